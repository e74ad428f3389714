//! The SSD store through the real binary: convert, verify, plan and offloaded runs; faults
//! (bit flips, truncation, a full disk mid-convert, an unusable directory) are detected and
//! named, and never leave a half-written store that loads.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::*;
use gpu_offload::store::Store;
use serde_json::Value;

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_gpu-offload"));
    for (k, _) in std::env::vars() {
        if k.starts_with("GPU_OFFLOAD_") && k != "GPU_OFFLOAD_MODELS" {
            c.env_remove(k);
        }
    }
    c
}

fn run(c: &mut Command) -> Output {
    c.output().expect("run binary")
}

fn ok(c: &mut Command) -> String {
    let out = run(c);
    assert!(
        out.status.success(),
        "{:?}: {}",
        c,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn fails(c: &mut Command, needles: &[&str]) -> String {
    let out = run(c);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{c:?} succeeded");
    assert!(!err.contains("panicked"), "{c:?} panicked: {err}");
    for n in needles {
        assert!(err.contains(n), "{c:?}: {err:?} does not mention {n:?}");
    }
    err
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn converted(dir: &Path) -> std::path::PathBuf {
    let out = dir.join("store");
    ok(bin().args([
        "convert",
        "-m",
        s(&fixtures().join("hf/llama-gqa")),
        "-o",
        s(&out),
        "--encodings",
        "int8,int4",
    ]));
    out
}

fn sim_run(store: &Path, extra: &[&str]) -> Command {
    run_on("sim", store, extra)
}

/// `run` of `model` on `device`: 6 greedy tokens after 4 given ids, as JSON.
fn run_on(device: &str, model: &Path, extra: &[&str]) -> Command {
    let mut c = bin();
    c.args([
        "run",
        "--device",
        device,
        "-m",
        s(model),
        "--tokens",
        "5,17,99,3",
        "-n",
        "6",
        "--temperature",
        "0",
        "--json",
        "--ignore-eos",
    ]);
    c.args(extra);
    c
}

#[test]
fn convert_verify_and_run_offloaded() {
    let dir = tempfile::tempdir().unwrap();
    let store = converted(dir.path());
    let verified = ok(bin().args(["convert", "--verify", s(&store)]));
    assert!(verified.contains("all checksums match"), "{verified}");
    // Converting over an existing store needs --force.
    fails(
        bin().args([
            "convert",
            "-m",
            s(&fixtures().join("hf/llama-gqa")),
            "-o",
            s(&store),
        ]),
        &["already exists", "--force"],
    );

    // The same greedy tokens dense on the CPU (f32 file) and offloaded from the f16 store.
    let dense: Value = serde_json::from_str(&ok(bin().args([
        "run",
        "-m",
        s(&fixtures().join("hf/llama-gqa")),
        "--tokens",
        "5,17,99,3",
        "-n",
        "6",
        "--temperature",
        "0",
        "--json",
    ])))
    .unwrap();
    let budget = 300 * 1024;
    let offloaded: Value = serde_json::from_str(&ok(&mut sim_run(
        &store,
        &["--gpu-mem", &budget.to_string(), "--prefetch-window", "1"],
    )))
    .unwrap();
    assert_eq!(dense["token_ids"], offloaded["token_ids"]);
    let mem = &offloaded["memory"];
    assert!(mem["gpu_peak_bytes"].as_u64().unwrap() <= budget, "{mem}");
    assert_eq!(
        mem["h2d_bytes_per_token"].as_f64().unwrap(),
        mem["planned"]["h2d_bytes_per_token"].as_f64().unwrap()
    );
    assert!(
        mem["h2d_bytes_per_token"].as_f64().unwrap() > 0.0,
        "something streams at this budget: {mem}"
    );
    // The driver's figure for the process exists only on a GPU.
    assert!(mem["gpu_process_peak_bytes"].is_null(), "{mem}");

    // A store with no device flag runs where it can: on a machine without a GPU, the budgeted
    // device (on one with a GPU, `auto` is CUDA).
    if !gpu_offload::backend::cuda::device_available() {
        let auto: Value = serde_json::from_str(&ok(bin().args([
            "run",
            "-m",
            s(&store),
            "--tokens",
            "5,17,99,3",
            "-n",
            "6",
            "--temperature",
            "0",
            "--json",
        ])))
        .unwrap();
        assert_eq!(dense["token_ids"], auto["token_ids"]);
    }
    // `--device cpu` cannot run a store, and says what can.
    fails(
        bin().args(["run", "--device", "cpu", "-m", s(&store), "--tokens", "5"]),
        &["offload store", "--device sim"],
    );
}

#[test]
fn emulated_cards_cap_memory_and_count_their_fixed_cost() {
    let dir = tempfile::tempdir().unwrap();
    let store = converted(dir.path());
    let out: Value = serde_json::from_str(&ok(&mut sim_run(
        &store,
        &["--emulate", "rtx3060-12g", "--kv-type", "q8_0"],
    )))
    .unwrap();
    let mem = &out["memory"];
    assert_eq!(mem["emulated"], "rtx3060-12g", "{mem}");
    // No stated fixed cost in the preset: the conservative default comes off its 12 GiB.
    let fixed = gpu_offload::plan::hardware::DEFAULT_DEVICE_FIXED_BYTES;
    assert_eq!(mem["planned"]["gpu_fixed_bytes"].as_u64(), Some(fixed));
    assert!(mem["gpu_peak_bytes"].as_u64().unwrap() <= (12u64 << 30) - fixed);
    assert_eq!(out["token_ids"].as_array().unwrap().len(), 6);
    fails(
        &mut sim_run(&store, &["--emulate", "rtx3060-12g", "--gpu-mem", "13G"]),
        &["exceeds", "rtx3060-12g"],
    );
    fails(
        &mut sim_run(&store, &["--emulate", "no-such-card"]),
        &["--emulate", "no-such-card"],
    );
    fails(
        bin().args([
            "run",
            "--device",
            "cpu",
            "--emulate",
            "gpu-4g",
            "-m",
            s(&store),
            "--tokens",
            "5",
        ]),
        &["--emulate"],
    );
}

#[test]
fn plan_prints_a_table_and_refuses_a_budget_too_small() {
    let dir = tempfile::tempdir().unwrap();
    let store = converted(dir.path());
    // The budgeted CPU device's profile has no fixed device cost, so a few hundred KiB hold
    // this model.
    let table = ok(bin().args([
        "plan",
        "-m",
        s(&store),
        "--gpu-mem",
        "300K",
        "--ctx-size",
        "64",
        "--batch",
        "4",
        "--hardware",
        "cpu-sim",
    ]));
    for needle in [
        "layer",
        "resident MiB",
        "streamed MiB",
        "predicted decode",
        "of 0.3 MiB",
    ] {
        assert!(table.contains(needle), "{needle}: {table}");
    }
    let json: Value = serde_json::from_str(&ok(bin().args([
        "plan",
        "-m",
        s(&store),
        "--gpu-mem",
        "300K",
        "--ctx-size",
        "64",
        "--batch",
        "4",
        "--hardware",
        "cpu-sim",
        "--json",
    ])))
    .unwrap();
    assert!(json["gpu"]["total"].as_u64().unwrap() <= 300 * 1024);
    assert_eq!(json["gpu"]["fixed"].as_u64(), Some(0));
    // A GPU's context, kernels and cuBLAS come off --gpu-mem first: on a card whose profile
    // does not state them, the stated default applies, and the refusal names it.
    fails(
        bin().args([
            "plan",
            "-m",
            s(&store),
            "--gpu-mem",
            "300K",
            "--hardware",
            "rtx3060-12g",
        ]),
        &["too small", "fixed device cost 768.0 MiB"],
    );
    let err = fails(
        bin().args([
            "plan",
            "-m",
            s(&store),
            "--gpu-mem",
            "10K",
            "--ctx-size",
            "64",
            "--batch",
            "4",
            "--hardware",
            "cpu-sim",
        ]),
        &["too small", "at least"],
    );
    assert!(err.lines().count() == 1, "one line: {err}");
    fails(
        bin().args(["plan", "-m", s(&store), "--gpu-mem", "lots"]),
        &["--gpu-mem"],
    );
    // A step larger than the engine takes is refused by name, not cut down unsaid.
    for batch in ["0", "2048"] {
        fails(
            bin().args(["plan", "-m", s(&store), "--gpu-mem", "1G", "--batch", batch]),
            &["--batch", "between 1 and 512"],
        );
    }
    fails(
        bin().args([
            "plan",
            "-m",
            s(&store),
            "--gpu-mem",
            "1G",
            "--hardware",
            "nope",
        ]),
        &["nope"],
    );
}

#[test]
fn a_bit_flip_is_detected_and_named() {
    let dir = tempfile::tempdir().unwrap();
    let store = converted(dir.path());
    let manifest = Store::open(&store).unwrap().manifest;
    let seg = manifest.segment("blk.1.ffn_bundles.f16").unwrap().clone();
    let data = store.join("data.bin");
    let mut bytes = std::fs::read(&data).unwrap();
    bytes[(seg.offset + seg.bytes / 2) as usize] ^= 0x10;
    std::fs::write(&data, &bytes).unwrap();
    fails(
        bin().args(["convert", "--verify", s(&store)]),
        &["blk.1.ffn_bundles.f16", "checksum"],
    );
    // Offloaded runs read it at start-up (resident) or while streaming: either way it is named.
    fails(
        &mut sim_run(&store, &[]),
        &["blk.1.ffn_bundles.f16", "checksum"],
    );
    fails(
        &mut sim_run(&store, &["--gpu-mem", "300K", "--prefetch-window", "1"]),
        &["blk.1.ffn_bundles.f16", "checksum"],
    );
}

#[test]
fn truncation_is_detected_and_named() {
    let dir = tempfile::tempdir().unwrap();
    let store = converted(dir.path());
    let data = store.join("data.bin");
    let len = std::fs::metadata(&data).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&data)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let err = fails(&mut sim_run(&store, &[]), &["truncated"]);
    assert!(
        err.contains("blk.") || err.contains("output"),
        "names a segment: {err}"
    );
    std::fs::write(store.join("manifest.json"), "{ not json").unwrap();
    fails(
        &mut sim_run(&store, &[]),
        &["manifest.json", "not a valid store manifest"],
    );
}

#[test]
fn a_full_disk_during_convert_leaves_no_store() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("store");
    let script = format!(
        "ulimit -f 200; exec {} convert -m {} -o {}",
        env!("CARGO_BIN_EXE_gpu-offload"),
        s(&fixtures().join("hf/llama-gqa")),
        s(&out)
    );
    let o = run(Command::new("sh").args(["-c", &script]));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success(),
        "convert past the file-size limit succeeded"
    );
    assert!(
        err.contains("File too large") || err.contains("No space"),
        "{err}"
    );
    assert!(!err.contains("panicked"));
    assert!(!out.exists(), "no store at the target");
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert!(left.is_empty(), "temporary files left: {left:?}");
    fails(&mut sim_run(&out, &[]), &["store"]);
    // A later convert succeeds.
    ok(bin().args([
        "convert",
        "-m",
        s(&fixtures().join("hf/llama-gqa")),
        "-o",
        s(&out),
    ]));
    assert!(Store::open(&out).is_ok());
}

