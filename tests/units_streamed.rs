//! Cache units beside streamed attention (`--cold gpu` where every layer's attention does not
//! fit beside the units): the streaming source holds the units, attention resident by rows as
//! far as the plan's reserve leaves room and streamed through its slots beyond. The logits are
//! the streaming engine's, the device holds exactly what the plan counts, and units are refused
//! only below the least budget that holds them beside one streaming slot.

mod common;

use std::sync::Arc;

use gpu_offload::backend::KvType;
use gpu_offload::backend::cpu::{CpuBackend, kernels};
use gpu_offload::backend::sim::SimBackend;
use gpu_offload::engine::{Engine, backend_act};
use gpu_offload::footprint::Ledger;
use gpu_offload::plan::choice::{Cold, plan_cold};
use gpu_offload::plan::hybrid::plan_hot_neurons;
use gpu_offload::plan::precision::Precision;
use gpu_offload::plan::units::{HybridLayers, UnitMode, UnitPlan, plan_units};
use gpu_offload::plan::{Budget, HardwareProfile, Plan, PlanError};
use gpu_offload::sparsity::SparsityProfile;
use gpu_offload::store::Store;
use gpu_offload::tier::stream::StreamWeights;
use gpu_offload::tier::units::{UnitLayout, UnitTraffic};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use common::prefill_and_decode_logits as logits;
use common::{close, plan_for, store_of, streaming};

/// A synthesized f16 SwiGLU model (4 layers, d 256, GQA) in `dir`, as GGUF.
fn synthesized_f16(dir: &tempfile::TempDir) -> std::path::PathBuf {
    use gpu_offload::model::synth::{SynthSpec, synthesize_gguf};
    let spec = SynthSpec {
        n_layers: 4,
        d_model: 256,
        d_ff: 704,
        n_heads: 4,
        n_kv_heads: 2,
        vocab_size: 512,
        max_context: 64,
        ..SynthSpec::preset("tiny").unwrap()
    };
    let path = dir.path().join("f16.gguf");
    synthesize_gguf(&spec, &path, false, None, &mut |_, _| {}).unwrap();
    path
}

/// The models: stories260K (f32 SwiGLU) and a synthesized f16 SwiGLU model, both bundled.
fn models(dir: &tempfile::TempDir) -> Vec<std::path::PathBuf> {
    vec![common::stories260k(), synthesized_f16(dir)]
}

/// The budget the tests plan for: `g` bytes, a context of the prompt and 4 more, steps of
/// the whole prompt.
fn budget(g: u64, toks: usize) -> Budget {
    let mut b = Budget::new(g, None, 2, toks + 4, toks);
    b.batch = toks;
    b
}

/// `--cold gpu`'s plan at `budget`: its base plan and units.
fn units_at(
    store: &Store,
    budget: &Budget,
    profile: &SparsityProfile,
) -> Result<(Plan, UnitPlan), PlanError> {
    let hw = HardwareProfile::load("cpu-sim").unwrap();
    let c = plan_cold(
        &store.manifest,
        budget,
        &hw,
        Cold::Gpu,
        Some((profile, 0.5)),
        &[Precision::FP16],
    )?;
    Ok((c.plan, c.units.expect("a unit plan")))
}

/// The engine of units `layout` beside `plan`'s streamed attention on the budgeted device over
/// `ledger`, masks at `thresholds`; and what its units move.
fn streamed_units_engine(
    store: &Arc<Store>,
    plan: &Plan,
    layout: &UnitLayout,
    ledger: Arc<Ledger>,
    thresholds: &[f32],
) -> (Engine<SimBackend>, Arc<UnitTraffic>) {
    let spec = store.manifest.spec.clone();
    let sim = SimBackend::new(CpuBackend::new(2).unwrap(), ledger.clone());
    let src = StreamWeights::with_units(
        &sim,
        store.clone(),
        plan,
        ledger,
        kernels::best(),
        layout,
        backend_act(spec.activation),
    )
    .unwrap();
    let traffic = src.unit_traffic().expect("units");
    let e = Engine::with_source(sim, spec, Box::new(src))
        .unwrap()
        .with_prefill(plan.prefill)
        .unwrap()
        .with_kv_type(KvType::F16)
        .unwrap()
        .with_sparsity(thresholds.to_vec())
        .unwrap();
    (e, traffic)
}

