//! What every offloaded weight source holds for good, whatever its mode: each layer's norms and
//! biases (`Small`) and the end of a pass (`Head`: final norm, output matrix, RoPE factors)
//! on the device, the embedding tables in DRAM (`Embeddings`), and the `Loader` that reads
//! store segments through one staging buffer at start-up. `Resident` adds every layer's
//! attention on the device: what hybrid execution and cache units keep whole (the plan's side
//! is [`crate::plan::resident`]).
//!
//! Loads once at start-up and does not stream; every byte is reserved in the ledger.

use std::sync::Arc;

use crate::backend::Backend;
use crate::engine::{
    ColdView, EngineError, FfnView, HeadView, LayerView, LinearView, NormView, Result,
};
use crate::footprint::MatmulShapes;
use crate::footprint::ledger::{Ledger, Reservation, Tier};
use crate::model::{ModelSpec, PositionEncoding};
use crate::plan::{
    Part, device_dtype, head_segment, offload_matmuls, part_segment_name, staging_chunks,
};
use crate::store::{Segment, SegmentKind, Store, StoreError, names};
use crate::tensor::{AlignedBuf, DType, HostTensor};

fn store_err(e: StoreError) -> EngineError {
    EngineError::Weights(e.to_string())
}

fn weights_err(e: impl std::fmt::Display) -> EngineError {
    EngineError::Weights(e.to_string())
}

/// Norms and biases of one layer (always resident).
pub(super) struct Small<B: Backend> {
    pub(super) attn_norm: (B::Weight, Option<B::Weight>),
    pub(super) ffn_norm: (B::Weight, Option<B::Weight>),
    /// q, k, v, o biases.
    pub(super) attn_bias: [Option<B::Weight>; 4],
    pub(super) up_bias: Option<B::Weight>,
    pub(super) down_bias: Option<B::Weight>,
    /// The per-head norms of q and k (Qwen3).
    pub(super) qk_norm: Option<[B::Weight; 2]>,
}

impl<B: Backend> Small<B> {
    /// Layer `l`'s norms and biases, loaded to the device.
    pub(super) fn load(loader: &mut Loader, b: &B, l: usize) -> Result<Self> {
        let mut norm = |what: &str| -> Result<(B::Weight, Option<B::Weight>)> {
            Ok((
                loader.vector(b, &names::layer(l, &format!("{what}.weight")))?,
                loader.opt_vector(b, &names::layer(l, &format!("{what}.bias")))?,
            ))
        };
        let attn_norm = norm("attn_norm")?;
        let ffn_norm = norm("ffn_norm")?;
        let mut attn_bias: [Option<B::Weight>; 4] = Default::default();
        for (i, t) in ["attn_q", "attn_k", "attn_v", "attn_output"]
            .iter()
            .enumerate()
        {
            attn_bias[i] = loader.opt_vector(b, &names::layer(l, &format!("{t}.bias")))?;
        }
        let q_norm = loader.opt_vector(b, &names::layer(l, "attn_q_norm.weight"))?;
        let k_norm = loader.opt_vector(b, &names::layer(l, "attn_k_norm.weight"))?;
        let qk_norm = match (q_norm, k_norm) {
            (Some(q), Some(k)) => Some([q, k]),
            (None, None) => None,
            _ => {
                return Err(weights_err(format!(
                    "layer {l} has one of attn_q_norm and attn_k_norm without the other"
                )));
            }
        };
        Ok(Small {
            attn_norm,
            ffn_norm,
            attn_bias,
            qk_norm,
            up_bias: loader.opt_vector(b, &names::layer(l, "ffn_up.bias"))?,
            down_bias: loader.opt_vector(b, &names::layer(l, "ffn_down.bias"))?,
        })
    }

    pub(super) fn qk_norm(&self) -> Option<[&B::Weight; 2]> {
        self.qk_norm.as_ref().map(|[q, k]| [q, k])
    }

    pub(super) fn attn_norm(&self) -> NormView<'_, B> {
        NormView {
            weight: &self.attn_norm.0,
            bias: self.attn_norm.1.as_ref(),
        }
    }

    pub(super) fn ffn_norm(&self) -> NormView<'_, B> {
        NormView {
            weight: &self.ffn_norm.0,
            bias: self.ffn_norm.1.as_ref(),
        }
    }
}

