//! `gpu-offload prefill`: the batch job. Reads prompts (a JSONL file or a directory of `*.txt`),
//! prefills each and optionally generates, and appends one JSON line per record to the output;
//! with `--save-contexts` each prompt also becomes a persistent context `serve` can continue.
//!
//! Resumable: ids already in the output (results or errors) are skipped, every line is appended
//! whole or not at all ([`LineLog`]), and a record's context is on disk before its line, so a job
//! killed at any instant and started again with the same command ends with every id exactly once.
//! Decoding is greedy by default, and a sampled run seeds each record from its id, so a restarted
//! job writes what an uninterrupted one would have.

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, IsTerminal, Read};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{Value, json};

use crate::backend::Backend;
use crate::engine::{Engine, EngineError, Logits, Sampler, SamplerParams, Session};
use crate::fault::TestDelay;
use crate::footprint::MAX_BATCH;
use crate::fsutil::LineLog;
use crate::limits::{MAX_JSONL_LINE_BYTES, MAX_PROMPT_BYTES};
use crate::model::Tokenizer;
use crate::model::tokenizer::TextStream;
use crate::runtime::{Job, with_engine};
use crate::runtime::{LoadedModel, ModelArgs, read_prompt_file};

#[derive(Debug, Args)]
pub struct PrefillArgs {
    #[command(flatten)]
    pub model: ModelArgs,

    /// Prompts: a JSONL file (one object per line: `id` and one of `prompt` text, `tokens` ids or
    /// `file`, a path relative to the JSONL file's directory) or a directory whose `*.txt` files
    /// are the prompts (id = file name).
    #[arg(long, short = 'i', env = "GPU_OFFLOAD_PREFILL_INPUT")]
    pub input: PathBuf,

    /// Results, one JSON line per record, appended; ids already there are skipped (resume).
    #[arg(long, short = 'o', env = "GPU_OFFLOAD_PREFILL_OUTPUT")]
    pub output: PathBuf,

    /// New tokens to generate after each prompt (0: prefill only).
    #[arg(long, short = 'n', env = "GPU_OFFLOAD_MAX_TOKENS", default_value_t = 0)]
    pub max_tokens: usize,

    /// Save each prompt (and what was generated) as a persistent context under this directory,
    /// in the format `serve --kv-dir DIR` loads; the output line names it (`context`).
    #[arg(long, env = "GPU_OFFLOAD_SAVE_CONTEXTS")]
    pub save_contexts: Option<PathBuf>,

    /// API key the saved contexts belong to in `serve --api-key` [default: none, for a server
    /// without keys]
    #[arg(long, env = "GPU_OFFLOAD_CONTEXT_KEY", requires = "save_contexts")]
    pub context_key: Option<String>,

    /// Add the last prompt position's logits to each output line.
    #[arg(long, env = "GPU_OFFLOAD_LOGITS")]
    pub logits: bool,

    /// Sampling (default greedy here, and seed 0: each record's generator is seeded from the
    /// seed and the record's id, so a resumed job samples what an uninterrupted one would).
    #[command(flatten)]
    pub sampling: super::run::SamplingArgs,

    /// Keep generating past end-of-generation tokens.
    #[arg(long, env = "GPU_OFFLOAD_IGNORE_EOS")]
    pub ignore_eos: bool,

    /// No progress bar.
    #[arg(long, short = 'q', env = "GPU_OFFLOAD_QUIET")]
    pub quiet: bool,
}

/// Where a record's prompt comes from.
#[derive(Debug)]
enum Source {
    Text(String),
    Tokens(Vec<u32>),
    File(PathBuf),
}

/// One input record: its id and its prompt, or why it is bad.
#[derive(Debug)]
struct Record {
    id: String,
    source: std::result::Result<Source, String>,
}

