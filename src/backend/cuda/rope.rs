//! Rotary position embeddings in place (kernels/rope.cu): one tensor, a step's queries and keys
//! in one launch, or — for f32 and f16 caches — the rotation and the step's KV store in one.

use super::args::{dtype_code, elementwise_cfg, pair_cfg, pairs_code};
use super::device::CudaBackend;
use super::launches;
use super::types::{
    CudaKv, CudaKvTable, CudaTensor, CudaWeight, check_rope, check_store_pair, shape_err,
};
use crate::backend::{KvType, Result, Rope, RopePairs};

pub(super) fn rope(
    cuda: &CudaBackend,
    x: &mut CudaTensor,
    head_dim: usize,
    rot_dims: usize,
    pairs: RopePairs,
    inv_freq: &CudaWeight,
    first_pos: usize,
) -> Result<()> {
    check_rope(x, head_dim, rot_dims, inv_freq)?;
    let total = x.rows * (x.cols / head_dim) * (rot_dims / 2);
    let (rows, cols, hd, rd) = (
        x.rows as i32,
        x.cols as i32,
        head_dim as i32,
        rot_dims as i32,
    );
    let p = pairs_code(pairs);
    let (fp, at) = (first_pos as i32, cuda.position_at()?);
    launches::rope(
        cuda.launch(elementwise_cfg(total)),
        x.buf.ptr,
        rows,
        cols,
        hd,
        rd,
        p,
        inv_freq.buf.ptr,
        fp,
        at,
    )?;
    Ok(())
}

#[allow(clippy::too_many_arguments)] // the trait's arguments, as it takes them
pub(super) fn rope_pair(
    cuda: &CudaBackend,
    q: &mut CudaTensor,
    k: &mut CudaTensor,
    head_dim: usize,
    rot_dims: usize,
    pairs: RopePairs,
    inv_freq: &CudaWeight,
    first_pos: usize,
) -> Result<()> {
    check_rope(q, head_dim, rot_dims, inv_freq)?;
    check_rope(k, head_dim, rot_dims, inv_freq)?;
    if q.rows != k.rows {
        return Err(shape_err(
            "rope_pair",
            format!("{} query rows, {} key rows", q.rows, k.rows),
        ));
    }
    let most = q.rows * (q.cols.max(k.cols) / head_dim) * (rot_dims / 2);
    let (qc, kc, rows) = (q.cols as i32, k.cols as i32, q.rows as i32);
    let (hd, rd, p) = (head_dim as i32, rot_dims as i32, pairs_code(pairs));
    let (fp, at) = (first_pos as i32, cuda.position_at()?);
    launches::rope_pair(
        cuda.launch(pair_cfg(most, 2)),
        q.buf.ptr,
        qc,
        k.buf.ptr,
        kc,
        rows,
        hd,
        rd,
        p,
        inv_freq.buf.ptr,
        fp,
        at,
    )?;
    Ok(())
}

pub(super) fn rope_store_kv(
    cuda: &CudaBackend,
    (q, k, v): (&mut CudaTensor, &mut CudaTensor, &CudaTensor),
    (kc, vc): (&mut CudaKv, &mut CudaKv),
    table: Option<&CudaKvTable>,
    dst_row: usize,
    rope: Rope<'_, CudaWeight>,
) -> Result<()> {
    // Q8_0 rows quantize 32 values a warp: the rotation and the store stay apart.
    if !matches!(kc.ty, KvType::F32 | KvType::F16) {
        return crate::backend::rope_then_store(cuda, (q, k, v), (kc, vc), table, dst_row, rope);
    }
    let (hd, rd) = (rope.head_dim, rope.rot_dims);
    check_rope(q, hd, rd, rope.inv_freq)?;
    check_rope(k, hd, rd, rope.inv_freq)?;
    let tp = check_store_pair((k, v), (kc, vc), table, dst_row)?;
    if q.rows != k.rows {
        return Err(shape_err(
            "rope_store_kv",
            format!("{} query rows, {} key rows", q.rows, k.rows),
        ));
    }
    let most = (q.rows * (q.cols / hd) * (rd / 2)).max(k.rows * k.cols);
    let (qc, kvc, rows) = (q.cols as i32, k.cols as i32, q.rows as i32);
    let (hd, rd, p) = (hd as i32, rd as i32, pairs_code(rope.pairs));
    let (dt, first, at) = (
        dtype_code(kc.ty.dtype()),
        dst_row as i32,
        cuda.position_at()?,
    );
    launches::rope_store_kv(
        cuda.launch(pair_cfg(most, 3)),
        q.buf.ptr,
        qc,
        k.buf.ptr,
        v.buf.ptr,
        kvc,
        rows,
        hd,
        rd,
        p,
        rope.inv_freq.buf.ptr,
        dt,
        kc.buf.ptr,
        vc.buf.ptr,
        tp,
        first,
        at,
    )?;
    Ok(())
}
