//! Where a decode step's time goes, from the engine's per-phase trace
//! ([`crate::engine::trace`]): the trace as Chrome trace-event JSON (`bench decode --trace
//! FILE`, viewable in Perfetto or chrome://tracing), and per decoded token each phase's seconds
//! and bytes beside the bound those bytes set (`--json`): host↔device bytes ÷ the PCIe rate,
//! the bytes the CPU reads ÷ the DRAM rate.

use std::path::Path;

use anyhow::{Context, Result};
use serde_json::{Value, json};

use crate::bench::bounds::Rates;
use crate::engine::trace::{Phase, PhaseTotals, Span, StepSpan, TraceLog, totals};
use crate::footprint::LedgerSnapshot;

/// Microseconds, as trace events count time.
fn us(d: std::time::Duration) -> f64 {
    d.as_nanos() as f64 / 1e3
}

fn step_event(s: &StepSpan) -> Value {
    json!({"name": "step", "cat": "step", "ph": "X", "pid": 1, "tid": 1,
           "ts": us(s.start), "dur": us(s.dur), "args": {"step": s.step, "rows": s.rows}})
}

fn span_event(s: &Span) -> Value {
    json!({"name": s.phase.name(), "cat": "phase", "ph": "X", "pid": 1, "tid": 1,
           "ts": us(s.start), "dur": us(s.dur),
           "args": {"step": s.step, "layer": s.layer, "h2d_bytes": s.bytes.h2d,
                    "d2h_bytes": s.bytes.d2h, "cpu_bytes": s.bytes.cpu}})
}

/// Where the device has a clock, the span's time on the device's compute stream (track 2) and
/// copy stream (track 3): how far each advanced between the span's ends.
fn device_events(s: &Span) -> impl Iterator<Item = Value> + '_ {
    s.device.into_iter().flat_map(move |d| {
        [(2, d.compute), (3, d.copy)]
            .into_iter()
            .filter(|(_, dur)| !dur.is_zero())
            .map(move |(tid, dur)| {
                json!({"name": s.phase.name(), "cat": "device", "ph": "X", "pid": 1, "tid": tid,
                       "ts": us(d.at), "dur": us(dur),
                       "args": {"step": s.step, "layer": s.layer}})
            })
    })
}

/// The log as Chrome trace-event JSON: a complete event (`"ph": "X"`, microseconds) per step and
/// per phase span inside it on the host's track, and where the device has a clock each span's
/// time on its compute and copy streams on tracks of their own.
pub fn chrome_trace(log: &TraceLog, model: &str, device: &str) -> Value {
    let mut events: Vec<Value> = Vec::with_capacity(log.steps.len() + log.spans.len() + 4);
    events.push(json!({"name": "process_name", "ph": "M", "pid": 1,
                       "args": {"name": format!("gpu-offload {model} on {device}")}}));
    for (tid, name) in [(1, "host"), (2, "device compute"), (3, "device copies")] {
        events.push(
            json!({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid,
                           "args": {"name": name}}),
        );
    }
    events.extend(log.steps.iter().map(step_event));
    events.extend(log.spans.iter().map(span_event));
    events.extend(log.spans.iter().flat_map(device_events));
    json!({"traceEvents": events, "displayTimeUnit": "ms"})
}

/// Write `trace` to `path` atomically.
pub fn write_trace(path: &Path, trace: &Value) -> Result<()> {
    let bytes = serde_json::to_vec(trace)?;
    crate::fsutil::write_atomic(path, &bytes)
        .with_context(|| format!("--trace {}: cannot write the trace", path.display()))
}

/// The decode steps of a log holding one generation: every step after its first (the prompt's).
pub fn decode_totals(log: &TraceLog) -> PhaseTotals {
    let first = log.steps.first().map(|s| s.step);
    totals(log, |s| Some(s.step) != first)
}

/// Seconds `bytes` take at `rate` (none where nothing moves or the rate is unknown).
fn at_rate(bytes: f64, rate: f64) -> Option<f64> {
    (bytes > 0.0 && rate.is_finite() && rate > 0.0).then(|| bytes / rate)
}

