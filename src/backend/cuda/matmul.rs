//! The products the engine asks for — one weight, several of one input, a gated FFN's gate and
//! up (one launch where a warp can take a row of both) and its down — each through the matvec
//! kernels or cuBLAS, as the tokens and the weights' formats decide.

use super::args::MAX_PARTS;
use super::args::{WARPS, act_code, blocks, cfg, dtype_code, elementwise_cfg};
use super::device::CudaBackend;
use super::gemm::{GemmInput, gemm_input_kind, largest_matmul};
use super::launches;
use super::matvec::{PartLaunch, matvec_parts, part_launch, tokens_per_matvec};
use super::types::{CudaTensor, CudaWeight, check_matmul, check_rms_norm, check_same_shape};
use crate::backend::{Act, Backend, MatmulPart, ProductInput, Result, WorkspaceOp};
use crate::footprint::workspace::quantizes_in_blocks;

pub(super) fn matmul_into(
    cuda: &CudaBackend,
    w: &CudaWeight,
    x: &CudaTensor,
    out: &mut CudaTensor,
    col0: usize,
) -> Result<()> {
    check_matmul(w, x, out, col0)?;
    cuda.bind()?;
    let n = x.rows;
    let (_ws, ws) = cuda.workspace_for(WorkspaceOp::Matmul {
        dtype: w.dtype,
        tokens: n,
        rows: w.rows,
        cols: w.cols,
    })?;
    let per_launch = tokens_per_matvec(w.dtype);
    if n > per_launch && cuda.gemm(w, x, out, col0, ws)? {
        return Ok(());
    }
    cuda.matvec_rows(
        w.all_rows(),
        x.buf.ptr,
        n,
        (out.buf.ptr, out.cols, col0),
        ws,
    )
}

