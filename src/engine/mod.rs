//! A forward pass, written once against [`Backend`]: the model's weights placed on the device,
//! sessions holding a KV cache, batched prefill and single-token decode, sampling, generation.
//! Knows nothing about HTTP or files.

pub mod generate;
pub mod perplexity;
pub mod sampler;

use serde::Serialize;
use thiserror::Error;

use crate::backend::{Act, AttnShape, Backend, BackendError, RopePairs};
use crate::model::{
    Activation, Arch, LayerWeights, Linear, ModelSpec, ModelWeights, NormKind, NormWeights,
    PositionEncoding, RopeStyle,
};
use crate::tensor::HostTensor;

pub use generate::{GenerateParams, Generation, StopReason, Timings, generate};
pub use sampler::{Sampler, SamplerParams};

#[derive(Debug, Error)]
pub enum EngineError {
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error("{needed} tokens do not fit in the context of {ctx} tokens")]
    ContextFull { needed: usize, ctx: usize },
    #[error("token id {id} is outside the vocabulary of {vocab} tokens")]
    InvalidToken { id: u32, vocab: usize },
    #[error("nothing to evaluate: no tokens given")]
    Empty,
    #[error("context size {requested} exceeds the model's maximum of {max} positions")]
    ContextTooLarge { requested: usize, max: usize },
}

pub type Result<T> = std::result::Result<T, EngineError>;

/// Tokens evaluated per forward step during prefill; bounds scratch memory for long prompts.
pub const MAX_BATCH: usize = 512;

struct DeviceNorm<B: Backend> {
    weight: B::Weight,
    bias: Option<B::Weight>,
}

struct DeviceLinear<B: Backend> {
    weight: B::Weight,
    bias: Option<B::Weight>,
}

struct DeviceLayer<B: Backend> {
    attn_norm: DeviceNorm<B>,
    wq: DeviceLinear<B>,
    wk: DeviceLinear<B>,
    wv: DeviceLinear<B>,
    wo: DeviceLinear<B>,
    ffn_norm: DeviceNorm<B>,
    w_gate: Option<DeviceLinear<B>>,
    w_up: DeviceLinear<B>,
    w_down: DeviceLinear<B>,
}

/// A model's weights resident on one backend, ready to run.
pub struct Engine<B: Backend> {
    backend: B,
    spec: ModelSpec,
    token_embd: B::Weight,
    pos_embd: Option<B::Weight>,
    layers: Vec<DeviceLayer<B>>,
    output_norm: DeviceNorm<B>,
    /// `None` when tied to `token_embd`.
    output: Option<B::Weight>,
    rope: Option<(B::Weight, RopePairs, usize)>,
    act: Act,
}

/// Which positions' logits a forward step returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Only the last token's (generation).
    Last,
    /// Every token's (scoring, perplexity).
    All,
    /// None (prefill of a prefix whose next token is already known).
    None,
}

/// One sequence's state on the device: its KV cache and how far it has been filled.
pub struct Session<B: Backend> {
    k: Vec<B::Tensor>,
    v: Vec<B::Tensor>,
    pos: usize,
    ctx: usize,
    scratch: Option<Scratch<B>>,
}

impl<B: Backend> Session<B> {
    /// Tokens evaluated so far.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Positions this session can hold.
    pub fn context_size(&self) -> usize {
        self.ctx
    }

    /// Forget everything after the first `pos` tokens (their cache rows are overwritten later).
    pub fn truncate(&mut self, pos: usize) {
        self.pos = self.pos.min(pos);
    }
}

/// Activation buffers for one forward step of `n` tokens.
struct Scratch<B: Backend> {
    n: usize,
    x: B::Tensor,
    h: B::Tensor,
    q: B::Tensor,
    k: B::Tensor,
    v: B::Tensor,
    attn: B::Tensor,
    proj: B::Tensor,
    up: B::Tensor,
    gate: Option<B::Tensor>,
}

