//! FFN neuron bundles as every backend sizes and checks them: their shape, the bytes `rows`
//! bundles take in an encoding (the one size CUDA allocates and the budgeted device reserves),
//! how many whole bundles a byte range holds, the checks of a weight read as bundles (or, coded,
//! refused as a tensor), and of scattering rows into a slot.

use super::{BackendError, Result};
use crate::store::Encoding;
use crate::store::quant::INT4_GROUP;
use crate::tensor::{Bytes, DType};

/// FFN neuron bundles (see `store`): `rows` neurons, each `parts` vectors of `d` values —
/// `[gate | up | down]` (3 parts, gated) or `[up | down]` (2 parts).
#[derive(Clone, Copy, Debug)]
pub struct BundleShape {
    pub parts: usize,
    pub d: usize,
}

/// Bytes of `rows` FFN bundles of `shape` in `enc` (`rows × enc.row_bytes(parts·d, parts)`), if
/// `enc` can hold such bundles: f32, f16, bf16, INT8, or INT4 with `d` a whole number of its
/// groups; else the error naming `name` and what is wrong. The one size every backend gives a
/// bundle weight (the budgeted device reserves it as CUDA allocates it).
pub fn bundle_bytes(name: &str, enc: Encoding, shape: BundleShape, rows: usize) -> Result<usize> {
    let BundleShape { parts, d } = shape;
    let bad = |msg: String| BackendError::Shape {
        op: "bundles",
        msg: format!("`{name}`: {msg}"),
    };
    if !(2..=3).contains(&parts) {
        return Err(bad(format!(
            "bundles have 2 parts (up, down) or 3 (gate, up, down), not {parts}"
        )));
    }
    if d == 0 {
        return Err(bad("bundles of 0 values".into()));
    }
    match enc {
        Encoding::Format(DType::F32 | DType::F16 | DType::BF16) | Encoding::Int8 => {}
        Encoding::Int4 if d.is_multiple_of(INT4_GROUP) => {}
        Encoding::Int4 => {
            return Err(bad(format!(
                "int4 bundles need parts of whole {INT4_GROUP}-value groups, not {d} values"
            )));
        }
        Encoding::Format(other) => {
            return Err(bad(format!(
                "{other} is not a bundle encoding (f32, f16, bf16, int8, int4)"
            )));
        }
    }
    rows.checked_mul(enc.row_bytes(parts * d, parts))
        .ok_or_else(|| bad(format!("{rows} bundles of {parts}×{d} overflow")))
}

/// Bytes a listed bundle op reads of bundles of `row_bytes` (`parts` parts) read in place from
/// host memory, `listed` of them listed and `live` of those left on by the mask: the up side
/// reads each listed one's deciding part (its gate, or its up part without a gate) and, gated,
/// the live ones' up parts; the down side the live ones' down parts. One formula for every
/// backend, so the link bytes the budgeted device counts are the ones CUDA's kernels move.
pub fn in_place_read_bytes(
    row_bytes: usize,
    parts: usize,
    listed: usize,
    live: usize,
    up: bool,
) -> u64 {
    let part = row_bytes / parts.max(1);
    let rows = match (up, parts) {
        (true, 3) => listed + live,
        (true, _) => listed,
        (false, _) => live,
    };
    (rows * part) as u64
}

/// A listed entry with this bit set names a row of the second set of bundles a listed op is
/// given (`rest`: the neurons where they rest in host memory), not of the first (the slots).
pub const IN_REST: u32 = 1 << 31;

/// Refuse `data` as host memory to map for the device (`name`) unless it is a page-aligned
/// buffer of its own (what CUDA page-locks whole).
pub fn check_mappable(name: &str, data: &Bytes) -> Result<()> {
    match data {
        Bytes::Aligned { .. } => Ok(()),
        _ => Err(BackendError::Shape {
            op: "map_bundles",
            msg: format!(
                "`{name}`: only a page-aligned buffer read from the store can be mapped for the device"
            ),
        }),
    }
}

