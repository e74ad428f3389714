//! The device workspace each op takes while it runs (temporaries beyond its operands): the one
//! formula the planner, the CUDA backend and the budgeted device use ([`workspace_bytes`]), and
//! the kernels' shape limits it follows. Pure: no GPU.

use super::attention::{FLASH_MAX_SPLITS, MAX_SPLITS};
use super::attention::{flash_partial_bytes, flash_split_rows, flash_takes, splits_keys};
use super::{KvType, device_bytes};
use crate::tensor::DType;

/// An op that takes device workspace (temporaries beyond its operands) while it runs, described
/// by what sizes it. Backends say how much each needs ([`Backend::workspace_bytes`](crate::backend::Backend::workspace_bytes)); the engine
/// holds the most any op of a step needs ([`Backend::set_workspace`](crate::backend::Backend::set_workspace)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkspaceOp {
    /// [`Backend::embed`](crate::backend::Backend::embed) of `tokens` ids.
    Embed { tokens: usize },
    /// [`Backend::matmul_into`](crate::backend::Backend::matmul_into) of `tokens` rows against a weight of `dtype`, `rows` × `cols`.
    Matmul {
        dtype: DType,
        tokens: usize,
        rows: usize,
        cols: usize,
    },
    /// The neuron-listed bundle ops over a list of `neurons` ids (copied in).
    Listed { neurons: usize },
    /// [`Backend::attention`](crate::backend::Backend::attention) of `tokens` query rows of `n_heads` heads of `head_dim` over a `kv`
    /// cache: few rows over a long context split the keys into chunks whose partial results
    /// meet in the workspace (a fixed most chunks, so the bytes do not depend on the context
    /// length), and so may a prompt's rows on tensor cores.
    Attention {
        tokens: usize,
        n_heads: usize,
        head_dim: usize,
        kv: KvType,
    },
    /// [`Backend::moe_ffn`](crate::backend::Backend::moe_ffn) over `tokens` rows of `d_model`:
    /// experts of `width` neurons whose gate and up are `gate`, whose down is `down`. Each
    /// expert's tokens run in passes of at most [`EXPERT_PASS_TOKENS`], through buffers in the
    /// workspace.
    Experts {
        tokens: usize,
        d_model: usize,
        width: usize,
        gate: DType,
        down: DType,
    },
}

/// Most tokens of one expert a pass of the device's expert products takes (a matvec launch's
/// for every format); an expert with more runs in several passes.
pub const EXPERT_PASS_TOKENS: usize = MAX_TOKENS;

/// Byte offsets into an [`WorkspaceOp::Experts`] workspace: a pass's gathered input rows, gate
/// and up activations, output rows, and the products' own workspace after them.
pub fn experts_layout(tokens: usize, d_model: usize, width: usize) -> [u64; 5] {
    let t = tokens.min(EXPERT_PASS_TOKENS) as u64;
    let rows = device_bytes(t * d_model as u64 * 4);
    let hidden = device_bytes(t * width as u64 * 4);
    [
        0,
        rows,
        rows + hidden,
        rows + 2 * hidden,
        2 * rows + 2 * hidden,
    ]
}

/// Tokens one float-format matvec launch handles (MAX_TOKENS in kernels/common.cuh); above it,
/// f16/bf16 products go through cuBLAS.
pub const MAX_TOKENS: usize = 8;
/// Tokens one block-format matvec launch handles (MAX_QTOKENS in kernels/common.cuh): up to it,
/// each weight block is read once for all tokens; above it, block formats are decoded to f16
/// tiles for cuBLAS.
pub const MAX_QTOKENS: usize = 16;
/// Widest rows whose one-token block-format matvec quantizes its activations itself, in each
/// block (QX_MAX_COLS in kernels/matvec.cu): no quantize launch, no workspace.
pub const QX_MAX_COLS: usize = 2048;
/// Most bytes of one f16 tile a block-format weight is decoded into for cuBLAS (whole rows; a
/// matrix smaller than this takes a tile of its own size).
pub const DEQUANT_TILE_BYTES: usize = 16 << 20;

/// Bytes of one 8-bit activation block (`ActBlock` in kernels/common.cuh).
pub const ACT_BLOCK_BYTES: usize = 44;

