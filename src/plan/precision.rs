//! Mixed-precision shares (M2Cache §4.2): what share of each token's active FFN neurons a cache
//! unit computes in f16, INT8 and INT4 ([`Precision`]), how `--neuron-precision` asks for them,
//! and the saved search (`bench precision`) that `auto` picks from. The tiers apply the shares
//! each step ([`crate::tier::precision`]).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::store::Encoding;

/// The encodings of the precision tiers, best first.
pub const TIER_ENCODINGS: [Encoding; 3] = [Encoding::F16, Encoding::Int8, Encoding::Int4];

/// Shares in percent of each token's active neurons computed in f16, INT8 and INT4.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Precision(pub [u32; 3]);

impl Precision {
    /// Every active neuron in f16.
    pub const FP16: Precision = Precision([100, 0, 0]);

    /// Checked shares (they add up to 100).
    pub fn new(shares: [u32; 3]) -> Result<Self, String> {
        if shares.iter().sum::<u32>() != 100 {
            return Err(format!(
                "precision shares {}/{}/{} do not add up to 100",
                shares[0], shares[1], shares[2]
            ));
        }
        Ok(Precision(shares))
    }

    /// The tiers in use (share > 0), by index into [`TIER_ENCODINGS`].
    pub fn tiers(&self) -> impl Iterator<Item = usize> + '_ {
        (0..3).filter(|&i| self.0[i] > 0)
    }

    /// Whether more than one tier is in use.
    pub fn mixed(&self) -> bool {
        self.tiers().count() > 1
    }

    /// How many of `count` ranked neurons fall in each tier: the cumulative shares rounded, so
    /// the tiers add up to `count` and an unused tier gets none.
    pub fn counts(&self, count: usize) -> [usize; 3] {
        let upto = |pct: u32| (count as u64 * pct as u64 + 50) / 100;
        let a = upto(self.0[0]) as usize;
        let b = upto(self.0[0] + self.0[1]) as usize;
        [a, b - a, count - b]
    }

    /// The candidates the precision search tries: all-f16, M2Cache's 25/25/50 and a grid in
    /// steps of 25%.
    pub fn search_grid() -> Vec<Precision> {
        let mut out = Vec::new();
        for a in (0..=100).step_by(25) {
            for b in (0..=100 - a).step_by(25) {
                out.push(Precision([a, b, 100 - a - b]));
            }
        }
        out
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if *self == Self::FP16 {
            return f.write_str("fp16");
        }
        write!(f, "{}/{}/{}", self.0[0], self.0[1], self.0[2])
    }
}

impl FromStr for Precision {
    type Err = String;

    /// `fp16`, or `A/B/C`: percent in f16, INT8, INT4.
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if s.eq_ignore_ascii_case("fp16") || s.eq_ignore_ascii_case("f16") {
            return Ok(Self::FP16);
        }
        let parts: Vec<&str> = s.split('/').collect();
        if parts.len() != 3 {
            return Err(format!(
                "`{s}`: give fp16 or three percentages A/B/C (f16/INT8/INT4), e.g. 25/25/50"
            ));
        }
        let mut shares = [0u32; 3];
        for (v, p) in shares.iter_mut().zip(&parts) {
            *v = p
                .trim()
                .parse()
                .map_err(|_| format!("`{s}`: `{p}` is not a whole percentage"))?;
        }
        Precision::new(shares)
    }
}

/// `--neuron-precision`: shares given, or the fastest of a saved search's good ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NeuronPrecision {
    Fixed(Precision),
    /// The fastest (by the plan) of the shares `bench precision` found within its tolerance
    /// of all-f16 perplexity; all-f16 where no search was saved.
    Auto,
}

impl FromStr for NeuronPrecision {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s.trim().eq_ignore_ascii_case("auto") {
            return Ok(NeuronPrecision::Auto);
        }
        s.parse().map(NeuronPrecision::Fixed)
    }
}

/// One candidate of a precision search.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PrecisionScore {
    pub precision: Precision,
    pub ppl: f64,
    pub ppl_std_err: f64,
    /// `ppl` over all-f16's.
    pub ratio: f64,
    /// Mean bytes of an active neuron's bundle at these shares.
    pub neuron_bytes: f64,
}

/// What `bench precision` measured for a model: perplexity on calibration text of each
/// candidate, at one sparsity. Saved beside the store's sparsity profile.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PrecisionSearch {
    pub model_id: String,
    /// `oracle` or `predicted`: what decided the active neurons and ranked them.
    pub sparsity: String,
    pub target: f64,
    /// The largest perplexity ratio to all-f16 a candidate may have to be used.
    pub tolerance: f64,
    pub tokens_scored: usize,
    pub scores: Vec<PrecisionScore>,
}

const SEARCH_FILE: &str = "precision-search.json";
const SUM_TAG: &[u8] = b"\n# xxh3 ";

#[derive(Debug, thiserror::Error)]
pub enum SearchError {
    #[error("{path}: {source}")]
    Io {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is damaged ({why}): run `gpu-offload bench precision` again")]
    Corrupt {
        path: std::path::PathBuf,
        why: String,
    },
}

impl PrecisionSearch {
    pub fn path_in(store_dir: &std::path::Path) -> std::path::PathBuf {
        store_dir.join(SEARCH_FILE)
    }

