//! Device allocations as a budget counts them: one size rule for every buffer.

/// Alignment (and granularity) of every device allocation: what cuBLAS and vectorised kernels
/// want, and what `cudaMalloc` gives.
pub const DEVICE_ALIGN: u64 = 256;

/// The device bytes an allocation of `bytes` takes (at least one granule).
pub fn device_bytes(bytes: u64) -> u64 {
    bytes.max(1).next_multiple_of(DEVICE_ALIGN)
}
