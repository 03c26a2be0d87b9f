//! Builders of rollout groups and of batcher texts for the trainer's tests.
#![allow(dead_code)]

use sluice_core::{
    DataSample, GroupId, NodeId, PolicyVersion, RolloutGroup, RolloutStatus, RolloutTurn, RunId,
};

/// One turn: `prompt` ids, `completion` ids with behaviour log-prob `logprob` each, version `v`.
pub fn turn(
    prompt: &[u32],
    completion: &[u32],
    logprob: f32,
    v: u64,
    situation: Option<&str>,
) -> RolloutTurn {
    let mut t = RolloutTurn::new(prompt.to_vec());
    let n = completion.len();
    t.append_tokens(completion, &vec![logprob; n], &vec![PolicyVersion(v); n])
        .unwrap();
    t.situation = situation.map(str::to_owned);
    t
}

/// A completed group whose rollout `i` has `turns[i]` and reward `rewards[i]`.
pub fn group(counter: u64, rewards: &[f64], turns: Vec<Vec<RolloutTurn>>) -> RolloutGroup {
    let id = GroupId {
        run: RunId::from_name("test"),
        node: NodeId(0),
        counter,
    };
    let sample = DataSample {
        id: counter.to_string(),
        domain: "math".into(),
        dataset: "arith".into(),
        input: serde_json::Value::Null,
        system_prompt: None,
    };
    let mut g = RolloutGroup::new(id, sample, rewards.len() as u32, PolicyVersion(0));
    for ((r, &reward), ts) in g.rollouts.iter_mut().zip(rewards).zip(turns) {
        r.reward = reward;
        r.turns = ts;
        r.status = RolloutStatus::Completed;
    }
    g
}

/// A group of single-turn rollouts with rewards `rewards`, each completing `[7, 8]` after `[1, 2]`.
pub fn single_turn_group(counter: u64, rewards: &[f64]) -> RolloutGroup {
    let turns = rewards
        .iter()
        .map(|_| vec![turn(&[1, 2], &[7, 8], -0.5, 0, None)])
        .collect();
    group(counter, rewards, turns)
}

/// `a ≈ b` within `tol`, with a message.
pub fn close(a: f64, b: f64, tol: f64, what: &str) {
    assert!((a - b).abs() <= tol, "{what}: {a} vs {b}");
}

/// The buffers of one training text (the batcher borrows them).
pub struct OwnedText {
    pub prompt: Vec<u32>,
    pub completion: Vec<u32>,
    pub behaviour: Vec<f32>,
    pub versions: Vec<u64>,
}

/// The batcher's view of `owned`: text `i` gets advantage `i − 0.5` and weight `1 / (i + 1)`, so
/// the checks can tell every text's figures apart.
pub fn text_views(owned: &[OwnedText]) -> Vec<sluice_trainer::batcher::TrainingText<'_>> {
    owned
        .iter()
        .enumerate()
        .map(|(i, t)| sluice_trainer::batcher::TrainingText {
            prompt: &t.prompt,
            completion: &t.completion,
            behaviour: &t.behaviour,
            versions: &t.versions,
            advantage: i as f32 - 0.5,
            weight: 1.0 / (i as f32 + 1.0),
        })
        .collect()
}
