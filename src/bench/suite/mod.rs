//! `bench suite`, the consumer-GPU benchmark: a matrix of `--gpu-mem` budgets × prompt lengths,
//! every figure beside its bound and the plan's prediction, peers run in the same process tree,
//! and the report (JSON, Markdown; the plots are `bench/plot.rs`'s).
//! - `axes`: the budgets and prompt lengths to run;
//! - `matrix`: running each cell and turning it into a figure beside its bound;
//! - `peers`: llama.cpp's `llama-bench` and HF transformers, measured in the same run;
//! - `report`: `suite.json`'s schema and its Markdown;
//! - `cells`: each cell loaded through the runtime and measured;
//! - `runner`: the benchmark end to end, with its flags.

pub mod axes;
mod cells;
pub mod matrix;
pub mod peers;
pub mod report;
pub mod runner;

pub use axes::{
    BudgetChoice, BudgetPoint, DEFAULT_BUDGETS, parse_budget_list, parse_prompt_list,
    select_budgets,
};
pub use matrix::{
    CellJob, CellOutcome, CellRun, CellRunner, Matrix, PASS_TOKENS, cell_of, run_matrix,
};
