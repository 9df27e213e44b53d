//! Which route a request is: its host, then the longest path prefix, then
//! its method.
//!
//! Routes are tried most specific first: a route for the exact host, then
//! for a wildcard host (longer suffix first), then routes for any host; within
//! each, the longest prefix first. The first route whose host, prefix and
//! method all match wins; a request whose path some route matches but never
//! with its method is a 405, and one no route matches is a 404.

use crate::config::{HostPattern, Route};

/// Outcome of matching a normalised path and method against the routes.
#[derive(Debug, PartialEq, Eq)]
pub enum RouteMatch {
    Found(usize),
    /// The path has a route but not for this method; the allowed methods.
    MethodNotAllowed(Vec<String>),
    NotFound,
}

struct Entry {
    host: Option<HostPattern>,
    prefix: String,
    methods: Option<Vec<String>>,
    /// Index into the config's routes.
    index: usize,
}

impl Entry {
    /// Whether this route takes requests for `host` and `path` (any method).
    fn serves(&self, host: Option<&str>, path: &str) -> bool {
        let host_ok = match (&self.host, host) {
            (None, _) => true,
            (Some(p), Some(h)) => p.matches(h),
            (Some(_), None) => false,
        };
        host_ok && path.starts_with(self.prefix.as_str())
    }
}

/// Routes ordered for matching: most specific first.
pub struct RouteTable {
    entries: Vec<Entry>,
}

impl RouteTable {
    pub fn new(routes: &[Route]) -> Self {
        let mut entries: Vec<Entry> = routes
            .iter()
            .enumerate()
            .map(|(i, r)| Entry {
                host: r.host.clone(),
                prefix: r.path_prefix.clone(),
                methods: r.methods.clone(),
                index: i,
            })
            .collect();
        // Stable: among equals, config order.
        entries.sort_by_key(|e| {
            let host = e
                .host
                .as_ref()
                .map_or((2, std::cmp::Reverse(0)), HostPattern::rank);
            (host, std::cmp::Reverse(e.prefix.len()))
        });
        RouteTable { entries }
    }

    /// The first route whose host and prefix match, whatever the method (the
    /// route a 405 is counted under).
    pub fn find_path(&self, host: Option<&str>, path: &str) -> Option<usize> {
        self.entries
            .iter()
            .find(|e| e.serves(host, path))
            .map(|e| e.index)
    }

    /// `host` is the request's host, lower-case and without its port. A
    /// prefix is a plain string prefix, so `/a/b;x` and `/a/bc` are still
    /// `/a/b`'s: a suffix can never escape a route's limit.
    pub fn find(&self, host: Option<&str>, path: &str, method: &str) -> RouteMatch {
        let mut allowed: Vec<String> = Vec::new();
        for e in self.entries.iter().filter(|e| e.serves(host, path)) {
            match &e.methods {
                None => return RouteMatch::Found(e.index),
                // HEAD is GET without a body.
                Some(ms)
                    if ms
                        .iter()
                        .any(|m| m == method || (method == "HEAD" && m == "GET")) =>
                {
                    return RouteMatch::Found(e.index)
                }
                Some(ms) => allowed.extend(ms.iter().cloned()),
            }
        }
        if allowed.is_empty() {
            return RouteMatch::NotFound;
        }
        allowed.sort();
        allowed.dedup();
        RouteMatch::MethodNotAllowed(allowed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(name: &str, prefix: &str, methods: Option<&[&str]>) -> Route {
        Route {
            name: name.into(),
            host: None,
            path_prefix: prefix.into(),
            methods: methods.map(|m| m.iter().map(|s| s.to_string()).collect()),
            upstream: "u".into(),
            require_api_key: false,
            limit: None,
            limit_by_plan: Default::default(),
            strip_prefix: false,
            timeout_ms: None,
            retries: 0,
            max_request_body_bytes: None,
            cors: None,
            in_flight: None,
            max_in_flight_per_client: None,
            charge: None,
        }
    }

    fn on(host: HostPattern, r: Route) -> Route {
        Route {
            host: Some(host),
            ..r
        }
    }

    #[test]
    fn longest_prefix_then_method_then_fall_through() {
        let t = RouteTable::new(&[
            route("all", "/", None),
            route("req", "/api/rides/request", Some(&["POST"])),
            route("get", "/api/rides", Some(&["GET"])),
        ]);
        let f = |p, m| t.find(None, p, m);
        assert_eq!(f("/api/rides/request", "POST"), RouteMatch::Found(1));
        assert_eq!(f("/api/rides/request/x", "POST"), RouteMatch::Found(1));
        assert_eq!(f("/api/rides/request;a=b", "POST"), RouteMatch::Found(1));
        // A GET to the POST-only prefix falls through to /api/rides.
        assert_eq!(f("/api/rides/request", "GET"), RouteMatch::Found(2));
        // A DELETE matches neither method: it falls through to the catch-all.
        assert_eq!(f("/api/rides/request", "DELETE"), RouteMatch::Found(0));
        assert_eq!(f("/api/rides/list", "HEAD"), RouteMatch::Found(2));
        assert_eq!(f("/other", "DELETE"), RouteMatch::Found(0));
        let t = RouteTable::new(&[route("only", "/api", None)]);
        assert_eq!(t.find(None, "/", "GET"), RouteMatch::NotFound);
        // 405 only when no route takes the method.
        let t = RouteTable::new(&[
            route("post", "/api/rides/request", Some(&["POST"])),
            route("put", "/api", Some(&["PUT"])),
        ]);
        assert_eq!(
            t.find(None, "/api/rides/request", "GET"),
            RouteMatch::MethodNotAllowed(vec!["POST".into(), "PUT".into()])
        );
    }

    #[test]
    fn hosts_exact_then_wildcard_then_any() {
        let t = RouteTable::new(&[
            route("any", "/", None),
            on(
                HostPattern::Wildcard(".example.com".into()),
                route("wild", "/", None),
            ),
            on(
                HostPattern::Exact("api.example.com".into()),
                route("exact", "/", None),
            ),
            on(
                HostPattern::Wildcard(".eu.example.com".into()),
                route("eu", "/", None),
            ),
        ]);
        let f = |h| t.find(Some(h), "/x", "GET");
        assert_eq!(f("api.example.com"), RouteMatch::Found(2));
        assert_eq!(f("shop.example.com"), RouteMatch::Found(1));
        assert_eq!(f("a.eu.example.com"), RouteMatch::Found(3));
        assert_eq!(
            f("example.com"),
            RouteMatch::Found(0),
            "*.example.com is not the apex"
        );
        assert_eq!(f("other.org"), RouteMatch::Found(0));
        assert_eq!(t.find(None, "/x", "GET"), RouteMatch::Found(0));
    }
}
