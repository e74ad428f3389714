//! `bench suite` end to end: the flags checked, the model found (or synthesized for
//! `--preset`), the rates its bounds divide by (measured, or a profile's), the budget axis
//! between the plan's minimum and the whole model, every cell and the peers run, and the report
//! written (suite.json, suite.md, the plots). What it prints is the CLI's.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};

use super::axes::{self, BudgetChoice, BudgetPoint};
use super::cells::LoaderCells;
use super::matrix::{self, Matrix};
use super::peers::{LlamaBench, PeerHf, PeerJob, PeerReport, PeerStatus};
use super::report::{Cell, DeviceInfo, Emulation, ModelInfo, SCHEMA, Settings, SuiteReport};
use crate::backend::cuda::CudaBackend;
use crate::bench::bounds::{self, Rates};
use crate::bench::output::{unix_now, writable_dir};
use crate::bench::plot;
use crate::bench::running::threads_of;
use crate::footprint::Ledger;
use crate::plan::{HardwareProfile, PlanError, make_plan};
use crate::runtime::parse_bytes;
use crate::runtime::rates::RatesDevice;
use crate::runtime::store::open_store_for;
use crate::runtime::{Device, Job, ModelArgs};
use crate::store::Manifest;

/// `--budgets`: sizes and the words `whole` and `min`.
#[derive(Clone, Debug)]
pub struct BudgetList(pub Vec<BudgetChoice>);

fn parse_budgets(s: &str) -> std::result::Result<BudgetList, String> {
    axes::parse_budget_list(s, parse_bytes).map(BudgetList)
}

/// `--prompts`: prompt lengths in tokens.
#[derive(Clone, Debug)]
pub struct PromptList(pub Vec<usize>);

fn parse_prompts(s: &str) -> std::result::Result<PromptList, String> {
    axes::parse_prompt_list(s).map(PromptList)
}

#[derive(Debug, Args)]
pub struct SuiteArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Benchmark a synthesized model of this shape instead of -m (tiny, 1b, 7b, 13b), written
    /// once into the cache.
    #[arg(long, env = "GPU_OFFLOAD_PRESET")]
    pub preset: Option<String>,
    /// Directory for suite.json, suite.md and the plots (created if missing).
    #[arg(long, short = 'o', env = "GPU_OFFLOAD_OUT")]
    pub out: PathBuf,
    /// --gpu-mem budgets: sizes and the words `whole` (no budget) and `min` (the smallest the
    /// plan accepts) [default: whole, 24G, 12G, 8G, 4G, min — those between min and whole]
    #[arg(long, env = "GPU_OFFLOAD_BUDGETS", value_parser = parse_budgets)]
    pub budgets: Option<BudgetList>,
    /// Prompt lengths for TTFT (those within the model's context are run).
    #[arg(long, env = "GPU_OFFLOAD_PROMPTS", value_parser = parse_prompts, default_value = "128,2048,8192")]
    pub prompts: PromptList,
    /// Prompt tokens before the decode measurement.
    #[arg(long, env = "GPU_OFFLOAD_DECODE_PROMPT", default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..))]
    pub decode_prompt: u32,
    /// Tokens to decode per budget.
    #[arg(long = "tokens", short = 'n', env = "GPU_OFFLOAD_TOKENS", default_value_t = 64, value_parser = clap::value_parser!(u32).range(2..))]
    pub tokens: u32,
    /// Measured repetitions per cell after a warm-up (the median is reported).
    #[arg(long, env = "GPU_OFFLOAD_REPS", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub reps: u32,
    /// llama.cpp's llama-bench binary, run beside ours (needs the model as GGUF).
    #[arg(long, env = "GPU_OFFLOAD_LLAMA_BENCH")]
    pub llama_bench: Option<PathBuf>,
    /// The model as GGUF for llama-bench [default: -m when it is a GGUF file]
    #[arg(long, env = "GPU_OFFLOAD_PEER_GGUF")]
    pub peer_gguf: Option<PathBuf>,
    /// A python with torch + transformers + accelerate: runs scripts/peer_hf.py beside ours
    /// (needs the model as an HF directory).
    #[arg(long, env = "GPU_OFFLOAD_PEER_HF")]
    pub peer_hf: Option<PathBuf>,
    /// Seconds one peer run may take.
    #[arg(long, env = "GPU_OFFLOAD_PEER_TIMEOUT", default_value_t = 1800)]
    pub peer_timeout: u64,
}

