//! The on-SSD offload store: one model converted to the layout the tiers read.
//!
//! A store is a directory with `manifest.json` (the model spec, every segment with offset,
//! length and xxh3-64 checksum, the model identity hash), `data.bin` (the segments, each starting
//! on a 4 KiB boundary so direct I/O can read it) and the tokenizer files.
//!
//! Matrices keep the model's own encoding, byte for byte (f32, f16, bf16 or a GGUF block
//! format): an offloaded run computes on the very numbers of the file and moves its bytes, no
//! more. Per layer:
//! - the FFN of a float model (f32/f16/bf16) is **bundled**: neuron i's gate row, up row and down
//!   column next to each other, one segment per encoding (f16 always; INT8 per row and INT4 per
//!   group of 32 on request) — what neuron-level sparsity reads;
//! - the FFN of a block-quantized model stays three matrices in their formats: a down-projection
//!   column crosses every row's blocks, so bundling it would mean re-quantizing (lossy) — the
//!   rows of gate, up and down are streamed as the file holds them;
//! - attention matrices whole, norms and biases whole (f32).
//!
//! A GGUF's matrices are by default not copied at all: their segments point at the model file
//! itself (`Segment::in_source`), checksummed at conversion, so a 40 GB model takes no second
//! 40 GB of disk (`convert --copy` copies them). A model file that changed size is refused at
//! open; changed bytes fail their checksums when read.
//!
//! Written atomically (a temporary directory renamed into place); every read from disk is
//! checked against its checksum, so a truncated or bit-flipped segment is named, never used.
//! Owns the format; knows nothing about devices.

mod check;
pub mod quant;
mod read;
mod write;

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::model::{ModelError, ModelSpec};
use crate::tensor::DType;

pub use read::Store;
pub use write::bundles as encode_bundles;
pub use write::{ConvertOptions, cached_store_for, convert};

/// Store format version this build reads and writes (2: matrices in the model's own encoding,
/// FFN matrices for block-quantized models; 3: the manifest checksummed whole, tokenizer files
/// checksummed). Older stores are refused with "convert the model again"; `run` converts its
/// cached store again by itself.
pub const FORMAT_VERSION: u32 = 3;
/// Segments start on this boundary (direct I/O).
pub const ALIGN: u64 = 4096;
/// Rows per checksum group: a read of any run of whole groups can be verified on its own
/// (streamed parts of a tensor start on a group boundary).
pub const GROUP_ROWS: usize = 64;
const FORMAT_NAME: &str = "gpu-offload-store";
const MANIFEST: &str = "manifest.json";
const DATA: &str = "data.bin";

#[derive(Debug, Error)]
pub enum StoreError {
    #[error("cannot access {}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: {msg}", path.display())]
    Format { path: PathBuf, msg: String },
    #[error("{}: segment `{segment}` is truncated: {msg}", path.display())]
    Truncated {
        path: PathBuf,
        segment: String,
        msg: String,
    },
    #[error("{}: segment `{segment}` fails its checksum (stored {expected}, read {actual}): the store is corrupt; convert the model again", path.display())]
    Checksum {
        path: PathBuf,
        segment: String,
        expected: String,
        actual: String,
    },
    #[error("{} already exists (pass --force to replace it)", path.display())]
    Exists { path: PathBuf },
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("{0}")]
    Unsupported(String),
}

impl StoreError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        StoreError::Io {
            path: path.into(),
            source,
        }
    }
}

/// How the values of a segment are encoded: a storage format a backend computes on directly
/// (the model's own), or one of the bundle-only codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Encoding {
    /// The values as a [`DType`] lays them out (f32, f16, bf16, GGUF blocks).
    Format(DType),
    /// Per row (per bundle part): an f32 scale, then `cols` i8 codes.
    Int8,
    /// Per group of 32: an f16 scale; then the codes, two per byte.
    Int4,
}

impl Encoding {
    pub const F32: Encoding = Encoding::Format(DType::F32);
    pub const F16: Encoding = Encoding::Format(DType::F16);

    pub fn name(self) -> &'static str {
        match self {
            Encoding::Format(d) => d.name(),
            Encoding::Int8 => "int8",
            Encoding::Int4 => "int4",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "int8" => Encoding::Int8,
            "int4" => Encoding::Int4,
            other => Encoding::Format(DType::parse(other)?),
        })
    }

    /// The storage format backends compute on, if this is one.
    pub fn dtype(self) -> Option<DType> {
        match self {
            Encoding::Format(d) => Some(d),
            Encoding::Int8 | Encoding::Int4 => None,
        }
    }

    /// Bytes of one row of `cols` values made of `parts` equal vectors (a bundle has 2 or 3
    /// parts; a matrix row 1).
    pub fn row_bytes(self, cols: usize, parts: usize) -> usize {
        match self {
            Encoding::Format(d) => d.bytes_for(cols),
            Encoding::Int8 => parts * 4 + cols,
            Encoding::Int4 => cols / quant::INT4_GROUP * 2 + cols / 2,
        }
    }
}

impl Serialize for Encoding {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for Encoding {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        Encoding::parse(&name)
            .ok_or_else(|| serde::de::Error::custom(format!("unknown encoding `{name}`")))
    }
}

