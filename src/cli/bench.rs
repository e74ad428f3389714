//! `gpu-offload bench`: measured speed beside its physical bound, in one run.
//! - `matvec`: one weight matrix times a few vectors; bytes/s against the memory it streams from.
//! - `attention`: a prompt's causal attention over its cache (the prefill kernel, or the decode
//!   kernel for a few rows); FLOP/s beside a matrix product's of the same rows, same run.
//! - `sparse`: the neuron-sparse FFN kernels (`backend::cpu::sparse`) on a 7B-shaped layer at
//!   several active fractions: bytes/s on the bundles they touch against the DRAM read rate, and
//!   the speed-up over the dense bundle kernels.
//! - `decode`: a model end to end (TTFT, prefill and decode tokens/s) against the bound of the
//!   resource it must move bytes through (device memory, PCIe, DRAM or SSD).
//! - `suite`: the consumer-GPU benchmark: a matrix of `--gpu-mem` budgets × prompt lengths,
//!   every figure beside its bound and the plan's prediction, peers in the same run, written as
//!   JSON, Markdown and SVG plots (the harness is `crate::bench`; this file loads and drives).
//! - `contexts`: the LLMS trace benchmark (`crate::bench::contexts`): context-switch latency and
//!   TTFT of five ways to keep contexts, on one trace.
//!
//! Bounds are measured rates (or a `--hardware` profile's figures); a figure more than 5% above
//! its bound is an error: the bound is wrong.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use serde_json::{Value, json};

use crate::backend::Backend;
use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::CudaBackend;
use crate::bench::bounds::{self, Bound, Rates, Traffic};
use crate::bench::suite::BudgetPoint;
use crate::bench::suite::peers::{LlamaBench, PeerHf, PeerJob};
use crate::bench::suite::report::{
    DeviceInfo, Emulation, ModelInfo, SCHEMA, Settings, SuiteReport,
};
use crate::bench::suite::{self, BudgetChoice, CellJob, CellOutcome, CellRun, CellRunner, Matrix};
use crate::bench::{measure, plot};
use crate::footprint::Ledger;
use crate::plan::{Budget, HardwareProfile, PlanError, make_plan};
use crate::runtime::parse_bytes;
use crate::runtime::store::open_store_for;
use crate::runtime::{AnyEngine, Job, Running, with_engine};
use crate::runtime::{Device, LoadedModel, ModelArgs};
use crate::store::{Encoding, Manifest};
use crate::tensor::{Bytes, DType, HostTensor};

#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub what: BenchWhat,
}

#[derive(Debug, Subcommand)]
pub enum BenchWhat {
    /// Matrix × vector(s): achieved bandwidth against the device's.
    Matvec(MatvecArgs),
    /// Causal attention of query rows over a KV cache (the prefill kernel for a prompt, the
    /// decode kernel for a few rows over a long context): FLOP/s beside a matrix product's of
    /// as many rows in the same run.
    Attention(AttentionArgs),
    /// Neuron-sparse FFN (PowerInfer-style) on the CPU: bandwidth on the bytes touched and
    /// speed-up over dense, at several active fractions.
    Sparse(SparseArgs),
    /// A model end to end: TTFT, prefill and decode tokens/s against the bound.
    Decode(DecodeArgs),
    /// The consumer-GPU benchmark: --gpu-mem budgets × prompt lengths, bounds, predictions and
    /// peers; writes suite.json, suite.md and SVG plots.
    Suite(SuiteArgs),
    /// HBM cache units (M2Cache): on a decode trace of held-out text, the share of each token's
    /// active neurons already in the unit under the adjacent-token update, against an LRU of the
    /// same size and against reloading the whole active set.
    Units(super::units::UnitsArgs),
    /// Mixed-precision neurons (M2Cache): the cache-unit engine's perplexity on calibration
    /// text at each candidate share of f16 / INT8 / INT4 neurons, against all-f16, and what
    /// each saves per token; saved in the store for --neuron-precision auto.
    Precision(super::precision::PrecisionArgs),
    /// Persistent contexts (LLMS) on a trace: N contexts, Poisson calls, only --resident of them
    /// on the device; recompute, whole swap, chunked swap (exact, int8) and ours compared on
    /// context-switch latency, TTFT and the contexts served within a latency target; writes
    /// contexts.json, contexts.md and contexts.svg.
    Contexts(ContextsArgs),
}

/// A storage format by name (`f16`, `q4_k`, …).
fn parse_dtype(s: &str) -> std::result::Result<DType, String> {
    DType::parse(s).ok_or_else(|| {
        let names: Vec<&str> = DType::ALL.iter().map(|d| d.name()).collect();
        format!("`{s}` is not a weight format ({})", names.join(", "))
    })
}

#[derive(Debug, Args)]
pub struct MatvecArgs {
    /// cpu or cuda.
    #[arg(long, env = "GPU_OFFLOAD_DEVICE", value_enum, default_value = "auto")]
    pub device: Device,
    /// Output rows (neurons).
    #[arg(long, env = "GPU_OFFLOAD_ROWS", default_value_t = 11008)]
    pub rows: usize,
    /// Input columns.
    #[arg(long, env = "GPU_OFFLOAD_COLS", default_value_t = 4096)]
    pub cols: usize,
    /// Weight format: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_k … q6_k.
    #[arg(long, env = "GPU_OFFLOAD_DTYPE", value_parser = parse_dtype, default_value = "f16")]
    pub dtype: DType,
    /// Vectors per product.
    #[arg(long, env = "GPU_OFFLOAD_TOKENS", default_value_t = 1)]
    pub tokens: usize,
    /// Repetitions.
    #[arg(long, env = "GPU_OFFLOAD_REPS", default_value_t = 50)]
    pub reps: usize,
    /// CPU threads.
    #[arg(long, short = 't', env = "GPU_OFFLOAD_THREADS")]
    pub threads: Option<usize>,
    /// Take the bound from this hardware profile (a preset name in configs/ or a JSON file)
    /// instead of measuring the memory's read rate now.
    #[arg(long, env = "GPU_OFFLOAD_HARDWARE")]
    pub hardware: Option<String>,
    #[arg(long, env = "GPU_OFFLOAD_JSON")]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct AttentionArgs {
    /// cpu or cuda.
    #[arg(long, env = "GPU_OFFLOAD_DEVICE", value_enum, default_value = "auto")]
    pub device: Device,
    /// Query rows (a prompt's tokens in one step).
    #[arg(long, env = "GPU_OFFLOAD_ROWS", default_value_t = 4000)]
    pub rows: usize,
    /// Positions in the cache before the rows (the rows sit at positions context.. and see
    /// every position up to their own).
    #[arg(long, env = "GPU_OFFLOAD_CONTEXT", default_value_t = 0)]
    pub context: usize,
    /// Query heads.
    #[arg(long, env = "GPU_OFFLOAD_HEADS", default_value_t = 32)]
    pub heads: usize,
    /// Key/value heads (a divisor of --heads: grouped-query attention below it).
    #[arg(long, env = "GPU_OFFLOAD_KV_HEADS", default_value_t = 32)]
    pub kv_heads: usize,
    /// Dims per head.
    #[arg(long, env = "GPU_OFFLOAD_HEAD_DIM", default_value_t = 128)]
    pub head_dim: usize,
    /// KV cache type.
    #[arg(long, env = "GPU_OFFLOAD_KV_TYPE", value_enum, default_value = "f16")]
    pub kv_type: crate::runtime::KvTypeArg,
    /// CUDA: split a prompt's keys this many ways on tensor cores (1: unsplit; at most 4, as
    /// far as 32.5 MiB of partials holds: 2048 rows × splits of 7B heads), instead of as many
    /// as fill the device, to set one beside the other.
    #[arg(long, env = "GPU_OFFLOAD_FLASH_SPLITS", value_parser = clap::value_parser!(u32).range(1..=4))]
    pub flash_splits: Option<u32>,
    /// Repetitions.
    #[arg(long, env = "GPU_OFFLOAD_REPS", default_value_t = 5)]
    pub reps: usize,
    /// CPU threads.
    #[arg(long, short = 't', env = "GPU_OFFLOAD_THREADS")]
    pub threads: Option<usize>,
    #[arg(long, env = "GPU_OFFLOAD_JSON")]
    pub json: bool,
}

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

