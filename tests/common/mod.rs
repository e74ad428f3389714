//! Helpers shared by the integration tests: where the test models are, and a small GGUF writer
//! for crafting good and bad files.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// `../shared/models/stories260K-f32.gguf` (or `$GPU_OFFLOAD_SHARED_MODELS/...`).
pub fn stories260k() -> PathBuf {
    let dir = std::env::var_os("GPU_OFFLOAD_SHARED_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join("../shared/models"));
    let p = dir.join("stories260K-f32.gguf");
    assert!(
        p.exists(),
        "{} is missing: the shared test models must be next to the checkout (or set GPU_OFFLOAD_SHARED_MODELS)",
        p.display()
    );
    p
}

/// SmolLM2-135M-Instruct Q4_1, fetched by scripts/fetch-models.sh. `None` (with a printed reason)
/// only when GPU_OFFLOAD_SKIP_MISSING_MODELS=1; otherwise a missing file fails the test.
pub fn smollm2() -> Option<PathBuf> {
    let p = gpu_offload::model::default_model_path();
    if p.exists() {
        return Some(p);
    }
    if std::env::var_os("GPU_OFFLOAD_SKIP_MISSING_MODELS").is_some_and(|v| v == "1") {
        eprintln!(
            "skipped: {} missing (GPU_OFFLOAD_SKIP_MISSING_MODELS=1)",
            p.display()
        );
        return None;
    }
    panic!("{} is missing: run scripts/fetch-models.sh", p.display());
}

/// The repository root: `$GPU_OFFLOAD_REPO` (test binaries run on another machine, e.g. the
/// GPU machine, from a copy of the tree) or where the crate was built.
pub fn repo() -> PathBuf {
    std::env::var_os("GPU_OFFLOAD_REPO")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

pub fn fixtures() -> PathBuf {
    repo().join("tests/fixtures")
}

/// A JSON fixture, by path relative to tests/fixtures.
pub fn json_fixture(rel: &str) -> serde_json::Value {
    let path = fixtures().join(rel);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A JSON list of token ids.
pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("id list")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

pub use gpu_offload::model::gguf::{MetaValue, RawTensor};

/// Write a GGUF v3 file.
pub fn write_gguf(path: &Path, kv: &[(&str, MetaValue)], tensors: &[RawTensor]) {
    gpu_offload::model::gguf::write(path, kv, tensors).expect("write gguf");
}

/// A tiny but complete `llama` GGUF (no tokenizer): 1 layer, d 256, 4 heads, vocab 64. `ffn_type`
/// is the GGML type id of the FFN matrices (their bytes are zeros of the right size), so a file
/// with an unsupported type can be made.
pub fn tiny_llama_gguf(path: &Path, arch: &str, ffn_type: u32, ffn_block: (u64, u64)) {
    let (d, ff, vocab) = (256u64, 256u64, 64u64);
    let vals = |n: u64| -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 7919 % 97) as f32 - 48.0) / 480.0)
            .collect()
    };
    let ffn = |name: &str, cols: u64, rows: u64| RawTensor {
        name: name.into(),
        dims: vec![cols, rows],
        ggml_type: ffn_type,
        bytes: vec![0u8; (cols * rows / ffn_block.0 * ffn_block.1) as usize],
    };
    let key = |k: &str| format!("{arch}.{k}");
    let keys: Vec<(String, MetaValue)> = vec![
        (
            "general.architecture".into(),
            MetaValue::String(arch.into()),
        ),
        (key("block_count"), MetaValue::U32(1)),
        (key("embedding_length"), MetaValue::U32(d as u32)),
        (key("feed_forward_length"), MetaValue::U32(ff as u32)),
        (key("attention.head_count"), MetaValue::U32(4)),
        (key("attention.head_count_kv"), MetaValue::U32(4)),
        (key("context_length"), MetaValue::U32(64)),
        (
            key("attention.layer_norm_rms_epsilon"),
            MetaValue::F32(1e-5),
        ),
    ];
    let kv: Vec<(&str, MetaValue)> = keys.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    write_gguf(
        path,
        &kv,
        &[
            RawTensor::f32("token_embd.weight", &[d, vocab], &vals(d * vocab)),
            RawTensor::f32("output_norm.weight", &[d], &vec![1.0; d as usize]),
            RawTensor::f32("blk.0.attn_norm.weight", &[d], &vec![1.0; d as usize]),
            RawTensor::f32("blk.0.attn_q.weight", &[d, d], &vals(d * d)),
            RawTensor::f32("blk.0.attn_k.weight", &[d, d], &vals(d * d)),
            RawTensor::f32("blk.0.attn_v.weight", &[d, d], &vals(d * d)),
            RawTensor::f32("blk.0.attn_output.weight", &[d, d], &vals(d * d)),
            RawTensor::f32("blk.0.ffn_norm.weight", &[d], &vec![1.0; d as usize]),
            ffn("blk.0.ffn_gate.weight", d, ff),
            ffn("blk.0.ffn_up.weight", d, ff),
            ffn("blk.0.ffn_down.weight", ff, d),
        ],
    );
}

