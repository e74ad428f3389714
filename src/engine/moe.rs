//! A mixture-of-experts layer's FFN: the router's logits on the device, read back; the experts
//! chosen on the host as transformers chooses them ([`route`]); the chosen experts computed by
//! [`Backend::moe_ffn`], each expert's tokens in one product — all on the device, or, where the
//! experts are offloaded ([`ExpertsView`]), those its unit holds on the device and the others
//! on the CPU at the same time, merged on the device.

use super::ports::{ExpertsView, FfnView, LinearView};
use super::scratch::Scratch;
use super::trace::{self, Phase};
use super::{Engine, EngineError, Result};
use crate::backend::{Backend, Experts, Landing, Route};
use crate::model::spec::MoeSpec;

/// The routes of `n` tokens from their router logits (`n × router_rows`): per token a softmax
/// over all routed experts in f32, the top `used` (ties to the lower expert id), their
/// probabilities as weights, renormalised to sum to 1 where `norm_top_k`; then a shared
/// expert's parts (ids `experts ..`), each weighted by the sigmoid of the row's last logit.
/// Routes come token by token, each token's routed experts in descending weight first.
pub fn route(logits: &[f32], n: usize, moe: &MoeSpec) -> Vec<Route> {
    let e = moe.experts;
    let mut routes = Vec::with_capacity(n * (moe.used + moe.shared));
    let mut order: Vec<usize> = Vec::with_capacity(e);
    let mut probs = vec![0f32; e];
    for (t, full) in logits.chunks(moe.router_rows()).take(n).enumerate() {
        let row = &full[..e];
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        for (p, &l) in probs.iter_mut().zip(row) {
            *p = (l - max).exp();
            sum += *p;
        }
        probs.iter_mut().for_each(|p| *p /= sum);
        order.clear();
        order.extend(0..e);
        // Descending probability; a stable sort keeps the lower id first among equals.
        order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));
        let top = &order[..moe.used];
        let total: f32 = if moe.norm_top_k {
            top.iter().map(|&i| probs[i]).sum()
        } else {
            1.0
        };
        routes.extend(top.iter().map(|&i| Route {
            token: t as u32,
            expert: i as u32,
            weight: probs[i] / total,
        }));
        if moe.shared > 0 {
            let gate = 1.0 / (1.0 + (-full[e]).exp());
            routes.extend((e..e + moe.shared).map(|i| Route {
                token: t as u32,
                expert: i as u32,
                weight: gate,
            }));
        }
    }
    routes
}

/// The one weight of a whole, unbiased FFN matrix.
fn whole<'a, B: Backend>(v: &LinearView<'a, B>, what: &str) -> Result<&'a B::Weight> {
    match (v.blocks.as_slice(), v.bias) {
        ([(0, w)], None) => Ok(*w),
        _ => Err(EngineError::Weights(format!(
            "a mixture-of-experts layer's {what} must be one whole matrix without bias here"
        ))),
    }
}

