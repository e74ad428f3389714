//! Gated f16 bundles laid out in tiles of [`TILE_NEURONS`] neurons ([`NeuronTiles`]), and the
//! one-pass FFN over them ([`tiled_ffn`], [`tiled_down`]): the sums [`super::sparse_ffn`] and
//! [`super::sparse_down`] give over the same neurons as bundles, bit for bit.
//!
//! A tile holds its neurons' gates, then their ups, then their downs (a part each); within a
//! part, chunk after chunk of [`TILE_COLS`] columns, each chunk the four rows' lines side by
//! side. So the pass reads a tile as one run from its first line to its last, where bundles or
//! parts taken apart are a run per row (four at once): on the 2-core VM, 30 SmolLM2 layers
//! (1,536 neurons, 84% on, 2 threads, out of tree) took 4.06–4.28 ms in tiles against
//! 4.95–5.01 as whole bundles, alternated in the same minutes. The price: a tile is read whole
//! wherever one of its neurons is on, so the planner lays a layer out in tiles only where most
//! of its cold neurons are on (its `TILES_READ_FASTER`).

use std::ops::Range;
use std::sync::atomic::Ordering;

use half::f16;

use super::bundle::{Bundles, check_x_h, err};
use super::down::{add_in_order, block_runs};
use super::ffn::run_listed;
use super::ops::{Axpy4Tiled, Dot4Tiled, Ops, TILE_COLS, TILE_NEURONS, TileRow};
use super::vector::{Vector, axpy4, dot4, ops};
use crate::backend::cpu::kernels::Kernels;
use crate::backend::{IN_REST, Result};

/// Parts of a gated bundle: gate, up, down.
const PARTS: usize = 3;

/// Whether bundles of `parts` parts of width `d` in `dtype` can be laid out in tiles.
pub fn tileable(dtype: crate::tensor::DType, parts: usize, d: usize) -> bool {
    dtype == crate::tensor::DType::F16 && parts == PARTS && d > 0 && d.is_multiple_of(TILE_COLS)
}

/// Bytes of the tiles that hold `neurons` neurons of width `d` (the last tile padded with
/// zero rows).
pub fn tiles_bytes(neurons: usize, d: usize) -> usize {
    neurons.div_ceil(TILE_NEURONS) * TILE_NEURONS * PARTS * d * 2
}

/// Where value `c` of row `r` of a part lies in it (in f16s).
fn at(r: usize, c: usize) -> usize {
    (c / TILE_COLS) * TILE_COLS * TILE_NEURONS + r * TILE_COLS + c % TILE_COLS
}

/// Gated f16 bundles `rows` of `bytes` (rows of `rb` bytes: gate, up and down of width `d`)
/// laid out in tiles, in the order listed. `d` and the bundles must be [`tileable`]
/// (`rb = 3·2·d`).
pub fn tile_bundles(bytes: &[u8], rb: usize, rows: &[u32], d: usize) -> Vec<u8> {
    assert!(
        rb == PARTS * 2 * d && d.is_multiple_of(TILE_COLS),
        "bundles not tileable"
    );
    let part_bytes = TILE_NEURONS * d * 2;
    let mut out = vec![0u8; tiles_bytes(rows.len(), d)];
    for (i, &row) in rows.iter().enumerate() {
        let (tile, r) = (i / TILE_NEURONS, i % TILE_NEURONS);
        let src = &bytes[row as usize * rb..(row as usize + 1) * rb];
        for p in 0..PARTS {
            let part = &mut out[(tile * PARTS + p) * part_bytes..][..part_bytes];
            for (c, line) in src[p * d * 2..(p + 1) * d * 2]
                .chunks_exact(TILE_COLS * 2)
                .enumerate()
            {
                let o = at(r, c * TILE_COLS) * 2;
                part[o..o + line.len()].copy_from_slice(line);
            }
        }
    }
    out
}

/// A part of a neuron's bundle.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Part {
    Gate = 0,
    Up = 1,
    Down = 2,
}

