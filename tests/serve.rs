//! `gpu-offload serve` over real HTTP on loopback: the OpenAI routes, SSE, contexts, limits,
//! authentication, concurrency, disconnects, and restarts after `kill -9`.

mod common;

use std::io::{Read, Write};
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
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_gpu-offload"));
        cmd.envs(env.iter().copied())
            .arg("serve")
            .arg("--model")
            .arg(model)
            .args(["--port", "0", "--threads", "2"])
            // The CPU unless the test names a device.
            .args(if extra.contains(&"--device") {
                &[][..]
            } else {
                &["--device", "cpu"][..]
            })
            .args(extra)
            .env_remove("GPU_OFFLOAD_API_KEY");
        let (child, base) = common::spawn_serve(cmd);
        Server { child, base }
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
    let raw_chunks = |w: &str| info["chunks"]["bits"][w].as_u64().unwrap();
    assert_eq!(
        raw_chunks("32") + raw_chunks("16"),
        info["chunks"]["total"].as_u64().unwrap(),
        "compression off: every chunk raw (f32, or f16 for an f16 cache): {info}"
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
    let (st, v) = raw("{\"prompt\": \"x\", \"n\": 17}");
    assert_error(st, &v, 400, "'n'");
    let (st, v) = raw("{\"prompt\": \"x\", \"frobnicate\": true}");
    assert_error(st, &v, 400, "frobnicate");
    let (st, v) = raw("{\"prompt\": [1, 999999]}");
    assert_error(st, &v, 400, "vocabulary");
    let long = "Once upon a time there was a dog. ".repeat(60);
    let (st, v) = post(&comp, json!({"prompt": long, "max_tokens": 4}));
    assert_error(st, &v, 400, "tokens");
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

/// Continuous batching: 8 clients at once on 8 slots run in shared decode steps (the metrics
/// show steps of several sequences), and every greedy answer — whole or streamed, its SSE
/// chunks in order — is the one the same request gets alone; on the CPU and on the budgeted
/// device at a third of the model's size.
#[test]
fn eight_clients_share_decode_steps_and_answer_as_alone() {
    let mut models = vec![(common::stories260k(), vec!["--device", "cpu"], 32)];
    // A mixture-of-experts model serves as a dense one does (the tiny synthetic Qwen3-MoE).
    let dir = tempfile::tempdir().unwrap();
    let moe = dir.path().join("tiny-moe.gguf");
    let spec = gpu_offload::model::synth::SynthSpec::preset("tiny-moe").unwrap();
    gpu_offload::model::synth::synthesize_gguf(&spec, &moe, false, None, &mut |_, _| {}).unwrap();
    models.push((moe, vec!["--device", "cpu"], 16));
    if let Some(p) = common::smollm2() {
        models.push((p.clone(), vec!["--device", "cpu"], 16));
        models.push((p, vec!["--device", "sim", "--gpu-mem", "60M"], 16));
    }
    let prompts = [
        "Once", "Lily", "Tom", "The dog", "A cat", "One day", "The sun", "Mom",
    ];
    for (model, device, n) in models {
        let mut args = vec!["--ctx-size", "256", "--parallel", "8", "--queue", "8"];
        args.extend(device.iter().copied());
        let what = format!("{} {device:?}", model.display());
        let s = Server::start(&model, &args);
        let url = s.url("/v1/completions");
        let alone: Vec<String> = prompts
            .iter()
            .map(|p| text_of(&post(&url, greedy(json!(p), n)).1))
            .collect();
        let (whole, streamed): (Vec<String>, Vec<String>) = std::thread::scope(|sc| {
            let hs: Vec<_> = prompts
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    let url = url.clone();
                    sc.spawn(move || {
                        if i % 2 == 0 {
                            let (st, v) = post(&url, greedy(json!(p), n));
                            assert_eq!(st, 200, "{v}");
                            (text_of(&v), true)
                        } else {
                            let mut body = greedy(json!(p), n);
                            body["stream"] = json!(true);
                            let lines = sse(&url, body);
                            assert_eq!(lines.last().map(String::as_str), Some("[DONE]"));
                            let text: String = lines[..lines.len() - 1]
                                .iter()
                                .map(|l| {
                                    let v: Value = serde_json::from_str(l).unwrap();
                                    v["choices"][0]["text"].as_str().unwrap_or("").to_string()
                                })
                                .collect();
                            (text, false)
                        }
                    })
                })
                .collect();
            let got: Vec<(String, bool)> = hs.into_iter().map(|h| h.join().unwrap()).collect();
            (
                got.iter().map(|g| g.0.clone()).collect(),
                got.iter().filter(|g| !g.1).map(|g| g.0.clone()).collect(),
            )
        });
        assert_eq!(
            whole, alone,
            "{what}: answers beside others differ from alone"
        );
        assert_eq!(streamed.len(), 4, "{what}");
        let (_, m) = call("GET", &s.url("/metrics"), None, None);
        let m = m.as_str().unwrap().to_string();
        let value = |name: &str| -> f64 {
            m.lines()
                .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
                .unwrap_or_else(|| panic!("{name} missing from /metrics"))
        };
        let (sum, count) = (
            value("gpu_offload_decode_batch_size_sum"),
            value("gpu_offload_decode_batch_size_count"),
        );
        assert!(
            sum / count > 1.5,
            "{what}: decode steps averaged {} sequences: the clients did not share steps",
            sum / count
        );
        assert!(
            value("gpu_offload_prompts_joined_steps_total") >= 1.0,
            "{what}: no prompt joined a step beside others"
        );
        s.stop();
    }
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

