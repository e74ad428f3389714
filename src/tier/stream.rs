//! The streaming weight source: runs a [`Plan`] on any backend. Small fragments, the output
//! matrix and every layer's resident share live on the device for good; each layer's streamed
//! share goes SSD → DRAM (the [`DramCache`]) → one of `window` device slots, copied in while the
//! layers before it compute (FlexInfer's prefetch window), the compute stream waiting on the copy
//! event and the slot refilled as soon as its layer is done.
//!
//! Weights come from the store in its encodings (the model's own; a float model's FFN as f16
//! neuron bundles, a block-quantized model's as its matrices); embeddings are looked up in DRAM.

use std::sync::Arc;

use super::dram::{DramCache, LayerData};
use crate::backend::{Backend, BundleShape};
use crate::engine::{
    ColdView, EngineError, FfnView, HeadView, LayerView, LinearView, NormView, Result, WeightSource,
};
use crate::footprint::MatmulShapes;
use crate::footprint::ledger::{Ledger, Reservation, Tier};
use crate::model::{ModelSpec, PositionEncoding};
use crate::plan::{
    PARTS, Part, Plan, Residency, device_dtype, head_segment, offload_matmuls, part_segment_name,
    staging_chunks, widest_dtype,
};
use crate::store::{Segment, SegmentKind, Store, StoreError, names};
use crate::tensor::{AlignedBuf, DType, HostTensor};

fn store_err(e: StoreError) -> EngineError {
    EngineError::Weights(e.to_string())
}

/// Norms and biases of one layer (always resident).
pub(super) struct Small<B: Backend> {
    pub(super) attn_norm: (B::Weight, Option<B::Weight>),
    pub(super) ffn_norm: (B::Weight, Option<B::Weight>),
    /// q, k, v, o biases.
    pub(super) attn_bias: [Option<B::Weight>; 4],
    pub(super) up_bias: Option<B::Weight>,
    pub(super) down_bias: Option<B::Weight>,
}

impl<B: Backend> Small<B> {
    /// Layer `l`'s norms and biases, loaded to the device.
    pub(super) fn load(loader: &mut Loader, b: &B, l: usize) -> Result<Self> {
        let mut norm = |what: &str| -> Result<(B::Weight, Option<B::Weight>)> {
            Ok((
                loader.vector(b, &names::layer(l, &format!("{what}.weight")))?,
                loader.opt_vector(b, &names::layer(l, &format!("{what}.bias")))?,
            ))
        };
        let attn_norm = norm("attn_norm")?;
        let ffn_norm = norm("ffn_norm")?;
        let mut attn_bias: [Option<B::Weight>; 4] = Default::default();
        for (i, t) in ["attn_q", "attn_k", "attn_v", "attn_output"]
            .iter()
            .enumerate()
        {
            attn_bias[i] = loader.opt_vector(b, &names::layer(l, &format!("{t}.bias")))?;
        }
        Ok(Small {
            attn_norm,
            ffn_norm,
            attn_bias,
            up_bias: loader.opt_vector(b, &names::layer(l, "ffn_up.bias"))?,
            down_bias: loader.opt_vector(b, &names::layer(l, "ffn_down.bias"))?,
        })
    }

    pub(super) fn attn_norm(&self) -> NormView<'_, B> {
        NormView {
            weight: &self.attn_norm.0,
            bias: self.attn_norm.1.as_ref(),
        }
    }

    pub(super) fn ffn_norm(&self) -> NormView<'_, B> {
        NormView {
            weight: &self.ffn_norm.0,
            bias: self.ffn_norm.1.as_ref(),
        }
    }
}

/// Device buffers one streamed layer passes through.
struct Slot<B: Backend> {
    parts: [Option<B::Weight>; PARTS],
    layer: Option<usize>,
    ready: Option<B::Event>,
}

/// A host table in DRAM (embeddings), read one row per token.
struct Table {
    t: HostTensor,
    _hold: Reservation,
}

/// What every offloaded source holds for the end of a pass: the final norm and the output
/// matrix on the device, and the RoPE frequency factors (host).
pub(super) struct Head<B: Backend> {
    output: B::Weight,
    norm: (B::Weight, Option<B::Weight>),
    rope_freq_factors: Option<Vec<f32>>,
}

