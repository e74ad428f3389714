//! Contexts on the engine thread: the API's create, get and delete (never one a running call
//! uses), and a slot's context written ahead of time (its changed chunks swapped out).

use serde_json::{Value, json};

use super::Worker;
use super::errors::{kv_error, shared_error};
use super::slot::Holder;
use crate::backend::Backend;
use crate::kv::persist::ContextIndex;
use crate::kv::{Bits, Claim, SharedError, WriteOutcome};
use crate::service::api::ApiError;

impl<B: Backend> Worker<B> {
    /// A new context of `owner`, as the API shows it (with a shared store, stored there first:
    /// not created where the store cannot take it).
    pub(super) fn create_context(
        &mut self,
        owner: Option<String>,
        system_prompt: Option<String>,
    ) -> Result<Value, ApiError> {
        let id = self
            .kv
            .create(owner.clone(), system_prompt)
            .map_err(kv_error)?;
        if let Some(store) = self.kv.shared().cloned() {
            let stored = self
                .kv
                .get(&id, owner.as_deref())
                .map_err(kv_error)
                .and_then(|c| store.create(&c.index).map_err(shared_error));
            if let Err(e) = stored {
                self.kv.forget(&id);
                return Err(e);
            }
        }
        self.context_json(&id, owner.as_deref())
    }

    /// Make the store's copy of context `id` (`remote`) this replica's; sessions holding a
    /// stale copy give it up.
    pub(super) fn sync_context(&mut self, id: &str, remote: &ContextIndex) -> Result<(), ApiError> {
        if self.kv.adopt(remote.clone()).map_err(kv_error)? {
            self.release_holders(id);
        }
        Ok(())
    }

    /// Slots holding context `id` hold it no more (their copy is stale or gone).
    fn release_holders(&mut self, id: &str) {
        for s in &mut self.slots {
            if s.holder == Holder::Context(id.to_string()) {
                s.holder = Holder::Free;
                s.unwritten = false;
            }
        }
    }

    /// With a shared store and no call running on it here: context `id` as the store has it
    /// now (gone from here where the store no longer has it; as it is here while the store
    /// cannot be reached).
    fn refresh_context(&mut self, id: &str) -> Result<(), ApiError> {
        let Some(store) = self.kv.shared().cloned() else {
            return Ok(());
        };
        // A call running here, or one not yet written back: this replica's copy is the newer.
        if self.running(id) || store.pending(id) > 0 {
            return Ok(());
        }
        match store.index(id) {
            Ok(Some(remote)) => self.sync_context(id, &remote),
            Ok(None) => {
                self.kv.forget(id);
                self.release_holders(id);
                Ok(())
            }
            // Unreachable: this replica's copy is shown where it has one.
            Err(e) if self.kv.has(id) => {
                tracing::warn!("context {id}: {e}; showing this replica's copy");
                Ok(())
            }
            Err(e) => Err(shared_error(e)),
        }
    }

    fn running(&self, id: &str) -> bool {
        self.active
            .iter()
            .any(|s| s.job.context.as_deref() == Some(id))
    }

    /// A context's call finished (`completed` or not): with a shared store, its result goes to
    /// the write-back with the call's lease (chunks written here first); a call that did not
    /// complete only gives its lease back.
    /// `done` runs once the store has the result or refused it (or at once where there is
    /// nothing to write, or when the store cannot be reached: the write-back retries behind it).
    pub(super) fn write_back(
        &mut self,
        slot: usize,
        id: &str,
        claim: Option<Claim>,
        completed: bool,
        done: Box<dyn FnOnce(WriteOutcome) + Send>,
    ) {
        let Some(Claim { lease, index: base }) = claim.filter(|_| completed) else {
            return done(WriteOutcome::Stored);
        };
        let written = self
            .kv
            .swap_out(&self.engine, &mut self.slots[slot].session, id);
        let (chunks, index) = match (written, self.kv.get_mut(id, base.owner.as_deref())) {
            (Ok(chunks), Ok(c)) => {
                c.index.revision = base.revision + 1;
                c.index.writer = Some(lease.token.clone());
                (chunks, c.index.clone())
            }
            (Err(e), _) | (_, Err(e)) => {
                // Not written: this replica's copy is dropped, the store keeps the context as it
                // was before the call (the lease goes back unused).
                tracing::warn!("context {id}: its call's chunks were not written: {e}");
                self.kv.forget(id);
                self.release_holders(id);
                return done(WriteOutcome::Refused(format!(
                    "this call's result was not kept: its chunks could not be written ({e})"
                )));
            }
        };
        if let Err(e) = self.kv.save_conversation(id) {
            tracing::warn!("saving context {id}: {e}");
        }
        self.slots[slot].unwritten = false;
        lease.commit(&base, index, chunks, done);
    }

    /// Delete context `id` of `owner`: refused while a call runs on it (here, or with a
    /// shared store anywhere: its lease is taken first, without waiting).
    pub(super) fn delete_context(
        &mut self,
        id: String,
        owner: Option<String>,
    ) -> Result<Value, ApiError> {
        let busy = self.running(&id);
        if !busy && let Some(store) = self.kv.shared().cloned() {
            let claim = match store.claim(&id, std::time::Duration::ZERO) {
                Err(SharedError::NotFound { .. }) => {
                    self.kv.forget(&id);
                    return Err(ApiError::not_found(format!("no context '{id}'")));
                }
                r => r.map_err(shared_error)?,
            };
            self.sync_context(&id, &claim.index)?;
            self.kv.get(&id, owner.as_deref()).map_err(kv_error)?;
            store.delete(&claim).map_err(shared_error)?;
        }
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

    /// Context `id` as the API shows it (with a shared store, as the store has it now).
    pub(super) fn get_context(&mut self, id: &str, owner: Option<&str>) -> Result<Value, ApiError> {
        self.refresh_context(id)?;
        self.context_json(id, owner)
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
            "revision": c.index.revision,
            "last_restore": c.last_restore,
        }))
    }
}
