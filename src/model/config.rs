//! Hugging Face `config.json` → [`ModelSpec`]. Reads both key styles: the older top-level
//! `rope_theta` / `rope_scaling` / `torch_dtype` and the newer `rope_parameters` / `dtype`.

use std::path::Path;

use serde_json::Value;

use super::ModelError;
use super::spec::*;
use crate::limits::{Limit, MAX_DIM, MAX_EXPERTS, MAX_HEADS, MAX_LAYERS, MAX_VOCAB};

/// A parsed `config.json`: the spec, plus the facts the loader needs about tensor naming.
#[derive(Clone, Debug)]
pub struct HfConfig {
    pub spec: ModelSpec,
    /// `model_type` as written (llama, mistral, qwen2, qwen3, qwen3_moe, mixtral, opt).
    pub model_type: String,
    /// The dtype the checkpoint says it is stored in (informational).
    pub dtype: Option<String>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

struct Reader<'a> {
    path: &'a Path,
    v: &'a Value,
}

impl Reader<'_> {
    fn err(&self, msg: String) -> ModelError {
        ModelError::Config {
            path: self.path.to_path_buf(),
            msg,
        }
    }

    fn usize(&self, key: &str) -> Result<usize, ModelError> {
        self.opt_usize(key)?
            .ok_or_else(|| self.err(format!("`{key}` is missing")))
    }

    /// A required size held to `limit` as it is read, so no later arithmetic or allocation
    /// sees a size over it.
    fn size(&self, key: &str, limit: &Limit) -> Result<usize, ModelError> {
        let v = self.usize(key)?;
        self.within(key, v, limit)
    }

    fn opt_size(&self, key: &str, limit: &Limit) -> Result<Option<usize>, ModelError> {
        self.opt_usize(key)?
            .map(|v| self.within(key, v, limit))
            .transpose()
    }

    fn within(&self, key: &str, v: usize, limit: &Limit) -> Result<usize, ModelError> {
        if limit.admits(v as u64) {
            Ok(v)
        } else {
            Err(self.err(format!("`{key}` {}", limit.over(v as u64))))
        }
    }

    fn opt_usize(&self, key: &str) -> Result<Option<usize>, ModelError> {
        match self.v.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => x
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| {
                    self.err(format!("`{key}` must be a non-negative integer, got {x}"))
                }),
        }
    }

    fn opt_f32(&self, key: &str) -> Result<Option<f32>, ModelError> {
        opt_f32_in(self.v, key).map_err(|m| self.err(m))
    }

    fn opt_bool(&self, key: &str) -> Result<Option<bool>, ModelError> {
        match self.v.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(x) => Err(self.err(format!("`{key}` must be true or false, got {x}"))),
        }
    }

    fn opt_str(&self, key: &str) -> Result<Option<&str>, ModelError> {
        match self.v.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(x) => Err(self.err(format!("`{key}` must be a string, got {x}"))),
        }
    }

    /// A token id or a list of them (`eos_token_id` may be either).
    fn ids(&self, key: &str) -> Result<Vec<u32>, ModelError> {
        let bad = || self.err(format!("`{key}` must be a token id or a list of ids"));
        match self.v.get(key) {
            None | Some(Value::Null) => Ok(vec![]),
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| {
                    x.as_u64()
                        .and_then(|n| u32::try_from(n).ok())
                        .ok_or_else(bad)
                })
                .collect(),
            Some(x) => x
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .map(|n| vec![n])
                .ok_or_else(bad),
        }
    }
}

fn opt_f32_in(v: &Value, key: &str) -> Result<Option<f32>, String> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x
            .as_f64()
            .map(|f| Some(f as f32))
            .ok_or_else(|| format!("`{key}` must be a number, got {x}")),
    }
}

