//! The CPU's share of a streamed plan's FFN: with the split (`--cold split`, decided by
//! [`crate::plan::split`]), the last neurons of every layer read into DRAM and computed by the
//! CPU beside the copies of the rest — the neurons PCIe would be slowest to bring; with hybrid
//! over streamed attention, the cold neurons of a hot-neuron plan, the hot ones gathered onto
//! the device (`layer_ffn` of [`super::hybrid`]). Hybrid's partial sums come back into one
//! buffer the device adds; the split's CPU rows, the last, continue the device's sum.
//!
//! Refuses a hot-neuron plan that does not match the plan's FFN (the FFN must be off the
//! device, one hot list per layer), and a plan with the FFN off the device without one.

use std::sync::Arc;

use super::cold::{ColdLayer, ColdTraffic, CpuSide};
use super::hybrid::{HotFfn, layer_ffn};
use super::resident::Small;
use crate::backend::Backend;
use crate::backend::cpu::kernels::Kernels;
use crate::engine::{EngineError, Result};
use crate::footprint::ledger::Ledger;
use crate::plan::hybrid::HybridPlan;
use crate::plan::{Part, Plan};
use crate::store::Store;

/// The FFN neurons the CPU computes, every layer.
pub(super) struct CpuShare<B: Backend> {
    pub(super) layers: Vec<ColdLayer>,
    /// Per layer, the ids of the FFN neurons the device computes, in column order.
    pub(super) device_ids: Vec<Vec<u32>>,
    /// The merge buffer of hybrid's partial sums; none for the split, whose CPU rows continue
    /// the device's sum ([`crate::engine::ColdMerge::Continue`]).
    pub(super) partial: Option<B::Tensor>,
    pub(super) traffic: Arc<ColdTraffic>,
}

/// What of a streamed plan's FFN does not pass through the slots: the CPU's share (none
/// without a split or hot-neuron plan) and, hybrid, each layer's hot block on the device
/// (empty otherwise).
pub(super) struct FfnShares<B: Backend> {
    pub(super) cpu: Option<CpuShare<B>>,
    pub(super) hot_ffn: Vec<HotFfn<B>>,
}

impl<B: Backend> CpuShare<B> {
    /// The CPU's share of `plan`'s FFN, computed with `kernels`: the split's rows, or with
    /// `hot` (whose base plan `plan` is) the cold neurons, the hot ones gathered onto the
    /// device (each layer's device up bias in `small` rewritten in their order).
    pub(super) fn for_plan(
        b: &B,
        store: &Arc<Store>,
        ledger: &Arc<Ledger>,
        plan: &Plan,
        small: &mut [Small<B>],
        kernels: &'static Kernels,
        hot: Option<&HybridPlan>,
    ) -> Result<FfnShares<B>> {
        let spec = &store.manifest.spec;
        let (shape, residency) = (plan.shape, plan.residency);
        let n_layers = spec.n_layers;
        let cpu_rows = residency.cpu_rows_of(&shape, Part::Ffn);
        let act = crate::backend::cpu::ops::activation(crate::engine::backend_act(spec.activation));
        let traffic = Arc::new(ColdTraffic::default());
        let cpu_side = || CpuSide {
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
                    let (part, cold) = layer_ffn(
                        b,
                        store,
                        ledger,
                        l,
                        &h.hot_neurons[l],
                        h.cold_cost[l],
                        &mut sm.up_bias,
                        cpu_side(),
                    )?;
                    layers.push(cold);
                    hot_ffn.push(part);
                }
                ColdLayer::pack_gathered(&mut layers);
                Some(CpuShare {
                    layers,
                    device_ids: h.hot_neurons.clone(),
                    partial: Some(b.alloc(plan.budget.batch.max(1), spec.d_model)?),
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
                    .map(|l| ColdLayer::bundle_rows(store, ledger, l, cpu_rows.clone(), cpu_side()))
                    .collect::<Result<Vec<_>>>()?;
                Some(CpuShare {
                    layers,
                    device_ids: vec![(0..cpu_rows.start as u32).collect(); n_layers],
                    partial: None,
                    traffic,
                })
            }
        };
        Ok(FfnShares { cpu, hot_ffn })
    }
}
