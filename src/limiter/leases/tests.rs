//! The leases' unit tests: spending, renewal, returns, failed calls and
//! quota reports, and the table's bound, on hand-made grants.

use std::time::{Duration, Instant};

use super::*;
use crate::config::Algorithm;
use crate::limiter::algorithms::lease::Grant;
use crate::limiter::{Tier, Verdict};

fn check(key: &str, cost: u64) -> Check {
    Check {
        tier: Tier::Key,
        key: key.into(),
        algorithm: Algorithm::TokenBucket {
            capacity: 1000,
            refill_per_sec: 100.0,
        },
        shadow: false,
        cost,
        shards: 1,
        pool: false,
        charged: false,
        most: 0,
    }
}

fn grant(l: &Leases, checks: &[Check], tokens: u64, sent: Instant) -> Asks {
    let refs: Vec<&[Check]> = vec![checks];
    let asks = l.asks(&refs, sent);
    let grants: Vec<Grant> = asks
        .asks
        .iter()
        .map(|_| Grant {
            tokens,
            until: 0,
            taken_back: 0,
            told: false,
        })
        .collect();
    l.granted(&asks, &grants, sent, 0);
    asks
}

#[test]
fn an_empty_lease_asks_redis_and_a_one_off_client_gets_none() {
    let l = Leases::new(Duration::from_millis(100), 1000);
    let now = Instant::now();
    let c = [check("a", 1)];
    assert!(!l.spend(&c, now).any());
    // One request of demand: not worth a lease.
    assert!(grant(&l, &c, 10, now).is_empty());
    assert!(!l.spend(&c, now).any());
}

#[test]
fn a_hot_bucket_is_spent_locally_until_its_lease_is_short() {
    let l = Leases::new(Duration::from_millis(100), 1000);
    let now = Instant::now();
    let c = [check("a", 1)];
    for _ in 0..10 {
        assert!(!l.spend(&c, now).any());
    }
    let asks = grant(&l, &c, 6, now);
    assert_eq!(asks.asks.len(), 1);
    // Ten requests within a tenth of a period: a hundred a period.
    assert_eq!(asks.asks[0].want, 100);
    let mut local = 0;
    while l.spend(&c, now).all() {
        local += 1;
    }
    assert_eq!(local, 6, "exactly the lease");
    // The lease expires: what is left of it is never spent, and goes
    // back with the next call.
    let _ = grant(&l, &c, 3, now);
    assert_eq!(l.outstanding("a", now).map(|o| o.0), Some(3));
    let later = now + Duration::from_millis(150);
    assert!(!l.spend(&c, later).any(), "an expired lease spends nothing");
    assert_eq!(l.outstanding("a", later), None);
    let asks = l.asks(&[&c[..]], later);
    assert_eq!(asks.asks[0].ret, 3);
}

#[test]
fn a_lease_is_renewed_once_it_holds_a_quarter_of_the_demand() {
    let l = Leases::new(Duration::from_millis(100), 1000);
    let now = Instant::now();
    let c = [check("a", 1)];
    for _ in 0..10 {
        assert!(!l.spend(&c, now).any());
    }
    let _ = grant(&l, &c, 100, now);
    // Each request spends a token and adds to the demand (ten a
    // hundredth of a period is a thousand a period): after k requests
    // the lease holds 100 - k of a demand of 10 * (10 + k). A quarter of
    // it is first reached at k = 22.
    let mut first_renewal = None;
    for k in 1..=60u64 {
        let t = l.spend(&c, now);
        assert!(t.all(), "request {k} is covered by the lease");
        if t.renew && first_renewal.is_none() {
            first_renewal = Some(k);
        }
    }
    assert_eq!(first_renewal, Some(22));
    // Queued once: the next call carries the top-up to the demand.
    let asks = l.asks(&[], now);
    assert_eq!(asks.asks.len(), 1);
    assert_eq!(asks.asks[0].want, 10 * 70 - 40);
}

