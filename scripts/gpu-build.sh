#!/usr/bin/env bash
# Build, on this machine, what scripts/gpu-check.sh runs on the GPU machine (which has CUDA but
# no Rust toolchain): the release binary and the GPU test binary, kernels compiled to PTX by the
# pinned nvcc (scripts/check-kernels.sh installs it) for compute_90 (the lent H100 and H200:
# their kernels then wait for the grid before them, so --programmatic-launch runs there;
# CUDA_COMPUTE_CAP=80 builds what older cards load), plus stories260K. Everything goes to
# .gpu/ (git-ignored), which the device call carries:
#     scripts/gpu-build.sh   # here
#     device run: carry [".gpu"], command "scripts/gpu-check.sh all"
# With GPU_OFFLOAD_PEERS=1 it also packs the peer `gpu-check.sh peers` runs beside us: llama.cpp's
# source (from the llama-cpp-python source package on PyPI, trimmed to what a CUDA llama-bench
# build needs), under .gpu/peers/ (never committed).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/check-kernels.sh >/dev/null
VENV="${GPU_OFFLOAD_NVCC_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-offload/nvcc-venv}"
NVCC="$(find "$VENV" -path '*nvidia/cu13/bin/nvcc' | head -n1)"
export NVCC
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
cargo build --release --locked
json="$(cargo test --release --locked --test gpu --no-run --message-format=json 2>/dev/null)"
test_bin="$(printf '%s\n' "$json" | grep -o '"executable":"[^"]*gpu-[^"]*"' | tail -n1 | cut -d'"' -f4)"
[[ -x "$test_bin" ]] || { echo "gpu-build: no GPU test binary" >&2; exit 1; }
rm -rf .gpu && mkdir -p .gpu/models
cp target/release/gpu-offload .gpu/
echo "compute_$CUDA_COMPUTE_CAP" > .gpu/ptx-arch
cp "$test_bin" .gpu/gpu-tests
strip .gpu/gpu-offload .gpu/gpu-tests 2>/dev/null || true
shared="${GPU_OFFLOAD_SHARED_MODELS:-../shared/models}"
cp "$shared/stories260K-f32.gguf" .gpu/models/
if [[ "${GPU_OFFLOAD_PEERS:-0}" == 1 ]]; then
    mkdir -p .gpu/peers
    tmp="$(mktemp -d)"
    # The sdist straight from the package index (pip download would build its build tools to
    # read metadata), checked against the index's sha256.
    python3 - "$tmp" <<'PY'
import hashlib, re, sys, urllib.request
name = "llama_cpp_python-0.3.36.tar.gz"
page = urllib.request.urlopen("https://pypi.org/simple/llama-cpp-python/").read().decode()
url, sha = re.search(r'href="([^"#]*/' + re.escape(name) + r')#sha256=([0-9a-f]+)"', page).groups()
data = urllib.request.urlopen(url).read()
assert hashlib.sha256(data).hexdigest() == sha, "sha256 mismatch"
open(f"{sys.argv[1]}/{name}", "wb").write(data)
PY
    tar -xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
    src="$(find "$tmp" -maxdepth 3 -type d -path '*vendor/llama.cpp' | head -n1)"
    rm -rf "$src"/{models,docs,media,tests,benches,tools/ui}
    find "$src/ggml/src" -maxdepth 1 -type d -name 'ggml-*' ! -name 'ggml-cuda' ! -name 'ggml-cpu' -exec rm -rf {} +
    tar -czf .gpu/peers/llama.cpp.tgz -C "$(dirname "$src")" llama.cpp
    rm -rf "$tmp"
fi
du -sh .gpu
echo "gpu-build: ready; carry .gpu and run scripts/gpu-check.sh"
