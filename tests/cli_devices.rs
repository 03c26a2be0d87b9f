//! Devices per role through the binary (docs/gpu.md): a run whose roles name their devices
//! explicitly works end to end; a `cuda:N` this binary cannot open is refused before anything
//! starts, naming the key and why; `sluice model probe` prints what `scripts/gpu-check`
//! compares.

use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;

fn sluice(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(args)
        .output()
        .expect("run sluice")
}

fn text(out: &Output) -> String {
    format!(
        "exit {:?}\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn quickstart() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("configs/quickstart.toml")
        .display()
        .to_string()
}

/// A two-step quickstart (no warm-up, small steps) with `sets` added.
fn short_run(out_dir: &Path, sets: &[&str]) -> Output {
    let output = format!("run.output_dir={}", out_dir.display());
    let mut args = vec!["run".to_owned(), quickstart()];
    for s in [
        output.as_str(),
        "run.max_steps=2",
        "warmup.enabled=false",
        "rollout.groups_per_step=4",
        "trainer.minibatches=1",
        "eval.samples=8",
        "eval.stop_at_accuracy=1.0",
        "metrics.enabled=false",
        "admin.listen=127.0.0.1:0",
    ]
    .iter()
    .chain(sets)
    {
        args.push("--set".into());
        args.push((*s).to_owned());
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    sluice(&args)
}

/// What a binary says when it cannot open `cuda:0`: built without CUDA, or (a `cuda` build)
/// no driver or no device on this machine.
fn assert_no_cuda(out: &Output, key: &str) {
    let all = text(out);
    assert!(!out.status.success(), "{all}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(&format!("{key}: cuda:0: ")), "{all}");
    let why = [
        "this sluice was built without CUDA",
        "no CUDA driver found",
        "no usable CUDA device 0",
    ];
    assert!(why.iter().any(|w| stderr.contains(w)), "{all}");
    assert!(!stderr.contains("panicked"), "{all}");
}

#[test]
fn a_run_with_every_role_on_an_explicit_device_trains_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    // model.device names a GPU: only the roles' own keys keep this run on the CPU.
    let out = short_run(
        &run,
        &[
            "model.device=cuda:0",
            "engine.device=cpu",
            "trainer.device=cpu",
            "eval.device=cpu",
        ],
    );
    assert!(out.status.success(), "{}", text(&out));
    let log = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let steps: Vec<Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|v: &Value| v.get("step").is_some())
        .collect();
    assert!(
        steps.iter().any(|v| v["step"] == 2),
        "two training steps logged: {log}"
    );
    assert!(log.contains("eval_accuracy"), "{log}");
}

#[test]
fn a_role_on_a_gpu_this_binary_cannot_open_is_refused_naming_its_key() {
    if cfg!(feature = "cuda") && Path::new("/dev/nvidiactl").exists() {
        return; // a GPU machine: cuda:0 opens (scripts/gpu-check covers it there)
    }
    let dir = tempfile::tempdir().unwrap();
    assert_no_cuda(
        &short_run(&dir.path().join("a"), &["engine.device=cuda:0"]),
        "engine.device",
    );
    assert_no_cuda(
        &short_run(&dir.path().join("b"), &["trainer.device=cuda:0"]),
        "trainer.device",
    );
    assert_no_cuda(
        &short_run(&dir.path().join("c"), &["eval.device=cuda:0"]),
        "eval.device",
    );
    // model.device is every role's default: the engine is asked first.
    assert_no_cuda(
        &short_run(&dir.path().join("d"), &["model.device=cuda"]),
        "engine.device",
    );
}

fn tiny_model(dir: &Path) {
    let out = sluice(&[
        "model",
        "init",
        "--preset",
        "tiny",
        "--out",
        dir.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out));
}

fn probe(dir: &Path, extra: &[&str]) -> Output {
    let mut args = vec!["model", "probe", dir.to_str().unwrap()];
    args.extend(extra);
    sluice(&args)
}

#[test]
fn probe_prints_logits_and_every_parameter_s_gradient() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    tiny_model(&model);
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    let vocab = config["vocab_size"].as_u64().unwrap() as usize;

    let out = probe(&model, &["--tokens", "5,6,7,8,9"]);
    assert!(out.status.success(), "{}", text(&out));
    let f32: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(f32["device"], "cpu");
    let logits = f32["logits"].as_array().unwrap();
    assert_eq!(logits.len(), vocab);
    assert!(logits.iter().all(|x| x.as_f64().unwrap().is_finite()));
    // The decode path (paged cache, two sequences a token per step) ends on the same
    // distribution for the prompt; the reversed prompt's differs.
    let rows = f32["decode_logits"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    let max_diff = |a: &[Value], b: &[Value]| {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x.as_f64().unwrap() - y.as_f64().unwrap()).abs())
            .fold(0.0, f64::max)
    };
    let scale = logits
        .iter()
        .map(|x| x.as_f64().unwrap().abs())
        .fold(0.0, f64::max);
    let first = rows[0].as_array().unwrap();
    assert_eq!(first.len(), vocab);
    let diff = max_diff(logits, first);
    assert!(diff / scale < 1e-5, "decode path: {diff} of {scale}");
    assert!(max_diff(logits, rows[1].as_array().unwrap()) / scale > 1e-3);
    let loss = f32["loss"].as_f64().unwrap();
    assert!(loss > 0.0 && loss.is_finite(), "{loss}");
    let grads = f32["grad_norms"].as_object().unwrap();
    assert!(grads.contains_key("model.embed_tokens.weight"), "{grads:?}");
    assert!(grads.values().all(|g| g.as_f64().unwrap().is_finite()));
    assert!(grads.values().any(|g| g.as_f64().unwrap() > 0.0));

    let f32_out = out.stdout;

    // bf16 weights on the engine's path: close to f32, not equal; the trainer's path is f32.
    let out = probe(&model, &["--tokens", "5,6,7,8,9", "--dtype", "bf16"]);
    assert!(out.status.success(), "{}", text(&out));
    let bf16: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(bf16["dtype"], "bf16");
    let diff = max_diff(logits, bf16["logits"].as_array().unwrap());
    assert!(diff > 0.0 && diff / scale < 0.05, "{diff} of {scale}");

    // The comparison gpu-check makes, here CPU against itself: identical.
    let dir = tmp.path();
    let cmp = gpu_check_compare(dir, (&out.stdout, &out.stdout), "1e-3");
    assert!(cmp.status.success(), "{}", text(&cmp));
    let line = String::from_utf8_lossy(&cmp.stdout);
    assert!(
        line.contains("logits_rel=0 ") && line.contains("decode_rel=0 ") && line.contains("ok=1"),
        "{line}"
    );

    // bf16 compute on the trainer's path (the products on AMX tiles where the CPU has them,
    // else the weights converted once for the step, as the trainer does): every parameter's
    // gradient within gpu-check's tolerance of f32's, and not equal to it.
    let mixed = probe(
        &model,
        &["--tokens", "5,6,7,8,9", "--compute-dtype", "bf16"],
    );
    assert!(mixed.status.success(), "{}", text(&mixed));
    let cmp = gpu_check_compare(dir, (&f32_out, &mixed.stdout), "5e-2");
    let line = String::from_utf8_lossy(&cmp.stdout);
    assert!(cmp.status.success() && line.contains("ok=1"), "{line}");
    assert!(!line.contains("grads_rel=0 "), "{line}");
}

