//! `gpu-offload serve` over real HTTP on loopback: the OpenAI routes, SSE, contexts, limits,
//! authentication, concurrency, disconnects, and restarts after `kill -9`.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

struct Server {
    child: Child,
    base: String,
}

impl Server {
    fn start(model: &Path, extra: &[&str]) -> Server {
        Self::start_env(model, extra, &[])
    }

    fn start_env(model: &Path, extra: &[&str], env: &[(&str, &str)]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_gpu-offload"))
            .envs(env.iter().copied())
            .arg("serve")
            .arg("--model")
            .arg(model)
            .args(["--port", "0", "--device", "cpu", "--threads", "2"])
            .args(extra)
            .env_remove("GPU_OFFLOAD_API_KEY")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start server");
        let stdout = child.stdout.take().expect("stdout");
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line).expect("read");
        let addr = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("server did not start: {line:?}"))
            .to_string();
        Server { child, base: addr }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    fn kill9(mut self) {
        self.child.kill().ok();
        self.child.wait().ok();
    }

    /// SIGTERM, then wait for a clean exit.
    fn stop(mut self) {
        let pid = self.child.id() as i32;
        unsafe {
            libc::kill(pid, libc::SIGTERM);
        }
        let t = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().expect("wait") {
                assert!(st.success(), "server exited with {st}");
                return;
            }
            assert!(t.elapsed() < Duration::from_secs(60), "server did not stop");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.child.kill().ok();
        self.child.wait().ok();
    }
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(120)))
        .build()
        .into()
}

/// (status, JSON body) of a request; `body` None = GET, Some = POST.
fn call(method: &str, url: &str, body: Option<&str>, key: Option<&str>) -> (u16, Value) {
    let a = agent();
    let auth = key.map(|k| format!("Bearer {k}"));
    let mut resp = match (method, body) {
        ("GET", _) => {
            let mut r = a.get(url);
            if let Some(h) = &auth {
                r = r.header("Authorization", h);
            }
            r.call()
        }
        ("DELETE", _) => {
            let mut r = a.delete(url);
            if let Some(h) = &auth {
                r = r.header("Authorization", h);
            }
            r.call()
        }
        (_, b) => {
            let mut r = a.post(url).header("Content-Type", "application/json");
            if let Some(h) = &auth {
                r = r.header("Authorization", h);
            }
            r.send(b.unwrap_or(""))
        }
    }
    .unwrap_or_else(|e| panic!("{method} {url}: {e}"));
    let status = resp.status().as_u16();
    let text = resp.body_mut().read_to_string().expect("body");
    let v = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, v)
}

/// The text `gpu-offload run --json` generates greedily on the CPU.
fn run_greedy(model: &Path, n: usize, args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_gpu-offload"))
        .args([
            "run",
            "--device",
            "cpu",
            "--temperature",
            "0",
            "--json",
            "-n",
        ])
        .arg(n.to_string())
        .args(args)
        .arg("-m")
        .arg(model)
        .output()
        .expect("run");
    let v: Value = serde_json::from_slice(&out.stdout).expect("run json");
    v["text"].as_str().expect("text").to_string()
}

fn post(url: &str, body: Value) -> (u16, Value) {
    call("POST", url, Some(&body.to_string()), None)
}

fn text_of(v: &Value) -> String {
    let c = &v["choices"][0];
    c["text"]
        .as_str()
        .or_else(|| c["message"]["content"].as_str())
        .unwrap_or_else(|| panic!("no text in {v}"))
        .to_string()
}

/// The data lines of an SSE response.
fn sse(url: &str, body: Value) -> Vec<String> {
    let mut resp = agent()
        .post(url)
        .header("Content-Type", "application/json")
        .send(body.to_string())
        .expect("stream");
    assert_eq!(resp.status().as_u16(), 200);
    let text = resp.body_mut().read_to_string().expect("body");
    text.lines()
        .filter_map(|l| l.strip_prefix("data: ").map(str::to_string))
        .collect()
}

fn assert_error(status: u16, v: &Value, want: u16, needle: &str) {
    assert_eq!(status, want, "{v}");
    let msg = v["error"]["message"]
        .as_str()
        .unwrap_or_else(|| panic!("no OpenAI error in {v}"));
    assert!(v["error"]["type"].is_string(), "{v}");
    assert!(msg.contains(needle), "'{msg}' lacks '{needle}'");
}

fn greedy(prompt: Value, n: usize) -> Value {
    json!({"prompt": prompt, "max_tokens": n, "temperature": 0})
}

