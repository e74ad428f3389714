// The bundled FFN (neuron i = [gate_i | up_i | down_i] or [up_i | down_i], see src/store) in
// every bundle encoding: f32, f16, bf16, INT8 (per part an f32 scale, then d i8 codes) and INT4
// (per group of 32 an f16 scale, then the codes two per byte); each bundle is `row_bytes` long.
// `up` computes the hidden activations of a run of neurons, one warp per neuron for up to
// MAX_TOKENS tokens; `down` adds their weighted down columns to the output, each block a run of
// neurons and a tile of output columns, accumulated with atomics. With `idx` (device neuron
// ids, else null) both run over the listed neurons only: neuron idx[i] of the run, its hidden
// value in column col0 + i (compact), its up bias at col0 + idx[i].
// One kernel pair per encoding (`ffn_bundles_up_<enc>`), from one template: the decode of one
// element (`Part::at`, kernels/bundle_codes.cuh) is the only thing that differs.
#include "bundle_codes.cuh"

#define WARPS 8
#define DOWN_TILE 256
#define DOWN_NEURONS 64

template <int E>
__device__ __forceinline__ void bundles_up(const u8* b, long long row_bytes, int neurons, int parts, int d,
                                           const float* x, int n, int kind, float threshold, const float* up_bias,
                                           float* h, int h_stride, int col0, const unsigned* idx) {
    int i = blockIdx.x * WARPS + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (i >= neurons) return;
    int row = idx ? (int)idx[i] : i;
    const u8* bundle = b + (long long)row * row_bytes;
    bool gated = parts == 3;
    Part<E> up(bundle, parts, d, gated ? 1 : 0);
    Part<E> gate(bundle, parts, d, 0);
    float ga[MAX_TOKENS], ua[MAX_TOKENS];
#pragma unroll
    for (int t = 0; t < MAX_TOKENS; t++) ga[t] = ua[t] = 0.0f;
    for (int j = lane; j < d; j += 32) {
        float u = up.at(j);
        float gv = gated ? gate.at(j) : 0.0f;
#pragma unroll
        for (int t = 0; t < MAX_TOKENS; t++) {
            if (t < n) {
                float xv = x[(long long)t * d + j];
                ua[t] += u * xv;
                ga[t] += gv * xv;
            }
        }
    }
#pragma unroll
    for (int t = 0; t < MAX_TOKENS; t++) {
        if (t < n) {
            float u = warp_sum(ua[t]);
            float g = warp_sum(ga[t]);
            if (lane == 0) {
                float v = gated ? sparse_act(act(g, kind), threshold) * u
                                : sparse_act(act(u + (up_bias ? up_bias[col0 + row] : 0.0f), kind), threshold);
                h[(long long)t * h_stride + col0 + i] = v;
            }
        }
    }
}

// Grid: (ceil(d / DOWN_TILE), ceil(neurons / DOWN_NEURONS)); block DOWN_TILE threads.
template <int E>
__device__ __forceinline__ void bundles_down(const u8* b, long long row_bytes, int neurons, int parts, int d,
                                             const float* h, int n, int h_stride, int col0, float* out,
                                             const unsigned* idx) {
    int j = blockIdx.x * DOWN_TILE + threadIdx.x;
    int i0 = blockIdx.y * DOWN_NEURONS;
    int i1 = min(i0 + DOWN_NEURONS, neurons);
    __shared__ float hs[MAX_TOKENS][DOWN_NEURONS];
    for (int k = threadIdx.x; k < MAX_TOKENS * DOWN_NEURONS; k += blockDim.x) {
        int t = k / DOWN_NEURONS, i = i0 + k % DOWN_NEURONS;
        hs[t][k % DOWN_NEURONS] = (t < n && i < i1) ? h[(long long)t * h_stride + col0 + i] : 0.0f;
    }
    __syncthreads();
    if (j >= d) return;
    float acc[MAX_TOKENS];
#pragma unroll
    for (int t = 0; t < MAX_TOKENS; t++) acc[t] = 0.0f;
    for (int i = i0; i < i1; i++) {
        long long row = idx ? (long long)idx[i] : i;
        float c = Part<E>(b + row * row_bytes, parts, d, parts - 1).at(j);
#pragma unroll
        for (int t = 0; t < MAX_TOKENS; t++)
            if (t < n) acc[t] += hs[t][i - i0] * c;
    }
#pragma unroll
    for (int t = 0; t < MAX_TOKENS; t++)
        if (t < n) atomicAdd(out + (long long)t * d + j, acc[t]);
}

#define BUNDLE_KERNELS(SUFFIX, E)                                                                                  \
    extern "C" __global__ void ffn_bundles_up_##SUFFIX(const u8* b, long long row_bytes, int neurons, int parts,  \
                                                       int d, const float* x, int n, int kind, float threshold,   \
                                                       const float* up_bias, float* h, int h_stride, int col0,    \
                                                       const unsigned* idx) {                                     \
        grid_dependency();                                                                                        \
        bundles_up<E>(b, row_bytes, neurons, parts, d, x, n, kind, threshold, up_bias, h, h_stride, col0, idx);   \
    }                                                                                                              \
    extern "C" __global__ void ffn_bundles_down_##SUFFIX(const u8* b, long long row_bytes, int neurons, int parts, \
                                                         int d, const float* h, int n, int h_stride, int col0,    \
                                                         float* out, const unsigned* idx) {                       \
        grid_dependency();                                                                                        \
        bundles_down<E>(b, row_bytes, neurons, parts, d, h, n, h_stride, col0, out, idx);                         \
    }

BUNDLE_KERNELS(f32, BE_F32)
BUNDLE_KERNELS(f16, BE_F16)
BUNDLE_KERNELS(bf16, BE_BF16)
BUNDLE_KERNELS(int8, BE_INT8)
BUNDLE_KERNELS(int4, BE_INT4)
