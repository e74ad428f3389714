//! The engine on real trained models against llama.cpp (tests/fixtures/llamacpp, written by
//! scripts/llamacpp_reference.py): prompt token ids, greedy continuations, logits.
//!
//! stories260K is f32 end to end, so its 64-token greedy runs must be identical. SmolLM2 is 4-bit
//! with 8-bit activations in both engines; rounding differs, and where llama.cpp's top-2 margin is
//! tiny its choice is not determined by the model: llama.cpp's own other configurations (f32 KV
//! cache, flash attention; recorded in the fixture) flip there too. So for SmolLM2 the test asks
//! for agreement up to 16 tokens or up to where llama.cpp disagrees with itself, whichever comes
//! first, and checks that every divergence happens at a small llama.cpp margin.

mod common;

use std::path::Path;

use common::ids;
use gpu_offload::backend::cpu::{CpuBackend, kernels};
use gpu_offload::engine::{Engine, GenerateParams, Logits, SamplerParams, generate};
use gpu_offload::model::Model;
use serde_json::Value;

fn fixture(name: &str) -> Value {
    common::json_fixture(&format!("llamacpp/{name}.json"))
}

/// `n` greedy tokens after `prompt`, not stopping at end-of-generation.
fn greedy(engine: &Engine<CpuBackend>, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut session = engine.new_session(prompt.len() + n).unwrap();
    let params = GenerateParams {
        max_tokens: n,
        sampler: SamplerParams::greedy(),
        stop_at_eog: false,
    };
    generate(
        engine,
        &mut session,
        prompt,
        &params,
        &|_| false,
        &mut |_| true,
    )
    .unwrap()
    .tokens
}

struct Run {
    prompt: String,
    agree: usize,
    /// llama.cpp's top-1 minus top-2 logit at our first divergence.
    gap: Option<f64>,
    /// Shortest agreement of llama.cpp's other configurations with its default.
    self_agree: usize,
}

/// Greedy runs of every fixture case with every kernel set this CPU has.
fn greedy_runs(model_path: &Path, fx: &Value) -> Vec<(&'static str, Vec<Run>)> {
    let model = Model::load(model_path).unwrap();
    let tok = model.tokenizer.as_ref().expect("tokenizer");
    let mut out = Vec::new();
    for k in kernels::available() {
        let engine = Engine::new(
            CpuBackend::with_kernels(2, k).unwrap(),
            model.spec.clone(),
            &model.weights,
        )
        .unwrap();
        let mut runs = Vec::new();
        for case in fx["greedy"].as_array().unwrap() {
            let prompt = case["prompt"].as_str().unwrap();
            let parse_special = case["parse_special"].as_bool().unwrap();
            let prompt_ids = tok.encode(prompt, true, parse_special).unwrap();
            assert_eq!(
                prompt_ids,
                ids(&case["prompt_ids"]),
                "prompt ids of {prompt:?}"
            );
            let want = ids(&case["greedy_ids"]);
            let tokens = greedy(&engine, &prompt_ids, want.len());
            let agree = tokens.iter().zip(&want).take_while(|(a, b)| a == b).count();
            let gap = (agree < want.len()).then(|| {
                let top = &case["top5"][agree];
                top[0][1].as_f64().unwrap() - top[1][1].as_f64().unwrap()
            });
            let self_agree = case["variant_agreement"]
                .as_object()
                .unwrap()
                .values()
                .map(|v| v.as_u64().unwrap() as usize)
                .min()
                .unwrap();
            runs.push(Run {
                prompt: prompt.to_string(),
                agree,
                gap,
                self_agree,
            });
        }
        out.push((k.name, runs));
    }
    out
}

#[test]
fn stories260k_greedy_64_tokens_equal_llama_cpp() {
    let fx = fixture("stories260K");
    for (kernels, runs) in greedy_runs(&common::stories260k(), &fx) {
        for r in runs {
            assert_eq!(
                r.agree, 64,
                "{kernels}: {:?} diverges at token {}",
                r.prompt, r.agree
            );
        }
    }
}

