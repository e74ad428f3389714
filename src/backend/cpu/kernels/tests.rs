//! Every kernel set this CPU runs against the portable reference and against itself: dots
//! and the quantizer within rounding of the reference, attention's kernels and the many-row
//! dots bit for bit whatever is computed beside a value.

use half::{bf16, f16};

use super::tiles::{TILE_ROWS, tile_rows};
use super::*;
use crate::tensor::{BlockQ4_0, BlockQ4_1, BlockQ8_0, DType, QK};
use rand::{RngExt, SeedableRng, rngs::StdRng};

fn rand_vec(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect()
}

fn rel(a: f32, b: f32) -> f32 {
    (a - b).abs() / b.abs().max(1.0)
}

/// Attention's weighted sum of value rows: each output its column's terms in row order,
/// fused multiply-adds on the SIMD sets and a multiply then an add on the portable one, bit
/// for bit over widths with and without tails (so no output depends on its neighbours).
#[test]
fn axpy_rows_sums_each_column_in_row_order() {
    let mut rng = StdRng::seed_from_u64(17);
    for width in [3usize, 8, 64, 75, 128, 200] {
        for count in [0usize, 1, 5, 16] {
            let rows: Vec<Vec<f32>> = (0..count).map(|_| rand_vec(&mut rng, width)).collect();
            let refs: Vec<&[f32]> = rows.iter().map(|r| r.as_slice()).collect();
            let w = rand_vec(&mut rng, count);
            let out0 = rand_vec(&mut rng, width);
            let (mut fused, mut unfused) = (out0.clone(), out0.clone());
            for (&wj, row) in w.iter().zip(&rows) {
                for ((f, u), &v) in fused.iter_mut().zip(unfused.iter_mut()).zip(row) {
                    *f = wj.mul_add(v, *f);
                    *u += wj * v;
                }
            }
            for k in available() {
                let want = if k.name == PORTABLE.name {
                    &unfused
                } else {
                    &fused
                };
                let mut got = out0.clone();
                (k.axpy_rows)(&mut got, &w, &refs);
                assert!(&got == want, "{} width {width}, {count} rows", k.name);
            }
        }
    }
}

/// A set's scores of a tile of queries and keys are each pair's alone, bit for bit,
/// whatever the tile's shape (every tile and remainder the kernel takes), and within
/// rounding of the portable set's.
#[test]
fn scores_are_each_pairs_alone_bit_for_bit() {
    let mut rng = StdRng::seed_from_u64(19);
    for width in [3usize, 8, 40, 64, 75, 128] {
        for (nq, nk) in [
            (1usize, 0usize),
            (1, 1),
            (1, 9),
            (1, 16),
            (2, 3),
            (2, 4),
            (3, 13),
            (5, 16),
        ] {
            let qs: Vec<Vec<f32>> = (0..nq).map(|_| rand_vec(&mut rng, width)).collect();
            let ks: Vec<Vec<f32>> = (0..nk).map(|_| rand_vec(&mut rng, width)).collect();
            let qr: Vec<&[f32]> = qs.iter().map(|r| r.as_slice()).collect();
            let kr: Vec<&[f32]> = ks.iter().map(|r| r.as_slice()).collect();
            let mut want = vec![0f32; nq * nk];
            portable::scores_of(&qr, &kr, &mut want);
            for k in available() {
                let mut got = vec![f32::NAN; nq * nk];
                (k.scores)(&qr, &kr, &mut got);
                for (at, (&g, &w)) in got.iter().zip(&want).enumerate() {
                    let (i, j) = (at / nk, at % nk);
                    let mut alone = [f32::NAN];
                    (k.scores)(&qr[i..=i], &kr[j..=j], &mut alone);
                    assert!(
                        g.to_bits() == alone[0].to_bits(),
                        "{} width {width}, query {i} key {j} of {nq}x{nk}: {g} vs {}",
                        k.name,
                        alone[0]
                    );
                    assert!(rel(g, w) < 1e-5, "{} {g} vs portable {w}", k.name);
                }
            }
        }
    }
}