#[test]
fn a_bucket_seen_now_and_then_or_gone_quiet_asks_for_no_lease() {
    let l = Leases::new(Duration::from_millis(100), 1000);
    let t0 = Instant::now();
    let c = [check("a", 1)];
    // Three requests a second apart: never hot.
    for i in 0..3 {
        let now = t0 + Duration::from_secs(i);
        assert!(!l.spend(&c, now).any());
        assert!(l.asks(&[&c[..]], now).is_empty(), "request {i}");
    }
    // Four within a period: hot.
    let now = t0 + Duration::from_secs(3);
    for _ in 0..4 {
        assert!(!l.spend(&c, now).any());
    }
    let _ = grant(&l, &c, 5, now);
    assert_eq!(l.outstanding("a", now).map(|o| o.0), Some(5));
    // Then quiet for two periods: its expired lease goes back, and no
    // new one is asked for on the strength of the old demand.
    let later = now + Duration::from_millis(250);
    assert!(l.due(later), "the sweeper finds the expired lease");
    let asks = l.asks(&[], later);
    assert_eq!(asks.asks.len(), 1);
    assert_eq!((asks.asks[0].ret, asks.asks[0].want), (5, 0));
}

#[test]
fn a_request_short_on_one_tier_takes_the_others_and_can_give_them_back() {
    let l = Leases::new(Duration::from_millis(100), 1000);
    let now = Instant::now();
    let both = [check("a", 1), check("b", 2)];
    for _ in 0..10 {
        let t = l.spend(&both, now);
        l.give_back(&both, &t);
    }
    let _ = grant(&l, &both[..1], 5, now);
    let _ = grant(&l, &both[1..], 3, now);
    assert!(l.spend(&both, now).all());
    // b holds 1, the request needs 2: a covers its tier, b goes to Redis.
    let t = l.spend(&both, now);
    assert!(t.any() && !t.all());
    assert_eq!(l.outstanding("a", now).unwrap().0, 3);
    // Redis refused it: a's token goes back.
    l.give_back(&both, &t);
    assert_eq!(l.outstanding("a", now).unwrap().0, 4);
    assert_eq!(l.outstanding("b", now).unwrap().0, 1);
}

#[test]
fn a_grant_is_taken_out_of_what_its_call_reported() {
    let c = check("a", 1);
    let d = Decision {
        allowed: true,
        limit: 1000,
        remaining: 50,
        retry_after_us: 0,
        reset_after_us: 9_500_000,
        delay_us: 0,
    };
    let mut verdicts = vec![Verdict {
        decisions: vec![d],
        now_us: 0,
    }];
    let asks = Asks {
        asks: vec![Ask {
            check: c.clone(),
            want: 10,
            ret: 0,
            until: 0,
            spent: 0,
            report: 0,
        }],
        replicas: 1,
        min: MIN_GRANT,
        ..Asks::default()
    };
    let grant = Grant {
        tokens: 10,
        until: 0,
        taken_back: 0,
        told: false,
    };
    debit(&[&[c][..]], &mut verdicts, &asks, &[grant]);
    // 10 tokens at 100/s: 100 ms more to refill.
    assert_eq!(verdicts[0].decisions[0].remaining, 40);
    assert_eq!(verdicts[0].decisions[0].reset_after_us, 9_600_000);
}

/// Redis's answer to `asks`: every return taken back, `tokens` granted
/// to the first ask that wants some.
fn answer(l: &Leases, asks: &Asks, tokens: u64, sent: Instant) {
    let grants: Vec<Grant> = asks
        .asks
        .iter()
        .map(|a| Grant {
            tokens: if a.want > 0 { tokens } else { 0 },
            until: 0,
            taken_back: a.ret,
            told: false,
        })
        .collect();
    l.granted(asks, &grants, sent, 0);
}

/// A hot bucket "a" (ten requests of demand) holding a lease of `tokens`.
fn hot(tokens: u64) -> (Leases, Instant, [Check; 1]) {
    let l = Leases::new(Duration::from_millis(100), 1000);
    let now = Instant::now();
    let c = [check("a", 1)];
    for _ in 0..10 {
        l.spend(&c, now);
    }
    let _ = grant(&l, &c, tokens, now);
    (l, now, c)
}

