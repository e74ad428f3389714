//! `gpu-offload convert`: a GGUF file or HF directory → an offload store on SSD (or, with
//! `--verify`, a full integrity check of an existing store).

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};

use crate::model::quant_mix::QuantMix;
use crate::model::quantize_gguf::quantize_gguf;
use crate::store::{ConvertOptions, Encoding, Store, cached_store_for, convert};

#[derive(Debug, Args)]
pub struct ConvertArgs {
    /// GGUF file or Hugging Face model directory to convert.
    #[arg(
        long,
        short = 'm',
        env = "GPU_OFFLOAD_MODEL",
        required_unless_present = "verify"
    )]
    pub model: Option<PathBuf>,

    /// Store directory to write [default: the cache directory `run` uses for this model]
    #[arg(long, short = 'o', env = "GPU_OFFLOAD_STORE")]
    pub out: Option<PathBuf>,

    /// Extra FFN bundle encodings besides f16, comma-separated: int8, int4.
    #[arg(long, env = "GPU_OFFLOAD_ENCODINGS", value_delimiter = ',')]
    pub encodings: Vec<String>,

    /// Store a block-quantized FFN (e.g. Q4_1) as neuron bundles as well: its blocks
    /// dequantized and encoded as f16 (and --encodings), so cache units (`--cold gpu`) and
    /// mixed-precision neurons can run it. The f16 bundles hold the blocks' values rounded to
    /// f16. Without --out the store goes beside the default one, suffixed `-bundles`.
    #[arg(long, env = "GPU_OFFLOAD_BUNDLE_FFN")]
    pub bundle_ffn: bool,

    /// Replace an existing store.
    #[arg(long, env = "GPU_OFFLOAD_FORCE")]
    pub force: bool,

    /// Copy a GGUF's tensors into the store [default: the store reads them in the GGUF itself,
    /// which must then stay where it is, unchanged]
    #[arg(long, env = "GPU_OFFLOAD_COPY")]
    pub copy: bool,

    /// Quantize the model first, as llama-quantize does: `q4_k_m` (llama.cpp's mix) or one block
    /// format for every matrix (q8_0, q4_0, q4_1, q5_0, q5_1, q2_k … q6_k). The model must be a
    /// GGUF with float matrices; the quantized GGUF is written to --quantized-out and the store
    /// is made from it (llama.cpp can run the same file).
    #[arg(long, env = "GPU_OFFLOAD_QUANTIZE", value_name = "TYPE")]
    pub quantize: Option<String>,

    /// Where --quantize writes the quantized GGUF (default: beside the model, named
    /// `<model stem>.<TYPE>.gguf`)
    #[arg(long, env = "GPU_OFFLOAD_QUANTIZED_OUT", requires = "quantize")]
    pub quantized_out: Option<PathBuf>,

    /// Check an existing store instead of converting: the manifest against its checksums, every
    /// tensor the spec needs present in its shape, no segment overlapping another or past the
    /// data, every segment's bytes against its whole and per-group checksums, and the tokenizer
    /// files against theirs.
    #[arg(long, env = "GPU_OFFLOAD_VERIFY", conflicts_with_all = ["model", "encodings", "force", "copy", "quantize", "bundle_ffn"])]
    pub verify: Option<PathBuf>,
}

