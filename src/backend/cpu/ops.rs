//! Scalar-per-row ops of the CPU backend: norms, RoPE rotation, activations, one head's attention.
//! Reductions accumulate in f64 where a long sum would otherwise drift from the references.

use super::CpuKv;
use super::kernels::Kernels;
use crate::backend::{Act, AttnShape, RopePairs};

/// Rows of a KV cache one head's slice at a time, as f32 (borrowed, or decoded into `tmp`).
pub trait KvRows: Sync {
    fn slice<'a>(&'a self, j: usize, col: usize, tmp: &'a mut [f32]) -> &'a [f32];
    /// All rows as f32 values and the distance between rows, where they are stored so (an
    /// f32 cache, not paged): attention then indexes them directly.
    fn f32_rows(&self) -> Option<(&[f32], usize)> {
        None
    }
}

impl KvRows for CpuKv {
    fn slice<'a>(&'a self, j: usize, col: usize, tmp: &'a mut [f32]) -> &'a [f32] {
        CpuKv::slice(self, j, col, tmp)
    }
    fn f32_rows(&self) -> Option<(&[f32], usize)> {
        self.f32_values().map(|v| (v, self.cols))
    }
}

/// Rows of attention's blocks of positions.
const ROWS: usize = 16;

/// Rows `js` (at most [`ROWS`]) of a cache, their values from `col` on, each `block.len() /
/// ROWS` long (decoded into `block` where the cache is not f32).
fn kv_block<'a>(
    direct: Option<(&'a [f32], usize)>,
    cache: &'a impl KvRows,
    js: std::ops::Range<usize>,
    col: usize,
    block: &'a mut [f32],
) -> [&'a [f32]; ROWS] {
    let mut rows: [&[f32]; ROWS] = [&[]; ROWS];
    let hd = block.len() / ROWS;
    for ((r, j), tmp) in rows.iter_mut().zip(js).zip(block.chunks_exact_mut(hd)) {
        *r = kv_row(direct, cache, j, col, tmp);
    }
    rows
}

/// Row `j`'s values `col..col + tmp.len()`: straight from `direct` (f32 rows, their stride)
/// where there is one, else through the cache's decoder.
#[inline]
fn kv_row<'a>(
    direct: Option<(&'a [f32], usize)>,
    cache: &'a impl KvRows,
    j: usize,
    col: usize,
    tmp: &'a mut [f32],
) -> &'a [f32] {
    match direct {
        Some((v, stride)) => &v[j * stride + col..j * stride + col + tmp.len()],
        None => cache.slice(j, col, tmp),
    }
}

pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ss: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    let scale = 1.0 / ((ss / x.len() as f64) as f32 + eps).sqrt();
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = v * scale * g;
    }
}

pub fn layer_norm(x: &[f32], w: &[f32], b: &[f32], eps: f32, out: &mut [f32]) {
    let n = x.len() as f64;
    let mean = x.iter().map(|&v| v as f64).sum::<f64>() / n;
    let var = x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
    let inv = 1.0 / (var + eps as f64).sqrt();
    for (((o, &v), &g), &bb) in out.iter_mut().zip(x).zip(w).zip(b) {
        *o = ((v as f64 - mean) * inv) as f32 * g + bb;
    }
}

/// Rotate one head in place by the per-pair (cos, sin).
pub fn rotate(head: &mut [f32], cos_sin: &[(f32, f32)], pairs: RopePairs) {
    let half = cos_sin.len();
    for (i, &(c, s)) in cos_sin.iter().enumerate() {
        let (a, b) = match pairs {
            RopePairs::Adjacent => (2 * i, 2 * i + 1),
            RopePairs::Halves => (i, i + half),
        };
        let (x0, x1) = (head[a], head[b]);
        head[a] = x0 * c - x1 * s;
        head[b] = x0 * s + x1 * c;
    }
}

pub fn activation(act: Act) -> fn(f32) -> f32 {
    match act {
        Act::Silu => |x| x / (1.0 + (-x).exp()),
        Act::Relu => |x| x.max(0.0),
        Act::Gelu => |x| 0.5 * x * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2)),
        Act::GeluTanh => |x| {
            const C: f32 = 0.797_884_6; // sqrt(2/pi)
            0.5 * x * (1.0 + (C * (x + 0.044715 * x * x * x)).tanh())
        },
    }
}

