//! Deterministic synthetic models in Hugging Face format (config.json + sharded safetensors):
//! any LLaMA-family or OPT shape, f16 or bf16, generated in parallel and streamed to disk, so a
//! 7B-shaped model takes about a minute on a 16-core machine. Optionally plants activation
//! structure: FFN neurons whose activation frequency follows a power law (hot and cold neurons),
//! for the sparse paths to exploit.
//!
//! The values are a pure function of (seed, tensor name, position): the same options give the
//! same bytes on any machine.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use half::{bf16, f16, slice::HalfFloatSliceExt};
use rayon::prelude::*;
use safetensors::tensor::{Dtype, View};
use serde_json::json;

use super::ModelError;
use super::spec::Arch;

mod moe;
use crate::limits;
pub use moe::SynthMoe;

/// Values generated per parallel chunk (each chunk has its own generator state).
const CHUNK: usize = 1 << 16;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SynthDtype {
    F16,
    Bf16,
}

/// The shape and options of a synthetic model.
#[derive(Clone, Debug)]
pub struct SynthSpec {
    pub arch: Arch,
    pub n_layers: usize,
    pub d_model: usize,
    pub d_ff: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub vocab_size: usize,
    pub max_context: usize,
    pub dtype: SynthDtype,
    /// LLaMA: `silu` (SwiGLU) or `relu` (ReGLU). OPT is always ReLU.
    pub activation: String,
    pub tied_output: bool,
    pub seed: u64,
    /// Plant hot/cold FFN neurons: the neuron at rank fraction q ∈ [0, 1) fires with frequency
    /// about `0.95·(1 + 200q)^(-exponent)` (exponent 0.8: ~5% of neurons active per token, the
    /// hottest 20% carrying ~60% of activations).
    pub power_law: Option<f64>,
    /// Bytes per safetensors shard.
    pub shard_bytes: u64,
    /// Experts in place of the dense FFN (`d_ff` is then each expert's width; GGUF only).
    pub moe: Option<SynthMoe>,
}

impl SynthSpec {
    /// Named shapes: `tiny` (CI), `1b` (TinyLlama-like), `7b` (Llama-2-7B), `13b`, `70b`; with
    /// experts `tiny-moe` (CI), `qwen3-30b-a3b`, `mixtral-8x7b`.
    pub fn preset(name: &str) -> Option<Self> {
        if let Some(s) = moe::preset(name) {
            return Some(s);
        }
        let base = |n_layers, d_model, d_ff, n_heads, n_kv_heads, vocab_size| SynthSpec {
            arch: Arch::Llama,
            n_layers,
            d_model,
            d_ff,
            n_heads,
            n_kv_heads,
            vocab_size,
            max_context: 4096,
            dtype: SynthDtype::F16,
            activation: "silu".into(),
            tied_output: false,
            seed: 0,
            power_law: None,
            shard_bytes: 4 << 30,
            moe: None,
        };
        Some(match name {
            "tiny" => SynthSpec {
                max_context: 256,
                ..base(2, 64, 160, 4, 2, 256)
            },
            "1b" => base(22, 2048, 5632, 32, 4, 32000),
            "7b" => base(32, 4096, 11008, 32, 32, 32000),
            "13b" => base(40, 5120, 13824, 40, 40, 32000),
            "70b" => base(80, 8192, 28672, 64, 8, 32000),
            _ => return None,
        })
    }

    pub fn validate(&self) -> Result<(), String> {
        let dims = [
            ("layers", self.n_layers),
            ("hidden size", self.d_model),
            ("FFN size", self.d_ff),
            ("heads", self.n_heads),
            ("KV heads", self.n_kv_heads),
            ("vocabulary", self.vocab_size),
            ("context", self.max_context),
        ];
        if let Some((what, _)) = dims.iter().find(|(_, v)| *v == 0) {
            return Err(format!("{what} must be positive"));
        }
        // Held to the limits every loader holds a model to, before anything is computed or
        // created from them.
        let limited = [
            ("layers", self.n_layers, &limits::MAX_LAYERS),
            ("hidden size", self.d_model, &limits::MAX_DIM),
            ("FFN size", self.d_ff, &limits::MAX_DIM),
            ("heads", self.n_heads, &limits::MAX_HEADS),
            ("KV heads", self.n_kv_heads, &limits::MAX_HEADS),
            ("vocabulary", self.vocab_size, &limits::MAX_VOCAB),
            ("context", self.max_context, &limits::MAX_DIM),
        ];
        for (what, v, limit) in limited {
            if !limit.admits(v as u64) {
                return Err(limit.refuse(what, v as u64));
            }
        }
        if !self.d_model.is_multiple_of(self.n_heads) {
            return Err(format!(
                "hidden size {} is not divisible by {} heads",
                self.d_model, self.n_heads
            ));
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(format!(
                "{} heads are not a multiple of {} KV heads",
                self.n_heads, self.n_kv_heads
            ));
        }
        if self.arch == Arch::Opt && self.n_kv_heads != self.n_heads {
            return Err("OPT has no grouped-query attention: KV heads must equal heads".into());
        }
        if !matches!(self.activation.as_str(), "silu" | "relu") {
            return Err(format!("activation `{}` (silu or relu)", self.activation));
        }
        if let Some(m) = &self.moe {
            m.validate(self)?;
        }
        if self.power_law.is_some_and(|e| !(e > 0.0 && e.is_finite())) {
            return Err("the power-law exponent must be positive".into());
        }
        // A tensor is generated whole in memory (f32, then its 2-byte encoding): one larger
        // than the host's memory would abort the process halfway through writing.
        let largest = self
            .tensors()
            .iter()
            .map(|t| (t.rows as u64).saturating_mul(t.cols as u64))
            .max()
            .unwrap_or(0);
        if let Some(mem) = host_memory_bytes()
            && largest.saturating_mul(6) > mem
        {
            return Err(format!(
                "the largest tensor has {largest} values, {} GiB to generate, more than this \
                 host's {} GiB of memory",
                largest.saturating_mul(6) >> 30,
                mem >> 30
            ));
        }
        Ok(())
    }

