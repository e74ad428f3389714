//! With the same oracle masks, every FFN mode computes the same logits on a profiled SwiGLU
//! model (thresholds above zero, so a neuron near its threshold is where modes could part), in
//! multi-token steps and in one-token decode steps, on the budgeted device through the CLI as a
//! user runs it (`logits --all-positions --sparsity oracle`).
//!
//! A neuron's activation is computed by one kernel whichever op computes it (the whole FFN, a
//! cache unit's listed neurons, the host deciding a unit's set, the CPU's cold neurons, in two
//! passes or in one), and a token's down sum goes in one order (`DOWN_BLOCK`: each block of 64
//! neuron ids summed from zero, the blocks added in order; neurons a mask leaves off add
//! nothing; the resident rows and the split's CPU rows start on block boundaries, the CPU's
//! continuing the device's sum), so stream, the split, cache units and hybrid give the same
//! logits bit for bit. On SmolLM2 (Q4_1) the 8-bit
//! activations of the next matmuls amplify a last-bit difference about 10⁵-fold (two runs of one
//! command once differed by 1.5e-2 of the logit scale when the down sum's order followed the
//! threads, and the split by 2e-2 while it added the CPU's sum to the device's in a merge).

mod common;

use std::path::Path;
use std::process::Command;

fn bin(models: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_gpu-offload"));
    for (k, _) in std::env::vars() {
        if k.starts_with("GPU_OFFLOAD_") {
            c.env_remove(k);
        }
    }
    c.env("GPU_OFFLOAD_MODELS", models);
    c
}

/// Runs `c`, which must succeed: its standard output.
fn run(c: &mut Command) -> Vec<u8> {
    let out = c.output().unwrap();
    assert!(
        out.status.success(),
        "{c:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// The logits of every position of `tokens` (`logits --all-positions --json`) on the budgeted
/// device with oracle masks and an f32 KV cache, with `args` (the mode and its budget).
fn logits(store: &Path, tokens: &str, args: &[&str]) -> Vec<Vec<f32>> {
    let out = run(bin(store.parent().unwrap())
        .args(["logits", "-m"])
        .arg(store)
        .args([
            "--device",
            "sim",
            "--sparsity",
            "oracle",
            "--kv-type",
            "f32",
        ])
        .args(["--all-positions", "--json", "--tokens", tokens])
        .args(args));
    let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
    serde_json::from_value(v["logits"].clone()).unwrap()
}

/// The largest difference between `a` and `b` over every position, relative to `a`'s largest
/// magnitude.
fn rel_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = a.iter().flatten().fold(0f32, |m, v| m.max(v.abs()));
    let d = a
        .iter()
        .zip(b)
        .flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (p - q).abs()))
        .fold(0f32, f32::max);
    d / scale
}

fn greedy_rows(a: &[Vec<f32>]) -> Vec<u32> {
    a.iter().map(|r| common::greedy(r)).collect()
}

/// The log of `logits` with `args` at `--log info` (the plan it ran), for checks that a mode
/// really ran as named.
fn plan_log(store: &Path, tokens: &str, args: &[&str]) -> String {
    let out = bin(store.parent().unwrap())
        .args(["logits", "-m"])
        .arg(store)
        .args(["--device", "sim", "--sparsity", "oracle", "--log", "info"])
        .args(["--tokens", tokens])
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success());
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// `store` profiled (no predictors): what oracle masks threshold by.
fn profile(store: &Path, tokens: &str) {
    run(bin(store.parent().unwrap())
        .args(["profile", "-m"])
        .arg(store)
        .args(["--random-corpus", "--tokens", tokens, "--no-predictors"]));
}

/// Each mode at `budget` (and stream at 1G, everything resident) over `tokens`, in one prompt
/// step and one token a step: the logits of each, named.
fn modes(store: &Path, tokens: &str, budget: &str) -> Vec<(String, Vec<Vec<f32>>)> {
    let mut out = Vec::new();
    for step in [None, Some("1")] {
        let step_args: Vec<&str> = step.map_or(vec![], |s| vec!["--prefill-step", s]);
        for (cold, gpu) in [
            ("stream", "1G"),
            ("stream", budget),
            ("gpu", budget),
            ("cpu", budget),
            ("split", budget),
        ] {
            let mut args = vec!["--gpu-mem", gpu, "--cold", cold];
            if cold == "gpu" {
                args.extend(["--neuron-precision", "fp16"]);
            }
            args.extend(&step_args);
            let name = format!("--cold {cold} at {gpu}, prefill step {step:?}");
            out.push((name, logits(store, tokens, &args)));
        }
    }
    out
}

