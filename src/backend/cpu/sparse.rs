//! Neuron-sparse FFN on the CPU (PowerInfer-style): compute only the neurons listed in `idx`.
//!
//! Semantics (the oracle the tests check): each function equals its dense counterpart run with
//! the hidden activations of every neuron outside `idx` set to zero.
//! - [`sparse_up`] / [`sparse_down`]: over FFN bundles ([`Bundles`]: neuron i's gate row, up row
//!   and down column side by side) in f32, f16, bf16, INT8 or INT4; `h` is compact, one value
//!   per listed neuron: `h[t·m + j]` belongs to neuron `idx[j]` (`m = idx.len()`).
//! - [`sparse_rows`] / [`sparse_down_blocks`]: over weight matrices in their storage format
//!   (GGUF blocks or floats), for models whose FFN is not bundled.
//!
//! A listed neuron appearing twice is computed twice (and added twice by the down functions):
//! the sums run over the list.

use half::{bf16, f16};
use rayon::prelude::*;

use super::kernels::{ActBlock, ActBlockK, Kernels};
use crate::backend::{BackendError, BundleShape, Result};
use crate::store::Encoding;
use crate::store::quant::INT4_GROUP;
use crate::tensor::{
    BlockQ2K, BlockQ3K, BlockQ4_0, BlockQ4_1, BlockQ4K, BlockQ5_0, BlockQ5_1, BlockQ5K, BlockQ6K,
    BlockQ8_0, DType, HostTensor, QK, QK_K,
};

fn err(op: &'static str, msg: String) -> BackendError {
    BackendError::Shape { op, msg }
}

/// A layer's FFN bundles in one encoding, borrowed (from the store's map or a buffer).
#[derive(Clone, Copy, Debug)]
pub struct Bundles<'a> {
    bytes: &'a [u8],
    enc: Encoding,
    shape: BundleShape,
    row_bytes: usize,
    neurons: usize,
}

impl<'a> Bundles<'a> {
    /// Bundles laid out as the store writes them (see `store::Encoding`): f32/f16/bf16 parts one
    /// after another; INT8 the part scales (f32) first, then the codes; INT4 all group scales
    /// (f16) first, then the packed codes.
    pub fn new(bytes: &'a [u8], enc: Encoding, shape: BundleShape) -> Result<Self> {
        let op = "sparse bundles";
        // The shape and encoding rule every backend sizes bundles by.
        let row_bytes = crate::backend::bundle_bytes("bundles", enc, shape, 1)?;
        let align = match enc {
            Encoding::Format(DType::F32) => 4,
            Encoding::Format(_) => 2,
            Encoding::Int8 | Encoding::Int4 => 1,
        };
        // Float parts are read as typed slices; the store's map and our buffers are aligned.
        if !(bytes.as_ptr() as usize).is_multiple_of(align) {
            return Err(err(
                op,
                format!("{} bundles not {align}-aligned", enc.name()),
            ));
        }
        if !bytes.len().is_multiple_of(row_bytes) {
            return Err(err(
                op,
                format!(
                    "{} bytes is not whole {row_bytes}-byte bundles",
                    bytes.len()
                ),
            ));
        }
        Ok(Bundles {
            bytes,
            enc,
            shape,
            row_bytes,
            neurons: bytes.len() / row_bytes,
        })
    }

    /// Float bundles held as a tensor (`neurons × parts·d`, as the dense kernels take them).
    pub fn from_host(t: &'a HostTensor, shape: BundleShape) -> Result<Self> {
        if t.cols != shape.parts * shape.d {
            return Err(err(
                "sparse bundles",
                format!(
                    "`{}` has {} columns, not {}×{}",
                    t.name, t.cols, shape.parts, shape.d
                ),
            ));
        }
        Bundles::new(t.data.as_slice(), Encoding::Format(t.dtype), shape)
    }

    pub fn neurons(&self) -> usize {
        self.neurons
    }

    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    pub fn shape(&self) -> BundleShape {
        self.shape
    }

    /// Part `p` of bundle `i` (`i < neurons`, `p < parts`: checked by the callers).
    fn part(&self, i: usize, p: usize) -> Vector<'a> {
        let BundleShape { parts, d } = self.shape;
        let row = &self.bytes[i * self.row_bytes..(i + 1) * self.row_bytes];
        match self.enc {
            Encoding::Format(DType::F32) => {
                Vector::F32(bytemuck::cast_slice(&row[p * d * 4..(p + 1) * d * 4]))
            }
            Encoding::Format(DType::F16) => {
                Vector::F16(bytemuck::cast_slice(&row[p * d * 2..(p + 1) * d * 2]))
            }
            Encoding::Format(DType::BF16) => {
                Vector::Bf16(bytemuck::cast_slice(&row[p * d * 2..(p + 1) * d * 2]))
            }
            Encoding::Int8 => {
                let mut s = [0u8; 4];
                s.copy_from_slice(&row[p * 4..p * 4 + 4]);
                let at = parts * 4 + p * d;
                Vector::I8 {
                    scale: f32::from_le_bytes(s),
                    q: bytemuck::cast_slice(&row[at..at + d]),
                }
            }
            Encoding::Int4 => {
                let groups = d / INT4_GROUP;
                let at = parts * groups * 2 + p * d / 2;
                Vector::I4 {
                    scales: &row[p * groups * 2..(p + 1) * groups * 2],
                    q: &row[at..at + d / 2],
                }
            }
            // `new` admits no other encoding.
            Encoding::Format(_) => unreachable!("checked in Bundles::new"),
        }
    }

    /// Checks shared by the bundle functions: every listed neuron exists.
    fn check_idx(&self, op: &'static str, idx: &[u32]) -> Result<()> {
        match idx.iter().find(|&&i| i as usize >= self.neurons) {
            Some(i) => Err(err(
                op,
                format!("neuron {i} listed, the bundles hold {}", self.neurons),
            )),
            None => Ok(()),
        }
    }
}

/// One weight vector in its encoding.
#[derive(Clone, Copy)]
enum Vector<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    Bf16(&'a [bf16]),
    /// value = scale · q
    I8 {
        scale: f32,
        q: &'a [i8],
    },
    /// value = scale(group) · (nibble − 8); `scales` holds little-endian f16s.
    I4 {
        scales: &'a [u8],
        q: &'a [u8],
    },
}

impl<'a> Vector<'a> {
    /// Elements `c0..c1`; for INT4 both are multiples of the group (the callers split so).
    fn slice(self, c0: usize, c1: usize) -> Vector<'a> {
        match self {
            Vector::F32(v) => Vector::F32(&v[c0..c1]),
            Vector::F16(v) => Vector::F16(&v[c0..c1]),
            Vector::Bf16(v) => Vector::Bf16(&v[c0..c1]),
            Vector::I8 { scale, q } => Vector::I8 {
                scale,
                q: &q[c0..c1],
            },
            Vector::I4 { scales, q } => {
                debug_assert!(c0.is_multiple_of(INT4_GROUP) && c1.is_multiple_of(INT4_GROUP));
                Vector::I4 {
                    scales: &scales[c0 / INT4_GROUP * 2..c1 / INT4_GROUP * 2],
                    q: &q[c0 / 2..c1 / 2],
                }
            }
        }
    }

    fn dot(self, k: &Kernels, o: &Ops, x: &[f32]) -> f32 {
        match self {
            Vector::F32(w) => (k.dot_f32)(w, x),
            Vector::F16(w) => (k.dot_f16)(w, x),
            Vector::Bf16(w) => (k.dot_bf16)(w, x),
            Vector::I8 { scale, q } => scale * (o.dot_i8)(q, x),
            Vector::I4 { scales, q } => (o.dot_i4)(scales, q, x),
        }
    }

    /// `out += a · self`
    fn axpy(self, o: &Ops, a: f32, out: &mut [f32]) {
        match self {
            Vector::F32(w) => (o.axpy_f32)(a, w, out),
            Vector::F16(w) => (o.axpy_f16)(a, w, out),
            Vector::Bf16(w) => (o.axpy_bf16)(a, w, out),
            Vector::I8 { scale, q } => (o.axpy_i8)(a * scale, q, out),
            Vector::I4 { scales, q } => (o.axpy_i4)(a, scales, q, out),
        }
    }
}

/// `[rows[r] · x]` for the first `live` rows (the rest are padding: repeats of a live row,
/// their results unused). All rows share one encoding (one bundle part kind); `next` is the
/// group to be read after this one, whose rows are prefetched while this one is summed.
fn dot4(
    k: &Kernels,
    o: &Ops,
    rows: [Vector; 4],
    next: [Vector; 4],
    live: usize,
    x: &[f32],
) -> [f32; 4] {
    match (rows[0], o.dot4_f16, o.dot4_i8, o.dot4_i4) {
        (Vector::F16(_), Some(f4), _, _) => {
            return f4(rows.map(|r| r.f16()), next.map(|r| r.f16()), x);
        }
        (Vector::I8 { .. }, _, Some(f4), _) => {
            let s = f4(rows.map(|r| r.i8_codes()), next.map(|r| r.i8_codes()), x);
            return [0, 1, 2, 3].map(|r| rows[r].i8_scale() * s[r]);
        }
        (Vector::I4 { .. }, _, _, Some(f4)) => {
            return f4(rows.map(|r| r.i4_row()), next.map(|r| r.i4_row()), x);
        }
        _ => {}
    }
    let mut s = [0f32; 4];
    for (v, r) in s.iter_mut().zip(rows).take(live) {
        *v = r.dot(k, o, x);
    }
    s
}

