//! JSONL and Parquet datasets named `domain::name[@split]`.
//!
//! A spec resolves to a file under the configured `data_dir`:
//! `<data_dir>/<domain>/<name>.jsonl` without a split, `<data_dir>/<domain>/<name>/<split>.jsonl`
//! with one; where no `.jsonl` is, the `.parquet` of the same name (Hugging Face `datasets`'
//! and verl's format: each row read as the JSON object a line would hold). Each non-blank line
//! (each Parquet row) is one JSON object, one [`DataSample`]:
//!
//! - `id` (string or integer, optional): the row id; the 1-based line number when absent;
//! - `system_prompt` (string, optional): overrides the domain's system prompt for this row;
//! - `input` (any JSON, optional): what the environment receives; when absent, the whole object
//!   minus `id` and `system_prompt` is the input.
//!
//! A line longer than `data.max_line_bytes`, one that is not UTF-8, or one that is not such an
//! object is reported with its file and line number, counted in
//! `sluice_data_bad_lines_total{dataset}`, and then skipped or made fatal per `data.on_bad_line`.

use std::path::{Path, PathBuf};

use crate::config::{BadLinePolicy, DatasetSpec};
use serde::Serialize;
use serde_json::Value;
use sluice_core::DataSample;
use sluice_core::files::{MIB, ReadFileError, read_capped};
use sluice_core::metrics::DATA_BAD_LINES;

use crate::error::DataError;

/// A line that could not be turned into a sample.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadLine {
    /// The file it is in.
    pub path: PathBuf,
    /// 1-based line number.
    pub line: usize,
    /// What was wrong.
    pub reason: String,
}

/// Default of `data.max_line_bytes`: far above any real row (a long-context prompt is well under
/// a megabyte), far below what a run can hold per row.
pub const DEFAULT_MAX_LINE_BYTES: usize = 16 * MIB as usize;
/// Default of `data.max_file_bytes`: the whole file is held in memory while it is parsed.
pub const DEFAULT_MAX_FILE_BYTES: u64 = 4096 * MIB;

/// Size caps of dataset reading (`data.max_file_bytes`, `data.max_line_bytes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ReadLimits {
    /// Largest file read, bytes; a larger (or non-regular) file is refused.
    pub max_file_bytes: u64,
    /// Longest line, bytes; a longer one is a bad line.
    pub max_line_bytes: usize,
}

impl Default for ReadLimits {
    fn default() -> Self {
        Self {
            max_file_bytes: DEFAULT_MAX_FILE_BYTES,
            max_line_bytes: DEFAULT_MAX_LINE_BYTES,
        }
    }
}

/// The rows of one `domain::name[@split]`, in file order.
#[derive(Debug, Clone, PartialEq)]
pub struct Dataset {
    spec: DatasetSpec,
    samples: Vec<DataSample>,
    bad_lines: Vec<BadLine>,
}

/// Where the JSONL file of `spec` lives under `data_dir`.
pub fn dataset_path(data_dir: &Path, spec: &DatasetSpec) -> PathBuf {
    let domain_dir = data_dir.join(&spec.domain);
    match &spec.split {
        Some(split) => domain_dir.join(&spec.name).join(format!("{split}.jsonl")),
        None => domain_dir.join(format!("{}.jsonl", spec.name)),
    }
}

/// The file `spec` is read from: its JSONL file when something is at that path (even a link
/// that leads nowhere: a file was meant), else its Parquet file when something is there, else
/// the JSONL path (which a read then reports missing).
pub fn dataset_file(data_dir: &Path, spec: &DatasetSpec) -> PathBuf {
    let jsonl = dataset_path(data_dir, spec);
    let parquet = jsonl.with_extension("parquet");
    let exists = |p: &Path| std::fs::symlink_metadata(p).is_ok();
    if !exists(&jsonl) && exists(&parquet) {
        parquet
    } else {
        jsonl
    }
}

/// Whether `path` names a Parquet file.
fn is_parquet(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "parquet")
}

/// The `dataset` field of a sample: the spec without its domain.
fn dataset_field(spec: &DatasetSpec) -> String {
    match &spec.split {
        Some(split) => format!("{}@{split}", spec.name),
        None => spec.name.clone(),
    }
}

impl Dataset {
    /// A dataset from samples produced elsewhere (a built-in task's generator). Each sample's
    /// `domain` and `dataset` are set from `spec`.
    pub fn from_samples(spec: DatasetSpec, samples: Vec<DataSample>) -> Self {
        let dataset = dataset_field(&spec);
        let samples = samples
            .into_iter()
            .map(|mut s| {
                s.domain = spec.domain.clone();
                s.dataset = dataset.clone();
                s
            })
            .collect();
        Self {
            spec,
            samples,
            bad_lines: Vec::new(),
        }
    }

