//! `gpu-offload prefill`, the batch job, through the real binary on stories260K: bad records
//! become error lines and the job goes on; a job killed with SIGKILL and started again ends with
//! every id exactly once and the output of an uninterrupted run; saved contexts continue in
//! `serve` exactly as if the prompt had been sent there.

mod common;

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_gpu-offload"));
    for (k, _) in std::env::vars() {
        if k.starts_with("GPU_OFFLOAD_") && k != "GPU_OFFLOAD_MODELS" {
            c.env_remove(k);
        }
    }
    c
}

fn prefill(model: &Path, input: &Path, output: &Path, extra: &[&str]) -> Command {
    let mut c = bin();
    c.args(["prefill", "--device", "cpu", "--threads", "1", "--quiet"])
        .arg("-m")
        .arg(model)
        .arg("--input")
        .arg(input)
        .arg("--output")
        .arg(output)
        .args(extra);
    c
}

fn ok(c: &mut Command) -> Output {
    let out = c.output().expect("run binary");
    assert!(
        out.status.success(),
        "{c:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Every line of a JSONL file (each must parse).
fn lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad line {l:?}: {e}")))
        .collect()
}

/// The output by id, without the timing; panics on a repeated id.
fn by_id(lines: &[Value]) -> BTreeMap<String, Value> {
    let mut m = BTreeMap::new();
    for l in lines {
        let mut l = l.clone();
        let id = l["id"].as_str().expect("id").to_string();
        if let Some(o) = l.as_object_mut() {
            o.remove("ttft_s");
        }
        assert!(m.insert(id.clone(), l).is_none(), "id {id} appears twice");
    }
    m
}

/// Twenty records, the eleventh naming a file that does not exist; prompts as text, token ids
/// and files.
fn twenty(dir: &Path) -> PathBuf {
    let words = [
        "Lily",
        "Tom",
        "the cat",
        "a big tree",
        "the sun",
        "mom",
        "a red ball",
    ];
    std::fs::write(
        dir.join("story.txt"),
        "Once upon a time there was a little dog",
    )
    .unwrap();
    let mut text = String::new();
    for i in 0..20usize {
        let id = format!("p{i:02}");
        let rec = match i {
            10 => json!({"id": id, "file": "missing.txt"}),
            7 => json!({"id": id, "file": "story.txt"}),
            i if i % 4 == 1 => json!({"id": id, "tokens": [1, 400 + i, 30 + 7 * i, 260]}),
            i => json!({
                "id": id,
                "prompt": format!("{} saw {} and", words[i % words.len()], words[(i * 3 + 1) % words.len()]),
            }),
        };
        text.push_str(&rec.to_string());
        text.push('\n');
    }
    let p = dir.join("prompts.jsonl");
    std::fs::write(&p, text).unwrap();
    p
}

fn wait_for_lines(path: &Path, n: usize, child: &mut Child) {
    let t = Instant::now();
    loop {
        let have = std::fs::read_to_string(path)
            .map(|s| s.matches('\n').count())
            .unwrap_or(0);
        if have >= n {
            return;
        }
        if let Some(st) = child.try_wait().expect("wait") {
            panic!("the job ended ({st}) before writing {n} lines");
        }
        assert!(t.elapsed() < Duration::from_secs(300), "no progress");
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn twenty_prompts_with_a_bad_one_survive_kill_9_and_resume() {
    let model = common::stories260k();
    let dir = tempfile::tempdir().unwrap();
    let input = twenty(dir.path());
    let n = ["-n", "20"];

    // The reference: one uninterrupted run.
    let reference = dir.path().join("ref.jsonl");
    ok(&mut prefill(&model, &input, &reference, &n));
    let want = lines(&reference);
    assert_eq!(want.len(), 20);
    let errors: Vec<&Value> = want.iter().filter(|l| l.get("error").is_some()).collect();
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(errors[0]["id"], "p10");
    let msg = errors[0]["error"].as_str().unwrap();
    assert!(msg.contains("missing.txt"), "{msg}");
    assert_eq!(want[10]["id"], "p10", "records keep the input order");
    for l in want.iter().filter(|l| l.get("error").is_none()) {
        assert!(l["prompt_tokens"].as_u64().unwrap() > 0, "{l}");
        assert!(l["ttft_s"].as_f64().unwrap() >= 0.0, "{l}");
        let generated = l["completion_tokens"].as_u64().unwrap();
        assert_eq!(l["tokens"].as_array().unwrap().len() as u64, generated);
        assert!(
            generated > 0 && !l["text"].as_str().unwrap().is_empty(),
            "{l}"
        );
    }
    let want = by_id(&want);

    // The same job killed with SIGKILL three times while it runs (each forward pass slowed so
    // the kills land inside a record), with a torn last line added after one of the kills.
    let out = dir.path().join("out.jsonl");
    for (round, at) in [3usize, 8, 14].into_iter().enumerate() {
        let mut child = prefill(&model, &input, &out, &n)
            .env("GPU_OFFLOAD_TEST_PREFILL_DELAY_MS", "4")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start");
        wait_for_lines(&out, at, &mut child);
        child.kill().expect("SIGKILL");
        child.wait().ok();
        let got = lines(&out);
        assert!(got.len() < 20, "the kill came after the job ended");
        by_id(&got);
        if round == 1 {
            let mut f = std::fs::OpenOptions::new().append(true).open(&out).unwrap();
            f.write_all(br#"{"id":"p15","prompt_tok"#).unwrap();
        }
    }
    // Ctrl-C: the current record is abandoned, the job exits non-zero saying how to resume.
    let mut child = prefill(&model, &input, &out, &n)
        .env("GPU_OFFLOAD_TEST_PREFILL_DELAY_MS", "4")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start");
    wait_for_lines(&out, 16, &mut child);
    // SAFETY: signalling our own child.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGINT);
    }
    let o = child.wait_with_output().expect("wait");
    assert!(!o.status.success());
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains("run the same command again to resume"), "{e}");
    assert!(lines(&out).len() < 20, "Ctrl-C came after the job ended");
    by_id(&lines(&out));

    let resumed = ok(&mut prefill(&model, &input, &out, &n));
    let stderr = String::from_utf8_lossy(&resumed.stderr);
    assert!(stderr.contains("resuming"), "{stderr}");
    let got = by_id(&lines(&out));
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>()
    );
    for (id, w) in &want {
        assert_eq!(
            &got[id], w,
            "record {id} differs from the uninterrupted run"
        );
    }

    // Run again: nothing is left to do, nothing is added.
    let before = std::fs::read(&out).unwrap();
    ok(&mut prefill(&model, &input, &out, &n));
    assert_eq!(std::fs::read(&out).unwrap(), before);
}

#[test]
fn bad_records_get_error_lines_and_the_job_goes_on() {
    let model = common::stories260k();
    let dir = tempfile::tempdir().unwrap();
    let long: Vec<u32> = (0..100).map(|i| 1 + i % 300).collect();
    let input = dir.path().join("in.jsonl");
    let recs = [
        json!({"id": "ok1", "prompt": "Lily went to the park"}).to_string(),
        "this is not json".to_string(),
        json!({"prompt": "no id here"}).to_string(),
        json!({"id": "ok1", "prompt": "a second ok1"}).to_string(),
        json!({"id": "empty", "prompt": "   "}).to_string(),
        json!({"id": "long", "tokens": long}).to_string(),
        json!({"id": "vocab", "tokens": [1, 99999]}).to_string(),
        json!({"id": "both", "prompt": "a", "tokens": [1]}).to_string(),
        String::new(),
        json!({"id": 42, "tokens": [1, 400, 300]}).to_string(),
    ];
    std::fs::write(&input, recs.join("\n")).unwrap();
    let out = dir.path().join("out.jsonl");
    ok(&mut prefill(
        &model,
        &input,
        &out,
        &["-n", "6", "--ctx-size", "64", "--logits"],
    ));
    let got = lines(&out);
    let ids: Vec<&str> = got.iter().map(|l| l["id"].as_str().unwrap()).collect();
    assert_eq!(
        ids,
        [
            "ok1", "line:2", "line:3", "line:4", "empty", "long", "vocab", "both", "42"
        ]
    );
    let err = |i: usize| {
        got[i]["error"]
            .as_str()
            .unwrap_or_else(|| panic!("{}", got[i]))
    };
    assert!(err(1).contains("malformed JSON"), "{}", err(1));
    assert!(err(2).contains("no id"), "{}", err(2));
    assert!(err(3).contains("duplicate id 'ok1'"), "{}", err(3));
    assert!(err(4).contains("empty prompt"), "{}", err(4));
    assert!(err(5).contains("context holds 64"), "{}", err(5));
    assert!(err(6).contains("outside the vocabulary"), "{}", err(6));
    assert!(err(7).contains("exactly one of"), "{}", err(7));
    for i in [0, 8] {
        let l = &got[i];
        assert!(l.get("error").is_none(), "{l}");
        // The logits are the last prompt position's: greedy decoding takes their argmax first.
        let logits: Vec<f64> = l["logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        let argmax = (0..logits.len())
            .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
            .unwrap();
        assert_eq!(
            l["tokens"][0].as_u64().unwrap() as usize,
            argmax,
            "{}",
            l["id"]
        );
    }

    // A directory of text files: every *.txt, sorted, id = file name; the same prompt as text
    // gives the same result.
    let texts = dir.path().join("texts");
    std::fs::create_dir(&texts).unwrap();
    std::fs::write(texts.join("b.txt"), "Tom had a red ball").unwrap();
    std::fs::write(texts.join("a.txt"), "Lily went to the park").unwrap();
    std::fs::write(texts.join("notes.md"), "not a prompt").unwrap();
    let out_dir = dir.path().join("dir.jsonl");
    ok(&mut prefill(&model, &texts, &out_dir, &["-n", "6"]));
    let d = lines(&out_dir);
    let ids: Vec<&str> = d.iter().map(|l| l["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["a.txt", "b.txt"]);
    assert_eq!(d[0]["tokens"], got[0]["tokens"]);
    assert_eq!(d[0]["text"], got[0]["text"]);

    // Clear errors for the job itself.
    let missing = dir.path().join("nope.jsonl");
    let o = prefill(&model, &missing, &out, &[]).output().unwrap();
    assert!(!o.status.success());
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains("nope.jsonl"), "{e}");
    let unwritable = dir.path().join("no-such-dir").join("out.jsonl");
    let o = prefill(&model, &input, &unwritable, &[]).output().unwrap();
    assert!(!o.status.success());
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains("cannot open output"), "{e}");
}

struct Server {
    child: Child,
    base: String,
}

impl Server {
    fn start(model: &Path, kv_dir: &Path) -> Server {
        let mut cmd = bin();
        cmd.arg("serve")
            .arg("--model")
            .arg(model)
            .args(["--port", "0", "--device", "cpu", "--threads", "2"])
            .args(["--kv-compression", "off", "--kv-dir"])
            .arg(kv_dir);
        let (child, base) = common::spawn_serve(cmd);
        Server { child, base }
    }

    fn call(&self, path: &str, body: Option<Value>) -> (u16, Value) {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(120)))
            .build()
            .into();
        let url = format!("{}{path}", self.base);
        let mut resp = match body {
            None => agent.get(&url).call(),
            Some(b) => agent
                .post(&url)
                .header("Content-Type", "application/json")
                .send(b.to_string()),
        }
        .unwrap_or_else(|e| panic!("{url}: {e}"));
        let status = resp.status().as_u16();
        let text = resp.body_mut().read_to_string().expect("body");
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    /// Greedy completion on a context; its text.
    fn continue_context(&self, id: &str, prompt: &str, n: usize) -> String {
        let (st, v) = self.call(
            &format!("/v1/contexts/{id}/completions"),
            Some(json!({"prompt": prompt, "max_tokens": n, "temperature": 0})),
        );
        assert_eq!(st, 200, "{v}");
        v["choices"][0]["text"].as_str().expect("text").to_string()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.child.kill().ok();
        self.child.wait().ok();
    }
}

#[test]
fn saved_contexts_continue_in_serve_as_if_sent_there() {
    let model = common::stories260k();
    let dir = tempfile::tempdir().unwrap();
    let prompts = [
        ("short", "Once upon a time"),
        (
            "long story",
            "Lily and Tom went to the park. They saw a big tree and a red ball. Tom wanted to play, but Lily was sad because",
        ),
    ];
    let input = dir.path().join("in.jsonl");
    let text: Vec<String> = prompts
        .iter()
        .map(|(id, p)| json!({"id": id, "prompt": p}).to_string())
        .collect();
    std::fs::write(&input, text.join("\n")).unwrap();
    let out = dir.path().join("out.jsonl");
    let kv = dir.path().join("kv");
    ok(&mut prefill(
        &model,
        &input,
        &out,
        &["-n", "8", "--save-contexts", kv.to_str().unwrap()],
    ));
    let got = lines(&out);
    assert_eq!(got.len(), 2);

    let s = Server::start(&model, &kv);
    let follow_up = " Then she said";
    for ((_, prompt), rec) in prompts.iter().zip(&got) {
        let cid = rec["context"].as_str().expect("context id");
        let (st, info) = s.call(&format!("/v1/contexts/{cid}"), None);
        assert_eq!(st, 200, "saved context {cid} not loaded: {info}");
        let conversation =
            rec["prompt_tokens"].as_u64().unwrap() + rec["completion_tokens"].as_u64().unwrap();
        assert_eq!(info["tokens"].as_u64().unwrap(), conversation, "{info}");

        // The prompt sent to `serve` directly, on a new context.
        let (st, c) = s.call("/v1/contexts", Some(json!({})));
        assert!(st == 200 || st == 201, "{st}: {c}");
        let rid = c["id"].as_str().unwrap().to_string();
        let direct = s.continue_context(&rid, prompt, 8);
        assert_eq!(
            direct,
            rec["text"].as_str().unwrap(),
            "{cid}: prefill and serve differ"
        );

        let want = s.continue_context(&rid, follow_up, 16);
        let have = s.continue_context(cid, follow_up, 16);
        assert!(!want.is_empty());
        assert_eq!(
            have, want,
            "{cid} continues differently from the prompt sent to serve"
        );
        let (_, info) = s.call(&format!("/v1/contexts/{cid}"), None);
        eprintln!("{cid}: restore {}", info["last_restore"]);
    }
}