/// Every set's f16 attention kernels (rows read in place, each value widened as it is
/// loaded) give bit for bit what its f32 kernels give over the rows widened first: an f16
/// cache's row attends alike read in place or decoded.
#[test]
fn f16_rows_attend_as_their_f32_copies() {
    let mut rng = StdRng::seed_from_u64(23);
    for width in [3usize, 8, 40, 64, 75, 128] {
        for (nq, nk) in [(1usize, 1usize), (1, 9), (3, 16), (2, 4), (5, 13)] {
            let half = |rng: &mut StdRng| -> Vec<f16> {
                rand_vec(rng, width)
                    .into_iter()
                    .map(f16::from_f32)
                    .collect()
            };
            let qs: Vec<Vec<f32>> = (0..nq).map(|_| rand_vec(&mut rng, width)).collect();
            let ks: Vec<Vec<f16>> = (0..nk).map(|_| half(&mut rng)).collect();
            let wide: Vec<Vec<f32>> = ks
                .iter()
                .map(|r| r.iter().map(|v| v.to_f32()).collect())
                .collect();
            let qr: Vec<&[f32]> = qs.iter().map(|r| r.as_slice()).collect();
            let kr: Vec<&[f16]> = ks.iter().map(|r| r.as_slice()).collect();
            let wr: Vec<&[f32]> = wide.iter().map(|r| r.as_slice()).collect();
            let w = rand_vec(&mut rng, nk);
            let out0 = rand_vec(&mut rng, width);
            for k in available() {
                let (mut a, mut b) = (vec![f32::NAN; nq * nk], vec![f32::NAN; nq * nk]);
                (k.scores_f16)(&qr, &kr, &mut a);
                (k.scores)(&qr, &wr, &mut b);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&a),
                    bits(&b),
                    "{} scores, width {width}, {nq}x{nk}",
                    k.name
                );
                let (mut a, mut b) = (out0.clone(), out0.clone());
                (k.axpy_rows_f16)(&mut a, &w, &kr);
                (k.axpy_rows)(&mut b, &w, &wr);
                assert_eq!(
                    bits(&a),
                    bits(&b),
                    "{} axpy, width {width}, {nk} rows",
                    k.name
                );
            }
        }
    }
}

#[test]
fn simd_kernels_equal_portable() {
    for k in available() {
        check_against_portable(k);
    }
}

fn check_against_portable(k: &Kernels) {
    let mut rng = StdRng::seed_from_u64(7);
    for n in [32usize, 64, 96, 576, 1536] {
        let w = rand_vec(&mut rng, n);
        let x = rand_vec(&mut rng, n);
        assert!(rel((k.dot_f32)(&w, &x), portable::dot_f32(&w, &x)) < 1e-5);
        let wh: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
        assert!(rel((k.dot_f16)(&wh, &x), portable::dot_f16(&wh, &x)) < 1e-5);
        let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
        assert!(rel((k.dot_bf16)(&wb, &x), portable::dot_bf16(&wb, &x)) < 1e-5);

        let mut qa = vec![ActBlock::default(); n / QK];
        let mut qb = vec![ActBlock::default(); n / QK];
        (k.quantize)(&x, &mut qa);
        portable::quantize(&x, &mut qb);
        for (a, b) in qa.iter().zip(&qb) {
            assert_eq!(a.qs, b.qs);
            assert_eq!((a.d, a.s, a.isum), (b.d, b.s, b.isum));
        }

        let q8: Vec<BlockQ8_0> = (0..n / QK)
            .map(|_| BlockQ8_0 {
                d: f16::from_f32(rng.random_range(0.001f32..0.1)),
                qs: std::array::from_fn(|_| rng.random_range(-128i32..=127) as i8),
            })
            .collect();
        assert!(rel((k.dot_q8_0)(&q8, &qa), portable::dot_q8_0(&q8, &qa)) < 1e-5);
        let q40: Vec<BlockQ4_0> = (0..n / QK)
            .map(|_| BlockQ4_0 {
                d: f16::from_f32(rng.random_range(-0.1f32..0.1)),
                qs: std::array::from_fn(|_| rng.random::<u8>()),
            })
            .collect();
        assert!(rel((k.dot_q4_0)(&q40, &qa), portable::dot_q4_0(&q40, &qa)) < 1e-5);
        let q41: Vec<BlockQ4_1> = (0..n / QK)
            .map(|_| BlockQ4_1 {
                d: f16::from_f32(rng.random_range(0.001f32..0.1)),
                m: f16::from_f32(rng.random_range(-0.5f32..0.5)),
                qs: std::array::from_fn(|_| rng.random::<u8>()),
            })
            .collect();
        assert!(rel((k.dot_q4_1)(&q41, &qa), portable::dot_q4_1(&q41, &qa)) < 1e-5);
    }
}