/// The device budgets a store can run at with hardware `hw`: from the smallest the planner
/// accepts to what holds everything, for the budget `b` makes of a size.
pub fn gpu_range(
    manifest: &gpu_offload::store::Manifest,
    hw: &gpu_offload::plan::HardwareProfile,
    b: impl Fn(u64) -> gpu_offload::plan::Budget,
) -> (u64, u64) {
    use gpu_offload::plan::{PlanError, make_plan};
    let min = match make_plan(manifest, &b(0), hw) {
        Err(PlanError::GpuTooSmall { minimum, .. }) => minimum,
        other => panic!("expected GpuTooSmall, got {other:?}"),
    };
    let all = make_plan(manifest, &b(u64::MAX / 4), hw).unwrap().gpu.total;
    (min, all)
}

/// The dense CPU engine (2 threads) of a loaded model, its KV cache in `kv`.
pub fn cpu_engine(
    model: &gpu_offload::model::Model,
    kv: gpu_offload::backend::KvType,
) -> gpu_offload::engine::Engine<gpu_offload::backend::cpu::CpuBackend> {
    gpu_offload::engine::Engine::new(
        gpu_offload::backend::cpu::CpuBackend::new(2).unwrap(),
        model.spec.clone(),
        &model.weights,
    )
    .unwrap()
    .with_kv_type(kv)
    .unwrap()
}

/// `t`'s reference decode, as an f32 tensor of the same name and shape.
pub fn decoded(t: &gpu_offload::tensor::HostTensor) -> gpu_offload::tensor::HostTensor {
    gpu_offload::tensor::HostTensor::from_f32(t.name.clone(), t.rows, t.cols, t.to_f32())
}

/// `weights` with every tensor stored in a block format replaced by its reference decode in f32:
/// the exact product that engines multiplying quantized activations (each in its own block
/// size) are each measured against.
pub fn dequantized(weights: &gpu_offload::model::ModelWeights) -> gpu_offload::model::ModelWeights {
    use gpu_offload::model::{Linear, NormWeights};
    use gpu_offload::tensor::HostTensor;
    fn decode(t: &mut HostTensor) {
        if t.dtype.is_quantized() {
            *t = decoded(t);
        }
    }
    fn linear(l: &mut Linear) {
        decode(&mut l.weight);
        l.bias.iter_mut().for_each(decode);
    }
    fn norm(n: &mut NormWeights) {
        decode(&mut n.weight);
        n.bias.iter_mut().for_each(decode);
    }
    let mut w = weights.clone();
    decode(&mut w.token_embd);
    w.pos_embd.iter_mut().for_each(decode);
    w.output.iter_mut().for_each(decode);
    norm(&mut w.output_norm);
    for l in &mut w.layers {
        for lin in [
            &mut l.wq,
            &mut l.wk,
            &mut l.wv,
            &mut l.wo,
            &mut l.w_up,
            &mut l.w_down,
        ] {
            linear(lin);
        }
        l.w_gate.iter_mut().for_each(linear);
        l.router.iter_mut().for_each(decode);
        for n in [&mut l.attn_norm, &mut l.ffn_norm] {
            norm(n);
        }
        l.q_norm
            .iter_mut()
            .chain(l.k_norm.iter_mut())
            .for_each(norm);
    }
    w
}

/// Logits of a prefill of `toks` (last position), then of 4 decode steps of its first tokens.
pub fn prefill_and_decode_logits<B: gpu_offload::backend::Backend>(
    e: &gpu_offload::engine::Engine<B>,
    toks: &[u32],
) -> Vec<f32> {
    use gpu_offload::engine::Logits;
    let mut s = e.new_session(toks.len() + 4).unwrap();
    let mut out = e.forward(&mut s, toks, Logits::Last).unwrap();
    for &t in &toks[..4] {
        out.extend(e.forward(&mut s, &[t], Logits::Last).unwrap());
    }
    out
}

/// The model converted into a store in `dir`.
pub fn store_of(
    model: &Path,
    dir: &tempfile::TempDir,
) -> std::sync::Arc<gpu_offload::store::Store> {
    store_with(model, dir, &Default::default())
}

/// The model converted into a store in `dir` with `opts`.
#[allow(dead_code)]
pub fn store_with(
    model: &Path,
    dir: &tempfile::TempDir,
    opts: &gpu_offload::store::ConvertOptions,
) -> std::sync::Arc<gpu_offload::store::Store> {
    use gpu_offload::store::{Store, convert};
    let at = dir.path().join("s");
    convert(model, &at, opts, &mut |_, _| {}).unwrap();
    std::sync::Arc::new(Store::open(&at).unwrap())
}