/// `out += Σ_r a[r] · cols[r]` over the first `live` columns (padding columns have `a = 0`);
/// `next` as for [`dot4`].
fn axpy4(o: &Ops, a: [f32; 4], cols: [Vector; 4], next: [Vector; 4], live: usize, out: &mut [f32]) {
    match (cols[0], o.axpy4_f16, o.axpy4_i8, o.axpy4_i4) {
        (Vector::F16(_), Some(f4), _, _) => {
            return f4(a, cols.map(|c| c.f16()), next.map(|c| c.f16()), out);
        }
        (Vector::I8 { .. }, _, Some(f4), _) => {
            let a = [0, 1, 2, 3].map(|r| a[r] * cols[r].i8_scale());
            return f4(
                a,
                cols.map(|c| c.i8_codes()),
                next.map(|c| c.i8_codes()),
                out,
            );
        }
        (Vector::I4 { .. }, _, _, Some(f4)) => {
            return f4(a, cols.map(|c| c.i4_row()), next.map(|c| c.i4_row()), out);
        }
        _ => {}
    }
    for (&a, c) in a.iter().zip(cols).take(live) {
        // Zero weights add nothing (and ReLU models have many).
        if a != 0.0 {
            c.axpy(o, a, out);
        }
    }
}

impl<'a> Vector<'a> {
    // Accessors for the group dispatch above: a group's vectors share one variant (one part
    // kind of one bundle set), so the dispatch looks at the first.
    fn f16(self) -> &'a [f16] {
        match self {
            Vector::F16(v) => v,
            _ => &[],
        }
    }
    fn i8_codes(self) -> &'a [i8] {
        match self {
            Vector::I8 { q, .. } => q,
            _ => &[],
        }
    }
    fn i8_scale(self) -> f32 {
        match self {
            Vector::I8 { scale, .. } => scale,
            _ => 0.0,
        }
    }
    fn i4_row(self) -> I4Row<'a> {
        match self {
            Vector::I4 { scales, q } => (scales, q),
            _ => (&[], &[]),
        }
    }
}

/// The kernels `Kernels` lacks: INT8/INT4 dots with f32 activations and the column axpys.
struct Ops {
    dot_i8: fn(&[i8], &[f32]) -> f32,
    dot_i4: fn(&[u8], &[u8], &[f32]) -> f32,
    axpy_f32: fn(f32, &[f32], &mut [f32]),
    axpy_f16: fn(f32, &[f16], &mut [f32]),
    axpy_bf16: fn(f32, &[bf16], &mut [f32]),
    axpy_i8: fn(f32, &[i8], &mut [f32]),
    axpy_i4: fn(f32, &[u8], &[u8], &mut [f32]),
    /// Four rows against one `x` in one pass (the loads of `x` shared), prefetching the next
    /// group's rows ahead of the reads; `None` where the per-row kernels serve (portable).
    /// INT8 sums come unscaled.
    dot4_f16: Option<Dot4F16>,
    dot4_i8: Option<Dot4I8>,
    dot4_i4: Option<Dot4I4>,
    /// `out += Σ_r a[r] · col[r]`, in the order of `r` (as four axpys would add), the next
    /// group's columns prefetched; the output tile is read and written once per four columns.
    axpy4_f16: Option<Axpy4F16>,
    axpy4_i8: Option<Axpy4I8>,
    axpy4_i4: Option<Axpy4I4>,
}

// The four-row kernels: (rows, next rows, x) and (weights, columns, next columns, out).
type Dot4F16 = fn([&[f16]; 4], [&[f16]; 4], &[f32]) -> [f32; 4];
type Dot4I8 = fn([&[i8]; 4], [&[i8]; 4], &[f32]) -> [f32; 4];
type Dot4I4 = fn([I4Row; 4], [I4Row; 4], &[f32]) -> [f32; 4];
type Axpy4F16 = fn([f32; 4], [&[f16]; 4], [&[f16]; 4], &mut [f32]);
type Axpy4I8 = fn([f32; 4], [&[i8]; 4], [&[i8]; 4], &mut [f32]);
type Axpy4I4 = fn([f32; 4], [I4Row; 4], [I4Row; 4], &mut [f32]);

/// An INT4 vector: its group scales (little-endian f16s) and packed codes.
type I4Row<'a> = (&'a [u8], &'a [u8]);

/// Ours to go with kernel set `k`: every set but the portable one implies AVX2+FMA+F16C (see
/// `kernels::available`), so the choice follows it, and a test forcing portable gets portable.
fn ops(k: &Kernels) -> &'static Ops {
    #[cfg(target_arch = "x86_64")]
    if k.name != super::kernels::PORTABLE.name {
        return &x86::OPS;
    }
    let _ = k;
    &portable::OPS
}

fn i4_scale(scales: &[u8], g: usize) -> f32 {
    f16::from_le_bytes([scales[2 * g], scales[2 * g + 1]]).to_f32()
}

mod portable {
    use super::*;

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
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use crate::backend::cpu::kernels::kq::x86::hsum;
    use half::bf16;
    use std::arch::x86_64::*;

    pub static OPS: Ops = Ops {
        dot_i8,
        dot_i4,
        axpy_f32,
        axpy_f16,
        axpy_bf16,
        axpy_i8,
        axpy_i4,
        dot4_f16: Some(dot4_f16),
        dot4_i8: Some(dot4_i8),
        dot4_i4: Some(dot4_i4),
        axpy4_f16: Some(axpy4_f16),
        axpy4_i8: Some(axpy4_i8),
        axpy4_i4: Some(axpy4_i4),
    };

    // The safe wrappers are installed only with a kernel set that required AVX2+FMA+F16C.

    fn dot_i8(q: &[i8], x: &[f32]) -> f32 {
        // SAFETY: AVX2+FMA present (see `ops`).
        unsafe { dot_i8_avx2(q, x) }
    }
    fn dot_i4(scales: &[u8], q: &[u8], x: &[f32]) -> f32 {
        // SAFETY: as above.
        unsafe { dot_i4_avx2(scales, q, x) }
    }
    fn axpy_f32(a: f32, w: &[f32], out: &mut [f32]) {
        // SAFETY: as above.
        unsafe { axpy_f32_avx2(a, w, out) }
    }
    fn axpy_f16(a: f32, w: &[f16], out: &mut [f32]) {
        // SAFETY: as above, plus F16C.
        unsafe { axpy_f16_avx2(a, w, out) }
    }
    fn axpy_bf16(a: f32, w: &[bf16], out: &mut [f32]) {
        // SAFETY: as above.
        unsafe { axpy_bf16_avx2(a, w, out) }
    }
    fn axpy_i8(a: f32, q: &[i8], out: &mut [f32]) {
        // SAFETY: as above.
        unsafe { axpy_i8_avx2(a, q, out) }
    }
    fn axpy_i4(a: f32, scales: &[u8], q: &[u8], out: &mut [f32]) {
        // SAFETY: as above.
        unsafe { axpy_i4_avx2(a, scales, q, out) }
    }
    fn dot4_f16(w: [&[f16]; 4], next: [&[f16]; 4], x: &[f32]) -> [f32; 4] {
        // SAFETY: as above, plus F16C.
        unsafe { dot4_f16_avx2(w, next, x) }
    }
    fn dot4_i8(q: [&[i8]; 4], next: [&[i8]; 4], x: &[f32]) -> [f32; 4] {
        // SAFETY: as above.
        unsafe { dot4_i8_avx2(q, next, x) }
    }
    fn dot4_i4(w: [I4Row; 4], next: [I4Row; 4], x: &[f32]) -> [f32; 4] {
        // SAFETY: as above, plus F16C.
        unsafe { dot4_i4_avx2(w, next, x) }
    }
    fn axpy4_f16(a: [f32; 4], w: [&[f16]; 4], next: [&[f16]; 4], out: &mut [f32]) {
        // SAFETY: as above, plus F16C.
        unsafe { axpy4_f16_avx2(a, w, next, out) }
    }
    fn axpy4_i8(a: [f32; 4], q: [&[i8]; 4], next: [&[i8]; 4], out: &mut [f32]) {
        // SAFETY: as above.
        unsafe { axpy4_i8_avx2(a, q, next, out) }
    }
    fn axpy4_i4(a: [f32; 4], w: [I4Row; 4], next: [I4Row; 4], out: &mut [f32]) {
        // SAFETY: as above, plus F16C.
        unsafe { axpy4_i4_avx2(a, w, next, out) }
    }