/// What a segment holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SegmentKind {
    /// A matrix (or a vector as one row).
    Tensor,
    /// FFN neuron bundles: `rows` neurons, each `parts` vectors of `d_model` values
    /// (gate, up, down or up, down).
    Bundles { parts: usize },
}

/// One contiguous run of bytes in `data.bin`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Segment {
    /// Canonical name, e.g. `blk.3.attn_q.weight`, `blk.3.ffn_bundles.f16`, `output_norm.weight`.
    pub name: String,
    pub kind: SegmentKind,
    pub encoding: Encoding,
    pub rows: usize,
    pub cols: usize,
    pub offset: u64,
    pub bytes: u64,
    /// xxh3-64 of the bytes, 16 hex digits.
    pub xxh3: String,
    /// xxh3-64 of each run of [`GROUP_ROWS`] rows (the last may be shorter).
    pub group_xxh3: Vec<String>,
    /// The bytes are the model file's own, read in place at `offset` of the source file
    /// (`Manifest::source`) rather than from `data.bin`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub in_source: bool,
}

impl Segment {
    /// The bytes of rows `rows` as a file range.
    pub fn row_range(&self, rows: std::ops::Range<usize>) -> std::ops::Range<u64> {
        let rb = self.row_bytes() as u64;
        self.offset + rows.start as u64 * rb..self.offset + rows.end as u64 * rb
    }

    /// The page-aligned file extent a direct read of `rows` covers: (start, length).
    pub fn read_extent(&self, rows: std::ops::Range<usize>) -> (u64, u64) {
        let r = self.row_range(rows);
        let start = r.start / ALIGN * ALIGN;
        let end = r.end.div_ceil(ALIGN) * ALIGN;
        (start, end - start)
    }

    pub fn row_bytes(&self) -> usize {
        let parts = match self.kind {
            SegmentKind::Tensor => 1,
            SegmentKind::Bundles { parts } => parts,
        };
        self.encoding.row_bytes(self.cols, parts)
    }
}

/// Where the model came from, so a cached store can be matched to its source.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SourceInfo {
    pub path: String,
    pub bytes: u64,
    pub modified_unix_s: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    /// Identity of the converted weights: xxh3-64 over the spec and every segment checksum.
    pub model_id: String,
    pub spec: ModelSpec,
    pub source: SourceInfo,
    /// Encodings the FFN bundles are stored in (f16 always first); empty when the FFN is stored
    /// as its matrices (block-quantized models).
    pub bundle_encodings: Vec<Encoding>,
    pub data_bytes: u64,
    pub segments: Vec<Segment>,
    /// Tokenizer files in the store directory (`tokenizer.gguf` or HF files), if any.
    pub tokenizer: Option<TokenizerFiles>,
    /// Every file of the tokenizer (and the HF configs copied with it), checksummed.
    pub tokenizer_files: Vec<FileChecksum>,
    /// Checksums of the manifest itself: checked at every open, so an edited or damaged manifest
    /// is refused before any of it is used ([`Manifest::seal`]).
    pub checksums: ManifestChecksums,
}

/// A file of the store directory other than `data.bin`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FileChecksum {
    /// File name in the store directory.
    pub name: String,
    pub bytes: u64,
    /// xxh3-64 of the file, 16 hex digits.
    pub xxh3: String,
}

/// xxh3-64 (16 hex digits) of the canonical serialization (compact JSON, fields in declaration
/// order) of each part of the manifest, and of the whole manifest with `manifest` itself empty.
/// A part's own checksum names what differs when only it was edited; the whole one covers the
/// rest (format, version, model id, encodings, data size) and the parts' checksums.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ManifestChecksums {
    pub spec: String,
    pub source: String,
    pub segments: String,
    /// `tokenizer` and `tokenizer_files` together.
    pub tokenizer: String,
    pub manifest: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum TokenizerFiles {
    /// GGUF tokenizer metadata only (no tensors), in `tokenizer.gguf`.
    Gguf,
    /// Copied Hugging Face files (tokenizer.json, tokenizer_config.json, ...).
    HuggingFace,
}

impl Manifest {
    pub fn segment(&self, name: &str) -> Option<&Segment> {
        self.segments.iter().find(|s| s.name == name)
    }
}

/// Canonical segment names.
pub mod names {
    pub const TOKEN_EMBD: &str = "token_embd.weight";
    pub const POS_EMBD: &str = "pos_embd.weight";
    pub const OUTPUT: &str = "output.weight";
    pub const OUTPUT_NORM: &str = "output_norm.weight";
    pub const OUTPUT_NORM_BIAS: &str = "output_norm.bias";
    pub const ROPE_FREQS: &str = "rope_freqs.weight";

    /// `blk.{layer}.{what}`, e.g. `layer(3, "attn_q.weight")`.
    pub fn layer(layer: usize, what: &str) -> String {
        format!("blk.{layer}.{what}")
    }

    /// The FFN bundle segment of a layer in one encoding.
    pub fn bundles(layer: usize, encoding: super::Encoding) -> String {
        format!("blk.{layer}.ffn_bundles.{}", encoding.name())
    }

    /// Whether the FFN of a model whose FFN matrices are in `dtypes` is stored as neuron
    /// bundles (float formats) or as its matrices (block formats: see the module docs).
    pub fn ffn_bundled(dtypes: &[crate::tensor::DType]) -> bool {
        dtypes.iter().all(|d| !d.is_quantized())
    }
}