impl<B: Backend> Engine<B> {
    /// Place `weights` on `backend`.
    pub fn new(backend: B, spec: ModelSpec, weights: &ModelWeights) -> Result<Self> {
        let up = |t: &HostTensor| backend.upload(t);
        let norm = |n: &NormWeights| -> Result<DeviceNorm<B>> {
            Ok(DeviceNorm {
                weight: up(&n.weight)?,
                bias: n.bias.as_ref().map(up).transpose()?,
            })
        };
        let linear = |l: &Linear| -> Result<DeviceLinear<B>> {
            Ok(DeviceLinear {
                weight: up(&l.weight)?,
                bias: l.bias.as_ref().map(up).transpose()?,
            })
        };
        let layer = |l: &LayerWeights| -> Result<DeviceLayer<B>> {
            Ok(DeviceLayer {
                attn_norm: norm(&l.attn_norm)?,
                wq: linear(&l.wq)?,
                wk: linear(&l.wk)?,
                wv: linear(&l.wv)?,
                wo: linear(&l.wo)?,
                ffn_norm: norm(&l.ffn_norm)?,
                w_gate: l.w_gate.as_ref().map(linear).transpose()?,
                w_up: linear(&l.w_up)?,
                w_down: linear(&l.w_down)?,
            })
        };
        let layers = weights
            .layers
            .iter()
            .map(layer)
            .collect::<Result<Vec<_>>>()?;
        let rope = match &spec.position {
            PositionEncoding::Rope(r) => {
                let inv = r.inv_freqs(weights.rope_freq_factors.as_deref());
                let pairs = match r.style {
                    RopeStyle::Adjacent => RopePairs::Adjacent,
                    RopeStyle::Halves => RopePairs::Halves,
                };
                let t = HostTensor::from_f32("rope.inv_freq", 1, inv.len(), inv);
                Some((up(&t)?, pairs, r.dims))
            }
            PositionEncoding::Learned { .. } => None,
        };
        let act = match spec.activation {
            Activation::Silu => Act::Silu,
            Activation::Relu => Act::Relu,
            Activation::Gelu => Act::Gelu,
            Activation::GeluTanh => Act::GeluTanh,
        };
        Ok(Engine {
            token_embd: up(&weights.token_embd)?,
            pos_embd: weights.pos_embd.as_ref().map(up).transpose()?,
            layers,
            output_norm: norm(&weights.output_norm)?,
            output: weights.output.as_ref().map(up).transpose()?,
            rope,
            act,
            spec,
            backend,
        })
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// A fresh session holding up to `ctx` positions.
    pub fn new_session(&self, ctx: usize) -> Result<Session<B>> {
        if ctx > self.spec.max_context {
            return Err(EngineError::ContextTooLarge {
                requested: ctx,
                max: self.spec.max_context,
            });
        }
        let kv = self.spec.kv_dim();
        let mut k = Vec::with_capacity(self.spec.n_layers);
        let mut v = Vec::with_capacity(self.spec.n_layers);
        for _ in 0..self.spec.n_layers {
            k.push(self.backend.alloc(ctx, kv)?);
            v.push(self.backend.alloc(ctx, kv)?);
        }
        Ok(Session {
            k,
            v,
            pos: 0,
            ctx,
            scratch: None,
        })
    }

    /// Evaluate `tokens` after what the session holds; returns logits (`vocab` values per
    /// returned position, row-major).
    pub fn forward(
        &self,
        session: &mut Session<B>,
        tokens: &[u32],
        logits: Logits,
    ) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            return Err(EngineError::Empty);
        }
        let needed = session.pos + tokens.len();
        if needed > session.ctx {
            return Err(EngineError::ContextFull {
                needed,
                ctx: session.ctx,
            });
        }
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= self.spec.vocab_size) {
            return Err(EngineError::InvalidToken {
                id,
                vocab: self.spec.vocab_size,
            });
        }
        self.backend.enter(|| {
            let mut out = Vec::new();
            let n_batches = tokens.len().div_ceil(MAX_BATCH);
            for (i, batch) in tokens.chunks(MAX_BATCH).enumerate() {
                let mode = match logits {
                    Logits::All => Logits::All,
                    Logits::Last if i + 1 == n_batches => Logits::Last,
                    _ => Logits::None,
                };
                out.extend(self.step(session, batch, mode)?);
            }
            Ok(out)
        })
    }

    fn scratch(&self, n: usize) -> Result<Scratch<B>> {
        let s = &self.spec;
        let b = &self.backend;
        Ok(Scratch {
            n,
            x: b.alloc(n, s.d_model)?,
            h: b.alloc(n, s.d_model)?,
            q: b.alloc(n, s.q_dim())?,
            k: b.alloc(n, s.kv_dim())?,
            v: b.alloc(n, s.kv_dim())?,
            attn: b.alloc(n, s.q_dim())?,
            proj: b.alloc(n, s.d_model)?,
            up: b.alloc(n, s.d_ff)?,
            gate: if s.gated_ffn {
                Some(b.alloc(n, s.d_ff)?)
            } else {
                None
            },
        })
    }

    fn norm(&self, x: &B::Tensor, n: &DeviceNorm<B>, out: &mut B::Tensor) -> Result<()> {
        let eps = self.spec.norm_eps;
        match (self.spec.norm, &n.bias) {
            (NormKind::Rms, _) => self.backend.rms_norm(x, &n.weight, eps, out)?,
            (NormKind::Layer, Some(b)) => self.backend.layer_norm(x, &n.weight, b, eps, out)?,
            (NormKind::Layer, None) => {
                return Err(BackendError::Shape {
                    op: "layer_norm",
                    msg: "LayerNorm without a bias".into(),
                }
                .into());
            }
        }
        Ok(())
    }

    fn linear(&self, l: &DeviceLinear<B>, x: &B::Tensor, out: &mut B::Tensor) -> Result<()> {
        self.backend.matmul(&l.weight, x, out)?;
        if let Some(b) = &l.bias {
            self.backend.add_bias(out, b)?;
        }
        Ok(())
    }

    /// One forward step over at most [`MAX_BATCH`] tokens.
    fn step(&self, session: &mut Session<B>, tokens: &[u32], logits: Logits) -> Result<Vec<f32>> {
        let n = tokens.len();
        let b = &self.backend;
        let spec = &self.spec;
        let pos = session.pos;
        let mut sc = match session.scratch.take() {
            Some(sc) if sc.n == n => sc,
            _ => self.scratch(n)?,
        };

        b.embed(&self.token_embd, tokens, &mut sc.x)?;
        if let (Some(table), PositionEncoding::Learned { offset }) =
            (&self.pos_embd, &spec.position)
        {
            b.add_table_rows(&mut sc.x, table, pos + offset)?;
        }
        let attn_shape = AttnShape {
            n_heads: spec.n_heads,
            n_kv_heads: spec.n_kv_heads,
            head_dim: spec.head_dim,
            scale: spec.attn_scale,
        };
        for (l, layer) in self.layers.iter().enumerate() {
            // Attention block.
            self.norm(&sc.x, &layer.attn_norm, &mut sc.h)?;
            self.linear(&layer.wq, &sc.h, &mut sc.q)?;
            self.linear(&layer.wk, &sc.h, &mut sc.k)?;
            self.linear(&layer.wv, &sc.h, &mut sc.v)?;
            if let Some((inv_freq, pairs, dims)) = &self.rope {
                b.rope(&mut sc.q, spec.head_dim, *dims, *pairs, inv_freq, pos)?;
                b.rope(&mut sc.k, spec.head_dim, *dims, *pairs, inv_freq, pos)?;
            }
            b.copy_rows(&sc.k, 0, &mut session.k[l], pos, n)?;
            b.copy_rows(&sc.v, 0, &mut session.v[l], pos, n)?;
            b.attention(
                &sc.q,
                &session.k[l],
                &session.v[l],
                pos,
                attn_shape,
                &mut sc.attn,
            )?;
            self.linear(&layer.wo, &sc.attn, &mut sc.proj)?;
            b.add(&mut sc.x, &sc.proj)?;

            // Feed-forward block.
            self.norm(&sc.x, &layer.ffn_norm, &mut sc.h)?;
            self.linear(&layer.w_up, &sc.h, &mut sc.up)?;
            let hidden = match (&layer.w_gate, &mut sc.gate) {
                (Some(wg), Some(gate)) => {
                    self.linear(wg, &sc.h, gate)?;
                    b.gated(gate, &sc.up, self.act)?;
                    &*gate
                }
                _ => {
                    b.activate(&mut sc.up, self.act)?;
                    &sc.up
                }
            };
            self.linear(&layer.w_down, hidden, &mut sc.proj)?;
            b.add(&mut sc.x, &sc.proj)?;
        }
        session.pos += n;

        let rows = match logits {
            Logits::None => {
                session.scratch = Some(sc);
                return Ok(Vec::new());
            }
            Logits::Last => 1,
            Logits::All => n,
        };
        let mut last = b.alloc(rows, spec.d_model)?;
        b.copy_rows(&sc.x, n - rows, &mut last, 0, rows)?;
        let mut normed = b.alloc(rows, spec.d_model)?;
        self.norm(&last, &self.output_norm, &mut normed)?;
        let out_w = self.output.as_ref().unwrap_or(&self.token_embd);
        let mut logits_t = b.alloc(rows, spec.vocab_size)?;
        b.matmul(out_w, &normed, &mut logits_t)?;
        let mut host = vec![0f32; rows * spec.vocab_size];
        b.read(&logits_t, &mut host)?;
        session.scratch = Some(sc);
        Ok(host)
    }

    /// Which architecture family this engine runs.
    pub fn arch(&self) -> Arch {
        self.spec.arch
    }
}

