//! AVX-512 VNNI: two 32-value blocks per 512-bit `vpdpbusd` (u8 × i8 → i32 in one op).
//!
//! The kernel set: the AVX2 set with its Q8_0/Q4_0/Q4_1 dots replaced (one row, or 16 rows ×
//! up to 8 tokens a tile: the many-row kernels) and the K-quants' VNNI dots (`kq::x86::vnni`).

use std::arch::x86_64::*;

use super::activations::{ActBlock, TokenBlocks};
use super::avx2_qdots::half_at;
use super::kq::ActBlockK;
use super::kq::x86::hsum_i32;
use super::lanes;
use super::qdots::{self, Q8, Q40, Q41, block_bytes};
use super::set::Kernels;
use crate::tensor::{
    BlockQ2K, BlockQ3K, BlockQ4_0, BlockQ4_1, BlockQ4K, BlockQ5K, BlockQ6K, BlockQ8_0,
};

pub fn supported() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni")
}

pub const KERNELS: Kernels = Kernels {
    name: "avx512vnni",
    dot_q8_0,
    dot_q4_0,
    dot_q4_1,
    dot_q2_k,
    dot_q3_k,
    dot_q4_k,
    dot_q5_k,
    dot_q6_k,
    dots_q8_0: Some(dots::<Q8>),
    dots_q4_0: Some(dots::<Q40>),
    dots_q4_1: Some(dots::<Q41>),
    tiled_q8_0: Some(dots_tiled::<Q8>),
    tiled_q4_0: Some(dots_tiled::<Q40>),
    tiled_q4_1: Some(dots_tiled::<Q41>),
    ..super::avx2::KERNELS
};

/// Weight rows a tile takes at once: one to each 32-bit lane of a register. Rows go in groups
/// of 16, one row to a lane (a group's weight codes transposed once for the tile's tokens,
/// each token's codes broadcast): the per-block scaling costs one vector operation for 16
/// rows, where one row to a register paid it for every row.
const LANES: usize = 16;

/// Token tiles, largest first.
const TILES: [usize; 4] = [8, 4, 2, 1];

/// This set's many-row kernel for `KIND` (the driver checks the bounds).
fn dots<const KIND: u8>(rows: &[&[u8]], x: &TokenBlocks, t0: usize, out: &mut [f32], next: &[u8]) {
    let k = qdots::Tiles {
        kind: KIND,
        tokens: &TILES,
        tile: tile::<KIND>,
    };
    // SAFETY: installed only after `supported()`.
    unsafe { qdots::dots(&k, rows, x, t0, out, next) }
}

/// This set's many-row kernel for `KIND` over rows laid out in tiles (`tiles`).
fn dots_tiled<const KIND: u8>(tiles: &[u8], x: &TokenBlocks, t0: usize, out: &mut [f32]) {
    let k = qdots::TiledKernel {
        kind: KIND,
        tokens: &TILES,
        tile: tiled::<KIND>,
        one_token: tiled_one_token::<KIND>,
    };
    // SAFETY: installed only after `supported()`.
    unsafe { qdots::dots_tiled::<LANES>(&k, tiles, x, t0, out) }
}

/// The integer the block's sum of code products needs added (the arithmetic is `qdots`').
#[inline]
fn code_offset<const KIND: u8>(a: &ActBlock) -> i32 {
    match KIND {
        // vpdpbusd multiplies unsigned by signed: (w + 128)·x = w·x + 128·Σx.
        Q8 => -128 * a.isum,
        // Codes 0..15 stand for −8..7.
        Q40 => -8 * a.isum,
        _ => 0,
    }
}

/// 16 rows × `tokens` tokens (8, 4, 2 or 1) into `out[t·16 + lane]`.
///
/// # Safety
/// AVX-512 (this set's features); whole rows of `nb` blocks and `tokens` tokens of `nb` blocks
/// at `x`; `out` holds `tokens` × 16.
unsafe fn tile<const KIND: u8>(
    rp: &[*const u8; LANES],
    x: *const ActBlock,
    nb: usize,
    tokens: usize,
    out: &mut [f32],
    next: &[u8],
) {
    // SAFETY: the caller's promise, passed on.
    unsafe { tile_of::<KIND, _>(RowLanes::new(rp), x, nb, tokens, out, next) }
}