    fn head_dim(&self) -> usize {
        match &self.moe {
            Some(m) => m.head_dim,
            None => self.d_model / self.n_heads,
        }
    }

    /// Parameters of the model.
    pub fn parameters(&self) -> u64 {
        self.tensors()
            .iter()
            .map(|t| (t.rows * t.cols) as u64)
            .sum()
    }

    /// Every tensor: HF name, shape and how its values are drawn.
    fn tensors(&self) -> Vec<TensorPlan> {
        let (d, ff, hd) = (self.d_model, self.d_ff, self.head_dim());
        let kv = self.n_kv_heads * hd;
        let mut v = Vec::new();
        let lin = TensorPlan::linear;
        let norm = |name: String| TensorPlan::norm(name, d);
        let bias = |name: String, cols: usize| TensorPlan {
            name,
            rows: 1,
            cols,
            fill: Fill::Uniform { std: 0.02 },
        };
        let planted = self.power_law.map(|exponent| exponent as f32);
        // Embeddings share a direction where neurons or routers are planted along it.
        let shared_direction =
            planted.is_some() || self.moe.as_ref().is_some_and(|m| m.popularity > 0.0);
        match self.arch {
            Arch::Llama => {
                v.push(TensorPlan {
                    name: "model.embed_tokens.weight".into(),
                    rows: self.vocab_size,
                    cols: d,
                    fill: if shared_direction {
                        Fill::Embedding
                    } else {
                        Fill::Uniform { std: 1.0 }
                    },
                });
                for l in 0..self.n_layers {
                    if let Some(m) = &self.moe {
                        m.layer_tensors(self, l, &mut v);
                        continue;
                    }
                    let p = format!("model.layers.{l}");
                    v.push(norm(format!("{p}.input_layernorm.weight")));
                    v.push(lin(format!("{p}.self_attn.q_proj.weight"), d, d));
                    v.push(lin(format!("{p}.self_attn.k_proj.weight"), kv, d));
                    v.push(lin(format!("{p}.self_attn.v_proj.weight"), kv, d));
                    v.push(lin(format!("{p}.self_attn.o_proj.weight"), d, d));
                    v.push(norm(format!("{p}.post_attention_layernorm.weight")));
                    let gate = format!("{p}.mlp.gate_proj.weight");
                    v.push(match planted {
                        Some(exponent) => TensorPlan {
                            name: gate,
                            rows: ff,
                            cols: d,
                            fill: Fill::Planted { exponent },
                        },
                        None => lin(gate, ff, d),
                    });
                    v.push(lin(format!("{p}.mlp.up_proj.weight"), ff, d));
                    v.push(lin(format!("{p}.mlp.down_proj.weight"), d, ff));
                }
                v.push(norm("model.norm.weight".into()));
                if !self.tied_output {
                    v.push(lin("lm_head.weight".into(), self.vocab_size, d));
                }
            }
            Arch::Opt => {
                let p = "model.decoder";
                v.push(TensorPlan {
                    name: format!("{p}.embed_tokens.weight"),
                    rows: self.vocab_size,
                    cols: d,
                    fill: if planted.is_some() {
                        Fill::Embedding
                    } else {
                        Fill::Uniform { std: 1.0 }
                    },
                });
                v.push(TensorPlan {
                    name: format!("{p}.embed_positions.weight"),
                    rows: self.max_context + 2,
                    cols: d,
                    fill: Fill::Uniform { std: 0.1 },
                });
                for l in 0..self.n_layers {
                    let q = format!("{p}.layers.{l}");
                    for (n, rows, cols) in [
                        ("self_attn.q_proj", d, d),
                        ("self_attn.k_proj", d, d),
                        ("self_attn.v_proj", d, d),
                        ("self_attn.out_proj", d, d),
                    ] {
                        v.push(lin(format!("{q}.{n}.weight"), rows, cols));
                        v.push(bias(format!("{q}.{n}.bias"), rows));
                    }
                    for n in ["self_attn_layer_norm", "final_layer_norm"] {
                        v.push(norm(format!("{q}.{n}.weight")));
                        v.push(bias(format!("{q}.{n}.bias"), d));
                    }
                    let fc1 = format!("{q}.fc1.weight");
                    v.push(match planted {
                        Some(exponent) => TensorPlan {
                            name: fc1,
                            rows: ff,
                            cols: d,
                            fill: Fill::Planted { exponent },
                        },
                        None => lin(fc1, ff, d),
                    });
                    v.push(bias(format!("{q}.fc1.bias"), ff));
                    v.push(lin(format!("{q}.fc2.weight"), d, ff));
                    v.push(bias(format!("{q}.fc2.bias"), d));
                }
                v.push(norm(format!("{p}.final_layer_norm.weight")));
                v.push(bias(format!("{p}.final_layer_norm.bias"), d));
            }
        }
        v
    }

