//! Physical bounds: the rates bytes move at (measured live, or a hardware profile's figures),
//! the bytes each resource must move per token, and the check that no measured figure beats
//! its bound. Owns no measuring of models and no printing.
//!
//! A bound is `1 / max over resources of (bytes ÷ rate)`: a token cannot be faster than its
//! slowest resource moves what it must. A figure above its bound (beyond [`TOLERANCE`]) means
//! the bound is wrong: a rate too low, or bytes counted that were never moved.

use std::collections::BTreeMap;

use serde::Serialize;
use thiserror::Error;

use crate::plan::{HardwareProfile, Plan};
use crate::runtime::probe::{self as hw, GpuProfile};

/// How far above its bound a measured figure may be before the bound is declared wrong (timer
/// noise on short runs).
pub const TOLERANCE: f64 = 1.05;

/// Device-memory read rate of a probed GPU, bytes/s: a kernel that only reads (a copy's rate
/// counted over bytes read plus written is the same bandwidth; never halve it).
pub fn hbm_read_rate(g: &GpuProfile) -> f64 {
    g.hbm_read_bytes_per_s
}

/// The rates bounds divide by, bytes/s, and where they came from.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Rates {
    /// "measured live (…)" or "profile NAME".
    pub source: String,
    /// Device memory read (the budgeted device: host memory read).
    pub hbm_read_bytes_per_s: f64,
    /// Host→device copies (pinned; the budgeted device: one-thread memcpy).
    pub h2d_bytes_per_s: f64,
    /// Host memory read by the CPU threads.
    pub dram_read_bytes_per_s: f64,
    /// SSD read with direct I/O.
    pub ssd_read_bytes_per_s: f64,
}

impl Rates {
    /// A profile's figures (what `--hardware` and `--emulate` give).
    pub fn from_profile(p: &HardwareProfile) -> Self {
        Rates {
            source: format!("profile {}", p.name),
            hbm_read_bytes_per_s: p.hbm_bytes_per_s,
            h2d_bytes_per_s: p.h2d_pinned_bytes_per_s,
            dram_read_bytes_per_s: p.dram_read_bytes_per_s,
            ssd_read_bytes_per_s: p.ssd_read_bytes_per_s,
        }
    }

    /// These rates with the host's DRAM read rate the median of `probes` (taken beside the run
    /// being bounded) and the one measured here; the device's memory read too where it is host
    /// memory (`hbm_is_host`: the budgeted device and the CPU). The host's rate swings with
    /// what else runs on it (29-66 GB/s within minutes on a shared VM): one probe after the run
    /// samples a moment, the median of probes between its repetitions the minutes it ran in.
    pub fn with_dram_probes(&self, probes: &[f64], hbm_is_host: bool) -> Self {
        let mut all: Vec<f64> = probes.iter().copied().filter(|r| *r > 0.0).collect();
        if all.is_empty() {
            return self.clone();
        }
        all.push(self.dram_read_bytes_per_s);
        all.sort_by(f64::total_cmp);
        let dram = all[all.len() / 2];
        Rates {
            source: format!(
                "{}; host DRAM read: the median of {} probes between repetitions and after",
                self.source,
                all.len()
            ),
            dram_read_bytes_per_s: dram,
            hbm_read_bytes_per_s: if hbm_is_host {
                dram
            } else {
                self.hbm_read_bytes_per_s
            },
            ..self.clone()
        }
    }

    /// As these rates run emulating `card` (see [`HardwareProfile::emulating`]): the card's
    /// host→device rate, this machine's others.
    pub fn emulating(&self, card: &HardwareProfile) -> Self {
        Rates {
            source: format!(
                "{}; host→device at {}'s {:.1} GB/s (emulated)",
                self.source,
                card.name,
                card.h2d_pinned_bytes_per_s / 1e9
            ),
            h2d_bytes_per_s: card.h2d_pinned_bytes_per_s,
            ..self.clone()
        }
    }