pub(super) fn matmul_parts(
    cuda: &CudaBackend,
    x: &CudaTensor,
    parts: &[MatmulPart<'_, CudaWeight>],
    outs: &mut [&mut CudaTensor],
) -> Result<()> {
    crate::backend::check_parts(parts, outs.len())?;
    cuda.bind()?;
    let n = x.rows;
    for p in parts {
        check_matmul(p.w, x, outs[p.out], p.col0)?;
    }
    let how: Vec<PartLaunch> = parts
        .iter()
        .map(|p| part_launch(p.w.dtype, p.w.cols, n))
        .collect();
    // A weight alone of its kind gains nothing from a parts launch.
    let shares =
        |k: PartLaunch| k != PartLaunch::Alone && how.iter().filter(|&&h| h == k).count() > 1;
    // The rest go one by one, but those multiplied through cuBLAS (more tokens than a
    // matvec launch takes) share one conversion of x per kind of input.
    let by_gemm =
        |p: &MatmulPart<'_, CudaWeight>| cuda.blas.is_some() && n > tokens_per_matvec(p.w.dtype);
    for kind in [GemmInput::F32, GemmInput::F16, GemmInput::BF16] {
        let group: Vec<&MatmulPart<'_, CudaWeight>> = parts
            .iter()
            .zip(&how)
            .filter(|&(p, &h)| !shares(h) && by_gemm(p) && gemm_input_kind(p.w.dtype) == kind)
            .map(|(p, _)| p)
            .collect();
        let Some(first) = group.first() else {
            continue;
        };
        let (_ws, ws) = cuda.workspace_for(largest_matmul(n, group.iter().map(|p| p.w)))?;
        let input = cuda.gemm_input(x, first.w.dtype, ws)?;
        for p in &group {
            cuda.gemm_from(p.w, input, x, outs[p.out], p.col0, ws)?;
        }
    }
    for (p, &h) in parts.iter().zip(&how) {
        if !shares(h) && !by_gemm(p) {
            cuda.matmul_into(p.w, x, outs[p.out], p.col0)?;
        }
    }
    for (kind, kernel) in [
        (
            PartLaunch::Blocks,
            launches::matvec_quant_parts as launches::Parts,
        ),
        (PartLaunch::F16, launches::matvec_f16_parts),
    ] {
        if !shares(kind) {
            continue;
        }
        let group: Vec<(&CudaWeight, &CudaTensor, usize)> = parts
            .iter()
            .zip(&how)
            .filter(|&(_, &h)| h == kind)
            .map(|(p, _)| (p.w, &*outs[p.out], p.col0))
            .collect();
        if kind == PartLaunch::Blocks && quantizes_in_blocks(n, x.cols) {
            cuda.launch_parts(
                launches::matvec_quant_parts_x,
                x.buf.ptr,
                (x.cols, n),
                &group,
            )?;
        } else if kind == PartLaunch::Blocks {
            // The activations quantized once, into the workspace one matmul of them takes.
            let w = group[0].0;
            let (_ws, ws) = cuda.workspace_for(WorkspaceOp::Matmul {
                dtype: w.dtype,
                tokens: n,
                rows: w.rows,
                cols: w.cols,
            })?;
            cuda.quantize(x.buf.ptr, n, x.cols, ws)?;
            cuda.launch_parts(kernel, ws, (x.cols, n), &group)?;
        } else {
            cuda.launch_parts(kernel, x.buf.ptr, (x.cols, n), &group)?;
        }
    }
    Ok(())
}

pub(super) fn matmul_parts_of(
    cuda: &CudaBackend,
    input: ProductInput<'_, CudaBackend>,
    parts: &[MatmulPart<'_, CudaWeight>],
    outs: &mut [&mut CudaTensor],
) -> Result<()> {
    match input {
        // Every part through cuBLAS with f16 input: the norm writes that input, where its
        // f32 rows would be written, read back and converted.
        ProductInput::RmsNorm {
            x,
            add,
            weight,
            eps,
            out,
        } if cuda.parts_take_f16_gemms(x.rows, parts) => {
            crate::backend::check_parts(parts, outs.len())?;
            check_rms_norm(x, weight, out)?;
            if let Some(y) = add {
                check_same_shape("add", x, y)?;
            }
            for p in parts {
                check_matmul(p.w, x, outs[p.out], p.col0)?;
            }
            cuda.bind()?;
            let most = largest_matmul(x.rows, parts.iter().map(|p| p.w));
            let (_ws, ws) = cuda.workspace_for(most)?;
            cuda.rms_norm_to_f16(x, add, weight, eps, ws)?;
            for p in parts {
                cuda.gemm_from(p.w, ws, x, outs[p.out], p.col0, ws)?;
            }
            Ok(())
        }
        // Block formats through the matvecs: the norm writes their 8-bit input, or runs
        // inside them.
        ProductInput::RmsNorm {
            x,
            add,
            weight,
            eps,
            out,
        } if normed_blocks(x, parts.iter().map(|p| p.w)) => {
            crate::backend::check_parts(parts, outs.len())?;
            for p in parts {
                check_matmul(p.w, x, outs[p.out], p.col0)?;
            }
            let group: Vec<(&CudaWeight, &CudaTensor, usize)> =
                parts.iter().map(|p| (p.w, &*outs[p.out], p.col0)).collect();
            normed_block_parts(cuda, (x, add, weight, eps, out), &group)
        }
        input => {
            let x = input.rows(cuda)?;
            cuda.matmul_parts(x, parts, outs)
        }
    }
}

/// A pending RMSNorm as [`normed_block_parts`] and [`gate_up_down`] take it apart: the residual
/// `x`, what is added to it first, the norm's weight and epsilon, and its (unwritten) output.
type PendingNorm<'a> = (
    &'a mut CudaTensor,
    Option<&'a CudaTensor>,
    &'a CudaWeight,
    f32,
    &'a mut CudaTensor,
);

/// Whether products of a pending RMSNorm of `x` by `weights` take it into their matvecs: some
/// weights, every one a block format whose matvec takes this many tokens (8-bit activations).
fn normed_blocks<'a>(x: &CudaTensor, weights: impl Iterator<Item = &'a CudaWeight>) -> bool {
    let mut any = false;
    for w in weights {
        if part_launch(w.dtype, w.cols, x.rows) != PartLaunch::Blocks {
            return false;
        }
        any = true;
    }
    any
}

/// The norm checked and, where the products' blocks quantize one token themselves (rows up to
/// QX_MAX_COLS), left to them (`Ok(true)`: the kernel norms, quantizes and writes the residual
/// once); else run, writing the products' 8-bit activations at `ws` (`Ok(false)`): either way
/// one launch fewer than the norm, then a quantize launch or the in-block quantization.
fn pending_norm_to_q8(cuda: &CudaBackend, norm: &mut PendingNorm<'_>, ws: u64) -> Result<bool> {
    let (x, add, weight, eps, out) = norm;
    check_rms_norm(x, weight, out)?;
    if let Some(y) = add {
        check_same_shape("add", x, y)?;
    }
    cuda.bind()?;
    if quantizes_in_blocks(x.rows, x.cols) {
        return Ok(true);
    }
    cuda.rms_norm_to_q8(x, *add, weight, *eps, ws)?;
    Ok(false)
}

