//! Opening a model: find it, open it as its file (for the CPU or a whole GPU) or its offload
//! store (for a budgeted device), and what the opened model answers before it is placed — its
//! identity, tokenizer, the prompt flags as token ids, the context a job gets, and the
//! thresholds or predictors `--sparsity` asks for.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};

use super::device::{emulated, gpu_budget, resolve_device};
use super::{Device, ModelArgs, PromptArgs};
use crate::engine::NeuronPredictor;
use crate::model::{ChatMessage, Model, ModelSpec, ModelWeights, Tokenizer, default_model_path};
use crate::runtime::store::open_store_for;
use crate::sparsity::{Predictors, SparsityProfile};
use crate::store::Store;

/// The predictor `--sparsity predicted` gives every engine.
pub(super) type SharedPredictor = Arc<dyn NeuronPredictor>;

/// `--sparsity-target` where none is given for a SwiGLU model: SmolLM2-135M on held-out text
/// stays within 1% of dense perplexity up to 15% with oracle masks (+0.26%; 20%: +1.3%).
pub const DEFAULT_SPARSITY_TARGET: f64 = 0.15;

/// Where an opened model's weights are.
pub(super) enum Weights {
    /// The model file itself, for the CPU engine.
    Dense(Box<ModelWeights>),
    /// The offload store, for budgeted devices.
    Stored(Arc<Store>),
}

/// An opened model, not yet placed on a device.
pub struct LoadedModel {
    pub spec: ModelSpec,
    pub tokenizer: Option<Tokenizer>,
    pub path: PathBuf,
    pub(super) weights: Weights,
    pub(super) device: Device,
    pub(super) t0: Instant,
}

