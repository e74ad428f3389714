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
            let mut session = engine.new_session(prompt_ids.len() + want.len()).unwrap();
            let params = GenerateParams {
                max_tokens: want.len(),
                sampler: SamplerParams::greedy(),
                stop_at_eog: false,
            };
            let g = generate(
                &engine,
                &mut session,
                &prompt_ids,
                &params,
                &|_| false,
                &mut |_| true,
            )
            .unwrap();
            let agree = g
                .tokens
                .iter()
                .zip(&want)
                .take_while(|(a, b)| a == b)
                .count();
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
