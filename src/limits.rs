//! Every size and count a loader, the store or the server accepts, in one place (issue 39).
//!
//! Each limit is data: a name that errors quote, its value and what it bounds. Loaders and the
//! server check against these constants and name the limit when refusing
//! ([`Limit::refuse`]); `gpu-offload --help`'s reference and the README's "Limits" table list
//! [`ALL`]. The values are far above any real model (a 1T-parameter model has ~128 layers, a
//! 256K vocabulary, hidden 16K) and low enough that what they admit fits this machine's memory:
//! a file may not make us allocate more than its own size times a small factor.

/// One accepted bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limit {
    /// The name errors and the README quote (`max_layers`).
    pub name: &'static str,
    /// The largest accepted value.
    pub value: u64,
    /// What it bounds, for the README's table.
    pub what: &'static str,
}

impl Limit {
    /// Whether `n` is within the limit.
    pub fn admits(&self, n: u64) -> bool {
        n <= self.value
    }

    /// The sentence an error carries when `what` (a count or size of `n`) exceeds this limit.
    pub fn refuse(&self, what: &str, n: u64) -> String {
        format!("{what} {}", self.over(n))
    }

    /// [`Limit::refuse`] without its subject, for errors that name it first: "is N, over the
    /// limit `name` of V (what)".
    pub fn over(&self, n: u64) -> String {
        format!(
            "is {n}, over the limit `{}` of {} ({})",
            self.name, self.value, self.what
        )
    }
}

impl Limit {
    /// All of the file at `path`, refused with [`std::io::ErrorKind::FileTooLarge`] (the
    /// message naming this limit) when it holds more than `self.value` bytes. The size is
    /// checked before reading and the read stops one byte past the limit, so an endless file
    /// (`/dev/zero`, a FIFO) is refused, not read until memory runs out.
    pub fn read_file(&self, path: &std::path::Path) -> std::io::Result<Vec<u8>> {
        use std::io::Read;
        let file = std::fs::File::open(path)?;
        let too_large = |n: u64| {
            std::io::Error::new(
                std::io::ErrorKind::FileTooLarge,
                self.refuse("its length in bytes", n),
            )
        };
        let len = file.metadata()?.len();
        if !self.admits(len) {
            return Err(too_large(len));
        }
        let mut bytes = Vec::with_capacity(len as usize);
        file.take(self.value.saturating_add(1))
            .read_to_end(&mut bytes)?;
        if !self.admits(bytes.len() as u64) {
            return Err(too_large(bytes.len() as u64));
        }
        Ok(bytes)
    }
}

/// Transformer layers of a model (GGUF, HF config.json, store spec).
pub const MAX_LAYERS: Limit = Limit {
    name: "max_layers",
    value: 4096,
    what: "transformer layers in a model",
};

/// Any one dimension of a model: hidden size, FFN width, heads × head size, context length.
pub const MAX_DIM: Limit = Limit {
    name: "max_dim",
    value: 1 << 20,
    what: "a model dimension (hidden, FFN, heads x head size, positions)",
};

/// Attention heads (query or key/value) of a layer.
pub const MAX_HEADS: Limit = Limit {
    name: "max_heads",
    value: 4096,
    what: "attention heads of a layer",
};

/// Experts of a mixture-of-experts layer.
pub const MAX_EXPERTS: Limit = Limit {
    name: "max_experts",
    value: 4096,
    what: "experts of a mixture-of-experts layer",
};

/// Tokens of a vocabulary.
pub const MAX_VOCAB: Limit = Limit {
    name: "max_vocab",
    value: 1 << 22,
    what: "tokens in a vocabulary",
};

/// Tensors in one GGUF or safetensors file.
pub const MAX_TENSORS: Limit = Limit {
    name: "max_tensors",
    value: 1 << 16,
    what: "tensors in one model file",
};

/// Bytes GGUF metadata arrays kept by the loader may take in memory, all arrays together
/// (arrays the runtime does not read are skipped, not expanded).
pub const MAX_METADATA_ARRAY_BYTES: Limit = Limit {
    name: "max_metadata_array_bytes",
    value: 256 << 20,
    what: "bytes of GGUF metadata arrays held in memory",
};

