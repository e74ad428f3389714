//! Where the benchmarks that write reports put them: the `--out` directory, created and proved
//! writable before any work, and the reports' timestamp.

use std::path::Path;

use anyhow::{Context, Result};

/// Create `dir` and prove it can be written, before any work.
pub fn writable_dir(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("--out {}: cannot create the directory", dir.display()))?;
    let probe = dir.join(".gpu-offload-write-test");
    crate::fsutil::write_atomic(&probe, b"ok")
        .with_context(|| format!("--out {}: cannot write there", dir.display()))?;
    std::fs::remove_file(&probe).ok();
    Ok(())
}

/// Seconds since the Unix epoch (0 where the clock is before it): a report's `created_unix_s`.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
