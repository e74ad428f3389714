//! Which attention kernel a step takes and how it splits its keys: what the workspace is sized
//! for ([`super::workspace_bytes`]), decided the same way on every device. Pure: no GPU.

use super::KvType;

/// Query rows the split-KV (flash-decoding) attention takes (SPLIT_ROWS in
/// kernels/flash_attention.cu); more rows go to the prefill kernels.
pub const SPLIT_ROWS: usize = 4;
/// Partials per head of a split attention (MAX_SPLITS in kernels/flash_attention.cu): rows ×
/// key chunks at most, whatever the context, so the workspace is fixed per model.
pub const MAX_SPLITS: usize = 32;
/// Fewest keys a split-attention chunk takes: shorter contexts take fewer chunks.
const SPLIT_MIN_KEYS: usize = 64;
/// Narrowest heads the split attention takes (see [`splits_keys`]).
const SPLIT_MIN_HD: usize = 32;
/// Most heads the split attention takes: one ticket each (`tickets`), counting the chunks of
/// a head done, so the last combines them.
pub const SPLIT_MAX_HEADS: usize = 1024;
/// Head dims the split kernel takes (SPLIT_MAX_HD in kernels/flash_attention.cu), and the
/// simple kernel too.
pub const MAX_HEAD_DIM: usize = 256;
/// Query rows from which a prefill over an f16 or Q8_0 cache runs on tensor cores (the flash
/// kernel), and the head dims it is built for (flash_attn_*_hd* in kernels/flash_attention.cu).
/// Prompts over an f32 cache keep f32 arithmetic (the simple kernel): that cache type is chosen
/// for its precision.
pub const FLASH_MIN_ROWS: usize = 16;
/// Compute capability (major · 10 + minor) the flash kernel needs: its m16n8k16 products and
/// cp.async copies are Ampere's (built for an older device it compiles to a trap, which is
/// never launched). Older devices' prompts take the simple kernel.
const FLASH_CAPABILITY: u32 = 80;

pub const FLASH_HEAD_DIMS: [usize; 4] = [64, 80, 96, 128];
/// Query rows per flash block (FA_ROWS) and threads per block of both new kernels; keys per
/// flash tile (FA_KEYS).
pub const FLASH_ROWS: usize = 64;

pub const FLASH_KEYS: usize = 64;
/// A prompt's flash attention splits its keys at most this many ways ([`flash_splits`]), and
/// only while its partials fit in FLASH_SPLIT_BYTES (those of 2048 rows of 7B heads, 32 of
/// 128: 32.5 MiB; so a budget pays tens of MiB for them, not a prompt's worth, and models
/// with fewer heads split more rows) and each split takes at least FLASH_SPLIT_MIN_KEYS keys
/// (so the partials' writes and the merge stay small beside the split's products).
pub const FLASH_MAX_SPLITS: usize = 4;
pub const FLASH_SPLIT_BYTES: usize = 2048 * 32 * (128 + 2) * 4;
const FLASH_SPLIT_MIN_KEYS: usize = 1024;
/// A split count is taken once its blocks fill the device's waves within this fraction of the
/// best count's (more splits cost more partials for little).
const FLASH_SPLIT_FILL: f64 = 0.85;

/// Whether attention with `n_heads` heads of `head_dim` splits the keys of few query rows across
/// blocks: a lane of the split kernel reads 8 of a key's dims at once and a key's lanes sum
/// within a warp, so heads narrower than 32, wider than it is built for or not in whole 8-dim
/// vectors stay with the simple kernel (a thread per key), as do more heads than it has
/// tickets for.
pub fn splits_keys(n_heads: usize, head_dim: usize) -> bool {
    (SPLIT_MIN_HD..=MAX_HEAD_DIM).contains(&head_dim)
        && head_dim.is_multiple_of(8)
        && n_heads <= SPLIT_MAX_HEADS
}

/// Which attention kernel a step takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionKernel {
    /// Few rows: the keys in chunks across blocks, combined by each head's last block.
    Split,
    /// Prompts over an f16 or Q8_0 cache on tensor cores.
    Flash,
    /// A block per (row, head), a thread per key: what is left.
    Simple,
}

/// The kernel attention of `rows` query rows over a `kv` cache takes, with `n_heads` heads of
/// `head_dim`, on a device of compute capability `capability` (major · 10 + minor).
pub fn attention_kernel(
    rows: usize,
    kv: KvType,
    n_heads: usize,
    head_dim: usize,
    capability: u32,
) -> AttentionKernel {
    if rows <= SPLIT_ROWS && splits_keys(n_heads, head_dim) {
        AttentionKernel::Split
    } else if flash_takes(rows, kv, head_dim) && flash_attention_runs(capability) {
        AttentionKernel::Flash
    } else {
        AttentionKernel::Simple
    }
}

