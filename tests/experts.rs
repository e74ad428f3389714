//! Mixture-of-experts models offloaded to the budgeted device (`--cold gpu|cpu` on a MoE
//! model): at budgets from "only attention, routers and shared expert resident" to "every expert
//! resident", planned with this device's rates (prompts leave missed experts to the CPU) and an
//! H100's (a 64-token prompt streams them through the device), the logits are the dense CPU
//! engine's; the ledger peaks at exactly the expert plan's bytes; the units' hits and copies and
//! the streamed experts are a reference simulation's of the ATU on the same routing trace; the
//! CPU reads exactly the missed experts; the bus moves exactly the copies, the streamed experts
//! and the partial sums beyond what every budget moves.

mod common;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use gpu_offload::backend::cpu::{CpuBackend, kernels};
use gpu_offload::backend::sim::SimBackend;
use gpu_offload::backend::{KvType, Route};
use gpu_offload::engine::{Engine, RouteTap, backend_act};
use gpu_offload::footprint::Ledger;
use gpu_offload::model::Model;
use gpu_offload::plan::expert_low_bit::LOW_BIT_ROWS;
use gpu_offload::plan::experts::{ExpertMode, ExpertPlan, plan_experts};
use gpu_offload::plan::{Budget, HardwareProfile, PlanError};
use gpu_offload::store::Store;
use gpu_offload::tier::atu::{CopyBudget, Eviction, SlotMap};
use gpu_offload::tier::experts::{ExpertCounts, ExpertWeights, active_experts};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use common::close;
use common::prefill_and_decode_logits as logits;

/// One layer's routes in a step, or (`guess`) those the previous layer guessed for it.
struct Routed {
    layer: usize,
    rows: usize,
    routes: Vec<Route>,
    guess: bool,
}

/// Every layer's routes and guesses, step by step.
#[derive(Default)]
struct Trace(Mutex<Vec<Routed>>);

impl Trace {
    fn push(&self, layer: usize, rows: usize, routes: &[Route], guess: bool) {
        self.0.lock().unwrap().push(Routed {
            layer,
            rows,
            routes: routes.to_vec(),
            guess,
        });
    }
}

impl RouteTap for Trace {
    fn routed(&self, layer: usize, rows: usize, routes: &[Route]) {
        self.push(layer, rows, routes, false);
    }

    fn guessed(&self, layer: usize, rows: usize, routes: &[Route]) {
        self.push(layer, rows, routes, true);
    }
}

fn budget(gpu_mem: u64, toks: usize) -> Budget {
    Budget::new(gpu_mem, None, 2, toks + 4, toks)
}

fn hw() -> HardwareProfile {
    HardwareProfile::load("cpu-sim").unwrap()
}

/// The plans of an H100: prompts stream the experts the units lack (the budgeted device's own
/// rates leave them to the CPU).
fn h100() -> HardwareProfile {
    HardwareProfile::load("h100-80g").unwrap()
}

/// The offloaded engine of `plan`, its ledger budgeted at exactly what the plan places on the
/// device, and at the budget's host memory.
fn offloaded(
    store: &Arc<Store>,
    plan: &ExpertPlan,
) -> (
    Engine<SimBackend>,
    Arc<Ledger>,
    Arc<gpu_offload::tier::experts::ExpertTraffic>,
    Arc<Trace>,
) {
    let ledger = Ledger::new(Some(plan.device.placed), plan.plan.budget.dram_mem);
    let sim = SimBackend::new(CpuBackend::new(2).unwrap(), ledger.clone());
    let spec = store.manifest.spec.clone();
    let src = ExpertWeights::new(
        &sim,
        store.clone(),
        plan,
        ledger.clone(),
        kernels::best(),
        2,
        backend_act(spec.activation),
    )
    .unwrap();
    let traffic = src.traffic();
    let trace = Arc::new(Trace::default());
    let e = Engine::with_source(sim, spec, Box::new(src))
        .unwrap()
        .with_prefill(plan.plan.prefill)
        .unwrap()
        .with_kv_type(KvType::F16)
        .unwrap()
        .with_route_tap(trace.clone());
    (e, ledger, traffic, trace)
}

