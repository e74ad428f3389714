//! The AVX2 set's Q4_0/Q4_1 dots: one row, and many (eight rows to a register, up to four
//! tokens a tile), with the arithmetic of `qdots` — so these formats give the same bits on the
//! AVX2 and AVX-512 sets, and a row's result never depends on what is computed beside it.
//! (Q8_0 keeps its own association: see `avx2::dot_q8_0_avx2`.)
//!
//! Why many rows: one row to a register pays the block's scaling (two f16 conversions, the
//! products' conversion, the multiplies) for 32 weights; eight rows to a register pay it once
//! for 256, after a horizontal sum of the integer products that costs less. On this project's
//! 2-core AVX2 machine (AMD EPYC, Zen 1) the one-row Q4_1 matvec was compute-bound at about a
//! third of the DRAM rate. The tile works on 128-bit halves of each block's codes (Zen 1 splits
//! 256-bit operations in two anyway, and the halves need no cross-lane broadcast or blend):
//! `bench matvec --rows 11008 --cols 4096 --dtype q4_1`, two threads, 12.2–12.7 GB/s with
//! 256-bit codes, 15.4–15.9 with halves.

use std::arch::x86_64::*;

use super::activations::{ActBlock, TokenBlocks};
use super::kq::x86::hsum_i32;
use super::lanes;
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

/// A block's 32 codes (at `p`) as two registers of bytes 0..15: codes 0..15 (the low nibbles)
/// and 16..31 (the high), matching the activations' two halves. The many-row tile takes them
/// so: 128-bit operations need no cross-lane broadcast or blend, and a CPU that splits 256-bit
/// operations in two (Zen 1) pays the same for the halves.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn code_halves<const KIND: u8>(p: *const u8) -> [__m128i; 2] {
    // SAFETY: the caller's whole block.
    let packed = unsafe { _mm_loadu_si128(p.add(block_bytes(KIND) - 16) as *const __m128i) };
    let low = _mm_set1_epi8(0x0f);
    [
        _mm_and_si128(packed, low),
        _mm_and_si128(_mm_srli_epi16::<4>(packed), low),
    ]
}

/// One row's block products with the activations' halves `x`: eight i16, each the sum of four
/// code products (maddubs pairs them; the halves add).
#[inline]
#[target_feature(enable = "avx2")]
fn products(c: [__m128i; 2], x: [__m128i; 2]) -> __m128i {
    _mm_add_epi16(_mm_maddubs_epi16(c[0], x[0]), _mm_maddubs_epi16(c[1], x[1]))
}

/// Eight rows' [`products`] summed into one register of the eight rows' totals (lane r, row
/// r), exactly: a product is at most 15·127 in size, so sixteen add within i16 (two rounds of
/// interleaving and adding) before each row's two partial sums widen to i32 and add.
#[inline]
#[target_feature(enable = "avx2")]
fn totals(p: [__m128i; 8]) -> __m256i {
    // i16 j of a four-row register: row j % 4's partial sum (j / 4: which of two).
    let four = |a: __m128i, b: __m128i, c: __m128i, d: __m128i| zip32(zip16(a, b), zip16(c, d));
    let widen = |v: __m128i| {
        _mm_add_epi32(
            _mm_cvtepi16_epi32(v),
            _mm_cvtepi16_epi32(_mm_unpackhi_epi64(v, v)),
        )
    };
    let low = widen(four(p[0], p[1], p[2], p[3]));
    let high = widen(four(p[4], p[5], p[6], p[7]));
    _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(low), high)
}

// `a` and `b` interleaved by 16- or 32-bit units, each unit of the low halves added to its
// counterpart of the high (functions, not closures, to inherit the target features).
#[inline]
#[target_feature(enable = "avx2")]
fn zip16(a: __m128i, b: __m128i) -> __m128i {
    _mm_add_epi16(_mm_unpacklo_epi16(a, b), _mm_unpackhi_epi16(a, b))
}
#[inline]
#[target_feature(enable = "avx2")]
fn zip32(a: __m128i, b: __m128i) -> __m128i {
    _mm_add_epi16(_mm_unpacklo_epi32(a, b), _mm_unpackhi_epi32(a, b))
}

/// The scales of one block (at `at`) of eight rows, and their mins (Q4_1; the scales again
/// otherwise).
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn scales8<const KIND: u8>(rp: &[*const u8; LANES], at: usize) -> (__m256, __m256) {
    if KIND == Q41 {
        // A Q4_1 block starts with its scale and min side by side: one 32-bit load a row, then
        // the scales and the mins sorted apart (fewer inserts than a 16-bit load each).
        // SAFETY: every block's first four bytes.
        let pair = |r: usize| unsafe { (rp[r].add(at) as *const i32).read_unaligned() };
        let apart = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
        let low = _mm_shuffle_epi8(_mm_setr_epi32(pair(0), pair(1), pair(2), pair(3)), apart);
        let high = _mm_shuffle_epi8(_mm_setr_epi32(pair(4), pair(5), pair(6), pair(7)), apart);
        return (
            _mm256_cvtph_ps(_mm_unpacklo_epi64(low, high)),
            _mm256_cvtph_ps(_mm_unpackhi_epi64(low, high)),
        );
    }
    // SAFETY: every block starts with its f16 scale.
    let h: [u16; LANES] =
        std::array::from_fn(|r| unsafe { (rp[r].add(at) as *const u16).read_unaligned() });
    // SAFETY: eight u16.
    let d = _mm256_cvtph_ps(unsafe { _mm_loadu_si128(h.as_ptr() as *const __m128i) });
    (d, d)
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
            let zero = _mm_setzero_si128();
            let c: [[__m128i; 2]; LANES] =
                lanes!(LANES, [zero; 2], |r| code_halves::<KIND>(rp[r].add(at)));
            let (dw, mw) = scales8::<KIND>(rp, at);
            for (t, acc) in acc.iter_mut().enumerate() {
                let a = &*x.add(t * nb + b);
                let xq = a.qs.as_ptr() as *const __m128i;
                let xv = [_mm_loadu_si128(xq), _mm_loadu_si128(xq.add(1))];
                let mut s = totals(lanes!(LANES, zero, |r| products(c[r], xv)));
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
