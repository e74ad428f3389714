//! The CUDA backend: cudarc with the driver loaded at run time (nothing here panics on a machine
//! without one: [`CudaBackend::new`] checks for libcuda first and returns an error).
//!
//! - Memory: every device buffer is a [`DeviceMemory`](super::memory::DeviceMemory) allocation:
//!   a ledger reservation of [`device_bytes`](crate::footprint::device_bytes) and, under a
//!   budget, a range of one arena allocated up front ([`CudaBackend::with_process_budget`] sizes
//!   it as `--gpu-mem` less what the context, our modules and cuBLAS hold, so the process never
//!   holds more than `--gpu-mem`). Without a budget buffers come from the compute stream's pool.
//! - Workspace: the temporaries ops need (f16 activations for cuBLAS, 8-bit activation blocks,
//!   token ids) are carved from one held buffer sized by [`workspace_bytes`] — the formula the
//!   planner and the budgeted device use too.
//! - Streams: one compute stream for every kernel (and cuBLAS, bound to it), one copy stream for
//!   weight uploads; events order them (`copies_done` → `compute_waits`, and back). A new buffer
//!   may reuse an arena range that queued work on either stream still touches, so every
//!   allocation orders both streams after what was queued before it.
//! - Kernels: `kernels/*.cu`, PTX built by build.rs or compiled here with NVRTC, loaded at start
//!   (so their memory is part of the fixed cost measured before the arena is sized); launched
//!   through functions build.rs generates from their signatures (`launches`), so rustc checks
//!   every launch's arguments.
//! - Host buffers the copy stream reads from are page-locked with [`CudaBackend::pin_host`].
//!
//! One file a concern, the ops' files named after the kernels' (`kernels/*.cu`):
//! - `device.rs`: context, streams, modules, cuBLAS, the arena; what every op shares of them;
//! - `types.rs`: the handles (tensors, weights, KV caches, block tables) and their checks;
//! - `args.rs`: what kernels take (codes, by-value parts, grids); `launches.rs`: the typed
//!   launches generated from the kernels; `kernels.rs`: loading the modules;
//! - `buffers.rs`: allocations and the workspace; `copies.rs`: host↔device copies, events,
//!   pinned memory; `membw.rs`: bandwidth and copy pacing; `graph.rs`: recorded steps;
//! - the ops: `norm.rs`, `rope.rs`, `elementwise.rs`, `kv.rs`, `matvec.rs`, `gemm.rs`
//!   (cuBLAS), `matmul.rs` (which of the two a product takes), `bundles.rs`, `attention.rs`;
//! - `meter.rs`: the process's device memory as the driver sees it; `clock.rs`: timing events
//!   on both streams (the device time of a trace's spans).
//!
//! This file declares them and dispatches [`Backend`] to them.

mod args;
mod attention;
mod buffers;
mod bundles;
mod clock;
mod copies;
mod device;
mod elementwise;
mod experts;
mod gemm;
mod graph;
pub mod kernels;
mod kv;
mod launches;
mod matmul;
mod matvec;
mod membw;
mod meter;
mod norm;
mod rope;
mod types;

use crate::backend::{Experts, Route};
use cudarc::driver::CudaEvent;

pub use device::{
    CudaBackend, DeviceInfo, MIN_CAPABILITY, device_available, driver_present, supported_capability,
};
pub use graph::CudaRecording;
pub use meter::DeviceMeter;
pub use types::PinnedRegion;
pub use types::{CudaKv, CudaKvTable, CudaTensor, CudaWeight};

use super::{
    Act, AttnShape, Backend, BackendError, BundleShape, HostPin, KvType, MatmulPart, ProductInput,
    Result, Rope, RopePairs, WorkspaceOp,
};
use crate::footprint::workspace_bytes;
use crate::store::Encoding;
use crate::tensor::{Bytes, DType, HostTensor};

