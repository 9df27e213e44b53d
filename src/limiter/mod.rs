//! Rate limiting: the algorithms, the two backends that keep their state, and
//! the fallback wrapper that moves between them when Redis fails.
//!
//! A request's tiers arrive as a list of `Check`s and are decided together:
//! either every enforcing tier admits and all are charged, or none is.

pub mod algorithms;
mod batch;
mod deny_cache;
mod fallback;
pub mod keys;
pub mod leases;
mod ledger;
mod local;
mod pulls;
mod redis;
pub mod standing;
pub mod trail;

use std::fmt;

use async_trait::async_trait;

pub use algorithms::{Decision, Micros};
pub(crate) use batch::{Lost, Sent};
pub use fallback::{share, Fallback, FallbackState, OnShares, Outcome, Reset};
pub use local::LocalBackend;
pub use redis::{slot, AdminConnection, RedisBackend};

use crate::config::Algorithm;

/// Which tier a check belongs to; a closed set, safe as a metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tier {
    Ip,
    Key,
    Route,
    /// An API key's calendar quota (its plan's, or its own).
    Quota,
}

impl Tier {
    pub const ALL: [Tier; 4] = [Tier::Ip, Tier::Key, Tier::Route, Tier::Quota];

    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Ip => "ip",
            Tier::Key => "key",
            Tier::Route => "route",
            Tier::Quota => "quota",
        }
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One tier of one request: which bucket, by which rule.
#[derive(Debug, Clone, PartialEq)]
pub struct Check {
    pub tier: Tier,
    /// The bucket's name, from `keys::bucket_key`.
    pub key: String,
    pub algorithm: Algorithm,
    /// Decide and report, but never reject on this tier's account.
    pub shadow: bool,
    /// Tokens this request takes (a route's `cost`; 1 elsewhere).
    pub cost: u64,
    /// The bucket is one of this many equal sub-buckets of a global limit
    /// (its `shards`), holding 1/shards of it; 1 for every other bucket.
    pub shards: u64,
    /// The check is a cut bucket's pool (`standing`): the replicas' shares
    /// are this replica's local part of it, so it is never leased too.
    pub pool: bool,
    /// Counts charged units (a route's `charge`): its cost is the
    /// estimate, settled once the answer says what it cost. A leased tier
    /// then settles through its lease (`leases::settle`).
    pub charged: bool,
    /// A charged check's largest cost (its route's `charge.max`): a
    /// standing share is cut for its bucket only while one such request
    /// fits in a share (`Standing::cuts`). 0 for every other check.
    pub most: u64,
}

impl Check {
    /// Whether this replica may lease the check's bucket: a leasable
    /// algorithm (`algorithms::lease::leasable`), not a shadow tier or a
    /// cut bucket's pool, and not a token bucket counting charged units.
    /// Such a bucket's requests each cost an estimate (often far more than
    /// a lease holds, so a lease rarely covers one), and the refunds of the
    /// requests a call decided move it under the floors of leases granted
    /// in between on other replicas: measured with three replicas, the
    /// returns those leases lost starved a tenant (loadtest/llm_tenants.sh).
    /// Its refunds go to Redis; a counting window's and a quota's leases
    /// hold every refund they take back (`leases::settle`).
    pub fn leased(&self) -> bool {
        let charged_bucket =
            self.charged && matches!(self.algorithm, Algorithm::TokenBucket { .. });
        !(self.shadow || self.pool || charged_bucket)
            && algorithms::lease::leasable(&self.algorithm)
    }

    /// The limit's name in `RateLimit-Policy`, a 429's
    /// `violated-policies` and `/limits`: the tier's, a quota's with its
    /// period, and a quota of charged units' with `-units` (a plan may
    /// have both of one period: policy names are keys of one dictionary).
    pub fn policy_name(&self) -> &'static str {
        let kind = self.kind();
        match (self.tier, self.charged) {
            (Tier::Quota, true) => LimitKind::UNITS_NAMES[kind.index() - 4],
            _ => kind.as_str(),
        }
    }

    /// Which kind of limit this is, for metrics and the access log.
    pub fn kind(&self) -> LimitKind {
        use crate::calendar::Period;
        LimitKind(match (self.tier, self.algorithm) {
            (Tier::Quota, Algorithm::Calendar { period, .. }) => match period {
                Period::Minute => 4,
                Period::Hour => 5,
                Period::Day => 6,
                Period::Week => 7,
                Period::Month => 8,
            },
            (tier, _) => tier as u8,
        })
    }
}

/// A limit's kind: its tier, a quota's with its period. A closed set, safe
/// as a metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitKind(u8);

impl LimitKind {
    const NAMES: [&'static str; 9] = [
        "ip",
        "key",
        "route",
        "quota",
        "quota-minute",
        "quota-hour",
        "quota-day",
        "quota-week",
        "quota-month",
    ];
    pub const COUNT: usize = Self::NAMES.len();
    /// A quota of charged units' policy names, by period (`policy_name`).
    const UNITS_NAMES: [&'static str; 5] = [
        "quota-minute-units",
        "quota-hour-units",
        "quota-day-units",
        "quota-week-units",
        "quota-month-units",
    ];

    /// The kinds every route reports from the start (a quota's, once seen).
    pub const FIRST: [LimitKind; 3] = [LimitKind(0), LimitKind(1), LimitKind(2)];

    /// The per-IP tier's.
    pub const IP: LimitKind = LimitKind(0);

