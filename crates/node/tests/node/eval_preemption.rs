//! The evaluator on a KV cache too small for its episodes: the engine preempts sequences (their
//! partials come back as aborts) and the evaluator resumes them, so the evaluation ends with the
//! same episodes as one with room to spare instead of failing.

use std::sync::Arc;

use sluice_config::Config;
use sluice_core::RolloutStatus;
use sluice_engine::{NativeEngineParams, SamplingParams};
use sluice_node::native::{Evaluator, NativeSetup, ensure_model_dir};

fn config(dir: &std::path::Path) -> Config {
    let text = format!(
        r#"
[run]
name = "eval-preemption"
output_dir = "{out}"
max_steps = 1

[model]
init_preset = "tiny"

[engine]
backend = "native"

[rollout]
max_new_tokens = 24

[data]
datasets = ["math::arithmetic@train"]
"#,
        out = dir.display()
    );
    sluice_config::parse(&text, "test.toml", &[], &|_| None).expect("valid config")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evaluation_resumes_preempted_requests_and_matches_an_unpreempted_one() {
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path());
    ensure_model_dir(&config).unwrap();
    let setup = NativeSetup::load(&config, None).unwrap();
    let task = setup.registry.get("arithmetic").unwrap();
    let samples: Vec<_> = task
        .eval_samples(0, 16)
        .unwrap()
        .into_iter()
        .take(12)
        .collect();
    let evaluator = |kv_cache_bytes: u64| {
        Evaluator::new(
            Arc::clone(&task),
            samples.clone(),
            setup.renderer.clone(),
            setup.limits(&config),
            NativeEngineParams {
                max_running_sequences: 64,
                eos_token_ids: setup.tokenizer.eos_token_ids().to_vec(),
                // The tiny preset's blocks take 8 KiB (16 tokens × 512 bytes): 24 blocks hold
                // about three episodes, 12 run at once.
                kv_cache_bytes,
                ..NativeEngineParams::default()
            },
            Arc::clone(&setup.tokenizer),
            SamplingParams {
                temperature: 0.0,
                top_p: 1.0,
                top_k: 0,
                max_tokens: 24,
                seed: None,
                stop_token_ids: Vec::new(),
            },
        )
    };
    let roomy = evaluator(0)
        .evaluate(Arc::clone(&setup.weights))
        .await
        .unwrap();
    assert_eq!(roomy.resumed_requests, 0);
    let tight = evaluator(24 * 8 * 1024)
        .evaluate(Arc::clone(&setup.weights))
        .await
        .expect("preempted requests are resumed, not failed");
    assert!(
        tight.resumed_requests > 0,
        "the budget must force preemption"
    );
    assert_eq!(tight.rollouts.len(), samples.len());
    assert!(tight.rollouts.iter().all(|r| matches!(
        r.status,
        RolloutStatus::Completed | RolloutStatus::Truncated
    )));
    // Greedy decoding resumed from prompt + partial continues as the uninterrupted run did.
    let tokens = |e: &sluice_node::native::Evaluation| {
        e.rollouts
            .iter()
            .map(|r| {
                r.turns
                    .iter()
                    .map(|t| t.completion_token_ids.clone())
                    .collect::<Vec<_>>()
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(tokens(&tight), tokens(&roomy));
    assert_eq!(tight.report.mean_reward, roomy.report.mean_reward);
}