impl Backend for CudaBackend {
    type Tensor = CudaTensor;
    type Weight = CudaWeight;
    type Event = CudaEvent;
    type Kv = CudaKv;
    type KvTable = CudaKvTable;
    type Recording = CudaRecording;

    fn name(&self) -> String {
        device::name(self)
    }

    fn upload(&self, w: &HostTensor) -> Result<CudaWeight> {
        copies::upload(self, w)
    }

    fn alloc_weight(
        &self,
        name: &str,
        dtype: DType,
        rows: usize,
        cols: usize,
    ) -> Result<CudaWeight> {
        buffers::alloc_weight(self, name, dtype, rows, cols)
    }

    fn upload_bundles(
        &self,
        name: &str,
        enc: Encoding,
        shape: BundleShape,
        data: &Bytes,
    ) -> Result<CudaWeight> {
        copies::upload_bundles(self, name, enc, shape, data)
    }

    fn alloc_bundles(
        &self,
        name: &str,
        enc: Encoding,
        shape: BundleShape,
        rows: usize,
    ) -> Result<CudaWeight> {
        buffers::alloc_bundles(self, name, enc, shape, rows)
    }

    fn map_bundles(
        &self,
        name: &str,
        enc: Encoding,
        shape: BundleShape,
        data: &Bytes,
    ) -> Result<CudaWeight> {
        copies::map_bundles(self, name, enc, shape, data)
    }

    fn retype_weight(
        &self,
        w: &mut CudaWeight,
        dtype: DType,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        buffers::retype_weight(self, w, dtype, rows, cols)
    }

    fn upload_into(&self, dst: &mut CudaWeight, first_row: usize, src: &[u8]) -> Result<()> {
        copies::upload_into(self, dst, first_row, src)
    }

    fn copies_done(&self) -> Result<CudaEvent> {
        copies::copies_done(self)
    }

    fn compute_done(&self) -> Result<CudaEvent> {
        copies::compute_done(self)
    }

    fn compute_waits(&self, ev: &CudaEvent) -> Result<()> {
        copies::compute_waits(self, ev)
    }

    fn copies_wait(&self, ev: &CudaEvent) -> Result<()> {
        copies::copies_wait(self, ev)
    }

    fn host_waits(&self, ev: &CudaEvent) -> Result<()> {
        copies::host_waits(self, ev)
    }

    fn pace_copies(&self, bytes_per_s: f64) -> Result<()> {
        membw::pace_copies(self, bytes_per_s)
    }

    fn pin_host(&self, bytes: &[u8]) -> Result<Option<HostPin>> {
        copies::pin_host(self, bytes)
    }

    fn alloc(&self, rows: usize, cols: usize) -> Result<CudaTensor> {
        buffers::alloc(self, rows, cols)
    }

    fn write(&self, dst: &mut CudaTensor, src: &[f32]) -> Result<()> {
        copies::write(self, dst, src)
    }

    fn read(&self, src: &CudaTensor, dst: &mut [f32]) -> Result<()> {
        copies::read(self, src, dst)
    }

    unsafe fn read_queued(&self, src: &CudaTensor, dst: &mut [f32]) -> Result<CudaEvent> {
        // SAFETY: the caller keeps the trait's contract, which the function's is.
        unsafe { copies::read_queued(self, src, dst) }
    }

    fn copy_rows(
        &self,
        src: &CudaTensor,
        src_row: usize,
        dst: &mut CudaTensor,
        dst_row: usize,
        n: usize,
    ) -> Result<()> {
        copies::copy_rows(self, src, src_row, dst, dst_row, n)
    }

    fn shape(&self, t: &CudaTensor) -> (usize, usize) {
        (t.rows, t.cols)
    }

    fn reshape(&self, t: &mut CudaTensor, rows: usize, cols: usize) -> Result<()> {
        buffers::reshape(t, rows, cols)
    }

    fn workspace_bytes(&self, op: &WorkspaceOp) -> u64 {
        workspace_bytes(op)
    }

    fn set_workspace(&self, bytes: u64) -> Result<()> {
        buffers::set_workspace(self, bytes)
    }

