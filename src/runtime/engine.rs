//! The engine of a run on whichever backend the flags chose, and [`with_engine!`] to run code on
//! it whatever the backend.

use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::CudaBackend;
use crate::backend::sim::SimBackend;
use crate::engine::Engine;

/// An engine on whichever backend the flags chose.
#[allow(clippy::large_enum_variant)] // one per process; boxing buys nothing
pub enum AnyEngine {
    Cpu(Engine<CpuBackend>),
    Sim(Engine<SimBackend>),
    Cuda(Engine<CudaBackend>),
}

/// Run `$body` with `$e` bound to the engine, whatever its backend.
macro_rules! with_engine {
    ($any:expr, $e:ident => $body:expr) => {
        match $any {
            $crate::runtime::AnyEngine::Cpu($e) => $body,
            $crate::runtime::AnyEngine::Sim($e) => $body,
            $crate::runtime::AnyEngine::Cuda($e) => $body,
        }
    };
}
pub(crate) use with_engine;