/// Parse the text of a `config.json` at `path`.
pub fn parse_config(path: &Path, text: &str) -> Result<HfConfig, ModelError> {
    let v: Value = serde_json::from_str(text).map_err(|e| ModelError::Config {
        path: path.to_path_buf(),
        msg: format!("not valid JSON: {e}"),
    })?;
    if !v.is_object() {
        return Err(ModelError::Config {
            path: path.to_path_buf(),
            msg: "must be a JSON object".into(),
        });
    }
    let r = Reader { path, v: &v };
    let model_type = r
        .opt_str("model_type")?
        .map(str::to_string)
        .or_else(|| {
            // Fall back to the class name in `architectures`.
            v.get("architectures")
                .and_then(|a| a.get(0))
                .and_then(Value::as_str)
                .map(|a| a.trim_end_matches("ForCausalLM").to_lowercase())
        })
        .ok_or_else(|| {
            r.err("neither `model_type` nor `architectures` says what model this is".into())
        })?;
    let dtype = r
        .opt_str("dtype")?
        .or(r.opt_str("torch_dtype")?)
        .map(str::to_string);
    let spec = match model_type.as_str() {
        "llama" | "mistral" | "qwen2" | "qwen3" | "qwen3_moe" | "qwen2_moe" | "mixtral" => {
            llama_spec(&r, &model_type)?
        }
        "opt" => opt_spec(&r)?,
        other => {
            let missing = match other {
                "gpt_oss" => Some(
                    "its router bias, softmax over the top-k, attention sinks, sliding window, \
                     MXFP4 experts and clamped SwiGLU",
                ),
                "deepseek_v2" | "deepseek_v3" => {
                    Some("multi-head latent attention and sigmoid, group-limited routing")
                }
                _ => None,
            };
            return Err(r.err(match missing {
                Some(m) => format!("`{other}` is not supported yet: {m} are not built"),
                None => format!(
                    "unknown architecture `{other}` (supported: llama, mistral, qwen2, qwen3, \
                     qwen2_moe, qwen3_moe, mixtral, opt)"
                ),
            }));
        }
    };
    spec.check()
        .map_err(|e| r.err(e.naming(hf_key(&model_type, e.field))))?;
    Ok(HfConfig {
        spec,
        model_type,
        dtype,
        bos_token_id: r.ids("bos_token_id")?.first().copied(),
        eos_token_ids: r.ids("eos_token_id")?,
    })
}

/// The config.json key a [`ModelSpec`] field comes from, for errors.
fn hf_key(model_type: &str, field: &str) -> &'static str {
    let opt = model_type == "opt";
    match field {
        "n_layers" => "num_hidden_layers",
        "d_model" => "hidden_size",
        "n_heads" => "num_attention_heads",
        "n_kv_heads" if opt => "num_attention_heads",
        "n_kv_heads" => "num_key_value_heads",
        "head_dim" | "rope.dims" | "attn_scale" => "head_dim",
        "d_ff" if opt => "ffn_dim",
        "moe.experts" => "num_local_experts",
        "moe.used" => "num_experts_per_tok",
        "moe.d_expert" | "d_ff" if model_type.ends_with("_moe") => "moe_intermediate_size",
        "moe.shared" => "shared_expert_intermediate_size",
        "d_ff" => "intermediate_size",
        "vocab_size" => "vocab_size",
        "max_context" => "max_position_embeddings",
        "norm_eps" => "rms_norm_eps",
        "rope.theta" => "rope_theta",
        "factor" => "rope_scaling.factor",
        "low_freq_factor" => "rope_scaling.low_freq_factor",
        "high_freq_factor" => "rope_scaling.high_freq_factor",
        "original_max_position" => "rope_scaling.original_max_position_embeddings",
        _ => "config",
    }
}

fn name_of(path: &Path) -> String {
    path.parent()
        .and_then(|p| p.file_name())
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into())
}

