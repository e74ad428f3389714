//! `gpu-offload serve`: load the model, start the engine thread and the HTTP server.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Args;

use crate::backend::KV_BLOCK;
use crate::kv::{self, Compression, CostModel, KvConfig, SharedConfig, SharedStore};
use crate::runtime::Job;
use crate::runtime::parse_bytes;
use crate::runtime::{LoadedModel, ModelArgs};
use crate::service::api::Limits;
use crate::service::conn::Timeouts;
use crate::service::server::{EngineThread, serve_http};
use crate::service::tokenize::Encoder;
use crate::service::worker::WorkerConfig;
use crate::service::{AppState, HttpConfig, Shared};

#[derive(Debug, Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,

    /// Address to listen on (loopback by default; anything else exposes the server).
    #[arg(long, env = "GPU_OFFLOAD_HOST", default_value = "127.0.0.1")]
    pub host: IpAddr,

    /// Port to listen on (0: any free port, printed at start).
    #[arg(long, env = "GPU_OFFLOAD_PORT", default_value_t = 8080)]
    pub port: u16,

    /// API keys (comma-separated). When set, every route but /health needs
    /// `Authorization: Bearer <key>`, and contexts belong to the key that created them.
    #[arg(long, env = "GPU_OFFLOAD_API_KEY", value_delimiter = ',')]
    pub api_key: Vec<String>,

    /// Sequences generated at once (their KV caches grow in the pool, --kv-pool-tokens). An
    /// offload plan (--gpu-mem) is costed for decode steps of this many sequences, --cold auto
    /// choosing the mode fastest for them, and kept for the run.
    #[arg(long, env = "GPU_OFFLOAD_PARALLEL", default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub parallel: u16,

    /// Positions of the paged KV pool on the device, shared by the running sequences and the
    /// contexts kept there: a sequence takes blocks of 16 positions as it grows, and starts
    /// once the pool can hold its prompt and max_tokens beside what the running ones may reach;
    /// idle contexts leave the device (LCTRU) when it runs short [default: --parallel × the
    /// context size]
    #[arg(long, env = "GPU_OFFLOAD_KV_POOL_TOKENS")]
    pub kv_pool_tokens: Option<usize>,

    /// Requests waiting at most; beyond, 429.
    #[arg(long, env = "GPU_OFFLOAD_QUEUE", default_value_t = 64)]
    pub queue: usize,

    /// Longest prompt accepted, in tokens [default: the context size]
    #[arg(long, env = "GPU_OFFLOAD_MAX_PROMPT_TOKENS")]
    pub max_prompt_tokens: Option<usize>,

    /// Largest max_tokens a request may ask for.
    #[arg(long, env = "GPU_OFFLOAD_MAX_TOKENS_LIMIT", default_value_t = 4096)]
    pub max_tokens_limit: usize,

    /// max_tokens when a request gives none.
    #[arg(long, env = "GPU_OFFLOAD_DEFAULT_MAX_TOKENS", default_value_t = 256)]
    pub default_max_tokens: usize,

    /// Directory where contexts persist (chunk files and indexes) [default: DRAM only, lost at exit]
    #[arg(long, env = "GPU_OFFLOAD_KV_DIR")]
    pub kv_dir: Option<PathBuf>,

    /// KV chunk compression when contexts leave the device: off, int8, int4, int2, or a ratio
    /// of the int8 size (e.g. 50%) met with per-chunk widths chosen by attention density (with
    /// --kv-dir, a chunk is kept exact where the measured decode costs more than loading the
    /// bytes exact adds).
    #[arg(long, env = "GPU_OFFLOAD_KV_COMPRESSION", default_value = "50%", value_parser = Compression::parse)]
    pub kv_compression: Compression,

    /// DRAM for compressed KV chunks (counted in the DRAM ledger).
    #[arg(long, env = "GPU_OFFLOAD_KV_DRAM_MEM", default_value = "512M", value_parser = parse_bytes)]
    pub kv_dram_mem: u64,

    /// Seconds in-flight requests may run after a shutdown signal before they are stopped.
    #[arg(long, env = "GPU_OFFLOAD_SHUTDOWN_GRACE", default_value_t = 10.0)]
    pub shutdown_grace: f64,

    /// Seconds a request head may take, from a connection's opening or the head's first byte
    /// to its end; a client slower than that (or silent) is closed, with a 408 once it began.
    #[arg(long, env = "GPU_OFFLOAD_HEADER_TIMEOUT", default_value_t = 10.0)]
    pub header_timeout: f64,

    /// Seconds a kept-alive connection may wait for its next request, and a client may leave
    /// its answer unread (a write without progress), before the connection is closed.
    #[arg(long, env = "GPU_OFFLOAD_IDLE_TIMEOUT", default_value_t = 60.0)]
    pub idle_timeout: f64,

    /// Seconds a request body may take to arrive whole; beyond, 408.
    #[arg(long, env = "GPU_OFFLOAD_BODY_TIMEOUT", default_value_t = 30.0)]
    pub body_timeout: f64,

    /// Prompts of one client (API key, or address without keys) encoded at once; more wait
    /// their turn (64 at most, then 429), never holding up other clients'.
    #[arg(long, env = "GPU_OFFLOAD_TOKENIZE_PER_KEY", default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..))]
    pub tokenize_per_key: u16,

    /// A store of contexts shared by replicas of this server, `redis://[user:password@]host:port[/db]`
    /// (Redis or Valkey; `rediss://` for TLS): every context's index and chunks live there,
    /// this server's tiers (device, DRAM, --kv-dir) a cache in front of it, so that a
    /// conversation continues on any replica. One call on a context at a time, everywhere.
    /// (Its value is not shown by --help: a URL may carry a password.)
    #[arg(long, env = "GPU_OFFLOAD_CONTEXT_STORE", hide_env_values = true)]
    pub context_store: Option<String>,

    /// The context store's password, where the URL carries none.
    #[arg(
        long,
        env = "GPU_OFFLOAD_CONTEXT_STORE_PASSWORD",
        hide_env_values = true
    )]
    pub context_store_password: Option<String>,

    /// PEM file of the certificates to trust for a `rediss://` context store (a private CA)
    /// [default: the system's roots]
    #[arg(long, env = "GPU_OFFLOAD_CONTEXT_STORE_CA")]
    pub context_store_ca: Option<PathBuf>,

    /// Chunk bytes the context store may hold; beyond, the least recently used chunks are
    /// dropped (their contexts recompute them from their tokens) [default: no bound]
    #[arg(long, env = "GPU_OFFLOAD_CONTEXT_STORE_MAX_BYTES", value_parser = parse_bytes)]
    pub context_store_max_bytes: Option<u64>,

    /// Seconds a context's lease lives without renewal: a replica that dies mid-call frees its
    /// context after this (renewed every third of it, at most a second apart, while the call
    /// runs).
    #[arg(long, env = "GPU_OFFLOAD_CONTEXT_LEASE_TTL", default_value_t = 30.0)]
    pub context_lease_ttl: f64,

    /// Seconds a call on a context that another call holds (on any replica) waits for it;
    /// beyond, 409.
    #[arg(long, env = "GPU_OFFLOAD_CONTEXT_WAIT", default_value_t = 30.0)]
    pub context_wait: f64,

    /// Model name reported by /v1/models and expected in requests [default: the file name]
    #[arg(long, env = "GPU_OFFLOAD_MODEL_NAME")]
    pub model_name: Option<String>,
}

