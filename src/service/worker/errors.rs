//! How the contexts' and the engine's errors reach the client: as the API error each stands for.

use crate::engine::EngineError;
use crate::kv::{KvError, SharedError};
use crate::service::api::ApiError;

/// A context's error as the client hears it: not found, another model's (a conflict), else
/// the server's.
pub(super) fn kv_error(e: KvError) -> ApiError {
    match e {
        KvError::NotFound(id) => ApiError::not_found(format!("no context '{id}'")),
        e @ KvError::OtherModel { .. } => ApiError::conflict(e.to_string()),
        KvError::Shared(e) => shared_error(e),
        e => ApiError::internal(e.to_string()),
    }
}

/// The shared store's error as the client hears it: a context another call holds is a
/// conflict (after `--context-wait`), an unreachable store makes calls on contexts unavailable
/// (never served from a copy that may be stale).
pub(crate) fn shared_error(e: SharedError) -> ApiError {
    match e {
        SharedError::NotFound { id } => ApiError::not_found(format!("no context '{id}'")),
        e @ SharedError::Busy { .. } => ApiError::conflict(e.to_string()),
        e @ (SharedError::Unreachable { .. } | SharedError::Auth { .. }) => {
            ApiError::unavailable(format!("{e}; calls on contexts wait for it"))
        }
        e => ApiError::internal(e.to_string()),
    }
}

/// The engine's error as the client hears it: the request's fault where it asked for what
/// cannot be, else the server's.
pub(super) fn engine_error(e: EngineError) -> ApiError {
    match e {
        e @ (EngineError::ContextFull { .. }
        | EngineError::InvalidToken { .. }
        | EngineError::Empty) => ApiError::bad_request(e.to_string(), None),
        e => ApiError::internal(e.to_string()),
    }
}
