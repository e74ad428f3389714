//! A sequence ends: the client hears its last choice finish and the usage; a context keeps the
//! conversation (or, for a call that did not complete, gets back what it was before), a
//! stateless slot keeps its tokens for prefix reuse or gives its blocks back.

use super::Worker;
use super::sequence::Sequence;
use super::slot::Holder;
use crate::backend::Backend;
use crate::kv::WriteOutcome;
use crate::model::ChatMessage;
use crate::service::api::ApiError;
use crate::service::messages::Event;

impl<B: Backend> Worker<B> {
    pub(super) fn finish(&mut self, mut seq: Sequence, reason: &'static str) {
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
        }
        let events = seq.job.events;
        let (prompt_tokens, completion_tokens) = (seq.prompt_tokens, seq.generated_total);
        let done: Box<dyn FnOnce(WriteOutcome) + Send> = Box::new(move |outcome| {
            let ev = match outcome {
                // The answer is not part of the conversation: the client hears so.
                WriteOutcome::Refused(why) => Event::Error(ApiError::conflict(why)),
                _ if reason == "error" => return,
                WriteOutcome::Stored | WriteOutcome::Retrying => Event::Done {
                    prompt_tokens,
                    completion_tokens,
                },
            };
            events.send(ev).ok();
        });
        if let Some(id) = seq.job.context.clone()
            && self.kv.shared().is_some()
        {
            // Shared store: written now, and the call is done for its client once the store has
            // it, so that whatever the client does next (on any replica) finds it.
            let claim = seq.job.claim.take();
            self.write_back(seq.slot, &id, claim, completed, done);
            return;
        }
        done(WriteOutcome::Stored);
        if seq.job.context.is_some() {
            // Ahead-of-time swap-out of the chunks this call changed: when the engine falls
            // idle (the run loop), so that calls already waiting do not wait for it too; before
            // then if the slot goes to another holder.
            self.slots[seq.slot].unwritten = true;
        }
    }
}
