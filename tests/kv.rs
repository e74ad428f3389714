//! Contexts swapped out and back: exact with compression off (from disk, partly recomputed,
//! with a corrupted chunk) with an f32 and an f16 KV cache, and the perplexity cost of
//! compressing to 50%.

mod common;

use std::path::Path;

use gpu_offload::backend::KvType;
use gpu_offload::backend::cpu::CpuBackend;
use gpu_offload::engine::{Engine, Logits, Session};
use gpu_offload::kv::{Bits, CHUNK_TOKENS, Compression, CostModel, KvConfig, KvManager};
use gpu_offload::model::Model;

fn engine(path: &Path, kv: KvType) -> (Engine<CpuBackend>, Model) {
    let m = Model::load(path).expect("model");
    let e = Engine::new(CpuBackend::new(2).unwrap(), m.spec.clone(), &m.weights)
        .expect("engine")
        .with_kv_type(kv)
        .expect("kv type");
    (e, m)
}

fn manager(dir: Option<&Path>, compression: Compression, dram: u64, costs: CostModel) -> KvManager {
    let cfg = KvConfig {
        shared: None,
        compression,
        dram_budget: dram,
        dir: dir.map(Path::to_path_buf),
        model_id: "test-model".into(),
        costs,
    };
    KvManager::open(cfg, None).expect("open").0
}

const LOAD_ONLY: CostModel = CostModel {
    recompute_s_per_token: 1.0,
    load_s_per_chunk: 0.0,
    load_s_per_byte: 0.0,
    decode_s_per_value: 0.0,
};

/// Evaluate `tokens` into a new context of `kv` and swap it out.
fn fill(
    e: &Engine<CpuBackend>,
    kv: &mut KvManager,
    tokens: &[u32],
    ctx: usize,
) -> (String, Session<CpuBackend>) {
    let id = kv.create(None, None).unwrap();
    let mut s = e.new_session(ctx).unwrap();
    e.enable_probe(&mut s).unwrap();
    e.forward(&mut s, tokens, Logits::None).unwrap();
    kv.get_mut(&id, None).unwrap().index.tokens = tokens.to_vec();
    kv.swap_out(e, &mut s, &id).unwrap();
    (id, s)
}

fn tokens_of(m: &Model, n: usize) -> Vec<u32> {
    let text = std::fs::read_to_string(common::fixtures().join("heldout.txt")).unwrap();
    let tok = m.tokenizer.as_ref().expect("tokenizer");
    let mut t = tok.encode(&text, true, false).unwrap();
    t.truncate(n);
    assert_eq!(t.len(), n, "held-out text too short");
    t
}

fn check_exact(path: &Path, kv_type: KvType) {
    let (e, m) = engine(path, kv_type);
    let t = tokens_of(&m, 70);
    let (head, tail) = t.split_at(60);
    let dir = tempfile::tempdir().unwrap();

    // Reference: never swapped.
    let mut kv = manager(Some(dir.path()), Compression::Off, 0, LOAD_ONLY);
    let (id, mut s) = fill(&e, &mut kv, head, 128);
    let want = e.forward(&mut s, tail, Logits::All).unwrap();

    // Every chunk from disk (no DRAM): bit-exact.
    let mut s2 = e.new_session(128).unwrap();
    let st = kv.swap_in(&e, &mut s2, &id).unwrap();
    assert_eq!(
        (st.chunks_from_disk, st.chunks_recomputed),
        (60usize.div_ceil(CHUNK_TOKENS), 0),
        "{st:?}"
    );
    assert_eq!(s2.position(), 60);
    let got = e.forward(&mut s2, tail, Logits::All).unwrap();
    assert!(got == want, "logits differ after a swap through disk");
    // Exact at the cache's own width: an f16 cache's chunks are half the bytes of f32.
    let bits = kv.get(&id, None).unwrap().chunk_bits();
    assert!(
        bits.iter().all(|b| *b == Some(Bits::exact_for(kv_type))),
        "{kv_type:?}: {bits:?}"
    );

    // Some chunks recomputed by the cost model, one chunk file corrupted: the same answer.
    let balanced = CostModel {
        recompute_s_per_token: 1.0,
        load_s_per_chunk: 24.0,
        load_s_per_byte: 0.0,
        decode_s_per_value: 0.0,
    };
    let mut kv = manager(Some(dir.path()), Compression::Off, 0, balanced);
    let cdir = dir.path().join("contexts").join(&id);
    let mut files: Vec<_> = std::fs::read_dir(&cdir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "kv"))
        .collect();
    files.sort();
    let last = files.last().unwrap();
    let mut bytes = std::fs::read(last).unwrap();
    bytes[7] ^= 0x10;
    std::fs::write(last, bytes).unwrap();
    let mut s3 = e.new_session(128).unwrap();
    let st = kv.swap_in(&e, &mut s3, &id).unwrap();
    assert!(
        st.chunks_recomputed >= 2 && st.chunks_from_disk >= 1 && st.chunks_corrupt == 1,
        "{st:?}"
    );
    let got = e.forward(&mut s3, tail, Logits::All).unwrap();
    let vocab = m.spec.vocab_size;
    for (p, (g, w)) in got.chunks(vocab).zip(want.chunks(vocab)).enumerate() {
        let scale = w.iter().fold(0f32, |a, x| a.max(x.abs()));
        let err = g.iter().zip(w).fold(0f32, |a, (x, y)| a.max((x - y).abs()));
        assert!(
            err <= 1e-4 * scale,
            "position {p}: recomputed chunks moved logits by {err} (scale {scale})"
        );
        let argmax = |v: &[f32]| {
            v.iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .unwrap()
                .0
        };
        assert_eq!(argmax(g), argmax(w), "position {p}");
    }
}

