//! Prompts encoded on the HTTP side, so that no client's prompt holds up the engine thread
//! (issue 39: two clients looping on 2 MB prompts took a 3 ms completion to 5 s).
//!
//! A prompt is first sized without encoding it: no token of the model covers more than the
//! longest token's bytes of text (the tokenizers here do not normalize text; the bound leaves
//! out ASCII whitespace, which a special token's strip may swallow), so a prompt of `B` such
//! bytes is at least `B / longest` tokens and is refused at once when that is over the limit.
//! What passes is at most the limit times the longest token's bytes. A short prompt (up to
//! [`ENCODE_INLINE_BYTES`]) is encoded where it arrives: tens of microseconds, less than a trip
//! to another thread, and it never queues behind a client's long ones (a normal completion from
//! an address that also floods waited behind its 2 MB bodies: 25 ms for a 3 ms call). A longer
//! one is encoded on the bulk pool, at most `tokenize_per_key` of one client's at a time (more
//! wait their turn, up to a bound, then 429) and at most one per CPU in all.
//!
//! The bulk pool's threads run at the lowest CPU priority (nice 19): a flood of long bodies is
//! refused as fast as the CPU allows when it is idle, but it takes no CPU time that the engine and
//! the short requests want (pinned to one core with six clients flooding 2 MB prompts, a 4-token
//! completion took 11 ms against 2.3 ms alone while those parses ran at the same priority).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::Semaphore;

use super::api::{ApiError, Input};
use crate::limits::MAX_PROMPT_BYTES;
use crate::model::{ChatMessage, Tokenizer};

/// The tokenizer and how much encoding the HTTP side lets run.
pub struct Encoder {
    tok: Option<Arc<Tokenizer>>,
    /// The most bytes of text one token stands for (at least 4: one character of any kind).
    longest_token: usize,
    /// Tokens a prompt may have (`--max-prompt-tokens`, at most the context).
    prompt_limit: usize,
    ctx: usize,
    per_key: usize,
    /// Per client: its encodings' permits, and how many run or wait.
    running: Mutex<HashMap<String, (Arc<Semaphore>, usize)>>,
    /// Long bodies' parses and long prompts' encodings: one thread per CPU, at nice 19.
    bulk: rayon::ThreadPool,
}

/// Prompts of at most this many bytes are encoded on the request's own task.
pub const ENCODE_INLINE_BYTES: usize = 4 << 10;

/// Encodings of one client that may wait for their turn; beyond, 429.
const WAITING_PER_KEY: usize = 64;

/// One client's encoding counted until dropped.
struct Pass<'a> {
    encoder: &'a Encoder,
    key: String,
}

impl Drop for Pass<'_> {
    fn drop(&mut self) {
        let mut running = self
            .encoder
            .running
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some((_, n)) = running.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                running.remove(&self.key);
            }
        }
    }
}

