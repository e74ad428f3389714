//! Products of many rows through cuBLAS (f32 accumulation): float weights with the activations
//! converted to their type, block formats decoded tile by tile to f16 (`dequant_f16`,
//! kernels/matvec.cu) beside the converted activations in the workspace.

use std::sync::Mutex;

use cudarc::cublas::sys as blas_sys;

use super::args::{blocks, cfg, dtype_code, elementwise_cfg};
use super::device::{BlasState, CudaBackend};
use super::launches;
use super::matvec::tokens_per_matvec;
use super::types::{CudaTensor, CudaWeight};
use crate::backend::{BackendError, MatmulPart, Result, WorkspaceOp};
use crate::footprint::device_bytes;
use crate::footprint::workspace::{dequant_tile_rows, workspace_bytes};
use crate::tensor::DType;

/// What cuBLAS multiplies weights of a format with: the activations as they are (f32), or
/// converted to f16 (f16 weights, and block formats' f16 tiles) or to bf16.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum GemmInput {
    F32,
    F16,
    BF16,
}

pub(super) fn gemm_input_kind(dtype: DType) -> GemmInput {
    match dtype {
        DType::F32 => GemmInput::F32,
        DType::BF16 => GemmInput::BF16,
        _ => GemmInput::F16,
    }
}

/// The workspace the largest of several products of `n` rows (`weights`, at least one) takes:
/// each alone takes no more, so one conversion of their input serves them all.
pub(super) fn largest_matmul<'a>(
    n: usize,
    weights: impl Iterator<Item = &'a CudaWeight>,
) -> WorkspaceOp {
    weights
        .map(|w| WorkspaceOp::Matmul {
            dtype: w.dtype,
            tokens: n,
            rows: w.rows,
            cols: w.cols,
        })
        .max_by_key(workspace_bytes)
        .unwrap_or(WorkspaceOp::Matmul {
            dtype: DType::F16,
            tokens: n,
            rows: 0,
            cols: 0,
        })
}

impl CudaBackend {
    /// `out[:, col0..col0+rows] = x · Wᵀ` through cuBLAS (f32 accumulation): float weights
    /// with x converted to the weight's type, block formats decoded tile by tile to f16 (x to
    /// f16). Returns false where cuBLAS is absent.
    pub(super) fn gemm(
        &self,
        w: &CudaWeight,
        x: &CudaTensor,
        out: &CudaTensor,
        col0: usize,
        ws: u64,
    ) -> Result<bool> {
        if self.blas.is_none() {
            return Ok(false);
        }
        let input = self.gemm_input(x, w.dtype, ws)?;
        self.gemm_from(w, input, x, out, col0, ws)?;
        Ok(true)
    }

    /// `x` as cuBLAS multiplies it with weights of `dtype`: f32 as it is, else converted at the
    /// workspace's start (bf16 for bf16 weights, f16 for the rest); its address. Weights whose
    /// inputs are alike ([`gemm_input_kind`]) can share one conversion.
    pub(super) fn gemm_input(&self, x: &CudaTensor, dtype: DType, ws: u64) -> Result<u64> {
        let convert = match gemm_input_kind(dtype) {
            GemmInput::F32 => return Ok(x.buf.ptr),
            GemmInput::F16 => launches::f32_to_f16,
            GemmInput::BF16 => launches::f32_to_bf16,
        };
        let len = (x.rows * x.cols) as i64;
        convert(
            self.launch(elementwise_cfg(x.rows * x.cols)),
            x.buf.ptr,
            ws,
            len,
        )?;
        Ok(ws)
    }

    /// Whether every part of a product of `n` rows goes through cuBLAS with f16 input: what a
    /// pending norm's rows can be written as straight away.
    pub(super) fn parts_take_f16_gemms(
        &self,
        n: usize,
        parts: &[MatmulPart<'_, CudaWeight>],
    ) -> bool {
        self.blas.is_some()
            && !parts.is_empty()
            && parts.iter().all(|p| {
                n > tokens_per_matvec(p.w.dtype) && gemm_input_kind(p.w.dtype) == GemmInput::F16
            })
    }

    /// The GEMM(s) of [`CudaBackend::gemm`] over `input` ([`CudaBackend::gemm_input`] of `x`
    /// for `w`'s format): block formats' decoded tiles go after the converted input.
    pub(super) fn gemm_from(
        &self,
        w: &CudaWeight,
        input: u64,
        x: &CudaTensor,
        out: &CudaTensor,
        col0: usize,
        ws: u64,
    ) -> Result<()> {
        let Some(blas) = &self.blas else {
            return Err(BackendError::Device("cuBLAS is not loaded".into()));
        };
        use blas_sys::cudaDataType as T;
        let (n, k, m) = (x.rows, x.cols, w.rows);
        let out_at = |row: usize| out.buf.ptr + 4 * (col0 + row) as u64;
        let ty = match w.dtype {
            DType::F32 => T::CUDA_R_32F,
            DType::BF16 => T::CUDA_R_16BF,
            DType::F16 => T::CUDA_R_16F,
            dtype => {
                // Workspace: [x in f16][one decoded tile], as workspace_bytes counts them.
                let tile_ptr = ws + device_bytes((n * k * 2) as u64);
                let tile_rows = dequant_tile_rows(m, k);
                let (dt, cols) = (dtype_code(dtype), k as i32);
                for r0 in (0..m).step_by(tile_rows) {
                    let rows = tile_rows.min(m - r0);
                    let (row0, nrows) = (r0 as i32, rows as i32);
                    let wp = w.buf.ptr;
                    launches::dequant_f16(
                        self.launch(cfg(blocks(rows * k / 8, 256), 256)),
                        wp,
                        dt,
                        row0,
                        nrows,
                        cols,
                        tile_ptr,
                    )?;
                    let c = out_at(r0);
                    self.gemm_call(
                        blas,
                        tile_ptr,
                        input,
                        T::CUDA_R_16F,
                        rows,
                        n,
                        k,
                        c,
                        out.cols,
                    )?;
                }
                return Ok(());
            }
        };
        self.gemm_call(blas, w.buf.ptr, input, ty, m, n, k, out_at(0), out.cols)
    }

    /// One cuBLAS GEMM: C (`m` × `n`, column-major, leading dimension `ldc`) = Aᵀ · B, where A is
    /// `m` rows of `k` values as stored (row-major) and B is `n` rows of `k` values.
    #[allow(clippy::too_many_arguments)]
    fn gemm_call(
        &self,
        blas: &Mutex<BlasState>,
        a: u64,
        b: u64,
        ty: blas_sys::cudaDataType,
        m: usize,
        n: usize,
        k: usize,
        c: u64,
        ldc: usize,
    ) -> Result<()> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        let state = blas
            .lock()
            .map_err(|_| BackendError::Device("cuBLAS handle poisoned".into()))?;
        // SAFETY: pointers are live device buffers of the shapes checked by matmul_into (the
        // weight, the workspace sized by workspace_bytes, the output's columns).
        let st = unsafe {
            blas_sys::cublasGemmEx(
                *state.handle.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                m as i32,
                n as i32,
                k as i32,
                &alpha as *const f32 as *const _,
                a as *const _,
                ty,
                k as i32,
                b as *const _,
                ty,
                k as i32,
                &beta as *const f32 as *const _,
                c as *mut _,
                blas_sys::cudaDataType::CUDA_R_32F,
                ldc as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        if st != blas_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Err(BackendError::Device(format!("cublasGemmEx: {st:?}")));
        }
        self.counted();
        Ok(())
    }
}