    /// Loads `spec` from its file under `data_dir` (see [`dataset_path`]) with the default
    /// [`ReadLimits`].
    pub fn load(
        data_dir: &Path,
        spec: &DatasetSpec,
        on_bad_line: BadLinePolicy,
    ) -> Result<Self, DataError> {
        Self::load_limited(data_dir, spec, on_bad_line, &ReadLimits::default())
    }

    /// Loads `spec` from its file under `data_dir`: a file that is not a regular file or is
    /// larger than `limits.max_file_bytes` is refused; a line longer than
    /// `limits.max_line_bytes` is a bad line.
    pub fn load_limited(
        data_dir: &Path,
        spec: &DatasetSpec,
        on_bad_line: BadLinePolicy,
        limits: &ReadLimits,
    ) -> Result<Self, DataError> {
        Self::read(data_dir, spec, on_bad_line, limits, true)
    }

    /// [`Self::load_limited`] for a second reader of a file the run already loaded (the
    /// warm-up's training problems): its bad lines were logged and counted then, and are not
    /// again.
    pub fn load_again(
        data_dir: &Path,
        spec: &DatasetSpec,
        on_bad_line: BadLinePolicy,
        limits: &ReadLimits,
    ) -> Result<Self, DataError> {
        Self::read(data_dir, spec, on_bad_line, limits, false)
    }

    fn read(
        data_dir: &Path,
        spec: &DatasetSpec,
        on_bad_line: BadLinePolicy,
        limits: &ReadLimits,
        report: bool,
    ) -> Result<Self, DataError> {
        let path = dataset_file(data_dir, spec);
        let bytes = read_capped(
            &path,
            limits.max_file_bytes,
            "dataset files (data.max_file_bytes)",
        )
        .map_err(|e| match e {
            ReadFileError::Io { path, source } => DataError::Io {
                dataset: spec.to_string(),
                path,
                cause: source,
            },
            other => DataError::File {
                dataset: spec.to_string(),
                cause: other,
            },
        })?;
        if is_parquet(&path) {
            let rows =
                crate::parquet_rows::rows(bytes, limits).map_err(|reason| DataError::Parquet {
                    dataset: spec.to_string(),
                    path: path.clone(),
                    reason,
                })?;
            let rows = rows.into_iter().enumerate().map(|(i, row)| {
                let row_no = i + 1;
                (row_no, parquet_row(row, row_no, limits).map(Some))
            });
            return Self::collect(rows, &path, spec, on_bad_line, report);
        }
        Self::parse_reporting(&bytes, &path, spec, on_bad_line, limits, report)
    }

    /// Parses JSONL `text` as if read from `path` (which only names the source in reports),
    /// with the default [`ReadLimits`].
    pub fn parse(
        text: &str,
        path: &Path,
        spec: &DatasetSpec,
        on_bad_line: BadLinePolicy,
    ) -> Result<Self, DataError> {
        Self::parse_bytes(
            text.as_bytes(),
            path,
            spec,
            on_bad_line,
            &ReadLimits::default(),
        )
    }

    /// Parses JSONL `bytes` as if read from `path`. Each line is checked on its own: one that is
    /// longer than `limits.max_line_bytes`, not UTF-8 or not a row is a bad line, reported with
    /// its number and skipped or fatal per `on_bad_line`.
    pub fn parse_bytes(
        bytes: &[u8],
        path: &Path,
        spec: &DatasetSpec,
        on_bad_line: BadLinePolicy,
        limits: &ReadLimits,
    ) -> Result<Self, DataError> {
        Self::parse_reporting(bytes, path, spec, on_bad_line, limits, true)
    }

    /// [`Self::parse_bytes`], its bad lines logged and counted when `report`.
    fn parse_reporting(
        bytes: &[u8],
        path: &Path,
        spec: &DatasetSpec,
        on_bad_line: BadLinePolicy,
        limits: &ReadLimits,
        report: bool,
    ) -> Result<Self, DataError> {
        // Editors on Windows save UTF-8 with a byte-order mark; it is not part of the first row.
        let bytes = bytes.strip_prefix("\u{feff}".as_bytes()).unwrap_or(bytes);
        let rows = bytes.split(|&b| b == b'\n').enumerate().map(|(idx, line)| {
            let line_no = idx + 1;
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            (line_no, line_row(line, line_no, limits))
        });
        Self::collect(rows, path, spec, on_bad_line, report)
    }

