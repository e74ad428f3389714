//! Every weight placed on the device once, in its file format: the dense engine (the CPU engine
//! uses the weights straight from the memory map; a GPU holds a copy).

use super::error::Result;
use super::ports::{FfnView, HeadView, LayerView, LinearView, NormView, WeightSource};
use crate::backend::Backend;
use crate::footprint::MatmulShapes;
use crate::model::{LayerWeights, Linear, ModelSpec, ModelWeights, NormWeights, PositionEncoding};
use crate::tensor::HostTensor;

struct Norm<B: Backend> {
    weight: B::Weight,
    bias: Option<B::Weight>,
}

struct Lin<B: Backend> {
    weight: B::Weight,
    bias: Option<B::Weight>,
}

struct Layer<B: Backend> {
    attn_norm: Norm<B>,
    wq: Lin<B>,
    wk: Lin<B>,
    wv: Lin<B>,
    wo: Lin<B>,
    qk_norm: Option<[B::Weight; 2]>,
    ffn_norm: Norm<B>,
    router: Option<B::Weight>,
    gate: Option<Lin<B>>,
    up: Lin<B>,
    down: Lin<B>,
}

/// All weights resident on the backend.
pub struct ResidentWeights<B: Backend> {
    token_embd: B::Weight,
    pos_embd: Option<(B::Weight, usize)>,
    layers: Vec<Layer<B>>,
    output_norm: Norm<B>,
    /// `None` when tied to `token_embd`.
    output: Option<B::Weight>,
    rope_freq_factors: Option<Vec<f32>>,
    matmuls: MatmulShapes,
}

impl<B: Backend> Norm<B> {
    fn view(&self) -> NormView<'_, B> {
        NormView {
            weight: &self.weight,
            bias: self.bias.as_ref(),
        }
    }
}

impl<B: Backend> Lin<B> {
    fn view(&self) -> LinearView<'_, B> {
        LinearView {
            blocks: vec![(0, &self.weight)],
            bias: self.bias.as_ref(),
        }
    }
}

impl<B: Backend> ResidentWeights<B> {
    pub fn new(b: &B, spec: &ModelSpec, w: &ModelWeights) -> Result<Self> {
        let up = |t: &HostTensor| b.upload(t);
        let norm = |n: &NormWeights| -> Result<Norm<B>> {
            Ok(Norm {
                weight: up(&n.weight)?,
                bias: n.bias.as_ref().map(up).transpose()?,
            })
        };
        let lin = |l: &Linear| -> Result<Lin<B>> {
            Ok(Lin {
                weight: up(&l.weight)?,
                bias: l.bias.as_ref().map(up).transpose()?,
            })
        };
        // Attention's matrices and an output matrix of its own are only ever multiplied: laid
        // out for the products (the FFN's may be read by rows; a tied output is the embedding).
        let product = |t: &HostTensor| -> Result<B::Weight> {
            let mut w = up(t)?;
            b.lay_out_for_products(&mut w)?;
            Ok(w)
        };
        let matrix = |l: &Linear| -> Result<Lin<B>> {
            Ok(Lin {
                weight: product(&l.weight)?,
                bias: l.bias.as_ref().map(up).transpose()?,
            })
        };
        let layer = |l: &LayerWeights| -> Result<Layer<B>> {
            Ok(Layer {
                attn_norm: norm(&l.attn_norm)?,
                wq: matrix(&l.wq)?,
                wk: matrix(&l.wk)?,
                wv: matrix(&l.wv)?,
                wo: matrix(&l.wo)?,
                qk_norm: match (&l.q_norm, &l.k_norm) {
                    (Some(q), Some(k)) => Some([up(&q.weight)?, up(&k.weight)?]),
                    _ => None,
                },
                ffn_norm: norm(&l.ffn_norm)?,
                router: l.router.as_ref().map(up).transpose()?,
                gate: l.w_gate.as_ref().map(lin).transpose()?,
                up: lin(&l.w_up)?,
                down: lin(&l.w_down)?,
            })
        };
        let pos_embd = match (&w.pos_embd, &spec.position) {
            (Some(p), PositionEncoding::Learned { offset }) => Some((up(p)?, *offset)),
            _ => None,
        };
        let mut layers: Vec<Layer<B>> = w.layers.iter().map(layer).collect::<Result<_>>()?;
        let mut attention: Vec<&mut B::Weight> = layers
            .iter_mut()
            .flat_map(|l| [&mut l.wq, &mut l.wk, &mut l.wv, &mut l.wo].map(|m| &mut m.weight))
            .collect();
        b.pack_for_products(&mut attention)?;
        Ok(ResidentWeights {
            token_embd: up(&w.token_embd)?,
            pos_embd,
            layers,
            output_norm: norm(&w.output_norm)?,
            output: w.output.as_ref().map(product).transpose()?,
            rope_freq_factors: w.rope_freq_factors.clone(),
            matmuls: MatmulShapes::of_weights(w),
        })
    }
}

impl<B: Backend> WeightSource<B> for ResidentWeights<B> {
    fn embed(&mut self, b: &B, ids: &[u32], first_pos: usize, out: &mut B::Tensor) -> Result<()> {
        b.embed(&self.token_embd, ids, out)?;
        if let Some((table, offset)) = &self.pos_embd {
            b.add_table_rows(out, table, first_pos + offset)?;
        }
        Ok(())
    }

    fn rope_freq_factors(&self) -> Option<Vec<f32>> {
        self.rope_freq_factors.clone()
    }

    fn layer(&mut self, _: &B, l: usize) -> Result<LayerView<'_, B>> {
        let layer = &self.layers[l];
        Ok(LayerView {
            attn_norm: layer.attn_norm.view(),
            wq: layer.wq.view(),
            wk: layer.wk.view(),
            wv: layer.wv.view(),
            wo: layer.wo.view(),
            qk_norm: layer.qk_norm.as_ref().map(|[q, k]| [q, k]),
            ffn_norm: layer.ffn_norm.view(),
            router: layer.router.as_ref(),
            ffn: FfnView::Matrices {
                gate: layer.gate.as_ref().map(Lin::view),
                up: layer.up.view(),
                down: layer.down.view(),
            },
            cold: None,
            unit: None,
            experts: None,
        })
    }

    fn layer_done(&mut self, _: &B, _: usize) -> Result<()> {
        Ok(())
    }

    fn head(&mut self, _: &B) -> Result<HeadView<'_, B>> {
        Ok(HeadView {
            norm: self.output_norm.view(),
            output: LinearView {
                blocks: vec![(0, self.output.as_ref().unwrap_or(&self.token_embd))],
                bias: None,
            },
        })
    }

    fn head_done(&mut self, _: &B) -> Result<()> {
        Ok(())
    }

    fn matmuls(&self) -> MatmulShapes {
        self.matmuls.clone()
    }

    fn fixed(&self) -> bool {
        true
    }
}
