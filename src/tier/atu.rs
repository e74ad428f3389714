//! HBM cache units (M2Cache §4): a layer's device region of `slots` FFN neuron slots, and which
//! neuron each slot holds. ATU, the adjacent-token update: for each token the active set is
//! compared with what the unit holds and only the missing neurons are loaded, into slots whose
//! neurons the token does not need (free slots first, then the stale neurons least likely to come
//! back). Adjacent tokens share most of their active neurons, so most of a token's set is already
//! there.
//!
//! Which stale neuron gives way is the [`Eviction`] policy: the ATU keeps the stale neurons that
//! fire most often over the profile ([`Eviction::Frequency`]); an LRU of the same size keeps the
//! most recently active ones ([`Eviction::Recency`]), for comparison.

use thiserror::Error;

const EMPTY: u32 = u32::MAX;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum UnitError {
    #[error("{active} active neurons for a unit of {slots} slots")]
    TooMany { active: usize, slots: usize },
    #[error("neuron {neuron} is not one of the layer's {neurons} or is listed twice")]
    BadList { neuron: u32, neurons: usize },
    #[error("a unit of {slots} slots for {neurons} neurons")]
    BadSize { slots: usize, neurons: usize },
}

/// Which stale neuron a miss replaces.
#[derive(Clone, Debug)]
pub enum Eviction {
    /// The one with the lowest score (e.g. its activation frequency over the profile).
    Frequency(Vec<f32>),
    /// The one active longest ago (an LRU cache).
    Recency,
}

/// One neuron to copy into the unit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Load {
    pub neuron: u32,
    pub slot: u32,
}

/// A cache unit's slot map.
#[derive(Clone, Debug)]
pub struct SlotMap {
    /// Per neuron, its slot or `EMPTY`.
    slot_of: Vec<u32>,
    /// Per slot, its neuron or `EMPTY`.
    neuron_in: Vec<u32>,
    /// Per slot, the update that last needed its neuron (for [`Eviction::Recency`]).
    last_used: Vec<u64>,
    eviction: Eviction,
    updates: u64,
    /// Scratch: per neuron, the update that needs it.
    needed_at: Vec<u64>,
}

impl SlotMap {
    /// An empty unit of `slots` slots for a layer of `neurons` neurons.
    pub fn new(neurons: usize, slots: usize, eviction: Eviction) -> Result<Self, UnitError> {
        let scored = match &eviction {
            Eviction::Frequency(s) => s.len() == neurons,
            Eviction::Recency => true,
        };
        if slots == 0 || slots > neurons || neurons >= EMPTY as usize || !scored {
            return Err(UnitError::BadSize { slots, neurons });
        }
        Ok(SlotMap {
            slot_of: vec![EMPTY; neurons],
            neuron_in: vec![EMPTY; slots],
            last_used: vec![0; slots],
            eviction,
            updates: 0,
            needed_at: vec![0; neurons],
        })
    }

    pub fn slots(&self) -> usize {
        self.neuron_in.len()
    }

    /// The slot holding `neuron`, if any.
    pub fn slot_of(&self, neuron: u32) -> Option<u32> {
        self.slot_of
            .get(neuron as usize)
            .copied()
            .filter(|&s| s != EMPTY)
    }

    /// The neuron in `slot`, if any.
    pub fn neuron_in(&self, slot: u32) -> Option<u32> {
        self.neuron_in
            .get(slot as usize)
            .copied()
            .filter(|&n| n != EMPTY)
    }

    /// Neurons held.
    pub fn held(&self) -> usize {
        self.neuron_in.iter().filter(|&&n| n != EMPTY).count()
    }

    /// How much neuron `n` is worth holding: its score under [`Eviction::Frequency`], else 0.
    pub fn value(&self, n: u32) -> f32 {
        match &self.eviction {
            Eviction::Frequency(score) => score.get(n as usize).copied().unwrap_or(0.0),
            Eviction::Recency => 0.0,
        }
    }

    /// The ATU for one token (or step): afterwards the unit holds every neuron of `active`
    /// (distinct ids, at most `slots` of them). Returns the neurons to load, in slot order;
    /// nothing else moves.
    pub fn update(&mut self, active: &[u32]) -> Result<Vec<Load>, UnitError> {
        if active.len() > self.slots() {
            return Err(UnitError::TooMany {
                active: active.len(),
                slots: self.slots(),
            });
        }
        Ok(self.step(active, usize::MAX)?.1)
    }

