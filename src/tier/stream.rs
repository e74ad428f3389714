//! The streaming weight source: runs a [`Plan`] on any backend. Small fragments, the output
//! matrix and every layer's resident share live on the device for good; each layer's streamed
//! share goes SSD → DRAM (the [`DramCache`]) → one of `window` device slots, copied in while the
//! layers before it compute (FlexInfer's prefetch window), the compute stream waiting on the copy
//! event and the slot refilled as soon as its layer is done. With the split, or hybrid over
//! streamed attention, part of the FFN is the CPU's ([`super::split`]).
//!
//! Weights come from the store in its encodings (the model's own; a float model's FFN as f16
//! neuron bundles, a block-quantized model's as its matrices); embeddings are looked up in DRAM.

use std::sync::Arc;

use super::cold::ColdTraffic;
use super::dram::{DramCache, LayerData};
use super::hybrid::HotFfn;
use super::resident::{Embeddings, Head, Loader, Small};
use super::split::{CpuShare, FfnShares};
use super::units::{UnitFfns, UnitFfnsLoader, UnitLayout, UnitTraffic};
use crate::backend::{Act, Backend, BundleShape};
use crate::engine::trace::{Phase, span};
use crate::engine::{
    ColdMerge, ColdView, EngineError, FfnView, HeadView, LayerView, LinearView, Result,
    WeightSource,
};
use crate::footprint::MatmulShapes;
use crate::footprint::ledger::Ledger;
use crate::model::ModelSpec;
use crate::plan::hybrid::HybridPlan;
use crate::plan::{
    PARTS, Part, Plan, Residency, device_dtype, offload_matmuls, part_segment_name, widest_dtype,
};
use crate::store::{Manifest, Store, StoreError};
use crate::tensor::{AlignedBuf, DType};

fn store_err(e: StoreError) -> EngineError {
    EngineError::Weights(e.to_string())
}

/// Device buffers one streamed layer passes through.
struct Slot<B: Backend> {
    parts: [Option<B::Weight>; PARTS],
    layer: Option<usize>,
    ready: Option<B::Event>,
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
    hot_ffn: Vec<HotFfn<B>>,
    /// Cache units with streamed attention: every layer's unit (or hybrid layer); none
    /// otherwise.
    units: Option<UnitFfns<B>>,
}

