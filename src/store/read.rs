//! Opening a store and reading its segments: direct I/O (page cache bypassed, so `--dram-mem`
//! is the only DRAM the weights use) into page-aligned buffers, every read checked against the
//! segment's checksum.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use half::f16;
use xxhash_rust::xxh3::xxh3_64;

use super::*;
use crate::model::{
    Arch, LayerWeights, Linear, ModelWeights, NormWeights, PositionEncoding, Tokenizer,
};
use crate::tensor::{AlignedBuf, Bytes, DType, HostTensor};

/// The first fields of a manifest, read before the rest: a store of another format or version
/// is refused as such, not as a manifest missing this version's fields.
#[derive(serde::Deserialize)]
struct Header {
    format: String,
    version: u32,
}

/// A file segments are read from, opened for direct I/O where the filesystem allows it.
struct DataFile {
    file: File,
    path: PathBuf,
    /// Whether reads bypass the page cache.
    direct: bool,
}

/// An opened store.
pub struct Store {
    dir: PathBuf,
    pub manifest: Manifest,
    /// `data.bin`.
    data: DataFile,
    /// The model file itself, for segments referenced in place.
    source: Option<DataFile>,
    index: HashMap<String, usize>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("dir", &self.dir)
            .field("model_id", &self.manifest.model_id)
            .field("direct_io", &self.data.direct)
            .finish()
    }
}

fn format_err(path: &Path, msg: impl Into<String>) -> StoreError {
    StoreError::Format {
        path: path.to_path_buf(),
        msg: msg.into(),
    }
}

impl Store {
    /// Whether `dir` looks like a store (has a manifest).
    pub fn is_store(dir: &Path) -> bool {
        dir.join(MANIFEST).is_file()
    }

