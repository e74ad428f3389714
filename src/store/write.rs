//! `convert`: a GGUF file or HF directory → a store directory, written into a temporary
//! directory next to the target and renamed into place only when complete and synced.

use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use rayon::prelude::*;
use xxhash_rust::xxh3::{Xxh3, xxh3_64};

use super::quant::{INT4_GROUP, int4_row, int8_row};
use super::*;
use crate::model::gguf::{GgufFile, MetaValue};
use crate::model::{LayerWeights, Linear, Model, NormWeights};
use crate::tensor::HostTensor;

#[derive(Clone, Debug, Default)]
pub struct ConvertOptions {
    /// Bundle encodings besides f16 (which is always written): INT8 and/or INT4.
    pub extra_encodings: Vec<Encoding>,
    /// Replace an existing store at the target.
    pub force: bool,
    /// Copy a GGUF's tensors into `data.bin` even where the store could read them in the file
    /// itself (by default it does: a 40 GB model then takes no second 40 GB of disk).
    pub copy: bool,
    /// Store a block-quantized FFN as neuron bundles too (its blocks dequantized, then encoded
    /// as f16 and `extra_encodings`), so cache units and mixed-precision neurons can run it.
    pub bundle_quantized: bool,
}

/// Appends segments to `data.bin`, each aligned and checksummed; or records, checksummed,
/// segments the store reads in the model file itself.
struct DataWriter {
    out: BufWriter<File>,
    path: PathBuf,
    offset: u64,
    segments: Vec<Segment>,
    /// Whether matrices mapped from the (single-file) source are referenced in place.
    in_place: bool,
}

/// The checksums of a segment's bytes: whole, and per group of [`GROUP_ROWS`] rows.
fn checksums(bytes: &[u8], rows: usize) -> (String, Vec<String>) {
    let group_bytes = (bytes.len() / rows.max(1)) * GROUP_ROWS;
    let groups = bytes
        .chunks(group_bytes.max(1))
        .map(|g| format!("{:016x}", xxh3_64(g)))
        .collect();
    (format!("{:016x}", xxh3_64(bytes)), groups)
}

impl DataWriter {
    fn put(
        &mut self,
        name: String,
        kind: SegmentKind,
        encoding: Encoding,
        rows: usize,
        cols: usize,
        bytes: &[u8],
    ) -> Result<(), StoreError> {
        let pad = self.offset.next_multiple_of(ALIGN) - self.offset;
        let err = |e| StoreError::io(&self.path, e);
        self.out.write_all(&vec![0u8; pad as usize]).map_err(err)?;
        self.offset += pad;
        self.out
            .write_all(bytes)
            .map_err(|e| StoreError::io(&self.path, e))?;
        let (xxh3, group_xxh3) = checksums(bytes, rows);
        self.segments.push(Segment {
            name,
            kind,
            encoding,
            rows,
            cols,
            offset: self.offset,
            bytes: bytes.len() as u64,
            xxh3,
            group_xxh3,
            in_source: false,
        });
        self.offset += bytes.len() as u64;
        Ok(())
    }

    /// A vector (norm weights, biases, RoPE factors) as f32, what every backend reads them in.
    fn vector(&mut self, name: String, t: &HostTensor) -> Result<(), StoreError> {
        let values = t.to_f32();
        self.put(
            name,
            SegmentKind::Tensor,
            Encoding::F32,
            t.rows,
            t.cols,
            bytemuck::cast_slice(&values),
        )
    }

    /// A matrix in its own encoding, its bytes as the model holds them: referenced where the
    /// source file has them, when it may be, else copied.
    fn matrix(&mut self, name: String, t: &HostTensor) -> Result<(), StoreError> {
        if let (true, crate::tensor::Bytes::Mapped { range, map }) = (self.in_place, &t.data) {
            let bytes = &map[range.clone()];
            let (xxh3, group_xxh3) = checksums(bytes, t.rows);
            self.segments.push(Segment {
                name,
                kind: SegmentKind::Tensor,
                encoding: Encoding::Format(t.dtype),
                rows: t.rows,
                cols: t.cols,
                offset: range.start as u64,
                bytes: bytes.len() as u64,
                xxh3,
                group_xxh3,
                in_source: true,
            });
            return Ok(());
        }
        self.put(
            name,
            SegmentKind::Tensor,
            Encoding::Format(t.dtype),
            t.rows,
            t.cols,
            t.data.as_slice(),
        )
    }