/// A host table in DRAM (embeddings), read one row per token.
struct Table {
    t: HostTensor,
    _hold: Reservation,
}

/// What every offloaded source holds for the end of a pass: the final norm and the output
/// matrix on the device, and the RoPE frequency factors (host).
pub(super) struct Head<B: Backend> {
    output: B::Weight,
    norm: (B::Weight, Option<B::Weight>),
    rope_freq_factors: Option<Vec<f32>>,
}

impl<B: Backend> Head<B> {
    pub(super) fn load(loader: &mut Loader, b: &B, store: &Store) -> Result<Self> {
        let seg = head_segment(&store.manifest).map_err(|e| EngineError::Weights(e.to_string()))?;
        Ok(Head {
            output: loader.load_matrix(b, seg, 0..seg.rows)?,
            norm: (
                loader.vector(b, names::OUTPUT_NORM)?,
                loader.opt_vector(b, names::OUTPUT_NORM_BIAS)?,
            ),
            rope_freq_factors: match store.segment(names::ROPE_FREQS) {
                Some(_) => Some(store.tensor(names::ROPE_FREQS).map_err(store_err)?.to_f32()),
                None => None,
            },
        })
    }

    pub(super) fn view(&self) -> HeadView<'_, B> {
        HeadView {
            norm: NormView {
                weight: &self.norm.0,
                bias: self.norm.1.as_ref(),
            },
            output: LinearView {
                blocks: vec![(0, &self.output)],
                bias: None,
            },
        }
    }

    pub(super) fn rope_freq_factors(&self) -> Option<Vec<f32>> {
        self.rope_freq_factors.clone()
    }
}

/// The embedding tables in DRAM, looked up on the host: a step's input rows are built there and
/// copied in once.
pub(super) struct Embeddings {
    token: Table,
    pos: Option<(Table, usize)>,
    d: usize,
    x_host: Vec<f32>,
}

impl Embeddings {
    pub(super) fn load(store: &Store, ledger: &Arc<Ledger>, spec: &ModelSpec) -> Result<Self> {
        Ok(Embeddings {
            token: table(store, ledger, names::TOKEN_EMBD)?,
            pos: match &spec.position {
                PositionEncoding::Learned { offset } => {
                    Some((table(store, ledger, names::POS_EMBD)?, *offset))
                }
                PositionEncoding::Rope(_) => None,
            },
            d: spec.d_model,
            x_host: Vec::new(),
        })
    }

    /// Token embeddings (plus learned positions from `first_pos`) of `ids` into `out`.
    pub(super) fn embed<B: Backend>(
        &mut self,
        b: &B,
        ids: &[u32],
        first_pos: usize,
        out: &mut B::Tensor,
    ) -> Result<()> {
        let d = self.d;
        self.x_host.resize(ids.len() * d, 0.0);
        let mut row = vec![0f32; d];
        for (i, &id) in ids.iter().enumerate() {
            let x = &mut self.x_host[i * d..(i + 1) * d];
            self.token
                .t
                .row_f32(id as usize, x)
                .map_err(|e| EngineError::InvalidToken { id, vocab: e.rows })?;
            if let Some((table, offset)) = &self.pos {
                let r = first_pos + i + offset;
                if r >= table.t.rows {
                    return Err(EngineError::ContextFull {
                        needed: first_pos + i + 1,
                        ctx: table.t.rows - offset,
                    });
                }
                table
                    .t
                    .row_f32(r, &mut row)
                    .map_err(|e| EngineError::Weights(e.to_string()))?;
                x.iter_mut().zip(&row).for_each(|(a, p)| *a += p);
            }
        }
        b.write(out, &self.x_host)?;
        Ok(())
    }
}

/// Reads store segments into one reusable page-aligned buffer (reserved in DRAM) and copies
/// them to the device in chunks of whole checksum groups.
pub(super) struct Loader<'a> {
    store: &'a Store,
    ledger: &'a Arc<Ledger>,
    staging: AlignedBuf,
    _hold: Reservation,
}