/// What the units should have done over `trace`: each layer's unit replayed step by step
/// through its own slot map (filled at start where it holds every expert), a guess for a layer
/// taken in first within the step's copy budget (next-layer prefetch), with the experts a
/// prompt's steps stream, the CPU's experts and bytes and the partial sums' bytes (`n ×
/// d_model` f32 a step that leaves the CPU any expert).
fn reference(plan: &ExpertPlan, trace: &[Routed], d: usize) -> (ExpertCounts, u64) {
    let e = plan.experts;
    let mut budgets = vec![CopyBudget::new(plan.copies_per_step); plan.layers.len()];
    // Each unit as the source makes it: by the profile's ranking or least recently routed,
    // starting with every expert where it holds them all, else with the profile's seeds.
    let mut maps: Vec<Option<SlotMap>> = plan
        .layers
        .iter()
        .enumerate()
        .map(|(i, l)| {
            (l.slots > 0).then(|| {
                let eviction = match plan.scores.get(i) {
                    Some(s) => Eviction::Frequency(s.clone()),
                    None => Eviction::Recency,
                };
                let mut m = SlotMap::new(e, l.slots, eviction).unwrap();
                let seed: Vec<u32> = if l.slots == e {
                    (0..e as u32).collect()
                } else {
                    plan.seeds.get(i).cloned().unwrap_or_default()
                };
                m.admit(&seed, seed.len()).unwrap();
                m
            })
        })
        .collect();
    // With the SSD tier, each layer's DRAM cache as the source makes it (empty at start).
    let mut dram: Vec<Option<SlotMap>> = (0..plan.layers.len())
        .map(|i| {
            let ds = plan.host.dram_slots.as_ref()?;
            let eviction = match plan.scores.get(i) {
                Some(s) => Eviction::Frequency(s.clone()),
                None => Eviction::Recency,
            };
            Some(SlotMap::new(e, ds[i], eviction).unwrap())
        })
        .collect();
    // An expert copied or streamed from DRAM where its cache holds it, else read from the store.
    let read =
        |cache: &Option<SlotMap>, e: u32| cache.as_ref().is_some_and(|m| m.slot_of(e).is_none());
    let mut c = ExpertCounts::default();
    let mut partials = 0;
    let mut guesses: Vec<Option<Vec<u32>>> = vec![None; plan.layers.len()];
    let mut opened = vec![false; plan.layers.len()];
    for Routed {
        layer,
        rows,
        routes,
        guess,
    } in trace
    {
        let active = active_experts(routes, e);
        let eb = plan.shapes[*layer].bytes();
        if *guess {
            assert!(plan.prefetches(*layer), "a guess for layer {layer}");
            if let Some(m) = &mut maps[*layer] {
                let allowed = budgets[*layer].allow();
                opened[*layer] = true;
                let (_, loads) = m.admit(&active, allowed).unwrap();
                budgets[*layer].spend(loads.len());
                c.copies += loads.len() as u64;
                c.prefetched += loads.len() as u64;
                c.copy_bytes += loads.len() as u64 * eb;
                let reads = loads
                    .iter()
                    .filter(|l| read(&dram[*layer], l.neuron))
                    .count() as u64;
                c.ssd_experts += reads;
                c.ssd_bytes += reads * eb;
            }
            guesses[*layer] = Some(active);
            continue;
        }
        if let Some(g) = guesses[*layer].take() {
            c.guessed += g.len() as u64;
            c.guessed_right += g.iter().filter(|x| active.contains(x)).count() as u64;
        }
        let allowed = if std::mem::take(&mut opened[*layer]) {
            budgets[*layer].left()
        } else {
            budgets[*layer].allow()
        };
        // What the device lacks: streamed, or computed by the CPU through its DRAM cache.
        let mut lacking: Vec<u32> = active
            .iter()
            .copied()
            .filter(|&x| maps[*layer].as_ref().is_none_or(|m| m.slot_of(x).is_none()))
            .collect();
        lacking.sort_unstable();
        let mut reads = 0;
        if plan.stream_rows.is_some_and(|r| *rows >= r) {
            reads += lacking.iter().filter(|&&x| read(&dram[*layer], x)).count() as u64;
        } else if let Some(cache) = &mut dram[*layer] {
            for group in lacking.chunks(cache.slots()) {
                reads += cache.admit(group, usize::MAX).unwrap().1.len() as u64;
            }
        }
        let hits = match &mut maps[*layer] {
            Some(m) => {
                let (hits, loads) = m.admit(&active, allowed).unwrap();
                budgets[*layer].spend(loads.len());
                c.copies += loads.len() as u64;
                c.copy_bytes += loads.len() as u64 * eb;
                reads += loads
                    .iter()
                    .filter(|l| read(&dram[*layer], l.neuron))
                    .count() as u64;
                hits
            }
            None => 0,
        };
        c.ssd_experts += reads;
        c.ssd_bytes += reads * eb;
        let missed = (active.len() - hits) as u64;
        c.needed += active.len() as u64;
        c.hits += hits as u64;
        if plan.stream_rows.is_some_and(|r| *rows >= r) {
            // A prompt's step: the misses through the stream area.
            c.streamed += missed;
            c.stream_bytes += missed * eb;
        } else {
            // Mixed precision: a decode step's routes the unit lacks that are not their token's
            // most weighted run on the device from low-bit copies; the CPU computes the rest.
            let cpu = match &plan.low_bit {
                Some(lb) if *rows <= LOW_BIT_ROWS => {
                    let mut top: std::collections::HashMap<u32, u32> = Default::default();
                    let (mut cpu, mut low) = (BTreeSet::new(), BTreeSet::new());
                    for r in routes.iter().filter(|r| (r.expert as usize) < e) {
                        let first = *top.entry(r.token).or_insert(r.expert);
                        if lacking.contains(&r.expert) {
                            if first == r.expert {
                                cpu.insert(r.expert);
                            } else {
                                low.insert(r.expert);
                            }
                        }
                    }
                    c.low_bit_experts += low.len() as u64;
                    c.low_bit_bytes += low.len() as u64 * lb.expert_bytes[*layer];
                    cpu.len() as u64
                }
                _ => missed,
            };
            c.cpu_experts += cpu;
            c.cpu_bytes += cpu * eb;
            if cpu > 0 {
                partials += (rows * d * 4) as u64;
            }
        }
    }
    (c, partials)
}

