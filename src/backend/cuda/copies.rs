//! Copies between host and device, and what orders them: weight uploads (on the copy stream,
//! paced under `--emulate`), activations written and read back (queued into page-locked stages
//! or waited for), copies of rows within the device, the events that order the two streams and
//! the host, and page-locked host ranges ([`PinnedRegion`]).

use cudarc::driver::CudaEvent;

use super::device::{CudaBackend, dev};
use super::types::{CudaTensor, CudaWeight, PinnedRegion, shape_err};
use crate::backend::{Backend, BackendError, BundleShape, HostPin, Result};
use crate::store::Encoding;
use crate::tensor::{Bytes, HostTensor};

impl CudaBackend {
    /// Page-lock `len` bytes at `ptr` so copies from them are truly asynchronous; the returned
    /// guard unlocks them when dropped (drop it before freeing the memory).
    pub fn pin_host(&self, ptr: *const u8, len: usize) -> Result<PinnedRegion> {
        self.ctx.bind_to_thread().map_err(dev)?;
        // SAFETY: registers an existing host range; the caller keeps it alive while the guard is.
        let r = unsafe { cudarc::driver::sys::cuMemHostRegister_v2(ptr as *mut _, len, 0) };
        if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
            return Err(BackendError::Device(format!(
                "cuMemHostRegister of {len} bytes: {r:?}"
            )));
        }
        Ok(PinnedRegion { ptr: ptr as usize })
    }
}

/// `data` (whole bundles, a page-aligned buffer of its own) page-locked and mapped, as a
/// bundle weight whose kernels read it in place over the link.
pub(super) fn map_bundles(
    cuda: &CudaBackend,
    name: &str,
    enc: Encoding,
    shape: BundleShape,
    data: &Bytes,
) -> Result<CudaWeight> {
    cuda.outside("map_bundles")?;
    crate::backend::check_mappable(name, data)?;
    let rows = crate::backend::bundle_rows(name, enc, shape, data.len())?;
    let Bytes::Aligned { buf, range } = data else {
        return Err(BackendError::Device(format!(
            "`{name}` is not page-aligned"
        )));
    };
    cuda.bind()?;
    let base = buf.as_slice().as_ptr();
    let flags = cudarc::driver::sys::CU_MEMHOSTREGISTER_DEVICEMAP;
    // SAFETY: registers the buffer's own whole pages; `MappedHost` keeps the buffer alive and
    // unregisters it first.
    let r =
        unsafe { cudarc::driver::sys::cuMemHostRegister_v2(base as *mut _, buf.capacity(), flags) };
    if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
        return Err(BackendError::Device(format!(
            "mapping `{name}` ({} bytes) for the device: cuMemHostRegister: {r:?}",
            buf.capacity()
        )));
    }
    let pin = PinnedRegion { ptr: base as usize };
    let mut device = 0u64;
    // SAFETY: `base` was just registered with DEVICEMAP.
    let r = unsafe {
        cudarc::driver::sys::cuMemHostGetDevicePointer_v2(&mut device, base as *mut _, 0)
    };
    if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
        return Err(BackendError::Device(format!(
            "the device address of `{name}`: cuMemHostGetDevicePointer: {r:?}"
        )));
    }
    let dbuf = super::types::DeviceBuf {
        ptr: device + range.start as u64,
        _pool: None,
        mem: cuda.mem.in_host(name)?,
    };
    let mut w = super::buffers::bundle_weight(dbuf, name, enc, shape, rows);
    w.host = Some(super::types::MappedHost {
        _pin: pin,
        _bytes: data.clone(),
    });
    Ok(w)
}

