//! GGUF v2/v3 reader: header, metadata, tensor directory, and tensor bytes straight from a memory
//! map. Every length and offset read from the file is bounds-checked, so a truncated or corrupt file
//! is an error naming what is wrong, never a panic or a runaway allocation.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use super::ModelError;
use super::ggml::GgmlType;
use crate::limits::{MAX_METADATA_ARRAY_BYTES, MAX_TENSORS};
use crate::tensor::{Bytes, DType, HostTensor};

const GGUF_MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;

/// The metadata arrays the runtime reads (the tokenizer's), expanded into [`MetaValue`]s; every
/// other array is kept as its bytes in the map ([`MetaValue::Raw`]): expanded, an array takes
/// 32 bytes of memory per element whatever its size on disk.
pub const EXPANDED_ARRAYS: &[&str] = &[
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
];

/// A metadata array the runtime does not read: its element type, length and encoded elements,
/// borrowed from the file's map, so writers can copy it through unchanged.
#[derive(Clone, Debug)]
pub struct RawArray {
    /// GGUF value type id of the elements.
    pub elem: u32,
    pub len: u64,
    /// The elements as the file encodes them.
    pub bytes: Bytes,
}

impl PartialEq for RawArray {
    fn eq(&self, other: &Self) -> bool {
        self.elem == other.elem
            && self.len == other.len
            && self.bytes.as_slice() == other.bytes.as_slice()
    }
}

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<MetaValue>),
    /// An array not in [`EXPANDED_ARRAYS`], unexpanded.
    Raw(RawArray),
}

impl MetaValue {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v as u64),
            MetaValue::U16(v) => Some(v as u64),
            MetaValue::U32(v) => Some(v as u64),
            MetaValue::U64(v) => Some(v),
            MetaValue::I8(v) => u64::try_from(v).ok(),
            MetaValue::I16(v) => u64::try_from(v).ok(),
            MetaValue::I32(v) => u64::try_from(v).ok(),
            MetaValue::I64(v) => u64::try_from(v).ok(),
            MetaValue::Bool(v) => Some(v as u64),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            MetaValue::I8(v) => Some(v as i64),
            MetaValue::I16(v) => Some(v as i64),
            MetaValue::I32(v) => Some(v as i64),
            MetaValue::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v as f64),
            MetaValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(v) => Some(v),
            _ => self.as_u64().map(|v| v != 0),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// The metadata of a GGUF file with typed lookups that name the key when it is missing or of the
/// wrong type.
#[derive(Clone, Debug, Default)]
pub struct GgufMetadata {
    pub path: PathBuf,
    pub entries: BTreeMap<String, MetaValue>,
}

