//! A mixture-of-experts model offloaded (the DESIGN's "experts as the unit of every tier"):
//! everything but the routed experts resident on the device — every layer's attention, router,
//! norms and shared expert, the output matrix, KV and step memory (the streaming plan of the
//! model without its experts, [`make_plan`], all of it resident) — and, in what the budget
//! leaves, per layer a cache unit of whole-expert slots ([`crate::tier::experts`]). The experts
//! a step routes to that the unit holds run on the device; the CPU computes the others from DRAM
//! at the same time (Fiddler: the activations travel, not the experts), and the unit takes in a
//! few of the missed experts after the step (the ATU, [`crate::tier::atu::SlotMap::admit`]),
//! [`ExpertPlan::copies_per_step`] a layer a step on average ([`crate::tier::atu::CopyBudget`]):
//! as many as the bus moves in the step's predicted time — a fraction is one copy every few
//! steps — so a refill never holds a token up.
//!
//! Slots are shared out evenly over the layers (balanced, as FlexInfer locks memory), the
//! remainder to the layers whose experts are smallest. With no routing profile, experts are
//! taken as equally likely: a unit of `s` slots of `E` experts expects a hit ratio of `s / E`
//! (an ATU cache with temporal locality does better; `bench experts` measures it on a trace).
//! `--cold cpu` keeps every routed expert on the CPU (llama.cpp's `-ot exps=CPU`); `--cold gpu`
//! gives the slots to the units; `auto` takes the faster by the prediction.
//!
//! Device bytes are counted as [`crate::tier::experts::ExpertWeights`] allocates them, buffer by
//! buffer, each rounded to the granule: what the plan accepts, the ledger holds to the byte.
//!
//! Fails with [`PlanError::GpuTooSmall`] where not even every layer's attention, router and
//! shared expert fit beside KV and step memory.

use serde::Serialize;

use crate::footprint::device_bytes;
use crate::store::Manifest;

use super::Plan;
use super::batch;
use super::budget::{Budget, PlanError, human_bytes};
pub use super::expert_host::HostExperts;
use super::expert_host::plan_host;
pub use super::expert_low_bit::LowBitExperts;
use super::expert_low_bit::{low_ranked_share, plan_low_bit};
pub use super::expert_shape::{ExpertShape, expert_read_rows};
use super::hardware::HardwareProfile;
use super::manifest::{part_segment_name, router_segment_name, seg, staging_for};
use super::preserve::Part;
use super::resident::SparsePerToken;
use super::stream::make_plan;
use crate::sparsity::routing::RoutingProfile;

/// Where the routed experts a device does not hold run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ExpertMode {
    /// Every routed expert on the CPU, from DRAM (llama.cpp's `-ot exps=CPU`).
    Cpu,
    /// A cache unit of expert slots per layer, updated by the ATU; misses on the CPU.
    Units,
    /// Every routed expert a step needs copied through the device's stream area and computed
    /// there, every step (nothing of them kept; the CPU computes none).
    Stream,
    /// Static hot experts (PowerInfer's placement with experts for neurons): each layer's slots
    /// hold the routing profile's most routed experts, placed by share per byte, never
    /// replaced; misses on the CPU. Needs a routing profile.
    Static,
}

