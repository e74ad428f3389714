//! Scalar-per-row ops of the CPU backend: norms, RoPE rotation, activations, one head's attention.
//! Reductions accumulate in f64 where a long sum would otherwise drift from the references.

use super::CpuKv;
use super::kernels::Kernels;
use crate::backend::{Act, RopePairs};

/// Rows of a KV cache one head's slice at a time, as f32 (borrowed, or decoded into `tmp`).
pub trait KvRows: Sync {
    fn slice<'a>(&'a self, j: usize, col: usize, tmp: &'a mut [f32]) -> &'a [f32];
}

impl KvRows for CpuKv {
    fn slice<'a>(&'a self, j: usize, col: usize, tmp: &'a mut [f32]) -> &'a [f32] {
        CpuKv::slice(self, j, col, tmp)
    }
}

pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ss: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    let scale = 1.0 / ((ss / x.len() as f64) as f32 + eps).sqrt();
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = v * scale * g;
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

/// One query head against the first `len` cached positions; `col` is where this KV head's
/// columns start in a cache row.
#[allow(clippy::too_many_arguments)]
pub fn attend(
    k: &Kernels,
    q: &[f32],
    k_cache: &impl KvRows,
    v_cache: &impl KvRows,
    col: usize,
    hd: usize,
    len: usize,
    scale: f32,
    out: &mut [f32],
) {
    let dot = k.dot_f32;
    // Rows of f16/Q8_0 caches are decoded here, one head at a time.
    let mut tmp = vec![0f32; hd];
    let mut scores: Vec<f32> = (0..len)
        .map(|j| dot(q, k_cache.slice(j, col, &mut tmp)) * scale)
        .collect();
    let max = scores.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let mut sum = 0f64;
    for s in &mut scores {
        *s = (*s - max).exp();
        sum += *s as f64;
    }
    let inv = (1.0 / sum) as f32;
    out.fill(0.0);
    for (j, &p) in scores.iter().enumerate() {
        let v = v_cache.slice(j, col, &mut tmp);
        let w = p * inv;
        out.iter_mut().zip(v).for_each(|(o, &vv)| *o += w * vv);
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
    fn attention_over_one_position_returns_its_value() {
        let mut k = CpuKv::new(2, 2, crate::backend::KvType::F32).unwrap();
        k.write(0, &[1.0, 0.0, 9.0, 9.0]).unwrap();
        let mut v = CpuKv::new(2, 2, crate::backend::KvType::F32).unwrap();
        v.write(0, &[3.0, 4.0, 9.0, 9.0]).unwrap();
        let mut out = [0f32; 2];
        attend(
            super::super::kernels::best(),
            &[1.0, 1.0],
            &k,
            &v,
            0,
            2,
            1,
            1.0,
            &mut out,
        );
        assert_eq!(out, [3.0, 4.0]);
    }

    #[test]
    fn gelu_matches_known_values() {
        let g = activation(Act::Gelu);
        assert!((g(1.0) - 0.841_344_7).abs() < 1e-6);
        let t = activation(Act::GeluTanh);
        assert!((t(1.0) - 0.841_192).abs() < 1e-5);
    }
}
