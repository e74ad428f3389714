// The kernels of kernels/flash_attention.cu run on the host, each block as threads
// (kernels/host/simt.h, which also stands in for the tensor-core product from the PTX fragment
// layouts), against a naive causal GQA attention in double over the same cache values:
// the flash prefill kernel (f16 and Q8_0 caches, the latter's tiles decoded to f16: queries,
// probabilities and values rounded to f16, so a relative tolerance of 2e-3), unsplit and with its
// keys split across blocks and merged by flash_combine (rows that see every split, rows that see
// none of the last, blocks left with no keys), and the split decode kernel, whose last block per head combines the
// chunks (every cache type, f32 math: 1e-4; every ticket left at 0). The flash kernel's cp.async
// copies land only when their thread waits for them (simt.h), so a tile read before its wait and
// barrier reads the tile before it and fails here; ldmatrix is emulated from its fragment layout.
// Each runs over the caches as they are and paged: the rows scattered backwards over a pool of
// twice the blocks and read through a block table (kv_row in common.cuh).
// A recorded step (a CUDA graph replayed at later positions) launches the split kernels with the
// position in device memory and room for the most chunks: their output must be the host-planned
// launch's bit for bit, and the device's chunk plan the host's (split_chunks) at every position.
// The simple kernel of kernels/attention.cu (one block per query row and head: the heads the
// other two do not take, prompts over f32 caches, and every prompt before sm_80) is held to the same naive
// attention, every cache type, paged and not, over more keys than one of its tiles, and launched
// as a recorded step launches it (position in device memory) to the same bits.
// Errors are max |got - want| / max |want|. scripts/check-kernels.sh builds and runs this.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "flash_attention.cu"
#include "attention.cu"

struct Case {
    int n, first_pos, heads, kv_heads, hd;
};

// A cache of `rows` × `cols` random values in DT, as store_kv writes it.
static std::vector<u8> cache(std::mt19937& rng, int dt, int rows, int cols) {
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<float> x((size_t)rows * cols);
    for (auto& v : x) v = u(rng);
    std::vector<u8> out;
    if (dt == DT_F32) {
        out.resize(x.size() * 4);
        std::memcpy(out.data(), x.data(), out.size());
    } else if (dt == DT_F16) {
        out.resize(x.size() * 2);
        for (size_t i = 0; i < x.size(); i++) ((u16*)out.data())[i] = f2h(x[i]);
    } else {  // Q8_0: d = amax / 127, q = round(x / d)
        out.resize(x.size() / 32 * 34);
        for (size_t b = 0; b < x.size() / 32; b++) {
            float amax = 0.0f;
            for (int i = 0; i < 32; i++) amax = std::fmax(amax, std::fabs(x[b * 32 + i]));
            float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            u16 dh = f2h(d);
            std::memcpy(&out[b * 34], &dh, 2);
            for (int i = 0; i < 32; i++) out[b * 34 + 2 + i] = (u8)(i8)std::round(x[b * 32 + i] * id);
        }
    }
    return out;
}

// A paged copy of a cache (`rows` rows of `rb` bytes) and its block table: block i of the
// sequence at block 2·(blocks - i) - 1 of a pool of 2·blocks blocks.
struct Paged {
    std::vector<u8> pool;
    std::vector<unsigned> table;
};

static Paged paged(const std::vector<u8>& c, int rows, long long rb) {
    int blocks = (rows + KV_BLOCK - 1) / KV_BLOCK;
    Paged p;
    p.pool.assign((size_t)2 * blocks * KV_BLOCK * rb, 0xff);
    for (int i = 0; i < blocks; i++) p.table.push_back((unsigned)(2 * (blocks - i) - 1));
    for (int r = 0; r < rows; r++) std::memcpy(&p.pool[kv_row(p.table.data(), r) * rb], &c[(size_t)r * rb], rb);
    return p;
}

