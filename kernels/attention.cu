// Causal attention over the KV cache with GQA, no score buffer in device memory: one block per
// (query token, head) walks the keys in tiles, keeping a running max and sum (online softmax)
// and rescaling its output accumulator as the max grows.
#include "common.cuh"

#define TILE 1024
#define MAX_HEAD_DIM 256

// q: n × q_stride (head h at h·hd); caches: ctx × kv_stride (KV head g at g·hd); query t sits at
// position first_pos + t and sees keys 0..=first_pos + t. Block: 256 threads.
extern "C" __global__ void attention(const float* q, const float* kc, const float* vc, float* out, int n_heads,
                                     int group, int hd, int q_stride, int kv_stride, int first_pos, float scale) {
    __shared__ float qs[MAX_HEAD_DIM];
    __shared__ float p[TILE];
    __shared__ float red[32];
    int t = blockIdx.x / n_heads, h = blockIdx.x % n_heads;
    int g = h / group;
    int len = first_pos + t + 1;
    const float* qrow = q + (long long)t * q_stride + (long long)h * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) qs[d] = qrow[d];
    __syncthreads();
    // Thread d < hd owns output dimension d.
    float acc = 0.0f, m = -3.0e38f, l = 0.0f;
    for (int j0 = 0; j0 < len; j0 += TILE) {
        int tile = min(TILE, len - j0);
        float local_max = -3.0e38f;
        for (int j = threadIdx.x; j < tile; j += blockDim.x) {
            const float* k = kc + (long long)(j0 + j) * kv_stride + (long long)g * hd;
            float s = 0.0f;
            for (int d = 0; d < hd; d++) s += qs[d] * k[d];
            s *= scale;
            p[j] = s;
            local_max = fmaxf(local_max, s);
        }
        float tile_max = block_max(local_max, red);
        float new_m = fmaxf(m, tile_max);
        float rescale = expf(m - new_m);
        float local_sum = 0.0f;
        for (int j = threadIdx.x; j < tile; j += blockDim.x) {
            float e = expf(p[j] - new_m);
            p[j] = e;
            local_sum += e;
        }
        float tile_sum = block_sum(local_sum, red);  // ends with a barrier: p[] is complete
        l = l * rescale + tile_sum;
        m = new_m;
        if (threadIdx.x < hd) {
            float a = acc * rescale;
            const float* v = vc + (long long)j0 * kv_stride + (long long)g * hd + threadIdx.x;
            for (int j = 0; j < tile; j++) a += p[j] * v[(long long)j * kv_stride];
            acc = a;
        }
        __syncthreads();
    }
    if (threadIdx.x < hd) out[(long long)t * q_stride + (long long)h * hd + threadIdx.x] = acc / l;
}
