//! The fuzz targets: each a function from bytes to `Result`, the error being the clean message a
//! user would see. A target must never panic, abort or hang, whatever the bytes. Shared by the
//! short run in `cargo test` (tests/fuzz.rs) and the long runs (fuzz/main.rs, scripts/fuzz.sh).
//!
//! Files the loaders read by path are written into a per-harness scratch directory; inputs of
//! several files are parts joined by [`mutate::PART_SEPARATOR`].

use std::path::{Path, PathBuf};

use gpu_offload::model::gguf::{self, GgufFile, MetaValue};
use gpu_offload::model::synth::{SynthDtype, SynthSpec, synthesize, synthesize_gguf};
use gpu_offload::model::tokenizer::chatml;
use gpu_offload::model::{ChatMessage, Model, Tokenizer};
use gpu_offload::service::api::{Limits, parse_chat, parse_completion, parse_new_context};
use gpu_offload::store::{self, ConvertOptions, Store};

use super::mutate::{MAX_INPUT, join_parts, split_parts};

/// Every target, by the name the scripts and the regression folders use.
pub const TARGETS: &[&str] = &[
    "gguf",
    "hf",
    "store_manifest",
    "tokenizer_json",
    "chat_template",
    "prefill_jsonl",
    "http_body",
];

/// A target's state: its scratch directory and the files its inputs are checked beside.
pub struct Harness {
    pub name: &'static str,
    scratch: tempfile::TempDir,
    /// A micro model written at start: its GGUF, HF directory and store (seeds and fixtures).
    micro: Micro,
}

struct Micro {
    gguf: PathBuf,
    hf: PathBuf,
    store: PathBuf,
}

fn micro_spec() -> SynthSpec {
    SynthSpec {
        n_layers: 1,
        d_model: 8,
        d_ff: 16,
        n_heads: 2,
        n_kv_heads: 1,
        // The GGUF vocabulary needs the 3 control and 256 byte tokens.
        vocab_size: 262,
        max_context: 32,
        dtype: SynthDtype::F16,
        ..SynthSpec::preset("tiny").expect("the tiny preset exists")
    }
}

/// The repository's root, from the main crate's tests or from the fuzz package.
pub fn repo_root() -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    match here.parent() {
        Some(up) if !here.join("tests/fixtures").is_dir() => up.to_path_buf(),
        _ => here.to_path_buf(),
    }
}

fn fixture(rel: &str) -> PathBuf {
    repo_root().join("tests/fixtures").join(rel)
}

fn read_capped(path: &Path) -> Vec<u8> {
    let mut bytes = std::fs::read(path).unwrap_or_default();
    bytes.truncate(MAX_INPUT);
    bytes
}

/// A clean error, as the user would read it.
fn err(e: impl std::fmt::Display) -> String {
    format!("{e:#}")
}

impl Harness {
    /// Set up `name`'s scratch directory and micro model.
    pub fn new(name: &str) -> Result<Harness, String> {
        let name = TARGETS
            .iter()
            .copied()
            .find(|t| *t == name)
            .ok_or_else(|| format!("no fuzz target `{name}` (targets: {})", TARGETS.join(", ")))?;
        let scratch = tempfile::Builder::new()
            .prefix(&format!("gpu-offload-fuzz-{name}-"))
            .tempdir()
            .map_err(err)?;
        let base = scratch.path().join("micro");
        let spec = micro_spec();
        let gguf = base.join("micro.gguf");
        let hf = base.join("hf");
        let store = base.join("store");
        synthesize_gguf(&spec, &gguf, true, None, &mut |_, _| {}).map_err(err)?;
        synthesize(&spec, &hf, true, &mut |_, _| {}).map_err(err)?;
        let opts = ConvertOptions {
            extra_encodings: Vec::new(),
            force: true,
            // Everything in data.bin: the store must not point at a file outside it.
            copy: true,
            bundle_quantized: false,
        };
        store::convert(&gguf, &store, &opts, &mut |_, _| {}).map_err(err)?;
        Ok(Harness {
            name,
            scratch,
            micro: Micro { gguf, hf, store },
        })
    }

    /// Run the target on one input: `Ok` when it loaded or parsed, `Err` with the message.
    pub fn run(&mut self, data: &[u8]) -> Result<(), String> {
        let outcome = match self.name {
            "gguf" => self.gguf(data),
            "hf" => self.hf(data),
            "store_manifest" => self.store_manifest(data),
            "tokenizer_json" => self.tokenizer_json(data),
            "chat_template" => self.chat_template(data),
            "prefill_jsonl" => self.prefill_jsonl(data),
            "http_body" => http_body(data),
            other => Err(format!("no fuzz target `{other}`")),
        };
        // The scratch directory's name varies by process; the message should not.
        let scratch = self.scratch.path().to_string_lossy().into_owned();
        outcome.map_err(|e| e.replace(&scratch, "<scratch>"))
    }

