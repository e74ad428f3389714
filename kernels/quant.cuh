// Block-format weights against 8-bit activation blocks: one 32-value sub-block of a weight row
// unpacked into codes for dp4a, and its dot product with one ActBlock. Every block format goes
// through these two functions (decode matvec), so the bit unpacking lives in one place; it is
// checked against the reference decode (`load_elem`) on the CPU by kernels/host/decode_check.cpp.
#pragma once
#include "common.cuh"

// value_i = scale[h] · (code_i − off) − min[h], h = i / 16 (halves = 2) or 0 (halves = 1).
// Codes are 32 bytes packed little-endian into 8 ints (non-negative, < 128, except Q8_0's).
struct WeightSub {
    int q[8];
    float scale[2];
    float min[2];
    int off;
    int halves;
    // The min multiplies `ActBlock::s` (d·Σq rounded to f16, as llama.cpp's q8_1 does for
    // Q4_1/Q5_1) instead of d·Σq.
    bool min_by_s;
};

__device__ __forceinline__ u32 load_u32_2(const u8* p) {  // 2-byte aligned
    return (u32)load_u16(p) | ((u32)load_u16(p + 2) << 16);
}

// Bits 0..3 of `h` moved to bit 4 of bytes 0..3.
__device__ __forceinline__ u32 spread_bit4(u32 h) {
    return ((h & 1u) << 4) | ((h & 2u) << 11) | ((h & 4u) << 18) | ((h & 8u) << 25);
}

// Bytes of a block format's super-block (K-quants, 256 values) or block (32 values).
__device__ __forceinline__ int block_bytes(int dtype) { return (int)row_bytes(dtype, dtype >= DT_Q2_K ? 256 : 32); }

