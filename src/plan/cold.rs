//! What a layer's FFN neurons cost, hot on the device or cold on the CPU, as the sparse modes
//! (hybrid execution, cache units) place them: [`ColdCost`], what the CPU reads for cold
//! neurons per token, and the layer's FFN layout as stored (bundles, or block-quantized
//! matrices placed in whole down blocks), with the device bytes its hot share takes the way the
//! sources allocate them. What [`crate::tier::cold`] carries out.
//!
//! Reads the manifest only; fails where a segment is missing or the FFN's shape does not split
//! into whole blocks.

use serde::Serialize;

use crate::backend::cpu::sparse::{TILE_NEURONS, tileable};
use crate::footprint::{DEVICE_ALIGN, device_bytes};
use crate::store::{Manifest, Segment, SegmentKind, names};
use crate::tensor::{DType, QK};

use super::budget::PlanError;
use super::manifest::{device_dtype, part_segment_name, seg};
use super::preserve::Part;

/// What the CPU reads for a layer's cold neurons, per token: every candidate neuron's deciding
/// vector (the gate, or the up row without a gate), the rest of each neuron that turns out active
/// and, for block-format down matrices, every down block (a unit, all `d_model` rows) holding an
/// active neuron.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct ColdCost {
    pub decide_bytes: u64,
    pub active_bytes: u64,
    pub unit_bytes: u64,
    /// Neurons per unit (1 for bundles).
    pub unit: usize,
    /// Whether the cold neurons are laid out in tiles of four
    /// ([`crate::backend::cpu::sparse::NeuronTiles`]), read whole wherever one of their neurons
    /// is on. The bytes above stay what the neurons need: a tile's rows that are off come with
    /// it, but no bound counts them.
    pub tiled: bool,
}

impl ColdCost {
    /// Of bundles of `row` bytes in `parts` parts, read as rows: the first part decides, the
    /// rest follows for an active neuron.
    pub fn of_bundles(row: u64, parts: u64) -> Self {
        let part = row / parts;
        ColdCost {
            decide_bytes: part,
            active_bytes: row - part,
            unit_bytes: 0,
            unit: 1,
            tiled: false,
        }
    }

    /// Bytes read for `candidates` neurons examined, `active` of them computed, `units` down
    /// blocks touched.
    pub fn bytes(&self, candidates: u64, active: u64, units: u64) -> u64 {
        self.decide_bytes * candidates + self.active_bytes * active + self.unit_bytes * units
    }
}

/// Bytes of a bundle part from which the hybrid source takes gated float bundles apart.
///
/// The CPU's pass ([`crate::backend::cpu::sparse::sparse_ffn`]) reads each group of four
/// neurons' parts side by side: taken apart, the group's gates are one run, and so are its ups
/// and downs where all are on; whole, each bundle is a run of its own. On Zen 4 (2 threads,
/// f16, layers well beyond the caches) whole bundles read 8–10% faster with 1,152-byte parts
/// (SmolLM2, 10–84% of neurons on), 2–10% with 1,536; level at 2,048; apart 10–13% faster with
/// 4,096 and 8,192 (the 1B and 7B shapes, 10–84% on).
pub const APART_FROM_PART_BYTES: u64 = 2048;

/// How much faster the CPU reads cold neurons laid out in tiles than as rows (whole bundles or
/// parts taken apart), taken low: a layer goes in tiles where the tiles it is expected to read
/// come to at most this many times the bytes its neurons need. On the 2-core VM (30 SmolLM2
/// layers of 1,536 f16 neurons, each on with a share p, the engine's one pass, 2 threads, out of
/// tree, tiles and whole bundles alternated): p = 0.84 (tiles 1.12× the bytes needed)
/// 4.06–4.28 ms in tiles against 4.95–5.01; p = 0.7 (1.24×) 4.32–4.60 against 4.71–4.77;
/// p = 0.5 (1.44×) 4.80–6.09 against 4.22–5.02; p = 0.27 (1.6×) 6.3 against 4.3–4.5.
pub const TILES_READ_FASTER: f64 = 1.25;

/// Whether the hybrid source takes a layer's cold bundles `s` (of `parts` parts) apart on the
/// CPU: gated bundles in a float format with parts of [`APART_FROM_PART_BYTES`] or more, every
/// gate then in one matrix, every up in another, every down in a third.
pub fn cold_taken_apart(s: &Segment, parts: usize) -> bool {
    parts == 3
        && !device_dtype(s).is_quantized()
        && s.row_bytes() as u64 / parts as u64 >= APART_FROM_PART_BYTES
}

