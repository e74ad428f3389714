//! A store edited by hand or by an attacker (issue 39): every change to its manifest, its
//! tokenizer file or its temporaries is refused, named, or harmless — never a panic and never a
//! silently different model.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;

use common::*;
use gpu_offload::store::{ConvertOptions, Store, convert};
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

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// stories260K converted into `dir/s` (its matrices read in the GGUF in place, as `run` does).
fn converted(dir: &Path) -> PathBuf {
    let at = dir.join("s");
    convert(
        &stories260k(),
        &at,
        &ConvertOptions::default(),
        &mut |_, _| {},
    )
    .unwrap();
    at
}

fn manifest(store: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(store.join("manifest.json")).unwrap()).unwrap()
}

fn write_manifest(store: &Path, m: &Value) {
    std::fs::write(
        store.join("manifest.json"),
        serde_json::to_vec_pretty(m).unwrap(),
    )
    .unwrap();
}

/// The manifest rewritten with its checksums made consistent again: an edit a checksum cannot
/// catch (a writer's bug, or someone who knows the format), left to the structural checks.
fn reseal(store: &Path) {
    let mut m: gpu_offload::store::Manifest =
        serde_json::from_slice(&std::fs::read(store.join("manifest.json")).unwrap()).unwrap();
    m.seal().unwrap();
    std::fs::write(
        store.join("manifest.json"),
        serde_json::to_vec_pretty(&m).unwrap(),
    )
    .unwrap();
}

/// `convert --verify` through the library, as the command does it.
fn verify(store: &Path) -> Result<(), String> {
    let s = Store::open(store).map_err(|e| e.to_string())?;
    s.verify(&mut |_, _| {}).map_err(|e| e.to_string())
}

/// A command's outcome: success, or a clean failure (an error message, no panic, no signal).
fn outcome(c: &mut Command) -> Result<String, String> {
    let out: Output = c.output().expect("run binary");
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !err.contains("panicked") && out.status.code().is_some_and(|rc| rc != 101),
        "{c:?} crashed ({:?}): {err}",
        out.status
    );
    match out.status.success() {
        true => Ok(String::from_utf8_lossy(&out.stdout).into_owned()),
        false => Err(err),
    }
}

fn cli_verify(store: &Path) -> Result<String, String> {
    outcome(bin().args(["convert", "--verify", s(store)]))
}

fn cli_run(store: &Path, tokens: &str) -> Result<String, String> {
    outcome(bin().args([
        "run",
        "--device",
        "sim",
        "-m",
        s(store),
        "--tokens",
        tokens,
        "-n",
        "4",
        "--temperature",
        "0",
        "--json",
        "--ignore-eos",
    ]))
}

/// Greedy tokens of a short run on the offloaded engine, from the store's own tokenizer's
/// encoding of a prompt: what a user of the store gets. Errors as text.
fn greedy_run(store: &Arc<Store>) -> Result<Vec<u32>, String> {
    use gpu_offload::backend::KvType;
    use gpu_offload::backend::cpu::CpuBackend;
    use gpu_offload::backend::sim::SimBackend;
    use gpu_offload::engine::{Engine, Logits};
    use gpu_offload::footprint::Ledger;
    use gpu_offload::plan::{Budget, HardwareProfile, make_plan};
    use gpu_offload::tier::stream::StreamWeights;
    let e = |e: &dyn std::fmt::Display| e.to_string();
    let tok = store
        .tokenizer()
        .map_err(|x| e(&x))?
        .ok_or("no tokenizer")?;
    let mut ids = tok
        .encode("Once upon a time", true, false)
        .map_err(|x| e(&x))?;
    let hw = HardwareProfile::load("cpu-sim").map_err(|x| e(&x))?;
    let plan = make_plan(
        &store.manifest,
        &Budget::new(u64::MAX / 4, None, 2, 32, 16),
        &hw,
    )
    .map_err(|x| e(&x))?;
    let ledger = Ledger::new(None, None);
    let sim = SimBackend::new(CpuBackend::new(1).map_err(|x| e(&x))?, ledger.clone());
    let src = StreamWeights::new(&sim, store.clone(), &plan, ledger.clone()).map_err(|x| e(&x))?;
    let engine = Engine::with_source(sim, store.manifest.spec.clone(), Box::new(src))
        .and_then(|en| en.with_prefill(plan.prefill))
        .and_then(|en| en.with_kv_type(KvType::F16))
        .map_err(|x| e(&x))?;
    let mut session = engine.new_session(32).map_err(|x| e(&x))?;
    let mut out = ids.clone();
    let mut logits = engine
        .forward(&mut session, &ids, Logits::Last)
        .map_err(|x| e(&x))?;
    for _ in 0..6 {
        let next = greedy(&logits);
        out.push(next);
        ids = vec![next];
        logits = engine
            .forward(&mut session, &ids, Logits::Last)
            .map_err(|x| e(&x))?;
    }
    Ok(out)
}

