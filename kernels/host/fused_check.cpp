// The fused decode kernels run on the host, each block as threads (kernels/host/simt.h), against
// the kernels they stand in for, bit for bit (a fused launch must change how many launches a step
// takes, never its numbers):
//  - matvec_quant_parts / matvec_f16_parts: several weights times one activation (q, k, v; gate
//    and up; blocks of one matrix at their column offsets), mixed block formats in one launch,
//    against matvec_quant / matvec_f16_vec per weight; matvec_quant_x / matvec_quant_parts_x
//    (one token quantized in each block, no quantize launch) against quantize_q8 + matvec_quant;
//  - rope_pair against rope of q and of k; store_kv_pair against store_kv of k and of v (every
//    cache type, paged and not, position in device memory or not);
//  - matvec_f16_gate_up / matvec_quant_gate_up(_x): a gated FFN's hidden activations, a row of
//    the gate and of up in one warp, against a matvec per weight then gated_f32;
//  - add_rms_norm against add_f32 then rms_norm;
//  - the norm inside one token's block-format products (matvec_quant_parts_norm,
//    matvec_quant_gate_up_norm) against add_rms_norm then the in-block kernels, residual too;
//    add_rms_norm_q8 / rms_norm_q8 against the norm then quantize_q8.
// scripts/check-kernels.sh builds and runs this.
#include <cstdio>
#include <cstring>
#include <algorithm>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "matvec.cu"
#include "elementwise.cu"
#include "rope.cu"
#include "attention.cu"
#include "norm.cu"

static std::mt19937 rng(29);

static std::vector<float> uniform(size_t n, float lo = -1.0f, float hi = 1.0f) {
    std::uniform_real_distribution<float> u(lo, hi);
    std::vector<float> v(n);
    for (auto& x : v) x = u(rng);
    return v;
}

static bool same(const char* what, const void* a, const void* b, size_t bytes) {
    bool eq = std::memcmp(a, b, bytes) == 0;
    std::printf("fused-check: %s: %s\n", what, eq ? "bit-identical" : "DIFFERENT  FAILED");
    return eq;
}

static void put_half(u8* p, float v) {
    u16 h = f2h(v);
    std::memcpy(p, &h, 2);
}

// `rows` rows of `cols` random weights in `dtype` (F16, Q8_0 or Q4_1), with sane block scales.
static std::vector<u8> weights(int dtype, int rows, int cols) {
    std::vector<u8> w((size_t)row_bytes(dtype, cols) * rows);
    std::uniform_int_distribution<int> byte(0, 255);
    if (dtype == DT_F16) {
        auto v = uniform((size_t)rows * cols);
        for (size_t i = 0; i < v.size(); i++) put_half(&w[2 * i], v[i]);
        return w;
    }
    int block = dtype == DT_Q8_0 ? 34 : 20;
    for (size_t b = 0; b < w.size() / block; b++) {
        u8* p = &w[b * block];
        for (int i = 0; i < block; i++) p[i] = (u8)byte(rng);
        put_half(p, uniform(1, 0.001f, 0.02f)[0]);
        if (dtype == DT_Q4_1) put_half(p + 2, uniform(1, -0.1f, 0.1f)[0]);
    }
    return w;
}

struct Weight {
    int dtype, rows;
    std::vector<u8> data;
};

