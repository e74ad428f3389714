//! `gpu-offload bench`: measured speed beside its physical bound, in one run.
//! - `matvec`: one weight matrix times a few vectors; bytes/s against the memory it streams from.
//! - `decode`: a model end to end (TTFT, prefill and decode tokens/s) against the bound of the
//!   resource it must move bytes through (device memory, PCIe, DRAM or SSD).

use std::time::Instant;

use anyhow::{Result, bail};
use clap::{Args, Subcommand, ValueEnum};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use serde_json::json;

use super::load::{Job, with_engine};
use super::{Device, LoadedModel, ModelArgs};
use crate::backend::Backend;
use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::CudaBackend;
use crate::engine::{GenerateParams, SamplerParams, generate};
use crate::hw;
use crate::tensor::{Bytes, DType, HostTensor};
use crate::tier::Ledger;

#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub what: BenchWhat,
}

#[derive(Debug, Subcommand)]
pub enum BenchWhat {
    /// Matrix × vector(s): achieved bandwidth against the device's.
    Matvec(MatvecArgs),
    /// A model end to end: TTFT, prefill and decode tokens/s against the bound.
    Decode(DecodeArgs),
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum DTypeArg {
    F32,
    F16,
    Bf16,
    #[value(name = "q8_0")]
    Q8_0,
    #[value(name = "q4_0")]
    Q4_0,
    #[value(name = "q4_1")]
    Q4_1,
}

impl DTypeArg {
    fn dtype(self) -> DType {
        match self {
            DTypeArg::F32 => DType::F32,
            DTypeArg::F16 => DType::F16,
            DTypeArg::Bf16 => DType::BF16,
            DTypeArg::Q8_0 => DType::Q8_0,
            DTypeArg::Q4_0 => DType::Q4_0,
            DTypeArg::Q4_1 => DType::Q4_1,
        }
    }
}

#[derive(Debug, Args)]
pub struct MatvecArgs {
    /// cpu or cuda.
    #[arg(long, env = "GPU_OFFLOAD_DEVICE", value_enum, default_value = "auto")]
    pub device: Device,
    /// Output rows (neurons).
    #[arg(long, default_value_t = 11008)]
    pub rows: usize,
    /// Input columns.
    #[arg(long, default_value_t = 4096)]
    pub cols: usize,
    #[arg(long, value_enum, default_value = "f16")]
    pub dtype: DTypeArg,
    /// Vectors per product.
    #[arg(long, default_value_t = 1)]
    pub tokens: usize,
    #[arg(long, default_value_t = 50)]
    pub reps: usize,
    /// CPU threads.
    #[arg(long, short = 't', env = "GPU_OFFLOAD_THREADS")]
    pub threads: Option<usize>,
    #[arg(long, env = "GPU_OFFLOAD_JSON")]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct DecodeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt length in tokens (random ids).
    #[arg(long, default_value_t = 32)]
    pub prompt_tokens: usize,
    /// Tokens to decode.
    #[arg(long, short = 'n', default_value_t = 64)]
    pub tokens: usize,
    /// Repetitions (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    #[arg(long, env = "GPU_OFFLOAD_JSON")]
    pub json: bool,
}

pub fn run(a: BenchArgs) -> Result<()> {
    match a.what {
        BenchWhat::Matvec(m) => matvec(m),
        BenchWhat::Decode(d) => decode(d),
    }
}

fn random_weight(dtype: DType, rows: usize, cols: usize) -> HostTensor {
    let mut rng = StdRng::seed_from_u64(9);
    let n = dtype.bytes_for(rows * cols);
    let mut bytes: Vec<u8> = (0..n).map(|_| rng.random::<u8>()).collect();
    match dtype {
        DType::F32 => bytes.chunks_mut(4).for_each(|f| f[3] = 0x3c),
        DType::F16 | DType::BF16 => bytes.chunks_mut(2).for_each(|h| h[1] &= 0x3b),
        _ => bytes.chunks_mut(dtype.block_bytes()).for_each(|b| {
            b[0..2].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
            if dtype == DType::Q4_1 {
                b[2..4].copy_from_slice(&half::f16::from_f32(-0.05).to_le_bytes());
            }
        }),
    }
    HostTensor {
        name: "bench".into(),
        rows,
        cols,
        dtype,
        data: Bytes::from_slice(&bytes),
    }
}

/// Seconds per product (median of 5 timings of `reps` products each).
fn time_matvec<B: Backend>(b: &B, w: &HostTensor, tokens: usize, reps: usize) -> Result<f64> {
    let dw = b.upload(w)?;
    let mut x = b.alloc(tokens, w.cols)?;
    b.write(&mut x, &vec![0.01; tokens * w.cols])?;
    let mut out = b.alloc(tokens, w.rows)?;
    let mut sink = vec![0f32; tokens * w.rows];
    b.enter(move || -> Result<f64> {
        b.matmul(&dw, &x, &mut out)?;
        b.read(&out, &mut sink)?;
        let mut times = Vec::new();
        for _ in 0..5 {
            let t0 = Instant::now();
            for _ in 0..reps {
                b.matmul(&dw, &x, &mut out)?;
            }
            b.read(&out, &mut sink)?;
            times.push(t0.elapsed().as_secs_f64() / reps as f64);
        }
        times.sort_by(f64::total_cmp);
        Ok(times[2])
    })
}

fn matvec(a: MatvecArgs) -> Result<()> {
    let dtype = a.dtype.dtype();
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
    let (secs, bound_name, bound) = if cuda {
        let g = hw::probe_gpu(256 << 20).map_err(anyhow::Error::msg)?;
        let be = CudaBackend::new(0, Ledger::new(None, None))?;
        // Device memory bandwidth for a stream that only reads: half the copy's read+write.
        (
            time_matvec(&be, &w, a.tokens, a.reps)?,
            "device memory read (d2d copy / 2)",
            g.d2d_bytes_per_s / 2.0,
        )
    } else {
        let threads = a.threads.unwrap_or(0);
        let be = CpuBackend::new(threads)?;
        let bw = hw::dram_read_bandwidth(be.threads(), 512 << 20, 5);
        (time_matvec(&be, &w, a.tokens, a.reps)?, "DRAM read", bw)
    };
    let achieved = bytes / secs;
    if a.json {
        println!(
            "{}",
            json!({"rows": a.rows, "cols": a.cols, "dtype": dtype.name(), "tokens": a.tokens, "seconds": secs,
                   "weight_bytes": bytes, "achieved_bytes_per_s": achieved, "bound": bound_name,
                   "bound_bytes_per_s": bound, "fraction_of_bound": achieved / bound,
                   "device": if cuda { "cuda" } else { "cpu" }})
        );
    } else {
        println!(
            "matvec {}x{} {dtype} × {} vector(s) on {}: {:.1} µs, {:.1} GB/s = {:.0}% of {} {:.1} GB/s",
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
    Ok(())
}

fn decode(a: DecodeArgs) -> Result<()> {
    if a.tokens < 2 || a.prompt_tokens == 0 || a.reps == 0 {
        bail!("--tokens must be at least 2; --prompt-tokens and --reps at least 1");
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
    let mut rng = StdRng::seed_from_u64(1);
    let prompt: Vec<u32> = (0..a.prompt_tokens)
        .map(|_| rng.random_range(3..spec.vocab_size as u32))
        .collect();
    let running = loaded.start(&a.model, Job::single(ctx, a.prompt_tokens, 1))?;
    let params = GenerateParams {
        max_tokens: a.tokens,
        sampler: SamplerParams::greedy(),
        stop_at_eog: false,
    };
    let mut runs = Vec::new();
    let mut traffic = Vec::new();
    for _ in 0..a.reps + 1 {
        let mut first = None;
        let t0 = Instant::now();
        let g = with_engine!(&running.engine, e => {
            let mut s = e.new_session(ctx)?;
            generate(e, &mut s, &prompt, &params, &|_| false, &mut |_| {
                if first.is_none() {
                    first = Some((t0.elapsed().as_secs_f64(), running.snapshot()));
                }
                true
            })?
        });
        let end = running.snapshot();
        let (ttft, after) = first.unwrap_or_default();
        traffic.push(running.memory_json(after, end, prompt.len(), g.timings.decode_steps));
        runs.push((
            ttft,
            g.timings.prefill_tokens_per_s(),
            g.timings.decode_tokens_per_s(),
        ));
    }
    // The first run warms caches and compiles kernels: leave it out.
    runs.remove(0);
    let by = |k: usize| {
        let mut v: Vec<f64> = runs.iter().map(|r| [r.0, r.1, r.2][k]).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (ttft, prefill, decode) = (by(0), by(1), by(2));
    let memory = traffic.pop().unwrap_or_default();
    // The bound: bytes each resource moves per token over its bandwidth.
    let device = match &running.engine {
        super::load::AnyEngine::Cpu(_) => "cpu",
        super::load::AnyEngine::Sim(_) => "sim",
        super::load::AnyEngine::Cuda(_) => "cuda",
    };
    let (bound_name, bound_tps) = match (&running.plan, &running.traffic, device) {
        (Some(plan), _, _) => (
            format!("plan: {} (predicted)", plan.prediction.limited_by),
            plan.prediction.tokens_per_s,
        ),
        (None, Some(t), "cuda") => {
            let g = hw::probe_gpu(256 << 20).map_err(anyhow::Error::msg)?;
            let bytes = t.mean(a.prompt_tokens, a.tokens - 1);
            (
                "device memory (weights + KV per token ÷ d2d/2)".into(),
                g.d2d_bytes_per_s / 2.0 / bytes,
            )
        }
        (None, Some(t), _) => {
            let bw = hw::dram_read_bandwidth(
                std::thread::available_parallelism().map_or(1, |n| n.get()),
                512 << 20,
                5,
            );
            (
                "DRAM (weights + KV per token ÷ read bandwidth)".into(),
                bw / t.mean(a.prompt_tokens, a.tokens - 1),
            )
        }
        _ => ("unknown".into(), f64::NAN),
    };
    let out = json!({
        "model": spec.name, "device": device, "prompt_tokens": a.prompt_tokens, "decode_tokens": a.tokens,
        "reps": a.reps, "ttft_s": ttft, "prefill_tokens_per_s": prefill, "decode_tokens_per_s": decode,
        "bound": bound_name, "bound_tokens_per_s": bound_tps, "fraction_of_bound": decode / bound_tps,
        "load_s": running.load_s, "memory": memory,
    });
    if a.json {
        println!("{out}");
    } else {
        println!(
            "{} on {device}: TTFT {:.1} ms ({} prompt tokens, {:.0} tok/s), decode {:.2} tok/s = {:.0}% of the {} bound {:.2} tok/s",
            spec.name,
            ttft * 1e3,
            a.prompt_tokens,
            prefill,
            decode,
            100.0 * decode / bound_tps,
            bound_name,
            bound_tps
        );
    }
    Ok(())
}
