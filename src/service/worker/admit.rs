//! Admission: waiting requests start in order (calls on one context one after another, first
//! come first served when the KV pool has no room yet). Starting one checks it, builds its
//! prompt, reserves its pool blocks, takes a slot (reusing the context's or a shared prefix's
//! cache) and evaluates the prompt alone or lets it join the next step.

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::Worker;
use super::errors::{engine_error, kv_error};
use super::sequence::{Before, Sequence};
use super::slot::{Holder, common_prefix};
use crate::backend::{Backend, KV_BLOCK};
use crate::engine::{EngineError, Logits};
use crate::kv::KvError;
use crate::model::ChatMessage;
use crate::model::tokenizer::TextStream;
use crate::service::api::ApiError;
use crate::service::messages::{Event, Generate};

/// Why a request did not start.
enum NotStarted {
    /// The KV pool has no room for it while the running sequences may still grow: it waits.
    Wait,
    Failed(ApiError),
}

impl From<ApiError> for NotStarted {
    fn from(e: ApiError) -> Self {
        NotStarted::Failed(e)
    }
}

/// Where an admitted request's prompt is evaluated.
enum PromptPass {
    /// In the next step, beside the running sequences: no pass of its own.
    Joins,
    /// Already, in a pass of its own: the logits of its last token.
    Ran(Vec<f32>),
}

/// A request that started: its slot and pool blocks, its prompt, and how the prompt runs.
struct Started {
    slot: usize,
    pool_blocks: usize,
    pass: PromptPass,
    tokens: Vec<u32>,
    messages: Option<Vec<ChatMessage>>,
    /// Tokens of the prompt the slot's session already held (reused, not evaluated again).
    cached: usize,
    before: Option<Before>,
}

impl<B: Backend> Worker<B> {
    pub(super) fn admit(&mut self) {
        let mut i = 0;
        while i < self.pending.len() && self.active.len() < self.slots.len() {
            let busy_ctx = self.pending[i].context.as_ref().is_some_and(|c| {
                self.active
                    .iter()
                    .any(|s| s.job.context.as_ref() == Some(c))
            });
            if busy_ctx {
                // Calls on one context run one after another.
                i += 1;
                continue;
            }
            let Some(g) = self.pending.remove(i) else {
                break;
            };
            self.shared.waiting.fetch_sub(1, Ordering::SeqCst);
            if g.events.is_closed() {
                continue;
            }
            match self.start(g) {
                Ok(seq) => self.active.push(seq),
                Err((g, NotStarted::Wait)) => {
                    // First come, first served: nothing behind it starts before it.
                    self.pending.insert(i, g);
                    self.shared.waiting.fetch_add(1, Ordering::SeqCst);
                    break;
                }
                Err((g, NotStarted::Failed(e))) => {
                    g.events.send(Event::Error(e)).ok();
                }
            }
        }
    }

    fn start(&mut self, g: Box<Generate>) -> Result<Sequence, (Box<Generate>, NotStarted)> {
        match self.try_start(&g) {
            Ok(Started {
                slot,
                pool_blocks,
                pass,
                tokens,
                messages,
                cached,
                before,
            }) => {
                let prompt_tokens = tokens.len();
                let mut seq = Sequence {
                    slot,
                    pool_blocks,
                    joining: Some(cached),
                    sampler: Self::sampler(&g.request, 0),
                    prompt_logits: None,
                    logits: Vec::new(),
                    tokens,
                    prompt_tokens,
                    choice: 0,
                    generated: 0,
                    generated_total: 0,
                    before,
                    text: String::new(),
                    stream: self.tok.clone().map(TextStream::new),
                    messages,
                    last_token: Instant::now(),
                    job: g,
                };
                if let PromptPass::Ran(l) = pass {
                    Self::prompt_done(&self.shared, &mut seq, l);
                }
                Ok(seq)
            }
            Err(e) => Err((g, e)),
        }
    }