pub(super) fn upload(cuda: &CudaBackend, w: &HostTensor) -> Result<CudaWeight> {
    cuda.bind()?;
    let mut dst = cuda.alloc_weight(&w.name, w.dtype, w.rows, w.cols)?;
    let bytes = w.data.as_slice();
    let paced = cuda.pace_before(&cuda.compute, 1)?;
    // SAFETY: dst holds exactly `bytes.len()` bytes; the compute stream orders the copy
    // before any kernel that reads it.
    unsafe {
        cudarc::driver::result::memcpy_htod_async(dst.buf.ptr, bytes, cuda.compute.cu_stream())
    }
    .map_err(dev)?;
    cuda.pace_after(&cuda.compute, paced, bytes.len())?;
    cuda.compute.synchronize().map_err(dev)?;
    cuda.ledger().count_h2d(bytes.len() as u64);
    dst.name = w.name.clone();
    Ok(dst)
}

pub(super) fn upload_bundles(
    cuda: &CudaBackend,
    name: &str,
    enc: Encoding,
    shape: BundleShape,
    data: &Bytes,
) -> Result<CudaWeight> {
    let bytes = data.as_slice();
    let rows = crate::backend::bundle_rows(name, enc, shape, bytes.len())?;
    let mut dst = cuda.alloc_bundles(name, enc, shape, rows)?;
    cuda.upload_into(&mut dst, 0, bytes)?;
    // As `upload`: the weight is usable (and `data` free) when this returns.
    cuda.copy.synchronize().map_err(dev)?;
    Ok(dst)
}

pub(super) fn upload_into(
    cuda: &CudaBackend,
    dst: &mut CudaWeight,
    first_row: usize,
    src: &[u8],
) -> Result<()> {
    cuda.outside("upload_into")?;
    cuda.bind()?;
    let rb = dst.row_bytes();
    let start = first_row * rb;
    if rb == 0 || !src.len().is_multiple_of(rb) || start + src.len() > dst.rows * rb {
        return Err(shape_err(
            "upload_into",
            format!(
                "{} bytes at row {first_row} of `{}` ({} rows)",
                src.len(),
                dst.name,
                dst.rows
            ),
        ));
    }
    let paced = cuda.pace_before(&cuda.copy, 0)?;
    // SAFETY: in bounds (checked); the caller keeps `src` unchanged until an event recorded
    // after this completes (Backend::upload_into's contract).
    unsafe {
        cudarc::driver::result::memcpy_htod_async(
            dst.buf.ptr + start as u64,
            src,
            cuda.copy.cu_stream(),
        )
    }
    .map_err(dev)?;
    cuda.pace_after(&cuda.copy, paced, src.len())?;
    cuda.ledger().count_h2d(src.len() as u64);
    Ok(())
}

pub(super) fn copies_done(cuda: &CudaBackend) -> Result<CudaEvent> {
    cuda.outside("copies_done")?;
    cuda.copy.record_event(None).map_err(dev)
}

pub(super) fn compute_done(cuda: &CudaBackend) -> Result<CudaEvent> {
    cuda.outside("compute_done")?;
    cuda.compute.record_event(None).map_err(dev)
}

pub(super) fn compute_waits(cuda: &CudaBackend, ev: &CudaEvent) -> Result<()> {
    cuda.outside("compute_waits")?;
    cuda.compute.wait(ev).map_err(dev)
}

pub(super) fn copies_wait(cuda: &CudaBackend, ev: &CudaEvent) -> Result<()> {
    cuda.outside("copies_wait")?;
    cuda.copy.wait(ev).map_err(dev)
}

pub(super) fn host_waits(cuda: &CudaBackend, ev: &CudaEvent) -> Result<()> {
    cuda.outside("host_waits")?;
    cuda.ledger().count_host_wait();
    ev.synchronize().map_err(dev)
}

pub(super) fn pin_host(cuda: &CudaBackend, bytes: &[u8]) -> Result<Option<HostPin>> {
    if bytes.is_empty() {
        return Ok(None);
    }
    Ok(Some(Box::new(CudaBackend::pin_host(
        cuda,
        bytes.as_ptr(),
        bytes.len(),
    )?)))
}

