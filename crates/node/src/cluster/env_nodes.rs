//! The head's env nodes as the set of env servers its training episodes run on
//! ([`sluice_env::remote::EnvServers`]): a domain with `env_nodes = true` gets its envs from
//! the live env nodes that advertised its task when they joined, each new episode on the one
//! with the fewest of the head's envs open (then the lowest load it reported, then by name).
//! A node a call finds gone is marked lost at once, so no other episode is sent there before
//! it heartbeats again; its episodes move to the others (`sluice_env::remote::RoutedEnv`).

use sluice_config::NodeRole;
use sluice_env::remote::{EnvServer, EnvServers, ServerId};
use tokio::sync::watch;

use super::registry::{MemberHealth, Registry};

impl EnvServers for Registry {
    fn subscribe(&self) -> watch::Receiver<u64> {
        Registry::subscribe(self)
    }

    fn pick(&self, task: &str, avoid: &[ServerId]) -> Option<EnvServer> {
        self.members
            .iter()
            .filter(|m| {
                m.role == NodeRole::Env
                    && m.health == MemberHealth::Live
                    && m.tasks.iter().any(|t| t == task)
                    && !avoid
                        .iter()
                        .any(|a| a.name == *m.key() && a.incarnation == m.incarnation)
            })
            .min_by(|a, b| {
                (a.envs_open.get(), a.load.unwrap_or(0), a.key()).cmp(&(
                    b.envs_open.get(),
                    b.load.unwrap_or(0),
                    b.key(),
                ))
            })
            .map(|m| {
                EnvServer::new(
                    ServerId {
                        name: m.key().clone(),
                        incarnation: m.incarnation,
                    },
                    m.url.clone(),
                    &m.envs_open,
                )
            })
    }

    fn gone(&self, server: &ServerId) {
        self.mark_gone(&server.name, server.incarnation);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::cluster::registry::JoinRequest;

    fn env(name: &str, tasks: &[&str]) -> JoinRequest {
        JoinRequest {
            name: name.into(),
            role: NodeRole::Env,
            // One port per node name: a member URL is exactly `http://host:port`.
            url: format!("http://127.0.0.1:{}", 1000 + u16::from(name.as_bytes()[0])),
            tasks: tasks.iter().map(|t| (*t).to_owned()).collect(),
        }
    }

    #[test]
    fn episodes_spread_over_live_nodes_serving_the_task_and_skip_gone_ones() {
        let r = Registry::with_timings(Duration::from_millis(100), Duration::from_secs(5), 8);
        r.join(env("a", &["arithmetic"])).unwrap();
        r.join(env("b", &["arithmetic", "episodic"])).unwrap();
        r.join(env("c", &["episodic"])).unwrap();
        assert!(r.pick("sum_digits", &[]).is_none(), "no node serves it");
        // Held envs count: four episodes go two and two.
        let held: Vec<EnvServer> = (0..4).map(|_| r.pick("arithmetic", &[]).unwrap()).collect();
        let on_a = held.iter().filter(|s| s.id.name == "a").count();
        assert_eq!(on_a, 2, "{held:?}");
        let listed = r.list();
        assert_eq!(listed[0].envs_open, Some(2));
        drop(held);
        assert_eq!(
            r.list()[0].envs_open,
            Some(0),
            "closed envs release their count"
        );
        // `a` is found gone: lost at once, announced, and not picked again.
        let mut changes = r.subscribe();
        let a = r.pick("arithmetic", &[]).unwrap();
        assert_eq!(a.id.name, "a");
        r.gone(&a.id);
        assert!(changes.has_changed().unwrap());
        changes.borrow_and_update();
        for _ in 0..3 {
            assert_eq!(r.pick("arithmetic", &[]).unwrap().id.name, "b");
        }
        // Avoided, `b` leaves no server for the task.
        let b = r.pick("arithmetic", &[]).unwrap().id.clone();
        assert!(r.pick("arithmetic", &[b]).is_none());
        // `a` rejoins (restarted): a new incarnation, picked again, and the join is announced.
        r.join(env("a", &["arithmetic"])).unwrap();
        assert!(changes.has_changed().unwrap());
        assert_eq!(r.pick("arithmetic", &[]).unwrap().id.name, "a");
    }
}