#[test]
fn a_killed_convert_is_cleaned_up_by_the_next() {
    let dir = tempfile::tempdir().unwrap();
    // What a process killed mid-write leaves: a temporary directory of a dead pid.
    let stale = dir.path().join(".store.tmp.999999999");
    std::fs::create_dir(&stale).unwrap();
    std::fs::write(stale.join("data.bin"), b"partial").unwrap();
    let out = dir.path().join("store");
    assert!(!Store::is_store(&out));
    ok(bin().args([
        "convert",
        "-m",
        s(&fixtures().join("hf/llama-gqa")),
        "-o",
        s(&out),
    ]));
    assert!(!stale.exists());
}

#[test]
fn unusable_directories_give_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    // A "store" whose manifest is a directory.
    let bad = dir.path().join("bad");
    std::fs::create_dir_all(bad.join("manifest.json")).unwrap();
    fails(
        bin().args(["plan", "-m", s(&bad), "--gpu-mem", "1G"]),
        &["bad"],
    );
    // A target under a regular file.
    let file = dir.path().join("file");
    std::fs::write(&file, b"x").unwrap();
    fails(
        bin().args([
            "convert",
            "-m",
            s(&fixtures().join("hf/llama-gqa")),
            "-o",
            s(&file.join("store")),
        ]),
        &["file"],
    );
    fails(
        bin().args(["convert", "--verify", s(&dir.path().join("nothing"))]),
        &["nothing"],
    );
}

