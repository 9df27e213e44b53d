//! CORS, decided without a socket: whether an origin may call a route, what
//! a preflight is answered, and which headers a cross-origin response
//! carries so that browser code can read it (a 429 and its Retry-After
//! included).
//!
//! A route's rules are built once per config load, with their header values
//! ready, so a request pays only for comparing its `Origin`.

use http::{HeaderMap, HeaderValue};

use crate::config::{AllowHeaders, Cors, HeaderStyle, OriginPattern};

/// What a preflight may announce when neither the policy nor its route
/// names methods.
pub const COMMON_METHODS: &[&str] = &["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE"];

/// Request headers a browser sends cross-origin without asking
/// (the Fetch standard's CORS-safelisted names).
const SAFELISTED: &[&str] = &[
    "accept",
    "accept-language",
    "content-language",
    "content-type",
];

pub type Headers = Vec<(&'static str, HeaderValue)>;

/// One route's policy, ready to answer.
#[derive(Debug)]
pub struct CorsRules {
    origins: Vec<OriginPattern>,
    /// `Access-Control-Allow-Origin: *` (any origin, no credentials);
    /// otherwise the request's origin is echoed and responses vary by it.
    star: bool,
    credentials: bool,
    methods: Vec<String>,
    methods_value: HeaderValue,
    headers: AllowHeaders,
    expose_value: HeaderValue,
    max_age: Option<HeaderValue>,
    pub charge_preflight: bool,
}

/// Why a preflight is refused (403, without CORS headers: the browser
/// then blocks the request it announced).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CorsError {
    Origin,
    /// The method asked for, when it is a valid token.
    Method(Option<String>),
    /// The headers the policy allows.
    Header(Vec<String>),
}

impl std::fmt::Display for CorsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CorsError::Origin => {
                f.write_str("the Origin is not allowed by this route's CORS policy")
            }
            CorsError::Method(Some(m)) => write!(f, "CORS: method {m} is not allowed"),
            CorsError::Method(None) => {
                f.write_str("CORS: Access-Control-Request-Method is not a method")
            }
            CorsError::Header(allowed) => write!(
                f,
                "CORS: a requested header is not allowed (allowed: {})",
                if allowed.is_empty() {
                    "none beyond the safelisted".to_string()
                } else {
                    allowed.join(", ")
                }
            ),
        }
    }
}

/// Whether a request is a CORS preflight: OPTIONS with an Origin and the
/// method it announces.
pub fn is_preflight(method: &str, headers: &HeaderMap) -> bool {
    method == "OPTIONS"
        && headers.contains_key(http::header::ORIGIN)
        && headers.contains_key(http::header::ACCESS_CONTROL_REQUEST_METHOD)
}

impl CorsRules {
    /// `route_methods`: the route's (`None`: any). `style`: which rate-limit
    /// headers the gateway sends, all of them exposed to scripts.
    pub fn new(cors: &Cors, route_methods: Option<&[String]>, style: HeaderStyle) -> Self {
        let methods: Vec<String> = match (&cors.allow_methods, route_methods) {
            (Some(m), Some(route)) => m.iter().filter(|x| route.contains(x)).cloned().collect(),
            (Some(m), None) => m.clone(),
            (None, Some(route)) => route.to_vec(),
            (None, None) => COMMON_METHODS.iter().map(|m| m.to_string()).collect(),
        };
        let mut expose: Vec<&str> = Vec::new();
        if style.x_ratelimit() {
            expose.extend([
                "x-ratelimit-limit",
                "x-ratelimit-remaining",
                "x-ratelimit-reset",
            ]);
        }
        if style.ietf() {
            expose.extend(["ratelimit-policy", "ratelimit"]);
        }
        expose.extend(["retry-after", "x-request-id"]);
        for h in &cors.expose_headers {
            if !expose.contains(&h.as_str()) {
                expose.push(h);
            }
        }
        let star = cors.allow_origins.contains(&OriginPattern::Any) && !cors.allow_credentials;
        CorsRules {
            origins: cors.allow_origins.clone(),
            star,
            credentials: cors.allow_credentials,
            methods_value: value(&methods.join(", ")),
            methods,
            headers: cors.allow_headers.clone(),
            expose_value: value(&expose.join(", ")),
            max_age: cors.max_age_secs.map(HeaderValue::from),
            charge_preflight: cors.charge_preflight,
        }
    }

