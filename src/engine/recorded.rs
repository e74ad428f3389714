//! Recorded decode steps (a CUDA graph): a session's one-token step recorded once and replayed
//! while no device allocation has been taken since; steps that hold anything but kernels run
//! plainly.

use super::ports::WeightSource;
use super::scratch::Scratch;
use super::session::{Recorded, Session, SessionKv};
use super::{Engine, Result};
use crate::backend::Backend;

impl<B: Backend> Engine<B> {
    /// Record a session's one-token decode step once and replay it from then on, where the
    /// backend records steps (CUDA: a graph, launched in one call instead of one launch per
    /// kernel; the budgeted device runs the ops and checks each replay against the recording).
    /// Steps that hold anything but kernels run as before: streamed or CPU-side weights,
    /// host-kept KV, activation taps and predicted masks. A session's density probe takes its
    /// query from a fixed row the recording writes.
    pub fn with_recorded_steps(mut self, on: bool) -> Self {
        self.record_steps = on;
        self
    }

    /// Whether one-token decode steps are recorded ([`Engine::with_recorded_steps`]).
    pub fn records_decode_steps(&self) -> bool {
        self.record_steps
    }

    /// Decode steps recorded, and replayed, so far.
    pub fn recorded_steps(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering;
        (
            self.steps_recorded.load(Ordering::Relaxed),
            self.steps_replayed.load(Ordering::Relaxed),
        )
    }

    /// Whether this step of `session` (`n` rows, `rows` of logits) is recorded or replayed: a
    /// one-token decode step of kernels only (see [`Engine::with_recorded_steps`]).
    pub(super) fn records(
        &self,
        session: &Session<B>,
        source: &dyn WeightSource<B>,
        n: usize,
        rows: usize,
        on_cpu: bool,
    ) -> bool {
        self.record_steps
            && self.backend.records_steps()
            && n == 1
            && rows == 1
            && !on_cpu
            && !matches!(session.recorded, Recorded::Refused)
            && matches!(session.kv, SessionKv::Device { .. } | SessionKv::Paged(_))
            && self.step_tap.is_none()
            && self.tap.is_none()
            && self.predictor.is_none()
            && source.fixed()
    }

    /// A one-token decode step through its recording: replayed where one is held and no
    /// allocation has been taken since; else recorded where a plain step ran last with none
    /// after it; else run plainly. The step buffers are held (`sc`, its logits and workspace
    /// set) before this. The token is embedded before the recorded ops (its id, or its row,
    /// comes from the host), and the position goes to the device as the step's.
    pub(super) fn recorded_step(
        &self,
        source: &mut dyn WeightSource<B>,
        session: &mut Session<B>,
        sc: &mut Scratch<B>,
        tokens: &[u32],
    ) -> Result<Vec<f32>> {
        use std::sync::atomic::Ordering;
        let b = &self.backend;
        let pos = session.pos;
        if let SessionKv::Paged(p) = &mut session.kv {
            self.sync_table(p)?;
        }
        source.embed(b, tokens, pos, &mut sc.x)?;
        // The position's device word is taken on first use (outside the plan: a budget with no
        // room left for it runs its steps plainly).
        let placed = b.set_step_position(pos);
        let now = b.allocations();
        let mut ops = |session: &mut Session<B>| -> Result<()> {
            // From the embedding: a recording that failed ran nothing on CUDA.
            sc.residual = false;
            for l in 0..self.spec.n_layers {
                {
                    let mut layer = source.layer(b, l)?;
                    self.attention_block(&mut layer, l, session, sc, (pos, None), false)?;
                    self.finish_layer(&mut layer, l, sc)?;
                }
                source.layer_done(b, l)?;
            }
            self.add_residual(sc)?;
            self.head_ops(source, sc, &[sc.n - 1])
        };
        let held = std::mem::replace(&mut session.recorded, Recorded::None);
        session.recorded = match (placed, held) {
            (Ok(()), Recorded::Held(rec, at)) if at == now => {
                b.replay(&rec, || ops(session))?;
                self.steps_replayed.fetch_add(1, Ordering::Relaxed);
                Recorded::Held(rec, at)
            }
            (Ok(()), Recorded::Ran(at)) if at == now => match b.record(|| ops(session)) {
                Ok(rec) => {
                    self.steps_recorded.fetch_add(1, Ordering::Relaxed);
                    Recorded::Held(rec, now)
                }
                Err(e) => {
                    // Nothing of a failed recording has run on CUDA; a budgeted device may have
                    // run part of it, which the plain step rewrites (the same rows).
                    tracing::info!("decode steps run unrecorded: {e}");
                    ops(session)?;
                    Recorded::Refused
                }
            },
            (Err(e), _) => {
                tracing::info!("decode steps run unrecorded: {e}");
                ops(session)?;
                Recorded::Refused
            }
            (Ok(()), _) => {
                ops(session)?;
                Recorded::Ran(b.allocations())
            }
        };
        // The staged queries into the ring, as a plain step would have put them there.
        if let Some(p) = &mut session.probe {
            let at = p.next;
            for (staged, ring) in p.staged.iter().zip(p.q.iter_mut()) {
                b.copy_rows(staged, 0, ring, at, 1)?;
            }
            let next = Self::probe_commit(session, pos, 1, at);
            if let Some(p) = &mut session.probe {
                p.next = next;
            }
        }
        session.pos += 1;
        self.head_read(sc, 1)
    }
}
