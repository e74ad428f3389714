//! Continuous batching in the engine: one step evaluates the next token of several sessions
//! (each at its own position, over its own KV cache, with or without a query probe), and every
//! session's logits are the ones it gets alone — bit for bit — on the CPU (f32 and a Q4_1
//! model) and on the budgeted device streaming its weights, with the KV cache on the device or
//! in host memory; the weights pass once per step, not once per session.

mod common;

use common::greedy as argmax;
use gpu_offload::backend::sim::SimBackend;
use gpu_offload::backend::{Backend, KvType};
use gpu_offload::engine::{Engine, Logits, Session};
use gpu_offload::footprint::Ledger;
use gpu_offload::model::Model;
use gpu_offload::plan::{Budget, HardwareProfile, make_plan};

const STEPS: usize = 5;

/// Prompts of different lengths (so positions differ within a step).
fn prompts(vocab: usize, count: usize) -> Vec<Vec<u32>> {
    common::varied_prompts(vocab, count, 3, 5)
}

fn alone<B: Backend>(e: &Engine<B>, prompts: &[Vec<u32>], probe: bool) -> Vec<Vec<Vec<f32>>> {
    common::decode_alone(e, prompts, STEPS, probe)
}

fn batched<B: Backend>(e: &Engine<B>, prompts: &[Vec<u32>], probe: bool) -> Vec<Vec<Vec<f32>>> {
    common::decode_batched(e, prompts, STEPS, probe)
}

fn same<B: Backend>(e: &Engine<B>, what: &str) {
    let ps = prompts(e.spec().vocab_size, 5);
    for probe in [false, true] {
        let a = alone(e, &ps, probe);
        let b = batched(e, &ps, probe);
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert!(
                x == y,
                "{what}, probe {probe}: session {i}'s logits differ when batched"
            );
        }
    }
}

#[test]
fn batched_decode_equals_each_session_alone_on_the_cpu() {
    let m = Model::load(&common::stories260k()).unwrap();
    same(&common::cpu_engine(&m, KvType::F32), "stories260K f32");
    same(
        &common::cpu_engine(&m, KvType::Q8_0),
        "stories260K, Q8_0 KV",
    );
    if let Some(p) = common::smollm2() {
        let m = Model::load(&p).unwrap();
        same(&common::cpu_engine(&m, KvType::F16), "SmolLM2 Q4_1");
    }
}

#[test]
fn batched_decode_streams_the_weights_once_per_step_on_the_budgeted_device() {
    let dir = tempfile::tempdir().unwrap();
    let store = common::store_of(&common::stories260k(), &dir);
    let hw = HardwareProfile::load("cpu-sim").unwrap();
    let sessions = 5;
    let b = |g| Budget {
        kv_type: KvType::F16,
        sessions,
        probe: true,
        logit_rows: sessions,
        ..Budget::new(g, None, 1, 64, 32)
    };
    let (min, all) = common::gpu_range(&store.manifest, &hw, b);
    let mut measured = 0;
    for g in [min, min + (all - min) / 4, min + (all - min) / 2, all] {
        let plan = make_plan(&store.manifest, &b(g), &hw).unwrap();
        let ledger = Ledger::new(Some(plan.ledger_budget()), None);
        let e = common::offloaded(&store, &plan, &ledger, KvType::F16);
        let what = format!("{g} bytes, {:?}", plan.prefill);
        same(&e, &what);
        assert!(
            ledger.snapshot().hbm_peak <= plan.gpu.placed,
            "{what}: peak"
        );
        // One batched step of all sessions moves the streamed weights once: what one session's
        // step moves, plus only the other sessions' own rows (inputs, KV in host memory).
        let ps = prompts(e.spec().vocab_size, sessions);
        let mut ss: Vec<Session<SimBackend>> =
            ps.iter().map(|_| e.new_session(64).unwrap()).collect();
        for (s, p) in ss.iter_mut().zip(&ps) {
            e.forward(s, p, Logits::Last).unwrap();
        }
        e.settle();
        let before = ledger.snapshot();
        if e.prefill().group < sessions {
            continue;
        }
        let mut calls: Vec<(&mut Session<SimBackend>, u32)> =
            ss.iter_mut().map(|s| (s, 5u32)).collect();
        e.decode_many(&mut calls).unwrap();
        e.settle();
        let moved = ledger.snapshot().h2d_bytes - before.h2d_bytes;
        eprintln!("{what}: a step of {sessions} sessions moved {moved} bytes");
        let kv_in: u64 = ps
            .iter()
            .map(|p| plan.decode_bytes_at(p.len()).0 - plan.decode_bytes_at(0).0)
            .sum();
        let one = plan.decode_bytes_at(0).0;
        // Each other session's own rows: its input, and where attention runs on the CPU its
        // attention output per layer.
        let spec = &store.manifest.spec;
        let own = 4 * spec.d_model as u64
            + if plan.prefill.cpu_attention {
                4 * (spec.n_layers * spec.q_dim()) as u64
            } else {
                0
            };
        let rows = (sessions as u64 - 1) * own;
        assert!(
            moved <= one + kv_in + rows,
            "{what}: a step of {sessions} moved {moved} bytes; one session's step moves {one}"
        );
        measured += usize::from(plan.streams());
    }
    assert!(measured > 0, "no budget streamed with a step of {sessions}");
}