// Weights times n tokens of x (cols wide): each weight into its own output at column 0, or (joined)
// all into one output, each at its offset; once by the per-weight kernels, once in one launch.
static bool parts(const std::vector<int>& dtypes, const std::vector<int>& rows, int cols, int n, bool joined) {
    std::vector<Weight> ws;
    for (size_t i = 0; i < dtypes.size(); i++) ws.push_back({dtypes[i], rows[i], weights(dtypes[i], rows[i], cols)});
    auto x = uniform((size_t)n * cols);
    int total = 0;
    for (auto& w : ws) total += w.rows;
    auto shape = [&](size_t i, int* stride, int* col0) {
        int off = 0;
        for (size_t j = 0; j < i; j++) off += ws[j].rows;
        *stride = joined ? total : ws[i].rows;
        *col0 = joined ? off : 0;
    };
    bool quant = dtypes[0] != DT_F16;
    std::vector<ActBlock> xq((size_t)n * cols / 32);
    if (quant) {
        long long blocks = (long long)xq.size();
        host_launch({(unsigned)((blocks * 32 + 255) / 256), 1, 1}, 256,
                    [&] { quantize_q8(x.data(), blocks, xq.data()); });
    }
    auto outputs = [&] {
        std::vector<std::vector<float>> o;
        if (joined) o.push_back(std::vector<float>((size_t)n * total, NAN));
        else
            for (auto& w : ws) o.push_back(std::vector<float>((size_t)n * w.rows, NAN));
        return o;
    };
    auto one = outputs();
    for (size_t i = 0; i < ws.size(); i++) {
        int stride, col0;
        shape(i, &stride, &col0);
        float* out = one[joined ? 0 : i].data();
        unsigned grid = (unsigned)((ws[i].rows + WARPS - 1) / WARPS);
        host_launch({grid, 1, 1}, WARPS * 32, [&] {
            if (quant)
                matvec_quant(ws[i].data.data(), ws[i].dtype, ws[i].rows, cols, xq.data(), n, out, stride, col0);
            else
                matvec_f16_vec(ws[i].data.data(), DT_F16, ws[i].rows, cols, x.data(), n, out, stride, col0);
        });
    }
    // Every value written (no NaN left), and each the per-weight kernel's.
    auto agree = [&](const std::vector<std::vector<float>>& got) {
        bool same = true;
        for (size_t i = 0; i < one.size(); i++) {
            for (float v : got[i]) same &= v == v;
            same &= std::memcmp(one[i].data(), got[i].data(), one[i].size() * 4) == 0;
        }
        return same;
    };
    // One launch for all (`in_blocks`: one token's activations quantized in each block).
    auto launch_parts = [&](bool in_blocks) {
        auto fused = outputs();
        MatvecParts ps{};
        unsigned grid = 0;
        for (size_t i = 0; i < ws.size(); i++) {
            int stride, col0;
            shape(i, &stride, &col0);
            ps.part[i] = {ws[i].data.data(), fused[joined ? 0 : i].data(), ws[i].dtype, ws[i].rows, stride, col0};
            grid += (unsigned)((ws[i].rows + WARPS - 1) / WARPS);
        }
        ps.count = (int)ws.size();
        host_launch({grid, 1, 1}, WARPS * 32, [&] {
            if (in_blocks)
                matvec_quant_parts_x(ps, cols, x.data(), n);
            else if (quant)
                matvec_quant_parts(ps, cols, xq.data(), n);
            else
                matvec_f16_parts(ps, cols, x.data(), n);
        });
        return fused;
    };
    bool ok = agree(launch_parts(false));
    if (quant && n == 1 && cols <= QX_MAX_COLS) {
        // No quantize launch: each block quantizes the token itself, alone and in parts.
        ok &= agree(launch_parts(true));
        auto alone = outputs();
        for (size_t i = 0; i < ws.size(); i++) {
            int stride, col0;
            shape(i, &stride, &col0);
            float* out = alone[joined ? 0 : i].data();
            unsigned grid = (unsigned)((ws[i].rows + WARPS - 1) / WARPS);
            host_launch({grid, 1, 1}, WARPS * 32, [&] {
                matvec_quant_x(ws[i].data.data(), ws[i].dtype, ws[i].rows, cols, x.data(), 1, out, stride, col0);
            });
        }
        ok &= agree(alone);
    }
    char what[160];
    int at = std::snprintf(what, sizeof what, "%s parts, %d tokens,%s rows", quant ? "block" : "f16", n,
                           joined ? " joined" : "");
    for (size_t i = 0; i < ws.size(); i++)
        at += std::snprintf(what + at, sizeof what - at, " %d (dtype %d)", ws[i].rows, ws[i].dtype);
    std::printf("fused-check: matvec %s: %s\n", what, ok ? "bit-identical" : "DIFFERENT  FAILED");
    return ok;
}