template <int DT>
static std::vector<double> naive(const std::vector<float>& q, const u8* kc, const u8* vc, const Case& c) {
    int kv_cols = c.kv_heads * c.hd, group = c.heads / c.kv_heads;
    long long rb = row_bytes(DT, kv_cols);
    double scale = 1.0 / std::sqrt((double)c.hd);
    std::vector<double> out((size_t)c.n * c.heads * c.hd, 0.0);
    for (int t = 0; t < c.n; t++)
        for (int h = 0; h < c.heads; h++) {
            int len = c.first_pos + t + 1, col = (h / group) * c.hd;
            std::vector<double> s(len);
            double mx = -1e300, sum = 0.0;
            for (int j = 0; j < len; j++) {
                double dot = 0.0;
                for (int d = 0; d < c.hd; d++)
                    dot += (double)q[((size_t)t * c.heads + h) * c.hd + d] * kv_elem<DT>(kc + j * rb, col + d);
                s[j] = dot * scale;
                mx = std::max(mx, s[j]);
            }
            for (int j = 0; j < len; j++) sum += (s[j] = std::exp(s[j] - mx));
            for (int d = 0; d < c.hd; d++) {
                double o = 0.0;
                for (int j = 0; j < len; j++) o += s[j] * kv_elem<DT>(vc + j * rb, col + d);
                out[((size_t)t * c.heads + h) * c.hd + d] = o / sum;
            }
        }
    return out;
}

static double rel(const std::vector<float>& got, const std::vector<double>& want) {
    double d = 0.0, m = 1e-30;
    for (size_t i = 0; i < got.size(); i++) {
        if (!std::isfinite(got[i])) return INFINITY;
        d = std::max(d, std::fabs(got[i] - want[i]));
        m = std::max(m, std::fabs(want[i]));
    }
    return d / m;
}

static std::vector<float> queries(std::mt19937& rng, const Case& c) {
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<float> q((size_t)c.n * c.heads * c.hd);
    for (auto& v : q) v = u(rng);
    return q;
}

// The flash kernel as launched unsplit (`chunk` 0: no workspace), or with its keys split into
// chunks of `chunk` (a multiple of FA_KEYS) and the splits merged by flash_combine.
template <int DT>
static bool flash(std::mt19937& rng, const Case& c, bool page, int chunk = 0) {
    int ctx = c.first_pos + c.n, kv_cols = c.kv_heads * c.hd;
    auto q = queries(rng, c);
    auto kc = cache(rng, DT, ctx, kv_cols), vc = cache(rng, DT, ctx, kv_cols);
    long long rb = row_bytes(DT, kv_cols);
    Paged pk = paged(kc, ctx, rb), pv = paged(vc, ctx, rb);
    std::vector<float> out(q.size(), NAN);
    float scale = 1.0f / std::sqrt((float)c.hd);
    int splits = chunk > 0 ? (ctx + chunk - 1) / chunk : 1;
    std::vector<float> ws(chunk > 0 ? (size_t)splits * c.n * c.heads * (c.hd + 2) : 0, NAN);
    float* w = chunk > 0 ? ws.data() : nullptr;
    int keys = chunk > 0 ? chunk : ctx;  // unsplit: a chunk of every key
    auto kernel = [&] {
        const u8* k = page ? pk.pool.data() : kc.data();
        const u8* v = page ? pv.pool.data() : vc.data();
        const unsigned* t = page ? pk.table.data() : nullptr;
        int g = c.heads / c.kv_heads;
#define FLASH_CASES(NAME)                                                                                        \
    switch (c.hd) {                                                                                              \
        case 64: flash_attn_##NAME##_hd64(q.data(), k, v, t, w, out.data(), c.n, c.heads, g, kv_cols, c.first_pos, scale, keys); break; \
        case 80: flash_attn_##NAME##_hd80(q.data(), k, v, t, w, out.data(), c.n, c.heads, g, kv_cols, c.first_pos, scale, keys); break; \
        case 96: flash_attn_##NAME##_hd96(q.data(), k, v, t, w, out.data(), c.n, c.heads, g, kv_cols, c.first_pos, scale, keys); break; \
        default: flash_attn_##NAME##_hd128(q.data(), k, v, t, w, out.data(), c.n, c.heads, g, kv_cols, c.first_pos, scale, keys); \
    }
        if (DT == DT_F16) {
            FLASH_CASES(f16)
        } else {
            FLASH_CASES(q8_0)
        }
#undef FLASH_CASES
    };
    host_launch({(unsigned)((c.n + FA_ROWS - 1) / FA_ROWS), (unsigned)c.heads, (unsigned)splits}, FA_THREADS, kernel);
    if (chunk > 0)
        host_launch({(unsigned)c.heads, (unsigned)c.n, 1}, FA_THREADS, [&] {
            flash_combine(w, out.data(), c.n, c.heads, c.hd, c.first_pos, chunk, splits);
        });
    double e = rel(out, naive<DT>(q, kc.data(), vc.data(), c));
    bool ok = e <= 2e-3;
    char how[48] = "";
    if (chunk > 0) std::snprintf(how, sizeof how, ", %d splits of %d keys", splits, chunk);
    std::printf("flash-check: flash %s n %d from %d heads %d/%d hd %d%s%s: %.2e%s\n", DT == DT_F16 ? "f16" : "q8_0",
                c.n, c.first_pos, c.heads, c.kv_heads, c.hd, how, page ? " paged" : "", e, ok ? "" : "  FAILED");
    return ok;
}

