#!/usr/bin/env bash
# Build, on this machine, what scripts/gpu-check.sh runs on the GPU machine (which has CUDA but
# no Rust toolchain): the release binary and the GPU test binary, kernels compiled to PTX by the
# pinned nvcc (scripts/check-kernels.sh installs it), plus stories260K. Everything goes to
# .gpu/ (git-ignored), which the device call carries:
#     scripts/gpu-build.sh   # here
#     device run: carry [".gpu"], command "scripts/gpu-check.sh all"
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/check-kernels.sh >/dev/null
VENV="${GPU_OFFLOAD_NVCC_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-offload/nvcc-venv}"
NVCC="$(find "$VENV" -path '*nvidia/cu13/bin/nvcc' | head -n1)"
export NVCC
cargo build --release --locked
json="$(cargo test --release --locked --test gpu --no-run --message-format=json 2>/dev/null)"
test_bin="$(printf '%s\n' "$json" | grep -o '"executable":"[^"]*gpu-[^"]*"' | tail -n1 | cut -d'"' -f4)"
[[ -x "$test_bin" ]] || { echo "gpu-build: no GPU test binary" >&2; exit 1; }
rm -rf .gpu && mkdir -p .gpu/models
cp target/release/gpu-offload .gpu/
cp "$test_bin" .gpu/gpu-tests
strip .gpu/gpu-offload .gpu/gpu-tests 2>/dev/null || true
shared="${GPU_OFFLOAD_SHARED_MODELS:-../shared/models}"
cp "$shared/stories260K-f32.gguf" .gpu/models/
du -sh .gpu
echo "gpu-build: ready; carry .gpu and run scripts/gpu-check.sh"
