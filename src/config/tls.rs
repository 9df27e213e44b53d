//! `[server.tls]`: TLS listeners and their certificates.
//!
//! Only the shape is checked here (addresses, a non-empty list of cert/key
//! file pairs); the files themselves are read when the gateway starts and
//! whenever they change (the `certs` room), so a file that `check` cannot read
//! on the machine it runs on is not a problem of the file's text.

use std::ops::Range;

use toml::de::DeTable;

use super::model::{CertificateFiles, TlsListeners};
use super::reader::Reader;
use super::reader::{non_empty, req, socket_addr};

pub const TLS_KEYS: &[&str] = &["listen", "certificates"];
pub const CERTIFICATE_KEYS: &[&str] = &["cert_file", "key_file"];

/// The section, or `None` once a problem has been reported.
pub fn read(r: &mut Reader<'_>, t: &DeTable<'_>, span: &Range<usize>) -> Option<TlsListeners> {
    let p = "server.tls";
    r.only_keys(p, t, TLS_KEYS);
    let listen = req(r, t, p, Some(span), "listen", |r, path, v| {
        non_empty(r, path, v, "listen address", socket_addr)
    });
    let certificates = req(r, t, p, Some(span), "certificates", |r, path, v| {
        let items = r.array(path, v)?;
        if items.is_empty() {
            r.error(
                path,
                Some(&v.span()),
                "expected at least one { cert_file, key_file }",
            );
            return None;
        }
        let read: Vec<Option<CertificateFiles>> = items
            .iter()
            .enumerate()
            .map(|(i, item)| {
                let at = format!("{path}[{i}]");
                let ct = r.table(&at, item)?;
                r.only_keys(&at, ct, CERTIFICATE_KEYS);
                let file = |r: &mut Reader<'_>, key: &str| {
                    req(r, ct, &at, Some(&item.span()), key, |r, path, v| {
                        r.file_path(path, v)
                    })
                };
                let (cert_file, key_file) = (file(r, "cert_file"), file(r, "key_file"));
                Some(CertificateFiles {
                    cert_file: cert_file?,
                    key_file: key_file?,
                    line: r.line_of(&item.span()),
                    key_path: at,
                })
            })
            .collect();
        read.into_iter().collect::<Option<Vec<_>>>()
    });
    Some(TlsListeners {
        listen: listen?,
        certificates: certificates?,
    })
}
