//! Predictions without `doctor`: with no saved profile a run prices its plan by this machine's
//! rates, measured at start and cached, and the plan says so. The one test here is alone in its
//! binary so nothing else runs beside its measurements (cargo runs test binaries one at a time).

mod common;

use std::path::Path;
use std::process::Command;

use serde_json::Value;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_gpu-offload"))
}

/// A command whose caches (stores, the saved profile, the rates cache) live under `dir`.
fn isolated(dir: &Path) -> Command {
    let mut c = bin();
    c.env("GPU_OFFLOAD_MODELS", dir.join("models"))
        .env_remove("GPU_OFFLOAD_HARDWARE")
        .env("RUST_LOG", "warn");
    c
}

fn json_of(c: &mut Command) -> Value {
    let out = c.output().expect("gpu-offload runs");
    assert!(
        out.status.success(),
        "{:?}: {}",
        c,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON on stdout")
}

/// SmolLM2 at a third of its size (to the MiB above) on the budgeted device: the plan's predicted decode tokens/s,
/// from rates measured at the start of the same run, of the order the run measures; the
/// plan names where its rates came from (measured at start, then read from the cache).
#[test]
fn predictions_without_a_saved_profile_come_from_measured_rates() {
    let Some(model) = common::smollm2() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let size = std::fs::metadata(&model).unwrap().len();
    // A third of the file, to the whole MiB above (a third exactly is 30 KiB short of what the
    // output matrix, a slot and the step need).
    let third = size.div_ceil(3).next_multiple_of(1 << 20).to_string();
    let m = model.to_string_lossy().into_owned();
    // A short warm-up converts the model into the isolated cache, so the measured run below
    // starts from the same page cache as any later run; it measures the rates first.
    let plan = || {
        json_of(isolated(dir.path()).args([
            "plan",
            "-m",
            &m,
            "--gpu-mem",
            &third,
            "--ctx-size",
            "64",
            "--batch",
            "16",
            "--json",
        ]))
    };
    let warm = plan();
    let source = warm["hardware"]["rates_source"]
        .as_str()
        .unwrap_or_default();
    assert!(
        source.contains("measured on this machine at start"),
        "{source}"
    );
    let again = plan();
    let source = again["hardware"]["rates_source"]
        .as_str()
        .unwrap_or_default();
    assert!(source.contains("by an earlier start"), "{source}");
    assert_eq!(warm["hardware"], {
        let mut h = again["hardware"].clone();
        h["rates_source"] = warm["hardware"]["rates_source"].clone();
        h
    });
    // Measured afresh for the run (the cache removed), so the rates and the decode it is held to
    // are taken under the same conditions.
    std::fs::remove_dir_all(dir.path().join("rates")).unwrap();
    let run = json_of(isolated(dir.path()).args([
        "bench",
        "decode",
        "--device",
        "sim",
        "-m",
        &m,
        "--gpu-mem",
        &third,
        "--prompt-tokens",
        "16",
        "-n",
        "64",
        "--reps",
        "3",
        "--json",
    ]));
    let measured = run["decode_tokens_per_s"].as_f64().unwrap();
    let predicted = run["predicted_tokens_per_s"].as_f64().unwrap();
    println!(
        "SmolLM2 at {third} bytes on the budgeted device: predicted {predicted:.1} tok/s, measured {measured:.1}"
    );
    // Tests do not hold wall-clock figures to a tolerance (a loaded CI machine moved this pair 26%
    // apart once): the closeness is `bench`'s to report. What is held is that the prediction is
    // priced by rates of this machine's order, not a default or a unit slip (a factor of 3).
    assert!(
        predicted.is_finite() && predicted > measured / 3.0 && predicted < measured * 3.0,
        "predicted {predicted:.1} tok/s, measured {measured:.1}: more than 3x apart"
    );
    // The whole model never fit: this is an offloaded run that streams.
    assert!(run["memory"]["h2d_bytes_per_token"].as_f64().unwrap() > 0.0);
}
