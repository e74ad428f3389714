//! A mixture-of-experts model's experts offloaded ([`crate::plan::experts`]): every layer's
//! attention, router, norms and shared expert resident on the device with the head; each
//! layer's routed experts in DRAM, read whole from the store (each expert one slice of each
//! stack, as the GGUF holds it), and on the device a unit of whole-expert slots.
//!
//! A step's routes split between the unit (the experts it holds, and the shared expert's parts
//! pinned after the routed slots) and the CPU (the others, computed from DRAM while the device
//! computes its share: the engine's offloaded MoE step). After the step the unit takes in the
//! missed experts the ATU admits ([`SlotMap::admit`]: with a routing profile the stale expert it
//! ranks lowest gives way, else the least recently routed), as many as the plan's copy budget
//! allows, each one copy of its gate, up and down rows queued behind the step's compute; the
//! next step that computes from the unit waits for them on the device, the host never does. A
//! unit starts with every expert where it holds them all, else with the profile's most routed
//! (empty without a profile). A prompt's step may bring the experts its unit lacks through a
//! stream area instead, for the device to compute.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

use super::atu::{CopyBudget, Eviction, Load, SlotMap};
use super::expert_host::{HostExperts, MATRICES, Reader, distinct_experts};
use super::expert_low_bit::LowBitArea;
use super::resident::{Resident, Small, resident_source};
use crate::backend::cpu::CpuBackend;
use crate::backend::cpu::kernels::Kernels;
use crate::backend::{Act, Backend, Experts, Route};
use crate::engine::{
    EngineError, ExpertCache, ExpertsView, FfnView, HeadView, LayerView, Result, WeightSource,
};
use crate::footprint::MatmulShapes;
use crate::footprint::ledger::{Ledger, Reservation, Tier};
use crate::model::ModelSpec;
use crate::model::spec::MoeSpec;
use crate::plan::device_dtype;
use crate::plan::expert_low_bit::LOW_BIT_ROWS;
use crate::plan::experts::ExpertPlan;
use crate::plan::manifest::router_segment_name;
use crate::sparsity::routing::NextRouter;
use crate::store::names;
use crate::store::{Store, StoreError};

fn store_err(e: StoreError) -> EngineError {
    EngineError::Weights(e.to_string())
}

fn weights_err(e: impl std::fmt::Display) -> EngineError {
    EngineError::Weights(e.to_string())
}

/// What the expert units and the CPU have done so far, summed over layers and steps.
#[derive(Default)]
pub struct ExpertTraffic {
    needed: AtomicU64,
    hits: AtomicU64,
    copies: AtomicU64,
    copy_bytes: AtomicU64,
    cpu_experts: AtomicU64,
    cpu_bytes: AtomicU64,
    streamed: AtomicU64,
    stream_bytes: AtomicU64,
    guessed: AtomicU64,
    guessed_right: AtomicU64,
    prefetched: AtomicU64,
    ssd_experts: AtomicU64,
    ssd_bytes: AtomicU64,
    low_bit_experts: AtomicU64,
    low_bit_bytes: AtomicU64,
}

/// A snapshot of [`ExpertTraffic`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ExpertCounts {
    /// Distinct routed experts a layer's step needed, summed over layers and steps.
    pub needed: u64,
    /// Of them, on the device when needed.
    pub hits: u64,
    /// Experts copied into units (after start-up), and their bytes.
    pub copies: u64,
    pub copy_bytes: u64,
    /// Experts the CPU computed (each read once a step), and their bytes.
    pub cpu_experts: u64,
    pub cpu_bytes: u64,
    /// Experts a prompt's steps brought through the stream area, and their bytes.
    pub streamed: u64,
    pub stream_bytes: u64,
    /// Next-layer prefetch: the distinct experts guessed for a layer from the previous layer's
    /// FFN input, of them those the layer then routed to, and the copies the guesses started
    /// (counted in `copies` too).
    pub guessed: u64,
    pub guessed_right: u64,
    pub prefetched: u64,
    /// The SSD tier: experts read from the store (for the CPU, a copy or the stream area),
    /// and their bytes as stored.
    pub ssd_experts: u64,
    pub ssd_bytes: u64,
    /// Mixed precision: low-ranked misses computed on the device from low-bit copies (counted
    /// a step a layer, distinct), and the copies' bytes.
    pub low_bit_experts: u64,
    pub low_bit_bytes: u64,
}

