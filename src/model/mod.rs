//! What a model is: its spec, its weights on the host, its tokenizer and chat template, read from
//! a GGUF file or a Hugging Face directory. Knows nothing about devices or execution.

pub mod config;
pub mod experts;
pub mod ggml;
pub mod gguf;
mod load_gguf;
mod load_hf;
pub mod quant_mix;
pub mod quantize_gguf;
pub mod spec;
pub mod synth;
pub mod tokenizer;

use std::path::{Path, PathBuf};

use thiserror::Error;

pub use spec::{
    Activation, Arch, ModelSpec, NormKind, PositionEncoding, RopeScaling, RopeSpec, RopeStyle,
};
pub use tokenizer::{ChatMessage, Tokenizer};

use crate::tensor::HostTensor;

#[derive(Debug, Error)]
pub enum ModelError {
    #[error("cannot read {}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: {msg}", path.display())]
    Format { path: PathBuf, msg: String },
    #[error("{}: truncated: {msg}", path.display())]
    Truncated { path: PathBuf, msg: String },
    #[error("{}: unsupported: {msg}", path.display())]
    Unsupported { path: PathBuf, msg: String },
    #[error("{}: tensor `{name}` is missing", path.display())]
    MissingTensor { path: PathBuf, name: String },
    #[error("{}: tensor `{name}` has shape {got:?}, expected {expected:?}", path.display())]
    Shape {
        path: PathBuf,
        name: String,
        expected: (usize, usize),
        got: (usize, usize),
    },
    #[error("{}: {msg}", path.display())]
    Config { path: PathBuf, msg: String },
    #[error("{}: tokenizer: {msg}", path.display())]
    Tokenizer { path: PathBuf, msg: String },
}

impl ModelError {
    pub fn io(path: &Path, source: std::io::Error) -> Self {
        ModelError::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

/// All of a file read whole (config.json, tokenizer.json, a safetensors index), held to
/// [`crate::limits::MAX_FILE_READ_BYTES`] before and while reading.
pub fn read_whole(path: &Path) -> Result<Vec<u8>, ModelError> {
    crate::limits::MAX_FILE_READ_BYTES
        .read_file(path)
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::FileTooLarge => ModelError::Format {
                path: path.to_path_buf(),
                msg: e.to_string(),
            },
            _ => ModelError::io(path, e),
        })
}

/// [`read_whole`] as UTF-8 text.
pub fn read_whole_string(path: &Path) -> Result<String, ModelError> {
    String::from_utf8(read_whole(path)?).map_err(|_| ModelError::Format {
        path: path.to_path_buf(),
        msg: "is not valid UTF-8".into(),
    })
}

/// The weights of one norm: scale, and a bias for LayerNorm.
#[derive(Clone, Debug)]
pub struct NormWeights {
    pub weight: HostTensor,
    pub bias: Option<HostTensor>,
}

/// A linear layer `y = W·x (+ b)`, `W` is `out × in`.
#[derive(Clone, Debug)]
pub struct Linear {
    pub weight: HostTensor,
    pub bias: Option<HostTensor>,
}

#[derive(Clone, Debug)]
pub struct LayerWeights {
    pub attn_norm: NormWeights,
    pub wq: Linear,
    pub wk: Linear,
    pub wv: Linear,
    pub wo: Linear,
    /// Per-head RMSNorm of q and of k before the rotation ([`ModelSpec::qk_norm`]).
    pub q_norm: Option<NormWeights>,
    pub k_norm: Option<NormWeights>,
    pub ffn_norm: NormWeights,
    /// A mixture-of-experts layer's router (`experts × d_model`); its experts are the FFN
    /// matrices below, side by side ([`spec::MoeSpec`]).
    pub router: Option<HostTensor>,
    /// Present for gated FFNs.
    pub w_gate: Option<Linear>,
    pub w_up: Linear,
    pub w_down: Linear,
}

