//! `[clients]`: who the client is (trusted proxies, IPv6 prefix), who is
//! never limited or always refused, where the API key is read from, and
//! the file more keys are read from (read by the `identity` room), whether
//! the key goes on upstream, and where the runtime keys' snapshot is kept.

use toml::de::DeTable;

use super::model::Clients;
use super::reader::Reader;
use super::reader::{cidrs, opt};

/// `clients.runtime_keys_snapshot`: `true` (the default: a file in the
/// system's temporary directory named for the Redis it mirrors), `false`,
/// or a path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySnapshot {
    Auto,
    Off,
    At(std::path::PathBuf),
}

pub const CLIENTS_KEYS: &[&str] = &[
    "trusted_proxies",
    "ipv6_prefix_len",
    "allow",
    "deny",
    "api_key_header",
    "api_keys_file",
    "hide_credentials",
    "runtime_keys_snapshot",
];

pub(super) fn read(r: &mut Reader<'_>, t: Option<&DeTable<'_>>) -> Option<Clients> {
    let p = "clients";
    let empty = DeTable::new();
    let t = t.unwrap_or(&empty);
    r.only_keys(p, t, CLIENTS_KEYS);
    let trusted = opt(r, t, p, "trusted_proxies", vec![], cidrs);
    let v6 = opt(r, t, p, "ipv6_prefix_len", 64, |r, path, v| {
        r.int(path, v, 1, 128).map(|n| n as u8)
    });
    let allow = opt(r, t, p, "allow", vec![], cidrs);
    let deny = opt(r, t, p, "deny", vec![], cidrs);
    let header = opt(
        r,
        t,
        p,
        "api_key_header",
        "x-api-key".to_string(),
        |r, path, v| {
            let s = r.string(path, v)?;
            if http::HeaderName::from_bytes(s.as_bytes()).is_ok() {
                Some(s.to_ascii_lowercase())
            } else {
                r.error(
                    path,
                    Some(&v.span()),
                    format!("expected an HTTP header name, found \"{s}\""),
                );
                None
            }
        },
    );
    let keys_file = opt(r, t, p, "api_keys_file", None, |r, path, v| {
        r.file_path(path, v).map(Some)
    });
    let hide = opt(r, t, p, "hide_credentials", false, |r, path, v| {
        r.boolean(path, v)
    });
    let snapshot = opt(
        r,
        t,
        p,
        "runtime_keys_snapshot",
        KeySnapshot::Auto,
        |r, path, v| match v.get_ref() {
            toml::de::DeValue::Boolean(true) => Some(KeySnapshot::Auto),
            toml::de::DeValue::Boolean(false) => Some(KeySnapshot::Off),
            _ => r.file_path(path, v).map(KeySnapshot::At),
        },
    );
    Some(Clients {
        trusted_proxies: trusted?,
        ipv6_prefix_len: v6?,
        allow: allow?,
        deny: deny?,
        api_key_header: header?,
        api_keys_file: keys_file?,
        hide_credentials: hide?,
        runtime_keys_snapshot: snapshot?,
    })
}
