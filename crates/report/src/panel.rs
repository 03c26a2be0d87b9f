//! One panel of the progress plot: a frame with reward on the left axis, eval accuracy (in
//! percent) on the right axis, and either the training step or the wall time along the bottom.

use crate::axis::Axis;
use crate::font::ADVANCE;
use crate::image::Rgb;
use crate::image::{Image, text_height, text_width};
use crate::log::StepRecord;
use crate::plot::{
    ACCURACY_COLOUR, DOMAIN_ACCURACY_PREFIX, PanelKind, REWARD_COLOUR, domain_colour, eval_domains,
};

pub(crate) const TEXT: Rgb = Rgb(40, 40, 40);
pub(crate) const GRID: Rgb = Rgb(232, 232, 232);
pub(crate) const FRAME: Rgb = Rgb(120, 120, 120);
const PHASE: Rgb = Rgb(140, 140, 140);

/// The plotting area of a panel, in pixels; data is drawn inside, labels outside.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Frame {
    pub left: i32,
    pub top: i32,
    pub right: i32,
    pub bottom: i32,
}

impl Frame {
    /// The pixel `fx` of the way across and `fy` of the way up (each clamped to [0, 1]).
    pub fn pixel(&self, fx: f64, fy: f64) -> (i32, i32) {
        let px = f64::from(self.left) + fx.clamp(0.0, 1.0) * f64::from(self.right - self.left);
        let py = f64::from(self.bottom) - fy.clamp(0.0, 1.0) * f64::from(self.bottom - self.top);
        (px.round() as i32, py.round() as i32)
    }
}

/// A laid-out panel: where its frame is and what its axes span.
#[derive(Debug, Clone)]
pub(crate) struct Panel {
    pub kind: PanelKind,
    pub frame: Frame,
    pub x: Axis,
    /// Wall seconds per x unit (1 for the step panel).
    x_unit_s: f64,
    x_name: &'static str,
    pub reward: Axis,
    pub accuracy: Axis,
    scale: u32,
}

