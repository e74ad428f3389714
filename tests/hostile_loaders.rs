//! Hostile model files through the real binary (issue 39): files crafted to make a loader
//! allocate without bound, numbers no weights can have, and weights that turn a run's logits
//! non-finite. Each must end in one clear error line, never an abort, a panic or garbage output.
//! Memory-hungry cases run in a child under an address-space cap, so old code aborts fast
//! instead of exhausting the machine.

mod common;

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::*;
use gpu_offload::model::gguf::GgufFile;

fn bin_path() -> &'static str {
    env!("CARGO_BIN_EXE_gpu-offload")
}

fn clean(c: &mut Command) -> &mut Command {
    for (k, _) in std::env::vars() {
        if k.starts_with("GPU_OFFLOAD_") && k != "GPU_OFFLOAD_MODELS" {
            c.env_remove(k);
        }
    }
    c
}

fn run(args: &[&str]) -> Output {
    clean(&mut Command::new(bin_path()))
        .args(args)
        .output()
        .expect("run binary")
}

/// Run the binary with its address space capped at `mib` MiB (`ulimit -v` in a shell).
fn run_capped(mib: u64, args: &[&str]) -> Output {
    clean(&mut Command::new("sh"))
        .arg("-c")
        .arg("ulimit -v $1 && shift && exec \"$@\"")
        .arg("sh")
        .arg((mib * 1024).to_string())
        .arg(bin_path())
        .args(args)
        // Fewer malloc arenas: each reserves 64 MiB of address space per thread.
        .env("MALLOC_ARENA_MAX", "2")
        .output()
        .expect("run capped binary")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The run failed cleanly: exit code 1 (not a signal, not a panic's 101), and its first stderr
/// line is an error mentioning every needle.
fn clean_error(o: &Output, needles: &[&str]) -> String {
    let err = stderr(o);
    assert_eq!(
        o.status.code(),
        Some(1),
        "expected a clean error (exit 1), got {:?}; stderr: {err}",
        o.status
    );
    assert!(!err.contains("panicked"), "panicked: {err}");
    let first = err.lines().next().unwrap_or("").to_string();
    assert!(first.starts_with("error"), "first line {first:?}");
    for n in needles {
        assert!(first.contains(n), "{first:?} does not mention {n:?}");
    }
    first
}

fn succeeded(o: &Output) {
    assert!(
        o.status.success(),
        "expected success, got {:?}; stderr: {}",
        o.status,
        stderr(o)
    );
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// A greedy 2-token run of `model` from tokens 1, 2, on the CPU (a GPU's driver reserves more
/// address space than the caps allow).
fn run_args(model: &Path) -> Vec<String> {
    [
        "run",
        "-m",
        s(model),
        "--device",
        "cpu",
        "--tokens",
        "1,2",
        "-n",
        "2",
        "--temperature",
        "0",
    ]
    .iter()
    .map(|a| a.to_string())
    .collect()
}

fn as_strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// stories260K with one metadata array of u8 inserted first: `key`, at least `len` zero
/// elements, streamed to disk. The inserted bytes are padded (by more elements) to a multiple
/// of 256 so the data section keeps its alignment.
fn with_inserted_array(dir: &Path, key: &str, len: u64) -> PathBuf {
    let (elem, elem_bytes) = (0u32, 1u64);
    let orig = std::fs::read(stories260k()).unwrap();
    let n_kv = u64::from_le_bytes(orig[16..24].try_into().unwrap());
    let head = 8 + key.len() as u64 + 4 + 4 + 8;
    let len = (head + len).next_multiple_of(256) - head;
    let path = dir.join("big-array.gguf");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
    f.write_all(&orig[..16]).unwrap();
    f.write_all(&(n_kv + 1).to_le_bytes()).unwrap();
    f.write_all(&(key.len() as u64).to_le_bytes()).unwrap();
    f.write_all(key.as_bytes()).unwrap();
    f.write_all(&9u32.to_le_bytes()).unwrap();
    f.write_all(&elem.to_le_bytes()).unwrap();
    f.write_all(&len.to_le_bytes()).unwrap();
    let zeros = vec![0u8; 1 << 20];
    let mut left = len * elem_bytes;
    while left > 0 {
        let n = left.min(zeros.len() as u64);
        f.write_all(&zeros[..n as usize]).unwrap();
        left -= n;
    }
    f.write_all(&orig[24..]).unwrap();
    f.flush().unwrap();
    path
}

/// Defect 1: a 100 MB metadata array the runtime never reads took 32x its size in memory
/// (3.2 GB for this one: an abort under the cap). It must load and run within 1.5 GiB of
/// address space.
#[test]
fn an_unused_metadata_array_is_not_expanded() {
    let dir = tempfile::tempdir().unwrap();
    let p = with_inserted_array(dir.path(), "zz.unused.blob", 100_000_000);
    let args = run_args(&p);
    succeeded(&run_capped(1536, &as_strs(&args)));
    // The same file still works as a source: `convert` copies its metadata through.
    let store = dir.path().join("store");
    succeeded(&run_capped(
        1536,
        &["convert", "-m", s(&p), "-o", s(&store)],
    ));
}

/// Defect 1: an array the runtime reads (merges) whose in-memory size exceeds
/// `max_metadata_array_bytes` is refused by name (on disk it is only 9 MB of u8).
#[test]
fn a_kept_metadata_array_over_the_limit_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let p = with_inserted_array(dir.path(), "tokenizer.ggml.merges", 9_000_000);
    let args = run_args(&p);
    clean_error(
        &run_capped(1536, &as_strs(&args)),
        &["max_metadata_array_bytes"],
    );
}

/// A tiny HF directory written by `synth`.
fn tiny_hf(dir: &Path) -> PathBuf {
    let out = dir.join("hf");
    succeeded(&run(&[
        "synth",
        "-o",
        s(&out),
        "--layers",
        "2",
        "--hidden",
        "64",
        "--ffn",
        "128",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--vocab",
        "300",
        "--max-context",
        "128",
    ]));
    out
}

fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&p, v.to_string()).unwrap();
}