// Every head's ticket back at 0 after a launch, ready for the next (a replayed graph's too).
static bool tickets_ready(const std::vector<unsigned>& tickets) {
    for (unsigned x : tickets)
        if (x != 0) {
            std::printf("flash-check: a head's ticket left at %u  FAILED\n", x);
            return false;
        }
    return true;
}

// A split case's queries and caches (as they are and paged), and what a launch reads: the caches
// and block table as `page` says.
struct SplitInputs {
    int ctx, kv_cols;
    std::vector<float> q;
    std::vector<u8> kc, vc;
    Paged pk, pv;
    const u8 *k, *v;
    const unsigned* t;
};

template <int DT>
static SplitInputs split_inputs(std::mt19937& rng, const Case& c, bool page) {
    SplitInputs in;
    in.ctx = c.first_pos + c.n;
    in.kv_cols = c.kv_heads * c.hd;
    in.q = queries(rng, c);
    in.kc = cache(rng, DT, in.ctx, in.kv_cols);
    in.vc = cache(rng, DT, in.ctx, in.kv_cols);
    long long rb = row_bytes(DT, in.kv_cols);
    in.pk = paged(in.kc, in.ctx, rb);
    in.pv = paged(in.vc, in.ctx, rb);
    // Heap data: the pointers stay valid as `in` moves.
    in.k = page ? in.pk.pool.data() : in.kc.data();
    in.v = page ? in.pv.pool.data() : in.vc.data();
    in.t = page ? in.pk.table.data() : nullptr;
    return in;
}

// The simple kernel: a block of 256 threads per (query row, head); launched as planned, and as a
// recorded step launches it (the position read from memory, a stale one passed): bit for bit.
template <int DT>
static bool simple(std::mt19937& rng, const Case& c, bool page) {
    SplitInputs in = split_inputs<DT>(rng, c, page);
    float scale = 1.0f / std::sqrt((float)c.hd);
    int g = c.heads / c.kv_heads, q_stride = c.heads * c.hd;
    auto run = [&](int pos_arg, const int* pos_at) {
        std::vector<float> out(in.q.size(), NAN);
        host_launch({(unsigned)(c.n * c.heads), 1, 1}, 256, [&] {
            attention_impl<DT>(in.q.data(), in.k, in.v, in.t, out.data(), c.heads, g, c.hd, q_stride, in.kv_cols,
                               pos_arg, scale, pos_at);
        });
        return out;
    };
    auto out = run(c.first_pos, nullptr);
    int pos = c.first_pos;
    auto replayed = run(c.first_pos / 2, &pos);
    bool same = std::memcmp(out.data(), replayed.data(), out.size() * 4) == 0;
    double e = rel(out, naive<DT>(in.q, in.kc.data(), in.vc.data(), c));
    bool ok = e <= 1e-4 && same;
    std::printf("flash-check: simple dtype %d n %d from %d heads %d/%d hd %d%s: %.2e, recorded %s%s\n", DT, c.n,
                c.first_pos, c.heads, c.kv_heads, c.hd, page ? " paged" : "", e, same ? "bit-identical" : "DIFFERENT",
                ok ? "" : "  FAILED");
    return ok;
}

