//! The CPU backend: a full, fast engine target (SIMD row kernels, a rayon pool per backend) and
//! the reference every other backend is checked against. Weights are used in place (borrowed
//! from the model's memory map), never inflated to f32.

pub mod attention;
mod awake;
pub mod bundles;
pub mod kernels;
mod kv;
pub mod matmul;
pub mod ops;
pub mod sparse;
mod tensor;
mod weight;

pub use kv::{CpuKv, CpuKvTable, attend_rows, decode_rows, encode_rows};
pub use tensor::CpuTensor;
pub use weight::CpuWeight;
use weight::bundle_weight;

use crate::backend::{Experts, Route};
use rayon::prelude::*;

use super::{
    Act, AttnSeq, AttnShape, Backend, BackendError, BundleShape, KvType, MatmulPart, Result,
    RopePairs, WorkspaceOp, sparse_act,
};
use crate::store::Encoding;
use crate::tensor::{Bytes, DType, HostTensor};

pub struct CpuBackend {
    pool: rayon::ThreadPool,
    threads: usize,
    kernels: &'static kernels::Kernels,
    awake: awake::Awake,
}

impl CpuBackend {
    /// A backend with `threads` worker threads (0 = one per available core) and the best
    /// kernels this CPU runs.
    pub fn new(threads: usize) -> Result<Self> {
        Self::with_kernels(threads, kernels::best())
    }

    /// A backend with a chosen kernel set (see [`kernels::available`]).
    pub fn with_kernels(threads: usize, kernels: &'static kernels::Kernels) -> Result<Self> {
        let threads = if threads == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            threads
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("cpu-backend-{i}"))
            .build()
            .map_err(|e| {
                BackendError::Unavailable(format!("cannot start {threads} threads: {e}"))
            })?;
        Ok(CpuBackend {
            pool,
            threads,
            kernels,
            awake: awake::Awake::default(),
        })
    }

    pub fn threads(&self) -> usize {
        self.threads
    }
}

/// Copies into a slot at least this long are split over the threads ([`Backend::upload_into`]).
const PARALLEL_COPY_BYTES: usize = 256 << 10;

fn shape_err(op: &'static str, msg: String) -> BackendError {
    BackendError::Shape { op, msg }
}

fn same_shape(op: &'static str, a: &CpuTensor, b: &CpuTensor) -> Result<()> {
    super::check_same_shape(op, (a.rows, a.cols), (b.rows, b.cols))
}

fn vector<'a>(op: &'static str, w: &'a CpuWeight, len: usize) -> Result<&'a [f32]> {
    let w = w.tensor(op)?;
    if w.dtype != crate::tensor::DType::F32 || w.rows * w.cols != len {
        return Err(shape_err(
            op,
            format!(
                "`{}` must be {len} f32 values, is {}x{} {}",
                w.name, w.rows, w.cols, w.dtype
            ),
        ));
    }
    Ok(bytemuck::cast_slice(w.data.as_slice()))
}

/// Row-parallel work pays off only above this many elements.
const PAR_ELEMS: usize = 1 << 15;

impl Backend for CpuBackend {
    type Tensor = CpuTensor;
    type Weight = CpuWeight;
    type Event = ();
    type Kv = CpuKv;
    type KvTable = CpuKvTable;
    type Recording = ();

    fn name(&self) -> String {
        format!(
            "cpu ({} threads, {} kernels)",
            self.threads, self.kernels.name
        )
    }