impl<B: Backend> Head<B> {
    pub(super) fn load(loader: &mut Loader, b: &B, store: &Store) -> Result<Self> {
        let seg = head_segment(&store.manifest).map_err(|e| EngineError::Weights(e.to_string()))?;
        Ok(Head {
            output: loader.load_to_device(b, seg, 0..seg.rows, device_dtype(seg))?,
            norm: (
                loader.vector(b, names::OUTPUT_NORM)?,
                loader.opt_vector(b, names::OUTPUT_NORM_BIAS)?,
            ),
            rope_freq_factors: match store.segment(names::ROPE_FREQS) {
                Some(_) => Some(store.tensor(names::ROPE_FREQS).map_err(store_err)?.to_f32()),
                None => None,
            },
        })
    }

    pub(super) fn view(&self) -> HeadView<'_, B> {
        HeadView {
            norm: NormView {
                weight: &self.norm.0,
                bias: self.norm.1.as_ref(),
            },
            output: LinearView {
                blocks: vec![(0, &self.output)],
                bias: None,
            },
        }
    }

    pub(super) fn rope_freq_factors(&self) -> Option<Vec<f32>> {
        self.rope_freq_factors.clone()
    }
}

/// The embedding tables in DRAM, looked up on the host: a step's input rows are built there and
/// copied in once.
pub(super) struct Embeddings {
    token: Table,
    pos: Option<(Table, usize)>,
    d: usize,
    x_host: Vec<f32>,
}

impl Embeddings {
    pub(super) fn load(store: &Store, ledger: &Arc<Ledger>, spec: &ModelSpec) -> Result<Self> {
        Ok(Embeddings {
            token: table(store, ledger, names::TOKEN_EMBD)?,
            pos: match &spec.position {
                PositionEncoding::Learned { offset } => {
                    Some((table(store, ledger, names::POS_EMBD)?, *offset))
                }
                PositionEncoding::Rope(_) => None,
            },
            d: spec.d_model,
            x_host: Vec::new(),
        })
    }

    /// Token embeddings (plus learned positions from `first_pos`) of `ids` into `out`.
    pub(super) fn embed<B: Backend>(
        &mut self,
        b: &B,
        ids: &[u32],
        first_pos: usize,
        out: &mut B::Tensor,
    ) -> Result<()> {
        let d = self.d;
        self.x_host.resize(ids.len() * d, 0.0);
        let mut row = vec![0f32; d];
        for (i, &id) in ids.iter().enumerate() {
            let x = &mut self.x_host[i * d..(i + 1) * d];
            self.token.t.row_f32(id as usize, x);
            if let Some((table, offset)) = &self.pos {
                let r = first_pos + i + offset;
                if r >= table.t.rows {
                    return Err(EngineError::ContextFull {
                        needed: first_pos + i + 1,
                        ctx: table.t.rows - offset,
                    });
                }
                table.t.row_f32(r, &mut row);
                x.iter_mut().zip(&row).for_each(|(a, p)| *a += p);
            }
        }
        b.write(out, &self.x_host)?;
        Ok(())
    }
}

pub struct StreamWeights<B: Backend> {
    spec: ModelSpec,
    residency: Residency,
    /// Whether the FFN is neuron bundles (else its matrices).
    bundled: bool,
    bundle: BundleShape,
    small: Vec<Small<B>>,
    /// Per layer, the resident row prefix of each part.
    resident: Vec<[Option<B::Weight>; PARTS]>,
    slots: Vec<Slot<B>>,
    /// The most recent fill: its copy event and the DRAM buffer it reads from.
    pending: Option<(B::Event, Arc<LayerData>)>,
    head: Head<B>,
    embeddings: Embeddings,
    dram: DramCache,
    matmuls: MatmulShapes,
    /// Per layer, each streamed part's device format and columns.
    part_formats: Vec<[(DType, usize); PARTS]>,
    /// The CPU+PCIe split: per layer the FFN neurons the CPU computes, the ids of those the
    /// device computes (column order), and where the CPU's partial sums come back.
    cpu: Option<CpuShare<B>>,
    /// Hybrid with streamed attention: per layer the hot neurons' block (the FFN's only device
    /// part); empty otherwise.
    hot_ffn: Vec<super::hybrid::HotFfn<B>>,
}

