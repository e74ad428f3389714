//! The CPU's KV cache: rows of keys or values stored in a [`KvType`] (f32, f16 or Q8_0 blocks),
//! converted with the same row codec every backend uses (`tensor::encode_row` / `decode_row`),
//! and read back one head's slice at a time by attention.

use std::ops::Range;

use half::f16;

use super::attention::KvRows;
use super::tensor::CpuTensor;
use crate::backend::{BackendError, KvType, Result};
use crate::tensor::{BlockQ8_0, QK, decode_row, encode_row};

#[derive(Clone, Debug)]
enum Rows {
    F32(Vec<f32>),
    F16(Vec<f16>),
    Q8_0(Vec<BlockQ8_0>),
}

/// A KV cache of `rows` positions × `cols` values.
#[derive(Clone, Debug)]
pub struct CpuKv {
    pub rows: usize,
    pub cols: usize,
    ty: KvType,
    data: Rows,
}

fn shape_err(op: &'static str, msg: String) -> BackendError {
    BackendError::Shape { op, msg }
}

impl CpuKv {
    pub fn new(rows: usize, cols: usize, ty: KvType) -> Result<Self> {
        ty.check_cols(cols)?;
        let n = rows
            .checked_mul(cols)
            .ok_or_else(|| shape_err("alloc_kv", format!("{rows}x{cols} overflows")))?;
        let data = match ty {
            KvType::F32 => Rows::F32(vec![0.0; n]),
            KvType::F16 => Rows::F16(vec![f16::ZERO; n]),
            KvType::Q8_0 => Rows::Q8_0(vec![
                BlockQ8_0 {
                    d: f16::ZERO,
                    qs: [0; QK]
                };
                n / QK
            ]),
        };
        Ok(CpuKv {
            rows,
            cols,
            ty,
            data,
        })
    }

    pub fn ty(&self) -> KvType {
        self.ty
    }

    /// Bytes of one row in the cache's type.
    pub fn row_bytes(&self) -> usize {
        self.ty.row_bytes(self.cols)
    }

    fn bytes(&self) -> &[u8] {
        match &self.data {
            Rows::F32(v) => bytemuck::cast_slice(v),
            Rows::F16(v) => bytemuck::cast_slice(v),
            Rows::Q8_0(v) => bytemuck::cast_slice(v),
        }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        match &mut self.data {
            Rows::F32(v) => bytemuck::cast_slice_mut(v),
            Rows::F16(v) => bytemuck::cast_slice_mut(v),
            Rows::Q8_0(v) => bytemuck::cast_slice_mut(v),
        }
    }

    /// The raw bytes of rows `first..first + n` (what a device would copy).
    pub fn raw_rows(&self, first: usize, n: usize) -> &[u8] {
        let rb = self.row_bytes();
        &self.bytes()[first * rb..(first + n) * rb]
    }

    /// Rows `first..` in raw bytes: whole rows of the cache's type (what a device copy reads).
    pub fn read_raw(&self, first: usize, out: &mut [u8]) -> Result<()> {
        let n = self.whole_rows("read_kv_raw", out.len())?;
        self.check_rows("read_kv_raw", first, n)?;
        out.copy_from_slice(self.raw_rows(first, n));
        Ok(())
    }

    /// Raw bytes (whole rows of the cache's type) into rows `first..`.
    pub fn write_raw(&mut self, first: usize, src: &[u8]) -> Result<()> {
        let n = self.whole_rows("write_kv_raw", src.len())?;
        self.check_rows("write_kv_raw", first, n)?;
        let rb = self.row_bytes();
        self.bytes_mut()[first * rb..(first + n) * rb].copy_from_slice(src);
        Ok(())
    }

    fn whole_rows(&self, op: &'static str, bytes: usize) -> Result<usize> {
        let rb = self.row_bytes();
        if rb == 0 || !bytes.is_multiple_of(rb) {
            return Err(shape_err(
                op,
                format!("{bytes} bytes are not whole {rb}-byte rows"),
            ));
        }
        Ok(bytes / rb)
    }

