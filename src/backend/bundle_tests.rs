//! FFN bundles in every store encoding on the CPU backend and the budgeted device: the dense and
//! the neuron-listed bundle ops equal a reference computed in f64 from the values the store's
//! dequantizers (`store::quant`, `tensor::decode_row`) give; the device takes exactly
//! `backend::bundle_bytes` (rounded as CUDA allocates); bad combinations are refused by name.

use half::f16;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use super::cpu::CpuBackend;
use super::sim::SimBackend;
use super::{Act, Backend, BackendError, BundleShape, WorkspaceOp, bundle_bytes, sparse_act};
use crate::footprint::device_bytes;
use crate::footprint::ledger::Ledger;
use crate::store::Encoding;
use crate::store::encode_bundles;
use crate::store::quant::{INT4_GROUP, dequant_int4_row, dequant_int8_row};
use crate::tensor::{Bytes, DType, HostTensor, decode_row};

/// Every bundle encoding (the sparse operators' tests check each too).
pub(crate) const ENCODINGS: [Encoding; 5] = [
    Encoding::F32,
    Encoding::F16,
    Encoding::Format(DType::BF16),
    Encoding::Int8,
    Encoding::Int4,
];

/// Part `p` of bundle `i` as the reference dequantizers decode it (the layout the store writes).
fn reference_part(bytes: &[u8], enc: Encoding, shape: BundleShape, i: usize, p: usize) -> Vec<f32> {
    let BundleShape { parts, d } = shape;
    let rb = enc.row_bytes(parts * d, parts);
    let row = &bytes[i * rb..(i + 1) * rb];
    let mut out = vec![0f32; d];
    match enc {
        Encoding::Format(dt) => {
            let pb = dt.bytes_for(d);
            decode_row(dt, &row[p * pb..(p + 1) * pb], &mut out);
        }
        Encoding::Int8 => {
            let scale =
                f32::from_le_bytes([row[p * 4], row[p * 4 + 1], row[p * 4 + 2], row[p * 4 + 3]]);
            let at = parts * 4 + p * d;
            dequant_int8_row(scale, bytemuck::cast_slice(&row[at..at + d]), &mut out);
        }
        Encoding::Int4 => {
            let g = d / INT4_GROUP;
            let scales: Vec<f16> = (0..g)
                .map(|k| f16::from_le_bytes([row[(p * g + k) * 2], row[(p * g + k) * 2 + 1]]))
                .collect();
            let at = parts * g * 2 + p * d / 2;
            dequant_int4_row(&scales, &row[at..at + d / 2], &mut out);
        }
    }
    out
}

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum()
}

/// A layer's random bundles in `enc`, with its reference (decoded) parts.
struct Layer {
    bytes: Vec<u8>,
    parts: Vec<Vec<Vec<f32>>>,
}

fn layer(rng: &mut StdRng, enc: Encoding, shape: BundleShape, neurons: usize) -> Layer {
    let d = shape.d;
    let mut r = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-0.3f32..0.3)).collect() };
    let gate = (shape.parts == 3).then(|| r(neurons * d));
    let (up, down_t) = (r(neurons * d), r(neurons * d));
    let bytes = encode_bundles(gate.as_deref(), &up, &down_t, d, enc);
    let parts = (0..neurons)
        .map(|i| {
            (0..shape.parts)
                .map(|p| reference_part(&bytes, enc, shape, i, p))
                .collect()
        })
        .collect();
    Layer { bytes, parts }
}

/// The hidden activation of neuron `i` for token `x` in f64, or `None` where its activation is
/// so near the threshold that rounding may put it on either side.
fn reference_h(l: &Layer, i: usize, x: &[f32], bias: &[f32], threshold: f32) -> Option<f64> {
    let p = &l.parts[i];
    let (a, u) = if p.len() == 3 {
        let g = dot(&p[0], x);
        (g / (1.0 + (-g).exp()), dot(&p[1], x))
    } else {
        ((dot(&p[0], x) + bias[i] as f64).max(0.0), 1.0)
    };
    if threshold > 0.0 && (a.abs() - threshold as f64).abs() < 1e-4 {
        return None;
    }
    Some(sparse_act(a as f32, threshold) as f64 * u)
}

