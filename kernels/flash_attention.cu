// Attention that scales with the context (issue 13), beside the simple kernel of attention.cu:
// - `flash_attn_{f16,q8_0}_hd*`: prefill (many query rows) over an f16 or Q8_0 cache on tensor
//   cores (a Q8_0 tile decoded to f16 as it is loaded; f32 caches keep f32 arithmetic, in the
//   simple kernel). A block
//   takes 64 query rows of one head (16 per warp); key and value tiles of 64 positions go through
//   shared memory once per block, copied by cp.async so each tile's load overlaps the product
//   before it (the values of tile j while its scores are computed, the keys of tile j + 1 while
//   its values are summed); the operands of Q·Kᵀ and P·V come out of shared memory by ldmatrix
//   (the values, stored as they lie in the cache, transposed by ldmatrix.trans); the products are
//   m16n8k16 f16 products with f32 accumulation (mma.sync, sm_80+); softmax is online (running
//   max and sum per row, in registers), so the score matrix never exists in device memory.
//   A few rows over a long context (a prompt cut into row groups under a budget) would leave
//   part of the device idle, a block per 64 rows and head: their keys are then split across
//   blocks too, and `flash_combine` merges the splits (flash_splits in src/backend/cuda/mod.rs).
// - `attention_split_*`: decode (few query rows) over a long context of any cache type. The keys
//   are cut into chunks, one block per (head, chunk), so a single token's attention fills the
//   GPU; each block leaves its rows' partials (max, sum, unnormalised output) in the workspace,
//   and the head's last block to finish combines them (a ticket per head), so attention is one
//   launch. A head holds MAX_SPLITS partials whatever the row count (rows × chunks ≤
//   MAX_SPLITS), so the workspace is fixed per model.
// Both read position j of the caches at row kv_row(table, j) (a paged sequence in the KV pool, or
// its own cache when table is null) and follow the causal rule of attention.cu: query row t sits at position first_pos + t and
// sees keys 0..=first_pos + t. kernels/host/flash_check.cpp runs both on the host against a naive
// attention (scripts/check-kernels.sh).
#include "common.cuh"

#define FA_ROWS 64     // query rows per flash block: 16 per warp
#define FA_KEYS 64     // keys per shared tile
#define FA_THREADS 128
#define FA_PAD 8       // halves after each shared row: fragment loads then hit 32 distinct banks
#define SPLIT_ROWS 4   // query rows the split kernel takes (SPLIT_ROWS in src/backend/cuda/mod.rs)
#define MAX_SPLITS 32  // partials per head: rows × chunks at most (MAX_SPLITS there)
#define SPLIT_MIN_KEYS 64  // keys a chunk takes at least (SPLIT_MIN_KEYS there)
#define SPLIT_THREADS 128
#define SPLIT_MAX_HD 256
#define SPLIT_LOADS 4  // keys whose key and value loads a lane of the split kernel has in flight (one row)
#define MASKED (-3.0e38f)

// Eight halves, moved as one 16-byte access.
struct alignas(16) Half8 {
    u32 w[4];
};

__device__ __forceinline__ u32 pack_h2(float lo, float hi) { return (u32)f2h(lo) | ((u32)f2h(hi) << 16); }

__device__ __forceinline__ u32 ld_u32(const u16* p) { return *(const u32*)p; }

// d += a·b for one 16×8 tile over k = 16: a is 16×16 f16 (row-major fragment), b 16×8 f16
// (column-major fragment), d f32. Fragment layouts: kernels/host/simt.h, host_mma_16816.
__device__ __forceinline__ void mma_16816(float* d, const u32* a, const u32* b) {
#ifdef KERNEL_HOST_CHECK
    host_mma_16816(d, a, b);
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// Four 8×8 tiles of halves from shared memory (ldmatrix.x4, sm_75+): lanes 8m .. 8m+7 give the
// addresses of tile m's rows (16 bytes each, 16-byte aligned); r[m] of lane 4g + t holds tile m's
// row g, halves 2t and 2t+1 (TRANS: its column g, rows 2t and 2t+1), as an mma fragment takes
// them. Fragment layouts: kernels/host/simt.h, host_ldmatrix_x4.
template <bool TRANS>
__device__ __forceinline__ void ldmatrix_x4(u32* r, const u16* row) {
#ifdef KERNEL_HOST_CHECK
    host_ldmatrix_x4(r, row, TRANS);
#else
    const unsigned a = (unsigned)__cvta_generic_to_shared(row);
    if (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(a));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(a));
#endif
}

