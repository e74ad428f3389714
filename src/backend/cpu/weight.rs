//! The CPU backend's weights ([`CpuWeight`]): a host tensor used in place, its encoding, and
//! how its rows lie in its bytes (a matrix only the products read may be laid out in tiles for
//! the many-row kernels).

use super::kernels::Kernels;
use super::kernels::tiles::{TILE_ROWS, tile_rows, tiles_format};
use super::matmul::{Layout, Matrix};
use super::sparse::{tile_bundles, tileable};
use super::{Result, shape_err};
use crate::backend::BundleShape;
use crate::store::Encoding;
use crate::tensor::{Bytes, DType, HostTensor};

/// A weight on the CPU backend: a host tensor used in place (borrowed from the model's map or a
/// store buffer), remembering its encoding. INT8/INT4 FFN bundles have no storage format a
/// matrix op could read, so only the bundle ops take them.
#[derive(Clone, Debug)]
pub struct CpuWeight {
    /// The bytes as `rows × cols`; `dtype` is their format unless `coded` is set.
    t: HostTensor,
    /// INT8/INT4 bundles: their encoding and part count (a code's row size depends on it).
    coded: Option<CodedBundles>,
    /// How the rows lie in the bytes: in tiles only once [`CpuWeight::lay_out_for_products`]
    /// put them so, after which only the products read them.
    layout: Layout,
    /// Gated f16 bundles mapped for the listed ops to read in place: the same neurons laid out
    /// in neuron tiles too ([`CpuWeight::lay_out_neuron_tiles`]), which those ops read instead
    /// of the rows.
    neuron_tiles: Option<Bytes>,
    /// The tiles were copied in whole ([`CpuWeight::landed_in_tiles`]): a slot, which
    /// [`CpuWeight::retype`] may refill as rows (a matrix laid out in place may not be).
    landed_in_tiles: bool,
}

/// What a [`CpuWeight`] of INT8/INT4 bundles holds beyond its bytes: no storage format reads
/// them, so the encoding and the part count say how big a row is.
#[derive(Clone, Copy, Debug)]
struct CodedBundles {
    enc: Encoding,
    parts: usize,
}

impl From<HostTensor> for CpuWeight {
    fn from(t: HostTensor) -> Self {
        CpuWeight {
            t,
            coded: None,
            layout: Layout::Rows,
            neuron_tiles: None,
            landed_in_tiles: false,
        }
    }
}

impl CpuWeight {
    /// Bytes of one row (one bundle, for bundles).
    pub fn row_bytes(&self) -> usize {
        match self.coded {
            Some(CodedBundles { enc, parts }) => enc.row_bytes(self.t.cols, parts),
            None => self.t.row_bytes(),
        }
    }

    /// The weight as a tensor in its storage format, its rows one after another (`None` for
    /// INT8/INT4 bundles, and for a matrix laid out for the products).
    pub fn as_tensor(&self) -> Option<&HostTensor> {
        (self.coded.is_none() && self.layout == Layout::Rows).then_some(&self.t)
    }

