//! File writing that never leaves a half-written file behind: write to a temporary file in the
//! same directory, fsync it, rename it over the target, fsync the directory; and an append-only
//! line log ([`LineLog`]) whose every line is whole or absent after a crash.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::Path;

/// Replace `path` with `bytes` atomically: readers see the old file or the new one, never a mix,
/// and after a crash the new one is either complete or absent.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    write_atomic_with(path, |f| f.write_all(bytes))
}

/// Like [`write_atomic`], with the contents produced by `fill` (for files too large to build in
/// memory first).
pub fn write_atomic_with(
    path: &Path,
    fill: impl FnOnce(&mut File) -> io::Result<()>,
) -> io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "path has no file name"))?;
    // A writer killed before its rename left its temporary behind; its name says whose it was.
    remove_stale_temps(dir, Some(name.to_string_lossy().as_ref()));
    let tmp = dir.join(format!(
        ".{}.tmp.{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let result = (|| {
        let mut f = File::create(&tmp)?;
        fill(&mut f)?;
        f.sync_all()?;
        drop(f);
        fs::rename(&tmp, path)?;
        // The rename itself must reach the disk.
        if let Ok(d) = File::open(dir) {
            d.sync_all().ok();
        }
        Ok(())
    })();
    if result.is_err() {
        fs::remove_file(&tmp).ok();
    }
    result
}

/// Remove the temporaries in `dir` that writers killed mid-write left behind: `.{name}.tmp.{pid}`
/// (a file of [`write_atomic`] or a directory written whole, then renamed) and `.{name}.old.{pid}`
/// (a directory being replaced), whose process `pid` is gone. `name`: only those of that target.
/// Returns how many were removed. Best effort: an unreadable directory or a temporary that cannot
/// be removed is left as it is (it is never read as data).
pub fn remove_stale_temps(dir: &Path, name: Option<&str>) -> usize {
    let Ok(entries) = fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for e in entries.flatten() {
        let fname = e.file_name().to_string_lossy().into_owned();
        let Some((target, pid)) = temp_owner(&fname) else {
            continue;
        };
        if name.is_some_and(|n| n != target) || process_alive(pid) {
            continue;
        }
        let path = e.path();
        let gone = match e.file_type() {
            Ok(t) if t.is_dir() => fs::remove_dir_all(&path),
            _ => fs::remove_file(&path),
        };
        if gone.is_ok() {
            tracing::info!(
                "removed {}, left by process {pid}, which is gone",
                path.display()
            );
            removed += 1;
        }
    }
    removed
}

/// `.{name}.tmp.{pid}` or `.{name}.old.{pid}` → (name, pid).
fn temp_owner(file_name: &str) -> Option<(&str, u32)> {
    let rest = file_name.strip_prefix('.')?;
    let (head, pid) = rest.rsplit_once('.')?;
    let pid = pid.parse::<u32>().ok()?;
    let target = head
        .strip_suffix(".tmp")
        .or_else(|| head.strip_suffix(".old"))?;
    (!target.is_empty()).then_some((target, pid))
}

/// Whether process `pid` runs (on Linux: has a `/proc` entry). Where that cannot be told, every
/// process counts as alive, so nothing is removed.
fn process_alive(pid: u32) -> bool {
    if pid == std::process::id() {
        return true;
    }
    if cfg!(target_os = "linux") && Path::new("/proc/self").exists() {
        return Path::new(&format!("/proc/{pid}")).exists();
    }
    true
}

/// An append-only file of newline-terminated lines (JSONL) that a job appends one record at a
/// time and that survives the job being killed at any instant.
///
/// Why this is atomic enough: each line goes out as one `write` of the whole line (newline
/// included) on a file opened for appending, then `fdatasync`. Only one writer exists (an
/// exclusive `flock` is held while the log is open), so lines never interleave. A process killed
/// in the middle of that `write` can leave at most a prefix of that one line at the end of the
/// file (Linux may stop a write to a regular file short on a fatal signal), never a hole or a
/// damaged earlier line; and only a newline-terminated line counts as written. [`LineLog::open`]
/// cuts such a trailing partial line off before anything is appended, so a restarted job writes
/// the record again whole, exactly once. A line that was written whole but not yet synced when
/// the process died is still in the page cache and reaches the disk; only a power loss can drop
/// it, and then it is absent (or partial, and cut) — the record runs again. Rewriting the whole
/// file with temp + rename per record would give the same guarantee at a cost growing with the
/// file (outputs with logits are large).
pub struct LineLog {
    file: File,
}

