//! The memory hierarchy carrying a [`crate::plan::Plan`] out: one weight source per execution
//! mode, named as the planner names the mode (`plan/X.rs` decides it, `tier/X.rs` holds its
//! bytes):
//! - [`stream`]: resident shares on the device, the rest streamed SSD → DRAM → device a window
//!   of layers ahead of compute (FlexInfer), and with the split the CPU computing the FFN
//!   neurons the link would be slowest to bring;
//! - [`hybrid`]: hot neurons resident on the device, cold ones in DRAM computed by the CPU
//!   (PowerInfer);
//! - [`units`]: per-layer HBM cache units filled by the adjacent-token update ([`atu`]), in
//!   mixed precision ([`precision`]) (M2Cache);
//! - [`dram`]: the DRAM cache of the store's segments all of them read through (a fixed area
//!   for the first layers, a dynamic area refilled from SSD ahead of use by a preloader).
//!
//! Every byte they hold is reserved in the [`crate::footprint::Ledger`].

pub mod atu;
pub mod dram;
pub mod hybrid;
pub mod precision;
pub mod stream;
pub mod units;