    /// Open and check the structure: manifest readable, of this format and as it was written
    /// (its checksums), its spec valid and every tensor the spec needs there in the shape it
    /// implies, every segment inside its file, no two over the same bytes, the tokenizer files
    /// there. Data checksums are checked on each read. Temporaries that dead writers left
    /// beside the store are removed.
    pub fn open(dir: &Path) -> Result<Store, StoreError> {
        let mpath = dir.join(MANIFEST);
        let manifest = read_manifest(&mpath)?;
        manifest
            .check_sealed()
            .map_err(|e| format_err(&mpath, e.to_string()))?;
        super::check::check_layout(&manifest).map_err(|m| format_err(&mpath, m))?;
        remove_stale_temps_around(dir);
        for f in &manifest.tokenizer_files {
            let path = dir.join(&f.name);
            let len = std::fs::metadata(&path)
                .map_err(|e| StoreError::io(&path, e))?
                .len();
            if len != f.bytes {
                return Err(format_err(
                    &path,
                    format!(
                        "{len} bytes, the manifest says {}: the store is damaged; convert the model again",
                        f.bytes
                    ),
                ));
            }
        }

        let data = open_data(&dir.join(DATA))?;
        let source = if manifest.segments.iter().any(|s| s.in_source) {
            let path = PathBuf::from(&manifest.source.path);
            let f = open_data(&path).map_err(|e| {
                format_err(
                    &mpath,
                    format!(
                        "the store reads the model file {} in place, and it cannot be opened ({e}): convert the model again",
                        path.display()
                    ),
                )
            })?;
            let size = f
                .file
                .metadata()
                .map_err(|e| StoreError::io(&path, e))?
                .len();
            if size != manifest.source.bytes {
                return Err(format_err(
                    &mpath,
                    format!(
                        "the store reads the model file {} in place, which has changed ({size} bytes, {} when converted): convert the model again",
                        path.display(),
                        manifest.source.bytes
                    ),
                ));
            }
            Some(f)
        } else {
            None
        };
        let len_of = |f: &DataFile| {
            f.file
                .metadata()
                .map(|m| m.len())
                .map_err(|e| StoreError::io(&f.path, e))
        };
        let data_len = len_of(&data)?;
        let source_len = source.as_ref().map(len_of).transpose()?.unwrap_or(0);
        let mut index = HashMap::new();
        for (i, s) in manifest.segments.iter().enumerate() {
            let expect = (s.rows as u64).checked_mul(s.row_bytes() as u64);
            // Segments of data.bin start on a page (direct I/O); in-place ones where the
            // model file has them.
            if expect != Some(s.bytes) || (!s.in_source && s.offset % ALIGN != 0) {
                return Err(format_err(
                    &mpath,
                    format!("segment `{}` has an inconsistent shape or offset", s.name),
                ));
            }
            let (len, path) = match (&source, s.in_source) {
                (Some(f), true) => (source_len, &f.path),
                _ => (data_len, &data.path),
            };
            let end = s.offset.saturating_add(s.bytes);
            if end > len {
                return Err(StoreError::Truncated {
                    path: path.clone(),
                    segment: s.name.clone(),
                    msg: format!(
                        "it ends at byte {end} but {} has {len} bytes",
                        path.display()
                    ),
                });
            }
            if s.group_xxh3.len() != s.rows.div_ceil(GROUP_ROWS) {
                return Err(format_err(
                    &mpath,
                    format!(
                        "segment `{}` has {} group checksums for {} rows",
                        s.name,
                        s.group_xxh3.len(),
                        s.rows
                    ),
                ));
            }
            if index.insert(s.name.clone(), i).is_some() {
                return Err(format_err(
                    &mpath,
                    format!("segment `{}` appears twice", s.name),
                ));
            }
        }
        let len = data_len;
        let data_path = data.path.clone();
        if len < manifest.data_bytes {
            return Err(StoreError::Truncated {
                path: data_path.clone(),
                segment: "(end of file)".into(),
                msg: format!("{len} bytes, the manifest says {}", manifest.data_bytes),
            });
        }
        Ok(Store {
            dir: dir.to_path_buf(),
            manifest,
            data,
            source,
            index,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn direct_io(&self) -> bool {
        self.data.direct
    }

    /// The file `seg` is read from.
    fn file_of(&self, seg: &Segment) -> &DataFile {
        match (&self.source, seg.in_source) {
            (Some(f), true) => f,
            _ => &self.data,
        }
    }

    pub fn segment(&self, name: &str) -> Option<&Segment> {
        self.index.get(name).map(|&i| &self.manifest.segments[i])
    }

    pub fn require(&self, name: &str) -> Result<&Segment, StoreError> {
        self.segment(name).ok_or_else(|| {
            format_err(
                &self.dir.join(MANIFEST),
                format!("segment `{name}` is missing"),
            )
        })
    }

    /// Read rows `rows` of `seg` (starting on a checksum group, ending on one or at the last
    /// row) into `buf` with one direct read of whole pages, and check every group. Returns where
    /// the rows start in `buf` and how many bytes were read from disk.
    pub fn read_rows_into(
        &self,
        seg: &Segment,
        rows: std::ops::Range<usize>,
        buf: &mut AlignedBuf,
    ) -> Result<(usize, u64), StoreError> {
        let aligned = rows.start.is_multiple_of(GROUP_ROWS)
            && (rows.end == seg.rows || rows.end.is_multiple_of(GROUP_ROWS))
            && rows.start <= rows.end
            && rows.end <= seg.rows;
        if !aligned {
            return Err(StoreError::Unsupported(format!(
                "rows {rows:?} of `{}` do not fall on checksum groups of {GROUP_ROWS}",
                seg.name
            )));
        }
        let (start, len) = seg.read_extent(rows.clone());
        let len_us = len as usize;
        assert!(
            buf.capacity() >= len_us,
            "buffer of {} bytes for a read of {len}",
            buf.capacity()
        );
        let f = self.file_of(seg);
        let dst = &mut buf.padded_mut()[..len_us];
        let mut done = 0;
        while done < len_us {
            let n = f
                .file
                .read_at(&mut dst[done..], start + done as u64)
                .map_err(|e| StoreError::io(&f.path, e))?;
            if n == 0 {
                break;
            }
            done += n;
        }
        let first = (seg.row_range(rows.clone()).start - start) as usize;
        let rb = seg.row_bytes();
        if done < first + rows.len() * rb {
            return Err(StoreError::Truncated {
                path: f.path.clone(),
                segment: seg.name.clone(),
                msg: format!("read {done} of {len} bytes"),
            });
        }
        forget_cached(f, start, len);
        for g in rows.start / GROUP_ROWS..rows.end.div_ceil(GROUP_ROWS) {
            let (r0, r1) = (g * GROUP_ROWS, ((g + 1) * GROUP_ROWS).min(seg.rows));
            let at = first + (r0 - rows.start) * rb;
            let actual = format!("{:016x}", xxh3_64(&dst[at..at + (r1 - r0) * rb]));
            if actual != seg.group_xxh3[g] {
                return Err(StoreError::Checksum {
                    path: f.path.clone(),
                    segment: format!("{} (rows {r0}..{r1})", seg.name),
                    expected: seg.group_xxh3[g].clone(),
                    actual,
                });
            }
        }
        Ok((first, len))
    }

    /// A whole segment in a fresh buffer, with where its bytes are in it (every checksum group
    /// checked).
    pub fn read(&self, seg: &Segment) -> Result<(AlignedBuf, std::ops::Range<usize>), StoreError> {
        let (_, extent) = seg.read_extent(0..seg.rows);
        let mut buf = AlignedBuf::zeroed(extent as usize);
        let (first, _) = self.read_rows_into(seg, 0..seg.rows, &mut buf)?;
        Ok((buf, first..first + seg.bytes as usize))
    }

    /// The full integrity check of `convert --verify`: every segment read once, its group
    /// checksums and its whole-tensor checksum checked, and every tokenizer file against its
    /// checksum (the manifest's own checksums and layout were checked at open).
    /// `progress(done, total)` in bytes of segments.
    pub fn verify(&self, progress: &mut dyn FnMut(u64, u64)) -> Result<(), StoreError> {
        self.verify_all(progress)?;
        for f in &self.manifest.tokenizer_files {
            super::check::check_file(&self.dir, f)?;
        }
        Ok(())
    }

    /// Read every segment once, checking its group checksums and its whole-tensor checksum;
    /// `progress(done, total)` in bytes.
    pub fn verify_all(&self, progress: &mut dyn FnMut(u64, u64)) -> Result<(), StoreError> {
        let total: u64 = self.manifest.segments.iter().map(|s| s.bytes).sum();
        let mut done = 0;
        let biggest = self
            .manifest
            .segments
            .iter()
            .map(|s| s.read_extent(0..s.rows).1)
            .max()
            .unwrap_or(0);
        let mut buf = AlignedBuf::zeroed(biggest as usize);
        for s in &self.manifest.segments {
            let (first, _) = self.read_rows_into(s, 0..s.rows, &mut buf)?;
            let whole = &buf.as_slice()[first..first + s.bytes as usize];
            let actual = format!("{:016x}", xxh3_64(whole));
            if actual != s.xxh3 {
                return Err(StoreError::Checksum {
                    path: self.file_of(s).path.clone(),
                    segment: s.name.clone(),
                    expected: s.xxh3.clone(),
                    actual,
                });
            }
            done += s.bytes;
            progress(done, total);
        }
        Ok(())
    }

    /// A tensor segment as a host tensor, in its stored format.
    pub fn tensor(&self, name: &str) -> Result<HostTensor, StoreError> {
        let seg = self.require(name)?;
        let dtype = match (seg.kind, seg.encoding.dtype()) {
            (SegmentKind::Tensor, Some(d)) => d,
            _ => {
                return Err(format_err(
                    &self.dir.join(MANIFEST),
                    format!("segment `{name}` is not a tensor in a storage format"),
                ));
            }
        };
        let (buf, range) = self.read(seg)?;
        Ok(HostTensor {
            name: name.to_string(),
            rows: seg.rows,
            cols: seg.cols,
            dtype,
            data: Bytes::Aligned {
                range,
                buf: Arc::new(buf),
            },
        })
    }

    pub fn opt_tensor(&self, name: &str) -> Result<Option<HostTensor>, StoreError> {
        match self.segment(name) {
            Some(_) => self.tensor(name).map(Some),
            None => Ok(None),
        }
    }

    /// The model's tokenizer, if the store carries one.
    pub fn tokenizer(&self) -> Result<Option<Tokenizer>, StoreError> {
        // The files are read whole to be parsed anyway: checking them first costs one hash.
        for f in &self.manifest.tokenizer_files {
            super::check::check_file(&self.dir, f)?;
        }
        Ok(match self.manifest.tokenizer {
            None => None,
            Some(TokenizerFiles::HuggingFace) => Tokenizer::from_hf_dir(&self.dir)?,
            Some(TokenizerFiles::Gguf) => {
                let f = crate::model::gguf::GgufFile::open(&self.dir.join("tokenizer.gguf"))?;
                Tokenizer::from_gguf(&f.metadata)?
            }
        })
    }

    /// Whether the FFN is stored as neuron bundles (else as its matrices).
    pub fn ffn_bundled(&self) -> bool {
        !self.manifest.bundle_encodings.is_empty()
    }

    /// Dense weights rebuilt from the store (matrices as stored; for a bundled FFN gate, up and
    /// down from the f16 bundles): the same numbers the offloaded engine computes with, in the
    /// dense layout.
    pub fn dense_weights(&self) -> Result<ModelWeights, StoreError> {
        let spec = &self.manifest.spec;
        let norm = |base: String| -> Result<NormWeights, StoreError> {
            Ok(NormWeights {
                weight: self.tensor(&format!("{base}.weight"))?,
                bias: self.opt_tensor(&format!("{base}.bias"))?,
            })
        };
        let linear = |base: String| -> Result<Linear, StoreError> {
            Ok(Linear {
                weight: self.tensor(&format!("{base}.weight"))?,
                bias: self.opt_tensor(&format!("{base}.bias"))?,
            })
        };
        let head_norm = |base: String| spec.qk_norm.then(|| norm(base)).transpose();
        let mut layers = Vec::with_capacity(spec.n_layers);
        for l in 0..spec.n_layers {
            let mut router = None;
            let (w_gate, w_up, w_down) = if spec.moe.is_some() {
                // The stored expert stacks are the model's own layout.
                router = Some(self.tensor(&names::layer(l, "ffn_gate_inp.weight"))?);
                (
                    Some(linear(names::layer(l, "ffn_gate_exps"))?),
                    linear(names::layer(l, "ffn_up_exps"))?,
                    linear(names::layer(l, "ffn_down_exps"))?,
                )
            } else if self.ffn_bundled() {
                self.ffn_from_bundles(l)?
            } else {
                (
                    spec.gated_ffn
                        .then(|| linear(names::layer(l, "ffn_gate")))
                        .transpose()?,
                    linear(names::layer(l, "ffn_up"))?,
                    linear(names::layer(l, "ffn_down"))?,
                )
            };
            layers.push(LayerWeights {
                attn_norm: norm(names::layer(l, "attn_norm"))?,
                wq: linear(names::layer(l, "attn_q"))?,
                wk: linear(names::layer(l, "attn_k"))?,
                wv: linear(names::layer(l, "attn_v"))?,
                wo: linear(names::layer(l, "attn_output"))?,
                q_norm: head_norm(names::layer(l, "attn_q_norm"))?,
                k_norm: head_norm(names::layer(l, "attn_k_norm"))?,
                ffn_norm: norm(names::layer(l, "ffn_norm"))?,
                router,
                w_gate,
                w_up,
                w_down,
            });
        }
        let pos_embd = match (spec.arch, &spec.position) {
            (Arch::Opt, PositionEncoding::Learned { .. }) => Some(self.tensor(names::POS_EMBD)?),
            _ => self.opt_tensor(names::POS_EMBD)?,
        };
        Ok(ModelWeights {
            token_embd: self.tensor(names::TOKEN_EMBD)?,
            pos_embd,
            layers,
            output_norm: norm("output_norm".into())?,
            output: self.opt_tensor(names::OUTPUT)?,
            rope_freq_factors: self.opt_tensor(names::ROPE_FREQS)?.map(|t| t.to_f32()),
        })
    }
}

impl Store {
    /// Layer `l`'s gate, up and down matrices rebuilt from its f16 bundles.
    #[allow(clippy::type_complexity)]
    fn ffn_from_bundles(&self, l: usize) -> Result<(Option<Linear>, Linear, Linear), StoreError> {
        let spec = &self.manifest.spec;
        let seg = self.require(&names::bundles(l, Encoding::F16))?;
        let (raw, range) = self.read(seg)?;
        let halves: &[f16] = bytemuck::cast_slice(&raw.as_slice()[range]);
        let (d, n_ff) = (spec.d_model, spec.d_ff);
        let parts = if spec.gated_ffn { 3 } else { 2 };
        let bundle = |i: usize, p: usize| &halves[(i * parts + p) * d..(i * parts + p + 1) * d];
        let rows_of =
            |p: usize| -> Vec<f16> { (0..n_ff).flat_map(|i| bundle(i, p).to_vec()).collect() };
        let mut down = vec![f16::ZERO; d * n_ff];
        for i in 0..n_ff {
            for (j, &v) in bundle(i, parts - 1).iter().enumerate() {
                down[j * n_ff + i] = v;
            }
        }
        let f16_tensor = |name: String, rows: usize, cols: usize, v: Vec<f16>| HostTensor {
            name,
            rows,
            cols,
            dtype: DType::F16,
            data: Bytes::from_slice(bytemuck::cast_slice(&v)),
        };
        Ok((
            spec.gated_ffn.then(|| Linear {
                weight: f16_tensor(names::layer(l, "ffn_gate.weight"), n_ff, d, rows_of(0)),
                bias: None,
            }),
            Linear {
                weight: f16_tensor(
                    names::layer(l, "ffn_up.weight"),
                    n_ff,
                    d,
                    rows_of(parts - 2),
                ),
                bias: self.opt_tensor(&names::layer(l, "ffn_up.bias"))?,
            },
            Linear {
                weight: f16_tensor(names::layer(l, "ffn_down.weight"), d, n_ff, down),
                bias: self.opt_tensor(&names::layer(l, "ffn_down.bias"))?,
            },
        ))
    }
}

/// The manifest at `mpath`: of this format and version, within the size limit, parsed.
fn read_manifest(mpath: &Path) -> Result<Manifest, StoreError> {
    let meta = std::fs::metadata(mpath).map_err(|e| StoreError::io(mpath, e))?;
    let limit = crate::limits::MAX_FILE_READ_BYTES;
    if !limit.admits(meta.len()) {
        return Err(format_err(
            mpath,
            limit.refuse("the manifest's size", meta.len()),
        ));
    }
    let text = std::fs::read(mpath).map_err(|e| StoreError::io(mpath, e))?;
    let header: Header = serde_json::from_slice(&text)
        .map_err(|e| format_err(mpath, format!("not a valid store manifest: {e}")))?;
    if header.format != FORMAT_NAME {
        return Err(format_err(
            mpath,
            format!("format `{}` is not a gpu-offload store", header.format),
        ));
    }
    if header.version != FORMAT_VERSION {
        let why = if header.version < FORMAT_VERSION {
            " (written before manifests were checksummed)"
        } else {
            ""
        };
        return Err(format_err(
            mpath,
            format!(
                "store format version {}{why}; this build reads version {FORMAT_VERSION}: convert the model again",
                header.version
            ),
        ));
    }
    serde_json::from_slice(&text)
        .map_err(|e| format_err(mpath, format!("not a valid store manifest: {e}")))
}

/// Remove what writers killed mid-write left: temporaries inside the store directory and the
/// temporary or replaced directories of this store beside it (their processes gone).
fn remove_stale_temps_around(dir: &Path) {
    crate::fsutil::remove_stale_temps(dir, None);
    if let (Some(parent), Some(name)) = (dir.parent(), dir.file_name()) {
        let parent = if parent.as_os_str().is_empty() {
            Path::new(".")
        } else {
            parent
        };
        crate::fsutil::remove_stale_temps(parent, Some(name.to_string_lossy().as_ref()));
    }
}

/// Open the data file for direct I/O, or buffered where the filesystem refuses O_DIRECT.
fn open_data(path: &Path) -> Result<DataFile, StoreError> {
    let (file, direct) = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
    {
        Ok(f) => (f, true),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            tracing::info!(
                "{}: no direct I/O on this filesystem; reading through the page cache",
                path.display()
            );
            (
                File::open(path).map_err(|e| StoreError::io(path, e))?,
                false,
            )
        }
        Err(e) => return Err(StoreError::io(path, e)),
    };
    Ok(DataFile {
        file,
        path: path.to_path_buf(),
        direct,
    })
}

/// Keep the page cache from holding weights behind the DRAM budget's back.
fn forget_cached(f: &DataFile, offset: u64, len: u64) {
    if !f.direct {
        // SAFETY: plain advisory syscall on an open descriptor.
        unsafe {
            libc::posix_fadvise(
                std::os::fd::AsRawFd::as_raw_fd(&f.file),
                offset as libc::off_t,
                len as libc::off_t,
                libc::POSIX_FADV_DONTNEED,
            );
        }
    }
}
