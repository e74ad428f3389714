//! The GPU-centric sparse FFN (cache units, M2Cache): whatever the unit sizes and masks, the
//! logits are the streaming engine's (the same neurons, summed in another order); what crosses
//! to the device per step is exactly the neurons the units lacked, and nothing else.

mod common;

use gpu_offload::backend::KvType;
use gpu_offload::backend::cpu::{CpuBackend, kernels};
use gpu_offload::backend::sim::SimBackend;
use gpu_offload::engine::{Engine, backend_act};
use gpu_offload::footprint::Ledger;
use gpu_offload::plan::precision::Precision;
use gpu_offload::tier::units::UnitWeights;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use common::prefill_and_decode_logits as logits;
use common::{close, plan_for, store_of, streaming};

/// The cache-unit engine of `store` on the budgeted device over `ledger`: units of `slots`
/// per layer and precision tier, stale neurons kept by `score`; and what its units move.
fn units_engine(
    store: &std::sync::Arc<gpu_offload::store::Store>,
    plan: &gpu_offload::plan::Plan,
    slots: &[[usize; 3]],
    precision: Precision,
    score: Option<&[Vec<f32>]>,
    hybrid: Option<&gpu_offload::plan::units::HybridLayers>,
    ledger: std::sync::Arc<Ledger>,
) -> gpu_offload::engine::Result<(
    Engine<SimBackend>,
    std::sync::Arc<gpu_offload::tier::units::UnitTraffic>,
)> {
    let spec = store.manifest.spec.clone();
    let sim = SimBackend::new(CpuBackend::new(2).unwrap(), ledger.clone());
    let src = UnitWeights::new(
        &sim,
        store.clone(),
        plan,
        slots,
        precision,
        score,
        hybrid,
        ledger,
        kernels::best(),
        backend_act(spec.activation),
    )?;
    let traffic = src.traffic();
    let e = Engine::with_source(sim, spec, Box::new(src))?
        .with_prefill(plan.prefill)?
        .with_kv_type(KvType::F16)?;
    Ok((e, traffic))
}

