//! The runtime: choose the device and the budget, open a model, plan it and assemble an engine
//! on the chosen backend, turn prompt flags into token ids, and probe the machine for the rates
//! the planner prices by. `cli`, `service` and `bench` all start their engines here; this room
//! knows no HTTP and prints nothing.

mod load;
mod options;
pub mod probe;
pub mod store;

pub(crate) use load::with_engine;
pub use load::{
    AnyEngine, DEFAULT_SPARSITY_TARGET, Hybrid, Job, LoadedModel, Running, Units, budget_for,
    kv_type_for,
};
pub use options::{
    BudgetArgs, Device, KvTypeArg, ModelArgs, PromptArgs, SparsityMode, parse_bytes,
};
