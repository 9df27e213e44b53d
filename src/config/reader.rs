//! A typed reader over a spanned TOML tree that keeps going after a problem.
//!
//! serde stops at the first error; an operator fixing a config at 3 a.m. wants
//! every problem at once, each with its dotted key path and line. So the file is
//! parsed into toml's spanned tree and read key by key here: every getter either
//! returns a value or records why not, and every table reports its unknown keys.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::ops::Range;

use ipnet::IpNet;
use toml::de::{DeTable, DeValue};
use toml::Spanned;

use super::ConfigError;

pub type Value<'i> = Spanned<DeValue<'i>>;

/// Collects problems while a file is read; knows the source to turn spans into lines.
pub struct Reader<'s> {
    src: &'s str,
    pub errors: Vec<ConfigError>,
    /// Where each key that was read sits, for errors found after reading.
    pub spans: HashMap<String, Range<usize>>,
}

impl<'s> Reader<'s> {
    pub fn new(src: &'s str) -> Self {
        Reader {
            src,
            errors: Vec::new(),
            spans: HashMap::new(),
        }
    }

    pub fn line_of(&self, span: &Range<usize>) -> usize {
        let end = span.start.min(self.src.len());
        self.src.as_bytes()[..end]
            .iter()
            .filter(|&&b| b == b'\n')
            .count()
            + 1
    }

    pub fn error(&mut self, path: &str, span: Option<&Range<usize>>, message: impl Into<String>) {
        let line = span.map(|s| self.line_of(s));
        self.errors.push(ConfigError {
            path: path.to_string(),
            line,
            message: message.into(),
        });
    }

    /// Reports every key of `table` not in `allowed` (unknown keys are errors, not ignored).
    pub fn only_keys(&mut self, path: &str, table: &DeTable<'_>, allowed: &[&str]) {
        for (key, _) in table.iter() {
            if !allowed.contains(&key.get_ref().as_ref()) {
                let at = join(path, key.get_ref());
                let span = key.span();
                self.error(
                    &at,
                    Some(&span),
                    format!("unknown key; expected one of: {}", allowed.join(", ")),
                );
            }
        }
    }

    /// A sub-table, or an error naming what was found instead.
    pub fn table<'a, 'i>(&mut self, path: &str, v: &'a Value<'i>) -> Option<&'a DeTable<'i>> {
        match v.get_ref() {
            DeValue::Table(t) => Some(t),
            other => {
                self.mismatch(path, v, "a table", other);
                None
            }
        }
    }

