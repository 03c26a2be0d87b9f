//! The plot's second row, drawn when the log has its keys ([`crate::keys`]): response lengths
//! (generated and trained means in tokens on the left axis, the length bias on the right)
//! and the train/inference mismatch (mean |Δ logprob| on the left axis, the k3 KL on the right),
//! both against training step. A log without those keys keeps the one-row plot.

use crate::axis::Axis;
use crate::image::{Image, Rgb, text_height, text_width};
use crate::keys as k;
use crate::log::StepRecord;
use crate::panel::{FRAME, Frame, GRID, TEXT};

/// One line of a diagnostics panel: the log key it draws, its legend label and colour.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Line {
    key: &'static str,
    label: &'static str,
    colour: Rgb,
}

/// What one diagnostics panel draws: lines on its left axis and on its right axis.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PanelSpec {
    title: &'static str,
    left: &'static [Line],
    right: &'static [Line],
}

/// Response lengths and the length bias.
pub(crate) const LENGTHS: PanelSpec = PanelSpec {
    title: "response tokens",
    left: &[
        Line {
            key: k::LENGTH_GENERATED_MEAN,
            label: "generated",
            colour: Rgb(31, 119, 180),
        },
        Line {
            key: k::LENGTH_TRAINED_MEAN,
            label: "trained",
            colour: Rgb(44, 160, 44),
        },
    ],
    right: &[Line {
        key: k::LENGTH_BIAS,
        label: "bias",
        colour: Rgb(214, 39, 40),
    }],
};

/// The train/inference mismatch.
pub(crate) const MISMATCH: PanelSpec = PanelSpec {
    title: "mismatch (nats)",
    left: &[Line {
        key: k::MISMATCH_LOGPROB_ABS_MEAN,
        label: "|dlogp| mean",
        colour: Rgb(148, 103, 189),
    }],
    right: &[Line {
        key: k::MISMATCH_KL,
        label: "KL",
        colour: Rgb(230, 97, 1),
    }],
};

/// Group time from admission to stored, its engine/env split, and truncation.
pub(crate) const TIMES: PanelSpec = PanelSpec {
    title: "group time (s)",
    left: &[
        Line {
            key: k::TIME_GROUP_SECONDS,
            label: "group",
            colour: Rgb(31, 119, 180),
        },
        Line {
            key: k::TIME_ENGINE_SECONDS,
            label: "engine",
            colour: Rgb(44, 160, 44),
        },
        Line {
            key: k::TIME_ENV_SECONDS,
            label: "env",
            colour: Rgb(255, 127, 14),
        },
    ],
    right: &[Line {
        key: k::TRUNCATED_RATIO,
        label: "truncated",
        colour: Rgb(214, 39, 40),
    }],
};

/// The second row's panels, left to right.
pub(crate) const ROW: [PanelSpec; 3] = [LENGTHS, TIMES, MISMATCH];

/// Whether `records` have anything for the second row.
pub(crate) fn wanted(records: &[StepRecord]) -> bool {
    records.iter().any(|r| {
        ROW.iter()
            .flat_map(|p| p.left.iter().chain(p.right))
            .any(|l| r.extra.contains_key(l.key))
    })
}

fn values<'a>(records: &'a [StepRecord], lines: &'a [Line]) -> impl Iterator<Item = f64> + 'a {
    records
        .iter()
        .flat_map(move |r| lines.iter().filter_map(|l| r.extra.get(l.key).copied()))
        .filter(|v| v.is_finite())
}

