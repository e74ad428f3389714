//! A model placed on a device for one job: its engine, load time, ledger and plan, what a
//! sparse run (hybrid, cache units) or the CPU engine reports, and the device memory the
//! process holds — and the `memory` object of `run --json` made of them.

use std::sync::Arc;

use serde_json::{Value, json};

use super::AnyEngine;
use crate::engine::DecodeTraffic;
use crate::footprint::{Ledger, LedgerSnapshot};
use crate::plan::{HardwareProfile, Plan};
use crate::tier::cold::ColdTraffic;

/// What a hybrid run placed and what its CPU share reads.
pub struct Hybrid {
    pub plan: crate::plan::hybrid::HybridPlan,
    pub traffic: Arc<ColdTraffic>,
}

/// What a sparse mode's plan holds on the device (`fixed + placed`, and placed) and moves
/// per token ([`Running::sparse_plan`]).
pub struct SparsePlanned<'a> {
    pub per_token: &'a crate::plan::resident::SparsePerToken,
    pub gpu_bytes: u64,
    pub gpu_placed_bytes: u64,
}

/// A cache-unit run's plan and what its units moved.
pub struct Units {
    pub plan: crate::plan::units::UnitPlan,
    pub traffic: Arc<crate::tier::units::UnitTraffic>,
}

/// An offloaded mixture-of-experts run's plan and what its units and the CPU did.
pub struct ExpertsRun {
    pub plan: crate::plan::experts::ExpertPlan,
    pub traffic: Arc<crate::tier::experts::ExpertTraffic>,
}

/// A model placed on a device for one job.
pub struct Running {
    pub engine: AnyEngine,
    /// Seconds from the start of loading until the engine was ready.
    pub load_s: f64,
    /// The byte ledger of a device run (offloaded or whole-GPU).
    pub ledger: Option<Arc<Ledger>>,
    /// For offloaded runs: the plan.
    pub plan: Option<Plan>,
    /// For hybrid runs (`--cold cpu`): the hot-neuron plan and the CPU's cold-neuron reads.
    pub hybrid: Option<Hybrid>,
    /// For cache-unit runs (`--cold gpu`): their plan and what they moved.
    pub units: Option<Units>,
    /// For offloaded mixture-of-experts runs: the expert plan and what it moved.
    pub experts: Option<ExpertsRun>,
    /// For the dense CPU engine: what a decode step reads from DRAM.
    pub traffic: Option<DecodeTraffic>,
    /// The preset a run emulates (`--emulate`).
    pub emulated: Option<HardwareProfile>,
    /// Most device memory the process was seen to hold (driver figures, CUDA only): by its
    /// own entry, and by the device's used memory beyond what was used before it started.
    pub(super) process_peak: std::sync::atomic::AtomicU64,
    pub(super) device_peak: std::sync::atomic::AtomicU64,
}

impl Running {
    pub fn ledger(&self) -> Option<&Arc<Ledger>> {
        self.ledger.as_ref()
    }

    /// The ledger's figures now (and a sample of the process's device memory).
    pub fn snapshot(&self) -> LedgerSnapshot {
        self.sample_process();
        self.ledger().map(|l| l.snapshot()).unwrap_or_default()
    }

    /// Device memory this process holds now, from the driver (CUDA only).
    pub fn process_bytes(&self) -> Option<u64> {
        match &self.engine {
            AnyEngine::Cuda(e) => e.backend().process_bytes(),
            _ => None,
        }
    }

    /// Device memory used now beyond what was used before this process's context: what
    /// `--gpu-mem` is held to as the card counts it (CUDA only).
    pub fn device_used_bytes(&self) -> Option<u64> {
        match &self.engine {
            AnyEngine::Cuda(e) => e.backend().device_used_bytes(),
            _ => None,
        }
    }

    pub(super) fn sample_process(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        if let Some(b) = self.process_bytes() {
            self.process_peak.fetch_max(b, Relaxed);
        }
        if let Some(b) = self.device_used_bytes() {
            self.device_peak.fetch_max(b, Relaxed);
        }
    }

