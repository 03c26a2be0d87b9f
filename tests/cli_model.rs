//! `sluice model init|info|import`: writes a loadable preset directory, imports a GGUF file
//! into one (info and probe accept it), refuses bad GGUF files naming what is wrong; bad
//! arguments exit non-zero; `info` describes a reward model (a one-label classifier).

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
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("config.json"), "{stderr}");
    // The OS error is said once, though the error naming the file already ends with it.
    assert_eq!(stderr.matches("(os error 2)").count(), 1, "{stderr}");
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

/// Byte position of tensor `name`'s data offset in the header of a GGUF file.
fn tensor_offset_at(bytes: &[u8], name: &str) -> usize {
    let at = bytes
        .windows(name.len())
        .position(|w| w == name.as_bytes())
        .expect("tensor name in the header")
        + name.len();
    let dims = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
    at + 4 + 8 * dims + 4
}

fn tensor_offset(bytes: &[u8], name: &str) -> u64 {
    let at = tensor_offset_at(bytes, name);
    u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap())
}

fn set_tensor_offset(bytes: &mut [u8], name: &str, offset: u64) {
    let at = tensor_offset_at(bytes, name);
    bytes[at..at + 8].copy_from_slice(&offset.to_le_bytes());
}

/// Imports each `(case, needles)` of `dir` with `RUST_BACKTRACE=1` set: each must exit 1
/// naming what is wrong (every needle), write nothing, and show no source path of a dependency.
fn assert_imports_refused(dir: &Path, expectations: &[(&str, &[&str])]) {
    for (name, needles) in expectations {
        let out = dir.join(format!("out-{name}"));
        let file = dir.join(format!("{name}.gguf"));
        let run = Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(["model", "import", "--gguf"])
            .arg(&file)
            .arg("--out")
            .arg(&out)
            .env("RUST_BACKTRACE", "1")
            .output()
            .expect("run sluice");
        let err = String::from_utf8_lossy(&run.stderr);
        assert_eq!(run.status.code(), Some(1), "{name}: {err}");
        for needle in *needles {
            assert!(err.contains(needle), "{name}: {needle:?} not in {err}");
        }
        assert!(
            !err.contains(".cargo") && !err.contains(".rs:"),
            "{name}: a source path in {err}"
        );
        assert!(
            !out.join("config.json").exists(),
            "{name}: nothing is written"
        );
    }
}

/// What candle's parser trusts is checked before it reads the file: an alignment of 0 once
/// panicked the import (a division by zero inside candle); one that is not a power of two, or
/// of a type candle ignores, would put every tensor's data in the wrong place; two tensors
/// sharing bytes, or one name given twice, imported one tensor's values as another's. A
/// truncated tensor once showed candle's backtrace (a path in its sources) under
/// `RUST_BACKTRACE=1`.
#[test]
fn import_refuses_gguf_headers_that_candle_would_trust() {
    use gguf_file::Value as V;
    let dir = tempfile::tempdir().unwrap();
    let good = preset_gguf(dir.path());
    let bytes = std::fs::read(&good).unwrap();
    let case = |name: &str| dir.path().join(format!("{name}.gguf"));
    for (name, value) in [
        ("align0", V::U32(0)),
        ("align48", V::U32(48)),
        ("align_neg", V::I32(-32)),
        ("align_u64", V::U64(64)),
    ] {
        rewrite_gguf(&good, &case(name), |m| set(m, "general.alignment", value));
    }
    let mut overlap = bytes.clone();
    let q = tensor_offset(&bytes, "blk.0.attn_q.weight");
    set_tensor_offset(&mut overlap, "blk.0.attn_k.weight", q);
    std::fs::write(case("overlap"), &overlap).unwrap();
    let mut misaligned = bytes.clone();
    let k = tensor_offset(&bytes, "blk.0.attn_k.weight");
    set_tensor_offset(&mut misaligned, "blk.0.attn_k.weight", k + 4);
    std::fs::write(case("misaligned"), &misaligned).unwrap();
    let mut twice = bytes.clone();
    let at = twice
        .windows(19)
        .position(|w| w == b"blk.1.attn_q.weight")
        .unwrap();
    twice[at + 4] = b'0';
    std::fs::write(case("twice"), &twice).unwrap();
    std::fs::write(case("tail_cut"), &bytes[..bytes.len() - 100]).unwrap();
    assert_imports_refused(
        dir.path(),
        &[
            (
                "align0",
                &["metadata key `general.alignment` = 0: must be a power of two greater than 0"],
            ),
            ("align48", &["metadata key `general.alignment` = 48"]),
            ("align_neg", &["metadata key `general.alignment` = -32"]),
            (
                "align_u64",
                &["metadata key `general.alignment` has metadata type 10 (u64)"],
            ),
            (
                "overlap",
                &["`blk.0.attn_q.weight`", "`blk.0.attn_k.weight`", "overlap"],
            ),
            (
                "misaligned",
                &[&format!(
                    "tensor `blk.0.attn_k.weight` has data offset {}, not a multiple of the alignment 32",
                    k + 4
                )],
            ),
            (
                "twice",
                &["tensor `blk.0.attn_q.weight` appears twice in the tensor directory"],
            ),
            (
                "tail_cut",
                &["tensor `output_norm.weight` (F32, shape [64]) needs 256 bytes"],
            ),
        ],
    );
}

