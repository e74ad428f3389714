//! The CUDA backend: cudarc with the driver loaded at run time (nothing here panics on a machine
//! without one: [`CudaBackend::new`] checks for libcuda first and returns an error).
//!
//! - Memory: every device buffer is a [`DeviceMemory`] allocation: a ledger reservation of
//!   [`device_bytes`] and, under a budget, a range of one arena allocated up front
//!   ([`CudaBackend::with_process_budget`] sizes it as `--gpu-mem` less what the context, our
//!   modules and cuBLAS hold, so the process never holds more than `--gpu-mem`). Without a budget
//!   buffers come from the compute stream's pool.
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

pub mod kernels;
mod launches;
mod meter;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::cublas::sys as blas_sys;
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig,
};

pub use meter::DeviceMeter;

use super::memory::{DeviceAlloc, DeviceMemory, Holds, Workspace};
use super::recording::{recordable_attention, step_position_word};
use super::{
    Act, AttnShape, Backend, BackendError, BundleShape, HostPin, KvType, MatmulPart, ProductInput,
    Result, Rope, RopePairs, STEP_POSITION_BYTES, WorkspaceOp,
};
use crate::footprint::attention::{
    AttentionKernel, FLASH_ROWS, MAX_HEAD_DIM, MAX_SPLITS, SPLIT_MAX_HEADS, attention_kernel,
    flash_splits, forced_flash_splits, split_chunks,
};
use crate::footprint::device_bytes;
use crate::footprint::ledger::Ledger;
use crate::footprint::workspace::{
    ACT_BLOCK_BYTES, MAX_QTOKENS, MAX_TOKENS, dequant_tile_rows, quantizes_in_blocks,
    uses_act_blocks, workspace_bytes,
};
use crate::store::Encoding;
use crate::tensor::{Bytes, DType, HostTensor};

/// Rows (warps) per matvec block (WARPS in kernels/matvec.cu, bundles.cu).
const WARPS: u32 = 8;
/// cuBLAS workspace, held for the backend's lifetime (so cuBLAS allocates nothing itself); part
/// of the fixed cost.
const BLAS_WORKSPACE: usize = 32 << 20;

/// Oldest compute capability the kernels run on (Turing, 7.5): `ldmatrix` and the integer dot
/// products, and the oldest target CUDA 13 compiles for.
pub const MIN_CAPABILITY: u32 = 75;
/// Threads per flash block (FA_THREADS in kernels/flash_attention.cu).
const FLASH_THREADS: u32 = 128;

/// Whether the kernels run on a device of compute capability `capability` (major · 10 + minor),
/// else why not.
pub fn supported_capability(capability: u32) -> Result<()> {
    if capability >= MIN_CAPABILITY {
        return Ok(());
    }
    Err(BackendError::Unavailable(format!(
        "compute capability {}.{}: the kernels need {}.{} (Turing) or newer",
        capability / 10,
        capability % 10,
        MIN_CAPABILITY / 10,
        MIN_CAPABILITY % 10
    )))
}

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

/// The workspace the largest of several products of `n` rows (`weights`, at least one) takes:
/// each alone takes no more, so one conversion of their input serves them all.
fn largest_matmul<'a>(n: usize, weights: impl Iterator<Item = &'a CudaWeight>) -> WorkspaceOp {
    weights
        .map(|w| WorkspaceOp::Matmul {
            dtype: w.dtype,
            tokens: n,
            rows: w.rows,
            cols: w.cols,
        })
        .max_by_key(workspace_bytes)
        .unwrap_or(WorkspaceOp::Matmul {
            dtype: DType::F16,
            tokens: n,
            rows: 0,
            cols: 0,
        })
}

fn dev<E: std::fmt::Debug>(e: E) -> BackendError {
    BackendError::Device(format!("{e:?}"))
}

/// Whether a CUDA driver can be loaded on this machine (without panicking when it cannot).
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the driver library.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Whether a usable CUDA device is present (without panicking where there is no driver).
pub fn device_available() -> bool {
    driver_present() && CudaContext::device_count().is_ok_and(|n| n > 0)
}

/// Device facts for `doctor` and the planner.
#[derive(Clone, Debug, serde::Serialize)]
pub struct DeviceInfo {
    pub name: String,
    pub compute_capability: (i32, i32),
    pub total_bytes: u64,
    pub free_bytes: u64,
    pub multiprocessors: i32,
}

/// One device buffer: its address, and what keeps it (a pool allocation, or an arena range).
struct DeviceBuf {
    ptr: u64,
    _pool: Option<CudaSlice<u8>>,
    mem: DeviceAlloc,
}

impl Holds for DeviceBuf {
    fn alloc(&self) -> &DeviceAlloc {
        &self.mem
    }
}

/// Activations on the device.
pub struct CudaTensor {
    buf: DeviceBuf,
    rows: usize,
    cols: usize,
    /// Values allocated (what `reshape` may use).
    capacity: usize,
}

/// A weight on the device.
pub struct CudaWeight {
    buf: DeviceBuf,
    name: String,
    dtype: DType,
    rows: usize,
    cols: usize,
    /// INT8/INT4 bundles: their encoding and part count (`dtype` is then a placeholder, and
    /// only the bundle ops take the weight).
    coded: Option<(Encoding, usize)>,
}

impl CudaWeight {
    /// Bytes of one row (one bundle, for bundles).
    fn row_bytes(&self) -> usize {
        match self.coded {
            Some((enc, parts)) => enc.row_bytes(self.cols, parts),
            None => self.dtype.bytes_for(self.cols),
        }
    }

    fn encoding(&self) -> Encoding {
        self.coded
            .map_or(Encoding::Format(self.dtype), |(enc, _)| enc)
    }

    /// Refuse coded bundles for `op`, which reads a tensor in its storage format.
    fn plain(&self, op: &'static str) -> Result<()> {
        match self.coded {
            None => Ok(()),
            Some((enc, _)) => Err(shape_err(
                op,
                format!(
                    "`{}` holds {} bundles: only the bundle ops take them",
                    self.name,
                    enc.name()
                ),
            )),
        }
    }

    /// Bytes of one bundle, once `self` is checked to hold bundles of `shape` in an encoding
    /// with kernels, and the kernel pair for it.
    fn bundles(
        &self,
        op: &'static str,
        shape: BundleShape,
    ) -> Result<(usize, (launches::BundlesUp, launches::BundlesDown))> {
        let enc = self.encoding();
        let parts_ok = self.coded.is_none_or(|(_, parts)| parts == shape.parts);
        if !parts_ok || self.cols != shape.parts * shape.d {
            return Err(shape_err(
                op,
                format!(
                    "`{}` ({} rows of {} {} values) is not {}-part bundles of {}",
                    self.name,
                    self.rows,
                    self.cols,
                    enc.name(),
                    shape.parts,
                    shape.d
                ),
            ));
        }
        let row_bytes = super::bundle_bytes(&self.name, enc, shape, 1)?;
        Ok((row_bytes, bundle_kernels(enc)))
    }
}

/// The (up, down) kernels of kernels/bundles.cu for bundles in `enc` (one `bundle_bytes` admits).
fn bundle_kernels(enc: Encoding) -> (launches::BundlesUp, launches::BundlesDown) {
    use launches as l;
    match enc {
        Encoding::Format(DType::F32) => (l::ffn_bundles_up_f32, l::ffn_bundles_down_f32),
        Encoding::Format(DType::BF16) => (l::ffn_bundles_up_bf16, l::ffn_bundles_down_bf16),
        Encoding::Int8 => (l::ffn_bundles_up_int8, l::ffn_bundles_down_int8),
        Encoding::Int4 => (l::ffn_bundles_up_int4, l::ffn_bundles_down_int4),
        // f16, and what `bundle_bytes` refuses before a kernel is picked.
        Encoding::Format(_) => (l::ffn_bundles_up_f16, l::ffn_bundles_down_f16),
    }
}

/// A KV cache on the device.
pub struct CudaKv {
    buf: DeviceBuf,
    rows: usize,
    cols: usize,
    ty: KvType,
}

/// A block table on the device, with the host's copy of its entries (checked against the cache
/// before a kernel reads through it).
pub struct CudaKvTable {
    buf: DeviceBuf,
    cap: usize,
    blocks: Vec<u32>,
}

/// The device address of an optional block table (0: the kernels read a cache's own rows).
fn table_ptr(
    op: &'static str,
    table: Option<&CudaKvTable>,
    rows: usize,
    cache_rows: usize,
) -> Result<u64> {
    match table {
        None => Ok(0),
        Some(t) => {
            super::check_kv_table(op, &t.blocks, rows, cache_rows)?;
            Ok(t.buf.ptr)
        }
    }
}

pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    compute: Arc<CudaStream>,
    copy: Arc<CudaStream>,
    blas: Option<Mutex<BlasState>>,
    mem: DeviceMemory,
    /// Base address of the arena (under a budget).
    arena: Option<u64>,
    workspace: Workspace<DeviceBuf>,
    /// `--emulate`: host→device copies paced to this many bytes/s by a stamp kernel before each
    /// copy and a wait kernel after it ([`CudaBackend::pace_before`]).
    pace: Mutex<Option<f64>>,
    /// The pacing stamps, one per stream (copy, compute); allocated with the context so they
    /// are part of the measured fixed cost.
    stamps: CudaSlice<u64>,
    /// The split attention's ticket per head (zeros; each launch leaves them at zero): with
    /// the context, as the stamps.
    tickets: CudaSlice<u32>,
    functions: Mutex<HashMap<(&'static str, &'static str), CudaFunction>>,
    modules: kernels::Modules,
    meter: Option<DeviceMeter>,
    /// Device bytes the process held once context, modules and cuBLAS were up (before any
    /// buffer), as measured; `None` where NVML could not tell.
    fixed_bytes: Option<u64>,
    /// Recorded steps: where the step position lives ([`Backend::set_step_position`]);
    /// whether the compute stream is being captured into a graph now.
    step_position: Mutex<Option<DeviceBuf>>,
    recording: std::sync::atomic::AtomicBool,
    /// `--programmatic-launch`: kernels launched with programmatic stream serialization.
    programmatic: std::sync::atomic::AtomicBool,
    /// The device's compute capability, major · 10 + minor.
    capability: u32,
    /// Its multiprocessors: with a kernel's blocks per multiprocessor, the blocks it holds at
    /// once ([`flash_splits`]).
    multiprocessors: usize,
    /// Key splits every prompt's flash attention takes (`bench attention --flash-splits`, to
    /// set a split beside none in one run); 0: as [`flash_splits`] picks.
    flash_splits_forced: std::sync::atomic::AtomicUsize,
    /// Device operations run: each launch (a cuBLAS call counts one), copy or fill within
    /// device memory, and each node of a replayed recording ([`Backend::device_ops_run`]).
    device_ops: std::sync::atomic::AtomicU64,
}

/// A recorded step: a CUDA graph, instantiated, and how many operations (nodes) it holds.
pub struct CudaRecording {
    graph: cudarc::driver::CudaGraph,
    nodes: u64,
}

// SAFETY: a graph needs its calls serialised, not a thread of its own (CUDA's graph thread-safety
// rules); the engine launches a session's recording under its pass lock, one thread at a time.
unsafe impl Send for CudaRecording {}

struct BlasState {
    handle: cudarc::cublas::CudaBlas,
    _workspace: CudaSlice<u8>,
}

/// Typed `u64` device addresses: kernel arguments with offsets computed on the host.
fn ptr_of<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    let (p, _sync) = s.device_ptr(stream);
    p
}

fn dtype_code(d: DType) -> i32 {
    match d {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
        DType::Q8_0 => 3,
        DType::Q4_0 => 4,
        DType::Q4_1 => 5,
        DType::Q5_0 => 6,
        DType::Q5_1 => 7,
        DType::Q2K => 8,
        DType::Q3K => 9,
        DType::Q4K => 10,
        DType::Q5K => 11,
        DType::Q6K => 12,
    }
}

fn pairs_code(p: RopePairs) -> i32 {
    match p {
        RopePairs::Adjacent => 0,
        RopePairs::Halves => 1,
    }
}

fn act_code(a: Act) -> i32 {
    match a {
        Act::Silu => 0,
        Act::Relu => 1,
        Act::Gelu => 2,
        Act::GeluTanh => 3,
    }
}

