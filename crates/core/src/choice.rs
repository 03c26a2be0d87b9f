//! Values that are one of a fixed set of names (`trainer.loss = "ppo"`, the `admission` knob):
//! the names are the enum's serde names (`#[serde(rename_all = "snake_case")]`), written once on
//! the enum. Parsing, printing and the list of accepted names in an error all come from them, so
//! a variant added to the enum is accepted everywhere, and listed, without another table.
//!
//! [`impl_choice!`](crate::impl_choice) gives an enum [`Choice`], `Display` and `FromStr`.

use std::fmt;

use serde::de::value::StrDeserializer;
use serde::de::{self, DeserializeOwned, Deserializer, Visitor};

/// A fieldless enum whose serde names are its accepted spellings. Implement it with
/// [`impl_choice!`](crate::impl_choice).
pub trait Choice: Copy + PartialEq + DeserializeOwned + 'static {
    /// Every accepted name, in declaration order.
    fn names() -> &'static [&'static str] {
        variant_names::<Self>()
    }

    /// This value's name.
    fn name(self) -> &'static str {
        Self::names()
            .iter()
            .copied()
            .find(|n| parse_exact::<Self>(n) == Some(self))
            .expect("every variant of a Choice enum has a serde name")
    }

    /// The value named `s`; the error lists every accepted name (`expected one of ppo, tis,
    /// decoupled_ppo, got `x``).
    fn parse(s: &str) -> Result<Self, String> {
        parse_exact(s)
            .ok_or_else(|| format!("expected one of {}, got `{s}`", Self::names().join(", ")))
    }
}

/// Implements [`Choice`], `Display` (the name) and `FromStr` ([`Choice::parse`]) for fieldless
/// enums that derive `Deserialize` with their config spellings.
#[macro_export]
macro_rules! impl_choice {
    ($($t:ty),+ $(,)?) => {$(
        impl $crate::choice::Choice for $t {}

        impl ::std::fmt::Display for $t {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str($crate::choice::Choice::name(*self))
            }
        }

        impl ::std::str::FromStr for $t {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                <$t as $crate::choice::Choice>::parse(s)
            }
        }
    )+};
}

fn parse_exact<T: DeserializeOwned>(s: &str) -> Option<T> {
    T::deserialize(StrDeserializer::<de::value::Error>::new(s)).ok()
}

/// The names serde's derive hands to `deserialize_enum` (its `VARIANTS`, renames applied),
/// read by a deserializer that answers nothing else.
fn variant_names<T: DeserializeOwned>() -> &'static [&'static str] {
    match T::deserialize(VariantProbe) {
        Err(Probed(Some(names))) => names,
        _ => panic!(
            "{} is not a fieldless enum deriving Deserialize",
            std::any::type_name::<T>()
        ),
    }
}

struct VariantProbe;

/// The probe's answer, carried as its error: the variant names, when an enum asked.
#[derive(Debug)]
struct Probed(Option<&'static [&'static str]>);

impl fmt::Display for Probed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("variant probe")
    }
}

impl std::error::Error for Probed {}

impl de::Error for Probed {
    fn custom<M: fmt::Display>(_: M) -> Self {
        Self(None)
    }
}

impl<'de> Deserializer<'de> for VariantProbe {
    type Error = Probed;

    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Probed> {
        Err(Probed(None))
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _name: &'static str,
        variants: &'static [&'static str],
        _: V,
    ) -> Result<V::Value, Probed> {
        Err(Probed(Some(variants)))
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct map struct identifier
        ignored_any
    }
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;

    use super::Choice;

    #[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
    #[serde(rename_all = "snake_case")]
    enum Shape {
        Round,
        FlatTop,
        #[serde(rename = "x")]
        Cross,
    }

    crate::impl_choice!(Shape);

    #[test]
    fn names_parse_and_print_come_from_serde() {
        assert_eq!(Shape::names(), ["round", "flat_top", "x"]);
        assert_eq!(Shape::FlatTop.to_string(), "flat_top");
        assert_eq!(Shape::Cross.name(), "x");
        assert_eq!("round".parse::<Shape>(), Ok(Shape::Round));
        assert_eq!(
            "Round".parse::<Shape>().unwrap_err(),
            "expected one of round, flat_top, x, got `Round`"
        );
    }
}
