//! Python's `json.dumps` output format, for the `tojson` filter of chat templates.
//!
//! transformers replaces Jinja's `tojson` with `json.dumps(x, ensure_ascii=False, indent=None,
//! separators=None, sort_keys=False)`: `", "` and `": "` separators, no HTML escaping. Tool
//! schemas are printed into prompts with it, so byte-exact output matters for matching the
//! prompts a model was trained on.

use minijinja::value::ValueKind;

/// A JSON tree that keeps object keys in the order the template values have them (serde_json's
/// map would sort them unless its `preserve_order` feature is on).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Json {
    Null,
    Bool(bool),
    Int(i128),
    Float(f64),
    Str(String),
    Array(Vec<Json>),
    Object(Vec<(String, Json)>),
}

impl Json {
    /// Converts a template value; functions and other non-data values are refused.
    pub(crate) fn from_template(v: &minijinja::Value) -> Result<Self, minijinja::Error> {
        let bad = |what: &str| {
            minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                format!("tojson: cannot serialize {what}"),
            )
        };
        Ok(match v.kind() {
            ValueKind::Undefined | ValueKind::None => Json::Null,
            ValueKind::Bool => Json::Bool(v.is_true()),
            ValueKind::Number => match i128::try_from(v.clone()) {
                Ok(i) if v.is_integer() => Json::Int(i),
                _ => Json::Float(f64::try_from(v.clone()).map_err(|_| bad("a number"))?),
            },
            ValueKind::String => Json::Str(v.as_str().unwrap_or_default().to_owned()),
            ValueKind::Bytes => {
                Json::Str(String::from_utf8_lossy(v.as_bytes().unwrap_or_default()).into_owned())
            }
            ValueKind::Seq | ValueKind::Iterable => Json::Array(
                v.try_iter()?
                    .map(|item| Json::from_template(&item))
                    .collect::<Result<_, _>>()?,
            ),
            ValueKind::Map => {
                let mut entries = Vec::new();
                for key in v.try_iter()? {
                    let item = v.get_item(&key)?;
                    let key = match key.as_str() {
                        Some(s) => s.to_owned(),
                        None => key.to_string(),
                    };
                    entries.push((key, Json::from_template(&item)?));
                }
                Json::Object(entries)
            }
            _ => return Err(bad("this value")),
        })
    }

    #[cfg(test)]
    fn from_serde(v: &serde_json::Value) -> Self {
        match v {
            serde_json::Value::Null => Json::Null,
            serde_json::Value::Bool(b) => Json::Bool(*b),
            serde_json::Value::Number(n) => match n.as_i64() {
                Some(i) => Json::Int(i.into()),
                None => Json::Float(n.as_f64().unwrap_or(0.0)),
            },
            serde_json::Value::String(s) => Json::Str(s.clone()),
            serde_json::Value::Array(a) => Json::Array(a.iter().map(Json::from_serde).collect()),
            serde_json::Value::Object(m) => Json::Object(
                m.iter()
                    .map(|(k, v)| (k.clone(), Json::from_serde(v)))
                    .collect(),
            ),
        }
    }
}

/// Formatting options, as `json.dumps` takes them.
#[derive(Debug, Clone)]
pub(crate) struct DumpOptions {
    /// Spaces per nesting level; `None` prints on one line.
    pub indent: Option<usize>,
    /// `(item, key)` separators; default `(", ", ": ")`, or `(",", ": ")` with an indent.
    pub separators: Option<(String, String)>,
    /// Sort object keys.
    pub sort_keys: bool,
    /// Escape every non-ASCII character as `\uXXXX`.
    pub ensure_ascii: bool,
}

/// `json.dumps(value, …)`.
pub(crate) fn dumps(value: &Json, opts: &DumpOptions) -> String {
    let (item_sep, key_sep) = opts.separators.clone().unwrap_or_else(|| {
        let item = if opts.indent.is_some() { "," } else { ", " };
        (item.to_owned(), ": ".to_owned())
    });
    let mut out = String::new();
    write_value(&mut out, value, opts, &item_sep, &key_sep, 0);
    out
}

fn newline(out: &mut String, indent: Option<usize>, level: usize) {
    if let Some(n) = indent {
        out.push('\n');
        out.extend(std::iter::repeat_n(' ', n * level));
    }
}

fn write_value(
    out: &mut String,
    value: &Json,
    opts: &DumpOptions,
    item_sep: &str,
    key_sep: &str,
    level: usize,
) {
    match value {
        Json::Null => out.push_str("null"),
        Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Json::Int(i) => out.push_str(&i.to_string()),
        Json::Float(f) => write_float(out, *f),
        Json::Str(s) => write_string(out, s, opts.ensure_ascii),
        Json::Array(items) => {
            if items.is_empty() {
                out.push_str("[]");
                return;
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, opts.indent, level + 1);
                write_value(out, item, opts, item_sep, key_sep, level + 1);
            }
            newline(out, opts.indent, level);
            out.push(']');
        }
        Json::Object(map) => {
            if map.is_empty() {
                out.push_str("{}");
                return;
            }
            let mut entries: Vec<(&String, &Json)> = map.iter().map(|(k, v)| (k, v)).collect();
            if opts.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, opts.indent, level + 1);
                write_string(out, k, opts.ensure_ascii);
                out.push_str(key_sep);
                write_value(out, v, opts, item_sep, key_sep, level + 1);
            }
            newline(out, opts.indent, level);
            out.push('}');
        }
    }
}

/// Floats as Python's `repr` (`1.0`, `0.1`, `1e-07`); NaN and infinities as Python prints them.
fn write_float(out: &mut String, f: f64) {
    if f.is_nan() {
        out.push_str("NaN");
        return;
    }
    if f.is_infinite() {
        out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" });
        return;
    }
    let s = format!("{f:?}");
    // Rust prints `1e-7`, Python `1e-07`: two-digit exponents with a sign.
    match s.split_once('e') {
        Some((mantissa, exp)) => {
            let (sign, digits) = match exp.strip_prefix('-') {
                Some(d) => ("-", d),
                None => ("+", exp),
            };
            out.push_str(&format!("{mantissa}e{sign}{digits:0>2}"));
        }
        None => out.push_str(&s),
    }
}

fn write_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for ch in s.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c if ensure_ascii && !c.is_ascii() => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn default() -> DumpOptions {
        DumpOptions {
            indent: None,
            separators: None,
            sort_keys: false,
            ensure_ascii: false,
        }
    }

    #[test]
    fn matches_python_json_dumps() {
        let v = Json::from_serde(
            &json!({"b": [1, 2.5, null, true], "a": "é\n\"<x>\"", "c": {}, "d": 1e-7}),
        );
        // Python prints insertion order, which serde_json keeps (`preserve_order`).
        assert_eq!(
            dumps(&v, &default()),
            r#"{"b": [1, 2.5, null, true], "a": "é\n\"<x>\"", "c": {}, "d": 1e-07}"#
        );
        let opts = DumpOptions {
            indent: Some(2),
            ensure_ascii: true,
            ..default()
        };
        assert_eq!(
            dumps(&Json::from_serde(&json!({"k": ["é", 1]})), &opts),
            "{\n  \"k\": [\n    \"\\u00e9\",\n    1\n  ]\n}"
        );
    }
}
