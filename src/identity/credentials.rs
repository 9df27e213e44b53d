//! The credentials a config names, read: every API key accepted
//! (`[[api_keys]]` and `clients.api_keys_file` in one set) and the signing
//! keys of each `[auth.jwt]` issuer that reads `key_files`.
//!
//! The config holds where they are; this room reads them, after the rest
//! of the file is sound (a key's plan must exist), at start, on `check` and
//! on every reload. A file that cannot be read is a problem of the config,
//! named with its key and line.

use std::path::Path;
use std::sync::Arc;

use crate::config::{self, Config, ConfigError, JwtKeys, KeyFacts, LoadError, OwnLimits};
use crate::identity::apikeys::{self, KeySet};
use crate::identity::jwt::keys::KeySet as JwtKeySet;

/// Whether the files a config names must be readable here. `run` and a
/// reload need them; `check` may run on another machine than the gateway,
/// so there a file it cannot open is a warning (as a certificate is), and
/// one it opens and refuses is a problem.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Files {
    Required,
    MayBeElsewhere,
}

/// What a config's credentials hold.
#[derive(Default)]
pub struct Credentials {
    pub keys: Arc<KeySet>,
    /// The keys of each `[[auth.jwt.issuers]]` entry that reads
    /// `key_files`, by the issuer's index (`None`: a JWKS endpoint).
    pub jwt_files: Vec<Option<Arc<JwtKeySet>>>,
    /// With `Files::MayBeElsewhere`: the files that could not be opened
    /// here, each with its key and line.
    pub unread: Vec<ConfigError>,
}

impl Credentials {
    /// Reads every file `config` names; every problem at once.
    pub fn read(config: &Config, files: Files) -> Result<Credentials, Vec<ConfigError>> {
        let mut errors = Vec::new();
        let mut unread = Vec::new();
        // A file `check` cannot open here is noted, not refused (`run` and
        // a reload read it once, in its loader, which names what is wrong).
        let mut elsewhere = |at: &str, path: &Path| match files {
            Files::Required => false,
            Files::MayBeElsewhere => match std::fs::File::open(path) {
                Err(e) => {
                    let why = format!(
                        "cannot read {}: {e}; `gateway run` refuses to start until it can be read",
                        path.display()
                    );
                    unread.push(config.error_at(at, why));
                    true
                }
                Ok(_) => false,
            },
        };
        let keys = match &config.clients.api_keys_file {
            Some(path) if elsewhere("clients.api_keys_file", path) => {
                KeySet::inline(&config.api_keys)
            }
            Some(path) => match apikeys::file::load(path, &config.api_keys, &config.plans) {
                Ok(set) => set,
                Err(e) => {
                    errors.push(config.error_at("clients.api_keys_file", e.to_string()));
                    KeySet::default()
                }
            },
            None => KeySet::inline(&config.api_keys),
        };
        let issuers = config.jwt.iter().flat_map(|j| j.issuers.iter());
        let jwt_files = issuers
            .enumerate()
            .map(|(i, issuer)| match &issuer.keys {
                JwtKeys::Url(_) => None,
                JwtKeys::Files { paths } => {
                    let at = format!("auth.jwt.issuers[{i}].key_files");
                    let sets: Vec<JwtKeySet> = paths
                        .iter()
                        .enumerate()
                        .filter_map(|(j, path)| {
                            let at = format!("{at}[{j}]");
                            if elsewhere(&at, path) {
                                return None;
                            }
                            match key_file(path) {
                                Ok(set) => Some(set),
                                Err(why) => {
                                    errors.push(config.error_at(&at, why));
                                    None
                                }
                            }
                        })
                        .collect();
                    Some(Arc::new(JwtKeySet::merge(sets)))
                }
            })
            .collect();
        if !errors.is_empty() {
            errors.sort_by_key(|e| e.line.unwrap_or(0));
            return Err(errors);
        }
        Ok(Credentials {
            keys: Arc::new(keys),
            jwt_files,
            unread,
        })
    }

    /// Whether any plan or key counts calendar quotas.
    pub fn has_quotas(&self, config: &Config) -> bool {
        config.plans_have_quotas() || self.keys.has_own_quotas()
    }
}

/// One JWT key file, read: a JWKS, or PEM keys. One with no key it can use
/// is refused, with what was skipped and why.
fn key_file(path: &Path) -> Result<JwtKeySet, String> {
    let file = path.display();
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read {file}: {e}"))?;
    match JwtKeySet::from_file_contents(&bytes) {
        Ok((set, skipped)) if set.is_empty() => Err(format!(
            "{file} holds no signing key {}",
            skipped.join("; ")
        )),
        Ok((set, _)) => Ok(set),
        Err(e) => Err(format!("{file}: {e}")),
    }
}

impl KeyFacts for Credentials {
    fn keys(&self) -> usize {
        self.keys.len()
    }

    fn keys_from_file(&self) -> usize {
        self.keys.from_file()
    }

    fn keys_per_plan(&self) -> std::collections::HashMap<String, usize> {
        let plans = self.keys.plans().iter().cloned();
        plans.zip(self.keys.per_plan()).collect()
    }

    fn jwt_file_keys(&self, issuer: usize) -> usize {
        self.jwt_files
            .get(issuer)
            .and_then(Option::as_ref)
            .map_or(0, |k| k.len())
    }

    fn each_with_own_limits(&self, f: &mut dyn FnMut(&OwnLimits<'_>) -> bool) {
        for k in self.keys.with_own_limits() {
            let own = OwnLimits {
                id: k.id,
                plan: k.plan,
                quotas: k.quotas,
                burst: k.burst,
            };
            if !f(&own) {
                return;
            }
        }
    }
}

/// Reads and validates a config file and the credentials it names;
/// `check` is run on `[server.tls]` as `config::load_checked` runs it.
pub fn load(
    path: &Path,
    check: Option<config::FileCheck<'_>>,
    files: Files,
) -> Result<(Config, Credentials), LoadError> {
    let config = match check {
        Some(check) => config::load_checked(path, check)?,
        None => config::load(path)?,
    };
    let credentials = Credentials::read(&config, files).map_err(|errors| LoadError::Invalid {
        path: path.to_path_buf(),
        errors,
    })?;
    Ok((config, credentials))
}

/// `config::parse` and the credentials it names: for tests and tools that
/// hold a config's text.
pub fn parse(src: &str) -> Result<(Config, Credentials), Vec<ConfigError>> {
    let config = config::parse(src)?;
    let credentials = Credentials::read(&config, Files::Required)?;
    Ok((config, credentials))
}
