//! Row kernels of the CPU backend: dot products of one weight row (in its storage format) with
//! activations, and the activation quantizer for the integer paths. Each kernel has a portable
//! version (the reference) and an AVX2/FMA/F16C version chosen once at run time.
//!
//! Quantized weights multiply 8-bit activations the way llama.cpp does (Q8_0/Q8_1 activation
//! blocks with f16-rounded scales), so its results and ours round alike.

use half::{bf16, f16};

use crate::tensor::{
    BlockQ2K, BlockQ3K, BlockQ4_0, BlockQ4_1, BlockQ4K, BlockQ5_0, BlockQ5_1, BlockQ5K, BlockQ6K,
    BlockQ8_0, DType, QK,
};

pub(crate) mod kq;
pub use kq::{ActBlockK, quantize_k};

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

/// `out[r·n + j] = rows[r] · x[t0 + j]` for weight rows (bytes of whole blocks) and
/// `n = out.len() / rows.len()` tokens, each result bit for bit the one-token kernel's. `next`:
/// the bytes the caller reads next, prefetched while these rows compute.
pub type DotsFn = fn(rows: &[&[u8]], x: &TokenBlocks, t0: usize, out: &mut [f32], next: &[u8]);

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

/// [`Kernels::scores`]: query rows, key rows, the products query-major.
pub type ScoresFn = fn(&[&[f32]], &[&[f32]], &mut [f32]);

/// The kernel set for this machine.
pub struct Kernels {
    pub name: &'static str,
    pub dot_f32: fn(&[f32], &[f32]) -> f32,
    /// `out[i] += w[j] · rows[j][i]` for each row `j` in order (a fused multiply-add where the
    /// set has one): attention's weighted sum of values, `out` held in registers across the
    /// rows. Each output depends on its own column alone, so a row's sums do not depend on
    /// the rows beside it.
    pub axpy_rows: fn(&mut [f32], &[f32], &[&[f32]]),
    /// `out[i · keys.len() + j] = qs[i] · keys[j]`: attention's scores, a tile of query heads
    /// (a prompt's rows, the heads sharing a KV head) against a block of key rows. Each product
    /// is summed alike wherever it falls in the tile (eight lanes of multiply-adds over the
    /// 8-wide steps, the lanes added pairwise, then the values past the last whole step in
    /// order), so a query's scores do not depend on the queries beside it: a decode step's row
    /// gives what the same row gives in a prompt, while a tile reads each key row once for two
    /// queries.
    pub scores: ScoresFn,
    /// `s[i] = exp(s[i] − max)` for scores at most `max`, returning their sum: a softmax's
    /// numerators. Each value depends on its input alone (not on where it lies in `s`).
    pub exp_sum: fn(&mut [f32], f32) -> f64,
    pub dot_f16: fn(&[f16], &[f32]) -> f32,
    pub dot_bf16: fn(&[bf16], &[f32]) -> f32,
    pub dot_q8_0: fn(&[BlockQ8_0], &[ActBlock]) -> f32,
    pub dot_q4_0: fn(&[BlockQ4_0], &[ActBlock]) -> f32,
    pub dot_q4_1: fn(&[BlockQ4_1], &[ActBlock]) -> f32,
    pub dot_q5_0: fn(&[BlockQ5_0], &[ActBlock]) -> f32,
    pub dot_q5_1: fn(&[BlockQ5_1], &[ActBlock]) -> f32,
    pub dot_q2_k: fn(&[BlockQ2K], &[ActBlockK]) -> f32,
    pub dot_q3_k: fn(&[BlockQ3K], &[ActBlockK]) -> f32,
    pub dot_q4_k: fn(&[BlockQ4K], &[ActBlockK]) -> f32,
    pub dot_q5_k: fn(&[BlockQ5K], &[ActBlockK]) -> f32,
    pub dot_q6_k: fn(&[BlockQ6K], &[ActBlockK]) -> f32,
    /// Activations into 32-value blocks (Q8_0…Q5_1 weights).
    pub quantize: fn(&[f32], &mut [ActBlock]),
    /// Activations into 256-value blocks (K-quant weights).
    pub quantize_k: fn(&[f32], &mut [ActBlockK]),
    /// Many-row Q8_0 / Q4_0 / Q4_1 kernels, where this set has them: each weight block is
    /// unpacked once for all the tokens and scaled once for a register of rows (batched decode
    /// is compute-bound on these formats otherwise).
    pub dots_q8_0: Option<DotsFn>,
    pub dots_q4_0: Option<DotsFn>,
    pub dots_q4_1: Option<DotsFn>,
}

impl Kernels {
    /// The many-row kernel for weights in `dtype`, if this set has one.
    pub fn dots(&self, dtype: DType) -> Option<DotsFn> {
        match dtype {
            DType::Q8_0 => self.dots_q8_0,
            DType::Q4_0 => self.dots_q4_0,
            DType::Q4_1 => self.dots_q4_1,
            _ => None,
        }
    }

    /// The many-row kernel for activation blocks `q` (`per_token` to a token) over weights in
    /// `dtype`, where this set has one (it serves one token as well as many).
    pub fn many_rows<'a>(
        &self,
        dtype: DType,
        q: &'a [ActBlock],
        per_token: usize,
    ) -> Option<(TokenBlocks<'a>, DotsFn)> {
        let dots = self.dots(dtype)?;
        Some((
            TokenBlocks {
                blocks: q,
                per_token,
            },
            dots,
        ))
    }
}

/// Every kernel set this CPU can run, best first.
pub fn available() -> Vec<&'static Kernels> {
    #[allow(unused_mut)]
    let mut v: Vec<&'static Kernels> = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        if x86::supported() {
            if x86::vnni::supported() {
                v.push(&x86::vnni::KERNELS);
            }
            v.push(&x86::KERNELS);
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