    /// `base` with its rates replaced by these (for the planner's cost model); named `name`. A
    /// rate that was not measured (not finite and positive) keeps `base`'s figure.
    pub fn into_profile(&self, base: &HardwareProfile, name: &str) -> HardwareProfile {
        let pick = |measured: f64, fallback: f64| {
            if measured.is_finite() && measured > 0.0 {
                measured
            } else {
                fallback
            }
        };
        let h2d = pick(self.h2d_bytes_per_s, base.h2d_pinned_bytes_per_s);
        HardwareProfile {
            name: name.into(),
            hbm_bytes_per_s: pick(self.hbm_read_bytes_per_s, base.hbm_bytes_per_s),
            h2d_pinned_bytes_per_s: h2d,
            h2d_pageable_bytes_per_s: base.h2d_pageable_bytes_per_s.min(h2d),
            dram_read_bytes_per_s: pick(self.dram_read_bytes_per_s, base.dram_read_bytes_per_s),
            ssd_read_bytes_per_s: pick(self.ssd_read_bytes_per_s, base.ssd_read_bytes_per_s),
            ..base.clone()
        }
    }
}

/// Bytes sizes of the host probes: far beyond any cache, small enough to take a fraction of a
/// second on two cores.
const PROBE_BYTES: usize = 256 << 20;
const SSD_PROBE_BYTES: usize = 64 << 20;

/// Host rates measured now: DRAM read with `threads` threads and SSD read under `ssd_dir`
/// (NaN when no directory is given or the probe fails: nothing is bounded by it then).
fn host_rates(threads: usize, ssd_dir: Option<&std::path::Path>) -> (f64, f64) {
    let dram = dram_read_rate(threads);
    let ssd = ssd_dir
        .and_then(|d| hw::ssd_read_bandwidth(d, SSD_PROBE_BYTES).ok())
        .unwrap_or(f64::NAN);
    (dram, ssd)
}

/// The host's DRAM read rate by `threads` threads, measured now (the best of three passes over
/// 256 MiB).
pub fn dram_read_rate(threads: usize) -> f64 {
    hw::dram_read_bandwidth(threads, PROBE_BYTES, 3)
}

/// The budgeted CPU device's link, measured now: its copy engine is one memcpy thread.
pub fn sim_link_rate() -> f64 {
    hw::memcpy_bandwidth(PROBE_BYTES, 3)
}

/// The budgeted CPU device's rates, measured now: its "device memory" is host memory read by
/// `threads` threads, its copy engine one memcpy thread ([`sim_link_rate`], or `link` where
/// the caller measured it already), its SSD the filesystem under `ssd_dir`.
pub fn measure_sim(threads: usize, ssd_dir: Option<&std::path::Path>, link: Option<f64>) -> Rates {
    let (dram, ssd) = host_rates(threads, ssd_dir);
    Rates {
        source: format!("measured live (budgeted CPU device, {threads} threads)"),
        hbm_read_bytes_per_s: dram,
        h2d_bytes_per_s: link.unwrap_or_else(sim_link_rate),
        dram_read_bytes_per_s: dram,
        ssd_read_bytes_per_s: ssd,
    }
}

/// GPU 0's rates, measured now (device memory read, pinned host→device), with the host's;
/// also the GPU's name and memory size.
pub fn measure_gpu(
    threads: usize,
    ssd_dir: Option<&std::path::Path>,
) -> Result<(Rates, GpuProfile), String> {
    let g = hw::probe_gpu(256 << 20)?;
    let (dram, ssd) = host_rates(threads, ssd_dir);
    let rates = Rates {
        source: format!("measured live ({})", g.name),
        hbm_read_bytes_per_s: hbm_read_rate(&g),
        h2d_bytes_per_s: g.h2d_pinned_bytes_per_s,
        dram_read_bytes_per_s: dram,
        ssd_read_bytes_per_s: ssd,
    };
    Ok((rates, g))
}

/// Bytes one decoded token moves through each resource.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Traffic {
    pub hbm_read_bytes: f64,
    pub h2d_bytes: f64,
    pub dram_read_bytes: f64,
    pub ssd_read_bytes: f64,
}

impl Traffic {
    /// What an offloaded plan moves per decoded token.
    pub fn of_plan(p: &Plan) -> Self {
        Traffic {
            hbm_read_bytes: p.per_token.hbm_read_bytes as f64,
            h2d_bytes: p.per_token.h2d_bytes as f64,
            dram_read_bytes: p.per_token.cpu_read_bytes as f64,
            ssd_read_bytes: p.per_token.ssd_bytes as f64,
        }
    }
}

