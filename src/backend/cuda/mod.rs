//! The CUDA backend: cudarc with the driver loaded at run time (nothing here panics on a machine
//! without one: [`CudaBackend::new`] checks for libcuda first and returns an error).
//!
//! - Memory: every device buffer is a ledger reservation in HBM (the budget is enforced where
//!   memory is taken) allocated from the stream-ordered pool of the compute stream.
//! - Streams: one compute stream for every kernel (and cuBLAS, bound to it), one copy stream for
//!   weight uploads; events order them (`copies_done` → `compute_waits`, and back).
//! - Kernels: `kernels/*.cu`, PTX built by build.rs or compiled here with NVRTC, each module
//!   loaded the first time one of its functions is asked for.
//! - Host buffers the copy stream reads from are page-locked with [`CudaBackend::pin_host`].

pub mod kernels;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::cublas::sys as blas_sys;
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig,
    PushKernelArg,
};

use super::{Act, AttnShape, Backend, BackendError, BundleShape, HostPin, Result, RopePairs};
use crate::tensor::{DType, HostTensor};
use crate::tier::ledger::{Ledger, Reservation, Tier};

/// Tokens one matvec launch handles (MAX_TOKENS in kernels/common.cuh).
const MAX_TOKENS: usize = 8;
/// Rows (warps) per matvec block (WARPS in kernels/matvec.cu, bundles.cu).
const WARPS: u32 = 8;
/// cuBLAS workspace, held for the backend's lifetime (so cuBLAS allocates nothing itself).
const BLAS_WORKSPACE: usize = 32 << 20;

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

/// Activations on the device.
pub struct CudaTensor {
    buf: CudaSlice<f32>,
    ptr: u64,
    rows: usize,
    cols: usize,
    _hold: Reservation,
}

/// A weight on the device.
pub struct CudaWeight {
    buf: CudaSlice<u8>,
    ptr: u64,
    name: String,
    dtype: DType,
    rows: usize,
    cols: usize,
    _hold: Reservation,
}

pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    compute: Arc<CudaStream>,
    copy: Arc<CudaStream>,
    blas: Option<Mutex<BlasState>>,
    ledger: Arc<Ledger>,
    functions: Mutex<HashMap<(&'static str, &'static str), CudaFunction>>,
    modules: kernels::Modules,
}

