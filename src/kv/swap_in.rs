//! Swap-in: a context's keys and values brought back into a session — chunks in DRAM decoded,
//! chunks on disk loaded on an I/O thread while a prefix of chunks is recomputed (the split the
//! cost model chooses), chunks without a usable copy recomputed from their tokens.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Instant;

use super::chunk::{self, Bits, CHUNK_TOKENS, ChunkData};
use super::context::{Context, RestoreStats};
use super::manager::KvManager;
use super::persist::{self, ChunkRecord};
use super::shared::{SharedError, SharedStore};
use super::{KvError, Result};
use crate::backend::Backend;
use crate::engine::{Engine, Logits, Session};

/// A chunk loaded from disk: the cache's own bytes, or values decoded from a code.
enum Loaded {
    Raw(Arc<Vec<u8>>),
    Values(ChunkData),
}

/// The shape of this engine's chunks: its layers and K/V width, and the width whose code is
/// the cache's own bytes ([`Bits::cache_bytes`]).
#[derive(Clone, Copy)]
struct ChunkShape {
    n_layers: usize,
    kv_dim: usize,
    raw_bits: Option<Bits>,
}

/// Where each chunk of a context can come back from.
struct ChunkSources {
    /// Positions of each chunk.
    lens: Vec<usize>,
    /// Its copy in DRAM (bytes and width), where one of its length is there.
    dram: Vec<Option<(Arc<Vec<u8>>, Bits)>>,
    /// Its record, where chunks are kept beyond DRAM (a local disk, the shared store) and one of
    /// its length is there.
    disk: Vec<Option<ChunkRecord>>,
    /// Bytes to load (local disk or store), for the chunks with a copy there and none in DRAM.
    on_disk: Vec<Option<u64>>,
}

impl KvManager {
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
        let sources = self.chunk_sources(c);
        let (n, lens) = (sources.lens.len(), &sources.lens);
        let prefix = self.cfg.costs.recompute_prefix(&sources.on_disk, lens);
        let mut stats = RestoreStats::default();
        session.truncate(0);
        let mut redo: Vec<usize> = Vec::new();
        let mut from_store = Vec::new();
        let copies = ChunkCopies {
            dir: self.cfg.dir.clone(),
            shared: self.cfg.shared.clone(),
        };
        let shape = ChunkShape {
            n_layers,
            kv_dim,
            raw_bits: Bits::cache_bytes(engine.kv_type()),
        };
        std::thread::scope(|scope| -> Result<()> {
            let (tx, rx) = mpsc::channel::<(usize, Option<(Loaded, Source)>)>();
            let io_jobs: Vec<(usize, ChunkRecord)> = (prefix..n)
                .filter(|&i| sources.on_disk[i].is_some())
                .filter_map(|i| sources.disk[i].clone().map(|r| (i, r)))
                .collect();
            if self.cfg.keeps_chunks() {
                let id = id.to_string();
                scope.spawn(move || read_chunk_copies(&copies, &id, io_jobs, shape, tx));
            } else {
                drop(tx);
            }
            if prefix > 0 {
                let upto: usize = lens[..prefix].iter().sum();
                engine.forward(session, &tokens[..upto], Logits::None)?;
                stats.chunks_recomputed += prefix;
            }
            write_dram_chunks(
                engine, session, &sources, prefix, shape, &mut stats, &mut redo,
            )?;
            write_loaded_chunks(
                engine,
                session,
                lens,
                rx,
                &mut stats,
                &mut redo,
                &mut from_store,
            )
        })?;
        // What came from the shared store stays in this replica's DRAM (under its budget): the
        // next restore of this revision here reads none of it again.
        for (i, bytes) in from_store {
            if let Some(r) = &sources.disk[i] {
                self.cache_in_dram(id, i, r.len, r.bits, bytes);
            }
        }
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
        self.record_restore(id, stats, &redo);
        Ok(stats)
    }

    /// Where each evaluated chunk of `c` can come back from: a DRAM copy or a disk record of
    /// its length.
    fn chunk_sources(&self, c: &Context) -> ChunkSources {
        let evaluated = c.index.evaluated;
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
                    .filter(|r| r.len == lens[i] && self.cfg.keeps_chunks())
            })
            .collect();
        let on_disk: Vec<Option<u64>> = (0..n)
            .map(|i| match (&dram[i], &disk[i]) {
                (None, Some(r)) => Some(r.bytes),
                _ => None,
            })
            .collect();
        ChunkSources {
            lens,
            dram,
            disk,
            on_disk,
        }
    }

    /// Count a restore of context `id` and keep its figures; chunks recomputed because their
    /// copy was bad are rewritten at the next swap-out.
    fn record_restore(&mut self, id: &str, stats: RestoreStats, redo: &[usize]) {
        self.counters.swap_ins += 1;
        self.counters.chunks_from_dram += stats.chunks_from_dram as u64;
        self.counters.chunks_from_disk += stats.chunks_from_disk as u64;
        self.counters.chunks_from_store += stats.chunks_from_store as u64;
        self.counters.chunks_recomputed += stats.chunks_recomputed as u64;
        self.counters.chunks_corrupt += stats.chunks_corrupt as u64;
        if let Some(c) = self.contexts.get_mut(id) {
            c.last_restore = Some(stats);
            // Chunks recomputed because their copy was bad are rewritten at the next swap-out.
            if let Some(&first_bad) = redo.first() {
                c.clean = c.clean.min(first_bad * CHUNK_TOKENS);
            }
        }
    }
}

