//! The budgeted device: the CPU standing in for a GPU. It takes device memory exactly as the CUDA
//! backend does — every buffer through the same [`DeviceMemory`] (ledger budget, aligned sizes,
//! one arena), and the same workspace for the same ops (the CUDA formula,
//! [`crate::footprint::workspace_bytes`]) — and counts every host→device and device→host copy, so the
//! offload policies run in CI with the byte accounting a GPU would show. Weights uploaded here
//! are real copies, as on a GPU. The math is the CPU backend's. Its ops run as the host asks
//! them, but an op's in-place reads cross the paced link after its math, as a CUDA kernel's
//! reads of mapped host memory do: the host goes on meanwhile (to queue a copy, say), and the
//! next op, or a read of what was computed, waits for them.

use crate::backend::{Experts, Route};
use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use super::cpu::{CpuBackend, CpuKv, CpuKvTable, CpuTensor, CpuWeight};
use super::memory::{DeviceAlloc, DeviceMemory, Workspace, check_workspace};
use super::recording::{
    outside_recording, position_unset, recordable_attention, step_position_word,
};
use super::{
    Act, AttnShape, Backend, BackendError, BundleShape, KvType, MatmulPart, Result, Rope,
    RopePairs, STEP_POSITION_BYTES, WorkspaceOp,
};
use crate::footprint::ledger::Ledger;
use crate::store::Encoding;
use crate::tensor::{Bytes, DType, HostTensor};
use link::wait_until;

pub struct SimBackend {
    cpu: CpuBackend,
    mem: DeviceMemory,
    workspace: Workspace<DeviceAlloc>,
    /// Emulated link: (bytes/s, when the last paced copy may end). Shared with the trace's clock.
    pace: Arc<Mutex<Option<(f64, Instant)>>>,
    /// When the compute stream's work queued so far ends: its in-place reads still crossing the
    /// link after the CPU has computed ([`SimBackend::stream_busy_until`]). Shared with the
    /// trace's clock.
    stream: Arc<Mutex<Option<Instant>>>,
    steps: Mutex<Steps>,
}

/// Recorded steps on the budgeted device ([`Backend::record`]): the step position and the device
/// buffer CUDA keeps it in; while a step is recorded or replayed, what each of its ops was
/// given. The ops run as always (there is no graph to launch), reading the position from the
/// step's as CUDA's recorded kernels do, and anything a CUDA graph cannot hold
/// (an allocation, a copy between host and device, a wait) fails. A replay whose ops differ
/// from its recording in anything else (a buffer, a shape, an op) fails too: CUDA would have
/// replayed the recording regardless.
#[derive(Default)]
struct Steps {
    position: Option<usize>,
    buf: Option<DeviceAlloc>,
    signing: Option<Vec<Signed>>,
    /// The ops of the last step recorded, by name ([`SimBackend::recorded_ops`]).
    last_recorded: Vec<&'static str>,
}

/// One op of a recorded step: its name and a hash of its arguments (buffers by allocation,
/// shapes, scalars; not positions).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Signed {
    op: &'static str,
    args: u64,
}

/// A step recorded on the budgeted device: its ops, signed.
pub struct SimRecording {
    ops: Vec<Signed>,
}

/// Buffers as a recording names them ([`tensor_arg`] each), then `rest`.
fn tensors_arg(tensors: &[&SimTensor], rest: &[u64]) -> Vec<u64> {
    let mut args: Vec<u64> = tensors.iter().flat_map(|t| tensor_arg(t)).collect();
    args.extend_from_slice(rest);
    args
}

/// A buffer as a recording names it: which allocation, and its shape now.
fn tensor_arg(t: &SimTensor) -> [u64; 3] {
    [t.mem.id, t.t.rows as u64, t.t.cols as u64]
}

/// Activations in the budgeted device's memory.
pub struct SimTensor {
    t: CpuTensor,
    mem: DeviceAlloc,
}

/// A weight in the budgeted device's memory.
pub struct SimWeight {
    w: CpuWeight,
    mem: DeviceAlloc,
}

/// A KV cache in the budgeted device's memory.
pub struct SimKv {
    kv: CpuKv,
    mem: DeviceAlloc,
}

/// A block table in the budgeted device's memory.
pub struct SimKvTable {
    t: CpuKvTable,
    mem: DeviceAlloc,
}

impl SimBackend {
    pub fn new(cpu: CpuBackend, ledger: Arc<Ledger>) -> Self {
        SimBackend {
            cpu,
            mem: DeviceMemory::new(ledger),
            workspace: Workspace::default(),
            pace: Arc::default(),
            stream: Arc::default(),
            steps: Mutex::new(Steps::default()),
        }
    }

