//! The device's handles — activations, weights (tensors in a storage format, or FFN bundles in
//! a store encoding), KV caches and block tables — each a [`DeviceBuf`] with its shape, and the
//! checks every op runs on them before a kernel reads through them (a kernel trusts its
//! arguments: an unchecked shape reads or writes past a buffer on the GPU).

use cudarc::driver::CudaSlice;

use crate::backend::memory::{DeviceAlloc, Holds};
use crate::backend::{BackendError, KvType, Result};
use crate::store::Encoding;
use crate::tensor::DType;

/// One device buffer: its address, and what keeps it (a pool allocation, or an arena range).
pub(super) struct DeviceBuf {
    pub(super) ptr: u64,
    pub(super) _pool: Option<CudaSlice<u8>>,
    pub(super) mem: DeviceAlloc,
}

impl Holds for DeviceBuf {
    fn alloc(&self) -> &DeviceAlloc {
        &self.mem
    }
}

/// Activations on the device.
pub struct CudaTensor {
    pub(super) buf: DeviceBuf,
    pub(super) rows: usize,
    pub(super) cols: usize,
    /// Values allocated (what `reshape` may use).
    pub(super) capacity: usize,
}

/// A weight on the device.
pub struct CudaWeight {
    pub(super) buf: DeviceBuf,
    pub(super) name: String,
    pub(super) dtype: DType,
    pub(super) rows: usize,
    pub(super) cols: usize,
    /// INT8/INT4 bundles: their encoding and part count (`dtype` is then a placeholder, and
    /// only the bundle ops take the weight).
    pub(super) coded: Option<(Encoding, usize)>,
    /// Host memory the device reads in place (`buf.ptr` is its mapped address), kept
    /// page-locked while the weight lives ([`crate::backend::Backend::map_bundles`]).
    pub(super) host: Option<MappedHost>,
}

/// Host bytes page-locked and mapped for the device: unlocked (first) before they are freed.
pub(super) struct MappedHost {
    pub(super) _pin: PinnedRegion,
    pub(super) _bytes: crate::tensor::Bytes,
}

/// Rows of a weight as the matvec kernels read them: where they start, their format, how many
/// and how wide (a whole weight, or one expert's rows of a stack).
#[derive(Clone, Copy, Debug)]
pub(super) struct WeightRows {
    pub(super) ptr: u64,
    pub(super) dtype: DType,
    pub(super) rows: usize,
    pub(super) cols: usize,
}

impl CudaWeight {
    /// All its rows.
    pub(super) fn all_rows(&self) -> WeightRows {
        WeightRows {
            ptr: self.buf.ptr,
            dtype: self.dtype,
            rows: self.rows,
            cols: self.cols,
        }
    }

    /// Rows `first .. first + n` (a matrix in a storage format, not coded bundles).
    pub(super) fn row_range(&self, first: usize, n: usize) -> Option<WeightRows> {
        (self.coded.is_none() && first + n <= self.rows).then(|| WeightRows {
            ptr: self.buf.ptr + (first * self.row_bytes()) as u64,
            dtype: self.dtype,
            rows: n,
            cols: self.cols,
        })
    }

    /// Bytes of one row (one bundle, for bundles).
    pub(super) fn row_bytes(&self) -> usize {
        match self.coded {
            Some((enc, parts)) => enc.row_bytes(self.cols, parts),
            None => self.dtype.bytes_for(self.cols),
        }
    }

    pub(super) fn encoding(&self) -> Encoding {
        self.coded
            .map_or(Encoding::Format(self.dtype), |(enc, _)| enc)
    }

    /// Refuse coded bundles for `op`, which reads a tensor in its storage format.
    pub(super) fn plain(&self, op: &'static str) -> Result<()> {
        crate::backend::check_not_coded(op, &self.name, self.coded.map(|(enc, _)| enc))
    }
}

/// A KV cache on the device.
pub struct CudaKv {
    pub(super) buf: DeviceBuf,
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) ty: KvType,
}

/// A block table on the device, with the host's copy of its entries (checked against the cache
/// before a kernel reads through it).
pub struct CudaKvTable {
    pub(super) buf: DeviceBuf,
    pub(super) cap: usize,
    pub(super) blocks: Vec<u32>,
}

