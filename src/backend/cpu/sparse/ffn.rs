//! The up side of listed neurons with its decision, in one pass ([`sparse_decide_up`]): each
//! group of four neurons' deciding parts, then the up parts of those the decision leaves on,
//! while their lines are still coming in. Hybrid's cold neurons took this in two passes (every
//! deciding part, then the ups of the active), each a parallel call and a walk through the
//! layer of its own. [`sparse_ffn`] adds the down side to the same pass: an active neuron's
//! whole bundle is read in one run.

use std::sync::atomic::{AtomicBool, Ordering};

use super::bundle::{Bundles, check_x_h, err};
use super::down::{add_in_order, block_runs};
use super::items::{item_runs, per_runs};
use super::vector::{Vector, axpy4, dot4, f16_fast, ops};
use crate::backend::Result;
use crate::backend::cpu::kernels::Kernels;

/// Where a layer's up side is: whole bundles (gate, up, down or up, down side by side), or
/// each part in rows of its own (the same neuron at the same row of each).
#[derive(Clone, Copy, Debug)]
pub enum FfnParts<'a> {
    Bundles(Bundles<'a>),
    Apart {
        /// The part that decides: the gate, or the up rows of an ungated FFN.
        decide: Bundles<'a>,
        /// The up rows of a gated FFN.
        up: Option<Bundles<'a>>,
        /// The down columns (as rows), for [`sparse_ffn`].
        down: Option<Bundles<'a>>,
    },
}

/// A part's role in a neuron's FFN.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    Decide,
    Up,
    Down,
}

impl<'a> FfnParts<'a> {
    /// Whether a gate decides and an up row follows (else the up row decides and is all).
    pub fn gated(&self) -> bool {
        match self {
            FfnParts::Bundles(b) => b.shape.parts == 3,
            FfnParts::Apart { up, .. } => up.is_some(),
        }
    }

    fn d(&self) -> usize {
        match self {
            FfnParts::Bundles(b) => b.shape.d,
            FfnParts::Apart { decide, .. } => decide.shape.d,
        }
    }

    fn is_f16(&self) -> bool {
        match self {
            FfnParts::Bundles(b) => b.is_f16(),
            FfnParts::Apart { decide, up, down } => {
                decide.is_f16() && up.is_none_or(|u| u.is_f16()) && down.is_none_or(|u| u.is_f16())
            }
        }
    }

    /// Where `role` of a neuron is: the bundles and the part within each.
    /// (A down part of parts taken apart without one is never asked for: [`sparse_ffn`] checks.)
    fn at(&self, role: Role) -> (&Bundles<'a>, usize) {
        match (self, role) {
            (FfnParts::Bundles(b), Role::Decide) => (b, 0),
            (FfnParts::Bundles(b), Role::Up) => (b, 1),
            (FfnParts::Bundles(b), Role::Down) => (b, b.shape.parts - 1),
            (FfnParts::Apart { decide, .. }, Role::Decide) => (decide, 0),
            (FfnParts::Apart { up, decide, .. }, Role::Up) => (up.as_ref().unwrap_or(decide), 0),
            (FfnParts::Apart { down, decide, .. }, Role::Down) => {
                (down.as_ref().unwrap_or(decide), 0)
            }
        }
    }

    fn part(&self, i: usize, role: Role) -> Vector<'a> {
        let (b, p) = self.at(role);
        b.part(i, p)
    }

    fn part_f16(&self, i: usize, role: Role) -> &'a [half::f16] {
        let (b, p) = self.at(role);
        b.part_f16(i, p)
    }

    /// The pieces agree (one width, one encoding, as many neurons) and hold every listed one.
    fn check(&self, op: &'static str, idx: &[u32]) -> Result<()> {
        match self {
            FfnParts::Bundles(b) => {
                if b.shape.parts < 2 {
                    return Err(err(op, "bundles of one part have no down column".into()));
                }
                b.check_idx(op, idx)
            }
            FfnParts::Apart { decide, up, down } => {
                for b in [Some(decide), up.as_ref(), down.as_ref()]
                    .into_iter()
                    .flatten()
                {
                    if b.shape.parts != 1
                        || b.shape.d != decide.shape.d
                        || b.neurons != decide.neurons
                        || b.enc != decide.enc
                    {
                        return Err(err(
                            op,
                            "the parts taken apart differ in width, encoding or neurons".into(),
                        ));
                    }
                    b.check_idx(op, idx)?;
                }
                Ok(())
            }
        }
    }
}