#[test]
fn completions_stream_contexts_and_bad_input() {
    let model = common::stories260k();
    let s = Server::start(
        &model,
        &[
            "--ctx-size",
            "256",
            "--parallel",
            "2",
            "--kv-compression",
            "off",
        ],
    );

    // Health, models.
    let (st, v) = call("GET", &s.url("/health"), None, None);
    assert_eq!((st, v["status"].as_str()), (200, Some("ok")));
    let (st, v) = call("GET", &s.url("/v1/models"), None, None);
    assert_eq!(st, 200);
    assert_eq!(v["data"][0]["id"], "stories260K-f32");

    // A completion equals `gpu-offload run` (greedy).
    let (st, v) = post(
        &s.url("/v1/completions"),
        greedy(json!("Once upon a time"), 24),
    );
    assert_eq!(st, 200, "{v}");
    let text = text_of(&v);
    let run = run_greedy(&model, 24, &["-p", "Once upon a time"]);
    assert_eq!(text, run, "server and run differ");
    assert_eq!(v["usage"]["completion_tokens"], 24);

    // Streaming gives the same text, then [DONE].
    let lines = sse(
        &s.url("/v1/completions"),
        json!({"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "stream": true}),
    );
    assert_eq!(lines.last().map(String::as_str), Some("[DONE]"));
    let mut streamed = String::new();
    let mut finish = None;
    for l in &lines[..lines.len() - 1] {
        let v: Value = serde_json::from_str(l).expect("chunk json");
        streamed.push_str(v["choices"][0]["text"].as_str().unwrap_or(""));
        if let Some(f) = v["choices"][0]["finish_reason"].as_str() {
            finish = Some(f.to_string());
        }
    }
    assert_eq!(streamed, text);
    assert_eq!(finish.as_deref(), Some("length"));

    // Contexts: two calls on a context continue the conversation exactly as one prompt would.
    let (st, c) = post(&s.url("/v1/contexts"), json!({}));
    assert_eq!(st, 201, "{c}");
    let id = c["id"].as_str().unwrap().to_string();
    let a: Vec<u32> = vec![1, 403, 407, 261, 378];
    let (st, v1) = post(
        &s.url(&format!("/v1/contexts/{id}/completions")),
        greedy(json!(a), 20),
    );
    assert_eq!(st, 200, "{v1}");
    let (_, info) = call("GET", &s.url(&format!("/v1/contexts/{id}")), None, None);
    let conv: Vec<u32> = common::ids(&info["token_ids"]);
    assert_eq!(conv.len(), 25);
    // Push the context off the device: other contexts take both slots.
    for p in ["Lily", "Tom"] {
        let (_, o) = post(&s.url("/v1/contexts"), json!({}));
        let url = s.url(&format!(
            "/v1/contexts/{}/completions",
            o["id"].as_str().unwrap()
        ));
        let (st, _) = post(&url, greedy(json!(p), 30));
        assert_eq!(st, 200);
    }
    let (_, info) = call("GET", &s.url(&format!("/v1/contexts/{id}")), None, None);
    assert_eq!(info["resident"], false, "{info}");
    let b: Vec<u32> = vec![13, 157];
    let (st, v2) = post(
        &s.url(&format!("/v1/contexts/{id}/completions")),
        greedy(json!(b), 20),
    );
    assert_eq!(st, 200, "{v2}");
    let mut whole = conv.clone();
    whole.extend(&b);
    let (_, reference) = post(&s.url("/v1/completions"), greedy(json!(whole), 20));
    assert_eq!(
        text_of(&v2),
        text_of(&reference),
        "a restored context differs"
    );
    let (_, info) = call("GET", &s.url(&format!("/v1/contexts/{id}")), None, None);
    let restore = &info["last_restore"];
    assert!(
        restore["chunks_from_dram"].as_u64().unwrap()
            + restore["chunks_from_disk"].as_u64().unwrap()
            + restore["chunks_recomputed"].as_u64().unwrap()
            > 0,
        "the context was not restored: {info}"
    );
    assert_eq!(
        info["chunks"]["bits"]["32"], info["chunks"]["total"],
        "compression off"
    );

    // Bad input: each gets its 4xx and the server keeps serving.
    let comp = s.url("/v1/completions");
    let raw = |body: &str| call("POST", &comp, Some(body), None);
    let (st, v) = raw("{\"prompt\": ");
    assert_error(st, &v, 400, "not valid JSON");
    let (st, v) = raw("{\"prompt\": 12}");
    assert_error(st, &v, 400, "prompt");
    let (st, v) = raw("{\"prompt\": \"x\", \"max_tokens\": -5}");
    assert_error(st, &v, 400, "max_tokens");
    let (st, v) = raw("{\"prompt\": \"x\", \"max_tokens\": 100000000000}");
    assert_error(st, &v, 400, "max_tokens");
    let (st, v) = raw("{\"prompt\": \"x\", \"temperature\": \"warm\"}");
    assert_error(st, &v, 400, "temperature");
    let (st, v) = raw("{\"prompt\": \"x\", \"n\": 4}");
    assert_error(st, &v, 400, "'n'");
    let (st, v) = raw("{\"prompt\": \"x\", \"frobnicate\": true}");
    assert_error(st, &v, 400, "frobnicate");
    let (st, v) = raw("{\"prompt\": [1, 999999]}");
    assert_error(st, &v, 400, "vocabulary");
    let long = "Once upon a time there was a dog. ".repeat(60);
    let (st, v) = post(&comp, json!({"prompt": long, "max_tokens": 4}));
    assert_error(st, &v, 400, "tokens");
    let (st, v) = post(
        &s.url("/v1/chat/completions"),
        json!({"messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_error(st, &v, 400, "chat template");
    let (st, v) = post(
        &s.url("/v1/contexts/ctx-nope/completions"),
        greedy(json!("x"), 2),
    );
    assert_error(st, &v, 404, "ctx-nope");
    let (st, v) = call("GET", &s.url("/v1/contexts/ctx-nope"), None, None);
    assert_error(st, &v, 404, "ctx-nope");
    let (st, v) = post(&s.url("/v1/contexts"), json!({"system_prompt": 7}));
    assert_error(st, &v, 400, "system_prompt");
    let (st, v) = post(&comp, json!({"prompt": "x", "model": "gpt-9"}));
    assert_error(st, &v, 404, "gpt-9");
    let (st, v) = call("GET", &s.url("/v1/nothing"), None, None);
    assert_error(st, &v, 404, "route");
    let (st, v) = call("GET", &comp, None, None);
    assert_error(st, &v, 405, "method");

    // Delete: gone afterwards.
    let (st, _) = call("DELETE", &s.url(&format!("/v1/contexts/{id}")), None, None);
    assert_eq!(st, 200);
    let (st, _) = call("GET", &s.url(&format!("/v1/contexts/{id}")), None, None);
    assert_eq!(st, 404);

    // Still serving, and the metrics saw it all.
    let (st, v) = post(&comp, greedy(json!("Once upon a time"), 24));
    assert_eq!((st, text_of(&v)), (200, text));
    let (st, m) = call("GET", &s.url("/metrics"), None, None);
    assert_eq!(st, 200);
    let m = m.as_str().unwrap().to_string();
    for name in [
        "gpu_offload_time_to_first_token_seconds_bucket",
        "gpu_offload_inter_token_latency_seconds_bucket",
        "gpu_offload_tokens_per_second",
        "gpu_offload_queue_depth",
        "gpu_offload_kv_chunks{tier=\"disk\"}",
        "gpu_offload_kv_events_total{event=\"swap_in\"}",
        "gpu_offload_prefix_cache_hit_tokens_total",
        "gpu_offload_requests_total{route=\"/v1/completions\",status=\"400\"}",
    ] {
        assert!(m.contains(name), "metrics lack {name}");
    }
    s.stop();
}

#[test]
fn concurrent_clients_queue_limits_and_disconnects() {
    let model = common::stories260k();
    let s = Server::start(
        &model,
        &["--ctx-size", "512", "--parallel", "2", "--queue", "8"],
    );
    let prompts = [
        "Once", "Lily", "Tom", "The dog", "A cat", "One day", "The sun", "Mom",
    ];
    let expected: Vec<String> = prompts
        .iter()
        .map(|p| text_of(&post(&s.url("/v1/completions"), greedy(json!(p), 32)).1))
        .collect();
    // 8 clients at once (2 run, the rest queue): each gets exactly its sequential answer.
    let got: Vec<String> = std::thread::scope(|sc| {
        let hs: Vec<_> = prompts
            .iter()
            .map(|p| {
                let url = s.url("/v1/completions");
                sc.spawn(move || {
                    let (st, v) = post(&url, greedy(json!(p), 32));
                    assert_eq!(st, 200, "{v}");
                    text_of(&v)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(got, expected);
    s.stop();

    // One slot, one queue place: a long stream holds the slot, one request waits, the next
    // is refused with 429; hanging up the stream frees the slot for the waiting one.
    let s = Server::start(
        &model,
        &["--ctx-size", "512", "--parallel", "1", "--queue", "1"],
    );
    let addr = s.base.trim_start_matches("http://").to_string();
    let mut stream = TcpStream::connect(&addr).expect("connect");
    let body = json!({"prompt": "Once", "max_tokens": 100000, "stream": true, "ignore_eos": true, "max_tokens": 4000}).to_string();
    write!(
        stream,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut first = [0u8; 256];
    let n = stream.read(&mut first).expect("first bytes");
    assert!(
        String::from_utf8_lossy(&first[..n]).contains("200"),
        "stream did not start"
    );
    let url = s.url("/v1/completions");
    let waiting = std::thread::spawn(move || post(&url, greedy(json!("Lily"), 8)));
    let t = Instant::now();
    loop {
        let (_, m) = call("GET", &s.url("/metrics"), None, None);
        if m.as_str().unwrap().contains("gpu_offload_queue_depth 1") {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the request never queued"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let (st, v) = post(&s.url("/v1/completions"), greedy(json!("Tom"), 8));
    assert_error(st, &v, 429, "queue");
    drop(stream);
    let (st, v) = waiting.join().unwrap();
    assert_eq!(
        st, 200,
        "the waiting request did not get the freed slot: {v}"
    );
    s.stop();
}

#[test]
fn api_keys_guard_routes_and_contexts() {
    let model = common::stories260k();
    let s = Server::start(&model, &["--ctx-size", "128", "--api-key", "alpha,beta"]);
    let (st, _) = call("GET", &s.url("/health"), None, None);
    assert_eq!(st, 200, "/health needs no key");
    let (st, v) = call("GET", &s.url("/v1/models"), None, None);
    assert_error(st, &v, 401, "missing API key");
    let (st, v) = call("GET", &s.url("/metrics"), None, Some("gamma"));
    assert_error(st, &v, 401, "invalid API key");
    let (st, c) = call("POST", &s.url("/v1/contexts"), Some("{}"), Some("alpha"));
    assert_eq!(st, 201);
    let id = c["id"].as_str().unwrap();
    let ctx = s.url(&format!("/v1/contexts/{id}"));
    let (st, _) = call("GET", &ctx, None, Some("alpha"));
    assert_eq!(st, 200);
    let (st, v) = call("GET", &ctx, None, Some("beta"));
    assert_error(st, &v, 404, id);
    let body = greedy(json!("Once"), 4).to_string();
    let (st, _) = call(
        "POST",
        &format!("{ctx}/completions"),
        Some(&body),
        Some("beta"),
    );
    assert_eq!(st, 404);
    let (st, _) = call("DELETE", &ctx, None, Some("beta"));
    assert_eq!(st, 404);
    let (st, v) = call(
        "POST",
        &format!("{ctx}/completions"),
        Some(&body),
        Some("alpha"),
    );
    assert_eq!(st, 200, "{v}");
    s.stop();
}

#[test]
fn chat_with_a_real_template() {
    let Some(model) = common::smollm2() else {
        return;
    };
    let s = Server::start(&model, &["--ctx-size", "512", "--parallel", "1"]);
    let msg = json!([{"role": "user", "content": "What is the capital of France?"}]);
    let (st, v) = post(
        &s.url("/v1/chat/completions"),
        json!({"messages": msg, "max_tokens": 16, "temperature": 0}),
    );
    assert_eq!(st, 200, "{v}");
    let answer = text_of(&v);
    let run = run_greedy(
        &model,
        16,
        &["--chat", "-p", "What is the capital of France?"],
    );
    assert_eq!(answer, run, "server chat and run --chat differ");
    assert_eq!(v["object"], "chat.completion");
    // Streamed chat: role first, then content deltas, then [DONE].
    let lines = sse(
        &s.url("/v1/chat/completions"),
        json!({"messages": msg, "max_tokens": 16, "temperature": 0, "stream": true}),
    );
    let first: Value = serde_json::from_str(&lines[0]).unwrap();
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    let streamed: String = lines[..lines.len() - 1]
        .iter()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["choices"][0]["delta"]["content"]
                .as_str()
                .unwrap_or("")
                .to_string()
        })
        .collect();
    assert_eq!(streamed, answer);
    assert_eq!(lines.last().unwrap(), "[DONE]");
    // A chat context with a system prompt keeps the conversation.
    let (_, c) = post(
        &s.url("/v1/contexts"),
        json!({"system_prompt": "You are a terse geography tutor."}),
    );
    let id = c["id"].as_str().unwrap();
    let url = s.url(&format!("/v1/contexts/{id}/chat/completions"));
    let (st, v) = post(
        &url,
        json!({"messages": msg, "max_tokens": 16, "temperature": 0}),
    );
    assert_eq!(st, 200, "{v}");
    let (st, v2) = post(
        &url,
        json!({"messages": [{"role": "user", "content": "And of Italy?"}], "max_tokens": 16, "temperature": 0}),
    );
    assert_eq!(st, 200, "{v2}");
    let (_, info) = call("GET", &s.url(&format!("/v1/contexts/{id}")), None, None);
    let roles: Vec<&str> = info["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["role"].as_str().unwrap())
        .collect();
    assert_eq!(roles, ["system", "user", "assistant", "user", "assistant"]);
    // The same conversation sent whole gives the same answer.
    let mut all = info["messages"].as_array().unwrap().clone();
    all.pop();
    let (_, whole) = post(
        &s.url("/v1/chat/completions"),
        json!({"messages": all, "max_tokens": 16, "temperature": 0}),
    );
    assert_eq!(text_of(&whole), text_of(&v2));
    s.stop();
}

/// Kill the server right after calls return (while chunks are being written), restart it on
/// the same directory, and check every context answers exactly as an undisturbed server whose
/// contexts saw the same calls.
#[test]
fn contexts_survive_kill_9() {
    let model = common::stories260k();
    let dir = tempfile::tempdir().unwrap();
    let kv = dir.path().join("kv");
    let kv_ref = dir.path().join("kv-ref");
    let args = |d: &Path| -> Vec<String> {
        [
            "--ctx-size",
            "512",
            "--parallel",
            "2",
            "--kv-compression",
            "off",
            "--kv-dir",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([d.to_string_lossy().into_owned()])
        .collect()
    };
    let a = args(&kv);
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    // Every chunk write of a swap-out takes 5 ms: the kills land in the middle of one.
    let slow = [("GPU_OFFLOAD_TEST_SWAP_DELAY_MS", "5")];
    let mut s = Server::start_env(&model, &a, &slow);
    let ids: Vec<String> = (0..3)
        .map(|_| {
            post(&s.url("/v1/contexts"), json!({})).1["id"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    let mut history: Vec<Vec<Vec<u32>>> = vec![Vec::new(); ids.len()];
    let mut lost_total = 0;
    for round in 0..4u32 {
        for (i, id) in ids.iter().enumerate() {
            let prompt: Vec<u32> = (0..(7 + 5 * round + i as u32))
                .map(|t| 1 + (t * 37 + round * 11 + i as u32) % 500)
                .collect();
            let (st, v) = post(
                &s.url(&format!("/v1/contexts/{id}/completions")),
                greedy(json!(prompt), 40),
            );
            assert_eq!(st, 200, "{v}");
            history[i].push(prompt);
        }
        // The last response just arrived: its chunks are being written now.
        std::thread::sleep(Duration::from_millis(1 + (round as u64 * 7) % 20));
        s.kill9();
        s = Server::start_env(&model, &a, &slow);
        for id in &ids {
            let (st, info) = call("GET", &s.url(&format!("/v1/contexts/{id}")), None, None);
            assert_eq!(st, 200, "context {id} lost after kill -9: {info}");
            lost_total += info["lost_chunks_at_load"].as_u64().unwrap();
        }
    }
    // The reference: the same calls on a server never killed.
    let b = args(&kv_ref);
    let b: Vec<&str> = b.iter().map(String::as_str).collect();
    let r = Server::start(&model, &b);
    let probe: Vec<u32> = vec![13, 157, 403];
    for (i, id) in ids.iter().enumerate() {
        let (_, c) = post(&r.url("/v1/contexts"), json!({}));
        let rid = c["id"].as_str().unwrap().to_string();
        for p in &history[i] {
            let (st, _) = post(
                &r.url(&format!("/v1/contexts/{rid}/completions")),
                greedy(json!(p), 40),
            );
            assert_eq!(st, 200);
        }
        let (_, want) = post(
            &r.url(&format!("/v1/contexts/{rid}/completions")),
            greedy(json!(probe), 30),
        );
        let (st, got) = post(
            &s.url(&format!("/v1/contexts/{id}/completions")),
            greedy(json!(probe), 30),
        );
        assert_eq!(st, 200, "{got}");
        assert_eq!(
            text_of(&got),
            text_of(&want),
            "context {i} answers differently after kill -9"
        );
        let (_, info) = call("GET", &s.url(&format!("/v1/contexts/{id}")), None, None);
        eprintln!("context {i}: restore {}", info["last_restore"]);
    }
    eprintln!("chunks found lost (recomputed) after the kills: {lost_total}");
    assert!(
        lost_total > 0,
        "no kill landed during a swap-out: the test proved nothing"
    );
    r.stop();
    s.stop();
}
