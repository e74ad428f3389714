//! Mixture-of-experts shapes for `synth` (GGUF only): Qwen3-MoE (`qwen3moe`: q and k RMS-normed
//! per head, RoPE by halves, `head_dim` apart from the hidden size) and Mixtral (`llama` with
//! 3-D experts), each layer's experts stacked as llama.cpp's `ffn_{gate,up,down}_exps`.
//!
//! Planted popularity: the router row of the expert of rank `r` (a pseudo-random order per
//! layer) leans along the direction the embeddings share, so its logit is biased by about
//! `−P·ln(1 + r)` against a unit-variance rest. Temporal locality cannot be planted by weights
//! on random token ids; `bench experts --synthetic` replays a drawn trace for that.

use super::{EMBED_ALONG, Fill, SynthSpec, TensorPlan, name_hash, splitmix};

/// The experts of a synthetic mixture-of-experts shape.
#[derive(Clone, Debug, PartialEq)]
pub struct SynthMoe {
    pub experts: usize,
    /// Experts a token is routed to.
    pub used: usize,
    /// Each expert's FFN width.
    pub d_expert: usize,
    /// Qwen3-MoE (`qwen3moe`) rather than Mixtral (`llama`).
    pub qwen3: bool,
    /// Per head (Qwen3-MoE's q is `heads × head_dim` wide, not the hidden size).
    pub head_dim: usize,
    /// Planted popularity `P` (0: none; see the module's note).
    pub popularity: f64,
}

/// The named mixture-of-experts shapes (see [`SynthSpec::preset`]).
pub(super) fn preset(name: &str) -> Option<SynthSpec> {
    let (n_layers, d_model, n_heads, n_kv_heads, vocab_size, max_context, moe) = match name {
        // Every matrix in rows of 256 (K-quant super-blocks), 8 experts as Mixtral, and Qwen3's
        // q wider than the hidden size.
        "tiny-moe" => (
            2,
            256,
            4,
            2,
            320,
            256,
            SynthMoe {
                experts: 8,
                used: 2,
                d_expert: 256,
                qwen3: true,
                head_dim: 128,
                popularity: 0.0,
            },
        ),
        "qwen3-30b-a3b" => (
            48,
            2048,
            32,
            4,
            151_936,
            32_768,
            SynthMoe {
                experts: 128,
                used: 8,
                d_expert: 768,
                qwen3: true,
                head_dim: 128,
                popularity: 0.0,
            },
        ),
        "mixtral-8x7b" => (
            32,
            4096,
            32,
            8,
            32_000,
            32_768,
            SynthMoe {
                experts: 8,
                used: 2,
                d_expert: 14_336,
                qwen3: false,
                head_dim: 128,
                popularity: 0.0,
            },
        ),
        _ => return None,
    };
    let base = SynthSpec::preset("tiny")?;
    Some(SynthSpec {
        n_layers,
        d_model,
        d_ff: moe.d_expert,
        n_heads,
        n_kv_heads,
        vocab_size,
        max_context,
        moe: Some(moe),
        ..base
    })
}

impl SynthMoe {
    pub(super) fn validate(&self, spec: &SynthSpec) -> Result<(), String> {
        use crate::limits::{MAX_DIM, MAX_EXPERTS};
        if spec.arch != crate::model::Arch::Llama || spec.activation != "silu" {
            return Err("mixture-of-experts shapes are SwiGLU LLaMA-family models".into());
        }
        if spec.power_law.is_some() {
            return Err("--power-law plants dense FFN neurons; experts take --popularity".into());
        }
        if self.experts == 0 || !MAX_EXPERTS.admits(self.experts as u64) {
            return Err(MAX_EXPERTS.refuse("experts", self.experts as u64));
        }
        if self.used == 0 || self.used > self.experts {
            return Err(format!(
                "{} experts a token of {}: need 1..=experts",
                self.used, self.experts
            ));
        }
        if self.d_expert == 0 || !MAX_DIM.admits(self.d_expert as u64) {
            return Err(MAX_DIM.refuse("expert FFN size", self.d_expert as u64));
        }
        if self.head_dim == 0
            || !self.head_dim.is_multiple_of(2)
            || !MAX_DIM.admits(self.head_dim as u64)
        {
            return Err(format!(
                "head size {} must be even and positive",
                self.head_dim
            ));
        }
        if !self.qwen3 && self.head_dim * spec.n_heads != spec.d_model {
            return Err("Mixtral's heads tile the hidden size (heads × head size = hidden)".into());
        }
        if !(self.popularity.is_finite() && (0.0..=8.0).contains(&self.popularity)) {
            return Err(format!("popularity {} is outside 0..=8", self.popularity));
        }
        Ok(())
    }