/// What one decode step must read from memory: every weight once (one embedding row when the
/// table is not also the output matrix; one position row) and the f32 KV cache so far. The
/// numerator of the memory-bandwidth bound on decode speed.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct DecodeTraffic {
    pub weight_bytes: u64,
    /// K and V bytes read per cached position, over all layers.
    pub kv_bytes_per_position: u64,
}

impl DecodeTraffic {
    pub fn of(spec: &ModelSpec, weights: &ModelWeights) -> Self {
        // Tables read one row per token: the embedding (unless it is also the output matrix)
        // and learned positions.
        let row_table = |t: &HostTensor| {
            (std::ptr::eq(t, &weights.token_embd) && !spec.tied_output)
                || weights
                    .pos_embd
                    .as_ref()
                    .is_some_and(|p| std::ptr::eq(t, p))
        };
        let mut weight_bytes: u64 = weights
            .tensors()
            .into_iter()
            .filter(|t| !row_table(t))
            .map(|t| t.data.len() as u64)
            .sum();
        if !spec.tied_output {
            weight_bytes += weights.token_embd.row_bytes() as u64;
        }
        if let Some(p) = &weights.pos_embd {
            weight_bytes += p.row_bytes() as u64;
        }
        DecodeTraffic {
            weight_bytes,
            kv_bytes_per_position: 2 * spec.n_layers as u64 * spec.kv_dim() as u64 * 4,
        }
    }

    /// Bytes read by the step that evaluates position `pos` (it attends to `pos + 1` rows).
    pub fn at(&self, pos: usize) -> u64 {
        self.weight_bytes + self.kv_bytes_per_position * (pos as u64 + 1)
    }

    /// Mean over the decode steps at positions `first..first + steps`.
    pub fn mean(&self, first: usize, steps: usize) -> f64 {
        if steps == 0 {
            return self.at(first) as f64;
        }
        let mid = first as f64 + (steps as f64 - 1.0) / 2.0;
        self.weight_bytes as f64 + self.kv_bytes_per_position as f64 * (mid + 1.0)
    }
}