    /// How the rows lie in the bytes.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    pub fn encoding(&self) -> Encoding {
        self.coded.map_or(Encoding::Format(self.t.dtype), |c| c.enc)
    }

    pub fn name(&self) -> &str {
        &self.t.name
    }

    /// Rows: neurons of bundles, else the matrix's rows.
    pub fn rows(&self) -> usize {
        self.t.rows
    }

    /// The weight as a tensor for `op`, which reads its rows in its storage format.
    pub(super) fn tensor(&self, op: &'static str) -> Result<&HostTensor> {
        self.not_coded(op)?;
        self.not_tiled(op)?;
        Ok(&self.t)
    }

    /// The weight as a matrix of the products (`op`), in either layout.
    pub(crate) fn matrix(&self, op: &'static str) -> Result<Matrix<'_>> {
        self.not_coded(op)?;
        Ok(Matrix {
            t: &self.t,
            layout: self.layout,
        })
    }

    /// The bytes, rows one after another, for `op` to read (of any encoding).
    pub(super) fn row_bytes_of(&self, op: &'static str) -> Result<&[u8]> {
        self.not_tiled(op)?;
        Ok(self.t.data.as_slice())
    }

    /// The bytes, to be moved (not changed) by `Bytes::pack_huge`.
    pub(super) fn bytes_for_packing(&mut self) -> &mut Bytes {
        &mut self.t.data
    }

    /// The bytes of a slot (a weight the backend allocated, held by nothing else) for `op` to
    /// fill, rows one after another.
    pub(super) fn slot_mut(&mut self, op: &'static str) -> Result<&mut [u8]> {
        self.not_tiled(op)?;
        let name = &self.t.name;
        let Bytes::Owned { words, len } = &mut self.t.data else {
            return Err(shape_err(op, format!("`{name}` is not a slot")));
        };
        let words = std::sync::Arc::get_mut(words)
            .ok_or_else(|| shape_err(op, format!("slot `{name}` is shared while being filled")))?;
        Ok(&mut bytemuck::cast_slice_mut::<u64, u8>(words)[..*len])
    }

    /// The slot as `rows × cols` of `dtype` (a slot that held coded bundles becomes a plain
    /// tensor again).
    pub(super) fn retype(&mut self, dtype: DType, rows: usize, cols: usize) -> Result<()> {
        if self.landed_in_tiles {
            // A slot refilled holds rows again until its next bytes say otherwise.
            self.layout = Layout::Rows;
            self.landed_in_tiles = false;
        }
        self.not_tiled("retype_weight")?;
        let w = &mut self.t;
        let Bytes::Owned { words, len } = &mut w.data else {
            return Err(shape_err(
                "retype_weight",
                format!("`{}` is not a slot", w.name),
            ));
        };
        *len = super::super::retyped_bytes(&w.name, dtype, rows, cols, (words.len() * 8) as u64)?;
        w.dtype = dtype;
        w.rows = rows;
        w.cols = cols;
        self.coded = None;
        Ok(())
    }

    /// Lay the whole tiles of a Q8_0/Q4_0/Q4_1 matrix's rows out for `kernels`' many-row
    /// kernels, where they have them (else leave it as it is): the same bytes, moved within
    /// each tile's span, copied first where something else holds them. From now on only the
    /// products read it.
    pub(super) fn lay_out_for_products(&mut self, kernels: &Kernels) -> Result<()> {
        self.not_coded("lay_out_for_products")?;
        let t = &self.t;
        if self.layout == Layout::Tiles || !tiles_apply(kernels, t.dtype, t.rows) {
            return Ok(());
        }
        let (rows, rb, dtype) = (t.rows, t.row_bytes(), t.dtype);
        if !matches!(&t.data, Bytes::Owned { words, .. } if std::sync::Arc::strong_count(words) == 1)
        {
            self.t.data = Bytes::from_slice(t.data.as_slice());
        }
        let bytes = self.slot_mut("lay_out_for_products")?;
        tile_rows(dtype, bytes, rows, rb);
        self.layout = Layout::Tiles;
        Ok(())
    }

    /// Lay bundles of `shape` out in neuron tiles beside their rows, where they can be (gated f16
    /// bundles whose width is whole tile columns): the bytes a mapped weight's listed ops read.
    /// Rows stay for every other reader (a gather into slots reads the store's copy, not this).
    pub(super) fn lay_out_neuron_tiles(&mut self, shape: BundleShape) {
        let t = &self.t;
        if self.coded.is_some() || !tileable(t.dtype, shape.parts, shape.d) {
            return;
        }
        let rows: Vec<u32> = (0..t.rows as u32).collect();
        let tiles = tile_bundles(t.data.as_slice(), t.row_bytes(), &rows, shape.d);
        self.neuron_tiles = Some(Bytes::from_slice(&tiles));
    }

    /// The neuron tiles [`CpuWeight::lay_out_neuron_tiles`] laid out, if any.
    pub(super) fn neuron_tiles(&self) -> Option<&[u8]> {
        self.neuron_tiles.as_ref().map(|b| b.as_slice())
    }

    /// Refuse (for `op`) bytes laid out by [`lay_out_rows`] for this weight, where the
    /// kernels have no tiles for its format and rows.
    pub(super) fn check_tiles(&self, op: &'static str, kernels: &Kernels) -> Result<()> {
        self.not_coded(op)?;
        if !tiles_apply(kernels, self.t.dtype, self.t.rows) {
            return Err(shape_err(
                op,
                format!(
                    "`{}` ({} rows of {}) has no tiles for these kernels",
                    self.t.name, self.t.rows, self.t.dtype
                ),
            ));
        }
        Ok(())
    }

    /// The slot's bytes were just copied in whole, laid out by [`lay_out_rows`]
    /// ([`CpuWeight::check_tiles`] passed): from now on only the products read them, in tiles.
    pub(super) fn landed_in_tiles(&mut self) {
        self.layout = Layout::Tiles;
        self.landed_in_tiles = true;
    }

    /// Refuse `op` a weight laid out in tiles, where it would read rows.
    fn not_tiled(&self, op: &'static str) -> Result<()> {
        match self.layout {
            Layout::Rows => Ok(()),
            Layout::Tiles => Err(shape_err(
                op,
                format!(
                    "`{}` is laid out in tiles for the products; {op} reads rows",
                    self.t.name
                ),
            )),
        }
    }

    /// Refuse `op` coded bundles: it reads a storage format.
    fn not_coded(&self, op: &'static str) -> Result<()> {
        super::super::check_not_coded(op, &self.t.name, self.coded.map(|c| c.enc))
    }

    /// The matrix's columns (a bundle's values, for bundles).
    pub fn cols(&self) -> usize {
        self.t.cols
    }

    /// Coded bundles' part count (`None` for any other weight).
    pub(super) fn coded_parts(&self) -> Option<usize> {
        self.coded.map(|c| c.parts)
    }
}