    /// A fresh, empty directory for one input's files.
    fn case_dir(&self) -> Result<PathBuf, String> {
        let dir = self.scratch.path().join("case");
        if dir.exists() {
            std::fs::remove_dir_all(&dir).map_err(err)?;
        }
        std::fs::create_dir_all(&dir).map_err(err)?;
        Ok(dir)
    }

    /// The seed corpus: the micro model's files, the test fixtures, hand-written bodies.
    pub fn seeds(&self) -> Vec<Vec<u8>> {
        let m = &self.micro;
        let file = |p: PathBuf| read_capped(&p);
        match self.name {
            "gguf" => vec![
                file(m.gguf.clone()),
                file(m.store.join("tokenizer.gguf")),
                // Larger than the cap: its metadata and tensor table, as llama.cpp's tools
                // write them.
                file(fixture("gguf/llama-gqa-q4_1.gguf")),
                file(fixture("gguf/qwen2-bias-f16.gguf")),
            ],
            "hf" => {
                let st = file(m.hf.join("model.safetensors"));
                let mut seeds = vec![join_parts(&[file(m.hf.join("config.json")), st.clone()])];
                for name in ["llama-gqa", "opt", "qwen2-bias", "relu-llama"] {
                    let cfg = file(fixture(&format!("hf/{name}/config.json")));
                    seeds.push(join_parts(&[cfg, st.clone()]));
                }
                seeds
            }
            "store_manifest" => vec![file(m.store.join("manifest.json"))],
            "tokenizer_json" => vec![
                join_parts(&[
                    file(fixture("hf/llama-tok/tokenizer.json")),
                    file(fixture("hf/llama-tok/tokenizer_config.json")),
                ]),
                file(fixture("hf/llama-tok/tokenizer.json")),
            ],
            "chat_template" => chat_seeds(),
            "prefill_jsonl" => vec![
                b"{\"id\": \"a\", \"tokens\": [1, 2, 3]}\n{\"id\": 7, \"tokens\": [511]}\n\n{\"id\": \"d/..\", \"file\": \"p.txt\"}\n".to_vec(),
                b"{\"id\": \"a\", \"prompt\": \"Once upon a time\"}\n{\"id\": 2, \"tokens\": [1, 2, 3]}\n{\"id\": \"c\", \"prompt\": \"\"}\n{\"prompt\": \"no id\"}\n".to_vec(),
                b"{\"id\": \"x\", \"tokens\": [1, 300]}\n{\"id\": \"x\", \"prompt\": \"dup\"}\nnot json\n[1]\n\n".to_vec(),
                b"{\"id\": \"f\", \"file\": \"prompt.txt\"}\n{\"id\": \"g\", \"prompt\": \"a\", \"tokens\": [1]}\n".to_vec(),
            ],
            "http_body" => http_seeds(),
            _ => Vec::new(),
        }
    }

    /// A GGUF file: the whole model load, then what a run touches first (the tokenizer, the
    /// embedding and output rows of the declared vocabulary).
    fn gguf(&mut self, data: &[u8]) -> Result<(), String> {
        let path = self.case_dir()?.join("model.gguf");
        std::fs::write(&path, data).map_err(err)?;
        // The tokenizer alone is what a store's `tokenizer.gguf` gives.
        if let Ok(file) = GgufFile::open(&path)
            && let Ok(Some(tok)) = Tokenizer::from_gguf(&file.metadata)
        {
            exercise_tokenizer(&tok);
        }
        let model = Model::load(&path).map_err(err)?;
        exercise_model(&model)
    }

    /// A Hugging Face directory: `config.json`, then `model.safetensors`.
    fn hf(&mut self, data: &[u8]) -> Result<(), String> {
        let dir = self.case_dir()?;
        let parts = split_parts(data);
        std::fs::write(dir.join("config.json"), &parts[0]).map_err(err)?;
        if let Some(st) = parts.get(1) {
            std::fs::write(dir.join("model.safetensors"), st).map_err(err)?;
        }
        let model = Model::load(&dir).map_err(err)?;
        exercise_model(&model)
    }

