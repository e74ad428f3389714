//! The shared context store (`serve --context-store redis://…`): contexts in Redis or Valkey, so
//! that any replica of `serve` continues any conversation. Each replica keeps its own tiers
//! (device, DRAM, `--kv-dir`) as a cache in front of it.
//!
//! What lives in the store, under `gpu-offload:` — per context `ctx:<id>` (its index, sealed as
//! on disk), `stamp:<id>` (the revision and its writer, what a replica compares its copy with),
//! `lease:<id>` (the one call that may write it, with an expiry) and `chunk:<id>:<name>` (the
//! same compressed, checksummed chunks `--kv-dir` holds, named by content); for the budget
//! (`--context-store-max-bytes`) `chunks:lru` (chunk keys by last use), `chunks:size` and
//! `chunks:bytes`.
//!
//! A call takes the context's lease (waiting while another call holds it), runs, and its
//! write-back (`writeback`) writes the chunks first and switches index and stamp last, in
//! one script that checks the lease and the revision it started from, then gives the lease back:
//! a replica that dies mid-call leaves the context as it was, and a write that lost its lease to
//! another call is refused and counted, never merged (no silent fork).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use redis::{Client, Connection, RedisError, Script};
use thiserror::Error;

mod writeback;

use super::persist::{self, ChunkRecord, ContextIndex};
use writeback::WriteBack;
pub use writeback::WriteBackCounters;

/// How long one command may take before the store counts as unreachable.
const IO_TIMEOUT: Duration = Duration::from_secs(3);
/// How long taking a pooled connection may wait (a new one's connect included).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// How often a call waiting for a context's lease asks again.
const LEASE_POLL: Duration = Duration::from_millis(25);

/// Lua run by the store, each one step done atomically there. Chunk scripts take the budget's
/// keys ([`SharedStore::budget_keys`]) first.
static CREATE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"if redis.call('exists', KEYS[1]) == 1 then return 0 end
          redis.call('set', KEYS[1], ARGV[1])
          redis.call('set', KEYS[2], ARGV[2])
          return 1",
    )
});
static RENEW: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"if redis.call('get', KEYS[1]) == ARGV[1] then
            return redis.call('pexpire', KEYS[1], ARGV[2]) end
          return 0",
    )
});
static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"if redis.call('get', KEYS[1]) == ARGV[1] then
            return redis.call('del', KEYS[1]) end
          return 0",
    )
});
/// KEYS[4] the chunk; ARGV its bytes, the time, its size. One already there is only touched.
static PUT_CHUNK: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"if redis.call('exists', KEYS[4]) == 0 then
            redis.call('set', KEYS[4], ARGV[1])
            redis.call('hset', KEYS[2], KEYS[4], ARGV[3])
            redis.call('incrby', KEYS[3], ARGV[3])
          end
          redis.call('zadd', KEYS[1], ARGV[2], KEYS[4])
          return 1",
    )
});
/// KEYS: lease, index, stamp; ARGV: token, base stamp, sealed index, its stamp.
static SWITCH_INDEX: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"local stamp = redis.call('get', KEYS[3])
          if stamp == ARGV[4] then return 1 end
          local holder = redis.call('get', KEYS[1])
          if holder and holder ~= ARGV[1] then return -1 end
          if stamp ~= ARGV[2] then return -2 end
          redis.call('set', KEYS[2], ARGV[3])
          redis.call('set', KEYS[3], ARGV[4])
          return 1",
    )
});
/// A chunk key forgotten: out of the budget's count and order, deleted (shared by the scripts
/// that drop chunks).
const FORGET_CHUNK: &str = r"local function forget(k)
    local s = redis.call('hget', KEYS[2], k)
    if s then
      redis.call('decrby', KEYS[3], s)
      redis.call('hdel', KEYS[2], k)
    end
    redis.call('zrem', KEYS[1], k)
    redis.call('del', k)
  end
";
/// ARGV: the chunk keys to drop.
static DROP_CHUNKS: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{FORGET_CHUNK}for _, k in ipairs(ARGV) do forget(k) end
         return #ARGV"
    ))
});
/// ARGV[1]: the budget (-1: none). Returns {dropped, bytes held}.
static EVICT: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{FORGET_CHUNK}local n = 0
         local max = tonumber(ARGV[1])
         while max >= 0 and tonumber(redis.call('get', KEYS[3]) or '0') > max do
           local m = redis.call('zpopmin', KEYS[1])
           if #m == 0 then break end
           forget(m[1])
           n = n + 1
         end
         return {{n, tonumber(redis.call('get', KEYS[3]) or '0')}}"
    ))
});

