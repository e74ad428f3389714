//! `bench suite`, `bench decode`, `bench matvec` and `bench attention` through the real binary: the report's files
//! and fields, peers beside ours (fake llama-bench and python written here), emulation, bad
//! input, and bounds that are wrong. No test asserts a time: only statuses, fields and messages.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::*;
use serde_json::Value;

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_gpu-offload"));
    for (k, _) in std::env::vars() {
        if k.starts_with("GPU_OFFLOAD_") && k != "GPU_OFFLOAD_MODELS" {
            c.env_remove(k);
        }
    }
    c
}

/// The binary with its own model cache under `dir` (stores converted there, the SSD probe there
/// too), so tests running at once never convert into the same directory.
fn isolated(dir: &Path) -> Command {
    let mut c = bin();
    c.env("GPU_OFFLOAD_MODELS", dir.join("models"));
    c
}

fn run(c: &mut Command) -> Output {
    c.output().expect("run binary")
}

fn ok(c: &mut Command) -> String {
    let out = run(c);
    assert!(
        out.status.success(),
        "{:?}: {}",
        c,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 stdout")
}

/// The command fails; its stderr.
fn fails(c: &mut Command) -> String {
    let out = run(c);
    assert!(
        !out.status.success(),
        "{:?} should have failed; stdout: {}",
        c,
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn stories() -> String {
    stories260k().to_str().unwrap().to_string()
}

/// A hardware profile whose every rate is `rate` bytes/s.
fn profile(dir: &Path, name: &str, rate: f64) -> String {
    let p = dir.join(format!("{name}.json"));
    let v = serde_json::json!({
        "name": name, "hbm_bytes_per_s": rate, "h2d_pinned_bytes_per_s": rate,
        "h2d_pageable_bytes_per_s": rate, "dram_read_bytes_per_s": rate,
        "ssd_read_bytes_per_s": rate, "op_overhead_s": 1e-6, "device_bytes": 0
    });
    std::fs::write(&p, v.to_string()).unwrap();
    p.to_str().unwrap().to_string()
}

/// Rates no run can beat: bounds that hold.
fn sane(dir: &Path) -> String {
    profile(dir, "sane", 1e15)
}

/// Rates every run beats: bounds that are wrong.
fn tiny(dir: &Path) -> String {
    profile(dir, "tiny", 1000.0)
}

fn read_json(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

/// The SVG parses as XML, its root is `<svg>` and it has drawn lines and points.
fn assert_svg_drawn(p: &Path) {
    let text = std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    let doc = roxmltree::Document::parse(&text).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    let root = doc.root_element();
    assert_eq!(root.tag_name().name(), "svg", "{}", p.display());
    let count = |tag: &str| {
        root.descendants()
            .filter(|n| n.tag_name().name() == tag)
            .count()
    };
    assert!(count("polyline") > 0, "{}: no lines drawn", p.display());
    assert!(count("circle") > 0, "{}: no points drawn", p.display());
    assert!(count("text") > 0, "{}: no labels", p.display());
}

fn cells(j: &Value, key: &str) -> Vec<Value> {
    j[key].as_array().unwrap_or_else(|| panic!("{key}")).clone()
}

#[test]
fn suite_on_the_budgeted_device_writes_every_cell_beside_its_bound() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let m = stories();
    let args = [
        "bench",
        "suite",
        "-m",
        &m,
        "--device",
        "sim",
        "--prompts",
        "16,64",
        "-n",
        "8",
    ];
    ok(isolated(dir.path()).args(args).arg("--out").arg(&out));
    let j = read_json(&out.join("suite.json"));
    assert_eq!(j["schema"], "gpu-offload/bench-suite/1");
    assert_eq!(j["device"]["kind"], "sim");
    assert!(j["device"]["emulated"].is_null());
    assert!(
        j["rates"]["source"]
            .as_str()
            .unwrap()
            .starts_with("measured live")
    );
    // A tiny model: the whole model, the midpoint and the minimum.
    let budgets = cells(&j, "budgets");
    let labels: Vec<&str> = budgets
        .iter()
        .map(|b| b["label"].as_str().unwrap())
        .collect();
    assert_eq!(labels.len(), 3, "{labels:?}");
    assert_eq!(labels[0], "whole");
    assert!(
        labels[1].starts_with("mid") && labels[2].starts_with("min"),
        "{labels:?}"
    );
    let decode = cells(&j, "decode");
    assert_eq!(decode.len(), 3);
    for c in &decode {
        assert_eq!(c["status"], "ok", "{c}");
        assert!(c["tokens_per_s"].as_f64().unwrap() > 0.0, "{c}");
        assert!(c["bound_tokens_per_s"].as_f64().unwrap() > 0.0, "{c}");
        assert!(c["predicted_tokens_per_s"].as_f64().unwrap() > 0.0, "{c}");
        let f = c["fraction_of_bound"].as_f64().unwrap();
        assert!(f > 0.0 && f <= 1.05, "{c}");
        assert!(c["bound_limited_by"].is_string(), "{c}");
        assert!(c.get("gpu_process_peak_bytes").is_some(), "{c}");
        // The ledger honours the budget.
        let peak = c["gpu_peak_bytes"].as_u64().unwrap();
        assert!(peak > 0);
        if let Some(b) = c["gpu_mem_bytes"].as_u64() {
            assert!(peak <= b, "{c}");
        }
    }
    let prefill = cells(&j, "prefill");
    assert_eq!(prefill.len(), 3 * 2);
    for c in &prefill {
        assert!(c.get("predicted_tokens_per_s").is_some(), "{c}");
        match c["status"].as_str().unwrap() {
            "ok" => {
                assert!(c["ttft_s"].as_f64().unwrap() > 0.0, "{c}");
                assert!(c["tokens_per_s"].as_f64().unwrap() > 0.0, "{c}");
                assert!(c["bound_ttft_s"].as_f64().unwrap() > 0.0, "{c}");
                assert!(c["fraction_of_bound"].as_f64().unwrap() > 0.0, "{c}");
            }
            "refused" => assert!(c["reason"].as_str().unwrap().contains("at least"), "{c}"),
            s => panic!("status {s}: {c}"),
        }
    }
    // The whole model runs every prompt.
    assert!(
        prefill
            .iter()
            .filter(|c| c["budget"] == "whole")
            .all(|c| c["status"] == "ok")
    );
    // Peers absent: "not run", with the reason.
    for p in cells(&j, "peers") {
        assert_eq!(p["status"], "not_run", "{p}");
        assert!(p["reason"].as_str().unwrap().contains("--"), "{p}");
    }
    assert_eq!(j["problems"].as_array().unwrap().len(), 0);
    let md = std::fs::read_to_string(out.join("suite.md")).unwrap();
    assert!(md.contains("## Decode tokens/s by --gpu-mem"), "{md}");
    assert!(
        md.contains("| --gpu-mem | status | tok/s | bound (limited by) |"),
        "{md}"
    );
    assert!(md.contains("| whole | ok |"), "{md}");
    assert!(md.contains("## Time to first token"), "{md}");
    assert!(md.contains("not run: no llama-bench given"), "{md}");
    assert!(
        md.contains("(decode.svg)") && md.contains("(ttft.svg)"),
        "{md}"
    );
    assert_svg_drawn(&out.join("decode.svg"));
    assert_svg_drawn(&out.join("ttft.svg"));
    // No temporary files left behind.
    for e in std::fs::read_dir(&out).unwrap() {
        let name = e.unwrap().file_name().to_string_lossy().into_owned();
        assert!(!name.starts_with('.'), "left behind: {name}");
    }
}

/// A fake `llama-bench` that prints canned `-o json` results (with the -ngl it was given) and
/// logs its arguments.
fn fake_llama_bench(dir: &Path) -> PathBuf {
    let p = dir.join("llama-bench");
    let script = r#"#!/bin/sh
echo "$@" >> "$(dirname "$0")/llama-bench.args"
ngl=99
while [ $# -gt 0 ]; do
  if [ "$1" = "-ngl" ]; then ngl="$2"; fi
  shift
done
echo "ggml_cuda_init: found 1 CUDA devices (fake)" >&2
cat <<JSON
[
  {"build_commit": "fake123", "build_number": 1, "backends": "CUDA", "gpu_info": "Fake GPU",
   "model_type": "llama ?B all F32", "model_size": 1000000, "n_gpu_layers": $ngl,
   "flash_attn": true, "n_prompt": 16, "n_gen": 0, "avg_ts": 4321.5, "stddev_ts": 3.0},
  {"build_commit": "fake123", "build_number": 1, "backends": "CUDA", "gpu_info": "Fake GPU",
   "model_type": "llama ?B all F32", "model_size": 1000000, "n_gpu_layers": $ngl,
   "flash_attn": true, "n_prompt": 0, "n_gen": 4, "avg_ts": 1234.5, "stddev_ts": 2.0}
]
JSON
"#;
    std::fs::write(&p, script).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    p
}

#[test]
fn llama_bench_peer_appears_beside_ours_and_a_missing_one_is_not_run() {
    let dir = tempfile::tempdir().unwrap();
    let lb = fake_llama_bench(dir.path());
    let m = stories();
    let hw = sane(dir.path());
    let out = dir.path().join("out");
    let base = [
        "bench",
        "suite",
        "-m",
        &m,
        "--device",
        "sim",
        "--budgets",
        "whole,1G",
        "--prompts",
        "16",
        "-n",
        "4",
        "--hardware",
        &hw,
    ];
    ok(isolated(dir.path())
        .args(base)
        .arg("--out")
        .arg(&out)
        .arg("--llama-bench")
        .arg(&lb));
    let j = read_json(&out.join("suite.json"));
    let peer = &j["peers"][0];
    assert_eq!(peer["name"], "llama.cpp (llama-bench)");
    assert_eq!(peer["status"], "ok", "{peer}");
    assert_eq!(peer["info"]["build_commit"], "fake123");
    let r = &peer["runs"][0];
    assert_eq!(r["budget"], "whole");
    assert_eq!(r["setting"], "-ngl 99 -fa 1");
    assert_eq!(r["n_gpu_layers"], 99);
    assert_eq!(r["decode_tokens_per_s"], 1234.5);
    assert_eq!(r["prefill"][0]["prompt_tokens"], 16);
    assert_eq!(r["prefill"][0]["tokens_per_s"], 4321.5);
    // At a budget: the largest -ngl whose process fits (5 layers + the output matrix within
    // 1 GiB, the default fixed process cost included).
    let r = &peer["runs"][1];
    assert_eq!(r["budget"], "1.0 GiB");
    assert_eq!(r["setting"], "-ngl 6 -fa 1");
    assert_eq!(r["n_gpu_layers"], 6);
    assert!(r["estimated_bytes"].as_u64().unwrap() <= 1 << 30);
    let args = std::fs::read_to_string(dir.path().join("llama-bench.args")).unwrap();
    for a in ["-m", "-p 16", "-n 4", "-ngl 99", "-fa 1", "-o json"] {
        assert!(args.contains(a), "{a} not in {args}");
    }
    let md = std::fs::read_to_string(out.join("suite.md")).unwrap();
    assert!(md.contains("llama.cpp (llama-bench) tok/s"), "{md}");
    assert!(md.contains("1234.50 (-ngl 99 -fa 1)"), "{md}");
    assert!(md.contains("### llama.cpp (llama-bench)"), "{md}");

    // A llama-bench that is not there: not run, with the reason; the suite itself succeeds.
    let out2 = dir.path().join("out2");
    ok(isolated(dir.path()).args(base).arg("--out").arg(&out2).env(
        "GPU_OFFLOAD_LLAMA_BENCH",
        dir.path().join("no-such-llama-bench"),
    ));
    let j = read_json(&out2.join("suite.json"));
    assert_eq!(j["peers"][0]["status"], "not_run");
    assert!(
        j["peers"][0]["reason"]
            .as_str()
            .unwrap()
            .contains("does not exist")
    );
    let md = std::fs::read_to_string(out2.join("suite.md")).unwrap();
    assert!(md.contains("not run: llama-bench"), "{md}");

    // A llama-bench that fails: the peer says so with its stderr; ours still stands.
    let broken = dir.path().join("broken-llama-bench");
    std::fs::write(
        &broken,
        "#!/bin/sh\necho 'CUDA error: out of memory' >&2\nexit 1\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&broken, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out3 = dir.path().join("out3");
    ok(isolated(dir.path())
        .args(base)
        .arg("--out")
        .arg(&out3)
        .arg("--llama-bench")
        .arg(&broken));
    let j = read_json(&out3.join("suite.json"));
    assert_eq!(j["peers"][0]["status"], "failed");
    assert!(
        j["peers"][0]["reason"]
            .as_str()
            .unwrap()
            .contains("out of memory")
    );
    assert!(
        j["decode"]
            .as_array()
            .unwrap()
            .iter()
            .all(|c| c["status"] == "ok")
    );
}

#[test]
fn a_preset_model_runs_from_env_vars_with_the_transformers_peer() {
    let dir = tempfile::tempdir().unwrap();
    let models = dir.path().join("models");
    // A fake python: whatever script it is given, prints peer_hf.py's JSON line.
    let py = dir.path().join("python");
    std::fs::write(
        &py,
        "#!/bin/sh\necho loading >&2\necho '{\"peer\": \"transformers (fake)\", \"torch\": \"0\", \"ttft_s\": 0.01, \"decode_tokens_per_s\": 77.5, \"prefill\": [{\"prompt_tokens\": 16, \"ttft_s\": 0.02}]}'\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&py, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = dir.path().join("out");
    ok(isolated(dir.path())
        .args(["bench", "suite"])
        .env("GPU_OFFLOAD_MODELS", &models)
        .env("GPU_OFFLOAD_PRESET", "tiny")
        .env("GPU_OFFLOAD_DEVICE", "sim")
        .env("GPU_OFFLOAD_OUT", &out)
        .env("GPU_OFFLOAD_BUDGETS", "whole,min")
        .env("GPU_OFFLOAD_PROMPTS", "16")
        .env("GPU_OFFLOAD_TOKENS", "4")
        .env("GPU_OFFLOAD_HARDWARE", sane(dir.path()))
        .env("GPU_OFFLOAD_PEER_HF", &py));
    let j = read_json(&out.join("suite.json"));
    assert!(
        j["model"]["source"]
            .as_str()
            .unwrap()
            .starts_with("preset tiny")
    );
    assert!(models.join("synth/tiny/config.json").is_file());
    let labels: Vec<&str> = j["budgets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["label"].as_str().unwrap())
        .collect();
    assert_eq!(labels.len(), 2, "{labels:?}");
    assert!(
        j["decode"]
            .as_array()
            .unwrap()
            .iter()
            .all(|c| c["status"] == "ok")
    );
    let hf = &j["peers"][1];
    assert_eq!(hf["name"], "transformers + accelerate");
    assert_eq!(hf["status"], "ok", "{hf}");
    assert_eq!(hf["runs"][0]["decode_tokens_per_s"], 77.5);
    assert_eq!(hf["runs"][0]["prefill"][0]["ttft_s"], 0.02);
    assert!(
        hf["runs"][1]["setting"]
            .as_str()
            .unwrap()
            .starts_with("max_memory")
    );
    // llama-bench needs a GGUF; this model is an HF directory.
    assert_eq!(j["peers"][0]["status"], "not_run");
}

#[test]
fn an_emulated_card_is_said_and_caps_the_budgets() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let m = stories();
    ok(isolated(dir.path())
        .args([
            "bench",
            "suite",
            "-m",
            &m,
            "--device",
            "sim",
            "--emulate",
            "rtx3060-12g",
        ])
        .args([
            "--budgets",
            "whole,24G,12G,min",
            "--prompts",
            "16",
            "-n",
            "4",
            "--out",
        ])
        .arg(&out));
    let j = read_json(&out.join("suite.json"));
    assert_eq!(j["device"]["emulated"]["preset"], "rtx3060-12g");
    assert!(
        j["device"]["emulated"]["on"]
            .as_str()
            .unwrap()
            .contains("budgeted CPU device")
    );
    // The card's PCIe pace, this machine's other rates.
    let source = j["rates"]["source"].as_str().unwrap();
    assert!(
        source.contains("measured live") && source.contains("rtx3060-12g's 12.5 GB/s"),
        "{source}"
    );
    assert_eq!(j["rates"]["h2d_bytes_per_s"].as_f64(), Some(12.5e9));
    let twelve = 12u64 << 30;
    for key in ["budgets", "decode", "prefill"] {
        for c in j[key].as_array().unwrap() {
            if let Some(b) = c["gpu_mem_bytes"].as_u64() {
                assert!(b <= twelve, "{key}: {c}");
            }
        }
    }
    let labels: Vec<&str> = j["budgets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["label"].as_str().unwrap())
        .collect();
    assert_eq!(labels.len(), 3, "24G dropped: {labels:?}");
    let md = std::fs::read_to_string(out.join("suite.md")).unwrap();
    assert!(md.contains("**Emulated rtx3060-12g**"), "{md}");
}

#[test]
fn bad_suite_input_gives_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let m = stories();
    let out = dir.path().join("out");
    let suite = |extra: &[&str]| {
        let mut c = isolated(dir.path());
        c.args(["bench", "suite", "-m", &m, "--device", "sim", "--out"])
            .arg(&out)
            .args(extra);
        c
    };
    let e = fails(&mut suite(&["--emulate", "gtx-9999"]));
    assert!(e.contains("gtx-9999") && e.contains("rtx3060-12g"), "{e}");
    let e = fails(&mut suite(&["--budgets", "4G,lots"]));
    assert!(e.contains("lots") && e.contains("whole"), "{e}");
    let e = fails(&mut suite(&["--prompts", "16,0"]));
    assert!(e.contains("positive"), "{e}");
    let e = fails(&mut suite(&["--gpu-mem", "4G"]));
    assert!(e.contains("--budgets"), "{e}");
    let e = fails(
        isolated(dir.path())
            .args(["bench", "suite", "-m", &m, "--device", "cpu", "--out"])
            .arg(&out),
    );
    assert!(e.contains("--device sim"), "{e}");
    let e = fails(&mut suite(&["--preset", "tiny"]));
    assert!(e.contains("not both"), "{e}");
    let e = fails(
        isolated(dir.path())
            .args(["bench", "suite", "--preset", "huge", "--out"])
            .arg(&out),
    );
    assert!(e.contains("huge") && e.contains("unknown"), "{e}");
    // An output directory that cannot be made (a file is in the way).
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let e = fails(
        isolated(dir.path())
            .args(["bench", "suite", "-m", &m, "--device", "sim", "--out"])
            .arg(file.join("sub")),
    );
    assert!(e.contains("--out") && e.contains("cannot create"), "{e}");
}

#[test]
fn matvec_above_its_bound_fails_naming_the_bound() {
    let dir = tempfile::tempdir().unwrap();
    let args = [
        "bench", "matvec", "--device", "cpu", "--rows", "256", "--cols", "256", "--reps", "2",
        "--dtype", "f32",
    ];
    let e = fails(bin().args(args).args(["--hardware", &tiny(dir.path())]));
    assert!(
        e.contains("DRAM read bound") && e.contains("bound is wrong"),
        "{e}"
    );
    ok(bin().args(args).args(["--hardware", &sane(dir.path())]));
}

#[test]
fn decode_above_its_bound_fails_naming_the_bound() {
    let dir = tempfile::tempdir().unwrap();
    let m = stories();
    let args = [
        "bench",
        "decode",
        "--device",
        "cpu",
        "-m",
        &m,
        "--prompt-tokens",
        "4",
        "-n",
        "4",
        "--reps",
        "1",
        "--json",
    ];
    let out = run(bin().args(args).args(["--hardware", &tiny(dir.path())]));
    assert!(!out.status.success());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(
        e.contains("DRAM bound") && e.contains("bound is wrong"),
        "{e}"
    );
    // The result is still printed before the error.
    let j: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(j["fraction_of_bound"].as_f64().unwrap() > 1.05);
    let j: Value = serde_json::from_str(&ok(bin()
        .args(args)
        .args(["--hardware", &sane(dir.path())])))
    .unwrap();
    assert_eq!(j["bound_limited_by"], "DRAM");
    assert!(j["bound_tokens_per_s"].as_f64().unwrap() > 0.0);
}

#[test]
fn attention_reports_the_causal_flops_beside_a_matrix_product() {
    let args = [
        "bench",
        "attention",
        "--device",
        "cpu",
        "--rows",
        "20",
        "--context",
        "30",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--head-dim",
        "64",
        "--reps",
        "1",
    ];
    for kv in ["f32", "f16", "q8_0"] {
        let out = ok(bin().args(args).args(["--kv-type", kv, "--json"]));
        let v: Value = serde_json::from_str(out.trim()).unwrap();
        // Rows at positions 30..50 each see 31..=50 keys: 810 in all, 4 FLOPs per dim of 4 heads of 64.
        assert_eq!(v["flops"].as_f64(), Some(4.0 * 256.0 * 810.0), "{v}");
        assert_eq!(v["kv_type"], kv, "{v}");
        let (rate, matmul) = (
            v["flops_per_s"].as_f64().unwrap(),
            v["matmul_flops_per_s"].as_f64().unwrap(),
        );
        assert!(rate > 0.0 && matmul > 0.0, "{v}");
        assert!(
            (v["fraction_of_matmul"].as_f64().unwrap() - rate / matmul).abs() < 1e-9,
            "{v}"
        );
    }
    let bad = ["bench", "attention", "--rows", "4", "--reps", "1"];
    let e = fails(
        bin()
            .args(bad)
            .args(["--device", "cpu", "--heads", "4", "--kv-heads", "3"]),
    );
    assert!(e.contains("--kv-heads must divide --heads"), "{e}");
    let e = fails(bin().args(bad).args(["--device", "sim"]));
    assert!(e.contains("runs on cpu or cuda"), "{e}");
}
