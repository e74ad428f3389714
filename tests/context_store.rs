//! Replicas of `serve` sharing persistent contexts through Redis (`--context-store`): a
//! conversation continues on another replica exactly, calls on one context from both replicas
//! take turns, a replica or the store killed mid-call leaves every context before or after the
//! call, and bad stores are refused. Each test starts its own `redis-server` (Debian's package;
//! `.ci/run` installs it) on a free loopback port; without one the tests skip, saying so.

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// A `redis-server` of this test: its port, its append-only file's directory.
struct Redis {
    child: Child,
    port: u16,
    dir: tempfile::TempDir,
    password: Option<String>,
}

fn redis_binary() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("GPU_OFFLOAD_TEST_REDIS_SERVER") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .flat_map(|d| [d.join("redis-server"), d.join("valkey-server")])
        .find(|p| p.is_file())
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

impl Redis {
    /// A fresh store, or None (printed) where no `redis-server` is installed.
    fn start(password: Option<&str>) -> Option<Redis> {
        let Some(bin) = redis_binary() else {
            eprintln!(
                "skipped: no redis-server on PATH (apt-get install redis-server; .ci/run installs it)"
            );
            return None;
        };
        let dir = tempfile::tempdir().expect("tempdir");
        let port = free_port();
        let child = Self::spawn(&bin, port, dir.path(), password);
        let r = Redis {
            child,
            port,
            dir,
            password: password.map(str::to_string),
        };
        r.wait_ready();
        Some(r)
    }

    /// A store that speaks TLS only, with the certificate `certs` holds (`srv.pem`, `srv.key`).
    fn start_tls(certs: &Path) -> Option<Redis> {
        let bin = redis_binary()?;
        let dir = tempfile::tempdir().expect("tempdir");
        let port = free_port();
        let child = Command::new(bin)
            .args(["--port", "0", "--bind", "127.0.0.1", "--save", ""])
            .args(["--tls-port", &port.to_string(), "--tls-auth-clients", "no"])
            .arg("--tls-cert-file")
            .arg(certs.join("srv.pem"))
            .arg("--tls-key-file")
            .arg(certs.join("srv.key"))
            .arg("--tls-ca-cert-file")
            .arg(certs.join("ca.pem"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server");
        let t = Instant::now();
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "redis-server did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Some(Redis {
            child,
            port,
            dir,
            password: None,
        })
    }

