//! A layer's FFN bundles borrowed in one encoding ([`Bundles`]): their layout, the vector of a
//! bundle's part, the checks every bundle operator shares; and one part's dot or axpy (what the
//! dense bundle kernels use).

use super::vector::Vector;
use crate::backend::{BackendError, BundleShape, IN_REST, Result};
use crate::store::Encoding;
use crate::store::quant::INT4_GROUP;
use crate::tensor::{DType, HostTensor};

pub(super) fn err(op: &'static str, msg: String) -> BackendError {
    BackendError::Shape { op, msg }
}

/// The up side's sizes: `x` is `n × d`, `h` is `n × m`.
pub(super) fn check_x_h(
    op: &'static str,
    (x, h): (&[f32], &[f32]),
    n: usize,
    (d, m): (usize, usize),
) -> Result<()> {
    if x.len() != n * d || h.len() != n * m {
        return Err(err(
            op,
            format!(
                "x has {} values, h {}: want {n}×{d} and {n}×{m}",
                x.len(),
                h.len()
            ),
        ));
    }
    Ok(())
}

/// A layer's FFN bundles in one encoding, borrowed (from the store's map or a buffer).
#[derive(Clone, Copy, Debug)]
pub struct Bundles<'a> {
    bytes: &'a [u8],
    pub(super) enc: Encoding,
    pub(super) shape: BundleShape,
    row_bytes: usize,
    pub(super) neurons: usize,
    /// Bundles of the same shape and encoding elsewhere: a listed entry with
    /// [`IN_REST`] set is that row of these ([`Bundles::with_rest`]).
    rest: &'a [u8],
}

impl<'a> Bundles<'a> {
    /// Bundles laid out as the store writes them (see `store::Encoding`): f32/f16/bf16 parts one
    /// after another; INT8 the part scales (f32) first, then the codes; INT4 all group scales
    /// (f16) first, then the packed codes.
    pub fn new(bytes: &'a [u8], enc: Encoding, shape: BundleShape) -> Result<Self> {
        let op = "sparse bundles";
        // The shape and encoding rule every backend sizes bundles by.
        let row_bytes = crate::backend::bundle_bytes("bundles", enc, shape, 1)?;
        let align = match enc {
            Encoding::Format(DType::F32) => 4,
            Encoding::Format(_) => 2,
            Encoding::Int8 | Encoding::Int4 => 1,
        };
        // Float parts are read as typed slices; the store's map and our buffers are aligned.
        if !(bytes.as_ptr() as usize).is_multiple_of(align) {
            return Err(err(
                op,
                format!("{} bundles not {align}-aligned", enc.name()),
            ));
        }
        if !bytes.len().is_multiple_of(row_bytes) {
            return Err(err(
                op,
                format!(
                    "{} bytes is not whole {row_bytes}-byte bundles",
                    bytes.len()
                ),
            ));
        }
        Ok(Bundles {
            bytes,
            enc,
            shape,
            row_bytes,
            neurons: bytes.len() / row_bytes,
            rest: &[],
        })
    }

    /// These bundles with `rest` beside them: a listed entry with [`IN_REST`] set reads that
    /// row of `rest` (a cache unit's slots and the neurons where they rest in host memory, in
    /// one list).
    pub fn with_rest(self, rest: Bundles<'a>) -> Result<Self> {
        if rest.enc != self.enc
            || rest.shape.parts != self.shape.parts
            || rest.shape.d != self.shape.d
        {
            return Err(err(
                "sparse bundles",
                "the two sets of bundles differ in shape or encoding".into(),
            ));
        }
        Ok(Bundles {
            rest: rest.bytes,
            ..self
        })
    }

    /// The bytes entry `i` of a list reads, and its row there.
    fn source(&self, i: usize) -> (&'a [u8], usize) {
        let flag = IN_REST as usize;
        if i & flag != 0 {
            (self.rest, i & !flag)
        } else {
            (self.bytes, i)
        }
    }

    /// Float bundles held as a tensor (`neurons × parts·d`, as the dense kernels take them).
    pub fn from_host(t: &'a HostTensor, shape: BundleShape) -> Result<Self> {
        if t.cols != shape.parts * shape.d {
            return Err(err(
                "sparse bundles",
                format!(
                    "`{}` has {} columns, not {}×{}",
                    t.name, t.cols, shape.parts, shape.d
                ),
            ));
        }
        Bundles::new(t.data.as_slice(), Encoding::Format(t.dtype), shape)
    }