    /// The samples of `rows` (`(line or row number, the row, none for a blank line, or why
    /// it is bad)`) read from `path`; bad ones logged and counted when `report`, then skipped
    /// or fatal per `on_bad_line`.
    fn collect(
        rows: impl Iterator<Item = (usize, Result<Option<Row>, String>)>,
        path: &Path,
        spec: &DatasetSpec,
        on_bad_line: BadLinePolicy,
        report: bool,
    ) -> Result<Self, DataError> {
        let dataset = dataset_field(spec);
        let label = spec.to_string();
        let mut samples = Vec::new();
        let mut bad_lines = Vec::new();
        for (line_no, row) in rows {
            match row {
                Ok(None) => {}
                Ok(Some(row)) => samples.push(DataSample {
                    id: row.id,
                    domain: spec.domain.clone(),
                    dataset: dataset.clone(),
                    input: row.input,
                    system_prompt: row.system_prompt,
                }),
                Err(reason) => {
                    if report {
                        metrics::counter!(DATA_BAD_LINES, "dataset" => label.clone()).increment(1);
                        tracing::warn!(dataset = %label, file = %path.display(), line = line_no, %reason, "bad dataset line");
                    }
                    if on_bad_line == BadLinePolicy::Fail {
                        return Err(DataError::BadLine {
                            dataset: label,
                            path: path.to_path_buf(),
                            line: line_no,
                            reason,
                        });
                    }
                    bad_lines.push(BadLine {
                        path: path.to_path_buf(),
                        line: line_no,
                        reason,
                    });
                }
            }
        }
        Ok(Self {
            spec: spec.clone(),
            samples,
            bad_lines,
        })
    }

    /// The spec this dataset was loaded for.
    pub fn spec(&self) -> &DatasetSpec {
        &self.spec
    }

    /// The rows, in file order.
    pub fn samples(&self) -> &[DataSample] {
        &self.samples
    }

    /// Number of rows.
    pub fn len(&self) -> usize {
        self.samples.len()
    }

    /// True when no row was loaded.
    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    /// Lines that were skipped (empty under `on_bad_line = "fail"`, which stops at the first).
    pub fn bad_lines(&self) -> &[BadLine] {
        &self.bad_lines
    }
}

/// One line as a row: `None` when blank, the reason when too long, not UTF-8 or not a row.
fn line_row(line: &[u8], line_no: usize, limits: &ReadLimits) -> Result<Option<Row>, String> {
    if line.len() > limits.max_line_bytes {
        return Err(format!(
            "line is {} bytes, longer than data.max_line_bytes = {}",
            line.len(),
            limits.max_line_bytes
        ));
    }
    let line = std::str::from_utf8(line).map_err(|e| {
        format!(
            "not UTF-8 text (invalid byte at column {})",
            e.valid_up_to() + 1
        )
    })?;
    if line.trim().is_empty() {
        return Ok(None);
    }
    parse_row(line, line_no).map(Some)
}

struct Row {
    id: String,
    input: Value,
    system_prompt: Option<String>,
}

fn parse_row(line: &str, line_no: usize) -> Result<Row, String> {
    let value: Value = serde_json::from_str(line).map_err(|e| format!("invalid JSON: {e}"))?;
    object_row(value, line_no)
}

/// A Parquet row as a row, held to `data.max_line_bytes` as the JSON line it would be.
fn parquet_row(value: Value, row_no: usize, limits: &ReadLimits) -> Result<Row, String> {
    /// Counts what is written, keeping none of it.
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    let bytes = match serde_json::to_writer(&mut count, &value) {
        Ok(()) => count.0,
        Err(_) => usize::MAX,
    };
    if bytes > limits.max_line_bytes {
        return Err(format!(
            "row is {bytes} bytes as JSON, longer than data.max_line_bytes = {}",
            limits.max_line_bytes
        ));
    }
    object_row(value, row_no)
}