impl LineLog {
    /// Open (or create) the log at `path`, cut a trailing partial line, and return it with the
    /// complete lines already there. Fails when another process holds the log open.
    pub fn open(path: &Path) -> io::Result<(LineLog, Vec<String>)> {
        let mut file = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(path)?;
        lock_exclusive(&file)?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)?;
        let whole = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
        if whole < bytes.len() {
            tracing::warn!(
                "{}: cutting a partial last line ({} bytes) left by an interrupted write",
                path.display(),
                bytes.len() - whole
            );
            file.set_len(whole as u64)?;
            file.sync_all()?;
        }
        let lines = String::from_utf8_lossy(&bytes[..whole])
            .lines()
            .map(str::to_string)
            .collect();
        Ok((LineLog { file }, lines))
    }

    /// Append `line` (which must not contain a newline) and make it durable.
    pub fn append(&mut self, line: &str) -> io::Result<()> {
        if line.contains('\n') {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a log line must not contain a newline",
            ));
        }
        let mut buf = Vec::with_capacity(line.len() + 1);
        buf.extend_from_slice(line.as_bytes());
        buf.push(b'\n');
        self.file.write_all(&buf)?;
        self.file.sync_data()
    }
}

#[cfg(unix)]
fn lock_exclusive(file: &File) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: flock on a descriptor we own; released when the file is closed.
    let r = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if r != 0 {
        let e = io::Error::last_os_error();
        return Err(if e.kind() == io::ErrorKind::WouldBlock {
            io::Error::new(
                io::ErrorKind::WouldBlock,
                "another process is writing this file",
            )
        } else {
            e
        });
    }
    Ok(())
}

#[cfg(not(unix))]
fn lock_exclusive(_file: &File) -> io::Result<()> {
    Ok(())
}

/// Read `path` whole, but never more than `max + 1` bytes: a result longer than `max` means the
/// file is over it (and `/dev/zero` or a huge file costs `max` bytes, not all memory).
pub fn read_at_most(path: &Path, max: u64) -> io::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    File::open(path)?
        .take(max.saturating_add(1))
        .read_to_end(&mut bytes)?;
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_log_cuts_a_partial_last_line_and_appends_whole_lines() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("out.jsonl");
        // A job killed in the middle of its third line.
        fs::write(&p, b"{\"id\":\"a\"}\n{\"id\":\"b\"}\n{\"id\":\"c\",\"te").unwrap();
        let (mut log, lines) = LineLog::open(&p).unwrap();
        assert_eq!(lines, vec![r#"{"id":"a"}"#, r#"{"id":"b"}"#]);
        assert_eq!(fs::read(&p).unwrap(), b"{\"id\":\"a\"}\n{\"id\":\"b\"}\n");
        log.append(r#"{"id":"c"}"#).unwrap();
        assert!(log.append("two\nlines").is_err());
        drop(log);
        let (_, lines) = LineLog::open(&p).unwrap();
        assert_eq!(lines.len(), 3);
        assert_eq!(lines[2], r#"{"id":"c"}"#);

        // Nothing but a partial line: the file becomes empty.
        fs::write(&p, b"{\"id\":").unwrap();
        let (_, lines) = LineLog::open(&p).unwrap();
        assert!(lines.is_empty());
        assert_eq!(fs::read(&p).unwrap(), b"");
    }

    #[test]
    fn line_log_has_one_writer() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("out.jsonl");
        let (_held, _) = LineLog::open(&p).unwrap();
        let e = LineLog::open(&p).err().expect("a second writer is refused");
        assert!(e.to_string().contains("another process"), "{e}");
    }

    #[test]
    fn replaces_the_file_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.bin");
        write_atomic(&p, b"one").unwrap();
        write_atomic(&p, b"two").unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"two");
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn temporaries_of_dead_writers_are_removed_and_others_kept() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        // No process has id 999999999 (Linux ids stop at 2^22); process 1 always runs.
        for n in [
            ".a.bin.tmp.999999999",
            ".a.bin.tmp.1",
            ".b.bin.tmp.999999999",
            ".a.bin.tmp.x",
            "a.bin.tmp.999999999",
        ] {
            fs::write(d.join(n), b"partial").unwrap();
        }
        fs::create_dir(d.join(".store.old.999999999")).unwrap();
        write_atomic(&d.join("a.bin"), b"whole").unwrap();
        let mut left: Vec<String> = fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        // Only a.bin's own dead temporary went; the rest is another target's or not a temporary.
        assert_eq!(
            left,
            [
                ".a.bin.tmp.1",
                ".a.bin.tmp.x",
                ".b.bin.tmp.999999999",
                ".store.old.999999999",
                "a.bin",
                "a.bin.tmp.999999999"
            ]
        );
        assert_eq!(remove_stale_temps(d, None), 2);
        assert!(!d.join(".store.old.999999999").exists());
        assert!(d.join(".a.bin.tmp.1").exists());
    }

    #[test]
    fn a_failed_fill_keeps_the_old_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.bin");
        write_atomic(&p, b"old").unwrap();
        let err = write_atomic_with(&p, |f| {
            f.write_all(b"partial")?;
            Err(io::Error::other("disk full"))
        });
        assert!(err.is_err());
        assert_eq!(fs::read(&p).unwrap(), b"old");
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
