//! A job: what one use of an engine needs the device to hold (contexts, sessions, step and
//! prompt sizes, a KV pool).

/// What a job needs the device to hold.
#[derive(Clone, Copy, Debug)]
pub struct Job {
    /// KV cache positions of each session.
    pub ctx: usize,
    /// Sessions holding a KV cache at once.
    pub sessions: usize,
    /// Whether sessions keep a query probe (contexts).
    pub probe: bool,
    /// Most tokens one step evaluates.
    pub batch: usize,
    /// Logit rows one step returns at most.
    pub logit_rows: usize,
    /// Most tokens one forward call evaluates (the longest prompt).
    pub prompt: usize,
    /// Blocks of a paged KV pool the sessions share, in place of a cache of `ctx` each.
    pub kv_pool: Option<usize>,
}

impl Job {
    /// One session of `ctx` positions.
    pub fn single(ctx: usize, batch: usize, logit_rows: usize) -> Self {
        Job {
            ctx,
            sessions: 1,
            probe: false,
            batch,
            logit_rows,
            prompt: batch,
            kv_pool: None,
        }
    }

    /// The same job for prompts of up to `tokens` (a call longer than a step is partitioned).
    pub fn with_prompt(self, tokens: usize) -> Self {
        Job {
            prompt: tokens.max(1),
            ..self
        }
    }
}