/// Bundled FFNs (stories260K SwiGLU, the ReGLU fixture, OPT's two-part ReLU bundles with an up
/// bias), random unit sizes (down to a few slots, so a step's active set comes in rounds) and
/// thresholds: the streaming engine's logits; the host→device bytes of the run are exactly the
/// units' loads (a bundle, plus its up bias where there is one, per neuron brought in) and what
/// is read in place where the neurons rest (a unit without an up bias lists the ones it does
/// not hold there: at least the deciding part of each, at most the whole bundle); a unit as
/// large as its layer loads each neuron at most once, and one without an up bias never evicts
/// (at most its slots are loaded).
#[test]
fn cache_units_equal_streaming_and_move_only_their_misses() {
    let models = common::bundled_models();
    let mut rng = StdRng::seed_from_u64(29);
    for model in models {
        let dir = tempfile::tempdir().unwrap();
        let store = store_of(&model, &dir);
        let spec = store.manifest.spec.clone();
        let toks: Vec<u32> = (0..10)
            .map(|i| (i * 13 + 5) % spec.vocab_size as u32)
            .collect();
        let plan = plan_for(&store, toks.len());
        let seg = store
            .manifest
            .segment(&gpu_offload::plan::part_segment_name(
                0,
                gpu_offload::plan::Part::Ffn,
            ))
            .unwrap();
        let biased = store.manifest.segment("blk.0.ffn_up.bias").is_some();
        let per_load = seg.row_bytes() as u64 + if biased { 4 } else { 0 };
        for case in 0..4 {
            let thresholds: Vec<f32> = if case == 0 {
                Vec::new()
            } else {
                (0..spec.n_layers)
                    .map(|_| [0.0, 0.01, 0.05][rng.random_range(0..3)])
                    .collect()
            };
            let slots: Vec<usize> = (0..spec.n_layers)
                .map(|_| match case {
                    3 => spec.d_ff,
                    _ => rng.random_range(1..=spec.d_ff),
                })
                .collect();
            let what = format!("{} case {case}, slots {slots:?}", model.display());
            let want = logits(&streaming(&store, &plan, &thresholds), &toks);
            let ledger = Ledger::new(None, None);
            let slots: Vec<[usize; 3]> = slots.iter().map(|&k| [k, 0, 0]).collect();
            let (e, traffic) = units_engine(
                &store,
                &plan,
                &slots,
                Precision::FP16,
                None,
                None,
                ledger.clone(),
            )
            .unwrap_or_else(|e| panic!("{what}: {e}"));
            let e = e.with_sparsity(thresholds.clone()).unwrap();
            let h2d_at_load = ledger.snapshot().h2d_bytes;
            let got = logits(&e, &toks);
            close(&got, &want, &what);
            let [needed, loads, bytes] = traffic.snapshot();
            let in_place = traffic.in_place();
            assert!(needed > 0 && loads <= needed, "{what}");
            assert_eq!(bytes, loads * per_load, "{what}");
            if biased {
                assert_eq!(in_place, 0, "{what}: an up bias goes by slot");
            } else {
                let held: usize = slots.iter().map(|k| k[0]).sum();
                assert!(
                    loads <= held as u64,
                    "{what}: a held neuron is never evicted"
                );
                assert!(
                    in_place > 0 || case == 3,
                    "{what}: some neurons read in place"
                );
            }
            // The embedding rows of the 14 tokens (looked up in DRAM) come in beside.
            let embeddings = 14 * spec.d_model as u64 * 4;
            let read = (ledger.snapshot().h2d_bytes - h2d_at_load)
                .checked_sub(bytes + embeddings)
                .unwrap_or_else(|| panic!("{what}: fewer host→device bytes than loads"));
            let (row, parts) = (seg.row_bytes() as u64, if spec.gated_ffn { 3 } else { 2 });
            assert!(
                (in_place * row / parts..=in_place * row).contains(&read),
                "{what}: {read} bytes read in place for {in_place} neurons of {row}"
            );
            if case == 3 {
                assert!(
                    loads <= (spec.n_layers * spec.d_ff) as u64,
                    "{what}: whole-layer units load each neuron once"
                );
            }
        }
    }
}

/// Planned cache units (`plan_units`, what `--cold gpu` runs) at random budgets: the device
/// holds exactly what the plan counts at its peak, the units never exceed their budget, and the
/// logits stay the streaming engine's, however small the units come out.
#[test]
fn planned_units_fill_the_budget_exactly() {
    use gpu_offload::plan::units::plan_units;
    use gpu_offload::plan::{Budget, HardwareProfile, make_plan};
    let hw = HardwareProfile::load("cpu-sim").unwrap();
    let mut rng = StdRng::seed_from_u64(31);
    for model in [common::stories260k(), common::fixtures().join("hf/opt")] {
        let dir = tempfile::tempdir().unwrap();
        let store = store_of(&model, &dir);
        let spec = store.manifest.spec.clone();
        let toks: Vec<u32> = (0..10)
            .map(|i| (i * 17 + 3) % spec.vocab_size as u32)
            .collect();
        let want = logits(
            &streaming(&store, &plan_for(&store, toks.len()), &[]),
            &toks,
        );
        let full = plan_units(
            &store.manifest,
            &plan_for(&store, toks.len()),
            None,
            0.5,
            Precision::FP16,
        )
        .unwrap();
        assert!(
            full.layers.iter().all(|l| l.slots == [spec.d_ff, 0, 0]),
            "all of every layer fits"
        );
        let rest = full.device.placed - full.device.units - full.device.staging;
        let mut tried = 0;
        for _ in 0..6 {
            let g = rest
                + ((full.device.units + full.device.staging) as f64 * rng.random_range(0.02..1.0))
                    as u64;
            let budget = Budget::new(g, None, 2, toks.len() + 4, toks.len());
            let Ok(plan) = make_plan(&store.manifest, &budget, &hw) else {
                continue;
            };
            let Ok(units) = plan_units(&store.manifest, &plan, None, 0.5, Precision::FP16) else {
                continue;
            };
            tried += 1;
            let what = format!(
                "{} at {g} bytes, slots {:?}",
                model.display(),
                units.slots()
            );
            assert!(units.device.total <= g, "{what}");
            let ledger = Ledger::new(Some(units.device.placed), None);
            let slots = units.slots();
            let (e, _) = units_engine(
                &store,
                &plan,
                &slots,
                Precision::FP16,
                Some(&units.scores),
                None,
                ledger.clone(),
            )
            .unwrap_or_else(|e| panic!("{what}: {e}"));
            let got = logits(&e, &toks);
            close(&got, &want, &what);
            assert_eq!(ledger.snapshot().hbm_peak, units.device.placed, "{what}");
        }
        assert!(tried >= 2, "{}: budgets too small to test", model.display());
    }
}