/// One line of a JSONL input, read no further than `max` bytes: None at the end, Some(false)
/// for a line over `max` (skipped to its end), Some(true) with the line in `buf` (no newline).
fn next_line(r: &mut impl BufRead, max: usize, buf: &mut Vec<u8>) -> std::io::Result<Option<bool>> {
    buf.clear();
    if r.by_ref().take(max as u64 + 1).read_until(b'\n', buf)? == 0 {
        return Ok(None);
    }
    if buf.last() == Some(&b'\n') {
        buf.pop();
        if buf.last() == Some(&b'\r') {
            buf.pop();
        }
        return Ok(Some(true));
    }
    if buf.len() <= max {
        return Ok(Some(true));
    }
    loop {
        let avail = r.fill_buf()?;
        if avail.is_empty() {
            break;
        }
        match avail.iter().position(|&b| b == b'\n') {
            Some(i) => {
                r.consume(i + 1);
                break;
            }
            None => {
                let n = avail.len();
                r.consume(n);
            }
        }
    }
    Ok(Some(false))
}

/// The records of a JSONL file, read line by line (each line at most `max_jsonl_line_bytes`).
/// A line without a usable id (not UTF-8, not JSON, too long) is named `line:N` (1-based); a
/// repeated id is an error record named by its line, so ids in the output stay unique.
fn read_jsonl(path: &Path) -> Result<Vec<Record>> {
    let file = std::fs::File::open(path)
        .with_context(|| format!("cannot read input {}", path.display()))?;
    let mut reader = std::io::BufReader::new(file);
    let base = path.parent().unwrap_or(Path::new("."));
    let mut first_line: HashMap<String, usize> = HashMap::new();
    let mut out = Vec::new();
    let mut buf = Vec::new();
    let limit = MAX_JSONL_LINE_BYTES;
    for n in 1.. {
        let whole = next_line(&mut reader, limit.value as usize, &mut buf)
            .with_context(|| format!("cannot read input {} at line {n}", path.display()))?;
        let line_id = format!("line:{n}");
        let line = match whole {
            None => break,
            Some(false) => {
                out.push(Record {
                    id: line_id,
                    source: Err(
                        limit.refuse("the line's length in bytes (read so far)", limit.value + 1)
                    ),
                });
                continue;
            }
            Some(true) => match std::str::from_utf8(&buf) {
                Ok(l) => l,
                Err(e) => {
                    out.push(Record {
                        id: line_id,
                        source: Err(format!(
                            "line {n} is not UTF-8 (invalid byte at column {})",
                            e.valid_up_to() + 1
                        )),
                    });
                    continue;
                }
            },
        };
        if line.trim().is_empty() {
            continue;
        }
        let v: Value = match serde_json::from_str(line) {
            Ok(v @ Value::Object(_)) => v,
            Ok(_) => {
                out.push(Record {
                    id: line_id,
                    source: Err("malformed record: not a JSON object".into()),
                });
                continue;
            }
            Err(e) => {
                out.push(Record {
                    id: line_id,
                    source: Err(format!("malformed JSON: {e}")),
                });
                continue;
            }
        };
        let id = match &v["id"] {
            Value::String(s) if !s.is_empty() => s.clone(),
            Value::Number(x) => x.to_string(),
            _ => {
                out.push(Record {
                    id: line_id,
                    source: Err("no id (a non-empty string or a number)".into()),
                });
                continue;
            }
        };
        if let Some(first) = first_line.get(&id) {
            out.push(Record {
                id: line_id,
                source: Err(format!("duplicate id '{id}' (first on line {first})")),
            });
            continue;
        }
        first_line.insert(id.clone(), n);
        out.push(Record {
            id,
            source: source_of(&v, base),
        });
    }
    Ok(out)
}

fn source_of(v: &Value, base: &Path) -> std::result::Result<Source, String> {
    let given: Vec<&str> = ["prompt", "tokens", "file"]
        .into_iter()
        .filter(|k| !v[*k].is_null())
        .collect();
    if given.len() != 1 {
        return Err(format!(
            "give exactly one of prompt, tokens or file (got {})",
            if given.is_empty() {
                "none".to_string()
            } else {
                given.join(", ")
            }
        ));
    }
    match given[0] {
        "prompt" => match &v["prompt"] {
            Value::String(s) if !MAX_PROMPT_BYTES.admits(s.len() as u64) => {
                Err(MAX_PROMPT_BYTES.refuse("the prompt's text in bytes", s.len() as u64))
            }
            Value::String(s) => Ok(Source::Text(s.clone())),
            _ => Err("prompt must be a string".into()),
        },
        "tokens" => {
            let ids = v["tokens"].as_array().ok_or("tokens must be an array")?;
            ids.iter()
                .map(|x| {
                    x.as_u64()
                        .and_then(|x| u32::try_from(x).ok())
                        .ok_or_else(|| format!("tokens: {x} is not a token id"))
                })
                .collect::<std::result::Result<Vec<u32>, String>>()
                .map(Source::Tokens)
        }
        _ => match &v["file"] {
            Value::String(f) => Ok(Source::File(base.join(f))),
            _ => Err("file must be a string".into()),
        },
    }
}

