//! The sparse operators over weight matrices in their storage format (GGUF blocks or floats),
//! for models whose FFN is not bundled: the listed rows of a gate/up matrix ([`sparse_rows`])
//! and a down matrix's blocks that hold a listed neuron ([`sparse_down_blocks`]).

use rayon::prelude::*;

use super::bundle::err;
use super::items::per_items;
use crate::backend::Result;
use crate::backend::cpu::kernels::{ActBlock, ActBlockK, Kernels};
use crate::tensor::{
    BlockQ2K, BlockQ3K, BlockQ4_0, BlockQ4_1, BlockQ4K, BlockQ5_0, BlockQ5_1, BlockQ5K, BlockQ6K,
    BlockQ8_0, DType, HostTensor, QK, QK_K,
};

/// Activations of one token prepared for a weight format.
#[derive(Clone, Copy)]
enum ActRow<'a> {
    Float(&'a [f32]),
    Quant(&'a [ActBlock]),
    QuantK(&'a [ActBlockK]),
}

/// Activations of `n` tokens (`n × cols`) prepared for `dtype`.
enum Prepared<'a> {
    Float(&'a [f32]),
    Quant(Vec<ActBlock>),
    QuantK(Vec<ActBlockK>),
}

impl<'a> Prepared<'a> {
    fn new(k: &Kernels, dtype: DType, x: &'a [f32], cols: usize) -> Self {
        if dtype.is_k_quant() {
            let per = cols / QK_K;
            let mut q = vec![ActBlockK::default(); x.len() / QK_K];
            for (xr, qr) in x.chunks(cols).zip(q.chunks_mut(per)) {
                (k.quantize_k)(xr, qr);
            }
            Prepared::QuantK(q)
        } else if dtype.is_quantized() {
            let per = cols / QK;
            let mut q = vec![ActBlock::default(); x.len() / QK];
            for (xr, qr) in x.chunks(cols).zip(q.chunks_mut(per)) {
                (k.quantize)(xr, qr);
            }
            Prepared::Quant(q)
        } else {
            Prepared::Float(x)
        }
    }

    /// Token `t`'s activations over columns `c0..c1` (block-aligned for the quantized forms).
    fn token(&self, t: usize, cols: usize, c0: usize, c1: usize) -> ActRow<'_> {
        match self {
            Prepared::Float(x) => ActRow::Float(&x[t * cols + c0..t * cols + c1]),
            Prepared::Quant(q) => {
                let per = cols / QK;
                ActRow::Quant(&q[t * per + c0 / QK..t * per + c1 / QK])
            }
            Prepared::QuantK(q) => {
                let per = cols / QK_K;
                ActRow::QuantK(&q[t * per + c0 / QK_K..t * per + c1 / QK_K])
            }
        }
    }
}

/// Dot of weights `w` (bytes of whole blocks in `dtype`) with matching activations.
fn dot_any(k: &Kernels, dtype: DType, w: &[u8], x: ActRow) -> f32 {
    use bytemuck::cast_slice as c;
    match (x, dtype) {
        (ActRow::Float(x), DType::F32) => (k.dot_f32)(c(w), x),
        (ActRow::Float(x), DType::F16) => (k.dot_f16)(c(w), x),
        (ActRow::Float(x), DType::BF16) => (k.dot_bf16)(c(w), x),
        (ActRow::Quant(x), DType::Q8_0) => (k.dot_q8_0)(c::<u8, BlockQ8_0>(w), x),
        (ActRow::Quant(x), DType::Q4_0) => (k.dot_q4_0)(c::<u8, BlockQ4_0>(w), x),
        (ActRow::Quant(x), DType::Q4_1) => (k.dot_q4_1)(c::<u8, BlockQ4_1>(w), x),
        (ActRow::Quant(x), DType::Q5_0) => (k.dot_q5_0)(c::<u8, BlockQ5_0>(w), x),
        (ActRow::Quant(x), DType::Q5_1) => (k.dot_q5_1)(c::<u8, BlockQ5_1>(w), x),
        (ActRow::QuantK(x), DType::Q2K) => (k.dot_q2_k)(c::<u8, BlockQ2K>(w), x),
        (ActRow::QuantK(x), DType::Q3K) => (k.dot_q3_k)(c::<u8, BlockQ3K>(w), x),
        (ActRow::QuantK(x), DType::Q4K) => (k.dot_q4_k)(c::<u8, BlockQ4K>(w), x),
        (ActRow::QuantK(x), DType::Q5K) => (k.dot_q5_k)(c::<u8, BlockQ5K>(w), x),
        (ActRow::QuantK(x), DType::Q6K) => (k.dot_q6_k)(c::<u8, BlockQ6K>(w), x),
        _ => unreachable!("Prepared::new matches the activations to {dtype}"),
    }
}

/// Checks shared by the matrix functions.
fn check_matrix(op: &'static str, w: &HostTensor) -> Result<()> {
    // Whole blocks per row, and block structs (align ≤ 4) read in place.
    if !w.cols.is_multiple_of(w.dtype.block_len())
        || w.data.len() < w.rows * w.row_bytes()
        || !(w.data.as_slice().as_ptr() as usize).is_multiple_of(4)
    {
        return Err(err(
            op,
            format!(
                "`{}` ({}x{} {}) is not whole aligned rows",
                w.name, w.rows, w.cols, w.dtype
            ),
        ));
    }
    Ok(())
}

/// `out[t·m + j] = W[idx[j]] · x_t` for `n` tokens (`x` is `n × w.cols`): only the listed rows
/// of a gate/up matrix in any storage format, each row with the format's own dot kernel (8-bit
/// activation blocks for the block formats, quantized once per call, as the dense matmul does).
pub fn sparse_rows(
    k: &Kernels,
    w: &HostTensor,
    idx: &[u32],
    x: &[f32],
    n: usize,
    out: &mut [f32],
) -> Result<()> {
    let op = "sparse_rows";
    check_matrix(op, w)?;
    let (m, cols) = (idx.len(), w.cols);
    if x.len() != n * cols || out.len() != n * m {
        return Err(err(
            op,
            format!(
                "x has {} values, out {}: want {n}×{cols} and {n}×{m}",
                x.len(),
                out.len()
            ),
        ));
    }
    if let Some(i) = idx.iter().find(|&&i| i as usize >= w.rows) {
        return Err(err(
            op,
            format!("row {i} listed, `{}` has {}", w.name, w.rows),
        ));
    }
    let prepared = Prepared::new(k, w.dtype, x, cols);
    let (data, rb) = (w.data.as_slice(), w.row_bytes());
    // The dense matmul's many-row kernel where it has one (the same results).
    let many = match &prepared {
        Prepared::Quant(q) => k.many_rows(w.dtype, q, cols / QK),
        _ => None,
    };
    let row = |j: usize| {
        let r = idx[j] as usize;
        &data[r * rb..(r + 1) * rb]
    };
    per_items(m, n, out, |js, o| {
        if let Some((blocks, dots)) = &many {
            // The listed rows together, as the dense matmul takes its rows.
            let rows: Vec<&[u8]> = js.map(row).collect();
            return dots(&rows, blocks, 0, o, &[]);
        }
        for (j, o) in js.zip(o.chunks_mut(n)) {
            for (t, v) in o.iter_mut().enumerate() {
                *v = dot_any(k, w.dtype, row(j), prepared.token(t, cols, 0, cols));
            }
        }
    });
    Ok(())
}

/// Output rows per task of [`sparse_down_blocks`].
const ROWS_PER_TASK: usize = 16;

/// `out[t·rows + r] += Σ_j W[r][idx[j]] · h[t·m + j]` for a down matrix `w` stored as
/// `d_model` rows × `d_ff` columns in its format: the activations outside `idx` are zero, so
/// every weight block (32 columns, or 256 for the K-quants; 32 for floats) holding none of a
/// token's non-zero activations contributes exactly zero to it and is skipped for it. The rest
/// run as the dense matmul would (the same 8-bit activation blocks), a run of consecutive
/// blocks per kernel call; the runs are each token's own, so a token gets what it gets alone,
/// bit for bit, whatever the other tokens of the call list. Returns how many blocks of each
/// row were read (for some token).
pub fn sparse_down_blocks(
    k: &Kernels,
    w: &HostTensor,
    idx: &[u32],
    h: &[f32],
    n: usize,
    out: &mut [f32],
) -> Result<usize> {
    let op = "sparse_down_blocks";
    check_matrix(op, w)?;
    let (rows, cols, m) = (w.rows, w.cols, idx.len());
    if h.len() != n * m || out.len() != n * rows {
        return Err(err(
            op,
            format!(
                "h has {} values, out {}: want {n}×{m} and {n}×{rows}",
                h.len(),
                out.len()
            ),
        ));
    }
    if let Some(i) = idx.iter().find(|&&i| i as usize >= cols) {
        return Err(err(
            op,
            format!("neuron {i} listed, `{}` has {cols} columns", w.name),
        ));
    }
    if m == 0 || n == 0 {
        return Ok(0);
    }
    // The dense activations (zero outside idx), which the quantizer sees exactly as the dense
    // matmul would.
    let mut full = vec![0f32; n * cols];
    for t in 0..n {
        for (j, &i) in idx.iter().enumerate() {
            full[t * cols + i as usize] += h[t * m + j];
        }
    }
    let block = w.dtype.block_len().max(QK);
    let blocks = cols.div_ceil(block);
    // Each token's runs of consecutive blocks holding its non-zero activations, as column
    // ranges; and the blocks some token reads.
    let mut read = vec![false; blocks];
    let runs: Vec<Vec<(usize, usize)>> = (0..n)
        .map(|t| {
            let mut active = vec![false; blocks];
            for (j, &i) in idx.iter().enumerate() {
                if h[t * m + j] != 0.0 {
                    active[i as usize / block] = true;
                }
            }
            let mut runs: Vec<(usize, usize)> = Vec::new();
            for (bi, _) in active.iter().enumerate().filter(|(_, a)| **a) {
                read[bi] = true;
                let (c0, c1) = (bi * block, ((bi + 1) * block).min(cols));
                match runs.last_mut() {
                    Some(r) if r.1 == c0 => r.1 = c1,
                    _ => runs.push((c0, c1)),
                }
            }
            runs
        })
        .collect();
    let used = read.iter().filter(|a| **a).count();
    let prepared = Prepared::new(k, w.dtype, &full, cols);
    let (data, rb) = (w.data.as_slice(), w.row_bytes());
    let bytes_of = |c: usize| w.dtype.bytes_for(c);
    let sums: Vec<Vec<f32>> = (0..rows.div_ceil(ROWS_PER_TASK))
        .into_par_iter()
        .map(|task| {
            let (r0, r1) = (task * ROWS_PER_TASK, ((task + 1) * ROWS_PER_TASK).min(rows));
            let mut acc = vec![0f32; n * (r1 - r0)];
            for r in r0..r1 {
                let row = &data[r * rb..(r + 1) * rb];
                for t in 0..n {
                    acc[t * (r1 - r0) + r - r0] = runs[t]
                        .iter()
                        .map(|&(c0, c1)| {
                            let x = prepared.token(t, cols, c0, c1);
                            dot_any(k, w.dtype, &row[bytes_of(c0)..bytes_of(c1)], x)
                        })
                        .sum();
                }
            }
            acc
        })
        .collect();
    for (task, acc) in sums.iter().enumerate() {
        let (r0, r1) = (task * ROWS_PER_TASK, ((task + 1) * ROWS_PER_TASK).min(rows));
        for t in 0..n {
            out[t * rows + r0..t * rows + r1]
                .iter_mut()
                .zip(&acc[t * (r1 - r0)..(t + 1) * (r1 - r0)])
                .for_each(|(o, s)| *o += s);
        }
    }
    Ok(used)
}

#[cfg(test)]
mod tests {
    use rand::seq::SliceRandom;
    use rand::{SeedableRng, rngs::StdRng};

    use super::super::tests::{REL, each_token_as_alone, kernel_sets, rand_idx, rand_vec};
    use super::*;
    use crate::backend::cpu::matmul;
    use crate::tensor::Bytes;

    fn matrix(rng: &mut StdRng, dtype: DType, rows: usize, cols: usize) -> HostTensor {
        let rb = dtype.bytes_for(cols);
        let mut bytes = vec![0u8; rows * rb];
        for r in 0..rows {
            let v = rand_vec(rng, cols, 1.0);
            crate::tensor::quantize_row(dtype, &v, &mut bytes[r * rb..(r + 1) * rb]);
        }
        HostTensor {
            name: "w".into(),
            rows,
            cols,
            dtype,
            data: Bytes::from_slice(&bytes),
        }
    }

    const FORMATS: [DType; 13] = DType::ALL;

    #[test]
    fn rows_equal_dense_matmul_rows() {
        let mut rng = StdRng::seed_from_u64(7);
        for k in kernel_sets() {
            for dtype in FORMATS {
                let (rows, cols) = (77, if dtype.is_k_quant() { 512 } else { 96 });
                let w = matrix(&mut rng, dtype, rows, cols);
                for n in [1usize, 2, 5] {
                    let x = rand_vec(&mut rng, n * cols, 1.0);
                    let mut dense = vec![0f32; n * rows];
                    matmul::matmul(k, &w, &x, n, &mut dense);
                    for frac in [0.0, 0.1, 0.5, 1.0] {
                        let idx = rand_idx(&mut rng, rows, frac);
                        let m = idx.len();
                        let mut got = vec![f32::NAN; n * m];
                        sparse_rows(k, &w, &idx, &x, n, &mut got).unwrap();
                        for t in 0..n {
                            for (j, &r) in idx.iter().enumerate() {
                                let (g, d) = (got[t * m + j], dense[t * rows + r as usize]);
                                assert!(
                                    (g - d).abs() <= 1e-5 * (1.0 + d.abs()),
                                    "{} {dtype} n {n} {frac} row {r}: {g} vs {d}",
                                    k.name
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn down_blocks_equal_dense_matmul_on_masked_h() {
        let mut rng = StdRng::seed_from_u64(9);
        for k in kernel_sets() {
            for dtype in FORMATS {
                // d_model odd; d_ff whole blocks (and not a multiple of 32 for floats).
                let (rows, cols) = (
                    37,
                    if dtype.is_k_quant() {
                        768
                    } else if dtype.is_quantized() {
                        416
                    } else {
                        203
                    },
                );
                let w = matrix(&mut rng, dtype, rows, cols);
                let wf = w.to_f32();
                for n in [1usize, 3] {
                    // Random lists, and one clustered list whose blocks are mostly skipped.
                    let mut lists: Vec<Vec<u32>> = [0.0, 0.1, 0.5, 1.0]
                        .iter()
                        .map(|&f| rand_idx(&mut rng, cols, f))
                        .collect();
                    let mut clustered: Vec<u32> = (40..70).collect();
                    clustered.shuffle(&mut rng);
                    lists.push(clustered);
                    for idx in lists {
                        let m = idx.len();
                        let h = rand_vec(&mut rng, n * m, 2.0);
                        let mut masked = vec![0f32; n * cols];
                        for t in 0..n {
                            for (j, &i) in idx.iter().enumerate() {
                                masked[t * cols + i as usize] = h[t * m + j];
                            }
                        }
                        let out0 = rand_vec(&mut rng, n * rows, 1.0);
                        let mut dense = vec![0f32; n * rows];
                        matmul::matmul(k, &w, &masked, n, &mut dense);
                        let what = format!("{} {dtype} n {n} m {m}", k.name);
                        each_token_as_alone(&mut rng, &idx, &h, n, &out0, &what, |i, h, n, o| {
                            sparse_down_blocks(k, &w, i, h, n, o).unwrap();
                        });
                        let mut got = out0.clone();
                        let used = sparse_down_blocks(k, &w, &idx, &h, n, &mut got).unwrap();
                        let block = dtype.block_len().max(QK);
                        let mut want_used: Vec<u32> =
                            idx.iter().map(|&i| i / block as u32).collect();
                        want_used.sort_unstable();
                        want_used.dedup();
                        assert_eq!(used, want_used.len());
                        for t in 0..n {
                            for r in 0..rows {
                                let mag: f64 = out0[t * rows + r].abs() as f64
                                    + (0..cols)
                                        .map(|c| {
                                            (wf[r * cols + c] * masked[t * cols + c]).abs() as f64
                                        })
                                        .sum::<f64>();
                                let (g, d) =
                                    (got[t * rows + r], out0[t * rows + r] + dense[t * rows + r]);
                                assert!(
                                    ((g - d).abs() as f64) <= REL * mag + 1e-30,
                                    "{} {dtype} n {n} m {m} row {r}: {g} vs {d}",
                                    k.name
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}