    /// The candidates within tolerance, best perplexity first.
    pub fn good(&self) -> Vec<Precision> {
        let mut ok: Vec<&PrecisionScore> = self
            .scores
            .iter()
            .filter(|s| s.ratio <= 1.0 + self.tolerance)
            .collect();
        ok.sort_by(|a, b| a.ppl.total_cmp(&b.ppl));
        ok.iter().map(|s| s.precision).collect()
    }

    /// Write into `store_dir` atomically: the JSON, then a line with its xxh3.
    pub fn save(&self, store_dir: &std::path::Path) -> Result<(), SearchError> {
        let path = Self::path_in(store_dir);
        let mut b = serde_json::to_vec_pretty(self).map_err(|e| SearchError::Io {
            path: path.clone(),
            source: std::io::Error::other(e),
        })?;
        let sum = xxhash_rust::xxh3::xxh3_64(&b);
        b.extend(SUM_TAG);
        b.extend(format!("{sum:016x}\n").as_bytes());
        crate::fsutil::write_atomic(&path, &b).map_err(|source| SearchError::Io { path, source })
    }

    /// The search saved in `store_dir` for `model_id`, if there is one.
    pub fn load(store_dir: &std::path::Path, model_id: &str) -> Result<Option<Self>, SearchError> {
        let path = Self::path_in(store_dir);
        let b = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(SearchError::Io { path, source }),
        };
        let corrupt = |why: &str| SearchError::Corrupt {
            path: path.clone(),
            why: why.into(),
        };
        let at = b
            .windows(SUM_TAG.len())
            .rposition(|w| w == SUM_TAG)
            .ok_or_else(|| corrupt("no checksum"))?;
        let (body, tail) = (&b[..at], &b[at + SUM_TAG.len()..]);
        let want = format!("{:016x}", xxhash_rust::xxh3::xxh3_64(body));
        if tail.trim_ascii() != want.as_bytes() {
            return Err(corrupt("checksum mismatch"));
        }
        let s: PrecisionSearch =
            serde_json::from_slice(body).map_err(|e| corrupt(&e.to_string()))?;
        if s.model_id != model_id {
            return Err(corrupt("made for another model"));
        }
        Ok(Some(s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints() {
        assert_eq!("fp16".parse::<Precision>().unwrap(), Precision::FP16);
        assert_eq!(
            "25/25/50".parse::<Precision>().unwrap(),
            Precision([25, 25, 50])
        );
        assert_eq!(Precision([25, 25, 50]).to_string(), "25/25/50");
        assert_eq!(Precision::FP16.to_string(), "fp16");
        for bad in ["25/25", "50/50/50", "a/b/c", "", "25/-25/100"] {
            assert!(bad.parse::<Precision>().is_err(), "{bad}");
        }
    }

    #[test]
    fn counts_follow_the_cumulative_shares() {
        let p = Precision([25, 25, 50]);
        assert_eq!(p.counts(8), [2, 2, 4]);
        assert_eq!(p.counts(0), [0, 0, 0]);
        assert_eq!(Precision([0, 100, 0]).counts(7), [0, 7, 0]);
        assert_eq!(Precision([50, 0, 50]).counts(5), [3, 0, 2]);
        assert!(Precision::search_grid().contains(&Precision([25, 25, 50])));
        assert!(Precision::search_grid().contains(&Precision::FP16));
    }

    #[test]
    fn a_saved_search_loads_back_and_damage_is_caught() {
        let dir = tempfile::tempdir().unwrap();
        let p = |a, b, c, ppl| PrecisionScore {
            precision: Precision([a, b, c]),
            ppl,
            ppl_std_err: 0.1,
            ratio: ppl / 10.0,
            neuron_bytes: 1.0,
        };
        let s = PrecisionSearch {
            model_id: "m".into(),
            sparsity: "oracle".into(),
            target: 0.5,
            tolerance: 0.01,
            tokens_scored: 100,
            scores: vec![p(100, 0, 0, 10.0), p(25, 25, 50, 10.05), p(0, 0, 100, 10.5)],
        };
        assert_eq!(PrecisionSearch::load(dir.path(), "m").unwrap(), None);
        s.save(dir.path()).unwrap();
        assert_eq!(
            PrecisionSearch::load(dir.path(), "m").unwrap(),
            Some(s.clone())
        );
        assert_eq!(s.good(), vec![Precision::FP16, Precision([25, 25, 50])]);
        assert!(PrecisionSearch::load(dir.path(), "other").is_err());
        let path = PrecisionSearch::path_in(dir.path());
        let mut b = std::fs::read(&path).unwrap();
        b[10] ^= 1;
        std::fs::write(&path, &b).unwrap();
        assert!(PrecisionSearch::load(dir.path(), "m").is_err());
        assert_eq!("auto".parse(), Ok(NeuronPrecision::Auto));
        assert_eq!(
            "25/25/50".parse(),
            Ok(NeuronPrecision::Fixed(Precision([25, 25, 50])))
        );
    }
}
