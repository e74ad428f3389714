#!/usr/bin/env bash
# On the GPU machine, from the repository root, with .gpu/ carried (scripts/gpu-build.sh made it
# on the development machine: that machine has the Rust toolchain, this one has CUDA):
#     scripts/gpu-check.sh [tests|issue13|issue36|issue37|hybridcpu|issue38|dense|graphs|bench|offload|budgets|suite|peers|quant|serve|hybrid|units|prefill|batching|all]
#   tests    every GPU parity test (ops with f32/f16/q8_0 KV, the process budget as the driver
#            counts it, engines), then compute-sanitizer memcheck over the op tests
#   issue13  what issue 13 asks of the GPU, sized for one device call (~8 min; each run under a
#            timeout): `doctor --save` (the runs after it plan with this card's measured rates),
#            then `graphs` and `prefill`, on one synthesized 7B shape (32k context)
#   issue36  what issue 36 asks of the GPU, sized for one device call (≤ 8 min; each run under its
#            own timeout, results as JSON lines): the GPU tests; the whole GPU's memory.used
#            (nvidia-smi --query-gpu, not the per-process figure) against --gpu-mem at 2G/4G/8G
#            on the 7B shape; whole-GPU decode at 128 and 4000 positions (recorded steps, the
#            default, and launched); 7B Q4_K_M on the whole GPU and at 2G; stream and split at 4G
#            planned with rates measured at start (no saved profile) and after `doctor --save`,
#            prediction beside measurement; 1, 4 and 16 sequences at 4G under --cold auto
#   issue37  what issue 37 asks of the GPU, one device call (≤ 8 min; each run under its own
#            timeout): after `doctor --save`, the 7B ReLU power-law shape at 4G and the 1B one at
#            1600M, --cold stream/cpu/gpu with oracle masks, each traced (--trace: Chrome
#            trace-event JSON under $OUT, per-phase totals beside each phase's bound in the
#            JSON) beside the plan's prediction; hybrid and units with predictors on the 1B;
#            cache units (attention streamed at 4G) vs the whole GPU
#   hybridcpu  hybrid's CPU side on this host (issue 37, ~2 min): the f16 sparse kernels at the
#            7B shape's layer with 8 and 16 threads, then the 1B ReLU shape's hybrid decode at
#            1600M with 8, 12 and 16 CPU threads
#   issue38  mixture-of-experts models (issue 38), one device call (≤ 8 min at I38_LAYERS=48; each
#            run under its own timeout): the expert GPU tests (moe_ffn in every format, offloaded
#            tiny MoE vs the dense run), `doctor --save`, the Qwen3-30B-A3B shape in Q4_K_M
#            (I38_LAYERS of its 48 layers; ~18 GB whole) planned and decoded at 8G and 4G with
#            expert units (--cold gpu), every routed expert on the CPU (--cold cpu) and the plan's
#            choice, each with nvidia-smi's memory.used peak and the units' hit ratio beside the
#            bound; at 8G also every expert streamed (--cold stream), units without next-layer
#            prefetch and units with Q4_0 low-bit misses (I38_EXTRA=0: not these); prefill of 512 and 2048 tokens at 8G; llama.cpp (built by `peers`) on the same
#            file: -ngl 99 -ot exps=CPU and --n-cpu-moe N for N down from all layers while its
#            process fits 8G. I38_MIXTRAL=1 adds the Mixtral-8x7B shape at 8G (synthesis ~5 min)
#   dense    whole-GPU decode of the 7B shape: its three f16 matvec shapes beside the HBM read
#            bound, decode at 128 and 4000 positions, recorded (CUDA's default) and launched
#   graphs   recorded decode steps (--cuda-graphs, issue 13): the parity tests (the fused decode
#            kernels equal the ones they replace, recorded logits equal launched ones, and
#            programmatic launches plain ones, bit for bit), then decode tok/s and device
#            operations per decode step (expected 185 for the SmolLM2 shape, 261 for the 7B
#            shape), launched and recorded, each plain and with --programmatic-launch, on a
#            synthesized SmolLM2-135M-shaped Q4_1 GGUF and on the 7B shape (whole GPU) at 128
#            positions, and recorded (plain and programmatic) at 4000; before them the 7B shape's
#            f16 matvecs against the HBM read bound
#   prefill  whole-GPU prefill of the 7B shape (32k context) at 512/2048/4000 tokens beside
#            transformers, 4000 in one step and in steps of 512, the attention kernels alone
#            (bench attention), 8k and 32k prompts at --gpu-mem 4G (plan, nvidia-smi peak)
#   bench    doctor (bandwidths, read kernel, fixed device cost), matvec vs the device-memory
#            read bound (a fraction above 1.05 fails the bench), full-GPU decode of the 7B shape
#            (f16 KV) at 128 and 4000 positions vs its HBM bound and vs transformers, its
#            prefill of 512 and 2048 tokens (tensor-core attention)
#   offload  the 7B shape under --gpu-mem 4G: decode vs the PCIe bound and the plan's
#            prediction, vs transformers + accelerate offload at 4 GiB; then --dram-mem below
#            the model size (SSD tier) vs the SSD bound
#   budgets  the whole process inside --gpu-mem by nvidia-smi: the 7B shape at 2G/4G/8G with
#            and without --dram-mem 6G, the 1B shape at a quarter of its size (logits vs the
#            whole-GPU run), and the longest prompt the 7B shape takes at 4G with f16 KV
#   suite    `bench suite` on the 7B shape, emulating rtx4090-24g and rtx3060-12g (SUITE_CARDS=...
#            picks which, so each fits in one device call)
#   peers    llama.cpp (built from .gpu/peers, see gpu-build.sh) beside us: `bench suite` with
#            llama-bench at full offload and the largest -ngl that fits each budget
#   quant    quantized models (issue 10): 7B Q4_K_M whole GPU vs llama.cpp (when built by
#            `peers`), 7B Q4_K_M at --gpu-mem 2G and 13B Q4_K_M at 4G vs the PCIe bound, the
#            70B-shaped Q4_K_M at 24G with --dram-mem 32G (SSD tier) vs the SSD and PCIe bounds;
#            stores read the GGUFs in place (70B Q4_K_M is ~40 GB of a 64 GB disk)
#   serve    the HTTP server on CUDA: completions, a context swapped out and restored, HBM ledger
#   hybrid   issue 11: the 7B shape with ReLU and power-law 0.8 hot neurons (f16: attention streamed
#            beside the hot neurons; Q4_K_M), at 4G, profiled on random token ids; hybrid decode
#            (--cold cpu, oracle masks) vs dense offload (--cold stream) vs each bound and the
#            plan's prediction, the ILP's placement and solve time; parity: hybrid logits vs the
#            whole-GPU run (oracle masks); the
#            dense 7B shape at 4G with --cold split vs streaming, and vs llama.cpp (after `peers`)
# Results: $OUT/results.jsonl (one JSON object per measurement) and $OUT/log.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE="${1:-all}"
OUT="${OUT:-$PWD/gpu-check-out}"
mkdir -p "$OUT"
LOG="$OUT/log.txt"
RES="$OUT/results.jsonl"
B="$PWD/.gpu/gpu-offload"
GT="$PWD/.gpu/gpu-tests"
LB="${GPU_CHECK_LLAMA_BENCH:-/tmp/lbuild/bin/llama-bench}"
WORK="${GPU_CHECK_WORK:-/tmp/gpu-offload-check}"
mkdir -p "$WORK"
PY="${PYTHON:-python3}"
# GPU_CHECK_DRY=1: every step runs with stand-ins that record what they are given (gpu-offload,
# the GPU tests, python, llama-bench, the NVIDIA tools) under $OUT/dry. tests/gpu.rs
# (gpu_check_script_calls_only_what_exists) runs each mode so on any machine and holds the
# record to the CLI, the test names and the scripts: a wrong flag or a test filter that matches
# nothing shows in CI, not in a device call.
if [[ -n "${GPU_CHECK_DRY:-}" ]]; then
    export GPU_CHECK_DRY_DIR="$OUT/dry"
    mkdir -p "$GPU_CHECK_DRY_DIR/bin" "$GPU_CHECK_DRY_DIR/calls"
    stand_in() { # name, what it does after recording its arguments
        printf '#!/usr/bin/env bash\nprintf "%%s\\0" "$@" > "$(mktemp "$GPU_CHECK_DRY_DIR/calls/%s.XXXXXX")"\n%s\n' \
            "$1" "$2" > "$GPU_CHECK_DRY_DIR/bin/$1"
        chmod +x "$GPU_CHECK_DRY_DIR/bin/$1"
    }
    # What later steps read: the model synth writes, serve's "listening", a JSON value.
    stand_in gpu-offload 'o=; p=; for a in "$@"; do [[ "$p" == -o ]] && o="$a"; p="$a"; done
