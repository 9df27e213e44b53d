//! Refunds: an admission whose request never reached the upstream (the
//! in-flight caps refused it, or its client left while it was queued) goes
//! back where it was decided.

use super::*;

impl Fallback {
    /// Gives back an admission (`Outcome::Decided`) whose request then
    /// never reached the upstream: the in-flight caps refused it, or its
    /// client left while it was queued. Where it was decided says how: in
    /// Redis (`refund.lua`), in the local backend, or on the fallback's
    /// shares, whose debt is then not charged at failback either.
    pub fn refund(&self, outcome: &Outcome) {
        let Outcome::Decided {
            verdict,
            backend,
            checks,
            standing: covered,
            leased,
        } = outcome
        else {
            return;
        };
        metrics::refunded();
        if covered.tiers != 0 || leased.is_some() {
            // The tiers its shares decided go back to them, a charged tier
            // spent from a lease to that lease; the others as where they
            // were decided.
            let leases = self.redis.as_ref().and_then(|r| r.leases());
            let now = Instant::now();
            let mut rest = (Vec::new(), Vec::new());
            for (i, c, on) in outcome.admitted_tiers() {
                match (on, &self.standing, leases) {
                    (DecidedOn::Share, Some(standing), _) => {
                        standing.give_back_one(c, covered.generation)
                    }
                    (DecidedOn::Lease(mark), _, Some(leases)) => {
                        leases.settle_on(c, mark, -(c.cost as i64), now);
                    }
                    (DecidedOn::Backend, ..) => {
                        rest.0.push(c.clone());
                        rest.1.push(verdict.decisions[i]);
                    }
                    _ => {}
                }
            }
            let (rest, decisions) = rest;
            if !rest.is_empty() {
                self.refund(&Outcome::Decided {
                    verdict: Verdict {
                        decisions,
                        now_us: verdict.now_us,
                    },
                    backend: *backend,
                    checks: rest.into(),
                    standing: OnShares::NONE,
                    leased: None,
                });
            }
            return;
        }
        match (backend, &self.redis) {
            (FallbackState::Redis, Some(redis)) => redis.refund(checks, verdict),
            (FallbackState::Redis, None) => {}
            (FallbackState::Local, redis) => {
                self.local
                    .refund_at(checks, &verdict.decisions, verdict.now_us);
                if redis.is_some() {
                    self.ledger
                        .unrecord(checks, &verdict.decisions, verdict.now_us);
                }
            }
        }
    }
}
