//! Unreachable engine members: the head's replica on one got no answer from it (connection
//! refused or reset, nothing within the call's deadline), so no slot claims it again until the
//! head has reason to think it can reach it:
//!
//! - it joins again (restarted: a new incarnation, live at once), or
//! - a probe of its URL (`GET /health`, any HTTP answer, within [`PROBE_TIMEOUT`]) answers.
//!
//! Heartbeats do not clear it: they show the node reaches the head, not that the head reaches
//! the node (a node behind a firewall, or advertising the wrong URL, heartbeats fine). The head
//! probes an unreachable member one heartbeat period after it was marked, then every
//! heartbeat period while it stays unreachable; each time it is marked again under the same
//! incarnation the wait doubles (at most [`MAX_PROBE_PERIOD`]), so a node that answers probes
//! but fails real calls costs a claim at a falling rate, and none of it counts towards
//! `supervision.engine_max_restarts`.
//!
//! Env nodes are not marked so: one a call finds gone is marked lost and comes back with its
//! next heartbeat ([`crate::cluster::env_nodes`]), since an env call that fails only moves its
//! episode.

use std::sync::Arc;
use std::time::Duration;

use sluice_core::metrics as m;
use sluice_http::{HttpClient, Method};
use tokio::time::Instant;

use super::{MemberHealth, Registry, UnreachableView};

/// Deadline of one probe.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest wait between two probes of an unreachable member.
pub const MAX_PROBE_PERIOD: Duration = Duration::from_secs(30);

/// A member's reachability record (see the module docs).
#[derive(Debug, Clone, Default)]
pub(super) struct Reach {
    /// The failed call that marked it unreachable last.
    reason: Option<String>,
    /// Times it was marked unreachable under this incarnation.
    times: u32,
    /// When to probe it next, while unreachable.
    next_probe: Option<Instant>,
}

impl Reach {
    /// What the member listing shows while the member is unreachable.
    pub(super) fn view(&self, health: MemberHealth) -> Option<UnreachableView> {
        (health == MemberHealth::Unreachable).then(|| UnreachableView {
            reason: self.reason.clone().unwrap_or_default(),
            times: self.times,
            next_probe_seconds: self.next_probe.map_or(0.0, |t| {
                t.saturating_duration_since(Instant::now()).as_secs_f64()
            }),
        })
    }
}

/// An unreachable member due for a probe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Probe {
    /// Its name.
    pub name: String,
    /// Its incarnation when the probe was due.
    pub incarnation: u64,
    /// Its URL.
    pub url: String,
}

impl Registry {
    /// The wait before probing a member marked unreachable `times` times: the heartbeat
    /// period, doubled per time beyond the first, at most [`MAX_PROBE_PERIOD`].
    fn probe_period(&self, times: u32) -> Duration {
        let doublings = times.saturating_sub(1).min(16);
        self.heartbeat
            .saturating_mul(1 << doublings)
            .min(MAX_PROBE_PERIOD)
    }

    /// Marks the engine member `name` unreachable when it is live under `incarnation`: a call
    /// of the replica on it got no answer (`reason`). No slot claims it until a probe answers
    /// or it joins again (see the module docs). Returns whether it was marked.
    pub fn mark_unreachable(&self, name: &str, incarnation: u64, reason: &str) -> bool {
        let marked = match self.members.get_mut(name) {
            Some(mut member)
                if member.incarnation == incarnation && member.health == MemberHealth::Live =>
            {
                member.health = MemberHealth::Unreachable;
                member.reach.times += 1;
                member.reach.reason = Some(reason.to_owned());
                let wait = self.probe_period(member.reach.times);
                member.reach.next_probe = Some(Instant::now() + wait);
                tracing::warn!(
                    name,
                    role = member.role.as_str(),
                    url = %member.url,
                    reason,
                    times = member.reach.times,
                    probe_in_s = wait.as_secs_f64(),
                    "node unreachable: the head's call to it got no answer; no replica runs on it until a probe of its url answers or it joins again"
                );
                metrics::counter!(m::NODE_MEMBER_UNREACHABLE, "role" => member.role.as_str())
                    .increment(1);
                true
            }
            _ => false,
        };
        if marked {
            self.announce();
        }
        marked
    }

    /// The unreachable members whose probe is due at `now`.
    pub fn probes_due(&self, now: Instant) -> Vec<Probe> {
        self.members
            .iter()
            .filter(|m| {
                m.health == MemberHealth::Unreachable && m.reach.next_probe.is_none_or(|t| t <= now)
            })
            .map(|m| Probe {
                name: m.key().clone(),
                incarnation: m.incarnation,
                url: m.url.clone(),
            })
            .collect()
    }

    /// Records a probe's outcome: an answer makes the member live again (announced, so a
    /// vacant slot claims it); no answer schedules the next probe.
    pub fn probed(&self, probe: &Probe, answered: bool) {
        let back = match self.members.get_mut(&probe.name) {
            Some(mut member)
                if member.incarnation == probe.incarnation
                    && member.health == MemberHealth::Unreachable =>
            {
                if answered {
                    member.health = MemberHealth::Live;
                    member.reach.next_probe = None;
                    tracing::info!(name = %probe.name, url = %probe.url, "unreachable node answers again: it can run a replica");
                } else {
                    let wait = self.probe_period(member.reach.times);
                    member.reach.next_probe = Some(Instant::now() + wait);
                }
                answered
            }
            _ => false,
        };
        if back {
            self.announce();
        }
    }

    /// Probes the unreachable engine members every heartbeat period, until aborted (the
    /// head's task, beside the sweeper).
    pub async fn probe_unreachable(self: Arc<Self>) {
        let mut ticker = tokio::time::interval(self.heartbeat);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            let due = self.probes_due(Instant::now());
            let answers = futures::future::join_all(due.iter().map(|p| answers(&p.url))).await;
            for (probe, answered) in due.iter().zip(answers) {
                self.probed(probe, answered);
            }
        }
    }
}

/// Whether the server at `url` answers `GET /health` (any status) within [`PROBE_TIMEOUT`].
async fn answers(url: &str) -> bool {
    let Ok(client) = HttpClient::new(url, "engine node") else {
        return false;
    };
    client
        .call(Method::GET, "/health", None, PROBE_TIMEOUT)
        .await
        .is_ok()
}
