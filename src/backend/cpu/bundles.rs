//! The bundled FFN on the CPU: neuron i's gate row, up row and down column stored side by side
//! (see `store`). `up` computes the hidden activations of a run of neurons, `down` adds their
//! weighted down columns to the output. Every bundle encoding (f32, f16, bf16, INT8, INT4; the
//! decoders are `sparse`'s); each bundle is read once.

use super::kernels::Kernels;
use super::sparse::{
    Bundles, DownSplit, FfnParts, NeuronTiles, TiledList, sparse_decide_up, sparse_down_split,
    sparse_part_dots, tiled_ffn,
};
use super::{CpuTensor, CpuWeight, ops, shape_err, vector};
use crate::backend::{Act, BundleShape, Result, sparse_act};
use crate::store::Encoding;
use crate::tensor::{Bytes, HostTensor};

/// `f` of weight `w` viewed as bundles of `shape` in its encoding (for `op`).
pub(super) fn with_bundles<R>(
    w: &CpuWeight,
    op: &'static str,
    shape: BundleShape,
    f: impl FnOnce(&super::sparse::Bundles) -> R,
) -> Result<R> {
    let bytes = w.row_bytes_of(op)?;
    let (rows, cols) = (w.rows(), w.cols());
    let enc = w.encoding();
    crate::backend::check_bundle_weight(op, w.name(), (rows, cols), enc, w.coded_parts(), shape)?;
    with_view(bytes, enc, shape, f)
}

/// `f` of weight `w` viewed as bundles of `shape`, with `rest` beside it where given (a listed
/// entry with [`crate::backend::IN_REST`] reads a row of `rest`).
pub(super) fn with_listed<R>(
    w: &CpuWeight,
    op: &'static str,
    shape: BundleShape,
    rest: Option<&CpuWeight>,
    f: impl FnOnce(&super::sparse::Bundles) -> R,
) -> Result<R> {
    let Some(rest) = rest else {
        return with_bundles(w, op, shape, f);
    };
    with_bundles(w, op, shape, |a| {
        with_bundles(rest, op, shape, |r| Ok(f(&(*a).with_rest(*r)?)))?
    })?
}

/// Weight `b`'s bundles (a unit's slots) beside `rest`'s neuron tiles as one list (for `op`),
/// where `rest` is laid out in them ([`CpuWeight::lay_out_neuron_tiles`]); else `None`, and
/// the listed ops read rows.
pub(super) fn tiled_list<'a>(
    b: &'a CpuWeight,
    op: &'static str,
    shape: BundleShape,
    rest: Option<&'a CpuWeight>,
) -> Result<Option<TiledList<'a>>> {
    let Some((rest, tiles)) = rest.and_then(|r| Some((r, r.neuron_tiles()?))) else {
        return Ok(None);
    };
    // Tiles are laid out for gated f16 bundles only; `with_slots` checks the slots are too.
    for w in [b, rest] {
        let (rows, cols) = (w.rows(), w.cols());
        let enc = w.encoding();
        crate::backend::check_bundle_weight(op, w.name(), (rows, cols), enc, None, shape)?;
    }
    let slots = Bundles::new(b.row_bytes_of(op)?, b.encoding(), shape)?;
    let tiles = NeuronTiles::new(tiles, rest.rows(), shape.d)?;
    Ok(Some(TiledList::with_slots(slots, tiles)?))
}

/// `f` of `bytes` viewed as bundles of `shape` in `enc`, multiplied in their encoding by the
/// best kernels (decoding rows to f32 first ran at ~1.4 GB/s). Bytes that cannot be viewed in
/// place (misaligned) are copied once into an aligned buffer.
pub(crate) fn with_view<R>(
    bytes: &[u8],
    enc: Encoding,
    shape: BundleShape,
    f: impl FnOnce(&Bundles) -> R,
) -> Result<R> {
    if let Ok(v) = Bundles::new(bytes, enc, shape) {
        return Ok(f(&v));
    }
    // Owned bytes are word-aligned, so what fails now is the shape or the encoding.
    let copy = Bytes::from_slice(bytes);
    let v = Bundles::new(copy.as_slice(), enc, shape)?;
    Ok(f(&v))
}

/// [`up_view`] of float bundles held as a `neurons × parts·d` tensor (f32, f16, bf16).
#[allow(clippy::too_many_arguments)]
pub fn up(
    k: &Kernels,
    b: &HostTensor,
    shape: BundleShape,
    x: &[f32],
    n: usize,
    act: fn(f32) -> f32,
    threshold: f32,
    bias: Option<&[f32]>,
    h: &mut [f32],
    stride: usize,
    col0: usize,
) {
    assert!(b.cols == shape.parts * shape.d);
    let enc = Encoding::Format(b.dtype);
    with_view(b.data.as_slice(), enc, shape, |view| {
        up_view(k, view, x, n, act, threshold, bias, h, stride, col0)
    })
    .expect("float bundles of whole rows");
}

