//! A block-quantized GGUF (SmolLM2-135M-Instruct, Q4_1) offloaded as it is: the store holds every
//! tensor's own bytes (the FFN as its matrices), is the file's size, and an offloaded run at any
//! budget computes on exactly the numbers of the dense run — the same logits, bit for bit, and
//! the same greedy tokens, with host→device traffic in the file's bytes.

mod common;

use std::process::Command;
use std::sync::Arc;

use gpu_offload::backend::KvType;
use gpu_offload::backend::cpu::CpuBackend;
use gpu_offload::backend::sim::SimBackend;
use gpu_offload::engine::{Engine, Logits};
use gpu_offload::footprint::Ledger;
use gpu_offload::model::Model;
use gpu_offload::model::gguf::GgufFile;
use gpu_offload::plan::{Budget, HardwareProfile, PlanError, make_plan};
use gpu_offload::store::{ConvertOptions, Store, convert};
use gpu_offload::tier::stream::StreamWeights;
use serde_json::Value;
use xxhash_rust::xxh3::xxh3_64;

fn converted_with(
    gguf: &std::path::Path,
    opts: &ConvertOptions,
) -> (Arc<Store>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("store");
    convert(gguf, &out, opts, &mut |_, _| {}).unwrap();
    (Arc::new(Store::open(&out).unwrap()), dir)
}

fn converted(gguf: &std::path::Path) -> (Arc<Store>, tempfile::TempDir) {
    converted_with(gguf, &ConvertOptions::default())
}

/// By default the store reads a GGUF's matrices in the file itself: only norms (as f32
/// vectors) go to `data.bin`, and every matrix segment is the file's bytes at its offset.
#[test]
fn the_store_reads_the_gguf_in_place() {
    let Some(path) = common::smollm2() else {
        return;
    };
    let (store, dir) = converted(&path);
    let gguf = GgufFile::open(&path).unwrap();
    for (name, info) in &gguf.tensors {
        let seg = store.segment(name).unwrap();
        assert_eq!(seg.in_source, info.dims.len() == 2, "`{name}`");
        if seg.in_source {
            assert_eq!(seg.offset, info.offset as u64, "`{name}`");
        }
        assert_eq!(
            seg.xxh3,
            format!("{:016x}", xxh3_64(gguf.tensor_bytes(info)))
        );
    }
    store.verify_all(&mut |_, _| {}).unwrap();
    let stored = walk(&dir.path().join("store"));
    println!("in place: the store holds {stored} bytes beside the file");
    assert!(stored < 4 << 20, "{stored} bytes");
}

/// A model file that changed under a store reading it in place is refused (size), or its
/// changed bytes fail their checksum when read (content).
#[test]
fn a_changed_model_file_is_caught() {
    let Some(path) = common::smollm2() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join("m.gguf");
    std::fs::copy(&path, &copy).unwrap();
    let out = dir.path().join("store");
    convert(&copy, &out, &ConvertOptions::default(), &mut |_, _| {}).unwrap();
    let store = Store::open(&out).unwrap();
    let seg = store
        .manifest
        .segments
        .iter()
        .find(|s| s.in_source && s.name.contains("ffn_down"))
        .unwrap()
        .clone();
    drop(store);
    // Same size, one byte flipped inside a matrix.
    let mut bytes = std::fs::read(&copy).unwrap();
    bytes[seg.offset as usize + 100] ^= 0x40;
    std::fs::write(&copy, &bytes).unwrap();
    let store = Store::open(&out).unwrap();
    let err = store.verify_all(&mut |_, _| {}).unwrap_err().to_string();
    assert!(err.contains(&seg.name) && err.contains("checksum"), "{err}");
    // Another size: refused at open, naming the file.
    bytes.push(0);
    std::fs::write(&copy, &bytes).unwrap();
    let err = Store::open(&out).unwrap_err().to_string();
    assert!(
        err.contains("has changed") && err.contains("m.gguf"),
        "{err}"
    );
    std::fs::remove_file(&copy).unwrap();
    let err = Store::open(&out).unwrap_err().to_string();
    assert!(err.contains("cannot be opened"), "{err}");
}

