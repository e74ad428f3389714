// Rotary position embeddings in place. One thread per (row, head, pair).
#include "common.cuh"

// pairs: 0 = adjacent (2i, 2i+1), 1 = halves (i, i + rot/2). Row r is at position first_pos + r,
// or *pos_at + r where pos_at is given (a recorded step, replayed at later positions).
extern "C" __global__ void rope(float* x, int rows, int cols, int head_dim, int rot_dims, int pairs,
                                const float* inv_freq, int first_pos, const int* pos_at) {
    if (pos_at) first_pos = *pos_at;
    int half = rot_dims / 2;
    int heads = cols / head_dim;
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
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
