//! Peers measured in the same run as ours: llama.cpp's `llama-bench` (whole-GPU and partial
//! offload at each budget) and HF transformers/accelerate (`scripts/peer_hf.py`). Each adapter
//! runs the peer as a child process and parses what it prints; a peer that is not configured
//! or not present is reported as "not run" with the reason, never an error of the suite.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::Value;

use super::axes::BudgetPoint;
use crate::plan::human_bytes;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PeerStatus {
    Ok,
    /// Not configured or not present here (`reason` says which).
    NotRun,
    Failed,
}

/// One peer's results across the budgets.
#[derive(Clone, Debug, Serialize)]
pub struct PeerReport {
    pub name: String,
    pub status: PeerStatus,
    pub reason: Option<String>,
    /// What the peer says about itself (build, backend, device).
    pub info: Value,
    pub runs: Vec<PeerRun>,
}

/// The peer at one budget.
#[derive(Clone, Debug, Serialize)]
pub struct PeerRun {
    /// The label of the suite's budget this run stands beside.
    pub budget: String,
    pub gpu_mem_bytes: Option<u64>,
    /// How the peer was told to fit: "-ngl 99 -fa 1", "max_memory 4096MiB", …
    pub setting: String,
    pub n_gpu_layers: Option<u32>,
    pub status: PeerStatus,
    pub reason: Option<String>,
    /// Device bytes the peer's process held at most, polled from the driver (null: not polled).
    pub process_peak_bytes: Option<u64>,
    /// The estimate of device bytes the setting was chosen by.
    pub estimated_bytes: Option<u64>,
    pub decode_tokens_per_s: Option<f64>,
    pub prefill: Vec<PeerPrefill>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PeerPrefill {
    pub prompt_tokens: usize,
    pub tokens_per_s: Option<f64>,
    pub ttft_s: Option<f64>,
}

impl PeerReport {
    pub fn not_run(name: &str, reason: impl Into<String>) -> Self {
        PeerReport {
            name: name.into(),
            status: PeerStatus::NotRun,
            reason: Some(reason.into()),
            info: Value::Null,
            runs: Vec::new(),
        }
    }

    /// Whether any run produced figures.
    pub fn ran(&self) -> bool {
        self.runs.iter().any(|r| r.status == PeerStatus::Ok)
    }

    fn run_for(&self, budget: &str) -> Option<&PeerRun> {
        self.runs.iter().find(|r| r.budget == budget)
    }

    /// The decode figure beside our cell at `budget`, for a table.
    pub fn decode_cell(&self, budget: &str) -> String {
        match self.run_for(budget) {
            None => "—".into(),
            Some(r) if r.status != PeerStatus::Ok => "not run".into(),
            Some(r) => format!(
                "{} ({})",
                r.decode_tokens_per_s
                    .map_or("—".into(), |t| format!("{t:.2}")),
                r.setting
            ),
        }
    }

    /// The TTFT beside our cell at (`budget`, `prompt`), for a table.
    pub fn ttft_cell(&self, budget: &str, prompt: usize) -> String {
        let Some(r) = self.run_for(budget).filter(|r| r.status == PeerStatus::Ok) else {
            return "—".into();
        };
        r.prefill
            .iter()
            .find(|p| p.prompt_tokens == prompt)
            .and_then(|p| p.ttft_s)
            .map_or("—".into(), |t| format!("{:.2} ms", t * 1e3))
    }

