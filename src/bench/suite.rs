//! The suite's matrix: which `--gpu-mem` budgets and prompt lengths to run, and turning each
//! measured cell into a figure beside its bound and the plan's prediction. Loading a model and
//! running it is the caller's ([`CellRunner`]): this module knows no CLI and no device.

use serde_json::Value;

use super::bounds::{self, Bound, Rates, Traffic};
use super::measure::Measured;
use super::report::{BudgetPoint, Cell, CellKind, Status};
use crate::plan::human_bytes;

/// One entry of `--budgets`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BudgetChoice {
    /// No budget: everything resident.
    Whole,
    /// The smallest budget the plan accepts.
    Min,
    Bytes(u64),
}

/// The fixed budgets the suite tries by default (kept when between the minimum and the whole
/// model's need).
pub const DEFAULT_BUDGETS: [u64; 4] = [24 << 30, 12 << 30, 8 << 30, 4 << 30];

/// `whole,24G,12G,min` → choices; sizes parsed by `size` (the CLI's `--gpu-mem` parser).
pub fn parse_budget_list(
    s: &str,
    size: impl Fn(&str) -> Result<u64, String>,
) -> Result<Vec<BudgetChoice>, String> {
    let mut out = Vec::new();
    for item in s.split(',').map(str::trim) {
        if item.is_empty() {
            return Err(format!("`{s}`: empty entry in the budget list"));
        }
        out.push(match item.to_ascii_lowercase().as_str() {
            "whole" => BudgetChoice::Whole,
            "min" => BudgetChoice::Min,
            _ => BudgetChoice::Bytes(size(item).map_err(|e| {
                format!("budget list `{s}`: {e} (entries are sizes, `whole` or `min`)")
            })?),
        });
    }
    Ok(out)
}

/// `128,2048` → prompt lengths (positive).
pub fn parse_prompt_list(s: &str) -> Result<Vec<usize>, String> {
    s.split(',')
        .map(str::trim)
        .map(|p| match p.parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(format!(
                "prompt list `{s}`: `{p}` is not a positive number of tokens"
            )),
        })
        .collect()
}

/// The budget axis, largest first. Default: whole, 24G, 12G, 8G, 4G and the minimum, keeping
/// the sizes below `whole_need` and at least `minimum`, with the midpoint of minimum and whole
/// added when that leaves no size between them. `explicit` (`--budgets`) replaces the list;
/// `cap` (an emulated card's memory) drops every budget above it, and the whole model when it
/// needs more. Returns the points and notes on what was dropped.
pub fn select_budgets(
    explicit: Option<&[BudgetChoice]>,
    whole_need: u64,
    minimum: u64,
    cap: Option<u64>,
) -> (Vec<BudgetPoint>, Vec<String>) {
    let mut notes = Vec::new();
    let mut sizes: Vec<(u64, String)> = Vec::new();
    let mut whole = false;
    match explicit {
        Some(list) => {
            for c in list {
                match *c {
                    BudgetChoice::Whole => whole = true,
                    BudgetChoice::Min => {
                        sizes.push((minimum, format!("min {}", human_bytes(minimum))))
                    }
                    BudgetChoice::Bytes(b) => sizes.push((b, human_bytes(b))),
                }
            }
        }
        None => {
            whole = true;
            for b in DEFAULT_BUDGETS {
                if b < whole_need && b >= minimum {
                    sizes.push((b, human_bytes(b)));
                }
            }
            if minimum < whole_need {
                if sizes.is_empty() {
                    let mid = minimum + (whole_need - minimum) / 2;
                    sizes.push((mid, format!("mid {}", human_bytes(mid))));
                }
                sizes.push((minimum, format!("min {}", human_bytes(minimum))));
            }
        }
    }
    if let Some(cap) = cap {
        if whole && whole_need > cap {
            whole = false;
            notes.push(format!(
                "the whole model needs {} of device memory, more than the emulated card's {}: no whole-model run",
                human_bytes(whole_need),
                human_bytes(cap)
            ));
        }
        let before = sizes.len();
        sizes.retain(|(b, _)| *b <= cap);
        if sizes.len() < before {
            notes.push(format!(
                "{} budget(s) above the emulated card's {} dropped",
                before - sizes.len(),
                human_bytes(cap)
            ));
        }
    }
    sizes.sort_by_key(|s| std::cmp::Reverse(s.0));
    sizes.dedup_by_key(|s| s.0);
    let mut points = Vec::new();
    if whole {
        points.push(BudgetPoint::whole());
    }
    points.extend(sizes.into_iter().map(|(b, label)| BudgetPoint {
        label,
        gpu_mem_bytes: Some(b),
    }));
    (points, notes)
}

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

    const G: u64 = 1 << 30;

    fn gib(s: &str) -> Result<u64, String> {
        s.strip_suffix('G')
            .and_then(|n| n.parse::<u64>().ok())
            .map(|n| n << 30)
            .ok_or_else(|| format!("`{s}` is not a size"))
    }

    fn sizes(p: &[BudgetPoint]) -> Vec<Option<u64>> {
        p.iter().map(|b| b.gpu_mem_bytes).collect()
    }

    #[test]
    fn default_budgets_lie_between_the_minimum_and_the_whole_model() {
        let (p, _) = select_budgets(None, 14 * G, 3 * G, None);
        assert_eq!(
            sizes(&p),
            [None, Some(12 * G), Some(8 * G), Some(4 * G), Some(3 * G)]
        );
        assert_eq!(p[0].label, "whole");
        assert!(p[4].label.starts_with("min"));
    }

    #[test]
    fn a_tiny_model_gets_the_midpoint() {
        let (p, _) = select_budgets(None, 600_000, 400_000, None);
        assert_eq!(sizes(&p), [None, Some(500_000), Some(400_000)]);
        assert!(p[1].label.starts_with("mid"));
    }

    #[test]
    fn an_emulated_card_caps_the_budgets() {
        let (p, notes) = select_budgets(None, 30 * G, 3 * G, Some(12 * G));
        assert_eq!(
            sizes(&p),
            [Some(12 * G), Some(8 * G), Some(4 * G), Some(3 * G)]
        );
        assert!(
            notes.iter().any(|n| n.contains("no whole-model run")),
            "{notes:?}"
        );
        let list = parse_budget_list("whole,24G,min", gib).unwrap();
        let (p, _) = select_budgets(Some(&list), 10 * G, 2 * G, Some(12 * G));
        assert_eq!(sizes(&p), [None, Some(2 * G)]);
    }

    #[test]
    fn budget_and_prompt_lists_parse_or_say_why_not() {
        assert_eq!(
            parse_budget_list("whole, 4G ,min", gib).unwrap(),
            [
                BudgetChoice::Whole,
                BudgetChoice::Bytes(4 * G),
                BudgetChoice::Min
            ]
        );
        assert!(
            parse_budget_list("4G,lots", gib)
                .unwrap_err()
                .contains("lots")
        );
        assert!(parse_budget_list("4G,,min", gib).is_err());
        assert_eq!(parse_prompt_list("16,64").unwrap(), [16, 64]);
        assert!(parse_prompt_list("16,0").is_err());
        assert!(parse_prompt_list("x").is_err());
    }

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
