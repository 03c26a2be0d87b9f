//! `stock_tool`: multi-turn tool use where the answer can only come from the tool. The model is
//! asked `How many figs are in stock?`; the counts are drawn per problem and never shown in the
//! prompt, so it must call `stock` with the item,
//! `<tool_call>{"name": "stock", "arguments": {"item": "figs"}}</tool_call>`, read the count in
//! the tool's reply and answer `[ANSWER] n`. Calling for another item returns that item's count
//! (a wrong answer); an unknown item is a tool error.
//!
//! What it asks of a model: pick the item named in the question (one of [`ITEMS`], which differ
//! in their first letter) and copy a number from the tool's reply into the answer. Unlike
//! [`super::calculator`], nothing has to be copied character by character across the prompt, so
//! a character-level model of ~100 k parameters can learn it; the held-out split holds unseen
//! (item, counts) draws, so memorising training answers does not pass it.
//!
//! Situations and the tool budget are the tool episode's ([`super::tool_env`]): `tool_call`,
//! `tool_error`, `answer`, `tool_budget`. Rewards: `correct` on the final answer (weight 1),
//! `format` (weight 0.1).

use std::collections::BTreeMap;

use serde_json::json;
use sluice_core::message::FunctionSpec;
use sluice_core::{DataSample, ToolSpec};
use sluice_data::rng::Rng;

use crate::error::EnvError;
use crate::protocol::MessageEnv;
use crate::task::{DataGenerator, Task};
use crate::tasks::tool_env::{ToolEnv, Toolbox, answer_tag_rubric, call_text, string_argument};
use crate::tasks::{draw, field, train_eval_specs};

/// Registered name.
pub const NAME: &str = "stock_tool";

/// System prompt of the task.
pub const SYSTEM_PROMPT: &str = "Look up counts with the stock tool. End with `[ANSWER] <number>`.";

/// The items a question may ask about (first letters all different).
pub const ITEMS: [&str; 10] = [
    "apples", "bananas", "cherries", "dates", "figs", "grapes", "kiwis", "lemons", "mangos",
    "pears",
];

/// Counts are drawn from `0..MAX_COUNT`.
pub const MAX_COUNT: u64 = 100;

/// The `stock` tool's declaration.
pub fn stock_tool() -> ToolSpec {
    ToolSpec {
        kind: "function".into(),
        function: FunctionSpec {
            name: "stock".into(),
            description: "How many of an item are in stock.".into(),
            parameters: json!({
                "type": "object",
                "properties": {"item": {"type": "string", "enum": ITEMS}},
                "required": ["item"]
            }),
        },
    }
}

/// Generates problems of the `train` / `eval` split: an item to ask about and the counts of all
/// of [`ITEMS`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Generator;

impl DataGenerator for Generator {
    fn generate(&self, split: &str, seed: u64, count: usize) -> Result<Vec<DataSample>, EnvError> {
        draw(NAME, split, seed, count, |rng: &mut Rng| {
            let item = ITEMS[rng.below(ITEMS.len() as u64) as usize];
            let stock: BTreeMap<&str, u64> = ITEMS
                .iter()
                .map(|&name| (name, rng.below(MAX_COUNT)))
                .collect();
            let answer = stock[item];
            let key = format!("{item}:{stock:?}");
            (key, json!({"item": item, "stock": stock, "answer": answer}))
        })
    }
}

/// The `stock` tool of one episode.
#[derive(Debug)]
struct Stock {
    counts: BTreeMap<String, u64>,
}

impl Toolbox for Stock {
    fn specs(&self) -> Vec<ToolSpec> {
        vec![stock_tool()]
    }

    fn call(&self, name: &str, arguments: &str) -> Result<String, String> {
        if name != "stock" {
            return Err(format!("unknown tool `{name}`; the only tool is `stock`"));
        }
        let item = string_argument(arguments, "item")?;
        self.counts
            .get(item.trim())
            .map(u64::to_string)
            .ok_or_else(|| format!("unknown item `{item}`; items: {}", ITEMS.join(", ")))
    }
}

/// The reference episode: one `stock` call for the asked item, then its count as the answer.
fn reference(sample: &DataSample, turn: u32) -> Option<String> {
    match turn {
        0 => {
            let item: String = field(sample, "item").ok()?;
            Some(call_text("stock", json!({ "item": item })))
        }
        1 => Some(format!("[ANSWER] {}", field::<u64>(sample, "answer").ok()?)),
        _ => None,
    }
}

