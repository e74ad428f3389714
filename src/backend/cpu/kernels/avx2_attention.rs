//! The AVX2/FMA set's attention kernels: softmax numerators (`exp` by a polynomial), the
//! query × key score tiles and the weighted sum of value rows. Each computes a value the same
//! way wherever it falls (in a tile, a lane or the scalar tail), so a row attends alike alone
//! or beside others.

use std::arch::x86_64::*;

use super::lanes;
use super::portable::{KvValue, score_tail};

/// `exp(x)` for 8 lanes to within about 2 ulp: `2^n · e^r` with `n = round(x·log2 e)` and
/// `r = x − n·ln 2` (split in two constants, so `r` is exact to f32), `e^r` by its Taylor
/// polynomial to degree 7 (|r| ≤ 0.35: the first term left out is below 1e-8 relative).
/// Below about −87.3 (no normal f32 result) it gives 0.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn exp8(x: __m256) -> __m256 {
    // (88 first: a NaN stays NaN.)
    let x = _mm256_min_ps(_mm256_set1_ps(88.0), x);
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    let mut p = _mm256_set1_ps(EXP_TAYLOR[0]);
    for &c in &EXP_TAYLOR[1..] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    let scale = _mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(n),
        _mm256_set1_epi32(127),
    ));
    let e = _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
    let under = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(EXP_MIN));
    _mm256_andnot_ps(under, e)
}

/// [`exp8`] for one value (the same operations, lane for lane).
#[inline]
fn exp1(x: f32) -> f32 {
    let x = if x > 88.0 { 88.0 } else { x };
    let n = (x * std::f32::consts::LOG2_E).round_ties_even();
    let r = (-n).mul_add(EXP_LN2_HI, x);
    let r = (-n).mul_add(EXP_LN2_LO, r);
    let mut p = EXP_TAYLOR[0];
    for &c in &EXP_TAYLOR[1..] {
        p = p.mul_add(r, c);
    }
    let e = p * f32::from_bits(((n as i32 + 127) as u32) << 23);
    if x < EXP_MIN { 0.0 } else { e }
}

/// ln 2 in two parts: the first has few enough bits that `n · EXP_LN2_HI` is exact.
const EXP_LN2_HI: f32 = 0.693_145_75;
const EXP_LN2_LO: f32 = 1.428_606_8e-6;
/// Below this `exp` has no normal f32 value.
const EXP_MIN: f32 = -87.336_55;
/// 1/7!, 1/6!, …, 1/1!, 1/0! (Horner's order).
const EXP_TAYLOR: [f32; 8] = [
    1.0 / 5040.0,
    1.0 / 720.0,
    1.0 / 120.0,
    1.0 / 24.0,
    1.0 / 6.0,
    0.5,
    1.0,
    1.0,
];

#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn exp_sum_avx2(s: &mut [f32], max: f32) -> f64 {
    let m = _mm256_set1_ps(max);
    let (mut lo, mut hi) = (_mm256_setzero_pd(), _mm256_setzero_pd());
    let mut chunks = s.chunks_exact_mut(8);
    for c in &mut chunks {
        // SAFETY: 8 floats.
        unsafe {
            let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), m));
            _mm256_storeu_ps(c.as_mut_ptr(), e);
            lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
            hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(e)));
        }
    }
    let mut lanes = [0f64; 4];
    // SAFETY: 4 doubles.
    unsafe { _mm256_storeu_pd(lanes.as_mut_ptr(), _mm256_add_pd(lo, hi)) };
    let mut sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
    for v in chunks.into_remainder() {
        *v = exp1(*v - max);
        sum += *v as f64;
    }
    sum
}

/// [`Kernels::scores`](super::Kernels::scores): two queries against four keys at a time (eight
/// accumulators, each key loaded once for both), a lone query against eight; whatever the tile,
/// a product is one chain of multiply-adds per lane and the same reduction.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn scores_avx2<K: KvValue>(qs: &[&[f32]], keys: &[&[K]], out: &mut [f32]) {
    let m = keys.len();
    let n = qs.first().map_or(0, |q| q.len());
    if m == 0 || out.len() < qs.len() * m {
        return;
    }
    if qs.iter().any(|r| r.len() != n) || keys.iter().any(|r| r.len() != n) {
        // Rows of unlike lengths (never in attention): each product alone, as defined.
        for (q, o) in qs.iter().zip(out.chunks_mut(m)) {
            for (o, k) in o.iter_mut().zip(keys) {
                // SAFETY: AVX2+FMA enabled on this function; the tile reads below `whole`.
                *o = unsafe { score_tiles::<1, 1, K>([q], [k], q.len().min(k.len())) }[0];
            }
        }
        return;
    }
    let mut i = 0;
    // SAFETY (every call below): the rows are `n` long; the tiles read below n / 8 · 8.
    unsafe {
        while i + 2 <= qs.len() {
            let q = [qs[i], qs[i + 1]];
            let mut j = 0;
            while j + 4 <= m {
                let k = [keys[j], keys[j + 1], keys[j + 2], keys[j + 3]];
                let s = score_tiles::<2, 4, K>(q, k, n);
                out[i * m + j..][..4].copy_from_slice(&s[..4]);
                out[(i + 1) * m + j..][..4].copy_from_slice(&s[4..]);
                j += 4;
            }
            for j in j..m {
                let s = score_tiles::<2, 1, K>(q, [keys[j]], n);
                (out[i * m + j], out[(i + 1) * m + j]) = (s[0], s[1]);
            }
            i += 2;
        }
        if let Some(&q) = qs.get(i) {
            let mut j = 0;
            while j + 4 <= m {
                let k = [keys[j], keys[j + 1], keys[j + 2], keys[j + 3]];
                out[i * m + j..][..4].copy_from_slice(&score_tiles::<1, 4, K>([q], k, n)[..4]);
                j += 4;
            }
            for j in j..m {
                out[i * m + j] = score_tiles::<1, 1, K>([q], [keys[j]], n)[0];
            }
        }
    }
}

