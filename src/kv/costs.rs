//! The cost models measured on this engine and drive: recompute time per token, load time per
//! chunk and per byte, and the decode time a compressed chunk adds.

use std::time::Instant;

use super::Result;
use super::chunk::{self, Bits, CHUNK_TOKENS, ChunkData};
use super::persist::{self, PersistError};
use super::policy::CostModel;
use super::shared::SharedStore;
use crate::backend::Backend;
use crate::engine::{Engine, Logits};

/// Measure the cost models on this engine: recompute time per token from a forward pass over
/// a few chunks, load time per chunk and per byte from writing and reading chunk-sized files
/// (in `dir`), or, with no local disk, chunk-sized values in the shared store (`shared`: its
/// chunks are what a restore then loads).
pub fn measure_costs<B: Backend>(
    engine: &Engine<B>,
    dir: Option<&std::path::Path>,
    shared: Option<&SharedStore>,
) -> Result<CostModel> {
    let spec = engine.spec();
    let tokens = (4 * CHUNK_TOKENS).min(spec.max_context).max(1);
    let mut session = engine.new_session(tokens)?;
    let ids: Vec<u32> = (0..tokens as u32)
        .map(|i| i % spec.vocab_size as u32)
        .collect();
    // Warm once, then time.
    engine.forward(&mut session, &ids, Logits::None)?;
    session.truncate(0);
    let t = Instant::now();
    engine.forward(&mut session, &ids, Logits::None)?;
    let recompute = t.elapsed().as_secs_f64() / tokens as f64;
    let chunk_bytes = 2 * spec.n_layers * CHUNK_TOKENS * spec.kv_dim() * 4;
    let large_bytes = chunk_bytes.max(8192) * 4;
    // Per read and per byte from the times of a 4 KiB read and a `large_bytes` one.
    let fit = |small: f64, large: f64| {
        let per_byte = ((large - small) / (large_bytes - 4096) as f64).max(0.0);
        (small.max(0.0), per_byte)
    };
    let (per_chunk, per_byte) = match (dir, shared) {
        (None, None) => (0.0, 0.0),
        (None, Some(store)) => fit(store.time_read(4096)?, store.time_read(large_bytes)?),
        (Some(dir), _) => {
            let probe = dir.join(".cost-probe");
            std::fs::create_dir_all(&probe).map_err(|e| PersistError::Io {
                path: probe.clone(),
                source: e,
            })?;
            // Best of a few, as the decode figure below: the two are compared, so they are
            // taken alike (a mean here against a best there leaned towards compressing).
            let time_read = |bytes: usize| -> Result<f64> {
                let rec = persist::write_chunk(&probe, "p", 0, 1, Bits::F32, &vec![7u8; bytes])?;
                let mut best = f64::INFINITY;
                for _ in 0..5 {
                    let t = Instant::now();
                    persist::read_chunk(&probe, "p", &rec)?;
                    best = best.min(t.elapsed().as_secs_f64());
                }
                Ok(best)
            };
            let (small, large) = (time_read(4096)?, time_read(large_bytes)?);
            std::fs::remove_dir_all(&probe).ok();
            fit(small, large)
        }
    };
    // Decoding a compressed chunk of this shape beyond copying an exact one (warm, best of a
    // few: the figure a restore pays per value).
    let decode_s_per_value = {
        let mut data = ChunkData::zeros(spec.n_layers, spec.kv_dim(), CHUNK_TOKENS);
        for (i, v) in data.values.iter_mut().enumerate() {
            *v = ((i * 7919 % 1000) as f32 / 250.0) - 2.0;
        }
        let time = |bits: Bits| {
            let bytes = chunk::encode(&data, bits);
            let mut out = data.clone();
            (0..5)
                .map(|_| {
                    let t = Instant::now();
                    chunk::decode_into(&bytes, bits, &mut out);
                    t.elapsed().as_secs_f64()
                })
                .fold(f64::INFINITY, f64::min)
        };
        let n = data.values.len().max(1) as f64;
        let exact = Bits::exact_for(engine.kv_type());
        ((time(Bits::Q4) - time(exact)) / n).max(0.0)
    };
    Ok(CostModel {
        recompute_s_per_token: recompute,
        load_s_per_chunk: per_chunk,
        load_s_per_byte: per_byte,
        decode_s_per_value,
    })
}
