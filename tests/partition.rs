//! Step-aware partitioning of long prompts (HyperGen) and KV caches in host memory, on the
//! budgeted device: for random budgets and step sizes that force every layout the planner has —
//! one step; row groups with the hidden states on the device or in host memory; the KV cache on
//! the device or in host memory, decode over a host-kept cache attending on the CPU or on the
//! device by the host's rates — a prompt's logits and the decode after it equal the
//! unpartitioned run's (f32, ≤ 1e-4 relative), the device's measured peak while each layer runs
//! each group equals the plan's device bytes, and the bytes a decoded token moves are the plan's.
//! On the engine alone: the same layouts forced by hand give every row's logits of one step, and
//! a KV cache in host memory gives the on-device result bit for bit (attended on the CPU: within
//! rounding).

mod common;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use gpu_offload::backend::KvType;
use gpu_offload::backend::sim::SimBackend;
use gpu_offload::engine::{Engine, Logits, StepTap};
use gpu_offload::footprint::Ledger;
use gpu_offload::footprint::PrefillLayout;
use gpu_offload::plan::{Budget, HardwareProfile, Plan, make_plan};
use gpu_offload::store::Store;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

const PROMPT: usize = 300;
const DECODE: usize = 4;

fn tokens(vocab: usize) -> Vec<u32> {
    (0..PROMPT + DECODE)
        .map(|i| ((i * 7919 + 13) % (vocab - 4) + 3) as u32)
        .collect()
}

fn budget(gpu_mem: u64, window: usize, batch: usize) -> Budget {
    Budget {
        kv_type: KvType::F32,
        prompt: PROMPT,
        ..Budget::new(gpu_mem, None, window, PROMPT + DECODE, batch)
    }
}

/// The layout a plan gives the prompt: (partitioned, hidden states on the device, KV on the
/// device).
fn mode(p: &PrefillLayout) -> (bool, bool, bool) {
    (
        p.partitions(PROMPT),
        p.partitions(PROMPT) && p.residual_on_device(PROMPT),
        !p.kv_host,
    )
}

/// Checks, at every group a layer has run, that the device holds exactly `want` bytes at its
/// peak since the last one.
struct PeakTap {
    ledger: Arc<Ledger>,
    want: u64,
    seen: Mutex<Vec<String>>,
    steps: Mutex<usize>,
}

impl StepTap for PeakTap {
    fn group_done(&self, layer: usize, first: usize, rows: usize) {
        let peak = self.ledger.snapshot().hbm_peak;
        if peak != self.want {
            self.seen.lock().unwrap().push(format!(
                "layer {layer}, rows {first}..{}: peak {peak}, planned {}",
                first + rows,
                self.want
            ));
        }
        *self.steps.lock().unwrap() += 1;
        self.ledger.reset_peaks();
    }
}

fn engine(store: &Arc<Store>, plan: &Plan, ledger: &Arc<Ledger>) -> Engine<SimBackend> {
    common::offloaded(store, plan, ledger, plan.budget.kv_type)
}

fn close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1.0);
    let diff = got
        .iter()
        .zip(want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(
        diff <= 1e-4 * scale,
        "{what}: logits differ by {diff} (scale {scale})"
    );
}

