//! Upstream pools: round-robin over each upstream's servers, with active
//! health checks where `health_check_path` is set.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use pingora::lb::health_check::HttpHealthCheck;
use pingora::lb::selection::RoundRobin;
use pingora::lb::LoadBalancer;
use pingora::services::background::{background_service, GenBackgroundService};

use crate::config::Upstream;

/// A health-check service the server must run for a pool.
pub type HealthCheck = GenBackgroundService<LoadBalancer<RoundRobin>>;

pub struct Pools {
    by_name: HashMap<String, Arc<LoadBalancer<RoundRobin>>>,
}

impl Pools {
    /// Builds every pool (resolving host names once, at start) and returns the
    /// health-check services the server must run.
    pub fn build(upstreams: &[Upstream]) -> Result<(Self, Vec<HealthCheck>), String> {
        let mut by_name = HashMap::new();
        let mut services = Vec::new();
        for u in upstreams {
            let mut lb =
                LoadBalancer::<RoundRobin>::try_from_iter(u.servers.iter().map(String::as_str))
                    .map_err(|e| format!("upstream {}: cannot resolve its servers: {e}", u.name))?;
            match &u.health_check_path {
                Some(path) => {
                    let mut hc = HttpHealthCheck::new("localhost", false);
                    hc.req.set_uri(
                        path.parse()
                            .map_err(|e| format!("upstream {}: health_check_path: {e}", u.name))?,
                    );
                    hc.peer_template.options.connection_timeout =
                        Some(Duration::from_millis(u.connect_timeout_ms));
                    hc.peer_template.options.read_timeout = Some(Duration::from_secs(1));
                    lb.set_health_check(Box::new(hc));
                    lb.health_check_frequency = Some(Duration::from_secs(1));
                    let service = background_service(&format!("health check {}", u.name), lb);
                    by_name.insert(u.name.clone(), service.task());
                    services.push(service);
                }
                None => {
                    by_name.insert(u.name.clone(), Arc::new(lb));
                }
            }
        }
        Ok((Pools { by_name }, services))
    }

    /// The next healthy server of a pool, round-robin.
    pub fn select(&self, upstream: &str) -> Option<std::net::SocketAddr> {
        let lb = self.by_name.get(upstream)?;
        let backend = lb.select(b"", 256)?;
        backend.addr.as_inet().copied()
    }
}
