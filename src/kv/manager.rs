//! All contexts of one model: opening the store (every persisted context loaded, or refused
//! when it belongs to another model), creating, finding (only the owner's), deleting, and
//! saving a conversation. Swapping contexts out and in is in [`super::swap_out`] and
//! [`super::swap_in`].

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use super::chunk::CHUNK_TOKENS;
use super::context::{Context, DramChunk};
use super::persist::{self, ContextIndex};
use super::policy::{Compression, CostModel};
use super::shared::SharedStore;
use super::{KvError, Result};
use crate::footprint::ledger::Ledger;

/// Settings of the context store.
#[derive(Clone, Debug)]
pub struct KvConfig {
    pub compression: Compression,
    /// Bytes of compressed chunks kept in DRAM at most.
    pub dram_budget: u64,
    /// Where contexts persist (None: DRAM only, lost at exit).
    pub dir: Option<PathBuf>,
    /// Identity of the model the contexts belong to.
    pub model_id: String,
    pub costs: CostModel,
    /// The store replicas share (`--context-store`): the index and chunks of every context,
    /// this manager's tiers a cache in front of it.
    pub shared: Option<Arc<SharedStore>>,
}

impl KvConfig {
    /// Whether written chunks are kept anywhere but DRAM (a local disk, the shared store): only
    /// then do chunk records name something a restore can load.
    pub fn keeps_chunks(&self) -> bool {
        self.dir.is_some() || self.shared.is_some()
    }
}

/// Counters for /metrics.
#[derive(Clone, Copy, Debug, Default)]
pub struct KvCounters {
    pub swap_outs: u64,
    pub swap_ins: u64,
    pub chunks_written: u64,
    pub chunks_from_dram: u64,
    pub chunks_from_disk: u64,
    pub chunks_from_store: u64,
    pub chunks_recomputed: u64,
    pub chunks_corrupt: u64,
    pub dram_evictions: u64,
}

/// All contexts of one model.
pub struct KvManager {
    pub(super) cfg: KvConfig,
    pub(super) ledger: Option<Arc<Ledger>>,
    pub(super) contexts: HashMap<String, Context>,
    /// Contexts found on disk that belong to another model: id → model id.
    pub(super) foreign: HashMap<String, String>,
    pub(super) clock: u64,
    pub(super) dram_used: u64,
    pub counters: KvCounters,
}

