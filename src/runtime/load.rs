//! Assembling an engine: find and open the model, turn prompt flags into token ids, then place
//! the model on the chosen device — all of it on the CPU or a GPU, or offloaded to the budgeted
//! device or a GPU under a plan — once the job's context and batch are known.

use crate::engine::NeuronPredictor;

/// The predictor `--sparsity predicted` gives every engine.
type SharedPredictor = Arc<dyn NeuronPredictor>;
use crate::sparsity::{Predictors, SparsityProfile};

/// `--sparsity-target` where none is given for a SwiGLU model: SmolLM2-135M on held-out text
/// stays within 1% of dense perplexity up to 15% with oracle masks (+0.26%; 20%: +1.3%).
pub const DEFAULT_SPARSITY_TARGET: f64 = 0.15;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use super::{Device, ModelArgs, PromptArgs};
use crate::backend::cpu::{CpuBackend, kernels};
use crate::backend::cuda::{CudaBackend, device_available};
use crate::backend::sim::SimBackend;
use crate::backend::{Backend, KvType};
use crate::engine::{DecodeTraffic, Engine, WeightSource};
use crate::footprint::{Ledger, LedgerSnapshot};
use crate::model::{ChatMessage, Model, ModelSpec, ModelWeights, Tokenizer, default_model_path};
use crate::plan::{Budget, HardwareProfile, Plan};
use crate::runtime::store::open_store_for;
use crate::store::Store;
use crate::tier::cold::ColdTraffic;
use crate::tier::hybrid::HybridWeights;
use crate::tier::stream::StreamWeights;

/// An engine on whichever backend the flags chose.
#[allow(clippy::large_enum_variant)] // one per process; boxing buys nothing
pub enum AnyEngine {
    Cpu(Engine<CpuBackend>),
    Sim(Engine<SimBackend>),
    Cuda(Engine<CudaBackend>),
}

/// Run `$body` with `$e` bound to the engine, whatever its backend.
macro_rules! with_engine {
    ($any:expr, $e:ident => $body:expr) => {
        match $any {
            $crate::runtime::AnyEngine::Cpu($e) => $body,
            $crate::runtime::AnyEngine::Sim($e) => $body,
            $crate::runtime::AnyEngine::Cuda($e) => $body,
        }
    };
}
pub(crate) use with_engine;

/// What a job needs the device to hold.
#[derive(Clone, Copy, Debug)]
pub struct Job {
    /// KV cache positions of each session.
    pub ctx: usize,
    /// Sessions holding a KV cache at once.
    pub sessions: usize,
    /// Whether sessions keep a query probe (contexts).
    pub probe: bool,
    /// Most tokens one step evaluates.
    pub batch: usize,
    /// Logit rows one step returns at most.
    pub logit_rows: usize,
    /// Most tokens one forward call evaluates (the longest prompt).
    pub prompt: usize,
    /// Blocks of a paged KV pool the sessions share, in place of a cache of `ctx` each.
    pub kv_pool: Option<usize>,
}

impl Job {
    /// One session of `ctx` positions.
    pub fn single(ctx: usize, batch: usize, logit_rows: usize) -> Self {
        Job {
            ctx,
            sessions: 1,
            probe: false,
            batch,
            logit_rows,
            prompt: batch,
            kv_pool: None,
        }
    }

    /// The same job for prompts of up to `tokens` (a call longer than a step is partitioned).
    pub fn with_prompt(self, tokens: usize) -> Self {
        Job {
            prompt: tokens.max(1),
            ..self
        }
    }
}

enum Weights {
    /// The model file itself, for the CPU engine.
    Dense(Box<ModelWeights>),
    /// The offload store, for budgeted devices.
    Stored(Arc<Store>),
}

/// What a hybrid run placed and what its CPU share reads.
pub struct Hybrid {
    pub plan: crate::plan::hybrid::HybridPlan,
    pub traffic: Arc<ColdTraffic>,
}

/// What an offloaded run's plan puts beside streaming, if anything.
enum NeuronPlan {
    Stream,
    Hybrid(crate::plan::hybrid::HybridPlan),
    Units(crate::plan::units::UnitPlan),
}

