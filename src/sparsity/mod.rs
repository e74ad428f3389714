//! FFN activation sparsity: which neurons a token needs, per model.
//!
//! A neuron is FFN row i of gate/up plus column i of down. Its activation for a token is
//! `a = act(gate_i·x)` (or `act(up_i·x)` without a gate); it is *inactive* when `|a| ≤ t_l`, a
//! per-layer threshold (CATS). For ReLU-family models `t = 0` is the exact active set (`a > 0`);
//! for SwiGLU models the threshold is chosen on calibration text to reach a target sparsity.
//!
//! `profile` runs a model over a corpus twice: the first pass builds, per layer, a histogram of
//! `|a|` (log-spaced bins) from which the threshold of every target sparsity is read; the second
//! counts, per neuron, how often it is active at each target of a 5% grid (its activation
//! frequency: PowerInfer's impact metric, the input of hot-neuron placement). The result is
//! saved in the model's store as one checksummed file tied to the store's model identity.

pub mod predictor;
pub mod recall;
pub mod routing;
pub mod trace;

use predictor::{Predictor, PredictorQuality, TrainOptions};
use rayon::prelude::*;

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};
use thiserror::Error;
use xxhash_rust::xxh3::xxh3_64;

use crate::engine::ActivationTap;

/// The profile's file in a store directory.
pub const PROFILE_FILE: &str = "sparsity.profile";
const MAGIC: &[u8; 8] = b"GOSPARS1";

/// A profile file's bytes sealed: followed by the xxh3 of everything before it.
fn sealed(mut b: Vec<u8>) -> Vec<u8> {
    let sum = xxh3_64(&b);
    b.extend(sum.to_le_bytes());
    b
}

/// A sealed profile file's bytes without their seal, checked: at least `least` bytes in all,
/// starting with `magic` (else "not a `what`"), the seal matching.
fn unsealed<'a>(
    b: &'a [u8],
    magic: &[u8; 8],
    least: usize,
    what: &str,
) -> Result<&'a [u8], String> {
    if b.len() < least.max(16) || &b[..8] != magic {
        return Err(format!("not a {what}"));
    }
    let (body, tail) = b.split_at(b.len() - 8);
    if xxh3_64(body).to_le_bytes() != tail {
        return Err("checksum mismatch".into());
    }
    Ok(body)
}

/// Histogram bins per layer: bin 0 holds exact zeros, bins 1..=LOG_BINS split
/// [MIN_ABS, MAX_ABS) logarithmically (≈0.6% wide), the last also takes anything larger.
const LOG_BINS: usize = 4096;
const MIN_ABS: f64 = 1e-7;
const MAX_ABS: f64 = 1e4;

/// Targets whose thresholds are kept: 1%, 2%, …, 99%.
pub const FINE_TARGETS: usize = 99;
/// Targets whose per-neuron frequencies are kept: 5%, 10%, …, 95%.
pub const GRID_TARGETS: usize = 19;

pub fn fine_target(i: usize) -> f64 {
    (i + 1) as f64 / 100.0
}

pub fn grid_target(i: usize) -> f64 {
    (i + 1) as f64 * 0.05
}

/// The grid target nearest `target` (its index).
pub fn grid_index(target: f64) -> usize {
    ((target / 0.05).round() as usize).clamp(1, GRID_TARGETS) - 1
}

