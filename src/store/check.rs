//! What a manifest must agree with before any of it is used (issue 39): its own checksums (an
//! edited or damaged manifest is refused, naming the part that differs), the spec (every tensor
//! the model needs, in the shape the spec implies, and no tensor it has no place for: a
//! vocabulary larger than the embedding would index past it), and its files (no two segments
//! over the same bytes, none past the data the manifest declares).

use std::collections::HashSet;
use std::path::Path;

use serde_json::Value;
use xxhash_rust::xxh3::xxh3_64;

use super::*;
use crate::model::PositionEncoding;

/// xxh3-64 of the canonical serialization of `v`.
fn digest<T: Serialize>(v: &T) -> Result<String, StoreError> {
    serde_json::to_vec(v)
        .map(|b| format!("{:016x}", xxh3_64(&b)))
        .map_err(|e| StoreError::Unsupported(format!("cannot serialize the manifest: {e}")))
}

impl Manifest {
    /// The checksums of the manifest as it is now.
    fn computed_checksums(&self) -> Result<ManifestChecksums, StoreError> {
        let mut sums = ManifestChecksums {
            spec: digest(&self.spec)?,
            source: digest(&self.source)?,
            segments: digest(&self.segments)?,
            tokenizer: digest(&(&self.tokenizer, &self.tokenizer_files))?,
            manifest: String::new(),
        };
        let mut whole = self.clone();
        whole.checksums = sums.clone();
        sums.manifest = digest(&whole)?;
        Ok(sums)
    }

    /// Record the manifest's checksums. It is first put through a serialization round trip, so
    /// that it is exactly what a reader of its JSON gets (floats included).
    pub fn seal(&mut self) -> Result<(), StoreError> {
        let bad = |e: serde_json::Error| StoreError::Unsupported(format!("manifest: {e}"));
        *self = serde_json::from_slice(&serde_json::to_vec(self).map_err(bad)?).map_err(bad)?;
        self.checksums = self.computed_checksums()?;
        Ok(())
    }

    /// Whether the manifest is as it was sealed; else a sentence naming the part that differs.
    pub fn check_sealed(&self) -> Result<(), StoreError> {
        let now = self.computed_checksums()?;
        let was = &self.checksums;
        let parts = [
            ("spec", &was.spec, &now.spec),
            ("source", &was.source, &now.source),
            ("segments", &was.segments, &now.segments),
            ("tokenizer", &was.tokenizer, &now.tokenizer),
            ("manifest", &was.manifest, &now.manifest),
        ];
        for (part, recorded, computed) in parts {
            if recorded != computed {
                let what = match part {
                    "manifest" => "the manifest".to_string(),
                    p => format!("the manifest's `{p}`"),
                };
                let differs = match part {
                    "spec" => spec_differences(self)
                        .map(|d| format!(" ({d})"))
                        .unwrap_or_default(),
                    _ => String::new(),
                };
                return Err(StoreError::Unsupported(format!(
                    "{what} does not match its checksum (recorded {recorded}, computed {computed}){differs}: the manifest was edited or damaged; convert the model again"
                )));
            }
        }
        Ok(())
    }
}

/// Where a manifest's spec fails its checksum: the fields that differ from the spec of the
/// model it was converted from, when that model is still where it was (e.g.
/// `spec.norm_eps is 2e-5 here, 1e-5 in /models/x.gguf`).
fn spec_differences(m: &Manifest) -> Option<String> {
    let path = Path::new(&m.source.path);
    let model = crate::model::Model::load(path).ok()?;
    // Through text, so that f32 fields read as written (`2e-5`, not their f64 expansion).
    let as_value = |s: &crate::model::ModelSpec| -> Option<Value> {
        serde_json::from_str(&serde_json::to_string(s).ok()?).ok()
    };
    let (here, there) = (as_value(&m.spec)?, as_value(&model.spec)?);
    let mut diffs = Vec::new();
    diff_values("spec", &here, &there, &mut diffs);
    let file = path.display();
    let said: Vec<String> = diffs
        .iter()
        .take(4)
        .map(|(at, a, b)| format!("{at} is {a} here, {b} in {file}"))
        .collect();
    (!said.is_empty()).then(|| said.join("; "))
}