fn put<B: Backend>(b: &B, rows: usize, cols: usize, v: &[f32]) -> B::Tensor {
    let mut t = b.alloc(rows, cols).unwrap();
    b.write(&mut t, v).unwrap();
    t
}

fn get<B: Backend>(b: &B, t: &B::Tensor) -> Vec<f32> {
    let (r, c) = b.shape(t);
    let mut v = vec![0f32; r * c];
    b.read(t, &mut v).unwrap();
    v
}

fn close(got: f32, want: f64, what: &str) {
    assert!(
        (got as f64 - want).abs() <= 1e-4 * (1.0 + want.abs()),
        "{what}: {got} vs {want}"
    );
}

/// Dense (two runs, the second at column `split`) and listed up and down ops on `b` against the
/// reference, for every encoding and both bundle forms.
fn bundle_ops_equal_the_reference<B: Backend>(b: &B) {
    let mut rng = StdRng::seed_from_u64(41);
    let (d, neurons, n, split) = (64, 70, 3, 24);
    b.set_workspace(b.workspace_bytes(&WorkspaceOp::Listed { neurons }))
        .unwrap();
    for enc in ENCODINGS {
        for parts in [2, 3] {
            for threshold in [0.0f32, 0.05] {
                let what = format!("{} {parts} parts, threshold {threshold}", enc.name());
                let shape = BundleShape { parts, d };
                let l = layer(&mut rng, enc, shape, neurons);
                let rb = enc.row_bytes(parts * d, parts);
                let bias: Vec<f32> = (0..neurons)
                    .map(|_| rng.random_range(-0.2f32..0.2))
                    .collect();
                let x: Vec<f32> = (0..n * d).map(|_| rng.random_range(-1f32..1.0)).collect();
                let act = if parts == 3 { Act::Silu } else { Act::Relu };
                let bias_w = b
                    .upload(&HostTensor::from_f32("bias", 1, neurons, bias.clone()))
                    .unwrap();
                let bias_w = (parts == 2).then_some(&bias_w);
                let run = |lo: usize, hi: usize| {
                    let data = Bytes::from_slice(&l.bytes[lo * rb..hi * rb]);
                    b.upload_bundles("run", enc, shape, &data).unwrap()
                };
                let (a, z) = (run(0, split), run(split, neurons));
                let xt = put(b, n, d, &x);

                // Dense up, in two runs.
                let mut h = b.alloc(n, neurons).unwrap();
                b.ffn_bundles_up(&a, shape, &xt, act, threshold, bias_w, &mut h, 0)
                    .unwrap();
                b.ffn_bundles_up(&z, shape, &xt, act, threshold, bias_w, &mut h, split)
                    .unwrap();
                let hv = get(b, &h);
                for t in 0..n {
                    for i in 0..neurons {
                        let xr = &x[t * d..(t + 1) * d];
                        if let Some(want) = reference_h(&l, i, xr, &bias, threshold) {
                            close(hv[t * neurons + i], want, &format!("{what} up {t} {i}"));
                        }
                    }
                }

                // Dense down on a random mask of hidden values.
                let hm: Vec<f32> = (0..n * neurons)
                    .map(|_| {
                        if rng.random_bool(0.3) {
                            0.0
                        } else {
                            rng.random_range(-1f32..1.0)
                        }
                    })
                    .collect();
                let want_down = |h: &dyn Fn(usize, usize) -> f64| -> Vec<f64> {
                    let mut w = vec![0f64; n * d];
                    for t in 0..n {
                        for i in 0..neurons {
                            let hi = h(t, i);
                            for (j, v) in l.parts[i][parts - 1].iter().enumerate() {
                                w[t * d + j] += hi * *v as f64;
                            }
                        }
                    }
                    w
                };
                let mut out = put(b, n, d, &vec![0.5; n * d]);
                let ht = put(b, n, neurons, &hm);
                b.ffn_bundles_down(&a, shape, &ht, 0, &mut out).unwrap();
                b.ffn_bundles_down(&z, shape, &ht, split, &mut out).unwrap();
                let want = want_down(&|t, i| hm[t * neurons + i] as f64);
                for (k, (g, w)) in get(b, &out).iter().zip(&want).enumerate() {
                    close(*g, w + 0.5, &format!("{what} down {k}"));
                }

                // Listed: a random list over the whole layer.
                let whole = b
                    .upload_bundles("layer", enc, shape, &Bytes::from_slice(&l.bytes))
                    .unwrap();
                let idx: Vec<u32> = (0..neurons as u32)
                    .filter(|_| rng.random_bool(0.4))
                    .collect();
                let m = idx.len();
                let mut hl = b.alloc(n, m + 2).unwrap();
                b.ffn_bundles_up_listed(&whole, shape, &xt, act, threshold, bias_w, &idx, &mut hl)
                    .unwrap();
                let hlv = get(b, &hl);
                for t in 0..n {
                    for (j, &i) in idx.iter().enumerate() {
                        let xr = &x[t * d..(t + 1) * d];
                        if let Some(want) = reference_h(&l, i as usize, xr, &bias, threshold) {
                            let got = hlv[t * (m + 2) + j];
                            close(got, want, &format!("{what} listed up {t} {i}"));
                        }
                    }
                }
                let hc: Vec<f32> = (0..n * (m + 2))
                    .map(|_| rng.random_range(-1f32..1.0))
                    .collect();
                let mut out = put(b, n, d, &vec![0.0; n * d]);
                b.ffn_bundles_down_listed(
                    &whole,
                    shape,
                    &put(b, n, m + 2, &hc),
                    (&idx, &idx),
                    &mut out,
                )
                .unwrap();
                let want = want_down(&|t, i| {
                    idx.iter()
                        .position(|&k| k as usize == i)
                        .map_or(0.0, |j| hc[t * (m + 2) + j] as f64)
                });
                for (k, (g, w)) in get(b, &out).iter().zip(&want).enumerate() {
                    close(*g, *w, &format!("{what} listed down {k}"));
                }
            }
        }
    }
    b.set_workspace(0).unwrap();
}

