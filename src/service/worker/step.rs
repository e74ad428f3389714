//! One engine step for every running sequence (continuous batching): tokens sampled, the
//! calls cut into batched steps of the engine's step rows, the logits handed back, the finished
//! sequences ended or started on their next choice.

use super::Worker;
use super::errors::engine_error;
use super::sequence::{Next, Sequence};
use crate::backend::Backend;
use crate::engine::{EngineError, Session};
use crate::fault::TestDelay;
use crate::service::Shared;
use crate::service::messages::Event;

/// Fault injection for tests: slows every decode step, so a test can hang up while a call is
/// surely under way.
static TEST_STEP_DELAY: TestDelay = TestDelay::new("GPU_OFFLOAD_TEST_STEP_DELAY_MS");

impl<B: Backend> Worker<B> {
    /// One engine step for every running sequence (continuous batching): each samples its
    /// next token, then the tokens to evaluate — those tokens, and the prompts of sequences
    /// just admitted — run in batched steps of at most the engine's step rows: the weights pass
    /// once for all of them, each call attends over its own cache, and each gets the logits it
    /// would get alone.
    pub(super) fn step_all(&mut self, stop_now: bool) {
        TEST_STEP_DELAY.pause();
        let mut finish: Vec<Option<&'static str>> = Vec::with_capacity(self.active.len());
        let mut eval: Vec<(usize, Vec<u32>)> = Vec::new();
        for i in 0..self.active.len() {
            let seq = &self.active[i];
            finish.push(if stop_now {
                Some("cancelled")
            } else if let Some(from) = seq.joining {
                if seq.job.events.is_closed() {
                    Some("cancelled")
                } else {
                    eval.push((i, seq.tokens[from..seq.prompt_tokens].to_vec()));
                    None
                }
            } else {
                match self.sample(i) {
                    Next::Done(reason) => Some(reason),
                    Next::Eval(t) => {
                        eval.push((i, vec![t]));
                        None
                    }
                }
            });
        }
        // Calls in order, as many as the step's rows hold.
        let group = self.engine.prefill().group.max(1);
        let mut parts: Vec<&[(usize, Vec<u32>)]> = Vec::new();
        let (mut from, mut rows) = (0, 0);
        for (k, (_, toks)) in eval.iter().enumerate() {
            if rows + toks.len() > group && k > from {
                parts.push(&eval[from..k]);
                (from, rows) = (k, 0);
            }
            rows += toks.len();
        }
        if from < eval.len() {
            parts.push(&eval[from..]);
        }
        for part in parts {
            self.shared.metrics.batch_size.observe(part.len() as f64);
            let mut result = self.step_part(part);
            if let Err(EngineError::KvPoolFull { needed, .. }) = &result {
                // Idle slots hold the blocks the admitted sequences were promised.
                self.make_room(*needed, None);
                result = self.step_part(part);
            }
            match result {
                Ok(logits) => {
                    for ((i, _), l) in part.iter().zip(logits) {
                        let seq = &mut self.active[*i];
                        if seq.joining.is_some() {
                            if part.len() > 1 {
                                self.shared.metrics.prompts_joined.inc();
                            }
                            Self::prompt_done(&self.shared, seq, l);
                        } else {
                            seq.logits = l;
                        }
                    }
                }
                Err(e) => {
                    let e = engine_error(e);
                    for (i, _) in part {
                        self.active[*i]
                            .job
                            .events
                            .send(Event::Error(e.clone()))
                            .ok();
                        finish[*i] = Some("error");
                    }
                }
            }
        }
        let mut i = 0;
        while i < self.active.len() {
            match finish[i] {
                Some(reason @ ("stop" | "length"))
                    if self.active[i].choice + 1 < self.active[i].job.request.n =>
                {
                    self.next_choice(i, reason);
                    i += 1;
                }
                Some(reason) => {
                    let seq = self.active.swap_remove(i);
                    finish.swap_remove(i);
                    self.finish(seq, reason);
                }
                None => i += 1,
            }
        }
    }

    /// One batched engine step over `part`'s calls (sequence, tokens), each on its slot's
    /// session.
    fn step_part(&mut self, part: &[(usize, Vec<u32>)]) -> Result<Vec<Vec<f32>>, EngineError> {
        // The sessions of this part, in its order.
        let mut sessions: Vec<(usize, &mut Session<B>)> = self
            .slots
            .iter_mut()
            .enumerate()
            .filter_map(|(si, slot)| {
                part.iter()
                    .position(|&(i, _)| self.active[i].slot == si)
                    .map(|k| (k, &mut slot.session))
            })
            .collect();
        sessions.sort_by_key(|(k, _)| *k);
        let mut calls: Vec<(&mut Session<B>, &[u32])> = sessions
            .into_iter()
            .map(|(k, session)| (session, &part[k].1[..]))
            .collect();
        self.engine.step_many(&mut calls)
    }

    /// A sequence's prompt has been evaluated: it starts (the client hears so) from `logits`.
    pub(super) fn prompt_done(shared: &Shared, seq: &mut Sequence, logits: Vec<f32>) {
        let cached = seq.joining.take().unwrap_or(0);
        seq.job
            .events
            .send(Event::Start {
                prompt_tokens: seq.prompt_tokens,
                cached_tokens: cached,
            })
            .ok();
        shared
            .metrics
            .ttft
            .observe(seq.job.received.elapsed().as_secs_f64());
        if seq.job.request.n > 1 {
            seq.prompt_logits = Some(logits.clone());
        }
        seq.logits = logits;
    }
}
