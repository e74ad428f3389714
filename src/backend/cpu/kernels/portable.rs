//! The portable kernel set: the reference every other set is checked against, and the
//! association (lane sums, pairwise adds, f16 rounding) the SIMD sets reproduce.

use half::{bf16, f16};

use super::activations::ActBlock;
use super::kq::{self, quantize_k};
use super::set::Kernels;
use crate::tensor::{BlockQ4_0, BlockQ4_1, BlockQ8_0, QK};

pub const PORTABLE: Kernels = Kernels {
    name: "portable",
    dot_f32,
    axpy_rows: axpy_rows_of::<f32>,
    axpy_rows_f16: axpy_rows_of::<f16>,
    scores: scores_of::<f32>,
    scores_f16: scores_of::<f16>,
    exp_sum,
    dot_f16,
    dot_bf16,
    dot_q8_0,
    dot_q4_0,
    dot_q4_1,
    dot_q5_0: kq::portable::dot_q5_0,
    dot_q5_1: kq::portable::dot_q5_1,
    dot_q2_k: kq::portable::dot_q2_k,
    dot_q3_k: kq::portable::dot_q3_k,
    dot_q4_k: kq::portable::dot_q4_k,
    dot_q5_k: kq::portable::dot_q5_k,
    dot_q6_k: kq::portable::dot_q6_k,
    quantize,
    quantize_k,
    dots_q8_0: None,
    dots_q4_0: None,
    dots_q4_1: None,
    tiled_q8_0: None,
    tiled_q4_0: None,
    tiled_q4_1: None,
};

/// Eight lanes added as attention's scores add them: ((0+1)+(2+3))+((4+5)+(6+7)).
pub(super) fn pairwise(l: [f32; 8]) -> f32 {
    ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
}

/// A value of a KV cache's rows as attention reads them: f32, or f16 widened to f32 as it is
/// loaded (exactly), so an f16 row read in place gives the products its decoded copy gives.
pub trait KvValue: Copy + Into<f32> + 'static {
    /// Whether the value is f16 (the SIMD sets' loads convert it).
    const HALF: bool;
}

impl KvValue for f32 {
    const HALF: bool = false;
}

impl KvValue for f16 {
    const HALF: bool = true;
}

/// A score's lanes' `sum` and the products of `q` and `k` from `whole` on, in order.
pub(super) fn score_tail<K: KvValue>(mut sum: f32, q: &[f32], k: &[K], whole: usize) -> f32 {
    for t in whole..q.len().min(k.len()) {
        sum += q[t] * k[t].into();
    }
    sum
}

pub(super) fn round_f16(v: f32) -> f32 {
    f16::from_f32(v).to_f32()
}

pub fn dot_f32(w: &[f32], x: &[f32]) -> f32 {
    dot_as_f32(w, x, |v| v)
}

pub fn scores_of<K: KvValue>(qs: &[&[f32]], keys: &[&[K]], out: &mut [f32]) {
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
fn score<K: KvValue>(q: &[f32], k: &[K]) -> f32 {
    let n = q.len().min(k.len());
    let whole = n / 8 * 8;
    let mut lanes = [0f32; 8];
    for (qc, kc) in q[..whole].chunks_exact(8).zip(k[..whole].chunks_exact(8)) {
        for l in 0..8 {
            lanes[l] += qc[l] * kc[l].into();
        }
    }
    score_tail(pairwise(lanes), q, k, whole)
}

pub fn axpy_rows_of<K: KvValue>(out: &mut [f32], w: &[f32], rows: &[&[K]]) {
    for (&w, row) in w.iter().zip(rows) {
        out.iter_mut()
            .zip(*row)
            .for_each(|(o, &v)| *o += w * v.into());
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
