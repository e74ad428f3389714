#!/usr/bin/env bash
# Fuzzing (issue 39). Without --long: the short run CI does (`cargo test --test fuzz`: seeds,
# committed regressions, 1,500 deterministic mutations per target). With --long: each target
# for MINUTES (default 10), coverage-guided by AFL++ when cargo-afl is installed
# (`apt-get install afl++` and `cargo install cargo-afl`, both on stable Rust), else by the
# in-process mutator with a random seed. Results in fuzz/out/<target>/: AFL's queue, crashes and
# hangs (or corpus/ and crashes/), and one summary line per target in fuzz/out/summary.txt.
#
#   scripts/fuzz.sh                                   the short run
#   scripts/fuzz.sh --long [--minutes N] [--engine afl|inprocess] [TARGET...]
#
# A crash or hang: replay it with `BIN replay TARGET FILE`, then commit the file as
# tests/fuzz_regressions/<target>/<name> so the short run replays it from then on.
set -euo pipefail
cd "$(dirname "$0")/.."
long=0 minutes=10 engine=auto targets=()
while [ $# -gt 0 ]; do
    case "$1" in
        --long) long=1 ;;
        --minutes) minutes="$2"; shift ;;
        --engine) engine="$2"; shift ;;
        -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
        *) targets+=("$1") ;;
    esac
    shift
done
if [ "$long" = 0 ]; then
    exec cargo test --test fuzz
fi
if [ "$engine" = auto ]; then
    if cargo afl --version >/dev/null 2>&1; then engine=afl; else engine=inprocess; fi
fi
base="${CARGO_TARGET_DIR:-$PWD/target}"
if [ "$engine" = afl ]; then
    export CARGO_TARGET_DIR="$base/fuzz-afl"
    cargo afl build --release --quiet --manifest-path fuzz/Cargo.toml
else
    export CARGO_TARGET_DIR="$base/fuzz-plain"
    cargo build --release --quiet --manifest-path fuzz/Cargo.toml --no-default-features
fi
bin="$CARGO_TARGET_DIR/release/gpu-offload-fuzz"
[ ${#targets[@]} -eq 0 ] && mapfile -t targets < <("$bin" list)
scripts/fuzz-corpus.sh "$bin" "${targets[@]}"
mkdir -p fuzz/out
secs=$(awk "BEGIN { print int($minutes * 60) }")
for t in "${targets[@]}"; do
    out="fuzz/out/$t"
    if [ "$engine" = afl ]; then
        # -m: a target allocating past 4 GiB is a finding (a crash), not a dead machine;
        # -t: an input over 10 s is a hang. Resume from an earlier run's queue when there is one.
        input="fuzz/corpus/$t"
        [ -d "$out/default/queue" ] && input=-
        AFL_SKIP_CPUFREQ=1 AFL_NO_UI=1 AFL_NO_AFFINITY=1 AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES=1 \
            AFL_SKIP_CRASHES=1 AFL_FAST_CAL=1 \
            cargo afl fuzz -i "$input" -o "$out" -V "$secs" -m 4096 -t 10000 -- "$bin" afl "$t" \
            > "$out.log" 2>&1 || { echo "$t: afl-fuzz failed, see $out.log"; tail -20 "$out.log"; continue; }
        s="$out/default/fuzzer_stats"
        get() { awk -F' *: *' -v k="$1" '$1 == k { print $2 }' "$s"; }
        line="$t: afl, $(get run_time) s, $(get execs_done) execs ($(get execs_per_sec)/s), corpus $(get corpus_count), edges $(get edges_found) of $(get total_edges) (map $(get bitmap_cvg)), crashes $(get saved_crashes), hangs $(get saved_hangs)"
    else
        line=$("$bin" run "$t" "$minutes" "$out/corpus" "$out/crashes")
    fi
    echo "$line" | tee -a fuzz/out/summary.txt
done
