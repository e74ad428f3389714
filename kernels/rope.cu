// Rotary position embeddings in place. One thread per (row, head, pair).
#include "common.cuh"

// Pair `idx` of `rows` rows of `cols` values. pairs: 0 = adjacent (2i, 2i+1), 1 = halves
// (i, i + rot/2). Row r is at position first_pos + r.
__device__ __forceinline__ void rope_at(float* x, long long idx, int rows, int cols, int head_dim, int rot_dims,
                                        int pairs, const float* inv_freq, int first_pos) {
    int half = rot_dims / 2;
    int heads = cols / head_dim;
    long long total = (long long)rows * heads * half;
    if (idx >= total) return;
    int i = (int)(idx % half);
    long long rh = idx / half;
    int h = (int)(rh % heads);
    int r = (int)(rh / heads);
    float angle = (float)(first_pos + r) * inv_freq[i];
    float c = cosf(angle), s = sinf(angle);
    float* head = x + (long long)r * cols + (long long)h * head_dim;
    int a = pairs == 0 ? 2 * i : i;
    int b = pairs == 0 ? 2 * i + 1 : i + half;
    float x0 = head[a], x1 = head[b];
    head[a] = x0 * c - x1 * s;
    head[b] = x0 * s + x1 * c;
}

// Rows at first_pos.., or at *pos_at.. where pos_at is given (a recorded step, replayed at later
// positions).
extern "C" __global__ void rope(float* x, int rows, int cols, int head_dim, int rot_dims, int pairs,
                                const float* inv_freq, int first_pos, const int* pos_at) {
    if (pos_at) first_pos = *pos_at;
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    rope_at(x, idx, rows, cols, head_dim, rot_dims, pairs, inv_freq, first_pos);
}

// Queries and keys in one launch: blockIdx.y 0 rotates q (q_cols wide), 1 rotates k.
extern "C" __global__ void rope_pair(float* q, int q_cols, float* k, int k_cols, int rows, int head_dim,
                                     int rot_dims, int pairs, const float* inv_freq, int first_pos,
                                     const int* pos_at) {
    if (pos_at) first_pos = *pos_at;
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (blockIdx.y == 0)
        rope_at(q, idx, rows, q_cols, head_dim, rot_dims, pairs, inv_freq, first_pos);
    else
        rope_at(k, idx, rows, k_cols, head_dim, rot_dims, pairs, inv_freq, first_pos);
}
