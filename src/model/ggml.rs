//! GGML tensor types as they appear in GGUF files: block geometry, which ones the backends use
//! as they are, and reference decoders for the others (decoded once at load).

use half::f16;

use crate::tensor::DType;

const QK_K: usize = 256;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    I8,
    I16,
    I32,
    I64,
    F64,
    BF16,
    /// A type id this reader knows exists but has no decoder for (IQ*, TQ*, MXFP4, ...).
    Other(u32),
}

impl GgmlType {
    pub fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            7 => Self::Q5_1,
            8 => Self::Q8_0,
            9 => Self::Q8_1,
            10 => Self::Q2K,
            11 => Self::Q3K,
            12 => Self::Q4K,
            13 => Self::Q5K,
            14 => Self::Q6K,
            15 => Self::Q8K,
            24 => Self::I8,
            25 => Self::I16,
            26 => Self::I32,
            27 => Self::I64,
            28 => Self::F64,
            30 => Self::BF16,
            16..=23 | 29 | 34..=39 => Self::Other(id),
            _ => return None,
        })
    }

    pub fn name(self) -> String {
        match self {
            Self::F32 => "F32".into(),
            Self::F16 => "F16".into(),
            Self::Q4_0 => "Q4_0".into(),
            Self::Q4_1 => "Q4_1".into(),
            Self::Q5_0 => "Q5_0".into(),
            Self::Q5_1 => "Q5_1".into(),
            Self::Q8_0 => "Q8_0".into(),
            Self::Q8_1 => "Q8_1".into(),
            Self::Q2K => "Q2_K".into(),
            Self::Q3K => "Q3_K".into(),
            Self::Q4K => "Q4_K".into(),
            Self::Q5K => "Q5_K".into(),
            Self::Q6K => "Q6_K".into(),
            Self::Q8K => "Q8_K".into(),
            Self::I8 => "I8".into(),
            Self::I16 => "I16".into(),
            Self::I32 => "I32".into(),
            Self::I64 => "I64".into(),
            Self::F64 => "F64".into(),
            Self::BF16 => "BF16".into(),
            Self::Other(id) => format!("type {id} (IQ/TQ family)"),
        }
    }

    /// (elements per block, bytes per block). For `Other` types the geometry is unknown; a
    /// one-byte block keeps the directory readable and loading them is refused later.
    pub fn block(self) -> (usize, usize) {
        match self {
            Self::F32 | Self::I32 => (1, 4),
            Self::F16 | Self::BF16 | Self::I16 => (1, 2),
            Self::I8 => (1, 1),
            Self::I64 | Self::F64 => (1, 8),
            Self::Q4_0 => (32, 18),
            Self::Q4_1 => (32, 20),
            Self::Q5_0 => (32, 22),
            Self::Q5_1 => (32, 24),
            Self::Q8_0 => (32, 34),
            Self::Q8_1 => (32, 36),
            Self::Q2K => (QK_K, 84),
            Self::Q3K => (QK_K, 110),
            Self::Q4K => (QK_K, 144),
            Self::Q5K => (QK_K, 176),
            Self::Q6K => (QK_K, 210),
            Self::Q8K => (QK_K, 292),
            Self::Other(_) => (1, 1),
        }
    }

    /// The format this type becomes on the host, or `None` when it is not supported.
    /// Quantized types without a native kernel are decoded to f16: exact enough (11-bit
    /// mantissa against 5–6-bit codes) and half the bytes of f32.
    pub fn host_dtype(self) -> Option<DType> {
        match self {
            Self::F32 => Some(DType::F32),
            Self::F16 => Some(DType::F16),
            Self::BF16 => Some(DType::BF16),
            Self::Q8_0 => Some(DType::Q8_0),
            Self::Q4_0 => Some(DType::Q4_0),
            Self::Q4_1 => Some(DType::Q4_1),
            Self::Q5_0 | Self::Q5_1 | Self::Q4K | Self::Q5K | Self::Q6K => Some(DType::F16),
            _ => None,
        }
    }

    /// Whether the bytes in the file are used as they are.
    pub fn is_native(self) -> bool {
        matches!(
            self,
            Self::F32 | Self::F16 | Self::BF16 | Self::Q8_0 | Self::Q4_0 | Self::Q4_1
        )
    }

    /// Decode `n` values of this type into `target` (F16 or F32) bytes.
    pub fn decode_to(self, target: DType, bytes: &[u8], n: usize) -> Result<Vec<u8>, String> {
        let values = self.dequantize(bytes, n)?;
        Ok(match target {
            DType::F32 => bytemuck::cast_slice(&values).to_vec(),
            DType::F16 => {
                let h: Vec<f16> = values.iter().map(|&v| f16::from_f32(v)).collect();
                bytemuck::cast_slice(&h).to_vec()
            }
            other => return Err(format!("cannot decode into {other}")),
        })
    }

    /// Reference dequantization to f32 (exactly what GGML computes).
    pub fn dequantize(self, bytes: &[u8], n: usize) -> Result<Vec<f32>, String> {
        let (block_len, block_bytes) = self.block();
        if !n.is_multiple_of(block_len) || bytes.len() != n / block_len * block_bytes {
            return Err(format!(
                "{} data of {} bytes does not hold {n} values",
                self.name(),
                bytes.len()
            ));
        }
        let mut out = vec![0f32; n];
        let blocks = bytes
            .chunks_exact(block_bytes)
            .zip(out.chunks_exact_mut(block_len));
        match self {
            Self::Q5_0 => blocks.for_each(|(b, y)| dequant_q5(b, y, false)),
            Self::Q5_1 => blocks.for_each(|(b, y)| dequant_q5(b, y, true)),
            Self::Q4K => blocks.for_each(|(b, y)| dequant_q4k(b, y)),
            Self::Q5K => blocks.for_each(|(b, y)| dequant_q5k(b, y)),
            Self::Q6K => blocks.for_each(|(b, y)| dequant_q6k(b, y)),
            t => match t.host_dtype() {
                Some(d) if t.is_native() => {
                    let row_bytes = d.bytes_for(block_len);
                    for (b, y) in bytes
                        .chunks_exact(row_bytes)
                        .zip(out.chunks_exact_mut(block_len))
                    {
                        crate::tensor::decode_row(d, b, y);
                    }
                }
                _ => return Err(format!("no decoder for {}", t.name())),
            },
        }
        Ok(out)
    }
}

