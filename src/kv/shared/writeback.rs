//! The shared store's write-back thread: completed calls written to the store in the order
//! they finished — chunks first, the index switched last (if the call's lease still holds and
//! nobody wrote the context meanwhile), old chunks dropped, the budget kept, the lease given
//! back — retried with backoff while the store is unreachable; and every held lease renewed.
//! The engine thread never waits on the store for a call's result.

use std::collections::HashMap;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use super::{SharedError, SharedStore, WriteOutcome};
use crate::fault::TestDelay;
use crate::kv::persist::{ChunkRecord, ContextIndex};

/// A completed call's result, for the store.
pub(super) struct Commit {
    pub(super) id: String,
    pub(super) token: String,
    /// The revision the call started from.
    pub(super) base_stamp: String,
    pub(super) index: ContextIndex,
    /// Chunks the call wrote, to put in the store first.
    pub(super) chunks: Vec<(ChunkRecord, Arc<Vec<u8>>)>,
    /// Chunks of the base revision the new one no longer names.
    pub(super) old_files: Vec<String>,
    /// Run once written, refused, or at the first failure to reach the store.
    pub(super) written: Option<Box<dyn FnOnce(WriteOutcome) + Send>>,
}

enum Job {
    Commit(Box<Commit>),
    Release { id: String, token: String },
}

/// What the write-back has done, for /metrics.
#[derive(Clone, Copy, Debug, Default)]
pub struct WriteBackCounters {
    pub committed: u64,
    /// Calls whose write was refused: another call wrote the context after this one's lease
    /// was lost (the store keeps the other call's; this one's answer is not part of it).
    pub conflicts: u64,
    pub retries: u64,
    pub chunks_put: u64,
    /// Chunks dropped to keep `--context-store-max-bytes`.
    pub chunks_evicted: u64,
    pub leases_lost: u64,
}

#[derive(Default)]
struct State {
    /// Commits queued or under way, by context.
    pending: HashMap<String, usize>,
    /// Held leases: token → context.
    held: HashMap<String, String>,
    counters: WriteBackCounters,
    /// Chunk bytes in the store after this replica's last write.
    chunk_bytes: Option<u64>,
}

pub(super) struct WriteBack {
    tx: mpsc::Sender<Job>,
    state: Arc<Mutex<State>>,
}

const BACKOFF_FIRST: Duration = Duration::from_millis(50);
const BACKOFF_MAX: Duration = Duration::from_secs(2);

impl WriteBack {
    pub(super) fn start(store: Weak<SharedStore>, ttl: Duration) -> WriteBack {
        let (tx, rx) = mpsc::channel();
        let state = Arc::new(Mutex::new(State::default()));
        let st = state.clone();
        let spawned = std::thread::Builder::new()
            .name("context-store".into())
            .spawn(move || run(store, rx, st, ttl / 3));
        if let Err(e) = spawned {
            tracing::error!("cannot start the context store's write-back thread: {e}");
        }
        WriteBack { tx, state }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        lock(&self.state)
    }

    pub(super) fn hold(&self, id: &str, token: &str) {
        self.lock().held.insert(token.into(), id.into());
    }

    pub(super) fn commit(&self, c: Commit) {
        *self.lock().pending.entry(c.id.clone()).or_default() += 1;
        let id = c.id.clone();
        if let Err(mpsc::SendError(job)) = self.tx.send(Job::Commit(Box::new(c))) {
            tracing::error!("context {id}: the write-back thread has stopped; not written");
            if let Job::Commit(mut c) = job
                && let Some(w) = c.written.take()
            {
                w(WriteOutcome::Refused(
                    "the write-back thread has stopped".into(),
                ));
            }
            settle(&self.state, &id, None);
        }
    }

    pub(super) fn release(&self, id: &str, token: &str) {
        self.lock().held.remove(token);
        self.tx
            .send(Job::Release {
                id: id.into(),
                token: token.into(),
            })
            .ok();
    }

    /// Commits of context `id` not yet written.
    pub(super) fn pending(&self, id: &str) -> usize {
        self.lock().pending.get(id).copied().unwrap_or(0)
    }

    pub(super) fn pending_total(&self) -> usize {
        self.lock().pending.values().sum()
    }

    pub(super) fn counters(&self) -> WriteBackCounters {
        self.lock().counters
    }

    pub(super) fn chunk_bytes(&self) -> Option<u64> {
        self.lock().chunk_bytes
    }
}

/// A commit of `id` is done: no longer pending, its lease (`token`) no longer renewed.
fn settle(state: &Mutex<State>, id: &str, token: Option<&str>) {
    let mut s = lock(state);
    if let Some(n) = s.pending.get_mut(id) {
        *n -= 1;
        if *n == 0 {
            s.pending.remove(id);
        }
    }
    if let Some(t) = token {
        s.held.remove(t);
    }
}