#[test]
fn cpu_bundle_ops_in_every_encoding_equal_the_dequantized_reference() {
    bundle_ops_equal_the_reference(&CpuBackend::new(2).unwrap());
}

#[test]
fn sim_bundle_ops_in_every_encoding_equal_the_dequantized_reference() {
    let sim = SimBackend::new(CpuBackend::new(2).unwrap(), Ledger::new(None, None));
    bundle_ops_equal_the_reference(&sim);
}

#[test]
fn bundle_bytes_is_rows_times_the_encodings_row() {
    let (rows, d) = (100, 96);
    for parts in [2, 3] {
        let shape = BundleShape { parts, d };
        let cols = parts * d;
        for (enc, row) in [
            (Encoding::F32, cols * 4),
            (Encoding::F16, cols * 2),
            (Encoding::Format(DType::BF16), cols * 2),
            // An f32 scale per part, then a byte per value.
            (Encoding::Int8, parts * 4 + cols),
            // An f16 scale per 32 values, then half a byte per value.
            (Encoding::Int4, cols / 32 * 2 + cols / 2),
        ] {
            assert_eq!(bundle_bytes("b", enc, shape, rows).unwrap(), rows * row);
        }
    }
}

/// The budgeted device takes what CUDA allocates for bundles — `bundle_bytes`, rounded as
/// device allocations are — whether uploaded or allocated as a slot, and gives it back.
#[test]
fn sim_reserves_the_device_bytes_of_every_encoding() {
    let mut rng = StdRng::seed_from_u64(3);
    let ledger = Ledger::new(Some(64 << 20), None);
    let sim = SimBackend::new(CpuBackend::new(1).unwrap(), ledger.clone());
    for enc in ENCODINGS {
        for parts in [2, 3] {
            let (shape, neurons) = (BundleShape { parts, d: 96 }, 77);
            let l = layer(&mut rng, enc, shape, neurons);
            let want = device_bytes(bundle_bytes("b", enc, shape, neurons).unwrap() as u64);
            let before = ledger.snapshot();
            let w = sim
                .upload_bundles("b", enc, shape, &Bytes::from_slice(&l.bytes))
                .unwrap();
            let after = ledger.snapshot();
            assert_eq!(
                after.hbm_used - before.hbm_used,
                want,
                "{} upload",
                enc.name()
            );
            assert_eq!(
                after.h2d_bytes - before.h2d_bytes,
                l.bytes.len() as u64,
                "{} copied in",
                enc.name()
            );
            let mut slot = sim.alloc_bundles("slot", enc, shape, neurons).unwrap();
            assert_eq!(
                ledger.snapshot().hbm_used - after.hbm_used,
                want,
                "{} slot",
                enc.name()
            );
            // A slot filled in two pieces computes as the uploaded bundles do.
            let rb = l.bytes.len() / neurons;
            sim.upload_into(&mut slot, 0, &l.bytes[..10 * rb]).unwrap();
            sim.upload_into(&mut slot, 10, &l.bytes[10 * rb..]).unwrap();
            let x = put(&sim, 1, 96, &vec![0.25; 96]);
            let mut h1 = sim.alloc(1, neurons).unwrap();
            let mut h2 = sim.alloc(1, neurons).unwrap();
            let act = Act::Relu;
            sim.ffn_bundles_up(&w, shape, &x, act, 0.0, None, &mut h1, 0)
                .unwrap();
            sim.ffn_bundles_up(&slot, shape, &x, act, 0.0, None, &mut h2, 0)
                .unwrap();
            assert_eq!(get(&sim, &h1), get(&sim, &h2), "{}", enc.name());
            drop((w, slot, x, h1, h2));
            assert_eq!(ledger.snapshot().hbm_used, before.hbm_used);
        }
    }
}