/// Neurons laid out in tiles ([`tile_bundles`]): neuron `i` is row `i % 4` of tile `i / 4`.
#[derive(Clone, Copy, Debug)]
pub struct NeuronTiles<'a> {
    halves: &'a [f16],
    neurons: usize,
    d: usize,
}

impl<'a> NeuronTiles<'a> {
    /// The tiles in `bytes` of `neurons` neurons of width `d`, checked.
    pub fn new(bytes: &'a [u8], neurons: usize, d: usize) -> Result<Self> {
        let op = "NeuronTiles";
        if !d.is_multiple_of(TILE_COLS) || d == 0 {
            return Err(err(
                op,
                format!("width {d} is not a multiple of {TILE_COLS}"),
            ));
        }
        if bytes.len() != tiles_bytes(neurons, d) {
            return Err(err(
                op,
                format!(
                    "{} bytes for the tiles of {neurons} neurons of width {d} ({})",
                    bytes.len(),
                    tiles_bytes(neurons, d)
                ),
            ));
        }
        let halves = bytemuck::try_cast_slice(bytes)
            .map_err(|e| err(op, format!("the tiles are not f16s in place: {e}")))?;
        Ok(NeuronTiles { halves, neurons, d })
    }

    /// Row `i`'s place: its tile's part `p` and its row there.
    fn row(&self, i: usize, p: Part) -> TileRow<'a> {
        let len = TILE_NEURONS * self.d;
        let tile = i / TILE_NEURONS;
        TileRow::in_tile(
            &self.halves[(tile * PARTS + p as usize) * len..][..len],
            i % TILE_NEURONS,
        )
    }

    /// Part `p` of neuron `i` as a row of its own.
    fn row_values(&self, i: usize, p: Part) -> Vec<f16> {
        let row = self.row(i, p);
        (0..self.d).map(|c| row.part[at(row.place, c)]).collect()
    }
}

/// The neurons a tiled walk lists: rows of tiles, or a cache unit's slots (gated f16 bundles)
/// beside the tiles its other neurons rest in, an entry with [`IN_REST`] naming a row of the
/// tiles and one without a slot. The unit's in-place neurons are then read a tile at a time,
/// as hybrid's cold pass reads its own (SmolLM2's units at 48M, budgeted device: the slots and
/// rows walked four rows at a time read their neurons at 9 GB/s where tiles read 20).
#[derive(Clone, Copy)]
pub struct TiledList<'a> {
    tiles: NeuronTiles<'a>,
    slots: Option<Bundles<'a>>,
}

impl<'a> From<NeuronTiles<'a>> for TiledList<'a> {
    fn from(tiles: NeuronTiles<'a>) -> Self {
        TiledList { tiles, slots: None }
    }
}

/// Where a listed entry's neuron lies.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Place {
    Tile(usize),
    Slot(usize),
}

impl Place {
    /// The row it names, of the tiles or of the slots.
    fn row(self) -> usize {
        match self {
            Place::Tile(i) | Place::Slot(i) => i,
        }
    }
}

impl<'a> TiledList<'a> {
    /// `slots` (gated f16 bundles as wide as the tiles) beside `tiles`, checked.
    pub fn with_slots(slots: Bundles<'a>, tiles: NeuronTiles<'a>) -> Result<Self> {
        if !slots.is_f16() || slots.shape.parts != PARTS || slots.shape.d != tiles.d {
            return Err(err(
                "TiledList",
                format!(
                    "slots of {}×{} beside tiles of gated f16 bundles of {}",
                    slots.shape.parts, slots.shape.d, tiles.d
                ),
            ));
        }
        Ok(TiledList {
            tiles,
            slots: Some(slots),
        })
    }

    fn place(&self, e: u32) -> Place {
        match self.slots {
            Some(_) if e & IN_REST == 0 => Place::Slot(e as usize),
            _ => Place::Tile((e & !IN_REST) as usize),
        }
    }

