//! Hybrid execution (`--cold cpu`): hot neurons on the budgeted device, cold ones on the CPU.
//! Whatever the placement, the logits are the streaming engine's (the same neurons, summed in
//! another order), the device holds exactly what the hybrid plan counts, and the CPU examines
//! exactly the cold neurons.

mod common;

use std::sync::Arc;

use gpu_offload::backend::KvType;
use gpu_offload::backend::cpu::{CpuBackend, kernels};
use gpu_offload::backend::sim::SimBackend;
use gpu_offload::engine::{Engine, Logits, NeuronPredictor, backend_act};
use gpu_offload::footprint::Ledger;
use gpu_offload::plan::choice::{Cold, plan_cold};
use gpu_offload::plan::hybrid::{HybridPlan, LayerRuns, plan_hot_streamed, plan_hybrid_with};
use gpu_offload::plan::{Budget, HardwareProfile, Plan, make_plan};
use gpu_offload::store::Store;
use gpu_offload::tier::cold::ColdTraffic;
use gpu_offload::tier::hybrid::HybridWeights;
use gpu_offload::tier::stream::StreamWeights;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use common::prefill_and_decode_logits as logits;
use common::random_profile;
use common::{close, plan_for, store_of, streaming};

/// The hybrid engine, its device ledger budgeted at exactly what `hot` counts.
fn hybrid(
    store: &Arc<Store>,
    plan: &Plan,
    hot: &HybridPlan,
    thresholds: &[f32],
) -> (Engine<SimBackend>, Arc<Ledger>, Arc<ColdTraffic>) {
    let ledger = Ledger::new(Some(hot.device.placed), None);
    hybrid_over(store, plan, hot, thresholds, ledger)
}

/// The hybrid engine over `ledger`.
fn hybrid_over(
    store: &Arc<Store>,
    plan: &Plan,
    hot: &HybridPlan,
    thresholds: &[f32],
    ledger: Arc<Ledger>,
) -> (Engine<SimBackend>, Arc<Ledger>, Arc<ColdTraffic>) {
    let sim = SimBackend::new(CpuBackend::new(2).unwrap(), ledger.clone());
    let spec = store.manifest.spec.clone();
    let src = HybridWeights::new(
        &sim,
        store.clone(),
        plan,
        hot,
        ledger.clone(),
        kernels::best(),
        backend_act(spec.activation),
    )
    .unwrap();
    let traffic = src.traffic();
    let e = Engine::with_source(sim, spec, Box::new(src))
        .unwrap()
        .with_prefill(plan.prefill)
        .unwrap()
        .with_kv_type(KvType::F16)
        .unwrap()
        .with_sparsity(thresholds.to_vec())
        .unwrap();
    (e, ledger, traffic)
}

/// A random hot set per layer in whole units of `unit`: none, all, or a random subset.
fn random_placement(
    rng: &mut StdRng,
    layers: usize,
    d_ff: usize,
    unit: usize,
    case: usize,
) -> Vec<Vec<u32>> {
    (0..layers)
        .map(|_| {
            let units = d_ff / unit;
            let take: Vec<usize> = match case {
                0 => Vec::new(),
                1 => (0..units).collect(),
                _ => (0..units).filter(|_| rng.random_bool(0.4)).collect(),
            };
            take.iter()
                .flat_map(|&u| (u * unit) as u32..((u + 1) * unit) as u32)
                .collect()
        })
        .collect()
}

