//! The predictors' recall measured on a run's own tokens ([`RecallTap`]): with the model loaded
//! whole, each layer's true active set (the threshold's mask at the target the predictors were
//! trained for, as `profile` trained them: `|a| > t`) beside the neurons its predictor names for
//! the same FFN input. The profile's held-out recall is of its corpus; this is of what ran.

use std::sync::Mutex;

use serde::Serialize;

use super::predictor::Predictor;
use crate::engine::ActivationTap;

/// Per layer: tokens seen, neurons active, active ones named, neurons named.
type Counts = [u64; 4];

/// Counts each layer's active, named and recalled neurons as the model runs.
pub struct RecallTap {
    predictors: Vec<Predictor>,
    thresholds: Vec<f32>,
    d_ff: usize,
    counts: Mutex<Vec<Counts>>,
}

/// What [`RecallTap`] counted, per layer and over all of them.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Recall {
    /// Active neurons named, over active neurons.
    pub recall: f64,
    /// Neurons named, over all neurons of every token.
    pub named_share: f64,
    /// Neurons active, over all neurons of every token.
    pub active_share: f64,
    /// Tokens per layer the counts are of.
    pub tokens: u64,
    /// Each layer's recall (1 where nothing was active).
    pub layers: Vec<f64>,
}

impl RecallTap {
    /// The `predictors` of a profile and its `thresholds` at the target they were trained for,
    /// one per layer of `d_ff` neurons.
    pub fn new(predictors: Vec<Predictor>, thresholds: Vec<f32>, d_ff: usize) -> Self {
        let n = predictors.len();
        RecallTap {
            predictors,
            thresholds,
            d_ff,
            counts: Mutex::new(vec![[0; 4]; n]),
        }
    }

    /// The counts so far.
    pub fn recall(&self) -> Recall {
        let counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        let sum = |i: usize| counts.iter().map(|c| c[i]).sum::<u64>();
        let (tokens, active, recalled, named) = (sum(0), sum(1), sum(2), sum(3));
        let ratio = |a: u64, b: u64| if b == 0 { 1.0 } else { a as f64 / b as f64 };
        let all = tokens * self.d_ff as u64;
        Recall {
            recall: ratio(recalled, active),
            named_share: ratio(named, all),
            active_share: ratio(active, all),
            tokens: counts.first().map_or(0, |c| c[0]),
            layers: counts.iter().map(|c| ratio(c[2], c[1])).collect(),
        }
    }
}

impl ActivationTap for RecallTap {
    fn observe(&self, layer: usize, input: &[f32], acts: &[f32], n: usize) {
        let (Some(p), Some(&t)) = (self.predictors.get(layer), self.thresholds.get(layer)) else {
            return;
        };
        let named = p.active(input, n);
        let (mut active, mut recalled) = (0u64, 0u64);
        for (&a, &k) in acts.iter().zip(&named) {
            if a.abs() > t {
                active += 1;
                recalled += k as u64;
            }
        }
        let mut counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = counts.get_mut(layer) {
            c[0] += n as u64;
            c[1] += active;
            c[2] += recalled;
            c[3] += named.iter().filter(|&&k| k).count() as u64;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A predictor naming neurons 0 and 2 of 3 for input (1, 0), against activations whose
    /// threshold leaves 0 and 1 on: half the active neurons recalled, two thirds named.
    #[test]
    fn recall_counts_the_active_neurons_the_predictor_names() {
        let p = Predictor {
            d: 2,
            rank: 1,
            neurons: 3,
            w1: vec![1.0, 0.0],
            b1: vec![0.0],
            w2: vec![1.0, -1.0, 0.0],
            b2: vec![0.0, 0.0, 0.5],
            cutoff: 0.25,
        };
        assert_eq!(p.active(&[1.0, 0.0], 1), [true, false, true]);
        let tap = RecallTap::new(vec![p], vec![0.5], 3);
        assert_eq!(tap.recall().recall, 1.0, "nothing active yet");
        tap.observe(0, &[1.0, 0.0], &[0.9, -0.8, 0.1], 1);
        // A layer without a predictor is not counted.
        tap.observe(1, &[1.0, 0.0], &[0.9, 0.9, 0.9], 1);
        let r = tap.recall();
        assert_eq!(r.tokens, 1);
        assert_eq!(r.recall, 0.5);
        assert!((r.named_share - 2.0 / 3.0).abs() < 1e-12);
        assert!((r.active_share - 2.0 / 3.0).abs() < 1e-12);
        assert_eq!(r.layers, [0.5]);
    }
}
