//! The suite's report: the `suite.json` schema (typed, serialized as written) and its Markdown
//! rendering, every figure beside its bound and the plan's prediction, peers beside ours. Pure
//! data and text: measures nothing, writes nothing.

use std::fmt::Write as _;

use serde::Serialize;
use serde_json::Value;

use super::axes::BudgetPoint;
use super::peers::PeerReport;
use crate::bench::bounds::Rates;
use crate::plan::human_bytes;

/// `schema` of suite.json; bumped when a field changes meaning.
pub const SCHEMA: &str = "gpu-offload/bench-suite/1";

#[derive(Clone, Debug, Serialize)]
pub struct SuiteReport {
    pub schema: &'static str,
    pub gpu_offload_version: &'static str,
    pub created_unix_s: u64,
    pub model: ModelInfo,
    pub device: DeviceInfo,
    /// The rates every bound divides by.
    pub rates: Rates,
    pub settings: Settings,
    /// The `--gpu-mem` axis, largest first.
    pub budgets: Vec<BudgetPoint>,
    /// One cell per budget: decode tokens/s after a short prompt.
    pub decode: Vec<Cell>,
    /// One cell per (budget, prompt length): TTFT and prefill tokens/s.
    pub prefill: Vec<Cell>,
    pub peers: Vec<PeerReport>,
    /// Cells that failed or beat their bound, one line each; empty when all is well.
    pub problems: Vec<String>,
    /// How to read the figures.
    pub notes: Vec<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct ModelInfo {
    pub name: String,
    pub path: String,
    /// "file" or "preset NAME" (synthesized).
    pub source: String,
    pub n_layers: usize,
    pub d_model: usize,
    pub vocab_size: usize,
    pub max_context: usize,
    /// Device bytes with everything resident for the decode job (the plan's total).
    pub whole_gpu_bytes: u64,
    /// The smallest `--gpu-mem` the plan accepts for the decode job.
    pub min_gpu_bytes: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct DeviceInfo {
    /// "sim" or "cuda".
    pub kind: String,
    /// What really ran: the GPU's name, or the CPU standing in for one.
    pub name: String,
    pub emulated: Option<Emulation>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Emulation {
    /// The preset (configs/) emulated.
    pub preset: String,
    pub device_bytes: u64,
    pub h2d_bytes_per_s: f64,
    /// The device that really ran.
    pub on: String,
}

#[derive(Clone, Debug, Serialize)]
pub struct Settings {
    pub prompts: Vec<usize>,
    pub decode_prompt_tokens: usize,
    pub decode_tokens: usize,
    pub reps: usize,
    /// The hardware profile the planner used for its predictions.
    pub planner_profile: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CellKind {
    Decode,
    Prefill,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Measured, within its bound.
    Ok,
    /// The planner refused the budget (the reason says what would fit).
    Refused,
    /// Loading or running failed.
    Failed,
    /// Measured faster than its bound: the bound is wrong.
    AboveBound,
}

impl Status {
    pub fn word(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Refused => "refused",
            Status::Failed => "failed",
            Status::AboveBound => "ABOVE BOUND",
        }
    }
}

/// One measured (or refused) point of the matrix.
#[derive(Clone, Debug, Serialize)]
pub struct Cell {
    pub budget: String,
    pub gpu_mem_bytes: Option<u64>,
    pub kind: CellKind,
    pub prompt_tokens: usize,
    /// Tokens generated (1 for a prefill cell: the first token).
    pub decode_tokens: usize,
    pub status: Status,
    pub reason: Option<String>,
    /// Decode tokens/s (decode cell) or prefill tokens/s (prefill cell).
    pub tokens_per_s: Option<f64>,
    pub ttft_s: Option<f64>,
    /// The physical bound in the same unit as `tokens_per_s`.
    pub bound_tokens_per_s: Option<f64>,
    /// Prefill cells: the TTFT bound (bytes only, no FLOPs).
    pub bound_ttft_s: Option<f64>,
    /// "HBM", "PCIe", "DRAM" or "SSD".
    pub bound_limited_by: Option<String>,
    /// Seconds each resource needs (per token, or per prompt for prefill), by resource.
    pub bound_seconds: std::collections::BTreeMap<String, f64>,
    /// The plan's predicted decode tokens/s (decode cells; null for prefill: the plan predicts
    /// decode only).
    pub predicted_tokens_per_s: Option<f64>,
    pub predicted_limited_by: Option<String>,
    /// tokens_per_s ÷ bound_tokens_per_s.
    pub fraction_of_bound: Option<f64>,
    pub fraction_of_prediction: Option<f64>,
    /// Peak device bytes by our ledger.
    pub gpu_peak_bytes: Option<u64>,
    /// Peak device bytes of the process as the driver saw them (null where not measured).
    pub gpu_process_peak_bytes: Option<u64>,
    pub h2d_bytes_per_token: Option<f64>,
    pub ssd_bytes_per_token: Option<f64>,
    pub load_s: Option<f64>,
    /// The `memory` object of `run --json` for this cell.
    pub memory: Option<Value>,
}

impl Cell {
    /// A cell that did not run.
    pub fn not_run(
        budget: &BudgetPoint,
        kind: CellKind,
        prompt_tokens: usize,
        decode_tokens: usize,
        status: Status,
        reason: String,
    ) -> Self {
        Cell {
            budget: budget.label.clone(),
            gpu_mem_bytes: budget.gpu_mem_bytes,
            kind,
            prompt_tokens,
            decode_tokens,
            status,
            reason: Some(reason),
            tokens_per_s: None,
            ttft_s: None,
            bound_tokens_per_s: None,
            bound_ttft_s: None,
            bound_limited_by: None,
            bound_seconds: Default::default(),
            predicted_tokens_per_s: None,
            predicted_limited_by: None,
            fraction_of_bound: None,
            fraction_of_prediction: None,
            gpu_peak_bytes: None,
            gpu_process_peak_bytes: None,
            h2d_bytes_per_token: None,
            ssd_bytes_per_token: None,
            load_s: None,
            memory: None,
        }
    }
}

fn num(v: Option<f64>, digits: usize) -> String {
    match v {
        Some(x) if x.is_finite() => format!("{x:.digits$}"),
        Some(_) => "∞".into(),
        None => "—".into(),
    }
}

fn pct(v: Option<f64>) -> String {
    v.filter(|x| x.is_finite())
        .map_or("—".into(), |x| format!("{:.0}%", 100.0 * x))
}

fn bytes(v: Option<u64>) -> String {
    v.map_or("—".into(), human_bytes)
}

fn ms(v: Option<f64>) -> String {
    v.filter(|x| x.is_finite())
        .map_or("—".into(), |s| format!("{:.2} ms", s * 1e3))
}

/// Markdown cells can't hold `|` or newlines.
fn md(s: &str) -> String {
    s.replace('|', "\\|").replace('\n', " ")
}

fn status(c: &Cell) -> String {
    match &c.reason {
        Some(r) => format!("{}: {}", c.status.word(), md(r)),
        None => c.status.word().into(),
    }
}

impl SuiteReport {
    /// The report for people: Markdown tables, bounds and predictions beside every figure.
    pub fn markdown(&self, plots: &[(&str, &str)]) -> String {
        let mut s = String::new();
        self.write_header(&mut s);
        let peer_cols: Vec<&PeerReport> = self.peers.iter().filter(|p| p.ran()).collect();
        self.write_decode_table(&mut s, &peer_cols);
        self.write_prefill_table(&mut s, &peer_cols);
        self.write_peers_plots_problems_notes(&mut s, plots);
        s
    }

    /// The title, the emulation warning and what ran: model, bounds' rates, settings.
    fn write_header(&self, s: &mut String) {
        let m = &self.model;
        let _ = writeln!(
            s,
            "# gpu-offload bench suite: {} on {}\n",
            m.name, self.device.name
        );
        if let Some(e) = &self.device.emulated {
            let _ = writeln!(
                s,
                "**Emulated {}** ({} of device memory, host→device copies paced to {:.1} GB/s) **on {}**: figures are what this run measured under that emulation, not a run on the card itself.\n",
                e.preset,
                human_bytes(e.device_bytes),
                e.h2d_bytes_per_s / 1e9,
                e.on
            );
        }
        let _ = writeln!(
            s,
            "- model: `{}` ({}), {} layers, d_model {}, vocab {}, max context {}",
            md(&m.path),
            m.source,
            m.n_layers,
            m.d_model,
            m.vocab_size,
            m.max_context
        );
        let _ = writeln!(
            s,
            "- device memory for the decode job: whole model {}, minimum {}",
            human_bytes(m.whole_gpu_bytes),
            human_bytes(m.min_gpu_bytes)
        );
        let r = &self.rates;
        let gbs = |v: f64| {
            if v.is_finite() {
                format!("{:.2} GB/s", v / 1e9)
            } else {
                "not measured".into()
            }
        };
        let _ = writeln!(
            s,
            "- bounds from {}: device memory read {}, host→device {}, DRAM read {}, SSD read {}",
            r.source,
            gbs(r.hbm_read_bytes_per_s),
            gbs(r.h2d_bytes_per_s),
            gbs(r.dram_read_bytes_per_s),
            gbs(r.ssd_read_bytes_per_s)
        );
        let st = &self.settings;
        let _ = writeln!(
            s,
            "- decode: {} tokens after a {}-token prompt; prompts {:?}; median of {} run(s) after a warm-up; planner profile {}",
            st.decode_tokens, st.decode_prompt_tokens, st.prompts, st.reps, st.planner_profile
        );
        let _ = writeln!(
            s,
            "- gpu-offload {}, schema {}\n",
            self.gpu_offload_version, self.schema
        );
    }

    /// Decode tokens/s by budget, peers' beside ours.
    fn write_decode_table(&self, s: &mut String, peer_cols: &[&PeerReport]) {
        let _ = writeln!(s, "## Decode tokens/s by --gpu-mem\n");
        let mut head = "| --gpu-mem | status | tok/s | bound (limited by) | of bound | plan predicts | of prediction | ledger peak | process peak |".to_string();
        let mut rule = "|---|---|---:|---:|---:|---:|---:|---:|---:|".to_string();
        for p in peer_cols {
            let _ = write!(head, " {} tok/s |", md(&p.name));
            rule.push_str("---:|");
        }
        let _ = writeln!(s, "{head}\n{rule}");
        for c in &self.decode {
            let _ = write!(
                s,
                "| {} | {} | {} | {} ({}) | {} | {} | {} | {} | {} |",
                c.budget,
                status(c),
                num(c.tokens_per_s, 2),
                num(c.bound_tokens_per_s, 2),
                c.bound_limited_by.as_deref().unwrap_or("—"),
                pct(c.fraction_of_bound),
                num(c.predicted_tokens_per_s, 2),
                pct(c.fraction_of_prediction),
                bytes(c.gpu_peak_bytes),
                bytes(c.gpu_process_peak_bytes)
            );
            for p in peer_cols {
                let _ = write!(s, " {} |", md(&p.decode_cell(&c.budget)));
            }
            s.push('\n');
        }
    }

    /// TTFT and prefill tokens/s by budget and prompt length, peers' beside ours.
    fn write_prefill_table(&self, s: &mut String, peer_cols: &[&PeerReport]) {
        let _ = writeln!(
            s,
            "\n## Time to first token by prompt length\n\nThe TTFT bound counts bytes only (weights streamed over PCIe and read from device memory once per {}-token pass); FLOPs are not in it.\n",
            crate::footprint::MAX_BATCH
        );
        let mut head = "| --gpu-mem | prompt | status | TTFT | prefill tok/s | TTFT bound (limited by) | of bound | ledger peak | process peak |".to_string();
        let mut rule = "|---|---:|---|---:|---:|---:|---:|---:|---:|".to_string();
        for p in peer_cols {
            let _ = write!(head, " {} TTFT |", md(&p.name));
            rule.push_str("---:|");
        }
        let _ = writeln!(s, "{head}\n{rule}");
        for c in &self.prefill {
            let _ = write!(
                s,
                "| {} | {} | {} | {} | {} | {} ({}) | {} | {} | {} |",
                c.budget,
                c.prompt_tokens,
                status(c),
                ms(c.ttft_s),
                num(c.tokens_per_s, 1),
                ms(c.bound_ttft_s),
                c.bound_limited_by.as_deref().unwrap_or("—"),
                pct(c.fraction_of_bound),
                bytes(c.gpu_peak_bytes),
                bytes(c.gpu_process_peak_bytes)
            );
            for p in peer_cols {
                let _ = write!(s, " {} |", md(&p.ttft_cell(&c.budget, c.prompt_tokens)));
            }
            s.push('\n');
        }
    }

    /// Each peer's section, the plots, the problems and the notes.
    fn write_peers_plots_problems_notes(&self, s: &mut String, plots: &[(&str, &str)]) {
        let _ = writeln!(s, "\n## Peers\n");
        if self.peers.is_empty() {
            let _ = writeln!(s, "No peers configured.");
        }
        for p in &self.peers {
            let _ = writeln!(s, "{}", p.markdown());
        }
        if !plots.is_empty() {
            let _ = writeln!(s, "## Plots\n");
            for (file, title) in plots {
                let _ = writeln!(s, "![{title}]({file})\n");
            }
        }
        if !self.problems.is_empty() {
            let _ = writeln!(s, "## Problems\n");
            for p in &self.problems {
                let _ = writeln!(s, "- {}", md(p));
            }
            s.push('\n');
        }
        if !self.notes.is_empty() {
            let _ = writeln!(s, "## Notes\n");
            for n in &self.notes {
                let _ = writeln!(s, "- {n}");
            }
        }
    }
}
