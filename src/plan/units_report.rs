//! A cache-unit plan as `plan --cold gpu` prints it: the units' sizes and precision, each
//! layer's slots, expected loads and neurons read in place, and the bytes per token.

use super::batch;
use super::budget::human_bytes;
use super::hybrid::{predictors_line, step_of};
use super::units::{UnitMode, UnitPlan};
use crate::plan::precision::TIER_ENCODINGS;

impl UnitPlan {
    /// The plan in lines of text.
    pub fn report(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let h = human_bytes;
        let used: Vec<usize> = self.precision.tiers().collect();
        let per: Vec<String> = used
            .iter()
            .map(|&i| format!("{} {}", TIER_ENCODINGS[i].name(), h(self.neuron_bytes[i])))
            .collect();
        let _ = writeln!(
            s,
            "cache units (--cold gpu) at {:.0}% sparsity, neuron precision {}: units of {:.2}× each layer's mean active neurons, per neuron {}",
            self.target * 100.0,
            self.precision,
            self.scale,
            per.join(", ")
        );
        let head: Vec<String> = used
            .iter()
            .map(|&i| format!("{:>6}", TIER_ENCODINGS[i].name()))
            .collect();
        let _ = writeln!(
            s,
            "layer  runs    {}  hot  mean active  expected loads/token  in place/token  device  attention  ms/token",
            head.join(" ")
        );
        for (l, x) in self.layers.iter().enumerate() {
            let k: Vec<String> = used.iter().map(|&i| format!("{:>6}", x.slots[i])).collect();
            let runs = match x.mode {
                UnitMode::Unit => "unit",
                UnitMode::Hybrid => "hybrid",
            };
            let attention = match x.attention_streamed {
                0 => "resident".to_string(),
                b => format!("streams {}", h(b)),
            };
            let _ = writeln!(
                s,
                "{l:>5}  {runs:<6}  {}  {:>3}  {:>11.1}  {:>19.1}  {:>14.1}  {:>6}  {attention:>9}  {:>8.3}",
                k.join(" "),
                x.hot,
                x.mean_active,
                x.expected_loads,
                x.expected_in_place,
                h(x.device_bytes),
                x.seconds * 1e3
            );
        }
        if let Some(line) = predictors_line(self.predictors.as_deref()) {
            let _ = writeln!(s, "{line}");
        }
        let d = &self.device;
        let hybrid_layers = self
            .layers
            .iter()
            .filter(|l| l.mode == UnitMode::Hybrid)
            .count();
        if hybrid_layers > 0 {
            let _ = writeln!(
                s,
                "{hybrid_layers} of {} layers hybrid (hot neurons resident, the CPU computes the rest): faster than a unit there",
                self.layers.len()
            );
        }
        if let Some(base) = &self.base_plan {
            let streaming = self
                .layers
                .iter()
                .filter(|l| l.attention_streamed > 0)
                .count();
            let _ = writeln!(
                s,
                "attention streams beside the units in {streaming} of {} layers: {} of each layer resident, {} streamed per token through {} slots ({}); {} kept for the units",
                self.layers.len(),
                h(base.resident_bytes_per_layer),
                h(base.streamed_bytes_per_layer),
                base.window,
                h(base.gpu.slots),
                h(base.budget.unit_reserve.unwrap_or(0))
            );
        }
        let _ = writeln!(
            s,
            "device {} (attention {}, units {}, staging {}, hybrid layers {}), neurons in DRAM {}",
            h(d.total),
            h(d.attention),
            h(d.units),
            h(d.staging),
            h(d.hybrid),
            h(self.dram_neurons)
        );
        let p = &self.per_token;
        let _ = writeln!(
            s,
            "per {}: device reads {}, CPU reads {} from DRAM ({}; the misses units bring in gathered), PCIe {}; predicted {}",
            step_of(self.sequences),
            h(p.hbm_bytes),
            h(p.cpu_bytes),
            match (self.predictors.is_some(), p.cpu_bytes) {
                (true, _) => "the predictors",
                (false, 0) => "none: the device decides",
                (false, _) => "deciding vectors",
            },
            h(p.pcie_bytes),
            batch::speed(self.predicted_tokens_per_s, self.sequences)
        );
        s
    }
}
