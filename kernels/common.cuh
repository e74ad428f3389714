// Shared helpers for every kernel file. Self-contained (no CUDA headers) so the same source
// compiles with nvcc at build time and with NVRTC at run time.
#pragma once

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

// Activations, numbered as `Act` in src/backend/mod.rs.
#define ACT_SILU 0
#define ACT_RELU 1
#define ACT_GELU 2
#define ACT_GELU_TANH 3

// Tokens one matvec launch handles (their accumulators live in registers).
#define MAX_TOKENS 8

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
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

// Byte size of one row of `cols` values in `dtype`.
__device__ __forceinline__ long long row_bytes(int dtype, int cols) {
    switch (dtype) {
        case DT_F32: return 4LL * cols;
        case DT_F16:
        case DT_BF16: return 2LL * cols;
        case DT_Q8_0: return (long long)(cols / 32) * 34;
        case DT_Q4_0: return (long long)(cols / 32) * 18;
        default: return (long long)(cols / 32) * 20;  // Q4_1
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
        default: {  // Q4_1
            const u8* b = row + (j / 32) * 20;
            int k = j % 32;
            int q = k < 16 ? (b[4 + k] & 0x0f) : (b[4 + k - 16] >> 4);
            return h2f(load_u16(b)) * (float)q + h2f(load_u16(b + 2));
        }
    }
}

// 32 activations quantized to 8 bits, laid out as `ActBlock` in src/backend/cpu/kernels.rs:
// x ≈ d·q, d and s = d·Σq rounded to f16 (held as f32), isum = Σq exact.
struct ActBlock {
    float d;
    float s;
    int isum;
    int qs[8];  // 32 i8 codes, 4 per int (little-endian bytes)
};

__device__ __forceinline__ float act(float x, int kind) {
    switch (kind) {
        case ACT_SILU: return x / (1.0f + expf(-x));
        case ACT_RELU: return fmaxf(x, 0.0f);
        case ACT_GELU: return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
        default: return 0.5f * x * (1.0f + tanhf(0.7978846f * (x + 0.044715f * x * x * x)));
    }
}