/// A layer's FFN as stored, for placement.
pub(super) struct FfnLayout {
    /// Bytes of one unit of neurons on the device.
    pub(super) unit_bytes: u64,
    pub(super) cost: ColdCost,
    /// Device tensors its hot share takes (each rounded to the granule).
    tensors: u64,
    /// Bundles: bytes of one neuron; matrices: (gate row, up row, down format, up bias).
    kind: FfnKind,
}

enum FfnKind {
    Bundles {
        row_bytes: u64,
        /// Gated float bundles of wide parts, which the hybrid source takes apart on the CPU
        /// (every gate in one matrix, every up in another, every down in a third:
        /// [`cold_taken_apart`]).
        parted: bool,
        /// Gated f16 bundles whose width the tiles take
        /// ([`crate::backend::cpu::sparse::tileable`]).
        tileable: bool,
    },
    Matrices {
        gate_row: u64,
        up_row: u64,
        down: DType,
        d_model: usize,
        up_bias: bool,
    },
}

impl FfnLayout {
    /// Layer `l`'s FFN as `m` stores it.
    pub(super) fn of(m: &Manifest, l: usize) -> Result<Self, PlanError> {
        let spec = &m.spec;
        let (d, d_ff) = (spec.d_model, spec.d_ff);
        if let Some(s) = m.segment(&part_segment_name(l, Part::Ffn)) {
            let SegmentKind::Bundles { parts } = s.kind else {
                return Err(PlanError::Store(format!("`{}` is not bundles", s.name)));
            };
            return Ok(FfnLayout::bundles(
                (s.row_bytes() as u64, parts as u64),
                cold_taken_apart(s, parts),
                tileable(device_dtype(s), parts, d),
            ));
        }
        let up = seg(m, &part_segment_name(l, Part::Up))?;
        let down = seg(m, &part_segment_name(l, Part::Down))?;
        let gate = if spec.gated_ffn {
            Some(seg(m, &part_segment_name(l, Part::Gate))?)
        } else {
            None
        };
        let Some(down_dtype) = down.encoding.dtype() else {
            return Err(PlanError::Store(format!("`{}` is not a matrix", down.name)));
        };
        let unit = down_dtype.block_len().max(QK);
        if !d_ff.is_multiple_of(unit) {
            return Err(PlanError::Store(format!(
                "d_ff {d_ff} is not a multiple of the {unit}-neuron blocks of `{}`",
                down.name
            )));
        }
        let (gate_row, up_row) = (
            gate.map_or(0, |g| g.row_bytes() as u64),
            up.row_bytes() as u64,
        );
        let down_unit = (d * down_dtype.bytes_for(unit)) as u64;
        let up_bias = m.segment(&names::layer(l, "ffn_up.bias")).is_some();
        Ok(FfnLayout {
            unit_bytes: unit as u64 * (gate_row + up_row) + down_unit,
            cost: ColdCost {
                decide_bytes: if gate.is_some() { gate_row } else { up_row },
                active_bytes: if gate.is_some() { up_row } else { 0 },
                unit_bytes: down_unit,
                unit,
                tiled: false,
            },
            tensors: 2 + gate.is_some() as u64 + up_bias as u64,
            kind: FfnKind::Matrices {
                gate_row,
                up_row,
                down: down_dtype,
                d_model: d,
                up_bias,
            },
        })
    }

    /// Bundles of `row` bytes in `parts` parts (the first decides), taken apart on the CPU
    /// (`parted`) or not, which tiles can hold (`tileable`) or not.
    fn bundles((row, parts): (u64, u64), parted: bool, tileable: bool) -> Self {
        FfnLayout {
            unit_bytes: row,
            cost: ColdCost::of_bundles(row, parts),
            tensors: 1,
            kind: FfnKind::Bundles {
                row_bytes: row,
                parted,
                tileable,
            },
        }
    }

    /// Reads (each of one place: [`super::HardwareProfile::cpu_read_start_s`]) of the CPU's
    /// cold pass over `candidates` neurons examined (`all`: every cold neuron, else those a
    /// predictor names), `active` of them computed and `units` down blocks, as the hybrid
    /// source lays the cold neurons out and its one pass reads them: gated float bundles taken
    /// apart (every gate one run where all are examined, else a read each; an up and a down
    /// row per active neuron), other bundles whole (a read per candidate, the rest of an active
    /// one following), matrices gathered (the deciding rows likewise; an up row per active
    /// neuron where gated; a read per down block).
    pub(super) fn cold_reads(
        &self,
        (candidates, all): (f64, bool),
        active: f64,
        units: f64,
    ) -> f64 {
        let deciding = if all { 0.0 } else { candidates };
        match self.kind {
            FfnKind::Bundles { parted: true, .. } => deciding + 2.0 * active,
            FfnKind::Bundles { parted: false, .. } => candidates,
            FfnKind::Matrices { gate_row, .. } => {
                deciding + if gate_row > 0 { active } else { 0.0 } + units
            }
        }
    }

