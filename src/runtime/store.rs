//! Finding the store for a model path: a store directory as it is, or the cached store of a
//! GGUF file / HF directory, converted on first use (and again when the source changed).

use std::path::Path;

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};

use crate::store::{ConvertOptions, Store, cached_store_for, convert};

/// The model's dense weights and tokenizer: from `store` where `model` is that store's
/// directory (the numbers the offloaded engine computes with), else loaded from the file.
pub fn model_for(model: &Path, store: &Store) -> Result<crate::model::Model> {
    if Store::is_store(model) {
        return Ok(crate::model::Model {
            spec: store.manifest.spec.clone(),
            weights: store.dense_weights()?,
            tokenizer: store.tokenizer()?,
            source: model.to_path_buf(),
        });
    }
    crate::model::Model::load(model)
        .with_context(|| format!("cannot load model {}", model.display()))
}

pub fn open_store_for(model: &Path) -> Result<Store> {
    if Store::is_store(model) {
        return Store::open(model)
            .with_context(|| format!("cannot open store {}", model.display()));
    }
    if !model.exists() {
        anyhow::bail!("{} does not exist", model.display());
    }
    let cached = cached_store_for(model)?;
    if Store::is_store(&cached) {
        match Store::open(&cached) {
            Ok(s) if source_unchanged(&s, model) => return Ok(s),
            Ok(_) => tracing::info!(
                "{} changed since it was converted; converting again",
                model.display()
            ),
            Err(e) => tracing::warn!(
                "cached store {} is unusable ({e}); converting again",
                cached.display()
            ),
        }
    }
    eprintln!(
        "converting {} into {} (first use)",
        model.display(),
        cached.display()
    );
    let pb = ProgressBar::new(0);
    pb.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} layers")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    convert(
        model,
        &cached,
        &ConvertOptions {
            force: true,
            ..Default::default()
        },
        &mut |done, total| {
            pb.set_length(total as u64);
            pb.set_position(done as u64);
        },
    )
    .with_context(|| format!("cannot convert {}", model.display()))?;
    pb.finish_and_clear();
    Store::open(&cached).with_context(|| format!("cannot open store {}", cached.display()))
}

fn source_unchanged(store: &Store, model: &Path) -> bool {
    let Ok(canonical) = std::fs::canonicalize(model) else {
        return false;
    };
    let src = &store.manifest.source;
    let meta = std::fs::metadata(&canonical);
    let same_size = match meta {
        Ok(m) if m.is_file() => m.len() == src.bytes,
        Ok(_) => {
            // A directory: the converter summed its files.
            std::fs::read_dir(&canonical)
                .map(|rd| {
                    rd.filter_map(|e| e.ok())
                        .filter_map(|e| e.metadata().ok())
                        .filter(|m| m.is_file())
                        .map(|m| m.len())
                        .sum::<u64>()
                        == src.bytes
                })
                .unwrap_or(false)
        }
        Err(_) => false,
    };
    src.path == canonical.to_string_lossy() && same_size
}
