//! `bench contexts`: the LLMS trace benchmark. N persistent contexts receive calls (Poisson
//! arrivals; the next call stays on the last context with a "sticky" probability, else goes to
//! one drawn at random); only `resident` contexts' KV fit on the device at once (the slots of
//! `serve --parallel`), so a call to another context first takes a slot from the least recently
//! used one. Every strategy replays the same trace with the real engine and real copies, and
//! what is reported is the wall clock of that work:
//! 1. `recompute`: drop the KV on eviction, re-prefill the whole conversation on return;
//! 2. `whole-swap`: the whole exact KV (at the device's KV width) out to DRAM on eviction and
//!    back on return, the least recently used contexts spilled whole to disk past the budget;
//! 3. `chunked-swap`: `KvManager` with compression off, swapped out at eviction, never
//!    recomputing (the cost model made to say recomputing never pays);
//! 4. `chunked-int8`: the same with every chunk at 8 bits;
//! 5. `ours`: `KvManager` as `serve` runs it: tolerance-aware widths (a chunk kept exact where
//!    the measured decode costs more than loading the bytes exact adds), the measured
//!    swap/recompute split, LCTRU and ahead-of-time swap-out at the end of every call.
//!
//! The queue is computed, not slept: one engine thread serves calls in arrival order, busy for
//! the measured time of each (switch, prefill, answer, and the ahead-of-time swap-out where a
//! strategy does one), as `serve`'s engine thread is.
//!
//! `trace`: the calls; `strategies`: how a context leaves the device and comes back; `replay`:
//! the queue; `report`: contexts.json and its Markdown; `runner`: the benchmark end to end,
//! with its flags. Nothing here prints but progress on stderr.

mod error;
pub mod replay;
pub mod report;
pub mod runner;
pub mod strategies;
pub mod trace;

pub use error::{ContextsError, Result};
pub use replay::{Histories, Job, NoSwitch, Outcome, no_switch_run, run, run_strategy};
pub use report::{
    CallRecord, CheckResult, ContextsReport, CostInfo, DeviceInfo, ModelInfo, MostContexts, SCHEMA,
    Settings, Speedup, StrategyResult, Summary, SweepCell, SweepPoint, most_contexts, notes,
    speedups,
};
pub use strategies::{MoverStats, RunSettings, Strategy};
pub use trace::{Call, TokenSource, Trace, TraceConfig};
