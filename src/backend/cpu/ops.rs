//! Scalar-per-row ops of the CPU backend: norms, RoPE rotation, activations.
//! Reductions accumulate in f64 where a long sum would otherwise drift from the references.

use crate::backend::{Act, RopePairs};

/// `1 / rms(x)` as every RMSNorm here takes it (the squares summed in f64, as the kernels do).
fn rms_scale(x: &[f32], eps: f32) -> f32 {
    let ss: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    1.0 / ((ss / x.len() as f64) as f32 + eps).sqrt()
}

pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let scale = rms_scale(x, eps);
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = v * scale * g;
    }
}

/// [`rms_norm`] of `x` into itself.
pub fn rms_norm_in_place(x: &mut [f32], w: &[f32], eps: f32) {
    let scale = rms_scale(x, eps);
    for (v, &g) in x.iter_mut().zip(w) {
        *v = *v * scale * g;
    }
}

pub fn layer_norm(x: &[f32], w: &[f32], b: &[f32], eps: f32, out: &mut [f32]) {
    let n = x.len() as f64;
    let mean = x.iter().map(|&v| v as f64).sum::<f64>() / n;
    let var = x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
    let inv = 1.0 / (var + eps as f64).sqrt();
    for (((o, &v), &g), &bb) in out.iter_mut().zip(x).zip(w).zip(b) {
        *o = ((v as f64 - mean) * inv) as f32 * g + bb;
    }
}

/// Rotate one head in place by the per-pair (cos, sin).
pub fn rotate(head: &mut [f32], cos_sin: &[(f32, f32)], pairs: RopePairs) {
    let half = cos_sin.len();
    for (i, &(c, s)) in cos_sin.iter().enumerate() {
        let (a, b) = match pairs {
            RopePairs::Adjacent => (2 * i, 2 * i + 1),
            RopePairs::Halves => (i, i + half),
        };
        let (x0, x1) = (head[a], head[b]);
        head[a] = x0 * c - x1 * s;
        head[b] = x0 * s + x1 * c;
    }
}

pub fn activation(act: Act) -> fn(f32) -> f32 {
    match act {
        Act::Silu => |x| x / (1.0 + (-x).exp()),
        Act::Relu => |x| x.max(0.0),
        Act::Gelu => |x| 0.5 * x * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2)),
        Act::GeluTanh => |x| {
            const C: f32 = 0.797_884_6; // sqrt(2/pi)
            0.5 * x * (1.0 + (C * (x + 0.044715 * x * x * x)).tanh())
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_unit_scale() {
        let mut out = [0f32; 4];
        rms_norm(&[2.0, -2.0, 2.0, -2.0], &[1.0; 4], 0.0, &mut out);
        assert_eq!(out, [1.0, -1.0, 1.0, -1.0]);
    }

    #[test]
    fn rotation_by_quarter_turn() {
        let mut h = [1.0f32, 0.0, 0.0, 1.0];
        let cs = [(0.0f32, 1.0f32), (0.0, 1.0)];
        rotate(&mut h, &cs, RopePairs::Adjacent);
        assert_eq!(h, [0.0, 1.0, -1.0, 0.0]);
        let mut h = [1.0f32, 0.0, 0.0, 1.0];
        rotate(&mut h, &cs, RopePairs::Halves);
        assert_eq!(h, [0.0, -1.0, 1.0, 0.0]);
    }

    #[test]
    fn gelu_matches_known_values() {
        let g = activation(Act::Gelu);
        assert!((g(1.0) - 0.841_344_7).abs() < 1e-6);
        let t = activation(Act::GeluTanh);
        assert!((t(1.0) - 0.841_192).abs() < 1e-5);
    }
}
