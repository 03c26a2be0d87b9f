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