#[test]
fn partitioned_prefill_equals_one_step_and_holds_the_planned_bytes_each_step() {
    let dir = tempfile::tempdir().unwrap();
    let store = common::store_of(&common::stories260k(), &dir);
    let spec = store.manifest.spec.clone();
    let toks = tokens(spec.vocab_size);
    let hw = HardwareProfile::load("cpu-sim").unwrap();

    // Unpartitioned: every weight resident, the prompt one step.
    let all_plan = make_plan(&store.manifest, &budget(u64::MAX / 4, 1, PROMPT), &hw).unwrap();
    assert!(!all_plan.prefill.partitions(PROMPT));
    let reference = engine(&store, &all_plan, &Ledger::new(None, None));
    let mut s = reference.new_session(PROMPT + DECODE).unwrap();
    let mut want = vec![
        reference
            .forward(&mut s, &toks[..PROMPT], Logits::Last)
            .unwrap(),
    ];
    for &t in &toks[PROMPT..] {
        want.push(reference.forward(&mut s, &[t], Logits::Last).unwrap());
    }

    let mut rng = StdRng::seed_from_u64(7);
    let mut seen = BTreeSet::new();
    let mut attention_seen = BTreeSet::new();
    let every = [
        (false, false, true),
        (true, true, true),
        (true, false, true),
        (true, true, false),
        (true, false, false),
    ];
    for case in 0..60 {
        if every.iter().all(|m| seen.contains(m)) && attention_seen.len() == 2 && case >= 12 {
            break;
        }
        // Half the cases on a host whose DRAM is slower than its link: decode then brings a
        // host-kept cache to the device instead of attending on the CPU.
        let mut hw = hw.clone();
        if rng.random_bool(0.5) {
            hw.dram_read_bytes_per_s = hw.h2d_pinned_bytes_per_s / 2.0;
        }
        let window = rng.random_range(1..=3usize);
        let batch = if rng.random_bool(0.3) {
            PROMPT
        } else {
            rng.random_range(1..PROMPT)
        };
        let (min, all) = common::gpu_range(&store.manifest, &hw, |g| budget(g, window, batch));
        let gpu_mem = rng.random_range(min..=all);
        let plan = make_plan(&store.manifest, &budget(gpu_mem, window, batch), &hw).unwrap();
        let m = mode(&plan.prefill);
        seen.insert(m);
        if plan.prefill.kv_host {
            attention_seen.insert(plan.prefill.cpu_attention);
        }
        let what = format!(
            "{gpu_mem} bytes (minimum {min}), window {window}, batch {batch}: {:?}",
            plan.prefill
        );

        let ledger = Ledger::new(Some(plan.ledger_budget()), None);
        let tap = Arc::new(PeakTap {
            ledger: ledger.clone(),
            want: plan.gpu.placed,
            seen: Mutex::new(Vec::new()),
            steps: Mutex::new(0),
        });
        let e = engine(&store, &plan, &ledger).with_step_tap(tap.clone());
        let mut s = e.new_session(PROMPT + DECODE).unwrap();
        ledger.reset_peaks();
        let got = e.forward(&mut s, &toks[..PROMPT], Logits::Last).unwrap();
        close(&got, &want[0], &format!("prefill, {what}"));
        let groups = PROMPT.div_ceil(plan.prefill.group.min(PROMPT));
        assert_eq!(
            *tap.steps.lock().unwrap(),
            groups * spec.n_layers,
            "{what}: steps"
        );
        let off = tap.seen.lock().unwrap().clone();
        assert!(
            off.is_empty(),
            "{what}: the device's peak is not the plan's\n{}\n{}",
            off.join("\n"),
            plan.report()
        );
        for (i, &t) in toks[PROMPT..].iter().enumerate() {
            e.settle();
            let before = ledger.snapshot();
            let got = e.forward(&mut s, &[t], Logits::Last).unwrap();
            e.settle();
            let after = ledger.snapshot();
            close(&got, &want[i + 1], &format!("decode {i}, {what}"));
            let (h2d, d2h) = plan.decode_bytes_at(PROMPT + i);
            assert_eq!(
                after.h2d_bytes - before.h2d_bytes,
                h2d,
                "{what}: token {i} in"
            );
            assert_eq!(
                after.d2h_bytes - before.d2h_bytes,
                d2h,
                "{what}: token {i} out"
            );
            assert!(after.hbm_peak <= plan.gpu.placed, "{what}: decode peak");
        }
    }
    assert_eq!(
        attention_seen.len(),
        2,
        "a host-kept cache's decode ran only with CPU attention = {attention_seen:?}"
    );
    for m in every {
        assert!(
            seen.contains(&m),
            "no budget gave the layout (partitioned, hidden on device, KV on device) = {m:?}; seen {seen:?}"
        );
    }
}