    fn try_start(&mut self, g: &Generate) -> Result<Started, NotStarted> {
        let vocab = self.engine.spec().vocab_size;
        Self::check_request(g, vocab)?;
        if let (Some(id), Some(claim)) = (&g.context, &g.claim) {
            // The context as the store has it, before anything here reads or writes it.
            self.sync_context(id, &claim.index)?;
        }
        let (tokens, messages) = self.prompt(g)?;
        self.check_prompt(g, &tokens, vocab)?;
        let pool_blocks = self.reserve_pool(g, &tokens)?;
        let (slot, anon_prefix) = self
            .pick_slot(g.context.as_deref(), &tokens)
            .ok_or_else(|| ApiError::internal("no free slot"))?;
        self.clock += 1;
        self.slots[slot].last_use = self.clock;
        if self.slots[slot].holder != g.context.clone().map_or(Holder::Free, Holder::Context) {
            // The slot goes to another holder: its context's chunks are written first.
            self.write_ahead(slot);
        }
        let (start, before) = match &g.context {
            Some(id) => {
                let (keep, before) = self.reuse_context(slot, id, g.owner.as_deref(), &tokens)?;
                (keep, Some(before))
            }
            None => {
                let keep = anon_prefix.min(tokens.len() - 1);
                self.slots[slot].session.truncate(keep);
                self.shared.metrics.prefix_reused.inc_by(keep as u64);
                (keep, None)
            }
        };
        self.shared
            .metrics
            .prompt_tokens
            .inc_by(tokens.len() as u64);
        self.slots[slot].busy = true;
        let pass = self.first_pass(g, slot, &tokens, start)?;
        Ok(Started {
            slot,
            pool_blocks,
            pass,
            tokens,
            messages,
            cached: start,
            before,
        })
    }

    /// What a request asks beside its prompt: biased tokens in the vocabulary, one answer on a
    /// context.
    fn check_request(g: &Generate, vocab: usize) -> Result<(), ApiError> {
        if let Some(&(t, _)) = g
            .request
            .penalties
            .bias
            .iter()
            .find(|&&(t, _)| t as usize >= vocab)
        {
            return Err(ApiError::bad_request(
                format!("'logit_bias' names token {t}, outside the vocabulary of {vocab} tokens"),
                Some("logit_bias"),
            ));
        }
        if g.context.is_some() && g.request.n > 1 {
            return Err(ApiError::bad_request(
                format!(
                    "'n' = {} on a context: a conversation continues with one answer",
                    g.request.n
                ),
                Some("n"),
            ));
        }
        Ok(())
    }