    fn steps(&self) -> Result<MutexGuard<'_, Steps>> {
        self.steps
            .lock()
            .map_err(|_| BackendError::Device("recorded steps poisoned".into()))
    }

    /// Note `op` with `args` in the step being recorded or replayed, if any.
    fn sign(&self, op: &'static str, args: &[u64]) -> Result<()> {
        // Every signed op is the compute stream's: it starts once the stream's earlier work ends.
        self.stream_waits();
        let mut steps = self.steps()?;
        if let Some(ops) = steps.signing.as_mut() {
            let mut h = DefaultHasher::new();
            args.hash(&mut h);
            ops.push(Signed {
                op,
                args: h.finish(),
            });
        }
        Ok(())
    }

    /// Fail if a step is being recorded: `op` is nothing a CUDA graph holds (one of
    /// [`REFUSED_WHILE_RECORDING`](super::recording::REFUSED_WHILE_RECORDING), as on CUDA).
    /// Count what a product reads of `w` in device memory (host memory read in place is the
    /// link's, counted where it is read).
    fn read_weight(&self, w: &SimWeight) {
        if !w.mem.in_host {
            let bytes = super::reads::product(w.w.rows(), w.w.row_bytes());
            self.ledger().count_device_read(bytes);
        }
    }

    fn outside(&self, op: &'static str) -> Result<()> {
        outside_recording(op, self.steps()?.signing.is_some())
    }

    /// The position an op recorded now reads: the step's, not its argument.
    fn position(&self, arg: usize) -> Result<usize> {
        let steps = self.steps()?;
        Ok(match (&steps.signing, steps.position) {
            (Some(_), Some(pos)) => pos,
            _ => arg,
        })
    }

    /// Run `ops` signing each: what they were given, in order (their errors come first).
    fn signed<E: From<BackendError>>(
        &self,
        ops: impl FnOnce() -> std::result::Result<(), E>,
    ) -> std::result::Result<Vec<Signed>, E> {
        self.begin_signing()?;
        let ran = ops();
        let signed = self.end_signing()?;
        ran?;
        Ok(signed)
    }

    /// Start signing a step's ops (its position set).
    fn begin_signing(&self) -> Result<()> {
        let mut steps = self.steps()?;
        if steps.signing.is_some() {
            return Err(BackendError::Device(
                "a step is already being recorded".into(),
            ));
        }
        if steps.position.is_none() {
            return Err(position_unset());
        }
        steps.signing = Some(Vec::new());
        Ok(())
    }

    /// The bundle ops' activation and shape, signed beside their buffers.
    fn sign_act(&self, act: Act, threshold: f32, shape: BundleShape) -> Result<()> {
        let args = [
            act as u64,
            threshold.to_bits().into(),
            shape.parts as u64,
            shape.d as u64,
        ];
        self.sign("bundle_shape", &args)
    }

    fn end_signing(&self) -> Result<Vec<Signed>> {
        Ok(self.steps()?.signing.take().unwrap_or_default())
    }

    pub fn ledger(&self) -> &Arc<Ledger> {
        self.mem.ledger()
    }

    /// The ops of the last step recorded here, in order: one per backend call the engine made
    /// (each one kernel on CUDA, but for a quantize launch before a block-format matmul of rows
    /// wider than `footprint::workspace::QX_MAX_COLS`).
    pub fn recorded_ops(&self) -> Result<Vec<&'static str>> {
        Ok(self.steps()?.last_recorded.clone())
    }

    fn reserve(&self, bytes: usize, what: &str) -> Result<DeviceAlloc> {
        self.mem.take(bytes as u64, what)
    }

    /// Fail as the CUDA backend would when `op` needs more workspace than is held.
    fn check_workspace(&self, op: WorkspaceOp) -> Result<()> {
        check_workspace(&op, self.workspace_held())
    }

    /// The workspace CUDA takes to multiply `tokens` rows by `w` (coded bundles are no matrix:
    /// the CPU backend refuses them after this).
    fn check_matmul_workspace(&self, w: &SimWeight, tokens: usize) -> Result<()> {
        match w.w.matrix("matmul").ok().map(|m| m.t) {
            Some(t) => self.check_workspace(WorkspaceOp::Matmul {
                dtype: t.dtype,
                tokens,
                rows: t.rows,
                cols: t.cols,
            }),
            None => Ok(()),
        }
    }
}

impl Backend for SimBackend {
    type Tensor = SimTensor;
    type Weight = SimWeight;
    /// When the work it marks is done: the host computes as asked, while copies queue on the
    /// paced link as on CUDA's copy stream.
    type Event = Instant;
    type Kv = SimKv;
    type KvTable = SimKvTable;
    type Recording = SimRecording;

    fn name(&self) -> String {
        let budget = self
            .ledger()
            .hbm_budget()
            .map_or("unlimited".to_string(), |b| format!("{} MiB", b >> 20));
        format!("sim (budgeted device, {budget}) on {}", self.cpu.name())
    }

