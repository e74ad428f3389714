//! Persistent contexts (LLMS): a context's KV cache is cut into chunks of [`CHUNK_TOKENS`]
//! positions. While the context is on the device its chunks are exact; after a call (when the
//! server falls idle) the chunks it changed are compressed (width per chunk by attention
//! density, to a global ratio; exact, as the cache's own bytes, where decoding would cost more
//! than the bytes save), kept in DRAM under a budget (LCTRU eviction) and written to disk ahead
//! of time, so taking the device away from a context costs nothing. Bringing it back loads chunks while
//! recomputing others from their tokens, the split chosen by measured cost models.

pub mod chunk;
pub mod persist;
pub mod policy;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use thiserror::Error;

use crate::backend::Backend;
use crate::engine::{Engine, EngineError, Logits, Session};
use crate::footprint::ledger::{Ledger, Reservation, Tier};
pub use chunk::{Bits, CHUNK_TOKENS, ChunkData};
use persist::{ChunkRecord, ContextIndex, PersistError};
pub use policy::{Compression, CostModel};

#[derive(Debug, Error)]
pub enum KvError {
    #[error("no context {0}")]
    NotFound(String),
    #[error(
        "context {id} was saved under another model ({model_id}); it cannot be used with this one"
    )]
    OtherModel { id: String, model_id: String },
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Persist(#[from] PersistError),
}

pub type Result<T> = std::result::Result<T, KvError>;

/// Settings of the context store.
#[derive(Clone, Debug)]
pub struct KvConfig {
    pub compression: Compression,
    /// Bytes of compressed chunks kept in DRAM at most.
    pub dram_budget: u64,
    /// Where contexts persist (None: DRAM only, lost at exit).
    pub dir: Option<PathBuf>,
    /// Identity of the model the contexts belong to.
    pub model_id: String,
    pub costs: CostModel,
}

/// A chunk's copy in DRAM.
struct DramChunk {
    bytes: Arc<Vec<u8>>,
    bits: Bits,
    len: usize,
    _reservation: Option<Reservation>,
}

/// How the last restore of a context went.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct RestoreStats {
    pub chunks_from_dram: usize,
    pub chunks_from_disk: usize,
    /// Recomputed by choice (the cost model) or because no copy existed.
    pub chunks_recomputed: usize,
    /// Copies that failed their checksum (recomputed, never used).
    pub chunks_corrupt: usize,
    pub seconds: f64,
}

/// One persistent context.
pub struct Context {
    pub index: ContextIndex,
    dram: Vec<Option<DramChunk>>,
    /// Tokens whose chunks are written and current.
    clean: usize,
    pub last_use: u64,
    pub last_restore: Option<RestoreStats>,
    /// Chunks found unusable when the context was loaded at start-up.
    pub lost_at_load: usize,
}

impl Context {
    pub fn id(&self) -> &str {
        &self.index.id
    }

    /// Chunk widths of the written chunks.
    pub fn chunk_bits(&self) -> Vec<Option<Bits>> {
        (0..self.index.chunks.len())
            .map(|c| {
                self.dram
                    .get(c)
                    .and_then(|d| d.as_ref().map(|d| d.bits))
                    .or_else(|| self.index.chunks[c].as_ref().map(|r| r.bits))
            })
            .collect()
    }

    pub fn chunks_in_dram(&self) -> usize {
        self.dram.iter().flatten().count()
    }

    pub fn chunks_on_disk(&self) -> usize {
        self.index.chunks.iter().flatten().count()
    }

    /// Forget the evaluated tokens after `keep` (the conversation diverged there).
    pub fn truncate_evaluated(&mut self, keep: usize) {
        let keep = keep.min(self.index.evaluated);
        self.index.evaluated = keep;
        let chunks = keep.div_ceil(CHUNK_TOKENS);
        self.index.chunks.truncate(chunks);
        self.dram.truncate(chunks);
        // A partial last chunk is rewritten at the next swap-out.
        self.clean = self.clean.min(keep / CHUNK_TOKENS * CHUNK_TOKENS);
    }
}

