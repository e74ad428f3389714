//! Choosing the next token from logits: greedy, or temperature with top-k, top-p and min-p
//! filtering, from a seeded generator so runs repeat; optionally after OpenAI-style presence and
//! frequency penalties and a logit bias, reporting log-probabilities.

use std::collections::HashMap;

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

/// Changes to the logits before sampling (OpenAI's `presence_penalty`, `frequency_penalty` and
/// `logit_bias`): `logit[t] -= presence·[count(t) > 0] + frequency·count(t) - bias[t]`, where
/// `count(t)` is how often `t` was sampled so far by this sampler.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Penalties {
    pub presence: f32,
    pub frequency: f32,
    /// `(token id, value added to its logit)`.
    pub bias: Vec<(u32, f32)>,
}

impl Penalties {
    pub fn is_neutral(&self) -> bool {
        self.presence == 0.0 && self.frequency == 0.0 && self.bias.is_empty()
    }
}

/// A sampled token and, when asked for, its log-probability and the most likely alternatives.
///
/// The log-probabilities are those of the model's distribution after the [`Penalties`] (a
/// log-softmax of the adjusted logits at temperature 1), before temperature and the top-k / top-p
/// / min-p truncation: so they mean the same at every temperature, greedy included (OpenAI's
/// reading; llama.cpp instead reports the probabilities after its whole sampling chain).
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub token: u32,
    pub logprob: f32,
    /// `(token, logprob)`, most likely first.
    pub top: Vec<(u32, f32)>,
}

pub struct Sampler {
    params: SamplerParams,
    rng: StdRng,
    candidates: Vec<(u32, f32)>,
    penalties: Penalties,
    counts: HashMap<u32, u32>,
    adjusted: Vec<f32>,
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
        Self::with_penalties(params, Penalties::default())
    }

    pub fn with_penalties(params: SamplerParams, penalties: Penalties) -> Self {
        let rng = StdRng::seed_from_u64(params.seed);
        Sampler {
            params,
            rng,
            candidates: Vec::new(),
            penalties,
            counts: HashMap::new(),
            adjusted: Vec::new(),
        }
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        self.choose(logits, None).token
    }

    /// Sample from `logits` after the penalties; with `top = Some(n)`, also report the token's
    /// log-probability and the `n` most likely tokens' (see [`Sampled`]).
    pub fn choose(&mut self, logits: &[f32], top: Option<usize>) -> Sampled {
        let mut adjusted = std::mem::take(&mut self.adjusted);
        let logits = if self.penalties.is_neutral() {
            logits
        } else {
            adjusted.clear();
            adjusted.extend_from_slice(logits);
            let pen = &self.penalties;
            for (&t, &c) in &self.counts {
                if let Some(l) = adjusted.get_mut(t as usize) {
                    *l -= pen.presence + pen.frequency * c as f32;
                }
            }
            for &(t, b) in &pen.bias {
                if let Some(l) = adjusted.get_mut(t as usize) {
                    *l += b;
                }
            }
            &adjusted
        };
        let token = self.pick(logits);
        let (logprob, top) = match top {
            Some(n) => log_probs(logits, token, n),
            None => (0.0, Vec::new()),
        };
        if !self.penalties.is_neutral() {
            *self.counts.entry(token).or_default() += 1;
        }
        self.adjusted = adjusted;
        Sampled {
            token,
            logprob,
            top,
        }
    }

    fn pick(&mut self, logits: &[f32]) -> u32 {
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

/// The log-softmax of `logits` at `token`, and the `n` largest `(token, logprob)` (first index
/// first on ties). NaN logits count as impossible.
fn log_probs(logits: &[f32], token: u32, n: usize) -> (f32, Vec<(u32, f32)>) {
    let max = logits
        .iter()
        .copied()
        .filter(|v| !v.is_nan())
        .fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return (f32::NEG_INFINITY, Vec::new());
    }
    let sum: f64 = logits
        .iter()
        .filter(|v| !v.is_nan())
        .map(|&v| ((v - max) as f64).exp())
        .sum();
    let log_z = max as f64 + sum.ln();
    let lp = |v: f32| {
        if v.is_nan() {
            f32::NEG_INFINITY
        } else {
            (v as f64 - log_z) as f32
        }
    };
    let chosen = logits
        .get(token as usize)
        .map_or(f32::NEG_INFINITY, |&v| lp(v));
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
    if n > 0 {
        for (i, &v) in logits.iter().enumerate() {
            if v.is_nan() {
                continue;
            }
            // Kept sorted, largest first; a later equal value goes after.
            if top.len() < n || top.last().is_some_and(|&(_, w)| v > w) {
                let at = top.partition_point(|&(_, w)| w >= v);
                top.insert(at, (i as u32, v));
                top.truncate(n);
            }
        }
    }
    (chosen, top.into_iter().map(|(t, v)| (t, lp(v))).collect())
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
    fn logprobs_are_the_log_softmax_and_top_is_sorted() {
        let logits = [1.0f32, 3.0, 2.0, 3.0, f32::NAN];
        let mut s = Sampler::new(SamplerParams::greedy());
        let r = s.choose(&logits, Some(3));
        assert_eq!(r.token, 1);
        let z: f64 = [1.0f64, 3.0, 2.0, 3.0].iter().map(|v| v.exp()).sum();
        let want = |v: f64| (v - z.ln()) as f32;
        assert!((r.logprob - want(3.0)).abs() < 1e-6);
        let ids: Vec<u32> = r.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, vec![1, 3, 2]);
        assert!((r.top[2].1 - want(2.0)).abs() < 1e-6);
        let total: f64 = (0..4)
            .map(|i| (log_probs(&logits, i, 0).0 as f64).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-6);
    }

    #[test]
    fn penalties_follow_openai_formula() {
        // Token 0 leads; each time it is chosen its logit falls by presence + frequency·count.
        let logits = [2.0f32, 1.0, 0.0];
        let mut s = Sampler::with_penalties(
            SamplerParams::greedy(),
            Penalties {
                presence: 0.5,
                frequency: 0.3,
                bias: vec![],
            },
        );
        // 0 (2.0) → 0 again: 2.0 − 0.5 − 0.3 = 1.2 > 1.0 → now 2.0 − 0.5 − 0.6 = 0.9 < 1.0: token 1.
        let seq: Vec<u32> = (0..3).map(|_| s.sample(&logits)).collect();
        assert_eq!(seq, vec![0, 0, 1]);
        // The reported logprob is of the penalized distribution.
        let r = s.choose(&logits, Some(1));
        let adj = [2.0f64 - 0.5 - 0.6, 1.0 - 0.5 - 0.3, 0.0];
        let z: f64 = adj.iter().map(|v| v.exp()).sum();
        assert_eq!(r.token, 0);
        assert!((r.logprob as f64 - (adj[0] - z.ln())).abs() < 1e-6);
    }

    #[test]
    fn logit_bias_forces_and_bans() {
        let logits = [2.0f32, 1.0, 0.0];
        let mut s = Sampler::with_penalties(
            SamplerParams::greedy(),
            Penalties {
                bias: vec![(2, 100.0), (0, -100.0)],
                ..Default::default()
            },
        );
        assert_eq!(s.sample(&logits), 2);
        let mut s = Sampler::with_penalties(
            SamplerParams {
                temperature: 1.0,
                top_k: 0,
                top_p: 1.0,
                min_p: 0.0,
                seed: 3,
            },
            Penalties {
                bias: vec![(0, -100.0)],
                ..Default::default()
            },
        );
        assert!((0..200).all(|_| s.sample(&logits) != 0));
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
