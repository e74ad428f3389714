//! The up side over bundles: the listed neurons' hidden activations ([`sparse_up`]) and one
//! part's dots alone ([`sparse_part_dots`], the part that decides which neurons are active).

use super::bundle::{Bundles, check_x_h, err};
use super::items::{in_fours, per_items};
use super::vector::{dot4, f16_fast, ops};
use crate::backend::cpu::kernels::Kernels;
use crate::backend::{BundleShape, Result};

/// Hidden activations of the listed neurons for `n` tokens:
/// `h[t·m + j] = act(gate_i·x_t) · (up_i·x_t)` (gated bundles) or `act(up_i·x_t + bias[i])`
/// (two-part bundles; `bias` indexed by neuron, ignored when gated, as the dense kernel does),
/// `i = idx[j]`, `x` is `n × d`.
#[allow(clippy::too_many_arguments)]
pub fn sparse_up(
    k: &Kernels,
    b: &Bundles,
    idx: &[u32],
    x: &[f32],
    n: usize,
    act: fn(f32) -> f32,
    bias: Option<&[f32]>,
    h: &mut [f32],
) -> Result<()> {
    let op = "sparse_up";
    let BundleShape { parts, d } = b.shape;
    let m = idx.len();
    check_x_h(op, (x, h), n, (d, m))?;
    if let Some(bb) = bias
        && bb.len() != b.neurons
    {
        return Err(err(
            op,
            format!("bias of {} for {} neurons", bb.len(), b.neurons),
        ));
    }
    b.check_idx(op, idx)?;
    let o = ops(k);
    let xt = |t: usize| &x[t * d..(t + 1) * d];
    let up = Up {
        idx,
        n,
        gated: parts == 3,
        act,
        bias,
    };
    match f16_fast(o, b.is_f16()) {
        Some(f) => up.walk(
            h,
            |i, p| b.part_f16(i, p),
            |rows, next, _, t| (f.dot4)(rows, next, xt(t)),
        ),
        None => up.walk(
            h,
            |i, p| b.part(i, p),
            |rows, next, live, t| dot4(k, o, rows, next, live, xt(t)),
        ),
    }
    Ok(())
}

/// What [`sparse_up`] computes, apart from the kind of vectors its kernels take.
struct Up<'a> {
    idx: &'a [u32],
    n: usize,
    gated: bool,
    act: fn(f32) -> f32,
    bias: Option<&'a [f32]>,
}

impl Up<'_> {
    /// The walk over vectors of one kind: `part(i, p)` is part `p` of neuron `i`,
    /// `dots(rows, next, live, t)` four vectors against token `t`.
    fn walk<V: Copy>(
        &self,
        h: &mut [f32],
        part: impl Fn(usize, usize) -> V + Sync,
        dots: impl Fn([V; 4], [V; 4], usize, usize) -> [f32; 4] + Sync,
    ) {
        let Up {
            idx,
            n,
            gated,
            act,
            bias,
        } = *self;
        // Gated: two neurons' gate and up rows per group of four; else four neurons' up rows.
        let per = if gated { 2 } else { 4 };
        per_items(idx.len(), n, h, |js, vals| {
            let j0 = js.start;
            let items: Vec<usize> = js.collect();
            let rows = |g: &[usize; 4]| -> [V; 4] {
                let nr = |q: usize| idx[g[q]] as usize;
                if gated {
                    [
                        part(nr(0), 0),
                        part(nr(0), 1),
                        part(nr(1), 0),
                        part(nr(1), 1),
                    ]
                } else {
                    [0, 1, 2, 3].map(|q| part(nr(q), 0))
                }
            };
            in_fours(&items, per, rows, |rows, next, group| {
                let live = if gated { 2 * group.len() } else { group.len() };
                for t in 0..n {
                    let s = dots(rows, next, live, t);
                    for (q, &j) in group.iter().enumerate() {
                        let i = idx[j] as usize;
                        vals[(j - j0) * n + t] = if gated {
                            act(s[2 * q]) * s[2 * q + 1]
                        } else {
                            act(s[q] + bias.map_or(0.0, |bb| bb[i]))
                        };
                    }
                }
            });
        });
    }
}

/// `out[t·m + j] = part p of bundle idx[j] · x_t` for `n` tokens: one part of the listed
/// neurons (the part that decides whether a neuron is active: the gate, or the up vector of
/// two-part bundles), so the others are read only for the neurons that turn out active.
pub fn sparse_part_dots(
    k: &Kernels,
    b: &Bundles,
    idx: &[u32],
    p: usize,
    x: &[f32],
    n: usize,
    out: &mut [f32],
) -> Result<()> {
    let op = "sparse_part_dots";
    let BundleShape { parts, d } = b.shape;
    let m = idx.len();
    if p >= parts || x.len() != n * d || out.len() != n * m {
        return Err(err(
            op,
            format!(
                "part {p} of {parts}, x has {} values, out {}: want {n}×{d} and {n}×{m}",
                x.len(),
                out.len()
            ),
        ));
    }
    b.check_idx(op, idx)?;
    let o = ops(k);
    let xt = |t: usize| &x[t * d..(t + 1) * d];
    match f16_fast(o, b.is_f16()) {
        Some(f) => part_dots(
            m,
            n,
            out,
            |j| b.part_f16(idx[j] as usize, p),
            |rows, next, _, t| (f.dot4)(rows, next, xt(t)),
        ),
        None => part_dots(
            m,
            n,
            out,
            |j| b.part(idx[j] as usize, p),
            |rows, next, live, t| dot4(k, o, rows, next, live, xt(t)),
        ),
    }
    Ok(())
}

/// [`sparse_part_dots`]' walk over vectors of one kind: `row(j)` is list position `j`'s
/// vector, `dots(rows, next, live, t)` four of them against token `t`.
fn part_dots<V: Copy>(
    m: usize,
    n: usize,
    out: &mut [f32],
    row: impl Fn(usize) -> V + Sync,
    dots: impl Fn([V; 4], [V; 4], usize, usize) -> [f32; 4] + Sync,
) {
    per_items(m, n, out, |js, vals| {
        let j0 = js.start;
        let items: Vec<usize> = js.collect();
        in_fours(
            &items,
            4,
            |g| g.map(&row),
            |rows, next, group| {
                for t in 0..n {
                    let s = dots(rows, next, group.len(), t);
                    for (q, &j) in group.iter().enumerate() {
                        vals[(j - j0) * n + t] = s[q];
                    }
                }
            },
        );
    });
}
