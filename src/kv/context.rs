//! One persistent context: its index (conversation, chunk records), its chunks' copies in
//! DRAM, how far its chunks are written, and how its last restore went.

use std::sync::Arc;

use super::chunk::{Bits, CHUNK_TOKENS};
use super::persist::ContextIndex;
use crate::footprint::ledger::Reservation;

/// A chunk's copy in DRAM.
pub(super) struct DramChunk {
    pub(super) bytes: Arc<Vec<u8>>,
    pub(super) bits: Bits,
    pub(super) len: usize,
    pub(super) _reservation: Option<Reservation>,
}

/// How the last restore of a context went.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct RestoreStats {
    pub chunks_from_dram: usize,
    pub chunks_from_disk: usize,
    /// From the shared context store (`--context-store`).
    pub chunks_from_store: usize,
    /// Recomputed by choice (the cost model) or because no copy existed.
    pub chunks_recomputed: usize,
    /// Copies that failed their checksum (recomputed, never used).
    pub chunks_corrupt: usize,
    pub seconds: f64,
}

/// One persistent context.
pub struct Context {
    pub index: ContextIndex,
    pub(super) dram: Vec<Option<DramChunk>>,
    /// Tokens whose chunks are written and current.
    pub(super) clean: usize,
    pub last_use: u64,
    pub last_restore: Option<RestoreStats>,
    /// Chunks found unusable when the context was loaded at start-up.
    pub lost_at_load: usize,
}

impl Context {
    pub fn id(&self) -> &str {
        &self.index.id
    }

    /// Chunk widths of the written chunks.
    pub fn chunk_bits(&self) -> Vec<Option<Bits>> {
        (0..self.index.chunks.len())
            .map(|c| {
                self.dram
                    .get(c)
                    .and_then(|d| d.as_ref().map(|d| d.bits))
                    .or_else(|| self.index.chunks[c].as_ref().map(|r| r.bits))
            })
            .collect()
    }

    pub fn chunks_in_dram(&self) -> usize {
        self.dram.iter().flatten().count()
    }

    pub fn chunks_on_disk(&self) -> usize {
        self.index.chunks.iter().flatten().count()
    }

    /// Forget the evaluated tokens after `keep` (the conversation diverged there).
    pub fn truncate_evaluated(&mut self, keep: usize) {
        let keep = keep.min(self.index.evaluated);
        self.index.evaluated = keep;
        let chunks = keep.div_ceil(CHUNK_TOKENS);
        self.index.chunks.truncate(chunks);
        self.dram.truncate(chunks);
        // A partial last chunk is rewritten at the next swap-out.
        self.clean = self.clean.min(keep / CHUNK_TOKENS * CHUNK_TOKENS);
    }
}
