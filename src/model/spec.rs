//! `ModelSpec`: everything the engine needs to know about a model's shape and numerics, whatever
//! file it came from.

use serde::{Deserialize, Serialize};

use crate::limits;

/// Model families with one forward pass each.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// LLaMA family: Llama 2/3, Mistral, Qwen2 (QKV bias), ReLU/ReGLU variants.
    Llama,
    /// OPT: LayerNorm, learned positions, ReLU FFN, biases, tied output.
    Opt,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NormKind {
    Rms,
    Layer,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    Silu,
    Relu,
    /// Exact (erf) GELU.
    Gelu,
    /// tanh approximation of GELU.
    GeluTanh,
}

impl Activation {
    /// Parse a HF `hidden_act` / `activation_function` name.
    pub fn from_hf(name: &str) -> Option<Self> {
        Some(match name {
            "silu" | "swish" => Self::Silu,
            "relu" => Self::Relu,
            "gelu" => Self::Gelu,
            "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Self::GeluTanh,
            _ => return None,
        })
    }
}

/// Which dimensions RoPE rotates together.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RopeStyle {
    /// Pairs (2i, 2i+1): llama.cpp's LLAMA layout (its converter permutes Q/K rows into it).
    Adjacent,
    /// Pairs (i, i + d/2): HF checkpoints, and llama.cpp's NEOX layout (qwen2).
    Halves,
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor`.
    Linear {
        factor: f32,
    },
    /// Llama 3.1 frequency-dependent scaling.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position: usize,
    },
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RopeSpec {
    pub theta: f32,
    pub style: RopeStyle,
    /// Rotated dimensions per head (the rest pass through).
    pub dims: usize,
    pub scaling: RopeScaling,
}

impl RopeSpec {
    /// The inverse frequency of each rotated pair, with scaling applied.
    pub fn inv_freqs(&self, freq_factors: Option<&[f32]>) -> Vec<f32> {
        let half = self.dims / 2;
        (0..half)
            .map(|i| {
                let base = self.theta.powf(-(2.0 * i as f32) / self.dims as f32);
                let scaled = match self.scaling {
                    RopeScaling::None => base,
                    RopeScaling::Linear { factor } => base / factor,
                    RopeScaling::Llama3 {
                        factor,
                        low_freq_factor,
                        high_freq_factor,
                        original_max_position,
                    } => {
                        let old = original_max_position as f32;
                        let low_wavelen = old / low_freq_factor;
                        let high_wavelen = old / high_freq_factor;
                        let wavelen = 2.0 * std::f32::consts::PI / base;
                        if wavelen < high_wavelen {
                            base
                        } else if wavelen > low_wavelen {
                            base / factor
                        } else {
                            let smooth = (old / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * base / factor + smooth * base
                        }
                    }
                };
                match freq_factors {
                    Some(f) => scaled / f[i],
                    None => scaled,
                }
            })
            .collect()
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum PositionEncoding {
    Rope(RopeSpec),
    /// A learned table indexed by `position + offset` (OPT uses offset 2).
    Learned {
        offset: usize,
    },
}

/// A mixture-of-experts FFN: `experts` gated FFNs of `d_expert` neurons, stacked in the layer's
/// FFN matrices ([`super::experts`]; so `d_ff` = `experts × d_expert`: expert `e` is neurons
/// `e·d_expert ..`), `used` of them a token, chosen as transformers chooses them: the router's
/// logits, a softmax over all experts in f32, the top `used` (ties to the lower index), their
/// weights renormalised to sum to 1 where `norm_top_k`.
///
/// A shared expert (Qwen2-MoE's, every token's, weighted by the sigmoid of its own gate) is
/// `shared` more experts of `d_expert` neurons after the routed ones — an FFN is a sum over its
/// neurons, so a wide one split into equal parts is exact — and its gate is the router's last
/// row.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MoeSpec {
    pub experts: usize,
    pub used: usize,
    pub d_expert: usize,
    /// Mixtral always; Qwen's `norm_topk_prob`.
    pub norm_top_k: bool,
    /// The shared expert's width in `d_expert` parts (0: none).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub shared: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

impl MoeSpec {
    /// The FFN's neurons: every expert's, side by side (the spec's `d_ff`). Loaders hold both
    /// factors to their limits first, so the product fits; the spec's check holds it to max_dim.
    pub fn neurons(&self) -> usize {
        (self.experts + self.shared) * self.d_expert
    }

    /// The router's rows: one per routed expert, and the shared expert's gate.
    pub fn router_rows(&self) -> usize {
        self.experts + usize::from(self.shared > 0)
    }
}

/// The shape and numerics of one model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelSpec {
    pub arch: Arch,
    /// Human-readable name (from the file's metadata, else the file name).
    pub name: String,
    pub n_layers: usize,
    pub d_model: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub d_ff: usize,
    pub vocab_size: usize,
    /// The longest sequence the model was trained for.
    pub max_context: usize,
    pub norm: NormKind,
    pub norm_eps: f32,
    pub activation: Activation,
    /// `down(act(gate·x) ⊙ up·x)` when true, `down(act(up·x))` otherwise.
    pub gated_ffn: bool,
    pub qkv_bias: bool,
    /// RMSNorm over each head of q and k (weights `head_dim` long, the model's epsilon) before
    /// the rotation (Qwen3). Left out of the manifest when false, so stores written before it
    /// keep their checksums.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub qk_norm: bool,
    /// A mixture-of-experts FFN in every layer (none: dense). Left out of the manifest when none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<MoeSpec>,
    pub out_bias: bool,
    pub ffn_bias: bool,
    pub position: PositionEncoding,
    pub tied_output: bool,
    /// Multiplier on q·k before the softmax.
    pub attn_scale: f32,
}

impl ModelSpec {
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Check the spec could be a model's, whatever file it came from (GGUF, config.json, a
    /// store's manifest): every count and dimension positive and within [`crate::limits`],
    /// head sizes that divide, and numerics (epsilon, RoPE base and scaling, attention scale)
    /// finite and positive. Loaders call it before allocating anything by the spec's sizes.
    /// The error names the spec's field ([`SpecError::field`]) so a loader can name its key.
    pub fn check(&self) -> Result<(), SpecError> {
        let err = |field: &'static str, msg: String| Err(SpecError { field, msg });
        let counts = [
            ("n_layers", self.n_layers, &limits::MAX_LAYERS),
            ("d_model", self.d_model, &limits::MAX_DIM),
            ("n_heads", self.n_heads, &limits::MAX_HEADS),
            ("n_kv_heads", self.n_kv_heads, &limits::MAX_HEADS),
            ("head_dim", self.head_dim, &limits::MAX_DIM),
            ("d_ff", self.d_ff, &limits::MAX_DIM),
            ("vocab_size", self.vocab_size, &limits::MAX_VOCAB),
            ("max_context", self.max_context, &limits::MAX_DIM),
        ];
        for (field, v, limit) in counts {
            if v == 0 {
                return err(field, "is 0".into());
            }
            if !limit.admits(v as u64) {
                return err(field, limit.over(v as u64));
            }
        }
        // Both factors are bounded above, so these products cannot overflow.
        for (field, v) in [("n_heads", self.q_dim()), ("n_kv_heads", self.kv_dim())] {
            if !limits::MAX_DIM.admits(v as u64) {
                return err(
                    field,
                    format!(
                        "times head_dim {} {}",
                        self.head_dim,
                        limits::MAX_DIM.over(v as u64)
                    ),
                );
            }
        }
        if let Some(m) = &self.moe {
            if m.experts == 0 || !limits::MAX_EXPERTS.admits(m.experts as u64) {
                let msg = match m.experts {
                    0 => "is 0".into(),
                    n => limits::MAX_EXPERTS.over(n as u64),
                };
                return err("moe.experts", msg);
            }
            if m.used == 0 || m.used > m.experts {
                return err(
                    "moe.used",
                    format!(
                        "is {}: a token uses at least one and at most all {} experts",
                        m.used, m.experts
                    ),
                );
            }
            if !limits::MAX_EXPERTS.admits(m.shared as u64) {
                return err("moe.shared", limits::MAX_EXPERTS.over(m.shared as u64));
            }
            let parts = m.experts + m.shared;
            if m.d_expert == 0 || parts.checked_mul(m.d_expert) != Some(self.d_ff) {
                return err(
                    "moe.d_expert",
                    format!(
                        "is {}: {parts} experts of it must make the FFN's {} neurons",
                        m.d_expert, self.d_ff
                    ),
                );
            }
            if !self.gated_ffn {
                return err("moe", "experts are gated FFNs (SwiGLU) here".into());
            }
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return err(
                "n_kv_heads",
                format!(
                    "is {}, which does not divide the {} attention heads",
                    self.n_kv_heads, self.n_heads
                ),
            );
        }
        match &self.position {
            PositionEncoding::Rope(r) => {
                if r.dims == 0 || r.dims > self.head_dim || r.dims % 2 != 0 {
                    return err(
                        "rope.dims",
                        format!(
                            "is {}: RoPE rotates an even number of dimensions, at most the \
                             head dim {}",
                            r.dims, self.head_dim
                        ),
                    );
                }
                if !(r.theta.is_finite() && r.theta > 1.0) {
                    return err(
                        "rope.theta",
                        format!("is {}: the RoPE base must be finite and above 1", r.theta),
                    );
                }
                r.scaling.check()?;
            }
            PositionEncoding::Learned { offset } => {
                if !limits::MAX_DIM.admits(*offset as u64) {
                    return err("position.offset", limits::MAX_DIM.over(*offset as u64));
                }
            }
        }
        if !(self.norm_eps.is_finite() && self.norm_eps > 0.0) {
            return err(
                "norm_eps",
                format!(
                    "is {}: a norm epsilon must be finite and positive",
                    self.norm_eps
                ),
            );
        }
        if !(self.attn_scale.is_finite() && self.attn_scale > 0.0) {
            return err(
                "attn_scale",
                format!(
                    "is {}: the attention scale must be finite and positive",
                    self.attn_scale
                ),
            );
        }
        Ok(())
    }

    /// [`ModelSpec::check`] as a sentence naming the spec's field.
    pub fn validate(&self) -> Result<(), String> {
        self.check().map_err(|e| e.to_string())
    }
}

impl RopeScaling {
    /// Every factor finite and positive (0 or NaN made every logit NaN), a Llama 3 band that is
    /// a band.
    fn check(&self) -> Result<(), SpecError> {
        let positive = |field: &'static str, v: f32| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(SpecError {
                    field,
                    msg: format!("is {v}: a RoPE scaling factor must be finite and positive"),
                })
            }
        };
        match *self {
            RopeScaling::None => Ok(()),
            RopeScaling::Linear { factor } => positive("factor", factor),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position,
            } => {
                positive("factor", factor)?;
                positive("low_freq_factor", low_freq_factor)?;
                positive("high_freq_factor", high_freq_factor)?;
                if high_freq_factor <= low_freq_factor {
                    return Err(SpecError {
                        field: "high_freq_factor",
                        msg: format!(
                            "is {high_freq_factor}, not above low_freq_factor {low_freq_factor}"
                        ),
                    });
                }
                if original_max_position == 0
                    || !limits::MAX_DIM.admits(original_max_position as u64)
                {
                    return Err(SpecError {
                        field: "original_max_position",
                        msg: format!(
                            "is {original_max_position}, not in 1..={}",
                            limits::MAX_DIM.value
                        ),
                    });
                }
                Ok(())
            }
        }
    }
}

/// Why a [`ModelSpec`] cannot be a model's: the field (`norm_eps`, `rope.theta`, a RoPE
/// scaling factor's name...) and what is wrong with it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpecError {
    pub field: &'static str,
    pub msg: String,
}

impl SpecError {
    /// The sentence with the field called by the name the file gives it (`key`), the spec's
    /// field in parentheses.
    pub fn naming(&self, key: &str) -> String {
        if key == self.field {
            return self.to_string();
        }
        format!("`{key}` ({}) {}", self.field, self.msg)
    }
}

impl std::fmt::Display for SpecError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "`{}` {}", self.field, self.msg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> ModelSpec {
        ModelSpec {
            arch: Arch::Llama,
            name: "t".into(),
            n_layers: 2,
            d_model: 64,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 16,
            d_ff: 128,
            vocab_size: 256,
            max_context: 128,
            norm: NormKind::Rms,
            norm_eps: 1e-5,
            activation: Activation::Silu,
            gated_ffn: true,
            qkv_bias: false,
            out_bias: false,
            ffn_bias: false,
            position: PositionEncoding::Rope(RopeSpec {
                theta: 10000.0,
                style: RopeStyle::Halves,
                dims: 16,
                scaling: RopeScaling::None,
            }),
            tied_output: false,
            attn_scale: 0.25,
            qk_norm: false,
            moe: None,
        }
    }

    /// Every field a spec can hold that no model has is refused, naming the field.
    #[test]
    fn impossible_specs_are_refused_naming_the_field() {
        assert_eq!(tiny().check(), Ok(()));
        let rope = |f: &dyn Fn(&mut RopeSpec)| {
            let mut s = tiny();
            if let PositionEncoding::Rope(r) = &mut s.position {
                f(r);
            }
            s
        };
        let cases: Vec<(ModelSpec, &str, &str)> = vec![
            (
                ModelSpec {
                    n_layers: 0,
                    ..tiny()
                },
                "n_layers",
                "is 0",
            ),
            (
                ModelSpec {
                    n_layers: 1_000_000_000,
                    ..tiny()
                },
                "n_layers",
                "max_layers",
            ),
            (
                ModelSpec {
                    d_model: 1 << 30,
                    ..tiny()
                },
                "d_model",
                "max_dim",
            ),
            (
                ModelSpec {
                    n_heads: 5000,
                    ..tiny()
                },
                "n_heads",
                "max_heads",
            ),
            (
                ModelSpec {
                    vocab_size: 1 << 30,
                    ..tiny()
                },
                "vocab_size",
                "max_vocab",
            ),
            (
                ModelSpec {
                    max_context: 0,
                    ..tiny()
                },
                "max_context",
                "is 0",
            ),
            (
                ModelSpec {
                    n_heads: 4096,
                    head_dim: 1 << 20,
                    ..tiny()
                },
                "n_heads",
                "max_dim",
            ),
            (
                ModelSpec {
                    n_kv_heads: 3,
                    ..tiny()
                },
                "n_kv_heads",
                "does not divide",
            ),
            (
                ModelSpec {
                    norm_eps: f32::NAN,
                    ..tiny()
                },
                "norm_eps",
                "finite",
            ),
            (
                ModelSpec {
                    norm_eps: 0.0,
                    ..tiny()
                },
                "norm_eps",
                "positive",
            ),
            (
                ModelSpec {
                    norm_eps: -1e-5,
                    ..tiny()
                },
                "norm_eps",
                "positive",
            ),
            (
                ModelSpec {
                    attn_scale: f32::INFINITY,
                    ..tiny()
                },
                "attn_scale",
                "finite",
            ),
            (rope(&|r| r.theta = f32::NAN), "rope.theta", "finite"),
            (rope(&|r| r.dims = 15), "rope.dims", "even"),
            (rope(&|r| r.dims = 32), "rope.dims", "head dim"),
            (
                rope(&|r| r.scaling = RopeScaling::Linear { factor: 0.0 }),
                "factor",
                "positive",
            ),
            (
                rope(&|r| r.scaling = RopeScaling::Linear { factor: f32::NAN }),
                "factor",
                "finite",
            ),
            (
                rope(&|r| {
                    r.scaling = RopeScaling::Llama3 {
                        factor: 8.0,
                        low_freq_factor: 4.0,
                        high_freq_factor: 4.0,
                        original_max_position: 8192,
                    }
                }),
                "high_freq_factor",
                "not above",
            ),
        ];
        for (spec, field, needle) in cases {
            let e = spec.check().unwrap_err();
            assert_eq!(e.field, field, "{e}");
            assert!(e.to_string().contains(needle), "{e}");
        }
    }

    #[test]
    fn llama3_scaling_keeps_high_frequencies() {
        let r = RopeSpec {
            theta: 500000.0,
            style: RopeStyle::Halves,
            dims: 128,
            scaling: RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position: 8192,
            },
        };
        let plain = RopeSpec {
            scaling: RopeScaling::None,
            ..r.clone()
        };
        let (a, b) = (r.inv_freqs(None), plain.inv_freqs(None));
        assert_eq!(a[0], b[0]);
        assert!((a[63] - b[63] / 8.0).abs() < 1e-12);
    }
}
