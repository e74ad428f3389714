//! gpu-offload: serve language models larger than GPU memory on one consumer GPU.
//!
//! Rooms (the README's "Where things are"), data flowing downward, no room importing one above
//! it (`tests/house.rs` holds the order): `cli`, `service`, `bench` on top; `runtime` (assembling
//! engines); `kv`, `tier`, `plan`, `sparsity`; `engine` (a forward pass); `backend` (where math
//! runs); `footprint`, `store`, `model`, `tensor`, `fsutil`, `limits`, `fault` at the bottom.

pub mod backend;
pub mod bench;
pub mod cli;
pub mod engine;
pub mod fault;
pub mod footprint;
pub mod fsutil;
pub mod kv;
pub mod limits;
pub mod model;
pub mod plan;
pub mod runtime;
pub mod service;
pub mod sparsity;
pub mod store;
pub mod tensor;
pub mod tier;
