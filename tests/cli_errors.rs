//! Bad input through the real binary: each case must exit non-zero with one clear error line
//! naming the problem, and never panic.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::*;

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_gpu-offload"));
    // Keep the user's environment from changing what is tested.
    for (k, _) in std::env::vars() {
        if k.starts_with("GPU_OFFLOAD_") && k != "GPU_OFFLOAD_MODELS" {
            c.env_remove(k);
        }
    }
    c
}

/// Run, and check: failure, no panic, the first stderr line starts with `error` and contains
/// every `needles` item. Returns the first line.
fn fails_with(args: &[&str], needles: &[&str]) -> String {
    let out: Output = bin().args(args).output().expect("run binary");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "{args:?} succeeded; stderr: {stderr}"
    );
    assert!(!stderr.contains("panicked"), "{args:?} panicked: {stderr}");
    let first = stderr.lines().next().unwrap_or("").to_string();
    assert!(first.starts_with("error"), "{args:?}: first line {first:?}");
    for n in needles {
        assert!(
            first.contains(n),
            "{args:?}: {first:?} does not mention {n:?}"
        );
    }
    first
}

fn path_str(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

#[test]
fn missing_model_file_is_named() {
    fails_with(
        &["run", "-m", "/nonexistent/model.gguf", "--tokens", "1"],
        &["/nonexistent/model.gguf"],
    );
}

#[test]
fn corrupt_file_is_not_a_gguf() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("junk.gguf");
    std::fs::write(&p, b"this is not a model at all, just some text").unwrap();
    fails_with(
        &["run", "-m", path_str(&p), "--tokens", "1"],
        &["junk.gguf", "not a GGUF file"],
    );
}

#[test]
fn truncated_gguf_says_truncated_at_every_cut() {
    let full = std::fs::read(stories260k()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("cut.gguf");
    // Header, metadata, tensor directory and data: cut inside each.
    for len in [10, 200, 5000, 20000, full.len() / 2, full.len() - 1] {
        std::fs::write(&p, &full[..len]).unwrap();
        let line = fails_with(
            &["logits", "-m", path_str(&p), "--tokens", "1", "--json"],
            &["cut.gguf"],
        );
        assert!(
            line.contains("truncated") || line.contains("beyond the end"),
            "cut at {len}: {line}"
        );
    }
}

#[test]
fn unknown_architecture_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("mamba.gguf");
    tiny_llama_gguf(&p, "mamba", 0, (1, 4));
    fails_with(
        &["run", "-m", path_str(&p), "--tokens", "1"],
        &["unknown architecture `mamba`"],
    );
}

#[test]
fn unsupported_quant_type_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("iq4_nl.gguf");
    tiny_llama_gguf(&p, "llama", 20, (32, 18)); // IQ4_NL: no kernel computes it
    fails_with(
        &["run", "-m", path_str(&p), "--tokens", "1"],
        &["IQ4_NL", "not supported", "ffn_gate"],
    );
}

#[test]
fn a_tiny_valid_gguf_runs() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("ok.gguf");
    tiny_llama_gguf(&p, "llama", 0, (1, 4));
    let out = bin()
        .args([
            "run",
            "-m",
            path_str(&p),
            "--tokens",
            "1,2,3",
            "-n",
            "4",
            "--temperature",
            "0",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["token_ids"].as_array().unwrap().len(), 4);
}

#[test]
fn prompt_longer_than_the_context_is_refused() {
    let m = stories260k();
    let ids: Vec<String> = (0..600).map(|i| (i % 500 + 1).to_string()).collect();
    let ids = ids.join(",");
    fails_with(
        &["run", "-m", path_str(&m), "--tokens", &ids],
        &["600 tokens", "512"],
    );
    fails_with(
        &[
            "logits",
            "-m",
            path_str(&m),
            "--tokens",
            "1,2,3",
            "--ctx-size",
            "2",
        ],
        &["3 tokens", "2"],
    );
    fails_with(
        &[
            "run",
            "-m",
            path_str(&m),
            "--tokens",
            "1",
            "--ctx-size",
            "4096",
        ],
        &["--ctx-size 4096", "512"],
    );
}

#[test]
fn token_outside_the_vocabulary_is_refused() {
    let m = stories260k();
    fails_with(
        &["logits", "-m", path_str(&m), "--tokens", "1,99999"],
        &["99999", "vocabulary"],
    );
}