/// An offloaded run's weight source, and what its sparse execution reports.
struct OffloadSource<B: Backend> {
    src: Box<dyn WeightSource<B>>,
    hybrid: Option<Hybrid>,
    units: Option<Units>,
}

/// A cache-unit run's plan and what its units moved.
pub struct Units {
    pub plan: crate::plan::units::UnitPlan,
    pub traffic: Arc<crate::tier::units::UnitTraffic>,
}

/// An opened model, not yet placed on a device.
pub struct LoadedModel {
    pub spec: ModelSpec,
    pub tokenizer: Option<Tokenizer>,
    pub path: PathBuf,
    weights: Weights,
    device: Device,
    t0: Instant,
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
    /// For the dense CPU engine: what a decode step reads from DRAM.
    pub traffic: Option<DecodeTraffic>,
    /// The preset a run emulates (`--emulate`).
    pub emulated: Option<HardwareProfile>,
    /// Most device memory the process was seen to hold (driver figures, CUDA only).
    process_peak: std::sync::atomic::AtomicU64,
}

fn resolve_device(args: &ModelArgs, path: &std::path::Path) -> Result<Device> {
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
    }
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

/// Log the plan, and say so when the budget narrowed the prefetch window.
fn note_plan(plan: &Plan) {
    tracing::info!("plan:\n{}", plan.report());
    if plan.streams() && plan.window < plan.budget.window {
        tracing::warn!(
            "--gpu-mem holds a prefetch window of {} layers, not the {} asked",
            plan.window,
            plan.budget.window
        );
    }
}

