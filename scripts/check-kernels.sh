#!/usr/bin/env bash
# Compile every kernels/*.cu to PTX with the pinned CUDA 13.0 nvcc from PyPI (no GPU needed),
# check the PTX ISA version is at most 9.0 (what the 13.0 driver loads), and assemble each for
# sm_90 with ptxas (built for compute_80 and for compute_90, where every kernel must wait for
# the grid before it), and for sm_75 (built for compute_75: Turing cards); then compile them again through NVRTC (the run-time path of builds made
# without nvcc) in the crate's own test; and build the block decoders for the host with g++ and
# check them against the reference dequantization (scripts/kernel_host_check.py), the bundle
# decoders against the store's (kernels/host/bundle_check.cpp), the flash, split and simple
# attention kernels against a naive attention (kernels/host/flash_check.cpp), the fused decode
# kernels against the ones they replace (kernels/host/fused_check.cpp), and the data-movement
# kernels (f16 tiles for cuBLAS, embedding rows, scattered rows) against plain loops
# (kernels/host/ops_check.cpp), and the bundle kernels against sums in double
# (kernels/host/bundles_check.cpp). The nvcc venv is cached in ${GPU_OFFLOAD_NVCC_VENV:-~/.cache/gpu-offload/nvcc-venv}.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${GPU_OFFLOAD_NVCC_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-offload/nvcc-venv}"
BIN="$VENV/lib/python3.11/site-packages/nvidia/cu13/bin"
if [[ ! -x "$BIN/nvcc" ]] || ! compgen -G "$VENV/lib/python3*/site-packages/nvidia/cu13/lib/libnvrtc.so*" >/dev/null; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 \
        nvidia-cuda-crt==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 \
        nvidia-cuda-nvrtc==13.0.88
fi
BIN="$(dirname "$(find "$VENV" -path '*nvidia/cu13/bin/nvcc' | head -n1)")"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
for cu in kernels/*.cu; do
    name="$(basename "$cu" .cu)"
    "$BIN/nvcc" --ptx -arch=compute_80 -O3 -I kernels "$cu" -o "$OUT/$name.ptx"
    version="$(grep -m1 '^\.version' "$OUT/$name.ptx" | awk '{print $2}')"
    if ! awk -v v="$version" 'BEGIN { exit !(v + 0 <= 9.0) }'; then
        echo "check-kernels: $cu: PTX ISA $version is newer than 9.0" >&2
        exit 1
    fi
    "$BIN/ptxas" -arch=sm_90 "$OUT/$name.ptx" -o "$OUT/$name.cubin"
    # Built for compute_90 (gpu-build.sh's default), every kernel waits for the grid before it
    # (griddepcontrol.wait: --programmatic-launch relies on it) and assembles for sm_90.
    "$BIN/nvcc" --ptx -arch=compute_90 -O3 -I kernels "$cu" -o "$OUT/$name.90.ptx"
    "$BIN/ptxas" -arch=sm_90 "$OUT/$name.90.ptx" -o "$OUT/$name.90.cubin"
    missing="$(awk '/\.entry /{ if (e != "" && !w) print e; e = $3; w = 0 } /griddepcontrol\.wait/{ w = 1 }
                    END { if (e != "" && !w) print e }' "$OUT/$name.90.ptx")"
    if [[ -n "$missing" ]]; then
        echo "check-kernels: $cu: kernels that do not wait for the grid before them: $missing" >&2
        exit 1
    fi
    # Built for Turing (compute_75: what NVRTC compiles for such a card at run time), the module
    # assembles for sm_75: nothing of Ampere's outside the kernels that trap there.
    "$BIN/nvcc" --ptx -arch=compute_75 -O3 -I kernels "$cu" -o "$OUT/$name.75.ptx"
    "$BIN/ptxas" -arch=sm_75 "$OUT/$name.75.ptx" -o "$OUT/$name.75.cubin"
    echo "check-kernels: $cu → PTX $version, ptxas sm_90 ok; for compute_90 every kernel waits; sm_75 ok"
done
python3 scripts/kernel_host_check.py
# The bundle decoders (kernels/bundle_codes.cuh) against the store's dequantizers, bit for bit,
# on bundles the store's encoder wrote (the crate's test writes them).
GPU_OFFLOAD_BUNDLE_FIXTURE="$OUT/bundles.txt" cargo test --locked --quiet --lib bundle_decode_fixture >/dev/null
"${CXX:-g++}" -std=c++17 -O1 -ffp-contract=off -DKERNEL_HOST_CHECK -I kernels -o "$OUT/bundle_check" \
    kernels/host/bundle_check.cpp
"$OUT/bundle_check" <"$OUT/bundles.txt"
# The flash prefill, split decode and simple attention kernels, each block run as host threads
# (the tensor-core product from the PTX fragment layouts), against a naive attention.
"${CXX:-g++}" -std=c++20 -O1 -pthread -fno-strict-aliasing -ffp-contract=off -DKERNEL_HOST_CHECK \
    -DKERNEL_HOST_SIMT -I kernels -o "$OUT/flash_check" kernels/host/flash_check.cpp
"$OUT/flash_check"
# The fused decode kernels (several weights per matvec launch, q and k rotated together, k and v
# stored together, the residual add in the norm, the norm inside the block-format products or
# writing their 8-bit activations) against the kernels they replace, bit for bit.
"${CXX:-g++}" -std=c++20 -O1 -pthread -fno-strict-aliasing -ffp-contract=off -DKERNEL_HOST_CHECK \
    -DKERNEL_HOST_SIMT -I kernels -o "$OUT/fused_check" kernels/host/fused_check.cpp
"$OUT/fused_check"
# dequant_f16, embed_rows, add_table_rows and scatter_rows against plain loops, bit for bit.
"${CXX:-g++}" -std=c++20 -O1 -pthread -fno-strict-aliasing -ffp-contract=off -DKERNEL_HOST_CHECK \
    -DKERNEL_HOST_SIMT -I kernels -o "$OUT/ops_check" kernels/host/ops_check.cpp
"$OUT/ops_check"
# The bundle kernels (eight elements a lane in the float encodings, one otherwise) against the
# same sums in double.
"${CXX:-g++}" -std=c++20 -O1 -pthread -fno-strict-aliasing -ffp-contract=off -DKERNEL_HOST_CHECK \
    -DKERNEL_HOST_SIMT -I kernels -o "$OUT/bundles_check" kernels/host/bundles_check.cpp
"$OUT/bundles_check" >"$OUT/bundles_check.log" || { cat "$OUT/bundles_check.log"; exit 1; }
tail -n 1 "$OUT/bundles_check.log"
LIB="$(dirname "$BIN")/lib"
LD_LIBRARY_PATH="$LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" GPU_OFFLOAD_REQUIRE_NVRTC=1 \
    cargo test --locked --quiet --lib nvrtc_compiles_every_module
echo "check-kernels: NVRTC compiled every module"
