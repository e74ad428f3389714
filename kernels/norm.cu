// RMSNorm and LayerNorm, one block per row; sums in double as the CPU backend does.
#include "common.cuh"

extern "C" __global__ void rms_norm(const float* x, const float* w, float eps, float* out, int cols) {
    grid_dependency();
    __shared__ double scratch[32];
    const float* xr = x + (long long)blockIdx.x * cols;
    float* orow = out + (long long)blockIdx.x * cols;
    double ss = 0.0;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) ss += (double)xr[j] * (double)xr[j];
    ss = block_sum_d(ss, scratch);
    float scale = 1.0f / sqrtf((float)(ss / cols) + eps);
    for (int j = threadIdx.x; j < cols; j += blockDim.x) orow[j] = xr[j] * scale * w[j];
}

// x += y, then out = rms_norm(x): the residual add and the next norm in one pass (each value
// added as add_f32 adds it, the sum as rms_norm takes it).
extern "C" __global__ void add_rms_norm(float* x, const float* y, const float* w, float eps, float* out, int cols) {
    grid_dependency();
    __shared__ double scratch[32];
    float* xr = x + (long long)blockIdx.x * cols;
    const float* yr = y + (long long)blockIdx.x * cols;
    float* orow = out + (long long)blockIdx.x * cols;
    double ss = 0.0;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
        float v = xr[j] + yr[j];
        xr[j] = v;
        ss += (double)v * (double)v;
    }
    ss = block_sum_d(ss, scratch);
    float scale = 1.0f / sqrtf((float)(ss / cols) + eps);
    for (int j = threadIdx.x; j < cols; j += blockDim.x) orow[j] = xr[j] * scale * w[j];
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
