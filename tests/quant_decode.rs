//! GGML block decoders against gguf-py.
//!
//! `tests/fixtures/quant/blocks.json` (written by `scripts/reference.py quant`) holds, per GGML
//! type, a few blocks of random bytes with finite f16 scales (positive, negative and subnormal
//! ones) and what gguf-py's `gguf.quants.dequantize` makes of them, as f32 bit patterns.
//! `GgmlType::dequantize` must give the same values. gguf-py evaluates each formula in the same
//! order as ggml's reference C code (`ggml-quants.c`), so the values must agree exactly.

use gpu_offload::model::ggml::GgmlType;
use serde_json::Value;

const FIXTURE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/quant/blocks.json"
);

/// The types the fixture must cover (name, GGML type id).
const TYPES: [(&str, u32); 8] = [
    ("Q4_0", 2),
    ("Q4_1", 3),
    ("Q5_0", 6),
    ("Q5_1", 7),
    ("Q8_0", 8),
    ("Q4_K", 12),
    ("Q5_K", 13),
    ("Q6_K", 14),
];

struct Case {
    name: String,
    ty: GgmlType,
    block_len: usize,
    block_bytes: usize,
    n: usize,
    bytes: Vec<u8>,
    want: Vec<f32>,
}

fn hex_bytes(s: &str) -> Vec<u8> {
    assert!(s.len().is_multiple_of(2), "odd hex length");
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex byte"))
        .collect()
}

fn hex_f32s(s: &str) -> Vec<f32> {
    assert!(s.len().is_multiple_of(8), "hex f32 list length");
    (0..s.len())
        .step_by(8)
        .map(|i| f32::from_bits(u32::from_str_radix(&s[i..i + 8], 16).expect("hex u32")))
        .collect()
}

fn usize_of(v: &Value, key: &str) -> usize {
    v[key].as_u64().unwrap_or_else(|| panic!("`{key}` missing")) as usize
}

fn cases() -> Vec<Case> {
    let text = std::fs::read_to_string(FIXTURE).expect("read tests/fixtures/quant/blocks.json");
    let doc: Value = serde_json::from_str(&text).expect("blocks.json is JSON");
    let types = doc["types"].as_object().expect("`types` object");
    TYPES
        .iter()
        .map(|&(name, id)| {
            let t = types
                .get(name)
                .unwrap_or_else(|| panic!("{name} missing from the fixture"));
            assert_eq!(usize_of(t, "type_id") as u32, id, "{name} type id");
            let want = hex_f32s(t["values_bits_hex"].as_str().expect("values_bits_hex"));
            // The JSON numbers are the same values (every f32 is exactly a double).
            let numbers: Vec<f32> = t["values"]
                .as_array()
                .expect("values")
                .iter()
                .map(|x| x.as_f64().expect("number") as f32)
                .collect();
            assert_eq!(numbers.len(), want.len(), "{name}: values length");
            for (i, (a, b)) in numbers.iter().zip(&want).enumerate() {
                assert_eq!(
                    a.to_bits(),
                    b.to_bits(),
                    "{name}[{i}]: values vs values_bits_hex"
                );
            }
            Case {
                name: name.to_string(),
                ty: GgmlType::from_id(id).unwrap_or_else(|| panic!("type id {id} unknown")),
                block_len: usize_of(t, "block_len"),
                block_bytes: usize_of(t, "block_bytes"),
                n: usize_of(t, "n"),
                bytes: hex_bytes(t["bytes_hex"].as_str().expect("bytes_hex")),
                want,
            }
        })
        .collect()
}

/// Indices where `got` and `want` differ; `bitwise` also tells +0 from -0.
fn mismatches(got: &[f32], want: &[f32], bitwise: bool) -> Vec<String> {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .enumerate()
        .filter(|(_, (g, w))| {
            if bitwise {
                g.to_bits() != w.to_bits()
            } else {
                g != w
            }
        })
        .map(|(i, (g, w))| {
            format!(
                "[{i}] got {g:e} ({:08x}) want {w:e} ({:08x})",
                g.to_bits(),
                w.to_bits()
            )
        })
        .collect()
}

