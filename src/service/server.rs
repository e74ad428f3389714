//! Starting the server's two sides: the engine thread (the contexts' cost models measured on its
//! engine, the contexts opened, the worker run until the request channel closes) and the HTTP
//! side (the routes served until a shutdown signal, which asks the engine thread to finish).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::Receiver;
use std::thread::JoinHandle;

use anyhow::{Context, Result};

use super::messages::Request;
use super::worker::{Worker, WorkerConfig};
use super::{AppState, Shared, router};
use crate::footprint::Ledger;
use crate::kv::{self, KvConfig, KvManager};
use crate::model::Tokenizer;
use crate::runtime::{AnyEngine, with_engine};

/// What the engine thread starts from.
pub struct EngineThread {
    pub engine: AnyEngine,
    pub tok: Option<Arc<Tokenizer>>,
    /// The contexts' settings; their cost models are measured on the engine thread, once the
    /// engine is there.
    pub kv: KvConfig,
    pub ledger: Option<Arc<Ledger>>,
    pub shared: Arc<Shared>,
    pub worker: WorkerConfig,
    /// The requests of the HTTP side.
    pub rx: Receiver<Request>,
}

impl EngineThread {
    /// Start the engine thread, passing each warning about the stored contexts to `warn`; returns
    /// once its worker runs, or with why it could not start.
    pub fn spawn(self, warn: fn(&str)) -> Result<JoinHandle<()>> {
        let EngineThread {
            engine,
            tok,
            kv: mut kv_cfg,
            ledger,
            shared: shared_w,
            worker: worker_cfg,
            rx,
        } = self;
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<()>>();
        let worker = std::thread::Builder::new()
            .name("engine".into())
            .spawn(move || {
                with_engine!(engine, e => {
                    let start = || -> Result<_> {
                        kv_cfg.costs = kv::measure_costs(&e, kv_cfg.dir.as_deref(), kv_cfg.shared.as_deref())?;
                        tracing::info!("KV cost model: {:?}", kv_cfg.costs);
                        let (kv, warnings) = KvManager::open(kv_cfg, ledger)?;
                        for w in warnings {
                            tracing::warn!("{w}");
                            warn(&w);
                        }
                        Ok(kv)
                    };
                    match start().and_then(|kv| Ok(Worker::new(e, tok, kv, shared_w, worker_cfg)?)) {
                        Ok(w) => {
                            ready_tx.send(Ok(())).ok();
                            w.run(rx);
                        }
                        Err(err) => {
                            ready_tx.send(Err(err)).ok();
                        }
                    }
                })
            })
            .context("cannot start the engine thread")?;
        ready_rx
            .recv()
            .context("the engine thread stopped while starting")??;
        Ok(worker)
    }
}

/// Serve `state`'s routes on `listener` until a shutdown signal (Ctrl-C, SIGTERM): then
/// `on_signal` runs and the engine thread is asked to finish the running calls.
pub async fn serve_http(
    listener: tokio::net::TcpListener,
    state: AppState,
    on_signal: fn(),
) -> std::io::Result<()> {
    let sd = state.shared.clone();
    let timeouts = state.cfg.timeouts;
    let app = router(state);
    super::conn::serve(listener, app, timeouts, async move {
        shutdown_signal().await;
        on_signal();
        sd.shutdown.store(true, Ordering::SeqCst);
    })
    .await
}

async fn shutdown_signal() {
    let ctrl_c = async {
        tokio::signal::ctrl_c().await.ok();
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
