//! `out = x · Wᵀ` on the CPU for every storage format, split over the thread pool by output
//! rows. Quantized weights first quantize the activations to 8-bit blocks (once per call), then
//! use integer dot products; float weights use f32 FMA.

use half::{bf16, f16};
use rayon::prelude::*;

use super::kernels::{ActBlock, ActBlockK, Kernels};
use crate::tensor::{
    BlockQ2K, BlockQ3K, BlockQ4_0, BlockQ4_1, BlockQ4K, BlockQ5_0, BlockQ5_1, BlockQ5K, BlockQ6K,
    BlockQ8_0, DType, HostTensor, QK, QK_K,
};

/// Tokens handled together per weight row: their activations stay in L1 while rows stream by.
const TOKEN_TILE: usize = 16;
/// Weight rows per call of a many-row kernel (one register lane to a row in the AVX-512 set):
/// the rows of a tile where a weight is laid out in tiles.
const ROW_TILE: usize = super::kernels::tiles::TILE_ROWS;

/// Raw pointer to the output, shared by tasks that write disjoint rows.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: tasks write disjoint (row, token) cells; see `matmul`.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// A method (not a field access) so closures capture the whole `Send` wrapper.
    fn at(self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }
}

/// How a weight's rows lie in its bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Layout {
    /// One row after another.
    #[default]
    Rows,
    /// Whole tiles of 16 rows laid out for the many-row kernels ([`kernels::tiles`]), the rows
    /// past the last whole tile one after another: only for a set with those kernels
    /// ([`Kernels::tiled`]).
    ///
    /// [`kernels::tiles`]: super::kernels::tiles
    Tiles,
}

/// A weight as the products read it: the tensor, and how its rows lie in its bytes.
#[derive(Clone, Copy)]
pub struct Matrix<'a> {
    pub t: &'a HostTensor,
    pub layout: Layout,
}

impl<'a> From<&'a HostTensor> for Matrix<'a> {
    fn from(t: &'a HostTensor) -> Self {
        Matrix {
            t,
            layout: Layout::Rows,
        }
    }
}

/// Activations prepared for one weight format.
enum Prepared<'a> {
    Float(&'a [f32]),
    /// 32-value blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 weights).
    Quant(Vec<ActBlock>),
    /// 256-value blocks (K-quant weights).
    QuantK(Vec<ActBlockK>),
}

/// Quantize `n` rows of `cols` activations into blocks of `per` values with `f` (in parallel
/// for many tokens).
fn quantize_rows<B: Default + Clone + Send>(
    x: &[f32],
    n: usize,
    cols: usize,
    per: usize,
    f: fn(&[f32], &mut [B]),
) -> Vec<B> {
    let blocks_per_row = cols / per;
    let mut q = vec![B::default(); n * blocks_per_row];
    let one = |(xr, qr): (&[f32], &mut [B])| f(xr, qr);
    if n >= 8 {
        x.par_chunks(cols)
            .zip(q.par_chunks_mut(blocks_per_row))
            .for_each(one);
    } else {
        x.chunks(cols)
            .zip(q.chunks_mut(blocks_per_row))
            .for_each(one);
    }
    q
}

/// `out[t * w.rows + r] = W[r] · x[t * w.cols ..]` for `n` tokens with kernel set `k`; runs on the
/// current rayon pool.
pub fn matmul(k: &Kernels, w: &HostTensor, x: &[f32], n: usize, out: &mut [f32]) {
    matmul_strided(k, w.into(), x, n, out, w.rows, 0)
}

/// As [`matmul`], into columns `col0 .. col0 + w.rows` of an output with `stride` columns.
pub fn matmul_strided(
    k: &Kernels,
    w: Matrix<'_>,
    x: &[f32],
    n: usize,
    out: &mut [f32],
    stride: usize,
    col0: usize,
) {
    let whole = (0..w.t.rows, 0..w.t.cols);
    product(k, w, whole, x, n, out, (stride, col0))
}

