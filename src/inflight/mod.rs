//! Protecting an upstream by concurrency rather than by rate: a cap on
//! requests in flight per upstream and per route, with a queue served by
//! plan priority (`gate`), a limit found from the upstream's latency
//! (`adaptive`), and a cap per client on a route (`PerClient`).
//!
//! The caps are this replica's. A pool-wide figure (`pool_max_in_flight`)
//! is divided by the live replicas the limiter's heartbeats count. They are
//! checked after the rate tiers admitted a request, so a refused request
//! takes no slot; a slot is a value dropped with the request, so every way
//! a request ends gives it back.

pub mod adaptive;
pub mod gate;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use crate::config::{Cap, Config, InFlight};
pub use gate::{Gate, Permit, Shed};

/// An adaptive limit stays under `max_in_flight` too, when both are given.
fn settings(f: &InFlight, replicas: u32) -> gate::Settings {
    let limit = limit_of(f.cap, replicas);
    gate::Settings {
        limit,
        queue: f.queue as usize,
        queue_timeout: Duration::from_millis(f.queue_timeout_ms),
        adaptive: f.adaptive.map(|(lo, hi)| (lo.min(limit), hi.min(limit))),
    }
}

/// This replica's share of a cap: a pool-wide figure over the live
/// replicas (rounded up: the pool may run a little over, never starve).
fn limit_of(cap: Cap, replicas: u32) -> u32 {
    match cap {
        Cap::Replica(n) => n,
        Cap::Pool(n) => n.div_ceil(replicas.max(1)).max(1),
    }
}

/// Every gate of one config: each capped upstream's and route's, and each
/// route's per-client counts. Built again on reload, keeping the gates (and
/// their requests in flight) of the upstreams and routes that remain.
pub struct Gates {
    /// By upstream name.
    upstreams: HashMap<String, (Arc<Gate>, InFlight)>,
    /// Indexed like the config's routes.
    routes: Vec<Option<(Arc<Gate>, InFlight)>>,
    per_client: Vec<Option<Arc<PerClient>>>,
    route_names: Vec<String>,
    replicas: AtomicU32,
}

impl Gates {
    pub fn build(config: &Config, previous: Option<&Gates>, replicas: u32) -> Self {
        let reuse = |old: Option<&(Arc<Gate>, InFlight)>, f: &InFlight| {
            let s = settings(f, replicas);
            match old {
                Some((g, _)) => {
                    g.configure(s);
                    g.clone()
                }
                None => Gate::new(s),
            }
        };
        let upstreams = config
            .upstreams
            .iter()
            .filter_map(|u| {
                let f = u.in_flight?;
                let old = previous.and_then(|p| p.upstreams.get(&u.name));
                Some((u.name.clone(), (reuse(old, &f), f)))
            })
            .collect();
        let old_route = |name: &str| {
            let p = previous?;
            let i = p.route_names.iter().position(|n| n == name)?;
            Some(i).map(|i| (&p.routes[i], &p.per_client[i]))
        };
        let routes = config
            .routes
            .iter()
            .map(|r| {
                let f = r.in_flight?;
                let old = old_route(&r.name).and_then(|(g, _)| g.as_ref());
                Some((reuse(old, &f), f))
            })
            .collect();
        let per_client = config
            .routes
            .iter()
            .map(|r| {
                let max = r.max_in_flight_per_client?;
                Some(match old_route(&r.name).and_then(|(_, c)| c.clone()) {
                    Some(c) => {
                        c.max.store(max, Ordering::Relaxed);
                        c
                    }
                    None => Arc::new(PerClient::new(max)),
                })
            })
            .collect();
        Gates {
            upstreams,
            routes,
            per_client,
            route_names: config.routes.iter().map(|r| r.name.clone()).collect(),
            replicas: AtomicU32::new(replicas),
        }
    }

    pub fn upstream(&self, name: &str) -> Option<&Arc<Gate>> {
        self.upstreams.get(name).map(|(g, _)| g)
    }

    pub fn route(&self, i: usize) -> Option<&Arc<Gate>> {
        self.routes.get(i)?.as_ref().map(|(g, _)| g)
    }

