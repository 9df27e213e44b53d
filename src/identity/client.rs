//! Who the client is: its address (behind trusted proxies), the bucket that
//! address falls in, and the API key it presents (looked up in
//! `crate::identity::apikeys`).
//!
//! Everything here is pure: it works on strings and addresses handed in, so it
//! is tested without sockets.

use std::fmt;
use std::net::{IpAddr, Ipv6Addr};

use ipnet::{IpNet, Ipv6Net};

/// `::ffff:a.b.c.d` is the IPv4 client a.b.c.d.
pub fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(v6),
        },
        v4 => v4,
    }
}

fn in_any(ip: IpAddr, nets: &[IpNet]) -> bool {
    nets.iter().any(|n| n.contains(&ip))
}

/// One `X-Forwarded-For` entry: a bare address, `[v6]`, `[v6]:port` or
/// `v4:port`. Anything else (zone ids, names, `unknown`) is malformed.
fn parse_xff_entry(s: &str) -> Option<IpAddr> {
    let s = s.trim();
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Some(ip);
    }
    if let Some(rest) = s.strip_prefix('[') {
        let (addr, after) = rest.split_once(']')?;
        if !(after.is_empty() || after.strip_prefix(':')?.parse::<u16>().is_ok()) {
            return None;
        }
        return addr.parse::<Ipv6Addr>().ok().map(IpAddr::V6);
    }
    let (addr, port) = s.rsplit_once(':')?;
    port.parse::<u16>().ok()?;
    addr.parse::<std::net::Ipv4Addr>().ok().map(IpAddr::V4)
}

/// The client address: the socket peer, unless the peer is a trusted proxy;
/// then the rightmost `X-Forwarded-For` address that is not itself trusted.
/// Several XFF headers are read as one list, in order. Malformed entries are
/// skipped, never believed.
pub fn client_ip<'a>(
    peer: IpAddr,
    xff_headers: impl DoubleEndedIterator<Item = &'a str>,
    trusted: &[IpNet],
) -> IpAddr {
    let peer = canonical(peer);
    if !in_any(peer, trusted) {
        return peer;
    }
    let mut leftmost_trusted = peer;
    for header in xff_headers.rev() {
        for entry in header.rsplit(',') {
            let Some(ip) = parse_xff_entry(entry).map(canonical) else {
                continue;
            };
            if !in_any(ip, trusted) {
                return ip;
            }
            leftmost_trusted = ip;
        }
    }
    // Every hop is a trusted proxy: the request started at the first of them.
    leftmost_trusted
}

/// The unit a client is limited as: an IPv4 address or an IPv6 prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ClientAddr {
    V4(std::net::Ipv4Addr),
    V6(Ipv6Net),
}

impl ClientAddr {
    pub fn new(ip: IpAddr, ipv6_prefix_len: u8) -> Self {
        match canonical(ip) {
            IpAddr::V4(v4) => ClientAddr::V4(v4),
            IpAddr::V6(v6) => ClientAddr::V6(
                Ipv6Net::new(v6, ipv6_prefix_len.min(128))
                    .map(|n| n.trunc())
                    .unwrap_or_else(|_| Ipv6Net::from(v6)),
            ),
        }
    }
}

impl fmt::Display for ClientAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClientAddr::V4(v4) => write!(f, "{v4}"),
            ClientAddr::V6(net) => write!(f, "{net}"),
        }
    }
}

/// Where a request's API key came from, for error messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyError {
    /// Two different keys in one request (header and bearer, or a repeated header).
    Conflicting,
}

/// The API key presented by a request, if any: the configured header or
/// `Authorization: Bearer`. Other `Authorization` schemes are left alone.
pub fn presented_key<'a>(
    key_headers: impl Iterator<Item = &'a [u8]>,
    authorization: impl Iterator<Item = &'a [u8]>,
) -> Result<Option<&'a [u8]>, KeyError> {
    let mut found: Option<&[u8]> = None;
    let bearer = authorization.filter_map(bearer);
    for k in key_headers.map(trim).chain(bearer) {
        if k.is_empty() {
            continue;
        }
        match found {
            Some(prev) if prev != k => return Err(KeyError::Conflicting),
            _ => found = Some(k),
        }
    }
    Ok(found)
}

/// The bearer JWT among `Authorization` values (`Bearer eyJ...`, shaped as
/// a JWS), and which value carried it.
pub fn bearer_jwt<'a>(authorization: &[&'a [u8]]) -> Option<(usize, &'a [u8])> {
    authorization.iter().enumerate().find_map(|(i, v)| {
        bearer(v)
            .filter(|t| crate::identity::jwt::looks_like_jwt(t))
            .map(|t| (i, t))
    })
}

/// The credential of one `Authorization: Bearer` value, trimmed.
fn bearer(v: &[u8]) -> Option<&[u8]> {
    let v = trim(v);
    (v.len() > 7 && v[..7].eq_ignore_ascii_case(b"bearer ")).then(|| trim(&v[7..]))
}

