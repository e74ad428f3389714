//! Where a mixture-of-experts model's experts live on the host: every expert's stacks in DRAM
//! where host memory holds them, else the SSD tier — per layer a DRAM cache of whole-expert
//! slots (the CPU computes a step's missed experts from it; an expert it lacks is read from the
//! store first, one read of each of its matrices, checksummed) and the store on the SSD behind
//! it. Slots are shared out evenly over the layers, every layer at least the experts one token
//! uses; the rest of host memory holds the tables, the start-up staging, the guess routers and
//! one expert's read buffer. ([`crate::tier::experts`] allocates exactly these bytes.)

use serde::Serialize;

use super::budget::{PlanError, human_bytes};
use super::expert_shape::ExpertShape;

/// Host bytes of `n` bytes of one allocation, as the ledger reserves them (pages).
pub fn host_bytes(n: u64) -> u64 {
    n.next_multiple_of(4096)
}

/// The experts' place on the host.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct HostExperts {
    /// Per layer, the DRAM cache's routed slots; `None`: every expert's stacks in DRAM.
    pub dram_slots: Option<Vec<usize>>,
    /// Host bytes of the experts: every stack, or the caches and the read buffer.
    pub bytes: u64,
    /// With the SSD tier: one expert matrix's largest read (whole checksum groups).
    pub read_buffer: u64,
}

impl ExpertShape {
    /// Host bytes of a DRAM cache of `slots` routed experts: one allocation per matrix.
    pub fn cache_host_bytes(&self, slots: usize) -> u64 {
        let n = slots as u64;
        host_bytes(n * self.gate) + host_bytes(n * self.up) + host_bytes(n * self.down)
    }

    /// Host bytes of every expert's stacks (routed and shared), one allocation per matrix.
    pub fn stacks_host_bytes(&self, experts: usize) -> u64 {
        let all = (experts + self.shared) as u64;
        [self.gate, self.up, self.down]
            .map(|b| host_bytes(all * b))
            .iter()
            .sum()
    }
}

/// The experts' host plan in `dram` bytes of host memory (`None`: unlimited) beside `other`
/// bytes (tables, staging, guess routers): every stack where they fit, else per layer a DRAM
/// cache of the same number of slots (the rest one more in the layers whose experts take least)
/// of at least `used`, else [`PlanError::DramTooSmall`].
pub fn plan_host(
    shapes: &[ExpertShape],
    (experts, used): (usize, usize),
    dram: Option<u64>,
    (other, other_what): (u64, &str),
) -> Result<HostExperts, PlanError> {
    let stacks: u64 = shapes.iter().map(|s| s.stacks_host_bytes(experts)).sum();
    let Some(dram) = dram.filter(|&d| d < stacks + other) else {
        return Ok(HostExperts {
            dram_slots: None,
            bytes: stacks,
            read_buffer: 0,
        });
    };
    let read_buffer = host_bytes(shapes.iter().map(|s| s.read_extent).max().unwrap_or(0));
    let cost = |slots: &[usize]| -> u64 {
        shapes
            .iter()
            .zip(slots)
            .map(|(s, &k)| s.cache_host_bytes(k))
            .sum::<u64>()
            + read_buffer
    };
    let n = shapes.len();
    let least = cost(&vec![used.min(experts); n]);
    let room = dram.saturating_sub(other);
    if room < least {
        return Err(PlanError::DramTooSmall {
            budget: dram,
            minimum: other + least,
            breakdown: format!(
                "the SSD tier keeps at least the {used} experts a token uses of every layer in host memory with one expert's read buffer ({}), beside {other_what} ({}); every expert's stacks would take {}",
                human_bytes(least),
                human_bytes(other),
                human_bytes(stacks)
            ),
        });
    }
    let even = (used..=experts)
        .rev()
        .find(|&k| cost(&vec![k; n]) <= room)
        .unwrap_or(used);
    let mut slots = vec![even; n];
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|&l| (shapes[l].bytes(), l));
    for l in order {
        if slots[l] < experts {
            slots[l] += 1;
            if cost(&slots) > room {
                slots[l] -= 1;
            }
        }
    }
    Ok(HostExperts {
        bytes: cost(&slots),
        dram_slots: Some(slots),
        read_buffer,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(bytes: u64) -> ExpertShape {
        ExpertShape {
            gate: bytes,
            up: bytes,
            down: bytes,
            shared: 0,
            router: 0,
            read_extent: bytes + 8192,
            dims: [(1, 1); 3],
        }
    }

    #[test]
    fn host_memory_below_the_stacks_gives_each_layer_a_cache_of_at_least_a_tokens_experts() {
        let shapes = [shape(4096), shape(8192)];
        let all = plan_host(&shapes, (8, 2), None, (0, "")).unwrap();
        assert_eq!(all.dram_slots, None);
        assert_eq!(all.bytes, 8 * 3 * (4096 + 8192));
        // Enough for every stack: no SSD tier.
        let enough = plan_host(&shapes, (8, 2), Some(all.bytes + 100), (100, "")).unwrap();
        assert_eq!(enough.dram_slots, None);
        // 4 slots a layer and the read buffer (16 KiB), then one more for the smaller layer.
        let room = 4 * 3 * (4096 + 8192) + 16384 + 3 * 4096;
        let p = plan_host(&shapes, (8, 2), Some(room + 100), (100, "")).unwrap();
        assert_eq!(p.dram_slots, Some(vec![5, 4]));
        assert_eq!(p.bytes, room);
        assert_eq!(p.read_buffer, 16384);
        // Below a token's experts a layer: refused, naming the SSD tier's least.
        let least = 2 * 3 * (4096 + 8192) + 16384;
        match plan_host(&shapes, (8, 2), Some(least + 99), (100, "the tables")) {
            Err(PlanError::DramTooSmall { minimum, .. }) => assert_eq!(minimum, least + 100),
            other => panic!("{other:?}"),
        }
        assert!(plan_host(&shapes, (8, 2), Some(least + 100), (100, "")).is_ok());
    }
}