    /// The rows of a float matrix as one-part vectors (row `i` = part 0 of entry `i`): what
    /// the bundle operators read of bundles taken apart, a part of every neuron in one matrix.
    pub fn of_rows(t: &'a HostTensor) -> Result<Self> {
        let op = "sparse rows";
        if !matches!(t.dtype, DType::F32 | DType::F16 | DType::BF16) {
            return Err(err(op, format!("`{}` is {}, not floats", t.name, t.dtype)));
        }
        let row_bytes = t.dtype.bytes_for(t.cols);
        let bytes = t.data.as_slice();
        let align = t.dtype.bytes_for(1);
        if row_bytes == 0
            || bytes.len() != t.rows * row_bytes
            || !(bytes.as_ptr() as usize).is_multiple_of(align)
        {
            return Err(err(
                op,
                format!(
                    "`{}` is not {} aligned rows of {row_bytes} bytes",
                    t.name, t.rows
                ),
            ));
        }
        Ok(Bundles {
            bytes,
            enc: Encoding::Format(t.dtype),
            shape: BundleShape {
                parts: 1,
                d: t.cols,
            },
            row_bytes,
            neurons: t.rows,
            rest: &[],
        })
    }

    pub fn neurons(&self) -> usize {
        self.neurons
    }

    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    pub fn shape(&self) -> BundleShape {
        self.shape
    }

    /// Part `p` of f16 bundle `i` ([`Bundles::is_f16`]; `i`, `p` checked by the callers).
    pub(super) fn part_f16(&self, i: usize, p: usize) -> &'a [half::f16] {
        debug_assert!(self.is_f16());
        let d = self.shape.d;
        let (bytes, i) = self.source(i);
        let at = i * self.row_bytes + p * d * 2;
        bytemuck::cast_slice(&bytes[at..at + d * 2])
    }

    /// Whether the bundles are f16.
    pub(super) fn is_f16(&self) -> bool {
        self.enc == Encoding::Format(DType::F16)
    }

    /// Part `p` of bundle `i` (`i < neurons`, `p < parts`: checked by the callers).
    pub(super) fn part(&self, i: usize, p: usize) -> Vector<'a> {
        let BundleShape { parts, d } = self.shape;
        let (bytes, i) = self.source(i);
        let row = &bytes[i * self.row_bytes..(i + 1) * self.row_bytes];
        match self.enc {
            Encoding::Format(DType::F32) => {
                Vector::F32(bytemuck::cast_slice(&row[p * d * 4..(p + 1) * d * 4]))
            }
            Encoding::Format(DType::F16) => {
                Vector::F16(bytemuck::cast_slice(&row[p * d * 2..(p + 1) * d * 2]))
            }
            Encoding::Format(DType::BF16) => {
                Vector::Bf16(bytemuck::cast_slice(&row[p * d * 2..(p + 1) * d * 2]))
            }
            Encoding::Int8 => {
                let mut s = [0u8; 4];
                s.copy_from_slice(&row[p * 4..p * 4 + 4]);
                let at = parts * 4 + p * d;
                Vector::I8 {
                    scale: f32::from_le_bytes(s),
                    q: bytemuck::cast_slice(&row[at..at + d]),
                }
            }
            Encoding::Int4 => {
                let groups = d / INT4_GROUP;
                let at = parts * groups * 2 + p * d / 2;
                Vector::I4 {
                    scales: &row[p * groups * 2..(p + 1) * groups * 2],
                    q: &row[at..at + d / 2],
                }
            }
            // `new` admits no other encoding.
            Encoding::Format(_) => unreachable!("checked in Bundles::new"),
        }
    }

    /// Checks shared by the bundle functions: every listed neuron exists.
    pub(super) fn check_idx(&self, op: &'static str, idx: &[u32]) -> Result<()> {
        let rest = self.rest.len() / self.row_bytes;
        let bad = |&&i: &&u32| match i & IN_REST {
            0 => i as usize >= self.neurons,
            _ => (i & !IN_REST) as usize >= rest,
        };
        match idx.iter().find(bad) {
            Some(&i) if i & IN_REST != 0 => Err(err(
                op,
                format!(
                    "neuron {} of the rest listed, it holds {rest}",
                    i & !IN_REST
                ),
            )),
            Some(i) => Err(err(
                op,
                format!("neuron {i} listed, the bundles hold {}", self.neurons),
            )),
            None => Ok(()),
        }
    }
}
