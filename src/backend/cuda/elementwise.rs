//! Element-wise ops and gathers (kernels/elementwise.cu): the embedding and learned positions,
//! rows scattered into a slot, bias, residual add, activations and the gated product, and a
//! buffer zeroed.

use super::args::{act_code, cfg, dtype_code, elementwise_cfg};
use super::device::{CudaBackend, dev};
use super::launches;
use super::types::{CudaTensor, CudaWeight, check_same_shape, shape_err};
use crate::backend::{Act, Result, WorkspaceOp};
use crate::tensor::DType;

pub(super) fn embed(
    cuda: &CudaBackend,
    table: &CudaWeight,
    ids: &[u32],
    out: &mut CudaTensor,
) -> Result<()> {
    table.plain("embed")?;
    cuda.bind()?;
    if out.rows != ids.len() || out.cols != table.cols {
        return Err(shape_err(
            "embed",
            format!("{} ids into {}x{}", ids.len(), out.rows, out.cols),
        ));
    }
    if let Some(&bad) = ids.iter().find(|&&i| i as usize >= table.rows) {
        return Err(shape_err(
            "embed",
            format!("token id {bad} ≥ vocabulary {}", table.rows),
        ));
    }
    // The ids are copied from the host: a recorded step starts after its embedding.
    cuda.outside("embed")?;
    let (_ws, iptr) = cuda.workspace_for(WorkspaceOp::Embed { tokens: ids.len() })?;
    // SAFETY: the workspace holds at least ids.len() u32 (checked); ordered on compute.
    unsafe { cudarc::driver::result::memcpy_htod_async(iptr, ids, cuda.compute.cu_stream()) }
        .map_err(dev)?;
    cuda.ledger().count_h2d(ids.len() as u64 * 4);
    let (dt, cols) = (dtype_code(table.dtype), table.cols as i32);
    launches::embed_rows(
        cuda.launch(cfg(ids.len() as u32, 256)),
        table.buf.ptr,
        dt,
        cols,
        iptr,
        out.buf.ptr,
    )?;
    Ok(())
}

pub(super) fn add_table_rows(
    cuda: &CudaBackend,
    x: &mut CudaTensor,
    table: &CudaWeight,
    first_row: usize,
) -> Result<()> {
    cuda.outside("add_table_rows")?;
    table.plain("add_table_rows")?;
    if x.cols != table.cols || first_row + x.rows > table.rows {
        return Err(shape_err(
            "add_table_rows",
            format!("rows {first_row}.. of {}", table.rows),
        ));
    }
    let (dt, cols, fr) = (dtype_code(table.dtype), table.cols as i32, first_row as i32);
    launches::add_table_rows(
        cuda.launch(cfg(x.rows as u32, 256)),
        x.buf.ptr,
        table.buf.ptr,
        dt,
        cols,
        fr,
    )?;
    Ok(())
}

pub(super) fn scatter_rows(
    cuda: &CudaBackend,
    src: &CudaWeight,
    rows: &[u32],
    dst: &mut CudaWeight,
) -> Result<()> {
    let rb = dst.row_bytes();
    crate::backend::check_scatter(
        (&src.name, src.rows, src.row_bytes(), src.encoding()),
        (&dst.name, dst.rows, rb, dst.encoding()),
        rows,
    )?;
    if rows.is_empty() {
        return Ok(());
    }
    let (_ws, list) = cuda.listed(rows)?;
    let row_bytes = rb as i64;
    launches::scatter_rows(
        cuda.launch(cfg(rows.len() as u32, 256)),
        src.buf.ptr,
        row_bytes,
        list,
        dst.buf.ptr,
    )?;
    Ok(())
}

pub(super) fn zero(cuda: &CudaBackend, x: &mut CudaTensor) -> Result<()> {
    cuda.bind()?;
    // SAFETY: the whole buffer.
    unsafe {
        cudarc::driver::result::memset_d8_async(
            x.buf.ptr,
            0,
            x.rows * x.cols * 4,
            cuda.compute.cu_stream(),
        )
    }
    .map_err(dev)?;
    cuda.counted();
    Ok(())
}

pub(super) fn add_bias(cuda: &CudaBackend, x: &mut CudaTensor, bias: &CudaWeight) -> Result<()> {
    bias.plain("add_bias")?;
    if bias.dtype != DType::F32 || bias.rows * bias.cols != x.cols {
        return Err(shape_err(
            "add_bias",
            format!("`{}` for {} columns", bias.name, x.cols),
        ));
    }
    let (n, cols) = ((x.rows * x.cols) as i64, x.cols as i32);
    launches::add_bias_f32(
        cuda.launch(elementwise_cfg(x.rows * x.cols)),
        x.buf.ptr,
        bias.buf.ptr,
        n,
        cols,
    )?;
    Ok(())
}

pub(super) fn add(cuda: &CudaBackend, x: &mut CudaTensor, y: &CudaTensor) -> Result<()> {
    check_same_shape("add", x, y)?;
    let n = (x.rows * x.cols) as i64;
    launches::add_f32(
        cuda.launch(elementwise_cfg(x.rows * x.cols)),
        x.buf.ptr,
        y.buf.ptr,
        n,
    )?;
    Ok(())
}

pub(super) fn activate(
    cuda: &CudaBackend,
    x: &mut CudaTensor,
    act: Act,
    threshold: f32,
) -> Result<()> {
    let (n, k) = ((x.rows * x.cols) as i64, act_code(act));
    launches::activate_f32(
        cuda.launch(elementwise_cfg(x.rows * x.cols)),
        x.buf.ptr,
        n,
        k,
        threshold,
    )?;
    Ok(())
}

pub(super) fn gated(
    cuda: &CudaBackend,
    gate: &mut CudaTensor,
    up: &CudaTensor,
    act: Act,
    threshold: f32,
) -> Result<()> {
    check_same_shape("gated", gate, up)?;
    let (n, k) = ((gate.rows * gate.cols) as i64, act_code(act));
    launches::gated_f32(
        cuda.launch(elementwise_cfg(gate.rows * gate.cols)),
        gate.buf.ptr,
        up.buf.ptr,
        n,
        k,
        threshold,
    )?;
    Ok(())
}