#[test]
fn fixture_geometry_matches_ggml_types() {
    for c in cases() {
        assert_eq!(c.ty.name(), c.name);
        assert_eq!(c.ty.block(), (c.block_len, c.block_bytes), "{}", c.name);
        assert_eq!(
            c.bytes.len(),
            c.n / c.block_len * c.block_bytes,
            "{}",
            c.name
        );
        assert_eq!(c.want.len(), c.n, "{}", c.name);
        assert!(c.want.iter().all(|v| v.is_finite()), "{}", c.name);
    }
}

/// Decode every case and compare with gguf-py; panics listing the types that differ.
fn check(cases: impl IntoIterator<Item = Case>, bitwise: bool) {
    let mut failures = Vec::new();
    for c in cases {
        let got =
            c.ty.dequantize(&c.bytes, c.n)
                .unwrap_or_else(|e| panic!("{}: {e}", c.name));
        let bad = mismatches(&got, &c.want, bitwise);
        if !bad.is_empty() {
            let first = bad[..bad.len().min(4)].join("; ");
            failures.push(format!(
                "{}: {} of {} differ, first: {first}",
                c.name,
                bad.len(),
                c.n
            ));
        }
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
}

/// Every value equal to gguf-py's as a number (+0 and -0 count as equal here).
#[test]
fn dequantize_equals_gguf_py() {
    check(cases(), false);
}

/// Bit for bit, signed zeros included: ggml computes Q5_0 as `x * d` (no `+ m`), which is -0.0
/// when the code is 16 and d < 0; a decoder that shares Q5_1's `x * d + m` with m = 0.0 would
/// turn that into +0.0 (the fixture has such a value: Q5_0 index 52).
#[test]
fn dequantize_bitwise_equals_gguf_py() {
    check(cases(), true);
}

/// Blocks are independent: decoding them one at a time gives the same values.
#[test]
fn dequantize_block_by_block() {
    for c in cases() {
        for (b, block) in c.bytes.chunks_exact(c.block_bytes).enumerate() {
            let got = c.ty.dequantize(block, c.block_len).unwrap();
            let want = &c.want[b * c.block_len..(b + 1) * c.block_len];
            let bad = mismatches(&got, want, false);
            assert!(bad.is_empty(), "{} block {b}: {}", c.name, bad.join("; "));
        }
    }
}

/// The decoder takes any `&[u8]`, including one that starts at an odd address (a tensor at an
/// odd offset of a map or buffer): no casting of the bytes to aligned block structs.
#[test]
fn dequantize_unaligned_input() {
    for c in cases() {
        let mut buf = vec![0u8; c.bytes.len() + 1];
        buf[1..].copy_from_slice(&c.bytes);
        let name = c.name.clone();
        let got = std::panic::catch_unwind(|| c.ty.dequantize(&buf[1..], c.n))
            .unwrap_or_else(|_| panic!("{name}: dequantize panicked on input at an odd address"))
            .unwrap();
        let bad = mismatches(&got, &c.want, false);
        assert!(bad.is_empty(), "{name} (unaligned): {}", bad.join("; "));
    }
}

#[test]
fn dequantize_rejects_wrong_sizes() {
    for c in cases() {
        // n not a whole number of blocks
        assert!(c.ty.dequantize(&c.bytes, c.n - 1).is_err(), "{}", c.name);
        // bytes one short / one long for n
        assert!(
            c.ty.dequantize(&c.bytes[..c.bytes.len() - 1], c.n).is_err(),
            "{}",
            c.name
        );
        let mut long = c.bytes.clone();
        long.push(0);
        assert!(c.ty.dequantize(&long, c.n).is_err(), "{}", c.name);
        // one block fewer than the bytes hold
        assert!(
            c.ty.dequantize(&c.bytes, c.n - c.block_len).is_err(),
            "{}",
            c.name
        );
    }
}
