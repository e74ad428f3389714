//! Profiling a model's FFN sparsity (`gpu-offload profile`): a CPU engine over its dense weights
//! with an activation tap, both passes over the calibration tokens (thresholds, then
//! frequencies), the activation predictors trained, and the profile saved in the model's store.
//! Progress goes to a callback; this prints nothing.

use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;

use crate::backend::cpu::{CpuBackend, kernels};
use crate::engine::Engine;
use crate::model::{ModelSpec, ModelWeights};
use crate::sparsity::predictor::{Predictor, TrainOptions};
use crate::sparsity::{ProfileTap, SparsityProfile, profile_passes};
use crate::store::Store;

/// How a profile is taken, beside its tokens.
#[derive(Clone, Copy, Debug)]
pub struct ProfileSettings {
    /// Worker threads (0: one per core).
    pub threads: usize,
    /// Collect the predictors' training data (false: `--no-predictors`).
    pub predictors: bool,
    /// Sparsity the predictors are trained for.
    pub predictor_target: f64,
    /// Tokens of pass 2 the predictors train on.
    pub predictor_tokens: usize,
    /// Rank of each predictor's hidden layer.
    pub predictor_rank: usize,
}

/// A CPU engine tapped for a profile, before its passes.
pub struct SparsityProfiler {
    spec: ModelSpec,
    engine: Engine<CpuBackend>,
    tap: Arc<ProfileTap>,
    /// Every weight's values, for the predictors' share of the model.
    model_parameters: u64,
    settings: ProfileSettings,
}

/// What both passes measured, and when they started.
pub struct ProfilePasses {
    thresholds: Vec<Vec<f32>>,
    measured: Vec<Vec<f32>>,
    frequency: Vec<u16>,
    tokens: usize,
    window: usize,
    t0: Instant,
}

/// A profile taken and saved, with the figures its summary reports.
pub struct ProfileRun {
    pub profile: SparsityProfile,
    /// Seconds from the first pass until the profile was saved.
    pub seconds: f64,
    /// Parameters of all the predictors, and of the model.
    pub predictor_parameters: usize,
    pub model_parameters: u64,
    /// Seconds the predictors took to train.
    pub train_seconds: f64,
}

impl SparsityProfiler {
    /// The tapped CPU engine over `weights` (dropped once the engine holds them).
    pub fn new(spec: &ModelSpec, weights: ModelWeights, settings: ProfileSettings) -> Result<Self> {
        super::refuse_experts(spec, "`profile`")?;
        let spec = spec.clone();
        let d_ff = spec.d_ff;
        let mut tap = ProfileTap::new(spec.n_layers, d_ff);
        if settings.predictors {
            tap = tap.with_predictor_data(
                spec.d_model,
                settings.predictor_target,
                settings.predictor_tokens,
            );
        }
        let tap = Arc::new(tap);
        let cpu = CpuBackend::with_kernels(settings.threads, kernels::best())?;
        let engine = Engine::new(cpu, spec.clone(), &weights)?.with_activation_tap(tap.clone());
        // Every weight's values, for the predictors' share of the model.
        let model_parameters: u64 = weights
            .tensors()
            .iter()
            .map(|t| (t.rows * t.cols) as u64)
            .sum();
        drop(weights);
        Ok(SparsityProfiler {
            spec,
            engine,
            tap,
            model_parameters,
            settings,
        })
    }