    fn check_rows(&self, op: &'static str, first: usize, n: usize) -> Result<()> {
        if first + n > self.rows {
            return Err(shape_err(
                op,
                format!("rows {first}..{} of a {}-row cache", first + n, self.rows),
            ));
        }
        Ok(())
    }

    /// Encode f32 `values` (whole rows) into rows `first..`.
    pub fn write(&mut self, first: usize, values: &[f32]) -> Result<()> {
        if self.cols == 0 || !values.len().is_multiple_of(self.cols) {
            return Err(shape_err(
                "write_kv",
                format!("{} values for rows of {}", values.len(), self.cols),
            ));
        }
        let n = values.len() / self.cols;
        self.check_rows("write_kv", first, n)?;
        let (rb, cols, dtype) = (self.row_bytes(), self.cols, self.ty.dtype());
        let bytes = &mut self.bytes_mut()[first * rb..(first + n) * rb];
        for (o, x) in bytes.chunks_exact_mut(rb).zip(values.chunks_exact(cols)) {
            encode_row(dtype, x, o)
                .ok_or_else(|| shape_err("write_kv", format!("{dtype} is not a KV cache type")))?;
        }
        Ok(())
    }

    /// Decode rows `first..first + out.len() / cols` into `out`.
    pub fn read(&self, first: usize, out: &mut [f32]) -> Result<()> {
        if self.cols == 0 || !out.len().is_multiple_of(self.cols) {
            return Err(shape_err(
                "read_kv",
                format!("{} values for rows of {}", out.len(), self.cols),
            ));
        }
        let n = out.len() / self.cols;
        self.check_rows("read_kv", first, n)?;
        decode_rows(self.ty, self.raw_rows(first, n), self.cols, out);
        Ok(())
    }

    /// Store every row of `src` at positions `dst_row..`: those rows, or with a block table
    /// the rows it maps them to.
    pub fn store(&mut self, src: &CpuTensor, blocks: Option<&[u32]>, dst_row: usize) -> Result<()> {
        if src.cols != self.cols {
            return Err(shape_err(
                "store_kv",
                format!("{} columns into a cache of {}", src.cols, self.cols),
            ));
        }
        if let Some(b) = blocks {
            crate::backend::check_kv_table("store_kv", b, dst_row + src.rows, self.rows)?;
        }
        let cols = self.cols;
        for (off, row, n) in crate::backend::kv_runs(blocks, dst_row, src.rows) {
            self.write(row, &src.data[off * cols..(off + n) * cols])?;
        }
        Ok(())
    }

    /// Every value of an f32 cache (row-major), or `None` for the other types.
    pub fn f32_values(&self) -> Option<&[f32]> {
        match &self.data {
            Rows::F32(v) => Some(v),
            _ => None,
        }
    }

    /// Ask L2 for rows `js`' values `col..col + width` ahead of use (a hint; nothing past a row
    /// or past the cache).
    pub fn prefetch(&self, js: Range<usize>, col: usize, width: usize) {
        let js = js.start.min(self.rows)..js.end.min(self.rows);
        let rb = self.row_bytes();
        let at = |c: usize| self.ty.row_bytes(c).min(rb);
        for row in self.raw_rows(js.start, js.len()).chunks_exact(rb) {
            crate::backend::cpu::kernels::prefetch_far(&row[at(col)..at(col + width).max(at(col))]);
        }
    }

    /// Values `col..col + out.len()` of row `j`, as f32: borrowed from an f32 cache, decoded
    /// into `tmp` otherwise.
    pub fn slice<'a>(&'a self, j: usize, col: usize, tmp: &'a mut [f32]) -> &'a [f32] {
        row_slice(self.ty, self.raw_rows(j, 1), col, tmp)
    }