impl ExpertMode {
    /// The mode `--cold` asks of a mixture-of-experts model: `cpu` every routed expert on the
    /// CPU, `gpu` expert units, `stream` every routed expert through the device each step,
    /// `auto` (`None`) the fastest; experts are not split by neurons.
    pub fn for_cold(cold: super::choice::Cold) -> Result<Option<Self>, PlanError> {
        use super::choice::Cold;
        match cold {
            Cold::Cpu => Ok(Some(ExpertMode::Cpu)),
            Cold::Gpu => Ok(Some(ExpertMode::Units)),
            Cold::Auto => Ok(None),
            Cold::Stream => Ok(Some(ExpertMode::Stream)),
            Cold::Split => Err(PlanError::Budget(
                "--cold split: a mixture-of-experts model's experts are not split by neurons; \
                 --cold cpu computes the routed experts on the CPU, --cold gpu keeps expert cache \
                 units on the device (their misses on the CPU), --cold stream copies each step's \
                 experts through the device, auto chooses"
                    .into(),
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ExpertMode::Cpu => "all routed experts on the CPU",
            ExpertMode::Units => "expert cache units (ATU), misses on the CPU",
            ExpertMode::Stream => "every routed expert streamed through the device each step",
            ExpertMode::Static => {
                "static hot experts (the profile's most routed), misses on the CPU"
            }
        }
    }
}

/// One layer's share of the plan.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ExpertLayer {
    /// Routed-expert slots on the device.
    pub slots: usize,
    /// Device bytes of its unit (slots and shared parts) and router.
    pub device_bytes: u64,
    /// Expected share of the routed experts the unit holds when routed.
    pub hit_ratio: f64,
    /// Expected bytes per token: the device's reads (attention, router, experts it computes),
    /// the CPU's (missed experts), the bus's (the ATU's copies).
    pub hbm_bytes: u64,
    pub cpu_bytes: u64,
    pub copy_bytes: u64,
    /// With the SSD tier: expected bytes a token the store reads for the CPU's experts its
    /// DRAM cache lacks.
    pub ssd_bytes: u64,
    /// Mixed precision: expected low-bit bytes a token copied in for the device.
    pub low_bit_bytes: u64,
    /// Predicted seconds per token of the layer's device experts and of the CPU's (with the
    /// partial sum's trip back); the layer takes the longer, after its attention and the
    /// landing of its FFN input and router logits.
    pub device_s: f64,
    pub cpu_s: f64,
}

/// Device bytes of the plan, as the source allocates them.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ExpertDevice {
    /// Every layer's attention matrices.
    pub attention: u64,
    /// Every layer's router.
    pub routers: u64,
    /// Every layer's unit (routed slots and shared parts).
    pub units: u64,
    /// The stream area a prompt's missed experts pass through (one layer's routed stacks; 0
    /// where prompts leave them to the CPU).
    pub stream: u64,
    /// Mixed precision: the low-bit area and its output buffer (0 without).
    pub low_bit: u64,
    /// The buffer the CPU's partial sums come back into.
    pub merge: u64,
    /// Everything the byte ledger holds at the peak (small fragments, head, KV, step memory
    /// and the above).
    pub placed: u64,
    /// `fixed + placed`.
    pub total: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct ExpertPlan {
    pub mode: ExpertMode,
    pub experts: usize,
    pub used: usize,
    pub layers: Vec<ExpertLayer>,
    /// Each layer's experts as stored.
    pub shapes: Vec<ExpertShape>,
    /// Experts a layer's unit takes in after a step, on average (a fraction: one every few
    /// steps); at most a token's experts.
    pub copies_per_step: f64,
    pub device: ExpertDevice,
    /// Host memory the experts take: every expert of every layer read whole, or with the SSD
    /// tier the DRAM caches and the read buffer ([`HostExperts`]).
    pub dram_expert_bytes: u64,
    pub host: HostExperts,
    /// Start-up staging buffer (attention, routers, head).
    pub staging: u64,
    /// Rows of the merge buffer (the most tokens a step evaluates).
    pub batch: usize,
    /// Steps of at least this many rows (a prompt's) bring the experts the units lack through
    /// the stream area and compute them on the device, as llama.cpp streams a prompt's
    /// experts, instead of the CPU computing them; `None`: the CPU always does (no area, or the
    /// CPU is faster at every step the budget takes).
    pub stream_rows: Option<usize>,
    pub per_token: SparsePerToken,
    pub predicted_tokens_per_s: f64,
    /// What the prediction assumes of the routing.
    pub routing: String,
    /// Next-layer prefetch: a layer with a partial unit has its experts guessed from the
    /// previous layer's FFN input and the copies of those it lacks started then, within its
    /// copy budget ([`crate::sparsity::routing::NextRouter`]). Its expected gain is not in the
    /// prediction (`bench decode` and `bench experts` measure how often the guess is right).
    pub prefetch: bool,
    /// Mixed precision (`--expert-low-bit`): a decode step's low-ranked misses run on the
    /// device from low-bit copies.
    pub low_bit: Option<LowBitExperts>,
    /// The modes `--cold auto` weighed, with their predicted tokens/s (the chosen one alone
    /// where a mode was asked for).
    pub alternatives: Vec<(ExpertMode, f64)>,
    /// Host memory of the guess routers (f16, one per prefetching layer); the CPU reads them
    /// once a decode step (counted in the per-token CPU bytes and time).
    pub guess_router_bytes: u64,
    /// With a routing profile: per layer the experts its unit starts with (its most routed),
    /// and each expert's share of the routings (what the ATU keeps when a stale expert must
    /// give way); without, units start empty and give way to the least recently routed.
    pub seeds: Vec<Vec<u32>>,
    #[serde(skip)]
    pub scores: Vec<Vec<f32>>,
    /// The plan as the rest of the runtime reads it: the streaming plan of everything but the
    /// experts (all of it resident: small fragments, head, KV, step memory, prefill layout),
    /// its device bytes, per-token bytes and prediction this plan's.
    #[serde(skip)]
    pub plan: Plan,
}

impl ExpertPlan {
    /// Per layer, its routed slots.
    pub fn slots(&self) -> Vec<usize> {
        self.layers.iter().map(|l| l.slots).collect()
    }

    /// Whether layer `l`'s experts are guessed from layer `l - 1`'s input and prefetched: with
    /// prefetch on, a layer after the first whose unit holds some experts but not all.
    pub fn prefetches(&self, l: usize) -> bool {
        self.prefetch
            && l > 0
            && self
                .layers
                .get(l)
                .is_some_and(|x| x.slots > 0 && x.slots < self.experts)
    }

    /// The ledger's device budget: what the plan places.
    pub fn ledger_budget(&self) -> u64 {
        self.device.placed
    }