/// A unit that reads the neurons it does not hold in place lists them all in one pair of
/// kernels a layer, whatever its slot count (`Engine::held_neurons`), and the plan prices it
/// so: each microsecond more a launch costs adds 2 launches a layer to the predicted step,
/// beside the other ops' 16 a layer and 4 a step. (It priced a call per slot-count of
/// neurons: at SmolLM2's 48M, eleven a layer where the step makes one.)
#[test]
fn in_place_units_pay_one_pair_of_launches_a_layer() {
    use gpu_offload::plan::units::plan_units;
    use gpu_offload::plan::{Budget, HardwareProfile, make_plan};
    let dir = tempfile::tempdir().unwrap();
    let store = store_of(&common::stories260k(), &dir);
    let spec = store.manifest.spec.clone();
    let full = plan_units(
        &store.manifest,
        &plan_for(&store, 4),
        None,
        0.5,
        Precision::FP16,
    )
    .unwrap();
    let rest = full.device.placed - full.device.units - full.device.staging;
    let g = rest + (full.device.units + full.device.staging) / 10;
    let step = |overhead: f64| {
        let mut hw = HardwareProfile::load("cpu-sim").unwrap();
        hw.op_overhead_s = overhead;
        let plan = make_plan(&store.manifest, &Budget::new(g, None, 2, 8, 4), &hw).unwrap();
        let u = plan_units(&store.manifest, &plan, None, 0.5, Precision::FP16).unwrap();
        let k = u.slots()[0][0];
        assert!(
            k > 0 && 2 * k < spec.d_ff,
            "units of {k} slots of {}",
            spec.d_ff
        );
        1.0 / u.predicted_tokens_per_s
    };
    // Launches large enough to outweigh every layer's link time.
    let (a, b) = (step(1e-3), step(2e-3));
    let launches = (b - a) / 1e-3;
    let want = (spec.n_layers * (2 + 16) + 4) as f64;
    assert!(
        (launches - want).abs() < 1e-6 * want,
        "{launches} launches a step, want {want}"
    );
}

/// Cache units hold neuron bundles: a block-quantized FFN (SmolLM2's matrices) is refused with
/// what runs it sparse instead, and so is a unit size out of range.
#[test]
fn units_refuse_what_they_cannot_hold() {
    use gpu_offload::plan::units::plan_units;
    if let Some(smol) = common::smollm2() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_of(&smol, &dir);
        let e = plan_units(
            &store.manifest,
            &plan_for(&store, 4),
            None,
            0.5,
            Precision::FP16,
        )
        .unwrap_err();
        assert!(e.to_string().contains("--cold cpu"), "{e}");
    }
    let dir = tempfile::tempdir().unwrap();
    let store = store_of(&common::stories260k(), &dir);
    let spec = store.manifest.spec.clone();
    let plan = plan_for(&store, 4);
    for (slots, precision) in [
        (vec![[0, 0, 0]; spec.n_layers], Precision::FP16),
        (vec![[spec.d_ff + 1, 0, 0]; spec.n_layers], Precision::FP16),
        (vec![[1, 0, 0]], Precision::FP16),
        // A tier in use without slots, slots in a tier not in use.
        (vec![[4, 0, 4]; spec.n_layers], Precision([50, 25, 25])),
        (vec![[4, 4, 0]; spec.n_layers], Precision::FP16),
        // INT8 neurons from a store without INT8 bundles.
        (vec![[4, 4, 4]; spec.n_layers], Precision([50, 25, 25])),
    ] {
        let r = units_engine(
            &store,
            &plan,
            &slots,
            precision,
            None,
            None,
            Ledger::new(None, None),
        );
        assert!(r.is_err(), "{slots:?} at {precision}");
    }
}

