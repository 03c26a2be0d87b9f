//! `key=value` assignments, as `sluice knobs set` takes them, read into a [`KnobPatch`] through
//! the patch's own serde derive: the knob names and their types come from the struct, so a new
//! knob needs no parser. `domain_mix.<domain>=<weight>` sets one domain's weight; a knob given
//! twice keeps the last value, as a shell's later flag does.
//!
//! The values are read by what each field asks for: a number, a switch (`true`/`false`) or one of
//! an enum's spellings; a refusal names the knob (`domain_mix.math` for a weight).

use std::fmt;

use serde::Deserialize;
use serde::de::value::StringDeserializer;
use serde::de::{self, DeserializeSeed, IntoDeserializer, MapAccess, Visitor};

use super::{KnobError, KnobPatch, knob_names};

/// Parses `assignments` into a patch (see the module doc).
pub(super) fn patch_from_assignments<S: AsRef<str>>(
    assignments: &[S],
) -> Result<KnobPatch, KnobError> {
    let mut scalars: Vec<(String, &str)> = Vec::new();
    let mut mix: Vec<(String, &str)> = Vec::new();
    for assignment in assignments {
        let assignment = assignment.as_ref();
        let (key, value) = assignment
            .split_once('=')
            .ok_or_else(|| KnobError::new(assignment, "expected `knob=value`, found no `=`"))?;
        let key = key.trim();
        if key == "domain_mix" {
            return Err(KnobError::new(
                key,
                "set one domain per assignment: `domain_mix.<domain>=<weight>` \
                 (e.g. `domain_mix.math=0.4`)",
            ));
        }
        let (list, name) = match key.strip_prefix("domain_mix.") {
            Some(domain) if !domain.is_empty() => (&mut mix, domain),
            _ => (&mut scalars, key),
        };
        list.retain(|(k, _)| k != name);
        list.push((name.to_owned(), value));
    }
    let mut entries: Vec<Entry<'_>> = scalars
        .into_iter()
        .map(|(key, value)| Entry {
            shown: key.clone(),
            key,
            value: Assigned::Scalar(value),
        })
        .collect();
    if !mix.is_empty() {
        let weights = mix
            .into_iter()
            .map(|(domain, value)| Entry {
                shown: format!("domain_mix.{domain}"),
                key: domain,
                value: Assigned::Scalar(value),
            })
            .collect();
        entries.push(Entry {
            shown: "domain_mix".into(),
            key: "domain_mix".into(),
            value: Assigned::Map(weights),
        });
    }
    KnobPatch::deserialize(Assignments::new(entries))
        .map_err(|e| KnobError::new(e.knob.unwrap_or_else(|| "knobs".into()), e.reason))
}

/// A refusal while reading the assignments: the reason, and the knob once known.
#[derive(Debug)]
struct AssignError {
    knob: Option<String>,
    reason: String,
}

impl AssignError {
    fn reason(reason: String) -> Self {
        Self { knob: None, reason }
    }

    fn at(mut self, knob: &str) -> Self {
        self.knob.get_or_insert_with(|| knob.to_owned());
        self
    }
}

impl fmt::Display for AssignError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.reason)
    }
}

impl std::error::Error for AssignError {}

impl de::Error for AssignError {
    fn custom<T: fmt::Display>(msg: T) -> Self {
        Self::reason(msg.to_string())
    }

    fn unknown_field(_field: &str, _expected: &'static [&'static str]) -> Self {
        Self::reason(format!(
            "unknown knob; knobs are: {}",
            knob_names().join(", ")
        ))
    }
}

/// One assignment: `key` as serde reads it, `shown` as errors name it.
struct Entry<'a> {
    key: String,
    shown: String,
    value: Assigned<'a>,
}

enum Assigned<'a> {
    /// The text after `=`.
    Scalar(&'a str),
    /// `domain_mix`'s weights, one entry per domain.
    Map(Vec<Entry<'a>>),
}

/// The assignments as a map, the shape of the patch and of `domain_mix`.
struct Assignments<'a> {
    entries: std::vec::IntoIter<Entry<'a>>,
    pending: Option<(String, Assigned<'a>)>,
}

impl<'a> Assignments<'a> {
    fn new(entries: Vec<Entry<'a>>) -> Self {
        Self {
            entries: entries.into_iter(),
            pending: None,
        }
    }
}

impl<'de> de::Deserializer<'de> for Assignments<'_> {
    type Error = AssignError;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, AssignError> {
        visitor.visit_map(self)
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct map struct enum identifier
        ignored_any
    }
}

impl<'de> MapAccess<'de> for Assignments<'_> {
    type Error = AssignError;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, AssignError> {
        let Some(entry) = self.entries.next() else {
            return Ok(None);
        };
        let key: StringDeserializer<AssignError> = entry.key.into_deserializer();
        let shown = entry.shown;
        let read = seed.deserialize(key).map_err(|e| e.at(&shown))?;
        self.pending = Some((shown, entry.value));
        Ok(Some(read))
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(
        &mut self,
        seed: V,
    ) -> Result<V::Value, AssignError> {
        let (shown, value) = self
            .pending
            .take()
            .ok_or_else(|| AssignError::reason("a value without its knob".into()))?;
        seed.deserialize(Value { value }).map_err(|e| e.at(&shown))
    }
}

/// One assignment's value, read as the field asks.
struct Value<'a> {
    value: Assigned<'a>,
}

impl<'a> Value<'a> {
    fn text(&self) -> Result<&'a str, AssignError> {
        match self.value {
            Assigned::Scalar(text) => Ok(text),
            Assigned::Map(_) => Err(AssignError::reason("expected a single value".into())),
        }
    }

    fn parse<T: std::str::FromStr>(&self, expected: &str) -> Result<T, AssignError> {
        let text = self.text()?;
        text.trim()
            .parse()
            .map_err(|_| AssignError::reason(format!("expected {expected}, got `{text}`")))
    }
}

impl<'de> de::Deserializer<'de> for Value<'_> {
    type Error = AssignError;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, AssignError> {
        match self.value {
            Assigned::Scalar(text) => visitor.visit_str(text.trim()),
            Assigned::Map(entries) => visitor.visit_map(Assignments::new(entries)),
        }
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, AssignError> {
        visitor.visit_some(self)
    }

    fn deserialize_bool<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, AssignError> {
        visitor.visit_bool(self.parse("true or false")?)
    }

    fn deserialize_u32<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, AssignError> {
        let v: u64 = self.parse("an integer ≥ 0")?;
        let v = u32::try_from(v).map_err(|_| {
            AssignError::reason(format!("expected an integer ≤ {}, got {v}", u32::MAX))
        })?;
        visitor.visit_u32(v)
    }

    fn deserialize_u64<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, AssignError> {
        visitor.visit_u64(self.parse("an integer ≥ 0")?)
    }

    fn deserialize_f64<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, AssignError> {
        visitor.visit_f64(self.parse("a number")?)
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _name: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, AssignError> {
        let text = self.text()?;
        let name = text.trim();
        if !variants.contains(&name) {
            return Err(AssignError::reason(format!(
                "expected one of {}, got `{name}`",
                variants.join(", ")
            )));
        }
        let name: StringDeserializer<AssignError> = name.to_owned().into_deserializer();
        visitor.visit_enum(name)
    }

    serde::forward_to_deserialize_any! {
        i8 i16 i32 i64 i128 u8 u16 u128 f32 char str string bytes byte_buf unit unit_struct
        newtype_struct seq tuple tuple_struct map struct identifier ignored_any
    }
}