    fn enter<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(|| {
            let _held = (self.threads > 1).then(|| self.awake.hold(&self.pool));
            f()
        })
    }

    fn upload(&self, w: &HostTensor) -> Result<CpuWeight> {
        Ok(w.clone().into())
    }

    fn lay_out_for_products(&self, w: &mut CpuWeight) -> Result<()> {
        w.lay_out_for_products(self.kernels)
    }

    fn host_matrix_layout(&self) -> Option<crate::backend::HostMatrixLayout> {
        let k = self.kernels;
        Some(std::sync::Arc::new(move |dtype, rows, row_bytes, bytes| {
            weight::lay_out_rows(k, dtype, rows, row_bytes, bytes)
        }))
    }

    fn upload_laid_out(&self, dst: &mut CpuWeight, src: &[u8]) -> Result<()> {
        dst.check_tiles("upload_laid_out", self.kernels)?;
        self.upload_into(dst, 0, src)?;
        dst.landed_in_tiles();
        Ok(())
    }

    fn pack_for_products(&self, ws: &mut [&mut CpuWeight]) -> Result<()> {
        let mut bytes: Vec<&mut Bytes> = ws.iter_mut().map(|w| w.bytes_for_packing()).collect();
        Bytes::pack_huge(&mut bytes);
        Ok(())
    }

    fn upload_bundles(
        &self,
        name: &str,
        enc: Encoding,
        shape: BundleShape,
        data: &Bytes,
    ) -> Result<CpuWeight> {
        let rows = super::bundle_rows(name, enc, shape, data.len())?;
        Ok(bundle_weight(name, enc, shape, rows, data.clone()))
    }

    fn map_bundles(
        &self,
        name: &str,
        enc: Encoding,
        shape: BundleShape,
        data: &Bytes,
    ) -> Result<CpuWeight> {
        let mut w = self.upload_bundles(name, enc, shape, data)?;
        w.lay_out_neuron_tiles(shape);
        Ok(w)
    }

    fn alloc_bundles(
        &self,
        name: &str,
        enc: Encoding,
        shape: BundleShape,
        rows: usize,
    ) -> Result<CpuWeight> {
        let bytes = super::bundle_bytes(name, enc, shape, rows)?;
        Ok(bundle_weight(name, enc, shape, rows, Bytes::zeroed(bytes)))
    }

    fn alloc_weight(
        &self,
        name: &str,
        dtype: DType,
        rows: usize,
        cols: usize,
    ) -> Result<CpuWeight> {
        if !cols.is_multiple_of(dtype.block_len()) {
            return Err(shape_err(
                "alloc_weight",
                format!("{cols} columns of {dtype}"),
            ));
        }
        let bytes = rows
            .checked_mul(dtype.bytes_for(cols))
            .ok_or_else(|| shape_err("alloc_weight", format!("{rows}x{cols} overflows")))?;
        Ok(HostTensor {
            name: name.to_string(),
            rows,
            cols,
            dtype,
            data: Bytes::zeroed(bytes),
        }
        .into())
    }

    fn retype_weight(
        &self,
        w: &mut CpuWeight,
        dtype: DType,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        w.retype(dtype, rows, cols)
    }

    fn upload_into(&self, dst: &mut CpuWeight, first_row: usize, src: &[u8]) -> Result<()> {
        let rb = dst.row_bytes();
        let start = first_row * rb;
        let (name, bytes) = (dst.name().to_string(), dst.slot_mut("upload_into")?);
        if rb == 0 || !src.len().is_multiple_of(rb) || start + src.len() > bytes.len() {
            return Err(shape_err(
                "upload_into",
                format!(
                    "{} bytes at row {first_row} of `{name}` ({} bytes)",
                    src.len(),
                    bytes.len()
                ),
            ));
        }
        let dst = &mut bytes[start..start + src.len()];
        // A layer's streamed share (SmolLM2's attention: 553 KB) copied by one thread ran at
        // 7.6 GB/s here, under the budgeted device's link rate (one memcpy of a large buffer,
        // 9.4 GB/s); its pacing holds it to the link's rate.
        if src.len() >= PARALLEL_COPY_BYTES {
            let chunk = src.len().div_ceil(self.threads()).next_multiple_of(4096);
            self.enter(|| {
                dst.par_chunks_mut(chunk)
                    .zip(src.par_chunks(chunk))
                    .for_each(|(d, s)| d.copy_from_slice(s));
            });
        } else {
            dst.copy_from_slice(src);
        }
        Ok(())
    }

    fn copies_done(&self) -> Result<()> {
        Ok(())
    }

    fn compute_done(&self) -> Result<()> {
        Ok(())
    }

    fn compute_waits(&self, _: &()) -> Result<()> {
        Ok(())
    }

    fn copies_wait(&self, _: &()) -> Result<()> {
        Ok(())
    }

    fn host_waits(&self, _: &()) -> Result<()> {
        Ok(())
    }

    fn alloc(&self, rows: usize, cols: usize) -> Result<CpuTensor> {
        let n = rows
            .checked_mul(cols)
            .ok_or_else(|| BackendError::OutOfMemory {
                what: format!("a {rows}x{cols} buffer"),
                needed: usize::MAX,
                available: 0,
            })?;
        Ok(CpuTensor {
            rows,
            cols,
            data: vec![0.0; n],
            capacity: n,
        })
    }

    fn write(&self, dst: &mut CpuTensor, src: &[f32]) -> Result<()> {
        if dst.data.len() != src.len() {
            return Err(shape_err(
                "write",
                format!("{} values into {}", src.len(), dst.data.len()),
            ));
        }
        dst.data.copy_from_slice(src);
        Ok(())
    }

    fn read(&self, src: &CpuTensor, dst: &mut [f32]) -> Result<()> {
        if dst.len() != src.data.len() {
            return Err(shape_err(
                "read",
                format!("{} values into {}", src.data.len(), dst.len()),
            ));
        }
        dst.copy_from_slice(&src.data);
        Ok(())
    }

    fn copy_rows(
        &self,
        src: &CpuTensor,
        src_row: usize,
        dst: &mut CpuTensor,
        dst_row: usize,
        n: usize,
    ) -> Result<()> {
        if src.cols != dst.cols || src_row + n > src.rows || dst_row + n > dst.rows {
            return Err(shape_err(
                "copy_rows",
                format!(
                    "{n} rows from {src_row} of {}x{} to {dst_row} of {}x{}",
                    src.rows, src.cols, dst.rows, dst.cols
                ),
            ));
        }
        let c = src.cols;
        dst.data[dst_row * c..(dst_row + n) * c]
            .copy_from_slice(&src.data[src_row * c..(src_row + n) * c]);
        Ok(())
    }

    fn shape(&self, t: &CpuTensor) -> (usize, usize) {
        (t.rows, t.cols)
    }

    fn reshape(&self, t: &mut CpuTensor, rows: usize, cols: usize) -> Result<()> {
        let n = rows.checked_mul(cols).filter(|&n| n <= t.capacity);
        let Some(n) = n else {
            return Err(shape_err(
                "reshape",
                format!("{rows}x{cols} in a buffer of {} values", t.capacity),
            ));
        };
        // Within the allocation: the Vec keeps its capacity, nothing is reallocated.
        t.data.resize(n, 0.0);
        (t.rows, t.cols) = (rows, cols);
        Ok(())
    }

    /// Host memory is not a device: no op needs workspace.
    fn workspace_bytes(&self, _: &WorkspaceOp) -> u64 {
        0
    }

    fn set_workspace(&self, _: u64) -> Result<()> {
        Ok(())
    }

    fn workspace_held(&self) -> u64 {
        0
    }

    fn alloc_kv(&self, rows: usize, cols: usize, ty: KvType) -> Result<CpuKv> {
        CpuKv::new(rows, cols, ty)
    }

    fn kv_shape(&self, kv: &CpuKv) -> (usize, usize, KvType) {
        (kv.rows, kv.cols, kv.ty())
    }

    fn alloc_kv_table(&self, blocks: usize) -> Result<CpuKvTable> {
        Ok(CpuKvTable::new(blocks))
    }

    fn write_kv_table(&self, table: &mut CpuKvTable, blocks: &[u32]) -> Result<()> {
        table.set(blocks)
    }

    fn store_kv(
        &self,
        src: &CpuTensor,
        dst: &mut CpuKv,
        table: Option<&CpuKvTable>,
        dst_row: usize,
    ) -> Result<()> {
        dst.store(src, table.map(|t| t.blocks()), dst_row)
    }

    fn read_kv(&self, src: &CpuKv, first: usize, out: &mut [f32]) -> Result<()> {
        src.read(first, out)
    }

    fn write_kv(&self, dst: &mut CpuKv, first: usize, values: &[f32]) -> Result<()> {
        dst.write(first, values)
    }

    fn read_kv_raw(&self, src: &CpuKv, first: usize, out: &mut [u8]) -> Result<()> {
        src.read_raw(first, out)
    }

    fn write_kv_raw(&self, dst: &mut CpuKv, first: usize, src: &[u8]) -> Result<()> {
        dst.write_raw(first, src)
    }

    fn embed(&self, table: &CpuWeight, ids: &[u32], out: &mut CpuTensor) -> Result<()> {
        let table = table.tensor("embed")?;
        if out.rows != ids.len() || out.cols != table.cols {
            return Err(shape_err(
                "embed",
                format!("{} ids into {}x{}", ids.len(), out.rows, out.cols),
            ));
        }
        for (&id, o) in ids.iter().zip(out.data.chunks_mut(table.cols)) {
            if id as usize >= table.rows {
                return Err(shape_err(
                    "embed",
                    format!("token id {id} ≥ vocabulary {}", table.rows),
                ));
            }
            table
                .row_f32(id as usize, o)
                .map_err(|e| shape_err("embed", e.to_string()))?;
        }
        Ok(())
    }

    fn add_table_rows(&self, x: &mut CpuTensor, table: &CpuWeight, first_row: usize) -> Result<()> {
        let table = table.tensor("add_table_rows")?;
        if x.cols != table.cols || first_row + x.rows > table.rows {
            return Err(shape_err(
                "add_table_rows",
                format!(
                    "rows {first_row}..{} of a {}-row table",
                    first_row + x.rows,
                    table.rows
                ),
            ));
        }
        let mut row = vec![0f32; x.cols];
        for (i, xr) in x.data.chunks_mut(x.cols).enumerate() {
            table
                .row_f32(first_row + i, &mut row)
                .map_err(|e| shape_err("add_table_rows", e.to_string()))?;
            xr.iter_mut().zip(&row).for_each(|(a, b)| *a += b);
        }
        Ok(())
    }

    fn matmul_into(
        &self,
        w: &CpuWeight,
        x: &CpuTensor,
        out: &mut CpuTensor,
        col0: usize,
    ) -> Result<()> {
        let w = w.matrix("matmul")?;
        let (wd, xd, od) = ((w.t.rows, w.t.cols), (x.rows, x.cols), (out.rows, out.cols));
        super::check_matmul_shape(&w.t.name, wd, xd, od, col0)?;
        let stride = out.cols;
        self.pool.install(|| {
            matmul::matmul_strided(
                self.kernels,
                w,
                &x.data,
                x.rows,
                &mut out.data,
                stride,
                col0,
            )
        });
        Ok(())
    }

    /// One parallel loop over every part's rows (`matmul::matmul_parts`), `x` quantized once.
    fn matmul_parts(
        &self,
        x: &CpuTensor,
        parts: &[MatmulPart<'_, CpuWeight>],
        outs: &mut [&mut CpuTensor],
    ) -> Result<()> {
        super::check_parts(parts, outs.len())?;
        let mut ws: Vec<(matmul::Matrix, usize, usize)> = Vec::with_capacity(parts.len());
        for (i, p) in parts.iter().enumerate() {
            let m = p.w.matrix("matmul_parts")?;
            let w = m.t;
            let (o, cols) = (&outs[p.out], p.col0..p.col0 + w.rows);
            let od = (o.rows, o.cols);
            super::check_matmul_shape(&w.name, (w.rows, w.cols), (x.rows, x.cols), od, p.col0)?;
            // The tasks write their columns through one pointer per output.
            if let Some(j) = ws.iter().position(|&(w2, out, col0)| {
                out == p.out && col0 < cols.end && cols.start < col0 + w2.t.rows
            }) {
                return Err(shape_err(
                    "matmul_parts",
                    format!(
                        "parts {j} and {i} write the same columns of output {}",
                        p.out
                    ),
                ));
            }
            ws.push((m, p.out, p.col0));
        }
        let strides: Vec<usize> = outs.iter().map(|o| o.cols).collect();
        let mut data: Vec<&mut [f32]> = outs.iter_mut().map(|o| o.data.as_mut_slice()).collect();
        let k = self.kernels;
        self.pool
            .install(|| matmul::matmul_parts(k, &ws, &x.data, x.rows, &mut data, &strides));
        Ok(())
    }

    fn ffn_bundles_up(
        &self,
        b: &CpuWeight,
        shape: BundleShape,
        x: &CpuTensor,
        act: Act,
        threshold: f32,
        up_bias: Option<&CpuWeight>,
        h: &mut CpuTensor,
        col0: usize,
    ) -> Result<()> {
        let op = "ffn_bundles_up";
        if x.cols != shape.d || h.rows != x.rows || col0 + b.rows() > h.cols {
            return Err(shape_err(
                op,
                format!(
                    "x {}x{}, {} neurons at {col0} into h {}x{}",
                    x.rows,
                    x.cols,
                    b.rows(),
                    h.rows,
                    h.cols
                ),
            ));
        }
        let bias = up_bias.map(|bb| vector(op, bb, h.cols)).transpose()?;
        let (stride, n) = (h.cols, x.rows);
        let f = ops::activation(act);
        bundles::with_bundles(b, op, shape, |view| {
            self.pool.install(|| {
                bundles::up_view(
                    self.kernels,
                    view,
                    &x.data,
                    n,
                    f,
                    threshold,
                    bias,
                    &mut h.data,
                    stride,
                    col0,
                )
            })
        })
    }

    fn ffn_bundles_down(
        &self,
        b: &CpuWeight,
        shape: BundleShape,
        h: &CpuTensor,
        col0: usize,
        out: &mut CpuTensor,
    ) -> Result<()> {
        let op = "ffn_bundles_down";
        if out.cols != shape.d || h.rows != out.rows || col0 + b.rows() > h.cols {
            return Err(shape_err(
                op,
                format!(
                    "h {}x{}, {} neurons at {col0} into {}x{}",
                    h.rows,
                    h.cols,
                    b.rows(),
                    out.rows,
                    out.cols
                ),
            ));
        }
        let (stride, n) = (h.cols, h.rows);
        bundles::with_bundles(b, op, shape, |view| {
            self.pool.install(|| {
                bundles::down_view(self.kernels, view, &h.data, n, stride, col0, &mut out.data)
            })
        })
    }

    fn ffn_bundles_up_listed_from(
        &self,
        listed: (&CpuWeight, Option<&CpuWeight>),
        shape: BundleShape,
        x: &CpuTensor,
        act: Act,
        threshold: f32,
        up_bias: Option<&CpuWeight>,
        idx: &[u32],
        h: &mut CpuTensor,
    ) -> Result<()> {
        let how = (act, threshold);
        self.listed_reading(listed, shape, x, how, up_bias, idx, h, None)?;
        Ok(())
    }

    fn ffn_bundles_listed_from(
        &self,
        listed: (&CpuWeight, Option<&CpuWeight>),
        shape: BundleShape,
        x: &CpuTensor,
        how: (Act, f32),
        up_bias: Option<&CpuWeight>,
        (idx, ids): (&[u32], &[u32]),
        h: &mut CpuTensor,
        out: &mut CpuTensor,
    ) -> Result<()> {
        let down = Some((ids, out));
        self.listed_reading(listed, shape, x, how, up_bias, idx, h, down)?;
        Ok(())
    }

    fn ffn_bundles_down_listed_from(
        &self,
        (b, rest): (&CpuWeight, Option<&CpuWeight>),
        shape: BundleShape,
        h: &CpuTensor,
        (idx, ids): (&[u32], &[u32]),
        out: &mut CpuTensor,
    ) -> Result<()> {
        let op = "ffn_bundles_down_listed";
        let (n, m) = (h.rows, idx.len());
        if out.cols != shape.d || out.rows != n || m > h.cols {
            return Err(shape_err(
                op,
                format!(
                    "h {}x{}, {m} neurons into {}x{}",
                    n, h.cols, out.rows, out.cols
                ),
            ));
        }
        let mut compact = vec![0f32; n * m];
        for t in 0..n {
            compact[t * m..(t + 1) * m].copy_from_slice(&h.data[t * h.cols..t * h.cols + m]);
        }
        if let Some(list) = bundles::tiled_list(b, op, shape, rest)? {
            let (k, out) = (self.kernels, &mut out.data);
            return self
                .pool
                .install(|| sparse::tiled_down(k, list, (idx, ids), &compact, n, out));
        }
        bundles::with_listed(b, op, shape, rest, |view| {
            self.pool.install(|| {
                sparse::sparse_down(self.kernels, view, (idx, ids), &compact, n, &mut out.data)
            })
        })?
    }

    fn scatter_rows(&self, src: &CpuWeight, rows: &[u32], dst: &mut CpuWeight) -> Result<()> {
        let rb = dst.row_bytes();
        super::check_scatter(
            (src.name(), src.rows(), src.row_bytes(), src.encoding()),
            (dst.name(), dst.rows(), rb, dst.encoding()),
            rows,
        )?;
        let from = src.row_bytes_of("scatter_rows")?;
        let out = dst.slot_mut("scatter_rows")?;
        for (i, &r) in rows.iter().enumerate() {
            let r = r as usize;
            out[r * rb..(r + 1) * rb].copy_from_slice(&from[i * rb..(i + 1) * rb]);
        }
        Ok(())
    }

    fn zero(&self, x: &mut CpuTensor) -> Result<()> {
        x.data.fill(0.0);
        Ok(())
    }

    fn add_bias(&self, x: &mut CpuTensor, bias: &CpuWeight) -> Result<()> {
        let b = vector("add_bias", bias, x.cols)?;
        for row in x.data.chunks_mut(x.cols) {
            row.iter_mut().zip(b).for_each(|(a, b)| *a += b);
        }
        Ok(())
    }

    fn add(&self, x: &mut CpuTensor, y: &CpuTensor) -> Result<()> {
        same_shape("add", x, y)?;
        x.data.iter_mut().zip(&y.data).for_each(|(a, b)| *a += b);
        Ok(())
    }

    fn rms_norm(&self, x: &CpuTensor, w: &CpuWeight, eps: f32, out: &mut CpuTensor) -> Result<()> {
        same_shape("rms_norm", x, out)?;
        let w = vector("rms_norm", w, x.cols)?;
        for (xr, or) in x.data.chunks(x.cols).zip(out.data.chunks_mut(x.cols)) {
            ops::rms_norm(xr, w, eps, or);
        }
        Ok(())
    }

    fn rms_norm_heads(
        &self,
        x: &mut CpuTensor,
        w: &CpuWeight,
        head_dim: usize,
        eps: f32,
    ) -> Result<()> {
        let w = vector("rms_norm_heads", w, head_dim)?;
        if head_dim == 0 || !x.cols.is_multiple_of(head_dim) {
            return Err(shape_err(
                "rms_norm_heads",
                format!("rows of {} values are not heads of {head_dim}", x.cols),
            ));
        }
        for head in x.data.chunks_mut(head_dim) {
            ops::rms_norm_in_place(head, w, eps);
        }
        Ok(())
    }

    fn layer_norm(
        &self,
        x: &CpuTensor,
        w: &CpuWeight,
        b: &CpuWeight,
        eps: f32,
        out: &mut CpuTensor,
    ) -> Result<()> {
        same_shape("layer_norm", x, out)?;
        let w = vector("layer_norm", w, x.cols)?;
        let b = vector("layer_norm", b, x.cols)?;
        for (xr, or) in x.data.chunks(x.cols).zip(out.data.chunks_mut(x.cols)) {
            ops::layer_norm(xr, w, b, eps, or);
        }
        Ok(())
    }

    fn rope(
        &self,
        x: &mut CpuTensor,
        head_dim: usize,
        rot_dims: usize,
        pairs: RopePairs,
        inv_freq: &CpuWeight,
        first_pos: usize,
    ) -> Result<()> {
        super::check_rope(x.cols, head_dim, rot_dims, None)?;
        let inv_freq = vector("rope", inv_freq, rot_dims / 2)?;
        let mut cos_sin = vec![(0f32, 0f32); rot_dims / 2];
        for (i, row) in x.data.chunks_mut(x.cols).enumerate() {
            let pos = (first_pos + i) as f32;
            for (cs, f) in cos_sin.iter_mut().zip(inv_freq) {
                let angle = pos * f;
                *cs = (angle.cos(), angle.sin());
            }
            for head in row.chunks_mut(head_dim) {
                ops::rotate(head, &cos_sin, pairs);
            }
        }
        Ok(())
    }

    fn activate(&self, x: &mut CpuTensor, act: Act, threshold: f32) -> Result<()> {
        let f = ops::activation(act);
        let apply = |c: &mut [f32]| c.iter_mut().for_each(|v| *v = sparse_act(f(*v), threshold));
        if x.data.len() >= PAR_ELEMS {
            self.pool
                .install(|| x.data.par_chunks_mut(4096).for_each(apply));
        } else {
            apply(&mut x.data);
        }
        Ok(())
    }

    fn moe_ffn(
        &self,
        experts: Experts<'_, CpuWeight>,
        x: &CpuTensor,
        routes: &[Route],
        act: Act,
        out: &mut CpuTensor,
    ) -> Result<()> {
        let op = "moe_ffn";
        let up = experts.up.tensor(op)?;
        let down = experts.down.tensor(op)?;
        let gate = experts.gate.map(|g| g.tensor(op)).transpose()?;
        let (d, f) = (x.cols, experts.width);
        let shapes = Experts {
            gate,
            up,
            down,
            width: f,
        };
        let by_expert = crate::backend::checks::moe_routes(
            ((x.rows, x.cols), (out.rows, out.cols)),
            &shapes,
            |w| (w.rows, w.cols),
            routes,
        )?;
        if !f.is_multiple_of(down.dtype.block_len()) {
            return Err(shape_err(
                op,
                format!("experts of {f} neurons: not whole {} blocks", down.dtype),
            ));
        }
        let f_act = ops::activation(act);
        let k = self.kernels;
        // One expert's output rows for its tokens.
        let expert = |e: usize, tokens: &[(usize, f32)]| -> Vec<f32> {
            let m = tokens.len();
            let xe: Vec<f32> = tokens
                .iter()
                .flat_map(|&(t, _)| x.data[t * d..(t + 1) * d].iter().copied())
                .collect();
            let neurons = e * f..(e + 1) * f;
            let mut h = vec![0f32; m * f];
            matmul::matmul_block(k, up, (neurons.clone(), 0..d), &xe, m, &mut h, f, 0);
            match gate {
                Some(g) => {
                    let mut gv = vec![0f32; m * f];
                    matmul::matmul_block(k, g, (neurons, 0..d), &xe, m, &mut gv, f, 0);
                    h.iter_mut().zip(&gv).for_each(|(u, g)| *u *= f_act(*g));
                }
                None => h.iter_mut().for_each(|u| *u = f_act(*u)),
            }
            let mut y = vec![0f32; m * d];
            matmul::matmul_block(k, down, (e * d..(e + 1) * d, 0..f), &h, m, &mut y, d, 0);
            y
        };
        // The experts run side by side (a decode step's few small products would otherwise
        // each be split across the threads); their outputs are summed in expert order, so the
        // result does not depend on the thread count.
        let ys: Vec<(usize, Vec<f32>)> = self.pool.install(|| {
            by_expert
                .par_iter()
                .enumerate()
                .filter(|(_, tokens)| !tokens.is_empty())
                .map(|(e, tokens)| (e, expert(e, tokens)))
                .collect()
        });
        out.data.fill(0.0);
        for (e, y) in &ys {
            for (i, &(t, w)) in by_expert[*e].iter().enumerate() {
                let row = &mut out.data[t * d..(t + 1) * d];
                row.iter_mut()
                    .zip(&y[i * d..(i + 1) * d])
                    .for_each(|(o, v)| *o += v * w);
            }
        }
        Ok(())
    }

    fn gated(&self, gate: &mut CpuTensor, up: &CpuTensor, act: Act, threshold: f32) -> Result<()> {
        same_shape("gated", gate, up)?;
        let f = ops::activation(act);
        let apply = |(g, u): (&mut [f32], &[f32])| {
            g.iter_mut()
                .zip(u)
                .for_each(|(g, u)| *g = sparse_act(f(*g), threshold) * u)
        };
        if gate.data.len() >= PAR_ELEMS {
            self.pool.install(|| {
                gate.data
                    .par_chunks_mut(4096)
                    .zip(up.data.par_chunks(4096))
                    .for_each(apply)
            });
        } else {
            apply((&mut gate.data, &up.data));
        }
        Ok(())
    }

    fn prefetch_kv(&self, k_cache: &CpuKv, v_cache: &CpuKv, rows: usize) {
        attention::prefetch_first_chunk([(k_cache, k_cache.cols), (v_cache, v_cache.cols)], rows);
    }

    fn attention(
        &self,
        q: &CpuTensor,
        k_cache: &CpuKv,
        v_cache: &CpuKv,
        table: Option<&CpuKvTable>,
        first_pos: usize,
        s: AttnShape,
        out: &mut CpuTensor,
    ) -> Result<()> {
        let seq = AttnSeq {
            first_row: 0,
            rows: q.rows,
            first_pos,
            k: k_cache,
            v: v_cache,
            table,
        };
        self.attention_batch(q, &[seq], s, out)
    }

    fn attends_batches(&self) -> bool {
        true
    }

    fn attention_batch(
        &self,
        q: &CpuTensor,
        seqs: &[AttnSeq<'_, Self>],
        s: AttnShape,
        out: &mut CpuTensor,
    ) -> Result<()> {
        let kv_dim = s.n_kv_heads * s.head_dim;
        let q_dim = s.n_heads * s.head_dim;
        if q.cols != q_dim
            || out.cols != q_dim
            || out.rows != q.rows
            || s.n_kv_heads == 0
            || !s.n_heads.is_multiple_of(s.n_kv_heads)
        {
            return Err(shape_err(
                "attention",
                format!(
                    "q {}x{} into {}x{}, {} heads over {} KV heads",
                    q.rows, q.cols, out.rows, out.cols, s.n_heads, s.n_kv_heads
                ),
            ));
        }
        // Each row's sequence; each sequence's caches as attention reads them.
        let mut owner: Vec<Option<usize>> = vec![None; q.rows];
        let mut views = Vec::with_capacity(seqs.len());
        let mut work = 0;
        for (i, seq) in seqs.iter().enumerate() {
            let (k, v, n, first_pos) = (seq.k, seq.v, seq.rows, seq.first_pos);
            let rows = match seq.table {
                // Paged: the table says which rows; it must cover the positions, inside the cache.
                Some(t) => {
                    let cache_rows = k.rows.min(v.rows);
                    super::check_kv_table("attention", t.blocks(), first_pos + n, cache_rows)?;
                    first_pos + n
                }
                None => k.rows.min(v.rows),
            };
            if k.cols != kv_dim
                || v.cols != kv_dim
                || first_pos + n > rows
                || seq.first_row + n > q.rows
            {
                return Err(shape_err(
                    "attention",
                    format!(
                        "rows {}..{} of q {}x{}, caches {}x{}, {n} positions from {first_pos}",
                        seq.first_row,
                        seq.first_row + n,
                        q.rows,
                        q.cols,
                        k.rows,
                        k.cols
                    ),
                ));
            }
            for (r, o) in owner.iter_mut().enumerate().skip(seq.first_row).take(n) {
                if o.replace(i).is_some() {
                    return Err(shape_err(
                        "attention",
                        format!("row {r} is in two sequences"),
                    ));
                }
            }
            views.push(match seq.table {
                Some(t) => (
                    kv::SeqRows::Paged(kv::PagedRows {
                        kv: k,
                        blocks: t.blocks(),
                    }),
                    kv::SeqRows::Paged(kv::PagedRows {
                        kv: v,
                        blocks: t.blocks(),
                    }),
                ),
                None => (kv::SeqRows::Whole(k), kv::SeqRows::Whole(v)),
            });
            work += n * s.n_heads * (first_pos + n) * s.head_dim;
        }
        let caches = |t: usize| {
            owner[t].map(|i| {
                let seq = &seqs[i];
                let len = seq.first_pos + (t - seq.first_row) + 1;
                (&views[i].0, &views[i].1, len)
            })
        };
        let (k, q, out) = (self.kernels, &q.data, &mut out.data);
        if work >= PAR_ELEMS / 2 {
            self.pool
                .install(|| attention::attend_each(k, q, caches, s, out, true));
        } else {
            attention::attend_each(k, q, caches, s, out, false);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::KV_BLOCK;

    /// Several sequences in one call — own caches of two types and blocks of a shared one —
    /// get, bit for bit, what each gets from `attention` alone; a row of no sequence is left
    /// as it was; a row claimed twice is refused.
    #[test]
    fn attention_batch_gives_each_sequence_its_own_attention() {
        let b = CpuBackend::new(2).unwrap();
        let s = AttnShape {
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 8,
            scale: 0.35,
        };
        let (q_dim, kv_dim) = (32, 16);
        let vals = |n: usize, seed: usize| -> Vec<f32> {
            (0..n)
                .map(|i| (((i + seed) * 7919 % 1009) as f32 - 504.0) / 300.0)
                .collect()
        };
        let cache = |rows, ty, seed| {
            let mut kv = b.alloc_kv(rows, kv_dim, ty).unwrap();
            b.write_kv(&mut kv, 0, &vals(rows * kv_dim, seed)).unwrap();
            kv
        };
        let (ka, va) = (cache(20, KvType::F32, 1), cache(20, KvType::F32, 2));
        let (kc, vc) = (cache(8, KvType::F16, 3), cache(8, KvType::F16, 4));
        let (kp, vp) = (
            cache(4 * KV_BLOCK, KvType::F32, 5),
            cache(4 * KV_BLOCK, KvType::F32, 6),
        );
        let mut table = b.alloc_kv_table(2).unwrap();
        b.write_kv_table(&mut table, &[3, 1]).unwrap();
        // (first_row, rows, first_pos, k, v, table)
        let seqs = [
            (0, 2, 5, &ka, &va, None),
            (2, 3, 0, &kc, &vc, None),
            (6, 1, 17, &kp, &vp, Some(&table)),
        ];
        let mut q = b.alloc(7, q_dim).unwrap();
        let qv = vals(7 * q_dim, 7);
        b.write(&mut q, &qv).unwrap();
        let mut out = b.alloc(7, q_dim).unwrap();
        b.write(&mut out, &vec![9.0; 7 * q_dim]).unwrap();
        let batch: Vec<AttnSeq<'_, CpuBackend>> = seqs
            .iter()
            .map(|&(first_row, rows, first_pos, k, v, table)| AttnSeq {
                first_row,
                rows,
                first_pos,
                k,
                v,
                table,
            })
            .collect();
        b.attention_batch(&q, &batch, s, &mut out).unwrap();
        for &(first_row, rows, first_pos, k, v, table) in &seqs {
            let mut qa = b.alloc(rows, q_dim).unwrap();
            b.write(&mut qa, &qv[first_row * q_dim..(first_row + rows) * q_dim])
                .unwrap();
            let mut alone = b.alloc(rows, q_dim).unwrap();
            b.attention(&qa, k, v, table, first_pos, s, &mut alone)
                .unwrap();
            let got = &out.data[first_row * q_dim..(first_row + rows) * q_dim];
            assert!(got == &alone.data[..], "rows from {first_row}");
        }
        assert!(out.data[5 * q_dim..6 * q_dim].iter().all(|&x| x == 9.0));
        let twice = [
            AttnSeq::<CpuBackend> {
                first_row: 0,
                rows: 2,
                first_pos: 5,
                k: &ka,
                v: &va,
                table: None,
            },
            AttnSeq {
                first_row: 1,
                rows: 1,
                first_pos: 0,
                k: &kc,
                v: &vc,
                table: None,
            },
        ];
        assert!(b.attention_batch(&q, &twice, s, &mut out).is_err());
    }
}
