//! KV cache chunks: the keys and values of up to [`CHUNK_TOKENS`] consecutive positions across
//! every layer, the unit contexts are compressed, swapped and recomputed in (LLMS). Encodings:
//! raw f32 or raw f16 (exact where the cache holds f16, the device's default), or per group of 32 values an asymmetric 8-, 4- or 2-bit code with f16 scale
//! and minimum, taken after an orthonormal Walsh-Hadamard rotation of each row (blocks of the
//! largest power of two dividing the row, up to 128): keys carry a few outlier channels that
//! would set every group's range, and the rotation spreads them out (as QuaRot does), which
//! makes 4 and 2 bits usable.

use crate::backend::KvType;
use half::f16;
use half::slice::HalfFloatSliceExt;
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
    /// Raw f16: exact for a cache of f16 values, at half the bytes of f32.
    F16,
    /// Raw f32: exact for any cache.
    F32,
}

impl Bits {
    pub fn bits(self) -> usize {
        match self {
            Bits::Q2 => 2,
            Bits::Q4 => 4,
            Bits::Q8 => 8,
            Bits::F16 => 16,
            Bits::F32 => 32,
        }
    }

    /// The narrowest raw encoding that holds every value of a `kv` cache exactly.
    pub fn exact_for(kv: KvType) -> Bits {
        // Q8_0's values (an f16 scale times an int8) need more than f16's 11 bits.
        Bits::cache_bytes(kv).unwrap_or(Bits::F32)
    }

    /// The encoding whose bytes are the `kv` cache's own rows (per layer K then V, `len` rows
    /// each: the engine's raw KV layout), if there is one: such a chunk moves between the cache
    /// and its store without a conversion.
    pub fn cache_bytes(kv: KvType) -> Option<Bits> {
        match kv {
            KvType::F16 => Some(Bits::F16),
            KvType::F32 => Some(Bits::F32),
            KvType::Q8_0 => None,
        }
    }

    /// A raw encoding (f16 or f32), not a quantized code.
    pub fn is_raw(self) -> bool {
        matches!(self, Bits::F16 | Bits::F32)
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
        Bits::F16 => values * 2,
        b => {
            let groups = values.div_ceil(GROUP);
            groups * 4 + (values * b.bits()).div_ceil(8)
        }
    }
}

