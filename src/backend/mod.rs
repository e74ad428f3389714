//! Where math runs. The engine is written once against [`Backend`]: device memory (activations,
//! weights, KV cache) is opaque handles, every op is enqueued in order, and only [`Backend::read`]
//! brings numbers back to the host. The CPU backend implements it directly; the CUDA backend and the
//! budgeted-device mode (CPU standing in for a GPU under a byte budget) implement the same calls.
//!
//! Knows nothing about models: ops take shapes and numbers, not layers.
//!
//! This file holds the [`Backend`] trait and its error; the rest of the room:
//! - `cpu/`, `cuda/`, `sim.rs`: the backends (the CPU, the GPU, the budgeted device);
//! - `memory.rs`: device memory under a budget (ledger, arena, workspace), shared by CUDA and
//!   the budgeted device;
//! - `recording.rs`: the rules of recorded steps, one definition for CUDA and the budgeted device;
//! - `args.rs`: the values ops take beside their buffers;
//! - `checks.rs`, `bundles.rs`, `kv_table.rs`: the checks and sizes every backend shares (shapes,
//!   bundle bytes, block tables);
//! - `fused.rs`: fused ops as the plain ops they equal (defaults and fallbacks);
//! - `transfer.rs`: host stages device→host copies land in;
//! - `clock.rs`: timing marks on a device's streams (the device time of a trace's spans).

mod args;
#[cfg(test)]
mod bundle_tests;
mod bundles;
mod checks;
pub mod clock;
pub mod cpu;
pub mod cuda;
mod fused;
mod kv_table;
pub mod memory;
pub mod reads;
mod recording;
pub mod sim;
mod transfer;

use thiserror::Error;

use crate::footprint::KvColsError;
pub use crate::footprint::{KV_BLOCK, KvType, WorkspaceOp};
use crate::store::Encoding;
use crate::tensor::{Bytes, DType, HostTensor};
pub use args::{Act, AttnSeq, AttnShape, Experts, MatmulPart, Rope, RopePairs, Route, sparse_act};
pub use bundles::{
    BundleShape, IN_REST, bundle_bytes, bundle_rows, check_bundle_weight, check_mappable,
    check_not_coded, check_scatter, in_place_read_bytes,
};
pub use checks::{
    check_matmul_shape, check_parts, check_rope, check_same_shape, retyped_bytes, weight_bytes,
};
pub use fused::{ProductInput, gate_and_up, gate_then_up, gate_up_then_down, rope_then_store};
pub use kv_table::{check_kv_table, kv_runs};
pub use recording::STEP_POSITION_BYTES;
use recording::not_recorded;
pub use transfer::{HostPin, HostStage, Landing, check_pace_rate};

#[derive(Debug, Error)]
pub enum BackendError {
    #[error("device memory exhausted: {what} needs {needed} bytes, {available} of the budget left")]
    OutOfMemory {
        what: String,
        needed: usize,
        available: usize,
    },
    #[error("shape mismatch in {op}: {msg}")]
    Shape { op: &'static str, msg: String },
    #[error("backend unavailable: {0}")]
    Unavailable(String),
    #[error("device error: {0}")]
    Device(String),
    #[error(
        "{op} needs {needed} bytes of device workspace, {held} are held: the step's workspace formula missed it"
    )]
    Workspace { op: String, needed: u64, held: u64 },
}

pub type Result<T> = std::result::Result<T, BackendError>;

impl From<KvColsError> for BackendError {
    fn from(e: KvColsError) -> Self {
        BackendError::Shape {
            op: "kv cache",
            msg: e.to_string(),
        }
    }
}

/// Lays `rows` rows of `dtype` (`row_bytes` each) out in place as a backend's products read
/// them, saying whether it did ([`Backend::host_matrix_layout`]). Shared with the thread that
/// reads streamed layers into DRAM.
pub type HostMatrixLayout =
    std::sync::Arc<dyn Fn(DType, usize, usize, &mut [u8]) -> bool + Send + Sync>;

