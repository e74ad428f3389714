//! Neuron-sparse FFN on the CPU (PowerInfer-style): compute only the neurons listed in `idx`.
//!
//! Semantics (the oracle the tests check): each function equals its dense counterpart run with
//! the hidden activations of every neuron outside `idx` set to zero.
//! - [`sparse_up`] / [`sparse_down`]: over FFN bundles ([`Bundles`]: neuron i's gate row, up row
//!   and down column side by side) in f32, f16, bf16, INT8 or INT4; `h` is compact, one value
//!   per listed neuron: `h[t·m + j]` belongs to neuron `idx[j]` (`m = idx.len()`).
//! - [`sparse_decide_up`]: the up side with its decision in one pass (each listed neuron's
//!   deciding part, then its up part where the decision leaves it on), over bundles or their
//!   parts taken apart ([`FfnParts`]), and over neurons laid out in tiles ([`tiled_ffn`]).
//! - [`sparse_rows`] / [`sparse_down_blocks`]: over weight matrices in their storage format
//!   (GGUF blocks or floats), for models whose FFN is not bundled.
//!
//! A listed neuron appearing twice is computed twice (and added twice by the down functions):
//! the sums run over the list. The down functions over bundles sum in one order
//! ([`DOWN_BLOCK`]), so every mode's sum is the same bit for bit.
//!
//! Where things are: the bundle view (`bundle`), one weight vector in its encoding and its
//! dot/axpy by group of four (`vector`), the inner kernels `Kernels` lacks (`ops`: the table;
//! `portable` and `x86` fill it), the split of listed items over tasks (`items`), the operators
//! over bundles (`up`, `down`) and over weight matrices (`matrix`).

mod bundle;
mod down;
mod ffn;
mod items;
mod matrix;
mod ops;
mod portable;
#[cfg(test)]
mod tests;
mod tiles;
mod up;
mod vector;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use bundle::Bundles;
pub use down::{DOWN_BLOCK, DownSplit, sparse_down, sparse_down_split};
pub use ffn::{FfnParts, sparse_decide_up, sparse_ffn};
pub(crate) use items::per_items;
pub use matrix::{sparse_down_blocks, sparse_rows};
pub use ops::{TILE_COLS, TILE_NEURONS};
pub use tiles::{
    NeuronTiles, TiledList, tile_bundles, tileable, tiled_down, tiled_ffn, tiles_bytes,
};
pub use up::{sparse_part_dots, sparse_up};
