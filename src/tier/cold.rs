//! Cold neurons: a layer's FFN neurons held in DRAM and computed by the CPU for the tokens that
//! need them ([`ColdLayer`]), as the split, hybrid execution and the hybrid layers of cache units
//! all run them; and what the CPU has read for them ([`ColdTraffic`]), counted as the plan's
//! cost model counts it ([`ColdCost`]).
//!
//! Per call the CPU reads each candidate neuron's deciding vector (the gate, or the up row of a
//! two-part FFN), applies the activation and the mask, and reads the rest only of the neurons
//! left on; a block-quantized down matrix is read in whole blocks. Where the plan expects most
//! of a layer's cold neurons on ([`ColdCost::tiled`]), its gated f16 bundles lie in tiles of
//! four, and a tile with any neuron on is read whole as one run (its off rows' lines come with
//! it; only the neurons' own bytes are counted). Bundles also serve cache units as the DRAM copy
//! their misses are gathered from.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::backend::BundleShape;
use crate::backend::cpu::kernels::Kernels;
use crate::backend::cpu::sparse::{
    Bundles, FfnParts, NeuronTiles, sparse_decide_up, sparse_down, sparse_down_blocks, sparse_ffn,
    sparse_part_dots, sparse_rows, tile_bundles, tiled_down, tiled_ffn,
};
use crate::backend::sparse_act;
use crate::engine::trace::{self, Phase, span};
use crate::engine::{ColdActive, ColdNeurons, EngineError, Result};
use crate::footprint::ledger::{Ledger, Reservation, Tier};
use crate::plan::cold::ColdCost;
use crate::plan::{Part, device_dtype, part_segment_name};
use crate::store::{SegmentKind, Store, StoreError, names};
use crate::tensor::{Bytes, DType, HostTensor};

fn store_err(e: StoreError) -> EngineError {
    EngineError::Weights(e.to_string())
}

fn weights_err(e: impl std::fmt::Display) -> EngineError {
    EngineError::Weights(e.to_string())
}

/// What the CPU has read for cold neurons, summed over every layer and call.
#[derive(Debug, Default)]
pub struct ColdTraffic {
    pub bytes: AtomicU64,
    /// Neurons examined (their deciding vector read).
    pub candidates: AtomicU64,
    /// Neurons computed.
    pub active: AtomicU64,
    /// Down blocks read (block-format FFNs).
    pub units: AtomicU64,
}

