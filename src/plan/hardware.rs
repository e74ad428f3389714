//! Hardware profiles: the bandwidths the cost model divides by. Measured by `gpu-offload
//! doctor --save` or taken from a preset in `configs/` (consumer GPUs, the budgeted CPU device).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HardwareProfile {
    pub name: String,
    /// Device memory read bandwidth, bytes/s.
    pub hbm_bytes_per_s: f64,
    /// Host→device copy bandwidth from pinned memory, bytes/s.
    pub h2d_pinned_bytes_per_s: f64,
    /// Host→device copy bandwidth from pageable memory, bytes/s.
    pub h2d_pageable_bytes_per_s: f64,
    /// Host memory read bandwidth (CPU threads), bytes/s.
    pub dram_read_bytes_per_s: f64,
    /// SSD sequential read bandwidth with direct I/O, bytes/s.
    pub ssd_read_bytes_per_s: f64,
    /// Fixed cost of one device op (kernel launch and its wait), seconds.
    pub op_overhead_s: f64,
    /// Device memory size, bytes (0 when unknown).
    #[serde(default)]
    pub device_bytes: u64,
    /// Device memory a process holds before it places anything: the CUDA context, our kernel
    /// modules, cuBLAS and its workspace (measured by `doctor`). `--gpu-mem` bounds the whole
    /// process, so the planner takes this off the budget first. `None`: not measured, and
    /// [`DEFAULT_DEVICE_FIXED_BYTES`] is assumed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_fixed_bytes: Option<u64>,
    /// Rate of the device's large matrix products (prefill GEMMs, f16 in, f32 accumulation),
    /// FLOP/s: the compute bound of a prefill's time to first token.
    #[serde(default = "default_matmul_flops")]
    pub matmul_flops_per_s: f64,
    /// Bytes of KV cache the CPU attends per second (`doctor` measures a decode step's
    /// attention over 4000 positions of an f16 cache): the rate of a decode step's attention
    /// over a cache kept in host memory. `None`: not measured, and the DRAM read rate is taken
    /// (the most it could be).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_attention_bytes_per_s: Option<f64>,
    /// Rate of a prompt's causal attention on the device, FLOP/s (`doctor` measures a row group
    /// of 512 rows over 8192 positions of an f16 cache with 7B heads on a GPU, the product of
    /// two 64-row tiles at a time where cuBLAS takes whole matrices). `None`: not measured,
    /// and the matrix-product rate is taken (the most it could be).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_flops_per_s: Option<f64>,
    /// Seconds the CPU's neuron-sparse pass spends on each read (an active neuron's up or
    /// down row, a matrix's block: a short run of bytes at a scattered place) beyond its bytes
    /// at the DRAM read rate: the start of each, which neither the prefetchers nor the
    /// kernels' own prefetches hide. `doctor` measures it on hybrid's cold pass over gated f16
    /// neurons beyond the last-level cache (two cores of an EPYC CI machine: 55–100 ns a read,
    /// where a read of SmolLM2's 1152 bytes takes 37 ns at the DRAM rate). `None`: not
    /// measured, and a read costs only its bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_read_start_s: Option<f64>,
    /// Whether the device's copies and its reads draw on one memory, so a token's copies and
    /// its device reads take turns rather than overlap: the budgeted CPU device, whose memcpy
    /// and kernels share host memory (a third of SmolLM2 on it: the overlapped figure predicted
    /// 57 tok/s where 29–34 ran; their sum, 34). A GPU's copy engine and HBM are apart.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub copies_share_memory: bool,
    /// Where these rates came from (`--hardware`, the saved profile, measured at start or read
    /// from the cache of an earlier measurement, a preset): said by `plan` and in its JSON.
    /// `None` for a profile as loaded, before a run chose it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rates_source: Option<String>,
}

/// What a profile that does not state its matrix-product rate is assumed to reach.
pub const DEFAULT_MATMUL_FLOPS: f64 = 50e12;

fn default_matmul_flops() -> f64 {
    DEFAULT_MATMUL_FLOPS
}

