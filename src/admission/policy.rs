//! The policy: a config snapshot with the lookups the request path needs,
//! built once per load. Each tier's rule with its buckets' constant name
//! head, each route's limit (split global limits and their dealer), the
//! key set and runtime keys a secret is looked up in, the JWT verifier,
//! each route's CORS rules, and the quota periods' spans.

use super::*;

/// A config snapshot with the lookups the request path needs, built once per load.
pub struct Policy {
    pub config: Arc<Config>,
    /// Every key the config accepts (`[[api_keys]]` and the keys file).
    pub keys: Arc<KeySet>,
    pub(super) routes: RouteTable,
    /// The tiers' rules, ready to name buckets: the ip tier's, each plan's
    /// (by name) and each route's limit (indexed like the config's routes).
    pub(super) ip_rule: Option<Rule>,
    pub(super) plan_rules: BTreeMap<String, Rule>,
    /// The keys with a burst bucket of their own, by id.
    pub(super) key_rules: BTreeMap<String, Rule>,
    pub(super) route_rules: Vec<Option<RouteRule>>,
    /// Each route's `limit_by_plan`: a plan's own rule, by plan name.
    pub(super) plan_route_rules: Vec<BTreeMap<String, RouteRule>>,
    /// Each route's CORS rules (its own policy, else `[cors]`'s), and
    /// `[cors]`'s for a request that matched no route.
    pub(super) route_cors: Vec<Option<CorsRules>>,
    pub(super) global_cors: Option<CorsRules>,
    /// Bucket names start with it (`redis.key_prefix`).
    pub(super) key_prefix: String,
    /// Each quota period's current span (`span`), by `Period::ALL` order.
    pub(super) spans: parking_lot::Mutex<[Option<Span>; 5]>,
    /// Keys issued at runtime (kept in Redis), after the config's.
    pub runtime: Arc<RuntimeKeys>,
    /// `[auth.jwt]`'s issuers, when there are any.
    pub jwt: Option<crate::identity::jwt::Verifier>,
}

/// A route's limit: its rule, and what names a request's bucket under it.
pub(super) struct RouteRule {
    pub(super) rule: Rule,
    pub(super) scope: Scope,
    pub(super) key: LimitKey,
    pub(super) missing: Missing,
    /// A global limit's sub-buckets (`shards`), by name; empty if not split.
    pub(super) shards: Vec<String>,
    /// `cost = "response"`: charged what the answer says (`charge`).
    pub(super) charged: bool,
    /// Which sub-bucket the next request takes: each replica deals its
    /// requests out in turn, so the sub-buckets fill evenly. Kept across
    /// reloads that keep the rule (`dealer`).
    pub(super) next_shard: Arc<AtomicUsize>,
}

impl RouteRule {
    pub(super) fn new(key_prefix: &str, name: &str, l: &crate::config::Limit) -> Self {
        let k = l.shards.max(1);
        // Each sub-bucket holds exactly 1/k (`config::limits` checked that
        // k divides the quota, and that a request fits in one).
        let mut rule = Rule::new(
            key_prefix,
            Tier::Route,
            name,
            crate::limiter::share(&l.algorithm, k as u32),
            l.shadow,
        );
        rule.cost = l.cost;
        rule.shards = k;
        rule.charged = l.charged;
        let (shards, next_shard) = if k > 1 {
            let names = (0..k).map(|i| shard_name(&rule.prefix, i, k)).collect();
            (names, dealer(&rule.prefix))
        } else {
            (Vec::new(), Arc::default())
        };
        RouteRule {
            rule,
            scope: l.scope,
            key: l.key.clone(),
            missing: l.missing,
            shards,
            charged: l.charged,
            next_shard,
        }
    }

    /// A rule counting charged units knows its route's largest cost.
    pub(super) fn charging(mut self, charge: Option<&crate::config::Charge>) -> Self {
        if self.rule.charged {
            self.rule.most = charge.map_or(0, |c| c.max);
        }
        self
    }

    /// The check of a request whose bucket is `identity`'s; for a split
    /// global limit, the next sub-bucket in turn.
    pub(super) fn check(&self, identity: &str) -> Check {
        if self.shards.is_empty() {
            return self.rule.check(identity);
        }
        let i = self.next_shard.fetch_add(1, Ordering::Relaxed) % self.shards.len();
        self.rule.check_named(self.shards[i].clone())
    }