impl ColdTraffic {
    fn add(&self, cost: &ColdCost, candidates: usize, active: usize, units: usize) {
        let (c, a, u) = (candidates as u64, active as u64, units as u64);
        let bytes = cost.bytes(c, a, u);
        trace::add_cpu_bytes(bytes);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        self.candidates.fetch_add(c, Ordering::Relaxed);
        self.active.fetch_add(a, Ordering::Relaxed);
        self.units.fetch_add(u, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> [u64; 4] {
        [
            self.bytes.load(Ordering::Relaxed),
            self.candidates.load(Ordering::Relaxed),
            self.active.load(Ordering::Relaxed),
            self.units.load(Ordering::Relaxed),
        ]
    }
}

/// The parts of a layer's cold FFN.
pub(super) enum ColdData {
    /// Gathered bundles (f16), `ids.len()` rows.
    Bundles { t: HostTensor, shape: BundleShape },
    /// Gathered gated bundles taken apart (hybrid's cold neurons), `ids.len()` rows each: every
    /// gate in one matrix, every up in another, every down in a third. Each pass then reads
    /// runs of whole rows: out of whole bundles the gates came at half the rate (1,152 of
    /// every 3,456 bytes on SmolLM2: the hardware prefetchers restart at every row), and each
    /// thread's half of a down row sat 2,304 bytes from the next while up and down were kept
    /// side by side.
    Parted {
        gates: HostTensor,
        ups: HostTensor,
        downs: HostTensor,
    },
    /// Gathered gated f16 bundles laid out in tiles of four (hybrid's cold neurons where most
    /// are on: [`ColdCost::tiled`]), `ids.len()` neurons: a tile is read as one run.
    Tiled {
        tiles: Bytes,
        neurons: usize,
        d: usize,
    },
    /// Gathered gate and up rows; the down matrix's blocks of the cold units, row by row.
    Matrices {
        gate: Option<HostTensor>,
        up: HostTensor,
        down: HostTensor,
    },
}

/// One layer's cold neurons in DRAM and how the CPU computes them.
pub struct ColdLayer {
    data: ColdData,
    /// Neuron id of each cold position.
    ids: Vec<u32>,
    /// The up bias of each cold position (two-part bundles and biased up matrices).
    up_bias: Option<Vec<f32>>,
    d_ff: usize,
    act: fn(f32) -> f32,
    kernels: &'static Kernels,
    cost: ColdCost,
    traffic: Arc<ColdTraffic>,
    _hold: Option<Reservation>,
}

impl ColdLayer {
    /// The cold neurons `ids` of a layer of `d_ff` gathered into `data` (held by `hold`), with
    /// their up biases, computed by `cpu` at `cost` per neuron.
    pub(super) fn gathered(
        data: ColdData,
        up_bias: Option<Vec<f32>>,
        ids: Vec<u32>,
        d_ff: usize,
        cost: ColdCost,
        cpu: CpuSide,
        hold: Option<Reservation>,
    ) -> Self {
        ColdLayer {
            data,
            up_bias,
            ids,
            d_ff,
            act: cpu.act,
            kernels: cpu.kernels,
            cost,
            traffic: cpu.traffic,
            _hold: hold,
        }
    }

    /// The bytes of every layer's cold neurons in `layers`, gathered one layer at a time, moved
    /// into one buffer on transparent huge pages ([`Bytes::pack_huge`]). The CPU reads them a few
    /// rows at a time: on 4 KiB pages every few rows began with a TLB miss (SmolLM2's 30 layers,
    /// 1,536 f16 neurons each in three 1.8 MB matrices, each too small to hold a huge page
    /// alone: 142 MB of rows at 84% on, two threads, 21–23 GB/s on 4 KiB pages against 28–33
    /// packed). Only what [`layer_ffn`](super::hybrid) gathered: nothing maps these buffers
    /// for a device.
    pub(super) fn pack_gathered<'l>(layers: impl IntoIterator<Item = &'l mut ColdLayer>) {
        let mut items: Vec<&mut Bytes> = Vec::new();
        for layer in layers {
            match &mut layer.data {
                ColdData::Bundles { t, .. } => items.push(&mut t.data),
                ColdData::Tiled { tiles, .. } => items.push(tiles),
                ColdData::Parted { gates, ups, downs } => {
                    items.extend([&mut gates.data, &mut ups.data, &mut downs.data])
                }
                ColdData::Matrices { gate, up, down } => {
                    items.extend(gate.as_mut().map(|g| &mut g.data));
                    items.extend([&mut up.data, &mut down.data]);
                }
            }
        }
        Bytes::pack_huge(&mut items);
    }

    /// The FFN bundles `rows` (whole checksum groups from the first, to the last row) of layer
    /// `l`, read into DRAM (reserved) for the CPU: the neurons a split plan computes there.
    pub(super) fn bundle_rows(
        store: &Store,
        ledger: &Arc<Ledger>,
        l: usize,
        rows: std::ops::Range<usize>,
        cpu: CpuSide,
    ) -> Result<Self> {
        let s = store
            .require(&part_segment_name(l, Part::Ffn))
            .map_err(store_err)?;
        let SegmentKind::Bundles { parts } = s.kind else {
            return Err(weights_err(format!("`{}` is not bundles", s.name)));
        };
        let (_, extent) = s.read_extent(rows.clone());
        let hold = ledger
            .reserve(Tier::Dram, extent, &format!("CPU neurons of layer {l}"))
            .map_err(weights_err)?;
        let mut buf = crate::tensor::AlignedBuf::zeroed(extent as usize);
        let (first, _) = store
            .read_rows_into(s, rows.clone(), &mut buf)
            .map_err(store_err)?;
        let rb = s.row_bytes();
        // Kept in its page-aligned buffer, not copied: the device may map it to read in place
        // (a cache unit's misses).
        let bytes = Bytes::Aligned {
            buf: Arc::new(buf),
            range: first..first + rows.len() * rb,
        };
        let up_bias = store
            .opt_tensor(&names::layer(l, "ffn_up.bias"))
            .map_err(store_err)?
            .map(|t| t.to_f32()[rows.clone()].to_vec());
        let row = rb as u64;
        Ok(ColdLayer {
            data: ColdData::Bundles {
                t: HostTensor {
                    name: format!("{} cpu", s.name),
                    rows: rows.len(),
                    cols: s.cols,
                    dtype: device_dtype(s),
                    data: bytes,
                },
                shape: BundleShape {
                    parts,
                    d: store.manifest.spec.d_model,
                },
            },
            ids: (rows.start as u32..rows.end as u32).collect(),
            up_bias,
            d_ff: store.manifest.spec.d_ff,
            act: cpu.act,
            kernels: cpu.kernels,
            cost: ColdCost::of_bundles(row, parts as u64),
            traffic: cpu.traffic,
            _hold: Some(hold),
        })
    }

    /// The neuron ids of cold positions `positions`.
    fn ids_of(&self, positions: &[u32]) -> Vec<u32> {
        positions.iter().map(|&p| self.ids[p as usize]).collect()
    }

    /// Cold positions some token may need (all without a predictor).
    fn candidates(&self, n: usize, keep: Option<&[bool]>) -> Vec<u32> {
        let d_ff = self.d_ff;
        (0..self.ids.len() as u32)
            .filter(|&j| {
                keep.is_none_or(|k| {
                    let id = self.ids[j as usize] as usize;
                    (0..n).any(|t| k[t * d_ff + id])
                })
            })
            .collect()
    }

    /// The neuron ids any of the `n` rows of `x` activates (as [`ColdNeurons::activate`]
    /// decides: the deciding vector read for every candidate `keep` lists, the mask applied),
    /// ascending; bundled layers only. Counted as candidates examined, none computed.
    pub(super) fn active_ids(
        &self,
        x: &[f32],
        n: usize,
        threshold: f32,
        keep: Option<&[bool]>,
    ) -> Result<Vec<u32>> {
        let ColdData::Bundles { t, shape } = &self.data else {
            return Err(weights_err(
                "cache units hold neuron bundles: this FFN is stored as matrices",
            ));
        };
        let b = Bundles::from_host(t, *shape)?;
        let cand = self.candidates(n, keep);
        let mut dec = vec![0f32; n * cand.len()];
        sparse_part_dots(self.kernels, &b, &cand, 0, x, n, &mut dec)?;
        let pos = self.mask_activations(&cand, n, shape.parts == 3, threshold, keep, &mut dec);
        self.traffic.add(&self.cost, cand.len(), 0, 0);
        Ok(pos.iter().map(|&jj| self.ids[cand[jj] as usize]).collect())
    }

    /// As [`ColdLayer::active_ids`] without a predictor, with the masked activations of the
    /// neurons found (`n × ids.len()`, zero where a token leaves one off): what ranks them.
    pub(super) fn active_scored(
        &self,
        x: &[f32],
        n: usize,
        threshold: f32,
    ) -> Result<(Vec<u32>, Vec<f32>)> {
        let ColdData::Bundles { t, shape } = &self.data else {
            return Err(weights_err(
                "cache units hold neuron bundles: this FFN is stored as matrices",
            ));
        };
        let b = Bundles::from_host(t, *shape)?;
        let cand = self.candidates(n, None);
        let c = cand.len();
        let mut dec = vec![0f32; n * c];
        sparse_part_dots(self.kernels, &b, &cand, 0, x, n, &mut dec)?;
        let pos = self.mask_activations(&cand, n, shape.parts == 3, threshold, None, &mut dec);
        self.traffic.add(&self.cost, c, 0, 0);
        let ids = pos.iter().map(|&jj| self.ids[cand[jj] as usize]).collect();
        Ok((ids, select_cols(&dec, n, c, &pos)))
    }

    /// The stored bundles of neurons `ids` (held here), one after another at the start of
    /// `out`, and their up biases (two-part bundles with one) at the start of `bias`; the
    /// bytes and biases written.
    pub(super) fn gather(
        &self,
        ids: &[u32],
        out: &mut [u8],
        bias: &mut [f32],
    ) -> Result<(usize, usize)> {
        let ColdData::Bundles { t, .. } = &self.data else {
            return Err(weights_err(
                "cache units hold neuron bundles: this FFN is stored as matrices",
            ));
        };
        let rb = t.row_bytes();
        let data = t.data.as_slice();
        if out.len() < ids.len() * rb {
            return Err(weights_err(
                "the staging buffer is smaller than the neurons",
            ));
        }
        let rows = ids
            .iter()
            .map(|&id| self.position(id))
            .collect::<Result<Vec<usize>>>()?;
        copy_rows(data, rb, &rows, out);
        Ok((ids.len() * rb, self.gather_bias(ids, bias)?))
    }

    /// The up biases of neurons `ids` (held here) at the start of `bias`; how many (none
    /// without an up bias).
    pub(super) fn gather_bias(&self, ids: &[u32], bias: &mut [f32]) -> Result<usize> {
        let Some(b) = &self.up_bias else {
            return Ok(0);
        };
        if bias.len() < ids.len() {
            return Err(weights_err(
                "the staging buffer is smaller than the neurons",
            ));
        }
        for (k, &id) in ids.iter().enumerate() {
            bias[k] = b[self.position(id)?];
        }
        Ok(ids.len())
    }

    fn position(&self, id: u32) -> Result<usize> {
        self.ids
            .binary_search(&id)
            .map_err(|_| weights_err(format!("neuron {id} is not held in DRAM")))
    }

    /// The bundles held here (row `j` = neuron `ids[j]`), where the layer holds bundles.
    pub(super) fn bundles(&self) -> Option<&HostTensor> {
        match &self.data {
            ColdData::Bundles { t, .. } => Some(t),
            ColdData::Parted { .. } | ColdData::Tiled { .. } | ColdData::Matrices { .. } => None,
        }
    }

    /// Neurons in the layer (held here or not).
    pub(super) fn d_ff(&self) -> usize {
        self.d_ff
    }

    /// Whether two-part bundles here carry an up bias.
    pub(super) fn has_up_bias(&self) -> bool {
        self.up_bias.is_some()
    }

    /// `dec[t·c + j]` (the deciding dot products of the candidates) turned into the masked
    /// activations, as the dense kernels compute them; returns the positions in `cand` that
    /// are non-zero for some token.
    fn mask_activations(
        &self,
        cand: &[u32],
        n: usize,
        gated: bool,
        threshold: f32,
        keep: Option<&[bool]>,
        dec: &mut [f32],
    ) -> Vec<usize> {
        let c = cand.len();
        let mut live = vec![false; c];
        for (jj, &j) in cand.iter().enumerate() {
            for t in 0..n {
                let v = &mut dec[t * c + jj];
                *v = self.masked(j, t, *v, (gated, threshold), keep);
                live[jj] |= *v != 0.0;
            }
        }
        (0..c).filter(|&jj| live[jj]).collect()
    }

    /// The activation of held neuron `j` for token `t` from its deciding dot `v`, masked: zero
    /// where the threshold or `keep` leaves it off. Gated bundles' gate takes no bias.
    fn masked(
        &self,
        j: u32,
        t: usize,
        v: f32,
        (gated, threshold): (bool, f32),
        keep: Option<&[bool]>,
    ) -> f32 {
        let id = self.ids[j as usize] as usize;
        if keep.is_some_and(|k| !k[t * self.d_ff + id]) {
            return 0.0;
        }
        let bias = if gated {
            0.0
        } else {
            self.up_bias.as_ref().map_or(0.0, |b| b[j as usize])
        };
        sparse_act((self.act)(v + bias), threshold)
    }

    /// [`ColdNeurons::activate`] over float bundles or their parts taken apart: the decision
    /// and the up side in one pass over the candidates `cand` (the same bits as deciding over
    /// all, then reading the ups of the neurons left on); with `out`, the down side too, added
    /// into it in the same pass ([`ColdNeurons::activate_down`]); over tiles, [`tiled_ffn`].
    fn activate_parts(
        &self,
        x: &[f32],
        n: usize,
        threshold: f32,
        keep: Option<&[bool]>,
        cand: &[u32],
        out: Option<&mut [f32]>,
    ) -> Result<ColdActive> {
        let c = cand.len();
        let mut h = vec![0f32; n * c];
        let down = out.is_some();
        let pos = if let ColdData::Tiled { tiles, neurons, d } = &self.data {
            // Tiles hold gated bundles only.
            let decide =
                |jj: usize, t: usize, v: f32| self.masked(cand[jj], t, v, (true, threshold), keep);
            let tiles = NeuronTiles::new(tiles.as_slice(), *neurons, *d)?;
            let listed = (cand, &self.ids_of(cand)[..]);
            tiled_ffn(self.kernels, tiles, listed, x, n, decide, &mut h, out)?
        } else {
            let parts = match &self.data {
                ColdData::Bundles { t, shape } => FfnParts::Bundles(Bundles::from_host(t, *shape)?),
                ColdData::Parted { gates, ups, downs } => FfnParts::Apart {
                    decide: Bundles::of_rows(gates)?,
                    up: Some(Bundles::of_rows(ups)?),
                    down: Some(Bundles::of_rows(downs)?),
                },
                ColdData::Tiled { .. } | ColdData::Matrices { .. } => {
                    return Err(weights_err("the FFN is stored as matrices, not bundles"));
                }
            };
            let gated = parts.gated();
            let decide =
                |jj: usize, t: usize, v: f32| self.masked(cand[jj], t, v, (gated, threshold), keep);
            match out {
                Some(out) => {
                    let listed = (cand, &self.ids_of(cand)[..]);
                    sparse_ffn(self.kernels, parts, listed, x, n, decide, &mut h, out)?
                }
                None => sparse_decide_up(self.kernels, parts, cand, x, n, decide, &mut h)?,
            }
        };
        self.traffic
            .add(&self.cost, c, if down { pos.len() } else { 0 }, 0);
        Ok(ColdActive {
            positions: pos.iter().map(|&jj| cand[jj]).collect(),
            values: select_cols(&h, n, c, &pos),
        })
    }
}

/// Gated float bundles `rows` (of `bytes`, `rb` bytes each, `d` wide) taken apart as
/// [`ColdData::Parted`] holds them (named after `name`): the same bytes, in another order.
pub(super) fn parted(
    name: &str,
    dtype: DType,
    d: usize,
    (bytes, rb): (&[u8], usize),
    rows: &[u32],
) -> ColdData {
    let part = rb / 3;
    let mut parts: [Vec<u8>; 3] = std::array::from_fn(|_| Vec::with_capacity(rows.len() * part));
    for &r in rows {
        let row = &bytes[r as usize * rb..(r as usize + 1) * rb];
        for (p, out) in parts.iter_mut().enumerate() {
            out.extend_from_slice(&row[p * part..(p + 1) * part]);
        }
    }
    let tensor = |what: &str, cols: usize, data: &[u8]| HostTensor {
        name: format!("{name} {what}"),
        rows: rows.len(),
        cols,
        dtype,
        data: Bytes::from_slice(data),
    };
    let [gates, ups, downs] = parts;
    ColdData::Parted {
        gates: tensor("gates", d, &gates),
        ups: tensor("ups", d, &ups),
        downs: tensor("downs", d, &downs),
    }
}

/// Gated f16 bundles `rows` (of `bytes`, `rb` bytes each, `d` wide) laid out in tiles as
/// [`ColdData::Tiled`] holds them: the same values, in another order.
pub(super) fn tiled(d: usize, (bytes, rb): (&[u8], usize), rows: &[u32]) -> ColdData {
    ColdData::Tiled {
        tiles: Bytes::from_slice(&tile_bundles(bytes, rb, rows, d)),
        neurons: rows.len(),
        d,
    }
}

/// The columns `pos` of `src` (`n × c`), as `n × pos.len()`.
fn select_cols(src: &[f32], n: usize, c: usize, pos: &[usize]) -> Vec<f32> {
    let a = pos.len();
    let mut out = vec![0f32; n * a];
    for t in 0..n {
        for (aa, &jj) in pos.iter().enumerate() {
            out[t * a + aa] = src[t * c + jj];
        }
    }
    out
}

impl ColdNeurons for ColdLayer {
    fn activate(
        &self,
        x: &[f32],
        n: usize,
        threshold: f32,
        keep: Option<&[bool]>,
    ) -> Result<ColdActive> {
        if self.ids.is_empty() {
            return Ok(ColdActive {
                positions: Vec::new(),
                values: Vec::new(),
            });
        }
        let k = self.kernels;
        let cand = self.candidates(n, keep);
        let c = cand.len();
        // The gate (or the up vector of two-part bundles) decides; the rest is read only for
        // the neurons it leaves on.
        let ColdData::Matrices { gate, up, .. } = &self.data else {
            return self.activate_parts(x, n, threshold, keep, &cand, None);
        };
        let mut dec = vec![0f32; n * c];
        let pos = {
            let _decide = span(Phase::Decide);
            sparse_rows(k, gate.as_ref().unwrap_or(up), &cand, x, n, &mut dec)?;
            let pos = self.mask_activations(&cand, n, gate.is_some(), threshold, keep, &mut dec);
            self.traffic.add(&self.cost, c, 0, 0);
            pos
        };
        let positions: Vec<u32> = pos.iter().map(|&jj| cand[jj]).collect();
        let mut values = select_cols(&dec, n, c, &pos);
        if gate.is_some() {
            let mut u = vec![0f32; values.len()];
            sparse_rows(k, up, &positions, x, n, &mut u)?;
            if let Some(bias) = &self.up_bias {
                let a = positions.len();
                for t in 0..n {
                    for (aa, &j) in positions.iter().enumerate() {
                        u[t * a + aa] += bias[j as usize];
                    }
                }
            }
            values.iter_mut().zip(&u).for_each(|(h, u)| *h *= u);
        }
        Ok(ColdActive { positions, values })
    }