/// As [`tile`], the 16 rows a tile laid out by `tiles::tile_rows` from `p` (nothing to
/// prefetch).
///
/// # Safety
/// As [`tile`]: a whole tile of `nb` blocks a row at `p`.
unsafe fn tiled<const KIND: u8>(
    p: *const u8,
    x: *const ActBlock,
    nb: usize,
    tokens: usize,
    out: &mut [f32],
) {
    // SAFETY: the caller's promise, passed on.
    unsafe { tile_of::<KIND, _>(TiledLanes(p), x, nb, tokens, out, &[]) }
}

/// One token against whole tiles (`tiles`: their bytes), tile i's 16 results into
/// `out[16·i ..]`: [`tiled`]'s one-token tile over each in one loop, no call between tiles
/// (a decode step's products of a few dozen tiles paid a call's costs on each).
///
/// # Safety
/// AVX-512 (this set's features); `tiles` whole tiles of `nb` blocks a row, `nb` blocks at
/// `x`, and `out` 16 values a tile.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn tiled_one_token<const KIND: u8>(
    tiles: &[u8],
    x: *const ActBlock,
    nb: usize,
    out: &mut [f32],
) {
    let span = LANES * nb * block_bytes(KIND);
    for (tile, out) in tiles.chunks_exact(span).zip(out.chunks_exact_mut(LANES)) {
        // SAFETY: the caller's promise, for this tile.
        unsafe { tile_body::<KIND, 1, _>(TiledLanes(tile.as_ptr()), x, nb, out, &[]) }
    }
}

/// # Safety
/// As [`tile`], with `src` giving whole blocks.
#[inline(always)]
unsafe fn tile_of<const KIND: u8, S: Lanes>(
    src: S,
    x: *const ActBlock,
    nb: usize,
    tokens: usize,
    out: &mut [f32],
    next: &[u8],
) {
    // SAFETY: the caller's promise, passed on.
    unsafe {
        match tokens {
            8 => tile_t::<KIND, 8, S>(src, x, nb, out, next),
            4 => tile_t::<KIND, 4, S>(src, x, nb, out, next),
            2 => tile_t::<KIND, 2, S>(src, x, nb, out, next),
            _ => tile_t::<KIND, 1, S>(src, x, nb, out, next),
        }
    }
}

/// Where a tile's 16 rows' blocks come from: the rows themselves ([`RowLanes`]) or a tile laid
/// out for the kernel ([`TiledLanes`]). Either gives the same values, so a result does not
/// depend on the layout.
trait Lanes: Copy {
    /// Block `b`'s codes as vpdpbusd's unsigned operand: register j holds, in lane r, row r's
    /// codes 4j .. 4j + 4, matching 32-bit word j of an activation block (Q4: registers 4..8
    /// each code 16 times over, [`nibbles`]).
    ///
    /// # Safety
    /// AVX-512; block `b` is whole in every row.
    unsafe fn codes<const KIND: u8>(self, b: usize) -> [__m512i; 8];
    /// Block `b`'s scales of the 16 rows, and their mins (Q4_1; the scales again otherwise).
    ///
    /// # Safety
    /// As [`Lanes::codes`].
    unsafe fn scales<const KIND: u8>(self, b: usize) -> (__m512, __m512);
}

/// 16 rows by their first bytes: each block's codes transposed, its scales gathered.
#[derive(Clone, Copy)]
struct RowLanes<'a> {
    rp: &'a [*const u8; LANES],
    /// Each lane's row as a distance from the first.
    dist: [i64; LANES],
}

impl<'a> RowLanes<'a> {
    fn new(rp: &'a [*const u8; LANES]) -> Self {
        let base = rp[0];
        let dist = std::array::from_fn(|i| (rp[i] as usize).wrapping_sub(base as usize) as i64);
        RowLanes { rp, dist }
    }
}

impl Lanes for RowLanes<'_> {
    #[inline(always)]
    unsafe fn codes<const KIND: u8>(self, b: usize) -> [__m512i; 8] {
        // SAFETY: the caller's promise.
        unsafe { codes16::<KIND>(self.rp, b * block_bytes(KIND)) }
    }

    #[inline(always)]
    unsafe fn scales<const KIND: u8>(self, b: usize) -> (__m512, __m512) {
        // SAFETY: 16 i64 distances; block b of every row (the caller's promise).
        unsafe {
            let d = self.dist.as_ptr() as *const __m512i;
            let (lo, hi) = (_mm512_loadu_si512(d), _mm512_loadu_si512(d.add(1)));
            scales16::<KIND>(self.rp[0].add(b * block_bytes(KIND)), lo, hi)
        }
    }
}