    /// One step of a unit whose misses are computed elsewhere and never waited for (an expert
    /// cache: the CPU computes a missed expert while its copy, if any, goes in behind): of
    /// `active` (distinct ids, most wanted first) the held ones are hits; at most `max_loads` of
    /// the misses, the first ones, go into free slots, then into stale ones in the policy's
    /// order, as many as there are. Returns the hits and the loads (in slot order).
    pub fn admit(
        &mut self,
        active: &[u32],
        max_loads: usize,
    ) -> Result<(usize, Vec<Load>), UnitError> {
        self.step(active, max_loads)
    }

    fn step(&mut self, active: &[u32], max_loads: usize) -> Result<(usize, Vec<Load>), UnitError> {
        let neurons = self.slot_of.len();
        self.updates += 1;
        let now = self.updates;
        let mut misses = Vec::new();
        for &n in active {
            let i = n as usize;
            if i >= neurons || self.needed_at[i] == now {
                return Err(UnitError::BadList { neuron: n, neurons });
            }
            self.needed_at[i] = now;
            match self.slot_of[i] {
                EMPTY => misses.push(n),
                s => self.last_used[s as usize] = now,
            }
        }
        let hits = active.len() - misses.len();
        misses.truncate(max_loads);
        if misses.is_empty() {
            return Ok((hits, Vec::new()));
        }
        // Free slots first, then the stale ones in the policy's order.
        let mut free: Vec<u32> = Vec::new();
        let mut stale: Vec<u32> = Vec::new();
        for (s, &n) in self.neuron_in.iter().enumerate() {
            if n == EMPTY {
                free.push(s as u32);
            } else if self.needed_at[n as usize] != now {
                stale.push(s as u32);
            }
        }
        if free.len() < misses.len() {
            match &self.eviction {
                Eviction::Frequency(score) => stale.sort_by(|&a, &b| {
                    let (na, nb) = (self.neuron_in[a as usize], self.neuron_in[b as usize]);
                    score[na as usize]
                        .total_cmp(&score[nb as usize])
                        .then(a.cmp(&b))
                }),
                Eviction::Recency => {
                    stale.sort_by_key(|&s| (self.last_used[s as usize], s));
                }
            }
            free.extend(stale);
        }
        let mut loads: Vec<Load> = misses
            .into_iter()
            .zip(free)
            .map(|(neuron, slot)| Load { neuron, slot })
            .collect();
        loads.sort_by_key(|l| l.slot);
        for l in &loads {
            let old = self.neuron_in[l.slot as usize];
            if old != EMPTY {
                self.slot_of[old as usize] = EMPTY;
            }
            self.neuron_in[l.slot as usize] = l.neuron;
            self.slot_of[l.neuron as usize] = l.slot;
            self.last_used[l.slot as usize] = now;
        }
        Ok((hits, loads))
    }

    /// Empty the slots of `loads` (an update whose copies failed): the unit must not claim
    /// neurons it never received.
    pub fn forget(&mut self, loads: &[Load]) {
        for l in loads {
            if let Some(n) = self.neuron_in.get_mut(l.slot as usize)
                && *n == l.neuron
            {
                *n = EMPTY;
                self.slot_of[l.neuron as usize] = EMPTY;
            }
        }
    }

    /// The slot of each of `active` (all held, as after [`SlotMap::update`]).
    pub fn slots_of(&self, active: &[u32]) -> Option<Vec<u32>> {
        active.iter().map(|&n| self.slot_of(n)).collect()
    }
}

/// How many copies an expert unit may start a step: `per_step` on average — a fraction is one
/// copy every few steps — with at most one step's worth (or one copy) banked, so the copies
/// never outrun the bus the plan gave them.
#[derive(Clone, Debug, PartialEq)]
pub struct CopyBudget {
    per_step: f64,
    credit: f64,
}

impl CopyBudget {
    pub fn new(per_step: f64) -> Self {
        CopyBudget {
            per_step: if per_step.is_finite() {
                per_step.max(0.0)
            } else {
                0.0
            },
            credit: 0.0,
        }
    }

    /// The copies this step may start (its share added to what is banked).
    pub fn allow(&mut self) -> usize {
        self.credit = (self.credit + self.per_step).min(self.per_step.max(1.0));
        self.credit.floor() as usize
    }

