//! Exact placement of hot FFN neurons on the GPU (PowerInfer §6, solved without an ILP solver).
//!
//! Problem. Each layer's neurons are sorted by impact (activation frequency), highest first, and
//! cut into groups of [`GROUP_NEURONS`]; the last group of a layer may be smaller. A group is
//! placed whole. Choose the resident groups to maximise the total impact, with the groups' bytes
//! (`bytes_per_neuron` × neurons) within the budget, and every layer either off the GPU or
//! holding at least `min_neurons` there (less would not pay for the layer's CPU↔GPU sync).
//!
//! Structure. A layer has `F` full groups and maybe one partial group (`r < 64` neurons). Full
//! groups all cost the same, so among choices with `j` full groups the best is the first `j`
//! (highest impact): its value `P(j)` is a prefix sum of non-increasing group impacts, so it is
//! concave in `j`. The partial group is the lowest-impact group but also the cheapest, so it can
//! be worth taking without all the full groups: a layer's choices are `(j, p)`, `j` full groups
//! plus the partial group when `p = 1`, of cost `j·a + p·b` and value `P(j) + p·v`, with
//! `j ≥ m_p` for the layer's minimum (or the layer off). These choices dominate every other set
//! of groups, so the optimum over them is the optimum over all sets of groups.
//!
//! Algorithm. Every placement's byte total is a multiple of `g`, the gcd of all group byte sizes
//! of the layers that can be on, so `bytes ≤ M` ⇔ `units ≤ ⌊M / g⌋`: a capacity axis in units of
//! `g` loses nothing. A knapsack DP over layers keeps `best[c]`, the most impact within `c`
//! units; a layer's update is `max(best[c], max_j best[c − shift − j·a] + P(j) (+ v))` for each
//! `p`. That is a (max,+) convolution of an arbitrary sequence with a concave one (per residue
//! class of `c` modulo `a`); concavity makes its matrix Monge, so the largest argmax is monotone
//! in `c` and divide and conquer finds every row's maximum in `O(n log n)` (the window `0 ≤ j ≤ F`
//! keeps that property: a concave function stays concave extended by −∞). The table of choices
//! per layer and capacity gives back each layer's `(j, p)`. Time `O(L · C log C)`, memory
//! `L · C` choices for `C = ⌊min(M, all bytes) / g⌋ + 1`; when that table would exceed
//! [`MAX_TABLE_CELLS`] (a pathological gcd, e.g. coprime bytes per neuron) the solver returns
//! [`PlacementError::TooFine`] rather than round anything.

use rayon::prelude::*;
use thiserror::Error;

/// Neurons per group (PowerInfer's placement granule).
pub const GROUP_NEURONS: usize = 64;

/// Most (layer, capacity) cells the DP's choice table may have (4 bytes each).
pub const MAX_TABLE_CELLS: u64 = 1 << 25;

/// One layer's FFN neurons as the placement sees them.
#[derive(Clone, Debug, PartialEq)]
pub struct PlacementLayer {
    /// Per neuron: its impact (activation frequency from profiling), finite and ≥ 0.
    pub impacts: Vec<f64>,
    /// Device bytes one resident neuron takes (its rows of every FFN matrix).
    pub bytes_per_neuron: u64,
    /// Fewest neurons worth putting on the GPU (see [`min_gpu_neurons`]); more than the layer
    /// has keeps the layer on the CPU.
    pub min_neurons: usize,
}

/// The chosen GPU-resident neurons.
#[derive(Clone, Debug, PartialEq)]
pub struct Placement {
    /// Per layer: indices of the GPU-resident neurons, ascending.
    pub neurons: Vec<Vec<u32>>,
    /// Total impact of the resident neurons.
    pub impact: f64,
    /// Device bytes of the resident neurons.
    pub bytes: u64,
}

