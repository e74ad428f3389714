//! The trace every strategy replays: its shape ([`TraceConfig`]), where its tokens come from
//! ([`TokenSource`]), each context's deterministic token `Stream`, and the calls (Poisson
//! arrivals, a sticky or random choice of context, user turns and fixed answers). Pure data:
//! runs no engine.

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use serde::Serialize;

/// The shape of a trace.
#[derive(Clone, Debug, Serialize)]
pub struct TraceConfig {
    pub contexts: usize,
    pub calls: usize,
    /// Tokens of each context's conversation before the trace starts.
    pub history_tokens: usize,
    /// Inclusive ranges, drawn uniformly.
    pub user_tokens: (usize, usize),
    pub answer_tokens: (usize, usize),
    /// Mean call arrivals per second (Poisson).
    pub rate_per_s: f64,
    /// Probability that a call goes to the context of the call before (else one drawn
    /// uniformly from all contexts): 0 switches at random, near 1 is a sticky Markov chain.
    pub sticky: f64,
    pub seed: u64,
}

impl TraceConfig {
    /// Refuse what cannot make a trace, naming the setting.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let range_ok = |(lo, hi): (usize, usize)| lo >= 1 && lo <= hi;
        if self.contexts == 0 || self.calls == 0 || self.history_tokens == 0 {
            return Err("contexts, calls and history tokens must each be at least 1".into());
        }
        if !range_ok(self.user_tokens) || !range_ok(self.answer_tokens) {
            return Err("turn lengths must be ranges MIN-MAX with 1 <= MIN <= MAX".into());
        }
        if !(self.rate_per_s.is_finite() && self.rate_per_s > 0.0) {
            return Err(format!(
                "the call rate must be a positive number of calls per second, not {}",
                self.rate_per_s
            ));
        }
        if !(0.0..=1.0).contains(&self.sticky) {
            return Err(format!(
                "the sticky probability must be within 0..=1, not {}",
                self.sticky
            ));
        }
        Ok(())
    }
}

/// Where a trace's tokens come from.
pub enum TokenSource {
    /// A tokenized corpus: each context reads it from its own seeded offset (wrapping).
    Corpus(Vec<u32>),
    /// Seeded random ids below `vocab`.
    Random { vocab: usize },
}

/// One context's token stream: deterministic in (seed, context), not in how many contexts the
/// trace has, so sweep points share their histories (and the histories' prefill).
struct Stream<'a> {
    src: &'a TokenSource,
    at: usize,
    rng: StdRng,
}

impl<'a> Stream<'a> {
    fn new(src: &'a TokenSource, seed: u64, context: usize) -> Self {
        let mut rng =
            StdRng::seed_from_u64(seed ^ (context as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let at = match src {
            TokenSource::Corpus(t) if !t.is_empty() => rng.random_range(0..t.len()),
            _ => 0,
        };
        Stream { src, at, rng }
    }

    fn take(&mut self, n: usize) -> Vec<u32> {
        match self.src {
            TokenSource::Corpus(t) if !t.is_empty() => (0..n)
                .map(|_| {
                    let v = t[self.at % t.len()];
                    self.at += 1;
                    v
                })
                .collect(),
            TokenSource::Corpus(_) => vec![0; n],
            TokenSource::Random { vocab } => {
                // Ids 0..3 are often BOS/EOS/unknown: keep clear of them when the vocabulary allows.
                let lo = if *vocab > 4 { 3 } else { 0 };
                let hi = (*vocab).max(1) as u32;
                (0..n).map(|_| self.rng.random_range(lo..hi)).collect()
            }
        }
    }
}

/// One call: when it arrives, which context, what the user says and what the answer is (the
/// answer is fixed by the trace so every strategy evaluates the same tokens).
#[derive(Clone, Debug)]
pub struct Call {
    pub arrival_s: f64,
    pub context: usize,
    pub user: Vec<u32>,
    pub answer: Vec<u32>,
}

#[derive(Clone, Debug)]
pub struct Trace {
    pub cfg: TraceConfig,
    pub histories: Vec<Vec<u32>>,
    pub calls: Vec<Call>,
}

impl Trace {
    pub fn generate(cfg: &TraceConfig, src: &TokenSource) -> Trace {
        let mut streams: Vec<Stream> = (0..cfg.contexts)
            .map(|i| Stream::new(src, cfg.seed, i))
            .collect();
        let histories = streams
            .iter_mut()
            .map(|s| s.take(cfg.history_tokens))
            .collect();
        let mut rng = StdRng::seed_from_u64(cfg.seed.wrapping_add(cfg.contexts as u64 * 7919));
        let mut t = 0.0;
        let mut prev: Option<usize> = None;
        let mut calls = Vec::with_capacity(cfg.calls);
        for _ in 0..cfg.calls {
            let u: f64 = rng.random();
            t += -(1.0 - u).ln() / cfg.rate_per_s;
            let context = match prev {
                Some(p) if rng.random::<f64>() < cfg.sticky => p,
                _ => rng.random_range(0..cfg.contexts),
            };
            prev = Some(context);
            let nu = rng.random_range(cfg.user_tokens.0..=cfg.user_tokens.1);
            let na = rng.random_range(cfg.answer_tokens.0..=cfg.answer_tokens.1);
            let user = streams[context].take(nu);
            let answer = streams[context].take(na);
            calls.push(Call {
                arrival_s: t,
                context,
                user,
                answer,
            });
        }
        Trace {
            cfg: cfg.clone(),
            histories,
            calls,
        }
    }

    /// The longest any context grows to (the session size every slot needs).
    pub fn max_context_tokens(&self) -> usize {
        let mut len: Vec<usize> = self.histories.iter().map(Vec::len).collect();
        for c in &self.calls {
            len[c.context] += c.user.len() + c.answer.len();
        }
        len.into_iter().max().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(contexts: usize) -> TraceConfig {
        TraceConfig {
            contexts,
            calls: 40,
            history_tokens: 50,
            user_tokens: (5, 9),
            answer_tokens: (2, 3),
            rate_per_s: 2.0,
            sticky: 0.0,
            seed: 7,
        }
    }

    #[test]
    fn traces_are_deterministic_and_histories_do_not_depend_on_the_count() {
        let src = TokenSource::Random { vocab: 100 };
        let a = Trace::generate(&cfg(4), &src);
        let b = Trace::generate(&cfg(4), &src);
        let c = Trace::generate(&cfg(9), &src);
        assert_eq!(a.histories, b.histories);
        assert_eq!(
            a.calls
                .iter()
                .map(|x| (x.context, x.user.clone()))
                .collect::<Vec<_>>(),
            b.calls
                .iter()
                .map(|x| (x.context, x.user.clone()))
                .collect::<Vec<_>>()
        );
        assert_eq!(a.histories[..], c.histories[..4]);
        let mut last = 0.0;
        for call in &a.calls {
            assert!(call.arrival_s > last && call.context < 4);
            assert!((5..=9).contains(&call.user.len()) && (2..=3).contains(&call.answer.len()));
            assert!(call.user.iter().all(|&t| (3..100).contains(&t)));
            last = call.arrival_s;
        }
    }

    #[test]
    fn a_sticky_chain_stays_and_a_random_one_switches() {
        let src = TokenSource::Random { vocab: 100 };
        let stays = |sticky: f64| {
            let t = Trace::generate(&TraceConfig { sticky, ..cfg(8) }, &src);
            t.calls
                .windows(2)
                .filter(|w| w[0].context == w[1].context)
                .count()
        };
        assert_eq!(stays(1.0), 39);
        assert!(stays(0.0) < 15, "{}", stays(0.0));
    }
}