/// An axis over the lines' values, 0 included (a bias is read against it).
fn value_axis(records: &[StepRecord], lines: &[Line]) -> Axis {
    let (lo, hi) = values(records, lines).fold((0.0f64, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    Axis::nice(lo, hi, 4, 0.0)
}

/// A laid-out diagnostics panel.
#[derive(Debug, Clone)]
pub(crate) struct DiagnosticsPanel {
    spec: PanelSpec,
    frame: Frame,
    x: Axis,
    left: Axis,
    right: Axis,
    scale: u32,
}

impl DiagnosticsPanel {
    /// Lays out `spec` in `frame` with the x axis of the run's steps.
    pub fn new(spec: PanelSpec, records: &[StepRecord], frame: Frame, scale: u32) -> Self {
        let steps = records.iter().map(|r| r.step as f64);
        let (lo, hi) = steps.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), s| {
            (lo.min(s), hi.max(s))
        });
        Self {
            left: value_axis(records, spec.left),
            right: value_axis(records, spec.right),
            x: Axis::nice(lo, hi, 4, 1.0),
            spec,
            frame,
            scale,
        }
    }

    fn pixel(&self, x: f64, fraction: f64) -> (i32, i32) {
        self.frame.pixel(self.x.fraction(x), fraction)
    }

    /// Where `record`'s value of `key` (on the left axis, else the right) is drawn.
    pub fn point(&self, key: &str, record: &StepRecord) -> Option<(i32, i32)> {
        let v = record.extra.get(key).copied().filter(|v| v.is_finite())?;
        let axis = if self.spec.left.iter().any(|l| l.key == key) {
            &self.left
        } else if self.spec.right.iter().any(|l| l.key == key) {
            &self.right
        } else {
            return None;
        };
        Some(self.pixel(record.step as f64, axis.fraction(v)))
    }

    /// Draws the grid, frame, ticks, the title with its legend, and the lines.
    pub fn draw(&self, image: &mut Image, records: &[StepRecord]) {
        let s = self.scale;
        let si = s as i32;
        let Frame {
            left,
            top,
            right,
            bottom,
        } = self.frame;
        let (tick, half) = (2 * si, text_height(s) / 2);
        let colour_of = |lines: &[Line]| lines.first().map_or(TEXT, |l| l.colour);
        for &t in &self.left.ticks {
            let (_, y) = self.pixel(self.x.lo, self.left.fraction(t));
            image.fill_rect(left, y, right - left, 1, GRID);
            let label = self.left.label(t);
            let w = text_width(&label, s);
            let at = (left - tick - 2 * si - w, y - half);
            image.text(at, &label, colour_of(self.spec.left), s);
        }
        for &t in &self.right.ticks {
            let (_, y) = self.pixel(self.x.lo, self.right.fraction(t));
            image.fill_rect(right + 1, y, tick, 1, FRAME);
            let label = self.right.label(t);
            image.text(
                (right + tick + 2 * si, y - half),
                &label,
                colour_of(self.spec.right),
                s,
            );
        }
        for &t in &self.x.ticks {
            let (x, _) = self.pixel(t, 0.0);
            image.fill_rect(x, top, 1, bottom - top, GRID);
            let label = self.x.label(t);
            let y = bottom + tick + 2 * si;
            image.text((x - text_width(&label, s) / 2, y), &label, TEXT, s);
        }
        image.fill_rect(left, top, right - left + 1, 1, FRAME);
        image.fill_rect(left, bottom, right - left + 1, 1, FRAME);
        image.fill_rect(left, top, 1, bottom - top + 1, FRAME);
        image.fill_rect(right, top, 1, bottom - top + 1, FRAME);
        // Title and legend on one line above the frame.
        let mut x = left;
        let head_y = top - 5 * si - text_height(s);
        x += image.text((x, head_y), self.spec.title, TEXT, s) + 6 * si;
        for line in self.spec.left.iter().chain(self.spec.right) {
            let mid = head_y + half;
            image.fill_rect(x, mid - si / 2, 8 * si, si, line.colour);
            x += 10 * si;
            x += image.text((x, head_y), line.label, line.colour, s) + 5 * si;
        }
        for line in self.spec.left.iter().chain(self.spec.right) {
            let points: Vec<(i32, i32)> = records
                .iter()
                .filter_map(|r| self.point(line.key, r))
                .collect();
            for pair in points.windows(2) {
                image.line(pair[0], pair[1], line.colour, s);
            }
            if let [only] = points.as_slice() {
                image.fill_disc(*only, 2 * s, line.colour);
            }
        }
    }
}
