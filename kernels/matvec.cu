// Matrix × (a few) vectors for decode: out[t][col0 + r] = W[r] · x[t], one warp per weight row,
// the row read once for all tokens of a launch. Float formats multiply f32 activations (up to
// MAX_TOKENS per launch); block formats multiply 8-bit activation blocks (quantize_q8) with
// integer dot products (kernels/quant.cuh), up to MAX_QTOKENS per launch. Prefill multiplies
// block formats through dequant_f16 tiles and cuBLAS.
#include "quant.cuh"

#define WARPS 8  // warps (rows) per block

// Bytes of each weight row a matvec warp asks L2 for before it waits for the grid before it
// (grid_dependency). Launched with programmatic stream serialization (`--programmatic-launch`),
// the blocks that become resident while that grid's last blocks still run then stream weights
// (which no kernel writes) instead of idling, so one launch's tail overlaps the next one's reads.
// Launched plainly, the loads that follow find the lines on their way. 4 KiB a row keeps what the
// resident warps ask for (~36 warps × 114 SMs × 4 KiB ≈ 16 MB) well inside an H100's 50 MB L2.
#define AHEAD_BYTES 4096

// One token's f16 matvec (a decode step): each lane has F16_LOADS 16-byte weight loads in flight
// (8 KiB a warp: a 4096-wide row in one round trip to memory), and the first round of them is
// asked of L2 ahead (F16_AHEAD) while the block stages the activations (stage_x); rows of up to
// F16_X_COLS activations (44 KiB: the 4096-wide rows and the 11008-wide down rows of a 7B model)
// are staged in shared memory.
#define F16_LOADS 16
#define F16_AHEAD (F16_LOADS * 32 * 16)
#define F16_X_COLS 11264

__device__ __forceinline__ void prefetch_l2(const u8* p) {
#ifndef KERNEL_HOST_CHECK
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#endif
}

// This lane's share (128-byte lines) of the first `ahead` bytes of a row of `bytes` bytes.
__device__ __forceinline__ void row_ahead(const u8* row, long long bytes, int ahead) {
    const long long n = bytes < ahead ? bytes : ahead;
    for (long long at = (long long)(threadIdx.x & 31) * 128; at < n; at += 32 * 128) prefetch_l2(row + at);
}

// grid_dependency, after the first `ahead` bytes of this warp's row of `w` (and of `w2` where
// given: the gate/up kernels) have been asked for. The one-weight and gate/up kernels start here.
__device__ __forceinline__ void grid_dependency_after_row(const u8* w, int dtype, const u8* w2, int dtype2, int rows,
                                                          int cols, int ahead = AHEAD_BYTES) {
    const int row = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (row < rows) {
        const long long rb = row_bytes(dtype, cols), rb2 = row_bytes(dtype2, cols);
        row_ahead(w + rb * row, rb, ahead);
        if (w2) row_ahead(w2 + rb2 * row, rb2, ahead);
    }
    grid_dependency();
}

// Each token's row sum to out[t][col0 + row] (lane 0 writes); MAXT = the kernel's token limit.
template <int MAXT>
__device__ __forceinline__ void write_out(float* acc, int n, float* out, int stride, int col0, int row) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int t = 0; t < MAXT; t++) {
        if (t < n) {
            float v = warp_sum(acc[t]);
            if (lane == 0) out[(long long)t * stride + col0 + row] = v;
        }
    }
}

// Each token's gated product of a gate row's and an up row's sums (as write_out sums them) to
// out[t][row]: the value gated_f32 makes of the two products.
template <int MAXT>
__device__ __forceinline__ void write_gated(float* g, float* u, int n, int kind, float threshold, float* out,
                                            int stride, int row) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int t = 0; t < MAXT; t++) {
        if (t < n) {
            float gv = warp_sum(g[t]), uv = warp_sum(u[t]);
            if (lane == 0) out[(long long)t * stride + row] = gated_value(gv, uv, kind, threshold);
        }
    }
}

// Any float format, any column count.
extern "C" __global__ void matvec_float(const u8* w, int dtype, int rows, int cols, const float* x, int n,
                                        float* out, int stride, int col0) {
    grid_dependency_after_row(w, dtype, 0, 0, rows, cols);
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
    write_out<MAX_TOKENS>(acc, n, out, stride, col0, row);
}

// A 16-byte load of weights, which are read once: it leaves L1 to what every warp of the SM
// reads again (the activations), so weight lines streaming through never evict them.
__device__ __forceinline__ uint4 ld_weights(const uint4* p) {
#ifdef KERNEL_HOST_CHECK
    return *p;
#else
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
#endif
}