/// Defect 2: `num_hidden_layers: 1000000000` aborted ("memory allocation of 1440000000000
/// bytes failed"); every dimension of config.json is held to its limit before allocating.
#[test]
fn hf_config_dimensions_over_their_limits_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let hf = tiny_hf(dir.path());
    let original = std::fs::read_to_string(hf.join("config.json")).unwrap();
    for (key, limit) in [
        ("num_hidden_layers", "max_layers"),
        ("hidden_size", "max_dim"),
        ("intermediate_size", "max_dim"),
        ("num_attention_heads", "max_heads"),
        ("num_key_value_heads", "max_heads"),
        ("vocab_size", "max_vocab"),
        ("max_position_embeddings", "max_dim"),
    ] {
        std::fs::write(hf.join("config.json"), &original).unwrap();
        edit_config(&hf, |v| v[key] = serde_json::json!(1_000_000_000u64));
        let out = run_capped(
            2048,
            &[
                "run",
                "-m",
                s(&hf),
                "--device",
                "cpu",
                "--tokens",
                "1",
                "-n",
                "1",
            ],
        );
        clean_error(&out, &[key, limit]);
    }
}

/// Defect 2: files read whole (config.json, tokenizer.json, the safetensors index) that are
/// endless (/dev/zero) were read until allocation failed; they are refused at
/// `max_file_read_bytes`.
#[test]
fn endless_files_read_whole_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let hf = tiny_hf(dir.path());
    for name in [
        "config.json",
        "tokenizer.json",
        "model.safetensors.index.json",
    ] {
        let p = hf.join(name);
        let saved = std::fs::read(&p).ok();
        std::fs::remove_file(&p).ok();
        std::os::unix::fs::symlink("/dev/zero", &p).unwrap();
        let out = run_capped(
            1536,
            &[
                "run",
                "-m",
                s(&hf),
                "--device",
                "cpu",
                "--tokens",
                "1",
                "-n",
                "1",
            ],
        );
        clean_error(&out, &[name, "max_file_read_bytes"]);
        std::fs::remove_file(&p).unwrap();
        if let Some(b) = saved {
            std::fs::write(&p, b).unwrap();
        }
    }
}

/// Defect 3: `synth --vocab 4294967295` aborted and left a 512 GiB sparse temp file; it is
/// refused before anything is created, in both formats.
#[test]
fn synth_refuses_dimensions_over_the_limits_and_leaves_nothing() {
    for out_name in ["m", "m.gguf"] {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join(out_name);
        for (flag, value, limit) in [
            ("--vocab", "4294967295", "max_vocab"),
            ("--layers", "1000000", "max_layers"),
            ("--hidden", "100000000", "max_dim"),
            ("--heads", "100000", "max_heads"),
        ] {
            let o = run_capped(1536, &["synth", "-o", s(&out), flag, value]);
            clean_error(&o, &[limit]);
            let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
            assert!(left.is_empty(), "{flag} {value} left {left:?}");
        }
    }
}