/// Whether prompts over an f16 or Q8_0 cache take the flash kernel on a device of compute
/// capability `capability` (major · 10 + minor).
pub fn flash_attention_runs(capability: u32) -> bool {
    capability >= FLASH_CAPABILITY
}

/// `(splits, chunk)` a prompt's flash attention of `rows` query rows (`n_heads` heads of
/// `head_dim`) over `keys` positions takes on a device that holds `slots` of its blocks at
/// once (multiprocessors × blocks each): its keys in `splits` chunks of `chunk` (a multiple
/// of the key tile, every chunk holding a key), merged after. One split (`chunk` = `keys`) unless a block per 64 rows
/// and head leaves much of the last wave of blocks idle (a few rows over a long context: a
/// prompt in row groups under a budget, whose 512 rows of a 7B model are 256 blocks where an
/// H100 PCIe holds 342) and more splits fill it (4: 1024 blocks, three waves).
pub fn flash_splits(
    rows: usize,
    n_heads: usize,
    head_dim: usize,
    keys: usize,
    slots: usize,
) -> (usize, usize) {
    let tiles = keys.div_ceil(FLASH_KEYS);
    let most =
        flash_most_splits(rows, n_heads, head_dim).min(tiles / (FLASH_SPLIT_MIN_KEYS / FLASH_KEYS));
    if most < 2 || slots == 0 {
        return flash_chunks(keys, 1);
    }
    let blocks = rows.div_ceil(FLASH_ROWS) * n_heads;
    // The share of the waves' slots that `splits` ways fill.
    let fill = |splits: usize| {
        let b = blocks * splits;
        b as f64 / (slots * b.div_ceil(slots)) as f64
    };
    let best = (1..=most).map(fill).fold(0.0, f64::max);
    let splits = (1..=most)
        .find(|&s| fill(s) >= FLASH_SPLIT_FILL * best)
        .unwrap_or(1);
    flash_chunks(keys, splits)
}

/// [`flash_splits`]' `(splits, chunk)` with `splits` asked for, as far as the workspace holds
/// it (`flash_most_splits`).
pub fn forced_flash_splits(
    rows: usize,
    n_heads: usize,
    head_dim: usize,
    keys: usize,
    splits: usize,
) -> (usize, usize) {
    flash_chunks(keys, splits.min(flash_most_splits(rows, n_heads, head_dim)))
}

/// The most ways a prompt's flash attention of `rows` rows (`n_heads` heads of `head_dim`)
/// splits its keys: what the workspace holds partials for (at most FLASH_MAX_SPLITS, their
/// bytes at most FLASH_SPLIT_BYTES).
fn flash_most_splits(rows: usize, n_heads: usize, head_dim: usize) -> usize {
    FLASH_MAX_SPLITS
        .min(flash_split_rows(n_heads, head_dim) / rows.max(1))
        .max(1)
}

/// Bytes of a split's partials for one row: each head's max, sum and `head_dim` outputs, f32.
pub fn flash_partial_bytes(n_heads: usize, head_dim: usize) -> usize {
    n_heads * (head_dim + 2) * 4
}

/// Rows × splits whose partials FLASH_SPLIT_BYTES holds.
pub fn flash_split_rows(n_heads: usize, head_dim: usize) -> usize {
    FLASH_SPLIT_BYTES / flash_partial_bytes(n_heads, head_dim).max(1)
}

/// `keys` positions in about `splits` chunks of whole key tiles: `(chunks, keys per chunk)`,
/// every chunk holding a key; one chunk of every key where `splits` is 1.
fn flash_chunks(keys: usize, splits: usize) -> (usize, usize) {
    let tiles = keys.div_ceil(FLASH_KEYS).max(1);
    if splits.clamp(1, tiles) == 1 {
        return (1, keys.max(1));
    }
    let chunk = tiles.div_ceil(splits.min(tiles)) * FLASH_KEYS;
    (keys.div_ceil(chunk), chunk)
}

/// Whether a prompt of `rows` rows over a `kv` cache with heads of `head_dim` takes the flash
/// kernel on some device (from compute capability 8.0): what its workspace is sized for,
/// whatever the device.
pub fn flash_takes(rows: usize, kv: KvType, head_dim: usize) -> bool {
    rows >= FLASH_MIN_ROWS
        && matches!(kv, KvType::F16 | KvType::Q8_0)
        && FLASH_HEAD_DIMS.contains(&head_dim)
}