    fn spawn(bin: &Path, port: u16, dir: &Path, password: Option<&str>) -> Child {
        let mut cmd = Command::new(bin);
        cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            // Durable as a deployment would run it: every write in the append-only file first.
            .args([
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
            ])
            .arg("--dir")
            .arg(dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if let Some(p) = password {
            cmd.args(["--requirepass", p]);
        }
        cmd.spawn().expect("start redis-server")
    }

    fn wait_ready(&self) {
        let t = Instant::now();
        loop {
            let pong = TcpStream::connect(("127.0.0.1", self.port))
                .ok()
                .and_then(|mut s| {
                    s.set_read_timeout(Some(Duration::from_millis(500))).ok();
                    s.write_all(b"PING\r\n").ok()?;
                    let mut buf = [0u8; 64];
                    let n = s.read(&mut buf).ok()?;
                    Some(String::from_utf8_lossy(&buf[..n]).into_owned())
                });
            // A server with a password answers NOAUTH: it is up all the same.
            if pong.is_some_and(|p| p.starts_with("+PONG") || p.contains("NOAUTH")) {
                return;
            }
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "redis-server did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn kill9(&mut self) {
        self.child.kill().ok();
        self.child.wait().ok();
    }

    /// Start again on the same port and files (what was written before the kill is kept).
    fn restart(&mut self) {
        let bin = redis_binary().expect("redis-server");
        self.child = Self::spawn(&bin, self.port, self.dir.path(), self.password.as_deref());
        self.wait_ready();
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.kill9();
    }
}

struct Server {
    child: Child,
    base: String,
}

impl Server {
    fn start(model: &Path, store: &str, extra: &[&str], env: &[(&str, &str)]) -> Server {
        Self::start_with(model, Some(store), extra, env)
    }

    /// A server of this test's shape, sharing `store` (None: on its own).
    fn start_with(
        model: &Path,
        store: Option<&str>,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Server {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_gpu-offload"));
        cmd.envs(env.iter().copied())
            .arg("serve")
            .arg("--model")
            .arg(model)
            .args(["--port", "0", "--threads", "1", "--device", "cpu"])
            .args(["--ctx-size", "512", "--parallel", "2"])
            .args(store.map(|s| ["--context-store", s]).iter().flatten())
            .args(extra)
            .env_remove("GPU_OFFLOAD_API_KEY")
            .env_remove("GPU_OFFLOAD_CONTEXT_STORE_PASSWORD");
        let (child, base) = common::spawn_serve(cmd);
        Server { child, base }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    fn kill9(&mut self) {
        self.child.kill().ok();
        self.child.wait().ok();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill9();
    }
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(120)))
        .build()
        .into()
}

fn call(method: &str, url: &str, body: Option<Value>) -> (u16, Value) {
    let a = agent();
    let mut resp = match (method, body) {
        ("GET", _) => a.get(url).call(),
        ("DELETE", _) => a.delete(url).call(),
        (_, b) => a
            .post(url)
            .header("Content-Type", "application/json")
            .send(b.unwrap_or(json!({})).to_string()),
    }
    .unwrap_or_else(|e| panic!("{method} {url}: {e}"));
    let status = resp.status().as_u16();
    let text = resp.body_mut().read_to_string().expect("body");
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

fn post(url: &str, body: Value) -> (u16, Value) {
    call("POST", url, Some(body))
}

fn greedy(prompt: Value, n: usize) -> Value {
    json!({"prompt": prompt, "max_tokens": n, "temperature": 0})
}

fn text_of(v: &Value) -> String {
    v["choices"][0]["text"]
        .as_str()
        .unwrap_or_else(|| panic!("no text in {v}"))
        .to_string()
}

fn new_context(s: &Server) -> String {
    let (st, c) = post(&s.url("/v1/contexts"), json!({}));
    assert_eq!(st, 201, "{c}");
    c["id"].as_str().expect("id").to_string()
}

fn context(s: &Server, id: &str) -> (u16, Value) {
    call("GET", &s.url(&format!("/v1/contexts/{id}")), None)
}

fn turn(s: &Server, id: &str, prompt: &[u32], n: usize) -> (u16, Value) {
    post(
        &s.url(&format!("/v1/contexts/{id}/completions")),
        greedy(json!(prompt), n),
    )
}

fn token_ids(s: &Server, id: &str) -> Vec<u32> {
    let (st, info) = context(s, id);
    assert_eq!(st, 200, "{info}");
    common::ids(&info["token_ids"])
}

/// Wait until `s`'s /health says the store is `state` with nothing left to write back.
fn wait_health(s: &Server, state: &str, pending_zero: bool) -> Value {
    let t = Instant::now();
    loop {
        let (_, h) = call("GET", &s.url("/health"), None);
        let pending = h["context_store"]["pending_writebacks"]
            .as_u64()
            .unwrap_or(0);
        if h["context_store"]["state"] == state && (!pending_zero || pending == 0) {
            return h;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the store did not become {state}: {h}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

const FIRST: [u32; 5] = [1, 403, 407, 261, 378];
const SECOND: [u32; 2] = [13, 157];

/// Replica A starts a conversation; replica B continues it; A continues B's turn. Compression
/// off: each answer equals the same conversation sent whole to a server with no context.
/// Compression on: B's answer (its chunks from the store) equals the answer of one server
/// without a store whose context left the device and came back (the same compressed chunks:
/// the store adds no error to compression's own, which `tests/kv.rs` bounds).
#[test]
fn a_conversation_continues_on_another_replica() {
    let Some(redis) = Redis::start(None) else {
        return;
    };
    let model = common::stories260k();
    for compression in ["off", "50%"] {
        let extra = ["--kv-compression", compression];
        let a = Server::start(&model, &redis.url(), &extra, &[]);
        let b = Server::start(&model, &redis.url(), &extra, &[]);
        let id = new_context(&a);
        let (st, v) = turn(&a, &id, &FIRST, 60);
        assert_eq!(st, 200, "{v}");
        let mut whole = token_ids(&b, &id);
        assert_eq!(whole.len(), FIRST.len() + 60, "B sees A's turn");
        whole.extend(SECOND);
        let (st, on_b) = turn(&b, &id, &SECOND, 12);
        assert_eq!(st, 200, "{on_b}");
        let (_, info) = context(&b, &id);
        let restore = &info["last_restore"];
        assert!(
            restore["chunks_from_store"].as_u64().unwrap() > 0,
            "B restored nothing from the store: {info}"
        );
        assert_eq!(info["revision"], 2, "{info}");
        let reference = if compression == "off" {
            post(&a.url("/v1/completions"), greedy(json!(whole), 12)).1
        } else {
            // One server, no store: the context leaves the device (two others take both
            // slots) and comes back from its compressed chunks.
            let r = Server::start_with(&model, None, &extra, &[]);
            let rid = new_context(&r);
            assert_eq!(turn(&r, &rid, &FIRST, 60).0, 200);
            for p in [[1u32, 13], [1, 157]] {
                let o = new_context(&r);
                assert_eq!(turn(&r, &o, &p, 30).0, 200);
            }
            let (_, info) = context(&r, &rid);
            assert_eq!(info["resident"], false, "{info}");
            let (st, v) = turn(&r, &rid, &SECOND, 12);
            assert_eq!(st, 200, "{v}");
            v
        };
        assert_eq!(
            text_of(&on_b),
            text_of(&reference),
            "B's turn differs (compression {compression})"
        );
        // A's copy is a revision behind: it takes B's, and continues it.
        let mut whole = token_ids(&a, &id);
        whole.extend([13]);
        let (st, on_a) = turn(&a, &id, &[13], 12);
        assert_eq!(st, 200, "{on_a}");
        let (_, reference) = post(&a.url("/v1/completions"), greedy(json!(whole), 12));
        if compression == "off" {
            assert_eq!(
                text_of(&on_a),
                text_of(&reference),
                "A's turn after B's differs"
            );
        }
        // A kept the chunks B's revision still names in its DRAM and read only B's new ones.
        let (_, info) = context(&a, &id);
        let restore = &info["last_restore"];
        assert!(
            restore["chunks_from_dram"].as_u64().unwrap() > 0
                && restore["chunks_from_store"].as_u64().unwrap() > 0,
            "A's restore of B's revision: {info}"
        );
        let (_, info) = context(&b, &id);
        assert_eq!(info["revision"], 3, "{info}");
        assert_eq!(info["tokens"], whole.len() + 12, "{info}");
    }
}

/// Calls on one context from both replicas at once take turns: none is lost or doubled, and
/// the conversation equals the same calls made one after another on one server.
#[test]
fn concurrent_calls_from_two_replicas_take_turns() {
    let Some(redis) = Redis::start(None) else {
        return;
    };
    let model = common::stories260k();
    let extra = ["--kv-compression", "off"];
    let a = Server::start(&model, &redis.url(), &extra, &[]);
    let b = Server::start(&model, &redis.url(), &extra, &[]);
    let id = new_context(&a);
    assert_eq!(turn(&a, &id, &FIRST, 8).0, 200);
    let calls = 4;
    std::thread::scope(|sc| {
        for s in [&a, &b, &a, &b] {
            let id = id.clone();
            sc.spawn(move || {
                for _ in 0..calls {
                    let (st, v) = turn(s, &id, &[13], 5);
                    assert_eq!(st, 200, "{v}");
                }
            });
        }
    });
    let got = token_ids(&b, &id);
    let (_, info) = context(&a, &id);
    assert_eq!(info["revision"], 1 + 4 * calls, "{info}");

    // The same calls, one after another, on a context of one replica.
    let r = new_context(&a);
    assert_eq!(turn(&a, &r, &FIRST, 8).0, 200);
    for _ in 0..4 * calls {
        assert_eq!(turn(&a, &r, &[13], 5).0, 200);
    }
    let want = token_ids(&a, &r);
    assert_eq!(got.len(), FIRST.len() + 8 + 16 * 6);
    assert_eq!(got, want, "concurrent turns differ from sequential ones");
    // Each call's lease went back: a delete goes through at once.
    let (st, v) = call("DELETE", &b.url(&format!("/v1/contexts/{id}")), None);
    assert_eq!(st, 200, "{v}");
    assert_eq!(context(&a, &id).0, 404);
}

/// A replica killed while its call's result is being written (its answer not yet out) leaves
/// the context as it was before the call; the other replica takes the context once the dead
/// one's lease expires and continues it. A replica killed right after its answer leaves the
/// context after the call. Other contexts are untouched.
#[test]
fn a_replica_killed_mid_call_leaves_the_context_before_or_after_it() {
    let Some(redis) = Redis::start(None) else {
        return;
    };
    let model = common::stories260k();
    let extra = ["--kv-compression", "off", "--context-lease-ttl", "1"];
    // Every chunk write of the write-back takes 400 ms: the kill lands in the middle of one.
    let slow = [("GPU_OFFLOAD_TEST_SWAP_DELAY_MS", "400")];
    let b = Server::start(&model, &redis.url(), &extra, &[]);
    let id = new_context(&b);
    let other = new_context(&b);
    assert_eq!(turn(&b, &id, &FIRST, 40).0, 200);
    assert_eq!(turn(&b, &other, &SECOND, 20).0, 200);
    let other_before = token_ids(&b, &other);
    for kill_after_answer in [false, true] {
        let before = token_ids(&b, &id);
        let mut a = Server::start(&model, &redis.url(), &extra, &slow);
        let url = a.url(&format!("/v1/contexts/{id}/completions"));
        let caller = std::thread::spawn(move || post(&url, greedy(json!(SECOND), 40)));
        if kill_after_answer {
            let (st, v) = caller.join().expect("caller");
            assert_eq!(st, 200, "{v}");
            a.kill9();
        } else {
            // The 40 tokens take well under 300 ms; the chunks' writes then hold the answer.
            std::thread::sleep(Duration::from_millis(300));
            a.kill9();
            // The client sees the connection close, never an answer.
            assert!(caller.join().is_err(), "the killed call answered");
        }
        let t = Instant::now();
        let now = token_ids(&b, &id);
        let mut after = before.clone();
        after.extend(SECOND);
        if kill_after_answer {
            assert_eq!(
                now.len(),
                before.len() + 42,
                "the answered call is not in the context"
            );
            assert!(now.starts_with(&after));
        } else {
            assert_eq!(now, before, "the context is not as before the killed call");
        }
        // B's next call waits for the dead replica's lease to expire, then continues.
        let mut whole = now.clone();
        whole.extend([13]);
        let (st, v) = turn(&b, &id, &[13], 10);
        assert_eq!(st, 200, "{v}");
        eprintln!(
            "B's call after the kill (after the answer: {kill_after_answer}) took {:.2} s",
            t.elapsed().as_secs_f64()
        );
        let (_, reference) = post(&b.url("/v1/completions"), greedy(json!(whole), 10));
        assert_eq!(text_of(&v), text_of(&reference));
    }
    assert_eq!(
        token_ids(&b, &other),
        other_before,
        "another context changed"
    );
}

/// The store killed while a replica writes a call back (between its chunks and its index),
/// and started again: the call completes from the replica's copy; meanwhile /health says
/// degraded with the write-back pending, calls on contexts get 503 (never served
/// from a copy that may be stale) while stateless ones are served; then the write-back goes
/// through, the context is after the call on both replicas, and nothing else is lost.
#[test]
fn the_store_killed_mid_write_back_and_restarted() {
    let Some(mut redis) = Redis::start(None) else {
        return;
    };
    let model = common::stories260k();
    let extra = ["--kv-compression", "off", "--context-lease-ttl", "2"];
    let slow = [("GPU_OFFLOAD_TEST_STORE_DELAY_MS", "1500")];
    let a = Server::start(&model, &redis.url(), &extra, &slow);
    let b = Server::start(&model, &redis.url(), &extra, &[]);
    let id = new_context(&b);
    let other = new_context(&b);
    assert_eq!(turn(&b, &id, &FIRST, 30).0, 200);
    assert_eq!(turn(&b, &other, &SECOND, 20).0, 200);
    let before = token_ids(&b, &id);
    let other_before = token_ids(&b, &other);
    let url = a.url(&format!("/v1/contexts/{id}/completions"));
    let on_a = std::thread::spawn(move || post(&url, greedy(json!(SECOND), 30)));
    // A's 30 tokens take well under 700 ms; its write-back then holds 1.5 s between its chunks
    // and its index: the store dies in between.
    std::thread::sleep(Duration::from_millis(700));
    redis.kill9();
    // The call completes from A's copy; the write-back goes on trying behind it.
    let (st, v) = on_a.join().expect("A's call");
    assert_eq!(st, 200, "{v}");
    let h = wait_health(&a, "degraded", false);
    assert!(
        h["context_store"]["pending_writebacks"].as_u64() == Some(1),
        "A's write-back is not pending: {h}"
    );
    let (st, v) = turn(&b, &other, &[13], 4);
    assert_eq!(st, 503, "a call on a context while the store is down: {v}");
    let (st, v) = post(&b.url("/v1/completions"), greedy(json!(FIRST), 4));
    assert_eq!(st, 200, "a stateless call while the store is down: {v}");
    let (st, v) = post(&b.url("/v1/contexts"), json!({}));
    assert_eq!(st, 503, "a context created while the store is down: {v}");
    let (_, m) = call("GET", &a.url("/metrics"), None);
    let m = m.as_str().unwrap_or_default().to_string();
    assert!(m.contains("gpu_offload_context_store_up 0"), "{m}");
    std::thread::sleep(Duration::from_millis(500));
    redis.restart();
    let h = wait_health(&a, "ok", true);
    eprintln!("after the restart: {h}");
    let after = token_ids(&b, &id);
    let mut want = before.clone();
    want.extend(SECOND);
    assert!(
        after == before || (after.len() == before.len() + 2 + 30 && after.starts_with(&want)),
        "the context is neither before nor after the call: {} tokens, before {}",
        after.len(),
        before.len()
    );
    assert_eq!(
        after.len(),
        before.len() + 32,
        "the write-back was not retried"
    );
    assert_eq!(token_ids(&a, &id), after, "the replicas disagree");
    assert_eq!(
        token_ids(&b, &other),
        other_before,
        "another context changed"
    );
    let (_, m) = call("GET", &a.url("/metrics"), None);
    let m = m.as_str().unwrap_or_default().to_string();
    assert!(m.contains("gpu_offload_context_store_up 1"), "{m}");
    assert!(
        !m.contains("gpu_offload_context_store_events_total{event=\"retry\"} 0"),
        "the write-back was not retried: {m}"
    );
    let mut whole = after.clone();
    whole.extend([13]);
    let (st, v) = turn(&b, &id, &[13], 8);
    assert_eq!(st, 200, "{v}");
    let (_, reference) = post(&b.url("/v1/completions"), greedy(json!(whole), 8));
    assert_eq!(text_of(&v), text_of(&reference));
}

fn serve_fails(model: &Path, store: &str, env: &[(&str, &str)]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_gpu-offload"))
        .envs(env.iter().copied())
        .env_remove("GPU_OFFLOAD_CONTEXT_STORE_PASSWORD")
        .args([
            "serve",
            "--port",
            "0",
            "--device",
            "cpu",
            "--context-store",
            store,
        ])
        .arg("--model")
        .arg(model)
        .stdin(Stdio::null())
        .output()
        .expect("serve");
    assert!(!out.status.success(), "serve started with store {store}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A wrong URL, an unreachable store, a refused password: serve does not start, saying why.
/// The right password from the environment: it starts. A context of another model in the
/// store: refused (409), as from `--kv-dir`.
#[test]
fn bad_stores_are_refused_with_the_reason() {
    let Some(redis) = Redis::start(Some("s3cret")) else {
        return;
    };
    let model = common::stories260k();
    let e = serve_fails(&model, "http://127.0.0.1:6379", &[]);
    assert!(e.contains("expected redis://"), "{e}");
    let e = serve_fails(&model, &format!("redis://127.0.0.1:{}", free_port()), &[]);
    assert!(e.contains("unreachable"), "{e}");
    let port = redis.port;
    let e = serve_fails(&model, &format!("redis://:wrong@127.0.0.1:{port}"), &[]);
    assert!(e.contains("refused the credentials"), "{e}");
    assert!(!e.contains("wrong"), "the password is shown: {e}");
    let e = serve_fails(&model, &redis.url(), &[]);
    assert!(e.contains("refused the credentials"), "{e}");

    let pw = [("GPU_OFFLOAD_CONTEXT_STORE_PASSWORD", "s3cret")];
    let mut cmd_env = pw.to_vec();
    cmd_env.push(("GPU_OFFLOAD_KV_COMPRESSION", "off"));
    let a = {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_gpu-offload"));
        cmd.envs(cmd_env.iter().copied())
            .args(["serve", "--port", "0", "--threads", "1", "--device", "cpu"])
            .args(["--context-store", &redis.url()])
            .arg("--model")
            .arg(&model);
        let (child, base) = common::spawn_serve(cmd);
        Server { child, base }
    };
    let id = new_context(&a);
    assert_eq!(turn(&a, &id, &FIRST, 4).0, 200);

    // Another model on the same store.
    let dir = tempfile::tempdir().expect("tempdir");
    let other = dir.path().join("other.gguf");
    common::tiny_llama_gguf(&other, "llama", 0, (1, 4));
    let c = {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_gpu-offload"));
        cmd.envs(pw.iter().copied())
            .args(["serve", "--port", "0", "--threads", "1", "--device", "cpu"])
            .args(["--context-store", &redis.url()])
            .arg("--model")
            .arg(&other);
        let (child, base) = common::spawn_serve(cmd);
        Server { child, base }
    };
    let (st, v) = turn(&c, &id, &[1, 2], 2);
    assert_eq!(st, 409, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("another model")),
        "{v}"
    );
    let (st, v) = context(&c, &id);
    assert_eq!(st, 409, "{v}");
    // The owner's replica still has it, unchanged.
    assert_eq!(token_ids(&a, &id).len(), FIRST.len() + 4);
}

/// `--context-store-max-bytes`: the store keeps at most that many chunk bytes (the least
/// recently used dropped), and a context whose chunks were dropped still continues exactly on
/// another replica (they are recomputed from its tokens).
#[test]
fn the_store_keeps_its_budget_and_dropped_chunks_are_recomputed() {
    let Some(redis) = Redis::start(None) else {
        return;
    };
    let model = common::stories260k();
    let budget = 64 * 1024;
    let extra = [
        "--kv-compression",
        "off",
        "--context-store-max-bytes",
        "64K",
    ];
    let a = Server::start(&model, &redis.url(), &extra, &[]);
    let b = Server::start(&model, &redis.url(), &extra, &[]);
    let ids: Vec<String> = (0..3).map(|_| new_context(&a)).collect();
    for id in &ids {
        assert_eq!(turn(&a, id, &FIRST, 100).0, 200);
    }
    let h = wait_health(&a, "ok", true);
    let held = h["context_store"]["chunk_bytes"]
        .as_u64()
        .expect("chunk bytes");
    assert!(
        held <= budget,
        "the store holds {held} chunk bytes, over {budget}: {h}"
    );
    let (_, m) = call("GET", &a.url("/metrics"), None);
    let evicted: u64 = m
        .as_str()
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            l.strip_prefix("gpu_offload_context_store_events_total{event=\"chunk_evicted\"} ")
        })
        .and_then(|v| v.trim().parse().ok())
        .expect("the evicted chunks' count");
    assert!(evicted > 0, "nothing was evicted");
    // The least recently written context lost its chunks: B recomputes them.
    let mut whole = token_ids(&b, &ids[0]);
    whole.extend(SECOND);
    let (st, v) = turn(&b, &ids[0], &SECOND, 12);
    assert_eq!(st, 200, "{v}");
    let (_, info) = context(&b, &ids[0]);
    assert!(
        info["last_restore"]["chunks_recomputed"].as_u64().unwrap() > 0,
        "nothing was recomputed: {info}"
    );
    let (_, reference) = post(&a.url("/v1/completions"), greedy(json!(whole), 12));
    assert_eq!(text_of(&v), text_of(&reference));
    eprintln!("store: {held} chunk bytes of {budget}, {evicted} chunks evicted; {info}");
}

/// A private CA and a certificate for 127.0.0.1 signed by it (`openssl` CLI), or None.
fn tls_certificates(dir: &Path) -> Option<()> {
    let openssl = |args: &[&str]| {
        Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    std::fs::write(dir.join("ext.cnf"), "subjectAltName=IP:127.0.0.1\n").ok()?;
    let ok = openssl(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=gpu-offload test CA",
    ]) && openssl(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "srv.key",
        "-out",
        "srv.csr",
        "-subj",
        "/CN=127.0.0.1",
    ]) && openssl(&[
        "x509",
        "-req",
        "-in",
        "srv.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "srv.pem",
        "-days",
        "2",
        "-extfile",
        "ext.cnf",
    ]);
    ok.then_some(())
}

/// `rediss://`: a store behind TLS with a private CA is used with `--context-store-ca` (a
/// conversation continues on a second replica through it) and refused without it (the
/// certificate's issuer is unknown).
#[test]
fn a_tls_store_with_a_private_ca() {
    if redis_binary().is_none() {
        eprintln!("skipped: no redis-server on PATH");
        return;
    }
    let certs = tempfile::tempdir().expect("tempdir");
    if tls_certificates(certs.path()).is_none() {
        eprintln!("skipped: the openssl CLI could not make a test CA");
        return;
    }
    let Some(redis) = Redis::start_tls(certs.path()) else {
        return;
    };
    let model = common::stories260k();
    let url = format!("rediss://127.0.0.1:{}", redis.port);
    let e = serve_fails(&model, &url, &[]);
    assert!(e.contains("certificate"), "{e}");
    let ca = certs.path().join("ca.pem");
    let ca = ca.to_string_lossy();
    let extra = ["--kv-compression", "off", "--context-store-ca", &ca];
    let a = Server::start(&model, &url, &extra, &[]);
    let b = Server::start(&model, &url, &extra, &[]);
    let id = new_context(&a);
    assert_eq!(turn(&a, &id, &FIRST, 20).0, 200);
    let mut whole = token_ids(&b, &id);
    whole.extend(SECOND);
    let (st, v) = turn(&b, &id, &SECOND, 10);
    assert_eq!(st, 200, "{v}");
    let (_, reference) = post(&a.url("/v1/completions"), greedy(json!(whole), 10));
    assert_eq!(text_of(&v), text_of(&reference));
}

/// One call per context: a replica that does not wait (`--context-wait 0`) gets 409 while
/// another call holds the context. A call whose write-back stalls past its lease (the store
/// stalled or the replica did) loses the context to a call on the other replica: its client
/// gets 409 saying its answer is not part of the conversation, which is exactly the other
/// call's — never a mix of both.
#[test]
fn busy_contexts_get_409_and_a_call_that_lost_its_lease_is_refused() {
    let Some(redis) = Redis::start(None) else {
        return;
    };
    let model = common::stories260k();
    let extra = ["--kv-compression", "off", "--context-lease-ttl", "1"];
    // A's write-back holds 4 s between its chunks and its index, renewing nothing meanwhile.
    let stall = [("GPU_OFFLOAD_TEST_STORE_DELAY_MS", "4000")];
    let a = Server::start(&model, &redis.url(), &extra, &stall);
    let b = Server::start(&model, &redis.url(), &extra, &[]);
    let mut impatient = extra.to_vec();
    impatient.extend(["--context-wait", "0"]);
    let c = Server::start(&model, &redis.url(), &impatient, &[]);
    let id = new_context(&b);
    assert_eq!(turn(&b, &id, &FIRST, 20).0, 200);
    let before = token_ids(&b, &id);
    let url = a.url(&format!("/v1/contexts/{id}/completions"));
    let on_a = std::thread::spawn(move || post(&url, greedy(json!(SECOND), 20)));
    std::thread::sleep(Duration::from_millis(300));
    let (st, v) = turn(&c, &id, &[13], 4);
    assert_eq!(st, 409, "a call on a busy context without waiting: {v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("in use")),
        "{v}"
    );
    // A's lease expires while its write-back stalls; B takes the context and writes it.
    std::thread::sleep(Duration::from_millis(1200));
    let (st, v) = turn(&b, &id, &[13], 4);
    assert_eq!(st, 200, "{v}");
    let (st, v) = on_a.join().expect("A's call");
    assert_eq!(st, 409, "A's call lost its lease and was kept anyway: {v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("not kept")),
        "{v}"
    );
    let mut want = before.clone();
    want.push(13);
    let now = token_ids(&b, &id);
    assert_eq!(
        now.len(),
        want.len() + 4,
        "the context is not B's call on the old one"
    );
    assert!(now.starts_with(&want));
    assert_eq!(token_ids(&a, &id), now, "A's copy forked from the store's");
    let (_, m) = call("GET", &a.url("/metrics"), None);
    assert!(
        m.as_str()
            .unwrap_or_default()
            .contains("gpu_offload_context_store_events_total{event=\"conflict\"} 1"),
        "{m}"
    );
}