/// The products of `QN` queries and `KN` keys (`QN · KN` ≤ 8) over their first `n` values,
/// query-major: a lane chain of multiply-adds per 8-wide step, the lanes added pairwise
/// ([`reduce_lanes`]), then the tail ([`score_tail`]).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn score_tiles<const QN: usize, const KN: usize, K: KvValue>(
    q: [&[f32]; QN],
    k: [&[K]; KN],
    n: usize,
) -> [f32; 8] {
    let whole = n / 8 * 8;
    let mut acc = [_mm256_setzero_ps(); 8];
    let mut t = 0;
    // SAFETY: every load reads 8 floats below `whole` ≤ each row's length.
    unsafe {
        while t < whole {
            let mut qv = [_mm256_setzero_ps(); QN];
            for a in 0..QN {
                qv[a] = _mm256_loadu_ps(q[a].as_ptr().add(t));
            }
            for b in 0..KN {
                let kv = load8(k[b].as_ptr().add(t));
                for a in 0..QN {
                    acc[a * KN + b] = _mm256_fmadd_ps(qv[a], kv, acc[a * KN + b]);
                }
            }
            t += 8;
        }
    }
    let mut s = [0f32; 8];
    // SAFETY: `s` holds the 8 lanes stored.
    unsafe { _mm256_storeu_ps(s.as_mut_ptr(), reduce_lanes(acc)) };
    if whole < n {
        for a in 0..QN {
            for b in 0..KN {
                s[a * KN + b] = score_tail(s[a * KN + b], q[a], k[b], whole);
            }
        }
    }
    s
}

/// Eight accumulators' lanes each summed as [`pairwise`](super::portable::pairwise) sums them,
/// into one register: horizontal adds pair lanes 0+1, 2+3 (then those pairs) within each half,
/// and the halves meet last.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn reduce_lanes(a: [__m256; 8]) -> __m256 {
    let t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    let t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    _mm256_add_ps(
        _mm256_permute2f128_ps::<0x20>(t0, t1),
        _mm256_permute2f128_ps::<0x31>(t0, t1),
    )
}

/// 8 values of a cache row from `p` as f32 (an f16 row's widened exactly).
///
/// # Safety
/// 8 values readable at `p`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load8<K: KvValue>(p: *const K) -> __m256 {
    // SAFETY: the caller's promise; `K` is f32 or f16, as `HALF` says.
    unsafe {
        if K::HALF {
            _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
        } else {
            _mm256_loadu_ps(p.cast())
        }
    }
}

/// 64 outputs (8 registers) at a time through every row, a fused multiply-add per term.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn axpy_rows_avx2<K: KvValue>(out: &mut [f32], w: &[f32], rows: &[&[K]]) {
    let rows = &rows[..w.len().min(rows.len())];
    let n = rows.iter().map(|r| r.len()).fold(out.len(), usize::min);
    let op = out.as_mut_ptr();
    let mut i = 0;
    // SAFETY: every load and store touches 8 floats below n (64 in the first loop).
    unsafe {
        while i + 64 <= n {
            let zero = _mm256_setzero_ps();
            let mut o = lanes!(8, zero, |k| _mm256_loadu_ps(op.add(i + 8 * k)));
            for (&wj, row) in w.iter().zip(rows) {
                let (wv, rp) = (_mm256_set1_ps(wj), row.as_ptr().add(i));
                for (k, ok) in o.iter_mut().enumerate() {
                    *ok = _mm256_fmadd_ps(wv, load8(rp.add(8 * k)), *ok);
                }
            }
            for (k, ok) in o.iter().enumerate() {
                _mm256_storeu_ps(op.add(i + 8 * k), *ok);
            }
            i += 64;
        }
        while i + 8 <= n {
            let mut o = _mm256_loadu_ps(op.add(i));
            for (&wj, row) in w.iter().zip(rows) {
                let v = load8(row.as_ptr().add(i));
                o = _mm256_fmadd_ps(_mm256_set1_ps(wj), v, o);
            }
            _mm256_storeu_ps(op.add(i), o);
            i += 8;
        }
    }
    for j in i..n {
        for (&wj, row) in w.iter().zip(rows) {
            out[j] = wj.mul_add(row[j].into(), out[j]);
        }
    }
}
