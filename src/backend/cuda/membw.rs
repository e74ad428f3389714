//! Measuring and pacing the device's memory traffic (kernels/membw.cu): the device-memory read
//! bandwidth, and host→device copies held to an emulated link's rate (`--emulate`) by a stamp
//! kernel before each copy and a wait kernel after it.

use std::sync::Arc;

use cudarc::driver::CudaStream;

use super::args::{cfg, ptr_of};
use super::device::{CudaBackend, dev};
use super::launches;
use crate::backend::{BackendError, Result, check_pace_rate};

impl CudaBackend {
    /// Device-memory read bandwidth, bytes/s: the `read_sum` kernel over a `bytes` buffer (far
    /// beyond the caches), best of 5 timed with events. The HBM bound's denominator.
    pub fn read_bandwidth(&self, bytes: usize) -> Result<f64> {
        self.bind()?;
        let n4 = (bytes / 16).max(1);
        let blocks_n = 4 * self.info()?.multiprocessors.max(1) as u32;
        // Outside the ledger: a measurement, not a placement.
        let x = self.compute.alloc_zeros::<u8>(n4 * 16).map_err(dev)?;
        let out = self
            .compute
            .alloc_zeros::<f32>(blocks_n as usize)
            .map_err(dev)?;
        let (xp, op, n) = (
            ptr_of(&x, &self.compute),
            ptr_of(&out, &self.compute),
            n4 as i64,
        );
        let mut best = f64::MAX;
        for rep in 0..6 {
            let start = self
                .compute
                .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(dev)?;
            launches::read_sum(self.launch(cfg(blocks_n, 256)), xp, n, op)?;
            let end = self
                .compute
                .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(dev)?;
            end.synchronize().map_err(dev)?;
            // The first run warms up (module, clocks): leave it out.
            if rep > 0 {
                best = best.min(start.elapsed_ms(&end).map_err(dev)? as f64 / 1e3);
            }
        }
        Ok((n4 * 16) as f64 / best)
    }

    /// Launch the stamp before a host→device copy on `stream` when pacing (the `pace` rate,
    /// `--emulate`); returns the wait to launch after it.
    pub(super) fn pace_before(
        &self,
        stream: &Arc<CudaStream>,
        slot: u64,
    ) -> Result<Option<(f64, u64)>> {
        let pace = self
            .pace
            .lock()
            .map_err(|_| BackendError::Device("pacer poisoned".into()))?;
        let Some(rate) = *pace else {
            return Ok(None);
        };
        let stamp = ptr_of(&self.stamps, stream) + 8 * slot;
        launches::pace_stamp(self.launch_on(stream, cfg(1, 1)), stamp)?;
        Ok(Some((rate, stamp)))
    }

    pub(super) fn pace_after(
        &self,
        stream: &Arc<CudaStream>,
        paced: Option<(f64, u64)>,
        bytes: usize,
    ) -> Result<()> {
        if let Some((rate, stamp)) = paced {
            let ns = (bytes as f64 / rate * 1e9) as u64;
            launches::pace_wait(self.launch_on(stream, cfg(1, 1)), stamp, ns)?;
        }
        Ok(())
    }
}

pub(super) fn pace_copies(cuda: &CudaBackend, bytes_per_s: f64) -> Result<()> {
    cuda.outside("pace_copies")?;
    check_pace_rate(bytes_per_s)?;
    let mut pace = cuda
        .pace
        .lock()
        .map_err(|_| BackendError::Device("pacer poisoned".into()))?;
    *pace = Some(bytes_per_s);
    Ok(())
}
