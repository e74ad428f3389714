// The bundle kernels (kernels/bundles.cu), each block run as host threads (kernels/host/simt.h),
// against the same sums in double over `Part::at` (which kernels/host/bundle_check.cpp holds to
// the store's dequantizers): ffn_bundles_up's hidden values and ffn_bundles_down's output, in
// the float encodings eight elements a lane (vector_parts) and one (a bundle address not
// 16-byte aligned, d not a multiple of 8, INT8), gated and not, one token and three, over all
// neurons and over a list mixing slots and rows resting in host memory (IN_REST). The orders
// of the sums differ, so each value is held to the reference within 1e-5 of the sum of its
// terms' magnitudes. scripts/check-kernels.sh builds and runs this.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "bundles.cu"

static std::mt19937 rng(37);

static float uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(rng); }

// `count` bundles of `parts` parts of d values in encoding `enc`, from random values.
static std::vector<u8> make_bundles(int enc, int parts, int d, int count, long long row_bytes) {
    std::vector<u8> out((size_t)row_bytes * count);
    for (int r = 0; r < count; r++) {
        u8* row = out.data() + (size_t)row_bytes * r;
        for (int p = 0; p < parts; p++)
            for (int j = 0; j < d; j++) {
                float v = uniform(-1.0f, 1.0f);
                if (enc == BE_F32) std::memcpy(row + ((size_t)p * d + j) * 4, &v, 4);
                if (enc == BE_F16) {
                    u16 h = f2h(v);
                    std::memcpy(row + ((size_t)p * d + j) * 2, &h, 2);
                }
                if (enc == BE_BF16) {
                    u16 h = (u16)(__float_as_uint(v) >> 16);
                    std::memcpy(row + ((size_t)p * d + j) * 2, &h, 2);
                }
                if (enc == BE_INT8) {
                    if (j == 0) {
                        float s = uniform(0.001f, 0.02f);
                        std::memcpy(row + p * 4, &s, 4);
                    }
                    row[parts * 4 + (size_t)p * d + j] = (u8)(int8_t)std::uniform_int_distribution<int>(-127, 127)(rng);
                }
            }
    }
    return out;
}