fn half_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Q5_0 `{d, qh[4], qs[16]}` and Q5_1 `{d, m, qh[4], qs[16]}`: the fifth bit of value j is bit j
/// of `qh`; values 0..16 come from low nibbles, 16..32 from high nibbles.
fn dequant_q5(b: &[u8], y: &mut [f32], with_min: bool) {
    let d = half_at(b, 0);
    let (m, rest) = if with_min {
        (half_at(b, 2), &b[4..])
    } else {
        (0.0, &b[2..])
    };
    let qh = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]);
    let qs = &rest[4..20];
    let offset = if with_min { 0 } else { 16 };
    for j in 0..16 {
        let h0 = ((qh >> j) << 4) & 0x10;
        let h1 = (qh >> (j + 12)) & 0x10;
        let x0 = ((qs[j] as u32 & 0x0f) | h0) as i32 - offset;
        let x1 = ((qs[j] as u32 >> 4) | h1) as i32 - offset;
        // ggml adds the min only for Q5_1 (so Q5_0 keeps the sign of a zero product).
        if with_min {
            y[j] = x0 as f32 * d + m;
            y[j + 16] = x1 as f32 * d + m;
        } else {
            y[j] = x0 as f32 * d;
            y[j + 16] = x1 as f32 * d;
        }
    }
}

/// The 6-bit scale and min of sub-block `j` packed in the 12 `scales` bytes of Q4_K/Q5_K.
fn scale_min_k4(j: usize, q: &[u8]) -> (f32, f32) {
    if j < 4 {
        ((q[j] & 63) as f32, (q[j + 4] & 63) as f32)
    } else {
        let sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
        let m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
        (sc as f32, m as f32)
    }
}

