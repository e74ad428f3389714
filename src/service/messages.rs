//! What the HTTP side and the engine thread say to each other over their channels: requests in
//! ([`Request`], a [`Generate`] job), events out ([`Event`]). Plain data: neither side's
//! workings.

use std::time::Instant;

use serde_json::Value;
use tokio::sync::{mpsc::UnboundedSender, oneshot};

use super::api::{ApiError, GenerationRequest};
use crate::kv::Claim;

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
    /// With a shared context store: the call's lease on its context and the context as the
    /// store had it when the lease was taken (dropped unused, the lease is given back).
    pub claim: Option<Claim>,
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