// 16 bytes from global to shared memory without passing through registers (cp.async, sm_80+);
// the bytes past `src_bytes` (0 or 16) are zeros. They land once the thread waits for their
// group (cp_async_wait_all), for the other threads after a barrier behind that.
__device__ __forceinline__ void cp_async16(u16* dst, const u16* src, int src_bytes) {
#ifdef KERNEL_HOST_CHECK
    host_cp_async16(dst, src, src_bytes);
#else
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(src_bytes) : "memory");
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#ifdef KERNEL_HOST_CHECK
    host_cp_async_commit();
#else
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

__device__ __forceinline__ void cp_async_wait_all() {
#ifdef KERNEL_HOST_CHECK
    host_cp_async_wait(0);
#else
    asm volatile("cp.async.wait_group 0;" ::: "memory");
#endif
}

// Elements c..c+7 of a KV cache row in storage format DT, c a multiple of 8, as loaded (kv_load8)
// and then converted (kv_cvt8): one 16-byte load for f16, two for f32; a Q8_0 row's 8 codes lie in
// one block. Split so a lane can have several rows' loads in flight before it converts any; the
// words a format does not use are never set (nor kept in registers).
struct KvRaw {
    u32 w[8];
};

template <int DT>
__device__ __forceinline__ KvRaw kv_load8(const u8* row, int c) {
    KvRaw r;
    if (DT == DT_F32) {
        const uint4* p = (const uint4*)((const float*)row + c);
        const uint4 a = p[0], b = p[1];
        r.w[0] = a.x, r.w[1] = a.y, r.w[2] = a.z, r.w[3] = a.w;
        r.w[4] = b.x, r.w[5] = b.y, r.w[6] = b.z, r.w[7] = b.w;
    } else if (DT == DT_F16) {
        const uint4 h = *(const uint4*)((const u16*)row + c);
        r.w[0] = h.x, r.w[1] = h.y, r.w[2] = h.z, r.w[3] = h.w;
    } else {
        // Rows and 34-byte blocks start at even bytes (rows of whole blocks, buffers aligned),
        // so the scale and the codes load two bytes at a time.
        const u8* b = row + (c >> 5) * 34;
        r.w[0] = *(const u16*)b;
        const u16* codes = (const u16*)(b + 2 + (c & 31));
#pragma unroll
        for (int e = 0; e < 4; e++) r.w[1 + e] = codes[e];
    }
    return r;
}

// The values kv_elem gives for the 8 elements kv_load8 loaded.
template <int DT>
__device__ __forceinline__ void kv_cvt8(const KvRaw& r, float* x) {
    if (DT == DT_F32) {
#pragma unroll
        for (int e = 0; e < 8; e++) x[e] = __uint_as_float(r.w[e]);
    } else if (DT == DT_F16) {
#pragma unroll
        for (int e = 0; e < 8; e++) x[e] = h2f((u16)(r.w[e >> 1] >> (16 * (e & 1))));
    } else {
        const float d = h2f((u16)r.w[0]);
#pragma unroll
        for (int e = 0; e < 4; e++) {
            x[2 * e] = d * (float)(i8)(r.w[1 + e] & 0xff);
            x[2 * e + 1] = d * (float)(i8)(r.w[1 + e] >> 8);
        }
    }
}

template <int DT>
__device__ __forceinline__ void kv_vec8(const u8* row, int c, float* x) {
    kv_cvt8<DT>(kv_load8<DT>(row, c), x);
}

