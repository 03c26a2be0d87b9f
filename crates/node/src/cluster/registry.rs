//! The head's membership registry: the engine and env nodes that joined, their heartbeats, and
//! which engine replica slot runs on which engine node. Shared by the admin handlers (join,
//! heartbeat, leave, list) and the engine actor's replica factory (claim a live node, check a
//! node is still live), from different tasks: members live in a [`DashMap`].
//!
//! A member is identified by its name; a node that joins again under the same name (restarted)
//! starts a new *incarnation*, so a replica built on the old one sees it gone. A member silent
//! for `node.lost_after_s` is *lost* (its replica fails at the engine's next check, its requests
//! come back aborted with their partials and resume elsewhere); it stays listed as lost until it
//! heartbeats again, joins again, or its place is needed for a new member.
//!
//! An engine member the head cannot reach (a call of the replica on it got no answer: its
//! process was killed, or it advertises a URL the head has no route to) is *unreachable* at
//! once, whatever its heartbeats say: no slot claims it until a probe of its URL answers or it
//! joins again (the `reach` module).
//!
//! Every change of who is live (a join, a return, a leave, a loss) is announced on a watch
//! channel ([`Registry::subscribe`]): a vacant engine replica slot and an episode waiting for an
//! env node wake on it instead of polling. Env nodes advertise the tasks they serve when they
//! join; the head's env episodes go to them ([`super::env_nodes`]). The messages of the
//! membership routes are in `wire` (re-exported here).
//!
//! Heartbeats are timed on tokio's clock ([`Instant`]), as the head's sweeper is: a test that
//! pauses the runtime's time moves both.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use dashmap::DashMap;
use sluice_config::{NodeConfig, NodeRole};
use sluice_core::metrics as m;
use sluice_env::remote::OpenEnvs;
use tokio::sync::watch;
use tokio::time::Instant;

mod reach;
mod series;
mod wire;

use wire::valid_name;
pub use wire::{
    Heartbeat, JoinError, JoinReply, JoinRequest, MAX_ADVERTISED_TASKS, MemberHealth, NodeView,
    UnreachableView,
};

#[derive(Debug, Clone)]
pub(super) struct Member {
    pub(super) role: NodeRole,
    pub(super) url: String,
    pub(super) incarnation: u64,
    last_seen: Instant,
    pub(super) health: MemberHealth,
    weight_version: Option<u64>,
    pub(super) load: Option<u64>,
    /// Tasks it serves (env nodes).
    pub(super) tasks: Vec<String>,
    /// The head's envs open on it (env nodes).
    pub(super) envs_open: OpenEnvs,
    /// Why the head marked it unreachable, the times it did under this incarnation and when
    /// to probe it next ([`reach`]).
    reach: reach::Reach,
}

/// An engine node claimed for a replica slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    /// The node's name.
    pub name: String,
    /// Its incarnation when claimed.
    pub incarnation: u64,
    /// Its URL.
    pub url: String,
}

/// See the module docs.
#[derive(Debug)]
pub struct Registry {
    pub(super) members: DashMap<String, Member>,
    /// Replica slot → the engine node it runs on. Only the engine actor claims (one thread), the
    /// admin handlers read.
    claims: Mutex<BTreeMap<u32, Claim>>,
    incarnations: AtomicU64,
    heartbeat: Duration,
    lost_after: Duration,
    max_nodes: usize,
    /// Bumped at every change of who is live.
    changes: watch::Sender<u64>,
}

impl Registry {
    /// An empty registry with the head's `[node]` timings and limit.
    pub fn new(node: &NodeConfig) -> Self {
        Self::with_timings(
            node.heartbeat,
            node.lost_after,
            node.max_nodes.get() as usize,
        )
    }

    /// An empty registry (tests choose their own timings).
    pub fn with_timings(heartbeat: Duration, lost_after: Duration, max_nodes: usize) -> Self {
        Self {
            members: DashMap::new(),
            claims: Mutex::new(BTreeMap::new()),
            incarnations: AtomicU64::new(0),
            heartbeat,
            lost_after,
            max_nodes: max_nodes.max(1),
            changes: watch::Sender::new(0),
        }
    }