fn llama_spec(r: &Reader, model_type: &str) -> Result<ModelSpec, ModelError> {
    let d_model = r.size("hidden_size", &MAX_DIM)?;
    let n_heads = r.size("num_attention_heads", &MAX_HEADS)?;
    let explicit_head_dim = r.opt_size("head_dim", &MAX_DIM)?;
    if n_heads == 0 || d_model % n_heads != 0 && explicit_head_dim.is_none() {
        return Err(r.err(format!(
            "hidden_size {d_model} is not divisible by num_attention_heads {n_heads}"
        )));
    }
    let head_dim = explicit_head_dim.unwrap_or(d_model / n_heads);
    let n_kv_heads = r
        .opt_size("num_key_value_heads", &MAX_HEADS)?
        .unwrap_or(n_heads);
    let act_name = r.opt_str("hidden_act")?.unwrap_or("silu");
    let activation = Activation::from_hf(act_name)
        .ok_or_else(|| r.err(format!("unsupported activation `{act_name}`")))?;
    // Qwen2 and Qwen2-MoE: q, k and v with bias, the output without.
    let qwen = model_type == "qwen2" || model_type == "qwen2_moe";
    let moe = moe_spec(r, model_type)?;
    let attention_bias = r.opt_bool("attention_bias")?.unwrap_or(false);
    if r.opt_bool("mlp_bias")?.unwrap_or(false) {
        return Err(r.err("`mlp_bias: true` is not supported".into()));
    }
    let max_context = r
        .opt_size("max_position_embeddings", &MAX_DIM)?
        .unwrap_or(2048);
    if let Some(w) = r.opt_usize("sliding_window")? {
        let used = r
            .opt_bool("use_sliding_window")?
            .unwrap_or(!model_type.starts_with("qwen"));
        if used && w < max_context {
            tracing::warn!(
                "config sets a sliding window of {w} tokens; attention here is full, which is \
                 exact up to {w} tokens"
            );
        }
    }
    let (theta, scaling) = rope_params(r)?;
    Ok(ModelSpec {
        arch: Arch::Llama,
        name: name_of(r.path),
        n_layers: r.size("num_hidden_layers", &MAX_LAYERS)?,
        d_model,
        n_heads,
        n_kv_heads,
        head_dim,
        d_ff: match &moe {
            Some(m) => m.neurons(),
            None => r.size("intermediate_size", &MAX_DIM)?,
        },
        vocab_size: r.size("vocab_size", &MAX_VOCAB)?,
        max_context,
        norm: NormKind::Rms,
        norm_eps: r.opt_f32("rms_norm_eps")?.unwrap_or(1e-6),
        activation,
        gated_ffn: true,
        qkv_bias: qwen || attention_bias,
        out_bias: attention_bias && !qwen,
        ffn_bias: false,
        position: PositionEncoding::Rope(RopeSpec {
            theta,
            style: RopeStyle::Halves,
            dims: head_dim,
            scaling,
        }),
        tied_output: r.opt_bool("tie_word_embeddings")?.unwrap_or(false),
        attn_scale: 1.0 / (head_dim as f32).sqrt(),
        qk_norm: model_type.starts_with("qwen3"),
        moe,
    })
}

/// The experts of a mixture-of-experts `model_type` (none for dense ones). Every layer must be
/// one: Qwen3-MoE's dense layers (`mlp_only_layers`, `decoder_sparse_step` above 1) are refused.
fn moe_spec(r: &Reader, model_type: &str) -> Result<Option<MoeSpec>, ModelError> {
    let (count_key, width_key) = match model_type {
        // Configs written before transformers 5 say `num_experts`, since then `num_local_experts`.
        "qwen3_moe" | "qwen2_moe" if r.v.get("num_experts").is_some() => {
            ("num_experts", "moe_intermediate_size")
        }
        "qwen3_moe" | "qwen2_moe" => ("num_local_experts", "moe_intermediate_size"),
        "mixtral" => ("num_local_experts", "intermediate_size"),
        _ => return Ok(None),
    };
    // Routing is a softmax over the experts; a config naming another function is refused.
    if let Some(f) = r.opt_str("scoring_func")?
        && f != "softmax"
    {
        return Err(r.err(format!(
            "`scoring_func` \"{f}\": only softmax routing is built"
        )));
    }
    if model_type != "mixtral" {
        if r.opt_usize("decoder_sparse_step")?.unwrap_or(1) != 1 {
            return Err(r.err(
                "`decoder_sparse_step` above 1 (dense FFN layers between the expert ones) is not \
                 supported yet"
                    .into(),
            ));
        }
        if r.v
            .get("mlp_only_layers")
            .and_then(Value::as_array)
            .is_some_and(|a| !a.is_empty())
        {
            return Err(r.err(
                "`mlp_only_layers` (dense FFN layers among the expert ones) is not supported yet"
                    .into(),
            ));
        }
    }
    let d_expert = r.size(width_key, &MAX_DIM)?;
    // Qwen2-MoE's shared expert, as parts of `d_expert` neurons (see MoeSpec).
    let shared = match model_type {
        "qwen2_moe" => {
            let width = r.size("shared_expert_intermediate_size", &MAX_DIM)?;
            if !width.is_multiple_of(d_expert) {
                return Err(r.err(format!(
                    "`shared_expert_intermediate_size` {width} is not a multiple of \
                     `moe_intermediate_size` {d_expert} (the shared expert is computed as \
                     experts of that width)"
                )));
            }
            width / d_expert
        }
        _ => 0,
    };
    Ok(Some(MoeSpec {
        experts: r.size(count_key, &MAX_EXPERTS)?,
        used: r.size("num_experts_per_tok", &MAX_EXPERTS)?,
        d_expert,
        // Mixtral always renormalises; Qwen where the config says (its default: not).
        norm_top_k: model_type == "mixtral" || r.opt_bool("norm_topk_prob")?.unwrap_or(false),
        shared,
    }))
}

