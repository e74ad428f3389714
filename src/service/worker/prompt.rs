//! The tokens a request continues: its text encoded, its chat rendered in the model's template,
//! or for a context its conversation so far followed by the new input.

use std::sync::Arc;

use super::Worker;
use super::errors::kv_error;
use crate::backend::Backend;
use crate::model::{ChatMessage, Tokenizer};
use crate::service::api::{ApiError, Input};
use crate::service::messages::Generate;
use crate::service::tokenize::{encode_text, render_chat};

impl<B: Backend> Worker<B> {
    fn tokenizer(&self) -> Result<Arc<Tokenizer>, ApiError> {
        self.tok.clone().ok_or_else(|| {
            ApiError::bad_request(
                "this model has no tokenizer: send the prompt as token ids",
                Some("prompt"),
            )
        })
    }

    fn render_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, ApiError> {
        let tok = self.tokenizer()?;
        render_chat(&tok, messages)
    }

    fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>, ApiError> {
        let tok = self.tokenizer()?;
        encode_text(&tok, text, add_special)
    }

    /// The tokens the request continues, and for a chat on a context its messages.
    pub(super) fn prompt(
        &self,
        g: &Generate,
    ) -> Result<(Vec<u32>, Option<Vec<ChatMessage>>), ApiError> {
        let input = &g.request.input;
        let Some(id) = &g.context else {
            return Ok(match input {
                Input::Text(t) => (self.encode(t, true)?, None),
                Input::Tokens(t) | Input::Encoded { tokens: t, .. } => (t.clone(), None),
                Input::Chat(m) => (self.render_chat(m)?, None),
            });
        };
        let c = self.kv.get(id, g.owner.as_deref()).map_err(kv_error)?;
        let idx = &c.index;
        Ok(match input {
            Input::Chat(new) => {
                let mut messages = idx.messages.clone();
                if messages.is_empty()
                    && let Some(s) = &idx.system_prompt
                {
                    messages.push(ChatMessage {
                        role: "system".into(),
                        content: s.clone(),
                    });
                }
                messages.extend(new.iter().cloned());
                (self.render_chat(&messages)?, Some(messages))
            }
            Input::Text(t) => {
                let mut tokens = idx.tokens.clone();
                if tokens.is_empty() {
                    let first = format!("{}{t}", idx.system_prompt.as_deref().unwrap_or(""));
                    tokens = self.encode(&first, true)?;
                } else {
                    tokens.extend(self.encode(t, false)?);
                }
                (tokens, None)
            }
            // The HTTP side encodes no input of a context's call: taken as ids if it did.
            Input::Tokens(t) | Input::Encoded { tokens: t, .. } => {
                let mut tokens = idx.tokens.clone();
                tokens.extend(t);
                (tokens, None)
            }
        })
    }
}