    fn workspace_held(&self) -> u64 {
        self.workspace.held()
    }

    fn alloc_kv(&self, rows: usize, cols: usize, ty: KvType) -> Result<CudaKv> {
        kv::alloc_kv(self, rows, cols, ty)
    }

    fn kv_shape(&self, kv: &CudaKv) -> (usize, usize, KvType) {
        (kv.rows, kv.cols, kv.ty)
    }

    fn alloc_kv_table(&self, blocks: usize) -> Result<CudaKvTable> {
        kv::alloc_kv_table(self, blocks)
    }

    fn write_kv_table(&self, table: &mut CudaKvTable, blocks: &[u32]) -> Result<()> {
        kv::write_kv_table(self, table, blocks)
    }

    fn store_kv(
        &self,
        src: &CudaTensor,
        dst: &mut CudaKv,
        table: Option<&CudaKvTable>,
        dst_row: usize,
    ) -> Result<()> {
        kv::store_kv(self, src, dst, table, dst_row)
    }

    fn store_kv_pair(
        &self,
        (k, v): (&CudaTensor, &CudaTensor),
        (kc, vc): (&mut CudaKv, &mut CudaKv),
        table: Option<&CudaKvTable>,
        dst_row: usize,
    ) -> Result<()> {
        kv::store_kv_pair(self, (k, v), (kc, vc), table, dst_row)
    }

    fn rope_store_kv(
        &self,
        (q, k, v): (&mut CudaTensor, &mut CudaTensor, &CudaTensor),
        (kc, vc): (&mut CudaKv, &mut CudaKv),
        table: Option<&CudaKvTable>,
        dst_row: usize,
        rope: Rope<'_, CudaWeight>,
    ) -> Result<()> {
        rope::rope_store_kv(self, (q, k, v), (kc, vc), table, dst_row, rope)
    }

    fn read_kv(&self, src: &CudaKv, first: usize, out: &mut [f32]) -> Result<()> {
        kv::read_kv(self, src, first, out)
    }

    fn read_kv_raw(&self, src: &CudaKv, first: usize, out: &mut [u8]) -> Result<()> {
        kv::read_kv_raw(self, src, first, out)
    }

    fn write_kv_raw(&self, dst: &mut CudaKv, first: usize, src: &[u8]) -> Result<()> {
        kv::write_kv_raw(self, dst, first, src)
    }

    fn write_kv(&self, dst: &mut CudaKv, first: usize, values: &[f32]) -> Result<()> {
        kv::write_kv(self, dst, first, values)
    }

    fn embed(&self, table: &CudaWeight, ids: &[u32], out: &mut CudaTensor) -> Result<()> {
        elementwise::embed(self, table, ids, out)?;
        let read = super::reads::embedding(ids.len(), table.row_bytes());
        self.ledger().count_device_read(read);
        Ok(())
    }

    fn add_table_rows(
        &self,
        x: &mut CudaTensor,
        table: &CudaWeight,
        first_row: usize,
    ) -> Result<()> {
        elementwise::add_table_rows(self, x, table, first_row)
    }

    fn matmul_into(
        &self,
        w: &CudaWeight,
        x: &CudaTensor,
        out: &mut CudaTensor,
        col0: usize,
    ) -> Result<()> {
        matmul::matmul_into(self, w, x, out, col0)?;
        self.read_weights(&[w]);
        Ok(())
    }

