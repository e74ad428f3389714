//! The values ops take beside their buffers: the activation an FFN applies (and the sparsity
//! mask on it), the rotary embedding's pairing, attention's geometry and a batch's sequences, and
//! one weight of a multi-weight product. Plain data, the same for every backend.

use super::Backend;

/// Element-wise nonlinearities.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Act {
    Silu,
    Relu,
    Gelu,
    GeluTanh,
}

/// Which RoPE pairing a rotation uses (see `model::RopeStyle`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopePairs {
    Adjacent,
    Halves,
}

/// The FFN sparsity mask on one activation value `a = act(·)` (CATS): a neuron whose activation
/// magnitude is at most `threshold` contributes nothing. `threshold ≤ 0` is the dense FFN, bit
/// for bit (no mask is applied at all); for ReLU-family activations threshold 0 already is the
/// exact active set (`a > 0`).
#[inline]
pub fn sparse_act(a: f32, threshold: f32) -> f32 {
    if threshold > 0.0 && a.abs() <= threshold {
        0.0
    } else {
        a
    }
}

/// A model's rotary embedding as the ops take it: heads of `head_dim`, the first `rot_dims` of
/// each rotated by `inv_freq` (`rot_dims / 2` values), `pairs` paired.
#[derive(Clone, Copy)]
pub struct Rope<'a, W> {
    pub head_dim: usize,
    pub rot_dims: usize,
    pub pairs: RopePairs,
    pub inv_freq: &'a W,
}

/// Geometry of one attention call.
#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
}

/// One sequence's rows in [`Backend::attention_batch`]: rows `first_row..first_row + rows` of
/// the query and output, row `i` at position `first_pos + i`, over this sequence's caches (with
/// its block table where it is paged).
pub struct AttnSeq<'a, B: Backend + ?Sized> {
    pub first_row: usize,
    pub rows: usize,
    pub first_pos: usize,
    pub k: &'a B::Kv,
    pub v: &'a B::Kv,
    pub table: Option<&'a B::KvTable>,
}

/// One token's use of one expert in a mixture-of-experts layer, with the router's weight.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Route {
    pub token: u32,
    pub expert: u32,
    pub weight: f32,
}

/// A mixture-of-experts layer's experts, stacked (see [`crate::model::experts`]): expert `e` is
/// rows `e·width .. (e+1)·width` of `gate` and `up` (`E·width × d`) and its own `d × width` down,
/// rows `e·d .. (e+1)·d` of `down` (`E·d × width`).
pub struct Experts<'a, W> {
    pub gate: Option<&'a W>,
    pub up: &'a W,
    pub down: &'a W,
    pub width: usize,
}

impl<'a, W> Experts<'a, W> {
    /// Gated experts of `width` neurons from their gate, up and down stacks.
    pub fn gated([gate, up, down]: &'a [W; 3], width: usize) -> Self {
        Experts {
            gate: Some(gate),
            up,
            down,
            width,
        }
    }
}

/// One weight of [`Backend::matmul_parts`]: `x · wᵀ` into columns `col0..` of output `out`.
pub struct MatmulPart<'a, W> {
    pub w: &'a W,
    pub out: usize,
    pub col0: usize,
}
