//! Contexts on disk: `<kv-dir>/contexts/<id>/index.json` (the conversation, the model identity,
//! a record per chunk) and one file per chunk named by its checksum. Every file is written
//! atomically; the index carries its own checksum. A chunk file that is missing or fails its
//! checksum is never used (the chunk is recomputed from its tokens).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64;

use super::chunk::Bits;
use crate::fsutil::{read_at_most, write_atomic};
use crate::model::ChatMessage;

const FORMAT: &str = "gpu-offload-context";
const VERSION: u32 = 1;

/// Where one encoded chunk lives on disk.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkRecord {
    pub len: usize,
    pub bits: Bits,
    pub bytes: u64,
    pub xxh3: String,
    pub file: String,
}

/// Everything needed to bring a context back.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ContextIndex {
    pub format: String,
    pub version: u32,
    pub model_id: String,
    pub id: String,
    /// Hash of the API key that owns the context (None: no key in use).
    pub owner: Option<String>,
    pub created: u64,
    pub system_prompt: Option<String>,
    /// The chat so far (chat calls), for the template.
    pub messages: Vec<ChatMessage>,
    /// The conversation's tokens.
    pub tokens: Vec<u32>,
    /// Leading tokens whose keys and values the chunks hold (the last sampled token of a call
    /// is in `tokens` but not yet evaluated).
    pub evaluated: usize,
    /// Chunk records of the evaluated tokens; None: not written yet (recompute).
    pub chunks: Vec<Option<ChunkRecord>>,
    /// Completed calls on the context (a shared store's version: one more per call).
    #[serde(default)]
    pub revision: u64,
    /// The lease of the call that wrote this revision (shared store; None before the first
    /// call): two replicas' revisions of one number are told apart by it.
    #[serde(default)]
    pub writer: Option<String>,
}

impl ContextIndex {
    pub fn new(model_id: &str, id: &str, owner: Option<String>, created: u64) -> Self {
        ContextIndex {
            format: FORMAT.into(),
            version: VERSION,
            model_id: model_id.into(),
            id: id.into(),
            owner,
            created,
            system_prompt: None,
            messages: Vec::new(),
            tokens: Vec::new(),
            evaluated: 0,
            chunks: Vec::new(),
            revision: 0,
            writer: None,
        }
    }

    /// What tells this revision from every other one: its number and its writer.
    pub fn stamp(&self) -> String {
        format!("{}:{}", self.revision, self.writer.as_deref().unwrap_or(""))
    }

    /// The chunk names (files, keys) the index refers to.
    pub fn chunk_files(&self) -> impl Iterator<Item = &str> {
        self.chunks.iter().flatten().map(|r| r.file.as_str())
    }
}

#[derive(Serialize, Deserialize)]
struct Sealed {
    xxh3: String,
    body: serde_json::Value,
}

#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("{path}: {msg}")]
    Corrupt { path: PathBuf, msg: String },
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> PersistError + '_ {
    move |source| PersistError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The directory of all contexts under `kv_dir`.
pub fn contexts_dir(kv_dir: &Path) -> PathBuf {
    kv_dir.join("contexts")
}

fn context_dir(kv_dir: &Path, id: &str) -> PathBuf {
    contexts_dir(kv_dir).join(id)
}

/// Create the directory and check it is writable, so a bad `--kv-dir` fails at start-up.
pub fn prepare(kv_dir: &Path) -> Result<(), PersistError> {
    let dir = contexts_dir(kv_dir);
    fs::create_dir_all(&dir).map_err(io_err(&dir))?;
    let probe = dir.join(".write-test");
    write_atomic(&probe, b"ok").map_err(io_err(&probe))?;
    fs::remove_file(&probe).map_err(io_err(&probe))?;
    Ok(())
}

/// The index as stored: its JSON with the JSON's checksum beside it.
pub fn seal(index: &ContextIndex) -> Vec<u8> {
    let body = serde_json::to_value(index).unwrap_or_default();
    let text = serde_json::to_vec(&body).unwrap_or_default();
    let sealed = Sealed {
        xxh3: format!("{:016x}", xxh3_64(&text)),
        body,
    };
    serde_json::to_vec(&sealed).unwrap_or_default()
}

