//! The suite's plots as SVG (plotters' SVG backend): decode tokens/s against `--gpu-mem` with the
//! bound and the plan's prediction beside ours (and peers as points), and TTFT against prompt
//! length, one line per budget.
//!
//! Why SVG: text in an SVG is a `<text>` element the viewer renders, so drawing needs no font
//! files at run time or in CI (plotters is built without its `ttf` feature and lays text out
//! with its built-in estimate); a PNG would need a rasterizer and a font on the machine.

use plotters::prelude::*;

use super::suite::axes::BudgetPoint;
use super::suite::peers::{PeerReport, PeerStatus};
use super::suite::report::{Cell, Status, SuiteReport};

const SIZE: (u32, u32) = (960, 600);
const PALETTE: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

type Series = (String, RGBColor, Vec<(f64, f64)>, bool);
/// A text placed at a data point.
type Note = (f64, f64, String);

/// Bytes in the unit that suits the axis.
fn unit_for(max_bytes: u64) -> (f64, &'static str) {
    if max_bytes >= 1 << 30 {
        ((1u64 << 30) as f64, "GiB")
    } else if max_bytes >= 1 << 20 {
        ((1u64 << 20) as f64, "MiB")
    } else {
        (1024.0, "KiB")
    }
}

/// A tick label with three significant digits and no trailing zeros.
fn sig(v: f64) -> String {
    if v == 0.0 || !v.is_finite() {
        return format!("{v}");
    }
    let digits = (2 - v.abs().log10().floor() as i32).max(0) as usize;
    let s = format!("{v:.digits$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

fn finite_pos(v: Option<f64>) -> Option<f64> {
    v.filter(|x| x.is_finite() && *x > 0.0)
}

/// A log axis range covering `values` with a margin (never empty or degenerate).
fn log_range(values: impl Iterator<Item = f64>) -> std::ops::Range<f64> {
    let (lo, hi) = values
        .filter(|v| v.is_finite() && *v > 0.0)
        .fold((f64::MAX, f64::MIN), |(l, h), v| (l.min(v), h.max(v)));
    if lo > hi {
        return 0.1..10.0;
    }
    (lo / 2.0)..(hi * 2.0)
}

fn lin_range(values: impl Iterator<Item = f64>) -> std::ops::Range<f64> {
    let (lo, hi) = values
        .filter(|v| v.is_finite())
        .fold((f64::MAX, f64::MIN), |(l, h), v| (l.min(v), h.max(v)));
    if lo > hi {
        return 0.0..1.0;
    }
    let pad = ((hi - lo) * 0.08).max(hi.abs() * 0.05).max(1e-9);
    (lo - pad).max(0.0)..(hi + pad)
}

/// Draw `series` (name, color, points, dashed) on log-y axes; `log_x` for a log x axis.
fn draw(
    title: &str,
    x_desc: &str,
    y_desc: &str,
    series: &[Series],
    notes: &[Note],
    log_x: bool,
) -> Result<String, String> {
    let err = |e: &dyn std::fmt::Debug| format!("plot {title}: {e:?}");
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&e))?;
        let xs = || series.iter().flat_map(|s| s.2.iter().map(|p| p.0));
        let ys = log_range(series.iter().flat_map(|s| s.2.iter().map(|p| p.1)));
        let mut builder = ChartBuilder::on(&root);
        builder
            .caption(title, ("sans-serif", 22))
            .margin(16)
            .x_label_area_size(48)
            .y_label_area_size(80);
        macro_rules! body {
            ($chart:expr) => {{
                let mut chart = $chart;
                chart
                    .configure_mesh()
                    .light_line_style(WHITE)
                    .y_labels(16)
                    .x_desc(x_desc)
                    .y_desc(y_desc)
                    .x_label_formatter(&|v| sig(*v))
                    .y_label_formatter(&|v| sig(*v))
                    .draw()
                    .map_err(|e| err(&e))?;
                let mut any = false;
                for (name, color, pts, dashed) in series {
                    let pts: Vec<(f64, f64)> = pts
                        .iter()
                        .copied()
                        .filter(|p| p.0.is_finite() && p.1.is_finite() && p.1 > 0.0)
                        .collect();
                    if pts.is_empty() {
                        continue;
                    }
                    any = true;
                    let c = *color;
                    let style = c.stroke_width(2);
                    let line: Vec<(f64, f64)> = pts.clone();
                    if *dashed {
                        chart
                            .draw_series(DashedLineSeries::new(line, 8, 5, style))
                            .map_err(|e| err(&e))?
                            .label(name.as_str())
                            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c));
                    } else {
                        chart
                            .draw_series(LineSeries::new(line, style))
                            .map_err(|e| err(&e))?
                            .label(name.as_str())
                            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c));
                    }
                    chart
                        .draw_series(pts.iter().map(|&p| Circle::new(p, 4, c.filled())))
                        .map_err(|e| err(&e))?;
                }
                chart
                    .draw_series(
                        notes
                            .iter()
                            .filter(|n| n.0.is_finite() && n.1.is_finite() && n.1 > 0.0)
                            .map(|n| {
                                Text::new(
                                    n.2.clone(),
                                    (n.0, n.1),
                                    ("sans-serif", 12).into_font().color(&BLACK),
                                )
                            }),
                    )
                    .map_err(|e| err(&e))?;
                if any {
                    chart
                        .configure_series_labels()
                        .position(SeriesLabelPosition::UpperLeft)
                        .background_style(WHITE.mix(0.85))
                        .border_style(BLACK)
                        .draw()
                        .map_err(|e| err(&e))?;
                }
            }};
        }
        if log_x {
            let x = log_range(xs());
            body!(
                builder
                    .build_cartesian_2d(x.log_scale(), ys.log_scale())
                    .map_err(|e| err(&e))?
            );
        } else {
            let x = lin_range(xs());
            body!(
                builder
                    .build_cartesian_2d(x, ys.log_scale())
                    .map_err(|e| err(&e))?
            );
        }
        root.present().map_err(|e| err(&e))?;
    }
    Ok(svg)
}

