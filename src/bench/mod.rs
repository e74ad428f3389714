//! End-to-end benchmark harness (DESIGN §3 `bench/`): measuring a model's speed, the physical
//! bound beside every figure, the suite's matrix of budgets and prompt lengths, peers run in the
//! same process tree, and the report (JSON, Markdown, SVG plots). The CLI (`cli/bench.rs`) loads
//! models and drives it; nothing here parses flags or knows how a model is loaded.

pub mod attention;
pub mod bounds;
pub mod contexts;
pub mod corpus;
pub mod decode;
pub mod matvec;
pub mod measure;
pub mod output;
pub mod plot;
pub mod precision;
pub mod running;
pub mod sparse;
pub mod suite;
pub mod units;

pub use bounds::{AboveBound, Bound, Rates, Traffic, hbm_read_rate};
pub use measure::{Measured, measure};
