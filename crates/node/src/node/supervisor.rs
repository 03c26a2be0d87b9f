//! The node's supervisor actor: every pipeline actor is linked to it, and its supervision
//! handler applies the last rows of the restart table of DESIGN §3 (see [`crate::node`]).
//!
//! Restarts that keep a run going happen below this level, where the state to restart from
//! lives: the engine actor rebuilds its replicas, an env worker turns a panicking env call into
//! a failed rollout and lives on. An actor whose end reaches this handler — the sampler,
//! controller, replay store, engine actor, trainer or an env worker — holds run state no restart
//! here could rebuild, so the run stops: the end is announced on the [`RunEvents`] (the first
//! actor to end is what [`crate::Node::failure`] names), the run's watchers end the run, and a
//! restart of the process resumes from the checkpoint and the replay store.

use std::collections::HashMap;

use ractor::{
    Actor, ActorCell, ActorId, ActorProcessingErr, ActorRef, ActorStatus, SupervisionEvent,
};

use sluice_actors::ActorError;
use sluice_actors::events::RunEvents;

/// Messages: adopt a child under a name.
pub(crate) struct Adopt {
    name: &'static str,
    cell: ActorCell,
}

/// The supervisor, with where it announces ends.
struct Supervisor {
    events: RunEvents,
}

impl Supervisor {
    /// `name` ended (`failure`: its error or panic): the run stops.
    fn ended(&self, name: &'static str, failure: Option<String>) {
        if let Some(e) = failure {
            tracing::error!(actor = name, error = %e, "actor failed; the run stops");
        }
        self.events.actor_ended(name);
    }
}

impl Actor for Supervisor {
    type Msg = Adopt;
    /// Each linked child's name.
    type State = HashMap<ActorId, &'static str>;
    type Arguments = ();

    async fn pre_start(
        &self,
        _me: ActorRef<Adopt>,
        (): (),
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(HashMap::new())
    }

    async fn handle(
        &self,
        me: ActorRef<Adopt>,
        Adopt { name, cell }: Adopt,
        children: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        children.insert(cell.get_id(), name);
        cell.link(me.get_cell());
        // A child that ended before it was linked sends no event: look once after linking.
        if matches!(
            cell.get_status(),
            ActorStatus::Stopping | ActorStatus::Stopped
        ) && children.remove(&cell.get_id()).is_some()
        {
            self.ended(name, None);
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        _me: ActorRef<Adopt>,
        event: SupervisionEvent,
        children: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        // ractor's default would stop the supervisor on any child's end; the table decides.
        match event {
            SupervisionEvent::ActorTerminated(cell, _, _) => {
                if let Some(name) = children.remove(&cell.get_id()) {
                    self.ended(name, None);
                }
            }
            SupervisionEvent::ActorFailed(cell, e) => {
                if let Some(name) = children.remove(&cell.get_id()) {
                    self.ended(name, Some(e.to_string()));
                }
            }
            _ => {}
        }
        Ok(())
    }
}

/// Handle on the node's supervisor; dropping it stops the supervisor (a node whose start
/// failed half-way leaves none behind).
pub(crate) struct NodeSupervisor {
    actor: ActorRef<Adopt>,
    join: Option<tokio::task::JoinHandle<()>>,
}

impl NodeSupervisor {
    /// Starts a supervisor announcing ends on `events`.
    pub(crate) async fn start(events: RunEvents) -> Result<Self, ActorError> {
        let (actor, join) = Actor::spawn(None, Supervisor { events }, ())
            .await
            .map_err(|e| ActorError::Spawn {
                actor: "supervisor",
                message: e.to_string(),
            })?;
        Ok(Self {
            actor,
            join: Some(join),
        })
    }

    /// Links `cell` under `name`: its end is handled by the restart table.
    pub(crate) fn adopt(&self, name: &'static str, cell: ActorCell) {
        if self.actor.cast(Adopt { name, cell }).is_err() {
            tracing::error!(
                actor = name,
                "the node supervisor is gone; the actor is unsupervised"
            );
        }
    }

    /// Stops the supervisor (after its children: the node stops them first).
    pub(crate) async fn stop(mut self) {
        self.actor.stop(None);
        if let Some(join) = self.join.take() {
            let _ = join.await;
        }
    }
}

impl Drop for NodeSupervisor {
    fn drop(&mut self) {
        self.actor.stop(None);
    }
}
