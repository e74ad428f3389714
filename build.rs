//! Compiles `kernels/*.cu` to PTX with nvcc when one is found (`NVCC`, `PATH`, `CUDA_PATH`,
//! `/usr/local/cuda`), for `compute_80` or `CUDA_COMPUTE_CAP` (e.g. `90`), host compiler from
//! `NVCC_CCBIN`. Without nvcc (or when it fails) the sources are embedded instead and the CUDA
//! backend compiles them at run time with NVRTC. Either way the crate builds without CUDA.
//! Writes `$OUT_DIR/kernels.rs`: `MODULES: &[(name, KernelSource)]` and `SOURCES` (every
//! module's self-contained CUDA source, for NVRTC); and `$OUT_DIR/launches.rs`: one typed launch
//! function per kernel, read from the kernels' signatures (see `kernel_signatures`), so that
//! rustc checks every launch's arguments against the kernel it launches.

use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

fn find_nvcc() -> Option<PathBuf> {
    if let Some(p) = env::var_os("NVCC") {
        return Some(PathBuf::from(p));
    }
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(path) = env::var_os("PATH") {
        candidates.extend(env::split_paths(&path).map(|d| d.join("nvcc")));
    }
    for var in ["CUDA_PATH", "CUDA_HOME", "CUDA_ROOT"] {
        if let Some(d) = env::var_os(var) {
            candidates.push(PathBuf::from(d).join("bin").join("nvcc"));
        }
    }
    candidates.push(PathBuf::from("/usr/local/cuda/bin/nvcc"));
    candidates.into_iter().find(|p| p.is_file())
}

/// The source with each `#include "x.cuh"` replaced by that header from `dir`, recursively and
/// once per header (`#pragma once`), so NVRTC gets one self-contained string.
fn inline_headers(src: &str, dir: &Path, seen: &mut Vec<String>) -> String {
    let mut out = String::with_capacity(src.len());
    for line in src.lines() {
        let header = line
            .trim()
            .strip_prefix("#include \"")
            .and_then(|rest| rest.strip_suffix('"'))
            .filter(|h| h.ends_with(".cuh"));
        match header {
            Some(h) => {
                if !seen.iter().any(|s| s == h) {
                    seen.push(h.to_string());
                    let text = fs::read_to_string(dir.join(h)).expect("kernel header");
                    out.push_str(&inline_headers(
                        &text.replace("#pragma once", ""),
                        dir,
                        seen,
                    ));
                }
            }
            None => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    out
}

/// A kernel parameter's type as a launch passes it.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Param {
    /// Any pointer: a device address.
    Ptr,
    I32,
    U32,
    I64,
    U64,
    F32,
    /// `MatvecParts`, passed by value (src/backend/cuda/mod.rs mirrors its layout).
    MatvecParts,
}

impl Param {
    fn of(c_type: &str, what: &str) -> Param {
        if c_type.contains('*') {
            return Param::Ptr;
        }
        let t: Vec<&str> = c_type
            .split_whitespace()
            .filter(|w| *w != "const")
            .collect();
        match t.join(" ").as_str() {
            "int" => Param::I32,
            "unsigned" | "unsigned int" | "u32" => Param::U32,
            "long long" => Param::I64,
            "unsigned long long" | "u64" => Param::U64,
            "float" => Param::F32,
            "MatvecParts" => Param::MatvecParts,
            other => {
                panic!("{what}: kernel parameter type `{other}` has no launch type in build.rs")
            }
        }
    }

    fn rust(self) -> &'static str {
        match self {
            Param::Ptr | Param::U64 => "u64",
            Param::I32 => "i32",
            Param::U32 => "u32",
            Param::I64 => "i64",
            Param::F32 => "f32",
            Param::MatvecParts => "MatvecParts",
        }
    }
}

/// One `extern "C" __global__` kernel: its name and parameters (name, type).
struct Kernel {
    name: String,
    params: Vec<(String, Param)>,
}