#[derive(Debug, Args)]
pub struct DecodeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt length in tokens (random ids).
    #[arg(long, env = "GPU_OFFLOAD_PROMPT_TOKENS", default_value_t = 32)]
    pub prompt_tokens: usize,
    /// Tokens to decode.
    #[arg(long, short = 'n', env = "GPU_OFFLOAD_TOKENS", default_value_t = 64)]
    pub tokens: usize,
    /// Repetitions (the median is reported).
    #[arg(long, env = "GPU_OFFLOAD_REPS", default_value_t = 3)]
    pub reps: usize,
    /// Decode this many sequences at once (continuous batching: one step evaluates a token of
    /// each), beside one sequence alone in the same run: aggregate tokens/s of both.
    #[arg(long, env = "GPU_OFFLOAD_SESSIONS", default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=512))]
    pub sessions: u16,
    #[arg(long, env = "GPU_OFFLOAD_JSON")]
    pub json: bool,
}

pub fn run(a: BenchArgs) -> Result<()> {
    match a.what {
        BenchWhat::Matvec(m) => matvec(m),
        BenchWhat::Attention(a) => attention(a),
        BenchWhat::Sparse(s) => sparse(s),
        BenchWhat::Decode(d) => decode(d),
        BenchWhat::Suite(s) => suite_cmd(s),
        BenchWhat::Units(u) => super::units::units(u),
        BenchWhat::Precision(p) => super::precision::run(p),
        BenchWhat::Contexts(c) => contexts_cmd(c),
    }
}

/// Random values in [-1, 1) quantized into `dtype` by the reference quantizers, a row at a time.
fn random_weight(dtype: DType, rows: usize, cols: usize) -> HostTensor {
    use rayon::prelude::*;
    let rb = dtype.bytes_for(cols);
    let mut bytes = vec![0u8; rows * rb];
    bytes.par_chunks_mut(rb).enumerate().for_each(|(r, out)| {
        let mut rng = StdRng::seed_from_u64(9 + r as u64);
        let x: Vec<f32> = (0..cols).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        crate::tensor::quantize_row(dtype, &x, out);
    });
    HostTensor {
        name: "bench".into(),
        rows,
        cols,
        dtype,
        data: Bytes::from_slice(&bytes),
    }
}

/// Bytes of weights the products cycle through, so no cache holds them between uses (a
/// matrix a last-level cache holds would be read at cache speed, beating the memory bound):
/// 256 MiB, far above the caches of the GPUs and CPUs we bound (H100 L2 50 MB).
const MATVEC_WORKING_SET: usize = 256 << 20;

/// Seconds per product (median of 5 timings of `reps` products each), cycling through copies
/// of `w` that together exceed [`MATVEC_WORKING_SET`].
fn time_matvec<B: Backend>(b: &B, w: &HostTensor, tokens: usize, reps: usize) -> Result<f64> {
    let copies = MATVEC_WORKING_SET.div_ceil(w.data.len().max(1)).max(1);
    let dws = (0..copies)
        .map(|_| b.upload(w))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let mut x = b.alloc(tokens, w.cols)?;
    b.write(&mut x, &vec![0.01; tokens * w.cols])?;
    let mut out = b.alloc(tokens, w.rows)?;
    let mut sink = vec![0f32; tokens * w.rows];
    // The workspace the product takes, as a forward step would hold it.
    b.set_workspace(b.workspace_bytes(&crate::backend::WorkspaceOp::Matmul {
        dtype: w.dtype,
        tokens,
        rows: w.rows,
        cols: w.cols,
    }))?;
    b.enter(move || -> Result<f64> {
        for dw in &dws {
            b.matmul(dw, &x, &mut out)?;
        }
        b.read(&out, &mut sink)?;
        let mut times = Vec::new();
        for _ in 0..5 {
            let t0 = Instant::now();
            for i in 0..reps {
                b.matmul(&dws[i % copies], &x, &mut out)?;
            }
            b.read(&out, &mut sink)?;
            times.push(t0.elapsed().as_secs_f64() / reps as f64);
        }
        times.sort_by(f64::total_cmp);
        Ok(times[2])
    })
}

fn matvec(a: MatvecArgs) -> Result<()> {
    let dtype = a.dtype;
    if !a.cols.is_multiple_of(dtype.block_len()) || a.rows == 0 || a.tokens == 0 || a.reps == 0 {
        bail!(
            "--cols must be a multiple of {} for {dtype}; rows, tokens and reps must be positive",
            dtype.block_len()
        );
    }
    let w = random_weight(dtype, a.rows, a.cols);
    let bytes = w.data.len() as f64;
    let cuda = match a.device {
        Device::Cuda => true,
        Device::Auto => crate::backend::cuda::device_available(),
        _ => false,
    };
    let profile = a
        .hardware
        .as_deref()
        .map(HardwareProfile::load)
        .transpose()
        .map_err(anyhow::Error::msg)?;
    let (secs, bound_name, bound, source) = if cuda {
        let be = CudaBackend::new(0, Ledger::new(None, None))?;
        let secs = time_matvec(&be, &w, a.tokens, a.reps)?;
        let (bw, source) = match &profile {
            Some(p) => (p.hbm_bytes_per_s, format!("profile {}", p.name)),
            None => {
                let g = crate::runtime::probe::probe_gpu(256 << 20).map_err(anyhow::Error::msg)?;
                (
                    bounds::hbm_read_rate(&g),
                    format!("measured live ({})", g.name),
                )
            }
        };
        (secs, "device memory read", bw, source)
    } else {
        let threads = a.threads.unwrap_or(0);
        let be = CpuBackend::new(threads)?;
        let secs = time_matvec(&be, &w, a.tokens, a.reps)?;
        let (bw, source) = match &profile {
            Some(p) => (p.dram_read_bytes_per_s, format!("profile {}", p.name)),
            None => (
                crate::runtime::probe::dram_read_bandwidth(be.threads(), 512 << 20, 5),
                format!("measured live ({} threads)", be.threads()),
            ),
        };
        (secs, "DRAM read", bw, source)
    };
    let achieved = bytes / secs;
    if a.json {
        println!(
            "{}",
            json!({"rows": a.rows, "cols": a.cols, "dtype": dtype.name(), "tokens": a.tokens, "seconds": secs,
                   "weight_bytes": bytes, "achieved_bytes_per_s": achieved, "bound": bound_name,
                   "bound_bytes_per_s": bound, "fraction_of_bound": achieved / bound,
                   "bound_from": source, "device": if cuda { "cuda" } else { "cpu" }})
        );
    } else {
        println!(
            "matvec {}x{} {dtype} × {} vector(s) on {}: {:.1} µs, {:.1} GB/s = {:.0}% of {} {:.1} GB/s ({source})",
            a.rows,
            a.cols,
            a.tokens,
            if cuda { "cuda" } else { "cpu" },
            secs * 1e6,
            achieved / 1e9,
            100.0 * achieved / bound,
            bound_name,
            bound / 1e9
        );
    }
    if achieved > bounds::TOLERANCE * bound {
        bail!(
            "matvec: measured {:.3} GB/s is {:.2}× its {bound_name} bound {:.3} GB/s ({source}): a figure above its bound means the bound is wrong — check that rate",
            achieved / 1e9,
            achieved / bound,
            bound / 1e9
        );
    }
    Ok(())
}

