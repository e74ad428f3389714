//! Hybrid execution (PowerInfer): every layer's attention, the norms, biases and output matrix
//! resident on the device; of each FFN, the hot neurons ([`HybridPlan`]) resident on the device in
//! one contiguous block per layer and the cold ones in DRAM, computed by the CPU for the tokens
//! that need them. Nothing streams: per layer the FFN input goes down to the host, the CPU's
//! partial sum comes back and is added on the device (the engine's hybrid step, which queues
//! the device's hot neurons before the CPU starts, so the two overlap).
//!
//! Hot neurons are gathered at load time: bundles row by row; block-quantized matrices by
//! rows for gate and up, and by whole blocks of every down row (the placement works in units
//! of a down block, see [`crate::plan::hybrid`]). The cold neurons are gathered the same way into
//! DRAM, reserved in the ledger.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::stream::{Embeddings, Head, Loader, Small};
use crate::backend::cpu::kernels::Kernels;
use crate::backend::cpu::sparse::{
    Bundles, sparse_down, sparse_down_blocks, sparse_part_dots, sparse_rows,
};
use crate::backend::{Act, Backend, BundleShape, sparse_act};
use crate::engine::{
    ColdNeurons, ColdView, EngineError, FfnView, HeadView, LayerView, LinearView, Result,
    WeightSource,
};
use crate::footprint::MatmulShapes;
use crate::footprint::ledger::{Ledger, Reservation, Tier};
use crate::model::ModelSpec;
use crate::plan::cold::ColdCost;
use crate::plan::hybrid::HybridPlan;
use crate::plan::{Part, Plan, device_dtype, offload_matmuls, part_segment_name};
use crate::store::{SegmentKind, Store, StoreError, names};
use crate::tensor::{Bytes, DType, HostTensor, QK};

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
        self.bytes.fetch_add(cost.bytes(c, a, u), Ordering::Relaxed);
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
enum ColdData {
    /// Gathered bundles (f16), `ids.len()` rows.
    Bundles { t: HostTensor, shape: BundleShape },
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
        let bytes = &buf.as_slice()[first..first + rows.len() * rb];
        let up_bias = store
            .opt_tensor(&names::layer(l, "ffn_up.bias"))
            .map_err(store_err)?
            .map(|t| t.to_f32()[rows.clone()].to_vec());
        let row = rb as u64;
        let part = row / parts as u64;
        Ok(ColdLayer {
            data: ColdData::Bundles {
                t: HostTensor {
                    name: format!("{} cpu", s.name),
                    rows: rows.len(),
                    cols: s.cols,
                    dtype: device_dtype(s),
                    data: Bytes::from_slice(bytes),
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
            cost: ColdCost {
                decide_bytes: part,
                active_bytes: row - part,
                unit_bytes: 0,
                unit: 1,
            },
            traffic: cpu.traffic,
            _hold: Some(hold),
        })
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

    /// The neuron ids any of the `n` rows of `x` activates (as [`ColdNeurons::add_ffn`]
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
        let pos = self.activate(&cand, n, shape.parts == 3, threshold, keep, &mut dec);
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
        let pos = self.activate(&cand, n, shape.parts == 3, threshold, None, &mut dec);
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
        for (k, &id) in ids.iter().enumerate() {
            let j = self.position(id)?;
            out[k * rb..(k + 1) * rb].copy_from_slice(&data[j * rb..(j + 1) * rb]);
        }
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
    fn activate(
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
            let id = self.ids[j as usize] as usize;
            let bias = if gated {
                0.0
            } else {
                self.up_bias.as_ref().map_or(0.0, |b| b[j as usize])
            };
            for t in 0..n {
                let v = &mut dec[t * c + jj];
                *v = sparse_act((self.act)(*v + bias), threshold);
                if keep.is_some_and(|k| !k[t * self.d_ff + id]) {
                    *v = 0.0;
                }
                live[jj] |= *v != 0.0;
            }
        }
        (0..c).filter(|&jj| live[jj]).collect()
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
    fn add_ffn(
        &self,
        x: &[f32],
        n: usize,
        threshold: f32,
        keep: Option<&[bool]>,
        out: &mut [f32],
    ) -> Result<()> {
        if self.ids.is_empty() {
            return Ok(());
        }
        let k = self.kernels;
        let cand = self.candidates(n, keep);
        let c = cand.len();
        let mut dec = vec![0f32; n * c];
        match &self.data {
            ColdData::Bundles { t, shape } => {
                let b = Bundles::from_host(t, *shape)?;
                let gated = shape.parts == 3;
                // The gate (or the up vector of two-part bundles) decides; the rest is read
                // only for the neurons it leaves on.
                sparse_part_dots(k, &b, &cand, 0, x, n, &mut dec)?;
                let pos = self.activate(&cand, n, gated, threshold, keep, &mut dec);
                let active: Vec<u32> = pos.iter().map(|&jj| cand[jj]).collect();
                let mut h = select_cols(&dec, n, c, &pos);
                if gated {
                    let mut u = vec![0f32; h.len()];
                    sparse_part_dots(k, &b, &active, 1, x, n, &mut u)?;
                    h.iter_mut().zip(&u).for_each(|(h, u)| *h *= u);
                }
                sparse_down(k, &b, &active, &h, n, out)?;
                self.traffic.add(&self.cost, c, active.len(), 0);
            }
            ColdData::Matrices { gate, up, down } => {
                let gated = gate.is_some();
                sparse_rows(k, gate.as_ref().unwrap_or(up), &cand, x, n, &mut dec)?;
                let pos = self.activate(&cand, n, gated, threshold, keep, &mut dec);
                let active: Vec<u32> = pos.iter().map(|&jj| cand[jj]).collect();
                let mut h = select_cols(&dec, n, c, &pos);
                if gated {
                    let a = active.len();
                    let mut u = vec![0f32; h.len()];
                    sparse_rows(k, up, &active, x, n, &mut u)?;
                    if let Some(bias) = &self.up_bias {
                        for t in 0..n {
                            for (aa, &j) in active.iter().enumerate() {
                                u[t * a + aa] += bias[j as usize];
                            }
                        }
                    }
                    h.iter_mut().zip(&u).for_each(|(h, u)| *h *= u);
                }
                let units = sparse_down_blocks(k, down, &active, &h, n, out)?;
                self.traffic.add(&self.cost, c, active.len(), units);
            }
        }
        Ok(())
    }
}

/// A layer's hot neurons on the device.
pub(super) enum HotFfn<B: Backend> {
    Bundles(Option<B::Weight>),
    Matrices {
        gate: Option<B::Weight>,
        up: Option<B::Weight>,
        down: Option<B::Weight>,
        up_bias: Option<B::Weight>,
    },
}

impl<B: Backend> HotFfn<B> {
    /// The device's share of a hybrid layer's FFN: its hot block (nothing where no neuron is
    /// hot), with the layer's biases from `sm`.
    pub(super) fn view<'a>(
        &'a self,
        sm: &'a Small<B>,
        bundle: BundleShape,
        gated: bool,
    ) -> FfnView<'a, B> {
        match self {
            HotFfn::Bundles(w) => FfnView::Bundles {
                runs: w.iter().map(|w| (0, w)).collect(),
                shape: bundle,
                up_bias: sm.up_bias.as_ref(),
                down_bias: sm.down_bias.as_ref(),
            },
            HotFfn::Matrices {
                gate,
                up,
                down,
                up_bias,
            } => FfnView::Matrices {
                gate: gated.then(|| linear(gate.as_ref(), None)),
                up: linear(up.as_ref(), up_bias.as_ref()),
                down: linear(down.as_ref(), sm.down_bias.as_ref()),
            },
        }
    }
}