/// [`down_view`] of float bundles held as a tensor (see [`up`]).
#[allow(clippy::too_many_arguments)]
pub fn down(
    k: &Kernels,
    b: &HostTensor,
    shape: BundleShape,
    h: &[f32],
    n: usize,
    stride: usize,
    col0: usize,
    out: &mut [f32],
) {
    assert!(b.cols == shape.parts * shape.d);
    let enc = Encoding::Format(b.dtype);
    with_view(b.data.as_slice(), enc, shape, |view| {
        down_view(k, view, h, n, stride, col0, out)
    })
    .expect("float bundles of whole rows");
}

/// `h[t·stride + col0 + i] = act(gate_i·x_t) · (up_i·x_t)` or `act(up_i·x_t + bias[col0 + i])`
/// for every neuron `i` of `view`, in any bundle encoding: `listed_acts` over all of them.
#[allow(clippy::too_many_arguments)]
pub fn up_view(
    k: &Kernels,
    view: &Bundles,
    x: &[f32],
    n: usize,
    act: fn(f32) -> f32,
    threshold: f32,
    bias: Option<&[f32]>,
    h: &mut [f32],
    stride: usize,
    col0: usize,
) {
    let neurons = view.neurons();
    let d = view.shape().d;
    assert!(x.len() == n * d && h.len() == n * stride && col0 + neurons <= stride);
    let idx: Vec<u32> = (0..neurons as u32).collect();
    let bias = |i: u32| bias.map_or(0.0, |bb| bb[col0 + i as usize]);
    let (v, _) = listed_acts(k, view, &idx, x, n, act, threshold, bias)
        .expect("every neuron of the view, x sized to it (asserted)");
    for t in 0..n {
        h[t * stride + col0..t * stride + col0 + neurons]
            .copy_from_slice(&v[t * neurons..(t + 1) * neurons]);
    }
}

/// The hidden activations of the neurons `idx` of `view` for the `n` tokens of `x` (`n × m`,
/// token-major): `act(gate·x)` masked by `threshold` ([`sparse_act`]) times `up·x`, or, without
/// a gate, `act(up·x + bias(i))` masked; and the positions in `idx` whose up parts were read
/// (gated: those the mask leaves on for some token; without a gate: every one, it decides). The
/// whole FFN's op and the listed ops (cache units, hot neurons) all compute them here with the
/// same kernels, and the host decides a unit's active set with the same gate dots: a neuron's
/// activation, and so whether the mask keeps it, is the same bit for bit whichever op computes
/// it and whatever it is listed with.
#[allow(clippy::too_many_arguments)]
pub(crate) fn listed_acts(
    k: &Kernels,
    view: &Bundles,
    idx: &[u32],
    x: &[f32],
    n: usize,
    act: fn(f32) -> f32,
    threshold: f32,
    bias: impl Fn(u32) -> f32,
) -> Result<(Vec<f32>, Vec<usize>)> {
    let m = idx.len();
    let gated = view.shape().parts == 3;
    let mut v = vec![0f32; n * m];
    if gated {
        // The gate of every listed neuron, and in the same pass the up part of those the mask
        // leaves on for some token only: a neuron off for every token is not read further (the
        // device decides by reading the gate alone).
        let decide = |_: usize, _: usize, g: f32| sparse_act(act(g), threshold);
        let on = sparse_decide_up(k, FfnParts::Bundles(*view), idx, x, n, decide, &mut v)?;
        return Ok((v, on));
    }
    // The up part decides (and is all) without a gate: every listed neuron's.
    sparse_part_dots(k, view, idx, 0, x, n, &mut v)?;
    for (at, g) in v.iter_mut().enumerate() {
        *g = sparse_act(act(*g + bias(idx[at % m])), threshold);
    }
    Ok((v, (0..m).collect()))
}

