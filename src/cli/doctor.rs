//! `gpu-offload doctor`: what this machine can do — devices found, host memory bandwidth — as
//! the hardware profile the planner and the benchmark bounds use.

use std::io::Write;

use anyhow::Result;
use clap::Args;

use crate::hw;

#[derive(Debug, Args)]
pub struct DoctorArgs {
    /// Threads for the host memory bandwidth test [default: one per core]
    #[arg(long, short = 't', env = "GPU_OFFLOAD_THREADS", value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub threads: Option<u16>,

    /// Print the profile as JSON.
    #[arg(long, env = "GPU_OFFLOAD_JSON")]
    pub json: bool,
}

pub fn run(args: DoctorArgs) -> Result<()> {
    let threads = args.threads.map_or_else(
        || std::thread::available_parallelism().map_or(1, |n| n.get()),
        usize::from,
    );
    let host = hw::probe_host(threads);
    let gpu = "no GPU found: this build runs on the CPU only";
    let mut out = std::io::stdout().lock();
    if args.json {
        writeln!(
            out,
            "{}",
            serde_json::json!({"host": host, "gpu": null, "gpu_status": gpu})
        )?;
        return Ok(());
    }
    writeln!(out, "GPU:   {gpu}")?;
    writeln!(
        out,
        "CPU:   {} ({} logical cores; {})",
        host.cpu_model,
        host.logical_cores,
        host.simd.join(" ")
    )?;
    if let Some(b) = host.dram_bytes {
        writeln!(out, "DRAM:  {:.1} GiB", b as f64 / (1u64 << 30) as f64)?;
    }
    writeln!(
        out,
        "DRAM read bandwidth: {:.1} GB/s ({} threads)",
        host.dram_read_bytes_per_s / 1e9,
        host.dram_read_threads
    )?;
    Ok(())
}