    /// [`KvRows::decode_block`] of rows `js`, in one pass over their bytes.
    pub fn decode_block(&self, js: Range<usize>, col: usize, block: &mut [f32]) {
        let rows = (self.raw_rows(js.start, js.len()), self.row_bytes());
        decode_block(self.ty, rows, col, block);
    }
}

/// Rows of `ty` (`rows`: their raw bytes, `rb` a row), each row's values `col..` as f32 into
/// `block`, `block.len() / rows` values a row (what [`row_slice`] gives each): an f16 cache's
/// runs through one F16C loop, where a call a row cost more than the conversion.
fn decode_block(ty: KvType, (rows, rb): (&[u8], usize), col: usize, block: &mut [f32]) {
    let n = rows.len() / rb.max(1);
    if n == 0 {
        return;
    }
    let width = block.len() / n;
    match ty {
        KvType::F16 => {
            crate::tensor::f16_runs_to_f32(bytemuck::cast_slice(rows), (rb / 2, col), block, width)
        }
        KvType::F32 => {
            for (row, o) in rows
                .chunks_exact(rb)
                .zip(block.chunks_exact_mut(width.max(1)))
            {
                o.copy_from_slice(&bytemuck::cast_slice::<u8, f32>(row)[col..col + width]);
            }
        }
        KvType::Q8_0 => {
            for (row, tmp) in rows
                .chunks_exact(rb)
                .zip(block.chunks_exact_mut(width.max(1)))
            {
                row_slice(ty, row, col, tmp);
            }
        }
    }
}

impl KvRows for CpuKv {
    fn slice<'a>(&'a self, j: usize, col: usize, tmp: &'a mut [f32]) -> &'a [f32] {
        CpuKv::slice(self, j, col, tmp)
    }
    fn decode_block(&self, js: Range<usize>, col: usize, block: &mut [f32]) {
        CpuKv::decode_block(self, js, col, block)
    }
    fn f32_rows(&self) -> Option<(&[f32], usize)> {
        self.f32_values().map(|v| (v, self.cols))
    }
    fn f16_rows(&self) -> Option<(&[f16], usize)> {
        match &self.data {
            Rows::F16(v) => Some((v, self.cols)),
            _ => None,
        }
    }
    fn prefetch(&self, js: Range<usize>, col: usize, width: usize) {
        CpuKv::prefetch(self, js, col, width)
    }
}

/// A block table on the CPU: the block ids a paged sequence's positions map to.
#[derive(Clone, Debug, Default)]
pub struct CpuKvTable {
    blocks: Vec<u32>,
    cap: usize,
}

impl CpuKvTable {
    pub fn new(cap: usize) -> Self {
        CpuKvTable {
            blocks: Vec::with_capacity(cap),
            cap,
        }
    }

    pub fn set(&mut self, blocks: &[u32]) -> Result<()> {
        if blocks.len() > self.cap {
            return Err(shape_err(
                "write_kv_table",
                format!("{} blocks into a table of {}", blocks.len(), self.cap),
            ));
        }
        self.blocks.clear();
        self.blocks.extend_from_slice(blocks);
        Ok(())
    }

    pub fn blocks(&self) -> &[u32] {
        &self.blocks
    }
}

