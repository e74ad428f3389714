//! The bytes a KV cache takes: its element types, the paged pool's block, and the formulas
//! the planner budgets and the engine allocates by.

use thiserror::Error;

use super::device_bytes;
use crate::model::ModelSpec;
use crate::tensor::DType;

/// Positions per block of a paged KV cache: the contexts' chunk length, so a context's chunk is
/// one block of the pool.
pub const KV_BLOCK: usize = 16;

/// Element type of a KV cache on a device. Keys and values are computed in f32 and stored in this
/// type; attention reads them back in f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvType {
    F32,
    F16,
    /// llama.cpp's Q8_0: per 32 values an f16 scale and 32 `i8` (8.5 bits a value).
    Q8_0,
}

impl KvType {
    pub fn dtype(self) -> DType {
        match self {
            KvType::F32 => DType::F32,
            KvType::F16 => DType::F16,
            KvType::Q8_0 => DType::Q8_0,
        }
    }

    pub fn name(self) -> &'static str {
        self.dtype().name()
    }

    /// Bytes of one cache row of `cols` values.
    pub fn row_bytes(self, cols: usize) -> usize {
        self.dtype().bytes_for(cols)
    }

    /// Whether rows of `cols` values can be stored (Q8_0 needs whole blocks of 32).
    pub fn check_cols(self, cols: usize) -> Result<(), KvColsError> {
        let block = self.dtype().block_len();
        if cols.is_multiple_of(block) {
            Ok(())
        } else {
            Err(KvColsError {
                kv: self,
                block,
                cols,
            })
        }
    }
}

/// A KV cache type that cannot store rows of a model's width.
#[derive(Debug, Error)]
#[error(
    "a {} KV cache needs rows of whole {block}-value blocks; this model's rows have {cols} values (use --kv-type f16)",
    kv.name()
)]
pub struct KvColsError {
    pub kv: KvType,
    pub block: usize,
    pub cols: usize,
}

/// Device bytes of one session's KV cache of `ctx` positions in `kv`.
pub fn kv_bytes(spec: &ModelSpec, ctx: usize, kv: KvType) -> u64 {
    2 * spec.n_layers as u64 * device_bytes((ctx * kv.row_bytes(spec.kv_dim())) as u64)
}

/// Device bytes of a KV pool of `blocks` blocks (`Engine::with_kv_pool`).
pub fn kv_pool_bytes(spec: &ModelSpec, blocks: usize, kv: KvType) -> u64 {
    kv_bytes(spec, blocks * KV_BLOCK, kv)
}

/// Device bytes of a paged session's block table, for a context of `ctx` positions.
pub fn kv_table_bytes(ctx: usize) -> u64 {
    device_bytes((ctx.div_ceil(KV_BLOCK) * 4) as u64)
}
