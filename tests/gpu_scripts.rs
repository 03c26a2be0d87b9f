//! The GPU scripts (`scripts/gpu-check`, `scripts/cuda-toolchain`, `scripts/gpu_check.py`,
//! `scripts/gpu-prepare`, `scripts/kernel-instructions`) cannot run without a GPU or a network;
//! these checks catch what can rot without one: they parse, every `sluice` subcommand and flag
//! `gpu-check` calls exists, the config keys it overrides load, `gpu-prepare` cuts the model it
//! carries into halves that travel, the helper's profile summary adds Nsight Compute's times up
//! as it should, and the instruction counter finds a disassembly's loops.

use std::path::Path;
use std::process::{Command, Output};

fn script(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("scripts")
        .join(name)
        .display()
        .to_string()
}

/// Runs `cmd` and returns its output, failing the test with `what` and its stderr if it failed.
fn succeeds(cmd: &mut Command, what: &str) -> Output {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

#[test]
fn the_shell_scripts_parse() {
    for name in [
        "gpu-check",
        "cuda-toolchain",
        "gpu-prepare",
        "fetch-smollm2",
    ] {
        succeeds(Command::new("bash").args(["-n", &script(name)]), name);
    }
}

#[test]
fn the_python_helper_compiles() {
    // `ast.parse` rather than py_compile: nothing is written into the source tree.
    succeeds(
        Command::new("python3").args([
            "-c",
            "import ast, sys; ast.parse(open(sys.argv[1]).read(), sys.argv[1])",
            &script("gpu_check.py"),
        ]),
        "gpu_check.py",
    );
}

/// `gpu_check.py kernel-profile` over Nsight Compute's CSV (its own lines and the program's
/// around the table, thousands separators, mixed units): kernels summed by name, Sluice's own
/// told from cuBLAS's and candle's by the names in the CUDA sources (a macro's `##` names
/// included), and the device's busy share of the wall time.
#[test]
fn kernel_profile_sums_ncu_times_by_kernel_and_origin() {
    let tmp = tempfile::tempdir().unwrap();
    let csv = tmp.path().join("profile.csv");
    let head = r#""ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value""#;
    let row = |id: usize, name: &str, unit: &str, value: &str| {
        format!(
            r#""{id}","7","sluice","h","{name}","1","7","(128, 1, 1)","(8, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","{unit}","{value}""#
        )
    };
    let text = [
        "==PROF== Connected to process 7".to_owned(),
        "  step [8x2048]  40000 tok/s".to_owned(),
        head.to_owned(),
        row(0, "attn_tc_bwd_kv_bf16_64", "nsecond", "3,000,000"),
        row(
            1,
            "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n",
            "nsecond",
            "4,000,000",
        ),
        row(2, "ucopy_bf16", "usecond", "1,000"),
        row(3, "ucopy_bf16", "nsecond", "1,000,000"),
        row(4, "rms_bwd_dx_bf16", "msecond", "1"),
        "==PROF== Disconnected from process 7".to_owned(),
    ]
    .join("\n");
    std::fs::write(&csv, text).unwrap();
    let kernels = Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/model/kernels");
    let sources: Vec<_> = std::fs::read_dir(&kernels)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .collect();
    let out = succeeds(
        Command::new("python3")
            .arg(script("gpu_check.py"))
            .arg("kernel-profile")
            .arg(&csv)
            .arg("--ours")
            .args(&sources)
            .args(["--wall-seconds", "0.02"]),
        "kernel-profile",
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let last = text.lines().last().unwrap();
    for word in [
        "profile_launches=5",
        "profile_device_ms=10.0",
        "profile_cublas_pct=40.0",
        "profile_sluice_pct=40.0",
        "profile_sluice_launches=2",
        "profile_candle_pct=20.0",
        "profile_candle_launches=2",
        "profile_busy_pct=50.0",
    ] {
        assert!(last.split(' ').any(|w| w == word), "no {word} in {last}");
    }
    assert!(
        last.contains("profile_top=sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n:40.0,attn_tc_bwd_kv_bf16_64:30.0,ucopy_bf16:20.0"),
        "{last}"
    );
}

/// `scripts/kernel-instructions` over a disassembly in cuobjdump's form and ptxas's report: each
/// backward branch is a loop, counted with its opcodes (predicates and modifiers stripped), and
/// each kernel's registers and spills are its own.
#[test]
fn kernel_instructions_counts_each_loop_and_reads_registers() {
    let sass = "\n\tcode for sm_90\n\n\t\tFunction : attn_tc_fwd_bf16_64\n\
        \t.headerflags\t@\"EF_CUDA_SM90\"\n\
        /*0000*/ LDC R1, c[0x0][0x28] ; /* 0x00000a00ff017b82 */\n\
        \t/* 0x000ff00000000800 */\n\
        /*0010*/ LDSM.16.M88.4 R4, [R2] ;\n\
        /*0020*/ HMMA.16816.F32.BF16 R8, R4.reuse, R6, R8 ;\n\
        /*0030*/ MUFU.EX2 R9, R9 ;\n\
        /*0040*/ @!P0 BRA 0x20 ;\n\
        /*0050*/ @P1 BRA 0x10 ;\n\
        /*0060*/ EXIT ;\n\
        /*0070*/ BRA 0x70;\n\
        \t\tFunction : attn_tc_kv_sum_bf16\n\
        /*0000*/ EXIT ;\n";
    let report = "ptxas info    : Compiling entry function 'attn_tc_kv_sum_bf16' for 'sm_90'\n\
        ptxas info    : Function properties for attn_tc_kv_sum_bf16\n\
        \x20   0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
        ptxas info    : Used 32 registers, used 0 barriers\n\
        ptxas info    : Compiling entry function 'attn_tc_fwd_bf16_64' for 'sm_90'\n\
        ptxas info    : Function properties for attn_tc_fwd_bf16_64\n\
        \x20   0 bytes stack frame, 76 bytes spill stores, 76 bytes spill loads\n\
        ptxas info    : Used 128 registers, used 1 barriers\n";
    let probe = "import importlib.util, importlib.machinery, sys\n\
        loader = importlib.machinery.SourceFileLoader('ki', sys.argv[1])\n\
        m = importlib.util.module_from_spec(importlib.util.spec_from_loader('ki', loader))\n\
        loader.exec_module(m)\n\
        sass, report = sys.stdin.read().split('@@')\n\
        for name, (n, loops) in sorted(m.loops(sass).items()):\n\
        \x20   print(name, n, [(a, b, len(c), c.count('HMMA'), c.count('BRA')) for a, b, c in loops])\n\
        print(sorted(m.resources(report).items()))\n";
    let mut child = Command::new("python3")
        .args(["-c", probe, &script("kernel-instructions")])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    let input = format!("{sass}@@{report}");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines,
        [
            // The inner loop 0x20..0x40, the outer 0x10..0x50, the end marker 0x70.
            "attn_tc_fwd_bf16_64 8 [(32, 64, 3, 1, 1), (16, 80, 5, 1, 2), (112, 112, 1, 0, 1)]",
            "attn_tc_kv_sum_bf16 1 []",
            "[('attn_tc_fwd_bf16_64', (128, 76)), ('attn_tc_kv_sum_bf16', (32, 0))]",
        ],
        "{text}"
    );
}

/// Shell words of a line: `"..."` and `'...'` quoting, no expansion.
fn words(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut word = String::new();
    let mut quote = None;
    let mut started = false;
    for c in line.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => word.push(c),
            (None, '"' | '\'') => {
                quote = Some(c);
                started = true;
            }
            (None, c) if c.is_whitespace() => {
                if started || !word.is_empty() {
                    out.push(std::mem::take(&mut word));
                }
                started = false;
            }
            (None, c) => word.push(c),
        }
    }
    if started || !word.is_empty() {
        out.push(word);
    }
    out
}

