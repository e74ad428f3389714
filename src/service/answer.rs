//! The OpenAI answer bodies of a generation: the parts every chunk of an answer repeats, the
//! streamed chunks (a token, a finished choice), the whole answer, the log-probabilities in the
//! chat's and the completions' shapes, and the usage.

use serde_json::{Value, json};

use super::messages::TokenLogprob;

/// How many choices an answer has and whether they carry log-probabilities.
#[derive(Clone, Copy)]
pub(super) struct AnswerShape {
    pub(super) n: usize,
    pub(super) logprobs: bool,
}

/// The prompt's share of the usage: its tokens, and those reused from a cache.
#[derive(Clone, Copy)]
pub(super) struct PromptUsage {
    pub(super) prompt_tokens: usize,
    pub(super) cached: usize,
}

/// One choice of a non-streamed answer, as it arrives.
#[derive(Default)]
pub(super) struct Choice {
    pub(super) text: String,
    pub(super) logprobs: Vec<TokenLogprob>,
    /// Per token: the character offset of its text in `text`.
    pub(super) offsets: Vec<usize>,
    pub(super) finish: Option<&'static str>,
}

/// Chat's `{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}`.
fn chat_logprob(t: &TokenLogprob) -> Value {
    let top: Vec<Value> = t
        .top
        .iter()
        .map(|(p, lp)| json!({"token": p.text, "logprob": lp, "bytes": p.bytes}))
        .collect();
    json!({"token": t.token.text, "logprob": t.logprob, "bytes": t.token.bytes, "top_logprobs": top})
}

/// Completions' `{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}`;
/// `text_offset` counts characters from the start of the completion's text.
fn completion_logprobs(lps: &[TokenLogprob], offsets: &[usize]) -> Value {
    let top: Vec<Value> = lps
        .iter()
        .map(|t| {
            let m: serde_json::Map<String, Value> = t
                .top
                .iter()
                .map(|(p, lp)| (p.text.clone(), json!(lp)))
                .collect();
            Value::Object(m)
        })
        .collect();
    json!({
        "tokens": lps.iter().map(|t| t.token.text.clone()).collect::<Vec<_>>(),
        "token_logprobs": lps.iter().map(|t| t.logprob).collect::<Vec<_>>(),
        "top_logprobs": top,
        "text_offset": offsets,
    })
}

/// The `logprobs` of one streamed chunk whose tokens' text starts at character `at`.
pub(super) fn logprobs_json(chat: bool, lps: &[TokenLogprob], at: usize) -> Value {
    if chat {
        json!({"content": lps.iter().map(chat_logprob).collect::<Vec<_>>(), "refusal": null})
    } else {
        completion_logprobs(lps, &vec![at; lps.len()])
    }
}

pub(super) fn usage(prompt: usize, completion: usize, cached: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

/// What every body of one answer repeats: its id, model, time of creation, kind (chat or
/// completion) and context.
pub(super) struct AnswerHead {
    pub(super) id: String,
    pub(super) model: String,
    pub(super) created: u64,
    pub(super) chat: bool,
    pub(super) context: Option<String>,
}

impl AnswerHead {
    pub(super) fn wrap(&self, choice: Value) -> Value {
        let mut v = json!({
            "id": self.id,
            "object": if self.chat { "chat.completion.chunk" } else { "text_completion" },
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        });
        if let Some(c) = &self.context {
            v["context"] = c.clone().into();
        }
        v
    }

    pub(super) fn token(&self, index: usize, text: &str, logprobs: Option<Value>) -> Value {
        let lp = logprobs.unwrap_or(Value::Null);
        if self.chat {
            self.wrap(json!({"index": index, "delta": {"content": text}, "logprobs": lp, "finish_reason": null}))
        } else {
            self.wrap(json!({"index": index, "text": text, "logprobs": lp, "finish_reason": null}))
        }
    }

    pub(super) fn finish(&self, index: usize, reason: &str) -> Value {
        if self.chat {
            self.wrap(
                json!({"index": index, "delta": {}, "logprobs": null, "finish_reason": reason}),
            )
        } else {
            self.wrap(
                json!({"index": index, "text": "", "logprobs": null, "finish_reason": reason}),
            )
        }
    }

    /// The whole (non-streamed) answer over its `choices`.
    pub(super) fn whole(self, choices: &[Choice], logprobs: bool, usage: Value) -> Value {
        let chat = self.chat;
        let choices: Vec<Value> = choices
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let lp = if logprobs {
                    if chat {
                        json!({"content": c.logprobs.iter().map(chat_logprob).collect::<Vec<_>>(), "refusal": null})
                    } else {
                        completion_logprobs(&c.logprobs, &c.offsets)
                    }
                } else {
                    Value::Null
                };
                let reason = c.finish.unwrap_or("stop");
                if chat {
                    json!({"index": i, "message": {"role": "assistant", "content": c.text}, "finish_reason": reason, "logprobs": lp})
                } else {
                    json!({"index": i, "text": c.text, "finish_reason": reason, "logprobs": lp})
                }
            })
            .collect();
        let mut v = json!({
            "id": self.id,
            "object": if chat { "chat.completion" } else { "text_completion" },
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage,
        });
        if let Some(c) = self.context {
            v["context"] = c.into();
        }
        v
    }
}
