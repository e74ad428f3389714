//! Device memory as a budget sees it, the same for every device: one size rule for every
//! allocation ([`device_bytes`]), the byte ledger that refuses a reservation past the budget, and —
//! when there is a budget — one arena every buffer is carved from ([`Arena`]); and the workspace
//! a backend holds for its ops, with the one check of an op against it ([`check_workspace`]).
//!
//! The CUDA backend maps arena offsets onto one `cuMemAlloc` of the whole budget, so the process
//! never holds more device memory than the budget plus its fixed cost, however the stream-ordered
//! pool would have rounded or kept freed blocks. The budgeted CPU device uses the very same arena
//! with no memory behind it: where an allocation fails on the GPU for want of a hole big enough,
//! it fails in CI too.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::{BackendError, Result};
use crate::footprint::ledger::{Ledger, Reservation, Tier};
use crate::footprint::{WorkspaceOp, device_bytes, workspace_bytes};

/// A best-fit allocator over offsets `0..size` (no memory of its own). Free ranges are kept
/// coalesced, so freeing everything always leaves one hole of the whole size.
#[derive(Debug)]
pub struct Arena {
    size: u64,
    /// Free ranges: offset → length.
    free: BTreeMap<u64, u64>,
}

impl Arena {
    pub fn new(size: u64) -> Self {
        let mut free = BTreeMap::new();
        if size > 0 {
            free.insert(0, size);
        }
        Arena { size, free }
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// The offset of `bytes` taken from the smallest hole that holds them (lowest offset among
    /// equals), or `None`.
    pub fn alloc(&mut self, bytes: u64) -> Option<u64> {
        let (&off, &len) = self
            .free
            .iter()
            .filter(|&(_, &len)| len >= bytes)
            .min_by_key(|&(&off, &len)| (len, off))?;
        self.free.remove(&off);
        if len > bytes {
            self.free.insert(off + bytes, len - bytes);
        }
        Some(off)
    }

    /// Give back `bytes` at `off` (as returned by [`Arena::alloc`]), merging with its neighbours.
    pub fn free(&mut self, off: u64, bytes: u64) {
        let (mut start, mut len) = (off, bytes);
        if let Some((&p, &plen)) = self.free.range(..off).next_back()
            && p + plen == off
        {
            self.free.remove(&p);
            start = p;
            len += plen;
        }
        if let Some(&nlen) = self.free.get(&(off + bytes)) {
            self.free.remove(&(off + bytes));
            len += nlen;
        }
        debug_assert!(start + len <= self.size, "arena free past its end");
        self.free.insert(start, len);
    }

    pub fn free_bytes(&self) -> u64 {
        self.free.values().sum()
    }

    pub fn largest_hole(&self) -> u64 {
        self.free.values().copied().max().unwrap_or(0)
    }
}

/// The device memory of one backend: the ledger's HBM budget and, under a budget, the arena of
/// exactly that size.
pub struct DeviceMemory {
    ledger: Arc<Ledger>,
    arena: Option<Arc<Mutex<Arena>>>,
    /// Allocations taken so far (each one's [`DeviceAlloc::id`]).
    takes: AtomicU64,
}

/// One device allocation: its ledger reservation and, in an arena, its range.
#[derive(Debug)]
pub struct DeviceAlloc {
    /// Which allocation of its [`DeviceMemory`] this is (1, 2, …: never reused), so a buffer
    /// can be told from one taken later at the same address.
    pub id: u64,
    /// Offset in the arena (`None` without one).
    pub offset: Option<u64>,
    /// Device bytes taken ([`device_bytes`] of the request).
    pub bytes: u64,
    /// Host memory the device reads in place over the link (mapped), no device memory: what
    /// its ops read of it crosses the link.
    pub in_host: bool,
    arena: Option<Arc<Mutex<Arena>>>,
    _hold: Reservation,
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        if let (Some(a), Some(off)) = (&self.arena, self.offset)
            && let Ok(mut a) = a.lock()
        {
            a.free(off, self.bytes);
        }
    }
}

/// Something holding one device allocation (a buffer and what keeps it).
pub trait Holds {
    fn alloc(&self) -> &DeviceAlloc;
}

impl Holds for DeviceAlloc {
    fn alloc(&self) -> &DeviceAlloc {
        self
    }
}

/// A backend's held workspace: one buffer of the largest size asked for since it was last
/// freed (`set(0)`).
pub struct Workspace<T>(Mutex<Option<T>>);

