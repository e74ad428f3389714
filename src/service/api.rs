//! The OpenAI-compatible request bodies, checked by hand so every mistake gets a 4xx with an
//! OpenAI-style error naming the field, and the errors themselves.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};

use crate::engine::SamplerParams;
use crate::model::ChatMessage;

/// An error as OpenAI's API returns it: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Clone, Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
        }
    }

    pub fn bad_request(message: impl Into<String>, param: Option<&str>) -> Self {
        let mut e = Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message);
        e.param = param.map(str::to_string);
        e
    }

    pub fn unauthorized(message: impl Into<String>) -> Self {
        let mut e = Self::new(StatusCode::UNAUTHORIZED, "authentication_error", message);
        e.code = Some("invalid_api_key");
        e
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found_error", message)
    }

    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, "conflict_error", message)
    }

    pub fn too_many(message: impl Into<String>) -> Self {
        let mut e = Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message);
        e.code = Some("queue_full");
        e
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    pub fn method_not_allowed() -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            "method not allowed on this route",
        )
    }

    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

/// What the model continues: text, token ids, or chat messages.
#[derive(Clone, Debug)]
pub enum Input {
    Text(String),
    Tokens(Vec<u32>),
    Chat(Vec<ChatMessage>),
}

/// A checked generation request.
#[derive(Clone, Debug)]
pub struct GenerationRequest {
    pub model: Option<String>,
    pub input: Input,
    pub max_tokens: usize,
    pub sampler: SamplerParams,
    pub stop: Vec<String>,
    pub stream: bool,
    pub ignore_eos: bool,
}

/// Limits the server enforces on requests.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub max_tokens: usize,
    pub default_max_tokens: usize,
}

/// Fields OpenAI clients send that this server accepts only at their neutral value.
type Check = fn(&Value) -> bool;

const NEUTRAL: &[(&str, Check)] = &[
    ("n", |v| v == &json!(1)),
    ("best_of", |v| v == &json!(1)),
    ("echo", |v| v == &json!(false)),
    ("logprobs", |v| v.is_null() || v == &json!(false)),
    ("top_logprobs", |v| v.is_null()),
    ("presence_penalty", |v| v.as_f64() == Some(0.0)),
    ("frequency_penalty", |v| v.as_f64() == Some(0.0)),
    ("logit_bias", |v| {
        v.as_object().is_some_and(|o| o.is_empty()) || v.is_null()
    }),
    ("user", |v| v.is_string()),
    ("stream_options", |v| v.is_object() || v.is_null()),
    ("suffix", |v| v.is_null()),
];

const COMMON: &[&str] = &[
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stream",
    "ignore_eos",
];

fn parse_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("the body is not valid JSON: {e}"), None))?;
    match v {
        Value::Object(o) => Ok(o),
        _ => Err(ApiError::bad_request(
            "the body must be a JSON object",
            None,
        )),
    }
}

fn check_fields(o: &Map<String, Value>, own: &[&str]) -> Result<(), ApiError> {
    for (k, v) in o {
        if COMMON.contains(&k.as_str()) || own.contains(&k.as_str()) {
            continue;
        }
        match NEUTRAL.iter().find(|(n, _)| n == k) {
            Some((_, ok)) if ok(v) => {}
            Some(_) => {
                return Err(ApiError::bad_request(
                    format!("'{k}' = {v} is not supported by this server"),
                    Some(k),
                ));
            }
            None => {
                return Err(ApiError::bad_request(
                    format!("unrecognized request argument: '{k}'"),
                    Some(k),
                ));
            }
        }
    }
    Ok(())
}

fn number(o: &Map<String, Value>, key: &str) -> Result<Option<f64>, ApiError> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => Ok(n.as_f64()),
        Some(v) => Err(ApiError::bad_request(
            format!("'{key}' must be a number, got {v}"),
            Some(key),
        )),
    }
}

fn count(o: &Map<String, Value>, key: &str) -> Result<Option<u64>, ApiError> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) if n.as_u64().is_some() => Ok(n.as_u64()),
        Some(v) => Err(ApiError::bad_request(
            format!("'{key}' must be a non-negative integer, got {v}"),
            Some(key),
        )),
    }
}

