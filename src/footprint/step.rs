//! The device memory of one forward step (activations, logits, workspace), how a long call is
//! partitioned into steps (HyperGen), and the other per-session buffers the planner budgets:
//! the formulas the engine allocates by and the planner plans with.

use super::{KvType, WorkspaceOp, device_bytes};
use crate::model::{ModelSpec, ModelWeights};
use crate::tensor::{DType, HostTensor};

/// Tokens evaluated per forward step during prefill; bounds scratch memory for long prompts.
pub const MAX_BATCH: usize = 512;

/// How a forward call longer than one step runs, and where a session's KV cache lives
/// (HyperGen's step-aware partitioning, as the plan sizes it for a budget):
/// - up to `group` tokens are one step: every layer once over all of them;
/// - a longer call runs layer by layer: each layer's weights are brought once and run over the
///   call's tokens in row groups of `group`, the hidden states of all of them kept between
///   layers on the device (up to `residual_rows` tokens) or in page-locked host memory — so a
///   streamed model passes over PCIe once per prompt, not once per group;
/// - `kv_host`: keys and values live in host memory and one layer's pass through a device
///   buffer of the context's length (read back, then written out, per layer and step), so the
///   longest context is a matter of host memory.
/// - `cpu_attention` (with `kv_host`): steps of at most [`CPU_ATTENTION_ROWS`] rows (decode)
///   attend on the CPU over the host copy — their queries, keys and values come down, the
///   output goes up — instead of bringing each layer's cache to the device: the same bytes read
///   from DRAM instead of sent over PCIe, and the link left to the weights.
/// - `joins`: a batched step ([`Engine::step_many`](crate::engine::Engine::step_many)) may take a whole prompt beside the other
///   sequences' tokens (serve), so the step buffers one call's rows at the step's size; without
///   it a call in a batched step is one token (decode) and one row is buffered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PrefillLayout {
    pub group: usize,
    pub residual_rows: usize,
    pub kv_host: bool,
    #[serde(default)]
    pub cpu_attention: bool,
    #[serde(default)]
    pub joins: bool,
}

/// Most rows of a step that attend on the CPU ([`PrefillLayout::cpu_attention`]); longer
/// steps (prefill) bring the cache to the device.
pub const CPU_ATTENTION_ROWS: usize = 4;

impl Default for PrefillLayout {
    /// Unbudgeted: steps of [`MAX_BATCH`], hidden states and KV on the device.
    fn default() -> Self {
        PrefillLayout {
            group: MAX_BATCH,
            residual_rows: usize::MAX,
            kv_host: false,
            cpu_attention: false,
            joins: true,
        }
    }
}

impl PrefillLayout {
    /// Whether a call of `tokens` runs layer by layer in row groups.
    pub fn partitions(&self, tokens: usize) -> bool {
        tokens > self.group
    }

    /// Whether a step of `rows` rows attends on the CPU.
    pub fn attends_on_cpu(&self, rows: usize) -> bool {
        self.kv_host && self.cpu_attention && rows <= CPU_ATTENTION_ROWS
    }

    /// Whether the hidden states of a partitioned call of `tokens` stay on the device.
    pub fn residual_on_device(&self, tokens: usize) -> bool {
        tokens <= self.residual_rows
    }
}

/// The prefill step of an engine that holds its whole model (no plan: a whole-GPU or CPU run):
/// the longest call (`prompt` tokens) in one step, up to `cap` and [`crate::footprint::MAX_GROUP`] rows,
/// halved until the step's device memory (`step(rows)`) fits in `room`; [`MAX_BATCH`] (or
/// `cap`, if smaller) where none larger does. Larger steps are larger GEMMs (tensor cores fill
/// with more rows) and fewer launches.
pub fn whole_device_group(
    prompt: usize,
    cap: usize,
    room: u64,
    mut step: impl FnMut(usize) -> u64,
) -> usize {
    let cap = cap.clamp(1, crate::footprint::MAX_GROUP);
    let mut g = prompt.min(cap);
    while g > MAX_BATCH {
        if step(g) <= room {
            return g;
        }
        g /= 2;
    }
    MAX_BATCH.min(cap)
}

/// One matrix a forward step multiplies: its format and shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatmulShape {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
}

/// The matrices a forward step multiplies: the distinct shapes of every layer's (weights in
/// neuron bundles need no workspace and are not listed) and the output matrix.
#[derive(Clone, Debug, PartialEq)]
pub struct MatmulShapes {
    pub layer: Vec<MatmulShape>,
    pub head: MatmulShape,
    /// A mixture-of-experts model's experts on the device: the distinct formats of their
    /// layers (none where no expert is computed on the device from these shapes).
    pub experts: Vec<ExpertsShape>,
}

/// The experts of a mixture-of-experts layer as the device computes them: gate and up format,
/// down format, neurons of one expert.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertsShape {
    pub gate: DType,
    pub down: DType,
    pub width: usize,
}

impl MatmulShape {
    pub fn of(t: &HostTensor) -> Self {
        MatmulShape {
            dtype: t.dtype,
            rows: t.rows,
            cols: t.cols,
        }
    }

    /// The workspace op of multiplying `tokens` rows by this matrix.
    pub fn op(&self, tokens: usize) -> WorkspaceOp {
        WorkspaceOp::Matmul {
            dtype: self.dtype,
            tokens,
            rows: self.rows,
            cols: self.cols,
        }
    }
}

