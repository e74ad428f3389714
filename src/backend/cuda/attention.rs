//! Causal attention over the KV cache (kernels/attention.cu, flash_attention.cu): the kernel a
//! call takes (the policy is `footprint::attention`'s), then the split decode kernel (keys in
//! chunks across blocks), the flash kernel on tensor cores (prompts; its keys split as the
//! device's occupancy allows) or the simple kernel.

use cudarc::driver::LaunchConfig;

use super::args::{cfg, ptr_of};
use super::device::{CudaBackend, dev};
use super::launches;
use super::types::{CudaKv, CudaKvTable, CudaTensor, shape_err, table_ptr};
use crate::backend::recording::recordable_attention;
use crate::backend::{AttnShape, KvType, Result, WorkspaceOp};
use crate::footprint::attention::{
    AttentionKernel, FLASH_ROWS, MAX_HEAD_DIM, attention_kernel, flash_splits, forced_flash_splits,
    split_chunks, split_most_chunks,
};

/// Threads per flash block (FA_THREADS in kernels/flash_attention.cu).
const FLASH_THREADS: u32 = 128;

/// The flash kernel for a `kv` cache (f16 or Q8_0) and heads of `head_dim` (one of
/// FLASH_HEAD_DIMS): its name and its launch.
fn flash_kernel(kv: KvType, head_dim: usize) -> (&'static str, launches::Flash) {
    match (kv, head_dim) {
        (KvType::Q8_0, 64) => ("flash_attn_q8_0_hd64", launches::flash_attn_q8_0_hd64),
        (KvType::Q8_0, 80) => ("flash_attn_q8_0_hd80", launches::flash_attn_q8_0_hd80),
        (KvType::Q8_0, 96) => ("flash_attn_q8_0_hd96", launches::flash_attn_q8_0_hd96),
        (KvType::Q8_0, _) => ("flash_attn_q8_0_hd128", launches::flash_attn_q8_0_hd128),
        (_, 64) => ("flash_attn_f16_hd64", launches::flash_attn_f16_hd64),
        (_, 80) => ("flash_attn_f16_hd80", launches::flash_attn_f16_hd80),
        (_, 96) => ("flash_attn_f16_hd96", launches::flash_attn_f16_hd96),
        _ => ("flash_attn_f16_hd128", launches::flash_attn_f16_hd128),
    }
}

impl CudaBackend {
    /// Make every prompt's flash attention split its keys `splits` ways (as far as the
    /// workspace holds: at most [`FLASH_MAX_SPLITS`](crate::footprint::attention::FLASH_MAX_SPLITS), their partials at most
    /// [`FLASH_SPLIT_BYTES`](crate::footprint::attention::FLASH_SPLIT_BYTES)), or `None`: as [`flash_splits`] picks for the device. For
    /// benchmarks that set one beside the other.
    pub fn set_flash_splits(&self, splits: Option<usize>) {
        self.flash_splits_forced
            .store(splits.unwrap_or(0), std::sync::atomic::Ordering::Relaxed);
    }

    /// The ways attention of `rows` query rows over `keys` positions of a `kv` cache (heads
    /// of `head_dim`) splits its keys on this device where it runs on tensor cores, else `None`
    /// (the split decode kernel plans its own chunks; the simple kernel splits none).
    pub fn prompt_splits(
        &self,
        rows: usize,
        kv: KvType,
        n_heads: usize,
        head_dim: usize,
        keys: usize,
    ) -> Result<Option<usize>> {
        if attention_kernel(rows, kv, n_heads, head_dim, self.capability) != AttentionKernel::Flash
        {
            return Ok(None);
        }
        Ok(Some(
            self.flash_splits_of(rows, kv, n_heads, head_dim, keys)?.0,
        ))
    }

