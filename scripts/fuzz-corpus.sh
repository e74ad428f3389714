#!/usr/bin/env bash
# Seed corpora for the fuzz targets (issue 39), generated, never copied from elsewhere:
# fuzz/corpus/<target>/seed-NN from a micro model the harness synthesizes (its GGUF, HF
# directory, store manifest), tests/fixtures (GGUF and HF files, tokenizer.json, cut to 64 KiB),
# hand-written chat templates, prefill records and request bodies (fuzz/src/targets.rs, `seeds`);
# plus the first 64 KiB of stories260K (its metadata and tokenizer) when the test model is here.
#
#   scripts/fuzz-corpus.sh [BINARY] [TARGET...]
# BINARY: a built gpu-offload-fuzz (scripts/fuzz.sh passes its own); default: build it, no AFL.
set -euo pipefail
cd "$(dirname "$0")/.."
bin="${1:-}"
[ $# -gt 0 ] && shift
if [ -z "$bin" ]; then
    export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}/fuzz-plain"
    cargo build --release --quiet --manifest-path fuzz/Cargo.toml --no-default-features
    bin="$CARGO_TARGET_DIR/release/gpu-offload-fuzz"
fi
targets=("$@")
[ ${#targets[@]} -eq 0 ] && mapfile -t targets < <("$bin" list)
for t in "${targets[@]}"; do
    "$bin" seeds "$t" "fuzz/corpus/$t"
done
stories="${GPU_OFFLOAD_SHARED_MODELS:-/work/shared/models}/stories260K-f32.gguf"
if [ -f "$stories" ] && [[ " ${targets[*]} " == *" gguf "* ]]; then
    head -c 65536 "$stories" > fuzz/corpus/gguf/seed-stories260k-head
fi
for t in "${targets[@]}"; do
    echo "fuzz/corpus/$t: $(ls "fuzz/corpus/$t" | wc -l) files, $(du -sk "fuzz/corpus/$t" | cut -f1) KiB"
done
