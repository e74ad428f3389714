// Measuring and pacing the device's memory traffic.
#include "common.cuh"

// Read `n4` float4s and keep one sum per block in `out` (so the loads cannot be dropped): the
// device-memory read bandwidth the HBM bounds divide by. Grid-stride, 256 threads a block.
extern "C" __global__ void read_sum(const float4* x, long long n4, float* out) {
    grid_dependency();
    __shared__ float red[32];
    float s = 0.0f;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n4;
         i += (long long)gridDim.x * blockDim.x) {
        float4 v = x[i];
        s += (v.x + v.y) + (v.z + v.w);
    }
    s = block_sum(s, red);
    if (threadIdx.x == 0) out[blockIdx.x] = s;
}

__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Emulating a slower host link (`--emulate`): `pace_stamp` runs on a stream just before a copy,
// `pace_wait` just after it, spinning until `ns` (the copy's bytes at the emulated rate) have
// passed since the stamp. A copy then takes max(its real time, bytes / emulated rate).
extern "C" __global__ void pace_stamp(unsigned long long* stamp) {
    grid_dependency();
    *stamp = global_ns();
}

extern "C" __global__ void pace_wait(const unsigned long long* stamp, unsigned long long ns) {
    grid_dependency();
    unsigned long long until = *stamp + ns;
    while (global_ns() < until) __nanosleep(500);
}
