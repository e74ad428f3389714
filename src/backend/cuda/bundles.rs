//! The bundled FFN (kernels/bundles.cu) in every bundle encoding: the hidden activations of a run
//! of neurons (`up`) and their weighted down columns added to the output (`down`), over all
//! neurons of a weight or a list of them copied into the workspace.

use cudarc::driver::LaunchConfig;

use super::args::{WARPS, act_code, blocks, cfg};
use super::device::CudaBackend;
use super::launches;
use super::types::{CudaTensor, CudaWeight, shape_err};
use crate::backend::{Act, BundleShape, IN_REST, Result, check_bundle_weight};
use crate::footprint::workspace::MAX_TOKENS;
use crate::store::Encoding;
use crate::tensor::DType;

/// A list of neurons in the workspace: its device address, how many, and the rest its entries
/// with [`IN_REST`] name rows of (and how many do).
#[derive(Clone, Copy)]
struct Listed<'a> {
    ptr: u64,
    count: usize,
    rest: Option<(&'a CudaWeight, usize)>,
}

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

impl CudaWeight {
    /// Refuse `self` for `op` (a whole-bundle op) where it is host memory read in place: only
    /// the listed ops count what they read of it.
    fn whole(&self, op: &'static str) -> Result<()> {
        match self.host {
            Some(_) => Err(shape_err(
                op,
                format!(
                    "`{}` is read in place: only the listed ops take it",
                    self.name
                ),
            )),
            None => Ok(()),
        }
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
    /// Count the bytes the kernels read of `rows` listed bundles of `b` (the up side or the
    /// down one): over the link where `b` is host memory they read in place, else of device
    /// memory. The kernels skip the parts of neurons the mask leaves off, which the host does
    /// not see: counted as if every listed neuron were on (the budgeted device counts the exact
    /// bytes).
    fn count_in_place(&self, b: &CudaWeight, shape: BundleShape, rows: usize, up: bool) {
        let bytes = crate::backend::in_place_read_bytes(b.row_bytes(), shape.parts, rows, rows, up);
        match b.host {
            Some(_) => self.ledger().count_h2d(bytes),
            None => self.ledger().count_device_read(bytes),
        }
    }

    /// The address of `list`'s rest (0 without), checked to be bundles as `b` is, with the
    /// link bytes the side (`up` or down) reads of each set counted.
    fn listed_rest(
        &self,
        b: &CudaWeight,
        shape: BundleShape,
        list: Option<Listed<'_>>,
        up: bool,
    ) -> Result<u64> {
        let (count, rest) = list.map_or((b.rows, None), |l| (l.count, l.rest));
        let Some((r, in_rest)) = rest else {
            self.count_in_place(b, shape, count, up);
            return Ok(0);
        };
        r.bundles("ffn_bundles listed", shape)?;
        if r.encoding() != b.encoding() {
            return Err(shape_err(
                "ffn_bundles listed",
                format!("`{}` and its rest `{}` differ in encoding", b.name, r.name),
            ));
        }
        self.count_in_place(b, shape, count - in_rest, up);
        self.count_in_place(r, shape, in_rest, up);
        Ok(r.buf.ptr)
    }

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
        list: Option<Listed<'_>>,
    ) -> Result<()> {
        let (row_bytes, (up, _)) = b.bundles("ffn_bundles_up", shape)?;
        let rest = self.listed_rest(b, shape, list, true)?;
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
        let count = list.map_or(b.rows, |l| l.count);
        let idx_ptr = list.map_or(0u64, |l| l.ptr);
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
                rest,
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
        list: Option<Listed<'_>>,
    ) -> Result<()> {
        let (row_bytes, (_, down)) = b.bundles("ffn_bundles_down", shape)?;
        let rest = self.listed_rest(b, shape, list, false)?;
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
        let count = list.map_or(b.rows, |l| l.count);
        let idx_ptr = list.map_or(0u64, |l| l.ptr);
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
                rest,
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
    b.whole("ffn_bundles_up")?;
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
    b.whole("ffn_bundles_down")?;
    if col0 + b.rows > h.cols {
        return Err(shape_err(
            "ffn_bundles_down",
            format!("{} neurons at {col0} of h {}x{}", b.rows, h.rows, h.cols),
        ));
    }
    cuda.bundles_down(b, shape, h, col0, out, None)
}

/// The list `idx` over `b` and `rest` checked (an entry with [`IN_REST`] names a row of
/// `rest`) against the `width` columns it fills; how many entries name rows of `rest`.
fn check_listed(
    op: &'static str,
    (b, rest): (&CudaWeight, Option<&CudaWeight>),
    idx: &[u32],
    width: usize,
) -> Result<usize> {
    let mut in_rest = 0;
    for &i in idx {
        let (rows, row) = match (i & IN_REST, rest) {
            (0, _) => (b.rows, i as usize),
            (_, Some(r)) => {
                in_rest += 1;
                (r.rows, (i & !IN_REST) as usize)
            }
            (_, None) => (0, 0),
        };
        if row >= rows {
            return Err(shape_err(
                op,
                format!("entry {i:#x} of the list: `{}` has no such neuron", b.name),
            ));
        }
    }
    if idx.len() > width {
        return Err(shape_err(
            op,
            format!("{} listed neurons into {width} columns", idx.len()),
        ));
    }
    Ok(in_rest)
}

#[allow(clippy::too_many_arguments)] // the trait's arguments, as it takes them
pub(super) fn ffn_bundles_up_listed(
    cuda: &CudaBackend,
    (b, rest): (&CudaWeight, Option<&CudaWeight>),
    shape: BundleShape,
    x: &CudaTensor,
    act: Act,
    threshold: f32,
    up_bias: Option<&CudaWeight>,
    idx: &[u32],
    h: &mut CudaTensor,
) -> Result<()> {
    let op = "ffn_bundles_up_listed";
    let in_rest = check_listed(op, (b, rest), idx, h.cols)?;
    if rest.is_some() && up_bias.is_some() {
        return Err(shape_err(
            op,
            "an up bias goes by slot: none with a rest".into(),
        ));
    }
    if idx.is_empty() {
        return Ok(());
    }
    let (_ws, ptr) = cuda.listed(idx)?;
    let list = Listed {
        ptr,
        count: idx.len(),
        rest: rest.map(|r| (r, in_rest)),
    };
    cuda.bundles_up(b, shape, x, act, threshold, up_bias, h, 0, Some(list))
}

pub(super) fn ffn_bundles_down_listed(
    cuda: &CudaBackend,
    (b, rest): (&CudaWeight, Option<&CudaWeight>),
    shape: BundleShape,
    h: &CudaTensor,
    idx: &[u32],
    out: &mut CudaTensor,
) -> Result<()> {
    let in_rest = check_listed("ffn_bundles_down_listed", (b, rest), idx, h.cols)?;
    if idx.is_empty() {
        return Ok(());
    }
    let (_ws, ptr) = cuda.listed(idx)?;
    let list = Listed {
        ptr,
        count: idx.len(),
        rest: rest.map(|r| (r, in_rest)),
    };
    cuda.bundles_down(b, shape, h, 0, out, Some(list))
}
