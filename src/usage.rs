//! Usage for billing: each API key's `used` of one quota period, as
//! `gateway usage` and the admin `GET /usage` give it (CSV or JSON lines).
//!
//! A quota's count lives in Redis under a key named by the period's start
//! (`keys.rs`), so a period, current or ended, is found by one SCAN pattern
//! and read a thousand keys a page: Redis keeps serving between pages.
//! An ended period is there for `limiter.quota_retention_days` after its
//! end. Only keys that made a request in the period have a row.
//!
//! `used` is what Redis has debited: exactly what was admitted once this
//! replica set's leases are back (within a lease period and a quarter of
//! the last request; at once after a graceful stop or a reload).

use std::collections::HashMap;
use std::fmt::Write;

use chrono::{DateTime, NaiveDate, NaiveTime, TimeZone, Utc};
use chrono_tz::Tz;

use crate::calendar::{self, Period, Span};
use crate::config::{Algorithm, Config};
use crate::identity::apikeys::{KeyRef, KeySet};
use crate::limiter::keys::{rule_prefix, unescape};
use crate::limiter::{Micros, RedisBackend};

/// One key's use of the period.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    pub id: String,
    pub used: u64,
    /// The key's quota for the period as configured now (`None`: the key
    /// or its quota is no longer in the config).
    pub limit: Option<u64>,
}

#[derive(Debug, Clone)]
pub struct Report {
    pub period: Period,
    pub span: Span,
    pub zone: Tz,
    pub rows: Vec<Row>,
}

/// Output formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Csv,
    JsonLines,
}

impl Format {
    pub fn parse(s: &str) -> Result<Format, String> {
        match s {
            "csv" => Ok(Format::Csv),
            "jsonl" | "json" => Ok(Format::JsonLines),
            other => Err(format!(
                "format \"{other}\" is not one of \"csv\", \"jsonl\""
            )),
        }
    }

    pub fn content_type(self) -> &'static str {
        match self {
            Format::Csv => "text/csv",
            Format::JsonLines => "application/jsonl",
        }
    }
}

/// What `gateway usage` and `GET /usage` are asked: a period (the one
/// `at` falls in) and a format.
#[derive(Debug, Clone, Copy)]
pub struct Question {
    pub period: Period,
    pub at: Micros,
    pub format: Format,
}

impl Question {
    /// From the words of a command line or a query: `at` is read in
    /// `zone`, and defaults to now.
    pub fn parse(period: &str, at: Option<&str>, format: &str, zone: Tz) -> Result<Self, String> {
        Ok(Question {
            period: parse_period(period)?,
            format: Format::parse(format)?,
            at: match at {
                Some(a) => parse_at(a, zone)?,
                None => crate::clock::Clock::now_us(&crate::clock::SystemClock),
            },
        })
    }
}

pub fn parse_period(s: &str) -> Result<Period, String> {
    Period::ALL
        .iter()
        .find(|(name, _)| *name == s)
        .map(|(_, p)| *p)
        .ok_or_else(|| {
            format!(
                "period \"{s}\" is not one of \"minute\", \"hour\", \"day\", \"week\", \"month\""
            )
        })
}

/// An instant of the period wanted: a date (`2026-10-15`, noon in `zone`,
/// clear of any DST gap) or an RFC 3339 time.
pub fn parse_at(s: &str, zone: Tz) -> Result<Micros, String> {
    if let Ok(d) = NaiveDate::parse_from_str(s, "%Y-%m-%d") {
        let noon = d.and_time(NaiveTime::from_hms_opt(12, 0, 0).unwrap_or_default());
        return zone
            .from_local_datetime(&noon)
            .earliest()
            .map(|t| t.timestamp_micros())
            .ok_or_else(|| format!("{s}: not a time in {}", zone.name()));
    }
    DateTime::parse_from_rfc3339(s)
        .map(|t| t.timestamp_micros())
        .map_err(|_| {
            format!(
                "at \"{s}\" is not a date (2026-10-15) or an RFC 3339 time (2026-10-15T12:00:00Z)"
            )
        })
}

/// The SCAN pattern of a period's quota counts: the rule prefix
/// `quota_checks` names them with, any identity.
pub fn pattern(key_prefix: &str, period: Period, span: Span) -> String {
    format!("{}*", period_prefix(key_prefix, period, span))
}

fn period_prefix(key_prefix: &str, period: Period, span: Span) -> String {
    let alg = Algorithm::Calendar {
        limit: 1,
        period,
        start: span.start,
        end: span.end,
    };
    rule_prefix(key_prefix, "quota", period.as_str(), &alg)
}

/// The count a stored quota state holds for the period ending at `end`
/// ("end count", as `limiter.lua` writes it).
pub fn count_of(raw: &str, end: Micros) -> Option<u64> {
    let (e, count) = raw.split_once(' ')?;
    (e.parse::<i64>().ok()? == end)
        .then(|| count.parse().ok())
        .flatten()
}

/// The key's quota for `period`: its own, else its plan's.
fn limit_of(config: &Config, key: &KeyRef<'_>, period: Period) -> Option<u64> {
    let quotas = match key.quotas {
        Some(q) => q,
        None => config.plans.get(key.plan)?.quotas.as_slice(),
    };
    quotas.iter().find(|q| q.period == period).map(|q| q.limit)
}