    /// GGUF architecture name.
    pub(super) fn arch(&self) -> &'static str {
        if self.qwen3 { "qwen3moe" } else { "llama" }
    }

    /// Layer `l`'s tensors (HF-style names that `gguf_name` maps; the experts of a kind as one
    /// stack, expert `e`'s rows after expert `e − 1`'s).
    pub(super) fn layer_tensors(&self, spec: &SynthSpec, l: usize, v: &mut Vec<TensorPlan>) {
        let (d, hd, de, e) = (spec.d_model, self.head_dim, self.d_expert, self.experts);
        let (q, kv) = (spec.n_heads * hd, spec.n_kv_heads * hd);
        let (lin, norm) = (TensorPlan::linear, TensorPlan::norm);
        let p = format!("model.layers.{l}");
        v.push(norm(format!("{p}.input_layernorm.weight"), d));
        v.push(lin(format!("{p}.self_attn.q_proj.weight"), q, d));
        v.push(lin(format!("{p}.self_attn.k_proj.weight"), kv, d));
        if self.qwen3 {
            v.push(norm(format!("{p}.self_attn.q_norm.weight"), hd));
            v.push(norm(format!("{p}.self_attn.k_norm.weight"), hd));
        }
        v.push(lin(format!("{p}.self_attn.v_proj.weight"), kv, d));
        v.push(lin(format!("{p}.self_attn.o_proj.weight"), d, q));
        v.push(norm(format!("{p}.post_attention_layernorm.weight"), d));
        v.push(TensorPlan {
            name: format!("{p}.mlp.gate.weight"),
            rows: e,
            cols: d,
            fill: Fill::Router {
                popularity: self.popularity as f32,
            },
        });
        v.push(lin(format!("{p}.mlp.experts.gate_proj.weight"), e * de, d));
        v.push(lin(format!("{p}.mlp.experts.up_proj.weight"), e * de, d));
        v.push(lin(format!("{p}.mlp.experts.down_proj.weight"), e * d, de));
    }
}

