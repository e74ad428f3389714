//! Paged KV caches as every backend reads them: where a sequence's logical rows lie through its
//! block table ([`kv_runs`]), and the check of a table against the cache it maps into.

use super::{BackendError, KV_BLOCK, Result};

/// Where the logical rows `first..first + n` of a cache lie: runs of `(offset from first,
/// physical row, rows)`. Without a table (`None`) row r is row r; with one, row r is row
/// `blocks[r / KV_BLOCK] · KV_BLOCK + r % KV_BLOCK`, and a run goes on across blocks that
/// follow each other in the cache (as a fresh pool hands them out), so copies stay few.
pub fn kv_runs(
    blocks: Option<&[u32]>,
    first: usize,
    n: usize,
) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
    let mut done = 0;
    std::iter::from_fn(move || {
        if done >= n {
            return None;
        }
        let r = first + done;
        let run = match blocks {
            None => (done, r, n - done),
            Some(b) => {
                let mut block = r / KV_BLOCK;
                let mut len = (KV_BLOCK - r % KV_BLOCK).min(n - done);
                while done + len < n
                    && block + 1 < b.len()
                    && b[block + 1] as usize == b[block] as usize + 1
                {
                    block += 1;
                    len = (len + KV_BLOCK).min(n - done);
                }
                (
                    done,
                    b[r / KV_BLOCK] as usize * KV_BLOCK + r % KV_BLOCK,
                    len,
                )
            }
        };
        done += run.2;
        Some(run)
    })
}

/// Checks a block table against the cache it maps into: it covers `rows` logical rows and
/// every block lies inside the cache's `cache_rows`.
pub fn check_kv_table(
    op: &'static str,
    blocks: &[u32],
    rows: usize,
    cache_rows: usize,
) -> Result<()> {
    let cache_blocks = cache_rows / KV_BLOCK;
    if blocks.len() * KV_BLOCK < rows {
        return Err(BackendError::Shape {
            op,
            msg: format!(
                "a block table of {} blocks for {rows} positions",
                blocks.len()
            ),
        });
    }
    if let Some(&b) = blocks.iter().find(|&&b| b as usize >= cache_blocks) {
        return Err(BackendError::Shape {
            op,
            msg: format!("block {b} of a cache of {cache_blocks} blocks"),
        });
    }
    Ok(())
}

#[cfg(test)]
mod kv_runs_tests {
    use super::{KV_BLOCK, kv_runs};

    #[test]
    fn runs_follow_the_table_and_join_adjacent_blocks() {
        let b = KV_BLOCK;
        let none: Vec<_> = kv_runs(None, 5, 40).collect();
        assert_eq!(none, vec![(0, 5, 40)]);
        // Blocks 7, 8 adjacent, then 2, then 3: rows 5..53 of the sequence.
        let table = [7u32, 8, 2, 3];
        let got: Vec<_> = kv_runs(Some(&table), 5, 48).collect();
        assert_eq!(got, vec![(0, 7 * b + 5, 2 * b - 5), (2 * b - 5, 2 * b, 21)]);
        // Not adjacent: one run per block.
        let apart = [4u32, 1];
        let got: Vec<_> = kv_runs(Some(&apart), 0, b + 3).collect();
        assert_eq!(got, vec![(0, 4 * b, b), (b, b, 3)]);
    }
}
