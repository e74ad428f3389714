//! GGML block layouts beyond the 32-value Q8_0/Q4_0/Q4_1 (those live in `tensor`): Q5_0, Q5_1
//! and the 256-value K-quants, byte for byte as `ggml-common.h` lays them out, with their
//! reference decoders. Each decoder evaluates ggml's `dequantize_row_*` formula in the same
//! order (no fused multiply-add), so the values are bit-identical to ggml's and gguf-py's.
//!
//! Decoders read bytes without assuming alignment, so they work on any slice.

use half::f16;

/// Elements per K-quant super-block.
pub const QK_K: usize = 256;

/// Q5_0: per 32 values an f16 scale `d`, the fifth bits in `qh` (bit j = value j) and 16 bytes
/// of nibbles (values 0..16 low, 16..32 high); x = d·(q − 16).
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct BlockQ5_0 {
    pub d: f16,
    pub qh: [u8; 4],
    pub qs: [u8; 16],
}

/// Q5_1: as Q5_0 with a min: x = d·q + m.
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct BlockQ5_1 {
    pub d: f16,
    pub m: f16,
    pub qh: [u8; 4],
    pub qs: [u8; 16],
}

/// Q2_K: 16 sub-blocks of 16; `scales[j]` holds a 4-bit scale (low) and 4-bit min (high);
/// x = d·sc·q − dmin·m with 2-bit q.
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct BlockQ2K {
    pub scales: [u8; 16],
    pub qs: [u8; 64],
    pub d: f16,
    pub dmin: f16,
}

/// Q3_K: 16 sub-blocks of 16 with 6-bit signed scales packed in 12 bytes; 2 low bits in `qs`,
/// the third (inverted: clear means −4) in `hmask`; x = d·(sc − 32)·(q − 4·!h).
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct BlockQ3K {
    pub hmask: [u8; 32],
    pub qs: [u8; 64],
    pub scales: [u8; 12],
    pub d: f16,
}

/// Q4_K: 8 sub-blocks of 32 with 6-bit scales and mins packed in 12 bytes; x = d·sc·q − dmin·m.
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct BlockQ4K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; 12],
    pub qs: [u8; 128],
}

/// Q5_K: Q4_K with a fifth bit per value in `qh`.
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct BlockQ5K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; 12],
    pub qh: [u8; 32],
    pub qs: [u8; 128],
}

/// Q6_K: 16 sub-blocks of 16 with i8 scales; 4 low bits in `ql`, 2 high bits in `qh`;
/// x = d·sc·(q − 32).
#[repr(C)]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub struct BlockQ6K {
    pub ql: [u8; 128],
    pub qh: [u8; 64],
    pub scales: [i8; 16],
    pub d: f16,
}

pub(crate) fn half_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// The 6-bit scale and min of sub-block `j` (0..8) packed in the 12 `scales` bytes of
/// Q4_K/Q5_K.
#[inline]
pub fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// The 16 signed 6-bit scales of a Q3_K block (`scales` bytes), as `sc − 32`.
#[inline]
pub fn q3k_scales(q: &[u8]) -> [i8; 16] {
    std::array::from_fn(|j| {
        let low = if j < 8 { q[j] & 0x0f } else { q[j - 8] >> 4 };
        let high = (q[8 + j % 4] >> (2 * (j / 4))) & 3;
        (low | (high << 4)) as i8 - 32
    })
}

/// Q5_0 (`with_min = false`, 22 bytes) or Q5_1 (`true`, 24 bytes): one block into 32 values.
pub fn decode_q5(b: &[u8], y: &mut [f32], with_min: bool) {
    let d = half_at(b, 0);
    let (m, rest) = if with_min {
        (half_at(b, 2), &b[4..])
    } else {
        (0.0, &b[2..])
    };
    let qh = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]);
    let qs = &rest[4..20];
    for j in 0..16 {
        let h0 = ((qh >> j) << 4) & 0x10;
        let h1 = (qh >> (j + 12)) & 0x10;
        let q0 = (qs[j] as u32 & 0x0f) | h0;
        let q1 = (qs[j] as u32 >> 4) | h1;
        if with_min {
            y[j] = q0 as f32 * d + m;
            y[j + 16] = q1 as f32 * d + m;
        } else {
            // ggml multiplies without adding (so a zero product keeps the sign of d).
            y[j] = (q0 as i32 - 16) as f32 * d;
            y[j + 16] = (q1 as i32 - 16) as f32 * d;
        }
    }
}

/// Q2_K: one 84-byte block into 256 values.
pub fn decode_q2k(b: &[u8], y: &mut [f32]) {
    let (scales, qs) = (&b[0..16], &b[16..80]);
    let d = half_at(b, 80);
    let dmin = half_at(b, 82);
    for (v, o) in y[..QK_K].iter_mut().enumerate() {
        let (n, j, r) = (v / 128, (v % 128) / 32, v % 32);
        let sc = scales[8 * n + 2 * j + r / 16];
        let q = (qs[32 * n + r] >> (2 * j)) & 3;
        let dl = d * (sc & 0x0f) as f32;
        let ml = dmin * (sc >> 4) as f32;
        *o = dl * q as f32 - ml;
    }
}

