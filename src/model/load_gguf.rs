//! GGUF file → [`Model`]: llama.cpp's `llama` and `qwen2` architectures (and `mistral`, which
//! llama.cpp writes as `llama`).

use std::path::Path;

use super::gguf::GgufFile;
use super::spec::*;
use super::tokenizer::Tokenizer;
use super::{LayerWeights, Linear, Model, ModelError, ModelWeights, NormWeights};
use crate::tensor::HostTensor;

pub(super) fn load(path: &Path) -> Result<Model, ModelError> {
    let file = GgufFile::open(path)?;
    let meta = &file.metadata;
    let arch = meta.str("general.architecture")?.to_string();
    let style = match arch.as_str() {
        "llama" | "mistral" => RopeStyle::Adjacent,
        "qwen2" => RopeStyle::Halves,
        other => {
            return Err(ModelError::Unsupported {
                path: path.to_path_buf(),
                msg: format!("unknown architecture `{other}` (supported: llama, mistral, qwen2)"),
            });
        }
    };
    let key = |k: &str| format!("{arch}.{k}");
    let token_embd = file.load("token_embd.weight")?;
    let d_model = meta.usize(&key("embedding_length"))?;
    let n_heads = meta.usize(&key("attention.head_count"))?;
    if n_heads == 0 {
        return Err(format_err(path, "attention.head_count is 0"));
    }
    let n_kv_heads = meta
        .opt_usize(&key("attention.head_count_kv"))?
        .unwrap_or(n_heads);
    let head_dim = meta
        .opt_usize(&key("attention.key_length"))?
        .unwrap_or(d_model / n_heads);
    let rope_dims = meta
        .opt_usize(&key("rope.dimension_count"))?
        .unwrap_or(head_dim);
    let scaling = match meta.opt_str(&key("rope.scaling.type"))? {
        None | Some("none") => RopeScaling::None,
        Some("linear") => RopeScaling::Linear {
            factor: meta.f32(&key("rope.scaling.factor"))?,
        },
        Some(other) => {
            return Err(ModelError::Unsupported {
                path: path.to_path_buf(),
                msg: format!("RoPE scaling `{other}` (supported: none, linear)"),
            });
        }
    };
    let output = match file.tensor_info("output.weight") {
        Some(_) => Some(file.load("output.weight")?),
        None => None,
    };
    let rope_freq_factors = match file.tensor_info("rope_freqs.weight") {
        Some(_) => Some(file.load("rope_freqs.weight")?.to_f32()),
        None => None,
    };
    let n_layers = meta.usize(&key("block_count"))?;
    let spec = ModelSpec {
        arch: Arch::Llama,
        name: meta
            .opt_str("general.name")?
            .map(str::to_string)
            .unwrap_or_else(|| file_stem(path)),
        n_layers,
        d_model,
        n_heads,
        n_kv_heads,
        head_dim,
        d_ff: meta.usize(&key("feed_forward_length"))?,
        vocab_size: token_embd.rows,
        max_context: meta.opt_usize(&key("context_length"))?.unwrap_or(2048),
        norm: NormKind::Rms,
        norm_eps: meta
            .opt_f32(&key("attention.layer_norm_rms_epsilon"))?
            .unwrap_or(1e-5),
        activation: Activation::Silu,
        gated_ffn: true,
        qkv_bias: file.tensor_info("blk.0.attn_q.bias").is_some(),
        out_bias: file.tensor_info("blk.0.attn_output.bias").is_some(),
        ffn_bias: false,
        position: PositionEncoding::Rope(RopeSpec {
            theta: meta.opt_f32(&key("rope.freq_base"))?.unwrap_or(10000.0),
            style,
            dims: rope_dims,
            scaling,
        }),
        tied_output: output.is_none(),
        attn_scale: 1.0 / (head_dim as f32).sqrt(),
    };
    spec.validate().map_err(|m| format_err(path, &m))?;
    if n_layers > 4096 {
        return Err(format_err(path, "block_count is implausibly large"));
    }

    let norm = |name: String| -> Result<NormWeights, ModelError> {
        Ok(NormWeights {
            weight: as_f32(file.load(&name)?),
            bias: None,
        })
    };
    let linear = |base: String, bias: bool| -> Result<Linear, ModelError> {
        Ok(Linear {
            weight: file.load(&format!("{base}.weight"))?,
            bias: if bias {
                Some(as_f32(file.load(&format!("{base}.bias"))?))
            } else {
                None
            },
        })
    };
    let mut layers = Vec::with_capacity(n_layers);
    for i in 0..n_layers {
        let b = format!("blk.{i}");
        layers.push(LayerWeights {
            attn_norm: norm(format!("{b}.attn_norm.weight"))?,
            wq: linear(format!("{b}.attn_q"), spec.qkv_bias)?,
            wk: linear(format!("{b}.attn_k"), spec.qkv_bias)?,
            wv: linear(format!("{b}.attn_v"), spec.qkv_bias)?,
            wo: linear(format!("{b}.attn_output"), spec.out_bias)?,
            ffn_norm: norm(format!("{b}.ffn_norm.weight"))?,
            w_gate: Some(linear(format!("{b}.ffn_gate"), false)?),
            w_up: linear(format!("{b}.ffn_up"), false)?,
            w_down: linear(format!("{b}.ffn_down"), false)?,
        });
    }
    let weights = ModelWeights {
        token_embd,
        pos_embd: None,
        layers,
        output_norm: norm("output_norm.weight".into())?,
        output,
        rope_freq_factors,
    };
    let tokenizer = Tokenizer::from_gguf(meta)?;
    Ok(Model {
        spec,
        weights,
        tokenizer,
        source: path.to_path_buf(),
    })
}

fn format_err(path: &Path, msg: &str) -> ModelError {
    ModelError::Format {
        path: path.to_path_buf(),
        msg: msg.to_string(),
    }
}

fn file_stem(path: &Path) -> String {
    path.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into())
}

/// Small vectors (norms, biases) are kept as f32 whatever their file format.
pub(super) fn as_f32(t: HostTensor) -> HostTensor {
    if t.dtype == crate::tensor::DType::F32 {
        return t;
    }
    let values = t.to_f32();
    HostTensor::from_f32(t.name, t.rows, t.cols, values)
}
