//! Device memory of this process as the driver sees it, through NVML, two ways: this process's
//! entry in the device's compute processes (or, where the process table does not show our pid —
//! a PID namespace — the device figure), and the device figure: the device's used memory (what
//! nvidia-smi's `memory.used` shows) less what was used before this process made its context.
//! The second counts what the driver takes for our context without showing it by pid
//! ([`crate::footprint::fixed`]). Nothing here panics without a GPU: every call is an `Option`.

use nvml_wrapper::Nvml;
use nvml_wrapper::enums::device::UsedGpuMemory;

pub struct DeviceMeter {
    nvml: Nvml,
    uuid: String,
    /// Device memory in use before this process's context existed.
    baseline_used: u64,
    /// Other processes' device memory then, by the process table (`None`: unreadable).
    baseline_others: Option<u64>,
}

/// NVML's spelling of a CUDA device UUID: `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
fn uuid_string(bytes: &[u8; 16]) -> String {
    let h: Vec<String> = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        h[0..4].concat(),
        h[4..6].concat(),
        h[6..8].concat(),
        h[8..10].concat(),
        h[10..16].concat()
    )
}

impl DeviceMeter {
    /// Open NVML for CUDA device `ordinal` and note what is in use now. Call before creating the
    /// context, so the baseline excludes it.
    pub fn before_context(ordinal: usize) -> Option<Self> {
        use cudarc::driver::result;
        result::init().ok()?;
        let dev = result::device::get(ordinal as i32).ok()?;
        let raw = result::device::get_uuid(dev).ok()?;
        let bytes: [u8; 16] = raw.bytes.map(|b| b as u8);
        let uuid = uuid_string(&bytes);
        let nvml = Nvml::init().ok()?;
        let dev = nvml.device_by_uuid(uuid.as_str()).ok()?;
        let baseline_used = dev.memory_info().ok()?.used;
        let baseline_others = others_bytes(&dev, false);
        Some(DeviceMeter {
            nvml,
            uuid,
            baseline_used,
            baseline_others,
        })
    }

    /// Device bytes used now beyond what was used before this process's context: this
    /// process's memory as the card counts it, where nothing else moved.
    pub fn device_bytes(&self) -> Option<u64> {
        let dev = self.nvml.device_by_uuid(self.uuid.as_str()).ok()?;
        Some(
            dev.memory_info()
                .ok()?
                .used
                .saturating_sub(self.baseline_used),
        )
    }

    /// Whether another process's device memory differs from what it was before this
    /// process's context (by more than a 2 MiB page): then [`DeviceMeter::device_bytes`] is
    /// not ours alone. `false` where the process table cannot be read (nothing to tell by).
    pub fn others_moved(&self) -> bool {
        let Ok(dev) = self.nvml.device_by_uuid(self.uuid.as_str()) else {
            return false;
        };
        match (self.baseline_others, others_bytes(&dev, true)) {
            (Some(before), Some(now)) => before.abs_diff(now) > 2 << 20,
            _ => false,
        }
    }

    /// The driver's figures now, for the fixed cost
    /// ([`FixedCostReading`](crate::footprint::FixedCostReading)).
    pub fn reading(&self) -> crate::footprint::FixedCostReading {
        crate::footprint::FixedCostReading {
            process_bytes: self.process_bytes(),
            device_bytes: self.device_bytes(),
            shared: self.others_moved(),
        }
    }

    /// Device bytes this process holds now.
    pub fn process_bytes(&self) -> Option<u64> {
        let dev = self.nvml.device_by_uuid(self.uuid.as_str()).ok()?;
        let pid = std::process::id();
        if let Ok(procs) = dev.running_compute_processes()
            && let Some(p) = procs.iter().find(|p| p.pid == pid)
            && let UsedGpuMemory::Used(b) = p.used_gpu_memory
        {
            return Some(b);
        }
        let used = dev.memory_info().ok()?.used;
        Some(used.saturating_sub(self.baseline_used))
    }
}

/// Device bytes of every compute process other than this one, by the process table; `None`
/// where it cannot be read, or where this process has a context (`with_context`) and the table
/// does not show it (a PID namespace: the pids there are not ours to compare).
fn others_bytes(dev: &nvml_wrapper::Device, with_context: bool) -> Option<u64> {
    let pid = std::process::id();
    let procs = dev.running_compute_processes().ok()?;
    if with_context && !procs.iter().any(|p| p.pid == pid) {
        return None;
    }
    Some(
        procs
            .iter()
            .filter(|p| p.pid != pid)
            .map(|p| match p.used_gpu_memory {
                UsedGpuMemory::Used(b) => b,
                UsedGpuMemory::Unavailable => 0,
            })
            .sum(),
    )
}

#[cfg(test)]
mod tests {
    use super::uuid_string;

    #[test]
    fn uuids_are_spelled_as_nvml_does() {
        let b: [u8; 16] = core::array::from_fn(|i| (i * 17) as u8);
        assert_eq!(uuid_string(&b), "GPU-00112233-4455-6677-8899-aabbccddeeff");
    }
}
