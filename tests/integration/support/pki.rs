//! Certificates for TLS tests, made with the `openssl` CLI in a temp dir:
//! a CA and the leaf certificates it signs.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A CA and leaf certificates it signs, in a temp dir.
pub struct Pki {
    dir: tempfile::TempDir,
}

/// Runs the `openssl` CLI in `dir`, failing the test with its stderr.
pub fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .expect("openssl (scripts/setup.sh installs it)");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Pki {
    pub fn new() -> Self {
        Pki {
            dir: tempfile::tempdir().expect("temp dir"),
        }
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// A self-signed CA `name`.crt / `name`.key.
    pub fn ca(&self, name: &str) {
        openssl(
            self.dir.path(),
            &[
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-days",
                "2",
                "-subj",
                &format!("/CN={name}"),
                "-keyout",
                &format!("{name}.key"),
                "-out",
                &format!("{name}.crt"),
            ],
        );
    }

    /// A leaf `file`.crt / `file`.key for `names` (subjectAltName: DNS names,
    /// or `IP:` addresses), signed by `ca`.
    pub fn leaf(&self, ca: &str, file: &str, names: &[&str]) {
        let san: Vec<String> = names
            .iter()
            .map(|n| match n.starts_with("IP:") {
                true => n.to_string(),
                false => format!("DNS:{n}"),
            })
            .collect();
        fs::write(
            self.path(&format!("{file}.ext")),
            format!("subjectAltName={}\n", san.join(",")),
        )
        .expect("ext file");
        openssl(
            self.dir.path(),
            &[
                "req",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-subj",
                &format!("/CN={}", names[0]),
                "-keyout",
                &format!("{file}.key"),
                "-out",
                &format!("{file}.csr"),
            ],
        );
        openssl(
            self.dir.path(),
            &[
                "x509",
                "-req",
                "-in",
                &format!("{file}.csr"),
                "-CA",
                &format!("{ca}.crt"),
                "-CAkey",
                &format!("{ca}.key"),
                "-CAcreateserial",
                "-days",
                "2",
                "-extfile",
                &format!("{file}.ext"),
                "-out",
                &format!("{file}.crt"),
            ],
        );
    }
}