/// Positions of a chunk: a head's attention is taken over chunks of this many positions (each
/// chunk's maximum score, sum of exponentials and unnormalised weighted sum of values), then
/// the chunks merged in order. The arithmetic is the same whether one task takes a row's chunks
/// or several tasks share them, so a decoded token alone can spread its long context over the
/// threads and still get what it gets beside others.
pub const CHUNK: usize = 256;

/// Causal attention of the rows of `q` (`n_heads · head_dim` each) into the same rows of
/// `out`: `caches(t)` gives row `t`'s key and value caches and how many of their positions it
/// attends (`None`: the row is left alone); over the current rayon pool where `parallel`. A task
/// takes the query heads sharing a KV head (each key and value row read once for them) where
/// there are enough such tasks for the threads, else one head; with few rows over long
/// contexts, a row's chunks of positions are shared out too. A head's arithmetic is the same
/// every way, so a row's result depends on nothing but its own query and caches.
pub fn attend_each<'c, R: KvRows + 'c>(
    k: &Kernels,
    q: &[f32],
    caches: impl Fn(usize) -> Option<(&'c R, &'c R, usize)> + Sync,
    s: AttnShape,
    out: &mut [f32],
    parallel: bool,
) {
    use rayon::prelude::*;
    let hd = s.head_dim;
    let q_dim = s.n_heads * hd;
    let n = q.len() / q_dim.max(1);
    let group = (s.n_heads / s.n_kv_heads.max(1)).max(1);
    let threads = if parallel {
        rayon::current_num_threads()
    } else {
        1
    };
    let chunks: Vec<usize> = (0..n)
        .map(|t| caches(t).map_or(0, |(.., len)| len.div_ceil(CHUNK)))
        .collect();
    let grouped = n * s.n_kv_heads;
    let split = parallel && grouped < 4 * threads && chunks.iter().sum::<usize>() > n;
    let per_task = if grouped >= 4 * threads || split {
        group
    } else {
        1
    };
    let tasks_per_row = s.n_heads / per_task;
    // Head set `idx` (row t's heads h0 .. h0 + per_task): its queries, caches, KV columns and
    // length.
    let head_set = |idx: usize| {
        let (t, h0) = (idx / tasks_per_row, (idx % tasks_per_row) * per_task);
        caches(t).map(|(kc, vc, len)| {
            let qh = &q[t * q_dim + h0 * hd..][..per_task * hd];
            (qh, kc, vc, (h0 / group) * hd, len)
        })
    };
    if !split {
        // Each task a row's head set, its chunks one after another.
        let task = |(idx, o): (usize, &mut [f32])| {
            if let Some((qh, kc, vc, col, len)) = head_set(idx) {
                attend(k, qh, kc, vc, col, hd, len, s.scale, o);
            }
        };
        if parallel {
            out.par_chunks_mut(per_task * hd).enumerate().for_each(task);
        } else {
            out.chunks_mut(per_task * hd).enumerate().for_each(task);
        }
        return;
    }
    // Few rows over long contexts: every chunk of every head set its own task, then each head
    // set's chunks merged.
    let sets = n * tasks_per_row;
    let mut first = Vec::with_capacity(sets + 1);
    let mut items = Vec::new();
    for idx in 0..sets {
        first.push(items.len());
        items.extend((0..chunks[idx / tasks_per_row]).map(|c| (idx, c)));
    }
    first.push(items.len());
    let mut parts = vec![ChunkPart::default(); items.len() * per_task];
    let mut sums = vec![0f32; items.len() * per_task * hd];
    parts
        .par_chunks_mut(per_task)
        .zip(sums.par_chunks_mut(per_task * hd))
        .zip(items.par_iter())
        .for_each(|((part, acc), &(idx, c))| {
            if let Some((qh, kc, vc, col, len)) = head_set(idx) {
                let js = c * CHUNK..((c + 1) * CHUNK).min(len);
                let mut scratch = ChunkScratch::default();
                attend_chunk(
                    k,
                    qh,
                    (kc, vc),
                    col,
                    hd,
                    js,
                    s.scale,
                    part,
                    acc,
                    &mut scratch,
                );
            }
        });
    out.par_chunks_mut(per_task * hd)
        .enumerate()
        .for_each(|(idx, o)| {
            let (c0, c1) = (first[idx], first[idx + 1]);
            if c1 > c0 {
                merge_chunks(
                    &parts[c0 * per_task..c1 * per_task],
                    &sums[c0 * per_task * hd..c1 * per_task * hd],
                    o,
                );
            }
        });
}

