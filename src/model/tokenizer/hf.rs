//! Hugging Face tokenizers: `tokenizer.json` through the `tokenizers` crate, plus what transformers
//! reads beside it (`tokenizer_config.json`: chat template, BOS/EOS, add_bos_token;
//! `config.json` / `generation_config.json`: EOS ids).

use std::collections::BTreeSet;
use std::path::Path;

use serde_json::Value;

use super::TokenizeError;
use super::gguf_vocab::EOG_TEXTS;
use super::unicode::char_to_byte;
use crate::model::ModelError;

/// How a vocabulary piece turns back into bytes, judged from the tokenizer's decoder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PieceStyle {
    /// GPT-2 byte-level: every character stands for one byte.
    ByteLevel,
    /// SentencePiece: `▁` is a space, `<0xXX>` a byte.
    SentencePiece,
    /// The piece is the text.
    Plain,
}

/// A `tokenizer.json` tokenizer with the settings transformers would apply.
#[derive(Clone)]
pub(crate) struct HfTokenizer {
    /// Splits special tokens out of the text (`parse_special`).
    parsing: tokenizers::Tokenizer,
    /// Treats special tokens' text as plain text.
    literal: tokenizers::Tokenizer,
    style: PieceStyle,
    special_ids: BTreeSet<u32>,
    /// Every added token (special or not): its text is its piece.
    added_ids: BTreeSet<u32>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub bos_text: Option<String>,
    pub eos_text: Option<String>,
    /// tokenizer_config.json's `add_bos_token`, when given.
    add_bos: Option<bool>,
    eog: BTreeSet<u32>,
    pub chat_template: Option<String>,
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("vocab_size", &self.parsing.get_vocab_size(true))
            .field("style", &self.style)
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("eog", &self.eog)
            .finish()
    }
}

fn error(path: &Path, msg: impl Into<String>) -> ModelError {
    ModelError::Tokenizer {
        path: path.to_path_buf(),
        msg: msg.into(),
    }
}

/// A text file of the directory (held to `max_file_read_bytes`), `None` when absent.
fn read_text(path: &Path) -> Result<Option<String>, ModelError> {
    match crate::model::read_whole_string(path) {
        Ok(t) => Ok(Some(t)),
        Err(ModelError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
            Ok(None)
        }
        Err(ModelError::Io { source, .. }) => Err(error(path, format!("cannot read: {source}"))),
        Err(e) => Err(e),
    }
}

fn parse_json(path: &Path, text: &str) -> Result<Value, ModelError> {
    serde_json::from_str(text).map_err(|e| error(path, format!("not valid JSON: {e}")))
}

/// A JSON file of the directory, `None` when absent.
fn read_json(path: &Path) -> Result<Option<Value>, ModelError> {
    read_text(path)?
        .map(|text| parse_json(path, &text))
        .transpose()
}

/// A special-token entry of tokenizer_config.json: a string or `{"content": ...}`.
fn token_text(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content")?.as_str().map(String::from),
        _ => None,
    }
}

/// `eos_token_id` of config.json / generation_config.json: an id or a list of ids.
fn ids_of(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_u64())
            .filter_map(|x| u32::try_from(x).ok())
            .collect(),
        Some(x) => x
            .as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .into_iter()
            .collect(),
        None => Vec::new(),
    }
}

/// The chat template: a string, or a list of `{name, template}` of which "default" is taken; a
/// separate `chat_template.jinja` (transformers 5's layout) when the config has none.
fn chat_template(dir: &Path, config: Option<&Value>) -> Result<Option<String>, ModelError> {
    match config.and_then(|c| c.get("chat_template")) {
        Some(Value::String(s)) => return Ok(Some(s.clone())),
        Some(Value::Array(list)) => {
            let named = |name: &str| {
                list.iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some(name))
                    .and_then(|t| t.get("template"))
                    .and_then(Value::as_str)
                    .map(String::from)
            };
            return Ok(named("default"));
        }
        _ => {}
    }
    read_text(&dir.join("chat_template.jinja"))
}

/// The decoder's style; a `Sequence` counts as the style of any member that decides it.
fn piece_style(tokenizer_json: &Value) -> PieceStyle {
    fn walk(d: &Value) -> Option<PieceStyle> {
        match d.get("type").and_then(Value::as_str)? {
            "ByteLevel" => Some(PieceStyle::ByteLevel),
            "ByteFallback" | "Metaspace" => Some(PieceStyle::SentencePiece),
            "Replace" if d.to_string().contains('\u{2581}') => Some(PieceStyle::SentencePiece),
            "Sequence" => d.get("decoders")?.as_array()?.iter().find_map(walk),
            _ => None,
        }
    }
    tokenizer_json
        .get("decoder")
        .and_then(walk)
        .unwrap_or(PieceStyle::Plain)
}