#[derive(Debug, Error)]
pub enum SparsityError {
    #[error(
        "{store} holds no sparsity profile: run `gpu-offload profile -m {model}` first (or use --sparsity off)"
    )]
    NotProfiled { store: PathBuf, model: String },
    #[error(
        "the sparsity profile in {path} belongs to another model ({found}, this one is {want}): run `gpu-offload profile -m {model}` again"
    )]
    OtherModel {
        path: PathBuf,
        found: String,
        want: String,
        model: String,
    },
    #[error(
        "the sparsity profile {path} is corrupt ({why}): run `gpu-offload profile -m {model}` again"
    )]
    Corrupt {
        path: PathBuf,
        why: String,
        model: String,
    },
    #[error("--sparsity-target {0} is outside 0.01..=0.99")]
    Target(f64),
    #[error(
        "the sparsity profile of {model} has no predictors: run `gpu-offload profile -m {model}` (without --no-predictors)"
    )]
    NoPredictors { model: String },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Per-layer statistics of one model's FFN activations on a calibration corpus.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct SparsityProfile {
    pub model_id: String,
    pub corpus: String,
    /// Tokens the statistics cover.
    pub tokens: usize,
    /// Tokens per window (each window starts a fresh context).
    pub window: usize,
    pub n_layers: usize,
    pub d_ff: usize,
    /// `[layer][i]`: the threshold masking `fine_target(i)` of the layer's activations.
    pub thresholds: Vec<Vec<f32>>,
    /// `[layer][k]`: the share of activations masked by the threshold of `grid_target(k)`, as
    /// measured in the second pass.
    pub measured: Vec<Vec<f32>>,
    /// `[layer][k][neuron]`: how often the neuron is active at `grid_target(k)`, as a fraction
    /// of tokens scaled to 0..=65535 (kept in the file's binary part, not its JSON header).
    #[serde(skip)]
    pub frequency: Vec<u16>,
    /// The sparsity the predictors were trained for (their mask is the threshold's at it).
    #[serde(default)]
    pub predictor_target: Option<f64>,
    /// One per layer, or none (weights after the frequencies in the binary part).
    #[serde(default)]
    pub predictors: Vec<Predictor>,
    /// How each did on held-out tokens.
    #[serde(default)]
    pub predictor_quality: Vec<PredictorQuality>,
    /// The cache units' hit ratios `bench units` measured on a decode trace, where it has.
    #[serde(default)]
    pub unit_reuse: Option<UnitReuse>,
}

/// Per layer, the share of each token's active neurons a cache unit of a given size already
/// held under the adjacent-token update, measured on a decode trace at one sparsity: what the
/// plan expects the units' loads by.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct UnitReuse {
    pub target: f64,
    pub tokens: usize,
    /// `[layer]`: (slots, hit ratio), slots ascending.
    pub layers: Vec<Vec<(usize, f64)>>,
}

impl UnitReuse {
    /// The hit ratio of a unit of `slots` in layer `l` at `target`, interpolated between the
    /// sizes measured (the largest's beyond them); `None` below the smallest measured or for
    /// another target.
    pub fn hit_ratio(&self, target: f64, l: usize, slots: f64) -> Option<f64> {
        if (self.target - target).abs() > 1e-9 {
            return None;
        }
        let pts = self.layers.get(l)?;
        let first = pts.first()?;
        if slots < first.0 as f64 {
            return None;
        }
        for w in pts.windows(2) {
            let ((k0, h0), (k1, h1)) = (w[0], w[1]);
            if slots <= k1 as f64 {
                let t = if k1 > k0 {
                    (slots - k0 as f64) / (k1 - k0) as f64
                } else {
                    1.0
                };
                return Some(h0 + t * (h1 - h0));
            }
        }
        pts.last().map(|p| p.1)
    }
}

/// A profile's predictors as the engine uses them.
pub struct Predictors(pub Vec<Predictor>);

impl crate::engine::NeuronPredictor for Predictors {
    fn active(&self, layer: usize, input: &[f32], n: usize) -> Vec<bool> {
        self.0[layer].active(input, n)
    }

    fn scored(&self, layer: usize, input: &[f32], n: usize) -> (Vec<bool>, Vec<f32>) {
        self.0[layer].scored(input, n)
    }

    fn weight_bytes(&self, layer: usize) -> u64 {
        self.0.get(layer).map_or(0, |p| p.parameters() as u64 * 4)
    }
}