// Eight f16 weights of each of R rows (one 16-byte load each, the `v`-th of its row) times each
// token's values there, read once for the R rows; row r's sums into acc[r].
template <int MAXT, int R>
__device__ __forceinline__ void f16_vec_dot(const uint4* q, int v, int cols, const float* x, int n,
                                            float (*acc)[MAXT]) {
    float wv[R][8];
#pragma unroll
    for (int r = 0; r < R; r++) {
        const u32 words[4] = {q[r].x, q[r].y, q[r].z, q[r].w};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            wv[r][2 * k] = h2f((u16)(words[k] & 0xffff));
            wv[r][2 * k + 1] = h2f((u16)(words[k] >> 16));
        }
    }
#pragma unroll
    for (int t = 0; t < MAXT; t++) {
        if (t < n) {
            const float4* xv = (const float4*)(x + (long long)t * cols + 8 * v);
            float4 a = xv[0], b = xv[1];
#pragma unroll
            for (int r = 0; r < R; r++)
                acc[r][t] += wv[r][0] * a.x + wv[r][1] * a.y + wv[r][2] * a.z + wv[r][3] * a.w + wv[r][4] * b.x +
                             wv[r][5] * b.y + wv[r][6] * b.z + wv[r][7] * b.w;
        }
    }
}

// R weight rows of f16 (`wr[r]`: row r's first 16-byte vector; cols % 8 == 0, vecs = cols / 8)
// times n ≤ MAXT tokens, this lane's share of each row's sums. The arithmetic order, whatever
// MAXT, LOADS and R: lane l takes vectors l, l + 32, l + 64, … of each row and adds each one's
// eight products (left to right) to its sum in that order; write_out then adds the 32 lanes'
// sums by the butterfly of warp_sum. So one token, many, and a row alone or beside another give
// the same bits. What changes is only how many loads are in flight: LOADS vectors of each row,
// every one issued before any is used (a decode step's one token: 16 in all, 8 KiB a warp,
// a 4096-wide row in one round trip to memory; up to MAX_TOKENS tokens, one a row, their
// accumulators taking the registers).
template <int MAXT, int LOADS, int R>
__device__ __forceinline__ void f16_rows_acc(const uint4* const* wr, int vecs, int cols, const float* x, int n,
                                             float (*acc)[MAXT]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int t = 0; t < MAXT; t++) acc[r][t] = 0.0f;
    int v = lane;
    // Whole rounds: every load unconditional, so all are issued before the first use.
    for (; v + 32 * (LOADS - 1) < vecs; v += 32 * LOADS) {
        uint4 q[LOADS][R];
#pragma unroll
        for (int k = 0; k < LOADS; k++)
#pragma unroll
            for (int r = 0; r < R; r++) q[k][r] = ld_weights(wr[r] + v + 32 * k);
#pragma unroll
        for (int k = 0; k < LOADS; k++) f16_vec_dot<MAXT, R>(q[k], v + 32 * k, cols, x, n, acc);
    }
    // The rest of the row: fewer than LOADS vectors this lane, in the same order.
    if (v < vecs) {
        uint4 q[LOADS][R];
#pragma unroll
        for (int k = 0; k < LOADS; k++)
#pragma unroll
            for (int r = 0; r < R; r++)
                q[k][r] = v + 32 * k < vecs ? ld_weights(wr[r] + v + 32 * k) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int k = 0; k < LOADS; k++)
            if (v + 32 * k < vecs) f16_vec_dot<MAXT, R>(q[k], v + 32 * k, cols, x, n, acc);
    }
}

// Row `row` of f16 weights `w` (cols % 8 == 0) as f16_rows_acc's one row.
__device__ __forceinline__ const uint4* f16_row_start(const u8* w, int row, int cols) {
    return (const uint4*)(w + 2LL * cols * row);
}

template <int MAXT, int LOADS>
__device__ __forceinline__ void f16_row(const u8* w, int row, int cols, const float* x, int n, float* out, int stride,
                                        int col0) {
    float acc[1][MAXT];
    const uint4* wr[1] = {f16_row_start(w, row, cols)};
    f16_rows_acc<MAXT, LOADS, 1>(wr, cols / 8, cols, x, n, acc);
    write_out<MAXT>(acc[0], n, out, stride, col0, row);
}