impl<'a> Loader<'a> {
    /// A loader with a staging buffer of `bytes` (at least a page), reserved in DRAM.
    pub(super) fn new(store: &'a Store, ledger: &'a Arc<Ledger>, bytes: u64) -> Result<Self> {
        let bytes = bytes.max(4096);
        Ok(Loader {
            store,
            ledger,
            staging: AlignedBuf::zeroed(bytes as usize),
            _hold: ledger
                .reserve(Tier::Dram, bytes, "start-up staging")
                .map_err(|e| EngineError::Weights(e.to_string()))?,
        })
    }

    /// Rows `rows` of `seg` into a new device weight of `dtype`.
    pub(super) fn load_to_device<B: Backend>(
        &mut self,
        b: &B,
        seg: &Segment,
        rows: std::ops::Range<usize>,
        dtype: DType,
    ) -> Result<B::Weight> {
        let mut w = b.alloc_weight(&seg.name, dtype, rows.len(), seg.cols)?;
        for chunk in staging_chunks(seg, rows.clone()) {
            let (first, read) = self
                .store
                .read_rows_into(seg, chunk.clone(), &mut self.staging)
                .map_err(store_err)?;
            self.ledger.count_ssd(read);
            let len = chunk.len() * seg.row_bytes();
            b.upload_into(
                &mut w,
                chunk.start - rows.start,
                &self.staging.as_slice()[first..first + len],
            )?;
            // The copy reads from staging: finish it before the next read overwrites it.
            let ev = b.copies_done()?;
            b.host_waits(&ev)?;
        }
        Ok(w)
    }

    /// Rows `rows` of `seg` into a new device weight that only the products read, laid out for
    /// them ([`Backend::lay_out_for_products`]).
    pub(super) fn load_matrix<B: Backend>(
        &mut self,
        b: &B,
        seg: &Segment,
        rows: std::ops::Range<usize>,
    ) -> Result<B::Weight> {
        let mut w = self.load_to_device(b, seg, rows, device_dtype(seg))?;
        b.lay_out_for_products(&mut w)?;
        Ok(w)
    }

    pub(super) fn vector<B: Backend>(&mut self, b: &B, name: &str) -> Result<B::Weight> {
        let seg = self.store.require(name).map_err(store_err)?;
        self.load_to_device(b, seg, 0..seg.rows, DType::F32)
    }

    pub(super) fn opt_vector<B: Backend>(
        &mut self,
        b: &B,
        name: &str,
    ) -> Result<Option<B::Weight>> {
        match self.store.segment(name) {
            Some(_) => self.vector(b, name).map(Some),
            None => Ok(None),
        }
    }
}

/// A whole tensor segment in a DRAM buffer (reserved), as a host tensor.
fn table(store: &Store, ledger: &Arc<Ledger>, name: &str) -> Result<Table> {
    let seg = store.require(name).map_err(store_err)?;
    if seg.kind != SegmentKind::Tensor {
        return Err(EngineError::Weights(format!("`{name}` is not a tensor")));
    }
    let hold = ledger
        .reserve(Tier::Dram, seg.bytes.next_multiple_of(4096), name)
        .map_err(|e| EngineError::Weights(e.to_string()))?;
    let t = store.tensor(name).map_err(store_err)?;
    ledger.count_ssd(seg.read_extent(0..seg.rows).1);
    Ok(Table { t, _hold: hold })
}

/// What hybrid execution and cache units keep whole: every layer's norms, biases and attention
/// and the output head on the device, the embedding tables in DRAM, and the matmul shapes step
/// memory is sized by.
pub(super) struct Resident<B: Backend> {
    small: Vec<Small<B>>,
    /// q, k, v, o of every layer.
    attention: Vec<[B::Weight; 4]>,
    pub(super) head: Head<B>,
    pub(super) embeddings: Embeddings,
    pub(super) matmuls: MatmulShapes,
}

