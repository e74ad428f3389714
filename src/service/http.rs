//! Routes: OpenAI completions and chat (JSON or SSE), models, health, metrics, and the
//! persistent-context API. Authentication and the queue bound are enforced here.

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::time::Instant;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::DefaultBodyLimit;
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

use super::answer::{AnswerHead, AnswerShape, Choice, PromptUsage, logprobs_json, usage};
use super::api::{self, ApiError, GenerationRequest};
use super::conn::Peer;
use super::messages::{Event, Generate, Request};
use super::worker::errors::shared_error;
use super::{AppState, owner_of};
use crate::kv::{Claim, SharedStore, unix_now};
use crate::limits::MAX_REQUEST_BODY_BYTES;
use std::sync::Arc;
use std::time::Duration;

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
        // Bodies are read whole (and bounded) by `read_body`, after authentication.
        .layer(DefaultBodyLimit::max(MAX_REQUEST_BODY_BYTES.value as usize))
        .layer(middleware::from_fn_with_state(state.clone(), read_body))
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

/// The caller's owner id and the client its encoding work is counted as.
fn who(ext: &axum::http::Extensions) -> (Option<String>, String) {
    let o = owner(ext);
    let key = client(o.as_deref(), ext);
    (o, key)
}

/// Whose encoding work a request is counted as: its API key's owner, else its address.
fn client(owner: Option<&str>, ext: &axum::http::Extensions) -> String {
    match (owner, ext.get::<Peer>()) {
        (Some(o), _) => o.to_string(),
        (None, Some(p)) => p.0.ip().to_string(),
        (None, None) => String::new(),
    }
}

/// Read the request's body whole within `--body-timeout` and `max_request_body_bytes`, so that
/// a slow, over-long or malformed body gets OpenAI's error shape like every other mistake.
async fn read_body(State(st): State<AppState>, req: HttpRequest, next: Next) -> Response {
    let limit = MAX_REQUEST_BODY_BYTES.value as usize;
    let too_large = |n: u64| {
        ApiError::too_large(MAX_REQUEST_BODY_BYTES.refuse("the request body in bytes", n))
            .into_response()
    };
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if let Some(n) = declared.filter(|&n| !MAX_REQUEST_BODY_BYTES.admits(n)) {
        return too_large(n);
    }
    let (parts, body) = req.into_parts();
    let mut stream = body.into_data_stream();
    let mut bytes = Vec::new();
    let read = async {
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| {
                ApiError::bad_request(format!("the request body is malformed: {e}"), None)
                    .into_response()
            })?;
            if bytes.len() + chunk.len() > limit {
                return Err(too_large((bytes.len() + chunk.len()) as u64));
            }
            bytes.extend_from_slice(&chunk);
        }
        Ok(())
    };
    match tokio::time::timeout(st.cfg.timeouts.body, read).await {
        Ok(Ok(())) => {
            next.run(HttpRequest::from_parts(parts, Body::from(bytes)))
                .await
        }
        Ok(Err(resp)) => resp,
        Err(_) => ApiError::timeout(format!(
            "the request body did not arrive within {} s (--body-timeout)",
            st.cfg.timeouts.body.as_secs_f64()
        ))
        .into_response(),
    }
}

/// The server's health; with a shared context store, the store's too (the server is
/// "degraded" while the store is: calls on contexts wait for it, others are served).
async fn health(State(st): State<AppState>) -> impl IntoResponse {
    match &st.contexts {
        None => axum::Json(json!({"status": "ok"})),
        Some(store) => {
            let h = store.health();
            axum::Json(json!({"status": h.state, "context_store": h}))
        }
    }
}

