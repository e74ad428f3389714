//! The streaming plan ([`make_plan`]): which rows of every layer stay on the device and which
//! stream through `window` device slots, for a budget.
//!
//! Problem. Beside what the device holds whatever the residency (the process's fixed cost,
//! small fragments, output matrix, KV cache, one step's buffers: `DeviceFrame`), give every
//! layer the same resident share (FlexInfer's balanced locking, [`preserve`]) as large as fits
//! with `window` slots for the streamed rest; with the split, the CPU computes the last FFN
//! neurons instead ([`super::split`]); with a hot reserve (hybrid execution over streamed
//! attention), every FFN row is off the device and the reserve kept free.
//!
//! Algorithm. `L·r + k·(S − r) ≤ A` gives the per-layer share `r` for `L` layers, `k` slots,
//! `S` bytes a layer and `A` bytes left; rounding every buffer to the granule makes that a first
//! guess, shrunk until the rounded total fits: a few preservations of one layer's shape. Then
//! the DRAM plan ([`super::dram`]) and the predicted cost ([`super::cost`]).
//!
//! Fails with [`PlanError::GpuTooSmall`] where not even one slot and what is always held fit
//! (the message lists what takes the bytes), [`PlanError::DramTooSmall`] where the host cannot
//! hold the tables and the dynamic buffers, [`PlanError::Budget`] for a budget that asks for
//! nothing (no window, context, batch or session).

use crate::footprint::{PrefillLayout, StepMemory, device_bytes};
use crate::model::ModelSpec;
use crate::store::Manifest;

use super::batch;
use super::budget::{Budget, PlanError, human_bytes};
use super::cost::{DecodeInputs, decode_cost};
use super::dram::plan_dram;
use super::hardware::HardwareProfile;
use super::manifest::{head_segment, holds, layer_shapes, small_fragments, widest};
use super::prefill::{PrefillChoice, prefill_layout};
use super::preserve::{LayerShape, Part, Residency, preserve};
use super::split;
use super::{GpuBytes, Plan};

/// Plan `m` for `budget` on `hw`.
pub fn make_plan(m: &Manifest, budget: &Budget, hw: &HardwareProfile) -> Result<Plan, PlanError> {
    let spec = &m.spec;
    check_budget(spec, budget)?;
    let frame = DeviceFrame::new(m, budget, hw)?;
    let FittedLayers {
        residency,
        window,
        merge,
    } = frame.fit_layers(m, hw)?;
    let shape = frame.shape;
    let n_layers = frame.n_layers;
    let r = residency.resident_bytes(&shape);
    let s = shape.total() - r - residency.cpu_bytes(&shape);
    let gpu = frame.gpu_bytes(&residency, window, merge);
    let cpu_rows = n_layers as u64 * residency.cpu_bytes(&shape);
    let dram = plan_dram(m, budget, &shape, &residency, s, cpu_rows)?;
    let decode = decode_cost(
        spec,
        budget,
        hw,
        &DecodeInputs {
            shapes: &frame.shapes,
            shape,
            residency,
            prefill: frame.prefill,
            small: frame.small,
            head: frame.head,
            per_session: frame.kv / budget.sessions as u64,
            ssd_bytes: dram.ssd_bytes,
            cpu_rows,
            window,
        },
    );
    Ok(Plan {
        model_id: m.model_id.clone(),
        model: spec.name.clone(),
        spec: spec.clone(),
        hardware: hw.clone(),
        budget: budget.clone(),
        shape,
        residency,
        window,
        resident_bytes_per_layer: r,
        streamed_bytes_per_layer: s,
        gpu,
        dram: dram.plan,
        per_token: decode.per_token,
        prediction: decode.prediction,
        prefill: decode.prefill,
    })
}

/// A budget that asks for at least something of everything (a window, a context, a batch, a
/// session), with a KV type the model's rows take.
fn check_budget(spec: &ModelSpec, budget: &Budget) -> Result<(), PlanError> {
    if budget.window == 0 {
        return Err(PlanError::Budget(
            "the prefetch window must be at least 1 layer".into(),
        ));
    }
    if budget.ctx == 0 || budget.batch == 0 {
        return Err(PlanError::Budget(
            "context and batch must be at least 1".into(),
        ));
    }
    if budget.sessions == 0 {
        return Err(PlanError::Budget("at least one session must fit".into()));
    }
    if let Err(e) = budget.kv_type.check_cols(spec.kv_dim()) {
        return Err(PlanError::Budget(e.to_string()));
    }
    Ok(())
}