    fn activate_down(
        &self,
        x: &[f32],
        n: usize,
        threshold: f32,
        keep: Option<&[bool]>,
        out: &mut [f32],
    ) -> Result<ColdActive> {
        if self.ids.is_empty() || matches!(self.data, ColdData::Matrices { .. }) {
            let active = self.activate(x, n, threshold, keep)?;
            self.add_down(&active, n, out)?;
            return Ok(active);
        }
        let cand = self.candidates(n, keep);
        self.activate_parts(x, n, threshold, keep, &cand, Some(out))
    }

    fn add_down(&self, active: &ColdActive, n: usize, out: &mut [f32]) -> Result<()> {
        let ColdActive { positions, values } = active;
        if positions.is_empty() {
            return Ok(());
        }
        let listed = (positions.as_slice(), &self.ids_of(positions)[..]);
        let units = match &self.data {
            ColdData::Bundles { t, shape } => {
                let b = Bundles::from_host(t, *shape)?;
                sparse_down(self.kernels, &b, listed, values, n, out)?;
                0
            }
            ColdData::Parted { downs, .. } => {
                let downs = Bundles::of_rows(downs)?;
                sparse_down(self.kernels, &downs, listed, values, n, out)?;
                0
            }
            ColdData::Tiled { tiles, neurons, d } => {
                let tiles = NeuronTiles::new(tiles.as_slice(), *neurons, *d)?;
                tiled_down(self.kernels, tiles, listed, values, n, out)?;
                0
            }
            ColdData::Matrices { down, .. } => {
                sparse_down_blocks(self.kernels, down, positions, values, n, out)?
            }
        };
        self.traffic.add(&self.cost, 0, positions.len(), units);
        Ok(())
    }
}

/// Rows `rows` (of `rb` bytes) of `bytes`, one after another at the start of `out` (which
/// holds them), copied by the threads together: a cache unit's misses, a thousand bundles a
/// layer on SmolLM2, were its largest phase copied by one thread.
pub(super) fn copy_rows(bytes: &[u8], rb: usize, rows: &[usize], out: &mut [u8]) {
    use rayon::prelude::*;
    // Enough rows a task that each moves at least 64 KiB.
    const TASK_BYTES: usize = 64 << 10;
    let per = TASK_BYTES.div_ceil(rb.max(1)).max(1);
    out[..rows.len() * rb]
        .par_chunks_mut(per * rb)
        .zip(rows.par_chunks(per))
        .for_each(|(o, rs)| {
            for (o, &r) in o.chunks_exact_mut(rb).zip(rs) {
                o.copy_from_slice(&bytes[r * rb..(r + 1) * rb]);
            }
        });
}

/// How the CPU computes a layer's cold neurons.
pub(super) struct CpuSide {
    pub(super) kernels: &'static Kernels,
    pub(super) act: fn(f32) -> f32,
    pub(super) traffic: Arc<ColdTraffic>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Act;
    use crate::backend::cpu::{kernels, matmul::matmul};
    use crate::tensor::quantize::quantize_row;
    use crate::tensor::{DType, QK};
    use crate::tier::hybrid::{gather_blocks, gather_rows};
    use rand::{RngExt, SeedableRng, rngs::StdRng};

