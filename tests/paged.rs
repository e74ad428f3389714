//! The paged KV pool: sessions take blocks of 16 positions from one pool as they grow (their
//! blocks interleaved there), and every session's logits equal the ones it gets with a cache of
//! its own, bit for bit, on the CPU and on the budgeted device; truncating gives blocks back; a
//! call the pool cannot hold is refused with every session as it was; the budgeted device holds
//! exactly the plan's pool and block tables, and growing takes no device memory.

mod common;

use gpu_offload::backend::{Backend, KV_BLOCK, KvType};
use gpu_offload::engine::{Engine, EngineError, Logits, PoolUsage, Session};
use gpu_offload::footprint::Ledger;
use gpu_offload::footprint::{kv_pool_bytes, kv_table_bytes};
use gpu_offload::model::Model;
use gpu_offload::plan::{Budget, HardwareProfile, make_plan};

const STEPS: usize = 6;
const CTX: usize = 80;

fn argmax(v: &[f32]) -> u32 {
    gpu_offload::engine::sampler::argmax(v)
}

/// Prompts of different lengths, so blocks fill at different steps.
fn prompts(vocab: usize, count: usize) -> Vec<Vec<u32>> {
    common::varied_prompts(vocab, count, 9, 11)
}

/// Every session's prompt in two halves, one session after another (so a paged pool hands
/// out its blocks interleaved), then batched decode steps; halfway, session 0 goes back to
/// position 5 and evaluates its tokens again. The logits of every call, per session.
fn run<B: Backend>(e: &Engine<B>, prompts: &[Vec<u32>]) -> Vec<Vec<Vec<f32>>> {
    let mut sessions: Vec<Session<B>> = prompts
        .iter()
        .map(|_| e.new_session(CTX).unwrap())
        .collect();
    let mut tokens: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    let mut out = vec![Vec::new(); prompts.len()];
    for half in 0..2 {
        for (i, p) in prompts.iter().enumerate() {
            let part = if half == 0 {
                &p[..p.len() / 2]
            } else {
                &p[p.len() / 2..]
            };
            out[i].push(e.forward(&mut sessions[i], part, Logits::Last).unwrap());
            tokens[i].extend_from_slice(part);
        }
    }
    for step in 0..STEPS {
        if step == STEPS / 2 {
            sessions[0].truncate(5);
            let again = tokens[0][5..].to_vec();
            let l = e.forward(&mut sessions[0], &again, Logits::Last).unwrap();
            *out[0].last_mut().unwrap() = l;
        }
        let next: Vec<u32> = out.iter().map(|o| argmax(o.last().unwrap())).collect();
        let mut calls: Vec<(&mut Session<B>, u32)> =
            sessions.iter_mut().zip(next.iter().copied()).collect();
        // As many at a time as the step holds (the server does the same).
        let logits: Vec<Vec<f32>> = calls
            .chunks_mut(e.prefill().group)
            .flat_map(|c| e.decode_many(c).unwrap())
            .collect();
        for (i, l) in logits.into_iter().enumerate() {
            tokens[i].push(next[i]);
            out[i].push(l);
        }
    }
    out
}

fn same_as_own_caches<B: Backend, C: Backend>(pooled: &Engine<B>, own: &Engine<C>, what: &str) {
    let ps = prompts(own.spec().vocab_size, 5);
    let want = run(own, &ps);
    let got = run(pooled, &ps);
    for (i, (w, g)) in want.iter().zip(&got).enumerate() {
        assert!(w == g, "{what}: session {i}'s logits differ in the pool");
    }
    // Every session was dropped: all blocks are back.
    let u = pooled.pool_usage().unwrap();
    assert_eq!(u.free, u.total, "{what}: blocks not given back");
}

#[test]
fn pooled_sessions_equal_their_own_caches_on_the_cpu() {
    let m = Model::load(&common::stories260k()).unwrap();
    for kv in [KvType::F32, KvType::F16, KvType::Q8_0] {
        let own = common::cpu_engine(&m, kv);
        // Room for all five sessions at full length, plus blocks never used.
        let pooled = common::cpu_engine(&m, kv)
            .with_kv_pool(5 * CTX / KV_BLOCK + 3)
            .unwrap();
        same_as_own_caches(&pooled, &own, &format!("stories260K, {kv:?} KV"));
    }
}