#[test]
fn a_copied_store_holds_the_gguf_bytes_and_is_the_files_size() {
    let Some(path) = common::smollm2() else {
        return;
    };
    let (store, dir) = converted_with(
        &path,
        &ConvertOptions {
            copy: true,
            ..Default::default()
        },
    );
    let gguf = GgufFile::open(&path).unwrap();
    let mut matrices = 0;
    for (name, info) in &gguf.tensors {
        let seg = store
            .segment(name)
            .unwrap_or_else(|| panic!("`{name}` is not in the store"));
        let bytes = gguf.tensor_bytes(info);
        assert_eq!(
            seg.xxh3,
            format!("{:016x}", xxh3_64(bytes)),
            "`{name}` ({}) differs from the file's bytes",
            seg.encoding.name()
        );
        matrices += usize::from(info.dims.len() == 2);
        assert!(!seg.in_source);
    }
    assert!(matrices > 200, "{matrices} matrices");
    assert!(!store.ffn_bundled(), "a Q4_1 FFN stays matrices");
    let file = std::fs::metadata(&path).unwrap().len() as f64;
    let stored: u64 = walk(&dir.path().join("store"));
    let ratio = stored as f64 / file;
    println!("store {stored} bytes for a {file} byte file ({ratio:.4})");
    assert!((0.98..=1.02).contains(&ratio), "store/file = {ratio}");
}

fn walk(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum()
}

/// The dense CPU engine's logits for the model file at `path` (prompt, then single steps).
fn dense_logits(path: &std::path::Path, toks: &[u32], prompt: usize, kv: KvType) -> Vec<Vec<f32>> {
    logits(
        &common::cpu_engine(&Model::load(path).unwrap(), kv),
        toks,
        prompt,
    )
}

/// The plan run on the budgeted device (with a DRAM budget, if given), and its ledger.
fn offloaded(
    store: &Arc<Store>,
    plan: &gpu_offload::plan::Plan,
    dram: Option<u64>,
    kv: KvType,
) -> (Engine<SimBackend>, Arc<Ledger>) {
    let ledger = Ledger::new(Some(plan.ledger_budget()), dram);
    let sim = SimBackend::new(CpuBackend::new(2).unwrap(), ledger.clone());
    let src = StreamWeights::new(&sim, store.clone(), plan, ledger.clone()).unwrap();
    let e = Engine::with_source(sim, store.manifest.spec.clone(), Box::new(src))
        .unwrap()
        .with_prefill(plan.prefill)
        .unwrap()
        .with_kv_type(kv)
        .unwrap();
    (e, ledger)
}

/// Logits of a prompt then `decode` single-token steps.
fn logits<B: gpu_offload::backend::Backend>(
    e: &Engine<B>,
    toks: &[u32],
    prompt: usize,
) -> Vec<Vec<f32>> {
    let mut s = e.new_session(toks.len()).unwrap();
    let mut out = vec![e.forward(&mut s, &toks[..prompt], Logits::Last).unwrap()];
    for &t in &toks[prompt..] {
        out.push(e.forward(&mut s, &[t], Logits::Last).unwrap());
    }
    out
}