/// Every `"$bin" ...` call of gpu-check: (subcommand words, flags, `--set` values).
fn calls() -> Vec<(Vec<String>, Vec<String>, Vec<String>)> {
    let text = std::fs::read_to_string(script("gpu-check"))
        .unwrap()
        .replace("\\\n", " ");
    let mut out = Vec::new();
    for line in text.lines().filter(|l| !l.trim_start().starts_with('#')) {
        let w = words(line);
        let Some(i) = w.iter().position(|w| w == "$bin") else {
            continue;
        };
        let rest: Vec<&String> = w[i + 1..]
            .iter()
            .take_while(|w| !matches!(w.as_str(), "|" | "||" | ">" | ";" | "&&" | "then"))
            .filter(|w| !w.starts_with('>'))
            .collect();
        let sub_len = match rest.first().map(|s| s.as_str()) {
            Some("model" | "bench") => 2,
            Some(s) if s.starts_with("--") => 0,
            _ => 1,
        };
        let sub: Vec<String> = rest.iter().take(sub_len).map(|s| (*s).clone()).collect();
        let mut flags = Vec::new();
        let mut sets = Vec::new();
        let mut it = rest.iter().skip(sub_len);
        while let Some(w) = it.next() {
            if w.starts_with("--") {
                flags.push((*w).clone());
                if *w == "--set" {
                    sets.push((*it.next().expect("a --set value")).clone());
                }
            }
        }
        out.push((sub, flags, sets));
    }
    out
}

