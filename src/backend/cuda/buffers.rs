//! Device buffers and where they come from: every allocation ([`CudaBackend::take`]: an arena
//! range under a budget, else the compute stream's pool, both streams ordered after it), the
//! activations, weights and bundle slots the ops allocate, and the held workspace the ops carve
//! their temporaries from (a neuron list among them).

use super::args::ptr_of;
use super::device::{CudaBackend, dev};
use super::types::{CudaTensor, CudaWeight, DeviceBuf, shape_err};
use crate::backend::memory::check_workspace;
use crate::backend::{BundleShape, Result, WorkspaceOp};
use crate::store::Encoding;
use crate::tensor::DType;

impl CudaBackend {
    /// A device buffer of [`device_bytes`](crate::footprint::device_bytes)`(bytes)` for `what`:
    /// an arena range under a budget, else from the compute stream's pool. Both streams are
    /// ordered after the work queued so far, which may still touch a recycled range.
    pub(super) fn take(&self, bytes: usize, what: &str) -> Result<DeviceBuf> {
        self.outside("an allocation")?;
        self.bind()?;
        let mem = self.mem.take(bytes as u64, what)?;
        let (ptr, pool) = match (self.arena, mem.offset) {
            (Some(base), Some(off)) => (base + off, None),
            _ => {
                // SAFETY: uninitialised device memory; every user writes before reading (or
                // zeroes it).
                let buf = unsafe { self.compute.alloc::<u8>(mem.bytes as usize) }.map_err(dev)?;
                (ptr_of(&buf, &self.compute), Some(buf))
            }
        };
        if self.arena.is_some() {
            let copies = self.copy.record_event(None).map_err(dev)?;
            self.compute.wait(&copies).map_err(dev)?;
        }
        let computed = self.compute.record_event(None).map_err(dev)?;
        self.copy.wait(&computed).map_err(dev)?;
        Ok(DeviceBuf {
            ptr,
            _pool: pool,
            mem,
        })
    }

    /// The held workspace, checked to hold what `op` needs; the guard keeps other threads from
    /// reusing it while this op's kernels are queued.
    pub(super) fn workspace_for(
        &self,
        op: WorkspaceOp,
    ) -> Result<(std::sync::MutexGuard<'_, Option<DeviceBuf>>, u64)> {
        let ws = self.workspace.lock()?;
        let (held, ptr) = ws.as_ref().map_or((0, 0), |b| (b.mem.bytes, b.ptr));
        check_workspace(&op, held)?;
        Ok((ws, ptr))
    }

    /// `ids` copied into the workspace (ordered on compute): the list the listed bundle kernels
    /// read; the guard keeps the workspace while they are queued.
    pub(super) fn listed(
        &self,
        ids: &[u32],
    ) -> Result<(std::sync::MutexGuard<'_, Option<DeviceBuf>>, u64)> {
        self.outside("a neuron list")?;
        let (ws, ptr) = self.workspace_for(WorkspaceOp::Listed { neurons: ids.len() })?;
        // SAFETY: the workspace holds at least ids.len() u32 (checked); ordered on compute,
        // staged out of the pageable slice before the call returns.
        unsafe { cudarc::driver::result::memcpy_htod_async(ptr, ids, self.compute.cu_stream()) }
            .map_err(dev)?;
        Ok((ws, ptr))
    }
}

pub(super) fn alloc(cuda: &CudaBackend, rows: usize, cols: usize) -> Result<CudaTensor> {
    let buf = cuda.take(
        rows * cols * 4,
        &format!("a {rows}x{cols} activation buffer"),
    )?;
    let t = CudaTensor {
        buf,
        rows,
        cols,
        capacity: rows * cols,
    };
    // Zeroed, as the trait promises.
    // SAFETY: the whole buffer.
    unsafe {
        cudarc::driver::result::memset_d8_async(
            t.buf.ptr,
            0,
            rows * cols * 4,
            cuda.compute.cu_stream(),
        )
    }
    .map_err(dev)?;
    Ok(t)
}

pub(super) fn alloc_weight(
    cuda: &CudaBackend,
    name: &str,
    dtype: DType,
    rows: usize,
    cols: usize,
) -> Result<CudaWeight> {
    if !cols.is_multiple_of(dtype.block_len()) {
        return Err(shape_err(
            "alloc_weight",
            format!("{cols} columns of {dtype}"),
        ));
    }
    // Filled by upload/upload_into before use; `take` orders the copy stream after the
    // allocation.
    let buf = cuda.take(rows * dtype.bytes_for(cols), name)?;
    Ok(CudaWeight {
        buf,
        name: name.to_string(),
        dtype,
        rows,
        cols,
        coded: None,
        host: None,
    })
}

pub(super) fn alloc_bundles(
    cuda: &CudaBackend,
    name: &str,
    enc: Encoding,
    shape: BundleShape,
    rows: usize,
) -> Result<CudaWeight> {
    let bytes = crate::backend::bundle_bytes(name, enc, shape, rows)?;
    // Filled by upload_into before use; `take` orders the copy stream after the allocation.
    let buf = cuda.take(bytes, name)?;
    Ok(bundle_weight(buf, name, enc, shape, rows))
}

/// `rows` bundles of `shape` in `enc` at `buf`.
pub(super) fn bundle_weight(
    buf: DeviceBuf,
    name: &str,
    enc: Encoding,
    shape: BundleShape,
    rows: usize,
) -> CudaWeight {
    let (dtype, coded) = match enc {
        Encoding::Format(dtype) => (dtype, None),
        // The dtype of coded bundles is never read (`CudaWeight::plain` refuses them).
        Encoding::Int8 | Encoding::Int4 => (DType::F32, Some((enc, shape.parts))),
    };
    CudaWeight {
        buf,
        name: name.to_string(),
        dtype,
        rows,
        cols: shape.parts * shape.d,
        coded,
        host: None,
    }
}

pub(super) fn retype_weight(
    cuda: &CudaBackend,
    w: &mut CudaWeight,
    dtype: DType,
    rows: usize,
    cols: usize,
) -> Result<()> {
    cuda.outside("retype_weight")?;
    crate::backend::retyped_bytes(&w.name, dtype, rows, cols, w.buf.mem.bytes)?;
    // A slot that held coded bundles becomes a plain tensor again.
    w.coded = None;
    w.dtype = dtype;
    w.rows = rows;
    w.cols = cols;
    Ok(())
}

pub(super) fn reshape(t: &mut CudaTensor, rows: usize, cols: usize) -> Result<()> {
    if rows.checked_mul(cols).is_none_or(|n| n > t.capacity) {
        return Err(shape_err(
            "reshape",
            format!("{rows}x{cols} in a buffer of {} values", t.capacity),
        ));
    }
    (t.rows, t.cols) = (rows, cols);
    Ok(())
}

pub(super) fn set_workspace(cuda: &CudaBackend, bytes: u64) -> Result<()> {
    cuda.outside("set_workspace")?;
    // Queued kernels still using the old one are ahead of any user of its range in stream
    // order.
    cuda.workspace
        .set(bytes, |b| cuda.take(b as usize, "device workspace"))
}
