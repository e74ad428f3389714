//! Offloaded execution on the budgeted device (the CPU standing in for a GPU): for random GPU
//! budgets from the minimum up to "everything resident", random prefetch windows, random DRAM
//! budgets and KV cache types, the logits equal the dense engine's on the same (f16) weights; the
//! ledger's peak HBM (every buffer, the KV cache and the backend workspace, as the CUDA backend
//! takes them) and DRAM stay within the budgets after every token; the workspace held is the
//! formula's; and the bytes copied to the device, read back and read from SSD per decoded token
//! are exactly what the plan's cost model says. Random model shapes with 7B-like proportions show
//! the same for every budget the plan accepts.

mod common;

use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use gpu_offload::backend::cpu::CpuBackend;
use gpu_offload::backend::sim::SimBackend;
use gpu_offload::backend::{Backend, KvType};
use gpu_offload::engine::{Engine, Logits};
use gpu_offload::footprint::Ledger;
use gpu_offload::plan::{Budget, HardwareProfile, Plan, PlanError, make_plan};
use gpu_offload::store::{ConvertOptions, Store, convert};
use gpu_offload::tier::stream::StreamWeights;
use proptest::prelude::*;

const PROMPT: usize = 6;
const DECODE: usize = 4;

/// A converted store, by name, and the directory holding it.
type Converted = (String, Arc<Store>, tempfile::TempDir);

/// A converted store per source model, shared by the cases of this test binary.
fn store(name: &str, source: PathBuf) -> Arc<Store> {
    static STORES: OnceLock<Mutex<Vec<Converted>>> = OnceLock::new();
    let stores = STORES.get_or_init(|| Mutex::new(Vec::new()));
    let mut v = stores.lock().unwrap();
    if let Some((_, s, _)) = v.iter().find(|(n, _, _)| n == name) {
        return s.clone();
    }
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("store");
    convert(&source, &out, &ConvertOptions::default(), &mut |_, _| {}).unwrap();
    let s = Arc::new(Store::open(&out).unwrap());
    v.push((name.into(), s.clone(), dir));
    s
}

fn tokens(vocab: usize) -> Vec<u32> {
    (0..PROMPT + DECODE)
        .map(|i| ((i * 7919 + 13) % (vocab - 4) + 3) as u32)
        .collect()
}

/// Dense reference: the plain engine over the store's weights in dense layout.
fn dense(store: &Store, toks: &[u32], kv: KvType) -> Vec<Vec<f32>> {
    let w = store.dense_weights().unwrap();
    let e = Engine::new(CpuBackend::new(2).unwrap(), store.manifest.spec.clone(), &w)
        .unwrap()
        .with_kv_type(kv)
        .unwrap();
    let mut s = e.new_session(toks.len()).unwrap();
    let mut out = vec![e.forward(&mut s, &toks[..PROMPT], Logits::Last).unwrap()];
    for &t in &toks[PROMPT..] {
        out.push(e.forward(&mut s, &[t], Logits::Last).unwrap());
    }
    out
}

fn budget(gpu_mem: u64, dram_mem: Option<u64>, window: usize) -> Budget {
    Budget {
        kv_type: KvType::F32,
        ..Budget::new(gpu_mem, dram_mem, window, PROMPT + DECODE, PROMPT)
    }
}

/// (minimum GPU budget, GPU budget holding everything) for a window.
fn gpu_range(store: &Store, window: usize) -> (u64, u64) {
    let hw = HardwareProfile::load("cpu-sim").unwrap();
    common::gpu_range(&store.manifest, &hw, |g| budget(g, None, window))
}

/// (minimum DRAM budget, DRAM holding every streamed layer) for a plan's residency.
fn dram_range(store: &Store, gpu_mem: u64, window: usize) -> (u64, u64) {
    let hw = HardwareProfile::load("cpu-sim").unwrap();
    let p = make_plan(&store.manifest, &budget(gpu_mem, None, window), &hw).unwrap();
    let min = match make_plan(&store.manifest, &budget(gpu_mem, Some(1), window), &hw) {
        Err(PlanError::DramTooSmall { minimum, .. }) => minimum,
        Ok(_) => 1,
        Err(e) => panic!("{e}"),
    };
    (min, p.dram.total.max(p.dram.tables + p.dram.staging))
}