/// A compute device. `Tensor` is a device buffer of f32 activations shaped `rows × cols`
/// (row-major; one row per token); `Weight` a weight matrix resident on the device in its
/// storage format, or FFN bundles in a store encoding ([`Backend::upload_bundles`]). Copies to
/// the device may run on a separate copy stream: `Event`s order them against compute (on
/// synchronous backends they are no-ops).
pub trait Backend: Send + Sync + 'static {
    type Tensor: Send;
    type Weight: Send + Sync;
    type Event: Send;
    /// A KV cache: `rows` positions of `cols` values in a [`KvType`].
    type Kv: Send;
    /// A block table on the device: maps a paged sequence's positions into a shared cache
    /// (the KV pool) in blocks of [`KV_BLOCK`] rows ([`kv_runs`]).
    type KvTable: Send;
    /// A recorded step ([`Backend::record`]); `()` where nothing is recorded.
    type Recording: Send;

    fn name(&self) -> String;

    /// Run `f` in this backend's execution context, so the ops it calls do not each pay to
    /// enter it: the CPU backend's thread pool, its other workers kept taking tasks until `f`
    /// returns (none falls asleep between the forks of a step).
    fn enter<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        f()
    }

    // ---- memory -------------------------------------------------------------------------

    /// Place a weight on the device.
    fn upload(&self, w: &HostTensor) -> Result<Self::Weight>;
    /// An uninitialised device weight buffer of `rows × cols` values in `dtype` (a streaming
    /// slot, filled by [`Backend::upload_into`]).
    fn alloc_weight(
        &self,
        name: &str,
        dtype: DType,
        rows: usize,
        cols: usize,
    ) -> Result<Self::Weight>;
    /// `w` is whole, and from now on only the weight of [`Backend::matmul_into`] and
    /// [`Backend::matmul_parts`]: lay its bytes out for this backend's products where it has a
    /// faster layout (the CPU's many-row kernels read Q8_0/Q4_0/Q4_1 rows in tiles). The same
    /// bytes, so the memory held does not change; the ops that read rows refuse it after.
    fn lay_out_for_products(&self, _w: &mut Self::Weight) -> Result<()> {
        Ok(())
    }
    /// A function that lays a matrix's host bytes out in place as this backend's products read
    /// it, before they are copied whole into a slot ([`Backend::upload_laid_out`]), and says
    /// whether it did; `None` where rows are its only layout (CUDA). The CPU lays Q8_0/Q4_0/
    /// Q4_1 rows out in tiles: a streamed layer then lands ready for its products, where tiling
    /// each landed slot (2.8–3.3 GB/s) would cost more than it saves.
    fn host_matrix_layout(&self) -> Option<HostMatrixLayout> {
        None
    }
    /// [`Backend::upload_into`] of a whole matrix from its first row, its bytes laid out by
    /// [`Backend::host_matrix_layout`]'s function (which said it did): from now on `dst` is
    /// read in that layout, by the products only, until [`Backend::retype_weight`] makes it a
    /// slot of rows again.
    fn upload_laid_out(&self, dst: &mut Self::Weight, src: &[u8]) -> Result<()> {
        self.upload_into(dst, 0, src)
    }
    /// `ws` are whole, laid out and from now on read by the products only
    /// ([`Backend::lay_out_for_products`]): keep them side by side where this backend reads them
    /// faster so. The same bytes and the same device memory; nothing by default. The CPU puts
    /// them in one buffer on huge pages (`Bytes::pack_huge`): a layer's attention matrices are
    /// each too small for a huge page of their own.
    fn pack_for_products(&self, _ws: &mut [&mut Self::Weight]) -> Result<()> {
        Ok(())
    }
    /// Place FFN neuron bundles on the device in a store encoding (f32, f16, bf16, INT8, INT4;
    /// see `store::Encoding`): `data` is whole bundles of `shape` laid out as the store writes
    /// them. The weight remembers its encoding; INT8/INT4 weights are taken by the bundle ops
    /// only. Device bytes: [`bundle_bytes`].
    fn upload_bundles(
        &self,
        name: &str,
        enc: Encoding,
        shape: BundleShape,
        data: &Bytes,
    ) -> Result<Self::Weight>;
    /// An uninitialised slot for `rows` bundles of `shape` in `enc` (filled by
    /// [`Backend::upload_into`], whole bundles); device bytes as [`Backend::upload_bundles`].
    fn alloc_bundles(
        &self,
        name: &str,
        enc: Encoding,
        shape: BundleShape,
        rows: usize,
    ) -> Result<Self::Weight>;
    /// Reinterpret `w` as `rows × cols` values in `dtype`, within the bytes it was allocated
    /// with: a streaming slot that holds, layer after layer, tensors of different formats.
    fn retype_weight(
        &self,
        w: &mut Self::Weight,
        dtype: DType,
        rows: usize,
        cols: usize,
    ) -> Result<()>;
    /// Copy `src` (whole rows of `dst`'s format) into `dst` from row `first_row`, on the copy
    /// stream. `src` must stay unchanged until an event recorded after this call completes.
    fn upload_into(&self, dst: &mut Self::Weight, first_row: usize, src: &[u8]) -> Result<()>;
    /// `data` (whole bundles of `shape` in `enc`) as a bundle weight the device reads in place
    /// from host memory over the link — page-locked and mapped into its address space, no
    /// device memory taken, nothing copied. The bundle ops compute on it as on device bundles;
    /// every byte they read of it crosses the link ([`in_place_read_bytes`], counted as
    /// host→device); only the listed ops take it. `data` must be a page-aligned buffer of its own (read from the store) and
    /// is shared, not copied. The CPU backend reads it in place as any bundles, and lays
    /// gated f16 bundles out in neuron tiles too (a copy in host memory), which its listed ops
    /// read a tile at a time.
    fn map_bundles(
        &self,
        name: &str,
        enc: Encoding,
        shape: BundleShape,
        data: &Bytes,
    ) -> Result<Self::Weight>;
    /// An event that completes when every copy issued so far is done.
    fn copies_done(&self) -> Result<Self::Event>;
    /// An event that completes when all compute issued so far is done.
    fn compute_done(&self) -> Result<Self::Event>;
    /// Make later compute wait for `ev`.
    fn compute_waits(&self, ev: &Self::Event) -> Result<()>;
    /// Make later copies wait for `ev`.
    fn copies_wait(&self, ev: &Self::Event) -> Result<()>;
    /// Block the calling thread until `ev` has completed (host buffers a copy read from may be
    /// reused after this).
    fn host_waits(&self, ev: &Self::Event) -> Result<()>;
    /// Page-lock a host range that copies to the device will read from, so they run
    /// asynchronously; the guard unlocks it (drop it before the memory). `None` where pinning
    /// means nothing (the CPU backends).
    fn pin_host(&self, _bytes: &[u8]) -> Result<Option<HostPin>> {
        Ok(None)
    }
    /// Pace host→device copies to at most `bytes_per_s` from now on (emulating a slower link;
    /// see `--emulate`). The CPU backend copies nothing and ignores it.
    fn pace_copies(&self, _bytes_per_s: f64) -> Result<()> {
        Ok(())
    }
    /// A zeroed `rows × cols` activation buffer.
    fn alloc(&self, rows: usize, cols: usize) -> Result<Self::Tensor>;
    /// Host → device, in order with the compute queued so far; `src.len()` must equal the
    /// tensor's size. `src` (pageable memory) may be reused as soon as this returns, and the
    /// host does not wait for the device.
    fn write(&self, dst: &mut Self::Tensor, src: &[f32]) -> Result<()>;
    /// Device → host; waits for queued work.
    fn read(&self, src: &Self::Tensor, dst: &mut [f32]) -> Result<()>;
    /// Queue a device → host copy of `src` into `dst` behind the compute queued so far; it has
    /// landed once [`Backend::host_waits`] on the returned event has returned. Synchronous
    /// backends copy at once. Use it through [`Landing`].
    ///
    /// # Safety
    /// `dst` must be neither read, written nor freed until that wait has returned.
    unsafe fn read_queued(&self, src: &Self::Tensor, dst: &mut [f32]) -> Result<Self::Event> {
        self.read(src, dst)?;
        self.compute_done()
    }
    /// Copy `n` rows from `src[src_row..]` to `dst[dst_row..]` (same column count).
    fn copy_rows(
        &self,
        src: &Self::Tensor,
        src_row: usize,
        dst: &mut Self::Tensor,
        dst_row: usize,
        n: usize,
    ) -> Result<()>;
    fn shape(&self, t: &Self::Tensor) -> (usize, usize);
    /// View `t` as `rows × cols` in the memory it was allocated with (at most that many
    /// values; the contents are unspecified until written): a step's buffers narrowed to a
    /// layer's width and back, never reallocated.
    fn reshape(&self, t: &mut Self::Tensor, rows: usize, cols: usize) -> Result<()>;

    // ---- workspace ----------------------------------------------------------------------

    /// Device bytes `op` takes as workspace (0 where the backend needs none). The one formula
    /// the planner, this backend and the budgeted device all use.
    fn workspace_bytes(&self, op: &WorkspaceOp) -> u64;
    /// Hold exactly `bytes` of device workspace for the ops that follow (0 releases it). An op
    /// needing more than is held fails with [`BackendError::Workspace`].
    fn set_workspace(&self, bytes: u64) -> Result<()>;
    /// Device bytes of workspace held now.
    fn workspace_held(&self) -> u64;

    // ---- KV cache -----------------------------------------------------------------------

    /// A zeroed KV cache of `rows` positions × `cols` values.
    fn alloc_kv(&self, rows: usize, cols: usize, ty: KvType) -> Result<Self::Kv>;
    /// `(rows, cols, type)` of a cache.
    fn kv_shape(&self, kv: &Self::Kv) -> (usize, usize, KvType);
    /// A block table of up to `blocks` entries (device memory: 4 bytes an entry).
    fn alloc_kv_table(&self, blocks: usize) -> Result<Self::KvTable>;
    /// Set a table to `blocks` (block ids of the cache it will map into), in order with the
    /// compute; `blocks` may be reused when this returns.
    fn write_kv_table(&self, table: &mut Self::KvTable, blocks: &[u32]) -> Result<()>;
    /// Store every row of `src` (f32, `cols` wide) at rows `dst_row..` of `dst`, converted;
    /// with a `table`, at the rows it maps those positions to.
    fn store_kv(
        &self,
        src: &Self::Tensor,
        dst: &mut Self::Kv,
        table: Option<&Self::KvTable>,
        dst_row: usize,
    ) -> Result<()>;
    /// [`Backend::store_kv`] of a step's keys `k` into `k_cache` and its values `v` into
    /// `v_cache` (one launch on CUDA).
    fn store_kv_pair(
        &self,
        (k, v): (&Self::Tensor, &Self::Tensor),
        (k_cache, v_cache): (&mut Self::Kv, &mut Self::Kv),
        table: Option<&Self::KvTable>,
        dst_row: usize,
    ) -> Result<()> {
        self.store_kv(k, k_cache, table, dst_row)?;
        self.store_kv(v, v_cache, table, dst_row)
    }
    /// A step's rotation and KV store: [`Backend::rope_pair`] of `q` and `k` (rows at
    /// positions `dst_row..`), then [`Backend::store_kv_pair`] of `k` and `v` (one launch on
    /// CUDA for f32 and f16 caches).
    fn rope_store_kv(
        &self,
        (q, k, v): (&mut Self::Tensor, &mut Self::Tensor, &Self::Tensor),
        caches: (&mut Self::Kv, &mut Self::Kv),
        table: Option<&Self::KvTable>,
        dst_row: usize,
        rope: Rope<'_, Self::Weight>,
    ) -> Result<()> {
        rope_then_store(self, (q, k, v), caches, table, dst_row, rope)
    }
    /// Rows `first..first + out.len() / cols` of `src` as f32 on the host (waits for queued work).
    fn read_kv(&self, src: &Self::Kv, first: usize, out: &mut [f32]) -> Result<()>;
    /// Write f32 `values` (whole rows) into rows `first..` of `dst`, converted.
    fn write_kv(&self, dst: &mut Self::Kv, first: usize, values: &[f32]) -> Result<()>;
    /// Rows `first..` of `src` as stored (whole rows of its type, `out.len()` bytes) on the
    /// host, waiting for queued work: a cache kept in host memory, copied without conversion.
    fn read_kv_raw(&self, src: &Self::Kv, first: usize, out: &mut [u8]) -> Result<()>;
    /// Stored rows (whole rows of `dst`'s type) into rows `first..` of `dst`, in order with the
    /// compute; `src` may be reused when this returns.
    fn write_kv_raw(&self, dst: &mut Self::Kv, first: usize, src: &[u8]) -> Result<()>;

    // ---- ops ----------------------------------------------------------------------------

    /// `out[i] = table[ids[i]]` (rows decoded to f32).
    fn embed(&self, table: &Self::Weight, ids: &[u32], out: &mut Self::Tensor) -> Result<()>;
    /// `x[i] += table[first_row + i]` (learned positions).
    fn add_table_rows(
        &self,
        x: &mut Self::Tensor,
        table: &Self::Weight,
        first_row: usize,
    ) -> Result<()>;
    /// `out = x · Wᵀ`: `x` is `n × in`, `W` is `out_features × in`, `out` is `n × out_features`.
    fn matmul(&self, w: &Self::Weight, x: &Self::Tensor, out: &mut Self::Tensor) -> Result<()> {
        self.matmul_into(w, x, out, 0)
    }
    /// `out[:, col0 .. col0 + W.rows] = x · Wᵀ`: a row block of a larger weight (the rest of the
    /// columns are left alone).
    fn matmul_into(
        &self,
        w: &Self::Weight,
        x: &Self::Tensor,
        out: &mut Self::Tensor,
        col0: usize,
    ) -> Result<()>;
    /// Several products of the same `x` (q, k and v; gate and up): part `i` is
    /// [`Backend::matmul_into`] of `parts[i].w` into columns `col0..` of `outs[parts[i].out]`.
    /// The parts' columns must not overlap. CUDA quantizes `x` once for block formats and runs
    /// the parts in one launch where it can; the results are each part's alone, bit for bit.
    fn matmul_parts(
        &self,
        x: &Self::Tensor,
        parts: &[MatmulPart<'_, Self::Weight>],
        outs: &mut [&mut Self::Tensor],
    ) -> Result<()> {
        check_parts(parts, outs.len())?;
        for p in parts {
            self.matmul_into(p.w, x, outs[p.out], p.col0)?;
        }
        Ok(())
    }
    /// [`Backend::matmul_parts`] of `input`'s rows. CUDA writes a pending norm's rows straight
    /// into the f16 input of its GEMMs, where every part is one (the same bits).
    fn matmul_parts_of(
        &self,
        input: ProductInput<'_, Self>,
        parts: &[MatmulPart<'_, Self::Weight>],
        outs: &mut [&mut Self::Tensor],
    ) -> Result<()> {
        let x = input.rows(self)?;
        self.matmul_parts(x, parts, outs)
    }
    /// First half of a bundled FFN: for each neuron `i` of `bundles`,
    /// `h[:, col0 + i] = act(gate_i·x) ⊙ (up_i·x)` (gated) or `act(up_i·x + up_bias[col0 + i])`,
    /// masked by `threshold` as [`Backend::gated`] / [`Backend::activate`] are.
    #[allow(clippy::too_many_arguments)]
    fn ffn_bundles_up(
        &self,
        bundles: &Self::Weight,
        shape: BundleShape,
        x: &Self::Tensor,
        act: Act,
        threshold: f32,
        up_bias: Option<&Self::Weight>,
        h: &mut Self::Tensor,
        col0: usize,
    ) -> Result<()>;
    /// Second half: `out += Σ_i h[:, col0 + i] · down_i` over the neurons of `bundles`.
    fn ffn_bundles_down(
        &self,
        bundles: &Self::Weight,
        shape: BundleShape,
        h: &Self::Tensor,
        col0: usize,
        out: &mut Self::Tensor,
    ) -> Result<()>;
    /// [`Backend::ffn_bundles_up`] for the listed neurons of `bundles` only:
    /// `h[:, j] = ` the activation of neuron `idx[j]` (its up bias `up_bias[idx[j]]`), for
    /// `j < idx.len()`; the other neurons are not read.
    #[allow(clippy::too_many_arguments)]
    fn ffn_bundles_up_listed(
        &self,
        bundles: &Self::Weight,
        shape: BundleShape,
        x: &Self::Tensor,
        act: Act,
        threshold: f32,
        up_bias: Option<&Self::Weight>,
        idx: &[u32],
        h: &mut Self::Tensor,
    ) -> Result<()> {
        let listed = (bundles, None);
        self.ffn_bundles_up_listed_from(listed, shape, x, act, threshold, up_bias, idx, h)
    }
    /// `out += Σ_j h[:, j] · down_{idx[j]}`: the down columns of the listed neurons only.
    /// `ids[j]` is the neuron id of entry `idx[j]` (a unit's entries are slots): on the CPU and
    /// the budgeted device it places the term in the one order every FFN sums in
    /// ([`cpu::sparse::DOWN_BLOCK`]); CUDA sums in its own.
    fn ffn_bundles_down_listed(
        &self,
        bundles: &Self::Weight,
        shape: BundleShape,
        h: &Self::Tensor,
        listed: (&[u32], &[u32]),
        out: &mut Self::Tensor,
    ) -> Result<()> {
        self.ffn_bundles_down_listed_from((bundles, None), shape, h, listed, out)
    }
    /// [`Backend::ffn_bundles_up_listed`] over two sets of bundles of one shape and encoding
    /// (`listed.1`: the rest, a unit's neurons where they rest in host memory): an entry with
    /// [`IN_REST`] set is that row of the rest. No up bias with a rest (the bias goes by slot).
    #[allow(clippy::too_many_arguments)]
    fn ffn_bundles_up_listed_from(
        &self,
        listed: (&Self::Weight, Option<&Self::Weight>),
        shape: BundleShape,
        x: &Self::Tensor,
        act: Act,
        threshold: f32,
        up_bias: Option<&Self::Weight>,
        idx: &[u32],
        h: &mut Self::Tensor,
    ) -> Result<()>;
    /// [`Backend::ffn_bundles_down_listed`] over two sets of bundles, as
    /// [`Backend::ffn_bundles_up_listed_from`] (`(idx, ids)`: the entries and their neurons'
    /// ids, as [`Backend::ffn_bundles_down_listed`] takes them).
    fn ffn_bundles_down_listed_from(
        &self,
        bundles: (&Self::Weight, Option<&Self::Weight>),
        shape: BundleShape,
        h: &Self::Tensor,
        listed: (&[u32], &[u32]),
        out: &mut Self::Tensor,
    ) -> Result<()>;
    /// [`Backend::ffn_bundles_up_listed_from`] into `h`, then
    /// [`Backend::ffn_bundles_down_listed_from`] of that `h` into `out`, over one list: the
    /// same `h` and `out`. A backend may read each neuron once for both (the CPU and the
    /// budgeted device do where the rest lies in neuron tiles: two passes over SmolLM2's
    /// tiles read 12–14 GB/s where one read 18–20).
    #[allow(clippy::too_many_arguments)]
    fn ffn_bundles_listed_from(
        &self,
        listed: (&Self::Weight, Option<&Self::Weight>),
        shape: BundleShape,
        x: &Self::Tensor,
        (act, threshold): (Act, f32),
        up_bias: Option<&Self::Weight>,
        (idx, ids): (&[u32], &[u32]),
        h: &mut Self::Tensor,
        out: &mut Self::Tensor,
    ) -> Result<()> {
        self.ffn_bundles_up_listed_from(listed, shape, x, act, threshold, up_bias, idx, h)?;
        self.ffn_bundles_down_listed_from(listed, shape, h, (idx, ids), out)
    }
    /// A mixture-of-experts FFN: `out[t] = Σ w · down_e(act(gate_e·x[t]) ⊙ up_e·x[t])` over the
    /// routes `(t, e, w)`, each expert's tokens in one product (llama.cpp's `mul_mat_id`), the
    /// terms added in expert order (as transformers adds them).
    fn moe_ffn(
        &self,
        experts: Experts<'_, Self::Weight>,
        x: &Self::Tensor,
        routes: &[Route],
        act: Act,
        out: &mut Self::Tensor,
    ) -> Result<()>;
    /// Row `i` of `src` into row `rows[i]` of `dst` (the same format and columns), for every
    /// `i < rows.len()`, in order with the compute: a cache unit's missing neurons, brought in
    /// by one copy into `src`, scattered into their slots. Rows must be distinct and in range.
    fn scatter_rows(&self, src: &Self::Weight, rows: &[u32], dst: &mut Self::Weight) -> Result<()>;
    /// `x = 0`.
    fn zero(&self, x: &mut Self::Tensor) -> Result<()>;
    /// `x[i] += bias` for every row.
    fn add_bias(&self, x: &mut Self::Tensor, bias: &Self::Weight) -> Result<()>;
    /// `x += y`.
    fn add(&self, x: &mut Self::Tensor, y: &Self::Tensor) -> Result<()>;
    /// Per row: `out = x / rms(x) * w`.
    fn rms_norm(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
        eps: f32,
        out: &mut Self::Tensor,
    ) -> Result<()>;
    /// [`Backend::rms_norm`] of every `head_dim`-wide head of every row of `x`, in place, by
    /// the one weight vector `w` (`head_dim` long): Qwen3's norm of q and k before the rotation.
    fn rms_norm_heads(
        &self,
        x: &mut Self::Tensor,
        w: &Self::Weight,
        head_dim: usize,
        eps: f32,
    ) -> Result<()>;
    /// `x += y`, then [`Backend::rms_norm`] of `x` into `out`: a residual add and the norm after
    /// it (one launch on CUDA).
    fn add_rms_norm(
        &self,
        x: &mut Self::Tensor,
        y: &Self::Tensor,
        w: &Self::Weight,
        eps: f32,
        out: &mut Self::Tensor,
    ) -> Result<()> {
        self.add(x, y)?;
        self.rms_norm(x, w, eps, out)
    }
    /// Per row: `out = (x - mean) / std * w + b`.
    fn layer_norm(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
        b: &Self::Weight,
        eps: f32,
        out: &mut Self::Tensor,
    ) -> Result<()>;
    /// Rotate the first `rot_dims` dimensions of every head of every row; row `i` is at position
    /// `first_pos + i`; `inv_freq` holds `rot_dims / 2` inverse frequencies.
    fn rope(
        &self,
        x: &mut Self::Tensor,
        head_dim: usize,
        rot_dims: usize,
        pairs: RopePairs,
        inv_freq: &Self::Weight,
        first_pos: usize,
    ) -> Result<()>;
    /// [`Backend::rope`] of a step's queries `q` and keys `k` (one launch on CUDA).
    #[allow(clippy::too_many_arguments)]
    fn rope_pair(
        &self,
        q: &mut Self::Tensor,
        k: &mut Self::Tensor,
        head_dim: usize,
        rot_dims: usize,
        pairs: RopePairs,
        inv_freq: &Self::Weight,
        first_pos: usize,
    ) -> Result<()> {
        self.rope(q, head_dim, rot_dims, pairs, inv_freq, first_pos)?;
        self.rope(k, head_dim, rot_dims, pairs, inv_freq, first_pos)
    }
    /// `x = act(x)`, and where `threshold > 0`, 0 wherever `|act(x)| ≤ threshold` (the FFN
    /// sparsity mask; see [`sparse_act`]).
    fn activate(&self, x: &mut Self::Tensor, act: Act, threshold: f32) -> Result<()>;
    /// `gate = act(gate) ⊙ up`, and where `threshold > 0`, 0 wherever `|act(gate)| ≤ threshold`.
    fn gated(
        &self,
        gate: &mut Self::Tensor,
        up: &Self::Tensor,
        act: Act,
        threshold: f32,
    ) -> Result<()>;
    /// The hidden activations of a gated FFN into `gate`: `x · w_gateᵀ` there and `x · w_upᵀ`
    /// into `up`, then [`Backend::gated`] of the two; `up` is scratch (read it no more). CUDA
    /// computes a row of both weights in one warp and writes only the gated product (one launch
    /// for three, the same bits).
    fn gate_up(
        &self,
        x: &Self::Tensor,
        (w_gate, w_up): (&Self::Weight, &Self::Weight),
        (act, threshold): (Act, f32),
        gate: &mut Self::Tensor,
        up: &mut Self::Tensor,
    ) -> Result<()> {
        gate_then_up(self, x, (w_gate, w_up), (act, threshold), gate, up)
    }
    /// A gated FFN without bias or mask: [`Backend::gate_up`] of `input`'s rows, then `out =
    /// hidden · w_downᵀ`. `gate` and `up` are scratch (what they hold after is unspecified). A
    /// prompt's step on CUDA hands the gated product straight to cuBLAS as its f16 input (one
    /// launch and no f32 copy of it written and converted; the same bits), and a pending norm's
    /// rows too (see [`Backend::matmul_parts_of`]).
    fn gate_up_down(
        &self,
        input: ProductInput<'_, Self>,
        (w_gate, w_up, w_down): (&Self::Weight, &Self::Weight, &Self::Weight),
        how: (Act, f32),
        (gate, up): (&mut Self::Tensor, &mut Self::Tensor),
        out: &mut Self::Tensor,
    ) -> Result<()> {
        let x = input.rows(self)?;
        gate_up_then_down(self, x, (w_gate, w_up, w_down), how, (gate, up), out)
    }
    /// Ask for the first `rows` positions of a layer's key and value caches ahead of the
    /// attention that will read them, while other work runs (a hint: nothing by default).
    fn prefetch_kv(&self, _k_cache: &Self::Kv, _v_cache: &Self::Kv, _rows: usize) {}
    /// Causal attention of `q` (`n × n_heads·head_dim`, row `i` at position `first_pos + i`)
    /// over the first `first_pos + n` rows of the caches (`ctx × n_kv_heads·head_dim`), which
    /// already hold this step's keys and values; with a `table`, the rows it maps the positions
    /// to (a paged sequence in the KV pool).
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        q: &Self::Tensor,
        k_cache: &Self::Kv,
        v_cache: &Self::Kv,
        table: Option<&Self::KvTable>,
        first_pos: usize,
        shape: AttnShape,
        out: &mut Self::Tensor,
    ) -> Result<()>;
    /// Whether [`Backend::attention_batch`] runs here (else callers attend each sequence alone).
    fn attends_batches(&self) -> bool {
        false
    }
    /// The attention of several sequences' rows of `q` in one call (a batched step), each over
    /// its own caches: every sequence's rows of `out` get what [`Backend::attention`] gives them
    /// alone; rows of no sequence are left as they are. The caches already hold the step's keys
    /// and values.
    fn attention_batch(
        &self,
        _q: &Self::Tensor,
        _seqs: &[AttnSeq<'_, Self>],
        _shape: AttnShape,
        _out: &mut Self::Tensor,
    ) -> Result<()> {
        Err(BackendError::Shape {
            op: "attention_batch",
            msg: "this backend attends one sequence at a time".into(),
        })
    }

    /// Device operations run so far, where the backend counts them (CUDA: each kernel launch,
    /// copy or fill within device memory, and each node of a replayed recording, which holds
    /// exactly those); `None` elsewhere.
    fn device_ops_run(&self) -> Option<u64> {
        None
    }

    /// A clock on the device's streams for traces, where the device runs apart from the host
    /// (CUDA, and the budgeted device's link and in-place reads); `None` where its time is the
    /// host's.
    fn device_clock(&self) -> Option<std::sync::Arc<dyn clock::DeviceClock>> {
        None
    }

    // ---- recorded steps -----------------------------------------------------------------

    /// Whether this backend records a step's ops once and replays them ([`Backend::record`],
    /// [`Backend::replay`]): a CUDA graph, launched with one call instead of one per kernel.
    fn records_steps(&self) -> bool {
        false
    }
    /// Allocations taken on the device so far ([`memory::DeviceMemory::takes`]): while it is
    /// unchanged, every buffer a recording names is still the one it was recorded with.
    fn allocations(&self) -> u64 {
        0
    }
    /// Set the position a recorded step's first row is at when it runs (what `rope`,
    /// `store_kv` and `attention` are given while recording): before [`Backend::record`] and
    /// before each [`Backend::replay`]; not while recording.
    fn set_step_position(&self, _first_pos: usize) -> Result<()> {
        Err(not_recorded("set_step_position"))
    }
    /// Run `ops` (a step's ops, none of which may allocate, copy between host and device, wait
    /// or sync) and record them. Their position comes from [`Backend::set_step_position`], not
    /// from their arguments, so the recording replays at any later position; every other
    /// argument (buffers, shapes) is fixed in it.
    fn record<E: From<BackendError>>(
        &self,
        _ops: impl FnOnce() -> std::result::Result<(), E>,
    ) -> std::result::Result<Self::Recording, E> {
        Err(not_recorded("record").into())
    }
    /// Run `rec` again at the position set last. `ops` are the ops it was recorded from,
    /// issued again: a backend that replays for real does not call them; the budgeted device
    /// runs them and fails if they differ from the recording in anything but the position (a
    /// buffer, a shape, an op), which a real replay would have got wrong.
    fn replay<E: From<BackendError>>(
        &self,
        _rec: &Self::Recording,
        _ops: impl FnOnce() -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        Err(not_recorded("replay").into())
    }
}