/// The choices of an SSE answer, reassembled by index: (text, per-token logprob entries).
fn sse_choices(lines: &[String], chat: bool) -> Vec<(String, Vec<Value>, Option<String>)> {
    let mut out: Vec<(String, Vec<Value>, Option<String>)> = Vec::new();
    for l in lines.iter().filter(|l| l.as_str() != "[DONE]") {
        let v: Value = serde_json::from_str(l).expect("chunk json");
        for c in v["choices"].as_array().expect("choices") {
            let i = c["index"].as_u64().expect("index") as usize;
            if out.len() <= i {
                out.resize(i + 1, (String::new(), Vec::new(), None));
            }
            let text = if chat {
                c["delta"]["content"].as_str()
            } else {
                c["text"].as_str()
            };
            out[i].0.push_str(text.unwrap_or(""));
            let lp = &c["logprobs"];
            if chat {
                if let Some(a) = lp["content"].as_array() {
                    out[i].1.extend(a.iter().cloned());
                }
            } else if let Some(t) = lp["tokens"].as_array() {
                for (k, tok) in t.iter().enumerate() {
                    out[i].1.push(json!({
                        "token": tok,
                        "logprob": lp["token_logprobs"][k],
                        "top": lp["top_logprobs"][k],
                    }));
                }
            }
            if let Some(f) = c["finish_reason"].as_str() {
                out[i].2 = Some(f.to_string());
            }
        }
    }
    out
}

