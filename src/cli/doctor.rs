//! `gpu-offload doctor`: what this machine can do — devices found, host memory and SSD
//! bandwidth — and, with `--save`, the hardware profile the planner and the benchmark bounds use.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use crate::plan::HardwareProfile;
use crate::runtime::machine::{Machine, measure_machine, save_profile};
use crate::runtime::probe::{GpuProfile, READ_PROBE_WIDTH};

#[derive(Debug, Args)]
pub struct DoctorArgs {
    /// Threads for the host memory bandwidth test [default: one per core]
    #[arg(long, short = 't', env = "GPU_OFFLOAD_THREADS", value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub threads: Option<u16>,

    /// Directory on the drive the store lives on, for the SSD read test [default: the models
    /// directory]
    #[arg(long, env = "GPU_OFFLOAD_SSD_DIR")]
    pub ssd_dir: Option<PathBuf>,

    /// MiB read in the SSD test (0 skips it).
    #[arg(long, env = "GPU_OFFLOAD_SSD_TEST_MIB", default_value_t = 256)]
    pub ssd_test_mib: usize,

    /// Write the measured profile where the planner looks first (~/.cache/gpu-offload/hardware.json).
    #[arg(long, env = "GPU_OFFLOAD_SAVE")]
    pub save: bool,

    /// Print the report as JSON.
    #[arg(long, env = "GPU_OFFLOAD_JSON")]
    pub json: bool,
}

pub fn run(args: DoctorArgs) -> Result<()> {
    let threads = args.threads.map_or_else(
        || std::thread::available_parallelism().map_or(1, |n| n.get()),
        usize::from,
    );
    let ssd_dir = args
        .ssd_dir
        .clone()
        .unwrap_or_else(crate::model::models_dir);
    let m = measure_machine(threads, ssd_dir, args.ssd_test_mib)?;
    if args.save {
        save_profile(&m.profile)?;
    }
    let mut out = std::io::stdout().lock();
    if args.json {
        let v = serde_json::json!({
            "host": m.host,
            "memcpy_bytes_per_s": m.memcpy_bytes_per_s,
            "ssd_read_bytes_per_s": m.ssd_read_bytes_per_s,
            "gpu": m.gpu.as_ref().ok(),
            "gpu_status": match &m.gpu { Ok(g) => format!("{} found", g.name), Err(e) => e.clone() },
            "profile": m.profile,
        });
        writeln!(out, "{v}")?;
        return Ok(());
    }
    print_gpu(&mut out, &m.gpu)?;
    print_host(&mut out, &m)?;
    if args.save {
        writeln!(
            out,
            "profile saved to {}",
            HardwareProfile::saved_path().display()
        )?;
    }
    Ok(())
}

