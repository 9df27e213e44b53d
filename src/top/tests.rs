//! The top-K on a hand-fed stream: who comes first, the window, a quiet
//! replica's cost, and the query's parameters.

use super::*;
use crate::limiter::LimitKind;

const T0: i64 = 1_800_000_000_000_000;
const S: i64 = 1_000_000;

fn ip() -> LimitKind {
    LimitKind::from_index(0)
}

fn key() -> LimitKind {
    LimitKind::from_index(1)
}

fn names(v: &Value) -> Vec<String> {
    v["clients"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            format!(
                "{}/{}/{}",
                c["client"].as_str().unwrap(),
                c["route"],
                c["tier"]
            )
        })
        .collect()
}

#[test]
fn three_abusers_come_first_among_a_fair_crowd() {
    let top = Top::default();
    let mut t = T0;
    for round in 0..50 {
        for i in 0..200 {
            t += 10;
            let client = format!("fair-{i}");
            top.record(
                "ride",
                &[(ip(), Seen::Admitted), (key(), Seen::Admitted)],
                |_| &client,
                t,
            );
        }
        for (n, abuser) in ["a", "b", "c"].iter().enumerate() {
            // a most, then b, then c; each also admitted now and then
            // (counted once it is held: not in round 0).
            for _ in 0..(3 - n) {
                let seen = if round % 10 == 0 {
                    Seen::Admitted
                } else {
                    Seen::Refused
                };
                top.record(
                    "ride",
                    &[(ip(), Seen::Admitted), (key(), seen)],
                    |_| abuser,
                    t,
                );
            }
        }
    }
    let v = top.query(&Ask::default(), t);
    assert_eq!(
        names(&v)[..3],
        [
            "a/\"ride\"/\"key\"",
            "b/\"ride\"/\"key\"",
            "c/\"ride\"/\"key\""
        ],
        "{v}"
    );
    let a = &v["clients"][0];
    assert_eq!(
        (a["refused"].as_u64(), a["admitted"].as_u64()),
        (Some(135), Some(12)),
        "{a}"
    );
    // The IP tier refused nobody: no ring for it, and the fair crowd is
    // nowhere.
    assert_eq!(v["clients"].as_array().unwrap().len(), 3, "{v}");
}

#[test]
fn the_window_holds_only_its_slots_and_an_old_slot_is_reused_empty() {
    let top = Top::default();
    let refuse = |who: &str, at: i64| top.record("r", &[(ip(), Seen::Refused)], |_| who, at);
    refuse("old", T0);
    refuse("new", T0 + 30 * S);
    let ask = |secs| Ask {
        window_secs: secs,
        ..Ask::default()
    };
    let now = T0 + 31 * S;
    assert_eq!(names(&top.query(&ask(60), now)).len(), 2);
    assert_eq!(names(&top.query(&ask(10), now)), ["new/\"r\"/\"ip\""]);
    // A minute and more later the old slot's place is another slot's.
    refuse("later", T0 + SLOTS as i64 * SLOT_SECS * S);
    let v = top.query(&ask(60), T0 + SLOTS as i64 * SLOT_SECS * S);
    assert_eq!(names(&v), ["later/\"r\"/\"ip\"", "new/\"r\"/\"ip\""], "{v}");
}

#[test]
fn a_replica_that_refused_nobody_keeps_nothing() {
    let top = Top::default();
    for i in 0..1000 {
        let c = format!("c{i}");
        top.record("r", &[(ip(), Seen::Admitted)], |_| &c, T0 + i);
    }
    assert!(top.rings.read().is_empty());
    assert_eq!(top.query(&Ask::default(), T0)["clients"], json!([]));
}

#[test]
fn memory_is_bounded_whatever_the_clients() {
    let top = Top::default();
    for i in 0..100_000 {
        let c = format!("c{i}");
        top.record("r", &[(ip(), Seen::Refused)], |_| &c, T0 + i * 1000);
    }
    let rings = top.rings.read();
    let ring = rings["r"][0].as_ref().unwrap().lock();
    let held: usize = ring.slots.iter().map(|(_, s)| s.counters().len()).sum();
    assert!(held <= SLOTS * K, "{held} counters");
}

#[test]
fn a_query_names_what_it_did_not_understand() {
    assert_eq!(
        Ask::parse("route=ride&tier=key&window=10&limit=3"),
        Ok(Ask {
            route: Some("ride".into()),
            tier: Some("key".into()),
            window_secs: 10,
            limit: 3
        })
    );
    assert_eq!(
        Ask::parse("window=61"),
        Err("window=61: expected seconds, 1 to 60".into())
    );
    assert_eq!(
        Ask::parse("limit=0"),
        Err("limit=0: expected 1 to 1000".into())
    );
    assert_eq!(
        Ask::parse("who=me"),
        Err("unknown parameter \"who\": expected route, tier, window, limit".into())
    );
}

#[test]
fn filters_pick_a_route_and_a_tier() {
    let top = Top::default();
    top.record("a", &[(ip(), Seen::Refused)], |_| "x", T0);
    top.record("b", &[(key(), Seen::Refused)], |_| "y", T0);
    let only = |route: Option<&str>, tier: Option<&str>| {
        names(&top.query(
            &Ask {
                route: route.map(Into::into),
                tier: tier.map(Into::into),
                ..Ask::default()
            },
            T0,
        ))
    };
    assert_eq!(only(Some("a"), None), ["x/\"a\"/\"ip\""]);
    assert_eq!(only(None, Some("key")), ["y/\"b\"/\"key\""]);
    assert!(only(Some("a"), Some("key")).is_empty());
}

#[test]
fn replicas_answers_merge_into_one_view() {
    let one = |client: &str, refused: u64, admitted: u64, first: u8, last: u8| {
        json!({
            "client": client, "route": "r", "tier": "ip", "refused": refused,
            "refused_at_least": refused, "admitted": admitted,
            "first_seen": format!("2027-01-01T00:00:0{first}.000Z"),
            "last_seen": format!("2027-01-01T00:00:0{last}.000Z"),
        })
    };
    let a = json!({"window_secs": 60, "clients": [one("x", 4, 1, 2, 5), one("y", 1, 1, 1, 1)]});
    let b = json!({"window_secs": 60, "clients": [one("y", 6, 1, 3, 9), one("x", 3, 1, 1, 4)]});
    let m = merge(&[a, b]);
    assert_eq!(m["replicas"], 2);
    // Counts summed, the earliest first and the latest last; a tie in
    // order of name.
    assert_eq!(
        m["clients"],
        json!([one("x", 7, 2, 1, 5), one("y", 7, 2, 1, 9)]),
        "{m}"
    );
}
