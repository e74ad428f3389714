//! The CPU+PCIe split (`--cold split`, bundled FFNs, the DRAM holding the model): of the FFN
//! neurons that do not fit the device, the last ones of every layer are computed by the CPU
//! from DRAM instead of streamed, as many as make the CPU take as long as the copies of what
//! still streams. What [`crate::tier::split`] carries out.
//!
//! Problem. With `a` other streamed bytes, `n` neurons off the device of `b` bytes, PCIe rate
//! `p` and DRAM rate `d`, find `c` with `(a + (n − c)·b)/p = c·b/d`.
//!
//! Algorithm. Solve for `c`, round what still streams to whole checksum groups, refit the
//! residency around it (the slots shrink, which leaves room for more resident rows, which
//! changes the balance) and repeat: at most four rounds, stopping as soon as `c` settles.
//! Never fails; the caller keeps the split only where it fits and the CPU takes rows.

use crate::store::{GROUP_ROWS, Manifest};

use super::budget::PlanError;
use super::hardware::HardwareProfile;
use super::manifest::{extent, holds, part_segment_name, seg};
use super::preserve::{LayerShape, Part, Residency};

/// The residency balancing the CPU's share of the FFN against the copies, from `start` (no
/// split) on `hw`; `fit(c)` is the residency that fits with the last `c` neurons of every layer
/// on the CPU.
pub(super) fn balance(
    shape: &LayerShape,
    hw: &HardwareProfile,
    start: Residency,
    fit: impl Fn(usize) -> Residency,
) -> Residency {
    let f = Part::Ffn.index();
    let (rows, b) = (shape.rows[f], shape.row_bytes[f]);
    let (p, d) = (hw.h2d_pinned_bytes_per_s, hw.dram_read_bytes_per_s);
    let mut cur = start;
    for _ in 0..4 {
        let n = rows - cur.rows[f];
        let others =
            cur.streamed_bytes(shape) - cur.streamed_rows(shape, Part::Ffn).len() as u64 * b;
        let c = (((others + n as u64 * b) as f64 * d / (b as f64 * (p + d))) as usize).min(n);
        // What still streams ends on a checksum group (or is nothing).
        let end = (rows - c).div_ceil(GROUP_ROWS) * GROUP_ROWS;
        let c = rows - end.clamp(cur.rows[f], rows);
        if c == cur.cpu_rows {
            break;
        }
        cur = fit(c);
    }
    cur
}

/// DRAM the CPU's FFN rows of `residency` take in every layer, held as read: whole pages.
pub(super) fn cpu_rows_dram(
    m: &Manifest,
    shape: &LayerShape,
    residency: &Residency,
) -> Result<u64, PlanError> {
    let mut cpu_rows_dram = 0;
    for l in 0..m.spec.n_layers {
        for p in Part::FFN.into_iter().filter(|&p| holds(m, p)) {
            let sg = seg(m, &part_segment_name(l, p))?;
            cpu_rows_dram += extent(sg, residency.cpu_rows_of(shape, p));
        }
    }
    Ok(cpu_rows_dram)
}