/// Where a loaded chunk came from: the local disk, or the shared store (its encoded bytes
/// kept for this replica's DRAM, a cache in front of the store).
enum Source {
    Disk,
    Store(Arc<Vec<u8>>),
}

/// Where written chunks are: the local disk (`--kv-dir`), in front of the shared store.
struct ChunkCopies {
    dir: Option<PathBuf>,
    shared: Option<Arc<SharedStore>>,
}

impl ChunkCopies {
    /// Chunk `r` of `id`: the local disk's copy where it has a good one, else the store's.
    fn read(&self, id: &str, r: &ChunkRecord) -> Option<(Arc<Vec<u8>>, Source)> {
        let local = self.dir.as_ref().map(|d| persist::read_chunk(d, id, r));
        match (local, &self.shared) {
            (Some(Ok(b)), _) => Some((Arc::new(b), Source::Disk)),
            (_, Some(s)) => s
                .read_chunk(id, r)
                .map_err(|e| match e {
                    // The store's budget at work, not a fault.
                    SharedError::Evicted { .. } => tracing::debug!("{e}: recomputing"),
                    e => tracing::warn!("{e}: recomputing"),
                })
                .ok()
                .map(|b| {
                    let b = Arc::new(b);
                    (b.clone(), Source::Store(b))
                }),
            (Some(Err(e)), None) => {
                tracing::warn!("{e}: recomputing");
                None
            }
            (None, None) => None,
        }
    }
}

/// The I/O thread: read each chunk of `jobs` (local disk, else the shared store) and send it
/// decoded (or `None` where its copy is unusable: it is recomputed), until the receiver hangs
/// up.
fn read_chunk_copies(
    copies: &ChunkCopies,
    id: &str,
    jobs: Vec<(usize, ChunkRecord)>,
    shape: ChunkShape,
    tx: mpsc::Sender<(usize, Option<(Loaded, Source)>)>,
) {
    let ChunkShape {
        n_layers,
        kv_dim,
        raw_bits,
    } = shape;
    for (i, r) in jobs {
        let data = copies.read(id, &r).and_then(|(b, source)| {
            if Some(r.bits) == raw_bits {
                // The cache's own bytes: written as they are.
                let ok = b.len()
                    == chunk::encoded_len_rows(r.bits, 2 * n_layers * r.len * kv_dim, kv_dim);
                ok.then_some(Loaded::Raw(b))
            } else {
                chunk::decode(&b, r.bits, n_layers, kv_dim, r.len).map(Loaded::Values)
            }
            .map(|l| (l, source))
        });
        if tx.send((i, data)).is_err() {
            return;
        }
    }
}

/// Write the chunks from `prefix` on that have a DRAM copy into `session`; a copy that does
/// not decode goes to `redo`.
fn write_dram_chunks<B: Backend>(
    engine: &Engine<B>,
    session: &mut Session<B>,
    sources: &ChunkSources,
    prefix: usize,
    shape: ChunkShape,
    stats: &mut RestoreStats,
    redo: &mut Vec<usize>,
) -> Result<()> {
    let ChunkShape {
        n_layers,
        kv_dim,
        raw_bits,
    } = shape;
    let ChunkSources {
        lens,
        dram,
        on_disk,
        ..
    } = sources;
    let n = lens.len();
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
    Ok(())
}

/// Write the chunks the I/O thread loads into `session` as they arrive; one whose copy was
/// unusable goes to `redo`.
fn write_loaded_chunks<B: Backend>(
    engine: &Engine<B>,
    session: &mut Session<B>,
    lens: &[usize],
    rx: mpsc::Receiver<(usize, Option<(Loaded, Source)>)>,
    stats: &mut RestoreStats,
    redo: &mut Vec<usize>,
    from_store: &mut Vec<(usize, Arc<Vec<u8>>)>,
) -> Result<()> {
    for (i, data) in rx {
        match data {
            Some((d, source)) => {
                let at = i * CHUNK_TOKENS;
                match d {
                    Loaded::Raw(b) => engine.write_kv_raw(session, at, lens[i], &b)?,
                    Loaded::Values(d) => engine.write_kv(session, at, lens[i], &d.values)?,
                }
                match source {
                    Source::Disk => stats.chunks_from_disk += 1,
                    Source::Store(bytes) => {
                        stats.chunks_from_store += 1;
                        from_store.push((i, bytes));
                    }
                }
            }
            None => {
                stats.chunks_corrupt += 1;
                redo.push(i);
            }
        }
    }
    Ok(())
}
