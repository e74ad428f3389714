#!/usr/bin/env python3
"""Reference blocks from llama.cpp's own C code for tests/kquants.rs.

Writes tests/fixtures/quant/quantizers.json:
- `rows`: deterministic f32 rows (as bit patterns) of several shapes of data (normal, small
  uniform, outliers, all positive, sparse with an all-zero super-block, tiny, constant, heavy
  tailed), 512 values each;
- `quantized`: for Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and Q8_K, the bytes
  ggml's `quantize_row_<type>_ref` makes of each row (what llama-quantize writes without an
  importance matrix; Q8_K is the activation format of the K-quant dot products);
- `decoded`: random blocks of Q2_K and Q3_K (finite f16 scales of both signs) and ggml's
  `dequantize_row_<type>` of them, as f32 bit patterns (tests/fixtures/quant/blocks.json has
  the other types, from gguf-py).

The functions are called through ctypes in ggml's base library (libggml-base.so). The
llama-cpp-python package (PyPI, built from source: scripts/setup-pyref.sh) ships it in
`llama_cpp/lib/`; that is the default. Any build of ggml-base from the same llama.cpp works, e.g.
from the package's source distribution without building the rest:

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 && tar xzf llama_cpp_python-0.3.36.tar.gz
    cmake -S llama_cpp_python-0.3.36/vendor/llama.cpp -B build -DBUILD_SHARED_LIBS=ON -DCMAKE_BUILD_TYPE=Release
    cmake --build build --target ggml-base
    python3 scripts/quant_reference.py --ggml-lib build/bin/libggml-base.so

ggml-base is compiled for the baseline architecture (no FMA), so its float arithmetic is
exactly the C source's, and the bytes are the same on every x86-64 machine.
"""

import argparse
import ctypes
import importlib.util
import json
import os
import sys

import numpy as np

N = 512  # values per row (two K-quant super-blocks)

# name -> (GGML type id, values per block, bytes per block)
TYPES = {
    "Q8_0": (8, 32, 34),
    "Q4_0": (2, 32, 18),
    "Q4_1": (3, 32, 20),
    "Q5_0": (6, 32, 22),
    "Q5_1": (7, 32, 24),
    "Q2_K": (10, 256, 84),
    "Q3_K": (11, 256, 110),
    "Q4_K": (12, 256, 144),
    "Q5_K": (13, 256, 176),
    "Q6_K": (14, 256, 210),
    "Q8_K": (15, 256, 292),
}

# name -> byte offsets of the f16 scale fields, for the random decode blocks.
DECODE = {"Q2_K": [80, 82], "Q3_K": [108]}


def default_lib():
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "lib", "libggml-base.so")
    return path if os.path.exists(path) else None


def rows():
    rng = np.random.default_rng(20240607)
    sparse = np.where(rng.random(N) < 1 / 16, rng.normal(0, 1, N), 0.0)
    sparse[:256] = 0.0
    outliers = rng.normal(0, 0.02, N)
    outliers[rng.choice(N, 4, replace=False)] = [1.0, -1.0, 0.7, -0.9]
    out = {
        "normal": rng.normal(0, 1, N),
        "uniform_small": rng.uniform(-0.05, 0.05, N),
        "outliers": outliers,
        "positive": np.abs(rng.normal(0, 1, N)) + 0.5,
        "sparse": sparse,
        "tiny": rng.normal(0, 1e-6, N),
        "constant": np.full(N, 0.25),
        "heavy_tailed": rng.normal(0, 1, N) ** 3,
    }
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def f32_hex(a):
    return "".join(f"{v:08x}" for v in np.ascontiguousarray(a, dtype=np.float32).view(np.uint32))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ggml-lib", default=default_lib(), help="path of libggml-base.so")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "quant", "quantizers.json"))
    a = ap.parse_args()
    if not a.ggml_lib:
        sys.exit("no libggml-base.so: install llama-cpp-python (scripts/setup-pyref.sh) or pass --ggml-lib")
    lib = ctypes.CDLL(a.ggml_lib)
    fptr = ctypes.POINTER(ctypes.c_float)

    data = rows()
    quantized = {}
    for name, (type_id, block_len, block_bytes) in TYPES.items():
        fn = getattr(lib, f"quantize_row_{name.lower().replace('_k', '_K')}_ref")
        fn.argtypes = [fptr, ctypes.c_void_p, ctypes.c_int64]
        fn.restype = None
        per_row = {}
        for row, x in data.items():
            out = (ctypes.c_uint8 * (N // block_len * block_bytes))()
            fn(x.ctypes.data_as(fptr), out, N)
            per_row[row] = bytes(out).hex()
        quantized[name] = {"type_id": type_id, "block_len": block_len, "block_bytes": block_bytes, "rows": per_row}

    rng = np.random.default_rng(7)
    decoded = {}
    for name, scale_at in DECODE.items():
        type_id, block_len, block_bytes = TYPES[name]
        n_blocks = 4
        raw = bytearray(rng.integers(0, 256, n_blocks * block_bytes, dtype=np.uint8).tobytes())
        for b in range(n_blocks):
            for at in scale_at:
                sign = 1.0 if b == 0 else -1.0 if b == 1 else rng.choice([-1.0, 1.0])
                mag = 2.0 ** -20 if (b == 2 and at == scale_at[0]) else 2.0 ** rng.uniform(-12, 2)
                raw[b * block_bytes + at: b * block_bytes + at + 2] = np.float16(sign * mag).tobytes()
        fn = getattr(lib, f"dequantize_row_{name.lower().replace('_k', '_K')}")
        fn.argtypes = [ctypes.c_void_p, fptr, ctypes.c_int64]
        fn.restype = None
        n = n_blocks * block_len
        src = (ctypes.c_uint8 * len(raw)).from_buffer_copy(bytes(raw))
        y = np.zeros(n, dtype=np.float32)
        fn(src, y.ctypes.data_as(fptr), n)
        decoded[name] = {"type_id": type_id, "n": n, "bytes_hex": bytes(raw).hex(), "values_bits_hex": f32_hex(y)}

    doc = {
        "generator": "scripts/quant_reference.py (ggml's quantize_row_*_ref / dequantize_row_* via ctypes, "
        "llama.cpp as vendored by llama-cpp-python 0.3.36)",
        "n": N,
        "rows": {k: f32_hex(v) for k, v in data.items()},
        "quantized": quantized,
        "decoded": decoded,
    }
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
