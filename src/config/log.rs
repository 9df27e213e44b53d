//! `[log]`: the access log an operator can keep on during a surge.

use toml::de::DeTable;

use super::model::LogSettings;
use super::reader::opt;
use super::reader::Reader;

pub const LOG_KEYS: &[&str] = &["access", "refusals_per_sec"];

pub(super) fn read(r: &mut Reader<'_>, t: Option<&DeTable<'_>>) -> Option<LogSettings> {
    let p = "log";
    let empty = DeTable::new();
    let t = t.unwrap_or(&empty);
    r.only_keys(p, t, LOG_KEYS);
    let d = LogSettings::default();
    let access = opt(r, t, p, "access", d.access, |r, path, v| r.boolean(path, v));
    let refusals_per_sec = opt(
        r,
        t,
        p,
        "refusals_per_sec",
        d.refusals_per_sec,
        |r, path, v| r.int(path, v, 0, 1_000_000).map(|n| n as u32),
    );
    Some(LogSettings {
        access: access?,
        refusals_per_sec: refusals_per_sec?,
    })
}