/// With a predictor the units take its set as it is (nothing read from DRAM to decide): the
/// logits are the streaming engine's under the same predictor, and each step brings in or finds
/// exactly the neurons it lists.
#[test]
fn predicted_sets_go_straight_into_the_units() {
    use gpu_offload::engine::NeuronPredictor;
    use std::sync::Arc;
    struct EveryThird(usize);
    impl NeuronPredictor for EveryThird {
        fn active(&self, layer: usize, _input: &[f32], n: usize) -> Vec<bool> {
            (0..n * self.0)
                .map(|i| !(i % self.0 + layer).is_multiple_of(3))
                .collect()
        }
    }
    for model in common::bundled_models() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_of(&model, &dir);
        let spec = store.manifest.spec.clone();
        let toks: Vec<u32> = (0..10)
            .map(|i| (i * 11 + 2) % spec.vocab_size as u32)
            .collect();
        let plan = plan_for(&store, toks.len());
        let predictor =
            || -> Option<Arc<dyn NeuronPredictor>> { Some(Arc::new(EveryThird(spec.d_ff))) };
        let want = logits(
            &streaming(&store, &plan, &[]).with_predictor(predictor()),
            &toks,
        );
        let slots = vec![[spec.d_ff / 2, 0, 0]; spec.n_layers];
        let (e, traffic) = units_engine(
            &store,
            &plan,
            &slots,
            Precision::FP16,
            None,
            None,
            Ledger::new(None, None),
        )
        .unwrap();
        let e = e.with_predictor(predictor());
        let got = logits(&e, &toks);
        close(&got, &want, &model.display().to_string());
        let listed: u64 = (0..spec.n_layers)
            .map(|l| {
                (0..spec.d_ff)
                    .filter(|j| !(j + l).is_multiple_of(3))
                    .count() as u64
            })
            .sum();
        let [needed, _, _] = traffic.snapshot();
        assert_eq!(
            needed,
            5 * listed,
            "{}: every step's listed neurons",
            model.display()
        );
    }
}

