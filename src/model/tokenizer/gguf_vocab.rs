//! Vocabularies built from GGUF metadata (`tokenizer.ggml.*`), with llama.cpp's semantics: token
//! attributes, default and declared special ids, the end-of-generation set (including llama.cpp's
//! detection of control tokens by their text), add-BOS/EOS and prefix-space rules, encoding
//! (special-token partition, then SPM or byte-level BPE) and detokenizing.
//!
//! Everything read from the file is checked: a malformed vocabulary is a `ModelError::Tokenizer`,
//! never a panic.

use std::collections::{BTreeSet, HashMap};

use super::TokenizeError;
use super::bpe::{self, BpeVocab, MergeRanks};
use super::partition::{Fragment, SpecialToken, partition};
use super::pretokenize::{self, PreTokenizer};
use super::spm::{self, SpmVocab};
use super::unicode::char_to_byte;
use crate::model::ModelError;
use crate::model::gguf::GgufMetadata;

/// Token attributes (llama.cpp's `llama_token_attr` bits that matter here).
mod attr {
    pub const UNDEFINED: u16 = 0;
    pub const UNKNOWN: u16 = 1 << 0;
    pub const UNUSED: u16 = 1 << 1;
    pub const NORMAL: u16 = 1 << 2;
    pub const CONTROL: u16 = 1 << 3;
    pub const USER_DEFINED: u16 = 1 << 4;
    pub const BYTE: u16 = 1 << 5;
    pub const LSTRIP: u16 = 1 << 7;
    pub const RSTRIP: u16 = 1 << 8;
}

/// `tokenizer.ggml.token_type` values.
fn attr_of_type(ty: i64) -> u16 {
    match ty {
        1 => attr::NORMAL,
        2 => attr::UNKNOWN,
        3 => attr::CONTROL,
        4 => attr::USER_DEFINED,
        5 => attr::UNUSED,
        6 => attr::BYTE,
        _ => attr::UNDEFINED,
    }
}

#[derive(Clone, Debug)]
struct TokenData {
    text: String,
    score: f32,
    attr: u16,
}

#[derive(Clone, Debug)]
enum Algo {
    Spm,
    Bpe {
        pre: PreTokenizer,
        merges: MergeRanks,
    },
}

/// A GGUF vocabulary, ready to encode and decode.
#[derive(Clone)]
pub(crate) struct GgufVocab {
    algo: Algo,
    tokens: Vec<TokenData>,
    ids: HashMap<String, u32>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    unk: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
    clean_spaces: bool,
    eog: BTreeSet<u32>,
    /// Matched in the text before merging, longest first.
    specials: Vec<SpecialToken>,
}

impl std::fmt::Debug for GgufVocab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match &self.algo {
            Algo::Spm => "llama (SPM)".to_string(),
            Algo::Bpe { pre, merges } => {
                format!("gpt2 (BPE, pre {}, {} merges)", pre.name, merges.len())
            }
        };
        f.debug_struct("GgufVocab")
            .field("kind", &kind)
            .field("n_tokens", &self.tokens.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("add_bos", &self.add_bos)
            .field("eog", &self.eog)
            .finish()
    }
}

const KEY_MODEL: &str = "tokenizer.ggml.model";
const KEY_PRE: &str = "tokenizer.ggml.pre";
const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
const KEY_SCORES: &str = "tokenizer.ggml.scores";
const KEY_TYPES: &str = "tokenizer.ggml.token_type";
const KEY_MERGES: &str = "tokenizer.ggml.merges";
const KEY_CHAT_TEMPLATE: &str = "tokenizer.chat_template";

fn error(meta: &GgufMetadata, msg: impl Into<String>) -> ModelError {
    ModelError::Tokenizer {
        path: meta.path.clone(),
        msg: msg.into(),
    }
}

/// Re-wrap a metadata lookup error as a tokenizer error, keeping its message.
fn meta_error(meta: &GgufMetadata, e: ModelError) -> ModelError {
    match e {
        ModelError::Format { msg, .. } => error(meta, msg),
        other => other,
    }
}

/// Special ids and flags as llama.cpp initialises them for a vocabulary type (BPE when there is a
/// pre-tokenizer, SPM otherwise), before the metadata overrides them.
struct Settings {
    bos: Option<u32>,
    eos: Option<u32>,
    unk: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
    clean_spaces: bool,
}

