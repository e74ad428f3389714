//! The bundled FFN on the CPU: neuron i's gate row, up row and down column stored side by side
//! (see `store`). `up` computes the hidden activations of a run of neurons, `down` adds their
//! weighted down columns to the output. Every bundle encoding (f32, f16, bf16, INT8, INT4; the
//! decoders are `sparse`'s); each bundle is read once.

use rayon::prelude::*;

use super::kernels::Kernels;
use super::sparse::{Bundles, bundle_axpy, bundle_dot};
use crate::backend::{BundleShape, Result, sparse_act};
use crate::store::Encoding;
use crate::tensor::{Bytes, HostTensor};

/// Neurons per parallel task.
const NEURONS_PER_TASK: usize = 64;

#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: tasks write disjoint cells (see the callers).
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    fn at(self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }
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
/// for every neuron `i` of `view`, in any bundle encoding.
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
    let shape = view.shape();
    let d = shape.d;
    assert!(x.len() == n * d && h.len() == n * stride && col0 + neurons <= stride);
    let gated = shape.parts == 3;
    let ptr = OutPtr(h.as_mut_ptr());
    let tasks = neurons.div_ceil(NEURONS_PER_TASK);
    let task = |task: usize| {
        let i1 = ((task + 1) * NEURONS_PER_TASK).min(neurons);
        for i in task * NEURONS_PER_TASK..i1 {
            for t in 0..n {
                let xt = &x[t * d..(t + 1) * d];
                let u = bundle_dot(k, view, i, if gated { 1 } else { 0 }, xt);
                let v = if gated {
                    sparse_act(act(bundle_dot(k, view, i, 0, xt)), threshold) * u
                } else {
                    sparse_act(act(u + bias.map_or(0.0, |bb| bb[col0 + i])), threshold)
                };
                // SAFETY: neuron i belongs to this task only; index < n·stride (asserted).
                unsafe { *ptr.at(t * stride + col0 + i) = v };
            }
        }
    };
    if tasks <= 1 {
        (0..tasks).for_each(task);
    } else {
        (0..tasks).into_par_iter().for_each(task);
    }
}

/// `out[t] += Σ_i h[t·stride + col0 + i] · down_i` (out is `n × d`) over every neuron of `view`.
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
    let shape = view.shape();
    let d = shape.d;
    assert!(h.len() == n * stride && col0 + neurons <= stride && out.len() == n * d);
    let down_part = shape.parts - 1;
    // Each task sums a run of neurons into its own accumulator; the accumulators are added at
    // the end (cheap next to reading the bundles, which each task streams contiguously).
    let tasks = neurons.div_ceil(NEURONS_PER_TASK);
    let partial = |task: usize, acc: &mut [f32]| {
        let i1 = ((task + 1) * NEURONS_PER_TASK).min(neurons);
        for i in task * NEURONS_PER_TASK..i1 {
            for t in 0..n {
                let w = h[t * stride + col0 + i];
                if w != 0.0 {
                    bundle_axpy(k, view, i, down_part, w, &mut acc[t * d..(t + 1) * d]);
                }
            }
        }
    };
    let sum = (0..tasks)
        .into_par_iter()
        .fold(
            || vec![0f32; n * d],
            |mut acc, t| {
                partial(t, &mut acc);
                acc
            },
        )
        .reduce(
            || vec![0f32; n * d],
            |mut a, b| {
                a.iter_mut().zip(&b).for_each(|(x, y)| *x += y);
                a
            },
        );
    out.iter_mut().zip(&sum).for_each(|(o, s)| *o += s);
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