    pub fn array<'a, 'i>(&mut self, path: &str, v: &'a Value<'i>) -> Option<&'a [Value<'i>]> {
        match v.get_ref() {
            DeValue::Array(a) => Some(&a[..]),
            other => {
                self.mismatch(path, v, "an array", other);
                None
            }
        }
    }

    /// A string value, with `${VAR}` and `${VAR:-default}` taken from the
    /// environment. A variable that is unset and has no default is a
    /// problem of its own (every one is listed); its value is never echoed.
    pub fn string(&mut self, path: &str, v: &Value<'_>) -> Option<String> {
        match v.get_ref() {
            DeValue::String(s) => match expand(s, |name| std::env::var(name).ok()) {
                Ok(out) => Some(out),
                Err(problems) => {
                    for p in problems {
                        self.error(path, Some(&v.span()), p);
                    }
                    None
                }
            },
            other => {
                self.mismatch(path, v, "a string", other);
                None
            }
        }
    }

    /// A file path: a non-empty string (the file itself is read later, on
    /// the machine that runs the gateway).
    pub fn file_path(&mut self, path: &str, v: &Value<'_>) -> Option<std::path::PathBuf> {
        let s = self.string(path, v)?;
        if s.is_empty() {
            self.error(path, Some(&v.span()), "expected a file path");
            return None;
        }
        Some(std::path::PathBuf::from(s))
    }

    pub fn boolean(&mut self, path: &str, v: &Value<'_>) -> Option<bool> {
        match v.get_ref() {
            DeValue::Boolean(b) => Some(*b),
            other => {
                self.mismatch(path, v, "true or false", other);
                None
            }
        }
    }

    /// An integer within `min..=max`.
    pub fn int(&mut self, path: &str, v: &Value<'_>, min: u64, max: u64) -> Option<u64> {
        let expected = if min == 0 && max == u64::MAX {
            "a non-negative integer".to_string()
        } else if min == 1 && max == u64::MAX {
            "a positive integer".to_string()
        } else {
            format!("an integer from {min} to {max}")
        };
        let n = match v.get_ref() {
            DeValue::Integer(i) => i64::from_str_radix(i.as_str(), i.radix()).ok(),
            other => {
                self.mismatch(path, v, &expected, other);
                return None;
            }
        };
        match n {
            Some(n) if n >= 0 && (n as u64) >= min && (n as u64) <= max => Some(n as u64),
            _ => {
                let found = describe(v.get_ref());
                self.error(
                    path,
                    Some(&v.span()),
                    format!("expected {expected}, found {found}"),
                );
                None
            }
        }
    }

    /// A number (integer or float) strictly greater than zero and finite.
    pub fn positive_number(&mut self, path: &str, v: &Value<'_>) -> Option<f64> {
        self.number_where(path, v, "a positive number", |n| n > 0.0)
    }

    /// A number (integer or float) from 0 to 1, both included.
    pub fn fraction(&mut self, path: &str, v: &Value<'_>) -> Option<f64> {
        self.number_where(path, v, "a number from 0 to 1", |n| {
            (0.0..=1.0).contains(&n)
        })
    }

    /// A finite number (integer or float) for which `ok` holds; else an
    /// error saying what was `expected`.
    fn number_where(
        &mut self,
        path: &str,
        v: &Value<'_>,
        expected: &str,
        ok: impl Fn(f64) -> bool,
    ) -> Option<f64> {
        let n = match v.get_ref() {
            DeValue::Integer(i) => i64::from_str_radix(i.as_str(), i.radix())
                .ok()
                .map(|n| n as f64),
            DeValue::Float(f) => f.as_str().replace('_', "").parse::<f64>().ok(),
            other => {
                self.mismatch(path, v, expected, other);
                return None;
            }
        };
        match n {
            Some(n) if n.is_finite() && ok(n) => Some(n),
            _ => {
                let found = describe(v.get_ref());
                self.error(
                    path,
                    Some(&v.span()),
                    format!("expected {expected}, found {found}"),
                );
                None
            }
        }
    }

    /// A string that must be one of `choices`.
    pub fn choice<T: Copy>(
        &mut self,
        path: &str,
        v: &Value<'_>,
        choices: &[(&str, T)],
    ) -> Option<T> {
        let names: Vec<String> = choices.iter().map(|(n, _)| format!("\"{n}\"")).collect();
        let expected = format!("one of {}", names.join(", "));
        match v.get_ref() {
            DeValue::String(_) => match self.string(path, v) {
                None => None,
                Some(s) => match choices.iter().find(|(n, _)| *n == s.as_str()) {
                    Some((_, t)) => Some(*t),
                    None => {
                        self.error(
                            path,
                            Some(&v.span()),
                            format!("expected {expected}, found \"{s}\""),
                        );
                        None
                    }
                },
            },
            other => {
                self.mismatch(path, v, &expected, other);
                None
            }
        }
    }

    /// An array of strings.
    pub fn strings(&mut self, path: &str, v: &Value<'_>) -> Option<Vec<(String, Range<usize>)>> {
        let items = self.array(path, v)?;
        let mut out = Vec::with_capacity(items.len());
        let mut ok = true;
        for (i, item) in items.iter().enumerate() {
            match self.string(&format!("{path}[{i}]"), item) {
                Some(s) => out.push((s, item.span())),
                None => ok = false,
            }
        }
        ok.then_some(out)
    }

    fn mismatch(&mut self, path: &str, v: &Value<'_>, expected: &str, found: &DeValue<'_>) {
        // `capacity = "${CAP}"` is a string: say why it is not expanded.
        let hint = match found {
            DeValue::String(s) if s.contains("${") => {
                "; ${VAR} is expanded inside strings only, so a number or a boolean cannot come from the environment"
            }
            _ => "",
        };
        let found = describe(found);
        self.error(
            path,
            Some(&v.span()),
            format!("expected {expected}, found {found}{hint}"),
        );
    }
}

