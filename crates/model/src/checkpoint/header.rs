//! Why a safetensors header does not describe its file, in words naming the tensor. The
//! safetensors crate stops at the first range that does not start where the previous one ended
//! and names the tensor *after* the gap (a tensor removed from the header blames its healthy
//! neighbour), or says "invalid shape, data type, or offset" naming none; this walk says which
//! tensor's bytes are wrong and what was expected.

use safetensors::Dtype;
use serde_json::{Map, Value};

/// What is wrong with the tensor ranges of the safetensors file `bytes`, whose header the crate
/// refused; `None` when the walk finds nothing (the crate's own message is then used).
pub(super) fn diagnose(bytes: &[u8]) -> Option<String> {
    let n = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
    let end = 8usize.checked_add(usize::try_from(n).ok()?)?;
    let header: Map<String, Value> = serde_json::from_slice(bytes.get(8..end)?).ok()?;
    let data_len = (bytes.len() - end) as u64;
    // (start, end, name) of each tensor's data, relative to the end of the header.
    let mut ranges: Vec<(u64, u64, &str)> = Vec::with_capacity(header.len());
    for (name, entry) in &header {
        if name == "__metadata__" {
            continue;
        }
        match tensor_range(name, entry)? {
            Ok((start, end)) => ranges.push((start, end, name)),
            Err(reason) => return Some(reason),
        }
    }
    ranges.sort_unstable();
    // Overlaps first: a range moved onto its neighbour also leaves a gap, and the overlap names
    // the tensor that moved.
    for pair in ranges.windows(2) {
        let [(_, prev_end, prev), (start, _, name)] = pair else {
            continue;
        };
        if start < prev_end {
            return Some(format!(
                "tensors `{prev}` and `{name}` overlap: `{prev}` ends at byte {prev_end} of the data, `{name}` starts at {start}"
            ));
        }
    }
    let mut covered: Option<(u64, &str)> = None;
    for &(start, end, name) in &ranges {
        let (prev_end, prev) = covered.unwrap_or((0, ""));
        if start > prev_end {
            let after = if prev.is_empty() {
                String::new()
            } else {
                format!(" after tensor `{prev}`")
            };
            return Some(format!(
                "bytes {prev_end}..{start} of the data{after} belong to no tensor: the next, `{name}`, starts at {start} \
                 (a tensor missing from the header?)"
            ));
        }
        covered = Some((end, name));
    }
    let (last_end, last) = covered.unwrap_or((0, ""));
    if last_end > data_len {
        return Some(format!(
            "tensor `{last}` ends at byte {last_end} of the data, which holds only {data_len} bytes (a truncated file?)"
        ));
    }
    if last_end < data_len {
        let after = if last.is_empty() {
            String::new()
        } else {
            format!(" after tensor `{last}`")
        };
        return Some(format!(
            "bytes {last_end}..{data_len} of the data{after} belong to no tensor (a tensor missing from the header?)"
        ));
    }
    None
}

/// The `data_offsets` of header entry `name`, checked against its dtype and shape: `None` when
/// the entry is malformed (the crate's JSON error says so), `Some(Err)` naming the mismatch.
fn tensor_range(name: &str, entry: &Value) -> Option<Result<(u64, u64), String>> {
    let dtype: Dtype = serde_json::from_value(entry.get("dtype")?.clone()).ok()?;
    let shape: Vec<u64> = serde_json::from_value(entry.get("shape")?.clone()).ok()?;
    let [start, end]: [u64; 2] = serde_json::from_value(entry.get("data_offsets")?.clone()).ok()?;
    if end < start {
        return Some(Err(format!(
            "tensor `{name}`: data_offsets [{start}, {end}] end before they start"
        )));
    }
    let bits = shape
        .iter()
        .try_fold(1u64, |n, &d| n.checked_mul(d))
        .and_then(|n| n.checked_mul(dtype.bitsize() as u64));
    let Some(bits) = bits else {
        return Some(Err(format!(
            "tensor `{name}`: shape {shape:?} of {dtype:?} is too large"
        )));
    };
    if bits % 8 != 0 {
        return Some(Err(format!(
            "tensor `{name}`: shape {shape:?} of {dtype:?} is not a whole number of bytes"
        )));
    }
    let needed = bits / 8;
    if end - start != needed {
        return Some(Err(format!(
            "tensor `{name}`: {dtype:?} of shape {shape:?} needs {needed} bytes, its data_offsets [{start}, {end}] hold {}",
            end - start
        )));
    }
    Some(Ok((start, end)))
}
