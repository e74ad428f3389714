//! Per-layer activation predictors (Deja Vu's recipe): from a layer's FFN input `x` (d values),
//! a low-rank two-layer network `z = W2·relu(W1·x + b1) + b2` gives one logit per neuron; the
//! neurons whose logit is at least `cutoff` are predicted active.
//!
//! Training: class-balanced binary cross-entropy (positives weighted by negatives/positives, as
//! activity is rare), AdamW, minibatches. The last tenth of the tokens is held out: after each
//! epoch the cutoff is set to the highest logit that keeps recall ≥ 0.99 on them (a missed
//! active neuron costs accuracy; a false one only time), and training stops early once the
//! share of neurons predicted active at that recall stops falling. Training's products go
//! through `matrixmultiply`'s sgemm; a step's few tokens ([`Predictor::active`]) are two
//! matrix-vector products instead, by the CPU backend's dot kernel over rows split across
//! threads (sgemm packs every weight anew for each call and runs on one thread: ten times the
//! weights' read time for one token).

use crate::backend::cpu::sparse::per_items;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use serde::{Deserialize, Serialize};

/// Recall the cutoff is chosen for, on held-out tokens.
pub const TARGET_RECALL: f64 = 0.99;

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Predictor {
    pub d: usize,
    pub rank: usize,
    pub neurons: usize,
    /// `rank × d`, row-major. (The weights travel in the profile's binary part.)
    #[serde(skip)]
    pub w1: Vec<f32>,
    #[serde(skip)]
    pub b1: Vec<f32>,
    /// `neurons × rank`, row-major.
    #[serde(skip)]
    pub w2: Vec<f32>,
    #[serde(skip)]
    pub b2: Vec<f32>,
    pub cutoff: f32,
}

/// How a predictor did on its held-out tokens.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct PredictorQuality {
    pub recall: f64,
    pub precision: f64,
    /// Share of neurons predicted active (what the sparse FFN computes).
    pub predicted_share: f64,
    /// Share actually active.
    pub active_share: f64,
    pub epochs: usize,
}

/// `c (m×n) = a (m×k, strides) · b (k×n, strides)` (+ c if `accumulate`).
#[allow(clippy::too_many_arguments)]
fn gemm(
    m: usize,
    k: usize,
    n: usize,
    a: &[f32],
    (rsa, csa): (isize, isize),
    b: &[f32],
    (rsb, csb): (isize, isize),
    c: &mut [f32],
    accumulate: bool,
) {
    assert!(c.len() >= m * n);
    // SAFETY: the strides address within `a` (m×k) and `b` (k×n) as the callers lay them out,
    // and `c` holds m×n (asserted).
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.as_ptr(),
            rsa,
            csa,
            b.as_ptr(),
            rsb,
            csb,
            if accumulate { 1.0 } else { 0.0 },
            c.as_mut_ptr(),
            n as isize,
            1,
        )
    }
}

impl Predictor {
    fn new(d: usize, rank: usize, neurons: usize, rng: &mut StdRng) -> Self {
        let init = |n: usize, fan_in: usize, rng: &mut StdRng| -> Vec<f32> {
            let s = (6.0 / fan_in as f32).sqrt();
            (0..n).map(|_| rng.random_range(-s..s)).collect()
        };
        Predictor {
            d,
            rank,
            neurons,
            w1: init(rank * d, d, rng),
            b1: vec![0.0; rank],
            w2: init(neurons * rank, rank, rng),
            b2: vec![0.0; neurons],
            cutoff: 0.0,
        }
    }

    /// The weights in their binary order (w1, b1, w2, b2).
    pub fn weights(&self) -> [&Vec<f32>; 4] {
        [&self.w1, &self.b1, &self.w2, &self.b2]
    }

    /// The weights' lengths for this predictor's shape.
    pub fn weight_lens(&self) -> [usize; 4] {
        [
            self.rank * self.d,
            self.rank,
            self.neurons * self.rank,
            self.neurons,
        ]
    }

    /// Parameters (for the size report).
    pub fn parameters(&self) -> usize {
        // w1, b1, w2, b2 by their shapes.
        self.rank * self.d + self.rank + self.neurons * self.rank + self.neurons
    }