impl ExpertCounts {
    pub fn hit_ratio(&self) -> f64 {
        if self.needed == 0 {
            1.0
        } else {
            self.hits as f64 / self.needed as f64
        }
    }

    /// The share of guessed experts the layer then routed to (`None`: nothing guessed).
    pub fn guess_precision(&self) -> Option<f64> {
        (self.guessed > 0).then(|| self.guessed_right as f64 / self.guessed as f64)
    }
}

impl ExpertTraffic {
    pub fn snapshot(&self) -> ExpertCounts {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ExpertCounts {
            needed: get(&self.needed),
            hits: get(&self.hits),
            copies: get(&self.copies),
            copy_bytes: get(&self.copy_bytes),
            cpu_experts: get(&self.cpu_experts),
            cpu_bytes: get(&self.cpu_bytes),
            streamed: get(&self.streamed),
            stream_bytes: get(&self.stream_bytes),
            guessed: get(&self.guessed),
            guessed_right: get(&self.guessed_right),
            prefetched: get(&self.prefetched),
            ssd_experts: get(&self.ssd_experts),
            ssd_bytes: get(&self.ssd_bytes),
            low_bit_experts: get(&self.low_bit_experts),
            low_bit_bytes: get(&self.low_bit_bytes),
        }
    }
}

/// The distinct routed experts (ids below `experts`) of a step's routes, most wanted first: by
/// the sum of their weights over the step's rows, ties to the lower id. What a unit's ATU takes
/// a step at a time (and the reference simulation replays).
pub fn active_experts(routes: &[Route], experts: usize) -> Vec<u32> {
    let mut want: Vec<(u32, f32)> = Vec::new();
    for r in routes.iter().filter(|r| (r.expert as usize) < experts) {
        match want.iter_mut().find(|(e, _)| *e == r.expert) {
            Some((_, w)) => *w += r.weight,
            None => want.push((r.expert, r.weight)),
        }
    }
    want.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    want.into_iter().map(|(e, _)| e).collect()
}

/// One layer's experts: on the host (the stacks in DRAM, or the SSD tier's cache), the unit
/// on the device and its slot map.
struct LayerExperts<B: Backend> {
    host: HostExperts,
    /// The unit's gate, up and down: the routed slots, then the shared expert's parts.
    unit: Option<[B::Weight; 3]>,
    /// The routed slots' map (none without routed slots: the shared parts start at slot 0).
    map: Option<SlotMap>,
    /// The copies the unit may start a step.
    copies: CopyBudget,
    /// The copies last queued into the unit.
    landed: Option<B::Event>,
    /// This step's copy budget was opened by the previous layer's prefetch.
    opened: bool,
    /// The experts the previous layer guessed for this step (compared with the routed ones).
    guess: Option<Vec<u32>>,
}

impl<B: Backend> LayerExperts<B> {
    /// Copy expert `e` into slot `slot` of the unit, on the copy queue, from DRAM or (the SSD
    /// tier, where DRAM lacks it) a read of the store; its bytes and whether it was read.
    fn copy_in(
        &mut self,
        b: &B,
        e: usize,
        slot: usize,
        reader: &mut Reader,
    ) -> Result<(u64, bool)> {
        let unit = self
            .unit
            .as_mut()
            .ok_or_else(|| weights_err("a copy into a layer without a unit"))?;
        let (mut bytes, mut read) = (0, false);
        for (i, w) in unit.iter_mut().enumerate() {
            let (src, from_store) = self.host.expert(i, e, reader)?;
            b.upload_into(w, slot * self.host.rows(i), src)?;
            bytes += src.len() as u64;
            read |= from_store;
        }
        Ok((bytes, read))
    }

    /// The copies this step may still start: its budget opened here, or by the previous layer's
    /// prefetch.
    fn allowed(&mut self) -> usize {
        if std::mem::take(&mut self.opened) {
            self.copies.left()
        } else {
            self.copies.allow()
        }
    }

