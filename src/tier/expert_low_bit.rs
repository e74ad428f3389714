//! Mixed-precision experts ([`crate::plan::expert_low_bit`]): every routed expert's low-bit
//! copy in host memory (quantized at load from the stacks), and on the device one low-bit area
//! a decode step's low-ranked misses are copied into — each matrix as wide as its widest
//! layer's, re-typed per layer — and computed from, into their own output buffer that the
//! engine adds to the step's sum.

use std::sync::Arc;

use super::expert_host::distinct_experts;
use crate::backend::{Act, Backend, Experts, Route};
use crate::engine::{EngineError, Result};
use crate::footprint::ledger::{Ledger, Reservation, Tier};
use crate::plan::experts::LowBitExperts;
use crate::tensor::{Bytes, DType, HostTensor, encode_row};

fn weights_err(e: impl std::fmt::Display) -> EngineError {
    EngineError::Weights(e.to_string())
}

/// One layer's low-bit copies: per matrix every routed expert's rows, and the rows of one.
struct LowStacks {
    /// The page locks (copies out of them run asynchronously on a GPU), released first.
    _pins: Vec<crate::backend::HostPin>,
    matrices: [HostTensor; 3],
    rows: [usize; 3],
    _hold: Reservation,
}

/// What a step's low-bit experts did: experts copied and computed, their bytes.
pub(super) struct LowBitWork {
    pub experts: u64,
    pub bytes: u64,
}

pub(super) struct LowBitArea<B: Backend> {
    dtype: DType,
    layers: Vec<LowStacks>,
    area: [B::Weight; 3],
    out: B::Tensor,
    slots: usize,
}

impl<B: Backend> LowBitArea<B> {
    /// Quantize the routed experts of `stacks` (per layer, the three stacks of `all` experts,
    /// the first `experts` routed) to the plan's format, reserving their host memory, and
    /// allocate the device's area and output.
    pub(super) fn new(
        b: &B,
        plan: &LowBitExperts,
        stacks: &[[&HostTensor; 3]],
        (experts, all): (usize, usize),
        (ledger, d_model): (&Arc<Ledger>, usize),
    ) -> Result<Self> {
        let dtype = plan.dtype;
        let mut layers = Vec::with_capacity(stacks.len());
        for (l, three) in stacks.iter().enumerate() {
            let mut matrices = Vec::with_capacity(3);
            let mut rows = [0; 3];
            let mut bytes = 0;
            for (i, s) in three.iter().enumerate() {
                let m = quantize(s, experts * (s.rows / all.max(1)), dtype)?;
                rows[i] = m.rows / experts.max(1);
                bytes += (m.data.len() as u64).next_multiple_of(4096);
                matrices.push(m);
            }
            let hold = ledger
                .reserve(Tier::Dram, bytes, &format!("layer {l} low-bit experts"))
                .map_err(weights_err)?;
            let mut pins = Vec::new();
            for m in &matrices {
                pins.extend(b.pin_host(m.data.as_slice())?);
            }
            layers.push(LowStacks {
                _pins: pins,
                matrices: matrices
                    .try_into()
                    .map_err(|_| weights_err("three expert matrices"))?,
                rows,
                _hold: hold,
            });
        }
        let mut area = Vec::with_capacity(3);
        for (i, which) in ["gate", "up", "down"].iter().enumerate() {
            let widest = layers
                .iter()
                .max_by_key(|x| x.rows[i] * dtype.bytes_for(x.matrices[i].cols))
                .ok_or_else(|| weights_err("a model without layers"))?;
            area.push(b.alloc_weight(
                &format!("{which} low-bit area"),
                dtype,
                plan.slots * widest.rows[i],
                widest.matrices[i].cols,
            )?);
        }
        Ok(LowBitArea {
            dtype,
            layers,
            area: area
                .try_into()
                .map_err(|_| weights_err("three expert matrices"))?,
            out: b.alloc(plan.rows, d_model)?,
            slots: plan.slots,
        })
    }