/// Per decoded token, each phase's seconds and bytes beside its bound (the time its bytes take
/// at the rates, added: host↔device over PCIe, the device's reads of its weights and KV caches
/// from its memory, CPU reads from DRAM); the steps' own time; and the ledger's host↔device and
/// device-read bytes over the same steps (`decode` = the snapshots after the prompt and at the
/// end), which the phases' bytes equal.
pub fn per_token_json(
    t: &PhaseTotals,
    rates: &Rates,
    decode: (LedgerSnapshot, LedgerSnapshot),
) -> Value {
    let n = t.steps.max(1) as f64;
    let phases: serde_json::Map<String, Value> = Phase::ALL
        .iter()
        .filter_map(|p| t.phases.get(p).map(|s| (p, s)))
        .map(|(p, s)| {
            let (h2d, d2h, device, cpu) = (
                s.bytes.h2d as f64 / n,
                s.bytes.d2h as f64 / n,
                s.bytes.device as f64 / n,
                s.bytes.cpu as f64 / n,
            );
            let parts = [
                ("PCIe", at_rate(h2d + d2h, rates.h2d_bytes_per_s)),
                ("HBM", at_rate(device, rates.hbm_read_bytes_per_s)),
                ("DRAM", at_rate(cpu, rates.dram_read_bytes_per_s)),
            ];
            let bound: Option<f64> = parts
                .iter()
                .filter_map(|(_, s)| *s)
                .reduce(|a, b| a + b);
            let by: Vec<&str> = parts
                .iter()
                .filter(|(_, s)| s.is_some())
                .map(|(n, _)| *n)
                .collect();
            let v = json!({
                "seconds": s.seconds / n, "h2d_bytes": h2d, "d2h_bytes": d2h,
                "device_bytes": device, "cpu_bytes": cpu,
                "bound_seconds": bound, "bound_by": if by.is_empty() { None } else { Some(by.join("+")) },
                "fraction_of_bound": bound.map(|b| b / (s.seconds / n)),
                "spans": s.spans as f64 / n,
                "device_compute_seconds": s.device.map(|d| d[0] / n),
                "device_copy_seconds": s.device.map(|d| d[1] / n),
            });
            (p.name().to_string(), v)
        })
        .collect();
    let bytes = t.bytes();
    let (a, b) = decode;
    json!({
        "decode_steps": t.steps,
        "step_seconds": t.step_seconds / n,
        "phase_seconds": t.phase_seconds() / n,
        "phases": phases,
        "bytes": {"h2d": bytes.h2d as f64 / n, "d2h": bytes.d2h as f64 / n,
                  "device": bytes.device as f64 / n, "cpu": bytes.cpu as f64 / n},
        "ledger_bytes": {"h2d": (b.h2d_bytes - a.h2d_bytes) as f64 / n,
                         "d2h": (b.d2h_bytes - a.d2h_bytes) as f64 / n,
                         "device": (b.device_read_bytes - a.device_read_bytes) as f64 / n},
    })
}

/// What the plan of the running mode predicted one decode token to cost, by resource: bytes over
/// the link (host↔device), bytes the CPU reads, bytes the device reads, and the seconds each
/// takes at the plan's rates.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PlannedCosts {
    pub link_bytes: f64,
    pub cpu_bytes: f64,
    pub device_bytes: f64,
    pub link_seconds: f64,
    pub cpu_seconds: f64,
    pub device_seconds: f64,
}

impl PlannedCosts {
    /// The costs of a plan: the dense plan's own figures, or hybrid's or the cache units' bytes
    /// per token at the plan's rates where one of those runs.
    pub fn of(
        plan: &crate::plan::Plan,
        sparse: Option<&crate::plan::resident::SparsePerToken>,
    ) -> Self {
        let hw = &plan.hardware;
        match sparse {
            Some(s) => PlannedCosts {
                link_bytes: s.pcie_bytes as f64,
                cpu_bytes: s.cpu_bytes as f64,
                device_bytes: s.hbm_bytes as f64,
                link_seconds: s.pcie_bytes as f64 / hw.h2d_pinned_bytes_per_s,
                cpu_seconds: hw.cpu_sparse_seconds(s.cpu_bytes as f64, s.cpu_reads),
                device_seconds: s.hbm_bytes as f64 / hw.hbm_bytes_per_s,
            },
            None => {
                let (t, p) = (&plan.per_token, &plan.prediction);
                PlannedCosts {
                    link_bytes: (t.h2d_bytes + t.d2h_bytes) as f64,
                    cpu_bytes: t.cpu_read_bytes as f64,
                    device_bytes: t.hbm_read_bytes as f64,
                    link_seconds: p.pcie_s,
                    cpu_seconds: p.cpu_s,
                    device_seconds: p.hbm_s,
                }
            }
        }
    }
}

/// The resource a phase's time is spent on: the link (copies between host and device), the CPU
/// (deciding, cold neurons, gathering misses), the device (its kernels), or the host waiting and
/// its bookkeeping.
fn resource(p: Phase) -> &'static str {
    match p {
        Phase::Landing | Phase::H2d => "link",
        Phase::Decide | Phase::CpuNeurons | Phase::Gather => "cpu",
        Phase::Embed
        | Phase::Attention
        | Phase::Scatter
        | Phase::DeviceNeurons
        | Phase::Merge
        | Phase::Head => "device",
        Phase::HostWait | Phase::Other => "host",
    }
}

