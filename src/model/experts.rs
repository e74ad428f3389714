//! A mixture-of-experts layer's experts as one FFN, each expert's matrices stacked after the
//! last expert's as llama.cpp's 3-D `ffn_*_exps` hold them: gate and up `E·d_expert × d_model`
//! (expert `e` is rows `e·d_expert ..`), down `E·d_model × d_expert` (expert `e`'s own
//! `d_model × d_expert` matrix is rows `e·d_model ..`). So expert `e` is one contiguous slice of
//! each (a GGUF's tensors are used in place), and neurons `e·d_expert .. (e+1)·d_expert` of an
//! FFN of `d_ff = E × d_expert` (see [`super::spec::MoeSpec`]). Bytes are copied as they are
//! where parts are stacked: any format whose blocks tile the rows.

use super::ModelError;
use crate::tensor::{Bytes, HostTensor};

/// A layer's experts, each as its own gate, up and down matrix, as the stacked gate, up and
/// down (named `{base}.gate` …).
pub fn ffn_of_experts(
    base: &str,
    [gate, up, down]: [Vec<HostTensor>; 3],
) -> Result<[HostTensor; 3], ModelError> {
    Ok([
        stack_rows(&format!("{base}.gate"), &gate)?,
        stack_rows(&format!("{base}.up"), &up)?,
        stack_rows(&format!("{base}.down"), &down)?,
    ])
}

/// A layer's stacked experts `[gate, up, down]` and router with a shared expert (Qwen2-MoE)
/// appended as `parts` more experts (its wide gate and up cut by rows, its down by columns)
/// and its gate vector as the router's last row (see [`super::spec::MoeSpec`]).
pub fn with_shared_expert(
    [gate, up, down]: [HostTensor; 3],
    router: HostTensor,
    [s_gate, s_up, s_down, s_router]: [HostTensor; 4],
    parts: usize,
) -> Result<([HostTensor; 3], HostTensor), ModelError> {
    let after = |t: HostTensor, more: Vec<HostTensor>| {
        let name = t.name.clone();
        concat_rows(&name, &[vec![t], more].concat())
    };
    let mut s_router = s_router;
    (s_router.rows, s_router.cols) = (1, s_router.rows * s_router.cols);
    Ok((
        [
            after(gate, split_rows(&s_gate, parts)?)?,
            after(up, split_rows(&s_up, parts)?)?,
            after(down, split_columns(&s_down, parts)?)?,
        ],
        after(router, vec![s_router])?,
    ))
}

/// `parts` (each `rows × cols`, one format) one under the other: `Σ rows × cols`.
pub fn stack_rows(name: &str, parts: &[HostTensor]) -> Result<HostTensor, ModelError> {
    same_shapes(name, parts)?;
    concat_rows(name, parts)
}

/// `parts` of any row counts but one width and format, one under the other.
pub fn concat_rows(name: &str, parts: &[HostTensor]) -> Result<HostTensor, ModelError> {
    let first = parts
        .first()
        .ok_or_else(|| format_err(name, "no parts".into()))?;
    if let Some(p) = parts
        .iter()
        .find(|p| (p.cols, p.dtype) != (first.cols, first.dtype))
    {
        return Err(format_err(
            name,
            format!(
                "`{}` has rows of {} {} values, `{}` of {} {}",
                p.name, p.cols, p.dtype, first.name, first.cols, first.dtype
            ),
        ));
    }
    let mut bytes = Vec::with_capacity(parts.iter().map(|p| p.data.len()).sum());
    for p in parts {
        bytes.extend_from_slice(p.data.as_slice());
    }
    Ok(HostTensor {
        name: name.to_string(),
        rows: parts.iter().map(|p| p.rows).sum(),
        cols: first.cols,
        dtype: first.dtype,
        data: Bytes::from_slice(&bytes),
    })
}

/// `t` cut into `n` equal matrices of consecutive rows (a wide FFN's gate or up as `n`
/// narrower ones).
pub fn split_rows(t: &HostTensor, n: usize) -> Result<Vec<HostTensor>, ModelError> {
    if n == 0 || !t.rows.is_multiple_of(n) {
        return Err(format_err(
            &t.name,
            format!("{} rows are not {n} equal parts", t.rows),
        ));
    }
    let (rows, rb) = (t.rows / n, t.row_bytes());
    Ok((0..n)
        .map(|i| HostTensor {
            name: format!("{}.part{i}", t.name),
            rows,
            cols: t.cols,
            dtype: t.dtype,
            data: Bytes::from_slice(&t.data.as_slice()[i * rows * rb..(i + 1) * rows * rb]),
        })
        .collect())
}