    /// A request dealt a sub-bucket that spent nothing there gives its turn
    /// back: another tier rejected it (the sub-bucket admitted, or was never
    /// asked, as when a remembered denial answered first). The sub-buckets
    /// then take turns by what they admit, not by what they are offered. A
    /// sub-bucket that rejected keeps the turn spent: the next one is tried.
    pub(super) fn settle(&self, checks: &[Check], outcome: &Outcome) {
        let spent_or_empty = match outcome {
            Outcome::Decided {
                verdict,
                checks: decided,
                ..
            } => {
                verdict.admitted(decided)
                    || decided
                        .iter()
                        .zip(&verdict.decisions)
                        .any(|(c, d)| c.tier == Tier::Route && !d.allowed)
            }
            // Only the denying tier was asked: the turn is kept only if
            // that was the sub-bucket itself.
            Outcome::Remembered { checks, tier, .. } => checks[*tier].tier == Tier::Route,
            // Allowed or denied without Redis: nothing was spent anywhere.
            Outcome::FailOpen | Outcome::FailClosed => false,
        };
        if !spent_or_empty && checks.iter().any(|c| c.tier == Tier::Route) {
            self.next_shard.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// The turn counter of a split rule, by its buckets' names' head (which
/// carries its parameters): a reload that keeps the rule keeps dealing where
/// it was, rather than starting again at the first sub-bucket.
pub(super) fn dealer(rule_prefix: &str) -> Arc<AtomicUsize> {
    static DEALERS: std::sync::OnceLock<
        parking_lot::Mutex<std::collections::HashMap<String, Arc<AtomicUsize>>>,
    > = std::sync::OnceLock::new();
    DEALERS
        .get_or_init(Default::default)
        .lock()
        .entry(rule_prefix.to_string())
        .or_default()
        .clone()
}

/// The name of sub-bucket `i` of `k`: `global/I{TAG}`, where the hash tag is
/// the first whose Redis Cluster slot lies inside the i-th k-th of the slot
/// space, a slot clear of its ends (`redis-cli --cluster create` rounds its
/// masters' boundaries, which may fall one slot off a k-th's). Masters serve
/// contiguous slot ranges, so sub-buckets spread over them evenly (k a
/// multiple of the masters: the same number on each), where names hashed as
/// they come could put several on one master.
pub(super) fn shard_name(rule_prefix: &str, i: u64, k: u64) -> String {
    let (lo, hi) = (i * 16384 / k + 2, (i + 1) * 16384 / k - 2);
    let tag = (0u64..)
        .map(|n| format!("{{s{i}.{n}}}"))
        .find(|t| (lo..hi).contains(&(crate::limiter::slot(t) as u64)))
        .expect("every slot range is hit by some tag");
    format!("{rule_prefix}global/{i}{tag}")
}

/// One rule of one tier, with the constant head of its buckets' names
/// (`keys::rule_prefix`), built once per config load, not once per request.
#[derive(Clone)]
pub(super) struct Rule {
    pub(super) tier: Tier,
    pub(super) algorithm: Algorithm,
    pub(super) shadow: bool,
    pub(super) cost: u64,
    /// How many sub-buckets share the rule (`algorithm` is one's share).
    pub(super) shards: u64,
    /// Counts the units a `charge` route reads (`cost = "response"`): a
    /// property of the bucket, so every request of it (a CORS preflight
    /// too) is leased and cut the same way.
    pub(super) charged: bool,
    /// Its route's `charge.max` when `charged` (`Check::most`).
    pub(super) most: u64,
    pub(super) prefix: String,
}

impl Rule {
    pub(super) fn new(
        key_prefix: &str,
        tier: Tier,
        name: &str,
        algorithm: Algorithm,
        shadow: bool,
    ) -> Self {
        Rule {
            prefix: rule_prefix(key_prefix, tier.as_str(), name, &algorithm),
            tier,
            algorithm,
            shadow,
            cost: 1,
            shards: 1,
            charged: false,
            most: 0,
        }
    }

    /// The check of `identity`'s bucket under this rule.
    pub(super) fn check(&self, identity: &str) -> Check {
        self.check_named(bucket_name(&self.prefix, identity))
    }

    pub(super) fn check_named(&self, key: String) -> Check {
        Check {
            tier: self.tier,
            key,
            algorithm: self.algorithm,
            shadow: self.shadow,
            cost: self.cost,
            shards: self.shards,
            pool: false,
            charged: self.charged,
            most: self.most,
        }
    }
}

impl Policy {
    pub fn new(config: Arc<Config>, credentials: &Credentials) -> Self {
        let p = config.key_prefix();
        let ip_rule = config
            .ip_tier
            .as_ref()
            .map(|t| Rule::new(p, Tier::Ip, "ip", t.algorithm, t.shadow));
        let plan_rules = config
            .plans
            .iter()
            .map(|(name, plan)| {
                let algorithm = Algorithm::TokenBucket {
                    capacity: plan.capacity,
                    refill_per_sec: plan.refill_per_sec,
                };
                (
                    name.clone(),
                    Rule::new(p, Tier::Key, name, algorithm, false),
                )
            })
            .collect();
        // A key's own rule is named `@id`: `@` is in no plan's name.
        let key_rules = credentials
            .keys
            .with_own_limits()
            .filter_map(|k| {
                let b = k.burst?;
                let algorithm = Algorithm::TokenBucket {
                    capacity: b.capacity,
                    refill_per_sec: b.refill_per_sec,
                };
                let rule = Rule::new(p, Tier::Key, &format!("@{}", k.id), algorithm, false);
                Some((k.id.to_string(), rule))
            })
            .collect();
        let route_rules = config
            .routes
            .iter()
            .map(|r| {
                r.limit
                    .as_ref()
                    .map(|l| RouteRule::new(p, &r.name, l).charging(r.charge.as_deref()))
            })
            .collect();
        // A plan's rule is named `route.plan`: its buckets are its own.
        let plan_route_rules = config
            .routes
            .iter()
            .map(|r| {
                r.limit_by_plan
                    .iter()
                    .map(|(plan, l)| {
                        (
                            plan.clone(),
                            RouteRule::new(p, &format!("{}.{plan}", r.name), l)
                                .charging(r.charge.as_deref()),
                        )
                    })
                    .collect()
            })
            .collect();
        let style = config.limiter.headers;
        let route_cors = config
            .routes
            .iter()
            .map(|r| {
                let cors = r.cors.as_ref().or(config.cors.as_ref())?;
                Some(CorsRules::new(cors, r.methods.as_deref(), style))
            })
            .collect();
        let global_cors = config.cors.as_ref().map(|c| CorsRules::new(c, None, style));
        Policy {
            route_cors,
            global_cors,
            routes: RouteTable::new(&config.routes),
            ip_rule,
            plan_rules,
            key_rules,
            route_rules,
            plan_route_rules,
            key_prefix: p.to_string(),
            spans: parking_lot::Mutex::new([None; 5]),
            jwt: config.jwt.as_ref().map(|j| {
                crate::identity::jwt::Verifier::new(
                    j,
                    &credentials.jwt_files,
                    route_claims(&config),
                    config.plans.keys(),
                )
            }),
            config,
            keys: credentials.keys.clone(),
            runtime: Arc::default(),
        }
    }

    /// Whether any plan or key counts calendar quotas.
    pub fn has_quotas(&self) -> bool {
        self.config.plans_have_quotas() || self.keys.has_own_quotas()
    }

    /// This policy, looking up runtime keys in `keys` (one copy a process,
    /// kept across reloads).
    pub fn with_runtime_keys(mut self, keys: Arc<RuntimeKeys>) -> Self {
        self.runtime = keys;
        self
    }

    /// The key with this id: the config's, else a runtime one (held in
    /// `hold` for the borrow).
    pub(super) fn key_by_id<'a>(
        &'a self,
        id: &str,
        hold: &'a mut Option<Arc<RuntimeKey>>,
    ) -> Option<KeyRef<'a>> {
        if let Some(k) = self.keys.by_id(id) {
            return Some(k);
        }
        *hold = self.runtime.by_id(id);
        hold.as_deref().map(RuntimeKey::view)
    }

    /// The burst bucket `key` is held to: its own, else its plan's.
    pub(super) fn key_rule(&self, key: &KeyRef<'_>) -> Option<Cow<'_, Rule>> {
        match key.burst {
            // A runtime key's own rule is made when it is used.
            Some(b) => Some(match self.key_rules.get(key.id) {
                Some(r) => Cow::Borrowed(r),
                None => Cow::Owned(Rule::new(
                    &self.key_prefix,
                    Tier::Key,
                    &format!("@{}", key.id),
                    Algorithm::TokenBucket {
                        capacity: b.capacity,
                        refill_per_sec: b.refill_per_sec,
                    },
                    false,
                )),
            }),
            None => self.plan_rules.get(key.plan).map(Cow::Borrowed),
        }
    }

    /// The quotas `key` counts against: its own, else its plan's.
    pub(super) fn quotas_of<'a>(&'a self, key: &KeyRef<'a>) -> &'a [Quota] {
        match key.quotas {
            Some(own) => own,
            None => self
                .config
                .plans
                .get(key.plan)
                .map_or(&[][..], |p| p.quotas.as_slice()),
        }
    }

    /// One check per quota of `key`, on the period `now` falls in. Each
    /// period is a bucket of its own, named by the key's id alone (not its
    /// plan, nor the limit): a key moved to another plan, or a plan whose
    /// quota changed, keeps what it used this period. A quota of charged
    /// units (`cost = "response"`) counts only where `units` (a `charge`
    /// route); the bits of the checks that count them are returned
    /// (bit i: `out[i]`).
    pub(super) fn quota_checks(
        &self,
        key: &KeyRef<'_>,
        identity: &str,
        now: Micros,
        units: bool,
        out: &mut Vec<Check>,
    ) -> u64 {
        let mut charged = 0;
        for q in self.quotas_of(key) {
            if q.charged && !units {
                continue;
            }
            if q.charged && out.len() < 64 {
                charged |= 1 << out.len();
            }
            // A period's count of charged units is a bucket of its own.
            let units_rule;
            let rule = match q.charged {
                true => {
                    units_rule = format!("{}-units", q.period.as_str());
                    units_rule.as_str()
                }
                false => q.period.as_str(),
            };
            let span = self.span(q.period, now);
            let algorithm = Algorithm::Calendar {
                limit: q.limit,
                period: q.period,
                start: span.start,
                end: span.end,
            };
            out.push(Check {
                tier: Tier::Quota,
                key: bucket_key(&self.key_prefix, "quota", rule, &algorithm, identity),
                algorithm,
                shadow: false,
                cost: 1,
                shards: 1,
                pool: false,
                charged: q.charged,
                most: 0,
            });
        }
        charged
    }

    /// The period of `now`, remembered while it lasts (a calendar in a time
    /// zone is not free to work out on every request).
    pub(super) fn span(&self, period: Period, now: Micros) -> Span {
        let i = Period::ALL
            .iter()
            .position(|(_, p)| *p == period)
            .unwrap_or(0);
        let mut spans = self.spans.lock();
        match spans[i] {
            Some(s) if s.contains(now) => s,
            _ => {
                let s = calendar::span(period, self.config.limiter.quota_time_zone, now);
                spans[i] = Some(s);
                s
            }
        }
    }

    /// The route limit a key of plan `key_plan` (none: no key) is held to:
    /// its plan's own (`limit_by_plan`), else the route's `limit`.
    pub(super) fn route_rule(&self, route: usize, key_plan: Option<&str>) -> Option<&RouteRule> {
        key_plan
            .and_then(|p| self.plan_route_rules[route].get(p))
            .or(self.route_rules[route].as_ref())
    }

    /// After a request's decision: a split global limit's turn goes back
    /// if the request spent nothing on it (`RouteRule::settle`).
    pub fn settle(&self, plan: &Plan, outcome: &Outcome) {
        if let Some(rr) = self.route_rule(plan.route, plan.route_plan.as_deref()) {
            if !rr.shards.is_empty() {
                rr.settle(&plan.checks, outcome);
            }
        }
    }

    /// The CORS rules of a route, or (`None`) of requests that matched none.
    pub fn cors(&self, route: Option<usize>) -> Option<&CorsRules> {
        match route {
            Some(i) => self.route_cors[i].as_ref(),
            None => self.global_cors.as_ref(),
        }
    }
}