impl<B: Backend> Engine<B> {
    /// `sc.proj` = the experts' FFN of `sc.h` (the normed rows) in layer `l`: from `f`, every
    /// expert on the device, or through `offloaded` (its unit and the CPU).
    pub(super) fn moe_ffn(
        &self,
        l: usize,
        f: &FfnView<B>,
        router: &B::Weight,
        offloaded: Option<&mut ExpertsView<B>>,
        sc: &mut Scratch<B>,
    ) -> Result<()> {
        let moe = self.spec.moe.as_ref().ok_or_else(|| {
            EngineError::Weights(format!("layer {l} has a router, but the model no experts"))
        })?;
        let n = sc.n;
        // The step's FFN activation buffer holds a MoE layer's router logits
        // (`footprint::activation_shapes`).
        let rows = moe.router_rows();
        self.backend.matmul(router, &sc.h, &mut sc.up)?;
        if let Some(x) = offloaded {
            return self.offloaded_moe(l, x, sc);
        }
        let FfnView::Matrices { gate, up, down } = f else {
            return Err(EngineError::Weights(
                "mixture-of-experts layers are computed from whole matrices of experts".into(),
            ));
        };
        let experts = Experts {
            gate: gate.as_ref().map(|g| whole(g, "gate")).transpose()?,
            up: whole(up, "up")?,
            down: whole(down, "down")?,
            width: moe.d_expert,
        };
        let mut host = vec![0f32; n * rows];
        self.backend.read(&sc.up, &mut host)?;
        let routes = self.routes(l, &host, n)?;
        if let Some(tap) = self.route_tap.as_ref().filter(|t| t.wants_ffn_input()) {
            let mut x = vec![0f32; n * self.spec.d_model];
            self.backend.read(&sc.h, &mut x)?;
            tap.ffn_input(l, n, &x);
        }
        self.backend
            .moe_ffn(experts, &sc.h, &routes, self.act, &mut sc.proj)?;
        Ok(())
    }

    /// The routes of a step's `n` rows from their router logits, shown to the route tap.
    fn routes(&self, l: usize, logits: &[f32], n: usize) -> Result<Vec<Route>> {
        let moe = self.spec.moe.as_ref().ok_or_else(|| {
            EngineError::Weights(format!("layer {l} has a router, but the model no experts"))
        })?;
        let routes = route(logits, n, moe);
        if let Some(tap) = &self.route_tap {
            // The router's choices; a shared expert is every token's.
            let routed: Vec<Route> = routes
                .iter()
                .filter(|r| (r.expert as usize) < moe.experts)
                .copied()
                .collect();
            tap.routed(l, n, &routed);
        }
        Ok(routes)
    }

