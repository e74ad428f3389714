//! Row kernels for Q5_0/Q5_1 (against 32-value [`ActBlock`]s, as Q4_0/Q4_1) and the K-quants
//! Q2_K…Q6_K (against 256-value [`ActBlockK`]s with per-16 sums, llama.cpp's Q8_K): a portable
//! reference and AVX2 versions.
//!
//! Every kernel sums exact integer products per sub-block, then scales in f32; the AVX2 ones
//! move the constant code offsets (Q3_K's −4, Q6_K's −32) and the mins into one correction per
//! super-block computed from the activation block's per-16 sums.

use super::ActBlock;
use crate::tensor::{
    BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5_0, BlockQ5_1, BlockQ5K, BlockQ6K, QK_K,
    blocks::{q3k_scales, scale_min_k4},
};

/// 256 activations quantized to 8 bits, as llama.cpp's `block_q8_K`: x ≈ d·q with d an f32,
/// and `bsums[j]` = Σ q over values 16j..16j+16.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ActBlockK {
    pub d: f32,
    pub qs: [i8; QK_K],
    pub bsums: [i16; QK_K / 16],
}

impl Default for ActBlockK {
    fn default() -> Self {
        ActBlockK {
            d: 0.0,
            qs: [0; QK_K],
            bsums: [0; QK_K / 16],
        }
    }
}

/// llama.cpp's `quantize_row_q8_K` (the reference, which its x86 build uses too): d = −max/127
/// where max is the value of largest magnitude, q = nearest-even(x/d).
pub fn quantize_k(x: &[f32], out: &mut [ActBlockK]) {
    for (xs, o) in x.chunks_exact(QK_K).zip(out.iter_mut()) {
        let (mut amax, mut max) = (0f32, 0f32);
        for &v in xs {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            *o = ActBlockK::default();
            continue;
        }
        let iscale = -127.0 / max;
        for (q, &v) in o.qs.iter_mut().zip(xs) {
            // ggml's nearest_int: round half to even through the float magic number.
            let r = ((v * iscale + 12_582_912.0).to_bits() & 0x007f_ffff) as i32 - 0x0040_0000;
            *q = r.min(127) as i8;
        }
        for (s, q) in o.bsums.iter_mut().zip(o.qs.chunks_exact(16)) {
            *s = q.iter().map(|&v| v as i16).sum();
        }
        o.d = 1.0 / iscale;
    }
}

pub mod portable {
    use super::*;

    /// Σ over a 32-value block of 5-bit codes × activation codes.
    fn q5_dot(qh: [u8; 4], qs: &[u8; 16], a: &ActBlock) -> i32 {
        let qh = u32::from_le_bytes(qh);
        (0..32)
            .map(|j| {
                let nib = if j < 16 {
                    qs[j] & 0x0f
                } else {
                    qs[j - 16] >> 4
                };
                let q = nib as i32 | ((((qh >> j) & 1) as i32) << 4);
                q * a.qs[j] as i32
            })
            .sum()
    }

    pub fn dot_q5_0(w: &[BlockQ5_0], x: &[ActBlock]) -> f32 {
        w.iter()
            .zip(x)
            .map(|(b, a)| {
                let dot = q5_dot(b.qh, &b.qs, a) - 16 * a.isum;
                b.d.to_f32() * a.d * dot as f32
            })
            .sum()
    }

    pub fn dot_q5_1(w: &[BlockQ5_1], x: &[ActBlock]) -> f32 {
        w.iter()
            .zip(x)
            .map(|(b, a)| {
                let dot = q5_dot(b.qh, &b.qs, a);
                b.d.to_f32() * a.d * dot as f32 + b.m.to_f32() * a.s
            })
            .sum()
    }

    /// (Σ_s scale_s · Σ_{v in s} q_v·y_v) over the 16 sub-blocks of 16 of a K-quant block whose
    /// value v has code `code(v)`.
    fn sub16_dot(code: impl Fn(usize) -> i32, scale: impl Fn(usize) -> i32, a: &ActBlockK) -> i32 {
        (0..16)
            .map(|s| {
                let dot: i32 = (16 * s..16 * s + 16)
                    .map(|v| code(v) * a.qs[v] as i32)
                    .sum();
                scale(s) * dot
            })
            .sum()
    }

    pub fn dot_q2_k(w: &[BlockQ2K], x: &[ActBlockK]) -> f32 {
        w.iter()
            .zip(x)
            .map(|(b, a)| {
                let code = |v: usize| {
                    let (n, j, r) = (v / 128, (v % 128) / 32, v % 32);
                    ((b.qs[32 * n + r] >> (2 * j)) & 3) as i32
                };
                let isum = sub16_dot(code, |s| (b.scales[s] & 0x0f) as i32, a);
                let mins: i32 = (0..16)
                    .map(|s| (b.scales[s] >> 4) as i32 * a.bsums[s] as i32)
                    .sum();
                a.d * b.d.to_f32() * isum as f32 - a.d * b.dmin.to_f32() * mins as f32
            })
            .sum()
    }

    pub fn dot_q3_k(w: &[BlockQ3K], x: &[ActBlockK]) -> f32 {
        w.iter()
            .zip(x)
            .map(|(b, a)| {
                let sc = q3k_scales(&b.scales);
                let code = |v: usize| {
                    let (n, j, r) = (v / 128, (v % 128) / 32, v % 32);
                    let low = ((b.qs[32 * n + r] >> (2 * j)) & 3) as i32;
                    let high = (b.hmask[r] >> (4 * n + j)) & 1;
                    low - if high != 0 { 0 } else { 4 }
                };
                let isum = sub16_dot(code, |s| sc[s] as i32, a);
                a.d * b.d.to_f32() * isum as f32
            })
            .sum()
    }

