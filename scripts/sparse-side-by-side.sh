#!/usr/bin/env bash
# Streaming, hybrid execution and cache units side by side on the budgeted device: SmolLM2 as a
# neuron-bundled store at a budget its FFN does not fit (issue 37's CPU figures), oracle masks,
# the three modes alternated round by round in the same minutes (this machine's memory rate
# drifts by tens of percent within an hour: only runs taken together compare). Prints each
# run's decode tokens/s, its fraction of its own bound and the DRAM probe beside it, then each
# mode's median and, per round, whether hybrid and units each reach 0.7 of their bound and
# run faster than streaming.
#
#   scripts/sparse-side-by-side.sh [ROUNDS]      (default 3; about 40 s a round on 2 cores)
#
# Environment: GPU_OFFLOAD_BIN (default: target/release/gpu-offload, built if missing),
# GPU_MEM (default 48M), TOKENS (decode tokens a run, default 64), OUT (a directory for the
# runs' JSON; default a temporary one, removed). The store (convert --bundle-ffn, then profile
# --no-predictors on 300 random tokens) is made once under the model cache and reused.
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS="${1:-3}"
GPU_MEM="${GPU_MEM:-48M}"
TOKENS="${TOKENS:-64}"
BIN="${GPU_OFFLOAD_BIN:-target/release/gpu-offload}"
MODELS_DIR="${GPU_OFFLOAD_MODELS:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-offload/models}"
GGUF="$MODELS_DIR/SmolLM2-135M-Instruct.Q4_1.gguf"
STORE="$MODELS_DIR/stores/smollm2-bundled"

log() { printf 'sparse-side-by-side: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || die "ROUNDS must be a positive whole number, not '$ROUNDS'"
[[ "$TOKENS" =~ ^[1-9][0-9]*$ ]] || die "TOKENS must be a positive whole number, not '$TOKENS'"
command -v python3 >/dev/null || die "python3 is needed to read the runs' JSON"

if [[ ! -x "$BIN" ]]; then
    log "building $BIN"
    cargo build --release --locked
fi
[[ -f "$GGUF" ]] || scripts/fetch-models.sh

# The bundled store and its profile, made once (each step into a temporary name, then moved:
# an interrupted run leaves no half-made store behind).
if [[ ! -f "$STORE/sparsity.profile" ]]; then
    log "making the bundled store $STORE (convert --bundle-ffn, then profile)"
    mkdir -p "$(dirname "$STORE")"
    tmp="$STORE.tmp.$$"
    rm -rf -- "$tmp"
    trap 'rm -rf -- "$tmp"' EXIT
    "$BIN" convert -m "$GGUF" -o "$tmp" --bundle-ffn --copy >&2
    "$BIN" profile -m "$tmp" --random-corpus --tokens 300 --no-predictors >&2
    rm -rf -- "$STORE"
    mv -- "$tmp" "$STORE"
    trap - EXIT
fi

if [[ -n "${OUT:-}" ]]; then
    mkdir -p "$OUT"
    runs="$OUT"
else
    runs="$(mktemp -d)"
    trap 'rm -rf -- "$runs"' EXIT
fi

# mode name, then its flags beside the common ones.
modes=(
    "stream|--cold stream"
    "hybrid|--cold cpu"
    "units|--cold gpu --neuron-precision fp16"
)
# Each round starts one mode later than the last (stream, hybrid, units; hybrid, units,
# stream; …), so no mode always runs first: in five runs of three rounds in one fixed order,
# units lost to streaming in all five first rounds and in 1 of the 10 others.
for ((r = 1; r <= ROUNDS; r++)); do
    for ((i = 0; i < ${#modes[@]}; i++)); do
        m="${modes[$(((r - 1 + i) % ${#modes[@]}))]}"
        name="${m%%|*}"
        read -r -a flags <<<"${m#*|}"
        log "round $r: $name"
        "$BIN" bench decode -m "$STORE" --device sim --gpu-mem "$GPU_MEM" --sparsity oracle \
            -n "$TOKENS" --json "${flags[@]}" >"$runs/$name-$r.json"
    done
done

python3 - "$runs" "$ROUNDS" <<'EOF'
import json, statistics, sys

runs, rounds = sys.argv[1], int(sys.argv[2])
modes = ["stream", "hybrid", "units"]
got = {m: [json.load(open(f"{runs}/{m}-{r}.json")) for r in range(1, rounds + 1)] for m in modes}

print(f"{'round':>5} " + " ".join(f"{m + ' tok/s (fraction, DRAM GB/s)':>34}" for m in modes) + "  hybrid/units ≥ 0.7 and > stream")
for r in range(rounds):
    cells, d = [], {m: got[m][r] for m in modes}
    for m in modes:
        cells.append(f"{d[m]['decode_tokens_per_s']:7.1f} ({d[m]['fraction_of_bound']:.3f}, "
                     f"{d[m]['rates']['dram_read_bytes_per_s'] / 1e9:4.1f})")
    holds = [d[m]["fraction_of_bound"] >= 0.7 and d[m]["decode_tokens_per_s"] > d["stream"]["decode_tokens_per_s"]
             for m in ("hybrid", "units")]
    print(f"{r + 1:>5} " + " ".join(f"{c:>34}" for c in cells) + "  " + " / ".join("yes" if h else "no" for h in holds))
print(f"{'median':>5} " + " ".join(
    f"{statistics.median(x['decode_tokens_per_s'] for x in got[m]):7.1f} ({statistics.median(x['fraction_of_bound'] for x in got[m]):.3f})".rjust(34)
    for m in modes))
EOF
