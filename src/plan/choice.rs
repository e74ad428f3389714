//! Which mode runs the FFN neurons an offloaded run cannot keep on the device (`--cold`):
//! streamed in ([`super::stream`]), split with the CPU ([`super::split`]), hybrid
//! ([`super::hybrid`]) or cache units ([`super::units`]); for `auto`, every candidate the model
//! and profile allow, planned and compared by its predicted tokens/s — the aggregate of a decode
//! step of the budget's sequences ([`super::batch`]): the fastest mode for one sequence need
//! not be the fastest for many.
//!
//! Fails as the chosen mode's planner does; `auto` falls back to streaming, which always plans
//! where anything does.

use serde::Serialize;

use crate::sparsity::SparsityProfile;
use crate::store::Manifest;

use super::Plan;
use super::budget::{Budget, PlanError};
use super::hardware::HardwareProfile;
use super::hybrid::{HybridPlan, plan_hot_neurons, plan_hot_streamed};
use super::precision::Precision;
use super::stream::make_plan;
use super::units::{UnitPlan, mix_with_hybrid, plan_units_fastest, plan_units_streamed};

/// Where an offloaded run's FFN neurons that do not fit the device run (`--cold`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Cold {
    /// Streamed in per token, all computed on the device.
    Stream,
    /// Bundled FFNs: the CPU computes the last neurons of every layer from DRAM, as many as
    /// balance the copies of the rest.
    Split,
    /// Hybrid: hot neurons (by the sparsity profile) resident, the CPU computes the others. A
    /// mixture-of-experts model: every routed expert computed by the CPU from DRAM, the rest on
    /// the device (llama.cpp's `-ot exps=CPU`).
    Cpu,
    /// Cache units (bundled FFNs): the device computes every active neuron from a unit per
    /// layer that only the neurons it lacks are copied into (by the sparsity profile). A
    /// mixture-of-experts model: a unit of expert slots per layer in what the budget leaves,
    /// updated by the ATU; the experts it lacks computed by the CPU meanwhile.
    Gpu,
    /// The fastest of the above by the plan's prediction (hybrid and cache units only where a
    /// profile exists).
    Auto,
}

/// What [`plan_cold`] chose.
pub struct ColdChoice {
    /// The streaming plan (with the split where chosen); hybrid execution's base plan.
    pub plan: Plan,
    /// Hybrid execution's hot-neuron plan, where chosen.
    pub hot: Option<HybridPlan>,
    /// The cache units, where chosen.
    pub units: Option<UnitPlan>,
    /// The predicted tokens/s of every candidate considered (aggregate, all the budget's
    /// sequences together).
    pub candidates: Vec<(Cold, f64)>,
}