// Keys j0 .. j0 + FA_KEYS - 1 of a cache in format DT (rows of rb bytes; one KV head's HD columns
// from col) into a shared f16 tile of pitch P halves; positions at or past `keys` as zeros (they
// may be past the cache: their scores are masked, and zeros times a zero probability stay zeros).
// An f16 cache's rows are copied as they lie, by cp.async; a Q8_0 cache's are decoded here (d · q,
// rounded to f16 as the tile holds it), 8 values a thread at a time, and stored before the
// thread goes on: the barrier that publishes a cp.async tile publishes these too.
template <int DT, int HD, int P>
__device__ __forceinline__ void load_tile(u16* dst, const u8* cache, const unsigned* table, int kv_cols, int col,
                                          int j0, int keys) {
    for (int i = threadIdx.x; i < FA_KEYS * HD / 8; i += FA_THREADS) {
        const int r = i / (HD / 8), c = (i % (HD / 8)) * 8;
        const bool in = j0 + r < keys;
        if (DT == DT_F16) {
            const u16* src = (const u16*)cache + (in ? kv_row(table, j0 + r) * kv_cols + col + c : 0);
            cp_async16(dst + r * P + c, src, in ? 16 : 0);
        } else {
            float x[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
            if (in) kv_vec8<DT>(cache + kv_row(table, j0 + r) * row_bytes(DT, kv_cols), col + c, x);
            Half8 h;
#pragma unroll
            for (int e = 0; e < 4; e++) h.w[e] = pack_h2(x[2 * e], x[2 * e + 1]);
            *(Half8*)(dst + r * P + c) = h;
        }
    }
    cp_async_commit();
}

// Where split z of a split flash attention leaves row t's (max, sum) for head h: after every
// split's outputs (gridDim.z × n rows like `out`), two floats per (split, row, head).
__device__ __forceinline__ float* flash_stats(float* ws, int n, int n_heads, int hd, int z, int t, int h) {
    return ws + (long long)gridDim.z * n * n_heads * hd + (((long long)z * n + t) * n_heads + h) * 2;
}

// The flash kernels' products and copies (mma m16n8k16, cp.async) are Ampere's. Compiled for
// an older device (NVRTC for a Turing card) they are a trap: the backend takes the simple kernel
// there (FLASH_CAPABILITY in src/backend/cuda/mod.rs), and the module still loads for the split
// kernel below.
#if defined(KERNEL_HOST_CHECK) || !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define FLASH_TENSOR_CORES 1
#endif

// q: n × n_heads·HD f32; kc, vc: cache rows of kv_cols values in DT (f16 or Q8_0; KV head g at
// g·HD); out like q. Grid: (ceil(n / FA_ROWS), n_heads, splits); block: FA_THREADS.
// With one split, a block attends its rows over every key they see and writes `out`. With more
// (a few rows over a long context, too few blocks to fill the device), block z takes keys
// z·chunk .. (z + 1)·chunk - 1 only (chunk a multiple of FA_KEYS, so no tile straddles two
// splits), and leaves in `ws` what flash_combine merges: its rows' unnormalised outputs, laid
// out like `out`, at split z's n rows (ws + z·n·n_heads·HD), and each (row, head)'s running max
// (log2 units) and sum after every split's outputs (flash_stats). A row that sees none of a
// split's keys leaves values there that flash_combine never reads.
template <int DT, int HD>
__device__ void flash_impl(const float* q, const u8* kc, const u8* vc, const unsigned* table, float* ws, float* out,
                           int n, int n_heads, int group, int kv_cols, int first_pos, float scale, int chunk) {
#ifndef FLASH_TENSOR_CORES
    __trap();
#else
    constexpr int KP = HD + FA_PAD;      // pitch (halves) of a key or value row; the Q tile is staged in the keys'
    constexpr int KSTEPS = HD / 16;       // k-steps of Q·Kᵀ
    constexpr int OTILES = HD / 8;        // 8-wide column tiles of the output
    constexpr int STILES = FA_KEYS / 8;   // 8-wide column tiles of a score tile
    __shared__ Half8 k_raw[FA_KEYS * KP / 8];
    __shared__ Half8 v_raw[FA_KEYS * KP / 8];
    u16* ks = (u16*)k_raw;
    u16* vs = (u16*)v_raw;

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, grp = lane >> 2, quad = lane & 3;
    const int h = blockIdx.y, col = (h / group) * HD;
    // The last query tiles see the most keys: they go first, so the short ones fill the tail.
    const int q0 = (gridDim.x - 1 - blockIdx.x) * FA_ROWS, r0 = warp * 16;
    const long long q_stride = (long long)n_heads * HD;
    const int keys = first_pos + min(n, q0 + FA_ROWS);  // keys the block's last row sees
    // This block's keys: its split's (every key its rows see, unsplit; the host passes a chunk
    // of at least that). A block whose rows see none of its split's keys runs no tile and leaves
    // values flash_combine never reads (returning early instead costs the hd-128 kernel seven
    // registers, and a block per SM).
    const bool split = gridDim.z > 1;
    const int kb = (int)blockIdx.z * chunk, ke = min(keys, kb + chunk);

    // The block's queries in f16 (rows past n as zeros), then each warp's rows as A fragments.
    for (int i = tid; i < FA_ROWS * HD / 2; i += FA_THREADS) {
        int r = i / (HD / 2), c = (i % (HD / 2)) * 2;
        float x0 = 0.0f, x1 = 0.0f;
        if (q0 + r < n) {
            const float* src = q + (q0 + r) * q_stride + h * HD + c;
            x0 = src[0];
            x1 = src[1];
        }
        *(u32*)&ks[r * KP + c] = pack_h2(x0, x1);
    }
    __syncthreads();
    u32 qf[KSTEPS][4];
#pragma unroll
    for (int k = 0; k < KSTEPS; k++) {
        const u16* a = ks + (r0 + grp) * KP + k * 16 + quad * 2;
        qf[k][0] = ld_u32(a);
        qf[k][1] = ld_u32(a + 8 * KP);
        qf[k][2] = ld_u32(a + 8);
        qf[k][3] = ld_u32(a + 8 * KP + 8);
    }

    // This lane's rows: ta (fragment elements 0, 1) and ta + 8 (elements 2, 3).
    const int ta = q0 + r0 + grp;
    float o[OTILES][4];
#pragma unroll
    for (int j = 0; j < OTILES; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    // Running max (log2 units) and this lane's share of the running sum, per row.
    float m[2] = {MASKED, MASKED}, l[2] = {0.0f, 0.0f};
    const float scale2 = scale * 1.4426950408889634f;  // exp(x·scale) = exp2(x·scale2)

    // The rows this lane addresses for ldmatrix: of the keys (two 8-key score tiles, both halves
    // of a k-step: tile 2p + lane / 16, dims + 8 for lanes 8..15 and 24..31) and of the values
    // (two 8-dim output tiles over a k-step's 16 keys: keys + 8 for those lanes, tile 2p + lane / 16).
    const int lr = lane & 7, l8 = ((lane >> 3) & 1) * 8, l16 = lane >> 4;
    const u16* k_at = ks + (l16 * 8 + lr) * KP + l8;
    const u16* v_at = vs + (l8 + lr) * KP + l16 * 8;

    __syncthreads();  // every warp has its Q fragments: the key tile is free
    if (kb < ke) load_tile<DT, HD, KP>(ks, kc, table, kv_cols, col, kb, ke);
    for (int j0 = kb; j0 < ke; j0 += FA_KEYS) {
        // Keys j0.. have landed (this thread's copies; the barrier: everyone's), and every warp
        // is done with the values before them.
        cp_async_wait_all();
        __syncthreads();
        load_tile<DT, HD, KP>(vs, vc, table, kv_cols, col, j0, ke);

        // Scores of this warp's 16 rows against the 64 keys.
        float s[STILES][4];
#pragma unroll
        for (int j = 0; j < STILES; j++) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
        for (int p = 0; p < STILES / 2; p++) {
#pragma unroll
            for (int k = 0; k < KSTEPS; k++) {
                u32 b[4];
                ldmatrix_x4<false>(b, k_at + p * 16 * KP + k * 16);
                mma_16816(s[2 * p], qf[k], b);
                mma_16816(s[2 * p + 1], qf[k], b + 2);
            }
        }
        // Causal mask, only on tiles that reach past this warp's first row's position.
        const bool whole = j0 + FA_KEYS - 1 <= first_pos + q0 + r0;
        float tmax[2] = {MASKED, MASKED};
#pragma unroll
        for (int j = 0; j < STILES; j++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int row = ta + (e >> 1) * 8, key = j0 + j * 8 + quad * 2 + (e & 1);
                float x = s[j][e] * scale2;
                if (!whole && key > first_pos + row) x = MASKED;
                s[j][e] = x;
                tmax[e >> 1] = fmaxf(tmax[e >> 1], x);
            }
        }
        // Online softmax: the four lanes of a group hold one row between them.
        float alpha[2];
#pragma unroll
        for (int i = 0; i < 2; i++) {
            tmax[i] = fmaxf(tmax[i], __shfl_xor_sync(0xffffffffu, tmax[i], 1));
            tmax[i] = fmaxf(tmax[i], __shfl_xor_sync(0xffffffffu, tmax[i], 2));
            // Every row sees key 0, so m is a real score from the first tile on and masked
            // scores below give exp2(MASKED - m) = 0.
            float mn = fmaxf(m[i], tmax[i]);
            alpha[i] = exp2f(m[i] - mn);
            m[i] = mn;
            l[i] *= alpha[i];
        }
#pragma unroll
        for (int j = 0; j < STILES; j++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float p = exp2f(s[j][e] - m[e >> 1]);
                s[j][e] = p;
                l[e >> 1] += p;
            }
        }
#pragma unroll
        for (int j = 0; j < OTILES; j++) {
            o[j][0] *= alpha[0];
            o[j][1] *= alpha[0];
            o[j][2] *= alpha[1];
            o[j][3] *= alpha[1];
        }

        // The values have landed, and every warp is done with the keys: the next keys load
        // while these values are summed.
        cp_async_wait_all();
        __syncthreads();
        if (j0 + FA_KEYS < ke) load_tile<DT, HD, KP>(ks, kc, table, kv_cols, col, j0 + FA_KEYS, ke);

        // O += P·V: the score accumulators of tiles 2k, 2k+1 are exactly the A fragment of
        // k-step k (rows grp, grp + 8; keys 16k + 2·quad.. and + 8), rounded to f16.
#pragma unroll
        for (int k = 0; k < FA_KEYS / 16; k++) {
            u32 a[4] = {pack_h2(s[2 * k][0], s[2 * k][1]), pack_h2(s[2 * k][2], s[2 * k][3]),
                        pack_h2(s[2 * k + 1][0], s[2 * k + 1][1]), pack_h2(s[2 * k + 1][2], s[2 * k + 1][3])};
#pragma unroll
            for (int p = 0; p < OTILES / 2; p++) {
                u32 b[4];
                ldmatrix_x4<true>(b, v_at + k * 16 * KP + p * 16);
                mma_16816(o[2 * p], a, b);
                mma_16816(o[2 * p + 1], a, b + 2);
            }
        }
    }

#pragma unroll
    for (int i = 0; i < 2; i++) {
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    }
#pragma unroll
    for (int i = 0; i < 2; i++) {
        int row = ta + 8 * i;
        if (row >= n) continue;
        // Split: the unnormalised outputs and the (max, sum) flash_combine merges them by.
        float inv = split ? 1.0f : 1.0f / l[i];
        float* dst = (split ? ws + (long long)blockIdx.z * n * q_stride : out) + row * q_stride + h * HD + quad * 2;
#pragma unroll
        for (int j = 0; j < OTILES; j++) {
            dst[j * 8] = o[j][2 * i] * inv;
            dst[j * 8 + 1] = o[j][2 * i + 1] * inv;
        }
        if (split && quad == 0) {
            float* st = flash_stats(ws, n, n_heads, HD, blockIdx.z, row, h);
            st[0] = m[i];
            st[1] = l[i];
        }
    }
#endif
}