/// Mixed-precision units (f16 / INT8 / INT4 regions, each token's active neurons split by rank):
/// a prompt evaluated in one step gives the logits of the same tokens decoded one by one (the
/// split is per token, however many share the step); the host→device bytes are exactly each
/// tier's loads times its neuron's bytes in that tier's encoding; every tier in use loads; and
/// the quantized tiers change the logits, by little.
#[test]
fn mixed_precision_units_split_per_token_and_move_their_tiers_bytes() {
    use gpu_offload::engine::Logits;
    use gpu_offload::store::Encoding;
    let mut rng = StdRng::seed_from_u64(37);
    for model in common::bundled_models() {
        let dir = tempfile::tempdir().unwrap();
        let store = common::store_with(&model, &dir, &common::with_int_bundles());
        let spec = store.manifest.spec.clone();
        let toks: Vec<u32> = (0..9)
            .map(|i| (i * 7 + 1) % spec.vocab_size as u32)
            .collect();
        let plan = plan_for(&store, toks.len());
        let parts = if spec.gated_ffn { 3 } else { 2 };
        let biased = store.manifest.segment("blk.0.ffn_up.bias").is_some();
        let per_load = [Encoding::F16, Encoding::Int8, Encoding::Int4]
            .map(|e| e.row_bytes(parts * spec.d_model, parts) as u64 + if biased { 4 } else { 0 });
        for (case, precision) in [
            Precision([25, 25, 50]),
            Precision([50, 0, 50]),
            Precision([0, 100, 0]),
            Precision([34, 33, 33]),
        ]
        .into_iter()
        .enumerate()
        {
            let thresholds: Vec<f32> = if case % 2 == 0 {
                Vec::new()
            } else {
                (0..spec.n_layers)
                    .map(|_| [0.01, 0.05][rng.random_range(0..2)])
                    .collect()
            };
            let slots: Vec<[usize; 3]> = (0..spec.n_layers)
                .map(|_| {
                    [0, 1, 2].map(|i| {
                        if precision.0[i] > 0 {
                            rng.random_range(1..=spec.d_ff)
                        } else {
                            0
                        }
                    })
                })
                .collect();
            let what = format!("{} at {precision}, slots {slots:?}", model.display());
            let engine = |ledger| {
                let (e, traffic) =
                    units_engine(&store, &plan, &slots, precision, None, None, ledger)
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                (e.with_sparsity(thresholds.clone()).unwrap(), traffic)
            };
            let (batched, _) = engine(Ledger::new(None, None));
            let mut s = batched.new_session(toks.len()).unwrap();
            let all = batched.forward(&mut s, &toks, Logits::All).unwrap();
            let ledger = Ledger::new(None, None);
            let (single, traffic) = engine(ledger.clone());
            let h2d_at_load = ledger.snapshot().h2d_bytes;
            let mut s = single.new_session(toks.len()).unwrap();
            let mut one_by_one = Vec::new();
            for &t in &toks {
                one_by_one.extend(single.forward(&mut s, &[t], Logits::Last).unwrap());
            }
            close(
                &all,
                &one_by_one,
                &format!("{what}: one step against one by one"),
            );
            let tier_loads = traffic.tier_loads();
            let [_, loads, bytes] = traffic.snapshot();
            let in_place = traffic.in_place();
            assert_eq!(loads, tier_loads.iter().sum::<u64>(), "{what}");
            assert_eq!(
                bytes,
                (0..3).map(|i| tier_loads[i] * per_load[i]).sum::<u64>(),
                "{what}: each tier's loads in its encoding"
            );
            let embeddings = toks.len() as u64 * spec.d_model as u64 * 4;
            // What was read in place: at least each listed neuron's deciding part in its
            // tier's encoding, at most its whole bundle.
            let read = (ledger.snapshot().h2d_bytes - h2d_at_load)
                .checked_sub(bytes + embeddings)
                .unwrap_or_else(|| panic!("{what}: fewer host→device bytes than loads"));
            let most = per_load.iter().max().copied().unwrap_or(0);
            let least = per_load.iter().min().copied().unwrap_or(0) / parts as u64;
            assert!(
                (in_place * least..=in_place * most).contains(&read),
                "{what}: {read} bytes read in place for {in_place} neurons"
            );
            for (i, (&loaded, &share)) in tier_loads.iter().zip(&precision.0).enumerate() {
                assert_eq!(loaded > 0, share > 0, "{what}: tier {i}");
            }
            let f16_slots: Vec<[usize; 3]> = vec![[spec.d_ff, 0, 0]; spec.n_layers];
            let (f16, _) = units_engine(
                &store,
                &plan,
                &f16_slots,
                Precision::FP16,
                None,
                None,
                Ledger::new(None, None),
            )
            .unwrap();
            let f16 = f16.with_sparsity(thresholds.clone()).unwrap();
            let mut s = f16.new_session(toks.len()).unwrap();
            let want = f16.forward(&mut s, &toks, Logits::All).unwrap();
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1.0);
            let worst = all
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(worst > 0.0, "{what}: the quantized tiers change nothing");
            assert!(
                worst < 0.25 * scale,
                "{what}: {worst} off all-f16 (scale {scale})"
            );
        }
    }
}

