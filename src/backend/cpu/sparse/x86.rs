//! The AVX2/FMA/F16C inner kernels of the sparse operators: INT8/INT4 dots, the column axpys,
//! and the four-row dots and axpys that share the loads of `x` (or of the output tile) and
//! prefetch the next group's rows (into L2, a group ahead), which lie at random places.

use half::{bf16, f16};
use std::arch::x86_64::*;

use super::ops::{I4Row, Ops, TILE_COLS, TILE_NEURONS, TileRow, i4_scale};
use crate::backend::cpu::kernels::kq::x86::hsum;
use crate::backend::cpu::kernels::lanes;
use crate::store::quant::INT4_GROUP;

const AVX2: Ops = Ops {
    dot_i8,
    dot_i4,
    axpy_f32,
    axpy_f16,
    axpy_bf16,
    axpy_i8,
    axpy_i4,
    dot4_f16: Some(dot4_f16),
    dot4_i8: Some(dot4_i8),
    dot4_i4: Some(dot4_i4),
    axpy4_f16: Some(axpy4_f16),
    axpy4_i8: Some(axpy4_i8),
    axpy4_i4: Some(axpy4_i4),
    dot4_tiled: Some(dot4_tiled),
    axpy4_tiled: Some(axpy4_tiled),
};

/// The kernels for the AVX2 kernel set.
pub static OPS: Ops = AVX2;

/// The kernels for the AVX-512 kernel set: the f16 four-row dot in AVX-512's registers (the
/// same sums as the AVX2 one).
pub static OPS_AVX512: Ops = Ops {
    dot4_f16: Some(dot4_f16_512),
    dot4_tiled: Some(dot4_tiled_512),
    ..AVX2
};

// The safe wrappers are installed only with a kernel set that required AVX2+FMA+F16C.

fn dot_i8(q: &[i8], x: &[f32]) -> f32 {
    // SAFETY: AVX2+FMA present (see `ops`).
    unsafe { dot_i8_avx2(q, x) }
}
fn dot_i4(scales: &[u8], q: &[u8], x: &[f32]) -> f32 {
    // SAFETY: as above.
    unsafe { dot_i4_avx2(scales, q, x) }
}
fn axpy_f32(a: f32, w: &[f32], out: &mut [f32]) {
    // SAFETY: as above.
    unsafe { axpy_f32_avx2(a, w, out) }
}
fn axpy_f16(a: f32, w: &[f16], out: &mut [f32]) {
    // SAFETY: as above, plus F16C.
    unsafe { axpy_f16_avx2(a, w, out) }
}
fn axpy_bf16(a: f32, w: &[bf16], out: &mut [f32]) {
    // SAFETY: as above.
    unsafe { axpy_bf16_avx2(a, w, out) }
}
fn axpy_i8(a: f32, q: &[i8], out: &mut [f32]) {
    // SAFETY: as above.
    unsafe { axpy_i8_avx2(a, q, out) }
}
fn axpy_i4(a: f32, scales: &[u8], q: &[u8], out: &mut [f32]) {
    // SAFETY: as above.
    unsafe { axpy_i4_avx2(a, scales, q, out) }
}
fn dot4_f16(w: [&[f16]; 4], next: [&[f16]; 4], x: &[f32]) -> [f32; 4] {
    // SAFETY: as above, plus F16C.
    unsafe { dot4_f16_avx2(w, next, x) }
}
fn dot4_f16_512(w: [&[f16]; 4], next: [&[f16]; 4], x: &[f32]) -> [f32; 4] {
    // SAFETY: installed only with the AVX-512 kernel set (which requires AVX-512F/VL).
    unsafe { dot4_f16_avx512(w, next, x) }
}
fn dot4_i8(q: [&[i8]; 4], next: [&[i8]; 4], x: &[f32]) -> [f32; 4] {
    // SAFETY: as above.
    unsafe { dot4_i8_avx2(q, next, x) }
}
fn dot4_i4(w: [I4Row; 4], next: [I4Row; 4], x: &[f32]) -> [f32; 4] {
    // SAFETY: as above, plus F16C.
    unsafe { dot4_i4_avx2(w, next, x) }
}
fn axpy4_f16(a: [f32; 4], w: [&[f16]; 4], next: [&[f16]; 4], out: &mut [f32]) {
    // SAFETY: as above, plus F16C.
    unsafe { axpy4_f16_avx2(a, w, next, out) }
}
fn axpy4_i8(a: [f32; 4], q: [&[i8]; 4], next: [&[i8]; 4], out: &mut [f32]) {
    // SAFETY: as above.
    unsafe { axpy4_i8_avx2(a, q, next, out) }
}
fn axpy4_i4(a: [f32; 4], w: [I4Row; 4], next: [I4Row; 4], out: &mut [f32]) {
    // SAFETY: as above, plus F16C.
    unsafe { axpy4_i4_avx2(a, w, next, out) }
}
fn dot4_tiled(w: [TileRow; 4], x: &[f32], ahead: bool) -> [f32; 4] {
    // SAFETY: as above, plus F16C.
    unsafe { dot4_tiled_avx2(w, x, ahead) }
}
fn dot4_tiled_512(w: [TileRow; 4], x: &[f32], ahead: bool) -> [f32; 4] {
    // SAFETY: installed only with the AVX-512 kernel set (which requires AVX-512F/VL).
    unsafe { dot4_tiled_avx512(w, x, ahead) }
}
fn axpy4_tiled(a: [f32; 4], w: [TileRow; 4], out: &mut [f32], ahead: bool) {
    // SAFETY: as above, plus F16C.
    unsafe { axpy4_tiled_avx2(a, w, out, ahead) }
}