#[test]
fn swapped_contexts_give_the_same_logits_stories260k() {
    check_exact(&common::stories260k(), KvType::F32);
}

#[test]
fn swapped_contexts_give_the_same_logits_stories260k_f16_kv() {
    check_exact(&common::stories260k(), KvType::F16);
}

#[test]
fn swapped_contexts_give_the_same_logits_smollm2() {
    if let Some(p) = common::smollm2() {
        check_exact(&p, KvType::F32);
    }
}

#[test]
fn swapped_contexts_give_the_same_logits_smollm2_f16_kv() {
    if let Some(p) = common::smollm2() {
        check_exact(&p, KvType::F16);
    }
}

/// Perplexity of the held-out text evaluated in calls of 64 tokens, the context swapped out
/// (compressed) and back in between calls; the first call is not scored.
fn chunked_ppl(e: &Engine<CpuBackend>, t: &[u32], compression: Option<Compression>) -> (f64, f64) {
    let vocab = e.spec().vocab_size;
    let mut kv = manager(
        None,
        compression.unwrap_or(Compression::Off),
        u64::MAX / 4,
        LOAD_ONLY,
    );
    let id = kv.create(None, None).unwrap();
    let mut s = e.new_session(t.len()).unwrap();
    e.enable_probe(&mut s).unwrap();
    let (mut nll, mut n) = (0f64, 0usize);
    for (call, part) in t.chunks(64).enumerate() {
        let start = call * 64;
        let logits = e.forward(&mut s, part, Logits::All).unwrap();
        if call > 0 {
            for (i, row) in logits.chunks(vocab).enumerate() {
                if let Some(&next) = t.get(start + i + 1) {
                    nll += gpu_offload::engine::perplexity::nll(row, next);
                    n += 1;
                }
            }
        }
        if compression.is_some() {
            kv.get_mut(&id, None).unwrap().index.tokens = t[..start + part.len()].to_vec();
            kv.swap_out(e, &mut s, &id).unwrap();
            let mut fresh = e.new_session(t.len()).unwrap();
            e.enable_probe(&mut fresh).unwrap();
            kv.swap_in(e, &mut fresh, &id).unwrap();
            s = fresh;
        }
    }
    let bits = kv.get(&id, None).unwrap().chunk_bits();
    let full: Vec<Bits> = bits.into_iter().flatten().filter(|b| !b.is_raw()).collect();
    let mean_bits = full.iter().map(|b| b.bits() as f64).sum::<f64>() / full.len().max(1) as f64;
    ((nll / n as f64).exp(), mean_bits)
}

#[test]
fn compression_to_half_costs_little_perplexity() {
    let Some(p) = common::smollm2() else { return };
    let (e, m) = engine(&p, KvType::F32);
    let t = tokens_of(&m, 448);
    let (base, _) = chunked_ppl(&e, &t, None);
    let mut report =
        format!("SmolLM2 held-out perplexity, 448 tokens in calls of 64: exact {base:.4}");
    let mut half = 0.0;
    for (name, c) in [
        ("int8", Compression::Uniform(Bits::Q8)),
        ("50% (ours)", Compression::Ratio(0.5)),
        ("int4", Compression::Uniform(Bits::Q4)),
        ("int2", Compression::Uniform(Bits::Q2)),
    ] {
        let (ppl, bits) = chunked_ppl(&e, &t, Some(c));
        let delta = ppl / base - 1.0;
        report += &format!(
            "; {name}: {ppl:.4} ({:+.2}%, {bits:.2} bits/value)",
            100.0 * delta
        );
        if c == Compression::Ratio(0.5) {
            half = delta;
        }
    }
    eprintln!("{report}");
    assert!(half <= 0.01, "{report}");
}

