//! One head's attention on the CPU, and a step's rows attending their caches: the scores, the
//! softmax in chunks of positions, the weighted sum of values; over any cache that gives its rows
//! as f32 ([`KvRows`]: the CPU's own cache, a paged sequence's blocks of it, raw host rows).

use half::f16;

use super::kernels::Kernels;
use crate::backend::AttnShape;

/// Rows of a KV cache one head's slice at a time, as f32 (borrowed, or decoded into `tmp`).
pub trait KvRows: Sync {
    fn slice<'a>(&'a self, j: usize, col: usize, tmp: &'a mut [f32]) -> &'a [f32];
    /// Rows `js`' values `col..` as f32 into `block`, each row's `block.len() / js.len()`
    /// values one after another: what [`KvRows::slice`] gives each, in one call for a block of
    /// rows (a call a row, through the cache's layers, cost more than decoding an f16 head).
    fn decode_block(&self, js: std::ops::Range<usize>, col: usize, block: &mut [f32]);
    /// All rows as f32 values and the distance between rows, where they are stored so (an
    /// f32 cache, not paged): attention then indexes them directly.
    fn f32_rows(&self) -> Option<(&[f32], usize)> {
        None
    }
    /// All rows as f16 values and the distance between rows, where they are stored so (an f16
    /// cache, not paged): a lone row's attention then reads them in place.
    fn f16_rows(&self) -> Option<(&[f16], usize)> {
        None
    }
    /// Ask the caches for rows `js`' values `col..col + width` ahead of use (a hint).
    fn prefetch(&self, _js: std::ops::Range<usize>, _col: usize, _width: usize) {}
}

/// Rows of attention's blocks of positions.
const ROWS: usize = 16;

