//! `bench contexts` through the real binary on stories260K: every strategy in the report with
//! sane fields, ours (and the exact swaps) restoring contexts to the bit with compression off,
//! the budgeted device, and bad flags refused with a message naming them. No test asserts a time.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::*;
use serde_json::Value;

const STRATEGIES: [&str; 5] = [
    "recompute",
    "whole-swap",
    "chunked-swap",
    "chunked-int8",
    "ours",
];

/// The binary with no GPU_OFFLOAD_* settings from the environment, and its own model cache
/// under `dir` (a store converted for the budgeted device goes there).
fn bin(dir: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_gpu-offload"));
    for (k, _) in std::env::vars() {
        if k.starts_with("GPU_OFFLOAD_") {
            c.env_remove(k);
        }
    }
    c.env("GPU_OFFLOAD_MODELS", dir.join("models"));
    c
}

/// A small trace of `calls` calls on stories260K: 4 contexts, 2 on the device, contexts of
/// 96+ tokens.
fn small(dir: &Path, out: &Path, calls: &str) -> Command {
    let mut c = bin(dir);
    c.args(["bench", "contexts", "-m"])
        .arg(stories260k())
        .args([
            "--contexts",
            "4",
            "--resident",
            "2",
            "--calls",
            calls,
            "--history-tokens",
            "96",
            "--user-tokens",
            "8-40",
            "--answer-tokens",
            "4-12",
            "--random-corpus",
            "--threads",
            "2",
            "--json",
            "--out",
        ])
        .arg(out);
    c
}

fn run_ok(c: &mut Command) -> Output {
    let out = c.output().expect("run binary");
    assert!(
        out.status.success(),
        "{c:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn report(out: &Path) -> Value {
    let text = std::fs::read_to_string(out.join("contexts.json")).expect("contexts.json");
    serde_json::from_str(&text).expect("contexts.json is JSON")
}

fn num(v: &Value, path: &str) -> f64 {
    v.pointer(path)
        .and_then(Value::as_f64)
        .unwrap_or_else(|| panic!("{path} missing in {v}"))
}

fn strategy<'a>(r: &'a Value, name: &str) -> &'a Value {
    r["strategies"]
        .as_array()
        .expect("strategies")
        .iter()
        .find(|s| s["strategy"] == name)
        .unwrap_or_else(|| panic!("strategy {name} missing"))
}

