//! The dense CPU engine against transformers: logits at every position and greedy continuations
//! of the generated fixtures (tests/fixtures/hf, tests/fixtures/gguf; see their README).

mod common;

use std::path::Path;
use std::sync::Arc;

use common::{fixtures, ids};

use gpu_offload::backend::cpu::CpuBackend;
use gpu_offload::engine::{Engine, GenerateParams, Logits, SamplerParams, generate};
use gpu_offload::model::Model;
use gpu_offload::sparsity::routing::RouteTrace;
use serde_json::Value;

struct Reference {
    input_ids: Vec<u32>,
    logits: Vec<Vec<f32>>,
    greedy_prompt: Vec<u32>,
    greedy: Vec<u32>,
}

fn reference(path: &Path) -> Reference {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let v: Value = serde_json::from_str(&text).expect("reference json");
    Reference {
        input_ids: ids(&v["input_ids"]),
        logits: v["logits"]
            .as_array()
            .expect("logits")
            .iter()
            .map(|row| {
                row.as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_f64().unwrap() as f32)
                    .collect()
            })
            .collect(),
        greedy_prompt: ids(&v["greedy"]["prompt_ids"]),
        greedy: ids(&v["greedy"]["generated_ids"]),
    }
}

/// Worst over positions of max |ours − ref| / max |ref|.
fn worst_relative_error(ours: &[f32], reference: &[Vec<f32>]) -> f32 {
    let vocab = reference[0].len();
    assert_eq!(ours.len(), vocab * reference.len());
    reference
        .iter()
        .enumerate()
        .map(|(p, r)| {
            let row = &ours[p * vocab..(p + 1) * vocab];
            let diff = row
                .iter()
                .zip(r)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            let scale = r.iter().fold(0f32, |m, v| m.max(v.abs()));
            diff / scale
        })
        .fold(0f32, f32::max)
}

fn check(model_path: &Path, reference_path: &Path, tolerance: f32) {
    let model = Model::load(model_path).unwrap_or_else(|e| panic!("{e}"));
    let r = reference(reference_path);
    let engine = Engine::new(
        CpuBackend::new(2).unwrap(),
        model.spec.clone(),
        &model.weights,
    )
    .unwrap();

    let mut session = engine.new_session(r.input_ids.len()).unwrap();
    let logits = engine
        .forward(&mut session, &r.input_ids, Logits::All)
        .unwrap();
    let err = worst_relative_error(&logits, &r.logits);
    println!(
        "{}: worst relative logit error {err:.2e}",
        model_path.display()
    );
    assert!(
        err <= tolerance,
        "{}: relative error {err} > {tolerance}",
        model_path.display()
    );

    // Token-by-token decoding must agree with the batched pass over the same tokens.
    let mut session = engine.new_session(r.input_ids.len()).unwrap();
    let vocab = model.spec.vocab_size;
    for (i, &t) in r.input_ids.iter().enumerate() {
        let step = engine.forward(&mut session, &[t], Logits::Last).unwrap();
        let batched = &logits[i * vocab..(i + 1) * vocab];
        let d = step
            .iter()
            .zip(batched)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(d < 1e-3, "position {i}: decode differs from prefill by {d}");
    }

    let mut session = engine
        .new_session(r.greedy_prompt.len() + r.greedy.len())
        .unwrap();
    let params = GenerateParams {
        max_tokens: r.greedy.len(),
        sampler: SamplerParams::greedy(),
        stop_at_eog: false,
    };
    let g = generate(
        &engine,
        &mut session,
        &r.greedy_prompt,
        &params,
        &|_| false,
        &mut |_| true,
    )
    .unwrap();
    assert_eq!(
        g.tokens,
        r.greedy,
        "{}: greedy continuation",
        model_path.display()
    );
}

fn hf(name: &str) {
    let dir = fixtures().join("hf").join(name);
    check(&dir, &dir.join("reference.json"), 1e-3);
}

#[test]
fn llama_gqa_f32_old_config_keys_matches_transformers() {
    hf("llama-gqa");
}

#[test]
fn relu_llama_f16_new_config_keys_matches_transformers() {
    hf("relu-llama");
}

#[test]
fn qwen2_with_qkv_bias_bf16_tied_matches_transformers() {
    hf("qwen2-bias");
}

#[test]
fn qwen3_with_per_head_qk_norm_matches_transformers() {
    hf("qwen3");
}

