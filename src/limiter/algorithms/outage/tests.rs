//! The outage rules' tests: seeds from the shared bucket's answers, debts
//! recorded, merged and charged on failback, for every algorithm.

use super::*;
use crate::limiter::algorithms::{check, commit};

const T0: Micros = 1_700_000_000_000_000;

/// A bucket empty when Redis failed, spent on the fallback (each share
/// seeded with its TAT), charged once half-way (admissions after it open
/// a new debt, as stragglers after the ledger is taken do) and again at
/// the end, with the shared key expiring in Redis whenever its TAT has
/// passed. Against the exact replay of this replica's admissions onto
/// the shared bucket: one replica is charged exactly, N never more.
#[test]
fn a_debt_starts_where_the_seeded_share_stood() {
    let shared = Algorithm::TokenBucket {
        capacity: 60,
        refill_per_sec: 30.0,
    };
    let t = 1e6 / 30.0;
    let seed = T0 as f64 + 59.0 * t; // empty: TAT = now + tau
    for replicas in [1u64, 2, 3, 5] {
        let local = Algorithm::TokenBucket {
            capacity: 60 / replicas,
            refill_per_sec: 30.0 / replicas as f64,
        };
        let mut share = Some(State::Gcra { tat: seed });
        let mut redis = Some(State::Gcra { tat: seed });
        let mut truth = seed;
        let mut debt: Option<Debt> = None;
        let mut admitted = 0u64;
        // One request every 3 ms for 4 s on this replica's share.
        for k in 1..=1333 {
            let now = T0 + k * 3_000;
            let e = check(&local, share.as_ref(), now, 1);
            if e.decision.allowed {
                commit(&mut share, &e.update);
                admitted += 1;
                truth = truth.max(now as f64) + t;
                match debt {
                    None => debt = open(&shared, &local, &e.decision, now, 1),
                    Some(_) => record(&shared, &mut debt, now, 1),
                }
            }
            if k % 666 == 0 {
                // Redis lets the key expire once its TAT has passed.
                if matches!(redis, Some(State::Gcra { tat }) if tat <= now as f64) {
                    redis = None;
                }
                if let Some(owed) = debt.take() {
                    if let Some((after, _)) = charge(&shared, redis.as_ref(), &owed, now) {
                        redis = Some(after);
                    }
                }
                let charged = match redis {
                    Some(State::Gcra { tat }) => tat,
                    _ => now as f64,
                };
                let owed = truth.max(now as f64);
                assert!(
                    charged <= owed + 1.0,
                    "{replicas} replica(s), {admitted} admitted: charged {charged} > replay {owed} at t0+{}",
                    now - T0
                );
                if replicas == 1 {
                    assert!(
                        charged >= owed - 1.0,
                        "1 replica, {admitted} admitted: charged {charged} < replay {owed} at t0+{}",
                        now - T0
                    );
                }
            }
        }
        assert!(admitted > 60 / replicas, "{replicas}: {admitted}");
    }
}

/// Replaying admissions one by one onto a shared bucket equals one charge.
#[test]
fn gcra_debt_charges_what_a_replay_would() {
    let alg = Algorithm::TokenBucket {
        capacity: 10,
        refill_per_sec: 4.0,
    };
    let t = 250_000.0;
    // A TAT still ahead at the charge, and none (a full bucket).
    for start in [None, Some(T0 as f64 + 3_000_000.0)] {
        let times = [T0, T0 + 10, T0 + 400_000, T0 + 2_000_000, T0 + 2_000_001];
        let mut debt = None;
        let mut replay = start.unwrap_or(f64::MIN);
        for &at in &times {
            record(&alg, &mut debt, at, 1);
            replay = replay.max(at as f64) + t;
        }
        let now = T0 + 2_000_002;
        let state = start.map(|tat| State::Gcra { tat });
        let got = charge(&alg, state.as_ref(), debt.as_ref().unwrap(), now);
        assert_eq!(
            got.map(|(s, _)| s),
            Some(State::Gcra { tat: replay }),
            "start {start:?}, now {now}"
        );
    }
}

/// A seeded local share admits no more than the shared bucket had left,
/// scaled to the share.
#[test]
fn seeds_leave_the_share_of_what_was_left() {
    let shared = Algorithm::TokenBucket {
        capacity: 30,
        refill_per_sec: 0.001,
    };
    let local = Algorithm::TokenBucket {
        capacity: 10,
        refill_per_sec: 0.001 / 3.0,
    };
    // The shared bucket: 27 spent, 3 left.
    let mut s = None;
    let mut last = None;
    for i in 0..27 {
        let e = check(&shared, s.as_ref(), T0 + i, 1);
        commit(&mut s, &e.update);
        last = Some(e.decision);
    }
    let (seeded, _) = seed(&shared, &local, &last.unwrap(), T0 + 27).unwrap();
    let mut local_state = Some(seeded);
    let mut admitted = 0;
    for i in 0..10 {
        let e = check(&local, local_state.as_ref(), T0 + 28 + i, 1);
        if e.decision.allowed {
            admitted += 1;
            commit(&mut local_state, &e.update);
        }
    }
    assert_eq!(admitted, 1, "3 left of 30 is 1 left of a share of 10");
}