// The split kernel launched as planned on the host (chunks of `chunk` keys): ROWS 1 (the
// decode kernels) for one row, SPLIT_ROWS else, or (`wide`) SPLIT_ROWS for one row too.
template <int DT>
static bool split(std::mt19937& rng, const Case& c, int chunk, bool page, bool wide = false) {
    SplitInputs in = split_inputs<DT>(rng, c, page);
    auto& q = in.q;
    int kv_cols = in.kv_cols, chunks = (in.ctx + chunk - 1) / chunk;
    const u8 *k = in.k, *v = in.v;
    const unsigned* t = in.t;
    if (c.n * chunks > MAX_SPLITS) {
        std::printf("flash-check: %d rows × %d chunks exceed the workspace\n", c.n, chunks);
        return false;
    }
    std::vector<float> ws((size_t)c.heads * MAX_SPLITS * (c.hd + 2), NAN), out(q.size(), NAN);
    std::vector<unsigned> tickets(c.heads, 0);
    float scale = 1.0f / std::sqrt((float)c.hd);
    int g = c.heads / c.kv_heads;
    host_launch({(unsigned)c.heads, (unsigned)chunks, 1}, SPLIT_THREADS, [&] {
        if (c.n == 1 && !wide)
            split_impl<DT, 1>(q.data(), k, v, t, ws.data(), tickets.data(), out.data(), c.n, c.heads, g, c.hd,
                              kv_cols, c.first_pos, scale, chunk, chunks, nullptr);
        else
            split_impl<DT, SPLIT_ROWS>(q.data(), k, v, t, ws.data(), tickets.data(), out.data(), c.n, c.heads, g,
                                       c.hd, kv_cols, c.first_pos, scale, chunk, chunks, nullptr);
    });
    double e = rel(out, naive<DT>(q, in.kc.data(), in.vc.data(), c));
    bool ok = e <= 1e-4 && tickets_ready(tickets);
    std::printf("flash-check: split%s dtype %d n %d from %d heads %d/%d hd %d, %d chunks%s: %.2e%s\n",
                c.n == 1 && !wide ? "1" : "", DT, c.n, c.first_pos, c.heads, c.kv_heads, c.hd, chunks,
                page ? " paged" : "", e, ok ? "" : "  FAILED");
    return ok;
}

// split_chunks of src/footprint/attention.rs, as written there: the plan the host launches with,
// at most `most` chunks (split_most_chunks).
static void host_split_chunks(int keys, int rows, int most, int* chunks, int* chunk) {
    most = std::clamp(most, 1, std::max(MAX_SPLITS / std::max(rows, 1), 1));
    int c = std::clamp((keys + SPLIT_MIN_KEYS - 1) / SPLIT_MIN_KEYS, 1, most);
    *chunk = std::max((keys + c - 1) / c, 1);
    *chunks = (keys + *chunk - 1) / *chunk;
}

