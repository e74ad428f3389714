#!/usr/bin/env bash
# The whole test suite on a fresh clone: fetch the test models, then every unit and integration
# test (optimised test profile). Needs the Rust toolchain and python3 with pip.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-models.sh
# The official OpenAI Python client, for the serve test that drives it (a venv in the cache).
venv="${GPU_OFFLOAD_MODELS:-$HOME/.cache/gpu-offload/models}/../pyenv-openai"
if ! "$venv/bin/python" -c 'import openai' 2>/dev/null; then
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet openai==3.54.0
fi
export GPU_OFFLOAD_TEST_PYTHON="$venv/bin/python"
cargo test --locked "$@"
