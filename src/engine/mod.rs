//! A forward pass, written once against [`Backend`]: sessions holding a KV cache, batched
//! prefill and single-token decode, sampling, generation. Where each weight lives is a
//! [`WeightSource`]'s business: all resident ([`resident::ResidentWeights`]) or streamed through
//! the tiers (`tier`); the pass asks it for one layer at a time. Knows nothing about HTTP or files.

pub mod generate;
pub mod perplexity;
pub mod resident;
pub mod sampler;
mod traffic;

use std::sync::{Arc, Mutex};

use thiserror::Error;

use crate::backend::{
    Act, AttnSeq, AttnShape, Backend, BackendError, BundleShape, HostStage, KV_BLOCK, KvType,
    Landing, MatmulPart, ProductInput, Rope, RopePairs, kv_runs,
};
use crate::footprint::step::{PROBE_LAYERS, activation_shapes, logit_shapes};
use crate::footprint::{
    MAX_BATCH, MatmulShapes, PROBE_QUERIES, PrefillLayout, StepMemory, step_memory,
    whole_device_group,
};
use crate::model::{
    Activation, Arch, ModelSpec, ModelWeights, NormKind, PositionEncoding, RopeStyle,
};
use crate::tensor::HostTensor;

pub use generate::{GenerateParams, Generation, StopReason, Timings, generate};
pub use resident::ResidentWeights;
pub use sampler::{Penalties, Sampled, Sampler, SamplerParams};
pub use traffic::DecodeTraffic;

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
    #[error("weights: {0}")]
    Weights(String),
    #[error(
        "the KV pool is full: {needed} more blocks of {KV_BLOCK} positions needed, {free} free of {total}"
    )]
    KvPoolFull {
        needed: usize,
        free: usize,
        total: usize,
    },
}

pub type Result<T> = std::result::Result<T, EngineError>;

/// Told when a layer has run over a group of rows (`first..first + rows` of the call), while
/// every buffer of that step is still held: what the budgeted device's per-step peak is
/// measured by.
pub trait StepTap: Send + Sync {
    fn group_done(&self, layer: usize, first: usize, rows: usize);
}

/// The neurons one precision tier computes in a step.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TierSet {
    /// Neurons some token computes in this tier, ascending.
    pub ids: Vec<u32>,
    /// `n × d_ff` flags by neuron id: token `t` computes neuron `j` in this tier. `None` where
    /// every token computes all of `ids` here or the kernels' own mask decides (one tier, no
    /// predictor).
    pub keep: Option<Vec<bool>>,
}

/// A linear layer on the device: its rows may be split into blocks that live in different
/// places (a resident block and a streamed one); `(first_row, block)` pairs cover all rows.
pub struct LinearView<'a, B: Backend> {
    pub blocks: Vec<(usize, &'a B::Weight)>,
    pub bias: Option<&'a B::Weight>,
}

pub struct NormView<'a, B: Backend> {
    pub weight: &'a B::Weight,
    pub bias: Option<&'a B::Weight>,
}

/// The FFN of one layer: separate matrices, or neuron bundles in runs `(first_neuron, run)`.
pub enum FfnView<'a, B: Backend> {
    Matrices {
        gate: Option<LinearView<'a, B>>,
        up: LinearView<'a, B>,
        down: LinearView<'a, B>,
    },
    Bundles {
        runs: Vec<(usize, &'a B::Weight)>,
        shape: BundleShape,
        up_bias: Option<&'a B::Weight>,
        down_bias: Option<&'a B::Weight>,
    },
}

/// Everything one layer computes with, wherever it lives.
pub struct LayerView<'a, B: Backend> {
    pub attn_norm: NormView<'a, B>,
    pub wq: LinearView<'a, B>,
    pub wk: LinearView<'a, B>,
    pub wv: LinearView<'a, B>,
    pub wo: LinearView<'a, B>,
    pub ffn_norm: NormView<'a, B>,
    /// The FFN on the device: all of it, or in hybrid execution only the hot neurons (their
    /// hidden activations in columns `0..hot.len()`).
    pub ffn: FfnView<'a, B>,
    /// Hybrid execution: the neurons the CPU computes, and how they merge.
    pub cold: Option<ColdView<'a, B>>,
    /// The GPU-centric sparse FFN: a cache unit the neurons each step needs are brought into
    /// (`ffn` then gives only the down bias).
    pub unit: Option<Box<dyn NeuronUnit<B> + 'a>>,
}

/// A layer's HBM cache unit (M2Cache): device slots for FFN neuron bundles, filled with the
/// neurons each step needs by the adjacent-token update, computed in place by the neuron-listed
/// kernels.
pub trait NeuronUnit<B: Backend>: Send {
    /// The neurons the `n` rows of `x` (the FFN input) need — those the mask (`threshold`, as
    /// [`crate::backend::sparse_act`]) leaves on, or with a predictor those its flags `keep`
    /// (`n × d_ff`) list — split among the unit's precision tiers
    /// (mixed precision), ranked by `scores` (the predictor's, `n × d_ff`) or by
    /// the activations' magnitudes.
    fn active(
        &self,
        x: &[f32],
        n: usize,
        threshold: f32,
        keep: Option<&[bool]>,
        scores: Option<&[f32]>,
    ) -> Result<[TierSet; 3]>;
    /// Whether the unit has more than one precision tier (a predictor's scores rank them).
    fn mixed(&self) -> bool;
    /// Slots in the unit's region for precision tier `tier`.
    fn slots(&self, tier: usize) -> usize;
    /// Bring `neurons` (distinct, at most [`NeuronUnit::slots`]) into tier `tier`'s region,
    /// moving only those it does not hold; their slots, in the same order.
    fn bring(&mut self, b: &B, tier: usize, neurons: &[u32]) -> Result<Vec<u32>>;
    /// Tier `tier`'s region (one bundle per slot, in its encoding) and its up bias by slot, if
    /// the model has one.
    fn unit(&self, tier: usize) -> Result<(&B::Weight, Option<&B::Weight>)>;
}

/// The FFN neurons of a layer the CPU computes from DRAM (PowerInfer's cold neurons).
pub trait ColdNeurons: Send + Sync {
    /// Add to `out` (`n × d_model`) the FFN output of this layer's cold neurons for the `n`
    /// input rows `x`. A neuron the mask leaves out (`threshold`, as
    /// [`crate::backend::sparse_act`]) or `keep` does not list (`n × d_ff` flags by neuron id,
    /// from a predictor) contributes nothing, and the parts it would need beyond the one that
    /// decides are not read.
    fn add_ffn(
        &self,
        x: &[f32],
        n: usize,
        threshold: f32,
        keep: Option<&[bool]>,
        out: &mut [f32],
    ) -> Result<()>;
}

/// The CPU's share of a hybrid layer.
pub struct ColdView<'a, B: Backend> {
    pub neurons: &'a dyn ColdNeurons,
    /// Ids of the hot neurons, in the order of the device FFN's hidden columns.
    pub hot: &'a [u32],
    /// Device buffer the CPU's partial sum is copied into (room for the step's `n × d_model`).
    pub partial: &'a mut B::Tensor,
}

/// The final norm and the output matrix.
pub struct HeadView<'a, B: Backend> {
    pub norm: NormView<'a, B>,
    pub output: LinearView<'a, B>,
}

/// Provides the weights of a forward pass, one layer at a time, in order: `layer(0)`,
/// `layer_done(0)`, `layer(1)`, ..., `head()`, `head_done()`. A streaming source uses the calls
/// to move weights in ahead of use and free them after.
pub trait WeightSource<B: Backend>: Send {
    /// Token embeddings (plus learned positions from `first_pos`) of `ids` into `out`.
    fn embed(&mut self, b: &B, ids: &[u32], first_pos: usize, out: &mut B::Tensor) -> Result<()>;
    /// Per-pair RoPE frequency divisors shipped with the weights (Llama 3.1 GGUF files).
    fn rope_freq_factors(&self) -> Option<Vec<f32>>;
    fn layer(&mut self, b: &B, l: usize) -> Result<LayerView<'_, B>>;
    fn layer_done(&mut self, b: &B, l: usize) -> Result<()>;
    fn head(&mut self, b: &B) -> Result<HeadView<'_, B>>;
    fn head_done(&mut self, b: &B) -> Result<()>;
    /// Wait for background transfers (read-ahead) to finish, so traffic counters are stable.
    fn settle(&mut self) {}
    /// Whether every weight stays where it is on the device, and `layer`, `layer_done`,
    /// `head` and `head_done` issue nothing to it: what a recorded step needs.
    fn fixed(&self) -> bool {
        false
    }
    /// The weight formats and widths this source's matrices multiply with (what sizes the
    /// device workspace of a step).
    fn matmuls(&self) -> MatmulShapes;
}

/// A model ready to run on one backend.
pub struct Engine<B: Backend> {
    backend: B,
    spec: ModelSpec,
    /// One pass at a time: a streaming source's buffers and the step buffers are shared by all
    /// sessions.
    pass: Mutex<Pass<B>>,
    act: Act,
    /// RoPE inverse frequencies on the device, pairing, rotated dims.
    rope: Option<(B::Weight, RopePairs, usize)>,
    kv_type: KvType,
    /// Per layer, the FFN activation magnitude at or below which a neuron is inactive (the
    /// sparsity mask, [`crate::backend::sparse_act`]); empty = dense.
    thresholds: Vec<f32>,
    /// Where each layer's FFN activations are shown as they are computed (`profile`).
    tap: Option<Arc<dyn ActivationTap>>,
    /// Predicted masks, applied after the activation (`--sparsity predicted`).
    predictor: Option<Arc<dyn NeuronPredictor>>,
    prefill: PrefillLayout,
    step_tap: Option<Arc<dyn StepTap>>,
    /// The paged KV pool sessions take their blocks from ([`Engine::with_kv_pool`]); without
    /// one, each session holds a cache of its whole context.
    pool: Option<SharedPool<B>>,
    /// Whether one-token decode steps are recorded and replayed where the backend can
    /// ([`Engine::with_recorded_steps`]), and how many have been recorded and replayed.
    record_steps: bool,
    steps_recorded: std::sync::atomic::AtomicU64,
    steps_replayed: std::sync::atomic::AtomicU64,
    /// Logit rows a step may return at most ([`Engine::with_logit_rows`]): the logits buffers
    /// are made this large at once, so calls returning more later never reallocate them.
    logit_rows: usize,
}

/// The paged KV pool (vLLM's PagedAttention over the contexts' chunks): every layer's keys and
/// values of `total` blocks of [`KV_BLOCK`] positions, one cache per layer, shared by the
/// sessions. A session takes blocks as it grows and gives them back when truncated, released or
/// dropped; its block table maps its positions to the pool's rows.
struct KvPool<B: Backend> {
    k: Vec<B::Kv>,
    v: Vec<B::Kv>,
    /// Free block ids, the lowest last (taken first).
    free: Vec<u32>,
    total: usize,
}

type SharedPool<B> = Arc<Mutex<KvPool<B>>>;

fn lock_pool<B: Backend>(p: &SharedPool<B>) -> std::sync::MutexGuard<'_, KvPool<B>> {
    // A panic while the pool was held leaves ids only, never half-written state worth refusing.
    p.lock().unwrap_or_else(|e| e.into_inner())
}

impl<B: Backend> KvPool<B> {
    fn give_back(&mut self, blocks: &[u32]) {
        self.free.extend_from_slice(blocks);
        self.free.sort_unstable_by(|a, b| b.cmp(a));
    }
}

/// Free and total blocks of a KV pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolUsage {
    pub free: usize,
    pub total: usize,
}

/// Receives each layer's FFN input (`n` rows of `d_model`) and activations `act(gate·x)` (or
/// `act(up·x)` without a gate) before any mask (`n` rows of `d_ff`).
pub trait ActivationTap: Send + Sync {
    fn observe(&self, layer: usize, input: &[f32], acts: &[f32], n: usize);
}

/// Decides, per layer, which FFN neurons each token computes (activation predictors): the
/// others contribute nothing.
pub trait NeuronPredictor: Send + Sync {
    /// For `n` rows of the layer's FFN input, `n × d_ff` flags: true = compute.
    fn active(&self, layer: usize, input: &[f32], n: usize) -> Vec<bool>;
    /// The flags and a score per flag (higher = more surely active: what mixed precision
    /// ranks by). Without scores of its own a predictor scores its flags 1 and 0.
    fn scored(&self, layer: usize, input: &[f32], n: usize) -> (Vec<bool>, Vec<f32>) {
        let keep = self.active(layer, input, n);
        let scores = keep.iter().map(|&k| k as u8 as f32).collect();
        (keep, scores)
    }
}

struct Pass<B: Backend> {
    source: Box<dyn WeightSource<B>>,
    /// The buffers of the last step, reused while steps keep their size.
    scratch: Option<Scratch<B>>,
}

/// A predictor's flags for a step (`n × d_ff`) and, where asked for, its scores.
type Predicted = (Vec<bool>, Option<Vec<f32>>);

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