/// Planned mixed-precision units at random budgets and shares: the device holds exactly what
/// the plan counts, within the budget; a store without INT8/INT4 bundles is refused.
#[test]
fn planned_mixed_units_fill_the_budget_exactly() {
    use gpu_offload::plan::units::plan_units;
    use gpu_offload::plan::{Budget, HardwareProfile, make_plan};
    let hw = HardwareProfile::load("cpu-sim").unwrap();
    let mut rng = StdRng::seed_from_u64(41);
    let model = common::stories260k();
    let plain = tempfile::tempdir().unwrap();
    let e = plan_units(
        &store_of(&model, &plain).manifest,
        &plan_for(&store_of(&model, &tempfile::tempdir().unwrap()), 4),
        None,
        0.5,
        Precision([25, 25, 50]),
    )
    .unwrap_err();
    assert!(e.to_string().contains("--encodings int8,int4"), "{e}");
    let dir = tempfile::tempdir().unwrap();
    let store = common::store_with(&model, &dir, &common::with_int_bundles());
    let toks: Vec<u32> = (0..8).map(|i| i * 5 + 2).collect();
    let mut tried = 0;
    for _ in 0..8 {
        let precision = Precision::search_grid()[rng.random_range(0..15)];
        let full = plan_units(
            &store.manifest,
            &plan_for(&store, toks.len()),
            None,
            0.5,
            precision,
        )
        .unwrap();
        let rest = full.device.placed - full.device.units - full.device.staging;
        let g = rest
            + ((full.device.units + full.device.staging) as f64 * rng.random_range(0.05..1.0))
                as u64;
        let budget = Budget::new(g, None, 2, toks.len() + 4, toks.len());
        let Ok(plan) = make_plan(&store.manifest, &budget, &hw) else {
            continue;
        };
        let Ok(units) = plan_units(&store.manifest, &plan, None, 0.5, precision) else {
            continue;
        };
        tried += 1;
        let what = format!("{precision} at {g} bytes, slots {:?}", units.slots());
        assert!(units.device.total <= g, "{what}");
        let ledger = Ledger::new(Some(units.device.placed), None);
        let (e, _) = units_engine(
            &store,
            &plan,
            &units.slots(),
            precision,
            Some(&units.scores),
            None,
            ledger.clone(),
        )
        .unwrap_or_else(|e| panic!("{what}: {e}"));
        let _ = logits(&e, &toks);
        assert_eq!(ledger.snapshot().hbm_peak, units.device.placed, "{what}");
    }
    assert!(tried >= 3, "budgets too small to test");
}

