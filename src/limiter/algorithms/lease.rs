//! Leases as pure functions: what `limiter.lua` does with a replica's
//! lease requests, operation for operation (the conformance suite holds the
//! script to this model).
//!
//! A lease is tokens debited from the shared bucket exactly as a request of
//! that cost would be, so a replica only ever spends what Redis has already
//! taken. Its size is the smaller of what the replica asked for (its recent
//! demand) and a fair share of what the bucket holds (`available / replicas`);
//! a share under `min` grants nothing, so a bucket's last tokens are decided
//! one request at a time.
//!
//! Unspent tokens of an expired lease come back only where that is exact:
//! the bucket must end as if they had never been taken. Capping a return
//! at a full bucket is not enough (a bucket that refilled while the lease
//! was out, then was partly spent, would get the lease back on top of that).
//! So each grant carries `until`: for a window, the window its tokens count
//! in (a quota: its period's end; taken back only there, and only from a count that holds them); for a
//! token bucket, the floor of the TAT the bucket would have had without the
//! grant. Until that instant no request can have found that bucket full, so
//! the tokens come back exactly (the TAT moves back by them, never before
//! `until`: those that would move it further are lost); after it the return
//! is refused and the tokens are lost, which under-admits by them and never
//! over-admits.

use crate::config::Algorithm;

use super::{check, commit, Micros, State};

/// Whether an algorithm's buckets can be leased: the token bucket, the
/// two counting windows and a quota's period (a count, like a fixed
/// window's). A leaky bucket shapes each request to its own slot, and a
/// sliding log records each request's time: neither can be spent ahead by
/// count.
pub fn leasable(alg: &Algorithm) -> bool {
    matches!(
        alg,
        Algorithm::TokenBucket { .. }
            | Algorithm::FixedWindow { .. }
            | Algorithm::SlidingWindow { .. }
            | Algorithm::Calendar { .. }
    )
}

/// Takes back `ret` unspent tokens of a lease whose grant answered
/// `until`, where that is exact; returns how many were taken back and the
/// state's new time to live.
pub fn give_back(
    alg: &Algorithm,
    state: &mut Option<State>,
    now: Micros,
    ret: u64,
    until: i64,
) -> (u64, Option<u64>) {
    let Some(s) = state.as_mut() else {
        return (0, None);
    };
    if ret == 0 {
        return (0, None);
    }
    let now_f = now as f64;
    match (alg, s) {
        (Algorithm::TokenBucket { refill_per_sec, .. }, State::Gcra { tat }) => {
            // As many as lie above the floor: a refund or another lease's
            // return that moved the TAT under it costs this return only
            // what it moved, not the whole return.
            let t = 1e6 / refill_per_sec;
            let n = (ret as f64).min(((*tat - until as f64) / t).floor());
            if now <= until && n >= 1.0 {
                *tat -= n * t;
                return (n as u64, Some(super::ceil_us(*tat - now_f)));
            }
        }
        (Algorithm::FixedWindow { window_secs, .. }, State::Window { window, count })
            if *window == until && *count >= ret =>
        {
            let w = *window_secs as i64 * 1_000_000;
            *count -= ret;
            return (ret, Some(((*window + 1) * w - now).max(0) as u64));
        }
        (Algorithm::Calendar { end, .. }, State::Window { window, count })
            if *window == until && *count >= ret =>
        {
            *count -= ret;
            return (
                ret,
                Some((*end - now).max(0) as u64 + super::calendar::GRACE_US),
            );
        }
        (Algorithm::SlidingWindow { window_secs, .. }, State::Sliding { window, cur, .. })
            if *window == until && *cur >= ret =>
        {
            let w = *window_secs as f64 * 1e6;
            *cur -= ret;
            return (
                ret,
                Some(super::ceil_us(*window as f64 * w + 2.0 * w - now_f)),
            );
        }
        _ => {}
    }
    (0, None)
}

