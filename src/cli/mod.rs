//! The command-line edge: one file per subcommand parses its flags, calls the library and prints.
//! Every flag can also come from a `GPU_OFFLOAD_*` environment variable.

mod bench;
mod convert;
mod doctor;
pub(crate) mod load;
mod logits;
mod perplexity;
mod plan;
mod precision;
mod prefill;
mod profile;
mod run;
mod serve;
mod store;
mod synth;
mod units;

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

pub use load::LoadedModel;

#[derive(Debug, Parser)]
#[command(
    name = "gpu-offload",
    version,
    about = "Run language models larger than GPU memory: HBM/DRAM/SSD offloading, sparse FFNs, persistent contexts.",
    long_about = None
)]
pub struct Cli {
    /// Log filter (error, warn, info, debug, trace, or a tracing directive).
    #[arg(long, global = true, env = "GPU_OFFLOAD_LOG", default_value = "warn")]
    pub log: String,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Generate text from a prompt (streams to stdout).
    Run(run::RunArgs),
    /// Print the logits the model gives for a prompt or token ids.
    Logits(logits::LogitsArgs),
    /// Perplexity of the model over a text file.
    Perplexity(perplexity::PerplexityArgs),
    /// Probe this machine (devices, memory bandwidth) for the planner and the benchmarks.
    Doctor(doctor::DoctorArgs),
    /// Convert a GGUF file or HF directory into an offload store (or verify one).
    Convert(convert::ConvertArgs),
    /// Write a deterministic synthetic model of any shape (HF format).
    Synth(synth::SynthArgs),
    /// Decide where every byte lives for a budget; print the plan and its predicted speed.
    Plan(plan::PlanArgs),
    /// Measure speed beside its physical bound (matvec, decode).
    Bench(bench::BenchArgs),
    /// Serve an OpenAI-compatible HTTP API with persistent contexts.
    Serve(serve::ServeArgs),
    /// Batch job: prefill (and optionally continue) every prompt of a JSONL file or a directory,
    /// one JSON line each; resumable, and can save each prompt as a context `serve` continues.
    Prefill(prefill::PrefillArgs),
    /// Measure a model's FFN activation sparsity on a corpus (thresholds per target sparsity,
    /// activation frequency per neuron) and save it in the model's store.
    Profile(profile::ProfileArgs),
}

/// Where the math runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Device {
    /// A GPU when one is present; else the budgeted CPU device when --gpu-mem is given, else
    /// the CPU.
    Auto,
    /// The CPU backend: every weight used in place, in its file format.
    Cpu,
    /// The budgeted device: the CPU standing in for a GPU of --gpu-mem, weights offloaded from
    /// the store through DRAM and SSD exactly as on a GPU, every byte counted.
    Sim,
    /// An NVIDIA GPU (CUDA).
    Cuda,
}

/// Flags shared by every command that loads a model.
#[derive(Debug, Args)]
pub struct ModelArgs {
    /// GGUF file or Hugging Face model directory [default: the model scripts/fetch-models.sh
    /// downloads, SmolLM2-135M-Instruct Q4_1, in $GPU_OFFLOAD_MODELS or ~/.cache/gpu-offload/models]
    #[arg(long, short = 'm', env = "GPU_OFFLOAD_MODEL")]
    pub model: Option<PathBuf>,

    /// Worker threads for the CPU backend [default: one per core]
    #[arg(long, short = 't', env = "GPU_OFFLOAD_THREADS", value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub threads: Option<u16>,

    /// Device to run on.
    #[arg(long, env = "GPU_OFFLOAD_DEVICE", value_enum, default_value = "auto")]
    pub device: Device,

    /// CPU kernel set: avx512vnni, avx2 or portable [default: the best this CPU runs]
    #[arg(long, env = "GPU_OFFLOAD_KERNELS")]
    pub cpu_kernels: Option<String>,

    #[command(flatten)]
    pub budget: plan::BudgetArgs,

    /// Context size in tokens [default: what the job needs, at most the model's maximum]
    #[arg(long, env = "GPU_OFFLOAD_CTX_SIZE", value_parser = clap::value_parser!(u32).range(1..))]
    pub ctx_size: Option<u32>,

