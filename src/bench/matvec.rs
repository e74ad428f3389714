//! `bench matvec`: one weight matrix times a few vectors, cycled through copies no cache holds
//! between uses; bytes/s against the memory it streams from (device memory on CUDA, DRAM on the
//! CPU), a rate measured now or a hardware profile's. A figure above its bound is an error.

use std::time::Instant;

use anyhow::{Result, bail};
use clap::Args;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use crate::backend::Backend;
use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::CudaBackend;
use crate::bench::bounds;
use crate::footprint::Ledger;
use crate::plan::HardwareProfile;
use crate::runtime::Device;
use crate::tensor::{Bytes, DType, HostTensor};

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
pub const MATVEC_WORKING_SET: usize = 256 << 20;

/// Seconds per product (median of 5 timings of `reps` products each), cycling through copies
/// of `w` that together exceed [`MATVEC_WORKING_SET`].
fn time_matvec<B: Backend>(b: &B, w: &HostTensor, tokens: usize, reps: usize) -> Result<f64> {
    let copies = MATVEC_WORKING_SET.div_ceil(w.data.len().max(1)).max(1);
    // Each copy its own bytes: the CPU backend's upload keeps the tensor's (shared) buffer, so
    // clones of one tensor were one matrix that the last-level cache held.
    let dws = (0..copies)
        .map(|_| {
            b.upload(&HostTensor {
                data: Bytes::from_slice(w.data.as_slice()),
                ..w.clone()
            })
        })
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

/// What one `bench matvec` measured, beside its bound.
#[derive(Clone, Debug)]
pub struct MatvecRun {
    pub cuda: bool,
    pub weight_bytes: f64,
    /// Seconds per product.
    pub seconds: f64,
    pub achieved_bytes_per_s: f64,
    /// The memory the weights stream from: "device memory read" or "DRAM read".
    pub bound_name: &'static str,
    pub bound_bytes_per_s: f64,
    /// Where the bound's rate came from ("profile NAME", "measured live (…)").
    pub bound_from: String,
}

/// Time the products of `a` and find their bound.
pub fn run(a: &MatvecArgs) -> Result<MatvecRun> {
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
    Ok(MatvecRun {
        cuda,
        weight_bytes: bytes,
        seconds: secs,
        achieved_bytes_per_s: achieved,
        bound_name,
        bound_bytes_per_s: bound,
        bound_from: source,
    })
}

impl MatvecRun {
    /// An error when the figure is above its bound (beyond [`bounds::TOLERANCE`]): the bound is
    /// wrong.
    pub fn check_bound(&self) -> Result<()> {
        let (achieved, bound, bound_name, source) = (
            self.achieved_bytes_per_s,
            self.bound_bytes_per_s,
            self.bound_name,
            &self.bound_from,
        );
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
}