pub const PORTABLE: Kernels = Kernels {
    name: "portable",
    dot_f32: portable::dot_f32,
    axpy_rows: portable::axpy_rows,
    scores: portable::scores,
    exp_sum: portable::exp_sum,
    dot_f16: portable::dot_f16,
    dot_bf16: portable::dot_bf16,
    dot_q8_0: portable::dot_q8_0,
    dot_q4_0: portable::dot_q4_0,
    dot_q4_1: portable::dot_q4_1,
    dot_q5_0: kq::portable::dot_q5_0,
    dot_q5_1: kq::portable::dot_q5_1,
    dot_q2_k: kq::portable::dot_q2_k,
    dot_q3_k: kq::portable::dot_q3_k,
    dot_q4_k: kq::portable::dot_q4_k,
    dot_q5_k: kq::portable::dot_q5_k,
    dot_q6_k: kq::portable::dot_q6_k,
    quantize: portable::quantize,
    quantize_k,
    dots_q8_0: None,
    dots_q4_0: None,
    dots_q4_1: None,
};

/// Eight lanes added as attention's scores add them: ((0+1)+(2+3))+((4+5)+(6+7)).
fn pairwise(l: [f32; 8]) -> f32 {
    ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
}

/// A score's lanes' `sum` and the products of `q` and `k` from `whole` on, in order.
fn score_tail(mut sum: f32, q: &[f32], k: &[f32], whole: usize) -> f32 {
    for t in whole..q.len().min(k.len()) {
        sum += q[t] * k[t];
    }
    sum
}

fn round_f16(v: f32) -> f32 {
    f16::from_f32(v).to_f32()
}

pub mod portable {
    use super::*;

    pub fn dot_f32(w: &[f32], x: &[f32]) -> f32 {
        dot_as_f32(w, x, |v| v)
    }

    pub fn scores(qs: &[&[f32]], keys: &[&[f32]], out: &mut [f32]) {
        if keys.is_empty() {
            return;
        }
        for (q, o) in qs.iter().zip(out.chunks_mut(keys.len())) {
            for (o, k) in o.iter_mut().zip(keys) {
                *o = score(q, k);
            }
        }
    }

    /// One of [`scores`]'s products: the lanes' sums (a multiply then an add each, as the
    /// other portable dots round), added pairwise, then the tail.
    fn score(q: &[f32], k: &[f32]) -> f32 {
        let n = q.len().min(k.len());
        let whole = n / 8 * 8;
        let mut lanes = [0f32; 8];
        for (qc, kc) in q[..whole].chunks_exact(8).zip(k[..whole].chunks_exact(8)) {
            for l in 0..8 {
                lanes[l] += qc[l] * kc[l];
            }
        }
        super::score_tail(super::pairwise(lanes), q, k, whole)
    }

    pub fn axpy_rows(out: &mut [f32], w: &[f32], rows: &[&[f32]]) {
        for (&w, row) in w.iter().zip(rows) {
            out.iter_mut().zip(*row).for_each(|(o, &v)| *o += w * v);
        }
    }

    pub fn exp_sum(s: &mut [f32], max: f32) -> f64 {
        let mut sum = 0f64;
        for v in s.iter_mut() {
            *v = (*v - max).exp();
            sum += *v as f64;
        }
        sum
    }

    /// Eight partial sums: the same association the SIMD version uses, and faster. Every float
    /// format sums this way, so a row decoded to f32 first (as the matmul does for several
    /// tokens) gives what the row in its own format gives.
    fn dot_as_f32<W: Copy>(w: &[W], x: &[f32], f: impl Fn(W) -> f32) -> f32 {
        let mut acc = [0f32; 8];
        let chunks = w.len().min(x.len()) / 8 * 8;
        for (wc, xc) in w[..chunks].chunks_exact(8).zip(x[..chunks].chunks_exact(8)) {
            for i in 0..8 {
                acc[i] += f(wc[i]) * xc[i];
            }
        }
        let mut sum: f32 = acc.iter().sum();
        for i in chunks..w.len().min(x.len()) {
            sum += f(w[i]) * x[i];
        }
        sum
    }

    pub fn dot_f16(w: &[f16], x: &[f32]) -> f32 {
        dot_as_f32(w, x, f16::to_f32)
    }

    pub fn dot_bf16(w: &[bf16], x: &[f32]) -> f32 {
        dot_as_f32(w, x, bf16::to_f32)
    }

    pub fn dot_q8_0(w: &[BlockQ8_0], x: &[ActBlock]) -> f32 {
        w.iter()
            .zip(x)
            .map(|(b, a)| {
                let dot: i32 =
                    b.qs.iter()
                        .zip(a.qs)
                        .map(|(&p, q)| p as i32 * q as i32)
                        .sum();
                b.d.to_f32() * a.d * dot as f32
            })
            .sum()
    }

    fn nibble_dot(qs: &[u8; QK / 2], a: &ActBlock) -> i32 {
        let (lo, hi) = a.qs.split_at(QK / 2);
        qs.iter()
            .zip(lo.iter().zip(hi))
            .map(|(&q, (&x0, &x1))| (q & 0x0f) as i32 * x0 as i32 + (q >> 4) as i32 * x1 as i32)
            .sum()
    }

    pub fn dot_q4_0(w: &[BlockQ4_0], x: &[ActBlock]) -> f32 {
        w.iter()
            .zip(x)
            .map(|(b, a)| {
                let dot = nibble_dot(&b.qs, a) - 8 * a.isum;
                b.d.to_f32() * a.d * dot as f32
            })
            .sum()
    }

    pub fn dot_q4_1(w: &[BlockQ4_1], x: &[ActBlock]) -> f32 {
        w.iter()
            .zip(x)
            .map(|(b, a)| {
                let dot = nibble_dot(&b.qs, a);
                b.d.to_f32() * a.d * dot as f32 + b.m.to_f32() * a.s
            })
            .sum()
    }

