//! An offloaded run's plan and weight source: the plan for `--cold` (reading the sparsity
//! profile where it needs one), and the weights streamed, split hot/cold with the CPU, or held
//! in cache units, as the plan says.

use std::sync::Arc;

use anyhow::{Context, Result};

use super::ModelArgs;
use super::model::{DEFAULT_SPARSITY_TARGET, LoadedModel};
use super::running::{Hybrid, Units};
use crate::backend::Backend;
use crate::backend::cpu::kernels;
use crate::engine::WeightSource;
use crate::footprint::Ledger;
use crate::plan::{HardwareProfile, Plan};
use crate::sparsity::SparsityProfile;
use crate::store::Store;
use crate::tier::hybrid::HybridWeights;
use crate::tier::stream::StreamWeights;

/// What an offloaded run's plan puts beside streaming, if anything.
pub(super) enum NeuronPlan {
    Stream,
    Hybrid(crate::plan::hybrid::HybridPlan),
    Units(crate::plan::units::UnitPlan),
    /// A mixture-of-experts model: expert units (or every routed expert on the CPU).
    Experts(Box<crate::plan::experts::ExpertPlan>),
}

/// An offloaded run's weight source, and what its sparse execution reports.
pub(super) struct OffloadSource<B: Backend> {
    pub(super) src: Box<dyn WeightSource<B>>,
    pub(super) hybrid: Option<Hybrid>,
    pub(super) units: Option<Units>,
    pub(super) experts: Option<super::running::ExpertsRun>,
}

/// Log the plan, and say so when the budget narrowed the prefetch window.
fn note_plan(plan: &Plan) {
    tracing::info!("plan:\n{}", plan.report());
    if plan.streams() && plan.window < plan.budget.window {
        tracing::warn!(
            "--gpu-mem holds a prefetch window of {} layers, not the {} asked",
            plan.window,
            plan.budget.window
        );
    }
}

impl LoadedModel {
    /// The plan of an offloaded run for `--cold` (see [`crate::plan::choice::plan_cold`]): the
    /// sparsity profile is read where hybrid execution needs it or `auto` may choose it.
    pub(super) fn offload_plan(
        &self,
        args: &ModelArgs,
        store: &Store,
        budget: &crate::plan::Budget,
        hw: &HardwareProfile,
    ) -> Result<(Plan, NeuronPlan)> {
        use crate::plan::choice::{Cold, plan_cold};
        let cold = args.budget.cold;
        if store.manifest.spec.moe.is_some() {
            return self.expert_plan(store, budget, hw, cold);
        }
        let name = self.path.display().to_string();
        let load = || SparsityProfile::load(store.dir(), &store.manifest.model_id, &name);
        let profile =
            match cold {
                Cold::Cpu => Some(
                    load().context("--cold cpu places the hot neurons by how often they fire")?,
                ),
                Cold::Gpu => Some(load().context(
                    "--cold gpu sizes and keeps its cache units by how often neurons fire",
                )?),
                // Sparse modes only where neurons are skipped: the plan's predictions for them
                // assume the profile's sparsity.
                Cold::Auto
                    if args.sparsity != super::SparsityMode::Off
                        && SparsityProfile::path_in(store.dir()).exists() =>
                {
                    Some(load()?)
                }
                _ => None,
            };
        let target = match (
            args.sparsity,
            profile.as_ref().and_then(|p| p.predictor_target),
        ) {
            (super::SparsityMode::Predicted, Some(t)) => t,
            _ => args.sparsity_target.unwrap_or(DEFAULT_SPARSITY_TARGET),
        };
        let crate::plan::choice::ColdChoice {
            plan,
            hot,
            units,
            candidates: seen,
        } = plan_cold(
            &store.manifest,
            budget,
            hw,
            cold,
            profile.as_ref().map(|p| (p, target)),
            &args.budget.precisions(store, target)?,
        )?;
        if seen.len() > 1 {
            tracing::info!("--cold auto, predicted tokens/s: {seen:?}");
        }
        note_plan(&plan);
        if let Some(h) = &hot {
            tracing::info!("hybrid plan:\n{}", h.report());
        }
        if let Some(u) = &units {
            tracing::info!("cache units:\n{}", u.report());
        }
        let neurons = match (hot, units) {
            (Some(h), _) => NeuronPlan::Hybrid(h),
            (_, Some(u)) => NeuronPlan::Units(u),
            _ => NeuronPlan::Stream,
        };
        Ok((plan, neurons))
    }

