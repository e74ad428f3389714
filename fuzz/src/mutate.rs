//! The in-process mutator of the fuzz harness: a seeded generator and mutations that know the
//! shapes our inputs have (JSON documents, a safetensors header, little-endian lengths in GGUF,
//! inputs of several parts). No dependency: the same seed gives the same inputs on every machine,
//! which is what lets `cargo test` run it as a deterministic short run.

use serde_json::{Map, Number, Value};

/// Separates the parts of a multi-file input (config.json, then model.safetensors; or
/// tokenizer.json, then tokenizer_config.json; or a template, then messages).
pub const PART_SEPARATOR: &[u8] = b"\n\x00--fuzz-part--\x00\n";

/// Inputs are capped so that one input cannot take the process's memory by itself being large:
/// what the targets must survive is what a small file makes them allocate.
pub const MAX_INPUT: usize = 64 << 10;

/// splitmix64: tiny, seedable, good enough to pick mutations.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    pub fn chance(&mut self, one_in: usize) -> bool {
        self.below(one_in) == 0
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// Integers at the edges where size arithmetic breaks.
const INTERESTING: &[u64] = &[
    0,
    1,
    2,
    3,
    7,
    8,
    16,
    31,
    32,
    64,
    127,
    128,
    255,
    256,
    511,
    512,
    4095,
    4096,
    65535,
    65536,
    1 << 20,
    (1 << 31) - 1,
    1 << 31,
    u32::MAX as u64,
    1 << 32,
    1_000_000_000,
    1 << 40,
    i64::MAX as u64,
    1 << 63,
    u64::MAX,
];

/// JSON values a careless or hostile file puts where a number or string belongs.
fn interesting_json(rng: &mut Rng) -> Value {
    match rng.below(14) {
        0 => Value::Null,
        1 => Value::Bool(rng.chance(2)),
        2 => Value::from(*rng.pick(INTERESTING)),
        3 => Value::from((*rng.pick(INTERESTING) as i64).wrapping_neg()),
        4 => Value::from(*rng.pick(&[0.0, -0.0, 1e-300, 1e300, -1.0, 0.5, 1e38, 3.5e38])),
        5 => Value::Number(Number::from_f64(f64::MAX).unwrap_or_else(|| Number::from(0))),
        6 => Value::String(String::new()),
        7 => Value::String("x".repeat(rng.below(300))),
        8 => Value::String(
            rng.pick(&["NaN", "inf", "-1", "0", "../../x", "\u{0}", "é"])
                .to_string(),
        ),
        9 => Value::Array(Vec::new()),
        10 => Value::Object(Map::new()),
        11 => Value::Array((0..rng.below(40)).map(|i| Value::from(i as u64)).collect()),
        12 => Value::from(rng.below(5000) as u64),
        _ => Value::from(rng.below(100) as f64 / 7.0),
    }
}

/// Mutate `data` once or a few times; the result is at most [`MAX_INPUT`] bytes. `donor` is
/// another corpus entry, for splices.
pub fn mutate(data: &[u8], donor: &[u8], rng: &mut Rng) -> Vec<u8> {
    let mut out = data.to_vec();
    let rounds = 1 + rng.below(3);
    for _ in 0..rounds {
        out = mutate_parts(&out, donor, rng);
    }
    out.truncate(MAX_INPUT);
    out
}

/// Pick one part of a multi-part input and mutate it.
fn mutate_parts(data: &[u8], donor: &[u8], rng: &mut Rng) -> Vec<u8> {
    let mut parts = split_parts(data);
    if parts.len() > 1 && rng.chance(8) {
        // Drop or duplicate a whole part.
        let i = rng.below(parts.len());
        if rng.chance(2) {
            parts.remove(i);
        } else {
            let p = parts[i].clone();
            parts.insert(i, p);
        }
        return join_parts(&parts);
    }
    let i = rng.below(parts.len());
    parts[i] = mutate_one(&parts[i], donor, rng);
    join_parts(&parts)
}

pub fn split_parts(data: &[u8]) -> Vec<Vec<u8>> {
    let mut parts = Vec::new();
    let mut rest = data;
    while let Some(at) = find(rest, PART_SEPARATOR) {
        parts.push(rest[..at].to_vec());
        rest = &rest[at + PART_SEPARATOR.len()..];
    }
    parts.push(rest.to_vec());
    parts
}

pub fn join_parts(parts: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, p) in parts.iter().enumerate() {
        if i > 0 {
            out.extend_from_slice(PART_SEPARATOR);
        }
        out.extend_from_slice(p);
    }
    out
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn mutate_one(part: &[u8], donor: &[u8], rng: &mut Rng) -> Vec<u8> {
    // Structure-aware first when the part has a structure we know, bytes otherwise.
    if rng.chance(3) {
        return mutate_bytes(part, donor, rng);
    }
    if let Ok(mut v) = serde_json::from_slice::<Value>(part) {
        mutate_json(&mut v, rng);
        return serde_json::to_vec(&v).unwrap_or_else(|_| part.to_vec());
    }
    if let Some(out) = mutate_jsonl(part, rng) {
        return out;
    }
    if let Some(out) = mutate_safetensors(part, rng) {
        return out;
    }
    mutate_bytes(part, donor, rng)
}

