//! KV cache element types: an f16 cache (the default on devices) gives logits within 1e-2
//! (relative to the largest logit) of the f32 cache at every position, and the same greedy
//! continuation, on stories260K and every HF fixture; Q8_0 is measured and reported.

mod common;

use std::path::Path;

use gpu_offload::backend::KvType;
use gpu_offload::backend::cpu::CpuBackend;
use gpu_offload::engine::{Engine, GenerateParams, Logits, SamplerParams, generate};
use gpu_offload::model::Model;

/// Worst over positions of max |a − b| / max |b|.
fn worst_relative(a: &[f32], b: &[f32], vocab: usize) -> f32 {
    a.chunks(vocab)
        .zip(b.chunks(vocab))
        .map(|(x, y)| {
            let d = x.iter().zip(y).fold(0f32, |m, (p, q)| m.max((p - q).abs()));
            d / y.iter().fold(1e-30f32, |m, v| m.max(v.abs()))
        })
        .fold(0f32, f32::max)
}

/// All-position logits of `prompt` and the greedy continuation of `tokens` tokens.
fn run(model: &Model, kv: KvType, prompt: &[u32], tokens: usize) -> (Vec<f32>, Vec<u32>) {
    let e = common::cpu_engine(model, kv);
    let mut s = e.new_session(prompt.len() + tokens).unwrap();
    let logits = e.forward(&mut s, prompt, Logits::All).unwrap();
    let mut s = e.new_session(prompt.len() + tokens).unwrap();
    let params = GenerateParams {
        max_tokens: tokens,
        sampler: SamplerParams::greedy(),
        stop_at_eog: false,
    };
    let g = generate(&e, &mut s, prompt, &params, &|_| false, &mut |_| true).unwrap();
    (logits, g.tokens)
}

fn check(path: &Path, prompt: &[u32], tokens: usize) {
    let model = Model::load(path).unwrap();
    let vocab = model.spec.vocab_size;
    let (want, want_ids) = run(&model, KvType::F32, prompt, tokens);
    let (got, got_ids) = run(&model, KvType::F16, prompt, tokens);
    let e16 = worst_relative(&got, &want, vocab);
    let mut line = format!("{}: f16 KV {e16:.2e}", path.display());
    if KvType::Q8_0.check_cols(model.spec.kv_dim()).is_ok() {
        let (q8, q8_ids) = run(&model, KvType::Q8_0, prompt, tokens);
        let agree = q8_ids
            .iter()
            .zip(&want_ids)
            .take_while(|(a, b)| a == b)
            .count();
        line += &format!(
            ", q8_0 KV {:.2e} (greedy agrees for {agree}/{tokens})",
            worst_relative(&q8, &want, vocab)
        );
    }
    println!("{line}");
    assert!(e16 <= 1e-2, "{line}");
    assert_eq!(
        got_ids,
        want_ids,
        "{}: greedy ids with f16 KV",
        path.display()
    );
}

#[test]
fn f16_kv_matches_f32_on_stories260k() {
    check(
        &common::stories260k(),
        &[1, 403, 407, 261, 378, 261, 411],
        48,
    );
}

#[test]
fn f16_kv_matches_f32_on_hf_fixtures() {
    for name in ["llama-gqa", "relu-llama", "qwen2-bias", "opt", "llama-tok"] {
        let dir = common::fixtures().join("hf").join(name);
        check(&dir, &[5, 17, 99, 3, 42, 8, 61, 2], 24);
    }
}

#[test]
fn q8_0_kv_refuses_rows_it_cannot_block() {
    use gpu_offload::model::synth::{SynthSpec, synthesize};
    // KV rows of 2 heads × 24 values: not whole 32-value blocks.
    let spec = SynthSpec {
        d_model: 48,
        n_heads: 2,
        n_kv_heads: 2,
        ..SynthSpec::preset("tiny").unwrap()
    };
    let dir = tempfile::tempdir().unwrap();
    synthesize(&spec, &dir.path().join("m"), false, &mut |_, _| {}).unwrap();
    let model = Model::load(&dir.path().join("m")).unwrap();
    assert_eq!(model.spec.kv_dim(), 48);
    let e = Engine::new(
        CpuBackend::new(1).unwrap(),
        model.spec.clone(),
        &model.weights,
    )
    .unwrap();
    let msg = match e.with_kv_type(KvType::Q8_0) {
        Ok(_) => panic!("a q8_0 cache of 48-value rows was accepted"),
        Err(err) => err.to_string(),
    };
    assert!(
        msg.contains("q8_0") && msg.contains("--kv-type f16"),
        "{msg}"
    );
}
