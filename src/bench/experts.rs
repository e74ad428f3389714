//! `gpu-offload bench experts`: how well a per-layer expert cache on the device would serve a
//! mixture-of-experts model's routing, on a decode trace: per layer, the share of each token's
//! routed experts already on the device under the ATU (stale experts give way by their
//! calibration frequency), under an LRU, and under a static set of the most frequent experts,
//! at cache sizes of 1×, 2× and 4× the experts a token uses. Misses are computed on the CPU and
//! never waited for; at most `--max-copies` of a token's misses a layer are copied in.
//!
//! The trace is decoded by the model (calibration text, then held-out text) or, with
//! `--synthetic`, drawn with stated popularity and temporal locality (random weights cannot
//! plant locality; every report says which).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use clap::Args;
use serde::Serialize;

use crate::backend::cpu::{CpuBackend, kernels};
use crate::engine::{Engine, Logits};
use crate::model::Model;
use crate::runtime::corpus::{corpus_tokens, read_corpus};
use crate::sparsity::routing::{
    NextRouter, RouteTrace, SyntheticRouting, Trace, adjacent_overlap, experts_for_share,
    frequencies, synthetic,
};
use crate::tier::atu::{Admission, Eviction, replay_admit, replay_prefetched, replay_static};

#[derive(Debug, Args)]
pub struct ExpertsArgs {
    /// A mixture-of-experts GGUF file or Hugging Face directory (decoded on the CPU).
    #[arg(
        long,
        short = 'm',
        env = "GPU_OFFLOAD_MODEL",
        required_unless_present = "synthetic"
    )]
    pub model: Option<PathBuf>,

    /// Draw the trace instead, for a named shape's layers, experts and experts per token:
    /// `qwen3-30b-a3b` (48 × 128, top 8), `mixtral-8x7b` (32 × 8, top 2), `tiny` (2 × 8, top 2).
    #[arg(long, env = "GPU_OFFLOAD_SYNTHETIC", conflicts_with = "model")]
    pub synthetic: Option<String>,

    /// Synthetic trace: expert popularity, rank r drawn with weight (1 + r)^-P (0 = uniform).
    #[arg(long, env = "GPU_OFFLOAD_POPULARITY", default_value_t = 0.8)]
    pub popularity: f64,

    /// Synthetic trace: the chance each of the previous token's experts is routed to again.
    #[arg(long, env = "GPU_OFFLOAD_LOCALITY", default_value_t = 0.5)]
    pub locality: f64,

    /// Synthetic trace: the seed it is drawn from.
    #[arg(long, env = "GPU_OFFLOAD_SEED", default_value_t = 0)]
    pub seed: u64,

    /// Held-out text decoded token by token [default: moby-dick-eval.txt].
    #[arg(long, env = "GPU_OFFLOAD_CORPUS")]
    pub corpus: Option<PathBuf>,

    /// Text whose routing ranks the experts (the ATU's evictions, the static set)
    /// [default: moby-dick-profile.txt].
    #[arg(long, env = "GPU_OFFLOAD_CALIBRATION")]
    pub calibration: Option<PathBuf>,

    /// Decode seeded random token ids instead of text (a model without a tokenizer).
    #[arg(long, env = "GPU_OFFLOAD_RANDOM_TOKENS")]
    pub random_tokens: bool,

    /// Tokens of the evaluated trace, one per step.
    #[arg(long, env = "GPU_OFFLOAD_EXPERT_TOKENS", default_value_t = 256, value_parser = clap::value_parser!(u32).range(2..=1_000_000))]
    pub tokens: u32,

    /// Tokens of the calibration trace.
    #[arg(long, env = "GPU_OFFLOAD_CALIBRATION_TOKENS", default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub calibration_tokens: u32,

    /// Cache sizes per layer, as multiples of the experts a token uses (capped at all experts).
    #[arg(
        long,
        env = "GPU_OFFLOAD_EXPERT_SLOTS",
        value_delimiter = ',',
        default_value = "1,2,4"
    )]
    pub sizes: Vec<f64>,

    /// Most misses a layer copies in per token [default: the experts a token uses].
    #[arg(long, env = "GPU_OFFLOAD_MAX_COPIES")]
    pub max_copies: Option<usize>,

    /// Worker threads [default: one per core]
    #[arg(long, short = 't', env = "GPU_OFFLOAD_THREADS", value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub threads: Option<u16>,

    /// Print the result as JSON.
    #[arg(long, env = "GPU_OFFLOAD_JSON")]
    pub json: bool,
}

