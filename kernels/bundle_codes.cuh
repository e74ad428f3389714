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
};