/// 8 signed bytes at `p` as floats.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn i8x8(p: *const i8) -> __m256 {
    // SAFETY: the caller guarantees 8 readable bytes.
    unsafe { _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i))) }
}

/// One INT4 group (16 bytes at `p`) as four vectors of 8 values `nibble − 8`, in order.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn i4x32(p: *const u8) -> [__m256; 4] {
    // SAFETY: the caller guarantees 16 readable bytes.
    let b = unsafe { _mm_loadu_si128(p as *const __m128i) };
    let m = _mm_set1_epi8(0x0f);
    let lo = _mm_and_si128(b, m);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(b), m);
    // Byte j holds values 2j (low nibble) and 2j+1 (high): interleave to restore order.
    let eight = _mm_set1_epi8(8);
    let v0 = _mm_sub_epi8(_mm_unpacklo_epi8(lo, hi), eight);
    let v1 = _mm_sub_epi8(_mm_unpackhi_epi8(lo, hi), eight);
    let cvt = |v: __m128i| _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
    [
        cvt(v0),
        cvt(_mm_srli_si128::<8>(v0)),
        cvt(v1),
        cvt(_mm_srli_si128::<8>(v1)),
    ]
}

#[target_feature(enable = "avx2,fma")]
unsafe fn dot_i8_avx2(q: &[i8], x: &[f32]) -> f32 {
    let n = q.len().min(x.len());
    let (qp, xp) = (q.as_ptr(), x.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 2];
    let mut i = 0;
    // SAFETY: every load reads 8 values at i + 8 ≤ n (16 for the pair).
    unsafe {
        while i + 16 <= n {
            acc[0] = _mm256_fmadd_ps(i8x8(qp.add(i)), _mm256_loadu_ps(xp.add(i)), acc[0]);
            acc[1] = _mm256_fmadd_ps(i8x8(qp.add(i + 8)), _mm256_loadu_ps(xp.add(i + 8)), acc[1]);
            i += 16;
        }
        while i + 8 <= n {
            acc[0] = _mm256_fmadd_ps(i8x8(qp.add(i)), _mm256_loadu_ps(xp.add(i)), acc[0]);
            i += 8;
        }
    }
    let mut sum = hsum(_mm256_add_ps(acc[0], acc[1]));
    for j in i..n {
        sum += q[j] as f32 * x[j];
    }
    sum
}

#[target_feature(enable = "avx2,fma")]
unsafe fn dot_i4_avx2(scales: &[u8], q: &[u8], x: &[f32]) -> f32 {
    let groups = (q.len() / (INT4_GROUP / 2))
        .min(x.len() / INT4_GROUP)
        .min(scales.len() / 2);
    let mut acc = [_mm256_setzero_ps(); 2];
    for g in 0..groups {
        // SAFETY: group g < groups: 16 code bytes and 32 activations in bounds.
        unsafe {
            let v = i4x32(q.as_ptr().add(g * INT4_GROUP / 2));
            let xp = x.as_ptr().add(g * INT4_GROUP);
            let mut s = _mm256_mul_ps(v[0], _mm256_loadu_ps(xp));
            s = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xp.add(8)), s);
            let mut t = _mm256_mul_ps(v[2], _mm256_loadu_ps(xp.add(16)));
            t = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xp.add(24)), t);
            let d = _mm256_set1_ps(i4_scale(scales, g));
            // Two accumulators so consecutive groups do not wait on one FMA chain.
            acc[g & 1] = _mm256_fmadd_ps(d, _mm256_add_ps(s, t), acc[g & 1]);
        }
    }
    hsum(_mm256_add_ps(acc[0], acc[1]))
}

