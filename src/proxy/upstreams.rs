//! Upstream pools: round-robin over each upstream's servers, with active
//! health checks where `health_check_path` is set. Pools are rebuilt when a
//! reload changes the upstreams; one background loop checks whichever pools
//! are current.

use std::sync::Arc;
use std::time::Duration;

use pingora::lb::health_check::HttpHealthCheck;
use pingora::lb::selection::RoundRobin;
use pingora::lb::LoadBalancer;

use crate::config::Upstream;

pub struct Pools {
    /// The upstreams these pools were built from (to tell whether a reload changed them).
    pub source: Vec<Upstream>,
    by_name: Vec<(String, Arc<LoadBalancer<RoundRobin>>, bool)>,
}

impl Pools {
    /// Builds every pool, resolving host names once.
    pub fn build(upstreams: &[Upstream]) -> Result<Self, String> {
        let mut by_name = Vec::new();
        for u in upstreams {
            let mut lb =
                LoadBalancer::<RoundRobin>::try_from_iter(u.servers.iter().map(String::as_str))
                    .map_err(|e| {
                        format!("upstreams \"{}\": cannot resolve its servers: {e}", u.name)
                    })?;
            let checked = match &u.health_check_path {
                Some(path) => {
                    let mut hc = HttpHealthCheck::new("localhost", false);
                    let uri = path
                        .parse()
                        .map_err(|e| format!("upstreams \"{}\".health_check_path: {e}", u.name))?;
                    hc.req.set_uri(uri);
                    hc.peer_template.options.connection_timeout =
                        Some(Duration::from_millis(u.connect_timeout_ms));
                    hc.peer_template.options.read_timeout = Some(Duration::from_secs(1));
                    lb.set_health_check(Box::new(hc));
                    true
                }
                None => false,
            };
            by_name.push((u.name.clone(), Arc::new(lb), checked));
        }
        Ok(Pools {
            source: upstreams.to_vec(),
            by_name,
        })
    }

    /// The next healthy server of a pool, round-robin.
    pub fn select(&self, upstream: &str) -> Option<std::net::SocketAddr> {
        let (_, lb, _) = self.by_name.iter().find(|(n, _, _)| n == upstream)?;
        let backend = lb.select(b"", 256)?;
        backend.addr.as_inet().copied()
    }

    /// One round of health checks over every checked pool.
    pub async fn check_health(&self) {
        for (_, lb, checked) in &self.by_name {
            if *checked {
                lb.backends().run_health_check(true).await;
            }
        }
    }
}
