//! Prometheus metrics of the server (text format at `GET /metrics`).

use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

use crate::footprint::Ledger;
use crate::kv::{KvCounters, SharedHealth, WriteBackCounters};

pub struct Metrics {
    registry: Registry,
    pub ttft: Histogram,
    pub inter_token: Histogram,
    pub swap_in_seconds: Histogram,
    /// Sequences evaluated together per decode step (continuous batching).
    pub batch_size: Histogram,
    pub generated_tokens: IntCounter,
    pub prompt_tokens: IntCounter,
    pub prefix_reused: IntCounter,
    pub requests: IntCounterVec,
    pub queue_depth: IntGauge,
    pub active: IntGauge,
    pub contexts: IntGauge,
    pub kv_chunks: IntGaugeVec,
    pub kv_dram_bytes: IntGauge,
    /// Blocks of the paged KV pool, by state (`free`, `used`).
    pub kv_pool_blocks: IntGaugeVec,
    /// Prompts evaluated inside a batched step beside other sequences (no pass of their own).
    pub prompts_joined: IntCounter,
    /// Idle sessions whose blocks were taken for others when the pool ran short.
    pub pool_evictions: IntCounter,
    /// Decode steps recorded as CUDA graphs and replayed (`--cuda-graphs`), by event.
    pub decode_steps_recorded: IntGaugeVec,
    kv_events: IntGaugeVec,
    ledger: IntGaugeVec,
    /// The shared context store (`--context-store`): 1 answering, 0 degraded.
    store_up: IntGauge,
    store_pending: IntGauge,
    store_bytes: IntGauge,
    store_events: IntGaugeVec,
}

fn latency_buckets() -> Vec<f64> {
    vec![
        0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    ]
}

impl Metrics {
    pub fn new() -> Result<Self, prometheus::Error> {
        let registry = Registry::new_custom(Some("gpu_offload".into()), None)?;
        let hist = |name: &str, help: &str| {
            Histogram::with_opts(HistogramOpts::new(name, help).buckets(latency_buckets()))
        };
        let m = Metrics {
            ttft: hist(
                "time_to_first_token_seconds",
                "Time from request to first token",
            )?,
            inter_token: hist(
                "inter_token_latency_seconds",
                "Time between generated tokens",
            )?,
            swap_in_seconds: hist(
                "context_swap_in_seconds",
                "Time to bring a context onto the device",
            )?,
            batch_size: Histogram::with_opts(
                HistogramOpts::new(
                    "decode_batch_size",
                    "Sequences evaluated in one decode step (one pass of the weights)",
                )
                .buckets(vec![1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0]),
            )?,
            generated_tokens: IntCounter::new("generated_tokens_total", "Tokens generated")?,
            prompt_tokens: IntCounter::new("prompt_tokens_total", "Prompt tokens received")?,
            prefix_reused: IntCounter::new(
                "prefix_cache_hit_tokens_total",
                "Prompt tokens served from a cached prefix instead of evaluated",
            )?,
            requests: IntCounterVec::new(
                Opts::new("requests_total", "Requests by route and status"),
                &["route", "status"],
            )?,
            queue_depth: IntGauge::new("queue_depth", "Requests waiting for a sequence slot")?,
            active: IntGauge::new("active_sequences", "Sequences being generated")?,
            contexts: IntGauge::new("contexts", "Persistent contexts")?,
            kv_chunks: IntGaugeVec::new(
                Opts::new("kv_chunks", "KV chunks of contexts per tier"),
                &["tier"],
            )?,
            kv_dram_bytes: IntGauge::new("kv_dram_bytes", "Bytes of compressed KV chunks in DRAM")?,
            kv_pool_blocks: IntGaugeVec::new(
                Opts::new(
                    "kv_pool_blocks",
                    "Blocks of 16 positions of the paged KV pool, free and used",
                ),
                &["state"],
            )?,
            prompts_joined: IntCounter::new(
                "prompts_joined_steps_total",
                "Prompts evaluated in a batched step beside other sequences, not in a pass of their own",
            )?,
            pool_evictions: IntCounter::new(
                "kv_pool_evictions_total",
                "Idle sessions (stateless prefixes, contexts) that left the KV pool for others",
            )?,
            decode_steps_recorded: IntGaugeVec::new(
                Opts::new(
                    "decode_steps_recorded_total",
                    "Decode steps recorded as CUDA graphs (--cuda-graphs), and replayed",
                ),
                &["event"],
            )?,
            kv_events: IntGaugeVec::new(
                Opts::new("kv_events_total", "Context swap events and chunk sources"),
                &["event"],
            )?,
            ledger: IntGaugeVec::new(
                Opts::new(
                    "ledger_bytes",
                    "Bytes held per memory tier (in use and peak)",
                ),
                &["tier", "kind"],
            )?,
            store_up: IntGauge::new(
                "context_store_up",
                "1 while the shared context store answers, 0 while it is degraded (unreachable)",
            )?,
            store_pending: IntGauge::new(
                "context_store_pending_writebacks",
                "Completed calls on contexts not yet written to the shared store",
            )?,
            store_bytes: IntGauge::new(
                "context_store_chunk_bytes",
                "Chunk bytes in the shared context store after this replica's last write",
            )?,
            store_events: IntGaugeVec::new(
                Opts::new(
                    "context_store_events_total",
                    "Shared context store: write-backs committed, refused (conflict), retried; chunks put and evicted; leases lost",
                ),
                &["event"],
            )?,
            registry,
        };
        let r = &m.registry;
        r.register(Box::new(m.ttft.clone()))?;
        r.register(Box::new(m.inter_token.clone()))?;
        r.register(Box::new(m.batch_size.clone()))?;
        r.register(Box::new(m.swap_in_seconds.clone()))?;
        r.register(Box::new(m.generated_tokens.clone()))?;
        r.register(Box::new(m.prompt_tokens.clone()))?;
        r.register(Box::new(m.prefix_reused.clone()))?;
        r.register(Box::new(m.requests.clone()))?;
        r.register(Box::new(m.queue_depth.clone()))?;
        r.register(Box::new(m.active.clone()))?;
        r.register(Box::new(m.contexts.clone()))?;
        r.register(Box::new(m.kv_chunks.clone()))?;
        r.register(Box::new(m.kv_dram_bytes.clone()))?;
        r.register(Box::new(m.kv_pool_blocks.clone()))?;
        r.register(Box::new(m.pool_evictions.clone()))?;
        r.register(Box::new(m.prompts_joined.clone()))?;
        r.register(Box::new(m.decode_steps_recorded.clone()))?;
        r.register(Box::new(m.kv_events.clone()))?;
        r.register(Box::new(m.ledger.clone()))?;
        Ok(m)
    }

