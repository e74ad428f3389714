//! The activations the integer kernels take: 32-value blocks quantized to 8 bits
//! ([`ActBlock`], Q8_0/Q8_1 as llama.cpp stores them) and a view of several tokens' blocks for
//! the many-row kernels ([`TokenBlocks`]). (The K-quants' 256-value blocks are `kq::ActBlockK`.)

use crate::tensor::QK;

/// One block of 32 activations quantized to 8 bits: x ≈ d·q.
/// `d` and `s = d·Σq` hold f16-rounded values, as llama.cpp stores them; `isum = Σq` is exact.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ActBlock {
    pub d: f32,
    pub s: f32,
    pub isum: i32,
    pub qs: [i8; QK],
}

/// The activations of one or more tokens for the many-row kernels: `per_token` blocks to a token.
#[derive(Clone, Copy)]
pub struct TokenBlocks<'a> {
    pub blocks: &'a [ActBlock],
    pub per_token: usize,
}

impl TokenBlocks<'_> {
    pub fn tokens(&self) -> usize {
        self.blocks.len() / self.per_token.max(1)
    }
}
