//! The tokenizer against llama.cpp on real models: prompt ids for both `parse_special` settings,
//! token pieces, the end-of-generation set, detokenizing greedy continuations, streaming, and the
//! chat template — all compared with what `scripts/llamacpp_reference.py` recorded from
//! llama-cpp-python in `tests/fixtures/llamacpp/`. Plus: corrupt vocabularies are errors.
//!
//! stories260K lives in `../shared/models` (or `$GPU_OFFLOAD_SHARED_MODELS`); SmolLM2 is fetched
//! by `scripts/fetch-models.sh` into `$GPU_OFFLOAD_MODELS` (default
//! `${XDG_CACHE_HOME:-~/.cache}/gpu-offload/models`). A missing model fails the test unless
//! `GPU_OFFLOAD_SKIP_MISSING_MODELS=1`.

use std::path::{Path, PathBuf};

use gpu_offload::model::gguf::{GgufFile, GgufMetadata, MetaValue};
use gpu_offload::model::tokenizer::TextStream;
use gpu_offload::model::{ChatMessage, ModelError, Tokenizer};
use serde_json::Value;

mod common;
use common::ids;

const STORIES: &str = "stories260K";
const SMOLLM2: &str = "SmolLM2-135M-Instruct.Q4_1";

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn fixture(name: &str) -> Value {
    common::json_fixture(&format!("llamacpp/{name}.json"))
}

/// The model's path, or `None` (after saying why) when it is missing and the caller allowed that.
fn model_path(name: &str) -> Option<PathBuf> {
    match name {
        STORIES => Some(common::stories260k()),
        _ => common::smollm2(),
    }
}