/// Run the plan on the budgeted device and check logits, budgets and traffic.
fn check(store: &Arc<Store>, plan: &Plan, want: &[Vec<f32>], toks: &[u32]) {
    let prompt = plan.budget.batch;
    let ledger = Ledger::new(Some(plan.ledger_budget()), plan.budget.dram_mem);
    let sim = SimBackend::new(CpuBackend::new(2).unwrap(), ledger.clone());
    let src = StreamWeights::new(&sim, store.clone(), plan, ledger.clone()).unwrap();
    let e = Engine::with_source(sim, store.manifest.spec.clone(), Box::new(src))
        .unwrap()
        .with_prefill(plan.prefill)
        .unwrap()
        .with_kv_type(plan.budget.kv_type)
        .unwrap();
    let mut s = e.new_session(plan.budget.ctx).unwrap();
    let in_budget = |when: &str, n: usize| {
        let snap = ledger.snapshot();
        assert!(
            snap.hbm_peak <= plan.ledger_budget(),
            "{when}: HBM peak {} > budget {} less the fixed cost",
            snap.hbm_peak,
            plan.ledger_budget()
        );
        assert!(
            snap.hbm_peak <= plan.gpu.placed,
            "{when}: HBM peak {} > planned {}",
            snap.hbm_peak,
            plan.gpu.placed
        );
        if let Some(d) = plan.budget.dram_mem {
            assert!(
                snap.dram_total_peak <= d,
                "{when}: DRAM peak {} > budget {d}",
                snap.dram_total_peak
            );
        }
        // The workspace held covers what the formula says this step needs, and is no more
        // than the plan allowed for (it stays at the largest step's size: `Workspace::set`).
        let formula = e.step_memory(n, 1).unwrap().workspace;
        let held = e.backend().workspace_held();
        assert!(held >= formula, "{when}: workspace {held} under {formula}");
        assert!(held <= plan.gpu.workspace, "{when}: workspace over plan");
    };
    let close = |got: &[f32], want: &[f32], when: &str| {
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = got
            .iter()
            .zip(want)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            diff <= 1e-4 * scale.max(1.0),
            "{when}: logits differ by {diff} (scale {scale})\n{}",
            plan.report()
        );
    };
    let got = e.forward(&mut s, &toks[..prompt], Logits::Last).unwrap();
    if !want.is_empty() {
        close(&got, &want[0], "prefill");
    }
    // A partitioned prompt holds one group's workspace.
    in_budget("prefill", prompt.min(plan.prefill.group));
    for (i, &t) in toks[prompt..].iter().enumerate() {
        e.settle();
        let before = ledger.snapshot();
        let got = e.forward(&mut s, &[t], Logits::Last).unwrap();
        e.settle();
        let after = ledger.snapshot();
        if !want.is_empty() {
            close(&got, &want[i + 1], &format!("decode {i}"));
        }
        in_budget(&format!("decode {i}"), 1);
        let pt = &plan.per_token;
        let (h2d, d2h) = plan.decode_bytes_at(prompt + i);
        assert_eq!(
            after.h2d_bytes - before.h2d_bytes,
            h2d,
            "host→device bytes of token {i}"
        );
        assert_eq!(
            after.d2h_bytes - before.d2h_bytes,
            d2h,
            "device→host bytes of token {i}"
        );
        assert_eq!(
            after.ssd_read_bytes - before.ssd_read_bytes,
            pt.ssd_bytes,
            "SSD bytes of token {i}\n{}",
            plan.report()
        );
    }
}

fn case(name: &str, source: PathBuf, gpu_frac: f64, window: usize, dram_frac: Option<f64>) {
    let store = store(name, source);
    let toks = tokens(store.manifest.spec.vocab_size);
    let want = dense(&store, &toks, KvType::F32);
    let (min, all) = gpu_range(&store, window);
    let gpu_mem = min + ((all + 4096 - min) as f64 * gpu_frac) as u64;
    let dram_mem = dram_frac.map(|f| {
        let (lo, hi) = dram_range(&store, gpu_mem, window);
        lo + ((hi - lo) as f64 * f) as u64
    });
    let hw = HardwareProfile::load("cpu-sim").unwrap();
    let plan = make_plan(&store.manifest, &budget(gpu_mem, dram_mem, window), &hw).unwrap();
    check(&store, &plan, &want, &toks);
}

