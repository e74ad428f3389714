//! Hardware probe: what this machine can move per second. Host figures (cores, SIMD, DRAM read
//! bandwidth) are measured here; they are the denominators of every bound the benchmarks print.

use std::time::Instant;

use rayon::prelude::*;
use serde::Serialize;

#[derive(Clone, Debug, Serialize)]
pub struct HostProfile {
    pub cpu_model: String,
    pub logical_cores: usize,
    pub simd: Vec<&'static str>,
    pub dram_bytes: Option<u64>,
    /// Sustained read bandwidth of host memory with `threads` threads, bytes/s.
    pub dram_read_bytes_per_s: f64,
    pub dram_read_threads: usize,
}

/// CPU SIMD features the kernels care about.
pub fn simd_features() -> Vec<&'static str> {
    #[allow(unused_mut)]
    let mut v = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        for (name, on) in [
            ("sse4.2", is_x86_feature_detected!("sse4.2")),
            ("avx", is_x86_feature_detected!("avx")),
            ("avx2", is_x86_feature_detected!("avx2")),
            ("fma", is_x86_feature_detected!("fma")),
            ("f16c", is_x86_feature_detected!("f16c")),
            ("avx512f", is_x86_feature_detected!("avx512f")),
            ("avx512bw", is_x86_feature_detected!("avx512bw")),
            ("avx512vnni", is_x86_feature_detected!("avx512vnni")),
        ] {
            if on {
                v.push(name);
            }
        }
    }
    #[cfg(target_arch = "aarch64")]
    v.push("neon");
    v
}

/// The CPU's model name (`/proc/cpuinfo`), else the architecture.
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

fn dram_total() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Read bandwidth of host memory: `threads` threads each read their share of a `bytes`-sized
/// buffer (far larger than the caches) with the widest SIMD loads this CPU has (the best CPU
/// kernel set's dot product of the data with itself: one stream, the second operand an L1 hit),
/// so the bound is what our kernels can reach, not what a baseline loop does; the best of `reps`
/// passes. The buffer is on transparent huge pages where the host gives them, as the weights
/// the CPU streams are ([`crate::tensor::AlignedBuf`], [`crate::tensor::Bytes::pack_huge`]): on
/// 4 KiB pages this project's 2-core VM read 22–25 GB/s in the same seconds as huge pages read
/// 33–34, and hybrid's cold pass (on huge pages) read faster than such a bound. Bytes/s.
pub fn dram_read_bandwidth(threads: usize, bytes: usize, reps: usize) -> f64 {
    let floats = (bytes / 4).max(1 << 17);
    let mut pages = crate::tensor::AlignedBuf::zeroed(floats * 4);
    let buf: &mut [f32] = bytemuck::cast_slice_mut(pages.as_mut_slice());
    // Non-zero contents so pages are really backed.
    for (i, v) in buf.iter_mut().enumerate() {
        *v = (i % 7) as f32;
    }
    let buf: &[f32] = buf;
    let pool = match rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .build()
    {
        Ok(p) => p,
        Err(_) => return 0.0,
    };
    let dot = crate::backend::cpu::kernels::best().dot_f32;
    // Pieces of 64 KiB: each thread streams many, in order.
    let piece = 1 << 14;
    let mut best = 0f64;
    for _ in 0..reps.max(1) {
        let t0 = Instant::now();
        let sum: f32 = pool.install(|| {
            buf.par_chunks(floats.div_ceil(threads.max(1)))
                .map(|part| part.chunks(piece).map(|c| dot(c, c)).sum::<f32>())
                .sum()
        });
        let secs = t0.elapsed().as_secs_f64();
        std::hint::black_box(sum);
        best = best.max((floats * 4) as f64 / secs);
    }
    best
}

/// Probe the host (about a second).
pub fn probe_host(threads: usize) -> HostProfile {
    HostProfile {
        cpu_model: cpu_model(),
        logical_cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        simd: simd_features(),
        dram_bytes: dram_total(),
        dram_read_bytes_per_s: dram_read_bandwidth(threads, 512 << 20, 10),
        dram_read_threads: threads,
    }
}

