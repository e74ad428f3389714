//! The AVX2/FMA/F16C kernel set: its table, the safe wrappers it installs once `supported()`
//! said yes, and its row kernels (f32/f16/bf16 dots, Q8_0/Q4_0/Q4_1 dots, the activation
//! quantizer). Attention's kernels are in `avx2_attention`, the Q5/K-quant ones in `kq::x86`.

use half::{bf16, f16};
use std::arch::x86_64::*;

use super::activations::ActBlock;
use super::avx2_attention::{axpy_rows_avx2, exp_sum_avx2, scores_avx2};
use super::avx2_qdots::{self, dots};
use super::kq::x86::{h2f8, hsum};
use super::kq::{ActBlockK, quantize_k};
use super::lanes;
use super::portable::round_f16;
use super::qdots::{Q40, Q41};
use super::set::Kernels;
use crate::tensor::{
    BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5_0, BlockQ5_1, BlockQ5K, BlockQ6K, BlockQ8_0, QK,
};

pub fn supported() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

pub const KERNELS: Kernels = Kernels {
    name: "avx2",
    dot_f32,
    axpy_rows,
    axpy_rows_f16,
    scores,
    scores_f16,
    exp_sum,
    dot_f16,
    dot_bf16,
    dot_q8_0,
    dot_q4_0: avx2_qdots::dot_q4_0,
    dot_q4_1: avx2_qdots::dot_q4_1,
    dot_q5_0,
    dot_q5_1,
    dot_q2_k,
    dot_q3_k,
    dot_q4_k,
    dot_q5_k,
    dot_q6_k,
    quantize,
    quantize_k,
    // Q8_0 keeps llama.cpp's AVX2 association (eight lanes of block products, then one sum):
    // see `dot_q8_0_avx2`.
    dots_q8_0: None,
    dots_q4_0: Some(dots::<Q40>),
    dots_q4_1: Some(dots::<Q41>),
    tiled_q8_0: None,
    tiled_q4_0: None,
    tiled_q4_1: None,
};

fn dot_q5_0(w: &[BlockQ5_0], x: &[ActBlock]) -> f32 {
    // SAFETY: AVX2+FMA+F16C present (checked before this table is used).
    unsafe { super::kq::x86::dot_q5::<false>(bytemuck::cast_slice(w), x) }
}
fn dot_q5_1(w: &[BlockQ5_1], x: &[ActBlock]) -> f32 {
    // SAFETY: as above.
    unsafe { super::kq::x86::dot_q5::<true>(bytemuck::cast_slice(w), x) }
}
fn dot_q2_k(w: &[BlockQ2K], x: &[ActBlockK]) -> f32 {
    // SAFETY: as above.
    unsafe { super::kq::x86::dot_q2_k(w, x) }
}
fn dot_q3_k(w: &[BlockQ3K], x: &[ActBlockK]) -> f32 {
    // SAFETY: as above.
    unsafe { super::kq::x86::dot_q3_k(w, x) }
}
fn dot_q4_k(w: &[BlockQ4K], x: &[ActBlockK]) -> f32 {
    // SAFETY: as above.
    unsafe { super::kq::x86::dot_q4_k(w, x) }
}
fn dot_q5_k(w: &[BlockQ5K], x: &[ActBlockK]) -> f32 {
    // SAFETY: as above.
    unsafe { super::kq::x86::dot_q5_k(w, x) }
}
fn dot_q6_k(w: &[BlockQ6K], x: &[ActBlockK]) -> f32 {
    // SAFETY: as above.
    unsafe { super::kq::x86::dot_q6_k(w, x) }
}

// The safe wrappers below are installed only after `supported()` returned true.