impl GgufMetadata {
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.entries.get(key)
    }

    fn bad(&self, key: &str, want: &str) -> ModelError {
        ModelError::Format {
            path: self.path.clone(),
            msg: format!("metadata key `{key}` is missing or not {want}"),
        }
    }

    pub fn str(&self, key: &str) -> Result<&str, ModelError> {
        self.get(key)
            .and_then(MetaValue::as_str)
            .ok_or_else(|| self.bad(key, "a string"))
    }

    pub fn u64(&self, key: &str) -> Result<u64, ModelError> {
        self.get(key)
            .and_then(MetaValue::as_u64)
            .ok_or_else(|| self.bad(key, "an unsigned integer"))
    }

    pub fn usize(&self, key: &str) -> Result<usize, ModelError> {
        let v = self.u64(key)?;
        usize::try_from(v).map_err(|_| self.bad(key, "a size"))
    }

    pub fn f32(&self, key: &str) -> Result<f32, ModelError> {
        self.get(key)
            .and_then(MetaValue::as_f64)
            .map(|v| v as f32)
            .ok_or_else(|| self.bad(key, "a number"))
    }

    pub fn bool(&self, key: &str) -> Result<bool, ModelError> {
        self.get(key)
            .and_then(MetaValue::as_bool)
            .ok_or_else(|| self.bad(key, "a bool"))
    }

    pub fn opt_usize(&self, key: &str) -> Result<Option<usize>, ModelError> {
        if self.get(key).is_none() {
            return Ok(None);
        }
        self.usize(key).map(Some)
    }

    pub fn opt_f32(&self, key: &str) -> Result<Option<f32>, ModelError> {
        if self.get(key).is_none() {
            return Ok(None);
        }
        self.f32(key).map(Some)
    }

    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>, ModelError> {
        if self.get(key).is_none() {
            return Ok(None);
        }
        self.bool(key).map(Some)
    }

    pub fn opt_str(&self, key: &str) -> Result<Option<&str>, ModelError> {
        if self.get(key).is_none() {
            return Ok(None);
        }
        self.str(key).map(Some)
    }

    pub fn array(&self, key: &str) -> Result<&[MetaValue], ModelError> {
        self.get(key)
            .and_then(MetaValue::as_array)
            .ok_or_else(|| self.bad(key, "an array"))
    }

    /// An array of strings (e.g. the vocabulary).
    pub fn str_array(&self, key: &str) -> Result<Vec<&str>, ModelError> {
        self.array(key)?
            .iter()
            .map(|v| {
                v.as_str()
                    .ok_or_else(|| self.bad(key, "an array of strings"))
            })
            .collect()
    }

    pub fn f32_array(&self, key: &str) -> Result<Vec<f32>, ModelError> {
        self.array(key)?
            .iter()
            .map(|v| {
                v.as_f64()
                    .map(|x| x as f32)
                    .ok_or_else(|| self.bad(key, "an array of numbers"))
            })
            .collect()
    }

    pub fn i64_array(&self, key: &str) -> Result<Vec<i64>, ModelError> {
        self.array(key)?
            .iter()
            .map(|v| {
                v.as_i64()
                    .ok_or_else(|| self.bad(key, "an array of integers"))
            })
            .collect()
    }
}

/// Where one tensor's bytes are, as the directory says.
#[derive(Clone, Debug)]
pub struct GgufTensorInfo {
    pub name: String,
    /// GGML order: `dims[0]` is the contiguous (column) dimension.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Absolute offset in the file.
    pub offset: usize,
    pub n_bytes: usize,
}

impl GgufTensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// An opened GGUF file.
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: GgufMetadata,
    pub tensors: BTreeMap<String, GgufTensorInfo>,
    map: Arc<Mmap>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

struct Cursor<'a> {
    data: &'a [u8],
    map: &'a Arc<Mmap>,
    pos: usize,
    path: &'a Path,
    /// Bytes of memory the expanded arrays take so far (held to
    /// [`MAX_METADATA_ARRAY_BYTES`]).
    kept: u64,
}