/// `t` cut into `n` equal matrices of consecutive columns (a wide FFN's down as `n` narrower
/// ones); each part's rows must be whole blocks of its format.
pub fn split_columns(t: &HostTensor, n: usize) -> Result<Vec<HostTensor>, ModelError> {
    let block = t.dtype.block_len();
    if n == 0 || !t.cols.is_multiple_of(n) || !(t.cols / n).is_multiple_of(block) {
        return Err(format_err(
            &t.name,
            format!(
                "{} columns are not {n} equal parts of whole {} blocks",
                t.cols, t.dtype
            ),
        ));
    }
    let cols = t.cols / n;
    let (rb, part_rb) = (t.row_bytes(), t.dtype.bytes_for(cols));
    let src = t.data.as_slice();
    Ok((0..n)
        .map(|i| {
            let mut bytes = Vec::with_capacity(part_rb * t.rows);
            for r in 0..t.rows {
                let at = r * rb + i * part_rb;
                bytes.extend_from_slice(&src[at..at + part_rb]);
            }
            HostTensor {
                name: format!("{}.part{i}", t.name),
                rows: t.rows,
                cols,
                dtype: t.dtype,
                data: Bytes::from_slice(&bytes),
            }
        })
        .collect())
}

fn same_shapes<'a>(name: &str, parts: &'a [HostTensor]) -> Result<&'a HostTensor, ModelError> {
    let first = parts
        .first()
        .ok_or_else(|| format_err(name, "no experts".into()))?;
    for p in parts {
        if (p.rows, p.cols, p.dtype) != (first.rows, first.cols, first.dtype) {
            return Err(format_err(
                name,
                format!(
                    "expert tensor `{}` is {}x{} {}, `{}` {}x{} {}: every expert has one shape and format",
                    p.name,
                    p.rows,
                    p.cols,
                    p.dtype,
                    first.name,
                    first.rows,
                    first.cols,
                    first.dtype
                ),
            ));
        }
    }
    Ok(first)
}

fn format_err(name: &str, msg: String) -> ModelError {
    ModelError::Format {
        path: name.into(),
        msg,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(name: &str, rows: usize, cols: usize, base: f32) -> HostTensor {
        let v = (0..rows * cols).map(|i| base + i as f32).collect();
        HostTensor::from_f32(name, rows, cols, v)
    }

    #[test]
    fn experts_stack_as_neurons() {
        let (a, b) = (t("a", 2, 3, 0.0), t("b", 2, 3, 100.0));
        let rows = stack_rows("up", &[a, b]).unwrap();
        assert_eq!((rows.rows, rows.cols), (4, 3));
        assert_eq!(
            rows.to_f32(),
            [0., 1., 2., 3., 4., 5., 100., 101., 102., 103., 104., 105.]
        );
    }

    #[test]
    fn experts_of_different_shapes_are_refused() {
        let e = stack_rows("up", &[t("a", 2, 3, 0.0), t("b", 3, 3, 0.0)]).unwrap_err();
        assert!(e.to_string().contains("every expert has one shape"), "{e}");
    }

    #[test]
    fn a_wide_ffn_splits_into_parts_that_stack_back() {
        let gate = t("g", 6, 4, 0.0);
        let down = t("d", 4, 6, 100.0);
        let g = split_rows(&gate, 3).unwrap();
        assert_eq!((g.len(), g[1].rows, g[1].cols), (3, 2, 4));
        assert_eq!(
            stack_rows("g", &g).unwrap().data.as_slice(),
            gate.data.as_slice()
        );
        let d = split_columns(&down, 3).unwrap();
        assert_eq!((d[2].rows, d[2].cols), (4, 2));
        assert_eq!(d[2].to_f32()[..2], [104.0, 105.0]);
        assert_eq!(
            d[0].to_f32()[2..4],
            [106.0, 107.0],
            "row 1 of the first part"
        );
        assert!(split_rows(&gate, 4).is_err() && split_columns(&down, 4).is_err());
        let r = concat_rows("r", &[t("a", 3, 4, 0.0), t("b", 1, 4, 9.0)]).unwrap();
        assert_eq!((r.rows, r.to_f32()[12]), (4, 9.0));
        assert!(concat_rows("r", &[t("a", 3, 4, 0.0), t("b", 1, 5, 9.0)]).is_err());
    }
}