fn trim(v: &[u8]) -> &[u8] {
    let start = v
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .unwrap_or(v.len());
    let end = v
        .iter()
        .rposition(|b| !b.is_ascii_whitespace())
        .map_or(start, |e| e + 1);
    &v[start..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nets(s: &[&str]) -> Vec<IpNet> {
        s.iter().map(|n| n.parse().unwrap()).collect()
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn xff_only_from_trusted_peers() {
        let trusted = nets(&["127.0.0.1/32", "10.0.0.0/8"]);
        // Untrusted peer: XFF ignored.
        assert_eq!(
            client_ip(ip("198.51.100.1"), ["1.2.3.4"].into_iter(), &trusted),
            ip("198.51.100.1")
        );
        // Trusted peer: rightmost untrusted.
        assert_eq!(
            client_ip(
                ip("127.0.0.1"),
                ["6.6.6.6, 1.2.3.4, 10.0.0.2"].into_iter(),
                &trusted
            ),
            ip("1.2.3.4")
        );
        // Several headers read as one list.
        assert_eq!(
            client_ip(
                ip("127.0.0.1"),
                ["6.6.6.6", "1.2.3.4"].into_iter(),
                &trusted
            ),
            ip("1.2.3.4")
        );
        // Garbage skipped, never trusted.
        assert_eq!(
            client_ip(
                ip("127.0.0.1"),
                ["1.2.3.4, garbage, fe80::1%eth0, unknown"].into_iter(),
                &trusted
            ),
            ip("1.2.3.4")
        );
        // Ports and brackets.
        assert_eq!(
            client_ip(ip("127.0.0.1"), ["1.2.3.4:555"].into_iter(), &trusted),
            ip("1.2.3.4")
        );
        assert_eq!(
            client_ip(ip("127.0.0.1"), ["[2001:db8::1]:80"].into_iter(), &trusted),
            ip("2001:db8::1")
        );
        // Mapped forms are IPv4, including a mapped trusted proxy.
        assert_eq!(
            client_ip(
                ip("::ffff:127.0.0.1"),
                ["::ffff:1.2.3.4"].into_iter(),
                &trusted
            ),
            ip("1.2.3.4")
        );
        // All trusted: the leftmost.
        assert_eq!(
            client_ip(
                ip("127.0.0.1"),
                ["10.0.0.9, 10.0.0.2"].into_iter(),
                &trusted
            ),
            ip("10.0.0.9")
        );
        // No header: the peer.
        assert_eq!(
            client_ip(ip("127.0.0.1"), std::iter::empty(), &trusted),
            ip("127.0.0.1")
        );
    }

    #[test]
    fn ipv6_prefix_buckets() {
        let a = ClientAddr::new(ip("2001:db8:1:2:aaaa::1"), 64);
        let b = ClientAddr::new(ip("2001:db8:1:2:ffff::9"), 64);
        let c = ClientAddr::new(ip("2001:db8:1:3::1"), 64);
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_eq!(a.to_string(), "2001:db8:1:2::/64");
        assert_eq!(
            ClientAddr::new(ip("::ffff:9.9.9.9"), 64).to_string(),
            "9.9.9.9"
        );
    }

    #[test]
    fn presented_keys() {
        let none: [&[u8]; 0] = [];
        assert_eq!(
            presented_key([&b" k1 "[..]].into_iter(), none.into_iter()),
            Ok(Some(&b"k1"[..]))
        );
        assert_eq!(
            presented_key(none.into_iter(), [&b"Bearer k2"[..]].into_iter()),
            Ok(Some(&b"k2"[..]))
        );
        assert_eq!(
            presented_key(none.into_iter(), [&b"Basic abc"[..]].into_iter()),
            Ok(None)
        );
        assert_eq!(
            presented_key([&b"k1"[..]].into_iter(), [&b"bearer k1"[..]].into_iter()),
            Ok(Some(&b"k1"[..]))
        );
        assert_eq!(
            presented_key([&b"k1"[..], &b"k3"[..]].into_iter(), none.into_iter()),
            Err(KeyError::Conflicting)
        );
    }
}

#[cfg(test)]
mod fuzz {
    use std::net::IpAddr;

    use proptest::prelude::*;

    use super::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// Any X-Forwarded-For: no panic, and the answer is the peer or an
        /// address that really appears in the header.
        #[test]
        fn xff_never_invents_an_address(headers in prop::collection::vec("[0-9a-f:.,\\[\\] %]{0,60}", 0..4)) {
            let trusted: Vec<ipnet::IpNet> = vec!["127.0.0.0/8".parse().unwrap()];
            let peer: IpAddr = "127.0.0.1".parse().unwrap();
            let ip = client_ip(peer, headers.iter().map(String::as_str), &trusted);
            let appears = headers
                .iter()
                .flat_map(|h| h.split(','))
                .any(|e| parse_xff_entry(e).map(canonical) == Some(ip));
            prop_assert!(ip == peer || appears, "{headers:?} -> {ip}");
        }

        #[test]
        fn presented_keys_never_panic(a in any::<Vec<u8>>(), b in any::<Vec<u8>>()) {
            let _ = presented_key([a.as_slice()].into_iter(), [b.as_slice()].into_iter());
        }
    }
}
