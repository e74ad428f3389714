//! The commands end to end through the real binary: output formats (DESIGN §5), streaming,
//! environment variables, chat and perplexity.

mod common;

use std::process::Command;

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

fn ok(c: &mut Command) -> String {
    let out = c.output().expect("run binary");
    assert!(
        out.status.success(),
        "{:?}: {}",
        c,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 stdout")
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

#[test]
fn run_json_has_the_documented_fields_and_matches_the_stream() {
    let m = stories260k();
    let m = m.to_str().unwrap();
    let args = [
        "run",
        "-m",
        m,
        "--prompt",
        "Once upon a time",
        "--temperature",
        "0",
        "-n",
        "24",
    ];
    let json: Value = serde_json::from_str(&ok(bin().args(args).arg("--json"))).unwrap();
    assert_eq!(ids(&json["prompt_token_ids"]), [1, 403, 407, 261, 378]);
    assert_eq!(json["token_ids"].as_array().unwrap().len(), 24);
    for key in ["load_s", "prefill_tokens_per_s", "decode_tokens_per_s"] {
        assert!(
            json["timings"][key].as_f64().unwrap() > 0.0,
            "timings.{key}"
        );
    }
    assert!(
        json["memory"]["dram_read_bytes_per_token"]
            .as_f64()
            .unwrap()
            > 1e6
    );
    assert_eq!(json["stop_reason"], "length");
    let text = json["text"].as_str().unwrap();
    assert!(text.starts_with(", there was a little girl"), "{text:?}");
    // Streamed text is the same text.
    let streamed = ok(bin().args(args));
    assert_eq!(streamed.trim_end_matches('\n'), text);
}

#[test]
fn environment_variables_set_flags() {
    let m = stories260k();
    let out = ok(bin()
        .env("GPU_OFFLOAD_MODEL", &m)
        .env("GPU_OFFLOAD_TEMPERATURE", "0")
        .env("GPU_OFFLOAD_MAX_TOKENS", "5")
        .env("GPU_OFFLOAD_JSON", "true")
        .args(["run", "--prompt", "Once upon a time"]));
    let json: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(ids(&json["token_ids"]), [432, 383, 286, 261, 376]);
}

#[test]
fn logits_json_gives_one_row_per_position_asked() {
    let m = stories260k();
    let m = m.to_str().unwrap();
    let last: Value = serde_json::from_str(&ok(bin().args([
        "logits",
        "-m",
        m,
        "--tokens",
        "1,403,407",
        "--json",
    ])))
    .unwrap();
    let rows = last["logits"].as_array().unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].as_array().unwrap().len(), 512);
    let all: Value = serde_json::from_str(&ok(bin().args([
        "logits",
        "-m",
        m,
        "--tokens",
        "1,403,407",
        "--all-positions",
        "--json",
    ])))
    .unwrap();
    let all_rows = all["logits"].as_array().unwrap();
    assert_eq!(all_rows.len(), 3);
    assert_eq!(all_rows[2], rows[0]);
    let table = ok(bin().args([
        "logits",
        "-m",
        m,
        "--prompt",
        "Once upon a time",
        "--top",
        "3",
    ]));
    assert!(table.contains("position 4"), "{table}");
}

#[test]
fn hf_directory_with_tokenizer_runs_from_text() {
    let dir = fixtures().join("hf/llama-tok");
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let prompt = reference["greedy_prompt"].as_str().unwrap();
    let want = ids(&reference["greedy"]["generated_ids"]);
    let out = ok(bin().args([
        "run",
        "-m",
        dir.to_str().unwrap(),
        "--prompt",
        prompt,
        "--temperature",
        "0",
        "--ignore-eos",
        "-n",
        &want.len().to_string(),
        "--json",
    ]));
    let json: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        ids(&json["prompt_token_ids"]),
        ids(&reference["greedy"]["prompt_ids"])
    );
    assert_eq!(ids(&json["token_ids"]), want);
}

#[test]
fn chat_uses_the_models_template() {
    let Some(m) = smollm2() else { return };
    let out = ok(bin().args([
        "run",
        "-m",
        m.to_str().unwrap(),
        "--chat",
        "--system",
        "Be brief.",
        "--prompt",
        "Hi",
        "--temperature",
        "0",
        "-n",
        "4",
        "--json",
    ]));
    let json: Value = serde_json::from_str(&out).unwrap();
    // <|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n
    let p = ids(&json["prompt_token_ids"]);
    assert_eq!(p[0], 1, "starts with <|im_start|>: {p:?}");
    assert_eq!(
        p[p.len() - 4..],
        [1, 520, 9531, 198],
        "ends with <|im_start|>assistant\\n: {p:?}"
    );
    assert!(p.contains(&2), "contains <|im_end|>: {p:?}");
}

