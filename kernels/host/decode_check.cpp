// The block decoders of kernels/quant.cuh and kernels/common.cuh, compiled for the host and
// checked without a GPU (scripts/check-kernels.sh builds and runs this):
//  1. `load_elem` (the reference decode the kernels use) equals gguf-py's dequantization of the
//     committed blocks (tests/fixtures/quant/blocks.json) bit for bit;
//  2. `decode_sub` + `sub_dot` (the decode matvec's integer path) equal the reference decode
//     times the same 8-bit activation blocks, on those blocks and on random ones.
// Input on stdin (scripts/kernel_host_check.py), one line per fixture: `<dtype code> <n values> <block bytes hex> <values hex>`.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>
#include <iostream>

#include "quant.cuh"

static int failures = 0;

static std::vector<u8> unhex(const std::string& s) {
    std::vector<u8> out(s.size() / 2);
    for (size_t i = 0; i < out.size(); i++) out[i] = (u8)std::stoi(s.substr(2 * i, 2), nullptr, 16);
    return out;
}

static u32 rng_state = 12345;
static u32 next_u32() {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 17;
    rng_state ^= rng_state << 5;
    return rng_state;
}
static float uniform(float lo, float hi) { return lo + (hi - lo) * (float)(next_u32() >> 8) / 16777216.0f; }

// The host mirror of kernels/elementwise.cu quantize_q8 for one block of 32.
static ActBlock quantize_block(const float* x) {
    float amax = 0.0f;
    for (int i = 0; i < 32; i++) amax = std::fmax(amax, std::fabs(x[i]));
    float d = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
    ActBlock a{};
    int isum = 0;
    for (int i = 0; i < 32; i++) {
        int q = __float2int_rn(x[i] * id);
        isum += q;
        a.qs[i / 4] |= (int)((u32)(q & 0xff) << (8 * (i % 4)));
    }
    a.d = h2f(f2h(d));
    a.isum = isum;
    a.s = h2f(f2h(d * (float)isum));
    return a;
}

static const char* name_of(int dtype) {
    static const char* names[] = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0",
                                  "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"};
    return names[dtype];
}

// The integer path against the reference decode over a row of `n` values.
static void check_dot(int dtype, const u8* row, int n, const char* what) {
    std::vector<float> x(n);
    for (auto& v : x) v = uniform(-1.0f, 1.0f);
    double want = 0.0, scale = 0.0;
    float got = 0.0f;
    for (int b = 0; b < n / 32; b++) {
        ActBlock a = quantize_block(&x[32 * b]);
        for (int i = 0; i < 32; i++) {
            double term = (double)load_elem(row, dtype, 32 * b + i) * a.d * (double)(signed char)(a.qs[i / 4] >> (8 * (i % 4)));
            want += term;
            scale += std::fabs(term);
        }
        if (dtype == DT_Q4_1 || dtype == DT_Q5_1) {
            // These take the min times s = d·Σq rounded to f16, as llama.cpp's q8_1 does.
            const u8* blk = row + (long long)block_bytes(dtype) * b;
            want += (double)h2f(load_u16(blk + 2)) * ((double)a.s - (double)a.d * a.isum);
        }
        got += sub_dot(decode_sub(row, dtype, b), &a);
    }
    double err = std::fabs((double)got - want);
    if (!(err <= 1e-5 * scale + 1e-30)) {
        std::fprintf(stderr, "%s %s: integer path %.9g, reference decode %.9g (error %.3g of %.3g)\n", name_of(dtype),
                     what, got, want, err, scale);
        failures++;
    }
}

// A random row of `blocks` blocks: random codes, small finite f16 scales and mins.
static std::vector<u8> random_row(int dtype, int blocks) {
    int bb = block_bytes(dtype);
    std::vector<u8> row((size_t)bb * blocks);
    for (auto& v : row) v = (u8)next_u32();
    for (int b = 0; b < blocks; b++) {
        u8* blk = &row[(size_t)bb * b];
        std::vector<int> halves;
        switch (dtype) {
            case DT_Q4_1: case DT_Q5_1: case DT_Q4_K: case DT_Q5_K: halves = {0, 2}; break;
            case DT_Q2_K: halves = {80, 82}; break;
            case DT_Q3_K: halves = {108}; break;
            case DT_Q6_K: halves = {208}; break;
            default: halves = {0};
        }
        for (int off : halves) {
            u16 h = f2h(uniform(-0.05f, 0.05f));
            blk[off] = (u8)h;
            blk[off + 1] = (u8)(h >> 8);
        }
    }
    return row;
}

int main() {
    std::string line;
    int types = 0;
    while (std::getline(std::cin, line)) {
        if (line.empty()) continue;
        char bytes_hex[1 << 17], values_hex[1 << 17];
        int dtype, n;
        if (std::sscanf(line.c_str(), "%d %d %131071s %131071s", &dtype, &n, bytes_hex, values_hex) != 4) {
            std::fprintf(stderr, "decode_check: bad input line\n");
            return 2;
        }
        std::vector<u8> row = unhex(bytes_hex), bits = unhex(values_hex);
        int mismatched = 0;
        for (int j = 0; j < n; j++) {
            u32 want = ((u32)bits[4 * j] << 24) | ((u32)bits[4 * j + 1] << 16) | ((u32)bits[4 * j + 2] << 8) | bits[4 * j + 3];
            u32 got = __float_as_uint(load_elem(row.data(), dtype, j));
            if (got != want && !(std::isnan(__uint_as_float(got)) && std::isnan(__uint_as_float(want)))) {
                if (mismatched++ < 3)
                    std::fprintf(stderr, "%s value %d: load_elem %08x, gguf-py %08x\n", name_of(dtype), j, got, want);
            }
        }
        if (mismatched) failures++;
        bool finite = true;
        for (int j = 0; j < n; j++) finite = finite && std::isfinite(load_elem(row.data(), dtype, j));
        if (finite) check_dot(dtype, row.data(), n, "fixture blocks");
        std::printf("decode_check: %s: %d reference values ok\n", name_of(dtype), n);
        types++;
    }
    for (int dtype = DT_Q8_0; dtype <= DT_Q6_K; dtype++) {
        for (int trial = 0; trial < 500; trial++) {
            int blocks = dtype >= DT_Q2_K ? 1 + trial % 3 : 1 + trial % 8;
            std::vector<u8> r = random_row(dtype, blocks);
            check_dot(dtype, r.data(), blocks * (dtype >= DT_Q2_K ? 256 : 32), "random blocks");
        }
        std::printf("decode_check: %s: integer path = reference decode on 500 random rows\n", name_of(dtype));
    }
    if (failures) {
        std::fprintf(stderr, "decode_check: %d failures\n", failures);
        return 1;
    }
    if (types == 0) {
        std::fprintf(stderr, "decode_check: no input\n");
        return 2;
    }
    return 0;
}