/// Where the trace came from.
#[derive(Debug, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TraceSource {
    /// Routed by the model on decoded tokens.
    Decoded {
        model: String,
        /// The evaluated tokens' source (a corpus, or "random token ids").
        corpus: String,
        calibration: String,
    },
    /// Drawn with stated statistics (not a model's routing).
    Synthetic {
        shape: String,
        statistics: SyntheticRouting,
    },
}

/// One layer at one cache size.
#[derive(Debug, Serialize)]
pub struct LayerExperts {
    pub layer: usize,
    pub slots: usize,
    /// Of each token's experts, the share its predecessor used too.
    pub adjacent_overlap: f64,
    /// The fewest experts carrying 90% of the evaluated routings.
    pub experts_for_90pct: usize,
    pub atu: Admission,
    pub lru: Admission,
    pub static_top: Admission,
    /// Of the experts guessed for this layer from the previous layer's FFN input (next-layer
    /// prefetch; decoded traces only), the share it then routed to.
    pub guess_precision: Option<f64>,
    /// The ATU with those guesses admitted first each token, from the same copies.
    pub atu_prefetch: Option<Admission>,
}

#[derive(Debug, Serialize)]
pub struct SizeExperts {
    /// Slots per layer as a multiple of the experts a token uses.
    pub factor: f64,
    pub layers: Vec<LayerExperts>,
    pub atu: Admission,
    pub lru: Admission,
    pub static_top: Admission,
    pub atu_prefetch: Option<Admission>,
}

#[derive(Debug, Serialize)]
pub struct ExpertsReport {
    pub source: TraceSource,
    pub layers: usize,
    pub experts: usize,
    pub used: usize,
    pub tokens: usize,
    pub calibration_tokens: usize,
    pub max_copies: usize,
    /// Of every guessed expert (layers after the first), the share routed to (decoded traces).
    pub guess_precision: Option<f64>,
    pub sizes: Vec<SizeExperts>,
}

/// The shape of a named synthetic trace, `synth`'s preset of that name (`tiny`: `tiny-moe`):
/// (layers, experts, used).
fn shape(name: &str) -> Result<(usize, usize, usize)> {
    let preset = if name == "tiny" { "tiny-moe" } else { name };
    crate::model::synth::SynthSpec::preset(preset)
        .and_then(|s| s.moe.map(|m| (s.n_layers, m.experts, m.used)))
        .with_context(|| {
            format!(
                "no synthetic shape {name:?}: qwen3-30b-a3b, mixtral-8x7b or tiny (or pass --model)"
            )
        })
}

