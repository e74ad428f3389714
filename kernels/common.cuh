// Shared helpers for every kernel file. Self-contained (no CUDA headers) so the same source
// compiles with nvcc at build time and with NVRTC at run time.
#pragma once

#ifdef KERNEL_HOST_CHECK
#include "host/shim.h"
#endif

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;

// Storage formats, numbered as `DType` in src/tensor.rs.
#define DT_F32 0
#define DT_F16 1
#define DT_BF16 2
#define DT_Q8_0 3
#define DT_Q4_0 4
#define DT_Q4_1 5
#define DT_Q5_0 6
#define DT_Q5_1 7
#define DT_Q2_K 8
#define DT_Q3_K 9
#define DT_Q4_K 10
#define DT_Q5_K 11
#define DT_Q6_K 12

// Activations, numbered as `Act` in src/backend/mod.rs.
#define ACT_SILU 0
#define ACT_RELU 1
#define ACT_GELU 2
#define ACT_GELU_TANH 3

// Tokens one matvec launch handles (their accumulators live in registers): float formats,
// and block formats (whose decode costs more, so more tokens share it).
#define MAX_TOKENS 8
#define MAX_QTOKENS 16

__device__ __forceinline__ float h2f(u16 h) {
#ifdef KERNEL_HOST_CHECK
    return host_h2f(h);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#endif
}

__device__ __forceinline__ u16 f2h(float f) {
#ifdef KERNEL_HOST_CHECK
    return host_f2h(f);
#else
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#endif
}

// Every kernel starts here. Launched with programmatic stream serialization (CUDA's programmatic
// dependent launch, sm_90: `--programmatic-launch`), a kernel's blocks may be scheduled while the
// kernel before it in the stream still runs: they wait here until that grid has finished and its
// writes are visible, then let the next kernel's blocks be scheduled as theirs finish, so a
// launch's start overlaps its predecessor's end. Launched plainly (or built below compute_90,
// where this is empty) the wait has nothing to wait for. kernels.rs's tests hold every kernel
// to calling it first, or (the matvecs, kernels/matvec.cu) right after asking L2 for the weight
// rows it will read, which no kernel writes.
__device__ __forceinline__ void grid_dependency() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ float bf2f(u16 b) { return __uint_as_float(((u32)b) << 16); }