#[test]
fn tokens_given_back_after_their_lease_ended_are_owed_not_lost() {
    let (l, now, c) = hot(5);
    // A request takes a token, then waits for Redis on another tier...
    let t = l.spend(&c, now);
    assert!(t.all());
    // ...while the lease expires and a new one replaces it.
    let later = now + Duration::from_millis(120);
    for _ in 0..10 {
        l.spend(&c, later);
    }
    let asks = l.asks(&[&c[..]], later);
    assert_eq!(asks.asks[0].ret, 4, "the expired lease's unspent tokens");
    answer(&l, &asks, 6, later);
    // Refused: its token belongs to the ended lease, and is owed.
    l.give_back(&c, &t);
    assert_eq!(l.outstanding("a", later).map(|o| o.0), Some(6));
    assert!(l.owing());
    let asks = l.asks(&[], later);
    assert_eq!(asks.asks.len(), 1);
    assert_eq!(asks.asks[0].ret, 1);
    answer(&l, &asks, 0, later);
    // granted 11 = returned 5 + held 6: nothing vanished.
    assert_eq!(l.held(), 6);
}

#[test]
fn a_release_owes_every_lease_and_a_stop_spends_none_after_it() {
    let l = Leases::new(Duration::from_millis(100), 1000);
    let now = Instant::now();
    let (a, b) = ([check("a", 1)], [check("b", 2)]);
    for _ in 0..10 {
        l.spend(&a, now);
        l.spend(&b, now);
    }
    let _ = grant(&l, &a, 5, now);
    let _ = grant(&l, &b, 8, now);
    assert!(l.spend(&a, now).all());
    l.confirm(&a, &l.spend(&a, now));
    assert_eq!(l.held(), 13 - 1, "one spent, one taken and undecided");
    assert!(l.release(true));
    assert!(!l.spend(&a, now).any(), "nothing is spent after a stop");
    let asks = l.asks(&[&a[..], &b[..]], now);
    let mut rets: Vec<(u64, u64)> = asks.asks.iter().map(|x| (x.ret, x.want)).collect();
    rets.sort();
    assert_eq!(rets, vec![(3, 0), (8, 0)], "returns only, no new lease");
    answer(&l, &asks, 0, now);
    // The request still being decided holds its token until it is.
    assert_eq!(l.held(), 1);
    assert!(!l.owing());
}

#[test]
fn a_return_whose_call_cannot_have_run_is_owed_again() {
    let (l, now, _) = hot(5);
    let later = now + Duration::from_millis(150);
    assert!(l.due(later));
    let asks = l.asks(&[], later);
    l.failed(&asks, false);
    assert!(l.owing(), "never sent: owed again");
    let asks = l.asks(&[], later);
    assert_eq!(asks.asks[0].ret, 5);
    l.failed(&asks, true);
    assert!(!l.owing(), "may have run: never sent twice");
    assert_eq!(l.held(), 0, "counted lost");
}

#[test]
fn a_quota_report_whose_call_failed_is_told_again_with_its_number() {
    let l = Leases::new(Duration::from_millis(100), 1000);
    let now = Instant::now();
    let q = [Check {
        algorithm: Algorithm::Calendar {
            limit: 1000,
            period: crate::calendar::Period::Month,
            start: 0,
            end: i64::MAX / 2,
        },
        ..check("q", 1)
    }];
    for _ in 0..10 {
        l.spend(&q, now);
    }
    let _ = grant(&l, &q, 20, now);
    let spend = |n| {
        for _ in 0..n {
            let t = l.spend(&q, now);
            assert!(t.all());
            l.confirm(&q, &t);
        }
    };
    spend(3);
    let first = l.returns(now);
    assert_eq!(first.asks.len(), 1);
    let (report, spent) = (first.asks[0].report, first.asks[0].spent);
    assert!(report > 0 && spent == 3, "{first:?}");
    // While that call is out, new spending waits for it.
    spend(2);
    assert!(
        l.returns(now).is_empty(),
        "one call with reports out at a time"
    );
    // It failed, after it may have run: told again first, same number,
    // then the spending since under a new one.
    l.failed(&first, true);
    let again = l.returns(now);
    let told: Vec<(u64, u64)> = again.asks.iter().map(|a| (a.report, a.spent)).collect();
    assert_eq!(told.len(), 2, "{told:?}");
    assert_eq!(told[0], (report, 3));
    assert!(told[1].0 > report && told[1].1 == 2, "{told:?}");
    // Answered (the first counted before): nothing more to tell.
    let grants: Vec<Grant> = again
        .asks
        .iter()
        .enumerate()
        .map(|(i, _)| Grant {
            told: i == 0,
            ..Grant::default()
        })
        .collect();
    l.granted(&again, &grants, now, 0);
    assert!(l.returns(now).is_empty());
    assert_eq!(l.held(), 15, "20 granted, 5 spent");
}