impl HfTokenizer {
    pub fn load(dir: &Path) -> Result<Option<HfTokenizer>, ModelError> {
        let path = dir.join("tokenizer.json");
        let Some(text) = read_text(&path)? else {
            return Ok(None);
        };
        let json = parse_json(&path, &text)?;
        let parsing: tokenizers::Tokenizer = shielded("reading it", || text.parse())
            .map_err(|e| error(&path, e))?
            .map_err(|e: tokenizers::Error| error(&path, e.to_string()))?;
        let mut literal = parsing.clone();
        literal.set_encode_special_tokens(true);

        let config = read_json(&dir.join("tokenizer_config.json"))?;
        let model_config = read_json(&dir.join("config.json"))?;
        let generation = read_json(&dir.join("generation_config.json"))?;
        let cfg = |key: &str| config.as_ref().and_then(|c| c.get(key));

        let added = parsing.get_added_tokens_decoder();
        let special_ids: BTreeSet<u32> = added
            .iter()
            .filter(|(_, t)| t.special)
            .map(|(&id, _)| id)
            .collect();
        let added_ids: BTreeSet<u32> = added.keys().copied().collect();
        let bos_text = token_text(cfg("bos_token"));
        let eos_text = token_text(cfg("eos_token"));
        let id_of = |t: &Option<String>| t.as_deref().and_then(|t| parsing.token_to_id(t));
        let bos = id_of(&bos_text).or_else(|| {
            ids_of(model_config.as_ref().and_then(|c| c.get("bos_token_id")))
                .first()
                .copied()
        });
        let model_eos = ids_of(model_config.as_ref().and_then(|c| c.get("eos_token_id")));
        let gen_eos = ids_of(generation.as_ref().and_then(|c| c.get("eos_token_id")));
        let eos = id_of(&eos_text)
            .or_else(|| gen_eos.first().copied())
            .or_else(|| model_eos.first().copied());

        let mut eog: BTreeSet<u32> = eos.into_iter().chain(gen_eos).chain(model_eos).collect();
        eog.extend(
            EOG_TEXTS
                .iter()
                .filter_map(|t| parsing.token_to_id(t))
                .filter(|id| special_ids.contains(id)),
        );
        let bos_text = bos_text.or_else(|| bos.and_then(|id| parsing.id_to_token(id)));
        let eos_text = eos_text.or_else(|| eos.and_then(|id| parsing.id_to_token(id)));

        Ok(Some(HfTokenizer {
            style: piece_style(&json),
            chat_template: chat_template(dir, config.as_ref())?,
            add_bos: cfg("add_bos_token").and_then(Value::as_bool),
            parsing,
            literal,
            special_ids,
            added_ids,
            bos,
            eos,
            bos_text,
            eos_text,
            eog,
        }))
    }

    pub fn vocab_size(&self) -> usize {
        self.parsing.get_vocab_size(true)
    }

    /// The largest token id, added tokens included.
    pub fn max_id(&self) -> Option<u32> {
        self.parsing.get_vocab(true).into_values().max()
    }

    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.contains(&id)
    }

    /// Encode; with `add_special` the post-processor's tokens, then `add_bos_token` enforced when
    /// tokenizer_config.json states it (transformers rebuilds the post-processor from it).
    pub fn encode(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>, TokenizeError> {
        let tok = if parse_special {
            &self.parsing
        } else {
            &self.literal
        };
        let enc = shielded("encoding", || tok.encode(text, add_special))
            .map_err(TokenizeError)?
            .map_err(|e| TokenizeError(e.to_string()))?;
        let mut ids = enc.get_ids().to_vec();
        if add_special && let (Some(bos), Some(want)) = (self.bos, self.add_bos) {
            let plain_starts_with_bos = || {
                shielded("encoding", || tok.encode(text, false))
                    .ok()
                    .and_then(Result::ok)
                    .is_some_and(|e| e.get_ids().first() == Some(&bos))
            };
            let has = ids.first() == Some(&bos);
            if want && !has {
                ids.insert(0, bos);
            } else if !want && has && !plain_starts_with_bos() {
                ids.remove(0);
            }
        }
        Ok(ids)
    }

    /// The bytes token `id` adds to generated text.
    pub fn token_bytes(&self, id: u32, special: bool) -> Vec<u8> {
        let Some(piece) = self.parsing.id_to_token(id) else {
            return Vec::new();
        };
        if self.special_ids.contains(&id) {
            return if special {
                piece.into_bytes()
            } else {
                Vec::new()
            };
        }
        if self.added_ids.contains(&id) {
            return piece.into_bytes();
        }
        match self.style {
            PieceStyle::ByteLevel => piece
                .chars()
                .flat_map(|c| match char_to_byte(c) {
                    Some(b) => vec![b],
                    None => c.to_string().into_bytes(),
                })
                .collect(),
            PieceStyle::SentencePiece => match sentencepiece_byte(&piece) {
                Some(b) => vec![b],
                None => piece.replace('\u{2581}', " ").into_bytes(),
            },
            PieceStyle::Plain => piece.into_bytes(),
        }
    }

    /// The tokenizer's own decoder, without special tokens.
    pub fn decode(&self, ids: &[u32]) -> String {
        let decoded = shielded("decoding", || self.parsing.decode(ids, true));
        decoded.ok().and_then(Result::ok).unwrap_or_else(|| {
            let bytes: Vec<u8> = ids
                .iter()
                .flat_map(|&id| self.token_bytes(id, false))
                .collect();
            String::from_utf8_lossy(&bytes).into_owned()
        })
    }
}

/// Runs a call into the `tokenizers` crate, turning its panics into errors: a hostile
/// `tokenizer.json` reaches `panic!`s inside the crate (a BPE `continuing_subword_prefix` longer
/// than a merge's token; a post-processor template naming an undefined special token — the
/// fuzz regressions in tests/fuzz_regressions/tokenizer_json). The panic message is kept for
/// the error and not printed by the panic hook.
fn shielded<T>(what: &str, f: impl FnOnce() -> T) -> Result<T, String> {
    use std::cell::Cell;
    use std::panic::{AssertUnwindSafe, catch_unwind};
    thread_local! {
        static SHIELDED: Cell<bool> = const { Cell::new(false) };
    }
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !SHIELDED.with(Cell::get) {
                previous(info);
            }
        }));
    });
    let was = SHIELDED.with(|s| s.replace(true));
    let result = catch_unwind(AssertUnwindSafe(f));
    SHIELDED.with(|s| s.set(was));
    result.map_err(|payload| {
        let msg = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        format!("the tokenizers library failed while {what}: {msg}")
    })
}

/// `<0xXX>` → the byte.
fn sentencepiece_byte(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}