    /// The copies left this step after [`CopyBudget::allow`] and what was spent since.
    pub fn left(&self) -> usize {
        self.credit.floor() as usize
    }

    /// `n` copies started (at most what [`CopyBudget::allow`] gave).
    pub fn spend(&mut self, n: usize) {
        self.credit = (self.credit - n as f64).max(0.0);
    }
}

/// How a unit policy did over a trace of active sets.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct Reuse {
    /// Active neurons over the trace.
    pub needed: u64,
    /// Of them, already in the unit.
    pub hits: u64,
}

impl Reuse {
    pub fn loads(&self) -> u64 {
        self.needed - self.hits
    }

    pub fn hit_ratio(&self) -> f64 {
        if self.needed == 0 {
            1.0
        } else {
            self.hits as f64 / self.needed as f64
        }
    }
}

/// Replay `trace` (one active set per token) through a unit of `slots` slots under `eviction`.
/// The first token loads its whole set into the empty unit; every token counts.
pub fn replay(
    trace: &[Vec<u32>],
    neurons: usize,
    slots: usize,
    eviction: Eviction,
) -> Result<Reuse, UnitError> {
    let mut unit = SlotMap::new(neurons, slots, eviction)?;
    let mut r = Reuse::default();
    for active in trace {
        let loads = unit.update(active)?;
        r.needed += active.len() as u64;
        r.hits += (active.len() - loads.len()) as u64;
    }
    Ok(r)
}

/// How an expert cache did over a trace: hits among the routed experts, and the copies its
/// admissions made (each one expert's weights over the bus).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct Admission {
    /// Routed experts over the trace.
    pub needed: u64,
    /// Of them, on the device when routed.
    pub hits: u64,
    /// Experts copied in.
    pub copies: u64,
}

impl Admission {
    pub fn hit_ratio(&self) -> f64 {
        Reuse {
            needed: self.needed,
            hits: self.hits,
        }
        .hit_ratio()
    }
}

impl std::ops::AddAssign for Admission {
    fn add_assign(&mut self, o: Admission) {
        self.needed += o.needed;
        self.hits += o.hits;
        self.copies += o.copies;
    }
}

/// Replay `trace` (one routed set per token, most wanted first) through an expert cache of
/// `slots` slots under `eviction`, admitting at most `max_loads` misses a token
/// ([`SlotMap::admit`]). The cache starts empty.
pub fn replay_admit(
    trace: &[Vec<u32>],
    experts: usize,
    slots: usize,
    eviction: Eviction,
    max_loads: usize,
) -> Result<Admission, UnitError> {
    replay_prefetched(trace, &[], experts, slots, eviction, max_loads)
}

/// [`replay_admit`] with next-layer prefetch: before token `t` is routed, its guessed experts
/// `guesses[t]` (where given) are admitted first, from the same `max_loads` a token.
pub fn replay_prefetched(
    trace: &[Vec<u32>],
    guesses: &[Vec<u32>],
    experts: usize,
    slots: usize,
    eviction: Eviction,
    max_loads: usize,
) -> Result<Admission, UnitError> {
    let mut unit = SlotMap::new(experts, slots, eviction)?;
    let mut a = Admission::default();
    for (t, active) in trace.iter().enumerate() {
        let mut left = max_loads;
        if let Some(guess) = guesses.get(t) {
            let (_, loads) = unit.admit(guess, left)?;
            left -= loads.len();
            a.copies += loads.len() as u64;
        }
        let (hits, loads) = unit.admit(active, left)?;
        a.needed += active.len() as u64;
        a.hits += hits as u64;
        a.copies += loads.len() as u64;
    }
    Ok(a)
}

/// Replay `trace` through a static set: the `slots` experts `score` ranks highest (ties to the
/// lower id), loaded once before the trace and never changed (PowerInfer's hot set, with
/// experts for neurons).
pub fn replay_static(
    trace: &[Vec<u32>],
    score: &[f32],
    slots: usize,
) -> Result<Admission, UnitError> {
    let experts = score.len();
    if slots == 0 || slots > experts {
        return Err(UnitError::BadSize {
            slots,
            neurons: experts,
        });
    }
    let mut order: Vec<usize> = (0..experts).collect();
    order.sort_by(|&a, &b| score[b].total_cmp(&score[a]).then(a.cmp(&b)));
    let mut held = vec![false; experts];
    for &e in &order[..slots] {
        held[e] = true;
    }
    let mut a = Admission {
        copies: slots as u64,
        ..Admission::default()
    };
    for active in trace {
        for &e in active {
            let h = held.get(e as usize).ok_or(UnitError::BadList {
                neuron: e,
                neurons: experts,
            })?;
            a.needed += 1;
            a.hits += u64::from(*h);
        }
    }
    Ok(a)
}