/// The engine alone, layouts forced: every row's logits of a partitioned prompt equal one
/// step's, and a host-kept KV cache gives the device-kept one's results bit for bit, through
/// the prompt, decode, and a cache read back and written into a fresh session.
#[test]
fn forced_layouts_give_one_steps_logits_and_host_kv_the_devices_bits() {
    let model = gpu_offload::model::Model::load(&common::stories260k()).unwrap();
    let toks = tokens(model.spec.vocab_size);
    let run = |layout: PrefillLayout, logits: Logits| {
        let e = common::cpu_engine(&model, KvType::F16)
            .with_prefill(layout)
            .unwrap();
        let mut s = e.new_session(PROMPT + DECODE).unwrap();
        e.enable_probe(&mut s).unwrap();
        let mut out = vec![e.forward(&mut s, &toks[..PROMPT], logits).unwrap()];
        for &t in &toks[PROMPT..] {
            out.push(e.forward(&mut s, &[t], Logits::Last).unwrap());
        }
        let kv = e.read_kv(&mut s, 0, PROMPT + DECODE).unwrap();
        let density = e.attention_density(&mut s, 16).unwrap();
        // The cache written into a fresh session continues as the original does.
        let mut fresh = e.new_session(PROMPT + DECODE + 1).unwrap();
        e.write_kv(&mut fresh, 0, PROMPT + DECODE, &kv).unwrap();
        fresh.set_position(PROMPT + DECODE).unwrap();
        let next = toks[3];
        let a = e.forward(&mut fresh, &[next], Logits::Last).unwrap();
        (out, kv, density, a)
    };
    let one_step = PrefillLayout::default();
    let (want, want_kv, want_density, _) = run(one_step, Logits::All);
    assert_eq!(want[0].len(), PROMPT * model.spec.vocab_size);
    for group in [1, 7, 64, 299] {
        for residual_rows in [0, PROMPT] {
            let device_kv = PrefillLayout {
                group,
                residual_rows,
                kv_host: false,
                cpu_attention: false,
                joins: false,
            };
            let host_kv = PrefillLayout {
                kv_host: true,
                ..device_kv
            };
            let what = format!("group {group}, hidden on device {}", residual_rows > 0);
            let (got, kv, density, next) = run(device_kv, Logits::All);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                close(g, w, &format!("{what}: call {i}"));
            }
            let kv_scale = want_kv.iter().fold(0f32, |m, v| m.max(v.abs()));
            close(&kv, &want_kv, &format!("{what}: KV (scale {kv_scale})"));
            assert_eq!(density.len(), want_density.len(), "{what}: density blocks");
            let host = run(host_kv, Logits::All);
            assert!(
                host.0 == got,
                "{what}: host KV logits differ from device KV"
            );
            assert!(host.1 == kv, "{what}: host KV rows differ");
            assert!(host.2 == density, "{what}: host KV density differs");
            assert!(host.3 == next, "{what}: host KV restored session differs");
            // Decode attending on the CPU over the host copy: the same numbers within rounding
            // (another summation order), the cache rows bit for bit.
            let cpu = run(
                PrefillLayout {
                    cpu_attention: true,
                    ..host_kv
                },
                Logits::All,
            );
            for (i, (g, w)) in cpu.0.iter().zip(&got).enumerate() {
                close(g, w, &format!("{what}: CPU attention, call {i}"));
            }
            close(&cpu.1, &kv, &format!("{what}: CPU attention, KV"));
            close(&cpu.3, &next, &format!("{what}: CPU attention, restored"));
        }
    }
}

