//! Neuron encodings of the store and their CPU reference (de)quantizers:
//! - INT8 per row, symmetric: `x ≈ s·q`, `s = max|x| / 127`, `q ∈ [-127, 127]`;
//! - INT4 per group of 32, symmetric: `x ≈ s_g·q`, `s_g = max|x_g| / 7` (stored f16),
//!   `q ∈ [-7, 7]` stored as `q + 8` in a nibble, value `2j` in the low nibble of byte `j`.
//!
//! Tests and GPU kernels are checked against these functions.

use half::f16;

/// Values per INT4 group.
pub const INT4_GROUP: usize = 32;

/// Quantize one row to INT8: (scale, codes).
pub fn int8_row(x: &[f32]) -> (f32, Vec<i8>) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let scale = amax / 127.0;
    let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
    let q = x
        .iter()
        .map(|v| (v * inv).round().clamp(-127.0, 127.0) as i8)
        .collect();
    (scale, q)
}

pub fn dequant_int8_row(scale: f32, q: &[i8], out: &mut [f32]) {
    for (o, &c) in out.iter_mut().zip(q) {
        *o = scale * c as f32;
    }
}

/// Quantize one row (length a multiple of 32) to INT4 groups: (f16 scales, packed nibbles).
pub fn int4_row(x: &[f32]) -> (Vec<f16>, Vec<u8>) {
    debug_assert!(x.len().is_multiple_of(INT4_GROUP));
    let mut scales = Vec::with_capacity(x.len() / INT4_GROUP);
    let mut packed = vec![0u8; x.len() / 2];
    for (g, group) in x.chunks_exact(INT4_GROUP).enumerate() {
        let amax = group.iter().fold(0f32, |m, v| m.max(v.abs()));
        let s = f16::from_f32(amax / 7.0);
        let sf = s.to_f32();
        let inv = if sf > 0.0 { 1.0 / sf } else { 0.0 };
        scales.push(s);
        for (j, pair) in group.chunks_exact(2).enumerate() {
            let code = |v: f32| ((v * inv).round().clamp(-7.0, 7.0) as i32 + 8) as u8;
            packed[g * INT4_GROUP / 2 + j] = code(pair[0]) | (code(pair[1]) << 4);
        }
    }
    (scales, packed)
}

pub fn dequant_int4_row(scales: &[f16], packed: &[u8], out: &mut [f32]) {
    for (i, o) in out.iter_mut().enumerate() {
        let byte = packed[i / 2];
        let nib = if i % 2 == 0 { byte & 0x0f } else { byte >> 4 };
        *o = scales[i / INT4_GROUP].to_f32() * (nib as i32 - 8) as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ramp(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0)
            .collect()
    }

    #[test]
    fn int8_error_is_within_half_a_step() {
        let x = ramp(96);
        let (s, q) = int8_row(&x);
        let mut y = vec![0f32; x.len()];
        dequant_int8_row(s, &q, &mut y);
        for (a, b) in x.iter().zip(&y) {
            assert!((a - b).abs() <= s * 0.5 + 1e-6, "{a} vs {b}");
        }
    }

    #[test]
    fn int4_error_is_within_half_a_step_per_group() {
        let x = ramp(128);
        let (s, p) = int4_row(&x);
        let mut y = vec![0f32; x.len()];
        dequant_int4_row(&s, &p, &mut y);
        for (i, (a, b)) in x.iter().zip(&y).enumerate() {
            let step = s[i / INT4_GROUP].to_f32();
            // f16 rounding of the scale can stretch the grid by a hair.
            assert!(
                (a - b).abs() <= step * 0.5 + 7.0 * step * 1e-3 + 1e-6,
                "{i}: {a} vs {b}"
            );
        }
    }

    #[test]
    fn zeros_stay_zero() {
        let (s, q) = int8_row(&[0.0; 32]);
        assert_eq!(s, 0.0);
        assert!(q.iter().all(|&c| c == 0));
        let (s4, p) = int4_row(&[0.0; 32]);
        let mut y = [1f32; 32];
        dequant_int4_row(&s4, &p, &mut y);
        assert!(y.iter().all(|&v| v == 0.0));
    }
}
