//! gpu-offload: serve language models larger than GPU memory on one consumer GPU.
//!
//! Rooms (see DESIGN.md §3): `model` (what a model is), `backend` (where math runs), `engine`
//! (a forward pass), `cli` (the command-line edge).

pub mod model;
pub mod tensor;