    /// The plan as a table, for people.
    pub fn report(&self) -> String {
        use std::fmt::Write;
        let mib = |b: u64| format!("{:.1}", b as f64 / (1u64 << 20) as f64);
        let mut o = String::new();
        let _ = writeln!(
            o,
            "experts: {} ({} experts, {} a token, {:.2} copied in a layer a step{}); routing: {}",
            self.mode.name(),
            self.experts,
            self.used,
            self.copies_per_step,
            if self.prefetch {
                ", next layer's experts guessed and prefetched"
            } else {
                ""
            },
            self.routing
        );
        let _ = writeln!(
            o,
            "{:>5} {:>6} {:>10} {:>6} {:>10} {:>10} {:>10}",
            "layer", "slots", "dev MiB", "hit", "HBM B/tok", "CPU B/tok", "copy B/tok"
        );
        for (l, x) in self.layers.iter().enumerate() {
            let _ = writeln!(
                o,
                "{l:>5} {:>6} {:>10} {:>6.3} {:>10} {:>10} {:>10}",
                x.slots,
                mib(x.device_bytes),
                x.hit_ratio,
                x.hbm_bytes,
                x.cpu_bytes,
                x.copy_bytes
            );
        }
        let d = &self.device;
        let _ = writeln!(
            o,
            "prompts: {}",
            match self.stream_rows {
                Some(r) => format!(
                    "steps of {r} rows or more stream the experts the units lack through the device ({} MiB area)",
                    mib(d.stream)
                ),
                None => "the CPU computes the experts the units lack".into(),
            }
        );
        let _ = writeln!(
            o,
            "device: attention {} MiB, routers {} MiB, expert units {} MiB, stream area {} MiB, merge {} MiB; placed {} MiB, total {} MiB of {} MiB",
            mib(d.attention),
            mib(d.routers),
            mib(d.units),
            mib(d.stream),
            mib(d.merge),
            mib(d.placed),
            mib(d.total),
            mib(self.plan.budget.gpu_mem)
        );
        let p = &self.per_token;
        let _ = writeln!(
            o,
            "per token: HBM {} MiB, CPU {} MiB, PCIe {} MiB, SSD {} MiB; DRAM for experts {} MiB; predicted {:.1} tokens/s",
            mib(p.hbm_bytes),
            mib(p.cpu_bytes),
            mib(p.pcie_bytes),
            mib(self.plan.per_token.ssd_bytes),
            mib(self.dram_expert_bytes),
            self.predicted_tokens_per_s
        );
        if self.alternatives.len() > 1 {
            let _ = writeln!(
                o,
                "--cold auto weighed: {}",
                self.alternatives
                    .iter()
                    .map(|(m, t)| format!("{} {t:.1} tokens/s", m.name()))
                    .collect::<Vec<_>>()
                    .join("; ")
            );
        }
        let prompt = self.plan.budget.prompt.max(1);
        let pp = self.prefill_prediction(prompt);
        let _ = writeln!(
            o,
            "prefill of {prompt} tokens: {} steps of up to {} rows; predicted TTFT {:.3} s, bound by {} (device compute {:.3} s, streamed experts' copies {:.3} s, host→device {} MiB, the CPU's experts {:.3} s; {:.2} TFLOP)",
            pp.groups,
            self.plan.prefill.group.clamp(1, self.batch.max(1)),
            pp.ttft_s,
            pp.limited_by,
            pp.compute_s,
            pp.pcie_s,
            mib(pp.h2d_bytes),
            pp.cpu_s,
            pp.flops / 1e12
        );
        if let Some(lb) = &self.low_bit {
            let _ = writeln!(
                o,
                "mixed precision: a decode step's misses that are not their token's top expert run on the device from {} copies ({} MiB area of {} experts and output; {} MiB in host memory, quantized at load); the rest on the CPU at full precision",
                lb.dtype.name(),
                mib(lb.device_bytes()),
                lb.slots,
                mib(lb.dram)
            );
        }
        if let Some(ds) = &self.host.dram_slots {
            let _ = writeln!(
                o,
                "host: the SSD tier — every expert's stacks do not fit host memory; DRAM caches of {}..={} experts a layer (and a {} MiB read buffer), the others read from the store when the CPU needs them",
                ds.iter().min().unwrap_or(&0),
                ds.iter().max().unwrap_or(&0),
                mib(self.host.read_buffer)
            );
        }
        o
    }
}

/// The plan of a mixture-of-experts model for `budget` on `hw`: `mode` `None` takes the faster
/// of the two by the prediction.
pub fn plan_experts(
    m: &Manifest,
    budget: &Budget,
    hw: &HardwareProfile,
    mode: Option<ExpertMode>,
    routing: Option<&RoutingProfile>,
) -> Result<ExpertPlan, PlanError> {
    let moe = m
        .spec
        .moe
        .clone()
        .ok_or_else(|| PlanError::Store("an expert plan for a model without experts".into()))?;
    // Steps no larger than the budget's: the room beyond goes to the experts (a reserve keeps
    // the streaming plan from growing its prefill steps into it).
    let base_for = |gpu_mem: u64| {
        make_plan(
            m,
            &Budget {
                hot_reserve: Some(0),
                gpu_mem,
                ..budget.clone()
            },
            hw,
        )
    };
    let (base, fits) = match base_for(budget.gpu_mem) {
        Ok(p) => (p, true),
        // Not even attention streamed fits: what the experts' plan needs, said as its own.
        Err(PlanError::GpuTooSmall { .. }) => (base_for(u64::MAX / 4)?, false),
        Err(e) => return Err(e),
    };
    let spec = &base.spec;
    let n_layers = spec.n_layers;
    let shapes = (0..n_layers)
        .map(|l| ExpertShape::of(m, l))
        .collect::<Result<Vec<_>, _>>()?;
    let (attention, attention_layers, staging) = resident_reads(m)?;
    let routers: u64 = shapes.iter().map(|s| device_bytes(s.router)).sum();
    let batch = budget.batch.max(1);
    let merge = device_bytes((batch * spec.d_model * 4) as u64);
    let g = &base.gpu;
    let everything_else =
        g.small + g.head + g.kv + g.scratch + g.workspace + attention + routers + merge;
    let shared: u64 = shapes.iter().map(|s| s.unit_device_bytes(0)).sum();
    let usable = budget.gpu_mem.saturating_sub(g.fixed);
    if !fits || usable < everything_else + shared {
        return Err(PlanError::GpuTooSmall {
            budget: budget.gpu_mem,
            minimum: g.fixed + everything_else + shared,
            breakdown: format!(
                "a mixture-of-experts model keeps every layer's attention ({}), router ({}) and shared expert ({}) resident, with the small fragments {}, output matrix {}, KV cache {}, step buffers {}, workspace {} and the merge buffer {}",
                human_bytes(attention),
                human_bytes(routers),
                human_bytes(shared),
                human_bytes(g.small),
                human_bytes(g.head),
                human_bytes(g.kv),
                human_bytes(g.scratch),
                human_bytes(g.workspace),
                human_bytes(merge)
            ),
        });
    }
    let room = usable - everything_else;
    let mut fixed = Fixed {
        base: &base,
        shapes: &shapes,
        attention_layers: &attention_layers,
        experts: moe.experts,
        used: moe.used,
        everything_else,
        attention,
        routers,
        merge,
        staging,
        batch,
        stream: None,
        host: HostExperts {
            dram_slots: None,
            bytes: 0,
            read_buffer: 0,
        },
        low: None,
        profile: routing,
        ranks: routing.map(|r| (0..n_layers).map(|l| r.ranked(l)).collect()),
        routing: match routing {
            Some(r) => format!(
                "profiled on {} tokens of {}: a unit of s slots holds its layer's s most routed experts' share",
                r.tokens, r.corpus
            ),
            None => "uniform (no routing profile): a unit of s slots of E experts hits s/E".into(),
        },
    };
    // Streaming every step's experts: the area for every step, nothing for units.
    let streaming = {
        let mut f = fixed.clone();
        f.stream_every_step(budget, room)
            .and_then(|()| f.place_host(budget))
            .map(|()| f.finish(ExpertMode::Stream, vec![0; n_layers]))
    };
    let room = fixed.place_areas(budget, room)?;
    fixed.place_host(budget)?;
    let fixed = fixed;
    let slots = match &fixed.ranks {
        Some(ranks) => slots_by_share(&shapes, ranks, room),
        None => share_slots(&shapes, moe.experts, room),
    };
    let units = || fixed.finish(ExpertMode::Units, slots.clone());
    let cpu = || fixed.finish(ExpertMode::Cpu, vec![0; n_layers]);
    let hot = || match routing {
        Some(_) => Ok(fixed.finish(ExpertMode::Static, slots.clone())),
        None => Err(PlanError::Budget(
            "static hot experts are the routing profile's most routed: run `gpu-offload profile` \
             on the model first"
                .into(),
        )),
    };
    if mode == Some(ExpertMode::Stream) && budget.expert_low_bit.is_some() {
        return Err(PlanError::Budget(
            "--expert-low-bit serves the misses the CPU would compute; --cold stream computes \
             every routed expert on the device at full precision (use --cold gpu, cpu or auto)"
                .into(),
        ));
    }
    let mut plan = match mode {
        Some(ExpertMode::Cpu) => cpu(),
        Some(ExpertMode::Units) => units(),
        Some(ExpertMode::Stream) => streaming?,
        Some(ExpertMode::Static) => hot()?,
        None => fastest(
            [Some(units()), hot().ok(), Some(cpu()), streaming.ok()]
                .into_iter()
                .flatten()
                .collect(),
        )?,
    };
    if plan.alternatives.is_empty() {
        plan.alternatives = vec![(plan.mode, plan.predicted_tokens_per_s)];
    }
    Ok(plan)
}

/// The fastest of `all` by its prediction (the first of equals), with what was weighed.
fn fastest(all: Vec<ExpertPlan>) -> Result<ExpertPlan, PlanError> {
    let alternatives = all
        .iter()
        .map(|p| (p.mode, p.predicted_tokens_per_s))
        .collect();
    let mut best = all
        .into_iter()
        .reduce(|a, b| {
            if b.predicted_tokens_per_s > a.predicted_tokens_per_s {
                b
            } else {
                a
            }
        })
        .ok_or_else(|| PlanError::Store("no expert plan".into()))?;
    best.alternatives = alternatives;
    Ok(best)
}

/// Every layer's attention matrices on the device (rounded), each layer's bytes of them, and
/// the start-up staging that loads them, the routers, the head and the small fragments.
fn resident_reads(m: &Manifest) -> Result<(u64, Vec<u64>, u64), PlanError> {
    let n_layers = m.spec.n_layers;
    let mut attention = 0;
    let mut attention_layers = Vec::with_capacity(n_layers);
    let mut staging = 0;
    for l in 0..n_layers {
        let mut layer = 0;
        for p in Part::ATTENTION {
            let s = seg(m, &part_segment_name(l, p))?;
            attention += device_bytes(s.bytes);
            layer += s.bytes;
            staging = staging.max(staging_for(s, s.rows));
        }
        let r = seg(m, &router_segment_name(l))?;
        staging = staging.max(staging_for(r, r.rows));
        attention_layers.push(layer);
    }
    let head = super::manifest::head_segment(m)?;
    staging = staging.max(staging_for(head, head.rows));
    for (name, _) in super::manifest::small_fragments(m) {
        if let Some(s) = m.segment(&name) {
            staging = staging.max(staging_for(s, s.rows));
        }
    }
    Ok((attention, attention_layers, staging))
}

/// Slots per layer in `room` bytes: the same number in every layer, as many as fit (at most
/// every expert), then one more for the layers whose experts take least, as long as room is
/// left.
pub fn share_slots(shapes: &[ExpertShape], experts: usize, room: u64) -> Vec<usize> {
    let cost = |slots: &[usize]| -> u64 {
        shapes
            .iter()
            .zip(slots)
            .map(|(s, &k)| s.unit_device_bytes(k))
            .sum()
    };
    let n = shapes.len();
    let even = (0..=experts)
        .rev()
        .find(|&k| cost(&vec![k; n]) <= room)
        .unwrap_or(0);
    let mut slots = vec![even; n];
    if even == experts {
        return slots;
    }
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|&l| (shapes[l].bytes(), l));
    for l in order {
        slots[l] += 1;
        if cost(&slots) > room {
            slots[l] -= 1;
        }
    }
    slots
}

