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
