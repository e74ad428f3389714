//! CPU matmul kernels per storage format: decode (one token) and prefill (64 tokens) shapes;
//! and attention's kernels on a block of key and value rows held in the caches (`attention_*`:
//! the scores of a tile of query heads beside the same products one `dot_f32` each, and the
//! weighted value sums), in FLOPs a second.
//! Throughput is reported in weight bytes per second, the figure to hold against DRAM
//! bandwidth: the bench prints the machine's DRAM read bandwidth at the same thread count first
//! (`hw::dram_read_bandwidth`, as `gpu-offload doctor` measures it).
//!
//! `BENCH_THREADS` (default 2), `GPU_OFFLOAD_KERNELS` (a kernel set name), `BENCH_DTYPES`
//! (comma-separated format names, default all).

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use gpu_offload::backend::cpu::kernels;
use gpu_offload::backend::cpu::matmul::matmul;
use gpu_offload::tensor::{Bytes, DType, HostTensor};

fn weight(dtype: DType, rows: usize, cols: usize) -> HostTensor {
    // Deterministic bytes; for block formats keep the f16 scales finite (small positive).
    let n = dtype.bytes_for(rows * cols);
    let mut bytes: Vec<u8> = (0..n)
        .map(|i| ((i * 2654435761usize) >> 13) as u8)
        .collect();
    let block = dtype.block_bytes();
    // Byte offsets of each block format's f16 scale fields.
    let scales: &[usize] = match dtype {
        DType::Q8_0 | DType::Q4_0 | DType::Q5_0 => &[0],
        DType::Q4_1 | DType::Q5_1 | DType::Q4K | DType::Q5K => &[0, 2],
        DType::Q2K => &[80, 82],
        DType::Q3K => &[108],
        DType::Q6K => &[208],
        DType::F32 | DType::F16 | DType::BF16 => &[],
    };
    match dtype {
        _ if dtype.is_quantized() => {
            for b in bytes.chunks_mut(block) {
                for (k, &at) in scales.iter().enumerate() {
                    let v = if k == 0 { 0.01 } else { -0.05 };
                    b[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
                }
            }
        }
        DType::F16 | DType::BF16 => {
            for h in bytes.chunks_mut(2) {
                h[1] &= 0x3b; // keep exponents small
            }
        }
        DType::F32 => {
            for f in bytes.chunks_mut(4) {
                f[3] = 0x3c;
            }
        }
        _ => {}
    }
    HostTensor {
        name: "w".into(),
        rows,
        cols,
        dtype,
        data: Bytes::from_slice(&bytes),
    }
}

fn bench(c: &mut Criterion) {
    let threads = std::env::var("BENCH_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    let kernel_set = std::env::var("GPU_OFFLOAD_KERNELS")
        .ok()
        .and_then(|n| kernels::by_name(&n))
        .unwrap_or_else(kernels::best);
    let dtypes: Vec<DType> = match std::env::var("BENCH_DTYPES") {
        Ok(list) => list
            .split(',')
            .map(|n| DType::parse(n.trim()).unwrap_or_else(|| panic!("unknown format {n}")))
            .collect(),
        Err(_) => DType::ALL.to_vec(),
    };
    let dram = gpu_offload::runtime::probe::dram_read_bandwidth(threads, 1 << 30, 5);
    println!(
        "DRAM read bandwidth, {threads} threads: {:.1} GB/s (the bound for every matmul below)",
        dram / 1e9
    );
    for (rows, cols, n) in [
        (1536usize, 576usize, 1usize),
        // Batched decode of a small model (8 sequences: SmolLM2's up and down shapes).
        (1536, 576, 8),
        (576, 1536, 8),
        (49152, 576, 1),
        (49152, 576, 8),
        (4096, 4096, 1),
        (11008, 4096, 1),
        // Every format's weight well beyond the last-level cache (the DRAM-bound figure).
        (65536, 4096, 1),
        (1536, 576, 64),
        (1536, 1024, 64),
    ] {
        let mut g = c.benchmark_group(format!(
            "matmul_{rows}x{cols}_n{n}_t{threads}_{}",
            kernel_set.name
        ));
        for &dtype in &dtypes {
            if !cols.is_multiple_of(dtype.block_len()) {
                continue;
            }
            let w = weight(dtype, rows, cols);
            let x: Vec<f32> = (0..n * cols)
                .map(|i| ((i % 97) as f32 - 48.0) / 48.0)
                .collect();
            let mut out = vec![0f32; n * rows];
            g.throughput(Throughput::Bytes(w.data.len() as u64));
            g.bench_with_input(BenchmarkId::from_parameter(dtype), &w, |b, w| {
                b.iter(|| pool.install(|| matmul(kernel_set, w, &x, n, &mut out)))
            });
        }
        g.finish();
    }
}

/// Attention's inner kernels over one block of 16 cached rows (in L1, as `attend_chunk` holds
/// them): decode (one query head of 128), a prompt tile of 7B heads (8 query rows of 128) and
/// of SmolLM2's (8 rows × 3 heads sharing a KV head, 64).
fn attention(c: &mut Criterion) {
    let kernel_set = std::env::var("GPU_OFFLOAD_KERNELS")
        .ok()
        .and_then(|n| kernels::by_name(&n))
        .unwrap_or_else(kernels::best);
    const KEYS: usize = 16;
    for (queries, hd) in [(1usize, 128usize), (8, 128), (24, 64)] {
        let mut g = c.benchmark_group(format!(
            "attention_{queries}q_{KEYS}k_hd{hd}_{}",
            kernel_set.name
        ));
        let vals = |n: usize, seed: usize| -> Vec<f32> {
            (0..n)
                .map(|i| (((i * 31 + seed) % 97) as f32 - 48.0) / 48.0)
                .collect()
        };
        let q = vals(queries * hd, 1);
        let kv = vals(KEYS * hd, 2);
        let qs: Vec<&[f32]> = q.chunks_exact(hd).collect();
        let rows: Vec<&[f32]> = kv.chunks_exact(hd).collect();
        let w = vals(KEYS, 3);
        let mut out = vec![0f32; queries * KEYS];
        let mut acc = vec![0f32; queries * hd];
        g.throughput(Throughput::Elements((2 * queries * KEYS * hd) as u64));
        g.bench_function("scores", |b| {
            b.iter(|| (kernel_set.scores)(&qs, &rows, &mut out))
        });
        g.bench_function("dot_f32_each", |b| {
            b.iter(|| {
                for (qh, o) in qs.iter().zip(out.chunks_exact_mut(KEYS)) {
                    for (o, k) in o.iter_mut().zip(&rows) {
                        *o = (kernel_set.dot_f32)(qh, k);
                    }
                }
            })
        });
        g.bench_function("axpy_rows", |b| {
            b.iter(|| {
                for a in acc.chunks_exact_mut(hd) {
                    (kernel_set.axpy_rows)(a, &w, &rows);
                }
            })
        });
        g.finish();
    }
}

criterion_group!(benches, bench, attention);
criterion_main!(benches);