/// RoPE base and scaling from either `rope_parameters` (new) or `rope_theta` + `rope_scaling`.
fn rope_params(r: &Reader) -> Result<(f32, RopeScaling), ModelError> {
    let params = r.v.get("rope_parameters").filter(|p| !p.is_null());
    let scaling_obj = params.or_else(|| r.v.get("rope_scaling").filter(|p| !p.is_null()));
    let theta = match params {
        Some(p) => {
            opt_f32_in(p, "rope_theta").map_err(|m| r.err(format!("rope_parameters: {m}")))?
        }
        None => None,
    }
    .or(r.opt_f32("rope_theta")?)
    .unwrap_or(10000.0);
    let Some(s) = scaling_obj else {
        return Ok((theta, RopeScaling::None));
    };
    let kind = s
        .get("rope_type")
        .or_else(|| s.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let num = |key: &str| -> Result<f32, ModelError> {
        opt_f32_in(s, key)
            .map_err(|m| r.err(format!("rope scaling: {m}")))?
            .ok_or_else(|| r.err(format!("rope scaling `{kind}` needs `{key}`")))
    };
    let scaling = match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear {
            factor: num("factor")?,
        },
        "llama3" => RopeScaling::Llama3 {
            factor: num("factor")?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_max_position: num("original_max_position_embeddings")? as usize,
        },
        other => {
            return Err(r.err(format!(
                "RoPE scaling `{other}` is not supported (supported: default, linear, llama3)"
            )));
        }
    };
    Ok((theta, scaling))
}

