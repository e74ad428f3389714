// The data-movement kernels no other check covers, run on the host, each block as threads
// (kernels/host/simt.h), against plain loops over the same decoding (`load_elem`, which
// kernels/host/decode_check.cpp holds to gguf-py's), bit for bit:
//  - dequant_f16: a tile of a block-format weight decoded to f16 for cuBLAS (every block format,
//    tiles starting past row 0, a last block of threads cut short);
//  - embed_rows: token ids' rows of an embedding table, in its format;
//  - add_table_rows: learned positions added from row first_row on;
//  - scatter_rows: a cache unit's rows copied into their slots, by words and by bytes;
//  - gated_to_f16: gated_f32 then f32_to_f16 in one launch (every activation, masked or not),
//    the gate products left as they were;
//  - rms_norm_f16 and add_rms_norm_f16: rms_norm (add_rms_norm) then f32_to_f16 in one launch,
//    the residual added as add_rms_norm adds it.
// The weights are random bytes: what is checked is which bytes land where, and that each value is
// decoded as the reference decodes it. scripts/check-kernels.sh builds and runs this.
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "matvec.cu"
#include "elementwise.cu"
#include "norm.cu"

static std::mt19937 rng(31);

static std::vector<u8> random_bytes(size_t n) {
    std::uniform_int_distribution<int> byte(0, 255);
    std::vector<u8> v(n);
    for (auto& b : v) b = (u8)byte(rng);
    return v;
}

static bool same(const char* what, const void* a, const void* b, size_t bytes) {
    bool eq = std::memcmp(a, b, bytes) == 0;
    std::printf("ops-check: %s: %s\n", what, eq ? "bit-identical" : "DIFFERENT  FAILED");
    return eq;
}

static unsigned grid_for(long long n, int per) { return (unsigned)((n + per - 1) / per); }

// Rows row0..row0+tile_rows of a `rows` × `cols` weight in `dtype`, decoded to f16.
static bool dequant(int dtype, int rows, int cols, int row0, int tile_rows) {
    long long rb = row_bytes(dtype, cols);
    auto w = random_bytes((size_t)rb * rows);
    std::vector<u16> got((size_t)tile_rows * cols, 0xdead), want(got.size());
    host_launch({grid_for((long long)tile_rows * cols / 8, 256), 1, 1}, 256,
                [&] { dequant_f16(w.data(), dtype, row0, tile_rows, cols, got.data()); });
    for (int r = 0; r < tile_rows; r++)
        for (int c = 0; c < cols; c++)
            want[(size_t)r * cols + c] = f2h(load_elem(w.data() + rb * (row0 + r), dtype, c));
    char what[96];
    std::snprintf(what, sizeof what, "dequant_f16 dtype %d, rows %d..%d of %d × %d", dtype, row0, row0 + tile_rows,
                  rows, cols);
    return same(what, got.data(), want.data(), got.size() * 2);
}

// Rows of a `vocab` × `cols` table in `dtype`: by token id, and added from row `first_row` on.
static bool table_rows(int dtype, int vocab, int cols, int first_row) {
    long long rb = row_bytes(dtype, cols);
    auto table = random_bytes((size_t)rb * vocab);
    std::vector<int> ids = {vocab - 1, 0, 7 % vocab, 3 % vocab, vocab - 1};
    int n = (int)ids.size();
    std::vector<float> got((size_t)n * cols, NAN), want(got.size());
    host_launch({(unsigned)n, 1, 1}, 256, [&] { embed_rows(table.data(), dtype, cols, ids.data(), got.data()); });
    for (int t = 0; t < n; t++)
        for (int c = 0; c < cols; c++) want[(size_t)t * cols + c] = load_elem(table.data() + rb * ids[t], dtype, c);
    char what[96];
    std::snprintf(what, sizeof what, "embed_rows dtype %d, %d tokens of %d", dtype, n, cols);
    bool ok = same(what, got.data(), want.data(), got.size() * 4);

    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<float> x((size_t)n * cols);
    for (auto& v : x) v = u(rng);
    std::vector<float> added = x;
    host_launch({(unsigned)n, 1, 1}, 256, [&] { add_table_rows(added.data(), table.data(), dtype, cols, first_row); });
    for (int t = 0; t < n; t++)
        for (int c = 0; c < cols; c++)
            x[(size_t)t * cols + c] += load_elem(table.data() + rb * (first_row + t), dtype, c);
    std::snprintf(what, sizeof what, "add_table_rows dtype %d, %d tokens from row %d", dtype, n, first_row);
    return same(what, added.data(), x.data(), x.size() * 4) && ok;
}

// `n` rows of `row_bytes` bytes into slots `rows` of a pool of `slots` rows.
static bool scatter(long long rb, int n, int slots) {
    auto src = random_bytes((size_t)rb * n);
    auto pool = random_bytes((size_t)rb * slots);
    std::vector<unsigned> rows;
    for (int i = 0; i < n; i++) rows.push_back((unsigned)((i * 7 + 3) % slots));
    auto want = pool;
    for (int i = 0; i < n; i++) std::memcpy(&want[rows[i] * rb], &src[i * rb], rb);
    host_launch({(unsigned)n, 1, 1}, 256, [&] { scatter_rows(src.data(), rb, rows.data(), pool.data()); });
    char what[96];
    std::snprintf(what, sizeof what, "scatter_rows %d rows of %lld bytes into %d slots", n, rb, slots);
    return same(what, pool.data(), want.data(), pool.size());
}

