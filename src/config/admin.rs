//! `[admin]`: who may change state through the admin listener, and
//! whether it keeps the top-K of refused clients (`/top`).

use toml::de::DeTable;

use super::model::{AdminSettings, Secret};
use super::reader::opt;
use super::reader::Reader;

/// A token shorter than this is refused: it guards bucket resets.
const MIN_TOKEN_BYTES: usize = 16;

pub const ADMIN_KEYS: &[&str] = &["token", "top"];

pub(super) fn read(r: &mut Reader<'_>, t: Option<&DeTable<'_>>) -> Option<AdminSettings> {
    let p = "admin";
    let empty = DeTable::new();
    let t = t.unwrap_or(&empty);
    r.only_keys(p, t, ADMIN_KEYS);
    // A secret: the errors say its length, never its text.
    let token = opt(r, t, p, "token", None, |r, path, v| {
        let token = r.string(path, v)?;
        if token.len() < MIN_TOKEN_BYTES {
            r.error(
                path,
                Some(&v.span()),
                format!(
                    "expected a token of at least {MIN_TOKEN_BYTES} bytes, found {} (try `openssl rand -hex 24`)",
                    token.len()
                ),
            );
            return None;
        }
        Some(Some(Secret(token)))
    })?;
    let top = opt(r, t, p, "top", true, |r, path, v| r.boolean(path, v))?;
    Some(AdminSettings { token, top })
}
