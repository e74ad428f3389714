//! The suite's matrix: every cell of budgets × prompt lengths (the axes are `axes.rs`'s) run
//! through a [`CellRunner`], and each measured cell turned into a figure beside its bound and
//! the plan's prediction. Loading a model and running it is the caller's ([`CellRunner`]): this
//! module knows no CLI and no device.

use serde_json::Value;

use super::axes::BudgetPoint;
use super::report::{Cell, CellKind, Status};
use crate::bench::bounds::{self, Bound, Rates, Traffic};
use crate::bench::measure::Measured;

/// What a cell asks the runner to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CellJob {
    pub kind: CellKind,
    pub prompt_tokens: usize,
    /// Tokens to generate (1 for prefill cells).
    pub tokens: usize,
}

/// What the runner measured for a cell, with the bytes its bounds need.
#[derive(Clone, Debug, Default)]
pub struct CellRun {
    pub measured: Measured,
    /// Bytes per decoded token through each resource.
    pub traffic: Traffic,
    /// Per prefill pass: weight bytes streamed over PCIe, and weight bytes read from device
    /// memory.
    pub pass_streamed_bytes: f64,
    pub pass_read_bytes: f64,
    /// The plan's prediction: tokens/s and the resource it names.
    pub prediction: Option<(f64, String)>,
    pub gpu_peak_bytes: Option<u64>,
    pub gpu_process_peak_bytes: Option<u64>,
    pub load_s: f64,
    /// `run --json`'s memory object.
    pub memory: Value,
}

pub enum CellOutcome {
    Ran(Box<CellRun>),
    /// The plan refused the budget; the reason.
    Refused(String),
    Failed(String),
}

/// Loads and runs the model for one cell.
pub trait CellRunner {
    fn run(&mut self, budget: &BudgetPoint, job: CellJob) -> CellOutcome;
}

/// Prompt tokens one prefill pass evaluates.
pub const PASS_TOKENS: usize = crate::footprint::MAX_BATCH;

/// A measured run as a cell: bound, prediction, fractions, and the bound check.
pub fn cell_of(budget: &BudgetPoint, job: CellJob, run: &CellRun, rates: &Rates) -> Cell {
    let m = &run.measured;
    let mut c = Cell::not_run(
        budget,
        job.kind,
        job.prompt_tokens,
        job.tokens,
        Status::Ok,
        String::new(),
    );
    c.reason = None;
    c.ttft_s = Some(m.ttft_s);
    c.gpu_peak_bytes = run.gpu_peak_bytes;
    c.gpu_process_peak_bytes = run.gpu_process_peak_bytes;
    c.load_s = Some(run.load_s);
    c.memory = Some(run.memory.clone());
    c.h2d_bytes_per_token = run
        .memory
        .get("h2d_bytes_per_token")
        .and_then(Value::as_f64);
    c.ssd_bytes_per_token = run
        .memory
        .get("ssd_bytes_per_token")
        .and_then(Value::as_f64);
    let (figure, bound, what): (f64, Bound, String) = match job.kind {
        CellKind::Decode => {
            let b = Bound::of(&run.traffic, rates);
            c.predicted_tokens_per_s = run.prediction.as_ref().map(|p| p.0);
            c.predicted_limited_by = run.prediction.as_ref().map(|p| p.1.clone());
            c.fraction_of_prediction = c
                .predicted_tokens_per_s
                .filter(|p| *p > 0.0)
                .map(|p| m.decode_tokens_per_s / p);
            (
                m.decode_tokens_per_s,
                b,
                format!("decode at --gpu-mem {} (tokens/s)", budget.label),
            )
        }
        CellKind::Prefill => {
            let passes = job.prompt_tokens.div_ceil(PASS_TOKENS).max(1);
            let b = bounds::ttft_bound(run.pass_streamed_bytes, run.pass_read_bytes, passes, rates);
            c.bound_ttft_s = Some(1.0 / b.tokens_per_s);
            // In prompt tokens/s: the prompt over the bound's seconds.
            let b = Bound {
                tokens_per_s: job.prompt_tokens as f64 * b.tokens_per_s,
                ..b
            };
            (
                m.prefill_tokens_per_s,
                b,
                format!(
                    "prefill of {} tokens at --gpu-mem {} (tokens/s)",
                    job.prompt_tokens, budget.label
                ),
            )
        }
    };
    c.tokens_per_s = Some(figure);
    c.bound_tokens_per_s = Some(bound.tokens_per_s);
    c.bound_limited_by = Some(bound.limited_by.clone());
    c.bound_seconds = bound.seconds.clone();
    c.fraction_of_bound = Some(figure / bound.tokens_per_s);
    if let Err(e) = bounds::check(&what, figure, &bound, rates) {
        c.status = Status::AboveBound;
        c.reason = Some(e.to_string());
    }
    c
}

/// The matrix to run.
#[derive(Clone, Debug)]
pub struct Matrix {
    pub budgets: Vec<BudgetPoint>,
    pub prompts: Vec<usize>,
    pub decode_prompt_tokens: usize,
    pub decode_tokens: usize,
}

