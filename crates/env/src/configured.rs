//! The tasks of a run as its config sets them up: the built-in tasks, and for each
//! `[data.domains.<domain>]` that sets a `rubric`, an `env_url` or `env_nodes`, a copy of the
//! domain's task with that rubric and its envs on that server, registered as `<domain>/<task>`
//! and serving the domain. A domain with `env_nodes` keeps the task's own envs here (the
//! head's evaluations and warm-up run them); [`route_to_env_nodes`] gives the head's training
//! episodes the copy whose envs run on the joined env nodes. A domain whose task is not registered here but that names an env server gets a task
//! of its own: its envs run on the server, its rows come from `data_dir`, and its rubric is the
//! configured one (default: the env's rewards, `env` with weight 1).
//!
//! A domain whose task is `qa` and that sets its row fields (`question_field`, `answer_field`,
//! `system_prompt_field`, `answer_marker`) gets a `qa` copy reading them; those keys on a domain
//! of another task are refused.
//! A domain whose task is `python_code` and that sets a `sandbox` table gets a copy whose programs
//! run under those limits; a `sandbox` on a domain of another task is refused.
//!
//! Every error names the config key, like the config's own checks.

use sluice_core::config::Secret;
use sluice_data::config::{DataConfig, DomainConfig, DomainRubric, DomainSandbox, REWARD_MODEL_FN};

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use crate::error::EnvError;
use crate::remote::{EnvServers, RemoteEnvFactory, RoutedEnvFactory};
use crate::reward_fns::{AnswerOptions, GENERIC_NAMES, generic};
use crate::reward_model::RewardModelLoader;
use crate::rubric::{RewardFn, Rubric, RubricConfig};
use crate::sandbox::SandboxLimits;
use crate::task::{Task, TaskRegistry};
use crate::tasks::python_code;
use crate::tasks::qa::{self, QaOptions};

/// The environment variable holding the bearer token env servers are called with (the one
/// `sluice env-server` requires beyond loopback).
pub const ENV_TOKEN_VAR: &str = "SLUICE_ENV_TOKEN";

/// The built-in tasks configured by `data`'s domains; env servers are called with
/// `$SLUICE_ENV_TOKEN` when it is set, each call bounded by `env_step_timeout`
/// (`supervision.env_step_timeout_s`); rubrics with a `reward_model` table get their model from
/// `reward_models` (without one, such a rubric is refused).
pub fn registry(
    data: &DataConfig,
    env_step_timeout: Duration,
    reward_models: Option<&RewardModelLoader>,
) -> Result<TaskRegistry, EnvError> {
    configure(
        TaskRegistry::builtin(),
        data,
        env_step_timeout,
        env_token(),
        reward_models,
    )
}

/// The discount per turn of each domain whose episodes have one of their own, for the trainer's
/// advantages: `data.domains.<d>.gamma`, else the discount of the built-in task that serves the
/// domain (the `episodic` task's γ = 0.9). A domain left out takes `trainer.gamma`.
pub fn domain_gammas(data: &DataConfig) -> BTreeMap<String, f64> {
    let builtin = TaskRegistry::builtin();
    let mut domains = data.domains();
    domains.extend(data.domain_options.keys().cloned());
    domains
        .into_iter()
        .filter_map(|domain| {
            let options = data
                .domain_options
                .get(&domain)
                .cloned()
                .unwrap_or_default();
            if let Some(gamma) = options.gamma {
                return Some((domain, gamma));
            }
            let key = format!("data.domains.{domain}");
            // A domain whose task cannot be resolved is refused when the registry is built.
            let task = serving_task(data, &domain, &options, &key).ok().flatten()?;
            let discount = builtin.get(&task).ok()?.discount()?;
            Some((domain, discount.gamma))
        })
        .collect()
}

/// `$SLUICE_ENV_TOKEN`, trimmed as `sluice env-server` trims it, when set and not empty.
fn env_token() -> Option<Secret> {
    sluice_http::auth::token_from_env(ENV_TOKEN_VAR)
        .ok()
        .flatten()
}

/// `registry` (built by [`registry`] from `data`) with the envs of every domain that sets
/// `env_nodes` on `servers` (a head's joined env nodes), called with `$SLUICE_ENV_TOKEN` when
/// it is set: what the head's training episodes run on.
pub fn route_to_env_nodes(
    registry: &TaskRegistry,
    data: &DataConfig,
    env_step_timeout: Duration,
    servers: Arc<dyn EnvServers>,
) -> Result<TaskRegistry, EnvError> {
    let token = env_token();
    let mut routed = registry.clone();
    for (domain, options) in data.domain_options.iter().filter(|(_, o)| o.env_nodes) {
        let key = format!("data.domains.{domain}");
        let Some(task) = serving_task(data, domain, options, &key)? else {
            continue;
        };
        let name = registry.domain_tasks().get(domain).ok_or_else(|| {
            EnvError::Config(format!(
                "{key}.env_nodes: the domain has no configured task"
            ))
        })?;
        let envs =
            RoutedEnvFactory::new(Arc::clone(&servers), task, env_step_timeout, token.clone());
        routed.replace((*registry.get(name)?).clone().with_env(envs))?;
    }
    Ok(routed)
}

