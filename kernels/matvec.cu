// Matrix × (a few) vectors for decode: out[t][col0 + r] = W[r] · x[t] for up to MAX_TOKENS
// tokens, one warp per weight row, the row read once for all tokens. Float formats multiply f32
// activations; the block formats multiply 8-bit activation blocks (quantize_q8) with integer
// dot products, as the CPU backend does.
#include "common.cuh"

#define WARPS 8  // warps (rows) per block

__device__ __forceinline__ void write_out(float* acc, int n, float* out, int stride, int col0, int row) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int t = 0; t < MAX_TOKENS; t++) {
        if (t < n) {
            float v = warp_sum(acc[t]);
            if (lane == 0) out[(long long)t * stride + col0 + row] = v;
        }
    }
}

// Any float format, any column count.
extern "C" __global__ void matvec_float(const u8* w, int dtype, int rows, int cols, const float* x, int n,
                                        float* out, int stride, int col0) {
    int row = blockIdx.x * WARPS + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const u8* wr = w + row_bytes(dtype, cols) * row;
    float acc[MAX_TOKENS];
#pragma unroll
    for (int t = 0; t < MAX_TOKENS; t++) acc[t] = 0.0f;
    for (int j = lane; j < cols; j += 32) {
        float wv = load_elem(wr, dtype, j);
#pragma unroll
        for (int t = 0; t < MAX_TOKENS; t++)
            if (t < n) acc[t] += wv * x[(long long)t * cols + j];
    }
    write_out(acc, n, out, stride, col0, row);
}

// f16 rows with cols % 8 == 0: 16-byte loads, two in flight per lane.
extern "C" __global__ void matvec_f16_vec(const u8* w, int rows, int cols, const float* x, int n, float* out,
                                          int stride, int col0) {
    int row = blockIdx.x * WARPS + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const uint4* wr = (const uint4*)(w + 2LL * cols * row);
    int vecs = cols / 8;
    float acc[MAX_TOKENS];
#pragma unroll
    for (int t = 0; t < MAX_TOKENS; t++) acc[t] = 0.0f;
    for (int v = lane; v < vecs; v += 32) {
        uint4 q = __ldg(wr + v);
        u32 words[4] = {q.x, q.y, q.z, q.w};
        float wv[8];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            wv[2 * k] = h2f((u16)(words[k] & 0xffff));
            wv[2 * k + 1] = h2f((u16)(words[k] >> 16));
        }
#pragma unroll
        for (int t = 0; t < MAX_TOKENS; t++) {
            if (t < n) {
                const float4* xv = (const float4*)(x + (long long)t * cols + 8 * v);
                float4 a = xv[0], b = xv[1];
                acc[t] += wv[0] * a.x + wv[1] * a.y + wv[2] * a.z + wv[3] * a.w + wv[4] * b.x + wv[5] * b.y +
                          wv[6] * b.z + wv[7] * b.w;
            }
        }
    }
    write_out(acc, n, out, stride, col0, row);
}

__device__ __forceinline__ u32 load_u32_2(const u8* p) {  // 2-byte aligned
    return (u32)load_u16(p) | ((u32)load_u16(p + 2) << 16);
}

// Block formats. `xq` holds n rows of cols/32 activation blocks.
extern "C" __global__ void matvec_quant(const u8* w, int dtype, int rows, int cols, const ActBlock* xq, int n,
                                        float* out, int stride, int col0) {
    int row = blockIdx.x * WARPS + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    int nb = cols / 32;
    const u8* wr = w + row_bytes(dtype, cols) * row;
    float acc[MAX_TOKENS];
#pragma unroll
    for (int t = 0; t < MAX_TOKENS; t++) acc[t] = 0.0f;
    for (int b = lane; b < nb; b += 32) {
        int wq[8];
        float dw, mw = 0.0f;
        if (dtype == DT_Q8_0) {
            const u8* blk = wr + 34LL * b;
            dw = h2f(load_u16(blk));
#pragma unroll
            for (int k = 0; k < 8; k++) wq[k] = (int)load_u32_2(blk + 2 + 4 * k);
        } else {
            const u8* blk = wr + (dtype == DT_Q4_0 ? 18LL : 20LL) * b;
            dw = h2f(load_u16(blk));
            const u8* qs = blk + 2;
            if (dtype == DT_Q4_1) {
                mw = h2f(load_u16(blk + 2));
                qs = blk + 4;
            }
#pragma unroll
            for (int k = 0; k < 4; k++) {
                u32 packed = load_u32_2(qs + 4 * k);
                wq[k] = (int)(packed & 0x0f0f0f0fu);
                wq[k + 4] = (int)((packed >> 4) & 0x0f0f0f0fu);
            }
        }
#pragma unroll
        for (int t = 0; t < MAX_TOKENS; t++) {
            if (t < n) {
                const ActBlock* a = xq + (long long)t * nb + b;
                int dot = 0;
#pragma unroll
                for (int k = 0; k < 8; k++) dot = __dp4a(wq[k], a->qs[k], dot);
                float v;
                if (dtype == DT_Q8_0) v = dw * a->d * (float)dot;
                else if (dtype == DT_Q4_0) v = dw * a->d * (float)(dot - 8 * a->isum);
                else v = dw * a->d * (float)dot + mw * a->s;
                acc[t] += v;
            }
        }
    }
    write_out(acc, n, out, stride, col0, row);
}