/// The plan of an offloaded run for `mode`: the streaming plan (with or without the split) and,
/// for hybrid execution, the hot-neuron plan; `profile` at its target, where one exists (hybrid
/// needs it); cache units at the fastest of the neuron `precisions`. For `auto`, the
/// candidate predicted fastest, and the predictions of all of them.
pub fn plan_cold(
    m: &Manifest,
    budget: &Budget,
    hw: &HardwareProfile,
    mode: Cold,
    profile: Option<(&SparsityProfile, f64)>,
    precisions: &[Precision],
) -> Result<ColdChoice, PlanError> {
    let plan_with = |split: bool| {
        make_plan(
            m,
            &Budget {
                cpu_split: split,
                ..budget.clone()
            },
            hw,
        )
    };
    let hybrid = |plan: &Plan| -> Result<HybridPlan, PlanError> {
        let Some((p, target)) = profile else {
            return Err(PlanError::Store(
                "hybrid execution places hot neurons by their activation frequency: run `gpu-offload profile` first".into(),
            ));
        };
        match plan_hot_neurons(m, plan, p, target) {
            // Attention does not all fit: stream it, beside hot neurons in a share of the room
            // (none: as much attention resident as fits, every neuron cold).
            Err(e @ PlanError::GpuTooSmall { .. }) => {
                let room = make_plan(
                    m,
                    &Budget {
                        hot_reserve: Some(0),
                        cpu_split: false,
                        ..budget.clone()
                    },
                    hw,
                )?
                .gpu
                .resident_layers;
                [0.0, 0.25, 0.5, 0.75, 1.0]
                    .iter()
                    .filter_map(|f| {
                        plan_hot_streamed(m, budget, hw, p, target, (room as f64 * f) as u64).ok()
                    })
                    .max_by(|a, b| {
                        a.predicted_tokens_per_s
                            .total_cmp(&b.predicted_tokens_per_s)
                    })
                    .ok_or(e)
            }
            r => r,
        }
    };
    let units = |plan: &Plan, mix: bool| units_of(m, budget, hw, plan, profile, precisions, mix);
    let (plan, hot, units, candidates) = match mode {
        Cold::Stream | Cold::Split => {
            let plan = plan_with(mode == Cold::Split)?;
            let t = plan.prediction.tokens_per_s;
            (plan, None, None, vec![(mode, t)])
        }
        Cold::Cpu => {
            let plan = plan_with(false)?;
            let hot = hybrid(&plan)?;
            let t = hot.predicted_tokens_per_s;
            let plan = hot.base_plan.as_deref().cloned().unwrap_or(plan);
            (plan, Some(hot), None, vec![(Cold::Cpu, t)])
        }
        Cold::Gpu => {
            let u = match (plan_with(false), profile) {
                // Streaming needs a slot of a whole layer; units beside streamed attention
                // only one of its attention.
                (Err(PlanError::GpuTooSmall { .. }), Some((p, target))) => {
                    plan_units_streamed(m, budget, hw, p, target, precisions, false)?
                }
                (r, _) => units(&r?, false)?,
            };
            let t = u.predicted_tokens_per_s;
            let plan = match u.base_plan.as_deref() {
                Some(base) => base.clone(),
                None => plan_with(false)?,
            };
            (plan, None, Some(u), vec![(Cold::Gpu, t)])
        }
        Cold::Auto => {
            let stream = plan_with(false)?;
            let split = plan_with(true)?;
            let mut seen = vec![(Cold::Stream, stream.prediction.tokens_per_s)];
            if split.residency.cpu_rows > 0 {
                seen.push((Cold::Split, split.prediction.tokens_per_s));
            }
            // Hybrid where a profile exists (attention resident, or streamed beside).
            let hot = match profile {
                Some(_) if stream.streams() => hybrid(&stream).ok(),
                _ => None,
            };
            if let Some(h) = &hot {
                seen.push((Cold::Cpu, h.predicted_tokens_per_s));
            }
            // Cache units, each layer hybrid instead where that is faster.
            // (Beside streamed attention the units' own planning mixes them, in the same
            // reserve.)
            let unit_plan = match profile {
                Some(_) if stream.streams() => units(&stream, true).ok().map(|u| match &hot {
                    Some(h) if u.base_plan.is_none() => {
                        mix_with_hybrid(m, &stream, u.clone(), h).unwrap_or(u)
                    }
                    _ => u,
                }),
                _ => None,
            };
            if let Some(u) = &unit_plan {
                seen.push((Cold::Gpu, u.predicted_tokens_per_s));
            }
            let best = seen
                .iter()
                .copied()
                .fold((Cold::Stream, 0.0), |b, c| if c.1 > b.1 { c } else { b })
                .0;
            match best {
                Cold::Split => (split, None, None, seen),
                Cold::Cpu => {
                    let base = hot.as_ref().and_then(|h| h.base_plan.as_deref().cloned());
                    (base.unwrap_or(stream), hot, None, seen)
                }
                Cold::Gpu => {
                    let base = unit_plan
                        .as_ref()
                        .and_then(|u| u.base_plan.as_deref().cloned());
                    (base.unwrap_or(stream), None, unit_plan, seen)
                }
                _ => (stream, None, None, seen),
            }
        }
    };
    Ok(ColdChoice {
        plan,
        hot,
        units,
        candidates,
    })
}

/// Cache units for `budget` beside every layer's attention resident (`plan`, the streaming
/// plan, sizes them), or, where that does not fit, beside streamed attention (each layer hybrid
/// instead where faster, where `mix`).
#[allow(clippy::too_many_arguments)]
fn units_of(
    m: &Manifest,
    budget: &Budget,
    hw: &HardwareProfile,
    plan: &Plan,
    profile: Option<(&SparsityProfile, f64)>,
    precisions: &[Precision],
    mix: bool,
) -> Result<UnitPlan, PlanError> {
    let Some((p, target)) = profile else {
        return Err(PlanError::Store(
            "cache units are sized and kept by the neurons' activation frequencies: run `gpu-offload profile` first".into(),
        ));
    };
    match plan_units_fastest(m, plan, Some(p), target, precisions) {
        Err(PlanError::GpuTooSmall { .. }) => {
            plan_units_streamed(m, budget, hw, p, target, precisions, mix)
        }
        r => r,
    }
}
