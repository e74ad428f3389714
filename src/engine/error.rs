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
    /// The forward pass produced NaN or infinity: weights or settings no model has. The run
    /// stops here rather than sample from them.
    #[error(
        "non-finite values (NaN or infinity) {0}: the model's weights or settings are not a \
         working model's"
    )]
    NonFinite(NonFiniteAt),
    #[error(
        "the KV pool is full: {needed} more blocks of {KV_BLOCK} positions needed, {free} free of {total}"
    )]
    KvPoolFull {
        needed: usize,
        free: usize,
        total: usize,
    },
}

/// Where a forward pass first produced non-finite values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NonFiniteAt {
    /// In the logits; where in the pass is not known (yet).
    Logits,
    /// In the hidden state after layer `0` (counted from 0).
    Layer(usize),
    /// In the head (output norm or output matrix): every layer's output was finite.
    Head,
}

impl std::fmt::Display for NonFiniteAt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NonFiniteAt::Logits => write!(f, "in the logits"),
            NonFiniteAt::Layer(l) => write!(f, "in the hidden state after layer {l}"),
            NonFiniteAt::Head => write!(
                f,
                "in the logits, from the head (output norm or output matrix): every layer's \
                 output was finite"
            ),
        }
    }
}

pub type Result<T> = std::result::Result<T, EngineError>;