/// `n_rows` random rows of `blocks` blocks of `dtype` (Q8_0, Q4_0 or Q4_1), every code value
/// possible (Q8_0's −128 too).
fn random_rows(rng: &mut StdRng, dtype: DType, n_rows: usize, blocks: usize) -> Vec<Vec<u8>> {
    (0..n_rows)
        .map(|_| {
            (0..blocks)
                .flat_map(|_| {
                    let d = f16::from_f32(rng.random_range(0.001f32..0.1));
                    let m = f16::from_f32(rng.random_range(-0.5f32..0.5));
                    let q4: [u8; 16] = std::array::from_fn(|_| rng.random::<u8>());
                    let q8: [i8; QK] = std::array::from_fn(|_| rng.random::<i8>());
                    match dtype {
                        DType::Q8_0 => bytemuck::bytes_of(&BlockQ8_0 { d, qs: q8 }).to_vec(),
                        DType::Q4_0 => bytemuck::bytes_of(&BlockQ4_0 { d, qs: q4 }).to_vec(),
                        _ => bytemuck::bytes_of(&BlockQ4_1 { d, m, qs: q4 }).to_vec(),
                    }
                })
                .collect()
        })
        .collect()
}

/// The SIMD kernel sets this CPU runs (not the portable one); where it runs none, the skip is
/// printed and the list is empty.
fn simd_sets() -> Vec<&'static Kernels> {
    let sets: Vec<_> = available()
        .into_iter()
        .filter(|k| k.name != PORTABLE.name)
        .collect();
    if sets.is_empty() {
        println!("skipped: this CPU runs no SIMD kernel set");
    }
    sets
}

/// What every SIMD set's Q8_0/Q4_0/Q4_1 dot computes (`qdots`' arithmetic), in plain Rust:
/// block by block, the exact integer sum Σ code·x, then `acc = fma(d_w·d_x, sum, acc)` and,
/// for Q4_1, `acc = fma(m_w, s_x, acc)`.
fn shared_arithmetic(dtype: DType, row: &[u8], xa: &[ActBlock]) -> f32 {
    let bb = row.len() / xa.len();
    let half = |b: &[u8], i: usize| f16::from_le_bytes([b[i], b[i + 1]]).to_f32();
    let nibbles = |qs: &[u8], a: &ActBlock| -> i32 {
        (0..16)
            .map(|i| {
                (qs[i] & 15) as i32 * a.qs[i] as i32 + (qs[i] >> 4) as i32 * a.qs[i + 16] as i32
            })
            .sum()
    };
    let mut acc = 0f32;
    for (b, a) in row.chunks_exact(bb).zip(xa) {
        let sum = match dtype {
            DType::Q8_0 => (0..QK)
                .map(|i| b[2 + i] as i8 as i32 * a.qs[i] as i32)
                .sum(),
            DType::Q4_0 => nibbles(&b[2..], a) - 8 * a.isum,
            _ => nibbles(&b[4..], a),
        };
        acc = (half(b, 0) * a.d).mul_add(sum as f32, acc);
        if dtype == DType::Q4_1 {
            acc = half(b, 2).mul_add(a.s, acc);
        }
    }
    acc
}

