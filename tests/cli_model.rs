//! `sluice model init|info|import`: writes a loadable preset directory, imports a GGUF file
//! into one (info and probe accept it), refuses bad GGUF files naming what is wrong; bad
//! arguments exit non-zero.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use sluice_model::candle::Device;
use sluice_model::candle::quantized::{GgmlDType, QTensor, gguf_file};
use sluice_model::gguf::{ExportOptions, export_gguf};
use sluice_model::presets::{Preset, write_preset};

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

/// A `tiny` preset exported as GGUF (Q8_0 matrices, ChatML tokenizer as byte-level BPE with
/// Qwen2's pre-tokenizer), in `dir/model.gguf`.
fn preset_gguf(dir: &Path) -> PathBuf {
    let model = dir.join("preset");
    write_preset(Preset::Tiny, &model, 4).unwrap();
    let file = dir.join("model.gguf");
    let options = ExportOptions {
        matrix_type: GgmlDType::Q8_0,
        pre_tokenizer: "qwen2".into(),
        version: 3,
    };
    export_gguf(&model, &file, &options).unwrap();
    file
}

#[test]
fn import_of_a_gguf_file_is_a_directory_info_and_probe_accept() {
    let dir = tempfile::tempdir().unwrap();
    let file = preset_gguf(dir.path());
    let out = dir.path().join("imported");
    let (gguf, dest) = (file.to_str().unwrap(), out.to_str().unwrap());
    let run = sluice(&[
        "model", "import", "--gguf", gguf, "--out", dest, "--dtype", "bf16",
    ]);
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(stdout.contains("Qwen2ForCausalLM"), "{stdout}");
    assert!(stdout.contains("Q8_0"), "{stdout}");
    assert!(stdout.contains("pre-tokenizer `qwen2`"), "{stdout}");
    let info = sluice(&["model", "info", dest]);
    let text = String::from_utf8_lossy(&info.stdout);
    assert!(
        info.status.success(),
        "{}",
        String::from_utf8_lossy(&info.stderr)
    );
    assert!(text.contains("dtype             BF16"), "{text}");
    assert!(text.contains("chat template     true"), "{text}");
    assert!(text.contains("eos ids           [99]"), "{text}");
    let probe = sluice(&["model", "probe", dest, "--tokens", "40,69,76,76,79"]);
    assert!(
        probe.status.success(),
        "{}",
        String::from_utf8_lossy(&probe.stderr)
    );
    // A second import into the same directory is refused unless forced.
    let again = sluice(&["model", "import", "--gguf", gguf, "--out", dest]);
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("--force"));
    let forced = sluice(&["model", "import", "--gguf", gguf, "--out", dest, "--force"]);
    assert!(
        forced.status.success(),
        "{}",
        String::from_utf8_lossy(&forced.stderr)
    );
}

/// `src` rewritten with `edit` applied to its metadata (tensors unchanged).
fn rewrite_gguf(src: &Path, dst: &Path, edit: impl FnOnce(&mut Vec<(String, gguf_file::Value)>)) {
    let mut f = std::fs::File::open(src).unwrap();
    let content = gguf_file::Content::read(&mut f).unwrap();
    let mut meta: Vec<(String, gguf_file::Value)> = content
        .metadata
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    edit(&mut meta);
    let tensors: Vec<(String, QTensor)> = content
        .tensor_infos
        .keys()
        .map(|n| (n.clone(), content.tensor(&mut f, n, &Device::Cpu).unwrap()))
        .collect();
    let meta: Vec<(&str, &gguf_file::Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensors: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut w = std::fs::File::create(dst).unwrap();
    gguf_file::write(&mut w, &meta, &tensors).unwrap();
}

fn set(meta: &mut [(String, gguf_file::Value)], key: &str, value: gguf_file::Value) {
    let slot = meta
        .iter_mut()
        .find(|(k, _)| k == key)
        .expect("key present");
    slot.1 = value;
}

/// The file with the ggml type of tensor `name` overwritten in its header.
fn retype_tensor(bytes: &mut [u8], name: &str, ty: u32) {
    let at = bytes
        .windows(name.len())
        .position(|w| w == name.as_bytes())
        .expect("tensor name in the header")
        + name.len();
    let dims = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
    let ty_at = at + 4 + 8 * dims;
    bytes[ty_at..ty_at + 4].copy_from_slice(&ty.to_le_bytes());
}

#[test]
fn import_refuses_bad_gguf_files_naming_what_is_wrong() {
    use gguf_file::Value as V;
    let dir = tempfile::tempdir().unwrap();
    let good = preset_gguf(dir.path());
    let bytes = std::fs::read(&good).unwrap();
    let case = |name: &str| dir.path().join(format!("{name}.gguf"));
    std::fs::write(case("tail_cut"), &bytes[..bytes.len() - 100]).unwrap();
    std::fs::write(case("header_cut"), &bytes[..1000]).unwrap();
    std::fs::write(case("not_gguf"), b"{\"this is\": \"json\"}").unwrap();
    let mut retyped = bytes.clone();
    retype_tensor(&mut retyped, "blk.0.attn_q.weight", 16);
    std::fs::write(case("iq2"), &retyped).unwrap();
    rewrite_gguf(&good, &case("gemma"), |m| {
        set(m, "general.architecture", V::String("gemma2".into()));
    });
    rewrite_gguf(&good, &case("pre"), |m| {
        set(m, "tokenizer.ggml.pre", V::String("deepseek-llm".into()));
    });
    rewrite_gguf(&good, &case("ffn"), |m| {
        set(m, "qwen2.feed_forward_length", V::U32(128));
    });
    let expectations: &[(&str, &[&str])] = &[
        ("tail_cut", &["tensor `output_norm.weight`", "remaining"]),
        ("header_cut", &["truncated file (1000 bytes)"]),
        ("not_gguf", &["not a GGUF file"]),
        (
            "iq2",
            &[
                "tensor `blk.0.attn_q.weight` has ggml type 16 (IQ2_XXS)",
                "Q4_K",
            ],
        ),
        (
            "gemma",
            &[
                "`general.architecture`: `gemma2` is not supported",
                "llama, qwen2, qwen3",
            ],
        ),
        (
            "pre",
            &[
                "pre-tokenizer `deepseek-llm` is not supported",
                "smollm",
                "llama-bpe",
            ],
        ),
        (
            "ffn",
            &["tensor `blk.0.ffn_gate.weight`", "[256, 64]", "[128, 64]"],
        ),
    ];
    for (name, needles) in expectations {
        let out = dir.path().join(format!("out-{name}"));
        let run = sluice(&[
            "model",
            "import",
            "--gguf",
            case(name).to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ]);
        let err = String::from_utf8_lossy(&run.stderr);
        assert_eq!(run.status.code(), Some(1), "{name}: {err}");
        for needle in *needles {
            assert!(err.contains(needle), "{name}: {needle:?} not in {err}");
        }
        assert!(
            !out.join("config.json").exists(),
            "{name}: nothing is written"
        );
    }
}
