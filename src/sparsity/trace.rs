//! Decode traces of active neurons: per layer, the FFN neurons each token activates (as the
//! sparsity mask decides: `|act| > threshold`, a ReLU model's exact zeros at threshold 0), as
//! the engine computes them. What cache units are judged on (`bench units`).

use std::sync::Mutex;

use crate::engine::ActivationTap;

/// Records each layer's active neuron ids, a set per token, in the order the tokens run.
pub struct ActiveSetTap {
    thresholds: Vec<f32>,
    d_ff: usize,
    /// `[layer][token]`: ascending neuron ids.
    sets: Mutex<Vec<Vec<Vec<u32>>>>,
}

impl ActiveSetTap {
    /// A tap for a model of `thresholds.len()` layers of `d_ff` neurons.
    pub fn new(thresholds: Vec<f32>, d_ff: usize) -> Self {
        let layers = thresholds.len();
        ActiveSetTap {
            thresholds,
            d_ff,
            sets: Mutex::new(vec![Vec::new(); layers]),
        }
    }

    /// The trace so far, `[layer][token]`, leaving the tap empty.
    pub fn take(&self) -> Vec<Vec<Vec<u32>>> {
        let mut sets = self.sets.lock().unwrap_or_else(|p| p.into_inner());
        let layers = sets.len();
        std::mem::replace(&mut *sets, vec![Vec::new(); layers])
    }
}

/// The share of each token's set (after the first) its predecessor shared: neurons (`bench
/// units`) or routed experts (`bench experts`).
pub fn adjacent_overlap(trace: &[Vec<u32>]) -> f64 {
    let (mut shared, mut total) = (0u64, 0u64);
    for w in trace.windows(2) {
        let prev: std::collections::HashSet<u32> = w[0].iter().copied().collect();
        shared += w[1].iter().filter(|n| prev.contains(n)).count() as u64;
        total += w[1].len() as u64;
    }
    if total == 0 {
        1.0
    } else {
        shared as f64 / total as f64
    }
}

/// Whether an activation counts as active under `threshold` (what the mask keeps; see
/// [`crate::backend::sparse_act`]): nonzero, and above the threshold in magnitude.
pub fn is_active(a: f32, threshold: f32) -> bool {
    a != 0.0 && a.abs() > threshold
}

impl ActivationTap for ActiveSetTap {
    fn observe(&self, layer: usize, _input: &[f32], acts: &[f32], n: usize) {
        let Some(&t) = self.thresholds.get(layer) else {
            return;
        };
        let rows: Vec<Vec<u32>> = acts
            .chunks_exact(self.d_ff)
            .take(n)
            .map(|row| {
                row.iter()
                    .enumerate()
                    .filter(|&(_, &a)| is_active(a, t))
                    .map(|(i, _)| i as u32)
                    .collect()
            })
            .collect();
        let mut sets = self.sets.lock().unwrap_or_else(|p| p.into_inner());
        sets[layer].extend(rows);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_what_the_mask_keeps_per_token() {
        let tap = ActiveSetTap::new(vec![0.0, 0.5], 4);
        // Two tokens: layer 0 keeps the nonzero activations, layer 1 those above 0.5.
        let acts = [0.0, 0.2, -0.7, 0.0, 1.0, 0.0, 0.0, 0.6];
        tap.observe(0, &[], &acts, 2);
        tap.observe(1, &[], &acts, 2);
        let sets = tap.take();
        assert_eq!(sets[0], vec![vec![1, 2], vec![0, 3]]);
        assert_eq!(sets[1], vec![vec![2], vec![0, 3]]);
        assert!(tap.take()[0].is_empty());
    }
}