fn attention(a: AttentionArgs) -> Result<()> {
    if a.rows == 0 || a.reps == 0 || a.head_dim == 0 || a.heads == 0 {
        bail!("--rows, --reps, --heads and --head-dim must be positive");
    }
    if a.kv_heads == 0 || !a.heads.is_multiple_of(a.kv_heads) {
        bail!("--kv-heads must divide --heads ({})", a.heads);
    }
    let cuda = match a.device {
        Device::Cuda => true,
        Device::Auto => crate::backend::cuda::device_available(),
        Device::Cpu => false,
        Device::Sim => bail!("bench attention runs on cpu or cuda"),
    };
    let qd = a.heads * a.head_dim;
    let probe = crate::runtime::probe::AttentionProbe {
        rows: a.rows,
        context: a.context,
        heads: a.heads,
        kv_heads: a.kv_heads,
        head_dim: a.head_dim,
        kv: a.kv_type.kv_type(),
    };
    // The reference: a product of as many rows with a square f16 weight of the queries' width
    // (an attention layer's output projection), on the same device.
    if a.flash_splits.is_some() && !cuda {
        bail!("--flash-splits sets the CUDA prompt kernel; this run is on the CPU");
    }
    // Where a prompt runs on tensor cores, the ways its keys split.
    let (secs, matmul, device, splits) = if cuda {
        let be = CudaBackend::new(0, Ledger::new(None, None))?;
        be.set_flash_splits(a.flash_splits.map(|s| s as usize));
        let splits = be.prompt_splits(a.rows, probe.kv, a.heads, a.head_dim, a.context + a.rows)?;
        let secs = probe.seconds(&be, a.reps)?;
        let rate =
            crate::runtime::probe::matmul_rate(&be, a.rows, qd, qd).map_err(anyhow::Error::msg)?;
        (secs, rate, "cuda", splits)
    } else {
        let be = CpuBackend::new(a.threads.unwrap_or(0))?;
        let secs = probe.seconds(&be, a.reps)?;
        let rate =
            crate::runtime::probe::matmul_rate(&be, a.rows, qd, qd).map_err(anyhow::Error::msg)?;
        (secs, rate, "cpu", None)
    };
    let flops = probe.flops();
    let rate = flops / secs;
    let kv = format!("{:?}", a.kv_type.kv_type()).to_lowercase();
    if a.json {
        println!(
            "{}",
            json!({"rows": a.rows, "context": a.context, "heads": a.heads, "kv_heads": a.kv_heads,
                   "head_dim": a.head_dim, "kv_type": kv, "device": device,
                   "flash_splits": splits, "seconds": secs,
                   "flops": flops, "flops_per_s": rate, "matmul_flops_per_s": matmul,
                   "fraction_of_matmul": rate / matmul})
        );
    } else {
        println!(
            "attention of {} rows from position {} ({} heads / {} KV heads of {}, {kv} cache{}) on {device}: {:.3} ms, {:.2} TFLOP/s = {:.0}% of a {}x{qd}x{qd} f16 matrix product's {:.2} TFLOP/s",
            a.rows,
            a.context,
            a.heads,
            a.kv_heads,
            a.head_dim,
            splits.map_or(String::new(), |s| format!(", keys split {s} ways")),
            secs * 1e3,
            rate / 1e12,
            100.0 * rate / matmul,
            a.rows,
            matmul / 1e12
        );
    }
    Ok(())
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

fn sparse(a: SparseArgs) -> Result<()> {
    use crate::backend::BundleShape;
    use crate::backend::cpu::sparse::{Bundles, DownSplit, sparse_down_split, sparse_up};
    use crate::backend::cpu::{bundles, kernels};

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
    let silu: fn(f32) -> f32 = |x| x / (1.0 + (-x).exp());
    let mut rng = StdRng::seed_from_u64(5);
    let x: Vec<f32> = (0..n * d).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    // Fresh random lists, cycled, so one rep's bundles are not the next one's cache hits.
    const LISTS: usize = 8;
    let mut rows = Vec::new();
    if !a.json {
        println!(
            "sparse FFN {neurons} neurons × d {d}, gated, {n} token(s), {} threads, {} kernels; DRAM read bound {:.1} GB/s ({source})",
            be.threads(),
            k.name,
            bound / 1e9
        );
        println!(
            "{:<6} {:>7} {:>10} {:>10} {:>8} {:>7} {:>12} {:>10} {:>8}",
            "enc", "active", "µs", "MB", "GB/s", "÷DRAM", "partials µs", "dense µs", "speed-up"
        );
    }
    for &enc in &a.encodings.0 {
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
        // The dense bundle kernels take f32/f16 bundles only.
        let dense = matches!(enc.dtype(), Some(DType::F16 | DType::F32)).then(|| {
            let t = HostTensor {
                name: "dense".into(),
                rows: neurons,
                cols: shape.parts * d,
                dtype: enc.dtype().unwrap_or(DType::F16),
                data: Bytes::from_slice(&bytemuck::cast_slice(&bufs[0])[..layer_bytes]),
            };
            (0..copies).map(|_| t.clone()).collect::<Vec<_>>()
        });
        let dense_secs = match &dense {
            Some(ts) => {
                let mut h = vec![0f32; n * neurons];
                let mut out = vec![0f32; n * d];
                Some(be.enter(|| {
                    median_secs(a.reps, |i| {
                        let t = &ts[i % copies];
                        bundles::up(k, t, shape, &x, n, silu, 0.0, None, &mut h, neurons, 0);
                        bundles::down(k, t, shape, &h, n, neurons, 0, &mut out);
                        Ok(())
                    })
                })?)
            }
            None => None,
        };
        drop(dense);
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
                    rand::seq::SliceRandom::shuffle(&mut all[..], &mut rng);
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
                        sparse_up(k, b, idx, &x, n, silu, None, &mut h)?;
                        sparse_down_split(k, b, idx, &h, n, &mut out, split)?;
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
        for r in enc_rows {
            if !a.json {
                let f = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
                println!(
                    "{:<6} {:>6}% {:>10.0} {:>10.1} {:>8.1} {:>7.2} {:>12.0} {:>10.0} {:>7.2}×",
                    enc.name(),
                    r["active_percent"],
                    f("seconds") * 1e6,
                    f("bytes") / 1e6,
                    f("bytes_per_s") / 1e9,
                    f("fraction_of_dram"),
                    f("seconds_partials_split") * 1e6,
                    f("dense_seconds") * 1e6,
                    f("speedup"),
                );
            }
            rows.push(r);
        }
        if !a.json && dense_secs.is_none() {
            println!(
                "{:<6} (no dense kernel for {}: dense = sparse at 100%)",
                "",
                enc.name()
            );
        }
    }
    if a.json {
        println!(
            "{}",
            json!({"d": d, "neurons": neurons, "tokens": n, "gated": true, "threads": be.threads(),
                   "kernels": k.name, "dram_read_bytes_per_s": bound, "bound_from": source,
                   "rows": rows})
        );
    }
    Ok(())
}

/// Random prompt ids (seeded, so every run and every cell sees the same prompt).
fn random_prompt(n: usize, vocab: usize) -> Vec<u32> {
    random_prompt_seeded(n, vocab, 1)
}

fn random_prompt_seeded(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut rng = StdRng::seed_from_u64(seed);
    let hi = (vocab as u32).max(4);
    (0..n).map(|_| rng.random_range(3..hi)).collect()
}

fn device_of(r: &Running) -> &'static str {
    match &r.engine {
        AnyEngine::Cpu(_) => "cpu",
        AnyEngine::Sim(_) => "sim",
        AnyEngine::Cuda(_) => "cuda",
    }
}

fn threads_of(args: &ModelArgs) -> usize {
    args.threads.map_or_else(
        || std::thread::available_parallelism().map_or(1, |n| n.get()),
        usize::from,
    )
}

/// The rates bounds divide by: `hardware`'s figures when given, else measured now on
/// `device` (SSD only when `ssd_dir` is given).
fn rates_for(
    hardware: Option<&str>,
    emulate: Option<&str>,
    device: &str,
    threads: usize,
    ssd_dir: Option<&Path>,
) -> Result<Rates> {
    let rates = match hardware {
        Some(h) => Rates::from_profile(&HardwareProfile::load(h).map_err(anyhow::Error::msg)?),
        None => match device {
            "cuda" => {
                bounds::measure_gpu(threads, ssd_dir)
                    .map_err(anyhow::Error::msg)?
                    .0
            }
            _ => bounds::measure_sim(threads, ssd_dir),
        },
    };
    Ok(match emulate {
        Some(card) => rates.emulating(&HardwareProfile::load(card).map_err(anyhow::Error::msg)?),
        None => rates,
    })
}

/// Bytes per decoded token of a running model at positions `first..first + steps`: the plan's
/// for an offloaded run; every weight and the KV so far from device memory (CUDA) or DRAM (CPU)
/// for a whole-model run.
fn traffic_of(r: &Running, first: usize, steps: usize) -> Traffic {
    // Hybrid: the device reads attention and hot neurons, the CPU the cold ones, PCIe carries
    // two vectors a layer. Cache units: the device reads attention and the active neurons in
    // their units, PCIe carries the loads, the CPU reads the deciding vectors (oracle masks).
    // Both expected at the profile's frequencies.
    let sparse = r
        .hybrid
        .as_ref()
        .map(|h| &h.plan.per_token)
        .or(r.units.as_ref().map(|u| &u.plan.per_token));
    if let Some(p) = sparse {
        return Traffic {
            hbm_read_bytes: p.hbm_bytes as f64,
            h2d_bytes: p.pcie_bytes as f64,
            dram_read_bytes: p.cpu_bytes as f64,
            ssd_read_bytes: 0.0,
        };
    }
    match (&r.plan, &r.traffic) {
        (Some(plan), _) => Traffic::of_plan(plan),
        (None, Some(t)) if device_of(r) == "cuda" => Traffic {
            hbm_read_bytes: t.mean(first, steps),
            ..Default::default()
        },
        (None, Some(t)) => Traffic {
            dram_read_bytes: t.mean(first, steps),
            ..Default::default()
        },
        (None, None) => Traffic::default(),
    }
}

/// The directory offloaded weights are read from (the SSD the bound's SSD rate is of).
fn store_dir_for(model: &Path) -> PathBuf {
    if crate::store::Store::is_store(model) {
        model.to_path_buf()
    } else {
        crate::model::models_dir()
    }
}

