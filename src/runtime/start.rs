//! Placing an opened model on its device for a job: the settings every case shares, then one
//! step per case — the whole model on a GPU or on the CPU, or offloaded under a plan to a GPU or
//! to the budgeted CPU device — each with its KV pool, logit rows, recorded steps and prefill
//! steps; the result is [`Running`].

use std::sync::Arc;

use anyhow::{Context, Result};

use super::device::{budget_for, emulated, gpu_budget, kv_type_for};
use super::model::{LoadedModel, SharedPredictor, Weights};
use super::offload::OffloadSource;
use super::rates::RatesDevice;
use super::running::{Hybrid, Units};
use super::{AnyEngine, Device, Job, ModelArgs, Running};
use crate::backend::cpu::{CpuBackend, kernels};
use crate::backend::cuda::CudaBackend;
use crate::backend::sim::SimBackend;
use crate::backend::{Backend, KvType};
use crate::engine::{DecodeTraffic, Engine};
use crate::footprint::Ledger;
use crate::model::ModelWeights;
use crate::plan::{HardwareProfile, Plan};
use crate::store::Store;

/// What every case of [`LoadedModel::start`] takes from the flags and the job.
struct StartSettings<'a> {
    args: &'a ModelArgs,
    job: Job,
    kernels: &'static kernels::Kernels,
    threads: usize,
    /// The preset `--emulate` names.
    emulate: Option<HardwareProfile>,
    /// The device budget (`--gpu-mem`, capped by an emulated card).
    gpu_mem: Option<u64>,
    kv_type: KvType,
    /// What `--sparsity` asks for ([`LoadedModel::sparsity`]).
    thresholds: Vec<f32>,
    predictor: Option<SharedPredictor>,
}

impl StartSettings<'_> {
    /// Copies paced at the emulated card's host-to-device rate, where one is emulated.
    fn pace(&self, b: &dyn Fn(f64) -> crate::backend::Result<()>) -> Result<()> {
        if let Some(p) = &self.emulate {
            b(p.h2d_pinned_bytes_per_s)?;
        }
        Ok(())
    }
}

/// An engine placed by one case, with what its run reports.
struct Placed {
    engine: AnyEngine,
    ledger: Option<Arc<Ledger>>,
    plan: Option<Plan>,
    traffic: Option<DecodeTraffic>,
    hybrid: Option<Hybrid>,
    units: Option<Units>,
    experts: Option<super::running::ExpertsRun>,
}

/// Bytes a whole-model CPU engine's prefill step may hold (its activation buffers): steps of
/// more rows than [`crate::footprint::MAX_BATCH`] are ~10% faster on the CPU too (SmolLM2, 2048
/// tokens: 4.3–4.4 s in one step, 4.6–4.9 s in steps of 512), and a 7B model's 4096-row step
/// holds ~0.8 GB.
const HOST_STEP_BYTES: u64 = 1 << 30;

/// A whole-model engine (weights loaded, a KV pool allocated where the job asks for one) with
/// prefill steps as large as `room` bytes hold, up to `max_step` rows
/// ([`Engine::whole_model_group`]).
fn whole_model_prefill<B: Backend>(
    e: Engine<B>,
    job: &Job,
    max_step: usize,
    room: u64,
) -> Result<Engine<B>> {
    let group = e.whole_model_group(job.prompt, max_step, room, job.logit_rows.max(1))?;
    tracing::info!(
        "prefill steps of up to {group} rows ({} MiB for a step)",
        room >> 20
    );
    Ok(e.with_prefill(crate::footprint::PrefillLayout {
        group,
        ..Default::default()
    })?)
}

/// The room a whole-GPU engine's prefill step has: the device's free memory less the sessions'
/// KV caches (where no pool holds them already) and a margin for the driver and cuBLAS.
fn whole_gpu_step_room(e: &Engine<CudaBackend>, job: &Job) -> Result<u64> {
    let info = e.backend().info()?;
    let kv = match job.kv_pool {
        Some(_) => 0,
        None => {
            job.sessions.max(1) as u64 * crate::footprint::kv_bytes(e.spec(), job.ctx, e.kv_type())
        }
    };
    let margin = (256u64 << 20).max(info.total_bytes / 32);
    tracing::info!(
        "{} MiB free on the device, {} MiB for KV caches",
        info.free_bytes >> 20,
        kv >> 20
    );
    Ok(info.free_bytes.saturating_sub(kv + margin))
}

/// `e` with the job's KV pool, if it asks for one and the plan keeps KV on the device.
fn pooled<'p, B: crate::backend::Backend>(
    e: Engine<B>,
    job: &Job,
    plan: impl Into<Option<&'p Plan>>,
) -> Result<Engine<B>> {
    let kv_host = plan.into().is_some_and(|p| p.prefill.kv_host);
    Ok(match job.kv_pool.filter(|_| !kv_host) {
        Some(blocks) => e.with_kv_pool(blocks).with_context(|| {
            format!(
                "a KV pool of {} positions",
                blocks * crate::backend::KV_BLOCK
            )
        })?,
        None => e,
    })
}