/// The records of a directory: every `*.txt` file, sorted by name.
fn read_dir(dir: &Path) -> Result<Vec<Record>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("cannot list input directory {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == "txt"))
        .collect();
    files.sort();
    Ok(files
        .into_iter()
        .map(|p| Record {
            id: p
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            source: Ok(Source::File(p)),
        })
        .collect())
}

/// A record's prompt tokens, or why it has none.
fn tokens_of(
    source: &Source,
    tok: Option<&Tokenizer>,
    vocab: usize,
) -> std::result::Result<Vec<u32>, String> {
    let text = match source {
        Source::Tokens(ids) => {
            if let Some(&t) = ids.iter().find(|&&t| t as usize >= vocab) {
                return Err(format!(
                    "token id {t} is outside the vocabulary of {vocab} tokens"
                ));
            }
            if ids.is_empty() {
                return Err("empty prompt: no tokens".into());
            }
            return Ok(ids.clone());
        }
        Source::Text(t) => t.clone(),
        Source::File(p) => read_prompt_file(p).map_err(|e| format!("{e:#}"))?,
    };
    if text.trim().is_empty() {
        return Err("empty prompt".into());
    }
    let tok = tok.ok_or("the model has no tokenizer: give token ids (`tokens`)")?;
    // As `run` and `serve` encode a prompt: with the model's BOS.
    tok.encode(&text, true, true).map_err(|e| e.to_string())
}

/// A context id for a record id: the id itself when it is a safe directory name, else a hash.
fn context_id(id: &str) -> String {
    let safe = !id.is_empty()
        && id.len() <= 100
        && !id.starts_with('.')
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if safe {
        id.to_string()
    } else {
        format!("prefill-{:016x}", xxhash_rust::xxh3::xxh3_64(id.as_bytes()))
    }
}

/// Set by SIGINT/SIGTERM: the job stops at the next record boundary or decode step.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    if INTERRUPTED.swap(true, Ordering::SeqCst) {
        // A second Ctrl-C: leave now (the output holds only whole lines either way).
        // SAFETY: _exit is async-signal-safe.
        unsafe { libc::_exit(130) };
    }
}

fn catch_interrupts() {
    #[cfg(unix)]
    // SAFETY: installing a handler that only touches an atomic (and calls _exit).
    unsafe {
        let h = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
        libc::signal(libc::SIGINT, h);
        libc::signal(libc::SIGTERM, h);
    }
}

fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

/// Fault injection for tests: sleeps before every forward pass, so a test can kill the job in
/// the middle of a run.
static TEST_DELAY: TestDelay = TestDelay::new("GPU_OFFLOAD_TEST_PREFILL_DELAY_MS");

/// Why a record stopped short.
enum Stop {
    /// The record itself is bad: an error line, and the job goes on.
    Bad(String),
    /// Ctrl-C: the record is abandoned (no line).
    Interrupted,
    /// The device or the disk failed: the job stops (the record runs again on resume).
    Fatal(anyhow::Error),
}

impl From<EngineError> for Stop {
    fn from(e: EngineError) -> Self {
        match e {
            e @ (EngineError::ContextFull { .. }
            | EngineError::InvalidToken { .. }
            | EngineError::Empty) => Stop::Bad(e.to_string()),
            e => Stop::Fatal(e.into()),
        }
    }
}

/// What the job needs for every record.
struct Ctx<'a> {
    args: &'a PrefillArgs,
    /// The sampling flags (a record's seed is mixed with its id).
    sampler: SamplerParams,
    tok: Option<&'a Tokenizer>,
    model_id: String,
    owner: Option<String>,
}

