//! What the benchmarks read off a model the runtime started ([`Running`]): the device it runs
//! on, the CPU threads its flags ask for, and the bytes per decoded token its bounds divide (the
//! plan's, or what a whole-model run reads). Measures nothing.

use crate::bench::bounds::Traffic;
use crate::runtime::{AnyEngine, ModelArgs, Running};

/// The device a started model runs on: `cpu`, `sim` or `cuda`.
pub fn device_of(r: &Running) -> &'static str {
    match &r.engine {
        AnyEngine::Cpu(_) => "cpu",
        AnyEngine::Sim(_) => "sim",
        AnyEngine::Cuda(_) => "cuda",
    }
}

/// CPU threads a run's flags ask for (`-t`), else one per core.
pub fn threads_of(args: &ModelArgs) -> usize {
    args.threads.map_or_else(
        || std::thread::available_parallelism().map_or(1, |n| n.get()),
        usize::from,
    )
}

/// Bytes per decoded token of a running model at positions `first..first + steps`: the plan's
/// for an offloaded run; every weight and the KV so far from device memory (CUDA) or DRAM (CPU)
/// for a whole-model run.
pub fn traffic_of(r: &Running, first: usize, steps: usize) -> Traffic {
    // Hybrid: the device reads attention and hot neurons, the CPU the cold ones, PCIe carries
    // two vectors a layer. Cache units: the device reads attention and the active neurons in
    // their units, PCIe carries the loads, the CPU reads the deciding vectors (oracle masks).
    // Both expected at the profile's frequencies. Experts: the device reads attention, routers
    // and the experts its units hold, the CPU the missed ones, PCIe the copies and two vectors a
    // layer.
    let sparse = r
        .hybrid
        .as_ref()
        .map(|h| &h.plan.per_token)
        .or(r.units.as_ref().map(|u| &u.plan.per_token))
        .or(r.experts.as_ref().map(|x| &x.plan.per_token));
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
