//! The down side over bundles: the listed neurons' down columns weighted by their hidden
//! activations, added into the output ([`sparse_down`]) in one order ([`DOWN_BLOCK`]), split
//! over threads one of two ways ([`DownSplit`]).

use std::ops::Range;

use rayon::prelude::*;

use super::bundle::{Bundles, err};
use super::items::in_fours;
use super::vector::{axpy4, f16_fast, ops};
use crate::backend::cpu::kernels::Kernels;
use crate::backend::{BundleShape, Result};
use crate::store::GROUP_ROWS;
use crate::store::quant::INT4_GROUP;

/// How [`sparse_down_split`] spreads its work over threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DownSplit {
    /// Each task owns a range of output columns and reads that range of every listed column:
    /// no reduction, the task's outputs stay in L1.
    Output,
    /// Each [`DOWN_BLOCK`] is a task summing its listed neurons into an `n × d` sum of its own;
    /// the sums are added at the end in block order.
    Partials,
}

/// Output columns per task at least, so each task still reads runs long enough for the
/// prefetchers.
const MIN_COLS_PER_TASK: usize = 256;

/// Tasks' columns start at multiples of this: the INT4 group, and the f16/f32 kernels' 32-wide
/// steps (so no task ends in a column tail they would sum another way). No coarser, so the
/// threads share the columns evenly: at 64, SmolLM2's 576 split 320/256 over two threads.
const COLS_ALIGN: usize = INT4_GROUP;

/// Neuron ids per block of the one order every CPU and budgeted-device FFN sums its down
/// products in: a token's output is what `out` held plus, block by block in id order, the sum
/// of the block's terms in list order from zero. Blocks of ids (not list positions, nor a share
/// of the threads), so a token's result does not depend on what the other tokens list (their
/// neurons weigh zero for it), on which slots hold the neurons, or on the pool; and the blocks
/// can be summed apart (the one-walk cold pass, [`super::sparse_ffn`], gives each thread its
/// own). A list cut into calls on block boundaries sums what it sums whole: the store's
/// resident prefixes and the split's CPU rows are whole checksum groups, so this is the group.
pub const DOWN_BLOCK: u32 = GROUP_ROWS as u32;

/// The runs of list positions `0..m` whose neurons (`id(j)`) fall in one [`DOWN_BLOCK`].
pub(crate) fn block_runs(m: usize, id: impl Fn(usize) -> u32) -> Vec<Range<usize>> {
    let mut runs: Vec<Range<usize>> = Vec::new();
    for j in 0..m {
        let block = id(j) / DOWN_BLOCK;
        match runs.last_mut() {
            Some(r) if id(r.start) / DOWN_BLOCK == block => r.end = j + 1,
            _ => runs.push(j..j + 1),
        }
    }
    runs
}

/// `out[t] += Σ_j h[t·m + j] · down_{idx[j]}` for `n` tokens (`out` is `n × d`), in the order
/// [`DOWN_BLOCK`] gives by the neurons' ids (`ids[j]` is `idx[j]`'s: a unit's entries are slots),
/// split over output columns ([`DownSplit::Output`]). (`gpu-offload bench sparse` times both
/// splits; on this project's 2-core machine they measured within noise of each other, 1 and 4
/// tokens, f16/int8/int4, 10 and 50% active.)
pub fn sparse_down(
    k: &Kernels,
    b: &Bundles,
    (idx, ids): (&[u32], &[u32]),
    h: &[f32],
    n: usize,
    out: &mut [f32],
) -> Result<()> {
    sparse_down_split(k, b, (idx, ids), h, n, out, DownSplit::Output)
}

