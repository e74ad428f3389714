//! Routes: OpenAI completions and chat (JSON or SSE), models, health, metrics, and the
//! persistent-context API. Authentication and the queue bound are enforced here.

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::time::Instant;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, Request as HttpRequest, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::StreamExt;
use tokio_stream::wrappers::UnboundedReceiverStream;

use super::api::{self, ApiError, GenerationRequest};
use super::worker::{Event, Generate, Request, TokenLogprob};
use super::{AppState, owner_of};
use crate::kv::unix_now;

/// The router over `state`.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/contexts", post(create_context))
        .route("/v1/contexts/{id}", get(get_context).delete(delete_context))
        .route("/v1/contexts/{id}/completions", post(context_completions))
        .route("/v1/contexts/{id}/chat/completions", post(context_chat))
        .fallback(|| async { ApiError::not_found("no such route") })
        .method_not_allowed_fallback(|| async { ApiError::method_not_allowed() })
        .layer(middleware::from_fn_with_state(state.clone(), authenticate))
        .with_state(state)
}

/// The caller's owner id (set by [`authenticate`]): None when the server has no keys.
#[derive(Clone)]
struct Owner(Option<String>);

async fn authenticate(State(st): State<AppState>, mut req: HttpRequest, next: Next) -> Response {
    let path = req.uri().path().to_string();
    let mut owner = None;
    if !st.cfg.api_keys.is_empty() && path != "/health" {
        let key = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        match key {
            None => {
                return ApiError::unauthorized(
                    "missing API key: send 'Authorization: Bearer <key>'",
                )
                .into_response();
            }
            Some(k) if !st.cfg.api_keys.iter().any(|a| a == k) => {
                return ApiError::unauthorized("invalid API key").into_response();
            }
            Some(k) => owner = Some(owner_of(k)),
        }
    }
    req.extensions_mut().insert(Owner(owner));
    let resp = next.run(req).await;
    let route = match path.as_str() {
        p if p.starts_with("/v1/contexts") => "/v1/contexts",
        p => p,
    };
    let route = if route.len() > 40 { "other" } else { route };
    st.shared
        .metrics
        .requests
        .with_label_values(&[route, resp.status().as_str()])
        .inc();
    resp
}

fn owner(req: &axum::http::Extensions) -> Option<String> {
    req.get::<Owner>().and_then(|o| o.0.clone())
}

async fn health() -> impl IntoResponse {
    axum::Json(json!({"status": "ok"}))
}

