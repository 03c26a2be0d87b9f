//! `sluice model init|info`: writes a loadable preset directory; bad arguments exit non-zero.

use std::path::PathBuf;
use std::process::{Command, Output};

fn sluice(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(args)
        .output()
        .expect("run sluice")
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("sluice-cli-model-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[test]
fn init_writes_a_preset_that_info_describes() {
    let dir = scratch("init");
    let out = sluice(&[
        "model",
        "init",
        "--preset",
        "tiny",
        "--out",
        dir.to_str().unwrap(),
        "--seed",
        "5",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for file in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        assert!(dir.join(file).exists(), "{file}");
    }
    let out = sluice(&["model", "info", dir.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("Qwen2ForCausalLM"), "{stdout}");
    assert!(stdout.contains("chat template     true"), "{stdout}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn unknown_preset_and_missing_directory_fail() {
    let dir = scratch("bad");
    let out = sluice(&[
        "model",
        "init",
        "--preset",
        "huge",
        "--out",
        dir.to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("huge"));
    let out = sluice(&["model", "info", dir.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("config.json"));
}

#[test]
fn init_refuses_to_replace_an_existing_model_unless_forced() {
    let dir = scratch("exists");
    let args = |seed: &str, force: bool| {
        let mut a: Vec<String> = ["model", "init", "--preset", "tiny", "--out"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        a.extend([dir.display().to_string(), "--seed".into(), seed.into()]);
        if force {
            a.push("--force".into());
        }
        a
    };
    let run = |a: Vec<String>| {
        Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(&a)
            .output()
            .unwrap()
    };
    assert!(run(args("1", false)).status.success());
    let weights = std::fs::read(dir.join("model.safetensors")).unwrap();
    let out = run(args("2", false));
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("already holds a model (config.json); pass --force to replace it"),
        "{err}"
    );
    assert_eq!(
        std::fs::read(dir.join("model.safetensors")).unwrap(),
        weights,
        "the weights are untouched"
    );
    assert!(run(args("2", true)).status.success());
    assert_ne!(
        std::fs::read(dir.join("model.safetensors")).unwrap(),
        weights
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Rewrites one field of `dir/config.json`.
fn set_config_field(dir: &std::path::Path, field: &str, value: serde_json::Value) {
    let path = dir.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config[field] = value;
    std::fs::write(&path, config.to_string()).unwrap();
}

/// A directory that cannot load makes `model info` exit 1 naming the file and field (it once
/// printed such configs and exited 0), and `serve` refuses it with the same message (a config
/// claiming 10⁹ layers once aborted it allocating 3.7 GB, with no message naming the file).
#[test]
fn info_and_serve_refuse_a_directory_that_cannot_load() {
    let dir = scratch("unloadable");
    let d = dir.to_str().unwrap();
    let out = sluice(&["model", "init", "--preset", "tiny", "--out", d]);
    assert!(out.status.success());
    let cases = [
        (
            "num_hidden_layers",
            serde_json::json!(1_000_000_000u64),
            "`num_hidden_layers`: 1000000000 is over the limit of 1024",
        ),
        (
            "num_hidden_layers",
            serde_json::json!(1000),
            "`num_hidden_layers`: 1000 but the weight files hold 2 layers",
        ),
        (
            "vocab_size",
            serde_json::json!(4096),
            "`vocab_size`: implies model.embed_tokens.weight has 4096 rows",
        ),
    ];
    let original = std::fs::read_to_string(dir.join("config.json")).unwrap();
    for (field, value, message) in cases {
        std::fs::write(dir.join("config.json"), &original).unwrap();
        set_config_field(&dir, field, value.clone());
        let config_json = dir.join("config.json").display().to_string();
        let out = sluice(&["model", "info", d]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{field}={value}: {err}");
        assert!(
            err.contains(&config_json) && err.contains(message),
            "{field}={value}: {err}"
        );
        let out = sluice(&["serve", "--model", d, "--port", "0"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "serve {field}={value}: {err}");
        assert!(err.contains(message), "serve {field}={value}: {err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
