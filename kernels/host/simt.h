// A block of a kernel run on the host as blockDim.x threads, so kernels whose lanes talk to each
// other (shuffles, __syncthreads, shared tiles, warp-wide tensor-core products) can be checked
// without a GPU (kernels/host/flash_check.cpp). `__shared__` variables are function statics:
// one block runs at a time, so they are that block's shared memory. Blocks of a grid run one
// after another. Built with -DKERNEL_HOST_CHECK -DKERNEL_HOST_SIMT, -std=c++20 -pthread.
#pragma once
#include <barrier>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#define __shared__ static
#define __launch_bounds__(...)

struct HostDim3 { unsigned x, y, z; };
inline thread_local HostDim3 threadIdx = {0, 0, 0};
inline HostDim3 blockIdx = {0, 0, 0}, blockDim = {1, 1, 1}, gridDim = {1, 1, 1};

// One block's synchronisation: a barrier for the block, one per warp, and per warp two
// exchange areas used alternately (a lane writes one while a slow lane may still read the
// other), so each warp collective costs one barrier.
struct HostBlock {
    std::unique_ptr<std::barrier<>> block;
    std::vector<std::unique_ptr<std::barrier<>>> warp;
    // [warp][area][lane][word]: room for an mma's operands (4 + 2 + 4 words) or a shuffled value.
    std::vector<unsigned> xch;
};
inline HostBlock host_block;
inline thread_local unsigned host_phase = 0;
constexpr int HOST_XCH_WORDS = 10;

inline unsigned* host_area(int warp, unsigned phase, int lane) {
    return &host_block.xch[(((size_t)warp * 2 + (phase & 1)) * 32 + lane) * HOST_XCH_WORDS];
}

inline void __syncthreads() { host_block.block->arrive_and_wait(); }

// Every lane of the warp publishes `words` words; after the barrier, `peer(lane)` reads them.
template <typename F>
inline void host_warp_exchange(const unsigned* mine, int words, F&& read) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned phase = host_phase++;
    std::memcpy(host_area(warp, phase, lane), mine, words * 4);
    host_block.warp[warp]->arrive_and_wait();
    read([&](int l) { return (const unsigned*)host_area(warp, phase, l); });
}

template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int o) {
    static_assert(sizeof(T) <= 8, "shuffled values are at most 8 bytes");
    unsigned w[2] = {0, 0};
    std::memcpy(w, &v, sizeof(T));
    T out = v;
    host_warp_exchange(w, 2, [&](auto peer) { std::memcpy(&out, peer((threadIdx.x & 31) ^ o), sizeof(T)); });
    return out;
}

inline float host_half(unsigned word, int hi) {
    unsigned short h = (unsigned short)(word >> (16 * hi));
    _Float16 v;
    std::memcpy(&v, &h, 2);
    return (float)v;
}

// mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32, d += a·b, from the fragment layouts the
// PTX ISA gives: lane = 4·group + t (group = lane / 4, t = lane % 4);
//   A (16×16, 4 regs of 2 halves): a0 (row g, cols 2t, 2t+1), a1 (row g+8, same cols),
//     a2 (row g, cols 2t+8, 2t+9), a3 (row g+8, cols 2t+8, 2t+9);
//   B (16×8, 2 regs): b0 (rows 2t, 2t+1, col g), b1 (rows 2t+8, 2t+9, col g);
//   C/D (16×8 f32): d0, d1 (row g, cols 2t, 2t+1), d2, d3 (row g+8, cols 2t, 2t+1).
inline void host_mma_16816(float* d, const unsigned* a, const unsigned* b) {
    unsigned mine[6];
    std::memcpy(mine, a, 16);
    std::memcpy(mine + 4, b, 8);
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    float out[4];
    host_warp_exchange(mine, 6, [&](auto peer) {
        auto A = [&](int r, int k) {
            const unsigned* p = peer((r & 7) * 4 + ((k & 7) >> 1));
            return host_half(p[(r >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)], k & 1);
        };
        auto B = [&](int k, int c) {
            const unsigned* p = peer(c * 4 + ((k & 7) >> 1));
            return host_half(p[4 + (k >= 8 ? 1 : 0)], k & 1);
        };
        for (int e = 0; e < 4; e++) {
            int r = g + (e >= 2 ? 8 : 0), c = 2 * t + (e & 1);
            float acc = d[e];
            for (int k = 0; k < 16; k++) acc += A(r, k) * B(k, c);
            out[e] = acc;
        }
    });
    std::memcpy(d, out, 16);
}

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lanes 8m .. 8m+7 give the addresses of
// matrix m's eight rows (8 halves each); register m of lane l = 4·g + t holds matrix m's row g,
// halves 2t and 2t+1 (low half first), or with .trans its transpose's: rows 2t and 2t+1 of
// column g.
inline void host_ldmatrix_x4(unsigned* r, const void* row, bool trans) {
    unsigned mine[2];
    std::memcpy(mine, &row, sizeof row);
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    unsigned out[4];
    host_warp_exchange(mine, 2, [&](auto peer) {
        for (int m = 0; m < 4; m++) {
            auto at = [&](int rr, int c) {
                const unsigned char* p;
                std::memcpy(&p, peer(8 * m + rr), sizeof p);
                unsigned short h;
                std::memcpy(&h, p + 2 * c, 2);
                return (unsigned)h;
            };
            unsigned lo = trans ? at(2 * t, g) : at(g, 2 * t), hi = trans ? at(2 * t + 1, g) : at(g, 2 * t + 1);
            out[m] = lo | (hi << 16);
        }
    });
    std::memcpy(r, out, 16);
}

// cp.async.cg.shared.global (16 bytes, zero-filled past `src_bytes`), cp.async.commit_group and
// cp.async.wait_group as late as the PTX rules let them land: a copy reaches shared memory only
// when its thread waits for its group, so a kernel that reads a tile before waiting (or before
// the barrier after every thread's wait) reads the previous tile and fails its check.
struct HostCopy {
    void* dst;
    const void* src;
    int bytes;
};
inline thread_local std::vector<HostCopy> host_copies_open;
inline thread_local std::vector<std::vector<HostCopy>> host_copy_groups;
inline void host_cp_async16(void* dst, const void* src, int src_bytes) {
    host_copies_open.push_back({dst, src, src_bytes});
}
inline void host_cp_async_commit() {
    host_copy_groups.push_back(std::move(host_copies_open));
    host_copies_open.clear();
}
inline void host_cp_async_wait(size_t pending) {
    while (host_copy_groups.size() > pending) {
        for (const HostCopy& c : host_copy_groups.front()) {
            std::memset(c.dst, 0, 16);
            std::memcpy(c.dst, c.src, (size_t)c.bytes);
        }
        host_copy_groups.erase(host_copy_groups.begin());
    }
}

// Run `kernel` over `grid` blocks of `threads` threads (a multiple of 32), block after block.
inline void host_launch(HostDim3 grid, unsigned threads, const std::function<void()>& kernel) {
    gridDim = grid;
    blockDim = {threads, 1, 1};
    int warps = (int)(threads + 31) / 32;
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) {
                blockIdx = {x, y, z};
                host_block.block = std::make_unique<std::barrier<>>(threads);
                host_block.warp.clear();
                for (int w = 0; w < warps; w++) host_block.warp.push_back(std::make_unique<std::barrier<>>(32));
                host_block.xch.assign((size_t)warps * 2 * 32 * HOST_XCH_WORDS, 0);
                std::vector<std::thread> pool;
                for (unsigned i = 0; i < threads; i++)
                    pool.emplace_back([i, &kernel] {
                        threadIdx = {i, 0, 0};
                        host_phase = 0;
                        kernel();
                        // A lane that returns stops counting, as an exited thread on the device.
                        host_block.warp[i >> 5]->arrive_and_drop();
                        host_block.block->arrive_and_drop();
                    });
                for (auto& t : pool) t.join();
            }
}
