//! Routing traces of mixture-of-experts models: per layer, the experts each token is routed to
//! (most weight first), as the engine routes them ([`RouteTrace`]), or drawn with stated
//! statistics where weights cannot plant them ([`synthetic`]). What expert caches are judged on
//! (`bench experts`).

use std::sync::Mutex;

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

pub use super::trace::adjacent_overlap;
use crate::backend::Backend;
use crate::backend::Route;
use crate::backend::cpu::CpuBackend;
use crate::engine::RouteTap;
use crate::model::spec::MoeSpec;
use crate::tensor::{DType, HostTensor};

/// `[layer][token]`: the token's experts, most weight first.
pub type Trace = Vec<Vec<Vec<u32>>>;

/// Records each layer's routed experts, a list per token, in the order the tokens run; and
/// the next layer's experts guessed from each layer's FFN input ([`NextRouter`]), where it is
/// given the routers to guess with or an offloaded run shows its guesses.
pub struct RouteTrace {
    sets: Mutex<Trace>,
    guesses: Mutex<Trace>,
    /// Per layer, the next layer's router as it guesses from this layer's input, and the CPU
    /// that computes the guesses.
    next: Vec<Option<NextRouter>>,
    guesser: Option<(CpuBackend, MoeSpec)>,
}

/// Each token's experts of `routes` (token by token, each token's in descending weight).
fn per_token(rows: usize, routes: &[Route]) -> Vec<Vec<u32>> {
    let mut per_token = vec![Vec::new(); rows];
    for r in routes {
        if let Some(t) = per_token.get_mut(r.token as usize) {
            t.push(r.expert);
        }
    }
    per_token
}

fn record(trace: &Mutex<Trace>, layer: usize, rows: usize, routes: &[Route]) {
    let tokens = per_token(rows, routes);
    let mut sets = trace.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(l) = sets.get_mut(layer) {
        l.extend(tokens);
    }
}

fn take(trace: &Mutex<Trace>) -> Trace {
    let mut sets = trace.lock().unwrap_or_else(|p| p.into_inner());
    let layers = sets.len();
    std::mem::replace(&mut *sets, vec![Vec::new(); layers])
}

impl RouteTrace {
    pub fn new(layers: usize) -> Self {
        RouteTrace {
            sets: Mutex::new(vec![Vec::new(); layers]),
            guesses: Mutex::new(vec![Vec::new(); layers]),
            next: Vec::new(),
            guesser: None,
        }
    }

    /// A trace that also guesses every layer's experts from the previous layer's FFN input
    /// with `next` (per layer, the next layer's router; `None` for the last).
    pub fn with_guesses(
        layers: usize,
        next: Vec<Option<NextRouter>>,
        cpu: CpuBackend,
        moe: MoeSpec,
    ) -> Self {
        RouteTrace {
            next,
            guesser: Some((cpu, moe)),
            ..RouteTrace::new(layers)
        }
    }

    /// The trace so far, leaving the tap empty.
    pub fn take(&self) -> Trace {
        take(&self.sets)
    }

    /// The guesses so far (`[layer][token]`, none for the first layer), leaving them empty.
    pub fn take_guesses(&self) -> Trace {
        take(&self.guesses)
    }
}

impl RouteTap for RouteTrace {
    fn routed(&self, layer: usize, rows: usize, routes: &[Route]) {
        record(&self.sets, layer, rows, routes);
    }

    fn guessed(&self, layer: usize, rows: usize, routes: &[Route]) {
        record(&self.guesses, layer, rows, routes);
    }

    fn wants_ffn_input(&self) -> bool {
        !self.next.is_empty()
    }

    fn ffn_input(&self, layer: usize, rows: usize, x: &[f32]) {
        if let (Some(Some(next)), Some((cpu, moe))) = (self.next.get(layer), &self.guesser) {
            match next.guess(cpu, x, rows, moe) {
                Ok(g) => self.guessed(layer + 1, rows, &g),
                Err(e) => tracing::warn!("layer {}: no guess: {e}", layer + 1),
            }
        }
    }
}

/// Layer `l + 1`'s router applied to layer `l`'s FFN input (Eliseev & Mazur's guess, ProMoE's
/// prefetch): the next layer's experts guessed before its attention runs, so their copies can
/// start early. The input is layer `l`'s FFN norm output, while the next layer's router reads
/// its own norm's: the router's columns are scaled by the ratio of the two norms' weights (the
/// RMS factor scales every logit alike, which leaves the top k as they are); what the guess
/// misses is the next attention's and this FFN's contribution to the residual. Held in f16 on
/// the CPU (half the bytes a guess reads; it is a guess), computed by the CPU's kernels.
pub struct NextRouter {
    /// `experts × d`, f16.
    weight: <CpuBackend as Backend>::Weight,
    bytes: u64,
    d: usize,
    experts: usize,
}

