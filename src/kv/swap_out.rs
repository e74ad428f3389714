//! Swap-out: the chunks a session changed written ahead of time — compressed to widths chosen by
//! attention density (or kept exact where decoding costs more than the bytes save), written to
//! disk and kept in DRAM under its budget (LCTRU eviction) — and a whole session saved as a
//! context (`prefill --save-context`).

use std::sync::Arc;

use super::chunk::{self, Bits, CHUNK_TOKENS, ChunkData};
use super::context::DramChunk;
use super::manager::{KvManager, unix_now};
use super::persist::{self, ChunkRecord, ContextIndex};
use super::policy::{self, Compression};
use super::{KvError, Result};
use crate::backend::Backend;
use crate::engine::{Engine, Session};
use crate::fault::TestDelay;
use crate::footprint::ledger::Tier;

impl KvManager {
    /// Write the chunks the session changed since the last swap-out (ahead of time: the
    /// context may stay on the device). Returns the chunks written (for a shared store).
    pub fn swap_out<B: Backend>(
        &mut self,
        engine: &Engine<B>,
        session: &mut Session<B>,
        id: &str,
    ) -> Result<Vec<(ChunkRecord, Arc<Vec<u8>>)>> {
        let pos = session.position();
        let exact = Bits::exact_for(engine.kv_type());
        // With a disk tier, exact is kept wherever decoding costs more than the bytes it saves
        // (below); where that holds for every code, no width depends on the density.
        let exact_always = self.cfg.dir.is_some() && self.cfg.costs.exact_always(exact);
        // Only the ratio mode reads the density: the others would pay a pass over K for nothing.
        let density = match self.cfg.compression {
            Compression::Ratio(_) if !exact_always => {
                engine.attention_density(session, CHUNK_TOKENS)?
            }
            Compression::Ratio(_) | Compression::Off | Compression::Uniform(_) => Vec::new(),
        };
        let c = self
            .contexts
            .get_mut(id)
            .ok_or_else(|| KvError::NotFound(id.into()))?;
        let pos = pos.min(c.index.tokens.len());
        let n_chunks = pos.div_ceil(CHUNK_TOKENS);
        let first = (c.clean.min(pos)) / CHUNK_TOKENS;
        let full = pos / CHUNK_TOKENS;
        c.index.evaluated = pos;
        c.index.chunks.resize(n_chunks, None);
        c.dram.resize_with(n_chunks, || None);
        let ratio_mode = matches!(self.cfg.compression, Compression::Ratio(_));
        let fixed: Vec<Option<Bits>> = (0..full)
            .map(|i| {
                if i < first {
                    let kept = c.dram[i]
                        .as_ref()
                        .map(|d| d.bits)
                        .or_else(|| c.index.chunks[i].as_ref().map(|r| r.bits));
                    // A full chunk kept exact because decoding cost more than its bytes counts
                    // in the ratio's budget at the widest code, not at 32 bits.
                    match kept {
                        Some(b) if ratio_mode && b.is_raw() => Some(Bits::Q8),
                        k => k.or(Some(Bits::Q8)),
                    }
                } else {
                    None
                }
            })
            .collect();
        let widths: Vec<Bits> = match self.cfg.compression {
            Compression::Off => vec![exact; full],
            Compression::Uniform(b) => vec![b; full],
            // Tolerance-aware widths, then the cost model: where decoding a width costs more
            // than loading the bytes exact adds, the chunk is kept exact (no loss at all). Only
            // with a disk tier: what the DRAM budget cannot hold is then loaded at the measured
            // rate, not recomputed.
            Compression::Ratio(r) => policy::allocate_bits(&density, &fixed, r)
                .into_iter()
                .map(|b| {
                    if self.cfg.dir.is_some() && self.cfg.costs.prefer_exact(b, exact) {
                        exact
                    } else {
                        b
                    }
                })
                .collect(),
        };
        let mut written = Vec::new();
        for ci in first..n_chunks {
            let start = ci * CHUNK_TOKENS;
            let len = CHUNK_TOKENS.min(pos - start);
            // A partial chunk keeps changing: it stays exact until it is full.
            let bits = match widths.get(ci) {
                Some(&w) if len == CHUNK_TOKENS => w,
                _ => exact,
            };
            TEST_SWAP_DELAY.pause();
            let bytes = read_chunk_bytes(engine, session, start, len, bits)?;
            let record = match &self.cfg.dir {
                Some(dir) => persist::write_chunk(dir, id, ci, len, bits, &bytes)?,
                None => persist::chunk_record(ci, len, bits, &bytes),
            };
            // Without a disk or a shared store nothing is written: the record would name nothing.
            c.index.chunks[ci] = self.cfg.keeps_chunks().then(|| record.clone());
            if let Some(old) = c.dram[ci].take() {
                self.dram_used -= old.bytes.len() as u64;
            }
            written.push((ci, record, Arc::new(bytes)));
        }
        let count = written.len();
        c.clean = pos;
        if let Some(dir) = &self.cfg.dir {
            persist::save_index(dir, &c.index)?;
            persist::remove_unreferenced(dir, &c.index);
        }
        for (ci, record, bytes) in &written {
            self.cache_in_dram(id, *ci, record.len, record.bits, bytes.clone());
        }
        self.counters.swap_outs += 1;
        self.counters.chunks_written += count as u64;
        Ok(written.into_iter().map(|(_, r, b)| (r, b)).collect())
    }

