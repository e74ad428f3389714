//! What the kernels take, as the launches pass it: device addresses as `u64`, the codes of
//! formats, activations and RoPE pairings, the weights of a parts launch by value
//! (`MatvecParts` in kernels/matvec.cu), and the launch grids the ops share.

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, LaunchConfig};

use crate::backend::{Act, RopePairs};
use crate::tensor::DType;

/// Rows (warps) per matvec block (WARPS in kernels/matvec.cu, bundles.cu).
pub(super) const WARPS: u32 = 8;

/// Weights one parts launch takes (MAX_PARTS in kernels/matvec.cu).
pub(super) const MAX_PARTS: usize = 4;

/// One weight of a parts launch (`MatvecPart` in kernels/matvec.cu).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(super) struct MatvecPart {
    pub(super) w: u64,
    pub(super) out: u64,
    pub(super) dtype: i32,
    pub(super) rows: i32,
    pub(super) stride: i32,
    pub(super) col0: i32,
}

/// The weights of one parts launch, passed by value (`MatvecParts` in kernels/matvec.cu).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(super) struct MatvecParts {
    pub(super) part: [MatvecPart; MAX_PARTS],
    pub(super) count: i32,
}

const _: () = assert!(std::mem::size_of::<MatvecPart>() == 32);
const _: () = assert!(std::mem::size_of::<MatvecParts>() == 136);

/// Typed `u64` device addresses: kernel arguments with offsets computed on the host.
pub(super) fn ptr_of<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    let (p, _sync) = s.device_ptr(stream);
    p
}

pub(super) fn dtype_code(d: DType) -> i32 {
    match d {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
        DType::Q8_0 => 3,
        DType::Q4_0 => 4,
        DType::Q4_1 => 5,
        DType::Q5_0 => 6,
        DType::Q5_1 => 7,
        DType::Q2K => 8,
        DType::Q3K => 9,
        DType::Q4K => 10,
        DType::Q5K => 11,
        DType::Q6K => 12,
    }
}

pub(super) fn pairs_code(p: RopePairs) -> i32 {
    match p {
        RopePairs::Adjacent => 0,
        RopePairs::Halves => 1,
    }
}

pub(super) fn act_code(a: Act) -> i32 {
    match a {
        Act::Silu => 0,
        Act::Relu => 1,
        Act::Gelu => 2,
        Act::GeluTanh => 3,
    }
}

pub(super) fn blocks(n: usize, per: u32) -> u32 {
    (n as u64).div_ceil(per as u64).max(1) as u32
}

pub(super) fn cfg(grid: u32, block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Elementwise launch over `n` values.
pub(super) fn elementwise_cfg(n: usize) -> LaunchConfig {
    cfg(blocks(n, 256), 256)
}

/// Elementwise launch over the largest of `tensors` tensors' `n` values: blockIdx.y picks
/// the tensor (the pair kernels).
pub(super) fn pair_cfg(n: usize, tensors: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks(n, 256), tensors, 1),
        ..cfg(1, 256)
    }
}