/// Attention as a probe runs it: `rows` random query rows from position `context` over a random
/// `kv` cache of `context + rows` positions, `heads` heads (`kv_heads` of them for keys and
/// values) of `head_dim`.
#[derive(Clone, Copy, Debug)]
pub struct AttentionProbe {
    pub rows: usize,
    pub context: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub kv: crate::backend::KvType,
}

impl AttentionProbe {
    /// A decode step's attention over 4000 positions of an f16 cache with 7B heads (32 of 128):
    /// what `doctor` measures the CPU's attention rate on, for a KV cache kept in host memory.
    pub const DECODE_7B: AttentionProbe = AttentionProbe {
        rows: 1,
        context: 4000,
        heads: 32,
        kv_heads: 32,
        head_dim: 128,
        kv: crate::backend::KvType::F16,
    };

    /// A row group of a long prompt under a budget: 512 rows over 8192 positions of an f16
    /// cache with 7B heads (32 of 128), its keys split as the device fills. What `doctor`
    /// measures a GPU's prompt attention rate on.
    pub const PROMPT_7B: AttentionProbe = AttentionProbe {
        rows: 512,
        context: 7680,
        heads: 32,
        kv_heads: 32,
        head_dim: 128,
        kv: crate::backend::KvType::F16,
    };

    /// The same heads, 64 rows over 2048 positions: the CPU's prompt attention rate (the
    /// budgeted device's), in a fraction of a second on two cores.
    pub const PROMPT_CPU: AttentionProbe = AttentionProbe {
        rows: 64,
        context: 1984,
        heads: 32,
        kv_heads: 32,
        head_dim: 128,
        kv: crate::backend::KvType::F16,
    };

    /// FLOP/s of this attention on `b` (the median of 5 calls after one): what the planner
    /// divides a prompt's attention FLOPs by.
    pub fn flops_per_s<B: crate::backend::Backend>(&self, b: &B) -> Result<f64, String> {
        let secs = self
            .seconds(b, 1)
            .map_err(|e| format!("attention probe: {e}"))?;
        Ok(self.flops() / secs)
    }

    /// FLOPs of the causal attention ([`crate::plan::causal_attention_flops`]).
    pub fn flops(&self) -> f64 {
        crate::plan::causal_attention_flops(self.rows, self.context, self.heads * self.head_dim)
    }

    /// Bytes of cache read: the keys and values of every position the last row sees.
    pub fn kv_bytes(&self) -> f64 {
        let row = self.kv.row_bytes(self.kv_heads * self.head_dim);
        2.0 * ((self.context + self.rows) * row) as f64
    }

