//! `gpu-offload serve`: an OpenAI-compatible HTTP server (tokio + axum) in front of one engine
//! thread ([`worker`]) that owns the device, the sequences and the persistent contexts.
//!
//! The request bodies and errors are [`api`], the routes `http` with the answer bodies in
//! `answer`, the connections and their deadlines [`conn`], prompts encoded off the engine
//! thread [`tokenize`], what the two sides send each other [`messages`], the gauges and counters
//! [`metrics`], and starting both sides [`server`]. The service knows HTTP and the engine's
//! interface, never the kernels, and never the command line.

mod answer;
pub mod api;
pub mod conn;
mod http;
pub mod messages;
pub mod metrics;
pub mod server;
pub mod tokenize;
pub mod worker;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::{Arc, Mutex};
use std::time::Instant;

pub use http::router;
use messages::Request;
use metrics::Metrics;

use crate::footprint::Ledger;
use crate::kv::SharedStore;

/// What the HTTP side and the engine thread share.
pub struct Shared {
    pub metrics: Metrics,
    /// Requests sent to the engine thread and not yet admitted.
    pub waiting: AtomicUsize,
    pub shutdown: AtomicBool,
    pub ledger: Option<Arc<Ledger>>,
    last_scrape: Mutex<(Instant, u64)>,
}

impl Shared {
    /// `store`: the server has a shared context store (its figures are shown).
    pub fn new(ledger: Option<Arc<Ledger>>, store: bool) -> Result<Arc<Self>, prometheus::Error> {
        let metrics = Metrics::new()?;
        Ok(Arc::new(Shared {
            metrics: if store {
                metrics.with_store()?
            } else {
                metrics
            },
            waiting: AtomicUsize::new(0),
            shutdown: AtomicBool::new(false),
            ledger,
            last_scrape: Mutex::new((Instant::now(), 0)),
        }))
    }

    fn tokens_per_s(&self) -> f64 {
        let now = Instant::now();
        let count = self.metrics.generated_tokens.get();
        let mut g = self.last_scrape.lock().unwrap_or_else(|e| e.into_inner());
        let dt = (now - g.0).as_secs_f64();
        let rate = if dt > 0.0 {
            (count - g.1) as f64 / dt
        } else {
            0.0
        };
        *g = (now, count);
        rate
    }
}

/// Settings of the HTTP side.
#[derive(Clone, Debug)]
pub struct HttpConfig {
    pub addr: SocketAddr,
    /// Accepted API keys (empty: no authentication).
    pub api_keys: Vec<String>,
    pub model_name: String,
    /// Requests waiting at most before 429.
    pub queue: usize,
    pub limits: api::Limits,
    pub timeouts: conn::Timeouts,
    /// How long a call on a context another call holds waits for it (shared store) before 409.
    pub context_wait: std::time::Duration,
}

/// The owner id of an API key (contexts are stored with this, never the key).
pub fn owner_of(key: &str) -> String {
    format!("{:016x}", xxhash_rust::xxh3::xxh3_64(key.as_bytes()))
}

/// The state every route sees.
#[derive(Clone)]
pub struct AppState {
    pub tx: std::sync::mpsc::Sender<Request>,
    pub shared: Arc<Shared>,
    pub cfg: Arc<HttpConfig>,
    /// Prompts sized and encoded on this side, off the engine thread.
    pub encoder: Arc<tokenize::Encoder>,
    /// The context store replicas share (`--context-store`), if any.
    pub contexts: Option<Arc<SharedStore>>,
}
