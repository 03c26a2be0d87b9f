//! The per-step metrics log: `metrics.jsonl` in a run's output dir, one JSON object per line.
//!
//! Every line is flushed as it is written, so a run that is killed keeps every step it logged.
//! A killed writer can leave at most a final line without its newline; readers and
//! [`MetricsLog::open`] drop such a torn line when it does not parse, and report any other bad
//! line with its file and line number.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Deserializer, Serialize};
use sluice_core::PolicyVersion;

use crate::error::ReportError;
use crate::tensorboard::EventWriter;

/// The log's file name inside a run's output dir.
pub const METRICS_FILE: &str = "metrics.jsonl";

/// One training step, as one line of `metrics.jsonl`.
///
/// Non-finite numbers (a NaN loss) are written as `null`; the required fields read `null` back
/// as NaN, the optional ones as absent, so a diverging run still leaves a readable log.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    /// Training steps done, counting the supervised warm-up if the run logs it.
    pub step: u64,
    /// Seconds since the run started (a resumed run continues its predecessor's clock).
    #[serde(deserialize_with = "nan_if_null")]
    pub wall_s: f64,
    /// Which phase produced the step, e.g. `sft` or `rl`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    /// Mean reward of the step: the sampled reward, the mean of the rollouts finished since the
    /// previous record (the trained batch's, `trained_reward_mean`, until one was seen).
    #[serde(deserialize_with = "nan_if_null")]
    pub reward_mean: f64,
    /// Held-out accuracy as a fraction in [0, 1], on steps that were evaluated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_accuracy: Option<f64>,
    /// Mean number of policy versions between generating and training on a sample.
    #[serde(deserialize_with = "nan_if_null")]
    pub version_lag_mean: f64,
    /// Generated tokens per second over the last 10 s (absent until a second of them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_s: Option<f64>,
    /// Training loss of the step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss: Option<f64>,
    /// The policy version the step published.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy_version: Option<PolicyVersion>,
    /// Any other numbers, written as top-level keys of the line (they must not reuse a field's
    /// name).
    #[serde(flatten, deserialize_with = "extra_nan_if_null")]
    pub extra: BTreeMap<String, f64>,
}

/// The keys [`StepRecord`] writes itself; `extra` may not use them.
const FIELD_NAMES: [&str; 9] = [
    "step",
    "wall_s",
    "phase",
    "reward_mean",
    "eval_accuracy",
    "version_lag_mean",
    "tokens_per_s",
    "loss",
    "policy_version",
];

fn nan_if_null<'de, D: Deserializer<'de>>(deserializer: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(deserializer)?.unwrap_or(f64::NAN))
}

fn extra_nan_if_null<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<BTreeMap<String, f64>, D::Error> {
    let raw = BTreeMap::<String, Option<f64>>::deserialize(deserializer)?;
    Ok(raw
        .into_iter()
        .map(|(key, value)| (key, value.unwrap_or(f64::NAN)))
        .collect())
}

/// An open `metrics.jsonl`, appending one line per [`StepRecord`].
#[derive(Debug)]
pub struct MetricsLog {
    path: PathBuf,
    writer: BufWriter<File>,
    last: Option<StepRecord>,
    line: Vec<u8>,
    /// The step after which [`resume`](Self::resume) cut the log (what a TensorBoard writer must
    /// make TensorBoard forget too).
    cut_after: Option<u64>,
    /// Where every appended record is also written as TensorBoard scalars, when asked for.
    tensorboard: Option<EventWriter>,
    /// Records the opening dropped (after [`resume`](Self::resume)'s step).
    dropped: usize,
}

impl MetricsLog {
    /// Starts a new log at `path`, replacing any file there (parent dirs are created).
    pub fn create(path: impl AsRef<Path>) -> Result<Self, ReportError> {
        let path = path.as_ref();
        create_parent(path)?;
        let file = File::create(path).map_err(|e| ReportError::io(path, e))?;
        Ok(Self::with_file(path, file, None))
    }

