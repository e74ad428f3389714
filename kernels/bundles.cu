// The bundled FFN (neuron i = [gate_i | up_i | down_i] or [up_i | down_i], see src/store) in
// every bundle encoding: f32, f16, bf16, INT8 (per part an f32 scale, then d i8 codes) and INT4
// (per group of 32 an f16 scale, then the codes two per byte); each bundle is `row_bytes` long.
// `up` computes the hidden activations of a run of neurons, one warp per neuron for up to
// MAX_TOKENS tokens, reading a gated neuron's up part only where the mask leaves it on; `down`
// adds their weighted down columns to the output (skipping neurons off for every token), each
// block a run of neurons and a tile of output columns, accumulated with atomics. With `idx` (device neuron
// ids, else null) both run over the listed neurons only: neuron idx[i] of the run, its hidden
// value in column col0 + i (compact), its up bias at col0 + idx[i].
// With `rest` too (else null), a listed entry with IN_REST (the top bit) set is that row of
// `rest`: a cache unit's slots and the neurons where they rest in host memory (mapped, read in
// place over the link) in one list, so each token's sum stays one chain in list order.
// One kernel pair per encoding (`ffn_bundles_up_<enc>`), from one template: the decode of one
// element (`Part::at`, kernels/bundle_codes.cuh) is the only thing that differs.
#include "bundle_codes.cuh"

#define WARPS 8
#define DOWN_TILE 256
#define DOWN_NEURONS 64
#define IN_REST 0x80000000u

// The bundle entry `i` of a run names: row i of `b`, or the listed row of `b` or of `rest`.
__device__ __forceinline__ const u8* listed_bundle(const u8* b, const u8* rest, long long row_bytes,
                                                   const unsigned* idx, int i) {
    if (!idx) return b + (long long)i * row_bytes;
    unsigned e = idx[i];
    return (e & IN_REST) ? rest + (long long)(e & ~IN_REST) * row_bytes : b + (long long)e * row_bytes;
}

// A lane's share of one part times the n tokens of `x`, added to acc: eight elements a load
// with `vec` (vector_parts: lane l takes j = 8l .. 8l + 8, then 256 on), else one (j = l, then
// 32 on). The warp sums the lanes' shares.
template <int E>
__device__ __forceinline__ void part_dot(const Part<E>& p, bool vec, int d, const float* x, int n, int lane,
                                         float* acc) {
    if (vec) {
        for (int j = lane * 8; j < d; j += 256) {
            float w[8];
            p.at8(j, w);
#pragma unroll
            for (int t = 0; t < MAX_TOKENS; t++) {
                if (t >= n) continue;
                const float* xt = x + (long long)t * d + j;
                float s = 0.0f;
#pragma unroll
                for (int k = 0; k < 8; k++) s += w[k] * xt[k];
                acc[t] += s;
            }
        }
        return;
    }
    for (int j = lane; j < d; j += 32) {
        float w = p.at(j);
#pragma unroll
        for (int t = 0; t < MAX_TOKENS; t++)
            if (t < n) acc[t] += w * x[(long long)t * d + j];
    }
}

template <int E>
__device__ __forceinline__ void bundles_up(const u8* b, const u8* rest, long long row_bytes, int neurons, int parts, int d,
                                           const float* x, int n, int kind, float threshold, const float* up_bias,
                                           float* h, int h_stride, int col0, const unsigned* idx) {
    int i = blockIdx.x * WARPS + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (i >= neurons) return;
    // The up bias goes by row of `b` (none is given with a rest).
    int row = idx ? (int)(idx[i] & ~IN_REST) : i;
    const u8* bundle = listed_bundle(b, rest, row_bytes, idx, i);
    bool gated = parts == 3;
    float ga[MAX_TOKENS], ua[MAX_TOKENS];
#pragma unroll
    for (int t = 0; t < MAX_TOKENS; t++) ga[t] = ua[t] = 0.0f;
    // The deciding part first (the gate, or the up part without one).
    bool vec = vector_parts<E>(d, b, rest);
    part_dot<E>(Part<E>(bundle, parts, d, 0), vec, d, x, n, lane, ga);
    float a[MAX_TOKENS];
    bool on = false;
#pragma unroll
    for (int t = 0; t < MAX_TOKENS; t++) {
        a[t] = 0.0f;
        if (t < n) {
            float g = warp_sum(ga[t]);
            a[t] = gated ? sparse_act(act(g, kind), threshold)
                         : sparse_act(act(g + (up_bias ? up_bias[col0 + row] : 0.0f), kind), threshold);
            on = on || a[t] != 0.0f;
        }
    }
    // A gated neuron the mask leaves off for every token reads no more (every lane agrees:
    // the sums are the warp's).
    if (gated && on) {
        part_dot<E>(Part<E>(bundle, parts, d, 1), vec, d, x, n, lane, ua);
#pragma unroll
        for (int t = 0; t < MAX_TOKENS; t++)
            if (t < n) a[t] *= warp_sum(ua[t]);
    } else if (gated) {
#pragma unroll
        for (int t = 0; t < MAX_TOKENS; t++) a[t] = 0.0f;
    }
    if (lane == 0) {
#pragma unroll
        for (int t = 0; t < MAX_TOKENS; t++)
            if (t < n) h[(long long)t * h_stride + col0 + i] = a[t];
    }
}