fn hf(name: &str) -> PathBuf {
    common::fixtures().join("hf").join(name)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn llama_gqa_any_budget(gpu in 0.0f64..1.0, window in 1usize..4, dram in proptest::option::of(0.0f64..1.0)) {
        case("llama-gqa", hf("llama-gqa"), gpu, window, dram);
    }

    #[test]
    fn opt_any_budget(gpu in 0.0f64..1.0, window in 1usize..4, dram in proptest::option::of(0.0f64..1.0)) {
        case("opt", hf("opt"), gpu, window, dram);
    }

    #[test]
    fn qwen2_bias_any_budget(gpu in 0.0f64..1.0, window in 1usize..4, dram in proptest::option::of(0.0f64..1.0)) {
        case("qwen2-bias", hf("qwen2-bias"), gpu, window, dram);
    }

    #[test]
    fn qwen3_qk_norm_any_budget(gpu in 0.0f64..1.0, window in 1usize..4, dram in proptest::option::of(0.0f64..1.0)) {
        case("qwen3", hf("qwen3"), gpu, window, dram);
    }

    #[test]
    fn relu_llama_any_budget(gpu in 0.0f64..1.0, window in 1usize..4, dram in proptest::option::of(0.0f64..1.0)) {
        case("relu-llama", hf("relu-llama"), gpu, window, dram);
    }

    #[test]
    fn stories260k_any_budget(gpu in 0.0f64..1.0, window in 1usize..5, dram in proptest::option::of(0.0f64..1.0)) {
        case("stories260K", common::stories260k(), gpu, window, dram);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn smollm2_any_budget(gpu in 0.0f64..1.0, window in 1usize..4, dram in proptest::option::of(0.0f64..1.0)) {
        if let Some(path) = common::smollm2() {
            case("smollm2", path, gpu, window, dram);
        }
    }
}

/// The corners the random cases may miss: the exact minimum, a DRAM budget at its minimum.
#[test]
fn minimum_budgets_run() {
    for (name, src) in [("llama-gqa", hf("llama-gqa")), ("opt", hf("opt"))] {
        let store = store(name, src);
        let toks = tokens(store.manifest.spec.vocab_size);
        let want = dense(&store, &toks, KvType::F32);
        let (min, _) = gpu_range(&store, 1);
        let (dmin, _) = dram_range(&store, min, 1);
        let hw = HardwareProfile::load("cpu-sim").unwrap();
        let plan = make_plan(&store.manifest, &budget(min, Some(dmin), 1), &hw).unwrap();
        assert!(plan.streams());
        check(&store, &plan, &want, &toks);
    }
}

#[test]
fn budget_below_minimum_names_the_minimum() {
    let store = store("llama-gqa", hf("llama-gqa"));
    let (min, _) = gpu_range(&store, 3);
    let hw = HardwareProfile::load("cpu-sim").unwrap();
    let err = make_plan(&store.manifest, &budget(min - 1, None, 3), &hw).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("too small") && msg.contains("at least"),
        "{msg}"
    );
}

/// A small LLaMA with 7B-like proportions (FFN 2.6875 × hidden, head dim 16 or 32, optional
/// grouped-query attention), converted into a store.
fn random_shape_store(
    layers: usize,
    heads: usize,
    head_dim: usize,
    gqa: bool,
    vocab: usize,
    seed: u64,
) -> (Arc<Store>, tempfile::TempDir) {
    use gpu_offload::model::synth::{SynthSpec, synthesize};
    let d = heads * head_dim;
    let spec = SynthSpec {
        n_layers: layers,
        d_model: d,
        d_ff: (d * 43 / 16).next_multiple_of(32),
        n_heads: heads,
        n_kv_heads: if gqa { heads / 4 } else { heads },
        vocab_size: vocab,
        max_context: 128,
        seed,
        ..SynthSpec::preset("tiny").unwrap()
    };
    let dir = tempfile::tempdir().unwrap();
    synthesize(&spec, &dir.path().join("hf"), false, &mut |_, _| {}).unwrap();
    let out = dir.path().join("store");
    convert(
        &dir.path().join("hf"),
        &out,
        &ConvertOptions::default(),
        &mut |_, _| {},
    )
    .unwrap();
    (Arc::new(Store::open(&out).unwrap()), dir)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, failure_persistence: None, ..ProptestConfig::default() })]

    /// Whenever the plan accepts a budget (from the minimum up, with a fixed device cost or
    /// none, any prompt length and KV type), the run on the budgeted device completes within
    /// it, holding the workspace the formula says (checked in `check`).
    #[test]
    fn random_shapes_run_within_every_accepted_budget(
        layers in 2usize..5,
        heads in prop_oneof![Just(4usize), Just(8)],
        head_dim in prop_oneof![Just(16usize), Just(32)],
        gqa in any::<bool>(),
        vocab in prop_oneof![Just(256usize), Just(512)],
        seed in 0u64..1000,
        gpu_frac in 0.0f64..1.0,
        window in 1usize..3,
        prompt in 1usize..40,
        kv in prop_oneof![Just(KvType::F32), Just(KvType::F16), Just(KvType::Q8_0)],
        fixed in prop_oneof![Just(0u64), Just(1u64 << 20)],
    ) {
        let (store, _dir) = random_shape_store(layers, heads, head_dim, gqa, vocab, seed);
        let spec = &store.manifest.spec;
        let kv = if kv.check_cols(spec.kv_dim()).is_ok() { kv } else { KvType::F16 };
        let mut hw = HardwareProfile::load("cpu-sim").unwrap();
        hw.device_fixed_bytes = Some(fixed);
        let decode = 3;
        let b = |gpu_mem| Budget {
            kv_type: kv,
            ..Budget::new(gpu_mem, None, window, prompt + decode, prompt)
        };
        let (min, all) = common::gpu_range(&store.manifest, &hw, b);
        prop_assert!(min <= all);
        let gpu_mem = min + ((all - min) as f64 * gpu_frac) as u64;
        let plan = make_plan(&store.manifest, &b(gpu_mem), &hw).unwrap();
        prop_assert!(plan.gpu.total <= gpu_mem, "planned {} > budget {gpu_mem}", plan.gpu.total);
        let toks: Vec<u32> = (0..prompt + decode).map(|i| ((i * 31 + 7) % (vocab - 3) + 3) as u32).collect();
        // Logits are compared in the other tests; here the budget is the point.
        check(&store, &plan, &[], &toks);
        // One granule less than the minimum is refused, not run.
        let below = make_plan(&store.manifest, &b(min - 1), &hw);
        prop_assert!(matches!(below, Err(PlanError::GpuTooSmall { .. })), "below the minimum");
    }
}