/// The least budget cache units run at, as `--cold gpu` states it refusing a budget of one
/// byte; and the least with every layer's attention resident (as units keeping it resident
/// state it, refusing budgets below).
fn least_budgets(store: &Store, profile: &SparsityProfile, toks: usize) -> (u64, u64) {
    let hw = HardwareProfile::load("cpu-sim").unwrap();
    let least_of = |r: Result<(), PlanError>| match r {
        Err(PlanError::GpuTooSmall { minimum, .. }) => Some(minimum),
        Err(e) => panic!("refused otherwise: {e}"),
        Ok(()) => None,
    };
    let streamed = least_of(units_at(store, &budget(1, toks), profile).map(|_| ()))
        .expect("one byte holds units");
    let mut resident = streamed;
    loop {
        let plan = match gpu_offload::plan::make_plan(&store.manifest, &budget(resident, toks), &hw)
        {
            Ok(plan) => plan,
            Err(e) => {
                resident = least_of(Err(e)).unwrap();
                continue;
            }
        };
        let r = plan_units(&store.manifest, &plan, Some(profile), 0.5, Precision::FP16);
        match least_of(r.map(|_| ())) {
            Some(m) if m > resident => resident = m,
            Some(m) => panic!("refused at {resident} stating {m}"),
            None => break (streamed, resident),
        }
    }
}

/// At budgets from the least that holds units to below every layer's attention (with units of
/// a slot beside it): attention streams in some layers, the plan fits its budget, the logits of
/// a multi-token prefill and of decode steps are the streaming engine's within 2e-4 of the logit
/// scale, the device holds exactly what the plan counts at its peak, and the units load.
#[test]
fn units_beside_streamed_attention_equal_streaming_and_fill_the_plan() {
    let mut rng = StdRng::seed_from_u64(53);
    let synth = tempfile::tempdir().unwrap();
    for model in models(&synth) {
        let dir = tempfile::tempdir().unwrap();
        let store = store_of(&model, &dir);
        let spec = store.manifest.spec.clone();
        let profile = common::random_profile(&store, &mut rng);
        let toks: Vec<u32> = (0..8)
            .map(|i| (i * 37 + 11) % spec.vocab_size as u32)
            .collect();
        let thresholds = vec![0.02; spec.n_layers];
        let want = logits(
            &streaming(&store, &plan_for(&store, toks.len()), &thresholds),
            &toks,
        );
        let (least, resident) = least_budgets(&store, &profile, toks.len());
        assert!(least < resident, "{}", model.display());
        let mut budgets = vec![least];
        budgets
            .extend((0..3).map(|_| {
                least + ((resident - least) as f64 * rng.random_range(0.05..0.95)) as u64
            }));
        for g in budgets {
            let what = format!("{} at {g} bytes", model.display());
            let (plan, units) = units_at(&store, &budget(g, toks.len()), &profile)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert!(
                units.base_plan.is_some() && plan.residency.ffn_off,
                "{what}"
            );
            assert!(
                units.layers.iter().all(|l| l.attention_streamed > 0),
                "{what}: attention streams"
            );
            assert!(units.device.total <= g, "{what}");
            // The plan's GPU line accounts for the whole budget: what it places, the units'
            // reserve and the second step's buffers it keeps free beside them.
            let (reserve, scratch) = (plan.budget.unit_reserve.unwrap(), plan.gpu.scratch);
            assert!(plan.gpu.total + reserve + scratch <= g, "{what}");
            let mib = |b: u64| format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64);
            let report = plan.report();
            let line = report.lines().find(|l| l.starts_with("GPU")).unwrap();
            assert!(
                line.contains(&format!(
                    "beside these, {} kept free for the cache units and their staging (below) and {} for step buffers of another size",
                    mib(reserve),
                    mib(scratch)
                )),
                "{what}: {line}"
            );
            let ledger = Ledger::new(Some(units.device.placed), None);
            let (e, traffic) = streamed_units_engine(
                &store,
                &plan,
                &UnitLayout::of(&units),
                ledger.clone(),
                &thresholds,
            );
            close(&logits(&e, &toks), &want, &what);
            assert_eq!(ledger.snapshot().hbm_peak, units.device.placed, "{what}");
            let [needed, loads, _] = traffic.snapshot();
            assert!(needed > 0 && loads > 0 && loads <= needed, "{what}");
            eprintln!(
                "{what}: slots {:?}, {} of attention streamed per layer",
                units.slots(),
                units.layers[0].attention_streamed
            );
        }
    }
}