    /// A store's `manifest.json` beside the micro store's data and tokenizer: open (what every
    /// command does first), verify every checksum, read the weights and the tokenizer.
    fn store_manifest(&mut self, data: &[u8]) -> Result<(), String> {
        let dir = self.case_dir()?;
        for f in ["data.bin", "tokenizer.gguf"] {
            std::fs::hard_link(self.micro.store.join(f), dir.join(f)).map_err(err)?;
        }
        std::fs::write(dir.join("manifest.json"), data).map_err(err)?;
        let store = Store::open(&dir).map_err(err)?;
        store.verify_all(&mut |_, _| {}).map_err(err)?;
        if let Some(tok) = store.tokenizer().map_err(err)? {
            exercise_tokenizer(&tok);
        }
        let weights = store.dense_weights().map_err(err)?;
        let spec = &store.manifest.spec;
        // What the first decode step reads: the embedding and output rows of the vocabulary.
        let last = spec.vocab_size.saturating_sub(1);
        let mut row = vec![0f32; weights.token_embd.cols];
        weights.token_embd.row_f32(last, &mut row).map_err(err)?;
        if let Some(out) = &weights.output {
            let mut row = vec![0f32; out.cols];
            out.row_f32(last, &mut row).map_err(err)?;
        }
        Ok(())
    }

    /// `tokenizer.json`, then `tokenizer_config.json` (optional).
    fn tokenizer_json(&mut self, data: &[u8]) -> Result<(), String> {
        let dir = self.case_dir()?;
        let parts = split_parts(data);
        std::fs::write(dir.join("tokenizer.json"), &parts[0]).map_err(err)?;
        if let Some(cfg) = parts.get(1) {
            std::fs::write(dir.join("tokenizer_config.json"), cfg).map_err(err)?;
        }
        let tok = Tokenizer::from_hf_dir(&dir)
            .map_err(err)?
            .ok_or("no tokenizer")?;
        exercise_tokenizer(&tok);
        Ok(())
    }

    /// A chat template (as a GGUF's `tokenizer.chat_template`), then the messages as JSON.
    fn chat_template(&mut self, data: &[u8]) -> Result<(), String> {
        let parts = split_parts(data);
        let template = String::from_utf8_lossy(&parts[0]).into_owned();
        let messages: Vec<ChatMessage> = parts
            .get(1)
            .and_then(|m| serde_json::from_slice(m).ok())
            .unwrap_or_else(default_messages);
        let add_generation_prompt = parts.get(2).is_none_or(|p| p.first() != Some(&b'0'));
        let meta = self.tokenizer_metadata()?;
        let mut entries: Vec<(&str, MetaValue)> =
            meta.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
        entries.push(("tokenizer.chat_template", MetaValue::String(template)));
        let path = self.case_dir()?.join("tokenizer.gguf");
        std::fs::write(&path, gguf::encode(&entries, &[])).map_err(err)?;
        let file = GgufFile::open(&path).map_err(err)?;
        let tok = Tokenizer::from_gguf(&file.metadata)
            .map_err(err)?
            .ok_or("no tokenizer")?;
        let text = tok
            .apply_chat_template(&messages, add_generation_prompt)
            .map_err(err)?;
        tok.encode(&text, false, true).map_err(err)?;
        Ok(())
    }

    /// The micro model's tokenizer metadata (what a GGUF chat model carries beside its template).
    fn tokenizer_metadata(&self) -> Result<Vec<(String, MetaValue)>, String> {
        let file = GgufFile::open(&self.micro.store.join("tokenizer.gguf")).map_err(err)?;
        Ok(TOKENIZER_KEYS
            .iter()
            .filter_map(|k| Some((k.to_string(), file.metadata.get(k)?.clone())))
            .collect())
    }

    /// A prefill job's JSONL input: every record parsed into its id and prompt source.
    fn prefill_jsonl(&mut self, data: &[u8]) -> Result<(), String> {
        let path = self.case_dir()?.join("input.jsonl");
        std::fs::write(&path, data).map_err(err)?;
        let mut outcomes = gpu_offload::cli::fuzz_read_records(&path).map_err(err)?;
        // Per-record errors are the job going on as the README promises; as the outcome, they
        // tell the mutator which checks an input reached.
        outcomes.sort();
        outcomes.dedup();
        match outcomes.iter().all(|o| o == "tokens" || o == "file") {
            true => Ok(()),
            false => Err(outcomes.join(" | ")),
        }
    }
}

const TOKENIZER_KEYS: &[&str] = &[
    "tokenizer.ggml.model",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id",
];

/// What serving a loaded tokenizer does: encode a prompt with and without specials, decode,
/// pieces of every id near the vocabulary's ends, a chat prompt.
fn exercise_tokenizer(tok: &Tokenizer) {
    for (add, parse) in [(true, true), (false, false)] {
        if let Ok(ids) = tok.encode("Hello, wörld! <s> 12\n\t€", add, parse) {
            let _ = tok.decode(&ids);
        }
    }
    let n = tok.vocab_size() as u32;
    for id in [
        0,
        1,
        2,
        n.saturating_sub(1),
        n,
        n.saturating_add(1),
        u32::MAX,
    ] {
        let _ = tok.token_bytes(id, true);
        let _ = tok.is_end_of_generation(id);
    }
    let _ = tok.decode(&[0, n.saturating_sub(1), n, u32::MAX]);
    let _ = tok.apply_chat_template_or_chatml(&default_messages(), true);
}

