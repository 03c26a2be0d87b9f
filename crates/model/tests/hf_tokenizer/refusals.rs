//! Tokenizer files that load but could never work (part of the `hf_tokenizer` test binary).

use super::*;

/// Tokenizer files that load but could never work are refused at load, naming the file: an
/// empty vocabulary (every text request then answered "the prompt is empty"), end-of-sequence
/// ids outside the vocabulary or not ids at all (dropped silently: generation never stopped on
/// them), an `eos_token` the vocabulary lacks, and a chat template that does not parse (it
/// failed at the first chat request, naming no file).
#[test]
fn unusable_tokenizer_files_are_refused_at_load_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    write_preset(Preset::Tiny, dir.path(), 3).unwrap();
    let originals: Vec<(String, String)> = [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ]
    .iter()
    .map(|f| {
        let text = std::fs::read_to_string(dir.path().join(f)).unwrap();
        (f.to_string(), text)
    })
    .collect();
    let edit = |file: &str, change: &dyn Fn(&mut Value)| {
        let path = dir.path().join(file);
        let mut v = json_file(&path);
        change(&mut v);
        std::fs::write(&path, v.to_string()).unwrap();
    };
    type Case<'a> = (&'a str, Box<dyn Fn() + 'a>, &'a [&'a str]);
    let cases: Vec<Case<'_>> = vec![
        (
            "empty vocab",
            Box::new(|| {
                edit("tokenizer.json", &|t| {
                    t["model"]["vocab"] = json!({});
                    t["model"]["merges"] = json!([]);
                    t["added_tokens"] = json!([]);
                    t["post_processor"] = Value::Null;
                })
            }),
            &["tokenizer.json", "the vocabulary is empty"],
        ),
        (
            "generation eos out of vocab",
            Box::new(|| {
                edit("generation_config.json", &|g| {
                    g["eos_token_id"] = json!(100_000)
                })
            }),
            &[
                "generation_config.json",
                "`eos_token_id`: 100000 is outside the vocabulary of tokenizer.json",
            ],
        ),
        (
            "generation eos negative",
            Box::new(|| {
                edit("generation_config.json", &|g| {
                    g["eos_token_id"] = json!([-5])
                })
            }),
            &[
                "generation_config.json",
                "`eos_token_id`: -5 is not a token id",
            ],
        ),
        (
            "eos token not in vocab",
            Box::new(|| {
                edit("tokenizer_config.json", &|c| {
                    c["eos_token"] = json!("<|nope|>")
                })
            }),
            &[
                "tokenizer_config.json",
                "`eos_token` \"<|nope|>\" is not in the vocabulary",
            ],
        ),
        (
            "template does not parse",
            Box::new(|| {
                edit("tokenizer_config.json", &|c| {
                    c["chat_template"] = json!("{% for m in messages %}{{ m.content }}")
                })
            }),
            &["chat template", "tokenizer_config.json", "syntax error"],
        ),
        (
            "jinja file does not parse",
            Box::new(|| {
                std::fs::write(dir.path().join("chat_template.jinja"), "{{ messages[ }}").unwrap()
            }),
            &["chat template", "chat_template.jinja", "syntax error"],
        ),
    ];
    for (case, apply, needles) in cases {
        for (file, text) in &originals {
            std::fs::write(dir.path().join(file), text).unwrap();
        }
        let _ = std::fs::remove_file(dir.path().join("chat_template.jinja"));
        assert!(
            Tokenizer::from_dir(dir.path()).is_ok(),
            "{case}: the preset loads"
        );
        apply();
        let err = Tokenizer::from_dir(dir.path()).unwrap_err().to_string();
        for needle in needles {
            assert!(err.contains(needle), "{case}: {needle:?} not in {err}");
        }
    }
}