/// Q3_K: one 110-byte block into 256 values.
pub fn decode_q3k(b: &[u8], y: &mut [f32]) {
    let (hmask, qs) = (&b[0..32], &b[32..96]);
    let scales = q3k_scales(&b[96..108]);
    let d = half_at(b, 108);
    for (v, o) in y[..QK_K].iter_mut().enumerate() {
        let (n, j, r) = (v / 128, (v % 128) / 32, v % 32);
        let dl = d * scales[8 * n + 2 * j + r / 16] as f32;
        let low = ((qs[32 * n + r] >> (2 * j)) & 3) as i32;
        let high = hmask[r] & (1 << (4 * n + j)) != 0;
        *o = dl * (low - if high { 0 } else { 4 }) as f32;
    }
}

/// Q4_K: one 144-byte block into 256 values.
pub fn decode_q4k(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    let dmin = half_at(b, 2);
    let scales = &b[4..16];
    let qs = &b[16..144];
    for (c, (q, out)) in qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * c, scales);
        let (sc2, m2) = scale_min_k4(2 * c + 1, scales);
        let (d1, mm1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, mm2) = (d * sc2 as f32, dmin * m2 as f32);
        for l in 0..32 {
            out[l] = d1 * (q[l] & 0x0f) as f32 - mm1;
            out[l + 32] = d2 * (q[l] >> 4) as f32 - mm2;
        }
    }
}

/// Q5_K: one 176-byte block into 256 values.
pub fn decode_q5k(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    let dmin = half_at(b, 2);
    let scales = &b[4..16];
    let qh = &b[16..48];
    let qs = &b[48..176];
    for (c, (q, out)) in qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * c, scales);
        let (sc2, m2) = scale_min_k4(2 * c + 1, scales);
        let (d1, mm1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, mm2) = (d * sc2 as f32, dmin * m2 as f32);
        let (u1, u2) = (1u8 << (2 * c), 2u8 << (2 * c));
        for l in 0..32 {
            let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            out[l] = d1 * ((q[l] & 0x0f) + h1) as f32 - mm1;
            out[l + 32] = d2 * ((q[l] >> 4) + h2) as f32 - mm2;
        }
    }
}

/// Q6_K: one 210-byte block into 256 values.
pub fn decode_q6k(b: &[u8], y: &mut [f32]) {
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
            // ggml: d * sc * q, left to right, in f32.
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
    fn block_structs_have_ggml_sizes() {
        use std::mem::size_of;
        assert_eq!(size_of::<BlockQ5_0>(), 22);
        assert_eq!(size_of::<BlockQ5_1>(), 24);
        assert_eq!(size_of::<BlockQ2K>(), 84);
        assert_eq!(size_of::<BlockQ3K>(), 110);
        assert_eq!(size_of::<BlockQ4K>(), 144);
        assert_eq!(size_of::<BlockQ5K>(), 176);
        assert_eq!(size_of::<BlockQ6K>(), 210);
    }

    #[test]
    fn q4k_constant_block() {
        // d = 1, dmin = 0, every scale 1, codes 3.
        let mut b = vec![0u8; 144];
        b[0..2].copy_from_slice(&f16::from_f32(1.0).to_le_bytes());
        b[4..8].fill(1);
        b[12..16].fill(1);
        b[16..144].fill(0x33);
        let mut y = [0f32; 256];
        decode_q4k(&b, &mut y);
        assert!(y.iter().all(|&v| v == 3.0), "{y:?}");
    }

    #[test]
    fn q6k_signed_codes() {
        let mut b = vec![0u8; 210];
        b[208..210].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        b[192..208].fill(2);
        let mut y = [0f32; 256];
        decode_q6k(&b, &mut y);
        assert!(y.iter().all(|&v| v == -32.0));
    }

    #[test]
    fn q3k_scales_unpack_low_nibbles_and_high_pairs() {
        let mut q = [0u8; 12];
        q[0] = 0x21; // j = 0 low 1, j = 8 low 2
        q[8] = 0b11_10_01_00; // j = 0,4,8,12 high bits 0,1,2,3
        let s = q3k_scales(&q);
        assert_eq!(s[0], 1 - 32);
        assert_eq!(s[8], 2 + (2 << 4) - 32);
        assert_eq!(s[4], (1 << 4) - 32);
        assert_eq!(s[12], (3 << 4) - 32);
    }

    #[test]
    fn q2k_uses_scale_and_min_nibbles() {
        let mut b = vec![0u8; 84];
        b[0] = 0x32; // sub-block 0: scale 2, min 3
        b[16] = 0b11; // value 0: q = 3
        b[80..82].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        b[82..84].copy_from_slice(&f16::from_f32(0.25).to_le_bytes());
        let mut y = [0f32; 256];
        decode_q2k(&b, &mut y);
        assert_eq!(y[0], 0.5 * 2.0 * 3.0 - 0.75);
        assert_eq!(y[1], -0.75);
        assert_eq!(y[16], 0.0); // sub-block 1: scale 0, min 0
    }
}