/// `s` without comments, macro line continuations joined.
fn strip_comments(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i..].starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i..].starts_with(b"/*") {
            i += 2;
            while i + 1 < b.len() && !b[i..].starts_with(b"*/") {
                i += 1;
            }
            i += 2;
        } else if b[i] == b'"' {
            let start = i;
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += 1;
            }
            i += 1;
            out.push_str(&s[start..i.min(b.len())]);
        } else {
            let c = s[i..].chars().next().expect("char");
            out.push(c);
            i += c.len_utf8();
        }
    }
    out.replace("\\\n", " ")
}

/// The text inside the parenthesis opening at `s[open]`, and the index past its close.
fn balanced(s: &str, open: usize, what: &str) -> (String, usize) {
    let mut depth = 0;
    for (i, c) in s[open..].char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth == 0 {
                    return (s[open + 1..open + i].to_string(), open + i + 1);
                }
            }
            _ => {}
        }
    }
    panic!("{what}: unbalanced parenthesis")
}

/// `s` split at the commas outside parentheses, each part trimmed.
fn split_top(s: &str) -> Vec<String> {
    let (mut parts, mut depth, mut cur) = (Vec::new(), 0, String::new());
    for c in s.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(cur.trim().to_string());
                cur.clear();
                continue;
            }
            _ => {}
        }
        cur.push(c);
    }
    if !cur.trim().is_empty() {
        parts.push(cur.trim().to_string());
    }
    parts
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Every `extern "C" __global__` signature in `code` (comment-free, macros expanded).
fn signatures(code: &str, what: &str) -> Vec<Kernel> {
    let mut out = Vec::new();
    let marker = "extern \"C\" __global__";
    let mut at = 0;
    while let Some(found) = code[at..].find(marker) {
        // The offset of `rest` (a suffix of `code`).
        let offset = |rest: &str| code.len() - rest.len();
        let after_marker = code[at + found + marker.len()..].trim_start();
        let rest = after_marker
            .strip_prefix("void")
            .unwrap_or_else(|| panic!("{what}: a kernel not returning void"))
            .trim_start();
        let mut i = offset(rest);
        if rest.starts_with("__launch_bounds__") {
            let open = i + code[i..].find('(').expect("launch bounds");
            i = offset(code[balanced(code, open, what).1..].trim_start());
        }
        let open = i + code[i..]
            .find('(')
            .unwrap_or_else(|| panic!("{what}: kernel without parameters"));
        let name = code[i..open].trim().replace(' ', "");
        assert!(
            name.chars().all(is_ident) && !name.is_empty(),
            "{what}: kernel name `{name}`"
        );
        let (list, end) = balanced(code, open, what);
        let params = split_top(&list)
            .into_iter()
            .map(|p| {
                let cut = p
                    .trim_end()
                    .rfind(|c: char| !is_ident(c))
                    .unwrap_or_else(|| panic!("{what}: {name}: parameter `{p}`"));
                let (ty, pname) = (&p[..=cut], p[cut + 1..].trim());
                (pname.to_string(), Param::of(ty, &format!("{what}: {name}")))
            })
            .collect();
        out.push(Kernel { name, params });
        at = end;
    }
    out
}