/// What a run touches first in a loaded model: the embedding and output rows of every declared
/// token id at the vocabulary's ends, and the tokenizer.
fn exercise_model(model: &Model) -> Result<(), String> {
    let w = &model.weights;
    let last = model.spec.vocab_size.saturating_sub(1);
    let mut row = vec![0f32; w.token_embd.cols];
    w.token_embd.row_f32(0, &mut row).map_err(err)?;
    w.token_embd.row_f32(last, &mut row).map_err(err)?;
    let out = w.output.as_ref().unwrap_or(&w.token_embd);
    let mut row = vec![0f32; out.cols];
    out.row_f32(last, &mut row).map_err(err)?;
    if let Some(tok) = &model.tokenizer {
        exercise_tokenizer(tok);
    }
    Ok(())
}

fn default_messages() -> Vec<ChatMessage> {
    let m = |role: &str, content: &str| ChatMessage {
        role: role.into(),
        content: content.into(),
    };
    vec![
        m("system", "You are terse."),
        m("user", "Hi {{ there }} {% raw %}"),
        m("assistant", "Hello."),
        m("user", ""),
    ]
}

/// Templates shaped like the ones models ship (ChatML, Llama-2-ish, Zephyr), and messages.
fn chat_seeds() -> Vec<Vec<u8>> {
    let chatml = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
    let llama2 = "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] | trim + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] | trim + ' ' + eos_token }}{% endif %}{% endfor %}";
    let zephyr = "{% for message in messages %}\n{% if message.role == 'user' %}\n{{ '<|user|>\n' + message.content + eos_token }}\n{% elif message.role == 'system' %}\n{{ '<|system|>\n' + message.content + eos_token }}\n{% endif %}\n{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n{% endfor %}";
    let tools = "{%- set ns = namespace(n=0) -%}{%- for m in messages -%}{%- set ns.n = ns.n + 1 -%}{{ m | tojson(indent=2) }}{{ m.content.split(' ') | length }}{{ m.role.upper() }}{%- endfor -%}{{ strftime_now('%Y') | length }}{{ ns.n }}{{ messages[-1].content | replace('a', 'b') }}";
    let messages = serde_json::to_vec(&default_messages()).unwrap_or_default();
    let user_only = br#"[{"role": "user", "content": "Why is the sky blue?"}]"#.to_vec();
    [chatml, llama2, zephyr, tools]
        .iter()
        .flat_map(|t| {
            [
                join_parts(&[t.as_bytes().to_vec(), messages.clone()]),
                join_parts(&[t.as_bytes().to_vec(), user_only.clone(), b"0".to_vec()]),
            ]
        })
        .collect()
}

fn http_seeds() -> Vec<Vec<u8>> {
    [
        r#"{"model": "m", "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0.7, "top_p": 0.9, "stop": ["\n", "END"], "seed": 3, "stream": true}"#,
        r#"{"prompt": [1, 2, 3], "max_tokens": 0, "logprobs": 5, "n": 2, "presence_penalty": 0.5, "frequency_penalty": -0.5, "logit_bias": {"42": -100, "7": 3.5}}"#,
        r#"{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], "max_tokens": 8, "logprobs": true, "top_logprobs": 3, "stop": "x", "top_k": 40, "min_p": 0.05, "ignore_eos": true}"#,
        r#"{"messages": [], "best_of": 1, "echo": false, "user": "u", "stream_options": {"include_usage": true}, "suffix": null}"#,
        r#"{"system_prompt": "You are a helpful assistant."}"#,
        r#"{"system_prompt": null}"#,
        " \n",
        r#"[1, 2]"#,
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect()
}

/// A request body, given to each endpoint's parser; a parsed chat request is rendered as ChatML.
fn http_body(data: &[u8]) -> Result<(), String> {
    let limits = Limits {
        max_tokens: 256,
        default_max_tokens: 16,
    };
    let mut errors = Vec::new();
    if let Err(e) = parse_completion(data, limits) {
        errors.push(e.body().to_string());
    }
    for allow_empty in [false, true] {
        match parse_chat(data, limits, allow_empty) {
            Ok(req) => {
                if let gpu_offload::service::api::Input::Chat(m) = &req.input {
                    let _ = chatml(m, true);
                }
            }
            Err(e) => errors.push(e.body().to_string()),
        }
    }
    if let Err(e) = parse_new_context(data) {
        errors.push(e.body().to_string());
    }
    match errors.len() {
        4 => Err(errors.join(" | ")),
        _ => Ok(()),
    }
}