/// The synthesized model of `--preset`, written into the cache on first use.
fn preset_model(name: &str) -> Result<PathBuf> {
    use crate::model::synth::{SynthSpec, synthesize};
    let Some(spec) = SynthSpec::preset(name) else {
        bail!("--preset {name}: unknown (tiny, 1b, 7b, 13b)");
    };
    let dir = crate::model::models_dir().join("synth").join(name);
    if dir.join("config.json").is_file() {
        return Ok(dir);
    }
    eprintln!(
        "synthesizing the {name} shape into {} (first use)",
        dir.display()
    );
    let pb = ProgressBar::new((spec.parameters() * 2) >> 20);
    pb.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} MiB")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    synthesize(&spec, &dir, true, &mut |done, _| {
        pb.set_position(done >> 20)
    })
    .with_context(|| format!("cannot write {}", dir.display()))?;
    pb.finish_and_clear();
    Ok(dir)
}

/// What `bench suite` wrote: the report, where, and how many plots beside it.
pub struct SuiteRun {
    pub report: SuiteReport,
    pub out: PathBuf,
    pub plots: usize,
}

impl SuiteRun {
    /// An error naming every problem (a cell that failed or beat its bound) when there is one:
    /// the suite then exits non-zero, with its report written.
    pub fn check_problems(&self) -> Result<()> {
        let (report, a_out) = (&self.report, &self.out);
        if !report.problems.is_empty() {
            bail!(
                "{} problem(s); the report is in {}:\n  {}",
                report.problems.len(),
                a_out.display(),
                report.problems.join("\n  ")
            );
        }
        Ok(())
    }
}

/// Run the suite of `a` and write its report into `--out`.
pub fn run(mut a: SuiteArgs) -> Result<SuiteRun> {
    // Flags first: nothing heavy runs before bad input is refused.
    let device = suite_device(&a.model)?;
    a.model.device = device;
    let emulated = emulated_card(a.model.budget.emulate.as_deref())?;
    let explicit_hw = match &a.model.budget.hardware {
        Some(h) => Some(HardwareProfile::load(h).map_err(|e| anyhow::anyhow!("--hardware {e}"))?),
        None => None,
    };
    writable_dir(&a.out)?;
    let (model_path, source) = model_and_source(&a)?;
    a.model.model = Some(model_path.clone());
    let store = open_store_for(&model_path)?;
    let manifest = &store.manifest;
    let spec = manifest.spec.clone();

    // The job sizes and prompt lengths the model can hold.
    let n = a.tokens as usize;
    let decode_prompt = a.decode_prompt as usize;
    if decode_prompt + n > spec.max_context {
        bail!(
            "--decode-prompt {decode_prompt} plus -n {n} exceed {}'s maximum context of {} tokens",
            spec.name,
            spec.max_context
        );
    }
    let mut notes = Vec::new();
    let prompts: Vec<usize> = a
        .prompts
        .0
        .iter()
        .copied()
        .filter(|&p| p < spec.max_context)
        .collect();
    if prompts.len() < a.prompts.0.len() {
        notes.push(format!(
            "prompt lengths at or beyond the model's maximum context of {} were left out",
            spec.max_context
        ));
    }

    // Rates for the bounds, and the planner's profile.
    let device_word = if device == Device::Cuda {
        "cuda"
    } else {
        "sim"
    };
    let threads = threads_of(&a.model);
    let MachineRates { rates, real_device } =
        machine_rates(&mut a, device, explicit_hw.as_ref(), store.dir(), threads)?;
    // Emulating a card: its memory, fixed cost and PCIe pace; this machine's other rates (the
    // planner's profile does the same through `--emulate`).
    let rates = match &emulated {
        Some(card) => rates.emulating(card),
        None => rates,
    };
    let planner = match device {
        Device::Cuda => a
            .model
            .budget
            .hardware_profile(RatesDevice::Cuda, "gpu-4g", threads)?,
        _ => a
            .model
            .budget
            .hardware_profile(RatesDevice::Sim, "cpu-sim", threads)?,
    };

    let axis = budget_axis(
        &a,
        manifest,
        &planner,
        device,
        decode_prompt,
        n,
        emulated.as_ref(),
    )?;
    let (whole_need, minimum, budgets) = (axis.whole_need, axis.minimum, axis.budgets);
    notes.extend(axis.notes);
    if budgets.is_empty() {
        bail!(
            "no --gpu-mem budget left to run (the budget list, after dropping those above the emulated card)"
        );
    }

    let matrix = Matrix {
        budgets: budgets.clone(),
        prompts: prompts.clone(),
        decode_prompt_tokens: decode_prompt,
        decode_tokens: n,
    };
    let reps = a.reps as usize;
    let ran = run_cells_and_peers(&mut a, manifest, &planner, &matrix, &rates, &model_path);
    let (decode, prefill, problems, llama, hf) =
        (ran.decode, ran.prefill, ran.problems, ran.llama, ran.hf);

    notes.extend(closing_notes(emulated.as_ref(), &real_device, llama.ran()));
    let report = SuiteReport {
        schema: SCHEMA,
        gpu_offload_version: env!("CARGO_PKG_VERSION"),
        created_unix_s: unix_now(),
        model: ModelInfo {
            name: spec.name.clone(),
            path: model_path.display().to_string(),
            source,
            n_layers: spec.n_layers,
            d_model: spec.d_model,
            vocab_size: spec.vocab_size,
            max_context: spec.max_context,
            whole_gpu_bytes: whole_need,
            min_gpu_bytes: minimum,
        },
        device: DeviceInfo {
            kind: device_word.into(),
            name: real_device.clone(),
            emulated: emulated.as_ref().map(|p| Emulation {
                preset: p.name.clone(),
                device_bytes: p.device_bytes,
                h2d_bytes_per_s: p.h2d_pinned_bytes_per_s,
                on: real_device.clone(),
            }),
        },
        rates,
        settings: Settings {
            prompts,
            decode_prompt_tokens: decode_prompt,
            decode_tokens: n,
            reps,
            planner_profile: planner.name.clone(),
        },
        budgets,
        decode,
        prefill,
        peers: vec![llama, hf],
        problems,
        notes,
    };
    let plots = write_report(&report, &a.out)?;
    Ok(SuiteRun {
        report,
        out: a.out,
        plots,
    })
}