// One token's activations staged in shared memory by the whole block (then a barrier: every
// thread of the block must come here), where a row of them fits in F16_X_COLS: the f16 matvecs
// then read them from shared memory, a few cycles from their use, so the registers hold weight
// loads in flight instead of activations fetched early; wider rows read them from global memory
// (L1). The values and the order they are used in are the same either way.

__device__ __forceinline__ void stage_x(const float* x, int cols, float* xs) {
    for (int i = 4 * (int)threadIdx.x; i < cols; i += 4 * (int)blockDim.x) *(float4*)(xs + i) = *(const float4*)(x + i);
    __syncthreads();
}

// Whether a launch of n tokens of rows of `cols` reads them staged (stage_x).
__device__ __forceinline__ bool x_staged(int n, int cols) { return n == 1 && cols <= F16_X_COLS; }

// f16_row for a launch of n tokens of `x` as global memory holds them: one token (four loads
// in flight: the activations take registers too), or up to MAX_TOKENS.
__device__ __forceinline__ void f16_row_n(const u8* w, int row, int cols, const float* x, int n, float* out,
                                          int stride, int col0) {
    if (n == 1)
        f16_row<1, 4>(w, row, cols, x, n, out, stride, col0);
    else
        f16_row<MAX_TOKENS, 1>(w, row, cols, x, n, out, stride, col0);
}

// One weight row of a block format times n tokens' activation blocks (`xq`: n rows of cols/32),
// each weight block read once for all of them; this lane's share of each sum.
__device__ __forceinline__ void quant_row_acc(const u8* w, int dtype, int row, int cols, const ActBlock* xq, int n,
                                              float* acc) {
    int lane = threadIdx.x & 31;
    int nb = cols / 32;
    const u8* wr = w + row_bytes(dtype, cols) * row;
#pragma unroll
    for (int t = 0; t < MAX_QTOKENS; t++) acc[t] = 0.0f;
    for (int b = lane; b < nb; b += 32) {
        WeightSub ws = decode_sub(wr, dtype, b);
#pragma unroll
        for (int t = 0; t < MAX_QTOKENS; t++)
            if (t < n) acc[t] += sub_dot(ws, xq + (long long)t * nb + b);
    }
}

__device__ __forceinline__ void quant_row(const u8* w, int dtype, int row, int cols, const ActBlock* xq, int n,
                                          float* out, int stride, int col0) {
    float acc[MAX_QTOKENS];
    quant_row_acc(w, dtype, row, cols, xq, n, acc);
    write_out<MAX_QTOKENS>(acc, n, out, stride, col0, row);
}

// f16 rows with cols % 8 == 0 (`dtype` is DT_F16; every one-weight matvec kernel takes the same
// arguments). Two blocks an SM: 128 registers a thread hold a decode step's 16 loads in flight.
extern "C" __global__ void __launch_bounds__(WARPS * 32, 2)
    matvec_f16_vec(const u8* w, int dtype, int rows, int cols, const float* x, int n, float* out, int stride,
                   int col0) {
    grid_dependency_after_row(w, dtype, 0, 0, rows, cols, x_staged(n, cols) ? F16_AHEAD : AHEAD_BYTES);
    __shared__ float4 xs4[F16_X_COLS / 4];  // float4s: 16-byte aligned
    float* xs = (float*)xs4;
    const int row = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (x_staged(n, cols)) {
        stage_x(x, cols, xs);
        if (row < rows) f16_row<1, F16_LOADS>(w, row, cols, xs, 1, out, stride, col0);
    } else if (row < rows) {
        f16_row_n(w, row, cols, x, n, out, stride, col0);
    }
}

// Block formats, up to MAX_QTOKENS tokens per launch.
extern "C" __global__ void matvec_quant(const u8* w, int dtype, int rows, int cols, const ActBlock* xq, int n,
                                        float* out, int stride, int col0) {
    grid_dependency_after_row(w, dtype, 0, 0, rows, cols);
    int row = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (row >= rows) return;
    quant_row(w, dtype, row, cols, xq, n, out, stride, col0);
}

// Several weights times the same activations in one launch (q, k and v; gate and up): the
// blocks of part 0's rows, then part 1's, and so on; each row computed as the one-weight
// kernels compute it. Laid out as `MatvecParts` in src/backend/cuda/mod.rs.
#define MAX_PARTS 4
struct MatvecPart {
    const u8* w;
    float* out;
    int dtype;
    int rows;
    int stride;
    int col0;
};
struct MatvecParts {
    MatvecPart part[MAX_PARTS];
    int count;
};
static_assert(sizeof(MatvecPart) == 32 && sizeof(MatvecParts) == 136, "MatvecParts layout (mod.rs)");

