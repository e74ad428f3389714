//! The memory hierarchy: the byte ledger every allocation goes through; the DRAM cache of the
//! store's segments (a fixed area for the first layers, a dynamic area refilled from SSD ahead
//! of use by a preloader); and the streaming weight source that moves each layer's non-resident
//! weights SSD → DRAM → device a window of layers ahead of compute.

pub mod dram;
pub mod hybrid;
pub mod offload;
pub mod precision;
pub mod unit;
pub mod units;
