//! Tokenizers: SentencePiece-style ("llama") and byte-level BPE ("gpt2") vocabularies from GGUF
//! metadata, and `tokenizer.json` from Hugging Face directories; chat templates; incremental
//! decoding for streaming.
//!
//! Token ids for a GGUF file equal llama.cpp's for the same file (`tests/tokenizer_parity.rs`
//! checks this against recorded llama.cpp output). This module knows text and ids only: nothing
//! about weights, devices or generation.
//!
//! Layout: `gguf_vocab` (GGUF vocabularies: loading, special tokens, encode/decode) built on
//! `partition` (special-token splitting), `spm` and `bpe` (the merge algorithms), `pretokenize`
//! and `unicode` (BPE word splitting); `hf` wraps the `tokenizers` crate; `chat` renders templates.

mod bpe;
mod chat;
mod gguf_vocab;
mod hf;
mod partition;
mod pretokenize;
mod spm;
mod unicode;

use std::path::Path;

use super::ModelError;
use super::gguf::GgufMetadata;
use gguf_vocab::GgufVocab;
use hf::HfTokenizer;

/// One chat message for a chat template.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

#[derive(Debug, thiserror::Error)]
#[error("tokenizer: {0}")]
pub struct TokenizeError(pub String);

#[derive(Clone, Debug)]
enum Backend {
    Gguf(Box<GgufVocab>),
    Hf(Box<HfTokenizer>),
}

/// A model's tokenizer and chat template.
#[derive(Clone, Debug)]
pub struct Tokenizer {
    backend: Backend,
    chat_template: Option<String>,
}

impl Tokenizer {
    /// The tokenizer a GGUF file describes; `None` when it has no `tokenizer.ggml.model` (or
    /// declares no vocabulary).
    pub fn from_gguf(meta: &GgufMetadata) -> Result<Option<Tokenizer>, ModelError> {
        let Some(vocab) = GgufVocab::load(meta)? else {
            return Ok(None);
        };
        let chat_template = gguf_vocab::chat_template(meta)?;
        Ok(Some(Tokenizer {
            backend: Backend::Gguf(Box::new(vocab)),
            chat_template,
        }))
    }

    /// The tokenizer of a Hugging Face model directory; `None` when it has no tokenizer.json.
    /// Reads tokenizer_config.json (chat_template, bos/eos, add_bos_token) and the EOS ids of
    /// config.json / generation_config.json when present.
    pub fn from_hf_dir(dir: &Path) -> Result<Option<Tokenizer>, ModelError> {
        let Some(tok) = HfTokenizer::load(dir)? else {
            return Ok(None);
        };
        Ok(Some(Tokenizer {
            chat_template: tok.chat_template.clone(),
            backend: Backend::Hf(Box::new(tok)),
        }))
    }

    pub fn vocab_size(&self) -> usize {
        match &self.backend {
            Backend::Gguf(v) => v.len(),
            Backend::Hf(t) => t.vocab_size(),
        }
    }

    /// The largest id a text can encode to.
    pub fn max_id(&self) -> Option<u32> {
        match &self.backend {
            Backend::Gguf(v) => v.len().checked_sub(1).map(|n| n as u32),
            Backend::Hf(t) => t.max_id(),
        }
    }

    /// Text to ids. `add_special`: add BOS (and EOS) as the model's metadata says (llama.cpp's
    /// `add_special`); `parse_special`: text like `<|im_start|>` becomes that control token
    /// (llama.cpp's `parse_special`). User-defined tokens are always recognised.
    pub fn encode(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>, TokenizeError> {
        match &self.backend {
            Backend::Gguf(v) => v.encode(text, add_special, parse_special),
            Backend::Hf(t) => t.encode(text, add_special, parse_special),
        }
    }

    /// The bytes token `id` contributes to generated text: byte tokens give their byte, SPM `▁`
    /// gives a space, byte-level BPE gives its decoded bytes; control tokens give nothing unless
    /// `special`. May be part of a UTF-8 sequence. Unknown ids give nothing.
    pub fn token_bytes(&self, id: u32, special: bool) -> Vec<u8> {
        match &self.backend {
            Backend::Gguf(v) => v.piece(id, special),
            Backend::Hf(t) => t.token_bytes(id, special),
        }
    }

    /// Whole-sequence decode like llama.cpp's `llama_detokenize(remove_special = false,
    /// unparse_special = false)`: control tokens vanish, the first token loses the prefix space
    /// the encoder adds, and invalid UTF-8 becomes U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> String {
        match &self.backend {
            Backend::Gguf(v) => String::from_utf8_lossy(&v.detokenize(ids)).into_owned(),
            Backend::Hf(t) => t.decode(ids),
        }
    }