// One token of f16 rows (four loads in flight per lane) against the first of two (one at a time):
// the same bits; and both within f32 rounding of the product in double. `cols` past a whole
// number of rounds leaves some lanes' last loads out.
static bool f16_one_token(int rows, int cols) {
    auto w = weights(DT_F16, rows, cols);
    auto x = uniform((size_t)cols);
    std::vector<float> x2 = x;
    x2.insert(x2.end(), x.begin(), x.end());
    std::vector<float> one((size_t)rows, NAN), two((size_t)2 * rows, NAN);
    unsigned grid = (unsigned)((rows + WARPS - 1) / WARPS);
    auto run = [&](const std::vector<float>& xs, int n, std::vector<float>& out) {
        host_launch({grid, 1, 1}, WARPS * 32,
                    [&] { matvec_f16_vec(w.data(), DT_F16, rows, cols, xs.data(), n, out.data(), rows, 0); });
    };
    run(x, 1, one);
    run(x2, 2, two);
    double err = 0.0, scale = 0.0;
    for (int r = 0; r < rows; r++) {
        double want = 0.0;
        for (int c = 0; c < cols; c++) want += (double)h2f(((const u16*)w.data())[(size_t)r * cols + c]) * x[c];
        err = std::fmax(err, std::fabs(one[r] - want));
        scale = std::fmax(scale, std::fabs(want));
    }
    bool close = err <= 1e-5 * std::fmax(scale, 1.0);
    bool ok = std::memcmp(one.data(), two.data(), rows * 4) == 0 && std::memcmp(two.data(), two.data() + rows, rows * 4) == 0;
    std::printf("fused-check: f16 matvec of one token vs two, %d rows of %d: %s, %.1e from the double product%s\n", rows,
                cols, ok ? "bit-identical" : "DIFFERENT", err / std::fmax(scale, 1.0), ok && close ? "" : "  FAILED");
    return ok && close;
}

static bool rope_pairs(int rows, int heads, int kv_heads, int hd, int rot, int pairs, bool at) {
    auto inv = uniform((size_t)rot / 2, 0.001f, 1.0f);
    auto q = uniform((size_t)rows * heads * hd), k = uniform((size_t)rows * kv_heads * hd);
    auto q1 = q, k1 = k;
    int pos = 37;
    const int* pos_at = at ? &pos : nullptr;
    int first = at ? 5 : pos;
    auto rope_one = [&](std::vector<float>& x, int cols) {
        long long total = (long long)rows * (cols / hd) * (rot / 2);
        host_launch({(unsigned)((total + 255) / 256), 1, 1}, 256,
                    [&] { rope(x.data(), rows, cols, hd, rot, pairs, inv.data(), first, pos_at); });
    };
    rope_one(q1, heads * hd);
    rope_one(k1, kv_heads * hd);
    long long total = (long long)rows * heads * (rot / 2);
    host_launch({(unsigned)((total + 255) / 256), 2, 1}, 256, [&] {
        rope_pair(q.data(), heads * hd, k.data(), kv_heads * hd, rows, hd, rot, pairs, inv.data(), first, pos_at);
    });
    char what[120];
    std::snprintf(what, sizeof what, "rope_pair %d rows, %d/%d heads of %d (%d rotated, pairs %d)%s", rows, heads,
                  kv_heads, hd, rot, pairs, at ? ", position in memory" : "");
    bool ok = same((std::string(what) + ", q").c_str(), q.data(), q1.data(), q.size() * 4);
    return same((std::string(what) + ", k").c_str(), k.data(), k1.data(), k.size() * 4) && ok;
}

