//! The registry's rules: slot claims, incarnations, loss and return, refused joins.

use super::*;

fn engine(name: &str, port: u16) -> JoinRequest {
    JoinRequest {
        name: name.into(),
        role: NodeRole::Engine,
        url: format!("http://127.0.0.1:{port}"),
        tasks: Vec::new(),
    }
}

fn registry(max: usize) -> Registry {
    Registry::with_timings(Duration::from_millis(100), Duration::from_millis(500), max)
}

#[test]
fn slots_claim_distinct_live_engines_and_a_rejoin_is_a_new_incarnation() {
    let r = registry(8);
    assert!(r.claim(0).unwrap_err().contains("no engine node"));
    let a = r.join(engine("a", 1)).unwrap();
    r.join(engine("b", 2)).unwrap();
    let c0 = r.claim(0).unwrap();
    let c1 = r.claim(1).unwrap();
    assert_ne!(c0.name, c1.name);
    assert!(r.claim(2).unwrap_err().contains("all 2 live engine nodes"));
    // Slot 0 claims again (its replica is rebuilt): it may take the same node.
    assert_eq!(r.claim(0).unwrap(), c0);
    let again = r.join(engine("a", 1)).unwrap();
    assert!(again.incarnation > a.incarnation);
    assert!(
        !r.is_live("a", a.incarnation),
        "the old incarnation is gone"
    );
    assert!(r.is_live("a", again.incarnation));
    assert!(!r.heartbeat_from(
        "a",
        &Heartbeat {
            incarnation: a.incarnation,
            ..Default::default()
        }
    ));
}

#[test]
fn a_silent_member_is_lost_until_it_heartbeats_and_lost_ones_make_room() {
    let r = registry(2);
    let a = r.join(engine("a", 1)).unwrap();
    r.join(engine("b", 2)).unwrap();
    assert_eq!(
        r.join(engine("c", 3)).unwrap_err(),
        JoinError::Full { max: 2 }
    );
    let later = Instant::now() + Duration::from_secs(1);
    assert_eq!(r.sweep(later).len(), 2);
    assert!(!r.is_live("a", a.incarnation));
    assert!(r.claim(0).is_err(), "a lost node gets no replica");
    assert!(r.heartbeat_from(
        "a",
        &Heartbeat {
            incarnation: a.incarnation,
            weight_version: Some(3),
            load: Some(1)
        }
    ));
    assert!(r.is_live("a", a.incarnation));
    // `b` is lost: `c` takes its place.
    r.join(engine("c", 3)).unwrap();
    let names: Vec<String> = r.list().into_iter().map(|n| n.name).collect();
    assert_eq!(names, ["a", "c"]);
    assert_eq!(r.list()[0].weight_version, Some(3));
    assert!(r.leave("a", a.incarnation));
    assert!(!r.leave("a", a.incarnation));
}

#[test]
fn bad_joins_are_refused() {
    let r = registry(2);
    let mut bad = engine("a b", 1);
    assert!(matches!(r.join(bad.clone()), Err(JoinError::BadName(_))));
    bad.name = "a".into();
    bad.url = "10.0.0.1:80".into();
    assert!(matches!(r.join(bad.clone()), Err(JoinError::BadUrl(_))));
    bad.url = "http://10.0.0.1:80".into();
    bad.tasks = vec!["arithmetic".into(), "no spaces".into()];
    assert!(matches!(r.join(bad.clone()), Err(JoinError::BadTasks(_))));
    bad.tasks = (0..=MAX_ADVERTISED_TASKS)
        .map(|i| format!("t{i}"))
        .collect();
    let err = r.join(bad.clone()).unwrap_err().to_string();
    assert!(err.contains("got 65 names (t0, t1"), "{err}");
    bad.tasks.clear();
    bad.role = NodeRole::Head;
    assert_eq!(r.join(bad).unwrap_err(), JoinError::HeadRole);
}

