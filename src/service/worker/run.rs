//! The engine thread's loop: take what the channel brings (control requests answered at once),
//! admit, step every running sequence, write contexts ahead when idle, keep the gauges — until
//! the channel closes or a shutdown has let the running calls finish.

use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use super::Worker;
use super::slot::Holder;
use crate::backend::Backend;
use crate::kv::CHUNK_TOKENS;
use crate::service::api::ApiError;
use crate::service::messages::{Event, Request};

impl<B: Backend> Worker<B> {
    /// Serve until the request channel closes or shutdown is asked and everything is finished.
    pub fn run(mut self, rx: Receiver<Request>) {
        let mut shutdown_at: Option<Instant> = None;
        loop {
            // Take everything waiting; control requests are answered at once.
            loop {
                let msg =
                    if self.active.is_empty() && self.pending.is_empty() && shutdown_at.is_none() {
                        match rx.recv_timeout(Duration::from_millis(50)) {
                            Ok(m) => Some(m),
                            Err(RecvTimeoutError::Timeout) => None,
                            Err(RecvTimeoutError::Disconnected) => return self.flush(),
                        }
                    } else {
                        rx.try_recv().ok()
                    };
                match msg {
                    Some(m) => self.take(m),
                    None => break,
                }
            }
            if self.shared.shutdown.load(Ordering::SeqCst) && shutdown_at.is_none() {
                shutdown_at = Some(Instant::now() + self.cfg.shutdown_grace);
            }
            if shutdown_at.is_some() {
                while let Some(g) = self.pending.pop_front() {
                    self.shared.waiting.fetch_sub(1, Ordering::SeqCst);
                    g.events
                        .send(Event::Error(ApiError::unavailable(
                            "the server is shutting down",
                        )))
                        .ok();
                }
            }
            self.admit();
            self.step_all(shutdown_at.is_some_and(|t| Instant::now() >= t));
            if self.active.is_empty() && self.pending.is_empty() {
                // Idle: the ahead-of-time swap-outs held back while calls were waiting.
                for i in 0..self.slots.len() {
                    self.write_ahead(i);
                }
            }
            self.update_gauges();
            if shutdown_at.is_some() && self.active.is_empty() {
                return self.flush();
            }
        }
    }

    fn flush(mut self) {
        // Contexts are written when the engine falls idle; a last pass catches anything left.
        for i in 0..self.slots.len() {
            if let Holder::Context(id) = self.slots[i].holder.clone()
                && let Err(e) = self
                    .kv
                    .swap_out(&self.engine, &mut self.slots[i].session, &id)
            {
                tracing::warn!("flushing context {id}: {e}");
            }
        }
        tracing::info!("engine thread stopped; {} contexts kept", self.kv.len());
    }

    fn take(&mut self, m: Request) {
        match m {
            Request::Generate(g) => self.pending.push_back(g),
            Request::CreateContext {
                owner,
                system_prompt,
                reply,
            } => {
                reply.send(self.create_context(owner, system_prompt)).ok();
            }
            Request::GetContext { id, owner, reply } => {
                reply.send(self.get_context(&id, owner.as_deref())).ok();
            }
            Request::DeleteContext { id, owner, reply } => {
                reply.send(self.delete_context(id, owner)).ok();
            }
        }
    }

    pub(super) fn update_gauges(&self) {
        let m = &self.shared.metrics;
        m.queue_depth
            .set(self.shared.waiting.load(Ordering::SeqCst) as i64);
        let device: usize = self
            .slots
            .iter()
            .filter_map(|s| match &s.holder {
                Holder::Context(_) => Some(s.session.position().div_ceil(CHUNK_TOKENS)),
                _ => None,
            })
            .sum();
        let dram: usize = self.kv.contexts().map(|c| c.chunks_in_dram()).sum();
        let disk: usize = self.kv.contexts().map(|c| c.chunks_on_disk()).sum();
        m.kv_chunks
            .with_label_values(&["device"])
            .set(device as i64);
        m.kv_chunks.with_label_values(&["dram"]).set(dram as i64);
        m.kv_chunks.with_label_values(&["disk"]).set(disk as i64);
        m.kv_dram_bytes.set(self.kv.dram_bytes() as i64);
        if let Some(p) = self.engine.pool_usage() {
            m.kv_pool_blocks
                .with_label_values(&["free"])
                .set(p.free as i64);
            m.kv_pool_blocks
                .with_label_values(&["used"])
                .set((p.total - p.free) as i64);
        }
        m.contexts.set(self.kv.len() as i64);
        let (recorded, replayed) = self.engine.recorded_steps();
        for (event, v) in [("recorded", recorded), ("replayed", replayed)] {
            m.decode_steps_recorded
                .with_label_values(&[event])
                .set(v as i64);
        }
        let k = self.kv.counters;
        m.set_kv_counters(&k);
        // Last: a reader who sees the sequences gone sees what they held gone too.
        m.active.set(self.active.len() as i64);
    }
}