/// Slots per layer in `room` bytes by a routing profile: one slot at a time to the layer whose
/// next most routed expert adds the largest share of its routings per byte (each layer's shares
/// fall with its rank, so taking the best next slot is the best placement of whole slots up to
/// the last one's rounding: the ILP over experts as a greedy), at most every expert.
pub fn slots_by_share(
    shapes: &[ExpertShape],
    ranks: &[(Vec<u32>, Vec<f64>)],
    room: u64,
) -> Vec<usize> {
    let mut slots = vec![0usize; shapes.len()];
    let mut used: u64 = shapes.iter().map(|s| s.unit_device_bytes(0)).sum();
    loop {
        let best = (0..shapes.len())
            .filter_map(|l| {
                let share = *ranks[l].1.get(slots[l])?;
                let more = shapes[l].unit_device_bytes(slots[l] + 1)
                    - shapes[l].unit_device_bytes(slots[l]);
                (used + more <= room).then_some((l, share / more.max(1) as f64, more))
            })
            .max_by(|a, b| a.1.total_cmp(&b.1).then(b.0.cmp(&a.0)));
        match best {
            Some((l, _, more)) => {
                slots[l] += 1;
                used += more;
            }
            None => return slots,
        }
    }
}

/// What every mode of one budget shares.
#[derive(Clone)]
struct Fixed<'a> {
    base: &'a Plan,
    shapes: &'a [ExpertShape],
    attention_layers: &'a [u64],
    experts: usize,
    used: usize,
    everything_else: u64,
    attention: u64,
    routers: u64,
    merge: u64,
    staging: u64,
    batch: usize,
    /// The rows from which prompts stream, and the stream area's bytes.
    stream: Option<(usize, u64)>,
    /// With a routing profile: per layer its experts, most routed first, and their shares.
    ranks: Option<Vec<(Vec<u32>, Vec<f64>)>>,
    /// What the expected hits assume.
    routing: String,
    /// The routing profile, where there is one (its ATU replay gives the units' hit ratios).
    profile: Option<&'a RoutingProfile>,
    /// The experts on the host: every stack, or the SSD tier's DRAM caches.
    host: HostExperts,
    /// Mixed precision's low-bit copies.
    low: Option<LowBitExperts>,
}

