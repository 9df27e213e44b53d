//! Configuration: the file (`file`, read through `reader`) and the validated
//! model (`model`). The live snapshot the proxy reads per request, and its
//! reload, live in `proxy` (`Live`, `reload`): a reload swaps the policy, the
//! upstream pools and the metric handles together.

mod admin;
mod auth;
mod charge;
mod clients;
mod cors;
mod file;
mod inflight;
pub mod keys;
mod limiter;
mod limits;
mod log;
pub mod model;
mod reader;
mod redis;
mod routes;
pub mod rules;
mod server;
mod summary;
mod tls;
mod traces;
mod upstreams;
mod url;

use std::fmt::{self, Write as _};
use std::path::{Path, PathBuf};

pub use charge::{Charge, CostSource, Estimate, JsonPath};
pub use clients::KeySnapshot;
pub use model::*;
pub use traces::Resolved as TracingResolved;
pub use url::HttpUrl;

/// One problem in a config file: where it is and what was expected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// Dotted key path, e.g. `routes[2].limit.capacity`.
    pub path: String,
    pub line: Option<usize>,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(line) => write!(f, "{} (line {}): {}", self.path, line, self.message),
            None => write!(f, "{}: {}", self.path, self.message),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{} has {} problem(s):\n{}", path.display(), errors.len(), list(errors))]
    Invalid {
        path: PathBuf,
        errors: Vec<ConfigError>,
    },
}

fn list(errors: &[ConfigError]) -> String {
    errors.iter().fold(String::new(), |mut s, e| {
        let _ = writeln!(s, "  {e}");
        s
    })
}

/// Reads and validates a config file.
pub fn load(path: &Path) -> Result<Config, LoadError> {
    let src = std::fs::read_to_string(path).map_err(|source| LoadError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    parse(&src).map_err(|errors| LoadError::Invalid {
        path: path.to_path_buf(),
        errors,
    })
}

/// Validates config text; every problem is returned at once, ordered by line.
pub fn parse(src: &str) -> Result<Config, Vec<ConfigError>> {
    file::parse(src, None)
}

/// A check of what the file names rather than of its text (the TLS
/// certificates, which the `certs` room reads), run while the file is read so
/// that its problems are listed with the file's own, in one format.
pub type FileCheck<'a> = &'a dyn Fn(&TlsListeners) -> Vec<ConfigError>;

/// `load`, with `check` run on `[server.tls]` when that section is valid.
pub fn load_checked(path: &Path, check: FileCheck<'_>) -> Result<Config, LoadError> {
    let src = std::fs::read_to_string(path).map_err(|source| LoadError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    file::parse(&src, Some(check)).map_err(|errors| LoadError::Invalid {
        path: path.to_path_buf(),
        errors,
    })
}

impl Config {
    /// Whether any plan counts calendar quotas (a key may too: the
    /// `identity` room's key set knows).
    pub fn plans_have_quotas(&self) -> bool {
        self.plans.values().any(|p| !p.quotas.is_empty())
    }

    /// A problem found after the file was read (by the room that reads a
    /// file the config names), at `path`'s line.
    pub fn error_at(&self, path: &str, message: impl Into<String>) -> ConfigError {
        ConfigError {
            path: path.to_string(),
            line: self.lines.get(path).copied(),
            message: message.into(),
        }
    }

    /// What Redis keys and bucket names start with: `redis.key_prefix`,
    /// "rl" without a `[redis]` section.
    pub fn key_prefix(&self) -> &str {
        self.redis.as_ref().map_or("rl", |r| r.key_prefix.as_str())
    }
}

/// What the credentials a config names hold once read (the `identity` room
/// reads the keys file and the JWT key files): what `summary` and
/// `warnings` say of them.
pub trait KeyFacts {
    /// Keys accepted: `[[api_keys]]` and the keys file's.
    fn keys(&self) -> usize;
    fn keys_from_file(&self) -> usize;
    /// Keys by plan name, counted in one pass.
    fn keys_per_plan(&self) -> std::collections::HashMap<String, usize>;
    /// Signing keys read from the `key_files` of issuer `issuer` (its index).
    fn jwt_file_keys(&self, issuer: usize) -> usize;
    /// Calls `f` with each key that has limits of its own, until it
    /// returns false.
    fn each_with_own_limits(&self, f: &mut dyn FnMut(&OwnLimits<'_>) -> bool);
}

/// A key's own limits, as `KeyFacts` tells them.
pub struct OwnLimits<'a> {
    pub id: &'a str,
    pub plan: &'a str,
    pub quotas: Option<&'a [Quota]>,
    pub burst: Option<Burst>,
}

/// Whether the admin listener only takes loopback connections.
pub fn admin_loopback_only(srv: &Server) -> bool {
    srv.admin_listen
        .as_deref()
        .and_then(|a| a.parse::<std::net::SocketAddr>().ok())
        .is_some_and(|a| a.ip().is_loopback())
}

#[cfg(test)]
mod fuzz {
    use proptest::prelude::*;

    const DEMO: &str = include_str!("../../gateway.toml");

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        /// Arbitrary text: an error list or a config, never a panic.
        #[test]
        fn any_text_is_answered(src in any::<String>()) {
            if let Err(errors) = super::parse(&src) {
                prop_assert!(!errors.is_empty());
            }
        }

        /// The demo config with one line replaced by something else: every
        /// error names a key path (or the syntax), never a panic.
        #[test]
        fn mutated_demo_configs_are_answered(line in 0usize..140, junk in "[a-z_\\[\\]=\" 0-9.{},-]{0,30}") {
            let mut lines: Vec<&str> = DEMO.lines().collect();
            let i = line % lines.len();
            lines[i] = &junk;
            let src = lines.join("\n");
            if let Err(errors) = super::parse(&src) {
                for e in errors {
                    prop_assert!(!e.path.is_empty() && !e.message.is_empty(), "{e}");
                }
            }
        }
    }
}