/// A NaN or infinite hyper-parameter once became the default (`rope_theta` 10000 for the file's
/// 100000) through `config.json`, where JSON writes it as `null`.
#[test]
fn import_refuses_non_finite_hyper_parameters() {
    use gguf_file::Value as V;
    let dir = tempfile::tempdir().unwrap();
    let good = preset_gguf(dir.path());
    let case = |name: &str| dir.path().join(format!("{name}.gguf"));
    rewrite_gguf(&good, &case("freq_nan"), |m| {
        set(m, "qwen2.rope.freq_base", V::F32(f32::NAN));
    });
    rewrite_gguf(&good, &case("eps_inf"), |m| {
        set(
            m,
            "qwen2.attention.layer_norm_rms_epsilon",
            V::F64(f64::INFINITY),
        );
    });
    assert_imports_refused(
        dir.path(),
        &[
            (
                "freq_nan",
                &["metadata key `qwen2.rope.freq_base` = NaN: expected a finite number"],
            ),
            (
                "eps_inf",
                &[
                    "metadata key `qwen2.attention.layer_norm_rms_epsilon` = inf: expected a finite number",
                ],
            ),
        ],
    );
}

/// Token types outside llama.cpp's 1–6 and a chat template that does not parse are refused by
/// the import, not by the first request a server gets.
#[test]
fn import_refuses_token_types_and_chat_templates_it_cannot_use() {
    use gguf_file::Value as V;
    let dir = tempfile::tempdir().unwrap();
    let good = preset_gguf(dir.path());
    let case = |name: &str| dir.path().join(format!("{name}.gguf"));
    rewrite_gguf(&good, &case("type7"), |m| {
        let slot = m
            .iter_mut()
            .find(|(k, _)| k == "tokenizer.ggml.token_type")
            .expect("token types");
        let V::Array(items) = &mut slot.1 else {
            panic!("token types are an array")
        };
        items[5] = match items[5] {
            V::I32(_) => V::I32(7),
            V::U32(_) => V::U32(7),
            ref other => panic!("token type {other:?}"),
        };
    });
    rewrite_gguf(&good, &case("template"), |m| {
        set(
            m,
            "tokenizer.chat_template",
            V::String("{% for m in messages %}{{ m.content }}".into()),
        );
    });
    assert_imports_refused(
        dir.path(),
        &[
            (
                "type7",
                &[
                    "metadata key `tokenizer.ggml.token_type`[5] = 7: expected a token type from 1 to 6",
                ],
            ),
            (
                "template",
                &[
                    "metadata key `tokenizer.chat_template`: the chat template does not parse",
                    "syntax error",
                ],
            ),
        ],
    );
}

/// A reward model's directory (a one-label sequence classifier) is described as one, with its
/// head; one of two labels is refused naming the field.
#[test]
fn info_describes_a_reward_model_and_refuses_two_labels() {
    let dir = scratch("reward");
    let hidden = sluice_model::presets::preset_config(Preset::Tiny).hidden_size;
    sluice_model::presets::write_reward_preset(Preset::Tiny, &dir, 5, &vec![0.01; hidden]).unwrap();
    let out = sluice(&["model", "info", dir.to_str().unwrap()]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("Qwen2ForSequenceClassification (one label")
            && stdout.contains(&format!("score.weight [1, {hidden}]")),
        "{stdout}"
    );
    let config = dir.join("config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(
        &config,
        text.replace(
            "\"0\": \"LABEL_0\"",
            "\"0\": \"LABEL_0\", \"1\": \"LABEL_1\"",
        ),
    )
    .unwrap();
    let out = sluice(&["model", "info", dir.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("id2label") && stderr.contains("has 2"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