/// The tiny synthetic Qwen3-MoE (8 experts, top 2) in f16 and Q4_K_M, and the Qwen2-MoE fixture
/// (a shared expert beside the routed ones).
fn models(dir: &tempfile::TempDir) -> Vec<std::path::PathBuf> {
    use gpu_offload::model::quant_mix::QuantMix;
    use gpu_offload::model::synth::{SynthSpec, synthesize_gguf};
    let spec = SynthSpec::preset("tiny-moe").unwrap();
    let f16 = dir.path().join("tiny-moe.gguf");
    synthesize_gguf(&spec, &f16, false, None, &mut |_, _| {}).unwrap();
    let q = dir.path().join("tiny-moe-q4_k_m.gguf");
    synthesize_gguf(&spec, &q, false, Some(QuantMix::Q4KM), &mut |_, _| {}).unwrap();
    vec![f16, q, common::fixtures().join("hf/qwen2-moe")]
}

#[test]
fn offloaded_experts_equal_the_dense_run_at_random_budgets() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = StdRng::seed_from_u64(38);
    for model in models(&dir) {
        let sdir = tempfile::tempdir().unwrap();
        let store = common::store_of(&model, &sdir);
        let spec = store.manifest.spec.clone();
        let moe = spec.moe.clone().unwrap();
        let toks: Vec<u32> = (0..64)
            .map(|i| (i * 37 + 11) % spec.vocab_size as u32)
            .collect();
        let dense = Model::load(&model).unwrap();
        let want = logits(&common::cpu_engine(&dense, KvType::F16), &toks);
        let (mut streamed, mut guessed, mut ssd) = (0, 0, 0);
        // The model's routing on its own prompt's tokens and more: what `profile` saves.
        let routing = gpu_offload::runtime::profiling::profile_routing(
            &spec,
            dense.weights.clone(),
            &store,
            (
                &(0..256)
                    .map(|i| (i * 7 + 3) % spec.vocab_size as u32)
                    .collect::<Vec<_>>(),
                64,
                "test",
            ),
            2,
            &mut |_, _| {},
        )
        .unwrap();
        for (hw, routing) in [(hw(), None), (h100(), None), (hw(), Some(&routing))] {
            // The largest budget plans every expert in every layer; the least (found by bisection)
            // no slot.
            let plans = |gpu_mem: u64| {
                plan_experts(
                    &store.manifest,
                    &budget(gpu_mem, toks.len()),
                    &hw,
                    Some(ExpertMode::Units),
                    routing,
                )
            };
            let most = plans(u64::MAX / 4).unwrap().device.total;
            let (mut lo, mut least) = (4096u64, most);
            let r = plans(lo);
            assert!(
                matches!(r, Err(PlanError::GpuTooSmall { .. })),
                "{:?}",
                r.map(|p| p.device)
            );
            while least - lo > 1 {
                let mid = lo + (least - lo) / 2;
                match plans(mid) {
                    Ok(_) => least = mid,
                    Err(PlanError::GpuTooSmall { .. }) => lo = mid,
                    Err(e) => panic!("{e}"),
                }
            }
            let mut budgets = vec![most, least];
            budgets.extend((0..3).map(|_| rng.random_range(least..most)));
            // The SSD tier: host memory from the least it takes (a token's experts a layer in
            // DRAM) to below every expert's stacks.
            let stacks = plans(most).unwrap().dram_expert_bytes;
            // Each refusal names the least it needs (the plan without experts first, then the
            // SSD tier's): the least host memory that plans.
            let least_dram = |gpu_mem: u64| {
                let mut dram = 1;
                loop {
                    let short = Budget {
                        dram_mem: Some(dram),
                        ..budget(gpu_mem, toks.len())
                    };
                    match plan_experts(
                        &store.manifest,
                        &short,
                        &hw,
                        Some(ExpertMode::Units),
                        routing,
                    ) {
                        Err(PlanError::DramTooSmall { minimum, .. }) if minimum > dram => {
                            dram = minimum
                        }
                        Ok(_) => return dram,
                        Err(e) => panic!("{dram} bytes of host memory: {e}"),
                    }
                }
            };
            let mut base: Option<(u64, u64)> = None;
            for (i, &gpu_mem) in budgets.iter().enumerate() {
                // One budget without next-layer prefetch, one with the SSD tier.
                let b = Budget {
                    expert_prefetch: i != 3,
                    dram_mem: (i == 4)
                        .then(|| least_dram(gpu_mem) + rng.random_range(0..stacks / 2)),
                    ..budget(gpu_mem, toks.len())
                };
                let mut plan =
                    plan_experts(&store.manifest, &b, &hw, Some(ExpertMode::Units), routing)
                        .unwrap();
                if i == 2 {
                    // One copy every few steps (a bus slower than the step): the same logits, and
                    // the reference with the same budget.
                    plan.copies_per_step = 0.4;
                }
                let slots = plan.slots();
                let what = format!(
                    "{} at {gpu_mem} bytes on {}, slots {slots:?}, prompts stream from {:?} rows, DRAM caches {:?}",
                    model.display(),
                    hw.name,
                    plan.stream_rows,
                    plan.host.dram_slots
                );
                assert_eq!(plan.host.dram_slots.is_some(), i == 4, "{what}");
                assert!(plan.device.total <= gpu_mem, "{what}");
                // A prompt's prediction: nothing for the CPU or the bus where every expert is
                // resident; the CPU or the stream where none is.
                let pp = plan.prefill_prediction(toks.len());
                assert!(pp.ttft_s > 0.0 && pp.ttft_s.is_finite(), "{what}: {pp:?}");
                match i {
                    0 => {
                        assert!(slots.iter().all(|&s| s == moe.experts), "{what}");
                        assert_eq!((pp.cpu_s, pp.pcie_s), (0.0, 0.0), "{what}");
                    }
                    1 => {
                        assert!(slots.iter().all(|&s| s == 0), "{what}");
                        assert!(pp.cpu_s + pp.pcie_s > 0.0, "{what}: {pp:?}");
                        assert!(plan.prefill_prediction(4 * toks.len()).ttft_s > pp.ttft_s);
                    }
                    _ => {}
                }
                let (e, ledger, traffic, trace) = offloaded(&store, &plan);
                let at_load = ledger.snapshot();
                let got = logits(&e, &toks);
                close(&got, &want, &what);
                let end = ledger.snapshot();
                assert_eq!(end.hbm_peak, plan.device.placed, "{what}: ledger peak");
                let trace = trace.0.lock().unwrap();
                // One prefill step and 4 decode steps through every layer.
                let steps = trace.iter().filter(|r| !r.guess).count();
                assert_eq!(steps, 5 * spec.n_layers, "{what}");
                let (want_counts, partials) = reference(&plan, &trace, spec.d_model);
                streamed += want_counts.streamed;
                guessed += want_counts.guessed;
                ssd += want_counts.ssd_experts;
                if !plan.prefetch {
                    assert_eq!(want_counts.guessed, 0, "{what}: prefetch off");
                }
                assert_eq!(
                    traffic.snapshot(),
                    want_counts,
                    "{what}: units against the reference"
                );
                if i == 0 {
                    assert_eq!(
                        want_counts.hits, want_counts.needed,
                        "{what}: every expert resident"
                    );
                }
                // Beyond what every budget moves (the budget holding every expert: no copy, no
                // partial sum), the bus carries exactly the copies and the partial sums; nothing
                // else comes back.
                let h2d = end.h2d_bytes - at_load.h2d_bytes;
                let d2h = end.d2h_bytes - at_load.d2h_bytes;
                let (h2d_base, d2h_base) = *base.get_or_insert((h2d, d2h));
                assert_eq!(
                    h2d,
                    h2d_base
                        + want_counts.copy_bytes
                        + want_counts.stream_bytes
                        + want_counts.low_bit_bytes
                        + partials,
                    "{what}: h2d"
                );
                assert_eq!(d2h, d2h_base, "{what}: d2h");
            }
            // Static hot experts (the profile's most routed, never replaced): the same logits,
            // no copy; `auto` weighs them beside the units, the CPU and streaming.
            let b = budget(budgets[2], toks.len());
            let hot = plan_experts(&store.manifest, &b, &hw, Some(ExpertMode::Static), routing);
            match routing {
                None => assert!(hot.is_err(), "static hot experts without a profile"),
                Some(_) => {
                    let plan = hot.unwrap();
                    let (e, ledger, traffic, trace) = offloaded(&store, &plan);
                    close(&logits(&e, &toks), &want, "static hot experts");
                    assert_eq!(ledger.snapshot().hbm_peak, plan.device.placed);
                    let (counts, _) = reference(&plan, &trace.0.lock().unwrap(), spec.d_model);
                    assert_eq!(traffic.snapshot(), counts, "static hot experts");
                    assert_eq!(counts.copies, 0);
                    let auto = plan_experts(&store.manifest, &b, &hw, None, routing).unwrap();
                    let weighed: Vec<ExpertMode> = auto.alternatives.iter().map(|a| a.0).collect();
                    assert!(weighed.contains(&ExpertMode::Static), "{weighed:?}");
                }
            }
        }
        // (The HF fixture's experts are too small for streaming to pay at 64 rows.)
        assert!(
            streamed > 0 || model.is_dir(),
            "{}: no prompt streamed its experts",
            model.display()
        );
        // The partial units had their experts guessed a layer ahead; the SSD tier read experts.
        assert!(guessed > 0, "{}: nothing guessed", model.display());
        assert!(ssd > 0, "{}: nothing read from the store", model.display());
        // Host memory below every expert's stacks takes the SSD tier; below a token's experts
        // a layer it is refused up front, saying so.
        let need = plan_experts(
            &store.manifest,
            &budget(u64::MAX / 4, toks.len()),
            &hw(),
            None,
            None,
        )
        .unwrap()
        .dram_expert_bytes;
        let with_dram = |dram: u64| {
            let b = Budget {
                dram_mem: Some(dram),
                ..budget(u64::MAX / 4, toks.len())
            };
            plan_experts(&store.manifest, &b, &hw(), None, None)
        };
        let p = with_dram(need - 1).unwrap();
        assert!(p.host.dram_slots.is_some() && p.dram_expert_bytes < need);
        // (The plan without its experts refuses 1 byte first, naming its own least.)
        let tables = match with_dram(1) {
            Err(PlanError::DramTooSmall { minimum, .. }) => minimum,
            other => panic!("1 byte: {:?}", other.map(|p| p.dram_expert_bytes)),
        };
        match with_dram(tables) {
            Err(e @ PlanError::DramTooSmall { .. }) => {
                assert!(e.to_string().contains("the SSD tier keeps at least"), "{e}")
            }
            other => panic!(
                "DRAM below the SSD tier: {:?}",
                other.map(|p| p.dram_expert_bytes)
            ),
        }
        // Every routed expert on the CPU (llama.cpp's `-ot exps=CPU`): the same logits, no
        // slot, no copy.
        let plan = plan_experts(
            &store.manifest,
            &budget(u64::MAX / 4, toks.len()),
            &hw(),
            Some(ExpertMode::Cpu),
            None,
        )
        .unwrap();
        assert!(plan.slots().iter().all(|&s| s == 0));
        let (e, ledger, traffic, _) = offloaded(&store, &plan);
        close(&logits(&e, &toks), &want, "all experts on the CPU");
        assert_eq!(ledger.snapshot().hbm_peak, plan.device.placed);
        let t = traffic.snapshot();
        assert_eq!((t.hits, t.copies, t.cpu_experts), (0, 0, t.needed));
        // Every routed expert streamed through the device each step (`--cold stream`): the same
        // logits, every expert a step needs copied in, none on the CPU.
        let plan = plan_experts(
            &store.manifest,
            &budget(u64::MAX / 4, toks.len()),
            &hw(),
            Some(ExpertMode::Stream),
            None,
        )
        .unwrap();
        assert_eq!(plan.stream_rows, Some(1));
        let (e, ledger, traffic, trace) = offloaded(&store, &plan);
        close(&logits(&e, &toks), &want, "every expert streamed");
        assert_eq!(ledger.snapshot().hbm_peak, plan.device.placed);
        let t = traffic.snapshot();
        assert_eq!((t.hits, t.cpu_experts, t.streamed), (0, 0, t.needed));
        let (counts, _) = reference(&plan, &trace.0.lock().unwrap(), spec.d_model);
        assert_eq!(t, counts, "streaming against the reference");
    }
}