#[test]
fn offloaded_runs_compute_the_dense_numbers_exactly() {
    let Some(path) = common::smollm2() else {
        return;
    };
    let (store, _dir) = converted(&path);
    let model = Model::load(&path).unwrap();
    let toks: Vec<u32> = [1u32, 504, 3458, 282, 4649, 314, 2412, 30, 198, 504]
        .into_iter()
        .chain((0..6).map(|i| 100 + 37 * i))
        .collect();
    let prompt = 10;
    for kv in [KvType::F32, KvType::F16] {
        let want = logits(&common::cpu_engine(&model, kv), &toks, prompt);
        let hw = HardwareProfile::load("cpu-sim").unwrap();
        let b = |g| Budget {
            kv_type: kv,
            ..Budget::new(g, None, 2, toks.len(), prompt)
        };
        let (min, all) = common::gpu_range(&store.manifest, &hw, b);
        for g in [min, min + (all - min) / 3, all] {
            let plan = make_plan(&store.manifest, &b(g), &hw).unwrap();
            let (e, ledger) = offloaded(&store, &plan, None, kv);
            let got = logits(&e, &toks, prompt);
            assert!(
                got == want,
                "{kv:?} at {g} bytes: logits differ from the dense run"
            );
            if plan.streams() {
                // Streamed in the file's bytes: the per-token traffic is the plan's, in Q4_1.
                e.settle();
                let before = ledger.snapshot();
                let mut s = e.new_session(2).unwrap();
                e.forward(&mut s, &[1], Logits::Last).unwrap();
                e.settle();
                let moved = ledger.snapshot().h2d_bytes - before.h2d_bytes;
                assert_eq!(moved, plan.decode_bytes_at(0).0);
            }
        }
    }
}

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_gpu-offload"));
    for (k, _) in std::env::vars() {
        if k.starts_with("GPU_OFFLOAD_") && k != "GPU_OFFLOAD_MODELS" {
            c.env_remove(k);
        }
    }
    c
}

fn tokens(args: &[&str]) -> Value {
    let out = bin().args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j: Value = serde_json::from_slice(&out.stdout).unwrap();
    j["token_ids"].clone()
}

#[test]
fn run_on_the_budgeted_device_gives_the_cpus_tokens() {
    let Some(path) = common::smollm2() else {
        return;
    };
    let m = path.to_str().unwrap();
    let base = [
        "run",
        "-m",
        m,
        "--prompt",
        "The capital of France is",
        "--temperature",
        "0",
        "-n",
        "24",
        "--json",
    ];
    for kv in ["f32", "f16"] {
        let cpu = tokens(&[&base[..], &["--device", "cpu", "--kv-type", kv]].concat());
        for g in ["80M", "1G"] {
            let sim = tokens(
                &[
                    &base[..],
                    &["--device", "sim", "--gpu-mem", g, "--kv-type", kv],
                ]
                .concat(),
            );
            assert_eq!(sim, cpu, "--gpu-mem {g} --kv-type {kv}");
        }
    }
}

/// A GGUF whose layers keep one tensor in different formats (as Q4_K_M keeps some layers'
/// `ffn_down` and `attn_v` in Q6_K): here Q8_0 in even layers and F16 in odd ones, everything
/// else Q8_0, written from a synthesized 6-layer llama GGUF (so the DRAM cache has layers to
/// cycle through).
fn mixed_format_gguf(dir: &std::path::Path) -> std::path::PathBuf {
    use gpu_offload::model::gguf::{RawTensor, write};
    use gpu_offload::model::synth::{SynthSpec, synthesize_gguf};
    use gpu_offload::tensor::{DType, decode_row, encode_row};
    let src = dir.join("f16.gguf");
    let spec = SynthSpec {
        n_layers: 6,
        vocab_size: 320,
        ..SynthSpec::preset("tiny").unwrap()
    };
    synthesize_gguf(&spec, &src, false, None, &mut |_, _| {}).unwrap();
    let g = GgufFile::open(&src).unwrap();
    let mut tensors = Vec::new();
    for (name, info) in &g.tensors {
        let bytes = g.tensor_bytes(info);
        if info.dims.len() < 2 {
            tensors.push(RawTensor {
                name: name.clone(),
                dims: info.dims.clone(),
                ggml_type: 0,
                bytes: bytes.to_vec(),
            });
            continue;
        }
        let cols = info.dims[0] as usize;
        let odd_layer = name
            .strip_prefix("blk.")
            .and_then(|r| r.split('.').next())
            .and_then(|l| l.parse::<usize>().ok())
            .is_some_and(|l| l % 2 == 1);
        let mixed = name.contains("ffn_down") || name.contains("attn_v");
        let (dtype, ggml_type) = if mixed && odd_layer {
            (DType::F16, 1)
        } else {
            (DType::Q8_0, 8)
        };
        let from = info.ggml_type.host_dtype().unwrap();
        let mut out = Vec::new();
        let mut row = vec![0f32; cols];
        for r in bytes.chunks(from.bytes_for(cols)) {
            decode_row(from, r, &mut row);
            let mut enc = vec![0u8; dtype.bytes_for(cols)];
            encode_row(dtype, &row, &mut enc).unwrap();
            out.extend(enc);
        }
        tensors.push(RawTensor {
            name: name.clone(),
            dims: info.dims.clone(),
            ggml_type,
            bytes: out,
        });
    }
    let meta: Vec<(&str, gpu_offload::model::gguf::MetaValue)> = g
        .metadata
        .entries
        .iter()
        .map(|(k, v)| (k.as_str(), v.clone()))
        .collect();
    let path = dir.join("mixed.gguf");
    write(&path, &meta, &tensors).unwrap();
    path
}