/// The device workspace `op` takes on the CUDA backend (with cuBLAS): the one formula the
/// planner, this backend and the budgeted device (which reserves the same) use. Pure: no GPU.
pub fn workspace_bytes(op: &WorkspaceOp) -> u64 {
    match *op {
        // Token ids copied in for the gather.
        WorkspaceOp::Embed { tokens } => device_bytes(tokens as u64 * 4),
        // Neuron ids copied in for the listed bundle kernels.
        WorkspaceOp::Listed { neurons } => device_bytes(neurons as u64 * 4),
        // MAX_SPLITS partials per head of a split attention (max, sum and head_dim outputs,
        // f32), shared by its rows. Steps of more rows (which do not split) count them too:
        // the plan sizes the workspace once, at its batch, and the decode steps after it must
        // fit in that. A prompt's flash attention may split its keys too (flash_splits): the
        // partials of the most splits it can take at this many rows, up to FLASH_SPLIT_BYTES
        // of them, on every device (the formula knows none), never fewer for more rows (a
        // step's scratch, sized for the largest step, stays while a smaller one runs).
        WorkspaceOp::Attention {
            tokens,
            n_heads,
            head_dim,
            kv,
        } => {
            let decode = if tokens > 0 && splits_keys(n_heads, head_dim) {
                device_bytes((n_heads * MAX_SPLITS * (head_dim + 2) * 4) as u64)
            } else {
                0
            };
            let prompt = if flash_takes(tokens, kv, head_dim) {
                let rows = (tokens * FLASH_MAX_SPLITS).min(flash_split_rows(n_heads, head_dim));
                device_bytes((rows * flash_partial_bytes(n_heads, head_dim)) as u64)
            } else {
                0
            };
            decode.max(prompt)
        }
        WorkspaceOp::Experts {
            tokens,
            d_model,
            width,
            gate,
            down,
        } => {
            if tokens == 0 {
                return 0;
            }
            let t = tokens.min(EXPERT_PASS_TOKENS);
            let products = |dtype, rows, cols| {
                workspace_bytes(&WorkspaceOp::Matmul {
                    dtype,
                    tokens: t,
                    rows,
                    cols,
                })
            };
            experts_layout(tokens, d_model, width)[4]
                + products(gate, width, d_model).max(products(down, d_model, width))
        }
        WorkspaceOp::Matmul {
            dtype,
            tokens,
            rows,
            cols,
        } => {
            if uses_act_blocks(dtype) && quantizes_in_blocks(tokens, cols) {
                0
            } else if uses_act_blocks(dtype) {
                // Activations quantized to 8-bit blocks for the integer dot products; above
                // MAX_QTOKENS, the f16 activations and one decoded f16 tile for cuBLAS instead
                // (the larger of the two is held, so the matvec path can stand in where cuBLAS
                // is absent).
                let act_blocks = device_bytes((tokens * cols / 32 * ACT_BLOCK_BYTES) as u64);
                if tokens <= MAX_QTOKENS {
                    act_blocks
                } else {
                    let tile = dequant_tile_rows(rows, cols) * cols * 2;
                    act_blocks
                        .max(device_bytes((tokens * cols * 2) as u64) + device_bytes(tile as u64))
                }
            } else if tokens > MAX_TOKENS && matches!(dtype, DType::F16 | DType::BF16) {
                // Activations converted to the weight's type for cuBLAS.
                device_bytes((tokens * cols * 2) as u64)
            } else {
                0
            }
        }
    }
}

/// Rows of a block-format weight (`rows` × `cols`) decoded per f16 tile for cuBLAS.
pub fn dequant_tile_rows(rows: usize, cols: usize) -> usize {
    (DEQUANT_TILE_BYTES / (2 * cols.max(1))).clamp(1, rows.max(1))
}

/// Whether matmuls with `dtype` weights multiply 8-bit activation blocks (`matvec_quant`, which
/// needs them in the workspace): every block format.
pub fn uses_act_blocks(dtype: DType) -> bool {
    dtype.is_quantized()
}

