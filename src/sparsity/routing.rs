//! Routing traces of mixture-of-experts models: per layer, the experts each token is routed to
//! (most weight first), as the engine routes them ([`RouteTrace`]), or drawn with stated
//! statistics where weights cannot plant them ([`synthetic`]). What expert caches are judged on
//! (`bench experts`).

use std::sync::Mutex;

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

pub use super::trace::adjacent_overlap;
use crate::backend::Route;
use crate::engine::RouteTap;

/// `[layer][token]`: the token's experts, most weight first.
pub type Trace = Vec<Vec<Vec<u32>>>;

/// Records each layer's routed experts, a list per token, in the order the tokens run.
pub struct RouteTrace {
    sets: Mutex<Trace>,
}

impl RouteTrace {
    pub fn new(layers: usize) -> Self {
        RouteTrace {
            sets: Mutex::new(vec![Vec::new(); layers]),
        }
    }

    /// The trace so far, leaving the tap empty.
    pub fn take(&self) -> Trace {
        let mut sets = self.sets.lock().unwrap_or_else(|p| p.into_inner());
        let layers = sets.len();
        std::mem::replace(&mut *sets, vec![Vec::new(); layers])
    }
}

impl RouteTap for RouteTrace {
    fn routed(&self, layer: usize, rows: usize, routes: &[Route]) {
        let mut per_token = vec![Vec::new(); rows];
        // Routes come token by token, each token's in descending weight.
        for r in routes {
            if let Some(t) = per_token.get_mut(r.token as usize) {
                t.push(r.expert);
            }
        }
        let mut sets = self.sets.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(l) = sets.get_mut(layer) {
            l.extend(per_token);
        }
    }
}

/// A mixture-of-experts model's routing on a calibration corpus (`profile` on such a model): per
/// layer how many of the corpus's tokens each routed expert took. What the expert plan ranks
/// experts by (a unit of `s` slots is expected to hold the top `s` experts' share), what seeds
/// the units, and what their ATU keeps when a stale expert must give way. Saved in the model's
/// store as one checksummed file tied to the store's model identity.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RoutingProfile {
    pub model_id: String,
    pub corpus: String,
    pub tokens: usize,
    pub experts: usize,
    /// `[layer][expert]`: tokens routed to the expert.
    pub counts: Vec<Vec<u64>>,
}

const ROUTING_MAGIC: &[u8; 8] = b"GOROUTE1";
const ROUTING_FILE: &str = "routing-profile.bin";

impl RoutingProfile {
    /// The profile of `trace` (every layer's tokens, as [`RouteTrace`] records them).
    pub fn of(model_id: &str, corpus: &str, experts: usize, trace: &Trace) -> Self {
        let counts: Vec<Vec<u64>> = trace
            .iter()
            .map(|layer| {
                let mut c = vec![0u64; experts];
                for &e in layer.iter().flatten() {
                    if let Some(n) = c.get_mut(e as usize) {
                        *n += 1;
                    }
                }
                c
            })
            .collect();
        RoutingProfile {
            model_id: model_id.into(),
            corpus: corpus.into(),
            tokens: trace.first().map_or(0, |l| l.len()),
            experts,
            counts,
        }
    }

    pub fn path_in(store_dir: &std::path::Path) -> std::path::PathBuf {
        store_dir.join(ROUTING_FILE)
    }

    /// Layer `l`'s experts, most routed first (ties to the lower id), and each one's share of
    /// the layer's routings.
    pub fn ranked(&self, l: usize) -> (Vec<u32>, Vec<f64>) {
        let c = &self.counts[l];
        let total = c.iter().sum::<u64>().max(1) as f64;
        let mut ids: Vec<u32> = (0..c.len() as u32).collect();
        ids.sort_by(|&a, &b| c[b as usize].cmp(&c[a as usize]).then(a.cmp(&b)));
        let shares = ids.iter().map(|&e| c[e as usize] as f64 / total).collect();
        (ids, shares)
    }