/// `x · wᵀ` fits columns `col0..` of `out`, and `w` is a matrix in a storage format.
fn check_matmul(w: &CudaWeight, x: &CudaTensor, out: &CudaTensor, col0: usize) -> Result<()> {
    w.plain("matmul")?;
    let (wd, xd, od) = ((w.rows, w.cols), (x.rows, x.cols), (out.rows, out.cols));
    super::check_matmul_shape(&w.name, wd, xd, od, col0)
}

/// Rows `src` fit a cache `dst` from `dst_row` (through `table`, if any); the table's address.
fn check_store(
    src: &CudaTensor,
    dst: &CudaKv,
    table: Option<&CudaKvTable>,
    dst_row: usize,
) -> Result<u64> {
    if src.cols != dst.cols || (table.is_none() && dst_row + src.rows > dst.rows) {
        return Err(shape_err(
            "store_kv",
            format!(
                "{}x{} at row {dst_row} of a {}x{} cache",
                src.rows, src.cols, dst.rows, dst.cols
            ),
        ));
    }
    table_ptr("store_kv", table, dst_row + src.rows, dst.rows)
}

/// Keys and values of the same shape fit caches of the same size and type (through `table`, if
/// any, whose address this returns).
fn check_store_pair(
    (k, v): (&CudaTensor, &CudaTensor),
    (kc, vc): (&CudaKv, &CudaKv),
    table: Option<&CudaKvTable>,
    dst_row: usize,
) -> Result<u64> {
    let tp = check_store(k, kc, table, dst_row)?;
    check_store(v, vc, table, dst_row)?;
    if (k.rows, k.cols, kc.rows, kc.ty) != (v.rows, v.cols, vc.rows, vc.ty) {
        return Err(shape_err(
            "store_kv_pair",
            format!(
                "keys {}x{} into a {} cache of {} rows, values {}x{} into a {} one of {}",
                k.rows,
                k.cols,
                kc.ty.name(),
                kc.rows,
                v.rows,
                v.cols,
                vc.ty.name(),
                vc.rows
            ),
        ));
    }
    Ok(tp)
}

/// Rotating `x` (`head_dim`-wide heads, the first `rot_dims` of each) by `inv_freq` fits.
fn check_rope(
    x: &CudaTensor,
    head_dim: usize,
    rot_dims: usize,
    inv_freq: &CudaWeight,
) -> Result<()> {
    inv_freq.plain("rope")?;
    if head_dim == 0
        || !x.cols.is_multiple_of(head_dim)
        || rot_dims > head_dim
        || !rot_dims.is_multiple_of(2)
        || inv_freq.rows * inv_freq.cols != rot_dims / 2
    {
        return Err(shape_err(
            "rope",
            format!(
                "{} columns, head dim {head_dim}, rotating {rot_dims}",
                x.cols
            ),
        ));
    }
    Ok(())
}

/// `op` takes `x` and `y` value by value (the same shape).
fn check_same_shape(op: &'static str, x: &CudaTensor, y: &CudaTensor) -> Result<()> {
    super::check_same_shape(op, (x.rows, x.cols), (y.rows, y.cols))
}

/// `x` normed by `w` (f32, one value per column) into `out` fits.
fn check_rms_norm(x: &CudaTensor, w: &CudaWeight, out: &CudaTensor) -> Result<()> {
    w.plain("rms_norm")?;
    if (x.rows, x.cols) != (out.rows, out.cols)
        || w.rows * w.cols != x.cols
        || w.dtype != DType::F32
    {
        return Err(shape_err(
            "rms_norm",
            format!("{}x{} with `{}`", x.rows, x.cols, w.name),
        ));
    }
    Ok(())
}

/// Weights one parts launch takes (MAX_PARTS in kernels/matvec.cu).
const MAX_PARTS: usize = 4;

/// One weight of a parts launch (`MatvecPart` in kernels/matvec.cu).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct MatvecPart {
    w: u64,
    out: u64,
    dtype: i32,
    rows: i32,
    stride: i32,
    col0: i32,
}

/// The weights of one parts launch, passed by value (`MatvecParts` in kernels/matvec.cu).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct MatvecParts {
    part: [MatvecPart; MAX_PARTS],
    count: i32,
}

const _: () = assert!(std::mem::size_of::<MatvecPart>() == 32);
const _: () = assert!(std::mem::size_of::<MatvecParts>() == 136);

/// How a weight of [`Backend::matmul_parts`] runs with `n` tokens: in a parts launch of block
/// formats (activation blocks shared), of f16 rows, or alone ([`Backend::matmul_into`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum PartLaunch {
    Blocks,
    F16,
    Alone,
}

/// What cuBLAS multiplies weights of a format with: the activations as they are (f32), or
/// converted to f16 (f16 weights, and block formats' f16 tiles) or to bf16.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum GemmInput {
    F32,
    F16,
    BF16,
}

fn gemm_input_kind(dtype: DType) -> GemmInput {
    match dtype {
        DType::F32 => GemmInput::F32,
        DType::BF16 => GemmInput::BF16,
        _ => GemmInput::F16,
    }
}

/// Tokens one matvec launch of `dtype` weights takes (more go through cuBLAS where it is).
fn tokens_per_matvec(dtype: DType) -> usize {
    if uses_act_blocks(dtype) {
        MAX_QTOKENS
    } else {
        MAX_TOKENS
    }
}

/// Whether rows of `cols` values in `dtype` are whole 16-byte f16 vectors (the f16 matvec).
fn f16_vectors(dtype: DType, cols: usize) -> bool {
    dtype == DType::F16 && cols.is_multiple_of(8)
}

fn part_launch(dtype: DType, cols: usize, n: usize) -> PartLaunch {
    if uses_act_blocks(dtype) && n <= MAX_QTOKENS {
        PartLaunch::Blocks
    } else if f16_vectors(dtype, cols) && n <= MAX_TOKENS {
        PartLaunch::F16
    } else {
        PartLaunch::Alone
    }
}

fn shape_err(op: &'static str, msg: String) -> BackendError {
    BackendError::Shape { op, msg }
}

fn blocks(n: usize, per: u32) -> u32 {
    (n as u64).div_ceil(per as u64).max(1) as u32
}