    /// An offloaded layer's experts, the router's logits in `sc.up`, as one graph with one host
    /// wait:
    /// 1. copy device→host: the FFN input, queued (it lands while the logits are read);
    /// 2. host: the logits (the wait), the routes, split between the unit and the rest;
    /// 3. host: the next layer's experts guessed from this input, copies of those its unit lacks
    ///    queued (next-layer prefetch);
    /// 4. device: the unit's experts into `proj`, queued; with mixed precision, the low-ranked
    ///    misses' low-bit copies in, computed and added;
    /// 5. the rest: a prompt's step brings those experts through the stream area and the device
    ///    computes them into the partial sum; otherwise the CPU computes them into it while the
    ///    device runs 4, and the partial sum is copied host→device;
    /// 6. device: `proj += partial`, the merge;
    /// 7. the unit takes in what the policy admits of the misses, copies queued behind.
    fn offloaded_moe(&self, l: usize, x: &mut ExpertsView<B>, sc: &mut Scratch<B>) -> Result<()> {
        let b = &self.backend;
        let (n, d) = b.shape(&sc.h);
        let rows = b.shape(&sc.up).1;
        let mut stage = self.take_stage(sc)?;
        let done = (|| {
            let landing = trace::span(Phase::Landing);
            let input = Landing::start(b, &sc.h, &mut stage)?;
            drop(landing);
            let wait = trace::span(Phase::HostWait);
            let mut logits = vec![0f32; n * rows];
            b.read(&sc.up, &mut logits)?;
            let h = input.wait()?;
            drop(wait);
            let decide = trace::span(Phase::Decide);
            let routes = self.routes(l, &logits, n)?;
            let (device, rest) = x.cache.split(b, &routes)?;
            drop(decide);
            {
                // The next layer's experts guessed from this input: their copies start now,
                // beside this layer's work and the next attention.
                let _s = trace::span(Phase::Decide);
                if let Some(guess) = x.cache.prefetch(b, h, n)?
                    && let Some(tap) = &self.route_tap
                {
                    tap.guessed(l + 1, n, &guess);
                }
            }
            {
                let _s = trace::span(Phase::DeviceNeurons);
                match x.cache.unit() {
                    Some(unit) if !device.is_empty() => {
                        b.moe_ffn(unit, &sc.h, &device, self.act, &mut sc.proj)?
                    }
                    _ => b.zero(&mut sc.proj)?,
                }
            }
            let mut rest = rest;
            if !rest.is_empty() && !x.cache.streams(n) {
                let _s = trace::span(Phase::DeviceNeurons);
                if let Some(low) = x.cache.low_bit(b, &routes, &mut rest, &sc.h, self.act)? {
                    b.add(&mut sc.proj, low)?;
                }
            }
            if !rest.is_empty() {
                b.reshape(x.partial, n, d)?;
                if x.cache.streams(n) {
                    let copy = trace::span(Phase::H2d);
                    let area = x.cache.stream_in(b, &rest)?;
                    drop(copy);
                    let _s = trace::span(Phase::DeviceNeurons);
                    b.moe_ffn(area, &sc.h, &rest, self.act, x.partial)?;
                } else {
                    let mut part = vec![0f32; n * d];
                    {
                        let _s = trace::span(Phase::CpuNeurons);
                        x.cache.cpu_ffn(h, n, &rest, &mut part)?;
                    }
                    let _s = trace::span(Phase::H2d);
                    b.write(x.partial, &part)?;
                }
                let _s = trace::span(Phase::Merge);
                b.add(&mut sc.proj, x.partial)?;
            }
            let _s = trace::span(Phase::Gather);
            x.cache.admit(b, &routes)
        })();
        sc.stage = Some(stage);
        done
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(experts: usize, used: usize, norm_top_k: bool) -> MoeSpec {
        MoeSpec {
            experts,
            used,
            d_expert: 1,
            norm_top_k,
            shared: 0,
        }
    }

    #[test]
    fn top_k_of_the_softmax_ties_to_the_lower_id() {
        // Token 0: experts 1 and 3 lead; token 1: 0, 2 and 3 tie for first.
        let logits = [0.0, 2.0, -1.0, 1.0, 5.0, -3.0, 5.0, 5.0];
        let r = route(&logits, 2, &spec(4, 2, false));
        let ids: Vec<(u32, u32)> = r.iter().map(|r| (r.token, r.expert)).collect();
        assert_eq!(ids, [(0, 1), (0, 3), (1, 0), (1, 2)]);
        // Without renormalising, the weights are the softmax's probabilities.
        let p: Vec<f32> = logits[..4].iter().map(|l| l.exp()).collect();
        let s: f32 = p.iter().sum();
        assert!((r[0].weight - p[1] / s).abs() < 1e-6);
        let r = route(&logits, 2, &spec(4, 2, true));
        assert!((r[0].weight + r[1].weight - 1.0).abs() < 1e-6);
        assert!((r[2].weight - 0.5).abs() < 1e-6);
    }

    #[test]
    fn a_shared_expert_is_every_tokens_by_the_sigmoid_of_its_gate() {
        // 3 routed experts, top 1, and a shared expert in 2 parts; its gate is the 4th logit.
        let moe = MoeSpec {
            shared: 2,
            ..spec(3, 1, false)
        };
        assert_eq!((moe.router_rows(), moe.neurons()), (4, 5));
        let logits = [0.0, 3.0, 1.0, 0.0, 2.0, 0.0, 0.0, -1.5];
        let r = route(&logits, 2, &moe);
        let ids: Vec<(u32, u32)> = r.iter().map(|r| (r.token, r.expert)).collect();
        assert_eq!(ids, [(0, 1), (0, 3), (0, 4), (1, 0), (1, 3), (1, 4)]);
        assert!((r[1].weight - 0.5).abs() < 1e-7 && r[1].weight == r[2].weight);
        let s = 1.0 / (1.0 + 1.5f32.exp());
        assert!((r[4].weight - s).abs() < 1e-7);
    }
}