fn decode(a: DecodeArgs) -> Result<()> {
    if a.tokens < 2 || a.prompt_tokens == 0 || a.reps == 0 {
        bail!("--tokens must be at least 2; --prompt-tokens and --reps at least 1");
    }
    if a.sessions > 1 {
        return decode_sessions(a);
    }
    let loaded = LoadedModel::load(&a.model)?;
    let spec = loaded.spec().clone();
    let ctx = a.prompt_tokens + a.tokens;
    if ctx > spec.max_context {
        bail!(
            "{ctx} positions exceed the model's maximum of {}",
            spec.max_context
        );
    }
    let prompt = random_prompt(a.prompt_tokens, spec.vocab_size);
    let running = loaded.start(&a.model, Job::single(ctx, a.prompt_tokens, 1))?;
    let m = with_engine!(&running.engine, e => {
        measure(e, ctx, &prompt, a.tokens, a.reps, &|| running.snapshot())?
    });
    let memory = running.memory_json(m.after_prefill, m.end, prompt.len(), m.decode_steps);
    let device = device_of(&running);
    let traffic = traffic_of(&running, prompt.len(), m.decode_steps);
    let ssd_dir = (traffic.ssd_read_bytes > 0.0).then(|| store_dir_for(&loaded.path));
    let rates = rates_for(
        a.model.budget.hardware.as_deref(),
        a.model.budget.emulate.as_deref(),
        device,
        threads_of(&a.model),
        ssd_dir.as_deref(),
    )?;
    let bound = Bound::of(&traffic, &rates);
    let predicted = match (&running.hybrid, &running.units) {
        (Some(h), _) => Some(h.plan.predicted_tokens_per_s),
        (_, Some(u)) => Some(u.plan.predicted_tokens_per_s),
        _ => running.plan.as_ref().map(|p| p.prediction.tokens_per_s),
    };
    // What the cache units moved, against what the plan expected per token.
    let units = running.units.as_ref().map(|u| {
        let [needed, loads, bytes] = u.traffic.snapshot();
        json!({"needed": needed, "loads": loads, "bytes": bytes,
               "hit_ratio": if needed == 0 { 1.0 } else { 1.0 - loads as f64 / needed as f64 },
               "expected_pcie_bytes_per_token": u.plan.per_token.pcie_bytes,
               "slots": u.plan.slots(), "device_bytes": u.plan.device.total})
    });
    // What the CPU read for cold neurons, against what the plan expected per token.
    let cold = running.hybrid.as_ref().map(|h| {
        let [bytes, candidates, active, units] = h.traffic.snapshot();
        json!({"cpu_bytes_total": bytes, "candidates": candidates, "active": active,
               "down_blocks": units, "expected_cpu_bytes_per_token": h.plan.per_token.cpu_bytes,
               "hot_neurons": h.plan.layers.iter().map(|l| l.neurons).sum::<usize>(),
               "device_bytes": h.plan.device.total})
    });
    // Decode steps recorded (`--cuda-graphs`) and replayed over all repetitions.
    let (recorded, replayed) = with_engine!(&running.engine, e => e.recorded_steps());
    // Rows the prompt's steps took (a longer prompt runs layer by layer in groups of this many).
    let prefill_step = with_engine!(&running.engine, e => e.prefill().group);
    let out = json!({
        "model": spec.name, "device": device, "prompt_tokens": a.prompt_tokens, "decode_tokens": a.tokens,
        "prefill_step_rows": prefill_step.min(a.prompt_tokens),
        "cuda_graphs": {"on": a.model.cuda_graphs, "recorded": recorded, "replayed": replayed},
        "programmatic_launch": a.model.programmatic_launch,
        "device_ops_per_decode_step": m.device_ops_per_decode_step,
        "reps": a.reps, "ttft_s": m.ttft_s, "prefill_tokens_per_s": m.prefill_tokens_per_s,
        "decode_tokens_per_s": m.decode_tokens_per_s,
        "bound": format!("{} (bytes per token ÷ rate)", bound.limited_by),
        "bound_limited_by": bound.limited_by, "bound_tokens_per_s": bound.tokens_per_s,
        "bound_seconds": bound.seconds, "fraction_of_bound": m.decode_tokens_per_s / bound.tokens_per_s,
        "predicted_tokens_per_s": predicted, "rates": rates,
        "load_s": running.load_s, "memory": memory, "hybrid": cold, "cache_units": units,
    });
    if a.json {
        println!("{out}");
    } else {
        println!(
            "{} on {device}: TTFT {:.1} ms ({} prompt tokens in steps of {}, {:.0} tok/s), decode {:.2} tok/s = {:.0}% of the {} bound {:.2} tok/s ({}){}",
            spec.name,
            m.ttft_s * 1e3,
            a.prompt_tokens,
            prefill_step.min(a.prompt_tokens),
            m.prefill_tokens_per_s,
            m.decode_tokens_per_s,
            100.0 * m.decode_tokens_per_s / bound.tokens_per_s,
            bound.limited_by,
            bound.tokens_per_s,
            rates.source,
            predicted.map_or(String::new(), |p| format!(
                "; the plan predicted {p:.2} tok/s"
            ))
        );
        if a.model.cuda_graphs {
            println!("decode steps recorded {recorded}, replayed {replayed}");
        }
        if let Some(k) = m.device_ops_per_decode_step {
            println!("{k:.1} device operations (kernels, on-device copies) per decode step");
        }
    }
    bounds::check("decode (tokens/s)", m.decode_tokens_per_s, &bound, &rates)?;
    Ok(())
}

/// `bench decode --sessions N`: N sequences decoded together (one batched step per token of
/// each) against one alone, in one run on one engine: aggregate decode tokens/s of each.
fn decode_sessions(a: DecodeArgs) -> Result<()> {
    let loaded = LoadedModel::load(&a.model)?;
    let spec = loaded.spec().clone();
    let n = a.sessions as usize;
    let ctx = a.prompt_tokens + a.tokens + 1;
    if ctx > spec.max_context {
        bail!(
            "{ctx} positions exceed the model's maximum of {}",
            spec.max_context
        );
    }
    let job = Job {
        sessions: n,
        logit_rows: n,
        ..Job::single(ctx, a.prompt_tokens.max(n), 1)
    };
    let running = loaded.start(&a.model, job)?;
    let prompts: Vec<Vec<u32>> = (0..n)
        .map(|i| random_prompt_seeded(a.prompt_tokens, spec.vocab_size, 100 + i as u64))
        .collect();
    let argmax = crate::engine::sampler::argmax;
    let (one, many) = with_engine!(&running.engine, e => {
        let mut one = Vec::new();
        let mut many = Vec::new();
        for _ in 0..a.reps {
            // One sequence alone.
            let mut s = e.new_session(ctx)?;
            let mut next = argmax(&e.forward(&mut s, &prompts[0], crate::engine::Logits::Last)?);
            let t0 = Instant::now();
            for _ in 0..a.tokens {
                next = argmax(&e.forward(&mut s, &[next], crate::engine::Logits::Last)?);
            }
            one.push(a.tokens as f64 / t0.elapsed().as_secs_f64());
            drop(s);
            // All of them together.
            let mut ss = Vec::with_capacity(n);
            let mut last = Vec::with_capacity(n);
            for p in &prompts {
                let mut s = e.new_session(ctx)?;
                last.push(argmax(&e.forward(&mut s, p, crate::engine::Logits::Last)?));
                ss.push(s);
            }
            let group = e.prefill().group;
            let t0 = Instant::now();
            for _ in 0..a.tokens {
                let mut calls: Vec<_> = ss.iter_mut().zip(&last).map(|(s, &t)| (s, t)).collect();
                let mut out = Vec::with_capacity(n);
                for c in calls.chunks_mut(group) {
                    out.extend(e.decode_many(c)?);
                }
                last = out.iter().map(|l| argmax(l)).collect();
            }
            many.push((n * a.tokens) as f64 / t0.elapsed().as_secs_f64());
        }
        (one, many)
    });
    let (one, many) = (measure::median(one), measure::median(many));
    let out = json!({
        "model": spec.name, "device": device_of(&running), "sessions": n,
        "prompt_tokens": a.prompt_tokens, "decode_tokens": a.tokens, "reps": a.reps,
        "single_decode_tokens_per_s": one, "aggregate_decode_tokens_per_s": many,
        "speedup": many / one,
        "prefill_layout": running.plan.as_ref().map(|p| p.prefill),
    });
    if a.json {
        println!("{out}");
    } else {
        println!(
            "{} on {}: {n} sequences together {:.1} tok/s in all, one alone {:.1} tok/s ({:.2}×)",
            spec.name,
            device_of(&running),
            many,
            one,
            many / one
        );
    }
    Ok(())
}

