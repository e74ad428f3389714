//! Shared by the commands: find and load the model, place it on a backend, turn prompt flags
//! into token ids.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};

use super::{ModelArgs, PromptArgs};
use crate::backend::cpu::{CpuBackend, kernels};
use crate::engine::{DecodeTraffic, Engine};
use crate::model::{ChatMessage, Model, ModelSpec, Tokenizer, default_model_path};

pub struct LoadedModel {
    pub engine: Engine<CpuBackend>,
    pub tokenizer: Option<Tokenizer>,
    pub path: PathBuf,
    pub load_s: f64,
    pub traffic: DecodeTraffic,
}

impl LoadedModel {
    pub fn load(args: &ModelArgs) -> Result<Self> {
        let t0 = Instant::now();
        let kernels = match &args.cpu_kernels {
            None => kernels::best(),
            Some(name) => kernels::by_name(name).with_context(|| {
                let have: Vec<&str> = kernels::available().iter().map(|k| k.name).collect();
                format!(
                    "--cpu-kernels {name}: not available on this CPU (available: {})",
                    have.join(", ")
                )
            })?,
        };
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
        let model =
            Model::load(&path).with_context(|| format!("cannot load model {}", path.display()))?;
        tracing::info!(
            "loaded {} ({} layers, d_model {}, {} MiB of weights)",
            model.spec.name,
            model.spec.n_layers,
            model.spec.d_model,
            model.weights.total_bytes() >> 20
        );
        let backend = CpuBackend::with_kernels(args.threads.map_or(0, usize::from), kernels)?;
        let engine = Engine::new(backend, model.spec.clone(), &model.weights)?;
        Ok(LoadedModel {
            traffic: DecodeTraffic::of(&model.spec, &model.weights),
            engine,
            tokenizer: model.tokenizer,
            path,
            load_s: t0.elapsed().as_secs_f64(),
        })
    }

    pub fn spec(&self) -> &ModelSpec {
        self.engine.spec()
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
            (None, Some(f)) => std::fs::read_to_string(f)
                .with_context(|| format!("cannot read prompt file {}", f.display()))?,
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
        let max = self.spec().max_context;
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