/// Bundled FFNs (stories260K SwiGLU, the ReGLU fixture, OPT's two-part ReLU bundles with an up
/// bias): random placements and thresholds give the streaming engine's logits; the ledger
/// peaks at exactly the hybrid plan's bytes; the CPU examines every cold neuron once per token
/// and layer (no predictor).
#[test]
fn hybrid_equals_streaming_for_random_placements() {
    let models = common::bundled_models();
    let mut rng = StdRng::seed_from_u64(5);
    for model in models {
        let dir = tempfile::tempdir().unwrap();
        let store = store_of(&model, &dir);
        let spec = store.manifest.spec.clone();
        let toks: Vec<u32> = (0..10)
            .map(|i| (i * 13 + 5) % spec.vocab_size as u32)
            .collect();
        let plan = plan_for(&store, toks.len());
        for case in 0..4 {
            let thresholds: Vec<f32> = if case == 3 {
                (0..spec.n_layers)
                    .map(|_| [0.0, 0.01, 0.05][rng.random_range(0..3)])
                    .collect()
            } else {
                Vec::new()
            };
            let hot_ids = random_placement(&mut rng, spec.n_layers, spec.d_ff, 1, case);
            let cold: u64 = hot_ids.iter().map(|h| (spec.d_ff - h.len()) as u64).sum();
            let hot = plan_hybrid_with(&store.manifest, &plan, hot_ids, None, 0.5).unwrap();
            // The per-layer figures `plan` prints add up to its totals, and name each layer's
            // choice by its neurons.
            let layer_cpu: u64 = hot.layers.iter().map(|l| l.cpu_bytes).sum();
            assert_eq!(layer_cpu, hot.per_token.cpu_bytes);
            for (l, ids) in hot.layers.iter().zip(&hot.hot_neurons) {
                let want_runs = match ids.len() {
                    0 => LayerRuns::Cpu,
                    n if n == spec.d_ff => LayerRuns::Gpu,
                    _ => LayerRuns::Hybrid,
                };
                assert_eq!((l.runs, l.neurons), (want_runs, ids.len()));
                assert_eq!(l.cpu_bytes == 0, want_runs == LayerRuns::Gpu);
            }
            let want = logits(&streaming(&store, &plan, &thresholds), &toks);
            let (e, ledger, traffic) = hybrid(&store, &plan, &hot, &thresholds);
            let waits_at_load = ledger.snapshot().host_waits;
            let got = logits(&e, &toks);
            let what = format!("{} placement {case}", model.display());
            close(&got, &want, &what);
            assert_eq!(ledger.snapshot().hbm_peak, hot.device.placed, "{what}");
            // The per-layer graph waits on the host once per layer (the FFN input's landing),
            // plus once per step for the logits: the partial sums go back without a wait.
            assert_eq!(
                ledger.snapshot().host_waits - waits_at_load,
                5 * (spec.n_layers as u64 + 1),
                "{what}: host waits over 5 steps"
            );
            // One prefill step and 4 decode steps: each examines every cold neuron of every
            // layer once (the prefill's tokens share the read).
            let [bytes, candidates, active, _] = traffic.snapshot();
            assert_eq!(candidates, 5 * cold, "{what}");
            assert!(active <= candidates);
            let cost = &hot.cold_cost[0];
            assert_eq!(
                bytes,
                cost.bytes(candidates, active, 0),
                "{what}: bundles read the deciding part of each candidate and the rest of each active neuron"
            );
        }
    }
}