/// Unit sizes a routing profile replays the ATU at (the rest interpolated): this many, evenly
/// spaced.
const ATU_SIZES: usize = 16;

/// How an expert cache of a layer does on held-out routing, at evenly spaced unit sizes: the
/// experts ranked by how often `calib` (the first part of a layer's routing trace: each token's
/// experts) routed to them, then `eval` (the rest) replayed through an ATU unit (stale experts
/// giving way by that ranking, at most a token's experts copied in a token) and through the
/// static set of the top-ranked: `(slots, ATU hit ratio, static hit ratio)`. What a routing
/// profile records, so the plan expects neither in-sample.
pub fn atu_curve(calib: &[Vec<u32>], eval: &[Vec<u32>], experts: usize) -> Vec<(u32, f32, f32)> {
    let used = eval.iter().map(Vec::len).max().unwrap_or(0);
    if experts == 0 || used == 0 || calib.is_empty() {
        return Vec::new();
    }
    let mut score = vec![0f32; experts];
    for &e in calib.iter().flatten() {
        if let Some(c) = score.get_mut(e as usize) {
            *c += 1.0;
        }
    }
    let mut sizes: Vec<usize> = (1..=ATU_SIZES)
        .map(|j| (j * experts).div_ceil(ATU_SIZES).max(1))
        .collect();
    sizes.dedup();
    sizes
        .into_iter()
        .filter_map(|slots| {
            let eviction = Eviction::Frequency(score.clone());
            let a = replay_admit(eval, experts, slots, eviction, used).ok()?;
            let s = replay_static(eval, &score, slots).ok()?;
            Some((slots as u32, a.hit_ratio() as f32, s.hit_ratio() as f32))
        })
        .collect()
}

#[cfg(test)]
mod curve_tests {
    use super::atu_curve;
    use crate::sparsity::routing::{SyntheticRouting, synthetic};

    #[test]
    fn a_profile_replays_the_atu_at_evenly_spaced_sizes() {
        let stats = SyntheticRouting {
            layers: 1,
            experts: 32,
            used: 4,
            tokens: 600,
            popularity: 0.5,
            locality: 0.6,
            seed: 9,
        };
        let trace = synthetic(&stats).unwrap();
        let (calib, eval) = trace[0].split_at(300);
        let curve = atu_curve(calib, eval, 32);
        assert_eq!(curve.len(), 16);
        assert_eq!((curve[0].0, curve[15].0), (2, 32));
        // Larger units hit more; a unit of every expert misses each at most once, a static set
        // of every expert never.
        assert!(
            curve.windows(2).all(|w| w[1].1 >= w[0].1 - 1e-6),
            "{curve:?}"
        );
        assert!(curve[15].1 > 0.9 && curve[15].2 == 1.0);
        // 60% of a token's experts repeat: the ATU beats the static set at a token's size.
        assert!(curve[1].1 > curve[1].2 + 0.2, "{:?}", curve[1]);
        assert!(atu_curve(&[], eval, 32).is_empty());
    }
}

#[cfg(test)]
mod copy_budget_tests {
    use super::CopyBudget;