pub struct HybridWeights<B: Backend> {
    spec: ModelSpec,
    resident: Resident<B>,
    hot: Vec<HotFfn<B>>,
    hot_ids: Vec<Vec<u32>>,
    cold: Vec<ColdLayer>,
    partial: B::Tensor,
    bundle: BundleShape,
    traffic: Arc<ColdTraffic>,
}

/// What hybrid execution and cache units keep whole: every layer's norms, biases and attention
/// and the output head on the device, the embedding tables in DRAM, and the matmul shapes step
/// memory is sized by.
pub(super) struct Resident<B: Backend> {
    small: Vec<Small<B>>,
    /// q, k, v, o of every layer.
    attention: Vec<[B::Weight; 4]>,
    pub(super) head: Head<B>,
    pub(super) embeddings: Embeddings,
    pub(super) matmuls: MatmulShapes,
}

impl<B: Backend> Resident<B> {
    /// Load it through a staging buffer of `staging` bytes, calling `ffn(l, small)` after each
    /// layer's norms and biases are on the device (the FFN's own loading, which may rewrite the
    /// up bias).
    pub(super) fn load(
        b: &B,
        store: &Arc<Store>,
        ledger: &Arc<Ledger>,
        staging: u64,
        mut ffn: impl FnMut(usize, &mut Small<B>) -> Result<()>,
    ) -> Result<Self> {
        let n_layers = store.manifest.spec.n_layers;
        let embeddings = Embeddings::load(store, ledger, &store.manifest.spec)?;
        let mut loader = Loader::new(store, ledger, staging)?;
        let mut small = Vec::with_capacity(n_layers);
        let mut attention = Vec::with_capacity(n_layers);
        for l in 0..n_layers {
            let mut sm = Small::load(&mut loader, b, l)?;
            let mut att = Vec::with_capacity(4);
            for p in [Part::Q, Part::K, Part::V, Part::O] {
                let s = store.require(&part_segment_name(l, p)).map_err(store_err)?;
                att.push(loader.load_to_device(b, s, 0..s.rows, device_dtype(s))?);
            }
            let att: [B::Weight; 4] = att
                .try_into()
                .map_err(|_| weights_err("four attention matrices"))?;
            ffn(l, &mut sm)?;
            attention.push(att);
            small.push(sm);
        }
        let head = Head::load(&mut loader, b, store)?;
        Ok(Resident {
            small,
            attention,
            head,
            embeddings,
            matmuls: offload_matmuls(&store.manifest).map_err(weights_err)?,
        })
    }