fn shape_error<T>(r: super::Result<T>, what: &str) -> String {
    match r {
        Err(e @ BackendError::Shape { .. }) => e.to_string(),
        Err(e) => panic!("{what}: not a shape error: {e}"),
        Ok(_) => panic!("{what}: accepted"),
    }
}

/// Bad combinations are refused with an error that says what is wrong.
fn bad_bundles_are_refused<B: Backend>(b: &B) {
    let mut rng = StdRng::seed_from_u64(8);
    let shape = BundleShape { parts: 3, d: 64 };
    let l = layer(&mut rng, Encoding::Int8, shape, 4);
    let data = Bytes::from_slice(&l.bytes);
    let e = shape_error(
        b.upload_bundles("b", Encoding::Int4, BundleShape { parts: 3, d: 48 }, &data),
        "int4 of 48",
    );
    assert!(e.contains("32-value groups"), "{e}");
    let e = shape_error(
        b.alloc_bundles("b", Encoding::Int4, BundleShape { parts: 2, d: 40 }, 4),
        "int4 slot of 40",
    );
    assert!(e.contains("32-value groups"), "{e}");
    let short = Bytes::from_slice(&l.bytes[..l.bytes.len() - 1]);
    let e = shape_error(
        b.upload_bundles("b", Encoding::Int8, shape, &short),
        "a short byte run",
    );
    assert!(e.contains("not whole"), "{e}");
    let e = shape_error(
        b.upload_bundles("b", Encoding::Int8, BundleShape { parts: 4, d: 64 }, &data),
        "4 parts",
    );
    assert!(e.contains("not 4"), "{e}");
    let e = shape_error(
        b.upload_bundles("b", Encoding::Format(DType::Q4K), shape, &data),
        "a block format",
    );
    assert!(e.contains("not a bundle encoding"), "{e}");

    // INT8 bundles are no matrix, and their part count is theirs.
    let w = b.upload_bundles("b", Encoding::Int8, shape, &data).unwrap();
    let x = put(b, 1, 192, &[0.0; 192]);
    let mut out = b.alloc(1, 4).unwrap();
    b.set_workspace(1 << 20).unwrap();
    let e = shape_error(b.matmul(&w, &x, &mut out), "int8 bundles in matmul");
    assert!(e.contains("int8 bundles"), "{e}");
    let x = put(b, 1, 96, &[0.0; 96]);
    let mut h = b.alloc(1, 4).unwrap();
    let two = BundleShape { parts: 2, d: 96 };
    let e = shape_error(
        b.ffn_bundles_up(&w, two, &x, Act::Relu, 0.0, None, &mut h, 0),
        "3-part int8 bundles as 2 parts",
    );
    assert!(e.contains("2-part bundles"), "{e}");
    b.set_workspace(0).unwrap();
}