impl SparsityProfile {
    /// The sparsity its predictors were trained for; refused, saying how to make them, where it
    /// has none (`model` names the model in the advice).
    pub fn predictor_target_of(&self, model: &str) -> Result<f64, SparsityError> {
        self.predictor_target
            .ok_or_else(|| SparsityError::NoPredictors {
                model: model.to_string(),
            })
    }

    /// Per layer, the threshold for `target` sparsity (interpolated between whole percents).
    pub fn thresholds_for(&self, target: f64) -> Result<Vec<f32>, SparsityError> {
        if !(0.01..=0.99).contains(&target) {
            return Err(SparsityError::Target(target));
        }
        let x = target * 100.0 - 1.0;
        let (i0, w) = (x.floor() as usize, x - x.floor());
        Ok(self
            .thresholds
            .iter()
            .map(|t| {
                let i1 = (i0 + 1).min(FINE_TARGETS - 1);
                (t[i0] as f64 * (1.0 - w) + t[i1] as f64 * w) as f32
            })
            .collect())
    }

    /// Activation frequency (0..=1) of every neuron of `layer` at grid target `k`.
    pub fn frequencies(&self, layer: usize, k: usize) -> Vec<f64> {
        let at = (layer * GRID_TARGETS + k) * self.d_ff;
        self.frequency[at..at + self.d_ff]
            .iter()
            .map(|&f| f as f64 / 65535.0)
            .collect()
    }

    pub fn path_in(store_dir: &Path) -> PathBuf {
        store_dir.join(PROFILE_FILE)
    }

    /// Write into `store_dir` atomically: magic, JSON header length and header, the frequencies
    /// (u16 LE), then xxh3 of everything before it.
    pub fn save(&self, store_dir: &Path) -> Result<(), SparsityError> {
        let path = Self::path_in(store_dir);
        let header = serde_json::to_vec(self).map_err(|e| SparsityError::Io {
            path: path.clone(),
            source: std::io::Error::other(e),
        })?;
        let mut b = Vec::with_capacity(16 + header.len() + 2 * self.frequency.len() + 8);
        b.extend(MAGIC);
        b.extend((header.len() as u64).to_le_bytes());
        b.extend(&header);
        for f in &self.frequency {
            b.extend(f.to_le_bytes());
        }
        for p in &self.predictors {
            for w in p.weights() {
                for v in w {
                    b.extend(v.to_le_bytes());
                }
            }
        }
        crate::fsutil::write_atomic(&path, &sealed(b))
            .map_err(|source| SparsityError::Io { path, source })
    }

    /// The profile in `store_dir`, which must belong to `model_id`; `model` names the model in
    /// the errors' advice.
    pub fn load(store_dir: &Path, model_id: &str, model: &str) -> Result<Self, SparsityError> {
        let path = Self::path_in(store_dir);
        let b = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(SparsityError::NotProfiled {
                    store: store_dir.to_path_buf(),
                    model: model.into(),
                });
            }
            Err(source) => return Err(SparsityError::Io { path, source }),
        };
        let corrupt = |why: &str| SparsityError::Corrupt {
            path: path.clone(),
            why: why.into(),
            model: model.into(),
        };
        let body = unsealed(&b, MAGIC, 24, "sparsity profile").map_err(|why| corrupt(&why))?;
        let hlen = u64::from_le_bytes(body[8..16].try_into().map_err(|_| corrupt("header"))?);
        let hend = 16usize
            .checked_add(hlen as usize)
            .filter(|&e| e <= body.len())
            .ok_or_else(|| corrupt("header length"))?;
        let mut p: SparsityProfile =
            serde_json::from_slice(&body[16..hend]).map_err(|e| corrupt(&e.to_string()))?;
        let want = p.n_layers * GRID_TARGETS * p.d_ff;
        let weights: usize = p
            .predictors
            .iter()
            .map(|q| q.weight_lens().iter().sum::<usize>())
            .sum();
        if body.len() - hend != 2 * want + 4 * weights {
            return Err(corrupt("sizes do not match the header"));
        }
        let freq = &body[hend..hend + 2 * want];
        let mut at = hend + 2 * want;
        for q in &mut p.predictors {
            let lens = q.weight_lens();
            let mut take = |len: usize| -> Vec<f32> {
                let v = body[at..at + 4 * len]
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                at += 4 * len;
                v
            };
            q.w1 = take(lens[0]);
            q.b1 = take(lens[1]);
            q.w2 = take(lens[2]);
            q.b2 = take(lens[3]);
        }
        if freq.len() != 2 * want
            || p.thresholds.len() != p.n_layers
            || p.thresholds.iter().any(|t| t.len() != FINE_TARGETS)
        {
            return Err(corrupt("sizes do not match the header"));
        }
        p.frequency = freq
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect();
        if p.model_id != model_id {
            return Err(SparsityError::OtherModel {
                path,
                found: p.model_id,
                want: model_id.into(),
                model: model.into(),
            });
        }
        Ok(p)
    }
}