    /// Register the shared store's figures (only a server with a store shows them).
    pub fn with_store(self) -> Result<Self, prometheus::Error> {
        self.registry.register(Box::new(self.store_up.clone()))?;
        self.registry
            .register(Box::new(self.store_pending.clone()))?;
        self.registry
            .register(Box::new(self.store_events.clone()))?;
        self.registry.register(Box::new(self.store_bytes.clone()))?;
        Ok(self)
    }

    pub fn set_store(&self, h: &SharedHealth, w: &WriteBackCounters) {
        self.store_up.set((h.state == "ok") as i64);
        self.store_pending.set(h.pending_writebacks as i64);
        self.store_bytes.set(h.chunk_bytes.unwrap_or(0) as i64);
        let set = |name: &str, v: u64| self.store_events.with_label_values(&[name]).set(v as i64);
        set("committed", w.committed);
        set("conflict", w.conflicts);
        set("retry", w.retries);
        set("chunk_put", w.chunks_put);
        set("chunk_evicted", w.chunks_evicted);
        set("lease_lost", w.leases_lost);
    }

    pub fn set_kv_counters(&self, k: &KvCounters) {
        let set = |name: &str, v: u64| self.kv_events.with_label_values(&[name]).set(v as i64);
        set("swap_out", k.swap_outs);
        set("swap_in", k.swap_ins);
        set("chunks_written", k.chunks_written);
        set("chunk_hit_dram", k.chunks_from_dram);
        set("chunk_hit_disk", k.chunks_from_disk);
        set("chunk_hit_store", k.chunks_from_store);
        set("chunk_recomputed", k.chunks_recomputed);
        set("chunk_corrupt", k.chunks_corrupt);
        set("dram_eviction", k.dram_evictions);
    }

    /// The text exposition, with the ledger read now.
    pub fn render(&self, ledger: Option<&Ledger>, generated_per_s: f64) -> String {
        if let Some(l) = ledger {
            let s = l.snapshot();
            for (tier, used, peak) in [
                ("hbm", s.hbm_used, s.hbm_peak),
                ("pinned_dram", s.pinned_used, s.pinned_peak),
                ("dram", s.dram_used, s.dram_peak),
            ] {
                self.ledger
                    .with_label_values(&[tier, "used"])
                    .set(used as i64);
                self.ledger
                    .with_label_values(&[tier, "peak"])
                    .set(peak as i64);
            }
        }
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .ok();
        let mut text = String::from_utf8_lossy(&out).into_owned();
        text.push_str(&format!(
            "# HELP gpu_offload_tokens_per_second Generated tokens per second over the last scrape interval\n# TYPE gpu_offload_tokens_per_second gauge\ngpu_offload_tokens_per_second {generated_per_s}\n"
        ));
        text
    }
}
