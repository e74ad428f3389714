//! Which format each matrix of a model is quantized to: one format for all (llama-quantize's
//! `--pure`), or llama.cpp's Q4_K_M mix. Used where we make quantized models (`synth --dtype`,
//! `convert --quantize`), so our files and llama.cpp's of the same name hold the same formats.

use crate::tensor::DType;

/// A quantization of a whole model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantMix {
    /// Every matrix in one block format.
    Pure(DType),
    /// llama.cpp's Q4_K_M (llama architecture, no experts): Q4_K, except Q6_K for the output
    /// matrix and for `attn_v` and `ffn_down` in the layers `use_more_bits` picks (the first and
    /// last eighth, and every third layer between).
    Q4KM,
}

impl QuantMix {
    /// `q4_k_m`, or the name of a block format (`q4_k`, `q8_0`, …).
    pub fn parse(name: &str) -> Option<Self> {
        if name == "q4_k_m" {
            return Some(QuantMix::Q4KM);
        }
        DType::parse(name)
            .filter(|d| d.is_quantized())
            .map(QuantMix::Pure)
    }

    pub fn name(self) -> &'static str {
        match self {
            QuantMix::Pure(d) => d.name(),
            QuantMix::Q4KM => "q4_k_m",
        }
    }

    /// llama.cpp's `general.file_type` for this mix.
    pub fn file_type(self) -> u32 {
        match self {
            QuantMix::Q4KM => 15,
            QuantMix::Pure(d) => match d {
                DType::Q4_0 => 2,
                DType::Q4_1 => 3,
                DType::Q8_0 => 7,
                DType::Q5_0 => 8,
                DType::Q5_1 => 9,
                DType::Q2K => 10,
                DType::Q3K => 12,
                DType::Q4K => 14,
                DType::Q5K => 16,
                DType::Q6K => 18,
                DType::F32 => 0,
                DType::F16 => 1,
                DType::BF16 => 32,
            },
        }
    }

    /// The format of matrix `name` (GGUF naming: `token_embd.weight`, `output.weight`,
    /// `blk.{l}.attn_v.weight`, `blk.{l}.ffn_down_exps.weight`, …) with rows of `cols` values, in
    /// a model of `n_layers` layers and `experts` experts a layer (0 for dense), or `None` for a
    /// matrix llama.cpp never quantizes (a router, `ffn_gate_inp*`: it keeps its type).
    /// A format whose blocks do not tile the rows falls back as llama.cpp does where it can
    /// (Q4_K → Q5_0, Q5_K → Q5_1, Q6_K → Q8_0; Q2_K/Q3_K → Q4_0), else to F16.
    pub fn format(self, name: &str, cols: usize, n_layers: usize, experts: usize) -> Option<DType> {
        if name.contains("ffn_gate_inp") {
            return None;
        }
        let want = match self {
            QuantMix::Pure(d) => d,
            QuantMix::Q4KM => {
                let layer = name
                    .strip_prefix("blk.")
                    .and_then(|r| r.split('.').next())
                    .and_then(|l| l.parse::<usize>().ok());
                let more_bits = |i: usize| {
                    let n = n_layers;
                    i < n / 8 || i >= 7 * n / 8 || (i as i64 - (n / 8) as i64).rem_euclid(3) == 2
                };
                // llama.cpp's rule for 8-expert models (Mixtral): attention's v and k in
                // Q8_0, its output in Q5_K.
                let eight = experts == 8;
                if name == "output.weight" {
                    DType::Q6K
                } else if eight
                    && (name.contains("attn_v.weight") || name.contains("attn_k.weight"))
                {
                    DType::Q8_0
                } else if eight && name.contains("attn_output.weight") {
                    DType::Q5K
                } else if let Some(i) = layer
                    && (name.contains("attn_v.weight") || name.contains("ffn_down"))
                    && more_bits(i)
                {
                    DType::Q6K
                } else {
                    DType::Q4K
                }
            }
        };
        Some(Self::tiling(want, cols))
    }

    /// `want`, or what llama.cpp falls back to where its blocks do not tile rows of `cols`.
    fn tiling(want: DType, cols: usize) -> DType {
        if cols.is_multiple_of(want.block_len()) {
            return want;
        }
        let fallback = match want {
            DType::Q4K => DType::Q5_0,
            DType::Q5K => DType::Q5_1,
            DType::Q6K => DType::Q8_0,
            DType::Q2K | DType::Q3K => DType::Q4_0,
            _ => DType::F16,
        };
        if cols.is_multiple_of(fallback.block_len()) {
            fallback
        } else {
            DType::F16
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_k_m_gives_more_bits_where_llama_cpp_does() {
        let m = QuantMix::Q4KM;
        // 32 layers: the first 4, the last 4, and every third from layer 6.
        let more: Vec<usize> = (0..32)
            .filter(|&l| {
                m.format(&format!("blk.{l}.ffn_down.weight"), 11008, 32, 0) == Some(DType::Q6K)
            })
            .collect();
        assert_eq!(
            more,
            [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
        );
        assert_eq!(
            m.format("blk.5.attn_v.weight", 4096, 32, 0),
            Some(DType::Q4K)
        );
        assert_eq!(
            m.format("blk.6.attn_v.weight", 4096, 32, 0),
            Some(DType::Q6K)
        );
        assert_eq!(
            m.format("blk.6.attn_q.weight", 4096, 32, 0),
            Some(DType::Q4K)
        );
        assert_eq!(m.format("output.weight", 4096, 32, 0), Some(DType::Q6K));
        assert_eq!(m.format("token_embd.weight", 4096, 32, 0), Some(DType::Q4K));
        // Rows that 256-value super-blocks do not tile fall back.
        assert_eq!(
            m.format("blk.0.attn_q.weight", 96, 32, 0),
            Some(DType::Q5_0)
        );
        assert_eq!(m.format("output.weight", 96, 32, 0), Some(DType::Q8_0));
        assert_eq!(
            QuantMix::Pure(DType::Q4_0).format("x", 40, 1, 0),
            Some(DType::F16)
        );
        assert_eq!(QuantMix::parse("q4_k_m"), Some(QuantMix::Q4KM));
        // Experts: the router is never quantized; expert matrices follow their kind; an
        // 8-expert model's attention gets llama.cpp's extra bits.
        assert_eq!(m.format("blk.3.ffn_gate_inp.weight", 4096, 32, 8), None);
        assert_eq!(
            QuantMix::Pure(DType::Q8_0).format("blk.3.ffn_gate_inp.weight", 4096, 32, 8),
            None
        );
        assert_eq!(
            m.format("blk.3.ffn_down_exps.weight", 14336, 32, 8),
            Some(DType::Q6K)
        );
        assert_eq!(
            m.format("blk.4.ffn_down_exps.weight", 14336, 32, 8),
            Some(DType::Q4K)
        );
        assert_eq!(
            m.format("blk.4.ffn_gate_exps.weight", 4096, 32, 8),
            Some(DType::Q4K)
        );
        assert_eq!(
            m.format("blk.4.attn_v.weight", 4096, 32, 8),
            Some(DType::Q8_0)
        );
        assert_eq!(
            m.format("blk.4.attn_k.weight", 4096, 32, 8),
            Some(DType::Q8_0)
        );
        assert_eq!(
            m.format("blk.4.attn_output.weight", 4096, 32, 8),
            Some(DType::Q5K)
        );
        assert_eq!(
            m.format("blk.4.attn_k.weight", 4096, 48, 128),
            Some(DType::Q4K)
        );
        assert_eq!(QuantMix::parse("q6_k"), Some(QuantMix::Pure(DType::Q6K)));
        assert_eq!(QuantMix::parse("f16"), None);
    }
}
