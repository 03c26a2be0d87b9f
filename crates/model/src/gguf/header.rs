//! The GGUF header checked by Sluice itself, around candle's parser. candle trusts what the
//! header says: it divides by `general.alignment` (a zero panics), ignores an alignment of a
//! type it does not read (and then looks for the tensor data in the wrong place), keeps the
//! last of two metadata entries or tensors with one name, and reads each tensor's bytes
//! wherever its offset points (two tensors may share bytes). [`walk`] runs before candle and
//! [`check_layout`] after it; each refusal names the key or tensor.

use std::collections::HashSet;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;

use candle_core::quantized::gguf_file::{Content, DEFAULT_ALIGNMENT, Value};

use super::reader::SUPPORTED_TYPES;

/// The metadata key holding the tensor data alignment.
const ALIGNMENT_KEY: &str = "general.alignment";

/// Names of ggml types candle does not read, so that a refusal can say what the file holds.
const OTHER_TYPES: &[(u32, &str)] = &[
    (16, "IQ2_XXS"),
    (17, "IQ2_XS"),
    (18, "IQ3_XXS"),
    (19, "IQ1_S"),
    (20, "IQ4_NL"),
    (21, "IQ3_S"),
    (22, "IQ2_S"),
    (23, "IQ4_XS"),
    (24, "I8"),
    (25, "I16"),
    (26, "I32"),
    (27, "I64"),
    (28, "F64"),
    (29, "IQ1_M"),
    (34, "TQ1_0"),
    (35, "TQ2_0"),
    (39, "MXFP4"),
];

/// Walks the header of `path` before candle parses it: the magic and version, where the file
/// ends early, `general.alignment` (a non-zero power of two, of an integer type candle
/// reads), metadata keys and tensor names given twice, tensors of more than 4 dimensions and
/// ggml types candle cannot read. `Err` says what is wrong.
pub(super) fn walk(path: &Path) -> Result<(), String> {
    let file = File::open(path).map_err(|e| e.to_string())?;
    let size = file.metadata().map_err(|e| e.to_string())?.len();
    let mut r = BufReader::new(file);
    let truncated = |what: String| format!("truncated file ({size} bytes): ends in {what}");
    let magic = read_u32(&mut r).ok_or_else(|| truncated("the header".into()))?;
    if magic != 0x4655_4747 {
        return Err(format!(
            "not a GGUF file (magic 0x{magic:08x}, expected \"GGUF\")"
        ));
    }
    let version = read_u32(&mut r).ok_or_else(|| truncated("the header".into()))?;
    if !(2..=3).contains(&version) {
        return Err(format!(
            "GGUF version {version} is not supported (versions 2 and 3 are)"
        ));
    }
    let tensors = read_u64(&mut r).ok_or_else(|| truncated("the header".into()))?;
    let kvs = read_u64(&mut r).ok_or_else(|| truncated("the header".into()))?;
    let mut keys = HashSet::new();
    for i in 0..kvs {
        let key = read_str(&mut r, size).ok_or_else(|| truncated(format!("metadata entry {i}")))?;
        let ty = read_u32(&mut r).ok_or_else(|| truncated(format!("metadata key `{key}`")))?;
        if ty > 12 {
            return Err(format!(
                "metadata key `{key}` has unknown metadata type {ty} (0 to 12 exist)"
            ));
        }
        if key == ALIGNMENT_KEY {
            check_alignment(&mut r, ty)
                .ok_or_else(|| truncated(format!("metadata key `{key}`")))??;
        } else if skip_value(&mut r, ty, size, 0).is_none() {
            return Err(truncated(format!("metadata key `{key}`")));
        }
        if !keys.insert(key.clone()) {
            return Err(format!(
                "metadata key `{key}` appears twice (the second would silently replace the first)"
            ));
        }
    }
    let mut names = HashSet::new();
    for i in 0..tensors {
        let name = read_str(&mut r, size).ok_or_else(|| truncated(format!("tensor entry {i}")))?;
        let dims = read_u32(&mut r).ok_or_else(|| truncated(format!("tensor `{name}`")))?;
        if dims > 4 {
            return Err(format!("tensor `{name}` has {dims} dimensions (at most 4)"));
        }
        for _ in 0..dims {
            read_u64(&mut r).ok_or_else(|| truncated(format!("tensor `{name}`")))?;
        }
        let ty = read_u32(&mut r).ok_or_else(|| truncated(format!("tensor `{name}`")))?;
        if !SUPPORTED_TYPES.iter().any(|&(id, _)| id == ty) {
            let known = OTHER_TYPES.iter().find(|&&(id, _)| id == ty).map_or_else(
                || format!("unknown ggml type {ty}"),
                |(_, n)| format!("ggml type {ty} ({n})"),
            );
            let supported: Vec<&str> = SUPPORTED_TYPES.iter().map(|(_, n)| *n).collect();
            return Err(format!(
                "tensor `{name}` has {known}, which cannot be read; supported: {}",
                supported.join(", ")
            ));
        }
        read_u64(&mut r).ok_or_else(|| truncated(format!("tensor `{name}`")))?;
        if !names.insert(name.clone()) {
            return Err(format!(
                "tensor `{name}` appears twice in the tensor directory"
            ));
        }
    }
    Ok(())
}