    fn matmul_parts(
        &self,
        x: &CudaTensor,
        parts: &[MatmulPart<'_, CudaWeight>],
        outs: &mut [&mut CudaTensor],
    ) -> Result<()> {
        matmul::matmul_parts(self, x, parts, outs)?;
        self.read_weights(&parts.iter().map(|p| p.w).collect::<Vec<_>>());
        Ok(())
    }

    fn matmul_parts_of(
        &self,
        input: ProductInput<'_, Self>,
        parts: &[MatmulPart<'_, CudaWeight>],
        outs: &mut [&mut CudaTensor],
    ) -> Result<()> {
        matmul::matmul_parts_of(self, input, parts, outs)?;
        self.read_weights(&parts.iter().map(|p| p.w).collect::<Vec<_>>());
        Ok(())
    }

    fn ffn_bundles_up(
        &self,
        b: &CudaWeight,
        shape: BundleShape,
        x: &CudaTensor,
        act: Act,
        threshold: f32,
        up_bias: Option<&CudaWeight>,
        h: &mut CudaTensor,
        col0: usize,
    ) -> Result<()> {
        bundles::ffn_bundles_up(self, b, shape, x, act, threshold, up_bias, h, col0)
    }

    fn ffn_bundles_down(
        &self,
        b: &CudaWeight,
        shape: BundleShape,
        h: &CudaTensor,
        col0: usize,
        out: &mut CudaTensor,
    ) -> Result<()> {
        bundles::ffn_bundles_down(self, b, shape, h, col0, out)
    }

    fn ffn_bundles_up_listed_from(
        &self,
        listed: (&CudaWeight, Option<&CudaWeight>),
        shape: BundleShape,
        x: &CudaTensor,
        act: Act,
        threshold: f32,
        up_bias: Option<&CudaWeight>,
        idx: &[u32],
        h: &mut CudaTensor,
    ) -> Result<()> {
        bundles::ffn_bundles_up_listed(self, listed, shape, x, act, threshold, up_bias, idx, h)
    }

    fn ffn_bundles_down_listed_from(
        &self,
        listed: (&CudaWeight, Option<&CudaWeight>),
        shape: BundleShape,
        h: &CudaTensor,
        (idx, _ids): (&[u32], &[u32]),
        out: &mut CudaTensor,
    ) -> Result<()> {
        // CUDA sums in its own order (no bit parity is claimed there): the ids are not needed.
        bundles::ffn_bundles_down_listed(self, listed, shape, h, idx, out)
    }

    fn scatter_rows(&self, src: &CudaWeight, rows: &[u32], dst: &mut CudaWeight) -> Result<()> {
        elementwise::scatter_rows(self, src, rows, dst)
    }

    fn zero(&self, x: &mut CudaTensor) -> Result<()> {
        elementwise::zero(self, x)
    }

    fn add_bias(&self, x: &mut CudaTensor, bias: &CudaWeight) -> Result<()> {
        elementwise::add_bias(self, x, bias)
    }

    fn add(&self, x: &mut CudaTensor, y: &CudaTensor) -> Result<()> {
        elementwise::add(self, x, y)
    }

    fn rms_norm(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        eps: f32,
        out: &mut CudaTensor,
    ) -> Result<()> {
        norm::rms_norm(self, x, w, eps, out)
    }

    fn add_rms_norm(
        &self,
        x: &mut CudaTensor,
        y: &CudaTensor,
        w: &CudaWeight,
        eps: f32,
        out: &mut CudaTensor,
    ) -> Result<()> {
        norm::add_rms_norm(self, x, y, w, eps, out)
    }

    fn layer_norm(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        b: &CudaWeight,
        eps: f32,
        out: &mut CudaTensor,
    ) -> Result<()> {
        norm::layer_norm(self, x, w, b, eps, out)
    }

    fn moe_ffn(
        &self,
        e: Experts<'_, CudaWeight>,
        x: &CudaTensor,
        routes: &[Route],
        act: Act,
        out: &mut CudaTensor,
    ) -> Result<()> {
        let stacks: Vec<(usize, usize)> = [e.gate, Some(e.up), Some(e.down)]
            .into_iter()
            .flatten()
            .map(|w| (w.rows, w.row_bytes()))
            .collect();
        let width = e.width;
        experts::moe_ffn(self, e, x, routes, act, out)?;
        let read = super::reads::experts(routes, width, &stacks);
        self.ledger().count_device_read(read);
        Ok(())
    }

    fn rms_norm_heads(
        &self,
        x: &mut CudaTensor,
        w: &CudaWeight,
        head_dim: usize,
        eps: f32,
    ) -> Result<()> {
        norm::rms_norm_heads(self, x, w, head_dim, eps)
    }

    fn rope(
        &self,
        x: &mut CudaTensor,
        head_dim: usize,
        rot_dims: usize,
        pairs: RopePairs,
        inv_freq: &CudaWeight,
        first_pos: usize,
    ) -> Result<()> {
        rope::rope(self, x, head_dim, rot_dims, pairs, inv_freq, first_pos)
    }

    fn rope_pair(
        &self,
        q: &mut CudaTensor,
        k: &mut CudaTensor,
        head_dim: usize,
        rot_dims: usize,
        pairs: RopePairs,
        inv_freq: &CudaWeight,
        first_pos: usize,
    ) -> Result<()> {
        rope::rope_pair(self, q, k, head_dim, rot_dims, pairs, inv_freq, first_pos)
    }

    fn gate_up(
        &self,
        x: &CudaTensor,
        (w_gate, w_up): (&CudaWeight, &CudaWeight),
        (act, threshold): (Act, f32),
        gate: &mut CudaTensor,
        up: &mut CudaTensor,
    ) -> Result<()> {
        matmul::gate_up(self, x, (w_gate, w_up), (act, threshold), gate, up)?;
        self.read_weights(&[w_gate, w_up]);
        Ok(())
    }

    fn gate_up_down(
        &self,
        input: ProductInput<'_, Self>,
        (w_gate, w_up, w_down): (&CudaWeight, &CudaWeight, &CudaWeight),
        (act, threshold): (Act, f32),
        (gate, up): (&mut CudaTensor, &mut CudaTensor),
        out: &mut CudaTensor,
    ) -> Result<()> {
        matmul::gate_up_down(
            self,
            input,
            (w_gate, w_up, w_down),
            (act, threshold),
            (gate, up),
            out,
        )?;
        self.read_weights(&[w_gate, w_up, w_down]);
        Ok(())
    }

    fn activate(&self, x: &mut CudaTensor, act: Act, threshold: f32) -> Result<()> {
        elementwise::activate(self, x, act, threshold)
    }

    fn gated(
        &self,
        gate: &mut CudaTensor,
        up: &CudaTensor,
        act: Act,
        threshold: f32,
    ) -> Result<()> {
        elementwise::gated(self, gate, up, act, threshold)
    }

    fn attention(
        &self,
        q: &CudaTensor,
        k_cache: &CudaKv,
        v_cache: &CudaKv,
        table: Option<&CudaKvTable>,
        first_pos: usize,
        s: AttnShape,
        out: &mut CudaTensor,
    ) -> Result<()> {
        attention::attention(self, q, k_cache, v_cache, table, first_pos, s, out)?;
        let row_bytes = k_cache.ty.row_bytes(k_cache.cols);
        let read = super::reads::attention(first_pos + q.rows, row_bytes);
        self.ledger().count_device_read(read);
        Ok(())
    }

    fn records_steps(&self) -> bool {
        true
    }

    fn allocations(&self) -> u64 {
        self.mem.takes()
    }

    fn set_step_position(&self, first_pos: usize) -> Result<()> {
        graph::set_step_position(self, first_pos)
    }

    fn record<E: From<BackendError>>(
        &self,
        ops: impl FnOnce() -> std::result::Result<(), E>,
    ) -> std::result::Result<CudaRecording, E> {
        graph::record(self, ops)
    }

    fn replay<E: From<BackendError>>(
        &self,
        rec: &CudaRecording,
        ops: impl FnOnce() -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        graph::replay(self, rec, ops)
    }

    fn device_ops_run(&self) -> Option<u64> {
        Some(self.device_ops.load(std::sync::atomic::Ordering::Relaxed))
    }

    fn device_clock(&self) -> Option<std::sync::Arc<dyn super::clock::DeviceClock>> {
        Some(std::sync::Arc::new(clock::CudaClock::of(self)))
    }
}
