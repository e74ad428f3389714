//! Footprints: the bytes everything takes and the ledger that enforces them. The device size
//! rule ([`device_bytes`]), the fixed device cost a budget is carved after ([`fixed`]), KV cache
//! sizes, the per-op workspace formula and the kernel choices it follows, a forward step's memory and how long calls are partitioned, and the [`Ledger`]
//! every reservation goes through.
//!
//! The planner, the engine, the CUDA backend and the budgeted device all read these, so what a
//! plan accepts is what each device allocates. This room imports only `tensor` and `model`;
//! nothing in it knows a device, an engine or a plan.

pub mod attention;
mod device;
pub mod fixed;
pub mod kv;
pub mod ledger;
pub mod step;
pub mod workspace;

pub use device::{DEVICE_ALIGN, device_bytes};
pub use fixed::{FixedCost, FixedCostReading, FixedCostSource};
pub use kv::{KV_BLOCK, KvColsError, KvType, kv_bytes, kv_pool_bytes, kv_table_bytes};
pub use ledger::{Ledger, LedgerSnapshot, OverBudget, Reservation, Tier};
pub use step::{
    CPU_ATTENTION_ROWS, ExpertsShape, GOOD_GROUP, MAX_BATCH, MAX_GROUP, MatmulShape, MatmulShapes,
    PROBE_QUERIES, PrefillLayout, StepMemory, probe_bytes, step_memory, whole_device_group,
};
pub use workspace::{WorkspaceOp, workspace_bytes};