/// A sequence's rows for attention: a cache of its own, or its blocks of a shared one.
pub(super) enum SeqRows<'a> {
    Whole(&'a CpuKv),
    Paged(PagedRows<'a>),
}

impl KvRows for SeqRows<'_> {
    fn slice<'a>(&'a self, j: usize, col: usize, tmp: &'a mut [f32]) -> &'a [f32] {
        match self {
            SeqRows::Whole(kv) => kv.slice(j, col, tmp),
            SeqRows::Paged(p) => p.slice(j, col, tmp),
        }
    }
    fn decode_block(&self, js: Range<usize>, col: usize, block: &mut [f32]) {
        match self {
            SeqRows::Whole(kv) => kv.decode_block(js, col, block),
            SeqRows::Paged(p) => p.decode_block(js, col, block),
        }
    }
    fn f32_rows(&self) -> Option<(&[f32], usize)> {
        match self {
            SeqRows::Whole(kv) => KvRows::f32_rows(*kv),
            SeqRows::Paged(_) => None,
        }
    }
    fn f16_rows(&self) -> Option<(&[f16], usize)> {
        match self {
            SeqRows::Whole(kv) => KvRows::f16_rows(*kv),
            SeqRows::Paged(_) => None,
        }
    }
    fn prefetch(&self, js: Range<usize>, col: usize, width: usize) {
        match self {
            SeqRows::Whole(kv) => kv.prefetch(js, col, width),
            SeqRows::Paged(p) => p.prefetch(js, col, width),
        }
    }
}

/// A paged sequence's rows in a shared cache, through its block table.
pub(super) struct PagedRows<'a> {
    pub kv: &'a CpuKv,
    pub blocks: &'a [u32],
}

impl PagedRows<'_> {
    /// Rows `js` in runs that lie in one block each: `(where the run starts in the shared
    /// cache, its offset in `js`, its length)`; a run whose block is not in the table ends them.
    fn runs(&self, js: Range<usize>) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        let b = crate::backend::KV_BLOCK;
        let mut j = js.start;
        std::iter::from_fn(move || {
            if j >= js.end {
                return None;
            }
            let block = *self.blocks.get(j / b)?;
            let n = (b - j % b).min(js.end - j);
            let run = (block as usize * b + j % b, j - js.start, n);
            j += n;
            Some(run)
        })
    }
}

impl KvRows for PagedRows<'_> {
    fn slice<'a>(&'a self, j: usize, col: usize, tmp: &'a mut [f32]) -> &'a [f32] {
        let b = crate::backend::KV_BLOCK;
        self.kv
            .slice(self.blocks[j / b] as usize * b + j % b, col, tmp)
    }
    fn decode_block(&self, js: Range<usize>, col: usize, block: &mut [f32]) {
        let width = block.len() / js.len().max(1);
        let mut done = 0;
        for (at, off, n) in self.runs(js.clone()) {
            self.kv
                .decode_block(at..at + n, col, &mut block[off * width..(off + n) * width]);
            done = off + n;
        }
        // A row past the table: an error as `slice` makes it.
        if done < js.len() {
            let (b, j) = (crate::backend::KV_BLOCK, js.start + done);
            let at = self.blocks[j / b] as usize * b + j % b;
            self.kv.decode_block(
                at..at + 1,
                col,
                &mut block[done * width..(done + 1) * width],
            );
        }
    }
    fn prefetch(&self, js: Range<usize>, col: usize, width: usize) {
        for (at, _, n) in self.runs(js) {
            self.kv.prefetch(at..at + n, col, width);
        }
    }
}

/// Values `col..col + tmp.len()` of one stored `ty` row, as f32: borrowed from an f32 row,
/// decoded into `tmp` otherwise (f16 through the slice converter, which uses F16C where the CPU
/// has it: a value at a time, attention over an f16 cache was bound by the conversion).
fn row_slice<'a>(ty: KvType, row: &'a [u8], col: usize, tmp: &'a mut [f32]) -> &'a [f32] {
    match ty {
        KvType::F32 => &bytemuck::cast_slice::<u8, f32>(row)[col..col + tmp.len()],
        KvType::F16 => {
            let n = tmp.len();
            crate::tensor::f16_to_f32_slice(
                &bytemuck::cast_slice::<u8, f16>(row)[col..col + n],
                tmp,
            );
            tmp
        }
        KvType::Q8_0 => {
            // Each block's scale decoded once; each value d · q, as before. Whole blocks (a
            // head's columns, a run of heads) in bulk.
            let blocks: &[BlockQ8_0] = bytemuck::cast_slice(row);
            if col.is_multiple_of(QK) && tmp.len().is_multiple_of(QK) {
                let bb = std::mem::size_of::<BlockQ8_0>();
                crate::tensor::q8_0_to_f32(&row[col / QK * bb..(col + tmp.len()) / QK * bb], tmp);
                return tmp;
            }
            let mut i = 0;
            while i < tmp.len() {
                let (b, at) = (&blocks[(col + i) / QK], (col + i) % QK);
                let m = (QK - at).min(tmp.len() - i);
                let d = b.d.to_f32();
                for (o, &q) in tmp[i..i + m].iter_mut().zip(&b.qs[at..]) {
                    *o = d * q as f32;
                }
                i += m;
            }
            tmp
        }
    }
}