fn bin_of(a: f32) -> usize {
    let v = a.abs() as f64;
    if v == 0.0 {
        return 0;
    }
    if v < MIN_ABS {
        return 1;
    }
    let x = (v / MIN_ABS).ln() / (MAX_ABS / MIN_ABS).ln() * LOG_BINS as f64;
    1 + (x as usize).min(LOG_BINS - 1)
}

/// The upper edge of histogram bin `b` (every value in bins ≤ b is at most this).
fn bin_upper(b: usize) -> f32 {
    if b == 0 {
        return 0.0;
    }
    (MIN_ABS * (MAX_ABS / MIN_ABS).powf(b as f64 / LOG_BINS as f64)) as f32
}

enum Phase {
    /// Pass 1: `[layer][bin]` counts of |a|.
    Histogram(Vec<Vec<u64>>),
    /// Pass 2: per layer the 19 grid thresholds, and `[layer][j][neuron]` counts of activations
    /// exceeding exactly j of them.
    Counting {
        fine: Vec<Vec<f32>>,
        grid: Vec<Vec<f32>>,
        counts: Vec<Vec<u32>>,
    },
}

/// Predictor training data gathered in pass 2: per layer, FFN inputs (f16) and the mask at
/// the predictor's target (bit per neuron).
struct PredictorData {
    d_model: usize,
    fine: usize,
    max_tokens: usize,
    inputs: Vec<Vec<half::f16>>,
    masks: Vec<Vec<u64>>,
    tokens: Vec<usize>,
}

/// The [`ActivationTap`] `profile` runs the model with.
pub struct ProfileTap {
    n_layers: usize,
    d_ff: usize,
    state: Mutex<(Phase, usize)>,
    data: Mutex<Option<PredictorData>>,
}

impl ProfileTap {
    pub fn new(n_layers: usize, d_ff: usize) -> Self {
        ProfileTap {
            n_layers,
            d_ff,
            state: Mutex::new((Phase::Histogram(vec![vec![0; LOG_BINS + 1]; n_layers]), 0)),
            data: Mutex::new(None),
        }
    }

    /// Also gather, in pass 2, up to `max_tokens` tokens of training data for predictors of the
    /// mask at `target` sparsity.
    pub fn with_predictor_data(self, d_model: usize, target: f64, max_tokens: usize) -> Self {
        let fine = ((target * 100.0).round() as usize).clamp(1, FINE_TARGETS) - 1;
        *self.data.lock().unwrap_or_else(|e| e.into_inner()) = Some(PredictorData {
            d_model,
            fine,
            max_tokens,
            inputs: vec![Vec::new(); self.n_layers],
            masks: vec![Vec::new(); self.n_layers],
            tokens: vec![0; self.n_layers],
        });
        self
    }