    /// Whether `origin` (the header's bytes) is allowed; compared as
    /// browsers serialise origins (lower-case), so any case matches.
    pub fn allows(&self, origin: &[u8]) -> bool {
        let Ok(origin) = std::str::from_utf8(origin) else {
            return false;
        };
        let origin = origin.to_ascii_lowercase();
        self.origins.iter().any(|p| match p {
            OriginPattern::Any => true,
            OriginPattern::Exact(o) => *o == origin,
            OriginPattern::Subdomains { scheme, suffix } => origin
                .strip_prefix(scheme.as_str())
                .and_then(|rest| rest.strip_suffix(suffix.as_str()))
                .is_some_and(|name| {
                    !name.is_empty()
                        && name.split('.').all(|l| {
                            !l.is_empty()
                                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                        })
                }),
        })
    }

    /// `Access-Control-Allow-Origin` (and credentials) for an allowed origin.
    fn allow_origin(&self, origin: &HeaderValue, out: &mut Headers) {
        let acao = match self.star {
            true => HeaderValue::from_static("*"),
            false => origin.clone(),
        };
        out.push(("access-control-allow-origin", acao));
        if self.credentials {
            out.push((
                "access-control-allow-credentials",
                HeaderValue::from_static("true"),
            ));
        }
    }

    /// The headers of the 204 that answers a preflight, or why it is refused.
    pub fn preflight(&self, req: &HeaderMap) -> Result<Headers, CorsError> {
        let origin = req.get(http::header::ORIGIN).ok_or(CorsError::Origin)?;
        if !self.allows(origin.as_bytes()) {
            return Err(CorsError::Origin);
        }
        let method = req
            .get(http::header::ACCESS_CONTROL_REQUEST_METHOD)
            .and_then(|v| v.to_str().ok())
            .filter(|m| http::Method::from_bytes(m.as_bytes()).is_ok())
            .ok_or(CorsError::Method(None))?;
        // HEAD is GET without a body, as routes take it.
        let allowed = |m: &str| self.methods.iter().any(|x| x == m);
        if !(allowed(method) || method == "HEAD" && allowed("GET")) {
            return Err(CorsError::Method(Some(method.to_string())));
        }
        // The announced headers, each allowed (or safelisted), echoed back.
        let mut asked = Vec::new();
        for v in req.get_all(http::header::ACCESS_CONTROL_REQUEST_HEADERS) {
            let text = v.to_str().map_err(|_| self.header_error())?;
            for name in text.split(',').map(str::trim).filter(|n| !n.is_empty()) {
                let name = name.to_ascii_lowercase();
                let ok = match &self.headers {
                    AllowHeaders::Any => http::HeaderName::from_bytes(name.as_bytes()).is_ok(),
                    AllowHeaders::List(l) => {
                        l.contains(&name) || SAFELISTED.contains(&name.as_str())
                    }
                };
                if !ok {
                    return Err(self.header_error());
                }
                asked.push(name);
            }
        }
        let mut out = Vec::with_capacity(6);
        self.allow_origin(origin, &mut out);
        out.push(("access-control-allow-methods", self.methods_value.clone()));
        if !asked.is_empty() {
            out.push(("access-control-allow-headers", value(&asked.join(", "))));
        }
        if let Some(age) = &self.max_age {
            out.push(("access-control-max-age", age.clone()));
        }
        out.push((
            "vary",
            HeaderValue::from_static(
                "origin, access-control-request-method, access-control-request-headers",
            ),
        ));
        Ok(out)
    }

    fn header_error(&self) -> CorsError {
        CorsError::Header(match &self.headers {
            AllowHeaders::Any => Vec::new(),
            AllowHeaders::List(l) => l.clone(),
        })
    }