    fn config_json(&self) -> serde_json::Value {
        let torch_dtype = match self.dtype {
            SynthDtype::F16 => "float16",
            SynthDtype::Bf16 => "bfloat16",
        };
        match self.arch {
            Arch::Llama => json!({
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": self.d_model,
                "intermediate_size": self.d_ff,
                "num_hidden_layers": self.n_layers,
                "num_attention_heads": self.n_heads,
                "num_key_value_heads": self.n_kv_heads,
                "hidden_act": self.activation,
                "max_position_embeddings": self.max_context,
                "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0,
                "tie_word_embeddings": self.tied_output,
                "vocab_size": self.vocab_size,
                "bos_token_id": 1,
                "eos_token_id": 2,
                "torch_dtype": torch_dtype,
                "gpu_offload_synth": {"seed": self.seed, "power_law": self.power_law},
            }),
            Arch::Opt => json!({
                "architectures": ["OPTForCausalLM"],
                "model_type": "opt",
                "hidden_size": self.d_model,
                "ffn_dim": self.d_ff,
                "num_hidden_layers": self.n_layers,
                "num_attention_heads": self.n_heads,
                "activation_function": "relu",
                "max_position_embeddings": self.max_context,
                "do_layer_norm_before": true,
                "word_embed_proj_dim": self.d_model,
                "tie_word_embeddings": true,
                "vocab_size": self.vocab_size,
                "bos_token_id": 2,
                "eos_token_id": 2,
                "torch_dtype": torch_dtype,
                "gpu_offload_synth": {"seed": self.seed, "power_law": self.power_law},
            }),
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Fill {
    /// Uniform with this standard deviation.
    Uniform { std: f64 },
    /// 1 + small noise (norm scales).
    NearOne,
    /// Token embeddings sharing a common direction (so planted neurons see it).
    Embedding,
    /// FFN input rows: noise plus a per-neuron offset along the common direction, sized so the
    /// neuron of rank r fires with the power-law frequency.
    Planted { exponent: f32 },
    /// A router: noise plus a per-expert offset along the common direction (planted
    /// popularity, [`moe::router_offsets`]).
    Router { popularity: f32 },
}

#[derive(Clone, Debug)]
struct TensorPlan {
    name: String,
    rows: usize,
    cols: usize,
    fill: Fill,
}

impl TensorPlan {
    /// A matrix of unit-variance outputs for unit-variance inputs.
    fn linear(name: String, rows: usize, cols: usize) -> Self {
        TensorPlan {
            name,
            rows,
            cols,
            fill: Fill::Uniform {
                std: 1.0 / (cols as f64).sqrt(),
            },
        }
    }

    /// A norm's scale vector.
    fn norm(name: String, cols: usize) -> Self {
        TensorPlan {
            name,
            rows: 1,
            cols,
            fill: Fill::NearOne,
        }
    }
}

/// splitmix64: seeds independent per-chunk generators from (seed, tensor, chunk).
fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// xorshift64* stream of uniform values in [-1, 1).
struct Uniform(u64);

impl Uniform {
    fn new(seed: u64) -> Self {
        Uniform(splitmix(seed) | 1)
    }

    fn next(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let bits = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40; // 24 random bits
        bits as f32 * (2.0 / (1u64 << 24) as f32) - 1.0
    }
}

fn name_hash(name: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(name.as_bytes())
}

/// Inverse of the standard normal CDF (Acklam's rational approximation, |error| < 1.2e-9).
fn probit(p: f64) -> f64 {
    const A: [f64; 6] = [
        -3.969683028665376e+01,
        2.209460984245205e+02,
        -2.759285104469687e+02,
        1.383_577_518_672_69e2,
        -3.066479806614716e+01,
        2.506628277459239e+00,
    ];
    const B: [f64; 5] = [
        -5.447609879822406e+01,
        1.615858368580409e+02,
        -1.556989798598866e+02,
        6.680131188771972e+01,
        -1.328068155288572e+01,
    ];
    const C: [f64; 6] = [
        -7.784894002430293e-03,
        -3.223964580411365e-01,
        -2.400758277161838e+00,
        -2.549732539343734e+00,
        4.374664141464968e+00,
        2.938163982698783e+00,
    ];
    const D: [f64; 4] = [
        7.784695709041462e-03,
        3.224671290700398e-01,
        2.445134137142996e+00,
        3.754408661907416e+00,
    ];
    let p = p.clamp(1e-12, 1.0 - 1e-12);
    let tail = |q: f64| {
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    };
    if p < 0.02425 {
        tail((-2.0 * p.ln()).sqrt())
    } else if p > 1.0 - 0.02425 {
        -tail((-2.0 * (1.0 - p).ln()).sqrt())
    } else {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    }
}

/// The shared direction planted neurons and embeddings use: a unit vector of `d` values.
fn common_direction(seed: u64, d: usize) -> Vec<f32> {
    let mut g = Uniform::new(seed ^ 0x5eed_d1ec);
    let v: Vec<f32> = (0..d).map(|_| g.next()).collect();
    let n = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    v.into_iter().map(|x| x / n).collect()
}

/// Embedding rows are `EMBED_ALONG · u + noise` with unit-variance uniform noise per element.
const EMBED_ALONG: f32 = 0.5;

/// One tensor's values, generated on demand (a safetensors `View`).
struct SynthTensor<'a> {
    spec: &'a SynthSpec,
    plan: TensorPlan,
    shape: Vec<usize>,
    direction: &'a [f32],
}

impl SynthTensor<'_> {
    fn values(&self) -> Vec<f32> {
        let n = self.plan.rows * self.plan.cols;
        let base = self.spec.seed ^ name_hash(&self.plan.name);
        let mut out = vec![0f32; n];
        let sqrt3 = 3f32.sqrt();
        let cols = self.plan.cols;
        let router = match self.plan.fill {
            Fill::Router { popularity } => moe::router_offsets(
                self.spec.seed,
                &self.plan.name,
                self.plan.rows,
                popularity,
                cols,
            ),
            _ => Vec::new(),
        };
        out.par_chunks_mut(CHUNK)
            .enumerate()
            .for_each(|(c, chunk)| {
                let mut g = Uniform::new(base.wrapping_add(splitmix(c as u64)));
                match self.plan.fill {
                    Fill::Uniform { std } => {
                        let a = std as f32 * sqrt3;
                        chunk.iter_mut().for_each(|v| *v = a * g.next());
                    }
                    Fill::NearOne => chunk.iter_mut().for_each(|v| *v = 1.0 + 0.05 * g.next()),
                    Fill::Router { .. } => {
                        let a = sqrt3 / (cols as f32).sqrt();
                        for (k, v) in chunk.iter_mut().enumerate() {
                            let idx = c * CHUNK + k;
                            let (row, j) = (idx / cols, idx % cols);
                            *v = a * g.next() + router[row] * self.direction[j];
                        }
                    }
                    Fill::Embedding => {
                        for (k, v) in chunk.iter_mut().enumerate() {
                            let j = (c * CHUNK + k) % cols;
                            *v = sqrt3 * g.next()
                                + EMBED_ALONG * self.direction[j] * (cols as f32).sqrt();
                        }
                    }
                    Fill::Planted { exponent } => {
                        let a = sqrt3 / (cols as f32).sqrt();
                        for (k, v) in chunk.iter_mut().enumerate() {
                            let idx = c * CHUNK + k;
                            let (row, j) = (idx / cols, idx % cols);
                            *v = a * g.next()
                                + planted_offset(
                                    self.spec.seed,
                                    &self.plan.name,
                                    row,
                                    exponent,
                                    cols,
                                ) * self.direction[j];
                        }
                    }
                }
            });
        out
    }
}

/// The offset along the common direction for FFN row `row`: the frequency target of its
/// (pseudo-random) rank, turned into a margin. After RMSNorm an input is about
/// `c·u + noise` with `c = sqrt(d)·ρ/sqrt(1 + ρ²)` (ρ = EMBED_ALONG) and the row's noise
/// contributes a unit-variance term, so `P(fire) = Φ(offset·c)`.
fn planted_offset(seed: u64, name: &str, row: usize, exponent: f32, d: usize) -> f32 {
    // The neuron's place in the ranking as a fraction in [0, 1), so the profile does not depend
    // on the FFN width.
    let q = (splitmix(seed ^ name_hash(name) ^ (row as u64).wrapping_mul(0x9e37)) % 1_000_000)
        as f64
        / 1e6;
    let freq = (0.95 * (1.0 + 200.0 * q).powf(-exponent as f64)).clamp(0.005, 0.95);
    let rho = EMBED_ALONG as f64;
    let c = (d as f64).sqrt() * rho / (1.0 + rho * rho).sqrt();
    (probit(freq) / c) as f32
}

impl View for SynthTensor<'_> {
    fn dtype(&self) -> Dtype {
        match self.spec.dtype {
            SynthDtype::F16 => Dtype::F16,
            SynthDtype::Bf16 => Dtype::BF16,
        }
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        let v = self.values();
        let bytes = match self.spec.dtype {
            SynthDtype::F16 => {
                let mut h = vec![f16::ZERO; v.len()];
                h.par_chunks_mut(CHUNK)
                    .zip(v.par_chunks(CHUNK))
                    .for_each(|(h, v)| h.convert_from_f32_slice(v));
                bytemuck::cast_slice(&h).to_vec()
            }
            SynthDtype::Bf16 => {
                let mut h = vec![bf16::ZERO; v.len()];
                h.par_chunks_mut(CHUNK)
                    .zip(v.par_chunks(CHUNK))
                    .for_each(|(h, v)| h.convert_from_f32_slice(v));
                bytemuck::cast_slice(&h).to_vec()
            }
        };
        Cow::Owned(bytes)
    }

