//! The five ways to keep a context ([`Strategy`]) and what each does when a context leaves the
//! device and comes back: the `Mover` of each (`Recompute`, `WholeSwap`, `Chunked` over
//! `KvManager` for the chunked baselines and ours), the settings they run under and what their
//! stores held and moved. Knows no trace and no queue.

use std::path::{Path, PathBuf};

use serde::Serialize;

use super::error::{ContextsError, Result, io_err};
use crate::backend::Backend;
use crate::engine::{Engine, Logits, Session};
use crate::kv::{Bits, Compression, CostModel, KvConfig, KvCounters, KvManager};

/// How a context leaves the device and comes back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Strategy {
    Recompute,
    WholeSwap,
    ChunkedSwap,
    ChunkedInt8,
    Ours,
}

impl Strategy {
    pub const ALL: [Strategy; 5] = [
        Strategy::Recompute,
        Strategy::WholeSwap,
        Strategy::ChunkedSwap,
        Strategy::ChunkedInt8,
        Strategy::Ours,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Strategy::Recompute => "recompute",
            Strategy::WholeSwap => "whole-swap",
            Strategy::ChunkedSwap => "chunked-swap",
            Strategy::ChunkedInt8 => "chunked-int8",
            Strategy::Ours => "ours",
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Strategy::Recompute => "drop the KV; re-prefill the whole conversation on return",
            Strategy::WholeSwap => {
                "whole exact KV to DRAM (LRU contexts spilled to disk) at eviction, back on return"
            }
            Strategy::ChunkedSwap => {
                "16-token chunks, exact, written at eviction (DRAM + disk), loaded on return"
            }
            Strategy::ChunkedInt8 => "as chunked-swap with every chunk at int8",
            Strategy::Ours => {
                "LLMS: tolerance-aware widths (exact where decoding costs more than the bytes), swap/recompute split, LCTRU, ahead-of-time swap-out"
            }
        }
    }

    pub fn parse(s: &str) -> std::result::Result<Self, String> {
        Strategy::ALL
            .into_iter()
            .find(|k| k.name() == s.trim())
            .ok_or_else(|| {
                let names: Vec<&str> = Strategy::ALL.iter().map(|k| k.name()).collect();
                format!("`{s}` is not a strategy ({})", names.join(", "))
            })
    }
}

/// What a strategy does at each point of a context's life on and off the device.
pub(super) trait Mover<B: Backend> {
    /// The context (its history in `s`) is stored away before the trace starts.
    fn setup(&mut self, e: &Engine<B>, s: &mut Session<B>, c: usize, tokens: &[u32]) -> Result<()>;
    /// The context leaves the slot `s` (on the critical path of the call that wants it).
    /// `written`: [`Mover::after_call`] has run since the context last changed.
    fn evict(
        &mut self,
        e: &Engine<B>,
        s: &mut Session<B>,
        c: usize,
        tokens: &[u32],
        written: bool,
    ) -> Result<()>;
    /// Bring the context into `s` (reset) with its `tokens` evaluated.
    fn restore(
        &mut self,
        e: &Engine<B>,
        s: &mut Session<B>,
        c: usize,
        tokens: &[u32],
    ) -> Result<()>;
    /// Whether the strategy writes a context's new state ahead of its eviction
    /// ([`Mover::after_call`]), when the engine falls idle.
    fn writes_ahead(&self) -> bool {
        false
    }
    /// The engine is idle after a call on the context (which stays in `s`): write ahead.
    fn after_call(
        &mut self,
        _e: &Engine<B>,
        _s: &mut Session<B>,
        _c: usize,
        _tokens: &[u32],
    ) -> Result<()> {
        Ok(())
    }
    /// A call starts on the context (recency for the eviction order).
    fn touch(&mut self, _c: usize) {}
    fn stats(&self) -> MoverStats;
}

/// What a strategy's store holds and moved.
#[derive(Clone, Debug, Default, Serialize)]
pub struct MoverStats {
    /// Bytes of swapped KV in DRAM at the end.
    pub dram_bytes: u64,
    /// Bytes of swap files on disk at the end.
    pub disk_bytes: u64,
    /// Restores served from DRAM / disk / recomputation (whole contexts or chunks, by
    /// strategy: `unit` says which).
    pub from_dram: u64,
    pub from_disk: u64,
    pub recomputed: u64,
    pub unit: &'static str,
    pub dram_evictions: u64,
}

struct Recompute {
    restores: u64,
}