#[test]
fn dram_budget_below_the_minimum_is_refused_with_the_minimum() {
    let dir = tempfile::tempdir().unwrap();
    let store = converted(dir.path());
    fails(
        &mut sim_run(
            &store,
            &[
                "--gpu-mem",
                "300K",
                "--prefetch-window",
                "1",
                "--dram-mem",
                "20K",
            ],
        ),
        &["--dram-mem", "at least"],
    );
    fails(
        bin().args([
            "run",
            "--device",
            "cpu",
            "--gpu-mem",
            "1G",
            "--tokens",
            "1",
            "-m",
            s(&store),
        ]),
        &["--device sim"],
    );
}

/// A mixture-of-experts model is stored as its router and expert stacks (an expert one slice of
/// each) and comes back exactly: the CPU engine on the store's weights computes the logits it
/// computes on the source's, bit for bit; a flipped bit in an expert is named; offloaded runs
/// (every expert resident, or every routed expert on the CPU) decode what the CPU engine
/// decodes; bundling is refused.
#[test]
fn experts_are_stored_as_slices_and_come_back_exact() {
    use gpu_offload::backend::cpu::CpuBackend;
    use gpu_offload::engine::{Engine, Logits};
    use gpu_offload::model::Model;
    let dir = tempfile::tempdir().unwrap();
    let f = fixtures();
    for (i, src) in [
        f.join("hf/qwen2-moe"),
        f.join("gguf/qwen3-moe-f32.gguf"),
        f.join("gguf/mixtral-f32.gguf"),
    ]
    .iter()
    .enumerate()
    {
        let out = dir.path().join(format!("store{i}"));
        ok(bin().args(["convert", "-m", s(src), "-o", s(&out)]));
        ok(bin().args(["convert", "--verify", s(&out)]));
        let store = Store::open(&out).unwrap();
        let spec = store.manifest.spec.clone();
        let moe = spec.moe.clone().unwrap();
        let seg = |w: &str| {
            store
                .manifest
                .segment(&format!("blk.1.{w}"))
                .unwrap()
                .clone()
        };
        assert_eq!(seg("ffn_gate_inp.weight").rows, moe.router_rows());
        assert_eq!(
            (
                seg("ffn_down_exps.weight").rows,
                seg("ffn_down_exps.weight").cols
            ),
            ((moe.experts + moe.shared) * spec.d_model, moe.d_expert)
        );
        assert!(store.manifest.segment("blk.1.ffn_up.weight").is_none());
        let logits = |m: &gpu_offload::model::ModelWeights| {
            let e = Engine::new(CpuBackend::new(1).unwrap(), spec.clone(), m).unwrap();
            let mut sess = e.new_session(8).unwrap();
            e.forward(&mut sess, &[3, 17, 99, 5, 250, 7], Logits::All)
                .unwrap()
        };
        let direct = Model::load(src).unwrap();
        assert_eq!(
            logits(&store.dense_weights().unwrap()),
            logits(&direct.weights),
            "{}",
            src.display()
        );
        let dense: Value =
            serde_json::from_str(&ok(&mut run_on("cpu", src, &["--kv-type", "f32"]))).unwrap();
        for cold in ["gpu", "cpu", "stream"] {
            let run = ok(&mut sim_run(&out, &["--kv-type", "f32", "--cold", cold]));
            let offloaded: Value = serde_json::from_str(&run).unwrap();
            assert_eq!(
                offloaded["token_ids"],
                dense["token_ids"],
                "{} --cold {cold}",
                src.display()
            );
        }
        // Under a budget, `memory.planned` is the expert plan's: the device's peak within its
        // device bytes, its host→device bytes the measured ones, its PCIe bytes both ways.
        for cold in ["gpu", "cpu"] {
            let args = ["--kv-type", "f32", "--cold", cold, "--gpu-mem", "3M"];
            let run: Value = serde_json::from_str(&ok(&mut sim_run(&out, &args))).unwrap();
            let (mem, what) = (&run["memory"], format!("{} --cold {cold}", src.display()));
            let (planned, f) = (&mem["planned"], |v: &Value| v.as_f64().unwrap());
            assert!(
                f(&mem["gpu_peak_bytes"]) <= f(&planned["gpu_bytes"]),
                "{what}: {mem}"
            );
            assert_eq!(
                f(&planned["h2d_bytes_per_token"]),
                f(&mem["h2d_bytes_per_token"]),
                "{what}: {mem}"
            );
            assert!(
                f(&planned["pcie_bytes_per_token"]) > f(&planned["h2d_bytes_per_token"]),
                "{what}: {mem}"
            );
        }
        fails(
            &mut sim_run(&out, &["--cold", "split"]),
            &["--cold split", "mixture-of-experts", "--cold cpu"],
        );
        if i == 0 {
            // An expert's flipped bit is named by the verifier.
            let s1 = seg("ffn_up_exps.weight");
            let data = out.join("data.bin");
            let mut bytes = std::fs::read(&data).unwrap();
            bytes[(s1.offset + s1.bytes / 3) as usize] ^= 0x10;
            std::fs::write(&data, &bytes).unwrap();
            fails(
                bin().args(["convert", "--verify", s(&out)]),
                &["blk.1.ffn_up_exps.weight", "checksum"],
            );
            fails(
                bin().args([
                    "convert",
                    "-m",
                    s(src),
                    "-o",
                    s(&dir.path().join("bundled")),
                    "--bundle-ffn",
                ]),
                &["mixture-of-experts", "--bundle-ffn"],
            );
        }
    }
}
