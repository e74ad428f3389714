//! The in-process fuzz loop shared by the short run (tests/fuzz.rs) and the long runs
//! (fuzz/main.rs): mutate corpus entries, run the target, keep an input that gave an outcome not
//! seen before (a new error message, numbers masked, is a new path through the checks: the only
//! coverage signal a stable, uninstrumented build has).
//!
//! Before each input runs it is written to `current`, so when the target aborts or hangs the
//! process that started this one can name the input; a watchdog aborts on a hang.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::mutate::{Rng, mutate};
use super::targets::Harness;

/// An input taking this long is a hang: normal inputs take milliseconds.
pub const HANG: Duration = Duration::from_secs(30);

/// What a run found.
#[derive(Debug, Default)]
pub struct Stats {
    pub execs: u64,
    pub ok: u64,
    /// Distinct outcomes (`ok` or an error message with its numbers masked), with a count.
    pub outcomes: BTreeMap<String, u64>,
    pub corpus: usize,
    pub slowest: Duration,
    /// Inputs that panicked, with the panic's message.
    pub panics: Vec<(Vec<u8>, String)>,
}

/// An outcome's signature: the message with digit runs and quoted text (`…`, '…') masked, cut to
/// 160 characters, so "offset 4096" and "offset 8192", or two mangled key names, are one path.
pub fn signature(outcome: &Result<(), String>) -> String {
    let Err(msg) = outcome else {
        return "ok".into();
    };
    let mut out = String::new();
    let mut quote: Option<char> = None;
    for c in msg.chars() {
        match quote {
            Some(q) if c == q => {
                out.push(c);
                quote = None;
            }
            Some(_) => {}
            // An apostrophe inside a word ("model's") opens no quote.
            None if c == '`'
                || (c == '\'' && (out.is_empty() || out.ends_with([' ', '(', '[']))) =>
            {
                out.push(c);
                out.push('_');
                quote = Some(c);
            }
            None if c.is_ascii_digit() => {
                if !out.ends_with('#') {
                    out.push('#');
                }
            }
            None => out.push(c),
        }
    }
    out.chars().take(160).collect()
}

/// Aborts the process if one input runs past [`HANG`]; the input is in `current`.
pub struct Watchdog {
    started_ms: Arc<AtomicU64>,
    epoch: Instant,
}

impl Watchdog {
    pub fn start(current: PathBuf) -> Watchdog {
        let started_ms = Arc::new(AtomicU64::new(u64::MAX));
        let epoch = Instant::now();
        let shared = started_ms.clone();
        std::thread::spawn(move || {
            loop {
                std::thread::sleep(Duration::from_millis(500));
                let s = shared.load(Ordering::Relaxed);
                let now = epoch.elapsed().as_millis() as u64;
                if s != u64::MAX && now.saturating_sub(s) > HANG.as_millis() as u64 {
                    eprintln!(
                        "fuzz: HANG: one input ran over {} s; it is in {}",
                        HANG.as_secs(),
                        current.display()
                    );
                    std::process::abort();
                }
            }
        });
        Watchdog { started_ms, epoch }
    }

    fn begin(&self) {
        let now = self.epoch.elapsed().as_millis() as u64;
        self.started_ms.store(now, Ordering::Relaxed);
    }

    fn end(&self) {
        self.started_ms.store(u64::MAX, Ordering::Relaxed);
    }
}

/// Runs inputs one at a time, each written to `current` first.
pub struct Runner<'a> {
    pub harness: &'a mut Harness,
    pub current: PathBuf,
    pub watchdog: Watchdog,
    pub stats: Stats,
}

impl Runner<'_> {
    /// Run one input; the outcome's signature and whether it is new.
    pub fn run(&mut self, input: &[u8]) -> (String, bool) {
        // Best effort: if it cannot be written, a crash is still reported, unnamed.
        let _ = std::fs::write(&self.current, input);
        self.watchdog.begin();
        let t = Instant::now();
        let harness = &mut *self.harness;
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| harness.run(input)));
        let took = t.elapsed();
        let outcome = caught.unwrap_or_else(|payload| {
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "(no message)".into());
            self.stats.panics.push((input.to_vec(), msg.clone()));
            Err(format!("PANIC: {msg}"))
        });
        self.watchdog.end();
        self.stats.slowest = self.stats.slowest.max(took);
        self.stats.execs += 1;
        if outcome.is_ok() {
            self.stats.ok += 1;
        }
        let sig = signature(&outcome);
        let count = self.stats.outcomes.entry(sig.clone()).or_insert(0);
        *count += 1;
        (sig, *count == 1)
    }

    /// Mutate the corpus until `more(execs)` says stop; inputs with a new outcome join the
    /// corpus (and are written to `keep` when given).
    pub fn fuzz(
        &mut self,
        corpus: &mut Vec<Vec<u8>>,
        rng: &mut Rng,
        keep: Option<&Path>,
        mut more: impl FnMut(u64) -> bool,
    ) {
        if corpus.is_empty() {
            corpus.push(Vec::new());
        }
        while more(self.stats.execs) {
            let base = &corpus[rng.below(corpus.len())];
            let donor = &corpus[rng.below(corpus.len())];
            let input = mutate(base, donor, rng);
            let (_, new) = self.run(&input);
            if new {
                if let Some(dir) = keep {
                    let name = format!("{:016x}", fnv1a(&input));
                    let _ = std::fs::write(dir.join(name), &input);
                }
                corpus.push(input);
            }
        }
        self.stats.corpus = corpus.len();
    }
}

/// A stable name for an input (FNV-1a 64).
pub fn fnv1a(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The committed regression inputs of a target: tests/fuzz_regressions/<target>/*.
pub fn regressions(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = super::targets::repo_root()
        .join("tests/fuzz_regressions")
        .join(target);
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
        .into_iter()
        .filter_map(|p| std::fs::read(&p).ok().map(|d| (p, d)))
        .collect()
}