/// The preset `--emulate` names, if any.
fn emulated(args: &ModelArgs) -> Result<Option<HardwareProfile>> {
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
fn gpu_budget(args: &ModelArgs, emulate: Option<&HardwareProfile>) -> Result<Option<u64>> {
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

impl LoadedModel {
    pub fn load(args: &ModelArgs) -> Result<Self> {
        let t0 = Instant::now();
        let path = match &args.model {
            Some(p) => p.clone(),
            None => {
                let p = default_model_path();
                if !p.exists() {
                    bail!(
                        "no model given and the default model is not at {}: run scripts/fetch-models.sh or pass --model",
                        p.display()
                    );
                }
                p
            }
        };
        let device = resolve_device(args, &path)?;
        let budgeted = gpu_budget(args, emulated(args)?.as_ref())?.is_some();
        let offloaded = device == Device::Sim || (device == Device::Cuda && budgeted);
        let (spec, tokenizer, weights) = match offloaded {
            true => {
                let store = open_store_for(&path)?;
                let tok = store.tokenizer()?;
                (
                    store.manifest.spec.clone(),
                    tok,
                    Weights::Stored(Arc::new(store)),
                )
            }
            _ => {
                if Store::is_store(&path) {
                    bail!(
                        "{} is an offload store: run it with --gpu-mem (or --device sim)",
                        path.display()
                    );
                }
                let model = Model::load(&path)
                    .with_context(|| format!("cannot load model {}", path.display()))?;
                tracing::info!(
                    "loaded {} ({} layers, d_model {}, {} MiB of weights)",
                    model.spec.name,
                    model.spec.n_layers,
                    model.spec.d_model,
                    model.weights.total_bytes() >> 20
                );
                (
                    model.spec,
                    model.tokenizer,
                    Weights::Dense(Box::new(model.weights)),
                )
            }
        };
        Ok(LoadedModel {
            spec,
            tokenizer,
            path,
            weights,
            device,
            t0,
        })
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// Identity of the model's weights: the store's id, or a hash of the shape, the file
    /// sizes and the first and last 64 KiB of each file (cheap, and changes with any re-export).
    pub fn model_id(&self) -> Result<String> {
        use std::io::{Read, Seek, SeekFrom};
        if let Weights::Stored(store) = &self.weights {
            return Ok(store.manifest.model_id.clone());
        }
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        h.update(serde_json::to_string(&self.spec)?.as_bytes());
        let mut files: Vec<PathBuf> = if self.path.is_dir() {
            std::fs::read_dir(&self.path)
                .with_context(|| format!("cannot list {}", self.path.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.is_file())
                .collect()
        } else {
            vec![self.path.clone()]
        };
        files.sort();
        for f in files {
            let mut file =
                std::fs::File::open(&f).with_context(|| format!("cannot open {}", f.display()))?;
            let len = file.metadata()?.len();
            h.update(&len.to_le_bytes());
            let mut buf = vec![0u8; 65536.min(len as usize)];
            file.read_exact(&mut buf)?;
            h.update(&buf);
            file.seek(SeekFrom::End(-(buf.len() as i64)))?;
            file.read_exact(&mut buf)?;
            h.update(&buf);
        }
        Ok(format!("{:016x}", h.digest()))
    }

    /// Place the model on its device for `job`.
    pub fn start(&self, args: &ModelArgs, job: Job) -> Result<Running> {
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
        if args.cuda_graphs && self.device == Device::Cpu {
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
        let pace = |b: &dyn Fn(f64) -> crate::backend::Result<()>| -> Result<()> {
            if let Some(p) = &emulate {
                b(p.h2d_pinned_bytes_per_s)?;
            }
            Ok(())
        };
        let mut units = None;
        let (engine, ledger, plan, traffic, hybrid) = match (&self.weights, self.device) {
            (Weights::Dense(w), Device::Cuda) => {
                let ledger = Ledger::new(None, None);
                let cuda = CudaBackend::new(0, ledger.clone())?;
                cuda.set_programmatic_launch(args.programmatic_launch)?;
                tracing::info!("{}", cuda.name());
                let e = Engine::new(cuda, self.spec.clone(), w)?
                    .with_kv_type(kv_type)?
                    .with_sparsity(thresholds.clone())?
                    .with_predictor(predictor.clone());
                let e = pooled(e, &job, None)?
                    .with_logit_rows(job.logit_rows)
                    .with_recorded_steps(args.cuda_graphs);
                let room = whole_gpu_step_room(&e, &job)?;
                let e = whole_model_prefill(e, &job, args.budget.max_step(), room)?;
                (
                    AnyEngine::Cuda(e),
                    Some(ledger),
                    None,
                    Some(DecodeTraffic::of(&self.spec, w, kv_type)),
                    None,
                )
            }
            (Weights::Dense(w), _) => {
                let cpu = CpuBackend::with_kernels(threads, kernels)?;
                let e = Engine::new(cpu, self.spec.clone(), w)?
                    .with_kv_type(kv_type)?
                    .with_sparsity(thresholds.clone())?
                    .with_predictor(predictor.clone());
                let e = pooled(e, &job, None)?
                    .with_logit_rows(job.logit_rows)
                    .with_recorded_steps(args.cuda_graphs);
                let e = whole_model_prefill(e, &job, args.budget.max_step(), HOST_STEP_BYTES)?;
                (
                    AnyEngine::Cpu(e),
                    None,
                    None,
                    Some(DecodeTraffic::of(&self.spec, w, kv_type)),
                    None,
                )
            }
            (Weights::Stored(store), device) => {
                let mut budget = budget_for(args, job, gpu_mem.unwrap_or(u64::MAX / 4), device);
                if device == Device::Cuda {
                    let mut hw = args.budget.hardware_profile("gpu-4g")?;
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
                    pace(&|r| cuda.pace_copies(r))?;
                    let (plan, neurons) = self.offload_plan(args, store, &budget, &hw)?;
                    let OffloadSource {
                        src,
                        hybrid,
                        units: u,
                    } = self.offload_source(&cuda, store, &plan, neurons, &ledger, kernels)?;
                    units = u;
                    let e = Engine::with_source(cuda, self.spec.clone(), src)?
                        .with_kv_type(kv_type)?
                        .with_sparsity(thresholds.clone())?
                        .with_predictor(predictor.clone())
                        .with_prefill(plan.prefill)?;
                    let e = pooled(e, &job, &plan)?
                        .with_logit_rows(plan.budget.logit_rows)
                        .with_recorded_steps(args.cuda_graphs);
                    (AnyEngine::Cuda(e), Some(ledger), Some(plan), None, hybrid)
                } else {
                    let hw = args.budget.hardware_profile("cpu-sim")?;
                    let (plan, neurons) = self.offload_plan(args, store, &budget, &hw)?;
                    let ledger =
                        Ledger::new(gpu_mem.map(|_| plan.ledger_budget()), args.budget.dram_mem);
                    let sim = SimBackend::new(
                        CpuBackend::with_kernels(threads, kernels)?,
                        ledger.clone(),
                    );
                    pace(&|r| sim.pace_copies(r))?;
                    let OffloadSource {
                        src,
                        hybrid,
                        units: u,
                    } = self.offload_source(&sim, store, &plan, neurons, &ledger, kernels)?;
                    units = u;
                    let e = Engine::with_source(sim, self.spec.clone(), src)?
                        .with_kv_type(kv_type)?
                        .with_sparsity(thresholds.clone())?
                        .with_predictor(predictor.clone())
                        .with_prefill(plan.prefill)?;
                    let e = pooled(e, &job, &plan)?
                        .with_logit_rows(plan.budget.logit_rows)
                        .with_recorded_steps(args.cuda_graphs);
                    (AnyEngine::Sim(e), Some(ledger), Some(plan), None, hybrid)
                }
            }
        };
        let running = Running {
            engine,
            load_s: self.t0.elapsed().as_secs_f64(),
            ledger,
            plan,
            hybrid,
            units,
            traffic,
            emulated: emulate,
            process_peak: std::sync::atomic::AtomicU64::new(0),
        };
        running.sample_process();
        Ok(running)
    }

    /// The plan of an offloaded run for `--cold` (see [`crate::plan::choice::plan_cold`]): the
    /// sparsity profile is read where hybrid execution needs it or `auto` may choose it.
    fn offload_plan(
        &self,
        args: &ModelArgs,
        store: &Store,
        budget: &crate::plan::Budget,
        hw: &HardwareProfile,
    ) -> Result<(Plan, NeuronPlan)> {
        use crate::plan::choice::{Cold, plan_cold};
        let cold = args.budget.cold;
        let name = self.path.display().to_string();
        let load = || SparsityProfile::load(store.dir(), &store.manifest.model_id, &name);
        let profile =
            match cold {
                Cold::Cpu => Some(
                    load().context("--cold cpu places the hot neurons by how often they fire")?,
                ),
                Cold::Gpu => Some(load().context(
                    "--cold gpu sizes and keeps its cache units by how often neurons fire",
                )?),
                // Sparse modes only where neurons are skipped: the plan's predictions for them
                // assume the profile's sparsity.
                Cold::Auto
                    if args.sparsity != super::SparsityMode::Off
                        && SparsityProfile::path_in(store.dir()).exists() =>
                {
                    Some(load()?)
                }
                _ => None,
            };
        let target = match (
            args.sparsity,
            profile.as_ref().and_then(|p| p.predictor_target),
        ) {
            (super::SparsityMode::Predicted, Some(t)) => t,
            _ => args.sparsity_target.unwrap_or(DEFAULT_SPARSITY_TARGET),
        };
        let crate::plan::choice::ColdChoice {
            plan,
            hot,
            units,
            candidates: seen,
        } = plan_cold(
            &store.manifest,
            budget,
            hw,
            cold,
            profile.as_ref().map(|p| (p, target)),
            &args.budget.precisions(store, target)?,
        )?;
        if seen.len() > 1 {
            tracing::info!("--cold auto, predicted tokens/s: {seen:?}");
        }
        note_plan(&plan);
        if let Some(h) = &hot {
            tracing::info!("hybrid plan:\n{}", h.report());
        }
        if let Some(u) = &units {
            tracing::info!("cache units:\n{}", u.report());
        }
        let neurons = match (hot, units) {
            (Some(h), _) => NeuronPlan::Hybrid(h),
            (_, Some(u)) => NeuronPlan::Units(u),
            _ => NeuronPlan::Stream,
        };
        Ok((plan, neurons))
    }

    /// The weight source of an offloaded run: streaming (the plan may split the FFN with the
    /// CPU), hybrid (a hot-neuron plan: hot neurons on the device, cold ones on the CPU) or
    /// cache units (every active neuron on the device, copied in as the units lack them).
    fn offload_source<B: Backend>(
        &self,
        b: &B,
        store: &Arc<Store>,
        plan: &Plan,
        neurons: NeuronPlan,
        ledger: &Arc<Ledger>,
        kernels: &'static kernels::Kernels,
    ) -> Result<OffloadSource<B>> {
        let act = crate::engine::backend_act(self.spec.activation);
        let hot = match neurons {
            NeuronPlan::Stream => {
                let src = StreamWeights::with_cpu_kernels(
                    b,
                    store.clone(),
                    plan,
                    ledger.clone(),
                    kernels,
                    None,
                )?;
                return Ok(OffloadSource {
                    src: Box::new(src),
                    hybrid: None,
                    units: None,
                });
            }
            NeuronPlan::Units(u) => {
                let src = crate::tier::units::UnitWeights::new(
                    b,
                    store.clone(),
                    plan,
                    &u.slots(),
                    u.precision,
                    Some(&u.scores),
                    u.hybrid.as_ref(),
                    ledger.clone(),
                    kernels,
                    act,
                )?;
                let traffic = src.traffic();
                return Ok(OffloadSource {
                    src: Box::new(src),
                    hybrid: None,
                    units: Some(Units { plan: u, traffic }),
                });
            }
            NeuronPlan::Hybrid(h) => h,
        };
        let (src, traffic): (Box<dyn WeightSource<B>>, _) = if hot.base_plan.is_some() {
            // Attention streamed beside the hot neurons: the streaming source runs it.
            let src = StreamWeights::with_cpu_kernels(
                b,
                store.clone(),
                plan,
                ledger.clone(),
                kernels,
                Some(&hot),
            )?;
            let traffic = src
                .cpu_traffic()
                .ok_or_else(|| anyhow::anyhow!("a hybrid plan without CPU neurons"))?;
            (Box::new(src), traffic)
        } else {
            let src =
                HybridWeights::new(b, store.clone(), plan, &hot, ledger.clone(), kernels, act)?;
            let traffic = src.traffic();
            (Box::new(src), traffic)
        };
        Ok(OffloadSource {
            src,
            hybrid: Some(Hybrid { plan: hot, traffic }),
            units: None,
        })
    }

    /// What `--sparsity` asks for: per layer, the FFN thresholds (empty when off) — zeros for a
    /// ReLU-family model without --sparsity-target (its exact natural mask), else read from the
    /// profile in the model's store at the target — and, for `predicted`, the profile's
    /// predictors.
    pub fn sparsity(&self, args: &ModelArgs) -> Result<(Vec<f32>, Option<SharedPredictor>)> {
        use super::SparsityMode;
        if args.sparsity == SparsityMode::Off {
            return Ok((Vec::new(), None));
        }
        let relu = matches!(self.spec.activation, crate::model::Activation::Relu);
        if args.sparsity == SparsityMode::Oracle && relu && args.sparsity_target.is_none() {
            return Ok((vec![0.0; self.spec.n_layers], None));
        }
        let name = self.path.display().to_string();
        let profile = match &self.weights {
            Weights::Stored(store) => {
                SparsityProfile::load(store.dir(), &store.manifest.model_id, &name)?
            }
            Weights::Dense(_) => {
                let store = super::store::open_store_for(&self.path)?;
                SparsityProfile::load(store.dir(), &store.manifest.model_id, &name)?
            }
        };
        if args.sparsity == SparsityMode::Predicted {
            let Some(trained) = profile.predictor_target else {
                bail!(
                    "the sparsity profile of {name} has no predictors: run `gpu-offload profile -m {name}` (without --no-predictors)"
                );
            };
            if let Some(t) = args.sparsity_target
                && (t - trained).abs() > 1e-9
            {
                bail!(
                    "--sparsity-target {t}: the predictors of {name} were trained for {trained}; run `gpu-offload profile -m {name} --predictor-target {t}`"
                );
            }
            tracing::info!(
                "FFN sparsity {:.0}% (predicted): {} predictors",
                trained * 100.0,
                profile.predictors.len()
            );
            let p: Arc<dyn NeuronPredictor> = Arc::new(Predictors(profile.predictors));
            return Ok((Vec::new(), Some(p)));
        }
        let target = args.sparsity_target.unwrap_or(DEFAULT_SPARSITY_TARGET);
        let t = profile.thresholds_for(target)?;
        tracing::info!(
            "FFN sparsity {:.0}% (oracle): thresholds {:.4}…{:.4}",
            target * 100.0,
            t.iter().copied().fold(f32::INFINITY, f32::min),
            t.iter().copied().fold(0.0, f32::max)
        );
        Ok((t, None))
    }

    pub fn tokenizer(&self) -> Result<&Tokenizer> {
        self.tokenizer.as_ref().with_context(|| {
            format!(
                "{} has no tokenizer: pass token ids with --tokens",
                self.path.display()
            )
        })
    }

    /// Token ids for the prompt flags. `chat` wraps the text as one user message (after an
    /// optional system message) with the model's chat template.
    pub fn prompt_ids(&self, p: &PromptArgs, chat: Option<Option<&str>>) -> Result<Vec<u32>> {
        if let Some(ids) = &p.tokens {
            if chat.is_some() {
                bail!("--chat needs a text prompt, not --tokens");
            }
            return Ok(ids.clone());
        }
        let text = match (&p.prompt, &p.prompt_file) {
            (Some(t), _) => t.clone(),
            (None, Some(f)) => std::fs::read_to_string(f)
                .with_context(|| format!("cannot read prompt file {}", f.display()))?,
            (None, None) => bail!("give a prompt with --prompt, --prompt-file or --tokens"),
        };
        let tok = self.tokenizer()?;
        let text = match chat {
            None => text,
            Some(system) => {
                let mut messages = Vec::new();
                if let Some(s) = system {
                    messages.push(ChatMessage {
                        role: "system".into(),
                        content: s.to_string(),
                    });
                }
                messages.push(ChatMessage {
                    role: "user".into(),
                    content: text,
                });
                tok.apply_chat_template(&messages, true)?
            }
        };
        // Chat templates already contain the BOS text when the model wants one.
        let add_special = chat.is_none();
        Ok(tok.encode(&text, add_special, true)?)
    }

    /// The context size for a job that needs `needed` positions: `--ctx-size` when given
    /// (which must hold them), else exactly what is needed, never beyond the model's maximum.
    pub fn context_for(&self, args: &ModelArgs, needed: usize) -> Result<usize> {
        let max = self.spec.max_context;
        let ctx = match args.ctx_size {
            Some(c) => {
                let c = c as usize;
                if c > max {
                    bail!("--ctx-size {c} exceeds the model's maximum context of {max} tokens");
                }
                c
            }
            None => needed.min(max),
        };
        Ok(ctx.max(1))
    }
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

    fn sample_process(&self) {
        if let Some(b) = self.process_bytes() {
            self.process_peak
                .fetch_max(b, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// The most device memory the process was seen to hold (driver figures; CUDA only).
    pub fn process_peak_bytes(&self) -> Option<u64> {
        match self.process_peak.load(std::sync::atomic::Ordering::Relaxed) {
            0 => None,
            b => Some(b),
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
            "dram_peak_bytes": end.dram_total_peak,
            "h2d_bytes_per_token": per(after_prefill.h2d_bytes, end.h2d_bytes),
            "ssd_bytes_per_token": per(after_prefill.ssd_read_bytes, end.ssd_read_bytes),
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
                "predicted_tokens_per_s": plan.prediction.tokens_per_s,
            });
        }
        v
    }
}
