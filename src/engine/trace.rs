//! A per-phase trace of forward steps: for each step, layer and phase (attention, the FFN
//! input's landing on the host, deciding the active set, the CPU's neurons, gathering misses,
//! host→device copies, scatter, the device's neurons, the merge, host waits, and `other` for
//! the rest) the host's wall time and the bytes moved while the phase ran. The phases of a step
//! tile it: each span ends where the next begins, so they add up to the step's time.
//!
//! One recorder ([`StepTrace`]) per engine, off unless given ([`super::Engine::set_trace`]).
//! During a traced step it is the thread's active trace, and the engine and the tiers report
//! into it through [`span`], [`set_layer`] and [`add_bytes`], which do nothing when no step is
//! traced (one thread-local check). Host↔device bytes are the ledger's own counts, read at
//! every span's ends (exact where copies are issued by the stepping thread, as on the budgeted
//! device); the bytes the CPU reads for neurons are reported by the code that reads them.

use std::cell::RefCell;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::footprint::Ledger;

/// A phase of a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Token embeddings into the step's rows.
    Embed,
    /// A layer's attention block: norm, q/k/v, RoPE, the KV store, attention, the output
    /// projection and the FFN's norm.
    Attention,
    /// Queuing the FFN input's device→host copy (hybrid, split, cache units).
    Landing,
    /// Deciding the active neurons (the predictor, or the deciding rows read on the host).
    Decide,
    /// The CPU's neurons: hybrid's cold ones, the split's CPU rows.
    CpuNeurons,
    /// Gathering a cache unit's misses into the staging buffer (and the slot map's update).
    Gather,
    /// Host→device copies: streamed layers, unit misses, partial sums.
    H2d,
    /// Scattering copied neurons into their unit slots.
    Scatter,
    /// The FFN's neurons on the device.
    DeviceNeurons,
    /// Adding the CPU's partial sum to the device's.
    Merge,
    /// The host blocked on the device or a preloader (an event, a landing, a layer's DRAM copy).
    HostWait,
    /// The final norm, the output matrix and the logits' copy back.
    Head,
    /// Whatever no named phase covers (buffers, the weight source's bookkeeping, the residual).
    Other,
}

impl Phase {
    pub const ALL: [Phase; 13] = [
        Phase::Embed,
        Phase::Attention,
        Phase::Landing,
        Phase::Decide,
        Phase::CpuNeurons,
        Phase::Gather,
        Phase::H2d,
        Phase::Scatter,
        Phase::DeviceNeurons,
        Phase::Merge,
        Phase::HostWait,
        Phase::Head,
        Phase::Other,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Phase::Embed => "embed",
            Phase::Attention => "attention",
            Phase::Landing => "landing",
            Phase::Decide => "decide",
            Phase::CpuNeurons => "cpu_neurons",
            Phase::Gather => "gather",
            Phase::H2d => "h2d",
            Phase::Scatter => "scatter",
            Phase::DeviceNeurons => "device_neurons",
            Phase::Merge => "merge",
            Phase::HostWait => "host_wait",
            Phase::Head => "head",
            Phase::Other => "other",
        }
    }
}

/// Bytes moved during a span: host→device and device→host (the ledger's counts), and read by
/// the CPU for neurons (gathered misses, deciding rows, cold neurons).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SpanBytes {
    pub h2d: u64,
    pub d2h: u64,
    pub cpu: u64,
}

impl SpanBytes {
    pub fn add(&mut self, o: &SpanBytes) {
        self.h2d += o.h2d;
        self.d2h += o.d2h;
        self.cpu += o.cpu;
    }
}

/// One span of a step: a phase of a layer (or of none: the embedding, the head) from `start`
/// for `dur`, both from the trace's origin.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Span {
    pub step: u32,
    pub phase: Phase,
    pub layer: Option<u32>,
    pub start: Duration,
    pub dur: Duration,
    pub bytes: SpanBytes,
}

/// One traced step: `rows` tokens from `start` for `dur`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StepSpan {
    pub step: u32,
    pub rows: u32,
    pub start: Duration,
    pub dur: Duration,
}

/// What a trace holds: steps and their spans, in order.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct TraceLog {
    pub steps: Vec<StepSpan>,
    pub spans: Vec<Span>,
}

/// The span open now.
struct Open {
    phase: Phase,
    start: Instant,
    h2d: u64,
    d2h: u64,
    cpu: u64,
}

