//! A sequence: one running generation on its slot — its prompt and tokens, sampler, choices,
//! the text streamed so far — and what it does after each sampled token.

use std::sync::Arc;
use std::time::Instant;

use crate::engine::Sampler;
use crate::model::tokenizer::TextStream;
use crate::model::{ChatMessage, Tokenizer};
use crate::service::messages::Generate;

/// A context as it was before a call, restored when the call does not complete.
pub(super) struct Before {
    pub(super) tokens: Vec<u32>,
    pub(super) messages: Vec<ChatMessage>,
}

/// What a sequence does after sampling a token.
pub(super) enum Next {
    Done(&'static str),
    /// Evaluate this token (in the step's batch).
    Eval(u32),
}

/// One running generation.
pub(super) struct Sequence {
    pub(super) slot: usize,
    /// Blocks of the KV pool this sequence may come to hold (its prompt and every token it may
    /// generate), counted against the pool when it was admitted.
    pub(super) pool_blocks: usize,
    /// The prompt from this token on joins the next step (it has not started yet; the tokens
    /// before were already in its session).
    pub(super) joining: Option<usize>,
    pub(super) job: Box<Generate>,
    pub(super) sampler: Sampler,
    pub(super) logits: Vec<f32>,
    /// Prompt (the whole conversation for a context) followed by what the current choice
    /// generated.
    pub(super) tokens: Vec<u32>,
    pub(super) prompt_tokens: usize,
    /// The choice being generated (`0..n`); the next starts again from `prompt_logits`.
    pub(super) choice: usize,
    pub(super) prompt_logits: Option<Vec<f32>>,
    /// By the current choice, and by all choices.
    pub(super) generated: usize,
    pub(super) generated_total: usize,
    /// A context's conversation before this call.
    pub(super) before: Option<Before>,
    pub(super) text: String,
    pub(super) stream: Option<TextStream<Arc<Tokenizer>>>,
    /// Chat on a context: its messages so far (the assistant's reply is added at the end).
    pub(super) messages: Option<Vec<ChatMessage>>,
    pub(super) last_token: Instant,
}