impl Fixed<'_> {
    /// The stream area for every step (`--cold stream`): refused where `room` does not hold it.
    fn stream_every_step(&mut self, budget: &Budget, room: u64) -> Result<(), PlanError> {
        let area = self.stream_area();
        if room < area {
            return Err(PlanError::GpuTooSmall {
                budget: budget.gpu_mem,
                minimum: budget.gpu_mem - room + area,
                breakdown: format!(
                    "streaming every routed expert takes a stream area of one layer's experts ({}) beside everything a mixture-of-experts model keeps resident",
                    human_bytes(area)
                ),
            });
        }
        self.stream = Some((1, area));
        Ok(())
    }

    /// Device bytes of the stream area: one layer's routed stacks, each matrix as wide as its
    /// widest layer's.
    fn stream_area(&self) -> u64 {
        (0..3)
            .map(|i| {
                device_bytes(
                    self.shapes
                        .iter()
                        .map(|s| s.routed_stacks(self.experts)[i])
                        .max()
                        .unwrap_or(0),
                )
            })
            .sum()
    }

    /// Of `room` device bytes, the stream area's (one layer's routed stacks, each matrix as wide
    /// as its widest layer's, where prompts gain by streaming) and the low-bit area's (with
    /// `--expert-low-bit`); the room left for the units.
    fn place_areas(&mut self, budget: &Budget, mut room: u64) -> Result<u64, PlanError> {
        let area = self.stream_area();
        if room >= area
            && let Some(rows) = self.stream_rows()
        {
            self.stream = Some((rows, area));
            room -= area;
        }
        if let Some(dtype) = budget.expert_low_bit {
            let low = plan_low_bit(
                self.shapes,
                (self.experts, self.used),
                (self.batch, self.base.spec.d_model),
                dtype,
            )?;
            if room < low.device_bytes() {
                return Err(PlanError::GpuTooSmall {
                    budget: budget.gpu_mem,
                    minimum: budget.gpu_mem - room + low.device_bytes(),
                    breakdown: format!(
                        "--expert-low-bit's area for {} low-bit experts and its output ({}) beside everything a mixture-of-experts model keeps resident",
                        low.slots,
                        human_bytes(low.device_bytes())
                    ),
                });
            }
            room -= low.device_bytes();
            self.low = Some(low);
        }
        Ok(room)
    }

    /// The experts' host memory: every stack where `--dram-mem` holds them beside the guess
    /// routers (with prefetch), the low-bit copies, the tables and the staging; else the SSD
    /// tier's caches (not with low-bit copies, which are quantized from the stacks).
    fn place_host(&mut self, budget: &Budget) -> Result<(), PlanError> {
        let spec = &self.base.spec;
        let guess = if budget.expert_prefetch {
            spec.n_layers.saturating_sub(1) as u64
                * crate::sparsity::routing::NextRouter::bytes_for(self.experts, spec.d_model)
        } else {
            0
        };
        let low = self.low.as_ref().map_or(0, |l| l.dram);
        let tables = self.base.dram.tables;
        let host = plan_host(
            self.shapes,
            (self.experts, self.used),
            budget.dram_mem,
            (
                guess + low + tables + self.staging,
                &format!(
                    "the next-layer guess routers {}, the low-bit experts {}, the embedding tables {} and the start-up staging {}",
                    human_bytes(guess),
                    human_bytes(low),
                    human_bytes(tables),
                    human_bytes(self.staging)
                ),
            ),
        )?;
        if self.low.is_some() && host.dram_slots.is_some() {
            return Err(PlanError::Budget(
                "--expert-low-bit quantizes the experts from their stacks in host memory: it needs \
                 --dram-mem to hold every expert (the SSD tier does not)"
                    .into(),
            ));
        }
        self.host = host;
        Ok(())
    }

    /// The fewest rows (2 up to the budget's step) from which bringing a step's missed experts
    /// through the device beats the CPU computing them (the units taken empty: a prompt
    /// misses most): per layer, the distinct experts `n` rows route to (uniformly, `E·(1 −
    /// (1 − k/E)ⁿ)`) copied in and computed on the device, against the CPU reading them and
    /// computing every row's; where copies and compute share memory they take turns.
    fn stream_rows(&self) -> Option<usize> {
        let spec = &self.base.spec;
        let hw = &self.base.hardware;
        let (e, k) = (self.experts as f64, self.used as f64);
        if e == 0.0 {
            return None;
        }
        let expert_flops =
            2.0 * 3.0 * (spec.d_model * spec.moe.as_ref().map_or(0, |m| m.d_expert)) as f64;
        let cpu_rate = batch::cpu_flops_per_s(hw);
        (2..=self.batch).find(|&n| {
            let distinct = e * (1.0 - (1.0 - k / e).powi(n as i32));
            let (mut cpu_s, mut stream_s) = (0.0, 0.0);
            for s in self.shapes {
                let bytes = distinct * s.bytes() as f64;
                let flops = n as f64 * k * expert_flops;
                cpu_s += (bytes / hw.dram_read_bytes_per_s).max(flops / cpu_rate);
                let copy = bytes / hw.h2d_pinned_bytes_per_s;
                let compute = flops / hw.matmul_flops_per_s;
                stream_s += hw.together_s(copy, compute);
            }
            stream_s < cpu_s
        })
    }
    /// Layer `l` with `slots` routed slots: the expected hits at uniform routing, the bytes
    /// each resource reads a token, the device's and the CPU's seconds; and the layer's seconds
    /// (attention, the landing of its input and logits, the longer side).
    fn layer(&self, mode: ExpertMode, l: usize, slots: usize) -> (ExpertLayer, f64) {
        let base = self.base;
        let spec = &base.spec;
        let hw = &base.hardware;
        let shape = &self.shapes[l];
        let (d, k) = (spec.d_model, self.used as f64);
        let moe_rows = spec.moe.as_ref().map_or(0, |m| m.router_rows());
        let expert_flops = 2.0 * 3.0 * (d * spec.moe.as_ref().map_or(0, |m| m.d_expert)) as f64;
        // One host wait a layer: the FFN input and the router's logits down, the CPU's partial
        // sum up.
        let trip = |bytes: usize| hw.op_overhead_s + bytes as f64 / hw.h2d_pinned_bytes_per_s;
        let attention_row =
            batch::projection_flops(spec) + batch::attention_flops(spec, base.budget.ctx / 2);
        let eb = shape.bytes();
        let static_share = match &self.ranks {
            // (+ 0.0: an empty float sum is -0.0.)
            Some(r) => (r[l].1.iter().take(slots).sum::<f64>() + 0.0).min(1.0),
            None if self.experts == 0 => 0.0,
            None => slots as f64 / self.experts as f64,
        };
        // The profile's held-out replay says how units (which follow the routing) and static
        // hot experts do at this size; without it, the in-sample top share.
        let hit = match (mode, self.profile.and_then(|p| p.held_out_hits(l, slots))) {
            _ if slots >= self.experts => static_share,
            (ExpertMode::Units, Some((atu, _))) => atu.clamp(0.0, 1.0),
            (ExpertMode::Static, Some((_, hot))) => hot.clamp(0.0, 1.0),
            _ => static_share,
        };
        let on_device = hit * k + shape.shared as f64;
        // Mixed precision: a miss that is not its token's top expert comes as a low-bit copy
        // and runs on the device; the CPU computes the rest.
        let (missed, low, low_eb) = match &self.low {
            Some(lb) => {
                let all = (1.0 - hit) * k;
                let low = all * low_ranked_share(self.used);
                (all - low, low, lb.expert_bytes[l] as f64)
            }
            None => ((1.0 - hit) * k, 0.0, 0.0),
        };
        let low_bit_bytes = (low * low_eb) as u64;
        let hbm_bytes = self.attention_layers[l]
            + shape.router
            + (on_device * eb as f64) as u64
            + low_bit_bytes;
        let cpu_bytes = (missed * eb as f64) as u64;
        // The SSD tier: the CPU's experts its DRAM cache holds as the top ranks' share (taken
        // as independent of the device's unit), the others read from the store first.
        let in_dram = match &self.host.dram_slots {
            None => 1.0,
            Some(ds) => match &self.ranks {
                Some(r) => (r[l].1.iter().take(ds[l]).sum::<f64>() + 0.0).min(1.0),
                None => ds[l] as f64 / self.experts.max(1) as f64,
            },
        };
        let ssd_bytes = (missed * (1.0 - in_dram) * eb as f64) as u64;
        // Both sides start once the FFN input and the logits have landed (one wait); the CPU's
        // share comes back before the merge.
        let device_s = on_device * eb as f64 / hw.hbm_bytes_per_s
            + low_bit_bytes as f64 / hw.h2d_pinned_bytes_per_s
            + low_bit_bytes as f64 / hw.hbm_bytes_per_s;
        let cpu_s = if missed > 0.0 {
            ssd_bytes as f64 / hw.ssd_read_bytes_per_s
                + batch::bounded(
                    cpu_bytes as f64,
                    hw.dram_read_bytes_per_s,
                    1,
                    missed * expert_flops,
                    batch::cpu_flops_per_s(hw),
                )
                + trip(d * 4)
        } else {
            0.0
        };
        let attention_s = batch::bounded(
            self.attention_layers[l] as f64,
            hw.hbm_bytes_per_s,
            1,
            attention_row,
            hw.matmul_flops_per_s,
        );
        if mode == ExpertMode::Stream {
            // Every routed expert copied in (from DRAM, or with the SSD tier from the store:
            // the stream never fills the DRAM cache) and computed, the copies waited for.
            let streamed = k * eb as f64;
            let device_s = streamed / hw.h2d_pinned_bytes_per_s
                + (streamed + shape.shared as f64 * eb as f64) / hw.hbm_bytes_per_s;
            let layer = ExpertLayer {
                slots: 0,
                device_bytes: shape.unit_device_bytes(0) + device_bytes(shape.router),
                hit_ratio: 0.0,
                hbm_bytes: self.attention_layers[l]
                    + shape.router
                    + ((k + shape.shared as f64) * eb as f64) as u64,
                cpu_bytes: 0,
                copy_bytes: streamed as u64,
                ssd_bytes: if self.host.dram_slots.is_some() {
                    streamed as u64
                } else {
                    0
                },
                low_bit_bytes: 0,
                device_s,
                cpu_s: 0.0,
            };
            let ssd_s = layer.ssd_bytes as f64 / hw.ssd_read_bytes_per_s;
            return (
                layer,
                attention_s + trip((d + moe_rows) * 4) + ssd_s + device_s,
            );
        }
        let layer = ExpertLayer {
            slots,
            device_bytes: shape.unit_device_bytes(slots) + device_bytes(shape.router),
            hit_ratio: hit,
            hbm_bytes,
            cpu_bytes,
            copy_bytes: 0,
            ssd_bytes,
            low_bit_bytes,
            device_s,
            cpu_s,
        };
        (
            layer,
            attention_s + trip((d + moe_rows) * 4) + device_s.max(cpu_s),
        )
    }

    /// The plan with `slots` routed slots per layer: per layer the expected hits at uniform
    /// routing, the bytes each resource moves, the predicted seconds; the copies the bus moves
    /// within the step's time.
    /// Whether a plan of `mode` with `slots` prefetches (a partial unit after the first layer)
    /// and the host bytes of its guess routers.
    fn guess_routers(&self, mode: ExpertMode, slots: &[usize]) -> (bool, u64) {
        let partial = |l: &usize| slots[*l] > 0 && slots[*l] < self.experts;
        let prefetch = self.base.budget.expert_prefetch
            && mode == ExpertMode::Units
            && (1..slots.len()).any(|l| partial(&l));
        if !prefetch {
            return (false, 0);
        }
        let layers = (1..slots.len()).filter(partial).count() as u64;
        let d = self.base.spec.d_model;
        (
            true,
            layers * crate::sparsity::routing::NextRouter::bytes_for(self.experts, d),
        )
    }

    /// The ATU's copies, in beside the compute: as many a layer a step as the bus moves in the
    /// step's `seconds` (at most a token's experts); each partial layer's copy bytes a token
    /// set in `layers`. The copies a step and their bytes a token.
    fn copies(&self, mode: ExpertMode, seconds: f64, layers: &mut [ExpertLayer]) -> (f64, u64) {
        let hw = &self.base.hardware;
        let n_layers = self.base.spec.n_layers.max(1) as f64;
        let widest = self
            .shapes
            .iter()
            .map(|s| s.bytes())
            .max()
            .unwrap_or(0)
            .max(1);
        let in_time = seconds * hw.h2d_pinned_bytes_per_s / (widest as f64 * n_layers);
        let copies_per_step = match mode {
            ExpertMode::Units => in_time.clamp(0.0, self.used.max(1) as f64),
            ExpertMode::Cpu | ExpertMode::Stream | ExpertMode::Static => 0.0,
        };
        let mut copies = 0;
        for (x, shape) in layers.iter_mut().zip(self.shapes) {
            if x.slots > 0 && x.slots < self.experts {
                let missed = (1.0 - x.hit_ratio) * self.used as f64;
                x.copy_bytes = (missed.min(copies_per_step) * shape.bytes() as f64) as u64;
                copies += x.copy_bytes;
            }
        }
        (copies_per_step, copies)
    }

    fn finish(&self, mode: ExpertMode, slots: Vec<usize>) -> ExpertPlan {
        let base = self.base;
        let spec = &base.spec;
        let hw = &base.hardware;
        let g = &base.gpu;
        let d = spec.d_model;
        let moe_rows = spec.moe.as_ref().map_or(0, |m| m.router_rows());
        let mut layers = Vec::with_capacity(slots.len());
        let (mut hbm, mut cpu) = (g.small + g.head, 0u64);
        let mut seconds = 0.0;
        let mut units = 0;
        for (l, &s) in slots.iter().enumerate() {
            let (layer, layer_s) = self.layer(mode, l, s);
            seconds += layer_s;
            hbm += layer.hbm_bytes;
            cpu += layer.cpu_bytes;
            units += self.shapes[l].unit_device_bytes(s);
            layers.push(layer);
        }
        // Next-layer prefetch: the host reads each prefetching layer's guess router before the
        // previous layer's experts (on the step's path).
        let (prefetch, guess_router_bytes) = self.guess_routers(mode, &slots);
        cpu += guess_router_bytes;
        seconds += guess_router_bytes as f64 / hw.dram_read_bytes_per_s;
        let per_session = g.kv / base.budget.sessions.max(1) as u64;
        hbm += per_session / 2;
        seconds += batch::bounded(
            (g.head + per_session / 2) as f64,
            hw.hbm_bytes_per_s,
            1,
            batch::head_flops(spec),
            hw.matmul_flops_per_s,
        );
        // About 16 ops a layer (norms, projections, rope, attention, router, experts, merge).
        seconds += (spec.n_layers * 16 + 4) as f64 * hw.op_overhead_s;
        let (copies_per_step, copies) = self.copies(mode, seconds, &mut layers);
        // A GPU's copy engine moves them while it computes; where copies and compute share
        // memory (the budgeted CPU device) they take turns.
        let copy_s = copies as f64 / hw.h2d_pinned_bytes_per_s;
        let seconds = hw.together_s(seconds, copy_s);
        // Down: every layer's FFN input and router logits, and the logits; up: the token's
        // embedding, the CPU's partial sums where it computes any expert, and the copies.
        let d2h = spec.n_layers as u64 * ((d + moe_rows) * 4) as u64 + (spec.vocab_size * 4) as u64;
        let partials = layers.iter().filter(|x| x.cpu_bytes > 0).count() as u64 * (d * 4) as u64;
        let low_bit_bytes: u64 = layers.iter().map(|x| x.low_bit_bytes).sum();
        // Streamed experts (their time is in each layer's).
        let streamed: u64 = if mode == ExpertMode::Stream {
            layers.iter().map(|x| x.copy_bytes).sum()
        } else {
            0
        };
        let h2d = (d * 4) as u64 + partials + copies + low_bit_bytes + streamed;
        let pcie = h2d + d2h;
        let stream = self.stream.map_or(0, |(_, b)| b);
        let low_bit = self.low.as_ref().map_or(0, LowBitExperts::device_bytes);
        let placed = self.everything_else + units + stream + low_bit;
        let dram_expert_bytes = self.host.bytes;
        let mut plan = base.clone();
        plan.gpu.resident_layers = self.attention + self.routers + units + stream + low_bit;
        plan.gpu.merge = self.merge;
        plan.gpu.placed = placed;
        plan.gpu.total = g.fixed + placed;
        plan.per_token = super::PerToken {
            h2d_bytes: h2d,
            d2h_bytes: d2h,
            ssd_bytes: layers.iter().map(|x| x.ssd_bytes).sum(),
            hbm_read_bytes: hbm,
            cpu_read_bytes: cpu,
        };
        plan.prediction.tokens_per_s = if seconds > 0.0 { 1.0 / seconds } else { 0.0 };
        plan.prediction.limited_by = format!("experts: {}", mode.name());
        ExpertPlan {
            mode,
            experts: self.experts,
            used: self.used,
            layers,
            shapes: self.shapes.to_vec(),
            copies_per_step,
            device: ExpertDevice {
                attention: self.attention,
                routers: self.routers,
                units,
                stream,
                low_bit,
                merge: self.merge,
                placed,
                total: g.fixed + placed,
            },
            dram_expert_bytes,
            host: self.host.clone(),
            staging: self.staging,
            batch: self.batch,
            stream_rows: self.stream.map(|(r, _)| r),
            per_token: SparsePerToken::of_bytes(hbm, cpu, pcie),
            predicted_tokens_per_s: if seconds > 0.0 { 1.0 / seconds } else { 0.0 },
            routing: self.routing.clone(),
            prefetch,
            guess_router_bytes,
            low_bit: self.low.clone(),
            alternatives: Vec::new(),
            seeds: match (&self.ranks, mode) {
                (Some(r), ExpertMode::Units | ExpertMode::Static) => slots
                    .iter()
                    .zip(r)
                    .map(|(&s, (ids, _))| ids[..s.min(ids.len())].to_vec())
                    .collect(),
                _ => Vec::new(),
            },
            scores: match &self.ranks {
                Some(r) => r
                    .iter()
                    .map(|(ids, shares)| {
                        let mut score = vec![0f32; ids.len()];
                        for (&e, &sh) in ids.iter().zip(shares) {
                            score[e as usize] = sh as f32;
                        }
                        score
                    })
                    .collect(),
                None => Vec::new(),
            },
            plan,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(bytes: u64, shared: usize) -> ExpertShape {
        ExpertShape {
            gate: bytes,
            up: bytes,
            down: bytes,
            shared,
            router: 0,
            read_extent: bytes,
            dims: [(1, 1); 3],
        }
    }

    #[test]
    fn slots_are_shared_evenly_then_to_the_smallest_experts() {
        let g = crate::footprint::DEVICE_ALIGN;
        // One slot of layer 0 takes 3 granules, of layer 1 6 granules.
        let shapes = [shape(g, 0), shape(2 * g, 0)];
        let cost = |s: &[usize]| -> u64 {
            shapes
                .iter()
                .zip(s)
                .map(|(x, &k)| x.unit_device_bytes(k))
                .sum()
        };
        assert_eq!(share_slots(&shapes, 8, 0), [0, 0]);
        // Two of each (18 granules), and one more for layer 0 (3 more).
        assert_eq!(share_slots(&shapes, 8, 21 * g), [3, 2]);
        assert_eq!(cost(&[3, 2]), 21 * g);
        // Never more than every expert.
        assert_eq!(share_slots(&shapes, 8, u64::MAX / 4), [8, 8]);
        // A shared expert's parts take their slots first.
        let shared = [shape(g, 1), shape(g, 1)];
        assert_eq!(shared[0].unit_device_bytes(0), 3 * g);
        assert_eq!(share_slots(&shared, 8, 6 * g), [0, 0]);
        assert_eq!(share_slots(&shared, 8, 9 * g), [1, 0]);
    }
}