    /// A section for the Markdown report.
    pub fn markdown(&self) -> String {
        let mut s = format!("### {}\n\n", self.name);
        match self.status {
            PeerStatus::NotRun => {
                let _ = writeln!(
                    s,
                    "not run: {}\n",
                    self.reason.as_deref().unwrap_or("no reason given")
                );
                return s;
            }
            PeerStatus::Failed => {
                let _ = writeln!(
                    s,
                    "failed: {}\n",
                    self.reason.as_deref().unwrap_or("no reason given")
                );
            }
            PeerStatus::Ok => {}
        }
        if let Some(info) = self.info.as_object().filter(|o| !o.is_empty()) {
            let facts: Vec<String> = info
                .iter()
                .map(|(k, v)| match v.as_str() {
                    Some(t) => format!("{k}: {t}"),
                    None => format!("{k}: {v}"),
                })
                .collect();
            let _ = writeln!(s, "{}\n", facts.join(", ").replace('|', "\\|"));
        }
        let _ = writeln!(
            s,
            "| --gpu-mem | setting | status | decode tok/s | prefill tok/s by prompt | process peak | estimated |\n|---|---|---|---:|---|---:|---:|"
        );
        for r in &self.runs {
            let prefill: Vec<String> = r
                .prefill
                .iter()
                .map(|p| {
                    format!(
                        "{}: {}",
                        p.prompt_tokens,
                        p.tokens_per_s.map_or("—".into(), |t| format!("{t:.1}"))
                    )
                })
                .collect();
            let status = match (&r.status, &r.reason) {
                (PeerStatus::Ok, _) => "ok".to_string(),
                (st, reason) => format!(
                    "{}: {}",
                    if *st == PeerStatus::NotRun {
                        "not run"
                    } else {
                        "failed"
                    },
                    reason.as_deref().unwrap_or("").replace('|', "\\|")
                ),
            };
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} |",
                r.budget,
                r.setting,
                status,
                r.decode_tokens_per_s
                    .map_or("—".into(), |t| format!("{t:.2}")),
                prefill.join(", "),
                r.process_peak_bytes.map_or("—".into(), human_bytes),
                r.estimated_bytes.map_or("—".into(), human_bytes)
            );
        }
        s.push('\n');
        s
    }
}

/// What both peers are asked to run.
#[derive(Clone, Debug)]
pub struct PeerJob {
    pub prompts: Vec<usize>,
    pub decode_prompt_tokens: usize,
    pub decode_tokens: usize,
    pub reps: usize,
    pub threads: Option<usize>,
    /// Device bytes a process holds before it places anything (the hardware profile's).
    pub fixed_device_bytes: u64,
}