fn env(sample: &DataSample) -> Result<Box<dyn MessageEnv>, EnvError> {
    let item: String = field(sample, "item")?;
    let counts: BTreeMap<String, u64> = field(sample, "stock")?;
    if !counts.contains_key(&item) {
        return Err(EnvError::BadInput(format!(
            "sample `{}`: `stock` has no count for the asked item `{item}`",
            sample.id
        )));
    }
    Ok(Box::new(ToolEnv::new(
        format!("How many {item} are in stock?"),
        Stock { counts },
    )))
}

/// The task.
pub fn task() -> Task {
    Task::new(NAME, env, answer_tag_rubric())
        .with_system_prompt(SYSTEM_PROMPT)
        .with_datasets(train_eval_specs("tools", NAME))
        .with_reference(reference)
        .with_generator(Generator)
}

#[cfg(test)]
mod tests {
    use sluice_core::Message;
    use sluice_core::message::{FunctionCall, ToolCall};

    use super::*;

    fn call(name: &str, arguments: serde_json::Value) -> Message {
        let mut m = Message::assistant("");
        m.tool_calls.push(ToolCall {
            id: "call_0".into(),
            kind: "function".into(),
            function: FunctionCall {
                name: name.into(),
                arguments: arguments.to_string(),
            },
        });
        m
    }

    #[tokio::test]
    async fn the_tool_answers_the_count_of_the_item_called_for() {
        let sample = &Generator.generate("train", 7, 1).unwrap()[0];
        let item: String = field(sample, "item").unwrap();
        let counts: BTreeMap<String, u64> = field(sample, "stock").unwrap();
        let mut env = env(sample).unwrap();
        let init = env.init().await.unwrap();
        let question = init.messages[0].content.clone().unwrap();
        assert_eq!(question, format!("How many {item} are in stock?"));
        assert!(!question.chars().any(|c| c.is_ascii_digit()), "{question}");
        assert_eq!(init.tools[0].function.name, "stock");

        let other = ITEMS.iter().find(|&&i| i != item).unwrap();
        let step = env
            .step(call("stock", json!({ "item": other })))
            .await
            .unwrap();
        assert_eq!(step.situation.as_deref(), Some("tool_call"));
        assert_eq!(
            step.messages[0].content.as_deref(),
            Some(counts[*other].to_string().as_str())
        );

        let step = env
            .step(call("stock", json!({ "item": "plums" })))
            .await
            .unwrap();
        assert_eq!(step.situation.as_deref(), Some("tool_error"));
        let reply = step.messages[0].content.as_deref().unwrap();
        assert!(reply.starts_with("error: unknown item `plums`"), "{reply}");

        let step = env
            .step(call("lookup", json!({ "item": item })))
            .await
            .unwrap();
        assert_eq!(step.situation.as_deref(), Some("tool_error"));

        let step = env.step(Message::assistant("[ANSWER] 3")).await.unwrap();
        assert!(step.done);
        assert_eq!(step.situation.as_deref(), Some("answer"));
    }

    #[test]
    fn the_splits_are_disjoint_and_deterministic() {
        let train = Generator.generate("train", 1, 300).unwrap();
        let eval = Generator.generate("eval", 1, 100).unwrap();
        assert_eq!(train, Generator.generate("train", 1, 300).unwrap());
        let key = |s: &DataSample| s.input.to_string();
        let train_keys: std::collections::HashSet<_> = train.iter().map(key).collect();
        assert!(eval.iter().all(|s| !train_keys.contains(&key(s))));
        // Every item is asked about, and the answer is the asked item's count.
        for s in &train {
            let item: String = field(s, "item").unwrap();
            let counts: BTreeMap<String, u64> = field(s, "stock").unwrap();
            assert_eq!(field::<u64>(s, "answer").unwrap(), counts[&item]);
        }
        let asked: std::collections::HashSet<String> =
            train.iter().map(|s| field(s, "item").unwrap()).collect();
        assert_eq!(asked.len(), ITEMS.len());
    }

    #[test]
    fn a_sample_whose_counts_lack_the_item_is_refused_by_name() {
        let mut sample = Generator.generate("train", 1, 1).unwrap()[0].clone();
        sample.input["item"] = json!("plums");
        let err = env(&sample).err().unwrap().to_string();
        assert!(err.contains("no count for the asked item `plums`"), "{err}");
    }
}
