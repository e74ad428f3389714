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