// A tile's rows are a register's lanes.
const _: () = assert!(LANES == super::tiles::TILE_ROWS);

/// A tile laid out by `tiles::tile_rows`, from its first byte: every operand one load.
#[derive(Clone, Copy)]
struct TiledLanes(*const u8);

impl Lanes for TiledLanes {
    #[inline(always)]
    unsafe fn codes<const KIND: u8>(self, b: usize) -> [__m512i; 8] {
        let head = if KIND == Q41 { 4 } else { 2 };
        // SAFETY: a whole tile (the caller's promise): block b's codes at `head · 16` bytes
        // into its span, 64 bytes a register.
        unsafe {
            let p = self.0.add(b * LANES * block_bytes(KIND) + head * LANES);
            let zero = _mm512_setzero_si512();
            if KIND == Q8 {
                let flip = _mm512_set1_epi8(-128);
                lanes!(8, zero, |j| _mm512_xor_si512(
                    _mm512_loadu_si512(p.add(64 * j) as *const __m512i),
                    flip
                ))
            } else {
                nibbles(lanes!(4, zero, |j| _mm512_loadu_si512(
                    p.add(64 * j) as *const __m512i
                )))
            }
        }
    }

    #[inline(always)]
    unsafe fn scales<const KIND: u8>(self, b: usize) -> (__m512, __m512) {
        // SAFETY: a whole tile: block b's 16 f16 scales, then (Q4_1) its 16 mins.
        unsafe {
            let p = self.0.add(b * LANES * block_bytes(KIND));
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i));
            let m = if KIND == Q41 {
                _mm512_cvtph_ps(_mm256_loadu_si256(p.add(32) as *const __m256i))
            } else {
                d
            };
            (d, m)
        }
    }
}

/// 16 rows × `T` tokens into `out[t·16 + lane]`. Never inlined: each `T` gets its own
/// register allocation. The caller checks bounds.
#[inline(never)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn tile_t<const KIND: u8, const T: usize, S: Lanes>(
    src: S,
    x: *const ActBlock,
    nb: usize,
    out: &mut [f32],
    next: &[u8],
) {
    // SAFETY: the caller's promise, passed on.
    unsafe { tile_body::<KIND, T, S>(src, x, nb, out, next) }
}

/// [`tile_t`]'s work, inlined where it is called (in functions with this set's features).
///
/// # Safety
/// As [`tile_t`], from a function with this set's features.
#[inline(always)]
#[allow(clippy::needless_range_loop)]
unsafe fn tile_body<const KIND: u8, const T: usize, S: Lanes>(
    src: S,
    x: *const ActBlock,
    nb: usize,
    out: &mut [f32],
    next: &[u8],
) {
    assert!(out.len() >= T * LANES);
    // (No division where there is nothing to hint: a tile of a small product is short.)
    let step = if next.is_empty() {
        0
    } else {
        next.len().div_ceil(nb.max(1))
    };
    // SAFETY: this set's features (the caller's promise).
    let mut acc = [unsafe { _mm512_setzero_ps() }; T];
    for b in 0..nb {
        let ahead = (b * step).min(next.len())..((b + 1) * step).min(next.len());
        super::prefetch_far(&next[ahead]);
        // SAFETY: block b lies inside every row; token t's block b inside `x`.
        unsafe {
            let codes = src.codes::<KIND>(b);
            let (dw, mw) = src.scales::<KIND>(b);
            for t in 0..T {
                let a = &*x.add(t * nb + b);
                let q = a.qs.as_ptr() as *const i32;
                // Two chains: integer sums add exactly in any order.
                let mut s0 = _mm512_set1_epi32(code_offset::<KIND>(a));
                let mut s1 = _mm512_setzero_si512();
                let sum = if KIND == Q8 {
                    for j in 0..4 {
                        s0 = _mm512_dpbusd_epi32(
                            s0,
                            codes[2 * j],
                            _mm512_set1_epi32(q.add(2 * j).read_unaligned()),
                        );
                        s1 = _mm512_dpbusd_epi32(
                            s1,
                            codes[2 * j + 1],
                            _mm512_set1_epi32(q.add(2 * j + 1).read_unaligned()),
                        );
                    }
                    _mm512_add_epi32(s0, s1)
                } else {
                    // The high nibbles come 16 times over (`nibbles`): their chain's sum is
                    // a multiple of 16, divided exactly.
                    for j in 0..4 {
                        s0 = _mm512_dpbusd_epi32(
                            s0,
                            codes[j],
                            _mm512_set1_epi32(q.add(j).read_unaligned()),
                        );
                        s1 = _mm512_dpbusd_epi32(
                            s1,
                            codes[4 + j],
                            _mm512_set1_epi32(q.add(4 + j).read_unaligned()),
                        );
                    }
                    _mm512_add_epi32(s0, _mm512_srai_epi32::<4>(s1))
                };
                let f = _mm512_cvtepi32_ps(sum);
                let scale = _mm512_mul_ps(dw, _mm512_set1_ps(a.d));
                acc[t] = _mm512_fmadd_ps(scale, f, acc[t]);
                if KIND == Q41 {
                    acc[t] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.s), acc[t]);
                }
            }
        }
    }
    for t in 0..T {
        // SAFETY: T ≤ 8 rows of 16 floats.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(t * LANES), acc[t]) };
    }
}