/// Counters for /metrics.
#[derive(Clone, Copy, Debug, Default)]
pub struct KvCounters {
    pub swap_outs: u64,
    pub swap_ins: u64,
    pub chunks_written: u64,
    pub chunks_from_dram: u64,
    pub chunks_from_disk: u64,
    pub chunks_recomputed: u64,
    pub chunks_corrupt: u64,
    pub dram_evictions: u64,
}

/// All contexts of one model.
pub struct KvManager {
    cfg: KvConfig,
    ledger: Option<Arc<Ledger>>,
    contexts: HashMap<String, Context>,
    /// Contexts found on disk that belong to another model: id → model id.
    foreign: HashMap<String, String>,
    clock: u64,
    dram_used: u64,
    pub counters: KvCounters,
}

/// Seconds since the Unix epoch (0 if the clock is before it).
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl KvManager {
    /// Open the store, loading every context persisted under the directory. Returns the
    /// manager and one line per context that could not be loaded.
    pub fn open(cfg: KvConfig, ledger: Option<Arc<Ledger>>) -> Result<(Self, Vec<String>)> {
        let mut m = KvManager {
            cfg,
            ledger,
            contexts: HashMap::new(),
            foreign: HashMap::new(),
            clock: 0,
            dram_used: 0,
            counters: KvCounters::default(),
        };
        let mut warnings = Vec::new();
        if let Some(dir) = m.cfg.dir.clone() {
            persist::prepare(&dir)?;
            for r in persist::load_all(&dir)? {
                match r {
                    Err(e) => warnings.push(format!("context not loaded: {e}")),
                    Ok(idx) if idx.model_id != m.cfg.model_id => {
                        warnings.push(format!(
                            "context {} belongs to model {}, not {}: refused",
                            idx.id, idx.model_id, m.cfg.model_id
                        ));
                        m.foreign.insert(idx.id, idx.model_id);
                    }
                    Ok(mut idx) => {
                        // The index is written before its chunks: chunks it names that are
                        // missing are recomputed later, never trusted.
                        idx.evaluated = idx.evaluated.min(idx.tokens.len());
                        idx.chunks.truncate(idx.evaluated.div_ceil(CHUNK_TOKENS));
                        let n = idx.evaluated.div_ceil(CHUNK_TOKENS);
                        let lost = (0..n)
                            .filter(|&i| {
                                let want = CHUNK_TOKENS.min(idx.evaluated - i * CHUNK_TOKENS);
                                idx.chunks.get(i).cloned().flatten().is_none_or(|r| {
                                    r.len != want || persist::read_chunk(&dir, &idx.id, &r).is_err()
                                })
                            })
                            .count();

                        m.clock += 1;
                        let (id, evaluated) = (idx.id.clone(), idx.evaluated);
                        m.contexts.insert(
                            id,
                            Context {
                                index: idx,
                                dram: (0..n).map(|_| None).collect(),
                                // What the index names is what is written.
                                clean: evaluated,
                                last_use: 0,
                                last_restore: None,
                                lost_at_load: lost,
                            },
                        );
                    }
                }
            }
        }
        Ok((m, warnings))
    }

    pub fn len(&self) -> usize {
        self.contexts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.contexts.is_empty()
    }

    pub fn dram_bytes(&self) -> u64 {
        self.dram_used
    }

    pub fn contexts(&self) -> impl Iterator<Item = &Context> {
        self.contexts.values()
    }

    /// A new empty context owned by `owner`.
    pub fn create(
        &mut self,
        owner: Option<String>,
        system_prompt: Option<String>,
    ) -> Result<String> {
        let id = format!("ctx-{:016x}", rand::random::<u64>());
        let mut index = ContextIndex::new(&self.cfg.model_id, &id, owner, unix_now());
        index.system_prompt = system_prompt;
        if let Some(dir) = &self.cfg.dir {
            persist::save_index(dir, &index)?;
        }
        self.clock += 1;
        self.contexts.insert(
            id.clone(),
            Context {
                index,
                dram: Vec::new(),
                clean: 0,
                last_use: self.clock,
                last_restore: None,
                lost_at_load: 0,
            },
        );
        Ok(id)
    }

    fn check(&self, id: &str, owner: Option<&str>) -> Result<()> {
        if let Some(model_id) = self.foreign.get(id) {
            return Err(KvError::OtherModel {
                id: id.into(),
                model_id: model_id.clone(),
            });
        }
        match self.contexts.get(id) {
            // Another key's context does not exist for this caller.
            Some(c) if c.index.owner.as_deref() == owner => Ok(()),
            _ => Err(KvError::NotFound(id.into())),
        }
    }

    pub fn get(&self, id: &str, owner: Option<&str>) -> Result<&Context> {
        self.check(id, owner)?;
        self.contexts
            .get(id)
            .ok_or_else(|| KvError::NotFound(id.into()))
    }

    pub fn get_mut(&mut self, id: &str, owner: Option<&str>) -> Result<&mut Context> {
        self.check(id, owner)?;
        self.clock += 1;
        let clock = self.clock;
        let c = self
            .contexts
            .get_mut(id)
            .ok_or_else(|| KvError::NotFound(id.into()))?;
        c.last_use = clock;
        Ok(c)
    }

    pub fn delete(&mut self, id: &str, owner: Option<&str>) -> Result<()> {
        self.check(id, owner)?;
        if let Some(c) = self.contexts.remove(id) {
            self.dram_used -= c
                .dram
                .iter()
                .flatten()
                .map(|d| d.bytes.len() as u64)
                .sum::<u64>();
        }
        if let Some(dir) = &self.cfg.dir {
            persist::remove_context(dir, id)?;
        }
        Ok(())
    }

    /// Persist the conversation (tokens, messages) now: chunks not yet written are recomputed
    /// if the process dies before [`KvManager::swap_out`] finishes.
    pub fn save_conversation(&mut self, id: &str) -> Result<()> {
        let (Some(dir), Some(c)) = (&self.cfg.dir, self.contexts.get(id)) else {
            return Ok(());
        };
        persist::save_index(dir, &c.index)?;
        Ok(())
    }

    /// Write the chunks the session changed since the last swap-out (ahead of time: the
    /// context may stay on the device). Returns the number of chunks written.
    pub fn swap_out<B: Backend>(
        &mut self,
        engine: &Engine<B>,
        session: &mut Session<B>,
        id: &str,
    ) -> Result<usize> {
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
            if let Some(d) = test_swap_delay() {
                std::thread::sleep(d);
            }
            let bytes = read_chunk_bytes(engine, session, start, len, bits)?;
            c.index.chunks[ci] = match &self.cfg.dir {
                Some(dir) => Some(persist::write_chunk(dir, id, ci, len, bits, &bytes)?),
                None => None,
            };
            if let Some(old) = c.dram[ci].take() {
                self.dram_used -= old.bytes.len() as u64;
            }
            written.push((ci, len, bits, bytes));
        }
        let count = written.len();
        c.clean = pos;
        if let Some(dir) = &self.cfg.dir {
            persist::save_index(dir, &c.index)?;
            persist::remove_unreferenced(dir, &c.index);
        }
        for (ci, len, bits, bytes) in written {
            self.cache_in_dram(id, ci, len, bits, bytes);
        }
        self.counters.swap_outs += 1;
        self.counters.chunks_written += count as u64;
        Ok(count)
    }

    /// Keep a chunk in DRAM, evicting others in LCTRU order to make room; when nothing can be
    /// evicted the chunk is not cached (it is on disk, or will be recomputed).
    fn cache_in_dram(&mut self, id: &str, ci: usize, len: usize, bits: Bits, bytes: Vec<u8>) {
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
                        bytes: Arc::new(bytes),
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

    /// Bring a context's keys and values into `session` (which is reset): chunks in DRAM are
    /// decoded, chunks on disk load on an I/O thread while a prefix of chunks is recomputed
    /// (split by the cost model), chunks without a usable copy are recomputed from their tokens.
    pub fn swap_in<B: Backend>(
        &mut self,
        engine: &Engine<B>,
        session: &mut Session<B>,
        id: &str,
    ) -> Result<RestoreStats> {
        let t0 = Instant::now();
        let spec = engine.spec();
        let (n_layers, kv_dim) = (spec.n_layers, spec.kv_dim());
        let c = self
            .contexts
            .get(id)
            .ok_or_else(|| KvError::NotFound(id.into()))?;
        // The queries the session remembers are the previous holder's: the density this
        // context's chunks are compressed by comes from its own (recomputed chunks and calls).
        session.forget_queries();
        let evaluated = c.index.evaluated;
        let tokens = c.index.tokens[..evaluated].to_vec();
        let n = evaluated.div_ceil(CHUNK_TOKENS);
        let lens: Vec<usize> = (0..n)
            .map(|i| CHUNK_TOKENS.min(evaluated - i * CHUNK_TOKENS))
            .collect();
        let dram: Vec<Option<(Arc<Vec<u8>>, Bits)>> = (0..n)
            .map(|i| {
                c.dram
                    .get(i)
                    .and_then(|d| d.as_ref())
                    .filter(|d| d.len == lens[i])
                    .map(|d| (d.bytes.clone(), d.bits))
            })
            .collect();
        let disk: Vec<Option<ChunkRecord>> = (0..n)
            .map(|i| {
                c.index
                    .chunks
                    .get(i)
                    .cloned()
                    .flatten()
                    .filter(|r| r.len == lens[i] && self.cfg.dir.is_some())
            })
            .collect();
        let on_disk: Vec<Option<u64>> = (0..n)
            .map(|i| match (&dram[i], &disk[i]) {
                (None, Some(r)) => Some(r.bytes),
                _ => None,
            })
            .collect();
        let prefix = self.cfg.costs.recompute_prefix(&on_disk, &lens);
        let mut stats = RestoreStats::default();
        session.truncate(0);
        let mut redo: Vec<usize> = Vec::new();
        let dir = self.cfg.dir.clone();
        let raw_bits = Bits::cache_bytes(engine.kv_type());
        std::thread::scope(|scope| -> Result<()> {
            let (tx, rx) = mpsc::channel::<(usize, Option<Loaded>)>();
            let io_jobs: Vec<(usize, ChunkRecord)> = (prefix..n)
                .filter(|&i| on_disk[i].is_some())
                .filter_map(|i| disk[i].clone().map(|r| (i, r)))
                .collect();
            if let Some(dir) = dir.clone() {
                let id = id.to_string();
                scope.spawn(move || {
                    for (i, r) in io_jobs {
                        let data = persist::read_chunk(&dir, &id, &r)
                            .map_err(|e| tracing::warn!("{e}: recomputing"))
                            .ok()
                            .and_then(|b| {
                                if Some(r.bits) == raw_bits {
                                    // The cache's own bytes: written as they are.
                                    let ok = b.len()
                                        == chunk::encoded_len_rows(
                                            r.bits,
                                            2 * n_layers * r.len * kv_dim,
                                            kv_dim,
                                        );
                                    ok.then_some(Loaded::Raw(b))
                                } else {
                                    chunk::decode(&b, r.bits, n_layers, kv_dim, r.len)
                                        .map(Loaded::Values)
                                }
                            });
                        if tx.send((i, data)).is_err() {
                            return;
                        }
                    }
                });
            } else {
                drop(tx);
            }
            if prefix > 0 {
                let upto: usize = lens[..prefix].iter().sum();
                engine.forward(session, &tokens[..upto], Logits::None)?;
                stats.chunks_recomputed += prefix;
            }
            // One buffer for every chunk decoded here: no fresh pages to fault in per chunk.
            let mut buf = ChunkData {
                len: 0,
                n_layers,
                kv_dim,
                values: Vec::new(),
            };
            for i in prefix..n {
                match (&dram[i], &on_disk[i]) {
                    (Some((bytes, bits)), _) => {
                        buf.len = lens[i];
                        let at = i * CHUNK_TOKENS;
                        let raw_len =
                            chunk::encoded_len_rows(*bits, 2 * n_layers * lens[i] * kv_dim, kv_dim);
                        if Some(*bits) == raw_bits && bytes.len() == raw_len {
                            // The cache's own bytes: written as they are.
                            engine.write_kv_raw(session, at, lens[i], bytes)?;
                            stats.chunks_from_dram += 1;
                        } else if chunk::decode_into(bytes, *bits, &mut buf) {
                            engine.write_kv(session, at, lens[i], &buf.values)?;
                            stats.chunks_from_dram += 1;
                        } else {
                            redo.push(i);
                        }
                    }
                    (None, Some(_)) => {}
                    (None, None) => redo.push(i),
                }
            }
            for (i, data) in rx {
                match data {
                    Some(d) => {
                        let at = i * CHUNK_TOKENS;
                        match d {
                            Loaded::Raw(b) => engine.write_kv_raw(session, at, lens[i], &b)?,
                            Loaded::Values(d) => {
                                engine.write_kv(session, at, lens[i], &d.values)?
                            }
                        }
                        stats.chunks_from_disk += 1;
                    }
                    None => {
                        stats.chunks_corrupt += 1;
                        redo.push(i);
                    }
                }
            }
            Ok(())
        })?;
        // Recompute what has no usable copy, in order: every earlier position is in place.
        redo.sort_unstable();
        for &i in &redo {
            let start = i * CHUNK_TOKENS;
            session.set_position(start)?;
            engine.forward(session, &tokens[start..start + lens[i]], Logits::None)?;
            stats.chunks_recomputed += 1;
        }
        session.set_position(evaluated)?;
        stats.seconds = t0.elapsed().as_secs_f64();
        self.counters.swap_ins += 1;
        self.counters.chunks_from_dram += stats.chunks_from_dram as u64;
        self.counters.chunks_from_disk += stats.chunks_from_disk as u64;
        self.counters.chunks_recomputed += stats.chunks_recomputed as u64;
        self.counters.chunks_corrupt += stats.chunks_corrupt as u64;
        if let Some(c) = self.contexts.get_mut(id) {
            c.last_restore = Some(stats);
            // Chunks recomputed because their copy was bad are rewritten at the next swap-out.
            if let Some(&first_bad) = redo.first() {
                c.clean = c.clean.min(first_bad * CHUNK_TOKENS);
            }
        }
        Ok(stats)
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

/// A chunk loaded from disk: the cache's own bytes, or values decoded from a code.
enum Loaded {
    Raw(Vec<u8>),
    Values(ChunkData),
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

/// Fault injection for tests: `GPU_OFFLOAD_TEST_SWAP_DELAY_MS` slows every chunk write of a
/// swap-out, so a test can kill the server while one is under way.
fn test_swap_delay() -> Option<std::time::Duration> {
    static DELAY: std::sync::OnceLock<Option<std::time::Duration>> = std::sync::OnceLock::new();
    *DELAY.get_or_init(|| {
        std::env::var("GPU_OFFLOAD_TEST_SWAP_DELAY_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .map(std::time::Duration::from_millis)
    })
}

/// Measure the cost models on this engine: recompute time per token from a forward pass over
/// a few chunks, load time per chunk and per byte from writing and reading chunk-sized files.
pub fn measure_costs<B: Backend>(
    engine: &Engine<B>,
    dir: Option<&std::path::Path>,
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
    let (per_chunk, per_byte) = match dir {
        None => (0.0, 0.0),
        Some(dir) => {
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
            let small = time_read(4096)?;
            let large = time_read(chunk_bytes.max(8192) * 4)?;
            std::fs::remove_dir_all(&probe).ok();
            let per_byte = ((large - small) / (chunk_bytes.max(8192) * 4 - 4096) as f64).max(0.0);
            (small.max(0.0), per_byte)
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