#[derive(Debug, Error, PartialEq)]
pub enum PlacementError {
    #[error("layer {layer}, neuron {neuron}: impact {value} is not a finite number ≥ 0")]
    BadImpact {
        layer: usize,
        neuron: usize,
        value: f64,
    },
    #[error(
        "layer {layer} has {neurons} neurons; at most {} can be indexed",
        u32::MAX
    )]
    TooManyNeurons { layer: usize, neurons: usize },
    #[error("layer {layer}: {neurons} neurons of {bytes_per_neuron} bytes overflow 64 bits")]
    BytesOverflow {
        layer: usize,
        neurons: usize,
        bytes_per_neuron: u64,
    },
    #[error(
        "exact placement needs {layers} layers × {units} capacity units of {granule} bytes, more \
         than {limit} cells: the group sizes have too fine a common divisor for this budget"
    )]
    TooFine {
        layers: usize,
        units: u64,
        granule: u64,
        limit: u64,
    },
}

/// `C_l`: the fewest neurons of a layer whose GPU time saving pays for one CPU↔GPU sync of the
/// layer, `⌈sync / (cpu − gpu)⌉`. When no count within the layer pays (the GPU is not faster,
/// or the sync costs more than moving the whole layer saves, or an input is NaN), returns
/// `layer_neurons + 1`: as a [`PlacementLayer::min_neurons`] that keeps the layer on the CPU.
pub fn min_gpu_neurons(
    cpu_secs_per_neuron: f64,
    gpu_secs_per_neuron: f64,
    sync_secs: f64,
    layer_neurons: usize,
) -> usize {
    let never = layer_neurons.saturating_add(1);
    let saving = cpu_secs_per_neuron - gpu_secs_per_neuron;
    if sync_secs.is_nan() || saving.is_nan() {
        return never;
    }
    if sync_secs <= 0.0 {
        return 0;
    }
    if saving <= 0.0 {
        return never;
    }
    let needed = (sync_secs / saving).ceil();
    if needed > layer_neurons as f64 {
        never
    } else {
        needed as usize
    }
}

/// Marks a layer off in the choice table; other entries are `(j << 1 | p) + 1`.
const OFF: u32 = 0;

fn encode(full_groups: usize, partial: bool) -> u32 {
    // `full_groups < 2^26` (neuron indices fit u32), so this fits.
    ((full_groups as u32) << 1 | partial as u32) + 1
}

fn decode(choice: u32) -> Option<(usize, bool)> {
    (choice != OFF).then(|| (((choice - 1) >> 1) as usize, (choice - 1) & 1 == 1))
}

/// A layer's groups, in the terms the DP needs.
struct LayerGroups {
    /// Neuron indices, highest impact first (ties by index, so grouping is deterministic).
    order: Vec<u32>,
    /// `prefix[j]`: impact of the first `j` full groups, `j = 0..=F`.
    prefix: Vec<f64>,
    /// Neurons in the partial last group (0 if none) and its impact.
    partial_neurons: usize,
    partial_impact: f64,
    /// Fewest full groups allowed without / with the partial group (`None`: no such choice).
    min_full_alone: Option<usize>,
    min_full_with_partial: Option<usize>,
}

impl LayerGroups {
    fn new(index: usize, layer: &PlacementLayer) -> Result<Self, PlacementError> {
        let n = layer.impacts.len();
        if u32::try_from(n).is_err() {
            return Err(PlacementError::TooManyNeurons {
                layer: index,
                neurons: n,
            });
        }
        if let Some((neuron, &value)) = layer
            .impacts
            .iter()
            .enumerate()
            .find(|&(_, v)| !(v.is_finite() && *v >= 0.0))
        {
            return Err(PlacementError::BadImpact {
                layer: index,
                neuron,
                value,
            });
        }
        if layer.bytes_per_neuron.checked_mul(n as u64).is_none() {
            return Err(PlacementError::BytesOverflow {
                layer: index,
                neurons: n,
                bytes_per_neuron: layer.bytes_per_neuron,
            });
        }
        // Finite impacts ≥ 0 order like their bits (`+ 0.0` turns −0 into +0), so one integer
        // sort of (complemented bits, index) ranks highest impact first, ties by index: several
        // times faster than comparing floats.
        let mut keys: Vec<u128> = layer
            .impacts
            .iter()
            .enumerate()
            .map(|(i, &v)| (u128::from(!(v + 0.0).to_bits()) << 32) | i as u128)
            .collect();
        keys.sort_unstable();
        let order: Vec<u32> = keys.iter().map(|&k| k as u32).collect();
        let impact_of = |i: &u32| layer.impacts[*i as usize];
        let full = n / GROUP_NEURONS;
        let mut prefix = Vec::with_capacity(full + 1);
        prefix.push(0.0);
        for group in order[..full * GROUP_NEURONS].chunks_exact(GROUP_NEURONS) {
            let sum: f64 = group.iter().map(impact_of).sum();
            prefix.push(prefix[prefix.len() - 1] + sum);
        }
        let partial = &order[full * GROUP_NEURONS..];
        let min = layer.min_neurons;
        let min_full_alone = Some(min.div_ceil(GROUP_NEURONS).max(1)).filter(|&j| j <= full);
        let min_full_with_partial = (!partial.is_empty())
            .then(|| min.saturating_sub(partial.len()).div_ceil(GROUP_NEURONS))
            .filter(|&j| j <= full);
        Ok(LayerGroups {
            partial_neurons: partial.len(),
            partial_impact: partial.iter().map(impact_of).sum(),
            order,
            prefix,
            min_full_alone,
            min_full_with_partial,
        })
    }