    /// Hidden activations (`t × rank`, after relu) and logits (`t × neurons`) of `t` inputs.
    fn forward(&self, x: &[f32], t: usize) -> (Vec<f32>, Vec<f32>) {
        let (d, r, n) = (self.d, self.rank, self.neurons);
        let mut h = vec![0f32; t * r];
        gemm(
            t,
            d,
            r,
            x,
            (d as isize, 1),
            &self.w1,
            (1, d as isize),
            &mut h,
            false,
        );
        for row in h.chunks_exact_mut(r) {
            for (v, b) in row.iter_mut().zip(&self.b1) {
                *v = (*v + b).max(0.0);
            }
        }
        let mut z = vec![0f32; t * n];
        gemm(
            t,
            r,
            n,
            &h,
            (r as isize, 1),
            &self.w2,
            (1, r as isize),
            &mut z,
            false,
        );
        for row in z.chunks_exact_mut(n) {
            for (v, b) in row.iter_mut().zip(&self.b2) {
                *v += b;
            }
        }
        (h, z)
    }

    /// Per neuron logits of `t` inputs (`t × d`).
    pub fn logits(&self, x: &[f32], t: usize) -> Vec<f32> {
        self.forward(x, t).1
    }

    /// Whether each neuron is predicted active for each of `t` inputs (`t × neurons`).
    pub fn active(&self, x: &[f32], t: usize) -> Vec<bool> {
        self.scored(x, t).0
    }

    /// The flags of [`Predictor::active`] and the logits they come from: [`Predictor::logits`]
    /// as matrix-vector products (the same sums up to rounding: the cutoff was chosen on
    /// sgemm's logits, and a neuron within rounding of it may flip).
    pub fn scored(&self, x: &[f32], t: usize) -> (Vec<bool>, Vec<f32>) {
        let (d, r, n) = (self.d, self.rank, self.neurons);
        let t = t.min(x.len() / d.max(1));
        let mut h = rows_dot(&self.w1, &self.b1, d, &x[..t * d], t);
        h.iter_mut().for_each(|v| *v = v.max(0.0));
        let z = rows_dot(&self.w2, &self.b2, r, &h, t);
        debug_assert_eq!(z.len(), t * n);
        (z.iter().map(|&v| v >= self.cutoff).collect(), z)
    }
}

/// `out[i·rows + j] = w[j]·x_i + b[j]` (`t × rows`) for the rows of `w` (`rows × cols`,
/// row-major, `rows = b.len()`) and the `t` inputs of `x` (`t × cols`): each row read once for
/// all inputs, by the CPU's dot kernel, rows split over rayon tasks as the sparse operators
/// split their neurons.
fn rows_dot(w: &[f32], b: &[f32], cols: usize, x: &[f32], t: usize) -> Vec<f32> {
    let rows = b.len();
    let dot = crate::backend::cpu::kernels::best().dot_f32;
    let mut out = vec![0f32; t * rows];
    per_items(rows, t, &mut out, |js, vals| {
        for (j, vj) in js.zip(vals.chunks_mut(t.max(1))) {
            let wj = &w[j * cols..(j + 1) * cols];
            for (i, v) in vj.iter_mut().enumerate() {
                *v = dot(wj, &x[i * cols..(i + 1) * cols]) + b[j];
            }
        }
    });
    out
}

/// The quality of `logits` against `truth` at `cutoff`.
fn quality(logits: &[f32], truth: &[bool], cutoff: f32) -> PredictorQuality {
    let (mut tp, mut pred, mut act) = (0u64, 0u64, 0u64);
    for (&z, &y) in logits.iter().zip(truth) {
        let p = z >= cutoff;
        tp += (p && y) as u64;
        pred += p as u64;
        act += y as u64;
    }
    let n = logits.len().max(1) as f64;
    PredictorQuality {
        recall: if act == 0 {
            1.0
        } else {
            tp as f64 / act as f64
        },
        precision: if pred == 0 {
            1.0
        } else {
            tp as f64 / pred as f64
        },
        predicted_share: pred as f64 / n,
        active_share: act as f64 / n,
        epochs: 0,
    }
}

/// The highest cutoff keeping recall ≥ [`TARGET_RECALL`] over the positives' logits.
fn cutoff_for_recall(logits: &[f32], truth: &[bool]) -> f32 {
    let mut pos: Vec<f32> = logits
        .iter()
        .zip(truth)
        .filter(|(_, y)| **y)
        .map(|(z, _)| *z)
        .collect();
    if pos.is_empty() {
        return f32::INFINITY;
    }
    pos.sort_by(|a, b| a.total_cmp(b));
    let miss = ((1.0 - TARGET_RECALL) * pos.len() as f64).floor() as usize;
    pos[miss.min(pos.len() - 1)]
}

