//! Recorded steps as CUDA graphs: the compute stream captured while a step's ops are issued,
//! instantiated once and launched at each replay, with the step's position read from one word
//! of device memory ([`CudaBackend::position_at`]) so the graph replays at any position. What a
//! recorded step may hold is decided in [`crate::backend::recording`], for the budgeted device
//! too.

use super::device::{CudaBackend, dev};
use crate::backend::recording::{position_unset, step_position_word};
use crate::backend::{BackendError, Result, STEP_POSITION_BYTES};

/// A recorded step: a CUDA graph, instantiated, and how many operations (nodes) it holds.
pub struct CudaRecording {
    graph: cudarc::driver::CudaGraph,
    nodes: u64,
    /// What the recorded ops counted of the device's memory read: a replay reads it again (its
    /// attention over the recording step's positions, a few KB a position short of a later
    /// step's).
    device_reads: u64,
}

// SAFETY: a graph needs its calls serialised, not a thread of its own (CUDA's graph thread-safety
// rules); the engine launches a session's recording under its pass lock, one thread at a time.
unsafe impl Send for CudaRecording {}

impl CudaBackend {
    /// The step position's buffer: set (what a recording reads), else an error.
    fn step_position_ptr(&self) -> Result<u64> {
        let at = self
            .step_position
            .lock()
            .map_err(|_| BackendError::Device("step position poisoned".into()))?;
        at.as_ref().map(|b| b.ptr).ok_or_else(position_unset)
    }

    /// While recording, the device address of the step's position (the kernels read it there
    /// at each replay); else 0, and the kernels take the position they are given.
    pub(super) fn position_at(&self) -> Result<u64> {
        if !self.recording() {
            return Ok(0);
        }
        self.step_position_ptr()
    }
}

pub(super) fn set_step_position(cuda: &CudaBackend, first_pos: usize) -> Result<()> {
    cuda.outside("set_step_position")?;
    let word = step_position_word(first_pos)?;
    let mut at = cuda
        .step_position
        .lock()
        .map_err(|_| BackendError::Device("step position poisoned".into()))?;
    let buf = match &mut *at {
        Some(buf) => buf,
        slot => slot.insert(cuda.take(STEP_POSITION_BYTES, "recorded step position")?),
    };
    cuda.bind()?;
    // SAFETY: the buffer holds the word. From pageable memory the driver stages it before
    // returning; ordered on compute, so the step queued before this has read the last one.
    unsafe {
        cudarc::driver::result::memcpy_htod_async(buf.ptr, &[word], cuda.compute.cu_stream())
    }
    .map_err(dev)?;
    cuda.ledger().count_h2d(STEP_POSITION_BYTES as u64);
    Ok(())
}

pub(super) fn record<E: From<BackendError>>(
    cuda: &CudaBackend,
    ops: impl FnOnce() -> std::result::Result<(), E>,
) -> std::result::Result<CudaRecording, E> {
    cuda.outside("record")?;
    cuda.step_position_ptr()?;
    cuda.bind()?;
    // Thread-local: only this thread's calls are checked against the capture (a read-ahead
    // thread copying on the other stream goes on).
    cuda.compute
        .begin_capture(
            cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        )
        .map_err(dev)?;
    cuda.recording
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let reads_before = cuda.ledger().snapshot().device_read_bytes;
    let ran = ops();
    cuda.recording
        .store(false, std::sync::atomic::Ordering::SeqCst);
    // Always ended, so the stream leaves capture mode whatever the ops did.
    let graph = cuda
        .compute
        .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0));
    ran?;
    let graph = graph
        .map_err(dev)?
        .ok_or_else(|| BackendError::Device("a recorded step holds no work".into()))?;
    let mut nodes = 0usize;
    // SAFETY: a null node array asks only for the count, written to `nodes`.
    let r = unsafe {
        cudarc::driver::sys::cuGraphGetNodes(graph.cu_graph(), std::ptr::null_mut(), &mut nodes)
    };
    if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
        return Err(BackendError::Device(format!("cuGraphGetNodes: {r:?}")).into());
    }
    // Captured work does not run (the operations counted while capturing stand for this
    // run): this step runs now, as its replays will.
    graph.launch().map_err(dev)?;
    Ok(CudaRecording {
        graph,
        nodes: nodes as u64,
        device_reads: cuda.ledger().snapshot().device_read_bytes - reads_before,
    })
}

pub(super) fn replay<E: From<BackendError>>(
    cuda: &CudaBackend,
    rec: &CudaRecording,
    _ops: impl FnOnce() -> std::result::Result<(), E>,
) -> std::result::Result<(), E> {
    cuda.outside("replay")?;
    cuda.step_position_ptr()?;
    rec.graph.launch().map_err(dev)?;
    cuda.device_ops
        .fetch_add(rec.nodes, std::sync::atomic::Ordering::Relaxed);
    cuda.ledger().count_device_read(rec.device_reads);
    Ok(())
}
