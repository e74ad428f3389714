//! The runtime: choose the device and the budget, open a model, plan it and assemble an engine
//! on the chosen backend, turn prompt flags into token ids, and probe the machine for the rates
//! the planner prices by. `cli`, `service` and `bench` all start their engines here; this room
//! knows no HTTP and prints nothing.
//!
//! One file per concern: the flags (`options`), the job (`job`), the device and budget
//! (`device`), opening a model (`model`), placing it (`start`, with an offloaded run's
//! plan and weights in `offload`), the engine on its backend (`engine`) and what a placed
//! model reports (`running`); the machine measured for `doctor` ([`machine`], with the probes in
//! [`probe`]); the rates a plan prices by, measured at start and cached ([`rates`]); a model's
//! sparsity profiled ([`profiling`]); a store's plan for `plan`
//! ([`planning`]).

pub mod corpus;
mod device;
mod engine;
mod job;
pub mod machine;
mod model;
mod offload;
mod options;
pub mod planning;
pub mod probe;
pub mod profiling;
pub mod rates;
mod running;
mod start;
pub mod store;

pub use device::{budget_for, kv_type_for};
pub use engine::AnyEngine;
pub(crate) use engine::with_engine;
pub use job::Job;
pub use model::{DEFAULT_SPARSITY_TARGET, LoadedModel, read_prompt_file};
pub use options::{
    BudgetArgs, Device, KvTypeArg, ModelArgs, PromptArgs, SparsityMode, parse_bytes, parse_share,
};
pub use running::{Hybrid, Running, Units};

/// Refuse `what` (a neuron-level tool: profiles, cache units of neurons, the neuron planner) on
/// a mixture-of-experts model, whose FFN is its experts.
pub fn refuse_experts(spec: &crate::model::ModelSpec, what: &str) -> anyhow::Result<()> {
    match &spec.moe {
        Some(m) => anyhow::bail!(
            "{what} works on dense FFN neurons; this is a mixture-of-experts model ({} experts, {} \
             a token), whose routing is its sparsity (--sparsity off): offloaded, its experts go \
             to per-layer expert units (`plan` shows them, `profile` records the routing they \
             are ranked by), and `bench experts` studies their caches",
            m.experts,
            m.used
        ),
        None => Ok(()),
    }
}