/// The kernels of one `.cu` file: those written out, and those its function-like macros
/// (`#define FAMILY(a, b) ... extern "C" __global__ ...`) define where they are invoked.
fn kernel_signatures(src: &str, what: &str) -> Vec<Kernel> {
    let code = strip_comments(src);
    let mut families: Vec<(String, Vec<String>, String)> = Vec::new();
    let mut plain = String::new();
    for line in code.lines() {
        let t = line.trim_start();
        if let Some(def) = t.strip_prefix("#define ") {
            let def = def.trim_start();
            let name_end = def.find(|c: char| !is_ident(c)).unwrap_or(def.len());
            if def[name_end..].starts_with('(') && def.contains("__global__") {
                let (params, body_at) = balanced(def, name_end, what);
                let params = split_top(&params);
                families.push((
                    def[..name_end].to_string(),
                    params,
                    def[body_at..].to_string(),
                ));
            }
            continue;
        }
        plain.push_str(line);
        plain.push('\n');
    }
    let mut kernels = signatures(&plain, what);
    for (family, params, body) in &families {
        let mut at = 0;
        while let Some(found) = plain[at..].find(family.as_str()) {
            let start = at + found;
            let after = start + family.len();
            let bounded = !plain[..start].ends_with(is_ident) && plain[after..].starts_with('(');
            if !bounded {
                at = after;
                continue;
            }
            let (args, end) = balanced(&plain, after, what);
            let args = split_top(&args);
            assert_eq!(
                args.len(),
                params.len(),
                "{what}: {family} invoked with {} arguments",
                args.len()
            );
            // Substitute whole identifiers, then paste tokens joined by ##.
            let mut expanded = String::new();
            let mut word = String::new();
            for c in body.chars().chain(std::iter::once(' ')) {
                if is_ident(c) {
                    word.push(c);
                    continue;
                }
                match params.iter().position(|p| *p == word) {
                    Some(k) => expanded.push_str(&args[k]),
                    None => expanded.push_str(&word),
                }
                word.clear();
                expanded.push(c);
            }
            let pasted: String = {
                let mut s = expanded;
                while let Some(k) = s.find("##") {
                    let left = s[..k].trim_end().len();
                    let right = k + 2 + (s[k + 2..].len() - s[k + 2..].trim_start().len());
                    s = format!("{}{}", &s[..left], &s[right..]);
                }
                s
            };
            kernels.extend(signatures(&pasted, &format!("{what}: {family}")));
            at = end;
        }
    }
    kernels
}

/// Rust spelling of a C parameter name (keywords raw).
fn rust_ident(name: &str) -> String {
    const KEYWORDS: &[&str] = &[
        "as", "box", "break", "const", "continue", "crate", "dyn", "else", "enum", "extern", "fn",
        "for", "gen", "if", "impl", "in", "let", "loop", "match", "mod", "move", "mut", "pub",
        "ref", "return", "static", "struct", "super", "trait", "type", "unsafe", "use", "where",
        "while", "yield",
    ];
    if KEYWORDS.contains(&name) {
        format!("r#{name}")
    } else {
        name.to_string()
    }
}

/// `$OUT_DIR/launches.rs`: `KERNELS` (every kernel's module, name and parameter types) and one
/// launch function per kernel.
fn write_launches(sources: &[PathBuf], out: &Path) {
    let mut table = String::from(
        "/// Every kernel in kernels/*.cu: (module, name, parameters as launched).\n\
         #[cfg(test)]\n\
         pub(super) const KERNELS: &[(&str, &str, &[Param])] = &[\n",
    );
    let mut names = String::from(
        "// Generated by build.rs from kernels/*.cu.\n\
         /// Every kernel in kernels/*.cu: (module, name); the backend resolves them all at start,\n\
         /// so their code is loaded (and counted in the fixed cost) before the arena is sized.\n\
         pub const KERNEL_NAMES: &[(&str, &str)] = &[\n",
    );
    let mut fns = String::new();
    let mut seen = std::collections::BTreeSet::new();
    for src in sources {
        let module = src
            .file_stem()
            .expect("stem")
            .to_string_lossy()
            .into_owned();
        let text = fs::read_to_string(src).expect("kernel source");
        for k in kernel_signatures(&text, &src.display().to_string()) {
            assert!(
                seen.insert(k.name.clone()),
                "kernel `{}` defined twice",
                k.name
            );
            let kinds: Vec<String> = k
                .params
                .iter()
                .map(|(_, p)| format!("Param::{p:?}"))
                .collect();
            let _ = writeln!(names, "    ({module:?}, {:?}),", k.name);
            let _ = writeln!(
                table,
                "    ({module:?}, {:?}, &[{}]),",
                k.name,
                kinds.join(", ")
            );
            let args: Vec<String> = k
                .params
                .iter()
                .map(|(n, p)| format!("{}: {}", rust_ident(n), p.rust()))
                .collect();
            let c_params: Vec<String> = k.params.iter().map(|(n, _)| n.clone()).collect();
            let refs: Vec<String> = k
                .params
                .iter()
                .map(|(n, _)| format!("param(&{})", rust_ident(n)))
                .collect();
            let _ = write!(
                fns,
                "/// `{name}({cparams})` in kernels/{module}.cu.\n\
                 #[allow(clippy::too_many_arguments)]\n\
                 pub(super) fn {name}(l: Launch<'_>, {args}) -> Result<()> {{\n    \
                 l.run({module:?}, {name:?}, &mut [{refs}])\n}}\n\n",
                name = k.name,
                cparams = c_params.join(", "),
                args = args.join(", "),
                refs = refs.join(", "),
            );
        }
    }
    table.push_str("];\n\n");
    names.push_str("];\n");
    fs::write(out.join("kernel_names.rs"), names).expect("write kernel_names.rs");
    fs::write(
        out.join("launches.rs"),
        format!("// Generated by build.rs from kernels/*.cu.\n{table}{fns}"),
    )
    .expect("write launches.rs");
}