    /// Q4_K (`FIVE = false`) and Q5_K: Σ over 8 sub-blocks of 32, and the mins against the
    /// activation sums.
    fn dot_qk_32(
        d: f32,
        dmin: f32,
        scales: &[u8],
        code: impl Fn(usize) -> i32,
        a: &ActBlockK,
    ) -> f32 {
        let (mut isum, mut mins) = (0i32, 0i32);
        for j in 0..8 {
            let (sc, m) = scale_min_k4(j, scales);
            let dot: i32 = (32 * j..32 * j + 32)
                .map(|v| code(v) * a.qs[v] as i32)
                .sum();
            isum += sc as i32 * dot;
            mins += m as i32 * (a.bsums[2 * j] as i32 + a.bsums[2 * j + 1] as i32);
        }
        a.d * d * isum as f32 - a.d * dmin * mins as f32
    }

    pub fn dot_q4_k(w: &[BlockQ4K], x: &[ActBlockK]) -> f32 {
        w.iter()
            .zip(x)
            .map(|(b, a)| {
                let code = |v: usize| {
                    let (c, hi, l) = (v / 64, (v / 32) % 2, v % 32);
                    let q = b.qs[32 * c + l];
                    (if hi == 1 { q >> 4 } else { q & 0x0f }) as i32
                };
                dot_qk_32(b.d.to_f32(), b.dmin.to_f32(), &b.scales, code, a)
            })
            .sum()
    }

    pub fn dot_q5_k(w: &[BlockQ5K], x: &[ActBlockK]) -> f32 {
        w.iter()
            .zip(x)
            .map(|(b, a)| {
                let code = |v: usize| {
                    let (c, hi, l) = (v / 64, (v / 32) % 2, v % 32);
                    let q = b.qs[32 * c + l];
                    let low = if hi == 1 { q >> 4 } else { q & 0x0f };
                    let h = (b.qh[l] >> (2 * c + hi)) & 1;
                    (low | (h << 4)) as i32
                };
                dot_qk_32(b.d.to_f32(), b.dmin.to_f32(), &b.scales, code, a)
            })
            .sum()
    }

    pub fn dot_q6_k(w: &[BlockQ6K], x: &[ActBlockK]) -> f32 {
        w.iter()
            .zip(x)
            .map(|(b, a)| {
                let code = |v: usize| {
                    let (half, k, l) = (v / 128, (v % 128) / 32, v % 32);
                    let lo = b.ql[64 * half + l + 32 * (k & 1)];
                    let lo = if k < 2 { lo & 0x0f } else { lo >> 4 };
                    let hi = (b.qh[32 * half + l] >> (2 * k)) & 3;
                    (lo | (hi << 4)) as i32 - 32
                };
                let isum = sub16_dot(code, |s| b.scales[s] as i32, a);
                a.d * b.d.to_f32() * isum as f32
            })
            .sum()
    }
}

#[cfg(target_arch = "x86_64")]
pub mod x86 {
    //! AVX2 kernels. Each 32-value group of codes (unsigned, < 64) meets its 32 activation codes
    //! in one `maddubs` (pairs → 16 i16, no saturation at these ranges), then one `madd` by the
    //! two sub-block scales of the group (→ 8 i32).

    use super::*;
    use std::arch::x86_64::*;

