//! Flexible tensor preservation (FlexInfer's Algorithm 1) with balanced locking: which rows of
//! each layer's streamable tensors stay resident on the device, the same share in every layer so
//! every layer streams the same bytes.
//!
//! Order: when the per-layer budget holds the whole FFN, keep the FFN, then attention tensors one
//! by one; otherwise keep attention tensors one by one and give the FFN what is left. Under
//! grouped-query attention the small W_k and W_v come first (small tensors stream least
//! efficiently). A partly kept tensor keeps a prefix of whole checksum groups, so its streamed
//! rest can be read and verified on its own.

use serde::{Deserialize, Serialize};

use crate::store::GROUP_ROWS;

/// The streamable tensors of a layer. A store holds the FFN either as neuron bundles (`Ffn`)
/// or as its matrices (`Gate`, `Up`, `Down`); the parts it does not hold have no rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Part {
    /// FFN neuron bundles (one row per neuron).
    Ffn,
    /// FFN matrices of a block-quantized model (rows as the file holds them: neurons for gate
    /// and up, output dimensions for down).
    Gate,
    Up,
    Down,
    Q,
    K,
    V,
    O,
}

/// How many parts a layer has.
pub const PARTS: usize = 8;

impl Part {
    pub const ALL: [Part; PARTS] = [
        Part::Ffn,
        Part::Gate,
        Part::Up,
        Part::Down,
        Part::Q,
        Part::K,
        Part::V,
        Part::O,
    ];
    /// The FFN's parts, in the order tensor preservation keeps them.
    pub const FFN: [Part; 4] = [Part::Ffn, Part::Gate, Part::Up, Part::Down];
    /// Attention's matrices.
    pub const ATTENTION: [Part; 4] = [Part::Q, Part::K, Part::V, Part::O];

    pub fn index(self) -> usize {
        match self {
            Part::Ffn => 0,
            Part::Gate => 1,
            Part::Up => 2,
            Part::Down => 3,
            Part::Q => 4,
            Part::K => 5,
            Part::V => 6,
            Part::O => 7,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Part::Ffn => "ffn",
            Part::Gate => "ffn_gate",
            Part::Up => "ffn_up",
            Part::Down => "ffn_down",
            Part::Q => "wq",
            Part::K => "wk",
            Part::V => "wv",
            Part::O => "wo",
        }
    }
}

/// Rows and row size of each part (identical in every layer).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerShape {
    pub rows: [usize; PARTS],
    pub row_bytes: [u64; PARTS],
}

impl LayerShape {
    pub fn bytes(&self, p: Part) -> u64 {
        self.rows[p.index()] as u64 * self.row_bytes[p.index()]
    }

    pub fn total(&self) -> u64 {
        Part::ALL.iter().map(|&p| self.bytes(p)).sum()
    }
}

/// Rows of each part kept resident in every layer (a prefix); of the others, the last
/// `cpu_rows` FFN neurons (bundles) of every layer are computed by the CPU from DRAM and the rest
/// stream.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Residency {
    pub rows: [usize; PARTS],
    #[serde(default)]
    pub cpu_rows: usize,
    /// Hybrid execution with streamed attention: every FFN row off the device, neither
    /// resident nor streamed (the hot neurons are placed apart, the CPU computes the others).
    #[serde(default)]
    pub ffn_off: bool,
}

impl Residency {
    pub fn all(shape: &LayerShape) -> Self {
        Residency {
            rows: shape.rows,
            cpu_rows: 0,
            ffn_off: false,
        }
    }

    /// The rows of part `p` the CPU computes.
    pub fn cpu_rows_of(&self, shape: &LayerShape, p: Part) -> std::ops::Range<usize> {
        let rows = shape.rows[p.index()];
        match p {
            _ if self.ffn_off && Part::FFN.contains(&p) => 0..rows,
            Part::Ffn => rows - self.cpu_rows.min(rows)..rows,
            _ => rows..rows,
        }
    }

    pub fn cpu_bytes(&self, shape: &LayerShape) -> u64 {
        Part::FFN
            .iter()
            .map(|&p| self.cpu_rows_of(shape, p).len() as u64 * shape.row_bytes[p.index()])
            .sum()
    }

    pub fn resident_bytes(&self, shape: &LayerShape) -> u64 {
        Part::ALL
            .iter()
            .map(|&p| self.rows[p.index()] as u64 * shape.row_bytes[p.index()])
            .sum()
    }

    pub fn streamed_bytes(&self, shape: &LayerShape) -> u64 {
        shape.total() - self.resident_bytes(shape) - self.cpu_bytes(shape)
    }

    /// The streamed rows of part `p`.
    pub fn streamed_rows(&self, shape: &LayerShape, p: Part) -> std::ops::Range<usize> {
        self.rows[p.index()]..self.cpu_rows_of(shape, p).start.max(self.rows[p.index()])
    }
}