/// An index from what [`seal`] wrote, its checksum and format checked; the error's message.
pub fn unseal(bytes: &[u8]) -> Result<ContextIndex, String> {
    let sealed: Sealed = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
    let text = serde_json::to_vec(&sealed.body).unwrap_or_default();
    if format!("{:016x}", xxh3_64(&text)) != sealed.xxh3 {
        return Err("checksum mismatch".into());
    }
    let index: ContextIndex = serde_json::from_value(sealed.body).map_err(|e| e.to_string())?;
    if index.format != FORMAT || index.version != VERSION {
        return Err(format!(
            "format {} v{} is not {FORMAT} v{VERSION}",
            index.format, index.version
        ));
    }
    Ok(index)
}

/// Write the index atomically (sealed with its checksum).
pub fn save_index(kv_dir: &Path, index: &ContextIndex) -> Result<(), PersistError> {
    let dir = context_dir(kv_dir, &index.id);
    fs::create_dir_all(&dir).map_err(io_err(&dir))?;
    let path = dir.join("index.json");
    write_atomic(&path, &seal(index)).map_err(io_err(&path))
}

fn load_index(path: &Path) -> Result<ContextIndex, PersistError> {
    let corrupt = |msg: String| PersistError::Corrupt {
        path: path.to_path_buf(),
        msg,
    };
    // Bounded: an index replaced by a link to /dev/zero is refused, not read until memory ends.
    let bytes = crate::limits::MAX_FILE_READ_BYTES
        .read_file(path)
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::FileTooLarge => corrupt(e.to_string()),
            _ => io_err(path)(e),
        })?;
    unseal(&bytes).map_err(corrupt)
}

/// Every context index under `kv_dir`; unreadable ones come back as errors (named).
pub fn load_all(kv_dir: &Path) -> Result<Vec<Result<ContextIndex, PersistError>>, PersistError> {
    let dir = contexts_dir(kv_dir);
    let mut out = Vec::new();
    let entries = match fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(io_err(&dir)(e)),
    };
    let mut paths: Vec<PathBuf> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .collect();
    paths.sort();
    for p in paths {
        let index = p.join("index.json");
        if index.exists() {
            out.push(load_index(&index));
        }
    }
    Ok(out)
}

/// The record of one encoded chunk: its name carries its index and checksum, so a rewrite
/// never replaces a chunk an older index still names.
pub fn chunk_record(chunk: usize, len: usize, bits: Bits, bytes: &[u8]) -> ChunkRecord {
    let sum = format!("{:016x}", xxh3_64(bytes));
    ChunkRecord {
        len,
        bits,
        bytes: bytes.len() as u64,
        file: format!("{chunk:06}-{sum}.kv"),
        xxh3: sum,
    }
}

/// Write one encoded chunk under its record's name.
pub fn write_chunk(
    kv_dir: &Path,
    id: &str,
    chunk: usize,
    len: usize,
    bits: Bits,
    bytes: &[u8],
) -> Result<ChunkRecord, PersistError> {
    let dir = context_dir(kv_dir, id);
    fs::create_dir_all(&dir).map_err(io_err(&dir))?;
    let rec = chunk_record(chunk, len, bits, bytes);
    let path = dir.join(&rec.file);
    write_atomic(&path, bytes).map_err(io_err(&path))?;
    Ok(rec)
}

/// Whether `bytes` are the chunk `rec` names (length and checksum); the mismatch otherwise.
pub fn check_chunk(rec: &ChunkRecord, bytes: &[u8]) -> Result<(), String> {
    if bytes.len() as u64 != rec.bytes {
        return Err(format!("{} bytes, expected {}", bytes.len(), rec.bytes));
    }
    if format!("{:016x}", xxh3_64(bytes)) != rec.xxh3 {
        return Err("checksum mismatch".into());
    }
    Ok(())
}

/// Read a chunk and check its length and checksum.
pub fn read_chunk(kv_dir: &Path, id: &str, rec: &ChunkRecord) -> Result<Vec<u8>, PersistError> {
    let path = context_dir(kv_dir, id).join(&rec.file);
    // The size the index records is checked before reading: a chunk replaced by a larger file
    // (or a link to a device) is refused without reading it.
    let meta = fs::metadata(&path).map_err(io_err(&path))?;
    if !meta.is_file() || meta.len() != rec.bytes {
        return Err(PersistError::Corrupt {
            path,
            msg: if meta.is_file() {
                format!("{} bytes, expected {}", meta.len(), rec.bytes)
            } else {
                "not a regular file".into()
            },
        });
    }
    let bytes = read_at_most(&path, rec.bytes).map_err(io_err(&path))?;
    check_chunk(rec, &bytes).map_err(|msg| PersistError::Corrupt { path, msg })?;
    Ok(bytes)
}