// The part block `blockIdx.x` falls in, and its row there (-1: past the part's last row).
__device__ __forceinline__ const MatvecPart* part_row(const MatvecParts& ps, int* row) {
    int block = blockIdx.x;
    for (int i = 0; i < ps.count; i++) {
        int blocks = (ps.part[i].rows + WARPS - 1) / WARPS;
        if (block < blocks) {
            int r = block * WARPS + (threadIdx.x >> 5);
            *row = r < ps.part[i].rows ? r : -1;
            return &ps.part[i];
        }
        block -= blocks;
    }
    *row = -1;
    return 0;
}

// grid_dependency, after this warp's row of its part has been asked for (grid_dependency_after_row).
__device__ __forceinline__ void grid_dependency_after_part(const MatvecParts& ps, int cols, int ahead = AHEAD_BYTES) {
    int row;
    const MatvecPart* p = part_row(ps, &row);
    if (row >= 0) {
        const long long rb = row_bytes(p->dtype, cols);
        row_ahead(p->w + rb * row, rb, ahead);
    }
    grid_dependency();
}

// One token's activations, at most QX_MAX_COLS of them, quantized by the block's own warps into
// shared memory (quantize_block_warp, as quantize_q8 does): a decode step's block-format matvec
// needs no quantize launch before it. Wider rows keep the launch: there every block would
// repeat a quantization worth more than the launch it saves.
#define QX_MAX_COLS 2048
__device__ __forceinline__ void quantize_shared(int cols, const float* x, ActBlock* xs) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int b = warp; b < cols / 32; b += WARPS) quantize_block_warp(x[b * 32 + lane], xs + b);
    __syncthreads();
}

// One token's block-format rows times its activations quantized in shared memory. `n` is 1.
extern "C" __global__ void matvec_quant_x(const u8* w, int dtype, int rows, int cols, const float* x, int n,
                                          float* out, int stride, int col0) {
    grid_dependency_after_row(w, dtype, 0, 0, rows, cols);
    __shared__ ActBlock xs[QX_MAX_COLS / 32];
    quantize_shared(cols, x, xs);
    int row = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (row >= rows) return;
    quant_row(w, dtype, row, cols, xs, 1, out, stride, col0);
}

// The hidden activations of a gated FFN, a row of the gate and the same row of up in one warp:
// out[t][row] = act(Wg[row]·x[t]) ⊙ (Wu[row]·x[t]), masked by `threshold`. Each product is summed
// as the one-weight kernels sum it and gated as gated_f32 gates it, so one launch gives what two
// matvecs and the gated launch give, bit for bit. The three kernels take the same arguments
// (`x`: the activations as each reads them; `dg`, `du`: the weights' formats).
// f16 rows (cols % 8 == 0), n ≤ MAX_TOKENS. The gate's row and up's side by side: each row's
// loads in flight beside the other's, each activation read once for both, each row summed as
// alone.
extern "C" __global__ void __launch_bounds__(WARPS * 32, 2)
    matvec_f16_gate_up(const u8* wg, int dg, const u8* wu, int du, int rows, int cols, const float* x, int n,
                       int kind, float threshold, float* out, int stride) {
    grid_dependency_after_row(wg, dg, wu, du, rows, cols);
    __shared__ float4 xs4[F16_X_COLS / 4];  // float4s: 16-byte aligned
    float* xs = (float*)xs4;
    const int row = blockIdx.x * WARPS + (threadIdx.x >> 5);
    const bool staged = x_staged(n, cols);
    if (staged) stage_x(x, cols, xs);
    if (row >= rows) return;
    const uint4* wr[2] = {f16_row_start(wg, row, cols), f16_row_start(wu, row, cols)};
    if (staged) {
        float gu[2][1];
        f16_rows_acc<1, F16_LOADS / 2, 2>(wr, cols / 8, cols, xs, 1, gu);
        write_gated<1>(gu[0], gu[1], 1, kind, threshold, out, stride, row);
    } else if (n == 1) {
        float gu[2][1];
        f16_rows_acc<1, 2, 2>(wr, cols / 8, cols, x, 1, gu);
        write_gated<1>(gu[0], gu[1], 1, kind, threshold, out, stride, row);
    } else {
        float gu[2][MAX_TOKENS];
        f16_rows_acc<MAX_TOKENS, 1, 2>(wr, cols / 8, cols, x, n, gu);
        write_gated<MAX_TOKENS>(gu[0], gu[1], n, kind, threshold, out, stride, row);
    }
}

