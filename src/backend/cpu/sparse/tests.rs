//! The bundle operators (up, part dots, down) against the dense bundle kernels on masked
//! activations and against one vector at a time; bad inputs of every operator; and the helpers
//! the matrix operators' tests share.

use half::{bf16, f16};
use rand::seq::SliceRandom;
use rand::{RngExt, SeedableRng, rngs::StdRng};

use super::super::{bundles, kernels};
use super::vector::ops;
use super::*;
use crate::backend::BundleShape;
use crate::backend::bundle_tests::ENCODINGS;
use crate::backend::cpu::kernels::Kernels;
use crate::store::Encoding;
use crate::store::quant::{INT4_GROUP, dequant_int4_row, dequant_int8_row, int4_row, int8_row};
use crate::tensor::{Bytes, DType, HostTensor};

// Tolerance. For float bundles `sparse_up` runs the dense kernel on the same row and
// activations, so it matches exactly; INT8/INT4 differ from the dequantized-f32 oracle by
// one rounding per product (`s·(q·x)` against `(s·q)·x`). The down sums add the same terms
// in another association than the oracle's chain (blocks of ids): reassociating a sum of N terms
// moves it by at most about N·ε·Σ|terms| (ε = 2⁻²⁴), and N ≤ 200 here, so every check is
// `|got − want| ≤ 2e-5 · Σ|terms|`, Σ|terms| computed in f64 from the oracle's values.
pub(super) const REL: f64 = 2e-5;

pub(super) fn rand_vec(rng: &mut StdRng, n: usize, r: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-r..r)).collect()
}

/// Zero about half of each token's activations (each token its own), then check that
/// every token's row of `call` over all `n` tokens is, bit for bit, its row of `call` over
/// that token alone listing only its non-zero neurons (in the same order). `call(idx, h,
/// n, out)` adds into `out` (`n × width`, starting from `out0`).
pub(super) fn each_token_as_alone(
    rng: &mut StdRng,
    idx: &[u32],
    h: &[f32],
    n: usize,
    out0: &[f32],
    what: &str,
    call: impl Fn(&[u32], &[f32], usize, &mut [f32]),
) {
    let (m, width) = (idx.len(), out0.len() / n);
    let h: Vec<f32> = h
        .iter()
        .map(|&v| if rng.random_bool(0.5) { 0.0 } else { v })
        .collect();
    let mut all = out0.to_vec();
    call(idx, &h, n, &mut all);
    for t in 0..n {
        let own: Vec<usize> = (0..m).filter(|&j| h[t * m + j] != 0.0).collect();
        let idx_t: Vec<u32> = own.iter().map(|&j| idx[j]).collect();
        let h_t: Vec<f32> = own.iter().map(|&j| h[t * m + j]).collect();
        let mut alone = out0[t * width..(t + 1) * width].to_vec();
        call(&idx_t, &h_t, 1, &mut alone);
        assert!(
            alone == all[t * width..(t + 1) * width],
            "{what}: token {t} of {n} differs from alone"
        );
    }
}

/// [`each_token_as_alone`] for [`sparse_down_split`], over the list in ascending order (as the
/// engine lists neurons: in another order, the neurons other tokens need may cut a token's
/// blocks of ids into more runs than its own list does).
fn down_as_alone(
    rng: &mut StdRng,
    k: &Kernels,
    b: &Bundles,
    (idx, h, n): (&[u32], &[f32], usize),
    out0: &[f32],
    what: &str,
    split: DownSplit,
) {
    let m = idx.len();
    let mut order: Vec<usize> = (0..m).collect();
    order.sort_by_key(|&j| idx[j]);
    let idx: Vec<u32> = order.iter().map(|&j| idx[j]).collect();
    let h: Vec<f32> = (0..n)
        .flat_map(|t| order.iter().map(move |&j| h[t * m + j]))
        .collect();
    each_token_as_alone(rng, &idx, &h, n, out0, what, |i, h, n, o| {
        sparse_down_split(k, b, (i, i), h, n, o, split).unwrap();
    });
}

/// A random list of `frac` of `neurons`, in random order, without duplicates.
pub(super) fn rand_idx(rng: &mut StdRng, neurons: usize, frac: f64) -> Vec<u32> {
    let mut all: Vec<u32> = (0..neurons as u32).collect();
    all.shuffle(rng);
    all.truncate((neurons as f64 * frac).round() as usize);
    all
}

