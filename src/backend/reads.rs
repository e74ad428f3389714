//! What the device's kernels read of the weights and KV caches in its own memory, one formula
//! per kind of op for every backend: the budgeted device and CUDA count these in the ledger
//! ([`Ledger::count_device_read`](crate::footprint::Ledger::count_device_read)), so each phase
//! of a traced step has the device bytes its bound is taken from. Activations, norms and biases
//! are left out (a layer's are kilobytes beside its megabytes of weights).

/// A product with a weight of `rows` rows of `row_bytes`: every row read once, whatever the
/// number of tokens.
pub fn product(rows: usize, row_bytes: usize) -> u64 {
    (rows * row_bytes) as u64
}

/// Attention over a cache whose key (and value) rows are `row_bytes`, of a step whose last row
/// attends `positions` positions: each of those key and value rows read once.
pub fn attention(positions: usize, row_bytes: usize) -> u64 {
    2 * (positions * row_bytes) as u64
}

/// An embedding: `tokens` rows looked up in a table of `row_bytes` a row.
pub fn embedding(tokens: usize, row_bytes: usize) -> u64 {
    (tokens * row_bytes) as u64
}

/// A mixture-of-experts FFN of experts `width` neurons wide over `routes`: each distinct expert
/// they name has its rows of every stack read once (`stacks`: each stack's rows and row bytes,
/// the first the gate or up stack of `experts · width` rows, then the others).
pub fn experts(routes: &[super::Route], width: usize, stacks: &[(usize, usize)]) -> u64 {
    let mut routed: Vec<u32> = routes.iter().map(|r| r.expert).collect();
    routed.sort_unstable();
    routed.dedup();
    let n_experts = stacks.first().map_or(0, |&(rows, _)| rows / width.max(1));
    let all: usize = stacks.iter().map(|&(rows, rb)| rows * rb).sum();
    (all / n_experts.max(1) * routed.len()) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_formula_counts_what_its_kernels_read() {
        assert_eq!(product(576, 360), 207_360);
        // 96 positions of 3 KV heads of 64 f16 values: keys and values.
        assert_eq!(attention(96, 384), 73_728);
        assert_eq!(embedding(2, 612), 1224);
        // 2 of 8 experts of 16 neurons: gate and up 128 rows of 40 bytes, down 8·32 rows of 20.
        let route = |token, expert| crate::backend::Route {
            token,
            expert,
            weight: 0.5,
        };
        let routes = [route(0, 3), route(0, 5), route(1, 3)];
        assert_eq!(
            experts(&routes, 16, &[(128, 40), (128, 40), (256, 20)]),
            2 * 1920
        );
    }
}