/// Whether `kernels` multiply `rows` rows of `dtype` in tiles (a tiles format with many-row
/// kernels, a whole tile at least).
fn tiles_apply(kernels: &Kernels, dtype: DType, rows: usize) -> bool {
    tiles_format(dtype) && kernels.tiled(dtype).is_some() && rows >= TILE_ROWS
}

/// Lay `rows` rows of `dtype` (`row_bytes` each) in `bytes` out in tiles in place, where
/// `kernels` multiply them so; whether it did ([`Backend::host_matrix_layout`]'s function).
///
/// [`Backend::host_matrix_layout`]: crate::backend::Backend::host_matrix_layout
pub(super) fn lay_out_rows(
    kernels: &Kernels,
    dtype: DType,
    rows: usize,
    row_bytes: usize,
    bytes: &mut [u8],
) -> bool {
    if !tiles_apply(kernels, dtype, rows)
        || bytes.len() < rows * row_bytes
        || !row_bytes.is_multiple_of(dtype.block_bytes())
    {
        return false;
    }
    tile_rows(dtype, bytes, rows, row_bytes);
    true
}

/// `rows` bundles of `shape` in `enc` held in `data` (sized by the caller): float bundles are a
/// plain `rows × parts·d` tensor, as `upload` of the same bytes gives.
pub(super) fn bundle_weight(
    name: &str,
    enc: Encoding,
    shape: BundleShape,
    rows: usize,
    data: Bytes,
) -> CpuWeight {
    let (dtype, coded) = match enc {
        Encoding::Format(dtype) => (dtype, None),
        // The dtype of coded bundles is never read (`CpuWeight::tensor` refuses them).
        Encoding::Int8 | Encoding::Int4 => {
            let coded = CodedBundles {
                enc,
                parts: shape.parts,
            };
            (DType::F32, Some(coded))
        }
    };
    CpuWeight {
        t: HostTensor {
            name: name.to_string(),
            rows,
            cols: shape.parts * shape.d,
            dtype,
            data,
        },
        coded,
        layout: Layout::Rows,
        neuron_tiles: None,
        landed_in_tiles: false,
    }
}

#[cfg(test)]
mod tests {
    use super::super::CpuBackend;
    use super::*;
    use crate::backend::Backend;