/// A mixed plan (`--cold auto`: each layer a cache unit or hybrid, whichever the plan predicts
/// faster): hand-made mixes (every other layer hybrid with the ILP's hot neurons) and planned
/// ones at random budgets give the streaming engine's logits; a planned mix fits its budget and
/// the device holds exactly what it counts.
#[test]
fn unit_and_hybrid_layers_mix() {
    use gpu_offload::plan::hybrid::plan_hot_neurons;
    use gpu_offload::plan::units::{HybridLayers, UnitMode, mix_with_hybrid, plan_units};
    use gpu_offload::plan::{Budget, HardwareProfile, make_plan};
    let hw = HardwareProfile::load("cpu-sim").unwrap();
    let mut rng = StdRng::seed_from_u64(43);
    let mut mixed_plans = 0;
    for model in [common::stories260k(), common::fixtures().join("hf/opt")] {
        let dir = tempfile::tempdir().unwrap();
        let store = store_of(&model, &dir);
        let spec = store.manifest.spec.clone();
        let profile = common::random_profile(&store, &mut rng);
        let toks: Vec<u32> = (0..10)
            .map(|i| (i * 19 + 4) % spec.vocab_size as u32)
            .collect();
        let plan = plan_for(&store, toks.len());
        let thresholds: Vec<f32> = (0..spec.n_layers).map(|_| 0.02).collect();
        let want = logits(&streaming(&store, &plan, &thresholds), &toks);
        // Hand-made: every other layer hybrid.
        let hot = plan_hot_neurons(&store.manifest, &plan, &profile, 0.5).unwrap();
        let mix = HybridLayers {
            hot_neurons: (0..spec.n_layers)
                .map(|l| (l % 2 == 0).then(|| hot.hot_neurons[l].clone()))
                .collect(),
            cold_cost: hot.cold_cost.clone(),
            batch: toks.len(),
        };
        let slots: Vec<[usize; 3]> = (0..spec.n_layers)
            .map(|l| {
                if l % 2 == 0 {
                    [0; 3]
                } else {
                    [rng.random_range(1..=spec.d_ff), 0, 0]
                }
            })
            .collect();
        let what = format!("{} hand-made mix", model.display());
        let (e, _) = units_engine(
            &store,
            &plan,
            &slots,
            Precision::FP16,
            None,
            Some(&mix),
            Ledger::new(None, None),
        )
        .unwrap_or_else(|e| panic!("{what}: {e}"));
        let e = e.with_sparsity(thresholds.clone()).unwrap();
        close(&logits(&e, &toks), &want, &what);
        // Planned at random budgets.
        let full =
            plan_units(&store.manifest, &plan, Some(&profile), 0.5, Precision::FP16).unwrap();
        let rest = full.device.placed - full.device.units - full.device.staging;
        for _ in 0..8 {
            let g = rest
                + ((full.device.units + full.device.staging) as f64 * rng.random_range(0.1..1.2))
                    as u64;
            let budget = Budget::new(g, None, 2, toks.len() + 4, toks.len());
            let Ok(plan) = make_plan(&store.manifest, &budget, &hw) else {
                continue;
            };
            let (Ok(units), Ok(hot)) = (
                plan_units(&store.manifest, &plan, Some(&profile), 0.5, Precision::FP16),
                plan_hot_neurons(&store.manifest, &plan, &profile, 0.5),
            ) else {
                continue;
            };
            let unit_speed = units.predicted_tokens_per_s;
            let mixed = mix_with_hybrid(&store.manifest, &plan, units, &hot).unwrap();
            assert!(mixed.predicted_tokens_per_s >= unit_speed * (1.0 - 1e-9));
            let Some(h) = &mixed.hybrid else {
                continue;
            };
            mixed_plans += 1;
            let what = format!(
                "{} at {g} bytes: {:?}",
                model.display(),
                mixed.layers.iter().map(|l| l.mode).collect::<Vec<_>>()
            );
            assert!(
                mixed.layers.iter().any(|l| l.mode == UnitMode::Hybrid),
                "{what}"
            );
            assert!(mixed.device.total <= g, "{what}");
            let ledger = Ledger::new(Some(mixed.device.placed), None);
            let (e, _) = units_engine(
                &store,
                &plan,
                &mixed.slots(),
                Precision::FP16,
                Some(&mixed.scores),
                Some(h),
                ledger.clone(),
            )
            .unwrap_or_else(|e| panic!("{what}: {e}"));
            let e = e.with_sparsity(thresholds.clone()).unwrap();
            close(&logits(&e, &toks), &want, &what);
            assert_eq!(ledger.snapshot().hbm_peak, mixed.device.placed, "{what}");
        }
    }
    assert!(mixed_plans > 0, "no budget gave a mixed plan");
}

