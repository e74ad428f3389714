//! KV cache chunks: the keys and values of up to [`CHUNK_TOKENS`] consecutive positions across
//! every layer, the unit contexts are compressed, swapped and recomputed in (LLMS). Encodings:
//! raw f32 (exact), or per group of 32 values an asymmetric 8-, 4- or 2-bit code with f16 scale
//! and minimum, taken after an orthonormal Walsh-Hadamard rotation of each row (blocks of the
//! largest power of two dividing the row, up to 128): keys carry a few outlier channels that
//! would set every group's range, and the rotation spreads them out (as QuaRot does), which
//! makes 4 and 2 bits usable.

use half::f16;
use serde::{Deserialize, Serialize};

/// Positions per chunk.
pub const CHUNK_TOKENS: usize = crate::backend::KV_BLOCK;
/// Values per quantization group.
const GROUP: usize = 32;

/// How a chunk is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Bits {
    Q2,
    Q4,
    Q8,
    /// Uncompressed (exact).
    F32,
}

impl Bits {
    pub fn bits(self) -> usize {
        match self {
            Bits::Q2 => 2,
            Bits::Q4 => 4,
            Bits::Q8 => 8,
            Bits::F32 => 32,
        }
    }
}

/// One chunk on the host: for each layer, K then V, each `len × kv_dim` f32 values.
#[derive(Clone, Debug, PartialEq)]
pub struct ChunkData {
    pub len: usize,
    pub n_layers: usize,
    pub kv_dim: usize,
    pub values: Vec<f32>,
}

impl ChunkData {
    pub fn zeros(n_layers: usize, kv_dim: usize, len: usize) -> Self {
        ChunkData {
            len,
            n_layers,
            kv_dim,
            values: vec![0.0; 2 * n_layers * len * kv_dim],
        }
    }

    /// K (`which = 0`) or V (`1`) of `layer`: `len × kv_dim` values.
    pub fn part(&self, layer: usize, which: usize) -> &[f32] {
        let n = self.len * self.kv_dim;
        let at = (2 * layer + which) * n;
        &self.values[at..at + n]
    }

    pub fn part_mut(&mut self, layer: usize, which: usize) -> &mut [f32] {
        let n = self.len * self.kv_dim;
        let at = (2 * layer + which) * n;
        &mut self.values[at..at + n]
    }
}

/// Bytes an encoding of `values` values takes.
pub fn encoded_len(bits: Bits, values: usize) -> usize {
    match bits {
        Bits::F32 => values * 4,
        b => {
            let groups = values.div_ceil(GROUP);
            groups * 4 + (values * b.bits()).div_ceil(8)
        }
    }
}

/// Encode a chunk. Quantized encodings: for each group of 32 values (groups never span two
/// rows), f16 scale and f16 minimum, then the codes packed little-end first.
pub fn encode(c: &ChunkData, bits: Bits) -> Vec<u8> {
    if bits == Bits::F32 {
        return bytemuck::cast_slice(&c.values).to_vec();
    }
    let b = bits.bits();
    let levels = ((1u32 << b) - 1) as f32;
    let mut rotated = c.values.clone();
    rotate_rows(&mut rotated, c.kv_dim);
    let groups: Vec<&[f32]> = rotated
        .chunks(c.kv_dim.max(1))
        .flat_map(|row| row.chunks(GROUP))
        .collect();
    let mut header = Vec::with_capacity(groups.len() * 4);
    let mut codes = vec![0u8; (c.values.len() * b).div_ceil(8)];
    let mut bit = 0usize;
    for g in groups {
        let (lo, hi) = g
            .iter()
            .fold((f32::INFINITY, f32::NEG_INFINITY), |(l, h), &v| {
                (l.min(v), h.max(v))
            });
        let scale = f16::from_f32((hi - lo) / levels);
        let min = f16::from_f32(lo);
        header.extend(scale.to_le_bytes());
        header.extend(min.to_le_bytes());
        let (s, m) = (scale.to_f32(), min.to_f32());
        let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
        for &v in g {
            let q = ((v - m) * inv).round().clamp(0.0, levels) as u32;
            let mut left = b;
            let mut q = q;
            while left > 0 {
                let byte = bit / 8;
                let off = bit % 8;
                let take = left.min(8 - off);
                codes[byte] |= ((q & ((1 << take) - 1)) as u8) << off;
                q >>= take;
                left -= take;
                bit += take;
            }
        }
    }
    header.extend(codes);
    header
}

