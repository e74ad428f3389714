//! Row kernels of the CPU backend: dot products of one weight row (in its storage format) with
//! activations, and the activation quantizer for the integer paths. Each kernel has a portable
//! version (the reference) and an AVX2/FMA/F16C version chosen once at run time.
//!
//! Quantized weights multiply 8-bit activations the way llama.cpp does (Q8_0/Q8_1 activation
//! blocks with f16-rounded scales), so its results and ours round alike.
//!
//! Where things are: the table of a set ([`Kernels`], `set`), the activation blocks
//! (`activations`), the cache hint (`prefetch`), the sets themselves (`portable`, the reference;
//! `avx2` with `avx2_attention` and `avx2_qdots`, its Q4 dots of many rows; `avx512`, the VNNI
//! many-row dots), what the many-row Q8_0/Q4 dots of both share (`qdots`: their arithmetic and
//! driver) and the Q5/K-quant kernels of every set (`kq`). This file declares them and picks
//! the sets this CPU runs.

mod activations;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx2_attention;
#[cfg(target_arch = "x86_64")]
mod avx2_qdots;
#[cfg(target_arch = "x86_64")]
mod avx512;
pub(crate) mod kq;
pub mod portable;
mod prefetch;
#[cfg(target_arch = "x86_64")]
mod qdots;
mod set;
#[cfg(test)]
mod tests;
pub mod tiles;

pub use activations::{ActBlock, TokenBlocks};
pub use kq::{ActBlockK, quantize_k};
pub use portable::PORTABLE;
pub(crate) use prefetch::prefetch_far;
pub use set::{DotsFn, Kernels, ScoresFn, TiledFn};

/// `[body(0), body(1), …, body(n - 1)]` (`zero` fills it first), built by a loop in the
/// calling kernel. Not `std::array::from_fn` or `[T; N]::map` where `body` holds intrinsics:
/// those are generic functions without the kernel's target features, so where LLVM leaves one
/// out of line it cannot inline the intrinsics into it, and each becomes a call that passes its
/// registers through memory. (It did in 15c43bc: the Q8_0 tile kernel's code loads, and with
/// them the SmolLM2 head, took 4 ms a token instead of 1.) `tests/intrinsics_inlined.rs` checks
/// the built binary for such calls.
macro_rules! lanes {
    ($n:expr, $zero:expr, |$i:ident| $body:expr) => {{
        let mut out = [$zero; $n];
        for ($i, o) in out.iter_mut().enumerate() {
            *o = $body;
        }
        out
    }};
}
pub(crate) use lanes;

/// The AVX-512 kernel set's name (its sparse operators take AVX-512 four-row kernels).
#[cfg(target_arch = "x86_64")]
pub const AVX512_NAME: &str = avx512::KERNELS.name;

/// Every kernel set this CPU can run, best first.
pub fn available() -> Vec<&'static Kernels> {
    #[allow(unused_mut)]
    let mut v: Vec<&'static Kernels> = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        if avx2::supported() {
            if avx512::supported() {
                v.push(&avx512::KERNELS);
            }
            v.push(&avx2::KERNELS);
        }
    }
    v.push(&PORTABLE);
    v
}

/// The kernel set called `name`, if this CPU can run it.
pub fn by_name(name: &str) -> Option<&'static Kernels> {
    available().into_iter().find(|k| k.name == name)
}

/// The best kernel set this CPU supports.
pub fn best() -> &'static Kernels {
    available()[0]
}
