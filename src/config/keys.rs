//! Every table of `gateway.toml` and the keys the reader accepts in it: the
//! `*_KEYS` list beside each `only_keys` call, gathered under the path the
//! configuration reference (`docs/reference/configuration.md`) names that
//! table by. The tests below hold the reference to this list both ways and
//! check that no reader lists its keys anywhere but in a registered const,
//! so a key the reader gains or loses cannot pass undocumented.

use super::{
    admin, auth, charge, clients, cors, file, inflight, limiter, limits, log, redis, routes,
    server, tls, traces, upstreams,
};

/// One table of the file: its path as the reference writes it, and the
/// lists (by their const's name) whose keys together it accepts.
pub struct Table {
    pub path: &'static str,
    pub lists: &'static [(&'static str, &'static [&'static str])],
}

impl Table {
    /// Every key this table accepts.
    pub fn keys(&self) -> impl Iterator<Item = &'static str> {
        self.lists.iter().flat_map(|(_, keys)| keys.iter().copied())
    }
}

macro_rules! table {
    ($path:literal => $($module:ident::$list:ident),+ $(,)?) => {
        Table { path: $path, lists: &[$((stringify!($list), $module::$list)),+] }
    };
}

/// The tables, in the reference's order. A limit table (`tiers.ip`, a
/// route's `limit` and each of its `limit_by_plan`) takes `limit`'s keys
/// and its algorithm's; a route's also `routes[].limit`'s. `quotas[]` is a
/// plan's or an API key's `quotas`; `cors` is `[cors]` or a route's `cors`.
pub const TABLES: &[Table] = &[
    table!("top" => file::ROOT_KEYS),
    table!("server" => server::SERVER_KEYS),
    table!("server.tls" => tls::TLS_KEYS),
    table!("server.tls.certificates[]" => tls::CERTIFICATE_KEYS),
    table!("admin" => admin::ADMIN_KEYS),
    table!("log" => log::LOG_KEYS),
    table!("tracing" => traces::TRACING_KEYS),
    table!("limiter" => limiter::LIMITER_KEYS),
    table!("limiter.leases" => limiter::LEASES_KEYS),
    table!("limiter.shares" => limiter::SHARES_KEYS),
    table!("redis" => redis::REDIS_KEYS),
    table!("clients" => clients::CLIENTS_KEYS),
    table!("auth" => auth::AUTH_KEYS),
    table!("auth.jwt" => auth::JWT_KEYS),
    table!("auth.jwt.issuers[]" => auth::ISSUER_KEYS),
    table!("tiers" => file::TIERS_KEYS),
    table!("limit" => limits::LIMIT_KEYS),
    table!("routes[].limit" => limits::ROUTE_LIMIT_KEYS),
    table!("limit.token_bucket" => limits::TOKEN_BUCKET_KEYS),
    table!("limit.leaky_bucket" => limits::LEAKY_BUCKET_KEYS),
    table!("limit.fixed_window" => limits::WINDOW_KEYS),
    table!("limit.sliding_window" => limits::WINDOW_KEYS),
    table!("limit.sliding_log" => limits::WINDOW_KEYS),
    table!("plans.NAME" => limits::PLAN_KEYS),
    table!("quotas[]" => limits::QUOTA_KEYS),
    table!("api_keys[]" => limits::API_KEY_KEYS),
    table!("upstreams[]" => upstreams::UPSTREAM_KEYS),
    table!("upstreams[].adaptive" => inflight::ADAPTIVE_KEYS),
    table!("routes[]" => routes::ROUTE_KEYS),
    table!("routes[].charge" => charge::CHARGE_KEYS),
    table!("cors" => cors::CORS_KEYS),
];

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};
    use std::path::Path;

    use super::TABLES;

    const REFERENCE: &str = "docs/reference/configuration.md";

    fn read(rel: &str) -> String {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(rel);
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    /// What the reference lists: a table whose header's first cell is `key`
    /// follows a `<!-- keys: PATH ... -->` line (the tables the reader has)
    /// or a `<!-- not-yet-accepted: PATH ... -->` line (keys the contract
    /// is gaining), and each of its rows names one key as a code span.
    #[derive(Default)]
    struct Listed {
        keys: BTreeMap<String, BTreeSet<String>>,
        not_yet: BTreeMap<String, BTreeSet<String>>,
        problems: Vec<String>,
    }

    fn marker(line: &str) -> Option<(bool, Vec<String>)> {
        let inner = line.strip_prefix("<!--")?.strip_suffix("-->")?.trim();
        let (accepted, paths) = match inner.split_once(':')? {
            ("keys", p) => (true, p),
            ("not-yet-accepted", p) => (false, p),
            _ => return None,
        };
        Some((
            accepted,
            paths.split_whitespace().map(String::from).collect(),
        ))
    }

    fn listed(md: &str) -> Listed {
        let mut out = Listed::default();
        // The marker waiting for its table, then the table being read.
        let mut pending: Option<(usize, (bool, Vec<String>))> = None;
        let mut current: Option<(bool, Vec<String>)> = None;
        let mut in_table = false;
        for (i, line) in md.lines().enumerate() {
            let n = i + 1;
            let line = line.trim();
            if let Some(m) = marker(line) {
                if let Some((at, _)) = pending.replace((n, m)) {
                    out.problems
                        .push(format!("line {at}: a keys marker with no table after it"));
                }
                continue;
            }
            let Some(row) = line.strip_prefix('|') else {
                in_table = false;
                current = None;
                if let (false, Some((at, _))) = (line.is_empty(), &pending) {
                    out.problems
                        .push(format!("line {at}: a keys marker with no table after it"));
                    pending = None;
                }
                continue;
            };
            let first = row.split('|').next().unwrap_or("").trim();
            if !in_table {
                in_table = true;
                current = match (first == "key", pending.take()) {
                    (true, Some((_, m))) => Some(m),
                    (true, None) => {
                        out.problems.push(format!(
                            "line {n}: a table of keys with no <!-- keys: PATH --> line above it"
                        ));
                        None
                    }
                    (false, Some((at, _))) => {
                        out.problems.push(format!(
                            "line {at}: a keys marker above a table whose first column is not `key`"
                        ));
                        None
                    }
                    (false, None) => None,
                };
                continue;
            }
            if first.chars().all(|c| matches!(c, '-' | ':')) {
                continue; // the header's separator
            }
            let Some((accepted, paths)) = &current else {
                continue;
            };
            let key = first.strip_prefix('`').and_then(|k| k.strip_suffix('`'));
            let Some(key) = key.filter(|k| !k.is_empty() && !k.contains('`')) else {
                out.problems.push(format!(
                    "line {n}: expected one key as a code span in the first cell, found {first:?}"
                ));
                continue;
            };
            let into = if *accepted {
                &mut out.keys
            } else {
                &mut out.not_yet
            };
            for p in paths {
                into.entry(p.clone()).or_default().insert(key.to_string());
            }
        }
        if let Some((at, _)) = pending {
            out.problems
                .push(format!("line {at}: a keys marker with no table after it"));
        }
        out
    }

    /// Every way the reference and the reader's tables disagree.
    fn disagreements(md: &str) -> Vec<String> {
        let mut listed = listed(md);
        let mut out = std::mem::take(&mut listed.problems);
        for t in TABLES {
            let accepted: BTreeSet<&str> = t.keys().collect();
            let Some(doc) = listed.keys.get(t.path) else {
                out.push(format!("{}: no table of its keys", t.path));
                continue;
            };
            let doc: BTreeSet<&str> = doc.iter().map(String::as_str).collect();
            let missing: Vec<&str> = accepted.difference(&doc).copied().collect();
            if !missing.is_empty() {
                out.push(format!(
                    "{}: accepted by the reader but not in the reference: {}",
                    t.path,
                    missing.join(", ")
                ));
            }
            let refused: Vec<&str> = doc.difference(&accepted).copied().collect();
            if !refused.is_empty() {
                out.push(format!(
                    "{}: in the reference but refused by the reader: {}",
                    t.path,
                    refused.join(", ")
                ));
            }
        }
        for path in listed.keys.keys() {
            if !TABLES.iter().any(|t| t.path == path) {
                out.push(format!("{path}: a table the reader does not have"));
            }
        }
        for (path, keys) in &listed.not_yet {
            let table = TABLES.iter().find(|t| t.path == path);
            let accepted: BTreeSet<&str> = table.map_or(BTreeSet::new(), |t| t.keys().collect());
            for k in keys.iter().filter(|k| accepted.contains(k.as_str())) {
                out.push(format!(
                    "{path}.{k}: listed as not yet accepted, but the reader accepts it: move it to the key tables"
                ));
            }
        }
        out
    }

    #[test]
    fn the_reference_lists_exactly_the_keys_the_reader_accepts() {
        let problems = disagreements(&read(REFERENCE));
        assert!(
            problems.is_empty(),
            "{REFERENCE} and the config reader (src/config/keys.rs) disagree:\n  {}",
            problems.join("\n  ")
        );
    }

    /// The check is not vacuous: the reference with one row dropped, or one
    /// row too many, fails, naming the key.
    #[test]
    fn a_key_dropped_from_or_added_to_the_reference_is_named() {
        let md = read(REFERENCE);
        let row = md
            .lines()
            .find(|l| l.trim_start().starts_with("| `refusals_per_sec` |"))
            .expect("the reference lists log.refusals_per_sec");
        let dropped = md.replacen(&format!("{row}\n"), "", 1);
        let problems = disagreements(&dropped);
        assert_eq!(
            problems,
            ["log: accepted by the reader but not in the reference: refusals_per_sec"],
            "{problems:#?}"
        );
        let added = md.replacen(
            &format!("{row}\n"),
            &format!("{row}\n| `colour` | string | none | reload | not a key |\n"),
            1,
        );
        let problems = disagreements(&added);
        assert_eq!(
            problems,
            ["log: in the reference but refused by the reader: colour"],
            "{problems:#?}"
        );
        let unmarked = "| key | type |\n|---|---|\n| `listen` | x |\n";
        assert_eq!(
            listed(unmarked).problems,
            ["line 1: a table of keys with no <!-- keys: PATH --> line above it"]
        );
    }

    /// Each reader lists its allowed keys in a registered const: an
    /// `only_keys` call whose list is written out in place, or a `*_KEYS`
    /// const missing from `TABLES`, would let a key escape the check above.
    #[test]
    fn every_allowed_list_is_a_registered_const() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/config");
        let registered: BTreeSet<&str> = TABLES
            .iter()
            .flat_map(|t| t.lists.iter().map(|(name, _)| *name))
            .collect();
        let mut calls = 0;
        let mut defined = BTreeSet::new();
        let mut problems = Vec::new();
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .expect("src/config")
            .map(|e| e.expect("entry").path())
            .filter(|p| p.extension().is_some_and(|x| x == "rs"))
            .collect();
        files.sort();
        for file in files {
            let src = std::fs::read_to_string(&file).expect("read");
            let name = file.file_name().unwrap().to_string_lossy().to_string();
            for line in src.lines() {
                let line = line.trim();
                if let Some(rest) = line.strip_prefix("pub const ") {
                    let ident = rest.split(':').next().unwrap_or("");
                    if ident.ends_with("_KEYS") {
                        defined.insert(ident.to_string());
                    }
                }
            }
            for (at, _) in src.match_indices("only_keys(") {
                if src[..at].ends_with("fn ") {
                    continue; // the definition, in reader.rs
                }
                calls += 1;
                let args = &src[at + "only_keys(".len()..];
                let args = &args[..args.find(");").unwrap_or(args.len())];
                // The third argument: the allowed keys.
                let allowed = args.splitn(3, ',').nth(2).unwrap_or("").trim();
                if allowed.contains('"') || allowed.contains('[') {
                    problems.push(format!(
                        "{name}: only_keys(..., {allowed}) lists its keys in place; hoist them into a registered *_KEYS const"
                    ));
                }
            }
        }
        for d in &defined {
            if !registered.contains(d.as_str()) {
                problems.push(format!("{d} is not in config::keys::TABLES"));
            }
        }
        assert!(
            calls >= 20,
            "found only {calls} only_keys calls in src/config"
        );
        assert_eq!(
            defined.len(),
            registered.len(),
            "{defined:?} against {registered:?}"
        );
        assert!(problems.is_empty(), "{}", problems.join("\n"));
    }
}
