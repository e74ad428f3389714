#!/usr/bin/env python3
"""Build kernels/host/decode_check.cpp with g++ and feed it the committed reference blocks
(tests/fixtures/quant/blocks.json from gguf-py, and the Q2_K/Q3_K decodes in quantizers.json from
ggml), so the kernels' block decoders are checked on a machine without a GPU."""
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CODES = {"Q8_0": 3, "Q4_0": 4, "Q4_1": 5, "Q5_0": 6, "Q5_1": 7,
         "Q2_K": 8, "Q3_K": 9, "Q4_K": 10, "Q5_K": 11, "Q6_K": 12}


def lines():
    fixtures = os.path.join(ROOT, "tests", "fixtures", "quant")
    with open(os.path.join(fixtures, "blocks.json")) as f:
        blocks = json.load(f)["types"]
    with open(os.path.join(fixtures, "quantizers.json")) as f:
        decoded = json.load(f)["decoded"]
    for name, t in list(blocks.items()) + list(decoded.items()):
        if name in CODES:
            yield f"{CODES[name]} {int(t['n'])} {t['bytes_hex']} {t['values_bits_hex']}\n"


def main():
    cxx = os.environ.get("CXX", "g++")
    with tempfile.TemporaryDirectory() as tmp:
        exe = os.path.join(tmp, "decode_check")
        subprocess.run([cxx, "-std=c++17", "-O1", "-ffp-contract=off", "-DKERNEL_HOST_CHECK",
                        "-I", os.path.join(ROOT, "kernels"), "-o", exe,
                        os.path.join(ROOT, "kernels", "host", "decode_check.cpp")], check=True)
        run = subprocess.run([exe], input="".join(lines()), text=True)
        sys.exit(run.returncode)


if __name__ == "__main__":
    main()