/// [`sparse_down`] with the thread split chosen by the caller: the same bits either way.
pub fn sparse_down_split(
    k: &Kernels,
    b: &Bundles,
    (idx, ids): (&[u32], &[u32]),
    h: &[f32],
    n: usize,
    out: &mut [f32],
    split: DownSplit,
) -> Result<()> {
    let op = "sparse_down";
    let BundleShape { parts, d } = b.shape;
    let m = idx.len();
    if h.len() != n * m || out.len() != n * d || ids.len() != m {
        return Err(err(
            op,
            format!(
                "h has {} values, out {}, {} ids: want {n}×{m}, {n}×{d} and {m}",
                h.len(),
                out.len(),
                ids.len()
            ),
        ));
    }
    b.check_idx(op, idx)?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    let o = ops(k);
    let fast = f16_fast(o, b.is_f16());
    let down = parts - 1;
    // Each block's positions whose neuron weighs anything for some token: neurons with a zero
    // weight for every token add nothing (and ReLU models have many), and a block with none
    // adds nothing at all.
    let blocks: Vec<Vec<usize>> = block_runs(m, |j| ids[j])
        .into_iter()
        .map(|r| r.filter(|&j| (0..n).any(|t| h[t * m + j] != 0.0)).collect())
        .filter(|live: &Vec<usize>| !live.is_empty())
        .collect();
    // Sum the columns of the neurons at positions `live` over `c0..c1` into `acc`
    // (`n × (c1 − c0)`). Four columns at a time, so each pass reads and writes the output tile
    // once per four; every kernel adds a neuron's term with one fused multiply-add per output
    // in list order, so a neuron whose weight for a token is zero leaves that token's sums
    // exactly as they were.
    let columns = |live: &[usize], c0: usize, c1: usize, acc: &mut [f32]| {
        let w = c1 - c0;
        // Padding columns (repeats) get weight zero.
        let a = |group: &[usize], t: usize| {
            [0, 1, 2, 3].map(|q| group.get(q).map_or(0.0, |&j| h[t * m + j]))
        };
        match fast {
            Some(f) => {
                let cols = |g: &[usize; 4]| g.map(|j| &b.part_f16(idx[j] as usize, down)[c0..c1]);
                in_fours(live, 4, cols, |cols, next, group| {
                    for t in 0..n {
                        (f.axpy4)(a(group, t), cols, next, &mut acc[t * w..(t + 1) * w]);
                    }
                });
            }
            None => {
                let cols = |g: &[usize; 4]| g.map(|j| b.part(idx[j] as usize, down).slice(c0, c1));
                in_fours(live, 4, cols, |cols, next, group| {
                    for t in 0..n {
                        let out = &mut acc[t * w..(t + 1) * w];
                        axpy4(o, a(group, t), cols, next, group.len(), out);
                    }
                });
            }
        }
    };
    let threads = rayon::current_num_threads().max(1);
    match split {
        DownSplit::Output => {
            // Each task carries its columns of `out` through every block, each block summed
            // from zero in a tile of its own and then added.
            let per = columns_per_task(d, threads);
            let tasks = d.div_ceil(per);
            let cols = |task: usize| (task * per, ((task + 1) * per).min(d));
            let sums: Vec<Vec<f32>> = (0..tasks)
                .into_par_iter()
                .map(|task| {
                    let (c0, c1) = cols(task);
                    let mut acc: Vec<f32> = (0..n)
                        .flat_map(|t| out[t * d + c0..t * d + c1].iter().copied())
                        .collect();
                    let mut block = vec![0f32; acc.len()];
                    for live in &blocks {
                        block.fill(0.0);
                        columns(live, c0, c1, &mut block);
                        acc.iter_mut().zip(&block).for_each(|(a, s)| *a += s);
                    }
                    acc
                })
                .collect();
            for (task, acc) in sums.iter().enumerate() {
                let (c0, c1) = cols(task);
                let w = c1 - c0;
                for t in 0..n {
                    out[t * d + c0..t * d + c1].copy_from_slice(&acc[t * w..(t + 1) * w]);
                }
            }
        }
        DownSplit::Partials => {
            // Each block summed whole by a task of its own, the sums added in block order.
            let sums: Vec<Vec<f32>> = blocks
                .par_iter()
                .map(|live| {
                    let mut acc = vec![0f32; n * d];
                    columns(live, 0, d, &mut acc);
                    acc
                })
                .collect();
            add_in_order(&sums, out);
        }
    }
    Ok(())
}

/// `out += sums[0]`, then `sums[1]`, … (each as long as `out`), over column chunks in parallel.
pub(crate) fn add_in_order(sums: &[Vec<f32>], out: &mut [f32]) {
    const CHUNK: usize = 1024;
    let add = |(c, o): (usize, &mut [f32])| {
        for sum in sums {
            let part = &sum[c * CHUNK..c * CHUNK + o.len()];
            o.iter_mut().zip(part).for_each(|(x, s)| *x += s);
        }
    };
    if out.len() <= CHUNK {
        add((0, out));
    } else {
        out.par_chunks_mut(CHUNK).enumerate().for_each(add);
    }
}

/// Output columns per task of the [`DownSplit::Output`] split of `d` columns over `threads`:
/// an even share, rounded up to [`COLS_ALIGN`], at least [`MIN_COLS_PER_TASK`].
fn columns_per_task(d: usize, threads: usize) -> usize {
    d.div_ceil(threads.max(1))
        .next_multiple_of(COLS_ALIGN)
        .max(MIN_COLS_PER_TASK)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tasks start on the INT4 group and the kernels' steps, and two threads share a
    /// SmolLM2-wide (576) or Llama-wide (4096) output evenly; narrow outputs stay one task.
    #[test]
    fn output_columns_are_shared_evenly_on_aligned_starts() {
        for (d, threads, want) in [(576, 2, 288), (4096, 2, 2048), (576, 3, 256), (224, 2, 256)] {
            let per = columns_per_task(d, threads);
            assert_eq!(per, want, "d {d}, {threads} threads");
            assert!(per.is_multiple_of(INT4_GROUP) && per.is_multiple_of(32));
        }
    }
}
