//! The fixed device cost: what a process holds on the device before it places anything (the
//! CUDA context, kernel code, cuBLAS and its workspace), as the card counts it, and which of the
//! driver's figures it is taken from. `--gpu-mem` bounds the whole process, so the arena (and
//! the planner's ledger) gets `--gpu-mem` less this.
//!
//! Two figures can be read at start: the per-process one (NVML's entry for this pid) and the
//! device one (the device's used memory less what was used before this process made its
//! context). On an H100 the device figure was 590–640 MiB above the per-process one (memory
//! the driver takes for a context that the process table does not show: whole-GPU SmolLM2 held
//! 1335 MiB by `memory.used` against 718 by pid), so a budget held to the per-process figure
//! ran 15% over on the card. The device figure is taken wherever it can be trusted, which is
//! wherever no other process's memory moved while this one started; where it did, the device
//! is shared, and the per-process figure plus [`SHARED_DEVICE_MARGIN`] is taken instead.

use serde::Serialize;

/// What is added to the per-process figure where the device figure cannot be trusted (another
/// process's memory moved during start): the most the two figures were seen to differ by on an
/// H100 (590–640 MiB), rounded up.
pub const SHARED_DEVICE_MARGIN: u64 = 640 << 20;

/// Device code loaded after start, on first use: cuBLAS picks (and the driver loads) a kernel
/// per GEMM shape the first time it sees one. Our own kernels are all resolved at start and are
/// in the measured figure; this covers the library's, which no call at start can load in
/// advance. (The stories test saw 1.75 MiB held past the figure measured at start.)
pub const LAZY_CODE_BYTES: u64 = 4 << 20;

/// Which figure the fixed cost was taken from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FixedCostSource {
    /// The device's used memory, grown since before the context (nothing else moved).
    Device,
    /// The per-process figure plus [`SHARED_DEVICE_MARGIN`]: the device is shared, or its
    /// figure could not be read.
    ProcessWithMargin,
    /// Neither figure could be read (no NVML): the hardware profile's figure.
    Assumed,
}

impl std::fmt::Display for FixedCostSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FixedCostSource::Device => "the device's used memory",
            FixedCostSource::ProcessWithMargin => "this process's figure plus a margin",
            FixedCostSource::Assumed => "the hardware profile (not measured)",
        })
    }
}

/// The driver's figures once the context, kernels and cuBLAS are up.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FixedCostReading {
    /// Device bytes this process's entry shows.
    pub process_bytes: Option<u64>,
    /// Device bytes used now less those used before this process's context existed.
    pub device_bytes: Option<u64>,
    /// Whether another process's device memory changed while this one started (the device
    /// figure then holds some of theirs, or misses some of ours).
    pub shared: bool,
}

/// The fixed cost a process's budget is carved after, and the figures it came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct FixedCost {
    pub bytes: u64,
    pub source: FixedCostSource,
    /// The per-process figure read at start (without the lazy-code allowance).
    pub process_bytes: Option<u64>,
    /// The device figure read at start (without the lazy-code allowance).
    pub device_bytes: Option<u64>,
}

impl FixedCostReading {
    /// The fixed cost: the device figure where it is trusted (never below the process's own),
    /// else the process's plus [`SHARED_DEVICE_MARGIN`], else `assumed`; the first two with
    /// [`LAZY_CODE_BYTES`] for code loaded later.
    pub fn fixed_cost(&self, assumed: u64) -> FixedCost {
        let (bytes, source) = match (self.device_bytes, self.process_bytes) {
            (Some(d), p) if !self.shared => (
                d.max(p.unwrap_or(0)) + LAZY_CODE_BYTES,
                FixedCostSource::Device,
            ),
            (_, Some(p)) => (
                p + SHARED_DEVICE_MARGIN + LAZY_CODE_BYTES,
                FixedCostSource::ProcessWithMargin,
            ),
            (Some(d), None) => (
                d + SHARED_DEVICE_MARGIN + LAZY_CODE_BYTES,
                FixedCostSource::ProcessWithMargin,
            ),
            (None, None) => (assumed, FixedCostSource::Assumed),
        };
        FixedCost {
            bytes,
            source,
            process_bytes: self.process_bytes,
            device_bytes: self.device_bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn the_device_figure_is_taken_when_both_are_given() {
        // The H100's: 626 MiB by pid, ~1240 MiB by the device's used memory.
        let r = FixedCostReading {
            process_bytes: Some(626 * MIB),
            device_bytes: Some(1240 * MIB),
            shared: false,
        };
        let c = r.fixed_cost(768 * MIB);
        assert_eq!(c.source, FixedCostSource::Device);
        assert_eq!(c.bytes, 1240 * MIB + LAZY_CODE_BYTES);
        assert_eq!(c.process_bytes, Some(626 * MIB));
        assert_eq!(c.device_bytes, Some(1240 * MIB));
    }

    #[test]
    fn the_device_figure_is_never_below_the_process_one() {
        let r = FixedCostReading {
            process_bytes: Some(700 * MIB),
            device_bytes: Some(650 * MIB),
            shared: false,
        };
        assert_eq!(r.fixed_cost(0).bytes, 700 * MIB + LAZY_CODE_BYTES);
    }

    #[test]
    fn a_shared_device_takes_the_process_figure_and_the_margin() {
        let r = FixedCostReading {
            process_bytes: Some(626 * MIB),
            device_bytes: Some(3000 * MIB),
            shared: true,
        };
        let c = r.fixed_cost(768 * MIB);
        assert_eq!(c.source, FixedCostSource::ProcessWithMargin);
        assert_eq!(c.bytes, 626 * MIB + SHARED_DEVICE_MARGIN + LAZY_CODE_BYTES);
        // Only the device figure, and it cannot be trusted: it is all there is, plus the margin.
        let only_device = FixedCostReading {
            process_bytes: None,
            ..r
        };
        assert_eq!(
            only_device.fixed_cost(0).bytes,
            3000 * MIB + SHARED_DEVICE_MARGIN + LAZY_CODE_BYTES
        );
    }

    #[test]
    fn nothing_read_takes_the_assumed_figure() {
        let c = FixedCostReading::default().fixed_cost(768 * MIB);
        assert_eq!((c.bytes, c.source), (768 * MIB, FixedCostSource::Assumed));
        // A process figure alone (no device figure): the margin, since the gap is unknown.
        let p = FixedCostReading {
            process_bytes: Some(600 * MIB),
            ..Default::default()
        }
        .fixed_cost(768 * MIB);
        assert_eq!(p.source, FixedCostSource::ProcessWithMargin);
        assert_eq!(p.bytes, 600 * MIB + SHARED_DEVICE_MARGIN + LAZY_CODE_BYTES);
    }
}