#[test]
fn bad_bundles_are_refused_on_cpu_and_sim() {
    bad_bundles_are_refused(&CpuBackend::new(1).unwrap());
    let sim = SimBackend::new(CpuBackend::new(1).unwrap(), Ledger::new(None, None));
    bad_bundles_are_refused(&sim);
}

/// The fixture `kernels/host/bundle_check.cpp` checks the CUDA bundle decoders against: bundles
/// the store's encoder wrote, and what the reference dequantizers decode from them. Written to
/// the file `GPU_OFFLOAD_BUNDLE_FIXTURE` names (scripts/check-kernels.sh); else only built.
#[test]
fn bundle_decode_fixture() {
    use std::fmt::Write as _;
    let hex = |b: &[u8]| {
        b.iter().fold(String::new(), |mut s, x| {
            let _ = write!(s, "{x:02x}");
            s
        })
    };
    let mut rng = StdRng::seed_from_u64(11);
    let mut text = String::new();
    // ENCODINGS is in the order of the kernels' BE_* codes (f32, f16, bf16, int8, int4).
    for (code, enc) in ENCODINGS.into_iter().enumerate() {
        // d = 37: INT8 bundles of an odd length, so scales sit at every alignment.
        for (parts, d) in [(2, 64usize), (3, 96), (3, 37)] {
            if enc == Encoding::Int4 && !d.is_multiple_of(INT4_GROUP) {
                continue;
            }
            let (shape, neurons) = (BundleShape { parts, d }, 5);
            let l = layer(&mut rng, enc, shape, neurons);
            let values: Vec<u8> = l
                .parts
                .iter()
                .flatten()
                .flatten()
                .flat_map(|v| v.to_le_bytes())
                .collect();
            let _ = writeln!(
                text,
                "{code} {parts} {d} {neurons} {} {}",
                hex(&l.bytes),
                hex(&values)
            );
        }
    }
    if let Some(path) = std::env::var_os("GPU_OFFLOAD_BUNDLE_FIXTURE") {
        std::fs::write(&path, text).expect("write the bundle fixture");
    }
}

/// `bytes` in a page-aligned buffer of their own, as the store's reads leave them (what can be
/// mapped for the device).
fn aligned(bytes: &[u8]) -> Bytes {
    let mut buf = crate::tensor::AlignedBuf::zeroed(bytes.len());
    buf.as_mut_slice().copy_from_slice(bytes);
    Bytes::Aligned {
        buf: std::sync::Arc::new(buf),
        range: 0..bytes.len(),
    }
}

