#!/usr/bin/env bash
# The Python reference stack (developer machines only; CI needs none of it): a venv with
# llama-cpp-python built from source for this CPU (the llama.cpp peer and reference), and
# torch + transformers + gguf-py for scripts/reference.py. About 6 GB and 10 minutes on 2 cores.
#   scripts/setup-pyref.sh            -> ${GPU_OFFLOAD_PYREF:-~/.cache/gpu-offload/pyref}
set -euo pipefail
VENV="${GPU_OFFLOAD_PYREF:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-offload/pyref}"
python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" "$VENV/bin/pip" install --quiet llama-cpp-python==0.3.36
"$VENV/bin/pip" install --quiet torch==2.15.0 transformers==5.23.0 safetensors==0.8.0 gguf==0.19.0 numpy jinja2
echo "reference venv ready: $VENV/bin/python"