    /// Pad the file to a whole page (so direct reads of the last segment stay inside it), flush
    /// and sync.
    fn finish(mut self) -> Result<(u64, Vec<Segment>), StoreError> {
        let end = self.offset.next_multiple_of(ALIGN);
        let pad = (end - self.offset) as usize;
        let path = self.path.clone();
        self.out
            .write_all(&vec![0u8; pad])
            .map_err(|e| StoreError::io(&path, e))?;
        let file = self
            .out
            .into_inner()
            .map_err(|e| StoreError::io(&path, e.into_error()))?;
        file.sync_all().map_err(|e| StoreError::io(&path, e))?;
        Ok((end, self.segments))
    }
}

/// FFN bundles of one layer in one encoding: neuron i = [gate_i | up_i | down_i] (or [up_i |
/// down_i] without a gate), each `d_model` values, where down_i is column i of W_down (row i of
/// `down_t`). `enc` must hold bundles of `d` (`backend::bundle_bytes` says whether it does).
/// Public so tests and tools build bundles exactly as the store writes them.
pub fn bundles(
    gate: Option<&[f32]>,
    up: &[f32],
    down_t: &[f32],
    d: usize,
    enc: Encoding,
) -> Vec<u8> {
    debug_assert!(bundle_encoding(enc), "{enc:?} is not a bundle encoding");
    let n_ff = up.len() / d;
    let parts = if gate.is_some() { 3 } else { 2 };
    let cols = parts * d;
    let row_bytes = enc.row_bytes(cols, parts);
    let mut out = vec![0u8; n_ff * row_bytes];
    out.par_chunks_mut(row_bytes)
        .enumerate()
        .for_each(|(i, dst)| {
            let mut vecs: Vec<&[f32]> = Vec::with_capacity(3);
            if let Some(g) = gate {
                vecs.push(&g[i * d..(i + 1) * d]);
            }
            vecs.push(&up[i * d..(i + 1) * d]);
            vecs.push(&down_t[i * d..(i + 1) * d]);
            encode_bundle(&vecs, enc, dst);
        });
    out
}

/// Whether bundles can be written in `enc`: a float format, or INT8/INT4.
fn bundle_encoding(enc: Encoding) -> bool {
    enc.dtype().is_none_or(|d| !d.is_quantized())
}

/// One bundle's bytes: the parts in order. INT8 puts the part scales first, INT4 all group scales
/// first, so the codes of a bundle are contiguous.
fn encode_bundle(parts: &[&[f32]], enc: Encoding, dst: &mut [u8]) {
    let d = parts[0].len();
    match enc {
        Encoding::Format(dtype) => {
            let rb = dtype.bytes_for(d);
            for (p, v) in parts.iter().enumerate() {
                // Float formats always encode (checked by `bundle_encoding`).
                let _ = crate::tensor::encode_row(dtype, v, &mut dst[p * rb..(p + 1) * rb]);
            }
        }
        Encoding::Int8 => {
            let n = parts.len();
            for (p, v) in parts.iter().enumerate() {
                let (scale, q) = int8_row(v);
                dst[p * 4..p * 4 + 4].copy_from_slice(&scale.to_le_bytes());
                let codes = &mut dst[n * 4 + p * d..n * 4 + (p + 1) * d];
                codes.copy_from_slice(bytemuck::cast_slice(&q));
            }
        }
        Encoding::Int4 => {
            let groups = d / INT4_GROUP;
            let scale_bytes = parts.len() * groups * 2;
            for (p, v) in parts.iter().enumerate() {
                let (scales, packed) = int4_row(v);
                for (g, s) in scales.iter().enumerate() {
                    let at = (p * groups + g) * 2;
                    dst[at..at + 2].copy_from_slice(&s.to_le_bytes());
                }
                let at = scale_bytes + p * d / 2;
                dst[at..at + d / 2].copy_from_slice(&packed);
            }
        }
    }
}