/// What every residency of a streaming plan is fitted beside: the device bytes held whatever
/// the residency (fixed cost, small fragments, output matrix, KV cache, step memory), the bytes
/// left, the prefetch window the budget holds, and the layers' shapes.
struct DeviceFrame<'a> {
    budget: &'a Budget,
    n_layers: usize,
    d_model: usize,
    /// Every layer's row shape, and the widest (what a slot is sized for).
    shapes: Vec<LayerShape>,
    shape: LayerShape,
    /// What the process holds before placing anything (context, modules, cuBLAS).
    fixed_cost: u64,
    small: u64,
    head: u64,
    /// `--gpu-mem` less the fixed cost.
    usable: u64,
    prefill: PrefillLayout,
    kv: u64,
    step: StepMemory,
    /// One step's activations and logits, and a partitioned prompt's hidden states.
    scratch: u64,
    /// Small fragments, output matrix, KV, scratch and workspace: placed whatever the residency.
    fixed: u64,
    /// The prefetch window asked for, or the widest narrower one the budget holds (at least 1).
    window: usize,
    /// Every row of every layer.
    all: Residency,
    /// Whether every layer fits resident (then nothing streams).
    all_resident: bool,
    grouped_query: bool,
    /// The KV cache as the refusals name it.
    kv_what: String,
}

/// The residency a streaming plan settles on, the slots it streams through (0: all resident)
/// and the merge buffer hybrid's partial sums come back to (0 without).
struct FittedLayers {
    residency: Residency,
    window: usize,
    merge: u64,
}

impl<'a> DeviceFrame<'a> {
    /// What the device holds beside the layers for `budget` on `hw`, with the prefill layout
    /// and the window; refused where not even a window of one layer fits beside it.
    fn new(m: &Manifest, budget: &'a Budget, hw: &HardwareProfile) -> Result<Self, PlanError> {
        let spec = &m.spec;
        let n_layers = spec.n_layers;
        let shapes = layer_shapes(m)?;
        let shape = widest(&shapes);
        let fixed_cost = hw.fixed_device_bytes();
        let small: u64 = small_fragments(m)
            .iter()
            .map(|&(_, b)| device_bytes(b))
            .sum();
        let head = device_bytes(head_segment(m)?.bytes);
        // The least a streamed layer takes: nothing resident (cache units beside streamed
        // attention: no FFN row either, the units hold it).
        let none = Residency {
            ffn_off: budget.unit_reserve.is_some(),
            ..Residency::default()
        };
        let all = Residency::all(&shape);
        let usable = budget.gpu_mem.saturating_sub(fixed_cost);
        let resident_all_layers = resident_all_layers(&shapes, &all);
        let PrefillChoice {
            layout: prefill,
            kv,
            step,
            residual,
        } = prefill_layout(
            m,
            budget,
            small + head,
            usable,
            resident_all_layers,
            slot_device_bytes(&shape, &none),
        )?;
        // A partitioned prompt's hidden states count with the step's buffers.
        let scratch = step.activations + step.logits + residual;
        let fixed = small + head + kv + scratch + step.workspace;
        // Cache units with streamed attention keep their reserve free whatever the window, and
        // one step's buffers beside it (see `ffn_off`).
        let kept = budget.unit_reserve.map_or(0, |r| r + scratch);
        let minimum_with = |w: usize| fixed + kept + w as u64 * slot_device_bytes(&shape, &none);
        // The prefetch window asked for, or the widest narrower one the budget holds (a window
        // of one layer is the least that runs).
        let asked = budget.window.min(n_layers);
        let window = (1..=asked)
            .rev()
            .find(|&w| usable >= minimum_with(w))
            .unwrap_or(1);
        let minimum = minimum_with(window);
        let kv_what = match budget.kv_pool.filter(|_| !prefill.kv_host) {
            Some(blocks) => format!(
                "a KV pool of {} positions for {} sessions (--kv-pool-tokens)",
                blocks * crate::backend::KV_BLOCK,
                budget.sessions
            ),
            None => format!(
                "KV cache for {} × {} positions",
                budget.sessions, budget.ctx
            ),
        };
        let all_resident = fixed + resident_all_layers <= usable;
        let frame = DeviceFrame {
            budget,
            n_layers,
            d_model: spec.d_model,
            shapes,
            shape,
            fixed_cost,
            small,
            head,
            usable,
            prefill,
            kv,
            step,
            scratch,
            fixed,
            window,
            all,
            all_resident,
            grouped_query: spec.n_kv_heads < spec.n_heads,
            kv_what,
        };
        if !all_resident && usable < minimum {
            let breakdown = frame.breakdown(minimum - fixed - kept);
            return Err(PlanError::GpuTooSmall {
                budget: budget.gpu_mem,
                minimum: fixed_cost + minimum,
                breakdown: if kept > 0 {
                    format!(
                        "{} kept for cache units and their staging (and one step's buffers free beside them) beside {breakdown}",
                        human_bytes(kept)
                    )
                } else {
                    breakdown
                },
            });
        }
        Ok(frame)
    }