/// Remove chunk files the index no longer names (after the index was saved).
pub fn remove_unreferenced(kv_dir: &Path, index: &ContextIndex) {
    let dir = context_dir(kv_dir, &index.id);
    let keep: std::collections::HashSet<&str> = index.chunk_files().collect();
    if let Ok(entries) = fs::read_dir(&dir) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.ends_with(".kv") && !keep.contains(name.as_str()) {
                fs::remove_file(e.path()).ok();
            }
        }
    }
}

/// Delete a context and its chunks.
pub fn remove_context(kv_dir: &Path, id: &str) -> Result<(), PersistError> {
    let dir = context_dir(kv_dir, id);
    match fs::remove_dir_all(&dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_err(&dir)(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 39: an index or a chunk replaced by a link to /dev/zero was read until allocation
    /// failed (the process aborted); now each is a named error and the other contexts load.
    #[cfg(unix)]
    #[test]
    fn files_linked_to_dev_zero_are_refused_not_read_whole() {
        let dir = tempfile::tempdir().unwrap();
        prepare(dir.path()).unwrap();
        let mut idx = ContextIndex::new("m1", "ctx-a", None, 7);
        idx.tokens = vec![1, 2, 3];
        let rec = write_chunk(dir.path(), "ctx-a", 0, 3, Bits::F32, b"abcdefgh").unwrap();
        idx.chunks.push(Some(rec.clone()));
        save_index(dir.path(), &idx).unwrap();
        let chunk = context_dir(dir.path(), "ctx-a").join(&rec.file);
        fs::remove_file(&chunk).unwrap();
        std::os::unix::fs::symlink("/dev/zero", &chunk).unwrap();
        let e = read_chunk(dir.path(), "ctx-a", &rec).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
        fs::remove_file(&chunk).unwrap();
        fs::write(&chunk, vec![0u8; 1 << 20]).unwrap();
        let e = read_chunk(dir.path(), "ctx-a", &rec).unwrap_err();
        assert!(e.to_string().contains("expected 8"), "{e}");

        let ip = context_dir(dir.path(), "ctx-a").join("index.json");
        fs::remove_file(&ip).unwrap();
        std::os::unix::fs::symlink("/dev/zero", &ip).unwrap();
        let all = load_all(dir.path()).unwrap();
        let e = all[0].as_ref().unwrap_err();
        assert!(e.to_string().contains("max_file_read_bytes"), "{e}");
    }

    #[test]
    fn index_and_chunks_roundtrip_and_corruption_is_named() {
        let dir = tempfile::tempdir().unwrap();
        prepare(dir.path()).unwrap();
        let mut idx = ContextIndex::new("m1", "ctx-a", None, 7);
        idx.tokens = vec![1, 2, 3];
        let rec = write_chunk(dir.path(), "ctx-a", 0, 3, Bits::F32, b"abcdefgh").unwrap();
        idx.chunks.push(Some(rec.clone()));
        save_index(dir.path(), &idx).unwrap();
        let all = load_all(dir.path()).unwrap();
        assert_eq!(all.len(), 1);
        assert_eq!(all[0].as_ref().unwrap(), &idx);
        assert_eq!(read_chunk(dir.path(), "ctx-a", &rec).unwrap(), b"abcdefgh");

        // A flipped bit in a chunk is caught.
        let p = context_dir(dir.path(), "ctx-a").join(&rec.file);
        fs::write(&p, b"abcdefgX").unwrap();
        let e = read_chunk(dir.path(), "ctx-a", &rec).unwrap_err();
        assert!(e.to_string().contains("checksum"), "{e}");

        // A tampered index is refused.
        let ip = context_dir(dir.path(), "ctx-a").join("index.json");
        let text = fs::read_to_string(&ip)
            .unwrap()
            .replace("[1,2,3]", "[1,2,4]");
        fs::write(&ip, text).unwrap();
        let e = load_all(dir.path()).unwrap().remove(0).unwrap_err();
        assert!(e.to_string().contains("checksum"), "{e}");

        remove_context(dir.path(), "ctx-a").unwrap();
        assert!(load_all(dir.path()).unwrap().is_empty());
    }
}