    /// `(splits, chunk)` a prompt's flash attention of `rows` rows over `keys` positions of a
    /// `kv` cache (`n_heads` heads of `head_dim`) takes on this device: its kernel's blocks per
    /// multiprocessor (the driver's occupancy) × the multiprocessors are the slots it fills.
    fn flash_splits_of(
        &self,
        rows: usize,
        kv: KvType,
        n_heads: usize,
        head_dim: usize,
        keys: usize,
    ) -> Result<(usize, usize)> {
        match self
            .flash_splits_forced
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            0 => {
                let (name, _) = flash_kernel(kv, head_dim);
                let per_sm = self
                    .func("flash_attention", name)?
                    .occupancy_max_active_blocks_per_multiprocessor(FLASH_THREADS, 0, None)
                    .map_err(dev)? as usize;
                let slots = per_sm * self.multiprocessors;
                Ok(flash_splits(rows, n_heads, head_dim, keys, slots))
            }
            forced => Ok(forced_flash_splits(rows, n_heads, head_dim, keys, forced)),
        }
    }
}

/// One attention call as its kernels take it: the tensors, the block table's address (0: none),
/// the geometry in the kernels' integer types, and where a recorded step's position is read
/// (`at`; 0: the kernels take `fp`).
#[derive(Clone, Copy)]
struct AttentionCall<'a> {
    q: &'a CudaTensor,
    k_cache: &'a CudaKv,
    v_cache: &'a CudaKv,
    out: &'a CudaTensor,
    s: AttnShape,
    /// Query rows.
    n: usize,
    /// Positions the last row attends to: `first_pos + n`.
    keys: usize,
    tp: u64,
    at: u64,
    nh: i32,
    group: i32,
    hd: i32,
    qs: i32,
    kvs: i32,
    fp: i32,
}

/// `q` attending over `first_pos + q.rows` rows of the caches (through `table`, if any) into
/// `out` fits: the heads' geometry, the caches' widths and type, the rows they hold.
fn check_attention(
    q: &CudaTensor,
    k_cache: &CudaKv,
    v_cache: &CudaKv,
    table: Option<&CudaKvTable>,
    first_pos: usize,
    s: AttnShape,
    out: &CudaTensor,
) -> Result<()> {
    let kv_dim = s.n_kv_heads * s.head_dim;
    let q_dim = s.n_heads * s.head_dim;
    let n = q.rows;
    if q.cols != q_dim
        || out.cols != q_dim
        || out.rows != n
        || k_cache.cols != kv_dim
        || v_cache.cols != kv_dim
        || k_cache.ty != v_cache.ty
        || (table.is_none() && first_pos + n > k_cache.rows.min(v_cache.rows))
        || s.n_kv_heads == 0
        || !s.n_heads.is_multiple_of(s.n_kv_heads)
        || s.head_dim > MAX_HEAD_DIM
    {
        return Err(shape_err(
            "attention",
            format!(
                "q {}x{}, caches {}x{}, head dim {}",
                q.rows, q.cols, k_cache.rows, k_cache.cols, s.head_dim
            ),
        ));
    }
    Ok(())
}

/// [`Backend::attention`](crate::backend::Backend::attention) on the device: the call checked,
/// then the kernel [`attention_kernel`] picks, launched.
#[allow(clippy::too_many_arguments)] // the trait's arguments, as it takes them
pub(super) fn attention(
    cuda: &CudaBackend,
    q: &CudaTensor,
    k_cache: &CudaKv,
    v_cache: &CudaKv,
    table: Option<&CudaKvTable>,
    first_pos: usize,
    s: AttnShape,
    out: &mut CudaTensor,
) -> Result<()> {
    check_attention(q, k_cache, v_cache, table, first_pos, s, out)?;
    let kv_dim = s.n_kv_heads * s.head_dim;
    let q_dim = s.n_heads * s.head_dim;
    let n = q.rows;
    if n == 0 {
        return Ok(());
    }
    let tp = table_ptr(
        "attention",
        table,
        first_pos + n,
        k_cache.rows.min(v_cache.rows),
    )?;
    let (nh, group, hd) = (
        s.n_heads as i32,
        (s.n_heads / s.n_kv_heads) as i32,
        s.head_dim as i32,
    );
    let (qs, kvs, fp) = (q_dim as i32, kv_dim as i32, first_pos as i32);
    let keys = first_pos + n;
    let at = cuda.position_at()?;
    if at != 0 {
        recordable_attention(n)?;
    }
    let call = AttentionCall {
        q,
        k_cache,
        v_cache,
        out,
        s,
        n,
        keys,
        tp,
        at,
        nh,
        group,
        hd,
        qs,
        kvs,
        fp,
    };
    match attention_kernel(n, k_cache.ty, s.n_heads, s.head_dim, cuda.capability) {
        AttentionKernel::Split => split(cuda, &call),
        AttentionKernel::Flash => flash(cuda, &call),
        AttentionKernel::Simple => simple(cuda, &call),
    }
}