/// `registry`'s tasks configured by `data`'s domains (see the module doc); calls to env
/// servers carry `token` as a bearer token when given and are bounded by `env_step_timeout`;
/// `reward_models` makes the models of rubrics' `reward_model` tables.
pub fn configure(
    mut registry: TaskRegistry,
    data: &DataConfig,
    env_step_timeout: Duration,
    token: Option<Secret>,
    reward_models: Option<&RewardModelLoader>,
) -> Result<TaskRegistry, EnvError> {
    for (domain, options) in &data.domain_options {
        let key = format!("data.domains.{domain}");
        let Some(task) = serving_task(data, domain, options, &key)? else {
            continue;
        };
        let reads_rows = options.sets_qa_keys();
        if reads_rows && task != qa::NAME {
            return Err(EnvError::Config(format!(
                "{key}.{}: only the `{}` task reads it; the domain's task is `{task}` (set `task = \"{}\"`)",
                first_qa_key(options),
                qa::NAME,
                qa::NAME
            )));
        }
        if options.sandbox.is_some() && task != python_code::NAME {
            return Err(EnvError::Config(format!(
                "{key}.sandbox: only the `{}` task runs programs in a sandbox; the domain's task is `{task}`",
                python_code::NAME
            )));
        }
        if !needs_own_copy(options) {
            registry.serve_domain(domain, task);
            continue;
        }
        let (base, answers) = if reads_rows {
            let qa_options = QaOptions::from_domain(options);
            let answers = qa_options.answer_options();
            (qa::task_with(qa_options), answers)
        } else if let Some(sandbox) = &options.sandbox {
            let limits = sandbox_limits(sandbox);
            (python_code::task_with(limits), AnswerOptions::default())
        } else {
            let base = match registry.get(&task) {
                Ok(t) => (*t).clone(),
                Err(_) if options.env_url.is_some() => remote_only_task(&task),
                Err(e) => return Err(EnvError::Config(format!("{key}.task: {e}"))),
            };
            (base, AnswerOptions::default())
        };
        let rubric = options
            .rubric
            .as_ref()
            .map(|spec| rubric_with_answers(&base, spec, answers, reward_models))
            .transpose()
            .map_err(|e| EnvError::Config(format!("{key}.rubric.{e}")))?;
        let mut configured = base.renamed(format!("{domain}/{task}"));
        if let Some(rubric) = rubric {
            configured = configured.with_rubric(rubric);
        }
        if let Some(url) = &options.env_url {
            let mut envs = RemoteEnvFactory::new(url, &task, env_step_timeout)
                .map_err(|e| EnvError::Config(format!("{key}.env_url: {e}")))?;
            if let Some(token) = &token {
                envs = envs.with_token(token.clone());
            }
            configured = configured.with_env(envs);
        }
        let name = configured.name().to_owned();
        registry.register(configured)?;
        registry.serve_domain(domain, name);
    }
    Ok(registry)
}

/// The task name serving `domain`: its `task` key, else the one name its datasets share. `None`
/// for a domain that only sets a system prompt and whose datasets name several tasks.
fn serving_task(
    data: &DataConfig,
    domain: &str,
    options: &DomainConfig,
    key: &str,
) -> Result<Option<String>, EnvError> {
    if let Some(task) = &options.task {
        return Ok(Some(task.clone()));
    }
    let mut names: Vec<&str> = data
        .datasets
        .iter()
        .filter(|d| d.domain == domain)
        .map(|d| d.name.as_str())
        .collect();
    names.sort_unstable();
    names.dedup();
    match names.as_slice() {
        [one] => Ok(Some((*one).to_owned())),
        _ if !needs_own_copy(options) => Ok(None),
        several => Err(EnvError::Config(format!(
            "{key}.task: the domain's datasets name several tasks ({}); set `task` to say which one the rubric or env server is for",
            several.join(", ")
        ))),
    }
}

/// Whether a domain's task needs a copy of its own: a rubric, an env server, env nodes, the
/// `qa` task's row fields or a sandbox.
fn needs_own_copy(options: &DomainConfig) -> bool {
    options.rubric.is_some()
        || options.env_url.is_some()
        || options.env_nodes
        || options.sets_qa_keys()
        || options.sandbox.is_some()
}

