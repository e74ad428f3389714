//! The CPU+PCIe split (`--cold split`, bundled FFNs, the DRAM holding the model): of the FFN
//! neurons that do not fit the device, the last ones of every layer are computed by the CPU
//! from DRAM instead of streamed, as many as make the CPU take as long as the copies of what
//! still streams. What [`crate::tier::split`] carries out.
//!
//! Problem. With `a` other streamed bytes, `n` neurons off the device of `b` bytes, PCIe rate
//! `p` and the rate `d` at which the CPU gets through its neurons' bytes, find `c` with
//! `(a + (n − c)·b)/p = c·b/d`. For one sequence `d` is the DRAM read rate; a step of `N`
//! sequences reads the neurons once but computes `N` rows of `f` FLOPs each at the CPU's rate
//! `F`, so `d = min(DRAM, F·b/(N·f))` ([`super::batch::cpu_neuron_rate`]): the CPU's share
//! shrinks as the batch grows, while the streamed bytes serve every sequence alike.
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
/// split) on `hw`, the CPU getting through its neurons' bytes at `cpu_bytes_per_s` (the DRAM
/// rate for one sequence); `fit(c)` is the residency that fits with the last `c` neurons of
/// every layer on the CPU.
pub(super) fn balance(
    shape: &LayerShape,
    hw: &HardwareProfile,
    cpu_bytes_per_s: f64,
    start: Residency,
    fit: impl Fn(usize) -> Residency,
) -> Residency {
    let f = Part::Ffn.index();
    let (rows, b) = (shape.rows[f], shape.row_bytes[f]);
    let (p, d) = (hw.h2d_pinned_bytes_per_s, cpu_bytes_per_s);
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

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;
    use crate::plan::hardware::presets;
    use crate::plan::preserve::PARTS;

    /// A layer of bundled FFN neurons only, none resident: what streams is the FFN's rest.
    fn ffn_only(rows: usize, row_bytes: u64) -> LayerShape {
        let mut shape = LayerShape {
            rows: [0; PARTS],
            row_bytes: [0; PARTS],
        };
        shape.rows[Part::Ffn.index()] = rows;
        shape.row_bytes[Part::Ffn.index()] = row_bytes;
        shape
    }

    #[test]
    fn the_cpu_takes_as_long_as_the_copies_of_the_rest() {
        let shape = ffn_only(1024, 1000);
        // Where the refit changes nothing else, the balance settles in the second round.
        let fit = |c: usize| Residency {
            cpu_rows: c,
            ..Residency::default()
        };
        for (dram_per_pcie, want) in [(1.0, 512), (3.0, 768), (700.0 / 324.0, 640)] {
            let mut hw = presets().remove(0);
            hw.h2d_pinned_bytes_per_s = 1.0;
            hw.dram_read_bytes_per_s = dram_per_pcie;
            let rounds = Cell::new(0);
            let r = balance(&shape, &hw, dram_per_pcie, Residency::default(), |c| {
                rounds.set(rounds.get() + 1);
                fit(c)
            });
            assert_eq!(r.cpu_rows, want, "DRAM at {dram_per_pcie}× PCIe");
            // What still streams ends on a checksum group.
            assert_eq!((1024 - r.cpu_rows) % GROUP_ROWS, 0);
            assert_eq!(rounds.get(), 1, "settled after one refit");
        }
    }

    #[test]
    fn resident_rows_are_never_given_to_the_cpu() {
        let shape = ffn_only(1024, 1000);
        let mut hw = presets().remove(0);
        // The CPU far faster than PCIe would take every neuron off the device.
        hw.h2d_pinned_bytes_per_s = 1.0;
        hw.dram_read_bytes_per_s = 1e6;
        let mut start = Residency::default();
        start.rows[Part::Ffn.index()] = 256;
        let r = balance(&shape, &hw, hw.dram_read_bytes_per_s, start, |c| {
            let mut r = start;
            r.cpu_rows = c;
            r
        });
        assert!(r.cpu_rows + 256 <= 1024, "{} rows to the CPU", r.cpu_rows);
        assert!(
            r.cpu_rows + 256 + GROUP_ROWS >= 1024,
            "{} rows to the CPU",
            r.cpu_rows
        );
        assert_eq!((1024 - r.cpu_rows) % GROUP_ROWS, 0);
    }
}
