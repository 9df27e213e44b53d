//! A request some of whose tiers were covered by tokens this replica holds
//! (a standing share's or a lease's) and the rest decided elsewhere (Redis,
//! or the fallback): which tiers are covered, the checks the rest go out
//! as, and one outcome over every tier put back together in tier order,
//! the local tokens kept when it was admitted and given back when any tier
//! refused. Shares and leases both decide this way. And, for a refund or a
//! settlement, where each admitted tier was decided (`admitted_tiers`).

use std::sync::Arc;

use super::{FallbackState, OnShares, Outcome};
use crate::limiter::leases::{self, Mark};
use crate::limiter::standing::Taken;
use crate::limiter::{Check, Decision, Micros, Verdict};

/// Per tier, the lease it was spent from (`Outcome::Decided::leased`).
type Marks = Option<Arc<[Option<Mark>]>>;

/// What tokens held here decided of a request's tiers.
pub(super) struct Covered<'a> {
    /// Per tier: its decision when it was covered here.
    decisions: &'a [Option<Decision>],
    /// Covered by standing shares (of this membership): the outcome says
    /// which tiers (`Outcome::Decided::standing`), for a refund to give
    /// back to them.
    on_shares: Option<u64>,
    /// Covered by leases: the lease each charged tier was spent from, for
    /// its settlement (`Outcome::Decided::leased`).
    marks: Marks,
}

impl<'a> Covered<'a> {
    pub fn shares(taken: &'a Taken) -> Self {
        Covered {
            decisions: &taken.decisions,
            on_shares: Some(taken.generation),
            marks: None,
        }
    }

    pub fn leases(decisions: &'a [Option<Decision>]) -> Self {
        Covered {
            decisions,
            on_shares: None,
            marks: None,
        }
    }

    /// Covered by `taken`'s leases, each charged tier's lease marked (only
    /// a request charged by its answer is settled).
    pub fn marked_leases(taken: &'a leases::Taken, checks: &[Check]) -> Self {
        let marks = checks
            .iter()
            .any(|c| c.charged)
            .then(|| taken.marks(checks))
            .filter(|m| m.iter().any(Option::is_some))
            .map(Into::into);
        Covered {
            marks,
            ..Covered::leases(&taken.decisions)
        }
    }

    /// The marks over every tier: a covered tier's own, the others' from
    /// the outcome that decided the rest.
    fn merge_marks(&self, rest: Marks) -> Marks {
        if self.marks.is_none() && rest.is_none() {
            return None;
        }
        let mut rest = rest.as_deref().unwrap_or(&[]).to_vec().into_iter();
        let mine = |i: usize| self.marks.as_ref().and_then(|m| m[i]);
        Some(
            self.decisions
                .iter()
                .enumerate()
                .map(|(i, d)| match d {
                    Some(_) => mine(i),
                    None => rest.next().flatten(),
                })
                .collect(),
        )
    }

    /// Bit i: tier i is covered.
    fn mask(&self) -> u64 {
        self.decisions
            .iter()
            .enumerate()
            .filter(|(_, d)| d.is_some())
            .fold(0, |m, (i, _)| m | 1 << i)
    }

    fn marked(&self) -> OnShares {
        match self.on_shares {
            Some(generation) => OnShares {
                tiers: self.mask(),
                generation,
            },
            None => OnShares::NONE,
        }
    }

    /// The request admitted here, when every tier is covered (decided at
    /// `now_us`).
    pub fn whole(&self, checks: &Arc<[Check]>, now_us: Micros) -> Option<Outcome> {
        let decisions: Option<Vec<Decision>> = self.decisions.iter().copied().collect();
        Some(Outcome::Decided {
            verdict: Verdict {
                decisions: decisions.filter(|d| !d.is_empty())?,
                now_us,
            },
            backend: FallbackState::Redis,
            checks: checks.clone(),
            standing: self.marked(),
            leased: self.marks.clone(),
        })
    }

    /// The checks of the tiers not covered, in order, as `send` makes them.
    pub fn rest(&self, checks: &[Check], send: impl Fn(&Check) -> Check) -> Arc<[Check]> {
        checks
            .iter()
            .zip(self.decisions)
            .filter(|(_, d)| d.is_none())
            .map(|(c, _)| send(c))
            .collect()
    }