fn budget_x(b: &BudgetPoint, whole_need: u64, unit: f64) -> f64 {
    b.axis_bytes(whole_need) as f64 / unit
}

fn peer_points(p: &PeerReport, budgets: &[BudgetPoint], whole: u64, unit: f64) -> Vec<(f64, f64)> {
    let mut v: Vec<(f64, f64)> = p
        .runs
        .iter()
        .filter(|r| r.status == PeerStatus::Ok)
        .filter_map(|r| {
            let b = budgets.iter().find(|b| b.label == r.budget)?;
            Some((budget_x(b, whole, unit), finite_pos(r.decode_tokens_per_s)?))
        })
        .collect();
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    v
}

/// Decode tokens/s against `--gpu-mem`: ours, the bound, the plan's prediction, peers.
pub fn decode_svg(r: &SuiteReport) -> Result<String, String> {
    let whole = r.model.whole_gpu_bytes;
    let max = r
        .budgets
        .iter()
        .map(|b| b.axis_bytes(whole))
        .max()
        .unwrap_or(whole);
    let (unit, unit_name) = unit_for(max);
    let pick = |f: &dyn Fn(&Cell) -> Option<f64>| -> Vec<(f64, f64)> {
        let mut v: Vec<(f64, f64)> = r
            .decode
            .iter()
            .filter_map(|c| {
                let b = r.budgets.iter().find(|b| b.label == c.budget)?;
                Some((budget_x(b, whole, unit), finite_pos(f(c))?))
            })
            .collect();
        v.sort_by(|a, b| a.0.total_cmp(&b.0));
        v
    };
    let mut series: Vec<Series> = vec![
        (
            "gpu-offload".into(),
            PALETTE[0],
            pick(&|c| {
                if c.status == Status::Refused {
                    None
                } else {
                    c.tokens_per_s
                }
            }),
            false,
        ),
        (
            "bound".into(),
            PALETTE[3],
            pick(&|c| c.bound_tokens_per_s),
            true,
        ),
        (
            "plan prediction".into(),
            PALETTE[2],
            pick(&|c| c.predicted_tokens_per_s),
            true,
        ),
    ];
    for (i, p) in r.peers.iter().filter(|p| p.ran()).enumerate() {
        series.push((
            p.name.clone(),
            PALETTE[(4 + i) % PALETTE.len()],
            peer_points(p, &r.budgets, whole, unit),
            false,
        ));
    }
    let notes: Vec<Note> = r
        .decode
        .iter()
        .filter_map(|c| {
            let b = r.budgets.iter().find(|b| b.label == c.budget)?;
            let y = finite_pos(c.tokens_per_s).or(finite_pos(c.bound_tokens_per_s))?;
            Some((budget_x(b, whole, unit), y, format!(" {}", c.budget)))
        })
        .collect();
    draw(
        &format!("{}: decode tokens/s by device memory", r.model.name),
        &format!("--gpu-mem ({unit_name}; whole model at its need)"),
        "decode tokens/s (log)",
        &series,
        &notes,
        false,
    )
}