impl Settings {
    fn defaults(pre: Option<&PreTokenizer>) -> Settings {
        match pre {
            Some(pre) => Settings {
                bos: if pre.no_bos { None } else { Some(11) },
                eos: Some(11),
                unk: None,
                add_bos: pre.add_bos.unwrap_or(false),
                add_eos: false,
                add_space_prefix: false,
                clean_spaces: pre.clean_spaces,
            },
            None => Settings {
                bos: Some(1),
                eos: Some(2),
                unk: Some(0),
                add_bos: true,
                add_eos: false,
                add_space_prefix: true,
                clean_spaces: false,
            },
        }
    }
}

/// Ids llama.cpp finds by token text when the metadata does not give them; each found token is
/// forced to be a control token. `(metadata keys, candidate texts, ends generation)`.
#[rustfmt::skip]
const DETECTED_ROLES: &[(&[&str], &[&str], bool)] = &[
    (&["tokenizer.ggml.eot_token_id"], &["<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>"], true),
    (&["tokenizer.ggml.eom_token_id"], &["<|eom_id|>"], true),
    (&["tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id"], &["<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>", "<|prefix|>"], false),
    (&["tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.suffix_token_id"], &["<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>", "<|code_suffix|>", "<|suffix|>"], false),
    (&["tokenizer.ggml.fim_mid_token_id", "tokenizer.ggml.middle_token_id"], &["<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>", "<|middle|>"], false),
    (&["tokenizer.ggml.fim_pad_token_id"], &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"], true),
    (&["tokenizer.ggml.fim_rep_token_id"], &["<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"], true),
    (&["tokenizer.ggml.fim_sep_token_id"], &["<|file_sep|>"], true),
];

/// Token texts that end generation wherever they appear in a vocabulary (forced to control).
pub(crate) const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

impl GgufVocab {
    /// Build from metadata; `None` when the file declares no vocabulary.
    pub fn load(meta: &GgufMetadata) -> Result<Option<GgufVocab>, ModelError> {
        let Some(model) = meta.get(KEY_MODEL) else {
            return Ok(None);
        };
        let model = model
            .as_str()
            .ok_or_else(|| error(meta, format!("`{KEY_MODEL}` is not a string")))?;
        // SPM has no pre-tokenizer; byte-level BPE needs the one the file names.
        let pre = match model {
            "llama" => None,
            "gpt2" => Some(read_pre(meta)?),
            // llama.cpp's markers for a model without a vocabulary.
            "none" | "no_vocab" => return Ok(None),
            other => {
                return Err(error(
                    meta,
                    format!("unknown tokenizer model `{other}` (supported: llama, gpt2)"),
                ));
            }
        };
        let mut tokens = read_tokens(meta)?;
        let ids = index_tokens(meta, &tokens)?;
        let n = tokens.len() as u32;

        let mut s = Settings::defaults(pre.as_ref());
        read_flags(meta, &mut s)?;
        for (key, slot) in [
            ("tokenizer.ggml.bos_token_id", &mut s.bos),
            ("tokenizer.ggml.eos_token_id", &mut s.eos),
            ("tokenizer.ggml.unknown_token_id", &mut s.unk),
        ] {
            *slot = special_id(meta, &[key], slot.filter(|&id| id < n), n)?;
        }
        let eog = end_of_generation(meta, &mut tokens, &ids, &s)?;
        apply_model_quirks(meta, &mut tokens, &ids)?;
        let specials = special_tokens(&tokens);

        let algo = match pre {
            Some(pre) => Algo::Bpe {
                pre,
                merges: read_merges(meta)?,
            },
            None => Algo::Spm,
        };
        Ok(Some(GgufVocab {
            algo,
            tokens,
            ids,
            bos: s.bos,
            eos: s.eos,
            unk: s.unk,
            add_bos: s.add_bos,
            add_eos: s.add_eos,
            add_space_prefix: s.add_space_prefix,
            clean_spaces: s.clean_spaces,
            eog,
            specials,
        }))
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.contains(&id)
    }

    /// llama.cpp's `llama_tokenize`.
    pub fn encode(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>, TokenizeError> {
        let frags = partition(text, &self.specials, parse_special);
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && self.add_bos {
            out.push(self.bos.ok_or_else(|| {
                TokenizeError("the vocabulary adds BOS but has no BOS token".into())
            })?);
        }
        match &self.algo {
            Algo::Spm => self.encode_spm(text, &frags, &mut out)?,
            Algo::Bpe { pre, merges } => self.encode_bpe(text, &frags, pre, merges, &mut out),
        }
        if add_special && self.add_eos {
            out.push(self.eos.ok_or_else(|| {
                TokenizeError("the vocabulary adds EOS but has no EOS token".into())
            })?);
        }
        Ok(out)
    }

    fn encode_spm(
        &self,
        text: &str,
        frags: &[Fragment],
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizeError> {
        // A text fragment at the start or right after a special token gets the prefix space.
        let mut after_special = true;
        for frag in frags {
            match frag {
                Fragment::Text(r) => {
                    let mut s = String::with_capacity(r.len() + 1);
                    if self.add_space_prefix && after_special {
                        s.push(' ');
                    }
                    s.push_str(&text[r.clone()]);
                    spm::tokenize(self, &s.replace(' ', "\u{2581}"), out)?;
                    after_special = false;
                }
                Fragment::Token(id) => {
                    out.push(*id);
                    after_special = true;
                }
            }
        }
        Ok(())
    }

    fn encode_bpe(
        &self,
        text: &str,
        frags: &[Fragment],
        pre: &PreTokenizer,
        merges: &MergeRanks,
        out: &mut Vec<u32>,
    ) {
        let view = BpeView {
            vocab: self,
            merges,
            ignore_merges: pre.ignore_merges,
        };
        for frag in frags {
            match frag {
                Fragment::Text(r) => {
                    for word in pre.split(&text[r.clone()]) {
                        bpe::tokenize_word(&view, &bpe::byte_encode(word), out);
                    }
                }
                Fragment::Token(id) => out.push(*id),
            }
        }
    }

    /// llama.cpp's `token_to_piece` (no left strip): what token `id` adds to the text.
    pub fn piece(&self, id: u32, special: bool) -> Vec<u8> {
        let Some(t) = self.tokens.get(id as usize) else {
            return Vec::new();
        };
        if !special && t.attr & (attr::UNKNOWN | attr::CONTROL) != 0 {
            return Vec::new();
        }
        if t.attr & (attr::UNKNOWN | attr::CONTROL | attr::USER_DEFINED) != 0 {
            return t.text.as_bytes().to_vec();
        }
        if t.attr & attr::NORMAL != 0 {
            return match self.algo {
                Algo::Spm => t.text.replace('\u{2581}', " ").into_bytes(),
                Algo::Bpe { .. } => byte_decode(&t.text),
            };
        }
        if t.attr & attr::BYTE != 0 {
            return vec![byte_of_token(&t.text)];
        }
        Vec::new()
    }

    /// llama.cpp's `llama_detokenize(remove_special = false, unparse_special = false)`.
    pub fn detokenize(&self, ids: &[u32]) -> Vec<u8> {
        let mut out = Vec::new();
        // The prefix space the encoder added comes off the first token again.
        let mut remove_space = self.add_space_prefix;
        for &id in ids {
            let p = self.piece(id, false);
            let skip = usize::from(remove_space && p.first() == Some(&b' '));
            out.extend_from_slice(&p[skip..]);
            remove_space = false;
        }
        if self.clean_spaces {
            out = clean_up_spaces(&out);
        }
        out
    }

    fn lookup(&self, text: &str) -> Option<u32> {
        self.ids.get(text).copied()
    }
}

impl SpmVocab for GgufVocab {
    fn lookup(&self, text: &str) -> Option<u32> {
        GgufVocab::lookup(self, text)
    }
    fn score(&self, id: u32) -> f32 {
        self.tokens.get(id as usize).map_or(0.0, |t| t.score)
    }
    fn byte_token(&self, byte: u8) -> Option<u32> {
        let mut buf = [0u8; 4];
        self.lookup(&format!("<0x{byte:02X}>"))
            .or_else(|| {
                byte.is_ascii()
                    .then(|| self.lookup(char::from(byte).encode_utf8(&mut buf)))
                    .flatten()
            })
            // llama.cpp throws here; the unknown token is the graceful equivalent.
            .or(self.unk)
    }
}

struct BpeView<'a> {
    vocab: &'a GgufVocab,
    merges: &'a MergeRanks,
    ignore_merges: bool,
}

impl BpeVocab for BpeView<'_> {
    fn lookup(&self, text: &str) -> Option<u32> {
        self.vocab.lookup(text)
    }
    fn rank(&self, left: &str, right: &str) -> Option<u32> {
        self.merges.get(left, right)
    }
    fn ignore_merges(&self) -> bool {
        self.ignore_merges
    }
}

/// The byte of a `<0xXX>` token, read the way llama.cpp does (hex digits at 3..5, 0 if none).
fn byte_of_token(text: &str) -> u8 {
    let digits: String = text
        .chars()
        .skip(3)
        .take(2)
        .take_while(char::is_ascii_hexdigit)
        .collect();
    u8::from_str_radix(&digits, 16).unwrap_or(0)
}

/// Undo GPT-2's byte encoding of a token's text. Characters outside the map are written the way
/// llama.cpp writes them (`[UNK_BYTE_0x..<text>]`).
fn byte_decode(text: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    for c in text.chars() {
        match char_to_byte(c) {
            Some(b) => out.push(b),
            None => {
                out.extend_from_slice(b"[UNK_BYTE_0x");
                let mut buf = [0u8; 4];
                for b in c.encode_utf8(&mut buf).bytes() {
                    out.extend_from_slice(format!("{b:02x}").as_bytes());
                }
                out.extend_from_slice(text.as_bytes());
                out.push(b']');
            }
        }
    }
    out
}

/// llama.cpp's `clean_up_tokenization_spaces` passes over detokenized bytes. Each pass keeps the
/// first byte and may drop the space just written before the current byte.
fn clean_up_spaces(text: &[u8]) -> Vec<u8> {
    // " ?", " !", " .", " ,": drop the space.
    let mut out = Vec::with_capacity(text.len());
    for (i, &x) in text.iter().enumerate() {
        if i > 0 && text[i - 1] == b' ' && matches!(x, b'?' | b'!' | b'.' | b',') {
            out.pop();
        }
        out.push(x);
    }

    // " ' ": drop the spaces around a lone apostrophe. The skipped space is overwritten with NUL
    // (as llama.cpp does in place), so it no longer counts as a space for the next byte.
    let mut t = std::mem::take(&mut out);
    let mut i = 0;
    while i < t.len() {
        let x = t[i];
        if i > 0 && x == b'\'' && i + 1 < t.len() && t[i - 1] == b' ' && t[i + 1] == b' ' {
            out.pop();
            t[i + 1] = 0;
            i += 1;
        }
        out.push(x);
        i += 1;
    }

    // " 's", " 'm", " 're", " 've": drop the space (" 't", " 'd", " 'll" keep it).
    let t = std::mem::take(&mut out);
    for (i, &x) in t.iter().enumerate() {
        if i > 0 && t[i - 1] == b' ' && x == b'\'' && i + 1 < t.len() {
            let x1 = t[i + 1];
            let x2 = t.get(i + 2).copied();
            if matches!(x1, b's' | b'm')
                || matches!((x1, x2), (b'r', Some(b'e')) | (b'v', Some(b'e')))
            {
                out.pop();
            }
        }
        out.push(x);
    }
    out
}

/// `tokenizer.chat_template`, when the file has one.
pub(crate) fn chat_template(meta: &GgufMetadata) -> Result<Option<String>, ModelError> {
    Ok(meta
        .opt_str(KEY_CHAT_TEMPLATE)
        .map_err(|e| meta_error(meta, e))?
        .map(String::from))
}

fn read_pre(meta: &GgufMetadata) -> Result<PreTokenizer, ModelError> {
    let name = meta
        .opt_str(KEY_PRE)
        .map_err(|e| meta_error(meta, e))?
        .unwrap_or("");
    PreTokenizer::from_name(name).ok_or_else(|| {
        let known: Vec<&str> = pretokenize::known_names().collect();
        error(
            meta,
            format!(
                "unknown pre-tokenizer `{name}` (`{KEY_PRE}`); supported: {}",
                known.join(", ")
            ),
        )
    })
}

fn read_tokens(meta: &GgufMetadata) -> Result<Vec<TokenData>, ModelError> {
    let texts = meta
        .str_array(KEY_TOKENS)
        .map_err(|e| meta_error(meta, e))?;
    let n = texts.len();
    if n == 0 {
        return Err(error(meta, format!("`{KEY_TOKENS}` is empty")));
    }
    if u32::try_from(n).is_err() {
        return Err(error(
            meta,
            format!("`{KEY_TOKENS}` has {n} entries, more than token ids can hold"),
        ));
    }
    let scores = match meta.get(KEY_SCORES) {
        None => vec![0.0; n],
        Some(_) => meta
            .f32_array(KEY_SCORES)
            .map_err(|e| meta_error(meta, e))?,
    };
    let types = match meta.get(KEY_TYPES) {
        None => vec![1; n],
        Some(_) => meta.i64_array(KEY_TYPES).map_err(|e| meta_error(meta, e))?,
    };
    for (key, len) in [(KEY_SCORES, scores.len()), (KEY_TYPES, types.len())] {
        if len != n {
            return Err(error(
                meta,
                format!("`{key}` has {len} entries but `{KEY_TOKENS}` has {n}"),
            ));
        }
    }
    Ok(texts
        .iter()
        .zip(scores)
        .zip(types)
        .enumerate()
        .map(|(i, ((text, score), ty))| TokenData {
            // llama.cpp renames empty tokens so that every text maps to one id.
            text: if text.is_empty() {
                format!("[EMPTY_{i}]")
            } else {
                text.to_string()
            },
            score,
            attr: attr_of_type(ty),
        })
        .collect())
}

fn index_tokens(
    meta: &GgufMetadata,
    tokens: &[TokenData],
) -> Result<HashMap<String, u32>, ModelError> {
    let mut ids = HashMap::with_capacity(tokens.len());
    for (i, t) in tokens.iter().enumerate() {
        if let Some(prev) = ids.insert(t.text.clone(), i as u32) {
            // llama.cpp refuses such a vocabulary too (its text → id map would lose a token).
            return Err(error(
                meta,
                format!("tokens {prev} and {i} have the same text {:?}", t.text),
            ));
        }
    }
    Ok(ids)
}

fn read_flags(meta: &GgufMetadata, s: &mut Settings) -> Result<(), ModelError> {
    for (key, slot) in [
        ("tokenizer.ggml.add_space_prefix", &mut s.add_space_prefix),
        ("tokenizer.ggml.add_bos_token", &mut s.add_bos),
        ("tokenizer.ggml.add_eos_token", &mut s.add_eos),
    ] {
        if let Some(v) = meta.opt_bool(key).map_err(|e| meta_error(meta, e))? {
            *slot = v;
        }
    }
    Ok(())
}

/// The id under the first present key: a valid id replaces `default`, an out-of-range one is
/// ignored (llama.cpp warns and keeps the default); a value that is not an integer is an error.
fn special_id(
    meta: &GgufMetadata,
    keys: &[&str],
    default: Option<u32>,
    n_tokens: u32,
) -> Result<Option<u32>, ModelError> {
    let mut id = default;
    for key in keys {
        let Some(v) = meta.get(key) else { continue };
        if v.as_i64().is_none() && v.as_u64().is_none() {
            return Err(error(meta, format!("`{key}` is not an integer")));
        }
        if let Some(v) = v.as_u64().and_then(|v| u32::try_from(v).ok())
            && v < n_tokens
        {
            id = Some(v);
        }
    }
    Ok(id)
}

/// llama.cpp's end-of-generation set: declared eos/eot/eom and FIM pad/repo/sep ids, ids found by
/// text for the roles the metadata leaves open, and every token with an EOG text; then its two
/// corrections for vocabularies where `<|end|>` or `</s>` is an ordinary token.
fn end_of_generation(
    meta: &GgufMetadata,
    tokens: &mut [TokenData],
    ids: &HashMap<String, u32>,
    s: &Settings,
) -> Result<BTreeSet<u32>, ModelError> {
    let mut eog = BTreeSet::new();
    let mut by_id: Vec<(&String, &u32)> = ids.iter().collect();
    by_id.sort_by_key(|&(_, &id)| id);
    let n = tokens.len() as u32;
    for (keys, texts, ends) in DETECTED_ROLES {
        let mut id = special_id(meta, keys, None, n)?;
        if id.is_none() {
            // llama.cpp takes whichever candidate its hash map yields first; lowest id here.
            id = by_id
                .iter()
                .find(|(t, _)| texts.contains(&t.as_str()))
                .map(|&(_, &i)| i);
            if let Some(i) = id {
                tokens[i as usize].attr |= attr::CONTROL;
            }
        }
        if *ends {
            eog.extend(id);
        }
    }
    for &(text, &id) in &by_id {
        if EOG_TEXTS.contains(&text.as_str()) {
            eog.insert(id);
            tokens[id as usize].attr |= attr::CONTROL;
        }
    }
    // gpt-oss: these always render.
    for text in ["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"] {
        if let Some(&id) = ids.get(text) {
            tokens[id as usize].attr = attr::USER_DEFINED;
        }
    }
    eog.extend(s.eos);
    let has =
        |eog: &BTreeSet<u32>, text: &str| ids.get(text).filter(|id| eog.contains(id)).copied();
    let call = has(&eog, "<|call|>").or(has(&eog, "<|calls|>"));
    if let Some(end) = has(&eog, "<|end|>")
        && call.is_some()
        && (has(&eog, "<|return|>").is_some() || has(&eog, "<|flush|>").is_some())
    {
        eog.remove(&end);
        tokens[end as usize].attr = attr::USER_DEFINED;
    }
    if let Some(s_id) = has(&eog, "</s>")
        && (has(&eog, "<|tool_response>").is_some() || has(&eog, "<|plamo:eos|>").is_some())
    {
        eog.remove(&s_id);
        tokens[s_id as usize].attr = attr::NORMAL;
    }
    Ok(eog)
}

/// Per-model attribute fixes llama.cpp applies by model name (Phi-3: special tokens swallow the
/// whitespace after them, except `<unk>`, `<s>` and `<|endoftext|>`).
fn apply_model_quirks(
    meta: &GgufMetadata,
    tokens: &mut [TokenData],
    ids: &HashMap<String, u32>,
) -> Result<(), ModelError> {
    let name = meta
        .opt_str("general.name")
        .map_err(|e| meta_error(meta, e))?
        .unwrap_or("")
        .to_lowercase();
    if !(name.contains("phi-3") || name.contains("phi3")) {
        return Ok(());
    }
    for t in tokens.iter_mut() {
        if is_special(t.attr) {
            t.attr |= attr::RSTRIP;
        }
    }
    for (text, on) in [
        ("</s>", true),
        ("<unk>", false),
        ("<s>", false),
        ("<|endoftext|>", false),
    ] {
        if let Some(&id) = ids.get(text) {
            let a = &mut tokens[id as usize].attr;
            *a = if on {
                *a | attr::RSTRIP
            } else {
                *a & !attr::RSTRIP
            };
        }
    }
    Ok(())
}

fn is_special(a: u16) -> bool {
    a & (attr::CONTROL | attr::USER_DEFINED | attr::UNKNOWN) != 0
}

/// Control, user-defined and unknown tokens, longest text first (ties by id, for determinism).
fn special_tokens(tokens: &[TokenData]) -> Vec<SpecialToken> {
    let mut v: Vec<SpecialToken> = tokens
        .iter()
        .enumerate()
        .filter(|(_, t)| is_special(t.attr))
        .map(|(i, t)| SpecialToken {
            id: i as u32,
            text: t.text.clone(),
            control: t.attr & (attr::CONTROL | attr::UNKNOWN) != 0,
            lstrip: t.attr & attr::LSTRIP != 0,
            rstrip: t.attr & attr::RSTRIP != 0,
        })
        .collect();
    v.sort_by(|a, b| b.text.len().cmp(&a.text.len()).then(a.id.cmp(&b.id)));
    v
}

fn read_merges(meta: &GgufMetadata) -> Result<MergeRanks, ModelError> {
    if meta.get(KEY_MERGES).is_none() {
        return Err(error(
            meta,
            format!("a gpt2 vocabulary needs `{KEY_MERGES}`"),
        ));
    }
    let merges = meta
        .str_array(KEY_MERGES)
        .map_err(|e| meta_error(meta, e))?;
    Ok(MergeRanks::new(merges))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clean_up_spaces_matches_llama_cpp() {
        let c = |s: &str| String::from_utf8(clean_up_spaces(s.as_bytes())).unwrap();
        assert_eq!(c("Hello , world !"), "Hello, world!");
        assert_eq!(c("a ' b"), "a'b");
        assert_eq!(c("it 's I 'm we 're they 've"), "it's I'm we're they've");
        assert_eq!(c("don 't you 'll"), "don 't you 'll");
        assert_eq!(c(""), "");
        assert_eq!(c("x ' ,"), "x ',");
        // The space skipped after a lone apostrophe does not count for the next one.
        assert_eq!(c("a ' ' b"), "a'' b");
    }

    #[test]
    fn byte_tokens_parse_like_strtol() {
        assert_eq!(byte_of_token("<0x0A>"), 10);
        assert_eq!(byte_of_token("<0xff>"), 255);
        assert_eq!(byte_of_token("<0xZZ>"), 0);
        assert_eq!(byte_of_token("x"), 0);
    }

    #[test]
    fn byte_decoding_reverses_gpt2_encoding() {
        assert_eq!(byte_decode("ĠhelloĊ"), b" hello\n");
        assert_eq!(byte_decode("中"), "[UNK_BYTE_0xe4b8ad中]".as_bytes());
    }
}
