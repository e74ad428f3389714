//! The budgeted device's accounting of its bundle ops (a child module of `sim`, kept in its own
//! file): whole-run ops refused on host memory, the device reads they leave unread, the link
//! bytes the listed ops read in place.

use std::time::Instant;

use super::{SimBackend, SimWeight};
use crate::backend::cpu::CpuTensor;
use crate::backend::{BackendError, BundleShape, Result};

impl SimBackend {
    /// Refuse `b` for `op` (a whole-bundle op) where it is host memory read in place: only the
    /// listed ops count what they read of it.
    pub(super) fn whole(&self, op: &'static str, b: &SimWeight) -> Result<()> {
        if b.mem.in_host {
            return Err(BackendError::Shape {
                op,
                msg: format!(
                    "`{}` is read in place: only the listed ops take it",
                    b.w.name()
                ),
            });
        }
        Ok(())
    }

    /// Count in the ledger what a whole-run bundle op (`up` side or down) of `b` left unread:
    /// the CPU's kernels, as CUDA's, read the up part of a gated neuron only where its gate
    /// leaves it on for some token, and its down part only where its activation (column
    /// `col0 + i` of `h`) is non-zero for some token. A neuron whose gate is on but whose up
    /// product is exactly zero counts as off (its up part read all the same): a bound taking
    /// these bytes off stays a bound.
    pub(super) fn count_skipped(
        &self,
        b: &SimWeight,
        shape: BundleShape,
        h: &CpuTensor,
        col0: usize,
        up: bool,
    ) {
        let neurons = b.w.rows();
        let on = (col0..col0 + neurons)
            .filter(|&c| (0..h.rows).any(|t| h.data[t * h.cols + c] != 0.0))
            .count();
        let rb = b.w.row_bytes();
        let read = |live| crate::backend::in_place_read_bytes(rb, shape.parts, neurons, live, up);
        self.ledger().count_reads_skipped(read(neurons) - read(on));
    }

    /// Count (paced as a copy from `t0`) the link bytes a listed op read of the sets it was
    /// given that rest in host memory: entry `j` of `idx` read its up or down part where
    /// `live(j)`.
    pub(super) fn listed_in_place(
        &self,
        (b, rest): (&SimWeight, Option<&SimWeight>),
        shape: BundleShape,
        idx: &[u32],
        (up, live): (bool, &dyn Fn(usize) -> bool),
        t0: Instant,
    ) {
        let mut bytes = 0;
        for (w, in_rest) in [(Some(b), false), (rest, true)] {
            let Some(w) = w.filter(|w| w.mem.in_host) else {
                continue;
            };
            let mine = |j: &usize| (idx[*j] & crate::backend::IN_REST != 0) == in_rest;
            let listed = (0..idx.len()).filter(mine).count();
            let on = (0..idx.len()).filter(mine).filter(|&j| live(j)).count();
            bytes +=
                crate::backend::in_place_read_bytes(w.w.row_bytes(), shape.parts, listed, on, up);
        }
        if bytes > 0 {
            self.copied_in(bytes as usize, t0);
        }
    }
}
