//! The rates a plan prices by, and where they came from. `--hardware` names a profile; else the
//! profile `doctor --save` wrote; else this machine's rates measured at start — host memory
//! read, host→device copies, device memory read, and the product and attention rates — in a
//! second or so, then cached per machine and driver, so later starts read them. Only where the
//! measurement fails does a preset stand in, and that is said.
//!
//! Why measure rather than default: on an H100 with no saved profile the presets' rates
//! predicted 1.5 tok/s for a stream measured at 6.61 (and 4.5 for a split at 18.4).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use super::probe::{self as hw, AttentionProbe};
use crate::backend::cpu::CpuBackend;
use crate::plan::HardwareProfile;

/// Which device the rates are of: the GPU (CUDA device 0) or the budgeted CPU device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RatesDevice {
    Cuda,
    Sim,
}

/// Where a plan's rates came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RatesSource {
    /// `--hardware NAME_OR_FILE`.
    Given(String),
    /// The profile `doctor --save` wrote.
    Saved(PathBuf),
    /// Measured on this machine now, and cached at the path.
    Measured(PathBuf),
    /// Measured on this machine by an earlier start, read from the cache at the path.
    Cached(PathBuf),
    /// A preset, because the measurement failed (why).
    Preset { name: String, why: String },
}

impl std::fmt::Display for RatesSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RatesSource::Given(h) => write!(f, "--hardware {h}"),
            RatesSource::Saved(p) => write!(f, "saved by `doctor --save` ({})", p.display()),
            RatesSource::Measured(p) => {
                write!(
                    f,
                    "measured on this machine at start, cached in {}",
                    p.display()
                )
            }
            RatesSource::Cached(p) => write!(
                f,
                "measured on this machine by an earlier start, cached in {}",
                p.display()
            ),
            RatesSource::Preset { name, why } => {
                write!(f, "preset {name}: measuring this machine failed ({why})")
            }
        }
    }
}

/// The profile a plan for `device` prices by: `hardware` (a preset or file) where given, else
/// the saved profile, else this machine's measured rates (cached; `default` is the preset their
/// unmeasured figures come from, and what stands in if measuring fails). The profile's
/// `rates_source` says which.
pub fn planner_profile(
    hardware: Option<&str>,
    device: RatesDevice,
    default: &str,
    threads: usize,
) -> Result<HardwareProfile> {
    let (mut p, source) = match hardware {
        Some(h) => (
            HardwareProfile::load(h).map_err(anyhow::Error::msg)?,
            RatesSource::Given(h.to_string()),
        ),
        None => {
            let saved = HardwareProfile::saved_path();
            if saved.exists() {
                (
                    HardwareProfile::load(&saved.to_string_lossy()).map_err(anyhow::Error::msg)?,
                    RatesSource::Saved(saved),
                )
            } else {
                let base = HardwareProfile::load(default).map_err(anyhow::Error::msg)?;
                match cached_or_measured(device, &base, threads) {
                    Ok(found) => found,
                    Err(e) => {
                        tracing::warn!(
                            "measuring this machine's rates failed ({e:#}): the plan prices by preset {default}"
                        );
                        (
                            base,
                            RatesSource::Preset {
                                name: default.to_string(),
                                why: format!("{e:#}"),
                            },
                        )
                    }
                }
            }
        }
    };
    tracing::info!("rates: {source}");
    p.rates_source = Some(source.to_string());
    Ok(p)
}

/// What a cache entry is valid for: the same machine, driver, threads and build.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct CacheKey {
    device: String,
    cpu_model: String,
    logical_cores: usize,
    threads: usize,
    /// The GPU's name and the driver's version (CUDA only).
    gpu: Option<String>,
    driver: Option<String>,
    build: String,
    /// [`PROBES`] when measured (0 before it was kept).
    #[serde(default)]
    probes: u32,
}

/// What the probes measure, numbered: a cache of other probes is measured again. 2: the op
/// overhead timed inside the backend's pool (it had been 21 µs a step's op on the budgeted
/// device, where the step pays about 1), and the CPU's read starts.
const PROBES: u32 = 2;

/// A cache file: the key, the measured profile, and a checksum of both.
#[derive(Serialize, Deserialize)]
struct CacheEntry {
    key: CacheKey,
    profile: HardwareProfile,
    checksum: u64,
}

fn checksum(key: &CacheKey, profile: &HardwareProfile) -> Result<u64> {
    let bytes = serde_json::to_vec(&(key, profile))?;
    Ok(xxhash_rust::xxh3::xxh3_64(&bytes))
}

