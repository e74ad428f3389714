//! The device and what every op shares of it: the context, the compute and copy streams, every
//! kernel module and the cuBLAS handle (with its workspace), brought up and measured at start
//! (the fixed cost the arena is sized after); the arena itself under a budget; binding the
//! context, loading a kernel, the launch with programmatic stream serialization, counting
//! device operations, and whether a step is being captured. No op lives here.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::cublas::sys as blas_sys;
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig};

use super::args::ptr_of;
use super::kernels;
use super::meter::DeviceMeter;
use super::types::DeviceBuf;
use crate::backend::memory::{DeviceMemory, Workspace};
use crate::backend::recording::outside_recording;
use crate::backend::{BackendError, Result};
use crate::footprint::attention::SPLIT_MAX_HEADS;
use crate::footprint::ledger::Ledger;
use crate::footprint::{FixedCost, FixedCostReading, FixedCostSource};

/// cuBLAS workspace, held for the backend's lifetime (so cuBLAS allocates nothing itself); part
/// of the fixed cost.
const BLAS_WORKSPACE: usize = 32 << 20;

/// Oldest compute capability the kernels run on (Turing, 7.5): `ldmatrix` and the integer dot
/// products, and the oldest target CUDA 13 compiles for.
pub const MIN_CAPABILITY: u32 = 75;

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