impl LoadedModel {
    pub fn load(args: &ModelArgs) -> Result<Self> {
        let t0 = Instant::now();
        let path = match &args.model {
            Some(p) => p.clone(),
            None => {
                let p = default_model_path();
                if !p.exists() {
                    bail!(
                        "no model given and the default model is not at {}: run scripts/fetch-models.sh or pass --model",
                        p.display()
                    );
                }
                p
            }
        };
        let device = resolve_device(args, &path)?;
        let budgeted = gpu_budget(args, emulated(args)?.as_ref())?.is_some();
        let offloaded = device == Device::Sim || (device == Device::Cuda && budgeted);
        let (spec, tokenizer, weights) = match offloaded {
            true => {
                let store = open_store_for(&path)?;
                let tok = store.tokenizer()?;
                (
                    store.manifest.spec.clone(),
                    tok,
                    Weights::Stored(Arc::new(store)),
                )
            }
            _ => {
                if Store::is_store(&path) {
                    bail!(
                        "{} is an offload store: run it with --gpu-mem (or --device sim)",
                        path.display()
                    );
                }
                let model = Model::load(&path)
                    .with_context(|| format!("cannot load model {}", path.display()))?;
                tracing::info!(
                    "loaded {} ({} layers, d_model {}, {} MiB of weights)",
                    model.spec.name,
                    model.spec.n_layers,
                    model.spec.d_model,
                    model.weights.total_bytes() >> 20
                );
                (
                    model.spec,
                    model.tokenizer,
                    Weights::Dense(Box::new(model.weights)),
                )
            }
        };
        Ok(LoadedModel {
            spec,
            tokenizer,
            path,
            weights,
            device,
            t0,
        })
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// Identity of the model's weights: the store's id, or a hash of the shape, the file
    /// sizes and the first and last 64 KiB of each file (cheap, and changes with any re-export).
    pub fn model_id(&self) -> Result<String> {
        use std::io::{Read, Seek, SeekFrom};
        if let Weights::Stored(store) = &self.weights {
            return Ok(store.manifest.model_id.clone());
        }
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        h.update(serde_json::to_string(&self.spec)?.as_bytes());
        let mut files: Vec<PathBuf> = if self.path.is_dir() {
            std::fs::read_dir(&self.path)
                .with_context(|| format!("cannot list {}", self.path.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.is_file())
                .collect()
        } else {
            vec![self.path.clone()]
        };
        files.sort();
        for f in files {
            let mut file =
                std::fs::File::open(&f).with_context(|| format!("cannot open {}", f.display()))?;
            let len = file.metadata()?.len();
            h.update(&len.to_le_bytes());
            let mut buf = vec![0u8; 65536.min(len as usize)];
            file.read_exact(&mut buf)?;
            h.update(&buf);
            file.seek(SeekFrom::End(-(buf.len() as i64)))?;
            file.read_exact(&mut buf)?;
            h.update(&buf);
        }
        Ok(format!("{:016x}", h.digest()))
    }

    /// What `--sparsity` asks for: per layer, the FFN thresholds (empty when off) — zeros for a
    /// ReLU-family model without --sparsity-target (its exact natural mask), else read from the
    /// profile in the model's store at the target — and, for `predicted`, the profile's
    /// predictors.
    pub fn sparsity(&self, args: &ModelArgs) -> Result<(Vec<f32>, Option<SharedPredictor>)> {
        use super::SparsityMode;
        if args.sparsity == SparsityMode::Off {
            return Ok((Vec::new(), None));
        }
        // A MoE model's sparsity is its routing: no neuron masks (and no store to convert).
        super::refuse_experts(&self.spec, "`--sparsity`")?;
        let relu = matches!(self.spec.activation, crate::model::Activation::Relu);
        if args.sparsity == SparsityMode::Oracle && relu && args.sparsity_target.is_none() {
            return Ok((vec![0.0; self.spec.n_layers], None));
        }
        let name = self.path.display().to_string();
        let profile = match &self.weights {
            Weights::Stored(store) => {
                SparsityProfile::load(store.dir(), &store.manifest.model_id, &name)?
            }
            Weights::Dense(_) => {
                let store = super::store::open_store_for(&self.path)?;
                SparsityProfile::load(store.dir(), &store.manifest.model_id, &name)?
            }
        };
        if args.sparsity == SparsityMode::Predicted {
            let trained = profile.predictor_target_of(&name)?;
            if let Some(t) = args.sparsity_target
                && (t - trained).abs() > 1e-9
            {
                bail!(
                    "--sparsity-target {t}: the predictors of {name} were trained for {trained}; run `gpu-offload profile -m {name} --predictor-target {t}`"
                );
            }
            tracing::info!(
                "FFN sparsity {:.0}% (predicted): {} predictors",
                trained * 100.0,
                profile.predictors.len()
            );
            let p: Arc<dyn NeuronPredictor> = Arc::new(Predictors(profile.predictors));
            return Ok((Vec::new(), Some(p)));
        }
        let target = args.sparsity_target.unwrap_or(DEFAULT_SPARSITY_TARGET);
        let t = profile.thresholds_for(target)?;
        tracing::info!(
            "FFN sparsity {:.0}% (oracle): thresholds {:.4}…{:.4}",
            target * 100.0,
            t.iter().copied().fold(f32::INFINITY, f32::min),
            t.iter().copied().fold(0.0, f32::max)
        );
        Ok((t, None))
    }

    pub fn tokenizer(&self) -> Result<&Tokenizer> {
        self.tokenizer.as_ref().with_context(|| {
            format!(
                "{} has no tokenizer: pass token ids with --tokens",
                self.path.display()
            )
        })
    }

    /// Token ids for the prompt flags. `chat` wraps the text as one user message (after an
    /// optional system message) with the model's chat template.
    pub fn prompt_ids(&self, p: &PromptArgs, chat: Option<Option<&str>>) -> Result<Vec<u32>> {
        if let Some(ids) = &p.tokens {
            if chat.is_some() {
                bail!("--chat needs a text prompt, not --tokens");
            }
            return Ok(ids.clone());
        }
        let text = match (&p.prompt, &p.prompt_file) {
            (Some(t), _) => t.clone(),
            (None, Some(f)) => read_prompt_file(f)?,
            (None, None) => bail!("give a prompt with --prompt, --prompt-file or --tokens"),
        };
        let tok = self.tokenizer()?;
        let text = match chat {
            None => text,
            Some(system) => {
                let mut messages = Vec::new();
                if let Some(s) = system {
                    messages.push(ChatMessage {
                        role: "system".into(),
                        content: s.to_string(),
                    });
                }
                messages.push(ChatMessage {
                    role: "user".into(),
                    content: text,
                });
                tok.apply_chat_template(&messages, true)?
            }
        };
        // Chat templates already contain the BOS text when the model wants one.
        let add_special = chat.is_none();
        Ok(tok.encode(&text, add_special, true)?)
    }

    /// The context size for a job that needs `needed` positions: `--ctx-size` when given
    /// (which must hold them), else exactly what is needed, never beyond the model's maximum.
    pub fn context_for(&self, args: &ModelArgs, needed: usize) -> Result<usize> {
        let max = self.spec.max_context;
        let ctx = match args.ctx_size {
            Some(c) => {
                let c = c as usize;
                if c > max {
                    bail!("--ctx-size {c} exceeds the model's maximum context of {max} tokens");
                }
                c
            }
            None => needed.min(max),
        };
        Ok(ctx.max(1))
    }
}

/// A prompt file's text, read no further than `max_file_read_bytes` (so `/dev/zero` or a huge
/// file is refused, not read until memory runs out).
pub fn read_prompt_file(path: &Path) -> Result<String> {
    let bytes = crate::limits::MAX_FILE_READ_BYTES
        .read_file(path)
        .with_context(|| format!("cannot read prompt file {}", path.display()))?;
    String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "prompt file {} is not UTF-8 text (invalid byte at offset {})",
            path.display(),
            e.utf8_error().valid_up_to()
        )
    })
}
