//! `bench contexts`: the LLMS trace benchmark. N persistent contexts receive calls (Poisson
//! arrivals; the next call stays on the last context with a "sticky" probability, else goes to
//! one drawn at random); only `resident` contexts' KV fit on the device at once (the slots of
//! `serve --parallel`), so a call to another context first takes a slot from the least recently
//! used one. Every strategy replays the same trace with the real engine and real copies, and
//! what is reported is the wall clock of that work:
//! 1. `recompute`: drop the KV on eviction, re-prefill the whole conversation on return;
//! 2. `whole-swap`: the whole exact KV (at the device's KV width) out to DRAM on eviction and
//!    back on return, the least recently used contexts spilled whole to disk past the budget;
//! 3. `chunked-swap`: `KvManager` with compression off, swapped out at eviction, never
//!    recomputing (the cost model made to say recomputing never pays);
//! 4. `chunked-int8`: the same with every chunk at 8 bits;
//! 5. `ours`: `KvManager` as `serve` runs it: tolerance-aware widths (a chunk kept exact where
//!    the measured decode costs more than loading the bytes exact adds), the measured
//!    swap/recompute split, LCTRU and ahead-of-time swap-out at the end of every call.
//!
//! The queue is computed, not slept: one engine thread serves calls in arrival order, busy for
//! the measured time of each (switch, prefill, answer, and the ahead-of-time swap-out where a
//! strategy does one), as `serve`'s engine thread is. Nothing here parses flags or prints.

use std::path::{Path, PathBuf};
use std::time::Instant;

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use serde::Serialize;
use thiserror::Error;

use crate::backend::Backend;
use crate::engine::sampler::argmax;
use crate::engine::{Engine, EngineError, Logits, Session};
use crate::footprint::PROBE_QUERIES;
use crate::kv::{self, Bits, Compression, CostModel, KvConfig, KvCounters, KvError, KvManager};

/// `schema` of contexts.json; bumped when a field changes meaning.
pub const SCHEMA: &str = "gpu-offload/bench-contexts/1";

#[derive(Debug, Error)]
pub enum ContextsError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Kv(#[from] KvError),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, ContextsError>;

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> ContextsError + '_ {
    move |source| ContextsError::Io {
        path: path.to_path_buf(),
        source,
    }
}

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

// ------------------------------------------------------------------------------------- trace

/// The shape of a trace.
#[derive(Clone, Debug, Serialize)]
pub struct TraceConfig {
    pub contexts: usize,
    pub calls: usize,
    /// Tokens of each context's conversation before the trace starts.
    pub history_tokens: usize,
    /// Inclusive ranges, drawn uniformly.
    pub user_tokens: (usize, usize),
    pub answer_tokens: (usize, usize),
    /// Mean call arrivals per second (Poisson).
    pub rate_per_s: f64,
    /// Probability that a call goes to the context of the call before (else one drawn
    /// uniformly from all contexts): 0 switches at random, near 1 is a sticky Markov chain.
    pub sticky: f64,
    pub seed: u64,
}

impl TraceConfig {
    /// Refuse what cannot make a trace, naming the setting.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let range_ok = |(lo, hi): (usize, usize)| lo >= 1 && lo <= hi;
        if self.contexts == 0 || self.calls == 0 || self.history_tokens == 0 {
            return Err("contexts, calls and history tokens must each be at least 1".into());
        }
        if !range_ok(self.user_tokens) || !range_ok(self.answer_tokens) {
            return Err("turn lengths must be ranges MIN-MAX with 1 <= MIN <= MAX".into());
        }
        if !(self.rate_per_s.is_finite() && self.rate_per_s > 0.0) {
            return Err(format!(
                "the call rate must be a positive number of calls per second, not {}",
                self.rate_per_s
            ));
        }
        if !(0.0..=1.0).contains(&self.sticky) {
            return Err(format!(
                "the sticky probability must be within 0..=1, not {}",
                self.sticky
            ));
        }
        Ok(())
    }
}

/// Where a trace's tokens come from.
pub enum TokenSource {
    /// A tokenized corpus: each context reads it from its own seeded offset (wrapping).
    Corpus(Vec<u32>),
    /// Seeded random ids below `vocab`.
    Random { vocab: usize },
}

/// One context's token stream: deterministic in (seed, context), not in how many contexts the
/// trace has, so sweep points share their histories (and the histories' prefill).
struct Stream<'a> {
    src: &'a TokenSource,
    at: usize,
    rng: StdRng,
}