    /// KV cache element type: f16, f32 or q8_0 [default: f16 on a device (cuda, sim), f32 on
    /// the CPU]
    #[arg(long, env = "GPU_OFFLOAD_KV_TYPE", value_enum)]
    pub kv_type: Option<KvTypeArg>,

    /// FFN activation sparsity: off (every neuron computed); oracle (each token's exact mask:
    /// neurons whose activation magnitude is at most the layer's threshold for
    /// --sparsity-target contribute nothing; SwiGLU models need `gpu-offload profile` first);
    /// predicted (the profile's per-layer predictors choose the neurons from the layer's input).
    #[arg(long, env = "GPU_OFFLOAD_SPARSITY", value_enum, default_value = "off")]
    pub sparsity: SparsityMode,

    /// Share of FFN neurons to skip, 0.01–0.99 [default: 0 for ReLU models (their natural
    /// sparsity, exact), else 0.15, what SmolLM2-135M tolerates within 1% perplexity]
    #[arg(long, env = "GPU_OFFLOAD_SPARSITY_TARGET")]
    pub sparsity_target: Option<f64>,

    /// Record each sequence's one-token decode step as a CUDA graph once and replay it (one
    /// launch a token instead of one a kernel). Steps with weights resident on the device only;
    /// others run as before. On the budgeted device (`--device sim`) the steps are recorded as
    /// CUDA would and every replay is checked against its recording.
    #[arg(long, env = "GPU_OFFLOAD_CUDA_GRAPHS")]
    pub cuda_graphs: bool,

    /// Launch each CUDA kernel with programmatic stream serialization (programmatic dependent
    /// launch): its blocks are scheduled while the kernel before it finishes and wait for its
    /// results, so launches overlap (recorded steps too). Whole-GPU runs (no --gpu-mem) on
    /// compute capability 9.0 (Hopper) with kernels built for it (`CUDA_COMPUTE_CAP=90` at build
    /// time, or NVRTC); refused elsewhere.
    #[arg(long, env = "GPU_OFFLOAD_PROGRAMMATIC_LAUNCH")]
    pub programmatic_launch: bool,
}

/// `--sparsity`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum SparsityMode {
    Off,
    Oracle,
    /// The profile's predictors pick each token's neurons from the layer's input.
    Predicted,
}

/// `--kv-type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum KvTypeArg {
    /// Half the bytes of f32; on CUDA (Ampere and newer) a prompt's attention runs on tensor cores
    F16,
    /// Full precision, also in a CUDA prompt's attention (CUDA cores: slower for long prompts)
    F32,
    /// 8-bit blocks as llama.cpp quantizes them (~0.27 of f32's bytes); on CUDA (Ampere and
    /// newer) a prompt's attention runs on tensor cores
    #[value(name = "q8_0")]
    Q8_0,
}

impl KvTypeArg {
    pub fn kv_type(self) -> crate::backend::KvType {
        match self {
            KvTypeArg::F16 => crate::backend::KvType::F16,
            KvTypeArg::F32 => crate::backend::KvType::F32,
            KvTypeArg::Q8_0 => crate::backend::KvType::Q8_0,
        }
    }
}

/// Where the input tokens come from.
#[derive(Debug, Args)]
#[group(required = true, multiple = false)]
pub struct PromptArgs {
    /// Prompt text.
    #[arg(long, short = 'p', env = "GPU_OFFLOAD_PROMPT")]
    pub prompt: Option<String>,

    /// Read the prompt from a file.
    #[arg(long, env = "GPU_OFFLOAD_PROMPT_FILE")]
    pub prompt_file: Option<PathBuf>,

    /// Token ids, comma-separated (for models without a tokenizer), e.g. 1,15043,3186.
    #[arg(long, env = "GPU_OFFLOAD_TOKENS", value_delimiter = ',', num_args = 1..)]
    pub tokens: Option<Vec<u32>>,
}

pub fn dispatch(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Run(a) => run::run(a),
        Command::Logits(a) => logits::run(a),
        Command::Perplexity(a) => perplexity::run(a),
        Command::Doctor(a) => doctor::run(a),
        Command::Convert(a) => convert::run(a),
        Command::Synth(a) => synth::run(a),
        Command::Plan(a) => plan::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Serve(a) => serve::run(a),
        Command::Prefill(a) => prefill::run(a),
        Command::Profile(a) => profile::run(a),
    }
}
