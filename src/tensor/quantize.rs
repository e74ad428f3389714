//! Reference quantizers: f32 values → GGML blocks, byte for byte as llama.cpp's
//! `quantize_row_*_ref` (what `llama-quantize` does without an importance matrix). Each step is
//! evaluated in ggml's order and precision (f32, no fused multiply-add), so the bytes equal
//! ggml's; `tests/kquants.rs` checks them against blocks written by ggml itself
//! (`scripts/quant_reference.py`).
//!
//! Used to make quantized models (fixtures, benchmarks); never on a hot path.

// The loops index as ggml's C does, so the order of every float operation can be compared line
// by line with `ggml-quants.c`.
#![allow(clippy::needless_range_loop)]

use half::f16;

use super::blocks::{QK_K, scale_min_k4};
use super::{DType, QK};

/// ggml's `GROUP_MAX_EPS`: a group whose largest magnitude is below this is all zeros.
const GROUP_MAX_EPS: f32 = 1e-15;

/// Round to nearest, ties to even, through the float magic number, as ggml's `nearest_int`
/// (valid for |v| ≤ 4194303).
#[inline]
fn nearest_int(v: f32) -> i32 {
    let val = v + 12_582_912.0;
    (val.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

fn f16_bytes(v: f32) -> [u8; 2] {
    f16::from_f32(v).to_le_bytes()
}

fn f16_round(v: f32) -> f32 {
    f16::from_f32(v).to_f32()
}

/// Quantize `x` (a multiple of the block length) into `out` (`dtype.bytes_for(x.len())` bytes).
/// Float formats are rounded to nearest.
pub fn quantize_row(dtype: DType, x: &[f32], out: &mut [u8]) {
    assert!(
        x.len().is_multiple_of(dtype.block_len()) && out.len() == dtype.bytes_for(x.len()),
        "{} values into {} bytes of {dtype}",
        x.len(),
        out.len()
    );
    let blocks = out.chunks_exact_mut(dtype.block_bytes());
    match dtype {
        DType::F32 => {
            for (o, v) in out.chunks_exact_mut(4).zip(x) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        DType::F16 => match bytemuck::try_cast_slice_mut::<u8, f16>(out) {
            // In bulk (F16C where the CPU has it): the same rounding as one value at a time.
            Ok(h) => half::slice::HalfFloatSliceExt::convert_from_f32_slice(h, x),
            Err(_) => {
                for (o, v) in out.chunks_exact_mut(2).zip(x) {
                    o.copy_from_slice(&f16_bytes(*v));
                }
            }
        },
        DType::BF16 => {
            for (o, v) in out.chunks_exact_mut(2).zip(x) {
                o.copy_from_slice(&half::bf16::from_f32(*v).to_le_bytes());
            }
        }
        DType::Q8_0 => blocks.zip(x.chunks(QK)).for_each(|(o, x)| q8_0(x, o)),
        DType::Q4_0 => blocks.zip(x.chunks(QK)).for_each(|(o, x)| q4_0(x, o)),
        DType::Q4_1 => blocks.zip(x.chunks(QK)).for_each(|(o, x)| q4_1(x, o)),
        DType::Q5_0 => blocks.zip(x.chunks(QK)).for_each(|(o, x)| q5_0(x, o)),
        DType::Q5_1 => blocks.zip(x.chunks(QK)).for_each(|(o, x)| q5_1(x, o)),
        DType::Q2K => blocks.zip(x.chunks(QK_K)).for_each(|(o, x)| q2k(x, o)),
        DType::Q3K => blocks.zip(x.chunks(QK_K)).for_each(|(o, x)| q3k(x, o)),
        DType::Q4K => blocks.zip(x.chunks(QK_K)).for_each(|(o, x)| q4k(x, o)),
        DType::Q5K => blocks.zip(x.chunks(QK_K)).for_each(|(o, x)| q5k(x, o)),
        DType::Q6K => blocks.zip(x.chunks(QK_K)).for_each(|(o, x)| q6k(x, o)),
    }
}

/// Q8_0: d = amax/127, q = round-half-away(x/d).
fn q8_0(x: &[f32], o: &mut [u8]) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    o[..2].copy_from_slice(&f16_bytes(d));
    for (q, v) in o[2..34].iter_mut().zip(x) {
        *q = (v * id).round() as i8 as u8;
    }
}

/// The value of largest magnitude (the first such, keeping its sign).
fn signed_max(x: &[f32]) -> (f32, f32) {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    (amax, max)
}

fn min_max(x: &[f32]) -> (f32, f32) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

/// Q4_0: d = max/−8 (the signed extreme maps to code 0), q = trunc(x/d + 8.5) ≤ 15.
fn q4_0(x: &[f32], o: &mut [u8]) {
    let (_, max) = signed_max(x);
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    o[..2].copy_from_slice(&f16_bytes(d));
    for j in 0..16 {
        let q0 = ((x[j] * id + 8.5) as i8).min(15) as u8;
        let q1 = ((x[j + 16] * id + 8.5) as i8).min(15) as u8;
        o[2 + j] = q0 | (q1 << 4);
    }
}

/// Q4_1: d = (max − min)/15, m = min, q = trunc((x − min)/d + 0.5) ≤ 15.
fn q4_1(x: &[f32], o: &mut [u8]) {
    let (min, max) = min_max(x);
    let d = (max - min) / 15.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    o[..2].copy_from_slice(&f16_bytes(d));
    o[2..4].copy_from_slice(&f16_bytes(min));
    for j in 0..16 {
        let q0 = (((x[j] - min) * id + 0.5) as i8).min(15) as u8;
        let q1 = (((x[j + 16] - min) * id + 0.5) as i8).min(15) as u8;
        o[4 + j] = q0 | (q1 << 4);
    }
}

/// Nibbles into `qs`, fifth bits into the returned `qh`.
fn pack5(codes: impl Fn(usize) -> u8, qs: &mut [u8]) -> u32 {
    let mut qh = 0u32;
    for j in 0..16 {
        let (a, b) = (codes(j), codes(j + 16));
        qs[j] = (a & 0x0f) | ((b & 0x0f) << 4);
        qh |= (((a & 0x10) >> 4) as u32) << j;
        qh |= (((b & 0x10) >> 4) as u32) << (j + 16);
    }
    qh
}

/// Q5_0: d = max/−16, q = trunc(x/d + 16.5) ≤ 31.
fn q5_0(x: &[f32], o: &mut [u8]) {
    let (_, max) = signed_max(x);
    let d = max / -16.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    o[..2].copy_from_slice(&f16_bytes(d));
    let qh = pack5(|j| ((x[j] * id + 16.5) as i8).min(31) as u8, &mut o[6..22]);
    o[2..6].copy_from_slice(&qh.to_le_bytes());
}

/// Q5_1: d = (max − min)/31, m = min, q = trunc((x − min)/d + 0.5).
fn q5_1(x: &[f32], o: &mut [u8]) {
    let (min, max) = min_max(x);
    let d = (max - min) / 31.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    o[..2].copy_from_slice(&f16_bytes(d));
    o[2..4].copy_from_slice(&f16_bytes(min));
    let qh = pack5(|j| ((x[j] - min) * id + 0.5) as u8, &mut o[8..24]);
    o[4..8].copy_from_slice(&qh.to_le_bytes());
}

/// ggml's `make_qx_quants` with `rmse_type = 1` and no importance weights: a signed scale for
/// `x` with codes in `−nmax..nmax` (stored in `l` offset by `nmax`), searched over 19 trial
/// scales for the least weighted (x²) squared error.
fn make_qx_quants(nmax: i32, x: &[f32], l: &mut [i8]) -> f32 {
    let (amax, max) = signed_max(x);
    if amax < GROUP_MAX_EPS {
        l.fill(0);
        return 0.0;
    }
    let code = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-nmax, nmax - 1);
    let sums = |iscale: f32| {
        let (mut sumlx, mut suml2) = (0f32, 0f32);
        for &v in x {
            let q = code(iscale, v) as f32;
            let w = v * v;
            sumlx += w * v * q;
            suml2 += w * q * q;
        }
        (sumlx, suml2)
    };
    let mut iscale = -(nmax as f32) / max;
    for (o, &v) in l.iter_mut().zip(x) {
        *o = (code(iscale, v) + nmax) as i8;
    }
    let (sumlx, suml2) = sums(iscale);
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        let (sumlx, suml2) = sums(iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for (o, &v) in l.iter_mut().zip(x) {
                *o = (code(iscale, v) + nmax) as i8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// ggml's `make_q3_quants` with `do_rmse`: a signed scale for codes in `−nmax..nmax`, refined
/// by up to five passes of coordinate descent; codes stored offset by `nmax`.
fn make_q3_quants(nmax: i32, x: &[f32], l: &mut [i8]) -> f32 {
    let (amax, max) = signed_max(x);
    if amax < GROUP_MAX_EPS {
        l.fill(0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    for (o, &v) in l.iter_mut().zip(x) {
        let q = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
        *o = q as i8;
        let w = v * v;
        sumlx += w * v * q as f32;
        suml2 += w * q as f32 * q as f32;
    }
    for _ in 0..5 {
        let mut changed = 0;
        for (i, &v) in x.iter().enumerate() {
            let w = v * v;
            let li = l[i] as f32;
            let mut slx = sumlx - w * v * li;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * li * li;
                let new = nearest_int(v * sl2 / slx).clamp(-nmax, nmax - 1);
                if new != l[i] as i32 {
                    slx += w * v * new as f32;
                    sl2 += w * new as f32 * new as f32;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        l[i] = new as i8;
                        sumlx = slx;
                        suml2 = sl2;
                        changed += 1;
                    }
                }
            }
        }
        if changed == 0 {
            break;
        }
    }
    for o in l.iter_mut() {
        *o += nmax as i8;
    }
    if suml2 > 0.0 { sumlx / suml2 } else { 0.0 }
}

/// ggml's `make_qkx2_quants`: a scale and a (non-positive) min for codes `0..=nmax`, searched
/// over `nstep + 1` trial scales by weighted least squares (`mad`: absolute error instead).
/// Returns (scale, −min); the codes land in `l`.
#[allow(clippy::too_many_arguments)]
fn make_qkx2_quants(
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    l: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    mad: bool,
) -> (f32, f32) {
    let n = x.len();
    let (mut min, mut max) = (x[0], x[0]);
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l.fill(0);
        return (0.0, -min);
    }
    let err = |d: f32| if mad { d.abs() } else { d * d };
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0f32;
    for i in 0..n {
        let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        l[i] = q as u8;
        let diff = scale * q as f32 + min - x[i];
        best_error += weights[i] * err(diff);
    }
    let mut aux = [0u8; 32];
    let aux = &mut aux[..n];
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for i in 0..n {
            let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            aux[i] = q as u8;
            let (w, q) = (weights[i], q as f32);
            sum_l += w * q;
            sum_l2 += w * q * q;
            sum_xl += w * q * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0f32;
            for i in 0..n {
                let diff = this_scale * aux[i] as f32 + this_min - x[i];
                cur_error += weights[i] * err(diff);
            }
            if cur_error < best_error {
                l.copy_from_slice(aux);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// Q2_K: per 16 values a scale and min (make_qkx2, |x| weights, absolute error), both
/// quantized to 4 bits against the block's largest; codes re-derived from the stored scales.
fn q2k(x: &[f32], o: &mut [u8]) {
    let mut l = [0u8; QK_K];
    let (mut scales, mut mins) = ([0f32; 16], [0f32; 16]);
    let (mut max_scale, mut max_min) = (0f32, 0f32);
    for j in 0..16 {
        let xs = &x[16 * j..16 * j + 16];
        let weights: [f32; 16] = std::array::from_fn(|i| xs[i].abs());
        let (s, m) = make_qkx2_quants(
            3,
            xs,
            &weights,
            &mut l[16 * j..16 * j + 16],
            -0.5,
            0.1,
            15,
            true,
        );
        (scales[j], mins[j]) = (s, m);
        max_scale = greater(max_scale, s);
        max_min = greater(max_min, m);
    }
    let (sc, rest) = o.split_at_mut(16);
    let (qs, dd) = rest.split_at_mut(64);
    if max_scale > 0.0 {
        let iscale = 15.0 / max_scale;
        for j in 0..16 {
            sc[j] = nearest_int(iscale * scales[j]) as u8;
        }
        dd[0..2].copy_from_slice(&f16_bytes(max_scale / 15.0));
    } else {
        sc.fill(0);
        dd[0..2].copy_from_slice(&f16_bytes(0.0));
    }
    if max_min > 0.0 {
        let iscale = 15.0 / max_min;
        for j in 0..16 {
            sc[j] |= (nearest_int(iscale * mins[j]) << 4) as u8;
        }
        dd[2..4].copy_from_slice(&f16_bytes(max_min / 15.0));
    } else {
        dd[2..4].copy_from_slice(&f16_bytes(0.0));
    }
    let d_all = f16::from_le_bytes([dd[0], dd[1]]).to_f32();
    let dmin = f16::from_le_bytes([dd[2], dd[3]]).to_f32();
    for j in 0..16 {
        let d = d_all * (sc[j] & 0x0f) as f32;
        if d == 0.0 {
            continue;
        }
        let dm = dmin * (sc[j] >> 4) as f32;
        for i in 0..16 {
            l[16 * j + i] = nearest_int((x[16 * j + i] + dm) / d).clamp(0, 3) as u8;
        }
    }
    pack2(&l, qs);
}

/// 2-bit codes: byte l of each 32-byte group holds values l, l+32, l+64, l+96 of its 128.
fn pack2(l: &[u8; QK_K], qs: &mut [u8]) {
    for (n, q) in qs.chunks_exact_mut(32).enumerate() {
        let base = 128 * n;
        for (i, b) in q.iter_mut().enumerate() {
            let at = |k: usize| l[base + i + 32 * k];
            *b = at(0) | (at(1) << 2) | (at(2) << 4) | (at(3) << 6);
        }
    }
}

/// `if v > m { v } else { m }`, as ggml writes its running maxima.
fn greater(m: f32, v: f32) -> f32 {
    if v > m { v } else { m }
}

/// Q3_K: per 16 values a signed scale (make_q3_quants), quantized to 6 bits against the
/// block's largest magnitude; codes re-derived from the stored scales.
fn q3k(x: &[f32], o: &mut [u8]) {
    let mut l = [0i8; QK_K];
    let mut scales = [0f32; 16];
    let (mut amax, mut max_scale) = (0f32, 0f32);
    for j in 0..16 {
        scales[j] = make_q3_quants(4, &x[16 * j..16 * j + 16], &mut l[16 * j..16 * j + 16]);
        if scales[j].abs() > amax {
            amax = scales[j].abs();
            max_scale = scales[j];
        }
    }
    let (hmask, rest) = o.split_at_mut(32);
    let (qs, rest) = rest.split_at_mut(64);
    let (sc, dd) = rest.split_at_mut(12);
    sc.fill(0);
    if max_scale != 0.0 {
        let iscale = -32.0 / max_scale;
        for j in 0..16 {
            let q = (nearest_int(iscale * scales[j]) as i8).clamp(-32, 31) + 32;
            let q = q as u8;
            if j < 8 {
                sc[j] = q & 0x0f;
            } else {
                sc[j - 8] |= (q & 0x0f) << 4;
            }
            sc[8 + j % 4] |= (q >> 4) << (2 * (j / 4));
        }
        dd.copy_from_slice(&f16_bytes(1.0 / iscale));
    } else {
        dd.copy_from_slice(&f16_bytes(0.0));
    }
    let d_all = f16::from_le_bytes([dd[0], dd[1]]).to_f32();
    let stored = super::blocks::q3k_scales(sc);
    for j in 0..16 {
        let d = d_all * stored[j] as f32;
        if d == 0.0 {
            continue;
        }
        for i in 0..16 {
            l[16 * j + i] = (nearest_int(x[16 * j + i] / d).clamp(-4, 3) + 4) as i8;
        }
    }
    hmask.fill(0);
    let mut codes = [0u8; QK_K];
    for (j, c) in codes.iter_mut().enumerate() {
        let mut q = l[j] as u8;
        if q > 3 {
            hmask[j % 32] |= 1 << (j / 32);
            q -= 4;
        }
        *c = q;
    }
    pack2(&codes, qs);
}

/// Q4_K and Q5_K: per 32 values a scale and min (make_qkx2 with weights av|x| + |x|), both
/// quantized to 6 bits against the block's largest; codes re-derived from the stored scales.
/// Returns the codes (0..=nmax).
fn qkx_k(x: &[f32], o: &mut [u8], nmax: i32, rmin: f32, nstep: i32) -> [u8; QK_K] {
    let mut l = [0u8; QK_K];
    let (mut scales, mut mins) = ([0f32; 8], [0f32; 8]);
    let (mut max_scale, mut max_min) = (0f32, 0f32);
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        let sum_x2 = xs.iter().fold(0f32, |s, v| s + v * v);
        let av_x = (sum_x2 / 32.0).sqrt();
        let weights: [f32; 32] = std::array::from_fn(|i| av_x + xs[i].abs());
        let (s, m) = make_qkx2_quants(
            nmax,
            xs,
            &weights,
            &mut l[32 * j..32 * j + 32],
            rmin,
            0.1,
            nstep,
            false,
        );
        (scales[j], mins[j]) = (s, m);
        max_scale = greater(max_scale, s);
        max_min = greater(max_min, m);
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let sc = &mut o[4..16];
    sc.fill(0);
    for j in 0..8 {
        let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
        if j < 4 {
            sc[j] = ls;
            sc[j + 4] = lm;
        } else {
            sc[j + 4] = (ls & 0x0f) | ((lm & 0x0f) << 4);
            sc[j - 4] |= (ls >> 4) << 6;
            sc[j] |= (lm >> 4) << 6;
        }
    }
    o[0..2].copy_from_slice(&f16_bytes(max_scale / 63.0));
    o[2..4].copy_from_slice(&f16_bytes(max_min / 63.0));
    let d_all = f16_round(max_scale / 63.0);
    let dmin = f16_round(max_min / 63.0);
    for j in 0..8 {
        let (s, m) = scale_min_k4(j, &o[4..16]);
        let d = d_all * s as f32;
        if d == 0.0 {
            continue;
        }
        let dm = dmin * m as f32;
        for i in 0..32 {
            l[32 * j + i] = nearest_int((x[32 * j + i] + dm) / d).clamp(0, nmax) as u8;
        }
    }
    l
}

fn q4k(x: &[f32], o: &mut [u8]) {
    let l = qkx_k(x, o, 15, -1.0, 20);
    for (c, q) in o[16..144].chunks_exact_mut(32).enumerate() {
        for (i, b) in q.iter_mut().enumerate() {
            *b = l[64 * c + i] | (l[64 * c + 32 + i] << 4);
        }
    }
}

fn q5k(x: &[f32], o: &mut [u8]) {
    let l = qkx_k(x, o, 31, -0.5, 15);
    let (qh, qs) = o[16..176].split_at_mut(32);
    qh.fill(0);
    for (c, q) in qs.chunks_exact_mut(32).enumerate() {
        let (m1, m2) = (1u8 << (2 * c), 2u8 << (2 * c));
        for (i, b) in q.iter_mut().enumerate() {
            let (mut l1, mut l2) = (l[64 * c + i], l[64 * c + 32 + i]);
            if l1 > 15 {
                l1 -= 16;
                qh[i] |= m1;
            }
            if l2 > 15 {
                l2 -= 16;
                qh[i] |= m2;
            }
            *b = l1 | (l2 << 4);
        }
    }
}

/// Q6_K: per 16 values a signed scale (make_qx_quants, x² weights) quantized to 8 bits against
/// the block's largest magnitude; codes re-derived from the stored scales.
fn q6k(x: &[f32], o: &mut [u8]) {
    let mut l = [0i8; QK_K];
    let mut scales = [0f32; 16];
    let (mut max_abs, mut max_scale) = (0f32, 0f32);
    for j in 0..16 {
        scales[j] = make_qx_quants(32, &x[16 * j..16 * j + 16], &mut l[16 * j..16 * j + 16]);
        if scales[j].abs() > max_abs {
            max_abs = scales[j].abs();
            max_scale = scales[j];
        }
    }
    if max_abs < GROUP_MAX_EPS {
        o.fill(0);
        return;
    }
    let iscale = -128.0 / max_scale;
    o[208..210].copy_from_slice(&f16_bytes(1.0 / iscale));
    let d_all = f16_round(1.0 / iscale);
    for j in 0..16 {
        o[192 + j] = nearest_int(iscale * scales[j]).min(127) as i8 as u8;
    }
    for j in 0..16 {
        let d = d_all * o[192 + j] as i8 as f32;
        if d == 0.0 {
            continue;
        }
        for i in 0..16 {
            l[16 * j + i] = (nearest_int(x[16 * j + i] / d).clamp(-32, 31) + 32) as i8;
        }
    }
    let (ql, qh) = o[..192].split_at_mut(128);
    for n in 0..2 {
        let (ql, qh) = (&mut ql[64 * n..64 * n + 64], &mut qh[32 * n..32 * n + 32]);
        let at = |k: usize, i: usize| l[128 * n + 32 * k + i] as u8;
        for i in 0..32 {
            ql[i] = (at(0, i) & 0x0f) | ((at(2, i) & 0x0f) << 4);
            ql[i + 32] = (at(1, i) & 0x0f) | ((at(3, i) & 0x0f) << 4);
            qh[i] = (at(0, i) >> 4)
                | ((at(1, i) >> 4) << 2)
                | ((at(2, i) >> 4) << 4)
                | ((at(3, i) >> 4) << 6);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{RngExt, SeedableRng, rngs::StdRng};

    #[test]
    fn nearest_int_rounds_half_to_even() {
        assert_eq!(nearest_int(0.5), 0);
        assert_eq!(nearest_int(1.5), 2);
        assert_eq!(nearest_int(-2.5), -2);
        assert_eq!(nearest_int(-2.6), -3);
        assert_eq!(nearest_int(31.49), 31);
    }

    /// Quantize → decode is close to the input for every block format (the tight check is the
    /// byte comparison against ggml in tests/kquants.rs).
    #[test]
    fn roundtrip_error_is_small() {
        let mut rng = StdRng::seed_from_u64(5);
        let x: Vec<f32> = (0..1024).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        for (dtype, tol) in [
            (DType::Q8_0, 0.01),
            (DType::Q4_0, 0.13), // the extreme maps to −8, so +max clamps at 7·d
            (DType::Q4_1, 0.1),
            (DType::Q5_0, 0.07),
            (DType::Q5_1, 0.05),
            (DType::Q2K, 0.4),
            (DType::Q3K, 0.3),
            (DType::Q4K, 0.1),
            (DType::Q5K, 0.05),
            (DType::Q6K, 0.03),
        ] {
            let mut bytes = vec![0u8; dtype.bytes_for(x.len())];
            quantize_row(dtype, &x, &mut bytes);
            let mut y = vec![0f32; x.len()];
            super::super::decode_row(dtype, &bytes, &mut y);
            let err = x
                .iter()
                .zip(&y)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(err < tol, "{dtype}: max error {err}");
        }
    }

    #[test]
    fn zero_rows_quantize_to_zero_values() {
        let x = vec![0f32; 256];
        for dtype in DType::ALL.into_iter().filter(|d| d.is_quantized()) {
            let mut bytes = vec![0xffu8; dtype.bytes_for(256)];
            quantize_row(dtype, &x, &mut bytes);
            let mut y = vec![1f32; 256];
            super::super::decode_row(dtype, &bytes, &mut y);
            assert!(y.iter().all(|&v| v == 0.0), "{dtype}");
        }
    }
}