    /// What takes the device bytes, with `slots` bytes of streaming slots (for a refusal).
    fn breakdown(&self, slots: u64) -> String {
        let (budget, window, kv_what) = (self.budget, self.window, &self.kv_what);
        format!(
            "fixed device cost {} (context, kernels, cuBLAS), small fragments {}, output matrix {}, {kv_what} {} ({}), step buffers {}, workspace {}, {window} streaming slots {}",
            human_bytes(self.fixed_cost),
            human_bytes(self.small),
            human_bytes(self.head),
            human_bytes(self.kv),
            budget.kv_type.name(),
            human_bytes(self.scratch),
            human_bytes(self.step.workspace),
            human_bytes(slots)
        )
    }

    /// Device bytes placed with residency `r` in every layer and `k` streaming slots (the fixed
    /// cost left out).
    fn placed_with(&self, r: &Residency, k: usize) -> u64 {
        self.fixed
            + resident_all_layers(&self.shapes, r)
            + k as u64 * slot_device_bytes(&self.shape, r)
    }

    /// The residency that fits with the last `cpu` FFN neurons of every layer computed by the
    /// CPU (0: none): the device's share of each layer is the rest. `ffn_off`: no FFN row on
    /// the device at all (hybrid with streamed attention). `merge` bytes are kept beside.
    fn fit(&self, cpu: usize, ffn_off: bool, merge: u64) -> Residency {
        let (n_layers, window, usable) = (self.n_layers, self.window, self.usable);
        let mut dev = self.shape;
        dev.rows[Part::Ffn.index()] -= cpu;
        if ffn_off {
            Part::FFN.iter().for_each(|p| dev.rows[p.index()] = 0);
        }
        let s_dev = dev.total();
        let with_cpu = |r: Residency| Residency {
            cpu_rows: cpu,
            ffn_off,
            ..r
        };
        if self.all_resident && cpu == 0 && !ffn_off {
            return self.all;
        }
        // L·r + k·(S − r) ≤ A  ⇒  r ≤ (A − k·S) / (L − k); L > k here (else all resident fits).
        // Granule rounding makes that a first guess: shrink until the rounded total fits (no
        // residency always does: that is the minimum).
        let avail = usable.saturating_sub(self.fixed + merge);
        let mut per_layer = (avail.saturating_sub(window as u64 * s_dev)
            / (n_layers - window).max(1) as u64)
            .min(s_dev);
        loop {
            let r = with_cpu(preserve(&dev, per_layer, self.grouped_query));
            let placed = self.placed_with(&r, window) + merge;
            if placed <= usable || per_layer == 0 {
                break r;
            }
            let over = (placed - usable).div_ceil((n_layers - window).max(1) as u64);
            per_layer = per_layer.saturating_sub(over.max(crate::footprint::DEVICE_ALIGN));
        }
    }

