//! Fused ops as the plain ops they equal: what a backend without the fused kernel runs (the
//! trait's defaults) and where CUDA's fused launch does not apply (its fallbacks). Also the input
//! of a layer's products, which may carry the RMSNorm before them for a backend to fuse.

use super::args::{Act, MatmulPart, Rope};
use super::{Backend, Result};

/// [`Backend::rope_store_kv`] as two ops: [`Backend::rope_pair`], then
/// [`Backend::store_kv_pair`].
pub fn rope_then_store<B: Backend + ?Sized>(
    b: &B,
    (q, k, v): (&mut B::Tensor, &mut B::Tensor, &B::Tensor),
    caches: (&mut B::Kv, &mut B::Kv),
    table: Option<&B::KvTable>,
    dst_row: usize,
    rope: Rope<'_, B::Weight>,
) -> Result<()> {
    let (hd, rd, pairs, f) = (rope.head_dim, rope.rot_dims, rope.pairs, rope.inv_freq);
    b.rope_pair(q, k, hd, rd, pairs, f, dst_row)?;
    b.store_kv_pair((k, v), caches, table, dst_row)
}

/// [`Backend::gate_up`] as two ops: [`Backend::matmul_parts`] of up and the gate, then
/// [`Backend::gated`].
pub fn gate_then_up<B: Backend + ?Sized>(
    b: &B,
    x: &B::Tensor,
    (w_gate, w_up): (&B::Weight, &B::Weight),
    (act, threshold): (Act, f32),
    gate: &mut B::Tensor,
    up: &mut B::Tensor,
) -> Result<()> {
    gate_and_up(b, ProductInput::Rows(x), (w_gate, w_up), gate, up)?;
    b.gated(gate, up, act, threshold)
}

/// [`Backend::gate_up`], then `out = gate · w_downᵀ`: what [`Backend::gate_up_down`] computes,
/// op by op.
pub fn gate_up_then_down<B: Backend + ?Sized>(
    b: &B,
    x: &B::Tensor,
    (w_gate, w_up, w_down): (&B::Weight, &B::Weight, &B::Weight),
    how: (Act, f32),
    (gate, up): (&mut B::Tensor, &mut B::Tensor),
    out: &mut B::Tensor,
) -> Result<()> {
    b.gate_up(x, (w_gate, w_up), how, gate, up)?;
    b.matmul(w_down, gate, out)
}

/// `x · w_gateᵀ` into `gate` and `x · w_upᵀ` into `up` (`x` the input's rows), in one
/// [`Backend::matmul_parts_of`].
pub fn gate_and_up<B: Backend + ?Sized>(
    b: &B,
    x: ProductInput<'_, B>,
    (w_gate, w_up): (&B::Weight, &B::Weight),
    gate: &mut B::Tensor,
    up: &mut B::Tensor,
) -> Result<()> {
    let parts = [
        MatmulPart {
            w: w_up,
            out: 0,
            col0: 0,
        },
        MatmulPart {
            w: w_gate,
            out: 1,
            col0: 0,
        },
    ];
    b.matmul_parts_of(x, &parts, &mut [&mut *up, &mut *gate])
}

/// The input of a layer's products: rows already computed, or the RMSNorm before them (after a
/// residual add) not yet computed. Handed to the op that multiplies it, so a backend may write
/// the normed rows in the products' own input format (CUDA: f16, cuBLAS's input) instead of f32
/// rows it would read back and convert.
pub enum ProductInput<'a, B: Backend + ?Sized> {
    /// Rows already computed.
    Rows(&'a B::Tensor),
    /// `x += add` (where given), then [`Backend::rms_norm`] of `x` by `weight` into `out`. A
    /// backend that hands the normed rows straight to the products need not write `out`: what it
    /// holds after the op is unspecified.
    RmsNorm {
        x: &'a mut B::Tensor,
        add: Option<&'a B::Tensor>,
        weight: &'a B::Weight,
        eps: f32,
        out: &'a mut B::Tensor,
    },
}

impl<'a, B: Backend + ?Sized> ProductInput<'a, B> {
    /// The rows, the pending norm computed (into `out`) where there is one.
    pub fn rows(self, b: &B) -> Result<&'a B::Tensor> {
        match self {
            ProductInput::Rows(x) => Ok(x),
            ProductInput::RmsNorm {
                x,
                add,
                weight,
                eps,
                out,
            } => {
                match add {
                    Some(y) => b.add_rms_norm(x, y, weight, eps, out)?,
                    None => b.rms_norm(x, weight, eps, out)?,
                }
                Ok(out)
            }
        }
    }

    /// The tensor whose shape the rows have (`x` of a pending norm).
    pub fn shaped_as(&self) -> &B::Tensor {
        match self {
            ProductInput::Rows(x) => x,
            ProductInput::RmsNorm { x, .. } => x,
        }
    }
}
