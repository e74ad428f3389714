//! The CUDA device's clock for traces: timing events recorded on the compute and copy streams.

use std::sync::{Arc, Mutex};

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaStream};

use super::CudaBackend;
use super::device::dev;
use crate::backend::clock::DeviceClock;
use crate::backend::{BackendError, Result};

/// Timing events on one device's two streams, a pair per mark.
pub(super) struct CudaClock {
    compute: Arc<CudaStream>,
    copy: Arc<CudaStream>,
    marks: Mutex<Vec<[CudaEvent; 2]>>,
}

impl CudaClock {
    pub(super) fn of(cuda: &CudaBackend) -> Self {
        CudaClock {
            compute: cuda.compute.clone(),
            copy: cuda.copy.clone(),
            marks: Mutex::new(Vec::new()),
        }
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Vec<[CudaEvent; 2]>>> {
        self.marks
            .lock()
            .map_err(|_| BackendError::Device("the device clock's marks are poisoned".into()))
    }
}

impl DeviceClock for CudaClock {
    fn mark(&self) -> Result<usize> {
        // Timing events (the default flags: not CU_EVENT_DISABLE_TIMING).
        let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
        let compute = self.compute.record_event(flags).map_err(dev)?;
        let copy = self.copy.record_event(flags).map_err(dev)?;
        let mut marks = self.lock()?;
        marks.push([compute, copy]);
        Ok(marks.len() - 1)
    }

    fn take(&self) -> Result<Vec<[f64; 2]>> {
        let marks = std::mem::take(&mut *self.lock()?);
        let (Some(first), Some(last)) = (marks.first(), marks.last()) else {
            return Ok(Vec::new());
        };
        for e in last {
            e.synchronize().map_err(dev)?;
        }
        marks
            .iter()
            .map(|m| {
                let s = |i: usize| -> Result<f64> {
                    Ok(first[i].elapsed_ms(&m[i]).map_err(dev)? as f64 / 1e3)
                };
                Ok([s(0)?, s(1)?])
            })
            .collect()
    }
}
