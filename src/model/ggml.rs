//! GGML tensor types as they appear in GGUF files: block geometry and which storage format
//! ([`DType`]) each one is computed in. Every type with a format is used as it is in the file
//! (no widening at load); the others are refused.

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
            Self::Other(id) => match id {
                16 => "IQ2_XXS".into(),
                17 => "IQ2_XS".into(),
                18 => "IQ3_XXS".into(),
                19 => "IQ1_S".into(),
                20 => "IQ4_NL".into(),
                21 => "IQ3_S".into(),
                22 => "IQ2_S".into(),
                23 => "IQ4_XS".into(),
                29 => "IQ1_M".into(),
                34 => "TQ1_0".into(),
                35 => "TQ2_0".into(),
                39 => "MXFP4".into(),
                _ => format!("type {id}"),
            },
        }
    }

    /// (elements per block, bytes per block). For an `Other` id without a known layout a
    /// one-byte block keeps the directory readable; loading it is refused later.
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
            // Types no backend computes: their geometry (ggml-common.h) keeps the directory
            // and the file size checks right, so loading is refused with the type named.
            Self::Other(id) => match id {
                16 => (QK_K, 66),  // IQ2_XXS
                17 => (QK_K, 74),  // IQ2_XS
                18 => (QK_K, 98),  // IQ3_XXS
                19 => (QK_K, 50),  // IQ1_S
                20 => (32, 18),    // IQ4_NL
                21 => (QK_K, 110), // IQ3_S
                22 => (QK_K, 82),  // IQ2_S
                23 => (QK_K, 136), // IQ4_XS
                29 => (QK_K, 56),  // IQ1_M
                34 => (QK_K, 54),  // TQ1_0
                35 => (QK_K, 66),  // TQ2_0
                39 => (32, 17),    // MXFP4
                _ => (1, 1),
            },
        }
    }

    /// The storage format this type is computed in (its bytes used as they are), or `None` for a
    /// type no backend computes (Q8_1, Q8_K, the integer types, IQ*/TQ*/MXFP4…): loading such a
    /// tensor is refused, never widened.
    pub fn host_dtype(self) -> Option<DType> {
        Some(match self {
            Self::F32 => DType::F32,
            Self::F16 => DType::F16,
            Self::BF16 => DType::BF16,
            Self::Q8_0 => DType::Q8_0,
            Self::Q4_0 => DType::Q4_0,
            Self::Q4_1 => DType::Q4_1,
            Self::Q5_0 => DType::Q5_0,
            Self::Q5_1 => DType::Q5_1,
            Self::Q2K => DType::Q2K,
            Self::Q3K => DType::Q3K,
            Self::Q4K => DType::Q4K,
            Self::Q5K => DType::Q5K,
            Self::Q6K => DType::Q6K,
            _ => return None,
        })
    }

    /// The GGML type a storage format is written as in GGUF (the inverse of
    /// [`GgmlType::host_dtype`]) and its type id.
    pub fn of_dtype(d: DType) -> (Self, u32) {
        match d {
            DType::F32 => (Self::F32, 0),
            DType::F16 => (Self::F16, 1),
            DType::Q4_0 => (Self::Q4_0, 2),
            DType::Q4_1 => (Self::Q4_1, 3),
            DType::Q5_0 => (Self::Q5_0, 6),
            DType::Q5_1 => (Self::Q5_1, 7),
            DType::Q8_0 => (Self::Q8_0, 8),
            DType::Q2K => (Self::Q2K, 10),
            DType::Q3K => (Self::Q3K, 11),
            DType::Q4K => (Self::Q4K, 12),
            DType::Q5K => (Self::Q5K, 13),
            DType::Q6K => (Self::Q6K, 14),
            DType::BF16 => (Self::BF16, 30),
        }
    }

    /// Reference dequantization to f32 (exactly what GGML computes), for the types with a
    /// storage format ([`GgmlType::host_dtype`]).
    pub fn dequantize(self, bytes: &[u8], n: usize) -> Result<Vec<f32>, String> {
        let (block_len, block_bytes) = self.block();
        if !n.is_multiple_of(block_len) || bytes.len() != n / block_len * block_bytes {
            return Err(format!(
                "{} data of {} bytes does not hold {n} values",
                self.name(),
                bytes.len()
            ));
        }
        let dtype = self
            .host_dtype()
            .ok_or_else(|| format!("no decoder for {}", self.name()))?;
        let mut out = vec![0f32; n];
        crate::tensor::decode_row(dtype, bytes, &mut out);
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn computed_types_map_to_their_own_format() {
        for d in DType::ALL {
            let (t, id) = GgmlType::of_dtype(d);
            assert_eq!(GgmlType::from_id(id), Some(t));
            assert_eq!(t.host_dtype(), Some(d), "{}", t.name());
            assert_eq!(t.block(), (d.block_len(), d.block_bytes()), "{}", t.name());
        }
    }

    #[test]
    fn types_without_a_kernel_are_not_mapped() {
        for id in [9, 15, 16, 20, 23, 24, 26, 29, 34, 39] {
            let t = GgmlType::from_id(id).unwrap();
            assert_eq!(t.host_dtype(), None, "{}", t.name());
        }
    }

    #[test]
    fn wrong_lengths_are_errors() {
        assert!(GgmlType::Q4K.dequantize(&[0u8; 10], 256).is_err());
        assert!(GgmlType::Q2K.dequantize(&[0u8; 83], 256).is_err());
        assert!(GgmlType::Q8K.dequantize(&[0u8; 292], 256).is_err());
    }
}