/// A row's JSON object as a row: its `id` (else `line_no`), `system_prompt` and `input` (else
/// the rest of the object).
fn object_row(value: Value, line_no: usize) -> Result<Row, String> {
    let Value::Object(mut obj) = value else {
        return Err(format!("expected a JSON object, got {}", json_kind(&value)));
    };
    let id = match obj.remove("id") {
        None | Some(Value::Null) => line_no.to_string(),
        Some(Value::String(s)) => s,
        Some(Value::Number(n)) if n.is_i64() || n.is_u64() => n.to_string(),
        // pandas writes an integer column with a gap as floats (`3.0`): the integer it holds.
        Some(Value::Number(n))
            if n.as_f64()
                .is_some_and(|f| f.fract() == 0.0 && f.abs() < 9e15) =>
        {
            format!("{}", n.as_f64().unwrap_or_default() as i64)
        }
        Some(other) => {
            let got = match &other {
                Value::Number(n) => n.to_string(),
                v => json_kind(v).to_owned(),
            };
            return Err(format!("`id` must be a string or an integer, got {got}"));
        }
    };
    let system_prompt = match obj.remove("system_prompt") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s),
        Some(other) => {
            return Err(format!(
                "`system_prompt` must be a string, got {}",
                json_kind(&other)
            ));
        }
    };
    let input = match obj.remove("input") {
        Some(input) => input,
        None => Value::Object(obj),
    };
    Ok(Row {
        id,
        input,
        system_prompt,
    })
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(s: &str) -> DatasetSpec {
        s.parse().unwrap()
    }

    #[test]
    fn paths_follow_the_spec() {
        let dir = Path::new("/data");
        assert_eq!(
            dataset_path(dir, &spec("math::gsm8k")),
            Path::new("/data/math/gsm8k.jsonl")
        );
        assert_eq!(
            dataset_path(dir, &spec("math::gsm8k@test")),
            Path::new("/data/math/gsm8k/test.jsonl")
        );
    }

    #[test]
    fn rows_become_samples() {
        let text = r#"{"id": "a", "input": {"q": "1+1"}, "system_prompt": "be terse"}

{"question": "2+2", "answer": 4}
{"id": 17, "input": [1, 2]}
"#;
        let ds = Dataset::parse(
            text,
            Path::new("f.jsonl"),
            &spec("math::toy@train"),
            BadLinePolicy::Fail,
        )
        .unwrap();
        let s = ds.samples();
        assert_eq!(s.len(), 3);
        assert_eq!(s[0].id, "a");
        assert_eq!(s[0].input, serde_json::json!({"q": "1+1"}));
        assert_eq!(s[0].system_prompt.as_deref(), Some("be terse"));
        assert_eq!(
            (s[0].domain.as_str(), s[0].dataset.as_str()),
            ("math", "toy@train")
        );
        assert_eq!(
            s[1].id, "3",
            "line number when no id; blank lines still count"
        );
        assert_eq!(
            s[1].input,
            serde_json::json!({"question": "2+2", "answer": 4})
        );
        assert_eq!(s[2].id, "17");

        // pandas' floats for an integer column with a gap are their integers; 1.5 is no id.
        let ds = Dataset::parse(
            "{\"id\": 3.0, \"q\": 1}\n{\"id\": 1.5, \"q\": 2}\n",
            Path::new("f.jsonl"),
            &spec("math::toy@train"),
            BadLinePolicy::Skip,
        )
        .unwrap();
        assert_eq!(ds.samples()[0].id, "3");
        assert_eq!(ds.len(), 1);
        assert!(
            ds.bad_lines()[0].reason.contains("got 1.5"),
            "{:?}",
            ds.bad_lines()
        );
    }

    #[test]
    fn a_missing_file_names_the_os_error_once() {
        let err = Dataset::load(
            Path::new("/nonexistent-data"),
            &spec("math::toy"),
            BadLinePolicy::Fail,
        )
        .unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("cannot read /nonexistent-data/math/toy.jsonl: "),
            "{msg}"
        );
        // The binary prints the whole chain; the OS error is in the message, so no source.
        assert!(std::error::Error::source(&err).is_none());
    }

    #[test]
    fn a_byte_order_mark_does_not_spoil_the_first_row() {
        let text = "\u{feff}{\"id\": \"a\", \"q\": 1}\n{\"q\": 2}\n";
        let ds = Dataset::parse(
            text,
            Path::new("f.jsonl"),
            &spec("math::toy"),
            BadLinePolicy::Fail,
        )
        .unwrap();
        assert_eq!(ds.len(), 2);
        assert_eq!(ds.samples()[0].id, "a");
    }

    #[test]
    fn bad_lines_are_reported_with_file_and_line() {
        let text = "{\"input\": 1}\nnot json\n[1,2]\n{\"id\": true}\n{\"input\": 2}\n";
        let path = Path::new("data/math/toy.jsonl");
        let ds = Dataset::parse(text, path, &spec("math::toy"), BadLinePolicy::Skip).unwrap();
        assert_eq!(ds.len(), 2);
        let lines: Vec<usize> = ds.bad_lines().iter().map(|b| b.line).collect();
        assert_eq!(lines, [2, 3, 4]);
        assert!(
            ds.bad_lines()[1]
                .reason
                .contains("expected a JSON object, got an array")
        );
        assert_eq!(ds.bad_lines()[0].path, path);

        let err = Dataset::parse(text, path, &spec("math::toy"), BadLinePolicy::Fail).unwrap_err();
        assert_eq!(err.kind(), "data_bad_line");
        let msg = err.to_string();
        assert!(
            msg.starts_with("dataset `math::toy`: data/math/toy.jsonl:2: invalid JSON"),
            "{msg}"
        );
    }

    #[test]
    fn missing_file_names_the_path() {
        let err = Dataset::load(
            Path::new("/nonexistent"),
            &spec("a::b"),
            BadLinePolicy::Skip,
        )
        .unwrap_err();
        assert_eq!(err.kind(), "data_io");
        assert!(err.to_string().contains("/nonexistent/a/b.jsonl"), "{err}");
    }
}