impl<B: Backend> Resident<B> {
    /// Load it through a staging buffer of `staging` bytes, calling `ffn(l, small, loader)`
    /// after each layer's norms and biases are on the device (the FFN's own loading, which may
    /// rewrite the up bias, or load more of the layer through the same staging).
    pub(super) fn load(
        b: &B,
        store: &Arc<Store>,
        ledger: &Arc<Ledger>,
        staging: u64,
        mut ffn: impl FnMut(usize, &mut Small<B>, &mut Loader) -> Result<()>,
    ) -> Result<Self> {
        let n_layers = store.manifest.spec.n_layers;
        let embeddings = Embeddings::load(store, ledger, &store.manifest.spec)?;
        let mut loader = Loader::new(store, ledger, staging)?;
        let mut small = Vec::with_capacity(n_layers);
        let mut attention = Vec::with_capacity(n_layers);
        for l in 0..n_layers {
            let mut sm = Small::load(&mut loader, b, l)?;
            let mut att = Vec::with_capacity(4);
            for p in Part::ATTENTION {
                let s = store.require(&part_segment_name(l, p)).map_err(store_err)?;
                att.push(loader.load_matrix(b, s, 0..s.rows)?);
            }
            let att: [B::Weight; 4] = att
                .try_into()
                .map_err(|_| weights_err("four attention matrices"))?;
            ffn(l, &mut sm, &mut loader)?;
            attention.push(att);
            small.push(sm);
        }
        let mut all: Vec<&mut B::Weight> = attention.iter_mut().flatten().collect();
        b.pack_for_products(&mut all)?;
        let head = Head::load(&mut loader, b, store)?;
        Ok(Resident {
            small,
            attention,
            head,
            embeddings,
            matmuls: offload_matmuls(&store.manifest).map_err(weights_err)?,
        })
    }

    /// Layer `l`'s norms and biases.
    pub(super) fn small(&self, l: usize) -> &Small<B> {
        &self.small[l]
    }

    /// Layer `l` with `ffn` for its FFN and what runs beside.
    pub(super) fn layer<'a>(
        &'a self,
        l: usize,
        ffn: FfnView<'a, B>,
        cold: Option<ColdView<'a, B>>,
        unit: Option<Box<dyn crate::engine::NeuronUnit<B> + 'a>>,
    ) -> LayerView<'a, B> {
        let sm = &self.small[l];
        let [q, k, v, o] = &self.attention[l];
        LayerView {
            attn_norm: sm.attn_norm(),
            wq: linear(Some(q), sm.attn_bias[0].as_ref()),
            wk: linear(Some(k), sm.attn_bias[1].as_ref()),
            wv: linear(Some(v), sm.attn_bias[2].as_ref()),
            wo: linear(Some(o), sm.attn_bias[3].as_ref()),
            qk_norm: sm.qk_norm(),
            router: None,
            ffn_norm: sm.ffn_norm(),
            ffn,
            cold,
            unit,
            experts: None,
        }
    }
}

/// The [`WeightSource`] methods of a source whose `resident` field is a [`Resident`]: all but
/// `layer`.
macro_rules! resident_source {
    () => {
        fn embed(
            &mut self,
            b: &B,
            ids: &[u32],
            first_pos: usize,
            out: &mut B::Tensor,
        ) -> Result<()> {
            self.resident.embeddings.embed(b, ids, first_pos, out)
        }

        fn rope_freq_factors(&self) -> Option<Vec<f32>> {
            self.resident.head.rope_freq_factors()
        }

        fn layer_done(&mut self, _: &B, _: usize) -> Result<()> {
            Ok(())
        }

        fn head(&mut self, _: &B) -> Result<HeadView<'_, B>> {
            Ok(self.resident.head.view())
        }

        fn head_done(&mut self, _: &B) -> Result<()> {
            Ok(())
        }

        fn matmuls(&self) -> MatmulShapes {
            self.resident.matmuls.clone()
        }
    };
}
pub(super) use resident_source;

/// A device weight read whole (none: no blocks), with its bias.
pub(super) fn linear<'a, B: Backend>(
    w: Option<&'a B::Weight>,
    bias: Option<&'a B::Weight>,
) -> LinearView<'a, B> {
    LinearView {
        blocks: w.map(|w| (0, w)).into_iter().collect(),
        bias,
    }
}