/// Q4_K `{d, dmin, scales[12], qs[128]}`: 8 sub-blocks of 32 with 6-bit scales and mins.
fn dequant_q4k(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    let dmin = half_at(b, 2);
    let scales = &b[4..16];
    let qs = &b[16..144];
    for (chunk, (q, out)) in qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * chunk, scales);
        let (sc2, m2) = scale_min_k4(2 * chunk + 1, scales);
        let (d1, mm1, d2, mm2) = (d * sc1, dmin * m1, d * sc2, dmin * m2);
        for l in 0..32 {
            out[l] = d1 * (q[l] & 0x0f) as f32 - mm1;
            out[l + 32] = d2 * (q[l] >> 4) as f32 - mm2;
        }
    }
}

/// Q5_K `{d, dmin, scales[12], qh[32], qs[128]}`: as Q4_K with a fifth bit from `qh`.
fn dequant_q5k(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    let dmin = half_at(b, 2);
    let scales = &b[4..16];
    let qh = &b[16..48];
    let qs = &b[48..176];
    for (chunk, (q, out)) in qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * chunk, scales);
        let (sc2, m2) = scale_min_k4(2 * chunk + 1, scales);
        let (d1, mm1, d2, mm2) = (d * sc1, dmin * m1, d * sc2, dmin * m2);
        let u1 = 1u8 << (2 * chunk);
        let u2 = 2u8 << (2 * chunk);
        for l in 0..32 {
            let h1 = if qh[l] & u1 != 0 { 16.0 } else { 0.0 };
            let h2 = if qh[l] & u2 != 0 { 16.0 } else { 0.0 };
            out[l] = d1 * ((q[l] & 0x0f) as f32 + h1) - mm1;
            out[l + 32] = d2 * ((q[l] >> 4) as f32 + h2) - mm2;
        }
    }
}

/// Q6_K `{ql[128], qh[64], scales[16] (i8), d}`: 16 sub-blocks of 16 with 8-bit scales.
fn dequant_q6k(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 208);
    for half in 0..2 {
        let ql = &b[half * 64..half * 64 + 64];
        let qh = &b[128 + half * 32..128 + half * 32 + 32];
        let sc = &b[192 + half * 8..192 + half * 8 + 8];
        let out = &mut y[half * 128..half * 128 + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            out[l] = d * (sc[is] as i8) as f32 * q1 as f32;
            out[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
            out[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
            out[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4k_constant_block() {
        // d = 1, dmin = 0, every scale 1 (j<4: low 6 bits; j>=4: low nibble of q[j+4]), codes 3.
        let mut b = vec![0u8; 144];
        b[0..2].copy_from_slice(&f16::from_f32(1.0).to_le_bytes());
        for j in 0..4 {
            b[4 + j] = 1;
        }
        for j in 8..12 {
            b[4 + j] = 0x01;
        }
        for q in &mut b[16..144] {
            *q = 0x33;
        }
        let y = GgmlType::Q4K.dequantize(&b, 256).unwrap();
        assert!(y.iter().all(|&v| v == 3.0), "{y:?}");
    }

    #[test]
    fn q6k_signed_codes() {
        let mut b = vec![0u8; 210];
        b[208..210].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        for s in &mut b[192..208] {
            *s = 2;
        }
        // ql = 0, qh = 0 -> code -32 everywhere -> 0.5 * 2 * -32 = -32
        let y = GgmlType::Q6K.dequantize(&b, 256).unwrap();
        assert!(y.iter().all(|&v| v == -32.0));
    }

    #[test]
    fn wrong_lengths_are_errors() {
        assert!(GgmlType::Q4K.dequantize(&[0u8; 10], 256).is_err());
        assert!(GgmlType::Q2K.dequantize(&[0u8; 84], 256).is_err());
    }
}