/// f16 and Q8_0 KV caches: offloaded logits equal the dense engine's with the same cache type.
#[test]
fn kv_types_offloaded_equal_dense() {
    for kv in [KvType::F16, KvType::Q8_0] {
        let store = store("stories260K", common::stories260k());
        let toks = tokens(store.manifest.spec.vocab_size);
        let want = dense(&store, &toks, kv);
        let hw = HardwareProfile::load("cpu-sim").unwrap();
        let b = |g| Budget {
            kv_type: kv,
            ..budget(g, None, 2)
        };
        let min = match make_plan(&store.manifest, &b(0), &hw) {
            Err(PlanError::GpuTooSmall { minimum, .. }) => minimum,
            other => panic!("{other:?}"),
        };
        let plan = make_plan(&store.manifest, &b(min), &hw).unwrap();
        check(&store, &plan, &want, &toks);
    }
}

/// A budget that holds fewer streaming slots than the prefetch window asked for narrows the
/// window to what fits (one layer at the least) instead of refusing, and still runs exactly.
#[test]
fn a_budget_below_the_asked_window_narrows_it() {
    let store = store("llama-gqa", hf("llama-gqa"));
    let toks = tokens(store.manifest.spec.vocab_size);
    let want = dense(&store, &toks, KvType::F32);
    let hw = HardwareProfile::load("cpu-sim").unwrap();
    // The minimum now is the minimum with one slot.
    let (min, _) = gpu_range(&store, 3);
    let (min1, _) = gpu_range(&store, 1);
    assert_eq!(min, min1);
    let plan = make_plan(&store.manifest, &budget(min, None, 3), &hw).unwrap();
    assert_eq!((plan.window, plan.budget.window), (1, 3));
    assert!(plan.report().contains("of 3 asked"), "{}", plan.report());
    check(&store, &plan, &want, &toks);
}

/// On a card whose copies run beside its compute, a prefetch window of one slot prices them in
/// turn (the next layer's copy waits for this layer's compute to free the slot, and its compute
/// for the copy): the link's and the device's times add up; with two slots copies run ahead,
/// and the slower of the two bounds the step.
#[test]
fn one_streaming_slot_prices_copies_and_compute_in_turn() {
    let dir = tempfile::tempdir().unwrap();
    let store = common::store_of(&common::stories260k(), &dir);
    let hw = HardwareProfile::load("h100-80g").unwrap();
    assert!(!hw.copies_share_memory);
    let (min, all) = common::gpu_range(&store.manifest, &hw, |g| budget(g, None, 2));
    let mut priced = 0;
    for g in (1..8).map(|i| min + (all - min) * i / 8) {
        let plan = |window| make_plan(&store.manifest, &budget(g, None, window), &hw).unwrap();
        let (one, two) = (plan(1), plan(2));
        // Budgets that hold two slots beside what they keep resident.
        if two.window != 2 {
            continue;
        }
        priced += 1;
        assert_eq!(one.window, 1, "at {g} bytes");
        for (p, in_turn) in [(&one, true), (&two, false)] {
            let q = &p.prediction;
            assert!(q.pcie_s > 0.0 && q.hbm_s > 0.0 && q.cpu_s == 0.0, "{q:?}");
            let bound = if in_turn {
                q.pcie_s + q.hbm_s
            } else {
                q.pcie_s.max(q.hbm_s)
            };
            let want = 1.0 / (bound + q.ops_s);
            assert!(
                (q.tokens_per_s - want).abs() <= 1e-9 * want,
                "window {} at {g} bytes: {} against {want} ({q:?})",
                p.window,
                q.tokens_per_s
            );
        }
        assert_eq!(one.prediction.limited_by, "PCIe+HBM");
    }
    assert!(priced >= 3, "{priced} budgets held two slots");
}