/// Reads the value of `general.alignment` (of metadata type `ty`) and checks it: `None` when
/// the file ends, `Some(Err)` when the value cannot be used.
fn check_alignment<R: Read>(r: &mut R, ty: u32) -> Option<Result<(), String>> {
    // The integer types candle reads the alignment from; any other it ignores (and uses 32).
    let value: i64 = match ty {
        0 => i64::from(read_array::<1>(r)?[0]),
        1 => i64::from(i8::from_le_bytes(read_array::<1>(r)?)),
        2 => i64::from(u16::from_le_bytes(read_array::<2>(r)?)),
        3 => i64::from(i16::from_le_bytes(read_array::<2>(r)?)),
        4 => i64::from(read_u32(r)?),
        5 => i64::from(i32::from_le_bytes(read_array::<4>(r)?)),
        other => {
            return Some(Err(format!(
                "metadata key `{ALIGNMENT_KEY}` has metadata type {other} ({}); expected an unsigned 32-bit integer",
                type_name(other)
            )));
        }
    };
    if !u64::try_from(value).is_ok_and(u64::is_power_of_two) {
        return Some(Err(format!(
            "metadata key `{ALIGNMENT_KEY}` = {value}: must be a power of two greater than 0"
        )));
    }
    Some(Ok(()))
}

/// The GGUF spec's name of metadata type `ty`.
fn type_name(ty: u32) -> &'static str {
    match ty {
        0 => "u8",
        1 => "i8",
        2 => "u16",
        3 => "i16",
        4 => "u32",
        5 => "i32",
        6 => "f32",
        7 => "bool",
        8 => "string",
        9 => "array",
        10 => "u64",
        11 => "i64",
        12 => "f64",
        _ => "unknown",
    }
}