impl<'a> Cursor<'a> {
    fn truncated(&self, what: &str) -> ModelError {
        ModelError::Truncated {
            path: self.path.to_path_buf(),
            msg: format!("file ends while reading {what} at byte {}", self.pos),
        }
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], ModelError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.data.len())
            .ok_or_else(|| self.truncated(what))?;
        let s = &self.data[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], ModelError> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32, ModelError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, ModelError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn remaining(&self) -> usize {
        self.data.len() - self.pos
    }

    /// A length read from the file that must fit in what is left of it, given at least
    /// `min_item` bytes per item.
    fn len(&mut self, what: &str, min_item: usize) -> Result<usize, ModelError> {
        let n = self.u64(what)?;
        let fits = usize::try_from(n)
            .ok()
            .and_then(|n| n.checked_mul(min_item.max(1)))
            .is_some_and(|bytes| bytes <= self.remaining());
        if !fits {
            let left = self.remaining();
            return Err(self.truncated(&format!(
                "{what} (length {n} does not fit in the {left} bytes left)"
            )));
        }
        Ok(n as usize)
    }

    fn string(&mut self, what: &str) -> Result<String, ModelError> {
        let n = self.len(what, 1)?;
        let bytes = self.take(n, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| ModelError::Format {
            path: self.path.to_path_buf(),
            msg: format!("{what} is not valid UTF-8"),
        })
    }

    /// An array's element type and length (which must fit in the rest of the file).
    fn array_header(&mut self, key: &str, depth: u32) -> Result<(u32, usize), ModelError> {
        if depth > 2 {
            return Err(ModelError::Format {
                path: self.path.to_path_buf(),
                msg: format!("metadata `{key}` nests arrays too deeply"),
            });
        }
        let what = format!("value of `{key}`");
        let elem = self.u32(&what)?;
        let n = self.len(&what, elem_min_bytes(elem))?;
        Ok((elem, n))
    }

    /// Count `bytes` more of expanded arrays against [`MAX_METADATA_ARRAY_BYTES`].
    fn keep(&mut self, key: &str, bytes: u64) -> Result<(), ModelError> {
        self.kept = self.kept.saturating_add(bytes);
        if !MAX_METADATA_ARRAY_BYTES.admits(self.kept) {
            return Err(ModelError::Format {
                path: self.path.to_path_buf(),
                msg: MAX_METADATA_ARRAY_BYTES.refuse(
                    &format!("the memory metadata arrays take with `{key}`"),
                    self.kept,
                ),
            });
        }
        Ok(())
    }

    /// Step over `n` values of type `ty` without building them.
    fn skip(&mut self, ty: u32, n: usize, key: &str, depth: u32) -> Result<(), ModelError> {
        if let Some(size) = fixed_size(ty) {
            // One step: the length was checked to fit in the file at its smallest.
            let bytes = n
                .checked_mul(size)
                .ok_or_else(|| self.truncated(&format!("value of `{key}`")))?;
            self.take(bytes, &format!("value of `{key}`"))?;
            return Ok(());
        }
        let what = format!("value of `{key}`");
        for _ in 0..n {
            match ty {
                8 => {
                    let len = self.len(&what, 1)?;
                    self.take(len, &what)?;
                }
                9 => {
                    let (elem, items) = self.array_header(key, depth)?;
                    self.skip(elem, items, key, depth + 1)?;
                }
                _ => {
                    return Err(ModelError::Format {
                        path: self.path.to_path_buf(),
                        msg: format!("metadata `{key}` has unknown value type {ty}"),
                    });
                }
            }
        }
        Ok(())
    }

    fn value(&mut self, ty: u32, key: &str, depth: u32) -> Result<MetaValue, ModelError> {
        let what = format!("value of `{key}`");
        Ok(match ty {
            0 => MetaValue::U8(self.array::<1>(&what)?[0]),
            1 => MetaValue::I8(self.array::<1>(&what)?[0] as i8),
            2 => MetaValue::U16(u16::from_le_bytes(self.array(&what)?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.array(&what)?)),
            4 => MetaValue::U32(u32::from_le_bytes(self.array(&what)?)),
            5 => MetaValue::I32(i32::from_le_bytes(self.array(&what)?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.array(&what)?)),
            7 => MetaValue::Bool(self.array::<1>(&what)?[0] != 0),
            8 => {
                let text = self.string(&what)?;
                if depth > 0 {
                    self.keep(key, text.len() as u64)?;
                }
                MetaValue::String(text)
            }
            9 => {
                let (elem, n) = self.array_header(key, depth)?;
                if depth == 0 && !EXPANDED_ARRAYS.contains(&key) {
                    let start = self.pos;
                    self.skip(elem, n, key, depth + 1)?;
                    return Ok(MetaValue::Raw(RawArray {
                        elem,
                        len: n as u64,
                        // Mapped even when unaligned: only read as bytes, never typed.
                        bytes: Bytes::Mapped {
                            map: self.map.clone(),
                            range: start..self.pos,
                        },
                    }));
                }
                self.keep(
                    key,
                    (n as u64).saturating_mul(size_of::<MetaValue>() as u64),
                )?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(elem, key, depth + 1)?);
                }
                MetaValue::Array(items)
            }
            10 => MetaValue::U64(u64::from_le_bytes(self.array(&what)?)),
            11 => MetaValue::I64(i64::from_le_bytes(self.array(&what)?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.array(&what)?)),
            other => {
                return Err(ModelError::Format {
                    path: self.path.to_path_buf(),
                    msg: format!("metadata `{key}` has unknown value type {other}"),
                });
            }
        })
    }
}

/// Bytes of one value of fixed-size type `ty` (`None` for strings, arrays and unknown types).
fn fixed_size(ty: u32) -> Option<usize> {
    match ty {
        0 | 1 | 7 => Some(1),
        2 | 3 => Some(2),
        4..=6 => Some(4),
        10..=12 => Some(8),
        _ => None,
    }
}