#[test]
fn a_full_pool_refuses_a_call_and_leaves_every_session_as_it_was() {
    let m = Model::load(&common::stories260k()).unwrap();
    let own = common::cpu_engine(&m, KvType::F32);
    let e = common::cpu_engine(&m, KvType::F32).with_kv_pool(4).unwrap();
    let ps = prompts(m.spec.vocab_size, 4);
    let (a_toks, b_toks) = (&ps[3][..40], &ps[1][..20]);
    let mut a = e.new_session(CTX).unwrap();
    e.forward(&mut a, a_toks, Logits::Last).unwrap();
    assert_eq!(
        (a.kv_blocks(), e.pool_usage().unwrap()),
        (3, PoolUsage { free: 1, total: 4 })
    );
    let mut b = e.new_session(CTX).unwrap();
    let err = e.forward(&mut b, b_toks, Logits::Last).unwrap_err();
    assert!(
        matches!(
            err,
            EngineError::KvPoolFull {
                needed: 2,
                free: 1,
                total: 4
            }
        ),
        "{err}"
    );
    assert_eq!(
        (b.position(), b.kv_blocks(), a.position(), a.kv_blocks()),
        (0, 0, 40, 3)
    );
    // A batched step that cannot grow every session takes nothing either.
    let mut c = e.new_session(CTX).unwrap();
    e.forward(&mut c, &b_toks[..16], Logits::Last).unwrap();
    assert_eq!(e.pool_usage().unwrap().free, 0);
    let err = e.decode_many(&mut [(&mut a, 5), (&mut c, 6)]).unwrap_err();
    assert!(
        matches!(err, EngineError::KvPoolFull { needed: 1, .. }),
        "{err}"
    );
    assert_eq!((a.position(), c.position(), c.kv_blocks()), (40, 16, 1));
    drop(c);
    // Going back gives blocks back; the refused call then runs as on a cache of its own.
    a.truncate(10);
    assert_eq!((a.kv_blocks(), e.pool_usage().unwrap().free), (1, 3));
    let got = e.forward(&mut b, b_toks, Logits::Last).unwrap();
    let mut alone = own.new_session(CTX).unwrap();
    assert!(got == own.forward(&mut alone, b_toks, Logits::Last).unwrap());
    let mut again = own.new_session(CTX).unwrap();
    own.forward(&mut again, &a_toks[..10], Logits::Last)
        .unwrap();
    assert!(
        e.forward(&mut a, &a_toks[10..20], Logits::Last).unwrap()
            == own
                .forward(&mut again, &a_toks[10..20], Logits::Last)
                .unwrap()
    );
    // release() gives everything back.
    a.release();
    b.release();
    assert_eq!((a.position(), e.pool_usage().unwrap().free), (0, 4));
}

#[test]
fn kv_rows_read_from_a_pooled_session_continue_in_another() {
    for ty in [KvType::Q8_0, KvType::F16, KvType::F32] {
        rows_continue(ty);
    }
}

