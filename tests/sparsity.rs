//! FFN activation sparsity with oracle masks: a ReLU model's natural mask and a zero threshold
//! change nothing; a profiled SwiGLU model's masks give the same logits dense on the CPU and
//! offloaded on the budgeted device at any budget; `profile` and `--sparsity` refuse bad input
//! with advice.

mod common;

use std::process::Command;
use std::sync::{Arc, Mutex};

use gpu_offload::backend::KvType;
use gpu_offload::backend::cpu::CpuBackend;
use gpu_offload::engine::{ActivationTap, Engine};
use gpu_offload::footprint::Ledger;
use gpu_offload::model::Model;
use gpu_offload::plan::{Budget, HardwareProfile, make_plan};
use gpu_offload::sparsity::{ProfileTap, profile_passes};
use gpu_offload::store::{ConvertOptions, Store, convert};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

fn cpu_engine(model: &Model, thresholds: Vec<f32>) -> Engine<CpuBackend> {
    // f16 KV, as the budgeted device keeps it (the plans below count it so).
    common::cpu_engine(model, KvType::F16)
        .with_sparsity(thresholds)
        .unwrap()
}

use common::prefill_and_decode_logits as logits;

/// Counts activations exactly zero and in total.
#[derive(Default)]
struct Zeros(Mutex<(usize, usize)>);

impl ActivationTap for Zeros {
    fn observe(&self, _layer: usize, _input: &[f32], acts: &[f32], _n: usize) {
        let mut z = self.0.lock().unwrap();
        z.0 += acts.iter().filter(|&&a| a == 0.0).count();
        z.1 += acts.len();
    }
}

/// ReLU (ReGLU) model: the oracle mask at threshold 0 skips exactly the neurons whose
/// activation is zero, so the logits are the dense ones, bit for bit; and there are such
/// neurons to skip.
#[test]
fn oracle_masks_of_a_relu_model_are_exact() {
    let dir = common::fixtures().join("hf/relu-llama");
    let model = Model::load(&dir).unwrap();
    assert_eq!(model.spec.activation, gpu_offload::model::Activation::Relu);
    let toks: Vec<u32> = (0..24).map(|i| (i * 7 + 3) % 200).collect();
    let dense = logits(&cpu_engine(&model, Vec::new()), &toks);
    let zeros = Arc::new(Zeros::default());
    let sparse_engine =
        cpu_engine(&model, vec![0.0; model.spec.n_layers]).with_activation_tap(zeros.clone());
    assert!(logits(&sparse_engine, &toks) == dense);
    let (z, total) = *zeros.0.lock().unwrap();
    assert!(
        z * 5 > total,
        "a ReLU FFN leaves many neurons at zero: {z} of {total}"
    );
}

/// Keeps every neuron, or none of layer 1's.
struct Keep(bool);

impl gpu_offload::engine::NeuronPredictor for Keep {
    fn active(&self, layer: usize, _input: &[f32], n: usize) -> Vec<bool> {
        vec![self.0 || layer != 1; n * 172]
    }
}

/// A predictor keeping every neuron is the dense engine; one dropping a layer's neurons changes
/// the logits (stories260K, d_ff 172).
#[test]
fn predicted_masks_apply() {
    let model = Model::load(&common::stories260k()).unwrap();
    assert_eq!(model.spec.d_ff, 172);
    let toks: Vec<u32> = (0..12).map(|i| (i * 11 + 1) % 500).collect();
    let dense = logits(&cpu_engine(&model, Vec::new()), &toks);
    let all = cpu_engine(&model, Vec::new()).with_predictor(Some(Arc::new(Keep(true))));
    assert!(logits(&all, &toks) == dense);
    let cut = cpu_engine(&model, Vec::new()).with_predictor(Some(Arc::new(Keep(false))));
    assert!(logits(&cut, &toks) != dense);
}