    pub fn per_client(&self, i: usize) -> Option<&Arc<PerClient>> {
        self.per_client.get(i)?.as_ref()
    }

    /// The live replicas now: pool-wide caps follow them.
    pub fn set_replicas(&self, n: u32) {
        if self.replicas.swap(n, Ordering::Relaxed) == n {
            return;
        }
        let all = self.upstreams.values().chain(self.routes.iter().flatten());
        for (g, f) in all {
            if let Cap::Pool(_) = f.cap {
                g.set_limit(limit_of(f.cap, n));
            }
        }
    }

    /// Records every gate's load in the metrics, as of a scrape.
    pub fn scrape(&self) {
        crate::metrics::in_flight_scrape_start(self.per_client_routes());
        for (kind, name, gate) in self.all() {
            let (held, queued, limit) = gate.load();
            crate::metrics::in_flight_gate(crate::metrics::GateScrape {
                kind,
                name,
                held,
                queued,
                limit,
                held_total: gate.held(),
                refusal_reasons: &Shed::REASONS,
                rtt_us: gate.estimate().map(|e| (e.min_rtt_us, e.sample_rtt_us)),
            });
        }
    }

    /// The routes with a cap per client, for metrics.
    pub fn per_client_routes(&self) -> impl Iterator<Item = &str> {
        self.per_client
            .iter()
            .zip(&self.route_names)
            .filter_map(|(c, n)| c.as_ref().map(|_| n.as_str()))
    }

    /// Each upstream's and route's gate, for metrics: (kind, name, gate).
    pub fn all(&self) -> impl Iterator<Item = (&'static str, &str, &Arc<Gate>)> {
        let ups = self
            .upstreams
            .iter()
            .map(|(n, (g, _))| ("upstream", n.as_str(), g));
        let routes = self
            .routes
            .iter()
            .zip(&self.route_names)
            .filter_map(|(g, n)| g.as_ref().map(|(g, _)| ("route", n.as_str(), g)));
        ups.chain(routes)
    }
}

/// One route's requests in flight per client (`max_in_flight_per_client`).
pub struct PerClient {
    max: AtomicU32,
    counts: Mutex<HashMap<String, u32>>,
}

impl PerClient {
    fn new(max: u32) -> Self {
        PerClient {
            max: AtomicU32::new(max),
            counts: Mutex::new(HashMap::new()),
        }
    }

    /// A place for one more of `client`'s requests, or `None` when it has
    /// its cap in flight already.
    pub fn enter(self: &Arc<Self>, client: &str) -> Option<ClientSlot> {
        let max = self.max.load(Ordering::Relaxed);
        let mut counts = self.counts.lock();
        let n = counts.entry(client.to_string()).or_insert(0);
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(ClientSlot {
            of: self.clone(),
            client: client.to_string(),
        })
    }

    /// Clients with a request in flight (the map holds no others).
    pub fn clients(&self) -> usize {
        self.counts.lock().len()
    }
}

/// One client's request in flight on a route; leaves when dropped.
pub struct ClientSlot {
    of: Arc<PerClient>,
    client: String,
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        let mut counts = self.of.counts.lock();
        if let Some(n) = counts.get_mut(&self.client) {
            *n -= 1;
            if *n == 0 {
                counts.remove(&self.client);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pool_figure_is_shared_by_the_live_replicas() {
        assert_eq!(limit_of(Cap::Pool(100), 3), 34);
        assert_eq!(limit_of(Cap::Pool(100), 0), 100);
        assert_eq!(limit_of(Cap::Pool(2), 5), 1);
        assert_eq!(limit_of(Cap::Replica(7), 5), 7);
    }

    #[test]
    fn a_client_gets_its_cap_and_the_map_forgets_it_after() {
        let c = Arc::new(PerClient::new(2));
        let a = c.enter("k:a").unwrap();
        let b = c.enter("k:a").unwrap();
        assert!(c.enter("k:a").is_none());
        let _other = c.enter("k:b").unwrap();
        drop(a);
        let _again = c.enter("k:a").unwrap();
        drop(b);
        drop(_again);
        assert_eq!(c.clients(), 1);
    }
}