impl Matrix {
    pub fn cells(&self) -> usize {
        self.budgets.len() * (1 + self.prompts.len())
    }
}

/// Run every cell: per budget the decode cell, then one prefill cell per prompt. Returns the
/// decode cells, the prefill cells and one line per problem (failed, above its bound).
pub fn run_matrix(
    m: &Matrix,
    rates: &Rates,
    runner: &mut dyn CellRunner,
    progress: &mut dyn FnMut(&str),
) -> (Vec<Cell>, Vec<Cell>, Vec<String>) {
    let (mut decode, mut prefill, mut problems) = (Vec::new(), Vec::new(), Vec::new());
    for b in &m.budgets {
        let mut jobs = vec![CellJob {
            kind: CellKind::Decode,
            prompt_tokens: m.decode_prompt_tokens,
            tokens: m.decode_tokens,
        }];
        jobs.extend(m.prompts.iter().map(|&p| CellJob {
            kind: CellKind::Prefill,
            prompt_tokens: p,
            tokens: 1,
        }));
        for job in jobs {
            progress(&match job.kind {
                CellKind::Decode => format!("decode at {}", b.label),
                CellKind::Prefill => format!("prefill {} at {}", job.prompt_tokens, b.label),
            });
            let cell = match runner.run(b, job) {
                CellOutcome::Ran(run) => cell_of(b, job, &run, rates),
                CellOutcome::Refused(r) => Cell::not_run(
                    b,
                    job.kind,
                    job.prompt_tokens,
                    job.tokens,
                    Status::Refused,
                    r,
                ),
                CellOutcome::Failed(r) => Cell::not_run(
                    b,
                    job.kind,
                    job.prompt_tokens,
                    job.tokens,
                    Status::Failed,
                    r,
                ),
            };
            if matches!(cell.status, Status::Failed | Status::AboveBound) {
                problems.push(format!(
                    "{:?} {} tokens at {}: {}",
                    cell.kind,
                    cell.prompt_tokens,
                    cell.budget,
                    cell.reason.as_deref().unwrap_or("")
                ));
            }
            match job.kind {
                CellKind::Decode => decode.push(cell),
                CellKind::Prefill => prefill.push(cell),
            }
        }
    }
    (decode, prefill, problems)
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fake(f64);

    impl CellRunner for Fake {
        fn run(&mut self, b: &BudgetPoint, job: CellJob) -> CellOutcome {
            if b.gpu_mem_bytes == Some(1) {
                return CellOutcome::Refused("too small".into());
            }
            CellOutcome::Ran(Box::new(CellRun {
                measured: Measured {
                    prompt_tokens: job.prompt_tokens,
                    ttft_s: 0.5,
                    prefill_tokens_per_s: job.prompt_tokens as f64 / 0.5,
                    decode_tokens_per_s: self.0,
                    ..Default::default()
                },
                traffic: Traffic {
                    h2d_bytes: 1000.0,
                    ..Default::default()
                },
                pass_streamed_bytes: 100.0,
                prediction: Some((self.0 * 2.0, "PCIe".into())),
                ..Default::default()
            }))
        }
    }

    fn rates() -> Rates {
        Rates {
            source: "test".into(),
            hbm_read_bytes_per_s: 1e6,
            h2d_bytes_per_s: 1e4,
            dram_read_bytes_per_s: 1e6,
            ssd_read_bytes_per_s: 1e6,
        }
    }

    #[test]
    fn cells_carry_bound_prediction_and_fraction() {
        let m = Matrix {
            budgets: vec![
                BudgetPoint::whole(),
                BudgetPoint {
                    label: "tiny".into(),
                    gpu_mem_bytes: Some(1),
                },
            ],
            prompts: vec![16],
            decode_prompt_tokens: 4,
            decode_tokens: 8,
        };
        // PCIe bound: 1e4 / 1000 = 10 tok/s; 5 tok/s is half of it.
        let (d, p, problems) = run_matrix(&m, &rates(), &mut Fake(5.0), &mut |_| {});
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!((d.len(), p.len()), (2, 2));
        assert_eq!(d[0].status, Status::Ok);
        assert!((d[0].bound_tokens_per_s.unwrap() - 10.0).abs() < 1e-9);
        assert!((d[0].fraction_of_bound.unwrap() - 0.5).abs() < 1e-9);
        assert!((d[0].fraction_of_prediction.unwrap() - 0.5).abs() < 1e-9);
        assert_eq!(d[1].status, Status::Refused);
        // Prefill: one pass of 100 bytes at 1e4 B/s = 10 ms bound; 500 ms measured.
        assert!((p[0].bound_ttft_s.unwrap() - 0.01).abs() < 1e-12);
        assert!((p[0].fraction_of_bound.unwrap() - 0.02).abs() < 1e-9);
        // 50 tok/s beats the 10 tok/s bound: the bound is wrong.
        let (d, _, problems) = run_matrix(&m, &rates(), &mut Fake(50.0), &mut |_| {});
        assert_eq!(d[0].status, Status::AboveBound);
        assert!(d[0].reason.as_ref().unwrap().contains("PCIe bound"));
        assert_eq!(problems.len(), 1);
    }
}