fn bar(len: u64, unit: &str) -> ProgressBar {
    let pb = ProgressBar::new(len);
    let template = format!("{{elapsed_precise}} [{{bar:40}}] {{pos}}/{{len}} {unit}");
    pb.set_style(
        ProgressStyle::with_template(&template).unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    pb
}

pub fn run(args: ConvertArgs) -> Result<()> {
    if let Some(dir) = &args.verify {
        let store =
            Store::open(dir).with_context(|| format!("cannot open store {}", dir.display()))?;
        let total: u64 = store.manifest.segments.iter().map(|s| s.bytes).sum();
        let pb = bar(total >> 20, "MiB");
        store
            .verify(&mut |done, _| pb.set_position(done >> 20))
            .with_context(|| format!("store {} fails verification", dir.display()))?;
        pb.finish_and_clear();
        println!(
            "{}: manifest, {} segments ({:.1} MiB, whole and per group) and tokenizer files: all checksums match; every tensor of the spec present in its shape (model {})",
            dir.display(),
            store.manifest.segments.len(),
            total as f64 / (1u64 << 20) as f64,
            store.manifest.model_id
        );
        return Ok(());
    }
    let Some(model) = &args.model else {
        bail!("give --model to convert (or --verify STORE)");
    };
    let quantized;
    let model = match &args.quantize {
        Some(name) => {
            quantized = quantize_first(model, name, args.quantized_out.as_deref(), args.force)?;
            &quantized
        }
        None => model,
    };
    let mut extra = Vec::new();
    for name in &args.encodings {
        match Encoding::parse(name.trim()) {
            Some(e @ (Encoding::Int8 | Encoding::Int4)) => extra.push(e),
            _ => bail!("--encodings {name}: unknown encoding (int8, int4; f16 is always written)"),
        }
    }
    let out = match &args.out {
        Some(o) => o.clone(),
        None if args.bundle_ffn => {
            let mut p = cached_store_for(model)?.into_os_string();
            p.push("-bundles");
            p.into()
        }
        None => cached_store_for(model)?,
    };
    let t0 = Instant::now();
    let pb = bar(0, "layers");
    let manifest = convert(
        model,
        &out,
        &ConvertOptions {
            extra_encodings: extra,
            force: args.force,
            copy: args.copy,
            bundle_quantized: args.bundle_ffn,
        },
        &mut |done, total| {
            pb.set_length(total as u64);
            pb.set_position(done as u64);
        },
    )
    .with_context(|| format!("cannot convert {}", model.display()))?;
    pb.finish_and_clear();
    let encodings: Vec<&str> = manifest.bundle_encodings.iter().map(|e| e.name()).collect();
    let ffn = if encodings.is_empty() {
        "FFN as its matrices in the model's formats".to_string()
    } else {
        format!("FFN bundles in {}", encodings.join("+"))
    };
    let in_place: u64 = manifest
        .segments
        .iter()
        .filter(|s| s.in_source)
        .map(|s| s.bytes)
        .sum();
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    let place = if in_place > 0 {
        format!(
            " (+ {:.1} MiB read in place from {})",
            mib(in_place),
            model.display()
        )
    } else {
        String::new()
    };
    println!(
        "{} → {}: {} segments, {:.1} MiB{place}, {ffn}, model {} ({:.1} s)",
        model.display(),
        out.display(),
        manifest.segments.len(),
        mib(manifest.data_bytes),
        manifest.model_id,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

/// `--quantize NAME`: the quantized GGUF of `model`, written to `out` (default: beside it).
fn quantize_first(model: &Path, name: &str, out: Option<&Path>, force: bool) -> Result<PathBuf> {
    let mix = QuantMix::parse(&name.to_ascii_lowercase()).with_context(|| {
        format!("--quantize {name}: not a quantization (q4_k_m, q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k)")
    })?;
    if model.is_dir() || model.extension().is_none_or(|e| e != "gguf") {
        bail!(
            "--quantize takes a GGUF model with f16/bf16/f32 matrices; {} is not a .gguf file",
            model.display()
        );
    }
    let out = match out {
        Some(o) => o.to_path_buf(),
        None => {
            let stem = model
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| "model".into());
            model.with_file_name(format!("{stem}.{}.gguf", mix.name()))
        }
    };
    let t0 = Instant::now();
    let pb = bar(0, "MiB");
    let report = quantize_gguf(model, &out, mix, force, &mut |done, total| {
        pb.set_length(total >> 20);
        pb.set_position(done >> 20);
    })
    .with_context(|| format!("cannot quantize {}", model.display()))?;
    pb.finish_and_clear();
    let formats: Vec<String> = report
        .quantized
        .iter()
        .map(|(d, n)| format!("{n} {d}"))
        .collect();
    println!(
        "{} → {}: {} matrices quantized ({}), {:.1} → {:.1} MiB ({:.1} s)",
        model.display(),
        out.display(),
        report.quantized.iter().map(|(_, n)| n).sum::<usize>(),
        formats.join(", "),
        report.bytes_in as f64 / (1u64 << 20) as f64,
        report.bytes_out as f64 / (1u64 << 20) as f64,
        t0.elapsed().as_secs_f64()
    );
    Ok(out)
}