fn cfg(grid: u32, block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl CudaBackend {
    /// Device `ordinal` under `ledger`: its HBM budget (if any) is the arena every buffer comes
    /// from, allocated here; the context, modules and cuBLAS are outside it (see
    /// [`CudaBackend::with_process_budget`] to bound them too).
    pub fn new(ordinal: usize, ledger: Arc<Ledger>) -> Result<Self> {
        let mut me = Self::open(ordinal, ledger)?;
        me.make_arena()?;
        Ok(me)
    }

    /// Device `ordinal` with the whole process held to `gpu_mem` device bytes as the driver
    /// counts them: the context, modules and cuBLAS are brought up first and measured, and the
    /// arena gets what is left. Where NVML cannot measure, `assumed_fixed` (the hardware
    /// profile's figure) is taken. Returns the backend and its ledger (HBM budget = the arena).
    pub fn with_process_budget(
        ordinal: usize,
        gpu_mem: u64,
        dram_mem: Option<u64>,
        assumed_fixed: u64,
    ) -> Result<(Self, Arc<Ledger>)> {
        // The ledger's budget is only known once the fixed cost is: open with an unlimited one,
        // then replace it before any buffer exists.
        let mut me = Self::open(ordinal, Ledger::new(None, dram_mem))?;
        let fixed = me.fixed_bytes.unwrap_or(assumed_fixed);
        if gpu_mem <= fixed {
            return Err(BackendError::OutOfMemory {
                what: format!(
                    "--gpu-mem: the CUDA context, kernels and cuBLAS alone hold {} MiB on this device",
                    fixed >> 20
                ),
                needed: fixed as usize,
                available: gpu_mem as usize,
            });
        }
        let ledger = Ledger::new(Some(gpu_mem - fixed), dram_mem);
        me.fixed_bytes = Some(fixed);
        me.mem = DeviceMemory::new(ledger.clone());
        me.make_arena()?;
        Ok((me, ledger))
    }

    /// Context, streams, every kernel module and cuBLAS, then the fixed cost measured.
    fn open(ordinal: usize, ledger: Arc<Ledger>) -> Result<Self> {
        if !driver_present() {
            return Err(BackendError::Unavailable(
                "no CUDA driver (libcuda) on this machine".into(),
            ));
        }
        let meter = DeviceMeter::before_context(ordinal);
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| BackendError::Unavailable(format!("CUDA device {ordinal}: {e:?}")))?;
        let (major, minor) = ctx.compute_capability().map_err(dev)?;
        let capability = (major * 10 + minor) as u32;
        supported_capability(capability)?;
        let multiprocessors = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(dev)?
            .max(1) as usize;
        // Ordering between our streams is explicit (events); per-use event tracking would add
        // an event record to every kernel argument.
        // SAFETY: called before any allocation; every cross-stream use is ordered by the
        // engine's events (see Backend::copies_done / compute_waits).
        unsafe { ctx.disable_event_tracking() };
        let compute = ctx.new_stream().map_err(dev)?;
        let copy = ctx.new_stream().map_err(dev)?;
        let stamps = compute.alloc_zeros::<u64>(2).map_err(dev)?;
        let tickets = compute.alloc_zeros::<u32>(SPLIT_MAX_HEADS).map_err(dev)?;
        let mut me = CudaBackend {
            ctx,
            compute,
            copy,
            blas: None,
            mem: DeviceMemory::new(ledger),
            arena: None,
            workspace: Workspace::default(),
            pace: Mutex::new(None),
            stamps,
            tickets,
            functions: Mutex::new(HashMap::new()),
            modules: kernels::Modules::default(),
            meter,
            fixed_bytes: None,
            step_position: Mutex::new(None),
            recording: std::sync::atomic::AtomicBool::new(false),
            programmatic: std::sync::atomic::AtomicBool::new(false),
            capability,
            multiprocessors,
            flash_splits_forced: std::sync::atomic::AtomicUsize::new(0),
            device_ops: std::sync::atomic::AtomicU64::new(0),
        };
        for (name, _) in kernels::MODULES {
            me.modules.get(&me.ctx, name)?;
        }
        // SAFETY: only dlopens cuBLAS.
        if unsafe { blas_sys::is_culib_present() } {
            let handle = cudarc::cublas::CudaBlas::new(me.compute.clone()).map_err(dev)?;
            // SAFETY: uninitialised device memory handed to cuBLAS as scratch.
            let ws = unsafe { me.compute.alloc::<u8>(BLAS_WORKSPACE) }.map_err(dev)?;
            let wptr = ptr_of(&ws, &me.compute);
            // SAFETY: the workspace outlives the handle (both in BlasState).
            let st = unsafe {
                blas_sys::cublasSetWorkspace_v2(*handle.handle(), wptr as *mut _, BLAS_WORKSPACE)
            };
            if st != blas_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                return Err(BackendError::Device(format!("cublasSetWorkspace: {st:?}")));
            }
            me.blas = Some(Mutex::new(BlasState {
                handle,
                _workspace: ws,
            }));
        } else {
            tracing::warn!("cuBLAS not found: prefill runs on the matvec kernels");
        }
        me.synchronize()?;
        me.fixed_bytes = me.process_bytes();
        Ok(me)
    }

    /// Under a budget: the arena, one allocation of the whole budget.
    fn make_arena(&mut self) -> Result<()> {
        if let Some(size) = self.mem.arena_size() {
            self.bind()?;
            // SAFETY: a plain device allocation, freed in Drop after all work has finished.
            let base = unsafe { cudarc::driver::result::malloc_sync(size.max(1) as usize) }
                .map_err(|e| BackendError::OutOfMemory {
                    what: format!("the {} MiB device arena ({e:?})", size >> 20),
                    needed: size as usize,
                    available: self.info().map_or(0, |i| i.free_bytes as usize),
                })?;
            self.arena = Some(base);
        }
        Ok(())
    }

    /// Device-memory read bandwidth, bytes/s: the `read_sum` kernel over a `bytes` buffer (far
    /// beyond the caches), best of 5 timed with events. The HBM bound's denominator.
    pub fn read_bandwidth(&self, bytes: usize) -> Result<f64> {
        self.bind()?;
        let n4 = (bytes / 16).max(1);
        let blocks_n = 4 * self.info()?.multiprocessors.max(1) as u32;
        // Outside the ledger: a measurement, not a placement.
        let x = self.compute.alloc_zeros::<u8>(n4 * 16).map_err(dev)?;
        let out = self
            .compute
            .alloc_zeros::<f32>(blocks_n as usize)
            .map_err(dev)?;
        let (xp, op, n) = (
            ptr_of(&x, &self.compute),
            ptr_of(&out, &self.compute),
            n4 as i64,
        );
        let mut best = f64::MAX;
        for rep in 0..6 {
            let start = self
                .compute
                .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(dev)?;
            launches::read_sum(self.launch(cfg(blocks_n, 256)), xp, n, op)?;
            let end = self
                .compute
                .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(dev)?;
            end.synchronize().map_err(dev)?;
            // The first run warms up (module, clocks): leave it out.
            if rep > 0 {
                best = best.min(start.elapsed_ms(&end).map_err(dev)? as f64 / 1e3);
            }
        }
        Ok((n4 * 16) as f64 / best)
    }

    /// Device bytes this process holds now, from the driver (NVML); `None` where it cannot tell.
    pub fn process_bytes(&self) -> Option<u64> {
        self.meter.as_ref().and_then(|m| m.process_bytes())
    }

    /// Launch every kernel with programmatic stream serialization (`on`), or plainly: a
    /// kernel's blocks are then scheduled while the kernel before it finishes, each waiting for
    /// that grid's results before it reads or writes anything (`grid_dependency` in
    /// kernels/common.cuh), so a launch's start overlaps its predecessor's end, recorded steps'
    /// graphs included. Needs a device of compute capability 9.0 or newer and kernels built
    /// for it (PTX for compute_90, or NVRTC); elsewhere refused, and nothing changes.
    pub fn set_programmatic_launch(&self, on: bool) -> Result<()> {
        if on {
            let (major, minor) = self.ctx.compute_capability().map_err(dev)?;
            if !kernels::kernels_wait_for_grids(major) {
                return Err(BackendError::Unavailable(format!(
                    "programmatic launch needs a device of compute capability 9.0 or newer and \
                     kernels built for it: this device is {major}.{minor}, the kernels {}",
                    kernels::build_info()
                )));
            }
        }
        self.programmatic
            .store(on, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

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

    /// One kernel launched with programmatic stream serialization on the compute stream.
    fn launch_programmatic(
        &self,
        f: &CudaFunction,
        cfg: LaunchConfig,
        params: &mut [*mut std::ffi::c_void],
    ) -> Result<()> {
        use cudarc::driver::sys;
        self.bind()?;
        // SAFETY: a zeroed attribute is a valid value of the C struct; id and value set below.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.compute.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        // SAFETY: as a plain launch (launches.rs): the parameters are the kernel's, in its order
        // and types (a generated launch function's), and point at values that outlive this call; every pointer among them is a live device
        // allocation sized as the kernel indexes it. The attribute outlives the call.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                f.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(dev)
    }

    /// The fixed device cost this backend measured (context, modules, cuBLAS and its workspace)
    /// or, under [`CudaBackend::with_process_budget`], the figure it used.
    pub fn fixed_bytes(&self) -> Option<u64> {
        self.fixed_bytes
    }

    pub fn info(&self) -> Result<DeviceInfo> {
        use cudarc::driver::sys::CUdevice_attribute as A;
        let (free, total) = self.ctx.mem_get_info().map_err(dev)?;
        Ok(DeviceInfo {
            name: self.ctx.name().map_err(dev)?,
            compute_capability: self.ctx.compute_capability().map_err(dev)?,
            total_bytes: total as u64,
            free_bytes: free as u64,
            multiprocessors: self
                .ctx
                .attribute(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
                .map_err(dev)?,
        })
    }

    pub fn ledger(&self) -> &Arc<Ledger> {
        self.mem.ledger()
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub fn compute_stream(&self) -> &Arc<CudaStream> {
        &self.compute
    }

    pub fn copy_stream(&self) -> &Arc<CudaStream> {
        &self.copy
    }

    /// Wait for all queued work.
    pub fn synchronize(&self) -> Result<()> {
        self.compute.synchronize().map_err(dev)?;
        self.copy.synchronize().map_err(dev)
    }

    /// Make this device's context current on the calling thread (raw driver calls need it).
    fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(dev)
    }

    fn recording(&self) -> bool {
        self.recording.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Fail while a step is being captured: `op` is nothing a CUDA graph holds (an allocation,
    /// a copy between host and device, a wait), and would end the capture in an error.
    fn outside(&self, op: &'static str) -> Result<()> {
        super::recording::outside_recording(op, self.recording())
    }

    /// The step position's buffer: set (what a recording reads), else an error.
    fn step_position_ptr(&self) -> Result<u64> {
        let at = self
            .step_position
            .lock()
            .map_err(|_| BackendError::Device("step position poisoned".into()))?;
        at.as_ref()
            .map(|b| b.ptr)
            .ok_or_else(super::recording::position_unset)
    }

    /// While recording, the device address of the step's position (the kernels read it there
    /// at each replay); else 0, and the kernels take the position they are given.
    fn position_at(&self) -> Result<u64> {
        if !self.recording() {
            return Ok(0);
        }
        self.step_position_ptr()
    }

    /// A device buffer of [`device_bytes`]`(bytes)` for `what`: an arena range under a budget,
    /// else from the compute stream's pool. Both streams are ordered after the work queued so
    /// far, which may still touch a recycled range.
    fn take(&self, bytes: usize, what: &str) -> Result<DeviceBuf> {
        self.outside("an allocation")?;
        self.bind()?;
        let mem = self.mem.take(bytes as u64, what)?;
        let (ptr, pool) = match (self.arena, mem.offset) {
            (Some(base), Some(off)) => (base + off, None),
            _ => {
                // SAFETY: uninitialised device memory; every user writes before reading (or
                // zeroes it).
                let buf = unsafe { self.compute.alloc::<u8>(mem.bytes as usize) }.map_err(dev)?;
                (ptr_of(&buf, &self.compute), Some(buf))
            }
        };
        if self.arena.is_some() {
            let copies = self.copy.record_event(None).map_err(dev)?;
            self.compute.wait(&copies).map_err(dev)?;
        }
        let computed = self.compute.record_event(None).map_err(dev)?;
        self.copy.wait(&computed).map_err(dev)?;
        Ok(DeviceBuf {
            ptr,
            _pool: pool,
            mem,
        })
    }

    /// The held workspace, checked to hold what `op` needs; the guard keeps other threads from
    /// reusing it while this op's kernels are queued.
    /// `ids` copied into the workspace (ordered on compute): the list the listed bundle kernels
    /// read; the guard keeps the workspace while they are queued.
    fn listed(&self, ids: &[u32]) -> Result<(std::sync::MutexGuard<'_, Option<DeviceBuf>>, u64)> {
        self.outside("a neuron list")?;
        let (ws, ptr) = self.workspace_for(WorkspaceOp::Listed { neurons: ids.len() })?;
        // SAFETY: the workspace holds at least ids.len() u32 (checked); ordered on compute,
        // staged out of the pageable slice before the call returns.
        unsafe { cudarc::driver::result::memcpy_htod_async(ptr, ids, self.compute.cu_stream()) }
            .map_err(dev)?;
        Ok((ws, ptr))
    }

    /// The first half of the bundled FFN over all neurons of `b` (`list` none) or the `list.1`
    /// neurons listed at device address `list.0` (h compact from column `col0`).
    #[allow(clippy::too_many_arguments)]
    fn bundles_up(
        &self,
        b: &CudaWeight,
        shape: BundleShape,
        x: &CudaTensor,
        act: Act,
        threshold: f32,
        up_bias: Option<&CudaWeight>,
        h: &mut CudaTensor,
        col0: usize,
        list: Option<(u64, usize)>,
    ) -> Result<()> {
        let (row_bytes, (up, _)) = b.bundles("ffn_bundles_up", shape)?;
        if x.cols != shape.d || h.rows != x.rows {
            return Err(shape_err(
                "ffn_bundles_up",
                format!(
                    "x {}x{} into h {}x{} for bundles of {}",
                    x.rows, x.cols, h.rows, h.cols, shape.d
                ),
            ));
        }
        let row_bytes = row_bytes as i64;
        let count = list.map_or(b.rows, |l| l.1);
        let idx_ptr = list.map_or(0u64, |l| l.0);
        let (neurons, parts, d, kind) = (
            count as i32,
            shape.parts as i32,
            shape.d as i32,
            act_code(act),
        );
        if let Some(bb) = up_bias {
            bb.plain("ffn_bundles_up")?;
        }
        let bias = up_bias.map_or(0u64, |w| w.buf.ptr);
        let (hs, c0) = (h.cols as i32, col0 as i32);
        for t0 in (0..x.rows).step_by(MAX_TOKENS) {
            let nt = (x.rows - t0).min(MAX_TOKENS) as i32;
            let xp = x.buf.ptr + (t0 * shape.d * 4) as u64;
            let hp = h.buf.ptr + (t0 * h.cols * 4) as u64;
            up(
                self.launch(cfg(blocks(count, WARPS), WARPS * 32)),
                b.buf.ptr,
                row_bytes,
                neurons,
                parts,
                d,
                xp,
                nt,
                kind,
                threshold,
                bias,
                hp,
                hs,
                c0,
                idx_ptr,
            )?;
        }
        Ok(())
    }

    /// The second half over all neurons of `b` or the listed ones (see [`Self::bundles_up`]).
    fn bundles_down(
        &self,
        b: &CudaWeight,
        shape: BundleShape,
        h: &CudaTensor,
        col0: usize,
        out: &mut CudaTensor,
        list: Option<(u64, usize)>,
    ) -> Result<()> {
        let (row_bytes, (_, down)) = b.bundles("ffn_bundles_down", shape)?;
        if out.cols != shape.d || h.rows != out.rows {
            return Err(shape_err(
                "ffn_bundles_down",
                format!(
                    "h {}x{} into {}x{} for bundles of {}",
                    h.rows, h.cols, out.rows, out.cols, shape.d
                ),
            ));
        }
        let row_bytes = row_bytes as i64;
        let count = list.map_or(b.rows, |l| l.1);
        let idx_ptr = list.map_or(0u64, |l| l.0);
        let (neurons, parts, d) = (count as i32, shape.parts as i32, shape.d as i32);
        let (hs, c0) = (h.cols as i32, col0 as i32);
        let grid = (blocks(shape.d, 256), blocks(count, 64), 1);
        for t0 in (0..h.rows).step_by(MAX_TOKENS) {
            let nt = (h.rows - t0).min(MAX_TOKENS) as i32;
            let hp = h.buf.ptr + (t0 * h.cols * 4) as u64;
            let op = out.buf.ptr + (t0 * shape.d * 4) as u64;
            let c = LaunchConfig {
                grid_dim: grid,
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            down(
                self.launch(c),
                b.buf.ptr,
                row_bytes,
                neurons,
                parts,
                d,
                hp,
                nt,
                hs,
                c0,
                op,
                idx_ptr,
            )?;
        }
        Ok(())
    }

    fn workspace_for(
        &self,
        op: WorkspaceOp,
    ) -> Result<(std::sync::MutexGuard<'_, Option<DeviceBuf>>, u64)> {
        let need = workspace_bytes(&op);
        let ws = self.workspace.lock()?;
        let (held, ptr) = ws.as_ref().map_or((0, 0), |b| (b.mem.bytes, b.ptr));
        if need > held {
            return Err(BackendError::Workspace {
                op: format!("{op:?}"),
                needed: need,
                held,
            });
        }
        Ok((ws, ptr))
    }

    /// Launch the stamp before a host→device copy on `stream` when pacing (the `pace` rate,
    /// `--emulate`); returns the wait to launch after it.
    fn pace_before(&self, stream: &Arc<CudaStream>, slot: u64) -> Result<Option<(f64, u64)>> {
        let pace = self
            .pace
            .lock()
            .map_err(|_| BackendError::Device("pacer poisoned".into()))?;
        let Some(rate) = *pace else {
            return Ok(None);
        };
        let stamp = ptr_of(&self.stamps, stream) + 8 * slot;
        launches::pace_stamp(self.launch_on(stream, cfg(1, 1)), stamp)?;
        Ok(Some((rate, stamp)))
    }

    fn pace_after(
        &self,
        stream: &Arc<CudaStream>,
        paced: Option<(f64, u64)>,
        bytes: usize,
    ) -> Result<()> {
        if let Some((rate, stamp)) = paced {
            let ns = (bytes as f64 / rate * 1e9) as u64;
            launches::pace_wait(self.launch_on(stream, cfg(1, 1)), stamp, ns)?;
        }
        Ok(())
    }

    fn func(&self, module: &'static str, name: &'static str) -> Result<CudaFunction> {
        let mut cache = self
            .functions
            .lock()
            .map_err(|_| BackendError::Device("function cache poisoned".into()))?;
        if let Some(f) = cache.get(&(module, name)) {
            return Ok(f.clone());
        }
        let m = self.modules.get(&self.ctx, module)?;
        let f = m
            .load_function(name)
            .map_err(|e| BackendError::Device(format!("{module}.{name}: {e:?}")))?;
        cache.insert((module, name), f.clone());
        Ok(f)
    }

    /// Page-lock `len` bytes at `ptr` so copies from them are truly asynchronous; the returned
    /// guard unlocks them when dropped (drop it before freeing the memory).
    pub fn pin_host(&self, ptr: *const u8, len: usize) -> Result<PinnedRegion> {
        self.ctx.bind_to_thread().map_err(dev)?;
        // SAFETY: registers an existing host range; the caller keeps it alive while the guard is.
        let r = unsafe { cudarc::driver::sys::cuMemHostRegister_v2(ptr as *mut _, len, 0) };
        if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
            return Err(BackendError::Device(format!(
                "cuMemHostRegister of {len} bytes: {r:?}"
            )));
        }
        Ok(PinnedRegion { ptr: ptr as usize })
    }

    /// Quantize `n` rows of `cols` activations at `x` into 8-bit blocks at `out` (workspace).
    fn quantize(&self, x: u64, n: usize, cols: usize, out: u64) -> Result<()> {
        let blocks_total = n * cols / 32;
        let nb = blocks_total as i64;
        launches::quantize_q8(
            self.launch(cfg(blocks(blocks_total * 32, 256), 256)),
            x,
            nb,
            out,
        )?;
        Ok(())
    }

    /// `out[:, col0..col0+rows] = x · Wᵀ` through cuBLAS (f32 accumulation): float weights
    /// with x converted to the weight's type, block formats decoded tile by tile to f16 (x to
    /// f16). Returns false where cuBLAS is absent.
    fn gemm(
        &self,
        w: &CudaWeight,
        x: &CudaTensor,
        out: &CudaTensor,
        col0: usize,
        ws: u64,
    ) -> Result<bool> {
        if self.blas.is_none() {
            return Ok(false);
        }
        let input = self.gemm_input(x, w.dtype, ws)?;
        self.gemm_from(w, input, x, out, col0, ws)?;
        Ok(true)
    }

    /// `x` as cuBLAS multiplies it with weights of `dtype`: f32 as it is, else converted at the
    /// workspace's start (bf16 for bf16 weights, f16 for the rest); its address. Weights whose
    /// inputs are alike ([`gemm_input_kind`]) can share one conversion.
    fn gemm_input(&self, x: &CudaTensor, dtype: DType, ws: u64) -> Result<u64> {
        let convert = match gemm_input_kind(dtype) {
            GemmInput::F32 => return Ok(x.buf.ptr),
            GemmInput::F16 => launches::f32_to_f16,
            GemmInput::BF16 => launches::f32_to_bf16,
        };
        let len = (x.rows * x.cols) as i64;
        convert(
            self.launch(Self::elementwise_cfg(x.rows * x.cols)),
            x.buf.ptr,
            ws,
            len,
        )?;
        Ok(ws)
    }

    /// Whether every part of a product of `n` rows goes through cuBLAS with f16 input: what a
    /// pending norm's rows can be written as straight away.
    fn parts_take_f16_gemms(&self, n: usize, parts: &[MatmulPart<'_, CudaWeight>]) -> bool {
        self.blas.is_some()
            && !parts.is_empty()
            && parts.iter().all(|p| {
                n > tokens_per_matvec(p.w.dtype) && gemm_input_kind(p.w.dtype) == GemmInput::F16
            })
    }

    /// `x += add` (where given), then `x`'s rows normed by `w` and written as f16 at `dst` (the
    /// GEMMs' input): add_rms_norm (rms_norm) then f32_to_f16 in one launch, the same bits.
    fn rms_norm_to_f16(
        &self,
        x: &mut CudaTensor,
        add: Option<&CudaTensor>,
        w: &CudaWeight,
        eps: f32,
        dst: u64,
    ) -> Result<()> {
        let cols = x.cols as i32;
        let c = self.launch(cfg(x.rows as u32, 256));
        match add {
            Some(y) => {
                launches::add_rms_norm_f16(c, x.buf.ptr, y.buf.ptr, w.buf.ptr, eps, dst, cols)?
            }
            None => launches::rms_norm_f16(c, x.buf.ptr, w.buf.ptr, eps, dst, cols)?,
        }
        Ok(())
    }

    /// The GEMM(s) of [`CudaBackend::gemm`] over `input` ([`CudaBackend::gemm_input`] of `x`
    /// for `w`'s format): block formats' decoded tiles go after the converted input.
    fn gemm_from(
        &self,
        w: &CudaWeight,
        input: u64,
        x: &CudaTensor,
        out: &CudaTensor,
        col0: usize,
        ws: u64,
    ) -> Result<()> {
        let Some(blas) = &self.blas else {
            return Err(BackendError::Device("cuBLAS is not loaded".into()));
        };
        use blas_sys::cudaDataType as T;
        let (n, k, m) = (x.rows, x.cols, w.rows);
        let out_at = |row: usize| out.buf.ptr + 4 * (col0 + row) as u64;
        let ty = match w.dtype {
            DType::F32 => T::CUDA_R_32F,
            DType::BF16 => T::CUDA_R_16BF,
            DType::F16 => T::CUDA_R_16F,
            dtype => {
                // Workspace: [x in f16][one decoded tile], as workspace_bytes counts them.
                let tile_ptr = ws + device_bytes((n * k * 2) as u64);
                let tile_rows = dequant_tile_rows(m, k);
                let (dt, cols) = (dtype_code(dtype), k as i32);
                for r0 in (0..m).step_by(tile_rows) {
                    let rows = tile_rows.min(m - r0);
                    let (row0, nrows) = (r0 as i32, rows as i32);
                    let wp = w.buf.ptr;
                    launches::dequant_f16(
                        self.launch(cfg(blocks(rows * k / 8, 256), 256)),
                        wp,
                        dt,
                        row0,
                        nrows,
                        cols,
                        tile_ptr,
                    )?;
                    let c = out_at(r0);
                    self.gemm_call(
                        blas,
                        tile_ptr,
                        input,
                        T::CUDA_R_16F,
                        rows,
                        n,
                        k,
                        c,
                        out.cols,
                    )?;
                }
                return Ok(());
            }
        };
        self.gemm_call(blas, w.buf.ptr, input, ty, m, n, k, out_at(0), out.cols)
    }

    /// One cuBLAS GEMM: C (`m` × `n`, column-major, leading dimension `ldc`) = Aᵀ · B, where A is
    /// `m` rows of `k` values as stored (row-major) and B is `n` rows of `k` values.
    #[allow(clippy::too_many_arguments)]
    fn gemm_call(
        &self,
        blas: &Mutex<BlasState>,
        a: u64,
        b: u64,
        ty: blas_sys::cudaDataType,
        m: usize,
        n: usize,
        k: usize,
        c: u64,
        ldc: usize,
    ) -> Result<()> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        let state = blas
            .lock()
            .map_err(|_| BackendError::Device("cuBLAS handle poisoned".into()))?;
        // SAFETY: pointers are live device buffers of the shapes checked by matmul_into (the
        // weight, the workspace sized by workspace_bytes, the output's columns).
        let st = unsafe {
            blas_sys::cublasGemmEx(
                *state.handle.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                m as i32,
                n as i32,
                k as i32,
                &alpha as *const f32 as *const _,
                a as *const _,
                ty,
                k as i32,
                b as *const _,
                ty,
                k as i32,
                &beta as *const f32 as *const _,
                c as *mut _,
                blas_sys::cudaDataType::CUDA_R_32F,
                ldc as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        if st != blas_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Err(BackendError::Device(format!("cublasGemmEx: {st:?}")));
        }
        self.counted();
        Ok(())
    }

    /// One more device operation run ([`Backend::device_ops_run`]).
    fn counted(&self) {
        self.device_ops
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Elementwise launch over `n` values.
    fn elementwise_cfg(n: usize) -> LaunchConfig {
        cfg(blocks(n, 256), 256)
    }

    /// One-weight matvec `kernel` (they all take the same arguments): `w` times `n` tokens of
    /// `x_arg` (the activations as the kernel takes them) into columns `col0..` of the output at
    /// `out_p`, `stride` wide.
    fn launch_matvec(
        &self,
        kernel: launches::Matvec,
        w: &CudaWeight,
        x_arg: u64,
        n: usize,
        (out_p, stride, col0): (u64, usize, usize),
    ) -> Result<()> {
        let (dt, rows, cols) = (dtype_code(w.dtype), w.rows as i32, w.cols as i32);
        let (nt, stride, c0) = (n as i32, stride as i32, col0 as i32);
        kernel(
            self.launch(cfg(blocks(w.rows, WARPS), WARPS * 32)),
            w.buf.ptr,
            dt,
            rows,
            cols,
            x_arg,
            nt,
            out_p,
            stride,
            c0,
        )?;
        Ok(())
    }

    /// Elementwise launch over the largest of `tensors` tensors' `n` values: blockIdx.y picks
    /// the tensor (the pair kernels).
    fn pair_cfg(n: usize, tensors: u32) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (blocks(n, 256), tensors, 1),
            ..cfg(1, 256)
        }
    }

    /// The parts of `parts` that run `how`, `MAX_PARTS` per launch of `kernel` (with `x_arg`:
    /// the activations as the kernel takes them).
    fn launch_parts(
        &self,
        kernel: launches::Parts,
        x_arg: u64,
        (cols, n): (usize, usize),
        parts: &[(&CudaWeight, &CudaTensor, usize)],
    ) -> Result<()> {
        for group in parts.chunks(MAX_PARTS) {
            let mut ps = MatvecParts::default();
            let mut grid = 0u32;
            for (slot, &(w, out, col0)) in ps.part.iter_mut().zip(group) {
                *slot = MatvecPart {
                    w: w.buf.ptr,
                    out: out.buf.ptr,
                    dtype: dtype_code(w.dtype),
                    rows: w.rows as i32,
                    stride: out.cols as i32,
                    col0: col0 as i32,
                };
                grid += blocks(w.rows, WARPS);
            }
            ps.count = group.len() as i32;
            let (c, nt) = (cols as i32, n as i32);
            kernel(self.launch(cfg(grid, WARPS * 32)), ps, c, x_arg, nt)?;
        }
        Ok(())
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // Weights may be dropped after the backend: let every queued copy and kernel finish
        // first, so nothing in flight touches memory as it is freed.
        self.compute.synchronize().ok();
        self.copy.synchronize().ok();
        self.workspace.clear();
        if let Some(base) = self.arena.take()
            && self.bind().is_ok()
        {
            // Buffers still alive (dropped after the backend) only hold ledger ranges now.
            // SAFETY: allocated by make_arena; all work on it has finished (synchronized above).
            unsafe {
                cudarc::driver::result::free_sync(base).ok();
            }
        }
    }
}

/// A page-locked host range; unlocked on drop.
pub struct PinnedRegion {
    ptr: usize,
}

impl Drop for PinnedRegion {
    fn drop(&mut self) {
        // SAFETY: the range was registered by pin_host and is still allocated (guards drop
        // before their buffers).
        unsafe {
            cudarc::driver::sys::cuMemHostUnregister(self.ptr as *mut _);
        }
    }
}

impl Backend for CudaBackend {
    type Tensor = CudaTensor;
    type Weight = CudaWeight;
    type Event = CudaEvent;
    type Kv = CudaKv;
    type KvTable = CudaKvTable;
    type Recording = CudaRecording;

    fn name(&self) -> String {
        let name = self.ctx.name().unwrap_or_else(|_| "CUDA device".into());
        let budget = self
            .ledger()
            .hbm_budget()
            .map_or("whole device".to_string(), |b| {
                format!("{} MiB budget", b >> 20)
            });
        format!("cuda ({name}, {budget})")
    }

    fn upload(&self, w: &HostTensor) -> Result<CudaWeight> {
        self.bind()?;
        let mut dst = self.alloc_weight(&w.name, w.dtype, w.rows, w.cols)?;
        let bytes = w.data.as_slice();
        let paced = self.pace_before(&self.compute, 1)?;
        // SAFETY: dst holds exactly `bytes.len()` bytes; the compute stream orders the copy
        // before any kernel that reads it.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(dst.buf.ptr, bytes, self.compute.cu_stream())
        }
        .map_err(dev)?;
        self.pace_after(&self.compute, paced, bytes.len())?;
        self.compute.synchronize().map_err(dev)?;
        self.ledger().count_h2d(bytes.len() as u64);
        dst.name = w.name.clone();
        Ok(dst)
    }

    fn alloc_weight(
        &self,
        name: &str,
        dtype: DType,
        rows: usize,
        cols: usize,
    ) -> Result<CudaWeight> {
        if !cols.is_multiple_of(dtype.block_len()) {
            return Err(shape_err(
                "alloc_weight",
                format!("{cols} columns of {dtype}"),
            ));
        }
        // Filled by upload/upload_into before use; `take` orders the copy stream after the
        // allocation.
        let buf = self.take(rows * dtype.bytes_for(cols), name)?;
        Ok(CudaWeight {
            buf,
            name: name.to_string(),
            dtype,
            rows,
            cols,
            coded: None,
        })
    }

    fn upload_bundles(
        &self,
        name: &str,
        enc: Encoding,
        shape: BundleShape,
        data: &Bytes,
    ) -> Result<CudaWeight> {
        let bytes = data.as_slice();
        let rows = super::bundle_rows(name, enc, shape, bytes.len())?;
        let mut dst = self.alloc_bundles(name, enc, shape, rows)?;
        self.upload_into(&mut dst, 0, bytes)?;
        // As `upload`: the weight is usable (and `data` free) when this returns.
        self.copy.synchronize().map_err(dev)?;
        Ok(dst)
    }

    fn alloc_bundles(
        &self,
        name: &str,
        enc: Encoding,
        shape: BundleShape,
        rows: usize,
    ) -> Result<CudaWeight> {
        let bytes = super::bundle_bytes(name, enc, shape, rows)?;
        let (dtype, coded) = match enc {
            Encoding::Format(dtype) => (dtype, None),
            // The dtype of coded bundles is never read (`CudaWeight::plain` refuses them).
            Encoding::Int8 | Encoding::Int4 => (DType::F32, Some((enc, shape.parts))),
        };
        // Filled by upload_into before use; `take` orders the copy stream after the allocation.
        let buf = self.take(bytes, name)?;
        Ok(CudaWeight {
            buf,
            name: name.to_string(),
            dtype,
            rows,
            cols: shape.parts * shape.d,
            coded,
        })
    }

    fn retype_weight(
        &self,
        w: &mut CudaWeight,
        dtype: DType,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        super::retyped_bytes(&w.name, dtype, rows, cols, w.buf.mem.bytes)?;
        // A slot that held coded bundles becomes a plain tensor again.
        w.coded = None;
        w.dtype = dtype;
        w.rows = rows;
        w.cols = cols;
        Ok(())
    }

    fn upload_into(&self, dst: &mut CudaWeight, first_row: usize, src: &[u8]) -> Result<()> {
        self.outside("upload_into")?;
        self.bind()?;
        let rb = dst.row_bytes();
        let start = first_row * rb;
        if rb == 0 || !src.len().is_multiple_of(rb) || start + src.len() > dst.rows * rb {
            return Err(shape_err(
                "upload_into",
                format!(
                    "{} bytes at row {first_row} of `{}` ({} rows)",
                    src.len(),
                    dst.name,
                    dst.rows
                ),
            ));
        }
        let paced = self.pace_before(&self.copy, 0)?;
        // SAFETY: in bounds (checked); the caller keeps `src` unchanged until an event recorded
        // after this completes (Backend::upload_into's contract).
        unsafe {
            cudarc::driver::result::memcpy_htod_async(
                dst.buf.ptr + start as u64,
                src,
                self.copy.cu_stream(),
            )
        }
        .map_err(dev)?;
        self.pace_after(&self.copy, paced, src.len())?;
        self.ledger().count_h2d(src.len() as u64);
        Ok(())
    }

    fn copies_done(&self) -> Result<CudaEvent> {
        self.outside("copies_done")?;
        self.copy.record_event(None).map_err(dev)
    }

    fn compute_done(&self) -> Result<CudaEvent> {
        self.outside("compute_done")?;
        self.compute.record_event(None).map_err(dev)
    }

    fn compute_waits(&self, ev: &CudaEvent) -> Result<()> {
        self.outside("compute_waits")?;
        self.compute.wait(ev).map_err(dev)
    }

    fn copies_wait(&self, ev: &CudaEvent) -> Result<()> {
        self.outside("copies_wait")?;
        self.copy.wait(ev).map_err(dev)
    }

    fn host_waits(&self, ev: &CudaEvent) -> Result<()> {
        self.outside("host_waits")?;
        self.ledger().count_host_wait();
        ev.synchronize().map_err(dev)
    }

    fn pace_copies(&self, bytes_per_s: f64) -> Result<()> {
        if !(bytes_per_s.is_finite() && bytes_per_s > 0.0) {
            return Err(BackendError::Device(format!(
                "copy pacing needs a positive rate, not {bytes_per_s}"
            )));
        }
        let mut pace = self
            .pace
            .lock()
            .map_err(|_| BackendError::Device("pacer poisoned".into()))?;
        *pace = Some(bytes_per_s);
        Ok(())
    }

    fn pin_host(&self, bytes: &[u8]) -> Result<Option<HostPin>> {
        if bytes.is_empty() {
            return Ok(None);
        }
        Ok(Some(Box::new(CudaBackend::pin_host(
            self,
            bytes.as_ptr(),
            bytes.len(),
        )?)))
    }

    fn alloc(&self, rows: usize, cols: usize) -> Result<CudaTensor> {
        let buf = self.take(
            rows * cols * 4,
            &format!("a {rows}x{cols} activation buffer"),
        )?;
        let t = CudaTensor {
            buf,
            rows,
            cols,
            capacity: rows * cols,
        };
        // Zeroed, as the trait promises.
        // SAFETY: the whole buffer.
        unsafe {
            cudarc::driver::result::memset_d8_async(
                t.buf.ptr,
                0,
                rows * cols * 4,
                self.compute.cu_stream(),
            )
        }
        .map_err(dev)?;
        Ok(t)
    }

    fn write(&self, dst: &mut CudaTensor, src: &[f32]) -> Result<()> {
        self.outside("write")?;
        self.bind()?;
        if src.len() != dst.rows * dst.cols {
            return Err(shape_err(
                "write",
                format!("{} values into {}x{}", src.len(), dst.rows, dst.cols),
            ));
        }
        let paced = self.pace_before(&self.compute, 1)?;
        // SAFETY: sizes checked. From pageable memory the driver stages `src` before the call
        // returns (CUDA's documented behaviour for asynchronous host→device copies), so the
        // host neither waits for the device nor has to keep `src`; the copy runs in order on
        // the compute stream.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(dst.buf.ptr, src, self.compute.cu_stream())
        }
        .map_err(dev)?;
        self.pace_after(&self.compute, paced, std::mem::size_of_val(src))?;
        self.ledger().count_h2d(std::mem::size_of_val(src) as u64);
        Ok(())
    }

    fn read(&self, src: &CudaTensor, dst: &mut [f32]) -> Result<()> {
        self.outside("read")?;
        self.bind()?;
        if dst.len() != src.rows * src.cols {
            return Err(shape_err(
                "read",
                format!("{}x{} into {} values", src.rows, src.cols, dst.len()),
            ));
        }
        // SAFETY: sizes checked; the stream is synchronized before `dst` is used.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(dst, src.buf.ptr, self.compute.cu_stream())
        }
        .map_err(dev)?;
        self.compute.synchronize().map_err(dev)?;
        self.ctx.check_err().map_err(dev)?;
        self.ledger().count_d2h(std::mem::size_of_val(dst) as u64);
        self.ledger().count_host_wait();
        Ok(())
    }

    unsafe fn read_queued(&self, src: &CudaTensor, dst: &mut [f32]) -> Result<CudaEvent> {
        self.outside("read_queued")?;
        self.bind()?;
        if dst.len() != src.rows * src.cols {
            return Err(shape_err(
                "read_queued",
                format!("{}x{} into {} values", src.rows, src.cols, dst.len()),
            ));
        }
        // SAFETY: sizes checked; the caller leaves `dst` alone until the event has completed
        // (the trait's contract). Into page-locked memory (a `HostStage`) the copy is truly
        // asynchronous.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(dst, src.buf.ptr, self.compute.cu_stream())
        }
        .map_err(dev)?;
        self.ledger().count_d2h(std::mem::size_of_val(dst) as u64);
        // A blocking-sync event: the host thread sleeps on it instead of spinning, leaving its
        // core to the CPU's share of the work.
        self.compute
            .record_event(Some(
                cudarc::driver::sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC,
            ))
            .map_err(dev)
    }

    fn copy_rows(
        &self,
        src: &CudaTensor,
        src_row: usize,
        dst: &mut CudaTensor,
        dst_row: usize,
        n: usize,
    ) -> Result<()> {
        self.bind()?;
        if src.cols != dst.cols || src_row + n > src.rows || dst_row + n > dst.rows {
            return Err(shape_err(
                "copy_rows",
                format!("{n} rows from {src_row} to {dst_row}"),
            ));
        }
        let c = src.cols as u64 * 4;
        // SAFETY: both ranges in bounds (checked), ordered on the compute stream.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                dst.buf.ptr + dst_row as u64 * c,
                src.buf.ptr + src_row as u64 * c,
                n * c as usize,
                self.compute.cu_stream(),
            )
        }
        .map_err(dev)?;
        self.counted();
        Ok(())
    }

    fn shape(&self, t: &CudaTensor) -> (usize, usize) {
        (t.rows, t.cols)
    }

    fn reshape(&self, t: &mut CudaTensor, rows: usize, cols: usize) -> Result<()> {
        if rows.checked_mul(cols).is_none_or(|n| n > t.capacity) {
            return Err(shape_err(
                "reshape",
                format!("{rows}x{cols} in a buffer of {} values", t.capacity),
            ));
        }
        (t.rows, t.cols) = (rows, cols);
        Ok(())
    }

    fn workspace_bytes(&self, op: &WorkspaceOp) -> u64 {
        workspace_bytes(op)
    }

    fn set_workspace(&self, bytes: u64) -> Result<()> {
        self.outside("set_workspace")?;
        // Queued kernels still using the old one are ahead of any user of its range in stream
        // order.
        self.workspace
            .set(bytes, |b| self.take(b as usize, "device workspace"))
    }

    fn workspace_held(&self) -> u64 {
        self.workspace.held()
    }

    fn alloc_kv(&self, rows: usize, cols: usize, ty: KvType) -> Result<CudaKv> {
        ty.check_cols(cols)?;
        let bytes = rows * ty.row_bytes(cols);
        let buf = self.take(bytes, &format!("a {rows}x{cols} {} KV cache", ty.name()))?;
        // Zeroed like activations, so unwritten rows read as zeros everywhere.
        // SAFETY: the whole buffer, ordered on the compute stream.
        unsafe {
            cudarc::driver::result::memset_d8_async(buf.ptr, 0, bytes, self.compute.cu_stream())
        }
        .map_err(dev)?;
        Ok(CudaKv {
            buf,
            rows,
            cols,
            ty,
        })
    }

    fn kv_shape(&self, kv: &CudaKv) -> (usize, usize, KvType) {
        (kv.rows, kv.cols, kv.ty)
    }

    fn alloc_kv_table(&self, blocks: usize) -> Result<CudaKvTable> {
        let buf = self.take(blocks * 4, &format!("a KV block table of {blocks} blocks"))?;
        Ok(CudaKvTable {
            buf,
            cap: blocks,
            blocks: Vec::with_capacity(blocks),
        })
    }

    fn write_kv_table(&self, table: &mut CudaKvTable, blocks: &[u32]) -> Result<()> {
        self.outside("write_kv_table")?;
        self.bind()?;
        if blocks.len() > table.cap {
            return Err(shape_err(
                "write_kv_table",
                format!("{} blocks into a table of {}", blocks.len(), table.cap),
            ));
        }
        if blocks.is_empty() {
            table.blocks.clear();
            return Ok(());
        }
        // SAFETY: within the table's allocation; from pageable memory the driver stages
        // `blocks` before returning (see `write`), in order on the compute stream.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(
                table.buf.ptr,
                blocks,
                self.compute.cu_stream(),
            )
        }
        .map_err(dev)?;
        self.ledger()
            .count_h2d(std::mem::size_of_val(blocks) as u64);
        table.blocks.clear();
        table.blocks.extend_from_slice(blocks);
        Ok(())
    }

    fn store_kv(
        &self,
        src: &CudaTensor,
        dst: &mut CudaKv,
        table: Option<&CudaKvTable>,
        dst_row: usize,
    ) -> Result<()> {
        let tp = check_store(src, dst, table, dst_row)?;
        let n = src.rows * src.cols;
        let (rows, cols, dt) = (src.rows as i64, src.cols as i32, dtype_code(dst.ty.dtype()));
        let (sp, dp, first) = (src.buf.ptr, dst.buf.ptr, dst_row as i32);
        let at = self.position_at()?;
        launches::store_kv(
            self.launch(Self::elementwise_cfg(n)),
            sp,
            rows,
            cols,
            dt,
            dp,
            tp,
            first,
            at,
        )?;
        Ok(())
    }

    fn store_kv_pair(
        &self,
        (k, v): (&CudaTensor, &CudaTensor),
        (kc, vc): (&mut CudaKv, &mut CudaKv),
        table: Option<&CudaKvTable>,
        dst_row: usize,
    ) -> Result<()> {
        let tp = check_store_pair((k, v), (kc, vc), table, dst_row)?;
        let (rows, cols, dt) = (k.rows as i64, k.cols as i32, dtype_code(kc.ty.dtype()));
        let (first, at) = (dst_row as i32, self.position_at()?);
        launches::store_kv_pair(
            self.launch(Self::pair_cfg(k.rows * k.cols, 2)),
            k.buf.ptr,
            v.buf.ptr,
            rows,
            cols,
            dt,
            kc.buf.ptr,
            vc.buf.ptr,
            tp,
            first,
            at,
        )?;
        Ok(())
    }

    fn rope_store_kv(
        &self,
        (q, k, v): (&mut CudaTensor, &mut CudaTensor, &CudaTensor),
        (kc, vc): (&mut CudaKv, &mut CudaKv),
        table: Option<&CudaKvTable>,
        dst_row: usize,
        rope: Rope<'_, CudaWeight>,
    ) -> Result<()> {
        // Q8_0 rows quantize 32 values a warp: the rotation and the store stay apart.
        if !matches!(kc.ty, KvType::F32 | KvType::F16) {
            return super::rope_then_store(self, (q, k, v), (kc, vc), table, dst_row, rope);
        }
        let (hd, rd) = (rope.head_dim, rope.rot_dims);
        check_rope(q, hd, rd, rope.inv_freq)?;
        check_rope(k, hd, rd, rope.inv_freq)?;
        let tp = check_store_pair((k, v), (kc, vc), table, dst_row)?;
        if q.rows != k.rows {
            return Err(shape_err(
                "rope_store_kv",
                format!("{} query rows, {} key rows", q.rows, k.rows),
            ));
        }
        let most = (q.rows * (q.cols / hd) * (rd / 2)).max(k.rows * k.cols);
        let (qc, kvc, rows) = (q.cols as i32, k.cols as i32, q.rows as i32);
        let (hd, rd, p) = (hd as i32, rd as i32, pairs_code(rope.pairs));
        let (dt, first, at) = (
            dtype_code(kc.ty.dtype()),
            dst_row as i32,
            self.position_at()?,
        );
        launches::rope_store_kv(
            self.launch(Self::pair_cfg(most, 3)),
            q.buf.ptr,
            qc,
            k.buf.ptr,
            v.buf.ptr,
            kvc,
            rows,
            hd,
            rd,
            p,
            rope.inv_freq.buf.ptr,
            dt,
            kc.buf.ptr,
            vc.buf.ptr,
            tp,
            first,
            at,
        )?;
        Ok(())
    }

    fn read_kv(&self, src: &CudaKv, first: usize, out: &mut [f32]) -> Result<()> {
        self.outside("read_kv")?;
        self.bind()?;
        let n = out.len() / src.cols.max(1);
        if src.cols == 0 || !out.len().is_multiple_of(src.cols) || first + n > src.rows {
            return Err(shape_err(
                "read_kv",
                format!(
                    "{} values from row {first} of a {}x{} cache",
                    out.len(),
                    src.rows,
                    src.cols
                ),
            ));
        }
        let rb = src.ty.row_bytes(src.cols);
        let mut raw = vec![0u8; n * rb];
        // SAFETY: in bounds (checked); synchronized before `raw` is read.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(
                &mut raw[..],
                src.buf.ptr + (first * rb) as u64,
                self.compute.cu_stream(),
            )
        }
        .map_err(dev)?;
        self.compute.synchronize().map_err(dev)?;
        self.ledger().count_d2h(raw.len() as u64);
        self.ledger().count_host_wait();
        super::cpu::decode_rows(src.ty, &raw, src.cols, out);
        Ok(())
    }

    fn read_kv_raw(&self, src: &CudaKv, first: usize, out: &mut [u8]) -> Result<()> {
        self.outside("read_kv_raw")?;
        self.bind()?;
        let rb = src.ty.row_bytes(src.cols);
        let n = out.len() / rb.max(1);
        if rb == 0 || !out.len().is_multiple_of(rb) || first + n > src.rows {
            return Err(shape_err(
                "read_kv_raw",
                format!(
                    "{} bytes from row {first} of a {}x{} cache",
                    out.len(),
                    src.rows,
                    src.cols
                ),
            ));
        }
        // SAFETY: in bounds (checked); synchronized before `out` is read.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(
                out,
                src.buf.ptr + (first * rb) as u64,
                self.compute.cu_stream(),
            )
        }
        .map_err(dev)?;
        self.compute.synchronize().map_err(dev)?;
        self.ledger().count_d2h(out.len() as u64);
        self.ledger().count_host_wait();
        Ok(())
    }

    fn write_kv_raw(&self, dst: &mut CudaKv, first: usize, src: &[u8]) -> Result<()> {
        self.outside("write_kv_raw")?;
        self.bind()?;
        let rb = dst.ty.row_bytes(dst.cols);
        let n = src.len() / rb.max(1);
        if rb == 0 || !src.len().is_multiple_of(rb) || first + n > dst.rows {
            return Err(shape_err(
                "write_kv_raw",
                format!(
                    "{} bytes at row {first} of a {}x{} cache",
                    src.len(),
                    dst.rows,
                    dst.cols
                ),
            ));
        }
        if src.is_empty() {
            return Ok(());
        }
        let paced = self.pace_before(&self.compute, 1)?;
        // SAFETY: in bounds (checked); synchronous w.r.t. `src` (pageable).
        unsafe {
            cudarc::driver::result::memcpy_htod_async(
                dst.buf.ptr + (first * rb) as u64,
                src,
                self.compute.cu_stream(),
            )
        }
        .map_err(dev)?;
        self.pace_after(&self.compute, paced, src.len())?;
        self.compute.synchronize().map_err(dev)?;
        self.ledger().count_h2d(src.len() as u64);
        Ok(())
    }

    fn write_kv(&self, dst: &mut CudaKv, first: usize, values: &[f32]) -> Result<()> {
        self.outside("write_kv")?;
        self.bind()?;
        let n = values.len() / dst.cols.max(1);
        if dst.cols == 0 || !values.len().is_multiple_of(dst.cols) || first + n > dst.rows {
            return Err(shape_err(
                "write_kv",
                format!(
                    "{} values at row {first} of a {}x{} cache",
                    values.len(),
                    dst.rows,
                    dst.cols
                ),
            ));
        }
        // Encoded on the host with the codec the device kernel matches bit for bit.
        let raw = super::cpu::encode_rows(dst.ty, values, dst.cols);
        let rb = dst.ty.row_bytes(dst.cols);
        let paced = self.pace_before(&self.compute, 1)?;
        // SAFETY: in bounds (checked); synchronous w.r.t. `raw` (pageable).
        unsafe {
            cudarc::driver::result::memcpy_htod_async(
                dst.buf.ptr + (first * rb) as u64,
                &raw[..],
                self.compute.cu_stream(),
            )
        }
        .map_err(dev)?;
        self.pace_after(&self.compute, paced, raw.len())?;
        self.compute.synchronize().map_err(dev)?;
        self.ledger().count_h2d(raw.len() as u64);
        Ok(())
    }

    fn embed(&self, table: &CudaWeight, ids: &[u32], out: &mut CudaTensor) -> Result<()> {
        table.plain("embed")?;
        self.bind()?;
        if out.rows != ids.len() || out.cols != table.cols {
            return Err(shape_err(
                "embed",
                format!("{} ids into {}x{}", ids.len(), out.rows, out.cols),
            ));
        }
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= table.rows) {
            return Err(shape_err(
                "embed",
                format!("token id {bad} ≥ vocabulary {}", table.rows),
            ));
        }
        // The ids are copied from the host: a recorded step starts after its embedding.
        self.outside("embed")?;
        let (_ws, iptr) = self.workspace_for(WorkspaceOp::Embed { tokens: ids.len() })?;
        // SAFETY: the workspace holds at least ids.len() u32 (checked); ordered on compute.
        unsafe { cudarc::driver::result::memcpy_htod_async(iptr, ids, self.compute.cu_stream()) }
            .map_err(dev)?;
        self.ledger().count_h2d(ids.len() as u64 * 4);
        let (dt, cols) = (dtype_code(table.dtype), table.cols as i32);
        launches::embed_rows(
            self.launch(cfg(ids.len() as u32, 256)),
            table.buf.ptr,
            dt,
            cols,
            iptr,
            out.buf.ptr,
        )?;
        Ok(())
    }

    fn add_table_rows(
        &self,
        x: &mut CudaTensor,
        table: &CudaWeight,
        first_row: usize,
    ) -> Result<()> {
        self.outside("add_table_rows")?;
        table.plain("add_table_rows")?;
        if x.cols != table.cols || first_row + x.rows > table.rows {
            return Err(shape_err(
                "add_table_rows",
                format!("rows {first_row}.. of {}", table.rows),
            ));
        }
        let (dt, cols, fr) = (dtype_code(table.dtype), table.cols as i32, first_row as i32);
        launches::add_table_rows(
            self.launch(cfg(x.rows as u32, 256)),
            x.buf.ptr,
            table.buf.ptr,
            dt,
            cols,
            fr,
        )?;
        Ok(())
    }

    fn matmul_into(
        &self,
        w: &CudaWeight,
        x: &CudaTensor,
        out: &mut CudaTensor,
        col0: usize,
    ) -> Result<()> {
        check_matmul(w, x, out, col0)?;
        self.bind()?;
        let n = x.rows;
        let (_ws, ws) = self.workspace_for(WorkspaceOp::Matmul {
            dtype: w.dtype,
            tokens: n,
            rows: w.rows,
            cols: w.cols,
        })?;
        let per_launch = tokens_per_matvec(w.dtype);
        if n > per_launch && self.gemm(w, x, out, col0, ws)? {
            return Ok(());
        }
        let matvec = |kernel: launches::Matvec, x_arg: u64, t0: usize, nt: usize| {
            let out_p = out.buf.ptr + (t0 * out.cols * 4) as u64;
            self.launch_matvec(kernel, w, x_arg, nt, (out_p, out.cols, col0))
        };
        if uses_act_blocks(w.dtype) && quantizes_in_blocks(n, w.cols) {
            return matvec(launches::matvec_quant_x, x.buf.ptr, 0, 1);
        }
        if uses_act_blocks(w.dtype) {
            self.quantize(x.buf.ptr, n, w.cols, ws)?;
        }
        for t0 in (0..n).step_by(per_launch) {
            let nt = (n - t0).min(per_launch);
            if uses_act_blocks(w.dtype) {
                let xq = ws + (t0 * (w.cols / 32) * ACT_BLOCK_BYTES) as u64;
                matvec(launches::matvec_quant, xq, t0, nt)?;
            } else {
                let xp = x.buf.ptr + (t0 * w.cols * 4) as u64;
                if f16_vectors(w.dtype, w.cols) {
                    matvec(launches::matvec_f16_vec, xp, t0, nt)?;
                } else {
                    matvec(launches::matvec_float, xp, t0, nt)?;
                }
            }
        }
        Ok(())
    }

    fn matmul_parts(
        &self,
        x: &CudaTensor,
        parts: &[MatmulPart<'_, CudaWeight>],
        outs: &mut [&mut CudaTensor],
    ) -> Result<()> {
        super::check_parts(parts, outs.len())?;
        self.bind()?;
        let n = x.rows;
        for p in parts {
            check_matmul(p.w, x, outs[p.out], p.col0)?;
        }
        let how: Vec<PartLaunch> = parts
            .iter()
            .map(|p| part_launch(p.w.dtype, p.w.cols, n))
            .collect();
        // A weight alone of its kind gains nothing from a parts launch.
        let shares =
            |k: PartLaunch| k != PartLaunch::Alone && how.iter().filter(|&&h| h == k).count() > 1;
        // The rest go one by one, but those multiplied through cuBLAS (more tokens than a
        // matvec launch takes) share one conversion of x per kind of input.
        let by_gemm = |p: &MatmulPart<'_, CudaWeight>| {
            self.blas.is_some() && n > tokens_per_matvec(p.w.dtype)
        };
        for kind in [GemmInput::F32, GemmInput::F16, GemmInput::BF16] {
            let group: Vec<&MatmulPart<'_, CudaWeight>> = parts
                .iter()
                .zip(&how)
                .filter(|&(p, &h)| !shares(h) && by_gemm(p) && gemm_input_kind(p.w.dtype) == kind)
                .map(|(p, _)| p)
                .collect();
            let Some(first) = group.first() else {
                continue;
            };
            let (_ws, ws) = self.workspace_for(largest_matmul(n, group.iter().map(|p| p.w)))?;
            let input = self.gemm_input(x, first.w.dtype, ws)?;
            for p in &group {
                self.gemm_from(p.w, input, x, outs[p.out], p.col0, ws)?;
            }
        }
        for (p, &h) in parts.iter().zip(&how) {
            if !shares(h) && !by_gemm(p) {
                self.matmul_into(p.w, x, outs[p.out], p.col0)?;
            }
        }
        for (kind, kernel) in [
            (
                PartLaunch::Blocks,
                launches::matvec_quant_parts as launches::Parts,
            ),
            (PartLaunch::F16, launches::matvec_f16_parts),
        ] {
            if !shares(kind) {
                continue;
            }
            let group: Vec<(&CudaWeight, &CudaTensor, usize)> = parts
                .iter()
                .zip(&how)
                .filter(|&(_, &h)| h == kind)
                .map(|(p, _)| (p.w, &*outs[p.out], p.col0))
                .collect();
            if kind == PartLaunch::Blocks && quantizes_in_blocks(n, x.cols) {
                self.launch_parts(
                    launches::matvec_quant_parts_x,
                    x.buf.ptr,
                    (x.cols, n),
                    &group,
                )?;
            } else if kind == PartLaunch::Blocks {
                // The activations quantized once, into the workspace one matmul of them takes.
                let w = group[0].0;
                let (_ws, ws) = self.workspace_for(WorkspaceOp::Matmul {
                    dtype: w.dtype,
                    tokens: n,
                    rows: w.rows,
                    cols: w.cols,
                })?;
                self.quantize(x.buf.ptr, n, x.cols, ws)?;
                self.launch_parts(kernel, ws, (x.cols, n), &group)?;
            } else {
                self.launch_parts(kernel, x.buf.ptr, (x.cols, n), &group)?;
            }
        }
        Ok(())
    }

    fn matmul_parts_of(
        &self,
        input: ProductInput<'_, Self>,
        parts: &[MatmulPart<'_, CudaWeight>],
        outs: &mut [&mut CudaTensor],
    ) -> Result<()> {
        match input {
            // Every part through cuBLAS with f16 input: the norm writes that input, where its
            // f32 rows would be written, read back and converted.
            ProductInput::RmsNorm {
                x,
                add,
                weight,
                eps,
                out,
            } if self.parts_take_f16_gemms(x.rows, parts) => {
                super::check_parts(parts, outs.len())?;
                check_rms_norm(x, weight, out)?;
                if let Some(y) = add {
                    check_same_shape("add", x, y)?;
                }
                for p in parts {
                    check_matmul(p.w, x, outs[p.out], p.col0)?;
                }
                self.bind()?;
                let most = largest_matmul(x.rows, parts.iter().map(|p| p.w));
                let (_ws, ws) = self.workspace_for(most)?;
                self.rms_norm_to_f16(x, add, weight, eps, ws)?;
                for p in parts {
                    self.gemm_from(p.w, ws, x, outs[p.out], p.col0, ws)?;
                }
                Ok(())
            }
            input => {
                let x = input.rows(self)?;
                self.matmul_parts(x, parts, outs)
            }
        }
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
        if col0 + b.rows > h.cols {
            return Err(shape_err(
                "ffn_bundles_up",
                format!("{} neurons at {col0} into h {}x{}", b.rows, h.rows, h.cols),
            ));
        }
        self.bundles_up(b, shape, x, act, threshold, up_bias, h, col0, None)
    }

    fn ffn_bundles_down(
        &self,
        b: &CudaWeight,
        shape: BundleShape,
        h: &CudaTensor,
        col0: usize,
        out: &mut CudaTensor,
    ) -> Result<()> {
        if col0 + b.rows > h.cols {
            return Err(shape_err(
                "ffn_bundles_down",
                format!("{} neurons at {col0} of h {}x{}", b.rows, h.rows, h.cols),
            ));
        }
        self.bundles_down(b, shape, h, col0, out, None)
    }

    fn ffn_bundles_up_listed(
        &self,
        b: &CudaWeight,
        shape: BundleShape,
        x: &CudaTensor,
        act: Act,
        threshold: f32,
        up_bias: Option<&CudaWeight>,
        idx: &[u32],
        h: &mut CudaTensor,
    ) -> Result<()> {
        if idx.len() > h.cols || idx.iter().any(|&i| i as usize >= b.rows) {
            return Err(shape_err(
                "ffn_bundles_up_listed",
                format!(
                    "{} listed of {} neurons into h {}x{}",
                    idx.len(),
                    b.rows,
                    h.rows,
                    h.cols
                ),
            ));
        }
        if idx.is_empty() {
            return Ok(());
        }
        let (_ws, list) = self.listed(idx)?;
        self.bundles_up(
            b,
            shape,
            x,
            act,
            threshold,
            up_bias,
            h,
            0,
            Some((list, idx.len())),
        )
    }

    fn ffn_bundles_down_listed(
        &self,
        b: &CudaWeight,
        shape: BundleShape,
        h: &CudaTensor,
        idx: &[u32],
        out: &mut CudaTensor,
    ) -> Result<()> {
        if idx.len() > h.cols || idx.iter().any(|&i| i as usize >= b.rows) {
            return Err(shape_err(
                "ffn_bundles_down_listed",
                format!(
                    "{} listed of {} neurons, h {}x{}",
                    idx.len(),
                    b.rows,
                    h.rows,
                    h.cols
                ),
            ));
        }
        if idx.is_empty() {
            return Ok(());
        }
        let (_ws, list) = self.listed(idx)?;
        self.bundles_down(b, shape, h, 0, out, Some((list, idx.len())))
    }

    fn scatter_rows(&self, src: &CudaWeight, rows: &[u32], dst: &mut CudaWeight) -> Result<()> {
        let rb = dst.row_bytes();
        super::check_scatter(
            (&src.name, src.rows, src.row_bytes(), src.encoding()),
            (&dst.name, dst.rows, rb, dst.encoding()),
            rows,
        )?;
        if rows.is_empty() {
            return Ok(());
        }
        let (_ws, list) = self.listed(rows)?;
        let row_bytes = rb as i64;
        launches::scatter_rows(
            self.launch(cfg(rows.len() as u32, 256)),
            src.buf.ptr,
            row_bytes,
            list,
            dst.buf.ptr,
        )?;
        Ok(())
    }

    fn zero(&self, x: &mut CudaTensor) -> Result<()> {
        self.bind()?;
        // SAFETY: the whole buffer.
        unsafe {
            cudarc::driver::result::memset_d8_async(
                x.buf.ptr,
                0,
                x.rows * x.cols * 4,
                self.compute.cu_stream(),
            )
        }
        .map_err(dev)?;
        self.counted();
        Ok(())
    }

    fn add_bias(&self, x: &mut CudaTensor, bias: &CudaWeight) -> Result<()> {
        bias.plain("add_bias")?;
        if bias.dtype != DType::F32 || bias.rows * bias.cols != x.cols {
            return Err(shape_err(
                "add_bias",
                format!("`{}` for {} columns", bias.name, x.cols),
            ));
        }
        let (n, cols) = ((x.rows * x.cols) as i64, x.cols as i32);
        launches::add_bias_f32(
            self.launch(Self::elementwise_cfg(x.rows * x.cols)),
            x.buf.ptr,
            bias.buf.ptr,
            n,
            cols,
        )?;
        Ok(())
    }

    fn add(&self, x: &mut CudaTensor, y: &CudaTensor) -> Result<()> {
        check_same_shape("add", x, y)?;
        let n = (x.rows * x.cols) as i64;
        launches::add_f32(
            self.launch(Self::elementwise_cfg(x.rows * x.cols)),
            x.buf.ptr,
            y.buf.ptr,
            n,
        )?;
        Ok(())
    }

    fn rms_norm(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        eps: f32,
        out: &mut CudaTensor,
    ) -> Result<()> {
        check_rms_norm(x, w, out)?;
        let cols = x.cols as i32;
        launches::rms_norm(
            self.launch(cfg(x.rows as u32, 256)),
            x.buf.ptr,
            w.buf.ptr,
            eps,
            out.buf.ptr,
            cols,
        )?;
        Ok(())
    }

    fn add_rms_norm(
        &self,
        x: &mut CudaTensor,
        y: &CudaTensor,
        w: &CudaWeight,
        eps: f32,
        out: &mut CudaTensor,
    ) -> Result<()> {
        check_rms_norm(x, w, out)?;
        check_same_shape("add", x, y)?;
        let cols = x.cols as i32;
        launches::add_rms_norm(
            self.launch(cfg(x.rows as u32, 256)),
            x.buf.ptr,
            y.buf.ptr,
            w.buf.ptr,
            eps,
            out.buf.ptr,
            cols,
        )?;
        Ok(())
    }

    fn layer_norm(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        b: &CudaWeight,
        eps: f32,
        out: &mut CudaTensor,
    ) -> Result<()> {
        w.plain("layer_norm")?;
        b.plain("layer_norm")?;
        if (x.rows, x.cols) != (out.rows, out.cols)
            || w.rows * w.cols != x.cols
            || b.rows * b.cols != x.cols
        {
            return Err(shape_err(
                "layer_norm",
                format!("{}x{} with `{}`", x.rows, x.cols, w.name),
            ));
        }
        let cols = x.cols as i32;
        launches::layer_norm(
            self.launch(cfg(x.rows as u32, 256)),
            x.buf.ptr,
            w.buf.ptr,
            b.buf.ptr,
            eps,
            out.buf.ptr,
            cols,
        )?;
        Ok(())
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
        check_rope(x, head_dim, rot_dims, inv_freq)?;
        let total = x.rows * (x.cols / head_dim) * (rot_dims / 2);
        let (rows, cols, hd, rd) = (
            x.rows as i32,
            x.cols as i32,
            head_dim as i32,
            rot_dims as i32,
        );
        let p = pairs_code(pairs);
        let (fp, at) = (first_pos as i32, self.position_at()?);
        launches::rope(
            self.launch(Self::elementwise_cfg(total)),
            x.buf.ptr,
            rows,
            cols,
            hd,
            rd,
            p,
            inv_freq.buf.ptr,
            fp,
            at,
        )?;
        Ok(())
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
        check_rope(q, head_dim, rot_dims, inv_freq)?;
        check_rope(k, head_dim, rot_dims, inv_freq)?;
        if q.rows != k.rows {
            return Err(shape_err(
                "rope_pair",
                format!("{} query rows, {} key rows", q.rows, k.rows),
            ));
        }
        let most = q.rows * (q.cols.max(k.cols) / head_dim) * (rot_dims / 2);
        let (qc, kc, rows) = (q.cols as i32, k.cols as i32, q.rows as i32);
        let (hd, rd, p) = (head_dim as i32, rot_dims as i32, pairs_code(pairs));
        let (fp, at) = (first_pos as i32, self.position_at()?);
        launches::rope_pair(
            self.launch(Self::pair_cfg(most, 2)),
            q.buf.ptr,
            qc,
            k.buf.ptr,
            kc,
            rows,
            hd,
            rd,
            p,
            inv_freq.buf.ptr,
            fp,
            at,
        )?;
        Ok(())
    }

    fn gate_up(
        &self,
        x: &CudaTensor,
        (w_gate, w_up): (&CudaWeight, &CudaWeight),
        (act, threshold): (Act, f32),
        gate: &mut CudaTensor,
        up: &mut CudaTensor,
    ) -> Result<()> {
        check_matmul(w_gate, x, gate, 0)?;
        check_matmul(w_up, x, up, 0)?;
        check_same_shape("gate_up", gate, up)?;
        let n = x.rows;
        let how = part_launch(w_gate.dtype, w_gate.cols, n);
        // One launch where a warp can take a row of both (the same kind of matvec, the same
        // rows) and the gated product covers exactly what the two products write.
        if how == PartLaunch::Alone
            || how != part_launch(w_up.dtype, w_up.cols, n)
            || w_gate.rows != w_up.rows
            || gate.cols != w_gate.rows
        {
            return super::gate_then_up(self, x, (w_gate, w_up), (act, threshold), gate, up);
        }
        self.bind()?;
        let launch = |kernel: launches::GateUp, x_arg: u64| -> Result<()> {
            let (dg, du) = (dtype_code(w_gate.dtype), dtype_code(w_up.dtype));
            let (rows, cols, nt) = (w_gate.rows as i32, w_gate.cols as i32, n as i32);
            let (kind, stride) = (act_code(act), gate.cols as i32);
            kernel(
                self.launch(cfg(blocks(w_gate.rows, WARPS), WARPS * 32)),
                w_gate.buf.ptr,
                dg,
                w_up.buf.ptr,
                du,
                rows,
                cols,
                x_arg,
                nt,
                kind,
                threshold,
                gate.buf.ptr,
                stride,
            )
        };
        if how == PartLaunch::F16 {
            return launch(launches::matvec_f16_gate_up, x.buf.ptr);
        }
        if quantizes_in_blocks(n, x.cols) {
            return launch(launches::matvec_quant_gate_up_x, x.buf.ptr);
        }
        // The activations quantized once, into the workspace one matmul of them takes.
        let (_ws, ws) = self.workspace_for(WorkspaceOp::Matmul {
            dtype: w_gate.dtype,
            tokens: n,
            rows: w_gate.rows,
            cols: w_gate.cols,
        })?;
        self.quantize(x.buf.ptr, n, x.cols, ws)?;
        launch(launches::matvec_quant_gate_up, ws)
    }

    fn gate_up_down(
        &self,
        input: ProductInput<'_, Self>,
        (w_gate, w_up, w_down): (&CudaWeight, &CudaWeight, &CudaWeight),
        (act, threshold): (Act, f32),
        (gate, up): (&mut CudaTensor, &mut CudaTensor),
        out: &mut CudaTensor,
    ) -> Result<()> {
        let n = input.shaped_as().rows;
        // Every product through cuBLAS, down's input in f16: the gated product goes straight
        // there (gated_to_f16), where gated_f32 then the conversion would write it twice.
        let by_gemm = |w: &CudaWeight| n > tokens_per_matvec(w.dtype);
        if self.blas.is_none()
            || !(by_gemm(w_gate) && by_gemm(w_up) && by_gemm(w_down))
            || gemm_input_kind(w_down.dtype) != GemmInput::F16
        {
            let ws = (w_gate, w_up, w_down);
            let x = input.rows(self)?;
            return super::gate_up_then_down(self, x, ws, (act, threshold), (gate, up), out);
        }
        check_same_shape("gate_up_down", gate, up)?;
        check_matmul(w_down, gate, out, 0)?;
        super::gate_and_up(self, input, (w_gate, w_up), gate, up)?;
        self.bind()?;
        // The workspace down's product takes alone: its f16 input at the start, where
        // gemm_input would convert it.
        let (_ws, ws) = self.workspace_for(WorkspaceOp::Matmul {
            dtype: w_down.dtype,
            tokens: n,
            rows: w_down.rows,
            cols: w_down.cols,
        })?;
        let len = gate.rows * gate.cols;
        launches::gated_to_f16(
            self.launch(Self::elementwise_cfg(len)),
            gate.buf.ptr,
            up.buf.ptr,
            ws,
            len as i64,
            act_code(act),
            threshold,
        )?;
        self.gemm_from(w_down, ws, gate, out, 0, ws)
    }

    fn activate(&self, x: &mut CudaTensor, act: Act, threshold: f32) -> Result<()> {
        let (n, k) = ((x.rows * x.cols) as i64, act_code(act));
        launches::activate_f32(
            self.launch(Self::elementwise_cfg(x.rows * x.cols)),
            x.buf.ptr,
            n,
            k,
            threshold,
        )?;
        Ok(())
    }

    fn gated(
        &self,
        gate: &mut CudaTensor,
        up: &CudaTensor,
        act: Act,
        threshold: f32,
    ) -> Result<()> {
        check_same_shape("gated", gate, up)?;
        let (n, k) = ((gate.rows * gate.cols) as i64, act_code(act));
        launches::gated_f32(
            self.launch(Self::elementwise_cfg(gate.rows * gate.cols)),
            gate.buf.ptr,
            up.buf.ptr,
            n,
            k,
            threshold,
        )?;
        Ok(())
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
        let at = self.position_at()?;
        if at != 0 {
            recordable_attention(n)?;
        }
        let kernel = attention_kernel(n, k_cache.ty, s.n_heads, s.head_dim, self.capability);
        if kernel == AttentionKernel::Split {
            // Few rows (decode): the keys in chunks across blocks, partials in the workspace,
            // combined by each head's last block (one launch).
            let (_ws, wptr) = self.workspace_for(WorkspaceOp::Attention {
                tokens: n,
                n_heads: s.n_heads,
                head_dim: s.head_dim,
                kv: k_cache.ty,
            })?;
            // Recorded, the grid has room for the most chunks and the kernels plan them from
            // the position they read (the same plan, at every replay's position).
            let (chunks, chunk) = if at != 0 {
                ((MAX_SPLITS / n).max(1), 0)
            } else {
                split_chunks(keys, n)
            };
            let kernel = match k_cache.ty {
                KvType::F32 => launches::attention_split_f32,
                KvType::F16 => launches::attention_split_f16,
                KvType::Q8_0 => launches::attention_split_q8_0,
            };
            let c = LaunchConfig {
                grid_dim: (s.n_heads as u32, chunks as u32, 1),
                block_dim: (FLASH_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let (rows, chunk_i) = (n as i32, chunk as i32);
            let tickets = ptr_of(&self.tickets, &self.compute);
            kernel(
                self.launch(c),
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
                at,
            )?;
            return Ok(());
        }
        if kernel == AttentionKernel::Flash {
            // Prefill over an f16 or Q8_0 cache: tensor-core tiles (a Q8_0 tile decoded to f16
            // as it loads), the scores never leave the chip.
            let (_, kernel) = flash_kernel(k_cache.ty, s.head_dim);
            let (splits, chunk) =
                self.flash_splits_of(n, k_cache.ty, s.n_heads, s.head_dim, keys)?;
            // Split: the partials meet in the workspace, merged by one more launch.
            let (_ws, wptr) = if splits > 1 {
                let (ws, ptr) = self.workspace_for(WorkspaceOp::Attention {
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
                self.launch(c),
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
                    self.launch(c),
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
            return Ok(());
        }
        let kernel = match k_cache.ty {
            KvType::F32 => launches::attention_f32,
            KvType::F16 => launches::attention_f16,
            KvType::Q8_0 => launches::attention_q8_0,
        };
        kernel(
            self.launch(cfg((n * s.n_heads) as u32, 256)),
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

    fn records_steps(&self) -> bool {
        true
    }

    fn allocations(&self) -> u64 {
        self.mem.takes()
    }

    fn set_step_position(&self, first_pos: usize) -> Result<()> {
        self.outside("set_step_position")?;
        let word = step_position_word(first_pos)?;
        let mut at = self
            .step_position
            .lock()
            .map_err(|_| BackendError::Device("step position poisoned".into()))?;
        let buf = match &mut *at {
            Some(buf) => buf,
            slot => slot.insert(self.take(STEP_POSITION_BYTES, "recorded step position")?),
        };
        self.bind()?;
        // SAFETY: the buffer holds the word. From pageable memory the driver stages it before
        // returning; ordered on compute, so the step queued before this has read the last one.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(buf.ptr, &[word], self.compute.cu_stream())
        }
        .map_err(dev)?;
        self.ledger().count_h2d(STEP_POSITION_BYTES as u64);
        Ok(())
    }

    fn record<E: From<BackendError>>(
        &self,
        ops: impl FnOnce() -> std::result::Result<(), E>,
    ) -> std::result::Result<CudaRecording, E> {
        self.outside("record")?;
        self.step_position_ptr()?;
        self.bind()?;
        // Thread-local: only this thread's calls are checked against the capture (a read-ahead
        // thread copying on the other stream goes on).
        self.compute
            .begin_capture(
                cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
            .map_err(dev)?;
        self.recording
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let ran = ops();
        self.recording
            .store(false, std::sync::atomic::Ordering::SeqCst);
        // Always ended, so the stream leaves capture mode whatever the ops did.
        let graph = self
            .compute
            .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0));
        ran?;
        let graph = graph
            .map_err(dev)?
            .ok_or_else(|| BackendError::Device("a recorded step holds no work".into()))?;
        let mut nodes = 0usize;
        // SAFETY: a null node array asks only for the count, written to `nodes`.
        let r = unsafe {
            cudarc::driver::sys::cuGraphGetNodes(graph.cu_graph(), std::ptr::null_mut(), &mut nodes)
        };
        if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
            return Err(BackendError::Device(format!("cuGraphGetNodes: {r:?}")).into());
        }
        // Captured work does not run (the operations counted while capturing stand for this
        // run): this step runs now, as its replays will.
        graph.launch().map_err(dev)?;
        Ok(CudaRecording {
            graph,
            nodes: nodes as u64,
        })
    }

    fn replay<E: From<BackendError>>(
        &self,
        rec: &CudaRecording,
        _ops: impl FnOnce() -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        self.outside("replay")?;
        self.step_position_ptr()?;
        rec.graph.launch().map_err(dev)?;
        self.device_ops
            .fetch_add(rec.nodes, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    fn device_ops_run(&self) -> Option<u64> {
        Some(self.device_ops.load(std::sync::atomic::Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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

    #[test]
    fn ptx_newer_than_the_device_falls_back_to_nvrtc_or_says_how_to_build() {
        use kernels::{ModuleLoad, module_load};
        // PTX for compute_80: Ampere and newer load it; Turing compiles the source instead.
        for device in [80, 86, 90] {
            assert_eq!(
                module_load(true, Some(80), device, false).unwrap(),
                ModuleLoad::Ptx
            );
        }
        assert_eq!(
            module_load(true, Some(80), 75, true).unwrap(),
            ModuleLoad::Nvrtc
        );
        let e = module_load(true, Some(90), 86, false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("8.6") && e.contains("CUDA_COMPUTE_CAP=86") && e.contains("NVRTC"),
            "{e}"
        );
        // Sources compile for the device, where NVRTC is.
        assert_eq!(
            module_load(false, Some(80), 75, true).unwrap(),
            ModuleLoad::Nvrtc
        );
        let e = module_load(false, None, 90, false).unwrap_err().to_string();
        assert!(e.contains("NVRTC is not installed"), "{e}");
    }
}