/// Layers of mixed formats stream through the same slots (re-typed per layer) and DRAM buffers
/// (sized for the widest layer): at any budget, with the SSD tier in play, the offloaded logits
/// are the dense run's bit for bit and the traffic per token is the plan's, layer by layer.
#[test]
fn layers_of_mixed_formats_offload_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let path = mixed_format_gguf(dir.path());
    let (store, _d) = converted(&path);
    let shapes = gpu_offload::plan::layer_shapes(&store.manifest).unwrap();
    let down = gpu_offload::plan::Part::Down.index();
    assert_ne!(shapes[0].row_bytes[down], shapes[1].row_bytes[down]);
    let toks: Vec<u32> = (0..12).map(|i| (i * 37 % 300 + 3) as u32).collect();
    let prompt = 6;
    let want = dense_logits(&path, &toks, prompt, KvType::F16);
    let hw = HardwareProfile::load("cpu-sim").unwrap();
    for window in [1, 2] {
        let b = |g, dram| Budget::new(g, dram, window, toks.len(), prompt);
        let (min, all) = common::gpu_range(&store.manifest, &hw, |g| b(g, None));
        for g in [min, min + (all - min) / 3] {
            let dram = match make_plan(&store.manifest, &b(g, Some(1)), &hw) {
                Err(PlanError::DramTooSmall { minimum, .. }) => Some(minimum),
                _ => None,
            };
            let plan = make_plan(&store.manifest, &b(g, dram), &hw).unwrap();
            assert!(plan.streams());
            assert!(
                dram.is_none() || plan.per_token.ssd_bytes > 0,
                "the SSD tier is in play"
            );
            let (e, ledger) = offloaded(&store, &plan, dram, KvType::F16);
            let mut s = e.new_session(toks.len()).unwrap();
            let mut got = vec![e.forward(&mut s, &toks[..prompt], Logits::Last).unwrap()];
            for (i, &t) in toks[prompt..].iter().enumerate() {
                e.settle();
                let before = ledger.snapshot();
                got.push(e.forward(&mut s, &[t], Logits::Last).unwrap());
                e.settle();
                let after = ledger.snapshot();
                assert_eq!(
                    after.h2d_bytes - before.h2d_bytes,
                    plan.decode_bytes_at(prompt + i).0
                );
                assert_eq!(
                    after.ssd_read_bytes - before.ssd_read_bytes,
                    plan.per_token.ssd_bytes
                );
                assert!(after.hbm_peak <= plan.gpu.placed);
                if let Some(d) = dram {
                    assert!(after.dram_total_peak <= d);
                }
            }
            assert!(got == want, "window {window}, {g} bytes: logits differ");
        }
    }
}

