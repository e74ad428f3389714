#!/usr/bin/env python3
"""Record llama.cpp's tokenizer and greedy-decoding behaviour on the real test models as JSON
fixtures, so the Rust tokenizer and engine can be checked against llama.cpp without a Python ML
stack (CI reads only the committed JSON).

For each model, tests/fixtures/llamacpp/<model>.json holds:
  - the model file's sha256, vocabulary size, BOS/EOS, add_bos, the end-of-generation id set;
  - prompts with llama.cpp's token ids for (add_special=True, parse_special=False) and
    (add_special=True, parse_special=True)  [llama_tokenize via Llama.tokenize, vocab_only];
  - token pieces (llama_token_to_piece, special False/True) for a sample of ids;
  - the chat template rendered with jinja2 the way Hugging Face renders it, and its ids;
  - greedy continuations: prompt ids, greedy ids (argmax each step, manual eval loop), the top-5
    (id, logit) pairs of every step, the full logits of the first generated position (6
    significant digits), llama_detokenize of the greedy ids (remove_special=False,
    unparse_special=False) and the plain concatenation of their pieces.

Usage (the pyref venv has llama-cpp-python 0.3.36, jinja2, numpy):
    scripts/fetch-models.sh
    /root/.cache/gpu-offload/pyref/bin/python scripts/llamacpp_reference.py
Options: --models-dir DIR (default: $GPU_OFFLOAD_MODELS or ~/.cache/gpu-offload/models),
         --shared-models DIR (default: $GPU_OFFLOAD_SHARED_MODELS or ../shared/models),
         --out DIR (default: tests/fixtures/llamacpp).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import random
import sys
import tempfile
from pathlib import Path

import llama_cpp
import numpy as np
from llama_cpp import Llama

ROOT = Path(__file__).resolve().parent.parent
N_THREADS = 2
N_CTX = 512
TOP_K = 5

# Prompts every model is tokenized with: ASCII, accents, CJK, emoji (incl. a ZWJ sequence), code with
# tabs and indentation, leading and repeated spaces, empty lines, numbers, contractions, symbols,
# Unicode spaces and marks, and the empty string.
COMMON_PROMPTS = [
    "Hello world",
    "Once upon a time, there was a little girl named Lily.",
    "The quick brown fox jumps over the lazy dog. 123abc456",
    " leading space",
    "  two leading spaces",
    "   multiple   spaces   between   words   ",
    "\tTabbed line",
    "Hello\n\nWorld\n",
    "\n\n\n",
    "line1\nline2\r\nline3",
    "x",
    " ",
    "\n",
    "12345 and 3.14159 and 1,000,000 and 007",
    "def foo(x):\n\tif x > 0:\n\t\treturn x * 2\n    return -x  # comment\n",
    "fn main() {\n    let v: Vec<u32> = (0..10).collect();\n    println!(\"{:?}\", v);\n}\n",
    "naïve café résumé Ünïcödé",
    "日本語のテキスト 中文测试 한국어",
    "emoji 🎉🚀 and 👨‍👩‍👧 family",
    "It's a dog's life; they're here, we've won, I'm sure, you'll see, he'd go.",
    "IT'S ALL CAPS DON'T",
    "Ω≈ç√∫ ¡™£¢∞§¶•ªº–≠ ½ ² Ⅻ ﬁ",
    "a\u00a0b\u2003c\u3000d",
    "zero\u200bwidth and mark e\u0301",
    "مرحبا بالعالم नमस्ते दुनिया",
    "supercalifragilisticexpialidocious",
    "new in Unicode 16: \U00010d40\U00010d41 \U000105c0 \u1c89 \ua7cb",
    "<0x41> looks like a byte token",
    "",
]

# Pieces random prompts are built from: the classes the pre-tokenizers treat differently, special
# token texts (whole and broken), contractions in both cases, Unicode spaces, marks, numbers of
# other scripts and code points assigned after llama.cpp's Unicode tables.
RANDOM_PIECES = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789") + [
    " ", " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", "\r", "'", "'s", "'t", "'re", "'ve", "'ll",
    "'d", "'m", "'S", "'T", "'RE", "'LL", ".", ",", "!", "?", ";", ":", "-", "_", "(", ")", "[", "]",
    "{", "}", "<", ">", "=", "+", "$", "^", "~", "|", "`", '"', "#", "%", "&", "*", "/", "\\", "@",
    "é", "ñ", "ü", "ß", "Ω", "ж", "中", "文", "日本", "한", "😀", "🎉", "👨\u200d👩\u200d👧", "\u0301",
    "\u200b", "\u00a0", "\u3000", "\u2003", "\u0085", "\u2028", "½", "²", "Ⅻ", "٣", "३", "ﬁ", "ﾐ",
    "\u0378", "\ue000", "\U0010fffd", "\U00010d40", "\U000105c0", "\u1c89", "\U0002ebf0", "مرحبا",
    "नमस्ते", "สวัสดี", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<s>", "</s>", "<unk>", "<0x41>",
    "<fim_prefix>", "<reponame>", "<|im_start", "im_end|>", "the", " the", "Hello", " world", "123",
    "4567", "1,000", "3.14", "don't", "IT'S", "    return", "\tif", " ?", " !", " .", " ,", " ' ",
    " 's", " 're", " 've", " 'll", " 'd",
]
N_RANDOM = 150


def random_prompts(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(RANDOM_PIECES) for _ in range(rng.choice([1, 2, 3, 5, 8, 13, 21, 34])))
            for _ in range(n)]


# Other pre-tokenizers llama.cpp would apply to the SmolLM2 vocabulary (same tokens and merges,
# `tokenizer.ggml.pre` changed in a vocab-only copy): covers the GPT-2, Llama 3, Qwen2, default and
# Falcon splitters, ignore_merges, and the detokenizer's space clean-up.
PRE_VARIANTS = ["default", "gpt-2", "starcoder", "llama3", "qwen2", "falcon", "dbrx", "chatglm-bpe"]

MODELS = {
    "stories260K": {
        "file": "stories260K-f32.gguf",
        "shared": True,
        "prompts": COMMON_PROMPTS
        + [
            "<s>Hello</s> world",
            "<unk> and <s>",
            "Lily<s>",
        ],
        "greedy": [
            {"prompt": "Once upon a time", "parse_special": False},
            {"prompt": "Lily and Tom went to the park", "parse_special": False},
            {"prompt": "The little dog", "parse_special": False},
        ],
        "n_new": 64,
        "chat": None,
        "random_seed": 260,
        "pre_variants": [],
    },
    "SmolLM2-135M-Instruct.Q4_1": {
        "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "shared": False,
        "prompts": COMMON_PROMPTS
        + [
            "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n",
            "<|im_start|>user",
            "hello<|endoftext|>world",
            "text <|im_end|> more",
            "<reponame>x<file_sep>y",
        ],
        "greedy": [
            {"prompt": "The capital of France is", "parse_special": False},
            {
                "prompt": "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
                "parse_special": True,
            },
            {"prompt": "def fibonacci(n):", "parse_special": False},
            {"prompt": "Once upon a time", "parse_special": False},
            {"prompt": "The best way to learn a new language is", "parse_special": False},
            {
                "prompt": "<|im_start|>user\nName three primary colors.<|im_end|>\n<|im_start|>assistant\n",
                "parse_special": True,
            },
            {"prompt": "import numpy as np\n", "parse_special": False},
            {"prompt": "In 1492, Columbus", "parse_special": False},
        ],
        "n_new": 32,
        "random_seed": 135,
        "pre_variants": PRE_VARIANTS,
        "chat": [
            {"role": "user", "content": "Hi there!"},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Tell me a joke."},
        ],
    },
}


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sig6(x: float) -> float:
    return float(f"{x:.6g}")


def detokenize(vocab, ids: list[int]) -> bytes:
    """llama.cpp's own llama_detokenize (remove_special=False, unparse_special=False); the
    high-level Llama.detokenize is a Python re-implementation with different space handling."""
    arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
    size = 64 + 64 * len(ids)
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, size, False, False)
    if n < 0:
        raise RuntimeError(f"detokenize needs {-n} bytes")
    return buf.raw[:n]


def piece(vocab, tid: int, special: bool) -> bytes:
    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_token_to_piece(vocab, tid, buf, 256, 0, special)
    if n < 0:
        raise RuntimeError(f"piece of {tid} needs {-n} bytes")
    return buf.raw[:n]


def text_field(b: bytes) -> dict:
    """Bytes as JSON: the lossy text plus the exact bytes in hex (pieces may be partial UTF-8)."""
    return {"text": b.decode("utf-8", errors="replace"), "hex": b.hex()}


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool,
                bos: str, eos: str) -> str:
    """Render the way transformers' apply_chat_template does (sandboxed jinja2, trim_blocks,
    lstrip_blocks, loop controls, raise_exception)."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg):
        raise RuntimeError(msg)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt,
        bos_token=bos, eos_token=eos)


