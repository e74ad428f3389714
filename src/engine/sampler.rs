//! Choosing the next token from logits: greedy, or temperature with top-k, top-p and min-p
//! filtering, from a seeded generator so runs repeat.

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

#[derive(Clone, Debug, PartialEq)]
pub struct SamplerParams {
    /// 0 = greedy (argmax).
    pub temperature: f32,
    /// Keep the k most likely tokens (0 = all).
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches p (1 = all).
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` × the most likely one's probability (0 = none).
    pub min_p: f32,
    pub seed: u64,
}

impl Default for SamplerParams {
    fn default() -> Self {
        SamplerParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            seed: 0,
        }
    }
}

impl SamplerParams {
    pub fn greedy() -> Self {
        SamplerParams {
            temperature: 0.0,
            ..Default::default()
        }
    }

    /// Every field within its meaning; the message names the bad one.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(format!("temperature must be ≥ 0, got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top-p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min-p must be in [0, 1], got {}", self.min_p));
        }
        Ok(())
    }
}

pub struct Sampler {
    params: SamplerParams,
    rng: StdRng,
    candidates: Vec<(u32, f32)>,
}

/// Index of the largest value (the first one on ties), ignoring NaN.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > best_v {
            best = i;
            best_v = v;
        }
    }
    best as u32
}

impl Sampler {
    pub fn new(params: SamplerParams) -> Self {
        let rng = StdRng::seed_from_u64(params.seed);
        Sampler {
            params,
            rng,
            candidates: Vec::new(),
        }
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        if p.temperature <= 0.0 || p.top_k == 1 {
            return argmax(logits);
        }
        let c = &mut self.candidates;
        c.clear();
        c.extend(
            logits
                .iter()
                .enumerate()
                .filter(|(_, v)| !v.is_nan())
                .map(|(i, &v)| (i as u32, v)),
        );
        if c.is_empty() {
            return 0;
        }
        let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1);
        if p.top_k > 0 && p.top_k < c.len() {
            c.select_nth_unstable_by(p.top_k - 1, by_logit);
            c.truncate(p.top_k);
        }
        c.sort_unstable_by(by_logit);
        // Softmax at temperature, in place of the logits.
        let max = c[0].1;
        let mut sum = 0f64;
        for e in c.iter_mut() {
            e.1 = ((e.1 - max) / p.temperature).exp();
            sum += e.1 as f64;
        }
        for e in c.iter_mut() {
            e.1 = (e.1 as f64 / sum) as f32;
        }
        if p.min_p > 0.0 {
            let floor = c[0].1 * p.min_p;
            let keep = c.iter().take_while(|e| e.1 >= floor).count().max(1);
            c.truncate(keep);
        }
        if p.top_p < 1.0 {
            let mut acc = 0f32;
            let mut keep = c.len();
            for (i, e) in c.iter().enumerate() {
                acc += e.1;
                if acc >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
            c.truncate(keep);
        }
        let total: f32 = c.iter().map(|e| e.1).sum();
        let mut r = self.rng.random::<f32>() * total;
        for e in c.iter() {
            r -= e.1;
            if r <= 0.0 {
                return e.0;
            }
        }
        c[c.len() - 1].0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_maximum() {
        let mut s = Sampler::new(SamplerParams::greedy());
        assert_eq!(s.sample(&[0.0, 3.0, 3.0, 1.0]), 1);
    }

    #[test]
    fn same_seed_same_choices() {
        let logits: Vec<f32> = (0..100).map(|i| (i as f32 * 0.37).sin()).collect();
        let params = SamplerParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 42,
        };
        let a: Vec<u32> = {
            let mut s = Sampler::new(params.clone());
            (0..20).map(|_| s.sample(&logits)).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(params);
            (0..20).map(|_| s.sample(&logits)).collect()
        };
        assert_eq!(a, b);
        assert!(a.iter().any(|&t| t != a[0]), "sampling at T=1 should vary");
    }

    #[test]
    fn top_k_restricts_the_choice() {
        let logits = [5.0, 4.9, -10.0, 4.8, 0.0];
        let mut s = Sampler::new(SamplerParams {
            temperature: 5.0,
            top_k: 2,
            top_p: 1.0,
            min_p: 0.0,
            seed: 1,
        });
        for _ in 0..200 {
            assert!(s.sample(&logits) < 2);
        }
    }

    #[test]
    fn validation_names_the_field() {
        let p = SamplerParams {
            top_p: 1.5,
            ..Default::default()
        };
        assert!(p.validate().unwrap_err().contains("top-p"));
    }
}
