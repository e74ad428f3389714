//! What the Q8_0/Q4_0/Q4_1 dots of every SIMD set share: the formats' block sizes, the
//! arithmetic each result follows, and the many-row driver (rows in groups of a register's
//! lanes, tokens in tiles).
//!
//! Every kernel of these formats, one row or many, on either set, computes a result the same
//! way, so that it never depends on the rows or tokens computed beside it, nor on the CPU: for
//! each block in order, the exact integer sum Σ code·x (codes as the format means them), then
//! `acc = fma(d_w·d_x, sum, acc)` and, for Q4_1, `acc = fma(m_w, s_x, acc)`.

use super::activations::{ActBlock, TokenBlocks};

/// Weight formats of these kernels.
pub(super) const Q8: u8 = 0;
pub(super) const Q40: u8 = 1;
pub(super) const Q41: u8 = 2;

pub(super) const fn block_bytes(kind: u8) -> usize {
    match kind {
        Q8 => 34,
        Q40 => 18,
        _ => 20,
    }
}

/// The f16 at `p` (little-endian), read by the caller's own means (`half`'s software path is
/// slow where F16C is at hand).
pub(super) type F16At = unsafe fn(*const u8) -> f32;

/// One block's step of a one-row dot: `sum` (the block's exact Σ code·x) scaled into `acc`.
///
/// # Safety
/// `p` points at a whole block of `KIND`; `half` may be called on it.
#[inline(always)]
pub(super) unsafe fn block_step<const KIND: u8>(
    acc: f32,
    p: *const u8,
    sum: i32,
    a: &ActBlock,
    half: F16At,
) -> f32 {
    // SAFETY: the block's scale (and Q4_1's min) are its first bytes.
    let (d, m) = unsafe { (half(p), if KIND == Q41 { half(p.add(2)) } else { 0.0 }) };
    let acc = (d * a.d).mul_add(sum as f32, acc);
    if KIND == Q41 {
        m.mul_add(a.s, acc)
    } else {
        acc
    }
}

/// The tile a many-row kernel computes: `LANES` rows (pointers to their first block), `tokens`
/// tokens of `nb` blocks each from `x`, into `out[t·LANES + lane]`; `next` is prefetched on
/// the way.
pub(super) type Tile<const LANES: usize> =
    unsafe fn(&[*const u8; LANES], *const ActBlock, usize, usize, &mut [f32], &[u8]);

/// The most sums a tile writes (AVX-512: 16 rows × 8 tokens).
const MAX_TILE_SUMS: usize = 128;

/// A set's many-row kernel for one format: the format, the token counts its tile takes
/// (descending, ending in 1), and the tile.
pub(super) struct Tiles<const LANES: usize> {
    pub(super) kind: u8,
    pub(super) tokens: &'static [usize],
    pub(super) tile: Tile<LANES>,
}

/// The many-row driver: `out[r·n + j] = rows[r] · x[t0 + j]`, rows in groups of `LANES`
/// (lanes past a group's last row repeat it: computed, never stored), tokens in tiles of the
/// largest count `k` takes that fits, each through `k`'s tile. `next` is shared out among the
/// groups to prefetch.
///
/// # Safety
/// `k.tile` must be safe to call on this CPU; it is given whole rows and tokens (asserted
/// here).
pub(super) unsafe fn dots<const LANES: usize>(
    k: &Tiles<LANES>,
    rows: &[&[u8]],
    x: &TokenBlocks,
    t0: usize,
    out: &mut [f32],
    next: &[u8],
) {
    let (kind, tiles, tile) = (k.kind, k.tokens, k.tile);
    let n = out.len() / rows.len().max(1);
    let nb = x.per_token;
    assert!(
        rows.iter().all(|r| r.len() == nb * block_bytes(kind))
            && out.len() == rows.len() * n
            && t0 + n <= x.tokens(),
        "dots: {} rows, {nb} blocks per token, tokens {t0}+{n} of {}",
        rows.len(),
        x.tokens()
    );
    let groups = rows.len().div_ceil(LANES);
    let share = next.len().div_ceil(groups.max(1));
    for (g, group) in rows.chunks(LANES).enumerate() {
        let rp: [*const u8; LANES] =
            std::array::from_fn(|i| group[i.min(group.len() - 1)].as_ptr());
        let ahead = &next[(g * share).min(next.len())..((g + 1) * share).min(next.len())];
        let out = &mut out[g * LANES * n..(g * LANES + group.len()) * n];
        // SAFETY: whole rows of nb blocks, and tokens t0 .. t0 + n of nb blocks each (asserted
        // above).
        group_tokens::<LANES>(tiles, x, (t0, n), out, |tt, xb, sums, ahead_t| unsafe {
            let ahead = if ahead_t { ahead } else { &[] };
            tile(&rp, xb, nb, tt, sums, ahead)
        });
    }
}