/// A ReLU model skips cold neurons whose activation is zero for every token of a step, and a
/// predictor's flags narrow what the CPU examines.
#[test]
fn cold_neurons_skip_what_the_mask_and_predictor_leave_out() {
    struct EveryOther(usize);
    impl NeuronPredictor for EveryOther {
        fn active(&self, _layer: usize, _input: &[f32], n: usize) -> Vec<bool> {
            (0..n * self.0)
                .map(|i| (i % self.0).is_multiple_of(2))
                .collect()
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let store = store_of(&common::fixtures().join("hf/relu-llama"), &dir);
    let spec = store.manifest.spec.clone();
    let toks: Vec<u32> = (0..8).map(|i| (i * 7 + 3) % 200).collect();
    let plan = plan_for(&store, toks.len());
    let none = vec![Vec::new(); spec.n_layers];
    let hot = plan_hybrid_with(&store.manifest, &plan, none, None, 0.5).unwrap();
    let zeros = vec![0.0; spec.n_layers];
    let want = logits(&streaming(&store, &plan, &zeros), &toks);
    let (e, _, traffic) = hybrid(&store, &plan, &hot, &zeros);
    close(&logits(&e, &toks), &want, "ReLU, all cold");
    let [_, candidates, active, _] = traffic.snapshot();
    assert!(
        active < candidates,
        "ReLU zeros are skipped: {active} of {candidates}"
    );

    let (e, _, traffic) = hybrid(&store, &plan, &hot, &[]);
    let e = e.with_predictor(Some(Arc::new(EveryOther(spec.d_ff))));
    let stream =
        streaming(&store, &plan, &[]).with_predictor(Some(Arc::new(EveryOther(spec.d_ff))));
    close(&logits(&e, &toks), &logits(&stream, &toks), "predicted");
    let [_, candidates, _, _] = traffic.snapshot();
    assert_eq!(candidates, 5 * (spec.n_layers * spec.d_ff / 2) as u64);

    // With hot neurons too: the device computes only the listed hot neurons (the listed bundle
    // kernels), the CPU the listed cold ones; the logits are still the streaming engine's.
    let mut rng = StdRng::seed_from_u64(3);
    let hot_ids = random_placement(&mut rng, spec.n_layers, spec.d_ff, 1, 2);
    let hot = plan_hybrid_with(&store.manifest, &plan, hot_ids, None, 0.5).unwrap();
    let (e, ledger, _) = hybrid(&store, &plan, &hot, &[]);
    let e = e.with_predictor(Some(Arc::new(EveryOther(spec.d_ff))));
    close(
        &logits(&e, &toks),
        &logits(&stream, &toks),
        "predicted, hot and cold",
    );
    assert_eq!(ledger.snapshot().hbm_peak, hot.device.placed);
}

/// The largest |difference| between logit rows, and the row-wise argmax agreement.
fn argmax_rows(v: &[f32], vocab: usize) -> Vec<usize> {
    v.chunks(vocab)
        .map(|r| {
            r.iter()
                .enumerate()
                .fold((0, f32::MIN), |b, (i, &x)| if x > b.1 { (i, x) } else { b })
                .0
        })
        .collect()
}

/// Each row's greedy token of `got` is `want`'s wherever `want`'s choice is clear (its top two
/// more than `clear` of the logit range apart), and elsewhere one `want` scores within `clear`
/// of its best: a near-tie may fall either way when the two paths round differently.
fn greedy_agrees(got: &[f32], want: &[f32], vocab: usize, clear: f32, what: &str) {
    for (r, ((g, w), (gi, wi))) in got
        .chunks(vocab)
        .zip(want.chunks(vocab))
        .zip(
            argmax_rows(got, vocab)
                .into_iter()
                .zip(argmax_rows(want, vocab)),
        )
        .enumerate()
    {
        let range = w.iter().fold(0f32, |m, v| m.max(v.abs())) * clear;
        let second = w
            .iter()
            .enumerate()
            .filter(|&(i, _)| i != wi)
            .fold(f32::MIN, |m, (_, &v)| m.max(v));
        if w[wi] - second > range {
            assert_eq!(gi, wi, "{what}, row {r}: greedy token (clear choice)");
        } else {
            assert!(
                w[gi] >= w[wi] - range,
                "{what}, row {r}: greedy {gi} scored {} by the reference, its best {} ({wi}); g {}",
                w[gi],
                w[wi],
                g[gi]
            );
        }
    }
}

/// A block-quantized FFN (SmolLM2, Q4_1 matrices) places whole down blocks: at random block
/// placements the greedy tokens are the streaming engine's wherever its choice is clear (a
/// near-tie may fall either way) and the logits stay within 5%.
/// (Each layer's FFN output equals the streaming one to ~1e-7 relative — hot and cold blocks
/// summed apart, `tier::hybrid`'s unit test checks one layer to 1e-5 — but every matrix product
/// rounds its input to 8-bit blocks, and a value on a rounding edge moves by a whole step:
/// measured 0.7–2% of the logit range.) The ledger peaks at the plan's bytes; the CPU reads
/// every cold block once per step; a placement splitting a block is refused.
#[test]
fn hybrid_matrices_place_whole_blocks() {
    let Some(path) = common::smollm2() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let store = store_of(&path, &dir);
    let spec = store.manifest.spec.clone();
    let toks: Vec<u32> = (0..8).map(|i| (i * 101 + 7) % 40000).collect();
    let plan = plan_for(&store, toks.len());
    let mut rng = StdRng::seed_from_u64(9);
    let stream = streaming(&store, &plan, &[]);
    let want = logits(&stream, &toks);
    let first = |e: &Engine<SimBackend>| {
        let mut s = e.new_session(4).unwrap();
        e.forward(&mut s, &toks[..1], Logits::Last).unwrap()
    };
    let want_first = first(&stream);
    for case in [0, 2, 2] {
        let hot_ids = random_placement(&mut rng, spec.n_layers, spec.d_ff, 32, case);
        let hot = plan_hybrid_with(&store.manifest, &plan, hot_ids, None, 0.5).unwrap();
        let (e, ledger, traffic) = hybrid(&store, &plan, &hot, &[]);
        let what = format!("SmolLM2 placement {case}");
        // (The whole run first: the ledger holds exactly the plan, made for its session.)
        let got = logits(&e, &toks);
        let got_first = first(&e);
        for (got, want) in [(&got, &want), (&got_first, &want_first)] {
            greedy_agrees(got, want, spec.vocab_size, 0.02, &what);
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            let worst = got
                .iter()
                .zip(want.iter())
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(worst <= 0.05 * scale, "{what}: {worst} of {scale}");
        }
        assert_eq!(ledger.snapshot().hbm_peak, hot.device.placed);
        let [bytes, candidates, active, units] = traffic.snapshot();
        assert_eq!(
            candidates, active,
            "SiLU without a mask computes every cold neuron"
        );
        let cold_units: u64 = hot
            .hot_neurons
            .iter()
            .map(|h| ((spec.d_ff - h.len()) / 32) as u64)
            .sum();
        // 6 steps (a prefill, 4 decodes, the first-token run): every cold block (all d_model
        // rows of it) once per step.
        assert_eq!(units, 6 * cold_units, "{what}");
        assert_eq!(
            bytes,
            hot.cold_cost[0].bytes(candidates, active, units),
            "{what}"
        );
    }
    let mut split = vec![Vec::new(); spec.n_layers];
    split[0] = (0..16).collect();
    let e = plan_hybrid_with(&store.manifest, &plan, split, None, 0.5).unwrap_err();
    assert!(e.to_string().contains("whole blocks of 32"), "{e}");
}

/// The CPU+PCIe split (`--cold split`, bundled FFNs): at random budgets that stream, the plan
/// has the CPU compute the last FFN neurons of every layer; the logits are the dense engine's,
/// the device holds what the plan counts, nothing more, the copies carry only the streamed
/// rows, and the CPU examines exactly its neurons once per step.
#[test]
fn cpu_pcie_split_equals_streaming() {
    let dir = tempfile::tempdir().unwrap();
    let store = store_of(&common::stories260k(), &dir);
    let spec = store.manifest.spec.clone();
    let toks: Vec<u32> = (0..10).map(|i| (i * 13 + 5) % 500).collect();
    let hw = HardwareProfile::load("cpu-sim").unwrap();
    let budget = |g, split| Budget {
        cpu_split: split,
        ..Budget::new(g, None, 2, toks.len() + 4, toks.len())
    };
    let (min, all) = common::gpu_range(&store.manifest, &hw, |g| budget(g, true));
    let want = logits(
        &streaming(&store, &plan_for(&store, toks.len()), &[]),
        &toks,
    );
    let mut rng = StdRng::seed_from_u64(21);
    let mut split_seen = false;
    for _ in 0..4 {
        let g = rng.random_range(min..all);
        let plan = make_plan(&store.manifest, &budget(g, true), &hw).unwrap();
        let c = plan.residency.cpu_rows;
        split_seen |= c > 0;
        let ledger = Ledger::new(Some(plan.ledger_budget()), None);
        let sim = SimBackend::new(CpuBackend::new(2).unwrap(), ledger.clone());
        let src = StreamWeights::new(&sim, store.clone(), &plan, ledger.clone()).unwrap();
        let traffic = src.cpu_traffic();
        assert_eq!(traffic.is_some(), c > 0);
        let e = Engine::with_source(sim, spec.clone(), Box::new(src))
            .unwrap()
            .with_prefill(plan.prefill)
            .unwrap()
            .with_kv_type(KvType::F16)
            .unwrap();
        let got = logits(&e, &toks);
        close(
            &got,
            &want,
            &format!("split at {g} bytes ({c} CPU neurons)"),
        );
        let snap = ledger.snapshot();
        assert_eq!(snap.hbm_peak, plan.gpu.placed, "{g}");
        if let Some(t) = traffic {
            let [bytes, candidates, active, _] = t.snapshot();
            assert_eq!(candidates, 5 * (spec.n_layers * c) as u64);
            assert_eq!(active, candidates, "SiLU without a mask computes them all");
            // Per decoded token: the plan's CPU bytes of the FFN (the plan's CPU reads also
            // count the host-kept KV cache where decode attends on the CPU).
            let attention = if plan.prefill.cpu_attention {
                gpu_offload::footprint::kv_bytes(&spec, plan.budget.ctx, plan.budget.kv_type) / 2
            } else {
                0
            };
            assert_eq!(bytes / 5, plan.per_token.cpu_read_bytes - attention, "{g}");
        }
    }
    assert!(split_seen, "some budget between {min} and {all} splits");
}

/// Hybrid with streamed attention (`--cold cpu` where the budget cannot hold every layer's
/// attention), for bundled (stories260K) and block-quantized (SmolLM2) FFNs: the streaming
/// source runs the hot blocks beside attention streamed through its slots, the CPU the other
/// neurons; the answers are streaming's and the device holds exactly what the plan counts.
#[test]
fn hybrid_streams_attention_beside_hot_blocks() {
    let mut rng = StdRng::seed_from_u64(13);
    let hw = HardwareProfile::load("cpu-sim").unwrap();
    let mut models = vec![(common::stories260k(), [300 << 10, 340 << 10])];
    if let Some(smol) = common::smollm2() {
        models.push((smol, [40 << 20, 44 << 20]));
    }
    for (model, budgets) in models {
        let dir = tempfile::tempdir().unwrap();
        let store = store_of(&model, &dir);
        let spec = store.manifest.spec.clone();
        let toks: Vec<u32> = (0..8)
            .map(|i| (i * 101 + 7) % spec.vocab_size as u32)
            .collect();
        let profile = random_profile(&store, &mut rng);
        let want = logits(
            &streaming(&store, &plan_for(&store, toks.len()), &[]),
            &toks,
        );
        for g in budgets {
            let what = format!("{} at {g} bytes", model.display());
            let mut budget = Budget::new(g, None, 2, toks.len() + 4, toks.len());
            budget.batch = toks.len();
            let chosen = plan_cold(
                &store.manifest,
                &budget,
                &hw,
                Cold::Cpu,
                Some((&profile, 0.5)),
                &[gpu_offload::plan::precision::Precision::FP16],
            )
            .unwrap_or_else(|e| panic!("{what}: {e}"));
            let hot = chosen.hot.expect("a hybrid plan");
            assert!(
                hot.base_plan.is_some() && chosen.plan.residency.ffn_off,
                "{what}: attention streams"
            );
            assert!(
                hot.per_token.pcie_bytes > chosen.plan.per_token.d2h_bytes,
                "{what}"
            );
            let ledger = Ledger::new(Some(hot.device.placed), None);
            let sim = SimBackend::new(CpuBackend::new(2).unwrap(), ledger.clone());
            let src = StreamWeights::with_cpu_kernels(
                &sim,
                store.clone(),
                &chosen.plan,
                ledger.clone(),
                kernels::best(),
                Some(&hot),
            )
            .unwrap_or_else(|e| panic!("{what}: {e}"));
            let traffic = src.cpu_traffic().expect("the CPU's neurons");
            let e = Engine::with_source(sim, spec.clone(), Box::new(src))
                .unwrap()
                .with_prefill(chosen.plan.prefill)
                .unwrap()
                .with_kv_type(KvType::F16)
                .unwrap();
            let got = logits(&e, &toks);
            assert_eq!(
                argmax_rows(&got, spec.vocab_size),
                argmax_rows(&want, spec.vocab_size),
                "{what}"
            );
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            let worst = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(worst <= 1e-3 * scale.max(1.0), "{what}: {worst} of {scale}");
            assert_eq!(ledger.snapshot().hbm_peak, hot.device.placed, "{what}");
            let placed: usize = hot.layers.iter().map(|l| l.neurons).sum();
            // 5 steps, each examining every cold neuron once.
            let [_, candidates, _, _] = traffic.snapshot();
            let cold = (spec.n_layers * spec.d_ff - placed) as u64;
            assert_eq!(candidates, 5 * cold, "{what}");
            eprintln!(
                "{what}: {placed} hot neurons, {} attention bytes streamed per token, max |diff| {worst} of {scale}",
                chosen.plan.per_token.h2d_bytes
            );
        }
    }
}

/// A predictor whose flags differ from token to token: neuron `i` is computed for a row whose
/// input at `i mod d_model` is not negative.
struct BySign {
    d_model: usize,
    d_ff: usize,
}

impl NeuronPredictor for BySign {
    fn active(&self, _layer: usize, input: &[f32], n: usize) -> Vec<bool> {
        (0..n * self.d_ff)
            .map(|k| {
                let (t, i) = (k / self.d_ff, k % self.d_ff);
                input[t * self.d_model + i % self.d_model] >= 0.0
            })
            .collect()
    }
}

/// Continuous batching through hybrid execution: every session's logits in a batched decode
/// step are the ones it gets alone, bit for bit, while the mask and a predictor leave each
/// token its own neurons — bundles (ReLU) and block-quantized matrices (SmolLM2 Q4_1, whose
/// cold down blocks are skipped per token).
#[test]
fn batched_hybrid_decode_equals_each_session_alone() {
    let sessions = 5;
    // (Model, placement unit, mask threshold: high enough that SmolLM2's tokens leave whole
    // blocks of 32 neurons of their own inactive.)
    let mut models = vec![(common::fixtures().join("hf/relu-llama"), 1, 0.02)];
    models.extend(common::smollm2().map(|p| (p, 32, 0.4)));
    let hw = HardwareProfile::load("cpu-sim").unwrap();
    let mut rng = StdRng::seed_from_u64(11);
    for (model, unit, threshold) in models {
        let dir = tempfile::tempdir().unwrap();
        let store = store_of(&model, &dir);
        let spec = store.manifest.spec.clone();
        let budget = Budget {
            sessions,
            logit_rows: sessions,
            ..Budget::new(u64::MAX / 4, None, 2, 64, 16)
        };
        let plan = make_plan(&store.manifest, &budget, &hw).unwrap();
        let hot_ids = random_placement(&mut rng, spec.n_layers, spec.d_ff, unit, 2);
        let hot = plan_hybrid_with(&store.manifest, &plan, hot_ids, None, 0.5).unwrap();
        let thresholds = vec![threshold; spec.n_layers];
        let prompts = common::varied_prompts(spec.vocab_size, sessions, 3, 4);
        for predicted in [false, true] {
            // (Unbudgeted: sessions come and go between the runs; this is about the sums.)
            let ledger = Ledger::new(None, None);
            let (e, _, _) = hybrid_over(&store, &plan, &hot, &thresholds, ledger);
            let e = if predicted {
                e.with_predictor(Some(Arc::new(BySign {
                    d_model: spec.d_model,
                    d_ff: spec.d_ff,
                })))
            } else {
                e
            };
            let want = common::decode_alone(&e, &prompts, 3, false);
            let got = common::decode_batched(&e, &prompts, 3, false);
            for (i, (w, g)) in want.iter().zip(&got).enumerate() {
                assert!(
                    w == g,
                    "{}, predictor {predicted}: session {i}'s logits differ when batched",
                    model.display()
                );
            }
        }
    }
}

/// A measured read-start cost (`cpu_read_start_s`, what `doctor` and a start's rates measure)
/// prices each read of the CPU's cold pass: the same placement costs each layer's CPU exactly
/// that much more per read, where a layer's reads are, per cold neuron left on, its up and
/// down rows (gated float bundles, taken apart: the gates are one run); bytes and reads are
/// the same either way, and the plan's decode prediction falls.
#[test]
fn the_cpus_cold_pass_pays_each_reads_start() {
    let dir = tempfile::tempdir().unwrap();
    let store = store_of(&common::stories260k(), &dir);
    let spec = store.manifest.spec.clone();
    assert!(spec.gated_ffn);
    let plan = plan_for(&store, 4);
    assert!(
        plan.hardware.cpu_read_start_s.is_none(),
        "the preset measures none"
    );
    let start = 1e-6;
    let mut priced = plan.clone();
    priced.hardware.cpu_read_start_s = Some(start);
    let hot_n = spec.d_ff / 4;
    let hot: Vec<Vec<u32>> = vec![(0..hot_n as u32).collect(); spec.n_layers];
    let free = plan_hybrid_with(&store.manifest, &plan, hot.clone(), None, 0.5).unwrap();
    let paid = plan_hybrid_with(&store.manifest, &priced, hot, None, 0.5).unwrap();
    assert_eq!(free.per_token, paid.per_token);
    assert_eq!(paid.sequences, 1, "a decode step of one sequence");
    // No profile: every neuron on half the time. Gated float bundles are taken apart on the
    // CPU: the gates one run, an up and a down row per neuron on.
    let cold = (spec.d_ff - hot_n) as f64;
    let reads = 2.0 * 0.5 * cold;
    for (l, (a, b)) in free.layers.iter().zip(&paid.layers).enumerate() {
        assert_eq!(b.cpu_reads, reads, "layer {l}");
        let extra = b.cpu_s - a.cpu_s;
        assert!(
            (extra - start * reads).abs() <= 1e-9 * extra,
            "layer {l}: {extra} s more for {reads} reads"
        );
    }
    assert_eq!(paid.per_token.cpu_reads, reads * spec.n_layers as f64);
    assert!(paid.predicted_tokens_per_s < free.predicted_tokens_per_s);
    // The budgeted device's kernels run on the CPU: a split layer's shares take turns there
    // (their sum), where a GPU's run beside the CPU's (the longer).
    assert!(plan.hardware.copies_share_memory);
    let mut gpu = plan.clone();
    gpu.hardware.copies_share_memory = false;
    let beside = plan_hybrid_with(
        &store.manifest,
        &gpu,
        vec![(0..hot_n as u32).collect(); spec.n_layers],
        None,
        0.5,
    )
    .unwrap();
    let turns: f64 = free.layers.iter().map(|l| l.gpu_s.min(l.cpu_s)).sum();
    assert!(turns > 0.0);
    let gained = 1.0 / free.predicted_tokens_per_s - 1.0 / beside.predicted_tokens_per_s;
    assert!(
        (gained - turns).abs() <= 1e-9 * turns,
        "{gained} s a token beside, {turns} s the shorter shares"
    );
    // A cost that is not a time is refused.
    for bad in [-1e-9, f64::NAN, f64::INFINITY] {
        priced.hardware.cpu_read_start_s = Some(bad);
        assert!(priced.hardware.validate().is_err(), "{bad}");
    }
}

/// On the budgeted device the split's copies, device reads and CPU rows take turns (one CPU
/// runs them all: SmolLM2's split at 48M spent 4.3, 4.7 and 6.1 ms of a 15.2 ms step on them),
/// so its decode prediction is their sum; on a GPU with two streaming slots, the longest.
#[test]
fn the_budgeted_devices_split_takes_turns() {
    let dir = tempfile::tempdir().unwrap();
    let store = store_of(&common::stories260k(), &dir);
    let hw = HardwareProfile::load("cpu-sim").unwrap();
    let budget = |g| Budget {
        cpu_split: true,
        ..Budget::new(g, None, 2, 14, 10)
    };
    let (min, all) = common::gpu_range(&store.manifest, &hw, budget);
    // A budget where the CPU takes rows, beside `window` streaming slots.
    let split = |hw: &HardwareProfile, window: usize| {
        (0..16)
            .map(|i| min + (all - min) * i / 16)
            .map(|g| make_plan(&store.manifest, &budget(g), hw).unwrap())
            .find(|p| p.residency.cpu_rows > 0 && p.window == window)
            .expect("a budget where the CPU takes rows")
    };
    let plan = split(&hw, 1);
    let p = &plan.prediction;
    assert!(p.cpu_s > 0.0 && p.pcie_s > 0.0, "{p:?}");
    let device = p.hbm_s.max(p.step.compute_s);
    let rows = p.step.sequences as f64;
    let want = p.pcie_s + device + p.cpu_s;
    let got = rows / p.tokens_per_s - p.ops_s;
    assert!((got - want).abs() <= 1e-9 * want, "{got} s, want {want}");
    assert_eq!(p.limited_by, "PCIe+HBM+CPU");
    let gpu = HardwareProfile {
        copies_share_memory: false,
        ..hw.clone()
    };
    // Two slots: copies run ahead beside the compute (one would make them take turns, as
    // `one_streaming_slot_prices_copies_and_compute_in_turn` shows).
    let beside = split(&gpu, 2).prediction;
    let longest = [
        beside.pcie_s,
        beside.hbm_s.max(beside.step.compute_s) + beside.cpu_s,
    ]
    .into_iter()
    .fold(0.0, f64::max);
    let got = beside.step.sequences as f64 / beside.tokens_per_s - beside.ops_s;
    assert!(
        (got - longest).abs() <= 1e-9 * longest,
        "{got} s, want {longest}"
    );
}

/// Hybrid beside streamed attention: on the budgeted device the copies of attention take turns
/// with the step's compute (one CPU runs both: SmolLM2 at 48M predicted 98 tok/s where 78–82
/// ran), on a GPU they come in beside it; and the planner may keep no hot neuron at all, every
/// byte of the room for attention (there the fastest measured: 90–93 tok/s).
#[test]
fn hybrid_beside_streamed_attention_pays_its_copies_in_turn_on_the_budgeted_device() {
    let mut rng = StdRng::seed_from_u64(21);
    let dir = tempfile::tempdir().unwrap();
    let store = store_of(&common::stories260k(), &dir);
    let spec = store.manifest.spec.clone();
    let profile = random_profile(&store, &mut rng);
    let sim = HardwareProfile::load("cpu-sim").unwrap();
    assert!(sim.copies_share_memory);
    let gpu = HardwareProfile {
        copies_share_memory: false,
        ..sim.clone()
    };
    let budget = Budget::new(300 << 10, None, 1, 12, 8);
    let plan = |hw: &HardwareProfile, reserve: u64| {
        plan_hot_streamed(&store.manifest, &budget, hw, &profile, 0.5, reserve).unwrap()
    };
    for reserve in [0, 40 << 10] {
        let (turns, beside) = (plan(&sim, reserve), plan(&gpu, reserve));
        assert_eq!(
            turns.per_token, beside.per_token,
            "the same bytes either way"
        );
        assert_eq!(turns.sequences, 1);
        let base = turns.base_plan.as_deref().expect("attention streams");
        // What the slots bring a token (as the plan counts it): its input row aside.
        let copies = (base.per_token.h2d_bytes - spec.d_model as u64 * 4) as f64
            / sim.h2d_pinned_bytes_per_s;
        assert!(copies > 0.0, "attention streams at {reserve}");
        let (s_turns, s_beside) = (
            1.0 / turns.predicted_tokens_per_s,
            1.0 / beside.predicted_tokens_per_s,
        );
        // In turn the step pays the copies on top (and each layer's device and CPU shares,
        // where hot neurons split it); beside, only where they outlast the compute.
        let paid = s_turns - s_beside;
        assert!(
            paid >= 0.99 * copies,
            "reserve {reserve}: {paid} s more in turn, the copies take {copies} s"
        );
        if reserve == 0 {
            assert!(
                turns.hot_neurons.iter().all(Vec::is_empty),
                "no room, no hot neuron"
            );
            // No layer split: nothing else takes turns.
            assert!(
                paid <= 1.05 * copies,
                "{paid} s more in turn, copies {copies} s"
            );
        }
    }
}
