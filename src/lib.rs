//! gpu-offload: serve language models larger than GPU memory on one consumer GPU.
//!
//! Rooms (see DESIGN.md §3), data flowing downward: `cli` (the command-line edge) → `engine`
//! (a forward pass) → `backend` (where math runs) and `model` (what a model is) → `tensor`.

pub mod backend;
pub mod bench;
pub mod cli;
pub mod engine;
pub mod footprint;
pub mod fsutil;
pub mod hw;
pub mod kv;
pub mod model;
pub mod plan;
pub mod service;
pub mod sparsity;
pub mod store;
pub mod tensor;
pub mod tier;