    /// Layer `l`'s step: of `rest` (the routes the unit lacks), those that are not their token's
    /// most weighted routed expert in `routes` are copied in low-bit and computed on the device
    /// from `x`, into the output returned (the engine adds it); `rest` keeps the others.
    pub(super) fn serve(
        &mut self,
        b: &B,
        (l, experts, width): (usize, usize, usize),
        (routes, rest): (&[Route], &mut Vec<Route>),
        (x, act): (&B::Tensor, Act),
    ) -> Result<Option<(&B::Tensor, LowBitWork)>> {
        // Each token's top routed expert: routes come token by token, most weight first.
        let mut top: Vec<Option<u32>> = Vec::new();
        for r in routes.iter().filter(|r| (r.expert as usize) < experts) {
            let t = r.token as usize;
            if top.len() <= t {
                top.resize(t + 1, None);
            }
            top[t].get_or_insert(r.expert);
        }
        let is_top = |r: &Route| top.get(r.token as usize).copied().flatten() == Some(r.expert);
        let (low, cpu): (Vec<Route>, Vec<Route>) = rest
            .iter()
            .copied()
            .partition(|r| (r.expert as usize) < experts && !is_top(r));
        let ids = distinct_experts(&low);
        if ids.is_empty() {
            return Ok(None);
        }
        if ids.len() > self.slots {
            return Err(weights_err(format!(
                "{} low-ranked experts in a step; the low-bit area holds {}",
                ids.len(),
                self.slots
            )));
        }
        let stacks = self
            .layers
            .get(l)
            .ok_or_else(|| weights_err(format!("no low-bit experts for layer {l}")))?;
        // The area's last reader is the compute queued so far; its copies, the device's next.
        let free = b.compute_done()?;
        b.copies_wait(&free)?;
        let mut bytes = 0u64;
        for (i, w) in self.area.iter_mut().enumerate() {
            let (m, rows) = (&stacks.matrices[i], stacks.rows[i]);
            b.retype_weight(w, self.dtype, ids.len() * rows, m.cols)?;
            let rb = m.row_bytes();
            for (slot, &e) in ids.iter().enumerate() {
                let e = e as usize;
                let src = &m.data.as_slice()[e * rows * rb..(e + 1) * rows * rb];
                b.upload_into(w, slot * rows, src)?;
                bytes += src.len() as u64;
            }
        }
        let landed = b.copies_done()?;
        super::compute_waits_for(b, &landed)?;
        let local: Vec<Route> = low
            .iter()
            .map(|r| Route {
                expert: ids.binary_search(&r.expert).unwrap_or(0) as u32,
                ..*r
            })
            .collect();
        let (n, d) = b.shape(x);
        b.reshape(&mut self.out, n, d)?;
        let area = Experts::gated(&self.area, width);
        b.moe_ffn(area, x, &local, act, &mut self.out)?;
        *rest = cpu;
        Ok(Some((
            &self.out,
            LowBitWork {
                experts: ids.len() as u64,
                bytes,
            },
        )))
    }
}

/// The first `rows` rows of `stack` in `dtype`.
fn quantize(stack: &HostTensor, rows: usize, dtype: DType) -> Result<HostTensor> {
    let rows = rows.min(stack.rows);
    let rb = dtype.bytes_for(stack.cols);
    let mut data = vec![0u8; rows * rb];
    // Row by row on every core (the K formats' quantizers search per block).
    use rayon::prelude::*;
    data.par_chunks_mut(rb).enumerate().try_for_each_init(
        || vec![0f32; stack.cols],
        |row, (r, out)| -> Result<()> {
            stack.row_f32(r, row).map_err(weights_err)?;
            encode_row(dtype, row, out);
            Ok(())
        },
    )?;
    Ok(HostTensor {
        name: format!("{} ({})", stack.name, dtype.name()),
        rows,
        cols: stack.cols,
        dtype,
        data: Bytes::from_slice(&data),
    })
}