/// Decode `n` whole rows of `cols` values of a `ty` cache from raw bytes.
pub fn decode_rows(ty: KvType, bytes: &[u8], cols: usize, out: &mut [f32]) {
    let rb = ty.row_bytes(cols);
    for (b, o) in bytes.chunks_exact(rb).zip(out.chunks_exact_mut(cols)) {
        decode_row(ty.dtype(), b, o);
    }
}

/// Rows of a cache kept as raw bytes of `ty` (`cols` values a row).
struct RawRows<'a> {
    ty: KvType,
    cols: usize,
    bytes: &'a [u8],
}

impl KvRows for RawRows<'_> {
    fn f32_rows(&self) -> Option<(&[f32], usize)> {
        match self.ty {
            // Host memory kept as bytes: direct where the bytes are aligned for f32.
            KvType::F32 => bytemuck::try_cast_slice(self.bytes)
                .ok()
                .map(|v| (v, self.cols)),
            _ => None,
        }
    }
    fn slice<'a>(&'a self, j: usize, col: usize, tmp: &'a mut [f32]) -> &'a [f32] {
        let rb = self.ty.row_bytes(self.cols);
        row_slice(self.ty, &self.bytes[j * rb..(j + 1) * rb], col, tmp)
    }
    fn decode_block(&self, js: Range<usize>, col: usize, block: &mut [f32]) {
        let rb = self.ty.row_bytes(self.cols);
        decode_block(
            self.ty,
            (&self.bytes[js.start * rb..js.end * rb], rb),
            col,
            block,
        );
    }
}

/// Causal attention of `q` (`n` rows of `n_heads · head_dim`, row `t` at position
/// `first_pos + t`) over caches kept as raw rows of `ty` (`(keys, values)`, holding at least
/// `first_pos + n` rows) into `out`: a KV cache in host memory attended on the CPU, with the
/// CPU backend's arithmetic (the same numbers as its cache would give).
pub fn attend_rows(
    ty: KvType,
    (k, v): (&[u8], &[u8]),
    q: &[f32],
    first_pos: usize,
    s: crate::backend::AttnShape,
    out: &mut [f32],
) {
    let cols = s.n_kv_heads * s.head_dim;
    let (keys, values) = (
        RawRows { ty, cols, bytes: k },
        RawRows { ty, cols, bytes: v },
    );
    super::attention::attend_each(
        super::kernels::best(),
        q,
        |t| Some((&keys, &values, first_pos + t + 1)),
        s,
        out,
        true,
    );
}