/// The calling thread at the lowest CPU priority (Linux keeps a nice value per thread).
fn lower_this_threads_priority() {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: gettid and setpriority take and return plain integers.
        let rc = unsafe {
            let tid = libc::gettid();
            libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, 19)
        };
        if rc != 0 {
            tracing::warn!(
                "the bulk input thread keeps its priority: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

/// The text a prompt check sizes: its bytes and those of them not ASCII whitespace.
fn sizes<'a>(texts: impl Iterator<Item = &'a str>) -> (usize, usize) {
    texts.fold((0, 0), |(all, solid), t| {
        let ws = t.bytes().filter(u8::is_ascii_whitespace).count();
        (all + t.len(), solid + t.len() - ws)
    })
}

/// `text` as the engine encodes a prompt: with the model's BOS, control-token text parsed.
pub fn encode_text(tok: &Tokenizer, text: &str, add_special: bool) -> Result<Vec<u32>, ApiError> {
    tok.encode(text, add_special, true)
        .map_err(|e| ApiError::bad_request(e.to_string(), Some("prompt")))
}

/// The conversation in the model's chat template, or ChatML when it has none (as llama.cpp).
pub fn render_chat(tok: &Tokenizer, messages: &[ChatMessage]) -> Result<Vec<u32>, ApiError> {
    let (text, chatml) = tok
        .apply_chat_template_or_chatml(messages, true)
        .map_err(|e| ApiError::bad_request(format!("chat: {e}"), Some("messages")))?;
    // A model's own template writes the BOS text itself when the model wants one; ChatML does
    // not, so the tokenizer adds it.
    tok.encode(&text, chatml, true)
        .map_err(|e| ApiError::bad_request(e.to_string(), Some("messages")))
}

impl Encoder {
    pub fn new(
        tok: Option<Arc<Tokenizer>>,
        prompt_limit: usize,
        ctx: usize,
        per_key: usize,
    ) -> Result<Self, rayon::ThreadPoolBuildError> {
        let longest_token = tok.as_ref().map_or(4, |t| {
            (0..t.vocab_size() as u32)
                .map(|id| t.token_bytes(id, true).len())
                .max()
                .unwrap_or(0)
                .max(4)
        });
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let bulk = rayon::ThreadPoolBuilder::new()
            .num_threads(cpus)
            .thread_name(|i| format!("bulk-input-{i}"))
            .start_handler(|_| lower_this_threads_priority())
            .build()?;
        Ok(Encoder {
            tok,
            longest_token,
            prompt_limit: prompt_limit.min(ctx),
            ctx,
            per_key: per_key.max(1),
            running: Mutex::new(HashMap::new()),
            bulk,
        })
    }

    /// Refuse a prompt of `texts` that is over `max_prompt_bytes`, or that cannot be under the
    /// token limit whatever it encodes to (`extra` tokens are taken already).
    /// Returns the text's bytes.
    fn size_check<'a>(
        &self,
        texts: impl Iterator<Item = &'a str>,
        extra: usize,
        param: &str,
    ) -> Result<usize, ApiError> {
        let (bytes, solid) = sizes(texts);
        if !MAX_PROMPT_BYTES.admits(bytes as u64) {
            return Err(ApiError::bad_request(
                MAX_PROMPT_BYTES.refuse("the prompt's text in bytes", bytes as u64),
                Some(param),
            ));
        }
        let at_least = solid.div_ceil(self.longest_token) + extra;
        if self.tok.is_some() && at_least > self.prompt_limit {
            return Err(ApiError::bad_request(
                format!(
                    "the prompt is {bytes} bytes, so at least {at_least} tokens (no token of this model stands for more than {} bytes); this server takes at most {} (context size {})",
                    self.longest_token, self.prompt_limit, self.ctx
                ),
                Some(param),
            ));
        }
        Ok(bytes)
    }

    /// Count one encoding of `key`'s and the permits it waits on (`per_key` of them): refused
    /// while the client has that many running and [`WAITING_PER_KEY`] more waiting.
    fn enter(&self, key: &str) -> Result<(Pass<'_>, Arc<Semaphore>), ApiError> {
        let mut running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        let (permits, n) = running
            .entry(key.to_string())
            .or_insert_with(|| (Arc::new(Semaphore::new(self.per_key)), 0));
        if *n >= self.per_key + WAITING_PER_KEY {
            return Err(ApiError::too_many(format!(
                "{} prompts of this client are being encoded or waiting to be (--tokenize-per-key {}); retry when they finish",
                *n, self.per_key
            )));
        }
        *n += 1;
        let permits = permits.clone();
        Ok((
            Pass {
                encoder: self,
                key: key.to_string(),
            },
            permits,
        ))
    }

    /// Run `work` on the bulk pool as one piece of `key`'s work (an encoding, or the parse
    /// of a long body), after the client's turn.
    pub async fn off_thread<T: Send + 'static>(
        self: &Arc<Self>,
        key: &str,
        work: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
    ) -> Result<T, ApiError> {
        let (_pass, permits) = self.enter(key)?;
        // One client's backlog waits on its own permits, not on everyone's.
        let _turn = permits
            .acquire()
            .await
            .map_err(|_| ApiError::unavailable("the server is shutting down"))?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.bulk.spawn(move || {
            let done = std::panic::catch_unwind(std::panic::AssertUnwindSafe(work));
            // The request may have gone (its client disconnected): nothing waits for the answer.
            let _ = tx.send(done);
        });
        match rx.await {
            Ok(Ok(answer)) => answer,
            Ok(Err(_)) => Err(ApiError::internal(
                "parsing or encoding the request panicked",
            )),
            Err(_) => Err(ApiError::internal("the bulk input pool dropped a request")),
        }
    }

    /// Run `work` with the tokenizer on `bytes` of text: here when they are few, else on the
    /// blocking pool as one encoding of `key`'s.
    async fn run<T: Send + 'static>(
        self: &Arc<Self>,
        key: &str,
        bytes: usize,
        work: impl FnOnce(&Tokenizer) -> Result<T, ApiError> + Send + 'static,
    ) -> Result<T, ApiError> {
        let tok = self.tok.clone().ok_or_else(|| {
            ApiError::bad_request(
                "this model has no tokenizer: send the prompt as token ids",
                Some("prompt"),
            )
        })?;
        if bytes <= ENCODE_INLINE_BYTES {
            return work(&tok);
        }
        self.off_thread(key, move || work(&tok)).await
    }

    /// Check `input`'s size, and encode it unless it continues a context (whose conversation
    /// the engine thread holds: the size check bounds what it encodes there).
    pub async fn prepare(
        self: &Arc<Self>,
        key: &str,
        input: Input,
        on_context: bool,
    ) -> Result<Input, ApiError> {
        let param = input.param();
        let bytes = match &input {
            Input::Tokens(t) if t.len() > self.prompt_limit => {
                return Err(ApiError::bad_request(
                    format!(
                        "the prompt is {} tokens; this server takes at most {} (context size {})",
                        t.len(),
                        self.prompt_limit,
                        self.ctx
                    ),
                    Some(param),
                ));
            }
            Input::Tokens(_) | Input::Encoded { .. } => return Ok(input),
            Input::Text(t) => self.size_check(std::iter::once(t.as_str()), 0, param)?,
            Input::Chat(m) => self.size_check(m.iter().map(|m| m.content.as_str()), 0, param)?,
        };
        if on_context || self.tok.is_none() {
            return Ok(input);
        }
        let tokens = match input {
            Input::Text(t) => {
                self.run(key, bytes, move |tok| encode_text(tok, &t, true))
                    .await?
            }
            Input::Chat(m) => {
                self.run(key, bytes, move |tok| render_chat(tok, &m))
                    .await?
            }
            _ => unreachable!("token inputs returned above"),
        };
        Ok(Input::Encoded { tokens, param })
    }

    /// A new context's system prompt: refused when it leaves no room for a call's input (it
    /// and at least one token more must fit the prompt limit).
    pub async fn check_system_prompt(
        self: &Arc<Self>,
        key: &str,
        system_prompt: Option<&str>,
    ) -> Result<(), ApiError> {
        let Some(s) = system_prompt else {
            return Ok(());
        };
        let param = "system_prompt";
        let bytes = self.size_check(std::iter::once(s), 1, param)?;
        if self.tok.is_none() {
            return Ok(());
        }
        let text = s.to_string();
        let tokens = self
            .run(key, bytes, move |tok| encode_text(tok, &text, true))
            .await?
            .len();
        if tokens >= self.prompt_limit {
            return Err(ApiError::bad_request(
                format!(
                    "the system prompt is {tokens} tokens; a call on the context needs it and at least one token more within this server's prompt limit of {} tokens (context size {})",
                    self.prompt_limit, self.ctx
                ),
                Some(param),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_gets_its_share_of_encodings() {
        let e = Encoder::new(None, 100, 100, 2).unwrap();
        let mut a: Vec<_> = (0..2 + WAITING_PER_KEY)
            .map(|_| e.enter("a").unwrap())
            .collect();
        // Its own permits: two run at once, the rest wait.
        assert_eq!(a[0].1.available_permits(), 2);
        let err = e.enter("a").err().unwrap();
        assert_eq!(err.status, axum::http::StatusCode::TOO_MANY_REQUESTS);
        // Another client is not held up by the first's.
        let (_b, permits) = e.enter("b").unwrap();
        assert_eq!(permits.available_permits(), 2);
        a.pop();
        assert!(e.enter("a").is_ok());
    }

    /// `input` prepared by `e` for client "a" while that client's one encoding turn is taken
    /// (its long body being parsed): `None` while it waits.
    async fn prepared_while_busy(e: &Arc<Encoder>, input: Input) -> Option<Input> {
        let (_pass, permits) = e.enter("a").unwrap();
        let _busy = permits.try_acquire_owned().unwrap();
        let wait = std::time::Duration::from_millis(500);
        tokio::time::timeout(wait, e.prepare("a", input, false))
            .await
            .ok()
            .map(|r| r.unwrap())
    }

    #[tokio::test]
    async fn a_short_prompt_does_not_wait_behind_its_clients_long_work() {
        let tok = Arc::new(crate::model::tokenizer::tests::spm_tokenizer());
        let e = Arc::new(Encoder::new(Some(tok), 10_000, 10_000, 1).unwrap());
        let short = prepared_while_busy(&e, Input::Text("hi".into())).await;
        assert!(
            matches!(&short, Some(Input::Encoded { tokens, .. }) if tokens == &[1, 263]),
            "{short:?}"
        );
        // A long one takes its turn.
        let long = Input::Text("hi ".repeat(ENCODE_INLINE_BYTES / 3 + 1));
        assert!(prepared_while_busy(&e, long).await.is_none());
    }

    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn bulk_work_runs_at_the_lowest_priority() {
        let e = Arc::new(Encoder::new(None, 100, 100, 1).unwrap());
        // SAFETY: plain integer calls about the calling thread.
        let nice = e
            .off_thread("a", || {
                Ok(unsafe { libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t) })
            })
            .await
            .unwrap();
        assert_eq!(nice, 19);
    }

    #[test]
    fn sizes_leave_out_whitespace() {
        assert_eq!(sizes(["ab c", " \n"].into_iter()), (6, 3));
    }

    #[test]
    fn over_long_text_is_refused_without_a_tokenizer_pass() {
        let e = Encoder::new(None, 10, 10, 1).unwrap();
        let big = "x".repeat(MAX_PROMPT_BYTES.value as usize + 1);
        let err = e.size_check(std::iter::once(big.as_str()), 0, "prompt");
        assert!(err.unwrap_err().message.contains("max_prompt_bytes"));
    }
}