#[test]
fn invalid_flag_values_name_the_flag() {
    let m = stories260k();
    let m = path_str(&m);
    fails_with(
        &["run", "-m", m, "--tokens", "1", "--temperature", "-1"],
        &["temperature"],
    );
    fails_with(
        &["run", "-m", m, "--tokens", "1", "--top-p", "1.5"],
        &["top-p"],
    );
    fails_with(
        &["run", "-m", m, "--tokens", "1", "--min-p", "-0.5"],
        &["min-p"],
    );
    fails_with(
        &["run", "-m", m, "--tokens", "1", "--max-tokens", "many"],
        &["--max-tokens"],
    );
    fails_with(
        &["run", "-m", m, "--tokens", "1", "--threads", "0"],
        &["--threads"],
    );
    fails_with(&["run", "-m", m, "--tokens", "1,x,3"], &["--tokens"]);
    fails_with(
        &["run", "-m", m, "--tokens", "1", "--ctx-size", "0"],
        &["--ctx-size"],
    );
    fails_with(
        &["run", "-m", m, "--tokens", "1", "--device", "tpu"],
        &["--device"],
    );
    fails_with(
        &["perplexity", "-m", m, "--file", "/nonexistent.txt"],
        &["/nonexistent.txt"],
    );
    fails_with(
        &["run", "-m", m, "--tokens", "1", "--prompt", "both"],
        &["--prompt"],
    );
    // Batch sizes: at least one sequence, a list of whole numbers, modes by name.
    for bad in ["0", "1,0,4", "1,x", "4,,16"] {
        fails_with(
            &[
                "bench",
                "decode",
                "-m",
                m,
                "--device",
                "sim",
                "--sessions",
                bad,
            ],
            &["--sessions"],
        );
    }
    fails_with(
        &[
            "bench",
            "decode",
            "-m",
            m,
            "--device",
            "sim",
            "--modes",
            "stream,fast",
        ],
        &["--modes"],
    );
    fails_with(
        &["plan", "-m", m, "--gpu-mem", "1M", "--parallel", "0"],
        &["--parallel"],
    );
    fails_with(&["serve", "-m", m, "--parallel", "0"], &["--parallel"]);
    // Shares of neurons: NaN once ran with every threshold NaN (exit 0, issue 39).
    for bad in ["NaN", "inf", "2", "0"] {
        fails_with(
            &[
                "run",
                "-m",
                m,
                "--tokens",
                "1",
                "--sparsity",
                "oracle",
                "--sparsity-target",
                bad,
            ],
            &["--sparsity-target", "0.01..=0.99"],
        );
        fails_with(
            &["plan", "-m", m, "--gpu-mem", "1G", "--sparsity-target", bad],
            &["--sparsity-target"],
        );
        fails_with(
            &["profile", "-m", m, "--predictor-target", bad],
            &["--predictor-target"],
        );
    }
}

#[test]
fn text_prompt_needs_a_tokenizer() {
    let dir = fixtures().join("hf/llama-gqa");
    fails_with(
        &["run", "-m", path_str(&dir), "--prompt", "hello"],
        &["no tokenizer", "--tokens"],
    );
}

#[test]
fn broken_hf_directories_are_named() {
    let dir = tempfile::tempdir().unwrap();
    fails_with(
        &["run", "-m", path_str(dir.path()), "--tokens", "1"],
        &["config.json"],
    );

    std::fs::write(dir.path().join("config.json"), "{ not json").unwrap();
    fails_with(
        &["run", "-m", path_str(dir.path()), "--tokens", "1"],
        &["config.json", "JSON"],
    );

    let src = fixtures().join("hf/llama-gqa");
    std::fs::copy(src.join("config.json"), dir.path().join("config.json")).unwrap();
    fails_with(
        &["run", "-m", path_str(dir.path()), "--tokens", "1"],
        &["model.safetensors"],
    );

    let weights = std::fs::read(src.join("model.safetensors")).unwrap();
    std::fs::write(
        dir.path().join("model.safetensors"),
        &weights[..weights.len() - 100],
    )
    .unwrap();
    fails_with(
        &["run", "-m", path_str(dir.path()), "--tokens", "1"],
        &["model.safetensors"],
    );

    let cfg = std::fs::read_to_string(src.join("config.json")).unwrap();
    std::fs::write(dir.path().join("model.safetensors"), &weights).unwrap();
    std::fs::write(
        dir.path().join("config.json"),
        cfg.replace("\"llama\"", "\"mamba\""),
    )
    .unwrap();
    fails_with(
        &["run", "-m", path_str(dir.path()), "--tokens", "1"],
        &["unknown architecture `mamba`"],
    );

    std::fs::write(
        dir.path().join("config.json"),
        cfg.replace("\"hidden_size\": 64", "\"hidden_size\": 48"),
    )
    .unwrap();
    fails_with(
        &["run", "-m", path_str(dir.path()), "--tokens", "1"],
        &["shape"],
    );
}

#[test]
fn missing_default_model_points_to_the_fetch_script() {
    let dir = tempfile::tempdir().unwrap();
    let out = bin()
        .env("GPU_OFFLOAD_MODELS", dir.path())
        .args(["run", "--prompt", "hi"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("scripts/fetch-models.sh"), "{err}");
}
