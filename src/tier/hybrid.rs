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
//! DRAM, reserved in the ledger ([`super::cold`] computes them). `layer_ffn` is the split of
//! one layer, which the streaming source (hybrid over streamed attention) and cache units'
//! hybrid layers use as well.

use std::sync::Arc;

use super::cold::{self, ColdData, ColdLayer, ColdTraffic, CpuSide, copy_rows, parted};
use super::resident::{Resident, Small, linear, resident_source};
use crate::backend::cpu::kernels::Kernels;
use crate::backend::cpu::sparse::{tileable, tiles_bytes};
use crate::backend::{Act, Backend, BundleShape};
use crate::engine::{
    ColdMerge, ColdView, EngineError, FfnView, HeadView, LayerView, Result, WeightSource,
};
use crate::footprint::MatmulShapes;
use crate::footprint::ledger::{Ledger, Tier};
use crate::model::ModelSpec;
use crate::plan::cold::{ColdCost, cold_taken_apart};
use crate::plan::hybrid::HybridPlan;
use crate::plan::{Part, Plan, device_dtype, part_segment_name};
use crate::store::{SegmentKind, Store, StoreError, names};
use crate::tensor::{Bytes, DType, HostTensor, QK};

fn store_err(e: StoreError) -> EngineError {
    EngineError::Weights(e.to_string())
}

fn weights_err(e: impl std::fmt::Display) -> EngineError {
    EngineError::Weights(e.to_string())
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
        let resident = Resident::load(b, &store, &ledger, hot.staging, |l, sm, _| {
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
        ColdLayer::pack_gathered(&mut cold);
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
            merge: ColdMerge::Add(partial),
        };
        Ok(resident.layer(l, ffn, Some(cold), None))
    }
}

/// Rows `ids` of a row-major byte matrix with rows of `rb` bytes, one after another.
pub(super) fn gather_rows(bytes: &[u8], rb: usize, ids: &[u32]) -> Vec<u8> {
    let mut out = vec![0u8; ids.len() * rb];
    let rows: Vec<usize> = ids.iter().map(|&i| i as usize).collect();
    copy_rows(bytes, rb, &rows, &mut out);
    out
}

/// Of every row of a matrix whose rows hold `units` blocks of `ub` bytes, the blocks `units_of`
/// (ascending), row after row.
pub(super) fn gather_blocks(
    bytes: &[u8],
    rows: usize,
    rb: usize,
    ub: usize,
    units_of: &[usize],
) -> Vec<u8> {
    let mut out = Vec::with_capacity(rows * units_of.len() * ub);
    for r in 0..rows {
        let row = &bytes[r * rb..(r + 1) * rb];
        for &u in units_of {
            out.extend_from_slice(&row[u * ub..(u + 1) * ub]);
        }
    }
    out
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
    let split = NeuronSplit::new(store, l, ids, d_ff)?;
    let Gathered {
        hot: hot_part,
        cold: data,
        cold_bytes,
    } = if bundled {
        gather_bundles(b, store, &split, up_bias_dev, cost.tiled, (d, d_ff))?
    } else {
        gather_matrices(b, store, &split, cost, d, d_ff)?
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
    let up_bias = split.pick(&split.cold_ids);
    let cold = ColdLayer::gathered(data, up_bias, split.cold_ids, d_ff, cost, cpu, hold);
    Ok((hot_part, cold))
}

/// Layer `l`'s neurons as its FFN split takes them: the hot ones in the device's order, the
/// cold ones ascending, and the layer's up bias (where it has one).
struct NeuronSplit<'a> {
    l: usize,
    ids: &'a [u32],
    cold_ids: Vec<u32>,
    up_bias: Option<Vec<f32>>,
}

impl<'a> NeuronSplit<'a> {
    /// The hot `ids` of layer `l` checked (each below `d_ff`, none listed twice), the others
    /// cold.
    fn new(store: &Store, l: usize, ids: &'a [u32], d_ff: usize) -> Result<Self> {
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
        Ok(NeuronSplit {
            l,
            ids,
            cold_ids,
            up_bias,
        })
    }

    /// The up biases of neurons `ids` (none without an up bias).
    fn pick(&self, ids: &[u32]) -> Option<Vec<f32>> {
        self.up_bias
            .as_ref()
            .map(|b| ids.iter().map(|&i| b[i as usize]).collect())
    }
}

/// A layer's FFN gathered: the device's hot block, the cold neurons' host data, and its bytes
/// (what DRAM holds for them).
struct Gathered<B: Backend> {
    hot: HotFfn<B>,
    cold: ColdData,
    cold_bytes: u64,
}

/// A bundled layer split: the hot bundles gathered onto the device (the device's up bias,
/// `up_bias_dev`, rewritten in their order), the cold ones into host memory.
fn gather_bundles<B: Backend>(
    b: &B,
    store: &Store,
    split: &NeuronSplit,
    up_bias_dev: &mut Option<B::Weight>,
    tiled: bool,
    (d, d_ff): (usize, usize),
) -> Result<Gathered<B>> {
    let (l, ids, cold_ids) = (split.l, split.ids, &split.cold_ids);
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
    if let (Some(dev), Some(hb)) = (up_bias_dev.as_mut(), split.pick(ids)) {
        let mut v = hb;
        v.resize(d_ff, 0.0);
        upload(b, dev, bytemuck::cast_slice(&v))?;
    }
    let name = format!("{} cold", s.name);
    let mut cold_bytes = (cold_ids.len() * rb) as u64;
    // Where the plan says so, gated f16 bundles are laid out in tiles (a tile read as one
    // run); other gated float bundles are taken apart (the gates read as one run): the same
    // values.
    let cold = if tiled && tileable(dtype, parts, d) {
        cold_bytes = tiles_bytes(cold_ids.len(), d) as u64;
        cold::tiled(d, (bytes, rb), cold_ids)
    } else if cold_taken_apart(s, parts) {
        parted(&name, dtype, d, (bytes, rb), cold_ids)
    } else {
        ColdData::Bundles {
            t: HostTensor {
                name,
                rows: cold_ids.len(),
                cols: s.cols,
                dtype,
                data: Bytes::from_slice(&gather_rows(bytes, rb, cold_ids)),
            },
            shape: BundleShape { parts, d },
        }
    };
    Ok(Gathered {
        hot: HotFfn::Bundles(w),
        cold,
        cold_bytes,
    })
}

/// A block-quantized layer split in whole down blocks (`cost.unit` neurons): the hot rows of
/// gate and up and the hot blocks of every down row onto the device, the cold ones into host
/// memory.
fn gather_matrices<B: Backend>(
    b: &B,
    store: &Store,
    split: &NeuronSplit,
    cost: ColdCost,
    d: usize,
    d_ff: usize,
) -> Result<Gathered<B>> {
    let (l, ids, cold_ids) = (split.l, split.ids, &split.cold_ids);
    let spec = &store.manifest.spec;
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
        let cold_rows = gather_rows(bytes, s.row_bytes(), cold_ids);
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
    let up_bias_w = match split.pick(ids) {
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
    Ok(Gathered {
        hot: HotFfn::Matrices {
            gate: gate_w,
            up: up_w,
            down: down_w,
            up_bias: up_bias_w,
        },
        cold: ColdData::Matrices {
            gate: gate_t,
            up: up_t,
            down,
        },
        cold_bytes: n,
    })
}