    /// Copy `loads` into their slots behind the compute queued so far (the reads of the slots
    /// they overwrite); the unit's next use waits for them. On failure the map forgets them:
    /// the unit must not claim experts it never received.
    fn copy_loads(
        &mut self,
        b: &B,
        loads: &[Load],
        reader: &mut Reader,
        traffic: &ExpertTraffic,
    ) -> Result<u64> {
        let copied = (|| {
            let free = b.compute_done()?;
            b.copies_wait(&free)?;
            let mut bytes = 0;
            for l in loads {
                let (n, read) = self.copy_in(b, l.neuron as usize, l.slot as usize, reader)?;
                bytes += n;
                if read {
                    traffic.ssd_experts.fetch_add(1, Ordering::Relaxed);
                    traffic.ssd_bytes.fetch_add(n, Ordering::Relaxed);
                }
            }
            self.landed = Some(b.copies_done()?);
            Ok(bytes)
        })();
        if copied.is_err()
            && let Some(map) = self.map.as_mut()
        {
            map.forget(loads);
        }
        copied
    }
}

/// Steps of at most this many rows guess the next layer's experts: a guess costs the CPU
/// `rows × experts × d_model` multiply-adds before the layer's own work, and beyond a few rows
/// the copy budget takes only a small part of what is guessed.
pub const PREFETCH_ROWS: usize = 8;

/// Where a prompt's missed experts pass through: one layer's routed stacks, each matrix
/// allocated as wide as its widest layer's and re-typed for the layer it holds.
struct StreamArea<B: Backend> {
    stacks: [B::Weight; 3],
    /// Steps of at least this many rows stream.
    rows: usize,
}

/// The CPU's side: its backend and the experts' activation.
struct CpuSide {
    backend: CpuBackend,
    act: Act,
    width: usize,
    d: usize,
}

pub struct ExpertWeights<B: Backend> {
    resident: Resident<B>,
    routers: Vec<B::Weight>,
    layers: Vec<LayerExperts<B>>,
    partial: B::Tensor,
    stream: Option<StreamArea<B>>,
    cpu: CpuSide,
    experts: usize,
    traffic: Arc<ExpertTraffic>,
    /// Per layer, the next layer's router as it guesses from this layer's FFN input (where the
    /// plan prefetches into the next layer's unit), and their host memory.
    next: Vec<Option<NextRouter>>,
    _next_hold: Option<Reservation>,
    moe: MoeSpec,
    /// The SSD tier's reads of the store.
    reader: Reader,
    /// Mixed precision's low-bit copies and device area.
    low: Option<LowBitArea<B>>,
}

impl<B: Backend> ExpertWeights<B> {
    /// Load what `plan` places: everything but the routed experts on the device, each layer's
    /// unit of `plan`'s slots (the shared expert's parts copied in, and every expert where the
    /// unit holds them all), the experts' stacks in DRAM; the CPU computes with `kernels` on
    /// `threads` threads (0: all).
    pub fn new(
        b: &B,
        store: Arc<Store>,
        plan: &ExpertPlan,
        ledger: Arc<Ledger>,
        kernels: &'static Kernels,
        threads: usize,
        act: Act,
    ) -> Result<Self> {
        let m = &store.manifest;
        if m.model_id != plan.plan.model_id {
            return Err(weights_err("the expert plan was made for another model"));
        }
        let spec: &ModelSpec = &m.spec;
        let moe = spec
            .moe
            .clone()
            .ok_or_else(|| weights_err("an expert plan for a model without experts"))?;
        if plan.layers.len() != spec.n_layers {
            return Err(weights_err("the expert plan has another number of layers"));
        }
        let cpu = CpuBackend::with_kernels(threads, kernels)?;
        let mut reader = Reader::new(store.clone(), ledger.clone(), plan.host.read_buffer)?;
        let mut routers = Vec::with_capacity(spec.n_layers);
        let mut layers = Vec::with_capacity(spec.n_layers);
        let resident = Resident::load(
            b,
            &store,
            &ledger,
            plan.staging,
            |l, _: &mut Small<B>, loader| {
                let seg = store.require(&router_segment_name(l)).map_err(store_err)?;
                routers.push(loader.load_to_device(b, seg, 0..seg.rows, device_dtype(seg))?);
                layers.push(load_layer(
                    b,
                    (&store, &ledger, &cpu),
                    plan,
                    (l, &moe),
                    &mut reader,
                )?);
                Ok(())
            },
        )?;
        let (next, next_hold) = next_routers(&store, plan, &ledger, &cpu)?;
        let low = match &plan.low_bit {
            Some(lb) => {
                let stacks = layers
                    .iter()
                    .map(|x: &LayerExperts<B>| {
                        let s = |i| {
                            x.host.stack(i).ok_or_else(|| {
                                weights_err("low-bit experts need every expert's stacks in DRAM")
                            })
                        };
                        Ok([s(0)?, s(1)?, s(2)?])
                    })
                    .collect::<Result<Vec<_>>>()?;
                Some(LowBitArea::new(
                    b,
                    lb,
                    &stacks,
                    (moe.experts, moe.experts + moe.shared),
                    (&ledger, spec.d_model),
                )?)
            }
            None => None,
        };
        let partial = b.alloc(plan.batch.max(1), spec.d_model)?;
        let stream = match plan.stream_rows {
            Some(rows) => Some(StreamArea {
                stacks: stream_area(b, &layers, moe.experts)?,
                rows,
            }),
            None => None,
        };
        Ok(ExpertWeights {
            resident,
            routers,
            layers,
            partial,
            stream,
            cpu: CpuSide {
                backend: cpu,
                act,
                width: moe.d_expert,
                d: spec.d_model,
            },
            experts: moe.experts,
            traffic: Arc::new(ExpertTraffic::default()),
            next,
            _next_hold: next_hold,
            moe,
            reader,
            low,
        })
    }