/// The 16 bytes at `at` of 16 rows, transposed: register j holds, in lane r, row r's
/// bytes 4j .. 4j + 4.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
unsafe fn transpose16(rp: &[*const u8; LANES], at: usize) -> [__m512i; 4] {
    // z[k]'s 128-bit lane q: row 4q + k.
    let mut z = [_mm512_setzero_si512(); 4];
    for (k, zk) in z.iter_mut().enumerate() {
        // SAFETY: the caller passes 16 readable bytes at `at` in every row.
        unsafe {
            let l = |q: usize| _mm_loadu_si128(rp[4 * q + k].add(at) as *const __m128i);
            let v = _mm512_castsi128_si512(l(0));
            let v = _mm512_inserti32x4::<1>(v, l(1));
            let v = _mm512_inserti32x4::<2>(v, l(2));
            *zk = _mm512_inserti32x4::<3>(v, l(3));
        }
    }
    // A 4×4 transpose of 32-bit words within each 128-bit lane.
    let a = _mm512_unpacklo_epi32(z[0], z[1]);
    let b = _mm512_unpackhi_epi32(z[0], z[1]);
    let c = _mm512_unpacklo_epi32(z[2], z[3]);
    let d = _mm512_unpackhi_epi32(z[2], z[3]);
    [
        _mm512_unpacklo_epi64(a, c),
        _mm512_unpackhi_epi64(a, c),
        _mm512_unpacklo_epi64(b, d),
        _mm512_unpackhi_epi64(b, d),
    ]
}

/// Block codes (at `at` in each row) of 16 rows as vpdpbusd's unsigned operand:
/// register j holds, in lane r, row r's codes 4j .. 4j + 4, matching 32-bit word j of an
/// activation block (as [`Lanes::codes`]).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
unsafe fn codes16<const KIND: u8>(rp: &[*const u8; LANES], at: usize) -> [__m512i; 8] {
    // SAFETY: whole blocks at `at` (the caller's promise).
    unsafe {
        if KIND == Q8 {
            let a = transpose16(rp, at + 2);
            let b = transpose16(rp, at + 18);
            let flip = _mm512_set1_epi8(-128);
            lanes!(8, _mm512_setzero_si512(), |j| _mm512_xor_si512(
                if j < 4 { a[j] } else { b[j - 4] },
                flip
            ))
        } else {
            nibbles(transpose16(rp, at + block_bytes(KIND) - 16))
        }
    }
}

/// Q4 codes from their bytes in lane order (byte i holds code i in its low nibble and code
/// i + 16 in its high one): the low nibbles' registers, then the high nibbles' left in place,
/// each 16 times its code (one operation a register where a shift took two more; vpdpbusd's
/// sums stay exact, and the tile divides their sum by 16).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
fn nibbles(t: [__m512i; 4]) -> [__m512i; 8] {
    let (low, high) = (_mm512_set1_epi8(0x0f), _mm512_set1_epi8(0xf0u8 as i8));
    lanes!(8, _mm512_setzero_si512(), |j| {
        if j < 4 {
            _mm512_and_si512(t[j], low)
        } else {
            _mm512_and_si512(t[j - 4], high)
        }
    })
}

