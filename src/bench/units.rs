//! `gpu-offload bench units`: how well HBM cache units would reuse neurons between adjacent
//! tokens (M2Cache's ATU), on a decode trace of held-out text: per layer, the share of each
//! token's active neurons already in a unit of a given size under the ATU, under an LRU of the
//! same size, and what reloading the whole active set every token would move instead.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use crate::backend::cpu::{CpuBackend, kernels};
use crate::engine::{Engine, Logits};
use crate::runtime::corpus::{corpus_tokens, read_corpus};
use crate::runtime::store::open_store_for;
use crate::sparsity::trace::{ActiveSetTap, adjacent_overlap};
use crate::sparsity::{SparsityProfile, grid_index};
use crate::tier::atu::{Eviction, Reuse, replay};

#[derive(Debug, Args)]
pub struct UnitsArgs {
    /// GGUF file, Hugging Face directory or store, profiled (`gpu-offload profile`) [default:
    /// the model scripts/fetch-models.sh downloads]
    #[arg(long, short = 'm', env = "GPU_OFFLOAD_MODEL")]
    pub model: Option<PathBuf>,

    /// Held-out text decoded token by token [default: moby-dick-eval.txt, the part of the
    /// profile's book it was not calibrated on]
    #[arg(long, env = "GPU_OFFLOAD_CORPUS")]
    pub corpus: Option<PathBuf>,

    /// Tokens decoded, one per step.
    #[arg(long, env = "GPU_OFFLOAD_UNIT_TOKENS", default_value_t = 256, value_parser = clap::value_parser!(u32).range(2..))]
    pub tokens: u32,

    /// FFN sparsity whose mask decides what is active (from the profile's thresholds).
    #[arg(long, env = "GPU_OFFLOAD_SPARSITY_TARGET", default_value_t = 0.5)]
    pub sparsity_target: f64,

    /// Unit sizes to try, as multiples of the layer's largest active set in the trace (a unit
    /// must hold a token's whole set; capped at the layer's neurons).
    #[arg(
        long,
        env = "GPU_OFFLOAD_UNIT_SLOTS",
        value_delimiter = ',',
        default_value = "1.0,1.25,1.5"
    )]
    pub slots: Vec<f64>,

    /// Worker threads [default: one per core]
    #[arg(long, short = 't', env = "GPU_OFFLOAD_THREADS", value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub threads: Option<u16>,

    /// Print the result as JSON.
    #[arg(long, env = "GPU_OFFLOAD_JSON")]
    pub json: bool,

    /// Do not keep the measured hit ratios in the profile (where the plan of `--cold gpu`
    /// takes its expected loads from).
    #[arg(long, env = "GPU_OFFLOAD_NO_SAVE")]
    pub no_save: bool,
}

/// One layer at one unit size.
#[derive(Debug, Serialize)]
pub struct LayerReuse {
    pub layer: usize,
    pub slots: usize,
    /// Mean active neurons per token, and the share of them the previous token had active.
    pub mean_active: f64,
    pub adjacent_overlap: f64,
    pub atu: Reuse,
    pub lru: Reuse,
}

#[derive(Debug, Serialize)]
pub struct SizeReuse {
    /// Multiple of each layer's largest active set.
    pub factor: f64,
    pub layers: Vec<LayerReuse>,
    pub atu: Reuse,
    pub lru: Reuse,
    /// Neurons reloading every token's whole active set moves (no reuse).
    pub reload_loads: u64,
}

#[derive(Debug, Serialize)]
pub struct UnitsReport {
    pub model: String,
    pub corpus: String,
    pub tokens: usize,
    pub sparsity_target: f64,
    pub d_ff: usize,
    pub sizes: Vec<SizeReuse>,
}

fn add(a: Reuse, b: Reuse) -> Reuse {
    Reuse {
        needed: a.needed + b.needed,
        hits: a.hits + b.hits,
    }
}

/// Decode the held-out text of `args` one token at a time on the CPU engine with the profile's
/// mask, and replay each layer's active sets through units of each size.
pub fn run(args: &UnitsArgs) -> Result<UnitsReport> {
    let model_path = checked_model_path(args)?;
    let (corpus, text) = read_corpus(args.corpus.as_deref(), "moby-dick-eval.txt")?;
    let store = open_store_for(&model_path)?;
    crate::runtime::refuse_experts(&store.manifest.spec, "`bench units`")?;
    let name = model_path.display().to_string();
    let profile = SparsityProfile::load(store.dir(), &store.manifest.model_id, &name)
        .context("the units' eviction and the mask come from the sparsity profile")?;
    let model = crate::runtime::store::model_for(&model_path, &store)?;
    let Some(tokenizer) = &model.tokenizer else {
        bail!(
            "{} has no tokenizer: the trace decodes text",
            model_path.display()
        );
    };
    let want = args.tokens as usize;
    if want > model.spec.max_context {
        bail!(
            "--tokens {want} exceeds the model's context of {}",
            model.spec.max_context
        );
    }
    let tokens = corpus_tokens(&corpus, &text, tokenizer, want)?;
    let tokens = &tokens[..want];
    let spec = model.spec.clone();
    let d_ff = spec.d_ff;
    let thresholds = profile.thresholds_for(args.sparsity_target)?;
    let k = grid_index(args.sparsity_target);
    let tap = Arc::new(ActiveSetTap::new(thresholds, d_ff));
    let cpu = CpuBackend::with_kernels(args.threads.map_or(0, usize::from), kernels::best())?;
    let engine = Engine::new(cpu, spec.clone(), &model.weights)?.with_activation_tap(tap.clone());
    drop(model.weights);
    let trace = decode_trace(&engine, &tap, tokens)?;
    let sizes = reuse_by_size(&trace, &profile, &args.slots, d_ff, k)?;
    if !args.no_save {
        save_unit_reuse(profile, &sizes, args, want, spec.n_layers, store.dir())?;
    }
    Ok(UnitsReport {
        model: name,
        corpus: corpus.display().to_string(),
        tokens: want,
        sparsity_target: args.sparsity_target,
        d_ff,
        sizes,
    })
}