def vocab_facts(llm: Llama) -> dict:
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    return {
        "vocab": vocab,
        "n_vocab": n_vocab,
        "bos": llama_cpp.llama_vocab_bos(vocab),
        "eos": llama_cpp.llama_vocab_eos(vocab),
        "add_bos": bool(llama_cpp.llama_vocab_get_add_bos(vocab)),
        "add_eos": bool(llama_cpp.llama_vocab_get_add_eos(vocab)),
        "eog": [t for t in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, t)],
    }


def sample_ids(n_vocab: int) -> list[int]:
    """Every id of a small vocabulary; the first 300 and every 97th of a large one."""
    if n_vocab <= 1024:
        return list(range(n_vocab))
    return sorted(set(range(300)) | set(range(300, n_vocab, 97)) | {n_vocab - 1})


def all_prompts(spec: dict) -> list[str]:
    return spec["prompts"] + random_prompts(spec["random_seed"], N_RANDOM)


def tokenization(llm: Llama, spec: dict, facts: dict) -> dict:
    cases = []
    for text in all_prompts(spec):
        b = text.encode("utf-8")
        cases.append({
            "text": text,
            "ids": llm.tokenize(b, add_bos=True, special=False),
            "ids_parse_special": llm.tokenize(b, add_bos=True, special=True),
        })
    vocab = facts["vocab"]
    pieces = [
        {"id": t, "piece": piece(vocab, t, False).hex(), "piece_special": piece(vocab, t, True).hex()}
        for t in sample_ids(facts["n_vocab"])
    ]
    return {"prompts": cases, "pieces": pieces}