/// The device address of an optional block table (0: the kernels read a cache's own rows).
pub(super) fn table_ptr(
    op: &'static str,
    table: Option<&CudaKvTable>,
    rows: usize,
    cache_rows: usize,
) -> Result<u64> {
    match table {
        None => Ok(0),
        Some(t) => {
            crate::backend::check_kv_table(op, &t.blocks, rows, cache_rows)?;
            Ok(t.buf.ptr)
        }
    }
}

/// `x · wᵀ` fits columns `col0..` of `out`, and `w` is a matrix in a storage format.
pub(super) fn check_matmul(
    w: &CudaWeight,
    x: &CudaTensor,
    out: &CudaTensor,
    col0: usize,
) -> Result<()> {
    w.plain("matmul")?;
    let (wd, xd, od) = ((w.rows, w.cols), (x.rows, x.cols), (out.rows, out.cols));
    crate::backend::check_matmul_shape(&w.name, wd, xd, od, col0)
}

/// Rows `src` fit a cache `dst` from `dst_row` (through `table`, if any); the table's address.
pub(super) fn check_store(
    src: &CudaTensor,
    dst: &CudaKv,
    table: Option<&CudaKvTable>,
    dst_row: usize,
) -> Result<u64> {
    if src.cols != dst.cols || (table.is_none() && dst_row + src.rows > dst.rows) {
        return Err(shape_err(
            "store_kv",
            format!(
                "{}x{} at row {dst_row} of a {}x{} cache",
                src.rows, src.cols, dst.rows, dst.cols
            ),
        ));
    }
    table_ptr("store_kv", table, dst_row + src.rows, dst.rows)
}

/// Keys and values of the same shape fit caches of the same size and type (through `table`, if
/// any, whose address this returns).
pub(super) fn check_store_pair(
    (k, v): (&CudaTensor, &CudaTensor),
    (kc, vc): (&CudaKv, &CudaKv),
    table: Option<&CudaKvTable>,
    dst_row: usize,
) -> Result<u64> {
    let tp = check_store(k, kc, table, dst_row)?;
    check_store(v, vc, table, dst_row)?;
    if (k.rows, k.cols, kc.rows, kc.ty) != (v.rows, v.cols, vc.rows, vc.ty) {
        return Err(shape_err(
            "store_kv_pair",
            format!(
                "keys {}x{} into a {} cache of {} rows, values {}x{} into a {} one of {}",
                k.rows,
                k.cols,
                kc.ty.name(),
                kc.rows,
                v.rows,
                v.cols,
                vc.ty.name(),
                vc.rows
            ),
        ));
    }
    Ok(tp)
}

/// Rotating `x` (`head_dim`-wide heads, the first `rot_dims` of each) by `inv_freq` fits.
pub(super) fn check_rope(
    x: &CudaTensor,
    head_dim: usize,
    rot_dims: usize,
    inv_freq: &CudaWeight,
) -> Result<()> {
    inv_freq.plain("rope")?;
    crate::backend::check_rope(
        x.cols,
        head_dim,
        rot_dims,
        Some(inv_freq.rows * inv_freq.cols),
    )
}

/// `op` takes `x` and `y` value by value (the same shape).
pub(super) fn check_same_shape(op: &'static str, x: &CudaTensor, y: &CudaTensor) -> Result<()> {
    crate::backend::check_same_shape(op, (x.rows, x.cols), (y.rows, y.cols))
}

/// `x` normed by `w` (f32, one value per column) into `out` fits.
pub(super) fn check_rms_norm(x: &CudaTensor, w: &CudaWeight, out: &CudaTensor) -> Result<()> {
    w.plain("rms_norm")?;
    if (x.rows, x.cols) != (out.rows, out.cols)
        || w.rows * w.cols != x.cols
        || w.dtype != DType::F32
    {
        return Err(shape_err(
            "rms_norm",
            format!("{}x{} with `{}`", x.rows, x.cols, w.name),
        ));
    }
    Ok(())
}

pub(super) fn shape_err(op: &'static str, msg: String) -> BackendError {
    BackendError::Shape { op, msg }
}

/// A page-locked host range; unlocked on drop.
pub struct PinnedRegion {
    pub(super) ptr: usize,
}

impl Drop for PinnedRegion {
    fn drop(&mut self) {
        // SAFETY: the range was registered by pin_host and is still allocated (guards drop
        // before their buffers).
        unsafe {
            cudarc::driver::sys::cuMemHostUnregister(self.ptr as *mut _);
        }
    }
}