struct CpuShare<B: Backend> {
    layers: Vec<super::hybrid::ColdLayer>,
    /// Per layer, the ids of the FFN neurons the device computes, in column order.
    device_ids: Vec<Vec<u32>>,
    partial: B::Tensor,
    traffic: Arc<super::hybrid::ColdTraffic>,
}

/// Reads store segments into one reusable page-aligned buffer (reserved in DRAM) and copies
/// them to the device in chunks of whole checksum groups.
pub(super) struct Loader<'a> {
    store: &'a Store,
    ledger: &'a Arc<Ledger>,
    staging: AlignedBuf,
    _hold: Reservation,
}

impl<'a> Loader<'a> {
    /// A loader with a staging buffer of `bytes` (at least a page), reserved in DRAM.
    pub(super) fn new(store: &'a Store, ledger: &'a Arc<Ledger>, bytes: u64) -> Result<Self> {
        let bytes = bytes.max(4096);
        Ok(Loader {
            store,
            ledger,
            staging: AlignedBuf::zeroed(bytes as usize),
            _hold: ledger
                .reserve(Tier::Dram, bytes, "start-up staging")
                .map_err(|e| EngineError::Weights(e.to_string()))?,
        })
    }

    /// Rows `rows` of `seg` into a new device weight of `dtype`.
    pub(super) fn load_to_device<B: Backend>(
        &mut self,
        b: &B,
        seg: &Segment,
        rows: std::ops::Range<usize>,
        dtype: DType,
    ) -> Result<B::Weight> {
        let mut w = b.alloc_weight(&seg.name, dtype, rows.len(), seg.cols)?;
        for chunk in staging_chunks(seg, rows.clone()) {
            let (first, read) = self
                .store
                .read_rows_into(seg, chunk.clone(), &mut self.staging)
                .map_err(store_err)?;
            self.ledger.count_ssd(read);
            let len = chunk.len() * seg.row_bytes();
            b.upload_into(
                &mut w,
                chunk.start - rows.start,
                &self.staging.as_slice()[first..first + len],
            )?;
            // The copy reads from staging: finish it before the next read overwrites it.
            let ev = b.copies_done()?;
            b.host_waits(&ev)?;
        }
        Ok(w)
    }

    pub(super) fn vector<B: Backend>(&mut self, b: &B, name: &str) -> Result<B::Weight> {
        let seg = self.store.require(name).map_err(store_err)?;
        self.load_to_device(b, seg, 0..seg.rows, DType::F32)
    }

    pub(super) fn opt_vector<B: Backend>(
        &mut self,
        b: &B,
        name: &str,
    ) -> Result<Option<B::Weight>> {
        match self.store.segment(name) {
            Some(_) => self.vector(b, name).map(Some),
            None => Ok(None),
        }
    }
}

/// A whole tensor segment in a DRAM buffer (reserved), as a host tensor.
fn table(store: &Store, ledger: &Arc<Ledger>, name: &str) -> Result<Table> {
    let seg = store.require(name).map_err(store_err)?;
    if seg.kind != SegmentKind::Tensor {
        return Err(EngineError::Weights(format!("`{name}` is not a tensor")));
    }
    let hold = ledger
        .reserve(Tier::Dram, seg.bytes.next_multiple_of(4096), name)
        .map_err(|e| EngineError::Weights(e.to_string()))?;
    let t = store.tensor(name).map_err(store_err)?;
    ledger.count_ssd(seg.read_extent(0..seg.rows).1);
    Ok(Table { t, _hold: hold })
}

impl<B: Backend> StreamWeights<B> {
    /// Load what the plan keeps resident, fill the DRAM fixed area, start the preloader and
    /// prefetch the first `window` layers.
    pub fn new(b: &B, store: Arc<Store>, plan: &Plan, ledger: Arc<Ledger>) -> Result<Self> {
        Self::with_cpu_kernels(
            b,
            store,
            plan,
            ledger,
            crate::backend::cpu::kernels::best(),
            None,
        )
    }

