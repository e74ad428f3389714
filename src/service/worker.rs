//! The engine thread: owns the engine, the device sessions (slots) and the contexts; admits
//! requests from a queue, prefills them, then decodes one token per active sequence in turn.
//! Nothing here knows HTTP: requests come in and events go out over channels.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::sync::{mpsc::UnboundedSender, oneshot};

use super::Shared;
use super::api::{ApiError, GenerationRequest, Input};
use crate::backend::{Backend, KV_BLOCK};
use crate::engine::{Engine, EngineError, Logits, Sampled, Sampler, SamplerParams, Session};
use crate::kv::{Bits, CHUNK_TOKENS, KvError, KvManager};
use crate::model::tokenizer::TextStream;
use crate::model::{ChatMessage, Tokenizer};

/// What the HTTP side asks of the engine thread.
pub enum Request {
    Generate(Box<Generate>),
    CreateContext {
        owner: Option<String>,
        system_prompt: Option<String>,
        reply: oneshot::Sender<Result<Value, ApiError>>,
    },
    GetContext {
        id: String,
        owner: Option<String>,
        reply: oneshot::Sender<Result<Value, ApiError>>,
    },
    DeleteContext {
        id: String,
        owner: Option<String>,
        reply: oneshot::Sender<Result<Value, ApiError>>,
    },
}

pub struct Generate {
    pub request: GenerationRequest,
    pub context: Option<String>,
    pub owner: Option<String>,
    pub events: UnboundedSender<Event>,
    pub received: Instant,
}

/// What a generation reports, in order: `Start`, then per choice (0, 1, … `n - 1`, one after
/// another) `Token`… and `Finish`, then `Done`; or one `Error`.
#[derive(Debug)]
pub enum Event {
    Start {
        prompt_tokens: usize,
        cached_tokens: usize,
    },
    /// Text of choice `index` that became complete (it may lag a token behind when a character
    /// spans tokens), and the log-probabilities of the tokens sampled since the last `Token`
    /// (when the request asked for them).
    Token {
        index: usize,
        text: String,
        logprobs: Vec<TokenLogprob>,
    },
    Finish {
        index: usize,
        finish_reason: &'static str,
    },
    Done {
        prompt_tokens: usize,
        /// Over all choices.
        completion_tokens: usize,
    },
    Error(ApiError),
}

/// One sampled token's log-probability and the most likely alternatives (see
/// [`crate::engine::Sampled`] for which distribution).
#[derive(Clone, Debug)]
pub struct TokenLogprob {
    pub token: Piece,
    pub logprob: f32,
    pub top: Vec<(Piece, f32)>,
}

/// A token's text: its bytes, and them read as UTF-8 (lossily: a piece of a character).
#[derive(Clone, Debug)]
pub struct Piece {
    pub id: u32,
    pub text: String,
    pub bytes: Vec<u8>,
}

/// A context as it was before a call, restored when the call does not complete.
struct Before {
    tokens: Vec<u32>,
    messages: Vec<ChatMessage>,
}

#[derive(Clone, Debug, PartialEq)]
enum Holder {
    Free,
    /// A finished stateless request's tokens, kept for prefix reuse.
    Anon(Vec<u32>),
    /// A context. Its chunks are written ahead of time, when the engine falls idle after a
    /// call ([`Slot::unwritten`] until then): taking the slot away then costs nothing.
    Context(String),
}

struct Slot<B: Backend> {
    session: Session<B>,
    holder: Holder,
    busy: bool,
    last_use: u64,
    /// The held context changed since its chunks were last written: they are written when the
    /// engine falls idle, or before the slot goes to another holder, whichever comes first.
    unwritten: bool,
}