    /// 8 signed bytes at `p` as floats.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn i8x8(p: *const i8) -> __m256 {
        // SAFETY: the caller guarantees 8 readable bytes.
        unsafe { _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i))) }
    }

    /// One INT4 group (16 bytes at `p`) as four vectors of 8 values `nibble − 8`, in order.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn i4x32(p: *const u8) -> [__m256; 4] {
        // SAFETY: the caller guarantees 16 readable bytes.
        let b = unsafe { _mm_loadu_si128(p as *const __m128i) };
        let m = _mm_set1_epi8(0x0f);
        let lo = _mm_and_si128(b, m);
        let hi = _mm_and_si128(_mm_srli_epi16::<4>(b), m);
        // Byte j holds values 2j (low nibble) and 2j+1 (high): interleave to restore order.
        let eight = _mm_set1_epi8(8);
        let v0 = _mm_sub_epi8(_mm_unpacklo_epi8(lo, hi), eight);
        let v1 = _mm_sub_epi8(_mm_unpackhi_epi8(lo, hi), eight);
        let cvt = |v: __m128i| _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
        [
            cvt(v0),
            cvt(_mm_srli_si128::<8>(v0)),
            cvt(v1),
            cvt(_mm_srli_si128::<8>(v1)),
        ]
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn dot_i8_avx2(q: &[i8], x: &[f32]) -> f32 {
        let n = q.len().min(x.len());
        let (qp, xp) = (q.as_ptr(), x.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 2];
        let mut i = 0;
        // SAFETY: every load reads 8 values at i + 8 ≤ n (16 for the pair).
        unsafe {
            while i + 16 <= n {
                acc[0] = _mm256_fmadd_ps(i8x8(qp.add(i)), _mm256_loadu_ps(xp.add(i)), acc[0]);
                acc[1] =
                    _mm256_fmadd_ps(i8x8(qp.add(i + 8)), _mm256_loadu_ps(xp.add(i + 8)), acc[1]);
                i += 16;
            }
            while i + 8 <= n {
                acc[0] = _mm256_fmadd_ps(i8x8(qp.add(i)), _mm256_loadu_ps(xp.add(i)), acc[0]);
                i += 8;
            }
        }
        let mut sum = hsum(_mm256_add_ps(acc[0], acc[1]));
        for j in i..n {
            sum += q[j] as f32 * x[j];
        }
        sum
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn dot_i4_avx2(scales: &[u8], q: &[u8], x: &[f32]) -> f32 {
        let groups = (q.len() / (INT4_GROUP / 2))
            .min(x.len() / INT4_GROUP)
            .min(scales.len() / 2);
        let mut acc = [_mm256_setzero_ps(); 2];
        for g in 0..groups {
            // SAFETY: group g < groups: 16 code bytes and 32 activations in bounds.
            unsafe {
                let v = i4x32(q.as_ptr().add(g * INT4_GROUP / 2));
                let xp = x.as_ptr().add(g * INT4_GROUP);
                let mut s = _mm256_mul_ps(v[0], _mm256_loadu_ps(xp));
                s = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xp.add(8)), s);
                let mut t = _mm256_mul_ps(v[2], _mm256_loadu_ps(xp.add(16)));
                t = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xp.add(24)), t);
                let d = _mm256_set1_ps(i4_scale(scales, g));
                // Two accumulators so consecutive groups do not wait on one FMA chain.
                acc[g & 1] = _mm256_fmadd_ps(d, _mm256_add_ps(s, t), acc[g & 1]);
            }
        }
        hsum(_mm256_add_ps(acc[0], acc[1]))
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn axpy_f32_avx2(a: f32, w: &[f32], out: &mut [f32]) {
        let n = w.len().min(out.len());
        let av = _mm256_set1_ps(a);
        let (wp, op) = (w.as_ptr(), out.as_mut_ptr());
        let mut i = 0;
        // SAFETY: 8 values at i + 8 ≤ n.
        unsafe {
            while i + 8 <= n {
                let o = _mm256_fmadd_ps(av, _mm256_loadu_ps(wp.add(i)), _mm256_loadu_ps(op.add(i)));
                _mm256_storeu_ps(op.add(i), o);
                i += 8;
            }
        }
        for j in i..n {
            out[j] += a * w[j];
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn axpy_f16_avx2(a: f32, w: &[f16], out: &mut [f32]) {
        let n = w.len().min(out.len());
        let av = _mm256_set1_ps(a);
        let (wp, op) = (w.as_ptr() as *const u16, out.as_mut_ptr());
        let mut i = 0;
        // SAFETY: 8 values at i + 8 ≤ n.
        unsafe {
            while i + 8 <= n {
                let c = _mm256_cvtph_ps(_mm_loadu_si128(wp.add(i) as *const __m128i));
                _mm256_storeu_ps(
                    op.add(i),
                    _mm256_fmadd_ps(av, c, _mm256_loadu_ps(op.add(i))),
                );
                i += 8;
            }
        }
        for j in i..n {
            out[j] += a * w[j].to_f32();
        }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn axpy_bf16_avx2(a: f32, w: &[bf16], out: &mut [f32]) {
        let n = w.len().min(out.len());
        let av = _mm256_set1_ps(a);
        let (wp, op) = (w.as_ptr() as *const u16, out.as_mut_ptr());
        let mut i = 0;
        // SAFETY: 8 values at i + 8 ≤ n.
        unsafe {
            while i + 8 <= n {
                // bf16 is the top half of an f32.
                let c = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
                    _mm_loadu_si128(wp.add(i) as *const __m128i),
                )));
                _mm256_storeu_ps(
                    op.add(i),
                    _mm256_fmadd_ps(av, c, _mm256_loadu_ps(op.add(i))),
                );
                i += 8;
            }
        }
        for j in i..n {
            out[j] += a * w[j].to_f32();
        }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn axpy_i8_avx2(a: f32, q: &[i8], out: &mut [f32]) {
        let n = q.len().min(out.len());
        let av = _mm256_set1_ps(a);
        let (qp, op) = (q.as_ptr(), out.as_mut_ptr());
        let mut i = 0;
        // SAFETY: 8 values at i + 8 ≤ n.
        unsafe {
            while i + 8 <= n {
                let o = _mm256_fmadd_ps(av, i8x8(qp.add(i)), _mm256_loadu_ps(op.add(i)));
                _mm256_storeu_ps(op.add(i), o);
                i += 8;
            }
        }
        for j in i..n {
            out[j] += a * q[j] as f32;
        }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn axpy_i4_avx2(a: f32, scales: &[u8], q: &[u8], out: &mut [f32]) {
        let groups = (q.len() / (INT4_GROUP / 2))
            .min(out.len() / INT4_GROUP)
            .min(scales.len() / 2);
        for g in 0..groups {
            let s = _mm256_set1_ps(a * i4_scale(scales, g));
            // SAFETY: group g < groups: 16 code bytes and 32 outputs in bounds.
            unsafe {
                let v = i4x32(q.as_ptr().add(g * INT4_GROUP / 2));
                let op = out.as_mut_ptr().add(g * INT4_GROUP);
                for (k, vk) in v.iter().enumerate() {
                    let p = op.add(8 * k);
                    _mm256_storeu_ps(p, _mm256_fmadd_ps(s, *vk, _mm256_loadu_ps(p)));
                }
            }
        }
    }

    /// How far ahead of its reads each row is prefetched, bytes. Listed neurons' rows are
    /// short runs at random places: the hardware prefetchers restart at every row and every
    /// 4 KiB page, so we ask for the lines ourselves (measured: 256–1024 B all help, 512 best).
    const PREFETCH: usize = 512;

    /// Prefetch the line `PREFETCH` bytes past byte `at` of `row` (`len` bytes), or, past its
    /// end, the corresponding line of `next` (the row read after it).
    #[inline(always)]
    fn prefetch_ahead(row: *const u8, len: usize, next: *const u8, at: usize) {
        let a = at + PREFETCH;
        prefetch(if a < len {
            row.wrapping_add(a)
        } else {
            next.wrapping_add(a - len)
        });
    }

    #[inline(always)]
    fn prefetch(p: *const u8) {
        // SAFETY: a prefetch is a hint: it never faults, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p as *const i8) };
    }

    /// Every line of the next rows' INT4 scales, which sit apart from their codes.
    #[inline(always)]
    fn prefetch_scales(next: &[I4Row; 4]) {
        for (s, _) in next {
            for at in (0..s.len()).step_by(64) {
                prefetch(s.as_ptr().wrapping_add(at));
            }
        }
    }

    /// The f16 at `s[2g..2g + 2]` (little-endian) by F16C (`half`'s software path is slow).
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    fn scale_at(s: &[u8], g: usize) -> f32 {
        let v = u16::from_le_bytes([s[2 * g], s[2 * g + 1]]);
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(v as i32)))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot4_f16_avx2(w: [&[f16]; 4], next: [&[f16]; 4], x: &[f32]) -> [f32; 4] {
        let n = w.iter().map(|r| r.len()).fold(x.len(), usize::min);
        let p = w.map(|r| r.as_ptr() as *const u16);
        let nx = next.map(|r| r.as_ptr() as *const u8);
        let xp = x.as_ptr();
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        // SAFETY: loads of 8 values at o + 8 ≤ i + 32 ≤ n (8 for the second loop).
        unsafe {
            while i + 32 <= n {
                // 32 halves: one line of each row.
                for r in 0..4 {
                    prefetch_ahead(p[r] as *const u8, 2 * n, nx[r], 2 * i);
                }
                for o in (i..i + 32).step_by(8) {
                    let xv = _mm256_loadu_ps(xp.add(o));
                    for r in 0..4 {
                        let wv = _mm256_cvtph_ps(_mm_loadu_si128(p[r].add(o) as *const __m128i));
                        acc[r] = _mm256_fmadd_ps(wv, xv, acc[r]);
                    }
                }
                i += 32;
            }
            while i + 8 <= n {
                let xv = _mm256_loadu_ps(xp.add(i));
                for r in 0..4 {
                    let wv = _mm256_cvtph_ps(_mm_loadu_si128(p[r].add(i) as *const __m128i));
                    acc[r] = _mm256_fmadd_ps(wv, xv, acc[r]);
                }
                i += 8;
            }
        }
        let mut s = acc.map(|a| hsum(a));
        for j in i..n {
            for r in 0..4 {
                s[r] += w[r][j].to_f32() * x[j];
            }
        }
        s
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn dot4_i8_avx2(q: [&[i8]; 4], next: [&[i8]; 4], x: &[f32]) -> [f32; 4] {
        let n = q.iter().map(|r| r.len()).fold(x.len(), usize::min);
        let p = q.map(|r| r.as_ptr());
        let nx = next.map(|r| r.as_ptr() as *const u8);
        let xp = x.as_ptr();
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        // SAFETY: loads of 8 values at o + 8 ≤ i + 64 ≤ n (8 for the second loop).
        unsafe {
            while i + 64 <= n {
                for r in 0..4 {
                    prefetch_ahead(p[r] as *const u8, n, nx[r], i);
                }
                for o in (i..i + 64).step_by(8) {
                    let xv = _mm256_loadu_ps(xp.add(o));
                    for r in 0..4 {
                        acc[r] = _mm256_fmadd_ps(i8x8(p[r].add(o)), xv, acc[r]);
                    }
                }
                i += 64;
            }
            while i + 8 <= n {
                let xv = _mm256_loadu_ps(xp.add(i));
                for r in 0..4 {
                    acc[r] = _mm256_fmadd_ps(i8x8(p[r].add(i)), xv, acc[r]);
                }
                i += 8;
            }
        }
        let mut s = acc.map(|a| hsum(a));
        for j in i..n {
            for r in 0..4 {
                s[r] += q[r][j] as f32 * x[j];
            }
        }
        s
    }

    /// Whole groups in all four INT4 rows and `x`.
    fn i4_groups(w: &[I4Row; 4], len: usize) -> usize {
        w.iter()
            .map(|(s, q)| (s.len() / 2).min(q.len() / (INT4_GROUP / 2)))
            .fold(len / INT4_GROUP, usize::min)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot4_i4_avx2(w: [I4Row; 4], next: [I4Row; 4], x: &[f32]) -> [f32; 4] {
        let groups = i4_groups(&w, x.len());
        let nx = next.map(|(_, q)| q.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        prefetch_scales(&next);
        for g in 0..groups {
            // 16 code bytes per group: one line of each row per 4 groups.
            if g % 4 == 0 {
                for r in 0..4 {
                    prefetch_ahead(w[r].1.as_ptr(), groups * 16, nx[r], g * 16);
                }
            }
            // SAFETY: group g < groups: 16 code bytes of every row and 32 activations in bounds.
            unsafe {
                let xp = x.as_ptr().add(g * INT4_GROUP);
                let xv = [0, 8, 16, 24].map(|o| _mm256_loadu_ps(xp.add(o)));
                for r in 0..4 {
                    let v = i4x32(w[r].1.as_ptr().add(g * INT4_GROUP / 2));
                    let s = _mm256_fmadd_ps(v[1], xv[1], _mm256_mul_ps(v[0], xv[0]));
                    let t = _mm256_fmadd_ps(v[3], xv[3], _mm256_mul_ps(v[2], xv[2]));
                    let d = _mm256_set1_ps(scale_at(w[r].0, g));
                    acc[r] = _mm256_fmadd_ps(d, _mm256_add_ps(s, t), acc[r]);
                }
            }
        }
        acc.map(|a| hsum(a))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn axpy4_f16_avx2(a: [f32; 4], w: [&[f16]; 4], next: [&[f16]; 4], out: &mut [f32]) {
        let n = w.iter().map(|r| r.len()).fold(out.len(), usize::min);
        let av = a.map(|v| _mm256_set1_ps(v));
        let p = w.map(|r| r.as_ptr() as *const u16);
        let nx = next.map(|r| r.as_ptr() as *const u8);
        let op = out.as_mut_ptr();
        let mut i = 0;
        // SAFETY: 8 values at o + 8 ≤ i + 32 ≤ n (8 for the second loop).
        unsafe {
            while i + 32 <= n {
                for r in 0..4 {
                    prefetch_ahead(p[r] as *const u8, 2 * n, nx[r], 2 * i);
                }
                for o in (i..i + 32).step_by(8) {
                    let mut v = _mm256_loadu_ps(op.add(o));
                    for r in 0..4 {
                        let c = _mm256_cvtph_ps(_mm_loadu_si128(p[r].add(o) as *const __m128i));
                        v = _mm256_fmadd_ps(av[r], c, v);
                    }
                    _mm256_storeu_ps(op.add(o), v);
                }
                i += 32;
            }
            while i + 8 <= n {
                let mut v = _mm256_loadu_ps(op.add(i));
                for r in 0..4 {
                    let c = _mm256_cvtph_ps(_mm_loadu_si128(p[r].add(i) as *const __m128i));
                    v = _mm256_fmadd_ps(av[r], c, v);
                }
                _mm256_storeu_ps(op.add(i), v);
                i += 8;
            }
        }
        for j in i..n {
            for r in 0..4 {
                out[j] += a[r] * w[r][j].to_f32();
            }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn axpy4_i8_avx2(a: [f32; 4], q: [&[i8]; 4], next: [&[i8]; 4], out: &mut [f32]) {
        let n = q.iter().map(|r| r.len()).fold(out.len(), usize::min);
        let av = a.map(|v| _mm256_set1_ps(v));
        let p = q.map(|r| r.as_ptr());
        let nx = next.map(|r| r.as_ptr() as *const u8);
        let op = out.as_mut_ptr();
        let mut i = 0;
        // SAFETY: 8 values at o + 8 ≤ i + 64 ≤ n (8 for the second loop).
        unsafe {
            while i + 64 <= n {
                for r in 0..4 {
                    prefetch_ahead(p[r] as *const u8, n, nx[r], i);
                }
                for o in (i..i + 64).step_by(8) {
                    let mut v = _mm256_loadu_ps(op.add(o));
                    for r in 0..4 {
                        v = _mm256_fmadd_ps(av[r], i8x8(p[r].add(o)), v);
                    }
                    _mm256_storeu_ps(op.add(o), v);
                }
                i += 64;
            }
            while i + 8 <= n {
                let mut v = _mm256_loadu_ps(op.add(i));
                for r in 0..4 {
                    v = _mm256_fmadd_ps(av[r], i8x8(p[r].add(i)), v);
                }
                _mm256_storeu_ps(op.add(i), v);
                i += 8;
            }
        }
        for j in i..n {
            for r in 0..4 {
                out[j] += a[r] * q[r][j] as f32;
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn axpy4_i4_avx2(a: [f32; 4], w: [I4Row; 4], next: [I4Row; 4], out: &mut [f32]) {
        let groups = i4_groups(&w, out.len());
        let nx = next.map(|(_, q)| q.as_ptr());
        prefetch_scales(&next);
        for g in 0..groups {
            if g % 4 == 0 {
                for r in 0..4 {
                    prefetch_ahead(w[r].1.as_ptr(), groups * 16, nx[r], g * 16);
                }
            }
            // SAFETY: group g < groups: 16 code bytes of every row and 32 outputs in bounds.
            unsafe {
                let op = out.as_mut_ptr().add(g * INT4_GROUP);
                let mut o = [0, 8, 16, 24].map(|k| _mm256_loadu_ps(op.add(k)));
                for r in 0..4 {
                    let s = _mm256_set1_ps(a[r] * scale_at(w[r].0, g));
                    let v = i4x32(w[r].1.as_ptr().add(g * INT4_GROUP / 2));
                    for k in 0..4 {
                        o[k] = _mm256_fmadd_ps(s, v[k], o[k]);
                    }
                }
                for (k, ok) in o.iter().enumerate() {
                    _mm256_storeu_ps(op.add(8 * k), *ok);
                }
            }
        }
    }
}

/// Listed neurons per parallel task of the row-wise functions.
const NEURONS_PER_TASK: usize = 32;

/// `out[t·m + j] = f(j, t)` for `m` items and `n` tokens, items split over rayon tasks.
/// `f(js, vals)` fills a run of items `js`, item-major (`vals[(j − js.start)·n + t]`); for
/// `n > 1` the runs are transposed into `out` afterwards.
fn per_items(
    m: usize,
    n: usize,
    out: &mut [f32],
    f: impl Fn(std::ops::Range<usize>, &mut [f32]) + Sync,
) {
    debug_assert_eq!(out.len(), m * n);
    let task = |(c, o): (usize, &mut [f32])| {
        let j0 = c * NEURONS_PER_TASK;
        f(j0..j0 + o.len() / n.max(1), o)
    };
    if n == 1 {
        if m <= NEURONS_PER_TASK {
            out.chunks_mut(NEURONS_PER_TASK).enumerate().for_each(task);
        } else {
            out.par_chunks_mut(NEURONS_PER_TASK)
                .enumerate()
                .for_each(task);
        }
        return;
    }
    let mut tr = vec![0f32; m * n];
    tr.par_chunks_mut(NEURONS_PER_TASK * n)
        .enumerate()
        .for_each(task);
    for (j, v) in tr.chunks(n).enumerate() {
        for (t, &x) in v.iter().enumerate() {
            out[t * m + j] = x;
        }
    }
}

/// Groups of four vectors over a run of items (the last group padded with repeats of its last
/// item): `group(items)` picks the vectors. Calls `f(vectors, next group's vectors, items)`;
/// the last group's `next` is itself (nothing further to prefetch).
fn in_fours<'a>(
    items: &[usize],
    per: usize,
    group: impl Fn(&[usize; 4]) -> [Vector<'a>; 4],
    mut f: impl FnMut([Vector<'a>; 4], [Vector<'a>; 4], &[usize]),
) {
    let pad = |c: &[usize]| -> [usize; 4] { [0, 1, 2, 3].map(|q| c[q.min(c.len() - 1)]) };
    let mut chunks = items.chunks(per).peekable();
    let mut cur = chunks.peek().map(|c| group(&pad(c)));
    while let (Some(c), Some(rows)) = (chunks.next(), cur) {
        let next = chunks.peek().map(|c| group(&pad(c)));
        f(rows, next.unwrap_or(rows), c);
        cur = next;
    }
}

/// `part p of bundle i · x` by the best kernels (no decode to f32 first): the dense bundle
/// kernels' inner product.
pub(crate) fn bundle_dot(k: &Kernels, b: &Bundles, i: usize, p: usize, x: &[f32]) -> f32 {
    b.part(i, p).dot(k, ops(k), x)
}

/// `out += a · part p of bundle i` by the best kernels.
pub(crate) fn bundle_axpy(k: &Kernels, b: &Bundles, i: usize, p: usize, a: f32, out: &mut [f32]) {
    b.part(i, p).axpy(ops(k), a, out)
}

/// Hidden activations of the listed neurons for `n` tokens:
/// `h[t·m + j] = act(gate_i·x_t) · (up_i·x_t)` (gated bundles) or `act(up_i·x_t + bias[i])`
/// (two-part bundles; `bias` indexed by neuron, ignored when gated, as the dense kernel does),
/// `i = idx[j]`, `x` is `n × d`.
#[allow(clippy::too_many_arguments)]
pub fn sparse_up(
    k: &Kernels,
    b: &Bundles,
    idx: &[u32],
    x: &[f32],
    n: usize,
    act: fn(f32) -> f32,
    bias: Option<&[f32]>,
    h: &mut [f32],
) -> Result<()> {
    let op = "sparse_up";
    let BundleShape { parts, d } = b.shape;
    let m = idx.len();
    if x.len() != n * d || h.len() != n * m {
        return Err(err(
            op,
            format!(
                "x has {} values, h {}: want {n}×{d} and {n}×{m}",
                x.len(),
                h.len()
            ),
        ));
    }
    if let Some(bb) = bias
        && bb.len() != b.neurons
    {
        return Err(err(
            op,
            format!("bias of {} for {} neurons", bb.len(), b.neurons),
        ));
    }
    b.check_idx(op, idx)?;
    let o = ops(k);
    let gated = parts == 3;
    // Gated: two neurons' gate and up rows per group of four; else four neurons' up rows.
    let per = if gated { 2 } else { 4 };
    per_items(m, n, h, |js, vals| {
        let j0 = js.start;
        let items: Vec<usize> = js.collect();
        let rows = |g: &[usize; 4]| -> [Vector; 4] {
            let nr = |q: usize| idx[g[q]] as usize;
            if gated {
                [
                    b.part(nr(0), 0),
                    b.part(nr(0), 1),
                    b.part(nr(1), 0),
                    b.part(nr(1), 1),
                ]
            } else {
                [0, 1, 2, 3].map(|q| b.part(nr(q), 0))
            }
        };
        in_fours(&items, per, rows, |rows, next, group| {
            let live = if gated { 2 * group.len() } else { group.len() };
            for t in 0..n {
                let s = dot4(k, o, rows, next, live, &x[t * d..(t + 1) * d]);
                for (q, &j) in group.iter().enumerate() {
                    let i = idx[j] as usize;
                    vals[(j - j0) * n + t] = if gated {
                        act(s[2 * q]) * s[2 * q + 1]
                    } else {
                        act(s[q] + bias.map_or(0.0, |bb| bb[i]))
                    };
                }
            }
        });
    });
    Ok(())
}

/// `out[t·m + j] = part p of bundle idx[j] · x_t` for `n` tokens: one part of the listed
/// neurons (the part that decides whether a neuron is active: the gate, or the up vector of
/// two-part bundles), so the others are read only for the neurons that turn out active.
pub fn sparse_part_dots(
    k: &Kernels,
    b: &Bundles,
    idx: &[u32],
    p: usize,
    x: &[f32],
    n: usize,
    out: &mut [f32],
) -> Result<()> {
    let op = "sparse_part_dots";
    let BundleShape { parts, d } = b.shape;
    let m = idx.len();
    if p >= parts || x.len() != n * d || out.len() != n * m {
        return Err(err(
            op,
            format!(
                "part {p} of {parts}, x has {} values, out {}: want {n}×{d} and {n}×{m}",
                x.len(),
                out.len()
            ),
        ));
    }
    b.check_idx(op, idx)?;
    let o = ops(k);
    per_items(m, n, out, |js, vals| {
        let j0 = js.start;
        let items: Vec<usize> = js.collect();
        let rows = |g: &[usize; 4]| g.map(|j| b.part(idx[j] as usize, p));
        in_fours(&items, 4, rows, |rows, next, group| {
            for t in 0..n {
                let s = dot4(k, o, rows, next, group.len(), &x[t * d..(t + 1) * d]);
                for (q, &j) in group.iter().enumerate() {
                    vals[(j - j0) * n + t] = s[q];
                }
            }
        });
    });
    Ok(())
}

/// How [`sparse_down_split`] spreads its work over threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DownSplit {
    /// Each task owns a range of output columns and reads that range of every listed column:
    /// no reduction, the task's outputs stay in L1.
    Output,
    /// Each task sums the listed neurons of a fixed range of neuron ids into its own `n × d`
    /// accumulator; the accumulators are added at the end in task order (a token's result
    /// depends on its own neurons only, but on the list being whole: not for a unit's rounds).
    Partials,
}

/// Output columns per task at least (and a multiple of the INT4 group), so each task still
/// reads runs long enough for the prefetchers.
const MIN_COLS_PER_TASK: usize = 256;

/// `out[t] += Σ_j h[t·m + j] · down_{idx[j]}` for `n` tokens (`out` is `n × d`), split over
/// output columns ([`DownSplit::Output`]): each token's result is one chain of multiply-adds
/// from `out` in list order, so it is what the token gets alone, bit for bit, whatever the
/// other tokens list, however a cache unit cuts the list into rounds and whichever slots hold
/// the neurons. (`gpu-offload bench sparse` times both splits; on this project's 2-core
/// machine they measured within noise of each other, 1 and 4 tokens, f16/int8/int4, 10 and
/// 50% active.)
pub fn sparse_down(
    k: &Kernels,
    b: &Bundles,
    idx: &[u32],
    h: &[f32],
    n: usize,
    out: &mut [f32],
) -> Result<()> {
    sparse_down_split(k, b, idx, h, n, out, DownSplit::Output)
}

/// [`sparse_down`] with the thread split chosen by the caller.
pub fn sparse_down_split(
    k: &Kernels,
    b: &Bundles,
    idx: &[u32],
    h: &[f32],
    n: usize,
    out: &mut [f32],
    split: DownSplit,
) -> Result<()> {
    let op = "sparse_down";
    let BundleShape { parts, d } = b.shape;
    let m = idx.len();
    if h.len() != n * m || out.len() != n * d {
        return Err(err(
            op,
            format!(
                "h has {} values, out {}: want {n}×{m} and {n}×{d}",
                h.len(),
                out.len()
            ),
        ));
    }
    b.check_idx(op, idx)?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    let o = ops(k);
    let down = parts - 1;
    // Sum the columns of the neurons at positions `js` over `c0..c1` into `acc`
    // (`n × (c1 − c0)`). Four columns at a time, so each pass reads and writes the output tile
    // once per four; every kernel adds a neuron's term with one fused multiply-add per output
    // in list order, so a neuron whose weight for a token is zero leaves that token's sums
    // exactly as they were.
    let columns = |js: &[usize], c0: usize, c1: usize, acc: &mut [f32]| {
        let w = c1 - c0;
        // Neurons with a zero weight for every token add nothing (and ReLU models have many).
        let live: Vec<usize> = js
            .iter()
            .copied()
            .filter(|&j| (0..n).any(|t| h[t * m + j] != 0.0))
            .collect();
        let cols = |g: &[usize; 4]| g.map(|j| b.part(idx[j] as usize, down).slice(c0, c1));
        in_fours(&live, 4, cols, |cols, next, group| {
            for t in 0..n {
                // Padding columns (repeats) get weight zero.
                let a = [0, 1, 2, 3].map(|q| group.get(q).map_or(0.0, |&j| h[t * m + j]));
                axpy4(o, a, cols, next, group.len(), &mut acc[t * w..(t + 1) * w]);
            }
        });
    };
    let threads = rayon::current_num_threads().max(1);
    match split {
        DownSplit::Output => {
            // Each task carries its columns of `out` through every listed neuron: a token's
            // result is one chain of multiply-adds from `out` in list order, the same however
            // the list is cut into calls (a unit's rounds) or which slots hold the neurons.
            let all: Vec<usize> = (0..m).collect();
            let per = d
                .div_ceil(threads)
                .next_multiple_of(64)
                .max(MIN_COLS_PER_TASK);
            let tasks = d.div_ceil(per);
            let cols = |task: usize| (task * per, ((task + 1) * per).min(d));
            let sums: Vec<Vec<f32>> = (0..tasks)
                .into_par_iter()
                .map(|task| {
                    let (c0, c1) = cols(task);
                    let mut acc: Vec<f32> = (0..n)
                        .flat_map(|t| out[t * d + c0..t * d + c1].iter().copied())
                        .collect();
                    columns(&all, c0, c1, &mut acc);
                    acc
                })
                .collect();
            for (task, acc) in sums.iter().enumerate() {
                let (c0, c1) = cols(task);
                let w = c1 - c0;
                for t in 0..n {
                    out[t * d + c0..t * d + c1].copy_from_slice(&acc[t * w..(t + 1) * w]);
                }
            }
        }
        DownSplit::Partials => {
            // Each task owns a fixed range of neuron ids (not of positions in the list), and
            // the partial sums are added in task order: a token's result does not depend on
            // the neurons listed for the other tokens of the call (their weights for it are
            // zero) nor on how the threads divide the work.
            let per = b.neurons.div_ceil(threads * 4).max(16);
            let mut tasks: Vec<Vec<usize>> = vec![Vec::new(); b.neurons.div_ceil(per)];
            for (j, &i) in idx.iter().enumerate() {
                tasks[i as usize / per].push(j);
            }
            let sums: Vec<Vec<f32>> = tasks
                .par_iter()
                .filter(|js| !js.is_empty())
                .map(|js| {
                    let mut acc = vec![0f32; n * d];
                    columns(js, 0, d, &mut acc);
                    acc
                })
                .collect();
            // Added over column chunks in parallel, each in task order.
            const CHUNK: usize = 1024;
            out.par_chunks_mut(CHUNK).enumerate().for_each(|(c, o)| {
                for sum in &sums {
                    let part = &sum[c * CHUNK..c * CHUNK + o.len()];
                    o.iter_mut().zip(part).for_each(|(x, s)| *x += s);
                }
            });
        }
    }
    Ok(())
}

/// Activations of one token prepared for a weight format.
#[derive(Clone, Copy)]
enum ActRow<'a> {
    Float(&'a [f32]),
    Quant(&'a [ActBlock]),
    QuantK(&'a [ActBlockK]),
}

/// Activations of `n` tokens (`n × cols`) prepared for `dtype`.
enum Prepared<'a> {
    Float(&'a [f32]),
    Quant(Vec<ActBlock>),
    QuantK(Vec<ActBlockK>),
}

impl<'a> Prepared<'a> {
    fn new(k: &Kernels, dtype: DType, x: &'a [f32], cols: usize) -> Self {
        if dtype.is_k_quant() {
            let per = cols / QK_K;
            let mut q = vec![ActBlockK::default(); x.len() / QK_K];
            for (xr, qr) in x.chunks(cols).zip(q.chunks_mut(per)) {
                (k.quantize_k)(xr, qr);
            }
            Prepared::QuantK(q)
        } else if dtype.is_quantized() {
            let per = cols / QK;
            let mut q = vec![ActBlock::default(); x.len() / QK];
            for (xr, qr) in x.chunks(cols).zip(q.chunks_mut(per)) {
                (k.quantize)(xr, qr);
            }
            Prepared::Quant(q)
        } else {
            Prepared::Float(x)
        }
    }

    /// Token `t`'s activations over columns `c0..c1` (block-aligned for the quantized forms).
    fn token(&self, t: usize, cols: usize, c0: usize, c1: usize) -> ActRow<'_> {
        match self {
            Prepared::Float(x) => ActRow::Float(&x[t * cols + c0..t * cols + c1]),
            Prepared::Quant(q) => {
                let per = cols / QK;
                ActRow::Quant(&q[t * per + c0 / QK..t * per + c1 / QK])
            }
            Prepared::QuantK(q) => {
                let per = cols / QK_K;
                ActRow::QuantK(&q[t * per + c0 / QK_K..t * per + c1 / QK_K])
            }
        }
    }
}

/// Dot of weights `w` (bytes of whole blocks in `dtype`) with matching activations.
fn dot_any(k: &Kernels, dtype: DType, w: &[u8], x: ActRow) -> f32 {
    use bytemuck::cast_slice as c;
    match (x, dtype) {
        (ActRow::Float(x), DType::F32) => (k.dot_f32)(c(w), x),
        (ActRow::Float(x), DType::F16) => (k.dot_f16)(c(w), x),
        (ActRow::Float(x), DType::BF16) => (k.dot_bf16)(c(w), x),
        (ActRow::Quant(x), DType::Q8_0) => (k.dot_q8_0)(c::<u8, BlockQ8_0>(w), x),
        (ActRow::Quant(x), DType::Q4_0) => (k.dot_q4_0)(c::<u8, BlockQ4_0>(w), x),
        (ActRow::Quant(x), DType::Q4_1) => (k.dot_q4_1)(c::<u8, BlockQ4_1>(w), x),
        (ActRow::Quant(x), DType::Q5_0) => (k.dot_q5_0)(c::<u8, BlockQ5_0>(w), x),
        (ActRow::Quant(x), DType::Q5_1) => (k.dot_q5_1)(c::<u8, BlockQ5_1>(w), x),
        (ActRow::QuantK(x), DType::Q2K) => (k.dot_q2_k)(c::<u8, BlockQ2K>(w), x),
        (ActRow::QuantK(x), DType::Q3K) => (k.dot_q3_k)(c::<u8, BlockQ3K>(w), x),
        (ActRow::QuantK(x), DType::Q4K) => (k.dot_q4_k)(c::<u8, BlockQ4K>(w), x),
        (ActRow::QuantK(x), DType::Q5K) => (k.dot_q5_k)(c::<u8, BlockQ5K>(w), x),
        (ActRow::QuantK(x), DType::Q6K) => (k.dot_q6_k)(c::<u8, BlockQ6K>(w), x),
        _ => unreachable!("Prepared::new matches the activations to {dtype}"),
    }
}

/// Checks shared by the matrix functions.
fn check_matrix(op: &'static str, w: &HostTensor) -> Result<()> {
    // Whole blocks per row, and block structs (align ≤ 4) read in place.
    if !w.cols.is_multiple_of(w.dtype.block_len())
        || w.data.len() < w.rows * w.row_bytes()
        || !(w.data.as_slice().as_ptr() as usize).is_multiple_of(4)
    {
        return Err(err(
            op,
            format!(
                "`{}` ({}x{} {}) is not whole aligned rows",
                w.name, w.rows, w.cols, w.dtype
            ),
        ));
    }
    Ok(())
}

/// `out[t·m + j] = W[idx[j]] · x_t` for `n` tokens (`x` is `n × w.cols`): only the listed rows
/// of a gate/up matrix in any storage format, each row with the format's own dot kernel (8-bit
/// activation blocks for the block formats, quantized once per call, as the dense matmul does).
pub fn sparse_rows(
    k: &Kernels,
    w: &HostTensor,
    idx: &[u32],
    x: &[f32],
    n: usize,
    out: &mut [f32],
) -> Result<()> {
    let op = "sparse_rows";
    check_matrix(op, w)?;
    let (m, cols) = (idx.len(), w.cols);
    if x.len() != n * cols || out.len() != n * m {
        return Err(err(
            op,
            format!(
                "x has {} values, out {}: want {n}×{cols} and {n}×{m}",
                x.len(),
                out.len()
            ),
        ));
    }
    if let Some(i) = idx.iter().find(|&&i| i as usize >= w.rows) {
        return Err(err(
            op,
            format!("row {i} listed, `{}` has {}", w.name, w.rows),
        ));
    }
    let prepared = Prepared::new(k, w.dtype, x, cols);
    let (data, rb) = (w.data.as_slice(), w.row_bytes());
    // The dense matmul's many-row kernel where it has one (the same results).
    let many = match &prepared {
        Prepared::Quant(q) => k.many_rows(w.dtype, q, cols / QK),
        _ => None,
    };
    let row = |j: usize| {
        let r = idx[j] as usize;
        &data[r * rb..(r + 1) * rb]
    };
    per_items(m, n, out, |js, o| {
        if let Some((blocks, dots)) = &many {
            // The listed rows together, as the dense matmul takes its rows.
            let rows: Vec<&[u8]> = js.map(row).collect();
            return dots(&rows, blocks, 0, o, &[]);
        }
        for (j, o) in js.zip(o.chunks_mut(n)) {
            for (t, v) in o.iter_mut().enumerate() {
                *v = dot_any(k, w.dtype, row(j), prepared.token(t, cols, 0, cols));
            }
        }
    });
    Ok(())
}

/// Output rows per task of [`sparse_down_blocks`].
const ROWS_PER_TASK: usize = 16;

/// `out[t·rows + r] += Σ_j W[r][idx[j]] · h[t·m + j]` for a down matrix `w` stored as
/// `d_model` rows × `d_ff` columns in its format: the activations outside `idx` are zero, so
/// every weight block (32 columns, or 256 for the K-quants; 32 for floats) holding none of a
/// token's non-zero activations contributes exactly zero to it and is skipped for it. The rest
/// run as the dense matmul would (the same 8-bit activation blocks), a run of consecutive
/// blocks per kernel call; the runs are each token's own, so a token gets what it gets alone,
/// bit for bit, whatever the other tokens of the call list. Returns how many blocks of each
/// row were read (for some token).
pub fn sparse_down_blocks(
    k: &Kernels,
    w: &HostTensor,
    idx: &[u32],
    h: &[f32],
    n: usize,
    out: &mut [f32],
) -> Result<usize> {
    let op = "sparse_down_blocks";
    check_matrix(op, w)?;
    let (rows, cols, m) = (w.rows, w.cols, idx.len());
    if h.len() != n * m || out.len() != n * rows {
        return Err(err(
            op,
            format!(
                "h has {} values, out {}: want {n}×{m} and {n}×{rows}",
                h.len(),
                out.len()
            ),
        ));
    }
    if let Some(i) = idx.iter().find(|&&i| i as usize >= cols) {
        return Err(err(
            op,
            format!("neuron {i} listed, `{}` has {cols} columns", w.name),
        ));
    }
    if m == 0 || n == 0 {
        return Ok(0);
    }
    // The dense activations (zero outside idx), which the quantizer sees exactly as the dense
    // matmul would.
    let mut full = vec![0f32; n * cols];
    for t in 0..n {
        for (j, &i) in idx.iter().enumerate() {
            full[t * cols + i as usize] += h[t * m + j];
        }
    }
    let block = w.dtype.block_len().max(QK);
    let blocks = cols.div_ceil(block);
    // Each token's runs of consecutive blocks holding its non-zero activations, as column
    // ranges; and the blocks some token reads.
    let mut read = vec![false; blocks];
    let runs: Vec<Vec<(usize, usize)>> = (0..n)
        .map(|t| {
            let mut active = vec![false; blocks];
            for (j, &i) in idx.iter().enumerate() {
                if h[t * m + j] != 0.0 {
                    active[i as usize / block] = true;
                }
            }
            let mut runs: Vec<(usize, usize)> = Vec::new();
            for (bi, _) in active.iter().enumerate().filter(|(_, a)| **a) {
                read[bi] = true;
                let (c0, c1) = (bi * block, ((bi + 1) * block).min(cols));
                match runs.last_mut() {
                    Some(r) if r.1 == c0 => r.1 = c1,
                    _ => runs.push((c0, c1)),
                }
            }
            runs
        })
        .collect();
    let used = read.iter().filter(|a| **a).count();
    let prepared = Prepared::new(k, w.dtype, &full, cols);
    let (data, rb) = (w.data.as_slice(), w.row_bytes());
    let bytes_of = |c: usize| w.dtype.bytes_for(c);
    let sums: Vec<Vec<f32>> = (0..rows.div_ceil(ROWS_PER_TASK))
        .into_par_iter()
        .map(|task| {
            let (r0, r1) = (task * ROWS_PER_TASK, ((task + 1) * ROWS_PER_TASK).min(rows));
            let mut acc = vec![0f32; n * (r1 - r0)];
            for r in r0..r1 {
                let row = &data[r * rb..(r + 1) * rb];
                for t in 0..n {
                    acc[t * (r1 - r0) + r - r0] = runs[t]
                        .iter()
                        .map(|&(c0, c1)| {
                            let x = prepared.token(t, cols, c0, c1);
                            dot_any(k, w.dtype, &row[bytes_of(c0)..bytes_of(c1)], x)
                        })
                        .sum();
                }
            }
            acc
        })
        .collect();
    for (task, acc) in sums.iter().enumerate() {
        let (r0, r1) = (task * ROWS_PER_TASK, ((task + 1) * ROWS_PER_TASK).min(rows));
        for t in 0..n {
            out[t * rows + r0..t * rows + r1]
                .iter_mut()
                .zip(&acc[t * (r1 - r0)..(t + 1) * (r1 - r0)])
                .for_each(|(o, s)| *o += s);
        }
    }
    Ok(used)
}

#[cfg(test)]
mod tests {
    use super::super::{bundles, kernels, matmul};
    use super::*;
    use crate::store::quant::{dequant_int4_row, dequant_int8_row, int4_row, int8_row};
    use crate::tensor::Bytes;
    use rand::seq::SliceRandom;
    use rand::{RngExt, SeedableRng, rngs::StdRng};

    // Tolerance. For float bundles `sparse_up` runs the dense kernel on the same row and
    // activations, so it matches exactly; INT8/INT4 differ from the dequantized-f32 oracle by
    // one rounding per product (`s·(q·x)` against `(s·q)·x`). The down sums add the same terms
    // in another association (per-task partials, runs of blocks): reassociating a sum of N terms
    // moves it by at most about N·ε·Σ|terms| (ε = 2⁻²⁴), and N ≤ 200 here, so every check is
    // `|got − want| ≤ 2e-5 · Σ|terms|`, Σ|terms| computed in f64 from the oracle's values.
    const REL: f64 = 2e-5;

    fn rand_vec(rng: &mut StdRng, n: usize, r: f32) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-r..r)).collect()
    }

    /// Zero about half of each token's activations (each token its own), then check that
    /// every token's row of `call` over all `n` tokens is, bit for bit, its row of `call` over
    /// that token alone listing only its non-zero neurons (in the same order). `call(idx, h,
    /// n, out)` adds into `out` (`n × width`, starting from `out0`).
    fn each_token_as_alone(
        rng: &mut StdRng,
        idx: &[u32],
        h: &[f32],
        n: usize,
        out0: &[f32],
        what: &str,
        call: impl Fn(&[u32], &[f32], usize, &mut [f32]),
    ) {
        let (m, width) = (idx.len(), out0.len() / n);
        let h: Vec<f32> = h
            .iter()
            .map(|&v| if rng.random_bool(0.5) { 0.0 } else { v })
            .collect();
        let mut all = out0.to_vec();
        call(idx, &h, n, &mut all);
        for t in 0..n {
            let own: Vec<usize> = (0..m).filter(|&j| h[t * m + j] != 0.0).collect();
            let idx_t: Vec<u32> = own.iter().map(|&j| idx[j]).collect();
            let h_t: Vec<f32> = own.iter().map(|&j| h[t * m + j]).collect();
            let mut alone = out0[t * width..(t + 1) * width].to_vec();
            call(&idx_t, &h_t, 1, &mut alone);
            assert!(
                alone == all[t * width..(t + 1) * width],
                "{what}: token {t} of {n} differs from alone"
            );
        }
    }

    /// [`each_token_as_alone`] for [`sparse_down_split`].
    fn down_as_alone(
        rng: &mut StdRng,
        k: &Kernels,
        b: &Bundles,
        (idx, h, n): (&[u32], &[f32], usize),
        out0: &[f32],
        what: &str,
        split: DownSplit,
    ) {
        each_token_as_alone(rng, idx, h, n, out0, what, |i, h, n, o| {
            sparse_down_split(k, b, i, h, n, o, split).unwrap();
        });
    }

    /// A random list of `frac` of `neurons`, in random order, without duplicates.
    fn rand_idx(rng: &mut StdRng, neurons: usize, frac: f64) -> Vec<u32> {
        let mut all: Vec<u32> = (0..neurons as u32).collect();
        all.shuffle(rng);
        all.truncate((neurons as f64 * frac).round() as usize);
        all
    }

    /// What the encoding stores, as f32 (the oracle's weights).
    fn roundtrip(v: &[f32], enc: Encoding) -> Vec<f32> {
        let mut out = vec![0f32; v.len()];
        match enc {
            Encoding::Format(DType::F32) => out.copy_from_slice(v),
            Encoding::Format(DType::F16) => {
                out.iter_mut()
                    .zip(v)
                    .for_each(|(o, x)| *o = f16::from_f32(*x).to_f32());
            }
            Encoding::Format(DType::BF16) => {
                out.iter_mut()
                    .zip(v)
                    .for_each(|(o, x)| *o = bf16::from_f32(*x).to_f32());
            }
            Encoding::Int8 => {
                let (s, q) = int8_row(v);
                dequant_int8_row(s, &q, &mut out);
            }
            Encoding::Int4 => {
                let (s, q) = int4_row(v);
                dequant_int4_row(&s, &q, &mut out);
            }
            Encoding::Format(_) => unreachable!(),
        }
        out
    }

    /// A random layer: the store's bytes in `enc`, and the oracle: the same values as f32
    /// bundles for the dense kernels.
    struct Layer {
        bytes: Vec<u8>,
        oracle: HostTensor,
        /// The oracle's down columns, neuron-major.
        down: Vec<f32>,
        shape: BundleShape,
    }

    fn layer(rng: &mut StdRng, enc: Encoding, gated: bool, neurons: usize, d: usize) -> Layer {
        let gate = gated.then(|| rand_vec(rng, neurons * d, 0.5));
        let up = rand_vec(rng, neurons * d, 0.5);
        let down = rand_vec(rng, neurons * d, 0.5);
        let bytes = crate::store::encode_bundles(gate.as_deref(), &up, &down, d, enc);
        // Per bundle part, as the store quantizes them.
        let rt = |v: &[f32]| -> Vec<f32> { v.chunks(d).flat_map(|r| roundtrip(r, enc)).collect() };
        let (gate, up, down) = (gate.as_deref().map(rt), rt(&up), rt(&down));
        let f = crate::store::encode_bundles(gate.as_deref(), &up, &down, d, Encoding::F32);
        let parts = if gated { 3 } else { 2 };
        Layer {
            bytes,
            oracle: HostTensor {
                name: "oracle".into(),
                rows: neurons,
                cols: parts * d,
                dtype: DType::F32,
                data: Bytes::from_slice(&f),
            },
            down,
            shape: BundleShape { parts, d },
        }
    }

    /// Aligned copy (a `Vec<u8>` promises no alignment; the store's map and `Bytes` do).
    fn aligned(bytes: &[u8]) -> Bytes {
        Bytes::from_slice(bytes)
    }

    fn kernel_sets() -> Vec<&'static Kernels> {
        let mut v = vec![kernels::best()];
        if v[0].name != kernels::PORTABLE.name {
            v.push(&kernels::PORTABLE);
        }
        v
    }

    #[test]
    fn bundles_equal_dense_with_masked_h() {
        let mut rng = StdRng::seed_from_u64(11);
        let encs = [
            Encoding::F32,
            Encoding::F16,
            Encoding::Format(DType::BF16),
            Encoding::Int8,
            Encoding::Int4,
        ];
        let silu: fn(f32) -> f32 = |x| x / (1.0 + (-x).exp());
        let relu: fn(f32) -> f32 = |x| x.max(0.0);
        for k in kernel_sets() {
            for enc in encs {
                for (gated, neurons, d) in
                    [(true, 173usize, 96usize), (false, 61, 160), (true, 40, 71)]
                {
                    if enc == Encoding::Int4 && !d.is_multiple_of(INT4_GROUP) {
                        continue;
                    }
                    let l = layer(&mut rng, enc, gated, neurons, d);
                    let bytes = aligned(&l.bytes);
                    let b = Bundles::new(bytes.as_slice(), enc, l.shape).unwrap();
                    assert_eq!(b.neurons(), neurons);
                    let act = if gated { silu } else { relu };
                    let bias = rand_vec(&mut rng, neurons, 0.3);
                    let bias = (!gated).then_some(&bias[..]);
                    for n in [1usize, 3] {
                        let x = rand_vec(&mut rng, n * d, 1.0);
                        // Dense oracle: every neuron's h.
                        let mut hd = vec![0f32; n * neurons];
                        bundles::up(
                            k, &l.oracle, l.shape, &x, n, act, 0.0, bias, &mut hd, neurons, 0,
                        );
                        for frac in [0.0, 0.1, 0.5, 1.0] {
                            let what = format!("{} {enc:?} gated {gated} n {n} {frac}", k.name);
                            let idx = rand_idx(&mut rng, neurons, frac);
                            let m = idx.len();
                            let mut h = vec![f32::NAN; n * m];
                            sparse_up(k, &b, &idx, &x, n, act, bias, &mut h).unwrap();
                            for t in 0..n {
                                for (j, &i) in idx.iter().enumerate() {
                                    let (got, want) = (h[t * m + j], hd[t * neurons + i as usize]);
                                    let tol = 1e-5 * (1.0 + want.abs());
                                    assert!((got - want).abs() <= tol, "{what}: h {got} vs {want}");
                                }
                            }
                            // Down: the dense kernel on h masked to the listed neurons.
                            let mut masked = vec![0f32; n * neurons];
                            for t in 0..n {
                                for (j, &i) in idx.iter().enumerate() {
                                    masked[t * neurons + i as usize] = h[t * m + j];
                                }
                            }
                            let out0 = rand_vec(&mut rng, n * d, 1.0);
                            let mut want = out0.clone();
                            bundles::down(k, &l.oracle, l.shape, &masked, n, neurons, 0, &mut want);
                            for split in [DownSplit::Output, DownSplit::Partials] {
                                let w = format!("{what} {split:?}");
                                down_as_alone(&mut rng, k, &b, (&idx, &h, n), &out0, &w, split);
                                let mut got = out0.clone();
                                sparse_down_split(k, &b, &idx, &h, n, &mut got, split).unwrap();
                                for t in 0..n {
                                    for c in 0..d {
                                        let mag: f64 = out0[t * d + c].abs() as f64
                                            + idx
                                                .iter()
                                                .enumerate()
                                                .map(|(j, &i)| {
                                                    (h[t * m + j] * l.down[i as usize * d + c])
                                                        .abs()
                                                        as f64
                                                })
                                                .sum::<f64>();
                                        let (g, w) = (got[t * d + c], want[t * d + c]);
                                        assert!(
                                            ((g - w).abs() as f64) <= REL * mag + 1e-30,
                                            "{what} {split:?} [{t},{c}]: {g} vs {w}"
                                        );
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// The grouped (four-row) paths against one row at a time: short lists of every length
    /// around the group size, repeats, zero weights, several tokens, row lengths with tails.
    #[test]
    fn grouped_paths_equal_per_row() {
        let mut rng = StdRng::seed_from_u64(17);
        let encs = [
            Encoding::F32,
            Encoding::F16,
            Encoding::Format(DType::BF16),
            Encoding::Int8,
            Encoding::Int4,
        ];
        let id: fn(f32) -> f32 = |x| x;
        for k in kernel_sets() {
            let o = ops(k);
            for enc in encs {
                for (gated, d) in [(true, 224usize), (false, 224), (true, 77), (false, 77)] {
                    if enc == Encoding::Int4 && !d.is_multiple_of(INT4_GROUP) {
                        continue;
                    }
                    let neurons = 23;
                    let l = layer(&mut rng, enc, gated, neurons, d);
                    let bytes = aligned(&l.bytes);
                    let b = Bundles::new(bytes.as_slice(), enc, l.shape).unwrap();
                    let parts = l.shape.parts;
                    for m in 1..=10usize {
                        // With repeats: a neuron listed twice counts twice.
                        let idx: Vec<u32> = (0..m)
                            .map(|_| rng.random_range(0..neurons as u32))
                            .collect();
                        for n in [1usize, 2, 4] {
                            let what =
                                format!("{} {enc:?} gated {gated} d {d} m {m} n {n}", k.name);
                            let x = rand_vec(&mut rng, n * d, 1.0);
                            let row = |i: usize, p: usize, t: usize| {
                                b.part(i, p).dot(k, o, &x[t * d..(t + 1) * d])
                            };
                            let close = |g: f32, w: f32, mag: f32| {
                                assert!((g - w).abs() <= 1e-5 * (1.0 + mag), "{what}: {g} vs {w}");
                            };
                            let mut h = vec![f32::NAN; n * m];
                            sparse_up(k, &b, &idx, &x, n, id, None, &mut h).unwrap();
                            for p in 0..parts {
                                let mut v = vec![f32::NAN; n * m];
                                sparse_part_dots(k, &b, &idx, p, &x, n, &mut v).unwrap();
                                for t in 0..n {
                                    for (j, &i) in idx.iter().enumerate() {
                                        let want = row(i as usize, p, t);
                                        close(v[t * m + j], want, want.abs());
                                    }
                                }
                            }
                            for t in 0..n {
                                for (j, &i) in idx.iter().enumerate() {
                                    let i = i as usize;
                                    let want = if gated {
                                        row(i, 0, t) * row(i, 1, t)
                                    } else {
                                        row(i, 0, t)
                                    };
                                    close(h[t * m + j], want, want.abs());
                                }
                            }
                            // Zero weights for some neurons (all tokens) and some cells.
                            for (c, v) in h.iter_mut().enumerate() {
                                if c % m % 3 == 1 || c % 5 == 2 {
                                    *v = 0.0;
                                }
                            }
                            let out0 = rand_vec(&mut rng, n * d, 1.0);
                            for split in [DownSplit::Output, DownSplit::Partials] {
                                let w = format!("{what} {split:?}");
                                down_as_alone(&mut rng, k, &b, (&idx, &h, n), &out0, &w, split);
                                let mut got = out0.clone();
                                sparse_down_split(k, &b, &idx, &h, n, &mut got, split).unwrap();
                                for t in 0..n {
                                    let mut want = out0[t * d..(t + 1) * d].to_vec();
                                    let mut mag = 0f32;
                                    for (j, &i) in idx.iter().enumerate() {
                                        let a = h[t * m + j];
                                        b.part(i as usize, parts - 1).axpy(o, a, &mut want);
                                        mag += a.abs();
                                    }
                                    for c in 0..d {
                                        close(got[t * d + c], want[c], mag + want[c].abs());
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn bad_inputs_are_errors() {
        let mut rng = StdRng::seed_from_u64(3);
        let shape = BundleShape { parts: 3, d: 64 };
        let l = layer(&mut rng, Encoding::Int8, true, 10, 64);
        assert!(Bundles::new(&l.bytes[1..], Encoding::Int8, shape).is_err());
        assert!(Bundles::new(&l.bytes, Encoding::Format(DType::Q4_0), shape).is_err());
        let odd = BundleShape { parts: 3, d: 48 };
        assert!(Bundles::new(&[], Encoding::Int4, odd).is_err());
        let b = Bundles::new(&l.bytes, Encoding::Int8, shape).unwrap();
        let k = kernels::best();
        let x = vec![0f32; 64];
        let mut h = vec![0f32; 1];
        let relu: fn(f32) -> f32 = |x| x.max(0.0);
        assert!(sparse_up(k, &b, &[10], &x, 1, relu, None, &mut h).is_err());
        assert!(sparse_up(k, &b, &[9], &x[1..], 1, relu, None, &mut h).is_err());
        let mut out = vec![0f32; 64];
        assert!(sparse_down(k, &b, &[9, 1], &h, 1, &mut out).is_err());
        let w = HostTensor::from_f32("w", 4, 8, vec![0.0; 32]);
        assert!(sparse_rows(k, &w, &[4], &x[..8], 1, &mut h).is_err());
        assert!(sparse_down_blocks(k, &w, &[8], &h, 1, &mut out[..4]).is_err());
    }

    fn matrix(rng: &mut StdRng, dtype: DType, rows: usize, cols: usize) -> HostTensor {
        let rb = dtype.bytes_for(cols);
        let mut bytes = vec![0u8; rows * rb];
        for r in 0..rows {
            let v = rand_vec(rng, cols, 1.0);
            crate::tensor::quantize_row(dtype, &v, &mut bytes[r * rb..(r + 1) * rb]);
        }
        HostTensor {
            name: "w".into(),
            rows,
            cols,
            dtype,
            data: Bytes::from_slice(&bytes),
        }
    }

    const FORMATS: [DType; 13] = DType::ALL;

    #[test]
    fn rows_equal_dense_matmul_rows() {
        let mut rng = StdRng::seed_from_u64(7);
        for k in kernel_sets() {
            for dtype in FORMATS {
                let (rows, cols) = (77, if dtype.is_k_quant() { 512 } else { 96 });
                let w = matrix(&mut rng, dtype, rows, cols);
                for n in [1usize, 2, 5] {
                    let x = rand_vec(&mut rng, n * cols, 1.0);
                    let mut dense = vec![0f32; n * rows];
                    matmul::matmul(k, &w, &x, n, &mut dense);
                    for frac in [0.0, 0.1, 0.5, 1.0] {
                        let idx = rand_idx(&mut rng, rows, frac);
                        let m = idx.len();
                        let mut got = vec![f32::NAN; n * m];
                        sparse_rows(k, &w, &idx, &x, n, &mut got).unwrap();
                        for t in 0..n {
                            for (j, &r) in idx.iter().enumerate() {
                                let (g, d) = (got[t * m + j], dense[t * rows + r as usize]);
                                assert!(
                                    (g - d).abs() <= 1e-5 * (1.0 + d.abs()),
                                    "{} {dtype} n {n} {frac} row {r}: {g} vs {d}",
                                    k.name
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn down_blocks_equal_dense_matmul_on_masked_h() {
        let mut rng = StdRng::seed_from_u64(9);
        for k in kernel_sets() {
            for dtype in FORMATS {
                // d_model odd; d_ff whole blocks (and not a multiple of 32 for floats).
                let (rows, cols) = (
                    37,
                    if dtype.is_k_quant() {
                        768
                    } else if dtype.is_quantized() {
                        416
                    } else {
                        203
                    },
                );
                let w = matrix(&mut rng, dtype, rows, cols);
                let wf = w.to_f32();
                for n in [1usize, 3] {
                    // Random lists, and one clustered list whose blocks are mostly skipped.
                    let mut lists: Vec<Vec<u32>> = [0.0, 0.1, 0.5, 1.0]
                        .iter()
                        .map(|&f| rand_idx(&mut rng, cols, f))
                        .collect();
                    let mut clustered: Vec<u32> = (40..70).collect();
                    clustered.shuffle(&mut rng);
                    lists.push(clustered);
                    for idx in lists {
                        let m = idx.len();
                        let h = rand_vec(&mut rng, n * m, 2.0);
                        let mut masked = vec![0f32; n * cols];
                        for t in 0..n {
                            for (j, &i) in idx.iter().enumerate() {
                                masked[t * cols + i as usize] = h[t * m + j];
                            }
                        }
                        let out0 = rand_vec(&mut rng, n * rows, 1.0);
                        let mut dense = vec![0f32; n * rows];
                        matmul::matmul(k, &w, &masked, n, &mut dense);
                        let what = format!("{} {dtype} n {n} m {m}", k.name);
                        each_token_as_alone(&mut rng, &idx, &h, n, &out0, &what, |i, h, n, o| {
                            sparse_down_blocks(k, &w, i, h, n, o).unwrap();
                        });
                        let mut got = out0.clone();
                        let used = sparse_down_blocks(k, &w, &idx, &h, n, &mut got).unwrap();
                        let block = dtype.block_len().max(QK);
                        let mut want_used: Vec<u32> =
                            idx.iter().map(|&i| i / block as u32).collect();
                        want_used.sort_unstable();
                        want_used.dedup();
                        assert_eq!(used, want_used.len());
                        for t in 0..n {
                            for r in 0..rows {
                                let mag: f64 = out0[t * rows + r].abs() as f64
                                    + (0..cols)
                                        .map(|c| {
                                            (wf[r * cols + c] * masked[t * cols + c]).abs() as f64
                                        })
                                        .sum::<f64>();
                                let (g, d) =
                                    (got[t * rows + r], out0[t * rows + r] + dense[t * rows + r]);
                                assert!(
                                    ((g - d).abs() as f64) <= REL * mag + 1e-30,
                                    "{} {dtype} n {n} m {m} row {r}: {g} vs {d}",
                                    k.name
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}
