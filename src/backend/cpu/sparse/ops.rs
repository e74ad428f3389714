//! The table of the sparse operators' own inner kernels ([`Ops`]): what `Kernels` lacks (INT8
//! and INT4 dots with f32 activations, the column axpys, the four-row kernels). `portable` and
//! `x86` fill it; `vector::ops` picks one to go with a kernel set.

use half::{bf16, f16};

/// The kernels `Kernels` lacks: INT8/INT4 dots with f32 activations and the column axpys.
pub(super) struct Ops {
    pub(super) dot_i8: fn(&[i8], &[f32]) -> f32,
    pub(super) dot_i4: fn(&[u8], &[u8], &[f32]) -> f32,
    pub(super) axpy_f32: fn(f32, &[f32], &mut [f32]),
    pub(super) axpy_f16: fn(f32, &[f16], &mut [f32]),
    pub(super) axpy_bf16: fn(f32, &[bf16], &mut [f32]),
    pub(super) axpy_i8: fn(f32, &[i8], &mut [f32]),
    pub(super) axpy_i4: fn(f32, &[u8], &[u8], &mut [f32]),
    /// Four rows against one `x` in one pass (the loads of `x` shared), prefetching the next
    /// group's rows ahead of the reads; `None` where the per-row kernels serve (portable).
    /// INT8 sums come unscaled.
    pub(super) dot4_f16: Option<Dot4F16>,
    pub(super) dot4_i8: Option<Dot4I8>,
    pub(super) dot4_i4: Option<Dot4I4>,
    /// `out += Σ_r a[r] · col[r]`, in the order of `r` (as four axpys would add), the next
    /// group's columns prefetched; the output tile is read and written once per four columns.
    pub(super) axpy4_f16: Option<Axpy4F16>,
    pub(super) axpy4_i8: Option<Axpy4I8>,
    pub(super) axpy4_i4: Option<Axpy4I4>,
    /// [`Self::dot4_f16`] and [`Self::axpy4_f16`] over rows of neuron tiles
    /// ([`super::tiles`]): the same sums, read where the tiles keep the rows.
    pub(super) dot4_tiled: Option<Dot4Tiled>,
    pub(super) axpy4_tiled: Option<Axpy4Tiled>,
}

// The four-row kernels: (rows, next rows, x) and (weights, columns, next columns, out).
pub(super) type Dot4F16 = fn([&[f16]; 4], [&[f16]; 4], &[f32]) -> [f32; 4];
pub(super) type Dot4I8 = fn([&[i8]; 4], [&[i8]; 4], &[f32]) -> [f32; 4];
pub(super) type Dot4I4 = fn([I4Row; 4], [I4Row; 4], &[f32]) -> [f32; 4];
pub(super) type Axpy4F16 = fn([f32; 4], [&[f16]; 4], [&[f16]; 4], &mut [f32]);
pub(super) type Axpy4I8 = fn([f32; 4], [&[i8]; 4], [&[i8]; 4], &mut [f32]);
pub(super) type Axpy4I4 = fn([f32; 4], [I4Row; 4], [I4Row; 4], &mut [f32]);
/// The tiled kernels take whether to ask for the lines ahead: for a step's first token only,
/// the others reading the lines it brought in (37 tokens of SmolLM2's 30 layers: 60–61 ms
/// without the hints against 62–65 with them, out of tree).
pub(super) type Dot4Tiled = fn([TileRow; 4], &[f32], bool) -> [f32; 4];
pub(super) type Axpy4Tiled = fn([f32; 4], [TileRow; 4], &mut [f32], bool);

/// Neurons to a tile (`NeuronTiles`): the four rows the four-row kernels take.
pub const TILE_NEURONS: usize = 4;
/// Columns to a tile's chunk: one 64-byte line of f16s per row.
pub const TILE_COLS: usize = 32;

/// A row the tile kernels read: one of a neuron tile's part (its [`TILE_NEURONS`] rows
/// interleaved a line at a time: [`super::tiles`]), or a row of its own (a cache unit's slot
/// beside the tiles), read as a part of one row. Its values `i .. i + TILE_COLS` lie at
/// `i · lanes + place · TILE_COLS` in `part`.
#[derive(Clone, Copy)]
pub(super) struct TileRow<'a> {
    pub(super) part: &'a [f16],
    pub(super) place: usize,
    pub(super) lanes: usize,
}

impl<'a> TileRow<'a> {
    /// Row `place` of a tile's part.
    pub(super) fn in_tile(part: &'a [f16], place: usize) -> Self {
        TileRow {
            part,
            place,
            lanes: TILE_NEURONS,
        }
    }

    /// A row of its own.
    pub(super) fn alone(row: &'a [f16]) -> Self {
        TileRow {
            part: row,
            place: 0,
            lanes: 1,
        }
    }
}

/// An INT4 vector: its group scales (little-endian f16s) and packed codes.
pub(super) type I4Row<'a> = (&'a [u8], &'a [u8]);

pub(super) fn i4_scale(scales: &[u8], g: usize) -> f32 {
    f16::from_le_bytes([scales[2 * g], scales[2 * g + 1]]).to_f32()
}