    pub fn bos(&self) -> Option<u32> {
        match &self.backend {
            Backend::Gguf(v) => v.bos,
            Backend::Hf(t) => t.bos,
        }
    }

    pub fn eos(&self) -> Option<u32> {
        match &self.backend {
            Backend::Gguf(v) => v.eos,
            Backend::Hf(t) => t.eos,
        }
    }

    /// End-of-generation tokens (llama.cpp's EOG set: eos, eot, eom, and control tokens such as
    /// `<|im_end|>`, `<|endoftext|>`, `<|eot_id|>`), so generation stops there.
    pub fn is_end_of_generation(&self, id: u32) -> bool {
        match &self.backend {
            Backend::Gguf(v) => v.is_eog(id),
            Backend::Hf(t) => t.is_eog(id),
        }
    }

    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Render the chat template (minijinja, with what Hugging Face templates use); `bos_token`
    /// and `eos_token` are the texts of the model's BOS/EOS tokens. Error if there is no template.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizeError> {
        let template = self
            .chat_template()
            .ok_or_else(|| TokenizeError("the model has no chat template".into()))?;
        let (bos, eos) = self.special_texts();
        chat::render(template, messages, add_generation_prompt, &bos, &eos)
    }

    /// [`Tokenizer::apply_chat_template`], or ChatML when the model has no template (what
    /// llama.cpp falls back to); the flag says ChatML was used (it writes no BOS text).
    pub fn apply_chat_template_or_chatml(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<(String, bool), TokenizeError> {
        if self.chat_template().is_some() {
            return Ok((
                self.apply_chat_template(messages, add_generation_prompt)?,
                false,
            ));
        }
        Ok((chatml(messages, add_generation_prompt), true))
    }

    fn special_texts(&self) -> (String, String) {
        match &self.backend {
            Backend::Gguf(v) => {
                let text = |id: Option<u32>| {
                    id.map(|id| String::from_utf8_lossy(&v.piece(id, true)).into_owned())
                        .unwrap_or_default()
                };
                (text(v.bos), text(v.eos))
            }
            Backend::Hf(t) => (
                t.bos_text.clone().unwrap_or_default(),
                t.eos_text.clone().unwrap_or_default(),
            ),
        }
    }
}

/// Incremental decoder for streaming: push token ids, get back only complete UTF-8 text. A token
/// that ends inside a multi-byte character is held until the character completes; invalid bytes
/// become U+FFFD. The concatenated output equals the concatenated token pieces (llama.cpp's
/// `token_to_piece`, control tokens hidden), with no prefix-space removal: a stream continues a
/// prompt.
pub struct TextStream<T: std::ops::Deref<Target = Tokenizer>> {
    tok: T,
    pending: Vec<u8>,
}

impl<T: std::ops::Deref<Target = Tokenizer>> TextStream<T> {
    pub fn new(tok: T) -> Self {
        TextStream {
            tok,
            pending: Vec::new(),
        }
    }

    /// Add token `id`; returns the text that became complete.
    pub fn push(&mut self, id: u32) -> String {
        self.pending.extend(self.tok.token_bytes(id, false));
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let good = e.valid_up_to();
                    out.push_str(&String::from_utf8_lossy(&self.pending[..good]));
                    match e.error_len() {
                        // An incomplete character at the end: wait for more bytes.
                        None => {
                            self.pending.drain(..good);
                            return out;
                        }
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            self.pending.drain(..good + bad);
                        }
                    }
                }
            }
        }
    }

    /// Whatever is still held (an incomplete character comes out as U+FFFD).
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}