#define FLASH(NAME, DT, HD)                                                                                   \
    extern "C" __global__ void __launch_bounds__(FA_THREADS)                                                  \
        flash_attn_##NAME##_hd##HD(const float* q, const u8* kc, const u8* vc, const unsigned* table, float* ws, \
                                   float* out, int n, int n_heads, int group, int kv_cols, int first_pos,       \
                                   float scale, int chunk) {                                                    \
        grid_dependency();                                                                                        \
        flash_impl<DT, HD>(q, kc, vc, table, ws, out, n, n_heads, group, kv_cols, first_pos, scale, chunk);      \
    }

FLASH(f16, DT_F16, 64)
FLASH(f16, DT_F16, 80)
FLASH(f16, DT_F16, 96)
FLASH(f16, DT_F16, 128)
FLASH(q8_0, DT_Q8_0, 64)
FLASH(q8_0, DT_Q8_0, 80)
FLASH(q8_0, DT_Q8_0, 96)
FLASH(q8_0, DT_Q8_0, 128)

// out[t][h·hd + d] of a flash attention split `splits` ways into chunks of `chunk` keys, from
// what its blocks left in `ws` (flash_impl): row t (at position first_pos + t) merges the splits
// whose first key it sees, each weighted by exp2 of its max less the largest. Grid: (n_heads, n);
// block: FA_THREADS (a thread per output dim).
extern "C" __global__ void __launch_bounds__(FA_THREADS)
    flash_combine(float* ws, float* out, int n, int n_heads, int hd, int first_pos, int chunk, int splits) {
    grid_dependency();
    const int h = blockIdx.x, t = blockIdx.y, d = threadIdx.x;
    const int seen = min(splits, (first_pos + t) / chunk + 1);
    const long long q_stride = (long long)n_heads * hd;
    const float* stats = ws + (long long)splits * n * q_stride;
    float mx = MASKED;
    for (int z = 0; z < seen; z++) mx = fmaxf(mx, stats[(((long long)z * n + t) * n_heads + h) * 2]);
    float den = 0.0f, o = 0.0f;
    for (int z = 0; z < seen; z++) {
        const float* st = stats + (((long long)z * n + t) * n_heads + h) * 2;
        const float w = exp2f(st[0] - mx);
        den += st[1] * w;
        if (d < hd) o += ws[(long long)z * n * q_stride + t * q_stride + h * hd + d] * w;
    }
    if (d < hd) out[t * q_stride + h * hd + d] = o / den;
}