/// What a profile that does not state its fixed device cost is assumed to have: above the 626 MiB
/// an H100 (132 SMs, whose per-SM context reservations are among the largest) was seen to hold
/// with our modules and cuBLAS by its process entry. By the device's used memory the same H100
/// took ~1.21 GiB ([`crate::footprint::fixed`]); a run on a GPU measures that figure and plans
/// after it, so this default only prices plans made without the card (a named preset).
pub const DEFAULT_DEVICE_FIXED_BYTES: u64 = 768 << 20;

const GB: f64 = 1e9;

/// The built-in presets (also in configs/ as JSON).
pub fn presets() -> Vec<HardwareProfile> {
    let p = |name: &str,
             hbm: f64,
             h2d: f64,
             pageable: f64,
             dram: f64,
             ssd: f64,
             op: f64,
             mem_gib: u64,
             fixed: Option<u64>,
             tflops: f64| HardwareProfile {
        name: name.into(),
        hbm_bytes_per_s: hbm * GB,
        h2d_pinned_bytes_per_s: h2d * GB,
        h2d_pageable_bytes_per_s: pageable * GB,
        dram_read_bytes_per_s: dram * GB,
        ssd_read_bytes_per_s: ssd * GB,
        op_overhead_s: op,
        device_bytes: mem_gib << 30,
        device_fixed_bytes: fixed,
        matmul_flops_per_s: tflops * 1e12,
        cpu_attention_bytes_per_s: None,
        attention_flops_per_s: None,
        cpu_read_start_s: None,
        copies_share_memory: false,
        rates_source: None,
    };
    vec![
        // Consumer cards: fixed cost not measured here, so the conservative default applies.
        // Matrix-product rates: f16 tensor cores with f32 accumulation, dense, at about 70% of
        // the data sheet's peak (what cuBLAS reaches on large GEMMs).
        p(
            "rtx4090-24g",
            1008.0,
            25.0,
            12.0,
            60.0,
            6.0,
            4e-6,
            24,
            None,
            115.0,
        ),
        p(
            "rtx3060-12g",
            360.0,
            12.5,
            8.0,
            40.0,
            3.0,
            5e-6,
            12,
            None,
            18.0,
        ),
        p("gpu-4g", 200.0, 12.5, 8.0, 30.0, 2.0, 5e-6, 4, None, 20.0),
        p(
            "h100-80g", 3350.0, 50.0, 20.0, 200.0, 6.0, 3e-6, 80, None, 530.0,
        ),
        // The budgeted CPU device: copies are memcpy, "HBM" is host memory, and there is no
        // context to pay for (emulate a card with --hardware or --emulate to include one); its
        // products run on two CPU cores.
        HardwareProfile {
            copies_share_memory: true,
            ..p(
                "cpu-sim",
                20.0,
                10.0,
                10.0,
                20.0,
                1.0,
                2e-6,
                0,
                Some(0),
                0.05,
            )
        },
    ]
}

impl HardwareProfile {
    /// A preset by name, or a JSON profile file (as `doctor --save` writes).
    pub fn load(name_or_path: &str) -> Result<Self, String> {
        if let Some(p) = presets().into_iter().find(|p| p.name == name_or_path) {
            return Ok(p);
        }
        let path = Path::new(name_or_path);
        let text = std::fs::read_to_string(path).map_err(|e| {
            let names: Vec<String> = presets().into_iter().map(|p| p.name).collect();
            format!(
                "`{name_or_path}` is neither a preset ({}) nor a readable profile file: {e}",
                names.join(", ")
            )
        })?;
        let p: HardwareProfile = serde_json::from_str(&text)
            .map_err(|e| format!("{}: not a hardware profile: {e}", path.display()))?;
        p.validate()
            .map_err(|m| format!("{}: {m}", path.display()))?;
        Ok(p)
    }

    /// This machine (`self`) running as `card` does under `--emulate`: the card's memory size,
    /// fixed cost and host→device rate (what emulation caps and paces); device-memory,
    /// host-memory and SSD rates stay this machine's, since nothing slows those down.
    pub fn emulating(&self, card: &HardwareProfile) -> HardwareProfile {
        HardwareProfile {
            name: format!("{} (emulated on {})", card.name, self.name),
            h2d_pinned_bytes_per_s: card.h2d_pinned_bytes_per_s,
            h2d_pageable_bytes_per_s: card
                .h2d_pageable_bytes_per_s
                .min(card.h2d_pinned_bytes_per_s),
            device_bytes: card.device_bytes,
            device_fixed_bytes: card.device_fixed_bytes,
            ..self.clone()
        }
    }

