//! The KV cache on the device: caches and block tables allocated, this step's keys and values
//! stored into them (kernels/attention.cu: `store_kv`, `store_kv_pair`), and whole rows copied
//! between the cache and the host (decoded or as stored).

use super::args::{dtype_code, elementwise_cfg, pair_cfg};
use super::device::{CudaBackend, dev};
use super::launches;
use super::types::{CudaKv, CudaKvTable, CudaTensor, check_store, check_store_pair, shape_err};
use crate::backend::{KvType, Result};

pub(super) fn alloc_kv(cuda: &CudaBackend, rows: usize, cols: usize, ty: KvType) -> Result<CudaKv> {
    ty.check_cols(cols)?;
    let bytes = rows * ty.row_bytes(cols);
    let buf = cuda.take(bytes, &format!("a {rows}x{cols} {} KV cache", ty.name()))?;
    // Zeroed like activations, so unwritten rows read as zeros everywhere.
    // SAFETY: the whole buffer, ordered on the compute stream.
    unsafe { cudarc::driver::result::memset_d8_async(buf.ptr, 0, bytes, cuda.compute.cu_stream()) }
        .map_err(dev)?;
    Ok(CudaKv {
        buf,
        rows,
        cols,
        ty,
    })
}

pub(super) fn alloc_kv_table(cuda: &CudaBackend, blocks: usize) -> Result<CudaKvTable> {
    let buf = cuda.take(blocks * 4, &format!("a KV block table of {blocks} blocks"))?;
    Ok(CudaKvTable {
        buf,
        cap: blocks,
        blocks: Vec::with_capacity(blocks),
    })
}

pub(super) fn write_kv_table(
    cuda: &CudaBackend,
    table: &mut CudaKvTable,
    blocks: &[u32],
) -> Result<()> {
    cuda.outside("write_kv_table")?;
    cuda.bind()?;
    if blocks.len() > table.cap {
        return Err(shape_err(
            "write_kv_table",
            format!("{} blocks into a table of {}", blocks.len(), table.cap),
        ));
    }
    if blocks.is_empty() {
        table.blocks.clear();
        return Ok(());
    }
    // SAFETY: within the table's allocation; from pageable memory the driver stages
    // `blocks` before returning (see `write`), in order on the compute stream.
    unsafe {
        cudarc::driver::result::memcpy_htod_async(table.buf.ptr, blocks, cuda.compute.cu_stream())
    }
    .map_err(dev)?;
    cuda.ledger()
        .count_h2d(std::mem::size_of_val(blocks) as u64);
    table.blocks.clear();
    table.blocks.extend_from_slice(blocks);
    Ok(())
}

pub(super) fn store_kv(
    cuda: &CudaBackend,
    src: &CudaTensor,
    dst: &mut CudaKv,
    table: Option<&CudaKvTable>,
    dst_row: usize,
) -> Result<()> {
    let tp = check_store(src, dst, table, dst_row)?;
    let n = src.rows * src.cols;
    let (rows, cols, dt) = (src.rows as i64, src.cols as i32, dtype_code(dst.ty.dtype()));
    let (sp, dp, first) = (src.buf.ptr, dst.buf.ptr, dst_row as i32);
    let at = cuda.position_at()?;
    launches::store_kv(
        cuda.launch(elementwise_cfg(n)),
        sp,
        rows,
        cols,
        dt,
        dp,
        tp,
        first,
        at,
    )?;
    Ok(())
}

pub(super) fn store_kv_pair(
    cuda: &CudaBackend,
    (k, v): (&CudaTensor, &CudaTensor),
    (kc, vc): (&mut CudaKv, &mut CudaKv),
    table: Option<&CudaKvTable>,
    dst_row: usize,
) -> Result<()> {
    let tp = check_store_pair((k, v), (kc, vc), table, dst_row)?;
    let (rows, cols, dt) = (k.rows as i64, k.cols as i32, dtype_code(kc.ty.dtype()));
    let (first, at) = (dst_row as i32, cuda.position_at()?);
    launches::store_kv_pair(
        cuda.launch(pair_cfg(k.rows * k.cols, 2)),
        k.buf.ptr,
        v.buf.ptr,
        rows,
        cols,
        dt,
        kc.buf.ptr,
        vc.buf.ptr,
        tp,
        first,
        at,
    )?;
    Ok(())
}

