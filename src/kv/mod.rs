//! Persistent contexts (LLMS): a context's KV cache is cut into chunks of [`CHUNK_TOKENS`]
//! positions. While the context is on the device its chunks are exact; after a call (when the
//! server falls idle) the chunks it changed are compressed (width per chunk by attention
//! density, to a global ratio; exact, as the cache's own bytes, where decoding would cost more
//! than the bytes save), kept in DRAM under a budget (LCTRU eviction) and written to disk ahead
//! of time, so taking the device away from a context costs nothing. Bringing it back loads chunks while
//! recomputing others from their tokens, the split chosen by measured cost models.
//!
//! One file per concern: the chunk codes ([`chunk`]), the files ([`persist`]), widths and costs
//! ([`policy`]), one context (`context`), all of them (`manager`), writing chunks
//! (`swap_out`), bringing them back (`swap_in`) and measuring the cost models (`costs`).

pub mod chunk;
mod context;
mod costs;
mod manager;
pub mod persist;
pub mod policy;
pub mod shared;
mod swap_in;
mod swap_out;

use thiserror::Error;

use crate::engine::EngineError;
pub use chunk::{Bits, CHUNK_TOKENS, ChunkData};
pub use context::{Context, RestoreStats};
pub use costs::measure_costs;
pub use manager::{KvConfig, KvCounters, KvManager, unix_now};
use persist::PersistError;
pub use policy::{Compression, CostModel};
pub use shared::{
    Claim, Lease, SharedConfig, SharedError, SharedHealth, SharedStore, WriteBackCounters,
    WriteOutcome,
};
pub use swap_out::save_session;

#[derive(Debug, Error)]
pub enum KvError {
    #[error("no context {0}")]
    NotFound(String),
    #[error(
        "context {id} was saved under another model ({model_id}); it cannot be used with this one"
    )]
    OtherModel { id: String, model_id: String },
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Persist(#[from] PersistError),
    #[error(transparent)]
    Shared(#[from] shared::SharedError),
}

pub type Result<T> = std::result::Result<T, KvError>;
