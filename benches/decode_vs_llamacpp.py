#!/usr/bin/env python3
"""Decode speed of gpu-offload next to llama.cpp, in one run, beside the DRAM bound.

Both engines get the same model file, the same prompt token ids, the same thread count, greedy
decoding of the same number of tokens, and run alternately (ours, llama.cpp, ours, ...) so
background noise hits both. llama.cpp is the `llama-cpp-python` package (built from source on
this machine with the vector extensions it enables, never AMX: scripts/setup-pyref.sh). The
bound is measured DRAM read bandwidth (`gpu-offload doctor`) divided by the bytes one decode step
reads (weights + KV cache, `run --json` memory field).

Usage (from the repository root, after `cargo build --release` and scripts/fetch-models.sh):
    scripts/setup-pyref.sh; PY=~/.cache/gpu-offload/pyref/bin/python
    $PY benches/decode_vs_llamacpp.py [--model M] [--threads 2] [--tokens 128] [--reps 5]
Prints a Markdown table and writes the raw figures as JSON with --json-out.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / "target" / "release" / "gpu-offload"


def default_model() -> Path:
    base = os.environ.get("GPU_OFFLOAD_MODELS") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "gpu-offload", "models"
    )
    return Path(base) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def ours(model, prompt_ids, threads, tokens):
    out = subprocess.run(
        [str(BIN), "run", "--model", str(model), "--tokens", ",".join(map(str, prompt_ids)),
         "--temperature", "0", "--ignore-eos", "-n", str(tokens), "-t", str(threads), "--json"],
        check=True, capture_output=True, text=True,
    ).stdout
    d = json.loads(out)
    return d["timings"]["decode_tokens_per_s"], d["memory"]["dram_read_bytes_per_token"], d["token_ids"]


def llamacpp_runner(model, threads):
    import numpy as np
    from llama_cpp import Llama

    # logits_all: llama-cpp-python keeps per-position scores only then (costs nothing per step).
    llm = Llama(model_path=str(model), n_ctx=1024, n_threads=threads, n_threads_batch=threads,
                logits_all=True, verbose=False)

    def run(prompt_ids, tokens):
        llm.reset()
        llm.eval(prompt_ids)
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out = [tok]
        t0 = time.perf_counter()
        # tokens - 1 single-token steps after the prompt, as `run` counts decode steps.
        for _ in range(tokens - 1):
            llm.eval([tok])
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            out.append(tok)
        return (tokens - 1) / (time.perf_counter() - t0), out

    return llm, run


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=default_model())
    ap.add_argument("--prompt", default="Once upon a time, in a small village by the sea,")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args()
    if not BIN.exists():
        sys.exit(f"{BIN} missing: run cargo build --release first")
    if not a.model.exists():
        sys.exit(f"{a.model} missing: run scripts/fetch-models.sh")

    doctor = json.loads(subprocess.run([str(BIN), "doctor", "--json", "-t", str(a.threads)],
                                       check=True, capture_output=True, text=True).stdout)
    dram = doctor["host"]["dram_read_bytes_per_s"]

    llm, theirs = llamacpp_runner(a.model, a.threads)
    prompt_ids = llm.tokenize(a.prompt.encode(), add_bos=True, special=False)

    ours_tps, theirs_tps = [], []
    bytes_per_token = None
    agree = None
    for _ in range(a.reps):
        tps, bpt, ids = ours(a.model, prompt_ids, a.threads, a.tokens)
        ours_tps.append(tps)
        bytes_per_token = bpt
        tps2, ids2 = theirs(prompt_ids, a.tokens)
        theirs_tps.append(tps2)
        agree = next((i for i, (x, y) in enumerate(zip(ids, ids2)) if x != y), len(ids))

    bound = dram / bytes_per_token
    o, t = statistics.median(ours_tps), statistics.median(theirs_tps)
    rows = [
        ("gpu-offload", o, ours_tps),
        ("llama.cpp (llama-cpp-python)", t, theirs_tps),
    ]
    print(f"model {a.model.name}, prompt {len(prompt_ids)} tokens, {a.tokens} greedy tokens, "
          f"{a.threads} threads, {a.reps} alternating runs (median)")
    print(f"DRAM read bandwidth {dram / 1e9:.1f} GB/s, {bytes_per_token / 1e6:.1f} MB read per token "
          f"-> bound {bound:.0f} tok/s")
    print()
    print("| engine | decode tok/s (median) | runs | of DRAM bound |")
    print("|---|---|---|---|")
    for name, med, runs in rows:
        print(f"| {name} | {med:.1f} | {', '.join(f'{r:.0f}' for r in runs)} | {med / bound:.0%} |")
    print()
    print(f"ratio gpu-offload / llama.cpp: {o / t:.2f}x; greedy ids agree for the first {agree} tokens")
    if a.json_out:
        a.json_out.write_text(json.dumps({
            "model": a.model.name, "threads": a.threads, "tokens": a.tokens,
            "prompt_tokens": len(prompt_ids), "dram_read_bytes_per_s": dram,
            "bytes_per_token": bytes_per_token, "bound_tokens_per_s": bound,
            "ours": ours_tps, "llamacpp": theirs_tps, "ratio": o / t, "greedy_agree": agree,
        }, indent=1))


if __name__ == "__main__":
    main()
