//! TLS certificates for the listeners: read from their files, chosen by SNI,
//! and re-read when the files change (Kubernetes swaps a mounted secret by
//! symlink; cert-manager renews in place), without a restart.
//!
//! The first configured certificate is the default; each of the others
//! serves the DNS names its certificate carries (subjectAltName, exact or
//! `*.example.com` for one label). A reload that finds any file unreadable
//! or invalid keeps the certificates in use and says what is wrong.

use std::fmt;
use std::sync::Arc;

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use crate::config::CertificateFiles;

/// What is wrong with one configured certificate, named by its key path.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{key_path} (line {line}): {problem}")]
pub struct CertError {
    pub key_path: String,
    pub line: usize,
    pub problem: String,
    /// The file could not be read at all (as opposed to read and refused).
    pub unreadable: bool,
}

/// One certificate chain with its key, and the names it serves.
struct Entry {
    key: Arc<CertifiedKey>,
    names: Vec<String>,
}

struct Loaded {
    entries: Vec<Entry>,
    /// The files' bytes, to notice a change.
    content: Vec<Vec<u8>>,
}

pub struct Certificates {
    files: Vec<CertificateFiles>,
    current: ArcSwap<Loaded>,
    reloading: Mutex<()>,
}

impl fmt::Debug for Certificates {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Certificates")
            .field("certificates", &self.files.len())
            .finish()
    }
}

impl Certificates {
    /// Reads every configured certificate; any problem is an error.
    pub fn load(files: &[CertificateFiles]) -> Result<Self, CertError> {
        let loaded = read_all(files)?;
        Ok(Certificates {
            files: files.to_vec(),
            current: ArcSwap::from_pointee(loaded),
            reloading: Mutex::new(()),
        })
    }

    /// The names each certificate serves, in configured order.
    pub fn names(&self) -> Vec<Vec<String>> {
        self.current
            .load()
            .entries
            .iter()
            .map(|e| e.names.clone())
            .collect()
    }

    /// Re-reads the files; swaps in the new certificates if any file changed
    /// and all of them are valid. `Ok(true)`: swapped.
    pub fn reload(&self) -> Result<bool, CertError> {
        let _one = self.reloading.lock();
        let content = read_bytes(&self.files)?;
        if content == self.current.load().content {
            return Ok(false);
        }
        let loaded = parse_all(&self.files, content)?;
        self.current.store(Arc::new(loaded));
        Ok(true)
    }

    fn select(&self, sni: Option<&str>) -> Option<Arc<CertifiedKey>> {
        let loaded = self.current.load();
        let default = loaded.entries.first().map(|e| e.key.clone());
        let Some(sni) = sni else { return default };
        let sni = sni.trim_end_matches('.').to_ascii_lowercase();
        let wildcard = sni.split_once('.').map(|(_, rest)| format!("*.{rest}"));
        // Exact names first, then a wildcard covering one label.
        let exact = loaded.entries.iter().find(|e| e.names.contains(&sni));
        let wild = || {
            let w = wildcard.as_ref()?;
            loaded.entries.iter().find(|e| e.names.contains(w))
        };
        exact.or_else(wild).map(|e| e.key.clone()).or(default)
    }
}

impl ResolvesServerCert for Certificates {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.select(hello.server_name())
    }
}

/// Every problem of every configured certificate, for `gateway check` and
/// start-up to list beside the file's own (`config::load_checked`). Files
/// that cannot be read are listed only when `unreadable_too`: `check` may
/// run on a machine that does not hold them.
pub fn problems(
    files: &[CertificateFiles],
    unreadable_too: bool,
) -> Vec<crate::config::ConfigError> {
    files
        .iter()
        .filter_map(|f| read_all(std::slice::from_ref(f)).err())
        .filter(|e| unreadable_too || !e.unreadable)
        .map(|e| crate::config::ConfigError {
            path: e.key_path,
            line: Some(e.line),
            message: e.problem,
        })
        .collect()
}

fn problem(f: &CertificateFiles, what: impl Into<String>) -> CertError {
    CertError {
        key_path: f.key_path.clone(),
        line: f.line,
        problem: what.into(),
        unreadable: false,
    }
}

/// Each certificate's files, cert then key, as bytes.
fn read_bytes(files: &[CertificateFiles]) -> Result<Vec<Vec<u8>>, CertError> {
    let mut out = Vec::with_capacity(files.len() * 2);
    for f in files {
        for path in [&f.cert_file, &f.key_file] {
            let bytes = std::fs::read(path).map_err(|e| CertError {
                unreadable: true,
                ..problem(f, format!("cannot read {}: {e}", path.display()))
            })?;
            out.push(bytes);
        }
    }
    Ok(out)
}

fn read_all(files: &[CertificateFiles]) -> Result<Loaded, CertError> {
    let content = read_bytes(files)?;
    parse_all(files, content)
}

fn parse_all(files: &[CertificateFiles], content: Vec<Vec<u8>>) -> Result<Loaded, CertError> {
    let entries = files
        .iter()
        .zip(content.chunks(2))
        .map(|(f, pair)| parse_one(f, &pair[0], &pair[1]))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Loaded { entries, content })
}

fn parse_one(f: &CertificateFiles, cert_pem: &[u8], key_pem: &[u8]) -> Result<Entry, CertError> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<_, _>>()
        .map_err(|e| {
            problem(
                f,
                format!(
                    "{}: not a PEM certificate chain ({e})",
                    f.cert_file.display()
                ),
            )
        })?;
    if chain.is_empty() {
        return Err(problem(
            f,
            format!("{}: no certificate found", f.cert_file.display()),
        ));
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| {
        problem(
            f,
            format!("{}: no private key found ({e})", f.key_file.display()),
        )
    })?;
    let signer = rustls::crypto::ring::sign::any_supported_type(&key).map_err(|e| {
        problem(
            f,
            format!("{}: unsupported private key ({e})", f.key_file.display()),
        )
    })?;
    let names =
        dns_names(&chain[0]).map_err(|e| problem(f, format!("{}: {e}", f.cert_file.display())))?;
    let certified = CertifiedKey::new(chain, signer);
    certified.keys_match().map_err(|_| {
        problem(
            f,
            format!(
                "{} does not belong to the certificate in {}",
                f.key_file.display(),
                f.cert_file.display()
            ),
        )
    })?;
    Ok(Entry {
        key: Arc::new(certified),
        names,
    })
}

/// The DNS names a certificate serves: its subjectAltName entries, else its
/// common name; lower-cased.
fn dns_names(cert: &CertificateDer<'_>) -> Result<Vec<String>, String> {
    use x509_parser::extensions::GeneralName;
    let (_, x509) = x509_parser::parse_x509_certificate(cert.as_ref())
        .map_err(|e| format!("not an X.509 certificate ({e})"))?;
    let mut names: Vec<String> = match x509.subject_alternative_name() {
        Ok(Some(san)) => san
            .value
            .general_names
            .iter()
            .filter_map(|n| match n {
                GeneralName::DNSName(d) => Some(d.to_ascii_lowercase()),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    };
    if names.is_empty() {
        names = x509
            .subject()
            .iter_common_name()
            .filter_map(|cn| cn.as_str().ok().map(str::to_ascii_lowercase))
            .collect();
    }
    Ok(names)
}
