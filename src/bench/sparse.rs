//! `bench sparse`: the neuron-sparse FFN kernels (`backend::cpu::sparse`, PowerInfer's cold
//! path) on a 7B-shaped layer at several active fractions: bytes/s on the bundles they touch
//! against the DRAM read rate, and the speed-up over the dense bundle kernels (or over sparse
//! at 100% for the encodings without them). A figure above its bound is an error.

use std::time::Instant;

use anyhow::{Result, bail};
use clap::Args;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use serde_json::{Value, json};

use crate::backend::cpu::CpuBackend;
use crate::backend::cpu::bundles;
use crate::backend::cpu::kernels::{self, Kernels};
use crate::backend::cpu::sparse::{Bundles, DownSplit, sparse_down_split, sparse_up};
use crate::backend::{Backend, BundleShape};
use crate::bench::bounds;
use crate::bench::matvec::MATVEC_WORKING_SET;
use crate::plan::HardwareProfile;
use crate::store::Encoding;
use crate::tensor::{Bytes, DType, HostTensor};

/// Bundle encodings by name (`f16,int8,int4`).
#[derive(Clone, Debug)]
pub struct EncodingList(pub Vec<Encoding>);

fn parse_encodings(s: &str) -> std::result::Result<EncodingList, String> {
    s.split(',')
        .map(|e| {
            Encoding::parse(e.trim())
                .filter(|e| {
                    matches!(
                        e.dtype(),
                        None | Some(DType::F32 | DType::F16 | DType::BF16)
                    )
                })
                .ok_or_else(|| {
                    format!("`{e}` is not a bundle encoding (f32, f16, bf16, int8, int4)")
                })
        })
        .collect::<std::result::Result<_, _>>()
        .map(EncodingList)
}

/// Active fractions in percent (`10,30,50,100`).
#[derive(Clone, Debug)]
pub struct PercentList(pub Vec<u32>);

fn parse_percents(s: &str) -> std::result::Result<PercentList, String> {
    s.split(',')
        .map(|p| match p.trim().parse::<u32>() {
            Ok(v) if (1..=100).contains(&v) => Ok(v),
            _ => Err(format!("`{p}` is not a percentage in 1..=100")),
        })
        .collect::<std::result::Result<_, _>>()
        .map(PercentList)
}

#[derive(Debug, Args)]
pub struct SparseArgs {
    /// Model width: the length of each bundle part.
    #[arg(long, env = "GPU_OFFLOAD_SPARSE_D", default_value_t = 4096)]
    pub d: usize,
    /// FFN neurons of the layer.
    #[arg(long, env = "GPU_OFFLOAD_SPARSE_NEURONS", default_value_t = 11008)]
    pub neurons: usize,
    /// Bundle encodings to time: f32, f16, bf16, int8, int4 (comma-separated).
    #[arg(long, env = "GPU_OFFLOAD_SPARSE_ENCODINGS", value_parser = parse_encodings, default_value = "f16,int8,int4")]
    pub encodings: EncodingList,
    /// Active neurons, percent of the layer (comma-separated); random lists, cycled per rep.
    #[arg(long, env = "GPU_OFFLOAD_SPARSE_ACTIVE", value_parser = parse_percents, default_value = "10,30,50,100")]
    pub active: PercentList,
    /// Tokens per product.
    #[arg(long, env = "GPU_OFFLOAD_TOKENS", default_value_t = 1)]
    pub tokens: usize,
    /// Products per timing (the median of 5 timings is reported).
    #[arg(long, env = "GPU_OFFLOAD_REPS", default_value_t = 10)]
    pub reps: usize,
    /// CPU threads.
    #[arg(long, short = 't', env = "GPU_OFFLOAD_THREADS")]
    pub threads: Option<usize>,
    /// Take the DRAM bound from this hardware profile (a preset name in configs/ or a JSON
    /// file) instead of measuring it now.
    #[arg(long, env = "GPU_OFFLOAD_HARDWARE")]
    pub hardware: Option<String>,
    #[arg(long, env = "GPU_OFFLOAD_JSON")]
    pub json: bool,
}

