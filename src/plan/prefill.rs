//! HyperGen's step-aware partitioning: how the budget's longest call runs (in one step, or in
//! row groups layer by layer), and where a partitioned call's hidden states and the KV cache
//! live, chosen before any layer is placed so the layers get what the step leaves.
//!
//! Algorithm: four placements in order (everything on the device; hidden states in host
//! memory; the KV cache there; both), each with the largest step that fits beside the least
//! the model runs with, found by bisection (a step's bytes grow with its rows): `O(log rows)`
//! step-memory evaluations each. First a larger step than the budget's is tried where every
//! layer stays resident beside it. Where nothing fits, the least layout is returned and the
//! caller reports the shortfall.

use crate::footprint::{
    GOOD_GROUP, MAX_GROUP, PrefillLayout, StepMemory, device_bytes, kv_bytes, kv_pool_bytes,
    kv_table_bytes, probe_bytes, step_memory,
};
use crate::store::Manifest;

use super::budget::{Budget, PlanError};
use super::manifest::offload_matmuls;

/// The device memory of one step of `group` tokens on the CUDA backend (which the budgeted device
/// reserves the same way).
pub fn step_device_memory(
    m: &Manifest,
    budget: &Budget,
    group: usize,
) -> Result<StepMemory, PlanError> {
    Ok(step_memory(
        &m.spec,
        group,
        budget.logit_rows.min(group),
        budget.sessions > 1,
        budget.kv_type,
        &offload_matmuls(m)?,
        crate::footprint::workspace_bytes,
    ))
}

/// What [`prefill_layout`] chose: the layout, and the device bytes it takes beside the layers.
#[derive(Clone, Copy, Debug)]
pub(super) struct PrefillChoice {
    pub(super) layout: PrefillLayout,
    /// The KV caches (or pool) of every session, with their probes.
    pub(super) kv: u64,
    /// One step's activations, logits and workspace.
    pub(super) step: StepMemory,
    /// A partitioned call's hidden states where they stay on the device (else 0).
    pub(super) residual: u64,
}

/// One layout tried: whether it leaves room for the least the model runs with, whether for
/// every layer resident as well, and its bytes.
struct Candidate {
    fits: bool,
    beside_all_layers: bool,
    choice: PrefillChoice,
}