/// The device the suite runs offloaded on: `--device cuda` or `sim` (`auto`: CUDA where there
/// is a device, else sim); refuses the flags the suite sets itself.
fn suite_device(model: &ModelArgs) -> Result<Device> {
    if model.budget.gpu_mem.is_some() {
        bail!(
            "bench suite sweeps --gpu-mem itself: give the budgets with --budgets (e.g. --budgets whole,8G,4G,min)"
        );
    }
    if model.ctx_size.is_some() {
        bail!("bench suite sizes the context of each cell to its job: drop --ctx-size");
    }
    let device = match model.device {
        Device::Cpu => {
            bail!("bench suite runs offloaded: use --device sim (the budgeted CPU device) or cuda")
        }
        Device::Auto if crate::backend::cuda::device_available() => Device::Cuda,
        Device::Auto => Device::Sim,
        d => d,
    };
    Ok(device)
}

/// `--emulate`'s card: a profile that states the device memory to emulate.
fn emulated_card(emulate: Option<&str>) -> Result<Option<HardwareProfile>> {
    let emulated = match emulate {
        None => None,
        Some(name) => {
            let p = HardwareProfile::load(name).map_err(|e| anyhow::anyhow!("--emulate {e}"))?;
            if p.device_bytes == 0 {
                bail!(
                    "--emulate {name}: the profile states no device memory (device_bytes) to emulate"
                );
            }
            Some(p)
        }
    };
    Ok(emulated)
}

/// The model to run and where it comes from: `-m`, the `--preset` (synthesized once), or the
/// default model.
fn model_and_source(a: &SuiteArgs) -> Result<(PathBuf, String)> {
    let (model_path, source) = match (&a.model.model, &a.preset) {
        (Some(_), Some(_)) => bail!(
            "give -m MODEL or --preset NAME, not both (check GPU_OFFLOAD_MODEL / GPU_OFFLOAD_PRESET)"
        ),
        (None, Some(p)) => (preset_model(p)?, format!("preset {p} (synthesized)")),
        (Some(m), None) => (m.clone(), "file".to_string()),
        (None, None) => {
            let p = crate::model::default_model_path();
            if !p.exists() {
                bail!(
                    "no model given and the default model is not at {}: pass -m MODEL or --preset NAME",
                    p.display()
                );
            }
            (p, "file (the default model)".to_string())
        }
    };
    Ok((model_path, source))
}

/// The rates the bounds divide by, and what really ran (the GPU's name, or the CPU standing in
/// for one).
struct MachineRates {
    rates: Rates,
    real_device: String,
}