async fn metrics(State(st): State<AppState>) -> Response {
    if let Some(store) = &st.contexts {
        st.shared
            .metrics
            .set_store(&store.health(), &store.writeback_counters());
    }
    let rate = st.shared.tokens_per_s();
    let text = st.shared.metrics.render(st.shared.ledger.as_deref(), rate);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

async fn models(State(st): State<AppState>) -> impl IntoResponse {
    axum::Json(json!({"object": "list", "data": [{
        "id": st.cfg.model_name, "object": "model", "created": unix_now(), "owned_by": "gpu-offload",
    }]}))
}

/// Bodies longer than this are parsed on the blocking pool as the client's work (a flood of
/// 2 MB bodies then waits on its own client's turn, not on the runtime's threads).
const PARSE_INLINE_BYTES: usize = 64 << 10;

type Parser = fn(&[u8], api::Limits) -> Result<GenerationRequest, ApiError>;

async fn parse(
    st: &AppState,
    key: &str,
    body: Bytes,
    f: Parser,
) -> Result<GenerationRequest, ApiError> {
    let limits = st.cfg.limits;
    if body.len() <= PARSE_INLINE_BYTES {
        return f(&body, limits);
    }
    st.encoder.off_thread(key, move || f(&body, limits)).await
}

fn parse_chat(body: &[u8], limits: api::Limits) -> Result<GenerationRequest, ApiError> {
    api::parse_chat(body, limits, false)
}

async fn parse_and_generate(
    st: AppState,
    ext: axum::http::Extensions,
    context: Option<String>,
    body: Bytes,
    chat: bool,
) -> Response {
    let who = who(&ext);
    let f: Parser = if chat {
        parse_chat
    } else {
        api::parse_completion
    };
    match parse(&st, &who.1, body, f).await {
        Ok(r) => generate(st, who, context, r, chat).await,
        Err(e) => e.into_response(),
    }
}

async fn completions(
    State(st): State<AppState>,
    ext: axum::http::Extensions,
    body: Bytes,
) -> Response {
    parse_and_generate(st, ext, None, body, false).await
}

async fn chat(State(st): State<AppState>, ext: axum::http::Extensions, body: Bytes) -> Response {
    parse_and_generate(st, ext, None, body, true).await
}

async fn context_completions(
    State(st): State<AppState>,
    Path(id): Path<String>,
    ext: axum::http::Extensions,
    body: Bytes,
) -> Response {
    parse_and_generate(st, ext, Some(id), body, false).await
}

async fn context_chat(
    State(st): State<AppState>,
    Path(id): Path<String>,
    ext: axum::http::Extensions,
    body: Bytes,
) -> Response {
    parse_and_generate(st, ext, Some(id), body, true).await
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
    let (owner, key) = who(&ext);
    if let Err(e) = st
        .encoder
        .check_system_prompt(&key, system_prompt.as_deref())
        .await
    {
        return e.into_response();
    }
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
    (owner, key): (Option<String>, String),
    context: Option<String>,
    request: GenerationRequest,
    chat: bool,
) -> Response {
    let stream = request.stream;
    let n = request.n;
    let logprobs = request.logprobs.is_some();
    let mut request = request;
    request.input = match st
        .encoder
        .prepare(&key, request.input, context.is_some())
        .await
    {
        Ok(i) => i,
        Err(e) => return e.into_response(),
    };
    let claim = match (&context, &st.contexts) {
        (Some(id), Some(store)) => match claim(store, id, st.cfg.context_wait).await {
            Ok(c) => Some(c),
            Err(e) => return e.into_response(),
        },
        _ => None,
    };
    let mut erx = match queue(&st, owner, context.clone(), claim, request) {
        Ok(erx) => erx,
        Err(e) => return e.into_response(),
    };
    let prompt = match erx.recv().await {
        Some(Event::Start {
            prompt_tokens,
            cached_tokens,
        }) => PromptUsage {
            prompt_tokens,
            cached: cached_tokens,
        },
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
    let header = AnswerHead {
        id,
        model,
        created,
        chat,
        context,
    };
    let shape = AnswerShape { n, logprobs };
    if stream {
        return stream_answer(header, shape, prompt, erx);
    }
    collect_answer(header, shape, prompt, erx).await
}

/// Context `id`'s lease from the shared store, waiting up to `wait` while another call holds
/// it (off the async threads: the store's client blocks).
async fn claim(store: &Arc<SharedStore>, id: &str, wait: Duration) -> Result<Claim, ApiError> {
    let (store, id) = (store.clone(), id.to_string());
    match tokio::task::spawn_blocking(move || store.claim(&id, wait)).await {
        Ok(r) => r.map_err(shared_error),
        Err(e) => Err(ApiError::internal(format!(
            "taking the context's lease: {e}"
        ))),
    }
}

/// The generation sent to the engine thread, once the model is the one served, the server is
/// not shutting down and the queue has a place: the receiver of its events.
fn queue(
    st: &AppState,
    owner: Option<String>,
    context: Option<String>,
    claim: Option<Claim>,
    request: GenerationRequest,
) -> Result<mpsc::UnboundedReceiver<Event>, ApiError> {
    if let Some(m) = &request.model
        && m != &st.cfg.model_name
    {
        return Err(ApiError::not_found(format!(
            "model '{m}' is not served here (this server serves '{}')",
            st.cfg.model_name
        )));
    }
    if st.shared.shutdown.load(Ordering::SeqCst) {
        return Err(ApiError::unavailable("the server is shutting down"));
    }
    // Reserve a queue place first, so concurrent requests cannot overshoot the bound.
    let prev = st.shared.waiting.fetch_add(1, Ordering::SeqCst);
    if prev >= st.cfg.queue {
        st.shared.waiting.fetch_sub(1, Ordering::SeqCst);
        return Err(ApiError::too_many(format!(
            "the request queue is full ({} waiting); retry later",
            st.cfg.queue
        )));
    }
    let (etx, erx) = mpsc::unbounded_channel();
    let job = Generate {
        request,
        context,
        claim,
        owner,
        events: etx,
        received: Instant::now(),
    };
    if st.tx.send(Request::Generate(Box::new(job))).is_err() {
        st.shared.waiting.fetch_sub(1, Ordering::SeqCst);
        return Err(ApiError::unavailable("the engine has stopped"));
    }
    Ok(erx)
}

/// The answer as an SSE stream: the chat's role chunks first, a chunk per token and per
/// finished choice (the last one's with the usage), then `[DONE]`.
fn stream_answer(
    header: AnswerHead,
    shape: AnswerShape,
    prompt: PromptUsage,
    erx: mpsc::UnboundedReceiver<Event>,
) -> Response {
    let AnswerShape { n, logprobs } = shape;
    let PromptUsage {
        prompt_tokens,
        cached,
    } = prompt;
    let chat = header.chat;
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
    Sse::new(head.chain(events).chain(done))
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// The answer as one JSON object, once every choice has finished.
async fn collect_answer(
    header: AnswerHead,
    shape: AnswerShape,
    prompt: PromptUsage,
    mut erx: mpsc::UnboundedReceiver<Event>,
) -> Response {
    let AnswerShape { n, logprobs } = shape;
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
                let usage = usage(prompt.prompt_tokens, completion_tokens, prompt.cached);
                let v = header.whole(&choices, logprobs, usage);
                return axum::Json(v).into_response();
            }
        }
    }
    ApiError::internal("the engine stopped before the request finished").into_response()
}