/// The leaves where `a` and `b` differ, by path.
fn diff_values(at: &str, a: &Value, b: &Value, out: &mut Vec<(String, String, String)>) {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            let null = Value::Null;
            for k in keys {
                let (va, vb) = (x.get(k).unwrap_or(&null), y.get(k).unwrap_or(&null));
                diff_values(&format!("{at}.{k}"), va, vb, out);
            }
        }
        _ if a != b => out.push((at.to_string(), a.to_string(), b.to_string())),
        _ => {}
    }
}

/// How many rows the spec allows a tensor.
#[derive(Clone, Copy, Debug)]
enum Rows {
    Exactly(usize),
    /// A learned position table: more rows than its offset (the context it covers is checked
    /// against its rows when run).
    MoreThan(usize),
}

/// What the spec says one segment must be.
#[derive(Clone, Copy, Debug)]
struct Place {
    rows: Rows,
    cols: usize,
    what: Holds,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Holds {
    /// f32, what the writer stores every vector in.
    Vector,
    /// A matrix in a storage format.
    Matrix,
    /// FFN bundles of `parts` vectors in this encoding.
    Bundles(usize, Encoding),
}

fn vector(n: usize) -> Option<Place> {
    Some(Place {
        rows: Rows::Exactly(1),
        cols: n,
        what: Holds::Vector,
    })
}

fn matrix(rows: usize, cols: usize) -> Option<Place> {
    Some(Place {
        rows: Rows::Exactly(rows),
        cols,
        what: Holds::Matrix,
    })
}

/// The place the spec has for segment `name`, if any.
fn place_of(m: &Manifest, name: &str) -> Option<Place> {
    let s = &m.spec;
    let d = s.d_model;
    let bundled = !m.bundle_encodings.is_empty();
    let rope = match &s.position {
        PositionEncoding::Rope(r) => Some(r),
        PositionEncoding::Learned { .. } => None,
    };
    match name {
        names::TOKEN_EMBD | names::OUTPUT => return matrix(s.vocab_size, d),
        names::OUTPUT_NORM | names::OUTPUT_NORM_BIAS => return vector(d),
        names::ROPE_FREQS => return rope.and_then(|r| vector(r.dims / 2)),
        names::POS_EMBD => {
            return match s.position {
                PositionEncoding::Learned { offset } => Some(Place {
                    rows: Rows::MoreThan(offset),
                    cols: d,
                    what: Holds::Matrix,
                }),
                PositionEncoding::Rope(_) => None,
            };
        }
        _ => {}
    }
    let rest = name.strip_prefix("blk.")?;
    let (layer, what) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    // `blk.03.…` is no name the writer gives.
    if layer >= s.n_layers || names::layer(layer, what) != name {
        return None;
    }
    let (q, kv, ff) = (s.q_dim(), s.kv_dim(), s.d_ff);
    let parts = if s.gated_ffn { 3 } else { 2 };
    if let Some(moe) = &s.moe {
        // Experts (see the writer's `write_experts`); no dense FFN names, no bundles.
        match what {
            "ffn_gate_inp.weight" => return matrix(moe.router_rows(), d),
            "ffn_gate_exps.weight" | "ffn_up_exps.weight" => return matrix(ff, d),
            "ffn_down_exps.weight" => {
                return matrix((moe.experts + moe.shared) * d, moe.d_expert);
            }
            "ffn_gate.weight" | "ffn_up.weight" | "ffn_down.weight" | "ffn_up.bias" => {
                return None;
            }
            w if w.starts_with("ffn_bundles.") => return None,
            _ => {}
        }
    }
    match what {
        "attn_norm.weight" | "attn_norm.bias" | "ffn_norm.weight" | "ffn_norm.bias" => vector(d),
        "attn_q.weight" => matrix(q, d),
        "attn_k.weight" | "attn_v.weight" => matrix(kv, d),
        "attn_output.weight" => matrix(d, q),
        "attn_q.bias" => vector(q),
        "attn_k.bias" | "attn_v.bias" => vector(kv),
        "attn_output.bias" | "ffn_down.bias" => vector(d),
        "attn_q_norm.weight" | "attn_k_norm.weight" if s.qk_norm => vector(s.head_dim),
        "ffn_up.bias" => vector(ff),
        "ffn_gate.weight" if !bundled && s.gated_ffn => matrix(ff, d),
        "ffn_up.weight" if !bundled => matrix(ff, d),
        "ffn_down.weight" if !bundled => matrix(d, ff),
        _ => {
            let enc = Encoding::parse(what.strip_prefix("ffn_bundles.")?)?;
            m.bundle_encodings.contains(&enc).then_some(Place {
                rows: Rows::Exactly(ff),
                cols: parts * d,
                what: Holds::Bundles(parts, enc),
            })
        }
    }
}

/// The segments layer `l` cannot do without.
fn required_in_layer(m: &Manifest, l: usize) -> Vec<String> {
    let mut out: Vec<String> = [
        "attn_norm.weight",
        "attn_q.weight",
        "attn_k.weight",
        "attn_v.weight",
        "attn_output.weight",
        "ffn_norm.weight",
    ]
    .iter()
    .map(|w| names::layer(l, w))
    .collect();
    if m.spec.qk_norm {
        out.push(names::layer(l, "attn_q_norm.weight"));
        out.push(names::layer(l, "attn_k_norm.weight"));
    }
    if m.spec.moe.is_some() {
        for w in [
            "ffn_gate_inp.weight",
            "ffn_gate_exps.weight",
            "ffn_up_exps.weight",
            "ffn_down_exps.weight",
        ] {
            out.push(names::layer(l, w));
        }
    } else if m.bundle_encodings.is_empty() {
        if m.spec.gated_ffn {
            out.push(names::layer(l, "ffn_gate.weight"));
        }
        out.push(names::layer(l, "ffn_up.weight"));
        out.push(names::layer(l, "ffn_down.weight"));
    } else {
        out.extend(m.bundle_encodings.iter().map(|&e| names::bundles(l, e)));
    }
    out
}

/// Every segment has a place in the spec and the shape and encoding of that place; every
/// tensor the spec needs is there; no two segments share bytes. Errors name the segment.
pub(super) fn check_layout(m: &Manifest) -> Result<(), String> {
    // The one validation every loader runs (counts, limits, numbers no model has).
    m.spec.validate().map_err(|e| format!("model spec: {e}"))?;
    check_bundle_encodings(m)?;
    let s = &m.spec;
    for seg in &m.segments {
        let Some(place) = place_of(m, &seg.name) else {
            return Err(format!(
                "segment `{}` is no tensor of this model ({} layers, {} FFN{})",
                seg.name,
                s.n_layers,
                if m.bundle_encodings.is_empty() {
                    "as matrices"
                } else {
                    "as neuron bundles"
                },
                if s.gated_ffn { ", gated" } else { "" }
            ));
        };
        check_place(seg, &place)?;
    }
    let present: HashSet<&str> = m.segments.iter().map(|s| s.name.as_str()).collect();
    let mut required = vec![
        names::TOKEN_EMBD.to_string(),
        names::OUTPUT_NORM.to_string(),
    ];
    if matches!(s.position, PositionEncoding::Learned { .. }) {
        required.push(names::POS_EMBD.to_string());
    }
    // Layer by layer, stopping at the first missing segment: a layer count beyond the segments
    // the manifest holds is found missing after as many layers as it has, not after counting up.
    for l in 0..=s.n_layers {
        if let Some(missing) = required.iter().find(|n| !present.contains(n.as_str())) {
            return Err(format!(
                "segment `{missing}` is missing (the spec has {} layers)",
                s.n_layers
            ));
        }
        required = if l < s.n_layers {
            required_in_layer(m, l)
        } else {
            Vec::new()
        };
    }
    check_overlaps(m)
}

fn check_place(seg: &Segment, place: &Place) -> Result<(), String> {
    let rows_fit = match place.rows {
        Rows::Exactly(r) => seg.rows == r,
        Rows::MoreThan(r) => seg.rows > r,
    };
    if !rows_fit || seg.cols != place.cols {
        let need = match place.rows {
            Rows::Exactly(r) => format!("{r} × {}", place.cols),
            Rows::MoreThan(r) => format!("more than {r} rows of {}", place.cols),
        };
        return Err(format!(
            "segment `{}` is {} × {} but the model's spec needs {need}",
            seg.name, seg.rows, seg.cols
        ));
    }
    let fits = match (place.what, seg.kind, seg.encoding) {
        (Holds::Vector, SegmentKind::Tensor, e) => e == Encoding::F32,
        (Holds::Matrix, SegmentKind::Tensor, Encoding::Format(d)) => {
            seg.cols.is_multiple_of(d.block_len())
        }
        (Holds::Bundles(parts, enc), SegmentKind::Bundles { parts: p }, e) => {
            parts == p && e == enc
        }
        _ => false,
    };
    if !fits {
        return Err(format!(
            "segment `{}` holds {:?} in {}, which is not how this store keeps it",
            seg.name,
            seg.kind,
            seg.encoding.name()
        ));
    }
    Ok(())
}

/// Bundles, when there are any: f16 first (what dense weights are rebuilt from), then INT8 and
/// INT4 once each, INT4 only where the hidden size is whole groups.
fn check_bundle_encodings(m: &Manifest) -> Result<(), String> {
    let e = &m.bundle_encodings;
    let well_formed = e.is_empty()
        || (e[0] == Encoding::F16
            && e[1..]
                .iter()
                .all(|x| matches!(x, Encoding::Int8 | Encoding::Int4))
            && e.iter().collect::<HashSet<_>>().len() == e.len()
            && (!e.contains(&Encoding::Int4) || m.spec.d_model.is_multiple_of(quant::INT4_GROUP)));
    if well_formed {
        Ok(())
    } else {
        let names: Vec<&str> = e.iter().map(|x| x.name()).collect();
        Err(format!(
            "bundle encodings [{}] are not f16 followed by int8 and/or int4",
            names.join(", ")
        ))
    }
}

/// No two segments of the same file over the same bytes; none of `data.bin` past `data_bytes`.
fn check_overlaps(m: &Manifest) -> Result<(), String> {
    for in_source in [false, true] {
        let mut segs: Vec<&Segment> = m
            .segments
            .iter()
            .filter(|s| s.in_source == in_source)
            .collect();
        segs.sort_by_key(|s| s.offset);
        for pair in segs.windows(2) {
            if pair[0].offset.saturating_add(pair[0].bytes) > pair[1].offset {
                return Err(format!(
                    "segments `{}` and `{}` overlap",
                    pair[0].name, pair[1].name
                ));
            }
        }
        if let (false, Some(last)) = (in_source, segs.last())
            && last.offset.saturating_add(last.bytes) > m.data_bytes
        {
            return Err(format!(
                "segment `{}` runs past the {} bytes of data the manifest declares",
                last.name, m.data_bytes
            ));
        }
    }
    Ok(())
}

/// The checksum of a tokenizer file against the manifest's record of it.
pub(super) fn check_file(dir: &Path, f: &FileChecksum) -> Result<(), StoreError> {
    let path = dir.join(&f.name);
    if f.name.contains('/') || f.name.starts_with('.') {
        return Err(StoreError::Format {
            path,
            msg: "not a file name of the store directory".into(),
        });
    }
    let meta = std::fs::metadata(&path).map_err(|e| StoreError::io(&path, e))?;
    let limit = crate::limits::MAX_FILE_READ_BYTES;
    if !limit.admits(meta.len()) {
        return Err(StoreError::Format {
            path,
            msg: limit.refuse("the tokenizer file's size", meta.len()),
        });
    }
    if meta.len() != f.bytes {
        return Err(StoreError::Format {
            path,
            msg: format!(
                "{} bytes, the manifest says {}: the store is damaged; convert the model again",
                meta.len(),
                f.bytes
            ),
        });
    }
    let bytes = std::fs::read(&path).map_err(|e| StoreError::io(&path, e))?;
    let actual = format!("{:016x}", xxh3_64(&bytes));
    if actual != f.xxh3 {
        return Err(StoreError::Format {
            path,
            msg: format!(
                "fails its checksum (recorded {}, read {actual}): the store is damaged; convert the model again",
                f.xxh3
            ),
        });
    }
    Ok(())
}

/// `name`'s size and checksum, to record in the manifest.
pub(super) fn file_checksum(dir: &Path, name: &str) -> Result<FileChecksum, StoreError> {
    let path = dir.join(name);
    let bytes = std::fs::read(&path).map_err(|e| StoreError::io(&path, e))?;
    Ok(FileChecksum {
        name: name.to_string(),
        bytes: bytes.len() as u64,
        xxh3: format!("{:016x}", xxh3_64(&bytes)),
    })
}