pub fn run(args: &ExpertsArgs) -> Result<ExpertsReport> {
    if args.sizes.is_empty() || args.sizes.iter().any(|f| !(f.is_finite() && *f > 0.0)) {
        bail!("--sizes takes positive multiples of the experts a token uses");
    }
    let calib = args.calibration_tokens as usize;
    let want = args.tokens as usize;
    let (source, experts, used, calibration, eval, guesses) = match (&args.synthetic, &args.model) {
        (Some(name), _) => {
            let (layers, experts, used) = shape(name)?;
            let statistics = SyntheticRouting {
                layers,
                experts,
                used,
                tokens: calib + want,
                popularity: args.popularity,
                locality: args.locality,
                seed: args.seed,
            };
            let mut trace = synthetic(&statistics).map_err(|e| anyhow::anyhow!(e))?;
            // One draw split in two: the calibration part sees the same popularity order.
            let eval: Trace = trace.iter_mut().map(|sets| sets.split_off(calib)).collect();
            let source = TraceSource::Synthetic {
                shape: name.clone(),
                statistics,
            };
            (source, experts, used, trace, eval, None)
        }
        (None, Some(path)) => decoded(args, path, calib, want)?,
        (None, None) => bail!("pass --model (a mixture-of-experts model) or --synthetic SHAPE"),
    };
    let max_copies = args.max_copies.unwrap_or(used);
    let layers = layer_stats(&calibration, &eval, guesses.as_ref(), experts);
    let sizes = args
        .sizes
        .iter()
        .map(|&factor| {
            by_size(
                &layers,
                (&eval, guesses.as_ref()),
                experts,
                used,
                factor,
                max_copies,
            )
        })
        .collect::<Result<Vec<_>>>()?;
    let (guessed, right) = layers
        .iter()
        .filter_map(|l| l.guesses)
        .fold((0, 0), |(g, r), (a, b)| (g + a, r + b));
    Ok(ExpertsReport {
        source,
        layers: eval.len(),
        experts,
        used,
        tokens: want,
        calibration_tokens: calib,
        max_copies,
        guess_precision: (guessed > 0).then(|| right as f64 / guessed as f64),
        sizes,
    })
}

/// Every layer's routing on `calib` tokens of the calibration text, then on `want` tokens of
/// the held-out text, each decoded one token a step from a fresh context.
fn decoded(
    args: &ExpertsArgs,
    path: &std::path::Path,
    calib: usize,
    want: usize,
) -> Result<(TraceSource, usize, usize, Trace, Trace, Option<Trace>)> {
    let model = Model::load(path).with_context(|| format!("cannot load {}", path.display()))?;
    let Some(moe) = model.spec.moe.clone() else {
        bail!(
            "{} has no experts: `bench experts` is for mixture-of-experts models (dense FFNs: `bench units`)",
            path.display()
        );
    };
    let longest = calib.max(want);
    if longest > model.spec.max_context {
        bail!(
            "{longest} tokens exceed the model's context of {}",
            model.spec.max_context
        );
    }
    let (calib_ids, eval_ids, corpus, calibration) = if args.random_tokens {
        let ids = |seed: u64, n: usize| -> Vec<u32> {
            use rand::{RngExt, SeedableRng};
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let v = model.spec.vocab_size as u32;
            (0..n).map(|_| rng.random_range(0..v)).collect()
        };
        let label = |seed| format!("random token ids (seed {seed})");
        (
            ids(args.seed, calib),
            ids(args.seed + 1, want),
            label(args.seed + 1),
            label(args.seed),
        )
    } else {
        let Some(tokenizer) = &model.tokenizer else {
            bail!(
                "{} has no tokenizer: pass --random-tokens to decode random token ids",
                path.display()
            );
        };
        let (cpath, ctext) = read_corpus(args.calibration.as_deref(), "moby-dick-profile.txt")?;
        let (epath, etext) = read_corpus(args.corpus.as_deref(), "moby-dick-eval.txt")?;
        let mut c = corpus_tokens(&cpath, &ctext, tokenizer, calib)?;
        let mut e = corpus_tokens(&epath, &etext, tokenizer, want)?;
        c.truncate(calib);
        e.truncate(want);
        (
            c,
            e,
            epath.display().to_string(),
            cpath.display().to_string(),
        )
    };
    let layers = model.spec.n_layers;
    let threads = args.threads.map_or(0, usize::from);
    // Each layer's experts guessed from the previous layer's FFN input, as an offloaded run
    // prefetches them.
    let guesser = CpuBackend::with_kernels(threads, kernels::best())?;
    let w = &model.weights.layers;
    let next = (0..layers)
        .map(|l| match (w.get(l), w.get(l + 1)) {
            (Some(here), Some(next)) => {
                let router = next
                    .router
                    .as_ref()
                    .with_context(|| format!("layer {} has no router", l + 1))?;
                NextRouter::new(
                    &guesser,
                    router,
                    &here.ffn_norm.weight,
                    &next.ffn_norm.weight,
                    moe.experts,
                )
                .map(Some)
                .map_err(anyhow::Error::msg)
            }
            _ => Ok(None),
        })
        .collect::<Result<Vec<_>>>()?;
    let tap = Arc::new(RouteTrace::with_guesses(layers, next, guesser, moe.clone()));
    let cpu = CpuBackend::with_kernels(threads, kernels::best())?;
    let engine = Engine::new(cpu, model.spec.clone(), &model.weights)?.with_route_tap(tap.clone());
    drop(model.weights);
    let decode = |ids: &[u32]| -> Result<(Trace, Trace)> {
        let mut session = engine.new_session(ids.len())?;
        for &t in ids {
            engine.forward(&mut session, &[t], Logits::None)?;
        }
        Ok((tap.take(), tap.take_guesses()))
    };
    let (calibration_trace, _) = decode(&calib_ids)?;
    let (eval, guesses) = decode(&eval_ids)?;
    let source = TraceSource::Decoded {
        model: path.display().to_string(),
        corpus,
        calibration,
    };
    Ok((
        source,
        moe.experts,
        moe.used,
        calibration_trace,
        eval,
        Some(guesses),
    ))
}

