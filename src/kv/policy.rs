//! Which bit width each chunk gets (LLMS tolerance-aware compression) and which chunk leaves
//! DRAM first (the LCTRU queue).

use super::chunk::Bits;

/// How chunks are compressed when they leave the device.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Compression {
    /// Exact f32 (swap and restore are bit-exact).
    Off,
    /// Every chunk at one width (the "uniform" baseline).
    Uniform(Bits),
    /// Widths from {8, 4, 2} by information density, so that the mean code width over the
    /// context stays at or under this fraction of 8 bits (0.25..=1; the per-group scales, the
    /// same 1 bit per value at every width, are not counted).
    Ratio(f64),
}

impl Compression {
    /// Parse `off`, `int8`/`int4`/`int2` (uniform) or a ratio like `0.5` / `50%`.
    pub fn parse(s: &str) -> Result<Self, String> {
        let t = s.trim().to_ascii_lowercase();
        match t.as_str() {
            "off" | "none" | "f32" => return Ok(Compression::Off),
            "int8" | "q8" => return Ok(Compression::Uniform(Bits::Q8)),
            "int4" | "q4" => return Ok(Compression::Uniform(Bits::Q4)),
            "int2" | "q2" => return Ok(Compression::Uniform(Bits::Q2)),
            _ => {}
        }
        let (num, pct) = match t.strip_suffix('%') {
            Some(n) => (n, true),
            None => (t.as_str(), false),
        };
        let v: f64 = num.parse().map_err(|_| {
            format!("'{s}' is not off, int8, int4, int2 or a ratio like 0.5 or 50%")
        })?;
        let r = if pct { v / 100.0 } else { v };
        if !(0.25..=1.0).contains(&r) {
            return Err(format!(
                "compression ratio {s} is outside 25%..100% of int8 (2 bits is the least)"
            ));
        }
        Ok(Compression::Ratio(r))
    }
}

/// Bit widths for the full chunks of a context. `density[i]` is chunk i's share of attention;
/// `fixed[i]` is the width of a chunk already written (kept as is); the others are chosen: start
/// every free chunk at 2 bits, then widen the densest first (to 4, then 8) while the mean width
/// stays within `ratio` × 8 bits.
pub fn allocate_bits(density: &[f32], fixed: &[Option<Bits>], ratio: f64) -> Vec<Bits> {
    let n = fixed.len();
    let size = |b: Bits| b.bits() as f64;
    let budget = ratio * size(Bits::Q8) * n as f64;
    let mut bits: Vec<Bits> = fixed.iter().map(|f| f.unwrap_or(Bits::Q2)).collect();
    let mut used: f64 = bits.iter().map(|&b| size(b)).sum();
    let mut free: Vec<usize> = (0..n).filter(|&i| fixed[i].is_none()).collect();
    let d = |i: usize| density.get(i).copied().unwrap_or(0.0);
    free.sort_by(|&a, &b| d(b).total_cmp(&d(a)).then(a.cmp(&b)));
    for step in [Bits::Q4, Bits::Q8] {
        for &i in &free {
            if bits[i] >= step {
                continue;
            }
            let extra = size(step) - size(bits[i]);
            if used + extra <= budget + 1e-6 {
                used += extra;
                bits[i] = step;
            }
        }
    }
    bits
}

/// Eviction order of DRAM chunks (LCTRU): least recently used context first; within a context,
/// the chunks least tolerant of compression (the widest) first, then later chunks first.
pub fn lctru_key(
    context_last_use: u64,
    bits: Bits,
    index: usize,
) -> (u64, std::cmp::Reverse<Bits>, std::cmp::Reverse<usize>) {
    (
        context_last_use,
        std::cmp::Reverse(bits),
        std::cmp::Reverse(index),
    )
}

/// Linear cost models measured at start-up: recompute time per token, load time per chunk
/// file (a fixed part plus a per-byte part), and the time decoding a compressed value takes
/// beyond copying an exact one.
#[derive(Clone, Copy, Debug)]
pub struct CostModel {
    pub recompute_s_per_token: f64,
    pub load_s_per_chunk: f64,
    pub load_s_per_byte: f64,
    /// Seconds per value to decode a compressed chunk, over an exact one's copy; 0 (not
    /// measured): compression always pays.
    pub decode_s_per_value: f64,
}

impl CostModel {
    /// Whether a chunk the tolerance logic gives `bits` comes back sooner stored exact: the
    /// bytes exact adds cost less to load (at the measured disk rate, the slowest tier a chunk
    /// is read from) than decoding the compressed values costs. Exact loses nothing in accuracy;
    /// it only spends memory, where moving bytes is nearly free (the page cache, host memory).
    /// `exact`: the raw width that holds the cache's values exactly ([`Bits::exact_for`]).
    pub fn prefer_exact(&self, bits: Bits, exact: Bits) -> bool {
        if bits.is_raw() || self.decode_s_per_value <= 0.0 {
            return false;
        }
        // Bytes per value: the codes, plus a 4-byte header per group of 32.
        let compressed = bits.bits() as f64 / 8.0 + 4.0 / 32.0;
        let raw = exact.bits() as f64 / 8.0;
        (raw - compressed) * self.load_s_per_byte < self.decode_s_per_value
    }

    /// Whether every quantized width would be stored exact ([`CostModel::prefer_exact`]): then
    /// no chunk's width depends on its attention density, and nothing need measure it.
    pub fn exact_always(&self, exact: Bits) -> bool {
        [Bits::Q2, Bits::Q4, Bits::Q8]
            .iter()
            .all(|&b| self.prefer_exact(b, exact))
    }