#[target_feature(enable = "avx2,fma")]
unsafe fn axpy_f32_avx2(a: f32, w: &[f32], out: &mut [f32]) {
    let n = w.len().min(out.len());
    let av = _mm256_set1_ps(a);
    let (wp, op) = (w.as_ptr(), out.as_mut_ptr());
    let mut i = 0;
    // SAFETY: 8 values at i + 8 ≤ n.
    unsafe {
        while i + 8 <= n {
            let o = _mm256_fmadd_ps(av, _mm256_loadu_ps(wp.add(i)), _mm256_loadu_ps(op.add(i)));
            _mm256_storeu_ps(op.add(i), o);
            i += 8;
        }
    }
    for j in i..n {
        out[j] += a * w[j];
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn axpy_f16_avx2(a: f32, w: &[f16], out: &mut [f32]) {
    let n = w.len().min(out.len());
    let av = _mm256_set1_ps(a);
    let (wp, op) = (w.as_ptr() as *const u16, out.as_mut_ptr());
    let mut i = 0;
    // SAFETY: 8 values at i + 8 ≤ n.
    unsafe {
        while i + 8 <= n {
            let c = _mm256_cvtph_ps(_mm_loadu_si128(wp.add(i) as *const __m128i));
            _mm256_storeu_ps(
                op.add(i),
                _mm256_fmadd_ps(av, c, _mm256_loadu_ps(op.add(i))),
            );
            i += 8;
        }
    }
    for j in i..n {
        out[j] += a * w[j].to_f32();
    }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn axpy_bf16_avx2(a: f32, w: &[bf16], out: &mut [f32]) {
    let n = w.len().min(out.len());
    let av = _mm256_set1_ps(a);
    let (wp, op) = (w.as_ptr() as *const u16, out.as_mut_ptr());
    let mut i = 0;
    // SAFETY: 8 values at i + 8 ≤ n.
    unsafe {
        while i + 8 <= n {
            // bf16 is the top half of an f32.
            let c = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
                _mm_loadu_si128(wp.add(i) as *const __m128i),
            )));
            _mm256_storeu_ps(
                op.add(i),
                _mm256_fmadd_ps(av, c, _mm256_loadu_ps(op.add(i))),
            );
            i += 8;
        }
    }
    for j in i..n {
        out[j] += a * w[j].to_f32();
    }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn axpy_i8_avx2(a: f32, q: &[i8], out: &mut [f32]) {
    let n = q.len().min(out.len());
    let av = _mm256_set1_ps(a);
    let (qp, op) = (q.as_ptr(), out.as_mut_ptr());
    let mut i = 0;
    // SAFETY: 8 values at i + 8 ≤ n.
    unsafe {
        while i + 8 <= n {
            let o = _mm256_fmadd_ps(av, i8x8(qp.add(i)), _mm256_loadu_ps(op.add(i)));
            _mm256_storeu_ps(op.add(i), o);
            i += 8;
        }
    }
    for j in i..n {
        out[j] += a * q[j] as f32;
    }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn axpy_i4_avx2(a: f32, scales: &[u8], q: &[u8], out: &mut [f32]) {
    let groups = (q.len() / (INT4_GROUP / 2))
        .min(out.len() / INT4_GROUP)
        .min(scales.len() / 2);
    for g in 0..groups {
        let s = _mm256_set1_ps(a * i4_scale(scales, g));
        // SAFETY: group g < groups: 16 code bytes and 32 outputs in bounds.
        unsafe {
            let v = i4x32(q.as_ptr().add(g * INT4_GROUP / 2));
            let op = out.as_mut_ptr().add(g * INT4_GROUP);
            for (k, vk) in v.iter().enumerate() {
                let p = op.add(8 * k);
                _mm256_storeu_ps(p, _mm256_fmadd_ps(s, *vk, _mm256_loadu_ps(p)));
            }
        }
    }
}

/// Ask for the line at byte `at` of `next` (the row read one group after this one) while
/// byte `at` of this row is read: a whole group ahead, into L2. Listed neurons' rows are short
/// runs (SmolLM2's f16 rows are 1152 B), the hardware prefetchers restart at every one, and
/// lines asked for into L1 a few hundred bytes ahead queue on L1's few miss buffers: on the
/// Zen 4 machine four 576-wide rows in order read 17–19 GB/s (2 threads) that way, 24–31 GB/s
/// this way, 12–16 against 14–21 GB/s in random order (31 GB/s DRAM); 4096-wide rows 23–31
/// against 27–33 GB/s.
#[inline(always)]
fn prefetch_next(next: *const u8, at: usize) {
    // SAFETY: a prefetch is a hint: it never faults, whatever the address.
    unsafe { _mm_prefetch::<_MM_HINT_T1>(next.wrapping_add(at) as *const i8) };
}

/// Every line of the next rows' INT4 scales, which sit apart from their codes.
#[inline(always)]
fn prefetch_scales(next: &[I4Row; 4]) {
    for (s, _) in next {
        for at in (0..s.len()).step_by(64) {
            prefetch_next(s.as_ptr(), at);
        }
    }
}

/// The f16 at `s[2g..2g + 2]` (little-endian) by F16C (`half`'s software path is slow).
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn scale_at(s: &[u8], g: usize) -> f32 {
    let v = u16::from_le_bytes([s[2 * g], s[2 * g + 1]]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(v as i32)))
}

/// Four f16 rows' dots with `x`, each summed exactly as the dense kernel's
/// (`kernels::avx2::dot_f16_avx2`) sums one row: four accumulators over runs of 32 (run `k`
/// of 8 into accumulator `k`), then `(a0 + a1) + (a2 + a3)`. So a neuron's deciding dot is
/// the same bits whether four interleaved rows of bundles (the rows lie at random places: this
/// kernel keeps four streams in flight) or one row of a contiguous matrix (where one stream
/// runs fastest) computes it. Sixteen accumulators need AVX-512's 32 registers to stay in
/// registers ([`dot4_f16_avx512`]); the AVX2 build of the same code spills some.
macro_rules! dot4_f16_body {
    ($name:ident, $features:literal) => {
        #[target_feature(enable = $features)]
        unsafe fn $name(w: [&[f16]; 4], next: [&[f16]; 4], x: &[f32]) -> [f32; 4] {
            let n = w.iter().map(|r| r.len()).fold(x.len(), usize::min);
            let p = w.map(|r| r.as_ptr() as *const u16);
            let nx = next.map(|r| r.as_ptr() as *const u8);
            let xp = x.as_ptr();
            let mut acc = [[_mm256_setzero_ps(); 4]; 4];
            let mut i = 0;
            // SAFETY: loads of 8 values at o + 8 ≤ i + 32 ≤ n (8 for the second loop).
            unsafe {
                while i + 32 <= n {
                    // 32 halves: one line of each row.
                    for &q in &nx {
                        prefetch_next(q, 2 * i);
                    }
                    for k in 0..4 {
                        let o = i + 8 * k;
                        let xv = _mm256_loadu_ps(xp.add(o));
                        for r in 0..4 {
                            let wv =
                                _mm256_cvtph_ps(_mm_loadu_si128(p[r].add(o) as *const __m128i));
                            acc[r][k] = _mm256_fmadd_ps(wv, xv, acc[r][k]);
                        }
                    }
                    i += 32;
                }
                while i + 8 <= n {
                    let xv = _mm256_loadu_ps(xp.add(i));
                    for r in 0..4 {
                        let wv = _mm256_cvtph_ps(_mm_loadu_si128(p[r].add(i) as *const __m128i));
                        acc[r][0] = _mm256_fmadd_ps(wv, xv, acc[r][0]);
                    }
                    i += 8;
                }
            }
            let mut s = lanes!(4, 0.0, |r| hsum(_mm256_add_ps(
                _mm256_add_ps(acc[r][0], acc[r][1]),
                _mm256_add_ps(acc[r][2], acc[r][3]),
            )));
            for j in i..n {
                for r in 0..4 {
                    s[r] += w[r][j].to_f32() * x[j];
                }
            }
            s
        }
    };
}

dot4_f16_body!(dot4_f16_avx2, "avx2,fma,f16c");
dot4_f16_body!(dot4_f16_avx512, "avx2,fma,f16c,avx512f,avx512vl");

#[target_feature(enable = "avx2,fma")]
unsafe fn dot4_i8_avx2(q: [&[i8]; 4], next: [&[i8]; 4], x: &[f32]) -> [f32; 4] {
    let n = q.iter().map(|r| r.len()).fold(x.len(), usize::min);
    let p = q.map(|r| r.as_ptr());
    let nx = next.map(|r| r.as_ptr() as *const u8);
    let xp = x.as_ptr();
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    // SAFETY: loads of 8 values at o + 8 ≤ i + 64 ≤ n (8 for the second loop).
    unsafe {
        while i + 64 <= n {
            for &q in &nx {
                prefetch_next(q, i);
            }
            for o in (i..i + 64).step_by(8) {
                let xv = _mm256_loadu_ps(xp.add(o));
                for r in 0..4 {
                    acc[r] = _mm256_fmadd_ps(i8x8(p[r].add(o)), xv, acc[r]);
                }
            }
            i += 64;
        }
        while i + 8 <= n {
            let xv = _mm256_loadu_ps(xp.add(i));
            for r in 0..4 {
                acc[r] = _mm256_fmadd_ps(i8x8(p[r].add(i)), xv, acc[r]);
            }
            i += 8;
        }
    }
    let mut s = lanes!(4, 0.0, |r| hsum(acc[r]));
    for j in i..n {
        for r in 0..4 {
            s[r] += q[r][j] as f32 * x[j];
        }
    }
    s
}

/// Whole groups in all four INT4 rows and `x`.
fn i4_groups(w: &[I4Row; 4], len: usize) -> usize {
    w.iter()
        .map(|(s, q)| (s.len() / 2).min(q.len() / (INT4_GROUP / 2)))
        .fold(len / INT4_GROUP, usize::min)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot4_i4_avx2(w: [I4Row; 4], next: [I4Row; 4], x: &[f32]) -> [f32; 4] {
    let groups = i4_groups(&w, x.len());
    let nx = next.map(|(_, q)| q.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 4];
    prefetch_scales(&next);
    for g in 0..groups {
        // 16 code bytes per group: one line of each row per 4 groups.
        if g % 4 == 0 {
            for &q in &nx {
                prefetch_next(q, g * 16);
            }
        }
        // SAFETY: group g < groups: 16 code bytes of every row and 32 activations in bounds.
        unsafe {
            let xp = x.as_ptr().add(g * INT4_GROUP);
            let xv = lanes!(4, _mm256_setzero_ps(), |k| _mm256_loadu_ps(xp.add(8 * k)));
            for r in 0..4 {
                let v = i4x32(w[r].1.as_ptr().add(g * INT4_GROUP / 2));
                let s = _mm256_fmadd_ps(v[1], xv[1], _mm256_mul_ps(v[0], xv[0]));
                let t = _mm256_fmadd_ps(v[3], xv[3], _mm256_mul_ps(v[2], xv[2]));
                let d = _mm256_set1_ps(scale_at(w[r].0, g));
                acc[r] = _mm256_fmadd_ps(d, _mm256_add_ps(s, t), acc[r]);
            }
        }
    }
    lanes!(4, 0.0, |r| hsum(acc[r]))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn axpy4_f16_avx2(a: [f32; 4], w: [&[f16]; 4], next: [&[f16]; 4], out: &mut [f32]) {
    let n = w.iter().map(|r| r.len()).fold(out.len(), usize::min);
    let av = lanes!(4, _mm256_setzero_ps(), |r| _mm256_set1_ps(a[r]));
    let p = w.map(|r| r.as_ptr() as *const u16);
    let nx = next.map(|r| r.as_ptr() as *const u8);
    let op = out.as_mut_ptr();
    let mut i = 0;
    // SAFETY: 8 values at o + 8 ≤ i + 32 ≤ n (8 for the second loop).
    unsafe {
        while i + 32 <= n {
            for &q in &nx {
                prefetch_next(q, 2 * i);
            }
            for o in (i..i + 32).step_by(8) {
                let mut v = _mm256_loadu_ps(op.add(o));
                for r in 0..4 {
                    let c = _mm256_cvtph_ps(_mm_loadu_si128(p[r].add(o) as *const __m128i));
                    v = _mm256_fmadd_ps(av[r], c, v);
                }
                _mm256_storeu_ps(op.add(o), v);
            }
            i += 32;
        }
        while i + 8 <= n {
            let mut v = _mm256_loadu_ps(op.add(i));
            for r in 0..4 {
                let c = _mm256_cvtph_ps(_mm_loadu_si128(p[r].add(i) as *const __m128i));
                v = _mm256_fmadd_ps(av[r], c, v);
            }
            _mm256_storeu_ps(op.add(i), v);
            i += 8;
        }
    }
    for j in i..n {
        for r in 0..4 {
            out[j] += a[r] * w[r][j].to_f32();
        }
    }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn axpy4_i8_avx2(a: [f32; 4], q: [&[i8]; 4], next: [&[i8]; 4], out: &mut [f32]) {
    let n = q.iter().map(|r| r.len()).fold(out.len(), usize::min);
    let av = lanes!(4, _mm256_setzero_ps(), |r| _mm256_set1_ps(a[r]));
    let p = q.map(|r| r.as_ptr());
    let nx = next.map(|r| r.as_ptr() as *const u8);
    let op = out.as_mut_ptr();
    let mut i = 0;
    // SAFETY: 8 values at o + 8 ≤ i + 64 ≤ n (8 for the second loop).
    unsafe {
        while i + 64 <= n {
            for &q in &nx {
                prefetch_next(q, i);
            }
            for o in (i..i + 64).step_by(8) {
                let mut v = _mm256_loadu_ps(op.add(o));
                for r in 0..4 {
                    v = _mm256_fmadd_ps(av[r], i8x8(p[r].add(o)), v);
                }
                _mm256_storeu_ps(op.add(o), v);
            }
            i += 64;
        }
        while i + 8 <= n {
            let mut v = _mm256_loadu_ps(op.add(i));
            for r in 0..4 {
                v = _mm256_fmadd_ps(av[r], i8x8(p[r].add(i)), v);
            }
            _mm256_storeu_ps(op.add(i), v);
            i += 8;
        }
    }
    for j in i..n {
        for r in 0..4 {
            out[j] += a[r] * q[r][j] as f32;
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn axpy4_i4_avx2(a: [f32; 4], w: [I4Row; 4], next: [I4Row; 4], out: &mut [f32]) {
    let groups = i4_groups(&w, out.len());
    let nx = next.map(|(_, q)| q.as_ptr());
    prefetch_scales(&next);
    for g in 0..groups {
        if g % 4 == 0 {
            for &q in &nx {
                prefetch_next(q, g * 16);
            }
        }
        // SAFETY: group g < groups: 16 code bytes of every row and 32 outputs in bounds.
        unsafe {
            let op = out.as_mut_ptr().add(g * INT4_GROUP);
            let mut o = lanes!(4, _mm256_setzero_ps(), |k| _mm256_loadu_ps(op.add(8 * k)));
            for r in 0..4 {
                let s = _mm256_set1_ps(a[r] * scale_at(w[r].0, g));
                let v = i4x32(w[r].1.as_ptr().add(g * INT4_GROUP / 2));
                for k in 0..4 {
                    o[k] = _mm256_fmadd_ps(s, v[k], o[k]);
                }
            }
            for (k, ok) in o.iter().enumerate() {
                _mm256_storeu_ps(op.add(8 * k), *ok);
            }
        }
    }
}

/// Where tile row `w` keeps its values `i .. i + 32` (`i` a multiple of [`TILE_COLS`] below the
/// row's width), from the row's first line: a chunk is `lanes` lines (a tile's [`TILE_NEURONS`],
/// or a row of its own's one), the row's at its place among them; so at `i · lanes` from it.
/// (Checked by the callers: the part holds `lanes` rows of `n` values, the row is one of them,
/// `n` is a multiple of [`TILE_COLS`].)
#[inline(always)]
fn row_start(w: &TileRow) -> *const u16 {
    w.part.as_ptr().wrapping_add(w.place * TILE_COLS) as *const u16
}

/// Columns the rows share, checked: each row one of a tile's part ([`TILE_NEURONS`] rows of a
/// multiple of [`TILE_COLS`] values) or a row of its own as wide; `x` (or `out`) as wide.
fn tile_width(w: &[TileRow; 4], x: usize) -> usize {
    let n = x;
    assert!(
        n.is_multiple_of(TILE_COLS)
            && w.iter().all(|r| {
                (r.lanes == TILE_NEURONS || r.lanes == 1)
                    && r.part.len() == n * r.lanes
                    && r.place < r.lanes
            }),
        "tile rows out of shape"
    );
    n
}

/// How far ahead of the chunk being read the tile kernels ask for lines (into L1), where hints
/// pay: the tiles are read as one stream, and on some cores the hardware prefetchers alone keep
/// too little in flight. The best choice differs by core; out of tree, 30 SmolLM2 layers in
/// tiles (1,536 neurons, 85% on, 2 threads, `tiled_ffn`) unless said otherwise:
/// - on an AMD Zen 5 VM (family 1Ah, 2 cores): 26.5 GB/s at 512 bytes into L2, 38–39 at 4 KiB
///   into L1, 41–42 from 8 to 24 KiB, 34 at 16 KiB into L2, while its DRAM probe read 50–55;
/// - on an Intel Xeon VM with AVX-512 FP16 (2 cores, a worker kept between forks): 20–25 GB/s
///   at 2 KiB into L1 against 16–19 at 8 KiB; in the engine (`bench decode`, SmolLM2 bundled at
///   48M, budgeted device, alternated) hybrid's cold pass took 8.4–8.8 ms a token at 2 KiB
///   against 9.2 at 8 KiB. An earlier Intel VM had found no distance up to 16 KiB into L2
///   better than 512 bytes (L1 untried);
/// - on an AMD Zen 4 VM (family 19h, 2 cores), no hints at all: the hardware prefetchers keep
///   the stream at the memory's rate, and hints only take issue slots and miss buffers from
///   it. Out of tree, three runs each alternated, 16 KiB into L2 read 30.9–31.6 GB/s against
///   32.7–35.4 without hints while a plain read of the same bytes took 32–37 (the machine's
///   slower memory placement); with its faster one (plain read 55–72) 34–39 against 45–48.
///   In the engine (as above, eight rounds alternated, DRAM probe 34–37 GB/s in each) hybrid
///   decoded 122–135 tokens/s with hints (0.67–0.73 of its bound) and 135–143 without
///   (0.70–0.76), faster in every round. (Hints into L1 had been slower still: the cold pass
///   7.2–9.6 ms a token at 8 KiB against 5.4–7.2 at 16 KiB into L2. Zen 3, also family 19h,
///   untried.)
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct TilePrefetch {
    /// Bytes past the chunk being read.
    distance: usize,
}

/// [`TilePrefetch`] for a core by its CPUID vendor and (display) family; `None` where the
/// kernels give no hints.
fn tile_prefetch_for(amd: bool, family: u32) -> Option<TilePrefetch> {
    match (amd, family) {
        (true, 0x19) => None,
        (true, _) => Some(TilePrefetch { distance: 8 << 10 }),
        (false, _) => Some(TilePrefetch { distance: 2 << 10 }),
    }
}

/// This core's [`TilePrefetch`], read once.
fn tile_prefetch() -> Option<TilePrefetch> {
    static PREFETCH: std::sync::OnceLock<Option<TilePrefetch>> = std::sync::OnceLock::new();
    *PREFETCH.get_or_init(|| {
        let v = __cpuid(0);
        let amd = [v.ebx, v.edx, v.ecx] == [0x6874_7541, 0x6974_6e65, 0x444d_4163];
        tile_prefetch_for(amd, display_family(__cpuid(1).eax))
    })
}

/// The family CPUID leaf 1 reports in `eax`: the base family, plus the extended family where
/// the base is 0Fh.
fn display_family(eax: u32) -> u32 {
    let base = (eax >> 8) & 0xf;
    if base == 0xf {
        base + ((eax >> 20) & 0xff)
    } else {
        base
    }
}

/// Asks for the chunk's lines as [`TilePrefetch`] says.
#[inline(always)]
fn prefetch_chunk(p: *const u16, how: TilePrefetch) {
    for line in 0..TILE_COLS * TILE_NEURONS * 2 / 64 {
        let at = (p as *const i8).wrapping_add(how.distance + 64 * line);
        // SAFETY: a prefetch is a hint: it never faults, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(at) };
    }
}

/// [`dot4_f16_body`] over tile rows: each row's sum in the same accumulators and order, so the
/// same bits as over the row alone. A part's chunk of 32 columns is its rows' lines side by
/// side, so four rows of a part are read as one run.
macro_rules! dot4_tiled_body {
    ($name:ident, $features:literal) => {
        #[target_feature(enable = $features)]
        unsafe fn $name(w: [TileRow; 4], x: &[f32], ahead: bool) -> [f32; 4] {
            let n = tile_width(&w, x.len());
            let hints = if ahead { tile_prefetch() } else { None };
            let p = w.map(|r| row_start(&r));
            let lanes = w.map(|r| r.lanes);
            let xp = x.as_ptr();
            let mut acc = [[_mm256_setzero_ps(); 4]; 4];
            // SAFETY: the row's values `i + 8k .. i + 8k + 8` lie at `i·lanes + 8k` from its
            // start, within the part for `i + 32 ≤ n` (`tile_width`).
            unsafe {
                for i in (0..n).step_by(TILE_COLS) {
                    if let Some(how) = hints {
                        prefetch_chunk(w[0].part.as_ptr().add(i * lanes[0]) as *const u16, how);
                    }
                    for k in 0..4 {
                        let o = i + 8 * k;
                        let xv = _mm256_loadu_ps(xp.add(o));
                        for r in 0..4 {
                            let at = p[r].add(i * lanes[r] + 8 * k);
                            let wv = _mm256_cvtph_ps(_mm_loadu_si128(at as *const __m128i));
                            acc[r][k] = _mm256_fmadd_ps(wv, xv, acc[r][k]);
                        }
                    }
                }
            }
            lanes!(4, 0.0, |r| hsum(_mm256_add_ps(
                _mm256_add_ps(acc[r][0], acc[r][1]),
                _mm256_add_ps(acc[r][2], acc[r][3]),
            )))
        }
    };
}

dot4_tiled_body!(dot4_tiled_avx2, "avx2,fma,f16c");
dot4_tiled_body!(dot4_tiled_avx512, "avx2,fma,f16c,avx512f,avx512vl");

/// [`axpy4_f16_avx2`] over tile rows: the same terms in the same order.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn axpy4_tiled_avx2(a: [f32; 4], w: [TileRow; 4], out: &mut [f32], ahead: bool) {
    let n = tile_width(&w, out.len());
    let hints = if ahead { tile_prefetch() } else { None };
    let av = lanes!(4, _mm256_setzero_ps(), |r| _mm256_set1_ps(a[r]));
    let p = w.map(|r| row_start(&r));
    let lanes = w.map(|r| r.lanes);
    let op = out.as_mut_ptr();
    // SAFETY: as in `dot4_tiled_body`; `out` holds `n` values.
    unsafe {
        for i in (0..n).step_by(TILE_COLS) {
            if let Some(how) = hints {
                prefetch_chunk(w[0].part.as_ptr().add(i * lanes[0]) as *const u16, how);
            }
            for o in (i..i + TILE_COLS).step_by(8) {
                let mut v = _mm256_loadu_ps(op.add(o));
                for r in 0..4 {
                    let at = p[r].add(i * lanes[r] + o - i);
                    let c = _mm256_cvtph_ps(_mm_loadu_si128(at as *const __m128i));
                    v = _mm256_fmadd_ps(av[r], c, v);
                }
                _mm256_storeu_ps(op.add(o), v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CPUID leaf 1's family: Intel's base family 6, AMD's 0Fh plus the extended (Zen 4:
    /// 19h, Zen 5: 1Ah); Zen 3/4 give no hints, other cores hint into L1.
    #[test]
    fn the_tile_hints_follow_the_core_family() {
        // Sapphire Rapids (family 6, model 8Fh), EPYC Genoa (19h, 11h), EPYC Turin (1Ah, 02h).
        assert_eq!(display_family(0x0008_06f8), 6);
        assert_eq!(display_family(0x00a1_0f11), 0x19);
        assert_eq!(display_family(0x00b0_0f21), 0x1a);
        assert_eq!(tile_prefetch_for(true, 0x19), None);
        assert_eq!(
            tile_prefetch_for(true, 0x1a),
            Some(TilePrefetch { distance: 8192 })
        );
        assert_eq!(
            tile_prefetch_for(false, 6),
            Some(TilePrefetch { distance: 2048 })
        );
        if let Some(here) = tile_prefetch() {
            assert!(here.distance > 0 && here.distance.is_multiple_of(64));
        }
    }
}
