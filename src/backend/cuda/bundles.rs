//! The bundled FFN (kernels/bundles.cu) in every bundle encoding: the hidden activations of a run
//! of neurons (`up`) and their weighted down columns added to the output (`down`), over all
//! neurons of a weight or a list of them copied into the workspace.

use cudarc::driver::LaunchConfig;

use super::args::{WARPS, act_code, blocks, cfg};
use super::device::CudaBackend;
use super::launches;
use super::types::{CudaTensor, CudaWeight, shape_err};
use crate::backend::{Act, BundleShape, Result, check_bundle_weight};
use crate::footprint::workspace::MAX_TOKENS;
use crate::store::Encoding;
use crate::tensor::DType;

impl CudaWeight {
    /// Bytes of one bundle, once `self` is checked to hold bundles of `shape` in an encoding
    /// with kernels, and the kernel pair for it.
    pub(super) fn bundles(
        &self,
        op: &'static str,
        shape: BundleShape,
    ) -> Result<(usize, (launches::BundlesUp, launches::BundlesDown))> {
        let enc = self.encoding();
        let (dims, parts) = ((self.rows, self.cols), self.coded.map(|(_, parts)| parts));
        check_bundle_weight(op, &self.name, dims, enc, parts, shape)?;
        let row_bytes = crate::backend::bundle_bytes(&self.name, enc, shape, 1)?;
        Ok((row_bytes, bundle_kernels(enc)))
    }
}

/// The (up, down) kernels of kernels/bundles.cu for bundles in `enc` (one `bundle_bytes` admits).
fn bundle_kernels(enc: Encoding) -> (launches::BundlesUp, launches::BundlesDown) {
    use launches as l;
    match enc {
        Encoding::Format(DType::F32) => (l::ffn_bundles_up_f32, l::ffn_bundles_down_f32),
        Encoding::Format(DType::BF16) => (l::ffn_bundles_up_bf16, l::ffn_bundles_down_bf16),
        Encoding::Int8 => (l::ffn_bundles_up_int8, l::ffn_bundles_down_int8),
        Encoding::Int4 => (l::ffn_bundles_up_int4, l::ffn_bundles_down_int4),
        // f16, and what `bundle_bytes` refuses before a kernel is picked.
        Encoding::Format(_) => (l::ffn_bundles_up_f16, l::ffn_bundles_down_f16),
    }
}

impl CudaBackend {
    /// The first half of the bundled FFN over all neurons of `b` (`list` none) or the `list.1`
    /// neurons listed at device address `list.0` (h compact from column `col0`).
    #[allow(clippy::too_many_arguments)]
    fn bundles_up(
        &self,
        b: &CudaWeight,
        shape: BundleShape,
        x: &CudaTensor,
        act: Act,
        threshold: f32,
        up_bias: Option<&CudaWeight>,
        h: &mut CudaTensor,
        col0: usize,
        list: Option<(u64, usize)>,
    ) -> Result<()> {
        let (row_bytes, (up, _)) = b.bundles("ffn_bundles_up", shape)?;
        if x.cols != shape.d || h.rows != x.rows {
            return Err(shape_err(
                "ffn_bundles_up",
                format!(
                    "x {}x{} into h {}x{} for bundles of {}",
                    x.rows, x.cols, h.rows, h.cols, shape.d
                ),
            ));
        }
        let row_bytes = row_bytes as i64;
        let count = list.map_or(b.rows, |l| l.1);
        let idx_ptr = list.map_or(0u64, |l| l.0);
        let (neurons, parts, d, kind) = (
            count as i32,
            shape.parts as i32,
            shape.d as i32,
            act_code(act),
        );
        if let Some(bb) = up_bias {
            bb.plain("ffn_bundles_up")?;
        }
        let bias = up_bias.map_or(0u64, |w| w.buf.ptr);
        let (hs, c0) = (h.cols as i32, col0 as i32);
        for t0 in (0..x.rows).step_by(MAX_TOKENS) {
            let nt = (x.rows - t0).min(MAX_TOKENS) as i32;
            let xp = x.buf.ptr + (t0 * shape.d * 4) as u64;
            let hp = h.buf.ptr + (t0 * h.cols * 4) as u64;
            up(
                self.launch(cfg(blocks(count, WARPS), WARPS * 32)),
                b.buf.ptr,
                row_bytes,
                neurons,
                parts,
                d,
                xp,
                nt,
                kind,
                threshold,
                bias,
                hp,
                hs,
                c0,
                idx_ptr,
            )?;
        }
        Ok(())
    }

