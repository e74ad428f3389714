//! Issue 39's hostile input to `serve`, `run` and `prefill`, each defect reproduced: silent and
//! byte-dripping clients, bodies over the limit or malformed, `max_tokens: 0`, over-long stop
//! strings and logit_bias, prompts too long to encode, a context's system prompt that can never
//! fit, `-n` at u64::MAX, `/dev/zero` as a prompt file or input, an output that is the input and
//! a JSONL line that is not UTF-8.
//!
//! `GPU_OFFLOAD_TEST_BIN` runs them against another binary (the unfixed main, to see them fail
//! there); the server's deadlines are given through the environment so an older binary starts.
//! Every child runs under a 4 GiB address-space cap, so a binary that reads `/dev/zero` whole
//! fails quickly instead of taking the machine's memory.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

fn bin() -> Command {
    let path = std::env::var_os("GPU_OFFLOAD_TEST_BIN")
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_gpu-offload").into());
    let mut c = Command::new(path);
    for (k, _) in std::env::vars() {
        if k.starts_with("GPU_OFFLOAD_") && k != "GPU_OFFLOAD_MODELS" {
            c.env_remove(k);
        }
    }
    #[cfg(unix)]
    {
        use std::os::unix::process::CommandExt;
        // SAFETY: setrlimit is async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            c.pre_exec(|| {
                let cap = libc::rlimit {
                    rlim_cur: 4 << 30,
                    rlim_max: 4 << 30,
                };
                libc::setrlimit(libc::RLIMIT_AS, &cap);
                Ok(())
            });
        }
    }
    c
}

struct Server {
    child: Child,
    addr: String,
}

impl Server {
    /// stories260K on the CPU, context 512; the deadlines short (1 s head, 2 s idle and body).
    fn start(extra: &[&str]) -> Server {
        let mut cmd = bin();
        cmd.arg("serve")
            .arg("--model")
            .arg(common::stories260k())
            .args(["--port", "0", "--threads", "1", "--device", "cpu"])
            .args(["--ctx-size", "512", "--parallel", "2"])
            .args(extra)
            .env("GPU_OFFLOAD_HEADER_TIMEOUT", "1")
            .env("GPU_OFFLOAD_IDLE_TIMEOUT", "2")
            .env("GPU_OFFLOAD_BODY_TIMEOUT", "2");
        let (child, base) = common::spawn_serve(cmd);
        let addr = base.trim_start_matches("http://").to_string();
        Server { child, addr }
    }

    fn connect(&self) -> TcpStream {
        let s = TcpStream::connect(&self.addr).expect("connect");
        // Far beyond the deadlines under test: a read that times out means nobody closed it.
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        s
    }

    /// Send `raw` bytes as one request and read the answer until the server closes.
    fn raw(&self, raw: &[u8]) -> (u16, Value) {
        let mut s = self.connect();
        s.write_all(raw).expect("send");
        let text = read_until_closed(&mut s).expect("the server did not answer and close");
        parse_answer(&text)
    }

    fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let body = body.to_string();
        let head = format!(
            "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
            body.len()
        );
        let mut raw = head.into_bytes();
        raw.extend_from_slice(body.as_bytes());
        self.raw(&raw)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.child.kill().ok();
        self.child.wait().ok();
    }
}

/// Everything the peer sends until it closes; Err when the read timed out (it never closed).
fn read_until_closed(s: &mut TcpStream) -> Result<String, String> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 65536];
    loop {
        match s.read(&mut chunk) {
            Ok(0) => return Ok(String::from_utf8_lossy(&buf).into_owned()),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
                ) =>
            {
                return Ok(String::from_utf8_lossy(&buf).into_owned());
            }
            Err(e) => {
                return Err(format!(
                    "{e} after {} bytes: {}",
                    buf.len(),
                    String::from_utf8_lossy(&buf)
                ));
            }
        }
    }
}

/// (status, JSON body) of an HTTP/1.1 answer (a chunked body is joined).
fn parse_answer(text: &str) -> (u16, Value) {
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no HTTP answer: {text:?}"));
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((text, ""));
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        let mut out = String::new();
        let mut rest = body;
        while let Some((size, after)) = rest.split_once("\r\n") {
            let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
            if n == 0 || after.len() < n {
                break;
            }
            out.push_str(&after[..n]);
            rest = after[n..].trim_start_matches("\r\n");
        }
        out
    } else {
        body.to_string()
    };
    let v = serde_json::from_str(&body).unwrap_or(Value::String(format!("{head}\r\n\r\n{body}")));
    (status, v)
}

fn assert_error(got: &(u16, Value), want: u16, needle: &str) {
    let (status, v) = got;
    assert_eq!(*status, want, "{v}");
    let msg = v["error"]["message"]
        .as_str()
        .unwrap_or_else(|| panic!("not OpenAI's error shape: {v}"));
    assert!(v["error"]["type"].is_string(), "{v}");
    assert!(msg.contains(needle), "'{msg}' lacks '{needle}'");
}

