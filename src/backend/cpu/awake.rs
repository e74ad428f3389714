//! A worker kept from falling asleep between a serial stretch and the op after it that forks.
//!
//! Why: a pool worker idle for more than a few tens of µs sleeps, and the next fork then waits
//! on its wake-up. SmolLM2's q, k and v products (345 KB of Q4_1 from DRAM, 2 threads) took
//! 9.4 µs right after a parallel pass, 25–29 µs after 30–300 µs of serial work; with a worker
//! kept spinning through that work, 12–14 µs.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The longest a worker is kept: a fork that never comes costs no more than this.
const MOST: Duration = Duration::from_micros(200);

/// The keeper's state: an even count while none is wanted, odd while one spins.
#[derive(Default)]
pub(super) struct Awake(Arc<AtomicU64>);

impl Awake {
    /// Keep one of `pool`'s workers spinning until [`Awake::release`] (or [`MOST`]).
    pub(super) fn keep(&self, pool: &rayon::ThreadPool) {
        // Any keeper still spinning ends (its count passes), then one is wanted again.
        let mut mine = self.0.fetch_add(1, Ordering::AcqRel) + 1;
        if mine.is_multiple_of(2) {
            mine = self.0.fetch_add(1, Ordering::AcqRel) + 1;
        }
        let state = self.0.clone();
        pool.spawn(move || {
            let start = Instant::now();
            while state.load(Ordering::Acquire) == mine && start.elapsed() < MOST {
                std::hint::spin_loop();
            }
        });
    }

    /// A fork is about to start: the kept worker goes back to take its tasks.
    pub(super) fn release(&self) {
        let now = self.0.load(Ordering::Acquire);
        if !now.is_multiple_of(2) {
            let _ = self
                .0
                .compare_exchange(now, now + 1, Ordering::AcqRel, Ordering::Acquire);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kept worker spins until released, and a keeper released by none ends by itself.
    #[test]
    fn kept_workers_end_when_released_or_after_the_most() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let awake = Awake::default();
        pool.install(|| {
            awake.keep(&pool);
            awake.release();
            let t = Instant::now();
            rayon::join(|| (), || ());
            assert!(t.elapsed() < Duration::from_secs(1));
            awake.keep(&pool);
            awake.keep(&pool);
        });
        // Every keeper ends: the pool drops (joining nothing) and a new fork completes.
        std::thread::sleep(MOST * 2);
        pool.install(|| rayon::join(|| (), || ()));
        assert_eq!(awake.0.load(Ordering::Acquire) % 2, 1);
        awake.release();
        assert_eq!(awake.0.load(Ordering::Acquire) % 2, 0);
    }
}