/// The flags no model is needed to judge, checked before loading one; the connection deadlines.
fn check_flags(a: &ServeArgs) -> Result<Timeouts> {
    if !(a.shutdown_grace.is_finite() && a.shutdown_grace >= 0.0) {
        bail!("--shutdown-grace must be a non-negative number of seconds");
    }
    if a.api_key.iter().any(|k| k.trim().is_empty()) {
        bail!("--api-key: keys must not be empty");
    }
    if a.queue == 0 {
        bail!("--queue must be at least 1");
    }
    if a.default_max_tokens == 0 {
        bail!("--default-max-tokens must be at least 1 (a request generates at least one token)");
    }
    let seconds = |flag: &str, v: f64| -> Result<Duration> {
        if !(v.is_finite() && v > 0.0 && v <= 86_400.0) {
            bail!("--{flag} must be a number of seconds above 0 and at most 86400, got {v}");
        }
        Ok(Duration::from_secs_f64(v))
    };
    if !(a.context_wait.is_finite() && (0.0..=86_400.0).contains(&a.context_wait)) {
        bail!("--context-wait must be a number of seconds from 0 to 86400");
    }
    seconds("context-lease-ttl", a.context_lease_ttl)?;
    if a.context_lease_ttl < 0.3 {
        bail!("--context-lease-ttl must be at least 0.3 seconds (it is renewed every third)");
    }
    if a.context_store.is_none()
        && (a.context_store_password.is_some()
            || a.context_store_max_bytes.is_some()
            || a.context_store_ca.is_some())
    {
        bail!(
            "--context-store-password, --context-store-ca and --context-store-max-bytes need --context-store"
        );
    }
    Ok(Timeouts {
        header: seconds("header-timeout", a.header_timeout)?,
        idle: seconds("idle-timeout", a.idle_timeout)?,
        body: seconds("body-timeout", a.body_timeout)?,
    })
}

/// The shared context store, connected before the model loads (a wrong URL, an unreachable
/// store or a refused password fails at once).
fn open_store(a: &ServeArgs) -> Result<Option<Arc<SharedStore>>> {
    let Some(url) = &a.context_store else {
        return Ok(None);
    };
    let ca_pem = match &a.context_store_ca {
        Some(p) => Some(
            crate::limits::MAX_FILE_READ_BYTES
                .read_file(p)
                .with_context(|| format!("--context-store-ca {}", p.display()))?,
        ),
        None => None,
    };
    let store = SharedStore::open(SharedConfig {
        url: url.clone(),
        password: a.context_store_password.clone(),
        ca_pem,
        max_bytes: a.context_store_max_bytes,
        lease_ttl: Duration::from_secs_f64(a.context_lease_ttl),
    })?;
    eprintln!(
        "context store: {} (contexts shared with every replica using it)",
        store.url()
    );
    Ok(Some(store))
}

