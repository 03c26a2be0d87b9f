//! Config errors: one line naming where (file, and `--set` or environment when that is the
//! source), which key, and what was expected.

use std::fmt;

/// Which class of problem a [`ConfigError`] is; its [`ConfigErrorKind::as_str`] is the stable kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfigErrorKind {
    /// The file could not be read.
    Io,
    /// The file is not valid TOML.
    Syntax,
    /// A key that no section defines.
    UnknownKey,
    /// A value of the wrong type.
    Type,
    /// A value of the right type outside its allowed range or set.
    Value,
    /// A malformed `--set` override.
    Override,
}

impl ConfigErrorKind {
    /// Short stable name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Io => "config_io",
            Self::Syntax => "config_syntax",
            Self::UnknownKey => "config_unknown_key",
            Self::Type => "config_type",
            Self::Value => "config_value",
            Self::Override => "config_override",
        }
    }
}

/// A config could not be loaded; nothing was started.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ConfigError {
    /// The file (or `<string>` for in-memory configs).
    pub file: String,
    /// Dotted key path (`rollout.group_size`), when the problem is in one key.
    pub key: Option<String>,
    /// Where the offending value came from, when not the file itself (`--set`, `$SLUICE_ADMIN_TOKEN`).
    pub via: Option<String>,
    /// What was expected and what was found.
    pub message: String,
    /// The class of problem.
    pub kind: ConfigErrorKind,
}

impl ConfigError {
    /// A problem with the whole file (unreadable, not TOML).
    pub fn file(file: &str, kind: ConfigErrorKind, message: impl Into<String>) -> Self {
        Self {
            file: file.to_owned(),
            key: None,
            via: None,
            message: message.into(),
            kind,
        }
    }

    /// A problem with one key.
    pub fn key(
        file: &str,
        key: impl Into<String>,
        kind: ConfigErrorKind,
        message: impl Into<String>,
    ) -> Self {
        Self {
            file: file.to_owned(),
            key: Some(key.into()),
            via: None,
            message: message.into(),
            kind,
        }
    }

    /// Marks the offending value as coming from `via` (e.g. `--set`).
    pub fn via(mut self, via: impl Into<String>) -> Self {
        self.via = Some(via.into());
        self
    }

    /// Short stable name of the error class.
    pub fn kind(&self) -> &'static str {
        self.kind.as_str()
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: ", self.file)?;
        if let Some(via) = &self.via {
            write!(f, "{via} ")?;
        }
        if let Some(key) = &self.key {
            write!(f, "{key}: ")?;
        }
        // One line, always: multi-line TOML parser reports are folded.
        let mut first = true;
        for line in self
            .message
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
        {
            if !first {
                f.write_str(" ")?;
            }
            f.write_str(line)?;
            first = false;
        }
        Ok(())
    }
}

/// Edit distance between two short strings (for "did you mean" suggestions).
pub fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, &cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != cb);
            cur[j + 1] = sub.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

/// The candidate closest to `word`, if it is close enough to be a plausible typo.
pub fn closest<'a>(word: &str, candidates: &[&'a str]) -> Option<&'a str> {
    candidates
        .iter()
        .map(|c| (edit_distance(word, c), *c))
        .filter(|(d, c)| *d <= (c.len().max(word.len()) / 3).max(2))
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suggestions() {
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        let keys = ["group_size", "groups_per_step", "max_turns"];
        assert_eq!(closest("grop_size", &keys), Some("group_size"));
        assert_eq!(closest("max_turn", &keys), Some("max_turns"));
        assert_eq!(closest("zzzzzz", &keys), None);
    }
}