    /// Every layer resident where it fits, else the balanced share beside the window; then,
    /// where the budget asks, the FFN off the device for hot neurons, or the CPU split.
    fn fit_layers(&self, m: &Manifest, hw: &HardwareProfile) -> Result<FittedLayers, PlanError> {
        let budget = self.budget;
        let (mut residency, window) = if self.all_resident {
            (self.all, 0)
        } else {
            (self.fit(0, false, 0), self.window)
        };
        let mut merge = 0;
        // Hybrid's hot neurons, or cache units, in a reserve beside streamed attention.
        let reserve = match (budget.hot_reserve, budget.unit_reserve) {
            (Some(r), _) => Some((r, true)),
            (None, Some(r)) => Some((r, false)),
            (None, None) => None,
        };
        if let Some((reserve, with_merge)) = reserve
            && window > 0
        {
            (residency, merge) = self.ffn_off(reserve, with_merge)?;
        } else if budget.cpu_split && window > 0 && budget.dram_mem.is_none() && holds(m, Part::Ffn)
        {
            // The CPU+PCIe split: see `split::balance`. No merge buffer: the CPU's rows
            // continue the device's sum (`engine::ColdMerge::Continue`).
            // The CPU computes its neurons for every sequence of a decode step.
            let f = Part::Ffn.index();
            let cpu_rate = batch::cpu_neuron_rate(
                hw,
                batch::neuron_flops(&m.spec),
                self.shape.row_bytes[f],
                batch::step_rows(budget, &self.prefill),
            );
            let cur = split::balance(&self.shape, hw, cpu_rate, residency, |c| {
                self.fit(c, false, 0)
            });
            if cur.cpu_rows > 0 && self.placed_with(&cur, window) <= self.usable {
                residency = cur;
            }
        }
        Ok(FittedLayers {
            residency,
            window,
            merge,
        })
    }

    /// Every FFN neuron off the device (the CPU's, less the hot ones placed later in
    /// `reserve`; or cache units' in `reserve`); attention resident and streamed in what is
    /// left. The residency and the merge buffer (hybrid's, where `merge`), or the refusal where
    /// `reserve` does not fit beside them.
    fn ffn_off(&self, reserve: u64, merge: bool) -> Result<(Residency, u64), PlanError> {
        let (budget, window) = (self.budget, self.window);
        // Hybrid's CPU sums come back into a merge buffer; cache units leave one step's
        // buffers free beside theirs instead (steps of another size reallocate them, and a
        // budget filled exactly has its free bytes in pieces too small for them).
        let (with_merge, reserve) = if merge {
            (
                device_bytes((budget.batch * self.d_model * 4) as u64),
                reserve,
            )
        } else {
            (0, reserve + self.scratch)
        };
        let r = self.fit(0, true, with_merge + reserve);
        let placed = self.placed_with(&r, window) + with_merge + reserve;
        if placed > self.usable {
            return Err(PlanError::GpuTooSmall {
                budget: budget.gpu_mem,
                minimum: self.fixed_cost + placed,
                breakdown: format!(
                    "{} kept for {} beside {}",
                    human_bytes(reserve),
                    if merge {
                        "hot neurons"
                    } else {
                        "cache units and their staging (and one step's buffers free)"
                    },
                    self.breakdown(window as u64 * slot_device_bytes(&self.shape, &r))
                ),
            });
        }
        Ok((r, with_merge))
    }

    /// Device memory by use for `residency` streamed through `window` slots, with `merge`.
    fn gpu_bytes(&self, residency: &Residency, window: usize, merge: u64) -> GpuBytes {
        let placed = self.placed_with(residency, window) + merge;
        GpuBytes {
            merge,
            fixed: self.fixed_cost,
            small: self.small,
            head: self.head,
            resident_layers: resident_all_layers(&self.shapes, residency),
            slots: window as u64 * slot_device_bytes(&self.shape, residency),
            kv: self.kv,
            scratch: self.scratch,
            workspace: self.step.workspace,
            placed,
            total: self.fixed_cost + placed,
        }
    }
}

/// Device bytes of residency `r` in every layer of `shapes`.
fn resident_all_layers(shapes: &[LayerShape], r: &Residency) -> u64 {
    shapes.iter().map(|sh| resident_device_bytes(sh, r)).sum()
}

/// Device bytes of the parts of a layer held resident (one buffer per part).
fn resident_device_bytes(shape: &LayerShape, r: &Residency) -> u64 {
    Part::ALL
        .iter()
        .map(|&p| r.rows[p.index()] as u64 * shape.row_bytes[p.index()])
        .filter(|&b| b > 0)
        .map(device_bytes)
        .sum()
}

/// Device bytes of one streaming slot (one buffer per streamed part).
fn slot_device_bytes(shape: &LayerShape, r: &Residency) -> u64 {
    Part::ALL
        .iter()
        .map(|&p| r.streamed_rows(shape, p).len() as u64 * shape.row_bytes[p.index()])
        .filter(|&b| b > 0)
        .map(device_bytes)
        .sum()
}
