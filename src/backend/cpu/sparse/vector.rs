//! One weight vector in its encoding ([`Vector`]: a bundle's part, or a run of its columns),
//! its dot with activations and its axpy into an output, one at a time or four by four
//! ([`dot4`], [`axpy4`]: the groups the operators walk), by the inner kernels that go with a
//! kernel set ([`ops`]).

use half::{bf16, f16};

use super::ops::{Axpy4F16, Dot4F16, I4Row, Ops};
use crate::backend::cpu::kernels::Kernels;
use crate::store::quant::INT4_GROUP;

/// One weight vector in its encoding.
#[derive(Clone, Copy)]
pub(super) enum Vector<'a> {
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
    pub(super) fn slice(self, c0: usize, c1: usize) -> Vector<'a> {
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

    pub(super) fn dot(self, k: &Kernels, o: &Ops, x: &[f32]) -> f32 {
        match self {
            Vector::F32(w) => (k.dot_f32)(w, x),
            Vector::F16(w) => (k.dot_f16)(w, x),
            Vector::Bf16(w) => (k.dot_bf16)(w, x),
            Vector::I8 { scale, q } => scale * (o.dot_i8)(q, x),
            Vector::I4 { scales, q } => (o.dot_i4)(scales, q, x),
        }
    }

    /// `out += a · self`
    pub(super) fn axpy(self, o: &Ops, a: f32, out: &mut [f32]) {
        match self {
            Vector::F32(w) => (o.axpy_f32)(a, w, out),
            Vector::F16(w) => (o.axpy_f16)(a, w, out),
            Vector::Bf16(w) => (o.axpy_bf16)(a, w, out),
            Vector::I8 { scale, q } => (o.axpy_i8)(a * scale, q, out),
            Vector::I4 { scales, q } => (o.axpy_i4)(a, scales, q, out),
        }
    }
}

/// The f16 four-row kernels, where the bundles are f16 and the kernel set has them: the
/// operators then walk plain f16 slices, not [`Vector`]s. Building and matching groups of
/// `Vector`s took more of a layer's down pass than the kernel did (SmolLM2's layer, f16, on
/// one core: 57 µs a call, 42% of it in the kernel).
#[derive(Clone, Copy)]
pub(super) struct F16Fast {
    pub(super) dot4: Dot4F16,
    pub(super) axpy4: Axpy4F16,
}

/// [`F16Fast`] with the kernels `o` for bundles that are f16 (`f16`), if both allow.
pub(super) fn f16_fast(o: &Ops, f16: bool) -> Option<F16Fast> {
    match (f16, o.dot4_f16, o.axpy4_f16) {
        (true, Some(dot4), Some(axpy4)) => Some(F16Fast { dot4, axpy4 }),
        _ => None,
    }
}

/// `[rows[r] · x]` for the first `live` rows (the rest are padding: repeats of a live row,
/// their results unused). All rows share one encoding (one bundle part kind); `next` is the
/// group to be read after this one, whose rows are prefetched while this one is summed.
pub(super) fn dot4(
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
pub(super) fn axpy4(
    o: &Ops,
    a: [f32; 4],
    cols: [Vector; 4],
    next: [Vector; 4],
    live: usize,
    out: &mut [f32],
) {
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

/// Ours to go with kernel set `k`: every set but the portable one implies AVX2+FMA+F16C (see
/// `kernels::available`), so the choice follows it, and a test forcing portable gets portable.
pub(super) fn ops(k: &Kernels) -> &'static Ops {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::backend::cpu::kernels::{AVX512_NAME, PORTABLE};
        if k.name == AVX512_NAME {
            return &super::x86::OPS_AVX512;
        }
        if k.name != PORTABLE.name {
            return &super::x86::OPS;
        }
    }
    let _ = k;
    &super::portable::OPS
}