/// Highest device memory `pid` holds while `child` runs, polled from the driver every 50 ms
/// (NVML, else `nvidia-smi`); `None` where neither can tell. Waits for the child to exit.
fn wait_polling(
    child: &mut std::process::Child,
    timeout: Duration,
) -> std::io::Result<(std::process::ExitStatus, Option<u64>)> {
    let pid = child.id();
    let nvml = nvml_wrapper::Nvml::init().ok();
    let mut peak: Option<u64> = None;
    let mut smi_ok = nvml.is_none();
    let t0 = Instant::now();
    loop {
        if let Some(st) = child.try_wait()? {
            return Ok((st, peak));
        }
        if t0.elapsed() > timeout {
            child.kill().ok();
            let st = child.wait()?;
            return Ok((st, peak));
        }
        let used = match &nvml {
            Some(n) => nvml_process_bytes(n, pid),
            None if smi_ok => {
                let r = smi_process_bytes(pid);
                smi_ok = r.is_ok();
                r.ok().flatten()
            }
            None => None,
        };
        if let Some(u) = used {
            peak = Some(peak.map_or(u, |p| p.max(u)));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn nvml_process_bytes(nvml: &nvml_wrapper::Nvml, pid: u32) -> Option<u64> {
    let d = nvml.device_by_index(0).ok()?;
    d.running_compute_processes()
        .ok()?
        .into_iter()
        .filter(|p| p.pid == pid)
        .find_map(|p| match p.used_gpu_memory {
            nvml_wrapper::enums::device::UsedGpuMemory::Used(b) => Some(b),
            _ => None,
        })
}

/// `Err` when nvidia-smi can't be run at all.
fn smi_process_bytes(pid: u32) -> std::io::Result<Option<u64>> {
    let out = Command::new("nvidia-smi")
        .args([
            "--query-compute-apps=pid,used_memory",
            "--format=csv,noheader,nounits",
        ])
        .stderr(Stdio::null())
        .output()?;
    Ok(parse_smi_apps(&String::from_utf8_lossy(&out.stdout), pid))
}

/// `pid, MiB` lines of `nvidia-smi --query-compute-apps=pid,used_memory` → bytes of `pid`.
pub fn parse_smi_apps(text: &str, pid: u32) -> Option<u64> {
    text.lines().find_map(|l| {
        let mut it = l.split(',').map(str::trim);
        let p: u32 = it.next()?.parse().ok()?;
        let mib: u64 = it.next()?.parse().ok()?;
        (p == pid).then_some(mib << 20)
    })
}

/// The last JSON value a peer printed on stdout (peers log freely before it).
fn last_json(stdout: &str) -> Option<Value> {
    if let Ok(v) = serde_json::from_str::<Value>(stdout.trim()) {
        return Some(v);
    }
    // An array printed over several lines: from the last line that opens one.
    let lines: Vec<&str> = stdout.lines().collect();
    for i in (0..lines.len()).rev() {
        let tail = lines[i..].join("\n");
        if let Ok(v) = serde_json::from_str::<Value>(tail.trim()) {
            return Some(v);
        }
    }
    None
}

// ---------------------------------------------------------------- llama.cpp (llama-bench)

/// One test of `llama-bench -o json`: a prompt-processing test (`n_prompt` > 0, `n_gen` 0) or a
/// text-generation test (`n_gen` > 0).
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaBenchTest {
    pub n_prompt: usize,
    pub n_gen: usize,
    pub n_gpu_layers: Option<u32>,
    /// Mean tokens/s over the repetitions.
    pub avg_ts: f64,
    pub stddev_ts: Option<f64>,
}

/// Parse `llama-bench -o json` (an array of tests; `-o jsonl` lines also accepted).
pub fn parse_llama_bench(stdout: &str) -> Result<(Vec<LlamaBenchTest>, Value), String> {
    let items: Vec<Value> = match last_json(stdout) {
        Some(Value::Array(a)) => a,
        Some(v @ Value::Object(_)) => vec![v],
        _ => stdout
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l.trim()).ok())
            .filter(Value::is_object)
            .collect(),
    };
    if items.is_empty() {
        return Err("llama-bench printed no JSON tests".into());
    }
    let mut tests = Vec::new();
    for it in &items {
        let n = |k: &str| it.get(k).and_then(Value::as_u64);
        let (Some(n_prompt), Some(n_gen), Some(avg_ts)) = (
            n("n_prompt"),
            n("n_gen"),
            it.get("avg_ts").and_then(Value::as_f64),
        ) else {
            return Err(format!(
                "a llama-bench test lacks n_prompt, n_gen or avg_ts: {it}"
            ));
        };
        tests.push(LlamaBenchTest {
            n_prompt: n_prompt as usize,
            n_gen: n_gen as usize,
            n_gpu_layers: n("n_gpu_layers").map(|v| v as u32),
            avg_ts,
            stddev_ts: it.get("stddev_ts").and_then(Value::as_f64),
        });
    }
    let first = &items[0];
    let mut info = serde_json::Map::new();
    for k in [
        "build_commit",
        "build_number",
        "backends",
        "gpu_info",
        "cpu_info",
        "model_type",
        "model_size",
        "model_n_params",
        "type_k",
        "type_v",
        "flash_attn",
        "n_threads",
    ] {
        if let Some(v) = first.get(k) {
            info.insert(k.into(), v.clone());
        }
    }
    Ok((tests, Value::Object(info)))
}

/// Device bytes of a GGUF model by layer, as llama.cpp places them with `-ngl`.
#[derive(Clone, Debug, PartialEq)]
pub struct GgufLayout {
    pub layer_bytes: Vec<u64>,
    /// The output matrix (offloaded once `-ngl` exceeds the layer count).
    pub output_bytes: u64,
    /// f16 K+V bytes per position per layer.
    pub kv_bytes_per_position: u64,
    /// Compute buffer for a 512-token micro-batch (an estimate).
    pub compute_bytes: u64,
}

impl GgufLayout {
    pub fn of(path: &Path) -> Result<Self, String> {
        let f = crate::model::gguf::GgufFile::open(path).map_err(|e| e.to_string())?;
        let arch = f
            .metadata
            .str("general.architecture")
            .map_err(|e| e.to_string())?;
        let get = |k: &str| {
            f.metadata
                .usize(&format!("{arch}.{k}"))
                .map_err(|e| e.to_string())
        };
        let n_layers = get("block_count")?;
        let d_model = get("embedding_length")?;
        let d_ff = get("feed_forward_length").unwrap_or(4 * d_model);
        let heads = get("attention.head_count")?.max(1);
        let kv_heads = get("attention.head_count_kv").unwrap_or(heads);
        let mut layer_bytes = vec![0u64; n_layers];
        let mut output_bytes = 0;
        let mut vocab = 0;
        for t in f.tensors.values() {
            if let Some(rest) = t.name.strip_prefix("blk.")
                && let Some(i) = rest.split('.').next().and_then(|i| i.parse::<usize>().ok())
                && i < n_layers
            {
                layer_bytes[i] += t.n_bytes as u64;
            } else if t.name == "output.weight" {
                output_bytes = t.n_bytes as u64;
                vocab = t.dims.get(1).copied().unwrap_or(0) as usize;
            } else if t.name == "token_embd.weight" {
                vocab = vocab.max(t.dims.get(1).copied().unwrap_or(0) as usize);
                if output_bytes == 0 {
                    // Tied output: llama.cpp puts a copy on the device.
                    output_bytes = t.n_bytes as u64;
                }
            }
        }
        let kv_dim = d_model / heads * kv_heads;
        Ok(GgufLayout {
            layer_bytes,
            output_bytes,
            kv_bytes_per_position: 2 * kv_dim as u64 * 2,
            compute_bytes: 512 * 4 * (vocab + 2 * d_ff + 4 * d_model) as u64,
        })
    }

    pub fn n_layers(&self) -> usize {
        self.layer_bytes.len()
    }

    /// Estimated device bytes of `llama-bench -ngl ngl` with a context of `ctx` positions.
    pub fn estimate(&self, ngl: usize, ctx: usize, fixed: u64) -> u64 {
        let on = ngl.min(self.n_layers());
        let layers: u64 = self.layer_bytes[self.n_layers() - on..].iter().sum();
        let out = if ngl > self.n_layers() {
            self.output_bytes
        } else {
            0
        };
        fixed
            + layers
            + out
            + on as u64 * self.kv_bytes_per_position * ctx as u64
            + self.compute_bytes
    }

    /// The largest `-ngl` whose estimate fits `budget` (`None`: not even 0 fits).
    pub fn largest_ngl(&self, budget: u64, ctx: usize, fixed: u64) -> Option<usize> {
        (0..=self.n_layers() + 1)
            .rev()
            .find(|&n| self.estimate(n, ctx, fixed) <= budget)
    }
}

/// Where and how to run llama-bench.
#[derive(Clone, Debug)]
pub struct LlamaBench {
    pub exe: Option<PathBuf>,
    pub gguf: Option<PathBuf>,
    /// Stop a run after this long.
    pub timeout: Duration,
}

impl LlamaBench {
    const NAME: &'static str = "llama.cpp (llama-bench)";

    /// Run llama-bench beside every budget: `-ngl 99 -fa 1` for the whole model; at a budget
    /// the largest `-ngl` whose process fits (estimated from layer bytes, then verified by
    /// polling the process's device memory where a driver can tell, stepping down while over).
    pub fn run(
        &self,
        job: &PeerJob,
        budgets: &[BudgetPoint],
        progress: &mut dyn FnMut(&str),
    ) -> PeerReport {
        let Some(exe) = &self.exe else {
            return PeerReport::not_run(
                Self::NAME,
                "no llama-bench given (--llama-bench PATH or GPU_OFFLOAD_LLAMA_BENCH)",
            );
        };
        if !exe.is_file() {
            return PeerReport::not_run(
                Self::NAME,
                format!("llama-bench {} does not exist", exe.display()),
            );
        }
        let Some(gguf) = &self.gguf else {
            return PeerReport::not_run(
                Self::NAME,
                "llama-bench needs the model as GGUF (--peer-gguf FILE or GPU_OFFLOAD_PEER_GGUF)",
            );
        };
        let layout = match GgufLayout::of(gguf) {
            Ok(l) => l,
            Err(e) => {
                return PeerReport::not_run(
                    Self::NAME,
                    format!("cannot read {}: {e}", gguf.display()),
                );
            }
        };
        let ctx = job
            .prompts
            .iter()
            .copied()
            .max()
            .unwrap_or(0)
            .max(job.decode_tokens);
        let mut report = PeerReport {
            name: Self::NAME.into(),
            status: PeerStatus::Ok,
            reason: None,
            info: Value::Null,
            runs: Vec::new(),
        };
        for b in budgets {
            progress(&format!("llama-bench at {}", b.label));
            let run = self.run_budget(exe, gguf, job, &layout, ctx, b, &mut report.info);
            report.runs.push(run);
        }
        if !report.ran() {
            report.status = PeerStatus::Failed;
            report.reason = report
                .runs
                .iter()
                .find_map(|r| r.reason.clone())
                .or(Some("no run produced figures".into()));
        }
        report
    }

    #[allow(clippy::too_many_arguments)]
    fn run_budget(
        &self,
        exe: &Path,
        gguf: &Path,
        job: &PeerJob,
        layout: &GgufLayout,
        ctx: usize,
        b: &BudgetPoint,
        info: &mut Value,
    ) -> PeerRun {
        let mut run = PeerRun {
            budget: b.label.clone(),
            gpu_mem_bytes: b.gpu_mem_bytes,
            setting: String::new(),
            n_gpu_layers: None,
            status: PeerStatus::Ok,
            reason: None,
            process_peak_bytes: None,
            estimated_bytes: None,
            decode_tokens_per_s: None,
            prefill: Vec::new(),
        };
        let mut ngl = match b.gpu_mem_bytes {
            None => 99,
            Some(budget) => match layout.largest_ngl(budget, ctx, job.fixed_device_bytes) {
                Some(n) => n,
                None => {
                    run.status = PeerStatus::NotRun;
                    run.setting = "-ngl 0".into();
                    run.estimated_bytes = Some(layout.estimate(0, ctx, job.fixed_device_bytes));
                    run.reason = Some(format!(
                        "does not fit: even -ngl 0 needs about {} of device memory",
                        human_bytes(run.estimated_bytes.unwrap_or(0))
                    ));
                    return run;
                }
            },
        };
        // Verify on the device: step down while the process held more than the budget.
        for _attempt in 0..4 {
            run.setting = format!("-ngl {ngl} -fa 1");
            run.n_gpu_layers = Some(ngl as u32);
            run.estimated_bytes = Some(layout.estimate(ngl, ctx, job.fixed_device_bytes));
            match self.invoke(exe, gguf, job, ngl) {
                Err(e) => {
                    run.status = PeerStatus::Failed;
                    run.reason = Some(e);
                    return run;
                }
                Ok((tests, i, peak)) => {
                    if info.is_null() {
                        *info = i;
                    }
                    run.process_peak_bytes = peak;
                    run.status = PeerStatus::Ok;
                    run.reason = None;
                    run.decode_tokens_per_s = tests
                        .iter()
                        .find(|t| t.n_gen > 0 && t.n_prompt == 0)
                        .map(|t| t.avg_ts);
                    run.prefill = job
                        .prompts
                        .iter()
                        .map(|&p| {
                            let ts = tests
                                .iter()
                                .find(|t| t.n_prompt == p && t.n_gen == 0)
                                .map(|t| t.avg_ts);
                            PeerPrefill {
                                prompt_tokens: p,
                                tokens_per_s: ts,
                                ttft_s: ts.filter(|&t| t > 0.0).map(|t| p as f64 / t),
                            }
                        })
                        .collect();
                    match (b.gpu_mem_bytes, peak) {
                        (Some(budget), Some(p)) if p > budget && ngl > 0 => {
                            let over = p - budget;
                            let per = layout.layer_bytes.iter().copied().max().unwrap_or(1).max(1);
                            ngl = ngl.saturating_sub((over.div_ceil(per) as usize).max(1));
                            run.status = PeerStatus::Failed;
                            run.reason = Some(format!("process held {} > budget", human_bytes(p)));
                        }
                        (Some(budget), Some(p)) if p > budget => {
                            run.status = PeerStatus::NotRun;
                            run.reason =
                                Some(format!("does not fit: -ngl 0 held {}", human_bytes(p)));
                            return run;
                        }
                        _ => return run,
                    }
                }
            }
        }
        run
    }

    /// One llama-bench process: the prompts and the decode test at `-ngl ngl`.
    fn invoke(
        &self,
        exe: &Path,
        gguf: &Path,
        job: &PeerJob,
        ngl: usize,
    ) -> Result<(Vec<LlamaBenchTest>, Value, Option<u64>), String> {
        let mut cmd = Command::new(exe);
        cmd.arg("-m").arg(gguf);
        let prompts: Vec<String> = job.prompts.iter().map(|p| p.to_string()).collect();
        if !prompts.is_empty() {
            cmd.args(["-p", &prompts.join(",")]);
        } else {
            cmd.args(["-p", "0"]);
        }
        cmd.args(["-n", &job.decode_tokens.to_string()])
            .args(["-ngl", &ngl.to_string()])
            .args(["-fa", "1"])
            .args(["-r", &job.reps.max(1).to_string()])
            .args(["-o", "json"]);
        if let Some(t) = job.threads {
            cmd.args(["-t", &t.to_string()]);
        }
        let line = format!("{cmd:?}");
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", exe.display()))?;
        let stdout = child.stdout.take();
        let stderr = child.stderr.take();
        let out_t = std::thread::spawn(move || read_all(stdout));
        let err_t = std::thread::spawn(move || read_all(stderr));
        let (status, peak) = wait_polling(&mut child, self.timeout)
            .map_err(|e| format!("waiting for llama-bench: {e}"))?;
        let out = out_t.join().unwrap_or_default();
        let err = err_t.join().unwrap_or_default();
        if !status.success() {
            return Err(format!("{line} exited with {status}: {}", tail(&err, 400)));
        }
        let (tests, info) = parse_llama_bench(&out)?;
        Ok((tests, info, peak))
    }
}

fn read_all<R: std::io::Read>(r: Option<R>) -> String {
    let mut s = String::new();
    if let Some(mut r) = r {
        let _ = r.read_to_string(&mut s);
    }
    s
}

fn tail(s: &str, n: usize) -> String {
    let t = s.trim();
    let start = t.len().saturating_sub(n);
    let start = (start..=t.len())
        .find(|&i| t.is_char_boundary(i))
        .unwrap_or(t.len());
    t[start..].replace('\n', " / ")
}

// ---------------------------------------------------------------- transformers / accelerate

/// `scripts/peer_hf.py`, carried in the binary so the suite runs from anywhere.
const PEER_HF_SCRIPT: &str = include_str!("../../../scripts/peer_hf.py");

/// Where and how to run the transformers peer.
#[derive(Clone, Debug)]
pub struct PeerHf {
    /// The python to use (with torch, transformers, accelerate).
    pub python: Option<PathBuf>,
    /// The model as an HF directory.
    pub model_dir: Option<PathBuf>,
    pub timeout: Duration,
}

impl PeerHf {
    const NAME: &'static str = "transformers + accelerate";

    /// The whole model on the GPU; at each budget, accelerate's `device_map="auto"` with
    /// `max_memory={0: budget}` (a weights budget: accelerate does not count the CUDA context).
    pub fn run(
        &self,
        job: &PeerJob,
        budgets: &[BudgetPoint],
        scratch: &Path,
        progress: &mut dyn FnMut(&str),
    ) -> PeerReport {
        let Some(python) = &self.python else {
            return PeerReport::not_run(
                Self::NAME,
                "no python given (--peer-hf PYTHON or GPU_OFFLOAD_PEER_HF)",
            );
        };
        let Some(dir) = self
            .model_dir
            .as_ref()
            .filter(|d| d.join("config.json").is_file() && !crate::store::Store::is_store(d))
        else {
            return PeerReport::not_run(
                Self::NAME,
                "transformers needs the model as a Hugging Face directory (-m DIR or --preset)",
            );
        };
        let script = scratch.join(format!(".peer_hf.{}.py", std::process::id()));
        if let Err(e) = std::fs::write(&script, PEER_HF_SCRIPT) {
            return PeerReport::not_run(
                Self::NAME,
                format!("cannot write {}: {e}", script.display()),
            );
        }
        let mut report = PeerReport {
            name: Self::NAME.into(),
            status: PeerStatus::Ok,
            reason: None,
            info: Value::Null,
            runs: Vec::new(),
        };
        for b in budgets {
            progress(&format!("transformers at {}", b.label));
            report
                .runs
                .push(self.run_budget(python, &script, dir, job, b, &mut report.info));
        }
        std::fs::remove_file(&script).ok();
        if !report.ran() {
            report.status = PeerStatus::Failed;
            report.reason = report.runs.iter().find_map(|r| r.reason.clone());
        }
        report
    }

    fn run_budget(
        &self,
        python: &Path,
        script: &Path,
        dir: &Path,
        job: &PeerJob,
        b: &BudgetPoint,
        info: &mut Value,
    ) -> PeerRun {
        let setting = match b.gpu_mem_bytes {
            None => "whole model on GPU 0".to_string(),
            Some(m) => format!("max_memory {}MiB", (m >> 20).max(1)),
        };
        let mut run = PeerRun {
            budget: b.label.clone(),
            gpu_mem_bytes: b.gpu_mem_bytes,
            setting: setting.clone(),
            n_gpu_layers: None,
            status: PeerStatus::Ok,
            reason: None,
            process_peak_bytes: None,
            estimated_bytes: None,
            decode_tokens_per_s: None,
            prefill: Vec::new(),
        };
        let mut cmd = Command::new(python);
        cmd.arg(script)
            .arg(dir)
            .args(["--prompt-tokens", &job.decode_prompt_tokens.to_string()])
            .args(["--tokens", &job.decode_tokens.to_string()]);
        if !job.prompts.is_empty() {
            let p: Vec<String> = job.prompts.iter().map(|p| p.to_string()).collect();
            cmd.args(["--prompts", &p.join(",")]);
        }
        if let Some(m) = b.gpu_mem_bytes {
            cmd.args(["--max-gpu-mem", &format!("{}MiB", (m >> 20).max(1))]);
        }
        let result = (|| {
            let mut child = cmd
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .map_err(|e| format!("cannot start {}: {e}", python.display()))?;
            let (so, se) = (child.stdout.take(), child.stderr.take());
            let out_t = std::thread::spawn(move || read_all(so));
            let err_t = std::thread::spawn(move || read_all(se));
            let (status, peak) = wait_polling(&mut child, self.timeout)
                .map_err(|e| format!("waiting for the transformers peer: {e}"))?;
            let out = out_t.join().unwrap_or_default();
            let err = err_t.join().unwrap_or_default();
            if !status.success() {
                return Err(format!(
                    "peer_hf.py exited with {status}: {}",
                    tail(&err, 400)
                ));
            }
            let v = last_json(out.lines().last().unwrap_or(""))
                .or_else(|| last_json(&out))
                .ok_or_else(|| "peer_hf.py printed no JSON".to_string())?;
            Ok((v, peak))
        })();
        match result {
            Err(e) => {
                run.status = PeerStatus::Failed;
                run.reason = Some(e);
            }
            Ok((v, peak)) => {
                run.process_peak_bytes = peak;
                run.decode_tokens_per_s = v.get("decode_tokens_per_s").and_then(Value::as_f64);
                run.prefill = v
                    .get("prefill")
                    .and_then(Value::as_array)
                    .map(|a| {
                        a.iter()
                            .filter_map(|p| {
                                let n = p.get("prompt_tokens")?.as_u64()? as usize;
                                let ttft = p.get("ttft_s").and_then(Value::as_f64);
                                Some(PeerPrefill {
                                    prompt_tokens: n,
                                    tokens_per_s: ttft.filter(|&t| t > 0.0).map(|t| n as f64 / t),
                                    ttft_s: ttft,
                                })
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                if info.is_null() {
                    let mut m = serde_json::Map::new();
                    for k in ["peer", "torch", "transformers", "device"] {
                        if let Some(x) = v.get(k) {
                            m.insert(k.into(), x.clone());
                        }
                    }
                    *info = Value::Object(m);
                }
            }
        }
        run
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_bench_json_parses_prompt_and_generation_tests() {
        let text = r#"ggml_cuda_init: found 1 CUDA devices
[
  {"build_commit": "abc", "backends": "CUDA", "model_type": "llama 7B F16", "n_gpu_layers": 99,
   "n_prompt": 512, "n_gen": 0, "avg_ts": 17500.5, "stddev_ts": 10.0},
  {"build_commit": "abc", "backends": "CUDA", "model_type": "llama 7B F16", "n_gpu_layers": 99,
   "n_prompt": 0, "n_gen": 64, "avg_ts": 179.0, "stddev_ts": 0.5}
]
"#;
        let (tests, info) = parse_llama_bench(text).unwrap();
        assert_eq!(tests.len(), 2);
        assert_eq!(tests[0].n_prompt, 512);
        assert_eq!(tests[1].n_gen, 64);
        assert_eq!(tests[1].avg_ts, 179.0);
        assert_eq!(tests[1].n_gpu_layers, Some(99));
        assert_eq!(info["build_commit"], "abc");
        assert!(parse_llama_bench("no json").is_err());
        assert!(parse_llama_bench(r#"[{"n_prompt": 1}]"#).is_err());
    }

    #[test]
    fn nvidia_smi_lines_give_the_process_bytes() {
        let text = "1234, 500\n99, 3000\n";
        assert_eq!(parse_smi_apps(text, 99), Some(3000 << 20));
        assert_eq!(parse_smi_apps(text, 7), None);
    }

    #[test]
    fn largest_ngl_fits_the_budget() {
        let l = GgufLayout {
            layer_bytes: vec![100; 10],
            output_bytes: 50,
            kv_bytes_per_position: 1,
            compute_bytes: 10,
        };
        // fixed 20 + compute 10 + n·(100 + 4 kv) (+ 50 output past 10 layers).
        assert_eq!(l.largest_ngl(30, 4, 20), Some(0));
        assert_eq!(l.largest_ngl(29, 4, 20), None);
        assert_eq!(l.largest_ngl(30 + 3 * 104, 4, 20), Some(3));
        assert_eq!(l.largest_ngl(u64::MAX / 2, 4, 20), Some(11));
    }
}
