//! Hugging Face model directory → [`Model`]: `config.json`, `*.safetensors` (one file or an
//! index), `tokenizer.json`. Weights are borrowed from memory maps.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use super::config::parse_config;
use super::experts;
use super::load_gguf::as_f32;
use super::spec::Arch;
use super::tokenizer::Tokenizer;
use super::{LayerWeights, Linear, Model, ModelError, ModelWeights, NormWeights};
use crate::tensor::{Bytes, DType, HostTensor};

/// Where one tensor lives: which mapped file, which byte range, dtype and shape.
struct Entry {
    file: usize,
    start: usize,
    end: usize,
    dtype: Dtype,
    shape: Vec<usize>,
}

/// All tensors of a checkpoint, over one or more mapped safetensors files.
struct Checkpoint {
    files: Vec<(PathBuf, Arc<Mmap>)>,
    entries: HashMap<String, Entry>,
    dir: PathBuf,
}

impl Checkpoint {
    fn open(dir: &Path) -> Result<Self, ModelError> {
        let index = dir.join("model.safetensors.index.json");
        let file_names: Vec<String> = if index.exists() {
            let text = super::read_whole_string(&index)?;
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| ModelError::Format {
                    path: index.clone(),
                    msg: format!("not valid JSON: {e}"),
                })?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| ModelError::Format {
                    path: index.clone(),
                    msg: "`weight_map` is missing".into(),
                })?;
            let mut names: Vec<String> = map
                .values()
                .filter_map(|f| f.as_str().map(str::to_string))
                .collect();
            names.sort();
            names.dedup();
            names
        } else if dir.join("model.safetensors").exists() {
            vec!["model.safetensors".into()]
        } else {
            return Err(ModelError::Format {
                path: dir.to_path_buf(),
                msg: "no model.safetensors or model.safetensors.index.json in this directory"
                    .into(),
            });
        };

        let mut files = Vec::new();
        let mut entries = HashMap::new();
        for name in file_names {
            if name.contains('/') || name.contains("..") {
                return Err(ModelError::Format {
                    path: index.clone(),
                    msg: format!("weight file `{name}` is not a plain file name"),
                });
            }
            let path = dir.join(&name);
            let f = File::open(&path).map_err(|e| ModelError::io(&path, e))?;
            // SAFETY: read-only map kept alive by the Arc; see GgufFile::open.
            let map = unsafe { Mmap::map(&f) }.map_err(|e| ModelError::io(&path, e))?;
            let (header_len, meta) =
                SafeTensors::read_metadata(&map).map_err(|e| ModelError::Format {
                    path: path.clone(),
                    msg: format!("not a valid safetensors file: {e}"),
                })?;
            let data_start = header_len + 8;
            let file_idx = files.len();
            let infos = meta.tensors();
            let count = entries.len() as u64 + infos.len() as u64;
            if !crate::limits::MAX_TENSORS.admits(count) {
                return Err(ModelError::Format {
                    path: path.clone(),
                    msg: crate::limits::MAX_TENSORS.refuse("the checkpoint's tensor count", count),
                });
            }
            for (tname, info) in infos {
                let (s, e) = info.data_offsets;
                let (start, end) = (data_start + s, data_start + e);
                if end > map.len() || start > end {
                    return Err(ModelError::Truncated {
                        path: path.clone(),
                        msg: format!("tensor `{tname}` lies beyond the end of the file"),
                    });
                }
                entries.insert(
                    tname.clone(),
                    Entry {
                        file: file_idx,
                        start,
                        end,
                        dtype: info.dtype,
                        shape: info.shape.clone(),
                    },
                );
            }
            files.push((path, Arc::new(map)));
        }
        Ok(Checkpoint {
            files,
            entries,
            dir: dir.to_path_buf(),
        })
    }

    fn has(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// The first of `names` that exists, as a host tensor in its stored format.
    fn load_any(&self, names: &[String]) -> Result<HostTensor, ModelError> {
        let name = names
            .iter()
            .find(|n| self.has(n))
            .ok_or_else(|| ModelError::MissingTensor {
                path: self.dir.clone(),
                name: names.join(" or "),
            })?;
        self.load(name)
    }

    fn load(&self, name: &str) -> Result<HostTensor, ModelError> {
        let e = self
            .entries
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor {
                path: self.dir.clone(),
                name: name.to_string(),
            })?;
        let (path, map) = &self.files[e.file];
        let dtype = match e.dtype {
            Dtype::F32 => DType::F32,
            Dtype::F16 => DType::F16,
            Dtype::BF16 => DType::BF16,
            other => {
                return Err(ModelError::Unsupported {
                    path: path.clone(),
                    msg: format!("tensor `{name}` has dtype {other:?} (supported: F32, F16, BF16)"),
                });
            }
        };
        let (rows, cols) = match e.shape.as_slice() {
            [n] => (1, *n),
            [r, c] => (*r, *c),
            other => {
                return Err(ModelError::Format {
                    path: path.clone(),
                    msg: format!("tensor `{name}` has shape {other:?}; expected 1 or 2 dimensions"),
                });
            }
        };
        Ok(HostTensor {
            name: name.to_string(),
            rows,
            cols,
            dtype,
            data: Bytes::mapped(map.clone(), e.start..e.end),
        })
    }
}

