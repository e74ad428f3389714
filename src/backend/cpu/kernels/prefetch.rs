//! Cache hints: ask L2 for bytes ahead of their use (the many-row kernels' next rows, streamed
//! from DRAM; a decode step's KV rows).

/// Ask L2 for `bytes`, read from DRAM a tile or more ahead of use (the many-row kernels' next
/// rows). A hint into L1 holds one of L1's few line-fill buffers until the line arrives, which
/// capped a core's stream: `bench matvec` on this project's 2-core machine, from DRAM,
/// 11008×4096 Q4_1 18.5–21.0 GB/s into L1 and 25.3–26.7 into L2, 49152×576 Q8_0 18.0–18.8 and
/// 23.8–26.4 (the hardware prefetcher brings the lines on from L2 to L1).
#[inline]
pub(crate) fn prefetch_far(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    lines::<{ std::arch::x86_64::_MM_HINT_T1 }>(bytes);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

/// One hint of kind `HINT` per 64-byte line of `bytes`.
#[cfg(target_arch = "x86_64")]
#[inline]
fn lines<const HINT: i32>(bytes: &[u8]) {
    for line in bytes.chunks(64) {
        // SAFETY: SSE is part of x86-64; a prefetch reads nothing and cannot fault.
        unsafe { std::arch::x86_64::_mm_prefetch::<HINT>(line.as_ptr() as *const i8) };
    }
}