/// Each expert's offset along the shared direction in router `name` (`experts` rows of `d`
/// values): `−P·ln(1 + rank)` divided by the direction's share of a normed input, as
/// [`super::planted_offset`] sizes a planted neuron's.
pub(super) fn router_offsets(
    seed: u64,
    name: &str,
    experts: usize,
    popularity: f32,
    d: usize,
) -> Vec<f32> {
    if popularity == 0.0 {
        return vec![0.0; experts];
    }
    let key = |e: usize| splitmix(seed ^ name_hash(name) ^ (e as u64).wrapping_mul(0x9e37_79b9));
    let mut order: Vec<usize> = (0..experts).collect();
    order.sort_by_key(|&e| (key(e), e));
    let rho = EMBED_ALONG as f64;
    let c = (d as f64).sqrt() * rho / (1.0 + rho * rho).sqrt();
    let mut offsets = vec![0f32; experts];
    for (rank, &e) in order.iter().enumerate() {
        offsets[e] = (-(popularity as f64) * (1.0 + rank as f64).ln() / c) as f32;
    }
    offsets
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_follow_a_per_router_order() {
        let a = router_offsets(1, "r0", 8, 1.0, 256);
        let b = router_offsets(1, "r1", 8, 1.0, 256);
        assert_ne!(a, b, "each layer its own order");
        let mut sorted = a.clone();
        sorted.sort_by(|x, y| y.total_cmp(x));
        assert_eq!(sorted[0], 0.0, "the top expert is unbiased");
        let c = 16.0 * 0.5 / 1.25f64.sqrt();
        assert!((f64::from(sorted[7]) + 8f64.ln() / c).abs() < 1e-6);
        assert_eq!(router_offsets(1, "r0", 8, 0.0, 256), vec![0.0; 8]);
    }

    #[test]
    fn presets_validate_and_bad_shapes_do_not() {
        for name in ["tiny-moe", "qwen3-30b-a3b", "mixtral-8x7b"] {
            let s = SynthSpec::preset(name).unwrap();
            s.validate().unwrap();
        }
        let s = SynthSpec::preset("qwen3-30b-a3b").unwrap();
        // Qwen3-30B-A3B has about 30.5B parameters.
        let p = s.parameters() as f64 / 1e9;
        assert!((30.0..31.5).contains(&p), "{p}B parameters");
        let mut bad = SynthSpec::preset("tiny-moe").unwrap();
        bad.moe.as_mut().unwrap().used = 9;
        assert!(bad.validate().unwrap_err().contains("experts a token"));
        let mut bad = SynthSpec::preset("mixtral-8x7b").unwrap();
        bad.moe.as_mut().unwrap().head_dim = 64;
        assert!(bad.validate().is_err());
        let mut bad = SynthSpec::preset("tiny-moe").unwrap();
        bad.power_law = Some(0.8);
        assert!(bad.validate().is_err());
    }
    /// The tiny MoE as GGUF: loads as Qwen3-MoE with its experts; the Q4_K_M file holds
    /// llama.cpp's formats (router f32, 8-expert attention in Q8_0/Q5_K, down in Q6_K where
    /// `use_more_bits` says) and computes nearly what the f16 one does; planted popularity
    /// concentrates the routing.
    #[test]
    fn tiny_moe_ggufs_load_quantize_as_llama_cpp_and_plant_popularity() {
        use crate::backend::cpu::CpuBackend;
        use crate::engine::{Engine, Logits};
        use crate::model::Model;
        use crate::model::quant_mix::QuantMix;
        use crate::sparsity::routing::{RouteTrace, experts_for_share};
        use std::sync::Arc;
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, popularity: f64, quant: Option<QuantMix>| {
            let mut s = SynthSpec::preset("tiny-moe").unwrap();
            s.moe.as_mut().unwrap().popularity = popularity;
            let p = dir.path().join(name);
            super::super::synthesize_gguf(&s, &p, false, quant, &mut |_, _| {}).unwrap();
            p
        };
        let f16 = write("f16.gguf", 0.0, None);
        let q = write("q.gguf", 0.0, Some(QuantMix::Q4KM));
        let g = crate::model::gguf::GgufFile::open(&q).unwrap();
        let ty = |n: &str| g.tensors[n].ggml_type.name();
        assert_eq!(ty("blk.0.ffn_gate_inp.weight"), "F32");
        assert_eq!(ty("blk.0.attn_v.weight"), "Q8_0");
        assert_eq!(ty("blk.0.attn_k.weight"), "Q8_0");
        assert_eq!(ty("blk.0.attn_output.weight"), "Q5_K");
        assert_eq!(ty("blk.0.attn_q.weight"), "Q4_K");
        assert_eq!(ty("blk.0.ffn_gate_exps.weight"), "Q4_K");
        // use_more_bits(l, 2): layer 1 (the last eighth) only.
        assert_eq!(ty("blk.0.ffn_down_exps.weight"), "Q4_K");
        assert_eq!(ty("blk.1.ffn_down_exps.weight"), "Q6_K");
        assert_eq!(ty("output.weight"), "Q6_K");
        assert_eq!(
            g.tensors["blk.1.ffn_up_exps.weight"].dims,
            vec![256, 256, 8]
        );
        let logits = |p: &std::path::Path, ids: &[u32], tap: Option<Arc<RouteTrace>>| {
            let m = Model::load(p).unwrap();
            let moe = m.spec.moe.clone().expect("experts");
            assert_eq!((moe.experts, moe.used, moe.d_expert), (8, 2, 256));
            assert_eq!(m.spec.q_dim(), 512);
            assert!(m.tokenizer.is_some());
            let mut e =
                Engine::new(CpuBackend::new(1).unwrap(), m.spec.clone(), &m.weights).unwrap();
            if let Some(t) = tap {
                e = e.with_route_tap(t);
            }
            let mut s = e.new_session(ids.len()).unwrap();
            let mut out = Vec::new();
            for &t in ids {
                out = e.forward(&mut s, &[t], Logits::Last).unwrap();
            }
            out
        };
        let ids: Vec<u32> = (0..48).map(|i| (i * 37 + 5) % 320).collect();
        let (a, b) = (logits(&f16, &ids, None), logits(&q, &ids, None));
        let scale = a.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = a
            .iter()
            .zip(&b)
            .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(diff < 0.1 * scale, "Q4_K_M logits off by {diff} of {scale}");
        // Popularity: the experts carrying 90% of the routings, planted vs not.
        let share = |p: &std::path::Path| {
            let tap = Arc::new(RouteTrace::new(2));
            logits(p, &ids, Some(tap.clone()));
            tap.take()
                .iter()
                .map(|l| experts_for_share(l, 8, 0.9))
                .sum::<usize>()
        };
        let planted = write("planted.gguf", 3.0, None);
        let (flat, skewed) = (share(&f16), share(&planted));
        assert!(
            skewed < flat,
            "90% of routings: {skewed} experts planted vs {flat} not"
        );
    }
}