fn dot_f32(w: &[f32], x: &[f32]) -> f32 {
    // SAFETY: AVX2+FMA present (checked before this table is used).
    unsafe { dot_f32_avx2(w, x) }
}
fn axpy_rows(out: &mut [f32], w: &[f32], rows: &[&[f32]]) {
    // SAFETY: as above.
    unsafe { axpy_rows_avx2(out, w, rows) }
}
fn axpy_rows_f16(out: &mut [f32], w: &[f32], rows: &[&[f16]]) {
    // SAFETY: as above.
    unsafe { axpy_rows_avx2(out, w, rows) }
}
fn scores(qs: &[&[f32]], keys: &[&[f32]], out: &mut [f32]) {
    // SAFETY: as above.
    unsafe { scores_avx2(qs, keys, out) }
}
fn scores_f16(qs: &[&[f32]], keys: &[&[f16]], out: &mut [f32]) {
    // SAFETY: as above.
    unsafe { scores_avx2(qs, keys, out) }
}
fn exp_sum(s: &mut [f32], max: f32) -> f64 {
    // SAFETY: as above.
    unsafe { exp_sum_avx2(s, max) }
}
fn dot_f16(w: &[f16], x: &[f32]) -> f32 {
    // SAFETY: as above, plus F16C.
    unsafe { dot_f16_avx2(w, x) }
}
fn dot_bf16(w: &[bf16], x: &[f32]) -> f32 {
    // SAFETY: as above.
    unsafe { dot_bf16_avx2(w, x) }
}
fn dot_q8_0(w: &[BlockQ8_0], x: &[ActBlock]) -> f32 {
    // SAFETY: as above.
    unsafe { dot_q8_0_avx2(w, x) }
}
fn quantize(x: &[f32], out: &mut [ActBlock]) {
    // SAFETY: as above.
    unsafe { quantize_avx2(x, out) }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn dot_f32_avx2(w: &[f32], x: &[f32]) -> f32 {
    let n = w.len().min(x.len());
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    // SAFETY: every load reads 8 floats at i < n - 7 (or i + 24 < n for the unrolled loop).
    unsafe {
        while i + 32 <= n {
            for (k, a) in acc.iter_mut().enumerate() {
                let o = i + 8 * k;
                *a = _mm256_fmadd_ps(_mm256_loadu_ps(wp.add(o)), _mm256_loadu_ps(xp.add(o)), *a);
            }
            i += 32;
        }
        while i + 8 <= n {
            acc[0] = _mm256_fmadd_ps(
                _mm256_loadu_ps(wp.add(i)),
                _mm256_loadu_ps(xp.add(i)),
                acc[0],
            );
            i += 8;
        }
    }
    dot_f32_finish(acc, w, x, i)
}

/// [`dot_f32_avx2`]'s reduction: its four accumulators, then the values from `i` on.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn dot_f32_finish(acc: [__m256; 4], w: &[f32], x: &[f32], i: usize) -> f32 {
    let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let mut sum = hsum(v);
    for j in i..w.len().min(x.len()) {
        sum += w[j] * x[j];
    }
    sum
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_f16_avx2(w: &[f16], x: &[f32]) -> f32 {
    let n = w.len().min(x.len());
    let (wp, xp) = (w.as_ptr() as *const u16, x.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    // SAFETY: loads of 8 halves / 8 floats stay below n.
    unsafe {
        while i + 32 <= n {
            for (k, a) in acc.iter_mut().enumerate() {
                let o = i + 8 * k;
                let wv = _mm256_cvtph_ps(_mm_loadu_si128(wp.add(o) as *const __m128i));
                *a = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xp.add(o)), *a);
            }
            i += 32;
        }
        while i + 8 <= n {
            let wv = _mm256_cvtph_ps(_mm_loadu_si128(wp.add(i) as *const __m128i));
            acc[0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xp.add(i)), acc[0]);
            i += 8;
        }
    }
    let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let mut sum = hsum(v);
    for j in i..n {
        sum += w[j].to_f32() * x[j];
    }
    sum
}

/// As [`dot_f16_avx2`] (and so [`dot_f32_avx2`]'s association) for bf16 rows.
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_bf16_avx2(w: &[bf16], x: &[f32]) -> f32 {
    let n = w.len().min(x.len());
    let (wp, xp) = (w.as_ptr() as *const u16, x.as_ptr());
    // bf16 → f32 is a 16-bit shift. (A function, not a closure: a closure would not
    // inherit the target features and the loads would not inline.)
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn load8(p: *const u16) -> __m256 {
        // SAFETY: the caller passes 8 readable bf16.
        let h = unsafe { _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i)) };
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(h))
    }
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    // SAFETY: loads of 8 bf16 / 8 floats stay below n.
    unsafe {
        while i + 32 <= n {
            for (k, a) in acc.iter_mut().enumerate() {
                let o = i + 8 * k;
                *a = _mm256_fmadd_ps(load8(wp.add(o)), _mm256_loadu_ps(xp.add(o)), *a);
            }
            i += 32;
        }
        while i + 8 <= n {
            acc[0] = _mm256_fmadd_ps(load8(wp.add(i)), _mm256_loadu_ps(xp.add(i)), acc[0]);
            i += 8;
        }
    }
    let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let mut sum = hsum(v);
    for j in i..n {
        sum += w[j].to_f32() * x[j];
    }
    sum
}

/// Σ over 32 lanes of u8 × i8 products, as 8 i32 lanes.
#[inline]
#[target_feature(enable = "avx2")]
fn mul_sum_u8_i8(a: __m256i, b: __m256i) -> __m256i {
    let p16 = _mm256_maddubs_epi16(a, b);
    _mm256_madd_epi16(p16, _mm256_set1_epi16(1))
}