    /// Keep a chunk in DRAM, evicting others in LCTRU order to make room; when nothing can be
    /// evicted the chunk is not cached (it is on disk, or will be recomputed).
    pub(super) fn cache_in_dram(
        &mut self,
        id: &str,
        ci: usize,
        len: usize,
        bits: Bits,
        bytes: Arc<Vec<u8>>,
    ) {
        let need = bytes.len() as u64;
        if need > self.cfg.dram_budget {
            return;
        }
        loop {
            let fits = self.dram_used + need <= self.cfg.dram_budget;
            let reservation = match (&self.ledger, fits) {
                (_, false) => None,
                (None, true) => Some(None),
                (Some(l), true) => l.reserve(Tier::Dram, need, "KV chunk").ok().map(Some),
            };
            if let Some(reservation) = reservation {
                if let Some(c) = self.contexts.get_mut(id)
                    && ci < c.dram.len()
                {
                    c.dram[ci] = Some(DramChunk {
                        bytes,
                        bits,
                        len,
                        _reservation: reservation,
                    });
                    self.dram_used += need;
                }
                return;
            }
            if !self.evict_one(id, ci) {
                return;
            }
        }
    }

    /// Drop the DRAM copy first in LCTRU order (never `keep`). False when none is left.
    fn evict_one(&mut self, keep_id: &str, keep_chunk: usize) -> bool {
        let mut victim: Option<(_, String, usize)> = None;
        for (cid, c) in &self.contexts {
            for (i, d) in c.dram.iter().enumerate() {
                let Some(d) = d else { continue };
                if cid == keep_id && i == keep_chunk {
                    continue;
                }
                let key = policy::lctru_key(c.last_use, d.bits, i);
                if victim.as_ref().is_none_or(|(k, _, _)| key < *k) {
                    victim = Some((key, cid.clone(), i));
                }
            }
        }
        let Some((_, cid, i)) = victim else {
            return false;
        };
        if let Some(c) = self.contexts.get_mut(&cid)
            && let Some(d) = c.dram[i].take()
        {
            self.dram_used -= d.bytes.len() as u64;
            self.counters.dram_evictions += 1;
        }
        true
    }
}

/// Write what `session` holds as the persistent context `id` under `kv_dir`, in the format
/// `serve --kv-dir` loads: `tokens` is the conversation (the prompt and what was generated; the
/// last generated token may not be evaluated yet), the chunks exact (the cache's own bytes,
/// [`Bits::exact_for`]). The chunks are written first and the index last, each atomically, so
/// the context exists on disk only once it is complete; an older context of the same id is
/// replaced.
pub fn save_session<B: Backend>(
    engine: &Engine<B>,
    session: &mut Session<B>,
    kv_dir: &std::path::Path,
    model_id: &str,
    id: &str,
    owner: Option<String>,
    tokens: &[u32],
) -> Result<ContextIndex> {
    let evaluated = session.position().min(tokens.len());
    let exact = Bits::exact_for(engine.kv_type());
    let mut index = ContextIndex::new(model_id, id, owner, unix_now());
    index.tokens = tokens.to_vec();
    index.evaluated = evaluated;
    for ci in 0..evaluated.div_ceil(CHUNK_TOKENS) {
        let start = ci * CHUNK_TOKENS;
        let len = CHUNK_TOKENS.min(evaluated - start);
        let bytes = read_chunk_bytes(engine, session, start, len, exact)?;
        index.chunks.push(Some(persist::write_chunk(
            kv_dir, id, ci, len, exact, &bytes,
        )?));
    }
    persist::save_index(kv_dir, &index)?;
    persist::remove_unreferenced(kv_dir, &index);
    Ok(index)
}

/// Positions `start..start + len` of `session` encoded as a chunk of `bits`: the cache's bytes
/// as they are where `bits` is its own encoding ([`Bits::cache_bytes`]), else its values
/// encoded.
fn read_chunk_bytes<B: Backend>(
    engine: &Engine<B>,
    session: &mut Session<B>,
    start: usize,
    len: usize,
    bits: Bits,
) -> Result<Vec<u8>> {
    let raw = engine.read_kv_raw(session, start, len)?;
    if Bits::cache_bytes(engine.kv_type()) == Some(bits) {
        return Ok(raw);
    }
    let spec = engine.spec();
    let mut data = ChunkData::zeros(spec.n_layers, spec.kv_dim(), len);
    crate::backend::cpu::decode_rows(engine.kv_type(), &raw, spec.kv_dim(), &mut data.values);
    Ok(chunk::encode(&data, bits))
}

/// Fault injection for tests: slows every chunk write of a swap-out, so a test can kill the
/// server while one is under way.
static TEST_SWAP_DELAY: TestDelay = TestDelay::new("GPU_OFFLOAD_TEST_SWAP_DELAY_MS");