#[derive(Clone, Debug)]
pub struct ModelWeights {
    /// `vocab × d_model`.
    pub token_embd: HostTensor,
    /// Learned positions (OPT): `(max_context + offset) × d_model`.
    pub pos_embd: Option<HostTensor>,
    pub layers: Vec<LayerWeights>,
    pub output_norm: NormWeights,
    /// `vocab × d_model`; `None` when tied to `token_embd`.
    pub output: Option<HostTensor>,
    /// Per-pair RoPE frequency divisors (Llama 3.1 GGUF files ship them as a tensor).
    pub rope_freq_factors: Option<Vec<f32>>,
}

impl ModelWeights {
    /// The matrix that maps the final hidden state to logits.
    pub fn output_matrix(&self) -> &HostTensor {
        self.output.as_ref().unwrap_or(&self.token_embd)
    }

    /// Every tensor once, with a stable order (for byte accounting and hashing).
    pub fn tensors(&self) -> Vec<&HostTensor> {
        let mut v = vec![&self.token_embd];
        v.extend(self.pos_embd.as_ref());
        for l in &self.layers {
            v.extend(norm_tensors(&l.attn_norm));
            for lin in [&l.wq, &l.wk, &l.wv, &l.wo] {
                v.extend(linear_tensors(lin));
            }
            for n in [&l.q_norm, &l.k_norm].into_iter().flatten() {
                v.extend(norm_tensors(n));
            }
            v.extend(norm_tensors(&l.ffn_norm));
            v.extend(l.router.as_ref());
            if let Some(g) = &l.w_gate {
                v.extend(linear_tensors(g));
            }
            v.extend(linear_tensors(&l.w_up));
            v.extend(linear_tensors(&l.w_down));
        }
        v.extend(norm_tensors(&self.output_norm));
        v.extend(self.output.as_ref());
        v
    }

    pub fn total_bytes(&self) -> usize {
        self.tensors().iter().map(|t| t.data.len()).sum()
    }
}

fn norm_tensors(n: &NormWeights) -> impl Iterator<Item = &HostTensor> {
    std::iter::once(&n.weight).chain(n.bias.as_ref())
}

fn linear_tensors(l: &Linear) -> impl Iterator<Item = &HostTensor> {
    std::iter::once(&l.weight).chain(l.bias.as_ref())
}

/// A loaded model.
pub struct Model {
    pub spec: ModelSpec,
    pub weights: ModelWeights,
    pub tokenizer: Option<Tokenizer>,
    pub source: PathBuf,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("spec", &self.spec)
            .field("source", &self.source)
            .finish()
    }
}

impl Model {
    /// Load a GGUF file or a Hugging Face model directory.
    pub fn load(path: &Path) -> Result<Model, ModelError> {
        let meta = std::fs::metadata(path).map_err(|e| ModelError::io(path, e))?;
        let model = if meta.is_dir() {
            load_hf::load(path)?
        } else {
            load_gguf::load(path)?
        };
        model.check_shapes()?;
        Ok(model)
    }

