//! A mixture-of-experts layer's experts as one FFN: expert `e`'s gate and up rows stacked after
//! expert `e − 1`'s, its down columns beside them, so expert `e` is neurons
//! `e·d_expert .. (e+1)·d_expert` of FFN matrices `d_ff = experts × d_expert` wide (see
//! [`super::spec::MoeSpec`]). Bytes are copied as they are: any format whose blocks the expert
//! width is a whole number of.

use super::ModelError;
use crate::tensor::{Bytes, HostTensor};

/// A layer's experts, each as its own gate, up and down matrix, as the FFN's gate, up and down
/// (named `{base}.gate` …).
pub fn ffn_of_experts(
    base: &str,
    [gate, up, down]: [Vec<HostTensor>; 3],
) -> Result<[HostTensor; 3], ModelError> {
    Ok([
        stack_rows(&format!("{base}.gate"), &gate)?,
        stack_rows(&format!("{base}.up"), &up)?,
        stack_columns(&format!("{base}.down"), &down)?,
    ])
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

/// `parts` (each `rows × cols`, one format) side by side: `rows × Σ cols`, row `r` the parts'
/// rows `r` one after the other.
pub fn stack_columns(name: &str, parts: &[HostTensor]) -> Result<HostTensor, ModelError> {
    same_shapes(name, parts)?;
    concat_columns(name, parts)
}

/// `parts` of one height and format but any widths (each whole blocks), side by side.
pub fn concat_columns(name: &str, parts: &[HostTensor]) -> Result<HostTensor, ModelError> {
    let first = parts
        .first()
        .ok_or_else(|| format_err(name, "no parts".into()))?;
    for p in parts {
        if (p.rows, p.dtype) != (first.rows, first.dtype) {
            return Err(format_err(
                name,
                format!(
                    "`{}` is {} rows of {}, `{}` {} rows of {}",
                    p.name, p.rows, p.dtype, first.name, first.rows, first.dtype
                ),
            ));
        }
        if !p.cols.is_multiple_of(p.dtype.block_len()) {
            return Err(format_err(
                name,
                format!("rows of {} values are not whole {} blocks", p.cols, p.dtype),
            ));
        }
    }
    let mut bytes = Vec::with_capacity(parts.iter().map(|p| p.data.len()).sum());
    for r in 0..first.rows {
        for p in parts {
            let rb = p.row_bytes();
            bytes.extend_from_slice(&p.data.as_slice()[r * rb..(r + 1) * rb]);
        }
    }
    Ok(HostTensor {
        name: name.to_string(),
        rows: first.rows,
        cols: parts.iter().map(|p| p.cols).sum(),
        dtype: first.dtype,
        data: Bytes::from_slice(&bytes),
    })
}

/// `experts` matrices one under the other (`experts·rows × cols`, as a GGUF's `ffn_down_exps`
/// holds them) side by side: [`stack_columns`] of them.
pub fn columns_of_stacked(t: &HostTensor, experts: usize) -> Result<HostTensor, ModelError> {
    if experts == 0 || !t.rows.is_multiple_of(experts) {
        return Err(format_err(
            &t.name,
            format!("{} rows are not {experts} experts' matrices", t.rows),
        ));
    }
    let rows = t.rows / experts;
    if !t.cols.is_multiple_of(t.dtype.block_len()) {
        return Err(format_err(
            &t.name,
            format!("rows of {} values are not whole {} blocks", t.cols, t.dtype),
        ));
    }
    let (row_bytes, src) = (t.row_bytes(), t.data.as_slice());
    let mut bytes = Vec::with_capacity(src.len());
    for r in 0..rows {
        for e in 0..experts {
            let at = (e * rows + r) * row_bytes;
            bytes.extend_from_slice(&src[at..at + row_bytes]);
        }
    }
    Ok(HostTensor {
        name: t.name.clone(),
        rows,
        cols: t.cols * experts,
        dtype: t.dtype,
        data: Bytes::from_slice(&bytes),
    })
}

/// A `rows × parts·cols` matrix's `parts` column blocks one under the other (`parts·rows ×
/// cols`): the inverse of [`columns_of_stacked`], each expert's down contiguous as a GGUF's
/// `ffn_down_exps` holds it.
pub fn stacked_of_columns(t: &HostTensor, parts: usize) -> Result<HostTensor, ModelError> {
    concat_rows(&t.name, &split_columns(t, parts)?)
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
        let rows = stack_rows("up", &[a.clone(), b.clone()]).unwrap();
        assert_eq!((rows.rows, rows.cols), (4, 3));
        assert_eq!(
            rows.to_f32(),
            [0., 1., 2., 3., 4., 5., 100., 101., 102., 103., 104., 105.]
        );
        let cols = stack_columns("down", &[a, b]).unwrap();
        assert_eq!((cols.rows, cols.cols), (2, 6));
        assert_eq!(
            cols.to_f32(),
            [0., 1., 2., 100., 101., 102., 3., 4., 5., 103., 104., 105.]
        );
    }

    #[test]
    fn stacked_matrices_side_by_side_equal_their_stacked_columns() {
        let (a, b) = (t("a", 2, 3, 0.0), t("b", 2, 3, 100.0));
        let stacked = stack_rows("s", &[a.clone(), b.clone()]).unwrap();
        let want = stack_columns("down", &[a, b]).unwrap();
        let got = columns_of_stacked(&stacked, 2).unwrap();
        assert_eq!((got.rows, got.cols), (want.rows, want.cols));
        assert_eq!(got.to_f32(), want.to_f32());
        assert!(columns_of_stacked(&stacked, 3).is_err());
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
            stack_columns("d", &d).unwrap().data.as_slice(),
            down.data.as_slice()
        );
        assert!(split_rows(&gate, 4).is_err() && split_columns(&down, 4).is_err());
        let r = concat_rows("r", &[t("a", 3, 4, 0.0), t("b", 1, 4, 9.0)]).unwrap();
        assert_eq!((r.rows, r.to_f32()[12]), (4, 9.0));
        assert!(concat_rows("r", &[t("a", 3, 4, 0.0), t("b", 1, 5, 9.0)]).is_err());
    }
}