/// Every SIMD set's Q4_0/Q4_1 dot, one row and many, is `shared_arithmetic` bit for bit (and
/// AVX-512's Q8_0 too; AVX2's Q8_0 keeps llama.cpp's association): so Q4_0 and Q4_1 give the
/// same bits on the AVX2 set and the AVX-512 one (a model's logits do not depend on which of
/// them the CPU has).
#[test]
fn q_dots_are_the_shared_arithmetic_on_every_simd_set() {
    let mut rng = StdRng::seed_from_u64(23);
    let sets = simd_sets();
    for k in sets {
        for dtype in [DType::Q8_0, DType::Q4_0, DType::Q4_1] {
            if dtype == DType::Q8_0 && k.dots(dtype).is_none() {
                continue;
            }
            for blocks in [1usize, 2, 18, 128] {
                let x = rand_vec(&mut rng, 3 * blocks * QK);
                let mut qa = vec![ActBlock::default(); 3 * blocks];
                (k.quantize)(&x, &mut qa);
                let rows = random_rows(&mut rng, dtype, 11, blocks);
                let refs: Vec<&[u8]> = rows.iter().map(|r| r.as_slice()).collect();
                let mut many = vec![f32::NAN; rows.len() * 3];
                if let Some(dots) = k.dots(dtype) {
                    let x = TokenBlocks {
                        blocks: &qa,
                        per_token: blocks,
                    };
                    dots(&refs, &x, 0, &mut many, &[]);
                }
                for (r, row) in rows.iter().enumerate() {
                    for t in 0..3 {
                        let xa = &qa[t * blocks..(t + 1) * blocks];
                        let want = shared_arithmetic(dtype, row, xa);
                        let one = match dtype {
                            DType::Q8_0 => (k.dot_q8_0)(bytemuck::cast_slice(row), xa),
                            DType::Q4_0 => (k.dot_q4_0)(bytemuck::cast_slice(row), xa),
                            _ => (k.dot_q4_1)(bytemuck::cast_slice(row), xa),
                        };
                        let what =
                            format!("{} {dtype} {blocks} blocks, row {r}, token {t}", k.name);
                        assert_eq!(one.to_bits(), want.to_bits(), "{what}: {one} vs {want}");
                        if k.dots(dtype).is_some() {
                            let m = many[r * 3 + t];
                            assert_eq!(
                                m.to_bits(),
                                want.to_bits(),
                                "{what} (many rows): {m} vs {want}"
                            );
                        }
                    }
                }
            }
        }
        println!(
            "{}: its Q4_0/Q4_1 (and many-row Q8_0) dots are the shared arithmetic",
            k.name
        );
    }
}

/// The many-row Q4_0/Q4_1 kernels sum a block's code products in 16-bit lanes before they
/// widen: at the extremes (every code 15 against activations all +127 or all −127, and codes
/// 0 and 15 alternating against alternating signs) nothing saturates or wraps, so each row is
/// still the shared arithmetic bit for bit.
#[test]
fn q4_many_row_sums_hold_at_the_extremes() {
    let sets = simd_sets();
    let blocks = 4;
    let d = f16::from_f32(0.05);
    let m = f16::from_f32(-0.25);
    let row = |codes: [u8; 16], dtype: DType| -> Vec<u8> {
        (0..blocks)
            .flat_map(|_| match dtype {
                DType::Q4_0 => bytemuck::bytes_of(&BlockQ4_0 { d, qs: codes }).to_vec(),
                _ => bytemuck::bytes_of(&BlockQ4_1 { d, m, qs: codes }).to_vec(),
            })
            .collect()
    };
    // Activations that quantize to ±127 everywhere, or to alternating signs.
    let tokens: [Vec<f32>; 3] = [
        vec![1.0; blocks * QK],
        vec![-1.0; blocks * QK],
        (0..blocks * QK)
            .map(|i| if i % 2 == 0 { 1.0 } else { -1.0 })
            .collect(),
    ];
    for k in sets {
        for dtype in [DType::Q4_0, DType::Q4_1] {
            let Some(dots) = k.dots(dtype) else { continue };
            // Eight rows of all 15s and eight of 15/0 alternating: two full register groups.
            let rows: Vec<Vec<u8>> = (0..16)
                .map(|r| row(if r < 8 { [0xff; 16] } else { [0x0f; 16] }, dtype))
                .collect();
            let refs: Vec<&[u8]> = rows.iter().map(|r| r.as_slice()).collect();
            let x: Vec<f32> = tokens.concat();
            let mut qa = vec![ActBlock::default(); tokens.len() * blocks];
            (k.quantize)(&x, &mut qa);
            assert!(qa.iter().all(|a| a.qs.iter().all(|&q| q.abs() == 127)));
            let mut many = vec![f32::NAN; rows.len() * tokens.len()];
            let tb = TokenBlocks {
                blocks: &qa,
                per_token: blocks,
            };
            dots(&refs, &tb, 0, &mut many, &[]);
            for (r, row) in rows.iter().enumerate() {
                for t in 0..tokens.len() {
                    let want = shared_arithmetic(dtype, row, &qa[t * blocks..(t + 1) * blocks]);
                    let got = many[r * tokens.len() + t];
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{} {dtype} row {r} token {t}: {got} vs {want}",
                        k.name
                    );
                }
            }
        }
    }
}