/// The cost model beside the trace, per decoded token: for the link, the CPU and the device,
/// what the plan predicted (bytes, and seconds at its rates) and what the traced phases on
/// that resource measured (their seconds and bytes: the device's, its reads of the weights and
/// KV caches in its memory). The host's waits and
/// bookkeeping are measured only. A device phase that reads host memory in place over the
/// link (cache units' misses) counts towards the link for as long as its bytes need at the
/// measured link rate (`rates`), the rest towards the device: its kernels wait on the link
/// there, and the plan counts those bytes as the link's. Where the device has a clock (CUDA),
/// a device phase lasts as long as its compute stream advanced and a link phase as long as its
/// copy stream did, where longer than the host's seconds: the host only queues that work.
pub fn plan_vs_trace_json(t: &PhaseTotals, planned: &PlannedCosts, rates: &Rates) -> Value {
    let n = t.steps.max(1) as f64;
    let link_rate = rates.h2d_bytes_per_s;
    let mut seconds: std::collections::BTreeMap<&str, f64> = Default::default();
    for (p, s) in &t.phases {
        let r = resource(*p);
        let secs = match (r, s.device) {
            ("device", Some([compute, _])) => s.seconds.max(compute),
            ("link", Some([_, copy])) => s.seconds.max(copy),
            _ => s.seconds,
        } / n;
        let on_link = if r == "device" && s.bytes.h2d > 0 && link_rate > 0.0 {
            (s.bytes.h2d as f64 / n / link_rate).min(secs)
        } else {
            0.0
        };
        *seconds.entry("link").or_default() += on_link;
        *seconds.entry(r).or_default() += secs - on_link;
    }
    let b = t.bytes();
    let measured = |r: &str| seconds.get(r).copied().unwrap_or(0.0);
    json!({
        "link": {"predicted_seconds": planned.link_seconds, "measured_seconds": measured("link"),
                 "predicted_bytes": planned.link_bytes, "measured_bytes": (b.h2d + b.d2h) as f64 / n},
        "cpu": {"predicted_seconds": planned.cpu_seconds, "measured_seconds": measured("cpu"),
                "predicted_bytes": planned.cpu_bytes, "measured_bytes": b.cpu as f64 / n},
        "device": {"predicted_seconds": planned.device_seconds, "measured_seconds": measured("device"),
                   "predicted_bytes": planned.device_bytes, "measured_bytes": b.device as f64 / n},
        "host": {"measured_seconds": measured("host")},
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::trace::{PhaseSum, SpanBytes};

    /// A device phase reading host memory in place counts towards the link for as long as its
    /// bytes need at the link's rate (all of it where they need longer), the rest towards the
    /// device; the link's own phases and the CPU's stay where they are.
    #[test]
    fn in_place_reads_count_towards_the_link() {
        let rates = Rates {
            source: "test".into(),
            hbm_read_bytes_per_s: 20e9,
            h2d_bytes_per_s: 10e9,
            dram_read_bytes_per_s: 20e9,
            ssd_read_bytes_per_s: f64::NAN,
        };
        let sum = |seconds: f64, h2d: u64| PhaseSum {
            seconds,
            bytes: SpanBytes {
                h2d,
                ..Default::default()
            },
            spans: 1,
            device: None,
        };
        let mut t = PhaseTotals {
            steps: 2,
            step_seconds: 0.06,
            ..Default::default()
        };
        // Per token: 10 ms of units whose 60 MB need 6 ms at 10 GB/s; 2 ms of attention
        // reading 40 MB in place (4 ms: longer than the phase); 4 ms of copies; 6 ms of CPU.
        t.phases
            .insert(Phase::DeviceNeurons, sum(0.02, 120_000_000));
        t.phases.insert(Phase::Attention, sum(0.004, 80_000_000));
        t.phases.insert(Phase::H2d, sum(0.008, 80_000_000));
        t.phases.insert(Phase::CpuNeurons, sum(0.012, 0));
        let v = plan_vs_trace_json(&t, &PlannedCosts::default(), &rates);
        let got = |r: &str| v[r]["measured_seconds"].as_f64().unwrap();
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        assert!(close(got("link"), 0.006 + 0.002 + 0.004), "{v}");
        assert!(close(got("device"), 0.004), "{v}");
        assert!(close(got("cpu"), 0.006), "{v}");
        assert!(
            close(got("link") + got("device") + got("cpu"), 0.022),
            "{v}"
        );
        // With a device clock: the copies' stream ran 30 ms of the 4 ms the host spent queuing
        // them, the units' compute stream 40 ms of their 10 (24 ms of it for their bytes at 10
        // GB/s: now 240 MB), attention's 1 ms (its host's 2 stay); the CPU's phase keeps its
        // host seconds.
        let with_clock = |seconds: f64, h2d: u64, device: [f64; 2]| PhaseSum {
            device: Some(device),
            ..sum(seconds, h2d)
        };
        t.phases.insert(
            Phase::DeviceNeurons,
            with_clock(0.02, 480_000_000, [0.08, 0.0]),
        );
        t.phases
            .insert(Phase::Attention, with_clock(0.004, 0, [0.002, 0.0]));
        t.phases
            .insert(Phase::H2d, with_clock(0.008, 80_000_000, [0.0, 0.06]));
        t.phases
            .insert(Phase::CpuNeurons, with_clock(0.012, 0, [0.5, 0.5]));
        let v = plan_vs_trace_json(&t, &PlannedCosts::default(), &rates);
        let got = |r: &str| v[r]["measured_seconds"].as_f64().unwrap();
        assert!(close(got("link"), 0.024 + 0.03), "{v}");
        assert!(close(got("device"), 0.016 + 0.002), "{v}");
        assert!(close(got("cpu"), 0.006), "{v}");
    }
}
