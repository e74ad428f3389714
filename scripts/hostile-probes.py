#!/usr/bin/env python3
"""Hostile-input probes (issue 39): files, flags and HTTP requests a careless or hostile user
would try, each run under `timeout` and an address-space cap, classified as

    clean   a non-zero exit with an error message (or, where the input is a valid variant, a run)
    panic   a Rust panic (exit 101 / "panicked at")
    signal  killed by a signal (abort, segfault)
    hang    still running at the timeout
    wrong   exit 0 where the input is invalid, or output that cannot be right (NaN, changed
            output from an edit the store's checksums should have caught)

Usage: scripts/hostile-probes.py [--bin target/release/gpu-offload] [--only CATEGORY,...]
       [--flips N] [--json FILE]. Prints the table (probe x count x outcome); exit 1 when any
probe is not clean. Our own test models only (stories260K, the HF fixture).
"""

import argparse
import collections
import copy
import json
import math
import os
import random
import resource
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hostile_gguf as gg  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.environ.get("GPU_OFFLOAD_SHARED_MODELS", os.path.join(ROOT, "..", "shared", "models"))
STORIES = os.path.join(SHARED, "stories260K-f32.gguf")
HF = os.path.join(ROOT, "tests", "fixtures", "hf", "llama-gqa")
AS_LIMIT = 4 << 30
TIMEOUT = 10

results = collections.OrderedDict()  # category -> Counter of outcomes
examples = {}  # (category, "clean") -> first example
bad = []  # every probe that was not clean: (category, outcome, what)
args = None
WORK = None


def cap():
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))