#[test]
fn density_read_in_runs_equals_the_whole_layer_read() {
    let (e, m) = engine(&common::stories260k(), KvType::F32);
    let t = tokens_of(&m, 150);
    let mut s = e.new_session(256).unwrap();
    e.enable_probe(&mut s).unwrap();
    e.forward(&mut s, &t, Logits::None).unwrap();
    let whole = e
        .attention_density_in(&mut s, CHUNK_TOKENS, usize::MAX)
        .unwrap();
    assert_eq!(whole.len(), 150usize.div_ceil(CHUNK_TOKENS));
    let total: f32 = whole.iter().sum();
    assert!((total - 1.0).abs() < 1e-5, "{total}");
    // Runs of one block, of several (ragged against the 150 positions), and the default.
    for rows in [1, CHUNK_TOKENS, 3 * CHUNK_TOKENS + 5, 64] {
        let runs = e.attention_density_in(&mut s, CHUNK_TOKENS, rows).unwrap();
        assert_eq!(runs, whole, "K read {rows} rows at a time");
    }
    assert_eq!(e.attention_density(&mut s, CHUNK_TOKENS).unwrap(), whole);
}

/// A session taken over by another context forgets the previous holder's queries: restored
/// from copies alone (nothing recomputed), the context's density is empty until its own calls
/// evaluate queries; after one, it is the same as in a session that never held anything else.
#[test]
fn swap_in_forgets_the_previous_holders_queries() {
    let (e, m) = engine(&common::stories260k(), KvType::F32);
    let t = tokens_of(&m, 70);
    let (a, b) = t.split_at(40);
    let mut kv = manager(None, Compression::Off, 1 << 30, LOAD_ONLY);
    let (id, _) = fill(&e, &mut kv, b, 128);
    // A session that held another context (its probe full of that one's queries).
    let mut held = e.new_session(128).unwrap();
    e.enable_probe(&mut held).unwrap();
    e.forward(&mut held, a, Logits::None).unwrap();
    assert!(!e.attention_density(&mut held, 16).unwrap().is_empty());
    let st = kv.swap_in(&e, &mut held, &id).unwrap();
    assert_eq!(st.chunks_recomputed, 0, "{st:?}");
    assert!(
        e.attention_density(&mut held, 16).unwrap().is_empty(),
        "the previous holder's queries survived the swap-in"
    );
    // One call of its own: the same density as a fresh session restored the same way.
    let mut fresh = e.new_session(128).unwrap();
    e.enable_probe(&mut fresh).unwrap();
    kv.swap_in(&e, &mut fresh, &id).unwrap();
    for s in [&mut held, &mut fresh] {
        e.forward(s, &a[..5], Logits::None).unwrap();
    }
    assert_eq!(
        e.attention_density(&mut held, 16).unwrap(),
        e.attention_density(&mut fresh, 16).unwrap()
    );
}

/// Ours (a ratio) with a cost model that says decoding costs more than the bytes exact adds
/// (host memory and the page cache as the media): the full chunks are stored exact and come
/// back bit for bit; with decoding free (not measured), or without a disk tier, they are
/// compressed as the tolerance logic says.
#[test]
fn ratio_keeps_chunks_exact_where_decoding_costs_more_than_the_bytes() {
    let (e, m) = engine(&common::stories260k(), KvType::F32);
    let t = tokens_of(&m, 70);
    let (head, tail) = t.split_at(60);
    let dir = tempfile::tempdir().unwrap();
    let cheap_bytes = CostModel {
        recompute_s_per_token: 1.0,
        load_s_per_chunk: 1e-5,
        load_s_per_byte: 0.1e-9,
        decode_s_per_value: 2e-9,
    };
    for (costs, disk, exact) in [
        (cheap_bytes, true, true),
        (LOAD_ONLY, true, false),
        (cheap_bytes, false, false),
    ] {
        let d = disk.then_some(dir.path());
        let mut kv = manager(d, Compression::Ratio(0.5), 1 << 30, costs);
        let (id, mut s) = fill(&e, &mut kv, head, 128);
        let want = e.forward(&mut s, tail, Logits::All).unwrap();
        let bits = kv.get(&id, None).unwrap().chunk_bits();
        let full = head.len() / CHUNK_TOKENS;
        assert_eq!(bits.len(), head.len().div_ceil(CHUNK_TOKENS));
        for (i, b) in bits.iter().enumerate().take(full) {
            assert_eq!(b.is_some_and(Bits::is_raw), exact, "chunk {i}: {bits:?}");
        }
        let mut s2 = e.new_session(128).unwrap();
        kv.swap_in(&e, &mut s2, &id).unwrap();
        let got = e.forward(&mut s2, tail, Logits::All).unwrap();
        if exact {
            assert!(got == want, "exact chunks restore bit for bit");
        } else {
            assert!(got != want, "compressed chunks were expected");
        }
    }
}