/// Training settings.
#[derive(Clone, Copy, Debug)]
pub struct TrainOptions {
    pub rank: usize,
    pub max_epochs: usize,
    pub batch: usize,
    pub lr: f32,
    pub weight_decay: f32,
    pub seed: u64,
}

impl Default for TrainOptions {
    fn default() -> Self {
        TrainOptions {
            rank: 128,
            max_epochs: 30,
            batch: 128,
            lr: 2e-3,
            weight_decay: 0.01,
            seed: 0,
        }
    }
}

/// AdamW state for one parameter vector.
struct Adam {
    m: Vec<f32>,
    v: Vec<f32>,
}

impl Adam {
    fn new(n: usize) -> Self {
        Adam {
            m: vec![0.0; n],
            v: vec![0.0; n],
        }
    }

    fn step(&mut self, w: &mut [f32], g: &[f32], lr: f32, wd: f32, t: i32, decay: bool) {
        let (b1, b2, eps) = (0.9f32, 0.999f32, 1e-8f32);
        let (c1, c2) = (1.0 - b1.powi(t), 1.0 - b2.powi(t));
        for i in 0..w.len() {
            self.m[i] = b1 * self.m[i] + (1.0 - b1) * g[i];
            self.v[i] = b2 * self.v[i] + (1.0 - b2) * g[i] * g[i];
            let upd = (self.m[i] / c1) / ((self.v[i] / c2).sqrt() + eps);
            w[i] -= lr * (upd + if decay { wd * w[i] } else { 0.0 });
        }
    }
}