    /// Every weight has the shape the spec implies.
    fn check_shapes(&self) -> Result<(), ModelError> {
        let s = &self.spec;
        let w = &self.weights;
        let check = |t: &HostTensor, rows: usize, cols: usize| {
            if (t.rows, t.cols) != (rows, cols) {
                Err(ModelError::Shape {
                    path: self.source.clone(),
                    name: t.name.clone(),
                    expected: (rows, cols),
                    got: (t.rows, t.cols),
                })
            } else {
                Ok(())
            }
        };
        let check_norm = |n: &NormWeights| {
            check(&n.weight, 1, s.d_model)?;
            n.bias.as_ref().map_or(Ok(()), |b| check(b, 1, s.d_model))
        };
        let check_lin = |l: &Linear, rows: usize, cols: usize| {
            check(&l.weight, rows, cols)?;
            l.bias.as_ref().map_or(Ok(()), |b| check(b, 1, rows))
        };
        check(&w.token_embd, s.vocab_size, s.d_model)?;
        if let Some(o) = &w.output {
            check(o, s.vocab_size, s.d_model)?;
        }
        if let (Some(p), PositionEncoding::Learned { offset }) = (&w.pos_embd, &s.position)
            && (p.cols != s.d_model || p.rows <= *offset)
        {
            return Err(ModelError::Shape {
                path: self.source.clone(),
                name: p.name.clone(),
                expected: (s.max_context + offset, s.d_model),
                got: (p.rows, p.cols),
            });
        }
        check_norm(&w.output_norm)?;
        if w.layers.len() != s.n_layers {
            return Err(ModelError::Format {
                path: self.source.clone(),
                msg: format!("{} layers found, {} declared", w.layers.len(), s.n_layers),
            });
        }
        for l in &w.layers {
            check_norm(&l.attn_norm)?;
            check_norm(&l.ffn_norm)?;
            let head_norms = [&l.q_norm, &l.k_norm];
            if head_norms.iter().any(|n| n.is_some() != s.qk_norm) {
                return Err(ModelError::Format {
                    path: self.source.clone(),
                    msg: format!(
                        "the spec says the model {} norm each head of q and k, but a layer has {} of the two norms",
                        if s.qk_norm { "does" } else { "does not" },
                        head_norms.iter().filter(|n| n.is_some()).count()
                    ),
                });
            }
            for n in head_norms.into_iter().flatten() {
                check(&n.weight, 1, s.head_dim)?;
            }
            match (&s.moe, &l.router) {
                (Some(m), Some(r)) => check(r, m.router_rows(), s.d_model)?,
                (None, None) => {}
                (Some(_), None) => {
                    return Err(ModelError::Format {
                        path: self.source.clone(),
                        msg: "a mixture-of-experts layer has no router".into(),
                    });
                }
                (None, Some(r)) => {
                    return Err(ModelError::Format {
                        path: self.source.clone(),
                        msg: format!("`{}` is a router, but the model has no experts", r.name),
                    });
                }
            }
            check_lin(&l.wq, s.q_dim(), s.d_model)?;
            check_lin(&l.wk, s.kv_dim(), s.d_model)?;
            check_lin(&l.wv, s.kv_dim(), s.d_model)?;
            check_lin(&l.wo, s.d_model, s.q_dim())?;
            if let Some(g) = &l.w_gate {
                check_lin(g, s.d_ff, s.d_model)?;
            }
            check_lin(&l.w_up, s.d_ff, s.d_model)?;
            match &s.moe {
                // Each expert's down after the last's (see `experts`).
                Some(m) => check_lin(&l.w_down, (m.experts + m.shared) * s.d_model, m.d_expert)?,
                None => check_lin(&l.w_down, s.d_model, s.d_ff)?,
            }
        }
        if let (Some(f), PositionEncoding::Rope(r)) = (&w.rope_freq_factors, &s.position)
            && f.len() != r.dims / 2
        {
            return Err(ModelError::Format {
                path: self.source.clone(),
                msg: format!(
                    "rope_freqs has {} entries, expected {}",
                    f.len(),
                    r.dims / 2
                ),
            });
        }
        Ok(())
    }
}

/// File name of the default model that `scripts/fetch-models.sh` downloads.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// Where fetched models live: `$GPU_OFFLOAD_MODELS`, else `$XDG_CACHE_HOME/gpu-offload/models`,
/// else `~/.cache/gpu-offload/models`.
pub fn models_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("GPU_OFFLOAD_MODELS") {
        return PathBuf::from(d);
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| PathBuf::from(".cache"));
    cache.join("gpu-offload").join("models")
}

/// The model `run` uses when none is given.
pub fn default_model_path() -> PathBuf {
    models_dir().join(DEFAULT_MODEL_FILE)
}