#[test]
fn a_vocabulary_larger_than_the_embedding_is_refused_not_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let store = converted(dir.path());
    let mut m = manifest(&store);
    m["spec"]["vocab_size"] = 612.into();
    write_manifest(&store, &m);
    // Before issue 39: --verify passed and this run panicked in tensor.rs.
    let verified = cli_verify(&store);
    assert!(verified.is_err(), "verify passed: {verified:?}");
    let ran = cli_run(&store, "1,2,600");
    assert!(ran.is_err(), "run passed: {ran:?}");

    // The same edit with the manifest's checksums made consistent: the shape check names the
    // embedding.
    reseal(&store);
    let e = Store::open(&store).expect_err("a 612-token vocabulary over 512 rows");
    assert!(e.to_string().contains("token_embd.weight"), "{e}");
    let ran = cli_run(&store, "1,2,600").expect_err("refused");
    assert!(ran.contains("token_embd.weight"), "{ran}");
}

#[test]
fn every_tensor_shape_is_checked_against_the_spec() {
    let dir = tempfile::tempdir().unwrap();
    let store = converted(dir.path());
    let pristine = manifest(&store);
    let names: Vec<String> = pristine["segments"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap().to_string())
        .collect();
    for (i, name) in names.iter().enumerate() {
        // One more row (and the bytes and group checksums that go with it, so only the shape
        // against the spec can tell).
        let mut m = pristine.clone();
        let seg = &mut m["segments"][i];
        let rows = seg["rows"].as_u64().unwrap();
        let row_bytes = seg["bytes"].as_u64().unwrap() / rows;
        seg["rows"] = (rows + 1).into();
        seg["bytes"] = ((rows + 1) * row_bytes).into();
        let groups = (rows as usize + 1).div_ceil(64);
        let mut g = seg["group_xxh3"].as_array().unwrap().clone();
        g.resize(groups, Value::from("0000000000000000"));
        seg["group_xxh3"] = Value::from(g);
        write_manifest(&store, &m);
        reseal(&store);
        let e = Store::open(&store).expect_err(name);
        assert!(e.to_string().contains(name.as_str()), "{name}: {e}");
    }
    // A segment the spec has no place for, and one it needs, missing.
    let mut m = pristine.clone();
    let mut extra = m["segments"][1].clone();
    extra["name"] = "blk.9.attn_q.weight".into();
    m["segments"].as_array_mut().unwrap().push(extra);
    write_manifest(&store, &m);
    reseal(&store);
    let e = Store::open(&store).unwrap_err().to_string();
    assert!(e.contains("blk.9.attn_q.weight"), "{e}");
    let mut m = pristine.clone();
    let at = names
        .iter()
        .position(|n| n == "blk.2.attn_k.weight")
        .unwrap();
    m["segments"].as_array_mut().unwrap().remove(at);
    write_manifest(&store, &m);
    reseal(&store);
    let e = Store::open(&store).unwrap_err().to_string();
    assert!(
        e.contains("blk.2.attn_k.weight") && e.contains("missing"),
        "{e}"
    );
    // Two segments over the same bytes of data.bin.
    let mut m = pristine.clone();
    let segs = m["segments"].as_array_mut().unwrap();
    let norms: Vec<usize> = (0..segs.len())
        .filter(|&i| {
            let n = segs[i]["name"].as_str().unwrap();
            n.ends_with("attn_norm.weight")
        })
        .collect();
    let off = segs[norms[0]]["offset"].clone();
    segs[norms[1]]["offset"] = off;
    write_manifest(&store, &m);
    reseal(&store);
    let e = Store::open(&store).unwrap_err().to_string();
    assert!(e.contains("overlap"), "{e}");
}