/// As [`matmul_strided`] with the block `rows × cols` of `w` for the weight (a mixture-of-experts
/// layer's expert: a row range of each of its stacked matrices). The column range starts and
/// ends on the format's block boundaries.
#[allow(clippy::too_many_arguments)]
pub fn matmul_block(
    k: &Kernels,
    w: &HostTensor,
    (row_range, col_range): (std::ops::Range<usize>, std::ops::Range<usize>),
    x: &[f32],
    n: usize,
    out: &mut [f32],
    stride: usize,
    col0: usize,
) {
    product(
        k,
        w.into(),
        (row_range, col_range),
        x,
        n,
        out,
        (stride, col0),
    )
}

/// [`matmul_block`] of a weight in either layout.
fn product(
    k: &Kernels,
    w: Matrix<'_>,
    (row_range, col_range): (std::ops::Range<usize>, std::ops::Range<usize>),
    x: &[f32],
    n: usize,
    out: &mut [f32],
    (stride, col0): (usize, usize),
) {
    let (rows, cols) = (row_range.len(), col_range.len());
    assert!(out.len() == n * stride && col0 + rows <= stride);
    let part = Part::new(w, (row_range, col_range), x, n);
    let prepared = prepare(k, w.t.dtype, x, n, cols);
    let ptr = OutPtr(out.as_mut_ptr());
    run_parts(k, &[(part, &prepared, ptr, stride, col0)], n);
}

/// `outs[i][t·stride_i + col0_i + r] = W_i[r] · x[t]` for every part `i` (whole weights of the
/// same `x`: q, k and v), the parts' rows over the pool in one parallel loop, the activations
/// quantized once per kind of block: three small products each paid the pool's wake-up and
/// an idle tail. Each result is [`matmul_strided`]'s bit for bit.
///
/// # Panics
/// Where an output is not `n × stride` with room for its columns, or two parts writing one
/// output overlap (the caller checks both).
pub fn matmul_parts(
    k: &Kernels,
    parts: &[(Matrix<'_>, usize, usize)],
    x: &[f32],
    n: usize,
    outs: &mut [&mut [f32]],
    strides: &[usize],
) {
    for (i, &(w, o, col0)) in parts.iter().enumerate() {
        assert!(outs[o].len() == n * strides[o] && col0 + w.t.rows <= strides[o]);
        for &(w2, o2, c2) in &parts[..i] {
            assert!(o2 != o || c2 + w2.t.rows <= col0 || col0 + w.t.rows <= c2);
        }
    }
    // One preparation of `x` per kind of activation block the parts' formats take.
    let kind = |d: DType| (d.is_k_quant(), d.is_quantized());
    let mut kinds: Vec<(DType, Prepared)> = Vec::new();
    for &(Matrix { t: w, .. }, _, _) in parts {
        if !kinds.iter().any(|(d, _)| kind(*d) == kind(w.dtype)) {
            kinds.push((w.dtype, prepare(k, w.dtype, x, n, w.cols)));
        }
    }
    let ptrs: Vec<OutPtr> = outs.iter_mut().map(|o| OutPtr(o.as_mut_ptr())).collect();
    let jobs: Vec<_> = parts
        .iter()
        .map(|&(w, o, col0)| {
            let prepared = &kinds
                .iter()
                .find(|(d, _)| kind(*d) == kind(w.t.dtype))
                .expect("prepared above")
                .1;
            let part = Part::new(w, (0..w.t.rows, 0..w.t.cols), x, n);
            (part, prepared, ptrs[o], strides[o], col0)
        })
        .collect();
    run_parts(k, &jobs, n);
}

/// `x` as `dtype`'s kernels take it.
fn prepare<'a>(k: &Kernels, dtype: DType, x: &'a [f32], n: usize, cols: usize) -> Prepared<'a> {
    if dtype.is_k_quant() {
        Prepared::QuantK(quantize_rows(x, n, cols, QK_K, k.quantize_k))
    } else if dtype.is_quantized() {
        Prepared::Quant(quantize_rows(x, n, cols, QK, k.quantize))
    } else {
        Prepared::Float(x)
    }
}