if [[ "$1" == synth && -n "$o" ]]; then
    if [[ "$o" == *.gguf ]]; then : > "$o"; else mkdir -p "$o" && echo "{}" > "$o/config.json"; fi
fi
[[ "$1" == serve ]] && echo listening
echo 0'
    stand_in gpu-tests 'echo "test result: ok (dry run)"'
    # Inline programs are compiled (not run); a script's flags are checked by the test.
    stand_in python 'case "$1" in
    -) python3 -c "import ast, sys; ast.parse(sys.stdin.read())" ;;
    -c) python3 -c "import ast, sys; ast.parse(sys.argv[1])" "$2" ;;
esac || echo "python: inline program does not compile: $*" >> "$GPU_CHECK_DRY_DIR/errors"
echo 0'
    # Its own options, then the program it checks.
    stand_in compute-sanitizer 'while [[ "$1" == --* ]]; do shift 2; done; exec "$@"'
    for t in nvidia-smi llama-bench cmake tar; do stand_in "$t" 'true'; done
    B="$GPU_CHECK_DRY_DIR/bin/gpu-offload" GT="$GPU_CHECK_DRY_DIR/bin/gpu-tests" PY="$GPU_CHECK_DRY_DIR/bin/python"
    LB="$GPU_CHECK_DRY_DIR/bin/llama-bench"
    export PATH="$GPU_CHECK_DRY_DIR/bin:$PATH"
fi
export GPU_OFFLOAD_REPO="$PWD" GPU_OFFLOAD_SHARED_MODELS="$PWD/.gpu/models" GPU_OFFLOAD_MODELS="${GPU_OFFLOAD_MODELS:-$WORK/models}"
export GPU_OFFLOAD_SKIP_MISSING_MODELS="${GPU_OFFLOAD_SKIP_MISSING_MODELS:-1}" GPU_OFFLOAD_REQUIRE_GPU=1
# Kernels built for compute_90 (gpu-build.sh's default) must take programmatic launch here.
PTX_ARCH="$(cat .gpu/ptx-arch 2>/dev/null || echo compute_80)"
[[ "${PTX_ARCH#compute_}" -ge 90 ]] && export GPU_OFFLOAD_REQUIRE_PROGRAMMATIC=1
[[ -x "$B" ]] || { echo "gpu-check: .gpu/gpu-offload missing: run scripts/gpu-build.sh here and carry .gpu" | tee -a "$LOG"; exit 2; }

say() { echo "== $*" | tee -a "$LOG"; }

# Run a command with stdout to $1, polling nvidia-smi every 0.2 s for the device memory of its
# process (by pid; where the process table shows other pids — a PID namespace — the sum over
# compute processes, the machine being ours); the peak (MiB) goes to $1.peak.
with_peak() {
    local out="$1"; shift
    "$@" > "$out" 2>>"$LOG" &
    local pid=$! peak=0 m
    while kill -0 "$pid" 2>/dev/null; do
        m="$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null \
            | awk -F', *' -v p="$pid" '$1==p {own=$2} {all+=$2} END {print (own != "" ? own : all + 0)}')"
        [[ -n "$m" && "$m" -gt "$peak" ]] && peak="$m"
        sleep 0.2
    done
    wait "$pid"; local rc=$?
    echo "$peak" > "$out.peak"
    return $rc
}
# Like with_peak, but the whole GPU's figure (nvidia-smi --query-gpu=memory.used, what a card
# of --gpu-mem must hold): the peak (MiB) to $1.peak, the idle figure before the run to $1.idle.
with_device_peak() {
    local out="$1"; shift
    local idle peak m
    idle="$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0 2>/dev/null | head -n1)"
    idle="${idle//[^0-9]/}"; idle="${idle:-0}"; peak="$idle"
    "$@" > "$out" 2>>"$LOG" &
    local pid=$!
    while kill -0 "$pid" 2>/dev/null; do
        m="$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0 2>/dev/null | head -n1)"
        m="${m//[^0-9]/}"
        [[ -n "$m" && "$m" -gt "$peak" ]] && peak="$m"
        sleep 0.1
    done
    wait "$pid"; local rc=$?
    echo "$peak" > "$out.peak"
    echo "$idle" > "$out.idle"
    return $rc
}
record() { # name, json
    printf '{"check":"%s","result":%s}\n' "$1" "$2" >> "$RES"
    echo "$1: $2" | tee -a "$LOG"
}

# Last-position logits of an offloaded run of a model (the flags after it) against the whole
# GPU's, oracle masks both: max |diff|, scale, argmax equal. Args: record name, model, flags.
parity_vs_whole() {
    local name=$1 model=$2
    shift 2
    "$B" logits --device cuda -m "$model" --sparsity oracle --tokens 1,45,200,7 --json > "$WORK/whole.json" 2>>"$LOG"
    "$B" logits --device cuda -m "$model" "$@" --sparsity oracle --tokens 1,45,200,7 --json > "$WORK/$name.json" 2>>"$LOG"
    record "$name" "$($PY - "$WORK/whole.json" "$WORK/$name.json" <<'PY'
import json, sys
a, b = (json.load(open(p))["logits"][-1] for p in sys.argv[1:3])
d = max(abs(x - y) for x, y in zip(a, b))
print(json.dumps({"max_abs_diff": d, "scale": max(abs(x) for x in a), "argmax_equal": a.index(max(a)) == b.index(max(b))}))
PY
)"
}