/// Decode into a chunk of the given shape; `None` when the bytes do not fit the shape.
pub fn decode(
    bytes: &[u8],
    bits: Bits,
    n_layers: usize,
    kv_dim: usize,
    len: usize,
) -> Option<ChunkData> {
    let n = 2 * n_layers * len * kv_dim;
    if bytes.len() != encoded_len_rows(bits, n, kv_dim) {
        return None;
    }
    let mut c = ChunkData::zeros(n_layers, kv_dim, len);
    if bits == Bits::F32 {
        c.values.copy_from_slice(bytemuck::cast_slice(bytes));
        return Some(c);
    }
    let b = bits.bits();
    let groups_per_row = kv_dim.div_ceil(GROUP);
    let n_groups = (n / kv_dim.max(1)) * groups_per_row;
    let (header, codes) = bytes.split_at(n_groups * 4);
    let mut bit = 0usize;
    let mut gi = 0;
    for row in c.values.chunks_mut(kv_dim.max(1)) {
        for g in row.chunks_mut(GROUP) {
            let h = &header[gi * 4..gi * 4 + 4];
            let s = f16::from_le_bytes([h[0], h[1]]).to_f32();
            let m = f16::from_le_bytes([h[2], h[3]]).to_f32();
            gi += 1;
            for v in g.iter_mut() {
                let mut q = 0u32;
                let mut got = 0;
                while got < b {
                    let byte = bit / 8;
                    let off = bit % 8;
                    let take = (b - got).min(8 - off);
                    q |= (((codes[byte] >> off) as u32) & ((1 << take) - 1)) << got;
                    got += take;
                    bit += take;
                }
                *v = m + s * q as f32;
            }
        }
    }
    rotate_rows(&mut c.values, kv_dim);
    Some(c)
}

/// The rotation block for rows of `kv_dim` values: the largest power of two dividing it, ≤ 128.
fn rotation_block(kv_dim: usize) -> usize {
    if kv_dim == 0 {
        return 1;
    }
    (1usize << kv_dim.trailing_zeros()).min(128)
}

/// Apply the orthonormal Walsh-Hadamard transform to each block of each row (its own inverse).
fn rotate_rows(values: &mut [f32], kv_dim: usize) {
    let n = rotation_block(kv_dim);
    if n < 2 {
        return;
    }
    let norm = 1.0 / (n as f32).sqrt();
    for block in values.chunks_exact_mut(n) {
        let mut h = 1;
        while h < n {
            for i in (0..n).step_by(2 * h) {
                for j in i..i + h {
                    let (a, b) = (block[j], block[j + h]);
                    block[j] = a + b;
                    block[j + h] = a - b;
                }
            }
            h *= 2;
        }
        for v in block.iter_mut() {
            *v *= norm;
        }
    }
}

/// Encoded size when groups restart at every row of `kv_dim` values.
pub fn encoded_len_rows(bits: Bits, values: usize, kv_dim: usize) -> usize {
    match bits {
        Bits::F32 => values * 4,
        b => {
            let rows = values / kv_dim.max(1);
            rows * kv_dim.div_ceil(GROUP) * 4 + (values * b.bits()).div_ceil(8)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(n_layers: usize, kv_dim: usize, len: usize) -> ChunkData {
        let mut c = ChunkData::zeros(n_layers, kv_dim, len);
        for (i, v) in c.values.iter_mut().enumerate() {
            *v = ((i * 7919 % 1000) as f32 / 250.0 - 2.0) * if i % 5 == 0 { 3.0 } else { 1.0 };
        }
        c
    }

    #[test]
    fn f32_roundtrips_exactly() {
        let c = sample(3, 40, 16);
        let e = encode(&c, Bits::F32);
        assert_eq!(decode(&e, Bits::F32, 3, 40, 16).unwrap(), c);
    }

    #[test]
    fn quantized_error_shrinks_with_bits() {
        let c = sample(2, 64, 11);
        let rms = |a: &[f32], b: &[f32]| {
            (a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum::<f32>() / a.len() as f32).sqrt()
        };
        let signal = rms(&c.values, &vec![0.0; c.values.len()]);
        let mut last = f32::INFINITY;
        for (bits, bound) in [(Bits::Q2, 0.5), (Bits::Q4, 0.12), (Bits::Q8, 0.005)] {
            let e = encode(&c, bits);
            assert_eq!(e.len(), encoded_len_rows(bits, c.values.len(), 64));
            let d = decode(&e, bits, 2, 64, 11).unwrap();
            let err = rms(&c.values, &d.values) / signal;
            assert!(err < bound, "{bits:?}: relative RMS error {err}");
            assert!(err < last);
            last = err;
        }
    }

    #[test]
    fn rotation_is_its_own_inverse_and_spreads_outliers() {
        let mut row: Vec<f32> = (0..192)
            .map(|i| if i == 5 { 40.0 } else { (i % 7) as f32 * 0.1 })
            .collect();
        let orig = row.clone();
        rotate_rows(&mut row, 192);
        let max = row.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(max < 8.0, "outlier not spread: {max}");
        rotate_rows(&mut row, 192);
        for (a, b) in row.iter().zip(&orig) {
            assert!((a - b).abs() < 1e-4);
        }
    }

    #[test]
    fn wrong_sizes_are_refused() {
        let c = sample(1, 32, 4);
        let e = encode(&c, Bits::Q4);
        assert!(decode(&e[..e.len() - 1], Bits::Q4, 1, 32, 4).is_none());
        assert!(decode(&e, Bits::Q4, 1, 32, 5).is_none());
    }

    #[test]
    fn compression_ratios() {
        let n = 2 * 30 * 16 * 192;
        assert_eq!(encoded_len_rows(Bits::F32, n, 192), n * 4);
        let q8 = encoded_len_rows(Bits::Q8, n, 192) as f64 / n as f64;
        let q2 = encoded_len_rows(Bits::Q2, n, 192) as f64 / n as f64;
        assert!(
            (q8 - 1.125).abs() < 1e-9 && (q2 - 0.375).abs() < 1e-9,
            "{q8} {q2}"
        );
    }
}