#[test]
fn verify_and_load_refuse_what_the_manifest_checksum_did_not_cover() {
    let dir = tempfile::tempdir().unwrap();
    let store = converted(dir.path());
    let pristine = manifest(&store);
    assert!(cli_verify(&store).is_ok());
    let tokens = cli_run(&store, "1,2,3").unwrap();
    type Edit = fn(&mut Value);
    let edits: &[(&str, Edit)] = &[
        ("segments emptied", |m| m["segments"] = Value::Array(vec![])),
        ("a segment removed", |m| {
            m["segments"].as_array_mut().unwrap().remove(3);
        }),
        ("a whole-tensor xxh3 changed", |m| {
            m["segments"][2]["xxh3"] = "0123456789abcdef".into()
        }),
        ("norm eps", |m| m["spec"]["norm_eps"] = 2e-5.into()),
        ("rope theta", |m| {
            m["spec"]["position"]["theta"] = 20000.0.into()
        }),
        ("attention scale", |m| m["spec"]["attn_scale"] = 0.5.into()),
        ("layers", |m| m["spec"]["n_layers"] = 4.into()),
        ("vocabulary", |m| m["spec"]["vocab_size"] = 500.into()),
    ];
    for (what, edit) in edits {
        let mut m = pristine.clone();
        edit(&mut m);
        write_manifest(&store, &m);
        let v = cli_verify(&store);
        assert!(v.is_err(), "{what}: verify passed: {v:?}");
        let r = cli_run(&store, "1,2,3");
        assert!(r.is_err(), "{what}: run gave {r:?} (unedited: {tokens})");
    }
    write_manifest(&store, &pristine);
    assert!(cli_verify(&store).is_ok());

    // The tokenizer file: deleted, or one byte changed.
    let tok = store.join("tokenizer.gguf");
    let bytes = std::fs::read(&tok).unwrap();
    std::fs::remove_file(&tok).unwrap();
    let e = cli_verify(&store).expect_err("tokenizer.gguf deleted");
    assert!(e.contains("tokenizer.gguf"), "{e}");
    let mut flipped = bytes.clone();
    let at = flipped.len() - 100;
    flipped[at] ^= 0x20;
    std::fs::write(&tok, &flipped).unwrap();
    let e = cli_verify(&store).expect_err("tokenizer.gguf corrupted");
    assert!(e.contains("tokenizer.gguf"), "{e}");
    std::fs::write(&tok, &bytes).unwrap();
    assert!(cli_verify(&store).is_ok());

    // Resealed, the whole-tensor checksum is still checked by --verify, which names the segment.
    let mut m = pristine.clone();
    let name = m["segments"][2]["name"].as_str().unwrap().to_string();
    m["segments"][2]["xxh3"] = "0123456789abcdef".into();
    write_manifest(&store, &m);
    reseal(&store);
    let e = verify(&store).expect_err("whole xxh3 changed");
    assert!(e.contains(&name), "{e}");
}

