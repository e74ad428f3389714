//! Replaying a trace with each strategy: the histories prefilled once and shared, the run
//! without switches whose times every strategy's queue uses ([`NoSwitch`]), the queue itself
//! (one engine thread serving calls in arrival order over `resident` slots, [`run_strategy`]),
//! and the whole job: the main trace, the sweep and the check ([`run`]).

use std::path::Path;
use std::time::Instant;

use super::error::{ContextsError, Result, io_err};
use super::report::{CallRecord, CheckResult, StrategyResult, Summary, SweepCell, SweepPoint};
use super::strategies::{Mover, MoverStats, RunSettings, Strategy, mover};
use super::trace::Trace;
use crate::backend::Backend;
use crate::engine::sampler::argmax;
use crate::engine::{Engine, Logits, Session};
use crate::footprint::PROBE_QUERIES;
use crate::kv::{self, CostModel};

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
    let mut slots = Slots::new(sessions.len());
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
        let slot = slots.pick(c, k);
        let s = &mut sessions[slot];
        let context_tokens = tokens[c].len();
        let switched = slots.holder[slot] != Some(c);
        let (out_s, in_s) = if switched {
            slots.switch(m.as_mut(), e, s, slot, c, &tokens)?
        } else {
            (0.0, 0.0)
        };
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
            slots.unwritten[slot] = true;
            let idle = trace
                .calls
                .get(k + 1)
                .is_none_or(|next| next.arrival_s > done);
            if idle {
                after_s = slots.write_ahead(m.as_mut(), e, sessions, &tokens)?;
            }
        }
        if let (Some(chk), Some(r)) = (check.as_mut(), reference.and_then(|r| r.get(k))) {
            compare_logits(chk, r, &logits);
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
    Ok(strategy_result(
        kind,
        n,
        calls,
        stopped_early,
        m.stats(),
        check,
    ))
}

/// The device's slots as the queue sees them: the context each holds, whether it changed since
/// it was last written (strategies that write ahead), and when each was last used.
struct Slots {
    holder: Vec<Option<usize>>,
    /// Slots whose context changed since it was last written (strategies that write ahead).
    unwritten: Vec<bool>,
    last_use: Vec<u64>,
}

impl Slots {
    fn new(slots: usize) -> Self {
        Slots {
            holder: vec![None; slots],
            unwritten: vec![false; slots],
            last_use: vec![0u64; slots],
        }
    }

    /// The slot for call `k` on context `c`, marked used by it.
    fn pick(&mut self, c: usize, k: usize) -> usize {
        let slots = self.holder.len();
        // The slot holding the context, else an empty one, else the least recently used.
        let slot = self
            .holder
            .iter()
            .position(|h| *h == Some(c))
            .or_else(|| self.holder.iter().position(Option::is_none))
            .unwrap_or_else(|| {
                (0..slots)
                    .min_by_key(|&i| self.last_use[i])
                    .unwrap_or_default()
            });
        self.last_use[slot] = k as u64 + 1;
        slot
    }

    /// Take `slot` from the context holding it and bring context `c` in: the seconds of each.
    fn switch<B: Backend>(
        &mut self,
        m: &mut dyn Mover<B>,
        e: &Engine<B>,
        s: &mut Session<B>,
        slot: usize,
        c: usize,
        tokens: &[Vec<u32>],
    ) -> Result<(f64, f64)> {
        let t0 = Instant::now();
        if let Some(v) = self.holder[slot].take() {
            m.evict(e, s, v, &tokens[v], !self.unwritten[slot])?;
            self.unwritten[slot] = false;
        }
        let out_s = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        m.restore(e, s, c, &tokens[c])?;
        let in_s = t1.elapsed().as_secs_f64();
        self.holder[slot] = Some(c);
        Ok((out_s, in_s))
    }

    /// The engine fell idle: write every changed slot's context ahead of its eviction. The
    /// seconds it took.
    fn write_ahead<B: Backend>(
        &mut self,
        m: &mut dyn Mover<B>,
        e: &Engine<B>,
        sessions: &mut [Session<B>],
        tokens: &[Vec<u32>],
    ) -> Result<f64> {
        let t4 = Instant::now();
        // One slot per session.
        for (j, s) in sessions.iter_mut().enumerate() {
            if let (true, Some(h)) = (self.unwritten[j], self.holder[j]) {
                m.after_call(e, s, h, &tokens[h])?;
            }
            self.unwritten[j] = false;
        }
        Ok(t4.elapsed().as_secs_f64())
    }
}

/// Count a call's logits against the never-swapped run's into `chk`.
fn compare_logits(chk: &mut CheckResult, r: &[f32], logits: &[f32]) {
    chk.calls += 1;
    if argmax(r) == argmax(logits) {
        chk.top1_agree += 1;
    }
    for (a, b) in r.iter().zip(logits) {
        let d = (a - b).abs();
        if a.to_bits() != b.to_bits() {
            chk.exact = false;
        }
        if d > chk.max_abs_logit_diff || d.is_nan() {
            chk.max_abs_logit_diff = if d.is_nan() { f32::INFINITY } else { d };
        }
    }
}

/// A strategy's calls summed up: switch latencies over the calls that switched, TTFT over all.
fn strategy_result(
    kind: Strategy,
    n: usize,
    calls: Vec<CallRecord>,
    stopped_early: bool,
    store: MoverStats,
    check: Option<CheckResult>,
) -> StrategyResult {
    let sw: Vec<&CallRecord> = calls.iter().filter(|r| r.switched).collect();
    let pick = |f: &dyn Fn(&CallRecord) -> f64, only_switches: bool| -> Option<Summary> {
        let v: Vec<f64> = if only_switches {
            sw.iter().map(|r| f(r)).collect()
        } else {
            calls.iter().map(f).collect()
        };
        Summary::of(&v)
    };
    StrategyResult {
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
        store,
        check,
        calls,
    }
}

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
        set.costs = kv::measure_costs(e, Some(&probe), None)?;
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

    #[test]
    fn a_call_takes_its_context_s_slot_else_an_empty_one_else_the_least_recently_used() {
        let mut slots = Slots::new(2);
        assert_eq!(slots.pick(7, 0), 0);
        slots.holder[0] = Some(7);
        assert_eq!(slots.pick(8, 1), 1, "the empty slot");
        slots.holder[1] = Some(8);
        assert_eq!(slots.pick(7, 2), 0, "the slot holding the context");
        assert_eq!(slots.pick(9, 3), 1, "the least recently used");
        assert_eq!(slots.last_use, [3, 4]);
    }

    #[test]
    fn the_check_counts_agreement_and_calls_a_nan_difference_infinite() {
        let mut chk = CheckResult {
            calls: 0,
            top1_agree: 0,
            max_abs_logit_diff: 0.0,
            exact: true,
        };
        compare_logits(&mut chk, &[0.0, 1.0], &[0.0, 1.0]);
        assert!(chk.exact && chk.top1_agree == 1 && chk.max_abs_logit_diff == 0.0);
        compare_logits(&mut chk, &[0.0, 1.0], &[2.0, 1.5]);
        assert_eq!((chk.calls, chk.top1_agree, chk.exact), (2, 1, false));
        assert_eq!(chk.max_abs_logit_diff, 2.0);
        compare_logits(&mut chk, &[0.0, 1.0], &[0.0, f32::NAN]);
        assert_eq!(chk.max_abs_logit_diff, f32::INFINITY);
    }
}