    /// As [`Self::new`], with `kernels` for the neurons a split plan has the CPU compute; with
    /// `hot` (a plan from [`crate::plan::hybrid::plan_hot_streamed`], whose base plan this is), the
    /// FFN runs hybrid: its hot neurons on the device, the others on the CPU, attention as the
    /// plan streams it.
    pub fn with_cpu_kernels(
        b: &B,
        store: Arc<Store>,
        plan: &Plan,
        ledger: Arc<Ledger>,
        kernels: &'static crate::backend::cpu::kernels::Kernels,
        hot: Option<&crate::plan::hybrid::HybridPlan>,
    ) -> Result<Self> {
        let m = &store.manifest;
        if m.model_id != plan.model_id {
            return Err(EngineError::Weights(
                "the plan was made for another model".into(),
            ));
        }
        let spec = m.spec.clone();
        let (shape, residency) = (plan.shape, plan.residency);
        let n_layers = spec.n_layers;

        // Tables first: they stay in DRAM for the whole run.
        let embeddings = Embeddings::load(&store, &ledger, &spec)?;
        let mut loader = Loader::new(&store, &ledger, plan.dram.staging)?;
        let mut small = Vec::with_capacity(n_layers);
        let mut resident = Vec::with_capacity(n_layers);
        for l in 0..n_layers {
            small.push(Small::load(&mut loader, b, l)?);
            let mut parts: [Option<B::Weight>; PARTS] = Default::default();
            for p in Part::ALL {
                let r = residency.rows[p.index()];
                if r > 0 {
                    let seg = store.require(&part_segment_name(l, p)).map_err(store_err)?;
                    parts[p.index()] =
                        Some(loader.load_to_device(b, seg, 0..r, device_dtype(seg))?);
                }
            }
            resident.push(parts);
        }
        let head = Head::load(&mut loader, b, &store)?;
        drop(loader);

        let mut part_formats = vec![[(DType::F32, 0); PARTS]; n_layers];
        for (l, formats) in part_formats.iter_mut().enumerate() {
            for p in Part::ALL {
                if shape.rows[p.index()] > 0 {
                    let seg = store.require(&part_segment_name(l, p)).map_err(store_err)?;
                    formats[p.index()] = (device_dtype(seg), seg.cols);
                }
            }
        }
        let mut slots = Vec::with_capacity(plan.window);
        for i in 0..plan.window {
            let mut parts: [Option<B::Weight>; PARTS] = Default::default();
            for p in Part::ALL {
                let rows = residency.streamed_rows(&shape, p);
                if !rows.is_empty() {
                    // Sized for the layer whose rows of this part are widest.
                    let widest =
                        widest_dtype(m, p).map_err(|e| EngineError::Weights(e.to_string()))?;
                    parts[p.index()] = Some(b.alloc_weight(
                        &format!("slot {i} {}", p.name()),
                        widest,
                        rows.len(),
                        part_formats[0][p.index()].1,
                    )?);
                }
            }
            slots.push(Slot {
                parts,
                layer: None,
                ready: None,
            });
        }
        let dram = DramCache::new(
            store.clone(),
            ledger.clone(),
            shape,
            residency,
            n_layers,
            if plan.window == 0 {
                0
            } else {
                plan.dram.fixed_layers
            },
            plan.dram.dynamic_buffers,
            &|buf: &AlignedBuf| match b.pin_host(buf.as_slice()) {
                Ok(p) => p,
                Err(e) => {
                    tracing::warn!(
                        "cannot page-lock a DRAM buffer ({e}); copies from it will be slower"
                    );
                    None
                }
            },
        )
        .map_err(store_err)?;
        let matmuls = offload_matmuls(m).map_err(|e| EngineError::Weights(e.to_string()))?;
        let cpu_rows = residency.cpu_rows_of(&shape, Part::Ffn);
        let act = crate::backend::cpu::ops::activation(crate::engine::backend_act(spec.activation));
        let traffic = Arc::new(super::hybrid::ColdTraffic::default());
        let cpu_side = || super::hybrid::CpuSide {
            kernels,
            act,
            traffic: traffic.clone(),
        };
        let mut hot_ffn = Vec::new();
        let cpu = match hot {
            _ if cpu_rows.is_empty() && !residency.ffn_off => {
                if hot.is_some() {
                    return Err(EngineError::Weights(
                        "a hot-neuron plan needs a plan with the FFN off the device".into(),
                    ));
                }
                None
            }
            Some(h) => {
                if !residency.ffn_off || h.hot_neurons.len() != n_layers {
                    return Err(EngineError::Weights(
                        "the hot-neuron plan does not match this plan's FFN".into(),
                    ));
                }
                let mut layers = Vec::new();
                for (l, sm) in small.iter_mut().enumerate() {
                    let (part, cold) = super::hybrid::layer_ffn(
                        b,
                        &store,
                        &ledger,
                        l,
                        &h.hot_neurons[l],
                        h.cold_cost[l],
                        &mut sm.up_bias,
                        cpu_side(),
                    )?;
                    layers.push(cold);
                    hot_ffn.push(part);
                }
                Some(CpuShare {
                    layers,
                    device_ids: h.hot_neurons.clone(),
                    partial: b.alloc(plan.budget.batch.max(1), spec.d_model)?,
                    traffic,
                })
            }
            None if residency.ffn_off => {
                return Err(EngineError::Weights(
                    "a plan with the FFN off the device runs with its hot-neuron plan".into(),
                ));
            }
            None => {
                let layers = (0..n_layers)
                    .map(|l| {
                        super::hybrid::ColdLayer::bundle_rows(
                            &store,
                            &ledger,
                            l,
                            cpu_rows.clone(),
                            cpu_side(),
                        )
                    })
                    .collect::<Result<Vec<_>>>()?;
                Some(CpuShare {
                    layers,
                    device_ids: vec![(0..cpu_rows.start as u32).collect(); n_layers],
                    partial: b.alloc(plan.budget.batch.max(1), spec.d_model)?,
                    traffic,
                })
            }
        };
        let mut me = StreamWeights {
            cpu,
            hot_ffn,
            part_formats,
            matmuls,
            bundled: store.ffn_bundled(),
            bundle: BundleShape {
                parts: if spec.gated_ffn { 3 } else { 2 },
                d: spec.d_model,
            },
            spec,
            residency,
            small,
            resident,
            slots,
            pending: None,
            head,
            embeddings,
            dram,
        };
        for l in 0..me.slots.len() {
            me.fill(b, l, l)?;
        }
        Ok(me)
    }