    fn enter<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.cpu.enter(f)
    }

    fn upload(&self, w: &HostTensor) -> Result<SimWeight> {
        self.outside("upload")?;
        let hold = self.reserve(w.data.len(), &w.name)?;
        let t0 = Instant::now();
        let data = Bytes::from_slice(w.data.as_slice());
        self.copied_in(w.data.len(), t0);
        Ok(SimWeight {
            w: HostTensor { data, ..w.clone() }.into(),
            mem: hold,
        })
    }

    fn upload_bundles(
        &self,
        name: &str,
        enc: Encoding,
        shape: BundleShape,
        data: &Bytes,
    ) -> Result<SimWeight> {
        self.outside("upload_bundles")?;
        // Checked (and sized) before any memory is taken; the CPU keeps a view, no copy yet.
        let rows = self.cpu.upload_bundles(name, enc, shape, data)?.rows();
        let hold = self.reserve(super::bundle_bytes(name, enc, shape, rows)?, name)?;
        let t0 = Instant::now();
        let copy = Bytes::from_slice(data.as_slice());
        self.copied_in(data.len(), t0);
        Ok(SimWeight {
            w: self.cpu.upload_bundles(name, enc, shape, &copy)?,
            mem: hold,
        })
    }

    fn alloc_bundles(
        &self,
        name: &str,
        enc: Encoding,
        shape: BundleShape,
        rows: usize,
    ) -> Result<SimWeight> {
        self.outside("alloc_bundles")?;
        let hold = self.reserve(super::bundle_bytes(name, enc, shape, rows)?, name)?;
        Ok(SimWeight {
            w: self.cpu.alloc_bundles(name, enc, shape, rows)?,
            mem: hold,
        })
    }

    fn map_bundles(
        &self,
        name: &str,
        enc: Encoding,
        shape: BundleShape,
        data: &Bytes,
    ) -> Result<SimWeight> {
        self.outside("map_bundles")?;
        super::check_mappable(name, data)?;
        Ok(SimWeight {
            w: self.cpu.map_bundles(name, enc, shape, data)?,
            mem: self.mem.in_host(name)?,
        })
    }

    fn lay_out_for_products(&self, w: &mut SimWeight) -> Result<()> {
        self.cpu.lay_out_for_products(&mut w.w)
    }

    fn pack_for_products(&self, ws: &mut [&mut SimWeight]) -> Result<()> {
        // Host bytes moved; the device memory each holds stays reserved as it was.
        let mut host: Vec<&mut CpuWeight> = ws.iter_mut().map(|w| &mut w.w).collect();
        self.cpu.pack_for_products(&mut host)
    }

    fn alloc_weight(
        &self,
        name: &str,
        dtype: DType,
        rows: usize,
        cols: usize,
    ) -> Result<SimWeight> {
        self.outside("alloc_weight")?;
        let bytes = rows.saturating_mul(dtype.bytes_for(cols));
        let hold = self.reserve(bytes, name)?;
        Ok(SimWeight {
            w: self.cpu.alloc_weight(name, dtype, rows, cols)?,
            mem: hold,
        })
    }

    fn retype_weight(
        &self,
        w: &mut SimWeight,
        dtype: DType,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        self.outside("retype_weight")?;
        self.cpu.retype_weight(&mut w.w, dtype, rows, cols)
    }

    fn upload_into(&self, dst: &mut SimWeight, first_row: usize, src: &[u8]) -> Result<()> {
        self.outside("upload_into")?;
        let t0 = Instant::now();
        self.cpu.upload_into(&mut dst.w, first_row, src)?;
        // On the copy stream: the caller waits for it by its event, as on CUDA.
        self.queue_on_link(src.len(), t0);
        Ok(())
    }

    fn host_matrix_layout(&self) -> Option<crate::backend::HostMatrixLayout> {
        self.cpu.host_matrix_layout()
    }

    fn upload_laid_out(&self, dst: &mut SimWeight, src: &[u8]) -> Result<()> {
        self.outside("upload_laid_out")?;
        let t0 = Instant::now();
        self.cpu.upload_laid_out(&mut dst.w, src)?;
        self.queue_on_link(src.len(), t0);
        Ok(())
    }

    fn copies_done(&self) -> Result<Instant> {
        self.outside("copies_done")?;
        // When the last copy queued crosses the link (now where nothing paces it).
        Ok(self.link_ends())
    }

    fn compute_done(&self) -> Result<Instant> {
        self.outside("compute_done")?;
        // The host computes as it is asked: what was queued is done once its in-place reads
        // have crossed the link.
        Ok(self.stream_ends())
    }

    fn compute_waits(&self, copied: &Instant) -> Result<()> {
        self.outside("compute_waits")?;
        wait_until(*copied);
        Ok(())
    }

    fn copies_wait(&self, ev: &Instant) -> Result<()> {
        self.outside("copies_wait")?;
        // A copy queued from now starts no earlier than now, and than the compute event (the
        // end of in-place reads still crossing).
        self.link_busy_until(*ev);
        Ok(())
    }

    fn host_waits(&self, ev: &Instant) -> Result<()> {
        self.outside("host_waits")?;
        self.ledger().count_host_wait();
        wait_until(*ev);
        Ok(())
    }

    fn pace_copies(&self, bytes_per_s: f64) -> Result<()> {
        self.outside("pace_copies")?;
        super::check_pace_rate(bytes_per_s)?;
        let mut p = self
            .pace
            .lock()
            .map_err(|_| BackendError::Device("pacer poisoned".into()))?;
        *p = Some((bytes_per_s, Instant::now()));
        Ok(())
    }

    fn alloc(&self, rows: usize, cols: usize) -> Result<SimTensor> {
        self.outside("alloc")?;
        let bytes = rows.saturating_mul(cols).saturating_mul(4);
        let hold = self.reserve(bytes, &format!("a {rows}x{cols} activation buffer"))?;
        Ok(SimTensor {
            t: self.cpu.alloc(rows, cols)?,
            mem: hold,
        })
    }

    fn write(&self, dst: &mut SimTensor, src: &[f32]) -> Result<()> {
        self.outside("write")?;
        let t0 = Instant::now();
        self.cpu.write(&mut dst.t, src)?;
        self.copied_in(std::mem::size_of_val(src), t0);
        Ok(())
    }

    fn read(&self, src: &SimTensor, dst: &mut [f32]) -> Result<()> {
        self.outside("read")?;
        self.stream_waits();
        self.cpu.read(&src.t, dst)?;
        self.ledger().count_d2h(std::mem::size_of_val(dst) as u64);
        self.ledger().count_host_wait();
        Ok(())
    }

    unsafe fn read_queued(&self, src: &SimTensor, dst: &mut [f32]) -> Result<Instant> {
        self.outside("read_queued")?;
        // The copy is done at once (the values are computed); it lands once the compute stream's
        // work ends. The wait is counted where the host waits on the event.
        self.cpu.read(&src.t, dst)?;
        self.ledger().count_d2h(std::mem::size_of_val(dst) as u64);
        Ok(self.stream_ends())
    }

    fn copy_rows(
        &self,
        src: &SimTensor,
        src_row: usize,
        dst: &mut SimTensor,
        dst_row: usize,
        n: usize,
    ) -> Result<()> {
        let (a, b) = (tensor_arg(src), tensor_arg(dst));
        self.sign(
            "copy_rows",
            &[
                a[0],
                a[1],
                a[2],
                b[0],
                b[1],
                b[2],
                src_row as u64,
                dst_row as u64,
                n as u64,
            ],
        )?;
        self.cpu.copy_rows(&src.t, src_row, &mut dst.t, dst_row, n)
    }

    fn shape(&self, t: &SimTensor) -> (usize, usize) {
        self.cpu.shape(&t.t)
    }

    fn reshape(&self, t: &mut SimTensor, rows: usize, cols: usize) -> Result<()> {
        self.sign("reshape", &[t.mem.id, rows as u64, cols as u64])?;
        self.cpu.reshape(&mut t.t, rows, cols)
    }

    /// What the CUDA backend takes for the same op.
    fn workspace_bytes(&self, op: &WorkspaceOp) -> u64 {
        crate::footprint::workspace_bytes(op)
    }

    fn set_workspace(&self, bytes: u64) -> Result<()> {
        self.outside("set_workspace")?;
        self.workspace
            .set(bytes, |b| self.mem.take(b, "device workspace"))
    }

    fn workspace_held(&self) -> u64 {
        self.workspace.held()
    }

    fn alloc_kv(&self, rows: usize, cols: usize, ty: KvType) -> Result<SimKv> {
        self.outside("alloc_kv")?;
        ty.check_cols(cols)?;
        let bytes = rows.saturating_mul(ty.row_bytes(cols));
        let hold = self.reserve(bytes, &format!("a {rows}x{cols} {} KV cache", ty.name()))?;
        Ok(SimKv {
            kv: self.cpu.alloc_kv(rows, cols, ty)?,
            mem: hold,
        })
    }

    fn kv_shape(&self, kv: &SimKv) -> (usize, usize, KvType) {
        self.cpu.kv_shape(&kv.kv)
    }

    fn alloc_kv_table(&self, blocks: usize) -> Result<SimKvTable> {
        self.outside("alloc_kv_table")?;
        let hold = self.reserve(
            blocks.saturating_mul(4),
            &format!("a KV block table of {blocks} blocks"),
        )?;
        Ok(SimKvTable {
            t: self.cpu.alloc_kv_table(blocks)?,
            mem: hold,
        })
    }

    fn write_kv_table(&self, table: &mut SimKvTable, blocks: &[u32]) -> Result<()> {
        self.outside("write_kv_table")?;
        let t0 = Instant::now();
        self.cpu.write_kv_table(&mut table.t, blocks)?;
        self.copied_in(std::mem::size_of_val(blocks), t0);
        Ok(())
    }

    fn store_kv(
        &self,
        src: &SimTensor,
        dst: &mut SimKv,
        table: Option<&SimKvTable>,
        dst_row: usize,
    ) -> Result<()> {
        let a = tensor_arg(src);
        let args = [a[0], a[1], a[2], dst.mem.id, table.map_or(0, |t| t.mem.id)];
        self.sign("store_kv", &args)?;
        let dst_row = self.position(dst_row)?;
        self.cpu
            .store_kv(&src.t, &mut dst.kv, table.map(|t| &t.t), dst_row)
    }

    fn store_kv_pair(
        &self,
        (k, v): (&SimTensor, &SimTensor),
        (kc, vc): (&mut SimKv, &mut SimKv),
        table: Option<&SimKvTable>,
        dst_row: usize,
    ) -> Result<()> {
        let t = table.map_or(0, |t| t.mem.id);
        let args = tensors_arg(&[k, v], &[kc.mem.id, vc.mem.id, t]);
        self.sign("store_kv_pair", &args)?;
        let dst_row = self.position(dst_row)?;
        let table = table.map(|t| &t.t);
        self.cpu.store_kv(&k.t, &mut kc.kv, table, dst_row)?;
        self.cpu.store_kv(&v.t, &mut vc.kv, table, dst_row)
    }

    fn rope_store_kv(
        &self,
        (q, k, v): (&mut SimTensor, &mut SimTensor, &SimTensor),
        (kc, vc): (&mut SimKv, &mut SimKv),
        table: Option<&SimKvTable>,
        dst_row: usize,
        rope: Rope<'_, SimWeight>,
    ) -> Result<()> {
        let (hd, rd, pairs, f) = (rope.head_dim, rope.rot_dims, rope.pairs, rope.inv_freq);
        let t = table.map_or(0, |t| t.mem.id);
        let rest = [
            hd as u64,
            rd as u64,
            pairs as u64,
            f.mem.id,
            kc.mem.id,
            vc.mem.id,
            t,
        ];
        self.sign("rope_store_kv", &tensors_arg(&[q, k, v], &rest))?;
        let pos = self.position(dst_row)?;
        self.cpu.rope(&mut q.t, hd, rd, pairs, &f.w, pos)?;
        self.cpu.rope(&mut k.t, hd, rd, pairs, &f.w, pos)?;
        let table = table.map(|t| &t.t);
        self.cpu.store_kv(&k.t, &mut kc.kv, table, pos)?;
        self.cpu.store_kv(&v.t, &mut vc.kv, table, pos)
    }

    fn read_kv(&self, src: &SimKv, first: usize, out: &mut [f32]) -> Result<()> {
        self.outside("read_kv")?;
        self.stream_waits();
        self.cpu.read_kv(&src.kv, first, out)?;
        self.ledger().count_host_wait();
        let rows = out.len() / src.kv.cols.max(1);
        self.ledger().count_d2h((rows * src.kv.row_bytes()) as u64);
        Ok(())
    }

    fn write_kv(&self, dst: &mut SimKv, first: usize, values: &[f32]) -> Result<()> {
        self.outside("write_kv")?;
        self.stream_waits();
        let t0 = Instant::now();
        self.cpu.write_kv(&mut dst.kv, first, values)?;
        let rows = values.len() / dst.kv.cols.max(1);
        self.copied_in(rows * dst.kv.row_bytes(), t0);
        Ok(())
    }

    fn read_kv_raw(&self, src: &SimKv, first: usize, out: &mut [u8]) -> Result<()> {
        self.outside("read_kv_raw")?;
        self.stream_waits();
        self.cpu.read_kv_raw(&src.kv, first, out)?;
        self.ledger().count_host_wait();
        self.ledger().count_d2h(out.len() as u64);
        Ok(())
    }

    fn write_kv_raw(&self, dst: &mut SimKv, first: usize, src: &[u8]) -> Result<()> {
        self.outside("write_kv_raw")?;
        self.stream_waits();
        let t0 = Instant::now();
        self.cpu.write_kv_raw(&mut dst.kv, first, src)?;
        self.copied_in(src.len(), t0);
        Ok(())
    }

    fn embed(&self, table: &SimWeight, ids: &[u32], out: &mut SimTensor) -> Result<()> {
        // The ids are copied from the host: a recorded step starts after its embedding.
        self.outside("embed")?;
        self.stream_waits();
        self.check_workspace(WorkspaceOp::Embed { tokens: ids.len() })?;
        self.cpu.embed(&table.w, ids, &mut out.t)?;
        self.ledger().count_h2d(std::mem::size_of_val(ids) as u64);
        let read = super::reads::embedding(ids.len(), table.w.row_bytes());
        self.ledger().count_device_read(read);
        Ok(())
    }

    fn add_table_rows(&self, x: &mut SimTensor, table: &SimWeight, first_row: usize) -> Result<()> {
        self.outside("add_table_rows")?;
        self.stream_waits();
        self.cpu.add_table_rows(&mut x.t, &table.w, first_row)
    }

    fn matmul_into(
        &self,
        w: &SimWeight,
        x: &SimTensor,
        out: &mut SimTensor,
        col0: usize,
    ) -> Result<()> {
        self.check_matmul_workspace(w, x.t.rows)?;
        let (a, b) = (tensor_arg(x), tensor_arg(out));
        self.sign(
            "matmul_into",
            &[w.mem.id, a[0], a[1], a[2], b[0], b[1], b[2], col0 as u64],
        )?;
        self.cpu.matmul_into(&w.w, &x.t, &mut out.t, col0)?;
        self.read_weight(w);
        Ok(())
    }

    /// As CUDA: each part takes the workspace one matmul of it takes (block formats share one
    /// quantization of `x`), signed as one op.
    fn matmul_parts(
        &self,
        x: &SimTensor,
        parts: &[MatmulPart<'_, SimWeight>],
        outs: &mut [&mut SimTensor],
    ) -> Result<()> {
        super::check_parts(parts, outs.len())?;
        let mut args = tensors_arg(&[x], &[]);
        for p in parts {
            self.check_matmul_workspace(p.w, x.t.rows)?;
            args.extend([p.w.mem.id, p.col0 as u64]);
            args.extend(tensor_arg(outs[p.out]));
        }
        self.sign("matmul_parts", &args)?;
        let cpu_parts: Vec<MatmulPart<'_, CpuWeight>> = parts
            .iter()
            .map(|p| MatmulPart {
                w: &p.w.w,
                out: p.out,
                col0: p.col0,
            })
            .collect();
        let mut cpu_outs: Vec<&mut CpuTensor> = outs.iter_mut().map(|o| &mut o.t).collect();
        self.cpu.matmul_parts(&x.t, &cpu_parts, &mut cpu_outs)?;
        parts.iter().for_each(|p| self.read_weight(p.w));
        Ok(())
    }

    fn ffn_bundles_up(
        &self,
        b: &SimWeight,
        shape: BundleShape,
        x: &SimTensor,
        act: Act,
        threshold: f32,
        up_bias: Option<&SimWeight>,
        h: &mut SimTensor,
        col0: usize,
    ) -> Result<()> {
        let (a, o) = (tensor_arg(x), tensor_arg(h));
        let bias = up_bias.map_or(0, |w| w.mem.id);
        let args = [
            b.mem.id,
            a[0],
            a[1],
            a[2],
            o[0],
            o[1],
            o[2],
            col0 as u64,
            bias,
        ];
        self.sign("ffn_bundles_up", &args)?;
        self.sign_act(act, threshold, shape)?;
        self.whole("ffn_bundles_up", b)?;
        self.cpu.ffn_bundles_up(
            &b.w,
            shape,
            &x.t,
            act,
            threshold,
            up_bias.map(|w| &w.w),
            &mut h.t,
            col0,
        )?;
        self.count_skipped(b, shape, &h.t, col0, true);
        Ok(())
    }

    fn ffn_bundles_down(
        &self,
        b: &SimWeight,
        shape: BundleShape,
        h: &SimTensor,
        col0: usize,
        out: &mut SimTensor,
    ) -> Result<()> {
        let (a, o) = (tensor_arg(h), tensor_arg(out));
        let args = [b.mem.id, a[0], a[1], a[2], o[0], o[1], o[2], col0 as u64];
        self.sign("ffn_bundles_down", &args)?;
        self.sign_act(Act::Relu, 0.0, shape)?;
        self.whole("ffn_bundles_down", b)?;
        self.cpu
            .ffn_bundles_down(&b.w, shape, &h.t, col0, &mut out.t)?;
        self.count_skipped(b, shape, &h.t, col0, false);
        Ok(())
    }

    fn ffn_bundles_up_listed_from(
        &self,
        listed: (&SimWeight, Option<&SimWeight>),
        shape: BundleShape,
        x: &SimTensor,
        act: Act,
        threshold: f32,
        up_bias: Option<&SimWeight>,
        idx: &[u32],
        h: &mut SimTensor,
    ) -> Result<()> {
        let how = (act, threshold);
        self.listed_op(
            "ffn_bundles_up_listed",
            listed,
            shape,
            x,
            how,
            up_bias,
            (idx, None),
            h,
        )
    }

    fn ffn_bundles_listed_from(
        &self,
        listed: (&SimWeight, Option<&SimWeight>),
        shape: BundleShape,
        x: &SimTensor,
        how: (Act, f32),
        up_bias: Option<&SimWeight>,
        (idx, ids): (&[u32], &[u32]),
        h: &mut SimTensor,
        out: &mut SimTensor,
    ) -> Result<()> {
        let down = Some((ids, out));
        self.listed_op(
            "ffn_bundles_listed",
            listed,
            shape,
            x,
            how,
            up_bias,
            (idx, down),
            h,
        )
    }

    fn ffn_bundles_down_listed_from(
        &self,
        listed: (&SimWeight, Option<&SimWeight>),
        shape: BundleShape,
        h: &SimTensor,
        entries: (&[u32], &[u32]),
        out: &mut SimTensor,
    ) -> Result<()> {
        self.listed_down(listed, shape, h, entries, out)
    }

    fn scatter_rows(&self, src: &SimWeight, rows: &[u32], dst: &mut SimWeight) -> Result<()> {
        self.check_workspace(WorkspaceOp::Listed {
            neurons: rows.len(),
        })?;
        self.outside("scatter_rows")?;
        self.stream_waits();
        self.cpu.scatter_rows(&src.w, rows, &mut dst.w)
    }

    fn zero(&self, x: &mut SimTensor) -> Result<()> {
        self.sign("zero", &tensor_arg(x))?;
        self.cpu.zero(&mut x.t)
    }

    fn add_bias(&self, x: &mut SimTensor, bias: &SimWeight) -> Result<()> {
        let a = tensor_arg(x);
        self.sign("add_bias", &[a[0], a[1], a[2], bias.mem.id])?;
        self.cpu.add_bias(&mut x.t, &bias.w)
    }

    fn add(&self, x: &mut SimTensor, y: &SimTensor) -> Result<()> {
        let (a, b) = (tensor_arg(x), tensor_arg(y));
        self.sign("add", &[a[0], a[1], a[2], b[0], b[1], b[2]])?;
        self.cpu.add(&mut x.t, &y.t)
    }

    fn rms_norm(&self, x: &SimTensor, w: &SimWeight, eps: f32, out: &mut SimTensor) -> Result<()> {
        let (a, b) = (tensor_arg(x), tensor_arg(out));
        let args = [
            a[0],
            a[1],
            a[2],
            w.mem.id,
            eps.to_bits().into(),
            b[0],
            b[1],
            b[2],
        ];
        self.sign("rms_norm", &args)?;
        self.cpu.rms_norm(&x.t, &w.w, eps, &mut out.t)
    }

    fn add_rms_norm(
        &self,
        x: &mut SimTensor,
        y: &SimTensor,
        w: &SimWeight,
        eps: f32,
        out: &mut SimTensor,
    ) -> Result<()> {
        let args = tensors_arg(&[x, y, out], &[w.mem.id, eps.to_bits().into()]);
        self.sign("add_rms_norm", &args)?;
        self.cpu.add(&mut x.t, &y.t)?;
        self.cpu.rms_norm(&x.t, &w.w, eps, &mut out.t)
    }

    fn layer_norm(
        &self,
        x: &SimTensor,
        w: &SimWeight,
        b: &SimWeight,
        eps: f32,
        out: &mut SimTensor,
    ) -> Result<()> {
        let (xa, o) = (tensor_arg(x), tensor_arg(out));
        let args = [
            xa[0],
            xa[1],
            xa[2],
            w.mem.id,
            b.mem.id,
            eps.to_bits().into(),
            o[0],
            o[1],
            o[2],
        ];
        self.sign("layer_norm", &args)?;
        self.cpu.layer_norm(&x.t, &w.w, &b.w, eps, &mut out.t)
    }

    fn moe_ffn(
        &self,
        experts: Experts<'_, SimWeight>,
        x: &SimTensor,
        routes: &[Route],
        act: Act,
        out: &mut SimTensor,
    ) -> Result<()> {
        let mut rest = vec![
            experts.gate.map_or(0, |g| g.mem.id),
            experts.up.mem.id,
            experts.down.mem.id,
            experts.width as u64,
            act as u64,
        ];
        rest.extend(
            routes
                .iter()
                .flat_map(|r| [r.token as u64, r.expert as u64, r.weight.to_bits().into()]),
        );
        self.sign("moe_ffn", &tensors_arg(&[x, out], &rest))?;
        // As CUDA: each expert's tokens in passes through buffers in the workspace.
        let dtype = |w: &SimWeight| w.w.as_tensor().map(|t| t.dtype);
        if let (Some(gate), Some(down)) = (
            dtype(experts.gate.unwrap_or(experts.up)),
            dtype(experts.down),
        ) {
            self.check_workspace(WorkspaceOp::Experts {
                tokens: x.t.rows,
                d_model: x.t.cols,
                width: experts.width,
                gate,
                down,
            })?;
        }
        let cpu_experts = Experts {
            gate: experts.gate.map(|g| &g.w),
            up: &experts.up.w,
            down: &experts.down.w,
            width: experts.width,
        };
        self.cpu
            .moe_ffn(cpu_experts, &x.t, routes, act, &mut out.t)?;
        let stacks: Vec<(usize, usize)> = [experts.gate, Some(experts.up), Some(experts.down)]
            .into_iter()
            .flatten()
            .map(|w| (w.w.rows(), w.w.row_bytes()))
            .collect();
        let read = super::reads::experts(routes, experts.width, &stacks);
        self.ledger().count_device_read(read);
        Ok(())
    }

    fn rms_norm_heads(
        &self,
        x: &mut SimTensor,
        w: &SimWeight,
        head_dim: usize,
        eps: f32,
    ) -> Result<()> {
        let args = tensors_arg(&[x], &[w.mem.id, head_dim as u64, eps.to_bits().into()]);
        self.sign("rms_norm_heads", &args)?;
        self.cpu.rms_norm_heads(&mut x.t, &w.w, head_dim, eps)
    }

    fn rope(
        &self,
        x: &mut SimTensor,
        head_dim: usize,
        rot_dims: usize,
        pairs: RopePairs,
        inv_freq: &SimWeight,
        first_pos: usize,
    ) -> Result<()> {
        let (hd, rd, p) = (head_dim as u64, rot_dims as u64, pairs as u64);
        self.sign("rope", &tensors_arg(&[x], &[hd, rd, p, inv_freq.mem.id]))?;
        let first_pos = self.position(first_pos)?;
        self.cpu
            .rope(&mut x.t, head_dim, rot_dims, pairs, &inv_freq.w, first_pos)
    }

    #[allow(clippy::too_many_arguments)]
    fn rope_pair(
        &self,
        q: &mut SimTensor,
        k: &mut SimTensor,
        head_dim: usize,
        rot_dims: usize,
        pairs: RopePairs,
        inv_freq: &SimWeight,
        first_pos: usize,
    ) -> Result<()> {
        let (hd, rd, p) = (head_dim as u64, rot_dims as u64, pairs as u64);
        let args = tensors_arg(&[q, k], &[hd, rd, p, inv_freq.mem.id]);
        self.sign("rope_pair", &args)?;
        let first_pos = self.position(first_pos)?;
        let f = &inv_freq.w;
        self.cpu
            .rope(&mut q.t, head_dim, rot_dims, pairs, f, first_pos)?;
        self.cpu
            .rope(&mut k.t, head_dim, rot_dims, pairs, f, first_pos)
    }

    fn activate(&self, x: &mut SimTensor, act: Act, threshold: f32) -> Result<()> {
        let a = tensor_arg(x);
        self.sign(
            "activate",
            &[a[0], a[1], a[2], act as u64, threshold.to_bits().into()],
        )?;
        self.cpu.activate(&mut x.t, act, threshold)
    }

    fn gated(&self, gate: &mut SimTensor, up: &SimTensor, act: Act, threshold: f32) -> Result<()> {
        let args = tensors_arg(&[gate, up], &[act as u64, threshold.to_bits().into()]);
        self.sign("gated", &args)?;
        self.cpu.gated(&mut gate.t, &up.t, act, threshold)
    }

    /// As CUDA: the workspace each weight's matmul takes (block formats share one quantization
    /// of `x`), signed as one op.
    fn gate_up(
        &self,
        x: &SimTensor,
        (w_gate, w_up): (&SimWeight, &SimWeight),
        (act, threshold): (Act, f32),
        gate: &mut SimTensor,
        up: &mut SimTensor,
    ) -> Result<()> {
        for w in [w_gate, w_up] {
            self.check_matmul_workspace(w, x.t.rows)?;
        }
        let rest = [
            w_gate.mem.id,
            w_up.mem.id,
            act as u64,
            threshold.to_bits().into(),
        ];
        self.sign("gate_up", &tensors_arg(&[x, gate, up], &rest))?;
        let cpu = &self.cpu;
        super::gate_then_up(
            cpu,
            &x.t,
            (&w_gate.w, &w_up.w),
            (act, threshold),
            &mut gate.t,
            &mut up.t,
        )?;
        self.read_weight(w_gate);
        self.read_weight(w_up);
        Ok(())
    }

    fn prefetch_kv(&self, k_cache: &SimKv, v_cache: &SimKv, rows: usize) {
        self.cpu.prefetch_kv(&k_cache.kv, &v_cache.kv, rows)
    }

    fn attention(
        &self,
        q: &SimTensor,
        k_cache: &SimKv,
        v_cache: &SimKv,
        table: Option<&SimKvTable>,
        first_pos: usize,
        shape: AttnShape,
        out: &mut SimTensor,
    ) -> Result<()> {
        self.check_workspace(WorkspaceOp::Attention {
            tokens: q.t.rows,
            n_heads: shape.n_heads,
            head_dim: shape.head_dim,
            kv: k_cache.kv.ty(),
        })?;
        let (a, o) = (tensor_arg(q), tensor_arg(out));
        let args = [
            a[0],
            a[1],
            a[2],
            k_cache.mem.id,
            v_cache.mem.id,
            table.map_or(0, |t| t.mem.id),
            shape.n_heads as u64,
            shape.n_kv_heads as u64,
            shape.head_dim as u64,
            shape.scale.to_bits().into(),
            o[0],
            o[1],
            o[2],
        ];
        self.sign("attention", &args)?;
        if self.steps()?.signing.is_some() {
            recordable_attention(q.t.rows)?;
        }
        let first_pos = self.position(first_pos)?;
        self.cpu.attention(
            &q.t,
            &k_cache.kv,
            &v_cache.kv,
            table.map(|t| &t.t),
            first_pos,
            shape,
            &mut out.t,
        )?;
        let read = super::reads::attention(first_pos + q.t.rows, k_cache.kv.row_bytes());
        self.ledger().count_device_read(read);
        Ok(())
    }

    fn device_clock(&self) -> Option<Arc<dyn super::clock::DeviceClock>> {
        Some(Arc::new(self.clock()))
    }

    fn records_steps(&self) -> bool {
        true
    }

    fn allocations(&self) -> u64 {
        self.mem.takes()
    }

    /// Taken and copied as CUDA does: one small buffer, the first time; the position each time.
    fn set_step_position(&self, first_pos: usize) -> Result<()> {
        self.outside("set_step_position")?;
        step_position_word(first_pos)?;
        let mut steps = self.steps()?;
        if steps.buf.is_none() {
            steps.buf = Some(self.reserve(STEP_POSITION_BYTES, "recorded step position")?);
        }
        steps.position = Some(first_pos);
        drop(steps);
        self.copied_in(STEP_POSITION_BYTES, Instant::now());
        Ok(())
    }

    fn record<E: From<BackendError>>(
        &self,
        ops: impl FnOnce() -> std::result::Result<(), E>,
    ) -> std::result::Result<SimRecording, E> {
        let ops = self.signed(ops)?;
        self.steps()?.last_recorded = ops.iter().map(|s| s.op).collect();
        Ok(SimRecording { ops })
    }

    fn replay<E: From<BackendError>>(
        &self,
        rec: &SimRecording,
        ops: impl FnOnce() -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        let signed = self.signed(ops)?;
        if signed != rec.ops {
            let at = signed
                .iter()
                .zip(&rec.ops)
                .position(|(a, b)| a != b)
                .unwrap_or(signed.len().min(rec.ops.len()));
            let name = |ops: &[Signed]| ops.get(at).map_or("nothing", |s| s.op);
            return Err(BackendError::Device(format!(
                "a replayed step is not its recording: op {at} is {} now, {} when recorded ({} \
                 ops now, {} then); a CUDA graph would have run the recording",
                name(&signed),
                name(&rec.ops),
                signed.len(),
                rec.ops.len()
            ))
            .into());
        }
        Ok(())
    }
}

#[path = "sim_bundles.rs"]
mod bundles;
#[path = "sim_link.rs"]
mod link;

#[cfg(test)]
#[path = "sim_tests.rs"]
mod tests;
