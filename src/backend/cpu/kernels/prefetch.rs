//! A cache hint: ask for bytes ahead of their use (the many-row kernels, the KV cache's rows).

/// Ask the caches for `bytes` ahead of use (one hint per 64-byte line; a hint never faults).
#[inline]
pub(crate) fn prefetch(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    for line in bytes.chunks(64) {
        // SAFETY: SSE is part of x86-64; a prefetch reads nothing and cannot fault.
        unsafe {
            use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
            _mm_prefetch::<_MM_HINT_T0>(line.as_ptr() as *const i8);
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}