    /// How many leading chunks to recompute while the I/O thread loads the rest from disk, so
    /// that both finish as early as possible. `on_disk[i]`: bytes chunk i must read (None: the
    /// chunk is in DRAM or has to be recomputed anyway).
    pub fn recompute_prefix(&self, on_disk: &[Option<u64>], tokens_per_chunk: &[usize]) -> usize {
        let n = on_disk.len();
        let load = |i: usize| {
            on_disk[i].map_or(0.0, |b| {
                self.load_s_per_chunk + b as f64 * self.load_s_per_byte
            })
        };
        let mut io_after: f64 = (0..n).map(load).sum();
        let mut compute = 0.0;
        let mut best = (io_after, 0);
        for r in 1..=n {
            compute += tokens_per_chunk[r - 1] as f64 * self.recompute_s_per_token;
            io_after -= load(r - 1);
            let t = compute.max(io_after);
            if t < best.0 {
                best = (t, r);
            }
        }
        best.1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratio_is_met_and_dense_chunks_get_more_bits() {
        let density = [0.5, 0.05, 0.3, 0.05, 0.1, 0.0];
        let fixed = [None; 6];
        for ratio in [0.25, 0.5, 0.75, 1.0] {
            let bits = allocate_bits(&density, &fixed, ratio);
            let used: usize = bits.iter().map(|b| b.bits()).sum();
            assert!(used as f64 <= ratio * 6.0 * 8.0 + 1e-6, "{ratio}: {bits:?}");
            // Densest never gets fewer bits than a sparser one.
            assert!(
                bits[0] >= bits[2] && bits[2] >= bits[4] && bits[4] >= bits[5],
                "{bits:?}"
            );
        }
        assert_eq!(allocate_bits(&density, &fixed, 1.0), vec![Bits::Q8; 6]);
        let half = allocate_bits(&density, &fixed, 0.5);
        assert_eq!(half.iter().map(|b| b.bits()).sum::<usize>(), 24, "{half:?}");
    }

    #[test]
    fn fixed_chunks_keep_their_width_and_count_against_the_budget() {
        let fixed = [Some(Bits::Q8), Some(Bits::Q8), None, None];
        let bits = allocate_bits(&[0.0, 0.0, 0.9, 0.1], &fixed, 0.5);
        assert_eq!(&bits[..2], &[Bits::Q8, Bits::Q8]);
        assert_eq!(&bits[2..], &[Bits::Q2, Bits::Q2]);
    }

    #[test]
    fn parse_compression() {
        assert_eq!(Compression::parse("off").unwrap(), Compression::Off);
        assert_eq!(Compression::parse("50%").unwrap(), Compression::Ratio(0.5));
        assert_eq!(
            Compression::parse("int8").unwrap(),
            Compression::Uniform(Bits::Q8)
        );
        assert!(Compression::parse("0.1").is_err());
        assert!(Compression::parse("lots").is_err());
    }

    #[test]
    fn recompute_prefix_balances_io_and_compute() {
        let m = CostModel {
            recompute_s_per_token: 1.0,
            load_s_per_chunk: 16.0,
            load_s_per_byte: 0.0,
            decode_s_per_value: 0.0,
        };
        // Loading a chunk costs as much as recomputing it: split in half.
        assert_eq!(m.recompute_prefix(&[Some(1); 8], &[16; 8]), 4);
        // Free loads: recompute nothing.
        let cheap = CostModel {
            load_s_per_chunk: 0.0,
            ..m
        };
        assert_eq!(cheap.recompute_prefix(&[Some(1); 8], &[16; 8]), 0);
        // Nothing on disk: nothing to gain.
        assert_eq!(m.recompute_prefix(&[None; 8], &[16; 8]), 0);
    }

    #[test]
    fn exact_is_preferred_only_where_decoding_costs_more_than_the_bytes() {
        let m = |per_byte: f64, decode: f64| CostModel {
            recompute_s_per_token: 1e-3,
            load_s_per_chunk: 1e-5,
            load_s_per_byte: per_byte,
            decode_s_per_value: decode,
        };
        // Page cache (0.16 ns/byte) against a 1.5 ns/value decode: exact.
        let f32 = Bits::F32;
        let fast = m(0.16e-9, 1.5e-9);
        assert!(fast.exact_always(f32));
        // An SSD at 1 GB/s: the bytes cost more than the decode, compression kept.
        let ssd = m(1e-9, 1.5e-9);
        assert!(
            [Bits::Q2, Bits::Q4, Bits::Q8]
                .iter()
                .all(|&b| !ssd.prefer_exact(b, f32))
        );
        // In between, the widest code saves the fewest bytes: it goes exact first.
        let mid = m(0.5e-9, 1.5e-9);
        assert!(mid.prefer_exact(Bits::Q8, f32) && !mid.prefer_exact(Bits::Q2, f32));
        assert!(!mid.exact_always(f32));
        // An f16 cache's exact chunks are half the bytes: exact pays sooner.
        assert!(mid.exact_always(Bits::F16));
        assert!(!m(1.5e-9, 1.5e-9).prefer_exact(Bits::Q2, Bits::F16));
        // Not measured: never.
        assert!(!m(0.0, 0.0).prefer_exact(Bits::Q4, f32));
        assert!(!fast.prefer_exact(Bits::F32, f32) && !fast.prefer_exact(Bits::F16, f32));
    }
}