    fn check_idx(&self, op: &'static str, idx: &[u32]) -> Result<()> {
        let slots = self.slots.as_ref().map_or(0, |s| s.neurons);
        let bad = idx.iter().find(|&&e| match self.place(e) {
            Place::Tile(i) => i >= self.tiles.neurons,
            Place::Slot(i) => i >= slots,
        });
        match bad.map(|&e| self.place(e)) {
            Some(Place::Tile(i)) => Err(err(
                op,
                format!("neuron {i} of {} in tiles", self.tiles.neurons),
            )),
            Some(Place::Slot(i)) => Err(err(op, format!("slot {i} of {slots}"))),
            None => Ok(()),
        }
    }
}

/// The four-row sums over tile rows: the tiles' own kernels, or (portable) each row copied out
/// and summed as a row of bundles is; over slots, the row kernels.
#[derive(Clone, Copy)]
struct TileOps<'a> {
    k: &'a Kernels,
    o: &'static Ops,
    list: TiledList<'a>,
}

/// Four rows of one part, found once for every token that reads them: where the tiles keep
/// them, with the tiles' kernels, or (portable) copied out, with the row kernels.
enum FourRows<'a> {
    Tiles {
        rows: [TileRow<'a>; 4],
        dot: Dot4Tiled,
        axpy: Axpy4Tiled,
    },
    Copied {
        rows: [Vec<f16>; 4],
        k: &'a Kernels,
        o: &'static Ops,
    },
    Slots {
        rows: [Vector<'a>; 4],
        k: &'a Kernels,
        o: &'static Ops,
    },
}

impl<'a> TileOps<'a> {
    /// Part `p` of the neurons of entries `es` (one group's: those in tiles all in one, beside
    /// any in slots).
    fn rows(&self, es: [u32; 4], p: Part) -> FourRows<'a> {
        let slots = self.list.slots.as_ref();
        let places = es.map(|e| self.list.place(e));
        if let Some(slots) = slots.filter(|_| places.iter().all(|q| matches!(q, Place::Slot(_)))) {
            let part = |q: Place| slots.part(q.row(), p as usize);
            return FourRows::Slots {
                rows: places.map(part),
                k: self.k,
                o: self.o,
            };
        }
        let tiles = self.list.tiles;
        // A slot's part as a row of its own (slots are f16 as the tiles are: `with_slots`).
        let slot = |q: Place| match (q, slots) {
            (Place::Slot(i), Some(s)) => Some(s.part_f16(i, p as usize)),
            _ => None,
        };
        match (self.o.dot4_tiled, self.o.axpy4_tiled) {
            (Some(dot), Some(axpy)) => FourRows::Tiles {
                rows: places.map(|q| match slot(q) {
                    Some(row) => TileRow::alone(row),
                    None => tiles.row(q.row(), p),
                }),
                dot,
                axpy,
            },
            _ => FourRows::Copied {
                rows: places.map(|q| match slot(q) {
                    Some(row) => row.to_vec(),
                    None => tiles.row_values(q.row(), p),
                }),
                k: self.k,
                o: self.o,
            },
        }
    }
}

impl FourRows<'_> {
    /// `[rows[q] · x]` for the first `live` (the rest repeat a live one); the lines after them
    /// asked for where `ahead` (a step's first token).
    fn dot4(&self, live: usize, x: &[f32], ahead: bool) -> [f32; 4] {
        match self {
            FourRows::Tiles { rows, dot, .. } => dot(*rows, x, ahead),
            FourRows::Copied { rows, k, o } => {
                let vs = [0, 1, 2, 3].map(|q| Vector::F16(&rows[q]));
                dot4(k, o, vs, vs, live, x)
            }
            FourRows::Slots { rows, k, o } => dot4(k, o, *rows, *rows, live, x),
        }
    }

    /// `out += Σ_q a[q] · rows[q]` in the order of `q` (`a = 0` past `live`); `ahead` as for
    /// [`Self::dot4`].
    fn axpy4(&self, a: [f32; 4], live: usize, out: &mut [f32], ahead: bool) {
        match self {
            FourRows::Tiles { rows, axpy, .. } => axpy(a, *rows, out, ahead),
            FourRows::Copied { rows, o, .. } => {
                let vs = [0, 1, 2, 3].map(|q| Vector::F16(&rows[q]));
                axpy4(o, a, vs, vs, live, out)
            }
            FourRows::Slots { rows, o, .. } => axpy4(o, a, *rows, *rows, live, out),
        }
    }
}