/// Checks, after candle parsed the header of a `file_size`-byte file, that every tensor's data
/// lies inside the file at an aligned offset and that no two tensors share bytes (the
/// directory is what llama.cpp's writer lays out: each tensor at its own aligned offset).
pub(super) fn check_layout(content: &Content, file_size: u64) -> Result<(), String> {
    let alignment = match content.metadata.get(ALIGNMENT_KEY) {
        Some(Value::U8(v)) => u64::from(*v),
        Some(Value::U16(v)) => u64::from(*v),
        Some(Value::U32(v)) => u64::from(*v),
        Some(Value::I8(v)) => u64::try_from(*v).unwrap_or(DEFAULT_ALIGNMENT),
        Some(Value::I16(v)) => u64::try_from(*v).unwrap_or(DEFAULT_ALIGNMENT),
        Some(Value::I32(v)) => u64::try_from(*v).unwrap_or(DEFAULT_ALIGNMENT),
        _ => DEFAULT_ALIGNMENT,
    }
    .max(1);
    // (start, end, name): the byte range of each tensor's data in the file.
    let mut ranges: Vec<(u64, u64, &str)> = Vec::with_capacity(content.tensor_infos.len());
    for (name, info) in &content.tensor_infos {
        let ty = info.ggml_dtype;
        let dims = info.shape.dims();
        let elems = dims
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .ok_or_else(|| format!("tensor `{name}` has shape {dims:?}: too many elements"))?;
        let block = ty.block_size();
        if elems % block != 0 {
            return Err(format!(
                "tensor `{name}` ({ty:?}, shape {dims:?}) has {elems} elements, not a multiple of the {ty:?} block of {block}"
            ));
        }
        let bytes = (elems / block)
            .checked_mul(ty.type_size())
            .and_then(|b| u64::try_from(b).ok())
            .ok_or_else(|| format!("tensor `{name}` has shape {dims:?}: too many bytes"))?;
        if info.offset % alignment != 0 {
            return Err(format!(
                "tensor `{name}` has data offset {}, not a multiple of the alignment {alignment}",
                info.offset
            ));
        }
        let start = content.tensor_data_offset.saturating_add(info.offset);
        let remaining = file_size.saturating_sub(start);
        if bytes > remaining {
            return Err(format!(
                "tensor `{name}` ({ty:?}, shape {dims:?}) needs {bytes} bytes at byte {start} of the file, only {remaining} remaining (a truncated file?)"
            ));
        }
        if bytes > 0 {
            ranges.push((start, start + bytes, name));
        }
    }
    ranges.sort_unstable();
    // The range reaching furthest so far: any later start before its end overlaps it.
    let mut furthest: Option<(u64, u64, &str)> = None;
    for range in ranges {
        if let Some((s, e, other)) = furthest
            && range.0 < e
        {
            let (start, end, name) = range;
            return Err(format!(
                "tensors `{other}` (bytes {s}..{e}) and `{name}` (bytes {start}..{end}) overlap: each tensor's data must have bytes of its own"
            ));
        }
        if furthest.is_none_or(|(_, e, _)| range.1 > e) {
            furthest = Some(range);
        }
    }
    Ok(())
}

fn read_array<const N: usize>(r: &mut impl Read) -> Option<[u8; N]> {
    let mut b = [0u8; N];
    r.read_exact(&mut b).ok()?;
    Some(b)
}

fn read_u32(r: &mut impl Read) -> Option<u32> {
    read_array::<4>(r).map(u32::from_le_bytes)
}

fn read_u64(r: &mut impl Read) -> Option<u64> {
    read_array::<8>(r).map(u64::from_le_bytes)
}

/// A length-prefixed string, as candle reads it (trailing NULs dropped, invalid UTF-8
/// replaced), so that names compare as candle will key them.
fn read_str<R: Read>(r: &mut R, size: u64) -> Option<String> {
    let len = read_u64(r)?;
    if len > size {
        return None;
    }
    let mut v = vec![0u8; usize::try_from(len).ok()?];
    r.read_exact(&mut v).ok()?;
    while v.last() == Some(&0) {
        v.pop();
    }
    Some(String::from_utf8_lossy(&v).into_owned())
}

/// Skips one metadata value of type `ty`; `None` when the file ends or the type is unknown.
fn skip_value<R: Read>(r: &mut R, ty: u32, size: u64, depth: usize) -> Option<()> {
    let width: u64 = match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        10..=12 => 8,
        8 => {
            let len = read_u64(r)?;
            if len > size {
                return None;
            }
            len
        }
        9 if depth < 8 => {
            let item = read_u32(r)?;
            let n = read_u64(r)?;
            if n > size {
                return None;
            }
            for _ in 0..n {
                skip_value(r, item, size, depth + 1)?;
            }
            return Some(());
        }
        _ => return None,
    };
    let skipped = std::io::copy(&mut r.by_ref().take(width), &mut std::io::sink()).ok()?;
    (skipped == width).then_some(())
}