/// The many-row kernels give each (row, token) exactly what the one-token kernel gives it
/// (batched requests answer as if alone), whatever rows and tokens are computed beside it:
/// odd and even block counts, every tile size, groups of rows full and partial.
#[test]
fn many_token_dots_equal_one_token_dots_bit_for_bit() {
    let mut rng = StdRng::seed_from_u64(19);
    let mut checked = 0;
    for k in available() {
        for dtype in [DType::Q8_0, DType::Q4_0, DType::Q4_1] {
            let Some(dots) = k.dots(dtype) else {
                continue;
            };
            for (blocks, tokens, n_rows) in [
                (1usize, 3usize, 1usize),
                (18, 11, 17),
                (48, 8, 16),
                (9, 16, 3),
            ] {
                let x = rand_vec(&mut rng, tokens * blocks * QK);
                let mut qa = vec![ActBlock::default(); tokens * blocks];
                (k.quantize)(&x, &mut qa);
                let rows = random_rows(&mut rng, dtype, n_rows, blocks);
                let refs: Vec<&[u8]> = rows.iter().map(|r| r.as_slice()).collect();
                let x = TokenBlocks {
                    blocks: &qa,
                    per_token: blocks,
                };
                for t0 in [0, 1] {
                    let n = tokens - t0;
                    let mut all = vec![f32::NAN; n_rows * n];
                    dots(&refs, &x, t0, &mut all, &rows[0]);
                    for (r, row) in rows.iter().enumerate() {
                        // One row alone gives what it gives among the others.
                        let mut alone = vec![f32::NAN; n];
                        dots(&[row], &x, t0, &mut alone, &[]);
                        assert_eq!(alone[..], all[r * n..(r + 1) * n]);
                        for (j, g) in alone.iter().enumerate() {
                            let xa = &qa[(t0 + j) * blocks..(t0 + j + 1) * blocks];
                            let one = match dtype {
                                DType::Q8_0 => (k.dot_q8_0)(bytemuck::cast_slice(row), xa),
                                DType::Q4_0 => (k.dot_q4_0)(bytemuck::cast_slice(row), xa),
                                _ => (k.dot_q4_1)(bytemuck::cast_slice(row), xa),
                            };
                            assert_eq!(
                                g.to_bits(),
                                one.to_bits(),
                                "{} {dtype} {blocks} blocks, row {r}, token {}: {g} vs {one}",
                                k.name,
                                t0 + j
                            );
                            // And it is the product the portable kernel computes.
                            let reference = match dtype {
                                DType::Q8_0 => portable::dot_q8_0(bytemuck::cast_slice(row), xa),
                                DType::Q4_0 => portable::dot_q4_0(bytemuck::cast_slice(row), xa),
                                _ => portable::dot_q4_1(bytemuck::cast_slice(row), xa),
                            };
                            assert!(
                                (g - reference).abs() <= 1e-4 * reference.abs().max(1.0),
                                "{} {dtype}: {g} vs portable {reference}",
                                k.name
                            );
                            checked += 1;
                        }
                    }
                }
            }
        }
    }
    println!("{checked} many-row dots checked");
}