/// Blocks a split attention's grid gives each multiprocessor at least (where keys and the
/// workspace allow): two, so one finishing early leaves its multiprocessor another to run.
const SPLIT_MIN_BLOCKS_PER_SM: usize = 2;

/// The most key chunks a split attention of `rows` query rows with `n_heads` heads takes on a
/// device of `multiprocessors`, each holding `per_sm` of its blocks at once (the kernel's
/// occupancy; 0 multiprocessors: unknown): as many as fill those slots once with a block per
/// head and chunk (no more, so a long context's blocks all run at once, each reading its chunk
/// at the memory's pace, and no last, nearly empty wave is left), but at least
/// SPLIT_MIN_BLOCKS_PER_SM a multiprocessor; at most MAX_SPLITS / rows (the workspace), and all
/// of that where the device is unknown. An H100 SXM (132 multiprocessors, 5 blocks each of the one-row f16 kernel
/// at 95 registers) and a 7B model's 32 heads: 20 chunks, 640 blocks (4.8 a multiprocessor) at
/// 4000 positions.
pub fn split_most_chunks(
    rows: usize,
    n_heads: usize,
    multiprocessors: usize,
    per_sm: usize,
) -> usize {
    let cap = (MAX_SPLITS / rows.max(1)).max(1);
    if multiprocessors == 0 {
        return cap;
    }
    let heads = n_heads.max(1);
    let fill = multiprocessors * per_sm / heads;
    let least = (multiprocessors * SPLIT_MIN_BLOCKS_PER_SM).div_ceil(heads);
    fill.max(least).clamp(1, cap)
}