fn per_s(n: usize, s: f64) -> f64 {
    if s > 0.0 { n as f64 / s } else { 0.0 }
}

/// What one record did, for the totals.
#[derive(Clone, Copy, Debug, Default)]
struct Done {
    prompt_tokens: usize,
    generated: usize,
    prefill_s: f64,
    /// Sampling and decoding after the prefill (context saving included).
    decode_s: f64,
}

/// Prefill one record, generate, save its context; the output line's JSON.
fn one<B: Backend>(
    e: &Engine<B>,
    session: &mut Session<B>,
    c: &Ctx,
    id: &str,
    prompt: &[u32],
) -> std::result::Result<(Value, Done), Stop> {
    let args = c.args;
    session.truncate(0);
    let t0 = Instant::now();
    TEST_DELAY.pause();
    let last = e.forward(session, prompt, Logits::Last)?;
    let prefill_s = t0.elapsed().as_secs_f64();
    let mut sampler = Sampler::new(SamplerParams {
        seed: c.sampler.seed ^ xxhash_rust::xxh3::xxh3_64(id.as_bytes()),
        ..c.sampler.clone()
    });
    let is_eog = |t: u32| c.tok.is_some_and(|k| k.is_end_of_generation(t)) && !args.ignore_eos;
    let mut stream = c.tok.map(TextStream::new);
    let mut text = String::new();
    let mut generated: Vec<u32> = Vec::new();
    let mut ttft = t0.elapsed().as_secs_f64();
    let mut stop = "length";
    let last_logits = args.logits.then(|| last.clone());
    let mut logits = last;
    while generated.len() < args.max_tokens {
        let next = sampler.sample(&logits);
        if generated.is_empty() {
            ttft = t0.elapsed().as_secs_f64();
        }
        if is_eog(next) {
            stop = "stop";
            break;
        }
        generated.push(next);
        if let Some(s) = &mut stream {
            text.push_str(&s.push(next));
        }
        if generated.len() >= args.max_tokens {
            break;
        }
        if session.position() >= session.context_size() {
            stop = "context_full";
            break;
        }
        if interrupted() {
            return Err(Stop::Interrupted);
        }
        TEST_DELAY.pause();
        logits = e.forward(session, &[next], Logits::Last)?;
    }
    if let Some(s) = &mut stream {
        text.push_str(&s.finish());
    }
    let mut out = json!({
        "id": id,
        "prompt_tokens": prompt.len(),
        "completion_tokens": generated.len(),
        "ttft_s": ttft,
        "text": text,
        "tokens": generated,
        "stop_reason": stop,
    });
    if let Some(dir) = &args.save_contexts {
        let cid = context_id(id);
        let mut conversation = prompt.to_vec();
        conversation.extend(&generated);
        crate::kv::save_session(
            e,
            session,
            dir,
            &c.model_id,
            &cid,
            c.owner.clone(),
            &conversation,
        )
        .map_err(|err| Stop::Fatal(anyhow::Error::new(err).context("saving a context")))?;
        out["context"] = cid.into();
    }
    if let Some(l) = last_logits {
        out["logits"] = json!(l);
    }
    let done = Done {
        prompt_tokens: prompt.len(),
        generated: generated.len(),
        prefill_s,
        decode_s: t0.elapsed().as_secs_f64() - prefill_s,
    };
    Ok((out, done))
}

/// The output side of the job: the log, the progress bar, the counts.
struct Output<'a> {
    log: LineLog,
    path: &'a Path,
    pb: &'a ProgressBar,
    t0: Instant,
    tokens: usize,
    totals: Done,
    written: usize,
    errors: usize,
}

impl Output<'_> {
    fn append(&mut self, line: &Value) -> Result<()> {
        self.log
            .append(&line.to_string())
            .with_context(|| format!("cannot append to {}", self.path.display()))?;
        self.written += 1;
        self.pb.inc(1);
        let s = self.t0.elapsed().as_secs_f64();
        if s > 0.0 {
            self.pb
                .set_message(format!("{:.0} tok/s", self.tokens as f64 / s));
        }
        Ok(())
    }
}

