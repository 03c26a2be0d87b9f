//! `--set key.path=value` overrides, applied to the TOML tree before deserialization.

use std::str::FromStr;

/// One `--set` override.
#[derive(Debug, Clone, PartialEq)]
pub struct Override {
    /// Dotted key path, e.g. `rollout.group_size`.
    pub key: String,
    /// The value, parsed as a TOML value when it is one (`8`, `0.5`, `true`, `"x"`, `[1, 2]`) and
    /// taken as a plain string otherwise (`drain`, `runs/a`).
    pub value: toml::Value,
}

impl FromStr for Override {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (key, value) = s
            .split_once('=')
            .ok_or_else(|| format!("--set {s}: expected `key.path=value`"))?;
        let key = key.trim();
        if key.is_empty() || key.split('.').any(|part| part.trim().is_empty()) {
            return Err(format!(
                "--set {s}: `{key}` is not a key path (expected `section.key`)"
            ));
        }
        let value = value.trim();
        let digits = value.strip_prefix(['+', '-']).unwrap_or(value);
        if !digits.is_empty()
            && digits.bytes().all(|b| b.is_ascii_digit() || b == b'_')
            && value.replace('_', "").parse::<i64>().is_err()
        {
            // Not a string that happens to be digits: an integer TOML cannot hold.
            return Err(format!(
                "--set {s}: {value} is beyond TOML's integers ({} to {}); quote it for a string",
                i64::MIN,
                i64::MAX
            ));
        }
        let parsed = format!("v = {value}")
            .parse::<toml::Table>()
            .ok()
            .and_then(|mut t| t.remove("v"))
            .unwrap_or_else(|| toml::Value::String(value.to_owned()));
        Ok(Self {
            key: key.to_owned(),
            value: parsed,
        })
    }
}

impl Override {
    /// Writes the value into `tree`, creating intermediate tables.
    pub(crate) fn apply(&self, tree: &mut toml::Table) -> Result<(), String> {
        let parts: Vec<&str> = self.key.split('.').map(str::trim).collect();
        let (last, parents) = parts.split_last().expect("key path validated non-empty");
        let mut table = tree;
        let mut walked = String::new();
        for part in parents {
            if !walked.is_empty() {
                walked.push('.');
            }
            walked.push_str(part);
            let entry = table
                .entry((*part).to_owned())
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            table = match entry {
                toml::Value::Table(t) => t,
                other => {
                    return Err(format!(
                        "`{walked}` is not a table (found {}), so it has no key `{last}`",
                        other.type_str()
                    ));
                }
            };
        }
        table.insert((*last).to_owned(), self.value.clone());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_toml_cannot_hold_are_refused_not_read_as_strings() {
        let err = "run.max_steps=18446744073709551615"
            .parse::<Override>()
            .unwrap_err();
        assert_eq!(
            err,
            "--set run.max_steps=18446744073709551615: 18446744073709551615 is beyond TOML's \
             integers (-9223372036854775808 to 9223372036854775807); quote it for a string"
        );
        assert!("run.seed=-9223372036854775809".parse::<Override>().is_err());
        let o: Override = "run.seed=9_223_372_036_854_775_807".parse().unwrap();
        assert_eq!(o.value, toml::Value::Integer(i64::MAX));
    }

    #[test]
    fn values_are_typed_when_they_parse() {
        let o: Override = "rollout.group_size=4".parse().unwrap();
        assert_eq!(o.value, toml::Value::Integer(4));
        let o: Override = "rollout.weight_update_mode=drain".parse().unwrap();
        assert_eq!(o.value, toml::Value::String("drain".into()));
        let o: Override = "engine.remote_urls=[\"http://a:1\"]".parse().unwrap();
        assert!(o.value.is_array());
        let o: Override = "run.output_dir=/tmp/x y".parse().unwrap();
        assert_eq!(o.value, toml::Value::String("/tmp/x y".into()));
    }

    #[test]
    fn malformed_overrides() {
        assert!("rollout.group_size".parse::<Override>().is_err());
        assert!("=3".parse::<Override>().is_err());
        assert!("rollout..x=3".parse::<Override>().is_err());
        let mut tree: toml::Table = "run = 3".parse().unwrap();
        let o: Override = "run.name=x".parse().unwrap();
        assert_eq!(
            o.apply(&mut tree).unwrap_err(),
            "`run` is not a table (found integer), so it has no key `name`"
        );
    }
}
