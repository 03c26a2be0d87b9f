//! `sluice model init|info|probe|import`: write a preset model directory, describe one, probe
//! it on a device (`probe.rs`), or convert a GGUF file into one.

use std::process::ExitCode;

use anyhow::{Context, bail};
use sluice_model::{ModelConfig, Tokenizer, gguf, presets};

use crate::cli::{ModelCommand, ModelImportArgs, ModelInfoArgs, ModelInitArgs};

/// Runs one `model` subcommand.
pub fn run(command: ModelCommand) -> anyhow::Result<ExitCode> {
    match command {
        ModelCommand::Init(args) => init(&args),
        ModelCommand::Info(args) => info(&args),
        ModelCommand::Probe(args) => super::probe::run(&args),
        ModelCommand::Import(args) => import(&args),
    }
}

fn import(args: &ModelImportArgs) -> anyhow::Result<ExitCode> {
    if let Some(existing) = model_files(&args.out).filter(|_| !args.force) {
        bail!(
            "--out {}: already holds a model ({existing}); pass --force to replace it",
            args.out.display()
        );
    }
    let dtype = sluice_model::config::candle_dtype(args.dtype);
    let summary = gguf::import_gguf(&args.gguf, &args.out, &gguf::ImportOptions { dtype })
        .with_context(|| format!("importing {}", args.gguf.display()))?;
    let types: Vec<String> = summary
        .tensor_types
        .iter()
        .map(|(t, n)| format!("{n} {t}"))
        .collect();
    println!(
        "wrote {} ({} parameters, {} layers, {:?}) to {}",
        summary.config.architecture.class_name(),
        summary.config.num_parameters(),
        summary.config.num_layers,
        summary.config.dtype,
        args.out.display()
    );
    println!("tensors in the file: {}", types.join(", "));
    println!(
        "tokenizer: {} (chat template: {})",
        summary.tokenizer, summary.chat_template
    );
    Ok(ExitCode::SUCCESS)
}

fn init(args: &ModelInitArgs) -> anyhow::Result<ExitCode> {
    if let Some(existing) = model_files(&args.out).filter(|_| !args.force) {
        bail!(
            "--out {}: already holds a model ({existing}); pass --force to replace it",
            args.out.display()
        );
    }
    presets::write_preset(args.preset, &args.out, args.seed)
        .with_context(|| format!("writing preset to {}", args.out.display()))?;
    let config = presets::preset_config(args.preset);
    println!(
        "wrote {:?} preset ({} parameters, seed {}) to {}",
        args.preset,
        config.num_parameters(),
        args.seed,
        args.out.display()
    );
    Ok(ExitCode::SUCCESS)
}

/// The first file of `dir` that makes it a model directory (`config.json`, safetensors
/// weights or their index), if any: writing a preset there would replace trained weights.
fn model_files(dir: &std::path::Path) -> Option<String> {
    let entries = std::fs::read_dir(dir).ok()?;
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| {
            n == "config.json"
                || n.ends_with(".safetensors")
                || n.ends_with(".safetensors.index.json")
        })
        .collect();
    names.sort();
    names.into_iter().next()
}

/// The config of `dir` after the checks loading makes short of reading tensor data (sizes
/// within bounds and matching the tensors, shard names inside the directory, every tensor
/// present with its shape and a float dtype): `model info` succeeds only on a directory that
/// loads.
fn loadable_config(dir: &std::path::Path) -> anyhow::Result<ModelConfig> {
    sluice_model::check_checkpoint(dir)
        .with_context(|| format!("{}: the model directory does not load", dir.display()))
}

fn info(args: &ModelInfoArgs) -> anyhow::Result<ExitCode> {
    let classifier = sluice_model::reward::classifier_class(&args.dir);
    let config = match &classifier {
        Some(_) => sluice_model::reward::check_classifier(&args.dir)
            .with_context(|| format!("{}: the classifier does not load", args.dir.display()))?,
        None => loadable_config(&args.dir)?,
    };
    match &classifier {
        // A classifier's decoder is read with its LM head tied (it has none), plus its head.
        Some(class) => {
            println!("architecture      {class} (one label: a reward model or a critic)");
            println!(
                "parameters        {}",
                config.num_parameters() + config.hidden_size
            );
            println!("head              score.weight [1, {}]", config.hidden_size);
        }
        None => {
            println!("architecture      {}", config.architecture.class_name());
            println!("parameters        {}", config.num_parameters());
        }
    }
    println!(
        "layers            {} (hidden {}, intermediate {})",
        config.num_layers, config.hidden_size, config.intermediate_size
    );
    println!(
        "heads             {} query, {} key/value, head_dim {}",
        config.num_heads, config.num_kv_heads, config.head_dim
    );
    println!("vocab             {}", config.vocab_size);
    if classifier.is_none() {
        println!("tied embeddings   {}", config.tie_word_embeddings);
    }
    println!("dtype             {:?}", config.dtype);
    if args.dir.join("tokenizer.json").exists() {
        let tok = Tokenizer::from_dir(&args.dir)?;
        println!("tokenizer vocab   {}", tok.vocab_size());
        println!("eos ids           {:?}", tok.eos_token_ids());
        println!("chat template     {}", tok.chat_template().is_some());
    }
    Ok(ExitCode::SUCCESS)
}
