// The bundle decoders of kernels/bundle_codes.cuh, compiled for the host and checked without a
// GPU (scripts/check-kernels.sh builds and runs this): `Part<E>::at` gives, bit for bit, the
// values the store's dequantizers (src/store/quant.rs, tensor::decode_row) decode from bundles
// the store's encoder wrote.
// Input on stdin (written by the crate's test `bundle_decode_fixture`), one line per layer:
// `<encoding> <parts> <d> <neurons> <bundle bytes hex> <decoded f32 bits hex, bundle by bundle, part by part>`.
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "bundle_codes.cuh"

static std::vector<u8> unhex(const std::string& s) {
    std::vector<u8> out(s.size() / 2);
    for (size_t i = 0; i < out.size(); i++) out[i] = (u8)std::stoi(s.substr(2 * i, 2), nullptr, 16);
    return out;
}

template <int E>
static float decode(const u8* row, int parts, int d, int p, int j) {
    return Part<E>(row, parts, d, p).at(j);
}

static float decode_any(int enc, const u8* row, int parts, int d, int p, int j) {
    switch (enc) {
        case BE_F32: return decode<BE_F32>(row, parts, d, p, j);
        case BE_F16: return decode<BE_F16>(row, parts, d, p, j);
        case BE_BF16: return decode<BE_BF16>(row, parts, d, p, j);
        case BE_INT8: return decode<BE_INT8>(row, parts, d, p, j);
        default: return decode<BE_INT4>(row, parts, d, p, j);
    }
}

int main() {
    static const char* names[] = {"f32", "f16", "bf16", "int8", "int4"};
    std::string line;
    int layers = 0, failures = 0;
    while (std::getline(std::cin, line)) {
        if (line.empty()) continue;
        int enc, parts, d, neurons;
        char bytes_hex[1 << 18], values_hex[1 << 19];
        if (std::sscanf(line.c_str(), "%d %d %d %d %262143s %524287s", &enc, &parts, &d, &neurons, bytes_hex,
                        values_hex) != 6 ||
            enc < 0 || enc > BE_INT4) {
            std::fprintf(stderr, "bundle_check: bad input line\n");
            return 2;
        }
        std::vector<u8> bytes = unhex(bytes_hex), bits = unhex(values_hex);
        size_t row_bytes = bytes.size() / neurons;
        int mismatched = 0;
        for (int i = 0; i < neurons; i++) {
            for (int p = 0; p < parts; p++) {
                for (int j = 0; j < d; j++) {
                    size_t k = 4 * (((size_t)i * parts + p) * d + j);
                    u32 want = (u32)bits[k] | ((u32)bits[k + 1] << 8) | ((u32)bits[k + 2] << 16) |
                               ((u32)bits[k + 3] << 24);
                    u32 got = __float_as_uint(decode_any(enc, &bytes[row_bytes * i], parts, d, p, j));
                    if (got != want && mismatched++ < 3)
                        std::fprintf(stderr, "%s %d parts: bundle %d part %d value %d: kernel %08x, store %08x\n",
                                     names[enc], parts, i, p, j, got, want);
                }
            }
        }
        if (mismatched) failures++;
        std::printf("bundle_check: %s, %d parts of %d: %d bundles decode as the store's dequantizers\n", names[enc],
                    parts, d, neurons);
        layers++;
    }
    if (failures) {
        std::fprintf(stderr, "bundle_check: %d layers differ\n", failures);
        return 1;
    }
    if (layers == 0) {
        std::fprintf(stderr, "bundle_check: no input\n");
        return 2;
    }
    return 0;
}