/// `--hardware`'s rates, or this machine's measured now (then saved as hardware-measured.json
/// in `--out` and given to the planner as `--hardware`).
fn machine_rates(
    a: &mut SuiteArgs,
    device: Device,
    explicit_hw: Option<&HardwareProfile>,
    ssd_dir: &Path,
    threads: usize,
) -> Result<MachineRates> {
    let mut real_device = match device {
        Device::Cuda => String::from("CUDA device 0"),
        _ => format!(
            "the budgeted CPU device (sim) on {}",
            crate::runtime::probe::cpu_model()
        ),
    };
    let rates = match explicit_hw {
        Some(p) => {
            if device == Device::Cuda
                && let Ok(be) = CudaBackend::new(0, Ledger::new(None, None))
                && let Ok(info) = be.info()
            {
                real_device = info.name;
            }
            Rates::from_profile(p)
        }
        None => {
            let ssd = ssd_dir.to_path_buf();
            eprintln!("measuring this machine's rates for the bounds…");
            let (rates, base) = if device == Device::Cuda {
                let (r, g) =
                    bounds::measure_gpu(threads, Some(&ssd)).map_err(anyhow::Error::msg)?;
                real_device = g.name.clone();
                let mut base = HardwareProfile::saved_or("gpu-4g").map_err(anyhow::Error::msg)?;
                base.device_bytes = g.total_bytes;
                base.device_fixed_bytes = g.fixed_bytes.or(base.device_fixed_bytes);
                (r, base)
            } else {
                let base = HardwareProfile::load("cpu-sim").map_err(anyhow::Error::msg)?;
                (bounds::measure_sim(threads, Some(&ssd), None), base)
            };
            let profile = rates.into_profile(&base, "measured");
            let path = a.out.join("hardware-measured.json");
            crate::fsutil::write_atomic(&path, serde_json::to_string_pretty(&profile)?.as_bytes())
                .with_context(|| format!("cannot write {}", path.display()))?;
            a.model.budget.hardware = Some(path.to_string_lossy().into_owned());
            rates
        }
    };
    Ok(MachineRates { rates, real_device })
}

/// The `--gpu-mem` axis: what the whole model needs for the decode job, the least the plan
/// accepts, the budgets to run between them and notes on those dropped.
struct BudgetAxis {
    whole_need: u64,
    minimum: u64,
    budgets: Vec<BudgetPoint>,
    notes: Vec<String>,
}

fn budget_axis(
    a: &SuiteArgs,
    manifest: &Manifest,
    planner: &HardwareProfile,
    device: Device,
    decode_prompt: usize,
    n: usize,
    emulated: Option<&HardwareProfile>,
) -> Result<BudgetAxis> {
    // The budget axis: what the whole model needs and the least the plan accepts.
    let decode_budget = |gpu_mem| {
        crate::runtime::budget_for(
            &a.model,
            Job::single(decode_prompt + n, decode_prompt, 1),
            gpu_mem,
            device,
        )
    };
    let whole_need = make_plan(manifest, &decode_budget(u64::MAX / 4), planner)
        .context("planning the whole model")?
        .gpu
        .total;
    let minimum = match make_plan(manifest, &decode_budget(0), planner) {
        Err(PlanError::GpuTooSmall { minimum, .. }) => minimum,
        Ok(p) => p.gpu.total,
        Err(e) => return Err(e).context("planning the smallest budget"),
    };
    let cap = emulated.map(|p| p.device_bytes);
    let (budgets, budget_notes) = axes::select_budgets(
        a.budgets.as_ref().map(|b| b.0.as_slice()),
        whole_need,
        minimum,
        cap,
    );
    Ok(BudgetAxis {
        whole_need,
        minimum,
        budgets,
        notes: budget_notes,
    })
}

/// What the matrix and the peers measured.
struct CellsAndPeers {
    decode: Vec<Cell>,
    prefill: Vec<Cell>,
    problems: Vec<String>,
    llama: PeerReport,
    hf: PeerReport,
}