/// How many `shape` bundles in `enc` the `len` bytes handed to
/// [`Backend::upload_bundles`](super::Backend::upload_bundles) hold: an error naming `name` unless
/// they are whole bundles.
pub fn bundle_rows(name: &str, enc: Encoding, shape: BundleShape, len: usize) -> Result<usize> {
    let row_bytes = bundle_bytes(name, enc, shape, 1)?;
    if !len.is_multiple_of(row_bytes) {
        return Err(BackendError::Shape {
            op: "upload_bundles",
            msg: format!(
                "`{name}`: {len} bytes is not whole {row_bytes}-byte {} bundles of {}×{}",
                enc.name(),
                shape.parts,
                shape.d
            ),
        });
    }
    Ok(len / row_bytes)
}

/// Refuse weight `name` for `op`, which reads a tensor in its storage format, where it holds
/// INT8/INT4 bundles (`coded`: their encoding; `None` for a tensor): every backend's words.
pub fn check_not_coded(op: &'static str, name: &str, coded: Option<Encoding>) -> Result<()> {
    match coded {
        None => Ok(()),
        Some(enc) => Err(BackendError::Shape {
            op,
            msg: format!(
                "`{name}` holds {} bundles: only the bundle ops take them",
                enc.name()
            ),
        }),
    }
}

/// Weight `name` (`rows` of `cols` values in `enc`; `coded_parts`: the part count of its INT8/
/// INT4 code, where it is one) is bundles of `shape`, else the error naming `op`: what every
/// backend checks before a bundle op reads a weight as bundles.
pub fn check_bundle_weight(
    op: &'static str,
    name: &str,
    (rows, cols): (usize, usize),
    enc: Encoding,
    coded_parts: Option<usize>,
    shape: BundleShape,
) -> Result<()> {
    let parts_ok = coded_parts.is_none_or(|parts| parts == shape.parts);
    if !parts_ok || cols != shape.parts * shape.d {
        return Err(BackendError::Shape {
            op,
            msg: format!(
                "`{name}` ({rows} rows of {cols} {} values) is not {}-part bundles of {}",
                enc.name(),
                shape.parts,
                shape.d
            ),
        });
    }
    Ok(())
}

/// The checks of [`Backend::scatter_rows`](super::Backend::scatter_rows) for weights of `rows` ×
/// `row_bytes` each (`src`, `dst`, named): an error unless the formats match and `rows` are
/// distinct rows of `dst`, one per row of `src` at most.
pub fn check_scatter(
    (src_name, src_rows, src_row_bytes, src_enc): (&str, usize, usize, Encoding),
    (dst_name, dst_rows, dst_row_bytes, dst_enc): (&str, usize, usize, Encoding),
    rows: &[u32],
) -> Result<()> {
    let bad = |msg: String| BackendError::Shape {
        op: "scatter_rows",
        msg,
    };
    if src_enc != dst_enc || src_row_bytes != dst_row_bytes || src_row_bytes == 0 {
        return Err(bad(format!(
            "`{src_name}` ({} rows of {src_row_bytes} bytes) into `{dst_name}` ({} rows of {dst_row_bytes} bytes)",
            src_enc.name(),
            dst_enc.name()
        )));
    }
    if rows.len() > src_rows {
        return Err(bad(format!(
            "{} rows from the {src_rows} of `{src_name}`",
            rows.len()
        )));
    }
    let mut seen = vec![false; dst_rows];
    for &r in rows {
        match seen.get_mut(r as usize) {
            Some(s) if !*s => *s = true,
            _ => {
                return Err(bad(format!(
                    "row {r} of `{dst_name}` ({dst_rows} rows) is out of range or listed twice"
                )));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_read_as_bundles_or_tensors_are_checked_by_their_coding() {
        let shape = BundleShape { parts: 3, d: 64 };
        assert!(check_not_coded("matmul", "w", None).is_ok());
        let e = check_not_coded("matmul", "w", Some(Encoding::Int8)).unwrap_err();
        assert!(e.to_string().contains("`w` holds int8 bundles"), "{e}");
        let ok =
            |cols, coded| check_bundle_weight("up", "b", (4, cols), Encoding::F16, coded, shape);
        assert!(ok(192, None).is_ok() && ok(192, Some(3)).is_ok());
        for (cols, coded) in [(128, None), (192, Some(2))] {
            let e = ok(cols, coded).unwrap_err().to_string();
            assert!(e.contains("is not 3-part bundles of 64"), "{e}");
        }
    }
}
