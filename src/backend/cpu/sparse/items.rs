//! How the row-wise operators walk their listed items: runs of items over rayon tasks
//! ([`per_items`]) and, within a run, groups of four vectors with the next group to prefetch
//! ([`in_fours`]).

use rayon::prelude::*;

/// Listed neurons per parallel task of the row-wise functions.
const NEURONS_PER_TASK: usize = 32;

/// `out[t·m + j] = f(j, t)` for `m` items and `n` tokens, items split over rayon tasks.
/// `f(js, vals)` fills a run of items `js`, item-major (`vals[(j − js.start)·n + t]`); for
/// `n > 1` the runs are transposed into `out` afterwards.
pub(crate) fn per_items(
    m: usize,
    n: usize,
    out: &mut [f32],
    f: impl Fn(std::ops::Range<usize>, &mut [f32]) + Sync,
) {
    per_runs(&item_runs(m), n, out, f);
}

/// `0..m` in runs of [`NEURONS_PER_TASK`] items, a task's each.
pub(crate) fn item_runs(m: usize) -> Vec<std::ops::Range<usize>> {
    (0..m)
        .step_by(NEURONS_PER_TASK)
        .map(|j| j..(j + NEURONS_PER_TASK).min(m))
        .collect()
}

/// [`per_items`] over the given runs of items (consecutive, from 0, covering all `m`), a task
/// each, each task's result returned in run order.
pub(crate) fn per_runs<R: Send>(
    runs: &[std::ops::Range<usize>],
    n: usize,
    out: &mut [f32],
    f: impl Fn(std::ops::Range<usize>, &mut [f32]) -> R + Sync,
) -> Vec<R> {
    let m = runs.last().map_or(0, |r| r.end);
    debug_assert_eq!(out.len(), m * n);
    // Each run's slice of an item-major buffer.
    fn split<'b>(
        runs: &[std::ops::Range<usize>],
        n: usize,
        mut buf: &'b mut [f32],
    ) -> Vec<(std::ops::Range<usize>, &'b mut [f32])> {
        runs.iter()
            .map(|r| {
                let (this, rest) = std::mem::take(&mut buf).split_at_mut(r.len() * n);
                buf = rest;
                (r.clone(), this)
            })
            .collect()
    }
    let task = |(js, vals): (std::ops::Range<usize>, &mut [f32])| f(js, vals);
    if n == 1 {
        let tasks = split(runs, n, out);
        return if tasks.len() <= 1 {
            tasks.into_iter().map(task).collect()
        } else {
            tasks.into_par_iter().map(task).collect()
        };
    }
    let mut tr = vec![0f32; m * n];
    let results = split(runs, n, &mut tr).into_par_iter().map(task).collect();
    for (j, v) in tr.chunks(n).enumerate() {
        for (t, &x) in v.iter().enumerate() {
            out[t * m + j] = x;
        }
    }
    results
}

/// Groups of four vectors over a run of items (the last group padded with repeats of its last
/// item): `group(items)` picks the vectors (a [`super::vector::Vector`] of any encoding, or a
/// plain f16 slice for the f16 kernels: see [`super::vector::F16Fast`]). Calls
/// `f(vectors, next group's vectors, items)`; the last group's `next` is itself (nothing
/// further to prefetch).
pub(super) fn in_fours<V: Copy>(
    items: &[usize],
    per: usize,
    group: impl Fn(&[usize; 4]) -> [V; 4],
    mut f: impl FnMut([V; 4], [V; 4], &[usize]),
) {
    let pad = |c: &[usize]| -> [usize; 4] { [0, 1, 2, 3].map(|q| c[q.min(c.len() - 1)]) };
    let mut chunks = items.chunks(per).peekable();
    let mut cur = chunks.peek().map(|c| group(&pad(c)));
    while let (Some(c), Some(rows)) = (chunks.next(), cur) {
        let next = chunks.peek().map(|c| group(&pad(c)));
        f(rows, next.unwrap_or(rows), c);
        cur = next;
    }
}