#[test]
fn bad_layouts_are_refused() {
    let model = gpu_offload::model::Model::load(&common::stories260k()).unwrap();
    for group in [0, gpu_offload::footprint::MAX_GROUP + 1] {
        let e = common::cpu_engine(&model, KvType::F32).with_prefill(PrefillLayout {
            group,
            ..PrefillLayout::default()
        });
        assert!(e.is_err(), "group {group} accepted");
    }
}

#[test]
fn steps_longer_than_max_batch_give_the_logits_of_max_batch_steps() {
    // A whole-GPU engine takes a long prompt in one step of up to MAX_GROUP rows where the
    // device holds it (engine::whole_device_group): every row's logits, the decode after it and
    // the cache equal those of steps of MAX_BATCH rows (here partitioned) within rounding.
    use gpu_offload::model::synth::{SynthSpec, synthesize_gguf};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    let spec = SynthSpec {
        max_context: 2048,
        vocab_size: 300,
        ..SynthSpec::preset("tiny").unwrap()
    };
    synthesize_gguf(&spec, &path, false, None, &mut |_, _| {}).unwrap();
    let model = gpu_offload::model::Model::load(&path).unwrap();
    let prompt = gpu_offload::footprint::MAX_BATCH * 2 + 300;
    let toks: Vec<u32> = (0..prompt + DECODE)
        .map(|i| ((i * 7919 + 13) % (model.spec.vocab_size - 4) + 3) as u32)
        .collect();
    let run = |group: usize| {
        let e = common::cpu_engine(&model, KvType::F32)
            .with_prefill(PrefillLayout {
                group,
                ..PrefillLayout::default()
            })
            .unwrap();
        let mut s = e.new_session(prompt + DECODE).unwrap();
        let mut out = vec![e.forward(&mut s, &toks[..prompt], Logits::All).unwrap()];
        for &t in &toks[prompt..] {
            out.push(e.forward(&mut s, &[t], Logits::Last).unwrap());
        }
        (out, e.read_kv(&mut s, 0, prompt + DECODE).unwrap())
    };
    let (want, want_kv) = run(gpu_offload::footprint::MAX_BATCH);
    assert_eq!(want[0].len(), prompt * model.spec.vocab_size);
    for group in [prompt, gpu_offload::footprint::MAX_BATCH + 1] {
        let (got, kv) = run(group);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            close(g, w, &format!("group {group}: call {i}"));
        }
        close(&kv, &want_kv, &format!("group {group}: KV"));
    }
}

#[test]
fn a_whole_device_takes_the_longest_call_in_the_largest_step_that_fits() {
    use gpu_offload::footprint::MAX_GROUP;
    use gpu_offload::footprint::{MAX_BATCH, whole_device_group};
    let kib = |g: usize| g as u64 * 1024;
    let any = MAX_GROUP;
    // The call itself, capped at MAX_GROUP and at the step asked for.
    assert_eq!(whole_device_group(4000, any, kib(4000), kib), 4000);
    assert_eq!(whole_device_group(100_000, any, u64::MAX, kib), MAX_GROUP);
    assert_eq!(whole_device_group(4000, 3000, u64::MAX, kib), 3000);
    // Halved until it fits; never below MAX_BATCH, which a short call keeps too, unless a
    // smaller step is asked for.
    assert_eq!(whole_device_group(4000, any, kib(2500), kib), 2000);
    assert_eq!(whole_device_group(4000, any, kib(10), kib), MAX_BATCH);
    assert_eq!(whole_device_group(300, any, u64::MAX, kib), MAX_BATCH);
    assert_eq!(whole_device_group(4000, 100, u64::MAX, kib), 100);
}