// bundles_down where vector_parts: the block's DOWN_TILE columns are a warp's, eight a
// lane (one 16-byte load per neuron), and its warps take every (DOWN_TILE / 32)th of the
// block's neurons; their sums meet in shared memory before the one atomic add per column.
template <int E>
__device__ __forceinline__ void bundles_down_vec(const u8* b, const u8* rest, long long row_bytes, int parts, int d,
                                                 int n, int i0, int i1, const float (*hs)[DOWN_NEURONS], float* out,
                                                 const unsigned* idx) {
    const int warps = DOWN_TILE / 32;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int c = blockIdx.x * DOWN_TILE + lane * 8;
    float acc[MAX_TOKENS][8];
#pragma unroll
    for (int t = 0; t < MAX_TOKENS; t++)
#pragma unroll
        for (int k = 0; k < 8; k++) acc[t][k] = 0.0f;
    if (c < d) {
        for (int i = i0 + warp; i < i1; i += warps) {
            bool on = false;
#pragma unroll
            for (int t = 0; t < MAX_TOKENS; t++) on = on || (t < n && hs[t][i - i0] != 0.0f);
            if (!on) continue;
            float w[8];
            Part<E>(listed_bundle(b, rest, row_bytes, idx, i), parts, d, parts - 1).at8(c, w);
#pragma unroll
            for (int t = 0; t < MAX_TOKENS; t++) {
                if (t >= n) continue;
                float h = hs[t][i - i0];
#pragma unroll
                for (int k = 0; k < 8; k++) acc[t][k] += h * w[k];
            }
        }
    }
    __shared__ float red[DOWN_TILE / 32][DOWN_TILE];
    int col = blockIdx.x * DOWN_TILE + threadIdx.x;
    // Unrolled so acc stays in registers; n is the block's, so every thread meets each barrier.
#pragma unroll
    for (int t = 0; t < MAX_TOKENS; t++) {
        if (t >= n) break;
#pragma unroll
        for (int k = 0; k < 8; k++) red[warp][lane * 8 + k] = acc[t][k];
        __syncthreads();
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < warps; w++) s += red[w][threadIdx.x];
        if (col < d) atomicAdd(out + (long long)t * d + col, s);
        __syncthreads();
    }
}

// Grid: (ceil(d / DOWN_TILE), ceil(neurons / DOWN_NEURONS)); block DOWN_TILE threads.
template <int E>
__device__ __forceinline__ void bundles_down(const u8* b, const u8* rest, long long row_bytes, int neurons, int parts, int d,
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
    if (vector_parts<E>(d, b, rest)) {
        bundles_down_vec<E>(b, rest, row_bytes, parts, d, n, i0, i1, hs, out, idx);
        return;
    }
    if (j >= d) return;
    float acc[MAX_TOKENS];
#pragma unroll
    for (int t = 0; t < MAX_TOKENS; t++) acc[t] = 0.0f;
    for (int i = i0; i < i1; i++) {
        // A neuron off for every token reads nothing (hs is the block's: all threads agree).
        bool on = false;
#pragma unroll
        for (int t = 0; t < MAX_TOKENS; t++) on = on || (t < n && hs[t][i - i0] != 0.0f);
        if (!on) continue;
        float c = Part<E>(listed_bundle(b, rest, row_bytes, idx, i), parts, d, parts - 1).at(j);
#pragma unroll
        for (int t = 0; t < MAX_TOKENS; t++)
            if (t < n) acc[t] += hs[t][i - i0] * c;
    }
#pragma unroll
    for (int t = 0; t < MAX_TOKENS; t++)
        if (t < n) atomicAdd(out + (long long)t * d + j, acc[t]);
}

#define BUNDLE_KERNELS(SUFFIX, E)                                                                                  \
    extern "C" __global__ void ffn_bundles_up_##SUFFIX(const u8* b, const u8* rest, long long row_bytes,          \
                                                       int neurons, int parts,                                    \
                                                       int d, const float* x, int n, int kind, float threshold,   \
                                                       const float* up_bias, float* h, int h_stride, int col0,    \
                                                       const unsigned* idx) {                                     \
        grid_dependency();                                                                                        \
        bundles_up<E>(b, rest, row_bytes, neurons, parts, d, x, n, kind, threshold, up_bias, h, h_stride, col0,   \
                      idx);                                                                                       \
    }                                                                                                              \
    extern "C" __global__ void ffn_bundles_down_##SUFFIX(const u8* b, const u8* rest, long long row_bytes,        \
                                                         int neurons, int parts,                                  \
                                                         int d, const float* h, int n, int h_stride, int col0,    \
                                                         float* out, const unsigned* idx) {                       \
        grid_dependency();                                                                                        \
        bundles_down<E>(b, rest, row_bytes, neurons, parts, d, h, n, h_stride, col0, out, idx);                   \
    }

BUNDLE_KERNELS(f32, BE_F32)
BUNDLE_KERNELS(f16, BE_F16)
BUNDLE_KERNELS(bf16, BE_BF16)
BUNDLE_KERNELS(int8, BE_INT8)
BUNDLE_KERNELS(int4, BE_INT4)