struct BlasState {
    handle: cudarc::cublas::CudaBlas,
    _workspace: CudaSlice<u8>,
    _hold: Reservation,
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

/// Launch `$f` on the compute stream with the given arguments (each a local value).
macro_rules! launch {
    ($self:expr, $f:expr, $cfg:expr, $($arg:expr),* $(,)?) => {{
        let f = $f;
        let mut b = $self.compute.launch_builder(&f);
        $( b.arg(&$arg); )*
        // SAFETY: argument types and counts match the kernel signatures in kernels/*.cu; every
        // pointer is a live device allocation sized as the kernel indexes it (checked by the
        // callers' shape checks).
        unsafe { b.launch($cfg) }.map_err(dev)?;
    }};
}

impl CudaBackend {
    /// Device `ordinal` with a ledger (its HBM budget is enforced on every allocation).
    pub fn new(ordinal: usize, ledger: Arc<Ledger>) -> Result<Self> {
        if !driver_present() {
            return Err(BackendError::Unavailable(
                "no CUDA driver (libcuda) on this machine".into(),
            ));
        }
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| BackendError::Unavailable(format!("CUDA device {ordinal}: {e:?}")))?;
        // Ordering between our streams is explicit (events); per-use event tracking would add
        // an event record to every kernel argument.
        // SAFETY: called before any allocation; every cross-stream use is ordered by the
        // engine's events (see Backend::copies_done / compute_waits).
        unsafe { ctx.disable_event_tracking() };
        let compute = ctx.new_stream().map_err(dev)?;
        let copy = ctx.new_stream().map_err(dev)?;
        let mut me = CudaBackend {
            ctx,
            compute,
            copy,
            blas: None,
            ledger,
            functions: Mutex::new(HashMap::new()),
            modules: kernels::Modules::default(),
        };
        // SAFETY: only dlopens cuBLAS.
        if unsafe { blas_sys::is_culib_present() } {
            let handle = cudarc::cublas::CudaBlas::new(me.compute.clone()).map_err(dev)?;
            let hold = me.reserve(BLAS_WORKSPACE, "cuBLAS workspace")?;
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
                _hold: hold,
            }));
        } else {
            tracing::warn!("cuBLAS not found: prefill runs on the matvec kernels");
        }
        Ok(me)
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
        &self.ledger
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

    fn reserve(&self, bytes: usize, what: &str) -> Result<Reservation> {
        self.ledger
            .reserve(Tier::Hbm, bytes as u64, what)
            .map_err(|e| BackendError::OutOfMemory {
                what: e.what,
                needed: e.needed as usize,
                available: e.available as usize,
            })
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

    fn alloc_f32(&self, n: usize, what: &str) -> Result<(CudaSlice<f32>, u64, Reservation)> {
        let hold = self.reserve(n * 4, what)?;
        // SAFETY: uninitialised f32 buffer; callers write before reading (or zero it).
        let buf = unsafe { self.compute.alloc::<f32>(n.max(1)) }.map_err(dev)?;
        let ptr = ptr_of(&buf, &self.compute);
        Ok((buf, ptr, hold))
    }

    /// A transient device buffer of `bytes` (counted while alive).
    fn scratch(&self, bytes: usize, what: &str) -> Result<(CudaSlice<u8>, u64, Reservation)> {
        let hold = self.reserve(bytes, what)?;
        // SAFETY: scratch is written by a kernel before it is read.
        let buf = unsafe { self.compute.alloc::<u8>(bytes.max(1)) }.map_err(dev)?;
        let ptr = ptr_of(&buf, &self.compute);
        Ok((buf, ptr, hold))
    }

    fn quantize(&self, x: u64, n: usize, cols: usize) -> Result<(CudaSlice<u8>, u64, Reservation)> {
        let blocks_total = n * cols / 32;
        let (buf, ptr, hold) = self.scratch(blocks_total * 44, "activation blocks")?;
        let f = self.func("elementwise", "quantize_q8")?;
        let nb = blocks_total as i64;
        launch!(
            self,
            f,
            cfg(blocks(blocks_total * 32, 256), 256),
            x,
            nb,
            ptr
        );
        Ok((buf, ptr, hold))
    }

    /// cuBLAS `out[:, col0..col0+rows] = x · Wᵀ` for float weights (x converted to the
    /// weight's type; f32 accumulation).
    fn gemm(&self, w: &CudaWeight, x: &CudaTensor, out: &CudaTensor, col0: usize) -> Result<bool> {
        let Some(blas) = &self.blas else {
            return Ok(false);
        };
        use blas_sys::cudaDataType as T;
        let (n, k, m) = (x.rows, x.cols, w.rows);
        let (atype, bptr, _conv) = match w.dtype {
            DType::F32 => (T::CUDA_R_32F, x.ptr, None),
            DType::F16 | DType::BF16 => {
                let (buf, ptr, hold) = self.scratch(n * k * 2, "activations for cuBLAS")?;
                let name = if w.dtype == DType::F16 {
                    "f32_to_f16"
                } else {
                    "f32_to_bf16"
                };
                let f = self.func("elementwise", name)?;
                let len = (n * k) as i64;
                launch!(self, f, cfg(blocks(n * k, 256), 256), x.ptr, ptr, len);
                (
                    if w.dtype == DType::F16 {
                        T::CUDA_R_16F
                    } else {
                        T::CUDA_R_16BF
                    },
                    ptr,
                    Some((buf, hold)),
                )
            }
            _ => return Ok(false),
        };
        let (alpha, beta) = (1.0f32, 0.0f32);
        let state = blas
            .lock()
            .map_err(|_| BackendError::Device("cuBLAS handle poisoned".into()))?;
        // Column-major view: C (m × n, ld = out stride) = Wᵀ-as-stored (op T of the k × m
        // matrix W) · x (k × n).
        // SAFETY: pointers are live device buffers of the shapes checked by matmul_into.
        let st = unsafe {
            blas_sys::cublasGemmEx(
                *state.handle.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                m as i32,
                n as i32,
                k as i32,
                &alpha as *const f32 as *const _,
                w.ptr as *const _,
                atype,
                k as i32,
                bptr as *const _,
                atype,
                k as i32,
                &beta as *const f32 as *const _,
                (out.ptr + 4 * col0 as u64) as *mut _,
                T::CUDA_R_32F,
                out.cols as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        if st != blas_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Err(BackendError::Device(format!("cublasGemmEx: {st:?}")));
        }
        Ok(true)
    }

    /// Elementwise launch over `n` values.
    fn elementwise_cfg(n: usize) -> LaunchConfig {
        cfg(blocks(n, 256), 256)
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // Weights may be dropped after the backend: let every queued copy and kernel finish
        // first, so nothing in flight touches memory as it is freed.
        self.compute.synchronize().ok();
        self.copy.synchronize().ok();
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

    fn name(&self) -> String {
        let name = self.ctx.name().unwrap_or_else(|_| "CUDA device".into());
        let budget = self
            .ledger
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
        // SAFETY: dst holds exactly `bytes.len()` bytes; the compute stream orders the copy
        // before any kernel that reads it.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(dst.ptr, bytes, self.compute.cu_stream())
        }
        .map_err(dev)?;
        self.compute.synchronize().map_err(dev)?;
        self.ledger.count_h2d(bytes.len() as u64);
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
        let bytes = rows * dtype.bytes_for(cols);
        let hold = self.reserve(bytes, name)?;
        // SAFETY: filled by upload/upload_into before use.
        let buf = unsafe { self.compute.alloc::<u8>(bytes.max(1)) }.map_err(dev)?;
        let ptr = ptr_of(&buf, &self.compute);
        // The allocation is ordered on the compute stream; copies into it run on the copy
        // stream, which must not get ahead of it.
        let allocated = self.compute.record_event(None).map_err(dev)?;
        self.copy.wait(&allocated).map_err(dev)?;
        Ok(CudaWeight {
            buf,
            ptr,
            name: name.to_string(),
            dtype,
            rows,
            cols,
            _hold: hold,
        })
    }

    fn upload_into(&self, dst: &mut CudaWeight, first_row: usize, src: &[u8]) -> Result<()> {
        self.bind()?;
        let rb = dst.dtype.bytes_for(dst.cols);
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
        // SAFETY: in bounds (checked); the caller keeps `src` unchanged until an event recorded
        // after this completes (Backend::upload_into's contract).
        unsafe {
            cudarc::driver::result::memcpy_htod_async(
                dst.ptr + start as u64,
                src,
                self.copy.cu_stream(),
            )
        }
        .map_err(dev)?;
        let _ = &dst.buf;
        self.ledger.count_h2d(src.len() as u64);
        Ok(())
    }

    fn copies_done(&self) -> Result<CudaEvent> {
        self.copy.record_event(None).map_err(dev)
    }

    fn compute_done(&self) -> Result<CudaEvent> {
        self.compute.record_event(None).map_err(dev)
    }

    fn compute_waits(&self, ev: &CudaEvent) -> Result<()> {
        self.compute.wait(ev).map_err(dev)
    }

    fn copies_wait(&self, ev: &CudaEvent) -> Result<()> {
        self.copy.wait(ev).map_err(dev)
    }

    fn host_waits(&self, ev: &CudaEvent) -> Result<()> {
        ev.synchronize().map_err(dev)
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
        self.bind()?;
        let (buf, ptr, hold) =
            self.alloc_f32(rows * cols, &format!("a {rows}x{cols} activation buffer"))?;
        let t = CudaTensor {
            buf,
            ptr,
            rows,
            cols,
            _hold: hold,
        };
        // Zeroed, as the trait promises.
        // SAFETY: the whole buffer.
        unsafe {
            cudarc::driver::result::memset_d8_async(
                t.ptr,
                0,
                rows * cols * 4,
                self.compute.cu_stream(),
            )
        }
        .map_err(dev)?;
        Ok(t)
    }

    fn write(&self, dst: &mut CudaTensor, src: &[f32]) -> Result<()> {
        self.bind()?;
        if src.len() != dst.rows * dst.cols {
            return Err(shape_err(
                "write",
                format!("{} values into {}x{}", src.len(), dst.rows, dst.cols),
            ));
        }
        // SAFETY: sizes checked; synchronous w.r.t. `src` (pageable) then ordered on compute.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(dst.ptr, src, self.compute.cu_stream())
        }
        .map_err(dev)?;
        self.compute.synchronize().map_err(dev)?;
        self.ledger.count_h2d(std::mem::size_of_val(src) as u64);
        Ok(())
    }

    fn read(&self, src: &CudaTensor, dst: &mut [f32]) -> Result<()> {
        self.bind()?;
        if dst.len() != src.rows * src.cols {
            return Err(shape_err(
                "read",
                format!("{}x{} into {} values", src.rows, src.cols, dst.len()),
            ));
        }
        // SAFETY: sizes checked; the stream is synchronized before `dst` is used.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(dst, src.ptr, self.compute.cu_stream())
        }
        .map_err(dev)?;
        self.compute.synchronize().map_err(dev)?;
        self.ctx.check_err().map_err(dev)?;
        self.ledger.count_d2h(std::mem::size_of_val(dst) as u64);
        Ok(())
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
                dst.ptr + dst_row as u64 * c,
                src.ptr + src_row as u64 * c,
                n * c as usize,
                self.compute.cu_stream(),
            )
        }
        .map_err(dev)
    }

    fn shape(&self, t: &CudaTensor) -> (usize, usize) {
        (t.rows, t.cols)
    }

    fn embed(&self, table: &CudaWeight, ids: &[u32], out: &mut CudaTensor) -> Result<()> {
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
        let (ibuf, iptr, _hold) = self.scratch(ids.len() * 4, "token ids")?;
        // SAFETY: the buffer holds ids.len() u32.
        unsafe { cudarc::driver::result::memcpy_htod_async(iptr, ids, self.compute.cu_stream()) }
            .map_err(dev)?;
        self.ledger.count_h2d(ids.len() as u64 * 4);
        let f = self.func("elementwise", "embed_rows")?;
        let (dt, cols) = (dtype_code(table.dtype), table.cols as i32);
        launch!(
            self,
            f,
            cfg(ids.len() as u32, 256),
            table.ptr,
            dt,
            cols,
            iptr,
            out.ptr
        );
        // The ids buffer is freed in stream order after the kernel.
        drop(ibuf);
        Ok(())
    }

    fn add_table_rows(
        &self,
        x: &mut CudaTensor,
        table: &CudaWeight,
        first_row: usize,
    ) -> Result<()> {
        if x.cols != table.cols || first_row + x.rows > table.rows {
            return Err(shape_err(
                "add_table_rows",
                format!("rows {first_row}.. of {}", table.rows),
            ));
        }
        let f = self.func("elementwise", "add_table_rows")?;
        let (dt, cols, fr) = (dtype_code(table.dtype), table.cols as i32, first_row as i32);
        launch!(
            self,
            f,
            cfg(x.rows as u32, 256),
            x.ptr,
            table.ptr,
            dt,
            cols,
            fr
        );
        Ok(())
    }

    fn matmul_into(
        &self,
        w: &CudaWeight,
        x: &CudaTensor,
        out: &mut CudaTensor,
        col0: usize,
    ) -> Result<()> {
        self.bind()?;
        if x.cols != w.cols || out.rows != x.rows || col0 + w.rows > out.cols {
            return Err(shape_err(
                "matmul",
                format!(
                    "{}x{} · ({}: {}x{})ᵀ into columns {col0}.. of {}x{}",
                    x.rows, x.cols, w.name, w.rows, w.cols, out.rows, out.cols
                ),
            ));
        }
        let n = x.rows;
        if n > MAX_TOKENS && self.gemm(w, x, out, col0)? {
            return Ok(());
        }
        let (rows, cols, stride, c0) = (w.rows as i32, w.cols as i32, out.cols as i32, col0 as i32);
        let grid = blocks(w.rows, WARPS);
        let quant = w.dtype.is_quantized();
        let q = if quant {
            Some(self.quantize(x.ptr, n, w.cols)?)
        } else {
            None
        };
        for t0 in (0..n).step_by(MAX_TOKENS) {
            let nt = (n - t0).min(MAX_TOKENS) as i32;
            let out_p = out.ptr + (t0 * out.cols * 4) as u64;
            match &q {
                Some((_, qptr, _)) => {
                    let f = self.func("matvec", "matvec_quant")?;
                    let xq = qptr + (t0 * (w.cols / 32) * 44) as u64;
                    let dt = dtype_code(w.dtype);
                    launch!(
                        self,
                        f,
                        cfg(grid, WARPS * 32),
                        w.ptr,
                        dt,
                        rows,
                        cols,
                        xq,
                        nt,
                        out_p,
                        stride,
                        c0
                    );
                }
                None => {
                    let xp = x.ptr + (t0 * w.cols * 4) as u64;
                    if w.dtype == DType::F16 && w.cols.is_multiple_of(8) {
                        let f = self.func("matvec", "matvec_f16_vec")?;
                        launch!(
                            self,
                            f,
                            cfg(grid, WARPS * 32),
                            w.ptr,
                            rows,
                            cols,
                            xp,
                            nt,
                            out_p,
                            stride,
                            c0
                        );
                    } else {
                        let f = self.func("matvec", "matvec_float")?;
                        let dt = dtype_code(w.dtype);
                        launch!(
                            self,
                            f,
                            cfg(grid, WARPS * 32),
                            w.ptr,
                            dt,
                            rows,
                            cols,
                            xp,
                            nt,
                            out_p,
                            stride,
                            c0
                        );
                    }
                }
            }
        }
        Ok(())
    }

    fn ffn_bundles_up(
        &self,
        b: &CudaWeight,
        shape: BundleShape,
        x: &CudaTensor,
        act: Act,
        up_bias: Option<&CudaWeight>,
        h: &mut CudaTensor,
        col0: usize,
    ) -> Result<()> {
        if b.dtype != DType::F16
            || b.cols != shape.parts * shape.d
            || x.cols != shape.d
            || h.rows != x.rows
            || col0 + b.rows > h.cols
        {
            return Err(shape_err(
                "ffn_bundles_up",
                format!(
                    "`{}` {}x{} {} as {} parts of {}",
                    b.name, b.rows, b.cols, b.dtype, shape.parts, shape.d
                ),
            ));
        }
        let f = self.func("bundles", "ffn_bundles_up")?;
        let (neurons, parts, d, kind) = (
            b.rows as i32,
            shape.parts as i32,
            shape.d as i32,
            act_code(act),
        );
        let bias = up_bias.map_or(0u64, |w| w.ptr);
        let (hs, c0) = (h.cols as i32, col0 as i32);
        for t0 in (0..x.rows).step_by(MAX_TOKENS) {
            let nt = (x.rows - t0).min(MAX_TOKENS) as i32;
            let xp = x.ptr + (t0 * shape.d * 4) as u64;
            let hp = h.ptr + (t0 * h.cols * 4) as u64;
            launch!(
                self,
                f.clone(),
                cfg(blocks(b.rows, WARPS), WARPS * 32),
                b.ptr,
                neurons,
                parts,
                d,
                xp,
                nt,
                kind,
                bias,
                hp,
                hs,
                c0
            );
        }
        Ok(())
    }

    fn ffn_bundles_down(
        &self,
        b: &CudaWeight,
        shape: BundleShape,
        h: &CudaTensor,
        col0: usize,
        out: &mut CudaTensor,
    ) -> Result<()> {
        if b.dtype != DType::F16
            || b.cols != shape.parts * shape.d
            || out.cols != shape.d
            || h.rows != out.rows
            || col0 + b.rows > h.cols
        {
            return Err(shape_err(
                "ffn_bundles_down",
                format!(
                    "`{}` {}x{} as {} parts of {}",
                    b.name, b.rows, b.cols, shape.parts, shape.d
                ),
            ));
        }
        let f = self.func("bundles", "ffn_bundles_down")?;
        let (neurons, parts, d) = (b.rows as i32, shape.parts as i32, shape.d as i32);
        let (hs, c0) = (h.cols as i32, col0 as i32);
        let grid = (blocks(shape.d, 256), blocks(b.rows, 64), 1);
        for t0 in (0..h.rows).step_by(MAX_TOKENS) {
            let nt = (h.rows - t0).min(MAX_TOKENS) as i32;
            let hp = h.ptr + (t0 * h.cols * 4) as u64;
            let op = out.ptr + (t0 * shape.d * 4) as u64;
            let c = LaunchConfig {
                grid_dim: grid,
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            launch!(
                self,
                f.clone(),
                c,
                b.ptr,
                neurons,
                parts,
                d,
                hp,
                nt,
                hs,
                c0,
                op
            );
        }
        Ok(())
    }

    fn zero(&self, x: &mut CudaTensor) -> Result<()> {
        self.bind()?;
        // SAFETY: the whole buffer.
        unsafe {
            cudarc::driver::result::memset_d8_async(
                x.ptr,
                0,
                x.rows * x.cols * 4,
                self.compute.cu_stream(),
            )
        }
        .map_err(dev)
    }

    fn add_bias(&self, x: &mut CudaTensor, bias: &CudaWeight) -> Result<()> {
        if bias.dtype != DType::F32 || bias.rows * bias.cols != x.cols {
            return Err(shape_err(
                "add_bias",
                format!("`{}` for {} columns", bias.name, x.cols),
            ));
        }
        let f = self.func("elementwise", "add_bias_f32")?;
        let (n, cols) = ((x.rows * x.cols) as i64, x.cols as i32);
        launch!(
            self,
            f,
            Self::elementwise_cfg(x.rows * x.cols),
            x.ptr,
            bias.ptr,
            n,
            cols
        );
        Ok(())
    }

    fn add(&self, x: &mut CudaTensor, y: &CudaTensor) -> Result<()> {
        if (x.rows, x.cols) != (y.rows, y.cols) {
            return Err(shape_err(
                "add",
                format!("{}x{} vs {}x{}", x.rows, x.cols, y.rows, y.cols),
            ));
        }
        let f = self.func("elementwise", "add_f32")?;
        let n = (x.rows * x.cols) as i64;
        launch!(
            self,
            f,
            Self::elementwise_cfg(x.rows * x.cols),
            x.ptr,
            y.ptr,
            n
        );
        Ok(())
    }

    fn rms_norm(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        eps: f32,
        out: &mut CudaTensor,
    ) -> Result<()> {
        if (x.rows, x.cols) != (out.rows, out.cols)
            || w.rows * w.cols != x.cols
            || w.dtype != DType::F32
        {
            return Err(shape_err(
                "rms_norm",
                format!("{}x{} with `{}`", x.rows, x.cols, w.name),
            ));
        }
        let f = self.func("norm", "rms_norm")?;
        let cols = x.cols as i32;
        launch!(
            self,
            f,
            cfg(x.rows as u32, 256),
            x.ptr,
            w.ptr,
            eps,
            out.ptr,
            cols
        );
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
        if (x.rows, x.cols) != (out.rows, out.cols)
            || w.rows * w.cols != x.cols
            || b.rows * b.cols != x.cols
        {
            return Err(shape_err(
                "layer_norm",
                format!("{}x{} with `{}`", x.rows, x.cols, w.name),
            ));
        }
        let f = self.func("norm", "layer_norm")?;
        let cols = x.cols as i32;
        launch!(
            self,
            f,
            cfg(x.rows as u32, 256),
            x.ptr,
            w.ptr,
            b.ptr,
            eps,
            out.ptr,
            cols
        );
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
        let f = self.func("rope", "rope")?;
        let total = x.rows * (x.cols / head_dim) * (rot_dims / 2);
        let (rows, cols, hd, rd) = (
            x.rows as i32,
            x.cols as i32,
            head_dim as i32,
            rot_dims as i32,
        );
        let p = if pairs == RopePairs::Adjacent {
            0i32
        } else {
            1
        };
        let fp = first_pos as i32;
        launch!(
            self,
            f,
            Self::elementwise_cfg(total),
            x.ptr,
            rows,
            cols,
            hd,
            rd,
            p,
            inv_freq.ptr,
            fp
        );
        Ok(())
    }

    fn activate(&self, x: &mut CudaTensor, act: Act) -> Result<()> {
        let f = self.func("elementwise", "activate_f32")?;
        let (n, k) = ((x.rows * x.cols) as i64, act_code(act));
        launch!(self, f, Self::elementwise_cfg(x.rows * x.cols), x.ptr, n, k);
        Ok(())
    }

    fn gated(&self, gate: &mut CudaTensor, up: &CudaTensor, act: Act) -> Result<()> {
        if (gate.rows, gate.cols) != (up.rows, up.cols) {
            return Err(shape_err(
                "gated",
                format!("{}x{} vs {}x{}", gate.rows, gate.cols, up.rows, up.cols),
            ));
        }
        let f = self.func("elementwise", "gated_f32")?;
        let (n, k) = ((gate.rows * gate.cols) as i64, act_code(act));
        launch!(
            self,
            f,
            Self::elementwise_cfg(gate.rows * gate.cols),
            gate.ptr,
            up.ptr,
            n,
            k
        );
        Ok(())
    }

    fn attention(
        &self,
        q: &CudaTensor,
        k_cache: &CudaTensor,
        v_cache: &CudaTensor,
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
            || first_pos + n > k_cache.rows.min(v_cache.rows)
            || s.n_kv_heads == 0
            || !s.n_heads.is_multiple_of(s.n_kv_heads)
            || s.head_dim > 256
        {
            return Err(shape_err(
                "attention",
                format!(
                    "q {}x{}, caches {}x{}, head dim {}",
                    q.rows, q.cols, k_cache.rows, k_cache.cols, s.head_dim
                ),
            ));
        }
        let f = self.func("attention", "attention")?;
        let (nh, group, hd) = (
            s.n_heads as i32,
            (s.n_heads / s.n_kv_heads) as i32,
            s.head_dim as i32,
        );
        let (qs, kvs, fp) = (q_dim as i32, kv_dim as i32, first_pos as i32);
        launch!(
            self,
            f,
            cfg((n * s.n_heads) as u32, 256),
            q.ptr,
            k_cache.ptr,
            v_cache.ptr,
            out.ptr,
            nh,
            group,
            hd,
            qs,
            kvs,
            fp,
            s.scale
        );
        Ok(())
    }
}

impl CudaTensor {
    /// The underlying slice (for tests reading device memory directly).
    pub fn slice(&self) -> &CudaSlice<f32> {
        &self.buf
    }
}