/// `scripts/gpu_check.py compare` of two probe outputs (written into `dir`), logits within
/// 1e-4 and gradient norms within `grads_tol`, as gpu-check runs it.
fn gpu_check_compare(dir: &Path, (a, b): (&[u8], &[u8]), grads_tol: &str) -> Output {
    std::fs::write(dir.join("a.json"), a).unwrap();
    std::fs::write(dir.join("b.json"), b).unwrap();
    Command::new("python3")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/gpu_check.py"))
        .args(["compare", "--logits-tol", "1e-4", "--grads-tol", grads_tol])
        .arg(dir.join("a.json"))
        .arg(dir.join("b.json"))
        .output()
        .unwrap()
}

#[test]
fn probe_refuses_bad_arguments_naming_them() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    tiny_model(&model);
    let out = probe(&model, &["--tokens", "5"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--tokens: expected at least 2"),
        "{}",
        text(&out)
    );
    let out = probe(&model, &["--tokens", "5,999999"]);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("outside the vocabulary"),
        "{}",
        text(&out)
    );
    if !(cfg!(feature = "cuda") && Path::new("/dev/nvidiactl").exists()) {
        assert_no_cuda(
            &probe(&model, &["--tokens", "5,6", "--device", "cuda:0"]),
            "--device",
        );
    }
}