    /// Both passes over `tokens` in windows of `window` (each a fresh context); `progress` hears
    /// (windows done, windows in all).
    pub fn passes(
        &self,
        tokens: &[u32],
        window: usize,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<ProfilePasses> {
        let t0 = Instant::now();
        let (thresholds, measured, frequency) =
            profile_passes(&self.engine, &self.tap, tokens, window, progress)?;
        Ok(ProfilePasses {
            thresholds,
            measured,
            frequency,
            tokens: tokens.len(),
            window,
            t0,
        })
    }

    /// Train the predictors, and save the profile of `passes` (on `corpus`) in `store`.
    pub fn finish(
        self,
        passes: ProfilePasses,
        store: &Store,
        corpus: String,
    ) -> Result<ProfileRun> {
        let spec = &self.spec;
        let t_train = Instant::now();
        let trained = self.tap.train_predictors(TrainOptions {
            rank: self.settings.predictor_rank,
            ..Default::default()
        });
        let train_s = t_train.elapsed().as_secs_f64();
        let (predictors, predictor_quality): (Vec<_>, Vec<_>) = trained.into_iter().unzip();
        let params: usize = predictors.iter().map(|p: &Predictor| p.parameters()).sum();
        let profile = SparsityProfile {
            model_id: store.manifest.model_id.clone(),
            corpus,
            tokens: passes.tokens,
            window: passes.window,
            n_layers: spec.n_layers,
            d_ff: spec.d_ff,
            thresholds: passes.thresholds,
            measured: passes.measured,
            frequency: passes.frequency,
            predictor_target: (!predictors.is_empty()).then_some(self.settings.predictor_target),
            predictors,
            predictor_quality,
            unit_reuse: None,
        };
        profile.save(store.dir())?;
        let secs = passes.t0.elapsed().as_secs_f64();
        Ok(ProfileRun {
            profile,
            seconds: secs,
            predictor_parameters: params,
            model_parameters: self.model_parameters,
            train_seconds: train_s,
        })
    }
}

/// How skewed each layer is at grid target `k`: the share of its neurons holding 80% of the
/// activations.
pub fn hot_shares(profile: &SparsityProfile, k: usize) -> Vec<f64> {
    let d_ff = profile.d_ff;
    (0..profile.n_layers)
        .map(|l| {
            let mut f = profile.frequencies(l, k);
            f.sort_by(|a, b| b.total_cmp(a));
            let total: f64 = f.iter().sum();
            let mut acc = 0.0;
            let hot = f
                .iter()
                .take_while(|&&v| {
                    acc += v;
                    acc - v < 0.8 * total
                })
                .count();
            hot as f64 / d_ff as f64
        })
        .collect()
}

/// A mixture-of-experts model's routing on `tokens` (`profile` on such a model): the CPU engine
/// over its dense weights, windows of `window` tokens each a fresh context, every layer's routes
/// recorded; the profile saved in `store`. `progress` hears (windows done, windows in all).
pub fn profile_routing(
    spec: &ModelSpec,
    weights: ModelWeights,
    store: &Store,
    (tokens, window, corpus): (&[u32], usize, &str),
    threads: usize,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<crate::sparsity::routing::RoutingProfile> {
    use crate::sparsity::routing::{RouteTrace, RoutingProfile};
    let moe = spec
        .moe
        .as_ref()
        .ok_or_else(|| anyhow::anyhow!("a routing profile of a model without experts"))?;
    let tap = Arc::new(RouteTrace::new(spec.n_layers));
    let cpu = CpuBackend::with_kernels(threads, kernels::best())?;
    let engine = Engine::new(cpu, spec.clone(), &weights)?.with_route_tap(tap.clone());
    drop(weights);
    let windows: Vec<&[u32]> = tokens.chunks(window.max(1)).collect();
    for (i, w) in windows.iter().enumerate() {
        let mut s = engine.new_session(w.len())?;
        engine.forward(&mut s, w, crate::engine::Logits::Last)?;
        progress(i + 1, windows.len());
    }
    let trace = tap.take();
    let mut profile = RoutingProfile::of(&store.manifest.model_id, corpus, moe.experts, &trace);
    // Units and static hot experts on held-out routing: each layer's experts ranked on the
    // first half of the trace, the second half replayed.
    profile.atu = trace
        .iter()
        .map(|sets| {
            let (calib, eval) = sets.split_at(sets.len() / 2);
            crate::tier::atu::atu_curve(calib, eval, moe.experts)
        })
        .collect();
    profile.save(store.dir())?;
    Ok(profile)
}

/// The recall of the predictors in `store`'s profile (`name` in errors) on `prompt` and the
/// `continuation` tokens a CPU engine over the model loaded whole decodes greedily after it:
/// each layer's true active set (the threshold's mask at their target) beside what its
/// predictor names, counted by a [`RecallTap`](crate::sparsity::recall::RecallTap).
pub fn measure_recall(
    model: &std::path::Path,
    store: &Store,
    name: &str,
    prompt: &[u32],
    continuation: usize,
    threads: usize,
) -> Result<crate::sparsity::recall::Recall> {
    use crate::engine::{Logits, sampler::argmax};
    use crate::sparsity::recall::RecallTap;
    let profile = SparsityProfile::load(store.dir(), &store.manifest.model_id, name)?;
    let target = profile.predictor_target_of(name)?;
    let thresholds = profile.thresholds_for(target)?;
    let m = super::store::model_for(model, store)?;
    let tap = Arc::new(RecallTap::new(profile.predictors, thresholds, m.spec.d_ff));
    let cpu = CpuBackend::with_kernels(threads, kernels::best())?;
    let engine = Engine::new(cpu, m.spec.clone(), &m.weights)?.with_activation_tap(tap.clone());
    let mut session = engine.new_session(prompt.len() + continuation)?;
    let mut logits = engine.forward(&mut session, prompt, Logits::Last)?;
    for _ in 0..continuation {
        let next = argmax(&logits);
        logits = engine.forward(&mut session, &[next], Logits::Last)?;
    }
    Ok(tap.recall())
}