/// HyperGen's step-aware partitioning, for the budget's longest call (`budget.prompt`): the
/// step (row group) the device holds, and where a partitioned call's hidden states and the KV
/// cache live, as the first of these that leaves room for the least the model runs with
/// (`weights_min`: one streaming slot; or every layer resident, `all_layers`) beside
/// `fixed` (small fragments, output matrix):
/// 0. everything on the device, every layer resident beside a step larger than the budget's
///    (up to `max_step` and [`MAX_GROUP`] rows): the largest such step;
/// 1. everything on the device, the step as large as the budget asks;
/// 2. hidden states in host memory;
/// 3. the KV cache in host memory, hidden states on the device;
/// 4. both in host memory;
///
/// each with the largest step that fits, taken as soon as it is the call itself or at least
/// [`GOOD_GROUP`] rows (else the largest step of the four). Also the KV cache's, the step's and
/// the hidden states' device bytes.
pub(super) fn prefill_layout(
    m: &Manifest,
    budget: &Budget,
    fixed: u64,
    usable: u64,
    all_layers: u64,
    weights_min: u64,
) -> Result<PrefillChoice, PlanError> {
    let spec = &m.spec;
    let prompt = budget.prompt.max(1);
    let probe = if budget.probe { probe_bytes(spec) } else { 0 };
    let sessions = budget.sessions as u64;
    let kv_on_device = kv_bytes(spec, budget.ctx, budget.kv_type);
    // One layer's K and V, the context's length, on the device at a time.
    let kv_work = 2 * device_bytes((budget.ctx * budget.kv_type.row_bytes(spec.kv_dim())) as u64);
    let residual = device_bytes((prompt * spec.d_model * 4) as u64);
    let matmuls = offload_matmuls(m)?;
    // Several sequences (serve): prompts join their batched steps.
    let joins = budget.sessions > 1;
    let layout = |kv_host: bool, residual_on_device: bool, group: usize| {
        let step = step_memory(
            spec,
            group,
            budget.logit_rows.min(group),
            joins,
            budget.kv_type,
            &matmuls,
            crate::footprint::workspace_bytes,
        );
        // A pool lives on the device: with KV in host memory, each session keeps its own.
        let kv = match budget.kv_pool.filter(|_| !kv_host) {
            // The pool, and each session's block table and probe.
            Some(blocks) => {
                kv_pool_bytes(spec, blocks, budget.kv_type)
                    + sessions * (kv_table_bytes(budget.ctx) + probe)
            }
            None => sessions * (if kv_host { kv_work } else { kv_on_device } + probe),
        };
        let partitioned = prompt > group;
        let res = if partitioned && residual_on_device {
            residual
        } else {
            0
        };
        // Cache units beside streamed attention keep their reserve free, and one step's
        // buffers beside it ([`super::stream`]).
        let kept = budget
            .unit_reserve
            .map_or(0, |r| r + step.activations + step.logits + res);
        let held = fixed + kv + step.total() + res + kept;
        let fits = held + all_layers <= usable || held + weights_min <= usable;
        let beside_all_layers = held + all_layers <= usable;
        let l = PrefillLayout {
            group,
            residual_rows: if partitioned && residual_on_device {
                prompt
            } else {
                0
            },
            kv_host,
            // Decided by the link rates (make_plan).
            cpu_attention: false,
            joins,
        };
        Candidate {
            fits,
            beside_all_layers,
            choice: PrefillChoice {
                layout: l,
                kv,
                step,
                residual: res,
            },
        }
    };
    let whole = budget.batch.min(prompt).max(1);
    // Every layer on the device with room for larger steps as well (a whole-GPU run): a call
    // longer than the budget's step runs in steps of up to MAX_GROUP rows, the largest that
    // still leaves every layer resident. Larger GEMMs fill the tensor cores better (a 512-row
    // product of a 4096-wide weight is ~1 wave of 128×128 tiles on an H100's 114 SMs) and a
    // call takes fewer launches; nothing the model runs with gives way for it.
    let grown = prompt.min(budget.max_step.min(MAX_GROUP));
    if !budget.cpu_split
        && budget.hot_reserve.is_none()
        && budget.unit_reserve.is_none()
        && let Some(g) = largest_step(whole + 1, grown, |g| {
            layout(false, true, g).beside_all_layers
        })
    {
        return Ok(layout(false, true, g).choice);
    }
    let mut best: Option<PrefillChoice> = None;
    for (kv_host, residual_on_device) in
        [(false, true), (false, false), (true, true), (true, false)]
    {
        // The budget's step, the call in one step, else the largest partition that fits (the
        // bytes grow with the group: bisect).
        let mut found = [budget.batch.max(1), whole]
            .into_iter()
            .map(|g| layout(kv_host, residual_on_device, g))
            .find(|c| c.fits)
            .map(|c| c.choice);
        if found.is_none() && whole > 1 {
            found = largest_step(1, whole - 1, |g| {
                layout(kv_host, residual_on_device, g).fits
            })
            .map(|g| layout(kv_host, residual_on_device, g).choice);
        }
        let Some(c) = found else { continue };
        if c.layout.group >= whole.min(GOOD_GROUP) {
            return Ok(c);
        }
        if best
            .as_ref()
            .is_none_or(|b| c.layout.group > b.layout.group)
        {
            best = Some(c);
        }
    }
    // Nothing fits: the least the model runs with, whose shortfall the caller reports.
    Ok(best.unwrap_or_else(|| layout(true, false, 1).choice))
}

/// The largest step of `lo..=hi` rows that `fits` (the bytes grow with the step: bisect), or
/// none where even `lo` does not.
fn largest_step(lo: usize, hi: usize, fits: impl Fn(usize) -> bool) -> Option<usize> {
    if lo > hi || !fits(lo) {
        return None;
    }
    let (mut lo, mut hi) = (lo, hi);
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    Some(lo)
}

#[cfg(test)]
mod tests {
    use super::largest_step;

    #[test]
    fn largest_step_is_the_last_that_fits() {
        assert_eq!(largest_step(1, 100, |g| g <= 37), Some(37));
        assert_eq!(largest_step(1, 100, |_| true), Some(100));
        assert_eq!(largest_step(1, 1, |_| true), Some(1));
        assert_eq!(largest_step(5, 100, |g| g <= 4), None);
        assert_eq!(largest_step(10, 9, |_| true), None);
    }
}