def write_vocab_variant(src: Path, dest: Path, pre: str) -> None:
    """A vocab-only copy of `src` (every metadata key, no tensors) with tokenizer.ggml.pre = pre."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(src)
    writer = GGUFWriter(str(dest), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = pre if key == "tokenizer.ggml.pre" else field.contents()
        if field.types[0] == GGUFValueType.ARRAY:
            writer.add_key_value(key, value, field.types[0], sub_type=field.types[-1])
        else:
            writer.add_key_value(key, value, field.types[0])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def pre_variants(path: Path, spec: dict) -> list[dict]:
    """Ids (aligned with `prompts`) and llama_detokenize of the add_special ids, per pre-tokenizer."""
    out = []
    prompts = all_prompts(spec)
    with tempfile.TemporaryDirectory() as tmp:
        for pre in spec["pre_variants"]:
            dest = Path(tmp) / f"vocab-{pre}.gguf"
            write_vocab_variant(path, dest, pre)
            llm = Llama(model_path=str(dest), vocab_only=True, verbose=False)
            vocab = llama_cpp.llama_model_get_vocab(llm.model)
            ids = [llm.tokenize(t.encode(), add_bos=True, special=False) for t in prompts]
            ids_ps = [llm.tokenize(t.encode(), add_bos=True, special=True) for t in prompts]
            out.append({
                "pre": pre,
                "ids": ids,
                "ids_parse_special": ids_ps,
                "detokenized_hex": [detokenize(vocab, i).hex() for i in ids],
            })
            del llm
    return out


def chat_section(llm: Llama, spec: dict, facts: dict) -> dict | None:
    if not spec["chat"]:
        return None
    template = llm.metadata.get("tokenizer.chat_template")
    if not template:
        return None
    vocab = facts["vocab"]
    bos = piece(vocab, facts["bos"], True).decode() if facts["bos"] >= 0 else ""
    eos = piece(vocab, facts["eos"], True).decode() if facts["eos"] >= 0 else ""
    out = {"messages": spec["chat"], "bos_token": bos, "eos_token": eos, "renders": []}
    for agp in (True, False):
        text = render_chat(template, spec["chat"], agp, bos, eos)
        out["renders"].append({
            "add_generation_prompt": agp,
            "text": text,
            "ids_parse_special": llm.tokenize(text.encode(), add_bos=True, special=True),
        })
    return out


def greedy_ids(llm: Llama, prompt_ids: list[int], n: int) -> list[int]:
    llm.reset()
    llm.eval(prompt_ids)
    out = []
    for _ in range(n):
        t = int(np.argmax(np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)))
        out.append(t)
        llm.eval([t])
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# Other llama.cpp configurations, each as valid as the default: how long their greedy runs agree
# with the default's measures where the reference itself is numerically determined.
VARIANTS = {
    "f32_kv_cache": {"type_k": 0, "type_v": 0},
    "flash_attn": {"flash_attn": True},
}


def greedy(llm: Llama, spec: dict, case: dict, full_logits: bool) -> dict:
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    prompt_ids = llm.tokenize(case["prompt"].encode(), add_bos=True, special=case["parse_special"])
    llm.reset()
    llm.eval(prompt_ids)
    out_ids, steps, first_logits = [], [], None
    for step in range(spec["n_new"]):
        logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        top = np.argsort(-logits, kind="stable")[:TOP_K]
        steps.append([[int(t), sig6(float(logits[t]))] for t in top])
        if step == 0 and full_logits:
            first_logits = [sig6(float(x)) for x in logits]
        t = int(np.argmax(logits))
        out_ids.append(t)
        llm.eval([t])
    pieces = b"".join(piece(vocab, t, False) for t in out_ids)
    agreement = {
        name: common_prefix(out_ids, greedy_ids(v, prompt_ids, spec["n_new"]))
        for name, v in llm.variants.items()
    }
    res = {
        "prompt": case["prompt"],
        "parse_special": case["parse_special"],
        "prompt_ids": prompt_ids,
        "greedy_ids": out_ids,
        "top5": steps,
        "detokenized": text_field(detokenize(vocab, out_ids)),
        "pieces_concat": text_field(pieces),
        "llama_cpp_python_detokenize": text_field(llm.detokenize(out_ids)),
        "variant_agreement": agreement,
    }
    if first_logits is not None:
        res["first_logits"] = first_logits
    return res


def build(name: str, spec: dict, path: Path) -> dict:
    print(f"{name}: {path}", file=sys.stderr)
    tok_llm = Llama(model_path=str(path), vocab_only=True, verbose=False)
    facts = vocab_facts(tok_llm)
    fixture = {
        "model": spec["file"],
        "sha256": sha256_file(path),
        "size_bytes": path.stat().st_size,
        "llama_cpp_python": llama_cpp.__version__,
        "n_vocab": facts["n_vocab"],
        "bos": facts["bos"],
        "eos": facts["eos"],
        "add_bos": facts["add_bos"],
        "add_eos": facts["add_eos"],
        "eog": facts["eog"],
    }
    fixture.update(tokenization(tok_llm, spec, facts))
    fixture["chat"] = chat_section(tok_llm, spec, facts)
    del tok_llm
    fixture["pre_variants"] = pre_variants(path, spec)

    def load(**kw) -> Llama:
        return Llama(model_path=str(path), n_ctx=N_CTX, n_threads=N_THREADS,
                     n_threads_batch=N_THREADS, logits_all=True, verbose=False, **kw)

    llm = load()
    llm.variants = {name: load(**kw) for name, kw in VARIANTS.items()}
    # Full first-position logits for every case of a small vocabulary, for the first case only of a
    # large one (keeps the file well under 2 MB).
    small = facts["n_vocab"] <= 4096
    fixture["greedy"] = [greedy(llm, spec, c, small or i == 0) for i, c in enumerate(spec["greedy"])]
    fixture["notes"] = (
        "prompts: fixed cases, then random ones (seeded) from RANDOM_PIECES. "
        "ids: Llama.tokenize(text.encode(), add_bos=True, special=False); ids_parse_special: the "
        "same with special=True (llama_tokenize add_special=True, parse_special=False/True). "
        "pre_variants: the same prompts through a vocab-only copy of the model with "
        "tokenizer.ggml.pre replaced (ids aligned with prompts; detokenized_hex = "
        "llama_detokenize of each ids list). "
        "pieces: llama_token_to_piece(id, lstrip=0, special=False/True) as hex. greedy: manual "
        "argmax loop over Llama.eval with n_ctx=512, n_threads=2, logits_all=True; top5 holds "
        "[id, logit] per step; variant_agreement: for each other llama.cpp configuration "
        "(f32 KV cache; flash attention), how many greedy ids agree with this run's; first_logits is the full logits vector of the first generated "
        "position (6 significant digits; every case for a small vocabulary, the first case "
        "otherwise). detokenized: llama_detokenize(remove_special=False, unparse_special=False); "
        "pieces_concat: concatenated token pieces (special=False); llama_cpp_python_detokenize: "
        "Llama.detokenize (pieces, minus one leading space after BOS). chat: the GGUF "
        "chat_template rendered by jinja2 like transformers (trim_blocks, lstrip_blocks), and its "
        "ids with parse_special=True."
    )
    return fixture


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_models = os.environ.get("GPU_OFFLOAD_MODELS") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpu-offload" / "models")
    default_shared = os.environ.get("GPU_OFFLOAD_SHARED_MODELS") or str(ROOT.parent / "shared" / "models")
    ap.add_argument("--models-dir", default=default_models)
    ap.add_argument("--shared-models", default=default_shared)
    ap.add_argument("--out", default=str(ROOT / "tests" / "fixtures" / "llamacpp"))
    ap.add_argument("--only", help="one model name")
    args = ap.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, spec in MODELS.items():
        if args.only and args.only != name:
            continue
        base = Path(args.shared_models) if spec["shared"] else Path(args.models_dir)
        path = base / spec["file"]
        if not path.exists():
            hint = "" if spec["shared"] else " (run scripts/fetch-models.sh)"
            sys.exit(f"missing model {path}{hint}")
        fixture = build(name, spec, path)
        dest = out / f"{name}.json"
        tmp = dest.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(fixture, ensure_ascii=False, indent=None, separators=(",", ":")) + "\n")
        tmp.replace(dest)
        print(f"wrote {dest} ({dest.stat().st_size / 1e6:.2f} MB)", file=sys.stderr)


if __name__ == "__main__":
    main()
