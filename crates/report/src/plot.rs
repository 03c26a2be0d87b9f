//! The progress plot: reward mean and eval accuracy against training step (left panel) and
//! wall time (right panel), with a title, a legend and labelled axes, as one PNG.
//!
//! Reward is read on each panel's left axis; accuracy, in percent, on its right axis. When every
//! reward lies in [0, 1] both axes share one grid (0–1 and 0–100 %). Phase changes (`sft` →
//! `rl`) are dashed vertical lines. Rendering is deterministic: the same records give the same
//! bytes.

use std::path::Path;

use crate::axis::Axis;
use crate::diagnostics::{self, DiagnosticsPanel};
use crate::error::ReportError;
use crate::image::{Image, Rgb, text_height, text_width};
use crate::log::StepRecord;
use crate::panel::{Frame, Panel};

/// The plot's file name inside a run's output dir.
pub const PLOT_FILE: &str = "progress.png";
/// Colour of the reward line (blue).
pub const REWARD_COLOUR: Rgb = Rgb(31, 119, 180);
/// Colour of the accuracy line and its points (orange; blue and orange stay apart for
/// colour-blind readers).
pub const ACCURACY_COLOUR: Rgb = Rgb(230, 97, 1);
/// Colours of the per-domain accuracy lines (thin), in the order the domains first appear.
const DOMAIN_COLOURS: [Rgb; 4] = [
    Rgb(44, 160, 44),
    Rgb(148, 103, 189),
    Rgb(140, 86, 75),
    Rgb(127, 127, 127),
];

/// The `extra` key of a domain's held-out accuracy in `metrics.jsonl`.
pub const DOMAIN_ACCURACY_PREFIX: &str = "eval_accuracy.";

/// The colour of the line of the `i`-th domain (in first-appearance order in the log).
pub fn domain_colour(i: usize) -> Rgb {
    DOMAIN_COLOURS[i % DOMAIN_COLOURS.len()]
}

/// The domains with their own accuracy in `records`, in first-appearance order.
pub(crate) fn eval_domains(records: &[StepRecord]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for r in records {
        for key in r.extra.keys() {
            if let Some(d) = key.strip_prefix(DOMAIN_ACCURACY_PREFIX)
                && !out.iter().any(|o| o == d)
            {
                out.push(d.to_owned());
            }
        }
    }
    out
}
const TITLE: Rgb = Rgb(20, 20, 20);
const LEGEND_TEXT: Rgb = Rgb(40, 40, 40);

/// Size and title of the plot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlotOptions {
    /// Width in pixels (at least 320).
    pub width: u32,
    /// Height in pixels (at least 200).
    pub height: u32,
    /// Title at the top left; `None` summarises the run (last step, wall time, last eval).
    pub title: Option<String>,
}

impl Default for PlotOptions {
    fn default() -> Self {
        Self {
            width: 960,
            height: 540,
            title: None,
        }
    }
}

/// Which panel of the plot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PanelKind {
    /// Against training step (left).
    Step,
    /// Against wall time (right).
    WallTime,
}

/// Which series of a panel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Series {
    /// `reward_mean`, on the left axis.
    Reward,
    /// `eval_accuracy` in percent, on the right axis.
    Accuracy,
}

/// A rendered plot, with where each record's points were drawn.
#[derive(Debug, Clone)]
pub struct RunPlot {
    image: Image,
    panels: [Panel; 2],
    /// The second row (lengths, group times, mismatch), when the log has its keys.
    diagnostics: Option<[DiagnosticsPanel; 3]>,
}

impl RunPlot {
    /// The picture.
    pub fn image(&self) -> &Image {
        &self.image
    }

    /// The pixel at which `record`'s value of `series` is drawn in `panel`, or `None` when the
    /// record has no finite value there (no eval at that step, a NaN reward).
    pub fn point(
        &self,
        panel: PanelKind,
        series: Series,
        record: &StepRecord,
    ) -> Option<(i32, i32)> {
        let panel = &self.panels[match panel {
            PanelKind::Step => 0,
            PanelKind::WallTime => 1,
        }];
        match series {
            Series::Reward => panel.reward_point(record),
            Series::Accuracy => panel.accuracy_point(record),
        }
    }

