//! The byte ledger: every allocation in device memory (HBM) and in the host memory the model
//! uses (pinned and pageable DRAM) goes through it, so budgets are enforced where memory is
//! taken, and every byte moved between tiers is counted. Backends and the tiers hold
//! [`Reservation`]s; dropping one gives its bytes back.
//!
//! Knows nothing about devices: it is numbers and locks.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde::Serialize;
use thiserror::Error;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    /// GPU memory (or the budgeted device's stand-in).
    Hbm,
    /// Page-locked host memory (staging for fast copies to the device).
    PinnedDram,
    /// Ordinary host memory.
    Dram,
}

impl Tier {
    fn index(self) -> usize {
        match self {
            Tier::Hbm => 0,
            Tier::PinnedDram => 1,
            Tier::Dram => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Tier::Hbm => "HBM",
            Tier::PinnedDram => "pinned DRAM",
            Tier::Dram => "DRAM",
        }
    }
}

#[derive(Debug, Error)]
#[error("{tier} budget exceeded: {what} needs {needed} bytes, {available} of {budget} left")]
pub struct OverBudget {
    pub tier: &'static str,
    pub what: String,
    pub needed: u64,
    pub available: u64,
    pub budget: u64,
}

#[derive(Debug, Default)]
struct State {
    used: [u64; 3],
    peak: [u64; 3],
    peak_dram_total: u64,
}

/// Budgets, usage and traffic counters.
#[derive(Debug)]
pub struct Ledger {
    hbm_budget: Option<u64>,
    /// Covers pinned and pageable DRAM together.
    dram_budget: Option<u64>,
    state: Mutex<State>,
    h2d: AtomicU64,
    d2h: AtomicU64,
    waits: AtomicU64,
    ssd: AtomicU64,
    skipped: AtomicU64,
    device_reads: AtomicU64,
}

/// Bytes held in one tier until dropped.
#[derive(Debug)]
pub struct Reservation {
    ledger: Arc<Ledger>,
    tier: Tier,
    bytes: u64,
}

impl Reservation {
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn tier(&self) -> Tier {
        self.tier
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.ledger.release(self.tier, self.bytes);
    }
}

/// What the ledger says at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct LedgerSnapshot {
    pub hbm_used: u64,
    pub hbm_peak: u64,
    pub pinned_used: u64,
    pub pinned_peak: u64,
    pub dram_used: u64,
    pub dram_peak: u64,
    /// Peak of pinned + pageable DRAM together (what the DRAM budget bounds).
    pub dram_total_peak: u64,
    pub h2d_bytes: u64,
    pub d2h_bytes: u64,
    pub ssd_read_bytes: u64,
    /// Times the host waited for the device (see [`Ledger::count_host_wait`]).
    pub host_waits: u64,
    /// Device memory the FFN's bundle kernels did not read: the parts of neurons off for every
    /// token ([`Ledger::count_reads_skipped`]).
    pub device_reads_skipped: u64,
    /// Device memory the device's kernels read of the weights and KV caches it holds
    /// ([`Ledger::count_device_read`]): what bounds a phase of device work by its memory's rate.
    pub device_read_bytes: u64,
}

impl Ledger {
    /// A ledger with optional budgets (`None`: unlimited, still counted).
    pub fn new(hbm_budget: Option<u64>, dram_budget: Option<u64>) -> Arc<Self> {
        Arc::new(Ledger {
            hbm_budget,
            dram_budget,
            state: Mutex::new(State::default()),
            h2d: AtomicU64::new(0),
            d2h: AtomicU64::new(0),
            waits: AtomicU64::new(0),
            ssd: AtomicU64::new(0),
            skipped: AtomicU64::new(0),
            device_reads: AtomicU64::new(0),
        })
    }

    pub fn hbm_budget(&self) -> Option<u64> {
        self.hbm_budget
    }

