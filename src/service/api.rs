//! The OpenAI-compatible request bodies, checked by hand so every mistake gets a 4xx with an
//! OpenAI-style error naming the field, and the errors themselves.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};

use crate::engine::{Penalties, SamplerParams};
use crate::limits::{MAX_LOGIT_BIAS_KEYS, MAX_STOP_BYTES, MAX_STOP_STRINGS};
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

    /// A request (head or body) that did not arrive in time.
    pub fn timeout(message: impl Into<String>) -> Self {
        let mut e = Self::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            message,
        );
        e.code = Some("request_timeout");
        e
    }

    /// A body over [`crate::limits::MAX_REQUEST_BODY_BYTES`].
    pub fn too_large(message: impl Into<String>) -> Self {
        let mut e = Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            message,
        );
        e.code = Some("request_too_large");
        e
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
    /// Text or chat the HTTP side already encoded (off the engine thread), and the field it came
    /// from for errors.
    Encoded {
        tokens: Vec<u32>,
        param: &'static str,
    },
}

impl Input {
    /// The request field errors about the prompt name.
    pub fn param(&self) -> &'static str {
        match self {
            Input::Chat(_) => "messages",
            Input::Encoded { param, .. } => param,
            Input::Text(_) | Input::Tokens(_) => "prompt",
        }
    }
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
    /// Choices to generate (`n`), each from the prompt, choice `i` seeded with `seed + i`.
    pub n: usize,
    /// Report log-probabilities, with this many alternatives per token.
    pub logprobs: Option<usize>,
    /// `presence_penalty`, `frequency_penalty`, `logit_bias` (ids checked against the vocabulary
    /// by the engine thread).
    pub penalties: Penalties,
}

/// The most choices one request may ask for.
pub const MAX_N: u64 = 16;
/// The most alternatives per token: completions' `logprobs`, chat's `top_logprobs`.
pub const MAX_LOGPROBS_COMPLETION: u64 = 5;
pub const MAX_TOP_LOGPROBS_CHAT: u64 = 20;

/// Limits the server enforces on requests.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub max_tokens: usize,
    pub default_max_tokens: usize,
}

/// Fields OpenAI clients send that this server accepts only at their neutral value.
type Check = fn(&Value) -> bool;

const NEUTRAL: &[(&str, Check)] = &[
    ("best_of", |v| v.is_null() || v == &json!(1)),
    ("echo", |v| v.is_null() || v == &json!(false)),
    ("user", |v| v.is_string()),
    ("stream_options", |v| v.is_object() || v.is_null()),
    ("suffix", |v| v.is_null()),
];

/// Fields refused until this server implements them (a request naming nothing is accepted).
const UNIMPLEMENTED: &[(&str, Check, &str)] = &[
    (
        "response_format",
        |v| v.is_null() || v == &json!({"type": "text"}),
        "structured (JSON) output is not implemented by this server; only {\"type\": \"text\"} is accepted",
    ),
    (
        "tools",
        |v| v.is_null() || v.as_array().is_some_and(Vec::is_empty),
        "tool calling is not implemented by this server",
    ),
    (
        "tool_choice",
        |v| v.is_null() || v == &json!("none"),
        "tool calling is not implemented by this server",
    ),
    (
        "parallel_tool_calls",
        |v| v.is_null() || v.is_boolean(),
        "tool calling is not implemented by this server",
    ),
    (
        "functions",
        |v| v.is_null() || v.as_array().is_some_and(Vec::is_empty),
        "function calling is not implemented by this server",
    ),
    (
        "function_call",
        |v| v.is_null() || v == &json!("none"),
        "function calling is not implemented by this server",
    ),
];