/// A bound on tokens/s and the resource that sets it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Bound {
    pub tokens_per_s: f64,
    /// "HBM", "PCIe", "DRAM", "SSD", or "HBM+DRAM" (device and CPU one after the other).
    pub limited_by: String,
    /// Seconds per token each resource needs (bytes ÷ rate), by name; resources the token
    /// moves nothing through are absent.
    pub seconds: BTreeMap<String, f64>,
}

impl Bound {
    /// The slowest resource of `traffic` at `rates`.
    pub fn of(traffic: &Traffic, rates: &Rates) -> Self {
        let seconds: BTreeMap<String, f64> = [
            ("HBM", traffic.hbm_read_bytes, rates.hbm_read_bytes_per_s),
            ("PCIe", traffic.h2d_bytes, rates.h2d_bytes_per_s),
            ("DRAM", traffic.dram_read_bytes, rates.dram_read_bytes_per_s),
            ("SSD", traffic.ssd_read_bytes, rates.ssd_read_bytes_per_s),
        ]
        .into_iter()
        .filter(|&(_, bytes, _)| bytes > 0.0)
        // A rate that was not measured bounds nothing: its entry is NaN (null in JSON).
        .map(|(name, bytes, rate)| {
            let s = if rate.is_finite() && rate > 0.0 {
                bytes / rate
            } else {
                f64::NAN
            };
            (name.to_string(), s)
        })
        .collect();
        // The CPU's share of a split or hybrid layer waits for the device's input and the
        // device for its partial sum: the two add up, layer by layer.
        let mut seconds = seconds;
        if let (Some(h), Some(d)) = (seconds.get("HBM"), seconds.get("DRAM")) {
            let both = h + d;
            seconds.insert("HBM+DRAM".to_string(), both);
        }
        let (limited_by, worst) = seconds
            .iter()
            .fold(("none".to_string(), 0.0), |acc, (n, s)| {
                if *s > acc.1 { (n.clone(), *s) } else { acc }
            });
        Bound {
            tokens_per_s: if worst > 0.0 {
                1.0 / worst
            } else {
                f64::INFINITY
            },
            limited_by,
            seconds,
        }
    }

    /// The rate of the limiting resource, bytes/s, for messages.
    pub fn rate_of(&self, rates: &Rates) -> f64 {
        match self.limited_by.as_str() {
            "HBM" => rates.hbm_read_bytes_per_s,
            "PCIe" => rates.h2d_bytes_per_s,
            "DRAM" => rates.dram_read_bytes_per_s,
            "SSD" => rates.ssd_read_bytes_per_s,
            "HBM+DRAM" => rates.hbm_read_bytes_per_s.min(rates.dram_read_bytes_per_s),
            _ => f64::NAN,
        }
    }
}

/// Lower bound on the time to first token for a `prompt`-token prompt evaluated in `passes`
/// passes: each pass streams `streamed_bytes` over PCIe and reads `read_bytes` of device memory.
/// Only bytes count: FLOPs are not in it.
pub fn ttft_bound(streamed_bytes: f64, read_bytes: f64, passes: usize, rates: &Rates) -> Bound {
    let t = Traffic {
        hbm_read_bytes: read_bytes * passes as f64,
        h2d_bytes: streamed_bytes * passes as f64,
        ..Default::default()
    };
    Bound::of(&t, rates)
}

/// A measured figure above its bound.
#[derive(Debug, Error, Clone, PartialEq)]
#[error(
    "{what}: measured {measured:.4} is {:.2}× its {limited_by} bound {bound:.4} (rate {rate_gbs:.3} GB/s from {rates_from}): a figure above its bound means the bound is wrong — check that rate, or the bytes counted per token",
    measured / bound
)]
pub struct AboveBound {
    pub what: String,
    pub measured: f64,
    pub bound: f64,
    pub limited_by: String,
    pub rate_gbs: f64,
    /// Where the rate came from ("measured live (…)", "profile NAME").
    pub rates_from: String,
}

