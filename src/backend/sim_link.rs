//! The budgeted device's link (a child module of `sim`, kept in its own file): copies and
//! in-place reads paced to the link's rate, one after another, and the waits for them; and its
//! compute stream, busy until its ops' in-place reads have crossed.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::SimBackend;
use crate::backend::clock::DeviceClock;
use crate::backend::{BackendError, Result};

impl SimBackend {
    /// When the paced link is free again: the end of the last paced copy or in-place read
    /// (`None` while nothing paces it).
    #[cfg(test)]
    pub(crate) fn link_free_at(&self) -> Option<Instant> {
        link_until(&self.pace)
    }

    /// When the paced link has carried what is queued on it (now, if it has): the copy
    /// stream's end.
    pub(super) fn link_ends(&self) -> Instant {
        later_of_now(link_until(&self.pace))
    }

    /// Count a host→device copy of `bytes` (or an in-place read) started at `started`, taking
    /// as long as the emulated link would, behind what it carries already; the calling thread
    /// returns once it has crossed.
    pub(super) fn copied_in(&self, bytes: usize, started: Instant) {
        wait_until(self.queue_on_link(bytes, started));
    }

    /// The paced link carries nothing queued from now before `at` (a copy waiting for an
    /// event).
    pub(super) fn link_busy_until(&self, at: Instant) {
        if let Ok(mut pace) = self.pace.lock()
            && let Some((_, until)) = pace.as_mut()
        {
            *until = (*until).max(at);
        }
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

    /// The compute stream's work queued so far ends no earlier than `end` (an op's in-place reads
    /// crossing the link after the CPU computed it). The host is not held: as on CUDA, where
    /// a kernel reading mapped host memory runs while the host queues what comes next (a
    /// copy, which the link carries behind those reads), only the stream's next op, or a host
    /// waiting on the stream, waits for it.
    pub(super) fn stream_busy_until(&self, end: Instant) {
        if let Ok(mut s) = self.stream.lock() {
            *s = Some(s.map_or(end, |t| t.max(end)));
        }
    }

    /// When the compute stream's work queued so far ends (now, if it has).
    pub(super) fn stream_ends(&self) -> Instant {
        ends(&self.stream)
    }

    /// A clock on this device's two streams for traces ([`SimClock`]).
    pub(super) fn clock(&self) -> SimClock {
        SimClock {
            pace: self.pace.clone(),
            stream: self.stream.clone(),
            marks: Mutex::default(),
        }
    }

    /// Block until the compute stream's work queued so far has ended: the start of each of its
    /// ops, and of a read of what it computed.
    pub(super) fn stream_waits(&self) {
        wait_until(self.stream_ends());
    }
}

/// When the work a stream has queued ends: its end, or now if that has passed.
fn ends(stream: &Mutex<Option<Instant>>) -> Instant {
    later_of_now(stream.lock().ok().and_then(|s| *s))
}

/// When the paced link's last copy or in-place read ends (`None` while nothing paces it).
fn link_until(pace: &Mutex<Option<(f64, Instant)>>) -> Option<Instant> {
    pace.lock().ok().and_then(|p| p.map(|(_, until)| until))
}

/// `end`, or now where it has passed or there is none.
fn later_of_now(end: Option<Instant>) -> Instant {
    let now = Instant::now();
    end.map_or(now, |t| t.max(now))
}

/// The budgeted device's streams as a trace's clock: a mark on the compute stream is when the
/// work it has queued ends (its ops run as the host asks them, but in-place reads may still be
/// crossing), one on the copy stream when the link has carried what is queued on it. So a span
/// in which the host waits for the stream's earlier work is given only the stream's time
/// after that work, as CUDA's events give it.
pub(super) struct SimClock {
    pace: Arc<Mutex<Option<(f64, Instant)>>>,
    stream: Arc<Mutex<Option<Instant>>>,
    marks: Mutex<Vec<[Instant; 2]>>,
}

impl SimClock {
    fn marks(&self) -> Result<std::sync::MutexGuard<'_, Vec<[Instant; 2]>>> {
        self.marks
            .lock()
            .map_err(|_| BackendError::Device("clock marks poisoned".into()))
    }
}

impl DeviceClock for SimClock {
    fn mark(&self) -> Result<usize> {
        let copy = later_of_now(link_until(&self.pace));
        let mut marks = self.marks()?;
        marks.push([ends(&self.stream), copy]);
        Ok(marks.len() - 1)
    }

    fn take(&self) -> Result<Vec<[f64; 2]>> {
        let marks = std::mem::take(&mut *self.marks()?);
        let Some(first) = marks.first().copied() else {
            return Ok(Vec::new());
        };
        if let Some(last) = marks.iter().flatten().max() {
            wait_until(*last);
        }
        let secs = |t: Instant, from: Instant| t.saturating_duration_since(from).as_secs_f64();
        Ok(marks
            .iter()
            .map(|m| [secs(m[0], first[0]), secs(m[1], first[1])])
            .collect())
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
