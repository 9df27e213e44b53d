//! URLs a config names (an issuer's `jwks_url`): checked when the file is
//! read, so a bad one is reported with its key and line.

/// An `http://` or `https://` URL, parsed: where a JWKS is fetched from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpUrl {
    pub https: bool,
    pub host: String,
    pub port: u16,
    /// `host[:port]`, as the `Host` header.
    pub authority: String,
    pub path: String,
}

impl HttpUrl {
    pub fn parse(url: &str) -> Result<HttpUrl, String> {
        let uri: http::Uri = url
            .parse()
            .map_err(|e| format!("\"{url}\" is not a URL: {e}"))?;
        let https = match uri.scheme_str() {
            Some("https") => true,
            Some("http") => false,
            _ => return Err(format!("\"{url}\": expected an http:// or https:// URL")),
        };
        let authority = uri
            .authority()
            .ok_or_else(|| format!("\"{url}\" has no host"))?;
        if authority.as_str().contains('@') {
            return Err(format!("\"{url}\": credentials in a URL are not supported"));
        }
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']');
        Ok(HttpUrl {
            https,
            host: host.to_string(),
            port: authority.port_u16().unwrap_or(if https { 443 } else { 80 }),
            authority: authority.to_string(),
            path: uri
                .path_and_query()
                .map_or("/".to_string(), |p| p.as_str().to_string()),
        })
    }
}