    fn data_len(&self) -> usize {
        self.plan.rows * self.plan.cols * 2
    }
}

/// The host's memory (`MemTotal` of /proc/meminfo), where known.
fn host_memory_bytes() -> Option<u64> {
    let text = fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib.saturating_mul(1024))
}

fn io(path: &Path, e: std::io::Error) -> ModelError {
    ModelError::io(path, e)
}

/// Write the model into directory `out` (created; must not exist unless `force`).
/// `progress(bytes_done, bytes_total)`.
pub fn synthesize(
    spec: &SynthSpec,
    out: &Path,
    force: bool,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<(), ModelError> {
    spec.validate().map_err(|msg| ModelError::Config {
        path: out.to_path_buf(),
        msg,
    })?;
    if spec.moe.is_some() {
        return Err(ModelError::Config {
            path: out.to_path_buf(),
            msg: "mixture-of-experts shapes are written as GGUF (--format gguf, or -o NAME.gguf)"
                .into(),
        });
    }
    if out.exists() && !force {
        return Err(ModelError::Config {
            path: out.to_path_buf(),
            msg: "already exists (pass --force to replace it)".into(),
        });
    }
    let parent = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    fs::create_dir_all(parent).map_err(|e| io(parent, e))?;
    let tmp: PathBuf = parent.join(format!(
        ".{}.synth.{}",
        out.file_name()
            .map_or("model".into(), |n| n.to_string_lossy()),
        std::process::id()
    ));
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(|e| io(&tmp, e))?;
    }
    fs::create_dir(&tmp).map_err(|e| io(&tmp, e))?;
    let result = write_model(spec, &tmp, progress).and_then(|()| {
        if out.exists() {
            fs::remove_dir_all(out).map_err(|e| io(out, e))?;
        }
        fs::rename(&tmp, out).map_err(|e| io(out, e))
    });
    if result.is_err() {
        fs::remove_dir_all(&tmp).ok();
    }
    result
}