/// A set's many-row kernel over rows laid out in tiles (`tiles::tile_rows`): the format, the
/// token counts its tile takes (as [`Tiles`]), the tile, given the tile's first byte, and its
/// one-token tile over whole tiles in one call (tiles, a token's blocks, blocks a row, 16
/// results a tile): the same arithmetic. Nothing is prefetched ([`super::TiledFn`]).
pub(super) struct TiledKernel {
    pub(super) kind: u8,
    pub(super) tokens: &'static [usize],
    pub(super) tile: unsafe fn(*const u8, *const ActBlock, usize, usize, &mut [f32]),
    pub(super) one_token: unsafe fn(&[u8], *const ActBlock, usize, &mut [f32]),
}

/// The many-row driver over whole tiles of `LANES` rows (`tiles`: their bytes): as [`dots`],
/// each tile's rows through `k`'s tile.
///
/// # Safety
/// `k.tile` must be safe to call on this CPU; it is given whole tiles and tokens (asserted
/// here).
pub(super) unsafe fn dots_tiled<const LANES: usize>(
    k: &TiledKernel,
    tiles: &[u8],
    x: &TokenBlocks,
    t0: usize,
    out: &mut [f32],
) {
    let nb = x.per_token;
    let span = LANES * nb * block_bytes(k.kind);
    let groups = tiles.len() / span.max(1);
    let n = out.len() / (groups * LANES).max(1);
    assert!(
        span > 0
            && tiles.len() == groups * span
            && out.len() == groups * LANES * n
            && t0 + n <= x.tokens(),
        "dots_tiled: {} bytes of tiles of {span}, {nb} blocks per token, tokens {t0}+{n} of {}",
        tiles.len(),
        x.tokens()
    );
    if n == 0 {
        return;
    }
    if n == 1 {
        // SAFETY: whole tiles, token t0's nb blocks, 16 results a tile (asserted above).
        unsafe { (k.one_token)(tiles, x.blocks[t0 * nb..].as_ptr(), nb, out) };
        return;
    }
    for (tile, out) in tiles
        .chunks_exact(span)
        .zip(out.chunks_exact_mut(LANES * n))
    {
        // SAFETY: a whole tile of nb blocks a row, and tokens t0 .. t0 + n (asserted above).
        group_tokens::<LANES>(k.tokens, x, (t0, n), out, |tt, xb, sums, _| unsafe {
            (k.tile)(tile.as_ptr(), xb, nb, tt, sums)
        });
    }
}

/// One group's rows (`out`: `n` results a row, its rows in order) against tokens
/// `t0 .. t0 + n` of `x`, in tiles of the largest count in `tiles` that fits: `tile(count,
/// the first token's blocks, sums, whether it is the first tile)` writes
/// `sums[t·LANES + lane]`.
fn group_tokens<const LANES: usize>(
    tiles: &[usize],
    x: &TokenBlocks,
    (t0, n): (usize, usize),
    out: &mut [f32],
    mut tile: impl FnMut(usize, *const ActBlock, &mut [f32], bool),
) {
    let nb = x.per_token;
    if n == 1 && out.len() == LANES {
        // One token over a whole group: the tile's sums are the rows' results in order.
        tile(1, x.blocks[t0 * nb..].as_ptr(), out, true);
        return;
    }
    // On the stack: this runs for every tile of rows of every product.
    let mut sums = [0f32; MAX_TILE_SUMS];
    assert!(
        LANES * tiles[0] <= MAX_TILE_SUMS,
        "a tile of {LANES} × {} sums",
        tiles[0]
    );
    let mut t = 0;
    while t < n {
        let tt = tiles.iter().copied().find(|&s| s <= n - t).unwrap_or(1);
        tile(tt, x.blocks[(t0 + t) * nb..].as_ptr(), &mut sums, t == 0);
        for (i, o) in out.chunks_exact_mut(n).enumerate() {
            for (j, v) in o[t..t + tt].iter_mut().enumerate() {
                *v = sums[j * LANES + i];
            }
        }
        t += tt;
    }
}