    /// The prompt is not empty, fits the server's limit and names only tokens of the
    /// vocabulary.
    fn check_prompt(&self, g: &Generate, tokens: &[u32], vocab: usize) -> Result<(), ApiError> {
        if tokens.is_empty() {
            return Err(ApiError::bad_request("the prompt is empty", Some("prompt")));
        }
        let limit = self.cfg.max_prompt_tokens.min(self.cfg.ctx);
        if tokens.len() > limit {
            return Err(ApiError::bad_request(
                format!(
                    "the prompt{} is {} tokens; this server takes at most {limit} (context size {})",
                    if g.context.is_some() {
                        " with the context's conversation"
                    } else {
                        ""
                    },
                    tokens.len(),
                    self.cfg.ctx
                ),
                Some(g.request.input.param()),
            ));
        }
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(ApiError::bad_request(
                format!("token id {t} is outside the vocabulary of {vocab} tokens"),
                Some("prompt"),
            ));
        }
        Ok(())
    }

    /// The blocks of the KV pool this sequence may come to hold: refused where the pool could
    /// never hold them, waiting where the running sequences may still take them.
    fn reserve_pool(&self, g: &Generate, tokens: &[u32]) -> Result<usize, NotStarted> {
        // The pool must hold what this sequence may grow to beside what the running ones may:
        // otherwise it waits (a sequence never runs out of blocks half way).
        let pool_blocks = (tokens.len() + g.request.max_tokens)
            .min(self.cfg.ctx)
            .div_ceil(KV_BLOCK);
        if let Some(pool) = self.engine.pool_usage() {
            if pool_blocks > pool.total {
                return Err(ApiError::bad_request(
                    format!(
                        "the prompt of {} tokens and max_tokens {} need {} positions of KV cache; this server's pool holds {} (--kv-pool-tokens)",
                        tokens.len(),
                        g.request.max_tokens,
                        pool_blocks * KV_BLOCK,
                        pool.total * KV_BLOCK
                    ),
                    Some("max_tokens"),
                )
                .into());
            }
            if self.pool_committed() + pool_blocks > pool.total {
                return Err(NotStarted::Wait);
            }
        }
        Ok(pool_blocks)
    }

    /// What a call reuses is the slot's; the blocks of every other idle slot may be taken for
    /// its prompt. Whether `e` was the pool running short and room was made.
    fn room(&mut self, e: &EngineError, slot: usize) -> bool {
        match e {
            EngineError::KvPoolFull { needed, .. } => self.make_room(*needed, Some(slot)),
            _ => false,
        }
    }

    /// Context `id` on `slot` (swapped in unless the slot holds it), cut back to what `tokens`
    /// share with its evaluated conversation: the tokens kept, and the context as it was.
    fn reuse_context(
        &mut self,
        slot: usize,
        id: &str,
        owner: Option<&str>,
        tokens: &[u32],
    ) -> Result<(usize, Before), ApiError> {
        if self.slots[slot].holder != Holder::Context(id.to_string()) {
            self.slots[slot].holder = Holder::Free;
            let mut stats = self
                .kv
                .swap_in(&self.engine, &mut self.slots[slot].session, id);
            if let Err(KvError::Engine(e)) = &stats
                && self.room(e, slot)
            {
                stats = self
                    .kv
                    .swap_in(&self.engine, &mut self.slots[slot].session, id);
            }
            let stats = stats.map_err(kv_error)?;
            self.shared.metrics.swap_in_seconds.observe(stats.seconds);
            self.slots[slot].holder = Holder::Context(id.to_string());
        }
        let c = self.kv.get_mut(id, owner).map_err(kv_error)?;
        let before = Before {
            tokens: c.index.tokens.clone(),
            messages: c.index.messages.clone(),
        };
        let keep = common_prefix(tokens, &c.index.tokens[..c.index.evaluated]);
        let keep = keep.min(tokens.len() - 1);
        if keep < c.index.evaluated {
            c.truncate_evaluated(keep);
        }
        self.slots[slot].session.truncate(keep);
        Ok((keep, before))
    }

    /// The prompt from `start` on: joining the next step where it is short enough, else
    /// evaluated now in a pass of its own (the slot freed again if that fails).
    fn first_pass(
        &mut self,
        g: &Generate,
        slot: usize,
        tokens: &[u32],
        start: usize,
    ) -> Result<PromptPass, NotStarted> {
        if tokens.len() - start <= self.joining_rows() {
            // The prompt joins the next step beside the running sequences: no pass of its own.
            if g.context.is_none() {
                self.slots[slot].holder = Holder::Anon(tokens.to_vec());
            }
            return Ok(PromptPass::Joins);
        }
        let mut logits = self.engine.forward(
            &mut self.slots[slot].session,
            &tokens[start..],
            Logits::Last,
        );
        if let Err(e) = &logits
            && self.room(e, slot)
        {
            logits = self.engine.forward(
                &mut self.slots[slot].session,
                &tokens[start..],
                Logits::Last,
            );
        }
        let s = &mut self.slots[slot];
        let logits = match logits {
            Ok(l) => l,
            Err(e) => {
                s.busy = false;
                s.holder = Holder::Free;
                return Err(engine_error(e).into());
            }
        };
        if g.context.is_none() {
            s.holder = Holder::Anon(tokens.to_vec());
        }
        Ok(PromptPass::Ran(logits))
    }
}