    pub fn as_str(self) -> &'static str {
        Self::NAMES[self.0 as usize]
    }

    pub fn index(self) -> usize {
        self.0 as usize
    }

    /// The kind `index` gave (the last kind past the end).
    pub fn from_index(i: usize) -> LimitKind {
        LimitKind(i.min(Self::COUNT - 1) as u8)
    }

    /// As a metric label.
    pub fn label(self) -> crate::metrics::TierLabel {
        crate::metrics::TierLabel {
            slot: self.index(),
            name: self.as_str(),
        }
    }

    /// The labels every route reports from the start.
    pub fn first_labels() -> [crate::metrics::TierLabel; 3] {
        Self::FIRST.map(Self::label)
    }
}

const _: () = assert!(LimitKind::COUNT <= crate::metrics::TIER_SLOTS);

/// What the backend said about a whole request.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Verdict {
    /// One decision per check, in order.
    pub decisions: Vec<Decision>,
    /// The time the decision was made at (Redis's clock for the Redis backend).
    pub now_us: Micros,
}

impl Verdict {
    /// Admitted iff every enforcing (non-shadow) tier admitted.
    pub fn admitted(&self, checks: &[Check]) -> bool {
        checks
            .iter()
            .zip(&self.decisions)
            .all(|(c, d)| d.allowed || c.shadow)
    }
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum LimiterError {
    #[error("redis call exceeded its {0} ms budget")]
    Timeout(u64),
    /// The breaker opened while the call was out: the request is decided
    /// by `on_redis_failure` at once.
    #[error("redis call abandoned: the breaker opened")]
    Abandoned,
    /// Redis answers but refuses this gateway: a configuration problem
    /// (password, ACL, database) that waiting will not fix.
    #[error("redis refused the gateway ({reason}): {detail}")]
    Refused {
        reason: &'static str,
        detail: String,
    },
    /// Redis ran the call past its deadline (`redis/script.rs`, `Fence`),
    /// writing nothing: its caller may have given up on it.
    #[error("redis ran the call {0} us past its deadline; nothing was written")]
    Late(u64),
    #[error("redis is not connected")]
    NotConnected,
    #[error("redis error: {0}")]
    Redis(String),
    /// Redis did not answer in time (redis-rs's own response or connect
    /// timeout); worded as any other Redis error.
    #[error("redis error: {0}")]
    NoAnswer(String),
    #[error("limiter script returned {0}")]
    BadReply(String),
    /// Keys of one call in different cluster slots: a bug, never a reason to admit.
    #[error("redis refused keys spanning cluster slots (CROSSSLOT)")]
    CrossSlot,
    /// A cluster node refused the call before anything ran: a key it does
    /// not serve (MOVED, ASK: with the node that does), a slot on the move
    /// (TRYAGAIN), or a node that cannot take it now (READONLY, CLUSTERDOWN,
    /// MASTERDOWN, LOADING). The call can be sent again.
    #[error("redis refused the call for now ({0})")]
    Misplaced(&'static str, Option<String>),
}

impl LimiterError {
    /// Redis did not answer in time (as opposed to answering with an
    /// error): the connection may be silent for good.
    pub fn is_silence(&self) -> bool {
        matches!(self, LimiterError::Timeout(_) | LimiterError::NoAnswer(_))
    }

    /// Whether the call may have run in Redis: only an error that Redis
    /// gave before running anything, or a call never sent, says it did not.
    pub fn may_have_run(&self) -> bool {
        !matches!(
            self,
            LimiterError::NotConnected
                | LimiterError::Late(_)
                | LimiterError::Refused { .. }
                | LimiterError::CrossSlot
                | LimiterError::Misplaced(..)
        )
    }

    /// The closed label `gateway_redis_errors_total{reason}` counts this under.
    pub fn reason(&self) -> &'static str {
        match self {
            LimiterError::Timeout(_) | LimiterError::Late(_) | LimiterError::Abandoned => "timeout",
            LimiterError::NotConnected
            | LimiterError::Redis(_)
            | LimiterError::NoAnswer(_)
            | LimiterError::Misplaced(..) => "unavailable",
            LimiterError::Refused { reason, .. } => reason,
            LimiterError::BadReply(_) | LimiterError::CrossSlot => "protocol",
        }
    }
}

/// Where bucket state lives. Decides all checks of one request atomically.
#[async_trait]
pub trait Backend: Send + Sync {
    async fn decide(&self, checks: &[Check]) -> Result<Verdict, LimiterError>;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::calendar::Period;

    #[test]
    fn a_limit_kind_is_its_tier_or_its_quota_period() {
        for tier in Tier::ALL {
            assert_eq!(LimitKind(tier as u8).as_str(), tier.as_str());
        }
        for (name, period) in Period::ALL {
            let c = Check {
                tier: Tier::Quota,
                key: String::new(),
                algorithm: Algorithm::Calendar {
                    limit: 1,
                    period,
                    start: 0,
                    end: 1,
                },
                shadow: false,
                cost: 1,
                shards: 1,
                pool: false,
                charged: false,
                most: 0,
            };
            assert_eq!(c.policy_name(), format!("quota-{name}"));
            let units = Check {
                charged: true,
                ..c.clone()
            };
            assert_eq!(units.policy_name(), format!("quota-{name}-units"));
            assert_eq!(units.kind(), c.kind(), "one metric label for both");
        }
    }
}