pub(super) fn read_kv(
    cuda: &CudaBackend,
    src: &CudaKv,
    first: usize,
    out: &mut [f32],
) -> Result<()> {
    cuda.outside("read_kv")?;
    cuda.bind()?;
    let n = out.len() / src.cols.max(1);
    if src.cols == 0 || !out.len().is_multiple_of(src.cols) || first + n > src.rows {
        return Err(shape_err(
            "read_kv",
            format!(
                "{} values from row {first} of a {}x{} cache",
                out.len(),
                src.rows,
                src.cols
            ),
        ));
    }
    let rb = src.ty.row_bytes(src.cols);
    let mut raw = vec![0u8; n * rb];
    // SAFETY: in bounds (checked); synchronized before `raw` is read.
    unsafe {
        cudarc::driver::result::memcpy_dtoh_async(
            &mut raw[..],
            src.buf.ptr + (first * rb) as u64,
            cuda.compute.cu_stream(),
        )
    }
    .map_err(dev)?;
    cuda.compute.synchronize().map_err(dev)?;
    cuda.ledger().count_d2h(raw.len() as u64);
    cuda.ledger().count_host_wait();
    crate::backend::cpu::decode_rows(src.ty, &raw, src.cols, out);
    Ok(())
}

pub(super) fn read_kv_raw(
    cuda: &CudaBackend,
    src: &CudaKv,
    first: usize,
    out: &mut [u8],
) -> Result<()> {
    cuda.outside("read_kv_raw")?;
    cuda.bind()?;
    let rb = src.ty.row_bytes(src.cols);
    let n = out.len() / rb.max(1);
    if rb == 0 || !out.len().is_multiple_of(rb) || first + n > src.rows {
        return Err(shape_err(
            "read_kv_raw",
            format!(
                "{} bytes from row {first} of a {}x{} cache",
                out.len(),
                src.rows,
                src.cols
            ),
        ));
    }
    // SAFETY: in bounds (checked); synchronized before `out` is read.
    unsafe {
        cudarc::driver::result::memcpy_dtoh_async(
            out,
            src.buf.ptr + (first * rb) as u64,
            cuda.compute.cu_stream(),
        )
    }
    .map_err(dev)?;
    cuda.compute.synchronize().map_err(dev)?;
    cuda.ledger().count_d2h(out.len() as u64);
    cuda.ledger().count_host_wait();
    Ok(())
}

pub(super) fn write_kv_raw(
    cuda: &CudaBackend,
    dst: &mut CudaKv,
    first: usize,
    src: &[u8],
) -> Result<()> {
    cuda.outside("write_kv_raw")?;
    cuda.bind()?;
    let rb = dst.ty.row_bytes(dst.cols);
    let n = src.len() / rb.max(1);
    if rb == 0 || !src.len().is_multiple_of(rb) || first + n > dst.rows {
        return Err(shape_err(
            "write_kv_raw",
            format!(
                "{} bytes at row {first} of a {}x{} cache",
                src.len(),
                dst.rows,
                dst.cols
            ),
        ));
    }
    if src.is_empty() {
        return Ok(());
    }
    let paced = cuda.pace_before(&cuda.compute, 1)?;
    // SAFETY: in bounds (checked); synchronous w.r.t. `src` (pageable).
    unsafe {
        cudarc::driver::result::memcpy_htod_async(
            dst.buf.ptr + (first * rb) as u64,
            src,
            cuda.compute.cu_stream(),
        )
    }
    .map_err(dev)?;
    cuda.pace_after(&cuda.compute, paced, src.len())?;
    cuda.compute.synchronize().map_err(dev)?;
    cuda.ledger().count_h2d(src.len() as u64);
    Ok(())
}

pub(super) fn write_kv(
    cuda: &CudaBackend,
    dst: &mut CudaKv,
    first: usize,
    values: &[f32],
) -> Result<()> {
    cuda.outside("write_kv")?;
    cuda.bind()?;
    let n = values.len() / dst.cols.max(1);
    if dst.cols == 0 || !values.len().is_multiple_of(dst.cols) || first + n > dst.rows {
        return Err(shape_err(
            "write_kv",
            format!(
                "{} values at row {first} of a {}x{} cache",
                values.len(),
                dst.rows,
                dst.cols
            ),
        ));
    }
    // Encoded on the host with the codec the device kernel matches bit for bit.
    let raw = crate::backend::cpu::encode_rows(dst.ty, values, dst.cols);
    let rb = dst.ty.row_bytes(dst.cols);
    let paced = cuda.pace_before(&cuda.compute, 1)?;
    // SAFETY: in bounds (checked); synchronous w.r.t. `raw` (pageable).
    unsafe {
        cudarc::driver::result::memcpy_htod_async(
            dst.buf.ptr + (first * rb) as u64,
            &raw[..],
            cuda.compute.cu_stream(),
        )
    }
    .map_err(dev)?;
    cuda.pace_after(&cuda.compute, paced, raw.len())?;
    cuda.compute.synchronize().map_err(dev)?;
    cuda.ledger().count_h2d(raw.len() as u64);
    Ok(())
}