#[test]
fn every_strategy_is_reported_and_exact_swaps_restore_contexts_to_the_bit() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let res = run_ok(small(dir.path(), &out, "10").args([
        "--check",
        "--kv-compression",
        "off",
        "--sweep",
        "2,4",
        "--ttft-target",
        "60",
    ]));
    let r = report(&out);
    // --json prints the same report.
    let printed: Value = serde_json::from_slice(&res.stdout).expect("stdout is the JSON report");
    assert_eq!(printed["strategies"], r["strategies"]);
    assert_eq!(r["schema"], "gpu-offload/bench-contexts/1");
    assert_eq!(r["device"]["kind"], "cpu");
    assert_eq!(r["settings"]["trace"]["contexts"], 4);
    for name in STRATEGIES {
        let s = strategy(&r, name);
        assert_eq!(s["calls_run"], 10, "{name}");
        assert_eq!(s["stopped_early"], false, "{name}");
        assert!(s["switches"].as_u64().unwrap() >= 1, "{name}: no switch");
        for field in ["switch_s", "switch_in_s", "switch_out_s", "ttft_s"] {
            let mean = num(s, &format!("/{field}/mean"));
            let p99 = num(s, &format!("/{field}/p99"));
            assert!(
                mean.is_finite() && mean >= 0.0 && p99 >= mean,
                "{name} {field}: {mean} {p99}"
            );
        }
        assert!(num(s, "/min_switch_context_tokens") >= 96.0, "{name}");
        assert_eq!(s["calls"].as_array().unwrap().len(), 10, "{name}");
        let check = &s["check"];
        assert_eq!(check["calls"], 10, "{name}");
        // Exact stores bring the KV back as it was: the same logits as never swapping.
        if name != "chunked-int8" && name != "recompute" {
            assert_eq!(check["top1_agree"], 10, "{name}: {check}");
            assert_eq!(check["exact"], true, "{name}: {check}");
        }
    }
    // Ours swaps out ahead of time, when the engine falls idle: a write is held back only
    // while the next call is already waiting, and taking a slot costs (next to) nothing unless
    // a write was held back.
    let ours = strategy(&r, "ours");
    let calls = ours["calls"].as_array().unwrap();
    let field = |k: usize, f: &str| calls[k][f].as_f64().unwrap();
    let mut held_back = 0;
    for k in 0..calls.len() {
        if field(k, "after_s") == 0.0 {
            held_back += 1;
            assert!(
                k + 1 < calls.len() && field(k + 1, "wait_s") > 0.0,
                "call {k}'s write held back with no call waiting"
            );
        }
    }
    if held_back == 0 {
        assert!(num(ours, "/switch_out_s/max") < 1e-3);
    }
    assert!(num(ours, "/after_s_mean") > 0.0);
    // Every strategy's queue uses the shared work's times, timed once per call.
    for name in STRATEGIES {
        let c = &strategy(&r, name)["calls"];
        for (k, call) in c.as_array().unwrap().iter().enumerate() {
            for f in ["shared_prefill_s", "shared_answer_s"] {
                assert_eq!(call[f], calls[k][f], "{name} call {k}: {f}");
                assert!(call[f].as_f64().unwrap() > 0.0, "{name} call {k}: {f}");
            }
        }
    }
    // Int8 is lossy, and the check sees it.
    assert!(num(strategy(&r, "chunked-int8"), "/check/max_abs_logit_diff") > 0.0);
    let sweep = r["sweep"].as_array().unwrap();
    let counts: Vec<u64> = sweep
        .iter()
        .map(|p| p["contexts"].as_u64().unwrap())
        .collect();
    assert_eq!(counts, [2, 4]);
    for p in sweep {
        assert_eq!(p["cells"].as_array().unwrap().len(), 5);
    }
    // With as many slots as contexts nothing switches: every strategy meets a loose target.
    for m in r["most_contexts"].as_array().unwrap() {
        assert!(m["contexts"].as_u64().unwrap() >= 2, "{m}");
    }
    assert_eq!(r["speedups"].as_array().unwrap().len(), 4);
    let md = std::fs::read_to_string(out.join("contexts.md")).unwrap();
    for name in STRATEGIES {
        assert!(
            md.contains(&format!("| {name} |")),
            "{name} not in contexts.md"
        );
    }
    let svg = std::fs::read_to_string(out.join("contexts.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("ours"));
    // The swap files are gone.
    assert!(!out.join("kv-scratch").exists());
}

#[test]
fn runs_on_the_budgeted_device() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    run_ok(small(dir.path(), &out, "6").args([
        "--device",
        "sim",
        "--gpu-mem",
        "4M",
        "--strategies",
        "whole-swap,ours",
        "--kv-compression",
        "off",
        "--check",
    ]));
    let r = report(&out);
    assert_eq!(r["device"]["kind"], "sim");
    assert_eq!(r["model"]["kv_type"], "f16");
    assert_eq!(r["strategies"].as_array().unwrap().len(), 2);
    for name in ["whole-swap", "ours"] {
        let s = strategy(&r, name);
        assert_eq!(s["check"]["exact"], true, "{name}: {}", s["check"]);
    }
}

#[test]
fn bad_flags_are_refused_with_the_flag_named() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    for (args, expect) in [
        (vec!["--sticky", "1.5"], "probability"),
        (vec!["--user-tokens", "50-10"], "MIN-MAX"),
        (vec!["--answer-tokens", "0"], "MIN-MAX"),
        (vec!["--strategies", "ours,magic"], "not a strategy"),
        (vec!["--rate", "0"], "positive"),
        (vec!["--sweep", "2,x"], "number of contexts"),
        (vec!["--kv-compression", "lots"], "ratio"),
        (vec!["--ctx-size", "512"], "--ctx-size"),
        (vec!["--history-tokens", "100000"], "holds at most"),
        (vec!["--resident", "0"], "--resident"),
        (vec!["--gpu-mem", "1G", "--device", "cpu"], "--device sim"),
    ] {
        let o = bin(dir.path())
            .args(["bench", "contexts", "--random-corpus", "--calls", "4", "-m"])
            .arg(stories260k())
            .arg("--out")
            .arg(&out)
            .args(&args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{args:?} was accepted");
        assert!(err.contains(expect), "{args:?}: {err}");
    }
}