/// SwiGLU (stories260K): threshold 0 is the dense engine, bit for bit.
#[test]
fn threshold_zero_is_the_dense_engine() {
    let model = Model::load(&common::stories260k()).unwrap();
    let toks: Vec<u32> = (0..20).map(|i| (i * 11 + 1) % 500).collect();
    let dense = logits(&cpu_engine(&model, Vec::new()), &toks);
    let zero = logits(&cpu_engine(&model, vec![0.0; model.spec.n_layers]), &toks);
    assert!(dense == zero);
}

/// SmolLM2 (Q4_1: the FFN stays matrices, so offloading is bit-exact): profiled on a few
/// hundred tokens, the 50% oracle masks change the logits, skip about half the activations, and
/// give the same logits offloaded on the budgeted device at random budgets as on the CPU.
#[test]
fn oracle_sparsity_offloads_exactly() {
    let Some(path) = common::smollm2() else {
        return;
    };
    let model = Model::load(&path).unwrap();
    let tok = model.tokenizer.as_ref().unwrap();
    let text = "It was the best of times, it was the worst of times, it was the age of wisdom, \
                it was the age of foolishness, it was the epoch of belief, it was the epoch of \
                incredulity, it was the season of Light, it was the season of Darkness. ";
    let calib: Vec<u32> = tok.encode(&text.repeat(8), false, false).unwrap();
    let (n_layers, d_ff) = (model.spec.n_layers, model.spec.d_ff);
    let tap = Arc::new(ProfileTap::new(n_layers, d_ff));
    let profiling = cpu_engine(&model, Vec::new()).with_activation_tap(tap.clone());
    let (fine, measured, _) =
        profile_passes(&profiling, &tap, &calib[..256], 128, &mut |_, _| {}).unwrap();
    let t50: Vec<f32> = fine.iter().map(|t| t[49]).collect();
    for (l, m) in measured.iter().enumerate() {
        assert!((m[9] - 0.5).abs() < 0.02, "layer {l}: measured {}", m[9]);
    }
    let toks = tok
        .encode("Call me Ishmael. Some years ago", false, false)
        .unwrap();
    let dense = logits(&cpu_engine(&model, Vec::new()), &toks);
    let want = logits(&cpu_engine(&model, t50.clone()), &toks);
    assert!(want != dense, "the masks must change something");

    let dir = tempfile::tempdir().unwrap();
    convert(
        &path,
        &dir.path().join("s"),
        &ConvertOptions::default(),
        &mut |_, _| {},
    )
    .unwrap();
    let store = Arc::new(Store::open(&dir.path().join("s")).unwrap());
    let hw = HardwareProfile::load("cpu-sim").unwrap();
    let b = |g| Budget::new(g, None, 2, toks.len() + 4, toks.len());
    let (min, all) = common::gpu_range(&store.manifest, &hw, b);
    let mut rng = StdRng::seed_from_u64(11);
    for _ in 0..3 {
        let g = rng.random_range(min..=all);
        let plan = make_plan(&store.manifest, &b(g), &hw).unwrap();
        let ledger = Ledger::new(Some(plan.ledger_budget()), None);
        let e = common::offloaded(&store, &plan, &ledger, KvType::F16)
            .with_sparsity(t50.clone())
            .unwrap();
        assert!(logits(&e, &toks) == want, "{g} bytes: logits differ");
    }
}

fn bin(models: &std::path::Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_gpu-offload"));
    for (k, _) in std::env::vars() {
        if k.starts_with("GPU_OFFLOAD_") {
            c.env_remove(k);
        }
    }
    c.env("GPU_OFFLOAD_MODELS", models);
    c
}

/// Runs `c`, which must succeed; its JSON output.
fn succeeds(c: &mut Command) -> serde_json::Value {
    let out = c.output().unwrap();
    assert!(
        out.status.success(),
        "{c:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null)
}

fn fails(c: &mut Command, needle: &str) {
    let out = c.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "expected failure mentioning {needle}"
    );
    assert!(err.contains(needle), "wanted `{needle}` in: {err}");
}