    /// What the units and the CPU have done so far.
    pub fn traffic(&self) -> Arc<ExpertTraffic> {
        self.traffic.clone()
    }
}

/// The eviction of layer `l`'s caches (its unit and, with the SSD tier, its DRAM cache): stale
/// experts give way by the profile's ranking, or least recently routed first.
fn eviction_of(plan: &ExpertPlan, l: usize) -> Eviction {
    match plan.scores.get(l) {
        Some(score) => Eviction::Frequency(score.clone()),
        None => Eviction::Recency,
    }
}

/// Layer `l`'s experts as `plan` places them: on the host (every stack, or the SSD tier's
/// cache), on the device a unit of the plan's slots with the shared expert's parts copied in,
/// starting with every expert where it holds them all, else with the profile's most routed
/// (empty without one).
fn load_layer<B: Backend>(
    b: &B,
    (store, ledger, cpu): (&Store, &Arc<Ledger>, &CpuBackend),
    plan: &ExpertPlan,
    (l, moe): (usize, &MoeSpec),
    reader: &mut Reader,
) -> Result<LayerExperts<B>> {
    let all = moe.experts + moe.shared;
    let cache = plan
        .host
        .dram_slots
        .as_ref()
        .map(|ds| (ds[l].min(moe.experts), eviction_of(plan, l)));
    let host = HostExperts::load(b, (store, ledger), cpu, (l, moe.experts, all), cache)?;
    let slots = plan.layers[l].slots.min(moe.experts);
    let mut layer = LayerExperts {
        unit: None,
        map: None,
        copies: CopyBudget::new(plan.copies_per_step),
        landed: None,
        opened: false,
        guess: None,
        host,
    };
    if slots + moe.shared > 0 {
        let mut unit = Vec::with_capacity(3);
        for i in 0..3 {
            let seg = layer.host.segment(i);
            unit.push(b.alloc_weight(
                &format!("{} unit", seg.name),
                device_dtype(seg),
                (slots + moe.shared) * layer.host.rows(i),
                seg.cols,
            )?);
        }
        layer.unit = Some(
            unit.try_into()
                .map_err(|_| weights_err("three expert matrices"))?,
        );
        // The shared expert's parts, pinned after the routed slots.
        for i in 0..moe.shared {
            layer.copy_in(b, moe.experts + i, slots + i, reader)?;
        }
    }
    if slots > 0 {
        let mut map =
            SlotMap::new(moe.experts, slots, eviction_of(plan, l)).map_err(weights_err)?;
        let seed: Vec<u32> = if slots == moe.experts {
            (0..slots as u32).collect()
        } else {
            plan.seeds.get(l).cloned().unwrap_or_default()
        };
        let (_, loads) = map.admit(&seed, seed.len()).map_err(weights_err)?;
        for ld in &loads {
            layer.copy_in(b, ld.neuron as usize, ld.slot as usize, reader)?;
        }
        layer.map = Some(map);
    }
    let ev = b.copies_done()?;
    b.host_waits(&ev)?;
    Ok(layer)
}