    /// Write into `store_dir` atomically: magic, the JSON, then xxh3 of everything before it.
    pub fn save(&self, store_dir: &std::path::Path) -> Result<(), super::SparsityError> {
        let path = Self::path_in(store_dir);
        let mut b = ROUTING_MAGIC.to_vec();
        b.extend(
            serde_json::to_vec(self).map_err(|e| super::SparsityError::Io {
                path: path.clone(),
                source: std::io::Error::other(e),
            })?,
        );
        let sum = xxhash_rust::xxh3::xxh3_64(&b);
        b.extend(sum.to_le_bytes());
        crate::fsutil::write_atomic(&path, &b)
            .map_err(|source| super::SparsityError::Io { path, source })
    }

    /// The routing profile in `store_dir`, if there is one; it must belong to `model_id`, with a
    /// row of `experts` counts for each of `layers` layers (`model` names the model in the
    /// errors' advice).
    pub fn load(
        store_dir: &std::path::Path,
        model_id: &str,
        (layers, experts): (usize, usize),
        model: &str,
    ) -> Result<Option<Self>, super::SparsityError> {
        let path = Self::path_in(store_dir);
        let b = match crate::fsutil::read_at_most(&path, crate::limits::MAX_FILE_READ_BYTES.value) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(super::SparsityError::Io { path, source }),
        };
        let corrupt = |why: &str| super::SparsityError::Corrupt {
            path: path.clone(),
            why: why.into(),
            model: model.into(),
        };
        if b.len() < 16 || &b[..8] != ROUTING_MAGIC {
            return Err(corrupt("not a routing profile"));
        }
        let (body, tail) = b.split_at(b.len() - 8);
        if xxhash_rust::xxh3::xxh3_64(body).to_le_bytes() != tail {
            return Err(corrupt("checksum mismatch"));
        }
        let p: RoutingProfile =
            serde_json::from_slice(&body[8..]).map_err(|e| corrupt(&e.to_string()))?;
        if p.model_id != model_id {
            return Err(super::SparsityError::OtherModel {
                path,
                found: p.model_id,
                want: model_id.into(),
                model: model.into(),
            });
        }
        if p.experts != experts
            || p.counts.len() != layers
            || p.counts.iter().any(|c| c.len() != experts)
        {
            return Err(corrupt(&format!(
                "{} layers of {} experts, not the model's {layers} of {experts}",
                p.counts.len(),
                p.experts
            )));
        }
        Ok(Some(p))
    }
}

/// How often each of `experts` experts is routed to in `sets` (a layer's trace), as shares of
/// all routings.
pub fn frequencies(sets: &[Vec<u32>], experts: usize) -> Vec<f32> {
    let mut counts = vec![0u64; experts];
    for &e in sets.iter().flatten() {
        if let Some(c) = counts.get_mut(e as usize) {
            *c += 1;
        }
    }
    let total = counts.iter().sum::<u64>().max(1) as f64;
    counts.iter().map(|&c| (c as f64 / total) as f32).collect()
}

/// The fewest experts that take `share` of a layer's routings (the skew the literature quotes:
/// Qwen3-30B-A3B needs 65 of 128 for 90%).
pub fn experts_for_share(sets: &[Vec<u32>], experts: usize, share: f64) -> usize {
    let mut f = frequencies(sets, experts);
    f.sort_by(|a, b| b.total_cmp(a));
    let mut acc = 0.0;
    for (i, p) in f.iter().enumerate() {
        acc += f64::from(*p);
        if acc >= share - 1e-9 {
            return i + 1;
        }
    }
    experts
}

/// The longest synthetic trace (a trace is held in memory: layers × tokens × used ids).
pub const MAX_TRACE_TOKENS: usize = 1 << 20;