/// Where attention reads a cache's rows in place, and the distance between rows.
#[derive(Clone, Copy)]
enum InPlace<'a> {
    /// An f32 cache (not paged).
    F32(&'a [f32], usize),
    /// An f16 cache (not paged), for a lone row: the kernels widen each value as they load it,
    /// where decoding a block first cost a pass over it for one query's few products.
    F16(&'a [f16], usize),
}

impl<'a> InPlace<'a> {
    /// How `cache` is read in place, if it is: f32 rows always, f16 rows for a `lone` row.
    fn of(cache: &'a impl KvRows, lone: bool) -> Option<Self> {
        if let Some((v, stride)) = cache.f32_rows() {
            return Some(InPlace::F32(v, stride));
        }
        let (v, stride) = cache.f16_rows().filter(|_| lone)?;
        Some(InPlace::F16(v, stride))
    }

    /// The f32 rows and their distance, where these are f32.
    fn f32(self) -> Option<(&'a [f32], usize)> {
        match self {
            InPlace::F32(v, stride) => Some((v, stride)),
            InPlace::F16(..) => None,
        }
    }
}

/// Row `j` of a cache read in place (`v`, rows `stride` apart): `hd` values from column `col`.
fn row_at<T>(v: &[T], stride: usize, j: usize, col: usize, hd: usize) -> &[T] {
    &v[j * stride + col..j * stride + col + hd]
}

/// Rows `js` (at most [`ROWS`]) of a cache, the columns of a run of KV heads: `width` values
/// from `col0` on. Straight from `direct` (f32 rows, their stride) where there is one; else
/// each row's run decoded into `block` in one call, `width` apart (one call a row, not one a
/// row and head: a Q8_0 row's blocks then go through the bulk decoder together).
struct KvRun<'a> {
    rows: [&'a [f32]; ROWS],
    col0: usize,
    /// Rows read in place: the f32 values and the distance between rows, and the block's rows.
    direct: Option<(&'a [f32], usize, std::ops::Range<usize>)>,
}

impl<'a> KvRun<'a> {
    fn of(
        direct: Option<(&'a [f32], usize)>,
        cache: &'a impl KvRows,
        js: std::ops::Range<usize>,
        (col0, width): (usize, usize),
        block: &'a mut [f32],
    ) -> Self {
        let mut rows: [&[f32]; ROWS] = [&[]; ROWS];
        if direct.is_none() {
            let block = &mut block[..js.len() * width];
            cache.decode_block(js.clone(), col0, block);
            for (r, v) in rows.iter_mut().zip(block.chunks_exact(width)) {
                *r = v;
            }
        }
        KvRun {
            rows,
            col0,
            direct: direct.map(|(v, stride)| (v, stride, js)),
        }
    }

    /// The block's rows, `hd` values from cache column `col` (within the run).
    fn head(&self, col: usize, hd: usize) -> [&'a [f32]; ROWS] {
        match &self.direct {
            Some((v, stride, js)) => {
                let mut rows: [&[f32]; ROWS] = [&[]; ROWS];
                for (r, j) in rows.iter_mut().zip(js.clone()) {
                    *r = row_at(v, *stride, j, col, hd);
                }
                rows
            }
            None => {
                let at = col - self.col0;
                self.rows.map(|r| r.get(at..at + hd).unwrap_or(&[]))
            }
        }
    }
}

/// Positions of a chunk: a head's attention is taken over chunks of this many positions (each
/// chunk's maximum score, sum of exponentials and unnormalised weighted sum of values), then
/// the chunks merged in order. The arithmetic is the same whether one task takes a row's chunks
/// or several tasks share them, so a decoded token alone can spread its long context over the
/// threads and still get what it gets beside others.
const CHUNK: usize = 256;

/// Query rows a task takes together where they attend the same caches (a prompt's rows): each
/// key and value row is read once for all of them.
const ROW_TILE: usize = 8;

/// Asks for the key and value rows of the first chunk an attention over `rows` positions reads,
/// into L2: the hint [`attend_chunk`] gives a lone row at its start, given earlier.
/// `caches`: the key cache and the value cache, each with its values a row.
pub(super) fn prefetch_first_chunk<R: KvRows>(caches: [(&R, usize); 2], rows: usize) {
    for (c, cols) in caches {
        if c.f32_rows().is_none() {
            c.prefetch(0..rows.min(CHUNK), 0, cols);
        }
    }
}

/// Causal attention of the rows of `q` (`n_heads · head_dim` each) into the same rows of
/// `out`: `caches(t)` gives row `t`'s key and value caches and how many of their positions it
/// attends (`None`: the row is left alone); over the current rayon pool where `parallel`.
/// Consecutive rows over the same caches go in tiles of `ROW_TILE`, each key and value row
/// read once for the tile's rows and the query heads sharing its KV head; with few tiles, every
/// (row, KV head, chunk of positions) is a task of its own. A head's arithmetic is the same every
/// way, so a row's result depends on nothing but its own query and caches.
pub fn attend_each<'c, R: KvRows + 'c>(
    k: &Kernels,
    q: &[f32],
    caches: impl Fn(usize) -> Option<(&'c R, &'c R, usize)> + Sync,
    s: AttnShape,
    out: &mut [f32],
    parallel: bool,
) {
    use rayon::prelude::*;
    let hd = s.head_dim;
    let q_dim = s.n_heads * hd;
    let n = q.len() / q_dim.max(1);
    let kv_heads = s.n_kv_heads.max(1);
    let group = (s.n_heads / kv_heads).max(1);
    let same =
        |a: (&R, &R, usize), b: (&R, &R, usize)| std::ptr::eq(a.0, b.0) && std::ptr::eq(a.1, b.1);
    let mut tiles: Vec<std::ops::Range<usize>> = Vec::new();
    let mut t = 0;
    while t < n {
        let Some(c) = caches(t) else {
            t += 1;
            continue;
        };
        let mut e = t + 1;
        while e < n && e - t < ROW_TILE && caches(e).is_some_and(|d| same(c, d)) {
            e += 1;
        }
        tiles.push(t..e);
        t = e;
    }
    let chunks = |t: usize| caches(t).map_or(0, |(.., len)| len.div_ceil(CHUNK));
    let threads = if parallel {
        rayon::current_num_threads()
    } else {
        1
    };
    let rows: usize = tiles.iter().map(|r| r.len()).sum();
    let items: usize = tiles
        .iter()
        .flat_map(|r| r.clone())
        .map(chunks)
        .sum::<usize>()
        * kv_heads;
    // Split where there are few tiles and some row's context spans several chunks.
    if !parallel || tiles.len() >= 2 * threads || items <= rows * kv_heads {
        // Each task a tile of rows, all their heads; a tile alone (a decode step's row) spreads
        // its KV heads over the threads instead of leaving all but one idle.
        let heads_parallel = parallel && tiles.len() < threads;
        let tile = |(r, o): (&std::ops::Range<usize>, &mut [f32])| {
            let lens: Vec<usize> = r.clone().map(|t| caches(t).map_or(0, |c| c.2)).collect();
            let Some((kc, vc, _)) = caches(r.start) else {
                return;
            };
            let qr = &q[r.start * q_dim..r.end * q_dim];
            attend_tile(k, qr, &lens, (kc, vc), s, o, heads_parallel);
        };
        let mut slices = Vec::with_capacity(tiles.len());
        let (mut rest, mut at) = (out, 0);
        for r in &tiles {
            let (_, tail) = rest.split_at_mut((r.start - at) * q_dim);
            let (mine, tail) = tail.split_at_mut(r.len() * q_dim);
            slices.push(mine);
            (rest, at) = (tail, r.end);
        }
        if parallel {
            tiles.par_iter().zip(slices).for_each(tile);
        } else {
            tiles.iter().zip(slices).for_each(tile);
        }
        return;
    }
    // Few rows over long contexts: every (row, chunk, run of KV heads) its own task, the runs as
    // long as the threads leave them (a block of cache rows then read a run of heads at a time,
    // in order, where a task per head read it in strips a row apart); then each (row, KV head)'s
    // chunks merged.
    let total = items / kv_heads;
    let runs = (2 * threads).div_ceil(total.max(1)).clamp(1, kv_heads);
    let run = kv_heads.div_ceil(runs);
    let runs = kv_heads.div_ceil(run);
    let slots = run * group;
    let cols: Vec<usize> = (0..kv_heads).map(|h| h * hd).collect();
    let mut first = Vec::with_capacity(n + 1);
    let mut work = Vec::new();
    for t in 0..n {
        first.push(work.len());
        work.extend((0..chunks(t)).flat_map(|c| (0..runs).map(move |r| (t, c, r * run))));
    }
    first.push(work.len());
    let mut parts = vec![ChunkPart::default(); work.len() * slots];
    let mut sums = vec![0f32; work.len() * slots * hd];
    parts
        .par_chunks_mut(slots)
        .zip(sums.par_chunks_mut(slots * hd))
        .zip(work.par_iter())
        .for_each(|((part, acc), &(t, c, h0))| {
            if let Some((kc, vc, len)) = caches(t) {
                let h1 = (h0 + run).min(kv_heads);
                let qt = &q[t * q_dim + h0 * group * hd..t * q_dim + h1 * group * hd];
                let used = (h1 - h0) * group;
                let mut scratch = ChunkScratch::default();
                attend_chunk(
                    k,
                    &[qt],
                    &[len],
                    (kc, vc),
                    (&cols[h0..h1], c),
                    hd,
                    s.scale,
                    &mut part[..used],
                    &mut acc[..used * hd],
                    &mut scratch,
                );
            }
        });
    // (Row t, KV head h)'s chunks in order, as `merge_chunks` takes them.
    out.par_chunks_mut(group * hd)
        .enumerate()
        .for_each(|(idx, o)| {
            let (t, h) = (idx / kv_heads, idx % kv_heads);
            let n_chunks = (first[t + 1] - first[t]) / runs;
            if n_chunks == 0 {
                return;
            }
            let mut ps = Vec::with_capacity(n_chunks * group);
            let mut ss = Vec::with_capacity(n_chunks * group * hd);
            for c in 0..n_chunks {
                let w = first[t] + c * runs + h / run;
                let at = w * slots + (h % run) * group;
                ps.extend_from_slice(&parts[at..at + group]);
                ss.extend_from_slice(&sums[at * hd..(at + group) * hd]);
            }
            merge_chunks(&ps, &ss, o);
        });
}

/// One head's partial attention over a chunk of positions.
#[derive(Clone, Copy, Default)]
struct ChunkPart {
    /// The chunk's maximum score.
    max: f32,
    /// Σ exp(score − max) over the chunk.
    sum: f64,
}

/// Buffers a chunk's attention works in, kept across a task's chunks.
#[derive(Default)]
struct ChunkScratch {
    /// Rows of f16/Q8_0 caches decoded to f32.
    block: Vec<f32>,
    /// Each (row, head)'s scores over the chunk, [`CHUNK`] apart.
    scores: Vec<f32>,
    /// A block's scores for the query heads sharing one KV head, as the kernel lays them out.
    tile: Vec<f32>,
}

/// The query heads `q` (`group · hd` values: the heads sharing one KV head) against the first
/// `len` cached positions, into `out` (as many values); `col` is where this KV head's columns
/// start in a cache row. Each key and value row is read once for the whole group (grouped-query
/// attention shares them); every head's arithmetic is what it would be alone.
#[allow(clippy::too_many_arguments)]
pub fn attend(
    k: &Kernels,
    q: &[f32],
    k_cache: &impl KvRows,
    v_cache: &impl KvRows,
    col: usize,
    hd: usize,
    len: usize,
    scale: f32,
    out: &mut [f32],
) {
    let mut scratch = ChunkScratch::default();
    let caches = (k_cache, v_cache);
    attend_head(
        k,
        &[q],
        &[len],
        caches,
        col,
        hd,
        scale,
        &mut [out],
        &mut scratch,
    );
}

/// A tile of rows `q` (all heads of each) attending the first `lens[r]` positions of the same
/// caches, into `out` (as many values): chunk by chunk for each KV head, then each row's chunks
/// merged.
fn attend_tile<K: KvRows + Sync, V: KvRows + Sync>(
    k: &Kernels,
    q: &[f32],
    lens: &[usize],
    caches: (&K, &V),
    s: AttnShape,
    out: &mut [f32],
    heads_parallel: bool,
) {
    use rayon::prelude::*;
    let hd = s.head_dim;
    let q_dim = s.n_heads * hd;
    let kv_heads = s.n_kv_heads.max(1);
    let group = (s.n_heads / kv_heads).max(1);
    // Each KV head's columns of every row of `out`: head h's slices at `per_head[h]`.
    let mut per_head: Vec<Vec<&mut [f32]>> = (0..kv_heads).map(|_| Vec::new()).collect();
    for row in out.chunks_exact_mut(q_dim) {
        for (h, o) in row.chunks_exact_mut(group * hd).enumerate() {
            per_head[h].push(o);
        }
    }
    // Each head on its own: the same results whichever thread computes it (a scratch per
    // thread, reused over its heads).
    let head = |scratch: &mut ChunkScratch, (h, outs): (usize, &mut Vec<&mut [f32]>)| {
        let heads = h * group * hd..(h + 1) * group * hd;
        let qs: Vec<&[f32]> = q.chunks_exact(q_dim).map(|r| &r[heads.clone()]).collect();
        attend_head(k, &qs, lens, caches, h * hd, hd, s.scale, outs, scratch);
    };
    if heads_parallel && kv_heads > 1 {
        let heads = per_head.par_iter_mut().enumerate();
        heads.for_each_init(ChunkScratch::default, head);
    } else {
        let mut scratch = ChunkScratch::default();
        for h in per_head.iter_mut().enumerate() {
            head(&mut scratch, h);
        }
    }
}

/// Rows `qs` (each the `group · hd` values of the heads sharing one KV head, whose columns
/// start at `col` in a cache row) attending the first `lens[r]` positions of the same caches,
/// into `outs[r]`: chunk by chunk, each chunk's key and value rows read once for all the rows
/// that reach it, then each row's chunks merged.
#[allow(clippy::too_many_arguments)]
fn attend_head<K: KvRows, V: KvRows>(
    k: &Kernels,
    qs: &[&[f32]],
    lens: &[usize],
    caches: (&K, &V),
    col: usize,
    hd: usize,
    scale: f32,
    outs: &mut [&mut [f32]],
    scratch: &mut ChunkScratch,
) {
    let group = qs.first().map_or(0, |q| q.len() / hd.max(1));
    let rows = lens.len();
    let chunks: Vec<usize> = lens.iter().map(|l| l.div_ceil(CHUNK)).collect();
    let most = chunks.iter().copied().max().unwrap_or(0);
    // Row r's chunk c at r·most + c: each row's chunks in order, as `merge_chunks` takes them.
    let mut parts = vec![ChunkPart::default(); rows * most * group];
    let mut sums = vec![0f32; rows * most * group * hd];
    let mut part = vec![ChunkPart::default(); rows * group];
    let mut acc = vec![0f32; rows * group * hd];
    for c in 0..most {
        // The rows that reach chunk c.
        let live: Vec<usize> = (0..rows).filter(|&r| chunks[r] > c).collect();
        let live_qs: Vec<&[f32]> = live.iter().map(|&r| qs[r]).collect();
        let ls: Vec<usize> = live.iter().map(|&r| lens[r]).collect();
        let (part, acc) = (
            &mut part[..live.len() * group],
            &mut acc[..live.len() * group * hd],
        );
        attend_chunk(
            k,
            &live_qs,
            &ls,
            caches,
            (&[col], c),
            hd,
            scale,
            part,
            acc,
            scratch,
        );
        for (i, &r) in live.iter().enumerate() {
            let at = (r * most + c) * group;
            parts[at..at + group].copy_from_slice(&part[i * group..(i + 1) * group]);
            sums[at * hd..(at + group) * hd]
                .copy_from_slice(&acc[i * group * hd..(i + 1) * group * hd]);
        }
    }
    for (r, o) in outs.iter_mut().enumerate() {
        let at = r * most * group;
        merge_chunks(
            &parts[at..at + chunks[r] * group],
            &sums[at * hd..(at + chunks[r] * group) * hd],
            o,
        );
    }
}

/// Query rows `qs` over chunk `c` of the (key, value) caches' positions, row r up to `lens[r]`:
/// each row holds, for every KV head whose columns start at `cols[h]`, the `group · hd` values of
/// the query heads sharing it. Each (row, head)'s [`ChunkPart`] goes into `part` and its sum of
/// value rows weighted by exp(score − max) into `acc` (`hd` values a head), rows one after
/// another, heads in order. Key and value rows are read a block at a time, every KV head of a
/// block before the next block (so several heads read a cache row in order, where a task per
/// head walked it in strips a row apart), once for all the rows and heads; each (row, head)
/// computes what it would alone.
#[allow(clippy::too_many_arguments)]
fn attend_chunk<K: KvRows, V: KvRows>(
    k: &Kernels,
    qs: &[&[f32]],
    lens: &[usize],
    (k_cache, v_cache): (&K, &V),
    (cols, c): (&[usize], usize),
    hd: usize,
    scale: f32,
    part: &mut [ChunkPart],
    acc: &mut [f32],
    scratch: &mut ChunkScratch,
) {
    // Query heads a row holds, and how many share each KV head.
    let heads = qs.first().map_or(0, |q| q.len() / hd);
    let group = heads / cols.len().max(1);
    let start = c * CHUNK;
    let ends: Vec<usize> = lens
        .iter()
        .map(|&l| l.min(start + CHUNK).saturating_sub(start))
        .collect();
    let width = ends.iter().copied().max().unwrap_or(0);
    // The run of KV heads' columns (`cols` ascend, `hd` apart): each block of rows decoded once
    // for all of them.
    let run = match (cols.first(), cols.last()) {
        (Some(&first), Some(&last)) => (first, last + hd - first),
        _ => return,
    };
    // The query heads sharing each KV head of the run, row by row: head h's at
    // h·per_head.., its (row r, query head g) at r·group + g there.
    let per_head = qs.len() * group;
    let mut queries: Vec<&[f32]> = Vec::with_capacity(cols.len() * per_head);
    for h in 0..cols.len() {
        for q in qs {
            queries.extend(q[h * group * hd..(h + 1) * group * hd].chunks_exact(hd));
        }
    }
    scratch.block.resize(ROWS * run.1, 0.0);
    scratch.scores.resize(qs.len() * heads * CHUNK, 0.0);
    scratch.tile.resize(per_head * ROWS, 0.0);
    let (block, scores, tile) = (&mut scratch.block, &mut scratch.scores, &mut scratch.tile);
    let lone = qs.len() == 1;
    let (keys, values) = (InPlace::of(k_cache, lone), InPlace::of(v_cache, lone));
    // A lone row (a decode step: little arithmetic per byte) asks for every key and value row
    // of the chunk at once, into L2, before it reads any: a cold pass between two layers has
    // pushed the cache out of every level, and hints a block ahead of use kept too few lines in
    // flight (SmolLM2 hybrid at 48M, its attention over 128-192 positions: 20.4-22.0 µs a layer
    // against 22.6-24.2). Rows read in place, or by a tile of a prompt's rows, are slower with
    // the hints.
    if lone {
        let hinted = |c: &Option<InPlace>| !matches!(c, Some(InPlace::F32(..)));
        for &col in cols {
            if hinted(&keys) {
                k_cache.prefetch(start..start + width, col, hd);
            }
            if hinted(&values) {
                v_cache.prefetch(start..start + width, col, hd);
            }
        }
    }
    // A lone row over rows read in place (f32, or f16 widened as loaded) takes each KV head's
    // chunk in one call of each kernel; any other row goes a block at a time, reading only f32
    // rows in place.
    let direct = if lone { keys.zip(values) } else { None };
    let (keys, values) = (keys.and_then(InPlace::f32), values.and_then(InPlace::f32));
    if let Some((kr, _)) = direct {
        tile.resize(per_head * width, 0.0);
        lone_scores(
            k,
            &queries,
            (kr, cols),
            (start, width),
            hd,
            scale,
            (tile, scores),
        );
    } else {
        // (Row r, head i)'s scores at (r·heads + i)·CHUNK. Key rows a block at a time, each block
        // scored for every row and head that reaches it.
        for j0 in (0..width).step_by(ROWS) {
            let j1 = (j0 + ROWS).min(width);
            let block_run = KvRun::of(keys, k_cache, start + j0..start + j1, run, block);
            for (h, &col) in cols.iter().enumerate() {
                // Every query head sharing this KV head against the whole block (a row that ends
                // inside it computes a few scores it leaves: only where a tile's rows meet their
                // own positions), then each row's own scaled into place.
                let w = j1 - j0;
                let tile = &mut tile[..per_head * w];
                let qh = &queries[h * per_head..(h + 1) * per_head];
                (k.scores)(qh, &block_run.head(col, hd)[..w], tile);
                for (r, &end) in ends.iter().enumerate() {
                    let m = end.saturating_sub(j0).min(w);
                    for g in 0..group {
                        let from = &tile[(r * group + g) * w..][..m];
                        let s = &mut scores[(r * heads + h * group + g) * CHUNK + j0..][..m];
                        s.iter_mut().zip(from).for_each(|(s, &v)| *s = v * scale);
                    }
                }
            }
        }
    }
    for (i, p) in part.iter_mut().enumerate() {
        let s = &mut scores[i * CHUNK..][..ends[i / heads.max(1)]];
        let max = s.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        *p = ChunkPart {
            max,
            sum: (k.exp_sum)(s, max),
        };
    }
    acc.fill(0.0);
    if let Some((_, vr)) = direct {
        lone_values(k, (vr, cols), (start, width), hd, scores, acc);
        return;
    }
    // Value rows a block at a time, each head's sum held in registers across the block.
    for j0 in (0..width).step_by(ROWS) {
        let j1 = (j0 + ROWS).min(width);
        let block_run = KvRun::of(values, v_cache, start + j0..start + j1, run, block);
        for (h, &col) in cols.iter().enumerate() {
            let block_rows = block_run.head(col, hd);
            for (r, &end) in ends.iter().enumerate() {
                let m = end.saturating_sub(j0).min(j1 - j0);
                if m == 0 {
                    continue;
                }
                for g in 0..group {
                    let i = r * heads + h * group + g;
                    let (a, w) = (
                        &mut acc[i * hd..(i + 1) * hd],
                        &scores[i * CHUNK + j0..][..m],
                    );
                    (k.axpy_rows)(a, w, &block_rows[..m]);
                }
            }
        }
    }
}

/// Rows `js` of a cache read in place, as [`row_at`] gives each.
fn rows_at<T>(
    v: &[T],
    stride: usize,
    js: std::ops::Range<usize>,
    col: usize,
    hd: usize,
) -> Vec<&[T]> {
    js.map(|j| row_at(v, stride, j, col, hd)).collect()
}

/// [`attend_chunk`]'s scores for a lone row over key rows read in place, positions `start..`
/// (`width` of them): each KV head's query heads (`queries`, `group` a head, in `cols`' order)
/// against the chunk's rows in one call, scaled into `scores` (head `i` at `i·CHUNK`). The
/// kernels take each (query, key) product alone, so the same bits as block by block.
fn lone_scores(
    k: &Kernels,
    queries: &[&[f32]],
    (keys, cols): (InPlace, &[usize]),
    (start, width): (usize, usize),
    hd: usize,
    scale: f32,
    (tile, scores): (&mut [f32], &mut [f32]),
) {
    let group = queries.len() / cols.len().max(1);
    let js = start..start + width;
    for (h, &col) in cols.iter().enumerate() {
        let qh = &queries[h * group..(h + 1) * group];
        let tile = &mut tile[..group * width];
        match keys {
            InPlace::F32(v, stride) => {
                (k.scores)(qh, &rows_at(v, stride, js.clone(), col, hd), tile)
            }
            InPlace::F16(v, stride) => {
                (k.scores_f16)(qh, &rows_at(v, stride, js.clone(), col, hd), tile)
            }
        }
        for g in 0..group {
            let s = &mut scores[(h * group + g) * CHUNK..][..width];
            let from = &tile[g * width..][..width];
            s.iter_mut().zip(from).for_each(|(s, &v)| *s = v * scale);
        }
    }
}

/// [`attend_chunk`]'s weighted sums for a lone row over value rows read in place: each query
/// head's `hd` values of `acc` (zeroed) plus its weights (`scores`, head `i` at `i·CHUNK`) times
/// the chunk's rows, in one call a head. The kernels add the rows in order into `acc` as
/// loaded, so the same bits as block by block.
fn lone_values(
    k: &Kernels,
    (values, cols): (InPlace, &[usize]),
    (start, width): (usize, usize),
    hd: usize,
    scores: &[f32],
    acc: &mut [f32],
) {
    let group = acc.len() / hd.max(1) / cols.len().max(1);
    let js = start..start + width;
    for (h, &col) in cols.iter().enumerate() {
        let rows = match values {
            InPlace::F32(v, stride) => HeadVec::F32(rows_at(v, stride, js.clone(), col, hd)),
            InPlace::F16(v, stride) => HeadVec::F16(rows_at(v, stride, js.clone(), col, hd)),
        };
        for g in 0..group {
            let i = h * group + g;
            let (a, w) = (
                &mut acc[i * hd..(i + 1) * hd],
                &scores[i * CHUNK..][..width],
            );
            match &rows {
                HeadVec::F32(rows) => (k.axpy_rows)(a, w, rows),
                HeadVec::F16(rows) => (k.axpy_rows_f16)(a, w, rows),
            }
        }
    }
}

/// A head's rows of a chunk read in place, as the kernels take them.
enum HeadVec<'a> {
    F32(Vec<&'a [f32]>),
    F16(Vec<&'a [f16]>),
}

/// The chunks' parts (chunk by chunk, a part per head) and weighted sums (`hd` values per head)
/// merged into each head's attention output (`out`, heads × `hd`): weights rescaled to the
/// largest maximum, chunks added in order, the total divided out last.
fn merge_chunks(parts: &[ChunkPart], sums: &[f32], out: &mut [f32]) {
    out.fill(0.0);
    if parts.is_empty() {
        return;
    }
    let hd = sums.len() / parts.len();
    let heads = out.len() / hd.max(1);
    for (g, o) in out.chunks_exact_mut(hd).enumerate() {
        let head = parts.iter().skip(g).step_by(heads);
        let max = head.clone().fold(f32::NEG_INFINITY, |m, p| m.max(p.max));
        let mut den = 0f64;
        for (c, p) in head.enumerate() {
            let a = (p.max - max).exp();
            den += a as f64 * p.sum;
            let acc = &sums[(c * heads + g) * hd..][..hd];
            o.iter_mut().zip(acc).for_each(|(o, &v)| *o += a * v);
        }
        let inv = (1.0 / den) as f32;
        o.iter_mut().for_each(|v| *v *= inv);
    }
}

#[cfg(test)]
mod tests {
    use super::super::kernels;
    use super::*;
    use crate::backend::cpu::CpuKv;

    #[test]
    fn attention_over_one_position_returns_its_value() {
        let mut k = CpuKv::new(2, 2, crate::backend::KvType::F32).unwrap();
        k.write(0, &[1.0, 0.0, 9.0, 9.0]).unwrap();
        let mut v = CpuKv::new(2, 2, crate::backend::KvType::F32).unwrap();
        v.write(0, &[3.0, 4.0, 9.0, 9.0]).unwrap();
        let mut out = [0f32; 2];
        attend(
            super::super::kernels::best(),
            &[1.0, 1.0],
            &k,
            &v,
            0,
            2,
            1,
            1.0,
            &mut out,
        );
        assert_eq!(out, [3.0, 4.0]);
    }

    /// Asking for a cache's first chunk ahead changes nothing an attention then reads, however
    /// many positions are asked for (none, past the cache) and in any cache type.
    #[test]
    fn prefetched_caches_attend_alike() {
        for ty in [crate::backend::KvType::F32, crate::backend::KvType::F16] {
            let mut k = CpuKv::new(3, 2, ty).unwrap();
            k.write(0, &[1.0, 0.0, 0.5, 2.0, 9.0, 9.0]).unwrap();
            let mut v = CpuKv::new(3, 2, ty).unwrap();
            v.write(0, &[3.0, 4.0, -1.0, 0.25, 9.0, 9.0]).unwrap();
            let run = |k: &CpuKv, v: &CpuKv| {
                let mut out = [0f32; 2];
                attend(kernels::best(), &[1.0, 1.0], k, v, 0, 2, 2, 0.5, &mut out);
                out.map(f32::to_bits)
            };
            let want = run(&k, &v);
            for rows in [0, 2, 3, 1000] {
                prefetch_first_chunk([(&k, 2), (&v, 2)], rows);
                assert_eq!(run(&k, &v), want, "{ty:?}, {rows} rows asked for");
            }
        }
    }

    /// The query heads sharing a KV head, attended together, get what each gets alone, bit for
    /// bit (f32 and f16 caches, lengths across the value-row blocks).
    #[test]
    fn grouped_heads_equal_each_head_alone() {
        use rand::{RngExt, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let (hd, kv_heads, group) = (64, 2, 3);
        let cols = kv_heads * hd;
        for ty in [crate::backend::KvType::F32, crate::backend::KvType::F16] {
            for len in [1usize, 16, 37] {
                let mut rand = |n: usize| -> Vec<f32> {
                    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
                };
                let (kr, vr, q) = (rand(len * cols), rand(len * cols), rand(group * hd));
                let mut k = CpuKv::new(len, cols, ty).unwrap();
                let mut v = CpuKv::new(len, cols, ty).unwrap();
                k.write(0, &kr).unwrap();
                v.write(0, &vr).unwrap();
                let kernels = super::super::kernels::best();
                let mut together = vec![0f32; group * hd];
                attend(kernels, &q, &k, &v, hd, hd, len, 0.125, &mut together);
                for g in 0..group {
                    let mut alone = vec![0f32; hd];
                    let qh = &q[g * hd..(g + 1) * hd];
                    attend(kernels, qh, &k, &v, hd, hd, len, 0.125, &mut alone);
                    assert!(
                        alone == together[g * hd..(g + 1) * hd],
                        "{ty:?} len {len}: head {g}"
                    );
                }
            }
        }
    }

    /// Attention over long contexts in chunks: a row alone (its chunks shared out over the
    /// threads, or in one task without them), the same row in a tile of a prompt's rows, and the
    /// rows of two sequences interleaved give the same bits; and they are softmax attention
    /// computed in f64 to 1e-5.
    #[test]
    fn chunked_attention_is_the_same_however_the_work_is_shared() {
        use rand::{RngExt, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let kernels = super::super::kernels::best();
        use crate::backend::KvType;
        // Three KV heads: a long row's tasks take runs of heads that do not divide them.
        for (kv_heads, ty) in [(2, KvType::F32), (2, KvType::F16), (3, KvType::Q8_0)] {
            let s = AttnShape {
                n_heads: 6,
                n_kv_heads: kv_heads,
                head_dim: 32,
                scale: 0.3,
            };
            let (hd, cols, q_dim, group) = (32, 32 * kv_heads, 192, 6 / kv_heads);
            for len in [1usize, CHUNK, CHUNK + 1, 3 * CHUNK + 77] {
                let mut rand = |n: usize| -> Vec<f32> {
                    (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect()
                };
                let cache = |vals: &[f32]| {
                    let mut c = CpuKv::new(len, cols, ty).unwrap();
                    c.write(0, vals).unwrap();
                    c
                };
                let (k, v) = (cache(&rand(len * cols)), cache(&rand(len * cols)));
                let (k2, v2) = (cache(&rand(len * cols)), cache(&rand(len * cols)));
                // 40 rows of a prompt, row t attending fewer positions the further it is.
                let rows = 40;
                let q = rand(rows * q_dim);
                let lens = |t: usize| len.saturating_sub(t * 23).max(1);
                let caches = |t: usize| Some((&k, &v, lens(t)));
                let mut many = vec![0f32; rows * q_dim];
                pool.install(|| attend_each(kernels, &q, caches, s, &mut many, true));
                let mut serial = vec![0f32; rows * q_dim];
                attend_each(kernels, &q, caches, s, &mut serial, false);
                assert_eq!(many, serial, "{ty:?} len {len}");
                // Two sequences' rows interleaved (no tile spans both); each row as it is alone.
                let mixed = |t: usize| {
                    Some(if t.is_multiple_of(2) {
                        (&k, &v, lens(t))
                    } else {
                        (&k2, &v2, lens(t))
                    })
                };
                let mut both = vec![0f32; rows * q_dim];
                pool.install(|| attend_each(kernels, &q, mixed, s, &mut both, true));
                for t in [0, 1, 9, 17, rows - 1] {
                    let qt = &q[t * q_dim..(t + 1) * q_dim];
                    for (whole, what, c) in
                        [(&many, "prompt", caches(t)), (&both, "mixed", mixed(t))]
                    {
                        let one = |_: usize| c;
                        let mut alone = vec![0f32; q_dim];
                        pool.install(|| attend_each(kernels, qt, one, s, &mut alone, true));
                        let mut alone_serial = vec![0f32; q_dim];
                        attend_each(kernels, qt, one, s, &mut alone_serial, false);
                        assert_eq!(alone, alone_serial, "{ty:?} len {len} row {t} ({what})");
                        assert_eq!(
                            alone[..],
                            whole[t * q_dim..(t + 1) * q_dim],
                            "{ty:?} len {len} row {t} ({what})"
                        );
                    }
                }
                // Row 0 against softmax attention in f64 over the cache's own values.
                let (mut kt, mut vt) = (vec![0f32; hd], vec![0f32; hd]);
                for h in 0..s.n_heads {
                    let col = (h / group) * hd;
                    let qh = &q[h * hd..(h + 1) * hd];
                    let sc: Vec<f64> = (0..len)
                        .map(|j| {
                            let kj = k.slice(j, col, &mut kt);
                            qh.iter()
                                .zip(kj)
                                .map(|(a, b)| *a as f64 * *b as f64)
                                .sum::<f64>()
                                * s.scale as f64
                        })
                        .collect();
                    let m = sc.iter().cloned().fold(f64::MIN, f64::max);
                    let den: f64 = sc.iter().map(|x| (x - m).exp()).sum();
                    for i in 0..hd {
                        let want: f64 = (0..len)
                            .map(|j| (sc[j] - m).exp() / den * v.slice(j, col, &mut vt)[i] as f64)
                            .sum();
                        let got = many[h * hd + i] as f64;
                        assert!(
                            (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                            "{ty:?} len {len} head {h}[{i}]: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}
