//! Mixed-precision neurons at run time (M2Cache §4.2): each token's active FFN neurons ranked by
//! score (the predictor's logit, or the activation's magnitude where the mask is exact), the top
//! share computed in f16, the next in INT8, the rest in INT4 — the shares a plan chose
//! ([`Precision`]). A cache unit keeps one region of slots per precision, each with its own slot
//! map.

use crate::engine::TierSet;
use crate::plan::precision::Precision;

/// Split a step's active neurons among the tiers of `precision`. `ids` (ascending) are the
/// neurons some of the `n` tokens needs; `score(t, i)` is `Some(score)` where token `t` needs
/// `ids[i]`. `keep` (`n × d_ff`, a predictor's flags) passes through where one tier is used.
/// Ties in score go to the lower id, so the split is deterministic.
///
/// Where only f16 is used without a predictor, no flags: the f16 kernels' own mask is the
/// deciding one. A quantized tier gets flags for `n > 1` even alone, since its kernels'
/// activations (from quantized weights) may pass the mask for a token the f16 decision left
/// out: without them a token's result would depend on what shares its step.
pub fn split_by_precision(
    precision: Precision,
    d_ff: usize,
    n: usize,
    ids: &[u32],
    keep: Option<&[bool]>,
    score: impl Fn(usize, usize) -> Option<f32>,
) -> [TierSet; 3] {
    let mut out: [TierSet; 3] = Default::default();
    let used: Vec<usize> = precision.tiers().collect();
    if used.len() == 1 && (used[0] == 0 || keep.is_some() || n == 1) {
        out[used[0]] = TierSet {
            ids: ids.to_vec(),
            keep: keep.map(<[bool]>::to_vec),
        };
        return out;
    }
    let mut flags: [Vec<bool>; 3] = Default::default();
    for &i in &used {
        flags[i] = vec![false; n * d_ff];
    }
    let mut in_tier = vec![[false; 3]; ids.len()];
    let mut ranked: Vec<(f32, usize)> = Vec::with_capacity(ids.len());
    for t in 0..n {
        ranked.clear();
        ranked.extend((0..ids.len()).filter_map(|i| score(t, i).map(|s| (s, i))));
        ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let counts = precision.counts(ranked.len());
        let mut at = 0;
        for (tier, &c) in counts.iter().enumerate() {
            for &(_, i) in &ranked[at..at + c] {
                flags[tier][t * d_ff + ids[i] as usize] = true;
                in_tier[i][tier] = true;
            }
            at += c;
        }
    }
    for &tier in &used {
        out[tier] = TierSet {
            ids: ids
                .iter()
                .zip(&in_tier)
                .filter(|(_, h)| h[tier])
                .map(|(&id, _)| id)
                .collect(),
            keep: (n > 1 || keep.is_some()).then(|| std::mem::take(&mut flags[tier])),
        };
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn one_token_goes_by_rank() {
        let ids = [1u32, 4, 6, 9];
        let scores = [0.5f32, 3.0, 0.1, 2.0];
        let s = split_by_precision(Precision([25, 25, 50]), 10, 1, &ids, None, |_, i| {
            Some(scores[i])
        });
        assert_eq!(s[0].ids, vec![4]);
        assert_eq!(s[1].ids, vec![9]);
        assert_eq!(s[2].ids, vec![1, 6]);
        assert!(s.iter().all(|t| t.keep.is_none()));
    }

    proptest! {
        /// Every (token, needed neuron) lands in exactly one tier, in the tier's ids and flags;
        /// no tier lists a neuron no token computes there; each token's tiers hold its counts.
        #[test]
        fn each_need_is_computed_once(
            n in 1usize..4,
            d_ff in 1usize..24,
            a in 0u32..=100,
            b in 0u32..=100,
            seed in any::<u64>(),
        ) {
            let b = b.min(100 - a);
            let p = Precision([a, b, 100 - a - b]);
            let mut x = seed;
            let mut next = || { x ^= x << 13; x ^= x >> 7; x ^= x << 17; x };
            let need: Vec<Option<f32>> = (0..n * d_ff)
                .map(|_| {
                    let v = next();
                    (v % 3 != 0).then(|| (v >> 8) as f32 % 97.0)
                })
                .collect();
            let ids: Vec<u32> = (0..d_ff as u32)
                .filter(|&j| (0..n).any(|t| need[t * d_ff + j as usize].is_some()))
                .collect();
            let s = split_by_precision(p, d_ff, n, &ids, None, |t, i| need[t * d_ff + ids[i] as usize]);
            for t in 0..n {
                let mine: Vec<u32> = ids.iter().copied().filter(|&j| need[t * d_ff + j as usize].is_some()).collect();
                let counts = p.counts(mine.len());
                for (tier, set) in s.iter().enumerate() {
                    let in_here: Vec<u32> = mine
                        .iter()
                        .copied()
                        .filter(|&j| match &set.keep {
                            Some(k) => k[t * d_ff + j as usize],
                            None => set.ids.contains(&j),
                        })
                        .collect();
                    prop_assert_eq!(in_here.len(), counts[tier]);
                    for j in &in_here {
                        prop_assert!(set.ids.contains(j));
                    }
                }
                for &j in &mine {
                    let tiers = s.iter().filter(|set| match &set.keep {
                        Some(k) => k[t * d_ff + j as usize],
                        None => set.ids.contains(&j),
                    }).count();
                    prop_assert_eq!(tiers, 1);
                }
            }
            for (tier, set) in s.iter().enumerate() {
                prop_assert!(set.ids.windows(2).all(|w| w[0] < w[1]));
                if p.0[tier] == 0 {
                    prop_assert!(set.ids.is_empty());
                }
                if let Some(k) = &set.keep {
                    for &j in &set.ids {
                        prop_assert!((0..n).any(|t| k[t * d_ff + j as usize]));
                    }
                }
            }
        }
    }
}