/// A mixture-of-experts layer's router and its experts' gate, up and down as the FFN's
/// matrices ([`super::experts`]), from the per-expert tensors transformers writes; a shared
/// expert (Qwen2-MoE) split into `moe.shared` more experts after them, its gate the router's
/// last row.
fn expert_ffn(
    ckpt: &Checkpoint,
    model_type: &str,
    layer: &str,
    moe: &crate::model::spec::MoeSpec,
) -> Result<(HostTensor, [Linear; 3]), ModelError> {
    let (block, names) = match model_type {
        "mixtral" => ("block_sparse_moe", ["w1", "w3", "w2"]),
        _ => ("mlp", ["gate_proj", "up_proj", "down_proj"]),
    };
    let router = as_f32(ckpt.load(&format!("{layer}.{block}.gate.weight"))?);
    let mut parts = [0, 1, 2].map(|_| Vec::new());
    for (which, part) in parts.iter_mut().enumerate() {
        for e in 0..moe.experts {
            part.push(ckpt.load(&format!(
                "{layer}.{block}.experts.{e}.{}.weight",
                names[which]
            ))?);
        }
    }
    let base = format!("{layer}.{block}.experts");
    let mut ffn = experts::ffn_of_experts(&base, parts)?;
    let mut router = router;
    if moe.shared > 0 {
        let shared = |w: &str| ckpt.load(&format!("{layer}.{block}.shared_expert.{w}.weight"));
        let gate = as_f32(ckpt.load(&format!("{layer}.{block}.shared_expert_gate.weight"))?);
        let parts = [
            shared("gate_proj")?,
            shared("up_proj")?,
            shared("down_proj")?,
            gate,
        ];
        (ffn, router) = experts::with_shared_expert(ffn, router, parts, moe.shared)?;
    }
    let linear = |weight: HostTensor| Linear { weight, bias: None };
    Ok((router, ffn.map(linear)))
}