impl Logits {
    /// Logit rows a step of `n` rows returns.
    fn rows(self, n: usize) -> usize {
        match self {
            Logits::None => 0,
            Logits::Last => 1,
            Logits::All => n,
        }
    }
}

/// One sequence's state on the device: its KV cache and how far it has been filled.
pub struct Session<B: Backend> {
    kv: SessionKv<B>,
    pos: usize,
    ctx: usize,
    probe: Option<QueryProbe<B>>,
    /// Its one-token decode step, recorded ([`Engine::with_recorded_steps`]).
    recorded: Recorded<B>,
}

/// Where a session's recorded decode step stands. A recording names every buffer of the step, so
/// it is replayed only while no device allocation has been taken since it was made (the
/// backend's allocation count, noted beside it); a step is recorded only after one ran plainly
/// with no allocation after it, so its buffers and kernels are settled first.
enum Recorded<B: Backend> {
    None,
    /// A plain step ran, and the allocation count after it.
    Ran(u64),
    Held(B::Recording, u64),
    /// Recording failed (an op no recording holds): this session's steps run plainly.
    Refused,
}

/// Where a session's keys and values live.
enum SessionKv<B: Backend> {
    /// Every layer's cache on the device.
    Device { k: Vec<B::Kv>, v: Vec<B::Kv> },
    /// In host memory (see [`PrefillLayout::kv_host`]).
    Host(HostKv<B>),
    /// Blocks of the engine's KV pool.
    Paged(PagedKv<B>),
}

struct PagedKv<B: Backend> {
    pool: SharedPool<B>,
    /// The pool's blocks holding positions `0..16`, `16..32`, … in order.
    blocks: Vec<u32>,
    /// `blocks` on the device (rewritten before a step when `dirty`).
    table: B::KvTable,
    dirty: bool,
}

impl<B: Backend> PagedKv<B> {
    /// Give back the blocks past the first `keep`.
    fn shrink(&mut self, keep: usize) {
        if keep < self.blocks.len() {
            lock_pool(&self.pool).give_back(&self.blocks[keep..]);
            self.blocks.truncate(keep);
            self.dirty = true;
        }
    }
}

impl<B: Backend> Drop for PagedKv<B> {
    fn drop(&mut self) {
        self.shrink(0);
    }
}

struct HostKv<B: Backend> {
    /// Per layer, the context's rows of K and V as stored (the cache's type, as on the
    /// device), page-locked where the backend pins so the copies run at the link's rate.
    k: Vec<HostStage>,
    v: Vec<HostStage>,
    row_bytes: usize,
    /// One layer's K and V on the device, the session's length: refilled for each layer.
    work_k: B::Kv,
    work_v: B::Kv,
}

/// The most recent queries of a few layers, kept so the attention a context's positions receive
/// can be measured later (the information density of KV chunks, LLMS eq. 1).
struct QueryProbe<B: Backend> {
    layers: Vec<usize>,
    /// Per probed layer: a ring of [`PROBE_QUERIES`] query rows (after RoPE).
    q: Vec<B::Tensor>,
    /// Per probed layer: the newest query of a recorded step, which writes it here (one fixed
    /// row; the ring row changes every step) and is copied into the ring after the step.
    staged: Vec<B::Tensor>,
    /// Position of the query in each ring row (`usize::MAX`: empty).
    positions: Vec<usize>,
    next: usize,
}

/// Bytes of K read at a time by [`Engine::attention_density`]: a context of up to this much
/// K per layer is read, scored and exponentiated once; beyond, once per pass, in runs of this
/// size, so the temporary does not grow with the context.
pub const DENSITY_READ_BYTES: usize = 4 << 20;
/// The fewest positions of a run of [`DENSITY_READ_BYTES`].
pub const DENSITY_READ_ROWS: usize = 256;

impl<B: Backend> Session<B> {
    /// Tokens evaluated so far.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Positions this session can hold.
    pub fn context_size(&self) -> usize {
        self.ctx
    }

    /// Forget the queries the probe remembers (a session taken over by another context: its
    /// density must come from that context's own queries).
    pub fn forget_queries(&mut self) {
        if let Some(p) = &mut self.probe {
            p.positions.fill(usize::MAX);
            p.next = 0;
        }
    }

    /// Forget everything after the first `pos` tokens (their cache rows are overwritten later;
    /// a paged session gives back the blocks it no longer needs).
    pub fn truncate(&mut self, pos: usize) {
        self.pos = self.pos.min(pos);
        if let SessionKv::Paged(p) = &mut self.kv {
            p.shrink(self.pos.div_ceil(KV_BLOCK));
        }
    }

    /// Forget every token and give back a paged session's blocks (a context swapped out of
    /// its session: its chunks are written elsewhere).
    pub fn release(&mut self) {
        self.pos = 0;
        if let SessionKv::Paged(p) = &mut self.kv {
            p.shrink(0);
        }
    }

    /// Blocks of the KV pool this session holds (0 unless paged).
    pub fn kv_blocks(&self) -> usize {
        match &self.kv {
            SessionKv::Paged(p) => p.blocks.len(),
            _ => 0,
        }
    }

    /// Declare the first `pos` cache rows valid: rows written with [`Engine::write_kv`], or a
    /// jump back to recompute the rows from `pos` on (the rows after stay as written).
    pub fn set_position(&mut self, pos: usize) -> Result<()> {
        if pos > self.ctx {
            return Err(EngineError::ContextFull {
                needed: pos,
                ctx: self.ctx,
            });
        }
        self.pos = pos;
        Ok(())
    }
}

/// Activation buffers for one forward step of `n` tokens, and the logits buffers of its last
/// `logit_rows` rows (when it returns logits).
struct Scratch<B: Backend> {
    /// Rows the buffers are viewed as now ([`Engine::narrow`]) and were allocated with.
    n: usize,
    cap: usize,
    x: B::Tensor,
    h: B::Tensor,
    q: B::Tensor,
    k: B::Tensor,
    v: B::Tensor,
    attn: B::Tensor,
    proj: B::Tensor,
    up: B::Tensor,
    gate: Option<B::Tensor>,
    /// One call's rows of q, k, v and attention output (a batched step's calls, one at a time).
    row: [B::Tensor; 4],
    logits: Option<LogitBuffers<B>>,
    /// Where hybrid layers' FFN inputs land on the host (made at the first hybrid layer).
    stage: Option<HostStage>,
    /// `proj` holds a layer's last residual, not yet added to `x`: the next layer adds it in
    /// its norm (one op); before anything else reads `x`, [`Engine::add_residual`].
    residual: bool,
}

struct LogitBuffers<B: Backend> {
    rows: usize,
    last: B::Tensor,
    normed: B::Tensor,
    logits: B::Tensor,
}

/// The backend's activation for a model's.
pub fn backend_act(a: Activation) -> Act {
    match a {
        Activation::Silu => Act::Silu,
        Activation::Relu => Act::Relu,
        Activation::Gelu => Act::Gelu,
        Activation::GeluTanh => Act::GeluTanh,
    }
}

impl<B: Backend> Engine<B> {
    /// Place all of `weights` on `backend` (see [`ResidentWeights`]).
    pub fn new(backend: B, spec: ModelSpec, weights: &ModelWeights) -> Result<Self> {
        let source = ResidentWeights::new(&backend, &spec, weights)?;
        Self::with_source(backend, spec, Box::new(source))
    }

    /// An engine whose weights come from `source`.
    pub fn with_source(
        backend: B,
        spec: ModelSpec,
        source: Box<dyn WeightSource<B>>,
    ) -> Result<Self> {
        let rope = match &spec.position {
            PositionEncoding::Rope(r) => {
                let inv = r.inv_freqs(source.rope_freq_factors().as_deref());
                let pairs = match r.style {
                    RopeStyle::Adjacent => RopePairs::Adjacent,
                    RopeStyle::Halves => RopePairs::Halves,
                };
                let t = HostTensor::from_f32("rope.inv_freq", 1, inv.len(), inv);
                Some((backend.upload(&t)?, pairs, r.dims))
            }
            PositionEncoding::Learned { .. } => None,
        };
        Ok(Engine {
            act: backend_act(spec.activation),
            backend,
            spec,
            pass: Mutex::new(Pass {
                source,
                scratch: None,
            }),
            rope,
            kv_type: KvType::F32,
            thresholds: Vec::new(),
            tap: None,
            predictor: None,
            prefill: PrefillLayout::default(),
            step_tap: None,
            pool: None,
            record_steps: false,
            steps_recorded: Default::default(),
            steps_replayed: Default::default(),
            logit_rows: 1,
        })
    }

    /// Make the logits buffers for `rows` rows from the first call on (the plan's
    /// `logit_rows`): a budgeted device then never frees a small set to make a larger one later,
    /// which could find the budget's free bytes in pieces.
    pub fn with_logit_rows(mut self, rows: usize) -> Self {
        self.logit_rows = rows.clamp(1, MAX_BATCH);
        self
    }

    /// Keep the KV caches of sessions made from now on in one paged pool of `blocks` blocks of
    /// [`KV_BLOCK`] positions (allocated now, in the engine's KV type): a session takes blocks
    /// as it grows instead of a cache of its whole context.
    pub fn with_kv_pool(mut self, blocks: usize) -> Result<Self> {
        if self.prefill.kv_host {
            return Err(EngineError::Weights(
                "a KV pool on the device and KV kept in host memory exclude each other".into(),
            ));
        }
        if blocks == 0 || blocks > u32::MAX as usize {
            return Err(EngineError::Weights(format!(
                "a KV pool of {blocks} blocks"
            )));
        }
        let (rows, cols, ty) = (blocks * KV_BLOCK, self.spec.kv_dim(), self.kv_type);
        let mut k = Vec::with_capacity(self.spec.n_layers);
        let mut v = Vec::with_capacity(self.spec.n_layers);
        for _ in 0..self.spec.n_layers {
            k.push(self.backend.alloc_kv(rows, cols, ty)?);
            v.push(self.backend.alloc_kv(rows, cols, ty)?);
        }
        self.pool = Some(Arc::new(Mutex::new(KvPool {
            k,
            v,
            free: (0..blocks as u32).rev().collect(),
            total: blocks,
        })));
        Ok(self)
    }

    /// Free and total blocks of the KV pool, if the engine has one.
    pub fn pool_usage(&self) -> Option<PoolUsage> {
        self.pool.as_ref().map(|p| {
            let p = lock_pool(p);
            PoolUsage {
                free: p.free.len(),
                total: p.total,
            }
        })
    }

    /// Blocks a paged session still has to take to hold its first `rows` positions.
    fn blocks_missing(s: &Session<B>, rows: usize) -> usize {
        match &s.kv {
            SessionKv::Paged(p) => rows.div_ceil(KV_BLOCK).saturating_sub(p.blocks.len()),
            _ => 0,
        }
    }

    /// Give each paged session of `want` (session, positions it must hold) the blocks it lacks,
    /// all or none: when the pool cannot give every one of them, nothing is taken.
    fn take_blocks(&self, want: &mut [(&mut Session<B>, usize)]) -> Result<()> {
        let needed: usize = want.iter().map(|(s, r)| Self::blocks_missing(s, *r)).sum();
        if needed == 0 {
            return Ok(());
        }
        let Some(pool) = &self.pool else {
            return Ok(());
        };
        let mut pool = lock_pool(pool);
        if needed > pool.free.len() {
            return Err(EngineError::KvPoolFull {
                needed,
                free: pool.free.len(),
                total: pool.total,
            });
        }
        for (s, rows) in want.iter_mut() {
            let missing = Self::blocks_missing(s, *rows);
            if let SessionKv::Paged(p) = &mut s.kv
                && missing > 0
            {
                let at = pool.free.len() - missing;
                // The lowest ids first, in ascending order.
                p.blocks.extend(pool.free.drain(at..).rev());
                p.dirty = true;
            }
        }
        Ok(())
    }

    /// A paged session's block table on the device, up to date.
    fn sync_table(&self, p: &mut PagedKv<B>) -> Result<()> {
        if p.dirty {
            self.backend.write_kv_table(&mut p.table, &p.blocks)?;
            p.dirty = false;
        }
        Ok(())
    }

    /// Run long calls and keep sessions' KV caches as `layout` says (sessions made from now on).
    pub fn with_prefill(mut self, layout: PrefillLayout) -> Result<Self> {
        if layout.kv_host && self.pool.is_some() {
            return Err(EngineError::Weights(
                "a KV pool on the device and KV kept in host memory exclude each other".into(),
            ));
        }
        let most = crate::footprint::MAX_GROUP;
        if layout.group == 0 || layout.group > most {
            return Err(EngineError::Weights(format!(
                "a prefill group of {} tokens (1..={most})",
                layout.group
            )));
        }
        self.prefill = layout;
        Ok(self)
    }

    pub fn prefill(&self) -> PrefillLayout {
        self.prefill
    }

    /// Record a session's one-token decode step once and replay it from then on, where the
    /// backend records steps (CUDA: a graph, launched in one call instead of one launch per
    /// kernel; the budgeted device runs the ops and checks each replay against the recording).
    /// Steps that hold anything but kernels run as before: streamed or CPU-side weights,
    /// host-kept KV, activation taps and predicted masks. A session's density probe takes its
    /// query from a fixed row the recording writes.
    pub fn with_recorded_steps(mut self, on: bool) -> Self {
        self.record_steps = on;
        self
    }

