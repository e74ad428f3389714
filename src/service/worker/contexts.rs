//! Contexts on the engine thread: the API's create, get and delete (never one a running call
//! uses), and a slot's context written ahead of time (its changed chunks swapped out).

use serde_json::{Value, json};

use super::Worker;
use super::errors::kv_error;
use super::slot::Holder;
use crate::backend::Backend;
use crate::kv::Bits;
use crate::service::api::ApiError;

impl<B: Backend> Worker<B> {
    /// A new context of `owner`, as the API shows it.
    pub(super) fn create_context(
        &mut self,
        owner: Option<String>,
        system_prompt: Option<String>,
    ) -> Result<Value, ApiError> {
        self.kv
            .create(owner.clone(), system_prompt)
            .map_err(kv_error)
            .and_then(|id| self.context_json(&id, owner.as_deref()))
    }

    /// Delete context `id` of `owner`: refused while a call runs on it.
    pub(super) fn delete_context(
        &mut self,
        id: String,
        owner: Option<String>,
    ) -> Result<Value, ApiError> {
        let busy = self
            .active
            .iter()
            .any(|s| s.job.context.as_deref() == Some(id.as_str()));
        if busy {
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
        }
    }

    /// Write slot `i`'s context's changed chunks (ahead-of-time swap-out), if it has any.
    pub(super) fn write_ahead(&mut self, i: usize) {
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

    pub(super) fn context_json(&self, id: &str, owner: Option<&str>) -> Result<Value, ApiError> {
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
}
