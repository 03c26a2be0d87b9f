//! Phase two of `[node]`.

use std::time::Duration;

use sluice_core::config::ConfigError;
use sluice_core::config::check::{Ctx, choice, non_zero_u32, number, socket};

use crate::sections::raw::RawNode;
use crate::sections::typed::{NodeConfig, NodeRole};

/// A base URL the cluster client can reach: `http://host:port`, no path.
fn base_url(ctx: &Ctx<'_>, key: &str, v: &str) -> Result<String, ConfigError> {
    let rest = v.strip_prefix("http://").unwrap_or("");
    let authority = rest.trim_end_matches('/');
    let ok = !authority.is_empty()
        && !authority.contains('/')
        && authority
            .rsplit_once(':')
            .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
    if !ok {
        return Err(ctx.value(
            key,
            format!("expected a base URL like http://10.0.0.1:9401, got `{v}`"),
        ));
    }
    Ok(format!("http://{authority}"))
}

/// Phase two of `[node]`.
pub fn validate_node(raw: RawNode, ctx: &Ctx<'_>) -> Result<NodeConfig, ConfigError> {
    let role: NodeRole = choice(ctx, "node.role", &raw.role)?;
    let heartbeat_s = number(
        ctx,
        "node.heartbeat_s",
        raw.heartbeat_s,
        "a number of seconds > 0",
        |v| v > 0.0,
    )?;
    let lost_after_s = number(
        ctx,
        "node.lost_after_s",
        raw.lost_after_s,
        &format!("more seconds than node.heartbeat_s ({heartbeat_s})"),
        |v| v > heartbeat_s,
    )?;
    let max_nodes = non_zero_u32(ctx, "node.max_nodes", raw.max_nodes)?;
    let member = role != NodeRole::Head;
    let head = match (raw.head, member) {
        (Some(h), true) => Some(base_url(ctx, "node.head", &h)?),
        (None, true) => {
            return Err(ctx.value(
                "node.head",
                format!(
                    "an {} node joins a head: expected the head's admin URL, like http://10.0.0.1:9401",
                    role.as_str()
                ),
            ));
        }
        (Some(_), false) => {
            return Err(ctx.value(
                "node.head",
                "the head joins no one: remove node.head (or set node.role = \"engine\" or \"env\")",
            ));
        }
        (None, false) => None,
    };
    let listen = match (raw.listen, member) {
        (Some(l), true) => Some(socket(ctx, "node.listen", &l)?),
        (None, true) => Some(
            if role == NodeRole::Engine {
                "127.0.0.1:8000"
            } else {
                "127.0.0.1:8071"
            }
            .parse()
            .expect("a valid default"),
        ),
        (Some(_), false) => {
            return Err(ctx.value(
                "node.listen",
                "the head serves on admin.listen; node.listen is for engine and env nodes",
            ));
        }
        (None, false) => None,
    };
    let advertise = raw
        .advertise
        .map(|a| base_url(ctx, "node.advertise", &a))
        .transpose()?;
    if let Some(l) = listen
        && advertise.is_none()
        && (l.ip().is_unspecified() || l.port() == 0)
    {
        return Err(ctx.value(
            "node.advertise",
            format!(
                "node.listen = {l} is not an address the head can reach: set node.advertise to this node's URL"
            ),
        ));
    }
    let name = match raw.name {
        Some(n) => {
            let valid = !n.is_empty()
                && n.len() <= 63
                && n.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
            if !valid || !member {
                return Err(ctx.value(
                    "node.name",
                    if member {
                        format!("expected 1 to 63 characters of [A-Za-z0-9._-], got `{n}`")
                    } else {
                        "the head has no name at itself; node.name is for engine and env nodes"
                            .to_owned()
                    },
                ));
            }
            Some(n)
        }
        None => None,
    };
    Ok(NodeConfig {
        role,
        head,
        name,
        listen,
        advertise,
        heartbeat: Duration::from_secs_f64(heartbeat_s),
        lost_after: Duration::from_secs_f64(lost_after_s),
        max_nodes,
    })
}