/// Where the run of `js` that starts at list position `j` ends: up to four positions, those
/// whose neurons (`idx`) lie in tiles all in one and ascending there, beside any in slots. A
/// run's rows are read in one pass of the four-row kernels, in list order: a tile's lines as
/// one stream, a slot's row beside them. (A unit's slots stand among the neurons resting in
/// tiles, one of a tile's four in a tenth of them: SmolLM2's units at 48M. Runs cut where a
/// slot stands read a tile in two or three passes, each computing four rows.)
fn group_end(list: &TiledList, idx: &[u32], j: usize, end: usize) -> usize {
    let mut last = None;
    let mut e = j;
    while e < end && e - j < TILE_NEURONS {
        if let Place::Tile(i) = list.place(idx[e]) {
            if last.is_some_and(|a: usize| a / TILE_NEURONS != i / TILE_NEURONS || a >= i) {
                break;
            }
            last = Some(i);
        }
        e += 1;
    }
    e
}

/// The runs of `js` that each lie in one tile or are up to four slots ([`group_end`]), in order.
fn list_groups(
    list: &TiledList,
    idx: &[u32],
    js: Range<usize>,
) -> impl Iterator<Item = Range<usize>> {
    let mut j = js.start;
    std::iter::from_fn(move || {
        (j < js.end).then(|| {
            let e = group_end(list, idx, j, js.end);
            let g = j..e;
            j = e;
            g
        })
    })
}

/// The entries at list positions `js[..len]`, padded to four with repeats of the last.
fn entries(idx: &[u32], js: &[usize; 4], len: usize) -> [u32; 4] {
    let at = |q: usize| idx[js[q.min(len - 1)]];
    [at(0), at(1), at(2), at(3)]
}

/// The positions of `g` (up to four) for which `on` holds, and their number.
fn fours(g: Range<usize>, on: impl Fn(usize) -> bool) -> ([usize; 4], usize) {
    let mut out = [0; 4];
    let mut k = 0;
    for j in g {
        if on(j) {
            out[k] = j;
            k += 1;
        }
    }
    (out, k)
}

/// A group's positions (one to four), as [`entries`] takes them.
fn positions(g: &Range<usize>) -> [usize; 4] {
    [g.start, g.start + 1, g.start + 2, g.start + 3]
}