/// A mixture-of-experts fixture (`model`: its HF directory or a GGUF of it): logits within 1e-4
/// of transformers' at every position, the same experts in every layer at every position, the
/// same greedy continuation.
fn moe(name: &str, model: &Path) {
    let dir = model;
    let refpath = fixtures().join("hf").join(name).join("reference.json");
    check(dir, &refpath, 1e-4);
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&refpath).unwrap()).unwrap();
    let want: Vec<Vec<Vec<u32>>> = serde_json::from_value(v["experts"].clone()).unwrap();
    let r = reference(&refpath);
    let model = Model::load(dir).unwrap();
    let tap = Arc::new(RouteTrace::new(model.spec.n_layers));
    let engine = Engine::new(
        CpuBackend::new(2).unwrap(),
        model.spec.clone(),
        &model.weights,
    )
    .unwrap()
    .with_route_tap(tap.clone());
    let mut session = engine.new_session(r.input_ids.len()).unwrap();
    engine
        .forward(&mut session, &r.input_ids, Logits::All)
        .unwrap();
    // The fixtures list each token's experts ascending; the trace, by weight.
    let mut got = tap.take();
    got.iter_mut().flatten().for_each(|e| e.sort_unstable());
    assert_eq!(got.len(), want.len(), "{name}: layers routed");
    for (l, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "{name}: layer {l}'s experts by position");
    }
}

#[test]
fn qwen3_moe_matches_transformers_expert_for_expert() {
    moe("qwen3-moe", &fixtures().join("hf/qwen3-moe"));
}

#[test]
fn mixtral_matches_transformers_expert_for_expert() {
    moe("mixtral", &fixtures().join("hf/mixtral"));
}

#[test]
fn qwen2_moe_with_its_shared_expert_matches_transformers_expert_for_expert() {
    moe("qwen2-moe", &fixtures().join("hf/qwen2-moe"));
}

#[test]
fn gguf_qwen2moe_f32_matches_transformers_expert_for_expert() {
    moe("qwen2-moe", &fixtures().join("gguf/qwen2-moe-f32.gguf"));
}

#[test]
fn gguf_qwen3moe_f32_matches_transformers_expert_for_expert() {
    moe("qwen3-moe", &fixtures().join("gguf/qwen3-moe-f32.gguf"));
}

#[test]
fn gguf_mixtral_f32_3d_experts_matches_transformers_expert_for_expert() {
    moe("mixtral", &fixtures().join("gguf/mixtral-f32.gguf"));
}