/// The sandbox limits a domain's `sandbox` table sets, the defaults where it sets none.
fn sandbox_limits(sandbox: &DomainSandbox) -> SandboxLimits {
    let d = SandboxLimits::default();
    SandboxLimits {
        cpu_seconds: sandbox.cpu_seconds.unwrap_or(d.cpu_seconds),
        memory_bytes: sandbox.memory_mib.map_or(d.memory_bytes, |m| m << 20),
        max_processes: sandbox.max_processes.unwrap_or(d.max_processes),
        wall: sandbox.wall_s.map_or(d.wall, Duration::from_secs_f64),
        max_output_bytes: sandbox
            .max_output_kib
            .map_or(d.max_output_bytes, |k| (k as usize) << 10),
    }
}

/// The first `qa` key a domain sets (for the error naming it).
fn first_qa_key(options: &DomainConfig) -> &'static str {
    if options.question_field.is_some() {
        "question_field"
    } else if options.answer_field.is_some() {
        "answer_field"
    } else if options.system_prompt_field.is_some() {
        "system_prompt_field"
    } else {
        "answer_marker"
    }
}

/// A task known only to an env server: envs there, rubric `env` until the config sets one.
fn remote_only_task(name: &str) -> Task {
    let unreachable = |_: &sluice_core::DataSample| {
        Err::<Box<dyn crate::MessageEnv>, _>(EnvError::Config(
            "a remote-only task runs its envs on its env server".into(),
        ))
    };
    let rubric = Rubric::new(vec![RewardFn::env_reward(1.0)], RubricConfig::default())
        .expect("a one-function rubric is valid");
    Task::new(name, unreachable, rubric)
}

/// `spec` built from `task`'s own functions and the generic ones (answers in the sample's
/// `answer` field, marked `####`). An error starts with the part of the key below `rubric.`
/// (`weights.bogus: …`).
pub fn rubric_for(task: &Task, spec: &DomainRubric) -> Result<Rubric, String> {
    rubric_with_answers(task, spec, AnswerOptions::default(), None)
}

/// [`rubric_for`] with the generic answer functions reading `answers` (the `regex` pattern and
/// the `judge` model are `spec`'s; the judge's requests carry `$SLUICE_JUDGE_TOKEN` when set;
/// the reward model is made by `reward_models`).
pub fn rubric_with_answers(
    task: &Task,
    spec: &DomainRubric,
    mut answers: AnswerOptions,
    reward_models: Option<&RewardModelLoader>,
) -> Result<Rubric, String> {
    if let Some(pattern) = &spec.regex {
        let compiled = regex::Regex::new(pattern).map_err(|e| format!("regex: {e}"))?;
        answers.regex = Some(Arc::new(compiled));
    }
    if let Some(judge) = &spec.judge {
        let judge = crate::judge::Judge::from_env(judge, &answers.answer_field)
            .map_err(|e| format!("judge.{e}"))?;
        answers.judge = Some(Arc::new(judge));
    }
    if let Some(model) = &spec.reward_model {
        let load = reward_models.ok_or(
            "reward_model: this command does not load reward models (a run, `sluice check` and `sluice data` do)",
        )?;
        let scorer = load(model).map_err(|e| format!("reward_model.path: {e}"))?;
        answers.reward_model = Some(crate::reward_model::reward_fn(scorer, 1.0, model.sigmoid));
    }
    let own = task.rubric().functions();
    let mut fns = Vec::with_capacity(spec.weights.len());
    for (name, &weight) in &spec.weights {
        let f = own
            .iter()
            .find(|f| f.name() == name)
            .map(|f| f.clone().with_weight(weight))
            .or_else(|| generic(name, weight, &answers));
        let Some(f) = f else {
            if name == "regex" {
                return Err(
                    "weights.regex: the `regex` reward function needs a pattern: set `regex = \"…\"` in the same rubric table".into(),
                );
            }
            if name == REWARD_MODEL_FN {
                return Err(
                    "weights.reward_model: the `reward_model` reward function needs its model: add a `reward_model` table (`path`) to the same rubric".into(),
                );
            }
            if name == "judge" {
                return Err(
                    "weights.judge: the `judge` reward function needs its model: add a `judge` table (`url`, `model`) to the same rubric".into(),
                );
            }
            let mut known: Vec<&str> = own.iter().map(RewardFn::name).collect();
            for g in GENERIC_NAMES {
                if !known.contains(g) {
                    known.push(g);
                }
            }
            return Err(format!(
                "weights.{name}: task `{}` has no reward function `{name}`; it has: {}",
                task.name(),
                known.join(", ")
            ));
        };
        fns.push(f);
    }
    let config = RubricConfig {
        truncation_reward: spec.truncation_reward,
        error_reward: spec.error_reward,
        timeout_s: spec.timeout.map(|d| d.as_secs_f64()),
    };
    Rubric::new(fns, config).map_err(|e| format!("weights: {e}"))
}