#[test]
fn gpu_check_calls_only_existing_subcommands_flags_and_keys() {
    let calls = calls();
    let subs: Vec<String> = calls.iter().map(|(s, _, _)| s.join(" ")).collect();
    for expected in [
        "model init",
        "model probe",
        "bench engine",
        "bench trainer",
        "run",
    ] {
        assert!(subs.iter().any(|s| s == expected), "{expected}: {subs:?}");
    }
    for (sub, flags, sets) in &calls {
        let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(sub)
            .arg("--help")
            .output()
            .unwrap();
        assert!(out.status.success(), "no subcommand `sluice {sub:?}`");
        let help = String::from_utf8_lossy(&out.stdout);
        for flag in flags {
            assert!(
                help.contains(flag.as_str()),
                "`sluice {} {flag}` is not a flag",
                sub.join(" ")
            );
        }
        if sub.first().is_some_and(|s| s == "run") {
            let overrides: Vec<sluice_config::Override> = sets
                .iter()
                .map(|s| {
                    s.replace("$device", "cuda:0")
                        .replace("$qs", "/tmp/gpu-check-qs")
                        .replace("$((seed + 2))", "3")
                        .replace("$seed", "1")
                        .replace("$graphs", "true")
                        .parse()
                        .unwrap_or_else(|e| panic!("--set {s}: {e}"))
                })
                .collect();
            let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/quickstart.toml");
            let text = std::fs::read_to_string(&path).unwrap();
            sluice_config::parse(&text, "configs/quickstart.toml", &overrides, &|_| None)
                .unwrap_or_else(|e| panic!("quickstart with {sets:?}: {e}"));
        }
    }
}

/// `scripts/gpu-prepare --model-only` cuts SmolLM2's GGUF (`scripts/fetch-smollm2 --gguf`) into
/// two halves that each fit one device call's 64 MiB carry and, put back together, are the GGUF
/// again (its magic, the checksum the script records for the call that joins them); it prints
/// the calls that carry them.
#[test]
fn gpu_prepare_cuts_the_gguf_into_halves_that_each_travel() {
    let tmp = tempfile::tempdir().unwrap();
    let out = succeeds(
        Command::new(script("gpu-prepare"))
            .args(["--model-only", "--out"])
            .arg(tmp.path()),
        "gpu-prepare --model-only",
    );
    let read = |p: &str| std::fs::read(tmp.path().join(p)).unwrap();
    let (a, b) = (read("gpu2/smollm2.a"), read("gpu3/smollm2.b"));
    let carry = 64 << 20;
    assert!(
        a.len() < carry && b.len() < carry,
        "{} and {}",
        a.len(),
        b.len()
    );
    assert!(
        a.len().abs_diff(b.len()) <= 1,
        "{} and {}",
        a.len(),
        b.len()
    );
    assert_eq!(&a[..4], b"GGUF", "the first half starts the GGUF");
    let whole = tmp.path().join("whole.gguf");
    std::fs::write(&whole, [a, b].concat()).unwrap();
    let sum = Command::new("sha256sum").arg(&whole).output().unwrap();
    let sum = String::from_utf8_lossy(&sum.stdout);
    let want = String::from_utf8(read("gpu3/smollm2.sha256")).unwrap();
    assert_eq!(sum.split_whitespace().next(), Some(want.trim()));
    let calls = String::from_utf8_lossy(&out.stdout);
    for call in [
        "carry gpu2/",
        "carry gpu3/",
        "GPU_CHECK_SMOLLM2=/tmp/smollm2.gguf",
    ] {
        assert!(calls.contains(call), "no `{call}` in:\n{calls}");
    }
}