    /// The pixel at which `record`'s accuracy on `domain` is drawn in `panel`, if the record
    /// has one.
    pub fn domain_point(
        &self,
        panel: PanelKind,
        domain: &str,
        record: &StepRecord,
    ) -> Option<(i32, i32)> {
        let panel = &self.panels[match panel {
            PanelKind::Step => 0,
            PanelKind::WallTime => 1,
        }];
        panel.domain_point(domain, record)
    }

    /// The pixel at which `record`'s value of a second-row key (`sluice_report::keys`:
    /// lengths, length bias, group times, truncation, mismatch) is drawn, if the plot has the row and the record the key.
    pub fn diagnostic_point(&self, key: &str, record: &StepRecord) -> Option<(i32, i32)> {
        self.diagnostics
            .as_ref()?
            .iter()
            .find_map(|p| p.point(key, record))
    }
}

/// Renders the default-sized plot of `records` and writes it to `path` as PNG.
pub fn plot_run(records: &[StepRecord], path: impl AsRef<Path>) -> Result<(), ReportError> {
    render_run(records, &PlotOptions::default())
        .image
        .write_png(path)
}

/// Renders the plot of `records` (in log order) without writing it.
pub fn render_run(records: &[StepRecord], options: &PlotOptions) -> RunPlot {
    let (width, height) = (options.width.max(320), options.height.max(200));
    let s: u32 = if width >= 640 && height >= 360 { 2 } else { 1 };
    let si = s as i32;
    let gap = 5 * si;
    let th = text_height(s);
    let mut image = Image::new(width, height, Rgb::WHITE);

    let title = options
        .title
        .clone()
        .unwrap_or_else(|| default_title(records));
    image.text((gap, gap), &title, TITLE, s);
    let legend = legend(records);
    let legend_width = legend_width(&legend, s);
    let (legend_x, legend_y) =
        if gap + text_width(&title, s) + 4 * gap + legend_width <= width as i32 - gap {
            (width as i32 - gap - legend_width, gap)
        } else {
            (gap, 2 * gap + th)
        };
    draw_legend(&mut image, &legend, (legend_x, legend_y), s);

    // Vertical layout: header rows, the axis names above each frame, then below each frame the
    // tick marks, tick labels and the x axis name.
    let top = legend_y + th + 2 * gap + th + gap;
    let below = 2 * si + 2 * si + th + gap + th + gap;
    let full_bottom = height as i32 - below;
    // The second row, when wanted, takes the lower two fifths below its own labels.
    let second_row = diagnostics::wanted(records);
    let (bottom, row2) = if second_row {
        let row1 = top + (full_bottom - top - below - th - 2 * gap) * 3 / 5;
        (row1, (row1 + below + th + 2 * gap, full_bottom))
    } else {
        (full_bottom, (0, 0))
    };
    let reward = reward_axis(records, ((bottom - top) / (25 * si)).clamp(2, 8) as usize);
    let accuracy = Axis::fixed(0.0, 100.0, 20.0);
    let reward_label_width = reward
        .ticks
        .iter()
        .map(|&t| text_width(&reward.label(t), s))
        .max()
        .unwrap_or(0);
    let accuracy_label_width = text_width("100%", s);

    let half = width as i32 / 2;
    let panels = [PanelKind::Step, PanelKind::WallTime].map(|kind| {
        let span = match kind {
            PanelKind::Step => (0, half),
            PanelKind::WallTime => (half, width as i32),
        };
        let frame = Frame {
            left: span.0 + gap + reward_label_width + 4 * si,
            top,
            right: span.1 - gap - accuracy_label_width - 4 * si,
            bottom,
        };
        Panel::new(kind, records, frame, (reward.clone(), accuracy.clone()), s)
    });
    for (panel, span, name) in [
        (&panels[0], (0, half), "by step"),
        (&panels[1], (half, width as i32), "by wall time"),
    ] {
        panel.draw_axes(&mut image, name, span);
        if records.is_empty() {
            panel.draw_message(&mut image, "no steps logged yet");
        }
        panel.draw_series(&mut image, records);
    }
    let diagnostics = second_row.then(|| {
        let third = width as i32 / 3;
        let panels = [0, 1, 2].map(|i| {
            let span = (i * third, (i + 1) * third);
            let frame = Frame {
                left: span.0 + gap + reward_label_width + 4 * si,
                top: row2.0,
                right: span.1 - gap - accuracy_label_width - 4 * si,
                bottom: row2.1,
            };
            DiagnosticsPanel::new(diagnostics::ROW[i as usize], records, frame, s)
        });
        for p in &panels {
            p.draw(&mut image, records);
        }
        panels
    });
    RunPlot {
        image,
        panels,
        diagnostics,
    }
}