    #[test]
    fn a_fraction_of_a_copy_a_step_is_one_copy_every_few_steps() {
        let mut b = CopyBudget::new(0.25);
        let got: Vec<usize> = (0..8)
            .map(|_| {
                let n = b.allow();
                b.spend(n);
                n
            })
            .collect();
        assert_eq!(got, [0, 0, 0, 1, 0, 0, 0, 1]);
        // Unspent credit banks up to one copy, not more.
        let mut b = CopyBudget::new(0.5);
        assert_eq!((b.allow(), b.allow(), b.allow()), (0, 1, 1));
        let mut b = CopyBudget::new(2.0);
        assert_eq!(b.allow(), 2);
        b.spend(1);
        assert_eq!(b.allow(), 2);
        assert_eq!(CopyBudget::new(f64::NAN).allow(), 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Invariants of the slot map under random traces and both policies: a neuron is in at
    /// most one slot and the maps agree; every active neuron is held after its update; loads
    /// are exactly the misses, into distinct slots, and nothing needed is evicted.
    fn check(neurons: usize, slots: usize, trace: &[Vec<u32>], eviction: Eviction) {
        let mut u = SlotMap::new(neurons, slots, eviction).unwrap();
        for active in trace {
            let before: Vec<Option<u32>> = (0..neurons as u32).map(|n| u.slot_of(n)).collect();
            let loads = u.update(active).unwrap();
            let misses = active
                .iter()
                .filter(|&&n| before[n as usize].is_none())
                .count();
            assert_eq!(loads.len(), misses);
            let mut seen = std::collections::HashSet::new();
            for l in &loads {
                assert!(seen.insert(l.slot), "slot {} loaded twice", l.slot);
                assert!(before[l.neuron as usize].is_none());
            }
            for &n in active {
                let s = u.slot_of(n).expect("held after its update");
                if let Some(was) = before[n as usize] {
                    assert_eq!(s, was, "a hit does not move");
                }
            }
            let mut held = std::collections::HashSet::new();
            for s in 0..slots as u32 {
                if let Some(n) = u.neuron_in(s) {
                    assert!(held.insert(n), "neuron {n} in two slots");
                    assert_eq!(u.slot_of(n), Some(s));
                }
            }
            assert!(u.held() <= slots);
        }
    }

    fn trace_strategy() -> impl Strategy<Value = (usize, usize, Vec<Vec<u32>>)> {
        (4usize..40).prop_flat_map(|neurons| {
            (1..=neurons).prop_flat_map(move |slots| {
                let set = proptest::collection::btree_set(0..neurons as u32, 0..=slots)
                    .prop_map(|s| s.into_iter().collect::<Vec<u32>>());
                (
                    Just(neurons),
                    Just(slots),
                    proptest::collection::vec(set, 1..20),
                )
            })
        })
    }

    proptest! {
        #[test]
        fn units_hold_each_neuron_once_and_every_active_one((neurons, slots, trace) in trace_strategy()) {
            check(neurons, slots, &trace, Eviction::Recency);
            let score = (0..neurons).map(|i| ((i * 7) % 5) as f32).collect();
            check(neurons, slots, &trace, Eviction::Frequency(score));
        }
    }

    #[test]
    fn frequency_keeps_the_likely_neurons_and_recency_the_recent_ones() {
        // Neurons 0..4, a unit of 3. Token 1 needs {0, 1, 2}; token 2 needs {3}: one stale
        // neuron gives way. Neuron 2 is the most frequent, 0 the least.
        let score = vec![0.1, 0.5, 0.9, 0.3];
        let mut atu = SlotMap::new(4, 3, Eviction::Frequency(score)).unwrap();
        atu.update(&[0, 1, 2]).unwrap();
        let loads = atu.update(&[3]).unwrap();
        assert_eq!(
            loads,
            vec![Load { neuron: 3, slot: 0 }],
            "neuron 0 gives way"
        );
        // LRU: token 1 {0, 1, 2}, token 2 {0, 1}: neuron 2 is the least recent when 3 comes.
        let mut lru = SlotMap::new(4, 3, Eviction::Recency).unwrap();
        lru.update(&[0, 1, 2]).unwrap();
        lru.update(&[0, 1]).unwrap();
        assert_eq!(lru.update(&[3]).unwrap(), vec![Load { neuron: 3, slot: 2 }]);
        assert_eq!(lru.slot_of(2), None);
    }

    #[test]
    fn bad_lists_and_sizes_are_refused() {
        let mut u = SlotMap::new(8, 2, Eviction::Recency).unwrap();
        assert_eq!(
            u.update(&[1, 2, 3]),
            Err(UnitError::TooMany {
                active: 3,
                slots: 2
            })
        );
        assert!(matches!(u.update(&[1, 1]), Err(UnitError::BadList { .. })));
        assert!(matches!(u.update(&[9]), Err(UnitError::BadList { .. })));
        assert!(SlotMap::new(8, 9, Eviction::Recency).is_err());
        assert!(SlotMap::new(8, 0, Eviction::Recency).is_err());
        assert!(SlotMap::new(8, 4, Eviction::Frequency(vec![0.0; 7])).is_err());
    }

    #[test]
    fn a_failed_update_is_forgotten() {
        let mut u = SlotMap::new(6, 3, Eviction::Recency).unwrap();
        u.update(&[0, 1]).unwrap();
        let loads = u.update(&[1, 4]).unwrap();
        assert_eq!(loads.len(), 1);
        u.forget(&loads);
        assert_eq!((u.slot_of(4), u.held()), (None, 2));
        // Next time neuron 4 is a miss again.
        assert_eq!(u.update(&[4]).unwrap().len(), 1);
    }

    #[test]
    fn replay_counts_hits_across_tokens() {
        let trace = vec![vec![0, 1, 2], vec![1, 2, 3], vec![1, 2, 3]];
        let r = replay(&trace, 6, 4, Eviction::Recency).unwrap();
        assert_eq!(r, Reuse { needed: 9, hits: 5 });
        assert!((r.hit_ratio() - 5.0 / 9.0).abs() < 1e-12);
    }

    /// `admit` against a model of the cache as a set: hits are the held ones; the first
    /// `max_loads` misses go in while free or stale slots last; nothing routed this token is
    /// evicted; the unit never exceeds its slots.
    fn check_admit(
        experts: usize,
        slots: usize,
        trace: &[Vec<u32>],
        max_loads: usize,
        ev: Eviction,
    ) {
        let mut u = SlotMap::new(experts, slots, ev).unwrap();
        for active in trace {
            let before: Vec<bool> = (0..experts as u32)
                .map(|e| u.slot_of(e).is_some())
                .collect();
            let (hits, loads) = u.admit(active, max_loads).unwrap();
            let misses: Vec<u32> = active
                .iter()
                .copied()
                .filter(|&e| !before[e as usize])
                .collect();
            assert_eq!(hits, active.len() - misses.len());
            let room = slots - active.iter().filter(|&&e| before[e as usize]).count();
            let want = misses.len().min(max_loads).min(room);
            let mut loaded: Vec<u32> = loads.iter().map(|l| l.neuron).collect();
            loaded.sort_unstable();
            let mut first: Vec<u32> = misses[..want].to_vec();
            first.sort_unstable();
            assert_eq!(loaded, first, "the first misses, as many as fit");
            for &e in active {
                if before[e as usize] {
                    assert!(u.slot_of(e).is_some(), "a routed expert is never evicted");
                }
            }
            assert!(u.held() <= slots);
        }
    }

    proptest! {
        #[test]
        fn admissions_take_the_first_misses_that_fit(
            (experts, slots, trace) in trace_strategy(),
            max_loads in 0usize..6,
        ) {
            check_admit(experts, slots, &trace, max_loads, Eviction::Recency);
            let score = (0..experts).map(|i| ((i * 3) % 7) as f32).collect();
            check_admit(experts, slots, &trace, max_loads, Eviction::Frequency(score));
        }
    }

    #[test]
    fn capped_admission_and_the_static_set_count_as_a_hand_replay_does() {
        // 6 experts, 2 slots, 1 copy a token, LRU. Token 1 routes {0, 1}: both miss, 0 goes in.
        // Token 2 {0, 2}: 0 hits, 2 takes the free slot. Token 3 {3, 0}: 0 hits; 3 replaces the
        // stale 2. Token 4 {2}: a miss; 0 and 3 were both last used at token 3, so the lower
        // slot (0's) gives way.
        let trace = vec![vec![0, 1], vec![0, 2], vec![3, 0], vec![2]];
        let a = replay_admit(&trace, 6, 2, Eviction::Recency, 1).unwrap();
        assert_eq!(
            a,
            Admission {
                needed: 7,
                hits: 2,
                copies: 4
            }
        );
        // The static pair {0, 2} by score: 0, 0, 0, 2 and 2 hit.
        let score = [5.0, 1.0, 4.0, 3.0, 0.0, 0.0];
        let s = replay_static(&trace, &score, 2).unwrap();
        assert_eq!(
            s,
            Admission {
                needed: 7,
                hits: 5,
                copies: 2
            }
        );
        assert!(replay_static(&trace, &score, 7).is_err());
        assert!(replay_static(&[vec![9]], &score, 2).is_err());
        // Uncapped admission into a cache as large as the routed set is the plain ATU.
        let r = replay(&trace, 6, 2, Eviction::Recency).unwrap();
        let u = replay_admit(&trace, 6, 2, Eviction::Recency, usize::MAX).unwrap();
        assert_eq!((u.needed, u.hits), (r.needed, r.hits));
    }
}
