//! One layer's experts on the host ([`crate::plan::expert_host`]): every expert's stacks in
//! DRAM (read whole from the store; an expert is one slice of each), or the SSD tier — a DRAM
//! cache of whole-expert slots the CPU computes from, an expert it lacks read from the store
//! first (one read of each matrix's rows, widened to whole checksum groups and checked), the
//! cache's stale experts giving way as the device's units do (the routing profile's ranking,
//! else least recently routed). Copies to the device come from DRAM where the expert is there,
//! else straight from a read of the store (not admitted to the cache).

use std::sync::Arc;

use super::atu::{Eviction, SlotMap};
use crate::backend::cpu::CpuBackend;
use crate::backend::{Act, Backend, Experts, Route};
use crate::engine::{EngineError, Result};
use crate::footprint::ledger::{Ledger, Reservation, Tier};
use crate::plan::experts::expert_read_rows;
use crate::plan::manifest::experts_segment_name;
use crate::store::{Segment, Store, StoreError};
use crate::tensor::{AlignedBuf, HostTensor};

fn store_err(e: StoreError) -> EngineError {
    EngineError::Weights(e.to_string())
}

fn weights_err(e: impl std::fmt::Display) -> EngineError {
    EngineError::Weights(e.to_string())
}

/// The three matrices of an expert.
pub(super) const MATRICES: [&str; 3] = ["gate", "up", "down"];

/// One of a layer's three expert stacks in DRAM: its bytes (what a copy into a slot reads) and
/// the CPU's weight over the same bytes.
struct Stack {
    /// The page lock of `host` (on a GPU: the copies out of it run asynchronously), released
    /// before the memory (fields drop in order).
    _pin: Option<crate::backend::HostPin>,
    host: HostTensor,
    cpu: <CpuBackend as Backend>::Weight,
    _hold: Reservation,
}

impl Stack {
    fn load<B: Backend>(
        b: &B,
        (store, ledger): (&Store, &Arc<Ledger>),
        cpu: &CpuBackend,
        seg: &Segment,
    ) -> Result<Self> {
        let hold = ledger
            .reserve(Tier::Dram, seg.bytes.next_multiple_of(4096), &seg.name)
            .map_err(weights_err)?;
        let host = store.tensor(&seg.name).map_err(store_err)?;
        ledger.count_ssd(seg.read_extent(0..seg.rows).1);
        Ok(Stack {
            _pin: b.pin_host(host.data.as_slice())?,
            cpu: cpu.upload(&host)?,
            host,
            _hold: hold,
        })
    }
}

/// The SSD tier's DRAM cache of one layer: per matrix `slots × rows` on the CPU, its slot map.
struct Cache {
    matrices: [<CpuBackend as Backend>::Weight; 3],
    map: SlotMap,
    _hold: Reservation,
}

/// Where the SSD tier reads: the store, one expert matrix's buffer, the ledger that counts the
/// bytes read from disk.
pub(super) struct Reader {
    store: Arc<Store>,
    buf: AlignedBuf,
    ledger: Arc<Ledger>,
    _hold: Option<Reservation>,
}

impl Reader {
    /// A reader with a buffer of `bytes` (0: no SSD tier), reserved in the ledger.
    pub(super) fn new(store: Arc<Store>, ledger: Arc<Ledger>, bytes: u64) -> Result<Self> {
        let hold = if bytes > 0 {
            Some(
                ledger
                    .reserve(Tier::Dram, bytes, "expert read buffer")
                    .map_err(weights_err)?,
            )
        } else {
            None
        };
        Ok(Reader {
            store,
            buf: AlignedBuf::zeroed(bytes as usize),
            ledger,
            _hold: hold,
        })
    }

    /// Expert `e`'s rows of `seg` (`rows` an expert), read from the store.
    fn read(&mut self, seg: &Segment, e: usize, rows: usize) -> Result<&[u8]> {
        let want = expert_read_rows(e, rows, seg.rows);
        let (_, len) = seg.read_extent(want.clone());
        if self.buf.capacity() < len as usize {
            return Err(weights_err(format!(
                "expert {e} of `{}` needs a read of {len} bytes; the buffer holds {}",
                seg.name,
                self.buf.capacity()
            )));
        }
        let (first, read) = self
            .store
            .read_rows_into(seg, want.clone(), &mut self.buf)
            .map_err(store_err)?;
        self.ledger.count_ssd(read);
        let rb = seg.row_bytes();
        let at = first + (e * rows - want.start) * rb;
        Ok(&self.buf.as_slice()[at..at + rows * rb])
    }
}