fn write_model(
    spec: &SynthSpec,
    dir: &Path,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<(), ModelError> {
    let direction = common_direction(spec.seed, spec.d_model);
    let plans = spec.tensors();
    let total: u64 = plans.iter().map(|p| (p.rows * p.cols * 2) as u64).sum();
    // Greedy sharding in declaration order.
    let mut shards: Vec<Vec<TensorPlan>> = vec![Vec::new()];
    let mut in_shard = 0u64;
    for p in plans {
        let b = (p.rows * p.cols * 2) as u64;
        if in_shard > 0 && in_shard + b > spec.shard_bytes {
            shards.push(Vec::new());
            in_shard = 0;
        }
        in_shard += b;
        shards.last_mut().expect("one shard").push(p);
    }
    let n_shards = shards.len();
    let mut weight_map = BTreeMap::new();
    let mut done = 0u64;
    for (i, shard) in shards.into_iter().enumerate() {
        let file = if n_shards == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{n_shards:05}.safetensors", i + 1)
        };
        let bytes: u64 = shard.iter().map(|p| (p.rows * p.cols * 2) as u64).sum();
        let views: Vec<(String, SynthTensor)> = shard
            .into_iter()
            .map(|plan| {
                weight_map.insert(plan.name.clone(), file.clone());
                let shape = if plan.rows == 1 {
                    vec![plan.cols]
                } else {
                    vec![plan.rows, plan.cols]
                };
                (
                    plan.name.clone(),
                    SynthTensor {
                        spec,
                        plan,
                        shape,
                        direction: &direction,
                    },
                )
            })
            .collect();
        let path = dir.join(&file);
        safetensors::tensor::serialize_to_file(views, None, &path).map_err(|e| {
            ModelError::Format {
                path: path.clone(),
                msg: format!("cannot write safetensors: {e}"),
            }
        })?;
        fs::File::open(&path)
            .and_then(|f| f.sync_all())
            .map_err(|e| io(&path, e))?;
        done += bytes;
        progress(done, total);
    }
    if n_shards > 1 {
        let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        let p = dir.join("model.safetensors.index.json");
        crate::fsutil::write_atomic(&p, index.to_string().as_bytes()).map_err(|e| io(&p, e))?;
    }
    let p = dir.join("config.json");
    let text =
        serde_json::to_string_pretty(&spec.config_json()).map_err(|e| ModelError::Format {
            path: p.clone(),
            msg: e.to_string(),
        })?;
    crate::fsutil::write_atomic(&p, text.as_bytes()).map_err(|e| io(&p, e))?;
    Ok(())
}

/// llama.cpp's name for an HF llama tensor (`None` for the rest).
fn gguf_name(hf: &str) -> Option<String> {
    Some(match hf {
        "model.embed_tokens.weight" => "token_embd.weight".into(),
        "model.norm.weight" => "output_norm.weight".into(),
        "lm_head.weight" => "output.weight".into(),
        _ => {
            let rest = hf.strip_prefix("model.layers.")?;
            let (layer, what) = rest.split_once('.')?;
            let what = match what {
                "input_layernorm.weight" => "attn_norm.weight",
                "post_attention_layernorm.weight" => "ffn_norm.weight",
                "self_attn.q_proj.weight" => "attn_q.weight",
                "self_attn.k_proj.weight" => "attn_k.weight",
                "self_attn.v_proj.weight" => "attn_v.weight",
                "self_attn.o_proj.weight" => "attn_output.weight",
                "self_attn.q_norm.weight" => "attn_q_norm.weight",
                "self_attn.k_norm.weight" => "attn_k_norm.weight",
                "mlp.gate.weight" => "ffn_gate_inp.weight",
                "mlp.experts.gate_proj.weight" => "ffn_gate_exps.weight",
                "mlp.experts.up_proj.weight" => "ffn_up_exps.weight",
                "mlp.experts.down_proj.weight" => "ffn_down_exps.weight",
                "mlp.gate_proj.weight" => "ffn_gate.weight",
                "mlp.up_proj.weight" => "ffn_up.weight",
                "mlp.down_proj.weight" => "ffn_down.weight",
                _ => return None,
            };
            format!("blk.{layer}.{what}")
        }
    })
}

