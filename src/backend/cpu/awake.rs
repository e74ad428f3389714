//! The pool's other workers kept taking its tasks for as long as the backend's execution
//! context is entered (a step), instead of falling asleep between the forks.
//!
//! Why: a rayon worker idle for a few µs sleeps, and the next fork waits on its wake-up (on
//! these VMs tens of µs). A decode step forks several times a layer, after serial stretches:
//! SmolLM2's q, k and v products (345 KB of Q4_1 from DRAM, 2 threads) took 9.4 µs right after
//! a parallel pass and 25–29 µs after 30–300 µs of serial work. Hybrid's cold pass over 30
//! SmolLM2 layers in tiles (4.8 MB a layer, 2 threads, out of tree, alternated) ran at 16–17
//! GB/s with a wake-up a layer and 19.5–20 with the other worker kept; an OpenMP loop of the
//! same kernels fell from 24–29 GB/s to 14–19 when its workers were made to sleep
//! (`OMP_WAIT_POLICY=passive`).
//!
//! A kept worker runs the pool's tasks as they come ([`rayon::yield_now`]) and otherwise spins,
//! yielding the core now and then to any other thread that wants it (the tiers' readers), until
//! the hold ends or it has gone [`MOST_IDLE`] without a task.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Idle polls between two yields of the core to the scheduler (and looks at the clock).
const POLLS_PER_YIELD: u32 = 64;

/// The longest a kept worker goes without a task before it leaves the pool to sleep and wake
/// as usual. Kept through longer idle stretches (the budgeted device's paced waits, hundreds
/// of µs), SmolLM2's cache units at 48M got slower: their listed op took 440–470 µs a layer
/// against 370–420 (the cause not found: not the polling's rate, the core's clock or the
/// sleeps' wake-ups, each tried); kept 100 µs, the units ran as before and hybrid kept its
/// gain.
const MOST_IDLE: Duration = Duration::from_micros(100);

/// Whether workers are held, and which hold: workers kept by an earlier hold end when the
/// generation passes theirs.
#[derive(Default)]
pub(super) struct Awake(Arc<Counts>);

#[derive(Default)]
struct Counts {
    holds: AtomicUsize,
    generation: AtomicU64,
    /// Workers keeping now, and keepers started ever.
    kept: AtomicUsize,
    started: AtomicUsize,
}

/// Workers kept while this lives (see [`Awake::hold`]).
pub(super) struct Held(Arc<Counts>);

impl Awake {
    /// Keep every worker of `pool` but the calling one taking its tasks until the returned
    /// [`Held`] drops (holds nest: the outermost one keeps them). The caller is one of the
    /// pool's workers (inside `pool.install`); it never runs a keeper itself, so its own
    /// forks and their joins never wait on one.
    pub(super) fn hold(&self, pool: &rayon::ThreadPool) -> Held {
        let c = &self.0;
        if c.holds.fetch_add(1, Ordering::AcqRel) == 0 {
            let mine = c.generation.fetch_add(1, Ordering::AcqRel) + 1;
            let holder = pool.current_thread_index();
            let c = c.clone();
            pool.spawn_broadcast(move |ctx| {
                if Some(ctx.index()) == holder {
                    return;
                }
                c.started.fetch_add(1, Ordering::AcqRel);
                c.kept.fetch_add(1, Ordering::AcqRel);
                let mut idle = 0u32;
                let mut last_task = Instant::now();
                while c.generation.load(Ordering::Acquire) == mine {
                    if let Some(rayon::Yield::Executed) = rayon::yield_now() {
                        idle = 0;
                        last_task = Instant::now();
                        continue;
                    }
                    idle += 1;
                    if idle.is_multiple_of(POLLS_PER_YIELD) {
                        if last_task.elapsed() > MOST_IDLE {
                            break;
                        }
                        std::thread::yield_now();
                    } else {
                        std::hint::spin_loop();
                    }
                }
                c.kept.fetch_sub(1, Ordering::AcqRel);
            });
        }
        Held(self.0.clone())
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if self.0.holds.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.generation.fetch_add(1, Ordering::AcqRel);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;

    /// Waits up to 10 s for `what` to hold.
    fn soon(what: impl Fn() -> bool) -> bool {
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(10) {
            if what() {
                return true;
            }
            std::thread::yield_now();
        }
        false
    }

    /// A hold keeps every worker but the caller (holds nest: the outermost keeps), the
    /// caller's forks and joins complete while it lasts, a worker idle for longer than
    /// [`MOST_IDLE`] leaves, and every keeper ends when the outermost hold drops. (A keeper
    /// may leave before the other starts on a loaded machine: the test counts starts.)
    #[test]
    fn a_hold_keeps_the_other_workers_until_it_drops_or_they_idle() {
        let run = std::thread::spawn(move || {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(3)
                .build()
                .unwrap();
            let awake = Awake::default();
            let kept = || awake.0.kept.load(Ordering::Acquire);
            let started = || awake.0.started.load(Ordering::Acquire);
            pool.install(|| {
                let held = awake.hold(&pool);
                let generation = awake.0.generation.load(Ordering::Acquire);
                assert!(soon(|| started() == 2), "the two other workers keep");
                let inner = awake.hold(&pool);
                assert_eq!(awake.0.generation.load(Ordering::Acquire), generation);
                let sum: u64 = (0..100_000u64).into_par_iter().map(|i| i % 7).sum();
                assert_eq!(sum, (0..100_000u64).map(|i| i % 7).sum::<u64>());
                for _ in 0..100 {
                    rayon::join(|| (), || ());
                }
                drop(inner);
                assert_eq!(
                    awake.0.holds.load(Ordering::Acquire),
                    1,
                    "the outer hold lasts"
                );
                assert_eq!(awake.0.generation.load(Ordering::Acquire), generation);
                // Idle for longer than a keeper waits: both leave, the hold still on.
                std::thread::sleep(MOST_IDLE * 20);
                assert!(soon(|| kept() == 0), "idle keepers leave");
                assert_eq!(rayon::join(|| 1, || 2), (1, 2));
                drop(held);
            });
            assert_eq!(awake.0.holds.load(Ordering::Acquire), 0);
            // A new hold keeps afresh, and its keepers end with it.
            pool.install(|| {
                let _held = awake.hold(&pool);
                assert!(soon(|| started() == 4));
            });
            assert!(soon(|| kept() == 0), "keepers end with their hold");
            // The callers never kept: two keepers a hold.
            std::thread::sleep(MOST_IDLE * 20);
            assert_eq!(started(), 4);
        });
        let t = Instant::now();
        while !run.is_finished() {
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "a held pool's caller waited on a keeper, or a keeper never ended"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        run.join().expect("the held pool's checks");
    }
}
