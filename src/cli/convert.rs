//! `gpu-offload convert`: a GGUF file or HF directory → an offload store on SSD (or, with
//! `--verify`, a full integrity check of an existing store).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};

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

    /// Replace an existing store.
    #[arg(long, env = "GPU_OFFLOAD_FORCE")]
    pub force: bool,

    /// Copy a GGUF's tensors into the store [default: the store reads them in the GGUF itself,
    /// which must then stay where it is, unchanged]
    #[arg(long, env = "GPU_OFFLOAD_COPY")]
    pub copy: bool,

    /// Check every segment of an existing store against its checksum instead of converting.
    #[arg(long, env = "GPU_OFFLOAD_VERIFY", conflicts_with_all = ["model", "encodings", "force", "copy"])]
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
        store.verify_all(&mut |done, _| pb.set_position(done >> 20))?;
        pb.finish_and_clear();
        println!(
            "{}: {} segments, {:.1} MiB, all checksums match (model {})",
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
    let mut extra = Vec::new();
    for name in &args.encodings {
        match Encoding::parse(name.trim()) {
            Some(e @ (Encoding::Int8 | Encoding::Int4)) => extra.push(e),
            _ => bail!("--encodings {name}: unknown encoding (int8, int4; f16 is always written)"),
        }
    }
    let out = match &args.out {
        Some(o) => o.clone(),
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
