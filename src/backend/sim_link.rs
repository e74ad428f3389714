//! The budgeted device's link (a child module of `sim`, kept in its own file): copies and
//! in-place reads paced to the link's rate, one after another, and the waits for them.

use std::time::{Duration, Instant};

use super::SimBackend;

impl SimBackend {
    /// When the paced link is free again: the end of the last paced copy or in-place read
    /// (`None` while nothing paces it).
    pub(crate) fn link_free_at(&self) -> Option<Instant> {
        self.pace
            .lock()
            .ok()
            .and_then(|p| p.map(|(_, until)| until))
    }

    /// Count a host→device copy of `bytes` (or an in-place read) started at `started`, taking
    /// as long as the emulated link would, behind what it carries already; the calling thread
    /// returns once it has crossed.
    pub(super) fn copied_in(&self, bytes: usize, started: Instant) {
        wait_until(self.queue_on_link(bytes, started));
    }

    /// Count a host→device copy of `bytes` issued at `started` and queue it on the link behind
    /// what it carries already, returning at once: when it will have crossed (`started` where
    /// nothing paces the link). The copy stream's, as on CUDA: its bytes are in place now, and
    /// whoever reads them waits for
    /// [`Backend::copies_done`](crate::backend::Backend::copies_done)'s event.
    pub(super) fn queue_on_link(&self, bytes: usize, started: Instant) -> Instant {
        self.ledger().count_h2d(bytes as u64);
        let Ok(mut pace) = self.pace.lock() else {
            return started;
        };
        match pace.as_mut() {
            Some((rate, until)) => {
                let end = (*until).max(started) + Duration::from_secs_f64(bytes as f64 / *rate);
                *until = end;
                end
            }
            None => started,
        }
    }
}

/// Block the calling thread until `end`, to within a few microseconds. A plain sleep wakes up
/// late by the thread's timer slack (Linux: 50 µs by default; measured on the 2-core CI machine,
/// a 5 µs sleep took 61 µs and a 200 µs one 262 µs), which made each short paced copy and
/// in-place read take several times its time at the link's rate. So the thread's slack is
/// set to its minimum once (a 5 µs sleep then took 10 µs), the sleep stops short of `end`, and
/// the rest is spun.
pub(super) fn wait_until(end: Instant) {
    /// What is spun rather than slept: above the wake-up latency left with the minimal slack.
    const SPIN: Duration = Duration::from_micros(20);
    fine_timer_slack();
    loop {
        let now = Instant::now();
        if now >= end {
            return;
        }
        let left = end - now;
        if left > SPIN {
            std::thread::sleep(left - SPIN);
        } else {
            std::hint::spin_loop();
        }
    }
}

/// The calling thread's timer slack at its minimum (once per thread; Linux only).
fn fine_timer_slack() {
    thread_local!(static SET: std::cell::Cell<bool> = const { std::cell::Cell::new(false) });
    SET.with(|set| {
        if !set.replace(true) {
            #[cfg(target_os = "linux")]
            // SAFETY: PR_SET_TIMERSLACK takes a plain integer and affects only this thread.
            unsafe {
                libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0, 0, 0);
            }
        }
    });
}
