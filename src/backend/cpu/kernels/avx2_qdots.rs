//! The AVX2 set's Q4_0/Q4_1 dots: one row, and many (eight rows to a register, up to four
//! tokens a tile), with the arithmetic of `qdots` — so these formats give the same bits on the
//! AVX2 and AVX-512 sets, and a row's result never depends on what is computed beside it.
//! (Q8_0 keeps its own association: see `avx2::dot_q8_0_avx2`.)
//!
//! Why many rows: one row to a register pays the block's scaling (two f16 conversions, the
//! products' conversion, the multiplies) for 32 weights; eight rows to a register pay it once
//! for 256, after a horizontal sum of the integer products that costs less. On this project's
//! 2-core AVX2 machine (AMD EPYC, Zen 1) the one-row Q4_1 matvec was compute-bound at about a
//! third of the DRAM rate.

use std::arch::x86_64::*;

use super::activations::{ActBlock, TokenBlocks};
use super::kq::x86::hsum_i32;
use super::prefetch_far;
use super::qdots::{self, Q40, Q41, block_bytes};
use crate::tensor::{BlockQ4_0, BlockQ4_1};

// The safe wrappers are installed only with the AVX2 set (which required AVX2+FMA+F16C).

pub(super) fn dot_q4_0(w: &[BlockQ4_0], x: &[ActBlock]) -> f32 {
    // SAFETY: AVX2+FMA+F16C present.
    unsafe { dot_one::<Q40>(bytemuck::cast_slice(w), x) }
}
pub(super) fn dot_q4_1(w: &[BlockQ4_1], x: &[ActBlock]) -> f32 {
    // SAFETY: as above.
    unsafe { dot_one::<Q41>(bytemuck::cast_slice(w), x) }
}

/// Weight rows a tile takes at once: one to each 32-bit lane of a register.
const LANES: usize = 8;

/// Token tiles, largest first: sixteen registers hold four tokens' sums beside a block's codes.
const TILES: [usize; 3] = [4, 2, 1];

/// This set's many-row kernel for `KIND` (the driver checks the bounds).
pub(super) fn dots<const KIND: u8>(
    rows: &[&[u8]],
    x: &TokenBlocks,
    t0: usize,
    out: &mut [f32],
    next: &[u8],
) {
    let k = qdots::Tiles {
        kind: KIND,
        tokens: &TILES,
        tile: tile::<KIND>,
    };
    // SAFETY: AVX2+FMA+F16C present (the set was installed after its check).
    unsafe { qdots::dots(&k, rows, x, t0, out, next) }
}

/// The f16 at `p` by F16C.
#[inline]
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn half_at(p: *const u8) -> f32 {
    // SAFETY: the caller's two readable bytes.
    let v = unsafe { (p as *const u16).read_unaligned() };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(u16::from_le(v) as i32)))
}

/// A block's 32 codes (at `p`) as one register of bytes 0..15, in the activations' order
/// (byte i of the block holds code i low and code i + 16 high).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn codes<const KIND: u8>(p: *const u8) -> __m256i {
    // SAFETY: the caller's whole block.
    let packed = unsafe { _mm_loadu_si128(p.add(block_bytes(KIND) - 16) as *const __m128i) };
    // The 16 bytes in both halves, the high half shifted down a nibble.
    let both = _mm256_broadcastsi128_si256(packed);
    let shifted = _mm256_blend_epi32::<0xf0>(both, _mm256_srli_epi16::<4>(both));
    _mm256_and_si256(shifted, _mm256_set1_epi8(0x0f))
}

/// What Q4_0's sum needs added: its codes 0..15 stand for −8..7.
#[inline(always)]
fn code_offset<const KIND: u8>(a: &ActBlock) -> i32 {
    if KIND == Q40 { -8 * a.isum } else { 0 }
}

/// One row against one token: a tile's arithmetic for a single lane.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_one<const KIND: u8>(w: &[u8], x: &[ActBlock]) -> f32 {
    let block = block_bytes(KIND);
    let nb = (w.len() / block).min(x.len());
    let mut acc = 0f32;
    for (b, a) in x[..nb].iter().enumerate() {
        // SAFETY: block b lies inside `w`; 32 codes in `a`.
        unsafe {
            let p = w.as_ptr().add(b * block);
            let xv = _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i);
            let pairs = _mm256_maddubs_epi16(codes::<KIND>(p), xv);
            let s = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
            let sum = hsum_i32(s) + code_offset::<KIND>(a);
            acc = qdots::block_step::<KIND>(acc, p, sum, a, half_at);
        }
    }
    acc
}