    /// Train one predictor per layer on the gathered data (layers in parallel). Empty when no
    /// data was gathered.
    pub fn train_predictors(&self, opts: TrainOptions) -> Vec<(Predictor, PredictorQuality)> {
        let data = self.data.lock().unwrap_or_else(|e| e.into_inner());
        let Some(data) = data.as_ref() else {
            return Vec::new();
        };
        let (d, n) = (data.d_model, self.d_ff);
        (0..self.n_layers)
            .into_par_iter()
            .map(|l| {
                let t = data.tokens[l];
                let x: Vec<f32> = data.inputs[l].iter().map(|v| v.to_f32()).collect();
                let words = n.div_ceil(64);
                let truth: Vec<bool> = (0..t * n)
                    .map(|i| {
                        let (row, j) = (i / n, i % n);
                        data.masks[l][row * words + j / 64] >> (j % 64) & 1 == 1
                    })
                    .collect();
                predictor::train(
                    &x,
                    &truth,
                    d,
                    n,
                    TrainOptions {
                        seed: l as u64,
                        ..opts
                    },
                )
            })
            .collect()
    }

    /// The fine-target index the predictor data is for.
    pub fn predictor_fine(&self) -> Option<usize> {
        self.data
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|d| d.fine)
    }

    /// End pass 1: read the thresholds of every fine target from the histograms, and start
    /// counting per neuron at the grid targets. Returns `[layer][fine target]` thresholds.
    pub fn start_counting(&self) -> Vec<Vec<f32>> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let Phase::Histogram(h) = &st.0 else {
            return Vec::new();
        };
        let fine: Vec<Vec<f32>> = h
            .iter()
            .map(|bins| {
                let total: u64 = bins.iter().sum();
                (0..FINE_TARGETS)
                    .map(|i| {
                        let want = (fine_target(i) * total as f64).ceil() as u64;
                        let mut cum = 0u64;
                        for (b, &c) in bins.iter().enumerate() {
                            cum += c;
                            if cum >= want {
                                return bin_upper(b);
                            }
                        }
                        bin_upper(LOG_BINS)
                    })
                    .collect()
            })
            .collect();
        let grid = fine
            .iter()
            .map(|t| (0..GRID_TARGETS).map(|k| t[5 * (k + 1) - 1]).collect())
            .collect();
        st.0 = Phase::Counting {
            fine: fine.clone(),
            grid,
            counts: vec![vec![0; (GRID_TARGETS + 1) * self.d_ff]; self.n_layers],
        };
        st.1 = 0;
        fine
    }

    /// End pass 2: `[layer][k]` measured sparsity and the per-neuron frequencies.
    pub fn finish(&self) -> (Vec<Vec<f32>>, Vec<u16>) {
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let (Phase::Counting { counts, .. }, tokens) = (&st.0, st.1) else {
            return (Vec::new(), Vec::new());
        };
        let tokens = (tokens / self.n_layers).max(1) as f64;
        let d = self.d_ff;
        let mut measured = Vec::with_capacity(self.n_layers);
        let mut freq = vec![0u16; self.n_layers * GRID_TARGETS * d];
        for (l, c) in counts.iter().enumerate() {
            let mut m = [0f32; GRID_TARGETS];
            for n in 0..d {
                // Active at target k ⇔ above at least k + 1 of the ascending grid thresholds.
                let mut above = 0u64;
                for j in (1..=GRID_TARGETS).rev() {
                    above += c[j * d + n] as u64;
                    let k = j - 1;
                    let f = above as f64 / tokens;
                    freq[(l * GRID_TARGETS + k) * d + n] = (f * 65535.0).round() as u16;
                    m[k] += f as f32;
                }
            }
            measured.push(m.iter().map(|s| 1.0 - s / d as f32).collect());
        }
        (measured, freq)
    }
}

