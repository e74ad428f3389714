//! The long-run fuzzer: `scripts/fuzz.sh` drives it.
//!
//! ```text
//! gpu-offload-fuzz list
//! gpu-offload-fuzz seeds TARGET DIR          write TARGET's seed corpus into DIR
//! gpu-offload-fuzz afl TARGET                one input per AFL++ iteration (built by cargo afl)
//! gpu-offload-fuzz run TARGET MINUTES CORPUS CRASHES [SEED]
//!                                            the in-process mutator for MINUTES, from the seeds
//!                                            and CORPUS; new outcomes are written to CORPUS,
//!                                            panicking inputs to CRASHES
//! gpu-offload-fuzz replay TARGET FILE...     run each file, print its outcome
//! ```

mod engine;
mod mutate;
mod targets;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize| args.get(i).map(String::as_str);
    let result = match (arg(0), arg(1)) {
        (Some("list"), _) => {
            println!("{}", targets::TARGETS.join("\n"));
            Ok(())
        }
        (Some("seeds"), Some(t)) => seeds(t, Path::new(arg(2).unwrap_or("."))),
        (Some("afl"), Some(t)) => afl(t),
        (Some("run"), Some(t)) => run(t, &args[2..]),
        (Some("replay"), Some(t)) => replay(t, &args[2..]),
        _ => Err("usage: gpu-offload-fuzz list | seeds T DIR | afl T | run T MINUTES CORPUS CRASHES [SEED] | replay T FILE...".into()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpu-offload-fuzz: {e}");
            ExitCode::FAILURE
        }
    }
}

fn seeds(target: &str, dir: &Path) -> Result<(), String> {
    let h = targets::Harness::new(target)?;
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    for (i, s) in h.seeds().iter().enumerate() {
        std::fs::write(dir.join(format!("seed-{i:02}")), s).map_err(|e| e.to_string())?;
    }
    Ok(())
}

#[cfg(feature = "afl")]
fn afl(target: &str) -> Result<(), String> {
    let mut h = targets::Harness::new(target)?;
    afl::fuzz!(|data: &[u8]| {
        let _ = h.run(data);
    });
    Ok(())
}

#[cfg(not(feature = "afl"))]
fn afl(_: &str) -> Result<(), String> {
    Err("built without the `afl` feature (scripts/fuzz.sh builds it with cargo afl)".into())
}

fn run(target: &str, rest: &[String]) -> Result<(), String> {
    let [minutes, corpus_dir, crash_dir, seed @ ..] = rest else {
        return Err("run TARGET MINUTES CORPUS CRASHES [SEED]".into());
    };
    let minutes: f64 = minutes.parse().map_err(|_| "MINUTES is a number")?;
    let seed: u64 = match seed.first() {
        Some(s) => s.parse().map_err(|_| "SEED is a number")?,
        None => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64),
    };
    let (corpus_dir, crash_dir) = (PathBuf::from(corpus_dir), PathBuf::from(crash_dir));
    for d in [&corpus_dir, &crash_dir] {
        std::fs::create_dir_all(d).map_err(|e| e.to_string())?;
    }
    let mut h = targets::Harness::new(target)?;
    let mut corpus = h.seeds();
    corpus.extend(engine::regressions(target).into_iter().map(|(_, d)| d));
    corpus.extend(read_dir(&corpus_dir).into_iter().map(|(_, d)| d));
    let current = crash_dir.join(".current");
    let watchdog = engine::Watchdog::start(current.clone());
    let mut runner = engine::Runner {
        harness: &mut h,
        current,
        watchdog,
        stats: engine::Stats::default(),
    };
    for input in corpus.clone() {
        runner.run(&input);
    }
    let mut rng = mutate::Rng::new(seed);
    let end = Instant::now() + Duration::from_secs_f64(minutes * 60.0);
    let mut next_report = Instant::now();
    let mut saved = 0;
    runner.fuzz(&mut corpus, &mut rng, Some(&corpus_dir), |execs| {
        let now = Instant::now();
        if now >= next_report {
            eprintln!("{target}: {execs} execs");
            next_report = now + Duration::from_secs(60);
        }
        now < end
    });
    for (input, msg) in &runner.stats.panics {
        let name = crash_dir.join(format!("panic-{:016x}", engine::fnv1a(input)));
        let _ = std::fs::write(&name, input);
        eprintln!("{target}: PANIC {msg}: {}", name.display());
        saved += 1;
    }
    let s = &runner.stats;
    println!(
        "{target}: seed {seed}, {minutes} min, {} execs ({:.0}/s), {} ok, {} distinct outcomes, corpus {}, {saved} panics, slowest input {:.0} ms",
        s.execs,
        s.execs as f64 / (minutes * 60.0),
        s.ok,
        s.outcomes.len(),
        s.corpus,
        s.slowest.as_secs_f64() * 1e3
    );
    let list: Vec<String> = s
        .outcomes
        .iter()
        .map(|(k, n)| format!("{n:>9}  {k}"))
        .collect();
    std::fs::write(
        corpus_dir.join("..").join(format!("{target}.outcomes")),
        list.join("\n"),
    )
    .map_err(|e| e.to_string())?;
    Ok(())
}

fn replay(target: &str, files: &[String]) -> Result<(), String> {
    let mut h = targets::Harness::new(target)?;
    for f in files {
        let data = std::fs::read(f).map_err(|e| format!("{f}: {e}"))?;
        match h.run(&data) {
            Ok(()) => println!("{f}: ok"),
            Err(e) => println!("{f}: error: {e}"),
        }
    }
    Ok(())
}

fn read_dir(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .filter_map(|p| std::fs::read(&p).ok().map(|d| (p, d)))
        .collect()
}