impl super::CpuBackend {
    /// [`Backend::ffn_bundles_up_listed_from`], giving the positions in `idx` whose up parts it
    /// read (what the budgeted device counts crossing the link for neurons read in place); with
    /// `down` (the entries' ids and the output), [`Backend::ffn_bundles_listed_from`]: over a
    /// [`TiledList`], each tile group's down columns added in the same pass.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn listed_reading(
        &self,
        (b, rest): (&CpuWeight, Option<&CpuWeight>),
        shape: BundleShape,
        x: &CpuTensor,
        (act, threshold): (Act, f32),
        up_bias: Option<&CpuWeight>,
        idx: &[u32],
        h: &mut CpuTensor,
        down: Option<(&[u32], &mut CpuTensor)>,
    ) -> Result<Vec<usize>> {
        let op = "ffn_bundles_up_listed";
        let (n, m) = (x.rows, idx.len());
        if x.cols != shape.d || h.rows != n || m > h.cols {
            return Err(shape_err(
                op,
                format!(
                    "x {}x{}, {m} neurons into h {}x{}",
                    n, x.cols, h.rows, h.cols
                ),
            ));
        }
        if let Some((ids, out)) = &down
            && (out.cols != shape.d || out.rows != n || ids.len() != m)
        {
            return Err(shape_err(
                op,
                format!(
                    "{m} neurons ({} ids) into {}x{}",
                    ids.len(),
                    out.rows,
                    out.cols
                ),
            ));
        }
        if rest.is_some() && up_bias.is_some() {
            return Err(shape_err(
                op,
                "an up bias goes by slot: none with a rest".into(),
            ));
        }
        let bias = up_bias.map(|bb| vector(op, bb, b.rows())).transpose()?;
        let f = ops::activation(act);
        let bias = |i: u32| bias.map_or(0.0, |bb| bb[i as usize]);
        let fill = |h: &mut CpuTensor, v: &[f32]| {
            let stride = h.cols;
            for t in 0..n {
                h.data[t * stride..t * stride + m].copy_from_slice(&v[t * m..(t + 1) * m]);
            }
        };
        if let Some(list) = tiled_list(b, op, shape, rest)? {
            let mut v = vec![0f32; n * m];
            let decide = |_: usize, _: usize, g: f32| sparse_act(f(g), threshold);
            // Without a down side the ids only size the check.
            let (ids, out) = match down {
                Some((ids, out)) => (ids, Some(&mut out.data[..])),
                None => (idx, None),
            };
            let k = self.kernels;
            let on = self
                .pool
                .install(|| tiled_ffn(k, list, (idx, ids), &x.data, n, decide, &mut v, out))?;
            fill(h, &v);
            return Ok(on);
        }
        let (v, live) = with_listed(b, op, shape, rest, |view| {
            self.pool
                .install(|| listed_acts(self.kernels, view, idx, &x.data, n, f, threshold, bias))
        })??;
        fill(h, &v);
        if let Some((ids, out)) = down {
            use crate::backend::Backend;
            self.ffn_bundles_down_listed_from((b, rest), shape, h, (idx, ids), out)?;
        }
        Ok(live)
    }
}

/// `out[t] += Σ_i h[t·stride + col0 + i] · down_i` (out is `n × d`) over every neuron of `view`,
/// row `i` being neuron `col0 + i`: [`sparse_down`](super::sparse::sparse_down) over all of
/// them, in the one order of [`DOWN_BLOCK`](super::sparse::DOWN_BLOCK)s, so each token's result
/// is the same bit for bit whatever the threads do, and the same as a cache unit's or the cold
/// pass's over the neurons a token needs (a neuron whose activation is zero adds nothing). Sums
/// added in the order work-stealing finished them made two runs of one command differ (SmolLM2
/// bundled: 1.5e-2 of the logit scale over 9 tokens, its 8-bit activations amplifying the last
/// bits).
pub fn down_view(
    k: &Kernels,
    view: &Bundles,
    h: &[f32],
    n: usize,
    stride: usize,
    col0: usize,
    out: &mut [f32],
) {
    let neurons = view.neurons();
    let d = view.shape().d;
    assert!(h.len() == n * stride && col0 + neurons <= stride && out.len() == n * d);
    let idx: Vec<u32> = (0..neurons as u32).collect();
    // The rows' ids from `col0` (a run of the layer's neurons from its first).
    let ids: Vec<u32> = (col0 as u32..(col0 + neurons) as u32).collect();
    let compact: Vec<f32> = (0..n)
        .flat_map(|t| {
            h[t * stride + col0..t * stride + col0 + neurons]
                .iter()
                .copied()
        })
        .collect();
    sparse_down_split(k, view, (&idx, &ids), &compact, n, out, DownSplit::Output)
        .expect("every neuron of the view, h and out sized to it (asserted)");
}

