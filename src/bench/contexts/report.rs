//! The contexts benchmark's report: what each call and strategy measured ([`CallRecord`],
//! [`StrategyResult`], [`Summary`], the check), the sweep's cells, ours against each baseline
//! ([`speedups`]), the most contexts served within the target ([`most_contexts`]), the
//! `contexts.json` schema and its Markdown rendering. Pure data and text: runs nothing,
//! writes nothing.

use serde::Serialize;

use super::strategies::{MoverStats, Strategy};
use super::trace::TraceConfig;

/// `schema` of contexts.json; bumped when a field changes meaning.
pub const SCHEMA: &str = "gpu-offload/bench-contexts/1";

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
    /// queue and TTFT use (see [`NoSwitch`](super::replay::NoSwitch)).
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

#[cfg(test)]
mod tests {
    use super::*;

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