impl<T: Holds> Default for Workspace<T> {
    fn default() -> Self {
        Workspace(Mutex::new(None))
    }
}

impl<T: Holds> Workspace<T> {
    /// Hold at least [`device_bytes`]`(bytes)` (nothing for 0), taking a new buffer with
    /// `take` when the one held is smaller. The old one is freed first: device memory is
    /// budgeted. A larger one is kept, as a step's buffers are (`Engine::take_scratch`): the
    /// plan counts the largest step's workspace, and freeing it for a smaller step let other
    /// buffers split its range, so the next large step found the budget's bytes free but in
    /// pieces (SmolLM2 streamed at 48M, `bench decode -n 2`: 700 KB asked, 724 KB free, the
    /// largest piece 640 KB).
    pub fn set(&self, bytes: u64, take: impl FnOnce(u64) -> Result<T>) -> Result<()> {
        let mut ws = self.lock()?;
        if bytes > 0
            && ws
                .as_ref()
                .is_some_and(|w| w.alloc().bytes >= device_bytes(bytes))
        {
            return Ok(());
        }
        *ws = None;
        if bytes > 0 {
            *ws = Some(take(bytes)?);
        }
        Ok(())
    }

    /// Free what is held.
    pub fn clear(&self) {
        if let Ok(mut w) = self.0.lock() {
            *w = None;
        }
    }

    /// Device bytes held now.
    pub fn held(&self) -> u64 {
        self.0
            .lock()
            .ok()
            .and_then(|w| w.as_ref().map(|w| w.alloc().bytes))
            .unwrap_or(0)
    }

    pub fn lock(&self) -> Result<std::sync::MutexGuard<'_, Option<T>>> {
        self.0
            .lock()
            .map_err(|_| BackendError::Device("workspace poisoned".into()))
    }
}

/// `op`'s workspace ([`workspace_bytes`]) fits the `held` bytes, else the error every device
/// gives when the step's workspace formula missed an op (CUDA and the budgeted device alike).
pub fn check_workspace(op: &WorkspaceOp, held: u64) -> Result<()> {
    let need = workspace_bytes(op);
    if need > held {
        return Err(BackendError::Workspace {
            op: format!("{op:?}"),
            needed: need,
            held,
        });
    }
    Ok(())
}

impl DeviceMemory {
    /// Memory under `ledger`'s HBM budget (an arena of that size when there is one).
    pub fn new(ledger: Arc<Ledger>) -> Self {
        let arena = ledger
            .hbm_budget()
            .map(|b| Arc::new(Mutex::new(Arena::new(b))));
        DeviceMemory {
            ledger,
            arena,
            takes: AtomicU64::new(0),
        }
    }

    /// How many allocations have been taken so far: unchanged between two reads, no buffer has
    /// been taken in between (so none freed since can have been replaced at its address by
    /// another; what a recorded step's replay relies on).
    pub fn takes(&self) -> u64 {
        self.takes.load(Ordering::SeqCst)
    }

    pub fn ledger(&self) -> &Arc<Ledger> {
        &self.ledger
    }

    /// Size of the arena (the budget), if there is one.
    pub fn arena_size(&self) -> Option<u64> {
        self.arena
            .as_ref()
            .and_then(|a| a.lock().ok().map(|a| a.size()))
    }

    /// Take [`device_bytes`]`(bytes)` for `what`.
    pub fn take(&self, bytes: u64, what: &str) -> Result<DeviceAlloc> {
        let bytes = device_bytes(bytes);
        let hold =
            self.ledger
                .reserve(Tier::Hbm, bytes, what)
                .map_err(|e| BackendError::OutOfMemory {
                    what: e.what,
                    needed: e.needed as usize,
                    available: e.available as usize,
                })?;
        let offset = match &self.arena {
            None => None,
            Some(a) => {
                let mut a = a
                    .lock()
                    .map_err(|_| BackendError::Device("device arena poisoned".into()))?;
                match a.alloc(bytes) {
                    Some(off) => Some(off),
                    None => {
                        return Err(BackendError::OutOfMemory {
                            what: format!(
                                "{what} (the budget has {} bytes free, but in pieces: the largest is {})",
                                a.free_bytes(),
                                a.largest_hole()
                            ),
                            needed: bytes as usize,
                            available: a.largest_hole() as usize,
                        });
                    }
                }
            }
        };
        Ok(DeviceAlloc {
            id: self.takes.fetch_add(1, Ordering::SeqCst) + 1,
            offset,
            bytes,
            in_host: false,
            arena: self.arena.clone(),
            _hold: hold,
        })
    }