    /// The plan of an offloaded mixture-of-experts model: `--cold cpu` keeps every routed
    /// expert on the CPU, `gpu` gives the room to expert units, `auto` takes the faster.
    fn expert_plan(
        &self,
        store: &Store,
        budget: &crate::plan::Budget,
        hw: &HardwareProfile,
        cold: crate::plan::choice::Cold,
    ) -> Result<(Plan, NeuronPlan)> {
        use crate::plan::experts::{ExpertMode, plan_experts};
        let mode = ExpertMode::for_cold(cold)?;
        let routing = super::planning::routing_profile(store, &self.path.display().to_string())?;
        let ep = plan_experts(&store.manifest, budget, hw, mode, routing.as_ref())?;
        tracing::info!("expert plan:\n{}", ep.report());
        Ok((ep.plan.clone(), NeuronPlan::Experts(Box::new(ep))))
    }

    /// The weight source of an offloaded run: streaming (the plan may split the FFN with the
    /// CPU), hybrid (a hot-neuron plan: hot neurons on the device, cold ones on the CPU) or
    /// cache units (every active neuron on the device, copied in as the units lack them).
    pub(super) fn offload_source<B: Backend>(
        &self,
        b: &B,
        store: &Arc<Store>,
        plan: &Plan,
        neurons: NeuronPlan,
        ledger: &Arc<Ledger>,
        (kernels, threads): (&'static kernels::Kernels, usize),
    ) -> Result<OffloadSource<B>> {
        let act = crate::engine::backend_act(self.spec.activation);
        let hot = match neurons {
            NeuronPlan::Experts(ep) => {
                let src = crate::tier::experts::ExpertWeights::new(
                    b,
                    store.clone(),
                    &ep,
                    ledger.clone(),
                    kernels,
                    threads,
                    act,
                )?;
                let traffic = src.traffic();
                return Ok(OffloadSource {
                    src: Box::new(src),
                    hybrid: None,
                    units: None,
                    experts: Some(super::running::ExpertsRun { plan: *ep, traffic }),
                });
            }
            NeuronPlan::Stream => {
                let src = StreamWeights::with_cpu_kernels(
                    b,
                    store.clone(),
                    plan,
                    ledger.clone(),
                    kernels,
                    None,
                )?;
                return Ok(OffloadSource {
                    src: Box::new(src),
                    hybrid: None,
                    units: None,
                    experts: None,
                });
            }
            NeuronPlan::Units(u) => {
                let (src, traffic): (Box<dyn WeightSource<B>>, _) = if u.base_plan.is_some() {
                    // Attention streamed beside the units: the streaming source runs it.
                    let src = StreamWeights::with_units(
                        b,
                        store.clone(),
                        plan,
                        ledger.clone(),
                        kernels,
                        &crate::tier::units::UnitLayout::of(&u),
                        act,
                    )?;
                    let traffic = src
                        .unit_traffic()
                        .ok_or_else(|| anyhow::anyhow!("a unit plan without units"))?;
                    (Box::new(src), traffic)
                } else {
                    let src = crate::tier::units::UnitWeights::new(
                        b,
                        store.clone(),
                        plan,
                        &u.slots(),
                        u.precision,
                        Some(&u.scores),
                        u.hybrid.as_ref(),
                        ledger.clone(),
                        kernels,
                        act,
                    )?;
                    let traffic = src.traffic();
                    (Box::new(src), traffic)
                };
                return Ok(OffloadSource {
                    src,
                    hybrid: None,
                    units: Some(Units { plan: u, traffic }),
                    experts: None,
                });
            }
            NeuronPlan::Hybrid(h) => h,
        };
        let (src, traffic): (Box<dyn WeightSource<B>>, _) = if hot.base_plan.is_some() {
            // Attention streamed beside the hot neurons: the streaming source runs it.
            let src = StreamWeights::with_cpu_kernels(
                b,
                store.clone(),
                plan,
                ledger.clone(),
                kernels,
                Some(&hot),
            )?;
            let traffic = src
                .cpu_traffic()
                .ok_or_else(|| anyhow::anyhow!("a hybrid plan without CPU neurons"))?;
            (Box::new(src), traffic)
        } else {
            let src =
                HybridWeights::new(b, store.clone(), plan, &hot, ledger.clone(), kernels, act)?;
            let traffic = src.traffic();
            (Box::new(src), traffic)
        };
        Ok(OffloadSource {
            src,
            hybrid: Some(Hybrid { plan: hot, traffic }),
            units: None,
            experts: None,
        })
    }
}