    /// Bytes of KV cache the CPU attends per second (measured, or the DRAM read rate).
    pub fn cpu_attention_rate(&self) -> f64 {
        self.cpu_attention_bytes_per_s
            .unwrap_or(self.dram_read_bytes_per_s)
    }

    /// Seconds the CPU's neuron-sparse pass takes to read `bytes` in `reads` reads: the bytes
    /// at the DRAM read rate and each read's start ([`Self::cpu_read_start_s`]).
    pub fn cpu_sparse_seconds(&self, bytes: f64, reads: f64) -> f64 {
        bytes / self.dram_read_bytes_per_s + reads * self.cpu_read_start_s.unwrap_or(0.0)
    }

    /// Seconds two parts of a step's work take together: the longer where a GPU runs one
    /// beside the other, their sum where they take turns (the budgeted device, whose kernels,
    /// copies and CPU share one memory and one CPU: [`Self::copies_share_memory`]).
    pub fn together_s(&self, a: f64, b: f64) -> f64 {
        if self.copies_share_memory {
            a + b
        } else {
            a.max(b)
        }
    }

    /// FLOP/s of a prompt's attention on the device (measured, or the matrix-product rate).
    pub fn attention_rate(&self) -> f64 {
        self.attention_flops_per_s
            .unwrap_or(self.matmul_flops_per_s)
    }

    /// Device bytes a process holds before placing anything (measured, or the default).
    pub fn fixed_device_bytes(&self) -> u64 {
        self.device_fixed_bytes
            .unwrap_or(DEFAULT_DEVICE_FIXED_BYTES)
    }

    pub fn validate(&self) -> Result<(), String> {
        for (what, v) in [
            ("hbm_bytes_per_s", self.hbm_bytes_per_s),
            ("h2d_pinned_bytes_per_s", self.h2d_pinned_bytes_per_s),
            ("h2d_pageable_bytes_per_s", self.h2d_pageable_bytes_per_s),
            ("dram_read_bytes_per_s", self.dram_read_bytes_per_s),
            ("ssd_read_bytes_per_s", self.ssd_read_bytes_per_s),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!("{what} must be positive, is {v}"));
            }
        }
        if !(self.matmul_flops_per_s.is_finite() && self.matmul_flops_per_s > 0.0) {
            return Err(format!(
                "matmul_flops_per_s must be positive, is {}",
                self.matmul_flops_per_s
            ));
        }
        for (what, v) in [
            ("cpu_attention_bytes_per_s", self.cpu_attention_bytes_per_s),
            ("attention_flops_per_s", self.attention_flops_per_s),
        ] {
            if let Some(v) = v
                && !(v.is_finite() && v > 0.0)
            {
                return Err(format!("{what} must be positive, is {v}"));
            }
        }
        if !(self.op_overhead_s.is_finite() && self.op_overhead_s >= 0.0) {
            return Err("op_overhead_s must be ≥ 0".into());
        }
        if let Some(v) = self.cpu_read_start_s
            && !(v.is_finite() && v >= 0.0)
        {
            return Err(format!("cpu_read_start_s must be ≥ 0, is {v}"));
        }
        Ok(())
    }

    /// Where `doctor --save` writes the measured profile and the planner looks first.
    pub fn saved_path() -> PathBuf {
        crate::model::models_dir().parent().map_or_else(
            || PathBuf::from("hardware.json"),
            |p| p.join("hardware.json"),
        )
    }

    /// The saved measured profile if there is one, else the named default preset.
    pub fn saved_or(default: &str) -> Result<Self, String> {
        let saved = Self::saved_path();
        if saved.exists() {
            return Self::load(&saved.to_string_lossy());
        }
        Self::load(default)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_are_valid_and_match_configs() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
        for p in presets() {
            p.validate().unwrap();
            let file = dir.join(format!("{}.json", p.name));
            let on_disk = HardwareProfile::load(&file.to_string_lossy()).unwrap();
            assert_eq!(on_disk, p, "{} differs from the preset", file.display());
        }
        assert!(
            HardwareProfile::load("no-such-gpu")
                .unwrap_err()
                .contains("rtx4090-24g")
        );
    }
}