/// What a layer's trace is, whatever the cache size: its experts' calibration frequencies, its
/// adjacent overlap and the experts carrying 90% of its routings.
struct LayerStats {
    score: Vec<f32>,
    adjacent_overlap: f64,
    experts_for_90pct: usize,
    /// Experts guessed for the layer's tokens, and of them those routed to.
    guesses: Option<(u64, u64)>,
}

fn layer_stats(
    calibration: &[Vec<Vec<u32>>],
    eval: &[Vec<Vec<u32>>],
    guesses: Option<&Trace>,
    experts: usize,
) -> Vec<LayerStats> {
    calibration
        .iter()
        .zip(eval)
        .enumerate()
        .map(|(l, (calib, sets))| LayerStats {
            score: frequencies(calib, experts),
            adjacent_overlap: adjacent_overlap(sets),
            experts_for_90pct: experts_for_share(sets, experts, 0.9),
            guesses: guesses
                .and_then(|g| g.get(l))
                .filter(|g| !g.is_empty())
                .map(|g| {
                    g.iter().zip(sets).fold((0, 0), |(n, r), (guess, routed)| {
                        let right = guess.iter().filter(|e| routed.contains(e)).count();
                        (n + guess.len() as u64, r + right as u64)
                    })
                }),
        })
        .collect()
}