impl ActivationTap for ProfileTap {
    fn observe(&self, layer: usize, input: &[f32], acts: &[f32], n: usize) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let d = self.d_ff;
        st.1 += n;
        match &mut st.0 {
            Phase::Histogram(h) => {
                let bins = &mut h[layer];
                for &a in acts {
                    bins[bin_of(a)] += 1;
                }
            }
            Phase::Counting { fine, grid, counts } => {
                let mut data = self.data.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(pd) = data.as_mut() {
                    let t = fine[layer][pd.fine];
                    let words = d.div_ceil(64);
                    let dm = pd.d_model;
                    for (row, x) in acts.chunks_exact(d).zip(input.chunks_exact(dm)) {
                        if pd.tokens[layer] >= pd.max_tokens {
                            break;
                        }
                        pd.inputs[layer].extend(x.iter().map(|&v| half::f16::from_f32(v)));
                        let mut bits = vec![0u64; words];
                        for (j, &a) in row.iter().enumerate() {
                            if a.abs() > t {
                                bits[j / 64] |= 1 << (j % 64);
                            }
                        }
                        pd.masks[layer].extend(bits);
                        pd.tokens[layer] += 1;
                    }
                }
                let (g, c) = (&grid[layer], &mut counts[layer]);
                for row in acts.chunks_exact(d) {
                    for (n, &a) in row.iter().enumerate() {
                        let j = g.partition_point(|&t| a.abs() > t);
                        c[j * d + n] += 1;
                    }
                }
            }
        }
    }
}

/// What both passes give: `[layer][fine target]` thresholds, `[layer][grid target]` measured
/// sparsity, and the per-neuron frequencies (see [`SparsityProfile`]).
pub type ProfileResult = (Vec<Vec<f32>>, Vec<Vec<f32>>, Vec<u16>);