/// [`AttentionKernel::Split`]: one launch.
fn split(cuda: &CudaBackend, call: &AttentionCall<'_>) -> Result<()> {
    let AttentionCall {
        q,
        k_cache,
        v_cache,
        out,
        s,
        n,
        keys,
        tp,
        at,
        nh,
        group,
        hd,
        kvs,
        fp,
        ..
    } = *call;
    // Few rows (decode): the keys in chunks across blocks, partials in the workspace,
    // combined by each head's last block (one launch).
    let (_ws, wptr) = cuda.workspace_for(WorkspaceOp::Attention {
        tokens: n,
        n_heads: s.n_heads,
        head_dim: s.head_dim,
        kv: k_cache.ty,
    })?;
    // A decode step's one row takes the one-row kernels (fewer registers: more blocks an SM).
    let (name, kernel): (_, launches::Split) = match (k_cache.ty, n) {
        (KvType::F32, 1) => ("attention_split1_f32", launches::attention_split1_f32),
        (KvType::F16, 1) => ("attention_split1_f16", launches::attention_split1_f16),
        (KvType::Q8_0, 1) => ("attention_split1_q8_0", launches::attention_split1_q8_0),
        (KvType::F32, _) => ("attention_split_f32", launches::attention_split_f32),
        (KvType::F16, _) => ("attention_split_f16", launches::attention_split_f16),
        (KvType::Q8_0, _) => ("attention_split_q8_0", launches::attention_split_q8_0),
    };
    // As many chunks as fill the device's slots for this kernel once (split_most_chunks).
    let per_sm = cuda.blocks_per_sm("flash_attention", name, FLASH_THREADS)?;
    let most = split_most_chunks(n, s.n_heads, cuda.multiprocessors, per_sm);
    // Recorded, the grid has room for the most chunks and the kernels plan them from
    // the position they read (the same plan, at every replay's position).
    let (chunks, chunk) = if at != 0 {
        (most, 0)
    } else {
        split_chunks(keys, n, most)
    };
    let c = LaunchConfig {
        grid_dim: (s.n_heads as u32, chunks as u32, 1),
        block_dim: (FLASH_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let (rows, chunk_i, most_i) = (n as i32, chunk as i32, most as i32);
    let tickets = ptr_of(&cuda.tickets, &cuda.compute);
    kernel(
        cuda.launch(c),
        q.buf.ptr,
        k_cache.buf.ptr,
        v_cache.buf.ptr,
        tp,
        wptr,
        tickets,
        out.buf.ptr,
        rows,
        nh,
        group,
        hd,
        kvs,
        fp,
        s.scale,
        chunk_i,
        most_i,
        at,
    )?;
    Ok(())
}

/// [`AttentionKernel::Flash`]: one launch, and one more to merge its key splits where there are
/// several.
fn flash(cuda: &CudaBackend, call: &AttentionCall<'_>) -> Result<()> {
    let AttentionCall {
        q,
        k_cache,
        v_cache,
        out,
        s,
        n,
        keys,
        tp,
        nh,
        group,
        hd,
        kvs,
        fp,
        ..
    } = *call;
    // Prefill over an f16 or Q8_0 cache: tensor-core tiles (a Q8_0 tile decoded to f16
    // as it loads), the scores never leave the chip.
    let (_, kernel) = flash_kernel(k_cache.ty, s.head_dim);
    let (splits, chunk) = cuda.flash_splits_of(n, k_cache.ty, s.n_heads, s.head_dim, keys)?;
    // Split: the partials meet in the workspace, merged by one more launch.
    let (_ws, wptr) = if splits > 1 {
        let (ws, ptr) = cuda.workspace_for(WorkspaceOp::Attention {
            tokens: n,
            n_heads: s.n_heads,
            head_dim: s.head_dim,
            kv: k_cache.ty,
        })?;
        (Some(ws), ptr)
    } else {
        (None, 0)
    };
    let c = LaunchConfig {
        grid_dim: (
            n.div_ceil(FLASH_ROWS) as u32,
            s.n_heads as u32,
            splits as u32,
        ),
        block_dim: (FLASH_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let (rows, chunk_i) = (n as i32, chunk as i32);
    kernel(
        cuda.launch(c),
        q.buf.ptr,
        k_cache.buf.ptr,
        v_cache.buf.ptr,
        tp,
        wptr,
        out.buf.ptr,
        rows,
        nh,
        group,
        kvs,
        fp,
        s.scale,
        chunk_i,
    )?;
    if splits > 1 {
        let c = LaunchConfig {
            grid_dim: (s.n_heads as u32, n as u32, 1),
            block_dim: (FLASH_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        launches::flash_combine(
            cuda.launch(c),
            wptr,
            out.buf.ptr,
            rows,
            nh,
            hd,
            fp,
            chunk_i,
            splits as i32,
        )?;
    }
    Ok(())
}

/// [`AttentionKernel::Simple`]: one launch, a block per (row, head).
fn simple(cuda: &CudaBackend, call: &AttentionCall<'_>) -> Result<()> {
    let AttentionCall {
        q,
        k_cache,
        v_cache,
        out,
        s,
        n,
        tp,
        at,
        nh,
        group,
        hd,
        qs,
        kvs,
        fp,
        ..
    } = *call;
    let kernel = match k_cache.ty {
        KvType::F32 => launches::attention_f32,
        KvType::F16 => launches::attention_f16,
        KvType::Q8_0 => launches::attention_q8_0,
    };
    kernel(
        cuda.launch(cfg((n * s.n_heads) as u32, 256)),
        q.buf.ptr,
        k_cache.buf.ptr,
        v_cache.buf.ptr,
        tp,
        out.buf.ptr,
        nh,
        group,
        hd,
        qs,
        kvs,
        fp,
        s.scale,
        at,
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::supported_capability;
    use crate::footprint::attention::{FLASH_MIN_ROWS, SPLIT_ROWS};

    #[test]
    fn prompts_take_tensor_cores_from_ampere_and_the_simple_kernel_before() {
        use AttentionKernel::*;
        let k = |rows, kv, hd, cap| attention_kernel(rows, kv, 32, hd, cap);
        for cap in [80, 86, 89, 90, 120] {
            for kv in [KvType::F16, KvType::Q8_0] {
                assert_eq!(k(4000, kv, 128, cap), Flash, "{cap}");
                assert_eq!(k(FLASH_MIN_ROWS, kv, 64, cap), Flash, "{cap}");
            }
        }
        // Turing: same decode kernel, prompts on the simple kernel.
        assert_eq!(k(4000, KvType::F16, 128, 75), Simple);
        assert_eq!(k(4000, KvType::Q8_0, 128, 75), Simple);
        assert_eq!(k(1, KvType::F16, 128, 75), Split);
        for cap in [75, 90] {
            assert_eq!(k(SPLIT_ROWS, KvType::Q8_0, 128, cap), Split);
            assert_eq!(k(FLASH_MIN_ROWS - 1, KvType::F16, 128, cap), Simple);
            // f32 caches keep f32 arithmetic.
            assert_eq!(k(4000, KvType::F32, 128, cap), Simple);
            // Head dims the flash kernel is not built for; heads the split one does not take.
            assert_eq!(k(4000, KvType::F16, 112, cap), Simple);
            assert_eq!(k(1, KvType::F16, 16, cap), Simple);
        }
        assert!(supported_capability(75).is_ok() && supported_capability(90).is_ok());
        let old = supported_capability(61).unwrap_err().to_string();
        assert!(old.contains("6.1") && old.contains("7.5"), "{old}");
    }
}