#[test]
fn openai_fields_logprobs_n_penalties_and_bias() {
    let model = common::stories260k();
    let s = Server::start(&model, &["--ctx-size", "256", "--parallel", "2"]);
    let comp = s.url("/v1/completions");
    let chat = s.url("/v1/chat/completions");
    let prompt = "Once upon a time";

    // Completions logprobs: the greedy token is the most likely alternative; offsets count
    // characters of the completion.
    let (st, plain) = post(&comp, greedy(json!(prompt), 12));
    assert_eq!(st, 200, "{plain}");
    let (st, v) = post(
        &comp,
        json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 3}),
    );
    assert_eq!(st, 200, "{v}");
    assert_eq!(text_of(&v), text_of(&plain));
    let lp = &v["choices"][0]["logprobs"];
    let tokens: Vec<&str> = lp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(tokens.len(), 12);
    assert_eq!(tokens.concat(), text_of(&v));
    let mut at = 0;
    for (k, t) in tokens.iter().enumerate() {
        assert_eq!(lp["text_offset"][k], at, "{lp}");
        at += t.chars().count();
        let chosen = lp["token_logprobs"][k].as_f64().unwrap();
        assert!(chosen <= 0.0);
        let top = lp["top_logprobs"][k].as_object().unwrap();
        assert!(!top.is_empty() && top.len() <= 3, "{top:?}");
        let best = top
            .values()
            .map(|x| x.as_f64().unwrap())
            .fold(f64::MIN, f64::max);
        assert!(
            (best - chosen).abs() < 1e-6,
            "greedy took a less likely token"
        );
    }
    let (_, v0) = post(
        &comp,
        json!({"prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 0}),
    );
    assert_eq!(v0["choices"][0]["logprobs"]["top_logprobs"][0], json!({}));

    // Streamed: the same tokens and log-probabilities, chunk by chunk.
    let lines = sse(
        &comp,
        json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 3, "stream": true}),
    );
    let got = sse_choices(&lines, false);
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].0, text_of(&v));
    let streamed: Vec<&Value> = got[0].1.iter().map(|e| &e["logprob"]).collect();
    let whole: Vec<&Value> = lp["token_logprobs"].as_array().unwrap().iter().collect();
    assert_eq!(streamed, whole);

    // Chat logprobs (stories260K has no template: ChatML), plain and streamed.
    let msgs = json!([{"role": "user", "content": "Tell me a story."}]);
    let (st, c) = post(
        &chat,
        json!({"messages": msgs, "max_tokens": 8, "temperature": 0, "logprobs": true, "top_logprobs": 2}),
    );
    assert_eq!(st, 200, "{c}");
    let content = c["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(
        content.len() as u64,
        c["usage"]["completion_tokens"].as_u64().unwrap()
    );
    for e in content {
        let bytes: Vec<u8> = e["bytes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b.as_u64().unwrap() as u8)
            .collect();
        assert_eq!(
            String::from_utf8_lossy(&bytes),
            e["token"].as_str().unwrap()
        );
        assert_eq!(e["top_logprobs"].as_array().unwrap().len(), 2);
        assert_eq!(e["top_logprobs"][0]["logprob"], e["logprob"]);
    }
    let lines = sse(
        &chat,
        json!({"messages": msgs, "max_tokens": 8, "temperature": 0, "logprobs": true, "top_logprobs": 2, "stream": true}),
    );
    let got = sse_choices(&lines, true);
    assert_eq!(got[0].0, text_of(&c));
    assert_eq!(&got[0].1, content);

    // n: greedy choices are identical; sampled ones follow seed + index; usage counts all.
    let (st, v) = post(
        &comp,
        json!({"prompt": prompt, "max_tokens": 10, "temperature": 0, "n": 3}),
    );
    assert_eq!(st, 200, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["text"], choices[0]["text"]);
    }
    assert_eq!(v["usage"]["completion_tokens"], 30);
    let sampled = |n: usize, seed: u64| {
        let (st, v) = post(
            &comp,
            json!({"prompt": prompt, "max_tokens": 16, "temperature": 1.0, "seed": seed, "n": n, "ignore_eos": true}),
        );
        assert_eq!(st, 200, "{v}");
        v["choices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["text"].as_str().unwrap().to_string())
            .collect::<Vec<_>>()
    };
    let three = sampled(3, 7);
    assert_eq!(three, sampled(3, 7), "not deterministic");
    assert!(three[0] != three[1] || three[1] != three[2], "{three:?}");
    for (i, t) in three.iter().enumerate() {
        assert_eq!(
            &sampled(1, 7 + i as u64)[0],
            t,
            "choice {i} is not seed + {i}"
        );
    }
    // n streamed: chunks carry their index and reassemble to the same choices.
    let lines = sse(
        &comp,
        json!({"prompt": prompt, "max_tokens": 16, "temperature": 1.0, "seed": 7, "n": 3, "ignore_eos": true, "stream": true}),
    );
    let got = sse_choices(&lines, false);
    let texts: Vec<String> = got.iter().map(|c| c.0.clone()).collect();
    assert_eq!(texts, three);
    assert!(got.iter().all(|c| c.2.as_deref() == Some("length")));
    let last: Value = serde_json::from_str(&lines[lines.len() - 2]).unwrap();
    assert_eq!(last["usage"]["completion_tokens"], 48);
    let lines = sse(
        &chat,
        json!({"messages": msgs, "max_tokens": 6, "temperature": 0, "n": 2, "stream": true}),
    );
    let got = sse_choices(&lines, true);
    assert_eq!(got.len(), 2);
    assert_eq!(got[0].0, got[1].0);

    // Penalties: a strong frequency penalty breaks greedy repetition.
    let (_, rep) = post(&comp, greedy(json!(prompt), 40));
    let (st, pen) = post(
        &comp,
        json!({"prompt": prompt, "max_tokens": 40, "temperature": 0, "frequency_penalty": 2.0, "presence_penalty": 1.0, "logprobs": 0}),
    );
    assert_eq!(st, 200, "{pen}");
    assert_ne!(text_of(&pen), text_of(&rep));
    let toks = pen["choices"][0]["logprobs"]["tokens"].as_array().unwrap();
    let distinct: std::collections::HashSet<&str> =
        toks.iter().map(|t| t.as_str().unwrap()).collect();
    assert!(
        distinct.len() * 10 >= toks.len() * 7,
        "penalized text repeats: {toks:?}"
    );

    // logit_bias: +100 forces a token (log-probability ~0 after the bias), -100 bans one.
    let (st, v) = post(
        &comp,
        json!({"prompt": prompt, "max_tokens": 5, "temperature": 0, "logit_bias": {"403": 100}, "logprobs": 1}),
    );
    assert_eq!(st, 200, "{v}");
    let lp = &v["choices"][0]["logprobs"];
    let forced = lp["tokens"][0].clone();
    for k in 0..5 {
        assert_eq!(lp["tokens"][k], forced);
        assert!(lp["token_logprobs"][k].as_f64().unwrap() > -1e-3, "{lp}");
    }
    // The greedy first token's id (a context shows its token ids), banned: another is taken.
    let (_, c) = post(&s.url("/v1/contexts"), json!({}));
    let ctx = format!("/v1/contexts/{}", c["id"].as_str().unwrap());
    let (_, one) = post(
        &s.url(&format!("{ctx}/completions")),
        greedy(json!(prompt), 1),
    );
    let (_, info) = call("GET", &s.url(&ctx), None, None);
    let greedy_id = *common::ids(&info["token_ids"]).last().unwrap();
    let (st, banned) = post(
        &comp,
        json!({"prompt": prompt, "max_tokens": 1, "temperature": 0, "logit_bias": {greedy_id.to_string(): -100}}),
    );
    assert_eq!(st, 200, "{banned}");
    assert_ne!(text_of(&banned), text_of(&one));
    // Bad values: 400 naming the field; unimplemented fields refused clearly.
    for (body, field) in [
        (json!({"prompt": "x", "n": 17}), "'n'"),
        (json!({"prompt": "x", "n": 0}), "'n'"),
        (json!({"prompt": "x", "logprobs": 6}), "'logprobs'"),
        (
            json!({"prompt": "x", "presence_penalty": 3}),
            "'presence_penalty'",
        ),
        (
            json!({"prompt": "x", "frequency_penalty": -2.5}),
            "'frequency_penalty'",
        ),
        (
            json!({"prompt": "x", "logit_bias": {"512": 1}}),
            "'logit_bias'",
        ),
        (
            json!({"prompt": "x", "logit_bias": {"5": 200}}),
            "'logit_bias'",
        ),
        (
            json!({"prompt": "x", "logit_bias": {"five": 1}}),
            "'logit_bias'",
        ),
        (
            json!({"prompt": "x", "response_format": {"type": "json_object"}}),
            "'response_format'",
        ),
    ] {
        let (st, v) = post(&comp, body.clone());
        assert_error(st, &v, 400, field);
        assert_eq!(v["error"]["param"], field.trim_matches('\''), "{body}");
    }
    for (body, field) in [
        (
            json!({"messages": msgs, "top_logprobs": 2}),
            "'top_logprobs'",
        ),
        (
            json!({"messages": msgs, "logprobs": true, "top_logprobs": 21}),
            "'top_logprobs'",
        ),
        (
            json!({"messages": msgs, "tools": [{"type": "function", "function": {"name": "f"}}]}),
            "'tools'",
        ),
        (
            json!({"messages": msgs, "tool_choice": "auto"}),
            "'tool_choice'",
        ),
        (
            json!({"messages": msgs, "functions": [{"name": "f"}]}),
            "'functions'",
        ),
        (
            json!({"messages": msgs, "response_format": {"type": "json_schema"}}),
            "'response_format'",
        ),
    ] {
        let (st, v) = post(&chat, body.clone());
        assert_error(st, &v, 400, field);
    }
    let (_, c) = post(&s.url("/v1/contexts"), json!({}));
    let url = s.url(&format!(
        "/v1/contexts/{}/completions",
        c["id"].as_str().unwrap()
    ));
    let (st, v) = post(&url, json!({"prompt": "x", "n": 2}));
    assert_error(st, &v, 400, "'n'");
    s.stop();
}