/// The statistics a synthetic routing trace is drawn with.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct SyntheticRouting {
    pub layers: usize,
    pub experts: usize,
    pub used: usize,
    pub tokens: usize,
    /// Popularity: the expert of rank `r` (a random order per layer) is drawn with weight
    /// `(1 + r)^-popularity` (0: uniform).
    pub popularity: f64,
    /// Temporal locality: each of the previous token's experts is routed to again with this
    /// probability before the rest are drawn by popularity (0: independent tokens).
    pub locality: f64,
    pub seed: u64,
}

impl SyntheticRouting {
    pub fn check(&self) -> Result<(), String> {
        if self.layers == 0 || self.tokens == 0 {
            return Err("a synthetic trace needs at least one layer and one token".into());
        }
        if self.used == 0 || self.used > self.experts {
            return Err(format!(
                "{} experts a token of {} experts: need 1..=experts",
                self.used, self.experts
            ));
        }
        use crate::limits::{MAX_EXPERTS, MAX_LAYERS};
        if !MAX_EXPERTS.admits(self.experts as u64) {
            return Err(MAX_EXPERTS.refuse("experts", self.experts as u64));
        }
        if !MAX_LAYERS.admits(self.layers as u64) {
            return Err(MAX_LAYERS.refuse("layers", self.layers as u64));
        }
        if self.tokens > MAX_TRACE_TOKENS {
            return Err(format!(
                "{} tokens: a synthetic trace holds at most {MAX_TRACE_TOKENS}",
                self.tokens
            ));
        }
        if !(self.popularity.is_finite() && (0.0..=8.0).contains(&self.popularity)) {
            return Err(format!("popularity {} is outside 0..=8", self.popularity));
        }
        if !(self.locality.is_finite() && (0.0..=1.0).contains(&self.locality)) {
            return Err(format!("locality {} is outside 0..=1", self.locality));
        }
        Ok(())
    }
}

/// A routing trace drawn with `s`'s statistics: deterministic in `s` (seed included).
pub fn synthetic(s: &SyntheticRouting) -> Result<Trace, String> {
    s.check()?;
    let mut rng = StdRng::seed_from_u64(s.seed);
    let mut trace = Vec::with_capacity(s.layers);
    for _ in 0..s.layers {
        // This layer's popularity order: a random permutation, rank r weighted (1 + r)^-p.
        let mut rank: Vec<usize> = (0..s.experts).collect();
        for i in (1..rank.len()).rev() {
            let j = rng.random_range(0..=i);
            rank.swap(i, j);
        }
        let mut weight = vec![0f64; s.experts];
        for (r, &e) in rank.iter().enumerate() {
            weight[e] = (1.0 + r as f64).powf(-s.popularity);
        }
        let mut sets: Vec<Vec<u32>> = Vec::with_capacity(s.tokens);
        let mut prev: Vec<u32> = Vec::new();
        for _ in 0..s.tokens {
            let mut set: Vec<u32> = prev
                .iter()
                .copied()
                .filter(|_| rng.random::<f64>() < s.locality)
                .collect();
            while set.len() < s.used {
                set.push(draw(&mut rng, &weight, &set));
            }
            prev = set.clone();
            sets.push(set);
        }
        trace.push(sets);
    }
    Ok(trace)
}