/// Run every prepared record in order (`engine` is None when none needs one). Err: the job
/// stopped (interrupted, or a failure that is not the record's fault).
fn drive<B: Backend>(
    mut engine: Option<(&Engine<B>, &mut Session<B>)>,
    c: &Ctx,
    prepared: &[(String, std::result::Result<Vec<u32>, String>)],
    ctx: usize,
    max_context: usize,
    out: &mut Output,
) -> Result<()> {
    for (id, prompt) in prepared {
        if interrupted() {
            bail!("interrupted");
        }
        let result = match (prompt, engine.as_mut()) {
            (Err(msg), _) => Err(Stop::Bad(msg.clone())),
            (Ok(p), _) if p.len() > ctx => Err(Stop::Bad(format!(
                "the prompt has {} tokens but the context holds {ctx} (the model's maximum is {max_context}; see --ctx-size)",
                p.len(),
            ))),
            (Ok(p), Some((e, session))) => one(e, session, c, id, p),
            (Ok(_), None) => Err(Stop::Fatal(anyhow::anyhow!("no engine was started"))),
        };
        let line = match result {
            Ok((v, d)) => {
                out.tokens += d.prompt_tokens + d.generated;
                let t = &mut out.totals;
                t.prompt_tokens += d.prompt_tokens;
                t.generated += d.generated;
                t.prefill_s += d.prefill_s;
                t.decode_s += d.decode_s;
                v
            }
            Err(Stop::Bad(msg)) => {
                out.errors += 1;
                tracing::warn!("record {id}: {msg}");
                json!({"id": id, "error": msg})
            }
            Err(Stop::Interrupted) => bail!("interrupted"),
            Err(Stop::Fatal(e)) => return Err(e.context(format!("record {id}"))),
        };
        out.append(&line)?;
    }
    Ok(())
}

/// The input is a file or a directory (not a device or a pipe: a job reads it again to
/// resume), and the output is not the input (it would be taken for a finished job's output).
fn check_paths(input: &Path, meta: &std::fs::Metadata, output: &Path) -> Result<()> {
    if !meta.is_file() && !meta.is_dir() {
        bail!(
            "input {} is neither a regular file nor a directory (a job reads its input again to resume)",
            input.display()
        );
    }
    #[cfg(unix)]
    if let Ok(out) = std::fs::metadata(output) {
        use std::os::unix::fs::MetadataExt;
        if (out.dev(), out.ino()) == (meta.dev(), meta.ino()) {
            bail!(
                "--output {} is the input {}: the results would be appended to the prompts (and every record taken as done)",
                output.display(),
                input.display()
            );
        }
    }
    Ok(())
}