pub fn run(a: ServeArgs) -> Result<()> {
    let timeouts = check_flags(&a)?;
    let store = open_store(&a)?;
    let loaded = LoadedModel::load(&a.model)?;
    let spec = loaded.spec().clone();
    let ctx = loaded.context_for(&a.model, spec.max_context.min(2048))?;
    let parallel = a.parallel as usize;
    let pool_tokens = a.kv_pool_tokens.unwrap_or(parallel * ctx);
    if pool_tokens < KV_BLOCK {
        bail!(
            "--kv-pool-tokens {pool_tokens}: the pool holds at least one block of {KV_BLOCK} positions"
        );
    }
    let running = loaded.start(
        &a.model,
        Job {
            ctx,
            sessions: parallel,
            probe: true,
            batch: crate::footprint::MAX_BATCH.min(ctx),
            // A batched decode step returns a row for every running sequence.
            logit_rows: parallel,
            // A prompt may fill the context.
            prompt: ctx,
            kv_pool: Some(pool_tokens.div_ceil(KV_BLOCK)),
        },
    )?;
    // The offload plan is costed for steps of every slot's sequence (the modes differ most in
    // how they scale with the batch) and kept as the running count varies.
    if let (Some(mode), Some(t)) = (running.cold_mode(), running.predicted_tokens_per_s()) {
        eprintln!(
            "plan: --cold {mode}, costed for decode steps of --parallel {parallel} sequences: predicted {t:.1} tok/s in all; kept for the whole run (not re-planned while fewer sequences run)"
        );
    }
    let model_id = loaded.model_id()?;
    let model_name = a.model_name.clone().unwrap_or_else(|| {
        loaded
            .path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| spec.name.clone())
    });
    if let Some(dir) = &a.kv_dir {
        kv::persist::prepare(dir)
            .with_context(|| format!("--kv-dir {} is not usable", dir.display()))?;
    }
    let shared = Shared::new(running.ledger.clone(), store.is_some()).context("metrics")?;
    let tok = loaded.tokenizer.clone().map(Arc::new);
    let (tx, rx) = std::sync::mpsc::channel();
    let max_prompt_tokens = a.max_prompt_tokens.unwrap_or(ctx);
    let encoder = Arc::new(
        Encoder::new(
            tok.clone(),
            max_prompt_tokens,
            ctx,
            a.tokenize_per_key as usize,
        )
        .context("starting the threads that parse long requests")?,
    );
    let worker_cfg = WorkerConfig {
        parallel,
        ctx,
        max_prompt_tokens,
        shutdown_grace: Duration::from_secs_f64(a.shutdown_grace),
    };
    // The cost models are measured on the engine thread, once the engine is there.
    let kv_cfg = KvConfig {
        compression: a.kv_compression,
        dram_budget: a.kv_dram_mem,
        dir: a.kv_dir.clone(),
        model_id,
        costs: CostModel {
            recompute_s_per_token: 0.0,
            load_s_per_chunk: 0.0,
            load_s_per_byte: 0.0,
            decode_s_per_value: 0.0,
        },
        shared: store.clone(),
    };
    let worker = EngineThread {
        engine: running.engine,
        tok,
        kv: kv_cfg,
        ledger: running.ledger.clone(),
        shared: shared.clone(),
        worker: worker_cfg,
        rx,
    }
    .spawn(|w| eprintln!("warning: {w}"))?;

    let cfg = HttpConfig {
        addr: SocketAddr::new(a.host, a.port),
        api_keys: a.api_key.clone(),
        model_name,
        queue: a.queue,
        limits: Limits {
            max_tokens: a.max_tokens_limit,
            default_max_tokens: a.default_max_tokens.min(a.max_tokens_limit),
        },
        timeouts,
        context_wait: Duration::from_secs_f64(a.context_wait),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let state = AppState {
        tx,
        shared: shared.clone(),
        cfg: Arc::new(cfg.clone()),
        encoder,
        contexts: store,
    };
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(cfg.addr)
            .await
            .with_context(|| format!("cannot listen on {}", cfg.addr))?;
        let addr = listener.local_addr()?;
        // Scripts wait for this line (and read the port from it when --port 0).
        println!("listening on http://{addr}");
        use std::io::Write;
        std::io::stdout().flush().ok();
        if !a.host.is_loopback() && a.api_key.is_empty() {
            eprintln!(
                "warning: listening on {addr} without --api-key: anyone who can reach it can use it"
            );
        }
        serve_http(listener, state, || {
            eprintln!("shutting down: finishing requests, flushing contexts")
        })
        .await
        .context("server error")
    })?;
    shared.shutdown.store(true, Ordering::SeqCst);
    if worker.join().is_err() {
        bail!("the engine thread panicked");
    }
    Ok(())
}