/// The plan takes the units' loads from the hit ratios `bench units` measured, where it has
/// them for the layer at that size and sparsity: the misses of the measured ratio. That is the
/// ATU's churn, which only units that bring in every needed neuron have (an up bias goes by
/// slot: OPT); a unit that reads its misses in place evicts nothing, so the measurement does
/// not apply to it (stories260K).
#[test]
fn measured_reuse_sets_the_expected_loads() {
    use gpu_offload::plan::units::plan_units;
    use gpu_offload::sparsity::UnitReuse;
    let mut rng = StdRng::seed_from_u64(47);
    for (model, in_place) in [
        (common::fixtures().join("hf/opt"), false),
        (common::stories260k(), true),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let store = store_of(&model, &dir);
        let spec = store.manifest.spec.clone();
        let plan = plan_for(&store, 8);
        let mut profile = common::random_profile(&store, &mut rng);
        let guessed =
            plan_units(&store.manifest, &plan, Some(&profile), 0.5, Precision::FP16).unwrap();
        profile.unit_reuse = Some(UnitReuse {
            target: 0.5,
            tokens: 100,
            layers: vec![vec![(1, 0.9), (spec.d_ff, 0.9)]; spec.n_layers],
        });
        let measured =
            plan_units(&store.manifest, &plan, Some(&profile), 0.5, Precision::FP16).unwrap();
        for (g, m) in guessed.layers.iter().zip(&measured.layers) {
            assert_eq!(g.slots, m.slots);
            if in_place {
                assert_eq!(g, m, "{}", model.display());
                assert_eq!(m.expected_loads, 0.0, "{m:?}");
                let whole = m.slots[0] == spec.d_ff;
                assert_eq!(m.expected_in_place > 0.0, !whole, "{m:?}");
                continue;
            }
            assert!(
                (m.expected_loads - 0.1 * m.mean_active).abs() < 1e-9,
                "{m:?}"
            );
            assert_ne!(g.expected_loads, m.expected_loads);
        }
        // At another sparsity the measurement does not apply.
        let other =
            plan_units(&store.manifest, &plan, Some(&profile), 0.3, Precision::FP16).unwrap();
        let again = {
            profile.unit_reuse = None;
            plan_units(&store.manifest, &plan, Some(&profile), 0.3, Precision::FP16).unwrap()
        };
        assert_eq!(other.layers, again.layers);
    }
}

/// Continuous batching through cache units: every session's logits in a batched decode step
/// are the ones it gets alone, bit for bit — with masks, units small enough that a step's
/// neurons come in rounds (the batch's rounds are not a token's own), and mixed precision.
#[test]
fn batched_unit_decode_equals_each_session_alone() {
    let sessions = 4;
    let mut rng = StdRng::seed_from_u64(41);
    let dir = tempfile::tempdir().unwrap();
    let store = common::store_with(&common::stories260k(), &dir, &common::with_int_bundles());
    let spec = store.manifest.spec.clone();
    let plan = plan_for(&store, 16);
    let prompts = common::varied_prompts(spec.vocab_size, sessions, 3, 4);
    for case in 0..4 {
        let precision = if case == 3 {
            Precision([34, 33, 33])
        } else {
            Precision::FP16
        };
        let slots: Vec<[usize; 3]> = (0..spec.n_layers)
            .map(|_| match case {
                0 => [spec.d_ff, 0, 0],
                1 => [rng.random_range(spec.d_ff / 2..=spec.d_ff), 0, 0],
                2 => [rng.random_range(1..=spec.d_ff / 4), 0, 0],
                _ => [0, 1, 2].map(|_| rng.random_range(1..=spec.d_ff / 2)),
            })
            .collect();
        let thresholds = vec![if case >= 2 { 0.05 } else { 0.0 }; spec.n_layers];
        let ledger = Ledger::new(None, None);
        let (e, _) = units_engine(&store, &plan, &slots, precision, None, None, ledger).unwrap();
        let e = e.with_sparsity(thresholds).unwrap();
        let want = common::decode_alone(&e, &prompts, 3, false);
        let got = common::decode_batched(&e, &prompts, 3, false);
        for (i, (w, g)) in want.iter().zip(&got).enumerate() {
            assert!(
                w == g,
                "case {case}: session {i}'s logits differ when batched"
            );
        }
    }
}
