//! `bench attention`: a prompt's causal attention over its cache (the prefill kernel, or the
//! decode kernel for a few rows over a long context), FLOP/s beside a matrix product's of as
//! many rows on the same device in the same run.

use anyhow::{Result, bail};
use clap::Args;

use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::CudaBackend;
use crate::footprint::Ledger;
use crate::runtime::Device;

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

/// What one `bench attention` measured.
#[derive(Clone, Debug)]
pub struct AttentionRun {
    /// "cpu" or "cuda".
    pub device: &'static str,
    /// Where a prompt runs on tensor cores, the ways its keys split.
    pub flash_splits: Option<usize>,
    pub seconds: f64,
    pub flops: f64,
    pub flops_per_s: f64,
    /// The reference: a product of as many rows with a square f16 weight of the queries' width.
    pub matmul_flops_per_s: f64,
    /// The queries' width (heads × dims per head): the reference product's size.
    pub query_width: usize,
    /// The KV cache type's name.
    pub kv_type: String,
}

/// Time the attention of `a` and the reference product beside it.
pub fn run(a: &AttentionArgs) -> Result<AttentionRun> {
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
    Ok(AttentionRun {
        device,
        flash_splits: splits,
        seconds: secs,
        flops,
        flops_per_s: rate,
        matmul_flops_per_s: matmul,
        query_width: qd,
        kv_type: kv,
    })
}
