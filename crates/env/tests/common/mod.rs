//! Shared test helpers: a scripted policy and sample/rollout builders.

#![allow(dead_code)]

use std::sync::Arc;

use sluice_core::{DataSample, GroupId, NodeId, PolicyVersion, Rollout, RunId};
use sluice_env::{
    BoxFuture, ByteRenderer, EnvError, Generate, Generated, Renderer, Task, TokenEnvLimits,
    TurnFinish, run_episode,
};

/// Replies with the given texts in order (byte tokens), each ending with `<|im_end|>`; a text
/// starting with `LEN:` is returned without the end marker and with finish reason `Length`.
pub struct Scripted {
    /// Replies, in order.
    pub replies: Vec<String>,
    /// Index of the next reply.
    pub next: usize,
    /// Every prompt seen, as text.
    pub prompts: Vec<String>,
}

impl Scripted {
    /// A policy that will say `replies`.
    pub fn new(replies: &[&str]) -> Self {
        Self {
            replies: replies.iter().map(|s| s.to_string()).collect(),
            next: 0,
            prompts: Vec::new(),
        }
    }
}

impl Generate for Scripted {
    fn generate<'a>(&'a mut self, prompt: &'a [u32]) -> BoxFuture<'a, Result<Generated, EnvError>> {
        Box::pin(async move {
            self.prompts
                .push(prompt.iter().map(|&t| t as u8 as char).collect());
            let text = self
                .replies
                .get(self.next)
                .cloned()
                .ok_or_else(|| EnvError::Generate("script exhausted".into()))?;
            self.next += 1;
            let (text, finish) = match text.strip_prefix("LEN:") {
                Some(t) => (t.to_owned(), TurnFinish::Length),
                None => (format!("{text}{}", ByteRenderer::END), TurnFinish::Stop),
            };
            let token_ids = ByteRenderer::encode(&text);
            let n = token_ids.len();
            Ok(Generated {
                token_ids,
                logprobs: vec![-0.5; n],
                versions: vec![PolicyVersion(0); n],
                finish,
            })
        })
    }
}

/// A sample with `input`.
pub fn sample(input: serde_json::Value) -> DataSample {
    DataSample {
        id: "s0".into(),
        domain: "test".into(),
        dataset: "t".into(),
        input,
        system_prompt: None,
    }
}

/// A fresh rollout.
pub fn rollout(index: u32) -> Rollout {
    Rollout::new(
        GroupId {
            run: RunId::from_name("test"),
            node: NodeId(0),
            counter: 0,
        }
        .rollout(index),
    )
}

/// The byte renderer.
pub fn renderer() -> Arc<dyn Renderer> {
    Arc::new(ByteRenderer)
}

/// Runs one episode of `task` on `sample` with scripted replies and scores it.
pub async fn play(task: &Task, sample: &DataSample, replies: &[&str]) -> Rollout {
    let mut env = task
        .token_env(sample, renderer(), TokenEnvLimits::default())
        .unwrap();
    let mut policy = Scripted::new(replies);
    let mut r = rollout(0);
    run_episode(&mut env, &mut policy, &mut r).await.unwrap();
    let score = task.rubric().score(sample, &r).await;
    score.apply_to(&mut r);
    if let Some(d) = task.discount() {
        sluice_env::discount::apply_discount(&mut r, d);
    }
    r
}