/// A synthesized Q4_K_M model (llama.cpp's mix: Q4_K, with Q6_K for the output and for `attn_v`
/// and `ffn_down` in the layers it gives more bits) is stored in its own formats, read in place,
/// and offloaded at tight budgets computes the dense run's logits bit for bit.
#[test]
fn a_q4_k_m_model_offloads_exactly() {
    use gpu_offload::model::quant_mix::QuantMix;
    use gpu_offload::model::synth::{SynthSpec, synthesize_gguf};
    use gpu_offload::tensor::DType;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("q4km.gguf");
    let spec = SynthSpec {
        n_layers: 8,
        d_model: 256,
        d_ff: 512,
        n_heads: 4,
        n_kv_heads: 2,
        vocab_size: 320,
        ..SynthSpec::preset("tiny").unwrap()
    };
    synthesize_gguf(&spec, &path, false, Some(QuantMix::Q4KM), &mut |_, _| {}).unwrap();
    let (store, _d) = converted(&path);
    let fmt = |name: &str| store.segment(name).unwrap().encoding.name();
    assert_eq!(fmt("output.weight"), "q6_k");
    assert_eq!(fmt("blk.0.ffn_down.weight"), "q6_k");
    assert_eq!(fmt("blk.1.ffn_down.weight"), "q4_k");
    assert_eq!(fmt("blk.3.attn_v.weight"), "q6_k");
    assert_eq!(fmt("blk.4.attn_q.weight"), "q4_k");
    assert!(
        store
            .manifest
            .segments
            .iter()
            .filter(|s| s.rows > 1)
            .all(|s| s.in_source)
    );
    assert_eq!(
        gpu_offload::plan::widest_dtype(&store.manifest, gpu_offload::plan::Part::Down).unwrap(),
        DType::Q6K
    );
    let toks: Vec<u32> = (0..12).map(|i| (i * 37 % 300 + 3) as u32).collect();
    let prompt = 6;
    let want = dense_logits(&path, &toks, prompt, KvType::F16);
    let hw = HardwareProfile::load("cpu-sim").unwrap();
    let b = |g| Budget::new(g, None, 2, toks.len(), prompt);
    let (min, all) = common::gpu_range(&store.manifest, &hw, b);
    for g in [min, min + (all - min) / 2] {
        let plan = make_plan(&store.manifest, &b(g), &hw).unwrap();
        let (e, ledger) = offloaded(&store, &plan, None, KvType::F16);
        assert!(
            logits(&e, &toks, prompt) == want,
            "{g} bytes: logits differ"
        );
        assert!(ledger.snapshot().hbm_peak <= plan.gpu.placed);
    }
}

