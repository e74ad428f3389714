//! The text a benchmark reads (`bench units`, `bench precision`, `bench contexts`). Finding and
//! reading a corpus is the CLI's `--corpus` handling (`cli/profile.rs`, shared with `profile`):
//! it is handed in as a [`CorpusReader`], so that `bench` imports nothing of `cli`.

use std::path::{Path, PathBuf};

use anyhow::Result;

use crate::model::tokenizer::Tokenizer;

/// Reads `--corpus FILE`, else the named default file in the models directory: its path and
/// text; an error naming the file when it is missing, unreadable, not UTF-8 or empty.
pub type ReadCorpus = fn(Option<&Path>, &str) -> Result<(PathBuf, String)>;

/// How a benchmark reads its corpus.
#[derive(Clone, Copy)]
pub struct CorpusReader {
    pub read: ReadCorpus,
    /// A corpus's text tokenized: an error naming the corpus when it has fewer than the tokens
    /// wanted.
    pub tokens: fn(&Path, &str, &Tokenizer, usize) -> Result<Vec<u32>>,
}