// Sub-block `b` (values 32b..32b+32) of a row in block format `dtype`.
__device__ __forceinline__ WeightSub decode_sub(const u8* row, int dtype, int b) {
    WeightSub w;
    w.off = 0;
    w.halves = 1;
    w.min[0] = w.min[1] = 0.0f;
    w.min_by_s = false;
    if (dtype < DT_Q2_K) {
        const u8* blk = row + (long long)block_bytes(dtype) * b;
        float d = h2f(load_u16(blk));
        w.scale[0] = w.scale[1] = d;
        switch (dtype) {
            case DT_Q8_0:
#pragma unroll
                for (int k = 0; k < 8; k++) w.q[k] = (int)load_u32_2(blk + 2 + 4 * k);
                break;
            case DT_Q4_0:
            case DT_Q4_1: {
                const u8* qs = blk + 2;
                if (dtype == DT_Q4_1) {
                    w.min[0] = -h2f(load_u16(blk + 2));
                    w.min_by_s = true;
                    qs = blk + 4;
                } else {
                    w.off = 8;
                }
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    u32 packed = load_u32_2(qs + 4 * k);
                    w.q[k] = (int)(packed & 0x0f0f0f0fu);
                    w.q[k + 4] = (int)((packed >> 4) & 0x0f0f0f0fu);
                }
                break;
            }
            default: {  // Q5_0, Q5_1: the fifth bit of value k is bit k of qh
                const u8* qhp = blk + 2;
                if (dtype == DT_Q5_1) {
                    w.min[0] = -h2f(load_u16(blk + 2));
                    w.min_by_s = true;
                    qhp = blk + 4;
                } else {
                    w.off = 16;
                }
                u32 qh = load_u32_2(qhp);
                const u8* qs = qhp + 4;
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    u32 packed = load_u32_2(qs + 4 * k);
                    w.q[k] = (int)((packed & 0x0f0f0f0fu) | spread_bit4((qh >> (4 * k)) & 15u));
                    w.q[k + 4] = (int)(((packed >> 4) & 0x0f0f0f0fu) | spread_bit4((qh >> (16 + 4 * k)) & 15u));
                }
            }
        }
        w.min[1] = w.min[0];
        return w;
    }
    // K-quants: sub-block j of super-block b / 8.
    const u8* B = row + (long long)block_bytes(dtype) * (b >> 3);
    int j = b & 7;
    switch (dtype) {
        case DT_Q2_K: {
            int n = j >> 2, jj = j & 3;
            float d = h2f(load_u16(B + 80)), dmin = h2f(load_u16(B + 82));
#pragma unroll
            for (int k = 0; k < 8; k++) w.q[k] = (int)((load_u32_2(B + 16 + 32 * n + 4 * k) >> (2 * jj)) & 0x03030303u);
            w.halves = 2;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                int sc = B[8 * n + 2 * jj + h];
                w.scale[h] = __fmul_rn(d, (float)(sc & 0x0f));
                w.min[h] = __fmul_rn(dmin, (float)(sc >> 4));
            }
            break;
        }
        case DT_Q3_K: {
            int n = j >> 2, jj = j & 3;
            float d = h2f(load_u16(B + 108));
            const u8* sc = B + 96;
#pragma unroll
            for (int k = 0; k < 8; k++) {
                u32 low = (load_u32_2(B + 32 + 32 * n + 4 * k) >> (2 * jj)) & 0x03030303u;
                u32 high = (load_u32_2(B + 4 * k) >> (4 * n + jj)) & 0x01010101u;
                // code = low | high << 2 in 0..8; the value is code − 4 (high clear subtracts 4).
                w.q[k] = (int)(low | (high << 2));
            }
            w.off = 4;
            w.halves = 2;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                int s = 8 * n + 2 * jj + h;
                int low = s < 8 ? (sc[s] & 0x0f) : (sc[s - 8] >> 4);
                int high = (sc[8 + (s & 3)] >> (2 * (s >> 2))) & 3;
                w.scale[h] = __fmul_rn(d, (float)((low | (high << 4)) - 32));
            }
            break;
        }
        case DT_Q4_K:
        case DT_Q5_K: {
            int c = j >> 1, upper = j & 1;
            const u8* qs = B + (dtype == DT_Q4_K ? 16 : 48);
#pragma unroll
            for (int k = 0; k < 8; k++) {
                u32 q = (load_u32_2(qs + 32 * c + 4 * k) >> (4 * upper)) & 0x0f0f0f0fu;
                if (dtype == DT_Q5_K) q |= ((load_u32_2(B + 16 + 4 * k) >> j) & 0x01010101u) << 4;
                w.q[k] = (int)q;
            }
            w.scale[0] = w.scale[1] = __fmul_rn(h2f(load_u16(B)), (float)scale_min_k4(B + 4, j, true));
            w.min[0] = w.min[1] = __fmul_rn(h2f(load_u16(B + 2)), (float)scale_min_k4(B + 4, j, false));
            break;
        }
        default: {  // Q6_K
            int half = j >> 2, k4 = j & 3;
            float d = h2f(load_u16(B + 208));
#pragma unroll
            for (int k = 0; k < 8; k++) {
                u32 lo = load_u32_2(B + 64 * half + 32 * (k4 & 1) + 4 * k);
                lo = (k4 < 2 ? lo : lo >> 4) & 0x0f0f0f0fu;
                u32 hi = (load_u32_2(B + 128 + 32 * half + 4 * k) >> (2 * k4)) & 0x03030303u;
                w.q[k] = (int)(lo | (hi << 4));
            }
            w.off = 32;
            w.halves = 2;
#pragma unroll
            for (int h = 0; h < 2; h++) w.scale[h] = __fmul_rn(d, (float)(i8)B[192 + 8 * half + h + 2 * k4]);
        }
    }
    return w;
}

// Σ_i value_i · a.d · a.q_i over the sub-block.
__device__ __forceinline__ float sub_dot(const WeightSub& w, const ActBlock* a) {
    if (w.halves == 1) {
        int dot = 0;
#pragma unroll
        for (int k = 0; k < 8; k++) dot = __dp4a(w.q[k], a->qs[k], dot);
        float v = w.scale[0] * a->d * (float)(dot - w.off * a->isum);
        if (w.min_by_s) return v - w.min[0] * a->s;
        return v - w.min[0] * a->d * (float)a->isum;
    }
    int dot[2] = {0, 0}, sum[2] = {0, 0};
#pragma unroll
    for (int k = 0; k < 8; k++) {
        dot[k >> 2] = __dp4a(w.q[k], a->qs[k], dot[k >> 2]);
        sum[k >> 2] = __dp4a(0x01010101, a->qs[k], sum[k >> 2]);
    }
    float v = 0.0f;
#pragma unroll
    for (int h = 0; h < 2; h++) v += w.scale[h] * (float)(dot[h] - w.off * sum[h]) - w.min[h] * (float)sum[h];
    return a->d * v;
}