fn boolean(o: &Map<String, Value>, key: &str) -> Result<bool, ApiError> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(ApiError::bad_request(
            format!("'{key}' must be true or false, got {v}"),
            Some(key),
        )),
    }
}

fn common(
    o: &Map<String, Value>,
    input: Input,
    limits: Limits,
) -> Result<GenerationRequest, ApiError> {
    let model = match o.get("model") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(v) => {
            return Err(ApiError::bad_request(
                format!("'model' must be a string, got {v}"),
                Some("model"),
            ));
        }
    };
    let key = if o.contains_key("max_completion_tokens") {
        "max_completion_tokens"
    } else {
        "max_tokens"
    };
    let max_tokens = match count(o, key)? {
        None => limits.default_max_tokens,
        Some(n) if n as usize > limits.max_tokens || n > u32::MAX as u64 => {
            return Err(ApiError::bad_request(
                format!(
                    "'{key}' = {n} exceeds this server's limit of {} tokens",
                    limits.max_tokens
                ),
                Some(key),
            ));
        }
        Some(n) => n as usize,
    };
    let defaults = SamplerParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        seed: rand::random(),
    };
    let sampler = SamplerParams {
        temperature: number(o, "temperature")?.map_or(defaults.temperature, |v| v as f32),
        top_p: number(o, "top_p")?.map_or(defaults.top_p, |v| v as f32),
        min_p: number(o, "min_p")?.map_or(defaults.min_p, |v| v as f32),
        top_k: count(o, "top_k")?.map_or(defaults.top_k, |v| v as usize),
        seed: count(o, "seed")?.unwrap_or(defaults.seed),
    };
    if let Err(msg) = sampler.validate() {
        let param = msg.split_whitespace().next().map(str::to_string);
        return Err(ApiError::bad_request(msg, param.as_deref()));
    }
    let stop = match o.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) if a.len() <= 4 && a.iter().all(|s| s.is_string()) => a
            .iter()
            .filter_map(|s| s.as_str().map(str::to_string))
            .collect(),
        Some(v) => {
            return Err(ApiError::bad_request(
                format!("'stop' must be a string or up to 4 strings, got {v}"),
                Some("stop"),
            ));
        }
    };
    if stop.iter().any(|s| s.is_empty()) {
        return Err(ApiError::bad_request(
            "'stop' strings must not be empty",
            Some("stop"),
        ));
    }
    Ok(GenerationRequest {
        model,
        input,
        max_tokens,
        sampler,
        stop,
        stream: boolean(o, "stream")?,
        ignore_eos: boolean(o, "ignore_eos")?,
    })
}

/// `POST /v1/completions` (and a context's): `prompt` is a string or an array of token ids.
pub fn parse_completion(body: &[u8], limits: Limits) -> Result<GenerationRequest, ApiError> {
    let o = parse_object(body)?;
    check_fields(&o, &["prompt"])?;
    let input = match o.get("prompt") {
        Some(Value::String(s)) => Input::Text(s.clone()),
        Some(Value::Array(a))
            if !a.is_empty()
                && a.iter()
                    .all(|t| t.as_u64().is_some_and(|t| t <= u32::MAX as u64)) =>
        {
            Input::Tokens(
                a.iter()
                    .filter_map(|t| t.as_u64().map(|t| t as u32))
                    .collect(),
            )
        }
        None => {
            return Err(ApiError::bad_request(
                "'prompt' is required",
                Some("prompt"),
            ));
        }
        Some(v) => {
            return Err(ApiError::bad_request(
                format!(
                    "'prompt' must be a string or a non-empty array of token ids, got {}",
                    short(v)
                ),
                Some("prompt"),
            ));
        }
    };
    common(&o, input, limits)
}