/// `rows × cols` row-major → `cols × rows`, in cache-sized tiles.
fn transpose(m: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    const T: usize = 64;
    let mut out = vec![0f32; m.len()];
    for r0 in (0..rows).step_by(T) {
        for c0 in (0..cols).step_by(T) {
            for r in r0..(r0 + T).min(rows) {
                for c in c0..(c0 + T).min(cols) {
                    out[c * rows + r] = m[r * cols + c];
                }
            }
        }
    }
    out
}

fn source_info(source: &Path) -> Result<SourceInfo, StoreError> {
    let canonical = fs::canonicalize(source).map_err(|e| StoreError::io(source, e))?;
    let meta = fs::metadata(&canonical).map_err(|e| StoreError::io(&canonical, e))?;
    let mtime = |m: &fs::Metadata| {
        m.modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_secs())
    };
    let (bytes, modified) = if meta.is_dir() {
        let mut total = 0u64;
        let mut newest = 0u64;
        for entry in fs::read_dir(&canonical).map_err(|e| StoreError::io(&canonical, e))? {
            let entry = entry.map_err(|e| StoreError::io(&canonical, e))?;
            if let Ok(m) = entry.metadata()
                && m.is_file()
            {
                total += m.len();
                newest = newest.max(mtime(&m));
            }
        }
        (total, newest)
    } else {
        (meta.len(), mtime(&meta))
    };
    Ok(SourceInfo {
        path: canonical.to_string_lossy().into_owned(),
        bytes,
        modified_unix_s: modified,
    })
}

/// Where `run` keeps the store it converts from `source` on first use:
/// `<models dir>/stores/<hash of the source path>`.
pub fn cached_store_for(source: &Path) -> Result<PathBuf, StoreError> {
    let canonical = fs::canonicalize(source).map_err(|e| StoreError::io(source, e))?;
    let key = xxh3_64(canonical.to_string_lossy().as_bytes());
    Ok(crate::model::models_dir()
        .join("stores")
        .join(format!("{key:016x}")))
}

/// Copy or extract the tokenizer into `tmp`: what kind it is and the files written.
fn write_tokenizer(
    source: &Path,
    tmp: &Path,
) -> Result<(Option<TokenizerFiles>, Vec<&'static str>), StoreError> {
    if source.is_dir() {
        let mut any = false;
        let mut written = Vec::new();
        for name in [
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
            "special_tokens_map.json",
            "chat_template.jinja",
            "config.json",
        ] {
            let from = source.join(name);
            if from.exists() {
                fs::copy(&from, tmp.join(name)).map_err(|e| StoreError::io(&from, e))?;
                any |= name == "tokenizer.json";
                written.push(name);
            }
        }
        return Ok((any.then_some(TokenizerFiles::HuggingFace), written));
    }
    let gguf = GgufFile::open(source)?;
    let entries: Vec<(&str, MetaValue)> = gguf
        .metadata
        .entries
        .iter()
        .filter(|(k, _)| k.starts_with("tokenizer."))
        .map(|(k, v)| (k.as_str(), v.clone()))
        .collect();
    if entries.is_empty() {
        return Ok((None, Vec::new()));
    }
    let path = tmp.join("tokenizer.gguf");
    crate::model::gguf::write(&path, &entries, &[]).map_err(|e| StoreError::io(&path, e))?;
    Ok((Some(TokenizerFiles::Gguf), vec!["tokenizer.gguf"]))
}