/// The GPU's lines of the report (or why there is none).
fn print_gpu(out: &mut impl Write, gpu: &Result<GpuProfile, String>) -> Result<()> {
    match &gpu {
        Ok(g) => {
            let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
            writeln!(
                out,
                "GPU:   {} (compute {}.{}, {} SMs), {:.1} GiB ({:.1} GiB free), driver {}",
                g.name,
                g.compute_capability.0,
                g.compute_capability.1,
                g.multiprocessors,
                gib(g.total_bytes),
                gib(g.free_bytes),
                g.driver_version.as_deref().unwrap_or("?")
            )?;
            if let Some(p) = &g.pcie {
                writeln!(
                    out,
                    "PCIe:  gen {} x{} (max gen {} x{})",
                    p.gen_current, p.width_current, p.gen_max, p.width_max
                )?;
            }
            writeln!(
                out,
                "device memory: {:.0} GB/s read (kernel), {:.0} GB/s device-to-device copy (read + write)",
                g.hbm_read_bytes_per_s / 1e9,
                g.d2d_bytes_per_s / 1e9
            )?;
            match g.fixed_cost {
                Some(c) => {
                    let mib = |b: Option<u64>| {
                        b.map_or_else(|| "unreadable".to_string(), |b| format!("{} MiB", b >> 20))
                    };
                    writeln!(
                        out,
                        "fixed device cost: {} MiB (CUDA context, kernels, cuBLAS + workspace), from {}: by this process's figure {}, by the device's used memory {}; --gpu-mem covers it",
                        c.bytes >> 20,
                        c.source,
                        mib(c.process_bytes),
                        mib(c.device_bytes)
                    )?
                }
                None => writeln!(
                    out,
                    "fixed device cost: not measurable here (NVML); the planner assumes {} MiB",
                    crate::plan::hardware::DEFAULT_DEVICE_FIXED_BYTES >> 20
                )?,
            }
            writeln!(
                out,
                "host→device: {:.1} GB/s pinned, {:.1} GB/s pageable; device→host: {:.1} GB/s pinned, {:.1} GB/s pageable",
                g.h2d_pinned_bytes_per_s / 1e9,
                g.h2d_pageable_bytes_per_s / 1e9,
                g.d2h_pinned_bytes_per_s / 1e9,
                g.d2h_pageable_bytes_per_s / 1e9
            )?;
            writeln!(
                out,
                "kernels: {}; --programmatic-launch {}",
                g.kernels,
                if g.programmatic_launch {
                    "runs here"
                } else {
                    "does not (compute capability 9.0 and kernels built for it)"
                }
            )?;
            writeln!(
                out,
                "products: {:.1} TFLOP/s (512 × 4096 × 4096, f16, cuBLAS)",
                g.matmul_flops_per_s / 1e12
            )?;
            writeln!(
                out,
                "prompt attention: {}, {:.1} TFLOP/s ({:.0}% of the products'; 512 rows over 8192 positions of an f16 cache, 32 heads of 128)",
                if g.flash_attention {
                    "tensor cores (flash)"
                } else {
                    "the simple kernel (tensor-core flash attention needs compute capability 8.0)"
                },
                g.attention_flops_per_s / 1e12,
                100.0 * g.attention_flops_per_s / g.matmul_flops_per_s
            )?;
        }
        Err(e) => writeln!(
            out,
            "GPU:   {e} (this build still runs on the CPU, and on the budgeted CPU device, --device sim)"
        )?,
    }
    Ok(())
}

/// The host's lines of the report: CPU, DRAM, memcpy, the budgeted device's CPU rates, SSD.
fn print_host(out: &mut impl Write, m: &Machine) -> Result<()> {
    let Machine {
        host,
        memcpy_bytes_per_s: memcpy,
        cpu_attention,
        cpu_read_start,
        ssd_dir,
        ssd_read_bytes_per_s: ssd,
        gpu,
        profile,
    } = m;
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
    writeln!(
        out,
        "memcpy bandwidth:    {:.1} GB/s (1 thread)",
        memcpy / 1e9
    )?;
    if let (Err(_), Some(attention)) = (&gpu, profile.attention_flops_per_s) {
        writeln!(
            out,
            "CPU products:        {:.1} GFLOP/s (128 × 1024 × 1024, f16); prompt attention {:.1} GFLOP/s (64 rows over 2048 positions of an f16 cache, 32 heads of 128): the budgeted device's",
            profile.matmul_flops_per_s / 1e9,
            attention / 1e9
        )?;
    }
    match &cpu_attention {
        Ok(rate) => writeln!(
            out,
            "CPU attention:       {:.1} GB/s of KV cache ({:.0}% of the DRAM read bandwidth; a \
             decode step over 4000 positions of an f16 cache, 32 heads of 128)",
            rate / 1e9,
            100.0 * rate / host.dram_read_bytes_per_s
        )?,
        Err(e) => writeln!(out, "CPU attention:       not measured ({e})")?,
    }
    let w = READ_PROBE_WIDTH;
    match &cpu_read_start {
        Ok(s) => writeln!(
            out,
            "CPU read starts:     {:.0} ns a read beyond its bytes (hybrid's cold pass over whole \
             gated f16 bundles of width {w}, where a part's {} bytes take {:.0} ns at the DRAM \
             read rate)",
            s * 1e9,
            2 * w,
            (2 * w) as f64 / host.dram_read_bytes_per_s * 1e9
        )?,
        Err(e) => writeln!(out, "CPU read starts:     not measured ({e})")?,
    }
    match ssd {
        Some(b) => writeln!(
            out,
            "SSD read bandwidth:  {:.2} GB/s (direct I/O, {})",
            b / 1e9,
            ssd_dir.display()
        )?,
        None => writeln!(out, "SSD read bandwidth:  not measured")?,
    }
    Ok(())
}