/// Mixed precision (`--expert-low-bit`): a decode step's low-ranked misses computed on the device
/// from Q4_0 copies of the tiny MoE's experts, the CPU computing each token's top miss. The
/// logits move by about Q4_0's error and no more; the ledger peaks at the plan (the low-bit area
/// and its output included); the low-bit experts and their bytes are the reference's; with the
/// SSD tier it is refused.
#[test]
fn low_ranked_misses_run_on_the_device_from_low_bit_copies() {
    use gpu_offload::tensor::DType;
    let dir = tempfile::tempdir().unwrap();
    let model = &models(&dir)[0];
    let sdir = tempfile::tempdir().unwrap();
    let store = common::store_of(model, &sdir);
    let spec = store.manifest.spec.clone();
    let toks: Vec<u32> = (0..64)
        .map(|i| (i * 37 + 11) % spec.vocab_size as u32)
        .collect();
    let dense = Model::load(model).unwrap();
    let want = logits(&common::cpu_engine(&dense, KvType::F16), &toks);
    let low = |gpu_mem: u64| {
        let b = Budget {
            expert_low_bit: Some(DType::Q4_0),
            ..budget(gpu_mem, toks.len())
        };
        plan_experts(&store.manifest, &b, &hw(), Some(ExpertMode::Units), None)
    };
    let most = low(u64::MAX / 4).unwrap().device.total;
    let (mut lo, mut least) = (4096u64, most);
    while least - lo > 1 {
        let mid = lo + (least - lo) / 2;
        match low(mid) {
            Ok(_) => least = mid,
            Err(PlanError::GpuTooSmall { .. }) => lo = mid,
            Err(e) => panic!("{e}"),
        }
    }
    let mut served = 0;
    for gpu_mem in [least, least + (most - least) / 3] {
        let plan = low(gpu_mem).unwrap();
        let what = format!("low-bit Q4_0 at {gpu_mem} bytes, slots {:?}", plan.slots());
        let lb = plan.low_bit.as_ref().unwrap();
        assert_eq!(plan.device.low_bit, lb.device_bytes());
        let (e, ledger, traffic, trace) = offloaded(&store, &plan);
        let got = logits(&e, &toks);
        // Q4_0 of the experts: off the dense logits by a few percent of their scale at most.
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1.0);
        let worst = got
            .iter()
            .zip(&want)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(worst <= 0.05 * scale, "{what}: {worst} of {scale}");
        assert_eq!(ledger.snapshot().hbm_peak, plan.device.placed, "{what}");
        let trace = trace.0.lock().unwrap();
        let (counts, _) = reference(&plan, &trace, spec.d_model);
        assert_eq!(traffic.snapshot(), counts, "{what}: against the reference");
        served += counts.low_bit_experts;
    }
    assert!(served > 0, "no low-ranked miss served from a low-bit copy");
    // Not with every expert streamed at full precision.
    let b = Budget {
        expert_low_bit: Some(DType::Q4_0),
        ..budget(most, toks.len())
    };
    match plan_experts(&store.manifest, &b, &hw(), Some(ExpertMode::Stream), None) {
        Err(e) => assert!(e.to_string().contains("--cold stream"), "{e}"),
        Ok(p) => panic!("low-bit with every expert streamed: {:?}", p.mode),
    }
    // Quantized from the stacks in host memory: not with the SSD tier.
    let b = Budget {
        expert_low_bit: Some(DType::Q4_0),
        dram_mem: Some(least_host(&store, toks.len()) + low(most).unwrap().low_bit.unwrap().dram),
        ..budget(most, toks.len())
    };
    match plan_experts(&store.manifest, &b, &hw(), Some(ExpertMode::Units), None) {
        Err(e) => assert!(e.to_string().contains("--expert-low-bit"), "{e}"),
        Ok(p) => panic!("low-bit with the SSD tier: {:?}", p.host),
    }
}

/// The least host memory a plan of the tiny MoE takes without low-bit copies (the SSD tier).
fn least_host(store: &Store, toks: usize) -> u64 {
    let mut dram = 1;
    loop {
        let b = Budget {
            dram_mem: Some(dram),
            ..budget(u64::MAX / 4, toks)
        };
        match plan_experts(&store.manifest, &b, &hw(), Some(ExpertMode::Units), None) {
            Err(PlanError::DramTooSmall { minimum, .. }) if minimum > dram => dram = minimum,
            Ok(_) => return dram,
            Err(e) => panic!("{e}"),
        }
    }
}