impl<B: Backend> Mover<B> for Recompute {
    fn setup(&mut self, _: &Engine<B>, _: &mut Session<B>, _: usize, _: &[u32]) -> Result<()> {
        Ok(())
    }
    fn evict(
        &mut self,
        _: &Engine<B>,
        _: &mut Session<B>,
        _: usize,
        _: &[u32],
        _: bool,
    ) -> Result<()> {
        Ok(())
    }
    fn restore(&mut self, e: &Engine<B>, s: &mut Session<B>, _: usize, t: &[u32]) -> Result<()> {
        s.truncate(0);
        e.forward(s, t, Logits::None)?;
        self.restores += 1;
        Ok(())
    }
    fn stats(&self) -> MoverStats {
        MoverStats {
            recomputed: self.restores,
            unit: "context",
            ..Default::default()
        }
    }
}

/// A whole context's KV off the device.
enum Held {
    None,
    Dram {
        payload: Vec<u8>,
        len: usize,
        last: u64,
    },
    Disk {
        path: PathBuf,
        len: usize,
    },
}

/// Whole-context swap: the exact KV as the cache holds it (its own bytes, no conversion), one
/// buffer per context, no chunking; past the DRAM budget the least recently evicted contexts
/// are written whole to disk (atomically, as every swap file here is).
struct WholeSwap {
    dir: PathBuf,
    budget: u64,
    held: Vec<Held>,
    dram_used: u64,
    clock: u64,
    stats: MoverStats,
}

impl WholeSwap {
    fn spill(&mut self, c: usize, p: &[u8], len: usize) -> Result<()> {
        let path = self.dir.join(format!("context-{c}.kv"));
        crate::fsutil::write_atomic(&path, p).map_err(io_err(&path))?;
        self.stats.disk_bytes += p.len() as u64;
        self.held[c] = Held::Disk { path, len };
        Ok(())
    }

    fn store(&mut self, c: usize, payload: Vec<u8>, len: usize) -> Result<()> {
        if self.held.len() <= c {
            self.held.resize_with(c + 1, || Held::None);
        }
        let need = payload.len() as u64;
        if need > self.budget {
            return self.spill(c, &payload, len);
        }
        while self.dram_used + need > self.budget {
            let victim = self
                .held
                .iter()
                .enumerate()
                .filter_map(|(i, h)| match h {
                    Held::Dram { last, .. } => Some((*last, i)),
                    _ => None,
                })
                .min();
            let Some((_, v)) = victim else { break };
            if let Held::Dram {
                payload: p, len: l, ..
            } = std::mem::replace(&mut self.held[v], Held::None)
            {
                self.dram_used -= p.len() as u64;
                self.stats.dram_evictions += 1;
                self.spill(v, &p, l)?;
            }
        }
        self.clock += 1;
        self.dram_used += need;
        self.held[c] = Held::Dram {
            payload,
            len,
            last: self.clock,
        };
        Ok(())
    }
}

impl<B: Backend> Mover<B> for WholeSwap {
    fn setup(&mut self, e: &Engine<B>, s: &mut Session<B>, c: usize, t: &[u32]) -> Result<()> {
        <Self as Mover<B>>::evict(self, e, s, c, t, false)
    }
    fn evict(
        &mut self,
        e: &Engine<B>,
        s: &mut Session<B>,
        c: usize,
        _: &[u32],
        _: bool,
    ) -> Result<()> {
        let len = s.position();
        let payload = e.read_kv_raw(s, 0, len)?;
        self.store(c, payload, len)
    }
    fn restore(&mut self, e: &Engine<B>, s: &mut Session<B>, c: usize, _: &[u32]) -> Result<()> {
        let held = self
            .held
            .get_mut(c)
            .map_or(Held::None, |h| std::mem::replace(h, Held::None));
        let (payload, len) = match held {
            Held::Dram { payload, len, .. } => {
                self.dram_used -= payload.len() as u64;
                self.stats.from_dram += 1;
                (payload, len)
            }
            Held::Disk { path, len } => {
                let b = std::fs::read(&path).map_err(io_err(&path))?;
                std::fs::remove_file(&path).ok();
                self.stats.disk_bytes -= b.len() as u64;
                self.stats.from_disk += 1;
                (b, len)
            }
            Held::None => {
                return Err(ContextsError::Invalid(format!(
                    "whole-swap: context {c} was never swapped out"
                )));
            }
        };
        s.truncate(0);
        e.write_kv_raw(s, 0, len, &payload)?;
        s.set_position(len)?;
        Ok(())
    }
    fn stats(&self) -> MoverStats {
        MoverStats {
            dram_bytes: self.dram_used,
            unit: "context",
            ..self.stats.clone()
        }
    }
}

/// `KvManager`: the chunked baselines (swap-out at eviction) and ours (swap-out ahead of time,
/// when the engine falls idle after a call).
struct Chunked {
    kv: KvManager,
    ids: Vec<String>,
    ahead_of_time: bool,
}