const COMMON: &[&str] = &[
    "n",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
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
        if let Some((_, ok, why)) = UNIMPLEMENTED.iter().find(|(n, _, _)| n == k) {
            if ok(v) {
                continue;
            }
            return Err(ApiError::bad_request(
                format!("'{k}' = {} is not supported: {why}", short(v)),
                Some(k),
            ));
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

/// A number within `lo..=hi`, or None when absent.
fn ranged(o: &Map<String, Value>, key: &str, lo: f64, hi: f64) -> Result<Option<f64>, ApiError> {
    match number(o, key)? {
        Some(v) if !(lo..=hi).contains(&v) => Err(ApiError::bad_request(
            format!("'{key}' must be between {lo} and {hi}, got {v}"),
            Some(key),
        )),
        v => Ok(v),
    }
}

/// A count within `lo..=hi`, or None when absent.
fn counted(o: &Map<String, Value>, key: &str, lo: u64, hi: u64) -> Result<Option<u64>, ApiError> {
    match count(o, key)? {
        Some(v) if !(lo..=hi).contains(&v) => Err(ApiError::bad_request(
            format!("'{key}' must be an integer from {lo} to {hi}, got {v}"),
            Some(key),
        )),
        v => Ok(v),
    }
}

fn penalties(o: &Map<String, Value>) -> Result<Penalties, ApiError> {
    let key = "logit_bias";
    let bias = match o.get(key) {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Object(m)) => {
            if !MAX_LOGIT_BIAS_KEYS.admits(m.len() as u64) {
                return Err(ApiError::bad_request(
                    MAX_LOGIT_BIAS_KEYS.refuse("the number of 'logit_bias' keys", m.len() as u64),
                    Some(key),
                ));
            }
            let mut bias = Vec::with_capacity(m.len());
            for (id, v) in m {
                let Ok(t) = id.parse::<u32>() else {
                    return Err(ApiError::bad_request(
                        format!("'{key}' keys must be token ids, got '{id}'"),
                        Some(key),
                    ));
                };
                match v.as_f64() {
                    Some(b) if (-100.0..=100.0).contains(&b) => bias.push((t, b as f32)),
                    _ => {
                        return Err(ApiError::bad_request(
                            format!(
                                "'{key}' values must be numbers from -100 to 100, got {v} for token {t}"
                            ),
                            Some(key),
                        ));
                    }
                }
            }
            bias
        }
        Some(v) => {
            return Err(ApiError::bad_request(
                format!(
                    "'{key}' must be an object of token id → bias, got {}",
                    short(v)
                ),
                Some(key),
            ));
        }
    };
    Ok(Penalties {
        presence: ranged(o, "presence_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32,
        frequency: ranged(o, "frequency_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32,
        bias,
    })
}

fn common(
    o: &Map<String, Value>,
    input: Input,
    limits: Limits,
    logprobs: Option<usize>,
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
        // As OpenAI's API: a request generates at least one token (the CLI's `-n 0` prefills only).
        Some(0) => {
            let mut e = ApiError::bad_request(
                format!(
                    "Invalid '{key}': integer below minimum value. Expected a value >= 1, but got 0 instead."
                ),
                Some(key),
            );
            e.code = Some("integer_below_min_value");
            return Err(e);
        }
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
        Some(Value::Array(a)) if !MAX_STOP_STRINGS.admits(a.len() as u64) => {
            return Err(ApiError::bad_request(
                MAX_STOP_STRINGS.refuse("the number of 'stop' strings", a.len() as u64),
                Some("stop"),
            ));
        }
        Some(Value::Array(a)) if a.iter().all(|s| s.is_string()) => a
            .iter()
            .filter_map(|s| s.as_str().map(str::to_string))
            .collect(),
        Some(v) => {
            return Err(ApiError::bad_request(
                format!(
                    "'stop' must be a string or up to {} strings, got {}",
                    MAX_STOP_STRINGS.value,
                    short(v)
                ),
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
    if let Some(s) = stop.iter().find(|s| !MAX_STOP_BYTES.admits(s.len() as u64)) {
        return Err(ApiError::bad_request(
            MAX_STOP_BYTES.refuse("a 'stop' string's length in bytes", s.len() as u64),
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
        n: counted(o, "n", 1, MAX_N)?.unwrap_or(1) as usize,
        logprobs,
        penalties: penalties(o)?,
    })
}

/// `POST /v1/completions` (and a context's): `prompt` is a string or an array of token ids.
pub fn parse_completion(body: &[u8], limits: Limits) -> Result<GenerationRequest, ApiError> {
    let o = parse_object(body)?;
    check_fields(&o, &["prompt", "logprobs"])?;
    // Completions: `logprobs` is the number of alternatives (0 = the sampled token's only).
    let logprobs = match o.get("logprobs") {
        None | Some(Value::Null) => None,
        Some(Value::Number(n)) if n.as_u64().is_some_and(|n| n <= MAX_LOGPROBS_COMPLETION) => {
            n.as_u64().map(|n| n as usize)
        }
        Some(v) => {
            return Err(ApiError::bad_request(
                format!(
                    "'logprobs' must be an integer from 0 to {MAX_LOGPROBS_COMPLETION} on completions, got {}",
                    short(v)
                ),
                Some("logprobs"),
            ));
        }
    };
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
    common(&o, input, limits, logprobs)
}

/// `POST /v1/chat/completions` (and a context's): `messages` with `role` and string `content`.
pub fn parse_chat(
    body: &[u8],
    limits: Limits,
    allow_empty: bool,
) -> Result<GenerationRequest, ApiError> {
    let o = parse_object(body)?;
    check_fields(&o, &["messages", "logprobs", "top_logprobs"])?;
    // Chat: `logprobs` is a switch, `top_logprobs` the number of alternatives.
    let top = counted(&o, "top_logprobs", 0, MAX_TOP_LOGPROBS_CHAT)?;
    let logprobs = match (boolean(&o, "logprobs")?, top) {
        (true, top) => Some(top.unwrap_or(0) as usize),
        (false, None) => None,
        (false, Some(_)) => {
            return Err(ApiError::bad_request(
                "'top_logprobs' needs 'logprobs': true",
                Some("top_logprobs"),
            ));
        }
    };
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
    common(&o, Input::Chat(messages), limits, logprobs)
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
        assert_eq!((r.n, r.logprobs), (1, None));
    }

    #[test]
    fn openai_fields_parse() {
        let r = parse_completion(
            br#"{"prompt":"hi","n":3,"logprobs":2,"presence_penalty":0.5,"frequency_penalty":-1,"logit_bias":{"7":-100,"9":2.5},"response_format":{"type":"text"},"tools":[]}"#,
            L,
        )
        .unwrap();
        assert_eq!((r.n, r.logprobs), (3, Some(2)));
        assert_eq!(r.penalties.presence, 0.5);
        assert_eq!(r.penalties.frequency, -1.0);
        let mut bias = r.penalties.bias.clone();
        bias.sort_by_key(|b| b.0);
        assert_eq!(bias, vec![(7, -100.0), (9, 2.5)]);
        let r = parse_chat(
            br#"{"messages":[{"role":"user","content":"hi"}],"logprobs":true,"top_logprobs":4}"#,
            L,
            false,
        )
        .unwrap();
        assert_eq!(r.logprobs, Some(4));
        let r = parse_chat(br#"{"messages":[],"logprobs":true}"#, L, true).unwrap();
        assert_eq!(r.logprobs, Some(0));
        let r = parse_chat(br#"{"messages":[],"logprobs":false}"#, L, true).unwrap();
        assert_eq!(r.logprobs, None);
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
            (br#"{"prompt":"a","n":0}"#, "'n'"),
            (br#"{"prompt":"a","n":17}"#, "'n'"),
            (br#"{"prompt":"a","logprobs":6}"#, "'logprobs'"),
            (br#"{"prompt":"a","logprobs":true}"#, "'logprobs'"),
            (
                br#"{"prompt":"a","presence_penalty":2.5}"#,
                "'presence_penalty'",
            ),
            (
                br#"{"prompt":"a","frequency_penalty":"x"}"#,
                "'frequency_penalty'",
            ),
            (br#"{"prompt":"a","logit_bias":{"x":1}}"#, "'logit_bias'"),
            (br#"{"prompt":"a","logit_bias":{"5":101}}"#, "'logit_bias'"),
            (br#"{"prompt":"a","logit_bias":[1]}"#, "'logit_bias'"),
            (
                br#"{"prompt":"a","response_format":{"type":"json_object"}}"#,
                "'response_format'",
            ),
            (
                br#"{"prompt":"a","tools":[{"type":"function"}]}"#,
                "'tools'",
            ),
            (br#"{"prompt":"a","tool_choice":"auto"}"#, "'tool_choice'"),
            (
                br#"{"prompt":"a","functions":[{"name":"f"}]}"#,
                "'functions'",
            ),
            (br#"{"prompt":"a","bogus":1}"#, "bogus"),
            (br#"{"prompt":5}"#, "prompt"),
            (br#"{"max_tokens":5}"#, "prompt"),
            (br#"{"prompt":"a","stream":"yes"}"#, "stream"),
            (br#"{"prompt":"a","max_tokens":0}"#, ">= 1, but got 0"),
            (
                br#"{"prompt":"a","stop":["a","b","c","d","e"]}"#,
                "max_stop_strings",
            ),
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
        for (body, needle) in [
            (
                &br#"{"messages":[],"top_logprobs":2}"#[..],
                "'top_logprobs'",
            ),
            (
                br#"{"messages":[],"logprobs":true,"top_logprobs":21}"#,
                "'top_logprobs'",
            ),
            (br#"{"messages":[],"logprobs":3}"#, "'logprobs'"),
        ] {
            let e = parse_chat(body, L, true).unwrap_err();
            assert!(e.message.contains(needle), "{}", e.message);
            assert_eq!(e.param.as_deref(), Some(&needle[1..needle.len() - 1]));
        }
        assert!(parse_chat(br#"{"messages":[]}"#, L, false).is_err());
    }

    #[test]
    fn stop_strings_and_logit_bias_are_bounded_by_the_limits() {
        let long = "x".repeat(MAX_STOP_BYTES.value as usize + 1);
        let body = json!({"prompt": "a", "stop": [long]}).to_string();
        let e = parse_completion(body.as_bytes(), L).unwrap_err();
        assert!(e.message.contains("max_stop_bytes"), "{}", e.message);
        let ok = "x".repeat(MAX_STOP_BYTES.value as usize);
        let body = json!({"prompt": "a", "stop": [ok]}).to_string();
        assert!(parse_completion(body.as_bytes(), L).is_ok());
        let keys = MAX_LOGIT_BIAS_KEYS.value as usize;
        let bias: Map<String, Value> = (0..=keys).map(|i| (i.to_string(), json!(1))).collect();
        let body = json!({"prompt": "a", "logit_bias": bias}).to_string();
        let e = parse_completion(body.as_bytes(), L).unwrap_err();
        assert!(e.message.contains("max_logit_bias_keys"), "{}", e.message);
        let bias: Map<String, Value> = (0..keys).map(|i| (i.to_string(), json!(1))).collect();
        let body = json!({"prompt": "a", "logit_bias": bias}).to_string();
        assert_eq!(
            parse_completion(body.as_bytes(), L)
                .unwrap()
                .penalties
                .bias
                .len(),
            keys
        );
        let e = parse_chat(
            br#"{"messages":[{"role":"user","content":"hi"}],"max_completion_tokens":0}"#,
            L,
            false,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_completion_tokens"));
    }
}