/// Rows of a Q or K projection reordered from HF's RoPE layout (a head's two halves rotate
/// together) to GGUF llama's (adjacent pairs rotate together), as llama.cpp's converter does:
/// row `i·2 + j` of a head takes HF row `j·hd/2 + i`.
fn rope_pairs_adjacent(values: &[f32], heads: usize, cols: usize) -> Vec<f32> {
    let rows = values.len() / cols;
    let hd = rows / heads;
    let mut out = vec![0f32; values.len()];
    for h in 0..heads {
        for i in 0..hd / 2 {
            for j in 0..2 {
                let (to, from) = (h * hd + i * 2 + j, h * hd + j * hd / 2 + i);
                out[to * cols..(to + 1) * cols]
                    .copy_from_slice(&values[from * cols..(from + 1) * cols]);
            }
        }
    }
    out
}

/// Write the model as one llama GGUF file `out` (what llama.cpp loads): the same values as the
/// HF directory [`synthesize`] writes (matrices in f16/bf16, norms in f32, Q/K rows in llama.cpp's
/// RoPE order), with a byte-fallback vocabulary of placeholder tokens. LLaMA SwiGLU shapes only.
/// With `quant`, the matrices are those f16/bf16 values quantized by llama.cpp's reference
/// quantizers in the mix's formats: what `llama-quantize` makes of the f16 file.
pub fn synthesize_gguf(
    spec: &SynthSpec,
    out: &Path,
    force: bool,
    quant: Option<super::quant_mix::QuantMix>,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<(), ModelError> {
    use super::gguf::{MetaValue as M, TensorSpec, write_streamed};
    let bad = |msg: String| ModelError::Config {
        path: out.to_path_buf(),
        msg,
    };
    spec.validate().map_err(bad)?;
    // llama.cpp's architecture: `llama` (Mixtral's experts too) or `qwen3moe`.
    let arch = spec.moe.as_ref().map_or("llama", SynthMoe::arch);
    let experts = spec.moe.as_ref().map_or(0, |m| m.experts);
    if spec.arch != Arch::Llama || spec.activation != "silu" {
        return Err(bad(
            "GGUF output is for LLaMA shapes with SwiGLU (llama.cpp's llama architecture)".into(),
        ));
    }
    if out.exists() && !force {
        return Err(bad("already exists (pass --force to replace it)".into()));
    }
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        fs::create_dir_all(parent).map_err(|e| io(parent, e))?;
    }
    let float = match spec.dtype {
        SynthDtype::F16 => crate::tensor::DType::F16,
        SynthDtype::Bf16 => crate::tensor::DType::BF16,
    };
    let file_type = match quant {
        Some(q) => q.file_type(),
        None => super::quant_mix::QuantMix::Pure(float).file_type(),
    };
    let owned = gguf_metadata(spec, arch, file_type).map_err(bad)?;
    let metadata: Vec<(&str, M)> = owned.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    let plans: Vec<TensorPlan> = spec.tensors();
    // Each tensor's format: f32 vectors, matrices in the float type or the mix's format.
    let mut formats = Vec::with_capacity(plans.len());
    let specs: Vec<TensorSpec> = plans
        .iter()
        .map(|p| {
            let name =
                gguf_name(&p.name).ok_or_else(|| bad(format!("no GGUF name for {}", p.name)))?;
            let vector = p.rows == 1;
            // Vectors and the router in f32 (llama.cpp's converter keeps them so, and its
            // quantizer never touches a router).
            let router = name.contains("ffn_gate_inp");
            let dtype = match (vector || router, quant) {
                (true, _) => crate::tensor::DType::F32,
                (false, Some(q)) => q
                    .format(&name, p.cols, spec.n_layers, experts)
                    .unwrap_or(crate::tensor::DType::F32),
                (false, None) => float,
            };
            formats.push(dtype);
            let dims = if vector {
                vec![p.cols as u64]
            } else if name.ends_with("_exps.weight") {
                // Expert-major 3-D: (cols, rows of one expert, experts).
                vec![p.cols as u64, (p.rows / experts) as u64, experts as u64]
            } else {
                vec![p.cols as u64, p.rows as u64]
            };
            Ok(TensorSpec {
                name,
                dims,
                ggml_type: super::ggml::GgmlType::of_dtype(dtype).1,
                bytes: (p.rows * dtype.bytes_for(p.cols)) as u64,
            })
        })
        .collect::<Result<_, ModelError>>()?;
    let total: u64 = specs.iter().map(|t| t.bytes).sum();
    let direction = common_direction(spec.seed, spec.d_model);
    let mut done = 0u64;
    write_streamed(out, &metadata, &specs, &mut |i| {
        let plan = plans[i].clone();
        let name = plan.name.clone();
        let (rows, cols) = (plan.rows, plan.cols);
        let t = SynthTensor {
            spec,
            shape: vec![rows, cols],
            plan,
            direction: &direction,
        };
        let mut v = t.values();
        // llama's converter permutes Q/K rows to its pairwise RoPE; qwen3moe rotates halves.
        if arch == "llama" && name.ends_with("q_proj.weight") {
            v = rope_pairs_adjacent(&v, spec.n_heads, cols);
        } else if arch == "llama" && name.ends_with("k_proj.weight") {
            v = rope_pairs_adjacent(&v, spec.n_kv_heads, cols);
        }
        // The model's numbers are its f16/bf16 values (what the HF directory holds); vectors are
        // those as f32, matrices those in their format.
        v.par_iter_mut().for_each(|x| {
            *x = match spec.dtype {
                SynthDtype::F16 => f16::from_f32(*x).to_f32(),
                SynthDtype::Bf16 => bf16::from_f32(*x).to_f32(),
            }
        });
        let dtype = formats[i];
        let rb = dtype.bytes_for(cols);
        let mut bytes = vec![0u8; rows * rb];
        bytes
            .par_chunks_mut(rb)
            .zip(v.par_chunks(cols))
            .for_each(|(o, x)| crate::tensor::quantize_row(dtype, x, o));
        done += bytes.len() as u64;
        progress(done, total);
        Ok(bytes)
    })
    .map_err(|e| io(out, e))
}