/// `Err` when `measured` (same unit as `bound`, higher = faster) exceeds `bound` by more than
/// [`TOLERANCE`].
pub fn check(what: &str, measured: f64, bound: &Bound, rates: &Rates) -> Result<(), AboveBound> {
    if bound.tokens_per_s.is_finite() && measured > TOLERANCE * bound.tokens_per_s {
        return Err(AboveBound {
            what: what.into(),
            measured,
            bound: bound.tokens_per_s,
            limited_by: bound.limited_by.clone(),
            rate_gbs: bound.rate_of(rates) / 1e9,
            rates_from: rates.source.clone(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rates(r: f64) -> Rates {
        Rates {
            source: "test".into(),
            hbm_read_bytes_per_s: 10.0 * r,
            h2d_bytes_per_s: r,
            dram_read_bytes_per_s: 5.0 * r,
            ssd_read_bytes_per_s: 0.5 * r,
        }
    }

    #[test]
    fn dram_probes_beside_the_run_give_the_median_rate() {
        // rates(1000): DRAM 5000, HBM 10000. Probes 3000, 9000 and a failed one (0) with the
        // rate measured after the run: the median of 3000, 5000, 9000.
        let r = rates(1000.0).with_dram_probes(&[3000.0, 0.0, 9000.0], false);
        assert_eq!(r.dram_read_bytes_per_s, 5000.0);
        assert_eq!(
            r.hbm_read_bytes_per_s, 10_000.0,
            "a GPU's memory is not the host's"
        );
        assert!(r.source.starts_with("test; ") && r.source.contains("median of 3 probes"));
        // The budgeted device's memory is the host's: the same rate. With an even count the
        // upper median (as the timings' medians).
        let r = rates(1000.0).with_dram_probes(&[1000.0, 2000.0, 8000.0], true);
        assert_eq!(r.dram_read_bytes_per_s, 5000.0);
        assert_eq!(r.hbm_read_bytes_per_s, 5000.0);
        assert_eq!(r.h2d_bytes_per_s, 1000.0);
        // No probes (rates from a profile): unchanged.
        assert_eq!(rates(1000.0).with_dram_probes(&[], true), rates(1000.0));
    }

    #[test]
    fn the_slowest_resource_sets_the_bound() {
        let t = Traffic {
            hbm_read_bytes: 100.0,
            h2d_bytes: 50.0,
            ..Default::default()
        };
        let b = Bound::of(&t, &rates(1000.0));
        // HBM: 100/10000 = 0.01 s; PCIe 50/1000 = 0.05 s.
        assert_eq!(b.limited_by, "PCIe");
        assert!((b.tokens_per_s - 20.0).abs() < 1e-9);
        assert_eq!(b.seconds.len(), 2);
    }

    #[test]
    fn a_figure_above_its_bound_is_an_error_naming_the_bound() {
        let t = Traffic {
            h2d_bytes: 1000.0,
            ..Default::default()
        };
        let r = rates(1000.0);
        let b = Bound::of(&t, &r);
        assert!(check("decode", 1.04, &b, &r).is_ok());
        let e = check("decode", 2.0, &b, &r).unwrap_err().to_string();
        assert!(
            e.contains("PCIe bound") && e.contains("bound is wrong"),
            "{e}"
        );
    }

    #[test]
    fn an_unmeasured_rate_bounds_nothing() {
        let t = Traffic {
            h2d_bytes: 50.0,
            ssd_read_bytes: 1e9,
            ..Default::default()
        };
        let mut r = rates(1000.0);
        r.ssd_read_bytes_per_s = f64::NAN;
        let b = Bound::of(&t, &r);
        assert_eq!(b.limited_by, "PCIe");
        assert!(b.seconds["SSD"].is_nan());
    }

    #[test]
    fn ttft_bound_counts_every_pass() {
        let b = ttft_bound(1000.0, 0.0, 4, &rates(1000.0));
        assert!((1.0 / b.tokens_per_s - 4.0).abs() < 1e-9);
    }

    #[test]
    fn profile_rates_round_trip() {
        let p = HardwareProfile::load("rtx3060-12g").unwrap();
        let mut r = Rates::from_profile(&p);
        assert_eq!(r.h2d_bytes_per_s, p.h2d_pinned_bytes_per_s);
        assert_eq!(r.into_profile(&p, &p.name), p);
        // An SSD that could not be probed keeps the base's figure: the profile stays valid.
        r.ssd_read_bytes_per_s = f64::NAN;
        let q = r.into_profile(&p, "measured");
        assert_eq!(q.ssd_read_bytes_per_s, p.ssd_read_bytes_per_s);
        q.validate().unwrap();
    }
}