/// Where decode attends over a host-kept cache follows the CPU's attention rate where `doctor`
/// measured one (else the DRAM read rate): below the link's rate the cache comes to the device,
/// however fast the DRAM is; above it the CPU attends, and the predicted decode time reads the
/// cache at that rate.
#[test]
fn a_measured_cpu_attention_rate_decides_where_decode_attends() {
    let dir = tempfile::tempdir().unwrap();
    let store = common::store_of(&common::stories260k(), &dir);
    let hw = HardwareProfile::load("cpu-sim").unwrap();
    assert!(hw.cpu_attention_bytes_per_s.is_none());
    assert!(hw.dram_read_bytes_per_s > hw.h2d_pinned_bytes_per_s);
    let (min, _) = common::gpu_range(&store.manifest, &hw, |g| budget(g, 1, 16));
    let plan_on =
        |hw: &HardwareProfile| make_plan(&store.manifest, &budget(min, 1, 16), hw).unwrap();
    let dram = plan_on(&hw);
    assert!(
        dram.prefill.kv_host,
        "the smallest budget keeps the cache in host memory"
    );
    assert!(
        dram.prefill.cpu_attention,
        "DRAM faster than the link: the CPU attends"
    );
    let measured = |rate: f64| HardwareProfile {
        cpu_attention_bytes_per_s: Some(rate),
        ..hw.clone()
    };
    let slow = plan_on(&measured(hw.h2d_pinned_bytes_per_s / 4.0));
    assert!(slow.prefill.kv_host && !slow.prefill.cpu_attention);
    assert_eq!(slow.prediction.cpu_s, 0.0, "nothing left for the CPU");
    let fast = plan_on(&measured(hw.h2d_pinned_bytes_per_s * 1.5));
    assert!(fast.prefill.cpu_attention);
    // The same bytes at 15 GB/s where the DRAM rate was 20.
    let ratio = fast.prediction.cpu_s / dram.prediction.cpu_s;
    let want = hw.dram_read_bytes_per_s / (hw.h2d_pinned_bytes_per_s * 1.5);
    assert!((ratio - want).abs() < 1e-9, "{ratio} vs {want}");
    assert!(fast.prediction.tokens_per_s <= dram.prediction.tokens_per_s);
    // A measured rate that is not a rate is refused.
    assert!(measured(0.0).validate().is_err());
    assert!(measured(f64::NAN).validate().is_err());
}

/// A measured prompt attention rate costs a prompt's attention FLOPs at that rate and its
/// products at the matrix-product rate; unmeasured, both at the latter. Long prompts, whose
/// attention grows with the square of their length, move the most.
#[test]
fn a_measured_attention_rate_prices_a_prompts_attention() {
    let dir = tempfile::tempdir().unwrap();
    let store = common::store_of(&common::stories260k(), &dir);
    let hw = HardwareProfile::load("h100-80g").unwrap();
    assert!(hw.attention_flops_per_s.is_none());
    let plan = make_plan(&store.manifest, &budget(8 << 30, 1, 256), &hw).unwrap();
    let measured = |rate: f64| HardwareProfile {
        attention_flops_per_s: Some(rate),
        ..hw.clone()
    };
    let slower = make_plan(
        &store.manifest,
        &budget(8 << 30, 1, 256),
        &measured(hw.matmul_flops_per_s / 3.0),
    )
    .unwrap();
    for tokens in [16, 256] {
        let (a, b) = (
            plan.prefill_prediction(tokens),
            slower.prefill_prediction(tokens),
        );
        assert_eq!(a.flops, b.flops);
        assert!(a.attention_flops > 0.0 && a.attention_flops < a.flops);
        let want = a.compute_s + 2.0 * a.attention_flops / hw.matmul_flops_per_s;
        assert!(
            (b.compute_s - want).abs() <= 1e-12 * want,
            "{tokens}: {} vs {want}",
            b.compute_s
        );
        // Unmeasured is the matrix-product rate for every FLOP.
        let all = a.flops / hw.matmul_flops_per_s;
        assert!((a.compute_s - all).abs() <= 1e-12 * all);
    }
    assert!(measured(0.0).validate().is_err());
    assert!(measured(f64::INFINITY).validate().is_err());
}