static bool store_pairs(int dt, int rows, int cols, bool page, bool at) {
    int ctx = 48;
    long long rb = row_bytes(dt, cols);
    // Paged: the sequence's block i at pool block 2·(blocks - i) - 1.
    int blocks = (ctx + KV_BLOCK - 1) / KV_BLOCK;
    std::vector<unsigned> table;
    for (int i = 0; i < blocks; i++) table.push_back((unsigned)(2 * (blocks - i) - 1));
    size_t bytes = (size_t)(page ? 2 * blocks * KV_BLOCK : ctx) * rb;
    auto k = uniform((size_t)rows * cols), v = uniform((size_t)rows * cols);
    std::vector<u8> kc(bytes, 0xab), vc(bytes, 0xcd);
    auto kc1 = kc, vc1 = vc;
    const unsigned* t = page ? table.data() : nullptr;
    int pos = 21;
    const int* pos_at = at ? &pos : nullptr;
    int first = at ? 3 : pos;
    long long n = (long long)rows * cols;
    unsigned grid = (unsigned)((n + 255) / 256);
    host_launch({grid, 1, 1}, 256, [&] { store_kv(k.data(), rows, cols, dt, kc1.data(), t, first, pos_at); });
    host_launch({grid, 1, 1}, 256, [&] { store_kv(v.data(), rows, cols, dt, vc1.data(), t, first, pos_at); });
    host_launch({grid, 2, 1}, 256, [&] {
        store_kv_pair(k.data(), v.data(), rows, cols, dt, kc.data(), vc.data(), t, first, pos_at);
    });
    char what[120];
    std::snprintf(what, sizeof what, "store_kv_pair dtype %d, %d rows of %d%s%s", dt, rows, cols,
                  page ? ", paged" : "", at ? ", position in memory" : "");
    bool ok = same((std::string(what) + ", k").c_str(), kc.data(), kc1.data(), bytes);
    return same((std::string(what) + ", v").c_str(), vc.data(), vc1.data(), bytes) && ok;
}

// A gated FFN's hidden activations in one launch (matvec_*_gate_up: a row of the gate and of up
// in one warp) against a matvec per weight, then gated_f32; `dg`, `du` the weights' formats, both
// F16 or both block formats; block formats of one token take their activations quantized in
// each block (`in_blocks`) or by a quantize launch, as the per-weight kernels do.
static bool gate_up(int dg, int du, int rows, int cols, int n, int kind, float threshold, bool in_blocks) {
    auto wg = weights(dg, rows, cols), wu = weights(du, rows, cols);
    auto x = uniform((size_t)n * cols, -2.0f, 2.0f);
    bool quant = dg != DT_F16;
    std::vector<ActBlock> xq((size_t)n * cols / 32);
    long long blocks = (long long)xq.size();
    if (quant)
        host_launch({(unsigned)((blocks * 32 + 255) / 256), 1, 1}, 256,
                    [&] { quantize_q8(x.data(), blocks, xq.data()); });
    std::vector<float> g((size_t)n * rows, NAN), u((size_t)n * rows, NAN), got((size_t)n * rows, NAN);
    unsigned grid = (unsigned)((rows + WARPS - 1) / WARPS);
    for (auto [w, dt, out] : {std::tuple{&wg, dg, &g}, std::tuple{&wu, du, &u}}) {
        host_launch({grid, 1, 1}, WARPS * 32, [&] {
            if (quant)
                matvec_quant(w->data(), dt, rows, cols, xq.data(), n, out->data(), rows, 0);
            else
                matvec_f16_vec(w->data(), dt, rows, cols, x.data(), n, out->data(), rows, 0);
        });
    }
    long long len = (long long)n * rows;
    host_launch({(unsigned)((len + 255) / 256), 1, 1}, 256,
                [&] { gated_f32(g.data(), u.data(), len, kind, threshold); });
    host_launch({grid, 1, 1}, WARPS * 32, [&] {
        if (!quant)
            matvec_f16_gate_up(wg.data(), dg, wu.data(), du, rows, cols, x.data(), n, kind, threshold, got.data(),
                               rows);
        else if (in_blocks)
            matvec_quant_gate_up_x(wg.data(), dg, wu.data(), du, rows, cols, x.data(), n, kind, threshold,
                                   got.data(), rows);
        else
            matvec_quant_gate_up(wg.data(), dg, wu.data(), du, rows, cols, xq.data(), n, kind, threshold, got.data(),
                                 rows);
    });
    char what[160];
    std::snprintf(what, sizeof what, "gate and up, dtypes %d/%d, %d rows of %d, %d tokens%s, act %d, threshold %g", dg,
                  du, rows, cols, n, in_blocks ? " quantized in blocks" : "", kind, threshold);
    bool ok = same(what, got.data(), g.data(), g.size() * 4);
    for (float v : got) ok &= v == v;
    return ok;
}