/// Each of eight rows' code products (maddubs's sixteen i16 pairs a row) summed into one
/// register of the eight rows' totals, exactly: a product is at most 15·127 in size, so
/// sixteen add within i16 before each half widens.
#[inline]
#[target_feature(enable = "avx2")]
fn totals(p: [__m256i; 8]) -> __m256i {
    // Interleave and add: pairs of rows, then pairs of pairs, then fours.
    let g = zip64(
        zip32(zip16(p[0], p[1]), zip16(p[2], p[3])),
        zip32(zip16(p[4], p[5]), zip16(p[6], p[7])),
    );
    // i16 r of each half: row r's sixteen products of that half.
    _mm256_add_epi32(
        _mm256_cvtepi16_epi32(_mm256_castsi256_si128(g)),
        _mm256_cvtepi16_epi32(_mm256_extracti128_si256::<1>(g)),
    )
}

// `a` and `b` interleaved by 16-, 32- or 64-bit units, each unit of the low quarters added to
// its counterpart of the high (functions, not closures, to inherit the target features).
#[inline]
#[target_feature(enable = "avx2")]
fn zip16(a: __m256i, b: __m256i) -> __m256i {
    _mm256_add_epi16(_mm256_unpacklo_epi16(a, b), _mm256_unpackhi_epi16(a, b))
}
#[inline]
#[target_feature(enable = "avx2")]
fn zip32(a: __m256i, b: __m256i) -> __m256i {
    _mm256_add_epi16(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b))
}
#[inline]
#[target_feature(enable = "avx2")]
fn zip64(a: __m256i, b: __m256i) -> __m256i {
    _mm256_add_epi16(_mm256_unpacklo_epi64(a, b), _mm256_unpackhi_epi64(a, b))
}

/// The scales of one block (at `at`) of eight rows, and their mins (Q4_1; the scales again
/// otherwise).
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn scales8<const KIND: u8>(rp: &[*const u8; LANES], at: usize) -> (__m256, __m256) {
    // SAFETY: every block starts with its f16 scale (then Q4_1's f16 min).
    let half = |off: usize| -> __m256 {
        let h: [u16; LANES] = std::array::from_fn(|r| unsafe {
            (rp[r].add(at + off) as *const u16).read_unaligned()
        });
        // SAFETY: eight u16.
        _mm256_cvtph_ps(unsafe { _mm_loadu_si128(h.as_ptr() as *const __m128i) })
    };
    let d = half(0);
    (d, if KIND == Q41 { half(2) } else { d })
}

/// Eight rows × `tokens` tokens (4, 2 or 1) into `out[t·8 + lane]` (Q4_0 or Q4_1).
///
/// # Safety
/// AVX2+FMA+F16C; whole rows of `nb` blocks and `tokens` tokens of `nb` blocks at `x`.
unsafe fn tile<const KIND: u8>(
    rp: &[*const u8; LANES],
    x: *const ActBlock,
    nb: usize,
    tokens: usize,
    out: &mut [f32],
    next: &[u8],
) {
    // SAFETY: the caller's promise, passed on.
    unsafe {
        match tokens {
            4 => tile_t::<KIND, 4>(rp, x, nb, out, next),
            2 => tile_t::<KIND, 2>(rp, x, nb, out, next),
            _ => tile_t::<KIND, 1>(rp, x, nb, out, next),
        }
    }
}

/// [`tile`] for `T` tokens. Never inlined: each `T` gets its own register allocation.
#[inline(never)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_t<const KIND: u8, const T: usize>(
    rp: &[*const u8; LANES],
    x: *const ActBlock,
    nb: usize,
    out: &mut [f32],
    next: &[u8],
) {
    debug_assert!(out.len() >= T * LANES);
    let block = block_bytes(KIND);
    let step = next.len().div_ceil(nb.max(1));
    let mut acc = [_mm256_setzero_ps(); T];
    for b in 0..nb {
        let at = b * block;
        prefetch_far(&next[(b * step).min(next.len())..((b + 1) * step).min(next.len())]);
        // SAFETY: block b lies inside every row; token t's block b inside `x`.
        unsafe {
            let c: [__m256i; LANES] = std::array::from_fn(|r| codes::<KIND>(rp[r].add(at)));
            let (dw, mw) = scales8::<KIND>(rp, at);
            for (t, acc) in acc.iter_mut().enumerate() {
                let a = &*x.add(t * nb + b);
                let xv = _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i);
                let mut s = totals(c.map(|c| _mm256_maddubs_epi16(c, xv)));
                if KIND == Q40 {
                    s = _mm256_add_epi32(s, _mm256_set1_epi32(code_offset::<KIND>(a)));
                }
                let scale = _mm256_mul_ps(dw, _mm256_set1_ps(a.d));
                *acc = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(s), *acc);
                if KIND == Q41 {
                    *acc = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.s), *acc);
                }
            }
        }
    }
    for (t, acc) in acc.iter().enumerate() {
        // SAFETY: `out` holds the largest tile.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(t * LANES), *acc) };
    }
}