__device__ __forceinline__ u16 f2bf(float f) {
    // Round to nearest even, as torch and the half crate do.
    u32 u = __float_as_uint(f);
    u32 rounding = 0x7fffu + ((u >> 16) & 1u);
    return (u16)((u + rounding) >> 16);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ double warp_sum_d(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ int warp_sum_i(int v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over a block of blockDim.x threads (a multiple of 32, at most 1024); every thread gets
// the result. `scratch` holds 32 values.
__device__ __forceinline__ double block_sum_d(double v, double* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum_d(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    int warps = (blockDim.x + 31) >> 5;
    v = (lane < warps) ? scratch[lane] : 0.0;
    return warp_sum_d(v);
}

__device__ __forceinline__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    int warps = (blockDim.x + 31) >> 5;
    v = (lane < warps) ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    int warps = (blockDim.x + 31) >> 5;
    v = (lane < warps) ? scratch[lane] : -3.0e38f;
    return warp_max(v);
}

__device__ __forceinline__ u16 load_u16(const u8* p) { return (u16)p[0] | ((u16)p[1] << 8); }

// Row of a KV cache holding position r: r itself (table null: a sequence's own cache), or
// through a block table into the shared pool, position r at table[r / 16]·16 + r % 16
// (KV_BLOCK in src/backend/mod.rs).
#define KV_BLOCK 16
__device__ __forceinline__ long long kv_row(const unsigned* table, int r) {
    return table ? (long long)table[r / KV_BLOCK] * KV_BLOCK + r % KV_BLOCK : (long long)r;
}

// Byte size of one row of `cols` values in `dtype`.
__device__ __forceinline__ long long row_bytes(int dtype, int cols) {
    switch (dtype) {
        case DT_F32: return 4LL * cols;
        case DT_F16:
        case DT_BF16: return 2LL * cols;
        case DT_Q8_0: return (long long)(cols / 32) * 34;
        case DT_Q4_0: return (long long)(cols / 32) * 18;
        case DT_Q4_1: return (long long)(cols / 32) * 20;
        case DT_Q5_0: return (long long)(cols / 32) * 22;
        case DT_Q5_1: return (long long)(cols / 32) * 24;
        case DT_Q2_K: return (long long)(cols / 256) * 84;
        case DT_Q3_K: return (long long)(cols / 256) * 110;
        case DT_Q4_K: return (long long)(cols / 256) * 144;
        case DT_Q5_K: return (long long)(cols / 256) * 176;
        default: return (long long)(cols / 256) * 210;  // Q6_K
    }
}

// The 6-bit scale (`sc`) or min (`!sc`) of sub-block j of a Q4_K/Q5_K block's 12 scale bytes.
__device__ __forceinline__ int scale_min_k4(const u8* q, int j, bool sc) {
    if (j < 4) return sc ? (q[j] & 63) : (q[j + 4] & 63);
    return sc ? ((q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4)) : ((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
}

// Value v (0..256) of a K-quant block at `b` (the reference decode, as src/tensor/blocks.rs).
// Products are rounded one by one (__fmul_rn: no fused multiply-add), as ggml's C code does.
__device__ __forceinline__ float load_k_elem(const u8* b, int dtype, int v) {
    switch (dtype) {
        case DT_Q2_K: {
            int n = v >> 7, j = (v & 127) >> 5, r = v & 31;
            int sc = b[8 * n + 2 * j + (r >> 4)];
            int q = (b[16 + 32 * n + r] >> (2 * j)) & 3;
            float dl = __fmul_rn(h2f(load_u16(b + 80)), (float)(sc & 0x0f));
            float ml = __fmul_rn(h2f(load_u16(b + 82)), (float)(sc >> 4));
            return __fsub_rn(__fmul_rn(dl, (float)q), ml);
        }
        case DT_Q3_K: {
            int n = v >> 7, j = (v & 127) >> 5, r = v & 31;
            int s = 8 * n + 2 * j + (r >> 4);
            const u8* sc = b + 96;
            int low = s < 8 ? (sc[s] & 0x0f) : (sc[s - 8] >> 4);
            int high = (sc[8 + (s & 3)] >> (2 * (s >> 2))) & 3;
            int q = ((b[32 + 32 * n + r] >> (2 * j)) & 3) - (((b[r] >> (4 * n + j)) & 1) ? 0 : 4);
            float dl = __fmul_rn(h2f(load_u16(b + 108)), (float)((low | (high << 4)) - 32));
            return __fmul_rn(dl, (float)q);
        }
        case DT_Q4_K:
        case DT_Q5_K: {
            int c = v >> 6, upper = (v >> 5) & 1, l = v & 31;
            const u8* qs = b + (dtype == DT_Q4_K ? 16 : 48);
            int q = upper ? (qs[32 * c + l] >> 4) : (qs[32 * c + l] & 0x0f);
            if (dtype == DT_Q5_K && ((b[16 + l] >> (2 * c + upper)) & 1)) q += 16;
            float d = __fmul_rn(h2f(load_u16(b)), (float)scale_min_k4(b + 4, 2 * c + upper, true));
            float m = __fmul_rn(h2f(load_u16(b + 2)), (float)scale_min_k4(b + 4, 2 * c + upper, false));
            return __fsub_rn(__fmul_rn(d, (float)q), m);
        }
        default: {  // Q6_K
            int half = v >> 7, k = (v & 127) >> 5, l = v & 31;
            int lo = b[64 * half + l + 32 * (k & 1)];
            lo = k < 2 ? (lo & 0x0f) : (lo >> 4);
            int hi = (b[128 + 32 * half + l] >> (2 * k)) & 3;
            int sc = (int)(i8)b[192 + 8 * half + (l >> 4) + 2 * k];
            float ds = __fmul_rn(h2f(load_u16(b + 208)), (float)sc);
            return __fmul_rn(ds, (float)((lo | (hi << 4)) - 32));
        }
    }
}

// Value j of a row in any format (the reference decode, as src/tensor.rs::decode_row).
__device__ __forceinline__ float load_elem(const u8* row, int dtype, int j) {
    switch (dtype) {
        case DT_F32: return ((const float*)row)[j];
        case DT_F16: return h2f(((const u16*)row)[j]);
        case DT_BF16: return bf2f(((const u16*)row)[j]);
        case DT_Q8_0: {
            const u8* b = row + (j / 32) * 34;
            return h2f(load_u16(b)) * (float)(i8)b[2 + (j % 32)];
        }
        case DT_Q4_0: {
            const u8* b = row + (j / 32) * 18;
            int k = j % 32;
            int q = k < 16 ? (b[2 + k] & 0x0f) : (b[2 + k - 16] >> 4);
            return h2f(load_u16(b)) * (float)(q - 8);
        }
        case DT_Q4_1: {
            const u8* b = row + (j / 32) * 20;
            int k = j % 32;
            int q = k < 16 ? (b[4 + k] & 0x0f) : (b[4 + k - 16] >> 4);
            return h2f(load_u16(b)) * (float)q + h2f(load_u16(b + 2));
        }
        case DT_Q5_0:
        case DT_Q5_1: {
            bool with_min = dtype == DT_Q5_1;
            const u8* b = row + (j / 32) * (with_min ? 24 : 22);
            const u8* qh = b + (with_min ? 4 : 2);
            int k = j % 32;
            int nib = k < 16 ? (qh[4 + k] & 0x0f) : (qh[4 + k - 16] >> 4);
            int q = nib | (((qh[k >> 3] >> (k & 7)) & 1) << 4);
            float d = h2f(load_u16(b));
            if (with_min) return __fadd_rn(__fmul_rn((float)q, d), h2f(load_u16(b + 2)));
            return __fmul_rn((float)(q - 16), d);
        }
        default: {  // K-quants
            int bytes = (int)row_bytes(dtype, 256);
            return load_k_elem(row + (long long)(j / 256) * bytes, dtype, j % 256);
        }
    }
}

// Element e of a KV cache row in storage format DT (f32, f16 or Q8_0: `KvType`).
template <int DT>
__device__ __forceinline__ float kv_elem(const u8* row, int e) {
    if (DT == DT_F32) return ((const float*)row)[e];
    if (DT == DT_F16) return h2f(((const u16*)row)[e]);
    const u8* b = row + (e >> 5) * 34;  // Q8_0
    return h2f(load_u16(b)) * (float)(i8)b[2 + (e & 31)];
}

// 32 activations quantized to 8 bits, laid out as `ActBlock` in src/backend/cpu/kernels.rs:
// x ≈ d·q, d and s = d·Σq rounded to f16 (held as f32), isum = Σq exact.
struct ActBlock {
    float d;
    float s;
    int isum;
    int qs[8];  // 32 i8 codes, 4 per int (little-endian bytes)
};

// One ActBlock from a warp, lane k holding value k, exactly as the CPU quantizer: d =
// max|x|/127 (stored f16-rounded), q = round-half-even(x·127/max|x|), s = f16(d·Σq).
__device__ __forceinline__ void quantize_block_warp(float v, ActBlock* o) {
    int lane = threadIdx.x & 31;
    float amax = warp_max(fabsf(v));
    float d = amax / 127.0f;
    float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    int q = __float2int_rn(v * id);
    int isum = warp_sum_i(q);
    // Gather the 32 codes into 8 little-endian ints: lane k holds byte k % 4 of int k / 4.
    u32 byte = (u32)(q & 0xff) << (8 * (lane & 3));
    byte |= __shfl_xor_sync(0xffffffffu, byte, 1);
    byte |= __shfl_xor_sync(0xffffffffu, byte, 2);
    if ((lane & 3) == 0) o->qs[lane >> 2] = (int)byte;
    if (lane == 0) {
        o->d = h2f(f2h(d));
        o->isum = isum;
        o->s = h2f(f2h(d * (float)isum));
    }
}

__device__ __forceinline__ float act(float x, int kind) {
    switch (kind) {
        case ACT_SILU: return x / (1.0f + expf(-x));
        case ACT_RELU: return fmaxf(x, 0.0f);
        case ACT_GELU: return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
        default: return 0.5f * x * (1.0f + tanhf(0.7978846f * (x + 0.044715f * x * x * x)));
    }
}

// The FFN sparsity mask (src/backend/mod.rs sparse_act): an activation of magnitude at most
// `threshold` counts as inactive; threshold <= 0 leaves every value as it is.
__device__ __forceinline__ float sparse_act(float a, float threshold) {
    return (threshold > 0.0f && fabsf(a) <= threshold) ? 0.0f : a;
}

// A gated FFN's hidden activation from its gate and up products: act(g), masked, times u.
__device__ __forceinline__ float gated_value(float g, float u, int kind, float threshold) {
    return sparse_act(act(g, kind), threshold) * u;
}

// One value of a KV cache row in DT_F32 or DT_F16 (position `pos`, column `col`), converted as
// store_rows converts it.
__device__ __forceinline__ void put_kv(u8* dst, int dt, const unsigned* table, int pos, int cols, int col, float v) {
    u8* row = dst + kv_row(table, pos) * row_bytes(dt, cols);
    if (dt == DT_F32)
        ((float*)row)[col] = v;
    else
        ((u16*)row)[col] = f2h(v);
}

// Store `rows` rows of `cols` f32 values into the cache `dst` in DT, source row t at position
// first_row + t (row kv_row(table, first_row + t)), converted as the host's `tensor::encode_row`
// does, bit for bit. f32/f16: a thread per value; Q8_0: a warp per 32-value block —
// d = amax/127, q = round(x·(1/d)), d kept as f16 — as llama.cpp's reference quantizer.
__device__ __forceinline__ void store_rows(long long i, const float* src, long long rows, int cols, int dt, u8* dst,
                                           const unsigned* table, int first_row) {
    long long n = rows * cols;
    const long long rb = row_bytes(dt, cols);
    if (dt == DT_F32 || dt == DT_F16) {
        if (i < n) put_kv(dst, dt, table, first_row + (int)(i / cols), cols, (int)(i % cols), src[i]);
        return;
    }
    // Q8_0: value i of the flattened rows (cols is a multiple of 32, so blocks never straddle rows).
    long long b = i >> 5;
    int lane = threadIdx.x & 31;
    if (b >= n / 32) return;
    float v = src[i];
    float amax = warp_max(fabsf(v));
    float d = amax / 127.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    const int row_blocks = cols / 32;
    u8* blk = dst + kv_row(table, first_row + (int)(b / row_blocks)) * rb + (b % row_blocks) * 34;
    blk[2 + lane] = (u8)(i8)roundf(v * id);
    if (lane == 0) *(u16*)blk = f2h(d);
}