    pub fn dram_budget(&self) -> Option<u64> {
        self.dram_budget
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding this lock cannot leave the numbers half-updated.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Take `bytes` in `tier` for `what`, or say why not.
    pub fn reserve(
        self: &Arc<Self>,
        tier: Tier,
        bytes: u64,
        what: &str,
    ) -> Result<Reservation, OverBudget> {
        let mut s = self.lock();
        let i = tier.index();
        let (budget, in_use) = match tier {
            Tier::Hbm => (self.hbm_budget, s.used[0]),
            Tier::PinnedDram | Tier::Dram => (self.dram_budget, s.used[1] + s.used[2]),
        };
        if let Some(budget) = budget
            && in_use + bytes > budget
        {
            return Err(OverBudget {
                tier: tier.name(),
                what: what.to_string(),
                needed: bytes,
                available: budget.saturating_sub(in_use),
                budget,
            });
        }
        s.used[i] += bytes;
        s.peak[i] = s.peak[i].max(s.used[i]);
        let dram_total = s.used[1] + s.used[2];
        s.peak_dram_total = s.peak_dram_total.max(dram_total);
        Ok(Reservation {
            ledger: self.clone(),
            tier,
            bytes,
        })
    }

    fn release(&self, tier: Tier, bytes: u64) {
        let mut s = self.lock();
        s.used[tier.index()] -= bytes;
    }

    pub fn count_h2d(&self, bytes: u64) {
        self.h2d.fetch_add(bytes, Ordering::Relaxed);
    }

    pub fn count_d2h(&self, bytes: u64) {
        self.d2h.fetch_add(bytes, Ordering::Relaxed);
    }

    /// The host blocked until the device reached a point (a read, an event): the syncs a step
    /// costs, which hybrid execution keeps to one per layer.
    pub fn count_host_wait(&self) {
        self.waits.fetch_add(1, Ordering::Relaxed);
    }

    pub fn count_ssd(&self, bytes: u64) {
        self.ssd.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Device memory a whole layer's bundle kernels left unread: the up and down parts of
    /// neurons the activation left off for every token (a ReLU model's most). The plan counts
    /// every bundle whole; a bound on the device's reads takes these off.
    pub fn count_reads_skipped(&self, bytes: u64) {
        self.skipped.fetch_add(bytes, Ordering::Relaxed);
    }

    /// The device's kernels read `bytes` of the weights and KV caches in its own memory (its
    /// activations left out: a layer's are a few KB beside its MB of weights). Counted by every
    /// backend with the same formulas ([`crate::backend::reads`]), so a phase's bytes bound it
    /// alike on the budgeted device and on CUDA.
    pub fn count_device_read(&self, bytes: u64) {
        self.device_reads.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Forget the peaks (usage stays): to measure the steady state after start-up.
    pub fn reset_peaks(&self) {
        let mut s = self.lock();
        s.peak = s.used;
        s.peak_dram_total = s.used[1] + s.used[2];
    }

    pub fn snapshot(&self) -> LedgerSnapshot {
        let s = self.lock();
        LedgerSnapshot {
            hbm_used: s.used[0],
            hbm_peak: s.peak[0],
            pinned_used: s.used[1],
            pinned_peak: s.peak[1],
            dram_used: s.used[2],
            dram_peak: s.peak[2],
            dram_total_peak: s.peak_dram_total,
            h2d_bytes: self.h2d.load(Ordering::Relaxed),
            d2h_bytes: self.d2h.load(Ordering::Relaxed),
            ssd_read_bytes: self.ssd.load(Ordering::Relaxed),
            host_waits: self.waits.load(Ordering::Relaxed),
            device_reads_skipped: self.skipped.load(Ordering::Relaxed),
            device_read_bytes: self.device_reads.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_are_enforced_and_released() {
        let l = Ledger::new(Some(100), Some(50));
        let a = l.reserve(Tier::Hbm, 60, "a").unwrap();
        let err = l.reserve(Tier::Hbm, 50, "b").unwrap_err();
        assert_eq!((err.needed, err.available), (50, 40));
        assert!(
            err.to_string()
                .contains("HBM budget exceeded: b needs 50 bytes"),
            "{err}"
        );
        drop(a);
        let _b = l.reserve(Tier::Hbm, 100, "b").unwrap();
        let _p = l.reserve(Tier::PinnedDram, 30, "p").unwrap();
        assert!(
            l.reserve(Tier::Dram, 30, "d").is_err(),
            "pinned and pageable share the DRAM budget"
        );
        let s = l.snapshot();
        assert_eq!((s.hbm_used, s.hbm_peak, s.pinned_used), (100, 100, 30));
    }

    #[test]
    fn counters_and_peaks() {
        let l = Ledger::new(None, None);
        {
            let _a = l.reserve(Tier::Dram, 10, "a").unwrap();
            let _b = l.reserve(Tier::PinnedDram, 5, "b").unwrap();
        }
        l.count_h2d(7);
        l.count_ssd(3);
        let s = l.snapshot();
        assert_eq!((s.dram_used, s.dram_peak, s.dram_total_peak), (0, 10, 15));
        assert_eq!((s.h2d_bytes, s.ssd_read_bytes), (7, 3));
        l.reset_peaks();
        assert_eq!(l.snapshot().dram_total_peak, 0);
    }
}
