//! The head's per-member series, rendered from the registry at each scrape: one series per
//! current member, none for a node that left or whose place went to another. Kept as gauges of
//! the `metrics` recorder, which has no way to delete a series, every name that ever joined
//! stayed in each scrape for the life of the head (a cluster whose nodes get new names, as pods
//! do, grew without bound).

use std::fmt::Write as _;

use sluice_core::metrics as m;

use super::{MemberHealth, Registry};

impl Registry {
    /// `sluice_node_member_up_info{node, role}` (1 while live, 0 while lost or unreachable)
    /// and `sluice_node_member_weight_version{node}` (members that reported one), in the
    /// Prometheus text format with their HELP and TYPE lines; empty with no member.
    pub fn exposition(&self) -> String {
        let members = self.list();
        let mut out = String::new();
        if members.is_empty() {
            return out;
        }
        header(&mut out, m::NODE_MEMBER_UP);
        for v in &members {
            let up = u8::from(v.health == MemberHealth::Live);
            let _ = writeln!(
                out,
                "{}{{node=\"{}\",role=\"{}\"}} {up}",
                m::NODE_MEMBER_UP,
                escape(&v.name),
                v.role.as_str()
            );
        }
        let versions: Vec<_> = members
            .iter()
            .filter_map(|v| Some((&v.name, v.weight_version?)))
            .collect();
        if !versions.is_empty() {
            header(&mut out, m::NODE_MEMBER_WEIGHT_VERSION);
            for (name, version) in versions {
                let _ = writeln!(
                    out,
                    "{}{{node=\"{}\"}} {version}",
                    m::NODE_MEMBER_WEIGHT_VERSION,
                    escape(name)
                );
            }
        }
        out
    }
}

/// The HELP and TYPE lines of the catalog's gauge `name`.
fn header(out: &mut String, name: &str) {
    let help = m::find(name).map_or("", |d| d.help);
    let help = help.replace('\\', "\\\\").replace('\n', "\\n");
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
}

/// A label value as the text format quotes it (member names are already plain: `valid_name`).
fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}
