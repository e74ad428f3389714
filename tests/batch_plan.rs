//! Batch-aware plans on the budgeted device's profile (`cpu-sim`): at random budgets and decode
//! batches (1 to 64 sequences a step), `--cold auto` runs the mode whose predicted aggregate
//! tokens/s is the best of the candidates (stream, split, hybrid, cache units), each
//! candidate's figure is what that mode's own plan predicts for the batch, and the split's CPU
//! rows never grow with the batch — they fall somewhere where the split takes rows for one
//! sequence, since the CPU computes its rows for every sequence while the streamed bytes serve
//! all of them at once.

mod common;

use std::sync::{Arc, OnceLock};

use gpu_offload::plan::batch;
use gpu_offload::plan::choice::{Cold, ColdChoice, plan_cold};
use gpu_offload::plan::precision::Precision;
use gpu_offload::plan::preserve::Part;
use gpu_offload::plan::{Budget, HardwareProfile, PlanError};
use gpu_offload::sparsity::SparsityProfile;
use gpu_offload::store::{ConvertOptions, Store};
use proptest::prelude::*;
use rand::SeedableRng;
use rand::rngs::StdRng;

/// Sparsity target the sparse modes are planned at.
const TARGET: f64 = 0.5;

/// A store whose FFN is bundled (every mode plans), a profile of random frequencies, and the
/// budgets it runs at: made once for every case.
struct Fixture {
    name: &'static str,
    _dir: tempfile::TempDir,
    store: Arc<Store>,
    profile: SparsityProfile,
    hw: HardwareProfile,
    range: (u64, u64),
}

impl Fixture {
    fn new(name: &'static str, model: &std::path::Path, opts: &ConvertOptions) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let store = common::store_with(model, &dir, opts);
        let profile = common::random_profile(&store, &mut StdRng::seed_from_u64(5));
        let hw = HardwareProfile::load("cpu-sim").unwrap();
        let range = common::gpu_range(&store.manifest, &hw, |g| budget(g, 1));
        Fixture {
            name,
            _dir: dir,
            store,
            profile,
            hw,
            range,
        }
    }

    /// The budget `at` (0 to 1) of the way from the least that runs to what holds everything.
    fn gpu_mem(&self, at: f64) -> u64 {
        self.range.0 + ((self.range.1 - self.range.0) as f64 * at) as u64
    }

    fn plan(&self, g: u64, n: usize, mode: Cold) -> Result<ColdChoice, PlanError> {
        plan_cold(
            &self.store.manifest,
            &budget(g, n),
            &self.hw,
            mode,
            Some((&self.profile, TARGET)),
            &[Precision::FP16],
        )
    }
}

/// stories260K: its FFN bundled as stored (f32 weights).
fn stories() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| Fixture::new("stories260K", &common::stories260k(), &Default::default()))
}

/// SmolLM2-135M with its Q4_1 FFN bundled in f16 as well (`convert --bundle-ffn`): large enough
/// that cache units fit beside streamed layers.
fn smollm2() -> Option<&'static Fixture> {
    static F: OnceLock<Option<Fixture>> = OnceLock::new();
    F.get_or_init(|| {
        common::smollm2().map(|p| {
            let opts = ConvertOptions {
                bundle_quantized: true,
                ..Default::default()
            };
            Fixture::new("SmolLM2 (bundled)", &p, &opts)
        })
    })
    .as_ref()
}

/// The fixture a case draws: SmolLM2 where fetched, else stories260K.
fn fixture(smol: bool) -> &'static Fixture {
    match smol {
        true => smollm2().unwrap_or_else(stories),
        false => stories(),
    }
}

/// `gpu_mem` for 64 sessions (their KV caches and logit rows, whatever the batch), decode steps
/// of `sequences` of them: the device holds the same whatever the batch, so only the batch
/// moves the plans.
fn budget(gpu_mem: u64, sequences: usize) -> Budget {
    Budget {
        sessions: 64,
        sequences,
        logit_rows: 64,
        ..Budget::new(gpu_mem, None, 2, 48, 64)
    }
}

/// The mode a choice runs, as `--cold` names it.
fn runs(c: &ColdChoice) -> Cold {
    if c.hot.is_some() {
        Cold::Cpu
    } else if c.units.is_some() {
        Cold::Gpu
    } else if c.plan.residency.cpu_rows > 0 {
        Cold::Split
    } else {
        Cold::Stream
    }
}