/// A layer of random bundles in `enc` (valid, finite values: the kernels' speed must not depend
/// on NaN or denormal paths), as words so the float parts are aligned.
fn random_bundles(enc: Encoding, shape: crate::backend::BundleShape, neurons: usize) -> Vec<u32> {
    use rayon::prelude::*;
    let rb = enc.row_bytes(shape.parts * shape.d, shape.parts);
    let mut words = vec![0u32; (neurons * rb).div_ceil(4)];
    let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut words);
    bytes[..neurons * rb]
        .par_chunks_mut(rb)
        .enumerate()
        .for_each(|(i, row)| {
            let mut rng = StdRng::seed_from_u64(17 + i as u64);
            rng.fill(row);
            let groups = shape.d / crate::store::quant::INT4_GROUP;
            match enc {
                // Keep sign and mantissa, pin the exponent: values of magnitude 1/16 … 1/8.
                Encoding::Format(DType::F16) => row.chunks_exact_mut(2).for_each(|c| {
                    let v = u16::from_le_bytes([c[0], c[1]]) & 0x83ff | 0x2c00;
                    c.copy_from_slice(&v.to_le_bytes());
                }),
                Encoding::Format(DType::BF16) => row.chunks_exact_mut(2).for_each(|c| {
                    let v = u16::from_le_bytes([c[0], c[1]]) & 0x807f | 0x3d80;
                    c.copy_from_slice(&v.to_le_bytes());
                }),
                Encoding::Format(_) => row.chunks_exact_mut(4).for_each(|c| {
                    let v =
                        u32::from_le_bytes([c[0], c[1], c[2], c[3]]) & 0x807f_ffff | 0x3d80_0000;
                    c.copy_from_slice(&v.to_le_bytes());
                }),
                Encoding::Int8 => row[..shape.parts * 4]
                    .chunks_exact_mut(4)
                    .for_each(|c| c.copy_from_slice(&0.01f32.to_le_bytes())),
                Encoding::Int4 => row[..shape.parts * groups * 2]
                    .chunks_exact_mut(2)
                    .for_each(|c| c.copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes())),
            }
        });
    words
}

/// Seconds per call of `f(rep)` (median of 5 timings of `reps` calls).
fn median_secs(reps: usize, mut f: impl FnMut(usize) -> Result<()>) -> Result<f64> {
    f(0)?;
    let mut times = Vec::new();
    for _ in 0..5 {
        let t0 = Instant::now();
        for i in 0..reps {
            f(i)?;
        }
        times.push(t0.elapsed().as_secs_f64() / reps as f64);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[2])
}

/// Fresh random lists, cycled, so one rep's bundles are not the next one's cache hits.
const LISTS: usize = 8;

/// A `bench sparse` run: the CPU backend, kernels and DRAM bound every encoding is timed
/// against, and the input every product shares.
pub struct SparseBench<'a> {
    a: &'a SparseArgs,
    shape: BundleShape,
    be: CpuBackend,
    k: &'static Kernels,
    /// The DRAM read rate every figure is bounded by, bytes/s.
    pub bound: f64,
    /// Where the bound came from ("profile NAME", "measured live (…)").
    pub source: String,
    x: Vec<f32>,
    /// Draws the active lists, encoding after encoding.
    rng: StdRng,
}

/// One encoding timed: a JSON row per active fraction (smallest first), and whether the dense
/// bundle kernels were its baseline (else sparse at 100%).
pub struct EncodingRows {
    pub rows: Vec<Value>,
    pub dense_kernel: bool,
}

impl<'a> SparseBench<'a> {
    /// The flags checked, the backend and bound ready, the shared input drawn.
    pub fn new(a: &'a SparseArgs) -> Result<Self> {
        let (d, neurons, n) = (a.d, a.neurons, a.tokens);
        if d == 0 || neurons == 0 || n == 0 || a.reps == 0 {
            bail!("--d, --neurons, --tokens and --reps must be positive");
        }
        let shape = BundleShape { parts: 3, d };
        let be = CpuBackend::new(a.threads.unwrap_or(0))?;
        let k = kernels::best();
        let profile = a
            .hardware
            .as_deref()
            .map(HardwareProfile::load)
            .transpose()
            .map_err(anyhow::Error::msg)?;
        let (bound, source) = match &profile {
            Some(p) => (p.dram_read_bytes_per_s, format!("profile {}", p.name)),
            None => (
                crate::runtime::probe::dram_read_bandwidth(be.threads(), 512 << 20, 5),
                format!("measured live ({} threads)", be.threads()),
            ),
        };
        let mut rng = StdRng::seed_from_u64(5);
        let x: Vec<f32> = (0..n * d).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        Ok(SparseBench {
            a,
            shape,
            be,
            k,
            bound,
            source,
            x,
            rng,
        })
    }

    pub fn threads(&self) -> usize {
        self.be.threads()
    }

