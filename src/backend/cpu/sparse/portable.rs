//! The portable inner kernels of the sparse operators (one vector at a time; no four-row
//! kernels): the reference the x86 ones are checked against.

use half::{bf16, f16};

use super::ops::{Ops, i4_scale};
use crate::store::quant::INT4_GROUP;

pub static OPS: Ops = Ops {
    dot_i8,
    dot_i4,
    axpy_f32,
    axpy_f16,
    axpy_bf16,
    axpy_i8,
    axpy_i4,
    dot4_f16: None,
    dot4_i8: None,
    dot4_i4: None,
    axpy4_f16: None,
    axpy4_i8: None,
    axpy4_i4: None,
    dot4_tiled: None,
    axpy4_tiled: None,
};

fn dot_i8(q: &[i8], x: &[f32]) -> f32 {
    q.iter().zip(x).map(|(&c, &v)| c as f32 * v).sum()
}

fn dot_i4(scales: &[u8], q: &[u8], x: &[f32]) -> f32 {
    let mut sum = 0f32;
    for (g, (qg, xg)) in q
        .chunks_exact(INT4_GROUP / 2)
        .zip(x.chunks_exact(INT4_GROUP))
        .enumerate()
    {
        let mut s = 0f32;
        for (j, &b) in qg.iter().enumerate() {
            s += ((b & 0x0f) as i32 - 8) as f32 * xg[2 * j];
            s += ((b >> 4) as i32 - 8) as f32 * xg[2 * j + 1];
        }
        sum += i4_scale(scales, g) * s;
    }
    sum
}

fn axpy_f32(a: f32, w: &[f32], out: &mut [f32]) {
    out.iter_mut().zip(w).for_each(|(o, &c)| *o += a * c);
}
fn axpy_f16(a: f32, w: &[f16], out: &mut [f32]) {
    out.iter_mut()
        .zip(w)
        .for_each(|(o, c)| *o += a * c.to_f32());
}
fn axpy_bf16(a: f32, w: &[bf16], out: &mut [f32]) {
    out.iter_mut()
        .zip(w)
        .for_each(|(o, c)| *o += a * c.to_f32());
}
fn axpy_i8(a: f32, q: &[i8], out: &mut [f32]) {
    out.iter_mut().zip(q).for_each(|(o, &c)| *o += a * c as f32);
}
fn axpy_i4(a: f32, scales: &[u8], q: &[u8], out: &mut [f32]) {
    for (g, (qg, og)) in q
        .chunks_exact(INT4_GROUP / 2)
        .zip(out.chunks_exact_mut(INT4_GROUP))
        .enumerate()
    {
        let s = a * i4_scale(scales, g);
        for (j, &b) in qg.iter().enumerate() {
            og[2 * j] += s * ((b & 0x0f) as i32 - 8) as f32;
            og[2 * j + 1] += s * ((b >> 4) as i32 - 8) as f32;
        }
    }
}
