//! The engine's ports: the traits other rooms implement for it (weight sources, cache units, cold
//! neurons, predictors, taps) and the views of one layer's weights a pass computes with. Shapes
//! and contracts only: no pass logic here, and nothing here knows the `Engine`.

use super::error::Result;
use crate::backend::{Backend, BundleShape};
use crate::footprint::MatmulShapes;

/// Told when a layer has run over a group of rows (`first..first + rows` of the call), while
/// every buffer of that step is still held: what the budgeted device's per-step peak is
/// measured by.
pub trait StepTap: Send + Sync {
    fn group_done(&self, layer: usize, first: usize, rows: usize);
}

/// Shown each mixture-of-experts layer's routes as steps choose them (tests; the routing
/// profile).
pub trait RouteTap: Send + Sync {
    /// The `rows` rows of a step through layer `layer` take `routes` (tokens counted from the
    /// step's first row).
    fn routed(&self, layer: usize, rows: usize, routes: &[crate::backend::Route]);
    /// Layer `layer`'s routes for the step's `rows` rows as guessed from the previous layer's
    /// FFN input (an offloaded run's next-layer prefetch), before the layer runs.
    fn guessed(&self, _layer: usize, _rows: usize, _routes: &[crate::backend::Route]) {}
    /// Whether the tap wants each MoE layer's FFN input ([`RouteTap::ffn_input`]).
    fn wants_ffn_input(&self) -> bool {
        false
    }
    /// The FFN input (the normed rows the router reads, `rows × d_model`) of layer `layer`.
    fn ffn_input(&self, _layer: usize, _rows: usize, _x: &[f32]) {}
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
    /// The per-head norms of q and of k before the rotation (Qwen3).
    pub qk_norm: Option<[&'a B::Weight; 2]>,
    pub ffn_norm: NormView<'a, B>,
    /// A mixture-of-experts layer's router: `ffn` then holds its experts side by side.
    pub router: Option<&'a B::Weight>,
    /// The FFN on the device: all of it, or in hybrid execution only the hot neurons (their
    /// hidden activations in columns `0..hot.len()`).
    pub ffn: FfnView<'a, B>,
    /// Hybrid execution: the neurons the CPU computes, and how they merge.
    pub cold: Option<ColdView<'a, B>>,
    /// The GPU-centric sparse FFN: a cache unit the neurons each step needs are brought into
    /// (`ffn` then gives only the down bias).
    pub unit: Option<Box<dyn NeuronUnit<B> + 'a>>,
    /// A mixture-of-experts layer whose routed experts are not all on the device: its unit of
    /// expert slots and the CPU's share (`ffn` is then not read).
    pub experts: Option<ExpertsView<'a, B>>,
}

/// A mixture-of-experts layer's routed experts, offloaded: a unit of expert slots on the device
/// (the shared expert's parts pinned in it), the other experts computed by the CPU from DRAM.
pub trait ExpertCache<B: Backend>: Send {
    /// Of a step's `routes` (expert ids as the router numbers them, the shared expert's parts
    /// after the routed ones), those the device computes, renumbered to their slots in
    /// [`ExpertCache::unit`] (the device waits here for copies still going into it), and those
    /// the CPU computes.
    fn split(
        &mut self,
        b: &B,
        routes: &[crate::backend::Route],
    ) -> Result<(Vec<crate::backend::Route>, Vec<crate::backend::Route>)>;
    /// The unit's slots as a stack of experts, where it has any.
    fn unit(&self) -> Option<crate::backend::Experts<'_, B::Weight>>;
    /// `out` (`n × d_model`) = the experts' FFN output of `routes` for the rows `x`, on the CPU.
    fn cpu_ffn(
        &mut self,
        x: &[f32],
        n: usize,
        routes: &[crate::backend::Route],
        out: &mut [f32],
    ) -> Result<()>;
    /// The next layer's experts guessed from this layer's FFN input `x` (`n` rows, on the host),
    /// and copies queued of those the next layer's unit lacks, as its copy budget allows
    /// (next-layer prefetch); the guessed routes, or `None` where nothing is guessed (prefetch
    /// off, the last layer, a step too large to guess for).
    fn prefetch(
        &mut self,
        b: &B,
        x: &[f32],
        n: usize,
    ) -> Result<Option<Vec<crate::backend::Route>>>;
    /// Mixed precision: of `rest` (the routes the unit lacks), those that are not their token's
    /// most weighted routed expert in `routes` are copied in low-bit and computed on the device
    /// from the step's FFN input `x` with `act` (the device waits for the copies); their sum, for
    /// the merge, or `None` where none goes (no low-bit copies, a step too large); `rest` keeps
    /// the others.
    fn low_bit(
        &mut self,
        b: &B,
        routes: &[crate::backend::Route],
        rest: &mut Vec<crate::backend::Route>,
        x: &B::Tensor,
        act: crate::backend::Act,
    ) -> Result<Option<&B::Tensor>>;
    /// After the step's compute is queued: take in what the policy admits of the step's missed
    /// experts, the copies queued behind that compute (never waited for here).
    fn admit(&mut self, b: &B, routes: &[crate::backend::Route]) -> Result<()>;
    /// Whether a step of `n` rows brings the experts the unit lacks through the stream area
    /// for the device to compute (a prompt's), rather than the CPU computing them.
    fn streams(&self, n: usize) -> bool;
    /// Bring the experts of `routes` (routed ids) into the stream area, the device waiting for
    /// them: the area as a stack of every routed expert, the routes' ids as they are.
    fn stream_in(
        &mut self,
        b: &B,
        routes: &[crate::backend::Route],
    ) -> Result<crate::backend::Experts<'_, B::Weight>>;
}

/// The offloaded experts of one layer, and where the CPU's partial sum comes back.
pub struct ExpertsView<'a, B: Backend> {
    pub cache: Box<dyn ExpertCache<B> + 'a>,
    /// Device buffer the CPU's partial sum is copied into (room for the step's `n × d_model`).
    pub partial: &'a mut B::Tensor,
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
    /// Every neuron of tier `tier` where it rests in host memory, mapped for the device to
    /// read in place (row = neuron id): where there is one, the unit computes the neurons it
    /// does not hold there ([`NeuronUnit::hold`]) instead of bringing them in.
    fn in_place(&self, tier: usize) -> Option<&B::Weight>;
    /// Of `neurons` (distinct), bring into tier `tier`'s region the ones it lacks that it
    /// has free slots for (the most valued first); then where each is, in the same order: its
    /// slot, or, one the region does not hold, its id with [`crate::backend::IN_REST`] set
    /// (a row of [`NeuronUnit::in_place`]).
    fn hold(&mut self, b: &B, tier: usize, neurons: &[u32]) -> Result<Vec<u32>>;
}

