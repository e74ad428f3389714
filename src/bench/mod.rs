//! End-to-end benchmark harness (DESIGN §3 `bench/`): one file or folder per benchmark of
//! `gpu-offload bench` (`matvec`, `attention`, `sparse`, `decode`, `suite/`, `contexts/`,
//! `units`, `precision`), each with its flags (clap structs beside the code that reads them, as
//! `runtime::ModelArgs`), loading models through `crate::runtime` and returning what it
//! measured. Beside them what they share: the physical bound beside every figure (`bounds`),
//! the one place a model's speed is measured (`measure`), what they read off a started model
//! (`running`), the report directory (`output`), the SVG plots (`plot`) and where a decode
//! step's time goes (`phases`, from the engine's trace); corpora are read by
//! `runtime::corpus`, as `profile` reads them. The CLI (`cli/bench.rs`) dispatches and prints the results; nothing here
//! imports `cli` or prints a result (progress and warnings go to stderr).

pub mod attention;
pub mod bounds;
pub mod contexts;
pub mod decode;
pub mod experts;
pub mod matvec;
pub mod measure;
pub mod output;
pub mod phases;
pub mod plot;
pub mod precision;
pub mod running;
pub mod sparse;
pub mod suite;
pub mod units;

pub use bounds::{AboveBound, Bound, Rates, Traffic, hbm_read_rate};
pub use measure::{Measured, measure};