/// The same for windows and logs: 27 of 30 spent leaves 1 of a share of 10.
#[test]
fn window_seeds_leave_the_share_of_what_was_left() {
    for (shared, local) in [
        (
            Algorithm::FixedWindow {
                limit: 30,
                window_secs: 60,
            },
            Algorithm::FixedWindow {
                limit: 10,
                window_secs: 60,
            },
        ),
        (
            Algorithm::SlidingWindow {
                limit: 30,
                window_secs: 60,
            },
            Algorithm::SlidingWindow {
                limit: 10,
                window_secs: 60,
            },
        ),
        (
            Algorithm::SlidingLog {
                limit: 30,
                window_secs: 60,
            },
            Algorithm::SlidingLog {
                limit: 10,
                window_secs: 60,
            },
        ),
    ] {
        let mut s = None;
        let mut last = None;
        for i in 0..27 {
            let e = check(&shared, s.as_ref(), T0 + i, 1);
            commit(&mut s, &e.update);
            last = Some(e.decision);
        }
        let (seeded, _) = seed(&shared, &local, &last.unwrap(), T0 + 27).unwrap();
        let mut local_state = Some(seeded);
        let admitted = (0..10)
            .filter(|i| {
                let e = check(&local, local_state.as_ref(), T0 + 28 + i, 1);
                if e.decision.allowed {
                    commit(&mut local_state, &e.update);
                }
                e.decision.allowed
            })
            .count();
        assert_eq!(admitted, 1, "{shared:?}");
    }
}

/// A debt put back after a failed charge and merged with what came after
/// charges what one debt of all those admissions would.
#[test]
fn merged_debts_charge_as_one() {
    let algs = [
        Algorithm::TokenBucket {
            capacity: 10,
            refill_per_sec: 4.0,
        },
        Algorithm::FixedWindow {
            limit: 50,
            window_secs: 1,
        },
        Algorithm::SlidingWindow {
            limit: 50,
            window_secs: 1,
        },
        Algorithm::SlidingLog {
            limit: 50,
            window_secs: 1,
        },
    ];
    let times: Vec<Micros> = (0..12).map(|i| T0 + i * 150_000).collect();
    for alg in algs {
        for split in 1..times.len() {
            let (mut whole, mut a, mut b) = (None, None, None);
            for (i, &t) in times.iter().enumerate() {
                record(&alg, &mut whole, t, 1);
                record(&alg, if i < split { &mut a } else { &mut b }, t, 1);
            }
            let merged = merge(&alg, a.unwrap(), b.unwrap());
            let now = times[times.len() - 1] + 1;
            let state = None;
            assert_eq!(
                charge(&alg, state.as_ref(), &merged, now),
                charge(&alg, state.as_ref(), whole.as_ref().unwrap(), now),
                "{alg:?} split at {split}"
            );
        }
    }
}

#[test]
fn window_debts_count_only_in_their_window() {
    let alg = Algorithm::FixedWindow {
        limit: 10,
        window_secs: 1,
    };
    let mut debt = None;
    record(&alg, &mut debt, T0 + 100, 1);
    record(&alg, &mut debt, T0 + 200, 1);
    let d = debt.unwrap();
    let state = State::Window {
        window: T0 / 1_000_000,
        count: 3,
    };
    assert_eq!(
        charge(&alg, Some(&state), &d, T0 + 300).map(|(s, _)| s),
        Some(State::Window {
            window: T0 / 1_000_000,
            count: 5
        })
    );
    assert_eq!(charge(&alg, Some(&state), &d, T0 + 1_000_000), None);
}

/// A quota admitted on the fallback owes its own period: charged back to
/// that period's count (while it is kept), never to the next one.
#[test]
fn an_unrecorded_admission_is_not_charged() {
    let algs = [
        Algorithm::TokenBucket {
            capacity: 10,
            refill_per_sec: 1.0,
        },
        Algorithm::FixedWindow {
            limit: 10,
            window_secs: 60,
        },
        Algorithm::SlidingWindow {
            limit: 10,
            window_secs: 60,
        },
        Algorithm::SlidingLog {
            limit: 10,
            window_secs: 60,
        },
    ];
    for alg in algs {
        let (mut a, mut b) = (None, None);
        record(&alg, &mut a, T0, 1);
        record(&alg, &mut b, T0, 1);
        record(&alg, &mut a, T0 + 5, 2);
        unrecord(&alg, &mut a, T0 + 5, 2);
        match (a.unwrap(), b.unwrap()) {
            (Debt::Gcra { count: ca, tat: ta }, Debt::Gcra { count: cb, tat: tb }) => {
                assert_eq!(ca, cb);
                assert!((ta - tb).abs() < 1e-6, "{ta} {tb}");
            }
            (x, y) => assert_eq!(format!("{x:?}"), format!("{y:?}"), "{alg:?}"),
        }
    }
}

#[test]
fn quota_debts_count_in_their_own_period() {
    let (start, end) = (T0, T0 + 86_400_000_000);
    let alg = Algorithm::Calendar {
        limit: 10,
        period: crate::calendar::Period::Day,
        start,
        end,
    };
    let mut debt = None;
    record(&alg, &mut debt, T0 + 100, 1);
    record(&alg, &mut debt, T0 + 200, 2);
    let d = debt.unwrap();
    let state = State::Window {
        window: end,
        count: 4,
    };
    assert_eq!(
        charge(&alg, Some(&state), &d, T0 + 300).map(|(s, _)| s),
        Some(State::Window {
            window: end,
            count: 7
        })
    );
    // Charged after the period's count has gone: nothing to add to.
    assert_eq!(
        charge(
            &alg,
            Some(&state),
            &d,
            end + 2 * super::super::calendar::GRACE_US as i64
        ),
        None
    );
    // The next period's bucket owes nothing of this one.
    let next = Algorithm::Calendar {
        limit: 10,
        period: crate::calendar::Period::Day,
        start: end,
        end: end + 86_400_000_000,
    };
    assert_eq!(charge(&next, None, &d, end + 1), None);
}