// The chunks a split attention of `rows` query rows over `keys` positions takes, given `most`
// (the host's split_most_chunks, from the device's size): at least SPLIT_MIN_KEYS keys a chunk,
// at most `most` chunks and rows × chunks at most MAX_SPLITS (the workspace), every chunk
// holding a key. The host's split_chunks (src/footprint/attention.rs), step for step.
__device__ inline void split_plan(int keys, int rows, int most, int* chunks, int* chunk) {
    const int cap = rows > 1 ? (MAX_SPLITS / rows > 1 ? MAX_SPLITS / rows : 1) : MAX_SPLITS;
    most = most < 1 ? 1 : (most > cap ? cap : most);
    int c = (keys + SPLIT_MIN_KEYS - 1) / SPLIT_MIN_KEYS;
    c = c < 1 ? 1 : (c > most ? most : c);
    const int k = (keys + c - 1) / c;
    *chunk = k < 1 ? 1 : k;
    *chunks = (keys + *chunk - 1) / *chunk;
}

// Lanes that share a key in the split kernel: a lane takes 8 of the head's dims, and the lanes
// of a key are a power of two, so their sum is a butterfly inside the warp (4 for heads of 32,
// 16 for 128, 32 for 256).
__device__ __forceinline__ int split_lanes(int hd) {
    int lanes = 1;
    while (lanes * 8 < hd) lanes <<= 1;
    return lanes;
}