#[test]
fn a_store_from_before_manifest_checksums_is_refused_and_a_cached_one_converted_again() {
    let dir = tempfile::tempdir().unwrap();
    let store = converted(dir.path());
    let mut m = manifest(&store);
    m["version"] = 2.into();
    m.as_object_mut().unwrap().remove("checksums");
    write_manifest(&store, &m);
    let e = Store::open(&store).unwrap_err().to_string();
    assert!(e.contains("convert the model again"), "{e}");

    // `run -m model.gguf` keeps its store in a cache: an old one there is converted again.
    let models = tempfile::tempdir().unwrap();
    let run = |cmd: &mut Command| {
        let out = cmd
            .env("GPU_OFFLOAD_MODELS", models.path())
            .args([
                "run",
                "--device",
                "sim",
                "-m",
                s(&stories260k()),
                "--tokens",
                "1,2,3",
                "-n",
                "4",
                "--temperature",
                "0",
                "--json",
            ])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        (
            v["token_ids"].clone(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (first, _) = run(&mut bin());
    let cached = std::fs::read_dir(models.path().join("stores"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| Store::is_store(p))
        .unwrap();
    let mut m = manifest(&cached);
    m["version"] = 2.into();
    m.as_object_mut().unwrap().remove("checksums");
    write_manifest(&cached, &m);
    let (again, stderr) = run(&mut bin());
    assert_eq!(first, again);
    assert!(stderr.contains("converting"), "{stderr}");
    assert!(Store::open(&cached).is_ok());
}

#[test]
fn stale_temporaries_of_dead_processes_are_removed_at_write_and_open() {
    let dir = tempfile::tempdir().unwrap();
    let store = converted(dir.path());
    // No process has this id (Linux ids stop at 2^22); process 1 always runs.
    let dead = dir.path().join(".s.tmp.999999999");
    let live = dir.path().join(".s.tmp.1");
    let dead_file = store.join(".manifest.json.tmp.999999999");
    let live_file = store.join(".manifest.json.tmp.1");
    std::fs::create_dir(&dead).unwrap();
    std::fs::write(dead.join("data.bin"), b"half").unwrap();
    std::fs::create_dir(&live).unwrap();
    std::fs::write(&dead_file, b"{").unwrap();
    std::fs::write(&live_file, b"{").unwrap();
    Store::open(&store).unwrap();
    assert!(!dead.exists() && !dead_file.exists());
    assert!(live.exists() && live_file.exists());
}

/// Every single-field edit of a stories260K store's manifest: refused by `convert --verify` and
/// at load, or the same greedy tokens as the unedited store.
#[test]
fn every_single_field_edit_of_the_manifest_is_refused_or_harmless() {
    let dir = tempfile::tempdir().unwrap();
    let store = converted(dir.path());
    let pristine = manifest(&store);
    let expected = greedy_run(&Arc::new(Store::open(&store).unwrap())).unwrap();
    let mut edits = Vec::new();
    single_field_edits(&pristine, &mut Vec::new(), &mut edits);
    let mut counts = Counts::default();
    let sample_every = edits.len() / 12 + 1;
    for (i, (path, edited)) in edits.iter().enumerate() {
        write_manifest(&store, edited);
        let loaded = Store::open(&store);
        let verified = verify(&store);
        counts.tried += 1;
        counts.refused_at_verify += verified.is_err() as usize;
        let refused_at_load = loaded.is_err();
        let ran = match loaded {
            Err(_) => {
                counts.refused_at_load += 1;
                assert!(verified.is_err(), "{path}: loads refused but verify passed");
                None
            }
            Ok(s) => {
                let s = Arc::new(s);
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| greedy_run(&s)));
                Some(r)
            }
        };
        match ran {
            None => {}
            Some(Ok(Ok(toks))) if toks == expected => counts.unchanged += 1,
            Some(Ok(Ok(toks))) => {
                counts.wrong.push(format!("{path}: {toks:?}"));
            }
            Some(Ok(Err(e))) => counts.wrong.push(format!("{path}: failed at run: {e}")),
            Some(Err(_)) => counts.wrong.push(format!("{path}: panicked")),
        }
        // A sample through the binary: the same verdicts, no panic.
        if i % sample_every == 0 {
            assert_eq!(cli_verify(&store).is_err(), verified.is_err(), "{path}");
            if refused_at_load {
                assert!(cli_run(&store, "1,2,3").is_err(), "{path}: cli run passed");
            }
        }
    }
    write_manifest(&store, &pristine);
    eprintln!(
        "manifest edits: {} tried, {} refused at verify, {} refused at load, {} unchanged output, {} wrong",
        counts.tried,
        counts.refused_at_verify,
        counts.refused_at_load,
        counts.unchanged,
        counts.wrong.len()
    );
    assert!(counts.tried > 500, "{}", counts.tried);
    assert!(
        counts.wrong.is_empty(),
        "{} of {} edits changed the output without being refused:\n{}",
        counts.wrong.len(),
        counts.tried,
        counts.wrong.join("\n")
    );
}

#[derive(Default)]
struct Counts {
    tried: usize,
    refused_at_verify: usize,
    refused_at_load: usize,
    unchanged: usize,
    wrong: Vec<String>,
}

/// Every single-field edit of `v` (as whole documents, with the edited field's path): numbers
/// +1, -1 and ×10; strings with one character changed; each array element removed; bools
/// flipped; each object key removed.
fn single_field_edits(root: &Value, path: &mut Vec<Step>, out: &mut Vec<(String, Value)>) {
    let here = get(root, path).clone();
    match &here {
        Value::Number(n) => {
            if let Some(u) = n.as_u64() {
                edit_at(root, path, Some((u + 1).into()), " +1", out);
                if u > 0 {
                    edit_at(root, path, Some((u - 1).into()), " -1", out);
                    edit_at(root, path, Some((u.saturating_mul(10)).into()), " x10", out);
                }
            } else if let Some(f) = n.as_f64() {
                edit_at(root, path, Some((f + 1.0).into()), " +1", out);
                edit_at(root, path, Some((f - 1.0).into()), " -1", out);
                if f != 0.0 {
                    edit_at(root, path, Some((f * 10.0).into()), " x10", out);
                }
            }
        }
        Value::String(t) => {
            let mut chars: Vec<char> = t.chars().collect();
            match chars.last_mut() {
                Some(c) => *c = if *c == 'a' { 'b' } else { 'a' },
                None => chars.push('a'),
            }
            edit_at(
                root,
                path,
                Some(chars.into_iter().collect::<String>().into()),
                " char",
                out,
            );
        }
        Value::Bool(b) => edit_at(root, path, Some((!b).into()), " flipped", out),
        Value::Array(items) => {
            for i in 0..items.len() {
                path.push(Step::Index(i));
                edit_at(root, path, None, " removed", out);
                single_field_edits(root, path, out);
                path.pop();
            }
        }
        Value::Object(map) => {
            for k in map.keys() {
                path.push(Step::Key(k.clone()));
                edit_at(root, path, None, " removed", out);
                single_field_edits(root, path, out);
                path.pop();
            }
        }
        Value::Null => edit_at(root, path, Some(Value::from(0)), " set", out),
    }
}

/// `root` with the value at `path` replaced (or removed), as one edit.
fn edit_at(
    root: &Value,
    path: &[Step],
    replacement: Option<Value>,
    what: &str,
    out: &mut Vec<(String, Value)>,
) {
    let mut doc = root.clone();
    match replacement {
        Some(r) => *get_mut(&mut doc, path) = r,
        None => remove(&mut doc, path),
    }
    out.push((format!("{}{what}", show(path)), doc));
}

#[derive(Clone, Debug)]
enum Step {
    Key(String),
    Index(usize),
}

fn show(path: &[Step]) -> String {
    path.iter()
        .map(|s| match s {
            Step::Key(k) => format!(".{k}"),
            Step::Index(i) => format!("[{i}]"),
        })
        .collect()
}

fn get<'a>(v: &'a Value, path: &[Step]) -> &'a Value {
    path.iter().fold(v, |v, s| match s {
        Step::Key(k) => &v[k.as_str()],
        Step::Index(i) => &v[*i],
    })
}

fn get_mut<'a>(v: &'a mut Value, path: &[Step]) -> &'a mut Value {
    path.iter().fold(v, |v, s| match s {
        Step::Key(k) => &mut v[k.as_str()],
        Step::Index(i) => &mut v[*i],
    })
}

fn remove(v: &mut Value, path: &[Step]) {
    let (last, parent) = path.split_last().unwrap();
    match (get_mut(v, parent), last) {
        (Value::Object(m), Step::Key(k)) => {
            m.remove(k);
        }
        (Value::Array(a), Step::Index(i)) => {
            a.remove(*i);
        }
        _ => unreachable!("a path leads to its parent's key or index"),
    }
}