/// A synthesized SwiGLU model in f16 (float weights: no 8-bit activations to amplify rounding):
/// every mode bit for bit equal to the whole-device run; at a budget where hybrid keeps hot neurons on the device and the split gives
/// the CPU rows.
#[test]
fn every_mode_gives_the_same_logits_on_a_swiglu_model() {
    use gpu_offload::model::synth::{SynthSpec, synthesize_gguf};
    let dir = tempfile::tempdir().unwrap();
    let gguf = dir.path().join("swiglu.gguf");
    let spec = SynthSpec {
        n_layers: 6,
        d_model: 256,
        d_ff: 1024,
        n_heads: 4,
        n_kv_heads: 2,
        vocab_size: 512,
        power_law: Some(0.8),
        activation: "silu".into(),
        ..SynthSpec::preset("tiny").unwrap()
    };
    synthesize_gguf(&spec, &gguf, false, None, &mut |_, _| {}).unwrap();
    let store = dir.path().join("swiglu");
    run(bin(dir.path())
        .args(["convert", "-m"])
        .arg(&gguf)
        .arg("-o")
        .arg(&store));
    profile(&store, "600");
    let tokens = "5,17,99,23,400,7,8,311,42";
    let budget = "5M";
    let log = plan_log(&store, tokens, &["--gpu-mem", budget, "--cold", "cpu"]);
    assert!(
        log.contains("hybrid (--cold cpu)") && !log.contains("hot neurons 0 B"),
        "hybrid keeps hot neurons on the device at {budget}: {log}"
    );
    let log = plan_log(&store, tokens, &["--gpu-mem", budget, "--cold", "split"]);
    assert!(
        log.contains("on the CPU)"),
        "the split gives the CPU rows at {budget}: {log}"
    );
    let runs = modes(&store, tokens, budget);
    let reference = &runs[0].1;
    for (name, got) in &runs {
        let d = rel_diff(reference, got);
        assert_eq!(d, 0.0, "{name}: {d:.2e} of the logit scale");
    }
}

/// SmolLM2 bundled (`convert --bundle-ffn`), profiled: stream (whole and at 80M), the split
/// (the CPU's rows continuing the device's sum), cache units and hybrid (hot neurons on the
/// device) give the same logits in prompt steps and decode steps (within 1e-3 of the scale: bit
/// for bit here) and the same greedy tokens.
#[test]
fn every_mode_gives_the_same_logits_on_smollm2_bundled() {
    let Some(model) = common::smollm2() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("smol-bundled");
    run(bin(dir.path())
        .args(["convert", "--bundle-ffn", "-m"])
        .arg(&model)
        .arg("-o")
        .arg(&store));
    profile(&store, "300");
    let tokens = "504,1345,1920,4401,418,260,3146,284,1837";
    let log = plan_log(&store, tokens, &["--gpu-mem", "80M", "--cold", "cpu"]);
    assert!(
        log.contains("hybrid (--cold cpu)") && !log.contains("hot neurons 0 B"),
        "hybrid keeps hot neurons on the device at 80M: {log}"
    );
    // Each layer whole on the device or on the CPU: a layer split between them adds two sums
    // of its down products, and SmolLM2 amplifies that reassociation (an ulp at layer 0) to
    // 1.4e-2 of the logit scale. On the budgeted device no split pays (`plan::hybrid`).
    let split: Vec<&str> = log
        .lines()
        .filter(|l| l.split_whitespace().nth(1) == Some("hybrid"))
        .collect();
    assert!(split.is_empty(), "layers split at 80M: {split:?}");
    let log = plan_log(&store, tokens, &["--gpu-mem", "80M", "--cold", "split"]);
    assert!(
        log.contains("on the CPU)"),
        "the split gives the CPU rows at 80M: {log}"
    );
    let runs = modes(&store, tokens, "80M");
    let reference = &runs[0].1;
    for (name, got) in &runs {
        let d = rel_diff(reference, got);
        assert!(d <= 1e-3, "{name}: {d:.2e} of the logit scale");
        assert_eq!(greedy_rows(got), greedy_rows(reference), "{name}");
    }
}