/// A mix beside streamed attention (every other layer hybrid, every other neuron of it hot;
/// the others cache units): the streaming engine's logits, and the device
/// holds exactly what the units, the hybrid layers and their merge buffer take beside the base
/// plan. Where the planner mixes by itself (`--cold auto`), its plan fits and holds what it
/// counts.
#[test]
fn unit_and_hybrid_layers_mix_beside_streamed_attention() {
    use gpu_offload::plan::units::plan_units_streamed;
    let hw = HardwareProfile::load("cpu-sim").unwrap();
    let mut rng = StdRng::seed_from_u64(59);
    let synth = tempfile::tempdir().unwrap();
    for model in models(&synth) {
        let dir = tempfile::tempdir().unwrap();
        let store = store_of(&model, &dir);
        let spec = store.manifest.spec.clone();
        let profile = common::random_profile(&store, &mut rng);
        let toks: Vec<u32> = (0..8)
            .map(|i| (i * 29 + 5) % spec.vocab_size as u32)
            .collect();
        let thresholds = vec![0.02; spec.n_layers];
        let want = logits(
            &streaming(&store, &plan_for(&store, toks.len()), &thresholds),
            &toks,
        );
        let (least, resident) = least_budgets(&store, &profile, toks.len());
        let g = least + (resident - least) / 2;
        let b = budget(g, toks.len());
        let what = format!("{} at {g} bytes", model.display());
        let (plan, units) = units_at(&store, &b, &profile).unwrap();
        let reserve = plan.budget.unit_reserve.expect("a reserve");
        assert!(
            reserve >= units.device.units + units.device.staging,
            "{what}"
        );
        // Every other layer hybrid, every other neuron of it hot; the rest cache units.
        let cost = plan_hot_neurons(
            &store.manifest,
            &plan_for(&store, toks.len()),
            &profile,
            0.5,
        )
        .unwrap()
        .cold_cost;
        let mix = HybridLayers {
            hot_neurons: (0..spec.n_layers)
                .map(|l| (l % 2 == 0).then(|| (0..spec.d_ff as u32).step_by(2).collect()))
                .collect(),
            cold_cost: cost,
            batch: toks.len(),
        };
        let layout = UnitLayout {
            slots: (0..spec.n_layers)
                .map(|l| {
                    if l % 2 == 0 {
                        [0; 3]
                    } else {
                        units.layers[l].slots
                    }
                })
                .collect(),
            precision: Precision::FP16,
            score: Some(&units.scores),
            hybrid: Some(&mix),
        };
        let (e, _) =
            streamed_units_engine(&store, &plan, &layout, Ledger::new(None, None), &thresholds);
        close(&logits(&e, &toks), &want, &format!("{what}, hand-made mix"));
        // As the planner mixes.
        let mixed = plan_units_streamed(
            &store.manifest,
            &b,
            &hw,
            &profile,
            0.5,
            &[Precision::FP16],
            true,
        )
        .unwrap();
        let base = mixed.base_plan.as_deref().expect("attention streams");
        assert!(mixed.device.total <= g, "{what}");
        assert!(
            mixed.predicted_tokens_per_s >= units.predicted_tokens_per_s * (1.0 - 1e-9),
            "{what}: mixing never predicts slower"
        );
        let ledger = Ledger::new(Some(mixed.device.placed), None);
        let (e, _) = streamed_units_engine(
            &store,
            base,
            &UnitLayout::of(&mixed),
            ledger.clone(),
            &thresholds,
        );
        close(&logits(&e, &toks), &want, &format!("{what}, planned"));
        assert_eq!(ledger.snapshot().hbm_peak, mixed.device.placed, "{what}");
        let hybrid = mixed.layers.iter().filter(|l| l.mode == UnitMode::Hybrid);
        assert_eq!(hybrid.count() > 0, mixed.hybrid.is_some(), "{what}");
        eprintln!(
            "{what}: planned {:?}",
            mixed.layers.iter().map(|l| l.mode).collect::<Vec<_>>()
        );
    }
}

/// Below every layer's attention with units of a slot beside it, units keeping attention
/// resident are refused and `--cold gpu` streams it; the least budget it states refusing a
/// smaller one plans, one byte less is refused with what takes the bytes.
#[test]
fn units_refused_only_below_their_least_budget() {
    let mut rng = StdRng::seed_from_u64(61);
    let synth = tempfile::tempdir().unwrap();
    for model in models(&synth) {
        let dir = tempfile::tempdir().unwrap();
        let store = store_of(&model, &dir);
        let profile = common::random_profile(&store, &mut rng);
        let toks = 8;
        let (least, resident) = least_budgets(&store, &profile, toks);
        let what = model.display().to_string();
        let hw = HardwareProfile::load("cpu-sim").unwrap();
        let below = gpu_offload::plan::make_plan(&store.manifest, &budget(resident - 1, toks), &hw)
            .unwrap();
        let e = plan_units(
            &store.manifest,
            &below,
            Some(&profile),
            0.5,
            Precision::FP16,
        )
        .unwrap_err();
        assert!(e.to_string().contains("attention resident"), "{what}: {e}");
        let (_, u) = units_at(&store, &budget(resident - 1, toks), &profile)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert!(u.base_plan.is_some(), "{what}");
        let (plan, u) = units_at(&store, &budget(least, toks), &profile)
            .unwrap_or_else(|e| panic!("{what} at its least budget: {e}"));
        assert!(
            u.device.total + plan.gpu.scratch <= least,
            "{what}: units within their least budget (one step's buffers left free)"
        );
        assert_eq!(u.slots(), vec![[1, 0, 0]; u.layers.len()], "{what}");
        match units_at(&store, &budget(least - 1, toks), &profile) {
            Err(e @ PlanError::GpuTooSmall { .. }) => {
                let msg = e.to_string();
                assert!(
                    msg.contains("cache units") && msg.contains("streaming slots"),
                    "{what}: {msg}"
                );
            }
            Err(e) => panic!("{what}: refused otherwise: {e}"),
            Ok(_) => panic!("{what}: planned below its least budget"),
        }
    }
}