/// Encode a chunk. Quantized encodings: for each group of 32 values (groups never span two
/// rows), f16 scale and f16 minimum, then the codes packed little-end first.
pub fn encode(c: &ChunkData, bits: Bits) -> Vec<u8> {
    match bits {
        Bits::F32 => return bytemuck::cast_slice(&c.values).to_vec(),
        Bits::F16 => {
            let mut h = vec![f16::ZERO; c.values.len()];
            h.convert_from_f32_slice(&c.values);
            return bytemuck::cast_slice(&h).to_vec();
        }
        _ => {}
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
    let mut c = ChunkData {
        len,
        n_layers,
        kv_dim,
        values: Vec::new(),
    };
    decode_into(bytes, bits, &mut c).then_some(c)
}

/// Decode into `out`, whose `len`, `n_layers` and `kv_dim` give the shape (its values buffer is
/// reused); false, leaving the values unspecified, when the bytes do not fit the shape.
///
/// Rows are independent (groups never span rows and the rotation works within a row), so each
/// row is dequantized in tight per-group loops, rotated, and rows run in parallel (rayon). The
/// arithmetic is the reference's operation for operation (`min + scale × code`, then the same
/// butterflies in the same stage order), so the values are bit for bit the same.
pub fn decode_into(bytes: &[u8], bits: Bits, out: &mut ChunkData) -> bool {
    let kv_dim = out.kv_dim;
    let n = 2 * out.n_layers * out.len * kv_dim;
    if bytes.len() != encoded_len_rows(bits, n, kv_dim) {
        return false;
    }
    if bits == Bits::F32 {
        out.values.clear();
        out.values.extend(
            bytes
                .chunks_exact(4)
                .map(|x| f32::from_le_bytes([x[0], x[1], x[2], x[3]])),
        );
        return true;
    }
    if bits == Bits::F16 {
        out.values.resize(n, 0.0);
        match bytemuck::try_cast_slice::<u8, f16>(bytes) {
            Ok(h) => crate::tensor::f16_to_f32_slice(h, &mut out.values),
            // Bytes not aligned for f16: value by value.
            Err(_) => {
                for (v, x) in out.values.iter_mut().zip(bytes.chunks_exact(2)) {
                    *v = f16::from_le_bytes([x[0], x[1]]).to_f32();
                }
            }
        }
        return true;
    }
    // Every value is written below: a reused buffer of the right size needs no clearing.
    out.values.resize(n, 0.0);
    if n == 0 {
        return true;
    }
    let groups_per_row = kv_dim.div_ceil(GROUP);
    let rows = n / kv_dim;
    let (header, codes) = bytes.split_at(rows * groups_per_row * 4);
    let rot = rotation_block(kv_dim);
    let decode_rows = |first_row: usize, block: &mut [f32]| {
        for (i, row) in block.chunks_exact_mut(kv_dim).enumerate() {
            let r = first_row + i;
            let head = &header[r * groups_per_row * 4..(r + 1) * groups_per_row * 4];
            match bits {
                Bits::Q8 => dequant_row::<8>(row, r * kv_dim, head, codes),
                Bits::Q4 => dequant_row::<4>(row, r * kv_dim, head, codes),
                Bits::Q2 => dequant_row::<2>(row, r * kv_dim, head, codes),
                Bits::F16 | Bits::F32 => unreachable!(),
            }
            if rot >= 2 {
                rotate_row(row, rot);
            }
        }
    };
    // About 4k values a task: enough to pay for the hand-off, many tasks per chunk.
    let rows_per_task = (4096 / kv_dim).max(1);
    if rows > rows_per_task {
        use rayon::prelude::*;
        out.values
            .par_chunks_mut(rows_per_task * kv_dim)
            .enumerate()
            .for_each(|(t, block)| decode_rows(t * rows_per_task, block));
    } else {
        decode_rows(0, &mut out.values);
    }
    true
}

/// Dequantize one row of `B`-bit codes: `first` is the index of the row's first value in the
/// chunk's code stream, `head` the row's group headers (f16 scale, f16 minimum).
fn dequant_row<const B: usize>(row: &mut [f32], first: usize, head: &[u8], codes: &[u8]) {
    let mask = ((1u16 << B) - 1) as u8;
    for (g, (out, h)) in row.chunks_mut(GROUP).zip(head.chunks_exact(4)).enumerate() {
        let s = f16::from_le_bytes([h[0], h[1]]).to_f32();
        let m = f16::from_le_bytes([h[2], h[3]]).to_f32();
        let k0 = first + g * GROUP;
        if out.len() == GROUP && (k0 * B).is_multiple_of(8) {
            // A whole group starting on a byte: 32 × B bits = 4 × B bytes, no carries. Codes
            // first, then one multiply-add pass the compiler vectorizes.
            let at = k0 * B / 8;
            let src = &codes[at..at + GROUP * B / 8];
            let mut q = [0u8; GROUP];
            for (i, q) in q.iter_mut().enumerate() {
                *q = (src[i * B / 8] >> ((i * B) % 8)) & mask;
            }
            for (v, &q) in out.iter_mut().zip(&q) {
                *v = m + s * q as f32;
            }
        } else {
            // A short group (the row's last) or one off a byte boundary: B divides 8, so a code
            // never straddles two bytes.
            for (j, v) in out.iter_mut().enumerate() {
                let bit = (k0 + j) * B;
                let q = (codes[bit / 8] >> (bit % 8)) & mask;
                *v = m + s * q as f32;
            }
        }
    }
}

/// The orthonormal Walsh-Hadamard transform of each `n`-value block of one row: the same
/// butterflies, stage by stage, as [`rotate_rows`], in contiguous slices the compiler vectorizes.
fn rotate_row(row: &mut [f32], n: usize) {
    let norm = 1.0 / (n as f32).sqrt();
    for block in row.chunks_exact_mut(n) {
        let mut h = 1;
        if n >= 8 {
            // The first three stages (h = 1, 2, 4) within each run of 8, in registers.
            for c in block.chunks_exact_mut(8) {
                let mut a = [0f32; 8];
                a.copy_from_slice(c);
                for h in [1, 2, 4] {
                    for i in 0..8 {
                        if i & h == 0 {
                            let (p, q) = (a[i], a[i + h]);
                            a[i] = p + q;
                            a[i + h] = p - q;
                        }
                    }
                }
                c.copy_from_slice(&a);
            }
            h = 8;
        }
        while h < n {
            for pair in block.chunks_exact_mut(2 * h) {
                let (a, b) = pair.split_at_mut(h);
                for (x, y) in a.iter_mut().zip(b.iter_mut()) {
                    let (p, q) = (*x, *y);
                    *x = p + q;
                    *y = p - q;
                }
            }
            h *= 2;
        }
        for v in block.iter_mut() {
            *v *= norm;
        }
    }
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
    if n >= 2 {
        rotate_row(values, n);
    }
}

/// Encoded size when groups restart at every row of `kv_dim` values.
pub fn encoded_len_rows(bits: Bits, values: usize, kv_dim: usize) -> usize {
    match bits {
        Bits::F32 => values * 4,
        Bits::F16 => values * 2,
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

    /// The rotation as first written. Apply the orthonormal Walsh-Hadamard transform to each block of each row (its own inverse).
    fn rotate_rows_reference(values: &mut [f32], kv_dim: usize) {
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

    /// The decoder as first written, value by value: the fast one must match it bit for bit.
    fn decode_reference(
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
            // (Copied, not cast: an empty Vec's pointer is not aligned for f32.)
            c.values = bytes
                .chunks_exact(4)
                .map(|x| f32::from_ne_bytes([x[0], x[1], x[2], x[3]]))
                .collect();
            return Some(c);
        }
        if bits == Bits::F16 {
            c.values = bytes
                .chunks_exact(2)
                .map(|x| f16::from_le_bytes([x[0], x[1]]).to_f32())
                .collect();
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
        rotate_rows_reference(&mut c.values, kv_dim);
        Some(c)
    }

    #[test]
    fn fast_decode_equals_the_reference_bit_for_bit() {
        use rand::{RngExt, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(14);
        // Shapes: SmolLM2's (192: rotation blocks of 64), a power of two, rows not a multiple
        // of the group (40, 50: short groups; odd 7 and 3: codes off byte boundaries).
        for &(n_layers, kv_dim, len) in &[
            (30, 192, 16),
            (2, 128, 16),
            (3, 40, 16),
            (2, 50, 7),
            (1, 7, 3),
            (2, 3, 5),
            (1, 64, 1),
            (2, 96, 0),
        ] {
            for bits in [Bits::Q2, Bits::Q4, Bits::Q8, Bits::F16, Bits::F32] {
                for trial in 0..3 {
                    let mut c = ChunkData::zeros(n_layers, kv_dim, len);
                    for v in c.values.iter_mut() {
                        let scale = if trial == 2 { 1e-3 } else { 4.0 };
                        *v = (rng.random::<f32>() - 0.5) * scale;
                        if rng.random::<f32>() < 0.02 {
                            *v *= 50.0;
                        }
                    }
                    if trial == 1 {
                        // Constant groups: a zero scale.
                        for v in c.values.iter_mut().take(70) {
                            *v = 0.25;
                        }
                    }
                    let mut fast = c.values.clone();
                    let mut slow = c.values.clone();
                    rotate_rows(&mut fast, kv_dim);
                    rotate_rows_reference(&mut slow, kv_dim);
                    assert_eq!(
                        bytemuck::cast_slice::<f32, u32>(&fast),
                        bytemuck::cast_slice::<f32, u32>(&slow)
                    );
                    let mut e = encode(&c, bits);
                    if trial == 2 {
                        // Arbitrary bytes too (any code and any scale, even non-finite ones).
                        for b in e.iter_mut() {
                            *b = rng.random::<u8>();
                        }
                    }
                    let want = decode_reference(&e, bits, n_layers, kv_dim, len).unwrap();
                    let got = decode(&e, bits, n_layers, kv_dim, len).unwrap();
                    assert_eq!(got.values.len(), want.values.len());
                    for (i, (a, b)) in got.values.iter().zip(&want.values).enumerate() {
                        // (Arbitrary f16 bytes hold NaNs: any NaN is the same NaN here.)
                        assert!(
                            a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                            "{bits:?} {n_layers}x{kv_dim}x{len} trial {trial} value {i}: {a} vs {b}"
                        );
                    }
                    // The reused buffer gives the same.
                    let mut again = got.clone();
                    assert!(decode_into(&e, bits, &mut again));
                    assert_eq!(
                        bytemuck::cast_slice::<f32, u32>(&again.values),
                        bytemuck::cast_slice::<f32, u32>(&got.values)
                    );
                    // Bytes not aligned for f16 decode the same.
                    let mut shifted = vec![0u8; e.len() + 1];
                    shifted[1..].copy_from_slice(&e);
                    assert!(decode_into(&shifted[1..], bits, &mut again));
                    assert_eq!(
                        bytemuck::cast_slice::<f32, u32>(&again.values),
                        bytemuck::cast_slice::<f32, u32>(&got.values)
                    );
                }
            }
        }
    }

    #[test]
    #[ignore = "timing: cargo test --release --lib kv::chunk::tests::decode_speed -- --ignored --nocapture"]
    fn decode_speed() {
        let c = sample(30, 192, 16);
        for bits in [Bits::Q2, Bits::Q4, Bits::Q8, Bits::F16, Bits::F32] {
            let e = encode(&c, bits);
            let reps = 50;
            let t = std::time::Instant::now();
            for _ in 0..reps {
                std::hint::black_box(decode_reference(&e, bits, 30, 192, 16));
            }
            let slow = t.elapsed().as_secs_f64() / reps as f64;
            let mut out = decode(&e, bits, 30, 192, 16).unwrap();
            let t = std::time::Instant::now();
            for _ in 0..reps {
                std::hint::black_box(decode_into(&e, bits, &mut out));
            }
            let fast = t.elapsed().as_secs_f64() / reps as f64;
            let n = c.values.len() as f64;
            println!(
                "{bits:?}: reference {:.2} ms ({:.2} ns/value), fast {:.3} ms ({:.2} ns/value)",
                slow * 1e3,
                slow * 1e9 / n,
                fast * 1e3,
                fast * 1e9 / n
            );
        }
    }

    #[test]
    fn f32_roundtrips_exactly() {
        let c = sample(3, 40, 16);
        let e = encode(&c, Bits::F32);
        assert_eq!(decode(&e, Bits::F32, 3, 40, 16).unwrap(), c);
    }

    #[test]
    fn f16_holds_an_f16_cache_exactly_at_half_the_bytes() {
        let mut c = sample(3, 40, 16);
        // What an f16 cache hands the host: values f16 can hold.
        for v in c.values.iter_mut() {
            *v = f16::from_f32(*v).to_f32();
        }
        c.values[7] = f32::INFINITY;
        c.values[8] = -0.0;
        c.values[9] = f16::MIN_POSITIVE_SUBNORMAL.to_f32();
        let e = encode(&c, Bits::F16);
        assert_eq!(e.len(), encoded_len_rows(Bits::F16, c.values.len(), 40));
        assert_eq!(2 * e.len(), encode(&c, Bits::F32).len());
        let d = decode(&e, Bits::F16, 3, 40, 16).unwrap();
        assert_eq!(
            bytemuck::cast_slice::<f32, u32>(&d.values),
            bytemuck::cast_slice::<f32, u32>(&c.values)
        );
        assert_eq!(Bits::exact_for(KvType::F16), Bits::F16);
        assert_eq!(Bits::exact_for(KvType::F32), Bits::F32);
        assert_eq!(Bits::exact_for(KvType::Q8_0), Bits::F32);
        // Raw widths sort above every code (policy and LCTRU order by width).
        assert!(Bits::Q8 < Bits::F16 && Bits::F16 < Bits::F32);
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
        assert_eq!(encoded_len_rows(Bits::F16, n, 192), n * 2);
        let q8 = encoded_len_rows(Bits::Q8, n, 192) as f64 / n as f64;
        let q2 = encoded_len_rows(Bits::Q2, n, 192) as f64 / n as f64;
        assert!(
            (q8 - 1.125).abs() < 1e-9 && (q2 - 0.375).abs() < 1e-9,
            "{q8} {q2}"
        );
    }
}