async fn metrics(State(st): State<AppState>) -> Response {
    let rate = st.shared.tokens_per_s();
    let text = st.shared.metrics.render(st.shared.ledger.as_deref(), rate);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

async fn models(State(st): State<AppState>) -> impl IntoResponse {
    axum::Json(json!({"object": "list", "data": [{
        "id": st.cfg.model_name, "object": "model", "created": unix_now(), "owned_by": "gpu-offload",
    }]}))
}

async fn completions(
    State(st): State<AppState>,
    ext: axum::http::Extensions,
    body: Bytes,
) -> Response {
    match api::parse_completion(&body, st.cfg.limits) {
        Ok(r) => generate(st, owner(&ext), None, r, false).await,
        Err(e) => e.into_response(),
    }
}

async fn chat(State(st): State<AppState>, ext: axum::http::Extensions, body: Bytes) -> Response {
    match api::parse_chat(&body, st.cfg.limits, false) {
        Ok(r) => generate(st, owner(&ext), None, r, true).await,
        Err(e) => e.into_response(),
    }
}

async fn context_completions(
    State(st): State<AppState>,
    Path(id): Path<String>,
    ext: axum::http::Extensions,
    body: Bytes,
) -> Response {
    match api::parse_completion(&body, st.cfg.limits) {
        Ok(r) => generate(st, owner(&ext), Some(id), r, false).await,
        Err(e) => e.into_response(),
    }
}

async fn context_chat(
    State(st): State<AppState>,
    Path(id): Path<String>,
    ext: axum::http::Extensions,
    body: Bytes,
) -> Response {
    match api::parse_chat(&body, st.cfg.limits, false) {
        Ok(r) => generate(st, owner(&ext), Some(id), r, true).await,
        Err(e) => e.into_response(),
    }
}

async fn ask(
    st: &AppState,
    make: impl FnOnce(oneshot::Sender<Result<Value, ApiError>>) -> Request,
    status: StatusCode,
) -> Response {
    let (tx, rx) = oneshot::channel();
    if st.tx.send(make(tx)).is_err() {
        return ApiError::unavailable("the engine has stopped").into_response();
    }
    match rx.await {
        Ok(Ok(v)) => (status, axum::Json(v)).into_response(),
        Ok(Err(e)) => e.into_response(),
        Err(_) => ApiError::unavailable("the engine has stopped").into_response(),
    }
}

async fn create_context(
    State(st): State<AppState>,
    ext: axum::http::Extensions,
    body: Bytes,
) -> Response {
    let system_prompt = match api::parse_new_context(&body) {
        Ok(s) => s,
        Err(e) => return e.into_response(),
    };
    let owner = owner(&ext);
    ask(
        &st,
        |reply| Request::CreateContext {
            owner,
            system_prompt,
            reply,
        },
        StatusCode::CREATED,
    )
    .await
}

async fn get_context(
    State(st): State<AppState>,
    Path(id): Path<String>,
    ext: axum::http::Extensions,
) -> Response {
    let owner = owner(&ext);
    ask(
        &st,
        |reply| Request::GetContext { id, owner, reply },
        StatusCode::OK,
    )
    .await
}

async fn delete_context(
    State(st): State<AppState>,
    Path(id): Path<String>,
    ext: axum::http::Extensions,
) -> Response {
    let owner = owner(&ext);
    ask(
        &st,
        |reply| Request::DeleteContext { id, owner, reply },
        StatusCode::OK,
    )
    .await
}

/// Queue a generation and answer with one JSON object or an SSE stream.
async fn generate(
    st: AppState,
    owner: Option<String>,
    context: Option<String>,
    request: GenerationRequest,
    chat: bool,
) -> Response {
    if let Some(m) = &request.model
        && m != &st.cfg.model_name
    {
        return ApiError::not_found(format!(
            "model '{m}' is not served here (this server serves '{}')",
            st.cfg.model_name
        ))
        .into_response();
    }
    if st.shared.shutdown.load(Ordering::SeqCst) {
        return ApiError::unavailable("the server is shutting down").into_response();
    }
    // Reserve a queue place first, so concurrent requests cannot overshoot the bound.
    let prev = st.shared.waiting.fetch_add(1, Ordering::SeqCst);
    if prev >= st.cfg.queue {
        st.shared.waiting.fetch_sub(1, Ordering::SeqCst);
        return ApiError::too_many(format!(
            "the request queue is full ({} waiting); retry later",
            st.cfg.queue
        ))
        .into_response();
    }
    let (etx, mut erx) = mpsc::unbounded_channel();
    let stream = request.stream;
    let n = request.n;
    let logprobs = request.logprobs.is_some();
    let job = Generate {
        request,
        context: context.clone(),
        owner,
        events: etx,
        received: Instant::now(),
    };
    if st.tx.send(Request::Generate(Box::new(job))).is_err() {
        st.shared.waiting.fetch_sub(1, Ordering::SeqCst);
        return ApiError::unavailable("the engine has stopped").into_response();
    }
    let (prompt_tokens, cached) = match erx.recv().await {
        Some(Event::Start {
            prompt_tokens,
            cached_tokens,
        }) => (prompt_tokens, cached_tokens),
        Some(Event::Error(e)) => return e.into_response(),
        _ => return ApiError::internal("the engine dropped the request").into_response(),
    };
    let id = format!(
        "{}-{:016x}",
        if chat { "chatcmpl" } else { "cmpl" },
        rand::random::<u64>()
    );
    let model = st.cfg.model_name.clone();
    let created = unix_now();
    if stream {
        let header = Chunk {
            id,
            model,
            created,
            chat,
            context,
        };
        let head: Vec<Value> = if chat {
            (0..n)
                .map(|i| {
                    header.wrap(json!({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}))
                })
                .collect()
        } else {
            Vec::new()
        };
        // Characters sent so far per choice: where the next token's text starts.
        let mut offsets = vec![0usize; n];
        let mut last_finish = None;
        let events = UnboundedReceiverStream::new(erx).filter_map(move |ev| {
            let v = match ev {
                Event::Token {
                    index,
                    text,
                    logprobs: lps,
                } => {
                    let at = offsets.get(index).copied().unwrap_or(0);
                    if let Some(o) = offsets.get_mut(index) {
                        *o += text.chars().count();
                    }
                    let lp = logprobs.then(|| logprobs_json(chat, &lps, at));
                    header.token(index, &text, lp)
                }
                Event::Finish {
                    index,
                    finish_reason,
                } => {
                    if index + 1 == n {
                        // The last choice's finish goes out with the usage.
                        last_finish = Some((index, finish_reason));
                        return None;
                    }
                    header.finish(index, finish_reason)
                }
                Event::Done {
                    completion_tokens, ..
                } => {
                    let (index, reason) = last_finish.take().unwrap_or((n - 1, "stop"));
                    let mut v = header.finish(index, reason);
                    v["usage"] = usage(prompt_tokens, completion_tokens, cached);
                    v
                }
                Event::Error(e) => e.body(),
                Event::Start { .. } => return None,
            };
            Some(Ok::<_, Infallible>(SseEvent::default().data(v.to_string())))
        });
        let head = tokio_stream::iter(
            head.into_iter()
                .map(|v| Ok(SseEvent::default().data(v.to_string()))),
        );
        let done = tokio_stream::once(Ok(SseEvent::default().data("[DONE]")));
        return Sse::new(head.chain(events).chain(done))
            .keep_alive(KeepAlive::default())
            .into_response();
    }
    let mut choices: Vec<Choice> = (0..n).map(|_| Choice::default()).collect();
    while let Some(ev) = erx.recv().await {
        match ev {
            Event::Token {
                index,
                text,
                logprobs,
            } => {
                if let Some(c) = choices.get_mut(index) {
                    let at = c.text.chars().count();
                    c.offsets.extend(std::iter::repeat_n(at, logprobs.len()));
                    c.logprobs.extend(logprobs);
                    c.text.push_str(&text);
                }
            }
            Event::Finish {
                index,
                finish_reason,
            } => {
                if let Some(c) = choices.get_mut(index) {
                    c.finish = Some(finish_reason);
                }
            }
            Event::Error(e) => return e.into_response(),
            Event::Start { .. } => {}
            Event::Done {
                completion_tokens, ..
            } => {
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
                    "id": id,
                    "object": if chat { "chat.completion" } else { "text_completion" },
                    "created": created,
                    "model": model,
                    "choices": choices,
                    "usage": usage(prompt_tokens, completion_tokens, cached),
                });
                if let Some(c) = context {
                    v["context"] = c.into();
                }
                return axum::Json(v).into_response();
            }
        }
    }
    ApiError::internal("the engine stopped before the request finished").into_response()
}

