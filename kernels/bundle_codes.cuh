// Decoding FFN bundles in their store encodings (src/store/quant.rs, src/store/write.rs), one
// element at a time: what the bundle kernels (kernels/bundles.cu) read. Checked bit for bit
// against the store's dequantizers on the CPU by kernels/host/bundle_check.cpp.
#pragma once
#include "common.cuh"

#define INT4_GROUP 32

// Bundle encodings (the kernels of each are named by `bundle_kernels` in src/backend/cuda/mod.rs).
#define BE_F32 0
#define BE_F16 1
#define BE_BF16 2
#define BE_INT8 3
#define BE_INT4 4

// Byte loads: an INT8 bundle is `parts · (4 + d)` bytes, so its f32 scales may be unaligned.
__device__ __forceinline__ float load_f32_bytes(const u8* p) {
    return __uint_as_float((u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24));
}

// Whether `Part<E>::at8` can take the parts of bundles at `b` and `rest` (null: none) eight
// elements at a time in 16-byte loads: the float encodings, d a multiple of 8 (bundles and their
// parts are then multiples of 16 bytes long) and both addresses 16-byte aligned (a mapped store
// tensor starts where the file puts it). A warp's loads are then 512 contiguous bytes, whole
// requests where a bundle rests in host memory and is read in place over the link (one element
// a lane made them 64 bytes: f16 misses were read at 0.7 of the link on the H200).
template <int E>
__device__ __forceinline__ bool vector_parts(int d, const u8* b, const u8* rest) {
    return (E == BE_F32 || E == BE_F16 || E == BE_BF16) && d % 8 == 0 &&
           (((unsigned long long)b | (unsigned long long)rest) & 15) == 0;
}

// Part `p` of one bundle (`row`), ready to decode element by element.
template <int E>
struct Part {
    const u8* codes;   // the part's values or codes
    const u8* scales;  // INT4: the part's group scales (f16)
    float scale;       // INT8: the part's scale

    __device__ __forceinline__ Part(const u8* row, int parts, int d, int p) {
        scales = 0;
        scale = 1.0f;
        if (E == BE_F32) {
            codes = row + (long long)p * d * 4;
        } else if (E == BE_F16 || E == BE_BF16) {
            codes = row + (long long)p * d * 2;
        } else if (E == BE_INT8) {
            scale = load_f32_bytes(row + p * 4);
            codes = row + parts * 4 + (long long)p * d;
        } else {
            int groups = d / INT4_GROUP;
            scales = row + p * groups * 2;
            codes = row + parts * groups * 2 + (long long)p * (d / 2);
        }
    }

    // Element j, as store::quant's dequantizers give it.
    __device__ __forceinline__ float at(int j) const {
        if (E == BE_F32) return ((const float*)codes)[j];
        if (E == BE_F16) return h2f(((const u16*)codes)[j]);
        if (E == BE_BF16) return bf2f(((const u16*)codes)[j]);
        if (E == BE_INT8) return scale * (float)(int)((const i8*)codes)[j];
        // INT4: value 2k in the low nibble of byte k, stored as q + 8.
        u8 byte = codes[j >> 1];
        int nib = (j & 1) ? (byte >> 4) : (byte & 15);
        return h2f(((const u16*)scales)[j / INT4_GROUP]) * (float)(nib - 8);
    }

    // Elements j .. j + 8 (j a multiple of 8), the values `at` gives: in 16-byte loads for the
    // float encodings (only where vector_parts), else one at a time.
    __device__ __forceinline__ void at8(int j, float* v) const {
        if (E == BE_F32) {
            float4 a = ((const float4*)codes)[j / 4], b = ((const float4*)codes)[j / 4 + 1];
            v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
            v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
        } else if (E == BE_F16 || E == BE_BF16) {
            uint4 q = ((const uint4*)codes)[j / 8];
            u32 w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
            for (int k = 0; k < 4; k++) {
                u16 lo = (u16)(w[k] & 0xffff), hi = (u16)(w[k] >> 16);
                v[2 * k] = E == BE_F16 ? h2f(lo) : bf2f(lo);
                v[2 * k + 1] = E == BE_F16 ? h2f(hi) : bf2f(hi);
            }
        } else {
#pragma unroll
            for (int k = 0; k < 8; k++) v[k] = at(j + k);
        }
    }
};