/// What a sequence does after sampling a token.
enum Next {
    Done(&'static str),
    /// Evaluate this token (in the step's batch).
    Eval(u32),
}

struct Sequence {
    slot: usize,
    /// Blocks of the KV pool this sequence may come to hold (its prompt and every token it may
    /// generate), counted against the pool when it was admitted.
    pool_blocks: usize,
    /// The prompt from this token on joins the next step (it has not started yet; the tokens
    /// before were already in its session).
    joining: Option<usize>,
    job: Box<Generate>,
    sampler: Sampler,
    logits: Vec<f32>,
    /// Prompt (the whole conversation for a context) followed by what the current choice
    /// generated.
    tokens: Vec<u32>,
    prompt_tokens: usize,
    /// The choice being generated (`0..n`); the next starts again from `prompt_logits`.
    choice: usize,
    prompt_logits: Option<Vec<f32>>,
    /// By the current choice, and by all choices.
    generated: usize,
    generated_total: usize,
    /// A context's conversation before this call.
    before: Option<Before>,
    text: String,
    stream: Option<TextStream<Arc<Tokenizer>>>,
    /// Chat on a context: its messages so far (the assistant's reply is added at the end).
    messages: Option<Vec<ChatMessage>>,
    last_token: Instant,
}

pub struct WorkerConfig {
    pub parallel: usize,
    pub ctx: usize,
    pub max_prompt_tokens: usize,
    pub shutdown_grace: Duration,
}

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

/// Fault injection for tests: `GPU_OFFLOAD_TEST_STEP_DELAY_MS` slows every decode step, so a
/// test can hang up while a call is surely under way.
fn test_step_delay() -> Option<Duration> {
    static DELAY: std::sync::OnceLock<Option<Duration>> = std::sync::OnceLock::new();
    *DELAY.get_or_init(|| {
        std::env::var("GPU_OFFLOAD_TEST_STEP_DELAY_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .map(Duration::from_millis)
    })
}

/// Which idle slot gives up its session first (a new request, pool pressure): free ones, then
/// stateless prefixes, then contexts (whose chunks are all written: LCTRU's least recently used
/// context), least recently used first within each.
fn eviction_rank(h: &Holder, last_use: u64) -> (u8, u64) {
    let rank = match h {
        Holder::Free => 0,
        Holder::Anon(_) => 1,
        Holder::Context(_) => 2,
    };
    (rank, last_use)
}

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

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

fn kv_error(e: KvError) -> ApiError {
    match e {
        KvError::NotFound(id) => ApiError::not_found(format!("no context '{id}'")),
        e @ KvError::OtherModel { .. } => ApiError::conflict(e.to_string()),
        e => ApiError::internal(e.to_string()),
    }
}

fn engine_error(e: EngineError) -> ApiError {
    match e {
        e @ (EngineError::ContextFull { .. }
        | EngineError::InvalidToken { .. }
        | EngineError::Empty) => ApiError::bad_request(e.to_string(), None),
        e => ApiError::internal(e.to_string()),
    }
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

    /// Write slot `i`'s context's changed chunks (ahead-of-time swap-out), if it has any.
    fn write_ahead(&mut self, i: usize) {
        let slot = &mut self.slots[i];
        if !std::mem::take(&mut slot.unwritten) {
            return;
        }
        if let Holder::Context(id) = &slot.holder
            && let Err(e) = self.kv.swap_out(&self.engine, &mut slot.session, id)
        {
            // Its chunks after the last write are recomputed from its tokens when it returns.
            tracing::warn!("swap-out of context {id}: {e}");
            slot.holder = Holder::Free;
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
                let r = self
                    .kv
                    .create(owner.clone(), system_prompt)
                    .map_err(kv_error)
                    .and_then(|id| self.context_json(&id, owner.as_deref()));
                reply.send(r).ok();
            }
            Request::GetContext { id, owner, reply } => {
                reply.send(self.context_json(&id, owner.as_deref())).ok();
            }
            Request::DeleteContext { id, owner, reply } => {
                let busy = self
                    .active
                    .iter()
                    .any(|s| s.job.context.as_deref() == Some(id.as_str()));
                let r = if busy {
                    // The caller owns it (else 404 below); refuse while a call runs on it.
                    self.kv
                        .get(&id, owner.as_deref())
                        .map_err(kv_error)
                        .and_then(|_| {
                            Err(ApiError::conflict(format!(
                                "context '{id}' is in use by a running request"
                            )))
                        })
                } else {
                    self.kv
                        .delete(&id, owner.as_deref())
                        .map_err(kv_error)
                        .map(|()| {
                            for s in &mut self.slots {
                                if s.holder == Holder::Context(id.clone()) {
                                    s.holder = Holder::Free;
                                    s.unwritten = false;
                                }
                            }
                            json!({"id": id, "object": "context.deleted", "deleted": true})
                        })
                };
                reply.send(r).ok();
            }
        }
    }

    fn context_json(&self, id: &str, owner: Option<&str>) -> Result<Value, ApiError> {
        let c = self.kv.get(id, owner).map_err(kv_error)?;
        let bits = c.chunk_bits();
        let count = |b: Bits| bits.iter().filter(|x| **x == Some(b)).count();
        let resident = self
            .slots
            .iter()
            .any(|s| s.holder == Holder::Context(id.to_string()));
        Ok(json!({
            "id": id,
            "object": "context",
            "created": c.index.created,
            "system_prompt": c.index.system_prompt,
            "messages": c.index.messages,
            "tokens": c.index.tokens.len(),
            "token_ids": c.index.tokens,
            "evaluated_tokens": c.index.evaluated,
            "resident": resident,
            "chunks": {
                "total": bits.len(),
                "in_dram": c.chunks_in_dram(),
                "on_disk": c.chunks_on_disk(),
                "bits": {"8": count(Bits::Q8), "4": count(Bits::Q4), "2": count(Bits::Q2), "16": count(Bits::F16), "32": count(Bits::F32)},
            },
            "lost_chunks_at_load": c.lost_at_load,
            "last_restore": c.last_restore,
        }))
    }

    fn admit(&mut self) {
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

    fn tokenizer(&self) -> Result<Arc<Tokenizer>, ApiError> {
        self.tok.clone().ok_or_else(|| {
            ApiError::bad_request(
                "this model has no tokenizer: send the prompt as token ids",
                Some("prompt"),
            )
        })
    }

    /// The conversation in the model's chat template, or ChatML when it has none (as llama.cpp).
    fn render_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, ApiError> {
        let tok = self.tokenizer()?;
        let (text, chatml) = tok
            .apply_chat_template_or_chatml(messages, true)
            .map_err(|e| ApiError::bad_request(format!("chat: {e}"), Some("messages")))?;
        // A model's own template writes the BOS text itself when the model wants one; ChatML
        // does not, so the tokenizer adds it.
        tok.encode(&text, chatml, true)
            .map_err(|e| ApiError::bad_request(e.to_string(), Some("messages")))
    }

    /// The sampler of choice `index`: seeded with `seed + index`.
    fn sampler(request: &GenerationRequest, index: usize) -> Sampler {
        let params = SamplerParams {
            seed: request.sampler.seed.wrapping_add(index as u64),
            ..request.sampler.clone()
        };
        Sampler::with_penalties(params, request.penalties.clone())
    }

    fn logprob(&self, s: &Sampled) -> TokenLogprob {
        let piece = |id: u32| {
            let bytes = self
                .tok
                .as_ref()
                .map(|t| t.token_bytes(id, false))
                .unwrap_or_default();
            Piece {
                id,
                text: String::from_utf8_lossy(&bytes).into_owned(),
                bytes,
            }
        };
        TokenLogprob {
            token: piece(s.token),
            logprob: s.logprob,
            top: s.top.iter().map(|&(t, lp)| (piece(t), lp)).collect(),
        }
    }

    fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>, ApiError> {
        self.tokenizer()?
            .encode(text, add_special, true)
            .map_err(|e| ApiError::bad_request(e.to_string(), Some("prompt")))
    }

    /// The tokens the request continues, and for a chat on a context its messages.
    fn prompt(&self, g: &Generate) -> Result<(Vec<u32>, Option<Vec<ChatMessage>>), ApiError> {
        let input = &g.request.input;
        let Some(id) = &g.context else {
            return Ok(match input {
                Input::Text(t) => (self.encode(t, true)?, None),
                Input::Tokens(t) => (t.clone(), None),
                Input::Chat(m) => (self.render_chat(m)?, None),
            });
        };
        let c = self.kv.get(id, g.owner.as_deref()).map_err(kv_error)?;
        let idx = &c.index;
        Ok(match input {
            Input::Chat(new) => {
                let mut messages = idx.messages.clone();
                if messages.is_empty()
                    && let Some(s) = &idx.system_prompt
                {
                    messages.push(ChatMessage {
                        role: "system".into(),
                        content: s.clone(),
                    });
                }
                messages.extend(new.iter().cloned());
                (self.render_chat(&messages)?, Some(messages))
            }
            Input::Text(t) => {
                let mut tokens = idx.tokens.clone();
                if tokens.is_empty() {
                    let first = format!("{}{t}", idx.system_prompt.as_deref().unwrap_or(""));
                    tokens = self.encode(&first, true)?;
                } else {
                    tokens.extend(self.encode(t, false)?);
                }
                (tokens, None)
            }
            Input::Tokens(t) => {
                let mut tokens = idx.tokens.clone();
                tokens.extend(t);
                (tokens, None)
            }
        })
    }

    /// Pick a free slot: the one already holding `context`, else the stateless one sharing
    /// the longest prefix with `tokens`, else empty, else least recently used.
    fn pick_slot(&self, context: Option<&str>, tokens: &[u32]) -> Option<(usize, usize)> {
        let free = || self.slots.iter().enumerate().filter(|(_, s)| !s.busy);
        if let Some(id) = context
            && let Some((i, _)) = free().find(|(_, s)| s.holder == Holder::Context(id.into()))
        {
            return Some((i, 0));
        }
        if context.is_none() {
            let best = free()
                .filter_map(|(i, s)| match &s.holder {
                    Holder::Anon(t) => Some((i, common_prefix(t, tokens))),
                    _ => None,
                })
                .max_by_key(|&(i, n)| (n, std::cmp::Reverse(i)));
            if let Some((i, n)) = best
                && n > 0
            {
                return Some((i, n));
            }
        }
        // Contexts are worth more than a stateless prefix: evict those last.
        free()
            .min_by_key(|(_, s)| eviction_rank(&s.holder, s.last_use))
            .map(|(i, _)| (i, 0))
    }

    /// The longest prompt (rest) that joins a step instead of running alone: what the step
    /// holds beside one token of every sequence; longer prompts run alone right away, layer by
    /// layer where the step cannot hold them (one pass of the weights for the whole prompt).
    fn joining_rows(&self) -> usize {
        let layout = self.engine.prefill();
        if layout.joins {
            layout.group.saturating_sub(self.cfg.parallel)
        } else {
            0
        }
    }

    /// Blocks of the KV pool the running sequences may come to hold.
    fn pool_committed(&self) -> usize {
        self.active.iter().map(|s| s.pool_blocks).sum()
    }

    /// Free at least `needed` blocks of the KV pool by taking idle slots' sessions away, in
    /// eviction order (never slot `keep`); a context's chunks are written first where they are
    /// not yet (ahead-of-time swap-out held back while calls ran), so it only needs swapping
    /// back in at its next call. Whether enough are free.
    fn make_room(&mut self, needed: usize, keep: Option<usize>) -> bool {
        let free = |w: &Self| w.engine.pool_usage().map_or(0, |u| u.free);
        let mut idle: Vec<usize> = (0..self.slots.len())
            .filter(|&i| {
                let s = &self.slots[i];
                !s.busy && Some(i) != keep && s.session.kv_blocks() > 0
            })
            .collect();
        idle.sort_by_key(|&i| eviction_rank(&self.slots[i].holder, self.slots[i].last_use));
        for i in idle {
            if free(self) >= needed {
                break;
            }
            self.write_ahead(i);
            let s = &mut self.slots[i];
            if let Holder::Context(id) = &s.holder {
                tracing::debug!("KV pool pressure: context {id} leaves the device");
                self.shared.metrics.pool_evictions.inc();
            }
            s.session.release();
            s.holder = Holder::Free;
        }
        free(self) >= needed
    }

    fn start(&mut self, g: Box<Generate>) -> Result<Sequence, (Box<Generate>, NotStarted)> {
        match self.try_start(&g) {
            Ok((slot, pool_blocks, logits, tokens, messages, cached, before)) => {
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
                if let Some(l) = logits {
                    Self::prompt_done(&self.shared, &mut seq, l);
                }
                Ok(seq)
            }
            Err(e) => Err((g, e)),
        }
    }

    #[allow(clippy::type_complexity)]
    fn try_start(
        &mut self,
        g: &Generate,
    ) -> Result<
        (
            usize,
            usize,
            Option<Vec<f32>>,
            Vec<u32>,
            Option<Vec<ChatMessage>>,
            usize,
            Option<Before>,
        ),
        NotStarted,
    > {
        let vocab = self.engine.spec().vocab_size;
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
            )
            .into());
        }
        if g.context.is_some() && g.request.n > 1 {
            return Err(ApiError::bad_request(
                format!(
                    "'n' = {} on a context: a conversation continues with one answer",
                    g.request.n
                ),
                Some("n"),
            )
            .into());
        }
        let (tokens, messages) = self.prompt(g)?;
        if tokens.is_empty() {
            return Err(ApiError::bad_request("the prompt is empty", Some("prompt")).into());
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
                Some(if matches!(g.request.input, Input::Chat(_)) {
                    "messages"
                } else {
                    "prompt"
                }),
            )
            .into());
        }
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(ApiError::bad_request(
                format!("token id {t} is outside the vocabulary of {vocab} tokens"),
                Some("prompt"),
            )
            .into());
        }
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
        let (slot, anon_prefix) = self
            .pick_slot(g.context.as_deref(), &tokens)
            .ok_or_else(|| ApiError::internal("no free slot"))?;
        // What the call reuses is the slot's; the blocks of every other idle slot may be
        // taken for its prompt.
        let room = |w: &mut Self, e: &EngineError| match e {
            EngineError::KvPoolFull { needed, .. } => w.make_room(*needed, Some(slot)),
            _ => false,
        };
        self.clock += 1;
        self.slots[slot].last_use = self.clock;
        if self.slots[slot].holder != g.context.clone().map_or(Holder::Free, Holder::Context) {
            // The slot goes to another holder: its context's chunks are written first.
            self.write_ahead(slot);
        }
        let mut before = None;
        let start = match &g.context {
            Some(id) => {
                if self.slots[slot].holder != Holder::Context(id.clone()) {
                    self.slots[slot].holder = Holder::Free;
                    let mut stats =
                        self.kv
                            .swap_in(&self.engine, &mut self.slots[slot].session, id);
                    if let Err(KvError::Engine(e)) = &stats
                        && room(self, e)
                    {
                        stats = self
                            .kv
                            .swap_in(&self.engine, &mut self.slots[slot].session, id);
                    }
                    let stats = stats.map_err(kv_error)?;
                    self.shared.metrics.swap_in_seconds.observe(stats.seconds);
                    self.slots[slot].holder = Holder::Context(id.clone());
                }
                let c = self.kv.get_mut(id, g.owner.as_deref()).map_err(kv_error)?;
                before = Some(Before {
                    tokens: c.index.tokens.clone(),
                    messages: c.index.messages.clone(),
                });
                let keep = common_prefix(&tokens, &c.index.tokens[..c.index.evaluated]);
                let keep = keep.min(tokens.len() - 1);
                if keep < c.index.evaluated {
                    c.truncate_evaluated(keep);
                }
                self.slots[slot].session.truncate(keep);
                keep
            }
            None => {
                let keep = anon_prefix.min(tokens.len() - 1);
                self.slots[slot].session.truncate(keep);
                self.shared.metrics.prefix_reused.inc_by(keep as u64);
                keep
            }
        };
        self.shared
            .metrics
            .prompt_tokens
            .inc_by(tokens.len() as u64);
        self.slots[slot].busy = true;
        if tokens.len() - start <= self.joining_rows() {
            // The prompt joins the next step beside the running sequences: no pass of its own.
            if g.context.is_none() {
                self.slots[slot].holder = Holder::Anon(tokens.clone());
            }
            return Ok((slot, pool_blocks, None, tokens, messages, start, before));
        }
        let mut logits = self.engine.forward(
            &mut self.slots[slot].session,
            &tokens[start..],
            Logits::Last,
        );
        if let Err(e) = &logits
            && room(self, e)
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
            s.holder = Holder::Anon(tokens.clone());
        }
        Ok((
            slot,
            pool_blocks,
            Some(logits),
            tokens,
            messages,
            start,
            before,
        ))
    }

    /// One engine step for every running sequence (continuous batching): each samples its
    /// next token, then the tokens to evaluate — those tokens, and the prompts of sequences
    /// just admitted — run in batched steps of at most the engine's step rows: the weights pass
    /// once for all of them, each call attends over its own cache, and each gets the logits it
    /// would get alone.
    fn step_all(&mut self, stop_now: bool) {
        if let Some(d) = test_step_delay() {
            std::thread::sleep(d);
        }
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
    fn prompt_done(shared: &Shared, seq: &mut Sequence, logits: Vec<f32>) {
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

    /// Sample one token for sequence `i` and send it: the token to evaluate next, or why the
    /// sequence is done.
    fn sample(&mut self, i: usize) -> Next {
        let seq = &mut self.active[i];
        if seq.job.events.is_closed() {
            return Next::Done("cancelled");
        }
        let sampled = seq.sampler.choose(&seq.logits, seq.job.request.logprobs);
        let next = sampled.token;
        let eog = self
            .tok
            .as_ref()
            .is_some_and(|t| t.is_end_of_generation(next));
        if eog && !seq.job.request.ignore_eos {
            return Next::Done("stop");
        }
        seq.tokens.push(next);
        seq.generated += 1;
        seq.generated_total += 1;
        self.shared.metrics.generated_tokens.inc();
        let now = Instant::now();
        if seq.generated > 1 {
            self.shared
                .metrics
                .inter_token
                .observe((now - seq.last_token).as_secs_f64());
        }
        seq.last_token = now;
        let mut piece = seq
            .stream
            .as_mut()
            .map(|s| s.push(next))
            .unwrap_or_default();
        let mut stop = None;
        if !seq.job.request.stop.is_empty() {
            let before = seq.text.len();
            seq.text.push_str(&piece);
            if let Some(cut) = seq
                .job
                .request
                .stop
                .iter()
                .filter_map(|s| seq.text.find(s.as_str()))
                .min()
            {
                seq.text.truncate(cut);
                piece = seq.text[before.min(cut)..].to_string();
                stop = Some("stop");
            }
        } else {
            seq.text.push_str(&piece);
        }
        let logprobs = if seq.job.request.logprobs.is_some() {
            let lp = self.logprob(&sampled);
            vec![lp]
        } else {
            Vec::new()
        };
        let seq = &mut self.active[i];
        if (!piece.is_empty() || !logprobs.is_empty())
            && seq
                .job
                .events
                .send(Event::Token {
                    index: seq.choice,
                    text: piece,
                    logprobs,
                })
                .is_err()
        {
            return Next::Done("cancelled");
        }
        if let Some(reason) = stop {
            return Next::Done(reason);
        }
        if seq.generated >= seq.job.request.max_tokens {
            return Next::Done("length");
        }
        let slot = &self.slots[seq.slot];
        if slot.session.position() >= slot.session.context_size() {
            return Next::Done("length");
        }
        Next::Eval(next)
    }

    /// Send what the text stream still holds of the current choice.
    fn flush_text(seq: &mut Sequence) {
        if let Some(rest) = seq.stream.as_mut().map(|s| s.finish())
            && !rest.is_empty()
            && seq.job.request.stop.is_empty()
        {
            seq.job
                .events
                .send(Event::Token {
                    index: seq.choice,
                    text: rest.clone(),
                    logprobs: Vec::new(),
                })
                .ok();
            seq.text.push_str(&rest);
        }
    }

    /// Choice `choice` of sequence `i` finished for `reason`: start the next from the prompt.
    fn next_choice(&mut self, i: usize, reason: &'static str) {
        let seq = &mut self.active[i];
        Self::flush_text(seq);
        seq.job
            .events
            .send(Event::Finish {
                index: seq.choice,
                finish_reason: reason,
            })
            .ok();
        seq.choice += 1;
        seq.generated = 0;
        seq.tokens.truncate(seq.prompt_tokens);
        seq.text.clear();
        seq.stream = self.tok.clone().map(TextStream::new);
        seq.sampler = Self::sampler(&seq.job.request, seq.choice);
        if let Some(l) = &seq.prompt_logits {
            seq.logits.clone_from(l);
        }
        self.slots[seq.slot].session.truncate(seq.prompt_tokens);
    }

    fn finish(&mut self, mut seq: Sequence, reason: &'static str) {
        Self::flush_text(&mut seq);
        let slot = &mut self.slots[seq.slot];
        slot.busy = false;
        let completed = !matches!(reason, "cancelled" | "error");
        if let Some(id) = seq.job.context.clone()
            && !completed
        {
            // A call that did not complete leaves the conversation as it was: its tokens and
            // messages, and on the device only what was evaluated of them before the call.
            if let (Ok(c), Some(b)) = (
                self.kv.get_mut(&id, seq.job.owner.as_deref()),
                seq.before.take(),
            ) {
                c.index.tokens = b.tokens;
                c.index.messages = b.messages;
                let keep = c.index.evaluated.min(c.index.tokens.len());
                c.truncate_evaluated(keep);
                slot.session.truncate(keep.min(slot.session.position()));
            }
            if let Err(e) = self.kv.save_conversation(&id) {
                tracing::warn!("saving context {id}: {e}");
            }
        } else if let Some(id) = seq.job.context.clone() {
            let pos = slot.session.position();
            if let Ok(c) = self.kv.get_mut(&id, seq.job.owner.as_deref()) {
                c.index.tokens = seq.tokens.clone();
                c.index.evaluated = pos.min(seq.tokens.len());
                if let Some(mut m) = seq.messages.take() {
                    m.push(ChatMessage {
                        role: "assistant".into(),
                        content: seq.text.clone(),
                    });
                    c.index.messages = m;
                }
            }
            // The conversation reaches the disk before the client hears the call is done.
            if let Err(e) = self.kv.save_conversation(&id) {
                tracing::warn!("saving context {id}: {e}");
            }
        } else if completed {
            let pos = slot.session.position();
            slot.holder = Holder::Anon(seq.tokens[..pos.min(seq.tokens.len())].to_vec());
        } else {
            // A client that hung up (or an error): its blocks go back to the pool at once.
            slot.session.release();
            slot.holder = Holder::Free;
        }
        if reason != "error" {
            seq.job
                .events
                .send(Event::Finish {
                    index: seq.choice,
                    finish_reason: reason,
                })
                .ok();
            seq.job
                .events
                .send(Event::Done {
                    prompt_tokens: seq.prompt_tokens,
                    completion_tokens: seq.generated_total,
                })
                .ok();
        }
        drop(seq.job.events);
        if seq.job.context.is_some() {
            // Ahead-of-time swap-out of the chunks this call changed: when the engine falls
            // idle (the run loop), so that calls already waiting do not wait for it too; before
            // then if the slot goes to another holder.
            self.slots[seq.slot].unwritten = true;
        }
    }

    fn update_gauges(&self) {
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