/// One head's partial attention over a chunk of positions.
#[derive(Clone, Copy, Default)]
pub struct ChunkPart {
    /// The chunk's maximum score.
    max: f32,
    /// Σ exp(score − max) over the chunk.
    sum: f64,
}

/// Buffers a chunk's attention works in, kept across the chunks of a task.
#[derive(Default)]
struct ChunkScratch {
    /// Rows of f16/Q8_0 caches decoded to f32.
    block: Vec<f32>,
    /// Each head's scores over the chunk.
    scores: Vec<f32>,
}

/// The query heads `q` (`group · hd` values: the heads sharing one KV head) against the first
/// `len` cached positions, into `out` (as many values); `col` is where this KV head's columns
/// start in a cache row. Each key and value row is read once for the whole group (grouped-query
/// attention shares them); every head's arithmetic is what it would be alone.
#[allow(clippy::too_many_arguments)]
pub fn attend(
    k: &Kernels,
    q: &[f32],
    k_cache: &impl KvRows,
    v_cache: &impl KvRows,
    col: usize,
    hd: usize,
    len: usize,
    scale: f32,
    out: &mut [f32],
) {
    let group = q.len() / hd;
    let chunks = len.div_ceil(CHUNK);
    let mut parts = vec![ChunkPart::default(); chunks * group];
    let mut sums = vec![0f32; chunks * group * hd];
    let mut scratch = ChunkScratch::default();
    for (c, (part, acc)) in parts
        .chunks_mut(group)
        .zip(sums.chunks_mut(group * hd))
        .enumerate()
    {
        let js = c * CHUNK..((c + 1) * CHUNK).min(len);
        let caches = (k_cache, v_cache);
        attend_chunk(k, q, caches, col, hd, js, scale, part, acc, &mut scratch);
    }
    merge_chunks(&parts, &sums, out);
}

/// Heads `q` (as in [`attend`]) over positions `js` of the (key, value) caches: each head's
/// [`ChunkPart`] into `part` and its sum of value rows weighted by exp(score − max) into `acc`
/// (`hd` values a head).
#[allow(clippy::too_many_arguments)]
fn attend_chunk<K: KvRows, V: KvRows>(
    k: &Kernels,
    q: &[f32],
    (k_cache, v_cache): (&K, &V),
    col: usize,
    hd: usize,
    js: std::ops::Range<usize>,
    scale: f32,
    part: &mut [ChunkPart],
    acc: &mut [f32],
    scratch: &mut ChunkScratch,
) {
    let len = js.len();
    // Head g's scores at g·len. Key rows a block at a time, each block scored for every head.
    scratch.block.resize(ROWS * hd, 0.0);
    scratch.scores.resize(part.len() * len, 0.0);
    let (block, scores) = (&mut scratch.block, &mut scratch.scores);
    let (keys, values) = (k_cache.f32_rows(), v_cache.f32_rows());
    for j0 in (0..len).step_by(ROWS) {
        let j1 = (j0 + ROWS).min(len);
        let rows = kv_block(keys, k_cache, js.start + j0..js.start + j1, col, block);
        let rows = &rows[..j1 - j0];
        for (g, qh) in q.chunks_exact(hd).enumerate() {
            let s = &mut scores[g * len + j0..g * len + j1];
            (k.dot_rows)(qh, rows, s);
            s.iter_mut().for_each(|v| *v *= scale);
        }
    }
    for (p, s) in part.iter_mut().zip(scores.chunks_exact_mut(len.max(1))) {
        let max = s.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        *p = ChunkPart {
            max,
            sum: (k.exp_sum)(s, max),
        };
    }
    acc.fill(0.0);
    // Value rows a block at a time, each head's sum held in registers across the block.
    for j0 in (0..len).step_by(ROWS) {
        let j1 = (j0 + ROWS).min(len);
        let rows = kv_block(values, v_cache, js.start + j0..js.start + j1, col, block);
        let rows = &rows[..j1 - j0];
        for (g, o) in acc.chunks_exact_mut(hd).enumerate() {
            (k.axpy_rows)(o, &scores[g * len + j0..g * len + j1], rows);
        }
    }
}

