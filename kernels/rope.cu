// Rotary position embeddings in place. One thread per (row, head, pair).
#include "common.cuh"

// Rotate pair `idx` of `rows` rows of `cols` values in place; false past the last pair, else its
// row and columns in *r, *a, *b. pairs: 0 = adjacent (2i, 2i+1), 1 = halves (i, i + rot/2).
// Row r is at position first_pos + r.
__device__ __forceinline__ bool rope_at(float* x, long long idx, int rows, int cols, int head_dim, int rot_dims,
                                        int pairs, const float* inv_freq, int first_pos, int* r, int* a, int* b) {
    int half = rot_dims / 2;
    int heads = cols / head_dim;
    long long total = (long long)rows * heads * half;
    if (idx >= total) return false;
    int i = (int)(idx % half);
    long long rh = idx / half;
    int h = (int)(rh % heads);
    *r = (int)(rh / heads);
    float angle = (float)(first_pos + *r) * inv_freq[i];
    float c = cosf(angle), s = sinf(angle);
    *a = h * head_dim + (pairs == 0 ? 2 * i : i);
    *b = h * head_dim + (pairs == 0 ? 2 * i + 1 : i + half);
    float* row = x + (long long)*r * cols;
    float x0 = row[*a], x1 = row[*b];
    row[*a] = x0 * c - x1 * s;
    row[*b] = x0 * s + x1 * c;
    return true;
}

// Rows at first_pos.., or at *pos_at.. where pos_at is given (a recorded step, replayed at later
// positions).
extern "C" __global__ void rope(float* x, int rows, int cols, int head_dim, int rot_dims, int pairs,
                                const float* inv_freq, int first_pos, const int* pos_at) {
    grid_dependency();
    if (pos_at) first_pos = *pos_at;
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    int r, a, b;
    rope_at(x, idx, rows, cols, head_dim, rot_dims, pairs, inv_freq, first_pos, &r, &a, &b);
}

// Queries and keys in one launch: blockIdx.y 0 rotates q (q_cols wide), 1 rotates k.
extern "C" __global__ void rope_pair(float* q, int q_cols, float* k, int k_cols, int rows, int head_dim,
                                     int rot_dims, int pairs, const float* inv_freq, int first_pos,
                                     const int* pos_at) {
    grid_dependency();
    if (pos_at) first_pos = *pos_at;
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    int r, a, b;
    if (blockIdx.y == 0)
        rope_at(q, idx, rows, q_cols, head_dim, rot_dims, pairs, inv_freq, first_pos, &r, &a, &b);
    else
        rope_at(k, idx, rows, k_cols, head_dim, rot_dims, pairs, inv_freq, first_pos, &r, &a, &b);
}

// A step's rotation and KV store in one launch, for f32 and f16 caches (DT), its rows at
// positions first_pos.. (or *pos_at..; through `table` where given): blockIdx.y 0 rotates q;
// 1 rotates k and writes it, its unrotated dims too, to k_dst; 2 writes v to v_dst. The same
// values as rope_pair, then store_kv_pair.
extern "C" __global__ void rope_store_kv(float* q, int q_cols, float* k, const float* v, int kv_cols, int rows,
                                         int head_dim, int rot_dims, int pairs, const float* inv_freq, int dt,
                                         u8* k_dst, u8* v_dst, const unsigned* table, int first_pos,
                                         const int* pos_at) {
    grid_dependency();
    if (pos_at) first_pos = *pos_at;
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    int r, a, b;
    if (blockIdx.y == 0) {
        rope_at(q, idx, rows, q_cols, head_dim, rot_dims, pairs, inv_freq, first_pos, &r, &a, &b);
        return;
    }
    if (blockIdx.y == 2) {
        store_rows(idx, v, rows, kv_cols, dt, v_dst, table, first_pos);
        return;
    }
    int heads = kv_cols / head_dim, rest = head_dim - rot_dims;
    long long rotated = (long long)rows * heads * (rot_dims / 2);
    if (rope_at(k, idx, rows, kv_cols, head_dim, rot_dims, pairs, inv_freq, first_pos, &r, &a, &b)) {
        const float* row = k + (long long)r * kv_cols;
        put_kv(k_dst, dt, table, first_pos + r, kv_cols, a, row[a]);
        put_kv(k_dst, dt, table, first_pos + r, kv_cols, b, row[b]);
        return;
    }
    // The dims past the rotated ones, stored as they are.
    long long j = idx - rotated;
    if (rest == 0 || j >= (long long)rows * heads * rest) return;
    long long rh = j / rest;
    int col = (int)(rh % heads) * head_dim + rot_dims + (int)(j % rest);
    r = (int)(rh / heads);
    put_kv(k_dst, dt, table, first_pos + r, kv_cols, col, k[(long long)r * kv_cols + col]);
}