impl Panel {
    /// Lays out a panel; the x axis gets as many ticks as its labels have room for.
    pub fn new(
        kind: PanelKind,
        records: &[StepRecord],
        frame: Frame,
        y: (Axis, Axis),
        scale: u32,
    ) -> Self {
        let (x_unit_s, x_name) = match kind {
            PanelKind::Step => (1.0, "step"),
            PanelKind::WallTime => wall_unit(records),
        };
        let mut panel = Self {
            kind,
            frame,
            x: Axis::nice(f64::NAN, f64::NAN, 1, 1.0),
            x_unit_s,
            x_name,
            reward: y.0,
            accuracy: y.1,
            scale,
        };
        let xs = records.iter().filter_map(|r| panel.x_value(r));
        let (lo, hi) = xs.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| {
            (lo.min(x), hi.max(x))
        });
        let min_step = if kind == PanelKind::Step { 1.0 } else { 0.0 };
        let width = f64::from(frame.right - frame.left);
        let room = 3 * (ADVANCE * scale) as i32;
        panel.x = (1..=8)
            .rev()
            .map(|target| Axis::nice(lo, hi, target, min_step))
            .find(|axis| {
                let widest = axis
                    .ticks
                    .iter()
                    .map(|&t| text_width(&axis.label(t), scale))
                    .max()
                    .unwrap_or(0);
                let spacing = axis.step / (axis.hi - axis.lo) * width;
                f64::from(widest + room) <= spacing
            })
            .unwrap_or_else(|| Axis::nice(lo, hi, 1, min_step));
        panel
    }

    /// The record's position along the x axis, if it has a finite one.
    fn x_value(&self, record: &StepRecord) -> Option<f64> {
        let x = match self.kind {
            PanelKind::Step => record.step as f64,
            PanelKind::WallTime => record.wall_s / self.x_unit_s,
        };
        x.is_finite().then_some(x)
    }

    /// The pixel of `x` on the x axis and `y_fraction` of the way up the frame (clamped to it).
    fn pixel(&self, x: f64, y_fraction: f64) -> (i32, i32) {
        self.frame.pixel(self.x.fraction(x), y_fraction)
    }

    /// Where the record's reward is drawn, if it has a finite reward and x.
    pub fn reward_point(&self, record: &StepRecord) -> Option<(i32, i32)> {
        let x = self.x_value(record)?;
        let y = Some(record.reward_mean).filter(|r| r.is_finite())?;
        Some(self.pixel(x, self.reward.fraction(y)))
    }

    /// Where the record's eval accuracy is drawn, if it was evaluated.
    pub fn accuracy_point(&self, record: &StepRecord) -> Option<(i32, i32)> {
        let x = self.x_value(record)?;
        let accuracy = record.eval_accuracy.filter(|a| a.is_finite())?;
        Some(self.pixel(x, self.accuracy.fraction(accuracy * 100.0)))
    }

    /// Where the record's accuracy on `domain` (`eval_accuracy.<domain>`) is drawn, if it has one.
    pub fn domain_point(&self, domain: &str, record: &StepRecord) -> Option<(i32, i32)> {
        let x = self.x_value(record)?;
        let key = format!("{DOMAIN_ACCURACY_PREFIX}{domain}");
        let accuracy = record.extra.get(&key).copied().filter(|a| a.is_finite())?;
        Some(self.pixel(x, self.accuracy.fraction(accuracy * 100.0)))
    }

    /// Draws grid, frame, ticks, tick labels, axis names and the panel title; `span` is the
    /// panel's horizontal extent including margins.
    pub fn draw_axes(&self, image: &mut Image, title: &str, span: (i32, i32)) {
        let s = self.scale;
        let Frame {
            left,
            top,
            right,
            bottom,
        } = self.frame;
        let tick = 2 * s as i32;
        let half_text = text_height(s) / 2;
        for &t in &self.reward.ticks {
            let (_, y) = self.pixel(self.x.lo, self.reward.fraction(t));
            image.fill_rect(left, y, right - left, 1, GRID);
            image.fill_rect(left - tick, y, tick, 1, FRAME);
            let label = self.reward.label(t);
            let w = text_width(&label, s);
            image.text(
                (left - tick - s as i32 * 2 - w, y - half_text),
                &label,
                REWARD_COLOUR,
                s,
            );
        }
        for &t in &self.accuracy.ticks {
            let (_, y) = self.pixel(self.x.lo, self.accuracy.fraction(t));
            image.fill_rect(right + 1, y, tick, 1, FRAME);
            let label = format!("{}%", self.accuracy.label(t));
            image.text(
                (right + tick + s as i32 * 2, y - half_text),
                &label,
                ACCURACY_COLOUR,
                s,
            );
        }
        let label_y = bottom + tick + 2 * s as i32;
        for &t in &self.x.ticks {
            let (x, _) = self.pixel(t, 0.0);
            image.fill_rect(x, top, 1, bottom - top, GRID);
            image.fill_rect(x, bottom + 1, 1, tick, FRAME);
            let label = self.x.label(t);
            image.text((x - text_width(&label, s) / 2, label_y), &label, TEXT, s);
        }
        // The frame goes over the grid so the edges stay crisp.
        image.fill_rect(left, top, right - left + 1, 1, FRAME);
        image.fill_rect(left, bottom, right - left + 1, 1, FRAME);
        image.fill_rect(left, top, 1, bottom - top + 1, FRAME);
        image.fill_rect(right, top, 1, bottom - top + 1, FRAME);

        let gap = 5 * s as i32;
        let x_name_y = label_y + text_height(s) + gap;
        let centre = (left + right) / 2;
        image.text(
            (centre - text_width(self.x_name, s) / 2, x_name_y),
            self.x_name,
            TEXT,
            s,
        );

        let head_y = top - gap - text_height(s);
        let reward_end =
            span.0 + gap + image.text((span.0 + gap, head_y), "reward", REWARD_COLOUR, s);
        let accuracy_name = "accuracy";
        let accuracy_x = span.1 - gap - text_width(accuracy_name, s);
        image.text((accuracy_x, head_y), accuracy_name, ACCURACY_COLOUR, s);
        let title_x = centre - text_width(title, s) / 2;
        // Narrow images drop the panel title rather than overprint the axis names.
        if title_x > reward_end + gap && title_x + text_width(title, s) + gap < accuracy_x {
            image.text((title_x, head_y), title, TEXT, s);
        }
    }

    /// Draws phase changes, the reward line and the accuracy line with its points marked.
    pub fn draw_series(&self, image: &mut Image, records: &[StepRecord]) {
        let s = self.scale;
        let Frame {
            left,
            top,
            right,
            bottom,
        } = self.frame;
        let si = s as i32;
        let mut label_free_x = [i32::MIN; 3];
        let mut previous: Option<&str> = None;
        for record in records {
            let phase = record.phase.as_deref();
            if let (Some(name), Some(x)) = (phase, self.x_value(record)) {
                if phase != previous {
                    let (px, _) = self.pixel(x, 0.0);
                    if previous.is_some() {
                        image.dashed_vline(px, (top + 1, bottom - 1), (3 * s, 3 * s), PHASE);
                    }
                    let label_x = px.max(left) + 2 * si;
                    let width = text_width(name, s);
                    // A short phase would put its neighbour's label on top of its own: use the
                    // first row with room, or leave the label out.
                    let row = label_free_x.iter().position(|&free| label_x >= free);
                    if let Some(row) = row.filter(|_| label_x + width < right) {
                        let y = top + 2 * si + row as i32 * (text_height(s) + 3 * si);
                        image.text((label_x, y), name, PHASE, s);
                        label_free_x[row] = label_x + width + 3 * si;
                    }
                }
                previous = phase;
            }
        }

        let thickness = s;
        let reward: Vec<Option<(i32, i32)>> =
            records.iter().map(|r| self.reward_point(r)).collect();
        draw_polyline(image, &reward, REWARD_COLOUR, thickness);
        let mut finite = reward.iter().flatten();
        if let (Some(&only), None) = (finite.next(), finite.next()) {
            // A lone point has no segment to show it.
            image.fill_disc(only, 2 * s, REWARD_COLOUR);
        }
        // Each domain's own accuracy, thin, under the mean's line.
        for (i, domain) in eval_domains(records).iter().enumerate() {
            let line: Vec<Option<(i32, i32)>> = records
                .iter()
                .filter_map(|r| self.domain_point(domain, r))
                .map(Some)
                .collect();
            draw_polyline(image, &line, domain_colour(i), 1);
        }
        // Steps without an eval neither break nor end the accuracy line.
        let accuracy: Vec<Option<(i32, i32)>> = records
            .iter()
            .filter_map(|r| self.accuracy_point(r))
            .map(Some)
            .collect();
        draw_polyline(image, &accuracy, ACCURACY_COLOUR, thickness);
        for point in accuracy.iter().flatten() {
            image.fill_disc(*point, 2 * s, ACCURACY_COLOUR);
        }
    }

    /// Writes `message` in the middle of the frame (for an empty log).
    pub fn draw_message(&self, image: &mut Image, message: &str) {
        let Frame {
            left,
            top,
            right,
            bottom,
        } = self.frame;
        let (w, h) = (text_width(message, self.scale), text_height(self.scale));
        image.text(
            ((left + right - w) / 2, (top + bottom - h) / 2),
            message,
            TEXT,
            self.scale,
        );
    }
}

/// Joins consecutive points; `None` (a non-finite value) breaks the line.
fn draw_polyline(image: &mut Image, points: &[Option<(i32, i32)>], colour: Rgb, thickness: u32) {
    for pair in points.windows(2) {
        if let [Some(a), Some(b)] = pair {
            // Thick strokes are offset so the point itself sits in the stroke's middle.
            let o = (thickness as i32 - 1) / 2;
            image.line((a.0 - o, a.1 - o), (b.0 - o, b.1 - o), colour, thickness);
        }
    }
}

/// Seconds for short runs, minutes up to three hours, hours beyond.
fn wall_unit(records: &[StepRecord]) -> (f64, &'static str) {
    let longest = records
        .iter()
        .map(|r| r.wall_s)
        .filter(|w| w.is_finite())
        .fold(0.0, f64::max);
    if longest <= 180.0 {
        (1.0, "wall time (s)")
    } else if longest <= 3.0 * 3600.0 {
        (60.0, "wall time (min)")
    } else {
        (3600.0, "wall time (h)")
    }
}