    /// Decode steps recorded, and replayed, so far.
    pub fn recorded_steps(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering;
        (
            self.steps_recorded.load(Ordering::Relaxed),
            self.steps_replayed.load(Ordering::Relaxed),
        )
    }

    /// Tell `tap` each time a layer has run over a group of rows.
    pub fn with_step_tap(mut self, tap: Arc<dyn StepTap>) -> Self {
        self.step_tap = Some(tap);
        self
    }

    /// Compute the FFN sparsely from now on: in layer `l`, neurons whose activation magnitude is
    /// at most `thresholds[l]` contribute nothing (one threshold per layer; an empty list is the
    /// dense FFN).
    pub fn with_sparsity(mut self, thresholds: Vec<f32>) -> Result<Self> {
        if !thresholds.is_empty() && thresholds.len() != self.spec.n_layers {
            return Err(EngineError::Weights(format!(
                "{} sparsity thresholds for {} layers",
                thresholds.len(),
                self.spec.n_layers
            )));
        }
        if let Some(t) = thresholds.iter().find(|t| !t.is_finite() || **t < 0.0) {
            return Err(EngineError::Weights(format!(
                "sparsity threshold {t} is not a finite non-negative number"
            )));
        }
        self.thresholds = thresholds;
        Ok(self)
    }

    /// Compute, in every layer, only the FFN neurons `predictor` picks for each token (none:
    /// every neuron the thresholds keep).
    pub fn with_predictor(mut self, predictor: Option<Arc<dyn NeuronPredictor>>) -> Self {
        self.predictor = predictor;
        self
    }

    /// Show every layer's FFN activations to `tap` as steps compute them.
    pub fn with_activation_tap(mut self, tap: Arc<dyn ActivationTap>) -> Self {
        self.tap = Some(tap);
        self
    }

    /// Store the KV cache of sessions made from now on in `kv` (f32 unless set).
    pub fn with_kv_type(mut self, kv: KvType) -> Result<Self> {
        if self.pool.is_some() {
            return Err(EngineError::Weights(
                "the KV type is chosen before the KV pool is made".into(),
            ));
        }
        kv.check_cols(self.spec.kv_dim())
            .map_err(BackendError::from)?;
        self.kv_type = kv;
        Ok(self)
    }

    pub fn kv_type(&self) -> KvType {
        self.kv_type
    }

    /// `f` given the device memory a step of `n` tokens returning `logit_rows` logit rows holds,
    /// as `(n, logit_rows) -> StepMemory` (the weights' shapes read once).
    fn with_step_memory<R>(
        &self,
        f: impl FnOnce(&dyn Fn(usize, usize) -> StepMemory) -> R,
    ) -> Result<R> {
        let pass = self
            .pass
            .lock()
            .map_err(|_| EngineError::Weights("an earlier pass panicked".into()))?;
        let matmuls = pass.source.matmuls();
        Ok(f(&|n, logit_rows| {
            step_memory(
                &self.spec,
                n,
                logit_rows,
                self.prefill.joins,
                self.kv_type,
                &matmuls,
                |op| self.backend.workspace_bytes(op),
            )
        }))
    }

    /// The device memory a step of `n` tokens returning `logit_rows` logit rows holds.
    pub fn step_memory(&self, n: usize, logit_rows: usize) -> Result<StepMemory> {
        self.with_step_memory(|step| step(n, logit_rows))
    }

