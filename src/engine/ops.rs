//! The small ops every part of a layer is made of: norms (with the residual add), linears (several
//! of one input in one launch), and the norm as the products after it take their input.

use super::ports::{LinearView, NormView};
use super::{Engine, Result};
use crate::backend::{Backend, BackendError, MatmulPart, ProductInput};
use crate::model::NormKind;

impl<B: Backend> Engine<B> {
    /// `x` normed by `n` into `out` (the model's norm: RMSNorm, or LayerNorm with its bias).
    pub(super) fn norm(&self, x: &B::Tensor, n: &NormView<B>, out: &mut B::Tensor) -> Result<()> {
        let eps = self.spec.norm_eps;
        match (self.spec.norm, n.bias) {
            (NormKind::Rms, _) => self.backend.rms_norm(x, n.weight, eps, out)?,
            (NormKind::Layer, Some(b)) => self.backend.layer_norm(x, n.weight, b, eps, out)?,
            (NormKind::Layer, None) => {
                return Err(BackendError::Shape {
                    op: "layer_norm",
                    msg: "LayerNorm without a bias".into(),
                }
                .into());
            }
        }
        Ok(())
    }

    /// `out = l(x)`: the product of each block of `l`'s rows (its outputs from the block's first
    /// row on), then the bias.
    pub(super) fn linear(
        &self,
        l: &LinearView<B>,
        x: &B::Tensor,
        out: &mut B::Tensor,
    ) -> Result<()> {
        match l.blocks.as_slice() {
            &[(row0, w)] => self.backend.matmul_into(w, x, out, row0)?,
            // A linear held in blocks (resident rows and streamed ones): one product of its
            // parts, where a product each paid the pool's wake-up and idle tail again.
            blocks => {
                let parts: Vec<MatmulPart<B::Weight>> = blocks
                    .iter()
                    .map(|&(col0, w)| MatmulPart { w, out: 0, col0 })
                    .collect();
                self.backend.matmul_parts(x, &parts, &mut [out])?;
            }
        }
        if let Some(b) = l.bias {
            self.backend.add_bias(out, b)?;
        }
        Ok(())
    }

    /// `x` through several linears of the same input (q, k, v; up and gate), each into its
    /// output: one [`Backend::matmul_parts`] (one launch on CUDA), then the biases.
    pub(super) fn linears(
        &self,
        ls: &[&LinearView<B>],
        x: ProductInput<'_, B>,
        outs: &mut [&mut B::Tensor],
    ) -> Result<()> {
        let parts: Vec<MatmulPart<B::Weight>> = ls
            .iter()
            .enumerate()
            .flat_map(|(out, l)| {
                l.blocks
                    .iter()
                    .map(move |&(col0, w)| MatmulPart { w, out, col0 })
            })
            .collect();
        self.backend.matmul_parts_of(x, &parts, outs)?;
        for (l, out) in ls.iter().zip(outs.iter_mut()) {
            if let Some(b) = l.bias {
                self.backend.add_bias(out, b)?;
            }
        }
        Ok(())
    }

    /// `x`'s rows (after `x += add`, where given) normed by `n`, as the products after the norm
    /// take them: an RMSNorm pending (the backend may write its rows straight in the products'
    /// input format), a LayerNorm computed into `out`.
    pub(super) fn norm_input<'a>(
        &self,
        x: &'a mut B::Tensor,
        add: Option<&'a B::Tensor>,
        n: &'a NormView<B>,
        out: &'a mut B::Tensor,
    ) -> Result<ProductInput<'a, B>> {
        match self.spec.norm {
            NormKind::Rms => Ok(ProductInput::RmsNorm {
                x,
                add,
                weight: n.weight,
                eps: self.spec.norm_eps,
                out,
            }),
            NormKind::Layer => {
                match add {
                    Some(y) => self.add_norm(x, y, n, out)?,
                    None => self.norm(x, n, out)?,
                }
                Ok(ProductInput::Rows(out))
            }
        }
    }

    /// `x += y`, then `x` normed by `n` into `out` (one op for RMSNorm).
    pub(super) fn add_norm(
        &self,
        x: &mut B::Tensor,
        y: &B::Tensor,
        n: &NormView<B>,
        out: &mut B::Tensor,
    ) -> Result<()> {
        match self.spec.norm {
            NormKind::Rms => {
                let eps = self.spec.norm_eps;
                Ok(self.backend.add_rms_norm(x, y, n.weight, eps, out)?)
            }
            NormKind::Layer => {
                self.backend.add(x, y)?;
                self.norm(x, n, out)
            }
        }
    }
}
