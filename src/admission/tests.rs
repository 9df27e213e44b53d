//! Admission's unit tests: split rules, headers, buckets.

use super::policy::shard_name;
use super::*;
use crate::limiter::slot;

fn global(capacity: u64, shards: u64) -> crate::config::Limit {
    crate::config::Limit {
        algorithm: Algorithm::TokenBucket {
            capacity,
            refill_per_sec: 4.0,
        },
        scope: Scope::Global,
        shadow: false,
        key: LimitKey::Client,
        missing: Missing::Reject,
        cost: 1,
        charged: false,
        shards,
    }
}

#[test]
fn a_split_global_limit_deals_its_sub_buckets_in_turn_each_holding_its_share() {
    let rr = RouteRule::new("rl", "r", &global(12, 4));
    let names: Vec<String> = (0..8).map(|_| rr.check("global").key).collect();
    assert_eq!(names[..4], names[4..], "in turn, then again");
    let distinct: std::collections::BTreeSet<_> = names.iter().collect();
    assert_eq!(distinct.len(), 4);
    let c = rr.check("global");
    assert_eq!(c.shards, 4);
    assert_eq!(
        c.algorithm,
        Algorithm::TokenBucket {
            capacity: 3,
            refill_per_sec: 1.0
        }
    );
    assert!(c.key.starts_with("rl:route:r:tb-3-1:global/"), "{}", c.key);
}

#[test]
fn sub_bucket_i_of_k_lies_in_the_i_th_k_th_of_the_cluster_slots() {
    for k in [2u64, 3, 4, 6, 16, 128] {
        for i in 0..k {
            let s = slot(&shard_name("rl:route:r:tb-3-1:", i, k)) as u64;
            // Clear of the ends, where a master's boundary may fall.
            assert!(
                (i * 16384 / k + 2..(i + 1) * 16384 / k - 2).contains(&s),
                "shard {i} of {k} in slot {s}"
            );
        }
    }
}

#[test]
fn an_unsplit_limit_keeps_its_one_bucket() {
    let rr = RouteRule::new("rl", "r", &global(12, 1));
    let c = rr.check("global");
    assert_eq!((c.key.as_str(), c.shards), ("rl:route:r:tb-12-4:global", 1));
}

fn decided_by(checks: Vec<Check>, allowed: &[bool]) -> Outcome {
    let decisions = allowed
        .iter()
        .map(|&allowed| Decision {
            allowed,
            limit: 3,
            remaining: 0,
            retry_after_us: 0,
            reset_after_us: 0,
            delay_us: 0,
        })
        .collect();
    Outcome::Decided {
        verdict: crate::limiter::Verdict {
            decisions,
            now_us: 0,
        },
        backend: crate::limiter::FallbackState::Redis,
        checks: checks.into(),
        standing: crate::limiter::OnShares::NONE,
        leased: None,
    }
}

#[test]
fn a_turn_that_spent_nothing_is_given_back() {
    // Its own rule name: the dealer is shared by every rule of the process.
    let rr = RouteRule::new("settle", "r", &global(12, 4));
    let ip = Check {
        tier: Tier::Ip,
        ..rr.rule.check("ip:1.2.3.4")
    };
    let settle = |route: &Check, decided: Vec<Check>, allowed: &[bool]| {
        rr.settle(&[ip.clone(), route.clone()], &decided_by(decided, allowed));
    };
    // Another tier rejected it while its sub-bucket admitted (so it was
    // refunded, or never charged): the next request gets the same one.
    let a = rr.check("global");
    settle(&a, vec![ip.clone(), a.clone()], &[false, true]);
    let b = rr.check("global");
    assert_eq!(b.key, a.key);
    // A remembered denial of another tier answered alone: the same.
    settle(&b, vec![ip.clone()], &[false]);
    let c = rr.check("global");
    assert_eq!(c.key, a.key);
    // The sub-bucket itself was empty: the turn is spent, the next is tried.
    settle(&c, vec![ip.clone(), c.clone()], &[true, false]);
    let d = rr.check("global");
    assert_ne!(d.key, c.key);
    // Admitted: spent.
    settle(&d, vec![ip.clone(), d.clone()], &[true, true]);
    assert_ne!(rr.check("global").key, d.key);
}

#[test]
fn a_tokens_signature_check_costs_the_ip_bucket_classify_charges() {
    let policy = |tiers: &str| {
        let cfg = crate::config::parse(&format!(
            "[server]\nlisten = [\"127.0.0.1:8080\"]\n\
             [clients]\nallow = [\"10.0.0.1\"]\ndeny = [\"10.0.0.2\"]\n{tiers}\n\
             [[upstreams]]\nname = \"a\"\nservers = [\"127.0.0.1:1\"]\n\
             [[routes]]\nname = \"r\"\npath_prefix = \"/\"\nupstream = \"a\"\n"
        ))
        .expect("config");
        Policy::new(Arc::new(cfg), &Credentials::default())
    };
    let headers = http::HeaderMap::new();
    let view = |peer: &str| RequestView {
        method: "GET",
        path: "/x",
        peer: peer.parse().unwrap(),
        xff: Vec::new(),
        api_key: Vec::new(),
        authorization: Vec::new(),
        host: None,
        content_length: None,
        query: None,
        headers: &headers,
        jwt: None,
    };
    let ip = "[tiers.ip]\nalgorithm = \"token_bucket\"\ncapacity = 5\nrefill_per_sec = 1\n";
    let with_ip = policy(ip);
    let TokenCost::Ip(check) = token_cost(&with_ip, &view("192.0.2.7")) else {
        panic!("an address under the ip tier pays it");
    };
    let plan = classify(&with_ip, &view("192.0.2.7")).expect("admitted");
    assert_eq!(plan.checks.len(), 1);
    assert_eq!(check.key, plan.checks[0].key, "the bucket classify charges");
    assert_eq!(check.tier, Tier::Ip);
    assert_eq!(token_cost(&with_ip, &view("10.0.0.1")), TokenCost::Free);
    assert_eq!(token_cost(&with_ip, &view("10.0.0.2")), TokenCost::Refused);
    let without = policy("");
    assert_eq!(token_cost(&without, &view("192.0.2.7")), TokenCost::Free);
    assert_eq!(token_cost(&without, &view("10.0.0.2")), TokenCost::Refused);
}