/// The model's tokenizer and its fixture, or `None` when skipped.
fn load(name: &str) -> Option<(Tokenizer, Value)> {
    let path = model_path(name)?;
    let fx = fixture(name);
    let size = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
    assert_eq!(
        Some(size),
        fx["size_bytes"].as_u64(),
        "{} is not the file the fixture was recorded from",
        path.display()
    );
    let file = GgufFile::open(&path).unwrap_or_else(|e| panic!("{e}"));
    let tok = Tokenizer::from_gguf(&file.metadata)
        .unwrap_or_else(|e| panic!("{e}"))
        .expect("the model has a tokenizer");
    Some((tok, fx))
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

fn lossy(v: &Value) -> String {
    String::from_utf8_lossy(&hex(v["hex"].as_str().expect("hex text"))).into_owned()
}

fn prompt_texts(fx: &Value) -> Vec<&str> {
    fx["prompts"]
        .as_array()
        .expect("prompts")
        .iter()
        .map(|p| p["text"].as_str().expect("text"))
        .collect()
}

/// Compare `tok` with llama.cpp's ids for every prompt and both settings; a description of each
/// mismatch.
fn mismatches(
    tok: &Tokenizer,
    prompts: &[&str],
    ids_plain: &[Vec<u32>],
    ids_special: &[Vec<u32>],
) -> Vec<String> {
    let mut failures = Vec::new();
    for (i, text) in prompts.iter().enumerate() {
        for (want, parse_special) in [(&ids_plain[i], false), (&ids_special[i], true)] {
            match tok.encode(text, true, parse_special) {
                Ok(got) if &got == want => {}
                got => failures.push(format!(
                    "{text:?} parse_special={parse_special}: got {got:?}, llama.cpp {want:?}"
                )),
            }
        }
    }
    failures
}

/// Every prompt, both settings; all mismatches reported together.
fn check_prompt_ids(name: &str) {
    let Some((tok, fx)) = load(name) else { return };
    let prompts = prompt_texts(&fx);
    let column = |key: &str| -> Vec<Vec<u32>> {
        fx["prompts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| ids(&p[key]))
            .collect()
    };
    let failures = mismatches(&tok, &prompts, &column("ids"), &column("ids_parse_special"));
    assert!(
        failures.is_empty(),
        "{name}: {} of {} encodings differ from llama.cpp:\n{}",
        failures.len(),
        prompts.len() * 2,
        failures.join("\n")
    );
    eprintln!(
        "{name}: {} prompts × 2 settings match llama.cpp",
        prompts.len()
    );
}

#[test]
fn stories260k_prompt_ids_match_llama_cpp() {
    check_prompt_ids(STORIES);
}

#[test]
fn smollm2_prompt_ids_match_llama_cpp() {
    check_prompt_ids(SMOLLM2);
}

/// The SmolLM2 vocabulary under other `tokenizer.ggml.pre` values (GPT-2, Llama 3, Qwen2, default,
/// Falcon splitters; ignore_merges; the detokenizer's space clean-up), against llama.cpp on a
/// vocab-only copy of the file with the same change.
#[test]
fn smollm2_vocab_under_other_pre_tokenizers_matches_llama_cpp() {
    let Some(path) = model_path(SMOLLM2) else {
        return;
    };
    let fx = fixture(SMOLLM2);
    let file = GgufFile::open(&path).unwrap_or_else(|e| panic!("{e}"));
    let prompts = prompt_texts(&fx);
    let variants = fx["pre_variants"].as_array().expect("pre_variants");
    assert!(!variants.is_empty());
    for v in variants {
        let pre = v["pre"].as_str().unwrap();
        let mut meta = file.metadata.clone();
        meta.entries
            .insert("tokenizer.ggml.pre".into(), MetaValue::String(pre.into()));
        let tok = Tokenizer::from_gguf(&meta)
            .unwrap_or_else(|e| panic!("pre {pre}: {e}"))
            .unwrap();
        let column =
            |key: &str| -> Vec<Vec<u32>> { v[key].as_array().unwrap().iter().map(ids).collect() };
        let plain = column("ids");
        let mut failures = mismatches(&tok, &prompts, &plain, &column("ids_parse_special"));
        for (ids, hex_text) in plain.iter().zip(v["detokenized_hex"].as_array().unwrap()) {
            let want = String::from_utf8_lossy(&hex(hex_text.as_str().unwrap())).into_owned();
            let got = tok.decode(ids);
            if got != want {
                failures.push(format!("decode {ids:?}: got {got:?}, llama.cpp {want:?}"));
            }
        }
        assert!(
            failures.is_empty(),
            "pre {pre}: {} mismatches with llama.cpp:\n{}",
            failures.len(),
            failures.join("\n")
        );
        eprintln!(
            "pre {pre}: {} prompts × 2 settings and their decodes match llama.cpp",
            prompts.len()
        );
    }
}

fn check_vocab_facts(name: &str) {
    let Some((tok, fx)) = load(name) else { return };
    assert_eq!(tok.vocab_size() as u64, fx["n_vocab"].as_u64().unwrap());
    let id_or_none = |v: &Value| v.as_i64().filter(|&x| x >= 0).map(|x| x as u32);
    assert_eq!(tok.bos(), id_or_none(&fx["bos"]));
    assert_eq!(tok.eos(), id_or_none(&fx["eos"]));
    let eog = ids(&fx["eog"]);
    let ours: Vec<u32> = (0..tok.vocab_size() as u32)
        .filter(|&id| tok.is_end_of_generation(id))
        .collect();
    assert_eq!(ours, eog, "{name}: end-of-generation ids");
    for p in fx["pieces"].as_array().expect("pieces") {
        let id = p["id"].as_u64().unwrap() as u32;
        assert_eq!(
            tok.token_bytes(id, false),
            hex(p["piece"].as_str().unwrap()),
            "{name}: piece of {id}"
        );
        assert_eq!(
            tok.token_bytes(id, true),
            hex(p["piece_special"].as_str().unwrap()),
            "{name}: special piece of {id}"
        );
    }
}

#[test]
fn stories260k_vocab_pieces_and_eog_match_llama_cpp() {
    check_vocab_facts(STORIES);
}

#[test]
fn smollm2_vocab_pieces_and_eog_match_llama_cpp() {
    check_vocab_facts(SMOLLM2);
}

/// Greedy continuations: prompt ids, `decode` = llama_detokenize, streaming = concatenated pieces.
fn check_greedy_text(name: &str) {
    let Some((tok, fx)) = load(name) else { return };
    for g in fx["greedy"].as_array().expect("greedy") {
        let prompt = g["prompt"].as_str().unwrap();
        let parse_special = g["parse_special"].as_bool().unwrap();
        assert_eq!(
            tok.encode(prompt, true, parse_special).unwrap(),
            ids(&g["prompt_ids"]),
            "{name}: prompt ids of {prompt:?}"
        );
        let out = ids(&g["greedy_ids"]);
        assert_eq!(
            tok.decode(&out),
            lossy(&g["detokenized"]),
            "{name}: decode after {prompt:?}"
        );

        let mut stream = TextStream::new(&tok);
        let mut streamed: String = out.iter().map(|&id| stream.push(id)).collect();
        streamed.push_str(&stream.finish());
        assert_eq!(
            streamed,
            lossy(&g["pieces_concat"]),
            "{name}: stream after {prompt:?}"
        );
    }
}

#[test]
fn stories260k_greedy_text_matches_llama_cpp() {
    check_greedy_text(STORIES);
}

#[test]
fn smollm2_greedy_text_matches_llama_cpp() {
    check_greedy_text(SMOLLM2);
}

#[test]
fn smollm2_chat_template_renders_like_transformers() {
    let Some((tok, fx)) = load(SMOLLM2) else {
        return;
    };
    let chat = &fx["chat"];
    let messages: Vec<ChatMessage> = serde_json::from_value(chat["messages"].clone()).unwrap();
    for r in chat["renders"].as_array().unwrap() {
        let agp = r["add_generation_prompt"].as_bool().unwrap();
        let text = tok.apply_chat_template(&messages, agp).unwrap();
        assert_eq!(
            text,
            r["text"].as_str().unwrap(),
            "add_generation_prompt={agp}"
        );
        assert_eq!(
            tok.encode(&text, true, true).unwrap(),
            ids(&r["ids_parse_special"])
        );
    }
}

#[test]
fn stories260k_has_no_chat_template() {
    let Some((tok, _)) = load(STORIES) else {
        return;
    };
    assert!(tok.chat_template().is_none());
    assert!(tok.apply_chat_template(&[], true).is_err());
}

// ---- corrupt metadata ----------------------------------------------------------------------

fn strings(v: &[&str]) -> MetaValue {
    MetaValue::Array(v.iter().map(|s| MetaValue::String(s.to_string())).collect())
}

/// A small valid "gpt2" vocabulary to break one key at a time.
fn bpe_meta() -> GgufMetadata {
    let mut meta = GgufMetadata {
        path: PathBuf::from("crafted.gguf"),
        ..Default::default()
    };
    let e = &mut meta.entries;
    e.insert(
        "tokenizer.ggml.model".into(),
        MetaValue::String("gpt2".into()),
    );
    e.insert(
        "tokenizer.ggml.pre".into(),
        MetaValue::String("smollm".into()),
    );
    e.insert(
        "tokenizer.ggml.tokens".into(),
        strings(&["<|endoftext|>", "a", "b", "ab", "Ġ"]),
    );
    e.insert(
        "tokenizer.ggml.token_type".into(),
        MetaValue::Array([3, 1, 1, 1, 1].map(MetaValue::I32).to_vec()),
    );
    e.insert("tokenizer.ggml.merges".into(), strings(&["a b"]));
    e.insert("tokenizer.ggml.eos_token_id".into(), MetaValue::U32(0));
    meta
}

fn tokenizer_error(meta: &GgufMetadata) -> String {
    match Tokenizer::from_gguf(meta) {
        Err(e @ ModelError::Tokenizer { .. }) => e.to_string(),
        Err(other) => panic!("wrong error kind: {other}"),
        Ok(_) => panic!("corrupt metadata accepted"),
    }
}

#[test]
fn crafted_bpe_vocabulary_works() {
    let tok = Tokenizer::from_gguf(&bpe_meta()).unwrap().unwrap();
    assert_eq!(
        tok.encode("ab ab<|endoftext|>", false, true).unwrap(),
        [3, 4, 3, 0]
    );
    assert_eq!(tok.decode(&[3, 4, 3, 0]), "ab ab");
    assert!(tok.is_end_of_generation(0));
}

#[test]
fn mismatched_vocab_arrays_are_errors() {
    let mut meta = bpe_meta();
    meta.entries.insert(
        "tokenizer.ggml.token_type".into(),
        MetaValue::Array(vec![MetaValue::I32(1); 3]),
    );
    let err = tokenizer_error(&meta);
    assert!(
        err.contains("token_type") && err.contains("3 entries"),
        "{err}"
    );

    let mut meta = bpe_meta();
    meta.entries.insert(
        "tokenizer.ggml.scores".into(),
        MetaValue::Array(vec![MetaValue::F32(0.0); 9]),
    );
    assert!(tokenizer_error(&meta).contains("scores"));
}

#[test]
fn unknown_tokenizer_model_is_an_error() {
    let mut meta = bpe_meta();
    meta.entries.insert(
        "tokenizer.ggml.model".into(),
        MetaValue::String("wordpiece-9000".into()),
    );
    assert!(tokenizer_error(&meta).contains("wordpiece-9000"));
    meta.entries
        .insert("tokenizer.ggml.model".into(), MetaValue::U32(7));
    assert!(tokenizer_error(&meta).contains("tokenizer.ggml.model"));
}

#[test]
fn unknown_pre_tokenizer_is_an_error_naming_it() {
    let mut meta = bpe_meta();
    meta.entries.insert(
        "tokenizer.ggml.pre".into(),
        MetaValue::String("mystery-pre".into()),
    );
    let err = tokenizer_error(&meta);
    assert!(
        err.contains("mystery-pre") && err.contains("pre-tokenizer"),
        "{err}"
    );
}

#[test]
fn wrongly_typed_vocab_keys_are_errors() {
    let cases: [(&str, MetaValue); 5] = [
        (
            "tokenizer.ggml.tokens",
            MetaValue::Array(vec![MetaValue::U32(1)]),
        ),
        ("tokenizer.ggml.tokens", MetaValue::String("a".into())),
        ("tokenizer.ggml.tokens", MetaValue::Array(vec![])),
        ("tokenizer.ggml.merges", MetaValue::U32(3)),
        ("tokenizer.ggml.bos_token_id", MetaValue::String("1".into())),
    ];
    for (key, value) in cases {
        let mut meta = bpe_meta();
        meta.entries.insert(key.into(), value);
        let err = tokenizer_error(&meta);
        assert!(err.contains(key) || err.contains("empty"), "{key}: {err}");
    }
    let mut meta = bpe_meta();
    meta.entries.remove("tokenizer.ggml.merges");
    assert!(tokenizer_error(&meta).contains("merges"));
    let mut meta = bpe_meta();
    meta.entries.remove("tokenizer.ggml.tokens");
    assert!(tokenizer_error(&meta).contains("tokens"));
}

#[test]
fn out_of_range_ids_never_panic() {
    let mut meta = bpe_meta();
    // An out-of-range special id is ignored, as llama.cpp does.
    meta.entries.insert(
        "tokenizer.ggml.eos_token_id".into(),
        MetaValue::U32(u32::MAX),
    );
    let tok = Tokenizer::from_gguf(&meta).unwrap().unwrap();
    assert!(tok.token_bytes(u32::MAX, true).is_empty());
    assert_eq!(tok.decode(&[99, 1, u32::MAX]), "a");
    assert!(!tok.is_end_of_generation(u32::MAX));
}

#[test]
fn no_tokenizer_model_means_no_tokenizer() {
    let mut meta = bpe_meta();
    meta.entries.remove("tokenizer.ggml.model");
    assert!(Tokenizer::from_gguf(&meta).unwrap().is_none());
    assert!(
        Tokenizer::from_hf_dir(Path::new("/nonexistent-dir"))
            .unwrap()
            .is_none()
    );
}

/// `tokenizer.json` (HF directory) against transformers' own tokenization and chat rendering.
#[test]
fn hf_tokenizer_json_matches_transformers() {
    let dir = crate_dir().join("tests/fixtures/hf/llama-tok");
    let tok = Tokenizer::from_hf_dir(&dir)
        .expect("tokenizer loads")
        .expect("directory has tokenizer.json");
    let fx: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    for case in fx["tokenization"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        assert_eq!(
            tok.encode(text, true, true).unwrap(),
            ids(&case["ids_add_special"]),
            "{text:?} with special tokens"
        );
        assert_eq!(
            tok.encode(text, false, true).unwrap(),
            ids(&case["ids_no_special"]),
            "{text:?} without"
        );
    }
    let chat = &fx["chat"];
    let messages: Vec<ChatMessage> = serde_json::from_value(chat["messages"].clone()).unwrap();
    let rendered = tok
        .apply_chat_template(&messages, chat["add_generation_prompt"].as_bool().unwrap())
        .unwrap();
    assert_eq!(rendered, chat["rendered"].as_str().unwrap());
    assert_eq!(
        tok.encode(&rendered, false, true).unwrap(),
        ids(&chat["ids_no_special"])
    );
    let greedy_prompt = fx["greedy_prompt"].as_str().unwrap();
    assert_eq!(
        tok.encode(greedy_prompt, true, true).unwrap(),
        ids(&fx["greedy"]["prompt_ids"])
    );
}
