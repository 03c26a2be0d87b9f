//! Run reports: what a run leaves behind for a person to read.
//!
//! | module | what it holds |
//! |---|---|
//! | [`log`] | [`StepRecord`], [`MetricsLog`] (appends `metrics.jsonl`, one JSON object per line) and [`read_log`] |
//! | [`tensorboard`] | [`EventWriter`]: the same records as TensorBoard scalars (`[metrics] tensorboard`) |
//! | [`plot`] | [`plot_run`]: reward and eval accuracy against step and wall time, as one PNG (with a second row of response lengths and train/inference mismatch when the log has them) |
//! | [`keys`] | the `metrics.jsonl` keys of rollout shapes, length bias and mismatch |
//! | [`image`] | [`Image`]: an RGB canvas with lines, rectangles and text, encoded by [`png`] |
//! | [`png`] | a small PNG encoder (8-bit RGB, fixed-Huffman deflate with run-length matches) |
//! | [`font`] | the 5×7 bitmap font of the plot's labels |
//! | [`error`] | [`ReportError`] with stable `kind()` names |
//!
//! No third-party imaging or plotting crates: the plot is simple enough to draw by hand, and
//! the quickstart must build fast on two cores.

pub mod error;
pub mod font;
pub mod image;
pub mod keys;
pub mod log;
pub mod plot;
pub mod png;
pub mod tensorboard;

mod axis;
mod diagnostics;
mod panel;

pub use error::ReportError;
pub use image::{Image, Rgb};
pub use log::{METRICS_FILE, MetricsLog, StepRecord, read_log};
pub use plot::{
    ACCURACY_COLOUR, DOMAIN_ACCURACY_PREFIX, PLOT_FILE, PanelKind, PlotOptions, REWARD_COLOUR,
    RunPlot, Series, domain_colour, plot_run, render_run,
};
pub use tensorboard::{EventWriter, TENSORBOARD_DIR};