/// Every set's softmax numerators are `exp` to a few ulp, each value whatever its place in
/// the slice (vector lanes and the scalar tail agree), and their sum is theirs.
#[test]
fn exp_sum_is_exp_to_a_few_ulp_wherever_a_value_lies() {
    let mut rng = StdRng::seed_from_u64(23);
    let mut xs: Vec<f32> = (0..1000)
        .map(|_| rng.random_range(-100.0f32..0.0))
        .collect();
    xs.extend([
        0.0,
        -0.0,
        -1e-30,
        -87.3,
        -87.4,
        -88.0,
        -103.0,
        f32::NEG_INFINITY,
        -1e-3,
    ]);
    for k in available() {
        let mut got = xs.clone();
        let sum = (k.exp_sum)(&mut got, 0.0);
        let mut want_sum = 0f64;
        for (&x, &g) in xs.iter().zip(&got) {
            let want = (x as f64).exp();
            want_sum += g as f64;
            let tiny = want < f32::MIN_POSITIVE as f64;
            assert!(
                (g as f64 - want).abs() <= 4.0 * f32::EPSILON as f64 * want
                    || (tiny && g as f64 <= f32::MIN_POSITIVE as f64),
                "{}: exp({x}) = {g}, want {want}",
                k.name
            );
            let mut one = [x];
            (k.exp_sum)(&mut one, 0.0);
            assert_eq!(one[0].to_bits(), g.to_bits(), "{}: exp({x}) alone", k.name);
        }
        assert!((sum - want_sum).abs() <= 1e-12 * want_sum, "{}", k.name);
        // Scores less their maximum: the maximum's numerator is exactly 1.
        let mut s = [3.0f32, 5.0, 1.0];
        (k.exp_sum)(&mut s, 5.0);
        assert_eq!(s[1], 1.0, "{}", k.name);
        let mut nan = [f32::NAN; 9];
        (k.exp_sum)(&mut nan, 0.0);
        assert!(
            nan.iter().all(|v| v.is_nan()),
            "{}: a NaN score stays NaN",
            k.name
        );
    }
}

#[test]
fn quantized_dot_is_close_to_float_dot() {
    let mut rng = StdRng::seed_from_u64(3);
    let x = rand_vec(&mut rng, 256);
    let w = rand_vec(&mut rng, 256);
    let q8: Vec<BlockQ8_0> = w
        .chunks(QK)
        .map(|c| {
            let amax = c.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            BlockQ8_0 {
                d: f16::from_f32(d),
                qs: std::array::from_fn(|i| (c[i] / d).round() as i8),
            }
        })
        .collect();
    let mut qa = vec![ActBlock::default(); 8];
    (best().quantize)(&x, &mut qa);
    let exact = portable::dot_f32(&w, &x);
    let approx = (best().dot_q8_0)(&q8, &qa);
    assert!(
        (exact - approx).abs() < 0.05 * exact.abs().max(1.0),
        "{exact} vs {approx}"
    );
}

/// The many-row kernels over rows laid out in tiles give the row kernels' bits: every format,
/// two tiles, token counts a tile takes whole and ones it splits, from a token past the first.
#[test]
fn tiled_dots_are_the_row_dots_bit_for_bit() {
    let mut rng = StdRng::seed_from_u64(41);
    let mut ran = false;
    for k in simd_sets() {
        for dtype in [DType::Q8_0, DType::Q4_0, DType::Q4_1] {
            let (Some(tiled), Some(dots)) = (k.tiled(dtype), k.dots(dtype)) else {
                continue;
            };
            ran = true;
            for blocks in [1usize, 18] {
                let rows = random_rows(&mut rng, dtype, 2 * TILE_ROWS, blocks);
                let refs: Vec<&[u8]> = rows.iter().map(|r| r.as_slice()).collect();
                let mut in_tiles = rows.concat();
                tile_rows(dtype, &mut in_tiles, rows.len(), rows[0].len());
                for n in [1usize, 2, 3, 5, 8, 9, 16] {
                    let x = rand_vec(&mut rng, (n + 1) * blocks * QK);
                    let mut qa = vec![ActBlock::default(); (n + 1) * blocks];
                    (k.quantize)(&x, &mut qa);
                    let x = TokenBlocks {
                        blocks: &qa,
                        per_token: blocks,
                    };
                    let mut want = vec![f32::NAN; rows.len() * n];
                    dots(&refs, &x, 1, &mut want, &[]);
                    let mut got = vec![f32::NAN; rows.len() * n];
                    tiled(&in_tiles, &x, 1, &mut got);
                    // No tokens: nothing written, nothing read.
                    tiled(&in_tiles, &x, 1, &mut []);
                    let what = format!("{} {dtype}, {blocks} blocks, {n} tokens", k.name);
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert_eq!(g.to_bits(), w.to_bits(), "{what}, value {i}: {g} vs {w}");
                    }
                }
            }
        }
    }
    if !ran {
        println!("skipped: no kernel set on this CPU reads rows in tiles");
    }
}
