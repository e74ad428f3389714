#!/usr/bin/env python3
"""llama.cpp's logits and greedy tokens for the synthetic tiny mixture-of-experts model, as a
committed fixture (tests/fixtures/llamacpp/tiny-moe.json) CI checks the engine against.

The model is not committed: `gpu-offload synth --preset tiny-moe` writes it deterministically
(Qwen3-MoE, 2 layers, 8 experts of 256, top 2; f16, and Q4_K_M by llama.cpp's mix). The fixture
keeps each file's sha256, so a test whose synth no longer writes the same bytes says so instead
of comparing against another model.

Usage (the pyref venv has llama-cpp-python, numpy; scripts/setup-pyref.sh):
    cargo build --release
    /root/.cache/gpu-offload/pyref/bin/python scripts/llamacpp_moe_reference.py \\
        [--bin target/release/gpu-offload] [--out tests/fixtures/llamacpp/tiny-moe.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import tempfile
from pathlib import Path

import sys

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference import llamacpp_run  # noqa: E402  (f32 KV cache, no flash attention, 24 greedy)

ROOT = Path(__file__).resolve().parent.parent
PRESET = "tiny-moe"
POSITIONS = 16      # logits recorded at every one of the first POSITIONS ids


def sig6(x: float) -> float:
    return float(f"{float(x):.6g}")


def ids(n: int, mul: int, add: int, vocab: int) -> list[int]:
    """Fixed, spread-out token ids (no tokenizer involved)."""
    return [(i * mul + add) % vocab for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=str(ROOT / "target" / "release" / "gpu-offload"))
    ap.add_argument("--out", default=str(ROOT / "tests" / "fixtures" / "llamacpp" / "tiny-moe.json"))
    a = ap.parse_args()
    import llama_cpp

    models = []
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in ("f16", "q4_k_m"):
            path = Path(tmp) / f"{PRESET}-{dtype}.gguf"
            args = ["synth", "--preset", PRESET, "--dtype", dtype, "-o", str(path)]
            subprocess.run([a.bin, *args], check=True, capture_output=True)
            data = path.read_bytes()
            vocab = 320
            input_ids = ids(POSITIONS, 37, 5, vocab)
            prompt = ids(8, 53, 11, vocab)
            logits, gen = llamacpp_run(path, input_ids, prompt)
            models.append({
                "dtype": dtype,
                "synth_args": args[:-2],
                "sha256": hashlib.sha256(data).hexdigest(),
                "bytes": len(data),
                "input_ids": input_ids,
                "logits": [[sig6(x) for x in row] for row in logits],
                "greedy": {"prompt_ids": prompt, "generated_ids": gen},
            })
            print(f"{dtype}: {len(data)} bytes, greedy {gen}")
    doc = {
        "generator": "scripts/llamacpp_moe_reference.py (llama-cpp-python "
                     + llama_cpp.__version__ + ", CPU, f32 KV cache, no flash attention)",
        "model": f"gpu-offload synth --preset {PRESET} (seed 0)",
        "models": models,
    }
    out = Path(a.out)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")


if __name__ == "__main__":
    main()