/// Per layer, the guess router of the next layer where the plan prefetches into its unit
/// ([`ExpertPlan::prefetches`]), built from the store's routers and FFN norms, and the host
/// memory they hold, reserved in the ledger.
fn next_routers(
    store: &Store,
    plan: &ExpertPlan,
    ledger: &Arc<Ledger>,
    cpu: &CpuBackend,
) -> Result<(Vec<Option<NextRouter>>, Option<Reservation>)> {
    let layers = plan.layers.len();
    let mut next: Vec<Option<NextRouter>> = (0..layers).map(|_| None).collect();
    let want: Vec<usize> = (1..layers).filter(|&l| plan.prefetches(l)).collect();
    if want.is_empty() {
        return Ok((next, None));
    }
    let d = store.manifest.spec.d_model;
    let bytes = want.len() as u64 * NextRouter::bytes_for(plan.experts, d);
    let hold = ledger
        .reserve(Tier::Dram, bytes, "next-layer guess routers")
        .map_err(weights_err)?;
    let norm = |l: usize| {
        store
            .tensor(&names::layer(l, "ffn_norm.weight"))
            .map_err(store_err)
    };
    for l in want {
        let router = store.tensor(&router_segment_name(l)).map_err(store_err)?;
        next[l - 1] = Some(
            NextRouter::new(cpu, &router, &norm(l - 1)?, &norm(l)?, plan.experts)
                .map_err(weights_err)?,
        );
    }
    Ok((next, Some(hold)))
}

/// The stream area on the device: per matrix, the routed stack of the layer whose stack takes
/// most bytes, in that layer's format.
fn stream_area<B: Backend>(
    b: &B,
    layers: &[LayerExperts<B>],
    experts: usize,
) -> Result<[B::Weight; 3]> {
    let mut area = Vec::with_capacity(3);
    for (i, which) in MATRICES.iter().enumerate() {
        let bytes = |l: usize| layers[l].host.rows(i) * layers[l].host.segment(i).row_bytes();
        let widest = (0..layers.len())
            .max_by_key(|&l| (bytes(l), std::cmp::Reverse(l)))
            .ok_or_else(|| weights_err("a model without layers"))?;
        let seg = layers[widest].host.segment(i);
        let rows = experts * layers[widest].host.rows(i);
        area.push(b.alloc_weight(
            &format!("{which} stream area"),
            device_dtype(seg),
            rows,
            seg.cols,
        )?);
    }
    area.try_into()
        .map_err(|_| weights_err("three expert matrices"))
}

/// One layer's experts for one step.
struct ExpertStep<'a, B: Backend> {
    layer: &'a mut LayerExperts<B>,
    /// The next layer's experts and the router that guesses them from this layer's input,
    /// where the plan prefetches into them.
    next: Option<(&'a mut LayerExperts<B>, &'a NextRouter)>,
    stream: Option<&'a mut StreamArea<B>>,
    cpu: &'a CpuSide,
    experts: usize,
    moe: &'a MoeSpec,
    traffic: &'a ExpertTraffic,
    reader: &'a mut Reader,
    /// Mixed precision's area, and this layer's index into it.
    low: Option<(&'a mut LowBitArea<B>, usize)>,
}