/// The rows of a period from what a SCAN found, less what dead holders'
/// expired leases give back (`reclaimable`, by bucket).
pub fn rows(
    config: &Config,
    keys: &KeySet,
    period: Period,
    span: Span,
    found: Vec<(String, Option<String>)>,
    reclaimable: &HashMap<String, u64>,
) -> Vec<Row> {
    let prefix = format!("{}k:", period_prefix(config.key_prefix(), period, span));
    let mut rows: Vec<Row> = found
        .into_iter()
        .filter_map(|(key, value)| {
            let back = reclaimable.get(&key).copied().unwrap_or(0);
            let id = unescape(key.strip_prefix(&prefix)?)?;
            let used = count_of(&value?, span.end)?.saturating_sub(back);
            Some(Row {
                id,
                used,
                limit: None,
            })
        })
        .collect();
    rows.sort_by(|a, b| a.id.cmp(&b.id));
    // Each row's limit in one pass over the keys (maybe a million), with a
    // map of the rows' ids only, not of every key.
    let at: HashMap<String, usize> = rows
        .iter()
        .enumerate()
        .map(|(i, r)| (r.id.clone(), i))
        .collect();
    for k in keys.iter() {
        if let Some(&i) = at.get(k.id) {
            rows[i].limit = limit_of(config, &k, period);
        }
    }
    rows
}

/// Reads a period's usage from Redis.
pub async fn collect(
    redis: &RedisBackend,
    config: &Config,
    keys: &KeySet,
    q: &Question,
) -> Result<Report, String> {
    let (zone, period) = (config.limiter.quota_time_zone, q.period);
    let span = calendar::span(period, zone, q.at);
    let pattern = pattern(config.key_prefix(), period, span);
    let redact = |e: crate::limiter::LimiterError| redis.redact(&e.to_string());
    let found = redis.scan_values(&pattern).await.map_err(redact)?;
    let back = redis.reclaimable(&pattern).await.map_err(redact)?;
    Ok(Report {
        period,
        span,
        zone,
        rows: rows(config, keys, period, span, found, &back),
    })
}

fn time(t: Micros, zone: Tz) -> String {
    DateTime::<Utc>::from_timestamp_micros(t)
        .unwrap_or_default()
        .with_timezone(&zone)
        .to_rfc3339()
}

/// A CSV field, quoted when it must be (RFC 4180).
fn field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

pub fn render(report: &Report, format: Format) -> String {
    let (start, end) = (
        time(report.span.start, report.zone),
        time(report.span.end, report.zone),
    );
    let period = report.period.as_str();
    let mut out = String::new();
    match format {
        Format::Csv => {
            out.push_str("key,period,start,end,used,limit\n");
            for r in &report.rows {
                let limit = r.limit.map(|l| l.to_string()).unwrap_or_default();
                let _ = writeln!(
                    out,
                    "{},{period},{start},{end},{},{limit}",
                    field(&r.id),
                    r.used
                );
            }
        }
        Format::JsonLines => {
            for r in &report.rows {
                let line = serde_json::json!({
                    "key": r.id,
                    "period": period,
                    "start": start,
                    "end": end,
                    "used": r.used,
                    "limit": r.limit,
                });
                let _ = writeln!(out, "{line}");
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_date_is_noon_in_the_zone_and_a_time_is_itself() {
        let tz: Tz = "Asia/Kolkata".parse().unwrap();
        let at = parse_at("2026-10-15", tz).unwrap();
        assert_eq!(time(at, tz), "2026-10-15T12:00:00+05:30");
        let t = parse_at("2026-10-15T00:00:00Z", tz).unwrap();
        assert_eq!(time(t, chrono_tz::UTC), "2026-10-15T00:00:00+00:00");
        assert!(parse_at("15/10/2026", tz).unwrap_err().contains("RFC 3339"));
        assert!(parse_period("year").unwrap_err().contains("\"month\""));
    }

    #[test]
    fn the_pattern_finds_one_periods_keys_and_their_ids() {
        let tz = chrono_tz::UTC;
        let at = parse_at("2026-10-15", tz).unwrap();
        let span = calendar::span(Period::Month, tz, at);
        let p = pattern("rl", Period::Month, span);
        assert_eq!(
            p,
            format!("rl:quota:month:q-month-{}:*", span.start / 1_000_000)
        );
        assert_eq!(count_of(&format!("{} 42", span.end), span.end), Some(42));
        assert_eq!(count_of(&format!("{} 42", span.end - 1), span.end), None);
    }

    #[test]
    fn csv_quotes_what_it_must() {
        let report = Report {
            period: Period::Day,
            span: Span {
                start: 0,
                end: 86_400_000_000,
            },
            zone: chrono_tz::UTC,
            rows: vec![
                Row {
                    id: "a,b".into(),
                    used: 3,
                    limit: Some(5),
                },
                Row {
                    id: "c".into(),
                    used: 1,
                    limit: None,
                },
            ],
        };
        assert_eq!(
            render(&report, Format::Csv),
            "key,period,start,end,used,limit\n\"a,b\",day,1970-01-01T00:00:00+00:00,1970-01-02T00:00:00+00:00,3,5\nc,day,1970-01-01T00:00:00+00:00,1970-01-02T00:00:00+00:00,1,\n"
        );
        let lines = render(&report, Format::JsonLines);
        let first: serde_json::Value = serde_json::from_str(lines.lines().next().unwrap()).unwrap();
        assert_eq!(
            (first["key"].as_str(), first["used"].as_u64()),
            (Some("a,b"), Some(3))
        );
    }
}