/// Bytes of a file read whole into memory (config.json, tokenizer.json, a store manifest, a
/// context index, a prompt file).
pub const MAX_FILE_READ_BYTES: Limit = Limit {
    name: "max_file_read_bytes",
    value: 256 << 20,
    what: "bytes of a file read whole (configs, tokenizers, manifests, indexes, prompt files)",
};

/// Bytes of one HTTP request body.
pub const MAX_REQUEST_BODY_BYTES: Limit = Limit {
    name: "max_request_body_bytes",
    value: 2 << 20,
    what: "bytes of one HTTP request body",
};

/// Bytes of one prompt (text before tokenization), over HTTP and in prefill records.
pub const MAX_PROMPT_BYTES: Limit = Limit {
    name: "max_prompt_bytes",
    value: 2 << 20,
    what: "bytes of one prompt's text",
};

/// Stop strings of one request (OpenAI accepts up to 4).
pub const MAX_STOP_STRINGS: Limit = Limit {
    name: "max_stop_strings",
    value: 4,
    what: "stop strings of one request",
};

/// Bytes of one stop string.
pub const MAX_STOP_BYTES: Limit = Limit {
    name: "max_stop_bytes",
    value: 1024,
    what: "bytes of one stop string",
};

/// Keys of one request's `logit_bias` (OpenAI accepts up to 300).
pub const MAX_LOGIT_BIAS_KEYS: Limit = Limit {
    name: "max_logit_bias_keys",
    value: 300,
    what: "keys of one request's logit_bias",
};

/// Bytes of one line of a `prefill` JSONL input (a record: its prompt JSON-escaped, or its
/// token ids), read line by line so the file itself may be of any size.
pub const MAX_JSONL_LINE_BYTES: Limit = Limit {
    name: "max_jsonl_line_bytes",
    value: 16 << 20,
    what: "bytes of one line of a prefill JSONL input",
};

/// Every limit, in the order the README lists them.
pub const ALL: &[Limit] = &[
    MAX_LAYERS,
    MAX_DIM,
    MAX_HEADS,
    MAX_EXPERTS,
    MAX_VOCAB,
    MAX_TENSORS,
    MAX_METADATA_ARRAY_BYTES,
    MAX_FILE_READ_BYTES,
    MAX_REQUEST_BODY_BYTES,
    MAX_PROMPT_BYTES,
    MAX_STOP_STRINGS,
    MAX_STOP_BYTES,
    MAX_LOGIT_BIAS_KEYS,
    MAX_JSONL_LINE_BYTES,
];

/// The README's "Limits" table: one row a limit of [`ALL`], in order.
pub fn markdown_table() -> String {
    let mut t = String::from("| Limit | Value | What it bounds |\n|---|---|---|\n");
    for l in ALL {
        let value = if l.value >= 1 << 20 && l.value % (1 << 20) == 0 && l.name.ends_with("bytes") {
            format!("{} MiB", l.value >> 20)
        } else {
            l.value.to_string()
        };
        t.push_str(&format!("| `{}` | {value} | {} |\n", l.name, l.what));
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The README's table is [`markdown_table`]'s, so the two cannot drift.
    #[test]
    fn the_readme_lists_every_limit() {
        let readme = include_str!("../README.md");
        let table = markdown_table();
        assert!(
            readme.contains(&table),
            "README.md's \"Limits\" table differs from limits::ALL; it should read:\n{table}"
        );
    }

    #[test]
    fn an_endless_file_is_refused_not_read() {
        let small = Limit {
            name: "max_test_bytes",
            value: 1000,
            what: "a test",
        };
        let e = small
            .read_file(std::path::Path::new("/dev/zero"))
            .unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::FileTooLarge);
        assert!(e.to_string().contains("max_test_bytes"), "{e}");
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        std::fs::write(&p, vec![7u8; 1000]).unwrap();
        assert_eq!(small.read_file(&p).unwrap().len(), 1000);
        std::fs::write(&p, vec![7u8; 1001]).unwrap();
        assert!(small.read_file(&p).is_err());
    }

    #[test]
    fn names_are_unique_and_errors_quote_them() {
        let mut names: Vec<_> = ALL.iter().map(|l| l.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), ALL.len());
        let e = MAX_LAYERS.refuse("num_hidden_layers", 1_000_000_000);
        assert!(e.contains("max_layers") && e.contains("4096"), "{e}");
        assert!(MAX_LAYERS.admits(4096) && !MAX_LAYERS.admits(4097));
    }
}
