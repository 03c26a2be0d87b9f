//! Parquet dataset files, as Hugging Face `datasets`, pandas and verl's preprocessing scripts
//! write them: each row becomes the JSON object a JSONL line would hold (nested structs as
//! objects, lists as arrays, strings as strings, bytes holding UTF-8 as strings and other bytes
//! as base64), so the rest of the loader treats both formats alike. Pages compressed with snappy
//! (pyarrow's default), gzip or LZ4, or not at all, are read; zstd and brotli are refused by
//! name. A file is read on a thread of its own whose stack grows with its footer, and may not
//! decode to far more than its size ([`Budget`]).

use bytes::Bytes;
use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::record::{Field, Row};
use serde_json::Value;

use crate::ReadLimits;

/// The largest footer read: its schema is built recursively, on a stack sized by it.
const MAX_FOOTER_BYTES: usize = 4 << 20;
/// The reading thread's stack: a base, and per footer byte enough for the deepest schema those
/// bytes can describe (a nested level takes at least about five bytes of footer).
const BASE_STACK_BYTES: usize = 16 << 20;
const STACK_BYTES_PER_FOOTER_BYTE: usize = 256;

/// Each row of the Parquet file `bytes` as a JSON value, in file order; `Err` when the file, or
/// any of its rows, cannot be decoded, or when it would decode to far more than its size (see
/// [`Budget`]). A row that fails leaves the reader where it stopped (it would report the same
/// error for ever), so the first one ends the read.
pub(crate) fn rows(bytes: Vec<u8>, limits: &ReadLimits) -> Result<Vec<Value>, String> {
    let footer = footer_bytes(&bytes);
    if footer > MAX_FOOTER_BYTES {
        return Err(format!(
            "not a readable Parquet file: its footer is {footer} bytes, over the {MAX_FOOTER_BYTES} read"
        ));
    }
    let budget = Budget::for_file(bytes.len(), limits);
    // The reader builds the schema and each row recursively: a deep file must not overflow the
    // caller's stack (an abort no unwinding catches), and a panic on a column type the record
    // reader does not implement must not take the process with it.
    let reader = std::thread::Builder::new()
        .name("parquet-reader".into())
        .stack_size(BASE_STACK_BYTES + footer * STACK_BYTES_PER_FOOTER_BYTE)
        .spawn(move || read(Bytes::from(bytes), budget))
        .map_err(|e| format!("cannot start reading the Parquet file: {e}"))?;
    reader.join().unwrap_or_else(|panic| {
        let what = panic
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| panic.downcast_ref::<&str>().copied())
            .unwrap_or("a column type the reader does not handle");
        Err(format!("not a readable Parquet file: {what}"))
    })
}

/// The footer's length as the file's last eight bytes give it (0 when they are not a Parquet
/// tail: the reader then says what is wrong).
fn footer_bytes(bytes: &[u8]) -> usize {
    match bytes.len().checked_sub(8).map(|at| &bytes[at..]) {
        Some([a, b, c, d, b'P', b'A', b'R', b'1']) => u32::from_le_bytes([*a, *b, *c, *d]) as usize,
        _ => 0,
    }
}

/// What a file may decode to: values (a row's fields, list elements, map entries) and bytes of
/// JSON. A run holds every row in memory, so a few compressed bytes must not become gigabytes:
/// runs of nulls or one dictionary string referenced by every row encode that in a kilobyte.
/// A file may hold a value per byte of its own (at least 2^20) and decode to 32 bytes of JSON
/// per byte (at least 64 MiB, at most `data.max_file_bytes`, what a JSONL file may hold).
#[derive(Debug, Clone, Copy)]
struct Budget {
    values: usize,
    json_bytes: usize,
    /// What was granted, for the error.
    granted: (usize, usize),
}

impl Budget {
    fn for_file(file_bytes: usize, limits: &ReadLimits) -> Self {
        let cap = usize::try_from(limits.max_file_bytes).unwrap_or(usize::MAX);
        let values = file_bytes.max(1 << 20);
        let json_bytes = file_bytes.saturating_mul(32).max(64 << 20).min(cap);
        Self {
            values,
            json_bytes,
            granted: (values, json_bytes),
        }
    }