/// Every cell of `matrix`, then the peers at the same budgets, under one progress bar.
fn run_cells_and_peers(
    a: &mut SuiteArgs,
    manifest: &Manifest,
    planner: &HardwareProfile,
    matrix: &Matrix,
    rates: &Rates,
    model_path: &Path,
) -> CellsAndPeers {
    let (budgets, prompts) = (&matrix.budgets, &matrix.prompts);
    let (decode_prompt, n) = (matrix.decode_prompt_tokens, matrix.decode_tokens);
    let peers_on = usize::from(a.llama_bench.is_some()) + usize::from(a.peer_hf.is_some());
    let pb = ProgressBar::new((matrix.cells() + peers_on * budgets.len()) as u64);
    pb.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut tick = |msg: &str| {
        pb.set_message(msg.to_string());
        pb.inc(1);
    };
    let reps = a.reps as usize;
    let (decode, prefill, problems) = {
        let mut cells = LoaderCells {
            args: &mut a.model,
            manifest,
            planner,
            reps,
        };
        matrix::run_matrix(matrix, rates, &mut cells, &mut tick)
    };

    // Peers, in the same run.
    let job = PeerJob {
        prompts: prompts.clone(),
        decode_prompt_tokens: decode_prompt,
        decode_tokens: n,
        reps,
        threads: a.model.threads.map(usize::from),
        fixed_device_bytes: planner.fixed_device_bytes(),
    };
    let timeout = Duration::from_secs(a.peer_timeout.max(1));
    let gguf = a.peer_gguf.clone().or_else(|| {
        (model_path.is_file()
            && model_path
                .extension()
                .is_some_and(|e| e.eq_ignore_ascii_case("gguf")))
        .then(|| model_path.to_path_buf())
    });
    let llama = LlamaBench {
        exe: a.llama_bench.clone(),
        gguf,
        timeout,
    }
    .run(&job, budgets, &mut tick);
    let hf = PeerHf {
        python: a.peer_hf.clone(),
        model_dir: model_path.is_dir().then(|| model_path.to_path_buf()),
        timeout,
    }
    .run(&job, budgets, &a.out, &mut tick);
    pb.finish_and_clear();
    // A peer that failed is reported beside ours; it is not a failure of this benchmark.
    for p in [&llama, &hf] {
        if p.status == PeerStatus::Failed {
            eprintln!(
                "warning: peer {} failed: {}",
                p.name,
                p.reason.as_deref().unwrap_or("")
            );
        }
    }
    CellsAndPeers {
        decode,
        prefill,
        problems,
        llama,
        hf,
    }
}

/// How to read the figures: the bounds, the tolerance, the emulation and llama.cpp's figures.
fn closing_notes(
    emulated: Option<&HardwareProfile>,
    real_device: &str,
    llama_ran: bool,
) -> Vec<String> {
    let mut notes: Vec<String> = Vec::new();
    notes.push("Decode bound: 1 / max over resources (device memory, PCIe, DRAM, SSD) of the bytes a token moves through it ÷ its rate. TTFT bound: bytes only (weights streamed and read once per pass), FLOPs are not in it.".into());
    notes.push(format!(
        "A figure above {:.0}% of its bound marks the bound wrong (status ABOVE BOUND) and makes the suite exit non-zero.",
        100.0 * bounds::TOLERANCE
    ));
    if let Some(p) = emulated {
        notes.push(format!(
            "Emulating {}: device memory is capped at {} (its fixed cost counted), host→device copies are paced to {:.1} GB/s; compute, device-memory, host-memory and SSD speeds are {}'s, and the bounds and predictions use them.",
            p.name,
            crate::plan::human_bytes(p.device_bytes),
            p.h2d_pinned_bytes_per_s / 1e9,
            real_device
        ));
    }
    if llama_ran {
        notes.push("llama.cpp: decode is llama-bench's tg test (from an empty context); TTFT is the prompt ÷ its pp tokens/s. At a budget, -ngl is the largest whose process fits (estimated from layer bytes; verified by polling the process's device memory where a driver answers).".into());
    }
    notes
}

/// suite.json, the plots and suite.md into `dir`, each written atomically: how many plots.
fn write_report(report: &SuiteReport, dir: &Path) -> Result<usize> {
    let write = |name: &str, bytes: &[u8]| {
        let p = dir.join(name);
        crate::fsutil::write_atomic(&p, bytes)
            .with_context(|| format!("cannot write {}", p.display()))
    };
    write(
        "suite.json",
        serde_json::to_string_pretty(report)?.as_bytes(),
    )?;
    let mut plots = Vec::new();
    for (file, title, svg) in [
        (
            "decode.svg",
            "decode tokens/s by --gpu-mem",
            plot::decode_svg(report),
        ),
        ("ttft.svg", "TTFT by prompt length", plot::ttft_svg(report)),
    ] {
        match svg {
            Ok(s) => {
                write(file, s.as_bytes())?;
                plots.push((file, title));
            }
            Err(e) => eprintln!("warning: {e}"),
        }
    }
    write("suite.md", report.markdown(&plots).as_bytes())?;
    Ok(plots.len())
}