/// A choice's predicted aggregate tokens/s, from the plan of the mode it runs.
fn predicted(c: &ColdChoice) -> f64 {
    match (&c.hot, &c.units) {
        (Some(h), _) => h.predicted_tokens_per_s,
        (_, Some(u)) => u.predicted_tokens_per_s,
        _ => c.plan.prediction.tokens_per_s,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, failure_persistence: None, ..ProptestConfig::default() })]

    /// `--cold auto` for n sequences a step runs the candidate predicted fastest for n, and
    /// each candidate's figure is its own mode's plan for n (cache units at least so: auto
    /// may make some layers hybrid where that is faster).
    #[test]
    fn auto_runs_the_mode_fastest_for_the_batch(smol: bool, at in 0.0f64..1.0, n in 1usize..=64) {
        let f = fixture(smol);
        let g = f.gpu_mem(at);
        let what = format!("{} at {g} bytes, {n} sequences", f.name);
        let auto = f.plan(g, n, Cold::Auto).unwrap();
        let best = auto.candidates.iter().map(|c| c.1).fold(0.0, f64::max);
        prop_assert!(best > 0.0, "{}", what);
        let chosen = runs(&auto);
        let figure = auto.candidates.iter().find(|c| c.0 == chosen).map(|c| c.1);
        prop_assert_eq!(figure, Some(predicted(&auto)), "{}: runs {:?}", what, chosen);
        prop_assert_eq!(predicted(&auto), best, "{}: runs {:?} of {:?}", what, chosen, auto.candidates);
        prop_assert_eq!(auto.plan.prediction.step.sequences, n.min(auto.plan.prefill.group), "{}", what);
        for &(mode, t) in &auto.candidates {
            let alone = predicted(&f.plan(g, n, mode).unwrap());
            if mode == Cold::Gpu {
                prop_assert!(t >= alone * (1.0 - 1e-12), "{}: {:?}", what, auto.candidates);
            } else {
                prop_assert_eq!(t, alone, "{}: {:?}", what, mode);
            }
        }
    }

    /// The split's CPU rows never grow with the batch, and fall somewhere between one
    /// sequence and 64 where the split takes rows for one and the step of 64 makes the CPU get
    /// through its neurons' bytes at most a quarter as fast as for one (its FLOPs, not DRAM,
    /// bound it). Then the balance wants at most a quarter of its rows, and a quarter of what
    /// rounds to `r > 0` rows is below `r` whenever `r` is at least a third of a checksum
    /// group (44 or more rows on these models). A smaller slowdown need not move a whole
    /// group: near the least budget that runs a step holds 4 to 7 sequences, and stories260K
    /// keeps its 108 rows there.
    #[test]
    fn split_cpu_rows_fall_as_the_batch_grows(smol: bool, at in 0.0f64..1.0) {
        let f = fixture(smol);
        let g = f.gpu_mem(at);
        let rows: Vec<usize> = (1..=64)
            .map(|n| f.plan(g, n, Cold::Split).unwrap().plan.residency.cpu_rows)
            .collect();
        for (n, w) in rows.windows(2).enumerate() {
            prop_assert!(
                w[1] <= w[0],
                "{} at {} bytes: {} CPU rows at {} sequences, {} at {}: {:?}",
                f.name, g, w[0], n + 1, w[1], n + 2, rows
            );
        }
        let at_64 = f.plan(g, 64, Cold::Split).unwrap().plan;
        let rate = batch::cpu_neuron_rate(
            &f.hw,
            batch::neuron_flops(&at_64.spec),
            at_64.shape.row_bytes[Part::Ffn.index()],
            at_64.prediction.step.sequences,
        );
        if rows[0] > 0 && rate * 4.0 <= f.hw.dram_read_bytes_per_s {
            prop_assert!(rows[63] < rows[0], "{} at {} bytes: {:?}", f.name, g, rows);
        }
    }
}

/// Where the budget splits for one sequence, more sequences make the split give rows back and
/// streaming's aggregate grow with them (its bytes serve every sequence of a step); one
/// sequence's step moves what its token does.
#[test]
fn a_batch_moves_rows_off_the_cpu_and_streaming_scales() {
    for f in [Some(stories()), smollm2()].into_iter().flatten() {
        let split_at = (1..40)
            .map(|k| f.gpu_mem(k as f64 / 40.0))
            .find(|&g| f.plan(g, 1, Cold::Split).unwrap().plan.residency.cpu_rows > 0)
            .unwrap_or_else(|| panic!("{}: some budget splits for one sequence", f.name));
        let one = f.plan(split_at, 1, Cold::Split).unwrap().plan;
        let many = f.plan(split_at, 16, Cold::Split).unwrap().plan;
        assert!(
            many.residency.cpu_rows < one.residency.cpu_rows,
            "{}: {} CPU rows for 1 sequence, {} for 16",
            f.name,
            one.residency.cpu_rows,
            many.residency.cpu_rows
        );
        let stream = |n| f.plan(split_at, n, Cold::Stream).unwrap().plan;
        let (alone, sixteen) = (stream(1), stream(16));
        assert_eq!(alone.prediction.step.sequences, 1);
        assert_eq!(alone.prediction.step.h2d_bytes, alone.per_token.h2d_bytes);
        assert_eq!(
            alone.prediction.step.hbm_read_bytes,
            alone.per_token.hbm_read_bytes
        );
        assert!(
            sixteen.prediction.tokens_per_s > 2.0 * alone.prediction.tokens_per_s,
            "{}: streaming {} tok/s for 1, {} in all for 16",
            f.name,
            alone.prediction.tokens_per_s,
            sixteen.prediction.tokens_per_s
        );
    }
}