    fn quantized(
        rng: &mut StdRng,
        name: &str,
        dtype: DType,
        rows: usize,
        cols: usize,
    ) -> HostTensor {
        let mut bytes = vec![0u8; rows * dtype.bytes_for(cols)];
        for r in bytes.chunks_mut(dtype.bytes_for(cols)) {
            let v: Vec<f32> = (0..cols).map(|_| rng.random_range(-1.0..1.0)).collect();
            quantize_row(dtype, &v, r);
        }
        HostTensor {
            name: name.into(),
            rows,
            cols,
            dtype,
            data: Bytes::from_slice(&bytes),
        }
    }

    fn gathered(t: &HostTensor, rows: usize, cols: usize, bytes: Vec<u8>) -> HostTensor {
        HostTensor {
            name: t.name.clone(),
            rows,
            cols,
            dtype: t.dtype,
            data: Bytes::from_slice(&bytes),
        }
    }

    /// Rows copied by several tasks land where one thread would put them, repeats included.
    #[test]
    fn copy_rows_is_the_rows_in_order() {
        let rb = 1000;
        let bytes: Vec<u8> = (0..300 * rb).map(|i| (i % 251) as u8).collect();
        let rows: Vec<usize> = (0..200)
            .map(|k| (k * 37 + k / 7) % 300)
            .chain([5, 5])
            .collect();
        let mut out = vec![0u8; rows.len() * rb + 3];
        copy_rows(&bytes, rb, &rows, &mut out);
        for (k, &r) in rows.iter().enumerate() {
            assert_eq!(
                out[k * rb..(k + 1) * rb],
                bytes[r * rb..(r + 1) * rb],
                "row {k}"
            );
        }
        assert_eq!(out[rows.len() * rb..], [0, 0, 0]);
    }