    /// A `rows × cols` matrix of `dtype` from values that vary by row and column.
    fn matrix(dtype: DType, rows: usize, cols: usize) -> HostTensor {
        let values: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 40.0)
            .collect();
        let mut bytes = vec![0u8; dtype.bytes_for(rows * cols)];
        crate::tensor::quantize_row(dtype, &values, &mut bytes);
        HostTensor {
            name: "m".into(),
            rows,
            cols,
            dtype,
            data: Bytes::from_slice(&bytes),
        }
    }

    /// A matrix laid out for the products multiplies to the bits it gave as rows (one token and
    /// several), its host tensor untouched (the bytes were shared, so they were copied first);
    /// every op that reads rows refuses it, saying why.
    #[test]
    fn laid_out_matrices_multiply_as_rows_and_row_ops_refuse_them() {
        let b = CpuBackend::new(2).unwrap();
        let host = matrix(DType::Q4_1, 40, 64);
        let before = host.data.as_slice().to_vec();
        let rows = b.upload(&host).unwrap();
        let mut tiled = b.upload(&host).unwrap();
        b.lay_out_for_products(&mut tiled).unwrap();
        if tiled.layout() == Layout::Rows {
            println!("skipped: the {} kernels read no tiles", b.kernels.name);
            return;
        }
        assert_eq!(host.data.as_slice(), before, "the host tensor is untouched");
        for n in [1, 5] {
            let mut x = b.alloc(n, 64).unwrap();
            let xs: Vec<f32> = (0..n * 64).map(|i| (i % 9) as f32 * 0.25 - 1.0).collect();
            b.write(&mut x, &xs).unwrap();
            let (mut want, mut got) = (b.alloc(n, 40).unwrap(), b.alloc(n, 40).unwrap());
            b.matmul_into(&rows, &x, &mut want, 0).unwrap();
            b.matmul_into(&tiled, &x, &mut got, 0).unwrap();
            let bits = |t: &super::super::CpuTensor| -> Vec<u32> {
                t.data.iter().map(|v| v.to_bits()).collect()
            };
            assert_eq!(bits(&got), bits(&want), "{n} tokens");
        }
        assert!(tiled.as_tensor().is_none());
        let refused = |e: crate::backend::BackendError| {
            assert!(e.to_string().contains("laid out in tiles"), "{e}");
        };
        let mut out = b.alloc(1, 64).unwrap();
        refused(b.embed(&tiled, &[3], &mut out).unwrap_err());
        let row = vec![0u8; tiled.row_bytes()];
        refused(b.upload_into(&mut tiled, 0, &row).unwrap_err());
        let mut slot = b.alloc_weight("s", DType::Q4_1, 40, 64).unwrap();
        refused(b.scatter_rows(&tiled, &[0], &mut slot).unwrap_err());
        refused(b.retype_weight(&mut tiled, DType::Q8_0, 8, 64).unwrap_err());
    }

    /// Bytes laid out on the host by the backend's own function and copied whole into a slot
    /// multiply to the bits the rows give; refilled, the slot holds rows again; what has no
    /// tiles is left as rows by the function and refused by the upload.
    #[test]
    fn slots_filled_in_tiles_multiply_as_rows_and_refill_as_rows() {
        let b = CpuBackend::new(2).unwrap();
        let (rows_n, cols) = (40, 64);
        let host = matrix(DType::Q4_1, rows_n, cols);
        let rb = host.row_bytes();
        let lay_out = b.host_matrix_layout().unwrap();
        let mut bytes = host.data.as_slice().to_vec();
        if !lay_out(DType::Q4_1, rows_n, rb, &mut bytes) {
            println!("skipped: the {} kernels read no tiles", b.kernels.name);
            return;
        }
        assert_ne!(bytes, host.data.as_slice(), "laid out");
        let rows = b.upload(&host).unwrap();
        let mut slot = b.alloc_weight("slot", DType::Q8_0, rows_n, cols).unwrap();
        let mut x = b.alloc(3, cols).unwrap();
        let xs: Vec<f32> = (0..3 * cols).map(|i| (i % 7) as f32 * 0.3 - 1.0).collect();
        b.write(&mut x, &xs).unwrap();
        let product = |w: &CpuWeight| {
            let mut out = b.alloc(3, rows_n).unwrap();
            b.matmul_into(w, &x, &mut out, 0).unwrap();
            out.data.iter().map(|v| v.to_bits()).collect::<Vec<u32>>()
        };
        let want = product(&rows);
        for _ in 0..2 {
            b.retype_weight(&mut slot, DType::Q4_1, rows_n, cols)
                .unwrap();
            b.upload_laid_out(&mut slot, &bytes).unwrap();
            assert_eq!(slot.layout(), Layout::Tiles);
            assert_eq!(product(&slot), want, "in tiles");
            b.retype_weight(&mut slot, DType::Q4_1, rows_n, cols)
                .unwrap();
            assert_eq!(slot.layout(), Layout::Rows, "refilled as rows");
            b.upload_into(&mut slot, 0, host.data.as_slice()).unwrap();
            assert_eq!(product(&slot), want, "as rows");
        }
        // No tiles: f32, or fewer rows than a tile.
        let mut f = matrix(DType::F32, 32, cols).data.as_slice().to_vec();
        assert!(!lay_out(DType::F32, 32, cols * 4, &mut f));
        let mut few = matrix(DType::Q8_0, 15, cols).data.as_slice().to_vec();
        let few_rb = DType::Q8_0.bytes_for(cols);
        assert!(!lay_out(DType::Q8_0, 15, few_rb, &mut few));
        let mut f32_slot = b.alloc_weight("f", DType::F32, 32, cols).unwrap();
        let zeros = vec![0u8; f.len()];
        assert!(b.upload_laid_out(&mut f32_slot, &f).is_err());
        assert_eq!(
            f32_slot.as_tensor().unwrap().data.as_slice(),
            &zeros[..],
            "nothing copied"
        );
    }

    /// Formats without tiles, and matrices of fewer rows than a tile, stay as rows.
    #[test]
    fn only_whole_tiles_of_the_tile_formats_are_laid_out() {
        let b = CpuBackend::new(1).unwrap();
        for (dtype, rows) in [(DType::F32, 32), (DType::Q4K, 32), (DType::Q8_0, 15)] {
            let mut w = b.upload(&matrix(dtype, rows, 256)).unwrap();
            b.lay_out_for_products(&mut w).unwrap();
            assert_eq!(w.layout(), Layout::Rows, "{dtype} × {rows}");
            assert!(w.as_tensor().is_some());
        }
    }
}
