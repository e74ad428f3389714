//! The command-line edge: one file per subcommand parses its flags, calls the library and prints.
//! Every flag can also come from a `GPU_OFFLOAD_*` environment variable.

mod bench;
mod convert;
mod doctor;
mod logits;
mod perplexity;
mod plan;
mod prefill;
mod profile;
mod run;
mod serve;
mod synth;

/// The prefill JSONL reader, for the fuzz harness (tests/fuzz.rs).
#[doc(hidden)]
pub use prefill::fuzz_read_records;

use clap::{Parser, Subcommand};

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
    /// activation frequency per neuron) and save it in the model's store; for a
    /// mixture-of-experts model, its routing (tokens per expert per layer).
    Profile(profile::ProfileArgs),
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
