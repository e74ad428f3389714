//! The argument checks every backend runs alike, so that each refuses a bad call with the same
//! words: a weight's bytes in a format, a product's shape and parts, two operands of one shape.
//! Checks on one backend's own handles stay with that backend; these take plain numbers.

use super::args::MatmulPart;
use super::{BackendError, Result};
use crate::tensor::DType;

/// Bytes `rows × cols` values in `dtype` take, if the shape is valid for the format (whole blocks
/// per row): what [`Backend::retype_weight`](super::Backend::retype_weight) checks against a
/// buffer's size.
pub fn weight_bytes(dtype: DType, rows: usize, cols: usize) -> Option<usize> {
    cols.is_multiple_of(dtype.block_len())
        .then(|| rows.checked_mul(dtype.bytes_for(cols)))
        .flatten()
}

/// The bytes [`Backend::retype_weight`](super::Backend::retype_weight) gives `name` as `rows ×
/// cols` in `dtype`, if the shape is valid for the format and fits its `capacity`; else the error
/// naming both.
pub fn retyped_bytes(
    name: &str,
    dtype: DType,
    rows: usize,
    cols: usize,
    capacity: u64,
) -> Result<usize> {
    weight_bytes(dtype, rows, cols)
        .filter(|&n| n as u64 <= capacity)
        .ok_or_else(|| BackendError::Shape {
            op: "retype_weight",
            msg: format!("{rows}x{cols} {dtype} does not fit `{name}` ({capacity} bytes)"),
        })
}

/// A mixture-of-experts FFN's shapes, each as `(rows, cols)` (`shape` reads a backend's
/// weight): `x` and `out` rows of `d`, the experts' stacks `up` (and `gate`: `E·width × d`) and
/// `down` (`E·d × width`); and `routes` to those experts for those rows. Every backend's
/// `moe_ffn` check: the routes grouped by expert, in expert order, each expert's `(row, weight)`
/// in route order.
pub fn moe_routes<W>(
    (x, out): ((usize, usize), (usize, usize)),
    experts: &super::Experts<'_, W>,
    shape: impl Fn(&W) -> (usize, usize),
    routes: &[super::Route],
) -> Result<Vec<Vec<(usize, f32)>>> {
    let (gate, up, down, width) = (
        experts.gate.map(&shape),
        shape(experts.up),
        shape(experts.down),
        experts.width,
    );
    let err = |msg: String| BackendError::Shape { op: "moe_ffn", msg };
    let d = x.1;
    let count = up.0.checked_div(width).unwrap_or(0);
    let fits = |w: (usize, usize), r: usize, c: usize| w == (r, c);
    if x != out
        || count == 0
        || !fits(up, count * width, d)
        || !fits(down, count * d, width)
        || gate.is_some_and(|g| !fits(g, count * width, d))
    {
        return Err(err(format!(
            "experts of {width} neurons over {}x{} up and {}x{} down, {}x{d} rows into {}x{}",
            up.0, up.1, down.0, down.1, x.0, out.0, out.1
        )));
    }
    let mut by_expert: Vec<Vec<(usize, f32)>> = vec![Vec::new(); count];
    for r in routes {
        let (t, e) = (r.token as usize, r.expert as usize);
        if t >= x.0 || e >= count {
            return Err(err(format!(
                "route to expert {e} of {count} for row {t} of {}",
                x.0
            )));
        }
        by_expert[e].push((t, r.weight));
    }
    Ok(by_expert)
}

/// `x` (rows × cols) times weight `name`ᵀ (rows × cols) fits columns `col0..` of `out`
/// (rows × cols): every backend's matmul check.
pub fn check_matmul_shape(
    name: &str,
    (w_rows, w_cols): (usize, usize),
    (x_rows, x_cols): (usize, usize),
    (out_rows, out_cols): (usize, usize),
    col0: usize,
) -> Result<()> {
    if x_cols != w_cols || out_rows != x_rows || col0 + w_rows > out_cols {
        return Err(BackendError::Shape {
            op: "matmul",
            msg: format!(
                "{x_rows}x{x_cols} · ({name}: {w_rows}x{w_cols})ᵀ into columns {col0}.. of \
                 {out_rows}x{out_cols}"
            ),
        });
    }
    Ok(())
}

/// Two operands an op takes value by value: the same shape (`(rows, cols)` each), else why not.
pub fn check_same_shape(
    op: &'static str,
    (a_rows, a_cols): (usize, usize),
    (b_rows, b_cols): (usize, usize),
) -> Result<()> {
    if (a_rows, a_cols) != (b_rows, b_cols) {
        return Err(BackendError::Shape {
            op,
            msg: format!("{a_rows}x{a_cols} vs {b_rows}x{b_cols}"),
        });
    }
    Ok(())
}

/// Every part of [`Backend::matmul_parts`](super::Backend::matmul_parts) names one of `outs`
/// outputs.
pub fn check_parts<W>(parts: &[MatmulPart<'_, W>], outs: usize) -> Result<()> {
    match parts.iter().position(|p| p.out >= outs) {
        Some(i) => Err(BackendError::Shape {
            op: "matmul_parts",
            msg: format!("part {i} writes output {} of {outs}", parts[i].out),
        }),
        None => Ok(()),
    }
}

/// A RoPE over rows of `cols` values in heads of `head_dim`, rotating the first `rot_dims` of each
/// head, with `freqs` inverse frequencies where the backend checks them here: else the error
/// every backend names.
pub fn check_rope(
    cols: usize,
    head_dim: usize,
    rot_dims: usize,
    freqs: Option<usize>,
) -> Result<()> {
    if head_dim == 0
        || !cols.is_multiple_of(head_dim)
        || rot_dims > head_dim
        || !rot_dims.is_multiple_of(2)
        || freqs.is_some_and(|f| f != rot_dims / 2)
    {
        return Err(BackendError::Shape {
            op: "rope",
            msg: format!("{cols} columns, head dim {head_dim}, rotating {rot_dims}"),
        });
    }
    Ok(())
}