// A step's rope and KV store in one launch against rope_pair then store_kv_pair: q, k (rotated in
// place) and both caches, bit for bit.
static bool rope_stores(int dt, int rows, int heads, int kv_heads, int hd, int rot, int pairs, bool page, bool at) {
    int ctx = 40, kv_cols = kv_heads * hd, q_cols = heads * hd;
    long long rb = row_bytes(dt, kv_cols);
    int blocks = (ctx + KV_BLOCK - 1) / KV_BLOCK;
    std::vector<unsigned> table;
    for (int i = 0; i < blocks; i++) table.push_back((unsigned)(2 * (blocks - i) - 1));
    size_t bytes = (size_t)(page ? 2 * blocks * KV_BLOCK : ctx) * rb;
    const unsigned* t = page ? table.data() : nullptr;
    auto inv = uniform((size_t)rot / 2, 0.001f, 1.0f);
    auto q = uniform((size_t)rows * q_cols), k = uniform((size_t)rows * kv_cols), v = uniform((size_t)rows * kv_cols);
    auto q1 = q, k1 = k;
    std::vector<u8> kc(bytes, 0xab), vc(bytes, 0xcd), kc1 = kc, vc1 = vc;
    int pos = 13;
    const int* pos_at = at ? &pos : nullptr;
    int first = at ? 2 : pos;
    long long rope_total = (long long)rows * heads * (rot / 2);
    host_launch({(unsigned)((rope_total + 255) / 256), 2, 1}, 256, [&] {
        rope_pair(q1.data(), q_cols, k1.data(), kv_cols, rows, hd, rot, pairs, inv.data(), first, pos_at);
    });
    long long n = (long long)rows * kv_cols;
    host_launch({(unsigned)((n + 255) / 256), 2, 1}, 256, [&] {
        store_kv_pair(k1.data(), v.data(), rows, kv_cols, dt, kc1.data(), vc1.data(), t, first, pos_at);
    });
    long long most = std::max(rope_total, n);
    host_launch({(unsigned)((most + 255) / 256), 3, 1}, 256, [&] {
        rope_store_kv(q.data(), q_cols, k.data(), v.data(), kv_cols, rows, hd, rot, pairs, inv.data(), dt, kc.data(),
                      vc.data(), t, first, pos_at);
    });
    char what[160];
    std::snprintf(what, sizeof what, "rope_store_kv dtype %d, %d rows, %d/%d heads of %d (%d rotated, pairs %d)%s%s", dt,
                  rows, heads, kv_heads, hd, rot, pairs, page ? ", paged" : "", at ? ", position in memory" : "");
    std::string w(what);
    bool ok = same((w + ", q").c_str(), q.data(), q1.data(), q.size() * 4);
    ok &= same((w + ", k").c_str(), k.data(), k1.data(), k.size() * 4);
    ok &= same((w + ", k cache").c_str(), kc.data(), kc1.data(), bytes);
    return same((w + ", v cache").c_str(), vc.data(), vc1.data(), bytes) && ok;
}

static bool add_norms(int rows, int cols) {
    auto x = uniform((size_t)rows * cols, -3.0f, 3.0f), y = uniform((size_t)rows * cols);
    auto w = uniform((size_t)cols, 0.5f, 1.5f);
    auto x1 = x;
    std::vector<float> out((size_t)rows * cols, NAN), out1 = out;
    float eps = 1e-5f;
    long long n = (long long)rows * cols;
    host_launch({(unsigned)((n + 255) / 256), 1, 1}, 256, [&] { add_f32(x1.data(), y.data(), n); });
    host_launch({(unsigned)rows, 1, 1}, 256, [&] { rms_norm(x1.data(), w.data(), eps, out1.data(), cols); });
    host_launch({(unsigned)rows, 1, 1}, 256,
                [&] { add_rms_norm(x.data(), y.data(), w.data(), eps, out.data(), cols); });
    char what[80];
    std::snprintf(what, sizeof what, "add_rms_norm %d rows of %d (residual)", rows, cols);
    bool ok = same(what, x.data(), x1.data(), x.size() * 4);
    std::snprintf(what, sizeof what, "add_rms_norm %d rows of %d (normed)", rows, cols);
    return same(what, out.data(), out1.data(), out.size() * 4) && ok;
}