/// Settings of the shared store.
#[derive(Clone, Debug)]
pub struct SharedConfig {
    /// `redis://[user:password@]host:port[/db]` or `rediss://…` (TLS).
    pub url: String,
    /// Used where the URL carries none.
    pub password: Option<String>,
    /// PEM certificates to trust for `rediss://` (a private CA); None: the system's roots.
    pub ca_pem: Option<Vec<u8>>,
    /// Chunk bytes the store may hold; beyond, the least recently used chunks are dropped (their
    /// contexts recompute them). None: no bound.
    pub max_bytes: Option<u64>,
    /// A lease's life without renewal: a replica that dies frees its contexts after this.
    pub lease_ttl: Duration,
}

#[derive(Debug, Error)]
pub enum SharedError {
    #[error("--context-store {url}: {msg}")]
    BadUrl { url: String, msg: String },
    #[error("the context store at {url} is unreachable: {msg}")]
    Unreachable { url: String, msg: String },
    #[error("the context store at {url} refused the credentials: {msg}")]
    Auth { url: String, msg: String },
    #[error("no context '{id}'")]
    NotFound { id: String },
    #[error("context '{id}' is in use by another call (on this or another replica); retry later")]
    Busy { id: String },
    #[error(
        "chunk {file} of context '{id}' was dropped from the store (--context-store-max-bytes)"
    )]
    Evicted { id: String, file: String },
    #[error("context '{id}' in the store is unusable: {msg}")]
    Corrupt { id: String, msg: String },
}

/// Whether the store answers, and the last failure.
#[derive(Clone, Debug, serde::Serialize)]
pub struct SharedHealth {
    pub url: String,
    /// "ok", or "degraded" when the last command failed.
    pub state: &'static str,
    pub last_error: Option<String>,
    /// Completed calls whose write to the store has not gone through yet.
    pub pending_writebacks: usize,
    /// Chunk bytes the store held after this replica's last write (None: none yet).
    pub chunk_bytes: Option<u64>,
}

/// What became of a call's result in the store, as its client hears it.
#[derive(Clone, Debug)]
pub enum WriteOutcome {
    /// The store has it (or there was nothing to write).
    Stored,
    /// The store could not be reached: the call completes from this replica's copy, the
    /// write-back retrying behind it.
    Retrying,
    /// Refused: another call wrote the context after this call's lease expired, or the store's
    /// copy is unusable; the conversation is as the store has it, without this call.
    Refused(String),
}

/// A context's lease: while held, only its call writes the context. Dropped, it is given back
/// (by the write-back thread, never blocking the caller).
pub struct Lease {
    pub id: String,
    pub token: String,
    store: Arc<SharedStore>,
    given_back: bool,
}

impl Lease {
    /// Give the lease to the write-back with this call's result: `index` (revision and writer
    /// already set) becomes the context once `chunks` (name, bytes) are in the store.
    /// `written` runs once the store has it, or has refused it, or at the first failure to
    /// reach the store (the call then completes from this replica's copy, the write-back
    /// retrying behind it).
    pub fn commit(
        mut self,
        base: &ContextIndex,
        index: ContextIndex,
        chunks: Vec<(ChunkRecord, Arc<Vec<u8>>)>,
        written: Box<dyn FnOnce(WriteOutcome) + Send>,
    ) {
        self.given_back = true;
        let old: Vec<String> = base
            .chunk_files()
            .filter(|f| !index.chunk_files().any(|n| n == *f))
            .map(str::to_string)
            .collect();
        self.store.writeback.commit(writeback::Commit {
            id: self.id.clone(),
            token: self.token.clone(),
            base_stamp: base.stamp(),
            index,
            chunks,
            old_files: old,
            written: Some(written),
        });
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if !self.given_back {
            self.store.writeback.release(&self.id, &self.token);
        }
    }
}

/// A call's hold on a context: its lease and the context as the store has it.
pub struct Claim {
    pub lease: Lease,
    pub index: ContextIndex,
}

/// The connection pool to the store, the scripts, and the write-back thread.
pub struct SharedStore {
    pool: r2d2::Pool<Client>,
    /// The URL without its password (for messages).
    url: String,
    cfg: SharedConfig,
    prefix: &'static str,
    replica: String,
    calls: AtomicU64,
    health: Mutex<Option<String>>,
    writeback: WriteBack,
}