/// ChatML: `<|im_start|>{role}\n{content}<|im_end|>\n` per message, then
/// `<|im_start|>assistant\n` when a reply is to follow.
pub fn chatml(messages: &[ChatMessage], add_generation_prompt: bool) -> String {
    let mut out = String::new();
    for m in messages {
        out.push_str(&format!(
            "<|im_start|>{}\n{}<|im_end|>\n",
            m.role, m.content
        ));
    }
    if add_generation_prompt {
        out.push_str("<|im_start|>assistant\n");
    }
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::model::gguf::MetaValue;

    fn strings(v: &[&str]) -> MetaValue {
        MetaValue::Array(v.iter().map(|s| MetaValue::String(s.to_string())).collect())
    }

    /// A tiny SPM vocabulary with byte tokens, in the shape llama.cpp's converters write.
    pub(crate) fn spm_tokenizer() -> Tokenizer {
        let mut tokens = vec!["<unk>".to_string(), "<s>".into(), "</s>".into()];
        tokens.extend((0..=255u32).map(|b| format!("<0x{b:02X}>")));
        tokens.extend(["▁", "h", "i", "▁h", "▁hi", "中"].map(String::from));
        let mut types = vec![2, 3, 3];
        types.extend(std::iter::repeat_n(6, 256));
        types.extend([1; 6]);
        let scores: Vec<MetaValue> = (0..tokens.len())
            .map(|i| MetaValue::F32(-(i as f32)))
            .collect();
        let mut meta = GgufMetadata::default();
        let e = &mut meta.entries;
        e.insert(
            "tokenizer.ggml.model".into(),
            MetaValue::String("llama".into()),
        );
        e.insert(
            "tokenizer.ggml.tokens".into(),
            MetaValue::Array(tokens.into_iter().map(MetaValue::String).collect()),
        );
        e.insert("tokenizer.ggml.scores".into(), MetaValue::Array(scores));
        e.insert(
            "tokenizer.ggml.token_type".into(),
            MetaValue::Array(types.into_iter().map(MetaValue::I32).collect()),
        );
        Tokenizer::from_gguf(&meta).unwrap().unwrap()
    }

    #[test]
    fn no_template_falls_back_to_chatml() {
        let tok = spm_tokenizer();
        assert!(tok.chat_template().is_none());
        let m = |role: &str, content: &str| ChatMessage {
            role: role.into(),
            content: content.into(),
        };
        let (text, chatml) = tok
            .apply_chat_template_or_chatml(&[m("system", "Be brief."), m("user", "hi")], true)
            .unwrap();
        assert!(chatml);
        assert_eq!(
            text,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
        assert!(tok.apply_chat_template(&[], true).is_err());
    }

    #[test]
    fn spm_falls_back_to_byte_tokens() {
        let t = spm_tokenizer();
        // BOS, "▁hi" (263), then "é" (C3 A9) as byte tokens <0xC3> = 3 + 0xC3, <0xA9> = 3 + 0xA9.
        assert_eq!(
            t.encode("hié", true, false).unwrap(),
            [1, 263, 3 + 0xC3, 3 + 0xA9]
        );
        // llama.cpp strips the prefix space from the first token only, and BOS is that token here.
        assert_eq!(t.decode(&[1, 263, 3 + 0xC3, 3 + 0xA9]), " hié");
        assert_eq!(t.decode(&[263, 263]), "hi hi");
        assert_eq!(t.token_bytes(263, false), b" hi");
        assert_eq!(t.token_bytes(3 + 0xC3, false), [0xC3]);
    }

    #[test]
    fn spm_control_tokens_need_parse_special() {
        let t = spm_tokenizer();
        let plain = t.encode("</s>", false, false).unwrap();
        assert!(!plain.contains(&2), "{plain:?}");
        assert_eq!(t.encode("</s>", false, true).unwrap(), [2]);
        assert!(t.is_end_of_generation(2));
        assert_eq!(t.token_bytes(2, false), b"");
        assert_eq!(t.token_bytes(2, true), b"</s>");
    }

    #[test]
    fn text_stream_holds_partial_utf8() {
        let t = spm_tokenizer();
        let mut s = TextStream::new(&t);
        assert_eq!(s.push(263), " hi");
        assert_eq!(s.push(3 + 0xE4), "");
        assert_eq!(s.push(3 + 0xB8), "");
        assert_eq!(s.push(3 + 0xAD), "中");
        assert_eq!(s.push(3 + 0xE4), "");
        assert_eq!(s.finish(), "\u{FFFD}");
        // An invalid byte in the middle is replaced and the stream goes on.
        assert_eq!(s.push(3 + 0xFF), "\u{FFFD}");
        assert_eq!(s.push(263), " hi");
    }

    #[test]
    fn corrupt_vocabularies_are_errors() {
        let base = spm_tokenizer();
        assert_eq!(base.vocab_size(), 265);
        let mut meta = GgufMetadata::default();
        meta.entries.insert(
            "tokenizer.ggml.model".into(),
            MetaValue::String("llama".into()),
        );
        meta.entries
            .insert("tokenizer.ggml.tokens".into(), strings(&["a", "b"]));
        meta.entries.insert(
            "tokenizer.ggml.scores".into(),
            MetaValue::Array(vec![MetaValue::F32(0.0)]),
        );
        assert!(matches!(
            Tokenizer::from_gguf(&meta),
            Err(ModelError::Tokenizer { .. })
        ));
        meta.entries.remove("tokenizer.ggml.scores");
        meta.entries
            .insert("tokenizer.ggml.tokens".into(), strings(&["a", "a"]));
        assert!(Tokenizer::from_gguf(&meta).is_err());
        meta.entries.insert(
            "tokenizer.ggml.model".into(),
            MetaValue::String("none".into()),
        );
        assert!(Tokenizer::from_gguf(&meta).unwrap().is_none());
    }
}