/// Conversion options that add the INT8 and INT4 bundles (mixed-precision neurons).
#[allow(dead_code)]
pub fn with_int_bundles() -> gpu_offload::store::ConvertOptions {
    use gpu_offload::store::{ConvertOptions, Encoding};
    ConvertOptions {
        extra_encodings: vec![Encoding::Int8, Encoding::Int4],
        ..Default::default()
    }
}

/// The offload plan of `store` with no budget to speak of: everything resident.
pub fn plan_for(store: &gpu_offload::store::Store, toks: usize) -> gpu_offload::plan::Plan {
    use gpu_offload::plan::{Budget, HardwareProfile, make_plan};
    let hw = HardwareProfile::load("cpu-sim").unwrap();
    make_plan(
        &store.manifest,
        &Budget::new(u64::MAX / 4, None, 2, toks + 4, toks),
        &hw,
    )
    .unwrap()
}

/// The offloading engine for `plan` on the budgeted device over `ledger`, its KV cache in `kv`
/// and laid out as the plan says.
pub fn offloaded(
    store: &std::sync::Arc<gpu_offload::store::Store>,
    plan: &gpu_offload::plan::Plan,
    ledger: &std::sync::Arc<gpu_offload::footprint::Ledger>,
    kv: gpu_offload::backend::KvType,
) -> gpu_offload::engine::Engine<gpu_offload::backend::sim::SimBackend> {
    use gpu_offload::backend::cpu::CpuBackend;
    use gpu_offload::backend::sim::SimBackend;
    use gpu_offload::engine::Engine;
    use gpu_offload::tier::stream::StreamWeights;
    let sim = SimBackend::new(CpuBackend::new(2).unwrap(), ledger.clone());
    let src = StreamWeights::new(&sim, store.clone(), plan, ledger.clone()).unwrap();
    Engine::with_source(sim, store.manifest.spec.clone(), Box::new(src))
        .unwrap()
        .with_prefill(plan.prefill)
        .unwrap()
        .with_kv_type(kv)
        .unwrap()
}

/// The offloading engine on the budgeted device for `plan`, masks at `thresholds`.
pub fn streaming(
    store: &std::sync::Arc<gpu_offload::store::Store>,
    plan: &gpu_offload::plan::Plan,
    thresholds: &[f32],
) -> gpu_offload::engine::Engine<gpu_offload::backend::sim::SimBackend> {
    let ledger = gpu_offload::footprint::Ledger::new(None, None);
    offloaded(store, plan, &ledger, gpu_offload::backend::KvType::F16)
        .with_sparsity(thresholds.to_vec())
        .unwrap()
}

/// Logits equal up to the order sums run in (2e-4 of the largest).
pub fn close(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1.0);
    let worst = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    assert!(
        worst <= 2e-4 * scale,
        "{what}: logits differ by {worst} (scale {scale})"
    );
}

/// Models whose FFN the store bundles by neuron: stories260K (SwiGLU), the ReGLU fixture and
/// OPT (two-part ReLU bundles with an up bias).
pub fn bundled_models() -> [PathBuf; 3] {
    [
        stories260k(),
        fixtures().join("hf/relu-llama"),
        fixtures().join("hf/opt"),
    ]
}

/// A profile with random activation frequencies (no corpus needed): what the planner places by.
#[allow(dead_code)]
pub fn random_profile(
    store: &gpu_offload::store::Store,
    rng: &mut rand::rngs::StdRng,
) -> gpu_offload::sparsity::SparsityProfile {
    use gpu_offload::sparsity::{GRID_TARGETS, SparsityProfile};
    use rand::RngExt;
    let spec = &store.manifest.spec;
    SparsityProfile {
        model_id: store.manifest.model_id.clone(),
        corpus: "random frequencies".into(),
        tokens: 0,
        window: 0,
        n_layers: spec.n_layers,
        d_ff: spec.d_ff,
        thresholds: Vec::new(),
        measured: Vec::new(),
        frequency: (0..spec.n_layers * GRID_TARGETS * spec.d_ff)
            .map(|_| rng.random_range(0..=u16::MAX))
            .collect(),
        predictor_target: None,
        predictors: Vec::new(),
        predictor_quality: Vec::new(),
        unit_reuse: None,
    }
}

/// Start `serve` from `cmd` (its arguments given) and wait for the address it listens on: the
/// child and `http://…`.
#[allow(dead_code)]
pub fn spawn_serve(mut cmd: std::process::Command) -> (std::process::Child, String) {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start server");
    let stdout = child.stdout.take().expect("stdout");
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).expect("read");
    let base = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("server did not start: {line:?}"))
        .to_string();
    (child, base)
}

