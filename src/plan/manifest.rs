//! The planner's reading of a store's manifest: which segment holds each part of a layer, the
//! layers' row shapes, the small fragments and the output matrix the device keeps, the formats
//! the device takes them in, the matrix products an offloaded step runs, and what reading rows
//! from SSD costs (page-aligned extents, start-up staging in chunks of whole checksum groups).
//!
//! Reads the manifest only: no I/O, no decisions.

use crate::footprint::{MatmulShape, MatmulShapes};
use crate::model::PositionEncoding;
use crate::store::{Encoding, GROUP_ROWS, Manifest, Segment, SegmentKind, names};
use crate::tensor::DType;

use super::budget::PlanError;
use super::preserve::{LayerShape, PARTS, Part};

/// Upper bound on one staging read (resident weights are loaded in chunks of whole groups).
pub const STAGING_CHUNK_BYTES: u64 = 64 << 20;

fn store_err(msg: String) -> PlanError {
    PlanError::Store(msg)
}

pub(super) fn seg<'a>(m: &'a Manifest, name: &str) -> Result<&'a Segment, PlanError> {
    m.segment(name)
        .ok_or_else(|| store_err(format!("segment `{name}` is missing")))
}

/// The segment of part `p` in layer `l`.
pub fn part_segment_name(l: usize, p: Part) -> String {
    match p {
        Part::Ffn => names::bundles(l, Encoding::F16),
        Part::Gate => names::layer(l, "ffn_gate.weight"),
        Part::Up => names::layer(l, "ffn_up.weight"),
        Part::Down => names::layer(l, "ffn_down.weight"),
        Part::Q => names::layer(l, "attn_q.weight"),
        Part::K => names::layer(l, "attn_k.weight"),
        Part::V => names::layer(l, "attn_v.weight"),
        Part::O => names::layer(l, "attn_output.weight"),
    }
}

/// Layer `l`'s router (a mixture-of-experts layer).
pub fn router_segment_name(l: usize) -> String {
    names::layer(l, "ffn_gate_inp.weight")
}

/// Layer `l`'s stack of every expert's gate, up or down matrix (`which`: "gate", "up", "down").
pub fn experts_segment_name(l: usize, which: &str) -> String {
    names::layer(l, &format!("ffn_{which}_exps.weight"))
}

/// Whether the store holds part `p` (the FFN is bundles or matrices; a gate only when gated). A
/// mixture-of-experts model's FFN is its experts ([`super::experts`]): no dense FFN part.
pub(super) fn holds(m: &Manifest, p: Part) -> bool {
    let bundled = !m.bundle_encodings.is_empty();
    match p {
        Part::Ffn | Part::Gate | Part::Up | Part::Down if m.spec.moe.is_some() => false,
        Part::Ffn => bundled,
        Part::Gate => !bundled && m.spec.gated_ffn,
        Part::Up | Part::Down => !bundled,
        Part::Q | Part::K | Part::V | Part::O => true,
    }
}

/// Row shape of every layer's streamable parts (the parts the store does not hold have no
/// rows). Rows are the same in every layer; formats, and so row bytes, may differ (a Q4_K_M file
/// keeps some layers' `ffn_down` and `attn_v` in Q6_K).
pub fn layer_shapes(m: &Manifest) -> Result<Vec<LayerShape>, PlanError> {
    let mut shapes: Vec<LayerShape> = Vec::with_capacity(m.spec.n_layers);
    for l in 0..m.spec.n_layers {
        let mut shape = LayerShape {
            rows: [0; PARTS],
            row_bytes: [0; PARTS],
        };
        for p in Part::ALL.into_iter().filter(|&p| holds(m, p)) {
            let s = seg(m, &part_segment_name(l, p))?;
            shape.rows[p.index()] = s.rows;
            shape.row_bytes[p.index()] = s.row_bytes() as u64;
        }
        if let Some(first) = shapes.first()
            && first.rows != shape.rows
        {
            return Err(store_err(format!(
                "layer {l} has other tensor shapes than layer 0"
            )));
        }
        shapes.push(shape);
    }
    Ok(shapes)
}

/// The shape every layer fits: each part's widest rows over the layers (what a streaming slot
/// and a DRAM buffer are sized for).
pub fn layer_shape(m: &Manifest) -> Result<LayerShape, PlanError> {
    Ok(widest(&layer_shapes(m)?))
}

pub(super) fn widest(shapes: &[LayerShape]) -> LayerShape {
    let mut w = shapes.first().copied().unwrap_or(LayerShape {
        rows: [0; PARTS],
        row_bytes: [0; PARTS],
    });
    for s in shapes {
        for (a, b) in w.row_bytes.iter_mut().zip(s.row_bytes) {
            *a = (*a).max(b);
        }
    }
    w
}