/// The hidden activations of the listed neurons (`i = idx[j]`) for `n` tokens (`x` is
/// `n × d`): `h[t·m + j] = decide(j, t, dec_i·x_t) · (up_i·x_t)` (gated; `dec` is the gate) or
/// `decide(j, t, dec_i·x_t)` (ungated; `dec` is the up row, and `decide` adds any bias), where
/// `decide` is the activation with its mask (zero where the neuron is off for the token). A
/// neuron's up part is read only where `decide` is non-zero for some token. Returns the list
/// positions `decide` left on for some token, ascending.
///
/// The deciding dots are the same bits as [`super::sparse_part_dots`]' (and so as the dense
/// kernel's dot of the same row), the up dots too: `h` is bit for bit what the two passes give.
pub fn sparse_decide_up(
    k: &Kernels,
    parts: FfnParts,
    idx: &[u32],
    x: &[f32],
    n: usize,
    decide: impl Fn(usize, usize, f32) -> f32 + Sync,
    h: &mut [f32],
) -> Result<Vec<usize>> {
    walk_listed("sparse_decide_up", k, parts, idx, x, n, &decide, h, None)
}

/// [`sparse_decide_up`] and the down side in the same pass: `h` as it gives, and
/// `out[t] += Σ_j h[t·m + j] · down_{idx[j]}` (`out` is `n × d`; `ids[j]` is `idx[j]`'s neuron
/// id, which places its term in the order).
/// Each group's down columns are added right after its up dots, so an active neuron's bundle is
/// read in one run rather than in two passes over the layer (SmolLM2's f16 layers, 84% on,
/// 2 threads: 5.4–5.6 ms against 6.3–6.8 for 30 layers). Each [`DOWN_BLOCK`](super::DOWN_BLOCK) of the list is a
/// task with a sum of its own, the sums added to `out` in block order: the order
/// [`super::sparse_down`] sums in, so the result is its result over the same `h`, bit for bit.
#[allow(clippy::too_many_arguments)]
pub fn sparse_ffn(
    k: &Kernels,
    parts: FfnParts,
    (idx, ids): (&[u32], &[u32]),
    x: &[f32],
    n: usize,
    decide: impl Fn(usize, usize, f32) -> f32 + Sync,
    h: &mut [f32],
    out: &mut [f32],
) -> Result<Vec<usize>> {
    let op = "sparse_ffn";
    let (d, m) = (parts.d(), idx.len());
    if let FfnParts::Apart { down: None, .. } = parts {
        return Err(err(
            op,
            "the parts taken apart came without their down rows".into(),
        ));
    }
    if out.len() != n * d || ids.len() != m {
        return Err(err(
            op,
            format!(
                "out has {} values, {} ids: want {n}×{d} and {m}",
                out.len(),
                ids.len()
            ),
        ));
    }
    walk_listed(op, k, parts, idx, x, n, &decide, h, Some((ids, out)))
}