// out[t][h·hd + d] of row t and head h from the `chunks` partials the split blocks left: every
// chunk's sum and outputs rescaled to the largest max. Read past L1: other blocks wrote them.
__device__ void combine_head(const float* ws, float* out, int t, int h, int n_heads, int hd, int chunks) {
    const int width = hd + 2;
    const float* w = ws + ((long long)h * MAX_SPLITS + t * chunks) * width;
    float mx = MASKED;
    for (int c = 0; c < chunks; c++) mx = fmaxf(mx, __ldcg(w + c * width));
    float sum = 0.0f;
    for (int c = 0; c < chunks; c++) sum += __ldcg(w + c * width + 1) * expf(__ldcg(w + c * width) - mx);
    const float inv = 1.0f / sum;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float o = 0.0f;
        for (int c = 0; c < chunks; c++) o += __ldcg(w + c * width + 2 + d) * expf(__ldcg(w + c * width) - mx);
        out[(long long)t * n_heads * hd + h * hd + d] = o * inv;
    }
}

// The 8 dims at column c of the LOADS cache rows a lane of the split kernel takes next: chunk
// positions first, first + groups, ... of the chunk at k0, loaded (kv_load8). Keys past the
// chunk's `len` load its last key (their scores are masked): no load has a branch, so every one
// is issued before any value is used.
template <int DT, int LOADS>
__device__ __forceinline__ void split_loads(const u8* cache, const unsigned* table, long long rb, int k0, int first,
                                            int groups, int len, int c, KvRaw (&x)[LOADS]) {
#pragma unroll
    for (int u = 0; u < LOADS; u++) {
        const int jj = min(first + u * groups, len - 1);
        x[u] = kv_load8<DT>(cache + kv_row(table, k0 + jj) * rb, c);
    }
}