/// `convert --quantize q4_k_m` of an f16 GGUF (made by `synth`) writes a Q4_K_M GGUF beside it
/// and a store that reads it in place; `run` on the budgeted device, streaming, gives the CPU's
/// greedy tokens. Quantizing a model that is already quantized is refused with the tensor
/// named, and nothing is written.
#[test]
fn convert_quantize_makes_a_q4_k_m_model_that_runs() {
    let dir = tempfile::tempdir().unwrap();
    let models = dir.path().join("cache");
    let f16 = dir.path().join("m-f16.gguf");
    let s = |p: &std::path::Path| p.to_str().unwrap().to_string();
    let cmd = |args: &[&str]| {
        bin()
            .env("GPU_OFFLOAD_MODELS", &models)
            .args(args)
            .output()
            .unwrap()
    };
    let ok = |args: &[&str]| {
        let out = cmd(args);
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    ok(&[
        "synth",
        "-o",
        &s(&f16),
        "--layers",
        "4",
        "--hidden",
        "256",
        "--ffn",
        "512",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--vocab",
        "320",
    ]);
    let said = ok(&["convert", "-m", &s(&f16), "--quantize", "q4_k_m"]);
    let q = dir.path().join("m-f16.q4_k_m.gguf");
    assert!(q.is_file() && said.contains("quantized"), "{said}");
    let store = Store::open(
        &models
            .join("stores")
            .read_dir()
            .unwrap()
            .next()
            .unwrap()
            .unwrap()
            .path(),
    )
    .unwrap();
    let fmt = |name: &str| store.segment(name).unwrap().encoding.name();
    // 4 layers: llama.cpp gives more bits to layers 2 and 3.
    assert_eq!(fmt("blk.3.ffn_down.weight"), "q6_k");
    assert_eq!(fmt("blk.1.ffn_up.weight"), "q4_k");
    let run = |extra: &[&str]| -> Value {
        let base = [
            "run",
            "-m",
            &s(&q),
            "--tokens",
            "5,17,99,3,250",
            "--temperature",
            "0",
            "-n",
            "12",
            "--json",
        ];
        let out = ok(&[&base[..], extra].concat());
        serde_json::from_str(&out).unwrap()
    };
    let cpu = run(&["--device", "cpu"]);
    // At 1M the layers stream (the quantized model is 1.5 MiB).
    let sim = run(&["--device", "sim", "--gpu-mem", "1M"]);
    assert_eq!(sim["token_ids"], cpu["token_ids"]);
    assert!(sim["memory"]["h2d_bytes_per_token"].as_f64().unwrap() > 1e6);
    // Already quantized: refused, the tensor named, nothing written.
    let again = dir.path().join("twice.gguf");
    let out = cmd(&[
        "convert",
        "-m",
        &s(&q),
        "--quantize",
        "q4_0",
        "--quantized-out",
        &s(&again),
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("already quantized") && err.contains("tensor `"),
        "{err}"
    );
    assert!(!again.exists());
    let out = cmd(&["convert", "-m", &s(&f16), "--quantize", "q9_9"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a quantization"));
}

/// `convert --bundle-ffn`: a block-quantized FFN (SmolLM2's Q4_1) is stored as neuron bundles
/// too (f16, INT8, INT4): the f16 bundles hold the blocks' values rounded to f16, every layer
/// has all three encodings, and the store plans cache units.
#[test]
fn a_bundled_quantized_ffn_holds_its_blocks_values_in_f16() {
    use gpu_offload::store::{Encoding, names};
    let Some(path) = common::smollm2() else {
        return;
    };
    let (store, _dir) = converted_with(
        &path,
        &ConvertOptions {
            bundle_quantized: true,
            extra_encodings: vec![Encoding::Int8, Encoding::Int4],
            ..Default::default()
        },
    );
    assert!(store.ffn_bundled());
    let spec = &store.manifest.spec;
    for l in 0..spec.n_layers {
        for e in [Encoding::F16, Encoding::Int8, Encoding::Int4] {
            assert!(
                store.manifest.segment(&names::bundles(l, e)).is_some(),
                "layer {l} {e:?}"
            );
        }
    }
    let model = Model::load(&path).unwrap();
    let rebuilt = store.dense_weights().unwrap();
    for l in [0, spec.n_layers - 1] {
        let (a, b) = (&model.weights.layers[l], &rebuilt.layers[l]);
        let pairs = [
            (a.w_gate.as_ref().unwrap(), b.w_gate.as_ref().unwrap()),
            (&a.w_up, &b.w_up),
            (&a.w_down, &b.w_down),
        ];
        for (x, y) in pairs {
            let (x, y) = (x.weight.to_f32(), y.weight.to_f32());
            assert_eq!(x.len(), y.len());
            for (u, v) in x.iter().zip(&y) {
                assert_eq!(half::f16::from_f32(*u).to_f32(), *v, "layer {l}");
            }
        }
    }
    let plan = common::plan_for(&store, 4);
    gpu_offload::plan::units::plan_units(
        &store.manifest,
        &plan,
        None,
        0.15,
        gpu_offload::plan::precision::Precision([25, 25, 50]),
    )
    .unwrap();
}
