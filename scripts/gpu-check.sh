#!/usr/bin/env bash
# On the GPU machine, from the repository root, with .gpu/ carried (scripts/gpu-build.sh made it
# on the development machine: that machine has the Rust toolchain, this one has CUDA):
#     scripts/gpu-check.sh [tests|bench|offload|all]
#   tests    every GPU parity test, then compute-sanitizer memcheck over the op tests
#   bench    doctor (bandwidths), matvec bandwidth vs device memory, full-GPU decode of a
#            synthesized 7B-shaped fp16 model vs its HBM bound and vs transformers, same call
#   offload  the 7B shape under --gpu-mem 4G: decode vs the PCIe bound and the plan's
#            prediction, vs transformers + accelerate offload at 4 GiB; then --dram-mem below
#            the model size (SSD tier) vs the SSD bound
#   serve    the HTTP server on CUDA: completions, a context swapped out and restored, HBM ledger
# Results: $OUT/results.jsonl (one JSON object per measurement) and $OUT/log.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE="${1:-all}"
OUT="${OUT:-$PWD/gpu-check-out}"
mkdir -p "$OUT"
LOG="$OUT/log.txt"
RES="$OUT/results.jsonl"
B="$PWD/.gpu/gpu-offload"
WORK="${GPU_CHECK_WORK:-/tmp/gpu-offload-check}"
mkdir -p "$WORK"
export GPU_OFFLOAD_REPO="$PWD" GPU_OFFLOAD_SHARED_MODELS="$PWD/.gpu/models" GPU_OFFLOAD_MODELS="${GPU_OFFLOAD_MODELS:-$WORK/models}"
export GPU_OFFLOAD_SKIP_MISSING_MODELS="${GPU_OFFLOAD_SKIP_MISSING_MODELS:-1}" GPU_OFFLOAD_REQUIRE_GPU=1
PY="${PYTHON:-python3}"
[[ -x "$B" ]] || { echo "gpu-check: .gpu/gpu-offload missing: run scripts/gpu-build.sh here and carry .gpu" | tee -a "$LOG"; exit 2; }

say() { echo "== $*" | tee -a "$LOG"; }
record() { # name, json
    printf '{"check":"%s","result":%s}\n' "$1" "$2" >> "$RES"
    echo "$1: $2" | tee -a "$LOG"
}

tests() {
    say "nvidia-smi"; nvidia-smi 2>&1 | head -15 | tee -a "$LOG"
    say "GPU parity tests"
    .gpu/gpu-tests --test-threads 1 --nocapture 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    record gpu_tests "{\"exit_code\":$rc}"
    if command -v compute-sanitizer >/dev/null; then
        say "compute-sanitizer memcheck (op tests and engines)"
        compute-sanitizer --tool memcheck --error-exitcode 9 .gpu/gpu-tests --test-threads 1 cuda_ops stories hf_fixtures offloaded 2>&1 | tail -25 | tee -a "$LOG"
        record memcheck "{\"exit_code\":${PIPESTATUS[0]}}"
    else
        record memcheck '{"skipped":"compute-sanitizer not on PATH"}'
    fi
}

synth7b() {
    if [[ ! -f "$WORK/m7b/config.json" ]]; then
        say "synthesizing a 7B-shaped fp16 model"
        "$B" synth --preset 7b -o "$WORK/m7b" --force 2>&1 | tee -a "$LOG"
    fi
}

bench() {
    say "doctor"
    "$B" doctor --save --json --ssd-dir "$WORK" > "$OUT/doctor.json" 2>>"$LOG"
    record doctor "$(cat "$OUT/doctor.json")"
    say "matvec bandwidth"
    for spec in "11008 4096 f16" "4096 11008 f16" "11008 4096 q4_1" "11008 4096 q8_0" "11008 4096 f16 8"; do
        set -- $spec
        record "matvec_${1}x${2}_${3}_n${4:-1}" "$("$B" bench matvec --device cuda --rows "$1" --cols "$2" --dtype "$3" --tokens "${4:-1}" --json 2>>"$LOG")"
    done
    synth7b
    say "full-GPU decode, 7B shape"
    record decode_7b_full_gpu "$("$B" bench decode --device cuda -m "$WORK/m7b" --prompt-tokens 32 -n 64 --json 2>>"$LOG")"
    say "transformers, same model, same call"
    record decode_7b_transformers "$($PY scripts/peer_hf.py "$WORK/m7b" --prompt-tokens 32 --tokens 64 2>>"$LOG" | tail -n1)"
    say "stories260K decode"
    record decode_stories_gpu "$("$B" bench decode --device cuda -m .gpu/models/stories260K-f32.gguf -n 128 --json 2>>"$LOG")"
}