/// `count` prompts of token ids below `vocab`, prompt `p` of `first + step · p` tokens (different
/// lengths, so positions and blocks differ between sessions).
#[allow(dead_code)]
pub fn varied_prompts(vocab: usize, count: usize, first: usize, step: usize) -> Vec<Vec<u32>> {
    (0..count)
        .map(|p| {
            (0..first + step * p)
                .map(|i| ((i * 7919 + 13 * p + 5) % (vocab - 4) + 3) as u32)
                .collect()
        })
        .collect()
}

/// The index of the largest value (the greedy token).
#[allow(dead_code)]
pub fn greedy(v: &[f32]) -> u32 {
    v.iter()
        .enumerate()
        .fold((0, f32::MIN), |m, (i, &x)| if x > m.1 { (i, x) } else { m })
        .0 as u32
}

/// A session of 64 positions, with a query probe where `probe`.
#[allow(dead_code)]
pub fn probed_session<B: gpu_offload::backend::Backend>(
    e: &gpu_offload::engine::Engine<B>,
    probe: bool,
) -> gpu_offload::engine::Session<B> {
    let mut s = e.new_session(64).unwrap();
    if probe {
        e.enable_probe(&mut s).unwrap();
    }
    s
}

/// Greedy decode of each prompt alone (with a query probe where `probe`): the logits of each of
/// `steps` decode steps.
#[allow(dead_code)]
pub fn decode_alone<B: gpu_offload::backend::Backend>(
    e: &gpu_offload::engine::Engine<B>,
    prompts: &[Vec<u32>],
    steps: usize,
    probe: bool,
) -> Vec<Vec<Vec<f32>>> {
    use gpu_offload::engine::Logits;
    prompts
        .iter()
        .map(|p| {
            let mut s = probed_session(e, probe);
            let mut l = e.forward(&mut s, p, Logits::Last).unwrap();
            let mut out = Vec::new();
            for _ in 0..steps {
                l = e.forward(&mut s, &[greedy(&l)], Logits::Last).unwrap();
                out.push(l.clone());
            }
            out
        })
        .collect()
}

/// The same, every decode step one batched call over all the sessions (as many at a time as
/// the engine's step holds, as the server does).
#[allow(dead_code)]
pub fn decode_batched<B: gpu_offload::backend::Backend>(
    e: &gpu_offload::engine::Engine<B>,
    prompts: &[Vec<u32>],
    steps: usize,
    probe: bool,
) -> Vec<Vec<Vec<f32>>> {
    use gpu_offload::engine::{Logits, Session};
    let mut sessions: Vec<Session<B>> = prompts.iter().map(|_| probed_session(e, probe)).collect();
    let mut last: Vec<Vec<f32>> = sessions
        .iter_mut()
        .zip(prompts)
        .map(|(s, p)| e.forward(s, p, Logits::Last).unwrap())
        .collect();

    let mut out = vec![Vec::new(); prompts.len()];
    for _ in 0..steps {
        let mut calls: Vec<(&mut Session<B>, u32)> = sessions
            .iter_mut()
            .zip(&last)
            .map(|(s, l)| (s, greedy(l)))
            .collect();
        last = calls
            .chunks_mut(e.prefill().group)
            .flat_map(|c| e.decode_many(c).unwrap())
            .collect();
        for (o, l) in out.iter_mut().zip(&last) {
            o.push(l.clone());
        }
    }
    out
}

/// Two small models whose decode steps CUDA can record (4 layers, heads of 64: the split
/// attention), synthesized into `dir` as GGUF: f16 weights, and Q4_1 (the matvec with 8-bit
/// activations). Named by their weights.
pub fn recordable_models(
    dir: &tempfile::TempDir,
) -> Vec<(&'static str, gpu_offload::model::Model)> {
    recordable_models_of(dir, 128)
}

/// [`recordable_models`] with contexts of `max_context` positions.
pub fn recordable_models_of(
    dir: &tempfile::TempDir,
    max_context: usize,
) -> Vec<(&'static str, gpu_offload::model::Model)> {
    use gpu_offload::model::quant_mix::QuantMix;
    use gpu_offload::model::synth::{SynthSpec, synthesize_gguf};
    use gpu_offload::tensor::DType;
    let spec = SynthSpec {
        n_layers: 4,
        d_model: 256,
        d_ff: 704,
        n_heads: 4,
        n_kv_heads: 2,
        vocab_size: 512,
        max_context,
        ..SynthSpec::preset("tiny").unwrap()
    };
    [("f16", None), ("q4_1", Some(QuantMix::Pure(DType::Q4_1)))]
        .into_iter()
        .map(|(name, quant)| {
            let path = dir.path().join(format!("{name}.gguf"));
            synthesize_gguf(&spec, &path, false, quant, &mut |_, _| {}).unwrap();
            (name, gpu_offload::model::Model::load(&path).unwrap())
        })
        .collect()
}
