//! RMSNorm and LayerNorm, one block per row (kernels/norm.cu): into f32 rows, or — where the rows
//! go straight to cuBLAS — into its f16 input.

use super::args::cfg;
use super::device::CudaBackend;
use super::launches;
use super::types::{CudaTensor, CudaWeight, check_rms_norm, check_same_shape, shape_err};
use crate::backend::Result;

impl CudaBackend {
    /// `x += add` (where given), then `x`'s rows normed by `w` and written as f16 at `dst` (the
    /// GEMMs' input): add_rms_norm (rms_norm) then f32_to_f16 in one launch, the same bits.
    pub(super) fn rms_norm_to_f16(
        &self,
        x: &mut CudaTensor,
        add: Option<&CudaTensor>,
        w: &CudaWeight,
        eps: f32,
        dst: u64,
    ) -> Result<()> {
        let cols = x.cols as i32;
        let c = self.launch(cfg(x.rows as u32, 256));
        match add {
            Some(y) => {
                launches::add_rms_norm_f16(c, x.buf.ptr, y.buf.ptr, w.buf.ptr, eps, dst, cols)?
            }
            None => launches::rms_norm_f16(c, x.buf.ptr, w.buf.ptr, eps, dst, cols)?,
        }
        Ok(())
    }

    /// `x += add` (where given), then `x`'s rows normed by `w` and written as 8-bit activation
    /// blocks at `dst` (the block-format matvecs' input): add_rms_norm (rms_norm) then
    /// quantize_q8 in one launch, the same bits.
    pub(super) fn rms_norm_to_q8(
        &self,
        x: &mut CudaTensor,
        add: Option<&CudaTensor>,
        w: &CudaWeight,
        eps: f32,
        dst: u64,
    ) -> Result<()> {
        let cols = x.cols as i32;
        let c = self.launch(cfg(x.rows as u32, 256));
        match add {
            Some(y) => {
                launches::add_rms_norm_q8(c, x.buf.ptr, y.buf.ptr, w.buf.ptr, eps, dst, cols)?
            }
            None => launches::rms_norm_q8(c, x.buf.ptr, w.buf.ptr, eps, dst, cols)?,
        }
        Ok(())
    }
}

pub(super) fn rms_norm(
    cuda: &CudaBackend,
    x: &CudaTensor,
    w: &CudaWeight,
    eps: f32,
    out: &mut CudaTensor,
) -> Result<()> {
    check_rms_norm(x, w, out)?;
    let cols = x.cols as i32;
    launches::rms_norm(
        cuda.launch(cfg(x.rows as u32, 256)),
        x.buf.ptr,
        w.buf.ptr,
        eps,
        out.buf.ptr,
        cols,
    )?;
    Ok(())
}

/// Every `head_dim`-wide head of `x` normed in place: the rms_norm kernel with one block per
/// head, reading and writing the same rows (each value is read and then written by one thread,
/// after the block's sum).
pub(super) fn rms_norm_heads(
    cuda: &CudaBackend,
    x: &mut CudaTensor,
    w: &CudaWeight,
    head_dim: usize,
    eps: f32,
) -> Result<()> {
    w.plain("rms_norm_heads")?;
    if head_dim == 0
        || !x.cols.is_multiple_of(head_dim)
        || w.rows * w.cols != head_dim
        || w.dtype != crate::tensor::DType::F32
    {
        return Err(shape_err(
            "rms_norm_heads",
            format!(
                "{}x{} in heads of {head_dim} with `{}`",
                x.rows, x.cols, w.name
            ),
        ));
    }
    let heads = x.rows * (x.cols / head_dim);
    launches::rms_norm(
        cuda.launch(cfg(heads as u32, 256)),
        x.buf.ptr,
        w.buf.ptr,
        eps,
        x.buf.ptr,
        head_dim as i32,
    )?;
    Ok(())
}

pub(super) fn add_rms_norm(
    cuda: &CudaBackend,
    x: &mut CudaTensor,
    y: &CudaTensor,
    w: &CudaWeight,
    eps: f32,
    out: &mut CudaTensor,
) -> Result<()> {
    check_rms_norm(x, w, out)?;
    check_same_shape("add", x, y)?;
    let cols = x.cols as i32;
    launches::add_rms_norm(
        cuda.launch(cfg(x.rows as u32, 256)),
        x.buf.ptr,
        y.buf.ptr,
        w.buf.ptr,
        eps,
        out.buf.ptr,
        cols,
    )?;
    Ok(())
}

pub(super) fn layer_norm(
    cuda: &CudaBackend,
    x: &CudaTensor,
    w: &CudaWeight,
    b: &CudaWeight,
    eps: f32,
    out: &mut CudaTensor,
) -> Result<()> {
    w.plain("layer_norm")?;
    b.plain("layer_norm")?;
    if (x.rows, x.cols) != (out.rows, out.cols)
        || w.rows * w.cols != x.cols
        || b.rows * b.cols != x.cols
    {
        return Err(shape_err(
            "layer_norm",
            format!("{}x{} with `{}`", x.rows, x.cols, w.name),
        ));
    }
    let cols = x.cols as i32;
    launches::layer_norm(
        cuda.launch(cfg(x.rows as u32, 256)),
        x.buf.ptr,
        w.buf.ptr,
        b.buf.ptr,
        eps,
        out.buf.ptr,
        cols,
    )?;
    Ok(())
}