    /// The handle of host memory mapped for the device to read in place (`what`): an id like
    /// any allocation's, no device bytes (the host memory is its owner's, already counted).
    pub fn in_host(&self, what: &str) -> Result<DeviceAlloc> {
        let hold = self
            .ledger
            .reserve(Tier::PinnedDram, 0, what)
            .map_err(|e| BackendError::Device(e.to_string()))?;
        Ok(DeviceAlloc {
            id: self.takes.fetch_add(1, Ordering::SeqCst) + 1,
            offset: None,
            bytes: 0,
            in_host: true,
            arena: None,
            _hold: hold,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn sizes_round_to_the_granule() {
        assert_eq!(device_bytes(0), 256);
        assert_eq!(device_bytes(1), 256);
        assert_eq!(device_bytes(256), 256);
        assert_eq!(device_bytes(257), 512);
    }

    #[test]
    fn best_fit_takes_the_smallest_hole() {
        let mut a = Arena::new(1000);
        let x = a.alloc(100).unwrap();
        let y = a.alloc(300).unwrap();
        let _z = a.alloc(100).unwrap();
        a.free(x, 100);
        a.free(y, 300);
        // Holes: [0, 400) and [500, 1000): 350 fits both; the smaller one is taken.
        assert_eq!(a.alloc(350), Some(0));
        assert_eq!(a.alloc(500), Some(500));
        assert_eq!(a.alloc(60), None);
        assert_eq!(a.largest_hole(), 50);
    }

    #[test]
    fn fragmentation_is_reported_with_the_largest_hole() {
        let ledger = Ledger::new(Some(4 * 256), None);
        let mem = DeviceMemory::new(ledger);
        let a = mem.take(256, "a").unwrap();
        let _b = mem.take(256, "b").unwrap();
        let c = mem.take(256, "c").unwrap();
        let _d = mem.take(256, "d").unwrap();
        drop((a, c));
        let e = mem.take(512, "e").unwrap_err().to_string();
        assert!(
            e.contains("in pieces") && e.contains("largest is 256"),
            "{e}"
        );
    }

    /// A workspace asked for less keeps what it holds, so a buffer taken meanwhile cannot split
    /// its range: the larger size is there again when asked for, in an arena with no room to
    /// spare. `set(0)` frees it.
    #[test]
    fn a_workspace_is_held_at_its_largest_size() {
        let ledger = Ledger::new(Some(4 * 256), None);
        let mem = DeviceMemory::new(ledger.clone());
        let ws: Workspace<DeviceAlloc> = Workspace::default();
        let take = |b: u64| mem.take(b, "device workspace");
        let _a = mem.take(256, "a").unwrap();
        ws.set(512, take).unwrap();
        ws.set(256, take).unwrap();
        assert_eq!(ws.held(), 512);
        // Freed for the smaller size, this buffer would have gone into the workspace's range.
        let _b = mem.take(256, "b").unwrap();
        ws.set(512, take).unwrap();
        assert_eq!(ws.held(), 512);
        assert_eq!(ledger.snapshot().hbm_used, 4 * 256);
        ws.set(0, take).unwrap();
        assert_eq!((ws.held(), ledger.snapshot().hbm_used), (0, 2 * 256));
    }

    proptest! {
        /// Any sequence of allocations and frees: ranges never overlap, stay inside the arena,
        /// and freeing everything leaves one hole of the whole size.
        #[test]
        fn ranges_are_disjoint_and_coalesce(ops in proptest::collection::vec((1u64..40, any::<bool>()), 1..200)) {
            let mut a = Arena::new(1000);
            let mut live: Vec<(u64, u64)> = Vec::new();
            for (size, free_one) in ops {
                if free_one && !live.is_empty() {
                    let (off, len) = live.remove(size as usize % live.len());
                    a.free(off, len);
                } else if let Some(off) = a.alloc(size) {
                    prop_assert!(off + size <= 1000);
                    for &(o, l) in &live {
                        prop_assert!(off + size <= o || o + l <= off, "overlap");
                    }
                    live.push((off, size));
                } else {
                    prop_assert!(a.largest_hole() < size);
                }
                let used: u64 = live.iter().map(|l| l.1).sum();
                prop_assert_eq!(a.free_bytes() + used, 1000);
            }
            for (off, len) in live {
                a.free(off, len);
            }
            prop_assert_eq!(a.largest_hole(), 1000);
        }
    }
}