/// The scales of one block of 16 rows (`p`: the first row's block; `lo`, `hi`: each
/// lane's row as a distance from it), and the mins (Q4_1; the scales again otherwise).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,f16c")]
unsafe fn scales16<const KIND: u8>(p: *const u8, lo: __m512i, hi: __m512i) -> (__m512, __m512) {
    // SAFETY: every block starts with 4 readable bytes (the f16 scale, then the min or
    // codes).
    let (g0, g1) = unsafe {
        (
            _mm512_i64gather_epi32::<1>(lo, p as *const i32),
            _mm512_i64gather_epi32::<1>(hi, p as *const i32),
        )
    };
    let words = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(g0), g1);
    let d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(words));
    let m = if KIND == Q41 {
        _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(words)))
    } else {
        d
    };
    (d, m)
}

fn dot_q2_k(w: &[BlockQ2K], x: &[ActBlockK]) -> f32 {
    // SAFETY: installed only after `supported()` (and the AVX2 set's check).
    unsafe { super::kq::x86::vnni::dot_q2_k(w, x) }
}
fn dot_q3_k(w: &[BlockQ3K], x: &[ActBlockK]) -> f32 {
    // SAFETY: as above.
    unsafe { super::kq::x86::vnni::dot_q3_k(w, x) }
}
fn dot_q4_k(w: &[BlockQ4K], x: &[ActBlockK]) -> f32 {
    // SAFETY: as above.
    unsafe { super::kq::x86::vnni::dot_q4_k(w, x) }
}
fn dot_q5_k(w: &[BlockQ5K], x: &[ActBlockK]) -> f32 {
    // SAFETY: as above.
    unsafe { super::kq::x86::vnni::dot_q5_k(w, x) }
}
fn dot_q6_k(w: &[BlockQ6K], x: &[ActBlockK]) -> f32 {
    // SAFETY: as above.
    unsafe { super::kq::x86::vnni::dot_q6_k(w, x) }
}

fn dot_q8_0(w: &[BlockQ8_0], x: &[ActBlock]) -> f32 {
    // SAFETY: installed only after `supported()` (and the AVX2 set's check).
    unsafe { dot_one::<Q8>(bytemuck::cast_slice(w), x) }
}
fn dot_q4_0(w: &[BlockQ4_0], x: &[ActBlock]) -> f32 {
    // SAFETY: as above.
    unsafe { dot_one::<Q40>(bytemuck::cast_slice(w), x) }
}
fn dot_q4_1(w: &[BlockQ4_1], x: &[ActBlock]) -> f32 {
    // SAFETY: as above.
    unsafe { dot_one::<Q41>(bytemuck::cast_slice(w), x) }
}

/// One row against one token: the tile's arithmetic for a single lane.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn dot_one<const KIND: u8>(w: &[u8], x: &[ActBlock]) -> f32 {
    let block = block_bytes(KIND);
    let nb = (w.len() / block).min(x.len());
    let mut acc = 0f32;
    for (b, a) in x[..nb].iter().enumerate() {
        // SAFETY: block b lies inside `w`; 32 codes in `a`.
        acc = unsafe {
            let p = w.as_ptr().add(b * block);
            let codes = if KIND == Q8 {
                _mm256_xor_si256(
                    _mm256_loadu_si256(p.add(2) as *const __m256i),
                    _mm256_set1_epi8(-128),
                )
            } else {
                let packed = _mm_loadu_si128(p.add(block - 16) as *const __m128i);
                let mask = _mm_set1_epi8(0x0f);
                _mm256_set_m128i(
                    _mm_and_si128(_mm_srli_epi16::<4>(packed), mask),
                    _mm_and_si128(packed, mask),
                )
            };
            let xs = _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i);
            let s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), codes, xs);
            let sum = hsum_i32(s) + code_offset::<KIND>(a);
            qdots::block_step::<KIND>(acc, p, sum, a, half_at)
        };
    }
    acc
}