/// A paced link carries what the listed ops read in place as it carries copies: the link is
/// busy until the bytes the op counted could cross at its rate, and so is the compute stream
/// (what `bench decode` relies on to hold the budgeted device to the rate its bound divides
/// by). As on CUDA, the host is not held meanwhile: it may queue a copy, which crosses behind
/// the reads; the stream's next op, a read of what it computed and the trace's clock wait for
/// them.
#[test]
fn in_place_reads_take_the_paced_link_as_copies_do() {
    let mut rng = StdRng::seed_from_u64(61);
    let ledger = Ledger::new(None, None);
    let sim = SimBackend::new(CpuBackend::new(1).unwrap(), ledger.clone());
    let (d, neurons, enc) = (64, 40, Encoding::F16);
    let shape = BundleShape { parts: 3, d };
    sim.set_workspace(sim.workspace_bytes(&WorkspaceOp::Listed { neurons }))
        .unwrap();
    let l = layer(&mut rng, enc, shape, neurons);
    let host = sim
        .map_bundles("host", enc, shape, &aligned(&l.bytes))
        .unwrap();
    let slots = sim.alloc_bundles("slots", enc, shape, 1).unwrap();
    let x: Vec<f32> = (0..d).map(|_| rng.random_range(-1f32..1.0)).collect();
    let xt = put(&sim, 1, d, &x);
    let mut h = sim.alloc(1, neurons).unwrap();
    let entries: Vec<u32> = (0..neurons as u32).map(|i| i | super::IN_REST).collect();
    assert!(sim.link_free_at().is_none(), "nothing paces the link yet");
    // A byte a microsecond: the reads below (some 10 KB) take milliseconds.
    let rate = 1e6;
    sim.pace_copies(rate).unwrap();
    let (t0, before) = (std::time::Instant::now(), ledger.snapshot().h2d_bytes);
    sim.ffn_bundles_up_listed_from(
        (&slots, Some(&host)),
        shape,
        &xt,
        Act::Silu,
        0.0,
        None,
        &entries,
        &mut h,
    )
    .unwrap();
    let bytes = ledger.snapshot().h2d_bytes - before;
    assert!(
        bytes as usize >= neurons * 2 * d,
        "every gate read in place: {bytes}"
    );
    let returned = std::time::Instant::now();
    let free = sim.link_free_at().unwrap();
    let crossing = std::time::Duration::from_secs_f64(bytes as f64 / rate);
    assert!(free >= t0 + crossing, "the link carried {bytes} bytes");
    assert!(returned < free, "the host was not held by the reads");
    let done = sim.compute_done().unwrap();
    assert!(done >= free, "the stream's work ends with its reads");
    let clock = sim.device_clock().unwrap();
    let first = clock.mark().unwrap();
    // A copy queued now crosses behind the reads, and the host is not held by it either.
    let mut slot = sim
        .alloc_weight("slot", crate::tensor::DType::F32, 1, 16)
        .unwrap();
    sim.copies_wait(&done).unwrap();
    sim.upload_into(&mut slot, 0, &[7u8; 64]).unwrap();
    let copied = sim.copies_done().unwrap();
    assert!(copied >= free + std::time::Duration::from_secs_f64(64.0 / rate));
    assert!(std::time::Instant::now() < free, "the copy did not wait");
    // The stream's next op starts once the reads have crossed.
    sim.zero(&mut h).unwrap();
    let after = std::time::Instant::now();
    assert!(after >= free, "the next op waited for the reads");
    let second = clock.mark().unwrap();
    let times = clock.take().unwrap();
    assert_eq!((first, second, times.len()), (0, 1, 2));
    // The clock's first mark was on the stream's end: between the marks the stream spent only
    // the op's own time (microseconds), not the reads' crossing again.
    assert!(times[1][0] < crossing.as_secs_f64() / 2.0, "{:?}", times[1]);
    assert!(
        times[1][1] >= 64.0 / rate,
        "the copy crossed between the marks"
    );
}