/// [`super::sparse_ffn`] over neurons in tiles: for the listed neurons (`i = idx[j]`, id
/// `ids[j]`) and `n` tokens (`x` is `n × d`), `h[t·m + j] = decide(j, t, gate_i·x_t) ·
/// (up_i·x_t)`, the up dot only where `decide` is non-zero for some token, and with `out`
/// (`n × d`) `out[t] += Σ_j h[t·m + j] · down_i` in the order of
/// [`DOWN_BLOCK`](super::DOWN_BLOCK). Returns the list positions `decide` left on for some token, ascending.
/// A tile's gates, then the ups and downs of its neurons on, are read in turn.
#[allow(clippy::too_many_arguments)]
pub fn tiled_ffn<'a>(
    k: &Kernels,
    list: impl Into<TiledList<'a>>,
    (idx, ids): (&[u32], &[u32]),
    x: &[f32],
    n: usize,
    decide: impl Fn(usize, usize, f32) -> f32 + Sync,
    h: &mut [f32],
    out: Option<&mut [f32]>,
) -> Result<Vec<usize>> {
    let op = "tiled_ffn";
    let list = list.into();
    let (d, m) = (list.tiles.d, idx.len());
    check_x_h(op, (x, h), n, (d, m))?;
    list.check_idx(op, idx)?;
    check_down(op, (n, d, m), ids, out.as_deref())?;
    if m == 0 || n == 0 {
        return Ok(Vec::new());
    }
    let t = TileOps { k, o: ops(k), list };
    let xt = |tok: usize| &x[tok * d..(tok + 1) * d];
    let down = out.map(|o| (ids, o));
    Ok(run_listed((m, n, d), h, down, |js, vals, live, mut sum| {
        let j0 = js.start;
        for g in list_groups(&list, idx, js) {
            let len = g.len();
            let gates = t.rows(entries(idx, &positions(&g), len), Part::Gate);
            for tok in 0..n {
                let s = gates.dot4(len, xt(tok), tok == 0);
                for (q, &v) in s[..len].iter().enumerate() {
                    let j = g.start + q;
                    vals[(j - j0) * n + tok] = decide(j, tok, v);
                }
            }
            let (on, nl) = fours(g, |j| {
                vals[(j - j0) * n..(j - j0 + 1) * n]
                    .iter()
                    .any(|&v| v != 0.0)
            });
            if nl == 0 {
                continue;
            }
            for &j in &on[..nl] {
                live[j].store(true, Ordering::Relaxed);
            }
            let on_rows = entries(idx, &on, nl);
            let ups = t.rows(on_rows, Part::Up);
            for tok in 0..n {
                let u = ups.dot4(nl, xt(tok), tok == 0);
                for (q, &j) in on[..nl].iter().enumerate() {
                    vals[(j - j0) * n + tok] *= u[q];
                }
            }
            if let Some(acc) = sum.as_deref_mut() {
                let downs = t.rows(on_rows, Part::Down);
                for tok in 0..n {
                    // Padding rows weigh zero.
                    let mut a = [0f32; 4];
                    for (a, &j) in a.iter_mut().zip(&on[..nl]) {
                        *a = vals[(j - j0) * n + tok];
                    }
                    downs.axpy4(a, nl, &mut acc[tok * d..(tok + 1) * d], tok == 0);
                }
            }
        }
    }))
}

/// [`super::sparse_down`] over neurons in tiles: `out[t] += Σ_j h[t·m + j] · down_{idx[j]}`
/// (`h` is `n × m`, `out` `n × d`) in the order of [`DOWN_BLOCK`](super::DOWN_BLOCK) by `ids`.
pub fn tiled_down<'a>(
    k: &Kernels,
    list: impl Into<TiledList<'a>>,
    (idx, ids): (&[u32], &[u32]),
    h: &[f32],
    n: usize,
    out: &mut [f32],
) -> Result<()> {
    use rayon::prelude::*;
    let op = "tiled_down";
    let list = list.into();
    let (d, m) = (list.tiles.d, idx.len());
    list.check_idx(op, idx)?;
    check_down(op, (n, d, m), ids, Some(out))?;
    if h.len() != n * m {
        return Err(err(op, format!("h has {} values: want {n}×{m}", h.len())));
    }
    let t = TileOps { k, o: ops(k), list };
    let sums: Vec<Vec<f32>> = block_runs(m, |j| ids[j])
        .into_par_iter()
        .filter_map(|js| {
            let mut acc = vec![0f32; n * d];
            let mut any = false;
            for g in list_groups(&list, idx, js) {
                // Listed neurons that weigh nothing for every token add nothing (as the
                // bundles' down pass skips them).
                let (on, nl) = fours(g, |j| (0..n).any(|tok| h[tok * m + j] != 0.0));
                if nl == 0 {
                    continue;
                }
                any = true;
                let downs = t.rows(entries(idx, &on, nl), Part::Down);
                for tok in 0..n {
                    let mut a = [0f32; 4];
                    for (a, &j) in a.iter_mut().zip(&on[..nl]) {
                        *a = h[tok * m + j];
                    }
                    downs.axpy4(a, nl, &mut acc[tok * d..(tok + 1) * d], tok == 0);
                }
            }
            any.then_some(acc)
        })
        .collect();
    add_in_order(&sums, out);
    Ok(())
}