/// The rows of one product: a block of a weight's rows and columns.
struct Part<'a> {
    dtype: DType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    sub_bytes: usize,
    /// From the block's first byte to the end of the weight's data.
    data: &'a [u8],
    /// The rows laid out in tiles (a multiple of 16, from the first; none for
    /// [`Layout::Rows`]).
    tiled_rows: usize,
}

impl<'a> Part<'a> {
    fn new(
        Matrix { t: w, layout }: Matrix<'a>,
        (row_range, col_range): (std::ops::Range<usize>, std::ops::Range<usize>),
        x: &[f32],
        n: usize,
    ) -> Self {
        let (rows, cols) = (row_range.len(), col_range.len());
        // Tiles are read whole: a product of them takes every row and column.
        let whole = row_range == (0..w.rows) && col_range == (0..w.cols);
        assert!(
            layout == Layout::Rows || whole,
            "a block of a weight laid out in tiles"
        );
        let block = w.dtype.block_len();
        assert!(
            row_range.end <= w.rows
                && col_range.end <= w.cols
                && col_range.start.is_multiple_of(block)
                && cols.is_multiple_of(block)
        );
        assert!(x.len() == n * cols);
        // Row r of the block: `sub_bytes` bytes from `first + r * row_bytes` of the data.
        let row_bytes = w.row_bytes();
        let first = row_range.start * row_bytes + w.dtype.bytes_for(col_range.start);
        Part {
            dtype: w.dtype,
            rows,
            cols,
            row_bytes,
            sub_bytes: w.dtype.bytes_for(cols),
            data: &w.data.as_slice()[first..],
            tiled_rows: match layout {
                Layout::Rows => 0,
                Layout::Tiles => rows / ROW_TILE * ROW_TILE,
            },
        }
    }

    fn row(&self, r: usize) -> &'a [u8] {
        &self.data[r * self.row_bytes..r * self.row_bytes + self.sub_bytes]
    }
}

/// Every part's rows, split into tasks over the pool together: part, prepared `x`, output,
/// its stride and first column.
fn run_parts(k: &Kernels, jobs: &[(Part<'_>, &Prepared<'_>, OutPtr, usize, usize)], n: usize) {
    let threads = rayon::current_num_threads().max(1);
    let total: usize = jobs.iter().map(|j| j.0.rows).sum();
    // Enough tasks to balance, few enough that scheduling stays cheap for small matrices.
    // Whole tiles of rows: a task's last tile of fewer rows costs the kernel a whole one
    // (SmolLM2's q/k/v took 120-row tasks, each ending in 8; tasks of 128 read a layer's
    // q/k/v and output projections from DRAM in 33–35 µs against 36–42).
    let rows_per_task = total
        .div_ceil(threads * 4)
        .max(1)
        .next_multiple_of(ROW_TILE);
    // (job, first row, end row) of each task; no task spans two parts.
    let tasks: Vec<(usize, usize, usize)> = jobs
        .iter()
        .enumerate()
        .flat_map(|(j, job)| {
            let rows = job.0.rows;
            (0..rows.div_ceil(rows_per_task))
                .map(move |t| (j, t * rows_per_task, ((t + 1) * rows_per_task).min(rows)))
        })
        .collect();
    let task = |&(j, r0, r1): &(usize, usize, usize)| {
        let (part, prepared, ptr, stride, col0) = &jobs[j];
        part_rows(k, part, prepared, n, (*ptr, *stride, *col0), r0..r1);
    };
    if tasks.len() == 1 {
        task(&tasks[0]);
    } else {
        tasks.par_iter().for_each(task);
    }
}

