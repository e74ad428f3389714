// Element-wise ops, embedding gathers, activation quantization and format conversions.
#include "common.cuh"

extern "C" __global__ void add_f32(float* x, const float* y, long long n) {
    grid_dependency();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}

// x[i] += a * y[i] over one row of `cols` values: an expert's output row, weighted by its route,
// added into its token's row (moe_ffn).
extern "C" __global__ void add_scaled_f32(float* x, const float* y, float a, int cols) {
    grid_dependency();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < cols) x[i] += a * y[i];
}

// x[r][c] += b[c]
extern "C" __global__ void add_bias_f32(float* x, const float* b, long long n, int cols) {
    grid_dependency();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += b[i % cols];
}

// x = act(x), masked by `threshold` (sparse_act).
extern "C" __global__ void activate_f32(float* x, long long n, int kind, float threshold) {
    grid_dependency();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = sparse_act(act(x[i], kind), threshold);
}

// g = act(g) * u, act(g) masked by `threshold` (sparse_act).
extern "C" __global__ void gated_f32(float* g, const float* u, long long n, int kind, float threshold) {
    grid_dependency();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) g[i] = gated_value(g[i], u[i], kind, threshold);
}

// gated_f32's values rounded to f16 into `out` (the f16 input of a down product through cuBLAS),
// `g` left as it is: the gated launch and the conversion (f32_to_f16) in one, the same bits.
extern "C" __global__ void gated_to_f16(const float* g, const float* u, u16* out, long long n, int kind,
                                        float threshold) {
    grid_dependency();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f2h(gated_value(g[i], u[i], kind, threshold));
}

// out[t] = table[ids[t]] decoded to f32. Grid: one block per token.
extern "C" __global__ void embed_rows(const u8* table, int dtype, int cols, const int* ids, float* out) {
    grid_dependency();
    int t = blockIdx.x;
    const u8* row = table + row_bytes(dtype, cols) * ids[t];
    for (int j = threadIdx.x; j < cols; j += blockDim.x) out[(long long)t * cols + j] = load_elem(row, dtype, j);
}

// x[t] += table[first_row + t]. Grid: one block per token.
extern "C" __global__ void add_table_rows(float* x, const u8* table, int dtype, int cols, int first_row) {
    grid_dependency();
    int t = blockIdx.x;
    const u8* row = table + row_bytes(dtype, cols) * (long long)(first_row + t);
    for (int j = threadIdx.x; j < cols; j += blockDim.x) x[(long long)t * cols + j] += load_elem(row, dtype, j);
}

// Quantize `blocks` runs of 32 activations to ActBlocks (quantize_block_warp). One warp per
// block.
extern "C" __global__ void quantize_q8(const float* x, long long blocks, ActBlock* out) {
    grid_dependency();
    long long b = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (b >= blocks) return;
    quantize_block_warp(x[b * 32 + lane], out + b);
}

extern "C" __global__ void f32_to_f16(const float* x, u16* y, long long n) {
    grid_dependency();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = f2h(x[i]);
}

extern "C" __global__ void f32_to_bf16(const float* x, u16* y, long long n) {
    grid_dependency();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = f2bf(x[i]);
}

// Row i of src into row rows[i] of dst (row_bytes each): a cache unit's missing neurons, brought
// in by one copy, scattered into their slots. Grid: one block per row; words where rows are whole
// words (allocations are aligned), else bytes.
extern "C" __global__ void scatter_rows(const u8* src, long long row_bytes, const unsigned* rows, u8* dst) {
    grid_dependency();
    long long i = blockIdx.x;
    const u8* s = src + i * row_bytes;
    u8* d = dst + (long long)rows[i] * row_bytes;
    if ((row_bytes & 3) == 0) {
        const unsigned* sw = (const unsigned*)s;
        unsigned* dw = (unsigned*)d;
        for (long long w = threadIdx.x; w < row_bytes / 4; w += blockDim.x) dw[w] = sw[w];
    } else {
        for (long long b = threadIdx.x; b < row_bytes; b += blockDim.x) d[b] = s[b];
    }
}
