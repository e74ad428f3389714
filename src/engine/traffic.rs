//! What a decode step reads: the numerator of the memory-bandwidth bound on decode speed.

use serde::Serialize;

use crate::backend::KvType;
use crate::model::{ModelSpec, ModelWeights};
use crate::tensor::HostTensor;

/// What one decode step must read from memory: every weight once (one embedding row when the
/// table is not also the output matrix; one position row; of a mixture-of-experts layer's
/// experts only the ones a token uses) and the KV cache so far. The
/// numerator of the memory-bandwidth bound on decode speed.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct DecodeTraffic {
    pub weight_bytes: u64,
    /// K and V bytes read per cached position, over all layers.
    pub kv_bytes_per_position: u64,
}

impl DecodeTraffic {
    pub fn of(spec: &ModelSpec, weights: &ModelWeights, kv: KvType) -> Self {
        // Tables read one row per token: the embedding (unless it is also the output matrix)
        // and learned positions.
        let row_table = |t: &HostTensor| {
            (std::ptr::eq(t, &weights.token_embd) && !spec.tied_output)
                || weights
                    .pos_embd
                    .as_ref()
                    .is_some_and(|p| std::ptr::eq(t, p))
        };
        // A mixture-of-experts layer's token reads only its experts' share: `used` routed
        // ones and any shared expert's parts, of all the stacks hold.
        let experts: Vec<&HostTensor> = match &spec.moe {
            Some(_) => weights
                .layers
                .iter()
                .flat_map(|l| [l.w_gate.as_ref(), Some(&l.w_up), Some(&l.w_down)])
                .flatten()
                .map(|lin| &lin.weight)
                .collect(),
            None => Vec::new(),
        };
        let is_expert = |t: &HostTensor| experts.iter().any(|e| std::ptr::eq(*e, t));
        let mut weight_bytes: u64 = weights
            .tensors()
            .into_iter()
            .filter(|t| !row_table(t) && !is_expert(t))
            .map(|t| t.data.len() as u64)
            .sum();
        if let Some(m) = &spec.moe {
            let all: u64 = experts.iter().map(|t| t.data.len() as u64).sum();
            let parts = (m.experts + m.shared) as u64;
            weight_bytes += all * (m.used + m.shared) as u64 / parts;
        }
        if !spec.tied_output {
            weight_bytes += weights.token_embd.row_bytes() as u64;
        }
        if let Some(p) = &weights.pos_embd {
            weight_bytes += p.row_bytes() as u64;
        }
        DecodeTraffic {
            weight_bytes,
            kv_bytes_per_position: 2 * spec.n_layers as u64 * kv.row_bytes(spec.kv_dim()) as u64,
        }
    }

    /// Bytes read by the step that evaluates position `pos` (it attends to `pos + 1` rows).
    pub fn at(&self, pos: usize) -> u64 {
        self.weight_bytes + self.kv_bytes_per_position * (pos as u64 + 1)
    }

    /// Mean over the decode steps at positions `first..first + steps`.
    pub fn mean(&self, first: usize, steps: usize) -> f64 {
        if steps == 0 {
            return self.at(first) as f64;
        }
        let mid = first as f64 + (steps as f64 - 1.0) / 2.0;
        self.weight_bytes as f64 + self.kv_bytes_per_position as f64 * (mid + 1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A token of the tiny MoE reads its 2 of 8 experts a layer, not all of them.
    #[test]
    fn a_moe_token_reads_its_experts_share() {
        let mut s = crate::model::synth::SynthSpec::preset("tiny-moe").unwrap();
        s.n_layers = 1;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.gguf");
        crate::model::synth::synthesize_gguf(&s, &p, false, None, &mut |_, _| {}).unwrap();
        let m = crate::model::Model::load(&p).unwrap();
        let t = DecodeTraffic::of(&m.spec, &m.weights, KvType::F32);
        let w = &m.weights;
        let l = &w.layers[0];
        let experts = [l.w_gate.as_ref().unwrap(), &l.w_up, &l.w_down]
            .iter()
            .map(|x| x.weight.data.len() as u64)
            .sum::<u64>();
        let all = w.tensors().iter().map(|x| x.data.len() as u64).sum::<u64>();
        let embd = w.token_embd.data.len() as u64 - w.token_embd.row_bytes() as u64;
        assert_eq!(t.weight_bytes, all - embd - experts + experts * 2 / 8);
    }
}