def run(cmd, env=None, stdin=None, timeout=TIMEOUT):
    e = dict(os.environ)
    e.update({"RUST_LOG": "error", "GPU_OFFLOAD_MODELS": os.path.join(WORK, "cache")})
    if env:
        e.update(env)
    try:
        p = subprocess.run(cmd, capture_output=True, env=e, preexec_fn=cap, timeout=timeout,
                           stdin=stdin if stdin is not None else subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return "hang", None, b"", b""
    out, err = p.stdout, p.stderr
    if p.returncode < 0 or p.returncode in (134, 137, 139):
        return "signal", p.returncode, out, err
    if p.returncode == 101 or b"panicked at" in err:
        return "panic", p.returncode, out, err
    return ("ok" if p.returncode == 0 else "error"), p.returncode, out, err


def record(category, outcome, what):
    results.setdefault(category, collections.Counter())[outcome] += 1
    if outcome == "clean":
        examples.setdefault((category, outcome), what)
    else:
        bad.append((category, outcome, what))


def judge(category, what, res, valid=False, expect=None):
    """valid: the input is a legitimate variant (a run is fine); expect: the output a run must give
    when it succeeds (a run giving anything else is wrong)."""
    kind, rc, out, err = res
    if kind in ("hang", "signal", "panic"):
        record(category, kind, f"{what}: rc {rc} {err[-300:]!r}")
    elif kind == "error":
        msg = err.decode("utf-8", "replace").strip()
        record(category, "clean" if msg else "wrong", f"{what}: {msg[-200:]}")
    elif expect is not None and out != expect and not valid:
        record(category, "wrong", f"{what}: exit 0, output changed: {out[:80]!r}")
    elif b"nan" in out.lower() and b"logit" in out.lower():
        record(category, "wrong", f"{what}: NaN logits")
    elif valid or (expect is not None and out == expect):
        record(category, "clean", what)
    else:
        record(category, "wrong", f"{what}: exit 0 on invalid input: {out[:80]!r}")


def gen(model, extra=(), store=False):
    device = ["--device", "sim", "--gpu-mem", "1G"] if store else ["--device", "cpu"]
    return [args.bin, "run", "-m", model, *device, "--tokens", "1,2,3", "-n", "4",
            "--temperature", "0", *extra]


# ---------------------------------------------------------------- GGUF files


def gguf_truncations():
    data = open(STORIES, "rb").read()
    g = gg.Gguf(STORIES)
    cuts = sorted(set([0, 1, 3, 4, 7, 8, 15, 16, 23, 24, 31, 40, 100, 500, 1000, 5000,
                       g.header_end - 1, g.header_end, g.header_end + 1, len(data) - 1]
                      + [int(len(data) * f / 40) for f in range(1, 40)]))
    for c in cuts:
        p = os.path.join(WORK, "trunc.gguf")
        open(p, "wb").write(data[:c])
        judge("gguf: truncated", f"cut at {c}", run(gen(p)))


def gguf_flips(n):
    data = bytearray(open(STORIES, "rb").read())
    base = run(gen(STORIES))[2]
    header_end = gg.Gguf(STORIES).header_end
    rng = random.Random(39)
    for i in range(n):
        # half the flips in the header (where they change what the file says), half anywhere
        pos = rng.randrange(header_end) if i % 2 == 0 else rng.randrange(len(data))
        d = bytearray(data)
        d[pos] ^= 1 << rng.randrange(8)
        p = os.path.join(WORK, "flip.gguf")
        open(p, "wb").write(d)
        res = run(gen(p))
        cat = "gguf: byte flip in header" if pos < header_end else "gguf: byte flip in weights"
        # A GGUF carries no checksum: a flip that still parses is another valid model; what
        # must not happen is a panic, a signal, a hang or NaN.
        judge(cat, f"flip at {pos}", res, valid=True)
        if res[0] == "ok" and res[2] != base:
            record(cat + " (ran, output changed)", "clean", f"flip at {pos}")


def crafted_ggufs():
    """Each entry: name, edit(g) -> optional write kwargs, valid."""
    def kv(key, t, v):
        return lambda g: g.set(key, t, v)

    def drop(key):
        return lambda g: g.drop(key)

    def tensor_dims(name, dims):
        def f(g):
            g.tensor(name)[1] = dims
        return f

    def nan_in(name, value):
        def f(g):
            t = g.tensor(name)
            t[3] = struct.pack("<f", value) + t[3][4:]
        return f

    def drop_tensor(name):
        def f(g):
            g.tensors = [t for t in g.tensors if t[0] != name]
        return f

    def dup_tensor(name):
        def f(g):
            g.tensors.append(copy.deepcopy(g.tensor(name)))
        return f

    def big_array(n, et=gg.U8):
        return kv("general.junk", gg.ARRAY, (et, [0] * n))

    a = "llama."
    cases = [
        ("block_count 0", kv(a + "block_count", gg.U32, 0), False),
        ("block_count 1e9", kv(a + "block_count", gg.U32, 10**9), False),
        ("block_count 6 (one more than tensors)", kv(a + "block_count", gg.U32, 6), False),
        ("embedding_length 0", kv(a + "embedding_length", gg.U32, 0), False),
        ("embedding_length 4e9", kv(a + "embedding_length", gg.U32, 4 * 10**9), False),
        ("feed_forward_length 0", kv(a + "feed_forward_length", gg.U32, 0), False),
        ("head_count 0", kv(a + "attention.head_count", gg.U32, 0), False),
        ("head_count 7 (does not divide)", kv(a + "attention.head_count", gg.U32, 7), False),
        ("head_count_kv 0", kv(a + "attention.head_count_kv", gg.U32, 0), False),
        ("head_count_kv 3 (does not divide)", kv(a + "attention.head_count_kv", gg.U32, 3), False),
        ("head_count_kv 16 (> heads)", kv(a + "attention.head_count_kv", gg.U32, 16), False),
        ("rope dimension 0", kv(a + "rope.dimension_count", gg.U32, 0), False),
        ("rope dimension 7 (odd)", kv(a + "rope.dimension_count", gg.U32, 7), False),
        ("rope dimension 4096", kv(a + "rope.dimension_count", gg.U32, 4096), False),
        ("context_length 0", kv(a + "context_length", gg.U32, 0), False),
        ("rms eps 0", kv(a + "attention.layer_norm_rms_epsilon", gg.F32, 0.0), False),
        ("rms eps -1", kv(a + "attention.layer_norm_rms_epsilon", gg.F32, -1.0), False),
        ("rms eps NaN", kv(a + "attention.layer_norm_rms_epsilon", gg.F32, math.nan), False),
        ("rms eps inf", kv(a + "attention.layer_norm_rms_epsilon", gg.F32, math.inf), False),
        ("rope theta 0", kv(a + "rope.freq_base", gg.F32, 0.0), False),
        ("rope theta NaN", kv(a + "rope.freq_base", gg.F32, math.nan), False),
        ("rope theta -inf", kv(a + "rope.freq_base", gg.F32, -math.inf), False),
        # A factor without a scaling type is unused; 0 is llama.cpp's "no scaling".
        ("rope scale factor 0 (no type)", kv(a + "rope.scaling.factor", gg.F32, 0.0), True),
        ("rope scale factor NaN", kv(a + "rope.scaling.factor", gg.F32, math.nan), False),
        ("rope scale linear factor 0", lambda g: (g.set(a + "rope.scaling.type", gg.STRING,
                                                        "linear"),
                                                  g.set(a + "rope.scaling.factor", gg.F32, 0.0)),
         False),
        ("rope scaling type bogus", kv(a + "rope.scaling.type", gg.STRING, "bogus"), False),
        ("architecture missing", drop("general.architecture"), False),
        ("architecture empty", kv("general.architecture", gg.STRING, ""), False),
        ("block_count missing", drop(a + "block_count"), False),
        ("block_count as string", kv(a + "block_count", gg.STRING, "5"), False),
        ("block_count as f32", kv(a + "block_count", gg.F32, 5.0), True),
        ("tokens missing", drop("tokenizer.ggml.tokens"), False),
        ("tokens 511 of 512 rows", lambda g: g.set("tokenizer.ggml.tokens", gg.ARRAY,
                                                  (gg.STRING, g.get("tokenizer.ggml.tokens")[1][:-1])),
         False),
        ("tokens 600 for 512 rows", lambda g: g.set("tokenizer.ggml.tokens", gg.ARRAY,
                                                   (gg.STRING, g.get("tokenizer.ggml.tokens")[1]
                                                    + [f"x{i}" for i in range(88)])), False),
        ("scores shorter than tokens", lambda g: g.set("tokenizer.ggml.scores", gg.ARRAY,
                                                      (gg.F32, g.get("tokenizer.ggml.scores")[1][:10])),
         False),
        # Out-of-range special ids are ignored for the defaults, as llama.cpp does.
        ("bos id 99999", kv("tokenizer.ggml.bos_token_id", gg.U32, 99999), True),
        ("eos id 99999", kv("tokenizer.ggml.eos_token_id", gg.U32, 99999), True),
        ("tokenizer model bogus", kv("tokenizer.ggml.model", gg.STRING, "bogus"), False),
        ("unused metadata array of 40 MB (u8)", big_array(40 << 20), True),
        ("unused metadata array of 10M i64", big_array(10 << 20, gg.I64), True),
        ("unused metadata array of 4M strings", kv("general.junk", gg.ARRAY,
                                                   (gg.STRING, [""] * (4 << 20))), True),
        ("nested arrays", kv("general.junk", gg.ARRAY, (gg.ARRAY, [(gg.U8, [1, 2])] * 1000)),
         True),
        ("embedding 600 rows claimed", tensor_dims("token_embd.weight", [64, 600]), False),
        ("embedding 100 rows", tensor_dims("token_embd.weight", [64, 100]), False),
        ("attn_q wrong shape", tensor_dims("blk.0.attn_q.weight", [64, 32]), False),
        ("attn_q 3-D", tensor_dims("blk.0.attn_q.weight", [64, 64, 1]), True),
        ("ffn_up dims 2^62", tensor_dims("blk.0.ffn_up.weight", [1 << 31, 1 << 31]), False),
        ("tensor missing (ffn_down 3)", drop_tensor("blk.3.ffn_down.weight"), False),
        ("tensor duplicated", dup_tensor("blk.0.ffn_up.weight"), False),
        ("norm weight NaN", nan_in("blk.0.attn_norm.weight", math.nan), False),
        ("embedding weight inf", nan_in("token_embd.weight", math.inf), False),
        # A finite weight is a weight: its output is the model's, whatever it is.
        ("ffn_down weight 1e38", nan_in("blk.2.ffn_down.weight", 1e38), True),
        ("output_norm NaN", nan_in("output_norm.weight", math.nan), False),
    ]
    for name, edit, valid in cases:
        g = gg.Gguf(STORIES)
        try:
            edit(g)
        except StopIteration:
            continue
        p = os.path.join(WORK, "crafted.gguf")
        gg.write(g, p)
        judge("gguf: crafted metadata/tensors", name, run(gen(p)), valid=valid)
    lies = [
        ("tensor count 2^40", dict(tensor_count=1 << 40)),
        ("tensor count 2^63", dict(tensor_count=1 << 63)),
        ("kv count 2^40", dict(kv_count=1 << 40)),
        ("kv count 0", dict(kv_count=0)),
        ("tensor offset past the end", dict(offsets=[1 << 40] + [None] * 46)),
        ("tensor offset misaligned", dict(offsets=[3] + [None] * 46)),
    ]
    for name, kw in lies:
        g = gg.Gguf(STORIES)
        p = os.path.join(WORK, "lie.gguf")
        gg.write(g, p, **kw)
        judge("gguf: lying counts and offsets", name, run(gen(p)))
    # A string length past the end, and a huge one, in the first key.
    data = bytearray(open(STORIES, "rb").read())
    for n in (1 << 62, len(data), 1 << 33):
        d = bytearray(data)
        d[24:32] = struct.pack("<Q", n)
        p = os.path.join(WORK, "strlen.gguf")
        open(p, "wb").write(d)
        judge("gguf: lying counts and offsets", f"key length {n}", run(gen(p)))
    for version in (0, 1, 2, 4, 0xFFFFFFFF):
        d = bytearray(data)
        d[4:8] = struct.pack("<I", version)
        p = os.path.join(WORK, "ver.gguf")
        open(p, "wb").write(d)
        judge("gguf: lying counts and offsets", f"version {version}", run(gen(p)),
              valid=version in (2,))


# ---------------------------------------------------------------- HF directories


def hf_configs():
    base_cfg = json.load(open(os.path.join(HF, "config.json")))
    hostile = [0, -1, 1.5, 10**9, 2**64, None, "x", [], {}, True]
    numeric = ["hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers",
               "num_key_value_heads", "head_dim", "max_position_embeddings", "vocab_size",
               "rms_norm_eps", "rope_theta", "bos_token_id", "eos_token_id"]
    base = None
    for key in numeric + ["rope_scaling", "torch_dtype", "hidden_act", "model_type",
                          "architectures", "tie_word_embeddings"]:
        for v in hostile + ["delete"]:
            cfg = dict(base_cfg)
            if v == "delete":
                cfg.pop(key)
            else:
                cfg[key] = v
            d = os.path.join(WORK, "hf")
            shutil.rmtree(d, ignore_errors=True)
            shutil.copytree(HF, d)
            json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
            if base is None:
                base = run(gen(HF))[2]
            # rope_theta 1e9 / 1.5 and eps 1.5 are legitimate settings; a deleted optional key
            # takes its default. Everything else must be refused or leave the output unchanged.
            valid = (key in ("rope_theta", "rms_norm_eps") and v in (1.5, 10**9, 2**64)) or (
                key == "tie_word_embeddings" and v is True) or (
                key in ("max_position_embeddings",) and v in (10**9,)) or (
                v == "delete" and key in ("rope_theta", "rms_norm_eps", "head_dim", "rope_scaling",
                                          "torch_dtype", "tie_word_embeddings",
                                          "max_position_embeddings", "hidden_act", "bos_token_id",
                                          "eos_token_id", "num_key_value_heads"))
            judge("hf: config.json values", f"{key} = {v}", run(gen(d)), valid=valid,
                  expect=base)
    for name, text in [("empty", ""), ("not JSON", "{"), ("array", "[]"), ("NaN eps",
                       json.dumps(base_cfg).replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": NaN'))]:
        d = os.path.join(WORK, "hf")
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(HF, d)
        open(os.path.join(d, "config.json"), "w").write(text)
        judge("hf: config.json values", name, run(gen(d)))
    # safetensors header lies
    st = open(os.path.join(HF, "model.safetensors"), "rb").read()
    n = struct.unpack("<Q", st[:8])[0]
    for name, blob in [("header length 2^62", struct.pack("<Q", 1 << 62) + st[8:]),
                       ("header length past the end", struct.pack("<Q", len(st)) + st[8:]),
                       ("header not JSON", st[:8] + b"x" * n + st[8 + n:]),
                       ("empty file", b""), ("header only", st[:8 + n])]:
        d = os.path.join(WORK, "hf")
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(HF, d)
        open(os.path.join(d, "model.safetensors"), "wb").write(blob)
        judge("hf: safetensors", name, run(gen(d)))


# ---------------------------------------------------------------- stores


def manifest_edits():
    store = os.path.join(WORK, "store")
    res = run([args.bin, "convert", "-m", STORIES, "-o", store, "--copy", "--force"], timeout=60)
    if res[0] != "ok":
        record("store: manifest edits", "wrong", f"convert failed: {res[3][-200:]!r}")
        return
    mpath = os.path.join(store, "manifest.json")
    original = open(mpath).read()
    base = run(gen(store, store=True))[2]

    def edits(v, path):
        if isinstance(v, bool):
            yield path, not v
        elif isinstance(v, (int, float)):
            for e in (v + 1, v - 1, v * 10, 0, -v if v else -1):
                yield path, type(v)(e) if isinstance(v, int) else float(e)
        elif isinstance(v, str):
            if v:
                c = "0" if v[-1] != "0" else "1"
                yield path, v[:-1] + c
            yield path, ""
        elif isinstance(v, list):
            for i, x in enumerate(v[:6]):
                yield path + [("del", i)], None
                yield from edits(x, path + [i])
        elif isinstance(v, dict):
            for k, x in v.items():
                yield path + [("del", k)], None
                yield from edits(x, path + [k])

    doc = json.loads(original)
    tried = 0
    for path, value in edits(doc, []):
        m = json.loads(original)
        node = m
        for p in path[:-1]:
            node = node[p]
        last = path[-1] if path else None
        if isinstance(last, tuple):
            del node[last[1]]
        else:
            node[last] = value
        open(mpath, "w").write(json.dumps(m, indent=1))
        tried += 1
        verify = run([args.bin, "convert", "--verify", store])
        res = run(gen(store, store=True))
        what = "/".join(str(p) for p in path) + f" = {value!r}"
        if verify[0] in ("panic", "signal", "hang"):
            judge("store: manifest edits (verify)", what, verify)
        if res[0] == "ok" and res[2] != base:
            record("store: manifest edits", "wrong", f"{what}: ran, output changed"
                   + ("" if verify[0] == "ok" else " (verify refused it)"))
        else:
            judge("store: manifest edits", what, res, valid=res[2] == base)
    open(mpath, "w").write(original)
    # data file damage
    data = os.path.join(store, "data.bin")
    blob = open(data, "rb").read()
    rng = random.Random(7)
    for i in range(40):
        d = bytearray(blob)
        pos = rng.randrange(len(d))
        d[pos] ^= 0x40
        open(data, "wb").write(d)
        judge("store: data.bin flips", f"flip at {pos}", run(gen(store, store=True)),
              expect=base)
    open(data, "wb").write(blob)
    for name, action in [("tokenizer deleted", lambda: os.remove(os.path.join(store, "tokenizer.gguf"))
                          if os.path.exists(os.path.join(store, "tokenizer.gguf")) else None),
                         ("data.bin truncated", lambda: open(data, "r+b").truncate(len(blob) // 2)),
                         ("data.bin empty", lambda: open(data, "wb").close()),
                         ("manifest empty", lambda: open(mpath, "w").close()),
                         ("manifest /dev/zero link", lambda: (os.remove(mpath),
                                                              os.symlink("/dev/zero", mpath)))]:
        action()
        judge("store: files damaged", name,
              run([args.bin, "convert", "--verify", store]))
        judge("store: files damaged", name + " (run)", run(gen(store, store=True)))
        shutil.rmtree(store)
        run([args.bin, "convert", "-m", STORIES, "-o", store, "--copy", "--force"], timeout=60)


# ---------------------------------------------------------------- flags and prompt files


def cli_flags():
    m = STORIES
    big = os.path.join(WORK, "big.txt")
    open(big, "w").write("once upon a time " * 180000)
    cases = [
        (["-n", "18446744073709551615"], False), (["-n", "-1"], False), (["-n", "0"], True),
        (["-n", "4294967296"], False), (["--ctx-size", "0"], False),
        (["--ctx-size", "18446744073709551615"], False), (["--ctx-size", "1"], False),
        (["-t", "0"], False), (["-t", "100000"], False), (["--gpu-mem", "-1"], False),
        (["--gpu-mem", "1e999"], False), (["--gpu-mem", "99999999999999999999G"], False),
        (["--gpu-mem", "NaN"], False), (["--device", "sim", "--gpu-mem", "1"], False),
        (["--prefill-step", "0"], False), (["--prefetch-window", "100000"], False),
        (["--sparsity-target", "NaN"], False), (["--sparsity-target", "2"], False),
        (["--temperature", "NaN"], False), (["--temperature", "-1"], False),
        (["--top-p", "2"], False), (["--top-k", "-5"], False), (["--seed", "-1"], False),
        (["--tokens", "600"], False), (["--tokens", "4294967296"], False),
        (["--tokens", ""], False), (["--tokens", "1,,2"], False),
    ]
    for extra, valid in cases:
        cmd = [args.bin, "run", "-m", m, "--device", "cpu", "--tokens", "1,2,3", "-n", "4"]
        cmd = cmd[:]
        # later flags override earlier ones in clap only for the same flag: put extras last
        judge("cli: flag values", " ".join(extra), run(cmd + extra), valid=valid)
    synth = [args.bin, "synth", "-o", os.path.join(WORK, "synth"), "--force", "--layers", "2",
             "--hidden", "64", "--ffn", "128", "--heads", "4", "--vocab", "256"]
    for extra in (["--vocab", "4294967295"], ["--layers", "1000000000"], ["--hidden", "0"],
                  ["--heads", "3"], ["--kv-heads", "3"], ["--power-law", "NaN"],
                  ["--power-law", "-1"], ["--shard-gib", "0"], ["--shard-gib", "NaN"],
                  ["--max-context", "0"], ["--ffn", "18446744073709551615"]):
        judge("cli: flag values", "synth " + " ".join(extra), run(synth + extra))
        leftovers = [f for f in os.listdir(WORK) if ".tmp." in f]
        if os.path.isdir(os.path.join(WORK, "synth")):
            leftovers += [f for f in os.listdir(os.path.join(WORK, "synth")) if ".tmp." in f]
        if leftovers:
            record("cli: flag values", "wrong", f"synth {extra}: left {leftovers}")
    grace = run([args.bin, "serve", "-m", m, "--device", "cpu", "--port", "0",
                 "--shutdown-grace", "NaN"], timeout=5)
    judge("cli: flag values", "serve --shutdown-grace NaN", grace)
    for name, extra in [("--prompt-file /dev/zero", ["--prompt-file", "/dev/zero"]),
                        ("--prompt-file /dev/urandom", ["--prompt-file", "/dev/urandom"]),
                        ("--prompt-file a directory", ["--prompt-file", "/tmp"]),
                        ("--prompt-file missing", ["--prompt-file", "/nonexistent/x"]),
                        ("prompt file of 3 MB", ["--prompt-file", big])]:
        judge("cli: prompt files", name,
              run([args.bin, "run", "-m", m, "--device", "cpu", "-n", "2"] + extra))
    jsonl = os.path.join(WORK, "in.jsonl")
    open(jsonl, "w").write('{"id":"a","tokens":[1,2,3]}\n')
    for name, cmd, valid in [
        ("prefill -i /dev/zero", ["-i", "/dev/zero", "-o", os.path.join(WORK, "o1.jsonl")], False),
        ("prefill -o equal to -i", ["-i", jsonl, "-o", jsonl], False),
        ("prefill record file /dev/zero", ["-i", None, "-o", os.path.join(WORK, "o2.jsonl")], True),
        ("prefill invalid UTF-8 line", ["-i", None, "-o", os.path.join(WORK, "o3.jsonl")], True),
    ]:
        if name == "prefill record file /dev/zero":
            p = os.path.join(WORK, "zero.jsonl")
            open(p, "w").write('{"id":"z","file":"/dev/zero"}\n{"id":"a","tokens":[1,2,3]}\n')
            cmd[1] = p
        if name == "prefill invalid UTF-8 line":
            p = os.path.join(WORK, "utf.jsonl")
            open(p, "wb").write(b'{"id":"u","prompt":"a\xff"}\n{"id":"a","tokens":[1,2,3]}\n')
            cmd[1] = p
        res = run([args.bin, "prefill", "-m", m, "--device", "cpu", "-n", "2"] + cmd)
        if valid and res[0] in ("ok", "error"):
            # per-record errors: the good record must have been answered
            out = cmd[3]
            good = os.path.exists(out) and '"id":"a"' in open(out, errors="replace").read().replace(" ", "")
            record("cli: prefill inputs", "clean" if good else "wrong",
                   name + ("" if good else f": the good record was lost (rc {res[1]})"))
        else:
            judge("cli: prefill inputs", name, res, valid=valid)


# ---------------------------------------------------------------- HTTP


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def http(port, method, path, body=None, headers=None, timeout=15):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method=method,
                                 headers=headers or {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read()
    except Exception as e:  # noqa: BLE001 — a probe records whatever happened
        if body is not None and "Broken pipe" in repr(e):
            # The server answered before reading the whole body and closed (an over-limit
            # Content-Length): read that answer as curl does, headers sent and the body held.
            return early_answer(port, method, path, len(body))
        return None, "", repr(e).encode()


def early_answer(port, method, path, length):
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {length}\r\n\r\n".encode())
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except OSError:
        pass
    s.close()
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    if not lines or len(lines[0].split()) < 2:
        return None, "", b"no answer before the body: " + data[:100]
    ctype = next((l.split(":", 1)[1].strip() for l in lines[1:]
                  if l.lower().startswith("content-type:")), "")
    return int(lines[0].split()[1]), ctype, rest


def http_probes():
    port = free_port()
    kvdir = os.path.join(WORK, "kv")
    env = dict(os.environ, RUST_LOG="error", GPU_OFFLOAD_MODELS=os.path.join(WORK, "cache"))
    srv = subprocess.Popen([args.bin, "serve", "-m", STORIES, "--device", "cpu", "--port",
                            str(port), "--kv-dir", kvdir, "--ctx-size", "256"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
                           preexec_fn=cap)
    for _ in range(100):
        if http(port, "GET", "/health", timeout=1)[0] == 200:
            break
        time.sleep(0.1)
    ok = {"model": "m", "prompt": "Once", "max_tokens": 2}
    bodies = [
        ("not JSON", b"{"), ("empty", b""), ("array", b"[]"), ("null", b"null"),
        ("prompt a number", json.dumps({"prompt": 5}).encode()),
        ("prompt 3 MB", json.dumps({"prompt": "a " * 1_500_000}).encode()),
        ("prompt 1.9 MB", json.dumps({"prompt": "once " * 380_000, "max_tokens": 1}).encode()),
        ("max_tokens 0", json.dumps(dict(ok, max_tokens=0)).encode()),
        ("max_tokens -1", json.dumps(dict(ok, max_tokens=-1)).encode()),
        ("max_tokens 2^64", b'{"prompt":"a","max_tokens":18446744073709551616}'),
        ("max_tokens 1e300", b'{"prompt":"a","max_tokens":1e300}'),
        ("max_tokens \"5\"", json.dumps(dict(ok, max_tokens="5")).encode()),
        ("temperature NaN", b'{"prompt":"a","temperature":NaN}'),
        ("temperature -1", json.dumps(dict(ok, temperature=-1)).encode()),
        ("temperature 1e308", json.dumps(dict(ok, temperature=1e308)).encode()),
        ("top_p 5", json.dumps(dict(ok, top_p=5)).encode()),
        ("stop x 100", json.dumps(dict(ok, stop=["x"] * 100)).encode()),
        ("stop 100 KB", json.dumps(dict(ok, stop=["x" * 100_000])).encode()),
        ("logit_bias 10k keys", json.dumps(dict(ok, logit_bias={str(i): 1 for i in range(10000)})).encode()),
        ("logit_bias key 99999", json.dumps(dict(ok, logit_bias={"99999": 1})).encode()),
        ("logit_bias NaN", b'{"prompt":"a","logit_bias":{"1":NaN}}'),
        ("n 1000", json.dumps(dict(ok, n=1000)).encode()),
        ("deep nesting", b'{"prompt":' + b"[" * 100000 + b"]" * 100000 + b"}"),
        ("prompt token ids out of range", json.dumps(dict(ok, prompt=[99999])).encode()),
        ("prompt token ids negative", json.dumps(dict(ok, prompt=[-1])).encode()),
        ("prompt empty", json.dumps(dict(ok, prompt="")).encode()),
        ("invalid UTF-8", b'{"prompt":"\xff\xfe"}'),
        ("lone surrogate", b'{"prompt":"\\ud800"}'),
    ]
    for name, body in bodies:
        for path in ("/v1/completions", "/v1/chat/completions"):
            if path.endswith("chat/completions") and body.startswith(b'{"prompt'):
                try:
                    d = json.loads(body)
                    d["messages"] = [{"role": "user", "content": d.pop("prompt")}]
                    body2 = json.dumps(d).encode()
                except Exception:  # noqa: BLE001
                    body2 = body
            else:
                body2 = body
            status, ctype, out = http(port, "POST", path, body2)
            what = f"{path} {name}: {status} {ctype} {out[:100]!r}"
            if status is None:
                record("http: request bodies", "hang" if b"timed out" in out else "signal", what)
            elif status >= 500:
                record("http: request bodies", "panic", what)
            elif status >= 400:
                record("http: request bodies", "clean" if "json" in ctype else "wrong", what)
            else:
                fine = name in ("max_tokens 0", "temperature 1e308", "prompt empty",
                                "prompt 1.9 MB", "lone surrogate", "logit_bias key 99999")
                record("http: request bodies", "clean" if fine else "wrong", what)
    # contexts
    for name, path, body in [
        ("id with ..", "/v1/contexts/..%2f..%2fetc", None),
        ("id 10 KB", "/v1/contexts/" + "a" * 10000, None),
        ("system prompt longer than the context", "/v1/contexts",
         json.dumps({"system": "once upon a time " * 400}).encode()),
        ("create body not JSON", "/v1/contexts", b"{"),
    ]:
        status, ctype, out = http(port, "POST" if body is not None else "GET", path, body)
        what = f"{name}: {status} {out[:100]!r}"
        if status is None or status >= 500:
            record("http: contexts", "panic" if status else "hang", what)
        else:
            record("http: contexts", "clean" if status >= 400 and "json" in ctype else "wrong",
                   what)
    # slow clients: a silent connection and a byte dripper must be closed by the server
    for name, drip in [("silent connection", None), ("header dripped a byte every 3 s", b"G")]:
        s = socket.create_connection(("127.0.0.1", port))
        s.settimeout(1)
        closed_at = None
        start = time.time()
        while time.time() - start < args.slow_seconds:
            try:
                if drip:
                    s.send(drip)
                data = s.recv(1)
                if data == b"" or data:
                    closed_at = time.time() - start
                    break
            except socket.timeout:
                time.sleep(2)
            except OSError:
                closed_at = time.time() - start
                break
        s.close()
        record("http: slow clients", "clean" if closed_at is not None else "hang",
               f"{name}: closed after {closed_at}")
    alive = srv.poll() is None
    srv.send_signal(signal.SIGTERM)
    try:
        srv.wait(10)
    except subprocess.TimeoutExpired:
        srv.kill()
    record("http: server survived", "clean" if alive else "signal", f"alive at end: {alive}")


CATEGORIES = {
    "truncate": gguf_truncations,
    "flips": lambda: gguf_flips(args.flips),
    "crafted": crafted_ggufs,
    "hf": hf_configs,
    "store": manifest_edits,
    "cli": cli_flags,
    "http": http_probes,
}


def main():
    global args, WORK
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "release", "gpu-offload"))
    ap.add_argument("--only", default=",".join(CATEGORIES))
    ap.add_argument("--flips", type=int, default=900)
    ap.add_argument("--slow-seconds", type=float, default=40)
    ap.add_argument("--json")
    ap.add_argument("--examples", action="store_true", help="print the first example of each outcome")
    args = ap.parse_args()
    WORK = tempfile.mkdtemp(prefix="hostile-")
    try:
        for c in args.only.split(","):
            CATEGORIES[c]()
    finally:
        shutil.rmtree(WORK, ignore_errors=True)
    outcomes = ["clean", "panic", "signal", "hang", "wrong"]
    print(f"| probe | count | {' | '.join(outcomes)} |")
    print("|---|---:|" + "---:|" * len(outcomes))
    total = collections.Counter()
    for cat, c in results.items():
        total.update(c)
        print(f"| {cat} | {sum(c.values())} | " + " | ".join(str(c[o]) for o in outcomes) + " |")
    print(f"| **all** | {sum(total.values())} | " + " | ".join(str(total[o]) for o in outcomes)
          + " |")
    for cat, o, ex in bad:
        print(f"- {o} in {cat}: {ex}")
    if args.examples:
        for (cat, o), ex in examples.items():
            if o == "clean":
                print(f"  clean in {cat}: {ex}")
    if args.json:
        json.dump({"results": {k: dict(v) for k, v in results.items()},
                   "not_clean": bad,
                   "examples": {f"{k[0]} / {k[1]}": v for k, v in examples.items()}},
                  open(args.json, "w"), indent=1)
    sys.exit(1 if any(total[o] for o in outcomes[1:]) else 0)


if __name__ == "__main__":
    main()
