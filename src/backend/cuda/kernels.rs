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

include!(concat!(env!("OUT_DIR"), "/kernel_names.rs"));

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

/// How a module reaches a device of compute capability `device` (major · 10 + minor).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModuleLoad {
    /// The build's PTX, which the driver compiles for the device.
    Ptx,
    /// The module's source compiled here by NVRTC for the device itself.
    Nvrtc,
}

/// How a module that ships as `source` loads on a device of compute capability `device`, or why
/// it cannot. PTX loads on devices at least as new as the target it was built for; on an older
/// one (PTX for compute_80 on a Turing card) the embedded source is compiled by NVRTC instead,
/// where NVRTC is installed.
pub fn module_load(
    is_ptx: bool,
    ptx_capability: Option<u32>,
    device: u32,
    nvrtc: bool,
) -> Result<ModuleLoad> {
    if is_ptx && ptx_capability.is_none_or(|c| c <= device) {
        return Ok(ModuleLoad::Ptx);
    }
    if nvrtc {
        return Ok(ModuleLoad::Nvrtc);
    }
    Err(BackendError::Unavailable(
        if let Some(target) = ptx_capability.filter(|_| is_ptx) {
            format!(
                "the kernels are PTX for compute_{target}, which a device of compute capability {}.{} cannot              load: rebuild with CUDA_COMPUTE_CAP={device} (or without nvcc, so they compile at              run time), or install NVRTC to compile them for this device",
                device / 10,
                device % 10
            )
        } else {
            "kernels were built without nvcc and NVRTC is not installed: rebuild with NVCC set, or          install NVRTC"
            .into()
        },
    ))
}

/// How this build's kernels reach a device of compute capability `device` (major · 10 + minor),
/// for `doctor`.
pub fn build_info_for(device: u32) -> String {
    let info = build_info();
    let is_ptx = MODULES
        .iter()
        .any(|(_, s)| matches!(s, KernelSource::Ptx(_)));
    match module_load(is_ptx, ptx_capability(), device, nvrtc_present()) {
        Ok(ModuleLoad::Nvrtc) if is_ptx => {
            format!("{info}, newer than this device: NVRTC compiles them for it")
        }
        Ok(_) => info,
        Err(e) => format!("{info}: {e}"),
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
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| BackendError::Device(format!("{e:?}")))?;
        let device = (major * 10 + minor) as u32;
        let is_ptx = matches!(source, KernelSource::Ptx(_));
        let (ptx, built_for) = match (
            source,
            module_load(is_ptx, ptx_capability(), device, nvrtc_present())?,
        ) {
            (KernelSource::Ptx(text), ModuleLoad::Ptx) => (Ptx::from_src(*text), PTX_ARCH),
            (_, _) => {
                let src = SOURCES
                    .iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, s)| *s)
                    .ok_or_else(|| BackendError::Device(format!("no source for `{name}`")))?;
                if is_ptx {
                    tracing::info!(
                        "kernel module {name}: PTX for {PTX_ARCH} is newer than this device                          ({major}.{minor}); compiling it with NVRTC"
                    );
                }
                let arch = format!("compute_{device}");
                (nvrtc_compile(name, src, &arch)?, "NVRTC")
            }
        };
        let module = ctx.load_module(ptx).map_err(|e| {
            BackendError::Device(format!("loading kernel module {name} ({built_for}): {e:?}"))
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
        // Ampere and newer, and Turing (what a build's PTX for compute_80 falls back to there:
        // the flash kernels compile to a trap, everything else as it is).
        for arch in ["compute_80", "compute_75"] {
            let mut entries = 0;
            for (name, src) in SOURCES {
                let ptx = nvrtc_compile(name, src, arch).unwrap_or_else(|e| panic!("{e}"));
                let text = ptx.to_src();
                let found = ptx_entries(&text);
                assert!(
                    !found.is_empty(),
                    "{name}: no kernels in the PTX for {arch}"
                );
                launches_match_ptx(name, &found);
                if arch == "compute_75" {
                    for ampere in ["cp.async", "m16n8k16"] {
                        assert!(!text.contains(ampere), "{name}: {ampere} in PTX for {arch}");
                    }
                }
                entries += found.len();
            }
            assert_eq!(SOURCES.len(), MODULES.len());
            // And no launch function is left for a kernel the PTX lacks.
            assert_eq!(entries, KERNELS.len(), "launch functions without a kernel");
        }
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

    #[test]
    fn ptx_newer_than_the_device_falls_back_to_nvrtc_or_says_how_to_build() {
        // PTX for compute_80: Ampere and newer load it; Turing compiles the source instead.
        for device in [80, 86, 90] {
            assert_eq!(
                module_load(true, Some(80), device, false).unwrap(),
                ModuleLoad::Ptx
            );
        }
        assert_eq!(
            module_load(true, Some(80), 75, true).unwrap(),
            ModuleLoad::Nvrtc
        );
        let e = module_load(true, Some(90), 86, false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("8.6") && e.contains("CUDA_COMPUTE_CAP=86") && e.contains("NVRTC"),
            "{e}"
        );
        // Sources compile for the device, where NVRTC is.
        assert_eq!(
            module_load(false, Some(80), 75, true).unwrap(),
            ModuleLoad::Nvrtc
        );
        let e = module_load(false, None, 90, false).unwrap_err().to_string();
        assert!(e.contains("NVRTC is not installed"), "{e}");
    }
}