/// [0, 1] when every reward fits (sharing the accuracy grid), else a padded nice range.
fn reward_axis(records: &[StepRecord], target: usize) -> Axis {
    let rewards = records
        .iter()
        .map(|r| r.reward_mean)
        .filter(|r| r.is_finite());
    let (lo, hi) = rewards.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), r| {
        (lo.min(r), hi.max(r))
    });
    if lo > hi || (lo >= 0.0 && hi <= 1.0) {
        return Axis::fixed(0.0, 1.0, 0.2);
    }
    // A little room keeps the extreme points off the frame.
    let pad = (hi - lo) * 0.03;
    Axis::nice(lo - pad, hi + pad, target, 0.0)
}

fn default_title(records: &[StepRecord]) -> String {
    let Some(last) = records.last() else {
        return "sluice run".to_string();
    };
    let mut title = format!("sluice run: step {}", last.step);
    if last.wall_s.is_finite() {
        title.push_str(&format!(", {}", format_duration(last.wall_s)));
    }
    let last_eval = records
        .iter()
        .rev()
        .find_map(|r| r.eval_accuracy.filter(|a| a.is_finite()));
    if let Some(accuracy) = last_eval {
        title.push_str(&format!(", eval {:.1}%", accuracy * 100.0));
    }
    title
}

fn format_duration(seconds: f64) -> String {
    if seconds < 120.0 {
        format!("{seconds:.0} s")
    } else if seconds < 3.0 * 3600.0 {
        format!("{:.1} min", seconds / 60.0)
    } else {
        format!("{:.1} h", seconds / 3600.0)
    }
}

const LEGEND: [(&str, Rgb, bool); 2] = [
    ("reward mean", REWARD_COLOUR, false),
    ("eval accuracy", ACCURACY_COLOUR, true),
];

/// The legend: reward, accuracy (the mean over domains when there are several), then each
/// domain's accuracy line.
fn legend(records: &[StepRecord]) -> Vec<(String, Rgb, bool)> {
    let mut out: Vec<(String, Rgb, bool)> = LEGEND
        .iter()
        .map(|&(label, colour, marked)| (label.to_owned(), colour, marked))
        .collect();
    for (i, domain) in eval_domains(records).iter().enumerate() {
        out.push((domain.clone(), domain_colour(i), false));
    }
    out
}

/// Sample stroke, gap, label, and a wider gap between entries.
fn legend_width(legend: &[(String, Rgb, bool)], s: u32) -> i32 {
    let si = s as i32;
    legend
        .iter()
        .map(|(label, _, _)| 12 * si + 3 * si + text_width(label, s))
        .sum::<i32>()
        + 8 * si
}

fn draw_legend(image: &mut Image, legend: &[(String, Rgb, bool)], (x, y): (i32, i32), s: u32) {
    let si = s as i32;
    let mid = y + text_height(s) / 2;
    let mut x = x;
    for (label, colour, marked) in legend {
        let (colour, marked) = (*colour, *marked);
        image.fill_rect(x, mid - si / 2, 12 * si, si, colour);
        if marked {
            image.fill_disc((x + 6 * si, mid), 2 * s, colour);
        }
        x += 12 * si + 3 * si;
        x += image.text((x, y), label, LEGEND_TEXT, s) + 8 * si;
    }
}
