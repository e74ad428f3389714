//! The budgeted device's accounting of its bundle ops (a child module of `sim`, kept in its own
//! file): whole-run ops refused on host memory, the device reads they make and leave unread, the
//! listed ops and the bytes they read, over the link where they read in place.

use std::time::Instant;

use super::{SimBackend, SimTensor, SimWeight};
use crate::backend::cpu::CpuTensor;
use crate::backend::{Act, Backend, BackendError, BundleShape, Result};
use crate::footprint::workspace::WorkspaceOp;

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

    /// Count in the ledger what a whole-run bundle op (`up` side or down) of `b` read and what
    /// it left unread: the CPU's kernels, as CUDA's, read the up part of a gated neuron only
    /// where its gate leaves it on for some token, and its down part only where its activation
    /// (column `col0 + i` of `h`) is non-zero for some token. A neuron whose gate is on but
    /// whose up product is exactly zero counts as off (its up part read all the same): a bound
    /// taking these bytes off stays a bound.
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
        self.ledger().count_device_read(read(on));
    }

    /// Count (paced as a copy from `t0`) the link bytes a listed op read of the sets it was
    /// given that rest in host memory, and the device bytes it read of those in device memory:
    /// entry `j` of `idx` read its up or down part where `live(j)`.
    pub(super) fn listed_in_place(
        &self,
        (b, rest): (&SimWeight, Option<&SimWeight>),
        shape: BundleShape,
        idx: &[u32],
        (up, live): (bool, &dyn Fn(usize) -> bool),
        t0: Instant,
    ) {
        let (mut bytes, mut device) = (0, 0);
        for (w, in_rest) in [(Some(b), false), (rest, true)] {
            let Some(w) = w else {
                continue;
            };
            let mine = |j: &usize| (idx[*j] & crate::backend::IN_REST != 0) == in_rest;
            let listed = (0..idx.len()).filter(mine).count();
            let on = (0..idx.len()).filter(mine).filter(|&j| live(j)).count();
            let read =
                crate::backend::in_place_read_bytes(w.w.row_bytes(), shape.parts, listed, on, up);
            // Read over the link where it rests in host memory, else from device memory.
            *if w.mem.in_host {
                &mut bytes
            } else {
                &mut device
            } += read;
        }
        self.ledger().count_device_read(device);
        if bytes > 0 {
            // The stream's: the host goes on (to copies, say) while they cross, as it does on
            // CUDA while the kernel reads; the stream's next op waits for them.
            let end = self.queue_on_link(bytes as usize, t0);
            self.stream_busy_until(end);
        }
    }
}

impl SimBackend {
    /// [`Backend::ffn_bundles_up_listed_from`] (`down`: none) and
    /// [`Backend::ffn_bundles_listed_from`] (`down`: the entries' ids and the output) as `op`:
    /// the CPU's op, its in-place reads paced as the link carries them (the up side's, then
    /// the down side's: the neurons with an activation for some token).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn listed_op(
        &self,
        op: &'static str,
        (b, rest): (&SimWeight, Option<&SimWeight>),
        shape: BundleShape,
        x: &SimTensor,
        how: (Act, f32),
        up_bias: Option<&SimWeight>,
        (idx, down): (&[u32], Option<(&[u32], &mut SimTensor)>),
        h: &mut SimTensor,
    ) -> Result<()> {
        self.check_workspace(WorkspaceOp::Listed { neurons: idx.len() })?;
        // The neuron list is copied from the host: nothing a recording holds.
        self.outside(op)?;
        self.stream_waits();
        let t0 = Instant::now();
        let both = down.is_some();
        let read = self.cpu.listed_reading(
            (&b.w, rest.map(|r| &r.w)),
            shape,
            &x.t,
            how,
            up_bias.map(|w| &w.w),
            idx,
            &mut h.t,
            down.map(|(ids, out)| (ids, &mut out.t)),
        )?;
        let mut up = vec![false; idx.len()];
        read.iter().for_each(|&j| up[j] = true);
        self.listed_in_place((b, rest), shape, idx, (true, &|j| up[j]), t0);
        if both {
            self.listed_in_place((b, rest), shape, idx, (false, &live_in(&h.t)), t0);
        }
        Ok(())
    }

    /// [`Backend::ffn_bundles_down_listed_from`]: the CPU's op, its in-place reads paced (the
    /// neurons with an activation for some token).
    pub(super) fn listed_down(
        &self,
        (b, rest): (&SimWeight, Option<&SimWeight>),
        shape: BundleShape,
        h: &SimTensor,
        (idx, ids): (&[u32], &[u32]),
        out: &mut SimTensor,
    ) -> Result<()> {
        self.check_workspace(WorkspaceOp::Listed { neurons: idx.len() })?;
        self.outside("ffn_bundles_down_listed")?;
        self.stream_waits();
        let t0 = Instant::now();
        let listed = (&b.w, rest.map(|r| &r.w));
        self.cpu
            .ffn_bundles_down_listed_from(listed, shape, &h.t, (idx, ids), &mut out.t)?;
        self.listed_in_place((b, rest), shape, idx, (false, &live_in(&h.t)), t0);
        Ok(())
    }
}

/// Whether list position `j` of `h` (tokens × list) is non-zero for some token.
fn live_in(h: &CpuTensor) -> impl Fn(usize) -> bool + '_ {
    move |j| (0..h.rows).any(|t| h.data[t * h.cols + j] != 0.0)
}