impl std::fmt::Debug for SharedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SharedStore({})", self.url)
    }
}

/// Commands on a pooled connection time out instead of hanging on a store that stopped.
#[derive(Debug)]
struct Timeouts;

impl r2d2::CustomizeConnection<Connection, RedisError> for Timeouts {
    fn on_acquire(&self, c: &mut Connection) -> Result<(), RedisError> {
        c.set_read_timeout(Some(IO_TIMEOUT))?;
        c.set_write_timeout(Some(IO_TIMEOUT))
    }
}

/// The URL as messages show it: the password replaced.
fn shown(url: &str) -> String {
    match redis::parse_redis_url(url) {
        Some(mut u) if u.password().is_some() => {
            u.set_password(Some("***")).ok();
            u.to_string()
        }
        _ => url.to_string(),
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl SharedStore {
    /// Connect (a clear error when the URL is wrong, the store unreachable or the password
    /// refused) and start the write-back thread.
    pub fn open(cfg: SharedConfig) -> Result<Arc<Self>, SharedError> {
        let url = shown(&cfg.url);
        let bad = |msg: String| SharedError::BadUrl {
            url: url.clone(),
            msg,
        };
        if !(cfg.url.starts_with("redis://") || cfg.url.starts_with("rediss://")) {
            return Err(bad(
                "expected redis://[user:password@]host:port[/db] or rediss://… (TLS)".into(),
            ));
        }
        if cfg.url.starts_with("rediss://") {
            // rustls needs a process-wide crypto provider; a second install is harmless.
            rustls::crypto::ring::default_provider()
                .install_default()
                .ok();
        }
        let mut info = redis::IntoConnectionInfo::into_connection_info(cfg.url.as_str())
            .map_err(|e| bad(e.to_string()))?;
        if info.redis_settings().password().is_none()
            && let Some(p) = &cfg.password
        {
            let r = info.redis_settings().clone().set_password(p);
            info = info.set_redis_settings(r);
        }
        let client = match &cfg.ca_pem {
            Some(pem) if cfg.url.starts_with("rediss://") => Client::build_with_tls(
                info,
                redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(pem.clone()),
                },
            ),
            Some(_) => return Err(bad("a CA certificate is for rediss:// (TLS) only".into())),
            None => Client::open(info),
        }
        .map_err(|e| bad(e.to_string()))?;
        // One connection first, so that the error names what failed.
        let mut first = client
            .get_connection_with_timeout(IO_TIMEOUT)
            .map_err(|e| classify(&url, e))?;
        redis::cmd("PING")
            .query::<String>(&mut first)
            .map_err(|e| classify(&url, e))?;
        let pool = r2d2::Pool::builder()
            .max_size(16)
            .min_idle(Some(1))
            // A store that is down is found out within a second (the engine thread's create, get
            // and delete wait no longer before their 503).
            .connection_timeout(CONNECT_TIMEOUT)
            // No PING before every command: a broken connection fails its command, is dropped,
            // and the command's caller retries (the write-back) or answers 503.
            .test_on_check_out(false)
            .connection_customizer(Box::new(Timeouts))
            .build_unchecked(client);
        let store = Arc::new_cyclic(|weak| SharedStore {
            pool,
            url,
            prefix: "gpu-offload",
            replica: format!("{:012x}", rand::random::<u64>() >> 16),
            calls: AtomicU64::new(0),
            health: Mutex::new(None),
            writeback: WriteBack::start(weak.clone(), cfg.lease_ttl),
            cfg,
        });
        Ok(store)
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    fn key(&self, kind: &str, id: &str) -> String {
        format!("{}:{kind}:{id}", self.prefix)
    }

    fn chunk_key(&self, id: &str, file: &str) -> String {
        format!("{}:chunk:{id}:{file}", self.prefix)
    }

    /// Run `f` on a pooled connection, keeping the store's health: a failure of the connection
    /// marks it degraded, a success ok again.
    fn run<T>(
        &self,
        f: impl Fn(&mut Connection) -> redis::RedisResult<T>,
    ) -> Result<T, SharedError> {
        let unreachable = |e: r2d2::Error| SharedError::Unreachable {
            url: self.url.clone(),
            msg: e.to_string(),
        };
        let r = match self.pool.get() {
            Err(e) => Err(unreachable(e)),
            Ok(mut c) => match f(&mut c) {
                // A pooled connection the store dropped (it restarted) fails once and is
                // discarded: the command goes again on a fresh one (every command here may be
                // repeated).
                Err(e) if e.is_io_error() || e.is_connection_dropped() => {
                    drop(c);
                    match self.pool.get() {
                        Ok(mut c) => f(&mut c).map_err(|e| classify(&self.url, e)),
                        Err(e) => Err(unreachable(e)),
                    }
                }
                r => r.map_err(|e| classify(&self.url, e)),
            },
        };
        let mut h = self.health.lock().unwrap_or_else(|e| e.into_inner());
        match &r {
            Err(e @ (SharedError::Unreachable { .. } | SharedError::Auth { .. })) => {
                *h = Some(e.to_string())
            }
            _ => *h = None,
        }
        r
    }

    /// Whether the store answers now (a PING), keeping the health.
    pub fn ping(&self) -> bool {
        self.run(|c| redis::cmd("PING").query::<String>(c)).is_ok()
    }

    pub fn health(&self) -> SharedHealth {
        let last_error = self
            .health
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        SharedHealth {
            url: self.url.clone(),
            state: if last_error.is_some() {
                "degraded"
            } else {
                "ok"
            },
            last_error,
            pending_writebacks: self.writeback.pending_total(),
            chunk_bytes: self.writeback.chunk_bytes(),
        }
    }

    /// Calls on context `id` this replica has not finished writing to the store.
    pub fn pending(&self, id: &str) -> usize {
        self.writeback.pending(id)
    }

    pub fn writeback_counters(&self) -> WriteBackCounters {
        self.writeback.counters()
    }

    /// Store a new context's index (revision 0); an id already there is refused.
    pub fn create(&self, index: &ContextIndex) -> Result<(), SharedError> {
        let ok: i64 = self.run(|c| {
            CREATE
                .key(self.key("ctx", &index.id))
                .key(self.key("stamp", &index.id))
                .arg(persist::seal(index))
                .arg(index.stamp())
                .invoke(c)
        })?;
        if ok != 1 {
            return Err(SharedError::Corrupt {
                id: index.id.clone(),
                msg: "an index of this id is already stored".into(),
            });
        }
        Ok(())
    }

    /// The context as the store has it (None: no such context), its stamp checked against the
    /// index it belongs with.
    pub fn index(&self, id: &str) -> Result<Option<ContextIndex>, SharedError> {
        if !plausible_id(id) {
            return Ok(None);
        }
        let (stamp, body): (Option<String>, Option<Vec<u8>>) = self.run(|c| {
            redis::cmd("MGET")
                .arg(self.key("stamp", id))
                .arg(self.key("ctx", id))
                .query(c)
        })?;
        let (Some(stamp), Some(body)) = (stamp, body) else {
            return Ok(None);
        };
        let corrupt = |msg: String| SharedError::Corrupt { id: id.into(), msg };
        let index = persist::unseal(&body).map_err(corrupt)?;
        if index.id != id || index.stamp() != stamp {
            return Err(corrupt(format!(
                "its index (id {}, revision {}) does not match its stamp {stamp}",
                index.id,
                index.stamp()
            )));
        }
        Ok(Some(index))
    }

    /// A fresh lease token: this replica's and the call's.
    fn token(&self) -> String {
        let n = self.calls.fetch_add(1, Ordering::Relaxed);
        format!("{}-{n}", self.replica)
    }

    /// Take context `id`'s lease, waiting up to `wait` while another call holds it (or this
    /// replica is still writing its last call back), and read the context as the store has it.
    pub fn claim(self: &Arc<Self>, id: &str, wait: Duration) -> Result<Claim, SharedError> {
        if !plausible_id(id) {
            return Err(SharedError::NotFound { id: id.into() });
        }
        let deadline = Instant::now() + wait;
        let token = self.token();
        let key = self.key("lease", id);
        let ttl = self.cfg.lease_ttl.as_millis() as u64;
        loop {
            // This replica's own write-back of the last call goes first.
            let taken = self.writeback.pending(id) == 0
                && self
                    .run(|c| {
                        redis::cmd("SET")
                            .arg(&key)
                            .arg(&token)
                            .arg("NX")
                            .arg("PX")
                            .arg(ttl)
                            .query::<Option<String>>(c)
                    })?
                    .is_some();
            if taken {
                break;
            }
            if Instant::now() >= deadline {
                return Err(SharedError::Busy { id: id.into() });
            }
            std::thread::sleep(LEASE_POLL);
        }
        let lease = Lease {
            id: id.into(),
            token,
            store: self.clone(),
            given_back: false,
        };
        self.writeback.hold(&lease.id, &lease.token);
        // Returning an error drops the lease, which gives it back.
        match self.index(id)? {
            Some(index) => Ok(Claim { lease, index }),
            None => Err(SharedError::NotFound { id: id.into() }),
        }
    }

    /// Keep lease `token` of `id` alive; false when it is no longer this call's.
    pub(super) fn renew(&self, id: &str, token: &str) -> Result<bool, SharedError> {
        let r: i64 = self.run(|c| {
            RENEW
                .key(self.key("lease", id))
                .arg(token)
                .arg(self.cfg.lease_ttl.as_millis() as u64)
                .invoke(c)
        })?;
        Ok(r == 1)
    }

    /// Give lease `token` of `id` back (nothing if it expired or is another's).
    pub(super) fn release(&self, id: &str, token: &str) -> Result<(), SharedError> {
        self.run(|c| {
            RELEASE
                .key(self.key("lease", id))
                .arg(token)
                .invoke::<i64>(c)
        })
        .map(|_| ())
    }

    /// Put chunks of `id` in the store (counted in the budget; one already there is only
    /// touched). One script a chunk: each carries a chunk's bytes.
    pub(super) fn put_chunks(
        &self,
        id: &str,
        chunks: &[(ChunkRecord, Arc<Vec<u8>>)],
    ) -> Result<(), SharedError> {
        let now = now_ms();
        for (rec, bytes) in chunks {
            self.run(|c| {
                let mut call = PUT_CHUNK.prepare_invoke();
                self.budget_keys(&mut call);
                call.key(self.chunk_key(id, &rec.file))
                    .arg(bytes.as_slice())
                    .arg(now)
                    .arg(bytes.len() as u64)
                    .invoke::<i64>(c)
            })?;
        }
        Ok(())
    }

    /// Which of `files` of `id` the store holds.
    pub(super) fn has_chunks(&self, id: &str, files: &[String]) -> Result<Vec<bool>, SharedError> {
        if files.is_empty() {
            return Ok(Vec::new());
        }
        self.run(|c| {
            let mut p = redis::pipe();
            for f in files {
                p.cmd("EXISTS").arg(self.chunk_key(id, f));
            }
            p.query::<Vec<bool>>(c)
        })
    }

    /// Switch context `id` to `index` if the call holding `token` still may: nobody else holds
    /// the lease and the store's revision is still `base_stamp` (or already `index`'s: a retry
    /// after the switch went through). Ok(false): refused (another call wrote the context
    /// meanwhile).
    pub(super) fn switch_index(
        &self,
        token: &str,
        base_stamp: &str,
        index: &ContextIndex,
    ) -> Result<bool, SharedError> {
        let r: i64 = self.run(|c| {
            SWITCH_INDEX
                .key(self.key("lease", &index.id))
                .key(self.key("ctx", &index.id))
                .key(self.key("stamp", &index.id))
                .arg(token)
                .arg(base_stamp)
                .arg(persist::seal(index))
                .arg(index.stamp())
                .invoke(c)
        })?;
        Ok(r == 1)
    }

    /// Drop chunks of `id` (and their count in the budget), in one script.
    pub(super) fn drop_chunks(&self, id: &str, files: &[String]) -> Result<(), SharedError> {
        if files.is_empty() {
            return Ok(());
        }
        self.run(|c| {
            let mut call = DROP_CHUNKS.prepare_invoke();
            self.budget_keys(&mut call);
            for f in files {
                call.arg(self.chunk_key(id, f));
            }
            call.invoke::<i64>(c)
        })
        .map(|_| ())
    }

    /// Drop the least recently used chunks until the store holds at most the budget (none
    /// without one): how many were dropped, and the chunk bytes the store then holds.
    pub(super) fn evict(&self) -> Result<(usize, u64), SharedError> {
        // -1: no budget, only the count is read.
        let max = self
            .cfg
            .max_bytes
            .map_or(-1, |m| m.min(i64::MAX as u64) as i64);
        let (n, bytes): (i64, i64) = self.run(|c| {
            let mut call = EVICT.prepare_invoke();
            self.budget_keys(&mut call);
            call.arg(max).invoke(c)
        })?;
        Ok((n as usize, bytes.max(0) as u64))
    }

    /// The budget's keys, as the chunk scripts take them: KEYS[1] the LRU order, KEYS[2] each
    /// chunk's size, KEYS[3] the total.
    fn budget_keys(&self, call: &mut redis::ScriptInvocation<'_>) {
        call.key(self.key("chunks", "lru"))
            .key(self.key("chunks", "size"))
            .key(self.key("chunks", "bytes"));
    }

    /// Seconds to read `bytes` from the store (best of a few, as the cost model's disk probe):
    /// a probe value of this replica's, gone after a minute.
    pub fn time_read(&self, bytes: usize) -> Result<f64, SharedError> {
        let key = self.key("probe", &self.replica);
        let value = vec![7u8; bytes];
        self.run(|c| {
            redis::cmd("SET")
                .arg(&key)
                .arg(value.as_slice())
                .arg("PX")
                .arg(60_000)
                .query::<()>(c)
        })?;
        let mut best = f64::INFINITY;
        for _ in 0..5 {
            let t = Instant::now();
            self.run(|c| redis::cmd("GET").arg(&key).query::<Vec<u8>>(c))?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        self.run(|c| redis::cmd("DEL").arg(&key).query::<i64>(c))?;
        Ok(best)
    }

    /// Read chunk `rec` of `id` (its length and checksum checked) and mark it used.
    pub fn read_chunk(&self, id: &str, rec: &ChunkRecord) -> Result<Vec<u8>, SharedError> {
        let key = self.chunk_key(id, &rec.file);
        let lru = self.key("chunks", "lru");
        let bytes: Option<Vec<u8>> = self.run(|c| {
            let (b, _): (Option<Vec<u8>>, i64) = redis::pipe()
                .cmd("GET")
                .arg(&key)
                .cmd("ZADD")
                .arg(&lru)
                .arg("XX")
                .arg(now_ms())
                .arg(&key)
                .query(c)?;
            Ok(b)
        })?;
        let corrupt = |msg: String| SharedError::Corrupt {
            id: id.into(),
            msg: format!("chunk {}: {msg}", rec.file),
        };
        let bytes = bytes.ok_or_else(|| SharedError::Evicted {
            id: id.into(),
            file: rec.file.clone(),
        })?;
        persist::check_chunk(rec, &bytes).map_err(corrupt)?;
        Ok(bytes)
    }

    /// Delete context `id` (its index, stamp and chunks); the caller holds its lease.
    pub fn delete(&self, claim: &Claim) -> Result<(), SharedError> {
        let id = &claim.index.id;
        let files: Vec<String> = claim.index.chunk_files().map(str::to_string).collect();
        self.drop_chunks(id, &files)?;
        self.run(|c| {
            redis::cmd("DEL")
                .arg(self.key("ctx", id))
                .arg(self.key("stamp", id))
                .query::<i64>(c)
        })
        .map(|_| ())
    }
}

/// Whether `id` could name a context (ids are made here: `ctx-` and hex): anything else from a
/// request's path is not looked up, so no key is ever built from arbitrary bytes.
fn plausible_id(id: &str) -> bool {
    (1..=64).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// A client error as the store's: refused credentials, else unreachable (connection, timeout,
/// or anything else the store answered instead of the command's reply).
fn classify(url: &str, e: RedisError) -> SharedError {
    let text = e.to_string();
    let auth = matches!(e.kind(), redis::ErrorKind::AuthenticationFailed)
        || ["WRONGPASS", "NOAUTH", "invalid password", "AUTH"]
            .iter()
            .any(|w| text.contains(w));
    if auth {
        SharedError::Auth {
            url: url.into(),
            msg: text,
        }
    } else {
        SharedError::Unreachable {
            url: url.into(),
            msg: text,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_ids_like_ours_are_looked_up() {
        assert!(plausible_id("ctx-0123456789abcdef"));
        assert!(plausible_id("saved_prompt-1"));
        for bad in ["", "a:b", "ctx-*", "x y", "ä", &"a".repeat(65)] {
            assert!(!plausible_id(bad), "{bad:?}");
        }
    }

    #[test]
    fn messages_never_show_the_password() {
        assert_eq!(
            shown("redis://user:s3cret@host:6379/2"),
            "redis://user:***@host:6379/2"
        );
        assert_eq!(shown("redis://host:6379"), "redis://host:6379");
        assert!(!shown("rediss://:pw@h:1").contains("pw"));
    }
}
