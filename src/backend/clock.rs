//! A clock on the device's own streams, for traces: marks recorded in stream order and read back
//! once the device has passed them, so a span of host work can be given the time the device's
//! streams advanced between its ends. CUDA's are events; the budgeted device's are when its
//! compute stream's in-place reads and its link's copies end. The CPU has none (its device time
//! is the host's).

use super::Result;

/// Timing marks on a device's compute and copy streams.
pub trait DeviceClock: Send + Sync {
    /// Record a mark on the compute stream and one on the copy stream, in their order; its
    /// index among the marks not yet taken.
    fn mark(&self) -> Result<usize>;
    /// Wait until the device has passed every mark, forget them, and give for each the seconds
    /// from the first mark to it on the compute stream and on the copy stream.
    fn take(&self) -> Result<Vec<[f64; 2]>>;
}