    /// Takes one value of `bytes` JSON bytes from the budget.
    fn take(&mut self, bytes: usize) -> Result<(), String> {
        if self.values == 0 || self.json_bytes < bytes {
            let (values, json_bytes) = self.granted;
            return Err(format!(
                "not a readable Parquet file: it decodes to more than {values} values or {json_bytes} bytes of JSON, far more than its size (data.max_file_bytes bounds the JSON)"
            ));
        }
        self.values -= 1;
        self.json_bytes -= bytes;
        Ok(())
    }
}

fn read(bytes: Bytes, mut budget: Budget) -> Result<Vec<Value>, String> {
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
    // The record reader builds a whole row before it is converted: a row of a hundred million
    // nulls must be refused from the footer's counts, before it exists.
    let values: u64 = reader
        .metadata()
        .row_groups()
        .iter()
        .flat_map(|g| g.columns().iter().map(|c| c.num_values().max(0) as u64))
        .fold(0, u64::saturating_add);
    if values > budget.granted.0 as u64 {
        return Err(format!(
            "not a readable Parquet file: its footer claims {values} values in {most} bytes (at most one a byte, or 2^20, are read)"
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
        out.push(row_json(&row, &mut budget)?);
    }
    Ok(out)
}

fn row_json(row: &Row, budget: &mut Budget) -> Result<Value, String> {
    let mut object = serde_json::Map::new();
    for (name, field) in row.get_column_iter() {
        budget.take(name.len() + 4)?;
        object.insert(name.clone(), field_json(field, budget)?);
    }
    Ok(Value::Object(object))
}

/// Days, milliseconds and microseconds within about 190,000 years of 1970: what the reader's
/// date conversions handle (past it they panic); a value beyond stays a number.
const MAX_DAYS: i64 = 70_000_000;
const MAX_MILLIS: i64 = MAX_DAYS * 86_400_000;
const DAY_MILLIS: i64 = 86_400_000;

/// One field as JSON: as the reader writes it, except that bytes holding UTF-8 text are text
/// (strings written without the string annotation, as older writers and pandas' `bytes` do;
/// other bytes stay base64), and dates and times out of the calendar's range stay numbers.
fn field_json(field: &Field, budget: &mut Budget) -> Result<Value, String> {
    let in_range = |v: i64, lo: i64, hi: i64| (lo..=hi).contains(&v);
    match field {
        Field::Group(row) => {
            budget.take(2)?;
            row_json(row, budget)
        }
        Field::ListInternal(list) => {
            budget.take(2)?;
            let items = list.elements().iter().map(|f| field_json(f, budget));
            Ok(Value::Array(items.collect::<Result<_, _>>()?))
        }
        Field::MapInternal(map) => {
            budget.take(2)?;
            let mut object = serde_json::Map::new();
            for (key, value) in map.entries() {
                let key = match field_json(key, budget)? {
                    Value::String(s) => s,
                    other => other.to_string(),
                };
                object.insert(key, field_json(value, budget)?);
            }
            Ok(Value::Object(object))
        }
        Field::Bytes(b) => {
            budget.take(b.len() * 4 / 3 + 4)?;
            Ok(match std::str::from_utf8(b.data()) {
                Ok(text) => Value::String(text.to_owned()),
                Err(_) => field.to_json_value(),
            })
        }
        Field::Str(s) => {
            budget.take(s.len() + 2)?;
            Ok(Value::String(s.clone()))
        }
        Field::Date(d) if !in_range(i64::from(*d), -MAX_DAYS, MAX_DAYS) => number(*d, budget),
        Field::TimeMillis(t) if !in_range(i64::from(*t), 0, DAY_MILLIS - 1) => number(*t, budget),
        Field::TimeMicros(t) if !in_range(*t, 0, DAY_MILLIS * 1000 - 1) => number(*t, budget),
        Field::TimestampMillis(t) if !in_range(*t, -MAX_MILLIS, MAX_MILLIS) => number(*t, budget),
        Field::TimestampMicros(t) if !in_range(*t / 1000, -MAX_MILLIS, MAX_MILLIS) => {
            number(*t, budget)
        }
        _ => {
            budget.take(24)?;
            Ok(field.to_json_value())
        }
    }
}

fn number(n: impl Into<serde_json::Number>, budget: &mut Budget) -> Result<Value, String> {
    budget.take(24)?;
    Ok(Value::Number(n.into()))
}

/// The reader's error (its first 300 characters: it may list a whole value's bytes), with what
/// to do about a codec this build leaves out.
fn explain(e: &parquet::errors::ParquetError) -> String {
    let full = e.to_string();
    let mut text: String = full.chars().take(300).collect();
    if text.len() < full.len() {
        text.push('…');
    }
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

    fn hostile(name: &str) -> Result<Vec<serde_json::Value>, String> {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("testdata/parquet")
            .join(name);
        super::rows(std::fs::read(path).unwrap(), &ReadLimits::default())
    }

    /// A file of no rows whose schema nests `depth` groups above one column: the footer in
    /// thrift's compact protocol, as a hostile writer makes it.
    fn deeply_nested(depth: usize) -> Vec<u8> {
        fn varint(mut n: u64, out: &mut Vec<u8>) {
            while n >= 0x80 {
                out.push((n as u8) | 0x80);
                n >>= 7;
            }
            out.push(n as u8);
        }
        let int = |n: i64, out: &mut Vec<u8>| varint(((n << 1) ^ (n >> 63)) as u64, out);
        let name = |s: &str, out: &mut Vec<u8>| {
            varint(s.len() as u64, out);
            out.extend_from_slice(s.as_bytes());
        };
        let mut elements = Vec::new();
        // The root: name (field 4), one child (field 5).
        elements.push(0x48);
        name("schema", &mut elements);
        elements.push(0x15);
        int(1, &mut elements);
        elements.push(0);
        for _ in 0..depth {
            // A required group: repetition (field 3), name, one child.
            elements.push(0x35);
            int(0, &mut elements);
            elements.push(0x18);
            name("a", &mut elements);
            elements.push(0x15);
            int(1, &mut elements);
            elements.push(0);
        }
        // The leaf: an INT32 (field 1), required, named.
        elements.extend([0x15, 2, 0x25, 0, 0x18]);
        name("x", &mut elements);
        elements.push(0);
        // FileMetaData: version 1, the schema list, 0 rows, no row groups.
        let mut footer = vec![0x15, 2, 0x19, 0xFC];
        varint(depth as u64 + 2, &mut footer);
        footer.extend(elements);
        footer.extend([0x16, 0, 0x19, 0x0C, 0]);
        let mut file = b"PAR1".to_vec();
        file.extend(&footer);
        file.extend((footer.len() as u32).to_le_bytes());
        file.extend(b"PAR1");
        file
    }

    /// Files a few kilobytes long that decode to gigabytes, and a schema nested deeper than a
    /// thread's stack, are refused with a reason instead of taking the process down.
    #[test]
    fn hostile_files_are_refused_not_fatal() {
        let err = hostile("nulls_bomb.parquet").unwrap_err();
        assert!(err.contains("100000002 values in 1209 bytes"), "{err}");
        let err = hostile("dictionary_bomb.parquet").unwrap_err();
        assert!(err.contains("bytes of JSON"), "{err}");
        for depth in [100, 20_000, 200_000] {
            let rows = super::rows(deeply_nested(depth), &ReadLimits::default());
            assert_eq!(rows, Ok(Vec::new()), "depth {depth}");
        }
    }

    /// Text stored as plain bytes reads as text, other bytes as base64; dates and times past
    /// the calendar's range stay numbers where the reader's conversion would panic.
    #[test]
    fn odd_column_types_read_as_json() {
        let rows = hostile("odd_types.parquet").unwrap();
        assert_eq!(rows[0]["prompt"], "What is 3+4?");
        assert_eq!(rows[0]["answer"], "7");
        assert_eq!(rows[0]["blob"], "//4=");
        assert_eq!(rows[0]["ts"], i64::MAX);
        assert_eq!(rows[0]["day"], i32::MAX);
        assert_eq!(rows[1]["day"], "1970-01-01");
        assert!(
            rows[1]["ts"].as_str().unwrap().starts_with("1970-01-01"),
            "{rows:?}"
        );
        assert!(
            rows[0]["t"].as_str().unwrap().starts_with("01:02:03"),
            "{rows:?}"
        );
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
