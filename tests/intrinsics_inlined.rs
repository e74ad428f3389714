//! The CPU kernels' SIMD intrinsics are inlined into the kernels, in the built binary.
//!
//! An intrinsic is a function with its target features; the compiler inlines it only into a
//! function that has them. A kernel that hands an intrinsic to a generic helper of `core`
//! (`std::array::from_fn`, `[T; N]::map`) works while the helper is inlined into the kernel;
//! where LLVM leaves the helper out of line, every intrinsic in it becomes a call that passes its
//! registers through memory. Whether that happens moves with unrelated code: at 15c43bc it did in
//! the Q8_0 tile kernel, and the SmolLM2 head took 4 ms a token instead of 1 with no test
//! failing. The kernels build such arrays with their own loop (`kernels::lanes!`); this test
//! reads the disassembly and fails on any out-of-line call to an intrinsic from our code, or
//! from a `core` helper our code calls.
//!
//! `GPU_OFFLOAD_INLINED_BIN=target/release/gpu-offload cargo test --test intrinsics_inlined`
//! checks another build (the release binary) the same way.

#![cfg(target_arch = "x86_64")]

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::process::Command;

/// A function of the disassembly: its name, and the start addresses of the functions it calls
/// (or jumps to).
struct Function {
    name: String,
    calls: Vec<u64>,
}

/// Every function of `text` (`objdump -d -C --no-show-raw-insn`) by start address.
fn functions(text: &str) -> HashMap<u64, Function> {
    let mut all = HashMap::new();
    let mut at = None;
    for line in text.lines() {
        // A function's header: `0000000000401000 <name>:`.
        if let Some(head) = line.strip_suffix(">:")
            && let Some((addr, name)) = head.split_once(" <")
            && let Ok(addr) = u64::from_str_radix(addr, 16)
        {
            all.insert(
                addr,
                Function {
                    name: name.to_string(),
                    calls: Vec::new(),
                },
            );
            at = Some(addr);
            continue;
        }
        // `  401006:\tcall   401100 <name>` (a jump inside a function names `<name+0x..>`).
        let Some(f) = at.and_then(|a| all.get_mut(&a)) else {
            continue;
        };
        let Some((_, ins)) = line.split_once(":\t") else {
            continue;
        };
        let mut words = ins.split_whitespace();
        if !matches!(words.next(), Some("call" | "jmp")) {
            continue;
        }
        let Some(target) = words.next().and_then(|t| u64::from_str_radix(t, 16).ok()) else {
            continue;
        };
        if ins.ends_with('>') && !ins.contains("+0x") {
            f.calls.push(target);
        }
    }
    all
}

/// An intrinsic left out of line: the SIMD functions of `core::arch` (not `_xgetbv`, which the
/// feature detection of `std` and of dependencies calls as a function).
fn is_intrinsic(name: &str) -> bool {
    name.starts_with("core::core_arch::") && !name.contains("::xsave::")
}

fn ours(name: &str) -> bool {
    name.contains("gpu_offload::")
}

/// "caller → intrinsic" for every out-of-line intrinsic called from our code or from a function
/// our code calls.
fn offences(all: &HashMap<u64, Function>) -> Vec<String> {
    let mut callers: HashMap<u64, Vec<&str>> = HashMap::new();
    for f in all.values() {
        for &c in &f.calls {
            callers.entry(c).or_default().push(&f.name);
        }
    }
    let mut found = Vec::new();
    for (addr, f) in all {
        for c in &f.calls {
            let Some(callee) = all.get(c).filter(|g| is_intrinsic(&g.name)) else {
                continue;
            };
            let via: BTreeSet<&str> = callers
                .get(addr)
                .map(|cs| cs.iter().copied().filter(|n| ours(n)).collect())
                .unwrap_or_default();
            if ours(&f.name) {
                found.push(format!("{} → {}", f.name, callee.name));
            } else if !via.is_empty() {
                found.push(format!(
                    "{} (called from {}) → {}",
                    f.name,
                    Vec::from_iter(via).join(", "),
                    callee.name
                ));
            }
        }
    }
    found.sort();
    found.dedup();
    found
}

#[test]
fn kernels_call_no_intrinsic_out_of_line() {
    let bin = std::env::var_os("GPU_OFFLOAD_INLINED_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_gpu-offload")));
    let out = Command::new("objdump")
        .args(["-d", "-C", "--no-show-raw-insn"])
        .arg(&bin)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "objdump (binutils) is needed to read {}: {e}",
                bin.display()
            )
        });
    assert!(
        out.status.success(),
        "objdump {}: {}",
        bin.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let all = functions(&text);
    // The kernels are in the binary: the check reads real code, not an empty listing.
    assert!(
        all.values()
            .any(|f| f.name.contains("gpu_offload::backend::cpu::kernels::avx2")),
        "no AVX2 kernel in the disassembly of {}",
        bin.display()
    );
    let found = offences(&all);
    assert!(
        found.is_empty(),
        "intrinsics called out of line in {} (build the array with `kernels::lanes!`, not a \
         closure handed to a generic helper):\n{}",
        bin.display(),
        found.join("\n")
    );
}

#[test]
fn a_helper_left_out_of_line_is_found() {
    // Headers and calls as objdump prints them: our kernel calls `try_from_fn`, which calls
    // the intrinsic; a dependency's helper does the same (not ours: not reported); std's
    // feature detection calls `_xgetbv` (not an offence).
    let text = "\
0000000000001000 <gpu_offload::backend::cpu::kernels::avx512::tile_t>:
    1004:\tcall   2000 <core::array::try_from_fn>
    1008:\tjmp    1004 <gpu_offload::backend::cpu::kernels::avx512::tile_t+0x4>
0000000000002000 <core::array::try_from_fn>:
    2004:\tcall   3000 <core::core_arch::x86::avx512f::_mm512_xor_si512>
0000000000003000 <core::core_arch::x86::avx512f::_mm512_xor_si512>:
    3004:\tret
0000000000004000 <aho_corasick::packed::teddy::Slim::new>:
    4004:\tcall   5000 <core::array::<impl [T; N]>::try_map>
0000000000005000 <core::array::<impl [T; N]>::try_map>:
    5004:\tjmp    6000 <core::core_arch::x86::avx::_mm256_loadu_si256>
0000000000006000 <core::core_arch::x86::avx::_mm256_loadu_si256>:
    6004:\tret
0000000000007000 <std_detect::detect::cache::detect_and_initialize>:
    7004:\tcall   8000 <core::core_arch::x86::xsave::_xgetbv>
0000000000008000 <core::core_arch::x86::xsave::_xgetbv>:
    8004:\tret
0000000000009000 <gpu_offload::backend::cpu::sparse::x86::dot4_tiled_avx512>:
    9004:\tcall   3000 <core::core_arch::x86::avx512f::_mm512_xor_si512>
";
    let found = offences(&functions(text));
    assert_eq!(
        found,
        [
            "core::array::try_from_fn (called from gpu_offload::backend::cpu::kernels::avx512::tile_t) → core::core_arch::x86::avx512f::_mm512_xor_si512",
            "gpu_offload::backend::cpu::sparse::x86::dot4_tiled_avx512 → core::core_arch::x86::avx512f::_mm512_xor_si512",
        ]
    );
}
