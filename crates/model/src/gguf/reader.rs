//! Reading a GGUF file through candle's parser: typed metadata accessors whose errors name the
//! key, and tensors dequantised to f32 with errors naming the tensor. When candle cannot parse
//! the header, [`diagnose_header`] walks it again to say which tensor or key was at fault.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

use candle_core::quantized::GgmlDType;
use candle_core::quantized::gguf_file::{Content, Value, VersionedMagic};
use candle_core::{DType, Device, Tensor};

use crate::error::{ModelError, Result};

/// The ggml tensor types candle reads (and so the importer accepts), with their ggml ids.
pub const SUPPORTED_TYPES: &[(u32, &str)] = &[
    (0, "F32"),
    (1, "F16"),
    (2, "Q4_0"),
    (3, "Q4_1"),
    (6, "Q5_0"),
    (7, "Q5_1"),
    (8, "Q8_0"),
    (9, "Q8_1"),
    (10, "Q2_K"),
    (11, "Q3_K"),
    (12, "Q4_K"),
    (13, "Q5_K"),
    (14, "Q6_K"),
    (15, "Q8_K"),
    (30, "BF16"),
];

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

/// An open GGUF file: its parsed header and a reader for tensor data.
pub struct GgufFile {
    path: PathBuf,
    content: Content,
    reader: BufReader<File>,
}