    /// Opens `path` for appending, creating it if absent: a resumed run continues its log.
    ///
    /// Existing lines are checked; a torn final line left by a killed run is cut off, any other
    /// bad line is an error naming file and line.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, ReportError> {
        Self::open_keeping(path.as_ref(), |_| true)
    }

    /// Like [`open`](Self::open), but first drops the records after `last_step`: a run that
    /// resumes from the checkpoint of `last_step` logs the later steps again.
    pub fn resume(path: impl AsRef<Path>, last_step: u64) -> Result<Self, ReportError> {
        let mut log = Self::open_keeping(path.as_ref(), |record| record.step <= last_step)?;
        log.cut_after = Some(last_step);
        Ok(log)
    }

    /// Also writes every appended record to a new TensorBoard event file in `dir`
    /// ([`crate::tensorboard`]). After [`resume`](Self::resume), the file first tells TensorBoard
    /// to forget what earlier files logged after the resumed step.
    pub fn with_tensorboard(mut self, dir: impl AsRef<Path>) -> Result<Self, ReportError> {
        let purge_from = self.cut_after.map(|step| step + 1);
        self.tensorboard = Some(EventWriter::create(dir, purge_from)?);
        Ok(self)
    }

    fn open_keeping(path: &Path, keep: impl Fn(&StepRecord) -> bool) -> Result<Self, ReportError> {
        create_parent(path)?;
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(ReportError::io(path, e)),
        };
        let lines = parse_lines(path, &text)?;
        let kept: Vec<&ParsedLine> = lines.lines.iter().filter(|l| keep(&l.record)).collect();
        let last = kept.last().map(|l| l.record.clone());
        if kept.len() != lines.lines.len() || lines.dropped_torn_tail {
            // Rewrite beside the log and rename over it, so a crash here leaves either the old
            // or the new file, never half of one.
            let tmp = path.with_extension("jsonl.tmp");
            let mut body = String::new();
            for line in &kept {
                body.push_str(line.text);
                body.push('\n');
            }
            std::fs::write(&tmp, body).map_err(|e| ReportError::io(&tmp, e))?;
            std::fs::rename(&tmp, path).map_err(|e| ReportError::io(path, e))?;
        } else if !text.is_empty() && !text.ends_with('\n') {
            // A complete final line without its newline: end it before appending.
            let mut file = append_file(path)?;
            file.write_all(b"\n")
                .map_err(|e| ReportError::io(path, e))?;
        }
        let file = append_file(path)?;
        let mut log = Self::with_file(path, file, last);
        log.dropped = lines.lines.len() - kept.len();
        Ok(log)
    }

    /// Records [`resume`](Self::resume) dropped: those after the step it resumed at.
    pub fn dropped(&self) -> usize {
        self.dropped
    }

    fn with_file(path: &Path, file: File, last: Option<StepRecord>) -> Self {
        Self {
            path: path.to_path_buf(),
            writer: BufWriter::new(file),
            last,
            line: Vec::new(),
            cut_after: None,
            tensorboard: None,
            dropped: 0,
        }
    }

    /// Appends one record as one line and flushes it to the OS.
    pub fn append(&mut self, record: &StepRecord) -> Result<(), ReportError> {
        if let Some(key) = record
            .extra
            .keys()
            .find(|k| FIELD_NAMES.contains(&k.as_str()))
        {
            return Err(ReportError::ReservedKey {
                step: record.step,
                key: key.clone(),
            });
        }
        self.line.clear();
        serde_json::to_writer(&mut self.line, record).map_err(|cause| ReportError::Serialize {
            step: record.step,
            cause,
        })?;
        self.line.push(b'\n');
        // One write of the whole line, then a flush: a kill tears at most this line.
        self.writer
            .write_all(&self.line)
            .and_then(|()| self.writer.flush())
            .map_err(|e| ReportError::io(&self.path, e))?;
        self.last = Some(record.clone());
        if let Some(tensorboard) = &mut self.tensorboard {
            tensorboard.append(record)?;
        }
        Ok(())
    }

    /// The last record in the log: the last one appended, or the last one found on opening.
    pub fn last(&self) -> Option<&StepRecord> {
        self.last.as_ref()
    }

    /// The log file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The TensorBoard event file this log also writes, if any.
    pub fn tensorboard_file(&self) -> Option<&Path> {
        self.tensorboard.as_ref().map(EventWriter::path)
    }
}

/// Reads every record of a metrics log, in file order. Blank lines are skipped and a torn
/// final line (no newline, does not parse) is dropped; any other bad line is an error naming
/// file and line.
pub fn read_log(path: impl AsRef<Path>) -> Result<Vec<StepRecord>, ReportError> {
    let path = path.as_ref();
    let text = std::fs::read_to_string(path).map_err(|e| ReportError::io(path, e))?;
    Ok(parse_lines(path, &text)?
        .lines
        .into_iter()
        .map(|l| l.record)
        .collect())
}

struct ParsedLine<'a> {
    text: &'a str,
    record: StepRecord,
}

struct ParsedLines<'a> {
    lines: Vec<ParsedLine<'a>>,
    dropped_torn_tail: bool,
}

fn parse_lines<'a>(path: &Path, text: &'a str) -> Result<ParsedLines<'a>, ReportError> {
    let mut parsed = ParsedLines {
        lines: Vec::new(),
        dropped_torn_tail: false,
    };
    let line_count = text.lines().count();
    for (index, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<StepRecord>(line) {
            Ok(record) => parsed.lines.push(ParsedLine { text: line, record }),
            Err(_) if index + 1 == line_count && !text.ends_with('\n') => {
                parsed.dropped_torn_tail = true;
            }
            Err(cause) => {
                return Err(ReportError::BadLine {
                    path: path.to_path_buf(),
                    line: index + 1,
                    cause,
                });
            }
        }
    }
    Ok(parsed)
}

fn create_parent(path: &Path) -> Result<(), ReportError> {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => {
            std::fs::create_dir_all(dir).map_err(|e| ReportError::io(dir, e))
        }
        _ => Ok(()),
    }
}

fn append_file(path: &Path) -> Result<File, ReportError> {
    OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| ReportError::io(path, e))
}
