//! A tiny synthetic model on the CPU backend, for the engine's own unit tests (test builds
//! only): what the engine's parts are checked against without the shared test models.

use super::Engine;
use crate::backend::cpu::CpuBackend;
use crate::model::Model;
use crate::model::synth::{SynthSpec, synthesize_gguf};

/// The `tiny` synthetic model (2 layers, `d_model` 64) with 320 tokens (a GGUF vocabulary holds
/// the 256 byte tokens and a few more), in a temporary file that lives as long as this does.
pub(super) struct Tiny {
    pub(super) model: Model,
    _dir: tempfile::TempDir,
}

impl Tiny {
    pub(super) fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.gguf");
        let spec = SynthSpec {
            vocab_size: 320,
            ..SynthSpec::preset("tiny").unwrap()
        };
        synthesize_gguf(&spec, &path, false, None, &mut |_, _| {}).unwrap();
        Tiny {
            model: Model::load(&path).unwrap(),
            _dir: dir,
        }
    }

    /// An engine of the model on one CPU thread.
    pub(super) fn engine(&self) -> Engine<CpuBackend> {
        let b = CpuBackend::new(1).unwrap();
        Engine::new(b, self.model.spec.clone(), &self.model.weights).unwrap()
    }
}
