//! A slot: one device session of the engine thread and who holds it (free, a stateless
//! prefix kept for reuse, or a context), with the order idle slots give their sessions up in.

use crate::backend::Backend;
use crate::engine::Session;

/// Who holds a slot's session.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Holder {
    Free,
    /// A finished stateless request's tokens, kept for prefix reuse.
    Anon(Vec<u32>),
    /// A context. Its chunks are written ahead of time, when the engine falls idle after a
    /// call ([`Slot::unwritten`] until then): taking the slot away then costs nothing.
    Context(String),
}

/// One device session of the engine thread, and who holds it.
pub(super) struct Slot<B: Backend> {
    pub(super) session: Session<B>,
    pub(super) holder: Holder,
    pub(super) busy: bool,
    pub(super) last_use: u64,
    /// The held context changed since its chunks were last written: they are written when the
    /// engine falls idle, or before the slot goes to another holder, whichever comes first.
    pub(super) unwritten: bool,
}

/// Which idle slot gives up its session first (a new request, pool pressure): free ones, then
/// stateless prefixes, then contexts (whose chunks are all written: LCTRU's least recently used
/// context), least recently used first within each.
pub(super) fn eviction_rank(h: &Holder, last_use: u64) -> (u8, u64) {
    let rank = match h {
        Holder::Free => 0,
        Holder::Anon(_) => 1,
        Holder::Context(_) => 2,
    };
    (rank, last_use)
}

/// Tokens `a` and `b` share from the start.
pub(super) fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_slots_give_up_free_then_prefixes_then_contexts_least_recent_first() {
        let mut slots = [
            (Holder::Context("a".into()), 1),
            (Holder::Anon(vec![1]), 5),
            (Holder::Free, 9),
            (Holder::Anon(vec![2]), 2),
            (Holder::Context("b".into()), 0),
            (Holder::Free, 3),
        ];
        slots.sort_by_key(|(h, last_use)| eviction_rank(h, *last_use));
        let order: Vec<(&Holder, u64)> = slots.iter().map(|(h, t)| (h, *t)).collect();
        assert_eq!(
            order,
            [
                (&Holder::Free, 3),
                (&Holder::Free, 9),
                (&Holder::Anon(vec![2]), 2),
                (&Holder::Anon(vec![1]), 5),
                (&Holder::Context("b".into()), 0),
                (&Holder::Context("a".into()), 1),
            ]
        );
    }

    #[test]
    fn common_prefix_stops_at_the_first_difference() {
        assert_eq!(common_prefix(&[1, 2, 3], &[1, 2, 4, 5]), 2);
        assert_eq!(common_prefix(&[1, 2], &[1, 2, 3]), 2);
        assert_eq!(common_prefix(&[], &[1]), 0);
        assert_eq!(common_prefix(&[7, 1], &[1, 7]), 0);
    }
}