/// `POST /v1/chat/completions` (and a context's): `messages` with `role` and string `content`.
pub fn parse_chat(
    body: &[u8],
    limits: Limits,
    allow_empty: bool,
) -> Result<GenerationRequest, ApiError> {
    let o = parse_object(body)?;
    check_fields(&o, &["messages"])?;
    let bad = |msg: String| ApiError::bad_request(msg, Some("messages"));
    let list = match o.get("messages") {
        Some(Value::Array(a)) => a,
        None => return Err(bad("'messages' is required".into())),
        Some(v) => {
            return Err(bad(format!(
                "'messages' must be an array, got {}",
                short(v)
            )));
        }
    };
    if list.is_empty() && !allow_empty {
        return Err(bad("'messages' must not be empty".into()));
    }
    let mut messages = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str);
        let content = m.get("content").and_then(Value::as_str);
        match (role, content) {
            (Some(r @ ("system" | "user" | "assistant")), Some(c)) => messages.push(ChatMessage {
                role: r.into(),
                content: c.into(),
            }),
            (Some(r), Some(_)) => {
                return Err(bad(format!(
                    "messages[{i}].role '{r}' is not system, user or assistant"
                )));
            }
            _ => {
                return Err(bad(format!(
                    "messages[{i}] needs a string 'role' and a string 'content'"
                )));
            }
        }
    }
    common(&o, Input::Chat(messages), limits)
}

/// `POST /v1/contexts`: an optional `system_prompt` string.
pub fn parse_new_context(body: &[u8]) -> Result<Option<String>, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    let o = parse_object(body)?;
    for k in o.keys() {
        if k != "system_prompt" {
            return Err(ApiError::bad_request(
                format!("unrecognized request argument: '{k}'"),
                Some(k),
            ));
        }
    }
    match o.get("system_prompt") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(v) => Err(ApiError::bad_request(
            format!("'system_prompt' must be a string, got {}", short(v)),
            Some("system_prompt"),
        )),
    }
}

fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.chars().count() > 60 {
        format!("{}…", s.chars().take(60).collect::<String>())
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const L: Limits = Limits {
        max_tokens: 100,
        default_max_tokens: 16,
    };

    #[test]
    fn good_requests_parse() {
        let r = parse_completion(
            br#"{"prompt":"hi","max_tokens":5,"temperature":0,"stop":["x"],"n":1}"#,
            L,
        )
        .unwrap();
        assert_eq!(r.max_tokens, 5);
        assert_eq!(r.sampler.temperature, 0.0);
        assert_eq!(r.stop, vec!["x"]);
        let r = parse_completion(br#"{"prompt":[1,2,3]}"#, L).unwrap();
        assert!(matches!(r.input, Input::Tokens(ref t) if t == &[1, 2, 3]));
        assert_eq!(r.max_tokens, 16);
        let r = parse_chat(
            br#"{"messages":[{"role":"user","content":"hi"}],"stream":true}"#,
            L,
            false,
        )
        .unwrap();
        assert!(r.stream);
    }

    #[test]
    fn bad_requests_name_the_field() {
        let cases: &[(&[u8], &str)] = &[
            (b"{not json", "not valid JSON"),
            (b"[1]", "JSON object"),
            (br#"{"prompt":"a","max_tokens":-1}"#, "max_tokens"),
            (br#"{"prompt":"a","max_tokens":1000000}"#, "limit"),
            (br#"{"prompt":"a","temperature":"hot"}"#, "temperature"),
            (br#"{"prompt":"a","temperature":-1}"#, "temperature"),
            (br#"{"prompt":"a","n":3}"#, "'n'"),
            (br#"{"prompt":"a","bogus":1}"#, "bogus"),
            (br#"{"prompt":5}"#, "prompt"),
            (br#"{"max_tokens":5}"#, "prompt"),
            (br#"{"prompt":"a","stream":"yes"}"#, "stream"),
        ];
        for (body, needle) in cases {
            let e = parse_completion(body, L).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST);
            assert!(
                e.message.contains(needle),
                "{}: {}",
                String::from_utf8_lossy(body),
                e.message
            );
        }
        let e = parse_chat(
            br#"{"messages":[{"role":"wizard","content":"x"}]}"#,
            L,
            false,
        )
        .unwrap_err();
        assert!(e.message.contains("wizard"));
        assert!(parse_chat(br#"{"messages":[]}"#, L, false).is_err());
    }
}
