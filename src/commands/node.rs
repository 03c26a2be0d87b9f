//! `sluice run` of an engine or env node (`[node] role = "engine" | "env"`, `docs/cluster.md`):
//! starts the node of `sluice_node::cluster::member_node` from the config, joins the head and
//! serves until SIGINT or SIGTERM, then stops it (it leaves the head first, aborts what is in
//! flight) and exits 0. A node the head replaced (declared lost, its name taken by another live
//! node) stops as well, and exits non-zero with the head's word. This file says what happens;
//! the node is the library's.

use std::process::ExitCode;

use anyhow::{Context, bail};
use sluice_config::{Config, NodeConfig, NodeRole};
use sluice_node::cluster::member_node::MemberNode;

use super::shutdown_signal;

/// Runs an engine or env node until it is stopped.
pub fn run(config: &Config, node: &NodeConfig) -> anyhow::Result<ExitCode> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async {
        let member = match node.role {
            NodeRole::Engine => MemberNode::start_engine(config).await?,
            NodeRole::Env => {
                let token = super::env_server::token_from_env()?;
                MemberNode::start_env(config, token).await?
            }
            NodeRole::Head => bail!("a head runs the pipeline (sluice run), not a member node"),
        };
        serve(member).await
    })
}

/// Joins the head and serves until a signal or until the head replaces this node; a signal
/// while joining stops the node at once.
async fn serve(mut member: MemberNode) -> anyhow::Result<ExitCode> {
    println!(
        "sluice {} node `{}` on http://{}, joining {}",
        member.role().as_str(),
        member.name(),
        member.addr(),
        member.head()
    );
    let joined = tokio::select! {
        joined = member.join() => Some(joined),
        () = shutdown_signal() => None,
    };
    let result = match joined {
        Some(Ok(())) => tokio::select! {
            () = shutdown_signal() => Ok(()),
            superseded = member.superseded() => Err(superseded),
        },
        Some(Err(e)) => Err(e),
        None => Ok(()),
    };
    member.stop().await;
    result?;
    Ok(ExitCode::SUCCESS)
}