    /// The headers an actual response carries: for an allowed origin, who
    /// may read it and which headers scripts see. A `"*"` answer is the same
    /// for every request, with an Origin or not (a cache may hand it to any
    /// page); any other depends on the origin and says so (`Vary: Origin`),
    /// so a cache never hands one origin's answer to another.
    pub fn response(&self, origin: Option<&HeaderValue>) -> Headers {
        let mut out = Vec::new();
        if self.star {
            out.push(("access-control-allow-origin", HeaderValue::from_static("*")));
            out.push(("access-control-expose-headers", self.expose_value.clone()));
            return out;
        }
        if let Some(origin) = origin.filter(|o| self.allows(o.as_bytes())) {
            self.allow_origin(origin, &mut out);
            out.push(("access-control-expose-headers", self.expose_value.clone()));
        }
        out.push(("vary", HeaderValue::from_static("origin")));
        out
    }

    /// The response headers this policy answers for: an upstream's own are
    /// dropped on a route that has one.
    pub const OWNED: &'static [&'static str] = &[
        "access-control-allow-origin",
        "access-control-allow-credentials",
        "access-control-expose-headers",
        "access-control-allow-methods",
        "access-control-allow-headers",
        "access-control-max-age",
    ];
}

/// Names and tokens from a validated config: always header text.
fn value(s: &str) -> HeaderValue {
    HeaderValue::from_str(s).unwrap_or_else(|_| HeaderValue::from_static(""))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cors(origins: &[OriginPattern], credentials: bool) -> Cors {
        Cors {
            allow_origins: origins.to_vec(),
            allow_methods: None,
            allow_headers: AllowHeaders::List(vec!["x-api-key".into()]),
            expose_headers: vec!["x-trace".into()],
            allow_credentials: credentials,
            max_age_secs: Some(600),
            charge_preflight: false,
        }
    }

    fn app() -> OriginPattern {
        OriginPattern::Exact("https://app.example.com".into())
    }

    fn req(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (n, v) in pairs {
            h.append(*n, HeaderValue::from_static(v));
        }
        h
    }

    fn get<'a>(hs: &'a Headers, name: &str) -> Option<&'a str> {
        hs.iter()
            .find(|(n, _)| *n == name)
            .and_then(|(_, v)| v.to_str().ok())
    }

    #[test]
    fn origins_match_exactly_or_as_subdomains() {
        let sub = OriginPattern::Subdomains {
            scheme: "https://".into(),
            suffix: ".example.com".into(),
        };
        let r = CorsRules::new(&cors(&[app(), sub], false), None, HeaderStyle::Both);
        assert!(r.allows(b"https://app.example.com"));
        assert!(
            r.allows(b"HTTPS://APP.example.com"),
            "origins compare case-insensitively"
        );
        assert!(r.allows(b"https://a.b.example.com"));
        assert!(
            !r.allows(b"https://example.com"),
            "the apex is not a subdomain"
        );
        assert!(!r.allows(b"http://a.example.com"), "scheme matters");
        assert!(!r.allows(b"https://evil-example.com"));
        assert!(!r.allows(b"https://x.example.com.evil.net"));
        assert!(!r.allows(b"https://.example.com"));
        assert!(!r.allows(b"null"));
    }

    #[test]
    fn a_preflight_is_answered_with_what_was_asked_when_allowed() {
        let methods = vec!["POST".to_string()];
        let r = CorsRules::new(&cors(&[app()], true), Some(&methods), HeaderStyle::Both);
        let ok = r
            .preflight(&req(&[
                ("origin", "https://app.example.com"),
                ("access-control-request-method", "POST"),
                ("access-control-request-headers", "X-API-Key, content-type"),
            ]))
            .unwrap();
        assert_eq!(
            get(&ok, "access-control-allow-origin"),
            Some("https://app.example.com")
        );
        assert_eq!(get(&ok, "access-control-allow-credentials"), Some("true"));
        assert_eq!(get(&ok, "access-control-allow-methods"), Some("POST"));
        assert_eq!(
            get(&ok, "access-control-allow-headers"),
            Some("x-api-key, content-type")
        );
        assert_eq!(get(&ok, "access-control-max-age"), Some("600"));
        assert!(get(&ok, "vary").unwrap().contains("origin"));

        let ask = |o: &'static str, m: &'static str, h: &'static str| {
            r.preflight(&req(&[
                ("origin", o),
                ("access-control-request-method", m),
                ("access-control-request-headers", h),
            ]))
        };
        assert_eq!(
            ask("https://evil.example", "POST", ""),
            Err(CorsError::Origin)
        );
        assert_eq!(
            ask("https://app.example.com", "GET", ""),
            Err(CorsError::Method(Some("GET".into()))),
            "a method the route does not take"
        );
        assert_eq!(
            ask("https://app.example.com", "POST", "x-secret"),
            Err(CorsError::Header(vec!["x-api-key".into()]))
        );
        assert_eq!(
            ask("https://app.example.com", "BAD METHOD", ""),
            Err(CorsError::Method(None))
        );
        let get_only = vec!["GET".to_string()];
        let g = CorsRules::new(&cors(&[app()], false), Some(&get_only), HeaderStyle::Both);
        let head = req(&[
            ("origin", "https://app.example.com"),
            ("access-control-request-method", "HEAD"),
        ]);
        assert!(g.preflight(&head).is_ok(), "HEAD goes where GET does");
    }

    #[test]
    fn responses_expose_the_rate_limit_headers_and_retry_after() {
        let r = CorsRules::new(&cors(&[app()], false), None, HeaderStyle::Both);
        let origin = HeaderValue::from_static("https://app.example.com");
        let hs = r.response(Some(&origin));
        assert_eq!(
            get(&hs, "access-control-allow-origin"),
            Some("https://app.example.com")
        );
        assert_eq!(
            get(&hs, "access-control-expose-headers"),
            Some("x-ratelimit-limit, x-ratelimit-remaining, x-ratelimit-reset, ratelimit-policy, ratelimit, retry-after, x-request-id, x-trace")
        );
        assert_eq!(get(&hs, "access-control-allow-credentials"), None);
        assert_eq!(get(&hs, "vary"), Some("origin"));
        let other = HeaderValue::from_static("https://evil.example");
        assert_eq!(
            r.response(Some(&other)),
            vec![("vary", HeaderValue::from_static("origin"))]
        );
        assert_eq!(
            r.response(None),
            vec![("vary", HeaderValue::from_static("origin"))]
        );

        let any = CorsRules::new(&cors(&[OriginPattern::Any], false), None, HeaderStyle::None);
        assert_eq!(
            any.response(None),
            any.response(Some(&other)),
            "the same for all"
        );
        let hs = any.response(Some(&other));
        assert_eq!(get(&hs, "access-control-allow-origin"), Some("*"));
        assert_eq!(
            get(&hs, "access-control-expose-headers"),
            Some("retry-after, x-request-id, x-trace")
        );
        assert_eq!(
            get(&hs, "vary"),
            None,
            "a \"*\" answer is the same for every origin"
        );
    }

    #[test]
    fn methods_default_to_the_routes_and_are_cut_to_them() {
        let mut c = cors(&[app()], false);
        let route = vec!["GET".to_string(), "POST".to_string()];
        let r = CorsRules::new(&c, Some(&route), HeaderStyle::Both);
        assert_eq!(r.methods, route);
        let r = CorsRules::new(&c, None, HeaderStyle::Both);
        assert_eq!(r.methods, COMMON_METHODS);
        c.allow_methods = Some(vec!["POST".into(), "DELETE".into()]);
        let r = CorsRules::new(&c, Some(&route), HeaderStyle::Both);
        assert_eq!(
            r.methods,
            vec!["POST".to_string()],
            "a global policy is cut to each route's methods"
        );
        assert!(is_preflight(
            "OPTIONS",
            &req(&[("origin", "x"), ("access-control-request-method", "GET")])
        ));
        assert!(!is_preflight("OPTIONS", &req(&[("origin", "x")])));
        assert!(!is_preflight(
            "GET",
            &req(&[("origin", "x"), ("access-control-request-method", "GET")])
        ));
    }
}