impl NextRouter {
    /// From the next layer's router (its first `experts` rows are the routed experts'), this
    /// layer's FFN norm weights and the next layer's.
    pub fn new(
        cpu: &CpuBackend,
        router: &HostTensor,
        norm_here: &HostTensor,
        norm_next: &HostTensor,
        experts: usize,
    ) -> Result<Self, String> {
        let d = router.cols;
        if router.rows < experts || norm_here.len() != d || norm_next.len() != d {
            return Err(format!(
                "`{}` ({} × {d}) does not route {experts} experts from norms `{}` and `{}` of {} and {} weights",
                router.name,
                router.rows,
                norm_here.name,
                norm_next.name,
                norm_here.len(),
                norm_next.len()
            ));
        }
        let (here, next) = (norm_here.to_f32(), norm_next.to_f32());
        let scale: Vec<f32> = here
            .iter()
            .zip(&next)
            .map(|(&h, &n)| if h == 0.0 { 0.0 } else { n / h })
            .collect();
        let w = router.to_f32();
        let row_bytes = DType::F16.bytes_for(d);
        let mut data = vec![0u8; experts * row_bytes];
        let mut row = vec![0f32; d];
        for (src, out) in w.chunks(d).zip(data.chunks_mut(row_bytes)) {
            row.iter_mut()
                .zip(src.iter().zip(&scale))
                .for_each(|(r, (v, s))| *r = v * s);
            crate::tensor::encode_row(DType::F16, &row, out);
        }
        let host = HostTensor {
            name: format!("{} (next-layer guess)", router.name),
            rows: experts,
            cols: d,
            dtype: DType::F16,
            data: crate::tensor::Bytes::from_slice(&data),
        };
        Ok(NextRouter {
            weight: cpu.upload(&host).map_err(|e| e.to_string())?,
            bytes: data.len() as u64,
            d,
            experts,
        })
    }

    /// Host bytes of a guess router of `experts` experts over `d` columns.
    pub fn bytes_for(experts: usize, d: usize) -> u64 {
        (experts * DType::F16.bytes_for(d)) as u64
    }

    /// Host bytes it holds.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The guessed routes (routed experts only, as [`crate::engine::moe::route`] routes them)
    /// of the `n` rows of `x`.
    pub fn guess(
        &self,
        cpu: &CpuBackend,
        x: &[f32],
        n: usize,
        moe: &MoeSpec,
    ) -> Result<Vec<Route>, String> {
        let e = |e: crate::backend::BackendError| e.to_string();
        let mut xt = cpu.alloc(n, self.d).map_err(e)?;
        cpu.write(&mut xt, &x[..n * self.d]).map_err(e)?;
        let mut lt = cpu.alloc(n, self.experts).map_err(e)?;
        cpu.matmul(&self.weight, &xt, &mut lt).map_err(e)?;
        let mut logits = vec![0f32; n * self.experts];
        cpu.read(&lt, &mut logits).map_err(e)?;
        let routed = MoeSpec {
            shared: 0,
            ..moe.clone()
        };
        Ok(crate::engine::moe::route(&logits, n, &routed))
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
    /// `[layer]`: `(slots, ATU hit ratio, static hit ratio)` of a unit of that many slots on the
    /// second half of the profiled trace, its experts ranked on the first half
    /// ([`crate::tier::atu::atu_curve`], set by `profile`): what the plan expects of units and of
    /// static hot experts. Empty in profiles written before it was recorded (the plan then
    /// expects the in-sample top share of both).
    #[serde(default)]
    pub atu: Vec<Vec<(u32, f32, f32)>>,
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
            atu: Vec::new(),
        }
    }

    /// Layer `l`'s expected hit ratios with `slots` slots, of an ATU unit and of static hot
    /// experts, interpolated between the replayed sizes (`None`: not recorded).
    pub fn held_out_hits(&self, l: usize, slots: usize) -> Option<(f64, f64)> {
        let curve = self.atu.get(l).filter(|c| !c.is_empty())?;
        let (mut s0, mut a0, mut t0) = (0f64, 0f64, 0f64);
        for &(s, a, t) in curve {
            let (s, a, t) = (f64::from(s), f64::from(a), f64::from(t));
            if slots as f64 <= s {
                let f = (slots as f64 - s0) / (s - s0).max(1.0);
                return Some((a0 + (a - a0) * f, t0 + (t - t0) * f));
            }
            (s0, a0, t0) = (s, a, t);
        }
        Some((a0, t0))
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
        crate::fsutil::write_atomic(&path, &super::sealed(b))
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
        let body = super::unsealed(&b, ROUTING_MAGIC, 16, "routing profile")
            .map_err(|why| corrupt(&why))?;
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
            || !(p.atu.is_empty() || p.atu.len() == layers)
            || p.atu.iter().flatten().any(|&(slots, atu, hot)| {
                slots == 0
                    || slots as usize > experts
                    || !(0.0..=1.0).contains(&atu)
                    || !(0.0..=1.0).contains(&hot)
            })
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
    fn the_units_expected_hits_interpolate_between_the_replayed_sizes() {
        let mut p = RoutingProfile::of("m", "c", 32, &vec![vec![vec![1, 2]]]);
        p.atu = vec![vec![(2, 0.2, 0.1), (4, 0.6, 0.3), (32, 0.9, 1.0)]];
        // Between replayed sizes a straight line, from none at 0 slots; the last beyond.
        let near = |got: Option<(f64, f64)>, want: (f64, f64)| {
            let g = got.unwrap();
            assert!(
                (g.0 - want.0).abs() < 1e-6 && (g.1 - want.1).abs() < 1e-6,
                "{g:?}"
            );
        };
        near(p.held_out_hits(0, 1), (0.1, 0.05));
        near(p.held_out_hits(0, 3), (0.4, 0.2));
        near(p.held_out_hits(0, 0), (0.0, 0.0));
        near(p.held_out_hits(0, 40), (0.9, 1.0));
        assert_eq!(p.held_out_hits(1, 3), None);
        // A profile written before the replay was recorded still reads (without it).
        let mut v = serde_json::to_value(&p).unwrap();
        v.as_object_mut().unwrap().remove("atu");
        let old: RoutingProfile = serde_json::from_value(v).unwrap();
        assert!(old.atu.is_empty() && old.held_out_hits(0, 3).is_none());
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
