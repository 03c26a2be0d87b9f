//! Parquet dataset files, as Hugging Face `datasets`, pandas and verl's preprocessing scripts
//! write them: each row becomes the JSON object a JSONL line would hold (nested structs as
//! objects, lists as arrays, strings as strings), so the rest of the loader treats both formats
//! alike. Pages compressed with snappy (pyarrow's default), gzip or LZ4, or not at all, are read;
//! zstd and brotli are refused by name.

use bytes::Bytes;
use parquet::file::reader::{FileReader, SerializedFileReader};
use serde_json::Value;

/// Each row of the Parquet file `bytes` as a JSON value, in file order; `Err` when the file, or
/// any of its rows, cannot be decoded. A row that fails leaves the reader where it stopped (it
/// would report the same error for ever), so the first one ends the read.
pub(crate) fn rows(bytes: Vec<u8>) -> Result<Vec<Value>, String> {
    // The record reader panics on column types it does not implement: a bad file must not
    // take the process with it.
    std::panic::catch_unwind(move || read(Bytes::from(bytes))).unwrap_or_else(|panic| {
        let what = panic
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| panic.downcast_ref::<&str>().copied())
            .unwrap_or("a column type the reader does not handle");
        Err(format!("not a readable Parquet file: {what}"))
    })
}

fn read(bytes: Bytes) -> Result<Vec<Value>, String> {
    // A dataset row holds at least a byte of its own; a file claiming more rows than it has
    // bytes (runs of nulls can encode billions in a few) would only fill memory.
    let most = bytes.len();
    let reader = SerializedFileReader::new(bytes).map_err(|e| explain(&e))?;
    let claimed = reader.metadata().file_metadata().num_rows();
    if usize::try_from(claimed).map_or(true, |n| n > most) {
        return Err(format!(
            "not a readable Parquet file: its footer claims {claimed} rows in {most} bytes"
        ));
    }
    let mut out = Vec::with_capacity(claimed as usize);
    for (i, row) in reader
        .get_row_iter(None)
        .map_err(|e| explain(&e))?
        .enumerate()
    {
        let row = row.map_err(|e| format!("row {}: {}", i + 1, explain(&e)))?;
        if out.len() == most {
            return Err(format!(
                "not a readable Parquet file: more rows than its {most} bytes"
            ));
        }
        out.push(row.to_json_value());
    }
    Ok(out)
}

/// The reader's error, with what to do about a codec this build leaves out.
fn explain(e: &parquet::errors::ParquetError) -> String {
    let text = e.to_string();
    if text.contains("Disabled feature") || text.contains("not supported") {
        format!(
            "{text} (Sluice reads Parquet pages compressed with snappy, gzip or LZ4: rewrite the file with one of them, e.g. pyarrow's default)"
        )
    } else {
        format!("not a readable Parquet file: {text}")
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::config::{BadLinePolicy, DatasetSpec};
    use crate::{Dataset, ReadLimits, dataset_file};

    fn spec(s: &str) -> DatasetSpec {
        s.parse().unwrap()
    }

    /// The repository's Parquet fixture (verl's GSM8K rows, written by pyarrow) is read where no
    /// JSONL file of the name is; a JSONL file wins; a file that is not Parquet is refused
    /// naming it.
    #[test]
    fn parquet_files_are_read_where_no_jsonl_is() {
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data");
        let verl = spec("gsm8k::verl@train");
        assert_eq!(
            dataset_file(&fixture, &verl),
            fixture.join("gsm8k/verl/train.parquet")
        );
        let ds = Dataset::load(&fixture, &verl, BadLinePolicy::Fail).unwrap();
        assert_eq!(ds.len(), 8);
        assert_eq!(ds.samples()[7].id, "8");
        assert_eq!(
            ds.samples()[7].input["prompt"][0]["role"],
            serde_json::json!("user")
        );

        let dir = tempfile::tempdir().unwrap();
        let split = dir.path().join("gsm8k/verl");
        std::fs::create_dir_all(&split).unwrap();
        std::fs::copy(
            fixture.join("gsm8k/verl/train.parquet"),
            split.join("train.parquet"),
        )
        .unwrap();
        std::fs::write(split.join("train.jsonl"), "{\"q\": 1}\n").unwrap();
        let ds = Dataset::load(dir.path(), &verl, BadLinePolicy::Fail).unwrap();
        assert_eq!(ds.len(), 1, "the JSONL file wins");
        std::fs::remove_file(split.join("train.jsonl")).unwrap();
        // A row longer than data.max_line_bytes as JSON is a bad line, as a long line is.
        let limits = ReadLimits {
            max_line_bytes: 400,
            ..ReadLimits::default()
        };
        let ds = Dataset::load_limited(dir.path(), &verl, BadLinePolicy::Skip, &limits).unwrap();
        assert!(
            ds.len() < 8 && !ds.bad_lines().is_empty(),
            "{:?}",
            ds.bad_lines()
        );
        assert!(
            ds.bad_lines()[0]
                .reason
                .contains("data.max_line_bytes = 400")
        );

        // Two bytes of a page changed: the reader fails that row and would fail it for ever
        // (reading on, it once filled memory).
        let mut broken = std::fs::read(fixture.join("gsm8k/verl/train.parquet")).unwrap();
        broken[1128] = 177;
        broken[2893] = 177;
        std::fs::write(split.join("train.parquet"), &broken).unwrap();
        let err = Dataset::load(dir.path(), &verl, BadLinePolicy::Skip).unwrap_err();
        assert_eq!(err.kind(), "data_parquet");
        assert!(err.to_string().contains("train.parquet: row "), "{err}");

        std::fs::write(split.join("test.parquet"), b"PAR1 not really").unwrap();
        let err =
            Dataset::load(dir.path(), &spec("gsm8k::verl@test"), BadLinePolicy::Skip).unwrap_err();
        assert_eq!(err.kind(), "data_parquet");
        let msg = err.to_string();
        assert!(
            msg.starts_with("dataset `gsm8k::verl@test`: ")
                && msg.contains("test.parquet: not a readable Parquet file"),
            "{msg}"
        );
    }
}
