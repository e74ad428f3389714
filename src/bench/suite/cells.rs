//! The suite's cells run for real: a [`CellRunner`] that loads the model through the runtime for
//! each cell, sized for its job and budget, measures it and reports the bytes its bounds need;
//! a budget the plan refuses is a refused cell, not a failure.

use anyhow::Result;
use serde_json::Value;

use super::axes::BudgetPoint;
use super::matrix::{CellJob, CellOutcome, CellRun, CellRunner};
use crate::bench::measure::{measure, random_prompt};
use crate::bench::running::traffic_of;
use crate::plan::{Budget, HardwareProfile, PlanError, make_plan};
use crate::runtime::{Job, LoadedModel, ModelArgs, with_engine};
use crate::store::Manifest;

/// Whether loading failed because the plan refused the budget.
fn refused(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        matches!(
            c.downcast_ref::<PlanError>(),
            Some(PlanError::GpuTooSmall { .. } | PlanError::DramTooSmall { .. })
        )
    })
}

/// Runs the suite's cells with the runtime's loader: one load per cell, sized for its job.
pub(super) struct LoaderCells<'a> {
    pub(super) args: &'a mut ModelArgs,
    pub(super) manifest: &'a Manifest,
    pub(super) planner: &'a HardwareProfile,
    pub(super) reps: usize,
}

impl LoaderCells<'_> {
    fn budget_for(&self, job: CellJob, gpu_mem: u64) -> Budget {
        crate::runtime::budget_for(
            self.args,
            Job::single(job.prompt_tokens + job.tokens, job.prompt_tokens, 1),
            gpu_mem,
            self.args.device,
        )
    }

    fn try_run(&mut self, job: CellJob) -> Result<CellRun> {
        let loaded = LoadedModel::load(self.args)?;
        let ctx = job.prompt_tokens + job.tokens;
        let running = loaded.start(self.args, Job::single(ctx, job.prompt_tokens, 1))?;
        let prompt = random_prompt(job.prompt_tokens, loaded.spec.vocab_size);
        let m = with_engine!(&running.engine, e => {
            let snapshot = || running.snapshot();
            measure(e, ctx, &prompt, job.tokens, self.reps, (&snapshot, &mut || {}), None)?
        });
        let memory = running.memory_json(m.after_prefill, m.end, prompt.len(), m.decode_steps);
        let traffic = traffic_of(
            &running,
            prompt.len(),
            m.decode_steps,
            (&m.after_prefill, &m.end),
        );
        // The whole model on CUDA runs without a plan: the all-resident plan predicts it.
        let whole_plan;
        let plan = match &running.plan {
            Some(p) => Some(p),
            None => {
                whole_plan = make_plan(
                    self.manifest,
                    &self.budget_for(job, u64::MAX / 4),
                    self.planner,
                )
                .ok();
                whole_plan.as_ref()
            }
        };
        let (pass_streamed, pass_read) = match (&running.plan, &running.traffic) {
            (Some(p), _) => (
                (p.spec.n_layers as u64 * p.streamed_bytes_per_layer) as f64,
                p.per_token.hbm_read_bytes.saturating_sub(p.gpu.kv / 2) as f64,
            ),
            (None, Some(t)) => (0.0, t.weight_bytes as f64),
            (None, None) => (0.0, 0.0),
        };
        Ok(CellRun {
            traffic,
            pass_streamed_bytes: pass_streamed,
            pass_read_bytes: pass_read,
            prediction: plan.map(|p| (p.prediction.tokens_per_s, p.prediction.limited_by.clone())),
            gpu_peak_bytes: memory.get("gpu_peak_bytes").and_then(Value::as_u64),
            gpu_process_peak_bytes: memory.get("gpu_process_peak_bytes").and_then(Value::as_u64),
            load_s: running.load_s,
            memory,
            measured: m,
        })
    }
}

impl CellRunner for LoaderCells<'_> {
    fn run(&mut self, budget: &BudgetPoint, job: CellJob) -> CellOutcome {
        self.args.budget.gpu_mem = budget.gpu_mem_bytes;
        match self.try_run(job) {
            Ok(r) => CellOutcome::Ran(Box::new(r)),
            Err(e) if refused(&e) => CellOutcome::Refused(e.to_string()),
            Err(e) => CellOutcome::Failed(format!("{e:#}")),
        }
    }
}
