//! What goes wrong in a forward pass, and the engine's `Result`: the bottom of the engine room,
//! returned by everything in it and by the weight sources other rooms give it.

use thiserror::Error;

use crate::backend::{BackendError, KV_BLOCK};

#[derive(Debug, Error)]
pub enum EngineError {
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error("{needed} tokens do not fit in the context of {ctx} tokens")]
    ContextFull { needed: usize, ctx: usize },
    #[error("token id {id} is outside the vocabulary of {vocab} tokens")]
    InvalidToken { id: u32, vocab: usize },
    #[error("nothing to evaluate: no tokens given")]
    Empty,
    #[error("context size {requested} exceeds the model's maximum of {max} positions")]
    ContextTooLarge { requested: usize, max: usize },
    #[error("weights: {0}")]
    Weights(String),
    #[error(
        "the KV pool is full: {needed} more blocks of {KV_BLOCK} positions needed, {free} free of {total}"
    )]
    KvPoolFull {
        needed: usize,
        free: usize,
        total: usize,
    },
}

pub type Result<T> = std::result::Result<T, EngineError>;