#[test]
fn stories260k_logits_match_llama_cpp() {
    let fx = fixture("stories260K");
    let model = Model::load(&common::stories260k()).unwrap();
    let engine = Engine::new(
        CpuBackend::new(2).unwrap(),
        model.spec.clone(),
        &model.weights,
    )
    .unwrap();
    for case in fx["greedy"].as_array().unwrap() {
        let prompt_ids = ids(&case["prompt_ids"]);
        let want: Vec<f64> = case["first_logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        let mut s = engine.new_session(prompt_ids.len()).unwrap();
        let got = engine.forward(&mut s, &prompt_ids, Logits::Last).unwrap();
        let diff = got
            .iter()
            .zip(&want)
            .fold(0f64, |m, (a, b)| m.max((*a as f64 - b).abs()));
        let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
        // llama.cpp keeps its KV cache in f16; ours is f32.
        assert!(
            diff / scale < 1e-3,
            "relative logit difference {}",
            diff / scale
        );
    }
}

#[test]
fn smollm2_greedy_follows_llama_cpp_wherever_it_is_determined() {
    let Some(path) = common::smollm2() else {
        return;
    };
    let fx = fixture("SmolLM2-135M-Instruct.Q4_1");
    for (kernels, runs) in greedy_runs(&path, &fx) {
        println!("kernels {kernels}:");
        let (mut ours, mut theirs) = (0, 0);
        for r in &runs {
            println!(
                "  {:40} agree {:2}  llama.cpp self-agreement {:2}  llama.cpp margin at divergence {}",
                format!("{:?}", r.prompt),
                r.agree,
                r.self_agree,
                r.gap.map_or("-".into(), |g| format!("{g:.4}"))
            );
            let need = r.self_agree.min(16);
            assert!(
                r.agree >= need,
                "{kernels}: {:?} agrees for {} tokens, needs {need}",
                r.prompt,
                r.agree
            );
            if let Some(g) = r.gap {
                assert!(
                    g < 0.5,
                    "{kernels}: {:?} diverges where llama.cpp is sure (margin {g})",
                    r.prompt
                );
            }
            ours += r.agree;
            theirs += r.self_agree;
        }
        assert!(
            ours >= theirs,
            "{kernels}: {ours} agreeing tokens in all, llama.cpp's own configurations {theirs}"
        );
    }
}

/// The synthetic tiny Qwen3-MoE (8 experts, top 2) as `synth` writes it, f16 and Q4_K_M,
/// against llama.cpp running the same files (tests/fixtures/llamacpp/tiny-moe.json, written by
/// scripts/llamacpp_moe_reference.py): the same bytes (sha256), the same greedy tokens, and
/// logits at every recorded position within llama.cpp's own rounding (f16 activations for f16
/// weights; 8-bit activations for the K-quants, in both engines).
#[test]
fn synth_tiny_moe_matches_llama_cpp() {
    use gpu_offload::model::quant_mix::QuantMix;
    use gpu_offload::model::synth::{SynthSpec, synthesize_gguf};
    use sha2::{Digest, Sha256};
    let fx = fixture("tiny-moe");
    let dir = tempfile::tempdir().unwrap();
    for m in fx["models"].as_array().unwrap() {
        let dtype = m["dtype"].as_str().unwrap();
        let path = dir.path().join(format!("{dtype}.gguf"));
        let quant = (dtype != "f16").then(|| QuantMix::parse(dtype).unwrap());
        let spec = SynthSpec::preset("tiny-moe").unwrap();
        synthesize_gguf(&spec, &path, false, quant, &mut |_, _| {}).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let sha: String = Sha256::digest(&bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(
            sha,
            m["sha256"].as_str().unwrap(),
            "{dtype}: synth no longer writes the file the fixture was made from: rerun \
             scripts/llamacpp_moe_reference.py"
        );
        let model = Model::load(&path).unwrap();
        let engine = Engine::new(
            CpuBackend::with_kernels(2, kernels::best()).unwrap(),
            model.spec.clone(),
            &model.weights,
        )
        .unwrap();
        let input = ids(&m["input_ids"]);
        let mut session = engine.new_session(input.len()).unwrap();
        let got = engine.forward(&mut session, &input, Logits::All).unwrap();
        let want: Vec<f64> = m["logits"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|row| row.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()))
            .collect();
        assert_eq!(got.len(), want.len());
        let scale = want.iter().fold(0f64, |a, w| a.max(w.abs()));
        let diff = got
            .iter()
            .zip(&want)
            .fold(0f64, |a, (g, w)| a.max((f64::from(*g) - w).abs()));
        let rel = diff / scale;
        println!("tiny-moe {dtype}: logits differ from llama.cpp's by {rel:.2e} of their scale");
        // Measured here: f16 4.3e-4 (llama.cpp rounds activations to f16), Q4_K_M 1.5e-6.
        let tol = if dtype == "f16" { 2e-3 } else { 1e-4 };
        assert!(rel < tol, "{dtype}: {rel:.2e} ≥ {tol:.0e}");
        let prompt = ids(&m["greedy"]["prompt_ids"]);
        let want = ids(&m["greedy"]["generated_ids"]);
        assert_eq!(
            greedy(&engine, &prompt, want.len()),
            want,
            "{dtype}: greedy tokens"
        );
    }
}