    /// One gated layer of Q4_1 matrices (Q6_K down, 256-neuron units, in the second case) split
    /// into hot blocks (dense products on the gathered matrices, as the device runs them) and
    /// cold blocks (the CPU's [`ColdLayer`]): their sum is the dense FFN to float reassociation,
    /// for every token, with and without a mask; the CPU's reads are the cost model's.
    #[test]
    fn hot_plus_cold_blocks_are_the_dense_ffn() {
        let k = kernels::best();
        let mut rng = StdRng::seed_from_u64(3);
        let (d, n) = (256, 3);
        for (down_dtype, d_ff, threshold) in [
            (DType::Q4_1, 512, 0.0),
            (DType::Q6K, 1024, 0.0),
            (DType::Q4_1, 512, 0.3),
        ] {
            let unit = down_dtype.block_len().max(QK);
            let gate = quantized(&mut rng, "gate", DType::Q4_1, d_ff, d);
            let up = quantized(&mut rng, "up", DType::Q4_1, d_ff, d);
            let down = quantized(&mut rng, "down", down_dtype, d, d_ff);
            let x: Vec<f32> = (0..n * d).map(|_| rng.random_range(-1.0..1.0)).collect();
            let silu = crate::backend::cpu::ops::activation(Act::Silu);
            let ffn = |g: &HostTensor, u: &HostTensor, dn: &HostTensor| {
                let m = g.rows;
                let (mut gv, mut uv) = (vec![0f32; n * m], vec![0f32; n * m]);
                matmul(k, g, &x, n, &mut gv);
                matmul(k, u, &x, n, &mut uv);
                let h: Vec<f32> = gv
                    .iter()
                    .zip(&uv)
                    .map(|(g, u)| sparse_act(silu(*g), threshold) * u)
                    .collect();
                let mut out = vec![0f32; n * d];
                matmul(k, dn, &h, n, &mut out);
                out
            };
            let want = ffn(&gate, &up, &down);
            let units = d_ff / unit;
            let hot_units: Vec<usize> = (0..units).filter(|_| rng.random_bool(0.5)).collect();
            let cold_units: Vec<usize> = (0..units).filter(|u| !hot_units.contains(u)).collect();
            let ids = |us: &[usize]| -> Vec<u32> {
                us.iter()
                    .flat_map(|&u| (u * unit) as u32..((u + 1) * unit) as u32)
                    .collect()
            };
            let (hot_ids, cold_ids) = (ids(&hot_units), ids(&cold_units));
            let rows = |t: &HostTensor, ids: &[u32]| {
                gathered(
                    t,
                    ids.len(),
                    d,
                    gather_rows(t.data.as_slice(), t.row_bytes(), ids),
                )
            };
            let blocks = |us: &[usize]| {
                let ub = down_dtype.bytes_for(unit);
                let b = gather_blocks(down.data.as_slice(), d, down.row_bytes(), ub, us);
                gathered(&down, d, us.len() * unit, b)
            };
            let mut got = if hot_ids.is_empty() {
                vec![0f32; n * d]
            } else {
                ffn(
                    &rows(&gate, &hot_ids),
                    &rows(&up, &hot_ids),
                    &blocks(&hot_units),
                )
            };
            let traffic = Arc::new(ColdTraffic::default());
            let cost = ColdCost {
                decide_bytes: gate.row_bytes() as u64,
                active_bytes: up.row_bytes() as u64,
                unit_bytes: (d * down_dtype.bytes_for(unit)) as u64,
                unit,
                tiled: false,
            };
            let cold = ColdLayer {
                data: ColdData::Matrices {
                    gate: Some(rows(&gate, &cold_ids)),
                    up: rows(&up, &cold_ids),
                    down: blocks(&cold_units),
                },
                ids: cold_ids.clone(),
                up_bias: None,
                d_ff,
                act: silu,
                kernels: k,
                cost,
                traffic: traffic.clone(),
                _hold: None,
            };
            let active = cold.activate(&x, n, threshold, None).unwrap();
            cold.add_down(&active, n, &mut got).unwrap();
            for (t, (g, w)) in got.chunks(d).zip(want.chunks(d)).enumerate() {
                let scale: f32 = w.iter().map(|v| v.abs()).sum::<f32>() / d as f32;
                for (a, b) in g.iter().zip(w) {
                    assert!(
                        (a - b).abs() <= 1e-5 * scale * d as f32,
                        "{down_dtype} token {t}: {a} vs {b}"
                    );
                }
            }
            let [bytes, candidates, active, touched] = traffic.snapshot();
            assert_eq!(candidates, cold_ids.len() as u64);
            assert_eq!(bytes, cost.bytes(candidates, active, touched));
            if threshold > 0.0 {
                assert!(active < candidates, "the mask leaves some cold neurons out");
            }
        }
    }