    /// What the CPU has read for the FFN neurons of a split plan (none without a split).
    pub fn cpu_traffic(&self) -> Option<Arc<super::hybrid::ColdTraffic>> {
        self.cpu.as_ref().map(|c| c.traffic.clone())
    }

    /// Copy layer `layer`'s streamed share into slot `slot`.
    fn fill(&mut self, b: &B, slot: usize, layer: usize) -> Result<()> {
        // The previous fill's DRAM buffer can go back to the preloader once its copy is done.
        if let Some((ev, data)) = self.pending.take() {
            b.host_waits(&ev)?;
            drop(data);
        }
        let data = self.dram.get(layer).map_err(store_err)?;
        // Compute may still be reading the slot's previous layer.
        let freed = b.compute_done()?;
        b.copies_wait(&freed)?;
        let s = &mut self.slots[slot];
        for pd in &data.parts {
            let w = s.parts[pd.part.index()].as_mut().ok_or_else(|| {
                EngineError::Weights(format!("slot {slot} has no {} buffer", pd.part.name()))
            })?;
            // This layer's format of the part (layers may differ, as in K-quant mixes).
            let (dtype, cols) = self.part_formats[layer][pd.part.index()];
            b.retype_weight(w, dtype, pd.rows.len(), cols)?;
            b.upload_into(w, 0, pd.bytes())?;
        }
        s.layer = Some(layer);
        s.ready = Some(b.copies_done()?);
        self.pending = Some((b.copies_done()?, data));
        Ok(())
    }

    fn slot_of(&self, layer: usize) -> Option<usize> {
        self.slots.iter().position(|s| s.layer == Some(layer))
    }

    fn linear<'a>(
        resident: &'a [Option<B::Weight>; PARTS],
        slot: Option<&'a Slot<B>>,
        p: Part,
        r: usize,
        bias: Option<&'a B::Weight>,
    ) -> LinearView<'a, B> {
        let mut blocks = Vec::with_capacity(2);
        if let Some(w) = &resident[p.index()] {
            blocks.push((0, w));
        }
        if let Some(w) = slot.and_then(|s| s.parts[p.index()].as_ref()) {
            blocks.push((r, w));
        }
        LinearView { blocks, bias }
    }
}