/// Bundles read in place from host memory beside a unit's slots: one list over both computes
/// what one list over the whole layer does, bit for bit (the entries' ids order each token's
/// sum), in every encoding, with and without a gate, one token and several, in two ops or
/// one (where the CPU reads gated f16 bundles in neuron tiles); the mapped bundles
/// take no device memory; the link bytes counted are exactly what was read of them (every listed
/// neuron's deciding part, the rest of those the mask leaves on); what cannot be mapped or read
/// so is refused.
#[test]
fn bundles_read_in_place_beside_slots_compute_as_one_layer() {
    let mut rng = StdRng::seed_from_u64(59);
    let ledger = Ledger::new(Some(64 << 20), None);
    let sim = SimBackend::new(CpuBackend::new(2).unwrap(), ledger.clone());
    let (d, neurons) = (64, 40);
    sim.set_workspace(sim.workspace_bytes(&WorkspaceOp::Listed { neurons }))
        .unwrap();
    for enc in ENCODINGS {
        for (parts, threshold, n) in [(3, 0.05f32, 1), (3, 0.0, 3), (2, 0.0, 2), (3, 0.3, 2)] {
            let what = format!(
                "{} {parts} parts, threshold {threshold}, {n} tokens",
                enc.name()
            );
            let shape = BundleShape { parts, d };
            let l = layer(&mut rng, enc, shape, neurons);
            let rb = enc.row_bytes(parts * d, parts);
            let act = if parts == 3 { Act::Silu } else { Act::Relu };
            let whole = sim
                .upload_bundles("layer", enc, shape, &Bytes::from_slice(&l.bytes))
                .unwrap();
            let used = ledger.snapshot().hbm_used;
            let host = sim
                .map_bundles("host", enc, shape, &aligned(&l.bytes))
                .unwrap();
            assert_eq!(
                ledger.snapshot().hbm_used,
                used,
                "{what}: mapping takes no device memory"
            );
            // Every third neuron in a slot (in reverse order), the others in host memory.
            let held: Vec<usize> = (0..neurons).filter(|i| i % 3 == 0).rev().collect();
            let mut slots = sim.alloc_bundles("slots", enc, shape, held.len()).unwrap();
            for (s, &i) in held.iter().enumerate() {
                sim.upload_into(&mut slots, s, &l.bytes[i * rb..(i + 1) * rb])
                    .unwrap();
            }
            let ids: Vec<u32> = (0..neurons as u32)
                .filter(|_| rng.random_bool(0.7))
                .collect();
            let entries: Vec<u32> = ids
                .iter()
                .map(|&i| match held.iter().position(|&k| k == i as usize) {
                    Some(s) => s as u32,
                    None => i | super::IN_REST,
                })
                .collect();
            let rest = entries.iter().filter(|&&e| e & super::IN_REST != 0).count();
            let m = ids.len();
            let x: Vec<f32> = (0..n * d).map(|_| rng.random_range(-1f32..1.0)).collect();
            let xt = put(&sim, n, d, &x);
            let (mut h1, mut h2) = (sim.alloc(n, m).unwrap(), sim.alloc(n, m).unwrap());
            sim.ffn_bundles_up_listed(&whole, shape, &xt, act, threshold, None, &ids, &mut h1)
                .unwrap();
            let before = ledger.snapshot().h2d_bytes;
            let pair = (&slots, Some(&host));
            sim.ffn_bundles_up_listed_from(
                pair, shape, &xt, act, threshold, None, &entries, &mut h2,
            )
            .unwrap();
            let up_bytes = ledger.snapshot().h2d_bytes - before;
            let (hv, hv2) = (get(&sim, &h1), get(&sim, &h2));
            assert_eq!(hv, hv2, "{what}: up");
            // A neuron the mask leaves on for some token (its activation is not 0 for it).
            let on = |j: usize| (0..n).any(|t| hv[t * m + j] != 0.0);
            let rest_on = (0..m)
                .filter(|&j| entries[j] & super::IN_REST != 0 && on(j))
                .count();
            let want = super::in_place_read_bytes(rb, parts, rest, rest_on, true);
            assert_eq!(up_bytes, want, "{what}: up's link bytes");
            let (mut o1, mut o2) = (
                put(&sim, n, d, &vec![0.5; n * d]),
                put(&sim, n, d, &vec![0.5; n * d]),
            );
            sim.ffn_bundles_down_listed(&whole, shape, &h1, (&ids, &ids), &mut o1)
                .unwrap();
            let before = ledger.snapshot().h2d_bytes;
            sim.ffn_bundles_down_listed_from(pair, shape, &h2, (&entries, &ids), &mut o2)
                .unwrap();
            let down_bytes = ledger.snapshot().h2d_bytes - before;
            assert_eq!(get(&sim, &o1), get(&sim, &o2), "{what}: down");
            let want = super::in_place_read_bytes(rb, parts, rest, rest_on, false);
            assert_eq!(down_bytes, want, "{what}: down's link bytes");
            // Both sides in one op (f16 gated bundles: read a tile at a time, once): the same
            // activations and output, the same link bytes.
            let (mut h3, mut o3) = (sim.alloc(n, m).unwrap(), put(&sim, n, d, &vec![0.5; n * d]));
            let before = ledger.snapshot().h2d_bytes;
            let how = (act, threshold);
            sim.ffn_bundles_listed_from(
                pair,
                shape,
                &xt,
                how,
                None,
                (&entries, &ids),
                &mut h3,
                &mut o3,
            )
            .unwrap();
            assert_eq!(get(&sim, &h3), hv, "{what}: one op's up");
            assert_eq!(get(&sim, &o3), get(&sim, &o1), "{what}: one op's down");
            let both = ledger.snapshot().h2d_bytes - before;
            assert_eq!(both, up_bytes + down_bytes, "{what}: one op's link bytes");
            // Refused: a whole-layer op on bundles read in place, an up bias with a rest, an
            // entry past the rest, bytes not in a buffer of their own.
            let e = shape_error(
                sim.ffn_bundles_up(&host, shape, &xt, act, 0.0, None, &mut h1, 0),
                &what,
            );
            assert!(e.contains("read in place"), "{e}");
            let bias = sim
                .upload(&HostTensor::from_f32(
                    "bias",
                    1,
                    neurons,
                    vec![0.0; neurons],
                ))
                .unwrap();
            let e = shape_error(
                sim.ffn_bundles_up_listed_from(
                    pair,
                    shape,
                    &xt,
                    act,
                    0.0,
                    Some(&bias),
                    &entries,
                    &mut h2,
                ),
                &what,
            );
            assert!(e.contains("up bias"), "{e}");
            let past = [neurons as u32 | super::IN_REST];
            let r =
                sim.ffn_bundles_up_listed_from(pair, shape, &xt, act, 0.0, None, &past, &mut h2);
            assert!(r.is_err(), "{what}: an entry past the rest");
            let e = shape_error(
                sim.map_bundles("h", enc, shape, &Bytes::from_slice(&l.bytes)),
                &what,
            );
            assert!(e.contains("page-aligned"), "{e}");
        }
    }
    sim.set_workspace(0).unwrap();
}