// The RMSNorm inside the products of one token (matvec_quant_parts_norm,
// matvec_quant_gate_up_norm: each block norms and quantizes the row itself, the last block to
// read the residual writes it) against add_rms_norm (rms_norm without the add) then the kernels
// quantizing in blocks: products, residual and the ticket left at 0, bit for bit.
static bool norm_products(const std::vector<int>& dtypes, const std::vector<int>& rows, int cols, bool add, bool gated) {
    std::vector<Weight> ws;
    for (size_t i = 0; i < dtypes.size(); i++) ws.push_back({dtypes[i], rows[i], weights(dtypes[i], rows[i], cols)});
    auto x = uniform((size_t)cols, -3.0f, 3.0f), y = uniform((size_t)cols), nw = uniform((size_t)cols, 0.5f, 1.5f);
    const float eps = 1e-5f;
    auto x1 = x, x2 = x;
    std::vector<float> normed((size_t)cols, NAN);
    host_launch({1, 1, 1}, 256, [&] {
        if (add)
            add_rms_norm(x1.data(), y.data(), nw.data(), eps, normed.data(), cols);
        else
            rms_norm(x1.data(), nw.data(), eps, normed.data(), cols);
    });
    unsigned ticket = 0;
    const float* a = add ? y.data() : nullptr;
    bool ok = true;
    if (gated) {
        int r = ws[0].rows;
        unsigned grid = (unsigned)((r + WARPS - 1) / WARPS);
        std::vector<float> want((size_t)r, NAN), got((size_t)r, NAN);
        host_launch({grid, 1, 1}, WARPS * 32, [&] {
            matvec_quant_gate_up_x(ws[0].data.data(), ws[0].dtype, ws[1].data.data(), ws[1].dtype, r, cols,
                                   normed.data(), 1, ACT_SILU, 0.0f, want.data(), r);
        });
        host_launch({grid, 1, 1}, WARPS * 32, [&] {
            matvec_quant_gate_up_norm(ws[0].data.data(), ws[0].dtype, ws[1].data.data(), ws[1].dtype, r, cols,
                                      x2.data(), a, nw.data(), eps, ACT_SILU, 0.0f, got.data(), r, &ticket);
        });
        for (float v : got) ok &= v == v;
        ok &= std::memcmp(want.data(), got.data(), want.size() * 4) == 0;
    } else {
        std::vector<std::vector<float>> want, got;
        MatvecParts pw{}, pg{};
        unsigned grid = 0;
        for (size_t i = 0; i < ws.size(); i++) {
            want.emplace_back((size_t)ws[i].rows, NAN);
            got.emplace_back((size_t)ws[i].rows, NAN);
        }
        for (size_t i = 0; i < ws.size(); i++) {
            pw.part[i] = {ws[i].data.data(), want[i].data(), ws[i].dtype, ws[i].rows, ws[i].rows, 0};
            pg.part[i] = {ws[i].data.data(), got[i].data(), ws[i].dtype, ws[i].rows, ws[i].rows, 0};
            grid += (unsigned)((ws[i].rows + WARPS - 1) / WARPS);
        }
        pw.count = pg.count = (int)ws.size();
        host_launch({grid, 1, 1}, WARPS * 32, [&] { matvec_quant_parts_x(pw, cols, normed.data(), 1); });
        host_launch({grid, 1, 1}, WARPS * 32,
                    [&] { matvec_quant_parts_norm(pg, cols, x2.data(), a, nw.data(), eps, &ticket); });
        for (size_t i = 0; i < ws.size(); i++) {
            for (float v : got[i]) ok &= v == v;
            ok &= std::memcmp(want[i].data(), got[i].data(), want[i].size() * 4) == 0;
        }
    }
    ok &= std::memcmp(x1.data(), x2.data(), x1.size() * 4) == 0 && ticket == 0;
    char what[160];
    int at = std::snprintf(what, sizeof what, "%s of a pending norm%s, %d cols, rows", gated ? "gate/up" : "parts",
                           add ? " after the residual add" : "", cols);
    for (size_t i = 0; i < ws.size(); i++)
        at += std::snprintf(what + at, sizeof what - at, " %d (dtype %d)", ws[i].rows, ws[i].dtype);
    std::printf("fused-check: %s: %s\n", what, ok ? "bit-identical, residual too" : "DIFFERENT  FAILED");
    return ok;
}

