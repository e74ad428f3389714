//! A mixture-of-experts FFN on the device ([`Backend::moe_ffn`](crate::backend::Backend::moe_ffn)):
//! per expert, in expert order, its tokens in passes of at most [`EXPERT_PASS_TOKENS`]: their
//! rows gathered into the workspace, the expert's gate and up rows of the stacks times them (the
//! matvec kernels reading the expert's slice in place), the gated product, its down rows, and
//! each output row added, weighted by its route, into its token's row — the CPU's order of sums.

use super::args::{act_code, elementwise_cfg};
use super::device::{CudaBackend, dev};
use super::launches;
use super::types::{CudaTensor, CudaWeight, WeightRows};
use crate::backend::{Act, BackendError, Experts, Result, Route, WorkspaceOp};
use crate::footprint::workspace::{EXPERT_PASS_TOKENS, experts_layout};

fn shape_err(msg: String) -> BackendError {
    BackendError::Shape { op: "moe_ffn", msg }
}

/// Rows `first .. first + n` of `w`, or the error naming the stack.
fn rows(w: &CudaWeight, first: usize, n: usize) -> Result<WeightRows> {
    w.row_range(first, n).ok_or_else(|| {
        shape_err(format!(
            "rows {first}..{} of `{}` ({} rows)",
            first + n,
            w.name,
            w.rows
        ))
    })
}

pub(super) fn moe_ffn(
    cuda: &CudaBackend,
    experts: Experts<'_, CudaWeight>,
    x: &CudaTensor,
    routes: &[Route],
    act: Act,
    out: &mut CudaTensor,
) -> Result<()> {
    let (d, f) = (x.cols, experts.width);
    let (up, down) = (experts.up, experts.down);
    let by_expert = crate::backend::checks::moe_routes(
        ((x.rows, x.cols), (out.rows, out.cols)),
        &experts,
        |w| (w.rows, w.cols),
        routes,
    )?;
    cuda.bind()?;
    let (_ws, ws) = cuda.workspace_for(WorkspaceOp::Experts {
        tokens: x.rows,
        d_model: d,
        width: f,
        gate: experts.gate.unwrap_or(up).dtype,
        down: down.dtype,
    })?;
    let [xe, hg, hu, ye, products] = experts_layout(x.rows, d, f).map(|o| ws + o);
    super::elementwise::zero(cuda, out)?;
    let row = (d * 4) as u64;
    for (e, tokens) in by_expert.iter().enumerate() {
        for pass in tokens.chunks(EXPERT_PASS_TOKENS) {
            let m = pass.len();
            for (i, &(t, _)) in pass.iter().enumerate() {
                // SAFETY: row `t` of `x` (checked) into row `i` of the pass's input rows (the
                // workspace holds EXPERT_PASS_TOKENS of them); ordered on the compute stream.
                unsafe {
                    cudarc::driver::result::memcpy_dtod_async(
                        xe + i as u64 * row,
                        x.buf.ptr + t as u64 * row,
                        d * 4,
                        cuda.compute.cu_stream(),
                    )
                }
                .map_err(dev)?;
                cuda.counted();
            }
            cuda.matvec_rows(rows(up, e * f, f)?, xe, m, (hu, f, 0), products)?;
            let hidden = match experts.gate {
                Some(g) => {
                    cuda.matvec_rows(rows(g, e * f, f)?, xe, m, (hg, f, 0), products)?;
                    launches::gated_f32(
                        cuda.launch(elementwise_cfg(m * f)),
                        hg,
                        hu,
                        (m * f) as i64,
                        act_code(act),
                        0.0,
                    )?;
                    hg
                }
                None => {
                    launches::activate_f32(
                        cuda.launch(elementwise_cfg(m * f)),
                        hu,
                        (m * f) as i64,
                        act_code(act),
                        0.0,
                    )?;
                    hu
                }
            };
            cuda.matvec_rows(rows(down, e * d, d)?, hidden, m, (ye, d, 0), products)?;
            for (i, &(t, w)) in pass.iter().enumerate() {
                launches::add_scaled_f32(
                    cuda.launch(elementwise_cfg(d)),
                    out.buf.ptr + t as u64 * row,
                    ye + i as u64 * row,
                    w,
                    d as i32,
                )?;
            }
        }
    }
    Ok(())
}
