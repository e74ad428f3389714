//! The fuzz targets' short run (issue 39): for each target, its seeds and committed regression
//! inputs (tests/fuzz_regressions/<target>/), then a fixed number of mutations from a fixed seed —
//! the same inputs on every run. Each target runs in a child process (this binary, the ignored
//! `fuzz_child` test) with a 4 GiB address-space cap, so an abort or a runaway allocation is
//! reported with the input that caused it, not as a dead test binary. Long runs: scripts/fuzz.sh.

#[allow(dead_code)]
#[path = "../fuzz/src/engine.rs"]
mod engine;
#[allow(dead_code)]
#[path = "../fuzz/src/mutate.rs"]
mod mutate;
#[allow(dead_code)]
#[path = "../fuzz/src/targets.rs"]
mod targets;

use std::path::PathBuf;
use std::process::Command;

/// Mutated inputs per target: a few seconds each on one core.
const SHORT_RUN_INPUTS: u64 = 1500;

const CHILD_TARGET: &str = "GPU_OFFLOAD_FUZZ_CHILD_TARGET";
const CHILD_CURRENT: &str = "GPU_OFFLOAD_FUZZ_CHILD_CURRENT";

/// Run `target`'s short run in a child; on any failure, keep the input and say where.
fn short_run(target: &str) {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fuzz");
    std::fs::create_dir_all(&dir).expect("the target's temporary directory is writable");
    let current = dir.join(format!("{target}.current"));
    let _ = std::fs::remove_file(&current);
    let out = Command::new(std::env::current_exe().expect("the test binary's path"))
        .args(["--ignored", "--exact", "fuzz_child", "--nocapture"])
        .args(["--test-threads", "1"])
        .env(CHILD_TARGET, target)
        .env(CHILD_CURRENT, &current)
        .output()
        .expect("the test binary runs as a child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let report: Vec<&str> = stdout
        .lines()
        .filter_map(|l| l.find("fuzz: ").map(|at| &l[at..]))
        .collect();
    println!("{}", report.join("\n"));
    if !out.status.success() {
        let kept = dir.join(format!("{target}-crash"));
        let saved = std::fs::copy(&current, &kept).is_ok();
        let tail: Vec<&str> = stderr.lines().rev().take(25).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        panic!(
            "fuzz target `{target}` failed ({}); the input: {}\n{}",
            out.status,
            if saved {
                kept.display().to_string()
            } else {
                "(not saved)".into()
            },
            tail.join("\n")
        );
    }
    assert!(
        report.iter().any(|l| l.contains("short run done")),
        "the child ran no short run:\n{stdout}\n{stderr}"
    );
}

/// The child: one target's seeds, regressions and mutations, in this process.
#[test]
#[ignore = "run by the fuzz_* tests in a child process"]
fn fuzz_child() {
    let target = std::env::var(CHILD_TARGET).expect("run by a fuzz_* test");
    let current = PathBuf::from(std::env::var(CHILD_CURRENT).expect("run by a fuzz_* test"));
    cap_address_space(4 << 30);
    let mut harness = targets::Harness::new(&target).expect("the micro model is written");
    let mut corpus = harness.seeds();
    let regressions = engine::regressions(&target);
    let watchdog = engine::Watchdog::start(current.clone());
    let mut runner = engine::Runner {
        harness: &mut harness,
        current,
        watchdog,
        stats: engine::Stats::default(),
    };
    let seeds = corpus.len();
    let mut seeds_ok = 0;
    for (i, seed) in corpus.clone().iter().enumerate() {
        let (sig, _) = runner.run(seed);
        println!("fuzz: {target}: seed {i}: {sig}");
        seeds_ok += (sig == "ok") as usize;
    }
    for (path, input) in &regressions {
        let (sig, _) = runner.run(input);
        println!("fuzz: {target}: regression {}: {sig}", path.display());
    }
    let mut rng = mutate::Rng::new(engine::fnv1a(target.as_bytes()));
    let before = runner.stats.execs;
    runner.fuzz(&mut corpus, &mut rng, None, |n| {
        n < before + SHORT_RUN_INPUTS
    });
    let s = &runner.stats;
    println!(
        "fuzz: {target}: short run done: {} inputs ({seeds} seeds, {seeds_ok} loading; {} regressions), {} ok, {} distinct outcomes, corpus {}, slowest input {:.0} ms",
        s.execs,
        regressions.len(),
        s.ok,
        s.outcomes.len(),
        s.corpus,
        s.slowest.as_secs_f64() * 1e3,
    );
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fuzz");
    for (input, msg) in &s.panics {
        let kept = dir.join(format!("{target}-panic-{:016x}", engine::fnv1a(input)));
        let _ = std::fs::write(&kept, input);
        println!("fuzz: {target}: PANIC {msg}; the input: {}", kept.display());
    }
    assert!(
        s.panics.is_empty(),
        "`{target}` panicked on {} inputs",
        s.panics.len()
    );
    // A seed that no longer loads would leave the run fuzzing error paths only.
    assert!(seeds_ok > 0, "no seed of `{target}` loads");
}

/// An allocation the target should have refused fails here instead of taking the machine.
fn cap_address_space(bytes: u64) {
    let limit = libc::rlimit {
        rlim_cur: bytes,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: setrlimit reads the struct we pass; lowering a soft limit is always allowed.
    unsafe {
        libc::setrlimit(libc::RLIMIT_AS, &limit);
    }
}

#[test]
fn fuzz_gguf() {
    short_run("gguf");
}

#[test]
fn fuzz_hf() {
    short_run("hf");
}

#[test]
fn fuzz_store_manifest() {
    short_run("store_manifest");
}

#[test]
fn fuzz_tokenizer_json() {
    short_run("tokenizer_json");
}

#[test]
fn fuzz_chat_template() {
    short_run("chat_template");
}

#[test]
fn fuzz_prefill_jsonl() {
    short_run("prefill_jsonl");
}

#[test]
fn fuzz_http_body() {
    short_run("http_body");
}

#[test]
fn every_target_has_a_short_run_test() {
    let source = include_str!("fuzz.rs");
    for t in targets::TARGETS {
        assert!(
            source.contains(&format!("short_run(\"{t}\")")),
            "target `{t}` has no short-run test"
        );
    }
}