/// One choice of a non-streamed answer, as it arrives.
#[derive(Default)]
struct Choice {
    text: String,
    logprobs: Vec<TokenLogprob>,
    /// Per token: the character offset of its text in `text`.
    offsets: Vec<usize>,
    finish: Option<&'static str>,
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
fn logprobs_json(chat: bool, lps: &[TokenLogprob], at: usize) -> Value {
    if chat {
        json!({"content": lps.iter().map(chat_logprob).collect::<Vec<_>>(), "refusal": null})
    } else {
        completion_logprobs(lps, &vec![at; lps.len()])
    }
}

fn usage(prompt: usize, completion: usize, cached: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

struct Chunk {
    id: String,
    model: String,
    created: u64,
    chat: bool,
    context: Option<String>,
}

impl Chunk {
    fn wrap(&self, choice: Value) -> Value {
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

    fn token(&self, index: usize, text: &str, logprobs: Option<Value>) -> Value {
        let lp = logprobs.unwrap_or(Value::Null);
        if self.chat {
            self.wrap(json!({"index": index, "delta": {"content": text}, "logprobs": lp, "finish_reason": null}))
        } else {
            self.wrap(json!({"index": index, "text": text, "logprobs": lp, "finish_reason": null}))
        }
    }

    fn finish(&self, index: usize, reason: &str) -> Value {
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
}