pub(super) fn dev<E: std::fmt::Debug>(e: E) -> BackendError {
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

/// The CUDA backend ([`crate::backend::cuda`]): one device, its streams, modules and memory.
pub struct CudaBackend {
    pub(super) ctx: Arc<CudaContext>,
    pub(super) compute: Arc<CudaStream>,
    pub(super) copy: Arc<CudaStream>,
    pub(super) blas: Option<Mutex<BlasState>>,
    pub(super) mem: DeviceMemory,
    /// Base address of the arena (under a budget).
    pub(super) arena: Option<u64>,
    pub(super) workspace: Workspace<DeviceBuf>,
    /// `--emulate`: host→device copies paced to this many bytes/s by a stamp kernel before each
    /// copy and a wait kernel after it ([`CudaBackend::pace_before`]).
    pub(super) pace: Mutex<Option<f64>>,
    /// The pacing stamps, one per stream (copy, compute); allocated with the context so they
    /// are part of the measured fixed cost.
    pub(super) stamps: CudaSlice<u64>,
    /// The split attention's ticket per head, then the normed products' ticket
    /// ([`CudaBackend::norm_ticket`]) (zeros; each launch leaves them at zero): with the
    /// context, as the stamps.
    pub(super) tickets: CudaSlice<u32>,
    pub(super) functions: Mutex<HashMap<(&'static str, &'static str), CudaFunction>>,
    /// Each kernel's blocks per multiprocessor ([`CudaBackend::blocks_per_sm`]), once asked.
    pub(super) slots: Mutex<HashMap<(&'static str, &'static str), usize>>,
    pub(super) modules: kernels::Modules,
    pub(super) meter: Option<DeviceMeter>,
    /// The fixed cost: the device bytes the process held once context, modules and cuBLAS
    /// were up (before any buffer), as the card counts them ([`crate::footprint::fixed`]);
    /// `None` where NVML could not tell (outside a process budget).
    pub(super) fixed: Option<FixedCost>,
    /// Recorded steps: where the step position lives
    /// ([`Backend::set_step_position`](crate::backend::Backend::set_step_position)); whether the
    /// compute stream is being captured into a graph now.
    pub(super) step_position: Mutex<Option<DeviceBuf>>,
    pub(super) recording: std::sync::atomic::AtomicBool,
    /// `--programmatic-launch`: kernels launched with programmatic stream serialization.
    pub(super) programmatic: std::sync::atomic::AtomicBool,
    /// The device's compute capability, major · 10 + minor.
    pub(super) capability: u32,
    /// Its multiprocessors: with a kernel's blocks per multiprocessor, the blocks it holds at
    /// once ([`flash_splits`](crate::footprint::attention::flash_splits)).
    pub(super) multiprocessors: usize,
    /// Key splits every prompt's flash attention takes (`bench attention --flash-splits`, to set a
    /// split beside none in one run); 0: as
    /// [`flash_splits`](crate::footprint::attention::flash_splits) picks.
    pub(super) flash_splits_forced: std::sync::atomic::AtomicUsize,
    /// Device operations run: each launch (a cuBLAS call counts one), copy or fill within device
    /// memory, and each node of a replayed recording
    /// ([`Backend::device_ops_run`](crate::backend::Backend::device_ops_run)).
    pub(super) device_ops: std::sync::atomic::AtomicU64,
}

pub(super) struct BlasState {
    pub(super) handle: cudarc::cublas::CudaBlas,
    _workspace: CudaSlice<u8>,
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
        let cost = me.reading().fixed_cost(assumed_fixed);
        let fixed = cost.bytes;
        match cost.source {
            FixedCostSource::Device => {}
            FixedCostSource::ProcessWithMargin => tracing::warn!(
                "another process's device memory moved while this one started (the device is shared, or its figure unreadable): the fixed cost is this process's {} MiB plus a {} MiB margin",
                cost.process_bytes.unwrap_or(0) >> 20,
                crate::footprint::fixed::SHARED_DEVICE_MARGIN >> 20
            ),
            FixedCostSource::Assumed => tracing::warn!(
                "the driver's memory figures cannot be read (NVML): the fixed cost is assumed to be {} MiB",
                fixed >> 20
            ),
        }
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
        me.fixed = Some(cost);
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
        let tickets = compute
            .alloc_zeros::<u32>(SPLIT_MAX_HEADS + 1)
            .map_err(dev)?;
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
            slots: Mutex::new(HashMap::new()),
            modules: kernels::Modules::default(),
            meter,
            fixed: None,
            step_position: Mutex::new(None),
            recording: std::sync::atomic::AtomicBool::new(false),
            programmatic: std::sync::atomic::AtomicBool::new(false),
            capability,
            multiprocessors,
            flash_splits_forced: std::sync::atomic::AtomicUsize::new(0),
            device_ops: std::sync::atomic::AtomicU64::new(0),
        };
        // Every kernel resolved now: under lazy loading (the driver's default) a kernel's code
        // reaches the device when it is first resolved, and it belongs in the fixed cost, not in
        // memory that appears beside the arena during the first step.
        for (module, name) in kernels::KERNEL_NAMES {
            me.func(module, name)?;
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
        let measured = me.reading().fixed_cost(0);
        me.fixed = (measured.source != FixedCostSource::Assumed).then_some(measured);
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

    /// Device bytes this process holds now, from the driver (NVML); `None` where it cannot tell.
    pub fn process_bytes(&self) -> Option<u64> {
        self.meter.as_ref().and_then(|m| m.process_bytes())
    }

    /// Device bytes used now beyond those used before this process's context (nvidia-smi's
    /// `memory.used`, less the device's idle figure): what `--gpu-mem` is held to as the card
    /// counts it. `None` where NVML cannot tell.
    pub fn device_used_bytes(&self) -> Option<u64> {
        self.meter.as_ref().and_then(|m| m.device_bytes())
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

    /// One kernel launched with programmatic stream serialization on the compute stream.
    pub(super) fn launch_programmatic(
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
        self.fixed.map(|c| c.bytes)
    }

    /// The fixed cost with the figures it came from (see [`CudaBackend::fixed_bytes`]).
    pub fn fixed_cost(&self) -> Option<FixedCost> {
        self.fixed
    }

    /// The driver's figures now (none where NVML cannot tell).
    fn reading(&self) -> FixedCostReading {
        self.meter
            .as_ref()
            .map_or_else(FixedCostReading::default, DeviceMeter::reading)
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

    /// Count what products read of `ws` in device memory (host memory read in place is the
    /// link's, counted where it is read).
    pub(super) fn read_weights(&self, ws: &[&super::CudaWeight]) {
        for w in ws.iter().filter(|w| w.host.is_none()) {
            let bytes = crate::backend::reads::product(w.rows, w.row_bytes());
            self.ledger().count_device_read(bytes);
        }
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
    pub(super) fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(dev)
    }

    pub(super) fn recording(&self) -> bool {
        self.recording.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Fail while a step is being captured: `op` is nothing a CUDA graph holds (an allocation,
    /// a copy between host and device, a wait), and would end the capture in an error. `op` is
    /// one of [`REFUSED_WHILE_RECORDING`](crate::backend::recording::REFUSED_WHILE_RECORDING),
    /// the rule the budgeted device follows too.
    pub(super) fn outside(&self, op: &'static str) -> Result<()> {
        outside_recording(op, self.recording())
    }

    /// The blocks of `threads` threads of kernel `name` a multiprocessor holds at once (the
    /// driver's occupancy); asked once per kernel.
    pub(super) fn blocks_per_sm(
        &self,
        module: &'static str,
        name: &'static str,
        threads: u32,
    ) -> Result<usize> {
        let key = (module, name);
        if let Some(&n) = self.lock_slots()?.get(&key) {
            return Ok(n);
        }
        let per_sm = self
            .func(module, name)?
            .occupancy_max_active_blocks_per_multiprocessor(threads, 0, None)
            .map_err(dev)? as usize;
        self.lock_slots()?.insert(key, per_sm);
        Ok(per_sm)
    }

    fn lock_slots(
        &self,
    ) -> Result<std::sync::MutexGuard<'_, HashMap<(&'static str, &'static str), usize>>> {
        self.slots
            .lock()
            .map_err(|_| BackendError::Device("occupancy cache poisoned".into()))
    }

    pub(super) fn func(&self, module: &'static str, name: &'static str) -> Result<CudaFunction> {
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

    /// The ticket of a launch of products with the RMSNorm before them inside (the grid's last
    /// block to have read the residual writes it): after the split attention's.
    pub(super) fn norm_ticket(&self) -> u64 {
        ptr_of(&self.tickets, &self.compute) + (SPLIT_MAX_HEADS * 4) as u64
    }

    /// One more device operation run
    /// ([`Backend::device_ops_run`](crate::backend::Backend::device_ops_run)).
    pub(super) fn counted(&self) {
        self.device_ops
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
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

pub(super) fn name(cuda: &CudaBackend) -> String {
    let name = cuda.ctx.name().unwrap_or_else(|_| "CUDA device".into());
    let budget = cuda
        .ledger()
        .hbm_budget()
        .map_or("whole device".to_string(), |b| {
            format!("{} MiB budget", b >> 20)
        });
    format!("cuda ({name}, {budget})")
}
