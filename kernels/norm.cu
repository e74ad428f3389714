// RMSNorm and LayerNorm, one block per row; sums in double as the CPU backend does.
#include "common.cuh"

// A normed value as the next op takes it: f32, or f16 (as f32_to_f16 rounds it) where the rows go
// straight to cuBLAS as its f16 input.
__device__ __forceinline__ void put_normed(float* p, float v) { *p = v; }
__device__ __forceinline__ void put_normed(u16* p, float v) { *p = f2h(v); }

// One row (block) of out = rms_norm(x), after x += y where ADD.
template <bool ADD, typename Out>
__device__ __forceinline__ void rms_norm_row(float* x, const float* y, const float* w, float eps, Out* out,
                                             int cols) {
    __shared__ double scratch[32];
    float* xr = x + (long long)blockIdx.x * cols;
    Out* orow = out + (long long)blockIdx.x * cols;
    double ss = 0.0;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
        float v = xr[j];
        if (ADD) {
            v += y[(long long)blockIdx.x * cols + j];
            xr[j] = v;
        }
        ss += (double)v * (double)v;
    }
    ss = block_sum_d(ss, scratch);
    float scale = 1.0f / sqrtf((float)(ss / cols) + eps);
    for (int j = threadIdx.x; j < cols; j += blockDim.x) put_normed(orow + j, xr[j] * scale * w[j]);
}

extern "C" __global__ void rms_norm(const float* x, const float* w, float eps, float* out, int cols) {
    grid_dependency();
    rms_norm_row<false>((float*)x, nullptr, w, eps, out, cols);
}

// x += y, then out = rms_norm(x): the residual add and the next norm in one pass (each value
// added as add_f32 adds it, the sum as rms_norm takes it).
extern "C" __global__ void add_rms_norm(float* x, const float* y, const float* w, float eps, float* out, int cols) {
    grid_dependency();
    rms_norm_row<true>(x, y, w, eps, out, cols);
}

// rms_norm and add_rms_norm writing the normed rows in f16 (rms_norm then f32_to_f16, bit for
// bit): the input of the GEMMs after them, where the f32 rows would be written, read back and
// converted.
extern "C" __global__ void rms_norm_f16(const float* x, const float* w, float eps, u16* out, int cols) {
    grid_dependency();
    rms_norm_row<false>((float*)x, nullptr, w, eps, out, cols);
}

extern "C" __global__ void add_rms_norm_f16(float* x, const float* y, const float* w, float eps, u16* out, int cols) {
    grid_dependency();
    rms_norm_row<true>(x, y, w, eps, out, cols);
}

// rms_norm and add_rms_norm writing the normed rows as 8-bit activation blocks (`out`: cols / 32
// ActBlocks a row), as quantize_q8 makes them from the f32 rows rms_norm writes, bit for bit: the
// block-format matvecs' input, where a row too wide to quantize inside their blocks would take a
// launch of its own. Each warp takes 32-value blocks of the row in turn, its lane k value k.
template <bool ADD>
__device__ __forceinline__ void rms_norm_q8_row(float* x, const float* y, const float* w, float eps, ActBlock* out,
                                                int cols) {
    __shared__ double scratch[32];
    float* xr = x + (long long)blockIdx.x * cols;
    const float* yr = ADD ? y + (long long)blockIdx.x * cols : nullptr;
    double ss = 0.0;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
        float v = xr[j];
        if (ADD) {
            v += yr[j];
            xr[j] = v;
        }
        ss += (double)v * (double)v;
    }
    ss = block_sum_d(ss, scratch);  // ends with a barrier: the sums written above are seen
    const float scale = 1.0f / sqrtf((float)(ss / cols) + eps);
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    ActBlock* orow = out + (long long)blockIdx.x * (cols / 32);
    for (int b = threadIdx.x >> 5; b < cols / 32; b += warps) {
        const int j = 32 * b + lane;
        quantize_block_warp(xr[j] * scale * w[j], orow + b);
    }
}

extern "C" __global__ void rms_norm_q8(const float* x, const float* w, float eps, ActBlock* out, int cols) {
    grid_dependency();
    rms_norm_q8_row<false>((float*)x, nullptr, w, eps, out, cols);
}

extern "C" __global__ void add_rms_norm_q8(float* x, const float* y, const float* w, float eps, ActBlock* out,
                                           int cols) {
    grid_dependency();
    rms_norm_q8_row<true>(x, y, w, eps, out, cols);
}

extern "C" __global__ void layer_norm(const float* x, const float* w, const float* b, float eps, float* out, int cols) {
    grid_dependency();
    __shared__ double scratch[32];
    const float* xr = x + (long long)blockIdx.x * cols;
    float* orow = out + (long long)blockIdx.x * cols;
    double s = 0.0;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) s += (double)xr[j];
    double mean = block_sum_d(s, scratch) / cols;
    double v = 0.0;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
        double c = (double)xr[j] - mean;
        v += c * c;
    }
    double var = block_sum_d(v, scratch) / cols;
    double inv = 1.0 / sqrt(var + (double)eps);
    for (int j = threadIdx.x; j < cols; j += blockDim.x) orow[j] = (float)(((double)xr[j] - mean) * inv) * w[j] + b[j];
}