    /// Layer `l`'s norms and biases.
    pub(super) fn small(&self, l: usize) -> &Small<B> {
        &self.small[l]
    }

    /// Layer `l` with `ffn` for its FFN and what runs beside.
    pub(super) fn layer<'a>(
        &'a self,
        l: usize,
        ffn: FfnView<'a, B>,
        cold: Option<ColdView<'a, B>>,
        unit: Option<Box<dyn crate::engine::NeuronUnit<B> + 'a>>,
    ) -> LayerView<'a, B> {
        let sm = &self.small[l];
        let [q, k, v, o] = &self.attention[l];
        LayerView {
            attn_norm: sm.attn_norm(),
            wq: linear(Some(q), sm.attn_bias[0].as_ref()),
            wk: linear(Some(k), sm.attn_bias[1].as_ref()),
            wv: linear(Some(v), sm.attn_bias[2].as_ref()),
            wo: linear(Some(o), sm.attn_bias[3].as_ref()),
            ffn_norm: sm.ffn_norm(),
            ffn,
            cold,
            unit,
        }
    }
}

/// The [`WeightSource`] methods of a source whose `resident` field is a [`Resident`]: all but
/// `layer`.
macro_rules! resident_source {
    () => {
        fn embed(
            &mut self,
            b: &B,
            ids: &[u32],
            first_pos: usize,
            out: &mut B::Tensor,
        ) -> Result<()> {
            self.resident.embeddings.embed(b, ids, first_pos, out)
        }

        fn rope_freq_factors(&self) -> Option<Vec<f32>> {
            self.resident.head.rope_freq_factors()
        }

        fn layer_done(&mut self, _: &B, _: usize) -> Result<()> {
            Ok(())
        }

        fn head(&mut self, _: &B) -> Result<HeadView<'_, B>> {
            Ok(self.resident.head.view())
        }

        fn head_done(&mut self, _: &B) -> Result<()> {
            Ok(())
        }

        fn matmuls(&self) -> MatmulShapes {
            self.resident.matmuls.clone()
        }
    };
}
pub(super) use resident_source;

