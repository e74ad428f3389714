//! The machine as `doctor` measures it: every probe run once — host, memcpy, CPU attention,
//! the SSD, the GPU — and the hardware profile they make (the GPU's, or without one the
//! budgeted CPU device's), which can be saved where the planner looks first. Prints nothing.

use std::path::PathBuf;

use anyhow::{Context, Result};

use super::probe::{self as hw, GpuProfile, HostProfile};
use crate::backend::cpu::CpuBackend;
use crate::plan::HardwareProfile;

/// What `doctor` measured.
pub struct Machine {
    pub host: HostProfile,
    /// One thread's memcpy, bytes/s.
    pub memcpy_bytes_per_s: f64,
    /// The CPU's decode attention rate, bytes of KV cache/s, or why it was not measured.
    pub cpu_attention: Result<f64, String>,
    /// The CPU's neuron-sparse pass: seconds a read costs beyond its bytes, or why it was not
    /// measured.
    pub cpu_read_start: Result<f64, String>,
    /// Where the SSD was read, and its rate (None: not measured).
    pub ssd_dir: PathBuf,
    pub ssd_read_bytes_per_s: Option<f64>,
    /// The GPU, or why none was found.
    pub gpu: Result<GpuProfile, String>,
    pub profile: HardwareProfile,
}

/// Measure this machine with `threads` threads for the CPU probes, reading `ssd_test_mib` MiB
/// in `ssd_dir` (0 skips the SSD test).
pub fn measure_machine(threads: usize, ssd_dir: PathBuf, ssd_test_mib: usize) -> Result<Machine> {
    let host = hw::probe_host(threads);
    let memcpy = hw::memcpy_bandwidth(256 << 20, 5);
    // One pool of `threads` for every CPU probe.
    let cpu = CpuBackend::new(threads)?;
    let cpu_attention = hw::cpu_attention_rate(&cpu);
    let cpu_read_start = hw::cpu_read_start_s(&cpu, 256 << 20, host.dram_read_bytes_per_s);
    let ssd = if ssd_test_mib == 0 {
        None
    } else {
        Some(
            hw::ssd_read_bandwidth(&ssd_dir, ssd_test_mib << 20)
                .with_context(|| format!("SSD test in {}", ssd_dir.display()))?,
        )
    };
    let gpu = hw::probe_gpu(256 << 20);
    let profile = profile_of(
        &gpu,
        &host,
        memcpy,
        ssd,
        (&cpu_attention, &cpu_read_start),
        &cpu,
    )?;
    Ok(Machine {
        host,
        memcpy_bytes_per_s: memcpy,
        cpu_attention,
        cpu_read_start,
        ssd_dir,
        ssd_read_bytes_per_s: ssd,
        gpu,
        profile,
    })
}

/// The hardware profile the measurements make: the GPU's where one was found, else the
/// budgeted CPU device's (its products and prompts measured on `cpu`).
fn profile_of(
    gpu: &Result<GpuProfile, String>,
    host: &HostProfile,
    memcpy: f64,
    ssd: Option<f64>,
    (cpu_attention, cpu_read_start): (&Result<f64, String>, &Result<f64, String>),
    cpu: &CpuBackend,
) -> Result<HardwareProfile> {
    Ok(match gpu {
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
            cpu_read_start_s: cpu_read_start.as_ref().ok().copied(),
            attention_flops_per_s: Some(g.attention_flops_per_s),
            copies_share_memory: false,
            rates_source: None,
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
            matmul_flops_per_s: hw::matmul_rate(cpu, 128, 1024, 1024)
                .map_err(anyhow::Error::msg)?,
            cpu_attention_bytes_per_s: cpu_attention.as_ref().ok().copied(),
            cpu_read_start_s: cpu_read_start.as_ref().ok().copied(),
            attention_flops_per_s: Some(
                hw::AttentionProbe::PROMPT_CPU
                    .flops_per_s(cpu)
                    .map_err(anyhow::Error::msg)?,
            ),
            copies_share_memory: true,
            rates_source: None,
        },
    })
}

/// Write `profile` where the planner looks first ([`HardwareProfile::saved_path`]).
pub fn save_profile(profile: &HardwareProfile) -> Result<()> {
    let path = HardwareProfile::saved_path();
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    crate::fsutil::write_atomic(&path, serde_json::to_string_pretty(profile)?.as_bytes())
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}