/// Seconds since the Unix epoch (0 if the clock is before it).
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl KvManager {
    /// Open the store, loading every context persisted under the directory. Returns the
    /// manager and one line per context that could not be loaded.
    pub fn open(cfg: KvConfig, ledger: Option<Arc<Ledger>>) -> Result<(Self, Vec<String>)> {
        let mut m = KvManager {
            cfg,
            ledger,
            contexts: HashMap::new(),
            foreign: HashMap::new(),
            clock: 0,
            dram_used: 0,
            counters: KvCounters::default(),
        };
        let mut warnings = Vec::new();
        if let Some(dir) = m.cfg.dir.clone() {
            persist::prepare(&dir)?;
            for r in persist::load_all(&dir)? {
                match r {
                    Err(e) => warnings.push(format!("context not loaded: {e}")),
                    Ok(idx) if idx.model_id != m.cfg.model_id => {
                        warnings.push(format!(
                            "context {} belongs to model {}, not {}: refused",
                            idx.id, idx.model_id, m.cfg.model_id
                        ));
                        m.foreign.insert(idx.id, idx.model_id);
                    }
                    Ok(mut idx) => {
                        // The index is written before its chunks: chunks it names that are
                        // missing are recomputed later, never trusted.
                        idx.evaluated = idx.evaluated.min(idx.tokens.len());
                        idx.chunks.truncate(idx.evaluated.div_ceil(CHUNK_TOKENS));
                        let n = idx.evaluated.div_ceil(CHUNK_TOKENS);
                        let lost = (0..n)
                            .filter(|&i| {
                                let want = CHUNK_TOKENS.min(idx.evaluated - i * CHUNK_TOKENS);
                                idx.chunks.get(i).cloned().flatten().is_none_or(|r| {
                                    r.len != want || persist::read_chunk(&dir, &idx.id, &r).is_err()
                                })
                            })
                            .count();

                        m.clock += 1;
                        let (id, evaluated) = (idx.id.clone(), idx.evaluated);
                        m.contexts.insert(
                            id,
                            Context {
                                index: idx,
                                dram: (0..n).map(|_| None).collect(),
                                // What the index names is what is written.
                                clean: evaluated,
                                last_use: 0,
                                last_restore: None,
                                lost_at_load: lost,
                            },
                        );
                    }
                }
            }
        }
        Ok((m, warnings))
    }

    pub fn len(&self) -> usize {
        self.contexts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.contexts.is_empty()
    }

    pub fn dram_bytes(&self) -> u64 {
        self.dram_used
    }

    pub fn contexts(&self) -> impl Iterator<Item = &Context> {
        self.contexts.values()
    }

    /// A new empty context owned by `owner`.
    pub fn create(
        &mut self,
        owner: Option<String>,
        system_prompt: Option<String>,
    ) -> Result<String> {
        let id = format!("ctx-{:016x}", rand::random::<u64>());
        let mut index = ContextIndex::new(&self.cfg.model_id, &id, owner, unix_now());
        index.system_prompt = system_prompt;
        if let Some(dir) = &self.cfg.dir {
            persist::save_index(dir, &index)?;
        }
        self.clock += 1;
        self.contexts.insert(
            id.clone(),
            Context {
                index,
                dram: Vec::new(),
                clean: 0,
                last_use: self.clock,
                last_restore: None,
                lost_at_load: 0,
            },
        );
        Ok(id)
    }

    fn check(&self, id: &str, owner: Option<&str>) -> Result<()> {
        if let Some(model_id) = self.foreign.get(id) {
            return Err(KvError::OtherModel {
                id: id.into(),
                model_id: model_id.clone(),
            });
        }
        match self.contexts.get(id) {
            // Another key's context does not exist for this caller.
            Some(c) if c.index.owner.as_deref() == owner => Ok(()),
            _ => Err(KvError::NotFound(id.into())),
        }
    }

    pub fn get(&self, id: &str, owner: Option<&str>) -> Result<&Context> {
        self.check(id, owner)?;
        self.contexts
            .get(id)
            .ok_or_else(|| KvError::NotFound(id.into()))
    }

    pub fn get_mut(&mut self, id: &str, owner: Option<&str>) -> Result<&mut Context> {
        self.check(id, owner)?;
        self.clock += 1;
        let clock = self.clock;
        let c = self
            .contexts
            .get_mut(id)
            .ok_or_else(|| KvError::NotFound(id.into()))?;
        c.last_use = clock;
        Ok(c)
    }

    pub fn delete(&mut self, id: &str, owner: Option<&str>) -> Result<()> {
        self.check(id, owner)?;
        if let Some(dir) = &self.cfg.dir {
            persist::remove_context(dir, id)?;
        }
        self.remove_here(id);
        Ok(())
    }

    /// Whether this manager holds context `id` (whoever owns it).
    pub fn has(&self, id: &str) -> bool {
        self.contexts.contains_key(id)
    }

    /// Make the shared store's copy of a context this manager's (`remote`): kept as it is
    /// where the local copy is the same revision by the same writer, else replaced (DRAM copies
    /// of chunks it still names kept, the others dropped; chunks named by content come back
    /// from the local disk where it has them, else from the store). Returns whether the local
    /// copy was replaced: a session holding it holds a stale cache then. Another model's
    /// context is refused.
    pub fn adopt(&mut self, remote: ContextIndex) -> Result<bool> {
        if remote.model_id != self.cfg.model_id {
            return Err(KvError::OtherModel {
                id: remote.id,
                model_id: remote.model_id,
            });
        }
        if let Some(c) = self.contexts.get(&remote.id)
            && c.index.stamp() == remote.stamp()
        {
            return Ok(false);
        }
        let id = remote.id.clone();
        let n = remote.evaluated.div_ceil(CHUNK_TOKENS);
        // DRAM copies of chunks the new revision still names (same content) are kept.
        let mut dram: Vec<Option<DramChunk>> = (0..n).map(|_| None).collect();
        if let Some(mut old) = self.contexts.remove(&id) {
            for (i, slot) in old.dram.iter_mut().enumerate() {
                let Some(d) = slot.take() else { continue };
                let same = remote
                    .chunks
                    .get(i)
                    .and_then(Option::as_ref)
                    .is_some_and(|r| {
                        i < n
                            && r.len == d.len
                            && r.bits == d.bits
                            && persist::check_chunk(r, &d.bytes).is_ok()
                    });
                if same {
                    dram[i] = Some(d);
                } else {
                    self.dram_used -= d.bytes.len() as u64;
                }
            }
        }
        if let Some(dir) = &self.cfg.dir {
            persist::save_index(dir, &remote)?;
        }
        self.clock += 1;
        self.contexts.insert(
            id,
            Context {
                clean: remote.evaluated,
                index: remote,
                dram,
                last_use: self.clock,
                last_restore: None,
                lost_at_load: 0,
            },
        );
        Ok(true)
    }

    /// Drop context `id` from this manager and its DRAM chunks from the DRAM count.
    fn remove_here(&mut self, id: &str) {
        if let Some(c) = self.contexts.remove(id) {
            self.dram_used -= c
                .dram
                .iter()
                .flatten()
                .map(|d| d.bytes.len() as u64)
                .sum::<u64>();
        }
    }

    /// Forget context `id` here only, its local files too (the shared store no longer has it).
    pub fn forget(&mut self, id: &str) {
        self.remove_here(id);
        if let Some(dir) = &self.cfg.dir
            && let Err(e) = persist::remove_context(dir, id)
        {
            tracing::warn!("{e}");
        }
    }

    pub fn shared(&self) -> Option<&Arc<SharedStore>> {
        self.cfg.shared.as_ref()
    }

    /// Persist the conversation (tokens, messages) now: chunks not yet written are recomputed
    /// if the process dies before [`KvManager::swap_out`] finishes.
    pub fn save_conversation(&mut self, id: &str) -> Result<()> {
        let (Some(dir), Some(c)) = (&self.cfg.dir, self.contexts.get(id)) else {
            return Ok(());
        };
        persist::save_index(dir, &c.index)?;
        Ok(())
    }
}