/// Rows `ids` of a row-major byte matrix with rows of `rb` bytes, one after another.
fn gather_rows(bytes: &[u8], rb: usize, ids: &[u32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(ids.len() * rb);
    for &i in ids {
        let i = i as usize;
        out.extend_from_slice(&bytes[i * rb..(i + 1) * rb]);
    }
    out
}

/// Of every row of a matrix whose rows hold `units` blocks of `ub` bytes, the blocks `units_of`
/// (ascending), row after row.
fn gather_blocks(bytes: &[u8], rows: usize, rb: usize, ub: usize, units_of: &[usize]) -> Vec<u8> {
    let mut out = Vec::with_capacity(rows * units_of.len() * ub);
    for r in 0..rows {
        let row = &bytes[r * rb..(r + 1) * rb];
        for &u in units_of {
            out.extend_from_slice(&row[u * ub..(u + 1) * ub]);
        }
    }
    out
}

/// How the CPU computes a layer's cold neurons.
pub(super) struct CpuSide {
    pub(super) kernels: &'static Kernels,
    pub(super) act: fn(f32) -> f32,
    pub(super) traffic: Arc<ColdTraffic>,
}

/// Layer `l`'s FFN split: the `ids` neurons gathered onto the device (in that order; whole down
/// blocks for matrices), the others gathered into DRAM (reserved) for the CPU. A bundled up
/// bias on the device (`up_bias_dev`) is rewritten in the hot block's order.
#[allow(clippy::too_many_arguments)]
pub(super) fn layer_ffn<B: Backend>(
    b: &B,
    store: &Store,
    ledger: &Arc<Ledger>,
    l: usize,
    ids: &[u32],
    cost: ColdCost,
    up_bias_dev: &mut Option<B::Weight>,
    cpu: CpuSide,
) -> Result<(HotFfn<B>, ColdLayer)> {
    let spec = &store.manifest.spec;
    let (d, d_ff) = (spec.d_model, spec.d_ff);
    let bundled = store.ffn_bundled();
    let mut is_hot = vec![false; d_ff];
    for &i in ids {
        let slot = is_hot
            .get_mut(i as usize)
            .ok_or_else(|| weights_err(format!("hot neuron {i} of layer {l} ≥ {d_ff}")))?;
        if *slot {
            return Err(weights_err(format!(
                "hot neuron {i} of layer {l} listed twice"
            )));
        }
        *slot = true;
    }
    let cold_ids: Vec<u32> = (0..d_ff as u32).filter(|&i| !is_hot[i as usize]).collect();
    let up_bias = store
        .opt_tensor(&names::layer(l, "ffn_up.bias"))
        .map_err(store_err)?
        .map(|t| t.to_f32());
    let pick = |ids: &[u32]| -> Option<Vec<f32>> {
        up_bias
            .as_ref()
            .map(|b| ids.iter().map(|&i| b[i as usize]).collect())
    };
    let (hot_part, data, cold_bytes) = if bundled {
        let s = store
            .require(&part_segment_name(l, Part::Ffn))
            .map_err(store_err)?;
        let SegmentKind::Bundles { parts } = s.kind else {
            return Err(weights_err(format!("`{}` is not bundles", s.name)));
        };
        let (buf, range) = store.read(s).map_err(store_err)?;
        let bytes = &buf.as_slice()[range];
        let rb = s.row_bytes();
        let dtype = device_dtype(s);
        let w = if ids.is_empty() {
            None
        } else {
            let mut w = b.alloc_weight(&format!("{} hot", s.name), dtype, ids.len(), s.cols)?;
            upload(b, &mut w, &gather_rows(bytes, rb, ids))?;
            Some(w)
        };
        // The device's up bias follows the hot block's order (same buffer, rewritten).
        if let (Some(dev), Some(hb)) = (up_bias_dev.as_mut(), pick(ids)) {
            let mut v = hb;
            v.resize(d_ff, 0.0);
            upload(b, dev, bytemuck::cast_slice(&v))?;
        }
        let t = HostTensor {
            name: format!("{} cold", s.name),
            rows: cold_ids.len(),
            cols: s.cols,
            dtype,
            data: Bytes::from_slice(&gather_rows(bytes, rb, &cold_ids)),
        };
        let n = t.data.len() as u64;
        (
            HotFfn::Bundles(w),
            ColdData::Bundles {
                t,
                shape: BundleShape { parts, d },
            },
            n,
        )
    } else {
        let unit = cost.unit;
        let hot_units: Vec<usize> = ids
            .iter()
            .step_by(unit.max(1))
            .map(|&i| i as usize / unit)
            .collect();
        let cold_units: Vec<usize> = cold_ids
            .iter()
            .step_by(unit.max(1))
            .map(|&i| i as usize / unit)
            .collect();
        if hot_units.len() * unit != ids.len()
            || ids
                .iter()
                .enumerate()
                .any(|(k, &i)| i as usize != hot_units[k / unit] * unit + k % unit)
        {
            return Err(weights_err(format!(
                "the hot neurons of layer {l} are not whole blocks of {unit}"
            )));
        }
        let rows_of = |p: Part, ids: &[u32]| -> Result<(HostTensor, Vec<u8>)> {
            let s = store.require(&part_segment_name(l, p)).map_err(store_err)?;
            let (buf, range) = store.read(s).map_err(store_err)?;
            let bytes = &buf.as_slice()[range];
            let dtype = device_dtype(s);
            let cold_rows = gather_rows(bytes, s.row_bytes(), &cold_ids);
            let t = HostTensor {
                name: format!("{} cold", s.name),
                rows: cold_ids.len(),
                cols: s.cols,
                dtype,
                data: Bytes::from_slice(&cold_rows),
            };
            Ok((t, gather_rows(bytes, s.row_bytes(), ids)))
        };
        let hot_weight = |p: Part,
                          rows: usize,
                          cols: usize,
                          dtype: DType,
                          bytes: &[u8]|
         -> Result<Option<B::Weight>> {
            if ids.is_empty() {
                return Ok(None);
            }
            let mut w = b.alloc_weight(
                &format!("{} hot", names::layer(l, p.name())),
                dtype,
                rows,
                cols,
            )?;
            upload(b, &mut w, bytes)?;
            Ok(Some(w))
        };
        let gate = if spec.gated_ffn {
            let (t, hot_rows) = rows_of(Part::Gate, ids)?;
            let w = hot_weight(Part::Gate, ids.len(), t.cols, t.dtype, &hot_rows)?;
            Some((t, w))
        } else {
            None
        };
        let (up_t, up_hot) = rows_of(Part::Up, ids)?;
        let up_w = hot_weight(Part::Up, ids.len(), up_t.cols, up_t.dtype, &up_hot)?;
        let s = store
            .require(&part_segment_name(l, Part::Down))
            .map_err(store_err)?;
        let dtype = device_dtype(s);
        let ub = dtype.bytes_for(unit);
        if unit != dtype.block_len().max(QK) || s.cols != d_ff || s.rows != d {
            return Err(weights_err(format!(
                "`{}` does not have the plan's {unit}-neuron blocks",
                s.name
            )));
        }
        let (buf, range) = store.read(s).map_err(store_err)?;
        let bytes = &buf.as_slice()[range];
        let down_w = hot_weight(
            Part::Down,
            d,
            ids.len(),
            dtype,
            &gather_blocks(bytes, d, s.row_bytes(), ub, &hot_units),
        )?;
        let down = HostTensor {
            name: format!("{} cold", s.name),
            rows: d,
            cols: cold_ids.len(),
            dtype,
            data: Bytes::from_slice(&gather_blocks(bytes, d, s.row_bytes(), ub, &cold_units)),
        };
        let up_bias_w = match pick(ids) {
            Some(v) if !ids.is_empty() => Some(b.upload(&HostTensor::from_f32(
                names::layer(l, "ffn_up.bias hot"),
                1,
                ids.len(),
                v,
            ))?),
            _ => None,
        };
        let n = (up_t.data.len() + down.data.len()) as u64
            + gate.as_ref().map_or(0, |(t, _)| t.data.len() as u64);
        let (gate_t, gate_w) = match gate {
            Some((t, w)) => (Some(t), w),
            None => (None, None),
        };
        (
            HotFfn::Matrices {
                gate: gate_w,
                up: up_w,
                down: down_w,
                up_bias: up_bias_w,
            },
            ColdData::Matrices {
                gate: gate_t,
                up: up_t,
                down,
            },
            n,
        )
    };
    let hold = if cold_bytes > 0 {
        Some(
            ledger
                .reserve(
                    Tier::Dram,
                    cold_bytes,
                    &format!("cold neurons of layer {l}"),
                )
                .map_err(weights_err)?,
        )
    } else {
        None
    };
    let cold = ColdLayer {
        data,
        up_bias: pick(&cold_ids),
        ids: cold_ids,
        d_ff,
        act: cpu.act,
        kernels: cpu.kernels,
        cost,
        traffic: cpu.traffic,
        _hold: hold,
    };
    Ok((hot_part, cold))
}

impl<B: Backend> HybridWeights<B> {
    /// Load what `hot` places on the device and gather the cold neurons into DRAM. `plan` is
    /// the store's offload plan for the same budget (its small fragments, KV and step memory);
    /// `kernels` and `act` are the CPU's for the cold neurons.
    pub fn new(
        b: &B,
        store: Arc<Store>,
        plan: &Plan,
        hot: &HybridPlan,
        ledger: Arc<Ledger>,
        kernels: &'static Kernels,
        act: Act,
    ) -> Result<Self> {
        let m = &store.manifest;
        if m.model_id != plan.model_id {
            return Err(weights_err("the plan was made for another model"));
        }
        let spec = m.spec.clone();
        let (n_layers, d) = (spec.n_layers, spec.d_model);
        if hot.hot_neurons.len() != n_layers || hot.cold_cost.len() != n_layers {
            return Err(weights_err(
                "the hot-neuron plan has another number of layers",
            ));
        }
        let traffic = Arc::new(ColdTraffic::default());
        let act_fn = crate::backend::cpu::ops::activation(act);
        let mut hot_ffn = Vec::with_capacity(n_layers);
        let mut cold = Vec::with_capacity(n_layers);
        let resident = Resident::load(b, &store, &ledger, hot.staging, |l, sm| {
            let (hot_part, cold_layer) = layer_ffn(
                b,
                &store,
                &ledger,
                l,
                &hot.hot_neurons[l],
                hot.cold_cost[l],
                &mut sm.up_bias,
                CpuSide {
                    kernels,
                    act: act_fn,
                    traffic: traffic.clone(),
                },
            )?;
            cold.push(cold_layer);
            hot_ffn.push(hot_part);
            Ok(())
        })?;
        let partial = b.alloc(hot.batch.max(1), d)?;
        Ok(HybridWeights {
            bundle: BundleShape {
                parts: if spec.gated_ffn { 3 } else { 2 },
                d,
            },
            spec,
            resident,
            hot: hot_ffn,
            hot_ids: hot.hot_neurons.clone(),
            cold,
            partial,
            traffic,
        })
    }

    /// What the CPU has read for cold neurons so far.
    pub fn traffic(&self) -> Arc<ColdTraffic> {
        self.traffic.clone()
    }
}

/// Copy `bytes` into `w` from row 0, and wait for the copy (the bytes are a temporary).
fn upload<B: Backend>(b: &B, w: &mut B::Weight, bytes: &[u8]) -> Result<()> {
    b.upload_into(w, 0, bytes)?;
    let ev = b.copies_done()?;
    b.host_waits(&ev)?;
    Ok(())
}

fn linear<'a, B: Backend>(
    w: Option<&'a B::Weight>,
    bias: Option<&'a B::Weight>,
) -> LinearView<'a, B> {
    LinearView {
        blocks: w.map(|w| (0, w)).into_iter().collect(),
        bias,
    }
}

impl<B: Backend> WeightSource<B> for HybridWeights<B> {
    resident_source!();

    fn layer(&mut self, _: &B, l: usize) -> Result<LayerView<'_, B>> {
        let HybridWeights {
            resident,
            hot,
            hot_ids,
            cold,
            partial,
            bundle,
            spec,
            ..
        } = self;
        let ffn = hot[l].view(resident.small(l), *bundle, spec.gated_ffn);
        let cold = ColdView {
            neurons: &cold[l],
            hot: &hot_ids[l],
            partial,
        };
        Ok(resident.layer(l, ffn, Some(cold), None))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::{kernels, matmul::matmul};
    use crate::tensor::quantize::quantize_row;
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
            cold.add_ffn(&x, n, threshold, None, &mut got).unwrap();
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
}
