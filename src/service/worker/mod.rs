//! The engine thread: owns the engine, the device sessions (slots) and the contexts; admits
//! requests from a queue, prefills them, then decodes one token per active sequence in turn.
//! Nothing here knows HTTP: requests come in and events go out over channels
//! ([`crate::service::messages`]).
//!
//! [`Worker`] is the thread's state; its work is one file per concern: the loop (`run`),
//! admission (`admit`) with the prompt (`prompt`) and the slots and KV pool (`pool`), the
//! batched step (`step`), what a sequence sends (`stream`) and how it ends (`finish`), and
//! the contexts' API (`contexts`).

mod admit;
mod contexts;
pub(crate) mod errors;
mod finish;
mod pool;
mod prompt;
mod run;
mod sequence;
mod slot;
mod step;
mod stream;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use self::sequence::Sequence;
use self::slot::{Holder, Slot};
use crate::backend::Backend;
use crate::engine::{Engine, EngineError};
use crate::kv::KvManager;
use crate::model::Tokenizer;
use crate::service::Shared;
use crate::service::messages::Generate;

/// Settings of the engine thread.
pub struct WorkerConfig {
    pub parallel: usize,
    pub ctx: usize,
    pub max_prompt_tokens: usize,
    pub shutdown_grace: Duration,
}

/// The engine thread's state: the engine, its slots, the running and waiting calls.
pub struct Worker<B: Backend> {
    engine: Engine<B>,
    tok: Option<Arc<Tokenizer>>,
    kv: KvManager,
    slots: Vec<Slot<B>>,
    active: Vec<Sequence>,
    pending: VecDeque<Box<Generate>>,
    shared: Arc<Shared>,
    cfg: WorkerConfig,
    clock: u64,
}

impl<B: Backend> Worker<B> {
    pub fn new(
        engine: Engine<B>,
        tok: Option<Arc<Tokenizer>>,
        kv: KvManager,
        shared: Arc<Shared>,
        cfg: WorkerConfig,
    ) -> Result<Self, EngineError> {
        let mut slots = Vec::with_capacity(cfg.parallel);
        for _ in 0..cfg.parallel {
            let mut session = engine.new_session(cfg.ctx)?;
            engine.enable_probe(&mut session)?;
            slots.push(Slot {
                session,
                holder: Holder::Free,
                busy: false,
                last_use: 0,
                unwritten: false,
            });
        }
        let w = Worker {
            engine,
            tok,
            kv,
            slots,
            active: Vec::new(),
            pending: VecDeque::new(),
            shared,
            cfg,
            clock: 0,
        };
        // /metrics tells the pool's size from the first request on.
        w.update_gauges();
        Ok(w)
    }
}