/// Every layer's hits at one cache size under the three policies: the ATU and the static set
/// ranked by the calibration trace's frequencies, the LRU by recency.
fn by_size(
    stats: &[LayerStats],
    (eval, guesses): (&[Vec<Vec<u32>>], Option<&Trace>),
    experts: usize,
    used: usize,
    factor: f64,
    max_copies: usize,
) -> Result<SizeExperts> {
    let slots = ((used as f64 * factor).ceil() as usize).clamp(1, experts);
    let mut layers = Vec::with_capacity(eval.len());
    let (mut atu, mut lru, mut static_top) = (
        Admission::default(),
        Admission::default(),
        Admission::default(),
    );
    let mut atu_prefetch = guesses.map(|_| Admission::default());
    for (l, (st, sets)) in stats.iter().zip(eval).enumerate() {
        let score = &st.score;
        let a = replay_admit(
            sets,
            experts,
            slots,
            Eviction::Frequency(score.clone()),
            max_copies,
        )?;
        let r = replay_admit(sets, experts, slots, Eviction::Recency, max_copies)?;
        let s = replay_static(sets, score, slots)?;
        // The first layer has no guesses: its ATU is the same with or without prefetch.
        let p = match guesses.and_then(|g| g.get(l)) {
            Some(g) => Some(replay_prefetched(
                sets,
                g,
                experts,
                slots,
                Eviction::Frequency(score.clone()),
                max_copies,
            )?),
            None => None,
        };
        if let (Some(total), Some(p)) = (atu_prefetch.as_mut(), p) {
            *total += p;
        }
        atu += a;
        lru += r;
        static_top += s;
        layers.push(LayerExperts {
            layer: l,
            slots,
            adjacent_overlap: st.adjacent_overlap,
            experts_for_90pct: st.experts_for_90pct,
            atu: a,
            lru: r,
            static_top: s,
            guess_precision: st
                .guesses
                .filter(|g| g.0 > 0)
                .map(|(n, r)| r as f64 / n as f64),
            atu_prefetch: p,
        });
    }
    Ok(SizeExperts {
        factor,
        layers,
        atu,
        lru,
        static_top,
        atu_prefetch,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_larger_cache_hits_more_and_the_atu_beats_a_static_set_on_local_traces() {
        let stats = SyntheticRouting {
            layers: 3,
            experts: 32,
            used: 4,
            tokens: 1500,
            popularity: 0.6,
            locality: 0.6,
            seed: 3,
        };
        let mut calibration = synthetic(&stats).unwrap();
        let eval: Trace = calibration.iter_mut().map(|s| s.split_off(500)).collect();
        let stats = layer_stats(&calibration, &eval, None, 32);
        let small = by_size(&stats, (&eval, None), 32, 4, 1.0, 4).unwrap();
        let large = by_size(&stats, (&eval, None), 32, 4, 4.0, 4).unwrap();
        assert_eq!(large.layers[0].slots, 16);
        for s in [&small, &large] {
            assert_eq!(s.atu.needed, 3 * 1000 * 4);
            assert_eq!(s.atu.needed, s.lru.needed);
        }
        assert!(large.atu.hits > small.atu.hits);
        assert!(large.lru.hits > small.lru.hits);
        // With 60% of a token's experts repeating, a cache that follows the trace beats the
        // fixed set of the same size.
        assert!(small.atu.hit_ratio() > small.static_top.hit_ratio() + 0.2);
        // A cache of every expert misses each expert once, then never.
        let all = by_size(&stats, (&eval, None), 32, 4, 8.0, 4).unwrap();
        assert_eq!(all.layers[0].slots, 32);
        assert!(all.atu.needed - all.atu.hits <= 3 * 32);
        assert_eq!(all.static_top.hits, all.static_top.needed);
    }

    #[test]
    fn right_guesses_admitted_first_make_every_routed_expert_a_hit() {
        let stats = SyntheticRouting {
            layers: 2,
            experts: 16,
            used: 2,
            tokens: 400,
            popularity: 0.3,
            locality: 0.2,
            seed: 5,
        };
        let calibration = synthetic(&stats).unwrap();
        let eval = synthetic(&SyntheticRouting { seed: 6, ..stats }).unwrap();
        // Layer 1 guessed exactly, no guess for layer 0.
        let right: Trace = vec![Vec::new(), eval[1].clone()];
        let st = layer_stats(&calibration, &eval, Some(&right), 16);
        assert_eq!(st[1].guesses, Some((800, 800)));
        assert_eq!(st[0].guesses, None);
        let s = by_size(&st, (&eval, Some(&right)), 16, 2, 1.0, 2).unwrap();
        let layer1 = s.layers[1].atu_prefetch.unwrap();
        assert_eq!((layer1.hits, layer1.needed), (800, 800));
        assert!(s.layers[1].atu.hits < 800);
        assert_eq!(s.layers[1].guess_precision, Some(1.0));
        // Layer 0 is the same with or without prefetch.
        assert_eq!(s.layers[0].atu_prefetch, Some(s.layers[0].atu));
        // Guesses that are never routed (another draw) are mostly wrong and cost copies.
        let wrong: Trace = vec![Vec::new(), calibration[1].clone()];
        let st = layer_stats(&calibration, &eval, Some(&wrong), 16);
        let (n, r) = st[1].guesses.unwrap();
        assert!(r * 3 < n, "{r} of {n} right");
        let s = by_size(&st, (&eval, Some(&wrong)), 16, 2, 1.0, 2).unwrap();
        assert!(s.layers[1].atu_prefetch.unwrap().copies > s.layers[1].atu.copies);
    }

    #[test]
    fn shapes_and_sizes_are_checked() {
        assert!(shape("qwen3-30b-a3b").is_ok());
        assert!(shape("gpt-oss").is_err());
    }
}