/// `(chunks, keys per chunk)` a split attention of `rows` (1..=SPLIT_ROWS) over `keys` (> 0)
/// positions takes with at most `most` chunks ([`split_most_chunks`]): chunks of at least
/// SPLIT_MIN_KEYS, rows × chunks at most MAX_SPLITS (the workspace), each chunk holding at least
/// one key (the kernels assume it). split_plan in kernels/flash_attention.cu, step for step (a
/// recorded step plans there, from the position it reads).
pub fn split_chunks(keys: usize, rows: usize, most: usize) -> (usize, usize) {
    let most = most.clamp(1, (MAX_SPLITS / rows.max(1)).max(1));
    let chunks = keys.div_ceil(SPLIT_MIN_KEYS).clamp(1, most);
    let chunk = keys.div_ceil(chunks).max(1);
    (keys.div_ceil(chunk), chunk)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A decode step's split attention fills the device once at a long context: at 4000
    /// positions a 7B model's 32 heads take at least two blocks a multiprocessor on an H100
    /// (132 multiprocessors) whatever the kernel's occupancy, and no more than it holds at once
    /// where that is more; the chunks never exceed the workspace (rows × chunks ≤ MAX_SPLITS)
    /// and always cover the keys; short contexts keep chunks of SPLIT_MIN_KEYS; an unknown
    /// device takes the workspace's most.
    #[test]
    fn split_attention_fills_the_device_at_long_contexts() {
        let sms = 132;
        for per_sm in 0..=16 {
            let most = split_most_chunks(1, 32, sms, per_sm);
            let (chunks, chunk) = split_chunks(4000, 1, most);
            let blocks = 32 * chunks;
            let slots = sms * per_sm.max(2);
            assert!(
                blocks >= 2 * sms,
                "{per_sm} a multiprocessor: {blocks} blocks"
            );
            assert!(
                blocks < slots + 32,
                "{per_sm}: {blocks} blocks, {slots} slots"
            );
            assert!(chunks * chunk >= 4000 && (chunks - 1) * chunk < 4000);
            if per_sm > 2 {
                assert!(blocks <= slots, "{per_sm}: {blocks} blocks, {slots} slots");
            }
        }
        // The one-row f16 kernel's 5 blocks a multiprocessor (95 registers): one wave.
        assert_eq!(split_most_chunks(1, 32, sms, 5), 20);
        assert_eq!(split_chunks(4000, 1, 20), (20, 200));
        // SmolLM2's 9 heads take the workspace's most; four rows share it.
        assert_eq!(split_most_chunks(1, 9, sms, 5), MAX_SPLITS);
        assert_eq!(split_most_chunks(4, 9, sms, 5), MAX_SPLITS / 4);
        assert_eq!(split_most_chunks(1, 32, 0, 5), MAX_SPLITS);
        // More heads than slots: one chunk a head.
        assert_eq!(split_most_chunks(1, 64, 20, 1), 1);
        // Short contexts: chunks of at least SPLIT_MIN_KEYS keys.
        assert_eq!(split_chunks(128, 1, 20), (2, 64));
        assert_eq!(split_chunks(1, 1, 20), (1, 1));
        for rows in 1..=SPLIT_ROWS {
            for most in [0, 1, 3, 20, MAX_SPLITS, 100] {
                for keys in (1..5000).step_by(7) {
                    let (chunks, chunk) = split_chunks(keys, rows, most);
                    assert!(
                        rows * chunks <= MAX_SPLITS && chunks <= most.max(1),
                        "{rows} {most} {keys}"
                    );
                    assert!(
                        chunks * chunk >= keys && (chunks - 1) * chunk < keys,
                        "{rows} {most} {keys}"
                    );
                }
            }
        }
    }
    use crate::footprint::WorkspaceOp;
    use crate::footprint::attention::{
        FLASH_KEYS, FLASH_MAX_SPLITS, flash_splits, forced_flash_splits,
    };
    use crate::footprint::workspace::workspace_bytes;

    /// A prompt's flash attention splits its keys where its blocks leave the device's last wave
    /// mostly idle, into chunks of whole key tiles the workspace holds partials for; the
    /// workspace never shrinks as steps grow.
    #[test]
    fn prompts_split_their_keys_where_blocks_leave_the_device_idle() {
        // H100 PCIe: 114 multiprocessors, 3 blocks of the hd-128 kernel each.
        let slots = 114 * 3;
        // A 7B row group of 512 over 32k positions: 256 blocks fill 75% of a wave; 4 splits
        // fill three waves.
        assert_eq!(flash_splits(512, 32, 128, 32768, slots), (4, 8192));
        // 1024 rows: 512 blocks are 1.5 waves; 2 splits make three.
        assert_eq!(flash_splits(1024, 32, 128, 32768, slots).0, 2);
        // A whole 4000-token prompt (2016 blocks, 5.9 waves), short contexts, unknown slots.
        assert_eq!(flash_splits(4000, 32, 128, 4000, slots), (1, 4000));
        assert_eq!(flash_splits(512, 32, 128, 1500, slots), (1, 1500));
        assert_eq!(flash_splits(512, 32, 128, 32768, 0), (1, 32768));
        // H100 SXM (132 × 3): 3 splits fill 97% where 4 fill 86%.
        assert_eq!(flash_splits(512, 32, 128, 32768, 132 * 3).0, 3);
        // SmolLM2's 9 heads of 64 (the hd-64 kernel holds 4 blocks an SM): a whole 4000-token
        // prompt is 567 blocks, 1.24 waves (62%); its smaller partials let it split up to 3
        // ways (93%), and 2 (83%) is within reach of that.
        assert_eq!(flash_splits(4000, 9, 64, 4000, 114 * 4).0, 2);
        assert_eq!(forced_flash_splits(4000, 9, 64, 4000, 4).0, 3);
        assert_eq!(forced_flash_splits(4000, 32, 128, 4000, 4).0, 1);
        for (rows, heads, hd) in [(16, 9, 64), (100, 32, 128), (512, 32, 128), (1500, 8, 80)] {
            let op = |tokens| WorkspaceOp::Attention {
                tokens,
                n_heads: heads,
                head_dim: hd,
                kv: KvType::Q8_0,
            };
            let held = workspace_bytes(&op(rows));
            assert!(held >= workspace_bytes(&op(rows - 1)), "{rows}");
            for keys in [rows, 1024, 1025, 3000, 4096, 40_000] {
                for slots in [1, 46, 342, 1000] {
                    for (splits, chunk) in [
                        flash_splits(rows, heads, hd, keys, slots),
                        forced_flash_splits(rows, heads, hd, keys, slots % 7),
                    ] {
                        let case = format!("{rows} rows, {keys} keys, {slots} slots");
                        assert!((1..=FLASH_MAX_SPLITS).contains(&splits), "{case}");
                        assert!(
                            splits * chunk >= keys && (splits - 1) * chunk < keys,
                            "{case}: {splits} × {chunk}"
                        );
                        if splits > 1 {
                            assert!(chunk.is_multiple_of(FLASH_KEYS), "{case}");
                            let need = (splits * rows * heads * (hd + 2) * 4) as u64;
                            assert!(need <= held, "{case}: {need} > {held}");
                        }
                    }
                }
            }
        }
        // Decode rows and f32 caches hold no prompt partials.
        let decode = |tokens, kv| {
            workspace_bytes(&WorkspaceOp::Attention {
                tokens,
                n_heads: 32,
                head_dim: 128,
                kv,
            })
        };
        assert_eq!(decode(4, KvType::F16), decode(1, KvType::F16));
        assert!(decode(16, KvType::F16) > decode(16, KvType::F32));
    }
}