/// Reference f16 bundle builder for tests: gate/up rows and down columns → bundle bytes.
#[cfg(test)]
pub fn make_bundles(gate: Option<&[f32]>, up: &[f32], down_t: &[f32], d: usize) -> HostTensor {
    let neurons = up.len() / d;
    let parts = if gate.is_some() { 3 } else { 2 };
    let mut v = Vec::with_capacity(neurons * parts * d);
    for i in 0..neurons {
        if let Some(g) = gate {
            v.extend(&g[i * d..(i + 1) * d]);
        }
        v.extend(&up[i * d..(i + 1) * d]);
        v.extend(&down_t[i * d..(i + 1) * d]);
    }
    let h: Vec<half::f16> = v.iter().map(|&x| half::f16::from_f32(x)).collect();
    HostTensor {
        name: "bundles".into(),
        rows: neurons,
        cols: parts * d,
        dtype: crate::tensor::DType::F16,
        data: crate::tensor::Bytes::from_slice(bytemuck::cast_slice(&h)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::{CpuBackend, CpuTensor};
    use crate::backend::{Act, Backend};
    use rand::{RngExt, SeedableRng, rngs::StdRng};

    fn f16_round(v: &[f32]) -> Vec<f32> {
        v.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect()
    }

    /// Split bundles (two runs of neurons) equal the dense FFN on the same f16 weights.
    #[test]
    fn bundled_ffn_equals_dense_ffn() {
        let mut rng = StdRng::seed_from_u64(5);
        let (d, ff) = (64, 96);
        let mut r = |n: usize| {
            f16_round(
                &(0..n)
                    .map(|_| rng.random_range(-0.3f32..0.3))
                    .collect::<Vec<_>>(),
            )
        };
        let (gate, up, down_t) = (r(ff * d), r(ff * d), r(ff * d));
        let be = CpuBackend::new(2).unwrap();
        for gated in [true, false] {
            for n in [1usize, 5] {
                let x: Vec<f32> = (0..n * d)
                    .map(|i| ((i * 7 % 13) as f32 - 6.0) / 6.0)
                    .collect();
                let bias: Vec<f32> = (0..ff).map(|i| (i as f32 - 48.0) / 100.0).collect();
                // Dense reference in f64.
                let mut want = vec![0f64; n * d];
                for t in 0..n {
                    for i in 0..ff {
                        let dot = |w: &[f32]| -> f64 {
                            (0..d)
                                .map(|j| w[i * d + j] as f64 * x[t * d + j] as f64)
                                .sum()
                        };
                        let h = if gated {
                            let g = dot(&gate);
                            g / (1.0 + (-g).exp()) * dot(&up)
                        } else {
                            (dot(&up) + bias[i] as f64).max(0.0)
                        };
                        for j in 0..d {
                            want[t * d + j] += h * down_t[i * d + j] as f64;
                        }
                    }
                }
                let shape = BundleShape {
                    parts: if gated { 3 } else { 2 },
                    d,
                };
                let bundles = make_bundles(gated.then_some(&gate[..]), &up, &down_t, d);
                // Two runs: neurons 0..40 and 40..96, as a resident part and a streamed part.
                let split = |lo: usize, hi: usize| {
                    let rb = bundles.row_bytes();
                    HostTensor {
                        name: "part".into(),
                        rows: hi - lo,
                        cols: bundles.cols,
                        dtype: bundles.dtype,
                        data: crate::tensor::Bytes::from_slice(
                            &bundles.data.as_slice()[lo * rb..hi * rb],
                        ),
                    }
                };
                let (a, b) = (
                    be.upload(&split(0, 40)).unwrap(),
                    be.upload(&split(40, ff)).unwrap(),
                );
                let xt = CpuTensor {
                    rows: n,
                    cols: d,
                    data: x.clone(),
                    capacity: n * d,
                };
                let mut h = be.alloc(n, ff).unwrap();
                let act = if gated { Act::Silu } else { Act::Relu };
                let bias_t = be
                    .upload(&HostTensor::from_f32("b", 1, ff, bias.clone()))
                    .unwrap();
                let bias_ref = (!gated).then_some(&bias_t);
                be.ffn_bundles_up(&a, shape, &xt, act, 0.0, bias_ref, &mut h, 0)
                    .unwrap();
                be.ffn_bundles_up(&b, shape, &xt, act, 0.0, bias_ref, &mut h, 40)
                    .unwrap();
                let mut out = be.alloc(n, d).unwrap();
                be.ffn_bundles_down(&a, shape, &h, 0, &mut out).unwrap();
                be.ffn_bundles_down(&b, shape, &h, 40, &mut out).unwrap();
                for (o, w) in out.data.iter().zip(&want) {
                    assert!(
                        (*o as f64 - w).abs() < 1e-4 * (1.0 + w.abs()),
                        "gated {gated} n {n}: {o} vs {w}"
                    );
                }
            }
        }
    }
}
