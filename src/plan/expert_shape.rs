//! One layer's stored experts as the planner reads them: each expert's bytes per matrix, its
//! shape, the shared expert's parts, the router, and what one expert's read from the store takes.

use serde::Serialize;

use super::budget::PlanError;
use super::manifest::{experts_segment_name, router_segment_name, seg};
use crate::footprint::device_bytes;
use crate::store::Manifest;

/// One layer's stored experts, as the planner reads them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct ExpertShape {
    /// Bytes of one expert's gate rows, up rows and down rows, as stored.
    pub gate: u64,
    pub up: u64,
    pub down: u64,
    /// Shared-expert parts every token takes (resident in their own slots).
    pub shared: usize,
    /// The router's bytes (f32).
    pub router: u64,
    /// The largest read of one expert's matrix from the store (whole checksum groups).
    pub read_extent: u64,
    /// Per matrix (gate, up, down), an expert's rows and their columns.
    pub dims: [(usize, usize); 3],
}

impl ExpertShape {
    /// Bytes of one expert (gate, up and down).
    pub fn bytes(&self) -> u64 {
        self.gate + self.up + self.down
    }

    /// Bytes of every routed expert's gate, up and down rows (a layer's stacks without the
    /// shared expert).
    pub fn routed_stacks(&self, experts: usize) -> [u64; 3] {
        let e = experts as u64;
        [e * self.gate, e * self.up, e * self.down]
    }

    /// Device bytes of a unit of `slots` routed slots and the shared parts: one tensor per
    /// matrix, each rounded (none where there is no slot at all).
    pub fn unit_device_bytes(&self, slots: usize) -> u64 {
        let n = (slots + self.shared) as u64;
        if n == 0 {
            return 0;
        }
        device_bytes(n * self.gate) + device_bytes(n * self.up) + device_bytes(n * self.down)
    }

    pub(super) fn of(m: &Manifest, l: usize) -> Result<Self, PlanError> {
        let moe =
            m.spec.moe.as_ref().ok_or_else(|| {
                PlanError::Store("an expert plan for a model without experts".into())
            })?;
        let all = moe.experts + moe.shared;
        let per_expert = |which: &str| -> Result<u64, PlanError> {
            let s = seg(m, &experts_segment_name(l, which))?;
            if all == 0 || s.rows % all != 0 {
                return Err(PlanError::Store(format!(
                    "`{}` has {} rows: not {all} experts of equal rows",
                    s.name, s.rows
                )));
            }
            Ok((s.rows / all * s.row_bytes()) as u64)
        };
        let mut read_extent = 0;
        let mut dims = [(0, 0); 3];
        for (i, which) in ["gate", "up", "down"].iter().enumerate() {
            let s = seg(m, &experts_segment_name(l, which))?;
            let rows = s.rows / all;
            dims[i] = (rows, s.cols);
            for e in 0..all {
                let (_, len) = s.read_extent(expert_read_rows(e, rows, s.rows));
                read_extent = read_extent.max(len);
            }
        }
        Ok(ExpertShape {
            gate: per_expert("gate")?,
            up: per_expert("up")?,
            down: per_expert("down")?,
            shared: moe.shared,
            router: seg(m, &router_segment_name(l))?.bytes,
            read_extent,
            dims,
        })
    }
}

/// The rows the store reads for expert `e` of a stack of `total` rows, `rows` an expert: its own
/// widened to whole checksum groups.
pub fn expert_read_rows(e: usize, rows: usize, total: usize) -> std::ops::Range<usize> {
    use crate::store::GROUP_ROWS;
    let (a, b) = (e * rows, (e + 1) * rows);
    (a / GROUP_ROWS * GROUP_ROWS)..b.next_multiple_of(GROUP_ROWS).min(total)
}
