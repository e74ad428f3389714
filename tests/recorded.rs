//! Recorded decode steps (`--cuda-graphs`) on the budgeted device, which records as CUDA would:
//! the ops between a token's embedding and its logits read their position from the step's, and
//! anything a CUDA graph cannot hold (an allocation, a copy between host and device, a wait)
//! fails; every replay issues its ops again and fails if they differ from the recording in
//! anything but the position (a buffer, a shape, an op), which a real graph would have run
//! regardless. So these tests prove on the CPU what the engine does with recordings: which steps
//! it replays, when it records again, and that a recorded session answers exactly as a plain one.

mod common;

use gpu_offload::backend::KvType;
use gpu_offload::backend::cpu::CpuBackend;
use gpu_offload::backend::sim::SimBackend;
use gpu_offload::engine::{Engine, Logits, Session};
use gpu_offload::footprint::Ledger;
use gpu_offload::model::Model;

const CTX: usize = 96;

fn engine(m: &Model, kv: KvType, pool: bool, record: bool) -> Engine<SimBackend> {
    let sim = SimBackend::new(CpuBackend::new(2).unwrap(), Ledger::new(None, None));
    let e = Engine::new(sim, m.spec.clone(), &m.weights)
        .unwrap()
        .with_kv_type(kv)
        .unwrap()
        .with_recorded_steps(record);
    if pool {
        // Room for two sessions' whole contexts: blocks are taken as they grow.
        e.with_kv_pool(2 * CTX.div_ceil(gpu_offload::backend::KV_BLOCK))
            .unwrap()
    } else {
        e
    }
}

/// Greedy decode of `steps` tokens after `prompt`: every call's logits.
fn decode(
    e: &Engine<SimBackend>,
    s: &mut Session<SimBackend>,
    prompt: &[u32],
    steps: usize,
) -> Vec<Vec<f32>> {
    let mut out = vec![e.forward(s, prompt, Logits::Last).unwrap()];
    for _ in 0..steps {
        let t = common::greedy(out.last().unwrap());
        out.push(e.forward(s, &[t], Logits::Last).unwrap());
    }
    out
}

fn prompt(vocab: usize) -> Vec<u32> {
    common::varied_prompts(vocab, 1, 5, 0).remove(0)
}

#[test]
fn recorded_decode_equals_plain_decode_bit_for_bit() {
    // The GPU machine's test (tests/gpu.rs) runs the synthesized ones.
    let dir = tempfile::tempdir().unwrap();
    let mut models: Vec<Model> = common::recordable_models(&dir)
        .into_iter()
        .map(|(_, m)| m)
        .collect();
    models.extend(common::smollm2().map(|p| Model::load(&p).unwrap()));
    for m in &models {
        decode_recorded_and_plain(m);
    }
}

fn decode_recorded_and_plain(m: &Model) {
    let p = prompt(m.spec.vocab_size);
    // 40 steps cross two 16-position blocks of a pooled session: its block table changes
    // between replays (written before the step, outside the recording).
    let steps = 40;
    for kv in [KvType::F16, KvType::Q8_0, KvType::F32] {
        for pool in [false, true] {
            let what = format!("{}: {kv:?} cache, pooled {pool}", m.spec.name);
            let plain = engine(m, kv, pool, false);
            let want = decode(&plain, &mut plain.new_session(CTX).unwrap(), &p, steps);
            let rec = engine(m, kv, pool, true);
            let got = decode(&rec, &mut rec.new_session(CTX).unwrap(), &p, steps);
            assert!(want == got, "{what}: recorded logits differ");
            // The first decode step runs plainly, the second is recorded, the rest replayed.
            assert_eq!(rec.recorded_steps(), (1, steps as u64 - 2), "{what}");
            assert_eq!(plain.recorded_steps(), (0, 0), "{what}");
        }
    }
}

