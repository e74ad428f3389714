//! The dense CPU engine against transformers: logits at every position and greedy continuations
//! of the generated fixtures (tests/fixtures/hf, tests/fixtures/gguf; see their README).

mod common;

use std::path::Path;
use std::sync::{Arc, Mutex};

use common::{fixtures, ids};

use gpu_offload::backend::Route;
use gpu_offload::backend::cpu::CpuBackend;
use gpu_offload::engine::{Engine, GenerateParams, Logits, RouteTap, SamplerParams, generate};
use gpu_offload::model::Model;
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

/// Records each layer's experts per token, ascending, as the fixtures list them.
#[derive(Default)]
struct Routes(Mutex<Vec<Vec<Vec<u32>>>>);

impl RouteTap for Routes {
    fn routed(&self, layer: usize, rows: usize, routes: &[Route]) {
        let mut all = self.0.lock().unwrap();
        if all.len() <= layer {
            all.resize(layer + 1, Vec::new());
        }
        let mut per_token = vec![Vec::new(); rows];
        for r in routes {
            per_token[r.token as usize].push(r.expert);
        }
        for mut ids in per_token {
            ids.sort_unstable();
            all[layer].push(ids);
        }
    }
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
    let tap = Arc::new(Routes::default());
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
    let got = tap.0.lock().unwrap().clone();
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
fn gguf_qwen3moe_f32_matches_transformers_expert_for_expert() {
    moe("qwen3-moe", &fixtures().join("gguf/qwen3-moe-f32.gguf"));
}

#[test]
fn gguf_mixtral_f32_3d_experts_matches_transformers_expert_for_expert() {
    moe("mixtral", &fixtures().join("gguf/mixtral-f32.gguf"));
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
