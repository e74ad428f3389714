//! The DRAM tier of the store (M2Cache's two-level cache): each layer's streamed parts are held
//! in host memory either in the **fixed area** (the first layers, loaded once) or, when the DRAM
//! budget is smaller than the model, in the **dynamic area**: a few buffers a preloader thread
//! refills from SSD, at least two layers ahead of the layer being copied to the device.
//!
//! Every buffer is a ledger reservation in DRAM; every SSD read is counted. Reads are direct
//! and checksummed by the store.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use crate::backend::{HostMatrixLayout, HostPin};
use crate::footprint::ledger::{Ledger, Reservation, Tier};
use crate::plan::{LayerShape, Part, Residency, device_dtype, part_segment_name};
use crate::store::{Store, StoreError};
use crate::tensor::AlignedBuf;

/// The streamed rows of one part of one layer, as read from SSD.
pub struct PartData {
    pub part: Part,
    pub rows: Range<usize>,
    /// Page-lock guard (drops before `buf`).
    _pin: Option<HostPin>,
    buf: AlignedBuf,
    /// Where the rows start in `buf` (the read started on a page boundary).
    first: usize,
    len: usize,
    /// Whether the rows were laid out for the device's products as they were read
    /// ([`crate::backend::Backend::host_matrix_layout`]).
    laid_out: bool,
    _hold: Reservation,
}

impl PartData {
    pub fn bytes(&self) -> &[u8] {
        &self.buf.as_slice()[self.first..self.first + self.len]
    }

    /// Whether [`PartData::bytes`] are laid out for the device's products, not rows: they go
    /// into a slot by [`crate::backend::Backend::upload_laid_out`].
    pub fn laid_out(&self) -> bool {
        self.laid_out
    }
}

/// One layer's streamed parts.
pub struct LayerData {
    pub layer: usize,
    pub parts: Vec<PartData>,
}

/// Which rows of which parts stream, and how to read them.
/// Page-locks a fresh host buffer for fast copies (see `Backend::pin_host`).
pub type PinFn<'a> = &'a dyn Fn(&AlignedBuf) -> Option<HostPin>;

#[derive(Clone)]
struct Reader {
    store: Arc<Store>,
    ledger: Arc<Ledger>,
    shape: LayerShape,
    residency: Residency,
    /// Lays attention's rows out for the device's products as they are read (they are only
    /// multiplied), where the device has such a layout.
    layout: Option<HostMatrixLayout>,
}

impl Reader {
    fn streamed_parts(&self) -> impl Iterator<Item = (Part, Range<usize>)> + '_ {
        Part::ALL
            .into_iter()
            .map(|p| (p, self.residency.streamed_rows(&self.shape, p)))
            .filter(|(_, r)| !r.is_empty())
    }

    /// Fresh buffers (reserved in DRAM, page-locked where the device wants that) that hold
    /// any of `layers` (their parts' formats may differ: each buffer fits the widest).
    fn alloc(&self, layers: &[usize], pin: PinFn) -> Result<LayerData, StoreError> {
        let layer = layers.first().copied().unwrap_or(0);
        let mut parts = Vec::new();
        for (p, rows) in self.streamed_parts() {
            let mut len = 0;
            for &l in layers {
                let seg = self.store.require(&part_segment_name(l, p))?;
                len = len.max(seg.read_extent(rows.clone()).1);
            }
            let buf = AlignedBuf::zeroed(len as usize);
            let pinned = pin(&buf);
            let tier = if pinned.is_some() {
                Tier::PinnedDram
            } else {
                Tier::Dram
            };
            let hold = self
                .ledger
                .reserve(
                    tier,
                    len,
                    &format!("DRAM buffer for layer {layer} {}", p.name()),
                )
                .map_err(|e| StoreError::Unsupported(e.to_string()))?;
            parts.push(PartData {
                part: p,
                rows,
                _pin: pinned,
                buf,
                first: 0,
                len: 0,
                laid_out: false,
                _hold: hold,
            });
        }
        Ok(LayerData { layer, parts })
    }

    /// Read layer `layer`'s streamed rows into `data` (buffers reused), one I/O thread per
    /// part so the drive sees several requests at once (FlexInfer's thread per tensor).
    fn fill(&self, data: &mut LayerData, layer: usize) -> Result<(), StoreError> {
        let read_part = |pd: &mut PartData| -> Result<(), StoreError> {
            let seg = self.store.require(&part_segment_name(layer, pd.part))?;
            let (first, read) = self
                .store
                .read_rows_into(seg, pd.rows.clone(), &mut pd.buf)?;
            self.ledger.count_ssd(read);
            pd.first = first;
            pd.len = pd.rows.len() * seg.row_bytes();
            pd.laid_out = match &self.layout {
                Some(lay_out) if Part::ATTENTION.contains(&pd.part) => {
                    let bytes = &mut pd.buf.as_mut_slice()[first..first + pd.len];
                    lay_out(device_dtype(seg), pd.rows.len(), seg.row_bytes(), bytes)
                }
                _ => false,
            };
            Ok(())
        };
        if data.parts.len() <= 1 {
            data.parts.iter_mut().try_for_each(read_part)?;
        } else {
            std::thread::scope(|scope| {
                let handles: Vec<_> = data
                    .parts
                    .iter_mut()
                    .map(|pd| scope.spawn(move || read_part(pd)))
                    .collect();
                handles.into_iter().try_for_each(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(StoreError::Unsupported("an I/O thread panicked".into()))
                    })
                })
            })?;
        }
        data.layer = layer;
        Ok(())
    }
}

