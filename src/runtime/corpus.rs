//! The text a job reads (`profile`, `bench units`, `bench precision`, `bench contexts`):
//! `--corpus FILE`, else a default file in the models directory, and its tokens.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

/// The text of `given`, or of `default_file` in the models directory: an error naming the fix
/// where it is missing, unreadable, not UTF-8 or empty.
pub fn read_corpus(given: Option<&Path>, default_file: &str) -> Result<(PathBuf, String)> {
    let corpus = given.map_or_else(
        || crate::model::models_dir().join(default_file),
        Path::to_path_buf,
    );
    if !corpus.exists() {
        bail!(
            "corpus {} does not exist{}",
            corpus.display(),
            if given.is_none() {
                ": run scripts/fetch-models.sh (it fetches the default corpus) or pass --corpus FILE"
            } else {
                ""
            }
        );
    }
    let bytes =
        std::fs::read(&corpus).with_context(|| format!("cannot read {}", corpus.display()))?;
    let text = String::from_utf8(bytes)
        .map_err(|_| anyhow::anyhow!("corpus {} is not UTF-8 text", corpus.display()))?;
    if text.trim().is_empty() {
        bail!("corpus {} is empty", corpus.display());
    }
    Ok((corpus, text))
}

/// The first `want` tokens of a corpus: an error if it has fewer.
pub fn corpus_tokens(
    corpus: &Path,
    text: &str,
    tokenizer: &crate::model::tokenizer::Tokenizer,
    want: usize,
) -> Result<Vec<u32>> {
    let all = tokenizer.encode(text, false, false)?;
    if all.len() < want {
        bail!(
            "corpus {} has {} tokens; this needs {want}: give a longer corpus or ask for fewer tokens",
            corpus.display(),
            all.len()
        );
    }
    Ok(all)
}