/// Newline-separated JSON records (prefill input): mutate one record, or swap, repeat, drop one.
fn mutate_jsonl(part: &[u8], rng: &mut Rng) -> Option<Vec<u8>> {
    let mut lines: Vec<Vec<u8>> = part.split(|&b| b == b'\n').map(<[u8]>::to_vec).collect();
    if lines.len() < 2 || serde_json::from_slice::<Value>(&lines[0]).is_err() {
        return None;
    }
    let i = rng.below(lines.len());
    match rng.below(4) {
        0 => {
            let l = lines[i].clone();
            lines.insert(rng.below(lines.len()), l);
        }
        1 => {
            lines.remove(i);
        }
        _ => {
            if let Ok(mut v) = serde_json::from_slice::<Value>(&lines[i]) {
                mutate_json(&mut v, rng);
                lines[i] = serde_json::to_vec(&v).ok()?;
            } else {
                lines[i] = mutate_bytes(&lines[i], &[], rng);
            }
        }
    }
    Some(lines.join(&b'\n'))
}

/// A safetensors file: an 8-byte header length, a JSON header, the data. Mutate the header's
/// JSON and write its length back, so the mutation reaches past the length check.
fn mutate_safetensors(part: &[u8], rng: &mut Rng) -> Option<Vec<u8>> {
    let n = u64::from_le_bytes(part.get(..8)?.try_into().ok()?) as usize;
    let header = part.get(8..8usize.checked_add(n)?)?;
    let mut v: Value = serde_json::from_slice(header).ok()?;
    mutate_json(&mut v, rng);
    let text = serde_json::to_vec(&v).ok()?;
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&text);
    out.extend_from_slice(&part[8 + n..]);
    Some(out)
}

/// Replace, remove or add one node somewhere in the document.
pub fn mutate_json(node: &mut Value, rng: &mut Rng) {
    // Walk down a random path; stop at a random depth.
    let children = match node {
        Value::Array(a) => a.len(),
        Value::Object(o) => o.len(),
        _ => 0,
    };
    if children > 0 && !rng.chance(3) {
        let i = rng.below(children);
        let child = match node {
            Value::Array(a) => a.get_mut(i),
            Value::Object(o) => o.values_mut().nth(i),
            _ => None,
        };
        if let Some(child) = child {
            return mutate_json(child, rng);
        }
    }
    match node {
        Value::Object(o) if !o.is_empty() && rng.chance(2) => {
            let i = rng.below(o.len());
            let key = o.keys().nth(i).cloned().unwrap_or_default();
            if rng.chance(2) {
                o.remove(&key);
            } else {
                o.insert(key, interesting_json(rng));
            }
        }
        Value::Array(a) if !a.is_empty() && rng.chance(2) => match rng.below(3) {
            0 => {
                a.remove(rng.below(a.len()));
            }
            1 => {
                let x = a[rng.below(a.len())].clone();
                let n = 1 + rng.below(8);
                a.extend(std::iter::repeat_n(x, n));
            }
            _ => {
                let i = rng.below(a.len());
                a[i] = interesting_json(rng);
            }
        },
        Value::Number(n) if rng.chance(2) => {
            // Near the old value: off by one, doubled, negated.
            let x = n.as_f64().unwrap_or(0.0);
            let y = *rng.pick(&[x + 1.0, x - 1.0, x * 2.0, -x, x * 1e6, 0.0]);
            *node = Number::from_f64(y).map_or(Value::Null, |n| {
                if y.fract() == 0.0 && y.abs() < 9e15 {
                    Value::from(y as i64)
                } else {
                    Value::Number(n)
                }
            });
        }
        Value::String(s) if rng.chance(2) => {
            let bytes = mutate_bytes(s.as_bytes(), &[], rng);
            *s = String::from_utf8_lossy(&bytes).into_owned();
        }
        _ => *node = interesting_json(rng),
    }
}

/// Byte-level: flips, interesting integers at aligned offsets, truncation, inserts, splices.
pub fn mutate_bytes(data: &[u8], donor: &[u8], rng: &mut Rng) -> Vec<u8> {
    let mut out = data.to_vec();
    if out.is_empty() {
        out.push(rng.next() as u8);
        return out;
    }
    let len = out.len();
    match rng.below(9) {
        0 => {
            let i = rng.below(len);
            out[i] ^= 1 << rng.below(8);
        }
        1 => {
            let i = rng.below(len);
            out[i] = rng.next() as u8;
        }
        2 | 3 => {
            // A little-endian integer (u32 or u64) at a 4-aligned offset: GGUF's counts,
            // lengths, types and dimensions all sit there.
            let width = if rng.chance(2) { 4 } else { 8 };
            let at = rng.below(len / 4 + 1) * 4;
            let value = *rng.pick(INTERESTING);
            let bytes = value.to_le_bytes();
            for (k, b) in bytes[..width].iter().enumerate() {
                if let Some(slot) = out.get_mut(at + k) {
                    *slot = *b;
                }
            }
        }
        4 => out.truncate(rng.below(len)),
        5 => {
            let at = rng.below(len);
            let end = (at + 1 + rng.below(64)).min(len);
            out.drain(at..end);
        }
        6 => {
            // Repeat a chunk (grows lists and strings).
            let at = rng.below(len);
            let end = (at + 1 + rng.below(256)).min(len);
            let chunk = out[at..end].to_vec();
            let to = rng.below(len + 1);
            out.splice(to..to, chunk);
        }
        7 if !donor.is_empty() => {
            // Splice: our head, the donor's tail.
            let at = rng.below(len);
            let from = rng.below(donor.len());
            out.truncate(at);
            out.extend_from_slice(&donor[from..]);
        }
        _ => {
            let at = rng.below(len + 1);
            let junk: Vec<u8> = (0..1 + rng.below(16)).map(|_| rng.next() as u8).collect();
            out.splice(at..at, junk);
        }
    }
    out
}