    /// Whether its cold neurons go in tiles: bundles the tiles take, whose tiles (each read
    /// whole, its gates always and the rest with `tile_on`, the chance one of its neurons is
    /// on) are expected to come to at most [`TILES_READ_FASTER`] times `needed_bytes`, what the
    /// neurons need read as rows.
    pub(super) fn tiles_pay(&self, tile_on: impl Iterator<Item = f64>, needed_bytes: f64) -> bool {
        let FfnKind::Bundles { tileable: true, .. } = self.kind else {
            return false;
        };
        let c = self.cost;
        let tiles: f64 = tile_on
            .map(|on| TILE_NEURONS as f64 * (c.decide_bytes as f64 + c.active_bytes as f64 * on))
            .sum();
        tiles <= TILES_READ_FASTER * needed_bytes
    }

    /// Whether the device's kernels can read a listed subset of its hot neurons (bundles: one
    /// neuron a unit), rather than every one of them masked (matrices).
    pub(super) fn reads_listed(&self) -> bool {
        matches!(self.kind, FfnKind::Bundles { .. })
    }

    /// Device bytes of `hot` neurons' tensors, as the hybrid source allocates them.
    pub(super) fn device_bytes(&self, hot: usize) -> u64 {
        if hot == 0 {
            return 0;
        }
        let h = hot as u64;
        match self.kind {
            FfnKind::Bundles { row_bytes, .. } => device_bytes(h * row_bytes),
            FfnKind::Matrices {
                gate_row,
                up_row,
                down,
                d_model,
                up_bias,
            } => {
                (if gate_row > 0 {
                    device_bytes(h * gate_row)
                } else {
                    0
                }) + device_bytes(h * up_row)
                    + device_bytes((d_model * down.bytes_for(hot)) as u64)
                    + if up_bias { device_bytes(h * 4) } else { 0 }
            }
        }
    }
}

/// Device bytes of layer `l`'s `hot` neurons as the hybrid source allocates them.
pub(super) fn hot_device_bytes(m: &Manifest, l: usize, hot: usize) -> Result<u64, PlanError> {
    Ok(FfnLayout::of(m, l)?.device_bytes(hot))
}

/// Room kept for the hot tensors' rounding to the granule, so the ILP's raw bytes always fit
/// once rounded.
pub(super) fn hot_rounding(layouts: &[FfnLayout]) -> u64 {
    layouts.iter().map(|f| f.tensors * DEVICE_ALIGN).sum()
}

/// What a layer's activation predictor costs and decides (`--sparsity predicted`): the host
/// reads its f32 weights and multiplies them every step, and the neurons it names are the ones
/// examined and computed, in place of every neuron's deciding vector and the threshold's mask.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct PredictorCost {
    /// Bytes of its weights, read once a step.
    pub weight_bytes: u64,
    /// Its multiply-adds ×2 per row.
    pub flops: f64,
    /// Share of the truly active neurons it names, on the profile's held-out tokens.
    pub recall: f64,
    /// Share of the inactive neurons it names all the same.
    pub false_on: f64,
    /// Share of all neurons it names.
    pub predicted_share: f64,
}

impl PredictorCost {
    /// Layer `l`'s predictor in `profile`, if it has one.
    pub fn of(profile: &crate::sparsity::SparsityProfile, l: usize) -> Option<Self> {
        let p = profile.predictors.get(l)?;
        let q = profile
            .predictor_quality
            .get(l)
            .copied()
            .unwrap_or_default();
        let params = p.parameters() as u64;
        // Of the neurons it names, those active are recall × active; the rest were off.
        let off = 1.0 - q.active_share;
        let false_on = if off > 0.0 {
            ((q.predicted_share - q.recall * q.active_share) / off).clamp(0.0, 1.0)
        } else {
            0.0
        };
        Some(PredictorCost {
            weight_bytes: params * 4,
            flops: 2.0 * params as f64,
            recall: q.recall,
            false_on,
            predicted_share: q.predicted_share,
        })
    }