/// `bench experts` on the tiny Qwen3-MoE: the trace it replays is the engine's routing of the
/// tokens it decodes (one by one), and its counts follow from the cache sizes: a cache of every
/// expert misses each only once; a static set of every expert never misses.
#[test]
fn bench_experts_replays_the_models_own_routing() {
    use gpu_offload::bench::experts::{ExpertsArgs, TraceSource, run};
    let model = fixtures().join("hf/qwen3-moe");
    let args = |random_tokens: bool, sizes: Vec<f64>| ExpertsArgs {
        model: Some(model.clone()),
        synthetic: None,
        popularity: 0.8,
        locality: 0.5,
        seed: 5,
        corpus: None,
        calibration: None,
        random_tokens,
        tokens: 40,
        calibration_tokens: 30,
        sizes,
        max_copies: None,
        threads: Some(1),
        json: false,
    };
    let r = run(&args(true, vec![1.0, 4.0])).unwrap();
    assert!(matches!(r.source, TraceSource::Decoded { .. }));
    assert_eq!((r.layers, r.experts, r.used, r.max_copies), (2, 8, 2, 2));
    let (one, all) = (&r.sizes[0], &r.sizes[1]);
    assert_eq!(one.layers[0].slots, 2);
    assert_eq!(all.layers[0].slots, 8);
    for s in &r.sizes {
        assert_eq!(
            s.atu.needed,
            2 * 40 * 2,
            "every token's experts in every layer"
        );
    }
    for l in &all.layers {
        assert!(
            l.atu.needed - l.atu.hits <= 8,
            "each expert misses at most once"
        );
        assert_eq!(l.atu.copies, l.atu.needed - l.atu.hits);
        assert_eq!(l.static_top.hits, l.static_top.needed);
    }
    // The same tokens decoded by hand route the same way: the adjacent overlap the report
    // states is the engine's.
    let m = Model::load(&model).unwrap();
    let tap = Arc::new(RouteTrace::new(2));
    let engine = Engine::new(CpuBackend::new(1).unwrap(), m.spec.clone(), &m.weights)
        .unwrap()
        .with_route_tap(tap.clone());
    let ids: Vec<u32> = {
        use rand::{RngExt, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(6);
        (0..40)
            .map(|_| rng.random_range(0..m.spec.vocab_size as u32))
            .collect()
    };
    let mut session = engine.new_session(40).unwrap();
    for &t in &ids {
        engine.forward(&mut session, &[t], Logits::None).unwrap();
    }
    let trace = tap.take();
    for (l, layer) in one.layers.iter().enumerate() {
        let want = gpu_offload::sparsity::routing::adjacent_overlap(&trace[l]);
        assert_eq!(layer.adjacent_overlap, want, "layer {l}");
    }
    // Text needs a tokenizer; a dense model has no experts.
    let e = run(&args(false, vec![1.0])).unwrap_err().to_string();
    assert!(
        e.contains("no tokenizer") && e.contains("--random-tokens"),
        "{e}"
    );
    let dense = ExpertsArgs {
        model: Some(fixtures().join("hf/qwen3")),
        ..args(true, vec![1.0])
    };
    let e = run(&dense).unwrap_err().to_string();
    assert!(e.contains("has no experts"), "{e}");
    let e = run(&args(true, vec![0.0])).unwrap_err().to_string();
    assert!(e.contains("--sizes"), "{e}");
}

/// Older Mixtral GGUFs hold each expert as its own 2-D `ffn_{gate,up,down}.E`: the same model.
#[test]
fn gguf_mixtral_f32_per_expert_tensors_match_transformers_expert_for_expert() {
    use gpu_offload::model::gguf::{GgufFile, MetaValue, RawTensor, write};
    let src = fixtures().join("gguf/mixtral-f32.gguf");
    let f = GgufFile::open(&src).unwrap();
    let meta: Vec<(&str, MetaValue)> = f
        .metadata
        .entries
        .iter()
        .map(|(k, v)| (k.as_str(), v.clone()))
        .collect();
    let mut tensors = Vec::new();
    for t in f.tensors.values() {
        let bytes = f.tensor_bytes(t);
        match t.name.strip_suffix("_exps.weight") {
            Some(base) => {
                // GGML dims [cols, rows, experts]: expert e is the e-th slice.
                let experts = t.dims[2] as usize;
                let per = bytes.len() / experts;
                for e in 0..experts {
                    tensors.push(RawTensor {
                        name: format!("{base}.{e}.weight"),
                        dims: t.dims[..2].to_vec(),
                        ggml_type: 0,
                        bytes: bytes[e * per..(e + 1) * per].to_vec(),
                    });
                }
            }
            None => tensors.push(RawTensor {
                name: t.name.clone(),
                dims: t.dims.clone(),
                ggml_type: 0,
                bytes: bytes.to_vec(),
            }),
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mixtral-2d.gguf");
    write(&path, &meta, &tensors).unwrap();
    assert!(
        GgufFile::open(&path)
            .unwrap()
            .tensor_info("blk.1.ffn_down.3.weight")
            .is_some()
    );
    moe("mixtral", &path);
}

#[test]
fn opt_f16_matches_transformers() {
    hf("opt");
}

#[test]
fn llama_with_tokenizer_json_matches_transformers() {
    hf("llama-tok");
}

#[test]
fn gguf_llama_f32_with_permuted_qk_matches_transformers() {
    let f = fixtures();
    check(
        &f.join("gguf/llama-gqa-f32.gguf"),
        &f.join("hf/llama-gqa/reference.json"),
        1e-3,
    );
}

#[test]
fn gguf_qwen2_f16_halves_rope_matches_transformers() {
    let f = fixtures();
    check(
        &f.join("gguf/qwen2-bias-f16.gguf"),
        &f.join("hf/qwen2-bias/reference.json"),
        1e-3,
    );
}

#[test]
fn gguf_qwen3_f32_qk_norm_matches_transformers() {
    let f = fixtures();
    check(
        &f.join("gguf/qwen3-f32.gguf"),
        &f.join("hf/qwen3/reference.json"),
        1e-3,
    );
}

/// Quantized weights multiply 8-bit activations (as llama.cpp does), so the reference — the exact
/// function of the dequantized weights — is met to about 1.5e-2, llama.cpp's own distance.
#[test]
fn gguf_llama_q8_0_matches_dequantized_reference() {
    let f = fixtures().join("gguf");
    check(
        &f.join("llama-gqa-q8_0.gguf"),
        &f.join("llama-gqa-q8_0.reference.json"),
        3e-2,
    );
}

#[test]
fn gguf_llama_q4_1_matches_dequantized_reference() {
    let f = fixtures().join("gguf");
    check(
        &f.join("llama-gqa-q4_1.gguf"),
        &f.join("llama-gqa-q4_1.reference.json"),
        3e-2,
    );
}