tests() {
    say "nvidia-smi"; nvidia-smi 2>&1 | head -15 | tee -a "$LOG"
    say "GPU parity tests"
    "$GT" --test-threads 1 --nocapture 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    record gpu_tests "{\"exit_code\":$rc}"
    if command -v compute-sanitizer >/dev/null; then
        say "compute-sanitizer memcheck (op tests and engines)"
        compute-sanitizer --tool memcheck --error-exitcode 9 "$GT" --test-threads 1 cuda_ops stories hf_fixtures offloaded recorded_decode 2>&1 | tail -25 | tee -a "$LOG"
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

synth1b() {
    if [[ ! -f "$WORK/m1b/config.json" ]]; then
        say "synthesizing a 1B-shaped fp16 model"
        "$B" synth --preset 1b -o "$WORK/m1b" --force 2>&1 | tee -a "$LOG"
    fi
}

# The machine measured and its profile saved where the planner looks first: the runs after it
# plan with this card's rates (PCIe, GEMM, the CPU's attention over a host-kept cache).
doctor_save() {
    say "doctor"
    "$B" doctor --save --json --ssd-dir "$WORK" > "$OUT/doctor.json" 2>>"$LOG"
    record doctor "$(cat "$OUT/doctor.json")"
}

bench() {
    doctor_save
    say "matvec bandwidth"
    for spec in "11008 4096 f16" "4096 11008 f16" "11008 4096 q4_1" "11008 4096 q8_0" "11008 4096 f16 8"; do
        set -- $spec
        record "matvec_${1}x${2}_${3}_n${4:-1}" "$("$B" bench matvec --device cuda --rows "$1" --cols "$2" --dtype "$3" --tokens "${4:-1}" --json 2>>"$LOG")"
    done
    synth7b
    say "full-GPU decode, 7B shape, f16 KV, at 128 and at 4000 positions"
    record decode_7b_full_gpu "$("$B" bench decode --device cuda -m "$WORK/m7b" --prompt-tokens 32 -n 64 --json 2>>"$LOG")"
    record decode_7b_full_gpu_4000 "$("$B" bench decode --device cuda -m "$WORK/m7b" --prompt-tokens 3968 -n 32 --reps 1 --json 2>>"$LOG")"
    say "full-GPU prefill, 7B shape, f16 KV, 512 and 2048 prompt tokens (prefill_tokens_per_s)"
    for p in 512 2048; do
        record "prefill_7b_full_gpu_$p" "$("$B" bench decode --device cuda -m "$WORK/m7b" --prompt-tokens "$p" -n 2 --reps 2 --json 2>>"$LOG")"
    done
    say "transformers, same model, same call"
    record decode_7b_transformers "$($PY scripts/peer_hf.py "$WORK/m7b" --prompt-tokens 32 --tokens 64 2>>"$LOG" | tail -n1)"
    say "stories260K decode"
    record decode_stories_gpu "$("$B" bench decode --device cuda -m .gpu/models/stories260K-f32.gguf -n 128 --json 2>>"$LOG")"
}

# A SmolLM2-135M-shaped Q4_1 GGUF (30 layers, 576 wide, 9 heads of 64, 3 KV heads, tied
# output, 49152 tokens): the real model is over what travels to this machine.
synthsmol() {
    if [[ ! -f "$WORK/smol-q4_1.gguf" ]]; then
        say "synthesizing a SmolLM2-135M-shaped Q4_1 GGUF"
        "$B" synth --preset tiny --layers 30 --hidden 576 --ffn 1536 --heads 9 --kv-heads 3 \
            --vocab 49152 --max-context 8192 --tied --dtype q4_1 --format gguf \
            -o "$WORK/smol-q4_1.gguf" --force 2>&1 | tail -n 2 | tee -a "$LOG"
    fi
}

# Decode on the 7B shape `$1` (the 4k one by default).
graphs() {
    local m="${1:-}"
    if [[ -z "$m" ]]; then
        synth7b
        m="$WORK/m7b"
    fi
    synthsmol
    say "fused decode kernels and recorded decode steps: parity with the launched kernels"
    timeout 300 "$GT" --test-threads 1 --nocapture cuda_ops::fused_ops recorded_decode programmatic_launch 2>&1 | tee -a "$LOG"
    record graphs_parity "{\"exit_code\":${PIPESTATUS[0]}}"
    say "the 7B shape's f16 matvecs (o, down, gate/up rows) beside the HBM read bound: a last wave of few blocks shows here"
    for spec in "4096 4096" "4096 11008" "11008 4096"; do
        set -- $spec
        record "matvec_${1}x${2}_f16" "$(timeout 60 "$B" bench matvec --device cuda --rows "$1" --cols "$2" --dtype f16 --json 2>>"$LOG")"
    done
    say "decode launched, recorded (--cuda-graphs), and both with --programmatic-launch, same call, side by side"
    local g name
    # Recorded steps are CUDA's default: "launched" asks for every kernel launched.
    for g in --no-cuda-graphs --cuda-graphs "--no-cuda-graphs --programmatic-launch" "--cuda-graphs --programmatic-launch"; do
        name="${g//--no-cuda-graphs/launched}"; name="${name//--/}"; name="${name// /_}"
        record "decode_smol_q4_1_$name" "$(timeout 120 "$B" bench decode --device cuda -m "$WORK/smol-q4_1.gguf" --prompt-tokens 32 -n 256 $g --json 2>>"$LOG")"
        record "decode_7b_full_gpu_$name" "$(timeout 150 "$B" bench decode --device cuda -m "$m" --prompt-tokens 32 -n 64 $g --json 2>>"$LOG")"
        # At 4000 positions, recorded steps only (the fastest way, beside the same with
        # programmatic launch): the attention's share of a step, not the launches, is the question.
        [[ "$g" == --cuda-graphs* ]] &&
            record "decode_7b_full_gpu_4000_$name" "$(timeout 150 "$B" bench decode --device cuda -m "$m" --prompt-tokens 3968 -n 32 --reps 1 $g --json 2>>"$LOG")"
    done
}

# Dense (whole-GPU) decode against the HBM bound, one JSON line a measurement: the 7B shape's f16
# matvecs (q/k/v/o 4096×4096, down 4096×11008, gate/up 11008×4096) beside the device-memory read
# bound, then its decode (f16 weights and KV) from 64 to 128 positions and from 3968 to 4000,
# recorded (CUDA's default) and launched (--no-cuda-graphs), in one call. For the coordinator to
# call from a mode (e.g. `dense) decode_dense ;;`).
decode_dense() {
    synth7b
    say "dense decode: the 7B shape's f16 matvecs beside the HBM read bound"
    local spec g name
    for spec in "4096 4096" "4096 11008" "11008 4096"; do
        set -- $spec
        record "dense_matvec_${1}x${2}_f16" "$(timeout 60 "$B" bench matvec --device cuda --rows "$1" --cols "$2" --dtype f16 --json 2>>"$LOG")"
    done
    say "dense decode: 7B shape whole GPU at 128 and 4000 positions, recorded and launched"
    for g in "" --no-cuda-graphs; do
        name="${g:+launched}"
        name="${name:-recorded}"
        record "dense_decode_7b_128_$name" "$(timeout 150 "$B" bench decode --device cuda -m "$WORK/m7b" --prompt-tokens 64 -n 64 $g --json 2>>"$LOG")"
        record "dense_decode_7b_4000_$name" "$(timeout 200 "$B" bench decode --device cuda -m "$WORK/m7b" --prompt-tokens 3968 -n 32 --reps 1 $g --json 2>>"$LOG")"
    done
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

budgets() {
    synth7b
    synth1b
    say "the whole process inside --gpu-mem (nvidia-smi peak beside the budget), 7B shape"
    local g d name
    for g in 2G 4G 8G; do
        for d in "" 6G; do
            name="budget_7b_${g}${d:+_dram$d}"
            with_peak "$WORK/$name.json" "$B" bench decode --device cuda -m "$WORK/m7b" --gpu-mem "$g" \
                ${d:+--dram-mem "$d"} --prompt-tokens 32 -n 8 --reps 1 --json
            record "$name" "{\"exit_code\":$?,\"gpu_mem\":\"$g\",\"nvidia_smi_peak_mib\":$(cat "$WORK/$name.json.peak"),\"bench\":$(cat "$WORK/$name.json" || echo null)}"
        done
    done
    # A quarter of 1B's 2.2 GB is below what the CUDA context alone holds (~0.6 GiB), so the
    # budget is a quarter of the weights on top of the measured fixed device cost.
    say "1B shape at a quarter of its size (plus the fixed device cost): logits against the whole-GPU run"
    local toks="1,306,4997,310,263,931,29892,727,471,263,2217,7826"
    with_peak "$WORK/l1b_full.json" "$B" logits --device cuda -m "$WORK/m1b" --tokens "$toks" --all-positions --json
    local fixed
    fixed="$("$B" doctor --json --ssd-test-mib 0 2>>"$LOG" | $PY -c 'import json,sys; print(json.load(sys.stdin)["profile"].get("device_fixed_bytes") or 805306368)')"
    # No figure (or none measured: the dry run's stand-in prints 0): the fixed cost seen so far.
    [[ "$fixed" =~ ^[0-9]+$ && "$fixed" -gt 0 ]] || fixed=805306368
    local quarter=$(( fixed + $(du -sb "$WORK/m1b" | cut -f1) / 4 ))
    with_peak "$WORK/l1b_quarter.json" "$B" logits --device cuda -m "$WORK/m1b" --gpu-mem "$quarter" --tokens "$toks" --all-positions --json
    local rc=$?
    record budget_1b_quarter "$($PY - "$WORK/l1b_full.json" "$WORK/l1b_quarter.json" "$quarter" "$(cat "$WORK/l1b_quarter.json.peak")" "$rc" <<'PY'
import json, sys
full, part, budget, peak, rc = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
try:
    a = json.load(open(full))["logits"]; b = json.load(open(part))["logits"]
    err = max(max(abs(x - y) for x, y in zip(ra, rb)) / max(abs(y) for y in ra) for ra, rb in zip(a, b))
except Exception as e:
    err = str(e)
print(json.dumps({"exit_code": rc, "gpu_mem_bytes": budget, "nvidia_smi_peak_mib": peak,
                  "within_budget": peak * 2**20 <= budget, "logits_max_relative_error": err}))
PY
)"
    say "the longest prompt the 7B shape takes at --gpu-mem 4G with f16 KV (plan), then run"
    local lo=512 hi=32768 mid
    while (( hi - lo > 256 )); do
        mid=$(( (lo + hi) / 2 ))
        if "$B" plan -m "$WORK/m7b" --gpu-mem 4G --ctx-size "$mid" --kv-type f16 >/dev/null 2>&1; then lo=$mid; else hi=$mid; fi
    done
    with_peak "$WORK/maxprompt.json" "$B" bench decode --device cuda -m "$WORK/m7b" --gpu-mem 4G --kv-type f16 \
        --prompt-tokens $(( lo - 2 )) -n 2 --reps 1 --json
    record max_prompt_7b_4g_f16 "{\"exit_code\":$?,\"max_ctx_planned\":$lo,\"nvidia_smi_peak_mib\":$(cat "$WORK/maxprompt.json.peak"),\"bench\":$(cat "$WORK/maxprompt.json" || echo null)}"
}

suite() {
    synth7b
    local card
    for card in ${SUITE_CARDS:-rtx4090-24g rtx3060-12g}; do
        say "bench suite on the 7B shape, emulating $card"
        "$B" bench suite --device cuda -m "$WORK/m7b" --emulate "$card" --out "$OUT/suite-$card" 2>>"$LOG"
        record "suite_$card" "{\"exit_code\":$?,\"files\":\"$(ls "$OUT/suite-$card" 2>/dev/null | tr '\n' ' ')\"}"
    done
}

peers() {
    synth7b
    local src=.gpu/peers/llama.cpp.tgz lb="$LB"
    if [[ ! -x "$lb" ]]; then
        [[ -f "$src" ]] || { record peers '{"skipped":"no .gpu/peers/llama.cpp.tgz (GPU_OFFLOAD_PEERS=1 scripts/gpu-build.sh)"}'; return; }
        say "building llama-bench (CUDA, sm_90) from the llama-cpp-python source package"
        rm -rf /tmp/llama.cpp && mkdir -p /tmp/llama.cpp && tar -xzf "$src" -C /tmp/llama.cpp --strip-components=1
        cmake -S /tmp/llama.cpp -B /tmp/lbuild -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF \
            -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF >>"$LOG" 2>&1 &&
            cmake --build /tmp/lbuild --target llama-bench -j 16 >>"$LOG" 2>&1
    fi
    if [[ ! -f "$WORK/m7b.gguf" ]]; then
        say "the 7B shape as an F16 GGUF for llama.cpp (the same model as the HF directory)"
        "$B" synth --preset 7b -o "$WORK/m7b.gguf" --force 2>&1 | tee -a "$LOG"
    fi
    say "bench suite with llama.cpp and transformers beside us"
    "$B" bench suite --device cuda -m "$WORK/m7b" --budgets whole,8G,4G,min --out "$OUT/suite-peers" \
        --llama-bench "$lb" --peer-gguf "$WORK/m7b.gguf" --peer-hf "$PY" 2>>"$LOG"
    record suite_peers "{\"exit_code\":$?,\"files\":\"$(ls "$OUT/suite-peers" 2>/dev/null | tr '\n' ' ')\"}"
}

quant() {
    local m
    for m in 7b 13b 70b; do
        if [[ ! -f "$WORK/m$m-q4km.gguf" ]]; then
            say "synthesizing the $m shape as Q4_K_M (llama.cpp's mix, reference quantizers)"
            "$B" synth --preset "$m" --dtype q4_k_m -o "$WORK/m$m-q4km.gguf" --force 2>&1 | tee -a "$LOG"
        fi
    done
    local lb="$LB" peer=()
    [[ -x "$lb" ]] && peer=(--llama-bench "$lb")
    say "7B Q4_K_M on the whole GPU and at 2G, beside llama.cpp where built"
    "$B" bench suite --device cuda -m "$WORK/m7b-q4km.gguf" --budgets whole,2G --prompts 512,2048 \
        --out "$OUT/suite-7b-q4km" "${peer[@]}" 2>>"$LOG"
    record suite_7b_q4km "{\"exit_code\":$?}"
    say "13B Q4_K_M at --gpu-mem 4G"
    with_peak "$WORK/q13b.json" "$B" bench decode --device cuda -m "$WORK/m13b-q4km.gguf" --gpu-mem 4G \
        --prompt-tokens 32 -n 8 --reps 1 --json
    record decode_13b_q4km_4g "{\"exit_code\":$?,\"nvidia_smi_peak_mib\":$(cat "$WORK/q13b.json.peak"),\"bench\":$(cat "$WORK/q13b.json" || echo null)}"
    say "70B-shaped Q4_K_M at --gpu-mem 24G --dram-mem 32G (SSD tier)"
    with_peak "$WORK/q70b.json" "$B" bench decode --device cuda -m "$WORK/m70b-q4km.gguf" --gpu-mem 24G \
        --dram-mem 32G --prompt-tokens 16 -n 4 --reps 1 --json
    record decode_70b_q4km_24g "{\"exit_code\":$?,\"nvidia_smi_peak_mib\":$(cat "$WORK/q70b.json.peak"),\"bench\":$(cat "$WORK/q70b.json" || echo null)}"
}

serve() {
    say "serve on CUDA (stories260K, --gpu-mem 1G: the process, context included): completions, a context swapped out and back, ledger in /metrics"
    "$B" serve --device cuda -m .gpu/models/stories260K-f32.gguf --gpu-mem 1G --port 18181 --parallel 1 \
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

hybrid() {
    # The f16 7B shape's attention is 4 GiB (4 × 4096² × 2 B × 32 layers): at 4G hybrid streams
    # it beside the hot neurons; as Q4_K_M (~1.2 GB of attention) it stays resident.
    local m="$WORK/m7b-relu" q="$WORK/m7b-relu-q4km.gguf"
    if [[ ! -f "$m/config.json" ]]; then
        say "synthesizing the 7B shape with ReLU and power-law 0.8 hot neurons (f16, and as Q4_K_M)"
        "$B" synth --preset 7b --activation relu --power-law 0.8 -o "$m" --force 2>&1 | tee -a "$LOG"
    fi
    if [[ ! -f "$q" ]]; then
        "$B" synth --preset 7b --activation relu --power-law 0.8 --dtype q4_k_m -o "$q" --force 2>&1 | tee -a "$LOG"
    fi
    local model budget cold path tag
    for model in "$m:4G:f16" "$q:4G:q4km"; do
        IFS=: read -r path budget tag <<< "$model"
        say "profile $tag on random ids (a synthesized model's hot neurons are planted; no predictors: oracle masks are exact for ReLU)"
        record "profile_7b_relu_$tag" "$("$B" profile -m "$path" --random-corpus --tokens 256 --window 128 --no-predictors --json 2>>"$LOG")"
        say "hybrid plan, $tag at $budget"
        "$B" plan -m "$path" --gpu-mem "$budget" --ctx-size 1024 --cold auto --hot-neurons 2>&1 | tail -6 | tee -a "$LOG"
        record "plan_7b_relu_${tag}_$budget" "$("$B" plan -m "$path" --gpu-mem "$budget" --ctx-size 1024 --cold cpu --json 2>>"$LOG")"
        for cold in stream cpu; do
            say "7B ReLU $tag at --gpu-mem $budget, --cold $cold, oracle masks"
            record "decode_7b_relu_${tag}_${budget}_$cold" "$("$B" bench decode --device cuda -m "$path" --gpu-mem "$budget" \
                --cold "$cold" --sparsity oracle --prompt-tokens 32 -n 16 --reps 2 --json 2>>"$LOG")"
        done
    done
    say "parity: hybrid (f16 at 4G, attention streamed) vs the whole GPU, oracle masks"
    parity_vs_whole parity_7b_relu_hybrid "$m" --gpu-mem 4G --cold cpu
    synth7b
    say "dense 7B shape at 4G: the CPU+PCIe split vs streaming (plan, then decode)"
    "$B" plan -m "$WORK/m7b" --gpu-mem 4G --ctx-size 1024 --cold auto 2>&1 | tail -3 | tee -a "$LOG"
    for cold in stream split; do
        record "decode_7b_4g_$cold" "$("$B" bench decode --device cuda -m "$WORK/m7b" --gpu-mem 4G --cold "$cold" \
            --prompt-tokens 32 -n 16 --reps 2 --json 2>>"$LOG")"
    done
    local lb="$LB"
    if [[ -x "$lb" && -f "$WORK/m7b.gguf" ]]; then
        say "the split at 4G beside llama.cpp at the largest -ngl that fits (built by \`peers\`)"
        "$B" bench suite --device cuda -m "$WORK/m7b" --budgets 4G --prompts 32 --cold split \
            --out "$OUT/suite-split" --llama-bench "$lb" --peer-gguf "$WORK/m7b.gguf" 2>>"$LOG"
        record suite_7b_split_4g "{\"exit_code\":$?}"
    else
        record suite_7b_split_4g '{"skipped":"llama-bench not built: run `scripts/gpu-check.sh peers` first"}'
    fi
}

units() {
    # Cache units (--cold gpu) on the 7B ReLU shape with power-law 0.8 hot neurons at 4G, beside
    # dense offload and the hybrid path; the synthesized SwiGLU shape too (its masks at 50%).
    local m="$WORK/m7b-relu" s="$WORK/m7b-swiglu"
    if [[ ! -f "$m/config.json" ]]; then
        "$B" synth --preset 7b --activation relu --power-law 0.8 -o "$m" --force 2>&1 | tee -a "$LOG"
    fi
    if [[ ! -f "$s/config.json" ]]; then
        "$B" synth --preset 7b --power-law 0.8 -o "$s" --force 2>&1 | tee -a "$LOG"
    fi
    local path tag cold target
    for model in "$m:relu:0.15" "$s:swiglu:0.5"; do
        IFS=: read -r path tag target <<< "$model"
        record "profile_7b_${tag}_units" "$("$B" profile -m "$path" --random-corpus --tokens 256 --window 128 --no-predictors --json 2>>"$LOG")"
        say "cache units plan, 7B $tag at 4G"
        "$B" plan -m "$path" --gpu-mem 4G --ctx-size 1024 --cold auto --sparsity-target "$target" 2>&1 | tail -12 | tee -a "$LOG"
        for cold in stream gpu cpu; do
            say "7B $tag at --gpu-mem 4G, --cold $cold, oracle masks at $target"
            record "decode_7b_${tag}_4g_$cold" "$("$B" bench decode --device cuda -m "$path" --gpu-mem 4G \
                --cold "$cold" --sparsity oracle --sparsity-target "$target" --prompt-tokens 32 -n 16 --reps 2 --json 2>>"$LOG")"
        done
    done
    say "mixed-precision neurons: 7B SwiGLU at 4G with INT8/INT4 bundles"
    "$B" convert -m "$s" --encodings int8,int4 --force 2>&1 | tail -1 | tee -a "$LOG"
    record "profile_7b_swiglu_units_int" "$("$B" profile -m "$s" --random-corpus --tokens 256 --window 128 --no-predictors --json 2>>"$LOG")"
    for p in fp16 25/25/50 25/0/75; do
        say "7B swiglu at --gpu-mem 4G, --cold gpu, --neuron-precision $p"
        record "decode_7b_swiglu_4g_gpu_${p//\//-}" "$("$B" bench decode --device cuda -m "$s" --gpu-mem 4G \
            --cold gpu --neuron-precision "$p" --sparsity oracle --sparsity-target 0.5 --prompt-tokens 32 -n 16 --reps 2 --json 2>>"$LOG")"
    done
    say "parity: cache units (ReLU 7B at 4G) vs the whole GPU, oracle masks"
    parity_vs_whole parity_7b_relu_units "$m" --gpu-mem 4G --cold gpu
}

synth7b_long() {
    if [[ ! -f "$WORK/m7b-32k/config.json" ]]; then
        say "synthesizing a 7B-shaped fp16 model with a 32k context"
        "$B" synth --preset 7b --max-context 32768 -o "$WORK/m7b-32k" --force 2>&1 | tee -a "$LOG"
    fi
}

prefill() {
    # One model for every run here (a second 7B copy and its store would crowd the 64 GB disk).
    synth7b_long
    local m="$WORK/m7b-32k" n
    say "a prompt in one large step equals steps of 512, split prompt attention equals unsplit (parity first: the figures after it count only if they pass)"
    timeout 120 "$GT" --test-threads 1 --nocapture prefill_in_one_large_step split_prompt_attention 2>&1 | tee -a "$LOG"
    record prefill_step_parity "{\"exit_code\":${PIPESTATUS[0]}}"
    say "whole-GPU prefill, 7B shape: ours beside transformers sdpa (same weights, same call)"
    for n in 512 2048 4000; do
        record "prefill_7b_full_gpu_$n" "$(timeout 150 "$B" bench decode --device cuda -m "$m" --prompt-tokens "$n" -n 2 --reps 2 --json 2>>"$LOG")"
    done
    # The prompt in one step (the default where the device holds it) beside steps of 512 rows
    # (before 4000-row steps): what the larger GEMMs and fewer launches give.
    record prefill_7b_full_gpu_4000_steps_512 "$(timeout 150 "$B" bench decode --device cuda -m "$m" --prompt-tokens 4000 -n 2 --reps 2 --prefill-step 512 --json 2>>"$LOG")"
    # The attention kernels alone (7B heads), beside a matrix product of as many rows, same call:
    # the prefill kernel at 512 and 4000 rows, the split decode kernel at 4000 and 32000 positions.
    for n in "512 0" "4000 0" "1 4000" "1 32000"; do
        set -- $n
        record "attention_7b_${1}_from_$2" "$(timeout 60 "$B" bench attention --device cuda --rows "$1" --context "$2" --json 2>>"$LOG")"
    done
    # The prefill kernel over a Q8_0 cache (its tiles decoded as they load) beside the f16 one.
    record attention_7b_4000_from_0_q8_0 "$(timeout 60 "$B" bench attention --device cuda --rows 4000 --context 0 --kv-type q8_0 --json 2>>"$LOG")"
    # A 512-row group late in a 32k prompt (the row groups of --gpu-mem 4G): its keys split as
    # the device fills (flash_splits), beside unsplit (256 blocks of 7B heads, a wave and less).
    record attention_7b_512_from_32000 "$(timeout 60 "$B" bench attention --device cuda --rows 512 --context 32000 --json 2>>"$LOG")"
    record attention_7b_512_from_32000_unsplit "$(timeout 60 "$B" bench attention --device cuda --rows 512 --context 32000 --flash-splits 1 --json 2>>"$LOG")"
    # The f16 GEMMs of a 512-row step (a 512-token prompt, a row group at 4G) alone and as one
    # merged product (q, k, v: 4096 → 12288 rows; gate, up: 11008 → 22016): whether 512 rows
    # leave cuBLAS's last wave of tiles idle, so batching a layer's same-shaped products pays.
    for spec in "4096 4096" "12288 4096" "11008 4096" "22016 4096"; do
        set -- $spec
        record "gemm_512x${1}x${2}_f16" "$(timeout 60 "$B" bench matvec --device cuda --rows "$1" --cols "$2" --tokens 512 --dtype f16 --json 2>>"$LOG")"
    done
    # One load for every length: "prefill" holds each one's TTFT (the best of two).
    record prefill_7b_transformers "$(timeout 240 $PY scripts/peer_hf.py "$m" --prompt-tokens 32 --tokens 8 --prompts 512,2048,4000 2>>"$LOG" | tail -n1)"
    say "7B shape (32k context) at --gpu-mem 4G: the plan of 8k and 32k prompts, then the runs (nvidia-smi peak)"
    for n in 8192 32760; do
        "$B" plan -m "$m" --gpu-mem 4G --prompt-tokens "$n" --json > "$OUT/plan_prefill_$n.json" 2>>"$LOG"
        with_peak "$WORK/prefill_$n.json" timeout 240 "$B" bench decode --device cuda -m "$m" --gpu-mem 4G \
            --prompt-tokens "$n" -n 2 --reps 1 --json
        record "prefill_7b_4g_$n" "{\"exit_code\":$?,\"nvidia_smi_peak_mib\":$(cat "$WORK/prefill_$n.json.peak"),\"plan\":$($PY -c 'import json,sys; p=json.load(open(sys.argv[1])); print(json.dumps({"prefill": p["prefill"], "prediction": p["prefill_prediction"]}))' "$OUT/plan_prefill_$n.json" 2>/dev/null || echo null),\"bench\":$(cat "$WORK/prefill_$n.json" || echo null)}"
    done
}

# serve on the 7B shape at 4G (arguments after the first two go to serve): one client alone,
# then N at once; the answers compared through their logprobs, the times and /metrics recorded.
serve_clients() {
    local n=$1 name=$2
    shift 2
    "$B" serve --device cuda -m "$WORK/m7b" --gpu-mem 4G --port 18182 "$@" \
        > "$WORK/serve7b.out" 2>>"$LOG" &
    local pid=$!
    for _ in $(seq 600); do grep -q listening "$WORK/serve7b.out" 2>/dev/null && break; sleep 0.5; done
    record "$name" "$(CLIENTS=$n $PY - <<'PY' 2>>"$LOG"
import json, os, threading, time, urllib.request as u
B = "http://127.0.0.1:18182"
N = int(os.environ["CLIENTS"])
def post(body):
    r = u.Request(B + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.load(u.urlopen(r, timeout=600))
prompts = [[(i * 7919 + 13 * k) % 31000 + 3 for i in range(64)] for k in range(N)]
# No tokenizer in a synthesized model: the answer is compared with its logprobs (token by token).
g = lambda p: {"prompt": p, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "logprobs": 1}
ans = lambda v: json.dumps([v["choices"][0].get("text"), v["choices"][0].get("logprobs")])
post(g(prompts[0]))  # warm-up
t = time.time(); alone = [ans(post(g(p))) for p in prompts[:1]]; one = time.time() - t
res = [None] * N
def run(k): res[k] = ans(post(g(prompts[k])))
t = time.time(); ts = [threading.Thread(target=run, args=(k,)) for k in range(N)]
[x.start() for x in ts]; [x.join() for x in ts]; many = time.time() - t
m = u.urlopen(B + "/metrics").read().decode()
keep = ("gpu_offload_decode_batch_size_", "gpu_offload_kv_pool", "gpu_offload_prompts_joined", "gpu_offload_ledger_bytes")
print(json.dumps({"clients": N, "one_client_s": one, "all_clients_s": many, "time_ratio": many / one,
                  "aggregate_speedup": N * one / many, "first_answer_equal": res[0] == alone[0],
                  "metrics": [l for l in m.splitlines() if l.startswith(keep)]}))
PY
)"
    kill -TERM $pid; wait $pid
}

batching() {
    synth7b
    synth1b
    local n
    say "7B shape at --gpu-mem 4G: N sequences in shared decode steps against one alone"
    for n in 4 16; do
        record "batch_7b_4g_$n" "$("$B" bench decode --device cuda -m "$WORK/m7b" --gpu-mem 4G --sessions "$n" --prompt-tokens 64 -n 16 --reps 1 --json 2>>"$LOG")"
    done
    say "serve, 7B shape at --gpu-mem 4G --parallel 4: one client against four at once"
    serve_clients 4 serve_7b_4g_concurrent --parallel 4 --ctx-size 512
    say "serve, 7B shape at --gpu-mem 4G --parallel 16, a paged KV pool of 2048 positions: one client against 16"
    serve_clients 16 serve_7b_4g_16_clients --parallel 16 --ctx-size 512 --kv-pool-tokens 2048
    say "bench contexts on CUDA, 1B shape (random token ids)"
    "$B" bench contexts --device cuda -m "$WORK/m1b" --gpu-mem 8G --random-corpus --contexts 8 --resident 2 \
        --calls 24 --history-tokens 1024 --out "$OUT/contexts-1b" 2>>"$LOG" | tail -n 20 | tee -a "$LOG"
    record contexts_1b_cuda "{\"exit_code\":$?,\"files\":\"$(ls "$OUT/contexts-1b" 2>/dev/null | tr '\n' ' ')\"}"
}

# MiB in a size flag (2G → 2048).
mib_of() { local v="${1%[GgMm]}"; [[ "$1" == *[Gg] ]] && echo $(( v * 1024 )) || echo "$v"; }

issue36() {
    say "GPU tests (the process budget, fused kernels, recorded = launched)"
    timeout 150 "$GT" --test-threads 1 2>&1 | tail -n 30 | tee -a "$LOG"
    record i36_gpu_tests "{\"exit_code\":${PIPESTATUS[0]}}"
    synth7b
    # No saved profile and no cached rates: the first runs plan with rates measured at start.
    rm -f "$WORK/hardware.json"; rm -rf "$WORK/rates"
    say "the whole GPU's memory.used against --gpu-mem, 7B shape (the device figure is the fixed cost)"
    local g name
    for g in 2G 4G 8G; do
        name="i36_budget_7b_$g"
        with_device_peak "$WORK/$name.json" timeout 90 "$B" bench decode --device cuda -m "$WORK/m7b" \
            --gpu-mem "$g" --prompt-tokens 32 -n 8 --reps 1 --json
        local rc=$? peak idle
        peak="$(cat "$WORK/$name.json.peak")"; idle="$(cat "$WORK/$name.json.idle")"
        record "$name" "{\"exit_code\":$rc,\"gpu_mem_mib\":$(mib_of "$g"),\"memory_used_peak_mib\":$peak,\"memory_used_idle_mib\":$idle,\"within_budget\":$([[ "$peak" -le "$(mib_of "$g")" ]] && echo true || echo false),\"bench\":$(cat "$WORK/$name.json" 2>/dev/null || echo null)}"
    done
    decode_dense
    say "stream and split at 4G, rates measured at start (no saved profile): prediction beside measurement"
    local cold
    for cold in stream split; do
        record "i36_decode_7b_4g_${cold}_measured_rates" "$(timeout 60 "$B" bench decode --device cuda -m "$WORK/m7b" --gpu-mem 4G --cold "$cold" --prompt-tokens 32 -n 16 --reps 2 --json 2>>"$LOG")"
    done
    record i36_plan_7b_4g_rates "$(timeout 30 "$B" plan -m "$WORK/m7b" --gpu-mem 4G --ctx-size 1024 --json 2>>"$LOG" | $PY -c 'import json,sys; p=json.load(sys.stdin); print(json.dumps({"rates_source": p["hardware"].get("rates_source"), "prediction": p["prediction"]}))' 2>>"$LOG" || echo null)"
    say "1, 4 and 16 sequences at 4G: stream, split and the auto choice for each count (the plan costs each mode for the batch)"
    record i36_batch_7b_4g "$(timeout 240 "$B" bench decode --device cuda -m "$WORK/m7b" --gpu-mem 4G --sessions 1,4,16 \
        --modes stream,split,auto --prompt-tokens 32 -n 16 --reps 1 --json 2>>"$LOG")"
    doctor_save
    say "stream and split at 4G after doctor --save"
    for cold in stream split; do
        record "i36_decode_7b_4g_${cold}_saved_profile" "$(timeout 60 "$B" bench decode --device cuda -m "$WORK/m7b" --gpu-mem 4G --cold "$cold" --prompt-tokens 32 -n 16 --reps 2 --json 2>>"$LOG")"
    done
    if [[ ! -f "$WORK/m7b-q4km.gguf" ]]; then
        say "synthesizing the 7B shape as Q4_K_M"
        timeout 240 "$B" synth --preset 7b --dtype q4_k_m -o "$WORK/m7b-q4km.gguf" --force 2>&1 | tail -n 2 | tee -a "$LOG"
    fi
    say "7B Q4_K_M: whole GPU and at --gpu-mem 2G"
    record i36_decode_7b_q4km_whole "$(timeout 60 "$B" bench decode --device cuda -m "$WORK/m7b-q4km.gguf" --prompt-tokens 128 -n 64 --json 2>>"$LOG")"
    with_device_peak "$WORK/i36_q4km_2g.json" timeout 90 "$B" bench decode --device cuda -m "$WORK/m7b-q4km.gguf" \
        --gpu-mem 2G --prompt-tokens 32 -n 16 --reps 1 --json
    record i36_decode_7b_q4km_2g "{\"exit_code\":$?,\"memory_used_peak_mib\":$(cat "$WORK/i36_q4km_2g.json.peak"),\"bench\":$(cat "$WORK/i36_q4km_2g.json" 2>/dev/null || echo null)}"
    if [[ -x "$LB" ]]; then
        say "llama.cpp on the same Q4_K_M file (built by \`peers\`)"
        record i36_llamacpp_7b_q4km "$(timeout 90 "$LB" -m "$WORK/m7b-q4km.gguf" -ngl 99 -fa 1 -p 0 -n 64 -o json 2>>"$LOG" | tr -d '\n' || echo null)"
    else
        record i36_llamacpp_7b_q4km '{"skipped":"llama-bench not built: run `scripts/gpu-check.sh peers` first"}'
    fi
}

issue37() {
    # Sparse offloading at its bounds: after `doctor --save`, the 7B ReLU power-law shape at 4G
    # and the 1B one at 1600M, dense stream, hybrid (--cold cpu) and cache units (--cold gpu)
    # with oracle masks, each with --trace (Chrome trace-event JSON under $OUT) and its per-phase
    # totals in the JSON beside each phase's bound; the plan's prediction of each; hybrid and
    # units with predictors on the 1B shape (its profile trains them); units vs the whole GPU.
    doctor_save
    local m7="$WORK/m7b-relu" m1="$WORK/m1b-relu"
    if [[ ! -f "$m7/config.json" ]]; then
        say "synthesizing the 7B shape with ReLU and power-law 0.8 hot neurons (f16)"
        timeout 120 "$B" synth --preset 7b --activation relu --power-law 0.8 -o "$m7" --force 2>&1 | tail -n 1 | tee -a "$LOG"
    fi
    if [[ ! -f "$m1/config.json" ]]; then
        say "synthesizing the 1B shape with ReLU and power-law 0.8 hot neurons (f16)"
        timeout 60 "$B" synth --preset 1b --activation relu --power-law 0.8 -o "$m1" --force 2>&1 | tail -n 1 | tee -a "$LOG"
    fi
    say "profiles: the 7B on 48 random tokens (no predictors), the 1B on 256 with predictors"
    record i37_profile_7b "$(timeout 120 "$B" profile -m "$m7" --random-corpus --tokens 48 --no-predictors --json 2>>"$LOG")"
    record i37_profile_1b "$(timeout 120 "$B" profile -m "$m1" --random-corpus --tokens 256 --json 2>>"$LOG")"
    local spec path budget tag cold
    for spec in "$m7:4G:7b" "$m1:1600M:1b"; do
        IFS=: read -r path budget tag <<< "$spec"
        for cold in stream cpu gpu; do
            say "$tag ReLU at --gpu-mem $budget, --cold $cold, oracle masks, traced"
            record "i37_plan_${tag}_$cold" "$(timeout 60 "$B" plan -m "$path" --gpu-mem "$budget" --ctx-size 1024 --cold "$cold" --json 2>>"$LOG" \
                | $PY -c 'import json,sys; p=json.load(sys.stdin); print(json.dumps({"prediction": p.get("prediction"), "candidates": p.get("cold_candidates"), "hybrid": (p.get("hot_neurons") or {}).get("predicted_tokens_per_s"), "units": (p.get("cache_units") or {}).get("predicted_tokens_per_s")}))' 2>>"$LOG" || echo null)"
            record "i37_decode_${tag}_$cold" "$(timeout 90 "$B" bench decode --device cuda -m "$path" --gpu-mem "$budget" --cold "$cold" \
                --sparsity oracle --prompt-tokens 32 -n 16 --reps 2 --trace "$OUT/trace-${tag}-$cold.json" --json 2>>"$LOG")"
        done
        # What --cold auto picks here, with every candidate's prediction (beside the runs above).
        record "i37_plan_${tag}_auto" "$(timeout 60 "$B" plan -m "$path" --gpu-mem "$budget" --ctx-size 1024 --cold auto --json 2>>"$LOG" \
            | $PY -c 'import json,sys; p=json.load(sys.stdin); print(json.dumps({"cold": p.get("cold"), "candidates": p.get("cold_candidates")}))' 2>>"$LOG" || echo null)"
        if [[ "$tag" == 1b ]]; then
            for cold in cpu gpu; do
                say "1b at 1600M, --cold $cold, predicted masks (recall in the JSON), traced"
                record "i37_decode_1b_${cold}_predicted" "$(timeout 90 "$B" bench decode --device cuda -m "$path" --gpu-mem "$budget" --cold "$cold" \
                    --sparsity predicted --recall --prompt-tokens 32 -n 16 --reps 2 --trace "$OUT/trace-1b-$cold-predicted.json" --json 2>>"$LOG")"
            done
        fi
    done
    say "parity: cache units (7B ReLU at 4G, attention streamed) vs the whole GPU, oracle masks"
    parity_vs_whole i37_parity_7b_units "$m7" --gpu-mem 4G --cold gpu
}

# Where hybrid's CPU side goes on this host (issue 37): the f16 sparse kernels alone (bench
# sparse at the 7B shape's layer, 8 and 16 threads) beside the DRAM bound, then hybrid decode of
# the 1B ReLU shape at 1600M with 8, 12 and 16 CPU threads (oracle masks; --json times the
# untraced repetitions, the traced one beside them). About two minutes.
hybridcpu() {
    local m1="$WORK/m1b-relu" t
    if [[ ! -f "$m1/config.json" ]]; then
        say "synthesizing the 1B shape with ReLU and power-law 0.8 hot neurons (f16)"
        timeout 60 "$B" synth --preset 1b --activation relu --power-law 0.8 -o "$m1" --force 2>&1 | tail -n 1 | tee -a "$LOG"
    fi
    say "profile of the 1B on 48 random tokens (no predictors)"
    timeout 120 "$B" profile -m "$m1" --random-corpus --tokens 48 --no-predictors --json > "$WORK/hybridcpu-profile.json" 2>>"$LOG"
    record hybridcpu_profile "{\"exit_code\":$?}"
    # The 7B layer (270 MB of f16 bundles): the 1B one (69 MB) fits the H200 host's cache, and
    # bench sparse refuses a rate above the DRAM probe's.
    for t in 8 16; do
        say "bench sparse, f16, the 7B layer (d 4096, 11008 neurons), $t threads"
        record "hybridcpu_sparse_t$t" "$(timeout 90 "$B" bench sparse --d 4096 --neurons 11008 --encodings f16 --active 30,100 -t "$t" --json 2>>"$LOG" || echo null)"
    done
    for t in 8 12 16; do
        say "1b hybrid at 1600M, $t CPU threads"
        record "hybridcpu_decode_1b_t$t" "$(timeout 60 "$B" bench decode --device cuda -m "$m1" --gpu-mem 1600M --cold cpu \
            --sparsity oracle -t "$t" --prompt-tokens 32 -n 16 --reps 3 --json 2>>"$LOG")"
    done
}

issue38() {
    say "expert GPU tests (moe_ffn in every format; offloaded tiny MoE vs the dense run)"
    timeout 120 "$GT" --test-threads 1 moe_ffn_on_gpu offloaded_experts_on_gpu 2>&1 | tail -n 20 | tee -a "$LOG"
    record i38_gpu_tests "{\"exit_code\":${PIPESTATUS[0]}}"
    doctor_save
    local layers="${I38_LAYERS:-48}" m="$WORK/qwen3moe-q4km.gguf"
    if [[ ! -f "$m" ]]; then
        say "synthesizing the Qwen3-30B-A3B shape ($layers layers) in Q4_K_M"
        timeout 300 "$B" synth --preset qwen3-30b-a3b --layers "$layers" --dtype q4_k_m -o "$m" --force 2>&1 | tail -n 2 | tee -a "$LOG"
    fi
    MOE_LAYERS="$layers" moe_runs i38_qwen3moe "$m" 8G 4G
    if [[ -n "${I38_MIXTRAL:-}" ]]; then
        local mx="$WORK/mixtral-q4km.gguf"
        if [[ ! -f "$mx" ]]; then
            say "synthesizing the Mixtral-8x7B shape in Q4_K_M"
            timeout 420 "$B" synth --preset mixtral-8x7b --dtype q4_k_m -o "$mx" --force 2>&1 | tail -n 2 | tee -a "$LOG"
        fi
        MOE_LAYERS=32 moe_runs i38_mixtral "$mx" 8G
    fi
}

# A MoE model at each budget: the plan, decode with units / all experts on the CPU / the plan's
# choice (memory.used peak beside the budget), prefill at the first budget, then llama.cpp's
# expert offload on the same file (--n-cpu-moe down from 5/6 of MOE_LAYERS, the model's layers).
# Args: record prefix, model, budgets.
moe_runs() {
    local tag=$1 m=$2 g cold name rc
    shift 2
    local first=$1
    for g in "$@"; do
        record "${tag}_plan_$g" "$(timeout 60 "$B" plan -m "$m" --gpu-mem "$g" --ctx-size 4096 --json 2>>"$LOG" \
            | $PY -c 'import json,sys; p=json.load(sys.stdin); x=p["experts"]; print(json.dumps({k: x[k] for k in ("mode","copies_per_step","predicted_tokens_per_s","per_token","device")} | {"slots": [l["slots"] for l in x["layers"]]}))' 2>>"$LOG" || echo null)"
        local runs=(gpu cpu auto)
        # At the first budget also: every expert streamed, units without next-layer prefetch,
        # and units with Q4_0 low-bit misses (I38_EXTRA=0 leaves them out).
        [[ "$g" == "$first" && "${I38_EXTRA:-1}" != 0 ]] && runs+=(stream gpu:--no-expert-prefetch gpu:--expert-low-bit=q4_0)
        local run extra
        for run in "${runs[@]}"; do
            cold="${run%%:*}"
            extra=()
            [[ "$run" == *:* ]] && extra=("${run#*:}")
            name="${tag}_decode_${g}_$(echo "$run" | tr -c 'a-z0-9_\n' _)"
            say "$name"
            with_device_peak "$WORK/$name.json" timeout 120 "$B" bench decode --device cuda -m "$m" --gpu-mem "$g" \
                --ctx-size 4096 --cold "$cold" "${extra[@]}" --prompt-tokens 32 -n 32 --reps 2 --json
            rc=$?
            record "$name" "{\"exit_code\":$rc,\"gpu_mem_mib\":$(mib_of "$g"),\"memory_used_peak_mib\":$(cat "$WORK/$name.json.peak"),\"memory_used_idle_mib\":$(cat "$WORK/$name.json.idle"),\"bench\":$(cat "$WORK/$name.json" 2>/dev/null || echo null)}"
        done
    done
    local p
    for p in 512 2048; do
        record "${tag}_prefill_${first}_$p" "$(timeout 120 "$B" bench decode --device cuda -m "$m" --gpu-mem "$first" --ctx-size 4096 \
            --prompt-tokens "$p" -n 4 --reps 1 --json 2>>"$LOG")"
    done
    if [[ -x "$LB" ]]; then
        say "llama.cpp on the same file: every routed expert on the CPU, then --n-cpu-moe N"
        record "${tag}_llamacpp_exps_cpu" "$(timeout 120 "$LB" -m "$m" -ngl 99 -ot exps=CPU -fa 1 -t 16 -p 512,2048 -n 32 -o json 2>>"$LOG" | tr -d '\n' || echo null)"
        local n
        for n in $(( MOE_LAYERS * 5 / 6 )) $(( MOE_LAYERS * 2 / 3 )) $(( MOE_LAYERS / 2 )) $(( MOE_LAYERS / 3 )) $(( MOE_LAYERS / 6 )); do
            name="${tag}_llamacpp_ncmoe_$n"
            with_peak "$WORK/$name.json" timeout 90 "$LB" -m "$m" -ngl 99 --n-cpu-moe "$n" -fa 1 -t 16 -p 0 -n 32 -o json
            rc=$?
            record "$name" "{\"exit_code\":$rc,\"process_peak_mib\":$(cat "$WORK/$name.json.peak"),\"bench\":$(tr -d '\n' < "$WORK/$name.json" 2>/dev/null || echo null)}"
            # Fewer CPU layers only take more memory: stop past the budget.
            [[ "$(cat "$WORK/$name.json.peak")" -gt "$(mib_of "$first")" ]] && break
        done
    else
        record "${tag}_llamacpp" '{"skipped":"llama-bench not built: run `scripts/gpu-check.sh peers` first"}'
    fi
}

case "$MODE" in
    tests) tests ;;
    issue36) issue36 ;;
    issue37) issue37 ;;
    issue38) issue38 ;;
    hybridcpu) hybridcpu ;;
    dense) decode_dense ;;
    graphs) graphs ;;
    issue13) doctor_save; synth7b_long; graphs "$WORK/m7b-32k"; prefill ;;
    batching) batching ;;
    prefill) prefill ;;
    bench) bench ;;
    offload) offload ;;
    serve) serve ;;
    budgets) budgets ;;
    suite) suite ;;
    peers) peers ;;
    quant) quant ;;
    hybrid) hybrid ;;
    units) units ;;
    all) tests; bench; budgets; offload; suite; serve ;;
    *) echo "usage: scripts/gpu-check.sh [tests|issue13|issue36|issue37|issue38|dense|graphs|bench|offload|budgets|suite|peers|quant|serve|hybrid|units|prefill|batching|all]"; exit 2 ;;
esac
say "done"