/// The down side's sizes: `ids` one per listed neuron, `out` (where given) `n × d`.
fn check_down(
    op: &'static str,
    (n, d, m): (usize, usize, usize),
    ids: &[u32],
    out: Option<&[f32]>,
) -> Result<()> {
    if ids.len() != m || out.is_some_and(|o| o.len() != n * d) {
        return Err(err(
            op,
            format!(
                "out has {} values, {} ids: want {n}×{d} and {m}",
                out.map_or(0, |o| o.len()),
                ids.len()
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every value of every bundle lands where the tiles' reader looks for it; padding is zero.
    #[test]
    fn tiles_hold_each_bundle_part_where_a_row_is_read() {
        let d = 64;
        let rb = PARTS * 2 * d;
        let stored = 7;
        let bytes: Vec<u8> = (0..stored * rb / 2)
            .flat_map(|i| f16::from_f32(i as f32).to_le_bytes())
            .collect();
        let rows = [5u32, 0, 6, 2, 3];
        let tiled = tile_bundles(&bytes, rb, &rows, d);
        assert_eq!(tiled.len(), tiles_bytes(rows.len(), d));
        let tiles = NeuronTiles::new(&tiled, rows.len(), d).unwrap();
        for (i, &row) in rows.iter().enumerate() {
            for (p, part) in [Part::Gate, Part::Up, Part::Down].into_iter().enumerate() {
                let want: Vec<f16> = (0..d)
                    .map(|c| f16::from_f32((row as usize * rb / 2 + p * d + c) as f32))
                    .collect();
                assert_eq!(tiles.row_values(i, part), want, "neuron {i} part {p}");
            }
        }
        for i in rows.len()..8 {
            assert!(
                tiles
                    .row_values(i, Part::Gate)
                    .iter()
                    .all(|v| v.to_f32() == 0.0)
            );
        }
        assert!(NeuronTiles::new(&tiled[..tiled.len() - 2], rows.len(), d).is_err());
        assert!(NeuronTiles::new(&tiled, rows.len(), 48).is_err());
        assert!(!tileable(crate::tensor::DType::F16, 3, 48));
        assert!(!tileable(crate::tensor::DType::F32, 3, 64));
    }

    /// Over any list (out of order, repeats, a neuron of the padded last tile's neighbours) and
    /// several tokens, the tiles give what the bundles give, bit for bit, with either kernel
    /// set; a neuron past those held is refused.
    #[test]
    fn tiles_compute_what_bundles_do_over_any_list() {
        use crate::backend::BundleShape;
        use crate::backend::cpu::kernels::{self, PORTABLE};
        use crate::backend::cpu::sparse::{Bundles, FfnParts, sparse_down, sparse_ffn};
        use crate::store::Encoding;
        let (d, neurons) = (64, 23);
        let mut seed = 7u64;
        let mut rand = move || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 33) as f32 / (1u64 << 31) as f32) - 0.5
        };
        let halves: Vec<f16> = (0..neurons * PARTS * d)
            .map(|_| f16::from_f32(rand()))
            .collect();
        let bytes: &[u8] = bytemuck::cast_slice(&halves);
        let rb = PARTS * 2 * d;
        let all: Vec<u32> = (0..neurons as u32).collect();
        let tiled = tile_bundles(bytes, rb, &all, d);
        let tiles = NeuronTiles::new(&tiled, neurons, d).unwrap();
        let shape = BundleShape { parts: 3, d };
        let b = Bundles::new(bytes, Encoding::Format(crate::tensor::DType::F16), shape).unwrap();
        let idx = [3u32, 0, 1, 2, 2, 9, 8, 22, 21, 20, 4, 5, 6, 7, 11];
        let ids = idx;
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for k in [kernels::best(), &PORTABLE] {
            for n in [1usize, 2] {
                let x: Vec<f32> = (0..n * d).map(|_| rand()).collect();
                // Off where the gate's dot is negative, half of it else.
                let decide = |_: usize, _: usize, v: f32| if v < 0.0 { 0.0 } else { v * 0.5 };
                let m = idx.len();
                let (mut ha, mut hb) = (vec![0f32; n * m], vec![0f32; n * m]);
                let start: Vec<f32> = (0..n * d).map(|i| i as f32 * 0.01).collect();
                let (mut oa, mut ob) = (start.clone(), start.clone());
                let pa = sparse_ffn(
                    k,
                    FfnParts::Bundles(b),
                    (&idx, &ids),
                    &x,
                    n,
                    decide,
                    &mut ha,
                    &mut oa,
                )
                .unwrap();
                let pb = tiled_ffn(
                    k,
                    tiles,
                    (&idx, &ids),
                    &x,
                    n,
                    decide,
                    &mut hb,
                    Some(&mut ob),
                )
                .unwrap();
                assert_eq!(pa, pb, "n {n}");
                assert!(pa.len() < m && !pa.is_empty(), "some on, some off");
                assert_eq!(bits(&ha), bits(&hb), "n {n}");
                assert_eq!(bits(&oa), bits(&ob), "n {n}");
                let (mut da, mut db) = (start.clone(), start.clone());
                sparse_down(k, &b, (&idx, &ids), &ha, n, &mut da).unwrap();
                tiled_down(k, tiles, (&idx, &ids), &ha, n, &mut db).unwrap();
                assert_eq!(bits(&da), bits(&db), "n {n}");
                let mut h = vec![0f32; n];
                let mut out = vec![0f32; n * d];
                let past = tiled_ffn(
                    k,
                    tiles,
                    (&[24], &[24]),
                    &x,
                    n,
                    decide,
                    &mut h,
                    Some(&mut out),
                );
                assert!(past.is_err());
            }
        }
    }

    /// A run of list positions splits where its neurons leave a tile or stop ascending, and
    /// after four; slots join a run wherever they stand.
    #[test]
    fn groups_lie_in_one_tile_in_list_order() {
        use crate::backend::BundleShape;
        use crate::store::Encoding;
        let d = TILE_COLS;
        let bytes = vec![0u8; tiles_bytes(16, d)];
        let tiles = NeuronTiles::new(&bytes, 16, d).unwrap();
        let list = TiledList::from(tiles);
        let idx = [0u32, 1, 2, 3, 4, 6, 5, 9, 13, 14];
        let groups = |idx: &[u32], js| list_groups(&list, idx, js).collect::<Vec<_>>();
        assert_eq!(
            groups(&idx, 0..idx.len()),
            vec![0..4, 4..6, 6..7, 7..8, 8..10]
        );
        assert_eq!(groups(&idx, 2..5), vec![2..4, 4..5]);
        let slot_bytes = vec![0u8; 6 * PARTS * 2 * d];
        let shape = BundleShape { parts: PARTS, d };
        let slots = Bundles::new(&slot_bytes, Encoding::F16, shape).unwrap();
        let list = TiledList::with_slots(slots, tiles).unwrap();
        let r = |i: u32| i | IN_REST;
        let idx = [
            r(0),
            r(1),
            5,
            r(2),
            r(3),
            0,
            1,
            2,
            3,
            4,
            r(9),
            r(8),
            r(12),
            5,
        ];
        assert_eq!(
            list_groups(&list, &idx, 0..idx.len()).collect::<Vec<_>>(),
            vec![0..4, 4..8, 8..11, 11..12, 12..14]
        );
        assert!(list.check_idx("t", &idx).is_ok());
        assert!(list.check_idx("t", &[6]).is_err(), "past the slots");
        assert!(list.check_idx("t", &[r(16)]).is_err(), "past the tiles");
        // Slots must be f16 as the tiles are.
        let int8_bytes = vec![0u8; 2 * Encoding::Int8.row_bytes(PARTS * d, PARTS)];
        let int8 = Bundles::new(&int8_bytes, Encoding::Int8, shape).unwrap();
        assert!(TiledList::with_slots(int8, tiles).is_err());
    }
}