/// TTFT against prompt length, one line per budget.
pub fn ttft_svg(r: &SuiteReport) -> Result<String, String> {
    let series: Vec<Series> = r
        .budgets
        .iter()
        .enumerate()
        .map(|(i, b)| {
            let pts = r
                .prefill
                .iter()
                .filter(|c| c.budget == b.label && c.status != Status::Refused)
                .filter_map(|c| Some((c.prompt_tokens as f64, finite_pos(c.ttft_s)?)))
                .collect();
            (
                format!("--gpu-mem {}", b.label),
                PALETTE[i % PALETTE.len()],
                pts,
                false,
            )
        })
        .collect();
    draw(
        &format!("{}: time to first token by prompt length", r.model.name),
        "prompt tokens (log)",
        "TTFT seconds (log)",
        &series,
        &[],
        true,
    )
}

/// `bench contexts`: p99 TTFT against the number of contexts (the sweep), one line per
/// strategy, the latency target dashed.
pub fn contexts_svg(r: &super::contexts::ContextsReport) -> Result<String, String> {
    let mut series: Vec<Series> = r
        .strategies
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let mut pts: Vec<(f64, f64)> = r
                .sweep
                .iter()
                .filter_map(|p| {
                    let c = p.cells.iter().find(|c| c.strategy == s.strategy)?;
                    Some((p.contexts as f64, finite_pos(c.ttft_p99_s)?))
                })
                .collect();
            if pts.is_empty() {
                // No sweep: the main trace's point.
                pts.extend(finite_pos(s.ttft_s.map(|t| t.p99)).map(|y| (s.contexts as f64, y)));
            }
            (
                s.strategy.name().to_string(),
                PALETTE[i % PALETTE.len()],
                pts,
                false,
            )
        })
        .collect();
    let xs: Vec<f64> = series
        .iter()
        .flat_map(|s| s.2.iter().map(|p| p.0))
        .collect();
    let (lo, hi) = xs
        .iter()
        .fold((f64::MAX, f64::MIN), |(l, h), &x| (l.min(x), h.max(x)));
    if lo <= hi {
        series.push((
            format!("target {} s", sig(r.settings.ttft_target_s)),
            BLACK,
            vec![
                (lo, r.settings.ttft_target_s),
                (hi, r.settings.ttft_target_s),
            ],
            true,
        ));
    }
    draw(
        &format!(
            "{} on {}: p99 TTFT by number of contexts ({} resident)",
            r.model.name, r.device.kind, r.settings.resident
        ),
        "contexts",
        "p99 TTFT seconds (log)",
        &series,
        &[],
        false,
    )
}