pub fn run(args: PrefillArgs) -> Result<()> {
    let sampler = args.sampling.params(0.0, || 0)?;
    let meta = std::fs::metadata(&args.input)
        .with_context(|| format!("input {} is not readable", args.input.display()))?;
    check_paths(&args.input, &meta, &args.output)?;
    let records = if meta.is_dir() {
        read_dir(&args.input)?
    } else {
        read_jsonl(&args.input)?
    };
    if let Some(dir) = &args.save_contexts {
        crate::kv::persist::prepare(dir)
            .with_context(|| format!("--save-contexts {} is not usable", dir.display()))?;
    }
    let (log, lines) = LineLog::open(&args.output)
        .with_context(|| format!("cannot open output {}", args.output.display()))?;
    let mut done: HashSet<String> = HashSet::new();
    for (i, l) in lines.iter().enumerate() {
        match serde_json::from_str::<Value>(l)
            .ok()
            .and_then(|v| v["id"].as_str().map(str::to_string))
        {
            Some(id) => {
                done.insert(id);
            }
            None => tracing::warn!(
                "{} line {}: not a result line; ignored",
                args.output.display(),
                i + 1
            ),
        }
    }
    let total = records.len();
    let skipped = records.iter().filter(|r| done.contains(&r.id)).count();
    if skipped > 0 {
        eprintln!(
            "resuming: {skipped} of {total} records already in {}",
            args.output.display()
        );
    }

    let loaded = LoadedModel::load(&args.model)?;
    let tok = loaded.tokenizer.as_ref();
    let vocab = loaded.spec().vocab_size;
    // Every prompt is read and tokenized first, done ones too: the context holds the longest,
    // and a resumed job sizes it (and so plans the device) exactly as the first run did.
    let prepared: Vec<(String, std::result::Result<Vec<u32>, String>)> = records
        .into_iter()
        .map(|r| {
            let t = r.source.and_then(|s| tokens_of(&s, tok, vocab));
            (r.id, t)
        })
        .collect();
    let longest = prepared
        .iter()
        .filter_map(|(_, t)| t.as_ref().ok().map(Vec::len))
        .max();
    let prepared: Vec<_> = prepared
        .into_iter()
        .filter(|(id, _)| !done.contains(id))
        .collect();
    let needs_engine = prepared.iter().any(|(_, t)| t.is_ok());
    let ctx = loaded.context_for(
        &args.model,
        longest.unwrap_or(1).saturating_add(args.max_tokens),
    )?;
    let model_id = loaded.model_id()?;
    let c = Ctx {
        args: &args,
        sampler,
        tok,
        model_id,
        owner: args.context_key.as_deref().map(crate::service::owner_of),
    };

    catch_interrupts();
    let pb = if args.quiet || !std::io::stderr().is_terminal() {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(total as u64)
    };
    pb.set_style(
        ProgressStyle::with_template(
            "{bar:30} {pos}/{len} prompts  {msg}  [{elapsed_precise} < {eta}]",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    pb.set_position(skipped as u64);
    let mut out = Output {
        log,
        path: &args.output,
        pb: &pb,
        t0: Instant::now(),
        tokens: 0,
        totals: Done::default(),
        written: 0,
        errors: 0,
    };
    let max_context = loaded.spec().max_context;
    let outcome = match longest.filter(|_| needs_engine) {
        // Only bad records left: no engine needed.
        None => drive::<crate::backend::cpu::CpuBackend>(
            None,
            &c,
            &prepared,
            ctx,
            max_context,
            &mut out,
        ),
        Some(longest) => {
            let running = loaded.start(
                &args.model,
                Job::single(ctx, longest.min(MAX_BATCH), 1).with_prompt(longest),
            )?;
            with_engine!(&running.engine, e => {
                let mut session = e.new_session(ctx)?;
                drive(Some((e, &mut session)), &c, &prepared, ctx, max_context, &mut out)
            })
        }
    };
    let (tokens, written, errors, t0, d) =
        (out.tokens, out.written, out.errors, out.t0, out.totals);
    pb.finish_and_clear();
    let s = t0.elapsed().as_secs_f64();
    let rate = if s > 0.0 { tokens as f64 / s } else { 0.0 };
    eprintln!(
        "[{written} records written ({errors} errors), {skipped} skipped as done; prefill {} tokens at {:.1} tok/s, {} generated at {:.1} tok/s; {tokens} tokens at {rate:.1} tok/s overall]",
        d.prompt_tokens,
        per_s(d.prompt_tokens, d.prefill_s),
        d.generated,
        per_s(d.generated, d.decode_s),
    );
    match outcome {
        Ok(()) => Ok(()),
        Err(e) if interrupted() => Err(e).with_context(|| {
            format!(
                "stopped after {} of {total} records; run the same command again to resume (records in {} are skipped)",
                skipped + written,
                args.output.display()
            )
        }),
        Err(e) => Err(e).with_context(|| {
            "the job stopped; run the same command again to resume".to_string()
        }),
    }
}

/// The fuzz harness's entry (tests/fuzz.rs, scripts/fuzz.sh): read `path` as `prefill -i` reads a
/// JSONL file, then each record's context id and prompt tokens without a model (prompt files
/// are not opened); per record, its error or the kind of its prompt.
#[doc(hidden)]
pub fn fuzz_read_records(path: &Path) -> Result<Vec<String>> {
    let records = read_jsonl(path)?;
    Ok(records
        .iter()
        .map(|r| {
            let _ = context_id(&r.id);
            match &r.source {
                Ok(s @ (Source::Text(_) | Source::Tokens(_))) => match tokens_of(s, None, 512) {
                    Ok(_) => "tokens".to_string(),
                    Err(e) => e,
                },
                Ok(Source::File(_)) => "file".to_string(),
                Err(e) => e.clone(),
            }
        })
        .collect())
}