// ------------------------------------------------------------------------------ bench suite

/// `--budgets`: sizes and the words `whole` and `min`.
#[derive(Clone, Debug)]
pub struct BudgetList(pub Vec<BudgetChoice>);

fn parse_budgets(s: &str) -> std::result::Result<BudgetList, String> {
    suite::parse_budget_list(s, parse_bytes).map(BudgetList)
}

/// `--prompts`: prompt lengths in tokens.
#[derive(Clone, Debug)]
pub struct PromptList(pub Vec<usize>);

fn parse_prompts(s: &str) -> std::result::Result<PromptList, String> {
    suite::parse_prompt_list(s).map(PromptList)
}

#[derive(Debug, Args)]
pub struct SuiteArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Benchmark a synthesized model of this shape instead of -m (tiny, 1b, 7b, 13b), written
    /// once into the cache.
    #[arg(long, env = "GPU_OFFLOAD_PRESET")]
    pub preset: Option<String>,
    /// Directory for suite.json, suite.md and the plots (created if missing).
    #[arg(long, short = 'o', env = "GPU_OFFLOAD_OUT")]
    pub out: PathBuf,
    /// --gpu-mem budgets: sizes and the words `whole` (no budget) and `min` (the smallest the
    /// plan accepts) [default: whole, 24G, 12G, 8G, 4G, min — those between min and whole]
    #[arg(long, env = "GPU_OFFLOAD_BUDGETS", value_parser = parse_budgets)]
    pub budgets: Option<BudgetList>,
    /// Prompt lengths for TTFT (those within the model's context are run).
    #[arg(long, env = "GPU_OFFLOAD_PROMPTS", value_parser = parse_prompts, default_value = "128,2048,8192")]
    pub prompts: PromptList,
    /// Prompt tokens before the decode measurement.
    #[arg(long, env = "GPU_OFFLOAD_DECODE_PROMPT", default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..))]
    pub decode_prompt: u32,
    /// Tokens to decode per budget.
    #[arg(long = "tokens", short = 'n', env = "GPU_OFFLOAD_TOKENS", default_value_t = 64, value_parser = clap::value_parser!(u32).range(2..))]
    pub tokens: u32,
    /// Measured repetitions per cell after a warm-up (the median is reported).
    #[arg(long, env = "GPU_OFFLOAD_REPS", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub reps: u32,
    /// llama.cpp's llama-bench binary, run beside ours (needs the model as GGUF).
    #[arg(long, env = "GPU_OFFLOAD_LLAMA_BENCH")]
    pub llama_bench: Option<PathBuf>,
    /// The model as GGUF for llama-bench [default: -m when it is a GGUF file]
    #[arg(long, env = "GPU_OFFLOAD_PEER_GGUF")]
    pub peer_gguf: Option<PathBuf>,
    /// A python with torch + transformers + accelerate: runs scripts/peer_hf.py beside ours
    /// (needs the model as an HF directory).
    #[arg(long, env = "GPU_OFFLOAD_PEER_HF")]
    pub peer_hf: Option<PathBuf>,
    /// Seconds one peer run may take.
    #[arg(long, env = "GPU_OFFLOAD_PEER_TIMEOUT", default_value_t = 1800)]
    pub peer_timeout: u64,
}

/// Whether loading failed because the plan refused the budget.
fn refused(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        matches!(
            c.downcast_ref::<PlanError>(),
            Some(PlanError::GpuTooSmall { .. } | PlanError::DramTooSmall { .. })
        )
    })
}

/// Runs the suite's cells with the CLI's loader: one load per cell, sized for its job.
struct LoaderCells<'a> {
    args: &'a mut ModelArgs,
    manifest: &'a Manifest,
    planner: &'a HardwareProfile,
    reps: usize,
}

impl LoaderCells<'_> {
    fn budget_for(&self, job: CellJob, gpu_mem: u64) -> Budget {
        crate::runtime::budget_for(
            self.args,
            Job::single(job.prompt_tokens + job.tokens, job.prompt_tokens, 1),
            gpu_mem,
            self.args.device,
        )
    }

    fn try_run(&mut self, job: CellJob) -> Result<CellRun> {
        let loaded = LoadedModel::load(self.args)?;
        let ctx = job.prompt_tokens + job.tokens;
        let running = loaded.start(self.args, Job::single(ctx, job.prompt_tokens, 1))?;
        let prompt = random_prompt(job.prompt_tokens, loaded.spec.vocab_size);
        let m = with_engine!(&running.engine, e => {
            measure(e, ctx, &prompt, job.tokens, self.reps, &|| running.snapshot())?
        });
        let memory = running.memory_json(m.after_prefill, m.end, prompt.len(), m.decode_steps);
        let traffic = traffic_of(&running, prompt.len(), m.decode_steps);
        // The whole model on CUDA runs without a plan: the all-resident plan predicts it.
        let whole_plan;
        let plan = match &running.plan {
            Some(p) => Some(p),
            None => {
                whole_plan = make_plan(
                    self.manifest,
                    &self.budget_for(job, u64::MAX / 4),
                    self.planner,
                )
                .ok();
                whole_plan.as_ref()
            }
        };
        let (pass_streamed, pass_read) = match (&running.plan, &running.traffic) {
            (Some(p), _) => (
                (p.spec.n_layers as u64 * p.streamed_bytes_per_layer) as f64,
                p.per_token.hbm_read_bytes.saturating_sub(p.gpu.kv / 2) as f64,
            ),
            (None, Some(t)) => (0.0, t.weight_bytes as f64),
            (None, None) => (0.0, 0.0),
        };
        Ok(CellRun {
            traffic,
            pass_streamed_bytes: pass_streamed,
            pass_read_bytes: pass_read,
            prediction: plan.map(|p| (p.prediction.tokens_per_s, p.prediction.limited_by.clone())),
            gpu_peak_bytes: memory.get("gpu_peak_bytes").and_then(Value::as_u64),
            gpu_process_peak_bytes: memory.get("gpu_process_peak_bytes").and_then(Value::as_u64),
            load_s: running.load_s,
            memory,
            measured: m,
        })
    }
}

impl CellRunner for LoaderCells<'_> {
    fn run(&mut self, budget: &BudgetPoint, job: CellJob) -> CellOutcome {
        self.args.budget.gpu_mem = budget.gpu_mem_bytes;
        match self.try_run(job) {
            Ok(r) => CellOutcome::Ran(Box::new(r)),
            Err(e) if refused(&e) => CellOutcome::Refused(e.to_string()),
            Err(e) => CellOutcome::Failed(format!("{e:#}")),
        }
    }
}

/// The synthesized model of `--preset`, written into the cache on first use.
fn preset_model(name: &str) -> Result<PathBuf> {
    use crate::model::synth::{SynthSpec, synthesize};
    let Some(spec) = SynthSpec::preset(name) else {
        bail!("--preset {name}: unknown (tiny, 1b, 7b, 13b)");
    };
    let dir = crate::model::models_dir().join("synth").join(name);
    if dir.join("config.json").is_file() {
        return Ok(dir);
    }
    eprintln!(
        "synthesizing the {name} shape into {} (first use)",
        dir.display()
    );
    let pb = ProgressBar::new((spec.parameters() * 2) >> 20);
    pb.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} MiB")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    synthesize(&spec, &dir, true, &mut |done, _| {
        pb.set_position(done >> 20)
    })
    .with_context(|| format!("cannot write {}", dir.display()))?;
    pb.finish_and_clear();
    Ok(dir)
}