/// Issue 39: 203 slow connections (silent, or a byte every 3 s) were never closed.
#[test]
fn silent_dripping_and_idle_connections_are_closed() {
    let s = Server::start(&[]);

    // Silent from the start: closed after the header timeout, without an answer.
    let mut silent = s.connect();
    let t = Instant::now();
    let got = read_until_closed(&mut silent);
    assert_eq!(got.as_deref(), Ok(""), "a silent connection stayed open");
    eprintln!("silent connection closed after {:?}", t.elapsed());

    // A head dripped a byte every 200 ms: a 408 in OpenAI's shape, then closed.
    let mut drip = s.connect();
    let mut reader = drip.try_clone().unwrap();
    let dripper = std::thread::spawn(move || {
        for b in b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-slow: "
            .iter()
            .cycle()
        {
            if drip.write_all(&[*b]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    });
    let text = read_until_closed(&mut reader).expect("a dripping head stayed open");
    assert_error(&parse_answer(&text), 408, "--header-timeout");
    dripper.join().unwrap();

    // A body that stops half way: 408 naming the body's deadline.
    let mut body = s.connect();
    body.write_all(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"prompt\":",
    )
    .unwrap();
    let text = read_until_closed(&mut body).expect("a stalled body stayed open");
    assert_error(&parse_answer(&text), 408, "--body-timeout");

    // Kept alive after an answer, then silent: closed after the idle timeout.
    let mut kept = s.connect();
    kept.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        .unwrap();
    let text = read_until_closed(&mut kept).expect("an idle kept-alive connection stayed open");
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");

    // The server still answers.
    let (status, v) = s.post(
        "/v1/completions",
        &json!({"prompt": [1, 2], "max_tokens": 2}),
    );
    assert_eq!(status, 200, "{v}");
}

/// Issue 39: a body over 2 MiB got `413 text/plain`, a malformed chunked body `400 text/plain`.
#[test]
fn bodies_over_the_limit_or_malformed_get_openai_errors() {
    let s = Server::start(&[]);
    let limit = gpu_offload::limits::MAX_REQUEST_BODY_BYTES.value;
    // Declared too long: refused before reading it.
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        limit + 1
    );
    assert_error(&s.raw(head.as_bytes()), 413, "max_request_body_bytes");
    // Chunked, and longer than the limit once read.
    let mut raw = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n".to_vec();
    let piece = vec![b' '; 1 << 20];
    for _ in 0..3 {
        raw.extend_from_slice(format!("{:x}\r\n", piece.len()).as_bytes());
        raw.extend_from_slice(&piece);
        raw.extend_from_slice(b"\r\n");
    }
    raw.extend_from_slice(b"0\r\n\r\n");
    let mut c = s.connect();
    c.write_all(&raw).ok();
    let text = read_until_closed(&mut c).expect("answer");
    assert_error(&parse_answer(&text), 413, "max_request_body_bytes");
    // A malformed chunk size.
    let raw = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\nzz\r\n{}\r\n0\r\n\r\n";
    assert_error(&s.raw(raw), 400, "malformed");
}

/// Issue 39: `max_tokens: 0` returned one token; stop strings and logit_bias were unbounded.
#[test]
fn max_tokens_zero_and_request_lists_are_refused_by_their_limits() {
    let s = Server::start(&[]);
    let got = s.post(
        "/v1/completions",
        &json!({"prompt": "Once upon", "max_tokens": 0}),
    );
    assert_error(&got, 400, "Expected a value >= 1, but got 0");
    assert_eq!(got.1["error"]["param"], "max_tokens");
    let got = s.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}),
    );
    assert_error(&got, 400, "Expected a value >= 1, but got 0");

    let long = "x".repeat(gpu_offload::limits::MAX_STOP_BYTES.value as usize + 1);
    let got = s.post(
        "/v1/completions",
        &json!({"prompt": "Once", "max_tokens": 1, "stop": [long]}),
    );
    assert_error(&got, 400, "max_stop_bytes");
    let keys = gpu_offload::limits::MAX_LOGIT_BIAS_KEYS.value as usize + 1;
    let bias: serde_json::Map<String, Value> =
        (0..keys).map(|i| (i.to_string(), json!(1))).collect();
    let got = s.post(
        "/v1/completions",
        &json!({"prompt": "Once", "max_tokens": 1, "logit_bias": bias}),
    );
    assert_error(&got, 400, "max_logit_bias_keys");
}