/// `profile` and `--sparsity oracle` on the CLI (stories260K): bad corpora and a model never
/// profiled are refused with the fix named; a profile makes oracle runs work; a profile from
/// another model is refused.
#[test]
fn profile_and_oracle_on_the_cli() {
    let dir = tempfile::tempdir().unwrap();
    let models = dir.path().join("cache");
    let m = dir.path().join("stories.gguf");
    std::fs::copy(common::stories260k(), &m).unwrap();
    let ms = m.to_str().unwrap();
    let corpus = dir.path().join("corpus.txt");
    let cs = corpus.to_str().unwrap();
    let profile = |extra: &[&str]| {
        let mut c = bin(&models);
        c.args(["profile", "-m", ms, "--tokens", "64", "--window", "32"])
            .args(extra);
        c
    };
    fails(&mut profile(&["--corpus", cs]), "does not exist");
    std::fs::write(&corpus, "  \n").unwrap();
    fails(&mut profile(&["--corpus", cs]), "is empty");
    std::fs::write(&corpus, [0xffu8, 0xfe, 0x00, 0x41]).unwrap();
    fails(&mut profile(&["--corpus", cs]), "not UTF-8");
    std::fs::write(&corpus, "Once upon a time.").unwrap();
    fails(&mut profile(&["--corpus", cs]), "give a longer corpus");
    let run_on = |device: &[&str], extra: &[&str]| {
        let mut c = bin(&models);
        c.args([
            "run",
            "-m",
            ms,
            "--prompt",
            "Once upon a time",
            "-n",
            "8",
            "--temperature",
            "0",
            "--json",
        ])
        .args(device)
        .args(extra);
        c
    };
    let run = |extra: &[&str]| run_on(&["--device", "cpu"], extra);
    fails(
        &mut run(&["--sparsity", "oracle"]),
        "run `gpu-offload profile -m",
    );
    let sim = ["--device", "sim", "--gpu-mem", "64M"];
    fails(
        &mut run_on(&sim, &["--cold", "cpu"]),
        "run `gpu-offload profile -m",
    );
    fails(
        &mut run_on(&sim, &["--cold", "gpu"]),
        "run `gpu-offload profile -m",
    );
    let units = |extra: &[&str]| {
        let mut c = bin(&models);
        c.args(["bench", "units", "-m", ms, "--corpus", cs, "--tokens", "48"])
            .args(extra);
        c
    };
    fails(&mut units(&[]), "run `gpu-offload profile -m");
    std::fs::write(
        &corpus,
        "Once upon a time, there was a little girl named Lily. She loved to play outside. "
            .repeat(20),
    )
    .unwrap();
    let v = succeeds(&mut profile(&["--corpus", cs, "--json"]));
    assert_eq!(v["tokens"], 64);
    assert_eq!(v["predictors"].as_array().map(Vec::len), Some(5));
    for a in [
        ["--sparsity", "off"],
        ["--sparsity", "oracle"],
        ["--sparsity", "predicted"],
    ] {
        succeeds(&mut run(&a));
    }
    // Cache units on a decode trace (`bench units`): every token's active set counted once per
    // policy, hits within it, reloading moves the whole set; a unit as large as the layer keeps
    // everything after its first load, so it can only miss a neuron's first activation.
    fails(&mut units(&["--slots", "0.5"]), "at least 1");
    let u = succeeds(&mut units(&["--slots", "1,1000", "--json"]));
    let sizes = u["sizes"].as_array().unwrap();
    assert_eq!(sizes.len(), 2);
    for s in sizes {
        let needed = s["atu"]["needed"].as_u64().unwrap();
        assert!(needed > 0, "{s}");
        assert_eq!(s["lru"]["needed"].as_u64(), Some(needed));
        assert_eq!(s["reload_loads"].as_u64(), Some(needed));
        for p in ["atu", "lru"] {
            assert!(s[p]["hits"].as_u64().unwrap() <= needed);
        }
        let layers = s["layers"].as_array().unwrap();
        assert_eq!(layers.len(), 5);
        let per_layer: f64 = layers
            .iter()
            .map(|l| l["mean_active"].as_f64().unwrap() * 48.0)
            .sum();
        assert!((per_layer - needed as f64).abs() < 1e-6 * needed as f64);
    }
    // The hit ratios measured are kept in the profile for the plan.
    let store_dir = std::fs::read_dir(models.join("stores"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let kept = gpu_offload::sparsity::SparsityProfile::load(
        &store_dir,
        &gpu_offload::store::Store::open(&store_dir)
            .unwrap()
            .manifest
            .model_id,
        ms,
    )
    .unwrap();
    let reuse = kept.unit_reuse.expect("bench units keeps its hit ratios");
    assert_eq!(reuse.layers.len(), 5);
    assert!(
        reuse
            .layers
            .iter()
            .all(|p| !p.is_empty() && p.iter().all(|&(_, h)| (0.0..=1.0).contains(&h)))
    );
    let whole = &sizes[1];
    let distinct_bound = 5 * 172;
    let misses = whole["atu"]["needed"].as_u64().unwrap() - whole["atu"]["hits"].as_u64().unwrap();
    assert!(misses <= distinct_bound, "{whole}");
    assert_eq!(
        whole["atu"], whole["lru"],
        "nothing is evicted from a whole-layer unit"
    );
    // Hybrid execution (hot neurons placed from the profile, cold ones on the CPU) generates
    // what streaming does (the same neurons, summed in another order).
    let streamed = succeeds(&mut run_on(&sim, &["--cold", "stream"]));
    let hybrid_out = succeeds(&mut run_on(&sim, &["--cold", "cpu"]));
    assert!(streamed["text"].as_str().is_some_and(|t| !t.is_empty()));
    assert_eq!(hybrid_out["token_ids"], streamed["token_ids"]);
    // Cache units (every active neuron on the device, brought in as the units lack it) too.
    let units_out = succeeds(&mut run_on(&sim, &["--cold", "gpu"]));
    assert_eq!(units_out["token_ids"], streamed["token_ids"]);
    // The predicted masks change the numbers (a predictor of a tiny model keeps most neurons,
    // not all).
    let logits_of = |mode: &str| -> serde_json::Value {
        succeeds(bin(&models).args([
            "logits",
            "-m",
            ms,
            "--prompt",
            "Once upon a time",
            "--json",
            "--device",
            "cpu",
            "--sparsity",
            mode,
        ]))["logits"]
            .clone()
    };
    assert_ne!(logits_of("predicted"), logits_of("off"));
    assert_ne!(logits_of("oracle"), logits_of("off"));
    // Hot-neuron placement from the profile: every neuron fits in 2G beside the rest, and the
    // placement stays within what the budget leaves for neurons.
    let plan = |g: &str| -> serde_json::Value {
        succeeds(bin(&models).args([
            "plan",
            "-m",
            ms,
            "--gpu-mem",
            g,
            "--hardware",
            "gpu-4g",
            "--hot-neurons",
            "--sparsity-target",
            "0.5",
            "--json",
        ]))["hot_neurons"]
            .clone()
    };
    let hot = plan("2G");
    assert_eq!(hot["layers"].as_array().map(Vec::len), Some(5));
    assert_eq!(hot["activation_share"].as_f64(), Some(1.0));
    assert!(hot["bytes"].as_u64() <= hot["budget_bytes"].as_u64());
    // A budget that leaves room for some of the neurons (330 KiB of them in all here).
    let some = plan("770.3M");
    let share = some["activation_share"].as_f64().unwrap();
    assert!(share > 0.0 && share < 1.0, "{some}");
    assert!(some["bytes"].as_u64() <= some["budget_bytes"].as_u64());
    // A budget that cannot hold every layer's attention: hybrid streams attention beside the
    // hot neurons (the streaming source with the FFN on the CPU but for them), and generates
    // what streaming does.
    let low = ["--device", "sim", "--gpu-mem", "320K"];
    let streamed = succeeds(&mut run_on(&low, &["--cold", "stream"]));
    let hybrid_low = succeeds(&mut run_on(&low, &["--cold", "cpu"]));
    assert_eq!(hybrid_low["token_ids"], streamed["token_ids"]);
    let p = succeeds(bin(&models).args([
        "plan",
        "-m",
        ms,
        "--gpu-mem",
        "320K",
        "--hardware",
        "cpu-sim",
        "--ctx-size",
        "64",
        "--batch",
        "8",
        "--cold",
        "cpu",
        "--json",
    ]));
    let h = &p["hot_neurons"];
    assert!(
        h["per_token"]["pcie_bytes"].as_u64().unwrap() > 100_000,
        "attention streams: {h}"
    );
    assert!(h["device"]["total"].as_u64().unwrap() <= 320 * 1024, "{h}");
    assert_eq!(
        p["residency"]["ffn_off"], true,
        "the FFN is off the device but for the hot neurons"
    );
    // `--cold auto`: the planner's choice is the candidate it predicts fastest, hybrid among
    // them now that a profile exists.
    let auto = succeeds(bin(&models).args([
        "plan",
        "-m",
        ms,
        "--gpu-mem",
        "770.3M",
        "--hardware",
        "gpu-4g",
        "--cold",
        "auto",
        "--json",
    ]));
    let cands = auto["cold_candidates"].as_array().unwrap().clone();
    assert!(cands.iter().any(|c| c[0] == "cpu"), "{auto}");
    let best = cands
        .iter()
        .max_by(|a, b| a[1].as_f64().unwrap().total_cmp(&b[1].as_f64().unwrap()))
        .unwrap();
    assert_eq!(auto["cold"], best[0], "{auto}");
    fails(
        &mut run(&["--sparsity", "oracle", "--sparsity-target", "1.5"]),
        "outside 0.01..=0.99",
    );
    fails(
        &mut run(&["--sparsity", "predicted", "--sparsity-target", "0.5"]),
        "were trained for 0.15",
    );
    succeeds(&mut profile(&["--corpus", cs, "--no-predictors"]));
    fails(&mut run(&["--sparsity", "predicted"]), "has no predictors");
    // A profile copied into another model's store belongs to the first model.
    let stores = models.join("stores");
    let first = std::fs::read_dir(&stores)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let other = dir.path().join("other.gguf");
    gpu_offload::model::synth::synthesize_gguf(
        &gpu_offload::model::synth::SynthSpec {
            vocab_size: 320,
            ..gpu_offload::model::synth::SynthSpec::preset("tiny").unwrap()
        },
        &other,
        false,
        None,
        &mut |_, _| {},
    )
    .unwrap();
    let os = other.to_str().unwrap();
    succeeds(bin(&models).args(["convert", "-m", os]));
    let second = std::fs::read_dir(&stores)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| *p != first)
        .unwrap();
    std::fs::copy(
        first.join("sparsity.profile"),
        second.join("sparsity.profile"),
    )
    .unwrap();
    let run_other = || {
        let mut c = bin(&models);
        c.args([
            "run",
            "-m",
            os,
            "--tokens",
            "1,2,3",
            "-n",
            "2",
            "--device",
            "cpu",
            "--sparsity",
            "oracle",
        ]);
        c
    };
    fails(&mut run_other(), "belongs to another model");
    // Calibration on random ids (for synthesized models without a tokenizer).
    let v = succeeds(bin(&models).args([
        "profile",
        "-m",
        os,
        "--random-corpus",
        "--tokens",
        "64",
        "--window",
        "32",
        "--no-predictors",
        "--json",
    ]));
    assert_eq!(v["tokens"], 64);
    succeeds(&mut run_other());
}

/// Mixed-precision neurons on the CLI (stories260K with INT8/INT4 bundles): `bench precision`
/// scores all-f16 and the candidates asked for (f16 first, at ratio 1), saves the search in the
/// store, and `--neuron-precision auto` then runs; shares a store cannot run (no INT8/INT4
/// bundles) and malformed shares are refused with the fix named.
#[test]
fn precision_search_on_the_cli() {
    let dir = tempfile::tempdir().unwrap();
    let models = dir.path().join("cache");
    let store = dir.path().join("store");
    let ss = store.to_str().unwrap();
    let corpus = dir.path().join("corpus.txt");
    let cs = corpus.to_str().unwrap();
    std::fs::write(
        &corpus,
        "Once upon a time, there was a little girl named Lily. She loved to play outside. "
            .repeat(20),
    )
    .unwrap();
    let m = common::stories260k();
    let ms = m.to_str().unwrap();
    succeeds(bin(&models).args(["convert", "-m", ms, "-o", ss, "--copy"]));
    let run = |extra: &[&str]| {
        let mut c = bin(&models);
        c.args([
            "run",
            "-m",
            ss,
            "--prompt",
            "Once upon a time",
            "-n",
            "6",
            "--temperature",
            "0",
            "--json",
            "--device",
            "sim",
            "--gpu-mem",
            "64M",
            "--cold",
            "gpu",
        ])
        .args(extra);
        c
    };
    succeeds(bin(&models).args([
        "profile", "-m", ss, "--corpus", cs, "--tokens", "64", "--window", "32", "--json",
    ]));
    fails(
        &mut run(&["--neuron-precision", "25/25/50"]),
        "--encodings int8,int4",
    );
    fails(
        &mut run(&["--neuron-precision", "50/50/50"]),
        "add up to 100",
    );
    succeeds(bin(&models).args([
        "convert",
        "-m",
        ms,
        "-o",
        ss,
        "--copy",
        "--force",
        "--encodings",
        "int8,int4",
    ]));
    succeeds(bin(&models).args([
        "profile", "-m", ss, "--corpus", cs, "--tokens", "64", "--window", "32", "--json",
    ]));
    let f16 = succeeds(&mut run(&["--neuron-precision", "fp16"]));
    let mixed = succeeds(&mut run(&["--neuron-precision", "25/25/50"]));
    assert!(mixed["token_ids"].as_array().is_some_and(|t| t.len() == 6));
    let search = |extra: &[&str]| {
        let mut c = bin(&models);
        c.args([
            "bench",
            "precision",
            "-m",
            ss,
            "--device",
            "sim",
            "--sparsity",
            "oracle",
            "--corpus",
            cs,
            "--ctx",
            "32",
            "--chunks",
            "2",
            "--json",
        ])
        .args(extra);
        c
    };
    fails(&mut search(&["--candidates", "10/10"]), "--candidates");
    let v = succeeds(&mut search(&["--candidates", "25/25/50,0/0/100"]));
    let rows = v["candidates"].as_array().unwrap();
    assert_eq!(rows.len(), 3, "{v}");
    assert_eq!(rows[0]["precision"], serde_json::json!([100, 0, 0]));
    assert_eq!(rows[0]["ratio"], 1.0);
    for r in rows {
        let ppl = r["ppl"].as_f64().unwrap();
        assert!(ppl.is_finite() && ppl > 1.0, "{r}");
        let ratio = r["ratio"].as_f64().unwrap();
        assert!((ratio - ppl / rows[0]["ppl"].as_f64().unwrap()).abs() < 1e-12);
    }
    // Fewer bytes per neuron the more of it is quantized.
    let bytes: Vec<f64> = rows
        .iter()
        .map(|r| r["neuron_bytes"].as_f64().unwrap())
        .collect();
    assert!(bytes[0] > bytes[1] && bytes[1] > bytes[2], "{bytes:?}");
    assert!(store.join("precision-search.json").exists());
    let auto = succeeds(&mut run(&["--neuron-precision", "auto"]));
    assert!(auto["token_ids"].as_array().is_some_and(|t| t.len() == 6));
    assert!(f16["token_ids"].as_array().is_some_and(|t| t.len() == 6));
}