/// Convert `source` (GGUF file or HF directory) into a store at `out`. `progress(done, total)`
/// counts layers.
pub fn convert(
    source: &Path,
    out: &Path,
    opts: &ConvertOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Manifest, StoreError> {
    if out.exists() && !opts.force {
        return Err(StoreError::Exists {
            path: out.to_path_buf(),
        });
    }
    let model = Model::load(source)?;
    let spec = model.spec.clone();
    if spec.moe.is_some() && (opts.bundle_quantized || !opts.extra_encodings.is_empty()) {
        return Err(StoreError::Unsupported(
            "a mixture-of-experts model's FFN is stored as its experts (each one slice of \
             ffn_{gate,up,down}_exps), not as neuron bundles: drop --bundle-ffn and --encodings"
                .into(),
        ));
    }
    for &e in &opts.extra_encodings {
        if e == Encoding::Int4 && !spec.d_model.is_multiple_of(INT4_GROUP) {
            return Err(StoreError::Unsupported(format!(
                "INT4 bundles need a hidden size divisible by {INT4_GROUP}; this model has {}",
                spec.d_model
            )));
        }
        if !matches!(e, Encoding::Int8 | Encoding::Int4) {
            return Err(StoreError::Unsupported(format!(
                "bundle encoding {} (extra encodings are int8 and int4)",
                e.name()
            )));
        }
    }
    let parent = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    fs::create_dir_all(parent).map_err(|e| StoreError::io(parent, e))?;
    let name = out
        .file_name()
        .ok_or_else(|| {
            StoreError::Unsupported(format!("{} is not a directory name", out.display()))
        })?
        .to_string_lossy()
        .into_owned();
    // Temporaries of earlier conversions to the same target whose process is gone (a crash or
    // kill mid-write leaves one behind; it never becomes a store).
    crate::fsutil::remove_stale_temps(parent, Some(name.as_str()));
    let tmp = parent.join(format!(".{name}.tmp.{}", std::process::id()));
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(|e| StoreError::io(&tmp, e))?;
    }
    fs::create_dir(&tmp).map_err(|e| StoreError::io(&tmp, e))?;
    let result = write_store(source, &model, &tmp, opts, progress).and_then(|manifest| {
        install(&tmp, out, &name)?;
        Ok(manifest)
    });
    if result.is_err() {
        fs::remove_dir_all(&tmp).ok();
    }
    result
}

/// Move the finished temporary directory to `out`, replacing what was there.
fn install(tmp: &Path, out: &Path, name: &str) -> Result<(), StoreError> {
    let parent = tmp.parent().unwrap_or(Path::new("."));
    let old = parent.join(format!(".{name}.old.{}", std::process::id()));
    let had_old = out.exists();
    if had_old {
        fs::rename(out, &old).map_err(|e| StoreError::io(out, e))?;
    }
    if let Err(e) = fs::rename(tmp, out) {
        if had_old {
            fs::rename(&old, out).ok();
        }
        return Err(StoreError::io(out, e));
    }
    if let Ok(d) = File::open(parent) {
        d.sync_all().ok();
    }
    if had_old {
        fs::remove_dir_all(&old).ok();
    }
    Ok(())
}

fn write_norm(dw: &mut DataWriter, base: String, n: &NormWeights) -> Result<(), StoreError> {
    dw.vector(format!("{base}.weight"), &n.weight)?;
    if let Some(b) = &n.bias {
        dw.vector(format!("{base}.bias"), b)?;
    }
    Ok(())
}

fn write_linear(dw: &mut DataWriter, base: String, l: &Linear) -> Result<(), StoreError> {
    dw.matrix(format!("{base}.weight"), &l.weight)?;
    if let Some(b) = &l.bias {
        dw.vector(format!("{base}.bias"), b)?;
    }
    Ok(())
}

/// Layer `l`'s attention: its norm, q, k, v and output projections, and q's and k's head norms.
fn write_attention(dw: &mut DataWriter, l: usize, layer: &LayerWeights) -> Result<(), StoreError> {
    write_norm(dw, names::layer(l, "attn_norm"), &layer.attn_norm)?;
    write_linear(dw, names::layer(l, "attn_q"), &layer.wq)?;
    write_linear(dw, names::layer(l, "attn_k"), &layer.wk)?;
    write_linear(dw, names::layer(l, "attn_v"), &layer.wv)?;
    write_linear(dw, names::layer(l, "attn_output"), &layer.wo)?;
    for (what, n) in [
        ("attn_q_norm", &layer.q_norm),
        ("attn_k_norm", &layer.k_norm),
    ] {
        if let Some(n) = n {
            write_norm(dw, names::layer(l, what), n)?;
        }
    }
    Ok(())
}