/// What the encoding stores, as f32 (the oracle's weights).
fn roundtrip(v: &[f32], enc: Encoding) -> Vec<f32> {
    let mut out = vec![0f32; v.len()];
    match enc {
        Encoding::Format(DType::F32) => out.copy_from_slice(v),
        Encoding::Format(DType::F16) => {
            out.iter_mut()
                .zip(v)
                .for_each(|(o, x)| *o = f16::from_f32(*x).to_f32());
        }
        Encoding::Format(DType::BF16) => {
            out.iter_mut()
                .zip(v)
                .for_each(|(o, x)| *o = bf16::from_f32(*x).to_f32());
        }
        Encoding::Int8 => {
            let (s, q) = int8_row(v);
            dequant_int8_row(s, &q, &mut out);
        }
        Encoding::Int4 => {
            let (s, q) = int4_row(v);
            dequant_int4_row(&s, &q, &mut out);
        }
        Encoding::Format(_) => unreachable!(),
    }
    out
}

/// A random layer: the store's bytes in `enc`, and the oracle: the same values as f32
/// bundles for the dense kernels.
struct Layer {
    bytes: Vec<u8>,
    oracle: HostTensor,
    /// The oracle's down columns, neuron-major.
    down: Vec<f32>,
    shape: BundleShape,
}

fn layer(rng: &mut StdRng, enc: Encoding, gated: bool, neurons: usize, d: usize) -> Layer {
    let gate = gated.then(|| rand_vec(rng, neurons * d, 0.5));
    let up = rand_vec(rng, neurons * d, 0.5);
    let down = rand_vec(rng, neurons * d, 0.5);
    let bytes = crate::store::encode_bundles(gate.as_deref(), &up, &down, d, enc);
    // Per bundle part, as the store quantizes them.
    let rt = |v: &[f32]| -> Vec<f32> { v.chunks(d).flat_map(|r| roundtrip(r, enc)).collect() };
    let (gate, up, down) = (gate.as_deref().map(rt), rt(&up), rt(&down));
    let f = crate::store::encode_bundles(gate.as_deref(), &up, &down, d, Encoding::F32);
    let parts = if gated { 3 } else { 2 };
    Layer {
        bytes,
        oracle: HostTensor {
            name: "oracle".into(),
            rows: neurons,
            cols: parts * d,
            dtype: DType::F32,
            data: Bytes::from_slice(&f),
        },
        down,
        shape: BundleShape { parts, d },
    }
}

impl Layer {
    /// Part `p` of every bundle, one row a neuron (a float layer's parts taken apart, as
    /// hybrid's cold neurons hold them).
    fn part_rows(&self, p: usize, dtype: DType) -> HostTensor {
        let (parts, d) = (self.shape.parts, self.shape.d);
        let neurons = self.oracle.rows;
        let part = self.bytes.len() / neurons / parts;
        HostTensor {
            name: format!("part {p}"),
            rows: neurons,
            cols: d,
            dtype,
            data: aligned(
                &self
                    .bytes
                    .chunks(parts * part)
                    .flat_map(|row| &row[p * part..(p + 1) * part])
                    .copied()
                    .collect::<Vec<u8>>(),
            ),
        }
    }
}

/// The layer shapes (gated, neurons, d) the operators are checked on: a tail of rows past the
/// groups of four, an ungated layer, a width with a column tail.
const SHAPES: [(bool, usize, usize); 3] = [(true, 173, 96), (false, 61, 160), (true, 40, 71)];

/// Aligned copy (a `Vec<u8>` promises no alignment; the store's map and `Bytes` do).
fn aligned(bytes: &[u8]) -> Bytes {
    Bytes::from_slice(bytes)
}

pub(super) fn kernel_sets() -> Vec<&'static Kernels> {
    let mut v = vec![kernels::best()];
    if v[0].name != kernels::PORTABLE.name {
        v.push(&kernels::PORTABLE);
    }
    v
}