// One chunk of keys (chunk·blockIdx.y ..) for the n ≤ ROWS query rows of head blockIdx.x (ROWS:
// 1 for a decode step, SPLIT_ROWS else; the registers a row takes are held either way); caches
// of any KV type DT, head dims of 32..SPLIT_MAX_HD in multiples of 8. Leaves, per row t, at
// ws[(h·MAX_SPLITS + t·chunks + chunk)·(hd + 2)]: the chunk's max score m, its sum of
// exp(score - m), and hd outputs weighted by those exps (a row that sees none of the chunk:
// MASKED, 0, zeros). The head's last block to finish (tickets[h] counts them, and is left at 0
// for the next launch) then writes the head's rows of `out` from every chunk's partials.
// Grid: (n_heads, chunks) with chunks ≤ most ≤ MAX_SPLITS / n; block: SPLIT_THREADS.
// With `pos_at` (a recorded step, replayed at later positions as a CUDA graph) the position is
// read there and the chunks planned here, as split_chunks plans them on the host; the grid then
// has room for the most chunks (`most`), and blocks past the plan take no ticket and leave
// nothing.
//
// The chunk is read at the memory's pace, with no barrier until its keys are done: a lane takes
// 8 dims of a key (16 bytes of an f16 cache), a group of split_lanes(hd) lanes covers a key, and
// group g takes keys g, g + groups, ... of the chunk, LOADS at a time, their keys' and values'
// loads all in flight together (for heads of 128: 32 keys a block, 16 KiB of an f16 cache, each
// round trip to memory). Each group keeps its own running max and sum per row (online softmax:
// a batch of keys rescales what it holds once), and at the end the block merges its groups'
// partials in group order, each weighted by exp(its max - the largest).
template <int DT, int ROWS>
__device__ void split_impl(const float* q, const u8* kc, const u8* vc, const unsigned* table, float* ws,
                           unsigned* tickets, float* out, int n, int n_heads, int group, int hd, int kv_cols,
                           int first_pos, float scale, int chunk, int most, const int* pos_at) {
    constexpr int LOADS = ROWS == 1 ? SPLIT_LOADS : 1;
    // Per row t and group g: the group's max and sum at stats[2 (t·groups + g)], its weighted
    // values at vals[(t·groups + g)·hd + d] (groups·hd ≤ SPLIT_THREADS·8: lanes·8 ≥ hd).
    __shared__ float stats[ROWS * SPLIT_THREADS / 4 * 2];
    __shared__ float vals[ROWS * SPLIT_THREADS * 8];
    __shared__ bool last;  // this block is the head's last to finish
    const int tid = threadIdx.x;
    const int h = blockIdx.x, part = blockIdx.y, col = (h / group) * hd;
    int chunks = gridDim.y;
    if (pos_at) {
        first_pos = *pos_at;
        split_plan(first_pos + n, n, most, &chunks, &chunk);
        if (part >= chunks) return;  // the whole block: no barrier is reached
    }
    const long long rb = row_bytes(DT, kv_cols);
    const int k0 = part * chunk, len = min(first_pos + n, k0 + chunk) - k0;
    // This lane: dims d0..d0+7 (none when d0 ≥ hd: it only joins the sums, its query zeros,
    // loading dims 0..7 where it loads) of keys kg, kg + groups, ... of the chunk.
    const int lanes = split_lanes(hd), groups = SPLIT_THREADS / lanes;
    const int kg = tid / lanes, d0 = (tid % lanes) * 8;
    const bool dims = d0 < hd;
    const int c = col + (dims ? d0 : 0);
    float qr[ROWS][8], acc[ROWS][8], m[ROWS], l[ROWS];
#pragma unroll
    for (int t = 0; t < ROWS; t++) {
#pragma unroll
        for (int e = 0; e < 8; e++) {
            qr[t][e] = t < n && dims ? q[(long long)t * n_heads * hd + h * hd + d0 + e] * scale : 0.0f;
            acc[t][e] = 0.0f;
        }
        m[t] = MASKED;
        l[t] = 0.0f;
    }

    // Every lane runs every batch (the butterflies take the whole warp); keys past the chunk
    // score as masked.
    for (int jb = 0; jb < len; jb += groups * LOADS) {
        KvRaw kr[LOADS], vr[LOADS];
        split_loads<DT, LOADS>(kc, table, rb, k0, jb + kg, groups, len, c, kr);
        split_loads<DT, LOADS>(vc, table, rb, k0, jb + kg, groups, len, c, vr);
        float kx[LOADS][8], vx[LOADS][8];
#pragma unroll
        for (int u = 0; u < LOADS; u++) {
            kv_cvt8<DT>(kr[u], kx[u]);
            kv_cvt8<DT>(vr[u], vx[u]);
        }
#pragma unroll
        for (int t = 0; t < ROWS; t++) {
            if (t >= n) break;
            float sc[LOADS];
            float mx = m[t];
#pragma unroll
            for (int u = 0; u < LOADS; u++) {
                const int jj = jb + kg + u * groups;
                float dot = 0.0f;
#pragma unroll
                for (int e = 0; e < 8; e++) dot += qr[t][e] * kx[u][e];
                for (int o = lanes >> 1; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
                sc[u] = jj < len && k0 + jj <= first_pos + t ? dot : MASKED;
                mx = fmaxf(mx, sc[u]);
            }
            // What the group holds, rescaled to the new max (1 while both are masked: it holds
            // nothing then); masked scores weigh 0.
            const float a = expf(m[t] - mx);
            float sum = 0.0f;
#pragma unroll
            for (int e = 0; e < 8; e++) acc[t][e] *= a;
#pragma unroll
            for (int u = 0; u < LOADS; u++) {
                const float w = sc[u] > MASKED ? expf(sc[u] - mx) : 0.0f;
                sum += w;
#pragma unroll
                for (int e = 0; e < 8; e++) acc[t][e] += w * vx[u][e];
            }
            l[t] = l[t] * a + sum;
            m[t] = mx;
        }
    }

    // The groups' partials, then the block's: per row and dim, the groups in order.
#pragma unroll
    for (int t = 0; t < ROWS; t++) {
        if (t >= n) break;
        if (tid % lanes == 0) {
            stats[2 * (t * groups + kg)] = m[t];
            stats[2 * (t * groups + kg) + 1] = l[t];
        }
        if (dims)
#pragma unroll
            for (int e = 0; e < 8; e++) vals[(t * groups + kg) * hd + d0 + e] = acc[t][e];
    }
    __syncthreads();
    const int width = hd + 2;
    for (int i = tid; i < n * hd; i += SPLIT_THREADS) {
        const int t = i / hd, d = i % hd;
        const float* st = stats + 2 * t * groups;
        float mx = MASKED;
        for (int g = 0; g < groups; g++) mx = fmaxf(mx, st[2 * g]);
        float sum = 0.0f, o = 0.0f;
        for (int g = 0; g < groups; g++) {
            const float w = expf(st[2 * g] - mx);
            sum += st[2 * g + 1] * w;
            o += vals[(t * groups + g) * hd + d] * w;
        }
        float* wp = ws + ((long long)h * MAX_SPLITS + t * chunks + part) * width;
        if (d == 0) {
            wp[0] = mx;
            wp[1] = sum;
        }
        wp[2 + d] = o;
    }
    // This block's partials reach the device (each thread fences its own writes) before its
    // ticket; the block that draws the head's last ticket sees every chunk's.
    __threadfence();
    __syncthreads();
    if (tid == 0) {
        last = atomicAdd(tickets + h, 1u) == (unsigned)(chunks - 1);
        if (last) tickets[h] = 0;  // every chunk has drawn: ready for the next launch
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int t = 0; t < n; t++) combine_head(ws, out, t, h, n_heads, hd, chunks);
}

// attention_split_*: up to SPLIT_ROWS query rows; attention_split1_*: one (a decode step), in
// fewer registers, so more blocks fit an SM.
#define SPLIT(name, DT, ROWS)                                                                               \
    extern "C" __global__ void __launch_bounds__(SPLIT_THREADS)                                             \
        name(const float* q, const u8* kc, const u8* vc, const unsigned* table, float* ws, unsigned* tickets, \
             float* out, int n, int n_heads, int group, int hd, int kv_cols, int first_pos, float scale,      \
             int chunk, int most, const int* pos_at) {                                                       \
        grid_dependency();                                                                                   \
        split_impl<DT, ROWS>(q, kc, vc, table, ws, tickets, out, n, n_heads, group, hd, kv_cols, first_pos,  \
                             scale, chunk, most, pos_at);                                                    \
    }

SPLIT(attention_split_f32, DT_F32, SPLIT_ROWS)
SPLIT(attention_split_f16, DT_F16, SPLIT_ROWS)
SPLIT(attention_split_q8_0, DT_Q8_0, SPLIT_ROWS)
SPLIT(attention_split1_f32, DT_F32, 1)
SPLIT(attention_split1_f16, DT_F16, 1)
SPLIT(attention_split1_q8_0, DT_Q8_0, 1)