    /// The prefill step [`whole_device_group`] picks for this engine's own step memory: the
    /// longest call (`prompt` tokens) in one step of at most `cap` rows whose buffers (with
    /// `logit_rows` rows of logits) fit in `room` bytes.
    pub fn whole_model_group(
        &self,
        prompt: usize,
        cap: usize,
        room: u64,
        logit_rows: usize,
    ) -> Result<usize> {
        self.with_step_memory(|step| {
            whole_device_group(prompt, cap, room, |g| step(g, logit_rows.min(g)).total())
        })
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Which architecture family this engine runs.
    pub fn arch(&self) -> Arch {
        self.spec.arch
    }

    /// Wait for the weight source's background transfers to finish (before reading counters).
    pub fn settle(&self) {
        if let Ok(mut p) = self.pass.lock() {
            p.source.settle();
        }
    }

    /// A fresh session holding up to `ctx` positions.
    pub fn new_session(&self, ctx: usize) -> Result<Session<B>> {
        if ctx > self.spec.max_context {
            return Err(EngineError::ContextTooLarge {
                requested: ctx,
                max: self.spec.max_context,
            });
        }
        let (kv, ty) = (self.spec.kv_dim(), self.kv_type);
        let kv = if let Some(pool) = &self.pool {
            SessionKv::Paged(PagedKv {
                pool: pool.clone(),
                blocks: Vec::new(),
                table: self.backend.alloc_kv_table(ctx.div_ceil(KV_BLOCK))?,
                dirty: false,
            })
        } else if self.prefill.kv_host {
            let row_bytes = ty.row_bytes(kv);
            let values = (ctx * row_bytes).div_ceil(4);
            let stages = || -> Result<Vec<HostStage>> {
                (0..self.spec.n_layers)
                    .map(|_| Ok(HostStage::new(&self.backend, values)?))
                    .collect()
            };
            SessionKv::Host(HostKv {
                k: stages()?,
                v: stages()?,
                row_bytes,
                work_k: self.backend.alloc_kv(ctx, kv, ty)?,
                work_v: self.backend.alloc_kv(ctx, kv, ty)?,
            })
        } else {
            let mut k = Vec::with_capacity(self.spec.n_layers);
            let mut v = Vec::with_capacity(self.spec.n_layers);
            for _ in 0..self.spec.n_layers {
                k.push(self.backend.alloc_kv(ctx, kv, ty)?);
                v.push(self.backend.alloc_kv(ctx, kv, ty)?);
            }
            SessionKv::Device { k, v }
        };
        Ok(Session {
            kv,
            pos: 0,
            ctx,
            probe: None,
            recorded: Recorded::None,
        })
    }

    /// Remember the latest queries of a few layers in `session` from now on, for
    /// [`Engine::attention_density`].
    pub fn enable_probe(&self, session: &mut Session<B>) -> Result<()> {
        if session.probe.is_some() {
            return Ok(());
        }
        let n = self.spec.n_layers;
        let count = PROBE_LAYERS.min(n);
        let layers: Vec<usize> = (0..count).map(|i| (2 * i + 1) * n / (2 * count)).collect();
        let mut q = Vec::with_capacity(count);
        let mut staged = Vec::with_capacity(count);
        for _ in 0..count {
            q.push(self.backend.alloc(PROBE_QUERIES, self.spec.q_dim())?);
            staged.push(self.backend.alloc(1, self.spec.q_dim())?);
        }
        session.probe = Some(QueryProbe {
            layers,
            q,
            staged,
            positions: vec![usize::MAX; PROBE_QUERIES],
            next: 0,
        });
        Ok(())
    }

    /// Keys and values of positions `first..first + len` of every layer, laid out per layer K
    /// then V, each `len × kv_dim` (the layout of `kv::ChunkData`).
    pub fn read_kv(&self, s: &mut Session<B>, first: usize, len: usize) -> Result<Vec<f32>> {
        let raw = self.read_kv_raw(s, first, len)?;
        let kv = self.spec.kv_dim();
        let mut out = vec![0f32; 2 * self.spec.n_layers * len * kv];
        crate::backend::cpu::decode_rows(self.kv_type, &raw, kv, &mut out);
        Ok(out)
    }

    /// [`Engine::read_kv`] as the cache holds it: rows of [`Engine::kv_type`] bytes, no
    /// conversion (per layer K then V, each `len` rows).
    pub fn read_kv_raw(&self, s: &mut Session<B>, first: usize, len: usize) -> Result<Vec<u8>> {
        self.check_rows(s, first, len)?;
        let part = len * self.kv_type.row_bytes(self.spec.kv_dim());
        let mut out = vec![0u8; 2 * self.spec.n_layers * part];
        if len == 0 {
            return Ok(out);
        }
        // Straight from the caches to the host: no device temporary.
        for (i, p) in out.chunks_mut(part).enumerate() {
            self.read_kv_raw_rows(s, i / 2, i % 2 == 1, first, p)?;
        }
        Ok(out)
    }

    /// Rows `first..` of layer `l`'s keys (or values) as f32, wherever the session keeps them.
    fn read_kv_rows(
        &self,
        s: &Session<B>,
        l: usize,
        values: bool,
        first: usize,
        out: &mut [f32],
    ) -> Result<()> {
        let cols = self.spec.kv_dim();
        let rows = out.len() / cols.max(1);
        let mut raw = vec![0u8; rows * self.kv_type.row_bytes(cols)];
        self.read_kv_raw_rows(s, l, values, first, &mut raw)?;
        crate::backend::cpu::decode_rows(self.kv_type, &raw, cols, out);
        Ok(())
    }

    /// Rows `first..` of layer `l`'s keys (or values) as the cache's bytes (`out.len()` bytes
    /// of whole rows), wherever the session keeps them.
    fn read_kv_raw_rows(
        &self,
        s: &Session<B>,
        l: usize,
        values: bool,
        first: usize,
        out: &mut [u8],
    ) -> Result<()> {
        let rb = self.kv_type.row_bytes(self.spec.kv_dim());
        let rows = out.len() / rb.max(1);
        match &s.kv {
            SessionKv::Device { k, v } => {
                let src = if values { &v[l] } else { &k[l] };
                self.backend.read_kv_raw(src, first, out)?;
            }
            SessionKv::Host(h) => {
                let raw = if values { &h.v[l] } else { &h.k[l] };
                let range = first * h.row_bytes..(first + rows) * h.row_bytes;
                let bytes = raw.bytes().get(range).ok_or(EngineError::ContextFull {
                    needed: first + rows,
                    ctx: s.ctx,
                })?;
                out.copy_from_slice(bytes);
            }
            SessionKv::Paged(p) => {
                if (first + rows).div_ceil(KV_BLOCK) > p.blocks.len() {
                    return Err(EngineError::Weights(format!(
                        "KV rows {first}..{} of a session holding {} blocks",
                        first + rows,
                        p.blocks.len()
                    )));
                }
                let pool = lock_pool(&p.pool);
                let src = if values { &pool.v[l] } else { &pool.k[l] };
                for (off, row, n) in kv_runs(Some(&p.blocks), first, rows) {
                    self.backend
                        .read_kv_raw(src, row, &mut out[off * rb..(off + n) * rb])?;
                }
            }
        }
        Ok(())
    }

    /// Write keys and values (layout of [`Engine::read_kv`]) into positions `first..first + len`.
    /// The session's position is not changed: see [`Session::set_position`].
    pub fn write_kv(
        &self,
        s: &mut Session<B>,
        first: usize,
        len: usize,
        values: &[f32],
    ) -> Result<()> {
        let kv = self.spec.kv_dim();
        if values.len() != 2 * self.spec.n_layers * len * kv {
            return Err(EngineError::Weights(format!(
                "KV rows: {} values given for {len} positions",
                values.len()
            )));
        }
        let raw = crate::backend::cpu::encode_rows(self.kv_type, values, kv);
        self.write_kv_raw(s, first, len, &raw)
    }

    /// [`Engine::write_kv`] from the cache's own bytes (layout of [`Engine::read_kv_raw`]).
    pub fn write_kv_raw(
        &self,
        s: &mut Session<B>,
        first: usize,
        len: usize,
        bytes: &[u8],
    ) -> Result<()> {
        self.check_rows(s, first, len)?;
        let rb = self.kv_type.row_bytes(self.spec.kv_dim());
        if bytes.len() != 2 * self.spec.n_layers * len * rb {
            return Err(EngineError::Weights(format!(
                "KV rows: {} bytes given for {len} positions of {rb}-byte rows",
                bytes.len()
            )));
        }
        if len == 0 {
            return Ok(());
        }
        self.take_blocks(&mut [(&mut *s, first + len)])?;
        for (i, part) in bytes.chunks(len * rb).enumerate() {
            let (l, is_v) = (i / 2, i % 2 == 1);
            match &mut s.kv {
                SessionKv::Device { k, v } => {
                    let dst = if is_v { &mut v[l] } else { &mut k[l] };
                    self.backend.write_kv_raw(dst, first, part)?;
                }
                SessionKv::Host(h) => {
                    let raw = if is_v { &mut h.v[l] } else { &mut h.k[l] };
                    raw.bytes_mut()[first * rb..(first + len) * rb].copy_from_slice(part);
                }
                SessionKv::Paged(p) => {
                    let mut pool = lock_pool(&p.pool);
                    let dst = if is_v { &mut pool.v[l] } else { &mut pool.k[l] };
                    for (off, row, n) in kv_runs(Some(&p.blocks), first, len) {
                        self.backend
                            .write_kv_raw(dst, row, &part[off * rb..(off + n) * rb])?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Before layer `l` runs steps from position `pos`: a host-kept session's rows `0..pos` of
    /// that layer into the device work buffers.
    fn kv_layer_begin(&self, s: &mut Session<B>, l: usize, pos: usize, on_cpu: bool) -> Result<()> {
        if on_cpu {
            return Ok(());
        }
        if let SessionKv::Host(h) = &mut s.kv {
            let end = pos * h.row_bytes;
            for (raw, work) in [(&h.k[l], &mut h.work_k), (&h.v[l], &mut h.work_v)] {
                self.backend.write_kv_raw(work, 0, &raw.bytes()[..end])?;
            }
        }
        Ok(())
    }

    /// After layer `l` has stored rows `pos..pos + n`: a host-kept session's copies of them.
    fn kv_layer_end(
        &self,
        s: &mut Session<B>,
        l: usize,
        pos: usize,
        n: usize,
        on_cpu: bool,
    ) -> Result<()> {
        if on_cpu {
            return Ok(());
        }
        if let SessionKv::Host(h) = &mut s.kv {
            let rb = h.row_bytes;
            for (raw, work) in [(&mut h.k[l], &h.work_k), (&mut h.v[l], &h.work_v)] {
                let rows = &mut raw.bytes_mut()[pos * rb..(pos + n) * rb];
                self.backend.read_kv_raw(work, pos, rows)?;
            }
        }
        Ok(())
    }

    fn check_rows(&self, s: &Session<B>, first: usize, len: usize) -> Result<()> {
        if first + len > s.ctx {
            return Err(EngineError::ContextFull {
                needed: first + len,
                ctx: s.ctx,
            });
        }
        Ok(())
    }

    /// Share of attention each block of `block` positions received from the remembered queries
    /// (softmax probabilities, averaged over probed layers, heads and queries; blocks sum to 1).
    /// Empty when the session has no probe or no queries yet. K is read in runs of
    /// [`DENSITY_READ_BYTES`] (at least [`DENSITY_READ_ROWS`] positions), so the temporary does
    /// not grow with the context.
    pub fn attention_density(&self, s: &mut Session<B>, block: usize) -> Result<Vec<f32>> {
        let row_bytes = self.spec.kv_dim().max(1) * std::mem::size_of::<f32>();
        let rows = (DENSITY_READ_BYTES / row_bytes).max(DENSITY_READ_ROWS);
        self.attention_density_in(s, block, rows)
    }

    /// [`Engine::attention_density`] reading K `rows` positions at a time (rounded up to whole
    /// blocks): three passes over them (each query-head's maximum score, its softmax sum, then
    /// the mass per block; K is read once when one run holds it all, else once per pass). Every
    /// sum is taken in the order of one whole-layer read (a block's mass comes from the one run
    /// that holds it), so the result is the same to the bit whatever `rows`.
    pub fn attention_density_in(
        &self,
        s: &mut Session<B>,
        block: usize,
        rows: usize,
    ) -> Result<Vec<f32>> {
        let Some(p) = &s.probe else {
            return Ok(Vec::new());
        };
        let spec = &self.spec;
        let layers = p.layers.clone();
        let pos = s.pos;
        let block = block.max(1);
        let blocks = pos.div_ceil(block);
        let mut mass = vec![0f64; blocks];
        let queries: Vec<(usize, usize)> = p
            .positions
            .iter()
            .enumerate()
            .filter(|&(_, &qp)| qp < pos)
            .map(|(r, &qp)| (r, qp))
            .collect();
        if queries.is_empty() || pos == 0 {
            return Ok(Vec::new());
        }
        let (hd, kv) = (spec.head_dim, spec.kv_dim());
        let group = spec.n_heads / spec.n_kv_heads.max(1);
        let rows = rows.clamp(1, pos).div_ceil(block) * block;
        let b = &self.backend;
        b.enter(move || {
            let Some(p) = &s.probe else {
                return Ok(Vec::new());
            };
            let mut q = vec![0f32; PROBE_QUERIES * spec.q_dim()];
            // Straight to the host, a run of rows at a time: no device temporary, and a host
            // one of `rows × kv_dim` however long the context.
            let mut k = vec![0f32; rows * kv];
            let n = queries.len() * spec.n_heads;
            // Each query head's scores over the run (`rows` to a head): computed once where one
            // run holds the whole layer (and their exponentials once), else once per pass; by
            // the host's vector kernels, 16 key rows at a time, whatever `rows`.
            let mut scores = vec![0f32; n * rows];
            let kern = crate::backend::cpu::kernels::best();
            for (li, &l) in layers.iter().enumerate() {
                b.read(&p.q[li], &mut q)?;
                let mut max = vec![f32::NEG_INFINITY; n];
                let mut sum = vec![0f64; n];
                for pass in 0..3 {
                    for first in (0..pos).step_by(rows) {
                        let len = rows.min(pos - first);
                        // One run holds the whole layer: read and scored once for the three
                        // passes.
                        if pass == 0 || rows < pos {
                            self.read_kv_rows(s, l, false, first, &mut k[..len * kv])?;
                            // Each query head's scores apart: over the threads.
                            let score = |(at, out): (usize, &mut [f32])| {
                                let (qi, h) = (at / spec.n_heads, at % spec.n_heads);
                                let (row, qp) = queries[qi];
                                let end = len.min((qp + 1).saturating_sub(first));
                                let qh = &q[row * spec.q_dim() + h * hd..][..hd];
                                let kh = (h / group.max(1)) * hd;
                                let out = &mut out[..end];
                                for (j0, o) in (0..end).step_by(16).zip(out.chunks_mut(16)) {
                                    let keys: [&[f32]; 16] = std::array::from_fn(|i| {
                                        let j = (j0 + i).min(end - 1);
                                        &k[j * kv + kh..][..hd]
                                    });
                                    (kern.scores)(&[qh], &keys[..o.len()], o);
                                }
                                for v in out.iter_mut() {
                                    *v *= spec.attn_scale;
                                }
                            };
                            use rayon::prelude::*;
                            scores.par_chunks_mut(rows).enumerate().for_each(score);
                        }
                        for (qi, &(_, qp)) in queries.iter().enumerate() {
                            if first > qp {
                                continue;
                            }
                            let end = len.min(qp + 1 - first);
                            for h in 0..spec.n_heads {
                                let at = qi * spec.n_heads + h;
                                let run = &mut scores[at * rows..][..end];
                                for (j, sc) in run.iter_mut().enumerate() {
                                    match pass {
                                        0 => max[at] = max[at].max(*sc),
                                        1 => {
                                            let e = (*sc - max[at]).exp();
                                            sum[at] += e as f64;
                                            if rows >= pos {
                                                // Kept for the last pass (the same value).
                                                *sc = e;
                                            }
                                        }
                                        _ => {
                                            let e = if rows >= pos {
                                                *sc
                                            } else {
                                                (*sc - max[at]).exp()
                                            };
                                            mass[(first + j) / block] += e as f64 / sum[at]
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
            let total: f64 = mass.iter().sum();
            Ok(mass
                .iter()
                .map(|m| if total > 0.0 { (m / total) as f32 } else { 0.0 })
                .collect())
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
        self.take_blocks(&mut [(&mut *session, needed)])?;
        let mut guard = self
            .pass
            .lock()
            .map_err(|_| EngineError::Weights("an earlier pass panicked".into()))?;
        let pass: &mut Pass<B> = &mut guard;
        self.backend.enter(|| {
            if self.prefill.partitions(tokens.len()) {
                self.layer_major(pass, session, tokens, logits)
            } else {
                self.step(pass, session, tokens, logits)
            }
        })
    }

    fn scratch(&self, n: usize) -> Result<Scratch<B>> {
        let b = &self.backend;
        let mut bufs = activation_shapes(&self.spec, n, self.prefill.joins)
            .into_iter()
            .map(|(r, c)| b.alloc(r, c))
            .collect::<std::result::Result<Vec<_>, _>>()?
            .into_iter();
        let mut next = || {
            bufs.next()
                .ok_or_else(|| EngineError::Weights("activation buffers miscounted".into()))
        };
        Ok(Scratch {
            n,
            cap: n,
            x: next()?,
            h: next()?,
            q: next()?,
            k: next()?,
            v: next()?,
            attn: next()?,
            proj: next()?,
            up: next()?,
            gate: if self.spec.gated_ffn {
                Some(next()?)
            } else {
                None
            },
            row: [next()?, next()?, next()?, next()?],
            logits: None,
            stage: None,
            residual: false,
        })
    }

    fn logit_buffers(&self, rows: usize) -> Result<LogitBuffers<B>> {
        let rows = rows.max(self.logit_rows.min(self.prefill.group));
        let [a, b, c] = logit_shapes(&self.spec, rows);
        let be = &self.backend;
        Ok(LogitBuffers {
            rows,
            last: be.alloc(a.0, a.1)?,
            normed: be.alloc(b.0, b.1)?,
            logits: be.alloc(c.0, c.1)?,
        })
    }

    fn norm(&self, x: &B::Tensor, n: &NormView<B>, out: &mut B::Tensor) -> Result<()> {
        let eps = self.spec.norm_eps;
        match (self.spec.norm, n.bias) {
            (NormKind::Rms, _) => self.backend.rms_norm(x, n.weight, eps, out)?,
            (NormKind::Layer, Some(b)) => self.backend.layer_norm(x, n.weight, b, eps, out)?,
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

    fn linear(&self, l: &LinearView<B>, x: &B::Tensor, out: &mut B::Tensor) -> Result<()> {
        for &(row0, w) in &l.blocks {
            self.backend.matmul_into(w, x, out, row0)?;
        }
        if let Some(b) = l.bias {
            self.backend.add_bias(out, b)?;
        }
        Ok(())
    }

    /// `x` through several linears of the same input (q, k, v; up and gate), each into its
    /// output: one [`Backend::matmul_parts`] (one launch on CUDA), then the biases.
    fn linears(
        &self,
        ls: &[&LinearView<B>],
        x: ProductInput<'_, B>,
        outs: &mut [&mut B::Tensor],
    ) -> Result<()> {
        let parts: Vec<MatmulPart<B::Weight>> = ls
            .iter()
            .enumerate()
            .flat_map(|(out, l)| {
                l.blocks
                    .iter()
                    .map(move |&(col0, w)| MatmulPart { w, out, col0 })
            })
            .collect();
        self.backend.matmul_parts_of(x, &parts, outs)?;
        for (l, out) in ls.iter().zip(outs.iter_mut()) {
            if let Some(b) = l.bias {
                self.backend.add_bias(out, b)?;
            }
        }
        Ok(())
    }

    /// The attention block's inputs from `sc.x` (the last layer's residual added first): its
    /// norm (into `sc.h`, where the backend writes it out), then q, k and v.
    fn attention_inputs(&self, layer: &LayerView<B>, sc: &mut Scratch<B>) -> Result<()> {
        let add = std::mem::take(&mut sc.residual).then_some(&sc.proj);
        let input = self.norm_input(&mut sc.x, add, &layer.attn_norm, &mut sc.h)?;
        let outs: &mut [&mut B::Tensor] = &mut [&mut sc.q, &mut sc.k, &mut sc.v];
        self.linears(&[&layer.wq, &layer.wk, &layer.wv], input, outs)
    }

    /// `x`'s rows (after `x += add`, where given) normed by `n`, as the products after the norm
    /// take them: an RMSNorm pending (the backend may write its rows straight in the products'
    /// input format), a LayerNorm computed into `out`.
    fn norm_input<'a>(
        &self,
        x: &'a mut B::Tensor,
        add: Option<&'a B::Tensor>,
        n: &'a NormView<B>,
        out: &'a mut B::Tensor,
    ) -> Result<ProductInput<'a, B>> {
        match self.spec.norm {
            NormKind::Rms => Ok(ProductInput::RmsNorm {
                x,
                add,
                weight: n.weight,
                eps: self.spec.norm_eps,
                out,
            }),
            NormKind::Layer => {
                match add {
                    Some(y) => self.add_norm(x, y, n, out)?,
                    None => self.norm(x, n, out)?,
                }
                Ok(ProductInput::Rows(out))
            }
        }
    }

    /// The gate, up and down weights of an FFN that one [`Backend::gate_up_down`] computes: a
    /// gated FFN of whole matrices without bias, whose activations nothing observes (the tap)
    /// or masks (`masked`, or the predictor).
    fn whole_gated_ffn<'v>(
        &self,
        f: &FfnView<'v, B>,
        masked: bool,
    ) -> Option<(&'v B::Weight, &'v B::Weight, &'v B::Weight)> {
        if masked || self.tap.is_some() || self.predictor.is_some() {
            return None;
        }
        let FfnView::Matrices {
            gate: Some(gate),
            up,
            down,
        } = f
        else {
            return None;
        };
        if gate.bias.is_some() || up.bias.is_some() || down.bias.is_some() {
            return None;
        }
        match (
            gate.blocks.as_slice(),
            up.blocks.as_slice(),
            down.blocks.as_slice(),
        ) {
            ([(0, g)], [(0, u)], [(0, d)]) => Some((*g, *u, *d)),
            _ => None,
        }
    }

    /// Rotate a step's queries and keys (rows from position `pos`), where the model rotates.
    fn rope_qk(&self, q: &mut B::Tensor, k: &mut B::Tensor, pos: usize) -> Result<()> {
        if let Some(r) = self.rope_args() {
            let (hd, rd, pairs, f) = (r.head_dim, r.rot_dims, r.pairs, r.inv_freq);
            self.backend.rope_pair(q, k, hd, rd, pairs, f, pos)?;
        }
        Ok(())
    }

    /// The model's rotary embedding as the ops take it (none where it does not rotate).
    fn rope_args(&self) -> Option<Rope<'_, B::Weight>> {
        self.rope.as_ref().map(|(inv_freq, pairs, dims)| Rope {
            head_dim: self.spec.head_dim,
            rot_dims: *dims,
            pairs: *pairs,
            inv_freq,
        })
    }

    /// `x += y`, then `x` normed by `n` into `out` (one op for RMSNorm).
    fn add_norm(
        &self,
        x: &mut B::Tensor,
        y: &B::Tensor,
        n: &NormView<B>,
        out: &mut B::Tensor,
    ) -> Result<()> {
        match self.spec.norm {
            NormKind::Rms => {
                let eps = self.spec.norm_eps;
                Ok(self.backend.add_rms_norm(x, y, n.weight, eps, out)?)
            }
            NormKind::Layer => {
                self.backend.add(x, y)?;
                self.norm(x, n, out)
            }
        }
    }

    /// The rows of a device tensor on the host.
    fn host_rows(&self, t: &B::Tensor) -> Result<(Vec<f32>, usize)> {
        let (n, cols) = self.backend.shape(t);
        let mut v = vec![0f32; n * cols];
        self.backend.read(t, &mut v)?;
        Ok((v, n))
    }

    /// Layer `layer`'s FFN input and activations before the mask, shown to the tap.
    fn show_tap(&self, layer: usize, input: &B::Tensor, pre_act: &B::Tensor) -> Result<()> {
        let Some(tap) = &self.tap else {
            return Ok(());
        };
        let (x, _) = self.host_rows(input)?;
        let (mut v, n) = self.host_rows(pre_act)?;
        let f = crate::backend::cpu::ops::activation(self.act);
        v.iter_mut().for_each(|x| *x = f(*x));
        tap.observe(layer, &x, &v, n);
        Ok(())
    }

    /// The predictor's flags for layer `layer` and the FFN input `x` (`n × d_ff`), if any.
    fn predict(&self, layer: usize, x: &[f32], n: usize) -> Result<Option<Vec<bool>>> {
        Ok(self.predict_scored(layer, x, n, false)?.map(|(k, _)| k))
    }

    /// As [`Engine::predict`], with the predictor's scores where `scored`.
    fn predict_scored(
        &self,
        layer: usize,
        x: &[f32],
        n: usize,
        scored: bool,
    ) -> Result<Option<Predicted>> {
        let Some(p) = &self.predictor else {
            return Ok(None);
        };
        let (keep, scores) = if scored {
            let (k, s) = p.scored(layer, x, n);
            (k, Some(s))
        } else {
            (p.active(layer, x, n), None)
        };
        let want = n * self.spec.d_ff;
        if keep.len() != want || scores.as_ref().is_some_and(|s| s.len() != want) {
            return Err(EngineError::Weights(format!(
                "the predictor of layer {layer} gave {} flags for {n}×{} activations",
                keep.len(),
                self.spec.d_ff
            )));
        }
        Ok(Some((keep, scores)))
    }

    /// Zero the hidden activations of the neurons `keep` leaves out. Column `j` of `hidden` is
    /// neuron `ids[j]` (columns past `ids` unused), or neuron `j` without `ids`. (The
    /// neuron-aware kernels skip them instead; this is the same result, for any backend.)
    fn mask_hidden(
        &self,
        keep: &[bool],
        ids: Option<&[u32]>,
        hidden: &mut B::Tensor,
    ) -> Result<()> {
        let d_ff = self.spec.d_ff;
        let (mut h, n) = self.host_rows(hidden)?;
        let cols = h.len() / n.max(1);
        let used = ids.map_or(cols, |ids| ids.len().min(cols));
        for t in 0..n {
            for j in 0..used {
                let id = ids.map_or(j, |ids| ids[j] as usize);
                if !keep[t * d_ff + id] {
                    h[t * cols + j] = 0.0;
                }
            }
        }
        self.backend.write(hidden, &h)?;
        Ok(())
    }

    /// The predictor's mask for the FFN input `input` applied to `hidden` (dense layers).
    fn apply_predictor(
        &self,
        layer: usize,
        input: &B::Tensor,
        hidden: &mut B::Tensor,
    ) -> Result<()> {
        if self.predictor.is_none() {
            return Ok(());
        }
        let (x, n) = self.host_rows(input)?;
        match self.predict(layer, &x, n)? {
            Some(keep) => self.mask_hidden(&keep, None, hidden),
            None => Ok(()),
        }
    }

    /// `proj = FFN(h)` of layer `layer`, using `sc.up` / `sc.gate` for the hidden activations:
    /// on the device, or in hybrid execution the hot neurons on the device and the cold ones on
    /// the CPU, merged on the device.
    fn ffn(
        &self,
        layer: usize,
        f: &FfnView<B>,
        cold: Option<&mut ColdView<B>>,
        sc: &mut Scratch<B>,
    ) -> Result<()> {
        let threshold = self.thresholds.get(layer).copied().unwrap_or(0.0);
        let Some(cold) = cold else {
            return self.device_ffn(layer, f, threshold, None, sc);
        };
        if self.tap.is_some() {
            return Err(EngineError::Weights(
                "activations are observed on a model loaded whole, not in hybrid execution".into(),
            ));
        }
        let mut stage = self.take_stage(sc)?;
        let done = self.hybrid_ffn(layer, f, threshold, cold, &mut stage, sc);
        sc.stage = Some(stage);
        done
    }

    /// The host stage the step's FFN input lands in, taken out of the scratch (made at the
    /// first use, or larger when the step is): it stays out while the copy into it is in flight
    /// (the device ops borrow the rest) and the caller puts it back whatever happens.
    fn take_stage(&self, sc: &mut Scratch<B>) -> Result<HostStage> {
        let values = sc.n * self.spec.d_model;
        match sc.stage.take() {
            Some(s) if s.len() >= values => Ok(s),
            _ => Ok(HostStage::new(&self.backend, values)?),
        }
    }

    /// One layer's hybrid FFN as its graph of device ops, CPU ops and copies, issued in this
    /// order, with one host wait:
    /// 1. copy device→host: the FFN input, queued behind the attention (event `input`);
    /// 2. device: the hot neurons, queued at once where no predictor decides them;
    /// 3. host: wait for `input` (a blocking event, never a spin); the predictor, if any;
    /// 4. device: the hot neurons, queued here where the predictor decides them;
    /// 5. CPU: the cold neurons into the partial sum, while the device runs 2 or 4;
    /// 6. copy host→device: the partial sum (staged by the driver; the host does not wait);
    /// 7. device: `proj += partial`, the one merge, after 2/4 and 6 in stream order.
    fn hybrid_ffn(
        &self,
        layer: usize,
        f: &FfnView<B>,
        threshold: f32,
        cold: &mut ColdView<B>,
        stage: &mut HostStage,
        sc: &mut Scratch<B>,
    ) -> Result<()> {
        let b = &self.backend;
        let (n, d) = b.shape(&sc.h);
        let input = Landing::start(b, &sc.h, stage)?;
        let early = self.predictor.is_none();
        if early {
            self.queue_hot(layer, f, threshold, None, cold.hot, sc)?;
        }
        let x = input.wait()?;
        let keep = self.predict(layer, x, n)?;
        if !early {
            self.queue_hot(layer, f, threshold, keep.as_deref(), cold.hot, sc)?;
        }
        let mut part = vec![0f32; n * d];
        cold.neurons
            .add_ffn(x, n, threshold, keep.as_deref(), &mut part)?;
        b.reshape(cold.partial, n, d)?;
        b.write(cold.partial, &part)?;
        b.add(&mut sc.proj, cold.partial)?;
        Ok(())
    }

    /// The FFN of a layer with a cache unit: the input lands on the host (the one wait), the
    /// unit decides the active neurons (or the predictor does) and brings them in, as many as
    /// its slots hold at a time, and the listed kernels compute them from their slots.
    fn unit_ffn(
        &self,
        layer: usize,
        f: &FfnView<B>,
        unit: &mut dyn NeuronUnit<B>,
        sc: &mut Scratch<B>,
    ) -> Result<()> {
        let b = &self.backend;
        let FfnView::Bundles {
            shape, down_bias, ..
        } = f
        else {
            return Err(EngineError::Weights(
                "cache units hold neuron bundles: this FFN is stored as matrices".into(),
            ));
        };
        if self.tap.is_some() {
            return Err(EngineError::Weights(
                "activations are observed on a model loaded whole, not from cache units".into(),
            ));
        }
        let threshold = self.thresholds.get(layer).copied().unwrap_or(0.0);
        let n = sc.n;
        let mut stage = self.take_stage(sc)?;
        let decided = (|| {
            let x = Landing::start(b, &sc.h, &mut stage)?.wait()?;
            let predicted = self.predict_scored(layer, x, n, unit.mixed())?;
            let (keep, scores) = match &predicted {
                Some((k, s)) => (Some(k.as_slice()), s.as_deref()),
                None => (None, None),
            };
            unit.active(x, n, threshold, keep, scores)
        })();
        sc.stage = Some(stage);
        let tiers = decided?;
        b.zero(&mut sc.proj)?;
        if let Some(bias) = down_bias {
            b.add_bias(&mut sc.proj, bias)?;
        }
        for (tier, set) in tiers.iter().enumerate() {
            let slots = unit.slots(tier).max(1);
            for chunk in set.ids.chunks(slots) {
                let at = unit.bring(b, tier, chunk)?;
                let (w, up_bias) = unit.unit(tier)?;
                b.ffn_bundles_up_listed(
                    w, *shape, &sc.h, self.act, threshold, up_bias, &at, &mut sc.up,
                )?;
                if let Some(keep) = &set.keep
                    && n > 1
                {
                    // A neuron one token needs (in this precision) may be off for another.
                    self.mask_hidden(keep, Some(chunk), &mut sc.up)?;
                }
                b.ffn_bundles_down_listed(w, *shape, &sc.up, &at, &mut sc.proj)?;
            }
        }
        Ok(())
    }

    /// Queue the hot neurons `hot` of a hybrid layer on the device (`proj` = their FFN
    /// output; the bias where there are none).
    fn queue_hot(
        &self,
        layer: usize,
        f: &FfnView<B>,
        threshold: f32,
        keep: Option<&[bool]>,
        hot: &[u32],
        sc: &mut Scratch<B>,
    ) -> Result<()> {
        let b = &self.backend;
        let n = sc.n;
        if hot.is_empty() {
            b.zero(&mut sc.proj)?;
            let bias = match f {
                FfnView::Matrices { down, .. } => down.bias,
                FfnView::Bundles { down_bias, .. } => *down_bias,
            };
            if let Some(bias) = bias {
                b.add_bias(&mut sc.proj, bias)?;
            }
            return Ok(());
        }
        // Hot matrices have `hot` rows (gate, up) and columns (down): the hidden buffers
        // narrow to match. Hot bundles fill the first `hot` columns as they are.
        let narrow = matches!(f, FfnView::Matrices { .. });
        let d_ff = self.spec.d_ff;
        if narrow {
            b.reshape(&mut sc.up, n, hot.len())?;
            if let Some(g) = &mut sc.gate {
                b.reshape(g, n, hot.len())?;
            }
        }
        let done = self.device_ffn(layer, f, threshold, Some((keep, hot)), sc);
        if narrow {
            b.reshape(&mut sc.up, n, d_ff)?;
            if let Some(g) = &mut sc.gate {
                b.reshape(g, n, d_ff)?;
            }
        }
        done
    }

    /// The FFN on the device. `hybrid`: the predictor's flags (already computed) and the ids of
    /// the device's neurons, column by column; else the predictor runs here on the whole layer.
    fn device_ffn(
        &self,
        layer: usize,
        f: &FfnView<B>,
        threshold: f32,
        hybrid: Option<(Option<&[bool]>, &[u32])>,
        sc: &mut Scratch<B>,
    ) -> Result<()> {
        let b = &self.backend;
        // Hybrid with a predictor over a hot block of bundles: only the hot neurons some token
        // needs are read (the neuron-listed kernels), their activations compact in `sc.up`.
        if let (
            Some((Some(keep), ids)),
            FfnView::Bundles {
                runs,
                shape,
                up_bias,
                down_bias,
            },
        ) = (hybrid, f)
            && let [(0, run)] = runs.as_slice()
        {
            let d_ff = self.spec.d_ff;
            let (n, _) = b.shape(&sc.h);
            let listed: Vec<u32> = (0..ids.len() as u32)
                .filter(|&j| (0..n).any(|t| keep[t * d_ff + ids[j as usize] as usize]))
                .collect();
            b.ffn_bundles_up_listed(
                run, *shape, &sc.h, self.act, threshold, *up_bias, &listed, &mut sc.up,
            )?;
            if n > 1 {
                // A neuron listed for one token may be off for another.
                let listed_ids: Vec<u32> = listed.iter().map(|&j| ids[j as usize]).collect();
                self.mask_hidden(keep, Some(&listed_ids), &mut sc.up)?;
            }
            b.zero(&mut sc.proj)?;
            b.ffn_bundles_down_listed(run, *shape, &sc.up, &listed, &mut sc.proj)?;
            if let Some(bias) = down_bias {
                b.add_bias(&mut sc.proj, bias)?;
            }
            return Ok(());
        }
        let mask = |input: &B::Tensor, hidden: &mut B::Tensor| match hybrid {
            Some((Some(keep), ids)) => self.mask_hidden(keep, Some(ids), hidden),
            Some((None, _)) => Ok(()),
            None => self.apply_predictor(layer, input, hidden),
        };
        match f {
            FfnView::Matrices { gate, up, down } => {
                let hidden = match (gate, &mut sc.gate) {
                    (Some(wg), Some(g)) => {
                        // Nothing but the tap reads the products before their gating: one op
                        // for the two products and the gated one (one kernel on CUDA).
                        let how = (self.act, threshold);
                        // Nor, unmasked, does anything but down read the gated product: one op
                        // to the FFN's output.
                        if let Some(ws) = self.whole_gated_ffn(f, hybrid.is_some()) {
                            let input = ProductInput::Rows(&sc.h);
                            b.gate_up_down(input, ws, how, (g, &mut sc.up), &mut sc.proj)?;
                            return Ok(());
                        }
                        match (&self.tap, wg.blocks.as_slice(), up.blocks.as_slice()) {
                            (None, [(0, w_gate)], [(0, w_up)])
                                if wg.bias.is_none() && up.bias.is_none() =>
                            {
                                b.gate_up(&sc.h, (w_gate, w_up), how, g, &mut sc.up)?;
                            }
                            _ => {
                                let input = ProductInput::Rows(&sc.h);
                                self.linears(&[up, wg], input, &mut [&mut sc.up, g])?;
                                self.show_tap(layer, &sc.h, g)?;
                                b.gated(g, &sc.up, self.act, threshold)?;
                            }
                        }
                        mask(&sc.h, g)?;
                        &*g
                    }
                    _ => {
                        self.linear(up, &sc.h, &mut sc.up)?;
                        self.show_tap(layer, &sc.h, &sc.up)?;
                        b.activate(&mut sc.up, self.act, threshold)?;
                        mask(&sc.h, &mut sc.up)?;
                        &sc.up
                    }
                };
                self.linear(down, hidden, &mut sc.proj)?;
            }
            FfnView::Bundles {
                runs,
                shape,
                up_bias,
                down_bias,
            } => {
                if self.tap.is_some() {
                    return Err(EngineError::Weights(
                        "activations are observed on the FFN matrices: profile a model loaded whole, not an offload store's neuron bundles".into(),
                    ));
                }
                for &(first, run) in runs {
                    b.ffn_bundles_up(
                        run, *shape, &sc.h, self.act, threshold, *up_bias, &mut sc.up, first,
                    )?;
                }
                mask(&sc.h, &mut sc.up)?;
                b.zero(&mut sc.proj)?;
                for &(first, run) in runs {
                    b.ffn_bundles_down(run, *shape, &sc.up, first, &mut sc.proj)?;
                }
                if let Some(bias) = down_bias {
                    b.add_bias(&mut sc.proj, bias)?;
                }
            }
        }
        Ok(())
    }

    /// The next token of each session, evaluated in one step (continuous batching): see
    /// [`Engine::step_many`].
    pub fn decode_many(&self, calls: &mut [(&mut Session<B>, u32)]) -> Result<Vec<Vec<f32>>> {
        let tokens: Vec<[u32; 1]> = calls.iter().map(|(_, t)| [*t]).collect();
        let mut calls: Vec<(&mut Session<B>, &[u32])> = calls
            .iter_mut()
            .zip(&tokens)
            .map(|((s, _), t)| (&mut **s, &t[..]))
            .collect();
        self.step_many(&mut calls)
    }

    /// One step over several sessions (continuous batching): each call's tokens — the next
    /// token of a sequence being decoded, or a whole prompt joining the step — are evaluated at
    /// that session's positions, over its own cache; the weights pass once for all of them.
    /// Returns each call's logits of its last token: what its tokens get alone, bit for bit on
    /// the CPU and the budgeted device. All the calls' tokens together are at most one step
    /// (`PrefillLayout::group`); a session appears once.
    pub fn step_many(&self, calls: &mut [(&mut Session<B>, &[u32])]) -> Result<Vec<Vec<f32>>> {
        if calls.is_empty() {
            return Ok(Vec::new());
        }
        for (s, toks) in calls.iter() {
            if toks.is_empty() {
                return Err(EngineError::Empty);
            }
            if s.pos + toks.len() > s.ctx {
                return Err(EngineError::ContextFull {
                    needed: s.pos + toks.len(),
                    ctx: s.ctx,
                });
            }
            if let Some(&id) = toks.iter().find(|&&t| t as usize >= self.spec.vocab_size) {
                return Err(EngineError::InvalidToken {
                    id,
                    vocab: self.spec.vocab_size,
                });
            }
        }
        if !self.prefill.joins
            && calls.len() > 1
            && let Some((_, t)) = calls.iter().find(|(_, t)| t.len() > 1)
        {
            return Err(EngineError::Weights(format!(
                "a call of {} tokens beside others in one step: this engine's plan buffers one token a call (plan several sequences for prompts to join)",
                t.len()
            )));
        }
        if let [(s, toks)] = calls
            && self.record_steps
            && toks.len() == 1
        {
            // One token of one sequence (a server with one client decoding): its own step,
            // recorded and replayed; the same logits, as a batched step gives each call what it
            // gets alone.
            return Ok(vec![self.forward(s, toks, Logits::Last)?]);
        }
        let n: usize = calls.iter().map(|(_, t)| t.len()).sum();
        if n > self.prefill.group {
            return Err(EngineError::Weights(format!(
                "{n} tokens of {} sequences in one step; the step holds {}",
                calls.len(),
                self.prefill.group
            )));
        }
        let mut want: Vec<(&mut Session<B>, usize)> = calls
            .iter_mut()
            .map(|(s, t)| {
                let rows = s.pos + t.len();
                (&mut **s, rows)
            })
            .collect();
        self.take_blocks(&mut want)?;
        let mut guard = self
            .pass
            .lock()
            .map_err(|_| EngineError::Weights("an earlier pass panicked".into()))?;
        let pass: &mut Pass<B> = &mut guard;
        self.backend.enter(|| self.batched_step(pass, calls, n))
    }

    fn batched_step(
        &self,
        pass: &mut Pass<B>,
        calls: &mut [(&mut Session<B>, &[u32])],
        n: usize,
    ) -> Result<Vec<Vec<f32>>> {
        let b = &self.backend;
        let spec = &self.spec;
        let m = calls.len();
        // Each call's first row in the step; the rows whose logits come back (each call's last).
        let firsts: Vec<usize> = calls
            .iter()
            .scan(0, |r, (_, t)| {
                let f = *r;
                *r += t.len();
                Some(f)
            })
            .collect();
        let lasts: Vec<usize> = calls
            .iter()
            .zip(&firsts)
            .map(|((_, t), f)| f + t.len() - 1)
            .collect();
        let mut sc = self.take_scratch(pass, n)?;
        if let Err(e) = self.hold_logits(&mut sc, m) {
            pass.scratch = Some(sc);
            return Err(e);
        }
        let source = &mut *pass.source;
        let joins = self.prefill.joins;
        let need = step_memory(spec, n, m, joins, self.kv_type, &source.matmuls(), |op| {
            b.workspace_bytes(op)
        });
        b.set_workspace(need.workspace)?;
        let run = (|| -> Result<Vec<f32>> {
            // Embed each call's tokens at its own positions (learned position tables differ
            // per row).
            for ((s, t), &first) in calls.iter().zip(&firsts) {
                b.reshape(&mut sc.h, t.len(), spec.d_model)?;
                source.embed(b, t, s.pos, &mut sc.h)?;
                b.copy_rows(&sc.h, 0, &mut sc.x, first, t.len())?;
            }
            b.reshape(&mut sc.h, n, spec.d_model)?;
            for l in 0..spec.n_layers {
                {
                    let mut layer = source.layer(b, l)?;
                    self.attention_inputs(&layer, &mut sc)?;
                    // All the calls' attention in one backend call where it can (each call's
                    // rows over its own caches, as alone), else call by call.
                    let together = self.attends_together(calls);
                    for ((s, t), &first) in calls.iter_mut().zip(&firsts) {
                        let (pos, k) = (s.pos, t.len());
                        let [qc, kc, vc, ac] = &mut sc.row;
                        for (buf, cols) in [
                            (&mut *qc, spec.q_dim()),
                            (&mut *kc, spec.kv_dim()),
                            (&mut *vc, spec.kv_dim()),
                            (&mut *ac, spec.q_dim()),
                        ] {
                            b.reshape(buf, k, cols)?;
                        }
                        b.copy_rows(&sc.q, first, qc, 0, k)?;
                        b.copy_rows(&sc.k, first, kc, 0, k)?;
                        b.copy_rows(&sc.v, first, vc, 0, k)?;
                        let on_cpu = self.prefill.attends_on_cpu(k);
                        self.kv_layer_begin(s, l, pos, on_cpu)?;
                        if Self::attends_on_host(s, on_cpu) {
                            self.rope_qk(qc, kc, pos)?;
                        } else {
                            self.rope_and_store(s, l, pos, (qc, kc, vc))?;
                        }
                        let ring_at = s.probe.as_ref().map_or(0, |p| p.next);
                        if let Some(p) = &mut s.probe
                            && let Some(pi) = p.layers.iter().position(|&pl| pl == l)
                        {
                            // The last queries of the call's rows go into the ring, oldest first.
                            let r = k.min(PROBE_QUERIES);
                            for j in 0..r {
                                let row = (ring_at + j) % PROBE_QUERIES;
                                b.copy_rows(qc, k - r + j, &mut p.q[pi], row, 1)?;
                            }
                        }
                        if together {
                            // The rotated queries go back to the step's rows.
                            b.copy_rows(qc, 0, &mut sc.q, first, k)?;
                            continue;
                        }
                        self.attend(s, l, pos, (qc, kc, vc), ac, on_cpu)?;
                        self.kv_layer_end(s, l, pos, k, on_cpu)?;
                        b.copy_rows(ac, 0, &mut sc.attn, first, k)?;
                    }
                    if together {
                        self.attend_together(calls, &firsts, l, &sc.q, &mut sc.attn)?;
                        for (s, t) in calls.iter_mut() {
                            self.kv_layer_end(s, l, s.pos, t.len(), false)?;
                        }
                    }
                    self.finish_layer(&mut layer, l, &mut sc)?;
                    if let Some(t) = &self.step_tap {
                        t.group_done(l, 0, n);
                    }
                }
                source.layer_done(b, l)?;
            }
            self.add_residual(&mut sc)?;
            self.head_of(source, &mut sc, &lasts)
        })();
        pass.scratch = Some(sc);
        let logits = run?;
        for (s, t) in calls.iter_mut() {
            let k = t.len();
            let next = Self::probe_commit(s, s.pos, k, s.probe.as_ref().map_or(0, |p| p.next));
            if let Some(p) = &mut s.probe {
                p.next = next;
            }
            s.pos += k;
        }
        Ok(logits.chunks(spec.vocab_size).map(|r| r.to_vec()).collect())
    }

    /// The step buffers viewed as `n` rows: the last step's where they hold that many (a
    /// step's memory is held, not reallocated, as calls of other sizes come and go: no churn, no
    /// fragments), else fresh ones (the old freed first: device memory is budgeted).
    fn take_scratch(&self, pass: &mut Pass<B>, n: usize) -> Result<Scratch<B>> {
        match pass.scratch.take() {
            Some(mut sc) if sc.cap >= n => match self.narrow(&mut sc, n) {
                Ok(()) => {
                    // A step that failed may have left its residual pending.
                    sc.residual = false;
                    Ok(sc)
                }
                Err(e) => {
                    pass.scratch = Some(sc);
                    Err(e)
                }
            },
            old => {
                drop(old);
                self.backend.set_workspace(0)?;
                self.scratch(n)
            }
        }
    }

    /// View the step buffers as `rows` rows (at most their capacity): a partitioned call's
    /// last, shorter group.
    fn narrow(&self, sc: &mut Scratch<B>, rows: usize) -> Result<()> {
        let b = &self.backend;
        let mut bufs = vec![&mut sc.x, &mut sc.h, &mut sc.q, &mut sc.k, &mut sc.v];
        bufs.extend([&mut sc.attn, &mut sc.proj, &mut sc.up]);
        if let Some(g) = sc.gate.as_mut() {
            bufs.push(g);
        }
        for t in bufs {
            let (_, cols) = b.shape(t);
            b.reshape(t, rows, cols)?;
        }
        sc.n = rows;
        Ok(())
    }

    /// Layer `l` over the rows of `sc.x` (the step's `n` rows, row `i` at position `pos + i`):
    /// attention (storing the rows' keys and values), then the FFN, each added to `sc.x`. The
    /// newest queries go into the session's probe from ring row `ring_at`, or (`None`, a
    /// recorded step's one row) into its staging row.
    #[allow(clippy::too_many_arguments)]
    fn run_layer(
        &self,
        layer: &mut LayerView<B>,
        l: usize,
        session: &mut Session<B>,
        sc: &mut Scratch<B>,
        pos: usize,
        ring_at: Option<usize>,
        on_cpu: bool,
    ) -> Result<()> {
        let b = &self.backend;
        let n = sc.n;

        // Attention block: q, k and v; q and k rotated, k and v stored (on the host for a
        // host-kept cache attended on the CPU).
        self.attention_inputs(layer, sc)?;
        if Self::attends_on_host(session, on_cpu) {
            self.rope_qk(&mut sc.q, &mut sc.k, pos)?;
        } else {
            self.rope_and_store(session, l, pos, (&mut sc.q, &mut sc.k, &sc.v))?;
        }
        if let Some(p) = &mut session.probe
            && let Some(i) = p.layers.iter().position(|&pl| pl == l)
        {
            match ring_at {
                // The last queries of these rows go into the ring, oldest first.
                Some(at) => {
                    let m = n.min(PROBE_QUERIES);
                    for r in 0..m {
                        let row = (at + r) % PROBE_QUERIES;
                        b.copy_rows(&sc.q, n - m + r, &mut p.q[i], row, 1)?;
                    }
                }
                // A recorded step's one query: to the fixed staging row.
                None => b.copy_rows(&sc.q, n - 1, &mut p.staged[i], 0, 1)?,
            }
        }
        self.attend(session, l, pos, (&sc.q, &sc.k, &sc.v), &mut sc.attn, on_cpu)?;
        self.finish_layer(layer, l, sc)
    }

    /// Attend `q` (positions `pos..`) over the session's layer `l` cache into `out`: on the
    /// device, over the keys and values [`Engine::rope_and_store`] stored, or (`on_cpu`, a
    /// host-kept cache) on the CPU over the host copy, storing `k` and `v` there first.
    fn attend(
        &self,
        s: &mut Session<B>,
        l: usize,
        pos: usize,
        (q, k, v): (&B::Tensor, &B::Tensor, &B::Tensor),
        out: &mut B::Tensor,
        on_cpu: bool,
    ) -> Result<()> {
        let b = &self.backend;
        let n = b.shape(q).0;
        if Self::attends_on_host(s, on_cpu)
            && let SessionKv::Host(h) = &mut s.kv
        {
            let spec = &self.spec;
            let (qd, kd) = (spec.q_dim(), spec.kv_dim());
            let mut qh = vec![0f32; n * qd];
            let mut kh = vec![0f32; n * kd];
            let mut vh = vec![0f32; n * kd];
            b.read(q, &mut qh)?;
            b.read(k, &mut kh)?;
            b.read(v, &mut vh)?;
            let rb = h.row_bytes;
            let rows = pos * rb..(pos + n) * rb;
            h.k[l].bytes_mut()[rows.clone()].copy_from_slice(&crate::backend::cpu::encode_rows(
                self.kv_type,
                &kh,
                kd,
            ));
            h.v[l].bytes_mut()[rows].copy_from_slice(&crate::backend::cpu::encode_rows(
                self.kv_type,
                &vh,
                kd,
            ));
            let mut o = vec![0f32; n * qd];
            crate::backend::cpu::attend_rows(
                self.kv_type,
                (h.k[l].bytes(), h.v[l].bytes()),
                &qh,
                pos,
                self.attn_shape(),
                &mut o,
            );
            b.write(out, &o)?;
            return Ok(());
        }
        let shape = self.attn_shape();
        match &s.kv {
            SessionKv::Paged(p) => {
                let pool = lock_pool(&p.pool);
                b.attention(q, &pool.k[l], &pool.v[l], Some(&p.table), pos, shape, out)?;
            }
            SessionKv::Device { k: kc, v: vc } => {
                b.attention(q, &kc[l], &vc[l], None, pos, shape, out)?;
            }
            SessionKv::Host(h) => {
                b.attention(q, &h.work_k, &h.work_v, None, pos, shape, out)?;
            }
        }
        Ok(())
    }

    /// Whether a step's attention runs on the CPU over a host-kept cache (`on_cpu`, the
    /// prefill layout's choice, where the session keeps its cache on the host).
    fn attends_on_host(s: &Session<B>, on_cpu: bool) -> bool {
        on_cpu && matches!(s.kv, SessionKv::Host(_))
    }

    /// Rotate a step's queries and keys (rows from position `pos`, where the model rotates) and
    /// store the keys and values in the session's layer `l` cache (a host-kept session: in its
    /// work buffers, which hold the layer from `kv_layer_begin`): one op (one kernel on CUDA for
    /// f32 and f16 caches).
    fn rope_and_store(
        &self,
        s: &mut Session<B>,
        l: usize,
        pos: usize,
        (q, k, v): (&mut B::Tensor, &mut B::Tensor, &B::Tensor),
    ) -> Result<()> {
        let b = &self.backend;
        let rope = self.rope_args();
        let store = |caches: (&mut B::Kv, &mut B::Kv), table: Option<&B::KvTable>| match rope {
            Some(r) => b.rope_store_kv((q, k, v), caches, table, pos, r),
            None => b.store_kv_pair((k, v), caches, table, pos),
        };
        match &mut s.kv {
            SessionKv::Paged(p) => {
                self.sync_table(p)?;
                let mut pool = lock_pool(&p.pool);
                let pool = &mut *pool;
                store((&mut pool.k[l], &mut pool.v[l]), Some(&p.table))?;
            }
            SessionKv::Device { k: kc, v: vc } => store((&mut kc[l], &mut vc[l]), None)?,
            SessionKv::Host(h) => store((&mut h.work_k, &mut h.work_v), None)?,
        }
        Ok(())
    }

    /// Whether a step's calls attend in one backend call: the backend can, none attends on the
    /// CPU beside the device, and their paged caches are this engine's pool (locked once).
    fn attends_together(&self, calls: &[(&mut Session<B>, &[u32])]) -> bool {
        self.backend.attends_batches()
            && calls.iter().all(|(s, t)| match &s.kv {
                SessionKv::Device { .. } => true,
                SessionKv::Host(_) => !self.prefill.attends_on_cpu(t.len()),
                SessionKv::Paged(p) => self.pool.as_ref().is_some_and(|e| Arc::ptr_eq(e, &p.pool)),
            })
    }

    /// Layer `l`'s attention of every call's rows of `q` (call `i`'s from `firsts[i]`, already
    /// rotated, its keys and values stored) into the same rows of `out`, in one backend call.
    fn attend_together(
        &self,
        calls: &[(&mut Session<B>, &[u32])],
        firsts: &[usize],
        l: usize,
        q: &B::Tensor,
        out: &mut B::Tensor,
    ) -> Result<()> {
        let paged = calls
            .iter()
            .any(|(s, _)| matches!(s.kv, SessionKv::Paged(_)));
        let pool = self.pool.as_ref().filter(|_| paged).map(lock_pool);
        let mut seqs = Vec::with_capacity(calls.len());
        for ((s, t), &first_row) in calls.iter().zip(firsts) {
            let (k, v, table) = match &s.kv {
                SessionKv::Device { k, v } => (&k[l], &v[l], None),
                SessionKv::Host(h) => (&h.work_k, &h.work_v, None),
                SessionKv::Paged(p) => {
                    let pool = pool.as_ref().ok_or_else(|| {
                        EngineError::Weights("a paged session without the engine's pool".into())
                    })?;
                    (&pool.k[l], &pool.v[l], Some(&p.table))
                }
            };
            seqs.push(AttnSeq {
                first_row,
                rows: t.len(),
                first_pos: s.pos,
                k,
                v,
                table,
            });
        }
        self.backend
            .attention_batch(q, &seqs, self.attn_shape(), out)?;
        Ok(())
    }

    /// The attention shape of every layer.
    fn attn_shape(&self) -> AttnShape {
        let spec = &self.spec;
        AttnShape {
            n_heads: spec.n_heads,
            n_kv_heads: spec.n_kv_heads,
            head_dim: spec.head_dim,
            scale: spec.attn_scale,
        }
    }

    /// The rest of layer `l` once `sc.attn` holds the attention output: the output projection
    /// added to `sc.x`, then the FFN, left in `sc.proj` for the next layer's norm to add
    /// (`sc.residual`).
    fn finish_layer(&self, layer: &mut LayerView<B>, l: usize, sc: &mut Scratch<B>) -> Result<()> {
        let device_ffn = layer.unit.is_none() && layer.cold.is_none();
        match self.whole_gated_ffn(&layer.ffn, !device_ffn) {
            // One op from the residual add to the FFN's output, so the norm's rows can go
            // straight into the products' input: the attention's projection goes to `sc.h` (free
            // once q, k and v are made) for the norm to add, and `sc.attn` (read by then) is the
            // norm's own scratch, where the backend writes its rows out.
            Some(ws) if self.spec.q_dim() == self.spec.d_model => {
                self.linear(&layer.wo, &sc.attn, &mut sc.h)?;
                let threshold = self.thresholds.get(l).copied().unwrap_or(0.0);
                let gate = sc.gate.as_mut().ok_or_else(|| {
                    EngineError::Weights("a gated FFN without its gate buffer".into())
                })?;
                let input =
                    self.norm_input(&mut sc.x, Some(&sc.h), &layer.ffn_norm, &mut sc.attn)?;
                let how = (self.act, threshold);
                self.backend
                    .gate_up_down(input, ws, how, (gate, &mut sc.up), &mut sc.proj)?;
            }
            _ => {
                self.linear(&layer.wo, &sc.attn, &mut sc.proj)?;
                // The residual add, and the feed-forward block's norm.
                self.add_norm(&mut sc.x, &sc.proj, &layer.ffn_norm, &mut sc.h)?;
                match layer.unit.as_deref_mut() {
                    Some(unit) => self.unit_ffn(l, &layer.ffn, unit, sc)?,
                    None => self.ffn(l, &layer.ffn, layer.cold.as_mut(), sc)?,
                }
            }
        }
        sc.residual = true;
        Ok(())
    }

    /// Add the last layer's residual to `sc.x` if it is pending: before anything but the next
    /// layer reads `sc.x`.
    fn add_residual(&self, sc: &mut Scratch<B>) -> Result<()> {
        if std::mem::take(&mut sc.residual) {
            self.backend.add(&mut sc.x, &sc.proj)?;
        }
        Ok(())
    }

    /// Record in the probe the positions of the newest queries of `n` rows from `pos` written
    /// from ring row `ring_at`; the ring row after them.
    fn probe_commit(session: &mut Session<B>, pos: usize, n: usize, ring_at: usize) -> usize {
        let m = n.min(PROBE_QUERIES);
        if let Some(p) = &mut session.probe {
            for r in 0..m {
                p.positions[(ring_at + r) % PROBE_QUERIES] = pos + n - m + r;
            }
        }
        (ring_at + m) % PROBE_QUERIES
    }

    /// Hold the logits buffers of a call returning up to `rows` rows at a time from its start,
    /// so a step holds all its memory while its layers run.
    fn hold_logits(&self, sc: &mut Scratch<B>, rows: usize) -> Result<()> {
        match sc.logits.take() {
            // Held buffers serve any call returning as many rows or fewer (the plan counts
            // them).
            Some(lb) if lb.rows >= rows => sc.logits = Some(lb),
            old => {
                drop(old);
                if rows > 0 {
                    sc.logits = Some(self.logit_buffers(rows)?);
                }
            }
        }
        Ok(())
    }

    /// View the logits buffers as `rows` rows (at most those they hold).
    fn view_logits(&self, lb: &mut LogitBuffers<B>, rows: usize) -> Result<()> {
        let b = &self.backend;
        let d = self.spec.d_model;
        b.reshape(&mut lb.last, rows, d)?;
        b.reshape(&mut lb.normed, rows, d)?;
        b.reshape(&mut lb.logits, rows, self.spec.vocab_size)?;
        Ok(())
    }

    /// The head over the last `rows` rows of `x` (`n` rows; at most the held logits rows):
    /// their logits on the host.
    fn head_rows(
        &self,
        source: &mut dyn WeightSource<B>,
        sc: &mut Scratch<B>,
        rows: usize,
    ) -> Result<Vec<f32>> {
        let last: Vec<usize> = (sc.n - rows..sc.n).collect();
        self.head_of(source, sc, &last)
    }

    /// The head over rows `rows` of `x`, in that order: their logits on the host.
    fn head_of(
        &self,
        source: &mut dyn WeightSource<B>,
        sc: &mut Scratch<B>,
        rows: &[usize],
    ) -> Result<Vec<f32>> {
        if !matches!(&sc.logits, Some(lb) if lb.rows >= rows.len()) {
            sc.logits = None;
            sc.logits = Some(self.logit_buffers(rows.len())?);
        }
        self.head_ops(source, sc, rows)?;
        self.head_read(sc, rows.len())
    }

    /// The head's ops over rows `rows` of `x`, into the held logits buffers (holding that
    /// many rows), which are left viewed as their full size.
    fn head_ops(
        &self,
        source: &mut dyn WeightSource<B>,
        sc: &mut Scratch<B>,
        rows: &[usize],
    ) -> Result<()> {
        let b = &self.backend;
        let m = rows.len();
        let mut lb = match sc.logits.take() {
            Some(lb) if lb.rows >= m => lb,
            _ => {
                return Err(EngineError::Weights(format!(
                    "the head over {m} rows without logits buffers for them"
                )));
            }
        };
        self.view_logits(&mut lb, m)?;
        // Runs of consecutive rows, one copy each.
        let mut i = 0;
        while i < m {
            let mut j = i + 1;
            while j < m && rows[j] == rows[j - 1] + 1 {
                j += 1;
            }
            b.copy_rows(&sc.x, rows[i], &mut lb.last, i, j - i)?;
            i = j;
        }
        {
            let head = source.head(b)?;
            self.norm(&lb.last, &head.norm, &mut lb.normed)?;
            self.linear(&head.output, &lb.normed, &mut lb.logits)?;
        }
        source.head_done(b)?;
        let full = lb.rows;
        self.view_logits(&mut lb, full)?;
        sc.logits = Some(lb);
        Ok(())
    }

    /// The first `m` rows of the logits [`Engine::head_ops`] left, on the host.
    fn head_read(&self, sc: &mut Scratch<B>, m: usize) -> Result<Vec<f32>> {
        let lb = sc
            .logits
            .as_mut()
            .ok_or_else(|| EngineError::Weights("logits read without their buffers".into()))?;
        self.view_logits(lb, m)?;
        let mut host = vec![0f32; m * self.spec.vocab_size];
        let read = self.backend.read(&lb.logits, &mut host);
        let full = lb.rows;
        self.view_logits(lb, full)?;
        read?;
        Ok(host)
    }

    /// Whether this step of `session` (`n` rows, `rows` of logits) is recorded or replayed: a
    /// one-token decode step of kernels only (see [`Engine::with_recorded_steps`]).
    fn records(
        &self,
        session: &Session<B>,
        source: &dyn WeightSource<B>,
        n: usize,
        rows: usize,
        on_cpu: bool,
    ) -> bool {
        self.record_steps
            && self.backend.records_steps()
            && n == 1
            && rows == 1
            && !on_cpu
            && !matches!(session.recorded, Recorded::Refused)
            && matches!(session.kv, SessionKv::Device { .. } | SessionKv::Paged(_))
            && self.step_tap.is_none()
            && self.tap.is_none()
            && self.predictor.is_none()
            && source.fixed()
    }

    /// A one-token decode step through its recording: replayed where one is held and no
    /// allocation has been taken since; else recorded where a plain step ran last with none
    /// after it; else run plainly. The step buffers are held (`sc`, its logits and workspace
    /// set) before this. The token is embedded before the recorded ops (its id, or its row,
    /// comes from the host), and the position goes to the device as the step's.
    fn recorded_step(
        &self,
        source: &mut dyn WeightSource<B>,
        session: &mut Session<B>,
        sc: &mut Scratch<B>,
        tokens: &[u32],
    ) -> Result<Vec<f32>> {
        use std::sync::atomic::Ordering;
        let b = &self.backend;
        let pos = session.pos;
        if let SessionKv::Paged(p) = &mut session.kv {
            self.sync_table(p)?;
        }
        source.embed(b, tokens, pos, &mut sc.x)?;
        // The position's device word is taken on first use (outside the plan: a budget with no
        // room left for it runs its steps plainly).
        let placed = b.set_step_position(pos);
        let now = b.allocations();
        let mut ops = |session: &mut Session<B>| -> Result<()> {
            // From the embedding: a recording that failed ran nothing on CUDA.
            sc.residual = false;
            for l in 0..self.spec.n_layers {
                {
                    let mut layer = source.layer(b, l)?;
                    self.run_layer(&mut layer, l, session, sc, pos, None, false)?;
                }
                source.layer_done(b, l)?;
            }
            self.add_residual(sc)?;
            self.head_ops(source, sc, &[sc.n - 1])
        };
        let held = std::mem::replace(&mut session.recorded, Recorded::None);
        session.recorded = match (placed, held) {
            (Ok(()), Recorded::Held(rec, at)) if at == now => {
                b.replay(&rec, || ops(session))?;
                self.steps_replayed.fetch_add(1, Ordering::Relaxed);
                Recorded::Held(rec, at)
            }
            (Ok(()), Recorded::Ran(at)) if at == now => match b.record(|| ops(session)) {
                Ok(rec) => {
                    self.steps_recorded.fetch_add(1, Ordering::Relaxed);
                    Recorded::Held(rec, now)
                }
                Err(e) => {
                    // Nothing of a failed recording has run on CUDA; a budgeted device may have
                    // run part of it, which the plain step rewrites (the same rows).
                    tracing::info!("decode steps run unrecorded: {e}");
                    ops(session)?;
                    Recorded::Refused
                }
            },
            (Err(e), _) => {
                tracing::info!("decode steps run unrecorded: {e}");
                ops(session)?;
                Recorded::Refused
            }
            (Ok(()), _) => {
                ops(session)?;
                Recorded::Ran(b.allocations())
            }
        };
        // The staged queries into the ring, as a plain step would have put them there.
        if let Some(p) = &mut session.probe {
            let at = p.next;
            for (staged, ring) in p.staged.iter().zip(p.q.iter_mut()) {
                b.copy_rows(staged, 0, ring, at, 1)?;
            }
            let next = Self::probe_commit(session, pos, 1, at);
            if let Some(p) = &mut session.probe {
                p.next = next;
            }
        }
        session.pos += 1;
        self.head_read(sc, 1)
    }

    /// One forward step: every layer once over all of `tokens` (at most a group).
    fn step(
        &self,
        pass: &mut Pass<B>,
        session: &mut Session<B>,
        tokens: &[u32],
        logits: Logits,
    ) -> Result<Vec<f32>> {
        let n = tokens.len();
        let b = &self.backend;
        let spec = &self.spec;
        let pos = session.pos;
        let rows = logits.rows(n);
        let mut sc = self.take_scratch(pass, n)?;
        self.hold_logits(&mut sc, rows)?;
        let source = &mut *pass.source;
        // The workspace the ops of this step need, by the formula the planner used.
        let joins = self.prefill.joins;
        let need = step_memory(
            spec,
            n,
            rows,
            joins,
            self.kv_type,
            &source.matmuls(),
            |op| b.workspace_bytes(op),
        );
        b.set_workspace(need.workspace)?;

        let on_cpu = self.prefill.attends_on_cpu(n);
        if self.records(session, &*source, n, rows, on_cpu) {
            let out = self.recorded_step(source, session, &mut sc, tokens);
            pass.scratch = Some(sc);
            return out;
        }
        source.embed(b, tokens, pos, &mut sc.x)?;
        let ring_at = session.probe.as_ref().map_or(0, |p| p.next);
        for l in 0..spec.n_layers {
            {
                let mut layer = source.layer(b, l)?;
                self.kv_layer_begin(session, l, pos, on_cpu)?;
                self.run_layer(&mut layer, l, session, &mut sc, pos, Some(ring_at), on_cpu)?;
                self.kv_layer_end(session, l, pos, n, on_cpu)?;
                if let Some(t) = &self.step_tap {
                    t.group_done(l, 0, n);
                }
            }
            source.layer_done(b, l)?;
        }
        self.add_residual(&mut sc)?;
        let next = Self::probe_commit(session, pos, n, ring_at);
        if let Some(p) = &mut session.probe {
            p.next = next;
        }
        session.pos += n;

        let out = if rows == 0 {
            Ok(Vec::new())
        } else {
            self.head_rows(source, &mut sc, rows)
        };
        pass.scratch = Some(sc);
        out
    }

    /// A call longer than a group, layer by layer (see [`PrefillLayout`]): each layer's weights
    /// once, over the call's rows in groups; the hidden states between layers on the device or
    /// in host memory. The same rows, positions and ops as one step over all of them.
    fn layer_major(
        &self,
        pass: &mut Pass<B>,
        session: &mut Session<B>,
        tokens: &[u32],
        logits: Logits,
    ) -> Result<Vec<f32>> {
        let b = &self.backend;
        let spec = &self.spec;
        let (total, d) = (tokens.len(), spec.d_model);
        let group = self.prefill.group;
        let pos = session.pos;
        // Every row's logits come a group at a time.
        let rows = logits.rows(group);
        let mut sc = self.take_scratch(pass, group)?;
        if let Err(e) = self.hold_logits(&mut sc, rows) {
            pass.scratch = Some(sc);
            return Err(e);
        }
        let source = &mut *pass.source;
        let need = step_memory(
            spec,
            group,
            rows,
            self.prefill.joins,
            self.kv_type,
            &source.matmuls(),
            |op| b.workspace_bytes(op),
        );
        b.set_workspace(need.workspace)?;
        let mut hidden = if self.prefill.residual_on_device(total) {
            Hidden::Device(b.alloc(total, d)?)
        } else {
            Hidden::Host(HostStage::new(b, total * d)?)
        };
        let groups: Vec<(usize, usize)> = (0..total)
            .step_by(group)
            .map(|a| (a, group.min(total - a)))
            .collect();
        // The probe ring row each group's queries start at: as if each group were a step.
        let mut ring = Vec::with_capacity(groups.len());
        let mut at = session.probe.as_ref().map_or(0, |p| p.next);
        for &(a, len) in &groups {
            ring.push(at);
            at = Self::probe_commit(session, pos + a, len, at);
        }
        let run = (|| -> Result<Vec<f32>> {
            for &(a, len) in &groups {
                self.narrow(&mut sc, len)?;
                source.embed(b, &tokens[a..a + len], pos + a, &mut sc.x)?;
                hidden.put(b, &sc.x, a)?;
            }
            for l in 0..spec.n_layers {
                {
                    let mut layer = source.layer(b, l)?;
                    // A partitioned call is a prefill: its groups attend on the device.
                    self.kv_layer_begin(session, l, pos, false)?;
                    for (&(a, len), &ring_at) in groups.iter().zip(&ring) {
                        self.narrow(&mut sc, len)?;
                        hidden.get(b, a, &mut sc.x)?;
                        self.run_layer(
                            &mut layer,
                            l,
                            session,
                            &mut sc,
                            pos + a,
                            Some(ring_at),
                            false,
                        )?;
                        self.add_residual(&mut sc)?;
                        hidden.put(b, &sc.x, a)?;
                        if let Some(t) = &self.step_tap {
                            t.group_done(l, a, len);
                        }
                    }
                    self.kv_layer_end(session, l, pos, total, false)?;
                }
                source.layer_done(b, l)?;
            }
            let mut out = Vec::new();
            match logits {
                Logits::None => {}
                // The last group's rows are still in `sc.x`.
                Logits::Last => out = self.head_rows(source, &mut sc, 1)?,
                Logits::All => {
                    for &(a, len) in &groups {
                        self.narrow(&mut sc, len)?;
                        hidden.get(b, a, &mut sc.x)?;
                        out.extend(self.head_rows(source, &mut sc, len)?);
                    }
                }
            }
            Ok(out)
        })();
        // The buffers go back at their full size whatever happened.
        let narrowed = self.narrow(&mut sc, group);
        pass.scratch = Some(sc);
        let out = run?;
        narrowed?;
        if let Some(p) = &mut session.probe {
            p.next = at;
        }
        session.pos += total;
        Ok(out)
    }
}

/// The hidden states of a partitioned call between layers: `rows × d_model` f32.
enum Hidden<B: Backend> {
    Device(B::Tensor),
    Host(HostStage),
}

impl<B: Backend> Hidden<B> {
    /// Rows `first..first + rows of x` from `x`.
    fn put(&mut self, b: &B, x: &B::Tensor, first: usize) -> Result<()> {
        let (rows, d) = b.shape(x);
        match self {
            Hidden::Device(t) => b.copy_rows(x, 0, t, first, rows)?,
            Hidden::Host(h) => b.read(x, &mut h.values_mut()[first * d..(first + rows) * d])?,
        }
        Ok(())
    }

    /// Rows `first..first + rows of x` into `x`.
    fn get(&self, b: &B, first: usize, x: &mut B::Tensor) -> Result<()> {
        let (rows, d) = b.shape(x);
        match self {
            Hidden::Device(t) => b.copy_rows(t, first, x, 0, rows)?,
            Hidden::Host(h) => b.write(x, &h.values()[first * d..(first + rows) * d])?,
        }
        Ok(())
    }
}