pub(super) fn write(cuda: &CudaBackend, dst: &mut CudaTensor, src: &[f32]) -> Result<()> {
    cuda.outside("write")?;
    cuda.bind()?;
    if src.len() != dst.rows * dst.cols {
        return Err(shape_err(
            "write",
            format!("{} values into {}x{}", src.len(), dst.rows, dst.cols),
        ));
    }
    let paced = cuda.pace_before(&cuda.compute, 1)?;
    // SAFETY: sizes checked. From pageable memory the driver stages `src` before the call
    // returns (CUDA's documented behaviour for asynchronous host→device copies), so the
    // host neither waits for the device nor has to keep `src`; the copy runs in order on
    // the compute stream.
    unsafe {
        cudarc::driver::result::memcpy_htod_async(dst.buf.ptr, src, cuda.compute.cu_stream())
    }
    .map_err(dev)?;
    cuda.pace_after(&cuda.compute, paced, std::mem::size_of_val(src))?;
    cuda.ledger().count_h2d(std::mem::size_of_val(src) as u64);
    Ok(())
}

pub(super) fn read(cuda: &CudaBackend, src: &CudaTensor, dst: &mut [f32]) -> Result<()> {
    cuda.outside("read")?;
    cuda.bind()?;
    if dst.len() != src.rows * src.cols {
        return Err(shape_err(
            "read",
            format!("{}x{} into {} values", src.rows, src.cols, dst.len()),
        ));
    }
    // SAFETY: sizes checked; the stream is synchronized before `dst` is used.
    unsafe {
        cudarc::driver::result::memcpy_dtoh_async(dst, src.buf.ptr, cuda.compute.cu_stream())
    }
    .map_err(dev)?;
    cuda.compute.synchronize().map_err(dev)?;
    cuda.ctx.check_err().map_err(dev)?;
    cuda.ledger().count_d2h(std::mem::size_of_val(dst) as u64);
    cuda.ledger().count_host_wait();
    Ok(())
}

pub(super) unsafe fn read_queued(
    cuda: &CudaBackend,
    src: &CudaTensor,
    dst: &mut [f32],
) -> Result<CudaEvent> {
    cuda.outside("read_queued")?;
    cuda.bind()?;
    if dst.len() != src.rows * src.cols {
        return Err(shape_err(
            "read_queued",
            format!("{}x{} into {} values", src.rows, src.cols, dst.len()),
        ));
    }
    // SAFETY: sizes checked; the caller leaves `dst` alone until the event has completed
    // (the trait's contract). Into page-locked memory (a `HostStage`) the copy is truly
    // asynchronous.
    unsafe {
        cudarc::driver::result::memcpy_dtoh_async(dst, src.buf.ptr, cuda.compute.cu_stream())
    }
    .map_err(dev)?;
    cuda.ledger().count_d2h(std::mem::size_of_val(dst) as u64);
    // A blocking-sync event: the host thread sleeps on it instead of spinning, leaving its
    // core to the CPU's share of the work.
    cuda.compute
        .record_event(Some(
            cudarc::driver::sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC,
        ))
        .map_err(dev)
}

pub(super) fn copy_rows(
    cuda: &CudaBackend,
    src: &CudaTensor,
    src_row: usize,
    dst: &mut CudaTensor,
    dst_row: usize,
    n: usize,
) -> Result<()> {
    cuda.bind()?;
    if src.cols != dst.cols || src_row + n > src.rows || dst_row + n > dst.rows {
        return Err(shape_err(
            "copy_rows",
            format!("{n} rows from {src_row} to {dst_row}"),
        ));
    }
    let c = src.cols as u64 * 4;
    // SAFETY: both ranges in bounds (checked), ordered on the compute stream.
    unsafe {
        cudarc::driver::result::memcpy_dtod_async(
            dst.buf.ptr + dst_row as u64 * c,
            src.buf.ptr + src_row as u64 * c,
            n * c as usize,
            cuda.compute.cu_stream(),
        )
    }
    .map_err(dev)?;
    cuda.counted();
    Ok(())
}