offload() {
    synth7b
    say "plan, 7B shape at 4G"
    "$B" plan -m "$WORK/m7b" --gpu-mem 4G --ctx-size 1024 2>&1 | tee "$OUT/plan_7b_4g.txt" | tail -8 | tee -a "$LOG"
    say "offloaded decode, 7B shape, --gpu-mem 4G"
    record decode_7b_4g "$("$B" bench decode --device cuda -m "$WORK/m7b" --gpu-mem 4G --prompt-tokens 32 -n 16 --reps 2 --json 2>>"$LOG")"
    say "transformers + accelerate offload at 4 GiB, same call"
    record decode_7b_accelerate_4g "$(timeout 400 $PY scripts/peer_hf.py "$WORK/m7b" --prompt-tokens 32 --tokens 4 --max-gpu-mem 4GiB 2>>"$LOG" | tail -n1)"
    say "SSD tier: --dram-mem 6G (below the 13.5 GB model)"
    record decode_7b_4g_dram6g "$("$B" bench decode --device cuda -m "$WORK/m7b" --gpu-mem 4G --dram-mem 6G --prompt-tokens 32 -n 8 --reps 1 --json 2>>"$LOG")"
}

serve() {
    say "serve on CUDA (stories260K, --gpu-mem 64M): completions, a context swapped out and back, ledger in /metrics"
    "$B" serve --device cuda -m .gpu/models/stories260K-f32.gguf --gpu-mem 64M --port 18181 --parallel 1 \
        --kv-dir "$WORK/kv" --kv-compression off --ctx-size 256 > "$WORK/serve.out" 2>>"$LOG" &
    local pid=$!
    for _ in $(seq 100); do grep -q listening "$WORK/serve.out" 2>/dev/null && break; sleep 0.2; done
    record serve_cuda "$($PY - <<'PY' 2>>"$LOG"
import json, urllib.request as u
B = "http://127.0.0.1:18181"
def post(p, body):
    r = u.Request(B + p, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.load(u.urlopen(r))
g = lambda prompt, n: {"prompt": prompt, "max_tokens": n, "temperature": 0}
a = post("/v1/completions", g("Once upon a time", 32))["choices"][0]["text"]
c = post("/v1/contexts", {})["id"]
post(f"/v1/contexts/{c}/completions", g([1, 403, 407, 261, 378], 40))
post("/v1/completions", g("Lily", 40))  # takes the only slot: the context leaves the device
t = post(f"/v1/contexts/{c}/completions", g([13, 157], 20))["choices"][0]["text"]
info = json.load(u.urlopen(f"{B}/v1/contexts/{c}"))
# 5 prompt + 40 generated + 2 appended tokens: the same conversation sent whole.
ref = post("/v1/completions", g(info["token_ids"][:47], 20))
m = u.urlopen(B + "/metrics").read().decode()
hbm = [l for l in m.splitlines() if l.startswith('gpu_offload_ledger_bytes{kind="peak",tier="hbm"}')]
print(json.dumps({"completion": a, "restore": info["last_restore"], "hbm_peak": hbm, "context_matches_whole_prompt": ref["choices"][0]["text"] == t}))
PY
)"
    kill -TERM $pid; wait $pid
}

case "$MODE" in
    tests) tests ;;
    bench) bench ;;
    offload) offload ;;
    serve) serve ;;
    all) tests; serve; bench; offload ;;
    *) echo "usage: scripts/gpu-check.sh [tests|bench|offload|serve|all]"; exit 2 ;;
esac
say "done"