#[test]
fn bundles_equal_dense_with_masked_h() {
    let mut rng = StdRng::seed_from_u64(11);
    let silu: fn(f32) -> f32 = |x| x / (1.0 + (-x).exp());
    let relu: fn(f32) -> f32 = |x| x.max(0.0);
    for k in kernel_sets() {
        for enc in ENCODINGS {
            for (gated, neurons, d) in SHAPES {
                if enc == Encoding::Int4 && !d.is_multiple_of(INT4_GROUP) {
                    continue;
                }
                let l = layer(&mut rng, enc, gated, neurons, d);
                let bytes = aligned(&l.bytes);
                let b = Bundles::new(bytes.as_slice(), enc, l.shape).unwrap();
                assert_eq!(b.neurons(), neurons);
                let act = if gated { silu } else { relu };
                let bias = rand_vec(&mut rng, neurons, 0.3);
                let bias = (!gated).then_some(&bias[..]);
                for n in [1usize, 3] {
                    let x = rand_vec(&mut rng, n * d, 1.0);
                    // Dense oracle: every neuron's h.
                    let mut hd = vec![0f32; n * neurons];
                    bundles::up(
                        k, &l.oracle, l.shape, &x, n, act, 0.0, bias, &mut hd, neurons, 0,
                    );
                    for frac in [0.0, 0.1, 0.5, 1.0] {
                        let what = format!("{} {enc:?} gated {gated} n {n} {frac}", k.name);
                        let idx = rand_idx(&mut rng, neurons, frac);
                        let m = idx.len();
                        let mut h = vec![f32::NAN; n * m];
                        sparse_up(k, &b, &idx, &x, n, act, bias, &mut h).unwrap();
                        for t in 0..n {
                            for (j, &i) in idx.iter().enumerate() {
                                let (got, want) = (h[t * m + j], hd[t * neurons + i as usize]);
                                let tol = 1e-5 * (1.0 + want.abs());
                                assert!((got - want).abs() <= tol, "{what}: h {got} vs {want}");
                            }
                        }
                        // Down: the dense kernel on h masked to the listed neurons.
                        let mut masked = vec![0f32; n * neurons];
                        for t in 0..n {
                            for (j, &i) in idx.iter().enumerate() {
                                masked[t * neurons + i as usize] = h[t * m + j];
                            }
                        }
                        let out0 = rand_vec(&mut rng, n * d, 1.0);
                        let mut want = out0.clone();
                        bundles::down(k, &l.oracle, l.shape, &masked, n, neurons, 0, &mut want);
                        for split in [DownSplit::Output, DownSplit::Partials] {
                            let w = format!("{what} {split:?}");
                            down_as_alone(&mut rng, k, &b, (&idx, &h, n), &out0, &w, split);
                            let mut got = out0.clone();
                            sparse_down_split(k, &b, (&idx, &idx), &h, n, &mut got, split).unwrap();
                            for t in 0..n {
                                for c in 0..d {
                                    let mag: f64 = out0[t * d + c].abs() as f64
                                        + idx
                                            .iter()
                                            .enumerate()
                                            .map(|(j, &i)| {
                                                (h[t * m + j] * l.down[i as usize * d + c]).abs()
                                                    as f64
                                            })
                                            .sum::<f64>();
                                    let (g, w) = (got[t * d + c], want[t * d + c]);
                                    assert!(
                                        ((g - w).abs() as f64) <= REL * mag + 1e-30,
                                        "{what} {split:?} [{t},{c}]: {g} vs {w}"
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The grouped (four-row) paths against one row at a time: short lists of every length
/// around the group size, repeats, zero weights, several tokens, row lengths with tails.
/// f16 bundles' part dots equal the dense kernel's dot of the same row bit for bit (lengths
/// with and without tails): a neuron's deciding dot, and so whether the mask keeps it, is the
/// same from four interleaved bundle rows (the listed and sparse operators) as from one row of
/// a contiguous matrix (hybrid's deciding rows).
#[test]
fn f16_part_dots_equal_the_dense_dot_bit_for_bit() {
    let mut rng = StdRng::seed_from_u64(23);
    for k in kernel_sets() {
        let o = ops(k);
        for d in [8usize, 40, 77, 224, 576] {
            let neurons = 11;
            let l = layer(&mut rng, Encoding::F16, true, neurons, d);
            let bytes = aligned(&l.bytes);
            let b = Bundles::new(bytes.as_slice(), Encoding::F16, l.shape).unwrap();
            let idx: Vec<u32> = (0..neurons as u32).rev().collect();
            for n in [1usize, 3] {
                let x = rand_vec(&mut rng, n * d, 1.0);
                for p in 0..l.shape.parts {
                    let mut v = vec![f32::NAN; n * neurons];
                    sparse_part_dots(k, &b, &idx, p, &x, n, &mut v).unwrap();
                    for t in 0..n {
                        for (j, &i) in idx.iter().enumerate() {
                            let want = b.part(i as usize, p).dot(k, o, &x[t * d..(t + 1) * d]);
                            assert_eq!(
                                v[t * neurons + j].to_bits(),
                                want.to_bits(),
                                "{} d {d} part {p} neuron {i} token {t}",
                                k.name
                            );
                        }
                    }
                }
            }
        }
    }
}

/// A float layer's bundles taken apart into one matrix per part (hybrid's cold neurons) compute
/// as the bundles did, bit for bit: each part's dots, and the down sums, through
/// [`Bundles::of_rows`]; other formats and ragged data are refused.
#[test]
fn rows_taken_apart_compute_as_their_bundles() {
    let mut rng = StdRng::seed_from_u64(29);
    for k in kernel_sets() {
        for (enc, dtype) in [(Encoding::F16, DType::F16), (Encoding::F32, DType::F32)] {
            let (neurons, d) = (37usize, 77usize);
            let l = layer(&mut rng, enc, true, neurons, d);
            let bytes = aligned(&l.bytes);
            let b = Bundles::new(bytes.as_slice(), enc, l.shape).unwrap();
            let matrix = |p: usize| l.part_rows(p, dtype);
            let idx = rand_idx(&mut rng, neurons, 0.7);
            let m = idx.len();
            for n in [1usize, 3] {
                let x = rand_vec(&mut rng, n * d, 1.0);
                for p in 0..3 {
                    let rows = matrix(p);
                    let apart = Bundles::of_rows(&rows).unwrap();
                    let (mut want, mut got) = (vec![0f32; n * m], vec![1f32; n * m]);
                    sparse_part_dots(k, &b, &idx, p, &x, n, &mut want).unwrap();
                    sparse_part_dots(k, &apart, &idx, 0, &x, n, &mut got).unwrap();
                    assert_eq!(want, got, "{} {dtype} part {p}, {n} tokens", k.name);
                }
                let h = rand_vec(&mut rng, n * m, 1.0);
                let out0 = rand_vec(&mut rng, n * d, 1.0);
                let (mut want, mut got) = (out0.clone(), out0);
                sparse_down(k, &b, (&idx, &idx), &h, n, &mut want).unwrap();
                let downs = matrix(2);
                sparse_down(
                    k,
                    &Bundles::of_rows(&downs).unwrap(),
                    (&idx, &idx),
                    &h,
                    n,
                    &mut got,
                )
                .unwrap();
                assert_eq!(want, got, "{} {dtype} down, {n} tokens", k.name);
            }
        }
    }
    // Blocks are not floats; 30 bytes are not two rows of eight f16.
    for (dtype, cols, len, why) in [
        (DType::Q8_0, 32usize, 34usize, "not floats"),
        (DType::F16, 8, 30, "aligned rows"),
    ] {
        let t = HostTensor {
            name: "refused".into(),
            rows: len.div_ceil(cols),
            cols,
            dtype,
            data: aligned(&vec![0u8; len]),
        };
        let e = Bundles::of_rows(&t).unwrap_err().to_string();
        assert!(e.contains(why), "{e}");
    }
}

#[test]
fn grouped_paths_equal_per_row() {
    let mut rng = StdRng::seed_from_u64(17);
    let id: fn(f32) -> f32 = |x| x;
    for k in kernel_sets() {
        let o = ops(k);
        for enc in ENCODINGS {
            for (gated, d) in [(true, 224usize), (false, 224), (true, 77), (false, 77)] {
                if enc == Encoding::Int4 && !d.is_multiple_of(INT4_GROUP) {
                    continue;
                }
                let neurons = 23;
                let l = layer(&mut rng, enc, gated, neurons, d);
                let bytes = aligned(&l.bytes);
                let b = Bundles::new(bytes.as_slice(), enc, l.shape).unwrap();
                let parts = l.shape.parts;
                for m in 1..=10usize {
                    // With repeats: a neuron listed twice counts twice.
                    let idx: Vec<u32> = (0..m)
                        .map(|_| rng.random_range(0..neurons as u32))
                        .collect();
                    for n in [1usize, 2, 4] {
                        let what = format!("{} {enc:?} gated {gated} d {d} m {m} n {n}", k.name);
                        let x = rand_vec(&mut rng, n * d, 1.0);
                        let row = |i: usize, p: usize, t: usize| {
                            b.part(i, p).dot(k, o, &x[t * d..(t + 1) * d])
                        };
                        let close = |g: f32, w: f32, mag: f32| {
                            assert!((g - w).abs() <= 1e-5 * (1.0 + mag), "{what}: {g} vs {w}");
                        };
                        let mut h = vec![f32::NAN; n * m];
                        sparse_up(k, &b, &idx, &x, n, id, None, &mut h).unwrap();
                        for p in 0..parts {
                            let mut v = vec![f32::NAN; n * m];
                            sparse_part_dots(k, &b, &idx, p, &x, n, &mut v).unwrap();
                            for t in 0..n {
                                for (j, &i) in idx.iter().enumerate() {
                                    let want = row(i as usize, p, t);
                                    close(v[t * m + j], want, want.abs());
                                }
                            }
                        }
                        for t in 0..n {
                            for (j, &i) in idx.iter().enumerate() {
                                let i = i as usize;
                                let want = if gated {
                                    row(i, 0, t) * row(i, 1, t)
                                } else {
                                    row(i, 0, t)
                                };
                                close(h[t * m + j], want, want.abs());
                            }
                        }
                        // Zero weights for some neurons (all tokens) and some cells.
                        for (c, v) in h.iter_mut().enumerate() {
                            if c % m % 3 == 1 || c % 5 == 2 {
                                *v = 0.0;
                            }
                        }
                        let out0 = rand_vec(&mut rng, n * d, 1.0);
                        let mut by_split = Vec::new();
                        for split in [DownSplit::Output, DownSplit::Partials] {
                            let w = format!("{what} {split:?}");
                            down_as_alone(&mut rng, k, &b, (&idx, &h, n), &out0, &w, split);
                            let mut got = out0.clone();
                            sparse_down_split(k, &b, (&idx, &idx), &h, n, &mut got, split).unwrap();
                            by_split.push(got.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
                            for t in 0..n {
                                let mut want = out0[t * d..(t + 1) * d].to_vec();
                                let mut mag = 0f32;
                                for (j, &i) in idx.iter().enumerate() {
                                    let a = h[t * m + j];
                                    b.part(i as usize, parts - 1).axpy(o, a, &mut want);
                                    mag += a.abs();
                                }
                                for c in 0..d {
                                    close(got[t * d + c], want[c], mag + want[c].abs());
                                }
                            }
                        }
                        // One order of blocks of ids, however the threads share the work.
                        assert_eq!(by_split[0], by_split[1], "{what}: the two splits");
                    }
                }
            }
        }
    }
}

/// The output-column split gives the same bits on any number of threads: each output is summed
/// in the one order of blocks of ids whichever task owns its column (576 columns: one task,
/// two of 288, three of 256/256/64), f16 and INT4, 1 and 3 tokens.
#[test]
fn down_split_by_columns_is_the_same_on_any_threads() {
    let mut rng = StdRng::seed_from_u64(29);
    let (neurons, d) = (40, 576);
    for k in kernel_sets() {
        for enc in [Encoding::F16, Encoding::Int4] {
            let l = layer(&mut rng, enc, true, neurons, d);
            let bytes = aligned(&l.bytes);
            let b = Bundles::new(bytes.as_slice(), enc, l.shape).unwrap();
            let idx = rand_idx(&mut rng, neurons, 0.8);
            for n in [1usize, 3] {
                let h = rand_vec(&mut rng, n * idx.len(), 1.0);
                let out0 = rand_vec(&mut rng, n * d, 1.0);
                let on = |threads: usize| {
                    let pool = rayon::ThreadPoolBuilder::new()
                        .num_threads(threads)
                        .build()
                        .unwrap();
                    let mut out = out0.clone();
                    pool.install(|| sparse_down(k, &b, (&idx, &idx), &h, n, &mut out))
                        .unwrap();
                    out
                };
                let one = on(1);
                for threads in [2, 3] {
                    let got = on(threads);
                    assert!(
                        got.iter()
                            .zip(&one)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{} {enc:?} {n} tokens: {threads} threads differ from one",
                        k.name
                    );
                }
            }
        }
    }
}

#[test]
fn bad_inputs_are_errors() {
    let mut rng = StdRng::seed_from_u64(3);
    let shape = BundleShape { parts: 3, d: 64 };
    let l = layer(&mut rng, Encoding::Int8, true, 10, 64);
    assert!(Bundles::new(&l.bytes[1..], Encoding::Int8, shape).is_err());
    assert!(Bundles::new(&l.bytes, Encoding::Format(DType::Q4_0), shape).is_err());
    let odd = BundleShape { parts: 3, d: 48 };
    assert!(Bundles::new(&[], Encoding::Int4, odd).is_err());
    let b = Bundles::new(&l.bytes, Encoding::Int8, shape).unwrap();
    let k = kernels::best();
    let x = vec![0f32; 64];
    let mut h = vec![0f32; 1];
    let relu: fn(f32) -> f32 = |x| x.max(0.0);
    assert!(sparse_up(k, &b, &[10], &x, 1, relu, None, &mut h).is_err());
    assert!(sparse_up(k, &b, &[9], &x[1..], 1, relu, None, &mut h).is_err());
    let mut out = vec![0f32; 64];
    assert!(sparse_down(k, &b, (&[9, 1], &[9, 1]), &h, 1, &mut out).is_err());
    let w = HostTensor::from_f32("w", 4, 8, vec![0.0; 32]);
    assert!(sparse_rows(k, &w, &[4], &x[..8], 1, &mut h).is_err());
    assert!(sparse_down_blocks(k, &w, &[8], &h, 1, &mut out[..4]).is_err());
}

/// The decision and the up side in one pass ([`sparse_decide_up`]) against the two it replaces
/// (the deciding part's dots, then the up dots of what the decision leaves on), in every
/// encoding, gated or not, whole bundles or taken apart, lists in random order, 1 and 3 tokens,
/// each token its own mask: the same values bit for bit, the same neurons on. (The modes' parity
/// on profiled SwiGLU models rests on those bits: a threshold flips neurons on a rounding.) The
/// down side in the same pass too ([`whole_ffn_in_one_pass`]).
#[test]
fn decide_and_up_in_one_pass_equal_two_passes_bit_for_bit() {
    let mut rng = StdRng::seed_from_u64(31);
    let silu: fn(f32) -> f32 = |x| x / (1.0 + (-x).exp());
    for k in kernel_sets() {
        for enc in ENCODINGS {
            for (gated, neurons, d) in SHAPES {
                if enc == Encoding::Int4 && !d.is_multiple_of(INT4_GROUP) {
                    continue;
                }
                let l = layer(&mut rng, enc, gated, neurons, d);
                let bytes = aligned(&l.bytes);
                let b = Bundles::new(bytes.as_slice(), enc, l.shape).unwrap();
                // Each part in rows of its own (floats only: INT8/INT4 parts carry their
                // scales in the bundle's head).
                let apart: Vec<HostTensor> = match enc.dtype() {
                    Some(dtype) => (0..l.shape.parts).map(|p| l.part_rows(p, dtype)).collect(),
                    None => Vec::new(),
                };
                let mut layouts = vec![("whole bundles", FfnParts::Bundles(b))];
                if !apart.is_empty() {
                    let r = |p: usize| Bundles::of_rows(&apart[p]).unwrap();
                    let parts = FfnParts::Apart {
                        decide: r(0),
                        up: gated.then(|| r(1)),
                        down: Some(r(l.shape.parts - 1)),
                    };
                    layouts.push(("apart", parts));
                }
                for n in [1usize, 3] {
                    let x = rand_vec(&mut rng, n * d, 1.0);
                    let idx = rand_idx(&mut rng, neurons, 0.8);
                    let m = idx.len();
                    let on: Vec<bool> = (0..n * m).map(|_| rng.random_bool(0.3)).collect();
                    let bias = rand_vec(&mut rng, neurons, 0.3);
                    // The decision: the activation (the ungated up row with its bias), zero
                    // where the token's mask leaves the neuron off.
                    let decide = |j: usize, t: usize, v: f32| {
                        let v = if gated { v } else { v + bias[idx[j] as usize] };
                        if on[t * m + j] { silu(v) } else { 0.0 }
                    };
                    // The two passes.
                    let mut want = vec![0f32; n * m];
                    sparse_part_dots(k, &b, &idx, 0, &x, n, &mut want).unwrap();
                    for t in 0..n {
                        for j in 0..m {
                            want[t * m + j] = decide(j, t, want[t * m + j]);
                        }
                    }
                    let live: Vec<usize> = (0..m)
                        .filter(|&j| (0..n).any(|t| want[t * m + j] != 0.0))
                        .collect();
                    assert!(!live.is_empty() && live.len() < m, "some on, some off");
                    if gated {
                        let listed: Vec<u32> = live.iter().map(|&j| idx[j]).collect();
                        let mut u = vec![0f32; n * live.len()];
                        sparse_part_dots(k, &b, &listed, 1, &x, n, &mut u).unwrap();
                        for t in 0..n {
                            for (a, &j) in live.iter().enumerate() {
                                want[t * m + j] *= u[t * live.len() + a];
                            }
                        }
                    }
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    for (layout, parts) in &layouts {
                        let what = format!("{} {enc:?} gated {gated} n {n} {layout}", k.name);
                        let mut got = vec![f32::NAN; n * m];
                        let got_on =
                            sparse_decide_up(k, *parts, &idx, &x, n, decide, &mut got).unwrap();
                        assert_eq!(got_on, live, "{what}");
                        assert_eq!(bits(&got), bits(&want), "{what}");
                        whole_ffn_in_one_pass(k, (*parts, &b), (&idx, &x, n), decide, &want, &what);
                    }
                }
            }
        }
    }
}

/// [`sparse_ffn`] over `parts` (the bundles `b` or their parts taken apart) against
/// [`sparse_decide_up`]'s values `want` (`n × m`) and [`sparse_down`] over them: the same
/// values bit for bit, the same sum from a sum already under way (bit for bit where the list
/// ascends, as every list the engine makes does; within rounding where a list in random order
/// cuts its blocks of ids differently once the neurons off are left out). Over the list in
/// ascending order, each token's sum is bit for bit its sum alone over the neurons on for it
/// (the others' add exact zeros within the same blocks of ids), and bit for bit the sum of the
/// neurons on over the whole list (the dense order).
fn whole_ffn_in_one_pass(
    k: &Kernels,
    (parts, b): (FfnParts, &Bundles),
    (idx, x, n): (&[u32], &[f32], usize),
    decide: impl Fn(usize, usize, f32) -> f32 + Sync,
    want: &[f32],
    what: &str,
) {
    let (m, d) = (idx.len(), b.shape.d);
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    let live: Vec<usize> = (0..m)
        .filter(|&j| (0..n).any(|t| want[t * m + j] != 0.0))
        .collect();
    let out0: Vec<f32> = (0..n * d).map(|i| (i % 5) as f32 * 0.25 - 0.5).collect();
    let mut got = out0.clone();
    let mut h = vec![f32::NAN; n * m];
    let on = sparse_ffn(k, parts, (idx, idx), x, n, &decide, &mut h, &mut got).unwrap();
    assert_eq!(on, live, "{what}: one pass");
    assert_eq!(bits(&h), bits(want), "{what}: one pass");
    let listed: Vec<u32> = live.iter().map(|&j| idx[j]).collect();
    let hs: Vec<f32> = (0..n)
        .flat_map(|t| live.iter().map(move |&j| want[t * m + j]))
        .collect();
    let mut two = out0.clone();
    sparse_down(k, b, (&listed, &listed), &hs, n, &mut two).unwrap();
    if idx.is_sorted() {
        assert_eq!(bits(&got), bits(&two), "{what}: one pass against two");
    }
    let scale = two.iter().fold(1f32, |a, v| a.max(v.abs()));
    for (i, (g, w)) in got.iter().zip(&two).enumerate() {
        assert!(
            (g - w).abs() <= 1e-5 * scale,
            "{what}: out[{i}] {g} against {w}"
        );
    }
    // Ascending, each token alone over its own neurons.
    let mut order: Vec<usize> = (0..m).collect();
    order.sort_by_key(|&j| idx[j]);
    let sorted: Vec<u32> = order.iter().map(|&j| idx[j]).collect();
    let dec_sorted = |jj: usize, t: usize, v: f32| decide(order[jj], t, v);
    let mut all = out0.clone();
    let mut hh = vec![0f32; n * m];
    sparse_ffn(
        k,
        parts,
        (&sorted, &sorted),
        x,
        n,
        dec_sorted,
        &mut hh,
        &mut all,
    )
    .unwrap();
    // The dense order: every neuron of the layer listed, those off weighing zero.
    let neurons = b.neurons();
    let mut dense_h = vec![0f32; n * neurons];
    for t in 0..n {
        for (jj, &i) in sorted.iter().enumerate() {
            dense_h[t * neurons + i as usize] += hh[t * m + jj];
        }
    }
    if sorted.windows(2).all(|w| w[0] < w[1]) {
        let every: Vec<u32> = (0..neurons as u32).collect();
        let mut dense = out0.clone();
        sparse_down(k, b, (&every, &every), &dense_h, n, &mut dense).unwrap();
        assert_eq!(bits(&dense), bits(&all), "{what}: the dense order");
    }
    for t in 0..n {
        let mine: Vec<usize> = (0..m).filter(|&jj| hh[t * m + jj] != 0.0).collect();
        let list: Vec<u32> = mine.iter().map(|&jj| sorted[jj]).collect();
        let xt = &x[t * d..(t + 1) * d];
        let dec_t = |a: usize, _: usize, v: f32| decide(order[mine[a]], t, v);
        let mut alone = out0[t * d..(t + 1) * d].to_vec();
        let mut ht = vec![0f32; list.len()];
        sparse_ffn(k, parts, (&list, &list), xt, 1, dec_t, &mut ht, &mut alone).unwrap();
        assert_eq!(
            bits(&alone),
            bits(&all[t * d..(t + 1) * d]),
            "{what}: token {t} alone"
        );
    }
}

/// A list cut into calls on [`DOWN_BLOCK`] boundaries (a stream's resident and streamed runs, the
/// split's device and CPU rows, a unit's rounds) sums what one call over the whole list does,
/// bit for bit, from a sum already under way; the blocks are the ids', not the entries': the
/// same neurons listed by other entries (a unit's slots) sum the same.
#[test]
fn calls_cut_on_block_boundaries_sum_what_one_call_does() {
    let mut rng = StdRng::seed_from_u64(41);
    let b64 = DOWN_BLOCK as usize;
    let (neurons, d) = (4 * b64 + 17, 96);
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for k in kernel_sets() {
        for enc in [Encoding::F16, Encoding::Int8] {
            let l = layer(&mut rng, enc, true, neurons, d);
            let bytes = aligned(&l.bytes);
            let b = Bundles::new(bytes.as_slice(), enc, l.shape).unwrap();
            let mut idx = rand_idx(&mut rng, neurons, 0.7);
            idx.sort();
            let m = idx.len();
            for n in [1usize, 3] {
                let h = rand_vec(&mut rng, n * m, 1.0);
                let out0 = rand_vec(&mut rng, n * d, 1.0);
                let mut whole = out0.clone();
                sparse_down(k, &b, (&idx, &idx), &h, n, &mut whole).unwrap();
                // Cut at the first entry of blocks 1 and 3.
                let cuts: Vec<usize> = [1, 3]
                    .iter()
                    .map(|&blk| idx.partition_point(|&i| (i as usize) < blk * b64))
                    .collect();
                let mut parts = out0.clone();
                let mut from = 0;
                for &to in cuts.iter().chain([m].iter()) {
                    let hs: Vec<f32> = (0..n)
                        .flat_map(|t| h[t * m + from..t * m + to].iter().copied())
                        .collect();
                    let list = &idx[from..to];
                    sparse_down(k, &b, (list, list), &hs, n, &mut parts).unwrap();
                    from = to;
                }
                let what = format!("{} {enc:?} n {n}", k.name);
                assert_eq!(bits(&parts), bits(&whole), "{what}: cut on blocks");
                // The same neurons read through other entries (in reverse row order of a copy).
                let copy_rows: Vec<u32> = idx.iter().rev().copied().collect();
                let rb = bytes.as_slice().len() / neurons;
                let mut copy = Vec::with_capacity(m * rb);
                for &i in &copy_rows {
                    copy.extend_from_slice(
                        &bytes.as_slice()[i as usize * rb..(i as usize + 1) * rb],
                    );
                }
                let copy = aligned(&copy);
                let cb = Bundles::new(copy.as_slice(), enc, l.shape).unwrap();
                let slots: Vec<u32> = (0..m as u32).rev().collect();
                let mut by_slot = out0.clone();
                sparse_down(k, &cb, (&slots, &idx), &h, n, &mut by_slot).unwrap();
                assert_eq!(bits(&by_slot), bits(&whole), "{what}: by slot");
            }
        }
    }
}