#[derive(Default)]
enum SlotState {
    #[default]
    Empty,
    Loading(usize),
    Ready(Arc<LayerData>),
    Failed(usize, String),
}

struct Ring {
    slots: Vec<SlotState>,
    /// Buffers not in any slot (taken out while a read runs).
    spare: Vec<LayerData>,
    queue: VecDeque<usize>,
    /// Whether a slot's layer has been handed out: the dynamic area is a stream, so a consumed
    /// layer is never handed out again (the next pass reads it afresh) and its buffer is free
    /// once the copy reading it lets go. Each dynamic layer is read exactly once per pass.
    consumed: Vec<bool>,
    shutdown: bool,
}

struct Shared {
    ring: Mutex<Ring>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Ring> {
        self.ring.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The DRAM cache of the streamed layers.
pub struct DramCache {
    fixed: Vec<Arc<LayerData>>,
    /// Layers `fixed.len()..n_layers` go through the dynamic area.
    n_layers: usize,
    shared: Arc<Shared>,
    preloader: Option<JoinHandle<()>>,
}

impl DramCache {
    /// Load the fixed area (layers `0..fixed_layers`) now and start the preloader for the rest
    /// with `dynamic_buffers` buffers, each page-locked by `pin` where it can be and its
    /// attention laid out by `layout` where the device has a layout of its own.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        store: Arc<Store>,
        ledger: Arc<Ledger>,
        shape: LayerShape,
        residency: Residency,
        n_layers: usize,
        fixed_layers: usize,
        dynamic_buffers: usize,
        (pin, layout): (PinFn, Option<HostMatrixLayout>),
    ) -> Result<Self, StoreError> {
        let reader = Reader {
            store,
            ledger,
            shape,
            residency,
            layout,
        };
        let mut fixed = Vec::with_capacity(fixed_layers);
        for l in 0..fixed_layers.min(n_layers) {
            let mut d = reader.alloc(&[l], pin)?;
            reader.fill(&mut d, l)?;
            fixed.push(Arc::new(d));
        }
        let dynamic = if fixed.len() < n_layers {
            dynamic_buffers.max(1)
        } else {
            0
        };
        let mut spare = Vec::with_capacity(dynamic);
        let dynamic_layers: Vec<usize> = (fixed.len()..n_layers).collect();
        for _ in 0..dynamic {
            spare.push(reader.alloc(&dynamic_layers, pin)?);
        }
        let shared = Arc::new(Shared {
            ring: Mutex::new(Ring {
                slots: (0..dynamic).map(|_| SlotState::Empty).collect(),
                spare,
                queue: VecDeque::new(),
                consumed: vec![false; dynamic],
                shutdown: false,
            }),
            changed: Condvar::new(),
        });
        let preloader = if dynamic > 0 {
            let sh = shared.clone();
            Some(
                std::thread::Builder::new()
                    .name("dram-preloader".into())
                    .spawn(move || preload_loop(sh, reader))
                    .map_err(|e| {
                        StoreError::Unsupported(format!("cannot start the preloader: {e}"))
                    })?,
            )
        } else {
            None
        };
        Ok(DramCache {
            n_layers,
            fixed,
            shared,
            preloader,
        })
    }

    pub fn fixed_layers(&self) -> usize {
        self.fixed.len()
    }

    /// The next dynamic layers after `l` in the cyclic order the pass visits them.
    fn ahead(&self, l: usize, count: usize) -> Vec<usize> {
        let f = self.fixed.len();
        let dynamic = self.n_layers - f;
        if dynamic == 0 {
            return Vec::new();
        }
        (1..=count.min(dynamic - 1))
            .map(|i| f + ((l.saturating_sub(f)) + i) % dynamic)
            .collect()
    }

    /// Layer `l`'s streamed parts, waiting for the read if needed; asks the preloader for the
    /// next two dynamic layers. Holding the returned `Arc` keeps the buffer from being reused.
    pub fn get(&self, l: usize) -> Result<Arc<LayerData>, StoreError> {
        if let Some(d) = self.fixed.get(l) {
            return Ok(d.clone());
        }
        let mut ring = self.shared.lock();
        let wanted: Vec<usize> = std::iter::once(l).chain(self.ahead(l, 2)).collect();
        for (i, &w) in wanted.iter().enumerate() {
            let present = ring
                .slots
                .iter()
                .zip(&ring.consumed)
                .any(|(s, &c)| match s {
                    SlotState::Loading(x) | SlotState::Failed(x, _) => *x == w,
                    SlotState::Ready(d) => d.layer == w && !c,
                    SlotState::Empty => false,
                });
            if !present && !ring.queue.contains(&w) {
                if i == 0 {
                    ring.queue.push_front(w);
                } else {
                    ring.queue.push_back(w);
                }
            }
        }
        self.shared.changed.notify_all();
        loop {
            let hit = (0..ring.slots.len()).find(|&i| {
                !ring.consumed[i] && matches!(&ring.slots[i], SlotState::Ready(d) if d.layer == l)
            });
            if let Some(i) = hit {
                ring.consumed[i] = true;
                if let SlotState::Ready(d) = &ring.slots[i] {
                    let d = d.clone();
                    self.shared.changed.notify_all();
                    return Ok(d);
                }
            }
            for s in ring.slots.iter_mut() {
                match s {
                    SlotState::Failed(x, msg) if *x == l => {
                        let msg = msg.clone();
                        *s = SlotState::Empty;
                        return Err(StoreError::Unsupported(msg));
                    }
                    _ => {}
                }
            }
            ring = self
                .shared
                .changed
                .wait(ring)
                .unwrap_or_else(|e| e.into_inner());
        }
    }
}

impl DramCache {
    /// Wait until the preloader has nothing queued or in progress (so counters are stable).
    pub fn settle(&self) {
        let mut ring = self.shared.lock();
        while !ring.shutdown
            && (!ring.queue.is_empty()
                || ring
                    .slots
                    .iter()
                    .any(|s| matches!(s, SlotState::Loading(_))))
        {
            ring = self
                .shared
                .changed
                .wait_timeout(ring, std::time::Duration::from_millis(50))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

impl Drop for DramCache {
    fn drop(&mut self) {
        self.shared.lock().shutdown = true;
        self.shared.changed.notify_all();
        if let Some(t) = self.preloader.take() {
            t.join().ok();
        }
    }
}

/// The preloader: takes requested layers off the queue and reads each into a buffer no one is
/// using (not the one just requested by a waiting reader).
fn preload_loop(shared: Arc<Shared>, reader: Reader) {
    let mut ring = shared.lock();
    loop {
        if ring.shutdown {
            return;
        }
        let Some(&layer) = ring.queue.front() else {
            ring = shared.changed.wait(ring).unwrap_or_else(|e| e.into_inner());
            continue;
        };
        let loaded = ring
            .slots
            .iter()
            .zip(&ring.consumed)
            .any(|(s, &c)| match s {
                SlotState::Ready(d) => d.layer == layer && !c,
                SlotState::Loading(x) | SlotState::Failed(x, _) => *x == layer,
                SlotState::Empty => false,
            });
        if loaded {
            ring.queue.pop_front();
            continue;
        }
        // A free slot: empty, or consumed and no longer read by a copy.
        let victim = (0..ring.slots.len()).find(|&i| match &ring.slots[i] {
            SlotState::Empty => true,
            SlotState::Ready(d) => ring.consumed[i] && Arc::strong_count(d) == 1,
            _ => false,
        });
        let Some(v) = victim else {
            // Every buffer is in use: wait for a reader to let one go.
            ring = shared.changed.wait(ring).unwrap_or_else(|e| e.into_inner());
            continue;
        };
        ring.queue.pop_front();
        let mut data = match std::mem::replace(&mut ring.slots[v], SlotState::Loading(layer)) {
            SlotState::Ready(d) => match Arc::try_unwrap(d) {
                Ok(d) => d,
                Err(_) => unreachable!("strong count was 1 under the lock"),
            },
            _ => match ring.spare.pop() {
                Some(d) => d,
                None => {
                    ring.slots[v] = SlotState::Failed(layer, "no DRAM buffer left".into());
                    shared.changed.notify_all();
                    continue;
                }
            },
        };
        drop(ring);
        let result = reader.fill(&mut data, layer);
        ring = shared.lock();
        ring.consumed[v] = false;
        ring.slots[v] = match result {
            Ok(()) => SlotState::Ready(Arc::new(data)),
            Err(e) => {
                ring.spare.push(data);
                SlotState::Failed(layer, e.to_string())
            }
        };
        shared.changed.notify_all();
    }
}