// Block formats, activation blocks quantized by quantize_q8 (n ≤ MAX_QTOKENS). Two rows' sums
// for 16 tokens: held to 80 registers (3 blocks per SM) without spilling (at 64 it spills).
extern "C" __global__ void __launch_bounds__(WARPS * 32, 3) matvec_quant_gate_up(const u8* wg, int dg, const u8* wu, int du, int rows, int cols,
                                                const ActBlock* xq, int n, int kind, float threshold, float* out,
                                                int stride) {
    grid_dependency_after_row(wg, dg, wu, du, rows, cols);
    int row = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (row >= rows) return;
    float g[MAX_QTOKENS], u[MAX_QTOKENS];
    quant_row_acc(wg, dg, row, cols, xq, n, g);
    quant_row_acc(wu, du, row, cols, xq, n, u);
    write_gated<MAX_QTOKENS>(g, u, n, kind, threshold, out, stride, row);
}

// Block formats, one token of at most QX_MAX_COLS activations quantized in each block
// (quantize_shared). `n` is 1.
extern "C" __global__ void matvec_quant_gate_up_x(const u8* wg, int dg, const u8* wu, int du, int rows, int cols,
                                                  const float* x, int n, int kind, float threshold, float* out,
                                                  int stride) {
    grid_dependency_after_row(wg, dg, wu, du, rows, cols);
    __shared__ ActBlock xs[QX_MAX_COLS / 32];
    quantize_shared(cols, x, xs);
    int row = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (row >= rows) return;
    float g[MAX_QTOKENS], u[MAX_QTOKENS];
    quant_row_acc(wg, dg, row, cols, xs, 1, g);
    quant_row_acc(wu, du, row, cols, xs, 1, u);
    write_gated<1>(g, u, 1, kind, threshold, out, stride, row);
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, 2)
    matvec_f16_parts(MatvecParts ps, int cols, const float* x, int n) {
    grid_dependency_after_part(ps, cols, x_staged(n, cols) ? F16_AHEAD : AHEAD_BYTES);
    __shared__ float4 xs4[F16_X_COLS / 4];  // float4s: 16-byte aligned
    float* xs = (float*)xs4;
    int row;
    const MatvecPart* p = part_row(ps, &row);
    if (x_staged(n, cols)) {
        stage_x(x, cols, xs);
        if (row >= 0) f16_row<1, F16_LOADS>(p->w, row, cols, xs, 1, p->out, p->stride, p->col0);
    } else if (row >= 0) {
        f16_row_n(p->w, row, cols, x, n, p->out, p->stride, p->col0);
    }
}

// Held to matvec_quant's 64 registers (4 blocks per SM), which it reaches without spilling.
extern "C" __global__ void __launch_bounds__(WARPS * 32, 4) matvec_quant_parts(MatvecParts ps, int cols, const ActBlock* xq, int n) {
    grid_dependency_after_part(ps, cols);
    int row;
    const MatvecPart* p = part_row(ps, &row);
    if (row < 0) return;
    quant_row(p->w, p->dtype, row, cols, xq, n, p->out, p->stride, p->col0);
}

// Rows row0..row0+tile_rows of a block-format weight decoded to f16 (the reference decode,
// rounded once), for cuBLAS on tensor cores: each thread writes 8 consecutive values.
extern "C" __global__ void dequant_f16(const u8* w, int dtype, int row0, int tile_rows, int cols, u16* out) {
    grid_dependency();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    int per_row = cols / 8;
    if (i >= (long long)tile_rows * per_row) return;
    int r = (int)(i / per_row), c = (int)(i % per_row) * 8;
    const u8* wr = w + row_bytes(dtype, cols) * (long long)(row0 + r);
    u32 packed[4];
#pragma unroll
    for (int k = 0; k < 4; k++)
        packed[k] = (u32)f2h(load_elem(wr, dtype, c + 2 * k)) | ((u32)f2h(load_elem(wr, dtype, c + 2 * k + 1)) << 16);
    *(uint4*)(out + (long long)r * cols + c) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
}

