//! A per-phase trace of forward steps: for each step, layer and phase (attention, the FFN
//! input's landing on the host, deciding the active set, the CPU's neurons, gathering misses,
//! host→device copies, scatter, the device's neurons, the merge, host waits, and `other` for
//! the rest) the host's wall time and the bytes moved while the phase ran. The phases of a step
//! tile it: each span ends where the next begins, so they add up to the step's time.
//!
//! One recorder ([`StepTrace`]) per engine, off unless given ([`super::Engine::set_trace`]).
//! During a traced step it is the thread's active trace, and the engine and the tiers report
//! into it through [`span`], [`set_layer`] and [`add_cpu_bytes`], which do nothing when no step is
//! traced (one thread-local check). Host↔device bytes are the ledger's own counts, read at
//! every span's ends (exact where copies are issued by the stepping thread, as on the budgeted
//! device); the bytes the CPU reads for neurons are reported by the code that reads them.

use std::cell::RefCell;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::backend::clock::DeviceClock;
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
    /// Deciding the active neurons (the predictor, or the deciding rows read on the host; the
    /// CPU's float cold neurons decide within their own pass, [`Phase::CpuNeurons`]).
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

/// Bytes moved during a span: host→device and device→host, and read by the device's kernels
/// of the weights and KV caches in its memory (the ledger's counts), and read by the CPU for
/// neurons (gathered misses, deciding rows, cold neurons).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SpanBytes {
    pub h2d: u64,
    pub d2h: u64,
    pub device: u64,
    pub cpu: u64,
}

impl SpanBytes {
    pub fn add(&mut self, o: &SpanBytes) {
        self.h2d += o.h2d;
        self.d2h += o.d2h;
        self.device += o.device;
        self.cpu += o.cpu;
    }
}