/// `scripts/gpu-check` keeps what it has measured in `result.txt` (under `GPU_CHECK_OUT`) as it
/// goes, and a SIGTERM to its process group prints it with `status=stopped`: a device call cut
/// off by its time limit loses no measurement taken before. A stand-in for the CUDA binary
/// answers the quickstart part at once (a held-out accuracy in its metrics) and hangs in the
/// recipe part's import, where the check is stopped.
#[test]
fn gpu_check_keeps_what_it_measured_when_stopped() {
    use std::os::unix::process::CommandExt;
    let tmp = tempfile::tempdir().unwrap();
    let fake = tmp.path().join("sluice");
    std::fs::write(
        &fake,
        r#"#!/bin/sh
case "$1" in
  --version) echo "sluice (stand-in)" ;;
  model)
    case "$2" in
      init) shift 2; while [ $# -gt 0 ]; do [ "$1" = --out ] && mkdir -p "$2" && echo '{}' >"$2/config.json"; shift; done ;;
      import) exec sleep 60 ;;
    esac ;;
  run)
    for a in "$@"; do case "$a" in run.output_dir=*) out="${a#run.output_dir=}" ;; esac; done
    mkdir -p "$out" && echo '{"step": 140, "eval_accuracy": 0.825}' >"$out/metrics.jsonl" ;;
esac
"#,
    )
    .unwrap();
    succeeds(Command::new("chmod").arg("+x").arg(&fake), "chmod");
    let gguf = tmp.path().join("model.gguf");
    std::fs::write(&gguf, b"GGUF").unwrap();
    let out_dir = tmp.path().join("out");
    let child = Command::new(script("gpu-check"))
        .arg(&fake)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("GPU_CHECK_PARTS", "quickstart recipe")
        .env("GPU_CHECK_SMOLLM2", &gguf)
        .env("GPU_CHECK_WORK", tmp.path().join("work"))
        .env("GPU_CHECK_OUT", &out_dir)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .process_group(0)
        .spawn()
        .unwrap();
    let kept = out_dir.join("result.txt");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !std::fs::read_to_string(&kept).is_ok_and(|t| t.contains("quickstart_accuracy=")) {
        assert!(
            std::time::Instant::now() < deadline,
            "no result.txt with the quickstart's accuracy"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    // The quickstart is measured; the recipe's import hangs: stop the whole call, as a time
    // limit does.
    std::thread::sleep(std::time::Duration::from_millis(500));
    // The check leads a process group of its own (field 5 of /proc/PID/stat), so the signal
    // reaches it and its children and nothing else.
    let pid = child.id();
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after_name = &stat[stat.rfind(')').unwrap() + 1..];
    let pgrp: u32 = after_name
        .split_whitespace()
        .nth(2)
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(pgrp, pid, "gpu-check's own process group");
    succeeds(
        Command::new("kill").args(["-s", "TERM", "--", &format!("-{pid}")]),
        "kill",
    );
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(143), "{stdout}");
    let last = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with("RESULT gpu"))
        .unwrap_or_default();
    for word in ["quickstart_accuracy=0.825", "status=stopped"] {
        assert!(last.split(' ').any(|w| w == word), "no {word} in {last:?}");
    }
    let kept = std::fs::read_to_string(&kept).unwrap();
    assert_eq!(kept.trim(), last, "result.txt holds the printed line");
}