/// Two sessions take turns; halfway a third is made and takes a prompt longer than any so far
/// (allocations: its cache, and step buffers for more rows, which replace the ones the
/// recordings name; so each session runs a plain step and records again), and the first goes
/// back three positions and decodes from there.
fn interleaved(e: &Engine<SimBackend>, vocab: usize) -> Vec<Vec<f32>> {
    let ps = common::varied_prompts(vocab, 2, 4, 3);
    let mut a = e.new_session(CTX).unwrap();
    let mut b = e.new_session(CTX).unwrap();
    let mut out = vec![
        e.forward(&mut a, &ps[0], Logits::Last).unwrap(),
        e.forward(&mut b, &ps[1], Logits::Last).unwrap(),
    ];
    let mut next = [common::greedy(&out[0]), common::greedy(&out[1])];
    let mut third = None;
    for step in 0..16 {
        if step == 8 {
            let mut c = e.new_session(CTX).unwrap();
            let long = common::varied_prompts(vocab, 3, 4, 5).remove(2);
            out.push(e.forward(&mut c, &long, Logits::Last).unwrap());
            third = Some(c);
            a.truncate(a.position() - 3);
        }
        for (i, s) in [&mut a, &mut b].into_iter().enumerate() {
            let l = e.forward(s, &[next[i]], Logits::Last).unwrap();
            next[i] = common::greedy(&l);
            out.push(l);
        }
    }
    drop(third);
    out
}

#[test]
fn sessions_taking_turns_record_again_after_an_allocation() {
    let Some(path) = common::smollm2() else {
        return;
    };
    let m = Model::load(&path).unwrap();
    for pool in [false, true] {
        let plain = engine(&m, KvType::F16, pool, false);
        let want = interleaved(&plain, m.spec.vocab_size);
        let rec = engine(&m, KvType::F16, pool, true);
        let got = interleaved(&rec, m.spec.vocab_size);
        assert!(want == got, "pooled {pool}: recorded logits differ");
        // Each session: plain, recorded, 6 replays; after the allocation: plain, recorded, 6.
        assert_eq!(rec.recorded_steps(), (4, 24), "pooled {pool}");
    }
}

#[test]
fn heads_only_the_simple_kernel_takes_are_recorded_too() {
    // stories260K's heads are 8 wide: CUDA attends them with the simple kernel, which reads a
    // recorded step's position from device memory as the split kernel does.
    let m = Model::load(&common::stories260k()).unwrap();
    let p = prompt(m.spec.vocab_size);
    let plain = engine(&m, KvType::F16, false, false);
    let want = decode(&plain, &mut plain.new_session(CTX).unwrap(), &p, 12);
    let rec = engine(&m, KvType::F16, false, true);
    let got = decode(&rec, &mut rec.new_session(CTX).unwrap(), &p, 12);
    assert!(want == got);
    // Plain, recorded, then 10 replays.
    assert_eq!(rec.recorded_steps(), (1, 10));
}

#[test]
fn a_budget_with_no_room_for_the_step_position_decodes_unrecorded() {
    use gpu_offload::backend::Backend;
    let dir = tempfile::tempdir().unwrap();
    let (_, m) = common::recordable_models(&dir).remove(0);
    let p = prompt(m.spec.vocab_size);
    let plain = engine(&m, KvType::F16, false, false);
    let want = decode(&plain, &mut plain.new_session(CTX).unwrap(), &p, 6);
    // A budget the engine, a session and its steps fill to the last granule.
    let budget = 64 << 20;
    let ledger = Ledger::new(Some(budget), None);
    let sim = SimBackend::new(CpuBackend::new(2).unwrap(), ledger.clone());
    let rec = Engine::new(sim, m.spec.clone(), &m.weights)
        .unwrap()
        .with_kv_type(KvType::F16)
        .unwrap()
        .with_recorded_steps(true);
    let mut s = rec.new_session(CTX).unwrap();
    let mut got = vec![rec.forward(&mut s, &p, Logits::Last).unwrap()];
    // The prompt's step buffers serve the decode steps too; the rest of the budget is filled.
    let free = budget - ledger.snapshot().hbm_used;
    let _filler = rec.backend().alloc(1, free as usize / 4).unwrap();
    assert_eq!(ledger.snapshot().hbm_used, budget);
    for _ in 0..6 {
        let t = common::greedy(got.last().unwrap());
        got.push(rec.forward(&mut s, &[t], Logits::Last).unwrap());
    }
    assert!(want == got, "unrecorded steps differ");
    assert_eq!(rec.recorded_steps(), (0, 0));
}

