//! Parquet dataset files, as Hugging Face `datasets`, pandas and verl's preprocessing scripts
//! write them: each row becomes the JSON object a JSONL line would hold (nested structs as
//! objects, lists as arrays, strings as strings), so the rest of the loader treats both formats
//! alike. Pages compressed with snappy (pyarrow's default), gzip or LZ4, or not at all, are read;
//! zstd and brotli are refused by name.

use bytes::Bytes;
use parquet::file::reader::{FileReader, SerializedFileReader};
use serde_json::Value;

/// Each row of the Parquet file `bytes` as a JSON value (a row that cannot be decoded gives its
/// reason instead), in file order; `Err` when the file itself cannot be read.
pub(crate) fn rows(bytes: Vec<u8>) -> Result<Vec<Result<Value, String>>, String> {
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

fn read(bytes: Bytes) -> Result<Vec<Result<Value, String>>, String> {
    let reader = SerializedFileReader::new(bytes).map_err(|e| explain(&e))?;
    let rows = reader.get_row_iter(None).map_err(|e| explain(&e))?;
    Ok(rows
        .map(|row| row.map(|r| r.to_json_value()).map_err(|e| explain(&e)))
        .collect())
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
