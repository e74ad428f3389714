//! `ModelSpec`: everything the engine needs to know about a model's shape and numerics, whatever
//! file it came from.

use serde::{Deserialize, Serialize};

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

    /// Check the numbers agree with each other; `what` names the source in errors.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("layers", self.n_layers),
            ("hidden size", self.d_model),
            ("attention heads", self.n_heads),
            ("KV heads", self.n_kv_heads),
            ("head dim", self.head_dim),
            ("FFN size", self.d_ff),
            ("vocabulary size", self.vocab_size),
        ];
        for (what, v) in positive {
            if v == 0 {
                return Err(format!("{what} is 0"));
            }
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(format!(
                "{} attention heads are not a multiple of {} KV heads",
                self.n_heads, self.n_kv_heads
            ));
        }
        if let PositionEncoding::Rope(r) = &self.position {
            if r.dims == 0 || r.dims > self.head_dim || r.dims % 2 != 0 {
                return Err(format!(
                    "RoPE dimension {} does not fit head dim {}",
                    r.dims, self.head_dim
                ));
            }
            if !(r.theta.is_finite() && r.theta > 1.0) {
                return Err(format!("RoPE theta {} is not valid", r.theta));
            }
        }
        if !(self.norm_eps.is_finite() && self.norm_eps >= 0.0) {
            return Err(format!("norm epsilon {} is not valid", self.norm_eps));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