fn cache_key(device: RatesDevice, threads: usize) -> CacheKey {
    let (gpu, driver) = match device {
        RatesDevice::Cuda => gpu_identity(),
        RatesDevice::Sim => (None, None),
    };
    CacheKey {
        device: format!("{device:?}").to_lowercase(),
        cpu_model: hw::cpu_model(),
        logical_cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        threads,
        gpu,
        driver,
        build: env!("CARGO_PKG_VERSION").to_string(),
        probes: PROBES,
    }
}

/// GPU 0's name and the driver's version, from NVML (both `None` without one).
fn gpu_identity() -> (Option<String>, Option<String>) {
    let Ok(nvml) = nvml_wrapper::Nvml::init() else {
        return (None, None);
    };
    let name = nvml.device_by_index(0).ok().and_then(|d| d.name().ok());
    (name, nvml.sys_driver_version().ok())
}

/// The cache directory: beside the saved profile (`hardware.json`).
fn cache_dir() -> PathBuf {
    HardwareProfile::saved_path()
        .parent()
        .map_or_else(|| PathBuf::from("rates"), |p| p.join("rates"))
}

fn cache_path(key: &CacheKey) -> Result<PathBuf> {
    let id = xxhash_rust::xxh3::xxh3_64(&serde_json::to_vec(key)?);
    Ok(cache_dir().join(format!("{}-{id:016x}.json", key.device)))
}

/// The cached profile for `key` at `path`, if it is there, whole and for this key.
fn read_cache(path: &Path, key: &CacheKey) -> Option<HardwareProfile> {
    let text = std::fs::read_to_string(path).ok()?;
    let entry: CacheEntry = match serde_json::from_str(&text) {
        Ok(e) => e,
        Err(e) => {
            tracing::warn!(
                "{}: not a rates cache ({e}); measuring again",
                path.display()
            );
            return None;
        }
    };
    let sound = entry.key == *key
        && checksum(&entry.key, &entry.profile).ok() == Some(entry.checksum)
        && entry.profile.validate().is_ok();
    if !sound {
        tracing::warn!(
            "{}: stale or damaged rates cache; measuring again",
            path.display()
        );
        return None;
    }
    Some(entry.profile)
}

fn cached_or_measured(
    device: RatesDevice,
    base: &HardwareProfile,
    threads: usize,
) -> Result<(HardwareProfile, RatesSource)> {
    let threads = effective_threads(threads);
    let key = cache_key(device, threads);
    let path = cache_path(&key)?;
    if let Some(p) = read_cache(&path, &key) {
        return Ok((p, RatesSource::Cached(path)));
    }
    tracing::info!("measuring this machine's rates for the plan (once; then cached)…");
    let profile = measure(device, base, threads)?;
    let entry = CacheEntry {
        checksum: checksum(&key, &profile)?,
        key,
        profile,
    };
    // A cache that cannot be written costs the next start a measurement, nothing more.
    let written = std::fs::create_dir_all(cache_dir())
        .map_err(anyhow::Error::from)
        .and_then(|()| {
            crate::fsutil::write_atomic(&path, serde_json::to_string_pretty(&entry)?.as_bytes())
                .with_context(|| format!("cannot write {}", path.display()))
        });
    if let Err(e) = written {
        tracing::warn!("rates cache not written: {e:#}");
    }
    Ok((entry.profile, RatesSource::Measured(path)))
}

/// The thread count the CPU's probes run with: `threads`, or every core where 0.
fn effective_threads(threads: usize) -> usize {
    match threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        t => t,
    }
}

/// Host memory read and copy probes: far beyond any cache, a fraction of a second.
const PROBE_BYTES: usize = 128 << 20;

/// The CPU's prompt attention at a start: `doctor`'s shape (7B heads over an f16 cache) with
/// half its rows and positions (a few tenths of a second on two cores).
const QUICK_PROMPT_CPU: AttentionProbe = AttentionProbe {
    rows: 32,
    context: 992,
    ..AttentionProbe::PROMPT_CPU
};