    fn full_groups(&self) -> usize {
        self.prefix.len() - 1
    }

    fn can_be_on(&self) -> bool {
        self.min_full_alone.is_some() || self.min_full_with_partial.is_some()
    }

    /// The resident neurons of choice `(j, p)`, ascending.
    fn neurons(&self, full_groups: usize, partial: bool) -> Vec<u32> {
        let mut v = self.order[..full_groups * GROUP_NEURONS].to_vec();
        if partial {
            v.extend_from_slice(&self.order[self.full_groups() * GROUP_NEURONS..]);
        }
        v.sort_unstable();
        v
    }
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// Choose the GPU-resident neurons of every layer: the most total impact within `budget_bytes`,
/// each layer off or at its minimum at least. Exact (see the module doc).
pub fn place_hot_neurons(
    layers: &[PlacementLayer],
    budget_bytes: u64,
) -> Result<Placement, PlacementError> {
    // Ranking the neurons (one sort per layer) is most of the time; layers are independent.
    let groups = layers
        .par_iter()
        .enumerate()
        .map(|(i, l)| LayerGroups::new(i, l))
        .collect::<Result<Vec<_>, _>>()?;
    let mut chosen: Vec<Option<(usize, bool)>> = vec![None; layers.len()];

    // Layers that cost nothing hold everything (impacts are ≥ 0); the others go to the DP.
    let mut priced = Vec::new();
    for (l, (layer, g)) in layers.iter().zip(&groups).enumerate() {
        if !g.can_be_on() {
            continue;
        }
        if layer.bytes_per_neuron == 0 {
            chosen[l] = Some((g.full_groups(), g.partial_neurons > 0));
        } else {
            priced.push(l);
        }
    }

    if !priced.is_empty() {
        let mut granule = 0;
        let mut all_bytes = 0u64;
        for &l in &priced {
            let bpn = layers[l].bytes_per_neuron;
            if groups[l].full_groups() > 0 {
                granule = gcd(granule, bpn * GROUP_NEURONS as u64);
            }
            if groups[l].partial_neurons > 0 {
                granule = gcd(granule, bpn * groups[l].partial_neurons as u64);
            }
            // Checked in `LayerGroups::new`; the sum only caps the axis, so saturating is exact.
            all_bytes = all_bytes.saturating_add(bpn * layers[l].impacts.len() as u64);
        }
        let units = budget_bytes.min(all_bytes) / granule;
        let cells = (priced.len() as u64).saturating_mul(units + 1);
        if cells > MAX_TABLE_CELLS {
            return Err(PlacementError::TooFine {
                layers: priced.len(),
                units: units + 1,
                granule,
                limit: MAX_TABLE_CELLS,
            });
        }
        let capacity = units as usize;
        let unit_of = |l: usize, neurons: usize| -> usize {
            (layers[l].bytes_per_neuron * neurons as u64 / granule) as usize
        };

        let mut best = vec![0.0f64; capacity + 1];
        let mut tables: Vec<Vec<u32>> = Vec::with_capacity(priced.len());
        for &l in &priced {
            let g = &groups[l];
            let full_units = unit_of(l, GROUP_NEURONS);
            let mut next = best.clone();
            let mut choice = vec![OFF; capacity + 1];
            if let Some(m) = g.min_full_alone {
                add_concave_option(
                    &best,
                    full_units,
                    m * full_units,
                    &g.prefix[m..],
                    0.0,
                    |t| encode(m + t, false),
                    &mut next,
                    &mut choice,
                );
            }
            if let Some(m) = g.min_full_with_partial {
                add_concave_option(
                    &best,
                    full_units,
                    m * full_units + unit_of(l, g.partial_neurons),
                    &g.prefix[m..],
                    g.partial_impact,
                    |t| encode(m + t, true),
                    &mut next,
                    &mut choice,
                );
            }
            best = next;
            tables.push(choice);
        }

        // Walk back from the full capacity: each layer's choice says what it used.
        let mut c = capacity;
        for (&l, table) in priced.iter().zip(&tables).rev() {
            if let Some((j, p)) = decode(table[c]) {
                let neurons = j * GROUP_NEURONS + if p { groups[l].partial_neurons } else { 0 };
                c -= unit_of(l, neurons);
                chosen[l] = Some((j, p));
            }
        }
    }

    let mut placement = Placement {
        neurons: vec![Vec::new(); layers.len()],
        impact: 0.0,
        bytes: 0,
    };
    for (l, choice) in chosen.into_iter().enumerate() {
        if let Some((j, p)) = choice {
            let neurons = groups[l].neurons(j, p);
            placement.impact += neurons
                .iter()
                .map(|&i| layers[l].impacts[i as usize])
                .sum::<f64>();
            placement.bytes += layers[l].bytes_per_neuron * neurons.len() as u64;
            placement.neurons[l] = neurons;
        }
    }
    Ok(placement)
}

/// For every capacity `c`, raise `out[c]` to
/// `max_t prev[c − offset − t·step] + values[t] + extra` (over `t` with a valid index) and
/// record `choice_of(t)` where that wins. `values` must be concave.
///
/// Per residue class of `c − offset` modulo `step`, row `j` (capacity `offset + r + j·step`)
/// takes source `i = j − t` (capacity `r + i·step`). The largest maximising `i` never decreases
/// with `j` (Monge), so the middle row's argmax splits the rest: `O(n log n)` per class.
#[allow(clippy::too_many_arguments)]
fn add_concave_option(
    prev: &[f64],
    step: usize,
    offset: usize,
    values: &[f64],
    extra: f64,
    choice_of: impl Fn(usize) -> u32,
    out: &mut [f64],
    choice: &mut [u32],
) {
    let capacity = prev.len() - 1;
    if offset > capacity {
        return;
    }
    let last_t = values.len() - 1;
    // With one value the step is irrelevant (a layer without full groups has no full size).
    let step = if last_t == 0 { 1 } else { step };
    let mut stack = Vec::new();
    for r in 0..step.min(capacity - offset + 1) {
        let rows = (capacity - offset - r) / step + 1;
        stack.push((0, rows, 0, rows - 1));
        while let Some((lo, hi, opt_lo, opt_hi)) = stack.pop() {
            if lo >= hi {
                continue;
            }
            let mid = (lo + hi) / 2;
            // Non-empty: opt_lo ≤ mid, and opt_hi ≥ mid − last_t (both are argmaxes of rows
            // around `mid`, each within its own window).
            let from = opt_lo.max(mid.saturating_sub(last_t));
            let to = opt_hi.min(mid);
            let (mut arg, mut value) = (from, f64::NEG_INFINITY);
            for i in from..=to {
                let v = prev[r + i * step] + values[mid - i];
                if v >= value {
                    (arg, value) = (i, v);
                }
            }
            let c = offset + r + mid * step;
            if value + extra > out[c] {
                out[c] = value + extra;
                choice[c] = choice_of(mid - arg);
            }
            stack.push((lo, mid, opt_lo, arg));
            stack.push((mid + 1, hi, arg, opt_hi));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use good_lp::{Expression, Solution, SolverModel, constraint, microlp, variable, variables};
    use rand::rngs::StdRng;
    use rand::{RngExt, SeedableRng};
    use std::time::Instant;

    /// The groups of a layer, derived independently: ranks by impact (ties by index), chunks.
    fn groups_of(layer: &PlacementLayer) -> Vec<Vec<u32>> {
        let mut order: Vec<u32> = (0..layer.impacts.len() as u32).collect();
        order.sort_by(|&a, &b| {
            layer.impacts[b as usize]
                .partial_cmp(&layer.impacts[a as usize])
                .expect("finite impacts")
                .then(a.cmp(&b))
        });
        order.chunks(GROUP_NEURONS).map(<[u32]>::to_vec).collect()
    }

    /// Panics unless `p` is a feasible placement of `layers` within `budget`, consistent with
    /// its stated bytes and impact.
    fn assert_feasible(layers: &[PlacementLayer], budget: u64, p: &Placement) {
        assert_eq!(p.neurons.len(), layers.len());
        let (mut bytes, mut impact) = (0u64, 0.0f64);
        for (l, (layer, resident)) in layers.iter().zip(&p.neurons).enumerate() {
            assert!(
                resident.windows(2).all(|w| w[0] < w[1]),
                "layer {l} unsorted"
            );
            assert!(
                resident.is_empty() || resident.len() >= layer.min_neurons,
                "layer {l}: {} neurons, minimum {}",
                resident.len(),
                layer.min_neurons
            );
            // Whole groups only.
            for g in groups_of(layer) {
                let inside = g
                    .iter()
                    .filter(|i| resident.binary_search(i).is_ok())
                    .count();
                assert!(inside == 0 || inside == g.len(), "layer {l} splits a group");
            }
            bytes += layer.bytes_per_neuron * resident.len() as u64;
            impact += resident
                .iter()
                .map(|&i| layer.impacts[i as usize])
                .sum::<f64>();
        }
        assert!(bytes <= budget, "{bytes} bytes over budget {budget}");
        assert_eq!(bytes, p.bytes);
        assert!((impact - p.impact).abs() <= 1e-9 * impact.max(1.0));
    }

    /// The PowerInfer MILP over the same groups, solved by microlp; its optimal impact.
    fn milp_optimum(layers: &[PlacementLayer], budget: u64) -> f64 {
        let mut vars = variables!();
        let mut objective = Expression::from(0.0);
        let mut bytes = Expression::from(0.0);
        let mut constraints = Vec::new();
        let mut picks = Vec::new();
        for layer in layers {
            let on = vars.add(variable().binary());
            let mut count = Expression::from(0.0);
            for g in groups_of(layer) {
                let x = vars.add(variable().binary());
                let impact: f64 = g.iter().map(|&i| layer.impacts[i as usize]).sum();
                objective += impact * x;
                bytes += (layer.bytes_per_neuron * g.len() as u64) as f64 * x;
                count += g.len() as f64 * x;
                constraints.push(constraint!(x <= on));
                picks.push((x, impact));
            }
            constraints.push(constraint!(count >= layer.min_neurons as f64 * on));
        }
        constraints.push(constraint!(bytes <= budget as f64));
        let mut model = vars.maximise(objective).using(microlp);
        for c in constraints {
            model = model.with(c);
        }
        let solution = model.solve().expect("the MILP is feasible (all off)");
        // Sum the rounded picks, so solver tolerances do not blur the comparison.
        picks
            .iter()
            .filter(|(x, _)| solution.value(*x) > 0.5)
            .map(|(_, v)| v)
            .sum()
    }

    fn random_instance(rng: &mut StdRng) -> (Vec<PlacementLayer>, u64) {
        let n_layers = rng.random_range(1..=6);
        // Half the instances use small integer impacts, so ties are common.
        let ties = rng.random_bool(0.5);
        let layers: Vec<PlacementLayer> = (0..n_layers)
            .map(|_| {
                let n = rng.random_range(0..=10 * GROUP_NEURONS);
                PlacementLayer {
                    impacts: (0..n)
                        .map(|_| {
                            if ties {
                                rng.random_range(0..4) as f64
                            } else {
                                rng.random::<f64>()
                            }
                        })
                        .collect(),
                    bytes_per_neuron: rng.random_range(1..=6),
                    min_neurons: rng.random_range(0..=n + 20),
                }
            })
            .collect();
        let all: u64 = layers
            .iter()
            .map(|l| l.bytes_per_neuron * l.impacts.len() as u64)
            .sum();
        let budget = rng.random_range(0..=all + all / 10);
        (layers, budget)
    }

    #[test]
    fn matches_the_milp_optimum_on_random_instances() {
        let mut rng = StdRng::seed_from_u64(0x9e3779b97f4a7c15);
        for case in 0..200 {
            let (layers, budget) = random_instance(&mut rng);
            let p = place_hot_neurons(&layers, budget).expect("valid instance");
            assert_feasible(&layers, budget, &p);
            let optimum = milp_optimum(&layers, budget);
            assert!(
                (p.impact - optimum).abs() <= 1e-9 * optimum.max(1.0),
                "case {case}: placement {} vs MILP {optimum}",
                p.impact
            );
        }
    }

    #[test]
    fn concave_option_matches_brute_force() {
        let mut rng = StdRng::seed_from_u64(7);
        for _ in 0..300 {
            let capacity = rng.random_range(0..60);
            let prev: Vec<f64> = (0..=capacity).map(|_| rng.random::<f64>() * 10.0).collect();
            let step = rng.random_range(1..5);
            let offset = rng.random_range(0..8);
            let mut gains: Vec<f64> = (0..rng.random_range(0..8))
                .map(|_| rng.random::<f64>())
                .collect();
            gains.sort_by(|a, b| b.total_cmp(a));
            let mut values = vec![rng.random::<f64>()];
            for g in gains {
                values.push(values[values.len() - 1] + g);
            }
            let mut out = prev.clone();
            let mut choice = vec![OFF; capacity + 1];
            add_concave_option(
                &prev,
                step,
                offset,
                &values,
                0.5,
                |t| t as u32 + 1,
                &mut out,
                &mut choice,
            );
            for c in 0..=capacity {
                let mut want = prev[c];
                for (t, v) in values.iter().enumerate() {
                    if let Some(src) = c.checked_sub(offset + t * step) {
                        want = want.max(prev[src] + v + 0.5);
                    }
                }
                assert!((out[c] - want).abs() < 1e-12, "c {c}: {} vs {want}", out[c]);
                if choice[c] != OFF {
                    let t = choice[c] as usize - 1;
                    let got = prev[c - offset - t * step] + values[t] + 0.5;
                    assert!((got - out[c]).abs() < 1e-12);
                }
            }
        }
    }

    fn layer(n: usize, bytes_per_neuron: u64, min_neurons: usize) -> PlacementLayer {
        PlacementLayer {
            impacts: (0..n).map(|i| 1.0 / (i + 1) as f64).collect(),
            bytes_per_neuron,
            min_neurons,
        }
    }

    #[test]
    fn zero_budget_places_only_free_layers() {
        let layers = [layer(200, 2, 0), layer(70, 0, 10)];
        let p = place_hot_neurons(&layers, 0).unwrap();
        assert!(p.neurons[0].is_empty());
        assert_eq!(p.neurons[1], (0..70).collect::<Vec<u32>>());
        assert_eq!(p.bytes, 0);
    }

    #[test]
    fn ample_budget_places_every_allowed_neuron() {
        let layers = [layer(200, 2, 0), layer(130, 3, 130), layer(50, 1, 51)];
        let p = place_hot_neurons(&layers, u64::MAX).unwrap();
        assert_eq!(p.neurons[0].len(), 200);
        assert_eq!(p.neurons[1].len(), 130);
        assert!(p.neurons[2].is_empty(), "minimum above the layer's size");
        assert_eq!(p.bytes, 200 * 2 + 130 * 3);
    }

    #[test]
    fn empty_inputs_place_nothing() {
        assert_eq!(
            place_hot_neurons(&[], 100).unwrap(),
            Placement {
                neurons: vec![],
                impact: 0.0,
                bytes: 0
            }
        );
        let p = place_hot_neurons(&[layer(0, 4, 0), layer(0, 4, 3)], 100).unwrap();
        assert_eq!(p.neurons, vec![Vec::<u32>::new(); 2]);
    }

    #[test]
    fn the_cheap_partial_group_can_go_alone() {
        // 65 neurons: a full group of 64 and a partial one of 1; room for one neuron only.
        let layers = [PlacementLayer {
            impacts: vec![1.0; 65],
            bytes_per_neuron: 10,
            min_neurons: 1,
        }];
        let p = place_hot_neurons(&layers, 10).unwrap();
        assert_eq!(p.neurons[0], vec![64]);
        assert_eq!(p.impact, 1.0);
    }

    #[test]
    fn bad_impacts_are_errors() {
        for bad in [f64::NAN, -1.0, f64::INFINITY] {
            let mut l = layer(10, 1, 0);
            l.impacts[3] = bad;
            let err = place_hot_neurons(&[layer(5, 1, 0), l], 100).unwrap_err();
            assert!(matches!(
                err,
                PlacementError::BadImpact {
                    layer: 1,
                    neuron: 3,
                    ..
                }
            ));
        }
    }

    #[test]
    fn too_fine_a_granule_is_an_error() {
        // Coprime bytes per neuron: groups share only the factor 64, a 64-byte granule over a
        // multi-GiB budget.
        let layers: Vec<PlacementLayer> = (0..4).map(|i| layer(1 << 20, 1009 + 2 * i, 0)).collect();
        let err = place_hot_neurons(&layers, 4 << 30).unwrap_err();
        assert!(matches!(err, PlacementError::TooFine { granule: 64, .. }));
    }

    #[test]
    fn min_gpu_neurons_pays_for_the_sync() {
        // Saving 1 µs per neuron, a 100 µs sync: 100 neurons.
        assert_eq!(min_gpu_neurons(3e-6, 2e-6, 100e-6, 1000), 100);
        assert_eq!(min_gpu_neurons(3e-6, 2e-6, 0.0, 1000), 0);
        // Never pays: the GPU is not faster, or the whole layer saves less than the sync.
        assert_eq!(min_gpu_neurons(2e-6, 2e-6, 1e-6, 1000), 1001);
        assert_eq!(min_gpu_neurons(3e-6, 2e-6, 1.0, 1000), 1001);
        assert_eq!(min_gpu_neurons(f64::NAN, 2e-6, 1.0, 1000), 1001);
    }

    /// Llama-2-70B's FFN: 80 layers × 28672 neurons, f16 gate/up/down rows of 8192.
    fn seventy_b() -> Vec<PlacementLayer> {
        let mut rng = StdRng::seed_from_u64(70);
        (0..80)
            .map(|_| {
                // Power-law impacts (Zipf over a random permutation of the neurons).
                let exponent = rng.random_range(0.8..1.4);
                PlacementLayer {
                    impacts: (0..28672)
                        .map(|_| (rng.random_range(1..=28672) as f64).powf(-exponent))
                        .collect(),
                    bytes_per_neuron: 3 * 8192 * 2,
                    min_neurons: min_gpu_neurons(4e-7, 2e-8, rng.random_range(2e-5..2e-4), 28672),
                }
            })
            .collect()
    }

    #[test]
    fn seventy_b_instance_is_feasible() {
        let layers = seventy_b();
        let budget = 20 << 30;
        let start = Instant::now();
        let p = place_hot_neurons(&layers, budget).unwrap();
        eprintln!(
            "70B placement: {:.1} ms, {} of {budget} bytes, impact {:.3}",
            start.elapsed().as_secs_f64() * 1e3,
            p.bytes,
            p.impact
        );
        assert_feasible(&layers, budget, &p);
        // Every impact is > 0 and no layer fits whole, so at the optimum a layer on the GPU could
        // not take one more group: less than a group's bytes are left.
        assert!(budget - p.bytes < 3 * 8192 * 2 * GROUP_NEURONS as u64);
    }
}
