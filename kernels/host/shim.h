// Host stand-ins for the CUDA built-ins the kernel headers use, so their per-thread device
// functions (decoders, dot products) compile with g++ and can be checked on a machine without a
// GPU (kernels/host/decode_check.cpp). Warp and block collectives are single-thread identities:
// only code that does not depend on them is checked here, unless KERNEL_HOST_SIMT runs each
// block as threads (kernels/host/simt.h).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#define __device__
#define __forceinline__ inline
#define __global__
#define __restrict__

inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
// Built with -ffp-contract=off, so these round once each, as the device intrinsics do.
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline int __float2int_rn(float f) { return (int)std::nearbyint(f); }
// Signed 8-bit × 8-bit products of the four bytes, summed into c.
inline int __dp4a(int a, int b, int c) {
    for (int k = 0; k < 4; k++) c += (int)(signed char)(a >> (8 * k)) * (int)(signed char)(b >> (8 * k));
    return c;
}
// Vector types and the read-only load, as the f16 matvec uses them.
struct uint4 { unsigned x, y, z, w; };
struct float4 { float x, y, z, w; };
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
template <typename T> inline T __ldg(const T* p) { return *p; }
// The L2-only load, the fence and the ticket atomic of a split attention's last block (blocks
// run one after another here, so the fence has nothing to order).
template <typename T> inline T __ldcg(const T* p) { return *p; }
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline float atomicAdd(float* p, float v) {
    float old, sum;
    __atomic_load(p, &old, __ATOMIC_SEQ_CST);
    do {
        sum = old + v;
    } while (!__atomic_compare_exchange(p, &old, &sum, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST));
    return old;
}
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
#ifdef KERNEL_HOST_SIMT
// Whole blocks run as host threads (kernels/host/simt.h): collectives and shared memory are real.
#include "simt.h"
#else
template <typename T> inline T __shfl_xor_sync(unsigned, T v, int) { return v; }
inline void __syncthreads() {}
struct HostDim3 { unsigned x, y, z; };
static HostDim3 threadIdx = {0, 0, 0}, blockIdx = {0, 0, 0}, blockDim = {32, 1, 1};
#endif
inline float host_h2f(unsigned short h) { _Float16 v; std::memcpy(&v, &h, 2); return (float)v; }
inline unsigned short host_f2h(float f) { _Float16 v = (_Float16)f; unsigned short h; std::memcpy(&h, &v, 2); return h; }