/// Issue 39: an over-long prompt was encoded in full on the engine thread before its 400; now it
/// is sized first (and refused without encoding when it cannot fit); a context whose system
/// prompt can never fit was created (201) and every call on it then failed.
#[test]
fn over_long_prompts_and_system_prompts_are_refused_up_front() {
    let s = Server::start(&[]);
    let huge = "abcdefgh".repeat(250_000);
    let got = s.post("/v1/completions", &json!({"prompt": huge, "max_tokens": 1}));
    assert_error(&got, 400, "at least");
    let got = s.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": huge}], "max_tokens": 1}),
    );
    assert_error(&got, 400, "at least");
    assert_eq!(got.1["error"]["param"], "messages");

    // Too long for the context once encoded, though its bytes alone do not tell.
    let long = "Once upon a time there was a girl. ".repeat(60);
    let got = s.post("/v1/completions", &json!({"prompt": long, "max_tokens": 1}));
    assert_error(&got, 400, "this server takes at most 512");
    let got = s.post("/v1/contexts", &json!({"system_prompt": long}));
    assert_error(&got, 400, "system prompt is");
    assert_eq!(got.1["error"]["param"], "system_prompt");

    // What fits still runs.
    let got = s.post(
        "/v1/completions",
        &json!({"prompt": "Once upon a time", "max_tokens": 2, "temperature": 0}),
    );
    assert_eq!(got.0, 200, "{}", got.1);
    let got = s.post("/v1/contexts", &json!({"system_prompt": "You are kind."}));
    assert_eq!(got.0, 201, "{}", got.1);
}

fn stories_run(args: &[&str]) -> Output {
    bin()
        .args(["run", "--device", "cpu", "--threads", "1", "-m"])
        .arg(common::stories260k())
        .args(args)
        .output()
        .expect("run")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A clean refusal: exit status 1 (no panic, no signal) and `needle` in stderr.
fn refused(o: &Output, needle: &str) {
    assert_eq!(o.status.code(), Some(1), "{:?}: {}", o.status, stderr(o));
    assert!(
        stderr(o).contains(needle),
        "'{}' lacks '{needle}'",
        stderr(o)
    );
}

/// Issue 39: `-n 18446744073709551615` wrapped ("the context holds 2"); `--prompt-file
/// /dev/zero` read until allocation failed.
#[test]
fn run_refuses_a_wrapping_count_and_an_endless_prompt_file() {
    let o = stories_run(&["-p", "Once upon", "-n", "18446744073709551615"]);
    refused(&o, "overflow");
    assert!(!stderr(&o).contains("holds 2"), "{}", stderr(&o));
    let o = stories_run(&["--prompt-file", "/dev/zero", "-n", "1"]);
    refused(&o, "max_file_read_bytes");
}

fn prefill(input: &Path, output: &Path) -> Output {
    bin()
        .args([
            "prefill",
            "--device",
            "cpu",
            "--threads",
            "1",
            "--quiet",
            "-m",
        ])
        .arg(common::stories260k())
        .arg("-i")
        .arg(input)
        .arg("-o")
        .arg(output)
        .output()
        .expect("prefill")
}

fn lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad line {l:?}: {e}")))
        .collect()
}

/// Issue 39: `-o` equal to `-i` was a silent no-op; one invalid UTF-8 byte aborted the whole
/// job (rc 1, no line number); `-i /dev/zero` and a record's `{"file": "/dev/zero"}` read until
/// allocation failed.
#[test]
fn prefill_refuses_its_own_input_as_output_and_reads_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    let mut text = Vec::new();
    text.extend_from_slice(
        json!({"id": "a", "prompt": "Once upon a time"})
            .to_string()
            .as_bytes(),
    );
    text.extend_from_slice(b"\n{\"id\": \"b\", \"prompt\": \"bad \xff byte\"}\n");
    text.extend_from_slice(
        json!({"id": "c", "file": "/dev/zero"})
            .to_string()
            .as_bytes(),
    );
    text.push(b'\n');
    text.extend_from_slice(
        json!({"id": "d", "tokens": [1, 2, 3]})
            .to_string()
            .as_bytes(),
    );
    text.push(b'\n');
    std::fs::write(&input, &text).unwrap();

    let o = prefill(&input, &input);
    refused(&o, "is the input");
    assert_eq!(
        std::fs::read(&input).unwrap(),
        text,
        "the input was written to"
    );

    let out = dir.path().join("out.jsonl");
    let o = prefill(&input, &out);
    assert!(o.status.success(), "{:?}: {}", o.status, stderr(&o));
    let got = lines(&out);
    let by = |id: &str| {
        got.iter()
            .find(|l| l["id"] == id)
            .unwrap_or_else(|| panic!("no line for {id}: {got:?}"))
    };
    assert!(by("a")["tokens"].is_array(), "{got:?}");
    assert!(by("d")["tokens"].is_array(), "{got:?}");
    let bad = by("line:2")["error"].as_str().unwrap_or_default();
    assert!(bad.contains("line 2") && bad.contains("UTF-8"), "{bad}");
    let zero = by("c")["error"].as_str().unwrap_or_default();
    assert!(zero.contains("max_file_read_bytes"), "{zero}");

    let o = prefill(Path::new("/dev/zero"), &dir.path().join("z.jsonl"));
    refused(&o, "neither a regular file nor a directory");
}