#[test]
fn an_unreachable_engine_gets_no_claim_until_a_probe_answers_or_it_joins_again() {
    let r = registry(8);
    let a = r.join(engine("a", 1)).unwrap();
    r.join(engine("b", 2)).unwrap();
    assert_eq!(r.claim(0).unwrap().name, "a");
    let mut changes = r.subscribe();
    changes.borrow_and_update();
    // The replica on `a` got no answer: unreachable at once, announced, and its slot takes `b`.
    assert!(r.mark_unreachable("a", a.incarnation, "connection refused"));
    assert!(changes.has_changed().unwrap());
    assert!(
        !r.mark_unreachable("a", a.incarnation, "again"),
        "marked once"
    );
    assert!(!r.is_live("a", a.incarnation));
    assert_eq!(r.claim(0).unwrap().name, "b");
    assert!(r.claim(1).unwrap_err().contains("all 1 live engine nodes"));
    let listed = &r.list()[0];
    assert_eq!(listed.health, MemberHealth::Unreachable);
    let why = listed.unreachable.as_ref().unwrap();
    assert_eq!((why.reason.as_str(), why.times), ("connection refused", 1));
    // Its heartbeats keep it listed and not lost, but do not make it claimable.
    let beat = Heartbeat {
        incarnation: a.incarnation,
        ..Default::default()
    };
    assert!(r.heartbeat_from("a", &beat));
    assert_eq!(r.list()[0].health, MemberHealth::Unreachable);
    assert!(r.sweep(Instant::now()).is_empty());
    // Probed one heartbeat period after it was marked: no answer keeps it out.
    assert!(r.probes_due(Instant::now()).is_empty(), "not due yet");
    let due = r.probes_due(Instant::now() + Duration::from_millis(150));
    assert_eq!(due.len(), 1);
    r.probed(&due[0], false);
    assert!(r.claim(1).is_err());
    // An answer makes it live again, announced: the vacant slot claims it.
    changes.borrow_and_update();
    r.probed(&due[0], true);
    assert!(changes.has_changed().unwrap());
    assert_eq!(r.list()[0].health, MemberHealth::Live);
    assert!(r.list()[0].unreachable.is_none());
    assert_eq!(r.claim(1).unwrap().name, "a");
    // Marked again under the same incarnation: the next probe waits twice as long.
    assert!(r.mark_unreachable("a", a.incarnation, "reset"));
    let after = |ms| r.probes_due(Instant::now() + Duration::from_millis(ms));
    assert!(after(150).is_empty());
    assert_eq!(after(250).len(), 1);
    // A silent unreachable member is lost; a new join is live at once, its count reset.
    let mut lost = r.sweep(Instant::now() + Duration::from_secs(1));
    lost.sort();
    assert_eq!(lost, ["a", "b"]);
    let again = r.join(engine("a", 1)).unwrap();
    assert!(r.is_live("a", again.incarnation));
    assert!(
        !r.mark_unreachable("a", a.incarnation, "old"),
        "an old incarnation is not marked"
    );
    assert!(r.mark_unreachable("a", again.incarnation, "refused"));
    assert_eq!(r.list()[0].unreachable.as_ref().unwrap().times, 1);
}

/// The per-member series follow the registry: 1 while live, 0 while lost, a weight version once
/// reported, and nothing for a node that left or lost its place to another.
#[test]
fn the_member_series_are_the_members_and_go_with_them() {
    let r = registry(2);
    assert_eq!(r.exposition(), "", "no member, no series");
    let a = r.join(engine("a", 1)).unwrap();
    r.join(engine("b", 2)).unwrap();
    let text = r.exposition();
    assert!(
        text.contains("# TYPE sluice_node_member_up_info gauge\n"),
        "{text}"
    );
    assert!(
        text.contains("sluice_node_member_up_info{node=\"a\",role=\"engine\"} 1\n"),
        "{text}"
    );
    assert!(
        !text.contains("sluice_node_member_weight_version"),
        "none reported: {text}"
    );
    r.sweep(Instant::now() + Duration::from_secs(1));
    assert!(r.heartbeat_from(
        "a",
        &Heartbeat {
            incarnation: a.incarnation,
            weight_version: Some(7),
            load: None
        }
    ));
    let text = r.exposition();
    assert!(
        text.contains("sluice_node_member_up_info{node=\"a\",role=\"engine\"} 1\n"),
        "{text}"
    );
    assert!(
        text.contains("sluice_node_member_up_info{node=\"b\",role=\"engine\"} 0\n"),
        "lost: {text}"
    );
    assert!(
        text.contains("sluice_node_member_weight_version{node=\"a\"} 7\n"),
        "{text}"
    );
    // `c` takes lost `b`'s place, and `a` leaves: their series go.
    r.join(engine("c", 3)).unwrap();
    assert!(r.leave("a", a.incarnation));
    let text = r.exposition();
    assert!(!text.contains("node=\"a\""), "{text}");
    assert!(!text.contains("node=\"b\""), "{text}");
    assert!(
        text.contains("sluice_node_member_up_info{node=\"c\",role=\"engine\"} 1\n"),
        "{text}"
    );
}

/// A live member's name is its own: a join under it from another URL (two nodes configured with
/// one name, or a frozen node back after its replacement joined) is refused, where the two
/// used to replace each other at every heartbeat. The same URL is a restart, and a lost or
/// unreachable holder gives the name up.
#[test]
fn a_live_members_name_is_refused_to_another_url() {
    let r = registry(4);
    let first = r.join(engine("e1", 1)).unwrap();
    assert_eq!(
        r.join(engine("e1", 2)).unwrap_err(),
        JoinError::NameTaken {
            name: "e1".into(),
            url: "http://127.0.0.1:1".into()
        }
    );
    assert!(r.is_live("e1", first.incarnation), "the holder stays");
    let restarted = r.join(engine("e1", 1)).unwrap();
    assert!(restarted.incarnation > first.incarnation);
    assert!(r.mark_unreachable("e1", restarted.incarnation, "no answer"));
    let moved = r.join(engine("e1", 2)).unwrap();
    r.sweep(Instant::now() + Duration::from_secs(1));
    assert!(!r.is_live("e1", moved.incarnation));
    r.join(engine("e1", 3)).unwrap();
    assert_eq!(r.list()[0].url, "http://127.0.0.1:3");
}
