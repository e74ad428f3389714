//! Device memory of this process as the driver sees it (what nvidia-smi shows), through NVML:
//! this process's entry in the device's compute processes, or — where the process table does not
//! show our pid (a PID namespace) — the device's used memory less what was used before this
//! process made its context. Nothing here panics without a GPU: every call is an `Option`.

use nvml_wrapper::Nvml;
use nvml_wrapper::enums::device::UsedGpuMemory;

pub struct DeviceMeter {
    nvml: Nvml,
    uuid: String,
    /// Device memory in use before this process's context existed.
    baseline_used: u64,
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
        let baseline_used = nvml
            .device_by_uuid(uuid.as_str())
            .ok()?
            .memory_info()
            .ok()?
            .used;
        Some(DeviceMeter {
            nvml,
            uuid,
            baseline_used,
        })
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

#[cfg(test)]
mod tests {
    use super::uuid_string;

    #[test]
    fn uuids_are_spelled_as_nvml_does() {
        let b: [u8; 16] = core::array::from_fn(|i| (i * 17) as u8);
        assert_eq!(uuid_string(&b), "GPU-00112233-4455-6677-8899-aabbccddeeff");
    }
}