/// Prompts join a step of sequences being decoded: three sessions decode while two more bring
/// their whole prompts into the same steps (continuous batching with prefill); every call's
/// logits are the ones it gets alone, bit for bit.
fn prompts_join_decode_steps<B: Backend>(e: &Engine<B>, what: &str) {
    let ps = prompts(e.spec().vocab_size, 5);
    let want = alone(e, &ps, true);
    let prompt_logits: Vec<Vec<f32>> = ps
        .iter()
        .map(|p| {
            let mut s = e.new_session(64).unwrap();
            e.forward(&mut s, p, Logits::Last).unwrap()
        })
        .collect();
    let mut ss: Vec<Session<B>> = ps.iter().map(|_| e.new_session(64).unwrap()).collect();
    for s in &mut ss {
        e.enable_probe(s).unwrap();
    }
    let mut last: Vec<Vec<f32>> = vec![Vec::new(); ps.len()];
    for i in 0..3 {
        last[i] = e.forward(&mut ss[i], &ps[i], Logits::Last).unwrap();
    }
    let mut got: Vec<Vec<Vec<f32>>> = vec![Vec::new(); ps.len()];
    // Steps 0 and 1: sessions 3 and 4 join with their prompts, one a step.
    for step in 0..STEPS + 2 {
        let joining = (step < 2).then_some(3 + step);
        let next: Vec<[u32; 1]> = last
            .iter()
            .map(|l| [if l.is_empty() { 0 } else { argmax(l) }])
            .collect();
        let mut calls: Vec<(usize, &mut Session<B>, &[u32])> = ss
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| !last[*i].is_empty() || joining == Some(*i))
            .filter(|(i, _)| got[*i].len() < STEPS || joining == Some(*i))
            .map(|(i, s)| {
                let toks: &[u32] = if joining == Some(i) { &ps[i] } else { &next[i] };
                (i, s, toks)
            })
            .collect();
        if calls.is_empty() {
            break;
        }
        let rows: usize = calls.iter().map(|c| c.2.len()).sum();
        assert!(
            rows <= e.prefill().group,
            "{what}: the test's step is too large"
        );
        let ids: Vec<usize> = calls.iter().map(|c| c.0).collect();
        let mut args: Vec<(&mut Session<B>, &[u32])> =
            calls.iter_mut().map(|(_, s, t)| (&mut **s, *t)).collect();
        let logits = e.step_many(&mut args).unwrap();
        for (i, l) in ids.into_iter().zip(logits) {
            if joining == Some(i) {
                assert!(
                    l == prompt_logits[i],
                    "{what}: session {i}'s prompt logits differ"
                );
            } else {
                got[i].push(l.clone());
            }
            last[i] = l;
        }
    }
    for (i, (w, g)) in want.iter().zip(&got).enumerate() {
        assert!(
            w == g,
            "{what}: session {i}'s decode differs beside joining prompts"
        );
    }
}

#[test]
fn prompts_join_decode_steps_and_answer_as_alone() {
    let m = Model::load(&common::stories260k()).unwrap();
    prompts_join_decode_steps(&common::cpu_engine(&m, KvType::F32), "stories260K f32");
    prompts_join_decode_steps(
        &common::cpu_engine(&m, KvType::Q8_0)
            .with_kv_pool(40)
            .unwrap(),
        "stories260K, Q8_0 KV in a pool",
    );
    let dir = tempfile::tempdir().unwrap();
    let store = common::store_of(&common::stories260k(), &dir);
    let hw = HardwareProfile::load("cpu-sim").unwrap();
    let b = |g| Budget {
        kv_type: KvType::F16,
        sessions: 5,
        probe: true,
        logit_rows: 5,
        ..Budget::new(g, None, 1, 64, 64)
    };
    let (min, all) = common::gpu_range(&store.manifest, &hw, b);
    let mut ran = 0;
    for g in [min, min + (all - min) / 2, all] {
        let plan = make_plan(&store.manifest, &b(g), &hw).unwrap();
        // The test's largest step: a prompt of 23 tokens beside four decoded ones.
        if plan.prefill.group < 27 {
            continue;
        }
        ran += 1;
        let ledger = Ledger::new(Some(plan.ledger_budget()), None);
        let e = common::offloaded(&store, &plan, &ledger, KvType::F16);
        prompts_join_decode_steps(&e, &format!("{g} bytes, {:?}", plan.prefill));
        assert!(ledger.snapshot().hbm_peak <= plan.gpu.placed, "{g}: peak");
    }
    assert!(ran >= 2, "the budgeted device ran {ran} budgets");
}

/// Mixture-of-experts models batch as dense ones do: a step's tokens are grouped by expert (one
/// product per expert), and every session's logits are its own alone, bit for bit — the f32
/// Qwen2-MoE with its shared expert, and the tiny synthetic Qwen3-MoE in Q4_K_M.
#[test]
fn mixture_of_experts_models_batch_bit_for_bit() {
    let m = Model::load(&common::fixtures().join("hf/qwen2-moe")).unwrap();
    let e = common::cpu_engine(&m, KvType::F32);
    same(&e, "Qwen2-MoE f32");
    prompts_join_decode_steps(&e, "Qwen2-MoE f32");
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("tiny-moe-q4_k_m.gguf");
    let spec = gpu_offload::model::synth::SynthSpec::preset("tiny-moe").unwrap();
    let q = gpu_offload::model::quant_mix::QuantMix::Q4KM;
    gpu_offload::model::synth::synthesize_gguf(&spec, &p, false, Some(q), &mut |_, _| {}).unwrap();
    let m = Model::load(&p).unwrap();
    let e = common::cpu_engine(&m, KvType::F16);
    same(&e, "tiny MoE Q4_K_M");
    prompts_join_decode_steps(&e, "tiny MoE Q4_K_M");
}
