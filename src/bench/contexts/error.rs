//! What the contexts benchmark can fail with: the engine's and the KV store's errors, a swap
//! file that cannot be read or written, and a run that is not what it claims (a context that
//! came back with the wrong length, times that are not the trace's).

use std::path::{Path, PathBuf};

use thiserror::Error;

use crate::engine::EngineError;
use crate::kv::KvError;

#[derive(Debug, Error)]
pub enum ContextsError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Kv(#[from] KvError),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, ContextsError>;

pub(super) fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> ContextsError + '_ {
    move |source| ContextsError::Io {
        path: path.to_path_buf(),
        source,
    }
}