#[test]
fn a_lone_sequence_in_batched_steps_is_recorded() {
    // A server with one client decodes through step_many: with recording on, a lone one-token
    // call takes its own step, recorded and replayed, with the batched step's logits.
    let dir = tempfile::tempdir().unwrap();
    let (_, m) = common::recordable_models(&dir).remove(1);
    let p = prompt(m.spec.vocab_size);
    let run = |e: &Engine<SimBackend>| {
        let mut s = e.new_session(CTX).unwrap();
        let mut out = vec![e.forward(&mut s, &p, Logits::Last).unwrap()];
        for _ in 0..10 {
            let t = common::greedy(out.last().unwrap());
            let toks = [t];
            let mut calls = [(&mut s, &toks[..])];
            out.extend(e.step_many(&mut calls).unwrap());
        }
        out
    };
    for pool in [false, true] {
        let plain = engine(&m, KvType::F16, pool, false);
        let rec = engine(&m, KvType::F16, pool, true);
        assert!(run(&plain) == run(&rec), "pooled {pool}");
        assert_eq!(rec.recorded_steps(), (1, 8), "pooled {pool}");
    }
}

#[test]
fn a_probed_session_records_and_remembers_the_same_queries() {
    // Serve's sessions keep a density probe: a recorded step writes its query to a fixed row,
    // copied into the ring after the step. The density the ring gives, and the logits, are a
    // plain session's; 24 steps wrap the 16-query ring.
    let dir = tempfile::tempdir().unwrap();
    let (_, m) = common::recordable_models(&dir).remove(1);
    let p = prompt(m.spec.vocab_size);
    let run = |e: &Engine<SimBackend>| {
        let mut s = e.new_session(CTX).unwrap();
        e.enable_probe(&mut s).unwrap();
        let logits = decode(e, &mut s, &p, 24);
        (logits, e.attention_density(&mut s, 16).unwrap())
    };
    for pool in [false, true] {
        let plain = engine(&m, KvType::F16, pool, false);
        let rec = engine(&m, KvType::F16, pool, true);
        let (want, want_density) = run(&plain);
        let (got, got_density) = run(&rec);
        assert!(want == got, "pooled {pool}: logits differ");
        assert!(!want_density.is_empty());
        assert_eq!(want_density, got_density, "pooled {pool}: densities differ");
        assert_eq!(rec.recorded_steps(), (1, 22), "pooled {pool}");
    }
}

/// A recorded decode step of a Llama-shaped model (f16 cache) holds per layer exactly these
/// backend calls: the fused ones (the last layer's residual added inside this one's norm, q, k
/// and v in one matmul call, q and k rotated and k and v stored in one call, the attention's
/// residual added inside the FFN's norm, gate and up and their gated product in one call), 8
/// where the unfused layer took 16. On CUDA each is one kernel: 8 a layer for the f16 model and
/// for Q4_1 (rows of up to `QX_MAX_COLS`, quantized inside the matvecs), where the unfused layer
/// launched 18 and 25.
#[test]
fn a_recorded_decode_step_calls_the_fused_ops() {
    let dir = tempfile::tempdir().unwrap();
    let layer = [
        "add_rms_norm",
        "matmul_parts",
        "rope_store_kv",
        "attention",
        "matmul_into",
        "add_rms_norm",
        "gate_up",
        "matmul_into",
    ];
    for (weights, m) in common::recordable_models(&dir) {
        let e = engine(&m, KvType::F16, false, true);
        let mut s = e.new_session(CTX).unwrap();
        decode(&e, &mut s, &prompt(m.spec.vocab_size), 3);
        assert_eq!(e.recorded_steps().0, 1, "{weights}");
        let ops = e.backend().recorded_ops().unwrap();
        let n = m.spec.n_layers;
        // The first layer's norm has no residual before it.
        assert_eq!(ops[0], "rms_norm", "{weights}: {ops:?}");
        for l in 0..n {
            let at = &ops[l * layer.len()..(l + 1) * layer.len()];
            assert_eq!(at[1..], layer[1..], "{weights}: layer {l} of {ops:?}");
            if l > 0 {
                assert_eq!(at[0], layer[0], "{weights}: layer {l} of {ops:?}");
            }
        }
        // Then the last residual, and the head: the last row, its norm and the output matmul
        // (reshapes are no device work).
        let head: Vec<&str> = ops[n * layer.len()..]
            .iter()
            .copied()
            .filter(|&op| op != "reshape")
            .collect();
        assert_eq!(
            head,
            ["add", "copy_rows", "rms_norm", "matmul_into"],
            "{weights}"
        );
    }
}