    /// Changes of who is live: the value is bumped at every join, return, leave and loss.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    fn announce(&self) {
        self.changes.send_modify(|n| *n += 1);
    }

    /// The heartbeat period members are told to keep.
    pub fn heartbeat(&self) -> Duration {
        self.heartbeat
    }

    /// Adds `req` as a new incarnation (a node that joins again under its name and URL replaces
    /// its old self, which a restart leaves behind). A live member under the name at another
    /// URL is another node: refused, until it leaves, is lost or is found unreachable. At the
    /// limit, the longest-lost member makes room; with none lost, refused.
    pub fn join(&self, req: JoinRequest) -> Result<JoinReply, JoinError> {
        if req.role == NodeRole::Head {
            return Err(JoinError::HeadRole);
        }
        if !valid_name(&req.name) {
            return Err(JoinError::BadName(req.name));
        }
        if req.tasks.len() > MAX_ADVERTISED_TASKS || !req.tasks.iter().all(|t| valid_name(t)) {
            let shown: Vec<&str> = req.tasks.iter().take(8).map(String::as_str).collect();
            return Err(JoinError::BadTasks(format!(
                "{} names ({}{})",
                req.tasks.len(),
                shown.join(", "),
                if req.tasks.len() > 8 { ", …" } else { "" }
            )));
        }
        // Exactly `http://host:port`: every later call appends its route to it, so a path,
        // query or credentials would ride along on each.
        if !req.url.starts_with("http://") || sluice_http::origin::check_origin(&req.url).is_err() {
            return Err(JoinError::BadUrl(req.url));
        }
        if let Some(held) = self.members.get(&req.name)
            && held.health == MemberHealth::Live
            && held.url != req.url
        {
            return Err(JoinError::NameTaken {
                name: req.name,
                url: held.url.clone(),
            });
        }
        if !self.members.contains_key(&req.name) && self.members.len() >= self.max_nodes {
            let oldest_lost = self
                .members
                .iter()
                .filter(|m| m.health == MemberHealth::Lost)
                .min_by_key(|m| m.last_seen)
                .map(|m| m.key().clone());
            match oldest_lost {
                Some(name) => {
                    self.members.remove(&name);
                }
                None => {
                    return Err(JoinError::Full {
                        max: self.max_nodes,
                    });
                }
            }
        }
        let incarnation = self.incarnations.fetch_add(1, Ordering::Relaxed) + 1;
        tracing::info!(name = %req.name, role = req.role.as_str(), url = %req.url, incarnation, "node joined");
        self.members.insert(
            req.name.clone(),
            Member {
                role: req.role,
                url: req.url,
                incarnation,
                last_seen: Instant::now(),
                health: MemberHealth::Live,
                weight_version: None,
                load: None,
                tasks: req.tasks,
                envs_open: OpenEnvs::default(),
                reach: reach::Reach::default(),
            },
        );
        self.announce();
        Ok(JoinReply {
            name: req.name,
            incarnation,
            heartbeat_s: self.heartbeat.as_secs_f64(),
        })
    }

    /// Records a heartbeat; `false` when `name` is not a member under that incarnation (the head
    /// restarted, or the node was replaced): the node joins again.
    pub fn heartbeat_from(&self, name: &str, beat: &Heartbeat) -> bool {
        let Some(mut member) = self.members.get_mut(name) else {
            return false;
        };
        if member.incarnation != beat.incarnation {
            return false;
        }
        let returned = member.health == MemberHealth::Lost;
        if returned {
            tracing::info!(name, "lost node heartbeats again");
            member.health = MemberHealth::Live;
        }
        // An unreachable member stays so: its heartbeats reach the head, which says nothing of
        // the head reaching it (only a probe of its URL or a new join does).
        member.last_seen = Instant::now();
        member.weight_version = beat.weight_version.or(member.weight_version);
        member.load = beat.load;
        drop(member);
        if returned {
            self.announce();
        }
        true
    }

    /// Removes `name` (a clean leave); `false` when it is not a member under `incarnation`.
    pub fn leave(&self, name: &str, incarnation: u64) -> bool {
        let removed = self
            .members
            .remove_if(name, |_, m| m.incarnation == incarnation);
        if let Some((_, m)) = &removed {
            tracing::info!(name, role = m.role.as_str(), "node left");
            self.announce();
        }
        removed.is_some()
    }

    /// Marks members silent for longer than `lost_after` as lost (the head runs this every
    /// heartbeat period), unreachable ones included. Returns the names newly lost.
    pub fn sweep(&self, now: Instant) -> Vec<String> {
        let mut lost = Vec::new();
        for mut member in self.members.iter_mut() {
            if member.health != MemberHealth::Lost
                && now.saturating_duration_since(member.last_seen) > self.lost_after
            {
                member.health = MemberHealth::Lost;
                let name = member.key().clone();
                tracing::warn!(
                    %name,
                    role = member.role.as_str(),
                    silent_s = now.saturating_duration_since(member.last_seen).as_secs_f64(),
                    "node lost: no heartbeat within node.lost_after_s"
                );
                metrics::counter!(m::NODE_MEMBER_LOST, "role" => member.role.as_str()).increment(1);
                lost.push(name);
            }
        }
        if !lost.is_empty() {
            self.announce();
        }
        lost
    }

    /// Marks `name` lost now, when it is live under `incarnation`: a call to it found it gone
    /// (an env node whose connections are refused). A node that is in fact alive is live again
    /// at its next heartbeat. Returns whether it was marked.
    pub fn mark_gone(&self, name: &str, incarnation: u64) -> bool {
        let marked = match self.members.get_mut(name) {
            Some(mut member)
                if member.incarnation == incarnation && member.health == MemberHealth::Live =>
            {
                member.health = MemberHealth::Lost;
                tracing::warn!(
                    name,
                    role = member.role.as_str(),
                    "node lost: a call to it failed"
                );
                metrics::counter!(m::NODE_MEMBER_LOST, "role" => member.role.as_str()).increment(1);
                true
            }
            _ => false,
        };
        if marked {
            self.announce();
        }
        marked
    }

    /// Whether `name` is a live member under `incarnation` (heartbeating, and not found
    /// unreachable).
    pub fn is_live(&self, name: &str, incarnation: u64) -> bool {
        self.members
            .get(name)
            .is_some_and(|m| m.incarnation == incarnation && m.health == MemberHealth::Live)
    }

    /// Claims a live engine node no other slot runs on for replica `slot` (its previous claim
    /// released first), or says why there is none.
    pub fn claim(&self, slot: u32) -> Result<Claim, String> {
        let mut claims = self.claims.lock().unwrap_or_else(|p| p.into_inner());
        claims.remove(&slot);
        let taken = |name: &str, incarnation: u64| {
            claims.values().any(|c| {
                c.name == name && c.incarnation == incarnation && self.is_live(name, incarnation)
            })
        };
        let mut engines: Vec<(String, u64, String)> = self
            .members
            .iter()
            .filter(|m| m.role == NodeRole::Engine && m.health == MemberHealth::Live)
            .map(|m| (m.key().clone(), m.incarnation, m.url.clone()))
            .collect();
        engines.sort();
        let live = engines.len();
        let free = engines
            .into_iter()
            .find(|(name, incarnation, _)| !taken(name, *incarnation));
        match free {
            Some((name, incarnation, url)) => {
                let claim = Claim {
                    name,
                    incarnation,
                    url,
                };
                claims.insert(slot, claim.clone());
                Ok(claim)
            }
            None if live == 0 => Err("no engine node has joined the head yet".into()),
            None => Err(format!(
                "all {live} live engine nodes run other replicas (engine.replicas bounds the nodes served)"
            )),
        }
    }

    /// Every member, by name.
    pub fn list(&self) -> Vec<NodeView> {
        let now = Instant::now();
        let claims = self
            .claims
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let mut out: Vec<NodeView> = self
            .members
            .iter()
            .map(|m| NodeView {
                name: m.key().clone(),
                role: m.role,
                url: m.url.clone(),
                health: m.health,
                incarnation: m.incarnation,
                last_seen_seconds: now.saturating_duration_since(m.last_seen).as_secs_f64(),
                weight_version: m.weight_version,
                load: m.load,
                replica: claims
                    .iter()
                    .find(|(_, c)| c.name == *m.key() && c.incarnation == m.incarnation)
                    .map(|(slot, _)| *slot),
                tasks: m.tasks.clone(),
                envs_open: (m.role == NodeRole::Env).then(|| m.envs_open.get() as u64),
                unreachable: m.reach.view(m.health),
            })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }
}

#[cfg(test)]
mod tests;