impl MatmulShapes {
    /// The matrices of a model used in its file formats.
    pub fn of_weights(w: &ModelWeights) -> Self {
        let mut layer: Vec<MatmulShape> = Vec::new();
        for l in &w.layers {
            for lin in [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_up, &l.w_down]
                .into_iter()
                .chain(l.w_gate.as_ref())
            {
                let k = MatmulShape::of(&lin.weight);
                if !layer.contains(&k) {
                    layer.push(k);
                }
            }
        }
        // A mixture-of-experts layer's stacks: expert by expert on the device.
        let mut experts = Vec::new();
        for l in w.layers.iter().filter(|l| l.router.is_some()) {
            let e = ExpertsShape {
                gate: l.w_gate.as_ref().unwrap_or(&l.w_up).weight.dtype,
                down: l.w_down.weight.dtype,
                width: l.w_down.weight.cols,
            };
            if !experts.contains(&e) {
                experts.push(e);
            }
        }
        MatmulShapes {
            layer,
            head: MatmulShape::of(w.output.as_ref().unwrap_or(&w.token_embd)),
            experts,
        }
    }
}

/// Queries remembered per probed layer.
pub const PROBE_QUERIES: usize = 16;

/// Layers probed at most (evenly spaced).
pub const PROBE_LAYERS: usize = 4;

/// `(rows, cols)` of the activation buffers of a step of `n` tokens, in the order the engine's
/// step buffers hold them (gate last, for gated FFNs).
pub fn activation_shapes(spec: &ModelSpec, n: usize, joins: bool) -> Vec<(usize, usize)> {
    let mut v = vec![
        (n, spec.d_model),
        (n, spec.d_model),
        (n, spec.q_dim()),
        (n, spec.kv_dim()),
        (n, spec.kv_dim()),
        (n, spec.q_dim()),
        (n, spec.d_model),
        // The FFN's hidden activations; a mixture-of-experts layer's are its router's logits
        // (each expert's hidden rows live only inside its product).
        (n, spec.moe.as_ref().map_or(spec.d_ff, |m| m.router_rows())),
    ];
    if spec.gated_ffn && spec.moe.is_none() {
        v.push((n, spec.d_ff));
    }
    // One call's rows of a batched step ([`Engine::step_many`](crate::engine::Engine::step_many): a decoded token, or a prompt
    // that joins the step): their queries, keys, values and attention output, at the call's
    // own positions and cache. Where prompts join ([`PrefillLayout::joins`]) up to the whole
    // step may be one call; otherwise a call is one token.
    let c = if joins { n } else { 1 };
    v.extend([
        (c, spec.q_dim()),
        (c, spec.kv_dim()),
        (c, spec.kv_dim()),
        (c, spec.q_dim()),
    ]);
    v
}

/// `(rows, cols)` of the logits buffers of `rows` returned rows.
pub fn logit_shapes(spec: &ModelSpec, rows: usize) -> [(usize, usize); 3] {
    [
        (rows, spec.d_model),
        (rows, spec.d_model),
        (rows, spec.vocab_size),
    ]
}

pub fn f32_buffers(shapes: &[(usize, usize)]) -> u64 {
    shapes
        .iter()
        .map(|&(r, c)| device_bytes((r * c * 4) as u64))
        .sum()
}

/// Device memory one forward step holds: the activation buffers, the logits buffers and the
/// backend's workspace.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct StepMemory {
    pub activations: u64,
    pub logits: u64,
    pub workspace: u64,
}

impl StepMemory {
    pub fn total(&self) -> u64 {
        self.activations + self.logits + self.workspace
    }
}

/// The device memory of a step of `n` tokens returning `logit_rows` rows of logits, with
/// `workspace` the backend's per-op formula ([`Backend::workspace_bytes`](crate::backend::Backend::workspace_bytes)): the one formula the
/// engine allocates by and the planner plans with.
pub fn step_memory(
    spec: &ModelSpec,
    n: usize,
    logit_rows: usize,
    joins: bool,
    kv: KvType,
    matmuls: &MatmulShapes,
    workspace: impl Fn(&WorkspaceOp) -> u64,
) -> StepMemory {
    let mut ws = workspace(&WorkspaceOp::Embed { tokens: n })
        .max(workspace(&WorkspaceOp::Listed { neurons: spec.d_ff }));
    for m in &matmuls.layer {
        ws = ws.max(workspace(&m.op(n)));
    }
    for e in &matmuls.experts {
        ws = ws.max(workspace(&WorkspaceOp::Experts {
            tokens: n,
            d_model: spec.d_model,
            width: e.width,
            gate: e.gate,
            down: e.down,
        }));
    }
    ws = ws.max(workspace(&WorkspaceOp::Attention {
        tokens: n,
        n_heads: spec.n_heads,
        head_dim: spec.head_dim,
        kv,
    }));
    if logit_rows > 0 {
        ws = ws.max(workspace(&matmuls.head.op(logit_rows)));
    }
    StepMemory {
        activations: f32_buffers(&activation_shapes(spec, n, joins)),
        logits: if logit_rows > 0 {
            f32_buffers(&logit_shapes(spec, logit_rows))
        } else {
            0
        },
        workspace: ws,
    }
}

/// Device bytes of a session's query probe ([`Engine::enable_probe`](crate::engine::Engine::enable_probe)).
pub fn probe_bytes(spec: &ModelSpec) -> u64 {
    let layers = PROBE_LAYERS.min(spec.n_layers) as u64;
    let row = (spec.q_dim() * 4) as u64;
    // The ring, and the row a recorded step stages its query in.
    layers * (device_bytes(PROBE_QUERIES as u64 * row) + device_bytes(row))
}

/// Most rows one prefill step takes: only where every layer stays on the device beside the
/// larger step's buffers (else the budget's step, at most [`crate::footprint::MAX_BATCH`]).
pub const MAX_GROUP: usize = 4096;

/// Groups at least this long make a partitioned prefill's products efficient enough that the
/// planner takes a smaller group before it moves the hidden states or the KV cache to the host.
pub const GOOD_GROUP: usize = 64;