    /// Every layer's, where the profile has a predictor for each (else none).
    pub fn all(profile: &crate::sparsity::SparsityProfile) -> Option<Vec<Self>> {
        (0..profile.n_layers)
            .map(|l| Self::of(profile, l))
            .collect()
    }

    /// Every layer's predictors together (none where there are none): all their weights'
    /// bytes, the mean share of neurons they name and their mean held-out recall.
    pub fn summary(p: &[Self]) -> Option<(u64, f64, f64)> {
        if p.is_empty() {
            return None;
        }
        let n = p.len() as f64;
        let mean = |f: fn(&Self) -> f64| p.iter().map(f).sum::<f64>() / n;
        Some((
            p.iter().map(|x| x.weight_bytes).sum(),
            mean(|x| x.predicted_share),
            mean(|x| x.recall),
        ))
    }

    /// The chance it names a neuron active with frequency `f`.
    pub fn names(&self, f: f64) -> f64 {
        (self.recall * f + self.false_on * (1.0 - f)).clamp(0.0, 1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sparsity::SparsityProfile;
    use crate::sparsity::predictor::{Predictor, PredictorQuality};

    /// Tiles pay where most cold neurons are on, not where few are, and only for bundles the
    /// tiles take.
    #[test]
    fn tiles_pay_where_most_neurons_are_on() {
        let (d, row) = (576u64, 3 * 576 * 2);
        let lay = |tileable| FfnLayout::bundles((row, 3), false, tileable);
        // 1,536 cold neurons, each on with `p`, independently.
        let pays = |tileable, p: f64| {
            let needed = 1536.0 * (d * 2) as f64 + 1536.0 * p * (2 * d * 2) as f64;
            let on = 1.0 - (1.0 - p).powi(TILE_NEURONS as i32);
            lay(tileable).tiles_pay(std::iter::repeat_n(on, 1536 / TILE_NEURONS), needed)
        };
        assert!(pays(true, 0.84));
        assert!(pays(true, 0.7));
        assert!(!pays(true, 0.5));
        assert!(!pays(true, 0.27));
        assert!(!pays(false, 0.84));
    }

    /// A predictor's cost from the profile: its weights' bytes and products from its shape, the
    /// neurons it names from its held-out quality (all the active ones it recalls, and of the
    /// inactive ones as many as make up its predicted share); none without predictors.
    #[test]
    fn a_predictor_costs_its_weights_and_names_what_it_predicts() {
        let mut p = SparsityProfile {
            model_id: "m".into(),
            corpus: "test".into(),
            tokens: 0,
            window: 0,
            n_layers: 2,
            d_ff: 100,
            thresholds: Vec::new(),
            measured: Vec::new(),
            frequency: Vec::new(),
            predictor_target: None,
            predictors: Vec::new(),
            predictor_quality: Vec::new(),
            unit_reuse: None,
        };
        assert_eq!(PredictorCost::all(&p), None);
        let (d, rank, neurons) = (16, 4, 100);
        p.predictors = vec![
            Predictor {
                d,
                rank,
                neurons,
                w1: Vec::new(),
                b1: Vec::new(),
                w2: Vec::new(),
                b2: Vec::new(),
                cutoff: 0.0,
            };
            2
        ];
        p.predictor_quality = vec![
            PredictorQuality {
                recall: 0.9,
                precision: 0.5,
                predicted_share: 0.36,
                active_share: 0.2,
                epochs: 3,
            };
            2
        ];
        let all = PredictorCost::all(&p).unwrap();
        assert_eq!(all.len(), 2);
        let c = all[0];
        let params = (rank * d + rank + neurons * rank + neurons) as u64;
        assert_eq!(c.weight_bytes, 4 * params);
        assert_eq!(c.flops, 2.0 * params as f64);
        // 0.36 named = 0.9 × 0.2 recalled + false_on × 0.8.
        assert!((c.false_on - 0.225).abs() < 1e-12, "{c:?}");
        assert!((c.names(1.0) - 0.9).abs() < 1e-12);
        assert!((c.names(0.0) - 0.225).abs() < 1e-12);
        // Over neurons whose frequencies average the active share, the named share is the
        // predicted share.
        let f = [0.0, 0.2, 0.4, 0.2];
        let named: f64 = f.iter().map(|&x| c.names(x)).sum::<f64>() / f.len() as f64;
        assert!((named - 0.36).abs() < 1e-12, "{named}");
        // A predictor that names every neuron.
        p.predictor_quality[1].predicted_share = 1.0;
        p.predictor_quality[1].recall = 1.0;
        assert_eq!(PredictorCost::all(&p).unwrap()[1].names(0.0), 1.0);
    }
}