#[test]
fn chat_without_a_template_is_chatml() {
    let model = common::stories260k();
    let s = Server::start(&model, &["--ctx-size", "256", "--parallel", "1"]);
    let msgs = json!([
        {"role": "system", "content": "You tell stories."},
        {"role": "user", "content": "Once upon a time"},
    ]);
    let (st, c) = post(
        &s.url("/v1/chat/completions"),
        json!({"messages": msgs, "max_tokens": 16, "temperature": 0}),
    );
    assert_eq!(st, 200, "{c}");
    let chatml = "<|im_start|>system\nYou tell stories.<|im_end|>\n<|im_start|>user\nOnce upon a time<|im_end|>\n<|im_start|>assistant\n";
    let (st, v) = post(&s.url("/v1/completions"), greedy(json!(chatml), 16));
    assert_eq!(st, 200, "{v}");
    assert_eq!(text_of(&c), text_of(&v));
    assert_eq!(c["usage"]["prompt_tokens"], v["usage"]["prompt_tokens"]);
    s.stop();
}

/// Start a long call on a context over raw TCP, read its first bytes, hang up.
fn hang_up_mid_call(base: &str, path: &str, body: &Value) {
    drop(start_call(base, path, body));
}

/// Send a call and return its connection once the call is under way (for a streamed call, once
/// its first bytes came back); dropping the connection hangs up.
fn start_call(base: &str, path: &str, body: &Value) -> TcpStream {
    let addr = base.trim_start_matches("http://").to_string();
    let mut stream = TcpStream::connect(&addr).expect("connect");
    let body = body.to_string();
    write!(
        stream,
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    if body.contains("\"stream\":true") {
        let mut first = [0u8; 256];
        let n = stream.read(&mut first).expect("first bytes");
        assert!(
            String::from_utf8_lossy(&first[..n]).contains("200"),
            "the call did not start"
        );
    } else {
        // Nothing comes back before the end: give the call time to be well under way.
        std::thread::sleep(Duration::from_millis(300));
    }
    stream
}

/// A server of 2 slots of 512 positions, compression off, whose decode steps take 5 ms (so a
/// long call is surely still running when a test acts), with `extra` flags.
fn slow_server(model: &Path, extra: &[&str]) -> Server {
    let mut args = vec![
        "--ctx-size",
        "512",
        "--parallel",
        "2",
        "--kv-compression",
        "off",
    ];
    args.extend_from_slice(extra);
    Server::start_env(model, &args, &[("GPU_OFFLOAD_TEST_STEP_DELAY_MS", "5")])
}

/// Ahead-of-time swap-out waits for an idle engine: a context call that ends while another
/// call runs leaves its chunks unwritten (the running call is not held up by the write); once
/// the engine falls idle they are written, with no further call on the context.
#[test]
fn a_contexts_chunks_are_written_when_the_engine_falls_idle() {
    let model = common::stories260k();
    let dir = tempfile::tempdir().unwrap();
    let kv = dir.path().to_string_lossy().into_owned();
    // The long call surely outlasts the context's call.
    let s = slow_server(&model, &["--kv-dir", &kv]);
    let (_, c) = post(&s.url("/v1/contexts"), json!({}));
    let id = c["id"].as_str().unwrap().to_string();
    let info = || call("GET", &s.url(&format!("/v1/contexts/{id}")), None, None).1;
    let mut long = greedy(json!("Once"), 4000);
    long["ignore_eos"] = json!(true);
    long["stream"] = json!(true);
    let running = start_call(&s.base, "/v1/completions", &long);
    let (st, v) = post(
        &s.url(&format!("/v1/contexts/{id}/completions")),
        greedy(json!("Once upon a time there was a little girl"), 30),
    );
    assert_eq!(st, 200, "{v}");
    let now = info();
    let chunks = now["evaluated_tokens"].as_u64().unwrap().div_ceil(16);
    assert!(chunks >= 2, "{now}");
    assert_eq!(
        (&now["chunks"]["on_disk"], &now["chunks"]["in_dram"]),
        (&json!(0), &json!(0)),
        "written while another call was running: {now}"
    );
    drop(running);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let now = info();
        if now["chunks"]["on_disk"].as_u64() == Some(chunks)
            && now["chunks"]["in_dram"].as_u64() == Some(chunks)
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the idle engine did not write the context: {now}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    s.stop();
}

#[test]
fn a_cancelled_call_leaves_its_context_as_before() {
    let model = common::stories260k();
    // A call of hundreds of tokens is surely running at the hang-up.
    let s = slow_server(&model, &[]);
    // Two contexts with the same conversation: A is disturbed, B is not.
    let mut ids = Vec::new();
    for _ in 0..2 {
        let (_, c) = post(&s.url("/v1/contexts"), json!({}));
        let id = c["id"].as_str().unwrap().to_string();
        let (st, v) = post(
            &s.url(&format!("/v1/contexts/{id}/completions")),
            greedy(json!("Once upon a time"), 20),
        );
        assert_eq!(st, 200, "{v}");
        ids.push(id);
    }
    let info = |id: &str| call("GET", &s.url(&format!("/v1/contexts/{id}")), None, None).1;
    let before = info(&ids[0]);
    assert_eq!(before["token_ids"], info(&ids[1])["token_ids"]);
    let long = json!({"prompt": " The dog", "max_tokens": 4000, "ignore_eos": true, "temperature": 0, "stream": true});
    let path = format!("/v1/contexts/{}/completions", ids[0]);
    hang_up_mid_call(&s.base, &path, &long);
    // The follow-up waits for the cancelled call on the same context, then continues from
    // the conversation as it was.
    let follow = greedy(json!(" Lily"), 16);
    let (st, a) = post(&s.url(&path), follow.clone());
    assert_eq!(st, 200, "{a}");
    let (_, b) = post(
        &s.url(&format!("/v1/contexts/{}/completions", ids[1])),
        follow.clone(),
    );
    assert_eq!(
        text_of(&a),
        text_of(&b),
        "the cancelled call changed the context"
    );
    assert_eq!(a["usage"]["prompt_tokens"], b["usage"]["prompt_tokens"]);
    assert_eq!(info(&ids[0])["token_ids"], info(&ids[1])["token_ids"]);

    // The same for a call that does not stream.
    let mut quiet = long.clone();
    quiet["stream"] = json!(false);
    hang_up_mid_call(&s.base, &path, &quiet);
    let follow = greedy(json!(" Tom"), 16);
    let (st, a) = post(&s.url(&path), follow.clone());
    assert_eq!(st, 200, "{a}");
    let (_, b) = post(
        &s.url(&format!("/v1/contexts/{}/completions", ids[1])),
        follow,
    );
    assert_eq!(
        text_of(&a),
        text_of(&b),
        "the cancelled call changed the context"
    );
    assert_eq!(info(&ids[0])["token_ids"], info(&ids[1])["token_ids"]);

    // A chat call cancelled the same way keeps the messages too.
    let (_, c) = post(&s.url("/v1/contexts"), json!({"system_prompt": "Stories."}));
    let cid = c["id"].as_str().unwrap().to_string();
    let chat = format!("/v1/contexts/{cid}/chat/completions");
    let msg = json!([{"role": "user", "content": "Once upon a time"}]);
    let (st, _) = post(
        &s.url(&chat),
        json!({"messages": msg, "max_tokens": 8, "temperature": 0}),
    );
    assert_eq!(st, 200);
    let before = info(&cid);
    hang_up_mid_call(
        &s.base,
        &chat,
        &json!({"messages": msg, "max_tokens": 4000, "ignore_eos": true, "stream": true}),
    );
    // Any later call on the context runs after the cancelled one.
    let (st, _) = post(
        &s.url(&format!("/v1/contexts/{cid}/completions")),
        greedy(json!([13]), 1),
    );
    assert_eq!(st, 200);
    let after = info(&cid);
    assert_eq!(after["messages"], before["messages"]);
    let mut want = common::ids(&before["token_ids"]);
    want.push(13);
    let got = common::ids(&after["token_ids"]);
    assert_eq!(&got[..want.len()], &want[..]);
    assert_eq!(got.len(), want.len() + 1);
    s.stop();
}

/// The official `openai` Python client against the server (scripts/openai-client-check.py):
/// skipped, saying why, where the package is not installed.
#[test]
fn openai_python_client_check() {
    // scripts/test.sh installs the client into a venv and names its python here.
    let python = std::env::var("GPU_OFFLOAD_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
    let has_openai = Command::new(&python)
        .args(["-c", "import openai"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !has_openai {
        println!("skipped: `python3 -c 'import openai'` fails (pip install openai)");
        return;
    }
    let model = common::stories260k();
    let s = Server::start(&model, &["--ctx-size", "256", "--parallel", "2"]);
    let out = Command::new(&python)
        .arg(common::repo().join("scripts/openai-client-check.py"))
        .arg(&s.base)
        .output()
        .expect("run python3");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "openai client check failed:\n{text}");
    assert!(text.contains("all ok"), "{text}");
    s.stop();
}

/// A value of `/metrics`, by its name with labels.
fn metric(s: &Server, name: &str) -> f64 {
    let (_, m) = call("GET", &s.url("/metrics"), None, None);
    let m = m.as_str().unwrap().to_string();
    m.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
        .unwrap_or_else(|| panic!("{name} missing from /metrics"))
}

/// The paged KV pool under pressure (10 blocks of 16 positions, 4 sequences at once): a call
/// that could never fit is refused; calls that do not fit beside the running ones wait and
/// answer as alone; an idle context gives its blocks to a growing sequence and comes back
/// exactly; a client hanging up gives its blocks back at once.
#[test]
fn a_small_kv_pool_queues_calls_and_moves_idle_contexts_out() {
    let model = common::stories260k();
    let args = [
        "--ctx-size",
        "256",
        "--parallel",
        "4",
        "--kv-compression",
        "off",
    ];
    let mut small = args.to_vec();
    small.extend(["--kv-pool-tokens", "160"]);
    let s = Server::start_env(&model, &small, &[("GPU_OFFLOAD_TEST_STEP_DELAY_MS", "2")]);
    let reference = Server::start(&model, &args);
    let url = s.url("/v1/completions");
    let used = |s: &Server| metric(s, "gpu_offload_kv_pool_blocks{state=\"used\"}");
    assert_eq!(
        metric(&s, "gpu_offload_kv_pool_blocks{state=\"free\"}"),
        10.0
    );

    // A client hanging up mid-stream (the first call: nothing else holds blocks) gives its blocks
    // back once the call is dropped.
    let mut stream = greedy(json!("A cat"), 120);
    stream["ignore_eos"] = json!(true);
    stream["stream"] = json!(true);
    hang_up_mid_call(&s.base, "/v1/completions", &stream);
    // The two gauges are read one request apart, and the sequence leaves the active count
    // a moment before its blocks are back: wait for both.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (active, now) = (metric(&s, "gpu_offload_active_sequences"), used(&s));
        if active == 0.0 && now == 0.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "after 10 s the hung-up call still runs ({active} active) or kept its blocks ({now})"
        );
        std::thread::sleep(Duration::from_millis(20));
    }

    // 1 + 200 positions need 13 blocks: never.
    let (st, v) = post(&url, greedy(json!("Once"), 200));
    assert_error(st, &v, 400, "--kv-pool-tokens");

    // Three calls of 5 blocks each at most: two run, the third waits for room.
    let long = |p: &str| {
        let mut b = greedy(json!(p), 70);
        b["ignore_eos"] = json!(true);
        b
    };
    let prompts = ["Once", "Lily", "Tom"];
    let alone: Vec<String> = prompts
        .iter()
        .map(|p| text_of(&post(&reference.url("/v1/completions"), long(p)).1))
        .collect();
    let together: Vec<String> = std::thread::scope(|sc| {
        let hs: Vec<_> = prompts
            .iter()
            .map(|p| {
                let url = url.clone();
                sc.spawn(move || {
                    let (st, v) = post(&url, long(p));
                    assert_eq!(st, 200, "{v}");
                    text_of(&v)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(together, alone, "answers that waited for the pool differ");

    // A context, idle on the device, then a stateless call growing to 9 of the 10 blocks: the
    // context's blocks go to it, and its next call swaps it back in.
    let mut answers = Vec::new();
    for srv in [&s, &reference] {
        let (_, c) = post(&srv.url("/v1/contexts"), json!({}));
        let id = c["id"].as_str().unwrap().to_string();
        let path = srv.url(&format!("/v1/contexts/{id}/completions"));
        let (st, first) = post(&path, greedy(json!("Once upon a time"), 20));
        assert_eq!(st, 200, "{first}");
        let mut big = greedy(json!("The dog"), 140);
        big["ignore_eos"] = json!(true);
        let (st, v) = post(&srv.url("/v1/completions"), big);
        assert_eq!(st, 200, "{v}");
        let (st, second) = post(&path, greedy(json!(" Lily"), 20));
        assert_eq!(st, 200, "{second}");
        answers.push((text_of(&first), text_of(&second)));
    }
    assert_eq!(
        answers[0], answers[1],
        "a context moved out by the pool came back changed"
    );
    assert!(metric(&s, "gpu_offload_kv_pool_evictions_total") >= 1.0);
    assert!(metric(&s, "gpu_offload_kv_events_total{event=\"swap_in\"}") >= 1.0);

    s.stop();
    reference.stop();
}

/// `serve --cuda-graphs` on the budgeted device: one client decodes through recorded steps (the
/// counts in /metrics), answering as `run` does greedily.
#[test]
fn one_client_decodes_through_recorded_steps() {
    let Some(model) = common::smollm2() else {
        return;
    };
    let s = Server::start(
        &model,
        &["--device", "sim", "--ctx-size", "256", "--cuda-graphs"],
    );
    let prompt = "The capital of France is";
    let (st, v) = post(&s.url("/v1/completions"), greedy(json!(prompt), 24));
    assert_eq!(st, 200, "{v}");
    // The budgeted device keeps an f16 cache; its math is the CPU's.
    let want = run_greedy(&model, 24, &["-p", prompt, "--kv-type", "f16"]);
    assert_eq!(text_of(&v), want);
    let (_, metrics) = call("GET", &s.url("/metrics"), None, None);
    let metrics = metrics.as_str().expect("metrics text").to_string();
    let count = |event: &str| -> u64 {
        let key = format!("gpu_offload_decode_steps_recorded_total{{event=\"{event}\"}} ");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(&key))
            .unwrap_or_else(|| panic!("no {key} in /metrics"))
            .trim()
            .parse()
            .expect("a count")
    };
    // 23 decode steps after the prompt's: one plain, one recorded, the rest replayed.
    assert_eq!((count("recorded"), count("replayed")), (1, 21));
    s.stop();
}