impl<B: Backend> ExpertCache<B> for ExpertStep<'_, B> {
    fn split(&mut self, b: &B, routes: &[Route]) -> Result<(Vec<Route>, Vec<Route>)> {
        let (mut device, mut cpu) = (Vec::new(), Vec::new());
        for r in routes {
            let e = r.expert as usize;
            let slot = if e >= self.experts {
                // A shared expert's part: pinned after the routed slots.
                Some((self.layer.map.as_ref().map_or(0, SlotMap::slots) + e - self.experts) as u32)
            } else {
                self.layer.map.as_ref().and_then(|m| m.slot_of(r.expert))
            };
            match slot {
                Some(s) => device.push(Route { expert: s, ..*r }),
                None => cpu.push(*r),
            }
        }
        if !device.is_empty()
            && let Some(ev) = self.layer.landed.take()
        {
            super::compute_waits_for(b, &ev)?;
        }
        Ok((device, cpu))
    }

    fn unit(&self) -> Option<Experts<'_, B::Weight>> {
        let width = self.cpu.width;
        self.layer.unit.as_ref().map(|u| Experts::gated(u, width))
    }

    fn cpu_ffn(&mut self, x: &[f32], n: usize, routes: &[Route], out: &mut [f32]) -> Result<()> {
        let c = self.cpu;
        let w = self.layer.host.cpu_ffn(
            (&c.backend, c.act, c.width),
            (x, n, c.d),
            routes,
            self.reader,
            out,
        )?;
        let t = self.traffic;
        t.cpu_experts.fetch_add(w.cpu_experts, Ordering::Relaxed);
        t.cpu_bytes.fetch_add(w.cpu_bytes, Ordering::Relaxed);
        t.ssd_experts.fetch_add(w.ssd_experts, Ordering::Relaxed);
        t.ssd_bytes.fetch_add(w.ssd_bytes, Ordering::Relaxed);
        crate::engine::trace::add_cpu_bytes(w.cpu_bytes);
        Ok(())
    }

    fn streams(&self, n: usize) -> bool {
        self.stream.as_ref().is_some_and(|s| n >= s.rows)
    }

    /// Copies `routes`' experts into the stream area, re-typed for this layer, behind the
    /// compute queued so far (the area's last reader); the device waits for them.
    fn stream_in(&mut self, b: &B, routes: &[Route]) -> Result<Experts<'_, B::Weight>> {
        let area = self
            .stream
            .as_deref_mut()
            .ok_or_else(|| weights_err("no stream area for a prompt's experts"))?;
        let ids = distinct_experts(routes);
        if ids.iter().any(|&e| e as usize >= self.experts) {
            return Err(weights_err(
                "a shared expert's part routed to the stream area",
            ));
        }
        let free = b.compute_done()?;
        b.copies_wait(&free)?;
        let mut bytes = 0u64;
        let host = &self.layer.host;
        let mut read = vec![false; ids.len()];
        for (i, w) in area.stacks.iter_mut().enumerate() {
            let (seg, rows) = (host.segment(i), host.rows(i));
            b.retype_weight(w, device_dtype(seg), self.experts * rows, seg.cols)?;
            for (&e, was_read) in ids.iter().zip(read.iter_mut()) {
                let (src, from_store) = host.expert(i, e as usize, self.reader)?;
                b.upload_into(w, e as usize * rows, src)?;
                bytes += src.len() as u64;
                *was_read |= from_store;
            }
        }
        let reads = read.iter().filter(|&&r| r).count() as u64;
        self.traffic.ssd_experts.fetch_add(reads, Ordering::Relaxed);
        self.traffic
            .ssd_bytes
            .fetch_add(reads * host.expert_bytes(), Ordering::Relaxed);
        let landed = b.copies_done()?;
        super::compute_waits_for(b, &landed)?;
        self.traffic
            .streamed
            .fetch_add(ids.len() as u64, Ordering::Relaxed);
        self.traffic
            .stream_bytes
            .fetch_add(bytes, Ordering::Relaxed);
        Ok(Experts::gated(&area.stacks, self.cpu.width))
    }

    fn low_bit(
        &mut self,
        b: &B,
        routes: &[Route],
        rest: &mut Vec<Route>,
        x: &B::Tensor,
        act: Act,
    ) -> Result<Option<&B::Tensor>> {
        let n = b.shape(x).0;
        let Some((area, l)) = self.low.as_mut() else {
            return Ok(None);
        };
        if n > LOW_BIT_ROWS {
            return Ok(None);
        }
        let served = area.serve(
            b,
            (*l, self.experts, self.cpu.width),
            (routes, rest),
            (x, act),
        )?;
        Ok(served.map(|(out, work)| {
            let t = self.traffic;
            t.low_bit_experts.fetch_add(work.experts, Ordering::Relaxed);
            t.low_bit_bytes.fetch_add(work.bytes, Ordering::Relaxed);
            out
        }))
    }

    fn prefetch(&mut self, b: &B, x: &[f32], n: usize) -> Result<Option<Vec<Route>>> {
        if n > PREFETCH_ROWS {
            return Ok(None);
        }
        let Some((next, router)) = self.next.as_mut() else {
            return Ok(None);
        };
        let guess = router
            .guess(&self.cpu.backend, x, n, self.moe)
            .map_err(weights_err)?;
        let active = active_experts(&guess, self.experts);
        next.guess = Some(active.clone());
        if let Some(map) = next.map.as_mut() {
            let allowed = next.copies.allow();
            next.opened = true;
            let (_, loads) = map.admit(&active, allowed).map_err(weights_err)?;
            next.copies.spend(loads.len());
            if !loads.is_empty() {
                let bytes = next.copy_loads(b, &loads, self.reader, self.traffic)?;
                let t = self.traffic;
                t.copies.fetch_add(loads.len() as u64, Ordering::Relaxed);
                t.prefetched
                    .fetch_add(loads.len() as u64, Ordering::Relaxed);
                t.copy_bytes.fetch_add(bytes, Ordering::Relaxed);
            }
        }
        Ok(Some(guess))
    }

    fn admit(&mut self, b: &B, routes: &[Route]) -> Result<()> {
        let active = active_experts(routes, self.experts);
        let t = self.traffic;
        t.needed.fetch_add(active.len() as u64, Ordering::Relaxed);
        if let Some(guess) = self.layer.guess.take() {
            let right = guess.iter().filter(|e| active.contains(e)).count();
            t.guessed.fetch_add(guess.len() as u64, Ordering::Relaxed);
            t.guessed_right.fetch_add(right as u64, Ordering::Relaxed);
        }
        let allowed = self.layer.allowed();
        let Some(map) = self.layer.map.as_mut() else {
            return Ok(());
        };
        let (hits, loads) = map.admit(&active, allowed).map_err(weights_err)?;
        self.layer.copies.spend(loads.len());
        t.hits.fetch_add(hits as u64, Ordering::Relaxed);
        if loads.is_empty() {
            return Ok(());
        }
        let bytes = self.layer.copy_loads(b, &loads, self.reader, t)?;
        t.copies.fetch_add(loads.len() as u64, Ordering::Relaxed);
        t.copy_bytes.fetch_add(bytes, Ordering::Relaxed);
        Ok(())
    }
}