/// A synthetic model's GGUF metadata: llama.cpp's keys for `arch`, and a byte-fallback
/// vocabulary of placeholder tokens.
fn gguf_metadata(
    spec: &SynthSpec,
    arch: &str,
    file_type: u32,
) -> Result<Vec<(String, super::gguf::MetaValue)>, String> {
    use super::gguf::MetaValue as M;
    // Placeholder vocabulary: unknown, BOS, EOS, the 256 byte tokens, then `▁t{i}`.
    let mut tokens: Vec<M> = ["<unk>", "<s>", "</s>"]
        .iter()
        .map(|t| M::String(t.to_string()))
        .collect();
    let mut types: Vec<M> = vec![M::I32(2), M::I32(3), M::I32(3)];
    for b in 0..256 {
        tokens.push(M::String(format!("<0x{b:02X}>")));
        types.push(M::I32(6));
    }
    if spec.vocab_size < tokens.len() {
        return Err(format!(
            "a GGUF vocabulary needs at least {} tokens (the byte tokens)",
            tokens.len()
        ));
    }
    for i in tokens.len()..spec.vocab_size {
        tokens.push(M::String(format!("\u{2581}t{i}")));
        types.push(M::I32(1));
    }
    let n = spec.vocab_size;
    let hd = spec.head_dim();
    let mut arch_keys: Vec<(&str, M)> = vec![
        ("context_length", M::U32(spec.max_context as u32)),
        ("embedding_length", M::U32(spec.d_model as u32)),
        ("block_count", M::U32(spec.n_layers as u32)),
        ("feed_forward_length", M::U32(spec.d_ff as u32)),
        ("attention.head_count", M::U32(spec.n_heads as u32)),
        ("attention.head_count_kv", M::U32(spec.n_kv_heads as u32)),
        ("attention.layer_norm_rms_epsilon", M::F32(1e-5)),
    ];
    match &spec.moe {
        None => arch_keys.push(("rope.freq_base", M::F32(10000.0))),
        Some(m) => arch_keys.extend([
            // Qwen3-MoE and Mixtral both rotate with base 1e6.
            ("rope.freq_base", M::F32(1e6)),
            ("attention.key_length", M::U32(hd as u32)),
            ("attention.value_length", M::U32(hd as u32)),
            ("rope.dimension_count", M::U32(hd as u32)),
            ("expert_count", M::U32(m.experts as u32)),
            ("expert_used_count", M::U32(m.used as u32)),
            ("expert_feed_forward_length", M::U32(m.d_expert as u32)),
        ]),
    }
    let arch_keys: Vec<(String, M)> = arch_keys
        .into_iter()
        .map(|(k, v)| (format!("{arch}.{k}"), v))
        .collect();
    let name = match &spec.moe {
        Some(m) => format!(
            "gpu-offload synth seed {} (planted expert popularity {})",
            spec.seed, m.popularity
        ),
        None => format!("gpu-offload synth seed {}", spec.seed),
    };
    let mut metadata: Vec<(String, M)> = vec![
        ("general.architecture".into(), M::String(arch.into())),
        ("general.name".into(), M::String(name)),
        ("general.file_type".into(), M::U32(file_type)),
    ];
    metadata.extend(arch_keys);
    metadata.extend(
        [
            ("tokenizer.ggml.model", M::String("llama".into())),
            ("tokenizer.ggml.tokens", M::Array(tokens)),
            ("tokenizer.ggml.scores", M::Array(vec![M::F32(0.0); n])),
            ("tokenizer.ggml.token_type", M::Array(types)),
            ("tokenizer.ggml.bos_token_id", M::U32(1)),
            ("tokenizer.ggml.eos_token_id", M::U32(2)),
            ("tokenizer.ggml.unknown_token_id", M::U32(0)),
        ]
        .map(|(k, v)| (k.to_string(), v)),
    );
    Ok(metadata)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The GGUF a synth writes is the model of the HF directory it writes: the same logits
    /// (its Q/K rows in llama.cpp's RoPE order, the loader rotating adjacent pairs).
    #[test]
    fn the_gguf_is_the_same_model_as_the_hf_directory() {
        use crate::backend::cpu::CpuBackend;
        use crate::engine::{Engine, Logits};
        let spec = SynthSpec {
            vocab_size: 300,
            ..SynthSpec::preset("tiny").unwrap()
        };
        let dir = tempfile::tempdir().unwrap();
        synthesize(&spec, &dir.path().join("hf"), false, &mut |_, _| {}).unwrap();
        let gguf = dir.path().join("m.gguf");
        synthesize_gguf(&spec, &gguf, false, None, &mut |_, _| {}).unwrap();
        assert!(synthesize_gguf(&spec, &gguf, false, None, &mut |_, _| {}).is_err());
        let run = |p: &Path| {
            let m = crate::model::Model::load(p).unwrap();
            let e = Engine::new(CpuBackend::new(1).unwrap(), m.spec.clone(), &m.weights).unwrap();
            let mut s = e.new_session(8).unwrap();
            (
                e.forward(&mut s, &[1, 5, 77, 260, 3, 9], Logits::All)
                    .unwrap(),
                m.tokenizer.is_some(),
            )
        };
        let (a, _) = run(&dir.path().join("hf"));
        let (b, has_tokenizer) = run(&gguf);
        assert!(has_tokenizer, "the GGUF carries a vocabulary");
        let scale = a.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = a
            .iter()
            .zip(&b)
            .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(
            diff <= 1e-4 * scale,
            "logits differ by {diff} (scale {scale})"
        );
        let relu = SynthSpec {
            activation: "relu".into(),
            ..spec
        };
        assert!(
            synthesize_gguf(
                &relu,
                &dir.path().join("r.gguf"),
                false,
                None,
                &mut |_, _| {}
            )
            .is_err()
        );
    }

    #[test]
    fn probit_inverts_known_quantiles() {
        assert!(probit(0.5).abs() < 1e-9);
        assert!((probit(0.975) - 1.959964).abs() < 1e-5);
        assert!((probit(0.01) + 2.326348).abs() < 1e-5);
    }

    #[test]
    fn same_seed_same_bytes_other_seed_other_bytes() {
        let spec = SynthSpec::preset("tiny").unwrap();
        let dir = tempfile::tempdir().unwrap();
        synthesize(&spec, &dir.path().join("a"), false, &mut |_, _| {}).unwrap();
        synthesize(&spec, &dir.path().join("b"), false, &mut |_, _| {}).unwrap();
        let other = SynthSpec { seed: 7, ..spec };
        synthesize(&other, &dir.path().join("c"), false, &mut |_, _| {}).unwrap();
        let read = |n: &str| fs::read(dir.path().join(n).join("model.safetensors")).unwrap();
        assert_eq!(read("a"), read("b"));
        assert_ne!(read("a"), read("c"));
        let m = crate::model::Model::load(&dir.path().join("a")).unwrap();
        assert_eq!(m.spec.n_layers, 2);
        assert!(synthesize(&other, &dir.path().join("c"), false, &mut |_, _| {}).is_err());
    }

    #[test]
    fn planted_neurons_follow_a_power_law() {
        // Layer 0's gate sees RMSNorm(embedding) (norm scales ≈ 1): measure firing frequencies.
        let spec = SynthSpec {
            d_model: 256,
            d_ff: 1024,
            vocab_size: 512,
            power_law: Some(0.8),
            activation: "relu".into(),
            ..SynthSpec::preset("tiny").unwrap()
        };
        let direction = common_direction(spec.seed, spec.d_model);
        let plans = spec.tensors();
        let find = |suffix: &str| {
            let p = plans
                .iter()
                .find(|p| p.name.ends_with(suffix))
                .unwrap()
                .clone();
            let shape = vec![p.rows, p.cols];
            SynthTensor {
                spec: &spec,
                plan: p,
                shape,
                direction: &direction,
            }
            .values()
        };
        let emb = find("embed_tokens.weight");
        let gate = find("layers.0.mlp.gate_proj.weight");
        let (d, ff) = (spec.d_model, spec.d_ff);
        let mut fires = vec![0usize; ff];
        for t in 0..spec.vocab_size {
            let x = &emb[t * d..(t + 1) * d];
            let rms = (x.iter().map(|v| v * v).sum::<f32>() / d as f32).sqrt();
            for (i, f) in fires.iter_mut().enumerate() {
                let dot: f32 = gate[i * d..(i + 1) * d]
                    .iter()
                    .zip(x)
                    .map(|(w, v)| w * v / rms)
                    .sum();
                *f += (dot > 0.0) as usize;
            }
        }
        let mut freq: Vec<f64> = fires
            .iter()
            .map(|&f| f as f64 / spec.vocab_size as f64)
            .collect();
        freq.sort_by(|a, b| b.total_cmp(a));
        let top: f64 = freq[..ff / 10].iter().sum::<f64>() / (ff / 10) as f64;
        let bottom: f64 = freq[ff / 2..].iter().sum::<f64>() / (ff / 2) as f64;
        let total: f64 = freq.iter().sum();
        let top20: f64 = freq[..ff / 5].iter().sum();
        assert!(
            top > 0.1 && top > 5.0 * bottom,
            "hot {top} vs cold {bottom}"
        );
        assert!(
            top20 / total > 0.5,
            "20% of neurons carry most activations: {}",
            top20 / total
        );
    }
}