/// Create `dir` and prove it can be written, before any work.
fn writable_dir(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("--out {}: cannot create the directory", dir.display()))?;
    let probe = dir.join(".gpu-offload-write-test");
    crate::fsutil::write_atomic(&probe, b"ok")
        .with_context(|| format!("--out {}: cannot write there", dir.display()))?;
    std::fs::remove_file(&probe).ok();
    Ok(())
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn suite_cmd(mut a: SuiteArgs) -> Result<()> {
    // Flags first: nothing heavy runs before bad input is refused.
    if a.model.budget.gpu_mem.is_some() {
        bail!(
            "bench suite sweeps --gpu-mem itself: give the budgets with --budgets (e.g. --budgets whole,8G,4G,min)"
        );
    }
    if a.model.ctx_size.is_some() {
        bail!("bench suite sizes the context of each cell to its job: drop --ctx-size");
    }
    let device = match a.model.device {
        Device::Cpu => {
            bail!("bench suite runs offloaded: use --device sim (the budgeted CPU device) or cuda")
        }
        Device::Auto if crate::backend::cuda::device_available() => Device::Cuda,
        Device::Auto => Device::Sim,
        d => d,
    };
    a.model.device = device;
    let emulated = match &a.model.budget.emulate {
        None => None,
        Some(name) => {
            let p = HardwareProfile::load(name).map_err(|e| anyhow::anyhow!("--emulate {e}"))?;
            if p.device_bytes == 0 {
                bail!(
                    "--emulate {name}: the profile states no device memory (device_bytes) to emulate"
                );
            }
            Some(p)
        }
    };
    let explicit_hw = match &a.model.budget.hardware {
        Some(h) => Some(HardwareProfile::load(h).map_err(|e| anyhow::anyhow!("--hardware {e}"))?),
        None => None,
    };
    writable_dir(&a.out)?;
    let (model_path, source) = match (&a.model.model, &a.preset) {
        (Some(_), Some(_)) => bail!(
            "give -m MODEL or --preset NAME, not both (check GPU_OFFLOAD_MODEL / GPU_OFFLOAD_PRESET)"
        ),
        (None, Some(p)) => (preset_model(p)?, format!("preset {p} (synthesized)")),
        (Some(m), None) => (m.clone(), "file".to_string()),
        (None, None) => {
            let p = crate::model::default_model_path();
            if !p.exists() {
                bail!(
                    "no model given and the default model is not at {}: pass -m MODEL or --preset NAME",
                    p.display()
                );
            }
            (p, "file (the default model)".to_string())
        }
    };
    a.model.model = Some(model_path.clone());
    let store = open_store_for(&model_path)?;
    let manifest = &store.manifest;
    let spec = manifest.spec.clone();

    // The job sizes and prompt lengths the model can hold.
    let n = a.tokens as usize;
    let decode_prompt = a.decode_prompt as usize;
    if decode_prompt + n > spec.max_context {
        bail!(
            "--decode-prompt {decode_prompt} plus -n {n} exceed {}'s maximum context of {} tokens",
            spec.name,
            spec.max_context
        );
    }
    let mut notes = Vec::new();
    let prompts: Vec<usize> = a
        .prompts
        .0
        .iter()
        .copied()
        .filter(|&p| p < spec.max_context)
        .collect();
    if prompts.len() < a.prompts.0.len() {
        notes.push(format!(
            "prompt lengths at or beyond the model's maximum context of {} were left out",
            spec.max_context
        ));
    }

    // Rates for the bounds, and the planner's profile.
    let device_word = if device == Device::Cuda {
        "cuda"
    } else {
        "sim"
    };
    let threads = threads_of(&a.model);
    let mut real_device = match device {
        Device::Cuda => String::from("CUDA device 0"),
        _ => format!(
            "the budgeted CPU device (sim) on {}",
            crate::runtime::probe::cpu_model()
        ),
    };
    let rates = match &explicit_hw {
        Some(p) => {
            if device == Device::Cuda
                && let Ok(be) = CudaBackend::new(0, Ledger::new(None, None))
                && let Ok(info) = be.info()
            {
                real_device = info.name;
            }
            Rates::from_profile(p)
        }
        None => {
            let ssd = store.dir().to_path_buf();
            eprintln!("measuring this machine's rates for the bounds…");
            let (rates, base) = if device == Device::Cuda {
                let (r, g) =
                    bounds::measure_gpu(threads, Some(&ssd)).map_err(anyhow::Error::msg)?;
                real_device = g.name.clone();
                let mut base = HardwareProfile::saved_or("gpu-4g").map_err(anyhow::Error::msg)?;
                base.device_bytes = g.total_bytes;
                base.device_fixed_bytes = g.fixed_bytes.or(base.device_fixed_bytes);
                (r, base)
            } else {
                let base = HardwareProfile::load("cpu-sim").map_err(anyhow::Error::msg)?;
                (bounds::measure_sim(threads, Some(&ssd)), base)
            };
            let profile = rates.into_profile(&base, "measured");
            let path = a.out.join("hardware-measured.json");
            crate::fsutil::write_atomic(&path, serde_json::to_string_pretty(&profile)?.as_bytes())
                .with_context(|| format!("cannot write {}", path.display()))?;
            a.model.budget.hardware = Some(path.to_string_lossy().into_owned());
            rates
        }
    };
    // Emulating a card: its memory, fixed cost and PCIe pace; this machine's other rates (the
    // planner's profile does the same through `--emulate`).
    let rates = match &emulated {
        Some(card) => rates.emulating(card),
        None => rates,
    };
    let planner = a.model.budget.hardware_profile(if device == Device::Cuda {
        "gpu-4g"
    } else {
        "cpu-sim"
    })?;

    // The budget axis: what the whole model needs and the least the plan accepts.
    let decode_budget = |gpu_mem| {
        crate::runtime::budget_for(
            &a.model,
            Job::single(decode_prompt + n, decode_prompt, 1),
            gpu_mem,
            device,
        )
    };
    let whole_need = make_plan(manifest, &decode_budget(u64::MAX / 4), &planner)
        .context("planning the whole model")?
        .gpu
        .total;
    let minimum = match make_plan(manifest, &decode_budget(0), &planner) {
        Err(PlanError::GpuTooSmall { minimum, .. }) => minimum,
        Ok(p) => p.gpu.total,
        Err(e) => return Err(e).context("planning the smallest budget"),
    };
    let cap = emulated.as_ref().map(|p| p.device_bytes);
    let (budgets, budget_notes) = suite::select_budgets(
        a.budgets.as_ref().map(|b| b.0.as_slice()),
        whole_need,
        minimum,
        cap,
    );
    notes.extend(budget_notes);
    if budgets.is_empty() {
        bail!(
            "no --gpu-mem budget left to run (the budget list, after dropping those above the emulated card)"
        );
    }

    let matrix = Matrix {
        budgets: budgets.clone(),
        prompts: prompts.clone(),
        decode_prompt_tokens: decode_prompt,
        decode_tokens: n,
    };
    let peers_on = usize::from(a.llama_bench.is_some()) + usize::from(a.peer_hf.is_some());
    let pb = ProgressBar::new((matrix.cells() + peers_on * budgets.len()) as u64);
    pb.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut tick = |msg: &str| {
        pb.set_message(msg.to_string());
        pb.inc(1);
    };
    let reps = a.reps as usize;
    let (decode, prefill, problems) = {
        let mut cells = LoaderCells {
            args: &mut a.model,
            manifest,
            planner: &planner,
            reps,
        };
        suite::run_matrix(&matrix, &rates, &mut cells, &mut tick)
    };

    // Peers, in the same run.
    let job = PeerJob {
        prompts: prompts.clone(),
        decode_prompt_tokens: decode_prompt,
        decode_tokens: n,
        reps,
        threads: a.model.threads.map(usize::from),
        fixed_device_bytes: planner.fixed_device_bytes(),
    };
    let timeout = Duration::from_secs(a.peer_timeout.max(1));
    let gguf = a.peer_gguf.clone().or_else(|| {
        (model_path.is_file()
            && model_path
                .extension()
                .is_some_and(|e| e.eq_ignore_ascii_case("gguf")))
        .then(|| model_path.clone())
    });
    let llama = LlamaBench {
        exe: a.llama_bench.clone(),
        gguf,
        timeout,
    }
    .run(&job, &budgets, &mut tick);
    let hf = PeerHf {
        python: a.peer_hf.clone(),
        model_dir: model_path.is_dir().then(|| model_path.clone()),
        timeout,
    }
    .run(&job, &budgets, &a.out, &mut tick);
    pb.finish_and_clear();
    // A peer that failed is reported beside ours; it is not a failure of this benchmark.
    for p in [&llama, &hf] {
        if p.status == crate::bench::suite::peers::PeerStatus::Failed {
            eprintln!(
                "warning: peer {} failed: {}",
                p.name,
                p.reason.as_deref().unwrap_or("")
            );
        }
    }

    notes.push("Decode bound: 1 / max over resources (device memory, PCIe, DRAM, SSD) of the bytes a token moves through it ÷ its rate. TTFT bound: bytes only (weights streamed and read once per pass), FLOPs are not in it.".into());
    notes.push(format!(
        "A figure above {:.0}% of its bound marks the bound wrong (status ABOVE BOUND) and makes the suite exit non-zero.",
        100.0 * bounds::TOLERANCE
    ));
    if let Some(p) = &emulated {
        notes.push(format!(
            "Emulating {}: device memory is capped at {} (its fixed cost counted), host→device copies are paced to {:.1} GB/s; compute, device-memory, host-memory and SSD speeds are {}'s, and the bounds and predictions use them.",
            p.name,
            crate::plan::human_bytes(p.device_bytes),
            p.h2d_pinned_bytes_per_s / 1e9,
            real_device
        ));
    }
    if llama.ran() {
        notes.push("llama.cpp: decode is llama-bench's tg test (from an empty context); TTFT is the prompt ÷ its pp tokens/s. At a budget, -ngl is the largest whose process fits (estimated from layer bytes; verified by polling the process's device memory where a driver answers).".into());
    }
    let report = SuiteReport {
        schema: SCHEMA,
        gpu_offload_version: env!("CARGO_PKG_VERSION"),
        created_unix_s: unix_now(),
        model: ModelInfo {
            name: spec.name.clone(),
            path: model_path.display().to_string(),
            source,
            n_layers: spec.n_layers,
            d_model: spec.d_model,
            vocab_size: spec.vocab_size,
            max_context: spec.max_context,
            whole_gpu_bytes: whole_need,
            min_gpu_bytes: minimum,
        },
        device: DeviceInfo {
            kind: device_word.into(),
            name: real_device.clone(),
            emulated: emulated.as_ref().map(|p| Emulation {
                preset: p.name.clone(),
                device_bytes: p.device_bytes,
                h2d_bytes_per_s: p.h2d_pinned_bytes_per_s,
                on: real_device.clone(),
            }),
        },
        rates,
        settings: Settings {
            prompts,
            decode_prompt_tokens: decode_prompt,
            decode_tokens: n,
            reps,
            planner_profile: planner.name.clone(),
        },
        budgets,
        decode,
        prefill,
        peers: vec![llama, hf],
        problems,
        notes,
    };
    write_report(&report, &a.out)?;
    if !report.problems.is_empty() {
        bail!(
            "{} problem(s); the report is in {}:\n  {}",
            report.problems.len(),
            a.out.display(),
            report.problems.join("\n  ")
        );
    }
    Ok(())
}