/// The products of a pending RMSNorm of `x` by block-format weights (`group`: weight, output,
/// first column), each part computed as `matmul_parts` computes it from the normed rows, the
/// residual written as add_rms_norm writes it.
fn normed_block_parts(
    cuda: &CudaBackend,
    mut norm: PendingNorm<'_>,
    group: &[(&CudaWeight, &CudaTensor, usize)],
) -> Result<()> {
    let (n, cols) = (norm.0.rows, norm.0.cols);
    let (_ws, ws) = cuda.workspace_for(largest_matmul(n, group.iter().map(|g| g.0)))?;
    let in_blocks = pending_norm_to_q8(cuda, &mut norm, ws)?;
    if !in_blocks {
        return cuda.launch_parts(launches::matvec_quant_parts, ws, (cols, n), group);
    }
    let (x, add, weight, eps, _) = norm;
    for (i, chunk) in group.chunks(MAX_PARTS).enumerate() {
        let (ps, grid) = matvec_parts(chunk);
        // The first launch adds the residual (written once); the rest norm it as written.
        let add_p = add.filter(|_| i == 0).map_or(0, |y| y.buf.ptr);
        launches::matvec_quant_parts_norm(
            cuda.launch(cfg(grid, WARPS * 32)),
            ps,
            cols as i32,
            x.buf.ptr,
            add_p,
            weight.buf.ptr,
            eps,
            cuda.norm_ticket(),
        )?;
    }
    Ok(())
}

pub(super) fn gate_up(
    cuda: &CudaBackend,
    x: &CudaTensor,
    (w_gate, w_up): (&CudaWeight, &CudaWeight),
    (act, threshold): (Act, f32),
    gate: &mut CudaTensor,
    up: &mut CudaTensor,
) -> Result<()> {
    check_matmul(w_gate, x, gate, 0)?;
    check_matmul(w_up, x, up, 0)?;
    check_same_shape("gate_up", gate, up)?;
    let n = x.rows;
    let how = part_launch(w_gate.dtype, w_gate.cols, n);
    // One launch where a warp can take a row of both (the same kind of matvec, the same
    // rows) and the gated product covers exactly what the two products write.
    if how == PartLaunch::Alone
        || how != part_launch(w_up.dtype, w_up.cols, n)
        || w_gate.rows != w_up.rows
        || gate.cols != w_gate.rows
    {
        return crate::backend::gate_then_up(cuda, x, (w_gate, w_up), (act, threshold), gate, up);
    }
    cuda.bind()?;
    let launch = |kernel: launches::GateUp, x_arg: u64| -> Result<()> {
        let (dg, du) = (dtype_code(w_gate.dtype), dtype_code(w_up.dtype));
        let (rows, cols, nt) = (w_gate.rows as i32, w_gate.cols as i32, n as i32);
        let (kind, stride) = (act_code(act), gate.cols as i32);
        kernel(
            cuda.launch(cfg(blocks(w_gate.rows, WARPS), WARPS * 32)),
            w_gate.buf.ptr,
            dg,
            w_up.buf.ptr,
            du,
            rows,
            cols,
            x_arg,
            nt,
            kind,
            threshold,
            gate.buf.ptr,
            stride,
        )
    };
    if how == PartLaunch::F16 {
        return launch(launches::matvec_f16_gate_up, x.buf.ptr);
    }
    if quantizes_in_blocks(n, x.cols) {
        return launch(launches::matvec_quant_gate_up_x, x.buf.ptr);
    }
    // The activations quantized once, into the workspace one matmul of them takes.
    let (_ws, ws) = cuda.workspace_for(WorkspaceOp::Matmul {
        dtype: w_gate.dtype,
        tokens: n,
        rows: w_gate.rows,
        cols: w_gate.cols,
    })?;
    cuda.quantize(x.buf.ptr, n, x.cols, ws)?;
    launch(launches::matvec_quant_gate_up, ws)
}