fn run(
    store: Weak<SharedStore>,
    rx: mpsc::Receiver<Job>,
    state: Arc<Mutex<State>>,
    tick: Duration,
) {
    // Leases renewed and the store's health checked at least every second.
    let tick = tick.clamp(Duration::from_millis(50), Duration::from_secs(1));
    loop {
        let job = match rx.recv_timeout(tick) {
            Ok(j) => Some(j),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => return,
        };
        let Some(store) = store.upgrade() else {
            return;
        };
        renew_all(&store, &state);
        match job {
            None => {
                // Idle: a PING keeps /health's view of the store current.
                store.ping();
            }
            Some(Job::Release { id, token }) => {
                // An unreachable store lets the lease expire on its own.
                if let Err(e) = store.release(&id, &token) {
                    tracing::warn!("context {id}: giving the lease back: {e} (it expires)");
                }
            }
            Some(Job::Commit(mut c)) => {
                let mut wait = BACKOFF_FIRST;
                let mut written = c.written.take();
                loop {
                    let r = write(&store, &c, &state);
                    // The caller hears of it now, whatever happened: written, refused, or the
                    // store unreachable (then this keeps trying behind the answer).
                    if let Some(w) = written.take() {
                        w(match &r {
                            Ok(o) => o.clone(),
                            Err(SharedError::Unreachable { .. } | SharedError::Auth { .. }) => {
                                WriteOutcome::Retrying
                            }
                            Err(e) => WriteOutcome::Refused(e.to_string()),
                        });
                    }
                    match r {
                        Ok(outcome) => {
                            let mut s = lock(&state);
                            match outcome {
                                WriteOutcome::Refused(_) => s.counters.conflicts += 1,
                                _ => s.counters.committed += 1,
                            }
                            break;
                        }
                        Err(e @ (SharedError::Unreachable { .. } | SharedError::Auth { .. })) => {
                            tracing::warn!("context {}: writing back: {e}; retrying", c.id);
                            lock(&state).counters.retries += 1;
                            std::thread::sleep(wait);
                            wait = (wait * 2).min(BACKOFF_MAX);
                            renew_all(&store, &state);
                        }
                        Err(e) => {
                            tracing::error!("context {}: not written back: {e}", c.id);
                            break;
                        }
                    }
                }
                settle(&state, &c.id, Some(&c.token));
            }
        }
    }
}

fn lock(state: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    state.lock().unwrap_or_else(|e| e.into_inner())
}

/// Renew every held lease; one found lost is dropped from the list (its commit will be refused
/// if another call wrote the context meanwhile).
fn renew_all(store: &SharedStore, state: &Mutex<State>) {
    let held: Vec<(String, String)> = lock(state)
        .held
        .iter()
        .map(|(t, i)| (t.clone(), i.clone()))
        .collect();
    for (token, id) in held {
        match store.renew(&id, &token) {
            Ok(true) => {}
            Ok(false) => {
                tracing::warn!("context {id}: lease {token} expired before its call was written");
                let mut s = lock(state);
                s.held.remove(&token);
                s.counters.leases_lost += 1;
            }
            // Unreachable: tried again at the next tick.
            Err(_) => return,
        }
    }
}

/// One attempt at writing `c` (every step may be repeated: chunks are named by content):
/// stored, or refused because another call wrote the context meanwhile (counted by the caller
/// once the outcome is final).
fn write(
    store: &SharedStore,
    c: &Commit,
    state: &Mutex<State>,
) -> Result<WriteOutcome, SharedError> {
    store.put_chunks(&c.id, &c.chunks)?;
    lock(state).counters.chunks_put += c.chunks.len() as u64;
    // Chunks the call did not write must already be in the store; any that is not (evicted)
    // is recomputed by whoever restores the context.
    let mut index = c.index.clone();
    let others: Vec<(usize, String)> = index
        .chunks
        .iter()
        .enumerate()
        .filter_map(|(i, r)| r.as_ref().map(|r| (i, r.file.clone())))
        .filter(|(_, f)| !c.chunks.iter().any(|(r, _)| &r.file == f))
        .collect();
    let names: Vec<String> = others.iter().map(|(_, f)| f.clone()).collect();
    for ((i, _), held) in others.iter().zip(store.has_chunks(&c.id, &names)?) {
        if !held {
            index.chunks[*i] = None;
        }
    }
    TEST_STORE_DELAY.pause();
    let outcome = if store.switch_index(&c.token, &c.base_stamp, &index)? {
        store.drop_chunks(&c.id, &c.old_files)?;
        let (evicted, bytes) = store.evict()?;
        let mut s = lock(state);
        s.counters.chunks_evicted += evicted as u64;
        s.chunk_bytes = Some(bytes);
        WriteOutcome::Stored
    } else {
        // The chunks only this call named are dropped; the other call's are kept.
        let current = store.index(&c.id)?;
        let orphans: Vec<String> = c
            .chunks
            .iter()
            .map(|(r, _)| r.file.clone())
            .filter(|f| {
                current
                    .as_ref()
                    .is_none_or(|i| !i.chunk_files().any(|n| n == f))
            })
            .collect();
        store.drop_chunks(&c.id, &orphans)?;
        let why = match current {
            Some(_) => format!(
                "this call's result was not kept: context '{}' was written by another call \
                 after this call's lease expired; the conversation is as that call left it",
                c.id
            ),
            None => format!(
                "this call's result was not kept: context '{}' is no longer in the store \
                 (deleted, or the store lost it)",
                c.id
            ),
        };
        tracing::warn!("context {} (revision {}): {why}", c.id, c.index.revision);
        WriteOutcome::Refused(why)
    };
    store.release(&c.id, &c.token)?;
    Ok(outcome)
}

/// Fault injection for tests: holds every write-back between its chunks and its index switch,
/// so a test can stop the store in the middle of one.
static TEST_STORE_DELAY: TestDelay = TestDelay::new("GPU_OFFLOAD_TEST_STORE_DELAY_MS");
