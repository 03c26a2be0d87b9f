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