/// The FFN neurons of a layer the CPU computes from DRAM (PowerInfer's cold neurons), in two
/// steps so that the sum the second adds to may arrive between them (the split's: the
/// device's partial sum, which the CPU's terms continue).
pub trait ColdNeurons: Send + Sync {
    /// Which of this layer's cold neurons the `n` input rows `x` activate, and their
    /// activations. A neuron the mask leaves out (`threshold`, as
    /// [`crate::backend::sparse_act`]) or `keep` does not list (`n × d_ff` flags by neuron id,
    /// from a predictor) is not active, and the parts it would need beyond the one that decides
    /// are not read.
    fn activate(
        &self,
        x: &[f32],
        n: usize,
        threshold: f32,
        keep: Option<&[bool]>,
    ) -> Result<ColdActive>;
    /// Add to `out` (`n × d_model`) the down products of `active`, each token's terms after
    /// what `out` holds, in the one order of blocks of ids (`backend::cpu::sparse::DOWN_BLOCK`).
    fn add_down(&self, active: &ColdActive, n: usize, out: &mut [f32]) -> Result<()>;
    /// [`ColdNeurons::activate`] and [`ColdNeurons::add_down`] of what it activates, where the
    /// sum need not wait: over bundles, in one pass that reads an active neuron's bundle in
    /// one run (the same bits as the two steps).
    fn activate_down(
        &self,
        x: &[f32],
        n: usize,
        threshold: f32,
        keep: Option<&[bool]>,
        out: &mut [f32],
    ) -> Result<ColdActive>;
}

/// The cold neurons a step activates ([`ColdNeurons::activate`]).
pub struct ColdActive {
    /// Their positions among the neurons the layer holds, ascending.
    pub positions: Vec<u32>,
    /// Their activations, `n × positions.len()`.
    pub values: Vec<f32>,
}

/// The CPU's share of a hybrid layer.
pub struct ColdView<'a, B: Backend> {
    pub neurons: &'a dyn ColdNeurons,
    /// Ids of the hot neurons, in the order of the device FFN's hidden columns.
    pub hot: &'a [u32],
    /// How the CPU's sum joins the device's.
    pub merge: ColdMerge<'a, B>,
}

/// How the CPU's share of a layer's FFN joins the device's.
pub enum ColdMerge<'a, B: Backend> {
    /// The CPU's partial sum is copied into this device buffer (room for the step's
    /// `n × d_model`) and added to the device's: hybrid, whose hot and cold neurons interleave.
    Add(&'a mut B::Tensor),
    /// Every CPU neuron follows every device neuron in the down sum's order (the split: the
    /// device's first rows, the CPU's last ones, from a block boundary), so the CPU's terms
    /// continue the device's sum landed on the host and the result goes back in its place: the
    /// sum where the device holds the whole FFN (bit for bit on the budgeted device, whose sums
    /// go in one order: `backend::cpu::sparse::DOWN_BLOCK`), and no merge buffer.
    Continue,
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
    /// Bytes of layer `layer`'s weights the host reads per call (what the trace and the plan
    /// count as the CPU's); none for a predictor without weights of its own.
    fn weight_bytes(&self, _layer: usize) -> u64 {
        0
    }
}
