//! The down side over bundles: the listed neurons' down columns weighted by their hidden
//! activations, added into the output ([`sparse_down`]), split over threads one of two ways
//! ([`DownSplit`]).

use rayon::prelude::*;

use super::bundle::{Bundles, err};
use super::items::in_fours;
use super::vector::{axpy4, f16_fast, ops};
use crate::backend::cpu::kernels::Kernels;
use crate::backend::{BundleShape, Result};
use crate::store::quant::INT4_GROUP;

/// How [`sparse_down_split`] spreads its work over threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DownSplit {
    /// Each task owns a range of output columns and reads that range of every listed column:
    /// no reduction, the task's outputs stay in L1.
    Output,
    /// Each task sums the listed neurons of a fixed range of neuron ids into its own `n × d`
    /// accumulator; the accumulators are added at the end in task order (a token's result
    /// depends on its own neurons only, but on the list being whole: not for a unit's rounds).
    Partials,
}

/// Output columns per task at least, so each task still reads runs long enough for the
/// prefetchers.
const MIN_COLS_PER_TASK: usize = 256;

/// Tasks' columns start at multiples of this: the INT4 group, and the f16/f32 kernels' 32-wide
/// steps (so no task ends in a column tail they would sum another way). No coarser, so the
/// threads share the columns evenly: at 64, SmolLM2's 576 split 320/256 over two threads.
const COLS_ALIGN: usize = INT4_GROUP;

/// `out[t] += Σ_j h[t·m + j] · down_{idx[j]}` for `n` tokens (`out` is `n × d`), split over
/// output columns ([`DownSplit::Output`]): each token's result is one chain of multiply-adds
/// from `out` in list order, so it is what the token gets alone, bit for bit, whatever the
/// other tokens list, however a cache unit cuts the list into rounds and whichever slots hold
/// the neurons. (`gpu-offload bench sparse` times both splits; on this project's 2-core
/// machine they measured within noise of each other, 1 and 4 tokens, f16/int8/int4, 10 and
/// 50% active.)
pub fn sparse_down(
    k: &Kernels,
    b: &Bundles,
    idx: &[u32],
    h: &[f32],
    n: usize,
    out: &mut [f32],
) -> Result<()> {
    sparse_down_split(k, b, idx, h, n, out, DownSplit::Output)
}

/// [`sparse_down`] with the thread split chosen by the caller.
pub fn sparse_down_split(
    k: &Kernels,
    b: &Bundles,
    idx: &[u32],
    h: &[f32],
    n: usize,
    out: &mut [f32],
    split: DownSplit,
) -> Result<()> {
    let op = "sparse_down";
    let BundleShape { parts, d } = b.shape;
    let m = idx.len();
    if h.len() != n * m || out.len() != n * d {
        return Err(err(
            op,
            format!(
                "h has {} values, out {}: want {n}×{m} and {n}×{d}",
                h.len(),
                out.len()
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
    // Sum the columns of the neurons at positions `js` over `c0..c1` into `acc`
    // (`n × (c1 − c0)`). Four columns at a time, so each pass reads and writes the output tile
    // once per four; every kernel adds a neuron's term with one fused multiply-add per output
    // in list order, so a neuron whose weight for a token is zero leaves that token's sums
    // exactly as they were.
    let columns = |js: &[usize], c0: usize, c1: usize, acc: &mut [f32]| {
        let w = c1 - c0;
        // Neurons with a zero weight for every token add nothing (and ReLU models have many).
        let live: Vec<usize> = js
            .iter()
            .copied()
            .filter(|&j| (0..n).any(|t| h[t * m + j] != 0.0))
            .collect();
        // Padding columns (repeats) get weight zero.
        let a = |group: &[usize], t: usize| {
            [0, 1, 2, 3].map(|q| group.get(q).map_or(0.0, |&j| h[t * m + j]))
        };
        match fast {
            Some(f) => {
                let cols = |g: &[usize; 4]| g.map(|j| &b.part_f16(idx[j] as usize, down)[c0..c1]);
                in_fours(&live, 4, cols, |cols, next, group| {
                    for t in 0..n {
                        (f.axpy4)(a(group, t), cols, next, &mut acc[t * w..(t + 1) * w]);
                    }
                });
            }
            None => {
                let cols = |g: &[usize; 4]| g.map(|j| b.part(idx[j] as usize, down).slice(c0, c1));
                in_fours(&live, 4, cols, |cols, next, group| {
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
            // Each task carries its columns of `out` through every listed neuron: a token's
            // result is one chain of multiply-adds from `out` in list order, the same however
            // the list is cut into calls (a unit's rounds) or which slots hold the neurons.
            let all: Vec<usize> = (0..m).collect();
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
                    columns(&all, c0, c1, &mut acc);
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
            // Each task owns a fixed range of neuron ids (not of positions in the list), and
            // the partial sums are added in task order: a token's result does not depend on
            // the neurons listed for the other tokens of the call (their weights for it are
            // zero) nor on how the threads divide the work.
            let per = b.neurons.div_ceil(threads * 4).max(16);
            let mut tasks: Vec<Vec<usize>> = vec![Vec::new(); b.neurons.div_ceil(per)];
            for (j, &i) in idx.iter().enumerate() {
                let at = ((i & !crate::backend::IN_REST) as usize / per).min(tasks.len() - 1);
                tasks[at].push(j);
            }
            let sums: Vec<Vec<f32>> = tasks
                .par_iter()
                .filter(|js| !js.is_empty())
                .map(|js| {
                    let mut acc = vec![0f32; n * d];
                    columns(js, 0, d, &mut acc);
                    acc
                })
                .collect();
            // Added over column chunks in parallel, each in task order.
            const CHUNK: usize = 1024;
            out.par_chunks_mut(CHUNK).enumerate().for_each(|(c, o)| {
                for sum in &sums {
                    let part = &sum[c * CHUNK..c * CHUNK + o.len()];
                    o.iter_mut().zip(part).for_each(|(x, s)| *x += s);
                }
            });
        }
    }
    Ok(())
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