/// `--model` (or the default model), which must exist; the other flags checked.
fn checked_model_path(args: &UnitsArgs) -> Result<PathBuf> {
    let model_path = args
        .model
        .clone()
        .unwrap_or_else(crate::model::default_model_path);
    if !model_path.exists() {
        bail!(
            "{} does not exist: pass --model (or run scripts/fetch-models.sh for the default)",
            model_path.display()
        );
    }
    if !(0.01..=0.99).contains(&args.sparsity_target) {
        bail!(
            "--sparsity-target {} is outside 0.01..=0.99",
            args.sparsity_target
        );
    }
    if args.slots.is_empty() || args.slots.iter().any(|f| !(f.is_finite() && *f >= 1.0)) {
        bail!(
            "--slots takes multiples of the largest active set, each at least 1 (a unit holds a token's whole set)"
        );
    }
    Ok(model_path)
}

/// Each layer's active set at each token of `tokens`, decoded one by one.
fn decode_trace(
    engine: &Engine<CpuBackend>,
    tap: &ActiveSetTap,
    tokens: &[u32],
) -> Result<Vec<Vec<Vec<u32>>>> {
    let want = tokens.len();
    let pb = ProgressBar::new(want as u64);
    pb.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} tokens decoded")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut session = engine.new_session(want)?;
    for &t in tokens {
        engine.forward(&mut session, &[t], Logits::None)?;
        pb.inc(1);
    }
    pb.finish_and_clear();
    let trace = tap.take();
    Ok(trace)
}

/// For each unit size (a multiple of each layer's largest active set), every layer's reuse
/// under the ATU (the profile's frequencies decide evictions) and under an LRU.
fn reuse_by_size(
    trace: &[Vec<Vec<u32>>],
    profile: &SparsityProfile,
    factors: &[f64],
    d_ff: usize,
    k: usize,
) -> Result<Vec<SizeReuse>> {
    let mut sizes = Vec::new();
    for &factor in factors {
        let mut layers = Vec::new();
        let (mut atu, mut lru, mut reload) = (Reuse::default(), Reuse::default(), 0u64);
        for (l, sets) in trace.iter().enumerate() {
            let largest = sets.iter().map(Vec::len).max().unwrap_or(0);
            let slots = ((largest as f64 * factor).ceil() as usize).clamp(1, d_ff);
            let score: Vec<f32> = profile
                .frequencies(l, k)
                .iter()
                .map(|&f| f as f32)
                .collect();
            let a = replay(sets, d_ff, slots, Eviction::Frequency(score))?;
            let r = replay(sets, d_ff, slots, Eviction::Recency)?;
            atu = add(atu, a);
            lru = add(lru, r);
            reload += a.needed;
            layers.push(LayerReuse {
                layer: l,
                slots,
                mean_active: a.needed as f64 / sets.len().max(1) as f64,
                adjacent_overlap: adjacent_overlap(sets),
                atu: a,
                lru: r,
            });
        }
        sizes.push(SizeReuse {
            factor,
            layers,
            atu,
            lru,
            reload_loads: reload,
        });
    }
    Ok(sizes)
}

/// Keep the measured hit ratios in the profile (each layer's points by unit size), where the
/// plan of `--cold gpu` takes its expected loads from.
fn save_unit_reuse(
    profile: SparsityProfile,
    sizes: &[SizeReuse],
    args: &UnitsArgs,
    want: usize,
    n_layers: usize,
    store_dir: &std::path::Path,
) -> Result<()> {
    let mut layers: Vec<Vec<(usize, f64)>> = vec![Vec::new(); n_layers];
    for size in sizes {
        for r in &size.layers {
            layers[r.layer].push((r.slots, r.atu.hit_ratio()));
        }
    }
    for pts in &mut layers {
        pts.sort_by_key(|p| p.0);
        pts.dedup_by_key(|p| p.0);
    }
    let mut profile = profile;
    profile.unit_reuse = Some(crate::sparsity::UnitReuse {
        target: args.sparsity_target,
        tokens: want,
        layers,
    });
    profile.save(store_dir)?;
    Ok(())
}