/// Encode whole rows of `cols` f32 values into the raw bytes of a `ty` cache.
pub fn encode_rows(ty: KvType, values: &[f32], cols: usize) -> Vec<u8> {
    let rb = ty.row_bytes(cols);
    let mut out = vec![0u8; values.len() / cols.max(1) * rb];
    for (o, x) in out.chunks_exact_mut(rb).zip(values.chunks_exact(cols)) {
        // Every KvType is an encodable row format.
        let _ = encode_row(ty.dtype(), x, o);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A block of rows decodes to what each row's `slice` gives, for every type, in a cache
    /// of its own, through a paged table whose blocks lie out of order (runs split at each
    /// block's end), and from raw rows.
    #[test]
    fn a_block_of_rows_decodes_as_each_row_alone() {
        let b = crate::backend::KV_BLOCK;
        let rows = 3 * b;
        let cols = 96;
        let vals: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 53 % 211) as f32 - 105.0) / 9.0)
            .collect();
        for ty in [KvType::F32, KvType::F16, KvType::Q8_0] {
            let mut kv = CpuKv::new(rows, cols, ty).unwrap();
            kv.write(0, &vals).unwrap();
            let table = [2u32, 0, 1];
            let paged = PagedRows {
                kv: &kv,
                blocks: &table,
            };
            let raw = RawRows {
                ty,
                cols,
                bytes: kv.raw_rows(0, rows),
            };
            // Logical row j of the paged view is physical row table[j / b]·b + j % b.
            let physical = |j: usize| table[j / b] as usize * b + j % b;
            for (js, col, width) in [
                (0..5, 0, 32),
                (b - 3..b + 7, 32, 64),
                (1..2 * b + 2, 64, 32),
            ] {
                let mut block = vec![f32::NAN; js.len() * width];
                let mut tmp = vec![0f32; width];
                kv.decode_block(js.clone(), col, &mut block);
                for (j, got) in js.clone().zip(block.chunks_exact(width)) {
                    assert_eq!(got, kv.slice(j, col, &mut tmp), "{ty:?} row {j}");
                }
                raw.decode_block(js.clone(), col, &mut block);
                for (j, got) in js.clone().zip(block.chunks_exact(width)) {
                    assert_eq!(got, kv.slice(j, col, &mut tmp), "{ty:?} raw row {j}");
                }
                block.fill(f32::NAN);
                paged.decode_block(js.clone(), col, &mut block);
                for (j, got) in js.clone().zip(block.chunks_exact(width)) {
                    assert_eq!(
                        got,
                        kv.slice(physical(j), col, &mut tmp),
                        "{ty:?} paged {j}"
                    );
                }
                // Hints past the cache or the table ask for nothing and fail nothing.
                kv.prefetch(rows - 2..rows + 5, col, width);
                paged.prefetch(js.start..rows + b, col, width);
            }
        }
    }

    #[test]
    fn every_type_round_trips_within_its_precision() {
        let vals: Vec<f32> = (0..4 * 64)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        for (ty, tol) in [
            (KvType::F32, 0.0),
            (KvType::F16, 1e-3),
            (KvType::Q8_0, 1.0 / 127.0),
        ] {
            let mut kv = CpuKv::new(6, 64, ty).unwrap();
            kv.write(1, &vals).unwrap();
            let mut back = vec![0f32; vals.len()];
            kv.read(1, &mut back).unwrap();
            let scale = vals.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (a, b) in back.iter().zip(&vals) {
                assert!((a - b).abs() <= tol * scale, "{ty:?}: {a} vs {b}");
            }
            // What was decoded encodes to the same bytes again (swap-out then in is exact).
            let raw = kv.raw_rows(1, 4).to_vec();
            kv.write(1, &back).unwrap();
            assert_eq!(kv.raw_rows(1, 4), &raw[..], "{ty:?}");
            let mut tmp = vec![0f32; 8];
            let s = kv.slice(2, 40, &mut tmp);
            assert_eq!(s, &back[64 + 40..64 + 48], "{ty:?}");
            // Across a Q8_0 block's end, and a whole row.
            let s = kv.slice(2, 28, &mut tmp);
            assert_eq!(s, &back[64 + 28..64 + 36], "{ty:?}");
            let mut row = vec![0f32; 64];
            let s = kv.slice(3, 0, &mut row);
            assert_eq!(s, &back[128..192], "{ty:?}");
        }
        assert!(CpuKv::new(4, 48, KvType::Q8_0).is_err());
        assert!(CpuKv::new(4, 48, KvType::F16).is_ok());
    }
}