    /// `outcome` decided the rest (`rest`): one outcome over every tier, in
    /// order, reporting a covered tier's own check and decision and the
    /// others as they were decided. `keep` is then told whether the request
    /// was admitted: the covered tiers' tokens are kept, or given back. An
    /// admission with no limiter (`FailOpen`) keeps them.
    pub fn merge(
        &self,
        checks: &Arc<[Check]>,
        outcome: Outcome,
        keep: impl FnOnce(bool),
    ) -> Outcome {
        match outcome {
            Outcome::Decided {
                verdict,
                backend,
                checks: rest,
                leased,
                ..
            } => {
                let mut answered = verdict.decisions.into_iter();
                let decisions: Vec<Decision> = self
                    .decisions
                    .iter()
                    .map(|d| match d {
                        Some(d) => *d,
                        None => answered.next().unwrap_or(Decision {
                            allowed: false,
                            limit: 0,
                            remaining: 0,
                            retry_after_us: 0,
                            reset_after_us: 0,
                            delay_us: 0,
                        }),
                    })
                    .collect();
                let checks = self.merge_checks(checks, &rest);
                let verdict = Verdict {
                    decisions,
                    now_us: verdict.now_us,
                };
                keep(verdict.admitted(&checks));
                Outcome::Decided {
                    verdict,
                    backend,
                    checks,
                    standing: self.marked(),
                    leased: self.merge_marks(leased),
                }
            }
            Outcome::Remembered {
                checks: rest,
                tier,
                decision,
                now_us,
            } => {
                keep(false);
                // Where the denying tier sits among all.
                let mut places = (0..checks.len()).filter(|&i| self.decisions[i].is_none());
                Outcome::Remembered {
                    checks: self.merge_checks(checks, &rest),
                    tier: places.nth(tier).unwrap_or(tier),
                    decision,
                    now_us,
                }
            }
            Outcome::FailOpen => {
                keep(true);
                Outcome::FailOpen
            }
            Outcome::FailClosed => {
                keep(false);
                Outcome::FailClosed
            }
        }
    }

    /// Every tier's check: a covered tier's own, the others' from `rest`.
    fn merge_checks(&self, checks: &[Check], rest: &[Check]) -> Arc<[Check]> {
        let mut rest = rest.iter();
        checks
            .iter()
            .zip(self.decisions)
            .map(|(c, d)| match d {
                Some(_) => c.clone(),
                None => rest.next().unwrap_or(c).clone(),
            })
            .collect()
    }
}

/// Where one admitted tier of a decided request was decided: what giving it
/// back (`refund`) or settling it (`settle`) goes through.
#[derive(Debug, Clone, Copy)]
pub(super) enum DecidedOn {
    /// This replica's standing share (of the outcome's membership).
    Share,
    /// A lease of this replica's (a charged tier's: `Outcome::Decided::leased`).
    Lease(Mark),
    /// The outcome's backend: Redis by a call, or the local backend.
    Backend,
}