/// The walk of [`sparse_decide_up`] (`down`: none) and of [`sparse_ffn`] (`down`: the ids and
/// the output, checked by it), `x`, `h` and the parts checked here for `op`. Without a down
/// side, runs of positions go to tasks; with one, each [`DOWN_BLOCK`](super::DOWN_BLOCK) is a
/// task with a sum of its own.
#[allow(clippy::too_many_arguments)]
fn walk_listed(
    op: &'static str,
    k: &Kernels,
    parts: FfnParts,
    idx: &[u32],
    x: &[f32],
    n: usize,
    decide: &(impl Fn(usize, usize, f32) -> f32 + Sync),
    h: &mut [f32],
    down: Option<(&[u32], &mut [f32])>,
) -> Result<Vec<usize>> {
    let (d, m) = (parts.d(), idx.len());
    check_x_h(op, (x, h), n, (d, m))?;
    parts.check(op, idx)?;
    if m == 0 || n == 0 {
        return Ok(Vec::new());
    }
    let o = ops(k);
    let xt = |t: usize| &x[t * d..(t + 1) * d];
    let walk = Walk {
        idx,
        n,
        gated: parts.gated(),
        decide,
    };
    let fast = f16_fast(o, parts.is_f16());
    Ok(run_listed(
        (m, n, d),
        h,
        down,
        |js, vals, on, sum| match fast {
            Some(f) => {
                let axpy = |a, cols, next, _, out: &mut [f32]| (f.axpy4)(a, cols, next, out);
                walk.run(
                    js,
                    (vals, on),
                    |i, r| parts.part_f16(i, r),
                    |rows, next, _, t| (f.dot4)(rows, next, xt(t)),
                    sum.map(|s| (s, &axpy as Axpy<'_, _>)),
                )
            }
            None => {
                let axpy =
                    |a, cols, next, live, out: &mut [f32]| axpy4(o, a, cols, next, live, out);
                walk.run(
                    js,
                    (vals, on),
                    |i, r| parts.part(i, r),
                    |rows, next, live, t| dot4(k, o, rows, next, live, xt(t)),
                    sum.map(|s| (s, &axpy as Axpy<'_, _>)),
                )
            }
        },
    ))
}

/// The tasks of a walk over `m` listed neurons for `n` tokens of width `d` (`h` is `n × m`):
/// without a down side (`down`), runs of list positions; with one (the ids, which place each
/// term in the order, and the `n × d` output), each [`DOWN_BLOCK`](super::DOWN_BLOCK) a task
/// with a sum of its own, the sums added to the output in block order (the order
/// [`super::sparse_down`] sums in). `task(js, vals, on, sum)` fills its positions' values
/// item-major (`vals[(j − js.start)·n + t]`), flags those on in `on` (by position) and adds
/// their down side into `sum` where there is one. Returns the positions on, ascending.
pub(super) fn run_listed(
    (m, n, d): (usize, usize, usize),
    h: &mut [f32],
    down: Option<(&[u32], &mut [f32])>,
    task: impl Fn(std::ops::Range<usize>, &mut [f32], &[AtomicBool], Option<&mut [f32]>) + Sync,
) -> Vec<usize> {
    let on: Vec<AtomicBool> = (0..m).map(|_| AtomicBool::new(false)).collect();
    let runs = match &down {
        Some((ids, _)) => block_runs(m, |j| ids[j]),
        None => item_runs(m),
    };
    let summed = down.is_some();
    let sums = per_runs(&runs, n, h, |js, vals| {
        let mut acc = vec![0f32; if summed { n * d } else { 0 }];
        task(js.clone(), vals, &on, summed.then_some(&mut acc[..]));
        // A block with no neuron on adds nothing (as in `sparse_down`).
        (summed && js.into_iter().any(|j| on[j].load(Ordering::Relaxed))).then_some(acc)
    });
    if let Some((_, out)) = down {
        let sums: Vec<Vec<f32>> = sums.into_iter().flatten().collect();
        add_in_order(&sums, out);
    }
    (0..m).filter(|&j| on[j].load(Ordering::Relaxed)).collect()
}

/// Adds `a[r] · cols[r]` into an output row for the first `live` columns, the `next` group's
/// fetched ahead (the down kernels' signature).
type Axpy<'f, V> = &'f dyn Fn([f32; 4], [V; 4], [V; 4], usize, &mut [f32]);

/// What one task of [`sparse_decide_up`] walks.
struct Walk<'a, D> {
    idx: &'a [u32],
    n: usize,
    gated: bool,
    decide: &'a D,
}

impl<D: Fn(usize, usize, f32) -> f32> Walk<'_, D> {
    /// The list positions `js` in groups of four: their values item-major into `vals`
    /// (`vals[(j − js.start)·n + t]`), those on flagged in `live` (by position). `part(i, role)` is a
    /// part of neuron `i`, `dots(rows, next, live, t)` four rows against token `t`, the
    /// `next` rows fetched ahead. With `down` (an `n × d` sum and its kernel), each group's
    /// down columns of the neurons on are added into the sum after the group's up dots.
    fn run<V: Copy>(
        &self,
        js: std::ops::Range<usize>,
        (vals, live): (&mut [f32], &[AtomicBool]),
        part: impl Fn(usize, Role) -> V,
        dots: impl Fn([V; 4], [V; 4], usize, usize) -> [f32; 4],
        mut down: Option<(&mut [f32], Axpy<'_, V>)>,
    ) {
        let n = self.n;
        let j0 = js.start;
        let items: Vec<usize> = js.collect();
        let groups: Vec<&[usize]> = items.chunks(4).collect();
        let neuron = |j: usize| self.idx[j] as usize;
        // Padded to four with repeats of the last (their results unused).
        let pad = |g: &[usize]| -> [usize; 4] { [0, 1, 2, 3].map(|q| g[q.min(g.len() - 1)]) };
        let deciding = |g: &[usize]| pad(g).map(|j| part(neuron(j), Role::Decide));
        // Group `gi`'s deciding dots (the next group's deciding rows fetched behind them), its
        // values into `vals`, those on flagged: the positions on and their number.
        let decide_group = |gi: usize, vals: &mut [f32]| -> ([usize; 4], usize) {
            let group = groups[gi];
            let dec = deciding(group);
            let ahead = groups.get(gi + 1).map(|g| deciding(g)).unwrap_or(dec);
            for t in 0..n {
                let s = dots(dec, ahead, group.len(), t);
                for (q, &j) in group.iter().enumerate() {
                    vals[(j - j0) * n + t] = (self.decide)(j, t, s[q]);
                }
            }
            let mut on = [0usize; 4];
            let mut nl = 0;
            for &j in group.iter() {
                let v = &vals[(j - j0) * n..(j - j0 + 1) * n];
                if v.iter().any(|&v| v != 0.0) {
                    live[j].store(true, Ordering::Relaxed);
                    on[nl] = j;
                    nl += 1;
                }
            }
            (on, nl)
        };
        if groups.is_empty() {
            return;
        }
        // Each group is decided one group ahead of its ups (gated) and its downs, so the dots
        // and sums fetch behind them exactly the next group's parts that are on. Each part's
        // rows then come in two dots ahead (a gate/up walk read 20–29 GB/s against 18–21 one
        // dot ahead, Zen 4, 2 threads), and no row is asked for that is not read: the deciding
        // dots used to fetch all four ups of their group, three in four of them off at 27% on.
        let of = |(on, nl): ([usize; 4], usize), role| {
            [0, 1, 2, 3].map(|r| part(neuron(on[r.min(nl - 1)]), role))
        };
        let ahead_of = |next: Option<([usize; 4], usize)>, role, cur: [V; 4]| match next {
            Some(g) if g.1 > 0 => of(g, role),
            _ => cur,
        };
        let mut cur = decide_group(0, vals);
        for gi in 0..groups.len() {
            let (on, nl) = cur;
            let next = (gi + 1 < groups.len()).then(|| decide_group(gi + 1, vals));
            if nl > 0 && self.gated {
                let ups = of(cur, Role::Up);
                let ahead = ahead_of(next, Role::Up, ups);
                for t in 0..n {
                    let u = dots(ups, ahead, nl, t);
                    for (r, &j) in on[..nl].iter().enumerate() {
                        vals[(j - j0) * n + t] *= u[r];
                    }
                }
            }
            if nl > 0
                && let Some((acc, axpy)) = &mut down
            {
                let d = acc.len() / n;
                let cols = of(cur, Role::Down);
                let ahead = ahead_of(next, Role::Down, cols);
                for t in 0..n {
                    // Padding columns weigh zero.
                    let a = [0, 1, 2, 3].map(|r| {
                        if r < nl {
                            vals[(on[r] - j0) * n + t]
                        } else {
                            0.0
                        }
                    });
                    axpy(a, cols, ahead, nl, &mut acc[t * d..(t + 1) * d]);
                }
            }
            if let Some(g) = next {
                cur = g;
            }
        }
    }
}