    /// Gated f16 bundles taken apart (hybrid's cold neurons with wide parts: the gates one
    /// matrix, the ups another, the downs a third) decide, activate and sum exactly what the
    /// whole bundles do, bit for bit, with and without a threshold and a predictor's flags, for
    /// 1 and 3 tokens, in two steps and in one pass ([`ColdNeurons::activate_down`]); the CPU's
    /// reads are the same.
    #[test]
    fn parted_and_tiled_bundles_compute_what_whole_bundles_do() {
        for k in [kernels::best(), &kernels::PORTABLE] {
            for tiles in [false, true] {
                layouts_agree(k, tiles);
            }
        }
    }

    /// Parts taken apart (or tiles) against whole bundles, with kernels `k`.
    fn layouts_agree(k: &'static kernels::Kernels, tiles: bool) {
        let mut rng = StdRng::seed_from_u64(5);
        let (d, d_ff) = (96, 200);
        let silu = crate::backend::cpu::ops::activation(Act::Silu);
        let halves: Vec<half::f16> = (0..d_ff * 3 * d)
            .map(|_| half::f16::from_f32(rng.random_range(-0.5..0.5)))
            .collect();
        let bytes: &[u8] = bytemuck::cast_slice(&halves);
        let rb = 3 * d * 2;
        let cold_ids: Vec<u32> = (0..d_ff as u32).filter(|i| i % 3 != 1).collect();
        let shape = BundleShape { parts: 3, d };
        let layer = |data: ColdData| ColdLayer {
            data,
            ids: cold_ids.clone(),
            up_bias: None,
            d_ff,
            act: silu,
            kernels: k,
            cost: ColdCost {
                decide_bytes: (d * 2) as u64,
                active_bytes: (2 * d * 2) as u64,
                unit_bytes: 0,
                unit: 1,
                tiled: tiles,
            },
            traffic: Arc::new(ColdTraffic::default()),
            _hold: None,
        };
        let whole = layer(ColdData::Bundles {
            t: HostTensor {
                name: "whole".into(),
                rows: cold_ids.len(),
                cols: 3 * d,
                dtype: DType::F16,
                data: Bytes::from_slice(&gather_rows(bytes, rb, &cold_ids)),
            },
            shape,
        });
        let parted = layer(if tiles {
            tiled(d, (bytes, rb), &cold_ids)
        } else {
            parted("parted", DType::F16, d, (bytes, rb), &cold_ids)
        });
        for n in [1usize, 3] {
            let x: Vec<f32> = (0..n * d).map(|_| rng.random_range(-1.0..1.0)).collect();
            let keep: Vec<bool> = (0..n * d_ff).map(|_| rng.random_bool(0.7)).collect();
            for (threshold, keep) in [(0.0, None), (0.3, None), (0.3, Some(&keep[..]))] {
                let a = whole.activate(&x, n, threshold, keep).unwrap();
                let b = parted.activate(&x, n, threshold, keep).unwrap();
                assert_eq!(a.positions, b.positions, "n {n} threshold {threshold}");
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&a.values),
                    bits(&b.values),
                    "n {n} threshold {threshold}"
                );
                let start: Vec<f32> = (0..n * d).map(|i| i as f32 * 0.01).collect();
                let (mut oa, mut ob) = (start.clone(), start);
                whole.add_down(&a, n, &mut oa).unwrap();
                parted.add_down(&b, n, &mut ob).unwrap();
                assert_eq!(bits(&oa), bits(&ob), "n {n} threshold {threshold}");
                // Both steps in one pass: the same neurons, the same sum bit for bit (the one
                // order of blocks of ids), the same bytes counted.
                let since = |before: [u64; 4]| {
                    let now = whole.traffic.snapshot();
                    std::array::from_fn::<u64, 4, _>(|i| now[i] - before[i])
                };
                let before = whole.traffic.snapshot();
                let mut want = vec![0f32; n * d];
                let again = whole.activate(&x, n, threshold, keep).unwrap();
                whole.add_down(&again, n, &mut want).unwrap();
                let two_steps = since(before);
                let mut want_parted = vec![0f32; n * d];
                let again = parted.activate(&x, n, threshold, keep).unwrap();
                parted.add_down(&again, n, &mut want_parted).unwrap();
                assert_eq!(
                    bits(&want_parted),
                    bits(&want),
                    "n {n} threshold {threshold}"
                );
                let before = whole.traffic.snapshot();
                let (mut pa, mut pb) = (vec![0f32; n * d], vec![0f32; n * d]);
                let fa = whole
                    .activate_down(&x, n, threshold, keep, &mut pa)
                    .unwrap();
                let fb = parted
                    .activate_down(&x, n, threshold, keep, &mut pb)
                    .unwrap();
                assert_eq!(since(before), two_steps, "n {n} threshold {threshold}");
                assert_eq!(fa.positions, a.positions, "n {n} threshold {threshold}");
                assert_eq!(fb.positions, a.positions, "n {n} threshold {threshold}");
                assert_eq!(bits(&pa), bits(&pb), "n {n} threshold {threshold}");
                assert_eq!(bits(&pa), bits(&want), "n {n} threshold {threshold}");
                if threshold > 0.0 {
                    assert!(
                        a.positions.len() < cold_ids.len(),
                        "the mask leaves some out"
                    );
                }
            }
        }
        assert_eq!(whole.traffic.snapshot(), parted.traffic.snapshot());
    }
}