/// Where the KV cache lives in host memory, each token brings every layer's rows so far (half
/// the context on average) over the link, or the CPU reads them where it attends there: the
/// per-token bytes of cache units and of hybrid execution count them to the byte, and their
/// time pays for them (a link slow enough to bind, so the brought-in rows show in the
/// prediction).
#[test]
fn a_host_kept_cache_is_in_the_sparse_plans_link_or_cpu_bytes_and_time() {
    let mut rng = StdRng::seed_from_u64(67);
    let dir = tempfile::tempdir().unwrap();
    let store = store_of(&common::stories260k(), &dir);
    let spec = store.manifest.spec.clone();
    let profile = common::random_profile(&store, &mut rng);
    let toks = 8;
    let (_, resident) = least_budgets(&store, &profile, toks);
    let hw = HardwareProfile::load("cpu-sim").unwrap();
    let plan = gpu_offload::plan::make_plan(&store.manifest, &budget(resident, toks), &hw).unwrap();
    let with_kv = |kv_host: bool, cpu_attention: bool| {
        let mut p = plan.clone();
        p.prefill.kv_host = kv_host;
        p.prefill.cpu_attention = cpu_attention;
        p.hardware.h2d_pinned_bytes_per_s = 1e6;
        p
    };
    let units = |kv_host, cpu_attention| {
        let p = with_kv(kv_host, cpu_attention);
        plan_units(&store.manifest, &p, Some(&profile), 0.5, Precision::FP16).unwrap()
    };
    let (device, link, cpu) = (units(false, false), units(true, false), units(true, true));
    let mid = gpu_offload::footprint::kv_bytes(&spec, plan.budget.ctx, plan.budget.kv_type) / 2;
    assert!(mid > 0);
    let (d, l, c) = (&device.per_token, &link.per_token, &cpu.per_token);
    assert_eq!(l.pcie_bytes - d.pcie_bytes, mid, "brought in over the link");
    assert_eq!((l.cpu_bytes, l.hbm_bytes), (d.cpu_bytes, d.hbm_bytes));
    assert_eq!(c.cpu_bytes - d.cpu_bytes, mid, "read by the CPU");
    assert_eq!((c.pcie_bytes, c.hbm_bytes), (d.pcie_bytes, d.hbm_bytes));
    for (i, ((d, l), c)) in device
        .layers
        .iter()
        .zip(&link.layers)
        .zip(&cpu.layers)
        .enumerate()
    {
        assert!(
            l.seconds > d.seconds,
            "layer {i}: {} against {}",
            l.seconds,
            d.seconds
        );
        assert!(
            c.seconds > d.seconds,
            "layer {i}: {} against {}",
            c.seconds,
            d.seconds
        );
    }
    assert!(link.predicted_tokens_per_s < device.predicted_tokens_per_s);
    assert!(cpu.predicted_tokens_per_s < device.predicted_tokens_per_s);
    // Hybrid execution with every layer's attention resident, at twice the budget.
    let hybrid = |kv_host, cpu_attention| {
        let mut p = with_kv(kv_host, cpu_attention);
        p.budget.gpu_mem = 2 * resident;
        plan_hot_neurons(&store.manifest, &p, &profile, 0.5).unwrap()
    };
    let (device, link, cpu) = (
        hybrid(false, false),
        hybrid(true, false),
        hybrid(true, true),
    );
    assert!(device.base_plan.is_none());
    assert_eq!(link.hot_neurons, device.hot_neurons);
    let (d, l, c) = (&device.per_token, &link.per_token, &cpu.per_token);
    assert_eq!(
        l.pcie_bytes - d.pcie_bytes,
        mid,
        "hybrid: brought in over the link"
    );
    assert_eq!((l.cpu_bytes, l.hbm_bytes), (d.cpu_bytes, d.hbm_bytes));
    assert_eq!(c.cpu_bytes - d.cpu_bytes, mid, "hybrid: read by the CPU");
    assert_eq!((c.pcie_bytes, c.hbm_bytes), (d.pcie_bytes, d.hbm_bytes));
    assert!(link.predicted_tokens_per_s < device.predicted_tokens_per_s);
    assert!(cpu.predicted_tokens_per_s < device.predicted_tokens_per_s);
}
