//! The suite's two axes: the `--gpu-mem` budgets ([`BudgetPoint`], the default list, `--budgets`
//! parsing and [`select_budgets`], which keeps those between the plan's minimum and the whole
//! model) and the prompt lengths (`--prompts`). Pure data: loads and runs nothing.

use serde::Serialize;

use crate::plan::human_bytes;

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct BudgetPoint {
    /// "whole", "24.0 GiB", "min 420.3 KiB", …
    pub label: String,
    /// `None`: no budget, everything resident.
    pub gpu_mem_bytes: Option<u64>,
}

impl BudgetPoint {
    pub fn whole() -> Self {
        BudgetPoint {
            label: "whole".into(),
            gpu_mem_bytes: None,
        }
    }

    /// Where the point sits on a memory axis: its budget, or what the whole model needs.
    pub fn axis_bytes(&self, whole_need: u64) -> u64 {
        self.gpu_mem_bytes.unwrap_or(whole_need)
    }
}

/// One entry of `--budgets`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BudgetChoice {
    /// No budget: everything resident.
    Whole,
    /// The smallest budget the plan accepts.
    Min,
    Bytes(u64),
}

/// The fixed budgets the suite tries by default (kept when between the minimum and the whole
/// model's need).
pub const DEFAULT_BUDGETS: [u64; 4] = [24 << 30, 12 << 30, 8 << 30, 4 << 30];

/// `whole,24G,12G,min` → choices; sizes parsed by `size` (the CLI's `--gpu-mem` parser).
pub fn parse_budget_list(
    s: &str,
    size: impl Fn(&str) -> Result<u64, String>,
) -> Result<Vec<BudgetChoice>, String> {
    let mut out = Vec::new();
    for item in s.split(',').map(str::trim) {
        if item.is_empty() {
            return Err(format!("`{s}`: empty entry in the budget list"));
        }
        out.push(match item.to_ascii_lowercase().as_str() {
            "whole" => BudgetChoice::Whole,
            "min" => BudgetChoice::Min,
            _ => BudgetChoice::Bytes(size(item).map_err(|e| {
                format!("budget list `{s}`: {e} (entries are sizes, `whole` or `min`)")
            })?),
        });
    }
    Ok(out)
}

/// `128,2048` → prompt lengths (positive).
pub fn parse_prompt_list(s: &str) -> Result<Vec<usize>, String> {
    s.split(',')
        .map(str::trim)
        .map(|p| match p.parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(format!(
                "prompt list `{s}`: `{p}` is not a positive number of tokens"
            )),
        })
        .collect()
}

/// The budget axis, largest first. Default: whole, 24G, 12G, 8G, 4G and the minimum, keeping
/// the sizes below `whole_need` and at least `minimum`, with the midpoint of minimum and whole
/// added when that leaves no size between them. `explicit` (`--budgets`) replaces the list;
/// `cap` (an emulated card's memory) drops every budget above it, and the whole model when it
/// needs more. Returns the points and notes on what was dropped.
pub fn select_budgets(
    explicit: Option<&[BudgetChoice]>,
    whole_need: u64,
    minimum: u64,
    cap: Option<u64>,
) -> (Vec<BudgetPoint>, Vec<String>) {
    let mut notes = Vec::new();
    let mut sizes: Vec<(u64, String)> = Vec::new();
    let mut whole = false;
    match explicit {
        Some(list) => {
            for c in list {
                match *c {
                    BudgetChoice::Whole => whole = true,
                    BudgetChoice::Min => {
                        sizes.push((minimum, format!("min {}", human_bytes(minimum))))
                    }
                    BudgetChoice::Bytes(b) => sizes.push((b, human_bytes(b))),
                }
            }
        }
        None => {
            whole = true;
            for b in DEFAULT_BUDGETS {
                if b < whole_need && b >= minimum {
                    sizes.push((b, human_bytes(b)));
                }
            }
            if minimum < whole_need {
                if sizes.is_empty() {
                    let mid = minimum + (whole_need - minimum) / 2;
                    sizes.push((mid, format!("mid {}", human_bytes(mid))));
                }
                sizes.push((minimum, format!("min {}", human_bytes(minimum))));
            }
        }
    }
    if let Some(cap) = cap {
        if whole && whole_need > cap {
            whole = false;
            notes.push(format!(
                "the whole model needs {} of device memory, more than the emulated card's {}: no whole-model run",
                human_bytes(whole_need),
                human_bytes(cap)
            ));
        }
        let before = sizes.len();
        sizes.retain(|(b, _)| *b <= cap);
        if sizes.len() < before {
            notes.push(format!(
                "{} budget(s) above the emulated card's {} dropped",
                before - sizes.len(),
                human_bytes(cap)
            ));
        }
    }
    sizes.sort_by_key(|s| std::cmp::Reverse(s.0));
    sizes.dedup_by_key(|s| s.0);
    let mut points = Vec::new();
    if whole {
        points.push(BudgetPoint::whole());
    }
    points.extend(sizes.into_iter().map(|(b, label)| BudgetPoint {
        label,
        gpu_mem_bytes: Some(b),
    }));
    (points, notes)
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = 1 << 30;

    fn gib(s: &str) -> Result<u64, String> {
        s.strip_suffix('G')
            .and_then(|n| n.parse::<u64>().ok())
            .map(|n| n << 30)
            .ok_or_else(|| format!("`{s}` is not a size"))
    }

    fn sizes(p: &[BudgetPoint]) -> Vec<Option<u64>> {
        p.iter().map(|b| b.gpu_mem_bytes).collect()
    }

    #[test]
    fn default_budgets_lie_between_the_minimum_and_the_whole_model() {
        let (p, _) = select_budgets(None, 14 * G, 3 * G, None);
        assert_eq!(
            sizes(&p),
            [None, Some(12 * G), Some(8 * G), Some(4 * G), Some(3 * G)]
        );
        assert_eq!(p[0].label, "whole");
        assert!(p[4].label.starts_with("min"));
    }

    #[test]
    fn a_tiny_model_gets_the_midpoint() {
        let (p, _) = select_budgets(None, 600_000, 400_000, None);
        assert_eq!(sizes(&p), [None, Some(500_000), Some(400_000)]);
        assert!(p[1].label.starts_with("mid"));
    }

    #[test]
    fn an_emulated_card_caps_the_budgets() {
        let (p, notes) = select_budgets(None, 30 * G, 3 * G, Some(12 * G));
        assert_eq!(
            sizes(&p),
            [Some(12 * G), Some(8 * G), Some(4 * G), Some(3 * G)]
        );
        assert!(
            notes.iter().any(|n| n.contains("no whole-model run")),
            "{notes:?}"
        );
        let list = parse_budget_list("whole,24G,min", gib).unwrap();
        let (p, _) = select_budgets(Some(&list), 10 * G, 2 * G, Some(12 * G));
        assert_eq!(sizes(&p), [None, Some(2 * G)]);
    }

    #[test]
    fn budget_and_prompt_lists_parse_or_say_why_not() {
        assert_eq!(
            parse_budget_list("whole, 4G ,min", gib).unwrap(),
            [
                BudgetChoice::Whole,
                BudgetChoice::Bytes(4 * G),
                BudgetChoice::Min
            ]
        );
        assert!(
            parse_budget_list("4G,lots", gib)
                .unwrap_err()
                .contains("lots")
        );
        assert!(parse_budget_list("4G,,min", gib).is_err());
        assert_eq!(parse_prompt_list("16,64").unwrap(), [16, 64]);
        assert!(parse_prompt_list("16,0").is_err());
        assert!(parse_prompt_list("x").is_err());
    }
}
