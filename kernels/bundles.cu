// The bundled FFN (neuron i = [gate_i | up_i | down_i] in f16, see src/store): `up` computes the
// hidden activations of a run of neurons, one warp per neuron for up to MAX_TOKENS tokens;
// `down` adds their weighted down columns to the output, each block a run of neurons and a tile
// of output columns, accumulated with atomics. With `idx` (device neuron ids, else null) both
// run over the listed neurons only: neuron idx[i] of the run, its hidden value in column col0 + i
// (compact), its up bias at col0 + idx[i].
#include "common.cuh"

#define WARPS 8
#define DOWN_TILE 256
#define DOWN_NEURONS 64

extern "C" __global__ void ffn_bundles_up(const u16* b, int neurons, int parts, int d, const float* x, int n,
                                          int kind, float threshold, const float* up_bias, float* h, int h_stride,
                                          int col0, const unsigned* idx) {
    int i = blockIdx.x * WARPS + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (i >= neurons) return;
    int row = idx ? (int)idx[i] : i;
    const u16* bundle = b + (long long)row * parts * d;
    const u16* gate = parts == 3 ? bundle : 0;
    const u16* up = parts == 3 ? bundle + d : bundle;
    float ga[MAX_TOKENS], ua[MAX_TOKENS];
#pragma unroll
    for (int t = 0; t < MAX_TOKENS; t++) ga[t] = ua[t] = 0.0f;
    for (int j = lane; j < d; j += 32) {
        float u = h2f(up[j]);
        float gv = gate ? h2f(gate[j]) : 0.0f;
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
                float v = gate ? sparse_act(act(g, kind), threshold) * u
                               : sparse_act(act(u + (up_bias ? up_bias[col0 + row] : 0.0f), kind), threshold);
                h[(long long)t * h_stride + col0 + i] = v;
            }
        }
    }
}

// Grid: (ceil(d / DOWN_TILE), ceil(neurons / DOWN_NEURONS)); block DOWN_TILE threads.
extern "C" __global__ void ffn_bundles_down(const u16* b, int neurons, int parts, int d, const float* h, int n,
                                            int h_stride, int col0, float* out, const unsigned* idx) {
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
        float c = h2f(b[(row * parts + parts - 1) * d + j]);
#pragma unroll
        for (int t = 0; t < MAX_TOKENS; t++)
            if (t < n) acc[t] += hs[t][i - i0] * c;
    }
#pragma unroll
    for (int t = 0; t < MAX_TOKENS; t++)
        if (t < n) atomicAdd(out + (long long)t * d + j, acc[t]);
}