/// Keep as many rows of `p` as `left` allows: all of them, or whole checksum groups.
fn keep(shape: &LayerShape, p: Part, left: &mut u64, res: &mut Residency) {
    let (rows, rb) = (shape.rows[p.index()], shape.row_bytes[p.index()]);
    if rb == 0 {
        return;
    }
    let fit = (*left / rb).min(rows as u64) as usize;
    let take = if fit == rows {
        rows
    } else {
        fit / GROUP_ROWS * GROUP_ROWS
    };
    res.rows[p.index()] = take;
    *left -= take as u64 * rb;
}

/// Algorithm 1: the residency that fits `per_layer_budget` bytes in every layer.
pub fn preserve(shape: &LayerShape, per_layer_budget: u64, grouped_query: bool) -> Residency {
    let attention = if grouped_query {
        [Part::K, Part::V, Part::Q, Part::O]
    } else {
        Part::ATTENTION
    };
    let mut res = Residency::default();
    let mut left = per_layer_budget;
    let ffn_bytes: u64 = Part::FFN.iter().map(|&p| shape.bytes(p)).sum();
    if left >= ffn_bytes {
        for p in Part::FFN.into_iter().chain(attention) {
            keep(shape, p, &mut left, &mut res);
        }
    } else {
        for p in attention.into_iter().chain(Part::FFN) {
            keep(shape, p, &mut left, &mut res);
        }
    }
    res
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 7B-like layer: FFN 11008 neurons × 24 KiB, four 4096×4096 f16 attention matrices
    /// (K, V small under GQA).
    fn shape(gqa: bool) -> LayerShape {
        let kv_rows = if gqa { 1024 } else { 4096 };
        LayerShape {
            rows: [11008, 0, 0, 0, 4096, kv_rows, kv_rows, 4096],
            row_bytes: [3 * 4096 * 2, 0, 0, 0, 8192, 8192, 8192, 8192],
        }
    }

    #[test]
    fn ffn_first_when_it_fits_then_attention_in_order() {
        let s = shape(false);
        let ffn = s.bytes(Part::Ffn);
        let r = preserve(&s, ffn + s.bytes(Part::Q) + 100 * 8192, false);
        assert_eq!(r.rows[Part::Ffn.index()], 11008);
        assert_eq!(r.rows[Part::Q.index()], 4096);
        assert_eq!(r.rows[Part::K.index()], 64, "partial K keeps whole groups");
        assert_eq!(r.rows[Part::V.index()], 0);
    }

    #[test]
    fn small_budget_keeps_attention_then_ffn_share() {
        let s = shape(true);
        // Room for K and V (GQA: 1024 rows each) and some FFN neurons.
        let kv = s.bytes(Part::K) + s.bytes(Part::V);
        let r = preserve(&s, kv + 200 * 3 * 4096 * 2 - 1, true);
        assert_eq!(
            (r.rows[Part::K.index()], r.rows[Part::V.index()]),
            (1024, 1024)
        );
        // Q does not fit whole; a prefix of groups is kept before the FFN gets the rest.
        let q = r.rows[Part::Q.index()];
        assert!(q > 0 && q.is_multiple_of(GROUP_ROWS) && q < 4096, "{q}");
        assert!(r.resident_bytes(&s) <= kv + 200 * 3 * 4096 * 2);
    }

    /// A block-quantized layer: the FFN as three matrices (Q4_0: 18 bytes per 32 values).
    #[test]
    fn ffn_matrices_are_kept_together_first() {
        let (d, ff) = (4096usize, 11008usize);
        let s = LayerShape {
            rows: [0, ff, ff, d, d, d, d, d],
            row_bytes: [
                0,
                (d / 32 * 18) as u64,
                (d / 32 * 18) as u64,
                (ff / 32 * 18) as u64,
                (d / 32 * 18) as u64,
                (d / 32 * 18) as u64,
                (d / 32 * 18) as u64,
                (d / 32 * 18) as u64,
            ],
        };
        let ffn: u64 = Part::FFN.iter().map(|&p| s.bytes(p)).sum();
        let r = preserve(&s, ffn, false);
        for p in [Part::Gate, Part::Up, Part::Down] {
            assert_eq!(r.rows[p.index()], s.rows[p.index()], "{p:?}");
        }
        assert_eq!(r.rows[Part::Q.index()], 0);
        // Less than the FFN: attention first, then gate, up, down in order.
        let r = preserve(&s, s.bytes(Part::Q) * 4 + s.bytes(Part::Gate), false);
        assert_eq!(r.rows[Part::O.index()], d);
        assert_eq!(r.rows[Part::Gate.index()], ff);
        assert_eq!(r.rows[Part::Down.index()], 0);
    }

    #[test]
    fn whole_layer_and_nothing() {
        let s = shape(true);
        assert_eq!(preserve(&s, s.total(), true), Residency::all(&s));
        assert_eq!(preserve(&s, 0, true).resident_bytes(&s), 0);
    }

    #[test]
    fn never_over_budget() {
        let s = shape(true);
        for budget in (0..s.total()).step_by(7_777_777) {
            let r = preserve(&s, budget, true);
            assert!(r.resident_bytes(&s) <= budget);
            for p in Part::ALL {
                let rows = r.rows[p.index()];
                assert!(rows == s.rows[p.index()] || rows.is_multiple_of(GROUP_ROWS));
            }
        }
    }
}