/// The budgeted device counts what its whole-run bundle ops leave unread, as its kernels (and
/// CUDA's) skip it: the up part of a gated neuron its gate leaves off for every token, and the
/// down part of every neuron off for every token. A bound on the device's reads takes these
/// bytes off what the plan counts whole.
#[test]
fn sim_counts_the_parts_whole_runs_leave_unread() {
    let mut rng = StdRng::seed_from_u64(11);
    let ledger = Ledger::new(None, None);
    let sim = SimBackend::new(CpuBackend::new(1).unwrap(), ledger.clone());
    for enc in ENCODINGS {
        for parts in [2, 3] {
            let (shape, neurons, n) = (BundleShape { parts, d: 64 }, 40, 2);
            let l = layer(&mut rng, enc, shape, neurons);
            let w = sim
                .upload_bundles("b", enc, shape, &Bytes::from_slice(&l.bytes))
                .unwrap();
            let xs: Vec<f32> = (0..n * 64)
                .map(|_| rng.random_range(-1.0f32..1.0))
                .collect();
            let x = put(&sim, n, 64, &xs);
            // Room beside the run's columns, which stay zero (not the run's to count).
            let (col0, cols) = (3, neurons + 5);
            let mut h = put(&sim, n, cols, &vec![0.0; n * cols]);
            let mut out = put(&sim, n, 64, &vec![0.0; n * 64]);
            let before = ledger.snapshot().device_reads_skipped;
            sim.ffn_bundles_up(&w, shape, &x, Act::Relu, 0.0, None, &mut h, col0)
                .unwrap();
            let after_up = ledger.snapshot().device_reads_skipped;
            sim.ffn_bundles_down(&w, shape, &h, col0, &mut out).unwrap();
            let after_down = ledger.snapshot().device_reads_skipped;
            let hv = get(&sim, &h);
            let off = (col0..col0 + neurons)
                .filter(|&c| (0..n).all(|t| hv[t * cols + c] == 0.0))
                .count() as u64;
            let what = format!("{} in {parts} parts", enc.name());
            assert!(
                off > 0 && off < neurons as u64,
                "{what}: {off} of {neurons} off"
            );
            let part = (l.bytes.len() / neurons / parts) as u64;
            let up_part = if parts == 3 { part } else { 0 };
            assert_eq!(after_up - before, off * up_part, "{what}: up side");
            assert_eq!(after_down - after_up, off * part, "{what}: down side");
        }
    }
}
