//! What serde knows about [`Knobs`](super::Knobs), read back from the derive: the knob names (the
//! struct's fields, in declaration order) and which of them are numbers or switches (exported as
//! `sluice_node_knob_value{knob}`). Nothing here repeats a knob name: adding a field to `Knobs`
//! adds it to the API's error messages, to `diff` and to the gauges.
//!
//! The derive is probed with a deserializer that offers every field once and records the type
//! each field asks for (`deserialize_bool`, `deserialize_u64`, …) instead of reading any input.

use std::fmt;
use std::sync::OnceLock;

use serde::Deserialize;
use serde::de::value::{MapDeserializer, StrDeserializer};
use serde::de::{self, DeserializeSeed, IntoDeserializer, MapAccess, Visitor};

use super::Knobs;

/// A field of [`Knobs`] and whether its value is a number or a switch (a gauge).
#[derive(Debug, Clone, Copy)]
struct Field {
    name: &'static str,
    numeric: bool,
}

/// The error of the probe: only ever "the type is not one a knob may have".
#[derive(Debug)]
pub(super) struct ProbeError(String);

impl fmt::Display for ProbeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ProbeError {}

impl de::Error for ProbeError {
    fn custom<T: fmt::Display>(msg: T) -> Self {
        Self(msg.to_string())
    }
}

fn fields() -> &'static [Field] {
    static FIELDS: OnceLock<Vec<Field>> = OnceLock::new();
    FIELDS.get_or_init(|| {
        let mut found = Vec::new();
        // The probe answers every type a knob has; a new knob of another type fails here, in
        // every test, rather than going missing from the names.
        if let Err(e) = Knobs::deserialize(Probe { found: &mut found }) {
            panic!("a Knobs field has a type the knob probe does not answer: {e}");
        }
        found
    })
}

/// Every knob name, as the API, the CLI, the config's `[rollout]` keys and the logs spell them.
pub fn knob_names() -> &'static [&'static str] {
    static NAMES: OnceLock<Vec<&'static str>> = OnceLock::new();
    NAMES.get_or_init(|| fields().iter().map(|f| f.name).collect())
}

/// The knobs whose values are numbers or switches: the `knob` label values of
/// `sluice_node_knob_value` (booleans export as 0/1).
pub fn gauge_names() -> &'static [&'static str] {
    static NAMES: OnceLock<Vec<&'static str>> = OnceLock::new();
    NAMES.get_or_init(|| {
        fields()
            .iter()
            .filter(|f| f.numeric)
            .map(|f| f.name)
            .collect()
    })
}

struct Probe<'a> {
    found: &'a mut Vec<Field>,
}

impl<'de> de::Deserializer<'de> for Probe<'_> {
    type Error = ProbeError;

    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, ProbeError> {
        Err(de::Error::custom("the knobs are a struct"))
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, ProbeError> {
        visitor.visit_map(ProbeFields {
            names: fields.iter(),
            current: "",
            found: self.found,
        })
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier
        ignored_any
    }
}

struct ProbeFields<'a> {
    names: std::slice::Iter<'static, &'static str>,
    current: &'static str,
    found: &'a mut Vec<Field>,
}

impl<'de> MapAccess<'de> for ProbeFields<'_> {
    type Error = ProbeError;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, ProbeError> {
        let Some(&name) = self.names.next() else {
            return Ok(None);
        };
        self.current = name;
        let key: StrDeserializer<'_, ProbeError> = name.into_deserializer();
        seed.deserialize(key).map(Some)
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(
        &mut self,
        seed: V,
    ) -> Result<V::Value, ProbeError> {
        seed.deserialize(ProbeValue {
            name: self.current,
            found: self.found,
        })
    }
}

/// One field's value: records whether the field asked for a number or a switch and answers a
/// placeholder of that type.
struct ProbeValue<'a> {
    name: &'static str,
    found: &'a mut Vec<Field>,
}

impl ProbeValue<'_> {
    fn record(self, numeric: bool) {
        self.found.push(Field {
            name: self.name,
            numeric,
        });
    }
}

impl<'de> de::Deserializer<'de> for ProbeValue<'_> {
    type Error = ProbeError;

    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, ProbeError> {
        Err(de::Error::custom(format!(
            "`{}`: expected a number, a switch, a choice or a map",
            self.name
        )))
    }

    fn deserialize_bool<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ProbeError> {
        self.record(true);
        visitor.visit_bool(false)
    }

    fn deserialize_u32<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ProbeError> {
        self.record(true);
        visitor.visit_u32(0)
    }

    fn deserialize_u64<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ProbeError> {
        self.record(true);
        visitor.visit_u64(0)
    }

    fn deserialize_f64<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ProbeError> {
        self.record(true);
        visitor.visit_f64(0.0)
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _name: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, ProbeError> {
        self.record(false);
        let first: StrDeserializer<'_, ProbeError> = variants[0].into_deserializer();
        visitor.visit_enum(first)
    }

    fn deserialize_map<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ProbeError> {
        self.record(false);
        let empty = std::iter::empty::<(&str, f64)>();
        visitor.visit_map(MapDeserializer::new(empty))
    }

    serde::forward_to_deserialize_any! {
        i8 i16 i32 i64 i128 u8 u16 u128 f32 char str string bytes byte_buf option unit
        unit_struct newtype_struct seq tuple tuple_struct struct identifier ignored_any
    }
}
