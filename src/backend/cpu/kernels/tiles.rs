//! Weight rows laid out in tiles for the one-register-of-rows kernels: Q8_0, Q4_0 and Q4_1 rows
//! in groups of [`TILE_ROWS`], each group's blocks one after another, and within a block the 16
//! rows' scales side by side, then (Q4_1) their mins, then their codes in the order the kernel
//! takes them (register `j`, lane `r`: row `r`'s code bytes `4j .. 4j + 4`). The same bytes as
//! the rows, moved within the group's own span, so a tile occupies what its rows did and a
//! matrix's last rows (fewer than a tile) stay as they were.
//!
//! Why: a decode step multiplies each weight block by one token, and a kernel reading rows had
//! to transpose 16 rows' codes and gather their scales for every block: at one token that work,
//! not the memory, set the pace (SmolLM2's 576×576 Q4_1, hot in cache, 16 GB/s a thread). In
//! tiles every operand is one load.

use crate::tensor::DType;

/// Rows to a tile: one to each 32-bit lane of a 512-bit register.
pub const TILE_ROWS: usize = 16;

/// The formats laid out in tiles, with their block's size and header (the scale, and Q4_1's
/// min, before the codes).
fn block_parts(dtype: DType) -> Option<(usize, usize)> {
    match dtype {
        DType::Q8_0 => Some((34, 2)),
        DType::Q4_0 => Some((18, 2)),
        DType::Q4_1 => Some((20, 4)),
        _ => None,
    }
}

/// Whether rows of `dtype` can be laid out in tiles.
pub fn tiles_format(dtype: DType) -> bool {
    block_parts(dtype).is_some()
}

/// Where byte `i` of block `b` of a tile's row `r` lies, from the tile's first byte (`nb` blocks
/// to a row, blocks of `bb` bytes with a header of `head`).
#[inline]
fn tiled_at((bb, head): (usize, usize), r: usize, b: usize, i: usize) -> usize {
    let block = b * TILE_ROWS * bb;
    if i < head {
        // The f16 scales of the 16 rows, then their f16 mins.
        block + (i / 2) * 2 * TILE_ROWS + 2 * r + i % 2
    } else {
        let c = i - head;
        block + head * TILE_ROWS + (c / 4) * 4 * TILE_ROWS + 4 * r + c % 4
    }
}

/// Lay the whole tiles of `rows` rows of `row_bytes` bytes in `data` out in tiles, in place
/// (the rows past the last whole tile stay). `dtype` must be a tiles format.
pub fn tile_rows(dtype: DType, data: &mut [u8], rows: usize, row_bytes: usize) {
    let parts = block_parts(dtype).expect("a tiles format");
    assert!(data.len() >= rows * row_bytes && row_bytes.is_multiple_of(parts.0));
    let nb = row_bytes / parts.0;
    let span = TILE_ROWS * row_bytes;
    let mut rowwise = vec![0u8; span];
    let (bb, head) = parts;
    for tile in data[..rows / TILE_ROWS * span].chunks_exact_mut(span) {
        rowwise.copy_from_slice(tile);
        for (r, row) in rowwise.chunks_exact(row_bytes).enumerate() {
            for (b, block) in row.chunks_exact(bb).enumerate().take(nb) {
                // Whole f16s and whole 4-byte words move together (`tiled_at` keeps them
                // whole): 2.8–3.3 GB/s, where a byte at a time moved 1.0.
                for i in (0..head).step_by(2) {
                    let at = tiled_at(parts, r, b, i);
                    tile[at..at + 2].copy_from_slice(&block[i..i + 2]);
                }
                for i in (head..bb).step_by(4) {
                    let at = tiled_at(parts, r, b, i);
                    tile[at..at + 4].copy_from_slice(&block[i..i + 4]);
                }
            }
        }
    }
}

/// Row `row` of `rows` laid out by [`tile_rows`] in `data`, as its own bytes into `out`
/// (`row_bytes` long).
pub fn tiled_row(dtype: DType, data: &[u8], (row, rows): (usize, usize), out: &mut [u8]) {
    let parts = block_parts(dtype).expect("a tiles format");
    let row_bytes = out.len();
    let span = TILE_ROWS * row_bytes;
    if row >= rows / TILE_ROWS * TILE_ROWS {
        out.copy_from_slice(&data[row * row_bytes..(row + 1) * row_bytes]);
        return;
    }
    let tile = &data[row / TILE_ROWS * span..][..span];
    for (b, block) in out.chunks_exact_mut(parts.0).enumerate() {
        for (i, v) in block.iter_mut().enumerate() {
            *v = tile[tiled_at(parts, row % TILE_ROWS, b, i)];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every byte moves to a place of its own within its tile, and back: a matrix of 37 rows
    /// (two tiles and 5 rows left as they are) in each format.
    #[test]
    fn tiles_hold_the_rows_bytes_and_give_each_row_back() {
        for dtype in [DType::Q8_0, DType::Q4_0, DType::Q4_1] {
            let (bb, _) = block_parts(dtype).unwrap();
            let (rows, nb) = (37, 3);
            let rb = nb * bb;
            let rowwise: Vec<u8> = (0..rows * rb).map(|i| (i * 7 + i / 251) as u8).collect();
            let mut tiled = rowwise.clone();
            tile_rows(dtype, &mut tiled, rows, rb);
            assert_ne!(tiled[..2 * TILE_ROWS * rb], rowwise[..2 * TILE_ROWS * rb]);
            assert_eq!(tiled[2 * TILE_ROWS * rb..], rowwise[2 * TILE_ROWS * rb..]);
            let mut sorted = (tiled.clone(), rowwise.clone());
            sorted.0.sort_unstable();
            sorted.1.sort_unstable();
            assert_eq!(sorted.0, sorted.1, "{dtype}: the same bytes");
            let mut row = vec![0u8; rb];
            for r in 0..rows {
                tiled_row(dtype, &tiled, (r, rows), &mut row);
                assert_eq!(row, rowwise[r * rb..(r + 1) * rb], "{dtype} row {r}");
            }
            // The kernel's operands: block 1's scales side by side, then row 5's first codes
            // in lane 5 of the first code register.
            let block1 = TILE_ROWS * bb;
            let head = if dtype == DType::Q4_1 { 4 } else { 2 };
            for r in 0..TILE_ROWS {
                let scale = &rowwise[r * rb + bb..][..2];
                assert_eq!(&tiled[block1 + 2 * r..][..2], scale);
            }
            let codes = &rowwise[5 * rb + head..][..4];
            assert_eq!(&tiled[head * TILE_ROWS + 4 * 5..][..4], codes);
        }
    }
}