    /// llama.cpp's x86 activation quantizer: d = max|x|/127 (stored as f16), q = round-half-even
    /// (x·127/max|x|), s = f16(d·Σq).
    pub fn quantize(x: &[f32], out: &mut [ActBlock]) {
        for (xs, o) in x.chunks_exact(QK).zip(out.iter_mut()) {
            let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
            let mut sum = 0i32;
            for (q, &v) in o.qs.iter_mut().zip(xs) {
                let r = (v * id).round_ties_even() as i32;
                *q = r as i8;
                sum += r;
            }
            o.d = round_f16(d);
            o.isum = sum;
            o.s = round_f16(d * sum as f32);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use half::bf16;
    use std::arch::x86_64::*;

    pub fn supported() -> bool {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    }

    pub const KERNELS: Kernels = Kernels {
        name: "avx2",
        dot_f32,
        axpy_rows,
        scores,
        exp_sum,
        dot_f16,
        dot_bf16,
        dot_q8_0,
        dot_q4_0,
        dot_q4_1,
        dot_q5_0,
        dot_q5_1,
        dot_q2_k,
        dot_q3_k,
        dot_q4_k,
        dot_q5_k,
        dot_q6_k,
        quantize,
        quantize_k,
        dots_q8_0: None,
        dots_q4_0: None,
        dots_q4_1: None,
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
    fn scores(qs: &[&[f32]], keys: &[&[f32]], out: &mut [f32]) {
        // SAFETY: as above.
        unsafe { scores_avx2(qs, keys, out) }
    }
    fn exp_sum(s: &mut [f32], max: f32) -> f64 {
        // SAFETY: as above.
        unsafe { exp_sum_avx2(s, max) }
    }

    /// `exp(x)` for 8 lanes to within about 2 ulp: `2^n · e^r` with `n = round(x·log2 e)` and
    /// `r = x − n·ln 2` (split in two constants, so `r` is exact to f32), `e^r` by its Taylor
    /// polynomial to degree 7 (|r| ≤ 0.35: the first term left out is below 1e-8 relative).
    /// Below about −87.3 (no normal f32 result) it gives 0.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn exp8(x: __m256) -> __m256 {
        // (88 first: a NaN stays NaN.)
        let x = _mm256_min_ps(_mm256_set1_ps(88.0), x);
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        );
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
    unsafe fn exp_sum_avx2(s: &mut [f32], max: f32) -> f64 {
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
    fn dot_q4_0(w: &[BlockQ4_0], x: &[ActBlock]) -> f32 {
        // SAFETY: as above.
        unsafe { dot_q4_avx2::<false>(bytemuck::cast_slice(w), x) }
    }
    fn dot_q4_1(w: &[BlockQ4_1], x: &[ActBlock]) -> f32 {
        // SAFETY: as above.
        unsafe { dot_q4_avx2::<true>(bytemuck::cast_slice(w), x) }
    }
    fn quantize(x: &[f32], out: &mut [ActBlock]) {
        // SAFETY: as above.
        unsafe { quantize_avx2(x, out) }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps::<1>(v);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
        _mm_cvtss_f32(s)
    }

    /// [`Kernels::scores`]: two queries against four keys at a time (eight accumulators, each
    /// key loaded once for both), a lone query against eight; whatever the tile, a product is
    /// one chain of multiply-adds per lane and the same reduction.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn scores_avx2(qs: &[&[f32]], keys: &[&[f32]], out: &mut [f32]) {
        let m = keys.len();
        let n = qs.first().map_or(0, |q| q.len());
        if m == 0 || out.len() < qs.len() * m {
            return;
        }
        if qs.iter().chain(keys).any(|r| r.len() != n) {
            // Rows of unlike lengths (never in attention): each product alone, as defined.
            for (q, o) in qs.iter().zip(out.chunks_mut(m)) {
                for (o, k) in o.iter_mut().zip(keys) {
                    // SAFETY: AVX2+FMA enabled on this function; the tile reads below `whole`.
                    *o = unsafe { score_tiles::<1, 1>([q], [k], q.len().min(k.len())) }[0];
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
                    let s = score_tiles::<2, 4>(q, k, n);
                    out[i * m + j..][..4].copy_from_slice(&s[..4]);
                    out[(i + 1) * m + j..][..4].copy_from_slice(&s[4..]);
                    j += 4;
                }
                for j in j..m {
                    let s = score_tiles::<2, 1>(q, [keys[j]], n);
                    (out[i * m + j], out[(i + 1) * m + j]) = (s[0], s[1]);
                }
                i += 2;
            }
            if let Some(&q) = qs.get(i) {
                let mut j = 0;
                while j + 4 <= m {
                    let k = [keys[j], keys[j + 1], keys[j + 2], keys[j + 3]];
                    out[i * m + j..][..4].copy_from_slice(&score_tiles::<1, 4>([q], k, n)[..4]);
                    j += 4;
                }
                for j in j..m {
                    out[i * m + j] = score_tiles::<1, 1>([q], [keys[j]], n)[0];
                }
            }
        }
    }

    /// The products of `QN` queries and `KN` keys (`QN · KN` ≤ 8) over their first `n` values,
    /// query-major: a lane chain of multiply-adds per 8-wide step, the lanes added pairwise
    /// ([`reduce_lanes`]), then the tail ([`score_tail`]).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn score_tiles<const QN: usize, const KN: usize>(
        q: [&[f32]; QN],
        k: [&[f32]; KN],
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
                    let kv = _mm256_loadu_ps(k[b].as_ptr().add(t));
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

    /// Eight accumulators' lanes each summed as [`pairwise`] sums them, into one register:
    /// horizontal adds pair lanes 0+1, 2+3 (then those pairs) within each half, and the halves
    /// meet last.
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

    /// 64 outputs (8 registers) at a time through every row, a fused multiply-add per term.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn axpy_rows_avx2(out: &mut [f32], w: &[f32], rows: &[&[f32]]) {
        let rows = &rows[..w.len().min(rows.len())];
        let n = rows.iter().map(|r| r.len()).fold(out.len(), usize::min);
        let op = out.as_mut_ptr();
        let mut i = 0;
        // SAFETY: every load and store touches 8 floats below n (64 in the first loop).
        unsafe {
            while i + 64 <= n {
                let mut o = [0, 1, 2, 3, 4, 5, 6, 7].map(|k| _mm256_loadu_ps(op.add(i + 8 * k)));
                for (&wj, row) in w.iter().zip(rows) {
                    let (wv, rp) = (_mm256_set1_ps(wj), row.as_ptr().add(i));
                    for (k, ok) in o.iter_mut().enumerate() {
                        *ok = _mm256_fmadd_ps(wv, _mm256_loadu_ps(rp.add(8 * k)), *ok);
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
                    let v = _mm256_loadu_ps(row.as_ptr().add(i));
                    o = _mm256_fmadd_ps(_mm256_set1_ps(wj), v, o);
                }
                _mm256_storeu_ps(op.add(i), o);
                i += 8;
            }
        }
        for j in i..n {
            for (&wj, row) in w.iter().zip(rows) {
                out[j] = wj.mul_add(row[j], out[j]);
            }
        }
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
                    *a =
                        _mm256_fmadd_ps(_mm256_loadu_ps(wp.add(o)), _mm256_loadu_ps(xp.add(o)), *a);
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

    /// Eight copies of an f16 as f32. (A scalar conversion compiles to an insert that depends on
    /// whatever register it merges into, which chained the blocks of the loops below.)
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    fn h2f8(bits: u16) -> __m256 {
        _mm256_cvtph_ps(_mm_set1_epi16(bits as i16))
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

    /// One Q4 block (`header` bytes of scales, then 16 bytes of nibbles) against one activation
    /// block: (d_w·d_x·Σ q_w q_x as 8 lanes, offset term as 8 equal lanes).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_block<const WITH_MIN: bool>(wb: *const u8, a: &ActBlock) -> (__m256, __m256) {
        let header = if WITH_MIN { 4 } else { 2 };
        let mask = _mm_set1_epi8(0x0f);
        // SAFETY: the caller passes a whole block; the activation block has 32 i8.
        let (packed, xv, d_bits, m_bits) = unsafe {
            (
                _mm_loadu_si128(wb.add(header) as *const __m128i),
                _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i),
                (wb as *const u16).read_unaligned(),
                if WITH_MIN {
                    (wb.add(2) as *const u16).read_unaligned()
                } else {
                    0
                },
            )
        };
        let lo = _mm_and_si128(packed, mask);
        let hi = _mm_and_si128(_mm_srli_epi16::<4>(packed), mask);
        let prod = _mm256_cvtepi32_ps(mul_sum_u8_i8(_mm256_set_m128i(hi, lo), xv));
        let scale = _mm256_mul_ps(h2f8(u16::from_le(d_bits)), _mm256_set1_ps(a.d));
        let offset = if WITH_MIN {
            // m·s: the min times the (scaled) sum of the activations.
            _mm256_mul_ps(h2f8(u16::from_le(m_bits)), _mm256_set1_ps(a.s))
        } else {
            // d_w·d_x·Σq_x, for the −8 offset of Q4_0 codes.
            _mm256_mul_ps(scale, _mm256_set1_ps(a.isum as f32))
        };
        (_mm256_mul_ps(scale, prod), offset)
    }

    /// Q4_0 (`WITH_MIN = false`, blocks of 18 bytes) and Q4_1 (`true`, 20 bytes).
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_q4_avx2<const WITH_MIN: bool>(w: &[u8], x: &[ActBlock]) -> f32 {
        let block = if WITH_MIN { 20 } else { 18 };
        let n = (w.len() / block).min(x.len());
        let p = w.as_ptr();
        // Even and odd blocks accumulate separately so consecutive blocks do not wait on
        // each other's adds.
        let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let (mut off0, mut off1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut i = 0;
        // SAFETY: i + 1 < n, so both blocks lie inside `w` and `x`.
        unsafe {
            while i + 1 < n {
                let (d0, o0) = q4_block::<WITH_MIN>(p.add(i * block), &x[i]);
                let (d1, o1) = q4_block::<WITH_MIN>(p.add((i + 1) * block), &x[i + 1]);
                acc0 = _mm256_add_ps(acc0, d0);
                acc1 = _mm256_add_ps(acc1, d1);
                off0 = _mm256_add_ps(off0, o0);
                off1 = _mm256_add_ps(off1, o1);
                i += 2;
            }
            if i < n {
                let (d0, o0) = q4_block::<WITH_MIN>(p.add(i * block), &x[i]);
                acc0 = _mm256_add_ps(acc0, d0);
                off0 = _mm256_add_ps(off0, o0);
            }
        }
        let dots = hsum(_mm256_add_ps(acc0, acc1));
        // Every lane of the offset sums holds the same value; take lane 0.
        let off = _mm256_cvtss_f32(_mm256_add_ps(off0, off1));
        if WITH_MIN {
            dots + off
        } else {
            dots - 8.0 * off
        }
    }

    /// AVX-512 VNNI: two 32-value blocks per 512-bit `vpdpbusd` (u8 × i8 → i32 in one op).
    pub mod vnni {
        use super::*;

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
            dots_q8_0: Some(dots_q8_0),
            dots_q4_0: Some(dots_q4_0),
            dots_q4_1: Some(dots_q4_1),
            ..super::KERNELS
        };

        fn dots_q8_0(rows: &[&[u8]], x: &TokenBlocks, t0: usize, out: &mut [f32], next: &[u8]) {
            // SAFETY: installed only after `supported()`; `dots` checks the bounds.
            unsafe { dots::<Q8>(rows, x, t0, out, next) }
        }
        fn dots_q4_0(rows: &[&[u8]], x: &TokenBlocks, t0: usize, out: &mut [f32], next: &[u8]) {
            // SAFETY: as above.
            unsafe { dots::<Q40>(rows, x, t0, out, next) }
        }
        fn dots_q4_1(rows: &[&[u8]], x: &TokenBlocks, t0: usize, out: &mut [f32], next: &[u8]) {
            // SAFETY: as above.
            unsafe { dots::<Q41>(rows, x, t0, out, next) }
        }

        /// Weight formats of these kernels.
        const Q8: u8 = 0;
        const Q40: u8 = 1;
        const Q41: u8 = 2;

        const fn block_bytes(kind: u8) -> usize {
            match kind {
                Q8 => 34,
                Q40 => 18,
                _ => 20,
            }
        }

        /// Weight rows a tile takes at once: one to each 32-bit lane of a register.
        const LANES: usize = 16;

        /// Tokens a tile takes at most.
        const MAX_TOKENS: usize = 8;

        // Every kernel of these formats, one row or many, computes a result the same way, so
        // that it never depends on the rows or tokens computed beside it: for each block in
        // order, the exact integer sum Σ code·x (with `code_offset`), then
        // acc = fma(d_w·d_x, sum, acc) and, for Q4_1, acc = fma(m_w, s_x, acc).

        /// The integer the block's sum of code products needs added.
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

        /// Rows in groups of 16, one row to a lane (a group's weight codes transposed once for
        /// the tile's tokens, each token's codes broadcast), tokens in tiles of 8, 4, 2 and 1:
        /// the per-block scaling costs one vector operation for 16 rows, where one row to a
        /// register paid it for every row.
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
        unsafe fn dots<const KIND: u8>(
            rows: &[&[u8]],
            x: &TokenBlocks,
            t0: usize,
            out: &mut [f32],
            next: &[u8],
        ) {
            let n = out.len() / rows.len().max(1);
            let nb = x.per_token;
            assert!(
                rows.iter().all(|r| r.len() == nb * block_bytes(KIND))
                    && out.len() == rows.len() * n
                    && t0 + n <= x.tokens(),
                "dots: {} rows, {nb} blocks per token, tokens {t0}+{n} of {}",
                rows.len(),
                x.tokens()
            );
            let groups = rows.len().div_ceil(LANES);
            let share = next.len().div_ceil(groups.max(1));
            let mut sums = [0f32; LANES * MAX_TOKENS];
            for (g, group) in rows.chunks(LANES).enumerate() {
                // Lanes past the group's last row repeat it (computed, never stored).
                let rp: [*const u8; LANES] =
                    std::array::from_fn(|i| group[i.min(group.len() - 1)].as_ptr());
                let ahead = &next[(g * share).min(next.len())..((g + 1) * share).min(next.len())];
                let mut t = 0;
                while t < n {
                    let tt = match n - t {
                        8.. => 8,
                        4..=7 => 4,
                        2 | 3 => 2,
                        _ => 1,
                    };
                    let xb = x.blocks[(t0 + t) * nb..].as_ptr();
                    let ahead = if t == 0 { ahead } else { &[] };
                    // SAFETY: whole rows of nb blocks, and tokens t0 + t .. + tt of nb blocks
                    // each (asserted above).
                    unsafe {
                        match tt {
                            8 => tile::<KIND, 8>(&rp, xb, nb, &mut sums, ahead),
                            4 => tile::<KIND, 4>(&rp, xb, nb, &mut sums, ahead),
                            2 => tile::<KIND, 2>(&rp, xb, nb, &mut sums, ahead),
                            _ => tile::<KIND, 1>(&rp, xb, nb, &mut sums, ahead),
                        }
                    }
                    let r0 = g * LANES;
                    for (i, o) in out[r0 * n..(r0 + group.len()) * n]
                        .chunks_exact_mut(n)
                        .enumerate()
                    {
                        for (j, v) in o[t..t + tt].iter_mut().enumerate() {
                            *v = sums[j * LANES + i];
                        }
                    }
                    t += tt;
                }
            }
        }

        /// 16 rows × `T` tokens into `out[t·16 + lane]`. Never inlined: each `T` gets its own
        /// register allocation. The caller checks bounds.
        #[inline(never)]
        #[allow(clippy::needless_range_loop)]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
        unsafe fn tile<const KIND: u8, const T: usize>(
            rp: &[*const u8; LANES],
            x: *const ActBlock,
            nb: usize,
            out: &mut [f32; LANES * MAX_TOKENS],
            next: &[u8],
        ) {
            let block = block_bytes(KIND);
            // Each lane's row as a distance from the first: the scales are gathered.
            let base = rp[0];
            let dist: [i64; LANES] =
                std::array::from_fn(|i| (rp[i] as usize).wrapping_sub(base as usize) as i64);
            // SAFETY: 16 i64.
            let (lo, hi) = unsafe {
                (
                    _mm512_loadu_si512(dist.as_ptr() as *const __m512i),
                    _mm512_loadu_si512(dist.as_ptr().add(8) as *const __m512i),
                )
            };
            let step = next.len().div_ceil(nb.max(1));
            let mut acc = [_mm512_setzero_ps(); T];
            for b in 0..nb {
                let at = b * block;
                let ahead = (b * step).min(next.len())..((b + 1) * step).min(next.len());
                super::super::prefetch(&next[ahead]);
                // SAFETY: block b lies inside every row; token t's block b inside `x`.
                unsafe {
                    let codes = codes16::<KIND>(rp, at);
                    let (dw, mw) = scales16::<KIND>(base.add(at), lo, hi);
                    for t in 0..T {
                        let a = &*x.add(t * nb + b);
                        let q = a.qs.as_ptr() as *const i32;
                        // Two chains: integer sums add exactly in any order.
                        let mut s0 = _mm512_set1_epi32(code_offset::<KIND>(a));
                        let mut s1 = _mm512_setzero_si512();
                        for j in 0..4 {
                            let x0 = _mm512_set1_epi32(q.add(2 * j).read_unaligned());
                            let x1 = _mm512_set1_epi32(q.add(2 * j + 1).read_unaligned());
                            s0 = _mm512_dpbusd_epi32(s0, codes[2 * j], x0);
                            s1 = _mm512_dpbusd_epi32(s1, codes[2 * j + 1], x1);
                        }
                        let f = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
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
        /// activation block.
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
        unsafe fn codes16<const KIND: u8>(rp: &[*const u8; LANES], at: usize) -> [__m512i; 8] {
            // SAFETY: whole blocks at `at` (the caller's promise).
            unsafe {
                if KIND == Q8 {
                    let a = transpose16(rp, at + 2);
                    let b = transpose16(rp, at + 18);
                    let flip = _mm512_set1_epi8(-128);
                    std::array::from_fn(|j| {
                        _mm512_xor_si512(if j < 4 { a[j] } else { b[j - 4] }, flip)
                    })
                } else {
                    // Byte i holds code i (low nibble) and code i + 16 (high nibble).
                    let t = transpose16(rp, at + block_bytes(KIND) - 16);
                    let mask = _mm512_set1_epi8(0x0f);
                    std::array::from_fn(|j| {
                        if j < 4 {
                            _mm512_and_si512(t[j], mask)
                        } else {
                            _mm512_and_si512(_mm512_srli_epi16::<4>(t[j - 4]), mask)
                        }
                    })
                }
            }
        }

        /// The scales of one block of 16 rows (`p`: the first row's block; `lo`, `hi`: each
        /// lane's row as a distance from it), and the mins (Q4_1; the scales again otherwise).
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,f16c")]
        unsafe fn scales16<const KIND: u8>(
            p: *const u8,
            lo: __m512i,
            hi: __m512i,
        ) -> (__m512, __m512) {
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
            unsafe { super::super::kq::x86::vnni::dot_q2_k(w, x) }
        }
        fn dot_q3_k(w: &[BlockQ3K], x: &[ActBlockK]) -> f32 {
            // SAFETY: as above.
            unsafe { super::super::kq::x86::vnni::dot_q3_k(w, x) }
        }
        fn dot_q4_k(w: &[BlockQ4K], x: &[ActBlockK]) -> f32 {
            // SAFETY: as above.
            unsafe { super::super::kq::x86::vnni::dot_q4_k(w, x) }
        }
        fn dot_q5_k(w: &[BlockQ5K], x: &[ActBlockK]) -> f32 {
            // SAFETY: as above.
            unsafe { super::super::kq::x86::vnni::dot_q5_k(w, x) }
        }
        fn dot_q6_k(w: &[BlockQ6K], x: &[ActBlockK]) -> f32 {
            // SAFETY: as above.
            unsafe { super::super::kq::x86::vnni::dot_q6_k(w, x) }
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
                let sum = unsafe {
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
                    let s4 =
                        _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
                    let s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
                    let s1 = _mm_add_epi32(s2, _mm_shuffle_epi32::<1>(s2));
                    _mm_cvtsi128_si32(s1) + code_offset::<KIND>(a)
                };
                let at = b * block;
                let half = |i: usize| f16::from_le_bytes([w[at + i], w[at + i + 1]]).to_f32();
                acc = (half(0) * a.d).mul_add(sum as f32, acc);
                if KIND == Q41 {
                    acc = half(2).mul_add(a.s, acc);
                }
            }
            acc
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn quantize_avx2(x: &[f32], out: &mut [ActBlock]) {
        let sign_mask = _mm256_set1_ps(-0.0);
        for (xs, o) in x.chunks_exact(QK).zip(out.iter_mut()) {
            // SAFETY: each chunk has exactly 32 floats.
            let v: [__m256; 4] =
                std::array::from_fn(|k| unsafe { _mm256_loadu_ps(xs.as_ptr().add(8 * k)) });
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
            let q: [__m256i; 4] = std::array::from_fn(|k| {
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{RngExt, SeedableRng, rngs::StdRng};

    fn rand_vec(rng: &mut StdRng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect()
    }

    fn rel(a: f32, b: f32) -> f32 {
        (a - b).abs() / b.abs().max(1.0)
    }

    /// Attention's weighted sum of value rows: each output its column's terms in row order,
    /// fused multiply-adds on the SIMD sets and a multiply then an add on the portable one, bit
    /// for bit over widths with and without tails (so no output depends on its neighbours).
    #[test]
    fn axpy_rows_sums_each_column_in_row_order() {
        let mut rng = StdRng::seed_from_u64(17);
        for width in [3usize, 8, 64, 75, 128, 200] {
            for count in [0usize, 1, 5, 16] {
                let rows: Vec<Vec<f32>> = (0..count).map(|_| rand_vec(&mut rng, width)).collect();
                let refs: Vec<&[f32]> = rows.iter().map(|r| r.as_slice()).collect();
                let w = rand_vec(&mut rng, count);
                let out0 = rand_vec(&mut rng, width);
                let (mut fused, mut unfused) = (out0.clone(), out0.clone());
                for (&wj, row) in w.iter().zip(&rows) {
                    for ((f, u), &v) in fused.iter_mut().zip(unfused.iter_mut()).zip(row) {
                        *f = wj.mul_add(v, *f);
                        *u += wj * v;
                    }
                }
                for k in available() {
                    let want = if k.name == PORTABLE.name {
                        &unfused
                    } else {
                        &fused
                    };
                    let mut got = out0.clone();
                    (k.axpy_rows)(&mut got, &w, &refs);
                    assert!(&got == want, "{} width {width}, {count} rows", k.name);
                }
            }
        }
    }

    /// A set's scores of a tile of queries and keys are each pair's alone, bit for bit,
    /// whatever the tile's shape (every tile and remainder the kernel takes), and within
    /// rounding of the portable set's.
    #[test]
    fn scores_are_each_pairs_alone_bit_for_bit() {
        let mut rng = StdRng::seed_from_u64(19);
        for width in [3usize, 8, 40, 64, 75, 128] {
            for (nq, nk) in [
                (1usize, 0usize),
                (1, 1),
                (1, 9),
                (1, 16),
                (2, 3),
                (2, 4),
                (3, 13),
                (5, 16),
            ] {
                let qs: Vec<Vec<f32>> = (0..nq).map(|_| rand_vec(&mut rng, width)).collect();
                let ks: Vec<Vec<f32>> = (0..nk).map(|_| rand_vec(&mut rng, width)).collect();
                let qr: Vec<&[f32]> = qs.iter().map(|r| r.as_slice()).collect();
                let kr: Vec<&[f32]> = ks.iter().map(|r| r.as_slice()).collect();
                let mut want = vec![0f32; nq * nk];
                portable::scores(&qr, &kr, &mut want);
                for k in available() {
                    let mut got = vec![f32::NAN; nq * nk];
                    (k.scores)(&qr, &kr, &mut got);
                    for (at, (&g, &w)) in got.iter().zip(&want).enumerate() {
                        let (i, j) = (at / nk, at % nk);
                        let mut alone = [f32::NAN];
                        (k.scores)(&qr[i..=i], &kr[j..=j], &mut alone);
                        assert!(
                            g.to_bits() == alone[0].to_bits(),
                            "{} width {width}, query {i} key {j} of {nq}x{nk}: {g} vs {}",
                            k.name,
                            alone[0]
                        );
                        assert!(rel(g, w) < 1e-5, "{} {g} vs portable {w}", k.name);
                    }
                }
            }
        }
    }

    #[test]
    fn simd_kernels_equal_portable() {
        for k in available() {
            check_against_portable(k);
        }
    }

    fn check_against_portable(k: &Kernels) {
        let mut rng = StdRng::seed_from_u64(7);
        for n in [32usize, 64, 96, 576, 1536] {
            let w = rand_vec(&mut rng, n);
            let x = rand_vec(&mut rng, n);
            assert!(rel((k.dot_f32)(&w, &x), portable::dot_f32(&w, &x)) < 1e-5);
            let wh: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
            assert!(rel((k.dot_f16)(&wh, &x), portable::dot_f16(&wh, &x)) < 1e-5);
            let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            assert!(rel((k.dot_bf16)(&wb, &x), portable::dot_bf16(&wb, &x)) < 1e-5);

            let mut qa = vec![ActBlock::default(); n / QK];
            let mut qb = vec![ActBlock::default(); n / QK];
            (k.quantize)(&x, &mut qa);
            portable::quantize(&x, &mut qb);
            for (a, b) in qa.iter().zip(&qb) {
                assert_eq!(a.qs, b.qs);
                assert_eq!((a.d, a.s, a.isum), (b.d, b.s, b.isum));
            }

            let q8: Vec<BlockQ8_0> = (0..n / QK)
                .map(|_| BlockQ8_0 {
                    d: f16::from_f32(rng.random_range(0.001f32..0.1)),
                    qs: std::array::from_fn(|_| rng.random_range(-128i32..=127) as i8),
                })
                .collect();
            assert!(rel((k.dot_q8_0)(&q8, &qa), portable::dot_q8_0(&q8, &qa)) < 1e-5);
            let q40: Vec<BlockQ4_0> = (0..n / QK)
                .map(|_| BlockQ4_0 {
                    d: f16::from_f32(rng.random_range(-0.1f32..0.1)),
                    qs: std::array::from_fn(|_| rng.random::<u8>()),
                })
                .collect();
            assert!(rel((k.dot_q4_0)(&q40, &qa), portable::dot_q4_0(&q40, &qa)) < 1e-5);
            let q41: Vec<BlockQ4_1> = (0..n / QK)
                .map(|_| BlockQ4_1 {
                    d: f16::from_f32(rng.random_range(0.001f32..0.1)),
                    m: f16::from_f32(rng.random_range(-0.5f32..0.5)),
                    qs: std::array::from_fn(|_| rng.random::<u8>()),
                })
                .collect();
            assert!(rel((k.dot_q4_1)(&q41, &qa), portable::dot_q4_1(&q41, &qa)) < 1e-5);
        }
    }

    /// The many-row kernels give each (row, token) exactly what the one-token kernel gives it
    /// (batched requests answer as if alone), whatever rows and tokens are computed beside it:
    /// odd and even block counts, every tile size, groups of rows full and partial.
    #[test]
    fn many_token_dots_equal_one_token_dots_bit_for_bit() {
        let mut rng = StdRng::seed_from_u64(19);
        let mut checked = 0;
        for k in available() {
            for dtype in [DType::Q8_0, DType::Q4_0, DType::Q4_1] {
                let Some(dots) = k.dots(dtype) else {
                    continue;
                };
                for (blocks, tokens, n_rows) in [
                    (1usize, 3usize, 1usize),
                    (18, 11, 17),
                    (48, 8, 16),
                    (9, 16, 3),
                ] {
                    let x = rand_vec(&mut rng, tokens * blocks * QK);
                    let mut qa = vec![ActBlock::default(); tokens * blocks];
                    (k.quantize)(&x, &mut qa);
                    let rows: Vec<Vec<u8>> = (0..n_rows)
                        .map(|_| {
                            (0..blocks)
                                .flat_map(|_| {
                                    let d = f16::from_f32(rng.random_range(0.001f32..0.1));
                                    let m = f16::from_f32(rng.random_range(-0.5f32..0.5));
                                    let q4: [u8; 16] = std::array::from_fn(|_| rng.random::<u8>());
                                    let q8: [i8; QK] = std::array::from_fn(|_| rng.random::<i8>());
                                    match dtype {
                                        DType::Q8_0 => {
                                            bytemuck::bytes_of(&BlockQ8_0 { d, qs: q8 }).to_vec()
                                        }
                                        DType::Q4_0 => {
                                            bytemuck::bytes_of(&BlockQ4_0 { d, qs: q4 }).to_vec()
                                        }
                                        _ => {
                                            bytemuck::bytes_of(&BlockQ4_1 { d, m, qs: q4 }).to_vec()
                                        }
                                    }
                                })
                                .collect()
                        })
                        .collect();
                    let refs: Vec<&[u8]> = rows.iter().map(|r| r.as_slice()).collect();
                    let x = TokenBlocks {
                        blocks: &qa,
                        per_token: blocks,
                    };
                    for t0 in [0, 1] {
                        let n = tokens - t0;
                        let mut all = vec![f32::NAN; n_rows * n];
                        dots(&refs, &x, t0, &mut all, &rows[0]);
                        for (r, row) in rows.iter().enumerate() {
                            // One row alone gives what it gives among the others.
                            let mut alone = vec![f32::NAN; n];
                            dots(&[row], &x, t0, &mut alone, &[]);
                            assert_eq!(alone[..], all[r * n..(r + 1) * n]);
                            for (j, g) in alone.iter().enumerate() {
                                let xa = &qa[(t0 + j) * blocks..(t0 + j + 1) * blocks];
                                let one = match dtype {
                                    DType::Q8_0 => (k.dot_q8_0)(bytemuck::cast_slice(row), xa),
                                    DType::Q4_0 => (k.dot_q4_0)(bytemuck::cast_slice(row), xa),
                                    _ => (k.dot_q4_1)(bytemuck::cast_slice(row), xa),
                                };
                                assert_eq!(
                                    g.to_bits(),
                                    one.to_bits(),
                                    "{} {dtype} {blocks} blocks, row {r}, token {}: {g} vs {one}",
                                    k.name,
                                    t0 + j
                                );
                                // And it is the product the portable kernel computes.
                                let reference = match dtype {
                                    DType::Q8_0 => {
                                        portable::dot_q8_0(bytemuck::cast_slice(row), xa)
                                    }
                                    DType::Q4_0 => {
                                        portable::dot_q4_0(bytemuck::cast_slice(row), xa)
                                    }
                                    _ => portable::dot_q4_1(bytemuck::cast_slice(row), xa),
                                };
                                assert!(
                                    (g - reference).abs() <= 1e-4 * reference.abs().max(1.0),
                                    "{} {dtype}: {g} vs portable {reference}",
                                    k.name
                                );
                                checked += 1;
                            }
                        }
                    }
                }
            }
        }
        println!("{checked} many-row dots checked");
    }

    /// Every set's softmax numerators are `exp` to a few ulp, each value whatever its place in
    /// the slice (vector lanes and the scalar tail agree), and their sum is theirs.
    #[test]
    fn exp_sum_is_exp_to_a_few_ulp_wherever_a_value_lies() {
        let mut rng = StdRng::seed_from_u64(23);
        let mut xs: Vec<f32> = (0..1000)
            .map(|_| rng.random_range(-100.0f32..0.0))
            .collect();
        xs.extend([
            0.0,
            -0.0,
            -1e-30,
            -87.3,
            -87.4,
            -88.0,
            -103.0,
            f32::NEG_INFINITY,
            -1e-3,
        ]);
        for k in available() {
            let mut got = xs.clone();
            let sum = (k.exp_sum)(&mut got, 0.0);
            let mut want_sum = 0f64;
            for (&x, &g) in xs.iter().zip(&got) {
                let want = (x as f64).exp();
                want_sum += g as f64;
                let tiny = want < f32::MIN_POSITIVE as f64;
                assert!(
                    (g as f64 - want).abs() <= 4.0 * f32::EPSILON as f64 * want
                        || (tiny && g as f64 <= f32::MIN_POSITIVE as f64),
                    "{}: exp({x}) = {g}, want {want}",
                    k.name
                );
                let mut one = [x];
                (k.exp_sum)(&mut one, 0.0);
                assert_eq!(one[0].to_bits(), g.to_bits(), "{}: exp({x}) alone", k.name);
            }
            assert!((sum - want_sum).abs() <= 1e-12 * want_sum, "{}", k.name);
            // Scores less their maximum: the maximum's numerator is exactly 1.
            let mut s = [3.0f32, 5.0, 1.0];
            (k.exp_sum)(&mut s, 5.0);
            assert_eq!(s[1], 1.0, "{}", k.name);
            let mut nan = [f32::NAN; 9];
            (k.exp_sum)(&mut nan, 0.0);
            assert!(
                nan.iter().all(|v| v.is_nan()),
                "{}: a NaN score stays NaN",
                k.name
            );
        }
    }

    #[test]
    fn quantized_dot_is_close_to_float_dot() {
        let mut rng = StdRng::seed_from_u64(3);
        let x = rand_vec(&mut rng, 256);
        let w = rand_vec(&mut rng, 256);
        let q8: Vec<BlockQ8_0> = w
            .chunks(QK)
            .map(|c| {
                let amax = c.iter().fold(0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                BlockQ8_0 {
                    d: f16::from_f32(d),
                    qs: std::array::from_fn(|i| (c[i] / d).round() as i8),
                }
            })
            .collect();
        let mut qa = vec![ActBlock::default(); 8];
        (best().quantize)(&x, &mut qa);
        let exact = portable::dot_f32(&w, &x);
        let approx = (best().dot_q8_0)(&q8, &qa);
        assert!(
            (exact - approx).abs() < 0.05 * exact.abs().max(1.0),
            "{exact} vs {approx}"
        );
    }
}