/// stories260K rewritten with its metadata edited by `edit` (tensors unchanged).
fn stories_with_meta(
    dir: &Path,
    name: &str,
    edit: impl FnOnce(&mut BTreeMap<String, MetaValue>),
) -> PathBuf {
    gguf_with_meta(&stories260k(), dir, name, edit)
}

/// The f32 GGUF `src` rewritten with its metadata edited by `edit` (tensors unchanged).
fn gguf_with_meta(
    src: &Path,
    dir: &Path,
    name: &str,
    edit: impl FnOnce(&mut BTreeMap<String, MetaValue>),
) -> PathBuf {
    let f = GgufFile::open(src).unwrap();
    let mut entries = f.metadata.entries.clone();
    edit(&mut entries);
    let meta: Vec<(&str, MetaValue)> = entries
        .iter()
        .map(|(k, v)| (k.as_str(), v.clone()))
        .collect();
    let tensors: Vec<RawTensor> = f
        .tensors
        .values()
        .map(|t| {
            assert!(t.ggml_type.host_dtype() == Some(gpu_offload::tensor::DType::F32));
            RawTensor {
                name: t.name.clone(),
                dims: t.dims.clone(),
                ggml_type: 0,
                bytes: f.tensor_bytes(t).to_vec(),
            }
        })
        .collect();
    let p = dir.join(format!("{name}.gguf"));
    write_gguf(&p, &meta, &tensors);
    p
}

/// stories260K with `count` f32 values of tensor `tensor` from element `first` set to `value`.
fn stories_with_weight(
    dir: &Path,
    name: &str,
    tensor: &str,
    first: usize,
    count: usize,
    value: f32,
) -> PathBuf {
    let src = stories260k();
    let f = GgufFile::open(&src).unwrap();
    let info = f.tensor_info(tensor).unwrap().clone();
    let mut bytes = std::fs::read(&src).unwrap();
    for i in first..first + count {
        let at = info.offset + 4 * i;
        bytes[at..at + 4].copy_from_slice(&value.to_le_bytes());
    }
    let p = dir.join(format!("{name}.gguf"));
    std::fs::write(&p, bytes).unwrap();
    p
}

/// A mixture-of-experts file whose expert counts disagree with its tensors or with each other
/// is refused naming the key or the tensor (issue 38).
#[test]
fn expert_counts_that_disagree_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let src = fixtures().join("gguf/qwen3-moe-f32.gguf");
    succeeded(&run(&as_strs(&run_args(&src))));
    let set = |k: &'static str, v: u32| {
        move |m: &mut BTreeMap<String, MetaValue>| {
            m.insert(k.into(), MetaValue::U32(v));
        }
    };
    let count = "qwen3moe.expert_count";
    let used = "qwen3moe.expert_used_count";
    let cases: [(&str, PathBuf, &[&str]); 4] = [
        (
            "fewer experts than the tensors hold",
            gguf_with_meta(&src, dir.path(), "count4", set(count, 4)),
            &["blk.0.ffn_gate_exps.weight", "4 expert matrices"],
        ),
        (
            "more used than there are",
            gguf_with_meta(&src, dir.path(), "used9", set(used, 9)),
            &[used, "at most all 8 experts"],
        ),
        (
            "none used",
            gguf_with_meta(&src, dir.path(), "used0", set(used, 0)),
            &[used],
        ),
        (
            "over the limit",
            gguf_with_meta(&src, dir.path(), "count5000", set(count, 5000)),
            &[count, "max_experts"],
        ),
    ];
    for (what, model, needles) in cases {
        let o = run(&as_strs(&run_args(&model)));
        println!("{what}: {}", clean_error(&o, needles));
    }
    // The HF config the same way.
    let hf = tiny_moe_hf(dir.path());
    succeeded(&run(&as_strs(&run_args(&hf))));
    edit_config(&hf, |c| c["num_experts_per_tok"] = 0.into());
    clean_error(&run(&as_strs(&run_args(&hf))), &["num_experts_per_tok"]);
    // A routing function other than the softmax is refused, not computed as one.
    edit_config(&hf, |c| {
        c["num_experts_per_tok"] = 2.into();
        c["scoring_func"] = "sigmoid".into();
    });
    clean_error(&run(&as_strs(&run_args(&hf))), &["scoring_func", "sigmoid"]);
    edit_config(&hf, |c| {
        c.as_object_mut().unwrap().remove("scoring_func");
    });
    let sigmoid = gguf_with_meta(
        &src,
        dir.path(),
        "gating2",
        set("qwen3moe.expert_gating_func", 2),
    );
    clean_error(
        &run(&as_strs(&run_args(&sigmoid))),
        &["qwen3moe.expert_gating_func", "sigmoid"],
    );
    let softmax = gguf_with_meta(
        &src,
        dir.path(),
        "gating1",
        set("qwen3moe.expert_gating_func", 1),
    );
    succeeded(&run(&as_strs(&run_args(&softmax))));
    // Qwen2-MoE needs its shared expert's width, a whole number of experts' widths.
    edit_config(&hf, |c| {
        c["num_experts_per_tok"] = 2.into();
        c["model_type"] = "qwen2_moe".into();
    });
    clean_error(
        &run(&as_strs(&run_args(&hf))),
        &["shared_expert_intermediate_size"],
    );
    edit_config(&hf, |c| c["shared_expert_intermediate_size"] = 48.into());
    clean_error(
        &run(&as_strs(&run_args(&hf))),
        &["shared_expert_intermediate_size", "not a multiple"],
    );
    edit_config(&hf, |c| c["model_type"] = "gpt_oss".into());
    clean_error(
        &run(&as_strs(&run_args(&hf))),
        &["gpt_oss", "attention sinks"],
    );
}