    /// The second half over all neurons of `b` or the listed ones (see [`Self::bundles_up`]).
    fn bundles_down(
        &self,
        b: &CudaWeight,
        shape: BundleShape,
        h: &CudaTensor,
        col0: usize,
        out: &mut CudaTensor,
        list: Option<(u64, usize)>,
    ) -> Result<()> {
        let (row_bytes, (_, down)) = b.bundles("ffn_bundles_down", shape)?;
        if out.cols != shape.d || h.rows != out.rows {
            return Err(shape_err(
                "ffn_bundles_down",
                format!(
                    "h {}x{} into {}x{} for bundles of {}",
                    h.rows, h.cols, out.rows, out.cols, shape.d
                ),
            ));
        }
        let row_bytes = row_bytes as i64;
        let count = list.map_or(b.rows, |l| l.1);
        let idx_ptr = list.map_or(0u64, |l| l.0);
        let (neurons, parts, d) = (count as i32, shape.parts as i32, shape.d as i32);
        let (hs, c0) = (h.cols as i32, col0 as i32);
        let grid = (blocks(shape.d, 256), blocks(count, 64), 1);
        for t0 in (0..h.rows).step_by(MAX_TOKENS) {
            let nt = (h.rows - t0).min(MAX_TOKENS) as i32;
            let hp = h.buf.ptr + (t0 * h.cols * 4) as u64;
            let op = out.buf.ptr + (t0 * shape.d * 4) as u64;
            let c = LaunchConfig {
                grid_dim: grid,
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            down(
                self.launch(c),
                b.buf.ptr,
                row_bytes,
                neurons,
                parts,
                d,
                hp,
                nt,
                hs,
                c0,
                op,
                idx_ptr,
            )?;
        }
        Ok(())
    }
}

#[allow(clippy::too_many_arguments)] // the trait's arguments, as it takes them
pub(super) fn ffn_bundles_up(
    cuda: &CudaBackend,
    b: &CudaWeight,
    shape: BundleShape,
    x: &CudaTensor,
    act: Act,
    threshold: f32,
    up_bias: Option<&CudaWeight>,
    h: &mut CudaTensor,
    col0: usize,
) -> Result<()> {
    if col0 + b.rows > h.cols {
        return Err(shape_err(
            "ffn_bundles_up",
            format!("{} neurons at {col0} into h {}x{}", b.rows, h.rows, h.cols),
        ));
    }
    cuda.bundles_up(b, shape, x, act, threshold, up_bias, h, col0, None)
}

pub(super) fn ffn_bundles_down(
    cuda: &CudaBackend,
    b: &CudaWeight,
    shape: BundleShape,
    h: &CudaTensor,
    col0: usize,
    out: &mut CudaTensor,
) -> Result<()> {
    if col0 + b.rows > h.cols {
        return Err(shape_err(
            "ffn_bundles_down",
            format!("{} neurons at {col0} of h {}x{}", b.rows, h.rows, h.cols),
        ));
    }
    cuda.bundles_down(b, shape, h, col0, out, None)
}

#[allow(clippy::too_many_arguments)] // the trait's arguments, as it takes them
pub(super) fn ffn_bundles_up_listed(
    cuda: &CudaBackend,
    b: &CudaWeight,
    shape: BundleShape,
    x: &CudaTensor,
    act: Act,
    threshold: f32,
    up_bias: Option<&CudaWeight>,
    idx: &[u32],
    h: &mut CudaTensor,
) -> Result<()> {
    if idx.len() > h.cols || idx.iter().any(|&i| i as usize >= b.rows) {
        return Err(shape_err(
            "ffn_bundles_up_listed",
            format!(
                "{} listed of {} neurons into h {}x{}",
                idx.len(),
                b.rows,
                h.rows,
                h.cols
            ),
        ));
    }
    if idx.is_empty() {
        return Ok(());
    }
    let (_ws, list) = cuda.listed(idx)?;
    cuda.bundles_up(
        b,
        shape,
        x,
        act,
        threshold,
        up_bias,
        h,
        0,
        Some((list, idx.len())),
    )
}

pub(super) fn ffn_bundles_down_listed(
    cuda: &CudaBackend,
    b: &CudaWeight,
    shape: BundleShape,
    h: &CudaTensor,
    idx: &[u32],
    out: &mut CudaTensor,
) -> Result<()> {
    if idx.len() > h.cols || idx.iter().any(|&i| i as usize >= b.rows) {
        return Err(shape_err(
            "ffn_bundles_down_listed",
            format!(
                "{} listed of {} neurons, h {}x{}",
                idx.len(),
                b.rows,
                h.rows,
                h.cols
            ),
        ));
    }
    if idx.is_empty() {
        return Ok(());
    }
    let (_ws, list) = cuda.listed(idx)?;
    cuda.bundles_down(b, shape, h, 0, out, Some((list, idx.len())))
}