    /// The name of the kernel set the products run.
    pub fn kernels(&self) -> &'static str {
        self.k.name
    }

    /// Time `enc` at every active fraction of `--active`.
    pub fn encoding(&mut self, enc: Encoding) -> Result<EncodingRows> {
        let a = self.a;
        let (d, neurons, n) = (a.d, a.neurons, a.tokens);
        let (shape, k, bound) = (self.shape, self.k, self.bound);
        let (be, x, source) = (&self.be, &self.x, &self.source);
        let silu: fn(f32) -> f32 = |x| x / (1.0 + (-x).exp());
        if enc == Encoding::Int4 && !d.is_multiple_of(crate::store::quant::INT4_GROUP) {
            bail!("int4 bundles need --d a multiple of 32");
        }
        let rb = enc.row_bytes(shape.parts * d, shape.parts);
        let layer = random_bundles(enc, shape, neurons);
        let layer_bytes = neurons * rb;
        // Copies so the cycle exceeds the last-level cache (as `bench matvec` does).
        let copies = MATVEC_WORKING_SET.div_ceil(layer_bytes).max(1);
        let bufs: Vec<Vec<u32>> = (0..copies).map(|_| layer.clone()).collect();
        drop(layer);
        let views = bufs
            .iter()
            .map(|w| Bundles::new(&bytemuck::cast_slice(w)[..layer_bytes], enc, shape))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let dense_secs = self.dense_seconds(enc, &bufs, layer_bytes, copies)?;
        let rng = &mut self.rng;
        let mut full_secs = None;
        let mut pct: Vec<u32> = a.active.0.clone();
        // 100% first: it is the dense baseline of the encodings without dense kernels.
        pct.sort_by_key(|&p| std::cmp::Reverse(p));
        let mut enc_rows = Vec::new();
        for p in pct {
            let m = (neurons * p as usize).div_ceil(100);
            let lists: Vec<Vec<u32>> = (0..LISTS)
                .map(|_| {
                    let mut all: Vec<u32> = (0..neurons as u32).collect();
                    rand::seq::SliceRandom::shuffle(&mut all[..], rng);
                    all.truncate(m);
                    all
                })
                .collect();
            let mut h = vec![0f32; n * m];
            let mut out = vec![0f32; n * d];
            let mut time = |split: DownSplit| -> Result<f64> {
                be.enter(|| {
                    median_secs(a.reps, |i| {
                        let (b, idx) = (&views[i % copies], &lists[i % LISTS]);
                        sparse_up(k, b, idx, x, n, silu, None, &mut h)?;
                        sparse_down_split(k, b, (idx, idx), &h, n, &mut out, split)?;
                        Ok(())
                    })
                })
            };
            // `sparse_down`'s split, and the other one beside it.
            let secs = time(DownSplit::Output)?;
            let partials_split = time(DownSplit::Partials)?;
            if p == 100 {
                full_secs = Some(secs);
            }
            let bytes = (m * rb) as f64;
            let rate = bytes / secs;
            let base = dense_secs.or(full_secs);
            if rate > bounds::TOLERANCE * bound {
                bail!(
                    "sparse: measured {:.3} GB/s is {:.2}× the DRAM read bound {:.3} GB/s ({source}): the bound is wrong, or the working set fits a cache",
                    rate / 1e9,
                    rate / bound,
                    bound / 1e9
                );
            }
            enc_rows.push(json!({"encoding": enc.name(), "active_percent": p, "neurons": m,
                "seconds": secs, "seconds_partials_split": partials_split, "bytes": bytes,
                "bytes_per_s": rate, "fraction_of_dram": rate / bound,
                "dense_seconds": base, "dense_is": if dense_secs.is_some() { "bundles::up+down" } else { "sparse at 100%" },
                "speedup": base.map(|b| b / secs)}));
        }
        enc_rows.reverse();
        Ok(EncodingRows {
            rows: enc_rows,
            dense_kernel: dense_secs.is_some(),
        })
    }

    /// Seconds per product of the dense bundle kernels on `enc`'s layer (`bufs`, `copies` of
    /// it), for the encodings they take.
    fn dense_seconds(
        &self,
        enc: Encoding,
        bufs: &[Vec<u32>],
        layer_bytes: usize,
        copies: usize,
    ) -> Result<Option<f64>> {
        let a = self.a;
        let (d, neurons, n) = (a.d, a.neurons, a.tokens);
        let (shape, k, be, x) = (self.shape, self.k, &self.be, &self.x);
        let silu: fn(f32) -> f32 = |x| x / (1.0 + (-x).exp());
        // The dense bundle kernels take f32/f16 bundles only.
        // A tensor over each copy: a clone would share one buffer (an `Arc`), which the last
        // level cache then held (the dense figures came out above the DRAM bound).
        let dense = matches!(enc.dtype(), Some(DType::F16 | DType::F32)).then(|| {
            bufs[..copies]
                .iter()
                .map(|buf| HostTensor {
                    name: "dense".into(),
                    rows: neurons,
                    cols: shape.parts * d,
                    dtype: enc.dtype().unwrap_or(DType::F16),
                    data: Bytes::from_slice(&bytemuck::cast_slice(buf)[..layer_bytes]),
                })
                .collect::<Vec<_>>()
        });
        let dense_secs = match &dense {
            Some(ts) => {
                let mut h = vec![0f32; n * neurons];
                let mut out = vec![0f32; n * d];
                Some(be.enter(|| {
                    median_secs(a.reps, |i| {
                        let t = &ts[i % copies];
                        bundles::up(k, t, shape, x, n, silu, 0.0, None, &mut h, neurons, 0);
                        bundles::down(k, t, shape, &h, n, neurons, 0, &mut out);
                        Ok(())
                    })
                })?)
            }
            None => None,
        };
        drop(dense);
        Ok(dense_secs)
    }

    /// The `--json` object: the setup and every encoding's `rows`.
    pub fn json(&self, rows: Vec<Value>) -> Value {
        let (d, neurons, n) = (self.a.d, self.a.neurons, self.a.tokens);
        let (be, k, bound, source) = (&self.be, self.k, self.bound, &self.source);
        json!({"d": d, "neurons": neurons, "tokens": n, "gated": true, "threads": be.threads(),
               "kernels": k.name, "dram_read_bytes_per_s": bound, "bound_from": source,
               "rows": rows})
    }
}