template <int E>
static bool check(int parts, int d, int n, bool listed, int misalign) {
    const int count = 41, neurons = listed ? 29 : count, rest_count = 23;
    long long row_bytes = E == BE_F32 ? 4LL * parts * d : E == BE_INT8 ? (long long)parts * (4 + d) : 2LL * parts * d;
    // Buffers 16-byte aligned, then shifted by `misalign` bytes (the kernels must then read one
    // element a lane).
    auto b_store = make_bundles(E, parts, d, count, row_bytes);
    auto r_store = make_bundles(E, parts, d, rest_count, row_bytes);
    std::vector<u8> b_buf(b_store.size() + 32), r_buf(r_store.size() + 32);
    u8* b = (u8*)(((uintptr_t)b_buf.data() + 15) & ~(uintptr_t)15) + misalign;
    u8* rest = (u8*)(((uintptr_t)r_buf.data() + 15) & ~(uintptr_t)15) + misalign;
    std::memcpy(b, b_store.data(), b_store.size());
    std::memcpy(rest, r_store.data(), r_store.size());
    std::vector<unsigned> idx;
    for (int i = 0; i < neurons; i++)
        idx.push_back(i % 3 == 1 ? IN_REST | (unsigned)((i * 7) % rest_count) : (unsigned)((i * 5) % count));
    std::vector<float> x((size_t)n * d), bias(count + 8);
    for (auto& v : x) v = uniform(-1.0f, 1.0f);
    for (auto& v : bias) v = uniform(-0.5f, 0.5f);
    int kind = parts == 3 ? ACT_SILU : ACT_RELU, col0 = 3, stride = neurons + 5;
    const unsigned* list = listed ? idx.data() : nullptr;
    const u8* r_arg = listed ? rest : nullptr;
    const float* up_bias = parts == 2 && !listed ? bias.data() : nullptr;
    auto bundle = [&](int i) { return listed_bundle(b, r_arg, row_bytes, list, i); };

    std::vector<float> h((size_t)n * stride, -7.0f), out((size_t)n * d, 0.0f);
    host_launch({(unsigned)((neurons + WARPS - 1) / WARPS), 1, 1}, WARPS * 32, [&] {
        bundles_up<E>(b, r_arg, row_bytes, neurons, parts, d, x.data(), n, kind, 0.0f, up_bias, h.data(), stride, col0,
                      list);
    });
    host_launch({(unsigned)((d + DOWN_TILE - 1) / DOWN_TILE), (unsigned)((neurons + DOWN_NEURONS - 1) / DOWN_NEURONS), 1},
                DOWN_TILE, [&] {
                    bundles_down<E>(b, r_arg, row_bytes, neurons, parts, d, h.data(), n, stride, col0, out.data(),
                                    list);
                });

    bool ok = true;
    double worst = 0.0;
    auto hold = [&](double got, double want, double mag) {
        double e = std::fabs(got - want) / (mag + 1e-30);
        worst = std::max(worst, e);
        if (!(e <= 1e-5)) ok = false;
    };
    for (int t = 0; t < n; t++) {
        const float* xt = x.data() + (size_t)t * d;
        for (int i = 0; i < neurons; i++) {
            auto dot = [&](int p, double& mag) {
                Part<E> part(bundle(i), parts, d, p);
                double s = 0.0;
                mag = 0.0;
                for (int j = 0; j < d; j++) {
                    s += (double)part.at(j) * xt[j];
                    mag += std::fabs((double)part.at(j) * xt[j]);
                }
                return s;
            };
            double gm, um = 0.0;
            double g = dot(0, gm);
            int row = listed ? (int)(idx[i] & ~IN_REST) : i;
            double want = parts == 3 ? (double)act((float)g, kind) * dot(1, um)
                                     : (double)act((float)(g + (up_bias ? up_bias[col0 + row] : 0.0f)), kind);
            double mag = parts == 3 ? std::fabs((double)act((float)g, kind)) * um + gm : gm + 1.0;
            hold(h[(size_t)t * stride + col0 + i], want, mag);
        }
        for (int c = 0; c < d; c++) {
            double s = 0.0, mag = 0.0;
            for (int i = 0; i < neurons; i++) {
                double v = (double)h[(size_t)t * stride + col0 + i] * Part<E>(bundle(i), parts, d, parts - 1).at(c);
                s += v;
                mag += std::fabs(v);
            }
            hold(out[(size_t)t * d + c], s, mag);
        }
    }
    static const char* names[] = {"f32", "f16", "bf16", "int8", "int4"};
    std::printf("bundles-check: %s, %d parts of %d, %d tokens, %s, %s: %s (worst %.1e)\n", names[E], parts, d, n,
                listed ? "listed with a rest" : "every neuron",
                vector_parts<E>(d, b, r_arg) ? "eight a lane" : "one a lane", ok ? "ok" : "FAILED", worst);
    return ok;
}

int main() {
    bool ok = true;
    for (int parts : {3, 2})
        for (int d : {512, 200, 100})
            for (int n : {1, 3})
                for (bool listed : {false, true}) {
                    ok &= check<BE_F16>(parts, d, n, listed, 0);
                    ok &= check<BE_BF16>(parts, d, n, listed, 0);
                    ok &= check<BE_F32>(parts, d, n, listed, 0);
                    ok &= check<BE_INT8>(parts, d, n, listed, 0);
                }
    // Not 16-byte aligned: one element a lane.
    ok &= check<BE_F16>(3, 512, 3, true, 2);
    ok &= check<BE_F32>(2, 512, 1, false, 4);
    if (!ok) {
        std::printf("bundles-check: FAILED\n");
        return 1;
    }
    std::printf("bundles-check: every case within 1e-5\n");
    return 0;
}