/// suite.json, the plots and suite.md into `dir`, each written atomically.
fn write_report(report: &SuiteReport, dir: &Path) -> Result<()> {
    let write = |name: &str, bytes: &[u8]| {
        let p = dir.join(name);
        crate::fsutil::write_atomic(&p, bytes)
            .with_context(|| format!("cannot write {}", p.display()))
    };
    write(
        "suite.json",
        serde_json::to_string_pretty(report)?.as_bytes(),
    )?;
    let mut plots = Vec::new();
    for (file, title, svg) in [
        (
            "decode.svg",
            "decode tokens/s by --gpu-mem",
            plot::decode_svg(report),
        ),
        ("ttft.svg", "TTFT by prompt length", plot::ttft_svg(report)),
    ] {
        match svg {
            Ok(s) => {
                write(file, s.as_bytes())?;
                plots.push((file, title));
            }
            Err(e) => eprintln!("warning: {e}"),
        }
    }
    write("suite.md", report.markdown(&plots).as_bytes())?;
    println!(
        "wrote {0}/suite.json, {0}/suite.md and {1} plot(s): {2} decode and {3} prefill cell(s), {4} problem(s)",
        dir.display(),
        plots.len(),
        report.decode.len(),
        report.prefill.len(),
        report.problems.len()
    );
    Ok(())
}

// ---------------------------------------------------------------------------- bench contexts

/// `MIN-MAX` or `N` (inclusive).
fn parse_token_range(s: &str) -> std::result::Result<(usize, usize), String> {
    let bad = || format!("`{s}` is not a token count N or a range MIN-MAX (e.g. 30-200)");
    let (a, b) = match s.split_once('-') {
        Some((a, b)) => (a, b),
        None => (s, s),
    };
    let a: usize = a.trim().parse().map_err(|_| bad())?;
    let b: usize = b.trim().parse().map_err(|_| bad())?;
    if a == 0 || a > b {
        return Err(bad());
    }
    Ok((a, b))
}

/// `2,4,8`: context counts for the sweep.
#[derive(Clone, Debug)]
pub struct CountList(pub Vec<usize>);

fn parse_counts(s: &str) -> std::result::Result<CountList, String> {
    if s.trim().is_empty() || s.trim() == "none" {
        return Ok(CountList(Vec::new()));
    }
    s.split(',')
        .map(|p| match p.trim().parse::<usize>() {
            Ok(v) if v >= 1 => Ok(v),
            _ => Err(format!("`{p}` is not a number of contexts (1 or more)")),
        })
        .collect::<std::result::Result<_, _>>()
        .map(CountList)
}

/// `recompute,ours` or `all`.
#[derive(Clone, Debug)]
pub struct StrategyList(pub Vec<crate::bench::contexts::Strategy>);

fn parse_strategies(s: &str) -> std::result::Result<StrategyList, String> {
    use crate::bench::contexts::Strategy;
    if s.trim() == "all" {
        return Ok(StrategyList(Strategy::ALL.to_vec()));
    }
    let mut v = Vec::new();
    for p in s.split(',') {
        let k = Strategy::parse(p)?;
        if !v.contains(&k) {
            v.push(k);
        }
    }
    Ok(StrategyList(v))
}

fn parse_probability(s: &str) -> std::result::Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if (0.0..=1.0).contains(&v) => Ok(v),
        _ => Err(format!("`{s}` is not a probability in 0..=1")),
    }
}

fn parse_positive(s: &str) -> std::result::Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!("`{s}` is not a positive number")),
    }
}

#[derive(Debug, Args)]
pub struct ContextsArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Contexts in the main trace.
    #[arg(long, env = "GPU_OFFLOAD_CONTEXTS", default_value_t = 6, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub contexts: u32,
    /// Contexts whose KV the device holds at once: the slots, as `serve --parallel` (on a
    /// budgeted device --gpu-mem must hold them beside the weights).
    #[arg(long, env = "GPU_OFFLOAD_RESIDENT", default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub resident: u16,
    /// Calls in each trace.
    #[arg(long, env = "GPU_OFFLOAD_CALLS", default_value_t = 24, value_parser = clap::value_parser!(u32).range(1..))]
    pub calls: u32,
    /// Tokens of each context's conversation before the trace (the contexts grow from there).
    #[arg(long, env = "GPU_OFFLOAD_HISTORY_TOKENS", default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..))]
    pub history_tokens: u32,
    /// Tokens of a user turn: N or MIN-MAX (uniform).
    #[arg(long, env = "GPU_OFFLOAD_USER_TOKENS", default_value = "30-200", value_parser = parse_token_range)]
    pub user_tokens: (usize, usize),
    /// Tokens of an answer: N or MIN-MAX (uniform).
    #[arg(long, env = "GPU_OFFLOAD_ANSWER_TOKENS", default_value = "10-60", value_parser = parse_token_range)]
    pub answer_tokens: (usize, usize),
    /// Mean call arrivals per second (Poisson).
    #[arg(long, env = "GPU_OFFLOAD_RATE", default_value = "0.2", value_parser = parse_positive)]
    pub rate: f64,
    /// Probability that a call goes to the same context as the call before (a Markov chain);
    /// otherwise the context is drawn uniformly. 0: switching at random.
    #[arg(long, env = "GPU_OFFLOAD_STICKY", default_value = "0", value_parser = parse_probability)]
    pub sticky: f64,
    /// Seed of the trace (arrivals, contexts, turn lengths, where each context reads the corpus).
    #[arg(long, env = "GPU_OFFLOAD_SEED", default_value_t = 1)]
    pub seed: u64,
    /// Strategies to compare (comma-separated): recompute, whole-swap, chunked-swap,
    /// chunked-int8, ours; or all.
    #[arg(long, env = "GPU_OFFLOAD_STRATEGIES", default_value = "all", value_parser = parse_strategies)]
    pub strategies: StrategyList,
    /// Ours: KV chunk compression (off, int8, int4, int2, or a ratio of the int8 size such as
    /// 50%, as `serve --kv-compression`).
    #[arg(long, env = "GPU_OFFLOAD_KV_COMPRESSION", default_value = "50%", value_parser = crate::kv::Compression::parse)]
    pub kv_compression: crate::kv::Compression,
    /// DRAM for swapped KV, for each strategy's store (as `serve --kv-dram-mem`).
    #[arg(long, env = "GPU_OFFLOAD_KV_DRAM_MEM", default_value = "256M", value_parser = parse_bytes)]
    pub kv_dram_mem: u64,
    /// Directory for swap files (emptied and removed after each strategy) [default: OUT/kv-scratch]
    #[arg(long, env = "GPU_OFFLOAD_KV_DIR")]
    pub kv_dir: Option<PathBuf>,
    /// Numbers of contexts to sweep for "most contexts within the target" (comma-separated;
    /// the main trace's count is always a point). Empty: no sweep.
    #[arg(long, env = "GPU_OFFLOAD_SWEEP", default_value = "", value_parser = parse_counts)]
    pub sweep: CountList,
    /// Latency target of the sweep: p99 TTFT in seconds.
    #[arg(long, env = "GPU_OFFLOAD_TTFT_TARGET", default_value = "2", value_parser = parse_positive)]
    pub ttft_target: f64,
    /// Also run the trace with no context ever leaving the device and compare each call's
    /// logits after its user turn (greedy token, largest difference) for every strategy.
    #[arg(long, env = "GPU_OFFLOAD_CHECK")]
    pub check: bool,
    /// Text whose tokens make the conversations [default: moby-dick-eval.txt from
    /// scripts/fetch-models.sh when the model has a tokenizer, else seeded random ids]
    #[arg(long, env = "GPU_OFFLOAD_CORPUS")]
    pub corpus: Option<PathBuf>,
    /// Seeded random token ids instead of a corpus.
    #[arg(long, env = "GPU_OFFLOAD_RANDOM_CORPUS", conflicts_with = "corpus")]
    pub random_corpus: bool,
    /// Directory for contexts.json, contexts.md and contexts.svg (created if missing).
    #[arg(
        long,
        short = 'o',
        env = "GPU_OFFLOAD_OUT",
        default_value = "bench-contexts"
    )]
    pub out: PathBuf,
    /// Print contexts.json on stdout too.
    #[arg(long, env = "GPU_OFFLOAD_JSON")]
    pub json: bool,
}