pub(super) fn gate_up_down(
    cuda: &CudaBackend,
    input: ProductInput<'_, CudaBackend>,
    (w_gate, w_up, w_down): (&CudaWeight, &CudaWeight, &CudaWeight),
    (act, threshold): (Act, f32),
    (gate, up): (&mut CudaTensor, &mut CudaTensor),
    out: &mut CudaTensor,
) -> Result<()> {
    let n = input.shaped_as().rows;
    // Gate and up of block formats through the matvecs: the norm writes their 8-bit input, or
    // runs inside them; then down.
    let input = match input {
        ProductInput::RmsNorm {
            x,
            add,
            weight,
            eps,
            out: normed,
        } if normed_blocks(x, [w_gate, w_up].into_iter())
            && w_gate.rows == w_up.rows
            && gate.cols == w_gate.rows =>
        {
            check_matmul(w_gate, x, gate, 0)?;
            check_matmul(w_up, x, up, 0)?;
            check_same_shape("gate_up", gate, up)?;
            normed_gate_up(
                cuda,
                (x, add, weight, eps, normed),
                (w_gate, w_up),
                (act, threshold),
                gate,
            )?;
            return cuda.matmul(w_down, gate, out);
        }
        input => input,
    };
    // Every product through cuBLAS, down's input in f16: the gated product goes straight
    // there (gated_to_f16), where gated_f32 then the conversion would write it twice.
    let by_gemm = |w: &CudaWeight| n > tokens_per_matvec(w.dtype);
    if cuda.blas.is_none()
        || !(by_gemm(w_gate) && by_gemm(w_up) && by_gemm(w_down))
        || gemm_input_kind(w_down.dtype) != GemmInput::F16
    {
        let ws = (w_gate, w_up, w_down);
        let x = input.rows(cuda)?;
        return crate::backend::gate_up_then_down(cuda, x, ws, (act, threshold), (gate, up), out);
    }
    check_same_shape("gate_up_down", gate, up)?;
    check_matmul(w_down, gate, out, 0)?;
    crate::backend::gate_and_up(cuda, input, (w_gate, w_up), gate, up)?;
    cuda.bind()?;
    // The workspace down's product takes alone: its f16 input at the start, where
    // gemm_input would convert it.
    let (_ws, ws) = cuda.workspace_for(WorkspaceOp::Matmul {
        dtype: w_down.dtype,
        tokens: n,
        rows: w_down.rows,
        cols: w_down.cols,
    })?;
    let len = gate.rows * gate.cols;
    launches::gated_to_f16(
        cuda.launch(elementwise_cfg(len)),
        gate.buf.ptr,
        up.buf.ptr,
        ws,
        len as i64,
        act_code(act),
        threshold,
    )?;
    cuda.gemm_from(w_down, ws, gate, out, 0, ws)
}

/// A gated FFN's hidden activations (into `gate`) from a pending RMSNorm of `x` by block-format
/// gate and up weights of the same rows: as `gate_up` computes them from the normed rows, the
/// residual written as add_rms_norm writes it.
fn normed_gate_up(
    cuda: &CudaBackend,
    mut norm: PendingNorm<'_>,
    (w_gate, w_up): (&CudaWeight, &CudaWeight),
    (act, threshold): (Act, f32),
    gate: &mut CudaTensor,
) -> Result<()> {
    let (n, cols) = (norm.0.rows, norm.0.cols);
    let (_ws, ws) = cuda.workspace_for(largest_matmul(n, [w_gate, w_up].into_iter()))?;
    let in_blocks = pending_norm_to_q8(cuda, &mut norm, ws)?;
    let (dg, du) = (dtype_code(w_gate.dtype), dtype_code(w_up.dtype));
    let (rows, c, kind, stride) = (
        w_gate.rows as i32,
        cols as i32,
        act_code(act),
        gate.cols as i32,
    );
    let launch = cuda.launch(cfg(blocks(w_gate.rows, WARPS), WARPS * 32));
    let (wg, wu) = (w_gate.buf.ptr, w_up.buf.ptr);
    if !in_blocks {
        let nt = n as i32;
        return launches::matvec_quant_gate_up(
            launch,
            wg,
            dg,
            wu,
            du,
            rows,
            c,
            ws,
            nt,
            kind,
            threshold,
            gate.buf.ptr,
            stride,
        );
    }
    let (x, add, weight, eps, _) = norm;
    launches::matvec_quant_gate_up_norm(
        launch,
        wg,
        dg,
        wu,
        du,
        rows,
        c,
        x.buf.ptr,
        add.map_or(0, |y| y.buf.ptr),
        weight.buf.ptr,
        eps,
        kind,
        threshold,
        gate.buf.ptr,
        stride,
        cuda.norm_ticket(),
    )
}