#[test]
fn the_table_is_bounded() {
    let l = Leases::new(Duration::from_millis(100), 32);
    let now = Instant::now();
    for i in 0..1000 {
        l.spend(&[check(&format!("k{i}"), 1)], now);
    }
    assert!(l.len() <= 32, "{}", l.len());
}

/// A charged counting window "w" (a minute of 1,000) that ten requests
/// made hot, holding a lease of `tokens` counted in window 0 (`grant`'s).
fn hot_window(tokens: u64, cost: u64) -> (Leases, Instant, [Check; 1]) {
    let l = Leases::new(Duration::from_millis(100), 1000);
    let now = Instant::now();
    let c = [Check {
        algorithm: Algorithm::FixedWindow {
            limit: 1000,
            window_secs: 60,
        },
        charged: true,
        ..check("w", cost)
    }];
    for _ in 0..10 {
        l.spend(&c, now);
    }
    let _ = grant(&l, &c, tokens, now);
    (l, now, c)
}

#[test]
fn a_token_bucket_counting_charged_units_is_never_leased() {
    let l = Leases::new(Duration::from_millis(100), 1000);
    let now = Instant::now();
    let c = [Check {
        charged: true,
        ..check("a", 10)
    }];
    for _ in 0..10 {
        assert!(!l.spend(&c, now).any());
    }
    assert!(l.asks(&[&c[..]], now).is_empty(), "no lease asked for");
}

#[test]
fn a_charged_refund_goes_back_to_its_lease_and_a_debt_is_spent_from_it() {
    let (l, now, c) = hot_window(40, 10);
    let t = l.spend(&c, now);
    assert!(t.all());
    l.confirm(&c, &t);
    let mark = t.marks(&c)[0].expect("spent from a lease");
    // The answer said 3 of the 10: 7 back to the lease.
    assert_eq!(l.settle_on(&c[0], mark, -7, now), 0);
    assert_eq!(l.outstanding("w", now).map(|o| o.0), Some(37));
    // Others said more: debts spent from the lease while it holds them,
    // the rest left to the caller (owed to Redis).
    assert_eq!(l.settle_on(&c[0], mark, 5, now), 0);
    assert_eq!(l.settle_on(&c[0], mark, 40, now), 8);
    assert_eq!(l.outstanding("w", now), None);
    // granted 40 + refunded 7 = spent 10 + 5 + 32: nothing held.
    assert_eq!(l.held(), 0);
}

#[test]
fn a_refund_after_its_lease_ended_is_owed_with_that_lease() {
    let (l, now, c) = hot_window(20, 10);
    let t = l.spend(&c, now);
    l.confirm(&c, &t);
    let mark = t.marks(&c)[0].unwrap();
    let later = now + Duration::from_millis(120);
    assert!(l.due(later), "the lease expired with 10 unspent");
    assert_eq!(l.settle_on(&c[0], mark, -6, later), 0);
    let asks = l.asks(&[], later);
    assert_eq!(
        (asks.asks[0].ret, asks.asks[0].until),
        (16, 0),
        "its 10 and the refund's 6, one return to its window"
    );
    answer(&l, &asks, 0, later);
    assert_eq!(l.held(), 0);
}

#[test]
fn a_refund_of_a_call_joins_a_lease_of_its_window() {
    let (l, now, c) = hot_window(5, 1);
    // A request a call decided in window 0 (Redis's time 1 µs): its
    // refund joins the lease; one of another window goes to Redis.
    assert!(l.credit(&c[0], 6, 1, now));
    assert_eq!(l.outstanding("w", now).map(|o| o.0), Some(11));
    assert!(!l.credit(&c[0], 6, 60_000_000, now));
    // No lease, an expired one, a token bucket, or a quota: to Redis.
    let other = Check {
        key: "v".into(),
        ..c[0].clone()
    };
    assert!(!l.credit(&other, 6, 1, now));
    assert!(!l.credit(&c[0], 6, 1, now + Duration::from_millis(120)));
    assert!(!l.credit(&check("a", 1), 6, 1, now));
    let quota = Check {
        algorithm: Algorithm::Calendar {
            limit: 100,
            period: crate::calendar::Period::Hour,
            start: 0,
            end: 3_600_000_000,
        },
        ..c[0].clone()
    };
    assert!(!l.credit(&quota, 6, 1, now));
    assert_eq!(l.held(), 11);
}