// A recorded step (replayed as a CUDA graph at later positions): the split kernels read the
// position from device memory and plan their chunks themselves, on a grid with room for the most
// chunks (`most`). Their output must be the host-planned launch's, bit for bit, at every position.
template <int DT>
static bool recorded(std::mt19937& rng, const Case& c, bool page, int most) {
    SplitInputs in = split_inputs<DT>(rng, c, page);
    auto& q = in.q;
    int ctx = in.ctx, kv_cols = in.kv_cols;
    const u8 *k = in.k, *v = in.v;
    const unsigned* t = in.t;
    float scale = 1.0f / std::sqrt((float)c.hd);
    int g = c.heads / c.kv_heads, chunks, chunk;
    host_split_chunks(ctx, c.n, most, &chunks, &chunk);
    const int grid = std::clamp(most, 1, std::max(MAX_SPLITS / c.n, 1));
    // One set of tickets for both runs, as one buffer serves every launch on the device.
    std::vector<unsigned> tickets(c.heads, 0);
    auto run = [&](unsigned grid_chunks, int pos_arg, int chunk_arg, const int* pos_at) {
        std::vector<float> ws((size_t)c.heads * MAX_SPLITS * (c.hd + 2), NAN), out(q.size(), NAN);
        host_launch({(unsigned)c.heads, grid_chunks, 1}, SPLIT_THREADS, [&] {
            if (c.n == 1)
                split_impl<DT, 1>(q.data(), k, v, t, ws.data(), tickets.data(), out.data(), c.n, c.heads, g, c.hd,
                                  kv_cols, pos_arg, scale, chunk_arg, most, pos_at);
            else
                split_impl<DT, SPLIT_ROWS>(q.data(), k, v, t, ws.data(), tickets.data(), out.data(), c.n, c.heads, g,
                                           c.hd, kv_cols, pos_arg, scale, chunk_arg, most, pos_at);
        });
        return out;
    };
    auto planned = run((unsigned)chunks, c.first_pos, chunk, nullptr);
    // The recorded launch's scalars are those of the step it was recorded at (stale here).
    int pos = c.first_pos;
    auto replayed = run((unsigned)grid, 3, 1, &pos);
    bool same = std::memcmp(planned.data(), replayed.data(), planned.size() * 4) == 0;
    double e = rel(replayed, naive<DT>(q, in.kc.data(), in.vc.data(), c));
    bool ok = same && e <= 1e-4 && tickets_ready(tickets);
    std::printf("flash-check: recorded split dtype %d n %d at %d (%d chunks of %d, most %d)%s: %s, %.2e%s\n", DT,
                c.n, c.first_pos, chunks, chunk, most, page ? " paged" : "", same ? "bit-identical" : "DIFFERENT", e,
                ok ? "" : "  FAILED");
    return ok;
}

// The device's chunk plan equals the host's for every position, row count and most chunks a
// split takes.
static bool plans_agree() {
    int plan[2];
    for (int rows = 1; rows <= SPLIT_ROWS; rows++)
        for (int most : {1, 3, 16, 24, MAX_SPLITS / rows, MAX_SPLITS})
            for (int keys = 1; keys <= 40000; keys++) {
                int hc, hk;
                host_split_chunks(keys, rows, most, &hc, &hk);
                split_plan(keys, rows, most, &plan[0], &plan[1]);
                if (plan[0] != hc || plan[1] != hk || hc * rows > MAX_SPLITS || hc > std::max(most, 1) ||
                    (long long)hc * hk < keys || (long long)(hc - 1) * hk >= keys) {
                    std::printf(
                        "flash-check: split plan of %d keys, %d rows, most %d: device %d × %d, host %d × %d  FAILED\n",
                        keys, rows, most, plan[0], plan[1], hc, hk);
                    return false;
                }
            }
    std::printf("flash-check: device and host split plans agree for 1..40000 keys, 1..%d rows, most 1..%d\n",
                SPLIT_ROWS, MAX_SPLITS);
    return true;
}