// add_rms_norm_q8 / rms_norm_q8 (the norm writing 8-bit activation blocks) against the norm then
// quantize_q8: blocks and residual, bit for bit.
static bool norm_q8(int rows, int cols, bool add) {
    auto x = uniform((size_t)rows * cols, -3.0f, 3.0f), y = uniform((size_t)rows * cols);
    auto w = uniform((size_t)cols, 0.5f, 1.5f);
    auto x1 = x;
    std::vector<float> normed((size_t)rows * cols, NAN);
    const float eps = 1e-5f;
    long long blocks = (long long)rows * cols / 32;
    std::vector<ActBlock> want((size_t)blocks), got((size_t)blocks);
    std::memset(want.data(), 0xab, want.size() * sizeof(ActBlock));
    std::memset(got.data(), 0xcd, got.size() * sizeof(ActBlock));
    host_launch({(unsigned)rows, 1, 1}, 256, [&] {
        if (add)
            add_rms_norm(x1.data(), y.data(), w.data(), eps, normed.data(), cols);
        else
            rms_norm(x1.data(), w.data(), eps, normed.data(), cols);
    });
    host_launch({(unsigned)((blocks * 32 + 255) / 256), 1, 1}, 256,
                [&] { quantize_q8(normed.data(), blocks, want.data()); });
    host_launch({(unsigned)rows, 1, 1}, 256, [&] {
        if (add)
            add_rms_norm_q8(x.data(), y.data(), w.data(), eps, got.data(), cols);
        else
            rms_norm_q8(x.data(), w.data(), eps, got.data(), cols);
    });
    char what[80];
    std::snprintf(what, sizeof what, "%s %d rows of %d (activation blocks)", add ? "add_rms_norm_q8" : "rms_norm_q8",
                  rows, cols);
    bool ok = same(what, got.data(), want.data(), want.size() * sizeof(ActBlock));
    std::snprintf(what, sizeof what, "%s %d rows of %d (residual)", add ? "add_rms_norm_q8" : "rms_norm_q8", rows, cols);
    return same(what, x.data(), x1.data(), x.size() * 4) && ok;
}