/// The format of part `p` in the layer where its rows are widest (what a slot for it is
/// allocated in, and re-typed from for each layer it holds).
pub fn widest_dtype(m: &Manifest, p: Part) -> Result<DType, PlanError> {
    let mut best = None;
    for l in 0..m.spec.n_layers {
        let s = seg(m, &part_segment_name(l, p))?;
        if best.is_none_or(|(rb, _)| s.row_bytes() > rb) {
            best = Some((s.row_bytes(), device_dtype(s)));
        }
    }
    best.map(|(_, d)| d)
        .ok_or_else(|| store_err(format!("no layer holds {}", p.name())))
}

/// Bytes of the small fragments the device holds (f32 vectors and the RoPE table), smallest
/// first (HyperGen's size-aware order; all of them are kept).
pub fn small_fragments(m: &Manifest) -> Vec<(String, u64)> {
    let mut v: Vec<(String, u64)> = m
        .segments
        .iter()
        .filter(|s| s.kind == SegmentKind::Tensor && s.rows == 1 && s.name != names::ROPE_FREQS)
        .map(|s| (s.name.clone(), s.bytes))
        .collect();
    if let PositionEncoding::Rope(r) = &m.spec.position {
        v.push(("rope.inv_freq".into(), (r.dims / 2 * 4) as u64));
    }
    v.sort_by_key(|(name, b)| (*b, name.clone()));
    v
}

/// The device's copy of the output matrix.
pub fn head_segment(m: &Manifest) -> Result<&Segment, PlanError> {
    match m.segment(names::OUTPUT) {
        Some(s) => Ok(s),
        None => seg(m, names::TOKEN_EMBD),
    }
}

/// The format a stored segment has on the device: its own (bundles are f16 on the device).
pub fn device_dtype(s: &Segment) -> DType {
    s.encoding.dtype().unwrap_or(DType::F16)
}

/// The matrices an offloaded step multiplies, in their formats: the attention projections and,
/// for a block-quantized model, the FFN matrices of every layer (a bundled FFN runs on neuron
/// bundles, no matrix product), a mixture-of-experts layer's router, and the output matrix.
pub fn offload_matmuls(m: &Manifest) -> Result<MatmulShapes, PlanError> {
    let shape = |s: &Segment| MatmulShape {
        dtype: device_dtype(s),
        rows: s.rows,
        cols: s.cols,
    };
    let mut layer: Vec<MatmulShape> = Vec::new();
    let mut experts = Vec::new();
    for l in 0..m.spec.n_layers {
        let mut names: Vec<String> = Part::ALL
            .into_iter()
            .filter(|&p| p != Part::Ffn && holds(m, p))
            .map(|p| part_segment_name(l, p))
            .collect();
        if let Some(moe) = &m.spec.moe {
            let e = crate::footprint::ExpertsShape {
                gate: device_dtype(seg(m, &experts_segment_name(l, "gate"))?),
                down: device_dtype(seg(m, &experts_segment_name(l, "down"))?),
                width: moe.d_expert,
            };
            if !experts.contains(&e) {
                experts.push(e);
            }
            names.push(router_segment_name(l));
        }
        for name in names {
            let k = shape(seg(m, &name)?);
            if !layer.contains(&k) {
                layer.push(k);
            }
        }
    }
    Ok(MatmulShapes {
        layer,
        head: shape(head_segment(m)?),
        experts,
    })
}

/// Page-aligned extent of reading `rows` of a segment: what an SSD read of them costs.
pub(super) fn extent(s: &Segment, rows: std::ops::Range<usize>) -> u64 {
    if rows.is_empty() {
        0
    } else {
        s.read_extent(rows).1
    }
}

/// The reads that load rows `rows` of `s` at start-up: runs of whole checksum groups of at most
/// [`STAGING_CHUNK_BYTES`].
pub fn staging_chunks(
    s: &Segment,
    rows: std::ops::Range<usize>,
) -> impl Iterator<Item = std::ops::Range<usize>> {
    let rb = s.row_bytes().max(1) as u64;
    let chunk = (STAGING_CHUNK_BYTES / rb / GROUP_ROWS as u64).max(1) as usize * GROUP_ROWS;
    let end = rows.end;
    rows.step_by(chunk).map(move |r| r..(r + chunk).min(end))
}

/// The staging buffer loading rows `0..rows` of `s` needs.
pub(super) fn staging_for(s: &Segment, rows: usize) -> u64 {
    staging_chunks(s, 0..rows)
        .map(|c| extent(s, c))
        .max()
        .unwrap_or(0)
}