/// One expert by `weight`, none of `taken`.
fn draw(rng: &mut StdRng, weight: &[f64], taken: &[u32]) -> u32 {
    let free = |e: usize| !taken.contains(&(e as u32));
    let total: f64 = (0..weight.len())
        .filter(|&e| free(e))
        .map(|e| weight[e])
        .sum();
    let mut x = rng.random::<f64>() * total;
    let mut last = 0;
    for (e, &w) in weight.iter().enumerate() {
        if !free(e) {
            continue;
        }
        last = e;
        if x < w {
            return e as u32;
        }
        x -= w;
    }
    last as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_routing_profile_comes_back_only_as_its_models_and_whole() {
        let dir = tempfile::tempdir().unwrap();
        let trace: Trace = vec![vec![vec![2, 0], vec![2, 1]], vec![vec![3, 1], vec![1, 0]]];
        let p = RoutingProfile::of("m1", "text", 4, &trace);
        assert_eq!(p.counts, [vec![1, 1, 2, 0], vec![1, 2, 0, 1]]);
        assert_eq!(p.ranked(0).0, [2, 0, 1, 3]);
        assert_eq!(
            RoutingProfile::load(dir.path(), "m1", (2, 4), "m").unwrap(),
            None
        );
        p.save(dir.path()).unwrap();
        assert_eq!(
            RoutingProfile::load(dir.path(), "m1", (2, 4), "m").unwrap(),
            Some(p.clone())
        );
        let err = |id, shape| {
            RoutingProfile::load(dir.path(), id, shape, "m")
                .unwrap_err()
                .to_string()
        };
        assert!(
            err("m2", (2, 4)).contains("another model"),
            "{}",
            err("m2", (2, 4))
        );
        assert!(err("m1", (3, 4)).contains("not the model's 3 of 4"));
        let path = RoutingProfile::path_in(dir.path());
        let mut b = std::fs::read(&path).unwrap();
        b[12] ^= 1;
        std::fs::write(&path, &b).unwrap();
        assert!(err("m1", (2, 4)).contains("checksum"));
    }

    fn stats(popularity: f64, locality: f64) -> SyntheticRouting {
        SyntheticRouting {
            layers: 2,
            experts: 64,
            used: 4,
            tokens: 2000,
            popularity,
            locality,
            seed: 7,
        }
    }

    #[test]
    fn synthetic_traces_have_the_statistics_they_are_drawn_with() {
        let flat = synthetic(&stats(0.0, 0.0)).unwrap();
        let skewed = synthetic(&stats(1.2, 0.0)).unwrap();
        let local = synthetic(&stats(0.0, 0.6)).unwrap();
        for sets in flat.iter().chain(&skewed).chain(&local) {
            assert_eq!(sets.len(), 2000);
            for s in sets {
                let mut d = s.clone();
                d.sort_unstable();
                d.dedup();
                assert_eq!(d.len(), 4, "distinct experts, `used` of them");
                assert!(d.iter().all(|&e| e < 64));
            }
        }
        // Uniform and independent: a token shares about used/experts of its predecessor's.
        let o = adjacent_overlap(&flat[0]);
        assert!((0.02..0.11).contains(&o), "overlap {o}");
        // Locality 0.6 keeps about 60% (plus chance).
        let o = adjacent_overlap(&local[0]);
        assert!((0.55..0.7).contains(&o), "overlap {o}");
        // Skew: fewer experts carry 90% of the routings.
        let (f, s) = (
            experts_for_share(&flat[0], 64, 0.9),
            experts_for_share(&skewed[0], 64, 0.9),
        );
        assert!(
            s + 15 < f,
            "90% of routings: {s} skewed vs {f} uniform experts"
        );
        // Deterministic.
        assert_eq!(synthetic(&stats(1.2, 0.3)), synthetic(&stats(1.2, 0.3)));
        assert!(
            synthetic(&SyntheticRouting {
                used: 65,
                ..stats(0.0, 0.0)
            })
            .is_err()
        );
        assert!(
            synthetic(&SyntheticRouting {
                locality: 1.5,
                ..stats(0.0, 0.0)
            })
            .is_err()
        );
    }

    #[test]
    fn the_tap_groups_a_steps_routes_by_token() {
        let tap = RouteTrace::new(2);
        let r = |token, expert| Route {
            token,
            expert,
            weight: 0.5,
        };
        tap.routed(1, 2, &[r(0, 5), r(0, 1), r(1, 2), r(1, 7)]);
        tap.routed(1, 1, &[r(0, 7), r(0, 5)]);
        let t = tap.take();
        assert!(t[0].is_empty());
        assert_eq!(t[1], vec![vec![5, 1], vec![2, 7], vec![7, 5]]);
        assert_eq!(frequencies(&t[1], 8)[5], 2.0 / 6.0);
        assert_eq!(adjacent_overlap(&t[1]), 1.0 / 4.0);
        assert!(tap.take()[1].is_empty());
    }
}