/// What the bucket holds at `now`: the most one request could take.
pub fn available(alg: &Algorithm, state: Option<&State>, now: Micros) -> u64 {
    let now_f = now as f64;
    let avail = match (*alg, state) {
        (
            Algorithm::TokenBucket {
                capacity,
                refill_per_sec,
            },
            s,
        ) => {
            let t = 1e6 / refill_per_sec;
            let tau = t * (capacity as f64 - 1.0);
            let tat = match s {
                Some(State::Gcra { tat }) if *tat > now_f => *tat,
                _ => now_f,
            };
            (((now_f + tau - tat) / t).floor() + 1.0).min(capacity as f64)
        }
        (Algorithm::FixedWindow { limit, window_secs }, s) => {
            let w = window_secs as i64 * 1_000_000;
            let n = window_of(now, w, s);
            match s {
                Some(State::Window { window, count }) if *window == n => {
                    limit as f64 - *count as f64
                }
                _ => limit as f64,
            }
        }
        (Algorithm::Calendar { limit, end, .. }, s) => match s {
            Some(State::Window { window, count }) if *window == end => limit as f64 - *count as f64,
            _ => limit as f64,
        },
        (Algorithm::SlidingWindow { limit, window_secs }, s) => {
            let w = window_secs as i64 * 1_000_000;
            let n = window_of(now, w, s);
            let (prev, cur) = match s {
                Some(State::Sliding { window, prev, cur }) if *window == n => (*prev, *cur),
                Some(State::Sliding { window, cur, .. }) if *window == n - 1 => (*cur, 0),
                _ => (0, 0),
            };
            let (wf, nf) = (w as f64, n as f64);
            (limit as f64 - cur as f64 - prev as f64 * (nf * wf + wf - now_f) / wf).floor()
        }
        _ => 0.0,
    };
    if avail > 0.0 {
        avail as u64
    } else {
        0
    }
}

/// The window `now` falls in for a window bucket's state.
fn window_of(now: Micros, w: i64, s: Option<&State>) -> i64 {
    let stored = match s {
        Some(State::Window { window, .. }) | Some(State::Sliding { window, .. }) => Some(*window),
        _ => None,
    };
    super::window_index(now, w, stored)
}

/// A quota's lease ledger, per holder (a replica's random id): tokens
/// granted to it and neither reported spent nor given back, and when Redis
/// takes them back itself. A holder that dies stops reporting; once its
/// time is up what it held goes back to the count (`reclaim`). A return is
/// taken back only up to what the holder holds, so never twice.
/// A holder numbers its reports (spending and returns): one told again
/// because its answer was lost counts once (`told_before`).
pub type Ledger = std::collections::BTreeMap<String, Held>;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Held {
    pub out: u64,
    pub reclaim_at: Micros,
    /// The holder's latest report counted (0: none), remembered until
    /// `forget_at` whether or not it still holds tokens, so a report told
    /// again after its holding was reclaimed still counts once.
    pub told: u64,
    pub forget_at: Micros,
}

/// How long after a holder's last grant or report's hold its last report
/// number is remembered: a replica cut off for longer that tells a report
/// again (its answer was lost) has it counted again.
pub const TOLD_KEEP_US: Micros = 86_400_000_000;

/// Whether a call reads a quota's ledger (and so reclaims what is due): it
/// leases the bucket, or its requests there (`cost` in all) might find it
/// short. Elsewhere a reclaim could change no decision, and waits.
pub fn reads_ledger(alg: &Algorithm, state: Option<&State>, cost: u64, leased: bool) -> bool {
    let Algorithm::Calendar { limit, end, .. } = *alg else {
        return false;
    };
    leased
        || (cost > 0
            && matches!(state, Some(State::Window { window, count })
                if *window == end && count + cost > limit))
}

/// Gives the holdings whose time is up back to the count (never below
/// zero); returns the tokens given back. The caller's own holding
/// (`caller`: the holder making the call) is not among them: a holder
/// that calls is alive and reports what it spent, and taking its holding
/// back first would let the call's own requests be admitted against
/// tokens it already spent (a replica back from a silent outage, its
/// reports still on their way, admitted one over its quota so).
pub fn reclaim(
    alg: &Algorithm,
    ledger: &mut Ledger,
    state: &mut Option<State>,
    now: Micros,
    caller: Option<&str>,
) -> u64 {
    let Algorithm::Calendar { end, .. } = *alg else {
        return 0;
    };
    let mut back = 0;
    ledger.retain(|holder, h| {
        if h.out > 0 && h.reclaim_at <= now && caller != Some(holder.as_str()) {
            if let Some(State::Window { window, count }) = state {
                if *window == end {
                    let b = h.out.min(*count);
                    *count -= b;
                    back += b;
                }
            }
            h.out = 0;
        }
        if h.forget_at <= now {
            h.told = 0;
        }
        h.out > 0 || h.told > 0
    });
    back
}