#[derive(Default)]
struct State {
    log: TraceLog,
    open: Option<Open>,
    /// The phases to go back to as the spans inside them end.
    stack: Vec<Phase>,
    layer: Option<u32>,
    /// The step in progress: its index, rows and start.
    step: Option<(u32, u32, Instant)>,
    next_step: u32,
    /// CPU bytes reported so far (spans take differences, as of the ledger's counters).
    cpu: u64,
}

/// The recorder: steps and their phase spans, with the ledger whose counts give their bytes.
pub struct StepTrace {
    origin: Instant,
    ledger: Option<Arc<Ledger>>,
    state: Mutex<State>,
}

impl StepTrace {
    /// A recorder whose spans count the host↔device bytes of `ledger` (none: no such bytes).
    pub fn new(ledger: Option<Arc<Ledger>>) -> Arc<Self> {
        Arc::new(StepTrace {
            origin: Instant::now(),
            ledger,
            state: Mutex::new(State::default()),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Spans are plain numbers: a panic elsewhere cannot leave them half-written.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn copies(&self) -> (u64, u64) {
        self.ledger.as_ref().map_or((0, 0), |l| {
            let s = l.snapshot();
            (s.h2d_bytes, s.d2h_bytes)
        })
    }

    /// Close the open span at `now` and open `phase` there.
    fn switch(&self, s: &mut State, phase: Option<Phase>, now: Instant) {
        let (h2d, d2h) = self.copies();
        if let (Some(o), Some((step, _, _))) = (s.open.take(), s.step) {
            let bytes = SpanBytes {
                h2d: h2d - o.h2d,
                d2h: d2h - o.d2h,
                cpu: s.cpu - o.cpu,
            };
            let dur = now.saturating_duration_since(o.start);
            if dur > Duration::ZERO || bytes != SpanBytes::default() {
                s.log.spans.push(Span {
                    step,
                    phase: o.phase,
                    layer: s.layer,
                    start: o.start.saturating_duration_since(self.origin),
                    dur,
                    bytes,
                });
            }
        }
        s.open = phase.map(|phase| Open {
            phase,
            start: now,
            h2d,
            d2h,
            cpu: s.cpu,
        });
    }

    /// A step of `rows` rows began at `at`: its time is `other` until a phase begins.
    pub fn begin_step(&self, rows: usize, at: Instant) {
        let mut s = self.lock();
        let s = &mut *s;
        s.stack.clear();
        s.layer = None;
        s.step = Some((s.next_step, rows as u32, at));
        s.next_step += 1;
        self.switch(s, Some(Phase::Other), at);
    }

    /// The step in progress ended now.
    pub fn end_step(&self) {
        let now = Instant::now();
        let mut s = self.lock();
        let s = &mut *s;
        self.switch(s, None, now);
        s.stack.clear();
        s.layer = None;
        if let Some((step, rows, start)) = s.step.take() {
            s.log.steps.push(StepSpan {
                step,
                rows,
                start: start.saturating_duration_since(self.origin),
                dur: now.saturating_duration_since(start),
            });
        }
    }

    fn enter(self: &Arc<Self>, phase: Phase) -> SpanGuard {
        let mut s = self.lock();
        let s = &mut *s;
        let outer = s.open.as_ref().map_or(Phase::Other, |o| o.phase);
        s.stack.push(outer);
        self.switch(s, Some(phase), Instant::now());
        SpanGuard {
            trace: self.clone(),
        }
    }

    fn leave(&self) {
        let mut s = self.lock();
        let s = &mut *s;
        let outer = s.stack.pop().unwrap_or(Phase::Other);
        self.switch(s, Some(outer), Instant::now());
    }

    fn layer(&self, layer: Option<usize>) {
        let mut s = self.lock();
        let s = &mut *s;
        let phase = s.open.as_ref().map_or(Phase::Other, |o| o.phase);
        self.switch(s, Some(phase), Instant::now());
        s.layer = layer.map(|l| l as u32);
    }

    fn bytes(&self, cpu: u64) {
        self.lock().cpu += cpu;
    }

    /// Forget every step so far (a new measurement begins).
    pub fn clear(&self) {
        let mut s = self.lock();
        s.log = TraceLog::default();
    }

    /// The steps and spans so far.
    pub fn log(&self) -> TraceLog {
        self.lock().log.clone()
    }

    /// Make this the thread's active trace until the guard drops (the step's thread: a backend
    /// may run a step on its own pool's thread).
    pub fn activate(self: &Arc<Self>) -> Active {
        let before = ACTIVE.with_borrow_mut(|a| a.replace(self.clone()));
        Active { before }
    }
}

thread_local! {
    static ACTIVE: RefCell<Option<Arc<StepTrace>>> = const { RefCell::new(None) };
}

/// The thread's active trace while it lives (see [`StepTrace::activate`]).
pub struct Active {
    before: Option<Arc<StepTrace>>,
}

impl Drop for Active {
    fn drop(&mut self) {
        let before = self.before.take();
        ACTIVE.with_borrow_mut(|a| *a = before);
    }
}

/// A phase in progress: the phase it interrupted resumes when this drops.
pub struct SpanGuard {
    trace: Arc<StepTrace>,
}

impl Drop for SpanGuard {
    fn drop(&mut self) {
        self.trace.leave();
    }
}

/// `phase` begins now in the thread's traced step, until the guard drops (nothing when no step
/// is traced).
#[must_use = "the phase lasts as long as the guard"]
pub fn span(phase: Phase) -> Option<SpanGuard> {
    ACTIVE.with_borrow(|a| a.as_ref().map(|t| t.enter(phase)))
}

/// The spans from now on are of layer `layer` (none: of the step as a whole).
pub fn set_layer(layer: Option<usize>) {
    ACTIVE.with_borrow(|a| {
        if let Some(t) = a {
            t.layer(layer);
        }
    });
}

/// The CPU read `bytes` for neurons in the phase open now.
pub fn add_cpu_bytes(bytes: u64) {
    ACTIVE.with_borrow(|a| {
        if let Some(t) = a {
            t.bytes(bytes);
        }
    });
}

/// Per phase, the seconds and bytes of the steps `steps` of a log picks (by step).
pub fn totals(log: &TraceLog, pick: impl Fn(&StepSpan) -> bool) -> PhaseTotals {
    let picked: std::collections::BTreeSet<u32> = log
        .steps
        .iter()
        .filter(|s| pick(s))
        .map(|s| s.step)
        .collect();
    let mut t = PhaseTotals {
        steps: picked.len(),
        step_seconds: log
            .steps
            .iter()
            .filter(|s| picked.contains(&s.step))
            .map(|s| s.dur.as_secs_f64())
            .sum(),
        ..Default::default()
    };
    for sp in log.spans.iter().filter(|s| picked.contains(&s.step)) {
        let e = t.phases.entry(sp.phase).or_default();
        e.seconds += sp.dur.as_secs_f64();
        e.bytes.add(&sp.bytes);
        e.spans += 1;
    }
    t
}

/// One phase's sums.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct PhaseSum {
    pub seconds: f64,
    pub bytes: SpanBytes,
    pub spans: usize,
}

/// Sums per phase over some steps, and those steps' own time.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct PhaseTotals {
    pub steps: usize,
    pub step_seconds: f64,
    pub phases: std::collections::BTreeMap<Phase, PhaseSum>,
}

impl PhaseTotals {
    /// Seconds of all phases together.
    pub fn phase_seconds(&self) -> f64 {
        self.phases.values().map(|p| p.seconds).sum()
    }