impl<B: Backend> WeightSource<B> for StreamWeights<B> {
    fn embed(&mut self, b: &B, ids: &[u32], first_pos: usize, out: &mut B::Tensor) -> Result<()> {
        self.embeddings.embed(b, ids, first_pos, out)
    }

    fn rope_freq_factors(&self) -> Option<Vec<f32>> {
        self.head.rope_freq_factors()
    }

    fn layer(&mut self, b: &B, l: usize) -> Result<LayerView<'_, B>> {
        let k = self.slots.len();
        let slot = if k > 0 {
            // The slots hold a sliding window of the layers about to run; a miss (a pass that
            // did not start at layer 0) is filled now.
            let i = match self.slot_of(l) {
                Some(i) => i,
                None => {
                    self.fill(b, l % k, l)?;
                    l % k
                }
            };
            if let Some(ev) = &self.slots[i].ready {
                b.compute_waits(ev)?;
            }
            Some(&self.slots[i])
        } else {
            None
        };
        let rows = self.residency.rows;
        let res = &self.resident[l];
        let sm = &self.small[l];
        let ffn_runs = {
            let mut runs = Vec::with_capacity(2);
            if let Some(w) = &res[Part::Ffn.index()] {
                runs.push((0, w));
            }
            if let Some(w) = slot.and_then(|s| s.parts[Part::Ffn.index()].as_ref()) {
                runs.push((rows[Part::Ffn.index()], w));
            }
            runs
        };
        Ok(LayerView {
            attn_norm: sm.attn_norm(),
            wq: Self::linear(
                res,
                slot,
                Part::Q,
                rows[Part::Q.index()],
                sm.attn_bias[0].as_ref(),
            ),
            wk: Self::linear(
                res,
                slot,
                Part::K,
                rows[Part::K.index()],
                sm.attn_bias[1].as_ref(),
            ),
            wv: Self::linear(
                res,
                slot,
                Part::V,
                rows[Part::V.index()],
                sm.attn_bias[2].as_ref(),
            ),
            wo: Self::linear(
                res,
                slot,
                Part::O,
                rows[Part::O.index()],
                sm.attn_bias[3].as_ref(),
            ),
            ffn_norm: sm.ffn_norm(),
            ffn: if let Some(hot) = self.hot_ffn.get(l) {
                hot.view(sm, self.bundle, self.spec.gated_ffn)
            } else if self.bundled {
                FfnView::Bundles {
                    runs: ffn_runs,
                    shape: self.bundle,
                    up_bias: sm.up_bias.as_ref(),
                    down_bias: sm.down_bias.as_ref(),
                }
            } else {
                let part = |p: Part, bias| Self::linear(res, slot, p, rows[p.index()], bias);
                FfnView::Matrices {
                    gate: self.spec.gated_ffn.then(|| part(Part::Gate, None)),
                    up: part(Part::Up, sm.up_bias.as_ref()),
                    down: part(Part::Down, sm.down_bias.as_ref()),
                }
            },
            cold: self.cpu.as_mut().map(|c| ColdView {
                neurons: &c.layers[l],
                hot: &c.device_ids[l],
                partial: &mut c.partial,
            }),
            unit: None,
        })
    }

    fn layer_done(&mut self, b: &B, l: usize) -> Result<()> {
        let k = self.slots.len();
        if k == 0 {
            return Ok(());
        }
        // Refill this layer's slot with the layer `k` ahead (wrapping to the next pass).
        let next = (l + k) % self.spec.n_layers;
        let i = self.slot_of(l).unwrap_or(l % k);
        self.fill(b, i, next)
    }

    fn head(&mut self, _: &B) -> Result<HeadView<'_, B>> {
        Ok(self.head.view())
    }

    fn head_done(&mut self, _: &B) -> Result<()> {
        Ok(())
    }

    fn settle(&mut self) {
        self.dram.settle();
    }

    fn matmuls(&self) -> MatmulShapes {
        self.matmuls.clone()
    }

    /// No streaming slots and no CPU-side neurons: every layer is resident, and the passes
    /// issue nothing but the ops.
    fn fixed(&self) -> bool {
        self.slots.is_empty() && self.cpu.is_none()
    }
}
