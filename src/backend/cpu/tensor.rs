//! The CPU backend's activations ([`CpuTensor`]): `rows × cols` f32 values in host memory,
//! what every CPU op reads and writes (the KV cache stores its rows from one).

/// Activations on the CPU.
#[derive(Clone, Debug)]
pub struct CpuTensor {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
    /// Values allocated (what [`Backend::reshape`](crate::backend::Backend::reshape) may use).
    pub capacity: usize,
}
