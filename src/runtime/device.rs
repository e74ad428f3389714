//! Choosing the device and its budget: the device the flags and the model allow, the KV cache
//! type, the preset `--emulate` names, the device budget, and the [`Budget`] the planner is
//! asked to fit for a job.

use anyhow::{Result, bail};

use super::{Device, Job, ModelArgs};
use crate::backend::KvType;
use crate::backend::cuda::device_available;
use crate::plan::{Budget, HardwareProfile};
use crate::store::Store;

pub(super) fn resolve_device(args: &ModelArgs, path: &std::path::Path) -> Result<Device> {
    let budgeted = args.budget.gpu_mem.is_some()
        || args.budget.dram_mem.is_some()
        || args.budget.emulate.is_some();
    Ok(match args.device {
        Device::Cuda if !device_available() => bail!(
            "--device cuda: no CUDA device found (no driver, or no GPU); use --device sim to run under a --gpu-mem budget on the CPU"
        ),
        Device::Cpu if budgeted => bail!(
            "--gpu-mem/--dram-mem/--emulate apply to offloaded devices: use --device sim (or cuda)"
        ),
        Device::Cpu if Store::is_store(path) => bail!(
            "{} is an offload store, which runs on a device: use --device sim (or cuda)",
            path.display()
        ),
        Device::Auto if device_available() => Device::Cuda,
        // A store only runs offloaded: without a GPU that is the budgeted device.
        Device::Auto if budgeted || Store::is_store(path) => Device::Sim,
        Device::Auto => Device::Cpu,
        d => d,
    })
}

/// The KV cache type a run on `device` uses: `--kv-type`, else f16 on a device and f32 on the CPU.
pub fn kv_type_for(args: &ModelArgs, device: Device) -> KvType {
    match args.kv_type {
        Some(k) => k.kv_type(),
        None if device == Device::Cpu => KvType::F32,
        None => KvType::F16,
    }
}

/// What the planner is asked to fit for `job` on a device with `gpu_mem`: the one place flags
/// and a job become a [`Budget`].
pub fn budget_for(args: &ModelArgs, job: Job, gpu_mem: u64, device: Device) -> Budget {
    Budget {
        gpu_mem,
        dram_mem: args.budget.dram_mem,
        window: args.budget.prefetch_window as usize,
        ctx: job.ctx,
        sessions: job.sessions.max(1),
        // Every session decodes in the same steps (serve, bench --sessions).
        sequences: job.sessions.max(1),
        kv_pool: job.kv_pool,
        kv_type: kv_type_for(args, device),
        probe: job.probe,
        batch: job
            .batch
            .clamp(1, crate::footprint::MAX_BATCH)
            .min(args.budget.max_step()),
        prompt: job.prompt.max(1),
        logit_rows: job.logit_rows.clamp(1, crate::footprint::MAX_BATCH),
        max_step: args.budget.max_step(),
        cpu_split: args.budget.cold == crate::plan::choice::Cold::Split,
        hot_reserve: None,
        unit_reserve: None,
        expert_prefetch: !args.budget.no_expert_prefetch,
        expert_low_bit: args.budget.expert_low_bit,
        predicted: args.sparsity == super::SparsityMode::Predicted,
    }
}

/// The preset `--emulate` names, if any.
pub(super) fn emulated(args: &ModelArgs) -> Result<Option<HardwareProfile>> {
    let Some(name) = &args.budget.emulate else {
        return Ok(None);
    };
    let p = HardwareProfile::load(name).map_err(|e| anyhow::anyhow!("--emulate: {e}"))?;
    if p.device_bytes == 0 {
        bail!(
            "--emulate {name}: the profile states no device memory (device_bytes), so there is nothing to emulate"
        );
    }
    Ok(Some(p))
}

/// The device budget a run uses: `--gpu-mem`, capped by an emulated card's memory.
pub(super) fn gpu_budget(
    args: &ModelArgs,
    emulate: Option<&HardwareProfile>,
) -> Result<Option<u64>> {
    Ok(match (args.budget.gpu_mem, emulate) {
        (Some(g), Some(p)) if g > p.device_bytes => bail!(
            "--gpu-mem {} exceeds the {} MiB of the emulated {}",
            crate::plan::human_bytes(g),
            p.device_bytes >> 20,
            p.name
        ),
        (Some(g), _) => Some(g),
        (None, Some(p)) => Some(p.device_bytes),
        (None, None) => None,
    })
}
