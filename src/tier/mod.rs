//! The memory hierarchy carrying a [`crate::plan::Plan`] out: one weight source per execution
//! mode, named as the planner names the mode (`plan/X.rs` decides it, `tier/X.rs` holds its
//! bytes):
//! - [`stream`]: resident shares on the device, the rest streamed SSD → DRAM → device a window
//!   of layers ahead of compute (FlexInfer);
//! - [`split`]: with the split, the CPU computing the FFN neurons the link would be slowest to
//!   bring (or, hybrid over streamed attention, the cold ones), beside the streaming source;
//! - [`hybrid`]: hot neurons resident on the device, cold ones in DRAM computed by the CPU
//!   (PowerInfer);
//! - [`units`]: per-layer HBM cache units filled by the adjacent-token update ([`atu`]), in
//!   mixed precision ([`precision`]) (M2Cache);
//! - [`experts`]: a mixture-of-experts model's routed experts in DRAM, per-layer units of
//!   expert slots on the device, the CPU computing the experts a unit lacks;
//! - [`dram`]: the DRAM cache of the store's segments all of them read through (a fixed area
//!   for the first layers, a dynamic area refilled from SSD ahead of use by a preloader).
//!
//! The pieces the modes share: [`resident`] (norms, biases, head, embeddings, the start-up
//! loader; every layer's attention where nothing streams) and [`cold`] (neurons the CPU
//! computes from DRAM). Arrows run one way: `resident`, `cold` ← `hybrid` ← `split` ← `stream`;
//! `units` uses `resident`, `cold` and `hybrid`, and `stream` uses `units` (cache units beside
//! streamed attention).
//!
//! Every byte they hold is reserved in the [`crate::footprint::Ledger`].

pub mod atu;
pub mod cold;
pub mod dram;
pub mod expert_host;
mod expert_low_bit;
pub mod experts;
pub mod hybrid;
pub mod precision;
pub mod resident;
pub mod split;
pub mod stream;
pub mod units;

/// `b.compute_waits(ev)` traced as a host wait: the budgeted device's host blocks there until
/// the copy has landed (CUDA queues the wait on its stream and returns at once), and untraced
/// that time fell into the step's `other` (SmolLM2 streamed at 48M with one slot: a third of
/// the step).
pub(crate) fn compute_waits_for<B: crate::backend::Backend>(
    b: &B,
    ev: &B::Event,
) -> crate::backend::Result<()> {
    let _wait = crate::engine::trace::span(crate::engine::trace::Phase::HostWait);
    b.compute_waits(ev)
}
