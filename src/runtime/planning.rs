//! The plan of a store for a budget (`gpu-offload plan`): its sparsity profile read where
//! `--cold` or `--hot-neurons` needs one, the cold choice ([`plan_cold`]), and hot neurons
//! placed as PowerInfer does where asked. Prints nothing.

use anyhow::Result;

use super::BudgetArgs;
use crate::plan::choice::{Cold, ColdChoice, plan_cold};
use crate::plan::hybrid::{HybridPlan, plan_hot_neurons};
use crate::plan::units::UnitPlan;
use crate::plan::{Budget, HardwareProfile, Plan};
use crate::sparsity::SparsityProfile;
use crate::store::Store;

/// A store's plan with what the cold choice and `--hot-neurons` add.
pub struct StorePlan {
    pub plan: Plan,
    /// The hot-neuron plan: the cold choice's, or the one `--hot-neurons` asked for.
    pub hot: Option<HybridPlan>,
    /// The cache units, where chosen.
    pub units: Option<UnitPlan>,
    /// The predicted tokens/s of every candidate considered.
    pub candidates: Vec<(Cold, f64)>,
    /// What runs the neurons that do not fit: `cpu`, `gpu`, `split` or `stream`.
    pub chosen: &'static str,
}

/// Plan `store` (named `name` in errors) for `budget` on `hw` under the budget flags' `--cold`,
/// placing hot neurons at `sparsity_target` as well where `hot_neurons` asks.
pub fn plan_store(
    store: &Store,
    name: &str,
    budget: &Budget,
    hw: &HardwareProfile,
    flags: &BudgetArgs,
    hot_neurons: bool,
    sparsity_target: f64,
) -> Result<StorePlan> {
    let profile_path = SparsityProfile::path_in(store.dir());
    let cold = flags.cold;
    let wants_profile = hot_neurons
        || cold == Cold::Cpu
        || cold == Cold::Gpu
        || (cold == Cold::Auto && profile_path.exists());
    let profile = if wants_profile {
        Some(SparsityProfile::load(
            store.dir(),
            &store.manifest.model_id,
            name,
        )?)
    } else {
        None
    };
    // With predictors (`--sparsity predicted`) the frequencies are those of the target they
    // were trained for.
    let sparsity_target = match (budget.predicted, &profile) {
        (false, _) | (true, None) => sparsity_target,
        (true, Some(p)) => p.predictor_target_of(name)?,
    };
    let ColdChoice {
        plan,
        hot: chosen_hot,
        units,
        candidates,
    } = plan_cold(
        &store.manifest,
        budget,
        hw,
        cold,
        profile.as_ref().map(|p| (p, sparsity_target)),
        &flags.precisions(store, sparsity_target)?,
    )?;
    // What runs the neurons that do not fit.
    let chosen = if chosen_hot.is_some() {
        "cpu"
    } else if units.is_some() {
        "gpu"
    } else if plan.residency.cpu_rows > 0 {
        "split"
    } else {
        "stream"
    };
    let hot = match (&profile, chosen_hot) {
        (_, Some(h)) => Some(h),
        (Some(p), None) if hot_neurons => Some(plan_hot_neurons(
            &store.manifest,
            &plan,
            p,
            sparsity_target,
        )?),
        _ => None,
    };
    Ok(StorePlan {
        plan,
        hot,
        units,
        candidates,
        chosen,
    })
}

/// The routing profile of a mixture-of-experts store, if `profile` made one (`name` names the
/// model in the errors' advice): refused where it is another model's or corrupt.
pub fn routing_profile(
    store: &Store,
    name: &str,
) -> Result<Option<crate::sparsity::routing::RoutingProfile>> {
    let spec = &store.manifest.spec;
    let experts = spec.moe.as_ref().map_or(0, |m| m.experts);
    Ok(crate::sparsity::routing::RoutingProfile::load(
        store.dir(),
        &store.manifest.model_id,
        (spec.n_layers, experts),
        name,
    )?)
}