/// The chunks' parts (chunk by chunk, a part per head) and weighted sums (`hd` values per head)
/// merged into each head's attention output (`out`, heads × `hd`): weights rescaled to the
/// largest maximum, chunks added in order, the total divided out last.
fn merge_chunks(parts: &[ChunkPart], sums: &[f32], out: &mut [f32]) {
    out.fill(0.0);
    if parts.is_empty() {
        return;
    }
    let hd = sums.len() / parts.len();
    let heads = out.len() / hd.max(1);
    for (g, o) in out.chunks_exact_mut(hd).enumerate() {
        let head = parts.iter().skip(g).step_by(heads);
        let max = head.clone().fold(f32::NEG_INFINITY, |m, p| m.max(p.max));
        let mut den = 0f64;
        for (c, p) in head.enumerate() {
            let a = (p.max - max).exp();
            den += a as f64 * p.sum;
            let acc = &sums[(c * heads + g) * hd..][..hd];
            o.iter_mut().zip(acc).for_each(|(o, &v)| *o += a * v);
        }
        let inv = (1.0 / den) as f32;
        o.iter_mut().for_each(|v| *v *= inv);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_unit_scale() {
        let mut out = [0f32; 4];
        rms_norm(&[2.0, -2.0, 2.0, -2.0], &[1.0; 4], 0.0, &mut out);
        assert_eq!(out, [1.0, -1.0, 1.0, -1.0]);
    }

    #[test]
    fn rotation_by_quarter_turn() {
        let mut h = [1.0f32, 0.0, 0.0, 1.0];
        let cs = [(0.0f32, 1.0f32), (0.0, 1.0)];
        rotate(&mut h, &cs, RopePairs::Adjacent);
        assert_eq!(h, [0.0, 1.0, -1.0, 0.0]);
        let mut h = [1.0f32, 0.0, 0.0, 1.0];
        rotate(&mut h, &cs, RopePairs::Halves);
        assert_eq!(h, [0.0, -1.0, 1.0, 0.0]);
    }

    #[test]
    fn attention_over_one_position_returns_its_value() {
        let mut k = CpuKv::new(2, 2, crate::backend::KvType::F32).unwrap();
        k.write(0, &[1.0, 0.0, 9.0, 9.0]).unwrap();
        let mut v = CpuKv::new(2, 2, crate::backend::KvType::F32).unwrap();
        v.write(0, &[3.0, 4.0, 9.0, 9.0]).unwrap();
        let mut out = [0f32; 2];
        attend(
            super::super::kernels::best(),
            &[1.0, 1.0],
            &k,
            &v,
            0,
            2,
            1,
            1.0,
            &mut out,
        );
        assert_eq!(out, [3.0, 4.0]);
    }

    /// The query heads sharing a KV head, attended together, get what each gets alone, bit for
    /// bit (f32 and f16 caches, lengths across the value-row blocks).
    #[test]
    fn grouped_heads_equal_each_head_alone() {
        use rand::{RngExt, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let (hd, kv_heads, group) = (64, 2, 3);
        let cols = kv_heads * hd;
        for ty in [crate::backend::KvType::F32, crate::backend::KvType::F16] {
            for len in [1usize, 16, 37] {
                let mut rand = |n: usize| -> Vec<f32> {
                    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
                };
                let (kr, vr, q) = (rand(len * cols), rand(len * cols), rand(group * hd));
                let mut k = CpuKv::new(len, cols, ty).unwrap();
                let mut v = CpuKv::new(len, cols, ty).unwrap();
                k.write(0, &kr).unwrap();
                v.write(0, &vr).unwrap();
                let kernels = super::super::kernels::best();
                let mut together = vec![0f32; group * hd];
                attend(kernels, &q, &k, &v, hd, hd, len, 0.125, &mut together);
                for g in 0..group {
                    let mut alone = vec![0f32; hd];
                    let qh = &q[g * hd..(g + 1) * hd];
                    attend(kernels, qh, &k, &v, hd, hd, len, 0.125, &mut alone);
                    assert!(
                        alone == together[g * hd..(g + 1) * hd],
                        "{ty:?} len {len}: head {g}"
                    );
                }
            }
        }
    }

    /// Attention over long contexts in chunks: a row alone (its chunks shared out over the
    /// threads), the same row among many (its chunks in one task) and the row computed serially
    /// give the same bits, and they are softmax attention computed in f64 to 1e-5.
    #[test]
    fn chunked_attention_is_the_same_however_the_work_is_shared() {
        use rand::{RngExt, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let s = AttnShape {
            n_heads: 6,
            n_kv_heads: 2,
            head_dim: 32,
            scale: 0.3,
        };
        let (hd, cols, q_dim) = (32, 64, 192);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        for ty in [crate::backend::KvType::F32, crate::backend::KvType::F16] {
            for len in [1usize, CHUNK, CHUNK + 1, 3 * CHUNK + 77] {
                let mut rand = |n: usize| -> Vec<f32> {
                    (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect()
                };
                let (kr, vr) = (rand(len * cols), rand(len * cols));
                let mut k = CpuKv::new(len, cols, ty).unwrap();
                let mut v = CpuKv::new(len, cols, ty).unwrap();
                k.write(0, &kr).unwrap();
                v.write(0, &vr).unwrap();
                // Row 0 attends all `len` positions, the others fewer.
                let rows = 12;
                let q = rand(rows * q_dim);
                let kernels = super::super::kernels::best();
                let lens = |t: usize| len.saturating_sub(t * 37).max(1);
                let caches = |t: usize| Some((&k, &v, lens(t)));
                let mut alone = vec![0f32; q_dim];
                pool.install(|| attend_each(kernels, &q[..q_dim], caches, s, &mut alone, true));
                let mut serial = vec![0f32; q_dim];
                attend_each(kernels, &q[..q_dim], caches, s, &mut serial, false);
                let mut many = vec![0f32; rows * q_dim];
                pool.install(|| attend_each(kernels, &q, caches, s, &mut many, true));
                assert_eq!(alone, serial, "{ty:?} len {len}");
                assert_eq!(alone[..], many[..q_dim], "{ty:?} len {len}");
                // Against softmax attention in f64 over the cache's own values.
                let (mut kt, mut vt) = (vec![0f32; hd], vec![0f32; hd]);
                for h in 0..s.n_heads {
                    let col = (h / 3) * hd;
                    let qh = &q[h * hd..(h + 1) * hd];
                    let sc: Vec<f64> = (0..len)
                        .map(|j| {
                            let kj = k.slice(j, col, &mut kt);
                            qh.iter()
                                .zip(kj)
                                .map(|(a, b)| *a as f64 * *b as f64)
                                .sum::<f64>()
                                * s.scale as f64
                        })
                        .collect();
                    let m = sc.iter().cloned().fold(f64::MIN, f64::max);
                    let den: f64 = sc.iter().map(|x| (x - m).exp()).sum();
                    for i in 0..hd {
                        let want: f64 = (0..len)
                            .map(|j| (sc[j] - m).exp() / den * v.slice(j, col, &mut vt)[i] as f64)
                            .sum();
                        let got = alone[h * hd + i] as f64;
                        assert!(
                            (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                            "{ty:?} len {len} head {h}[{i}]: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn gelu_matches_known_values() {
        let g = activation(Act::Gelu);
        assert!((g(1.0) - 0.841_344_7).abs() < 1e-6);
        let t = activation(Act::GeluTanh);
        assert!((t(1.0) - 0.841_192).abs() < 1e-5);
    }
}
