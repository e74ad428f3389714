#!/usr/bin/env bash
# The Python reference stack (developer machines only; CI needs none of it): a venv with
# llama-cpp-python built from source for this CPU (the llama.cpp peer and reference), and
# torch + transformers + gguf-py for scripts/reference.py. About 6 GB and 10 minutes on 2 cores.
#   scripts/setup-pyref.sh            -> ${GPU_OFFLOAD_PYREF:-~/.cache/gpu-offload/pyref}
set -euo pipefail
VENV="${GPU_OFFLOAD_PYREF:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-offload/pyref}"
python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
# The vector extensions named, not -march=native (GGML_NATIVE): these VMs' CPUs list AMX, which
# the VM does not enable, and a native build then dies of SIGILL in every evaluation. AVX2/FMA/F16C
# (and AVX-512 with VNNI where the CPU lists them, as our CPU kernels use them) never AMX.
flags="$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)"
has() { [[ " $flags " == *" $1 "* ]]; }
ext="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_BMI2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
ext="$ext -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
if has avx512f && has avx512bw && has avx512vl && has avx512_vnni; then
    ext="$ext -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON"
fi
CMAKE_ARGS="${CMAKE_ARGS:-$ext}" "$VENV/bin/pip" install --quiet llama-cpp-python==0.3.36
"$VENV/bin/pip" install --quiet torch==2.15.0 transformers==5.23.0 safetensors==0.8.0 gguf==0.19.0 numpy jinja2
echo "reference venv ready: $VENV/bin/python"
