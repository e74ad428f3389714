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
    debug_assert_eq!(out.len(), m * n);
    let task = |(c, o): (usize, &mut [f32])| {
        let j0 = c * NEURONS_PER_TASK;
        f(j0..j0 + o.len() / n.max(1), o)
    };
    if n == 1 {
        if m <= NEURONS_PER_TASK {
            out.chunks_mut(NEURONS_PER_TASK).enumerate().for_each(task);
        } else {
            out.par_chunks_mut(NEURONS_PER_TASK)
                .enumerate()
                .for_each(task);
        }
        return;
    }
    let mut tr = vec![0f32; m * n];
    tr.par_chunks_mut(NEURONS_PER_TASK * n)
        .enumerate()
        .for_each(task);
    for (j, v) in tr.chunks(n).enumerate() {
        for (t, &x) in v.iter().enumerate() {
            out[t * m + j] = x;
        }
    }
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