/// The fewest bytes one array element of type `elem` takes in the file.
fn elem_min_bytes(elem: u32) -> usize {
    match elem {
        8 => 8,
        9 => 12,
        other => fixed_size(other).unwrap_or(1),
    }
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        let file = File::open(path).map_err(|e| ModelError::io(path, e))?;
        // SAFETY: the map is read-only and lives as long as the Arc; a file changed underneath us
        // by another process is outside what any reader can guard against.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io(path, e))?;
        Self::parse(path, Arc::new(map))
    }

    fn parse(path: &Path, map: Arc<Mmap>) -> Result<Self, ModelError> {
        let mut c = Cursor {
            data: &map,
            map: &map,
            pos: 0,
            path,
            kept: 0,
        };
        let magic = c.array::<4>("magic")?;
        if &magic != GGUF_MAGIC {
            return Err(ModelError::Format {
                path: path.to_path_buf(),
                msg: "not a GGUF file (bad magic)".into(),
            });
        }
        let version = c.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(ModelError::Format {
                path: path.to_path_buf(),
                msg: format!("GGUF version {version} is not supported (2 and 3 are)"),
            });
        }
        // A tensor info is at least 8 (name len) + 4 (n_dims) + 4 (type) + 8 (offset) bytes,
        // a key-value pair at least 8 + 4.
        let n_tensors = c.len("tensor count", 24)?;
        if !MAX_TENSORS.admits(n_tensors as u64) {
            return Err(ModelError::Format {
                path: path.to_path_buf(),
                msg: MAX_TENSORS.refuse("the tensor count", n_tensors as u64),
            });
        }
        let n_kv = c.len("metadata count", 12)?;

        let mut entries = BTreeMap::new();
        for _ in 0..n_kv {
            let key = c.string("metadata key")?;
            let ty = c.u32("metadata type")?;
            let value = c.value(ty, &key, 0)?;
            entries.insert(key, value);
        }
        let metadata = GgufMetadata {
            path: path.to_path_buf(),
            entries,
        };
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => v
                .as_u64()
                .filter(|a| *a > 0 && a.is_power_of_two())
                .ok_or_else(|| ModelError::Format {
                    path: path.to_path_buf(),
                    msg: "general.alignment must be a power of two".into(),
                })?,
        };

        let mut raw = Vec::with_capacity(n_tensors);
        for _ in 0..n_tensors {
            let name = c.string("tensor name")?;
            let n_dims = c.u32("tensor dims")?;
            if n_dims == 0 || n_dims > 4 {
                return Err(ModelError::Format {
                    path: path.to_path_buf(),
                    msg: format!("tensor `{name}` has {n_dims} dimensions"),
                });
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(c.u64("tensor dim")?);
            }
            let ty = c.u32("tensor type")?;
            let offset = c.u64("tensor offset")?;
            raw.push((name, dims, ty, offset));
        }
        let data_start = (c.pos as u64).div_ceil(alignment) * alignment;

        let mut tensors = BTreeMap::new();
        for (name, dims, ty, offset) in raw {
            let ggml_type = GgmlType::from_id(ty).ok_or_else(|| ModelError::Unsupported {
                path: path.to_path_buf(),
                msg: format!("tensor `{name}` uses unknown GGML type id {ty}"),
            })?;
            let n_elems = dims
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .ok_or_else(|| ModelError::Format {
                    path: path.to_path_buf(),
                    msg: format!("tensor `{name}` has an impossible shape {dims:?}"),
                })?;
            let (block_len, block_bytes) = ggml_type.block();
            if dims[0] % block_len as u64 != 0 {
                return Err(ModelError::Format {
                    path: path.to_path_buf(),
                    msg: format!(
                        "tensor `{name}`: row length {} is not a multiple of the {} block ({block_len})",
                        dims[0],
                        ggml_type.name()
                    ),
                });
            }
            if offset % alignment != 0 {
                return Err(ModelError::Format {
                    path: path.to_path_buf(),
                    msg: format!(
                        "tensor `{name}` starts at offset {offset}, not a multiple of the file's alignment {alignment}"
                    ),
                });
            }
            let n_bytes = (n_elems / block_len as u64).checked_mul(block_bytes as u64);
            let start = data_start.checked_add(offset);
            let end = match (start, n_bytes) {
                (Some(s), Some(n)) => s.checked_add(n),
                _ => None,
            };
            let (start, end) = match (start, end) {
                (Some(s), Some(e)) if e <= map.len() as u64 => (s as usize, e as usize),
                _ => {
                    return Err(ModelError::Truncated {
                        path: path.to_path_buf(),
                        msg: format!(
                            "tensor `{name}` lies beyond the end of the file ({} bytes)",
                            map.len()
                        ),
                    });
                }
            };
            let info = GgufTensorInfo {
                name: name.clone(),
                dims,
                ggml_type,
                offset: start,
                n_bytes: end - start,
            };
            if tensors.insert(name.clone(), info).is_some() {
                return Err(ModelError::Format {
                    path: path.to_path_buf(),
                    msg: format!("tensor `{name}` appears twice"),
                });
            }
        }

        Ok(GgufFile {
            path: path.to_path_buf(),
            version,
            metadata,
            tensors,
            map,
        })
    }

    pub fn tensor_info(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.tensors.get(name)
    }

    /// The raw bytes of a tensor.
    pub fn tensor_bytes(&self, info: &GgufTensorInfo) -> &[u8] {
        &self.map[info.offset..info.offset + info.n_bytes]
    }

    /// Load a tensor as a `rows × cols` host tensor, its bytes borrowed from the map in the file's
    /// own format ([`GgmlType::host_dtype`]); a type no backend computes is refused.
    pub fn load(&self, name: &str) -> Result<HostTensor, ModelError> {
        self.load_as(name, 1)
    }

    /// A 3-D tensor of `experts` matrices (llama.cpp's `ffn_*_exps`: GGML dims `[cols, rows,
    /// experts]`, expert-major) as one matrix of `experts × rows` rows.
    pub fn load_experts(&self, name: &str, experts: usize) -> Result<HostTensor, ModelError> {
        self.load_as(name, experts)
    }

    /// The tensor `name` whose third GGML dimension is `stacked` (1: a matrix or vector), its
    /// matrices one under the other.
    fn load_as(&self, name: &str, stacked: usize) -> Result<HostTensor, ModelError> {
        let info = self
            .tensors
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor {
                path: self.path.clone(),
                name: name.to_string(),
            })?;
        let cols = info.dims[0] as usize;
        let third = info.dims.get(2).copied().unwrap_or(1);
        if third != stacked as u64 || info.dims.iter().skip(3).any(|&d| d != 1) {
            let expected = match stacked {
                1 => "a matrix".to_string(),
                n => format!("{n} expert matrices (the expert count)"),
            };
            return Err(ModelError::Format {
                path: self.path.clone(),
                msg: format!(
                    "tensor `{name}` has shape {:?}; expected {expected}",
                    info.dims
                ),
            });
        }
        // The tensor infos' sizes were checked against the file as it was read: these products
        // are its bytes' counts.
        let rows = info.dims.get(1).copied().unwrap_or(1) as usize * stacked;
        let dtype = info
            .ggml_type
            .host_dtype()
            .ok_or_else(|| ModelError::Unsupported {
                path: self.path.clone(),
                msg: format!(
                    "tensor `{name}` uses GGML type {}, which is not supported: no backend \
                     computes it (supported: {})",
                    info.ggml_type.name(),
                    DType::ALL
                        .map(|d| GgmlType::of_dtype(d).0.name())
                        .join(", ")
                ),
            })?;
        if !cols.is_multiple_of(dtype.block_len()) {
            return Err(ModelError::Format {
                path: self.path.clone(),
                msg: format!(
                    "tensor `{name}`: rows of {cols} values are not whole {} blocks of {}",
                    info.ggml_type.name(),
                    dtype.block_len()
                ),
            });
        }
        let data = Bytes::mapped(self.map.clone(), info.offset..info.offset + info.n_bytes);
        Ok(HostTensor {
            name: name.to_string(),
            rows,
            cols,
            dtype,
            data,
        })
    }
}