// The parts of one token's block-format products, its activations quantized in each block
// (quantize_shared). `n` is 1 (taken so every parts kernel takes the same arguments).
extern "C" __global__ void __launch_bounds__(WARPS * 32, 4) matvec_quant_parts_x(MatvecParts ps, int cols,
                                                                                const float* x, int n) {
    grid_dependency_after_part(ps, cols);
    __shared__ ActBlock xs[QX_MAX_COLS / 32];
    quantize_shared(cols, x, xs);
    int row;
    const MatvecPart* p = part_row(ps, &row);
    if (row < 0) return;
    quant_row(p->w, p->dtype, row, cols, xs, 1, p->out, p->stride, p->col0);
}

// The RMSNorm before a decode step's products, inside them (one token, rows of at most
// QX_MAX_COLS: where each block quantizes its activations itself, it norms them first): no norm
// launch. Every block norms the token's residual row x (after x + add, where `add` is given) into
// shared memory exactly as add_rms_norm (rms_norm) does, 256 threads summing the same squares in
// the same order, so the values are its values bit for bit; the grid's last block to have read x
// then writes the sum back (residual_once).
__device__ __forceinline__ void norm_shared(const float* x, const float* add, const float* nw, float eps, int cols,
                                            float* xn) {
    __shared__ double scratch[32];
    double ss = 0.0;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
        float v = x[j];
        if (add) v += add[j];
        xn[j] = v;
        ss += (double)v * (double)v;
    }
    ss = block_sum_d(ss, scratch);
    const float scale = 1.0f / sqrtf((float)(ss / cols) + eps);
    for (int j = threadIdx.x; j < cols; j += blockDim.x) xn[j] = xn[j] * scale * nw[j];
    __syncthreads();
}

// add_rms_norm's residual, x += add, written once by the grid's last block to take a ticket
// (left at 0 for the next launch). A block takes its ticket only after its norm_shared, whose
// values depend on every x it read, so when the last ticket is drawn no block reads x any more.
__device__ __forceinline__ void residual_once(float* x, const float* add, int cols, unsigned* ticket) {
    __shared__ bool last;
    if (threadIdx.x == 0) {
        last = atomicAdd(ticket, 1u) == gridDim.x - 1;
        if (last) *ticket = 0;
    }
    __syncthreads();
    if (last)
        for (int j = threadIdx.x; j < cols; j += blockDim.x) x[j] = x[j] + add[j];
}

// The token normed (norm_shared), quantized (quantize_shared) and the residual written
// (residual_once, where `add` is given): what a block of the normed products starts with.
__device__ __forceinline__ void norm_quantize_shared(float* x, const float* add, const float* nw, float eps, int cols,
                                                     unsigned* ticket, ActBlock* xs) {
    __shared__ float xn[QX_MAX_COLS];
    norm_shared(x, add, nw, eps, cols, xn);
    quantize_shared(cols, xn, xs);
    if (add) residual_once(x, add, cols, ticket);
}

// add_rms_norm (rms_norm where `add` is null) then matvec_quant_parts_x, one launch, the same bits
// (the residual too). One token of at most QX_MAX_COLS values.
extern "C" __global__ void __launch_bounds__(WARPS * 32, 4)
    matvec_quant_parts_norm(MatvecParts ps, int cols, float* x, const float* add, const float* nw, float eps,
                            unsigned* ticket) {
    grid_dependency_after_part(ps, cols);
    __shared__ ActBlock xs[QX_MAX_COLS / 32];
    norm_quantize_shared(x, add, nw, eps, cols, ticket, xs);
    int row;
    const MatvecPart* p = part_row(ps, &row);
    if (row < 0) return;
    quant_row(p->w, p->dtype, row, cols, xs, 1, p->out, p->stride, p->col0);
}

// add_rms_norm (rms_norm where `add` is null) then matvec_quant_gate_up_x, one launch, the same
// bits (the residual too). One token of at most QX_MAX_COLS values.
extern "C" __global__ void matvec_quant_gate_up_norm(const u8* wg, int dg, const u8* wu, int du, int rows, int cols,
                                                     float* x, const float* add, const float* nw, float eps, int kind,
                                                     float threshold, float* out, int stride, unsigned* ticket) {
    grid_dependency_after_row(wg, dg, wu, du, rows, cols);
    __shared__ ActBlock xs[QX_MAX_COLS / 32];
    norm_quantize_shared(x, add, nw, eps, cols, ticket, xs);
    int row = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (row >= rows) return;
    float g[MAX_QTOKENS], u[MAX_QTOKENS];
    quant_row_acc(wg, dg, row, cols, xs, 1, g);
    quant_row_acc(wu, du, row, cols, xs, 1, u);
    write_gated<1>(g, u, 1, kind, threshold, out, stride, row);
}