pub(super) fn load(dir: &Path) -> Result<Model, ModelError> {
    let config_path = dir.join("config.json");
    let text = super::read_whole_string(&config_path)?;
    let config = parse_config(&config_path, &text)?;
    let spec = config.spec.clone();
    let ckpt = Checkpoint::open(dir)?;

    let names = |alts: &[&str]| -> Vec<String> { alts.iter().map(|s| s.to_string()).collect() };
    let weights = match spec.arch {
        Arch::Llama => {
            let linear = |base: String, bias: bool| -> Result<Linear, ModelError> {
                Ok(Linear {
                    weight: ckpt.load(&format!("{base}.weight"))?,
                    bias: if bias {
                        Some(as_f32(ckpt.load(&format!("{base}.bias"))?))
                    } else {
                        None
                    },
                })
            };
            let norm = |name: String| -> Result<NormWeights, ModelError> {
                Ok(NormWeights {
                    weight: as_f32(ckpt.load(&name)?),
                    bias: None,
                })
            };
            let head_norm = |name: String| spec.qk_norm.then(|| norm(name)).transpose();
            let mut layers = Vec::with_capacity(spec.n_layers);
            for i in 0..spec.n_layers {
                let p = format!("model.layers.{i}");
                let (router, [gate, up, down]) = match &spec.moe {
                    None => (
                        None,
                        ["gate_proj", "up_proj", "down_proj"]
                            .map(|w| linear(format!("{p}.mlp.{w}"), false)),
                    ),
                    Some(m) => {
                        let (router, ffn) = expert_ffn(&ckpt, &config.model_type, &p, m)?;
                        (Some(router), ffn.map(Ok))
                    }
                };
                let [gate, up, down] = [gate?, up?, down?];
                layers.push(LayerWeights {
                    attn_norm: norm(format!("{p}.input_layernorm.weight"))?,
                    wq: linear(format!("{p}.self_attn.q_proj"), spec.qkv_bias)?,
                    wk: linear(format!("{p}.self_attn.k_proj"), spec.qkv_bias)?,
                    wv: linear(format!("{p}.self_attn.v_proj"), spec.qkv_bias)?,
                    wo: linear(format!("{p}.self_attn.o_proj"), spec.out_bias)?,
                    q_norm: head_norm(format!("{p}.self_attn.q_norm.weight"))?,
                    k_norm: head_norm(format!("{p}.self_attn.k_norm.weight"))?,
                    ffn_norm: norm(format!("{p}.post_attention_layernorm.weight"))?,
                    router,
                    w_gate: Some(gate),
                    w_up: up,
                    w_down: down,
                });
            }
            let token_embd = ckpt.load("model.embed_tokens.weight")?;
            let output = if spec.tied_output || !ckpt.has("lm_head.weight") {
                None
            } else {
                Some(ckpt.load("lm_head.weight")?)
            };
            ModelWeights {
                token_embd,
                pos_embd: None,
                layers,
                output_norm: norm("model.norm.weight".into())?,
                output,
                rope_freq_factors: None,
            }
        }
        Arch::Opt => {
            // transformers saves `model.decoder.*`; some older checkpoints drop the `model.`.
            let prefix = if ckpt.has("model.decoder.embed_tokens.weight") {
                "model.decoder"
            } else {
                "decoder"
            };
            let linear = |base: String| -> Result<Linear, ModelError> {
                Ok(Linear {
                    weight: ckpt.load(&format!("{base}.weight"))?,
                    bias: Some(as_f32(ckpt.load(&format!("{base}.bias"))?)),
                })
            };
            let norm = |base: String| -> Result<NormWeights, ModelError> {
                Ok(NormWeights {
                    weight: as_f32(ckpt.load(&format!("{base}.weight"))?),
                    bias: Some(as_f32(ckpt.load(&format!("{base}.bias"))?)),
                })
            };
            let mut layers = Vec::with_capacity(spec.n_layers);
            for i in 0..spec.n_layers {
                let p = format!("{prefix}.layers.{i}");
                layers.push(LayerWeights {
                    attn_norm: norm(format!("{p}.self_attn_layer_norm"))?,
                    wq: linear(format!("{p}.self_attn.q_proj"))?,
                    wk: linear(format!("{p}.self_attn.k_proj"))?,
                    wv: linear(format!("{p}.self_attn.v_proj"))?,
                    wo: linear(format!("{p}.self_attn.out_proj"))?,
                    q_norm: None,
                    k_norm: None,
                    ffn_norm: norm(format!("{p}.final_layer_norm"))?,
                    router: None,
                    w_gate: None,
                    w_up: linear(format!("{p}.fc1"))?,
                    w_down: linear(format!("{p}.fc2"))?,
                });
            }
            let output = if !spec.tied_output && ckpt.has("lm_head.weight") {
                Some(ckpt.load("lm_head.weight")?)
            } else {
                None
            };
            ModelWeights {
                token_embd: ckpt.load_any(&names(&[&format!("{prefix}.embed_tokens.weight")]))?,
                pos_embd: Some(ckpt.load(&format!("{prefix}.embed_positions.weight"))?),
                layers,
                output_norm: norm(format!("{prefix}.final_layer_norm"))?,
                output,
                rope_freq_factors: None,
            }
        }
    };
    let tokenizer = Tokenizer::from_hf_dir(dir)?;
    // An id past the embedding would be refused mid-run (an HF embedding may have more rows
    // than the tokenizer has tokens: padding; never fewer).
    if let Some(max) = tokenizer.as_ref().and_then(Tokenizer::max_id)
        && max as usize >= spec.vocab_size
    {
        return Err(ModelError::Format {
            path: dir.join("tokenizer.json"),
            msg: format!(
                "token id {max} is past the embedding's {} rows (`vocab_size` in config.json)",
                spec.vocab_size
            ),
        });
    }
    Ok(Model {
        spec,
        weights,
        tokenizer,
        source: dir.to_path_buf(),
    })
}