/// Layer `l`'s router and experts: `ffn_gate_inp` (f32, a row per routed expert and the shared
/// expert's gate), `ffn_gate_exps` and `ffn_up_exps` (expert `e`'s rows after `e − 1`'s) and
/// `ffn_down_exps` (expert `e`'s `d_model × d_expert` down after `e − 1`'s, as a GGUF holds it),
/// so an expert is one slice of each.
fn write_experts(dw: &mut DataWriter, l: usize, layer: &LayerWeights) -> Result<(), StoreError> {
    let router = layer.router.as_ref().ok_or_else(|| {
        StoreError::Unsupported(format!(
            "layer {l} of a mixture-of-experts model has no router"
        ))
    })?;
    let gate = layer.w_gate.as_ref().ok_or_else(|| {
        StoreError::Unsupported(format!(
            "layer {l}'s experts have no gate (SwiGLU experts only)"
        ))
    })?;
    dw.matrix(names::layer(l, "ffn_gate_inp.weight"), router)?;
    dw.matrix(names::layer(l, "ffn_gate_exps.weight"), &gate.weight)?;
    dw.matrix(names::layer(l, "ffn_up_exps.weight"), &layer.w_up.weight)?;
    dw.matrix(
        names::layer(l, "ffn_down_exps.weight"),
        &layer.w_down.weight,
    )
}