/// What runs a streamed plan's FFN beside (or instead of) the slots: the CPU (the split's rows,
/// or hybrid's cold neurons with `Some` hot-neuron plan), or cache units.
enum Beside<'a> {
    Cpu(Option<&'a HybridPlan>),
    Units(&'a UnitLayout<'a>, Act),
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
        hot: Option<&HybridPlan>,
    ) -> Result<Self> {
        Self::build(b, store, plan, ledger, kernels, Beside::Cpu(hot))
    }

    /// Cache units beside streamed attention: `plan` (from
    /// [`crate::plan::units::plan_units_streamed`], the units' base plan) streams attention and
    /// keeps the FFN off the device; each layer's FFN runs from its unit of `units` (or hybrid,
    /// where the layout says, with `kernels` and `act` for the CPU's neurons).
    pub fn with_units(
        b: &B,
        store: Arc<Store>,
        plan: &Plan,
        ledger: Arc<Ledger>,
        kernels: &'static crate::backend::cpu::kernels::Kernels,
        units: &UnitLayout,
        act: Act,
    ) -> Result<Self> {
        if !plan.residency.ffn_off {
            return Err(EngineError::Weights(
                "cache units beside streamed attention need a plan with the FFN off the device"
                    .into(),
            ));
        }
        Self::build(b, store, plan, ledger, kernels, Beside::Units(units, act))
    }

    /// What the cache units have moved so far (none without units).
    pub fn unit_traffic(&self) -> Option<Arc<UnitTraffic>> {
        self.units.as_ref().map(|u| u.traffic())
    }

    fn build(
        b: &B,
        store: Arc<Store>,
        plan: &Plan,
        ledger: Arc<Ledger>,
        kernels: &'static crate::backend::cpu::kernels::Kernels,
        beside: Beside,
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
        let ResidentShare {
            embeddings,
            mut small,
            resident,
            head,
        } = ResidentShare::load(b, &store, &ledger, plan)?;
        let part_formats = part_formats(&store, &shape, n_layers)?;
        let slots = alloc_slots(b, m, plan, &part_formats)?;
        let dram = dram_cache(b, &store, &ledger, plan)?;
        let matmuls = offload_matmuls(m).map_err(|e| EngineError::Weights(e.to_string()))?;
        let (FfnShares { cpu, hot_ffn }, units) = match beside {
            Beside::Cpu(hot) => (
                CpuShare::for_plan(b, &store, &ledger, plan, &mut small, kernels, hot)?,
                None,
            ),
            Beside::Units(layout, act) => {
                let loader = UnitFfnsLoader::new(&store, layout, kernels, act)?;
                let units = loader.load_all(b, &store, &ledger, &mut small)?;
                let none = FfnShares {
                    cpu: None,
                    hot_ffn: Vec::new(),
                };
                (none, Some(units))
            }
        };
        let mut me = StreamWeights {
            cpu,
            hot_ffn,
            units,
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
    pub fn cpu_traffic(&self) -> Option<Arc<ColdTraffic>> {
        self.cpu.as_ref().map(|c| c.traffic.clone())
    }

    /// Copy layer `layer`'s streamed share into slot `slot`.
    fn fill(&mut self, b: &B, slot: usize, layer: usize) -> Result<()> {
        // The previous fill's DRAM buffer can go back to the preloader once its copy is done.
        let wait = span(Phase::HostWait);
        if let Some((ev, data)) = self.pending.take() {
            b.host_waits(&ev)?;
            drop(data);
        }
        // The preloader may still be reading the layer into DRAM.
        let data = self.dram.get(layer).map_err(store_err)?;
        drop(wait);
        // Compute may still be reading the slot's previous layer.
        let freed = b.compute_done()?;
        b.copies_wait(&freed)?;
        let s = &mut self.slots[slot];
        let _copy = span(Phase::H2d);
        for pd in &data.parts {
            let w = s.parts[pd.part.index()].as_mut().ok_or_else(|| {
                EngineError::Weights(format!("slot {slot} has no {} buffer", pd.part.name()))
            })?;
            // This layer's format of the part (layers may differ, as in K-quant mixes).
            let (dtype, cols) = self.part_formats[layer][pd.part.index()];
            b.retype_weight(w, dtype, pd.rows.len(), cols)?;
            if pd.laid_out() {
                b.upload_laid_out(w, pd.bytes())?;
            } else {
                b.upload_into(w, 0, pd.bytes())?;
            }
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

/// What a streaming source loads to stay: the embedding tables in DRAM, and on the device each
/// layer's norms and biases, each layer's resident row prefix of every part, and the head.
struct ResidentShare<B: Backend> {
    embeddings: Embeddings,
    small: Vec<Small<B>>,
    resident: Vec<[Option<B::Weight>; PARTS]>,
    head: Head<B>,
}

impl<B: Backend> ResidentShare<B> {
    /// Load what `plan` keeps resident, through a staging buffer of the plan's size.
    fn load(b: &B, store: &Arc<Store>, ledger: &Arc<Ledger>, plan: &Plan) -> Result<Self> {
        let residency = plan.residency;
        let n_layers = store.manifest.spec.n_layers;
        // Tables first: they stay in DRAM for the whole run.
        let embeddings = Embeddings::load(store, ledger, &store.manifest.spec)?;
        let mut loader = Loader::new(store, ledger, plan.dram.staging)?;
        let mut small = Vec::with_capacity(n_layers);
        let mut resident = Vec::with_capacity(n_layers);
        for l in 0..n_layers {
            small.push(Small::load(&mut loader, b, l)?);
            let mut parts: [Option<B::Weight>; PARTS] = Default::default();
            for p in Part::ALL {
                let r = residency.rows[p.index()];
                if r > 0 {
                    let seg = store.require(&part_segment_name(l, p)).map_err(store_err)?;
                    // Attention's rows are only multiplied: laid out for the products.
                    parts[p.index()] = Some(if Part::ATTENTION.contains(&p) {
                        loader.load_matrix(b, seg, 0..r)?
                    } else {
                        loader.load_to_device(b, seg, 0..r, device_dtype(seg))?
                    });
                }
            }
            resident.push(parts);
        }
        let head = Head::load(&mut loader, b, store)?;
        drop(loader);
        Ok(ResidentShare {
            embeddings,
            small,
            resident,
            head,
        })
    }
}

/// Per layer, each streamed part's device format and columns (layers may differ, as in K-quant
/// mixes).
fn part_formats(
    store: &Store,
    shape: &crate::plan::LayerShape,
    n_layers: usize,
) -> Result<Vec<[(DType, usize); PARTS]>> {
    let mut part_formats = vec![[(DType::F32, 0); PARTS]; n_layers];
    for (l, formats) in part_formats.iter_mut().enumerate() {
        for p in Part::ALL {
            if shape.rows[p.index()] > 0 {
                let seg = store.require(&part_segment_name(l, p)).map_err(store_err)?;
                formats[p.index()] = (device_dtype(seg), seg.cols);
            }
        }
    }
    Ok(part_formats)
}

/// The `plan.window` device slots streamed layers pass through, each part sized for the layer
/// whose rows of it are widest.
fn alloc_slots<B: Backend>(
    b: &B,
    m: &Manifest,
    plan: &Plan,
    part_formats: &[[(DType, usize); PARTS]],
) -> Result<Vec<Slot<B>>> {
    let (shape, residency) = (plan.shape, plan.residency);
    let mut slots = Vec::with_capacity(plan.window);
    for i in 0..plan.window {
        let mut parts: [Option<B::Weight>; PARTS] = Default::default();
        for p in Part::ALL {
            let rows = residency.streamed_rows(&shape, p);
            if !rows.is_empty() {
                // Sized for the layer whose rows of this part are widest.
                let widest = widest_dtype(m, p).map_err(|e| EngineError::Weights(e.to_string()))?;
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
    Ok(slots)
}

/// The DRAM cache of the streamed parts (the plan's fixed area, where anything streams, and
/// dynamic buffers), its buffers page-locked where the backend can.
fn dram_cache<B: Backend>(
    b: &B,
    store: &Arc<Store>,
    ledger: &Arc<Ledger>,
    plan: &Plan,
) -> Result<DramCache> {
    let n_layers = store.manifest.spec.n_layers;
    let (shape, residency) = (plan.shape, plan.residency);
    DramCache::new(
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
        (
            &|buf: &AlignedBuf| match b.pin_host(buf.as_slice()) {
                Ok(p) => p,
                Err(e) => {
                    tracing::warn!(
                        "cannot page-lock a DRAM buffer ({e}); copies from it will be slower"
                    );
                    None
                }
            },
            b.host_matrix_layout(),
        ),
    )
    .map_err(store_err)
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
                super::compute_waits_for(b, ev)?;
            }
            Some(&self.slots[i])
        } else {
            None
        };
        let rows = self.residency.rows;
        let res = &self.resident[l];
        let sm = &self.small[l];
        // Cache units: the layer's unit (or hybrid layer) in place of the FFN's rows.
        let (unit_ffn, unit_cold, unit) = match self.units.as_mut() {
            Some(u) => {
                let (f, c, n) = u.layer(l, sm)?;
                (Some(f), c, n)
            }
            None => (None, None, None),
        };
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
            qk_norm: sm.qk_norm(),
            router: None,
            ffn_norm: sm.ffn_norm(),
            ffn: if let Some(u) = unit_ffn {
                u
            } else if let Some(hot) = self.hot_ffn.get(l) {
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
            cold: match unit_cold {
                Some(c) => Some(c),
                None => self.cpu.as_mut().map(|c| ColdView {
                    neurons: &c.layers[l],
                    hot: &c.device_ids[l],
                    merge: match c.partial.as_mut() {
                        Some(partial) => ColdMerge::Add(partial),
                        None => ColdMerge::Continue,
                    },
                }),
            },
            unit,
            experts: None,
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
        self.slots.is_empty() && self.cpu.is_none() && self.units.is_none()
    }
}
