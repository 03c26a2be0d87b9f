//! Reading a GGUF file through candle's parser: typed metadata accessors whose errors name the
//! key, and tensors dequantised to f32 with errors naming the tensor. The header is checked by
//! [`header`](super::header) before candle reads it and after, so that candle never sees a
//! value it would panic on or read garbage by.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use candle_core::quantized::GgmlDType;
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::{DType, Device, Tensor};

use super::header;
use crate::error::{ModelError, Result, candle_message};

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
        let file_size = file.metadata().map_err(|e| ModelError::io(path, e))?.len();
        // The walk refuses versions other than 2 and 3, so candle never parses a v1 file.
        header::walk(path).map_err(|reason| gguf_err(path, reason))?;
        let mut reader = BufReader::new(file);
        let content = Content::read(&mut reader).map_err(|e| {
            gguf_err(
                path,
                format!("not a readable GGUF file: {}", candle_message(&e)),
            )
        })?;
        header::check_layout(&content, file_size).map_err(|reason| gguf_err(path, reason))?;
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

    /// An optional finite float value (f32 or f64). NaN and infinities are refused: written to
    /// `config.json` they would become `null`, which reads back as the default.
    pub fn float_opt(&self, key: &str) -> Result<Option<f64>> {
        let x = match self.get(key) {
            None => return Ok(None),
            // The shortest decimal that is this f32 (`1e-5`, not `9.999999747378752e-6`): the
            // value the converter wrote before narrowing it.
            Some(Value::F32(x)) => x.to_string().parse().unwrap_or(f64::from(*x)),
            Some(Value::F64(x)) => *x,
            Some(v) => {
                return Err(self.err(format!("metadata key `{key}`: expected a float, got {v:?}")));
            }
        };
        if !x.is_finite() {
            return Err(self.err(format!(
                "metadata key `{key}` = {x}: expected a finite number"
            )));
        }
        Ok(Some(x))
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

    /// An optional array of finite numbers, as f64 (token types, scores).
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
            .map(|(i, item)| match number(item) {
                Some(x) if x.is_finite() => Ok(x),
                Some(x) => Err(self.err(format!(
                    "metadata key `{key}`[{i}] = {x}: expected a finite number"
                ))),
                None => Err(self.err(format!(
                    "metadata key `{key}`[{i}]: expected a number, got {item:?}"
                ))),
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
            .map_err(|e| {
                gguf_err(
                    &self.path,
                    format!("tensor `{name}`: {}", candle_message(&e)),
                )
            })?;
        q.dequantize(&Device::Cpu)
            .and_then(|t| t.to_dtype(DType::F32))
            .map_err(|e| {
                gguf_err(
                    &self.path,
                    format!("tensor `{name}`: dequantising: {}", candle_message(&e)),
                )
            })
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