/// Integer dot product of one Q8_0 weight block with one activation block, as 8 f32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn q8_block(b: &BlockQ8_0, a: &ActBlock) -> __m256 {
    // SAFETY: each block holds 32 i8 values; unaligned loads.
    let (wv, xv) = unsafe {
        (
            _mm256_loadu_si256(b.qs.as_ptr() as *const __m256i),
            _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i),
        )
    };
    // |w| as u8 times x carrying w's sign: maddubs needs one unsigned operand.
    _mm256_cvtepi32_ps(mul_sum_u8_i8(
        _mm256_sign_epi8(wv, wv),
        _mm256_sign_epi8(xv, wv),
    ))
}

/// Q8_0 as llama.cpp's AVX2 dot associates it (each block's products scaled in eight lanes,
/// one sum at the end), not `qdots`' block-by-block arithmetic: Q8_0 gains little from many
/// rows (its codes need no unpacking), and with the other association one activation code of
/// the synthesized MoE fixture rounds the other way at one position (6e-3 of the logit scale
/// from llama.cpp's, against 1.5e-6 with this one; `tests/real_models.rs`).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q8_0_avx2(w: &[BlockQ8_0], x: &[ActBlock]) -> f32 {
    // Two accumulators: consecutive blocks do not wait on each other's FMA.
    let mut acc = [_mm256_setzero_ps(); 2];
    let pairs = w.len().min(x.len()) / 2;
    for i in 0..pairs {
        for (k, a) in acc.iter_mut().enumerate() {
            let (b, xa) = (&w[2 * i + k], &x[2 * i + k]);
            let scale = _mm256_mul_ps(h2f8(b.d.to_bits()), _mm256_set1_ps(xa.d));
            // SAFETY: blocks are whole structs.
            *a = _mm256_fmadd_ps(scale, unsafe { q8_block(b, xa) }, *a);
        }
    }
    if w.len().min(x.len()) % 2 == 1 {
        let (b, xa) = (&w[2 * pairs], &x[2 * pairs]);
        let scale = _mm256_mul_ps(h2f8(b.d.to_bits()), _mm256_set1_ps(xa.d));
        // SAFETY: as above.
        acc[0] = _mm256_fmadd_ps(scale, unsafe { q8_block(b, xa) }, acc[0]);
    }
    hsum(_mm256_add_ps(acc[0], acc[1]))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_avx2(x: &[f32], out: &mut [ActBlock]) {
    let sign_mask = _mm256_set1_ps(-0.0);
    for (xs, o) in x.chunks_exact(QK).zip(out.iter_mut()) {
        // SAFETY: each chunk has exactly 32 floats.
        let v: [__m256; 4] = lanes!(4, _mm256_setzero_ps(), |k| unsafe {
            _mm256_loadu_ps(xs.as_ptr().add(8 * k))
        });
        let mut m = _mm256_andnot_ps(sign_mask, v[0]);
        for vk in &v[1..] {
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign_mask, *vk));
        }
        let m4 = _mm_max_ps(_mm256_extractf128_ps::<1>(m), _mm256_castps256_ps128(m));
        let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        let amax = _mm_cvtss_f32(m4);
        let d = amax / 127.0;
        let id = _mm256_set1_ps(if amax != 0.0 { 127.0 / amax } else { 0.0 });
        let q: [__m256i; 4] = lanes!(4, _mm256_setzero_si256(), |k| {
            let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm256_mul_ps(v[k], id),
            );
            _mm256_cvtps_epi32(r)
        });
        let sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        let s4 = _mm_add_epi32(
            _mm256_extracti128_si256::<1>(sum),
            _mm256_castsi256_si128(sum),
        );
        let s4 = _mm_hadd_epi32(s4, s4);
        let s4 = _mm_hadd_epi32(s4, s4);
        let isum = _mm_cvtsi128_si32(s4);
        // Pack 32 i32 → 32 i8 in order: packs interleave 128-bit lanes, the permute undoes it.
        let p01 = _mm256_packs_epi32(q[0], q[1]);
        let p23 = _mm256_packs_epi32(q[2], q[3]);
        let p = _mm256_packs_epi16(p01, p23);
        let p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        // SAFETY: qs has 32 bytes.
        unsafe { _mm256_storeu_si256(o.qs.as_mut_ptr() as *mut __m256i, p) };
        o.d = round_f16(d);
        o.isum = isum;
        o.s = round_f16(d * isum as f32);
    }
}
