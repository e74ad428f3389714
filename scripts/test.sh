#!/usr/bin/env bash
# The whole test suite on a fresh clone: fetch the test models, then every unit and integration
# test (optimised test profile). Needs the Rust toolchain and python3 with pip.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-models.sh
cargo test --locked "$@"