enum Place {
    /// Every expert's stacks.
    Stacks(Box<[Stack; 3]>),
    /// The SSD tier's cache.
    Cached(Box<Cache>),
}

/// A layer's experts on the host.
pub(super) struct HostExperts {
    segs: [Segment; 3],
    /// Rows of one expert, per matrix.
    rows: [usize; 3],
    place: Place,
}

/// What the host's side of a step did: experts the CPU computed and their bytes, experts read
/// from the store and their bytes.
#[derive(Default)]
pub(super) struct HostWork {
    pub cpu_experts: u64,
    pub cpu_bytes: u64,
    pub ssd_experts: u64,
    pub ssd_bytes: u64,
}

/// The distinct experts of `routes`, ascending.
pub(super) fn distinct_experts(routes: &[Route]) -> Vec<u32> {
    let mut ids: Vec<u32> = routes.iter().map(|r| r.expert).collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

impl HostExperts {
    /// Layer `l`'s experts (`experts` routed ones, `all` with the shared expert's parts):
    /// every stack read whole where `cache` is `None`, else a DRAM cache of that many routed
    /// slots under `eviction` (a shared part is read from the store when copied).
    pub(super) fn load<B: Backend>(
        b: &B,
        (store, ledger): (&Store, &Arc<Ledger>),
        cpu: &CpuBackend,
        (l, experts, all): (usize, usize, usize),
        cache: Option<(usize, Eviction)>,
    ) -> Result<Self> {
        let mut segs = Vec::with_capacity(3);
        let mut rows = [0; 3];
        for (i, w) in MATRICES.iter().enumerate() {
            let name = experts_segment_name(l, w);
            let seg = store.require(&name).map_err(store_err)?;
            if all == 0 || !seg.rows.is_multiple_of(all) {
                return Err(weights_err(format!(
                    "`{name}` has {} rows: not {all} experts of equal rows",
                    seg.rows
                )));
            }
            rows[i] = seg.rows / all;
            segs.push(seg.clone());
        }
        let segs: [Segment; 3] = segs
            .try_into()
            .map_err(|_| weights_err("three expert matrices"))?;
        let place = match cache {
            None => {
                let [g, u, d] = &segs;
                let load = |s| Stack::load(b, (store, ledger), cpu, s);
                Place::Stacks(Box::new([load(g)?, load(u)?, load(d)?]))
            }
            Some((slots, eviction)) => {
                let mut bytes = 0;
                let mut matrices = Vec::with_capacity(3);
                for (s, &r) in segs.iter().zip(&rows) {
                    bytes += (slots * r * s.row_bytes()).next_multiple_of(4096) as u64;
                    let dtype = crate::plan::device_dtype(s);
                    matrices.push(cpu.alloc_weight(
                        &format!("{} DRAM cache", s.name),
                        dtype,
                        slots * r,
                        s.cols,
                    )?);
                }
                let hold = ledger
                    .reserve(Tier::Dram, bytes, &format!("layer {l} expert DRAM cache"))
                    .map_err(weights_err)?;
                Place::Cached(Box::new(Cache {
                    matrices: matrices
                        .try_into()
                        .map_err(|_| weights_err("three expert matrices"))?,
                    map: SlotMap::new(experts, slots, eviction).map_err(weights_err)?,
                    _hold: hold,
                }))
            }
        };
        Ok(HostExperts { segs, rows, place })
    }

    /// Matrix `i`'s stack of every expert, where every stack is in DRAM.
    pub(super) fn stack(&self, i: usize) -> Option<&HostTensor> {
        match &self.place {
            Place::Stacks(s) => Some(&s[i].host),
            Place::Cached(_) => None,
        }
    }

    /// Rows of one expert of matrix `i`.
    pub(super) fn rows(&self, i: usize) -> usize {
        self.rows[i]
    }

    /// The segment of matrix `i` (its format and columns).
    pub(super) fn segment(&self, i: usize) -> &Segment {
        &self.segs[i]
    }

    /// Bytes of one expert (its three matrices, as stored).
    pub(super) fn expert_bytes(&self) -> u64 {
        self.segs
            .iter()
            .zip(&self.rows)
            .map(|(s, &r)| (r * s.row_bytes()) as u64)
            .sum()
    }

    /// Expert `e`'s rows of matrix `i`: from DRAM where they are, else read from the store
    /// (`true`: read).
    pub(super) fn expert<'a>(
        &'a self,
        i: usize,
        e: usize,
        reader: &'a mut Reader,
    ) -> Result<(&'a [u8], bool)> {
        let rb = self.segs[i].row_bytes();
        let r = self.rows[i];
        let dram = match &self.place {
            Place::Stacks(s) => Some((s[i].host.data.as_slice(), e)),
            Place::Cached(c) => match c.map.slot_of(e as u32) {
                Some(slot) => {
                    let t = c.matrices[i]
                        .as_tensor()
                        .ok_or_else(|| weights_err("an expert cache of coded bundles"))?;
                    Some((t.data.as_slice(), slot as usize))
                }
                None => None,
            },
        };
        match dram {
            Some((bytes, at)) => Ok((&bytes[at * r * rb..(at + 1) * r * rb], false)),
            None => Ok((reader.read(&self.segs[i], e, r)?, true)),
        }
    }

    /// `out` (`n × d`) = the experts' FFN of `routes` for the rows `x`, on the CPU; with the
    /// SSD tier the step's experts go through the cache as many at a time as it holds
    /// (ascending ids), those it lacks read from the store first.
    pub(super) fn cpu_ffn(
        &mut self,
        (cpu, act, width): (&CpuBackend, Act, usize),
        (x, n, d): (&[f32], usize, usize),
        routes: &[Route],
        reader: &mut Reader,
        out: &mut [f32],
    ) -> Result<HostWork> {
        let ids = distinct_experts(routes);
        let eb = self.expert_bytes();
        let mut work = HostWork {
            cpu_experts: ids.len() as u64,
            cpu_bytes: ids.len() as u64 * eb,
            ..HostWork::default()
        };
        let mut xt = cpu.alloc(n, d)?;
        cpu.write(&mut xt, x)?;
        let mut ot = cpu.alloc(n, d)?;
        let HostExperts { segs, rows, place } = self;
        match place {
            Place::Stacks(stacks) => {
                let [g, u, dn] = &**stacks;
                let experts = Experts {
                    gate: Some(&g.cpu),
                    up: &u.cpu,
                    down: &dn.cpu,
                    width,
                };
                cpu.moe_ffn(experts, &xt, routes, act, &mut ot)?;
                cpu.read(&ot, out)?;
            }
            Place::Cached(c) => {
                out.fill(0.0);
                let mut part = vec![0f32; n * d];
                for group in ids.chunks(c.map.slots()) {
                    let (_, loads) = c.map.admit(group, usize::MAX).map_err(weights_err)?;
                    for ld in &loads {
                        let slot = ld.slot as usize;
                        for ((m, s), &r) in c.matrices.iter_mut().zip(segs.iter()).zip(rows.iter())
                        {
                            let src = reader.read(s, ld.neuron as usize, r)?;
                            cpu.upload_into(m, slot * r, src)?;
                        }
                    }
                    work.ssd_experts += loads.len() as u64;
                    work.ssd_bytes += loads.len() as u64 * eb;
                    let mut local = Vec::new();
                    for r in routes.iter().filter(|r| group.contains(&r.expert)) {
                        let slot = c.map.slot_of(r.expert).ok_or_else(|| {
                            weights_err(format!("expert {} not in the DRAM cache", r.expert))
                        })?;
                        local.push(Route { expert: slot, ..*r });
                    }
                    let experts = Experts::gated(&c.matrices, width);
                    cpu.moe_ffn(experts, &xt, &local, act, &mut ot)?;
                    cpu.read(&ot, &mut part)?;
                    out.iter_mut().zip(&part).for_each(|(o, p)| *o += p);
                }
            }
        }
        Ok(work)
    }
}