/// Rows `r0..r1` of `part` against the `n` tokens of `prepared` into `out` (pointer, stride,
/// first column).
fn part_rows(
    k: &Kernels,
    part: &Part<'_>,
    prepared: &Prepared<'_>,
    n: usize,
    (ptr, stride, col0): (OutPtr, usize, usize),
    std::ops::Range { start: r0, end: r1 }: std::ops::Range<usize>,
) {
    let (dtype, cols, row_bytes, data) = (part.dtype, part.cols, part.row_bytes, part.data);
    // A many-row kernel unpacks each weight block once for all the tokens and scales 16 rows'
    // blocks in one vector operation, each result bit for bit the one-row kernel's.
    let many = match prepared {
        Prepared::Quant(q) => k.many_rows(dtype, q, cols / QK),
        _ => None,
    };
    let tiled = if part.tiled_rows > 0 {
        let tiled = k.tiled(dtype);
        assert!(
            tiled.is_some() && many.is_some(),
            "{dtype} rows in tiles for kernels without tiles ({})",
            k.name
        );
        tiled
    } else {
        None
    };
    // Float rows used by several tokens are decoded to f32 once per tile.
    let decode_rows = !dtype.is_quantized() && dtype != DType::F32 && n >= 4;
    let mut row_f32 = vec![0f32; if decode_rows { cols } else { 0 }];
    for t0 in (0..n).step_by(TOKEN_TILE) {
        let t1 = (t0 + TOKEN_TILE).min(n);
        if let Some((blocks, dots)) = &many {
            let mut sums = [0f32; ROW_TILE * TOKEN_TILE];
            let nt = t1 - t0;
            let mut ra = r0;
            while ra < r1 {
                // Whole tiles go to the kernel as many at a call as `sums` holds (a decode
                // step's one token: 16), so a call's fixed costs are paid once for them.
                let rb = match tiled {
                    Some(_) if ra < part.tiled_rows => {
                        (ra + ROW_TILE * (TOKEN_TILE / nt)).min(part.tiled_rows)
                    }
                    _ => ra + ROW_TILE,
                }
                .min(r1);
                let sums = &mut sums[..(rb - ra) * nt];
                match tiled {
                    // A task's rows start on a tile (`run_parts`), so a tile is whole here.
                    // No hints: a 49152×576 Q8_0 head in tiles (30 MB, 2 threads, from DRAM)
                    // took 874-921 µs with a tile ahead hinted, 781-827 without.
                    Some(tiled) if rb <= part.tiled_rows => {
                        tiled(&data[ra * row_bytes..rb * row_bytes], blocks, t0, sums)
                    }
                    _ => {
                        // The next rows stream in from DRAM while these compute (the kernel
                        // spreads the prefetches: a tile's lines at once filled the miss
                        // buffers).
                        let next = (rb * row_bytes).min(data.len())
                            ..((rb + ROW_TILE) * row_bytes).min(data.len());
                        let rows: [&[u8]; ROW_TILE] =
                            std::array::from_fn(|i| part.row((ra + i).min(rb - 1)));
                        dots(&rows[..rb - ra], blocks, t0, sums, &data[next]);
                    }
                }
                for (i, r) in (ra..rb).enumerate() {
                    for (t, v) in (t0..t1).zip(&sums[i * nt..(i + 1) * nt]) {
                        // SAFETY: as below.
                        unsafe { *ptr.at(t * stride + col0 + r) = *v };
                    }
                }
                ra = rb;
            }
            continue;
        }
        for r in r0..r1 {
            let mut wrow = part.row(r);
            let mut dtype = dtype;
            if decode_rows {
                crate::tensor::decode_row(dtype, wrow, &mut row_f32);
                wrow = bytemuck::cast_slice(&row_f32);
                dtype = DType::F32;
            }
            for t in t0..t1 {
                let v = dot_row(k, dtype, wrow, prepared, t, cols);
                // SAFETY: (t, r) is written by exactly one task (r in this task's rows; parts
                // writing one output own disjoint columns), and t * stride + col0 + r lies in
                // the output (asserted by the callers).
                unsafe { *ptr.at(t * stride + col0 + r) = v };
            }
        }
    }
}