/// Whether a block-format matvec of `tokens` rows of `cols` activations quantizes them in its
/// own blocks (`matvec_quant_x`): one token, rows of at most [`QX_MAX_COLS`].
pub fn quantizes_in_blocks(tokens: usize, cols: usize) -> bool {
    tokens == 1 && cols <= QX_MAX_COLS
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::footprint::attention::{SPLIT_ROWS, split_chunks, split_most_chunks};

    #[test]
    fn attention_workspace_depends_on_neither_context_nor_rows() {
        let op = |tokens, head_dim| WorkspaceOp::Attention {
            tokens,
            n_heads: 32,
            head_dim,
            kv: KvType::F32,
        };
        let one = workspace_bytes(&op(1, 128));
        assert_eq!(one, device_bytes((32 * MAX_SPLITS * 130 * 4) as u64));
        // Any step holds what the decode steps after it need (the plan sizes it once). Over
        // an f32 cache prompts take the simple kernel, which splits nothing.
        for tokens in [2, 4, 5, 40, 4000] {
            assert_eq!(workspace_bytes(&op(tokens, 128)), one);
        }
        // Whatever the device's size gives as the most chunks, the workspace holds them.
        for rows in 1..=SPLIT_ROWS {
            for keys in (1..300).chain([4000, 100_000]) {
                let most = split_most_chunks(rows, 32, keys, 3);
                let (chunks, chunk) = split_chunks(keys, rows, most);
                assert!(chunks >= 1 && rows * chunks <= MAX_SPLITS, "{rows} {keys}");
                assert!(
                    chunks * chunk >= keys && (chunks - 1) * chunk < keys,
                    "{keys}"
                );
            }
        }
        // Narrow heads, and heads not in whole 8-dim vectors, stay with the simple kernel,
        // which takes none.
        assert_eq!(workspace_bytes(&op(1, 16)), 0);
        assert_eq!(workspace_bytes(&op(1, 36)), 0);
        assert!(workspace_bytes(&op(1, 40)) > 0);
        assert_eq!(workspace_bytes(&op(0, 128)), 0);
    }

    #[test]
    fn block_formats_take_activation_blocks_then_f16_tiles() {
        for dtype in DType::ALL {
            let op = |tokens| WorkspaceOp::Matmul {
                dtype,
                tokens,
                rows: 1000,
                cols: 512,
            };
            let blocks = |tokens: u64| device_bytes(tokens * 512 / 32 * ACT_BLOCK_BYTES as u64);
            if dtype.is_quantized() {
                // One token of rows up to QX_MAX_COLS: quantized in the matvec's own blocks.
                assert_eq!(workspace_bytes(&op(1)), 0, "{dtype}");
                let wide = WorkspaceOp::Matmul {
                    dtype,
                    tokens: 1,
                    rows: 1000,
                    cols: 4096,
                };
                assert_eq!(
                    workspace_bytes(&wide),
                    device_bytes(4096 / 32 * ACT_BLOCK_BYTES as u64),
                    "{dtype}"
                );
                assert_eq!(workspace_bytes(&op(3)), blocks(3), "{dtype}");
                assert_eq!(workspace_bytes(&op(MAX_QTOKENS)), blocks(16), "{dtype}");
                // Above MAX_QTOKENS: f16 activations + one tile (the whole 1000-row matrix,
                // being under DEQUANT_TILE_BYTES).
                assert_eq!(
                    workspace_bytes(&op(40)),
                    device_bytes(40 * 512 * 2) + device_bytes(1000 * 512 * 2),
                    "{dtype}"
                );
            } else if matches!(dtype, DType::F16 | DType::BF16) {
                assert_eq!(workspace_bytes(&op(8)), 0, "{dtype}");
                assert_eq!(
                    workspace_bytes(&op(9)),
                    device_bytes(9 * 512 * 2),
                    "{dtype}"
                );
            } else {
                // f32 activations read in place.
                assert_eq!(workspace_bytes(&op(40)), 0, "{dtype}");
            }
        }
    }

    #[test]
    fn dequant_tiles_are_whole_rows_under_the_cap() {
        // 7B FFN down (4096 rows of 11008) and a 70B one (8192 of 28672): tiles stay under the
        // cap; a small matrix is one tile.
        for (rows, cols) in [(4096, 11008), (8192, 28672), (576, 1536), (1, 1 << 24)] {
            let t = dequant_tile_rows(rows, cols);
            assert!(t >= 1 && t <= rows);
            assert!(
                t == 1 || t * cols * 2 <= DEQUANT_TILE_BYTES,
                "{rows}x{cols}"
            );
        }
        assert_eq!(dequant_tile_rows(576, 1536), 576);
        assert_eq!(
            dequant_tile_rows(4096, 11008),
            DEQUANT_TILE_BYTES / (2 * 11008)
        );
    }
}