/// The Qwen3-MoE fixture copied into `dir` (config edits then stay there).
fn tiny_moe_hf(dir: &Path) -> PathBuf {
    let out = dir.join("qwen3-moe");
    std::fs::create_dir_all(&out).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixtures().join("hf/qwen3-moe").join(f), out.join(f)).unwrap();
    }
    out
}

/// Defect 4: numbers that cannot be weights' settings are refused at load, naming the key.
#[test]
fn impossible_numbers_in_gguf_metadata_are_refused_by_key() {
    let dir = tempfile::tempdir().unwrap();
    let eps = "llama.attention.layer_norm_rms_epsilon";
    let theta = "llama.rope.freq_base";
    // (file name, metadata edits, what the error must name)
    type Case<'a> = (&'a str, Vec<(&'a str, MetaValue)>, &'a str);
    let cases: Vec<Case> = vec![
        ("eps-nan", vec![(eps, MetaValue::F32(f32::NAN))], eps),
        ("eps-neg", vec![(eps, MetaValue::F32(-1e-5))], eps),
        ("eps-zero", vec![(eps, MetaValue::F32(0.0))], eps),
        ("eps-inf", vec![(eps, MetaValue::F32(f32::INFINITY))], eps),
        ("theta-nan", vec![(theta, MetaValue::F32(f32::NAN))], theta),
        ("theta-neg", vec![(theta, MetaValue::F32(-10.0))], theta),
        (
            "scale-zero",
            vec![
                (
                    "llama.rope.scaling.type",
                    MetaValue::String("linear".into()),
                ),
                ("llama.rope.scaling.factor", MetaValue::F32(0.0)),
            ],
            "llama.rope.scaling.factor",
        ),
        (
            "scale-nan",
            vec![
                (
                    "llama.rope.scaling.type",
                    MetaValue::String("linear".into()),
                ),
                ("llama.rope.scaling.factor", MetaValue::F32(f32::NAN)),
            ],
            "llama.rope.scaling.factor",
        ),
        (
            "scale-nan-untyped",
            vec![("llama.rope.scaling.factor", MetaValue::F32(f32::NAN))],
            "llama.rope.scaling.factor",
        ),
        (
            "kv-heads-3",
            vec![("llama.attention.head_count_kv", MetaValue::U32(3))],
            "llama.attention.head_count_kv",
        ),
        (
            "heads-7",
            vec![("llama.attention.head_count", MetaValue::U32(7))],
            "llama.attention.head_count",
        ),
        (
            "rope-dims-odd",
            vec![("llama.rope.dimension_count", MetaValue::U32(5))],
            "llama.rope.dimension_count",
        ),
        (
            "layers-zero",
            vec![("llama.block_count", MetaValue::U32(0))],
            "llama.block_count",
        ),
        (
            "layers-huge",
            vec![("llama.block_count", MetaValue::U32(1_000_000_000))],
            "max_layers",
        ),
        (
            "layers-fewer-than-blocks",
            vec![("llama.block_count", MetaValue::U32(4))],
            "blk.4",
        ),
        (
            "context-huge",
            vec![("llama.context_length", MetaValue::U64(1 << 40))],
            "max_dim",
        ),
        (
            "context-zero",
            vec![("llama.context_length", MetaValue::U32(0))],
            "llama.context_length",
        ),
    ];
    for (name, edits, needle) in cases {
        let p = stories_with_meta(dir.path(), name, |m| {
            for (k, v) in edits {
                m.insert(k.to_string(), v);
            }
        });
        let args = run_args(&p);
        let out = run_capped(2048, &as_strs(&args));
        clean_error(&out, &[needle]);
    }
}

