//! A forward pass, written once against [`Backend`]: sessions holding a KV cache, batched
//! prefill and single-token decode, sampling, generation. Where each weight lives is a
//! [`WeightSource`]'s business: all resident ([`resident::ResidentWeights`]) or streamed through
//! the tiers (`tier`); the pass asks it for one layer at a time. Knows nothing about HTTP or files.
//!
//! Where things are: `mod.rs` holds the [`Engine`] (its constructor and builders);
//! - below it, what it holds and what other rooms implement: `error`, `ports` (the traits and
//!   views), `kv_pool` (the paged pool's blocks), `scratch` (a step's buffers);
//! - sessions: `session` (a sequence's state, its blocks), `kv_rows` (its cache rows read and
//!   written), `probe` (the attention density of its context);
//! - a layer: `ops` (norms, linears), `attention`, `ffn` (where the FFN runs; the device's part),
//!   `ffn_hybrid`, `ffn_unit`, `activations` (the tap, the predictor's masks);
//! - a pass: `step` (one session's step, the layer, the step's memory), `head`, `batch` (several
//!   sessions in one step), `recorded` (recorded decode steps), `prefill` (layer-major calls);
//! - on top: `generate`, `perplexity`, `sampler`; `resident` (all weights on the device),
//!   `traffic` (what a decode step reads), `trace` (where a step's time goes, phase by phase).

mod activations;
mod attention;
mod batch;
mod error;
mod ffn;
mod ffn_hybrid;
mod ffn_unit;
pub mod generate;
mod head;
mod kv_pool;
mod kv_rows;
pub mod moe;
mod ops;
pub mod perplexity;
mod ports;
mod prefill;
mod probe;
mod recorded;
pub mod resident;
pub mod sampler;
mod scratch;
mod session;
mod step;
#[cfg(test)]
mod testing;
pub mod trace;
mod traffic;

use std::sync::{Arc, Mutex};

use self::kv_pool::{KvPool, SharedPool, lock_pool};
use self::scratch::Pass;
use crate::backend::{Act, Backend, BackendError, KV_BLOCK, KvType, RopePairs};
use crate::footprint::{MAX_BATCH, PrefillLayout};
use crate::model::{Activation, Arch, ModelSpec, ModelWeights, PositionEncoding, RopeStyle};
use crate::tensor::HostTensor;

pub use error::{EngineError, NonFiniteAt, Result};
pub use generate::{GenerateParams, Generation, StopReason, Timings, generate};
pub use kv_pool::PoolUsage;
pub use ports::{
    ActivationTap, ColdActive, ColdMerge, ColdNeurons, ColdView, ExpertCache, ExpertsView, FfnView,
    HeadView, LayerView, LinearView, NeuronPredictor, NeuronUnit, NormView, RouteTap, StepTap,
    TierSet, WeightSource,
};
pub use probe::{DENSITY_READ_BYTES, DENSITY_READ_ROWS};
pub use resident::ResidentWeights;
pub use sampler::{Penalties, Sampled, Sampler, SamplerParams};
pub use session::Session;
pub use step::Logits;
pub use traffic::DecodeTraffic;

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
    /// Where mixture-of-experts layers show their routes ([`Engine::with_route_tap`]).
    route_tap: Option<Arc<dyn RouteTap>>,
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
                trace: None,
                check_layers: false,
            }),
            rope,
            kv_type: KvType::F32,
            thresholds: Vec::new(),
            tap: None,
            predictor: None,
            prefill: PrefillLayout::default(),
            step_tap: None,
            route_tap: None,
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

    /// Show `tap` the experts every mixture-of-experts layer routes each step's rows to.
    pub fn with_route_tap(mut self, tap: Arc<dyn RouteTap>) -> Self {
        self.route_tap = Some(tap);
        self
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

    /// Record the phases of every step from now on in `trace` (none: stop recording).
    pub fn set_trace(&self, trace: Option<Arc<trace::StepTrace>>) -> Result<()> {
        let mut pass = self
            .pass
            .lock()
            .map_err(|_| EngineError::Weights("an earlier pass panicked".into()))?;
        pass.trace = trace;
        Ok(())
    }

    /// The recorder steps report their phases to, if any.
    pub fn trace(&self) -> Option<Arc<trace::StepTrace>> {
        self.pass.lock().ok().and_then(|p| p.trace.clone())
    }

    /// Wait for the weight source's background transfers to finish (before reading counters).
    pub fn settle(&self) {
        if let Ok(mut p) = self.pass.lock() {
            p.source.settle();
        }
    }
}