impl Chunked {
    fn sync_tokens(&mut self, c: usize, t: &[u32]) -> Result<()> {
        let ctx = self.kv.get_mut(&self.ids[c], None)?;
        ctx.index.tokens.clear();
        ctx.index.tokens.extend_from_slice(t);
        Ok(())
    }

    fn swap_out<B: Backend>(
        &mut self,
        e: &Engine<B>,
        s: &mut Session<B>,
        c: usize,
        t: &[u32],
    ) -> Result<()> {
        self.sync_tokens(c, t)?;
        self.kv.swap_out(e, s, &self.ids[c])?;
        Ok(())
    }
}

impl<B: Backend> Mover<B> for Chunked {
    fn setup(&mut self, e: &Engine<B>, s: &mut Session<B>, c: usize, t: &[u32]) -> Result<()> {
        while self.ids.len() <= c {
            let id = self.kv.create(None, None)?;
            self.ids.push(id);
        }
        self.swap_out(e, s, c, t)
    }
    fn evict(
        &mut self,
        e: &Engine<B>,
        s: &mut Session<B>,
        c: usize,
        t: &[u32],
        written: bool,
    ) -> Result<()> {
        if self.ahead_of_time && written {
            // Written when the engine fell idle after its last call: taking the slot is free.
            return Ok(());
        }
        self.swap_out(e, s, c, t)
    }
    fn restore(&mut self, e: &Engine<B>, s: &mut Session<B>, c: usize, _: &[u32]) -> Result<()> {
        self.kv.swap_in(e, s, &self.ids[c])?;
        Ok(())
    }
    fn writes_ahead(&self) -> bool {
        self.ahead_of_time
    }
    fn after_call(&mut self, e: &Engine<B>, s: &mut Session<B>, c: usize, t: &[u32]) -> Result<()> {
        if self.ahead_of_time {
            self.swap_out(e, s, c, t)?;
        }
        Ok(())
    }
    fn touch(&mut self, c: usize) {
        if let Some(id) = self.ids.get(c) {
            self.kv.get_mut(id, None).ok();
        }
    }
    fn stats(&self) -> MoverStats {
        let k: KvCounters = self.kv.counters;
        let disk: u64 = self
            .kv
            .contexts()
            .flat_map(|c| c.index.chunks.iter().flatten())
            .map(|r| r.bytes)
            .sum();
        MoverStats {
            dram_bytes: self.kv.dram_bytes(),
            disk_bytes: disk,
            from_dram: k.chunks_from_dram,
            from_disk: k.chunks_from_disk,
            recomputed: k.chunks_recomputed,
            unit: "chunk",
            dram_evictions: k.dram_evictions,
        }
    }
}

/// Settings every strategy runs under.
#[derive(Clone, Debug)]
pub struct RunSettings {
    /// Contexts whose KV the device holds at once (slots).
    pub resident: usize,
    /// Bytes of swapped KV kept in DRAM (each strategy's own store).
    pub dram_budget: u64,
    /// Ours: how chunks are compressed.
    pub compression: Compression,
    /// Scratch directory for swap files (one folder per strategy, removed after).
    pub kv_dir: PathBuf,
    pub model_id: String,
    /// Ours: the measured cost model.
    pub costs: CostModel,
}

pub(super) fn mover<B: Backend>(
    kind: Strategy,
    set: &RunSettings,
    dir: &Path,
) -> Result<Box<dyn Mover<B>>> {
    // Baselines never choose to recompute: a recompute cost no load can lose to.
    let never = CostModel {
        recompute_s_per_token: 1e9,
        load_s_per_chunk: 0.0,
        load_s_per_byte: 0.0,
        decode_s_per_value: 0.0,
    };
    let chunked = |compression, costs, ahead_of_time| -> Result<Box<dyn Mover<B>>> {
        let cfg = KvConfig {
            shared: None,
            compression,
            dram_budget: set.dram_budget,
            dir: Some(dir.to_path_buf()),
            model_id: set.model_id.clone(),
            costs,
        };
        let (kv, _) = KvManager::open(cfg, None)?;
        Ok(Box::new(Chunked {
            kv,
            ids: Vec::new(),
            ahead_of_time,
        }))
    };
    match kind {
        Strategy::Recompute => Ok(Box::new(Recompute { restores: 0 })),
        Strategy::WholeSwap => Ok(Box::new(WholeSwap {
            dir: dir.to_path_buf(),
            budget: set.dram_budget,
            held: Vec::new(),
            dram_used: 0,
            clock: 0,
            stats: MoverStats::default(),
        })),
        Strategy::ChunkedSwap => chunked(Compression::Off, never, false),
        Strategy::ChunkedInt8 => chunked(Compression::Uniform(Bits::Q8), never, false),
        Strategy::Ours => chunked(set.compression, set.costs, true),
    }
}
