//! Matrix × a few vectors (kernels/matvec.cu): one warp per weight row, the row read once for
//! all tokens of a launch; float formats over f32 activations, block formats over 8-bit
//! activation blocks (`quantize_q8`, kernels/elementwise.cu), several weights of one input in one
//! parts launch. Which launch a weight takes with how many tokens.

use super::args::{MAX_PARTS, MatvecPart, MatvecParts, WARPS, blocks, cfg, dtype_code};
use super::device::CudaBackend;
use super::launches;
use super::types::{CudaTensor, CudaWeight, WeightRows};
use crate::backend::Result;
use crate::footprint::workspace::{
    ACT_BLOCK_BYTES, MAX_QTOKENS, MAX_TOKENS, quantizes_in_blocks, uses_act_blocks,
};
use crate::tensor::DType;

/// How a weight of [`Backend::matmul_parts`](crate::backend::Backend::matmul_parts) runs with `n`
/// tokens: in a parts launch of block formats (activation blocks shared), of f16 rows, or alone
/// ([`Backend::matmul_into`](crate::backend::Backend::matmul_into)).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum PartLaunch {
    Blocks,
    F16,
    Alone,
}

/// Tokens one matvec launch of `dtype` weights takes (more go through cuBLAS where it is).
pub(super) fn tokens_per_matvec(dtype: DType) -> usize {
    if uses_act_blocks(dtype) {
        MAX_QTOKENS
    } else {
        MAX_TOKENS
    }
}

/// Whether rows of `cols` values in `dtype` are whole 16-byte f16 vectors (the f16 matvec).
pub(super) fn f16_vectors(dtype: DType, cols: usize) -> bool {
    dtype == DType::F16 && cols.is_multiple_of(8)
}

pub(super) fn part_launch(dtype: DType, cols: usize, n: usize) -> PartLaunch {
    if uses_act_blocks(dtype) && n <= MAX_QTOKENS {
        PartLaunch::Blocks
    } else if f16_vectors(dtype, cols) && n <= MAX_TOKENS {
        PartLaunch::F16
    } else {
        PartLaunch::Alone
    }
}

impl CudaBackend {
    /// Quantize `n` rows of `cols` activations at `x` into 8-bit blocks at `out` (workspace).
    pub(super) fn quantize(&self, x: u64, n: usize, cols: usize, out: u64) -> Result<()> {
        let blocks_total = n * cols / 32;
        let nb = blocks_total as i64;
        launches::quantize_q8(
            self.launch(cfg(blocks(blocks_total * 32, 256), 256)),
            x,
            nb,
            out,
        )?;
        Ok(())
    }

    /// `w` times `n` tokens of the f32 activations at `x` (rows of `w.cols`) into columns
    /// `col0..` of the output at `out_p`, `stride` wide, through matvec launches only (as many
    /// tokens a launch as the format takes); block formats quantize the activations into the
    /// workspace at `ws` (the [`WorkspaceOp::Matmul`](crate::footprint::WorkspaceOp) bytes of
    /// this product) unless the one-token kernel does it itself.
    pub(super) fn matvec_rows(
        &self,
        w: WeightRows,
        x: u64,
        n: usize,
        (out_p, stride, col0): (u64, usize, usize),
        ws: u64,
    ) -> Result<()> {
        let per_launch = tokens_per_matvec(w.dtype);
        let matvec = |kernel: launches::Matvec, x_arg: u64, t0: usize, nt: usize| {
            let out = out_p + (t0 * stride * 4) as u64;
            self.launch_matvec(kernel, w, x_arg, nt, (out, stride, col0))
        };
        if uses_act_blocks(w.dtype) && quantizes_in_blocks(n, w.cols) {
            return matvec(launches::matvec_quant_x, x, 0, 1);
        }
        if uses_act_blocks(w.dtype) {
            self.quantize(x, n, w.cols, ws)?;
        }
        for t0 in (0..n).step_by(per_launch) {
            let nt = (n - t0).min(per_launch);
            if uses_act_blocks(w.dtype) {
                let xq = ws + (t0 * (w.cols / 32) * ACT_BLOCK_BYTES) as u64;
                matvec(launches::matvec_quant, xq, t0, nt)?;
            } else {
                let xp = x + (t0 * w.cols * 4) as u64;
                if f16_vectors(w.dtype, w.cols) {
                    matvec(launches::matvec_f16_vec, xp, t0, nt)?;
                } else {
                    matvec(launches::matvec_float, xp, t0, nt)?;
                }
            }
        }
        Ok(())
    }

    /// One-weight matvec `kernel` (they all take the same arguments): `w` times `n` tokens of
    /// `x_arg` (the activations as the kernel takes them) into columns `col0..` of the output at
    /// `out_p`, `stride` wide.
    pub(super) fn launch_matvec(
        &self,
        kernel: launches::Matvec,
        w: WeightRows,
        x_arg: u64,
        n: usize,
        (out_p, stride, col0): (u64, usize, usize),
    ) -> Result<()> {
        let (dt, rows, cols) = (dtype_code(w.dtype), w.rows as i32, w.cols as i32);
        let (nt, stride, c0) = (n as i32, stride as i32, col0 as i32);
        kernel(
            self.launch(cfg(blocks(w.rows, WARPS), WARPS * 32)),
            w.ptr,
            dt,
            rows,
            cols,
            x_arg,
            nt,
            out_p,
            stride,
            c0,
        )?;
        Ok(())
    }

    /// The parts of `parts` that run `how`, `MAX_PARTS` per launch of `kernel` (with `x_arg`:
    /// the activations as the kernel takes them).
    pub(super) fn launch_parts(
        &self,
        kernel: launches::Parts,
        x_arg: u64,
        (cols, n): (usize, usize),
        parts: &[(&CudaWeight, &CudaTensor, usize)],
    ) -> Result<()> {
        for group in parts.chunks(MAX_PARTS) {
            let (ps, grid) = matvec_parts(group);
            let (c, nt) = (cols as i32, n as i32);
            kernel(self.launch(cfg(grid, WARPS * 32)), ps, c, x_arg, nt)?;
        }
        Ok(())
    }
}

/// At most MAX_PARTS `(weight, output, first column)` as one parts launch takes them, and its
/// grid (the blocks of every part's rows).
pub(super) fn matvec_parts(group: &[(&CudaWeight, &CudaTensor, usize)]) -> (MatvecParts, u32) {
    let mut ps = MatvecParts::default();
    let mut grid = 0u32;
    for (slot, &(w, out, col0)) in ps.part.iter_mut().zip(group) {
        *slot = MatvecPart {
            w: w.buf.ptr,
            out: out.buf.ptr,
            dtype: dtype_code(w.dtype),
            rows: w.rows as i32,
            stride: out.cols as i32,
            col0: col0 as i32,
        };
        grid += blocks(w.rows, WARPS);
    }
    ps.count = group.len().min(MAX_PARTS) as i32;
    (ps, grid)
}