    /// Horizontal sum of 8 f32 lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
        _mm_cvtss_f32(s)
    }

    /// Horizontal sum of 8 i32 lanes.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(in crate::backend::cpu::kernels) fn hsum_i32(v: __m256i) -> i32 {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<1>(s));
        _mm_cvtsi128_si32(s)
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn load256(p: *const u8) -> __m256i {
        // SAFETY: the caller passes 32 readable bytes.
        unsafe { _mm256_loadu_si256(p as *const __m256i) }
    }

    /// 32 unsigned codes · 32 activation codes, weighted per 16-value half by `scales`
    /// (16 i16 lanes: 8 of the first sub-block's scale, 8 of the second's) → 8 i32.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn group(q: __m256i, y: __m256i, scales: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(q, y), scales)
    }

    /// From 16 i8 scales, the i16 vector [scale 2g × 8, scale 2g+1 × 8] for group g.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn pair_scales(scales: __m128i, g: usize) -> __m256i {
        let (a, b) = ((2 * g) as i8, (2 * g + 1) as i8);
        let idx = _mm_setr_epi8(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b);
        _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, idx))
    }

    /// `Σ_s scales[s] · bsums[s]` over 16 sub-blocks (scales as 16 i8).
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn scaled_bsums(scales: __m128i, a: &ActBlockK) -> i32 {
        // SAFETY: bsums holds 16 i16 = 32 bytes.
        let b = unsafe { load256(a.bsums.as_ptr() as *const u8) };
        hsum_i32(_mm256_madd_epi16(_mm256_cvtepi8_epi16(scales), b))
    }

    /// The 32 values of a 32-value block's 5-bit codes: low nibbles, high nibbles, fifth bits
    /// from `qh` (bit j of the u32 → value j).
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn q5_codes(qh: u32, qs: *const u8) -> __m256i {
        // SAFETY: 16 bytes of nibbles at qs.
        let packed = unsafe { _mm_loadu_si128(qs as *const __m128i) };
        let mask = _mm_set1_epi8(0x0f);
        let lo = _mm_and_si128(packed, mask);
        let hi = _mm_and_si128(_mm_srli_epi16::<4>(packed), mask);
        let nibbles = _mm256_set_m128i(hi, lo);
        // Byte i of qh broadcast to values 8i..8i+8, then each value's own bit selected.
        let spread = _mm256_shuffle_epi8(
            _mm256_set1_epi32(qh as i32),
            _mm256_setr_epi8(
                0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3,
                3, 3, 3, 3,
            ),
        );
        let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
        _mm256_or_si256(nibbles, _mm256_and_si256(set, _mm256_set1_epi8(0x10)))
    }

    /// Eight copies of an f16 (bits) as f32. Scale arithmetic stays in vectors: a scalar
    /// conversion compiles to an insert that merges into whatever register is free (often an
    /// accumulator), which chains every block to the one before.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    pub(in crate::backend::cpu::kernels) fn h2f8(bits: u16) -> __m256 {
        _mm256_cvtph_ps(_mm_set1_epi16(bits as i16))
    }

    /// Eight copies of an i32 as f32 (a vector conversion: no false dependency).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn i2f8(v: i32) -> __m256 {
        _mm256_cvtepi32_ps(_mm256_set1_epi32(v))
    }

    /// `d_x · d_w` in every lane.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    fn scale8(dx: f32, dw: half::f16) -> __m256 {
        _mm256_mul_ps(_mm256_set1_ps(dx), h2f8(dw.to_bits()))
    }

    /// Q5_0 (`WITH_MIN = false`, blocks of 22 bytes) and Q5_1 (24 bytes).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q5<const WITH_MIN: bool>(w: &[u8], x: &[ActBlock]) -> f32 {
        let block = if WITH_MIN { 24 } else { 22 };
        let header = if WITH_MIN { 4 } else { 2 };
        let n = (w.len() / block).min(x.len());
        let p = w.as_ptr();
        let ones = _mm256_set1_epi16(1);
        let (mut acc, mut off) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for (i, a) in x[..n].iter().enumerate() {
            // SAFETY: block i lies inside `w` (i < n); the activation block has 32 codes.
            let (q, y, d_bits, m_bits) = unsafe {
                let b = p.add(i * block);
                let qh = u32::from_le((b.add(header) as *const u32).read_unaligned());
                (
                    q5_codes(qh, b.add(header + 4)),
                    load256(a.qs.as_ptr() as *const u8),
                    u16::from_le((b as *const u16).read_unaligned()),
                    if WITH_MIN {
                        u16::from_le((b.add(2) as *const u16).read_unaligned())
                    } else {
                        0
                    },
                )
            };
            let prod = if WITH_MIN {
                _mm256_maddubs_epi16(q, y)
            } else {
                // Signed codes q − 16: |q − 16| times y carrying the code's sign.
                let qs = _mm256_sub_epi8(q, _mm256_set1_epi8(16));
                _mm256_maddubs_epi16(_mm256_sign_epi8(qs, qs), _mm256_sign_epi8(y, qs))
            };
            let dot = _mm256_madd_epi16(prod, ones);
            let d = _mm256_mul_ps(h2f8(d_bits), _mm256_set1_ps(a.d));
            acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(dot), acc);
            if WITH_MIN {
                off = _mm256_fmadd_ps(h2f8(m_bits), _mm256_set1_ps(a.s), off);
            }
        }
        // Every lane of `off` holds the same sum.
        hsum(acc) + _mm256_cvtss_f32(off)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q2_k(w: &[BlockQ2K], x: &[ActBlockK]) -> f32 {
        let m3 = _mm256_set1_epi8(3);
        let mut acc = _mm256_setzero_ps();
        let mut mins_acc = _mm256_setzero_ps();
        for (b, a) in w.iter().zip(x) {
            // SAFETY: whole blocks: 16 scale bytes, 64 code bytes, 256 activation codes.
            unsafe {
                let sc8 = _mm_loadu_si128(b.scales.as_ptr() as *const __m128i);
                let scales = _mm_and_si128(sc8, _mm_set1_epi8(0x0f));
                let mins = _mm_and_si128(_mm_srli_epi16::<4>(sc8), _mm_set1_epi8(0x0f));
                let mut sumi = _mm256_setzero_si256();
                for n in 0..2 {
                    let mut q = load256(b.qs.as_ptr().add(32 * n));
                    for j in 0..4 {
                        let g = 4 * n + j;
                        let y = load256(a.qs.as_ptr().add(32 * g) as *const u8);
                        let codes = _mm256_and_si256(q, m3);
                        sumi = _mm256_add_epi32(sumi, group(codes, y, pair_scales(scales, g)));
                        q = _mm256_srli_epi16::<2>(q);
                    }
                }
                acc = _mm256_fmadd_ps(scale8(a.d, b.d), _mm256_cvtepi32_ps(sumi), acc);
                let m = i2f8(scaled_bsums(mins, a));
                mins_acc = _mm256_fmadd_ps(scale8(a.d, b.dmin), m, mins_acc);
            }
        }
        hsum(acc) - _mm256_cvtss_f32(mins_acc)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q3_k(w: &[BlockQ3K], x: &[ActBlockK]) -> f32 {
        let m3 = _mm256_set1_epi8(3);
        let one = _mm256_set1_epi8(1);
        let mut acc = _mm256_setzero_ps();
        for (b, a) in w.iter().zip(x) {
            let scales = q3k_scales_simd(&b.scales);
            // SAFETY: whole blocks: 32 hmask bytes, 64 code bytes, 256 activations.
            unsafe {
                let mut hm = load256(b.hmask.as_ptr());
                let mut sumi = _mm256_setzero_si256();
                for n in 0..2 {
                    let mut q = load256(b.qs.as_ptr().add(32 * n));
                    for j in 0..4 {
                        let g = 4 * n + j;
                        let y = load256(a.qs.as_ptr().add(32 * g) as *const u8);
                        // code + 4 = low two bits | third bit · 4 (0..8, unsigned).
                        let high = _mm256_slli_epi16::<2>(_mm256_and_si256(hm, one));
                        let codes = _mm256_or_si256(_mm256_and_si256(q, m3), high);
                        sumi = _mm256_add_epi32(sumi, group(codes, y, pair_scales(scales, g)));
                        q = _mm256_srli_epi16::<2>(q);
                        hm = _mm256_srli_epi16::<1>(hm);
                    }
                }
                // Σ sc·(code + 4)·y − 4·Σ sc·Σy (the correction in lane 0).
                let corr = _mm256_setr_epi32(4 * scaled_bsums(scales, a), 0, 0, 0, 0, 0, 0, 0);
                let total = _mm256_sub_epi32(sumi, corr);
                acc = _mm256_fmadd_ps(scale8(a.d, b.d), _mm256_cvtepi32_ps(total), acc);
            }
        }
        hsum(acc)
    }

    /// The 12 scale bytes of a K-quant block as three little-endian words.
    #[inline]
    fn words(q: &[u8; 12]) -> [u32; 3] {
        std::array::from_fn(|i| {
            u32::from_le_bytes([q[4 * i], q[4 * i + 1], q[4 * i + 2], q[4 * i + 3]])
        })
    }

    const LOW6: u32 = 0x3f3f_3f3f;
    const LOW4: u32 = 0x0f0f_0f0f;
    const LOW2: u32 = 0x0303_0303;

    /// The 8 scales and 8 mins of a Q4_K/Q5_K block, each byte repeated (one per 16-value half
    /// of its sub-block): scales 0..4 are the low 6 bits of bytes 0..4, mins 0..4 of bytes 4..8;
    /// scales and mins 4..8 take their low 4 bits from the nibbles of bytes 8..12 and their top 2
    /// from the top bits of bytes 0..4 and 4..8.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn k4_scales_mins(q: &[u8; 12]) -> (__m128i, __m128i) {
        let [w0, w1, w2] = words(q);
        let sc = _mm_set_epi32(
            0,
            0,
            ((w2 & LOW4) | (((w0 >> 6) & LOW2) << 4)) as i32,
            (w0 & LOW6) as i32,
        );
        let mn = _mm_set_epi32(
            0,
            0,
            (((w2 >> 4) & LOW4) | (((w1 >> 6) & LOW2) << 4)) as i32,
            (w1 & LOW6) as i32,
        );
        (_mm_unpacklo_epi8(sc, sc), _mm_unpacklo_epi8(mn, mn))
    }

    /// The 16 scales of a Q3_K block minus 32, as i8: low 4 bits from the nibbles of bytes 0..8
    /// (low nibbles first), top 2 bits from the bit pairs of bytes 8..12.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn q3k_scales_simd(q: &[u8; 12]) -> __m128i {
        let [w0, w1, w2] = words(q);
        let v = _mm_set_epi32(
            (((w1 >> 4) & LOW4) | (((w2 >> 6) & LOW2) << 4)) as i32,
            (((w0 >> 4) & LOW4) | (((w2 >> 4) & LOW2) << 4)) as i32,
            ((w1 & LOW4) | (((w2 >> 2) & LOW2) << 4)) as i32,
            ((w0 & LOW4) | ((w2 & LOW2) << 4)) as i32,
        );
        _mm_sub_epi8(v, _mm_set1_epi8(32))
    }

    /// Q4_K (`FIVE = false`) and Q5_K over whole blocks; `qs`/`qh` point at each block's codes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn qk_32<const FIVE: bool>(
        scales: &[u8; 12],
        qh: *const u8,
        qs: *const u8,
        a: &ActBlockK,
    ) -> (__m256i, i32) {
        let m4 = _mm256_set1_epi8(0x0f);
        let one = _mm256_set1_epi8(1);
        // Sub-block j's scale and min, each repeated for its two 16-value halves.
        let (sc, mn) = k4_scales_mins(scales);
        let mut sumi = _mm256_setzero_si256();
        // SAFETY: the caller passes whole blocks (128 code bytes, 32 high-bit bytes for Q5_K).
        unsafe {
            let mut h = if FIVE {
                load256(qh)
            } else {
                _mm256_setzero_si256()
            };
            for c in 0..4 {
                let q = load256(qs.add(32 * c));
                let (mut lo, mut hi) = (
                    _mm256_and_si256(q, m4),
                    _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4),
                );
                if FIVE {
                    lo = _mm256_or_si256(lo, _mm256_slli_epi16::<4>(_mm256_and_si256(h, one)));
                    h = _mm256_srli_epi16::<1>(h);
                    hi = _mm256_or_si256(hi, _mm256_slli_epi16::<4>(_mm256_and_si256(h, one)));
                    h = _mm256_srli_epi16::<1>(h);
                }
                let y0 = load256(a.qs.as_ptr().add(64 * c) as *const u8);
                let y1 = load256(a.qs.as_ptr().add(64 * c + 32) as *const u8);
                sumi = _mm256_add_epi32(sumi, group(lo, y0, pair_scales(sc, 2 * c)));
                sumi = _mm256_add_epi32(sumi, group(hi, y1, pair_scales(sc, 2 * c + 1)));
            }
            // Each min appears twice in `mn`, once per 16-value half: Σ m_j·(bsum 2j + 2j+1).
            (sumi, scaled_bsums(mn, a))
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q4_k(w: &[BlockQ4K], x: &[ActBlockK]) -> f32 {
        let (mut acc, mut mins) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for (b, a) in w.iter().zip(x) {
            // SAFETY: whole blocks.
            let (sumi, m) =
                unsafe { qk_32::<false>(&b.scales, std::ptr::null(), b.qs.as_ptr(), a) };
            acc = _mm256_fmadd_ps(scale8(a.d, b.d), _mm256_cvtepi32_ps(sumi), acc);
            mins = _mm256_fmadd_ps(scale8(a.d, b.dmin), i2f8(m), mins);
        }
        hsum(acc) - _mm256_cvtss_f32(mins)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q5_k(w: &[BlockQ5K], x: &[ActBlockK]) -> f32 {
        let (mut acc, mut mins) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for (b, a) in w.iter().zip(x) {
            // SAFETY: whole blocks.
            let (sumi, m) = unsafe { qk_32::<true>(&b.scales, b.qh.as_ptr(), b.qs.as_ptr(), a) };
            acc = _mm256_fmadd_ps(scale8(a.d, b.d), _mm256_cvtepi32_ps(sumi), acc);
            mins = _mm256_fmadd_ps(scale8(a.d, b.dmin), i2f8(m), mins);
        }
        hsum(acc) - _mm256_cvtss_f32(mins)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q6_k(w: &[BlockQ6K], x: &[ActBlockK]) -> f32 {
        let m4 = _mm256_set1_epi8(0x0f);
        let m3 = _mm256_set1_epi8(3);
        let mut acc = _mm256_setzero_ps();
        for (b, a) in w.iter().zip(x) {
            // SAFETY: whole blocks: 128 + 64 code bytes, 16 scales, 256 activations.
            unsafe {
                let scales = _mm_loadu_si128(b.scales.as_ptr() as *const __m128i);
                let mut sumi = _mm256_setzero_si256();
                for half in 0..2 {
                    let l0 = load256(b.ql.as_ptr().add(64 * half));
                    let l1 = load256(b.ql.as_ptr().add(64 * half + 32));
                    let h = load256(b.qh.as_ptr().add(32 * half));
                    let lows = [
                        _mm256_and_si256(l0, m4),
                        _mm256_and_si256(l1, m4),
                        _mm256_and_si256(_mm256_srli_epi16::<4>(l0), m4),
                        _mm256_and_si256(_mm256_srli_epi16::<4>(l1), m4),
                    ];
                    let highs = [
                        _mm256_and_si256(h, m3),
                        _mm256_and_si256(_mm256_srli_epi16::<2>(h), m3),
                        _mm256_and_si256(_mm256_srli_epi16::<4>(h), m3),
                        _mm256_and_si256(_mm256_srli_epi16::<6>(h), m3),
                    ];
                    for k in 0..4 {
                        let g = 4 * half + k;
                        let codes = _mm256_or_si256(lows[k], _mm256_slli_epi16::<4>(highs[k]));
                        let y = load256(a.qs.as_ptr().add(32 * g) as *const u8);
                        sumi = _mm256_add_epi32(sumi, group(codes, y, pair_scales(scales, g)));
                    }
                }
                // Codes are stored + 32: Σ sc·(q + 32)·y − 32·Σ sc·Σy.
                let total = _mm256_sub_epi32(
                    sumi,
                    _mm256_setr_epi32(32 * scaled_bsums(scales, a), 0, 0, 0, 0, 0, 0, 0),
                );
                acc = _mm256_fmadd_ps(scale8(a.d, b.d), _mm256_cvtepi32_ps(total), acc);
            }
        }
        hsum(acc)
    }

    /// AVX-512 VNNI versions of the K-quants: 64 codes per
    /// `vpdpbusd` (u8 × i8, four products summed per i32 lane), the lane sums weighted by their
    /// sub-block scales with one 32-bit multiply.
    pub mod vnni {
        use super::*;

        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn load512(p: *const u8) -> __m512i {
            // SAFETY: the caller passes 64 readable bytes.
            unsafe { _mm512_loadu_si512(p as *const _) }
        }

        /// Two 32-byte halves as one register (`lo` in lanes 0..8).
        #[inline]
        #[target_feature(enable = "avx512f")]
        fn join(lo: __m256i, hi: __m256i) -> __m512i {
            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
        }

        /// i32 lane i of the result = lane `first + (i >> SHIFT)` of `v`: spreads per-sub-block
        /// scales over the lanes that hold that sub-block's partial sums.
        #[inline]
        #[target_feature(enable = "avx512f")]
        fn spread<const SHIFT: u32>(v: __m512i, first: i32) -> __m512i {
            let iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            let idx = _mm512_add_epi32(_mm512_set1_epi32(first), _mm512_srli_epi32::<SHIFT>(iota));
            _mm512_permutexvar_epi32(idx, v)
        }

        /// Q6_K codes of 32 values: `low` nibbles | the 2-bit pairs of `h` at `SHIFT` as bits 4-5.
        #[inline]
        #[target_feature(enable = "avx2")]
        fn q6_codes<const SHIFT: i32>(low: __m256i, h: __m256i) -> __m256i {
            let high = _mm256_and_si256(_mm256_srli_epi16::<SHIFT>(h), _mm256_set1_epi8(3));
            _mm256_or_si256(low, _mm256_slli_epi16::<4>(high))
        }

        /// `d_x · d_w` in 16 lanes.
        #[inline]
        #[target_feature(enable = "avx512f,avx2,f16c")]
        fn scale16(dx: f32, dw: half::f16) -> __m512 {
            _mm512_mul_ps(
                _mm512_set1_ps(dx),
                _mm512_cvtph_ps(_mm256_set1_epi16(dw.to_bits() as i16)),
            )
        }

        /// Q4_K (`FIVE = false`) and Q5_K: Σ_j sc_j·Σ q·y as 16 i32 lanes, and Σ_j m_j·Σ y.
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
        unsafe fn qk_32<const FIVE: bool>(
            scales: &[u8; 12],
            qh: *const u8,
            qs: *const u8,
            a: &ActBlockK,
        ) -> (__m512i, i32) {
            let [w0, _, w2] = words(scales);
            let sc = _mm_set_epi32(
                0,
                0,
                ((w2 & LOW4) | (((w0 >> 6) & LOW2) << 4)) as i32,
                (w0 & LOW6) as i32,
            );
            let sc32 = _mm512_cvtepu8_epi32(sc);
            let (_, mn) = k4_scales_mins(scales);
            let m4 = _mm512_set1_epi8(0x0f);
            let one = _mm256_set1_epi8(1);
            let mut isum = _mm512_setzero_si512();
            // SAFETY: the caller passes whole blocks (128 code bytes, 32 high-bit bytes for
            // Q5_K); the activation block has 256 codes.
            unsafe {
                let mut h = if FIVE {
                    load256(qh)
                } else {
                    _mm256_setzero_si256()
                };
                for c in 0..4 {
                    let q = load256(qs.add(32 * c));
                    // Values 64c..64c+32 (low nibbles), then 64c+32..64c+64 (high nibbles).
                    let mut z = _mm512_and_si512(join(q, _mm256_srli_epi16::<4>(q)), m4);
                    if FIVE {
                        let fifth = join(
                            _mm256_and_si256(h, one),
                            _mm256_and_si256(_mm256_srli_epi16::<1>(h), one),
                        );
                        z = _mm512_or_si512(z, _mm512_slli_epi16::<4>(fifth));
                        h = _mm256_srli_epi16::<2>(h);
                    }
                    let y = load512(a.qs.as_ptr().add(64 * c) as *const u8);
                    let dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), z, y);
                    isum = _mm512_add_epi32(
                        isum,
                        _mm512_mullo_epi32(dot, spread::<3>(sc32, 2 * c as i32)),
                    );
                }
                (isum, scaled_bsums(mn, a))
            }
        }

        #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
        pub unsafe fn dot_q4_k(w: &[BlockQ4K], x: &[ActBlockK]) -> f32 {
            let (mut acc, mut mins) = (_mm512_setzero_ps(), _mm256_setzero_ps());
            for (b, a) in w.iter().zip(x) {
                // SAFETY: whole blocks.
                let (isum, m) =
                    unsafe { qk_32::<false>(&b.scales, std::ptr::null(), b.qs.as_ptr(), a) };
                acc = _mm512_fmadd_ps(scale16(a.d, b.d), _mm512_cvtepi32_ps(isum), acc);
                mins = _mm256_fmadd_ps(scale8(a.d, b.dmin), i2f8(m), mins);
            }
            _mm512_reduce_add_ps(acc) - _mm256_cvtss_f32(mins)
        }

        #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
        pub unsafe fn dot_q5_k(w: &[BlockQ5K], x: &[ActBlockK]) -> f32 {
            let (mut acc, mut mins) = (_mm512_setzero_ps(), _mm256_setzero_ps());
            for (b, a) in w.iter().zip(x) {
                // SAFETY: whole blocks.
                let (isum, m) =
                    unsafe { qk_32::<true>(&b.scales, b.qh.as_ptr(), b.qs.as_ptr(), a) };
                acc = _mm512_fmadd_ps(scale16(a.d, b.d), _mm512_cvtepi32_ps(isum), acc);
                mins = _mm256_fmadd_ps(scale8(a.d, b.dmin), i2f8(m), mins);
            }
            _mm512_reduce_add_ps(acc) - _mm256_cvtss_f32(mins)
        }

        /// Q2_K and Q3_K (`THREE`): 2-bit codes (+ the third bit, as code + 4) in 16-value
        /// sub-blocks, four i32 lanes per sub-block.
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
        unsafe fn q23_k<const THREE: bool>(
            qs: *const u8,
            hmask: *const u8,
            sc32: __m512i,
            a: &ActBlockK,
        ) -> __m512i {
            let m3 = _mm256_set1_epi8(3);
            let one = _mm256_set1_epi8(1);
            let mut isum = _mm512_setzero_si512();
            // SAFETY: the caller passes whole blocks (64 code bytes, 32 hmask bytes for Q3_K);
            // the activation block has 256 codes.
            unsafe {
                let mut hm = if THREE {
                    load256(hmask)
                } else {
                    _mm256_setzero_si256()
                };
                for n in 0..2 {
                    let mut q = load256(qs.add(32 * n));
                    let mut codes = [_mm256_setzero_si256(); 4];
                    for c in codes.iter_mut() {
                        *c = _mm256_and_si256(q, m3);
                        if THREE {
                            let high = _mm256_slli_epi16::<2>(_mm256_and_si256(hm, one));
                            *c = _mm256_or_si256(*c, high);
                            hm = _mm256_srli_epi16::<1>(hm);
                        }
                        q = _mm256_srli_epi16::<2>(q);
                    }
                    for v in 0..2 {
                        let z = join(codes[2 * v], codes[2 * v + 1]);
                        let y = load512(a.qs.as_ptr().add(128 * n + 64 * v) as *const u8);
                        let dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), z, y);
                        let first = (8 * n + 4 * v) as i32;
                        isum = _mm512_add_epi32(
                            isum,
                            _mm512_mullo_epi32(dot, spread::<2>(sc32, first)),
                        );
                    }
                }
            }
            isum
        }

        #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
        pub unsafe fn dot_q2_k(w: &[BlockQ2K], x: &[ActBlockK]) -> f32 {
            let (mut acc, mut mins) = (_mm512_setzero_ps(), _mm256_setzero_ps());
            for (b, a) in w.iter().zip(x) {
                // SAFETY: whole blocks: 16 scale bytes, 64 code bytes, 256 activations.
                unsafe {
                    let sc8 = _mm_loadu_si128(b.scales.as_ptr() as *const __m128i);
                    let scales = _mm_and_si128(sc8, _mm_set1_epi8(0x0f));
                    let mn = _mm_and_si128(_mm_srli_epi16::<4>(sc8), _mm_set1_epi8(0x0f));
                    let isum = q23_k::<false>(
                        b.qs.as_ptr(),
                        std::ptr::null(),
                        _mm512_cvtepu8_epi32(scales),
                        a,
                    );
                    acc = _mm512_fmadd_ps(scale16(a.d, b.d), _mm512_cvtepi32_ps(isum), acc);
                    let m = i2f8(scaled_bsums(mn, a));
                    mins = _mm256_fmadd_ps(scale8(a.d, b.dmin), m, mins);
                }
            }
            _mm512_reduce_add_ps(acc) - _mm256_cvtss_f32(mins)
        }

        #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
        pub unsafe fn dot_q3_k(w: &[BlockQ3K], x: &[ActBlockK]) -> f32 {
            let (mut acc, mut corr) = (_mm512_setzero_ps(), _mm256_setzero_ps());
            for (b, a) in w.iter().zip(x) {
                let scales = q3k_scales_simd(&b.scales);
                // SAFETY: whole blocks: 32 hmask bytes, 64 code bytes, 256 activations.
                unsafe {
                    let isum = q23_k::<true>(
                        b.qs.as_ptr(),
                        b.hmask.as_ptr(),
                        _mm512_cvtepi8_epi32(scales),
                        a,
                    );
                    acc = _mm512_fmadd_ps(scale16(a.d, b.d), _mm512_cvtepi32_ps(isum), acc);
                    // Codes were taken + 4: subtract 4·Σ sc·Σy.
                    let c = i2f8(4 * scaled_bsums(scales, a));
                    corr = _mm256_fmadd_ps(scale8(a.d, b.d), c, corr);
                }
            }
            _mm512_reduce_add_ps(acc) - _mm256_cvtss_f32(corr)
        }

        #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
        pub unsafe fn dot_q6_k(w: &[BlockQ6K], x: &[ActBlockK]) -> f32 {
            let m4 = _mm256_set1_epi8(0x0f);
            let (mut acc, mut corr) = (_mm512_setzero_ps(), _mm256_setzero_ps());
            for (b, a) in w.iter().zip(x) {
                // SAFETY: whole blocks: 128 + 64 code bytes, 16 scales, 256 activations.
                unsafe {
                    let sc8 = _mm_loadu_si128(b.scales.as_ptr() as *const __m128i);
                    let sc32 = _mm512_cvtepi8_epi32(sc8);
                    let mut isum = _mm512_setzero_si512();
                    for half in 0..2 {
                        let l0 = load256(b.ql.as_ptr().add(64 * half));
                        let l1 = load256(b.ql.as_ptr().add(64 * half + 32));
                        let h = load256(b.qh.as_ptr().add(32 * half));
                        let k0 = q6_codes::<0>(_mm256_and_si256(l0, m4), h);
                        let k1 = q6_codes::<2>(_mm256_and_si256(l1, m4), h);
                        let k2 = q6_codes::<4>(_mm256_and_si256(_mm256_srli_epi16::<4>(l0), m4), h);
                        let k3 = q6_codes::<6>(_mm256_and_si256(_mm256_srli_epi16::<4>(l1), m4), h);
                        // Codes of values 128·half + 0..64, then + 64..128: four sub-blocks of
                        // 16 each, four i32 lanes per sub-block.
                        for (v, z) in [join(k0, k1), join(k2, k3)].into_iter().enumerate() {
                            let y = load512(a.qs.as_ptr().add(128 * half + 64 * v) as *const u8);
                            let dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), z, y);
                            let first = (8 * half + 4 * v) as i32;
                            isum = _mm512_add_epi32(
                                isum,
                                _mm512_mullo_epi32(dot, spread::<2>(sc32, first)),
                            );
                        }
                    }
                    acc = _mm512_fmadd_ps(scale16(a.d, b.d), _mm512_cvtepi32_ps(isum), acc);
                    // Codes are stored + 32: subtract 32·Σ sc·Σy.
                    corr = _mm256_fmadd_ps(scale8(a.d, b.d), i2f8(32 * scaled_bsums(sc8, a)), corr);
                }
            }
            _mm512_reduce_add_ps(acc) - _mm256_cvtss_f32(corr)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Kernels, available};
    use super::*;
    use crate::tensor::{DType, decode_row};
    use half::f16;
    use rand::{RngExt, SeedableRng, rngs::StdRng};

    /// Random blocks of `dtype` (every byte random, then the f16 scale fields set to finite
    /// values of either sign, magnitudes 2^-10..2^-4).
    fn random_blocks(dtype: DType, n_blocks: usize, rng: &mut StdRng) -> Vec<u8> {
        let bb = dtype.block_bytes();
        let mut bytes: Vec<u8> = (0..n_blocks * bb).map(|_| rng.random::<u8>()).collect();
        let scale_at: &[usize] = match dtype {
            DType::Q5_0 => &[0],
            DType::Q5_1 | DType::Q4K | DType::Q5K => &[0, 2],
            DType::Q2K => &[80, 82],
            DType::Q3K => &[108],
            DType::Q6K => &[208],
            _ => unreachable!(),
        };
        for b in bytes.chunks_mut(bb) {
            for &at in scale_at {
                let mag = 2f32.powf(rng.random_range(-10.0f32..-4.0));
                let v = if rng.random::<bool>() { mag } else { -mag };
                b[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
            }
        }
        bytes
    }

    fn rand_x(rng: &mut StdRng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-3.0f32..3.0)).collect()
    }

    /// `kernel(w, x)` for one kernel set and dtype, with `x` quantized by that set.
    fn run(k: &Kernels, dtype: DType, w: &[u8], x: &[f32]) -> f32 {
        // (Vec<u8> storage is allocator-aligned, enough for the 2-byte-aligned block structs.)
        if dtype.is_k_quant() {
            let mut a = vec![ActBlockK::default(); x.len() / QK_K];
            (k.quantize_k)(x, &mut a);
            match dtype {
                DType::Q2K => (k.dot_q2_k)(bytemuck::cast_slice(w), &a),
                DType::Q3K => (k.dot_q3_k)(bytemuck::cast_slice(w), &a),
                DType::Q4K => (k.dot_q4_k)(bytemuck::cast_slice(w), &a),
                DType::Q5K => (k.dot_q5_k)(bytemuck::cast_slice(w), &a),
                _ => (k.dot_q6_k)(bytemuck::cast_slice(w), &a),
            }
        } else {
            let mut a = vec![ActBlock::default(); x.len() / 32];
            (k.quantize)(x, &mut a);
            match dtype {
                DType::Q5_0 => (k.dot_q5_0)(bytemuck::cast_slice(w), &a),
                _ => (k.dot_q5_1)(bytemuck::cast_slice(w), &a),
            }
        }
    }

    /// Σ decode(w)·(d_x·q_x) in f64, and a bound on what f32 accumulation (and Q5_1's
    /// f16-rounded activation sums, as llama.cpp's Q8_1 keeps them) may move it.
    fn reference(dtype: DType, w: &[u8], x: &[f32]) -> (f64, f64) {
        let mut wf = vec![0f32; x.len()];
        decode_row(dtype, w, &mut wf);
        let deq: Vec<f32> = if dtype.is_k_quant() {
            let mut a = vec![ActBlockK::default(); x.len() / QK_K];
            quantize_k(x, &mut a);
            a.iter()
                .flat_map(|b| b.qs.iter().map(move |&q| b.d * q as f32))
                .collect()
        } else {
            let mut a = vec![ActBlock::default(); x.len() / 32];
            super::super::portable::quantize(x, &mut a);
            a.iter()
                .flat_map(|b| b.qs.iter().map(move |&q| b.d * q as f32))
                .collect()
        };
        let exact: f64 = wf
            .iter()
            .zip(&deq)
            .map(|(&a, &b)| a as f64 * b as f64)
            .sum();
        let mag: f64 = wf
            .iter()
            .zip(&deq)
            .map(|(&a, &b)| (a as f64 * b as f64).abs())
            .sum();
        let mut tol = 2e-6 * mag;
        if dtype == DType::Q5_1 {
            // m·s with s = f16(d·Σq): half an f16 ulp of each block's activation sum.
            for (b, xs) in w.chunks(24).zip(x.chunks(32)) {
                let m = f16::from_le_bytes([b[2], b[3]]).to_f32().abs() as f64;
                let sum: f64 = xs.iter().map(|v| v.abs() as f64).sum();
                tol += m * sum * 2f64.powi(-10);
            }
        }
        (exact, tol)
    }

    const FORMATS: [DType; 7] = [
        DType::Q5_0,
        DType::Q5_1,
        DType::Q2K,
        DType::Q3K,
        DType::Q4K,
        DType::Q5K,
        DType::Q6K,
    ];

    #[test]
    fn every_kernel_equals_the_reference_decoder_times_quantized_activations() {
        let mut rng = StdRng::seed_from_u64(21);
        for k in available() {
            for dtype in FORMATS {
                for blocks in [1usize, 2, 3, 7] {
                    let n = blocks * dtype.block_len();
                    let w = random_blocks(dtype, blocks, &mut rng);
                    let x = rand_x(&mut rng, n);
                    let got = run(k, dtype, &w, &x) as f64;
                    let (want, tol) = reference(dtype, &w, &x);
                    assert!(
                        (got - want).abs() <= tol,
                        "{} {dtype} x{blocks}: {got} vs {want} (tolerance {tol:e})",
                        k.name
                    );
                }
            }
        }
    }

    #[test]
    fn simd_kernels_equal_portable_on_extreme_codes() {
        // All-ones bytes: every code at its maximum, every scale at its largest.
        for k in available() {
            for dtype in FORMATS {
                let mut w = vec![0xffu8; 4 * dtype.block_bytes()];
                let mut rng = StdRng::seed_from_u64(2);
                let scaled = random_blocks(dtype, 4, &mut rng);
                // Keep the scales finite: copy the f16 fields from random blocks.
                for (b, s) in w
                    .chunks_mut(dtype.block_bytes())
                    .zip(scaled.chunks(dtype.block_bytes()))
                {
                    for (i, (o, r)) in b.iter_mut().zip(s).enumerate() {
                        let is_scale = match dtype {
                            DType::Q5_0 => i < 2,
                            DType::Q5_1 | DType::Q4K | DType::Q5K => i < 4,
                            DType::Q2K => i >= 80,
                            DType::Q3K | DType::Q6K => i >= dtype.block_bytes() - 2,
                            _ => false,
                        };
                        if is_scale {
                            *o = *r;
                        }
                    }
                }
                let x: Vec<f32> = (0..4 * dtype.block_len())
                    .map(|i| if i % 3 == 0 { -3.0 } else { 3.0 })
                    .collect();
                let got = run(k, dtype, &w, &x) as f64;
                let (want, tol) = reference(dtype, &w, &x);
                assert!(
                    (got - want).abs() <= tol,
                    "{} {dtype}: {got} vs {want}",
                    k.name
                );
            }
        }
    }

    #[test]
    fn q8k_activations_match_ggml_reference_rules() {
        let mut x = vec![0f32; 256];
        x[3] = -2.0;
        x[4] = 1.0;
        x[5] = 0.5 * 2.0 / 127.0; // exactly half a step: rounds to even (0)
        let mut a = [ActBlockK::default()];
        quantize_k(&x, &mut a);
        assert_eq!(a[0].d, 2.0 / 127.0);
        assert_eq!(a[0].qs[3], -127);
        assert_eq!(a[0].qs[4], 64); // 63.5 → 64 (even)
        assert_eq!(a[0].bsums[0], -127 + 64 + a[0].qs[5] as i16);
    }
}