/// A ledger as Redis holds it: field `<holder>` = "out reclaim_at", and
/// `<holder>.t` = "told:forget_at" (a field that does not read so is left
/// out, as `limiter.lua` does).
pub fn parse_ledger(fields: Vec<(String, String)>) -> Ledger {
    let mut ledger = Ledger::new();
    let holder_ok = |h: &&str| {
        !h.is_empty()
            && h.bytes()
                .all(|b| b.is_ascii_digit() || b.is_ascii_lowercase())
    };
    for (field, v) in fields {
        if let Some(holder) = field.strip_suffix(".t").filter(holder_ok) {
            let Some((t, at)) = v.split_once(':') else {
                continue;
            };
            let (Ok(told), Ok(forget_at)) = (t.parse(), at.parse()) else {
                continue;
            };
            let h = ledger.entry(holder.to_string()).or_default();
            (h.told, h.forget_at) = (told, forget_at);
        } else {
            let Some((out, at)) = v.split_once(' ') else {
                continue;
            };
            let (Ok(out), Ok(reclaim_at)) = (out.parse(), at.parse()) else {
                continue;
            };
            let h = ledger.entry(field).or_default();
            (h.out, h.reclaim_at) = (out, reclaim_at);
        }
    }
    ledger
}

/// Whether a holder's report numbered `report` was counted before: its
/// call ran and the answer was lost, so the holder tells it again, and
/// its spending and returns are not counted twice. 0: not numbered.
pub fn told_before(ledger: &Ledger, holder: &str, report: u64) -> bool {
    report > 0 && ledger.get(holder).is_some_and(|h| h.told >= report)
}

/// Books a report as counted (a holding with nothing out is made for it).
/// A holder never has two calls carrying reports of one bucket out at once
/// (`Leases`), so its reports arrive in their order.
pub fn mark_told(ledger: &mut Ledger, holder: &str, report: u64, now: Micros, hold: u64) {
    if report == 0 {
        return;
    }
    let h = ledger.entry(holder.to_string()).or_default();
    h.told = h.told.max(report);
    h.forget_at = now + hold as Micros + TOLD_KEEP_US;
}

/// What a ledger gives back at `now` (holdings whose time is up).
pub fn due(ledger: &Ledger, now: Micros) -> u64 {
    ledger
        .values()
        .filter(|h| h.reclaim_at <= now)
        .map(|h| h.out)
        .sum()
}

/// A holder says it spent `spent` of its leased tokens. Beyond what it
/// holds, the report is late (Redis took those tokens back while the holder
/// was cut off): they are charged to the count again.
pub fn report_spent(
    alg: &Algorithm,
    ledger: &mut Ledger,
    state: &mut Option<State>,
    holder: &str,
    spent: u64,
) {
    let Algorithm::Calendar { end, .. } = *alg else {
        return;
    };
    let mut late = spent;
    if let Some(h) = ledger.get_mut(holder) {
        let own = late.min(h.out);
        h.out -= own;
        late -= own;
    }
    if let Some(State::Window { window, count }) = state {
        if *window == end {
            *count += late;
        }
    }
}

/// A quota return bounded by what its holder holds (`give_back` then takes
/// back what is exact, and `settle_return` books it).
pub fn returnable(ledger: &Ledger, holder: &str, ret: u64) -> u64 {
    ledger.get(holder).map_or(0, |h| ret.min(h.out))
}

pub fn settle_return(ledger: &mut Ledger, holder: &str, back: u64) {
    if let Some(h) = ledger.get_mut(holder) {
        h.out -= back.min(h.out);
    }
}

/// A quota grant booked to its holder, reclaimed `hold` after now unless
/// spent or given back first.
pub fn hold(ledger: &mut Ledger, holder: &str, granted: u64, now: Micros, hold: u64) {
    if granted == 0 {
        return;
    }
    let h = ledger.entry(holder.to_string()).or_default();
    h.out += granted;
    h.reclaim_at = now + hold as Micros;
    if h.told > 0 {
        h.forget_at = now + hold as Micros + TOLD_KEEP_US;
    }
}

/// A lease granted to one replica: tokens taken, and what a return of
/// them must name (`give_back`): the window they count in, or for a token
/// bucket the floor of its TAT without the grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Grant {
    pub tokens: u64,
    pub until: i64,
    /// Tokens of the call's return taken back (reported with the grant).
    pub taken_back: u64,
    /// The ask's report was counted before (`told_before`): nothing of it
    /// was counted again.
    pub told: bool,
}

