//! `gpu-offload synth`: write a deterministic synthetic model (HF format) of any shape.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};

use crate::model::Arch;
use crate::model::quant_mix::QuantMix;
use crate::model::synth::{SynthDtype, SynthSpec, synthesize, synthesize_gguf};

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum SynthArch {
    Llama,
    Opt,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum SynthFormat {
    /// A Hugging Face directory (config.json + safetensors).
    Hf,
    /// One llama GGUF file, as llama.cpp loads it (LLaMA SwiGLU shapes).
    Gguf,
}

#[derive(Debug, Args)]
pub struct SynthArgs {
    /// Directory (hf) or file (gguf) to write.
    #[arg(long, short = 'o', env = "GPU_OFFLOAD_OUT")]
    pub out: PathBuf,

    /// Output format [default: gguf when --out ends in .gguf, else hf]
    #[arg(long, env = "GPU_OFFLOAD_FORMAT", value_enum)]
    pub format: Option<SynthFormat>,

    /// Named shape: tiny, 1b, 7b, 13b, 70b; mixture-of-experts (GGUF only): tiny-moe,
    /// qwen3-30b-a3b, mixtral-8x7b (other flags override its fields; --ffn is then each
    /// expert's width).
    #[arg(long, env = "GPU_OFFLOAD_PRESET", default_value = "tiny")]
    pub preset: String,

    #[arg(long, env = "GPU_OFFLOAD_ARCH", value_enum)]
    pub arch: Option<SynthArch>,
    #[arg(long, env = "GPU_OFFLOAD_LAYERS")]
    pub layers: Option<usize>,
    #[arg(long, env = "GPU_OFFLOAD_HIDDEN")]
    pub hidden: Option<usize>,
    #[arg(long, env = "GPU_OFFLOAD_FFN")]
    pub ffn: Option<usize>,
    #[arg(long, env = "GPU_OFFLOAD_HEADS")]
    pub heads: Option<usize>,
    #[arg(long, env = "GPU_OFFLOAD_KV_HEADS")]
    pub kv_heads: Option<usize>,
    #[arg(long, env = "GPU_OFFLOAD_VOCAB")]
    pub vocab: Option<usize>,
    #[arg(long, env = "GPU_OFFLOAD_MAX_CONTEXT")]
    pub max_context: Option<usize>,
    /// Weight precision: f16 or bf16; for GGUF output also a quantization of those weights by
    /// llama.cpp's reference quantizers: q4_k_m (its mix), or one format for every matrix (q4_0,
    /// q4_1, q5_0, q5_1, q8_0, q2_k, q3_k, q4_k, q5_k, q6_k) [default: f16]
    #[arg(long, env = "GPU_OFFLOAD_DTYPE")]
    pub dtype: Option<String>,
    /// FFN activation for LLaMA shapes: silu or relu.
    #[arg(long, env = "GPU_OFFLOAD_ACTIVATION")]
    pub activation: Option<String>,
    /// Tie the output matrix to the embeddings.
    #[arg(long, env = "GPU_OFFLOAD_TIED")]
    pub tied: bool,
    #[arg(long, env = "GPU_OFFLOAD_SEED", default_value_t = 0)]
    pub seed: u64,
    /// Plant hot/cold FFN neurons with this power-law exponent (e.g. 0.8).
    #[arg(long, env = "GPU_OFFLOAD_POWER_LAW")]
    pub power_law: Option<f64>,
    /// Mixture-of-experts shapes: plant expert popularity P (the router logit of each layer's
    /// expert of rank r biased by about −P·ln(1 + r); 0 = none). Temporal locality is not
    /// plantable by weights: `bench experts --synthetic` draws traces with it.
    #[arg(long, env = "GPU_OFFLOAD_POPULARITY")]
    pub popularity: Option<f64>,
    /// GiB per safetensors shard.
    #[arg(long, env = "GPU_OFFLOAD_SHARD_GIB", default_value_t = 4.0)]
    pub shard_gib: f64,
    /// Replace an existing directory.
    #[arg(long, env = "GPU_OFFLOAD_FORCE")]
    pub force: bool,
}

pub fn run(a: SynthArgs) -> Result<()> {
    let Some(mut s) = SynthSpec::preset(&a.preset) else {
        bail!(
            "--preset {}: unknown (tiny, 1b, 7b, 13b, 70b, tiny-moe, qwen3-30b-a3b, mixtral-8x7b)",
            a.preset
        );
    };
    if let Some(arch) = a.arch {
        s.arch = match arch {
            SynthArch::Llama => Arch::Llama,
            SynthArch::Opt => Arch::Opt,
        };
        if s.arch == Arch::Opt {
            s.activation = "relu".into();
            s.n_kv_heads = a.heads.unwrap_or(s.n_heads);
            s.tied_output = true;
        }
    }
    macro_rules! set {
        ($field:ident, $arg:expr) => {
            if let Some(v) = $arg {
                s.$field = v;
            }
        };
    }
    set!(n_layers, a.layers);
    set!(d_model, a.hidden);
    set!(d_ff, a.ffn);
    set!(n_heads, a.heads);
    set!(n_kv_heads, a.kv_heads);
    set!(vocab_size, a.vocab);
    set!(max_context, a.max_context);
    set!(activation, a.activation.clone());
    let mut quant = None;
    match a.dtype.as_deref() {
        None | Some("f16") => s.dtype = SynthDtype::F16,
        Some("bf16") => s.dtype = SynthDtype::Bf16,
        Some(other) => {
            quant = Some(QuantMix::parse(other).with_context(|| {
                format!("--dtype {other}: unknown (f16, bf16, q4_k_m, or a block format such as q4_0, q8_0, q4_k, q6_k)")
            })?);
        }
    }
    s.tied_output |= a.tied;
    match (&mut s.moe, a.popularity) {
        (Some(m), Some(p)) => m.popularity = p,
        (Some(_), None) => {}
        (None, Some(_)) => bail!(
            "--popularity is for mixture-of-experts presets (tiny-moe, qwen3-30b-a3b, mixtral-8x7b)"
        ),
        (None, None) => {}
    }
    if let Some(m) = &mut s.moe {
        m.d_expert = s.d_ff;
    }
    s.seed = a.seed;
    s.power_law = a.power_law;
    if !(a.shard_gib.is_finite() && a.shard_gib > 0.0) {
        bail!("--shard-gib must be positive");
    }
    s.shard_bytes = (a.shard_gib * (1u64 << 30) as f64) as u64;
    if let Err(msg) = s.validate() {
        bail!("invalid model shape: {msg}");
    }
    let params = s.parameters();
    let pb = ProgressBar::new((params * 2) >> 20);
    pb.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} MiB")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let t0 = Instant::now();
    let format = a.format.unwrap_or_else(|| {
        if quant.is_some() || a.out.extension().is_some_and(|e| e == "gguf") {
            SynthFormat::Gguf
        } else {
            SynthFormat::Hf
        }
    });
    let mut tick = |done, _| pb.set_position(done >> 20);
    match (format, quant) {
        (SynthFormat::Hf, Some(q)) => bail!(
            "--dtype {}: quantized models are written as GGUF (--format gguf, or -o NAME.gguf)",
            q.name()
        ),
        (SynthFormat::Hf, None) => synthesize(&s, &a.out, a.force, &mut tick),
        (SynthFormat::Gguf, q) => synthesize_gguf(&s, &a.out, a.force, q, &mut tick),
    }
    .with_context(|| format!("cannot write {}", a.out.display()))?;
    pb.finish_and_clear();
    let secs = t0.elapsed().as_secs_f64();
    // What was written, as it lies on disk (quantized files are smaller than 2 bytes/parameter).
    let bytes: u64 = if a.out.is_dir() {
        std::fs::read_dir(&a.out)?
            .filter_map(|e| e.ok()?.metadata().ok())
            .map(|m| m.len())
            .sum()
    } else {
        std::fs::metadata(&a.out)?.len()
    };
    let count = if params >= 1_000_000_000 {
        format!("{:.2}B", params as f64 / 1e9)
    } else {
        format!("{:.2}M", params as f64 / 1e6)
    };
    if let Some(m) = &s.moe {
        println!(
            "{} experts a layer, {} a token, each {} wide; planted popularity {} (locality: none planted)",
            m.experts, m.used, m.d_expert, m.popularity
        );
    }
    println!(
        "{}: {count} parameters, {:.1} MiB in {:.1} s ({:.0} MiB/s)",
        a.out.display(),
        bytes as f64 / (1u64 << 20) as f64,
        secs,
        bytes as f64 / (1u64 << 20) as f64 / secs
    );
    Ok(())
}