/// Run both passes of a profile: `tokens` in windows of `window` (each a fresh context) through
/// `engine`, which must carry `tap` ([`crate::engine::Engine::with_activation_tap`]).
/// `progress(done, total)` counts windows over both passes.
pub fn profile_passes<B: crate::backend::Backend>(
    engine: &crate::engine::Engine<B>,
    tap: &ProfileTap,
    tokens: &[u32],
    window: usize,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<ProfileResult, crate::engine::EngineError> {
    let windows: Vec<&[u32]> = tokens.chunks(window.max(1)).collect();
    let total = 2 * windows.len();
    let mut fine = Vec::new();
    for pass in 0..2 {
        for (i, w) in windows.iter().enumerate() {
            let mut s = engine.new_session(w.len())?;
            engine.forward(&mut s, w, crate::engine::Logits::None)?;
            progress(pass * windows.len() + i + 1, total);
        }
        if pass == 0 {
            fine = tap.start_counting();
        }
    }
    let (measured, frequency) = tap.finish();
    Ok((fine, measured, frequency))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unit_reuse_interpolates_between_measured_sizes() {
        let r = UnitReuse {
            target: 0.5,
            tokens: 10,
            layers: vec![vec![(10, 0.5), (20, 0.7), (40, 0.9)]],
        };
        assert_eq!(r.hit_ratio(0.5, 0, 9.0), None);
        assert_eq!(r.hit_ratio(0.4, 0, 20.0), None);
        assert_eq!(r.hit_ratio(0.5, 1, 20.0), None);
        assert!((r.hit_ratio(0.5, 0, 15.0).unwrap() - 0.6).abs() < 1e-12);
        assert!((r.hit_ratio(0.5, 0, 30.0).unwrap() - 0.8).abs() < 1e-12);
        assert_eq!(r.hit_ratio(0.5, 0, 100.0), Some(0.9));
        assert_eq!(r.hit_ratio(0.5, 0, 10.0), Some(0.5));
    }

    #[test]
    fn bins_are_ordered_and_their_edges_bound_them() {
        let mut last = 0;
        for v in [0.0f32, 1e-9, 1e-7, 3e-5, 0.01, 0.5, 1.0, 7.0, 1e3, 1e6] {
            let b = bin_of(v);
            assert!(b >= last, "{v}");
            assert!(v <= bin_upper(b) || b == LOG_BINS, "{v} above its bin {b}");
            last = b;
        }
        assert_eq!(bin_of(0.0), 0);
        assert_eq!(bin_of(-0.25), bin_of(0.25));
    }

    /// A tap fed known activations: thresholds at the quantiles, frequencies that add up to the
    /// measured sparsity, and a file that round-trips and refuses another model or a flipped
    /// byte.
    #[test]
    fn profile_of_known_activations_round_trips() {
        let (layers, d) = (2, 8);
        let tap = ProfileTap::new(layers, d);
        // Neuron j's activation is (j + 1) · 0.1 on every token: a skewed, known layer.
        let row: Vec<f32> = (0..d).map(|j| (j + 1) as f32 * 0.1).collect();
        let acts: Vec<f32> = row.iter().cycle().take(4 * d).copied().collect();
        for pass in 0..2 {
            for l in 0..layers {
                tap.observe(l, &[], &acts, 4);
            }
            if pass == 0 {
                let fine = tap.start_counting();
                // 50% masks neurons 0..4 (values up to 0.4): the threshold lies in [0.4, 0.5).
                let t = fine[0][49];
                assert!((0.4..0.5).contains(&t), "{t}");
            }
        }
        let (measured, frequency) = tap.finish();
        // At 50%, neurons 0..4 are never active, 4..8 always.
        let k50 = 9;
        assert!((measured[0][k50] - 0.5).abs() < 1e-6, "{:?}", measured[0]);
        let p = SparsityProfile {
            model_id: "m1".into(),
            corpus: "test".into(),
            tokens: 4,
            window: 4,
            n_layers: layers,
            d_ff: d,
            thresholds: vec![vec![0.45; FINE_TARGETS]; layers],
            measured,
            frequency,
            predictor_target: None,
            predictors: Vec::new(),
            predictor_quality: Vec::new(),
            unit_reuse: None,
        };
        // With predictors, whose weights travel in the binary part.
        let x: Vec<f32> = (0..40 * 4).map(|i| ((i * 7) % 11) as f32 - 5.0).collect();
        let truth: Vec<bool> = (0..40 * d).map(|i| i % 3 == 0).collect();
        let (pred, q) = predictor::train(&x, &truth, 4, d, TrainOptions::default());
        let p = SparsityProfile {
            predictor_target: Some(0.5),
            predictors: vec![pred.clone(), pred],
            predictor_quality: vec![q, q],
            unit_reuse: None,
            ..p
        };
        let f = p.frequencies(1, k50);
        assert_eq!(f, [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]);
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(
            SparsityProfile::load(dir.path(), "m1", "M"),
            Err(SparsityError::NotProfiled { .. })
        ));
        p.save(dir.path()).unwrap();
        assert_eq!(SparsityProfile::load(dir.path(), "m1", "M").unwrap(), p);
        let e = SparsityProfile::load(dir.path(), "m2", "M").unwrap_err();
        assert!(matches!(e, SparsityError::OtherModel { .. }), "{e}");
        assert!(e.to_string().contains("gpu-offload profile -m M"));
        let path = SparsityProfile::path_in(dir.path());
        let mut b = std::fs::read(&path).unwrap();
        let mid = b.len() / 2;
        b[mid] ^= 1;
        std::fs::write(&path, &b).unwrap();
        let e = SparsityProfile::load(dir.path(), "m1", "M").unwrap_err();
        assert!(matches!(e, SparsityError::Corrupt { .. }), "{e}");
        assert!(p.thresholds_for(0.0).is_err() && p.thresholds_for(1.0).is_err());
        assert_eq!(p.thresholds_for(0.5).unwrap(), vec![0.45; layers]);
    }
}