fn contexts_cmd(a: ContextsArgs) -> Result<()> {
    use crate::bench::contexts::{self as cx, TokenSource, Trace, TraceConfig};
    // Flags first: nothing heavy runs before bad input is refused.
    if a.model.ctx_size.is_some() {
        bail!(
            "bench contexts sizes each slot to the longest context of its traces: drop --ctx-size"
        );
    }
    if a.strategies.0.is_empty() {
        bail!("--strategies: name at least one strategy");
    }
    let trace_cfg = |contexts: usize| TraceConfig {
        contexts,
        calls: a.calls as usize,
        history_tokens: a.history_tokens as usize,
        user_tokens: a.user_tokens,
        answer_tokens: a.answer_tokens,
        rate_per_s: a.rate,
        sticky: a.sticky,
        seed: a.seed,
    };
    trace_cfg(a.contexts as usize)
        .validate()
        .map_err(anyhow::Error::msg)?;
    writable_dir(&a.out)?;
    let kv_dir = a.kv_dir.clone().unwrap_or_else(|| a.out.join("kv-scratch"));

    let loaded = LoadedModel::load(&a.model)?;
    let spec = loaded.spec().clone();
    let (source, source_name) = if a.random_corpus {
        (
            TokenSource::Random {
                vocab: spec.vocab_size,
            },
            "seeded random ids".to_string(),
        )
    } else {
        let default = crate::model::models_dir().join("moby-dick-eval.txt");
        match (&a.corpus, &loaded.tokenizer) {
            (Some(p), None) => bail!(
                "--corpus {}: {} has no tokenizer (use --random-corpus)",
                p.display(),
                loaded.path.display()
            ),
            (None, None) => (
                TokenSource::Random {
                    vocab: spec.vocab_size,
                },
                "seeded random ids (the model has no tokenizer)".to_string(),
            ),
            (None, Some(_)) if !default.exists() => (
                TokenSource::Random {
                    vocab: spec.vocab_size,
                },
                format!("seeded random ids ({} is missing)", default.display()),
            ),
            (given, Some(tok)) => {
                let (path, text) =
                    super::profile::read_corpus(given.as_deref(), "moby-dick-eval.txt")?;
                let ids = tok
                    .encode(&text, false, false)
                    .with_context(|| format!("cannot tokenize {}", path.display()))?;
                if ids.is_empty() {
                    bail!("corpus {} has no tokens", path.display());
                }
                (TokenSource::Corpus(ids), path.display().to_string())
            }
        }
    };
    let main = Trace::generate(&trace_cfg(a.contexts as usize), &source);
    let mut counts: Vec<usize> = a.sweep.0.clone();
    counts.sort_unstable();
    counts.dedup();
    let sweep: Vec<Trace> = counts
        .iter()
        .filter(|&&n| n != a.contexts as usize)
        .map(|&n| Trace::generate(&trace_cfg(n), &source))
        .collect();
    let job = cx::Job {
        main,
        sweep,
        strategies: a.strategies.0.clone(),
        check: a.check,
        ttft_target_s: a.ttft_target,
    };
    let ctx = job.ctx_size();
    if ctx > spec.max_context {
        bail!(
            "the contexts grow to {ctx} tokens but {} holds at most {}: lower --history-tokens, --calls or the turn lengths",
            spec.name,
            spec.max_context
        );
    }
    let resident = a.resident as usize;
    let running = loaded.start(
        &a.model,
        Job {
            ctx,
            sessions: resident,
            probe: true,
            batch: crate::footprint::MAX_BATCH.min(ctx),
            logit_rows: 1,
            // Recompute re-prefills whole conversations.
            prompt: ctx,
            kv_pool: None,
        },
    )?;
    let model_id = loaded.model_id()?;
    let set = cx::RunSettings {
        resident,
        dram_budget: a.kv_dram_mem,
        compression: a.kv_compression,
        kv_dir: kv_dir.clone(),
        model_id,
        costs: crate::kv::CostModel {
            recompute_s_per_token: 0.0,
            load_s_per_chunk: 0.0,
            load_s_per_byte: 0.0,
            decode_s_per_value: 0.0,
        },
    };
    let progress = |m: &str| eprintln!("bench contexts: {m}");
    let (outcome, kv_type) = with_engine!(&running.engine, e => {
        (cx::run(e, ctx, &set, &job, &progress)?, e.kv_type())
    });
    std::fs::remove_dir(&kv_dir).ok();
    let kv_bytes_per_token = (2 * spec.n_layers * kv_type.row_bytes(spec.kv_dim())) as u64;
    let (speedups, ours_fastest) = cx::speedups(&outcome.strategies);
    let most_contexts = cx::most_contexts(&outcome.sweep, &job.strategies);
    let report = cx::ContextsReport {
        schema: cx::SCHEMA,
        gpu_offload_version: env!("CARGO_PKG_VERSION"),
        created_unix_s: unix_now(),
        model: cx::ModelInfo {
            name: spec.name.clone(),
            path: loaded.path.display().to_string(),
            n_layers: spec.n_layers,
            kv_dim: spec.kv_dim(),
            max_context: spec.max_context,
            kv_type: format!("{kv_type:?}").to_lowercase(),
            kv_bytes_per_token,
        },
        device: cx::DeviceInfo {
            kind: device_of(&running).into(),
            gpu_mem: a.model.budget.gpu_mem,
            threads: threads_of(&a.model),
        },
        settings: cx::Settings {
            trace: job.main.cfg.clone(),
            resident,
            ctx_size: ctx,
            dram_budget: a.kv_dram_mem,
            compression: format!("{:?}", a.kv_compression),
            kv_dir: kv_dir.display().to_string(),
            tokens: source_name,
            ttft_target_s: a.ttft_target,
            sweep_contexts: counts,
            check: a.check,
        },
        cost_model: cx::CostInfo {
            recompute_s_per_token: outcome.costs.recompute_s_per_token,
            load_s_per_chunk: outcome.costs.load_s_per_chunk,
            load_s_per_byte: outcome.costs.load_s_per_byte,
            decode_s_per_value: outcome.costs.decode_s_per_value,
        },
        strategies: outcome.strategies,
        speedups,
        ours_fastest,
        sweep: outcome.sweep,
        most_contexts,
        notes: cx::notes(),
    };
    let write = |name: &str, bytes: &[u8]| {
        let p = a.out.join(name);
        crate::fsutil::write_atomic(&p, bytes)
            .with_context(|| format!("cannot write {}", p.display()))
    };
    let json = serde_json::to_string_pretty(&report)?;
    write("contexts.json", json.as_bytes())?;
    let plot = match plot::contexts_svg(&report) {
        Ok(svg) => {
            write("contexts.svg", svg.as_bytes())?;
            Some("contexts.svg")
        }
        Err(e) => {
            eprintln!("warning: {e}");
            None
        }
    };
    let md = report.markdown(plot);
    write("contexts.md", md.as_bytes())?;
    if a.json {
        println!("{json}");
    } else {
        print!("{md}");
        println!(
            "wrote {0}/contexts.json, {0}/contexts.md{1}",
            a.out.display(),
            if plot.is_some() {
                " and contexts.svg"
            } else {
                ""
            }
        );
    }
    Ok(())
}