/// What the device's streams did during a span, where the backend has a clock
/// ([`crate::backend::Backend::device_clock`]): how far its compute and copy streams advanced
/// between the span's ends, and where the compute stream's part begins (from the trace's
/// origin, the device's time aligned with the host's at the step's first mark).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct DeviceTime {
    pub at: Duration,
    pub compute: Duration,
    pub copy: Duration,
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
    pub device: Option<DeviceTime>,
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
    device: u64,
    cpu: u64,
    /// The device clock's mark at the start, where the step has a clock.
    mark: Option<usize>,
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
    /// The step's device clock, where it has one, and when its first mark was made.
    clock: Option<(Arc<dyn DeviceClock>, Instant)>,
    /// Spans whose ends the clock marked: (span, start mark, end mark).
    marked: Vec<(usize, usize, usize)>,
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

    /// The ledger's host→device, device→host and device-read bytes so far.
    fn counts(&self) -> (u64, u64, u64) {
        self.ledger.as_ref().map_or((0, 0, 0), |l| {
            let s = l.snapshot();
            (s.h2d_bytes, s.d2h_bytes, s.device_read_bytes)
        })
    }

    /// Close the open span at `now` and open `phase` there.
    fn switch(&self, s: &mut State, phase: Option<Phase>, now: Instant) {
        let (h2d, d2h, device) = self.counts();
        // A clock that fails gives no device times, never a failed step.
        let mark = s.clock.as_ref().and_then(|(c, _)| c.mark().ok());
        if let (Some(o), Some((step, _, _))) = (s.open.take(), s.step) {
            let bytes = SpanBytes {
                h2d: h2d - o.h2d,
                d2h: d2h - o.d2h,
                device: device - o.device,
                cpu: s.cpu - o.cpu,
            };
            let dur = now.saturating_duration_since(o.start);
            if dur > Duration::ZERO || bytes != SpanBytes::default() {
                if let (Some(a), Some(b)) = (o.mark, mark) {
                    s.marked.push((s.log.spans.len(), a, b));
                }
                s.log.spans.push(Span {
                    step,
                    phase: o.phase,
                    layer: s.layer,
                    start: o.start.saturating_duration_since(self.origin),
                    dur,
                    bytes,
                    device: None,
                });
            }
        }
        s.open = phase.map(|phase| Open {
            phase,
            start: now,
            h2d,
            d2h,
            device,
            cpu: s.cpu,
            mark,
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
        self.device_times(s);
        if let Some((step, rows, start)) = s.step.take() {
            s.log.steps.push(StepSpan {
                step,
                rows,
                start: start.saturating_duration_since(self.origin),
                dur: now.saturating_duration_since(start),
            });
        }
    }

    /// The marked spans' device times, once the device has passed the step's marks.
    fn device_times(&self, s: &mut State) {
        let marked = std::mem::take(&mut s.marked);
        let Some((clock, first)) = s.clock.take() else {
            return;
        };
        let Ok(times) = clock.take() else {
            return;
        };
        let secs = |x: f64| Duration::from_secs_f64(x.max(0.0));
        let origin = first.saturating_duration_since(self.origin);
        for (i, a, b) in marked {
            if let (Some(sp), Some(ta), Some(tb)) =
                (s.log.spans.get_mut(i), times.get(a), times.get(b))
            {
                sp.device = Some(DeviceTime {
                    at: origin + secs(ta[0]),
                    compute: secs(tb[0] - ta[0]),
                    copy: secs(tb[1] - ta[1]),
                });
            }
        }
    }

    /// Time the device's streams in this step from now on with `clock`.
    fn set_clock(&self, clock: Arc<dyn DeviceClock>) {
        let mut s = self.lock();
        let s = &mut *s;
        if s.step.is_none() || s.clock.is_some() {
            return;
        }
        let phase = s.open.as_ref().map_or(Phase::Other, |o| o.phase);
        let now = Instant::now();
        s.clock = Some((clock, now));
        s.marked.clear();
        self.switch(s, Some(phase), now);
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

/// Time the device's streams in the thread's traced step with the clock `clock` makes (called
/// only when a step is traced; nothing where the backend has no clock). Not in a recorded step:
/// its ops are captured, not run.
pub fn device_clock(clock: impl FnOnce() -> Option<Arc<dyn DeviceClock>>) {
    ACTIVE.with_borrow(|a| {
        if let Some(t) = a
            && let Some(c) = clock()
        {
            t.set_clock(c);
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
        if let Some(d) = &sp.device {
            let [c, k] = e.device.get_or_insert([0.0; 2]);
            *c += d.compute.as_secs_f64();
            *k += d.copy.as_secs_f64();
        }
    }
    t
}

/// One phase's sums.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct PhaseSum {
    pub seconds: f64,
    pub bytes: SpanBytes,
    pub spans: usize,
    /// Seconds the device's compute and copy streams advanced during the phase (backends with
    /// a clock).
    pub device: Option<[f64; 2]>,
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
            ledger.count_device_read(11);
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
        let b = att.bytes;
        assert_eq!((b.h2d, b.d2h, b.device, b.cpu), (0, 7, 11, 5));
        assert_eq!(h2d.bytes.device, 0);
        assert!(att.seconds >= 0.002);
        assert!(
            log.spans
                .iter()
                .all(|s| s.phase == Phase::Other || s.layer == Some(0))
        );
    }

    /// A clock whose streams advance 1 ms (compute) and 2 ms (copies) from one mark to the next.
    struct Ticks(Mutex<usize>);

    impl DeviceClock for Ticks {
        fn mark(&self) -> crate::backend::Result<usize> {
            let mut n = self.0.lock().unwrap();
            *n += 1;
            Ok(*n - 1)
        }
        fn take(&self) -> crate::backend::Result<Vec<[f64; 2]>> {
            let n = std::mem::take(&mut *self.0.lock().unwrap());
            Ok((0..n).map(|i| [i as f64 * 1e-3, i as f64 * 2e-3]).collect())
        }
    }

    #[test]
    fn a_device_clock_times_each_span_between_its_marks() {
        let t = StepTrace::new(None);
        let _on = t.activate();
        t.begin_step(1, Instant::now());
        device_clock(|| Some(Arc::new(Ticks(Mutex::new(0)))));
        for p in [Phase::Attention, Phase::DeviceNeurons] {
            let _s = span(p);
            std::thread::sleep(Duration::from_micros(50));
        }
        t.end_step();
        let log = t.log();
        let timed: Vec<&Span> = log.spans.iter().filter(|s| s.device.is_some()).collect();
        assert!(timed.len() >= 2, "{log:?}");
        for s in timed {
            let d = s.device.unwrap();
            // Every span is between consecutive marks here.
            assert_eq!(d.compute, Duration::from_millis(1), "{s:?}");
            assert_eq!(d.copy, Duration::from_millis(2), "{s:?}");
        }
        let all = totals(&log, |_| true);
        assert!(all.phases[&Phase::Attention].device.is_some());
    }

    #[test]
    fn nothing_is_recorded_without_an_active_trace() {
        assert!(span(Phase::Head).is_none());
        set_layer(Some(3));
        add_cpu_bytes(9);
    }
}