/// One weight row (bytes in `dtype`) against token `t`.
#[inline]
fn dot_row(k: &Kernels, dtype: DType, wrow: &[u8], x: &Prepared, t: usize, cols: usize) -> f32 {
    match x {
        Prepared::Float(x) => {
            let xt = &x[t * cols..(t + 1) * cols];
            match dtype {
                DType::F32 => (k.dot_f32)(bytemuck::cast_slice(wrow), xt),
                DType::F16 => (k.dot_f16)(bytemuck::cast_slice::<u8, f16>(wrow), xt),
                DType::BF16 => (k.dot_bf16)(bytemuck::cast_slice::<u8, bf16>(wrow), xt),
                _ => unreachable!("quantized formats use Prepared::Quant"),
            }
        }
        Prepared::Quant(q) => {
            let bpr = cols / QK;
            let xt = &q[t * bpr..(t + 1) * bpr];
            match dtype {
                DType::Q8_0 => (k.dot_q8_0)(bytemuck::cast_slice::<u8, BlockQ8_0>(wrow), xt),
                DType::Q4_0 => (k.dot_q4_0)(bytemuck::cast_slice::<u8, BlockQ4_0>(wrow), xt),
                DType::Q4_1 => (k.dot_q4_1)(bytemuck::cast_slice::<u8, BlockQ4_1>(wrow), xt),
                DType::Q5_0 => (k.dot_q5_0)(bytemuck::cast_slice::<u8, BlockQ5_0>(wrow), xt),
                DType::Q5_1 => (k.dot_q5_1)(bytemuck::cast_slice::<u8, BlockQ5_1>(wrow), xt),
                _ => unreachable!("{dtype} does not use 32-value activation blocks"),
            }
        }
        Prepared::QuantK(q) => {
            let bpr = cols / QK_K;
            let xt = &q[t * bpr..(t + 1) * bpr];
            match dtype {
                DType::Q2K => (k.dot_q2_k)(bytemuck::cast_slice::<u8, BlockQ2K>(wrow), xt),
                DType::Q3K => (k.dot_q3_k)(bytemuck::cast_slice::<u8, BlockQ3K>(wrow), xt),
                DType::Q4K => (k.dot_q4_k)(bytemuck::cast_slice::<u8, BlockQ4K>(wrow), xt),
                DType::Q5K => (k.dot_q5_k)(bytemuck::cast_slice::<u8, BlockQ5K>(wrow), xt),
                DType::Q6K => (k.dot_q6_k)(bytemuck::cast_slice::<u8, BlockQ6K>(wrow), xt),
                _ => unreachable!("{dtype} does not use 256-value activation blocks"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::Bytes;
    use rand::{RngExt, SeedableRng, rngs::StdRng};

    fn reference(w: &HostTensor, x: &[f32], n: usize) -> Vec<f32> {
        let wf = w.to_f32();
        let mut out = vec![0f32; n * w.rows];
        for t in 0..n {
            for r in 0..w.rows {
                let mut s = 0f64;
                for c in 0..w.cols {
                    s += wf[r * w.cols + c] as f64 * x[t * w.cols + c] as f64;
                }
                out[t * w.rows + r] = s as f32;
            }
        }
        out
    }

    fn tensor(dtype: DType, rows: usize, cols: usize, rng: &mut StdRng) -> HostTensor {
        let vals: Vec<f32> = (0..rows * cols)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let bytes: Vec<u8> = match dtype {
            DType::F32 => bytemuck::cast_slice(&vals).to_vec(),
            DType::F16 => vals
                .iter()
                .flat_map(|v| f16::from_f32(*v).to_le_bytes())
                .collect(),
            DType::BF16 => vals
                .iter()
                .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
                .collect(),
            DType::Q8_0 => vals
                .chunks(QK)
                .flat_map(|c| {
                    let b = BlockQ8_0 {
                        d: f16::from_f32(1.0 / 127.0),
                        qs: std::array::from_fn(|i| (c[i] * 127.0).round() as i8),
                    };
                    bytemuck::bytes_of(&b).to_vec()
                })
                .collect(),
            DType::Q5_0
            | DType::Q5_1
            | DType::Q2K
            | DType::Q3K
            | DType::Q4K
            | DType::Q5K
            | DType::Q6K => {
                let mut b = vec![0u8; dtype.bytes_for(rows * cols)];
                crate::tensor::quantize_row(dtype, &vals, &mut b);
                b
            }
            DType::Q4_0 | DType::Q4_1 => (0..rows * cols / QK)
                .flat_map(|_| {
                    let qs: [u8; 16] = std::array::from_fn(|_| rng.random::<u8>());
                    let d = f16::from_f32(0.1);
                    if dtype == DType::Q4_0 {
                        bytemuck::bytes_of(&BlockQ4_0 { d, qs }).to_vec()
                    } else {
                        let m = f16::from_f32(-0.7);
                        bytemuck::bytes_of(&BlockQ4_1 { d, m, qs }).to_vec()
                    }
                })
                .collect(),
        };
        HostTensor {
            name: "w".into(),
            rows,
            cols,
            dtype,
            data: Bytes::from_slice(&bytes),
        }
    }

    #[test]
    fn every_format_matches_the_f64_reference() {
        let mut rng = StdRng::seed_from_u64(11);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        for dtype in DType::ALL {
            let shapes = if dtype.is_k_quant() {
                [(5, 256, 1), (67, 512, 3), (130, 256, 21)]
            } else {
                [(5, 64, 1), (67, 96, 3), (130, 64, 21)]
            };
            for (rows, cols, n) in shapes {
                let w = tensor(dtype, rows, cols, &mut rng);
                let x: Vec<f32> = (0..n * cols)
                    .map(|_| rng.random_range(-1.0f32..1.0))
                    .collect();
                let mut out = vec![f32::NAN; n * rows];
                pool.install(|| matmul(super::super::kernels::best(), &w, &x, n, &mut out));
                let want = reference(&w, &x, n);
                let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
                let tol = if dtype.is_quantized() { 2e-2 } else { 1e-5 };
                for (a, b) in out.iter().zip(&want) {
                    assert!(
                        (a - b).abs() <= tol * scale,
                        "{dtype} {rows}x{cols} n={n}: {a} vs {b}"
                    );
                }
            }
        }
    }

    /// Several weights of one input (formats of every kind of activation block, two of them
    /// into one output side by side) in one `matmul_parts`: each part's columns what
    /// `matmul_strided` writes alone, bit for bit, every kernel set, one token and many; the
    /// columns no part owns untouched.
    #[test]
    fn parts_in_one_call_are_each_product_alone_bit_for_bit() {
        let mut rng = StdRng::seed_from_u64(31);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let cols = 256;
        let ws = [
            tensor(DType::Q4_1, 70, cols, &mut rng),
            tensor(DType::Q8_0, 19, cols, &mut rng),
            tensor(DType::F16, 33, cols, &mut rng),
            tensor(DType::Q4K, 40, cols, &mut rng),
        ];
        // (weight, output, first column): outputs of 3 + 70 + 19 and 33 + 40 + 1 columns.
        let parts: Vec<(Matrix, usize, usize)> = vec![
            ((&ws[0]).into(), 0, 3),
            ((&ws[1]).into(), 0, 73),
            ((&ws[2]).into(), 1, 0),
            ((&ws[3]).into(), 1, 33),
        ];
        let strides = [92, 74];
        for k in super::super::kernels::available() {
            for n in [1, 5] {
                let x: Vec<f32> = (0..n * cols)
                    .map(|_| rng.random_range(-1.0f32..1.0))
                    .collect();
                let mut o0 = vec![f32::NAN; n * strides[0]];
                let mut o1 = vec![f32::NAN; n * strides[1]];
                pool.install(|| matmul_parts(k, &parts, &x, n, &mut [&mut o0, &mut o1], &strides));
                let mut want = [
                    vec![f32::NAN; n * strides[0]],
                    vec![f32::NAN; n * strides[1]],
                ];
                for &(w, o, col0) in &parts {
                    matmul_strided(k, w, &x, n, &mut want[o], strides[o], col0);
                }
                assert_same_bits(&[o0, o1], &want, &format!("{} n={n}", k.name));
            }
        }
    }

    /// Each output's values the same bits as the wanted ones'.
    fn assert_same_bits(got: &[Vec<f32>], want: &[Vec<f32>], what: &str) {
        for (o, (got, want)) in got.iter().zip(want).enumerate() {
            for (i, (a, b)) in got.iter().zip(want).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "{what}: output {o} [{i}]");
            }
        }
    }

    /// `w` with its whole tiles of rows laid out for the many-row kernels.
    fn in_tiles(w: &HostTensor) -> HostTensor {
        let mut bytes = w.data.as_slice().to_vec();
        super::super::kernels::tiles::tile_rows(w.dtype, &mut bytes, w.rows, w.row_bytes());
        HostTensor {
            data: Bytes::from_slice(&bytes),
            ..w.clone()
        }
    }

    /// Weights laid out in tiles multiply to their rows' bits: Q8_0, Q4_0 and Q4_1 of 150 rows
    /// (nine tiles and 6 rows left as rows), alone and as a part beside a weight of rows, one
    /// token and many, over two threads (tasks start on whole tiles; each takes two tiles in
    /// one kernel call, the last its tiles then the rows).
    #[test]
    fn tiles_multiply_to_the_rows_bits() {
        let k = super::super::kernels::best();
        let formats = [DType::Q8_0, DType::Q4_0, DType::Q4_1];
        if formats.iter().any(|&d| k.tiled(d).is_none()) {
            println!("skipped: the {} kernels read no tiles", k.name);
            return;
        }
        let mut rng = StdRng::seed_from_u64(43);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let (rows, cols) = (150, 96);
        let beside = tensor(DType::Q4_1, 19, cols, &mut rng);
        for dtype in formats {
            let w = tensor(dtype, rows, cols, &mut rng);
            let tiled = in_tiles(&w);
            assert_ne!(tiled.data.as_slice(), w.data.as_slice());
            let m = Matrix {
                t: &tiled,
                layout: Layout::Tiles,
            };
            for n in [1, 3, 17] {
                let x: Vec<f32> = (0..n * cols)
                    .map(|_| rng.random_range(-1.0f32..1.0))
                    .collect();
                let what = format!("{dtype} n={n}");
                let mut want = vec![f32::NAN; n * rows];
                pool.install(|| matmul(k, &w, &x, n, &mut want));
                let mut got = vec![f32::NAN; n * rows];
                pool.install(|| matmul_strided(k, m, &x, n, &mut got, rows, 0));
                assert_same_bits(&[got], &[want], &what);
                let stride = rows + beside.rows;
                let parts = [(m, 0, 0), ((&beside).into(), 0, rows)];
                let mut both = vec![f32::NAN; n * stride];
                pool.install(|| matmul_parts(k, &parts, &x, n, &mut [&mut both], &[stride]));
                let mut want = vec![f32::NAN; n * stride];
                let plain = [((&w).into(), 0, 0), ((&beside).into(), 0, rows)];
                pool.install(|| matmul_parts(k, &plain, &x, n, &mut [&mut want], &[stride]));
                assert_same_bits(&[both], &[want], &format!("{what}, as parts"));
            }
        }
    }

    /// Weights packed for the products (`Backend::pack_for_products`) lie side by side in one
    /// buffer, each from a cache line on, and multiply to the bits they gave before; together
    /// under two huge pages they are left where they were.
    #[test]
    fn packed_weights_lie_side_by_side_and_multiply_alike() {
        use crate::backend::Backend;
        let b = super::super::CpuBackend::new(2).unwrap();
        let mut rng = StdRng::seed_from_u64(47);
        let cols = 576;
        for (rows, packed) in [(4096, true), (64, false)] {
            let mut ws: Vec<super::super::CpuWeight> = [DType::Q8_0, DType::Q4_1, DType::Q8_0]
                .iter()
                .map(|&d| {
                    let mut w = b.upload(&tensor(d, rows, cols, &mut rng)).unwrap();
                    b.lay_out_for_products(&mut w).unwrap();
                    w
                })
                .collect();
            let mut x = b.alloc(1, cols).unwrap();
            let xs: Vec<f32> = (0..cols).map(|_| rng.random_range(-1.0f32..1.0)).collect();
            b.write(&mut x, &xs).unwrap();
            let products = |ws: &[super::super::CpuWeight]| -> Vec<Vec<f32>> {
                ws.iter()
                    .map(|w| {
                        let mut o = b.alloc(1, rows).unwrap();
                        b.matmul(w, &x, &mut o).unwrap();
                        let mut host = vec![0f32; rows];
                        b.read(&o, &mut host).unwrap();
                        host
                    })
                    .collect()
            };
            let before = products(&ws);
            let starts = |ws: &mut [super::super::CpuWeight]| -> Vec<usize> {
                ws.iter_mut()
                    .map(|w| w.bytes_for_packing().as_slice().as_ptr() as usize)
                    .collect()
            };
            let was = starts(&mut ws);
            let mut refs: Vec<&mut super::super::CpuWeight> = ws.iter_mut().collect();
            b.pack_for_products(&mut refs).unwrap();
            let now = starts(&mut ws);
            if packed {
                for (i, w) in ws[..2].iter_mut().enumerate() {
                    let len = w.bytes_for_packing().len().next_multiple_of(64);
                    assert_eq!(now[i] + len, now[i + 1], "{rows} rows, weight {i}");
                }
            } else {
                assert_eq!(now, was, "{rows} rows moved");
            }
            assert_same_bits(&products(&ws), &before, &format!("{rows} rows packed"));
        }
    }

    /// The backend's op refuses parts that would write the same columns of one output (its
    /// tasks write through one pointer per output), leaving the outputs as they were, and
    /// computes parts side by side.
    #[test]
    fn backend_parts_writing_the_same_columns_are_refused() {
        use crate::backend::{Backend, MatmulPart};
        let b = super::super::CpuBackend::new(2).unwrap();
        let mut rng = StdRng::seed_from_u64(5);
        let (wa, wb) = (
            tensor(DType::Q8_0, 8, 64, &mut rng),
            tensor(DType::Q8_0, 8, 64, &mut rng),
        );
        let (wa, wb) = (b.upload(&wa).unwrap(), b.upload(&wb).unwrap());
        let mut x = b.alloc(1, 64).unwrap();
        b.write(&mut x, &[0.5; 64]).unwrap();
        let mut out = b.alloc(1, 16).unwrap();
        b.write(&mut out, &[7.0; 16]).unwrap();
        let part = |w, col0| MatmulPart { w, out: 0, col0 };
        let err = b
            .matmul_parts(&x, &[part(&wa, 0), part(&wb, 7)], &mut [&mut out])
            .unwrap_err();
        assert!(err.to_string().contains("same columns"), "{err}");
        let mut host = vec![0f32; 16];
        b.read(&out, &mut host).unwrap();
        assert!(host.iter().all(|&v| v == 7.0), "{host:?}");
        b.matmul_parts(&x, &[part(&wa, 0), part(&wb, 8)], &mut [&mut out])
            .unwrap();
        let mut alone = b.alloc(1, 16).unwrap();
        b.matmul_into(&wa, &x, &mut alone, 0).unwrap();
        b.matmul_into(&wb, &x, &mut alone, 8).unwrap();
        let mut want = vec![0f32; 16];
        b.read(&out, &mut host).unwrap();
        b.read(&alone, &mut want).unwrap();
        assert_eq!(host, want);
    }

    /// A token's outputs do not depend on the tokens beside it (batched requests answer as if
    /// alone): every format, every kernel set, tile edges included.
    #[test]
    fn each_token_gets_what_it_gets_alone_bit_for_bit() {
        let mut rng = StdRng::seed_from_u64(23);
        for k in super::super::kernels::available() {
            for dtype in [
                DType::Q8_0,
                DType::Q4_0,
                DType::Q4_1,
                DType::F16,
                DType::BF16,
            ] {
                let (rows, cols, n) = (37, 96, 21);
                let w = tensor(dtype, rows, cols, &mut rng);
                let x: Vec<f32> = (0..n * cols)
                    .map(|_| rng.random_range(-1.0f32..1.0))
                    .collect();
                let mut all = vec![f32::NAN; n * rows];
                matmul(k, &w, &x, n, &mut all);
                for t in 0..n {
                    let mut one = vec![f32::NAN; rows];
                    matmul(k, &w, &x[t * cols..(t + 1) * cols], 1, &mut one);
                    for (r, (a, b)) in all[t * rows..(t + 1) * rows].iter().zip(&one).enumerate() {
                        assert_eq!(
                            a.to_bits(),
                            b.to_bits(),
                            "{} {dtype} token {t} row {r}",
                            k.name
                        );
                    }
                }
            }
        }
    }
}
