//! What the benchmarks read off a model the runtime started ([`Running`]): the device it runs
//! on, the CPU threads its flags ask for, and the bytes per decoded token its bounds divide (the
//! plan's, or what a whole-model run reads). Measures nothing.

use crate::bench::bounds::Traffic;
use crate::footprint::LedgerSnapshot;
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
/// for a whole-model run. On the budgeted device, less what the FFN's bundle kernels left unread
/// over those steps (`ledger`: the ledger before and after them), which the plan counts whole: a
/// ReLU model's bundles read their gates and the few neurons on (a synthesized 1B shape ran at
/// 1.1–1.2× a bound that counted them all). CUDA's kernels skip the same parts, unseen by the
/// host: its figure stays the plan's.
pub fn traffic_of(
    r: &Running,
    first: usize,
    steps: usize,
    ledger: (&LedgerSnapshot, &LedgerSnapshot),
) -> Traffic {
    let mut t = planned_traffic(r, first, steps);
    if device_of(r) == "sim" && steps > 0 {
        let skipped = ledger.1.device_reads_skipped - ledger.0.device_reads_skipped;
        t.hbm_read_bytes = (t.hbm_read_bytes - skipped as f64 / steps as f64).max(0.0);
    }
    t
}

/// [`traffic_of`] as the plan (or a whole-model run's traffic counter) has it.
fn planned_traffic(r: &Running, first: usize, steps: usize) -> Traffic {
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