/// A tensor to write: GGML dims (columns first), GGML type id, raw bytes.
#[derive(Clone, Debug)]
pub struct RawTensor {
    pub name: String,
    pub dims: Vec<u64>,
    pub ggml_type: u32,
    pub bytes: Vec<u8>,
}

impl RawTensor {
    pub fn spec(&self) -> TensorSpec {
        TensorSpec {
            name: self.name.clone(),
            dims: self.dims.clone(),
            ggml_type: self.ggml_type,
            bytes: self.bytes.len() as u64,
        }
    }

    pub fn f32(name: &str, dims: &[u64], values: &[f32]) -> Self {
        RawTensor {
            name: name.into(),
            dims: dims.to_vec(),
            ggml_type: 0,
            bytes: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    }
}

fn put_str(b: &mut Vec<u8>, v: &str) {
    b.extend((v.len() as u64).to_le_bytes());
    b.extend(v.as_bytes());
}

fn value_type(v: &MetaValue) -> u32 {
    match v {
        MetaValue::U8(_) => 0,
        MetaValue::I8(_) => 1,
        MetaValue::U16(_) => 2,
        MetaValue::I16(_) => 3,
        MetaValue::U32(_) => 4,
        MetaValue::I32(_) => 5,
        MetaValue::F32(_) => 6,
        MetaValue::Bool(_) => 7,
        MetaValue::String(_) => 8,
        MetaValue::Array(_) | MetaValue::Raw(_) => 9,
        MetaValue::U64(_) => 10,
        MetaValue::I64(_) => 11,
        MetaValue::F64(_) => 12,
    }
}

fn put_value(b: &mut Vec<u8>, v: &MetaValue) {
    match v {
        MetaValue::U8(x) => b.push(*x),
        MetaValue::I8(x) => b.push(*x as u8),
        MetaValue::U16(x) => b.extend(x.to_le_bytes()),
        MetaValue::I16(x) => b.extend(x.to_le_bytes()),
        MetaValue::U32(x) => b.extend(x.to_le_bytes()),
        MetaValue::I32(x) => b.extend(x.to_le_bytes()),
        MetaValue::U64(x) => b.extend(x.to_le_bytes()),
        MetaValue::I64(x) => b.extend(x.to_le_bytes()),
        MetaValue::F32(x) => b.extend(x.to_le_bytes()),
        MetaValue::F64(x) => b.extend(x.to_le_bytes()),
        MetaValue::Bool(x) => b.push(*x as u8),
        MetaValue::String(x) => put_str(b, x),
        MetaValue::Array(items) => {
            // An empty array is written as u8 elements.
            b.extend(items.first().map_or(0, value_type).to_le_bytes());
            b.extend((items.len() as u64).to_le_bytes());
            for i in items {
                put_value(b, i);
            }
        }
        MetaValue::Raw(raw) => {
            b.extend(raw.elem.to_le_bytes());
            b.extend(raw.len.to_le_bytes());
            b.extend(raw.bytes.as_slice());
        }
    }
}

/// What the header says of one tensor: name, GGML dims (columns first), GGML type id, and how
/// many bytes its data takes.
#[derive(Clone, Debug)]
pub struct TensorSpec {
    pub name: String,
    pub dims: Vec<u64>,
    pub ggml_type: u32,
    pub bytes: u64,
}

/// The header of a GGUF v3 file (alignment 32): magic, counts, metadata, tensor infos with their
/// offsets, padded to where the first tensor's data starts. Arrays must hold one element type.
fn header(metadata: &[(&str, MetaValue)], tensors: &[TensorSpec]) -> Vec<u8> {
    let align = DEFAULT_ALIGNMENT;
    let mut b = Vec::new();
    b.extend(GGUF_MAGIC);
    b.extend(3u32.to_le_bytes());
    b.extend((tensors.len() as u64).to_le_bytes());
    b.extend((metadata.len() as u64).to_le_bytes());
    for (k, v) in metadata {
        put_str(&mut b, k);
        b.extend(value_type(v).to_le_bytes());
        put_value(&mut b, v);
    }
    let mut offset = 0u64;
    for t in tensors {
        put_str(&mut b, &t.name);
        b.extend((t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            b.extend(d.to_le_bytes());
        }
        b.extend(t.ggml_type.to_le_bytes());
        b.extend(offset.to_le_bytes());
        offset += t.bytes.next_multiple_of(align);
    }
    b.resize((b.len() as u64).next_multiple_of(align) as usize, 0);
    b
}

/// A GGUF v3 file (alignment 32) holding `metadata` and `tensors`, as bytes. For tools and tests
/// that craft models; arrays must hold one element type.
pub fn encode(metadata: &[(&str, MetaValue)], tensors: &[RawTensor]) -> Vec<u8> {
    let specs: Vec<TensorSpec> = tensors.iter().map(RawTensor::spec).collect();
    let mut b = header(metadata, &specs);
    for t in tensors {
        b.extend(&t.bytes);
        b.resize(
            (b.len() as u64).next_multiple_of(DEFAULT_ALIGNMENT) as usize,
            0,
        );
    }
    b
}

/// Write [`encode`]'s bytes to `path` atomically.
pub fn write(
    path: &Path,
    metadata: &[(&str, MetaValue)],
    tensors: &[RawTensor],
) -> std::io::Result<()> {
    crate::fsutil::write_atomic(path, &encode(metadata, tensors))
}

/// Write a GGUF file too large to hold in memory, atomically: the header from `tensors`, then
/// each tensor's data as `data(i)` produces it, in order (each exactly `tensors[i].bytes`).
pub fn write_streamed(
    path: &Path,
    metadata: &[(&str, MetaValue)],
    tensors: &[TensorSpec],
    data: &mut dyn FnMut(usize) -> std::io::Result<Vec<u8>>,
) -> std::io::Result<()> {
    use std::io::Write;
    crate::fsutil::write_atomic_with(path, |f| {
        let mut w = std::io::BufWriter::with_capacity(8 << 20, f);
        w.write_all(&header(metadata, tensors))?;
        for (i, t) in tensors.iter().enumerate() {
            let bytes = data(i)?;
            if bytes.len() as u64 != t.bytes {
                return Err(std::io::Error::other(format!(
                    "tensor `{}`: {} bytes produced, the header says {}",
                    t.name,
                    bytes.len(),
                    t.bytes
                )));
            }
            w.write_all(&bytes)?;
            let pad = t.bytes.next_multiple_of(DEFAULT_ALIGNMENT) - t.bytes;
            w.write_all(&vec![0u8; pad as usize])?;
        }
        w.flush()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_gguf(path: &Path, kv: &[(&str, MetaValue)], tensors: &[(&str, Vec<u64>, Vec<f32>)]) {
        let raw: Vec<RawTensor> = tensors
            .iter()
            .map(|(n, d, v)| RawTensor::f32(n, d, v))
            .collect();
        write(path, kv, &raw).unwrap();
    }

    #[test]
    fn reads_metadata_and_tensors() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.gguf");
        write_gguf(
            &p,
            &[
                ("general.architecture", MetaValue::String("llama".into())),
                ("llama.block_count", MetaValue::U32(2)),
            ],
            &[("w", vec![3, 2], vec![1., 2., 3., 4., 5., 6.])],
        );
        let f = GgufFile::open(&p).unwrap();
        assert_eq!(f.metadata.str("general.architecture").unwrap(), "llama");
        assert_eq!(f.metadata.usize("llama.block_count").unwrap(), 2);
        let t = f.load("w").unwrap();
        assert_eq!((t.rows, t.cols), (2, 3));
        assert_eq!(t.to_f32(), vec![1., 2., 3., 4., 5., 6.]);
        assert!(t.data.is_mapped());
        assert!(matches!(
            f.load("nope"),
            Err(ModelError::MissingTensor { .. })
        ));
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.gguf");
        write_gguf(
            &p,
            &[("general.architecture", MetaValue::String("llama".into()))],
            &[("w", vec![8, 2], vec![0.5; 16])],
        );
        let full = std::fs::read(&p).unwrap();
        for len in 0..full.len() - 1 {
            let q = dir.path().join("cut.gguf");
            std::fs::write(&q, &full[..len]).unwrap();
            assert!(GgufFile::open(&q).is_err(), "length {len} accepted");
        }
    }

    /// A GGUF header (v3, no tensors) with `kv` pairs already encoded.
    fn raw_header(n_tensors: u64, n_kv: u64) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend(b"GGUF");
        b.extend(3u32.to_le_bytes());
        b.extend(n_tensors.to_le_bytes());
        b.extend(n_kv.to_le_bytes());
        b
    }

    fn put_u8_array(b: &mut Vec<u8>, key: &str, len: u64) {
        put_str(b, key);
        b.extend(9u32.to_le_bytes());
        b.extend(0u32.to_le_bytes());
        b.extend(len.to_le_bytes());
        b.resize(b.len() + len as usize, 1);
    }

    #[test]
    fn arrays_the_runtime_does_not_read_stay_raw_and_copy_through() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.gguf");
        let strings = MetaValue::Array(vec![
            MetaValue::String("ab".into()),
            MetaValue::String("c".into()),
        ]);
        let nested = MetaValue::Array(vec![MetaValue::Array(vec![MetaValue::I32(-3)])]);
        let tokens = MetaValue::Array(vec![MetaValue::String("x".into())]);
        write_gguf(
            &p,
            &[
                ("a.strings", strings.clone()),
                ("a.nested", nested),
                ("a.floats", MetaValue::Array(vec![MetaValue::F32(0.5); 3])),
                ("tokenizer.ggml.tokens", tokens.clone()),
            ],
            &[("w", vec![2], vec![1., 2.])],
        );
        let f = GgufFile::open(&p).unwrap();
        let raw = |k: &str| match f.metadata.get(k) {
            Some(MetaValue::Raw(r)) => r.clone(),
            other => panic!("{k}: {other:?}"),
        };
        assert_eq!((raw("a.strings").elem, raw("a.strings").len), (8, 2));
        assert_eq!(raw("a.floats").bytes.len(), 12);
        assert!(raw("a.nested").bytes.is_mapped());
        assert_eq!(f.metadata.get("tokenizer.ggml.tokens"), Some(&tokens));
        // Written back, the file is the same file.
        let meta: Vec<(&str, MetaValue)> = f
            .metadata
            .entries
            .iter()
            .map(|(k, v)| (k.as_str(), v.clone()))
            .collect();
        let q = dir.path().join("copy.gguf");
        let t = RawTensor::f32("w", &[2], &[1., 2.]);
        write(&q, &meta, &[t]).unwrap();
        let g = GgufFile::open(&q).unwrap();
        assert_eq!(g.metadata.entries, f.metadata.entries);
    }

    #[test]
    fn kept_arrays_over_the_memory_limit_are_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.gguf");
        // 32 bytes of memory an element: this many u8 elements are one over the limit.
        let n = MAX_METADATA_ARRAY_BYTES.value / size_of::<MetaValue>() as u64 + 1;
        let mut b = raw_header(0, 1);
        put_u8_array(&mut b, "tokenizer.ggml.merges", n);
        std::fs::write(&p, &b).unwrap();
        let err = GgufFile::open(&p).unwrap_err().to_string();
        assert!(err.contains("max_metadata_array_bytes"), "{err}");
        // The same array under a key the runtime does not read costs no memory.
        let mut b = raw_header(0, 1);
        put_u8_array(&mut b, "general.unused", n);
        std::fs::write(&p, &b).unwrap();
        assert!(matches!(
            GgufFile::open(&p).unwrap().metadata.get("general.unused"),
            Some(MetaValue::Raw(_))
        ));
    }

    #[test]
    fn tensor_counts_over_the_limit_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.gguf");
        let n = MAX_TENSORS.value + 1;
        let mut b = raw_header(n, 0);
        b.resize(b.len() + n as usize * 24, 0);
        std::fs::write(&p, &b).unwrap();
        let err = GgufFile::open(&p).unwrap_err().to_string();
        assert!(err.contains("max_tensors"), "{err}");
    }

    #[test]
    fn huge_claimed_lengths_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.gguf");
        let mut b = Vec::new();
        b.extend(b"GGUF");
        b.extend(3u32.to_le_bytes());
        b.extend(0u64.to_le_bytes());
        b.extend(1u64.to_le_bytes());
        b.extend(u64::MAX.to_le_bytes()); // key length
        std::fs::write(&p, &b).unwrap();
        let err = GgufFile::open(&p).unwrap_err().to_string();
        assert!(err.contains("metadata"), "{err}");
    }
}
