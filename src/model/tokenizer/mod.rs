//! Tokenizers: SentencePiece-style ("llama") and byte-level BPE ("gpt2") vocabularies from GGUF
//! metadata, and `tokenizer.json` from Hugging Face directories; chat templates.
//! Token ids must equal llama.cpp's for the same file.

use std::path::Path;

use super::ModelError;
use super::gguf::GgufMetadata;

/// One chat message for a chat template.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

#[derive(Debug, thiserror::Error)]
#[error("tokenizer: {0}")]
pub struct TokenizeError(pub String);

/// A tokenizer (placeholder until the real one lands).
#[derive(Clone, Debug)]
pub struct Tokenizer {
    _private: (),
}

impl Tokenizer {
    pub fn from_gguf(_meta: &GgufMetadata) -> Result<Option<Tokenizer>, ModelError> {
        Ok(None)
    }

    pub fn from_hf_dir(_dir: &Path) -> Result<Option<Tokenizer>, ModelError> {
        Ok(None)
    }
}