fn rows_continue(ty: KvType) {
    let m = Model::load(&common::stories260k()).unwrap();
    let own = common::cpu_engine(&m, ty);
    let e = common::cpu_engine(&m, ty).with_kv_pool(12).unwrap();
    let p = &prompts(m.spec.vocab_size, 4)[3];
    // Another session holds the first blocks, so the copies land elsewhere in the pool.
    let mut other = e.new_session(CTX).unwrap();
    e.forward(&mut other, &p[..20], Logits::Last).unwrap();
    let mut s = e.new_session(CTX).unwrap();
    e.forward(&mut s, p, Logits::Last).unwrap();
    let rows = e.read_kv(&mut s, 0, p.len()).unwrap();
    let mut r = own.new_session(CTX).unwrap();
    own.forward(&mut r, p, Logits::Last).unwrap();
    assert!(
        rows == own.read_kv(&mut r, 0, p.len()).unwrap(),
        "rows read"
    );
    let mut t = e.new_session(CTX).unwrap();
    e.write_kv(&mut t, 0, p.len(), &rows).unwrap();
    t.set_position(p.len()).unwrap();
    assert_eq!(t.kv_blocks(), p.len().div_ceil(KV_BLOCK));
    // The cache's own bytes: the same rows from either session, converted the same way, and
    // written back they continue the same.
    let raw = e.read_kv_raw(&mut s, 0, p.len()).unwrap();
    assert!(
        raw == own.read_kv_raw(&mut r, 0, p.len()).unwrap(),
        "{ty:?}: raw rows"
    );
    let row = ty.row_bytes(m.spec.kv_dim());
    assert_eq!(raw.len(), 2 * m.spec.n_layers * p.len() * row);
    let mut u = e.new_session(CTX).unwrap();
    e.write_kv_raw(&mut u, 0, p.len(), &raw).unwrap();
    u.set_position(p.len()).unwrap();
    assert!(
        e.read_kv(&mut u, 0, p.len()).unwrap() == rows,
        "{ty:?}: raw bytes written read back as the rows"
    );
    assert!(
        e.write_kv_raw(&mut u, 0, p.len(), &raw[1..]).is_err(),
        "a short buffer is refused"
    );
    let want = own.forward(&mut r, &[7], Logits::Last).unwrap();
    assert!(
        e.forward(&mut t, &[7], Logits::Last).unwrap() == want,
        "{ty:?}: continued from written rows"
    );
    assert!(
        e.forward(&mut u, &[7], Logits::Last).unwrap() == want,
        "{ty:?}: continued from written raw rows"
    );
}

#[test]
fn the_budgeted_device_holds_the_plans_pool_and_tables_and_growing_takes_no_memory() {
    let dir = tempfile::tempdir().unwrap();
    let store = common::store_of(&common::stories260k(), &dir);
    let hw = HardwareProfile::load("cpu-sim").unwrap();
    let (sessions, blocks) = (5, 5 * CTX / KV_BLOCK);
    let b = |g| Budget {
        kv_type: KvType::F16,
        sessions,
        kv_pool: Some(blocks),
        logit_rows: sessions,
        ..Budget::new(g, None, 1, CTX, 32)
    };
    let (min, all) = common::gpu_range(&store.manifest, &hw, b);
    let spec = &store.manifest.spec;
    let reference = common::offloaded(
        &store,
        &common::plan_for(&store, CTX),
        &Ledger::new(None, None),
        KvType::F16,
    );
    let mut pooled = 0;
    for g in [min, min + (all - min) / 8, (min + all) / 2, all] {
        let plan = make_plan(&store.manifest, &b(g), &hw).unwrap();
        if plan.prefill.kv_host {
            // Only KV in host memory fits: each session keeps its own there, no pool.
            continue;
        }
        pooled += 1;
        assert_eq!(
            plan.gpu.kv,
            kv_pool_bytes(spec, blocks, KvType::F16) + sessions as u64 * kv_table_bytes(CTX),
            "{g}: the plan's KV bytes"
        );
        let ledger = Ledger::new(Some(plan.ledger_budget()), None);
        let e = common::offloaded(&store, &plan, &ledger, KvType::F16);
        let before = ledger.snapshot().hbm_used;
        let e = e.with_kv_pool(blocks).unwrap();
        assert_eq!(
            ledger.snapshot().hbm_used - before,
            kv_pool_bytes(spec, blocks, KvType::F16),
            "{g}: the pool's bytes"
        );
        let held = ledger.snapshot().hbm_used;
        {
            let s: Vec<_> = (0..sessions).map(|_| e.new_session(CTX).unwrap()).collect();
            assert_eq!(
                ledger.snapshot().hbm_used - held,
                sessions as u64 * kv_table_bytes(CTX),
                "{g}: the block tables' bytes"
            );
            drop(s);
        }
        same_as_own_caches(&e, &reference, &format!("{g} bytes, {:?}", plan.prefill));
        // The step's buffers stay for the next step; sessions growing again take nothing more.
        let after = ledger.snapshot().hbm_used;
        run(&e, &prompts(spec.vocab_size, 5));
        let snap = ledger.snapshot();
        assert_eq!(snap.hbm_used, after, "{g}: a second run took device memory");
        assert!(
            snap.hbm_peak <= plan.gpu.placed,
            "{g}: peak {} over the plan's {}",
            snap.hbm_peak,
            plan.gpu.placed
        );
    }
    assert!(pooled >= 2, "{pooled} budgets planned the pool");
}