    /// Bytes of all phases together.
    pub fn bytes(&self) -> SpanBytes {
        let mut b = SpanBytes::default();
        self.phases.values().for_each(|p| b.add(&p.bytes));
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_tile_the_step_and_nest() {
        let ledger = Ledger::new(None, None);
        let t = StepTrace::new(Some(ledger.clone()));
        let _on = t.activate();
        let t0 = Instant::now();
        t.begin_step(1, t0);
        set_layer(Some(0));
        {
            let _a = span(Phase::Attention);
            std::thread::sleep(Duration::from_millis(2));
            {
                let _h = span(Phase::H2d);
                ledger.count_h2d(100);
            }
            ledger.count_d2h(7);
            add_cpu_bytes(5);
        }
        set_layer(None);
        t.end_step();
        let log = t.log();
        assert_eq!(log.steps.len(), 1);
        let sum: Duration = log.spans.iter().map(|s| s.dur).sum();
        assert_eq!(sum, log.steps[0].dur, "the spans tile the step");
        let all = totals(&log, |_| true);
        let h2d = all.phases[&Phase::H2d];
        assert_eq!((h2d.bytes.h2d, h2d.bytes.d2h), (100, 0));
        let att = all.phases[&Phase::Attention];
        assert_eq!((att.bytes.h2d, att.bytes.d2h, att.bytes.cpu), (0, 7, 5));
        assert!(att.seconds >= 0.002);
        assert!(
            log.spans
                .iter()
                .all(|s| s.phase == Phase::Other || s.layer == Some(0))
        );
    }

    #[test]
    fn nothing_is_recorded_without_an_active_trace() {
        assert!(span(Phase::Head).is_none());
        set_layer(Some(3));
        add_cpu_bytes(9);
    }
}
