//! Helpers shared by the integration tests: where the test models are, and a small GGUF writer
//! for crafting good and bad files.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// `../shared/models/stories260K-f32.gguf` (or `$GPU_OFFLOAD_SHARED_MODELS/...`).
pub fn stories260k() -> PathBuf {
    let dir = std::env::var_os("GPU_OFFLOAD_SHARED_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/models"));
    let p = dir.join("stories260K-f32.gguf");
    assert!(
        p.exists(),
        "{} is missing: the shared test models must be next to the checkout (or set GPU_OFFLOAD_SHARED_MODELS)",
        p.display()
    );
    p
}

/// SmolLM2-135M-Instruct Q4_1, fetched by scripts/fetch-models.sh. `None` (with a printed reason)
/// only when GPU_OFFLOAD_SKIP_MISSING_MODELS=1; otherwise a missing file fails the test.
pub fn smollm2() -> Option<PathBuf> {
    let p = gpu_offload::model::default_model_path();
    if p.exists() {
        return Some(p);
    }
    if std::env::var_os("GPU_OFFLOAD_SKIP_MISSING_MODELS").is_some_and(|v| v == "1") {
        eprintln!(
            "skipped: {} missing (GPU_OFFLOAD_SKIP_MISSING_MODELS=1)",
            p.display()
        );
        return None;
    }
    panic!("{} is missing: run scripts/fetch-models.sh", p.display());
}

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// A metadata value for [`write_gguf`].
pub enum Meta {
    U32(u32),
    F32(f32),
    Str(String),
    Bool(bool),
}

/// A tensor for [`write_gguf`]: name, GGML dims (columns first), GGML type id, raw bytes.
pub struct RawTensor {
    pub name: String,
    pub dims: Vec<u64>,
    pub ggml_type: u32,
    pub bytes: Vec<u8>,
}

impl RawTensor {
    pub fn f32(name: &str, dims: &[u64], values: &[f32]) -> Self {
        RawTensor {
            name: name.into(),
            dims: dims.to_vec(),
            ggml_type: 0,
            bytes: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    }
}

/// Write a GGUF v3 file (alignment 32).
pub fn write_gguf(path: &Path, kv: &[(&str, Meta)], tensors: &[RawTensor]) {
    fn s(b: &mut Vec<u8>, v: &str) {
        b.extend((v.len() as u64).to_le_bytes());
        b.extend(v.as_bytes());
    }
    let mut b = Vec::new();
    b.extend(b"GGUF");
    b.extend(3u32.to_le_bytes());
    b.extend((tensors.len() as u64).to_le_bytes());
    b.extend((kv.len() as u64).to_le_bytes());
    for (k, v) in kv {
        s(&mut b, k);
        match v {
            Meta::U32(x) => {
                b.extend(4u32.to_le_bytes());
                b.extend(x.to_le_bytes());
            }
            Meta::F32(x) => {
                b.extend(6u32.to_le_bytes());
                b.extend(x.to_le_bytes());
            }
            Meta::Bool(x) => {
                b.extend(7u32.to_le_bytes());
                b.push(*x as u8);
            }
            Meta::Str(x) => {
                b.extend(8u32.to_le_bytes());
                s(&mut b, x);
            }
        }
    }
    let mut offset = 0u64;
    for t in tensors {
        s(&mut b, &t.name);
        b.extend((t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            b.extend(d.to_le_bytes());
        }
        b.extend(t.ggml_type.to_le_bytes());
        b.extend(offset.to_le_bytes());
        offset += (t.bytes.len() as u64).div_ceil(32) * 32;
    }
    while b.len() % 32 != 0 {
        b.push(0);
    }
    for t in tensors {
        b.extend(&t.bytes);
        while b.len() % 32 != 0 {
            b.push(0);
        }
    }
    std::fs::write(path, b).expect("write gguf");
}

/// A tiny but complete `llama` GGUF (no tokenizer): 1 layer, d 256, 4 heads, vocab 64. `ffn_type`
/// is the GGML type id of the FFN matrices (their bytes are zeros of the right size), so a file
/// with an unsupported type can be made.
pub fn tiny_llama_gguf(path: &Path, arch: &str, ffn_type: u32, ffn_block: (u64, u64)) {
    let (d, ff, vocab) = (256u64, 256u64, 64u64);
    let vals = |n: u64| -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 7919 % 97) as f32 - 48.0) / 480.0)
            .collect()
    };
    let ffn = |name: &str, cols: u64, rows: u64| RawTensor {
        name: name.into(),
        dims: vec![cols, rows],
        ggml_type: ffn_type,
        bytes: vec![0u8; (cols * rows / ffn_block.0 * ffn_block.1) as usize],
    };
    let key = |k: &str| format!("{arch}.{k}");
    let keys: Vec<(String, Meta)> = vec![
        ("general.architecture".into(), Meta::Str(arch.into())),
        (key("block_count"), Meta::U32(1)),
        (key("embedding_length"), Meta::U32(d as u32)),
        (key("feed_forward_length"), Meta::U32(ff as u32)),
        (key("attention.head_count"), Meta::U32(4)),
        (key("attention.head_count_kv"), Meta::U32(4)),
        (key("context_length"), Meta::U32(64)),
        (key("attention.layer_norm_rms_epsilon"), Meta::F32(1e-5)),
    ];
    let kv: Vec<(&str, Meta)> = keys
        .into_iter()
        .map(|(k, v)| (Box::leak(k.into_boxed_str()) as &str, v))
        .collect();
    write_gguf(
        path,
        &kv,
        &[
            RawTensor::f32("token_embd.weight", &[d, vocab], &vals(d * vocab)),
            RawTensor::f32("output_norm.weight", &[d], &vec![1.0; d as usize]),
            RawTensor::f32("blk.0.attn_norm.weight", &[d], &vec![1.0; d as usize]),
            RawTensor::f32("blk.0.attn_q.weight", &[d, d], &vals(d * d)),
            RawTensor::f32("blk.0.attn_k.weight", &[d, d], &vals(d * d)),
            RawTensor::f32("blk.0.attn_v.weight", &[d, d], &vals(d * d)),
            RawTensor::f32("blk.0.attn_output.weight", &[d, d], &vals(d * d)),
            RawTensor::f32("blk.0.ffn_norm.weight", &[d], &vec![1.0; d as usize]),
            ffn("blk.0.ffn_gate.weight", d, ff),
            ffn("blk.0.ffn_up.weight", d, ff),
            ffn("blk.0.ffn_down.weight", ff, d),
        ],
    );
}
