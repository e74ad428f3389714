// Causal attention over the KV cache with GQA, no score buffer in device memory: one block per
// (query token, head) walks the keys in tiles, keeping a running max and sum (online softmax)
// and rescaling its output accumulator as the max grows. The cache holds f32, f16 or Q8_0 rows
// (`KvType` in src/backend/mod.rs); values are read back as f32 and accumulated in f32.
#include "common.cuh"

#define TILE 1024
#define MAX_HEAD_DIM 256

// q: n × q_stride f32 (head h at h·hd); caches: ctx rows of `kv_cols` values in DT (KV head g at
// values g·hd..), position j at row kv_row(table, j); query t sits at position first_pos + t and
// sees keys 0..=first_pos + t. With `pos_at` (a recorded step), the first position is read there
// instead of first_pos.
// Block: 256 threads.
template <int DT>
__device__ void attention_impl(const float* q, const u8* kc, const u8* vc, const unsigned* table, float* out,
                               int n_heads, int group,
                               int hd, int q_stride, int kv_cols, int first_pos, float scale, const int* pos_at) {
    if (pos_at) first_pos = *pos_at;
    __shared__ float qs[MAX_HEAD_DIM];
    __shared__ float p[TILE];
    __shared__ float red[32];
    const long long rb = row_bytes(DT, kv_cols);
    int t = blockIdx.x / n_heads, h = blockIdx.x % n_heads;
    int g = h / group;
    int len = first_pos + t + 1;
    const float* qrow = q + (long long)t * q_stride + (long long)h * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) qs[d] = qrow[d];
    __syncthreads();
    // Thread d < hd owns output dimension d.
    float acc = 0.0f, m = -3.0e38f, l = 0.0f;
    const int col = g * hd;
    for (int j0 = 0; j0 < len; j0 += TILE) {
        int tile = min(TILE, len - j0);
        float local_max = -3.0e38f;
        for (int j = threadIdx.x; j < tile; j += blockDim.x) {
            const u8* k = kc + kv_row(table, j0 + j) * rb;
            float s = 0.0f;
            for (int d = 0; d < hd; d++) s += qs[d] * kv_elem<DT>(k, col + d);
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
            for (int j = 0; j < tile; j++) a += p[j] * kv_elem<DT>(vc + kv_row(table, j0 + j) * rb, col + threadIdx.x);
            acc = a;
        }
        __syncthreads();
    }
    if (threadIdx.x < hd) out[(long long)t * q_stride + (long long)h * hd + threadIdx.x] = acc / l;
}

#define ATTENTION(name, DT)                                                                                   \
    extern "C" __global__ void name(const float* q, const u8* kc, const u8* vc, const unsigned* table,       \
                                    float* out, int n_heads, int group, int hd, int q_stride, int kv_cols,    \
                                    int first_pos, float scale, const int* pos_at) {                          \
        grid_dependency();                                                                                    \
        attention_impl<DT>(q, kc, vc, table, out, n_heads, group, hd, q_stride, kv_cols, first_pos, scale,    \
                           pos_at);                                                                           \
    }

ATTENTION(attention_f32, DT_F32)
ATTENTION(attention_f16, DT_F16)
ATTENTION(attention_q8_0, DT_Q8_0)

// With `pos_at` (a recorded step), the first position is read there instead of first_row.
extern "C" __global__ void store_kv(const float* src, long long rows, int cols, int dt, u8* dst,
                                   const unsigned* table, int first_row, const int* pos_at) {
    grid_dependency();
    if (pos_at) first_row = *pos_at;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    store_rows(i, src, rows, cols, dt, dst, table, first_row);
}

// A step's keys and values in one launch: blockIdx.y 0 stores k into k_dst, 1 v into v_dst
// (same shape, format and table).
extern "C" __global__ void store_kv_pair(const float* k, const float* v, long long rows, int cols, int dt,
                                        u8* k_dst, u8* v_dst, const unsigned* table, int first_row,
                                        const int* pos_at) {
    grid_dependency();
    if (pos_at) first_row = *pos_at;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (blockIdx.y == 0)
        store_rows(i, k, rows, cols, dt, k_dst, table, first_row);
    else
        store_rows(i, v, rows, cols, dt, v_dst, table, first_row);
}