    /// What runs the FFN neurons that do not fit the device, as `--cold` names it: `cpu`
    /// (hybrid), `gpu` (cache units), `split` or `stream`; `None` without a plan (the whole
    /// model on its device).
    pub fn cold_mode(&self) -> Option<&'static str> {
        let plan = self.plan.as_ref()?;
        Some(if let Some(x) = &self.experts {
            match x.plan.mode {
                crate::plan::experts::ExpertMode::Cpu => "cpu",
                crate::plan::experts::ExpertMode::Units => "gpu",
                crate::plan::experts::ExpertMode::Stream => "stream",
                crate::plan::experts::ExpertMode::Static => "static",
            }
        } else if self.hybrid.is_some() {
            "cpu"
        } else if self.units.is_some() {
            "gpu"
        } else if plan.residency.cpu_rows > 0 {
            "split"
        } else {
            "stream"
        })
    }

    /// The plan of the sparse mode that runs (hybrid, cache units, or a mixture-of-experts
    /// model's experts), where one does: what it holds on the device and moves per token.
    pub fn sparse_plan(&self) -> Option<SparsePlanned<'_>> {
        let (per_token, gpu_bytes, gpu_placed_bytes) =
            match (&self.hybrid, &self.units, &self.experts) {
                (Some(h), _, _) => (&h.plan.per_token, h.plan.device.total, h.plan.device.placed),
                (_, Some(u), _) => (&u.plan.per_token, u.plan.device.total, u.plan.device.placed),
                (_, _, Some(x)) => (&x.plan.per_token, x.plan.device.total, x.plan.device.placed),
                _ => return None,
            };
        Some(SparsePlanned {
            per_token,
            gpu_bytes,
            gpu_placed_bytes,
        })
    }

    /// The plan's predicted decode tokens/s for the mode it runs: the aggregate of a step of
    /// the job's sessions, each decoding a token ([`crate::plan::batch`]); `None` without a plan.
    pub fn predicted_tokens_per_s(&self) -> Option<f64> {
        match (&self.hybrid, &self.units) {
            (Some(h), _) => Some(h.plan.predicted_tokens_per_s),
            (_, Some(u)) => Some(u.plan.predicted_tokens_per_s),
            _ => self.plan.as_ref().map(|p| p.prediction.tokens_per_s),
        }
    }

    /// The most device memory the process was seen to hold by its own entry (driver figures;
    /// CUDA only).
    pub fn process_peak_bytes(&self) -> Option<u64> {
        match self.process_peak.load(std::sync::atomic::Ordering::Relaxed) {
            0 => None,
            b => Some(b),
        }
    }

    /// The most device memory seen used beyond the device's figure before this process
    /// started (nvidia-smi's `memory.used` less its idle figure; CUDA only).
    pub fn device_peak_bytes(&self) -> Option<u64> {
        match self.device_peak.load(std::sync::atomic::Ordering::Relaxed) {
            0 => None,
            b => Some(b),
        }
    }

    /// The fixed device cost this run's budget was carved after, with both driver figures.
    pub fn fixed_cost(&self) -> Option<crate::footprint::FixedCost> {
        match &self.engine {
            AnyEngine::Cuda(e) => e.backend().fixed_cost(),
            _ => None,
        }
    }

    /// The `memory` object of `run --json`: peaks from the ledger and per-token traffic of the
    /// decode steps between `after_prefill` and `end` (the bytes read from DRAM per step for the
    /// CPU engine).
    pub fn memory_json(
        &self,
        after_prefill: LedgerSnapshot,
        end: LedgerSnapshot,
        first_pos: usize,
        steps: usize,
    ) -> Value {
        let per = |a: u64, b: u64| {
            if steps == 0 {
                0.0
            } else {
                (b - a) as f64 / steps as f64
            }
        };
        let mut v = json!({
            "gpu_peak_bytes": end.hbm_peak,
            "gpu_process_peak_bytes": self.process_peak_bytes(),
            "gpu_device_used_peak_bytes": self.device_peak_bytes(),
            "gpu_fixed_cost": self.fixed_cost(),
            "dram_peak_bytes": end.dram_total_peak,
            "h2d_bytes_per_token": per(after_prefill.h2d_bytes, end.h2d_bytes),
            "ssd_bytes_per_token": per(after_prefill.ssd_read_bytes, end.ssd_read_bytes),
            // What the device's kernels read of its weights and KV caches (src/backend/reads.rs;
            // CUDA counts a bundle kernel's masked-off parts as read: its host does not see them).
            "device_read_bytes_per_token": per(after_prefill.device_read_bytes, end.device_read_bytes),
            // What the FFN's bundle kernels left unread: the budgeted device counts it; CUDA's
            // kernels skip the same, unseen by the host (null there, not a count of none).
            "device_reads_skipped_per_token": matches!(self.engine, AnyEngine::Sim(_)).then(|| per(
                after_prefill.device_reads_skipped,
                end.device_reads_skipped
            )),
        });
        if let Some(t) = &self.traffic {
            v["dram_read_bytes_per_token"] = t.mean(first_pos, steps).into();
        }
        if let Some(p) = &self.emulated {
            v["emulated"] = p.name.clone().into();
        }
        if let Some(plan) = &self.plan {
            v["planned"] = json!({
                "gpu_bytes": plan.gpu.total,
                "gpu_fixed_bytes": plan.gpu.fixed,
                "gpu_placed_bytes": plan.gpu.placed,
                "h2d_bytes_per_token": plan.per_token.h2d_bytes,
                "ssd_bytes_per_token": plan.per_token.ssd_bytes,
                "predicted_tokens_per_s": self.predicted_tokens_per_s(),
            });
            // A sparse mode holds and moves what its own plan says: its device bytes, and its
            // PCIe bytes both ways (the FFN input out and the partial sums in, or the units'
            // loads; logits). Hybrid and the cache units start from a streaming plan whose
            // host→device bytes are not theirs; an expert plan is written into its streaming
            // plan, host→device bytes too.
            if let Some(sp) = self.sparse_plan() {
                let p = &mut v["planned"];
                p["gpu_bytes"] = sp.gpu_bytes.into();
                p["gpu_placed_bytes"] = sp.gpu_placed_bytes.into();
                p["pcie_bytes_per_token"] = sp.per_token.pcie_bytes.into();
                if self.experts.is_none() {
                    p["h2d_bytes_per_token"] = Value::Null;
                }
            }
        }
        v
    }
}