#[test]
fn perplexity_reports_json() {
    let m = stories260k();
    let dir = tempfile::tempdir().unwrap();
    let text = "Once upon a time, there was a little girl named Lily. She loved to play outside. "
        .repeat(12);
    let f = dir.path().join("t.txt");
    std::fs::write(&f, text).unwrap();
    let out = ok(bin().args([
        "perplexity",
        "-m",
        m.to_str().unwrap(),
        "--file",
        f.to_str().unwrap(),
        "--ctx",
        "64",
        "--json",
    ]));
    let json: Value = serde_json::from_str(&out).unwrap();
    let ppl = json["ppl"].as_f64().unwrap();
    // A repeated sentence from its own training distribution: low, finite perplexity.
    assert!(ppl > 1.0 && ppl < 20.0, "{json}");
    assert_eq!(json["ctx"], 64);
    assert!(json["tokens_scored"].as_u64().unwrap() >= 31);
}

#[test]
fn doctor_reports_host_figures_without_a_gpu() {
    let out = ok(bin().args([
        "doctor",
        "--json",
        "-t",
        "1",
        "--ssd-test-mib",
        "8",
        "--ssd-dir",
        std::env::temp_dir().to_str().unwrap(),
    ]));
    let json: Value = serde_json::from_str(&out).unwrap();
    assert!(json["host"]["dram_read_bytes_per_s"].as_f64().unwrap() > 1e8);
    assert!(json["host"]["logical_cores"].as_u64().unwrap() >= 1);
    // The rate the CPU attends a host-kept cache at, for the planner.
    let attention = json["profile"]["cpu_attention_bytes_per_s"]
        .as_f64()
        .unwrap();
    assert!(attention > 1e6, "{json}");
    // Without a GPU, the budgeted device's prompt attention rate (on the CPU).
    if json["gpu"].is_null() {
        let prompt = json["profile"]["attention_flops_per_s"].as_f64().unwrap();
        assert!(prompt > 1e6, "{json}");
    }
}

/// `bench decode --sessions 8` on the budgeted device at about a third of SmolLM2's size: the
/// sessions' batched steps need larger logits buffers than the single sequence before them, and
/// the budget's free bytes must not be in pieces by then (the buffers are made for the plan's
/// logit rows at once).
#[test]
fn batched_decode_bench_runs_at_a_third_of_the_model() {
    let Some(model) = smollm2() else {
        eprintln!("skipped: SmolLM2 not fetched (scripts/fetch-models.sh)");
        return;
    };
    let out = ok(bin().args(["bench", "decode", "-m"]).arg(&model).args([
        "--device",
        "sim",
        "--gpu-mem",
        "36M",
        "--sessions",
        "8",
        "--prompt-tokens",
        "64",
        "-n",
        "4",
        "--reps",
        "1",
    ]));
    assert!(out.contains("8 sequences together"), "{out}");
}

/// `bench decode --sessions 1,4,16 --modes stream,split,auto` on SmolLM2 on the budgeted
/// device: a row for every mode and count, each run under the plan for that count, with its
/// measured aggregate tokens/s beside the plan's prediction for that many sequences (a store
/// whose FFN is not bundled has no split: `--cold split` streams and says so).
#[test]
fn batch_aware_bench_reports_each_mode_at_each_count() {
    let Some(model) = smollm2() else {
        eprintln!("skipped: SmolLM2 not fetched (scripts/fetch-models.sh)");
        return;
    };
    let out = ok(bin().args(["bench", "decode", "-m"]).arg(&model).args([
        "--device",
        "sim",
        "--gpu-mem",
        "60M",
        "--sessions",
        "1,4,16",
        "--modes",
        "stream,split,auto",
        "--prompt-tokens",
        "16",
        "-n",
        "3",
        "--reps",
        "1",
        "--json",
    ]));
    let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    let rows = v["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 9, "{v}");
    for (row, (mode, n)) in rows.iter().zip(
        ["stream", "split", "auto"]
            .iter()
            .flat_map(|m| [1, 4, 16].map(|n| (*m, n))),
    ) {
        assert_eq!(row["mode"], mode, "{row}");
        assert_eq!(row["sessions"], n, "{row}");
        assert!(row["error"].is_null(), "{row}");
        assert!(
            row["aggregate_decode_tokens_per_s"].as_f64().unwrap() > 0.0,
            "{row}"
        );
        assert!(
            row["predicted_aggregate_tokens_per_s"].as_f64().unwrap() > 0.0,
            "{row}"
        );
        if mode != "auto" {
            assert_eq!(row["runs"], "stream", "matrices have no split: {row}");
        }
    }
}
