//! The run's resolved config beside each checkpoint (`config.toml`, secrets redacted, summed
//! with the other files), and what a resume changed in it. A resume may change the config on
//! purpose (more steps, another learning rate), but a changed dataset, task, seed or model is
//! easy to pass by mistake: every changed key is said when the run resumes. (A domain whose
//! data changed starts its sampler position afresh: `sluice_data::DatasetRows`.)

use std::collections::BTreeMap;
use std::path::Path;

use sluice_actors::checkpoint::CheckpointError;

/// The file in the checkpoint directory.
pub const CONFIG_FILE: &str = "config.toml";

/// Keys (and `section.` prefixes) a resume changes as a matter of course, left unsaid: where
/// the node listens and what it exports, its supervision, its evaluations, and the step budget
/// (a finished run given more steps).
const UNSAID: &[&str] = &[
    "admin.",
    "metrics.",
    "supervision.",
    "eval.",
    "run.max_steps",
];

/// Longest value shown in a change.
const SHOWN: usize = 80;

/// Writes the resolved config `toml` into the checkpoint being staged.
pub(super) fn stage(staging: &Path, toml: &str) -> Result<(), CheckpointError> {
    let path = staging.join(CONFIG_FILE);
    std::fs::write(&path, toml).map_err(|e| CheckpointError::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    })
}

/// The keys whose values differ between the config of the checkpoint at `root` and `now` (the
/// resolved config as TOML), each as `key: old → new`, less those a resume changes as a matter
/// of course (listen addresses, metrics, supervision, evaluations, `run.max_steps`); `None`
/// when the checkpoint has no config (written before this file) or it cannot be read.
pub fn changes(root: &Path, now: &str) -> Option<Vec<String>> {
    let then = std::fs::read_to_string(root.join(CONFIG_FILE)).ok()?;
    let (then, now) = (flatten(&then)?, flatten(now)?);
    let keys: std::collections::BTreeSet<&String> = then.keys().chain(now.keys()).collect();
    let shown = |v: Option<&String>| match v {
        None => "(absent)".to_owned(),
        Some(v) if v.chars().count() > SHOWN => {
            format!("{}…", v.chars().take(SHOWN).collect::<String>())
        }
        Some(v) => v.clone(),
    };
    Some(
        keys.into_iter()
            .filter(|k| then.get(*k) != now.get(*k))
            .filter(|k| !UNSAID.iter().any(|u| k.starts_with(u)))
            .map(|k| format!("{k}: {} → {}", shown(then.get(k)), shown(now.get(k))))
            .collect(),
    )
}

/// `eval.stop_at_accuracy` of the config saved with the checkpoint at `root`: `None` when the
/// checkpoint has no config (written before this file) or it cannot be read, `Some(None)` when
/// that run had no target.
pub fn saved_target(root: &Path) -> Option<Option<f64>> {
    let text = std::fs::read_to_string(root.join(CONFIG_FILE)).ok()?;
    let table: toml::Table = text.parse().ok()?;
    let eval = table.get("eval").and_then(toml::Value::as_table);
    Some(eval.and_then(|e| e.get("stop_at_accuracy")?.as_float()))
}

/// Every leaf of a TOML document under its dotted key (arrays are leaves).
fn flatten(text: &str) -> Option<BTreeMap<String, String>> {
    fn walk(prefix: &str, table: &toml::Table, out: &mut BTreeMap<String, String>) {
        for (k, v) in table {
            let key = if prefix.is_empty() {
                k.clone()
            } else {
                format!("{prefix}.{k}")
            };
            match v {
                toml::Value::Table(t) => walk(&key, t, out),
                leaf => {
                    out.insert(key, leaf.to_string());
                }
            }
        }
    }
    let table: toml::Table = text.parse().ok()?;
    let mut out = BTreeMap::new();
    walk("", &table, &mut out);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resume_says_each_changed_key() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(
            changes(dir.path(), "[run]\nseed = 0\n"),
            None,
            "no file: nothing to say"
        );
        stage(
            dir.path(),
            "[run]\nseed = 0\nmax_steps = 10\n[data]\ndatasets = [\"math::arithmetic\"]\n",
        )
        .unwrap();
        let same = "[data]\ndatasets = [\"math::arithmetic\"]\n[run]\nmax_steps = 10\nseed = 0\n";
        assert_eq!(changes(dir.path(), same), Some(vec![]));
        let changed = "[run]\nseed = 7\nmax_steps = 99\nname = \"x\"\n[data]\ndatasets = [\"math::gsm\"]\n[admin]\nlisten = \"127.0.0.1:0\"\n";
        assert_eq!(
            changes(dir.path(), changed).unwrap(),
            [
                "data.datasets: [\"math::arithmetic\"] → [\"math::gsm\"]",
                "run.name: (absent) → \"x\"",
                "run.seed: 0 → 7",
            ]
        );
    }
}
