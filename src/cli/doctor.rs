//! `gpu-offload doctor`: what this machine can do — devices found, host memory and SSD
//! bandwidth — and, with `--save`, the hardware profile the planner and the benchmark bounds use.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

use crate::plan::HardwareProfile;
use crate::runtime::probe as hw;

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
    let host = hw::probe_host(threads);
    let memcpy = hw::memcpy_bandwidth(256 << 20, 5);
    // One pool of `threads` for every CPU probe.
    let cpu = crate::backend::cpu::CpuBackend::new(threads)?;
    let cpu_attention = hw::cpu_attention_rate(&cpu);
    let ssd_dir = args
        .ssd_dir
        .clone()
        .unwrap_or_else(crate::model::models_dir);
    let ssd = if args.ssd_test_mib == 0 {
        None
    } else {
        Some(
            hw::ssd_read_bandwidth(&ssd_dir, args.ssd_test_mib << 20)
                .with_context(|| format!("SSD test in {}", ssd_dir.display()))?,
        )
    };
    let gpu = hw::probe_gpu(256 << 20);
    let profile = match &gpu {
        Ok(g) => HardwareProfile {
            name: format!("{} (measured)", g.name),
            hbm_bytes_per_s: g.hbm_read_bytes_per_s,
            h2d_pinned_bytes_per_s: g.h2d_pinned_bytes_per_s,
            h2d_pageable_bytes_per_s: g.h2d_pageable_bytes_per_s,
            dram_read_bytes_per_s: host.dram_read_bytes_per_s,
            ssd_read_bytes_per_s: ssd.unwrap_or(1e9),
            op_overhead_s: 4e-6,
            device_bytes: g.total_bytes,
            device_fixed_bytes: g.fixed_bytes,
            matmul_flops_per_s: g.matmul_flops_per_s,
            cpu_attention_bytes_per_s: cpu_attention.as_ref().ok().copied(),
            attention_flops_per_s: Some(g.attention_flops_per_s),
        },
        // Without a GPU the profile describes the budgeted CPU device: its "HBM" is host
        // memory and its copies are memcpy.
        Err(_) => HardwareProfile {
            name: "cpu-sim (measured)".into(),
            hbm_bytes_per_s: host.dram_read_bytes_per_s,
            h2d_pinned_bytes_per_s: memcpy,
            h2d_pageable_bytes_per_s: memcpy,
            dram_read_bytes_per_s: host.dram_read_bytes_per_s,
            ssd_read_bytes_per_s: ssd.unwrap_or(1e9),
            op_overhead_s: 2e-6,
            device_bytes: 0,
            device_fixed_bytes: Some(0),
            // Its products and prompts run on the CPU.
            matmul_flops_per_s: hw::matmul_rate(&cpu, 128, 1024, 1024)
                .map_err(anyhow::Error::msg)?,
            cpu_attention_bytes_per_s: cpu_attention.as_ref().ok().copied(),
            attention_flops_per_s: Some(
                hw::AttentionProbe::PROMPT_CPU
                    .flops_per_s(&cpu)
                    .map_err(anyhow::Error::msg)?,
            ),
        },
    };
    if args.save {
        let path = HardwareProfile::saved_path();
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("cannot create {}", dir.display()))?;
        }
        crate::fsutil::write_atomic(&path, serde_json::to_string_pretty(&profile)?.as_bytes())
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    let mut out = std::io::stdout().lock();
    if args.json {
        let v = serde_json::json!({
            "host": host,
            "memcpy_bytes_per_s": memcpy,
            "ssd_read_bytes_per_s": ssd,
            "gpu": gpu.as_ref().ok(),
            "gpu_status": match &gpu { Ok(g) => format!("{} found", g.name), Err(e) => e.clone() },
            "profile": profile,
        });
        writeln!(out, "{v}")?;
        return Ok(());
    }
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
            match g.fixed_bytes {
                Some(f) => writeln!(
                    out,
                    "fixed device cost: {:.0} MiB (CUDA context, kernels, cuBLAS + workspace): --gpu-mem covers it",
                    f as f64 / (1u64 << 20) as f64
                )?,
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
    match ssd {
        Some(b) => writeln!(
            out,
            "SSD read bandwidth:  {:.2} GB/s (direct I/O, {})",
            b / 1e9,
            ssd_dir.display()
        )?,
        None => writeln!(out, "SSD read bandwidth:  not measured")?,
    }
    if args.save {
        writeln!(
            out,
            "profile saved to {}",
            HardwareProfile::saved_path().display()
        )?;
    }
    Ok(())
}