impl Outcome {
    /// Each tier a decided request was admitted by, with where.
    pub(super) fn admitted_tiers(&self) -> impl Iterator<Item = (usize, &Check, DecidedOn)> {
        let (checks, decisions, covered, leased): (&[Check], &[Decision], _, _) = match self {
            Outcome::Decided {
                verdict,
                checks,
                standing,
                leased,
                ..
            } => (checks, &verdict.decisions, *standing, leased.as_deref()),
            _ => (&[], &[], OnShares::NONE, None),
        };
        checks
            .iter()
            .zip(decisions)
            .enumerate()
            .filter(|(_, (_, d))| d.allowed)
            .map(move |(i, (c, _))| {
                let on = match leased.and_then(|m| m.get(i).copied().flatten()) {
                    _ if covered.tiers & (1 << i) != 0 => DecidedOn::Share,
                    Some(mark) => DecidedOn::Lease(mark),
                    None => DecidedOn::Backend,
                };
                (i, c, on)
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Algorithm;
    use crate::limiter::Tier;

    fn check(key: &str, capacity: u64) -> Check {
        Check {
            tier: Tier::Ip,
            key: key.into(),
            algorithm: Algorithm::TokenBucket {
                capacity,
                refill_per_sec: 1.0,
            },
            shadow: false,
            cost: 1,
            shards: 1,
            pool: false,
            charged: false,
            most: 0,
        }
    }

    fn decision(allowed: bool, remaining: u64) -> Decision {
        Decision {
            allowed,
            limit: 10,
            remaining,
            retry_after_us: 0,
            reset_after_us: 0,
            delay_us: 0,
        }
    }

    fn decided(checks: Arc<[Check]>, decisions: Vec<Decision>) -> Outcome {
        Outcome::Decided {
            verdict: Verdict {
                decisions,
                now_us: 7,
            },
            backend: FallbackState::Redis,
            checks,
            standing: OnShares::NONE,
            leased: None,
        }
    }

    #[test]
    fn the_rest_goes_out_and_comes_back_in_tier_order() {
        let checks: Arc<[Check]> = vec![check("a", 10), check("b", 10), check("c", 10)].into();
        let here = Taken {
            decisions: vec![None, Some(decision(true, 4)), None],
            now_us: 7,
            generation: 3,
        };
        let covered = Covered::shares(&here);
        assert!(covered.whole(&checks, 7).is_none());
        let rest = covered.rest(&checks, |c| check(&c.key, 5));
        assert_eq!(
            rest.iter().map(|c| c.key.as_str()).collect::<Vec<_>>(),
            ["a", "c"]
        );
        let mut kept = None;
        let outcome = covered.merge(
            &checks,
            decided(rest.clone(), vec![decision(true, 1), decision(true, 2)]),
            |admitted| kept = Some(admitted),
        );
        assert_eq!(kept, Some(true));
        let Outcome::Decided {
            verdict,
            checks: merged,
            standing,
            ..
        } = outcome
        else {
            panic!("decided");
        };
        assert_eq!(
            verdict
                .decisions
                .iter()
                .map(|d| d.remaining)
                .collect::<Vec<_>>(),
            [1, 4, 2]
        );
        assert_eq!(
            standing,
            OnShares {
                tiers: 0b010,
                generation: 3
            }
        );
        // The covered tier reports its own check, the others as sent.
        assert_eq!(merged[1], checks[1]);
        assert_eq!(
            (merged[0].clone(), merged[2].clone()),
            (rest[0].clone(), rest[1].clone())
        );
    }

    #[test]
    fn a_refusal_anywhere_gives_the_local_tokens_back() {
        let checks: Arc<[Check]> = vec![check("a", 10), check("b", 10)].into();
        let here = [Some(decision(true, 4)), None];
        let covered = Covered::leases(&here);
        let rest = covered.rest(&checks, Check::clone);
        let mut kept = None;
        let outcome = covered.merge(
            &checks,
            decided(rest.clone(), vec![decision(false, 0)]),
            |admitted| kept = Some(admitted),
        );
        assert_eq!(kept, Some(false));
        assert!(matches!(
            outcome,
            Outcome::Decided {
                standing: OnShares::NONE,
                ..
            }
        ));

        // A remembered denial names its tier among all.
        let mut kept = None;
        let outcome = covered.merge(
            &checks,
            Outcome::Remembered {
                checks: rest,
                tier: 0,
                decision: decision(false, 0),
                now_us: 7,
            },
            |admitted| kept = Some(admitted),
        );
        assert_eq!(kept, Some(false));
        assert!(matches!(outcome, Outcome::Remembered { tier: 1, .. }));

        let mut kept = None;
        covered.merge(&checks, Outcome::FailClosed, |a| kept = Some(a));
        assert_eq!(kept, Some(false));
        covered.merge(&checks, Outcome::FailOpen, |a| kept = Some(a));
        assert_eq!(kept, Some(true), "admitted with no limiter: kept");
    }

    #[test]
    fn a_request_covered_whole_is_decided_here() {
        let checks: Arc<[Check]> = vec![check("a", 10), check("b", 10)].into();
        let here = Taken {
            decisions: vec![Some(decision(true, 4)), Some(decision(true, 3))],
            now_us: 9,
            generation: 1,
        };
        let Some(Outcome::Decided {
            verdict, standing, ..
        }) = Covered::shares(&here).whole(&checks, 9)
        else {
            panic!("decided here");
        };
        assert_eq!(
            (verdict.decisions.len(), verdict.now_us, standing),
            (
                2,
                9,
                OnShares {
                    tiers: 0b11,
                    generation: 1
                }
            )
        );
        assert!(Covered::leases(&[]).whole(&checks, 9).is_none());
    }
}