fn main() {
    let dir = Path::new("kernels");
    println!("cargo:rerun-if-changed=kernels");
    for var in [
        "NVCC",
        "CUDA_COMPUTE_CAP",
        "NVCC_CCBIN",
        "PATH",
        "CUDA_PATH",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR"));
    let mut sources: Vec<PathBuf> = fs::read_dir(dir)
        .expect("kernels/")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    sources.sort();

    let nvcc = find_nvcc();
    let arch = env::var("CUDA_COMPUTE_CAP")
        .map_or_else(|_| "compute_80".to_string(), |c| format!("compute_{c}"));
    let mut rs = String::from(
        "// Generated by build.rs.\npub const MODULES: &[(&str, KernelSource)] = &[\n",
    );
    let mut compiled = 0;
    let mut inlined = String::from("pub const SOURCES: &[(&str, &str)] = &[\n");
    for src in &sources {
        let name = src
            .file_stem()
            .expect("stem")
            .to_string_lossy()
            .into_owned();
        let cu = out.join(format!("{name}.cu"));
        let text = inline_headers(
            &fs::read_to_string(src).expect("kernel source"),
            dir,
            &mut Vec::new(),
        );
        fs::write(&cu, text).expect("write inlined source");
        let _ = writeln!(
            inlined,
            "    ({name:?}, include_str!({:?})),",
            cu.display().to_string()
        );
        let ptx = out.join(format!("{name}.ptx"));
        let built = nvcc.as_ref().is_some_and(|nvcc| {
            let mut cmd = Command::new(nvcc);
            cmd.args(["--ptx", &format!("-arch={arch}"), "-O3", "-I"])
                .arg(dir)
                .arg(src)
                .arg("-o")
                .arg(&ptx);
            if let Ok(ccbin) = env::var("NVCC_CCBIN") {
                cmd.args(["-ccbin", &ccbin]);
            }
            match cmd.output() {
                Ok(o) if o.status.success() => true,
                Ok(o) => {
                    println!(
                        "cargo:warning=nvcc failed on {} ({}); embedding the source for NVRTC",
                        src.display(),
                        String::from_utf8_lossy(&o.stderr)
                            .lines()
                            .next()
                            .unwrap_or("")
                    );
                    false
                }
                Err(e) => {
                    println!(
                        "cargo:warning=cannot run {}: {e}; embedding sources for NVRTC",
                        nvcc.display()
                    );
                    false
                }
            }
        });
        if built {
            compiled += 1;
            let _ = writeln!(
                rs,
                "    ({name:?}, KernelSource::Ptx(include_str!({:?}))),",
                ptx.display().to_string()
            );
        } else {
            let _ = writeln!(
                rs,
                "    ({name:?}, KernelSource::Cuda(include_str!({:?}))),",
                cu.display().to_string()
            );
        }
    }
    rs.push_str("];\n");
    inlined.push_str("];\n");
    rs.push_str(&inlined);
    let _ = writeln!(rs, "pub const PTX_ARCH: &str = {arch:?};");
    let _ = writeln!(
        rs,
        "pub const COMPILED_WITH_NVCC: bool = {};",
        compiled == sources.len() && compiled > 0
    );
    fs::write(out.join("kernels.rs"), rs).expect("write kernels.rs");
    write_launches(&sources, &out);
}
