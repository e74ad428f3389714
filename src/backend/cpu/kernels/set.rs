//! The table of one kernel set ([`Kernels`]): a function per operation and weight format, and
//! the many-row kernels where a set has them. The sets fill it (`portable`, `avx2`, `avx512`);
//! nothing here computes.

use half::{bf16, f16};

use super::activations::{ActBlock, TokenBlocks};
use super::kq::ActBlockK;
use crate::tensor::{
    BlockQ2K, BlockQ3K, BlockQ4_0, BlockQ4_1, BlockQ4K, BlockQ5_0, BlockQ5_1, BlockQ5K, BlockQ6K,
    BlockQ8_0, DType,
};

/// `out[r·n + j] = rows[r] · x[t0 + j]` for weight rows (bytes of whole blocks) and
/// `n = out.len() / rows.len()` tokens, each result bit for bit the one-token kernel's. `next`:
/// the bytes the caller reads next, prefetched while these rows compute.
pub type DotsFn = fn(rows: &[&[u8]], x: &TokenBlocks, t0: usize, out: &mut [f32], next: &[u8]);

/// As [`DotsFn`], the rows of whole tiles laid out by [`super::tiles::tile_rows`] (`tiles`:
/// their bytes, `out[r·n + j]` for the tiles' rows in order), each result bit for bit
/// [`DotsFn`]'s of the same rows. No bytes to prefetch: tiles are one stream, which the
/// hardware prefetchers follow unaided (hints a tile ahead made a 30 MB head slower).
pub type TiledFn = fn(tiles: &[u8], x: &TokenBlocks, t0: usize, out: &mut [f32]);

/// [`Kernels::scores`]: query rows, key rows (of `K` values), the products query-major.
pub type ScoresOf<K> = fn(&[&[f32]], &[&[K]], &mut [f32]);

/// [`Kernels::scores`] over f32 key rows.
pub type ScoresFn = ScoresOf<f32>;

/// The kernel set for this machine.
pub struct Kernels {
    pub name: &'static str,
    pub dot_f32: fn(&[f32], &[f32]) -> f32,
    /// `out[i] += w[j] · rows[j][i]` for each row `j` in order (a fused multiply-add where the
    /// set has one): attention's weighted sum of values, `out` held in registers across the
    /// rows. Each output depends on its own column alone, so a row's sums do not depend on
    /// the rows beside it.
    pub axpy_rows: fn(&mut [f32], &[f32], &[&[f32]]),
    /// [`Kernels::axpy_rows`] over rows of f16 read in place, each value widened as it is
    /// loaded: the sums the rows' f32 copies give, without the copies.
    pub axpy_rows_f16: fn(&mut [f32], &[f32], &[&[f16]]),
    /// `out[i · keys.len() + j] = qs[i] · keys[j]`: attention's scores, a tile of query heads
    /// (a prompt's rows, the heads sharing a KV head) against a block of key rows. Each product
    /// is summed alike wherever it falls in the tile (eight lanes of multiply-adds over the
    /// 8-wide steps, the lanes added pairwise, then the values past the last whole step in
    /// order), so a query's scores do not depend on the queries beside it: a decode step's row
    /// gives what the same row gives in a prompt, while a tile reads each key row once for two
    /// queries.
    pub scores: ScoresFn,
    /// [`Kernels::scores`] against key rows of f16 read in place, each value widened as it is
    /// loaded: the products the rows' f32 copies give (a decode step's row reads an f16 cache
    /// without decoding it first).
    pub scores_f16: ScoresOf<f16>,
    /// `s[i] = exp(s[i] − max)` for scores at most `max`, returning their sum: a softmax's
    /// numerators. Each value depends on its input alone (not on where it lies in `s`).
    pub exp_sum: fn(&mut [f32], f32) -> f64,
    pub dot_f16: fn(&[f16], &[f32]) -> f32,
    pub dot_bf16: fn(&[bf16], &[f32]) -> f32,
    pub dot_q8_0: fn(&[BlockQ8_0], &[ActBlock]) -> f32,
    pub dot_q4_0: fn(&[BlockQ4_0], &[ActBlock]) -> f32,
    pub dot_q4_1: fn(&[BlockQ4_1], &[ActBlock]) -> f32,
    pub dot_q5_0: fn(&[BlockQ5_0], &[ActBlock]) -> f32,
    pub dot_q5_1: fn(&[BlockQ5_1], &[ActBlock]) -> f32,
    pub dot_q2_k: fn(&[BlockQ2K], &[ActBlockK]) -> f32,
    pub dot_q3_k: fn(&[BlockQ3K], &[ActBlockK]) -> f32,
    pub dot_q4_k: fn(&[BlockQ4K], &[ActBlockK]) -> f32,
    pub dot_q5_k: fn(&[BlockQ5K], &[ActBlockK]) -> f32,
    pub dot_q6_k: fn(&[BlockQ6K], &[ActBlockK]) -> f32,
    /// Activations into 32-value blocks (Q8_0…Q5_1 weights).
    pub quantize: fn(&[f32], &mut [ActBlock]),
    /// Activations into 256-value blocks (K-quant weights).
    pub quantize_k: fn(&[f32], &mut [ActBlockK]),
    /// Many-row Q8_0 / Q4_0 / Q4_1 kernels, where this set has them: each weight block is
    /// unpacked once for all the tokens and scaled once for a register of rows (batched decode
    /// is compute-bound on these formats otherwise).
    pub dots_q8_0: Option<DotsFn>,
    pub dots_q4_0: Option<DotsFn>,
    pub dots_q4_1: Option<DotsFn>,
    /// The many-row kernels over rows laid out in tiles, where this set has them (a decode
    /// step's one token then reads every operand in one load).
    pub tiled_q8_0: Option<TiledFn>,
    pub tiled_q4_0: Option<TiledFn>,
    pub tiled_q4_1: Option<TiledFn>,
}

impl Kernels {
    /// The many-row kernel for weights in `dtype`, if this set has one.
    pub fn dots(&self, dtype: DType) -> Option<DotsFn> {
        match dtype {
            DType::Q8_0 => self.dots_q8_0,
            DType::Q4_0 => self.dots_q4_0,
            DType::Q4_1 => self.dots_q4_1,
            _ => None,
        }
    }

    /// The many-row kernel over tiles of weights in `dtype`, if this set has one.
    pub fn tiled(&self, dtype: DType) -> Option<TiledFn> {
        match dtype {
            DType::Q8_0 => self.tiled_q8_0,
            DType::Q4_0 => self.tiled_q4_0,
            DType::Q4_1 => self.tiled_q4_1,
            _ => None,
        }
    }

    /// The many-row kernel for activation blocks `q` (`per_token` to a token) over weights in
    /// `dtype`, where this set has one (it serves one token as well as many).
    pub fn many_rows<'a>(
        &self,
        dtype: DType,
        q: &'a [ActBlock],
        per_token: usize,
    ) -> Option<(TokenBlocks<'a>, DotsFn)> {
        let dots = self.dots(dtype)?;
        Some((
            TokenBlocks {
                blocks: q,
                per_token,
            },
            dots,
        ))
    }
}