fn opt_spec(r: &Reader) -> Result<ModelSpec, ModelError> {
    let d_model = r.size("hidden_size", &MAX_DIM)?;
    let n_heads = r.size("num_attention_heads", &MAX_HEADS)?;
    if n_heads == 0 || d_model % n_heads != 0 {
        return Err(r.err(format!(
            "hidden_size {d_model} is not divisible by num_attention_heads {n_heads}"
        )));
    }
    if let Some(p) = r.opt_usize("word_embed_proj_dim")?
        && p != d_model
    {
        return Err(r.err(format!(
            "word_embed_proj_dim {p} differs from hidden_size {d_model}; OPT models with \
                 projected embeddings are not supported"
        )));
    }
    if r.opt_bool("layer_norm_elementwise_affine")? == Some(false) {
        return Err(r.err("layer_norm_elementwise_affine: false is not supported".into()));
    }
    if r.opt_bool("do_layer_norm_before")? == Some(false) {
        return Err(r.err(
            "do_layer_norm_before: false (post-norm OPT, e.g. opt-350m) is not supported".into(),
        ));
    }
    let act_name = r.opt_str("activation_function")?.unwrap_or("relu");
    let activation = Activation::from_hf(act_name)
        .ok_or_else(|| r.err(format!("unsupported activation `{act_name}`")))?;
    let bias = r.opt_bool("enable_bias")?.unwrap_or(true);
    if !bias {
        return Err(r.err("OPT with enable_bias: false is not supported".into()));
    }
    let head_dim = d_model / n_heads;
    Ok(ModelSpec {
        arch: Arch::Opt,
        name: name_of(r.path),
        n_layers: r.size("num_hidden_layers", &MAX_LAYERS)?,
        d_model,
        n_heads,
        n_kv_heads: n_heads,
        head_dim,
        d_ff: r.size("ffn_dim", &MAX_DIM)?,
        vocab_size: r.size("vocab_size", &MAX_VOCAB)?,
        max_context: r.size("max_position_embeddings", &MAX_DIM)?,
        norm: NormKind::Layer,
        norm_eps: 1e-5,
        activation,
        gated_ffn: false,
        qkv_bias: true,
        out_bias: true,
        ffn_bias: true,
        position: PositionEncoding::Learned { offset: 2 },
        tied_output: r.opt_bool("tie_word_embeddings")?.unwrap_or(true),
        attn_scale: 1.0 / (head_dim as f32).sqrt(),
        qk_norm: false,
        moe: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const OLD: &str = r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama",
      "hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":4,
      "num_key_value_heads":2,"vocab_size":256,"rms_norm_eps":1e-5,"rope_theta":500000.0,
      "max_position_embeddings":128,"torch_dtype":"float32","tie_word_embeddings":false}"#;

    const NEW: &str = r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama",
      "hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":4,
      "num_key_value_heads":2,"vocab_size":256,"rms_norm_eps":1e-5,
      "rope_parameters":{"rope_theta":500000.0,"rope_type":"default"},
      "max_position_embeddings":128,"dtype":"bfloat16","tie_word_embeddings":false}"#;

    #[test]
    fn both_key_styles_give_the_same_spec() {
        let p = Path::new("/m/config.json");
        let a = parse_config(p, OLD).unwrap();
        let b = parse_config(p, NEW).unwrap();
        assert_eq!(a.spec, b.spec);
        assert_eq!(a.dtype.as_deref(), Some("float32"));
        assert_eq!(b.dtype.as_deref(), Some("bfloat16"));
        let PositionEncoding::Rope(r) = &a.spec.position else {
            panic!("llama uses rope")
        };
        assert_eq!(r.theta, 500000.0);
        assert_eq!(a.spec.head_dim, 16);
    }

    #[test]
    fn unknown_architecture_is_named() {
        let e = parse_config(Path::new("c.json"), r#"{"model_type":"mamba"}"#).unwrap_err();
        assert!(
            e.to_string().contains("unknown architecture `mamba`"),
            "{e}"
        );
    }

    /// Sizes over their limits and numbers no model has are refused naming the key (a
    /// billion layers aborted the loader; a scaling factor of 0 made every logit NaN).
    #[test]
    fn impossible_values_are_refused_naming_the_key() {
        let p = Path::new("c.json");
        for (from, to, needles) in [
            (
                "\"num_hidden_layers\":2",
                "\"num_hidden_layers\":1000000000",
                &["`num_hidden_layers`", "max_layers"][..],
            ),
            (
                "\"vocab_size\":256",
                "\"vocab_size\":4294967296",
                &["`vocab_size`", "max_vocab"],
            ),
            (
                "\"num_attention_heads\":4",
                "\"num_attention_heads\":1000000",
                &["`num_attention_heads`", "max_heads"],
            ),
            (
                "\"rms_norm_eps\":1e-5",
                "\"rms_norm_eps\":-1e-5",
                &["`rms_norm_eps`"],
            ),
            (
                "\"rms_norm_eps\":1e-5",
                "\"rms_norm_eps\":0",
                &["`rms_norm_eps`"],
            ),
            (
                "\"rope_theta\":500000.0",
                "\"rope_theta\":0",
                &["`rope_theta`"],
            ),
            (
                "\"rope_theta\":500000.0",
                "\"rope_theta\":5e5,\"rope_scaling\":{\"type\":\"linear\",\"factor\":0}",
                &["`rope_scaling.factor`", "positive"],
            ),
            (
                "\"num_key_value_heads\":2",
                "\"num_key_value_heads\":3",
                &["`num_key_value_heads`"],
            ),
            (
                "\"num_hidden_layers\":2",
                "\"num_hidden_layers\":0",
                &["`num_hidden_layers`"],
            ),
        ] {
            let text = OLD.replace(from, to);
            assert_ne!(text, OLD, "{to}");
            let e = parse_config(p, &text).unwrap_err().to_string();
            for n in needles {
                assert!(e.contains(n), "{to}: {e}");
            }
        }
    }

    #[test]
    fn wrong_types_are_named() {
        let bad = OLD.replace("\"hidden_size\":64", "\"hidden_size\":\"64\"");
        let e = parse_config(Path::new("c.json"), &bad).unwrap_err();
        assert!(e.to_string().contains("hidden_size"), "{e}");
    }
}