int main() {
    std::mt19937 rng(13);
    bool ok = true;
    // Query tiles cut short by n, rows past n, diagonal and whole key tiles, GQA.
    for (bool page : {false, true}) {
        for (Case c : {Case{90, 70, 4, 2, 64}, Case{64, 0, 2, 1, 128}, Case{17, 130, 2, 2, 80}, Case{20, 5, 3, 1, 96}}) {
            ok &= flash<DT_F16>(rng, c, page);
            ok &= flash<DT_Q8_0>(rng, c, page);
        }
        // Keys split across blocks: splits every row sees (a short group late in a long
        // context), splits some rows of a block see and others not, blocks that see none of the
        // last splits, one tile a split.
        for (auto [c, chunk] : {std::pair{Case{90, 700, 4, 2, 64}, 256}, std::pair{Case{130, 20, 2, 1, 128}, 64},
                                std::pair{Case{40, 300, 2, 2, 80}, 128}, std::pair{Case{33, 200, 3, 1, 96}, 192}}) {
            ok &= flash<DT_F16>(rng, c, page, chunk);
            ok &= flash<DT_Q8_0>(rng, c, page, chunk);
        }
        // Chunks of one and of several tiles, rows that see none of the last chunk.
        // Heads whose dims leave lanes of a key idle (80, 96), a key per half warp (128) and per
        // warp (256); chunks of several tiles.
        for (Case c : {Case{1, 150, 4, 2, 64}, Case{3, 40, 4, 2, 48}, Case{4, 70, 2, 2, 32}, Case{1, 300, 4, 2, 80},
                       Case{2, 150, 2, 2, 128}, Case{1, 90, 2, 1, 256}, Case{4, 200, 3, 1, 96}}) {
            ok &= split<DT_F32>(rng, c, 64, page);
            ok &= split<DT_F16>(rng, c, 100, page);
            ok &= split<DT_Q8_0>(rng, c, 37, page);
            // One row through the SPLIT_ROWS kernels too (what a row takes beside others).
            if (c.n == 1) ok &= split<DT_F16>(rng, c, 64, page, true);
        }
        // A decode step over 4000 positions of 7B heads (128 wide, f16, 32 heads cut to 2 here)
        // at chunk counts the device's size gives (split_most_chunks), and a chunk with a
        // partial last batch.
        const int chunks = page ? 16 : 24;
        ok &= split<DT_F16>(rng, Case{1, 3999, 2, 2, 128}, (4000 + chunks - 1) / chunks, page);
        ok &= split<DT_Q8_0>(rng, Case{1, 1000, 2, 1, 64}, 1001 / 3 + 1, page);
    }
    ok &= plans_agree();
    // Heads of 36 and 16 (not whole 8-dim vectors: only this kernel takes them), 64; more keys
    // than one tile (1024), rows past the first. (KV rows whole Q8_0 blocks, as KvType requires.)
    for (bool page : {false, true})
        for (Case c : {Case{2, 1100, 8, 8, 36}, Case{3, 5, 4, 2, 64}, Case{1, 0, 2, 2, 16}}) {
            ok &= simple<DT_F32>(rng, c, page);
            ok &= simple<DT_F16>(rng, c, page);
            ok &= simple<DT_Q8_0>(rng, c, page);
        }
    // One chunk, the first split, many, the most; several rows. Each case once (each block runs
    // as host threads), the cache types and paging taking turns.
    int i = 0;
    for (Case c : {Case{1, 0, 2, 1, 64}, Case{1, 63, 2, 2, 64}, Case{1, 64, 2, 1, 64}, Case{1, 777, 2, 1, 64},
                   Case{1, 2100, 1, 1, 128}, Case{2, 300, 4, 2, 48}, Case{4, 90, 2, 2, 32}, Case{1, 3999, 1, 1, 128}}) {
        bool page = i % 2 == 1;
        // The most chunks a device of this size takes (split_most_chunks), or the workspace's.
        const int most = i % 4 == 3 ? 5 : (i % 4 == 1 ? 24 : MAX_SPLITS);
        switch (i++ % 3) {
            case 0: ok &= recorded<DT_F16>(rng, c, page, most); break;
            case 1: ok &= recorded<DT_F32>(rng, c, page, most); break;
            default: ok &= recorded<DT_Q8_0>(rng, c, page, most);
        }
    }
    if (!ok) return 1;
    std::printf("flash-check: flash prefill, split decode and simple attention equal naive attention, paged and not\n");
    return 0;
}