impl GgufFile {
    /// Opens `path` and parses its header (metadata and tensor directory).
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| ModelError::io(path, e))?;
        let mut reader = BufReader::new(file);
        let content = match Content::read(&mut reader) {
            Ok(c) => c,
            Err(e) => {
                let reason = diagnose_header(path)
                    .unwrap_or_else(|| format!("not a readable GGUF file: {e}"));
                return Err(gguf_err(path, reason));
            }
        };
        if matches!(content.magic, VersionedMagic::GgufV1) {
            return Err(gguf_err(
                path,
                "GGUF version 1 is not supported (versions 2 and 3 are)",
            ));
        }
        Ok(Self {
            path: path.to_owned(),
            content,
            reader,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// An import error about this file.
    pub fn err(&self, reason: impl Into<String>) -> ModelError {
        gguf_err(&self.path, reason)
    }

    /// The metadata value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.content.metadata.get(key)
    }

    /// A required string value.
    pub fn string(&self, key: &str) -> Result<&str> {
        self.string_opt(key)?
            .ok_or_else(|| self.err(format!("metadata key `{key}` is missing")))
    }

    /// An optional string value.
    pub fn string_opt(&self, key: &str) -> Result<Option<&str>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.err(format!(
                "metadata key `{key}`: expected a string, got {v:?}"
            ))),
        }
    }

    /// An optional non-negative integer value of any integer width.
    pub fn uint_opt(&self, key: &str) -> Result<Option<u64>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let n = match *v {
            Value::U8(x) => Some(u64::from(x)),
            Value::U16(x) => Some(u64::from(x)),
            Value::U32(x) => Some(u64::from(x)),
            Value::U64(x) => Some(x),
            Value::I8(x) => u64::try_from(x).ok(),
            Value::I16(x) => u64::try_from(x).ok(),
            Value::I32(x) => u64::try_from(x).ok(),
            Value::I64(x) => u64::try_from(x).ok(),
            _ => None,
        };
        n.map(Some).ok_or_else(|| {
            self.err(format!(
                "metadata key `{key}`: expected a non-negative integer, got {v:?}"
            ))
        })
    }

    /// A required positive integer value.
    pub fn usize_req(&self, key: &str) -> Result<usize> {
        match self.uint_opt(key)? {
            Some(n) if n > 0 => Ok(n as usize),
            Some(_) => Err(self.err(format!("metadata key `{key}` must be positive"))),
            None => Err(self.err(format!("metadata key `{key}` is missing"))),
        }
    }

    /// An optional token id.
    pub fn token_id_opt(&self, key: &str) -> Result<Option<u32>> {
        match self.uint_opt(key)? {
            None => Ok(None),
            Some(n) => u32::try_from(n)
                .map(Some)
                .map_err(|_| self.err(format!("metadata key `{key}`: {n} is not a token id"))),
        }
    }

    /// An optional float value (f32 or f64).
    pub fn float_opt(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            // The shortest decimal that is this f32 (`1e-5`, not `9.999999747378752e-6`): the
            // value the converter wrote before narrowing it.
            Some(Value::F32(x)) => Ok(Some(x.to_string().parse().unwrap_or(f64::from(*x)))),
            Some(Value::F64(x)) => Ok(Some(*x)),
            Some(v) => Err(self.err(format!("metadata key `{key}`: expected a float, got {v:?}"))),
        }
    }

    /// An optional boolean value.
    pub fn bool_opt(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.err(format!("metadata key `{key}`: expected a bool, got {v:?}"))),
        }
    }

    /// An optional array of strings.
    pub fn strings_opt(&self, key: &str) -> Result<Option<Vec<&str>>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let Value::Array(items) = v else {
            return Err(self.err(format!("metadata key `{key}`: expected an array")));
        };
        items
            .iter()
            .enumerate()
            .map(|(i, item)| match item {
                Value::String(s) => Ok(s.as_str()),
                other => Err(self.err(format!(
                    "metadata key `{key}`[{i}]: expected a string, got {other:?}"
                ))),
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    /// An optional array of numbers, as f64 (token types, scores).
    pub fn numbers_opt(&self, key: &str) -> Result<Option<Vec<f64>>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let Value::Array(items) = v else {
            return Err(self.err(format!("metadata key `{key}`: expected an array")));
        };
        items
            .iter()
            .enumerate()
            .map(|(i, item)| {
                number(item).ok_or_else(|| {
                    self.err(format!(
                        "metadata key `{key}`[{i}]: expected a number, got {item:?}"
                    ))
                })
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    /// Whether the file holds tensor `name`.
    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// Names of every tensor in the file, sorted.
    pub fn tensor_names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self
            .content
            .tensor_infos
            .keys()
            .map(String::as_str)
            .collect();
        names.sort_unstable();
        names
    }

    /// Shape of tensor `name` (outermost dimension first, as in HF), if present.
    pub fn tensor_shape(&self, name: &str) -> Option<&[usize]> {
        self.content.tensor_infos.get(name).map(|t| t.shape.dims())
    }

    /// The ggml type of tensor `name`, if present.
    pub fn tensor_type(&self, name: &str) -> Option<GgmlDType> {
        self.content.tensor_infos.get(name).map(|t| t.ggml_dtype)
    }

    /// How many tensors of each ggml type the file holds (`{"Q4_1": 210, …}`).
    pub fn type_counts(&self) -> BTreeMap<String, usize> {
        let mut counts = BTreeMap::new();
        for info in self.content.tensor_infos.values() {
            *counts.entry(format!("{:?}", info.ggml_dtype)).or_insert(0) += 1;
        }
        counts
    }

    /// Tensor `name` dequantised to f32 on the CPU.
    pub fn tensor_f32(&mut self, name: &str) -> Result<Tensor> {
        let q = self
            .content
            .tensor(&mut self.reader, name, &Device::Cpu)
            .map_err(|e| gguf_err(&self.path, format!("tensor `{name}`: {e}")))?;
        q.dequantize(&Device::Cpu)
            .and_then(|t| t.to_dtype(DType::F32))
            .map_err(|e| gguf_err(&self.path, format!("tensor `{name}`: dequantising: {e}")))
    }
}

/// An import error about `path`.
pub(crate) fn gguf_err(path: &Path, reason: impl Into<String>) -> ModelError {
    ModelError::Gguf {
        path: path.to_owned(),
        reason: reason.into(),
    }
}

fn number(v: &Value) -> Option<f64> {
    Some(match *v {
        Value::U8(x) => f64::from(x),
        Value::I8(x) => f64::from(x),
        Value::U16(x) => f64::from(x),
        Value::I16(x) => f64::from(x),
        Value::U32(x) => f64::from(x),
        Value::I32(x) => f64::from(x),
        Value::U64(x) => x as f64,
        Value::I64(x) => x as f64,
        Value::F32(x) => f64::from(x),
        Value::F64(x) => x,
        _ => return None,
    })
}

/// Walks the header of a file candle refused, to name what is wrong: a tensor whose ggml type
/// is not supported, or where the file ends. `None` when the walk finds nothing more specific.
pub(crate) fn diagnose_header(path: &Path) -> Option<String> {
    let file = File::open(path).ok()?;
    let size = file.metadata().ok()?.len();
    let mut r = BufReader::new(file);
    let magic = read_u32(&mut r)?;
    if magic != 0x4655_4747 {
        return Some(format!(
            "not a GGUF file (magic 0x{magic:08x}, expected \"GGUF\")"
        ));
    }
    let version = read_u32(&mut r)?;
    if !(2..=3).contains(&version) {
        return Some(format!(
            "GGUF version {version} is not supported (versions 2 and 3 are)"
        ));
    }
    let truncated = |what: String| Some(format!("truncated file ({size} bytes): ends in {what}"));
    let Some(tensors) = read_u64(&mut r) else {
        return truncated("the header".into());
    };
    let Some(kvs) = read_u64(&mut r) else {
        return truncated("the header".into());
    };
    for i in 0..kvs {
        let Some(key) = read_str(&mut r, size) else {
            return truncated(format!("metadata entry {i}"));
        };
        let Some(ty) = read_u32(&mut r) else {
            return truncated(format!("metadata key `{key}`"));
        };
        if skip_value(&mut r, ty, size, 0).is_none() {
            return truncated(format!("metadata key `{key}`"));
        }
    }
    for i in 0..tensors {
        let Some(name) = read_str(&mut r, size) else {
            return truncated(format!("tensor entry {i}"));
        };
        let Some(dims) = read_u32(&mut r) else {
            return truncated(format!("tensor `{name}`"));
        };
        if dims > 4 {
            return Some(format!("tensor `{name}` has {dims} dimensions (at most 4)"));
        }
        for _ in 0..dims {
            read_u64(&mut r)?;
        }
        let Some(ty) = read_u32(&mut r) else {
            return truncated(format!("tensor `{name}`"));
        };
        if !SUPPORTED_TYPES.iter().any(|&(id, _)| id == ty) {
            let known = OTHER_TYPES.iter().find(|&&(id, _)| id == ty).map_or_else(
                || format!("unknown ggml type {ty}"),
                |(_, n)| format!("ggml type {ty} ({n})"),
            );
            let supported: Vec<&str> = SUPPORTED_TYPES.iter().map(|(_, n)| *n).collect();
            return Some(format!(
                "tensor `{name}` has {known}, which cannot be read; supported: {}",
                supported.join(", ")
            ));
        }
        read_u64(&mut r)?;
    }
    None
}

fn read_u32(r: &mut impl Read) -> Option<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b).ok()?;
    Some(u32::from_le_bytes(b))
}

fn read_u64(r: &mut impl Read) -> Option<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b).ok()?;
    Some(u64::from_le_bytes(b))
}

fn read_str<R: Read>(r: &mut R, size: u64) -> Option<String> {
    let len = read_u64(r)?;
    if len > size {
        return None;
    }
    let mut v = vec![0u8; len as usize];
    r.read_exact(&mut v).ok()?;
    Some(String::from_utf8_lossy(&v).into_owned())
}

/// Skips one metadata value of type `ty`; `None` when the file ends or the type is unknown.
fn skip_value<R: Read>(r: &mut R, ty: u32, size: u64, depth: usize) -> Option<()> {
    let width: i64 = match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        10..=12 => 8,
        8 => {
            let len = read_u64(r)?;
            if len > size {
                return None;
            }
            let skipped = std::io::copy(&mut r.by_ref().take(len), &mut std::io::sink()).ok()?;
            return (skipped == len).then_some(());
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
    let mut b = vec![0u8; width as usize];
    r.read_exact(&mut b).ok()?;
    Some(())
}