// gated_to_f16 against gated_f32 then f32_to_f16, over `n` random products.
static bool gated_half(int kind, float threshold, long long n) {
    std::uniform_real_distribution<float> val(-6.0f, 6.0f);
    std::vector<float> g(n), u(n);
    for (auto& v : g) v = val(rng);
    for (auto& v : u) v = val(rng);
    std::vector<float> g1 = g, g2 = g;
    std::vector<u16> want(n), got(n, 0xdead);
    const unsigned blocks = grid_for(n, 256);
    host_launch({blocks, 1, 1}, 256, [&] { gated_f32(g1.data(), u.data(), n, kind, threshold); });
    host_launch({blocks, 1, 1}, 256, [&] { f32_to_f16(g1.data(), want.data(), n); });
    host_launch({blocks, 1, 1}, 256, [&] { gated_to_f16(g2.data(), u.data(), got.data(), n, kind, threshold); });
    char what[96];
    std::snprintf(what, sizeof what, "gated_to_f16 act %d threshold %g, %lld values", kind, threshold, n);
    return same(what, got.data(), want.data(), (size_t)n * 2) &&
           same("gated_to_f16 leaves the gate products", g2.data(), g.data(), (size_t)n * 4);
}

// rms_norm_f16 / add_rms_norm_f16 against rms_norm / add_rms_norm then f32_to_f16, `rows` of
// `cols` (more values than threads, and not a multiple of them).
static bool norm_half(int rows, int cols) {
    std::uniform_real_distribution<float> val(-3.0f, 3.0f);
    const long long n = (long long)rows * cols;
    std::vector<float> x(n), y(n), w(cols);
    for (auto* v : {&x, &y, &w})
        for (auto& e : *v) e = val(rng);
    const float eps = 1e-5f;
    std::vector<float> normed(n), x1 = x, x2 = x;
    std::vector<u16> want(n), got(n, 0xdead), want_add(n), got_add(n, 0xdead);
    host_launch({(unsigned)rows, 1, 1}, 256, [&] { rms_norm(x.data(), w.data(), eps, normed.data(), cols); });
    host_launch({grid_for(n, 256), 1, 1}, 256, [&] { f32_to_f16(normed.data(), want.data(), n); });
    host_launch({(unsigned)rows, 1, 1}, 256, [&] { rms_norm_f16(x.data(), w.data(), eps, got.data(), cols); });
    host_launch({(unsigned)rows, 1, 1}, 256,
                [&] { add_rms_norm(x1.data(), y.data(), w.data(), eps, normed.data(), cols); });
    host_launch({grid_for(n, 256), 1, 1}, 256, [&] { f32_to_f16(normed.data(), want_add.data(), n); });
    host_launch({(unsigned)rows, 1, 1}, 256,
                [&] { add_rms_norm_f16(x2.data(), y.data(), w.data(), eps, got_add.data(), cols); });
    char what[96];
    std::snprintf(what, sizeof what, "rms_norm_f16 %d rows of %d", rows, cols);
    bool ok = same(what, got.data(), want.data(), (size_t)n * 2);
    std::snprintf(what, sizeof what, "add_rms_norm_f16 %d rows of %d (normed)", rows, cols);
    ok &= same(what, got_add.data(), want_add.data(), (size_t)n * 2);
    std::snprintf(what, sizeof what, "add_rms_norm_f16 %d rows of %d (residual)", rows, cols);
    return ok && same(what, x2.data(), x1.data(), (size_t)n * 4);
}

int main() {
    bool ok = true;
    // Each block format; a tile from row 0 and one from further in, 8 values a thread, the last
    // block of threads partly past the tile.
    for (int dtype : {DT_Q8_0, DT_Q4_0, DT_Q4_1, DT_Q5_0, DT_Q5_1}) {
        ok &= dequant(dtype, 9, 576, 0, 9);
        ok &= dequant(dtype, 40, 96, 13, 27);
    }
    for (int dtype : {DT_Q2_K, DT_Q3_K, DT_Q4_K, DT_Q5_K, DT_Q6_K}) {
        ok &= dequant(dtype, 6, 512, 0, 6);
        ok &= dequant(dtype, 20, 256, 7, 11);
    }
    for (int dtype : {DT_F32, DT_F16, DT_BF16, DT_Q8_0, DT_Q4_1, DT_Q6_K}) ok &= table_rows(dtype, 11, 768, 4);
    ok &= table_rows(DT_F16, 9, 300, 2);  // more values than threads, not a multiple of them
    ok &= scatter(1152, 5, 12);            // whole words
    ok &= scatter(1154, 5, 12);            // bytes
    ok &= scatter(36, 12, 12);             // every slot
    for (int kind : {ACT_SILU, ACT_RELU, ACT_GELU, ACT_GELU_TANH}) ok &= gated_half(kind, 0.0f, 1000);
    ok &= gated_half(ACT_SILU, 0.5f, 777);  // masked, a last block cut short
    ok &= norm_half(5, 576);
    ok &= norm_half(3, 4096);
    if (!ok) return 1;
    std::printf("ops-check: dequant_f16, embed_rows, add_table_rows, scatter_rows, gated_to_f16 and the f16 norms "
                "equal the reference\n");
    return 0;
}