/// Grants a lease of up to `want` tokens, a `replicas`th of what is left at
/// most, nothing under `min`; the tokens are taken from `state`. Returns the
/// grant and the state's new time to live.
pub fn grant(
    alg: &Algorithm,
    state: &mut Option<State>,
    now: Micros,
    want: u64,
    replicas: u64,
    min: u64,
) -> (Grant, Option<u64>) {
    let g = (available(alg, state.as_ref(), now) / replicas.max(1)).min(want);
    if g < min.max(1) || !leasable(alg) {
        return (Grant::default(), None);
    }
    let e = check(alg, state.as_ref(), now, g);
    if !e.decision.allowed {
        return (Grant::default(), None);
    }
    let until = match state {
        Some(State::Gcra { tat }) if *tat > now as f64 => tat.floor() as i64,
        _ => now,
    };
    commit(state, &e.update);
    let until = match state {
        Some(State::Window { window, .. }) | Some(State::Sliding { window, .. }) => *window,
        _ => until,
    };
    (
        Grant {
            tokens: g,
            until,
            taken_back: 0,
            told: false,
        },
        Some(e.ttl_us),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const TB: Algorithm = Algorithm::TokenBucket {
        capacity: 100,
        refill_per_sec: 10.0,
    };
    const FW: Algorithm = Algorithm::FixedWindow {
        limit: 100,
        window_secs: 60,
    };
    const SW: Algorithm = Algorithm::SlidingWindow {
        limit: 100,
        window_secs: 60,
    };
    const NOW: Micros = 1_700_000_000_000_000;

    #[test]
    fn a_grant_is_a_fair_share_taken_as_one_request() {
        for alg in [TB, FW, SW] {
            let mut s = None;
            let (g, _) = grant(&alg, &mut s, NOW, 1_000, 4, 4);
            assert_eq!(g.tokens, 25, "{alg:?}");
            assert_eq!(available(&alg, s.as_ref(), NOW), 75, "{alg:?}");
            // Demand caps the share.
            let (g, _) = grant(&alg, &mut s, NOW, 10, 4, 4);
            assert_eq!(g.tokens, 10, "{alg:?}");
            assert_eq!(available(&alg, s.as_ref(), NOW), 65, "{alg:?}");
        }
    }

    #[test]
    fn near_exhaustion_nothing_is_granted() {
        for alg in [TB, FW, SW] {
            let mut s = None;
            let e = check(&alg, None, NOW, 90);
            commit(&mut s, &e.update);
            // 10 left over 3 replicas: a share of 3, under the minimum of 4.
            let before = s.clone();
            let (g, ttl) = grant(&alg, &mut s, NOW, 1_000, 3, 4);
            assert_eq!((g.tokens, ttl), (0, None), "{alg:?}");
            assert_eq!(s, before, "{alg:?}: nothing taken");
        }
    }

    #[test]
    fn a_token_bucket_takes_a_lease_back_only_while_that_is_exact() {
        // A drained bucket: a lease taken from it comes back exactly.
        let mut s = None;
        let e = check(&TB, None, NOW, 60);
        commit(&mut s, &e.update);
        let (g, _) = grant(&TB, &mut s, NOW, 10, 1, 1);
        assert_eq!(available(&TB, s.as_ref(), NOW), 30);
        assert_eq!(give_back(&TB, &mut s, NOW + 1000, 10, g.until).0, 10);
        assert_eq!(available(&TB, s.as_ref(), NOW + 1000), 40);
        // From a full bucket, refilled and then spent: the return would lift
        // it above what it would hold had the lease never been taken.
        let mut s = None;
        let (g, _) = grant(&TB, &mut s, NOW, 10, 1, 1);
        let later = NOW + 2_000_000; // refilled
        let e = check(&TB, s.as_ref(), later, 5);
        commit(&mut s, &e.update);
        assert_eq!(give_back(&TB, &mut s, later, 10, g.until).0, 0);
        assert_eq!(available(&TB, s.as_ref(), later), 95);
    }

    #[test]
    fn a_token_bucket_takes_back_what_lies_above_the_floor() {
        // Two leases of 10 on a drained bucket; the older gives back 3
        // first (it spent 7): the TAT is then 7 tokens above the newer's
        // floor, so of its 10 only 7 come back: the bucket is short of the 7
        // A spent and the 3 lost (under, never over).
        let mut s = None;
        let e = check(&TB, None, NOW, 60);
        commit(&mut s, &e.update);
        let (a, _) = grant(&TB, &mut s, NOW, 10, 1, 1);
        let (b, _) = grant(&TB, &mut s, NOW, 10, 1, 1);
        assert_eq!((a.tokens, b.tokens), (10, 10));
        assert_eq!(available(&TB, s.as_ref(), NOW), 20);
        assert_eq!(give_back(&TB, &mut s, NOW, 3, a.until).0, 3);
        assert_eq!(give_back(&TB, &mut s, NOW, 10, b.until).0, 7);
        assert_eq!(available(&TB, s.as_ref(), NOW), 30);
        // Nothing above the floor: nothing back.
        assert_eq!(give_back(&TB, &mut s, NOW, 10, b.until).0, 0);
    }

    #[test]
    fn a_window_takes_back_only_its_own_tokens() {
        for alg in [FW, SW] {
            let mut s = None;
            let (g, _) = grant(&alg, &mut s, NOW, 30, 1, 1);
            assert_eq!(available(&alg, s.as_ref(), NOW), 70);
            // Another window's tokens, or more than the count holds: nothing.
            assert_eq!(give_back(&alg, &mut s, NOW, 30, g.until - 1).0, 0);
            assert_eq!(give_back(&alg, &mut s, NOW, 31, g.until).0, 0);
            assert_eq!(give_back(&alg, &mut s, NOW, 20, g.until).0, 20);
            assert_eq!(available(&alg, s.as_ref(), NOW), 90, "{alg:?}");
        }
    }

    /// A quota of 100 an hour, its period begun just before `NOW`.
    fn hour_of_100() -> Algorithm {
        Algorithm::Calendar {
            limit: 100,
            period: crate::calendar::Period::Hour,
            start: NOW - 10,
            end: NOW + 3_600_000_000,
        }
    }

    #[test]
    fn a_quota_takes_back_only_its_own_periods_tokens() {
        let end = NOW + 3_600_000_000;
        let q = hour_of_100();
        let mut s = None;
        let (g, _) = grant(&q, &mut s, NOW, 30, 2, 4);
        assert_eq!(
            (g.tokens, g.until),
            (30, end),
            "a period is named by its end"
        );
        assert_eq!(available(&q, s.as_ref(), NOW), 70);
        // Half of what is left for two replicas: 35, asked 50.
        assert_eq!(grant(&q, &mut s, NOW, 50, 2, 4).0.tokens, 35);
        assert_eq!(give_back(&q, &mut s, NOW + 5, 20, end).0, 20);
        assert_eq!(available(&q, s.as_ref(), NOW), 55);
        // Another period's lease, or more than the count holds: refused.
        assert_eq!(give_back(&q, &mut s, NOW + 5, 5, end - 1).0, 0);
        assert_eq!(give_back(&q, &mut s, NOW + 5, 46, end).0, 0);
        let next = Algorithm::Calendar {
            limit: 100,
            period: crate::calendar::Period::Hour,
            start: end,
            end: end + 3_600_000_000,
        };
        assert_eq!(available(&next, s.as_ref(), end), 100);
    }

    #[test]
    fn a_dead_holders_quota_lease_comes_back_when_its_time_is_up() {
        let q = hour_of_100();
        let (mut s, mut l) = (None, Ledger::new());
        let (a, _) = grant(&q, &mut s, NOW, 30, 2, 4);
        hold(&mut l, "a", a.tokens, NOW, 200);
        let (b, _) = grant(&q, &mut s, NOW, 20, 2, 4);
        hold(&mut l, "b", b.tokens, NOW, 200);
        assert_eq!(available(&q, s.as_ref(), NOW), 50);
        // A spends 12 and says so, then dies; B gives its 20 back.
        report_spent(&q, &mut l, &mut s, "a", 12);
        let r = returnable(&l, "b", 25);
        assert_eq!(r, 20, "never more than B holds");
        let (back, _) = give_back(&q, &mut s, NOW + 5, r, b.until);
        settle_return(&mut l, "b", back);
        assert_eq!(available(&q, s.as_ref(), NOW), 70);
        // Before A's time is up nothing comes back; after, its 18, but
        // not to a call of A's own (alive, it reports what it spent).
        assert_eq!(reclaim(&q, &mut l, &mut s, NOW + 199, None), 0);
        assert_eq!(reclaim(&q, &mut l, &mut s, NOW + 200, Some("a")), 0);
        assert_eq!(reclaim(&q, &mut l, &mut s, NOW + 200, Some("b")), 18);
        assert_eq!(available(&q, s.as_ref(), NOW), 88);
        assert!(l.is_empty(), "both holdings settled: {l:?}");
        // A was only cut off: its late return takes back nothing, and the
        // 3 it spent unreported are charged again.
        assert_eq!(returnable(&l, "a", 15), 0);
        report_spent(&q, &mut l, &mut s, "a", 3);
        assert_eq!(available(&q, s.as_ref(), NOW), 85);
        // The ledger is read only where it can change a decision.
        assert!(reads_ledger(&q, s.as_ref(), 0, true));
        assert!(!reads_ledger(&q, s.as_ref(), 85, false));
        assert!(reads_ledger(&q, s.as_ref(), 86, false));
        assert!(!reads_ledger(&q, None, 500, false));
    }

    #[test]
    fn a_report_told_again_counts_once_even_after_its_holding_was_reclaimed() {
        let q = hour_of_100();
        let (mut s, mut l) = (None, Ledger::new());
        let (a, _) = grant(&q, &mut s, NOW, 40, 1, 4);
        hold(&mut l, "a", a.tokens, NOW, 200);
        // Report 1 (spent 10) is counted; its answer is lost, so A tells
        // it again: nothing more is charged.
        let tell = |l: &mut Ledger, s: &mut Option<State>, report: u64, spent: u64, at| {
            if told_before(l, "a", report) {
                return false;
            }
            report_spent(&q, l, s, "a", spent);
            mark_told(l, "a", report, at, 200);
            true
        };
        assert!(tell(&mut l, &mut s, 1, 10, NOW));
        assert!(!tell(&mut l, &mut s, 1, 10, NOW + 1));
        assert_eq!(l["a"].out, 30);
        assert_eq!(available(&q, s.as_ref(), NOW), 60);
        // A is cut off past its hold: its 30 come back, its number stays.
        assert_eq!(reclaim(&q, &mut l, &mut s, NOW + 200, None), 30);
        assert_eq!((l["a"].out, l["a"].told), (0, 1));
        // Back, it tells report 1 again (counted: nothing) and report 2,
        // 5 spent since: charged again, as a late report is.
        assert!(!tell(&mut l, &mut s, 1, 10, NOW + 300));
        assert!(tell(&mut l, &mut s, 2, 5, NOW + 300));
        assert_eq!(available(&q, s.as_ref(), NOW), 85);
        // Redis keeps the number in a field of its own (a shape a gateway
        // from before numbers leaves alone), a day past the report's hold.
        let at = NOW + 300 + 200 + TOLD_KEEP_US;
        let mut read = parse_ledger(vec![("a.t".to_string(), format!("2:{at}"))]);
        read.get_mut("a").unwrap().reclaim_at = NOW + 200;
        assert_eq!(read, l);
        let fields = [
            ("b", "7 9"),
            ("b.t", "3:11"),
            ("c.t", "7 9"),
            ("B.t", "3:11"),
        ];
        let read = parse_ledger(
            fields
                .iter()
                .map(|(f, v)| (f.to_string(), v.to_string()))
                .collect(),
        );
        assert_eq!(read.len(), 1, "malformed fields left out: {read:?}");
        assert_eq!((read["b"].out, read["b"].told), (7, 3));
        assert_eq!(reclaim(&q, &mut l, &mut s, at - 1, None), 0);
        assert_eq!(l["a"].told, 2);
        assert_eq!(reclaim(&q, &mut l, &mut s, at, None), 0);
        assert!(l.is_empty(), "forgotten a day later: {l:?}");
    }

    #[test]
    fn unleasable_algorithms_grant_nothing() {
        let leaky = Algorithm::LeakyBucket {
            rate_per_sec: 10.0,
            max_delay_ms: 1000,
        };
        let log = Algorithm::SlidingLog {
            limit: 10,
            window_secs: 1,
        };
        for alg in [leaky, log] {
            let mut s = None;
            assert_eq!(grant(&alg, &mut s, NOW, 5, 1, 1).0.tokens, 0);
            assert_eq!(s, None);
        }
    }
}