impl<'a> Stream<'a> {
    fn new(src: &'a TokenSource, seed: u64, context: usize) -> Self {
        let mut rng =
            StdRng::seed_from_u64(seed ^ (context as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let at = match src {
            TokenSource::Corpus(t) if !t.is_empty() => rng.random_range(0..t.len()),
            _ => 0,
        };
        Stream { src, at, rng }
    }

    fn take(&mut self, n: usize) -> Vec<u32> {
        match self.src {
            TokenSource::Corpus(t) if !t.is_empty() => (0..n)
                .map(|_| {
                    let v = t[self.at % t.len()];
                    self.at += 1;
                    v
                })
                .collect(),
            TokenSource::Corpus(_) => vec![0; n],
            TokenSource::Random { vocab } => {
                // Ids 0..3 are often BOS/EOS/unknown: keep clear of them when the vocabulary allows.
                let lo = if *vocab > 4 { 3 } else { 0 };
                let hi = (*vocab).max(1) as u32;
                (0..n).map(|_| self.rng.random_range(lo..hi)).collect()
            }
        }
    }
}

/// One call: when it arrives, which context, what the user says and what the answer is (the
/// answer is fixed by the trace so every strategy evaluates the same tokens).
#[derive(Clone, Debug)]
pub struct Call {
    pub arrival_s: f64,
    pub context: usize,
    pub user: Vec<u32>,
    pub answer: Vec<u32>,
}

#[derive(Clone, Debug)]
pub struct Trace {
    pub cfg: TraceConfig,
    pub histories: Vec<Vec<u32>>,
    pub calls: Vec<Call>,
}

impl Trace {
    pub fn generate(cfg: &TraceConfig, src: &TokenSource) -> Trace {
        let mut streams: Vec<Stream> = (0..cfg.contexts)
            .map(|i| Stream::new(src, cfg.seed, i))
            .collect();
        let histories = streams
            .iter_mut()
            .map(|s| s.take(cfg.history_tokens))
            .collect();
        let mut rng = StdRng::seed_from_u64(cfg.seed.wrapping_add(cfg.contexts as u64 * 7919));
        let mut t = 0.0;
        let mut prev: Option<usize> = None;
        let mut calls = Vec::with_capacity(cfg.calls);
        for _ in 0..cfg.calls {
            let u: f64 = rng.random();
            t += -(1.0 - u).ln() / cfg.rate_per_s;
            let context = match prev {
                Some(p) if rng.random::<f64>() < cfg.sticky => p,
                _ => rng.random_range(0..cfg.contexts),
            };
            prev = Some(context);
            let nu = rng.random_range(cfg.user_tokens.0..=cfg.user_tokens.1);
            let na = rng.random_range(cfg.answer_tokens.0..=cfg.answer_tokens.1);
            let user = streams[context].take(nu);
            let answer = streams[context].take(na);
            calls.push(Call {
                arrival_s: t,
                context,
                user,
                answer,
            });
        }
        Trace {
            cfg: cfg.clone(),
            histories,
            calls,
        }
    }

    /// The longest any context grows to (the session size every slot needs).
    pub fn max_context_tokens(&self) -> usize {
        let mut len: Vec<usize> = self.histories.iter().map(Vec::len).collect();
        for c in &self.calls {
            len[c.context] += c.user.len() + c.answer.len();
        }
        len.into_iter().max().unwrap_or(0)
    }
}

// ------------------------------------------------------------------------------ strategies

/// What a strategy does at each point of a context's life on and off the device.
trait Mover<B: Backend> {
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

// ---------------------------------------------------------------------------------- running

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

/// Mean and tail of a set of seconds.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Summary {
    pub n: usize,
    pub mean: f64,
    pub p50: f64,
    pub p99: f64,
    pub max: f64,
}

impl Summary {
    /// None for an empty set. Percentiles by nearest rank (p99 of fewer than 100 values is the
    /// largest).
    pub fn of(values: &[f64]) -> Option<Summary> {
        if values.is_empty() {
            return None;
        }
        let mut v = values.to_vec();
        v.sort_by(f64::total_cmp);
        let rank = |p: f64| v[((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
        Some(Summary {
            n: v.len(),
            mean: v.iter().sum::<f64>() / v.len() as f64,
            p50: rank(0.5),
            p99: rank(0.99),
            max: v[v.len() - 1],
        })
    }
}

/// One call as a strategy served it.
#[derive(Clone, Debug, Serialize)]
pub struct CallRecord {
    pub context: usize,
    /// Tokens the context held when the call began.
    pub context_tokens: usize,
    pub switched: bool,
    /// Taking the slot from the context that held it (critical path).
    pub switch_out_s: f64,
    /// Bringing this context's KV in.
    pub switch_in_s: f64,
    /// The user turn's prefill and the answer as this strategy's run timed them.
    pub prefill_s: f64,
    pub answer_s: f64,
    /// The same two as timed once for every strategy, in a run that never switches: what the
    /// queue and TTFT use (see [`NoSwitch`]).
    pub shared_prefill_s: f64,
    pub shared_answer_s: f64,
    /// Work after the answer on the engine thread (ours: the ahead-of-time swap-out, when the
    /// engine falls idle).
    pub after_s: f64,
    pub wait_s: f64,
    /// Wait + switch + prefill of the user turn (to the first token's logits).
    pub ttft_s: f64,
}

/// How a strategy's logits after each restore compare with a context never swapped out.
#[derive(Clone, Debug, Serialize)]
pub struct CheckResult {
    pub calls: usize,
    /// Calls whose greedy next token equals the never-swapped run's.
    pub top1_agree: usize,
    pub max_abs_logit_diff: f32,
    /// Every compared logit equal to the bit.
    pub exact: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct StrategyResult {
    pub strategy: Strategy,
    pub contexts: usize,
    pub calls_run: usize,
    /// The run stopped at the first call over the latency target (a sweep point it missed).
    pub stopped_early: bool,
    pub switches: usize,
    /// Switch latency (out + in) over the calls that switched.
    pub switch_s: Option<Summary>,
    pub switch_out_s: Option<Summary>,
    pub switch_in_s: Option<Summary>,
    pub ttft_s: Option<Summary>,
    pub after_s_mean: f64,
    /// Smallest context brought in by a switch, in tokens.
    pub min_switch_context_tokens: Option<usize>,
    pub mean_switch_context_tokens: Option<f64>,
    pub store: MoverStats,
    pub check: Option<CheckResult>,
    pub calls: Vec<CallRecord>,
}

/// The KV of each context's history but the last [`PROBE_QUERIES`] tokens, computed once and
/// shared by every strategy and sweep point (histories depend only on the seed and the context).
pub struct Histories {
    values: Vec<Option<Vec<f32>>>,
}

impl Histories {
    pub fn new() -> Self {
        Histories { values: Vec::new() }
    }

    fn ensure<B: Backend>(
        &mut self,
        e: &Engine<B>,
        s: &mut Session<B>,
        trace: &Trace,
        progress: &dyn Fn(&str),
    ) -> Result<()> {
        for (i, h) in trace.histories.iter().enumerate() {
            if self.values.get(i).is_some_and(Option::is_some) {
                continue;
            }
            progress(&format!(
                "prefilling the history of context {i} ({} tokens)",
                h.len()
            ));
            let keep = h.len() - PROBE_QUERIES.min(h.len());
            s.truncate(0);
            if keep > 0 {
                e.forward(s, &h[..keep], Logits::None)?;
            }
            let v = e.read_kv(s, 0, keep)?;
            if self.values.len() <= i {
                self.values.resize_with(i + 1, || None);
            }
            self.values[i] = Some(v);
        }
        Ok(())
    }

    /// Put context `c`'s history into `s`: the stored KV, then its last tokens evaluated for
    /// real, so the session's query probe holds what a full prefill would leave (ours picks
    /// widths from it).
    fn load<B: Backend>(
        &self,
        e: &Engine<B>,
        s: &mut Session<B>,
        c: usize,
        h: &[u32],
    ) -> Result<()> {
        let keep = h.len() - PROBE_QUERIES.min(h.len());
        let v = self
            .values
            .get(c)
            .and_then(Option::as_ref)
            .ok_or_else(|| ContextsError::Invalid(format!("history {c} not prefilled")))?;
        s.truncate(0);
        e.write_kv(s, 0, keep, v)?;
        s.set_position(keep)?;
        e.forward(s, &h[keep..], Logits::None)?;
        Ok(())
    }
}

impl Default for Histories {
    fn default() -> Self {
        Self::new()
    }
}

/// A run of a trace in which no context ever leaves the device (each context's calls in
/// order, one context after another): the work every strategy shares, timed once.
///
/// Each call's user-turn prefill and answer are the same work whatever strategy brought the
/// context in (the same positions, the same kernels). Every strategy's queue uses these times
/// for them, so that TTFTs differ only by what the strategies themselves do (switch,
/// after-call) and the waits that causes, not by the noise of timing the shared work five
/// times; each strategy's own timings of it stay in its [`CallRecord`]s.
pub struct NoSwitch {
    /// The logits after each call's user turn (the check's reference), when asked for.
    pub logits: Option<Vec<Vec<f32>>>,
    pub prefill_s: Vec<f64>,
    pub answer_s: Vec<f64>,
}

pub fn no_switch_run<B: Backend>(
    e: &Engine<B>,
    s: &mut Session<B>,
    trace: &Trace,
    hist: &mut Histories,
    keep_logits: bool,
    progress: &dyn Fn(&str),
) -> Result<NoSwitch> {
    hist.ensure(e, s, trace, progress)?;
    let n = trace.calls.len();
    let mut out = NoSwitch {
        logits: keep_logits.then(|| vec![Vec::new(); n]),
        prefill_s: vec![0.0; n],
        answer_s: vec![0.0; n],
    };
    for c in 0..trace.cfg.contexts {
        hist.load(e, s, c, &trace.histories[c])?;
        for (k, call) in trace
            .calls
            .iter()
            .enumerate()
            .filter(|(_, x)| x.context == c)
        {
            let t = Instant::now();
            let logits = e.forward(s, &call.user, Logits::Last)?;
            out.prefill_s[k] = t.elapsed().as_secs_f64();
            let t = Instant::now();
            e.forward(s, &call.answer, Logits::None)?;
            out.answer_s[k] = t.elapsed().as_secs_f64();
            if let Some(l) = out.logits.as_mut() {
                l[k] = logits;
            }
        }
    }
    Ok(out)
}

fn mover<B: Backend>(kind: Strategy, set: &RunSettings, dir: &Path) -> Result<Box<dyn Mover<B>>> {
    // Baselines never choose to recompute: a recompute cost no load can lose to.
    let never = CostModel {
        recompute_s_per_token: 1e9,
        load_s_per_chunk: 0.0,
        load_s_per_byte: 0.0,
        decode_s_per_value: 0.0,
    };
    let chunked = |compression, costs, ahead_of_time| -> Result<Box<dyn Mover<B>>> {
        let cfg = KvConfig {
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

/// Replay `trace` with one strategy. `sessions` are the device's slots; `shared`: the trace's
/// run without switches (the shared work's times, and the check's logits when it kept them);
/// `stop_above`: stop at the first call whose TTFT exceeds it (a sweep point that already
/// missed its target).
#[allow(clippy::too_many_arguments)]
pub fn run_strategy<B: Backend>(
    e: &Engine<B>,
    sessions: &mut [Session<B>],
    trace: &Trace,
    hist: &mut Histories,
    kind: Strategy,
    set: &RunSettings,
    shared: &NoSwitch,
    stop_above: Option<f64>,
    progress: &dyn Fn(&str),
) -> Result<StrategyResult> {
    if sessions.is_empty() {
        return Err(ContextsError::Invalid("no device slots".into()));
    }
    hist.ensure(e, &mut sessions[0], trace, progress)?;
    let dir = set.kv_dir.join(kind.name());
    if dir.exists() {
        std::fs::remove_dir_all(&dir).map_err(io_err(&dir))?;
    }
    std::fs::create_dir_all(&dir).map_err(io_err(&dir))?;
    let result = replay(
        e, sessions, trace, hist, kind, set, shared, stop_above, &dir, progress,
    );
    std::fs::remove_dir_all(&dir).ok();
    result
}

#[allow(clippy::too_many_arguments)]
fn replay<B: Backend>(
    e: &Engine<B>,
    sessions: &mut [Session<B>],
    trace: &Trace,
    hist: &Histories,
    kind: Strategy,
    set: &RunSettings,
    shared: &NoSwitch,
    stop_above: Option<f64>,
    dir: &Path,
    progress: &dyn Fn(&str),
) -> Result<StrategyResult> {
    let n = trace.cfg.contexts;
    let reference = shared.logits.as_deref();
    if shared.prefill_s.len() != trace.calls.len() || shared.answer_s.len() != trace.calls.len() {
        return Err(ContextsError::Invalid(
            "the shared work's times are not this trace's".into(),
        ));
    }
    let mut m = mover::<B>(kind, set, dir)?;
    // Before the trace every context has been served and swapped out.
    for (c, h) in trace.histories.iter().enumerate() {
        if kind != Strategy::Recompute {
            hist.load(e, &mut sessions[0], c, h)?;
        }
        m.setup(e, &mut sessions[0], c, h)?;
    }
    for s in sessions.iter_mut() {
        s.truncate(0);
    }
    let mut tokens: Vec<Vec<u32>> = trace.histories.clone();
    let slots = sessions.len();
    let mut holder: Vec<Option<usize>> = vec![None; slots];
    // Slots whose context changed since it was last written (strategies that write ahead).
    let mut unwritten = vec![false; slots];
    let mut last_use = vec![0u64; slots];
    let mut server_free = 0.0f64;
    let mut calls = Vec::with_capacity(trace.calls.len());
    let mut check = reference.map(|_| CheckResult {
        calls: 0,
        top1_agree: 0,
        max_abs_logit_diff: 0.0,
        exact: true,
    });
    let mut stopped_early = false;
    for (k, call) in trace.calls.iter().enumerate() {
        let c = call.context;
        // The slot holding the context, else an empty one, else the least recently used.
        let slot = holder
            .iter()
            .position(|h| *h == Some(c))
            .or_else(|| holder.iter().position(Option::is_none))
            .unwrap_or_else(|| (0..slots).min_by_key(|&i| last_use[i]).unwrap_or_default());
        last_use[slot] = k as u64 + 1;
        let s = &mut sessions[slot];
        let context_tokens = tokens[c].len();
        let t0 = Instant::now();
        let switched = holder[slot] != Some(c);
        let (mut out_s, mut in_s) = (0.0, 0.0);
        if switched {
            if let Some(v) = holder[slot].take() {
                m.evict(e, s, v, &tokens[v], !unwritten[slot])?;
                unwritten[slot] = false;
            }
            out_s = t0.elapsed().as_secs_f64();
            let t1 = Instant::now();
            m.restore(e, s, c, &tokens[c])?;
            in_s = t1.elapsed().as_secs_f64();
            holder[slot] = Some(c);
        }
        m.touch(c);
        if s.position() != tokens[c].len() {
            return Err(ContextsError::Invalid(format!(
                "{}: context {c} came back with {} tokens, not {}",
                kind.name(),
                s.position(),
                tokens[c].len()
            )));
        }
        let t2 = Instant::now();
        let logits = e.forward(s, &call.user, Logits::Last)?;
        let prefill_s = t2.elapsed().as_secs_f64();
        // The first token is out: the rest of the answer is the trace's (teacher-forced).
        let _first = argmax(&logits);
        let t3 = Instant::now();
        e.forward(s, &call.answer, Logits::None)?;
        let answer_s = t3.elapsed().as_secs_f64();
        tokens[c].extend_from_slice(&call.user);
        tokens[c].extend_from_slice(&call.answer);
        let (shared_prefill_s, shared_answer_s) = (shared.prefill_s[k], shared.answer_s[k]);
        let start = call.arrival_s.max(server_free);
        let wait_s = start - call.arrival_s;
        let ttft_s = wait_s + out_s + in_s + shared_prefill_s;
        let done = start + out_s + in_s + shared_prefill_s + shared_answer_s;
        // Ahead-of-time writes go where the engine falls idle: while a call is already waiting
        // they wait too (a context taken off the device before then writes at eviction).
        let mut after_s = 0.0;
        if m.writes_ahead() {
            unwritten[slot] = true;
            let idle = trace
                .calls
                .get(k + 1)
                .is_none_or(|next| next.arrival_s > done);
            if idle {
                let t4 = Instant::now();
                for j in 0..slots {
                    if let (true, Some(h)) = (unwritten[j], holder[j]) {
                        m.after_call(e, &mut sessions[j], h, &tokens[h])?;
                    }
                    unwritten[j] = false;
                }
                after_s = t4.elapsed().as_secs_f64();
            }
        }
        if let (Some(chk), Some(r)) = (check.as_mut(), reference.and_then(|r| r.get(k))) {
            chk.calls += 1;
            if argmax(r) == argmax(&logits) {
                chk.top1_agree += 1;
            }
            for (a, b) in r.iter().zip(&logits) {
                let d = (a - b).abs();
                if a.to_bits() != b.to_bits() {
                    chk.exact = false;
                }
                if d > chk.max_abs_logit_diff || d.is_nan() {
                    chk.max_abs_logit_diff = if d.is_nan() { f32::INFINITY } else { d };
                }
            }
        }
        server_free = done + after_s;
        calls.push(CallRecord {
            context: c,
            context_tokens,
            switched,
            switch_out_s: out_s,
            switch_in_s: in_s,
            prefill_s,
            answer_s,
            shared_prefill_s,
            shared_answer_s,
            after_s,
            wait_s,
            ttft_s,
        });
        if (k + 1) % 8 == 0 || k + 1 == trace.calls.len() {
            progress(&format!(
                "{} with {n} contexts: {}/{} calls",
                kind.name(),
                k + 1,
                trace.calls.len()
            ));
        }
        if stop_above.is_some_and(|t| ttft_s > t) {
            stopped_early = true;
            break;
        }
    }
    let sw: Vec<&CallRecord> = calls.iter().filter(|r| r.switched).collect();
    let pick = |f: &dyn Fn(&CallRecord) -> f64, only_switches: bool| -> Option<Summary> {
        let v: Vec<f64> = if only_switches {
            sw.iter().map(|r| f(r)).collect()
        } else {
            calls.iter().map(f).collect()
        };
        Summary::of(&v)
    };
    Ok(StrategyResult {
        strategy: kind,
        contexts: n,
        calls_run: calls.len(),
        stopped_early,
        switches: sw.len(),
        switch_s: pick(&|r| r.switch_out_s + r.switch_in_s, true),
        switch_out_s: pick(&|r| r.switch_out_s, true),
        switch_in_s: pick(&|r| r.switch_in_s, true),
        ttft_s: pick(&|r| r.ttft_s, false),
        after_s_mean: calls.iter().map(|r| r.after_s).sum::<f64>() / calls.len().max(1) as f64,
        min_switch_context_tokens: sw.iter().map(|r| r.context_tokens).min(),
        mean_switch_context_tokens: (!sw.is_empty())
            .then(|| sw.iter().map(|r| r.context_tokens as f64).sum::<f64>() / sw.len() as f64),
        store: m.stats(),
        check,
        calls,
    })
}

// ----------------------------------------------------------------------------------- report

#[derive(Clone, Debug, Serialize)]
pub struct ModelInfo {
    pub name: String,
    pub path: String,
    pub n_layers: usize,
    pub kv_dim: usize,
    pub max_context: usize,
    /// The device's KV element type.
    pub kv_type: String,
    /// Device KV bytes per token (all layers, K and V).
    pub kv_bytes_per_token: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct DeviceInfo {
    /// cpu, sim or cuda.
    pub kind: String,
    pub gpu_mem: Option<u64>,
    pub threads: usize,
}

#[derive(Clone, Debug, Serialize)]
pub struct Settings {
    pub trace: TraceConfig,
    pub resident: usize,
    /// Positions each device slot holds (the longest context of any trace run).
    pub ctx_size: usize,
    pub dram_budget: u64,
    /// Ours: chunk compression.
    pub compression: String,
    pub kv_dir: String,
    /// Where the tokens come from.
    pub tokens: String,
    pub ttft_target_s: f64,
    pub sweep_contexts: Vec<usize>,
    pub check: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct CostInfo {
    pub recompute_s_per_token: f64,
    pub load_s_per_chunk: f64,
    pub load_s_per_byte: f64,
    pub decode_s_per_value: f64,
}

/// How much faster ours switches and answers than one baseline (baseline ÷ ours).
#[derive(Clone, Debug, Serialize)]
pub struct Speedup {
    pub baseline: Strategy,
    pub switch_mean: Option<f64>,
    pub switch_p99: Option<f64>,
    pub ttft_mean: Option<f64>,
    pub ttft_p99: Option<f64>,
}

#[derive(Clone, Debug, Serialize)]
pub struct SweepCell {
    pub strategy: Strategy,
    pub ttft_p99_s: Option<f64>,
    pub switch_mean_s: Option<f64>,
    pub calls_run: usize,
    pub stopped_early: bool,
    pub met: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct SweepPoint {
    pub contexts: usize,
    pub cells: Vec<SweepCell>,
}

#[derive(Clone, Debug, Serialize)]
pub struct MostContexts {
    pub strategy: Strategy,
    /// The most contexts N such that every count tried up to N met the p99 TTFT target (None:
    /// the smallest tried missed it).
    pub contexts: Option<usize>,
}

#[derive(Clone, Debug, Serialize)]
pub struct ContextsReport {
    pub schema: &'static str,
    pub gpu_offload_version: &'static str,
    pub created_unix_s: u64,
    pub model: ModelInfo,
    pub device: DeviceInfo,
    pub settings: Settings,
    /// Ours' cost model, measured on this engine before the run.
    pub cost_model: CostInfo,
    /// The main trace, every strategy.
    pub strategies: Vec<StrategyResult>,
    /// Ours against each baseline on the main trace.
    pub speedups: Vec<Speedup>,
    /// Whether ours has the lowest mean and p99 switch latency and TTFT of all strategies run.
    pub ours_fastest: Option<bool>,
    pub sweep: Vec<SweepPoint>,
    pub most_contexts: Vec<MostContexts>,
    pub notes: Vec<String>,
}

impl SweepCell {
    pub fn of(r: &StrategyResult, target: f64) -> SweepCell {
        let p99 = r.ttft_s.map(|s| s.p99);
        SweepCell {
            strategy: r.strategy,
            ttft_p99_s: p99,
            switch_mean_s: r.switch_s.map(|s| s.mean),
            calls_run: r.calls_run,
            stopped_early: r.stopped_early,
            met: !r.stopped_early && p99.is_some_and(|p| p <= target),
        }
    }
}

/// Baseline ÷ ours for each baseline on the main run.
pub fn speedups(results: &[StrategyResult]) -> (Vec<Speedup>, Option<bool>) {
    let Some(ours) = results.iter().find(|r| r.strategy == Strategy::Ours) else {
        return (Vec::new(), None);
    };
    let ratio = |b: Option<Summary>, o: Option<Summary>, f: fn(&Summary) -> f64| match (b, o) {
        (Some(b), Some(o)) if f(&o) > 0.0 => Some(f(&b) / f(&o)),
        _ => None,
    };
    let mut fastest = true;
    let mut out = Vec::new();
    for b in results.iter().filter(|r| r.strategy != Strategy::Ours) {
        let s = Speedup {
            baseline: b.strategy,
            switch_mean: ratio(b.switch_s, ours.switch_s, |s| s.mean),
            switch_p99: ratio(b.switch_s, ours.switch_s, |s| s.p99),
            ttft_mean: ratio(b.ttft_s, ours.ttft_s, |s| s.mean),
            ttft_p99: ratio(b.ttft_s, ours.ttft_s, |s| s.p99),
        };
        for v in [s.switch_mean, s.switch_p99, s.ttft_mean, s.ttft_p99] {
            if v.is_some_and(|v| v < 1.0) {
                fastest = false;
            }
        }
        out.push(s);
    }
    let any = !out.is_empty();
    (out, any.then_some(fastest))
}

/// The most contexts each strategy served within the target, over the sweep.
pub fn most_contexts(sweep: &[SweepPoint], strategies: &[Strategy]) -> Vec<MostContexts> {
    if sweep.is_empty() {
        return Vec::new();
    }
    strategies
        .iter()
        .map(|&k| MostContexts {
            strategy: k,
            // A capacity claim must hold below it too: the largest count up to which every
            // point tried met the target (a noisy miss at a smaller count caps it there).
            contexts: {
                let mut points: Vec<&SweepPoint> = sweep.iter().collect();
                points.sort_by_key(|p| p.contexts);
                points
                    .iter()
                    .take_while(|p| p.cells.iter().any(|c| c.strategy == k && c.met))
                    .map(|p| p.contexts)
                    .last()
            },
        })
        .collect()
}

fn ms(v: Option<f64>) -> String {
    v.map_or("—".into(), |s| format!("{:.1}", s * 1e3))
}

fn times(v: Option<f64>) -> String {
    v.map_or("—".into(), |x| format!("{x:.1}×"))
}

impl ContextsReport {
    /// The report as Markdown; `plot` names the SVG beside it, if one was written.
    pub fn markdown(&self, plot: Option<&str>) -> String {
        use std::fmt::Write as _;
        let mut o = String::new();
        let t = &self.settings.trace;
        let _ = writeln!(
            o,
            "# bench contexts: {} on {}\n",
            self.model.name, self.device.kind
        );
        let _ = writeln!(
            o,
            "{} contexts, {} resident on the device ({} positions each{}), {} calls at {} calls/s \
             (Poisson), sticky {}, seed {}; history {} tokens, user turns {}–{}, answers {}–{}; \
             DRAM budget {} per strategy; ours compresses at {}; KV {} ({} bytes/token); tokens: {}.\n",
            t.contexts,
            self.settings.resident,
            self.settings.ctx_size,
            self.device.gpu_mem.map_or(String::new(), |g| format!(
                ", --gpu-mem {}",
                crate::plan::human_bytes(g)
            )),
            t.calls,
            t.rate_per_s,
            t.sticky,
            t.seed,
            t.history_tokens,
            t.user_tokens.0,
            t.user_tokens.1,
            t.answer_tokens.0,
            t.answer_tokens.1,
            crate::plan::human_bytes(self.settings.dram_budget),
            self.settings.compression,
            self.model.kv_type,
            self.model.kv_bytes_per_token,
            self.settings.tokens,
        );
        let _ = writeln!(
            o,
            "| strategy | switches | ctx tokens at switch (min / mean) | switch mean ms | switch p99 ms | out mean ms | in mean ms | TTFT mean ms | TTFT p99 ms | after-call mean ms | ours faster (switch mean / p99) | most contexts ≤ {:.2} s p99 TTFT |",
            self.settings.ttft_target_s
        );
        let _ = writeln!(
            o,
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        );
        for r in &self.strategies {
            let sp = self.speedups.iter().find(|s| s.baseline == r.strategy);
            let most = self
                .most_contexts
                .iter()
                .find(|m| m.strategy == r.strategy)
                .map_or("—".to_string(), |m| {
                    m.contexts.map_or("none".into(), |c| c.to_string())
                });
            let _ = writeln!(
                o,
                "| {} | {} | {} / {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                r.strategy.name(),
                r.switches,
                r.min_switch_context_tokens
                    .map_or("—".into(), |v| v.to_string()),
                r.mean_switch_context_tokens
                    .map_or("—".into(), |v| format!("{v:.0}")),
                ms(r.switch_s.map(|s| s.mean)),
                ms(r.switch_s.map(|s| s.p99)),
                ms(r.switch_out_s.map(|s| s.mean)),
                ms(r.switch_in_s.map(|s| s.mean)),
                ms(r.ttft_s.map(|s| s.mean)),
                ms(r.ttft_s.map(|s| s.p99)),
                ms(Some(r.after_s_mean)),
                sp.map_or("—".into(), |s| format!(
                    "{} / {}",
                    times(s.switch_mean),
                    times(s.switch_p99)
                )),
                most,
            );
        }
        let _ = writeln!(o);
        for r in &self.strategies {
            let st = &r.store;
            let _ = write!(
                o,
                "- `{}`: {}. Restores ({}s): {} from DRAM, {} from disk, {} recomputed; {} DRAM evictions; {} in DRAM at the end; {} on disk.",
                r.strategy.name(),
                r.strategy.describe(),
                st.unit,
                st.from_dram,
                st.from_disk,
                st.recomputed,
                st.dram_evictions,
                crate::plan::human_bytes(st.dram_bytes),
                crate::plan::human_bytes(st.disk_bytes),
            );
            if let Some(c) = &r.check {
                let _ = write!(
                    o,
                    " Check against a never-swapped run: greedy token equal on {}/{} calls, max |Δlogit| {:.3e}{}.",
                    c.top1_agree,
                    c.calls,
                    c.max_abs_logit_diff,
                    if c.exact { " (bit-exact)" } else { "" }
                );
            }
            let _ = writeln!(o);
        }
        if !self.sweep.is_empty() {
            let _ = writeln!(
                o,
                "\n## Contexts served within the target (p99 TTFT ≤ {:.2} s)\n",
                self.settings.ttft_target_s
            );
            let names: Vec<&str> = self.strategies.iter().map(|r| r.strategy.name()).collect();
            let _ = writeln!(o, "| contexts | {} |", names.join(" | "));
            let _ = writeln!(o, "|---:|{}", "---:|".repeat(names.len()));
            for p in &self.sweep {
                let cells: Vec<String> = self
                    .strategies
                    .iter()
                    .map(|r| {
                        p.cells.iter().find(|c| c.strategy == r.strategy).map_or(
                            "—".into(),
                            |c| {
                                format!(
                                    "{} {}{}",
                                    if c.met { "✓" } else { "✗" },
                                    ms(c.ttft_p99_s),
                                    if c.stopped_early {
                                        format!(" (stopped after {} calls)", c.calls_run)
                                    } else {
                                        String::new()
                                    }
                                )
                            },
                        )
                    })
                    .collect();
                let _ = writeln!(o, "| {} | {} |", p.contexts, cells.join(" | "));
            }
            let _ = writeln!(o, "\n(p99 TTFT in ms.)");
        }
        if let Some(p) = plot {
            let _ = writeln!(o, "\n![p99 TTFT by number of contexts]({p})");
        }
        let _ = writeln!(o, "\n## Notes\n");
        for n in &self.notes {
            let _ = writeln!(o, "- {n}");
        }
        o
    }
}

/// How to read the figures (written into every report).
pub fn notes() -> Vec<String> {
    vec![
        "Switch = taking a slot from the context holding it (out) + bringing the called context's KV in (in): wall clock of the real work on this engine.".into(),
        "The queue is computed from the measured service times: one engine thread serves calls in arrival order, as serve's does. TTFT = wait + switch + prefill of the user turn.".into(),
        "The user turn's prefill and the answer are the same work for every strategy: they are timed once per call, in a run that never switches (the check's reference run), and every strategy's queue and TTFT use those times. TTFTs then differ only by each strategy's own work (switch, after-call) and the waits it causes, not by the noise of timing the shared work once per strategy; each strategy's own timings of it are in the JSON (prefill_s, answer_s beside shared_prefill_s, shared_answer_s).".into(),
        "Answers are the trace's tokens evaluated in one forward pass (not sampled token by token), the same for every strategy; this shortens the busy time the queue sees.".into(),
        "Ours writes a call's new chunks ahead of time, when the engine falls idle after the call (no call waiting), as serve does: that time is in 'after-call' and in the queue's busy time, not in the switch. While calls wait the write waits too; a context taken off the device before it was written writes at eviction, in 'out'.".into(),
        "The chunked baselines are KvManager swapping out at eviction: every changed chunk is written to DRAM and (atomically, fsync'd) to disk on the critical path; they never choose to recompute.".into(),
        "Disk reads right after writes are likely served by the page cache.".into(),
        "p99 is by nearest rank: with fewer than 100 values it is the largest.".into(),
    ]
}

// ------------------------------------------------------------------------------ the whole run

/// What to run: the main trace (every strategy, full), the sweep's traces (each strategy
/// stopped at its first call over the target), and the check.
pub struct Job {
    pub main: Trace,
    pub sweep: Vec<Trace>,
    pub strategies: Vec<Strategy>,
    /// Compare each call's logits with a run that never swaps (main trace only).
    pub check: bool,
    pub ttft_target_s: f64,
}

impl Job {
    /// Positions a slot needs: the longest context of any trace.
    pub fn ctx_size(&self) -> usize {
        std::iter::once(&self.main)
            .chain(&self.sweep)
            .map(Trace::max_context_tokens)
            .max()
            .unwrap_or(1)
    }
}

pub struct Outcome {
    pub strategies: Vec<StrategyResult>,
    pub sweep: Vec<SweepPoint>,
    pub costs: CostModel,
}

/// Run `job` on `e` with `set.resident` slots of `ctx` positions. Ours' cost model is measured
/// here (on this engine, with its swap directory) unless ours is not run.
pub fn run<B: Backend>(
    e: &Engine<B>,
    ctx: usize,
    set: &RunSettings,
    job: &Job,
    progress: &dyn Fn(&str),
) -> Result<Outcome> {
    let mut set = set.clone();
    std::fs::create_dir_all(&set.kv_dir).map_err(io_err(&set.kv_dir))?;
    if job.strategies.contains(&Strategy::Ours) {
        let probe = set.kv_dir.join("cost-probe");
        set.costs = kv::measure_costs(e, Some(&probe))?;
        std::fs::remove_dir_all(&probe).ok();
        progress(&format!("ours' cost model: {:?}", set.costs));
    }
    let mut sessions = Vec::with_capacity(set.resident);
    for _ in 0..set.resident.max(1) {
        let mut s = e.new_session(ctx)?;
        e.enable_probe(&mut s)?;
        sessions.push(s);
    }
    let mut hist = Histories::new();
    progress("the run without switches (shared work's times; the check's reference)");
    let shared = no_switch_run(
        e,
        &mut sessions[0],
        &job.main,
        &mut hist,
        job.check,
        progress,
    )?;
    let mut main = Vec::new();
    for &k in &job.strategies {
        main.push(run_strategy(
            e,
            &mut sessions,
            &job.main,
            &mut hist,
            k,
            &set,
            &shared,
            None,
            progress,
        )?);
    }
    let mut sweep = Vec::new();
    if !job.sweep.is_empty() {
        sweep.push(SweepPoint {
            contexts: job.main.cfg.contexts,
            cells: main
                .iter()
                .map(|r| SweepCell::of(r, job.ttft_target_s))
                .collect(),
        });
    }
    for t in job
        .sweep
        .iter()
        .filter(|t| t.cfg.contexts != job.main.cfg.contexts)
    {
        let shared = no_switch_run(e, &mut sessions[0], t, &mut hist, false, progress)?;
        let mut cells = Vec::new();
        for &k in &job.strategies {
            let r = run_strategy(
                e,
                &mut sessions,
                t,
                &mut hist,
                k,
                &set,
                &shared,
                Some(job.ttft_target_s),
                progress,
            )?;
            cells.push(SweepCell::of(&r, job.ttft_target_s));
        }
        sweep.push(SweepPoint {
            contexts: t.cfg.contexts,
            cells,
        });
    }
    sweep.sort_by_key(|p| p.contexts);
    Ok(Outcome {
        strategies: main,
        sweep,
        costs: set.costs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(contexts: usize) -> TraceConfig {
        TraceConfig {
            contexts,
            calls: 40,
            history_tokens: 50,
            user_tokens: (5, 9),
            answer_tokens: (2, 3),
            rate_per_s: 2.0,
            sticky: 0.0,
            seed: 7,
        }
    }

    #[test]
    fn traces_are_deterministic_and_histories_do_not_depend_on_the_count() {
        let src = TokenSource::Random { vocab: 100 };
        let a = Trace::generate(&cfg(4), &src);
        let b = Trace::generate(&cfg(4), &src);
        let c = Trace::generate(&cfg(9), &src);
        assert_eq!(a.histories, b.histories);
        assert_eq!(
            a.calls
                .iter()
                .map(|x| (x.context, x.user.clone()))
                .collect::<Vec<_>>(),
            b.calls
                .iter()
                .map(|x| (x.context, x.user.clone()))
                .collect::<Vec<_>>()
        );
        assert_eq!(a.histories[..], c.histories[..4]);
        let mut last = 0.0;
        for call in &a.calls {
            assert!(call.arrival_s > last && call.context < 4);
            assert!((5..=9).contains(&call.user.len()) && (2..=3).contains(&call.answer.len()));
            assert!(call.user.iter().all(|&t| (3..100).contains(&t)));
            last = call.arrival_s;
        }
    }

    #[test]
    fn a_sticky_chain_stays_and_a_random_one_switches() {
        let src = TokenSource::Random { vocab: 100 };
        let stays = |sticky: f64| {
            let t = Trace::generate(&TraceConfig { sticky, ..cfg(8) }, &src);
            t.calls
                .windows(2)
                .filter(|w| w[0].context == w[1].context)
                .count()
        };
        assert_eq!(stays(1.0), 39);
        assert!(stays(0.0) < 15, "{}", stays(0.0));
    }

    #[test]
    fn p99_is_the_nearest_rank() {
        let v: Vec<f64> = (1..=10).map(f64::from).collect();
        let s = Summary::of(&v).unwrap();
        assert_eq!(
            (s.n, s.mean, s.p50, s.p99, s.max),
            (10, 5.5, 5.0, 10.0, 10.0)
        );
        assert!(Summary::of(&[]).is_none());
    }

    #[test]
    fn most_contexts_needs_every_smaller_point_met() {
        let point = |contexts, met: [bool; 2]| SweepPoint {
            contexts,
            cells: [Strategy::Recompute, Strategy::Ours]
                .iter()
                .zip(met)
                .map(|(&strategy, met)| SweepCell {
                    strategy,
                    ttft_p99_s: Some(1.0),
                    switch_mean_s: None,
                    calls_run: 1,
                    stopped_early: false,
                    met,
                })
                .collect(),
        };
        let sweep = [
            point(8, [false, true]),
            point(2, [true, true]),
            point(4, [false, false]),
        ];
        let m = most_contexts(&sweep, &[Strategy::Recompute, Strategy::Ours]);
        assert_eq!(m[0].contexts, Some(2));
        assert_eq!(m[1].contexts, Some(2));
        assert!(most_contexts(&[], &[Strategy::Ours]).is_empty());
    }
}