/// Defect 5: weights that turn the hidden state non-finite stop the run with an error naming
/// the first layer whose output is non-finite, instead of sampling from NaN (exit 0, garbage).
#[test]
fn non_finite_hidden_states_stop_the_run_naming_the_layer() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        (
            "nan-norm-1",
            "blk.1.attn_norm.weight",
            0,
            64,
            f32::NAN,
            "layer 1",
        ),
        (
            "inf-down-3",
            "blk.3.ffn_down.weight",
            0,
            172 * 64,
            f32::INFINITY,
            "layer 3",
        ),
        (
            "huge-up-2",
            "blk.2.ffn_up.weight",
            0,
            172 * 64,
            3e38,
            "layer 2",
        ),
        (
            "nan-output-norm",
            "output_norm.weight",
            0,
            1,
            f32::NAN,
            "output",
        ),
    ];
    for (name, tensor, first, count, value, needle) in cases {
        let p = stories_with_weight(dir.path(), name, tensor, first, count, value);
        let args = run_args(&p);
        let out = run_capped(2048, &as_strs(&args));
        clean_error(&out, &["non-finite", needle]);
    }
}

/// The tokenizer's vocabulary and the embedding's rows disagree (ids past the embedding, or
/// rows no token names): refused at load, as llama.cpp does.
#[test]
fn a_vocabulary_unlike_the_embedding_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    for delta in [10i64, -12] {
        let p = stories_with_meta(dir.path(), &format!("vocab{delta}"), |m| {
            let resize = |v: &mut MetaValue, extra: &dyn Fn(usize) -> MetaValue| {
                let MetaValue::Array(items) = v else {
                    panic!("an array")
                };
                let n = (items.len() as i64 + delta) as usize;
                items.truncate(n);
                while items.len() < n {
                    items.push(extra(items.len()));
                }
            };
            let extras: [(&str, &dyn Fn(usize) -> MetaValue); 3] = [
                ("tokenizer.ggml.tokens", &|i| {
                    MetaValue::String(format!("x{i}"))
                }),
                ("tokenizer.ggml.scores", &|_| MetaValue::F32(0.0)),
                ("tokenizer.ggml.token_type", &|_| MetaValue::I32(1)),
            ];
            for (key, extra) in extras {
                resize(m.get_mut(key).unwrap(), extra);
            }
        });
        let args = run_args(&p);
        let out = run_capped(2048, &as_strs(&args));
        clean_error(&out, &["tokenizer.ggml.tokens", "token_embd.weight"]);
    }
    // An HF directory whose tokenizer.json names an id past the embedding.
    let hf = dir.path().join("llama-tok");
    std::fs::create_dir_all(&hf).unwrap();
    for f in std::fs::read_dir(fixtures().join("hf/llama-tok")).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, hf.join(f.file_name().unwrap())).unwrap();
    }
    succeeded(&run(&as_strs(&run_args(&hf))));
    let tj = hf.join("tokenizer.json");
    let mut t: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&tj).unwrap()).unwrap();
    t["added_tokens"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!({
            "id": 384, "content": "<past>", "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true
        }));
    std::fs::write(&tj, t.to_string()).unwrap();
    clean_error(
        &run(&as_strs(&run_args(&hf))),
        &["tokenizer.json", "token id 384", "384 rows"],
    );
}