impl LoadedModel {
    /// Place the model on its device for `job`.
    pub fn start(&self, args: &ModelArgs, job: Job) -> Result<Running> {
        let settings = self.start_settings(args, job)?;
        let placed = match (&self.weights, self.device) {
            (Weights::Dense(w), Device::Cuda) => self.start_whole_gpu(&settings, w)?,
            (Weights::Dense(w), _) => self.start_whole_cpu(&settings, w)?,
            (Weights::Stored(store), Device::Cuda) => {
                self.start_offloaded_cuda(&settings, store)?
            }
            (Weights::Stored(store), _) => self.start_offloaded_sim(&settings, store)?,
        };
        let Placed {
            engine,
            ledger,
            plan,
            traffic,
            hybrid,
            units,
            experts,
        } = placed;
        let running = Running {
            engine,
            load_s: self.t0.elapsed().as_secs_f64(),
            ledger,
            plan,
            hybrid,
            units,
            experts,
            traffic,
            emulated: settings.emulate,
            process_peak: std::sync::atomic::AtomicU64::new(0),
            device_peak: std::sync::atomic::AtomicU64::new(0),
        };
        running.sample_process();
        Ok(running)
    }

    /// The CPU kernels, threads, emulated card, budget, KV type and sparsity of this start (and a
    /// warning for each flag this device ignores).
    fn start_settings<'a>(&self, args: &'a ModelArgs, job: Job) -> Result<StartSettings<'a>> {
        let kernels = match &args.cpu_kernels {
            None => kernels::best(),
            Some(name) => kernels::by_name(name).with_context(|| {
                let have: Vec<&str> = kernels::available().iter().map(|k| k.name).collect();
                format!(
                    "--cpu-kernels {name}: not available on this CPU (available: {})",
                    have.join(", ")
                )
            })?,
        };
        let threads = args.threads.map_or(0, usize::from);
        if args.cuda_graphs_on(self.device) && self.device == Device::Cpu {
            tracing::warn!(
                "--cuda-graphs: the CPU backend runs each op as it comes; nothing is recorded \
                 (recorded steps run on --device cuda, and are checked on --device sim)"
            );
        }
        if args.programmatic_launch && self.device != Device::Cuda {
            tracing::warn!("--programmatic-launch: only CUDA launches kernels; ignored here");
        }
        let emulate = emulated(args)?;
        let gpu_mem = gpu_budget(args, emulate.as_ref())?;
        let kv_type = kv_type_for(args, self.device);
        let (thresholds, predictor) = self.sparsity(args)?;
        Ok(StartSettings {
            args,
            job,
            kernels,
            threads,
            emulate,
            gpu_mem,
            kv_type,
            thresholds,
            predictor,
        })
    }

    /// The whole model on the GPU, prefill steps as large as its free memory holds.
    fn start_whole_gpu(&self, s: &StartSettings, w: &ModelWeights) -> Result<Placed> {
        let (args, job, kv_type) = (s.args, s.job, s.kv_type);
        let ledger = Ledger::new(None, None);
        let cuda = CudaBackend::new(0, ledger.clone())?;
        cuda.set_programmatic_launch(args.programmatic_launch)?;
        tracing::info!("{}", cuda.name());
        let e = Engine::new(cuda, self.spec.clone(), w)?
            .with_kv_type(kv_type)?
            .with_sparsity(s.thresholds.clone())?
            .with_predictor(s.predictor.clone());
        let e = pooled(e, &job, None)?
            .with_logit_rows(job.logit_rows)
            .with_recorded_steps(args.cuda_graphs_on(self.device));
        let room = whole_gpu_step_room(&e, &job)?;
        let e = whole_model_prefill(e, &job, args.budget.max_step(), room)?;
        Ok(Placed {
            engine: AnyEngine::Cuda(e),
            ledger: Some(ledger),
            plan: None,
            traffic: Some(DecodeTraffic::of(&self.spec, w, kv_type)),
            hybrid: None,
            units: None,
            experts: None,
        })
    }

    /// The whole model on the CPU, prefill steps of up to [`HOST_STEP_BYTES`].
    fn start_whole_cpu(&self, s: &StartSettings, w: &ModelWeights) -> Result<Placed> {
        let (args, job, kv_type) = (s.args, s.job, s.kv_type);
        let cpu = CpuBackend::with_kernels(s.threads, s.kernels)?;
        let e = Engine::new(cpu, self.spec.clone(), w)?
            .with_kv_type(kv_type)?
            .with_sparsity(s.thresholds.clone())?
            .with_predictor(s.predictor.clone());
        let e = pooled(e, &job, None)?
            .with_logit_rows(job.logit_rows)
            .with_recorded_steps(args.cuda_graphs_on(self.device));
        let e = whole_model_prefill(e, &job, args.budget.max_step(), HOST_STEP_BYTES)?;
        Ok(Placed {
            engine: AnyEngine::Cpu(e),
            ledger: None,
            plan: None,
            traffic: Some(DecodeTraffic::of(&self.spec, w, kv_type)),
            hybrid: None,
            units: None,
            experts: None,
        })
    }

    /// The store offloaded to the GPU under a plan: the whole process within `--gpu-mem` where
    /// one is given.
    fn start_offloaded_cuda(&self, s: &StartSettings, store: &Arc<Store>) -> Result<Placed> {
        let (args, job, gpu_mem) = (s.args, s.job, s.gpu_mem);
        let mut budget = budget_for(args, job, gpu_mem.unwrap_or(u64::MAX / 4), self.device);
        let mut hw = args
            .budget
            .hardware_profile(RatesDevice::Cuda, "gpu-4g", s.threads)?;
        // The whole process within the budget: the fixed cost this process measures
        // comes off it (the profile's figure where the driver cannot tell).
        let (cuda, ledger) = match gpu_mem {
            Some(g) => {
                let (c, l) = CudaBackend::with_process_budget(
                    0,
                    g,
                    args.budget.dram_mem,
                    hw.fixed_device_bytes(),
                )?;
                hw.device_fixed_bytes = c.fixed_bytes();
                (c, l)
            }
            None => {
                let l = Ledger::new(None, args.budget.dram_mem);
                hw.device_fixed_bytes = Some(0);
                (CudaBackend::new(0, l.clone())?, l)
            }
        };
        if gpu_mem.is_none() {
            budget.gpu_mem = u64::MAX / 4;
        }
        // Offloaded steps wait on weight copies between their kernels: launches keep
        // their full order there (the step is bound by the copies, not the launches).
        if args.programmatic_launch {
            tracing::warn!(
                "--programmatic-launch: whole-GPU runs only (no --gpu-mem); ignored here"
            );
        }
        s.pace(&|r| cuda.pace_copies(r))?;
        let (plan, neurons) = self.offload_plan(args, store, &budget, &hw)?;
        self.offloaded_engine(s, cuda, store, plan, neurons, ledger, AnyEngine::Cuda)
    }

    /// The store offloaded to the budgeted CPU device under a plan.
    fn start_offloaded_sim(&self, s: &StartSettings, store: &Arc<Store>) -> Result<Placed> {
        let (args, job, gpu_mem) = (s.args, s.job, s.gpu_mem);
        let budget = budget_for(args, job, gpu_mem.unwrap_or(u64::MAX / 4), self.device);
        let hw = args
            .budget
            .hardware_profile(RatesDevice::Sim, "cpu-sim", s.threads)?;
        let (plan, neurons) = self.offload_plan(args, store, &budget, &hw)?;
        let ledger = Ledger::new(gpu_mem.map(|_| plan.ledger_budget()), args.budget.dram_mem);
        let sim = SimBackend::new(
            CpuBackend::with_kernels(s.threads, s.kernels)?,
            ledger.clone(),
        );
        s.pace(&|r| sim.pace_copies(r))?;
        self.offloaded_engine(s, sim, store, plan, neurons, ledger, AnyEngine::Sim)
    }

    /// An offloaded engine on `b` under `plan`: the store's weights as the plan places them, the
    /// run's KV type, sparsity, prefill layout, KV pool, logit rows and recorded steps (what
    /// every offloaded device shares), wrapped by `wrap`.
    #[allow(clippy::too_many_arguments)]
    fn offloaded_engine<B: Backend>(
        &self,
        s: &StartSettings,
        b: B,
        store: &Arc<Store>,
        plan: Plan,
        neurons: super::offload::NeuronPlan,
        ledger: Arc<Ledger>,
        wrap: fn(Engine<B>) -> AnyEngine,
    ) -> Result<Placed> {
        let OffloadSource {
            src,
            hybrid,
            units,
            experts,
        } = self.offload_source(&b, store, &plan, neurons, &ledger, (s.kernels, s.threads))?;
        let e = Engine::with_source(b, self.spec.clone(), src)?
            .with_kv_type(s.kv_type)?
            .with_sparsity(s.thresholds.clone())?
            .with_predictor(s.predictor.clone())
            .with_prefill(plan.prefill)?;
        let e = pooled(e, &s.job, &plan)?
            .with_logit_rows(plan.budget.logit_rows)
            .with_recorded_steps(s.args.cuda_graphs_on(self.device));
        Ok(Placed {
            engine: wrap(e),
            ledger: Some(ledger),
            plan: Some(plan),
            traffic: None,
            hybrid,
            units,
            experts,
        })
    }
}
