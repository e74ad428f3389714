//! Hot-neuron placement for a profiled model (PowerInfer §6): everything but the FFN stays on
//! the device (every layer's attention, the output head, KV, step memory), and what the budget
//! leaves holds the FFN neurons that fire most often, chosen by the exact ILP
//! ([`super::placement`]) from the profile's activation frequencies. What `plan --hot-neurons`
//! prints; the hybrid engine (cold neurons on the CPU) runs it.

use serde::Serialize;

use super::placement::{PlacementLayer, min_gpu_neurons, place_hot_neurons};
use super::{Part, Plan, PlanError};
use crate::sparsity::{GRID_TARGETS, SparsityProfile, grid_target};

/// One layer's share of the placement.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct HotLayer {
    pub neurons: usize,
    /// Share of the layer's activations (at the target) its GPU neurons account for.
    pub activation_share: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct HotPlan {
    /// The profile's grid target the frequencies are taken at.
    pub target: f64,
    /// Device bytes left for FFN neurons once everything else is resident.
    pub budget_bytes: u64,
    pub bytes_per_neuron: u64,
    /// Fewest neurons worth a layer's GPU share (C_l).
    pub min_neurons: usize,
    pub layers: Vec<HotLayer>,
    pub bytes: u64,
    /// Share of all FFN activations computed on the GPU.
    pub activation_share: f64,
    pub solve_seconds: f64,
}

/// The placement for `plan`'s budget and hardware from `profile` at `target` sparsity.
pub fn plan_hot_neurons(
    plan: &Plan,
    profile: &SparsityProfile,
    target: f64,
) -> Result<HotPlan, PlanError> {
    let k = ((target / 0.05).round() as usize).clamp(1, GRID_TARGETS) - 1;
    let shape = &plan.shape;
    let spec = &plan.spec;
    let d_ff = spec.d_ff;
    if profile.d_ff != d_ff || profile.n_layers != spec.n_layers {
        return Err(PlanError::Store(
            "the sparsity profile's shape is not this model's".into(),
        ));
    }
    // A neuron's bytes: its bundle, or its gate and up rows and its share of the down matrix.
    let bytes_per_neuron = if shape.rows[Part::Ffn.index()] > 0 {
        shape.row_bytes[Part::Ffn.index()]
    } else {
        shape.row_bytes[Part::Gate.index()]
            + shape.row_bytes[Part::Up.index()]
            + shape.bytes(Part::Down).div_ceil(d_ff.max(1) as u64)
    };
    let attention: u64 = [Part::Q, Part::K, Part::V, Part::O]
        .iter()
        .map(|&p| shape.bytes(p))
        .sum::<u64>()
        * spec.n_layers as u64;
    let g = &plan.gpu;
    let everything_else = g.fixed + g.small + g.head + g.kv + g.scratch + g.workspace + attention;
    let budget_bytes = plan.budget.gpu_mem.saturating_sub(everything_else);
    // C_l: a neuron costs its bytes at DRAM speed on the CPU and at HBM speed on the GPU; a
    // layer split between them pays a round trip (the input down, the partial sum up). A layer
    // wholly on the GPU pays none, so it is always allowed (C_l at most the layer).
    let hw = &plan.hardware;
    let vector = (spec.d_model * 4) as f64;
    let sync = 2.0 * (hw.op_overhead_s + vector / hw.h2d_pinned_bytes_per_s);
    let min_neurons = min_gpu_neurons(
        bytes_per_neuron as f64 / hw.dram_read_bytes_per_s,
        bytes_per_neuron as f64 / hw.hbm_bytes_per_s,
        sync,
        d_ff,
    )
    .min(d_ff);
    let impacts: Vec<Vec<f64>> = (0..spec.n_layers)
        .map(|l| profile.frequencies(l, k))
        .collect();
    let layers: Vec<PlacementLayer> = impacts
        .iter()
        .map(|i| PlacementLayer {
            impacts: i.clone(),
            bytes_per_neuron,
            min_neurons,
        })
        .collect();
    let t0 = std::time::Instant::now();
    let placed = place_hot_neurons(&layers, budget_bytes)
        .map_err(|e| PlanError::Budget(format!("hot-neuron placement: {e}")))?;
    let solve_seconds = t0.elapsed().as_secs_f64();
    let total: f64 = impacts.iter().flatten().sum();
    let hot = placed
        .neurons
        .iter()
        .zip(&impacts)
        .map(|(n, i)| {
            let layer_total: f64 = i.iter().sum();
            // (+ 0.0: an empty float sum is -0.0.)
            let on: f64 = n.iter().map(|&j| i[j as usize]).sum::<f64>() + 0.0;
            HotLayer {
                neurons: n.len(),
                activation_share: if layer_total > 0.0 {
                    on / layer_total
                } else {
                    0.0
                },
            }
        })
        .collect();
    Ok(HotPlan {
        target: grid_target(k),
        budget_bytes,
        bytes_per_neuron,
        min_neurons,
        layers: hot,
        bytes: placed.bytes,
        activation_share: if total > 0.0 {
            placed.impact / total
        } else {
            0.0
        },
        solve_seconds,
    })
}

impl HotPlan {
    pub fn report(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let h = super::human_bytes;
        let _ = writeln!(
            s,
            "hot neurons at {:.0}% sparsity: {} left for FFN neurons after attention, head, KV and step memory; {} per neuron, at least {} per layer (C_l)",
            self.target * 100.0,
            h(self.budget_bytes),
            h(self.bytes_per_neuron),
            self.min_neurons
        );
        let _ = writeln!(s, "layer  GPU neurons  share of its activations");
        for (l, x) in self.layers.iter().enumerate() {
            let _ = writeln!(
                s,
                "{l:>5}  {:>11}  {:>6.1}%",
                x.neurons,
                100.0 * x.activation_share
            );
        }
        let _ = writeln!(
            s,
            "placed {} ({:.1}% of all FFN activations on the GPU), exact ILP solved in {:.1} ms",
            h(self.bytes),
            100.0 * self.activation_share,
            self.solve_seconds * 1e3
        );
        s
    }
}
