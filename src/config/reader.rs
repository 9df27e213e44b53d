//! A typed reader over a spanned TOML tree that keeps going after a problem.
//!
//! serde stops at the first error; an operator fixing a config at 3 a.m. wants
//! every problem at once, each with its dotted key path and line. So the file is
//! parsed into toml's spanned tree and read key by key here: every getter either
//! returns a value or records why not, and every table reports its unknown keys.

use std::collections::HashMap;
use std::ops::Range;

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

    pub fn string(&mut self, path: &str, v: &Value<'_>) -> Option<String> {
        match v.get_ref() {
            DeValue::String(s) => Some(s.to_string()),
            other => {
                self.mismatch(path, v, "a string", other);
                None
            }
        }
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
        let n = match v.get_ref() {
            DeValue::Integer(i) => i64::from_str_radix(i.as_str(), i.radix())
                .ok()
                .map(|n| n as f64),
            DeValue::Float(f) => f.as_str().replace('_', "").parse::<f64>().ok(),
            other => {
                self.mismatch(path, v, "a positive number", other);
                return None;
            }
        };
        match n {
            Some(n) if n.is_finite() && n > 0.0 => Some(n),
            _ => {
                let found = describe(v.get_ref());
                self.error(
                    path,
                    Some(&v.span()),
                    format!("expected a positive number, found {found}"),
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
            DeValue::String(s) => match choices.iter().find(|(n, _)| *n == s.as_ref()) {
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
        let found = describe(found);
        self.error(
            path,
            Some(&v.span()),
            format!("expected {expected}, found {found}"),
        );
    }
}

/// `a.b` + `c` = `a.b.c`; the root path is empty.
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