/// Train a predictor of `truth` (`tokens × neurons`, true = active) from `x` (`tokens × d`).
/// Needs at least 20 tokens (a tenth is held out).
pub fn train(
    x: &[f32],
    truth: &[bool],
    d: usize,
    neurons: usize,
    opts: TrainOptions,
) -> (Predictor, PredictorQuality) {
    let tokens = x.len() / d.max(1);
    assert!(truth.len() == tokens * neurons && tokens >= 20);
    let held = (tokens / 10).max(2);
    let train_tokens = tokens - held;
    let (xt, yt) = (&x[..train_tokens * d], &truth[..train_tokens * neurons]);
    let (xh, yh) = (&x[train_tokens * d..], &truth[train_tokens * neurons..]);
    let pos = yt.iter().filter(|&&y| y).count().max(1) as f32;
    let pos_weight = (yt.len() as f32 - pos) / pos;
    let mut rng = StdRng::seed_from_u64(opts.seed);
    let rank = opts.rank.min(d).max(1);
    let mut p = Predictor::new(d, rank, neurons, &mut rng);
    let (mut a1, mut ab1, mut a2, mut ab2) = (
        Adam::new(p.w1.len()),
        Adam::new(rank),
        Adam::new(p.w2.len()),
        Adam::new(neurons),
    );
    let mut order: Vec<usize> = (0..train_tokens).collect();
    let (mut best, mut best_share, mut stale, mut step) = (p.clone(), f64::INFINITY, 0, 0);
    let mut best_q = PredictorQuality::default();
    for epoch in 1..=opts.max_epochs {
        for i in (1..order.len()).rev() {
            order.swap(i, rng.random_range(0..=i));
        }
        for batch in order.chunks(opts.batch) {
            let b = batch.len();
            let mut xb = Vec::with_capacity(b * d);
            for &t in batch {
                xb.extend_from_slice(&xt[t * d..(t + 1) * d]);
            }
            let (h, mut z) = p.forward(&xb, b);
            // dz = w·(σ(z) − y) / b, with w = pos_weight on positives.
            for (bi, &t) in batch.iter().enumerate() {
                let y = &yt[t * neurons..(t + 1) * neurons];
                for (zv, &yv) in z[bi * neurons..(bi + 1) * neurons].iter_mut().zip(y) {
                    let s = 1.0 / (1.0 + (-*zv).exp());
                    *zv = if yv { pos_weight * (s - 1.0) } else { s } / b as f32;
                }
            }
            let dz = z;
            let mut gw2 = vec![0f32; neurons * rank];
            gemm(
                neurons,
                b,
                rank,
                &dz,
                (1, neurons as isize),
                &h,
                (rank as isize, 1),
                &mut gw2,
                false,
            );
            let mut gb2 = vec![0f32; neurons];
            for row in dz.chunks_exact(neurons) {
                gb2.iter_mut().zip(row).for_each(|(g, v)| *g += v);
            }
            let mut dh = vec![0f32; b * rank];
            gemm(
                b,
                neurons,
                rank,
                &dz,
                (neurons as isize, 1),
                &p.w2,
                (rank as isize, 1),
                &mut dh,
                false,
            );
            dh.iter_mut().zip(&h).for_each(|(g, &hv)| {
                if hv <= 0.0 {
                    *g = 0.0
                }
            });
            let mut gw1 = vec![0f32; rank * d];
            gemm(
                rank,
                b,
                d,
                &dh,
                (1, rank as isize),
                &xb,
                (d as isize, 1),
                &mut gw1,
                false,
            );
            let mut gb1 = vec![0f32; rank];
            for row in dh.chunks_exact(rank) {
                gb1.iter_mut().zip(row).for_each(|(g, v)| *g += v);
            }
            step += 1;
            let (lr, wd) = (opts.lr, opts.weight_decay);
            a1.step(&mut p.w1, &gw1, lr, wd, step, true);
            ab1.step(&mut p.b1, &gb1, lr, wd, step, false);
            a2.step(&mut p.w2, &gw2, lr, wd, step, true);
            ab2.step(&mut p.b2, &gb2, lr, wd, step, false);
        }
        let zh = p.logits(xh, held);
        let cut = cutoff_for_recall(&zh, yh);
        let q = quality(&zh, yh, cut);
        if q.predicted_share < best_share - 1e-4 {
            best_share = q.predicted_share;
            best = p.clone();
            best.cutoff = cut;
            best_q = PredictorQuality { epochs: epoch, ..q };
            stale = 0;
        } else {
            stale += 1;
            if stale >= 3 {
                break;
            }
        }
    }
    (best, best_q)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Neurons whose activity is a linear function of the input's first components: the
    /// predictor learns them, reaches the recall it is calibrated for on held-out tokens, and
    /// predicts far fewer neurons than all.
    #[test]
    fn learns_a_low_rank_activity_pattern() {
        let (d, neurons, tokens) = (32, 64, 1200);
        let mut rng = StdRng::seed_from_u64(3);
        let dirs: Vec<f32> = (0..neurons * 4)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let x: Vec<f32> = (0..tokens * d)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let mut truth = vec![false; tokens * neurons];
        for t in 0..tokens {
            for n in 0..neurons {
                let s: f32 = (0..4).map(|k| dirs[n * 4 + k] * x[t * d + k]).sum();
                truth[t * neurons + n] = s > 0.8;
            }
        }
        let (p, q) = train(
            &x,
            &truth,
            d,
            neurons,
            TrainOptions {
                rank: 16,
                batch: 32,
                max_epochs: 60,
                ..Default::default()
            },
        );
        assert!(q.recall >= TARGET_RECALL, "{q:?}");
        assert!(q.active_share < 0.4 && q.predicted_share < 0.6, "{q:?}");
        assert!(q.precision > 0.5, "{q:?}");
        assert_eq!(p.active(&x[..d], 1).len(), neurons);
        assert!(p.parameters() < d * neurons);
    }

    #[test]
    fn a_steps_logits_are_the_trained_products_up_to_rounding() {
        // Wider than a task of rows, and a rank that is no multiple of the kernels' step.
        let (d, rank, neurons) = (96, 19, 150);
        let mut rng = StdRng::seed_from_u64(5);
        let mut p = Predictor::new(d, rank, neurons, &mut rng);
        p.b1.iter_mut()
            .for_each(|b| *b = rng.random_range(-0.5..0.5));
        p.b2.iter_mut()
            .for_each(|b| *b = rng.random_range(-0.5..0.5));
        p.cutoff = 0.1;
        let x: Vec<f32> = (0..3 * d).map(|_| rng.random_range(-1.0..1.0)).collect();
        for t in [1, 3] {
            let want = p.logits(&x[..t * d], t);
            let (keep, got) = p.scored(&x[..t * d], t);
            assert_eq!(got.len(), t * neurons);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (g - w).abs() <= 1e-4 * (1.0 + w.abs()),
                    "t {t} logit {i}: {g} vs {w}"
                );
            }
            // Token i of a step is what it is alone.
            for i in 0..t {
                let (_, alone) = p.scored(&x[i * d..(i + 1) * d], 1);
                assert_eq!(
                    alone,
                    got[i * neurons..(i + 1) * neurons],
                    "t {t} token {i}"
                );
            }
            let flags: Vec<bool> = got.iter().map(|&v| v >= p.cutoff).collect();
            assert_eq!(keep, flags);
            assert!(keep.iter().any(|&k| k) && keep.iter().any(|&k| !k));
        }
    }
}