    /// Seconds per [`Backend::attention`](crate::backend::Backend::attention) on `b`: the
    /// median of 5 timings of `reps` calls, after one.
    pub fn seconds<B: crate::backend::Backend>(
        &self,
        b: &B,
        reps: usize,
    ) -> Result<f64, crate::backend::BackendError> {
        use crate::backend::{AttnShape, WorkspaceOp};
        use rand::{RngExt, SeedableRng};
        let (qd, kd) = (self.heads * self.head_dim, self.kv_heads * self.head_dim);
        let ctx = self.context + self.rows;
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let mut random =
            |len: usize| -> Vec<f32> { (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect() };
        let mut caches = [b.alloc_kv(ctx, kd, self.kv)?, b.alloc_kv(ctx, kd, self.kv)?];
        // The cache filled a slice at a time (host memory for 4096 rows, not the context).
        const SLICE: usize = 4096;
        for cache in &mut caches {
            for r0 in (0..ctx).step_by(SLICE) {
                let rows = SLICE.min(ctx - r0);
                let mut t = b.alloc(rows, kd)?;
                b.write(&mut t, &random(rows * kd))?;
                b.store_kv(&t, cache, None, r0)?;
            }
        }
        let mut q = b.alloc(self.rows, qd)?;
        b.write(&mut q, &random(self.rows * qd))?;
        let mut out = b.alloc(self.rows, qd)?;
        let (mut row, mut sink) = (b.alloc(1, qd)?, vec![0f32; qd]);
        b.set_workspace(b.workspace_bytes(&WorkspaceOp::Attention {
            tokens: self.rows,
            n_heads: self.heads,
            head_dim: self.head_dim,
            kv: self.kv,
        }))?;
        let shape = AttnShape {
            n_heads: self.heads,
            n_kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            scale: 1.0 / (self.head_dim as f32).sqrt(),
        };
        let context = self.context;
        let secs = b.enter(move || {
            let [k, v] = &caches;
            let mut once = || -> Result<(), crate::backend::BackendError> {
                b.attention(&q, k, v, None, context, shape, &mut out)?;
                // A read waits for the attention (and costs one row's copy).
                b.copy_rows(&out, 0, &mut row, 0, 1)?;
                b.read(&row, &mut sink)
            };
            once()?;
            let mut times = Vec::with_capacity(5);
            for _ in 0..5 {
                let t0 = Instant::now();
                for _ in 0..reps.max(1) {
                    once()?;
                }
                times.push(t0.elapsed().as_secs_f64() / reps.max(1) as f64);
            }
            times.sort_by(f64::total_cmp);
            Ok::<f64, crate::backend::BackendError>(times[2])
        })?;
        b.set_workspace(0)?;
        Ok(secs)
    }
}

/// Bytes of KV cache the CPU attends per second ([`AttentionProbe::DECODE_7B`] on `b`): what
/// the planner costs a decode step's attention over a KV cache kept in host
/// memory at, where it would otherwise take the DRAM read rate (which the arithmetic and the
/// cache rows' decoding keep the CPU well below).
pub fn cpu_attention_rate(b: &crate::backend::cpu::CpuBackend) -> Result<f64, String> {
    let probe = AttentionProbe::DECODE_7B;
    let secs = probe
        .seconds(b, 4)
        .map_err(|e| format!("CPU attention probe: {e}"))?;
    Ok(probe.kv_bytes() / secs)
}

/// Width of the bundles [`cpu_read_start_s`] reads: SmolLM2's, the shortest rows of the models
/// we serve, where a read's start weighs most beside its bytes.
pub const READ_PROBE_WIDTH: usize = 576;

/// Seconds the CPU's neuron-sparse pass spends on each read beyond its bytes at `dram` bytes/s
/// ([`crate::plan::HardwareProfile::cpu_read_start_s`]). The pass is hybrid's cold pass over
/// whole gated f16 bundles of [`READ_PROBE_WIDTH`] (narrow parts stay whole:
/// [`crate::plan::cold::APART_FROM_PART_BYTES`]), as the engine runs it on `b`'s pool: `bytes`
/// of neurons, every one examined (a read each), half of them left on and read whole in the
/// same run; the fastest of seven passes, as the DRAM rate beside it is the best of its (a
/// median moved 56–195 ns between starts on the shared 2-core machine).
pub fn cpu_read_start_s(
    b: &crate::backend::cpu::CpuBackend,
    bytes: usize,
    dram: f64,
) -> Result<f64, String> {
    use crate::backend::cpu::sparse::{Bundles, FfnParts, sparse_ffn};
    use crate::backend::{Backend, BundleShape};
    let err = |e: crate::backend::BackendError| format!("CPU read-start probe: {e}");
    let d = READ_PROBE_WIDTH;
    let part = d * 2;
    let neurons = (bytes / (3 * part)).max(64);
    let w: Vec<half::f16> = (0..neurons * 3 * d)
        .map(|i| half::f16::from_f32(((i % 29) as f32 - 14.0) * 0.01))
        .collect();
    let shape = BundleShape { parts: 3, d };
    let bundles =
        Bundles::new(bytemuck::cast_slice(&w), crate::store::Encoding::F16, shape).map_err(err)?;
    // Every neuron examined (the cold list is all of a layer's cold neurons), half left on by
    // a bit of a hash of its id.
    let listed: Vec<u32> = (0..neurons as u32).collect();
    let on_of = |j: usize| (j as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 63 == 1;
    let x: Vec<f32> = (0..d).map(|i| ((i % 7) as f32 - 3.0) * 0.1).collect();
    let k = crate::backend::cpu::kernels::best();
    let mut h = vec![0f32; neurons];
    let mut out = vec![0f32; d];
    let mut pass = || -> Result<(f64, usize), String> {
        let t0 = Instant::now();
        let on = sparse_ffn(
            k,
            FfnParts::Bundles(bundles),
            (&listed, &listed),
            &x,
            1,
            |j, _, v| if on_of(j) { v } else { 0.0 },
            &mut h,
            &mut out,
        )
        .map_err(err)?;
        std::hint::black_box(&out);
        Ok((t0.elapsed().as_secs_f64(), on.len()))
    };
    let mut times = b.enter(|| (0..7).map(|_| pass()).collect::<Result<Vec<_>, _>>())?;
    times.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (secs, on) = times[0];
    let bytes_s = ((neurons + 2 * on) * part) as f64 / dram;
    Ok(((secs - bytes_s) / neurons as f64).max(0.0))
}

/// Host memory copy bandwidth with one thread (what the budgeted device's "copy engine" does),
/// bytes/s copied.
pub fn memcpy_bandwidth(bytes: usize, reps: usize) -> f64 {
    let src: Vec<u8> = (0..bytes).map(|i| i as u8).collect();
    let mut dst = vec![0u8; bytes];
    let mut best = 0f64;
    for _ in 0..reps.max(1) {
        let t0 = Instant::now();
        dst.copy_from_slice(&src);
        std::hint::black_box(&dst);
        best = best.max(bytes as f64 / t0.elapsed().as_secs_f64());
    }
    best
}

/// Sequential read bandwidth of the filesystem under `dir` with direct I/O (page cache
/// bypassed; buffered with the cache dropped where the filesystem refuses O_DIRECT): writes a
/// `bytes` scratch file, reads it back in 4 MiB requests, removes it. Bytes/s.
pub fn ssd_read_bandwidth(dir: &std::path::Path, bytes: usize) -> std::io::Result<f64> {
    use std::io::Write;
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    std::fs::create_dir_all(dir)?;
    let path = dir.join(format!(".gpu-offload-ssd-probe.{}", std::process::id()));
    let result = (|| {
        let chunk = 4 << 20;
        let bytes = bytes.div_ceil(chunk) * chunk;
        {
            let mut f = std::fs::File::create(&path)?;
            let block: Vec<u8> = (0..chunk).map(|i| (i * 31) as u8).collect();
            for _ in 0..bytes / chunk {
                f.write_all(&block)?;
            }
            f.sync_all()?;
        }
        let (f, direct) = match std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path)
        {
            Ok(f) => (f, true),
            Err(_) => (std::fs::File::open(&path)?, false),
        };
        if !direct {
            // SAFETY: advisory call on an open descriptor.
            unsafe {
                libc::posix_fadvise(
                    std::os::fd::AsRawFd::as_raw_fd(&f),
                    0,
                    0,
                    libc::POSIX_FADV_DONTNEED,
                );
            }
        }
        let mut buf = crate::tensor::AlignedBuf::zeroed(chunk);
        let t0 = Instant::now();
        let mut off = 0u64;
        while (off as usize) < bytes {
            let n = f.read_at(buf.padded_mut(), off)?;
            if n == 0 {
                break;
            }
            off += n as u64;
        }
        Ok(off as f64 / t0.elapsed().as_secs_f64())
    })();
    std::fs::remove_file(&path).ok();
    result
}

/// What `doctor` measures of a GPU.
#[derive(Clone, Debug, Serialize)]
pub struct GpuProfile {
    pub name: String,
    pub compute_capability: (i32, i32),
    pub total_bytes: u64,
    pub free_bytes: u64,
    pub multiprocessors: i32,
    pub driver_version: Option<String>,
    /// Current and maximum PCIe generation and width (NVML).
    pub pcie: Option<PcieLink>,
    /// Device-to-device copy, bytes read plus written per second.
    pub d2d_bytes_per_s: f64,
    /// Device-memory read bandwidth (a kernel that only reads), bytes/s: what decode and matvec
    /// stream weights at, the HBM bound's denominator.
    pub hbm_read_bytes_per_s: f64,
    /// Device memory a process holds with our context, kernel modules, cuBLAS and its workspace
    /// up (NVML), before placing anything, as the card counts it; `None` where NVML cannot tell.
    pub fixed_bytes: Option<u64>,
    /// The same with both of the driver's figures (per process, and the device's used memory)
    /// and which was taken ([`crate::footprint::fixed`]).
    pub fixed_cost: Option<crate::footprint::FixedCost>,
    /// A prefill-sized f16 matrix product's rate (see [`matmul_rate`]), FLOP/s.
    pub matmul_flops_per_s: f64,
    /// A prompt's attention rate ([`AttentionProbe::PROMPT_7B`]), FLOP/s.
    pub attention_flops_per_s: f64,
    pub h2d_pinned_bytes_per_s: f64,
    pub h2d_pageable_bytes_per_s: f64,
    pub d2h_pinned_bytes_per_s: f64,
    pub d2h_pageable_bytes_per_s: f64,
    /// How the kernels ship in this build.
    pub kernels: String,
    /// Whether `--programmatic-launch` runs here (compute capability 9.0, kernels built for it).
    pub programmatic_launch: bool,
    /// Whether prompts over an f16 or Q8_0 cache take the tensor-core (flash) attention here (compute
    /// capability 8.0 and newer), not the simple kernel.
    pub flash_attention: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct PcieLink {
    pub gen_current: u32,
    pub width_current: u32,
    pub gen_max: u32,
    pub width_max: u32,
}

fn nvml_facts() -> (Option<String>, Option<PcieLink>) {
    let Ok(nvml) = nvml_wrapper::Nvml::init() else {
        return (None, None);
    };
    let driver = nvml.sys_driver_version().ok();
    let pcie = nvml.device_by_index(0).ok().and_then(|d| {
        Some(PcieLink {
            gen_current: d.current_pcie_link_gen().ok()?,
            width_current: d.current_pcie_link_width().ok()?,
            gen_max: d.max_pcie_link_gen().ok()?,
            width_max: d.max_pcie_link_width().ok()?,
        })
    });
    (driver, pcie)
}

/// Probe GPU 0: NVML facts and copy bandwidths measured with CUDA events. Errors (no driver, no
/// device) come back as text for `doctor` to print.
/// FLOP/s of `tokens` rows times an f16 `rows × cols` weight on `b` (the prefill's products: on a
/// GPU cuBLAS on tensor cores), the best of five after a warm-up: what the planner divides a
/// prefill's FLOPs by.
pub fn matmul_rate<B: crate::backend::Backend>(
    b: &B,
    tokens: usize,
    rows: usize,
    cols: usize,
) -> Result<f64, String> {
    use crate::tensor::{Bytes, DType, HostTensor};
    let err = |e: crate::backend::BackendError| format!("matrix product probe: {e}");
    let half: Vec<u16> = (0..rows * cols)
        .map(|i| half::f16::from_f32(((i * 7919) % 2001) as f32 * 1e-3 - 1.0).to_bits())
        .collect();
    let w = HostTensor {
        name: "probe".into(),
        rows,
        cols,
        dtype: DType::F16,
        data: Bytes::from_slice(bytemuck::cast_slice(&half)),
    };
    let w = b.upload(&w).map_err(err)?;
    let mut x = b.alloc(tokens, cols).map_err(err)?;
    b.write(&mut x, &vec![0.5f32; tokens * cols]).map_err(err)?;
    let mut out = b.alloc(tokens, rows).map_err(err)?;
    let op = crate::backend::WorkspaceOp::Matmul {
        dtype: DType::F16,
        tokens,
        rows,
        cols,
    };
    b.set_workspace(b.workspace_bytes(&op)).map_err(err)?;
    let mut sink = vec![0f32; rows];
    let mut row = b.alloc(1, rows).map_err(err)?;
    let mut one = || -> Result<f64, String> {
        let t0 = std::time::Instant::now();
        b.matmul(&w, &x, &mut out).map_err(err)?;
        // A read waits for the product (and costs one row's copy).
        b.copy_rows(&out, 0, &mut row, 0, 1).map_err(err)?;
        b.read(&row, &mut sink).map_err(err)?;
        Ok(t0.elapsed().as_secs_f64())
    };
    one()?;
    let mut best = f64::MAX;
    for _ in 0..5 {
        best = best.min(one()?);
    }
    b.set_workspace(0).map_err(err)?;
    Ok(2.0 * (tokens * rows * cols) as f64 / best)
}

/// Seconds one small device op costs on `b` beyond its bytes: the median of 101 one-token
/// products of a 16 × 256 f16 weight (8 KiB, cache-resident), each waited for, inside the
/// backend's context as a step's ops run. On the budgeted device this is the pool's fork and
/// join, about 0.5–1 µs on two cores (timed from outside the pool, where each op also entered
/// it, 21 µs: a third of SmolLM2's predicted step on ops the step never paid for); what the
/// cost model charges every op of a step.
pub fn op_overhead_s<B: crate::backend::Backend>(b: &B) -> Result<f64, String> {
    use crate::tensor::{Bytes, DType, HostTensor};
    let err = |e: crate::backend::BackendError| format!("op overhead probe: {e}");
    let (rows, cols) = (16, 256);
    let half: Vec<u16> = (0..rows * cols)
        .map(|i| half::f16::from_f32((i % 13) as f32 * 0.01).to_bits())
        .collect();
    let w = b
        .upload(&HostTensor {
            name: "probe".into(),
            rows,
            cols,
            dtype: DType::F16,
            data: Bytes::from_slice(bytemuck::cast_slice(&half)),
        })
        .map_err(err)?;
    let mut x = b.alloc(1, cols).map_err(err)?;
    b.write(&mut x, &vec![0.5f32; cols]).map_err(err)?;
    let mut out = b.alloc(1, rows).map_err(err)?;
    let mut sink = vec![0f32; rows];
    // Inside the backend's context, as a step's ops run (the engine enters it once a step):
    // from outside, each op on the CPU pool would also pay its own entry into the pool.
    let mut times = b
        .enter(move || {
            let mut times = Vec::with_capacity(102);
            for _ in 0..102 {
                let t0 = std::time::Instant::now();
                b.matmul(&w, &x, &mut out)?;
                b.read(&out, &mut sink)?;
                times.push(t0.elapsed().as_secs_f64());
            }
            Ok::<_, crate::backend::BackendError>(times)
        })
        .map_err(err)?;
    times.remove(0);
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

pub fn probe_gpu(bytes: usize) -> Result<GpuProfile, String> {
    use crate::backend::cuda::{CudaBackend, driver_present};
    use cudarc::driver::result as r;
    if !driver_present() {
        return Err("no GPU found: no CUDA driver (libcuda) on this machine".into());
    }
    let ledger = crate::footprint::Ledger::new(None, None);
    let be = CudaBackend::new(0, ledger).map_err(|e| format!("no GPU found: {e}"))?;
    let info = be.info().map_err(|e| e.to_string())?;
    let stream = be.compute_stream().clone();
    let ctx = be.context().clone();
    let err = |e: cudarc::driver::DriverError| format!("{e:?}");
    // SAFETY: buffers are written by the copies before being read; sizes match.
    unsafe {
        let a = stream.alloc::<u8>(bytes).map_err(err)?;
        let b = stream.alloc::<u8>(bytes).map_err(err)?;
        let (pa, _) = cudarc::driver::DevicePtr::device_ptr(&a, &stream);
        let (pb, _) = cudarc::driver::DevicePtr::device_ptr(&b, &stream);
        let mut pinned = ctx.alloc_pinned::<u8>(bytes).map_err(err)?;
        let mut pageable = vec![1u8; bytes];
        let cs = stream.cu_stream();
        let time = |f: &mut dyn FnMut() -> Result<(), cudarc::driver::DriverError>| -> Result<f64, String> {
            let mut best = f64::MAX;
            for _ in 0..5 {
                let start = stream.record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(err)?;
                f().map_err(err)?;
                let end = stream.record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(err)?;
                end.synchronize().map_err(err)?;
                best = best.min(start.elapsed_ms(&end).map_err(err)? as f64 / 1e3);
            }
            Ok(best)
        };
        let host_pinned = pinned.as_mut_slice().map_err(err)?;
        host_pinned.fill(2);
        let d2d = time(&mut || r::memcpy_dtod_async(pb, pa, bytes, cs))?;
        let h2d_p = time(&mut || r::memcpy_htod_async(pa, &host_pinned[..], cs))?;
        let h2d_u = time(&mut || r::memcpy_htod_async(pa, &pageable[..], cs))?;
        let d2h_p = time(&mut || r::memcpy_dtoh_async(&mut host_pinned[..], pa, cs))?;
        let d2h_u = time(&mut || r::memcpy_dtoh_async(&mut pageable[..], pa, cs))?;
        let (driver_version, pcie) = nvml_facts();
        drop((a, b));
        let b = bytes as f64;
        let hbm_read = be.read_bandwidth(bytes).map_err(|e| e.to_string())?;
        let matmul = matmul_rate(&be, 512, 4096, 4096)?;
        let attention = AttentionProbe::PROMPT_7B.flops_per_s(&be)?;
        let (major, minor) = info.compute_capability;
        let capability = (major * 10 + minor) as u32;
        Ok(GpuProfile {
            name: info.name,
            compute_capability: info.compute_capability,
            total_bytes: info.total_bytes,
            free_bytes: info.free_bytes,
            multiprocessors: info.multiprocessors,
            driver_version,
            pcie,
            d2d_bytes_per_s: 2.0 * b / d2d,
            hbm_read_bytes_per_s: hbm_read,
            fixed_bytes: be.fixed_bytes(),
            fixed_cost: be.fixed_cost(),
            matmul_flops_per_s: matmul,
            attention_flops_per_s: attention,
            h2d_pinned_bytes_per_s: b / h2d_p,
            h2d_pageable_bytes_per_s: b / h2d_u,
            d2h_pinned_bytes_per_s: b / d2h_p,
            d2h_pageable_bytes_per_s: b / d2h_u,
            kernels: crate::backend::cuda::kernels::build_info_for(capability),
            programmatic_launch: crate::backend::cuda::kernels::kernels_wait_for_grids(
                info.compute_capability.0,
            ),
            flash_attention: crate::footprint::attention::flash_attention_runs(capability),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The read-start probe runs hybrid's cold pass on a pool and gives a time (the cold pass's
    /// own arguments checked by the kernels it calls): finite, not negative.
    #[test]
    fn the_read_start_probe_runs_the_cold_pass() {
        let cpu = crate::backend::cpu::CpuBackend::new(2).unwrap();
        let s = cpu_read_start_s(&cpu, 4 << 20, 20e9).unwrap();
        assert!(s.is_finite() && s >= 0.0, "{s}");
        // Far faster DRAM than any: the bytes explain none of the time, every read its start.
        let slow = cpu_read_start_s(&cpu, 4 << 20, 1e15).unwrap();
        assert!(slow > 0.0, "{slow}");
    }
}