/// `a.b` + `c` = `a.b.c`; the root path is empty.
/// Expands `${NAME}` and `${NAME:-default}` (NAME: `[A-Za-z_][A-Za-z0-9_]*`)
/// with `lookup`; every unset variable without a default, and every
/// malformed reference, is a problem.
pub fn expand(raw: &str, lookup: impl Fn(&str) -> Option<String>) -> Result<String, Vec<String>> {
    let mut out = String::with_capacity(raw.len());
    let mut problems = Vec::new();
    let mut rest = raw;
    while let Some(at) = rest.find("${") {
        out.push_str(&rest[..at]);
        let after = &rest[at + 2..];
        let Some(end) = after.find('}') else {
            problems.push("a \"${\" without its closing \"}\"".to_string());
            rest = "";
            break;
        };
        let inner = &after[..end];
        let (name, default) = match inner.split_once(":-") {
            Some((n, d)) => (n, Some(d)),
            None => (inner, None),
        };
        let valid = name
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !valid {
            problems.push(format!("\"${{{inner}}}\" is not a variable reference (expected ${{NAME}} or ${{NAME:-default}})"));
        } else {
            match (lookup(name), default) {
                (Some(v), _) => out.push_str(&v),
                (None, Some(d)) => out.push_str(d),
                (None, None) => problems.push(format!(
                    "environment variable {name} is not set and has no default (write ${{{name}:-default}} for one)"
                )),
            }
        }
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    if problems.is_empty() {
        Ok(out)
    } else {
        Err(problems)
    }
}

pub fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

/// How a found value is shown in an error: strings quoted, numbers as written.
fn describe(v: &DeValue<'_>) -> String {
    match v {
        DeValue::String(s) => format!("\"{s}\""),
        DeValue::Integer(i) => {
            if i.radix() == 10 {
                i.as_str().to_string()
            } else {
                format!("an integer in base {}", i.radix())
            }
        }
        DeValue::Float(f) => f.as_str().to_string(),
        DeValue::Boolean(b) => b.to_string(),
        DeValue::Datetime(d) => format!("a datetime ({d})"),
        DeValue::Array(_) => "an array".to_string(),
        DeValue::Table(_) => "a table".to_string(),
    }
}

// The typed helpers every section's reader uses (`opt`, `req`, lists,
// addresses, CIDRs, names): the readers' vocabulary, here so that the
// arrows run one way (file.rs reads the sections; the sections read these).

/// Reads an optional key with `read`, or returns `default` when it is absent.
/// `None` means the key was present but wrong (already reported).
pub(super) fn opt<T>(
    r: &mut Reader<'_>,
    t: &DeTable<'_>,
    path: &str,
    key: &str,
    default: T,
    read: impl FnOnce(&mut Reader<'_>, &str, &Value<'_>) -> Option<T>,
) -> Option<T> {
    match t.get(key) {
        Some(v) => {
            r.spans.insert(join(path, key), v.span());
            read(r, &join(path, key), v)
        }
        None => Some(default),
    }
}

/// Reads a required key, reporting its absence against the table's line.
pub(super) fn req<T>(
    r: &mut Reader<'_>,
    t: &DeTable<'_>,
    path: &str,
    span: Option<&Range<usize>>,
    key: &str,
    read: impl FnOnce(&mut Reader<'_>, &str, &Value<'_>) -> Option<T>,
) -> Option<T> {
    match t.get(key) {
        Some(v) => {
            r.spans.insert(join(path, key), v.span());
            read(r, &join(path, key), v)
        }
        None => {
            r.error(&join(path, key), span, "missing required key");
            None
        }
    }
}

/// Checks one string of a list (with its span); `None` once reported.
type CheckItem = fn(&mut Reader<'_>, &str, &(String, Range<usize>)) -> Option<String>;

/// A non-empty array of strings, each checked by `item` (every bad one reported).
pub(super) fn non_empty(
    r: &mut Reader<'_>,
    path: &str,
    v: &Value<'_>,
    what: &str,
    item: CheckItem,
) -> Option<Vec<String>> {
    let items = r.strings(path, v)?;
    if items.is_empty() {
        r.error(
            path,
            Some(&v.span()),
            format!("expected at least one {what}"),
        );
        return None;
    }
    let checked: Vec<Option<String>> = items
        .iter()
        .enumerate()
        .map(|(i, x)| item(r, &format!("{path}[{i}]"), x))
        .collect();
    checked.into_iter().collect()
}

pub(super) fn socket_addr(
    r: &mut Reader<'_>,
    path: &str,
    (s, span): &(String, Range<usize>),
) -> Option<String> {
    match s.parse::<SocketAddr>() {
        Ok(_) => Some(s.clone()),
        Err(_) => {
            r.error(
                path,
                Some(span),
                format!("expected an address like \"0.0.0.0:8080\", found \"{s}\""),
            );
            None
        }
    }
}

/// `host:port` where host may be a name (resolved when the gateway starts).
pub(super) fn host_port(
    r: &mut Reader<'_>,
    path: &str,
    (s, span): &(String, Range<usize>),
) -> Option<String> {
    let ok = match s.rsplit_once(':') {
        Some((host, port)) => {
            !host.is_empty()
                && port.parse::<u16>().is_ok_and(|p| p > 0)
                && (s.parse::<SocketAddr>().is_ok()
                    || host
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-'))
        }
        None => false,
    };
    if ok {
        Some(s.clone())
    } else {
        r.error(
            path,
            Some(span),
            format!("expected \"host:port\" (e.g. \"127.0.0.1:9001\"), found \"{s}\""),
        );
        None
    }
}

pub(super) fn cidrs(r: &mut Reader<'_>, path: &str, v: &Value<'_>) -> Option<Vec<IpNet>> {
    let items = r.strings(path, v)?;
    let mut out = Vec::new();
    let mut ok = true;
    for (i, (s, span)) in items.iter().enumerate() {
        // A bare address is a /32 (or /128): what an operator means by it.
        let parsed = s
            .parse::<IpNet>()
            .or_else(|_| s.parse::<std::net::IpAddr>().map(IpNet::from));
        match parsed {
            Ok(n) => out.push(n.trunc()),
            Err(_) => {
                ok = false;
                r.error(
                    &format!("{path}[{i}]"),
                    Some(span),
                    format!("expected a CIDR like \"10.0.0.0/8\" or an IP address, found \"{s}\""),
                );
            }
        }
    }
    ok.then_some(out)
}

/// Names that end up in metric labels and Redis keys: a closed, safe alphabet.
pub(super) fn name(r: &mut Reader<'_>, path: &str, v: &Value<'_>) -> Option<String> {
    let s = r.string(path, v)?;
    match super::rules::name(&s) {
        Ok(()) => Some(s),
        Err(e) => {
            r.error(path, Some(&v.span()), e);
            None
        }
    }
}

#[cfg(test)]
mod expand_tests {
    use super::expand;

    #[test]
    fn variables_defaults_and_problems() {
        let env = |n: &str| match n {
            "HOST" => Some("redis.internal".to_string()),
            "EMPTY" => Some(String::new()),
            _ => None,
        };
        assert_eq!(
            expand("redis://${HOST}:6379", env).unwrap(),
            "redis://redis.internal:6379"
        );
        assert_eq!(expand("${PORT:-6379}", env).unwrap(), "6379");
        assert_eq!(
            expand("${EMPTY:-x}", env).unwrap(),
            "",
            "set (even empty) wins"
        );
        assert_eq!(
            expand("no vars $HOST {x}", env).unwrap(),
            "no vars $HOST {x}"
        );
        let e = expand("${A}${B}", env).unwrap_err();
        assert_eq!(e.len(), 2, "every unset variable: {e:?}");
        assert!(
            e[0].starts_with("environment variable A is not set"),
            "{e:?}"
        );
        assert!(expand("${1X}", env).unwrap_err()[0].contains("not a variable reference"));
        assert!(expand("${HOST", env).unwrap_err()[0].contains("without its closing"));
    }
}
