//! GGUF file → [`Model`]: llama.cpp's `llama` (with experts: Mixtral), `qwen2`, `qwen3` and
//! `qwen3moe` architectures (and `mistral`, which llama.cpp writes as `llama`).

use std::path::Path;

use super::gguf::GgufFile;
use super::spec::*;
use super::tokenizer::Tokenizer;
use super::{LayerWeights, Linear, Model, ModelError, ModelWeights, NormWeights};
use crate::limits::{Limit, MAX_DIM, MAX_EXPERTS, MAX_HEADS, MAX_LAYERS};
use crate::tensor::HostTensor;

pub(super) fn load(path: &Path) -> Result<Model, ModelError> {
    let file = GgufFile::open(path)?;
    let meta = &file.metadata;
    let arch = meta.str("general.architecture")?.to_string();
    let style = match arch.as_str() {
        "llama" | "mistral" => RopeStyle::Adjacent,
        "qwen2" | "qwen3" | "qwen2moe" | "qwen3moe" => RopeStyle::Halves,
        other => {
            return Err(ModelError::Unsupported {
                path: path.to_path_buf(),
                msg: match other {
                    "gpt-oss" => format!(
                        "`{other}` is not supported yet: its router bias, softmax over the top-k, \
                         attention sinks, sliding window, MXFP4 experts and clamped SwiGLU are not \
                         built"
                    ),
                    "deepseek2" => format!(
                        "`{other}` is not supported yet: multi-head latent attention and sigmoid, \
                         group-limited routing are not built"
                    ),
                    _ => format!(
                        "unknown architecture `{other}` (supported: llama, mistral, qwen2, qwen3, \
                         qwen2moe, qwen3moe)"
                    ),
                },
            });
        }
    };
    let token_embd = file.load("token_embd.weight")?;
    let output = match file.tensor_info("output.weight") {
        Some(_) => Some(file.load("output.weight")?),
        None => None,
    };
    let rope_freq_factors = match file.tensor_info("rope_freqs.weight") {
        Some(_) => Some(file.load("rope_freqs.weight")?.to_f32()),
        None => None,
    };
    let spec = read_spec(&file, path, &arch, style, token_embd.rows, output.is_none())?;
    let n_layers = spec.n_layers;
    // A block the metadata does not count would be silently left out of every token.
    if file
        .tensors
        .keys()
        .any(|name| name.starts_with(&format!("blk.{n_layers}.")))
    {
        return Err(format_err(
            path,
            &format!(
                "the file holds tensors of layer {n_layers} (`blk.{n_layers}.*`) but \
                 `{arch}.block_count` says {n_layers} layers"
            ),
        ));
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
    let head_norm = |name: String| spec.qk_norm.then(|| norm(name)).transpose();
    let mut layers = Vec::with_capacity(n_layers);
    for i in 0..n_layers {
        let b = format!("blk.{i}");
        let (router, [gate, up, down]) = match &spec.moe {
            None => (
                None,
                ["ffn_gate", "ffn_up", "ffn_down"].map(|w| linear(format!("{b}.{w}"), false)),
            ),
            Some(m) => {
                let (router, ffn) = expert_ffn(&file, &b, m)?;
                (Some(router), ffn.map(Ok))
            }
        };
        let [gate, up, down] = [gate?, up?, down?];
        layers.push(LayerWeights {
            attn_norm: norm(format!("{b}.attn_norm.weight"))?,
            wq: linear(format!("{b}.attn_q"), spec.qkv_bias)?,
            wk: linear(format!("{b}.attn_k"), spec.qkv_bias)?,
            wv: linear(format!("{b}.attn_v"), spec.qkv_bias)?,
            wo: linear(format!("{b}.attn_output"), spec.out_bias)?,
            q_norm: head_norm(format!("{b}.attn_q_norm.weight"))?,
            k_norm: head_norm(format!("{b}.attn_k_norm.weight"))?,
            ffn_norm: norm(format!("{b}.ffn_norm.weight"))?,
            router,
            w_gate: Some(gate),
            w_up: up,
            w_down: down,
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
    // Ids past the embedding would be refused mid-run, rows past the vocabulary sampled into
    // nothing: llama.cpp refuses such a file, and so do we.
    if let Some(t) = &tokenizer
        && t.vocab_size() != spec.vocab_size
    {
        return Err(format_err(
            path,
            &format!(
                "`tokenizer.ggml.tokens` has {} tokens but `token_embd.weight` has {} rows",
                t.vocab_size(),
                spec.vocab_size
            ),
        ));
    }
    Ok(Model {
        spec,
        weights,
        tokenizer,
        source: path.to_path_buf(),
    })
}

/// A mixture-of-experts layer's router and its experts as the FFN's matrices
/// ([`super::experts`]): llama.cpp's 3-D `ffn_*_exps`, or older files' per-expert
/// `ffn_{gate,up,down}.E`.
fn expert_ffn(
    file: &GgufFile,
    b: &str,
    moe: &MoeSpec,
) -> Result<(HostTensor, [Linear; 3]), ModelError> {
    let experts = moe.experts;
    let mut router = as_f32(file.load(&format!("{b}.ffn_gate_inp.weight"))?);
    let linear = |weight: HostTensor| Linear { weight, bias: None };
    let [gate, up, down] = if file
        .tensor_info(&format!("{b}.ffn_gate_exps.weight"))
        .is_some()
    {
        let load = |w: &str| file.load_experts(&format!("{b}.{w}.weight"), experts);
        [
            load("ffn_gate_exps")?,
            load("ffn_up_exps")?,
            load("ffn_down_exps")?,
        ]
    } else {
        let parts = |w: &str| -> Result<Vec<HostTensor>, ModelError> {
            (0..experts)
                .map(|e| file.load(&format!("{b}.{w}.{e}.weight")))
                .collect()
        };
        let parts = [parts("ffn_gate")?, parts("ffn_up")?, parts("ffn_down")?];
        super::experts::ffn_of_experts(&format!("{b}.ffn_exps"), parts)?
    };
    let [gate, up, down] = if moe.shared > 0 {
        // Qwen2-MoE's shared expert; its gate is a vector.
        let shexp = |w: &str| file.load(&format!("{b}.{w}_shexp.weight"));
        let s_router = as_f32(file.load(&format!("{b}.ffn_gate_inp_shexp.weight"))?);
        let parts = [
            shexp("ffn_gate")?,
            shexp("ffn_up")?,
            shexp("ffn_down")?,
            s_router,
        ];
        let ffn;
        (ffn, router) =
            super::experts::with_shared_expert([gate, up, down], router, parts, moe.shared)?;
        ffn
    } else {
        [gate, up, down]
    };
    Ok((router, [linear(gate), linear(up), linear(down)]))
}

/// The spec the metadata states (sizes held to their limits as they are read, so nothing
/// computes or allocates by a size over them), checked as every loader's is.
fn read_spec(
    file: &GgufFile,
    path: &Path,
    arch: &str,
    style: RopeStyle,
    vocab_size: usize,
    tied_output: bool,
) -> Result<ModelSpec, ModelError> {
    let meta = &file.metadata;
    let key = |k: &str| format!("{arch}.{k}");
    let size = |k: &str, limit: &Limit| -> Result<Option<usize>, ModelError> {
        let k = key(k);
        match meta.opt_usize(&k)? {
            Some(v) if !limit.admits(v as u64) => {
                Err(format_err(path, &format!("`{k}` {}", limit.over(v as u64))))
            }
            v => Ok(v),
        }
    };
    let required = |k: &str, limit: &Limit| -> Result<usize, ModelError> {
        size(k, limit)?.ok_or_else(|| meta_missing(path, &key(k)))
    };
    let d_model = required("embedding_length", &MAX_DIM)?;
    let n_heads = required("attention.head_count", &MAX_HEADS)?;
    if n_heads == 0 {
        return Err(format_err(
            path,
            &format!("`{}` is 0", key("attention.head_count")),
        ));
    }
    let n_kv_heads = size("attention.head_count_kv", &MAX_HEADS)?.unwrap_or(n_heads);
    let head_dim = match size("attention.key_length", &MAX_DIM)? {
        Some(d) => d,
        None if d_model.is_multiple_of(n_heads) => d_model / n_heads,
        None => {
            return Err(format_err(
                path,
                &format!(
                    "`{}` {d_model} is not divisible by `{}` {n_heads} (and no `{}` says the \
                     head size)",
                    key("embedding_length"),
                    key("attention.head_count"),
                    key("attention.key_length")
                ),
            ));
        }
    };
    let rope_dims = size("rope.dimension_count", &MAX_DIM)?.unwrap_or(head_dim);
    // A factor without a type is unused (no scaling), but a number no model has is still a
    // broken file: refused like the factor of a linear scaling (0 is llama.cpp's "none").
    if let Some(f) = meta.opt_f32(&key("rope.scaling.factor"))?
        && !(f.is_finite() && f >= 0.0)
    {
        return Err(format_err(
            path,
            &format!(
                "`{}` is {f}: a RoPE scaling factor must be a finite positive number",
                key("rope.scaling.factor")
            ),
        ));
    }
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
    let n_layers = required("block_count", &MAX_LAYERS)?;
    let moe = moe_of(path, arch, meta, &size)?;
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
        d_ff: match &moe {
            Some(m) => m.neurons(),
            None => required("feed_forward_length", &MAX_DIM)?,
        },
        vocab_size,
        max_context: size("context_length", &MAX_DIM)?.unwrap_or(2048),
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
        tied_output,
        attn_scale: 1.0 / (head_dim as f32).sqrt(),
        qk_norm: file.tensor_info("blk.0.attn_q_norm.weight").is_some(),
        moe,
    };
    spec.check()
        .map_err(|e| format_err(path, &e.naming(&gguf_key(arch, e.field))))?;
    Ok(spec)
}

/// Reads an `{arch}.` size key, held to a limit (absent: `None`).
type SizeOf<'a> = dyn Fn(&str, &Limit) -> Result<Option<usize>, ModelError> + 'a;

/// The experts the metadata states (none for a dense model), each size held to its limit by
/// `size` as it is read.
fn moe_of(
    path: &Path,
    arch: &str,
    meta: &super::gguf::GgufMetadata,
    size: &SizeOf,
) -> Result<Option<MoeSpec>, ModelError> {
    let key = |k: &str| format!("{arch}.{k}");
    let required = |k: &str, limit: &Limit| -> Result<usize, ModelError> {
        size(k, limit)?.ok_or_else(|| meta_missing(path, &key(k)))
    };
    // `expert_count` 0 (or none) is a dense model.
    Ok(match size("expert_count", &MAX_EXPERTS)? {
        None | Some(0) => None,
        Some(experts) => {
            // llama.cpp's gating: 1 softmax (the only one built), 2 sigmoid (DeepSeek-V3's).
            let gating = key("expert_gating_func");
            match meta.opt_usize(&gating)? {
                None | Some(1) => {}
                Some(g) => {
                    return Err(ModelError::Unsupported {
                        path: path.to_path_buf(),
                        msg: format!(
                            "`{gating}` is {g}: {} routing is not built (softmax over the \
                             experts, 1, is)",
                            if g == 2 { "sigmoid" } else { "this" }
                        ),
                    });
                }
            }
            let d_expert = match size("expert_feed_forward_length", &MAX_DIM)? {
                Some(w) => w,
                None => required("feed_forward_length", &MAX_DIM)?,
            };
            // Qwen2-MoE's shared expert, as parts of `d_expert` neurons (see MoeSpec).
            let shared = match size("expert_shared_feed_forward_length", &MAX_DIM)? {
                None | Some(0) => 0,
                Some(w) if w.is_multiple_of(d_expert) => w / d_expert,
                Some(w) => {
                    return Err(ModelError::Format {
                        path: path.to_path_buf(),
                        msg: format!(
                            "`{}` {w} is not a multiple of the experts' width {d_expert} (the \
                             shared expert is computed as experts of that width)",
                            key("expert_shared_feed_forward_length")
                        ),
                    });
                }
            };
            Some(MoeSpec {
                experts,
                used: required("expert_used_count", &MAX_EXPERTS)?,
                d_expert,
                // Mixtral always renormalises the chosen experts' weights, and so do the
                // Qwen3-MoE releases (`norm_topk_prob`); Qwen2-MoE does not; a file may say
                // otherwise.
                norm_top_k: meta
                    .opt_bool(&key("expert_weights_norm"))?
                    .unwrap_or(arch != "qwen2moe"),
                shared,
            })
        }
    })
}

/// The GGUF metadata key a [`ModelSpec`] field comes from, for errors.
fn gguf_key(arch: &str, field: &str) -> String {
    let k = match field {
        "n_layers" => "block_count",
        "d_model" => "embedding_length",
        "n_heads" => "attention.head_count",
        "n_kv_heads" => "attention.head_count_kv",
        "head_dim" | "attn_scale" => "attention.key_length",
        "d_ff" | "moe.d_expert" if arch.ends_with("moe") => "expert_feed_forward_length",
        "moe.shared" => "expert_shared_feed_forward_length",
        "d_ff" | "moe.d_expert" => "feed_forward_length",
        "moe.experts" => "expert_count",
        "moe.used" => "expert_used_count",
        // The vocabulary is the embedding's rows.
        "vocab_size" => return "token_embd.weight".into(),
        "max_context" => "context_length",
        "norm_eps" => "attention.layer_norm_rms_epsilon",
        "rope.theta" => "rope.freq_base",
        "rope.dims" => "rope.dimension_count",
        "factor" => "rope.scaling.factor",
        other => return other.into(),
    };
    format!("{arch}.{k}")
}

fn meta_missing(path: &Path, key: &str) -> ModelError {
    format_err(path, &format!("metadata key `{key}` is missing"))
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