/// `base` with this machine's rates measured on `device`: what the plan's cost model divides
/// by. The SSD rate stays `base`'s (measuring it means writing a file where the store lives).
pub fn measure(
    device: RatesDevice,
    base: &HardwareProfile,
    threads: usize,
) -> Result<HardwareProfile> {
    let dram = hw::dram_read_bandwidth(threads, PROBE_BYTES, 3);
    let cpu = CpuBackend::new(threads)?;
    // `doctor`'s probes, each timed fewer times (a start pays for these once per machine).
    let decode = AttentionProbe::DECODE_7B;
    let cpu_attention = decode.seconds(&cpu, 1).ok().map(|s| decode.kv_bytes() / s);
    let cpu_read_start = hw::cpu_read_start_s(&cpu, PROBE_BYTES, dram).ok();
    let p = match device {
        RatesDevice::Cuda => {
            let g = hw::probe_gpu(64 << 20).map_err(anyhow::Error::msg)?;
            HardwareProfile {
                name: format!("{} (measured)", g.name),
                hbm_bytes_per_s: g.hbm_read_bytes_per_s,
                h2d_pinned_bytes_per_s: g.h2d_pinned_bytes_per_s,
                h2d_pageable_bytes_per_s: g.h2d_pageable_bytes_per_s,
                dram_read_bytes_per_s: dram,
                device_bytes: g.total_bytes,
                device_fixed_bytes: g.fixed_bytes.or(base.device_fixed_bytes),
                matmul_flops_per_s: g.matmul_flops_per_s,
                cpu_attention_bytes_per_s: cpu_attention,
                cpu_read_start_s: cpu_read_start,
                attention_flops_per_s: Some(g.attention_flops_per_s),
                copies_share_memory: false,
                ..base.clone()
            }
        }
        // The budgeted device: its "device memory" is host memory, its copies one memcpy
        // thread, its products and attention the CPU's.
        RatesDevice::Sim => {
            let memcpy = hw::memcpy_bandwidth(PROBE_BYTES, 3);
            HardwareProfile {
                name: "cpu-sim (measured)".into(),
                hbm_bytes_per_s: dram,
                h2d_pinned_bytes_per_s: memcpy,
                h2d_pageable_bytes_per_s: memcpy,
                dram_read_bytes_per_s: dram,
                matmul_flops_per_s: hw::matmul_rate(&cpu, 128, 1024, 1024)
                    .map_err(anyhow::Error::msg)?,
                cpu_attention_bytes_per_s: cpu_attention,
                cpu_read_start_s: cpu_read_start,
                attention_flops_per_s: Some(
                    QUICK_PROMPT_CPU
                        .flops_per_s(&cpu)
                        .map_err(anyhow::Error::msg)?,
                ),
                copies_share_memory: true,
                op_overhead_s: hw::op_overhead_s(&cpu).map_err(anyhow::Error::msg)?,
                ..base.clone()
            }
        }
    };
    p.validate()
        .map_err(|m| anyhow::anyhow!("measured rates: {m}"))?;
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> CacheKey {
        cache_key(RatesDevice::Sim, 2)
    }

    #[test]
    fn a_cache_is_read_only_for_its_key_and_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sim.json");
        let profile = HardwareProfile::load("cpu-sim").unwrap();
        let k = key();
        let entry = CacheEntry {
            checksum: checksum(&k, &profile).unwrap(),
            key: k.clone(),
            profile: profile.clone(),
        };
        std::fs::write(&path, serde_json::to_string(&entry).unwrap()).unwrap();
        assert_eq!(read_cache(&path, &k), Some(profile.clone()));
        // Another machine's (or driver's, or thread count's) rates are not ours.
        let other = CacheKey {
            threads: 3,
            ..k.clone()
        };
        assert_eq!(read_cache(&path, &other), None);
        // Rates of earlier probes (a file from before their number was kept has none) are
        // measured again.
        let mut older = serde_json::to_value(&entry).unwrap();
        older["key"].as_object_mut().unwrap().remove("probes");
        older["checksum"] = serde_json::json!(
            checksum(
                &CacheKey {
                    probes: 0,
                    ..k.clone()
                },
                &profile
            )
            .unwrap()
        );
        std::fs::write(&path, older.to_string()).unwrap();
        assert_eq!(read_cache(&path, &k), None);
        std::fs::write(&path, serde_json::to_string(&entry).unwrap()).unwrap();
        // A damaged figure fails the checksum.
        let mut bad = entry;
        bad.profile.dram_read_bytes_per_s *= 2.0;
        std::fs::write(&path, serde_json::to_string(&bad).unwrap()).unwrap();
        assert_eq!(read_cache(&path, &k), None);
        // Not JSON at all.
        std::fs::write(&path, b"{ half a file").unwrap();
        assert_eq!(read_cache(&path, &k), None);
    }

    #[test]
    fn sources_say_where_the_rates_came_from() {
        let p = PathBuf::from("/c/rates/sim.json");
        assert!(
            RatesSource::Measured(p.clone())
                .to_string()
                .contains("measured on this machine at start")
        );
        assert!(
            RatesSource::Cached(p)
                .to_string()
                .contains("by an earlier start")
        );
        assert!(
            RatesSource::Preset {
                name: "gpu-4g".into(),
                why: "no GPU".into()
            }
            .to_string()
            .contains("preset gpu-4g")
        );
    }
}