impl<B: Backend> WeightSource<B> for ExpertWeights<B> {
    resident_source!();

    fn layer(&mut self, _: &B, l: usize) -> Result<LayerView<'_, B>> {
        let ExpertWeights {
            resident,
            routers,
            layers,
            partial,
            stream,
            cpu,
            experts,
            traffic,
            next,
            _next_hold: _,
            moe,
            reader,
            low,
        } = self;
        if l >= layers.len() {
            return Err(weights_err(format!("no layer {l}")));
        }
        let (here, after) = layers.split_at_mut(l + 1);
        let next = match (after.first_mut(), next.get(l)) {
            (Some(layer), Some(Some(router))) => Some((layer, router)),
            _ => None,
        };
        let cache = ExpertStep {
            layer: &mut here[l],
            next,
            stream: stream.as_mut(),
            cpu,
            experts: *experts,
            moe,
            traffic,
            reader,
            low: low.as_mut().map(|a| (a, l)),
        };
        let ffn = FfnView::Matrices {
            gate: None,
            up: crate::tier::resident::linear(None, None),
            down: crate::tier::resident::linear(None, None),
        };
        let mut view = resident.layer(l, ffn, None, None);
        view.router = Some(&routers[l]);
        view.experts = Some(ExpertsView {
            cache: Box::new(cache),
            partial,
        });
        Ok(view)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_steps_experts_come_most_wanted_first() {
        let r = |token, expert, weight| Route {
            token,
            expert,
            weight,
        };
        // Expert 3 is wanted by both rows (0.5 + 0.25), then 1 (0.5), then 2 and 5 tie at 0.25
        // (the lower id first); the shared part (id 8, after the 8 routed) is no routed expert.
        let routes = [
            r(0, 3, 0.5),
            r(0, 1, 0.5),
            r(0, 8, 0.9),
            r(1, 2, 0.25),
            r(1, 3, 0.25),
            r(1, 5, 0.25),
        ];
        assert_eq!(active_experts(&routes, 8), [3, 1, 2, 5]);
        assert!(active_experts(&[], 8).is_empty());
    }
}