int main() {
    bool ok = true;
    // q, k, v (GQA: k and v narrower, rows not a multiple of a block's 8); gate and up; one
    // matrix's row blocks into one output; mixed block formats; 1, a few and the most tokens.
    ok &= parts({DT_Q4_1, DT_Q4_1, DT_Q8_0}, {40, 13, 13}, 256, 1, false);
    ok &= parts({DT_Q8_0, DT_Q4_1}, {9, 30}, QX_MAX_COLS, 1, true);
    ok &= parts({DT_Q4_1, DT_Q8_0}, {72, 72}, 128, 3, false);
    ok &= parts({DT_Q8_0, DT_Q4_1, DT_Q4_1, DT_Q8_0}, {8, 17, 5, 24}, 96, MAX_QTOKENS, true);
    ok &= parts({DT_F16, DT_F16, DT_F16}, {40, 13, 13}, 256, 1, false);
    ok &= parts({DT_F16, DT_F16}, {24, 9}, 64, MAX_TOKENS, true);
    ok &= parts({DT_F16, DT_F16, DT_F16}, {16, 5, 5}, 8 * (32 * F16_LOADS + 3), 1, true);
    ok &= parts({DT_F16, DT_F16}, {9, 4}, F16_X_COLS + 16, 1, false);
    ok &= f16_one_token(11, 8 * (32 * 4 + 37));
    ok &= f16_one_token(9, 64);
    // Activations staged in shared memory: whole rounds of F16_LOADS and a partial one, and the
    // widest staged row; then rows too wide to stage (global activations, fewer loads in flight).
    ok &= f16_one_token(10, 8 * (32 * F16_LOADS * 2 + 37));
    ok &= f16_one_token(3, F16_X_COLS);
    ok &= f16_one_token(5, F16_X_COLS + 8 * 5);
    for (int pairs : {0, 1}) {
        ok &= rope_pairs(1, 4, 2, 16, 16, pairs, true);
        ok &= rope_pairs(3, 3, 1, 32, 24, pairs, false);
    }
    for (int dt : {DT_F32, DT_F16, DT_Q8_0}) {
        ok &= store_pairs(dt, 1, 64, dt != DT_F16, true);
        ok &= store_pairs(dt, 5, 96, dt == DT_F16, false);
    }
    ok &= rope_stores(DT_F16, 1, 4, 2, 64, 64, 1, true, true);
    ok &= rope_stores(DT_F32, 3, 3, 1, 32, 24, 0, false, false);
    ok &= rope_stores(DT_F16, 2, 2, 2, 32, 16, 1, false, true);
    // Gate and up: one token (four f16 loads in flight; quantized in blocks), a few, the most;
    // mixed block formats; the mask.
    ok &= gate_up(DT_F16, DT_F16, 40, 8 * (32 * 4 + 37), 1, ACT_SILU, 0.0f, false);
    ok &= gate_up(DT_F16, DT_F16, 17, 256, MAX_TOKENS, ACT_GELU, 0.05f, false);
    ok &= gate_up(DT_F16, DT_F16, 9, 8 * (32 * F16_LOADS + 13), 1, ACT_SILU, 0.0f, false);
    ok &= gate_up(DT_F16, DT_F16, 11, F16_X_COLS + 8 * 3, 1, ACT_SILU, 0.0f, false);
    ok &= gate_up(DT_Q4_1, DT_Q4_1, 40, 576, 1, ACT_SILU, 0.0f, true);
    ok &= gate_up(DT_Q4_1, DT_Q8_0, 13, QX_MAX_COLS, 1, ACT_GELU_TANH, 0.05f, true);
    ok &= gate_up(DT_Q8_0, DT_Q4_1, 24, 4096, 1, ACT_SILU, 0.0f, false);
    ok &= gate_up(DT_Q4_1, DT_Q4_1, 9, 96, MAX_QTOKENS, ACT_RELU, 0.0f, false);
    ok &= add_norms(1, 576);
    ok &= add_norms(3, 200);
    // The norm inside one token's block-format products: q/k/v of a SmolLM2 layer (576 wide,
    // GQA), mixed formats, the widest row a block quantizes; gate and up; with and without the
    // residual add.
    ok &= norm_products({DT_Q4_1, DT_Q4_1, DT_Q4_1}, {72, 24, 24}, 576, true, false);
    ok &= norm_products({DT_Q8_0, DT_Q4_1}, {9, 30}, QX_MAX_COLS, false, false);
    ok &= norm_products({DT_Q4_1, DT_Q4_1}, {40, 40}, 576, true, true);
    ok &= norm_products({DT_Q4_1, DT_Q8_0}, {13, 13}, 256, false, true);
    // The norm writing activation blocks (rows too wide for the matvec's blocks): one and a few.
    ok &= norm_q8(1, 4096, true);
    ok &= norm_q8(3, 2080, true);
    ok &= norm_q8(2, 4096, false);
    if (!ok) return 1;
    std::printf("fused-check: every fused kernel equals the kernels it replaces, bit for bit\n");
    return 0;
}