fn write_store(
    source: &Path,
    model: &Model,
    tmp: &Path,
    opts: &ConvertOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Manifest, StoreError> {
    let spec = &model.spec;
    let w = &model.weights;
    let data_path = tmp.join(DATA);
    let file = File::create(&data_path).map_err(|e| StoreError::io(&data_path, e))?;
    let mut dw = DataWriter {
        out: BufWriter::with_capacity(8 << 20, file),
        path: data_path.clone(),
        offset: 0,
        segments: Vec::new(),
        // One file mapped as a whole (a GGUF): its offsets are the file's.
        in_place: !opts.copy && source.is_file(),
    };
    let ffn_dtypes: Vec<crate::tensor::DType> = w
        .layers
        .iter()
        .flat_map(|l| {
            [Some(&l.w_up), Some(&l.w_down), l.w_gate.as_ref()]
                .into_iter()
                .flatten()
                .map(|lin| lin.weight.dtype)
        })
        .collect();
    // Experts stay whole, in their formats: one expert is one slice of each matrix.
    let bundled = spec.moe.is_none() && (opts.bundle_quantized || names::ffn_bundled(&ffn_dtypes));
    if !bundled && !opts.extra_encodings.is_empty() {
        return Err(StoreError::Unsupported(
            "INT8/INT4 bundles are made from float models; this model's FFN is block-quantized and is stored in its own formats (bundle it first with --bundle-ffn)".into(),
        ));
    }
    let mut encodings = Vec::new();
    if bundled {
        encodings.push(Encoding::F16);
        for &e in &opts.extra_encodings {
            if !encodings.contains(&e) {
                encodings.push(e);
            }
        }
    }

    dw.matrix(names::TOKEN_EMBD.into(), &w.token_embd)?;
    if let Some(p) = &w.pos_embd {
        dw.matrix(names::POS_EMBD.into(), p)?;
    }
    if let Some(f) = &w.rope_freq_factors {
        let t = HostTensor::from_f32(names::ROPE_FREQS, 1, f.len(), f.clone());
        dw.vector(names::ROPE_FREQS.into(), &t)?;
    }
    let n_layers = w.layers.len();
    for (l, layer) in w.layers.iter().enumerate() {
        write_attention(&mut dw, l, layer)?;
        write_norm(&mut dw, names::layer(l, "ffn_norm"), &layer.ffn_norm)?;
        if let Some(b) = &layer.w_up.bias {
            dw.vector(names::layer(l, "ffn_up.bias"), b)?;
        }
        if let Some(b) = &layer.w_down.bias {
            dw.vector(names::layer(l, "ffn_down.bias"), b)?;
        }
        if spec.moe.is_some() {
            write_experts(&mut dw, l, layer)?;
            progress(l + 1, n_layers);
            continue;
        }
        if !bundled {
            // Block formats: the FFN matrices as the file holds them.
            if let Some(g) = &layer.w_gate {
                dw.matrix(names::layer(l, "ffn_gate.weight"), &g.weight)?;
            }
            dw.matrix(names::layer(l, "ffn_up.weight"), &layer.w_up.weight)?;
            dw.matrix(names::layer(l, "ffn_down.weight"), &layer.w_down.weight)?;
            progress(l + 1, n_layers);
            continue;
        }
        let gate = layer.w_gate.as_ref().map(|g| g.weight.to_f32());
        let up = layer.w_up.weight.to_f32();
        let down_t = transpose(&layer.w_down.weight.to_f32(), spec.d_model, spec.d_ff);
        let parts = if gate.is_some() { 3 } else { 2 };
        for &enc in &encodings {
            let bytes = bundles(gate.as_deref(), &up, &down_t, spec.d_model, enc);
            dw.put(
                names::bundles(l, enc),
                SegmentKind::Bundles { parts },
                enc,
                spec.d_ff,
                parts * spec.d_model,
                &bytes,
            )?;
        }
        progress(l + 1, n_layers);
    }
    write_norm(&mut dw, "output_norm".into(), &w.output_norm)?;
    if let Some(o) = &w.output {
        dw.matrix(names::OUTPUT.into(), o)?;
    }
    let (data_bytes, segments) = dw.finish()?;

    let (tokenizer, tokenizer_names) = write_tokenizer(source, tmp)?;
    let tokenizer_files = tokenizer_names
        .iter()
        .map(|n| super::check::file_checksum(tmp, n))
        .collect::<Result<Vec<_>, _>>()?;
    let mut manifest = Manifest {
        format: FORMAT_NAME.into(),
        version: FORMAT_VERSION,
        model_id: model_id(spec, &segments)?,
        spec: spec.clone(),
        source: source_info(source)?,
        bundle_encodings: encodings,
        data_bytes,
        segments,
        tokenizer,
        tokenizer_files,
        checksums: ManifestChecksums::default(),
    };
    manifest.seal()?;
    // What the reader will check: a writer whose manifest fails its own checks (a model the
    // layout has no place for) fails here, not at every later open.
    super::check::check_layout(&manifest).map_err(|m| {
        StoreError::Unsupported(format!("the converted store would be refused: {m}"))
    })?;
    let text =
        serde_json::to_vec_pretty(&manifest).map_err(|e| StoreError::Unsupported(e.to_string()))?;
    let mpath = tmp.join(MANIFEST);
    crate::fsutil::write_atomic(&mpath, &text).map_err(|e| StoreError::io(&mpath, e))?;
    Ok(manifest)
}

/// Identity of the converted weights: xxh3-64 over the spec and every segment's checksum.
fn model_id(spec: &crate::model::ModelSpec, segments: &[Segment]) -> Result<String, StoreError> {
    let spec_json =
        serde_json::to_string(spec).map_err(|e| StoreError::Unsupported(e.to_string()))?;
    let mut id = Xxh3::new();
    id.update(spec_json.as_bytes());
    for s in segments {
        id.update(s.name.as_bytes());
        id.update(s.xxh3.as_bytes());
    }
    Ok(format!("{:016x}", id.digest()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bundles_put_gate_up_and_down_column_side_by_side() {
        // d = 2, n_ff = 2: gate rows g0 g1, up rows u0 u1, down (d × n_ff) [[a, b], [c, d]].
        let gate = [1.0, 2.0, 3.0, 4.0];
        let up = [5.0, 6.0, 7.0, 8.0];
        let down = [10.0, 11.0, 12.0, 13.0];
        let down_t = transpose(&down, 2, 2);
        let b = bundles(Some(&gate), &up, &down_t, 2, Encoding::F32);
        let v: &[f32] = bytemuck::cast_slice(&b);
        assert_eq!(
            v,
            [
                1.0, 2.0, 5.0, 6.0, 10.0, 12.0, 3.0, 4.0, 7.0, 8.0, 11.0, 13.0
            ]
        );
    }

    #[test]
    fn transpose_roundtrips() {
        let m: Vec<f32> = (0..6 * 130).map(|i| i as f32).collect();
        let t = transpose(&m, 6, 130);
        assert_eq!(t[5 * 6 + 1], m[130 + 5]);
        assert_eq!(transpose(&t, 130, 6), m);
    }
}
