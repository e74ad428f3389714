//! The kernel modules: PTX built by build.rs with nvcc, or CUDA source compiled here with NVRTC
//! when the build machine had no nvcc. Each module is loaded the first time it is needed.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaModule};
use cudarc::nvrtc::{CompileOptions, Ptx};

use crate::backend::{BackendError, Result};

/// How a module ships in the binary.
pub enum KernelSource {
    Ptx(&'static str),
    Cuda(&'static str),
}

mod generated {
    use super::KernelSource;
    include!(concat!(env!("OUT_DIR"), "/kernels.rs"));
}

pub use generated::{COMPILED_WITH_NVCC, MODULES, PTX_ARCH, SOURCES};

/// Compile one module's source with NVRTC for `arch` (e.g. `compute_90`).
pub fn nvrtc_compile(name: &str, src: &str, arch: &str) -> Result<Ptx> {
    // NVRTC wants a 'static arch string; there are only a few distinct ones per process.
    let arch: &'static str = Box::leak(arch.to_string().into_boxed_str());
    cudarc::nvrtc::compile_ptx_with_opts(
        src,
        CompileOptions {
            arch: Some(arch),
            name: Some(format!("{name}.cu")),
            ..Default::default()
        },
    )
    .map_err(|e| BackendError::Device(format!("NVRTC compiling {name}.cu: {e:?}")))
}

/// The compute capability (e.g. 80) this build's PTX is for, if the build carries PTX.
fn ptx_capability() -> Option<u32> {
    PTX_ARCH.strip_prefix("compute_")?.parse().ok()
}

/// Whether every kernel this build loads on a device of compute capability `major`.x waits for
/// the grid before it (`grid_dependency` in kernels/common.cuh does from compute_90 on): only
/// then may kernels be launched with programmatic stream serialization. PTX built for an older
/// target compiles the wait away; sources compiled here by NVRTC target the device itself.
pub fn kernels_wait_for_grids(major: i32) -> bool {
    major >= 9
        && MODULES.iter().all(|(_, s)| match s {
            KernelSource::Ptx(_) => ptx_capability().is_some_and(|c| c >= 90),
            KernelSource::Cuda(_) => true,
        })
}

/// Whether NVRTC can be loaded here.
pub fn nvrtc_present() -> bool {
    // SAFETY: only dlopens NVRTC.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// How this build carries its kernels, for `doctor`.
pub fn build_info() -> String {
    if COMPILED_WITH_NVCC {
        format!("PTX built by nvcc for {PTX_ARCH}")
    } else if MODULES
        .iter()
        .any(|(_, s)| matches!(s, KernelSource::Ptx(_)))
    {
        format!("PTX for {PTX_ARCH} for some modules, CUDA source (NVRTC at run time) for the rest")
    } else {
        "CUDA source, compiled with NVRTC at run time".into()
    }
}

/// Loaded modules by name.
#[derive(Default)]
pub struct Modules {
    loaded: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
}

impl Modules {
    pub fn get(&self, ctx: &Arc<CudaContext>, name: &'static str) -> Result<Arc<CudaModule>> {
        let mut loaded = self
            .loaded
            .lock()
            .map_err(|_| BackendError::Device("module cache poisoned".into()))?;
        if let Some(m) = loaded.get(name) {
            return Ok(m.clone());
        }
        let (_, source) = MODULES
            .iter()
            .find(|(n, _)| *n == name)
            .ok_or_else(|| BackendError::Device(format!("no kernel module `{name}`")))?;
        let ptx = match source {
            KernelSource::Ptx(text) => Ptx::from_src(*text),
            KernelSource::Cuda(src) => {
                if !nvrtc_present() {
                    return Err(BackendError::Unavailable(
                        "kernels were built without nvcc and NVRTC is not installed: rebuild with NVCC set, or install NVRTC".into(),
                    ));
                }
                let (major, minor) = ctx
                    .compute_capability()
                    .map_err(|e| BackendError::Device(format!("{e:?}")))?;
                let arch: &'static str =
                    Box::leak(format!("compute_{major}{minor}").into_boxed_str());
                cudarc::nvrtc::compile_ptx_with_opts(
                    src,
                    CompileOptions {
                        arch: Some(arch),
                        name: Some(format!("{name}.cu")),
                        ..Default::default()
                    },
                )
                .map_err(|e| BackendError::Device(format!("NVRTC compiling {name}.cu: {e:?}")))?
            }
        };
        let module = ctx.load_module(ptx).map_err(|e| {
            BackendError::Device(format!("loading kernel module {name} ({PTX_ARCH}): {e:?}"))
        })?;
        loaded.insert(name, module.clone());
        Ok(module)
    }
}

#[cfg(test)]
mod tests {
    use super::super::launches::{KERNELS, Param};
    use super::*;

    /// Every kernel's body starts with `grid_dependency();`, or with one of the matvec helpers
    /// `grid_dependency_after_*` that ask L2 for weight rows first and then call it: a kernel
    /// launched with programmatic stream serialization that did not wait would run beside the
    /// kernel before it.
    #[test]
    fn every_kernel_waits_for_the_grid_before_it() {
        let mut kernels = 0;
        let mut helpers = 0;
        for (name, src) in SOURCES {
            let mut rest = *src;
            while let Some(at) = rest.find("void grid_dependency_after_") {
                let def = &rest[at..];
                let body = &def[..def.find("\n}\n").unwrap_or(def.len())];
                assert!(
                    body.contains("grid_dependency();"),
                    "{name}: {} does not end in grid_dependency()",
                    &def[..def.find('(').unwrap_or(def.len())]
                );
                helpers += 1;
                rest = &def[body.len()..];
            }
            let mut rest = *src;
            while let Some(at) = rest.find("extern \"C\" __global__") {
                let decl = &rest[at..];
                let open = decl
                    .find('{')
                    .unwrap_or_else(|| panic!("{name}: a kernel without a body"));
                let body =
                    decl[open + 1..].trim_start_matches(|c: char| c.is_whitespace() || c == '\\');
                let head = decl[..open]
                    .split_whitespace()
                    .collect::<Vec<_>>()
                    .join(" ");
                assert!(
                    body.starts_with("grid_dependency();")
                        || body.starts_with("grid_dependency_after_"),
                    "{name}: kernel `{}` does not call grid_dependency() first",
                    head.chars().take(100).collect::<String>()
                );
                kernels += 1;
                rest = &decl[open..];
            }
        }
        assert!(kernels >= 30, "found only {kernels} kernels");
        assert!(
            helpers >= 2,
            "found only {helpers} grid_dependency_after_ helpers"
        );
    }

    /// The run-time compilation path (builds without nvcc) compiles every module. NVRTC needs
    /// no GPU; where it is not installed the test says so and skips.
    #[test]
    fn nvrtc_compiles_every_module() {
        if !nvrtc_present() {
            assert!(
                std::env::var_os("GPU_OFFLOAD_REQUIRE_NVRTC").is_none(),
                "GPU_OFFLOAD_REQUIRE_NVRTC is set but NVRTC cannot be loaded"
            );
            eprintln!("skipped: NVRTC not found (scripts/check-kernels.sh provides it)");
            return;
        }
        let mut entries = 0;
        for (name, src) in SOURCES {
            let ptx = nvrtc_compile(name, src, "compute_80").unwrap_or_else(|e| panic!("{e}"));
            let found = ptx_entries(&ptx.to_src());
            assert!(!found.is_empty(), "{name}: no kernels in the PTX");
            launches_match_ptx(name, &found);
            entries += found.len();
        }
        assert_eq!(SOURCES.len(), MODULES.len());
        // And no launch function is left for a kernel the PTX lacks.
        assert_eq!(entries, KERNELS.len(), "launch functions without a kernel");
    }

    #[test]
    fn the_ptx_check_reads_entries_and_refuses_a_mismatch() {
        let ptx = ".visible .entry rms_norm(\n\t.param .u64 .ptr .align 1 rms_norm_param_0,\n\t\
                   .param .u64 .ptr .align 1 rms_norm_param_1,\n\t.param .f32 rms_norm_param_2,\n\t\
                   .param .u64 .ptr .align 1 rms_norm_param_3,\n\t.param .u32 rms_norm_param_4\n)\n{\n}\n\
                   .visible .entry matvec_f16_parts(\n\t.param .align 8 .b8 matvec_f16_parts_param_0[136],\n\t\
                   .param .u32 matvec_f16_parts_param_1,\n\t.param .u64 matvec_f16_parts_param_2,\n\t\
                   .param .u32 matvec_f16_parts_param_3\n)\n";
        let entries = ptx_entries(ptx);
        use PtxParam::*;
        assert_eq!(entries[0].0, "rms_norm");
        assert_eq!(entries[0].1, [Int(8), Int(8), Float(4), Int(8), Int(4)]);
        assert_eq!(entries[1].1, [Aggregate(136), Int(4), Int(8), Int(4)]);
        launches_match_ptx("norm", &entries[..1]);
        launches_match_ptx("matvec", &entries[1..]);
        // A `long long` where the launch passes an `int`, a parameter short, a float for an
        // int, a kernel of another module, a kernel without a launch: each refused.
        let wrong: [(&str, &str, Vec<PtxParam>); 5] = [
            (
                "norm",
                "rms_norm",
                vec![Int(8), Int(8), Float(4), Int(8), Int(8)],
            ),
            ("norm", "rms_norm", vec![Int(8), Int(8), Float(4), Int(8)]),
            (
                "norm",
                "rms_norm",
                vec![Int(8), Int(8), Int(4), Int(8), Int(4)],
            ),
            (
                "rope",
                "rms_norm",
                vec![Int(8), Int(8), Float(4), Int(8), Int(4)],
            ),
            (
                "norm",
                "rms_norm_v2",
                vec![Int(8), Int(8), Float(4), Int(8), Int(4)],
            ),
        ];
        for (module, name, params) in wrong {
            let entry = [(name.to_string(), params)];
            let refused = std::panic::catch_unwind(|| launches_match_ptx(module, &entry));
            assert!(refused.is_err(), "{module}.{name} {:?} passed", entry[0].1);
        }
    }

    /// A PTX parameter: its bytes, and whether it is a float, an integer (pointers included)
    /// or an aggregate (a struct passed by value).
    #[derive(Debug, PartialEq, Clone, Copy)]
    enum PtxParam {
        Int(usize),
        Float(usize),
        Aggregate(usize),
    }

    /// Every `.entry` of `ptx`: its name and parameters.
    fn ptx_entries(ptx: &str) -> Vec<(String, Vec<PtxParam>)> {
        let mut out = Vec::new();
        for part in ptx.split(".entry ").skip(1) {
            let open = part.find('(').expect("entry parameters");
            let close = part.find(')').expect("entry parameters");
            let name = part[..open].trim().to_string();
            let params = part[open + 1..close]
                .split(',')
                .map(str::trim)
                .filter(|p| !p.is_empty())
                .map(|p| {
                    let words: Vec<&str> = p.split_whitespace().collect();
                    assert_eq!(words[0], ".param", "{name}: {p}");
                    if let Some(n) = p.rsplit_once('[') {
                        let bytes = n.1.trim_end_matches(']').parse().expect("array size");
                        return PtxParam::Aggregate(bytes);
                    }
                    let ty = words[1];
                    let bits: usize = ty[2..].parse().unwrap_or_else(|_| panic!("{name}: {p}"));
                    match &ty[..2] {
                        ".f" => PtxParam::Float(bits / 8),
                        ".u" | ".s" | ".b" => PtxParam::Int(bits / 8),
                        _ => panic!("{name}: parameter {p}"),
                    }
                })
                .collect();
            out.push((name, params));
        }
        out
    }

    /// Each of `module`'s PTX entries has a launch function with its parameters, in its order.
    fn launches_match_ptx(module: &str, entries: &[(String, Vec<PtxParam>)]) {
        for (name, params) in entries {
            let (m, _, launched) = KERNELS
                .iter()
                .find(|(_, n, _)| n == name)
                .unwrap_or_else(|| panic!("kernel `{name}` has no launch function"));
            assert_eq!(*m, module, "{name}");
            let as_ptx: Vec<PtxParam> = launched
                .iter()
                .map(|p| match p {
                    Param::F32 => PtxParam::Float(4),
                    Param::MatvecParts => PtxParam::Aggregate(p.bytes()),
                    _ => PtxParam::Int(p.bytes()),
                })
                .collect();
            assert_eq!(
                &as_ptx, params,
                "{module}.{name}: launch parameters against the PTX"
            );
        }
    }
}
