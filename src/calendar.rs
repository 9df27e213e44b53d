//! Calendar periods for quotas: the minute, hour, day, ISO week (from
//! Monday) or month an instant falls in, bounded by the local calendar of
//! an IANA time zone (`limiter.quota_time_zone`).
//!
//! A period starts at its local boundary (midnight, the first of the month,
//! ...) and ends where the next one starts, so a day across a DST change is
//! 23 or 25 hours long and a month is as long as it is. A boundary that falls
//! in a DST gap (a local time that does not exist) is the first instant
//! after the gap; a boundary on a repeated local time is its first
//! occurrence. Pure functions of the instant: the caller holds the clock.

use chrono::{DateTime, Datelike, Duration, LocalResult, NaiveDate, NaiveDateTime, TimeZone, Utc};
use chrono_tz::Tz;

pub use crate::clock::Micros;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Period {
    Minute,
    Hour,
    Day,
    Week,
    Month,
}

impl Period {
    pub const ALL: [(&'static str, Period); 5] = [
        ("minute", Period::Minute),
        ("hour", Period::Hour),
        ("day", Period::Day),
        ("week", Period::Week),
        ("month", Period::Month),
    ];

    /// The period's shortest length in seconds (a DST day: 23 hours; a
    /// February: 28 days).
    pub fn as_secs_at_least(self) -> u64 {
        match self {
            Period::Minute => 60,
            Period::Hour => 3600,
            Period::Day => 23 * 3600,
            Period::Week => 7 * 86400 - 3600,
            Period::Month => 28 * 86400 - 3600,
        }
    }

    /// Its longest.
    pub fn as_secs_at_most(self) -> u64 {
        match self {
            Period::Minute => 60,
            Period::Hour => 3600,
            Period::Day => 25 * 3600,
            Period::Week => 7 * 86400 + 3600,
            Period::Month => 31 * 86400 + 3600,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Period::Minute => "minute",
            Period::Hour => "hour",
            Period::Day => "day",
            Period::Week => "week",
            Period::Month => "month",
        }
    }

    /// Its nominal length in seconds (a day is 86,400 even when DST makes
    /// it 23 or 25 hours): the `w` of a `RateLimit-Policy`.
    pub fn nominal_secs(self) -> u64 {
        match self {
            Period::Minute => 60,
            Period::Hour => 3_600,
            Period::Day => 86_400,
            Period::Week => 7 * 86_400,
            Period::Month => 30 * 86_400,
        }
    }
}

/// One period: `[start, end)` in microseconds since the epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub start: Micros,
    pub end: Micros,
}

impl Span {
    pub fn contains(&self, t: Micros) -> bool {
        self.start <= t && t < self.end
    }
}

/// The period of kind `period` in zone `tz` that `now` falls in.
pub fn span(period: Period, tz: Tz, now: Micros) -> Span {
    let utc = DateTime::<Utc>::from_timestamp_micros(now).unwrap_or_default();
    let local = utc.with_timezone(&tz).naive_local();
    let first = floor(period, local);
    let mut start = resolve(tz, first);
    // The floor of a repeated local time can resolve after `now` (never,
    // with "first occurrence"), or a gap can put the resolved start after
    // `now` when `now` is the gap's end: step back a period then.
    if start > now {
        start = resolve(tz, floor(period, local - Duration::seconds(1)));
    }
    let end = resolve(tz, next(period, first));
    Span { start, end }
}

fn floor(period: Period, t: NaiveDateTime) -> NaiveDateTime {
    let d = t.date();
    let at = |d: NaiveDate, h: u32, m: u32| d.and_hms_opt(h, m, 0).expect("a valid time");
    match period {
        Period::Minute => at(d, t.time().hour_of(), t.time().minute_of()),
        Period::Hour => at(d, t.time().hour_of(), 0),
        Period::Day => at(d, 0, 0),
        Period::Week => at(
            d - Duration::days(d.weekday().num_days_from_monday() as i64),
            0,
            0,
        ),
        Period::Month => at(d.with_day(1).expect("day 1"), 0, 0),
    }
}

fn next(period: Period, start: NaiveDateTime) -> NaiveDateTime {
    match period {
        Period::Minute => start + Duration::minutes(1),
        Period::Hour => start + Duration::hours(1),
        Period::Day => start + Duration::days(1),
        Period::Week => start + Duration::days(7),
        Period::Month => {
            let d = start.date();
            let (y, m) = if d.month() == 12 {
                (d.year() + 1, 1)
            } else {
                (d.year(), d.month() + 1)
            };
            NaiveDate::from_ymd_opt(y, m, 1)
                .expect("the first of a month")
                .and_hms_opt(0, 0, 0)
                .expect("midnight")
        }
    }
}

/// A local boundary as an instant: its first occurrence, or the first
/// instant after a gap it falls in.
fn resolve(tz: Tz, local: NaiveDateTime) -> Micros {
    let mut t = local;
    // Gaps are at most a few hours; minutes are the finest step any zone's
    // offset has taken.
    for _ in 0..(48 * 60) {
        match tz.from_local_datetime(&t) {
            LocalResult::Single(x) | LocalResult::Ambiguous(x, _) => {
                return x.timestamp_micros();
            }
            LocalResult::None => t += Duration::minutes(1),
        }
    }
    // Unreachable for any real zone: fall back to reading it as UTC.
    local.and_utc().timestamp_micros()
}

/// `hour()`/`minute()` without importing `Timelike` at every call site.
trait HourMinute {
    fn hour_of(&self) -> u32;
    fn minute_of(&self) -> u32;
}

impl HourMinute for chrono::NaiveTime {
    fn hour_of(&self) -> u32 {
        chrono::Timelike::hour(self)
    }
    fn minute_of(&self) -> u32 {
        chrono::Timelike::minute(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(tz: Tz, y: i32, mo: u32, d: u32, h: u32, mi: u32, s: u32) -> Micros {
        tz.with_ymd_and_hms(y, mo, d, h, mi, s)
            .earliest()
            .expect("a valid local time")
            .timestamp_micros()
    }

    const H: Micros = 3_600_000_000;
    const DAY: Micros = 24 * H;

    #[test]
    fn the_last_microsecond_of_a_day_is_in_it() {
        let tz: Tz = "UTC".parse().unwrap();
        let midnight = at(tz, 2026, 11, 27, 0, 0, 0);
        let day = span(Period::Day, tz, midnight - 1);
        assert_eq!(
            day,
            Span {
                start: midnight - DAY,
                end: midnight
            }
        );
        let next = span(Period::Day, tz, midnight);
        assert_eq!(next.start, midnight);
        // In Tokyo (UTC+9, no DST) the day ends at 15:00 UTC.
        let tokyo: Tz = "Asia/Tokyo".parse().unwrap();
        let d = span(Period::Day, tokyo, midnight);
        assert_eq!(d.end, at(tz, 2026, 11, 27, 15, 0, 0));
        assert_eq!(d.end - d.start, DAY);
    }

    #[test]
    fn months_of_28_29_30_and_31_days() {
        let tz: Tz = "Europe/Paris".parse().unwrap();
        for (y, m, days) in [
            (2026, 2, 28),
            (2028, 2, 29),
            (2026, 4, 30),
            (2026, 1, 31),
            (2026, 12, 31),
        ] {
            let first = at(tz, y, m, 1, 0, 0, 0);
            let (ny, nm) = if m == 12 { (y + 1, 1) } else { (y, m + 1) };
            let next = at(tz, ny, nm, 1, 0, 0, 0);
            for t in [first, first + 1, next - 1] {
                let s = span(Period::Month, tz, t);
                assert_eq!(
                    s,
                    Span {
                        start: first,
                        end: next
                    },
                    "{y}-{m}"
                );
            }
            // Whole days of the month, give or take a DST hour (March, October).
            let hours = (next - first) / H;
            assert!((hours - days * 24).abs() <= 1, "{y}-{m}: {hours} h");
            assert_eq!(span(Period::Month, tz, next).start, next);
        }
    }

    #[test]
    fn a_day_across_a_dst_change_is_23_or_25_hours() {
        let ny: Tz = "America/New_York".parse().unwrap();
        // 2026-03-08: 02:00 EST jumps to 03:00 EDT.
        let spring = span(Period::Day, ny, at(ny, 2026, 3, 8, 12, 0, 0));
        assert_eq!(spring.end - spring.start, 23 * H);
        // 2026-11-01: 02:00 EDT falls back to 01:00 EST.
        let fall = span(Period::Day, ny, at(ny, 2026, 11, 1, 12, 0, 0));
        assert_eq!(fall.end - fall.start, 25 * H);
        // The hour that does not exist: 01:00 is followed by 03:00.
        let before = span(Period::Hour, ny, at(ny, 2026, 3, 8, 1, 30, 0));
        assert_eq!(before.end - before.start, H);
        let after = span(Period::Hour, ny, before.end);
        assert_eq!(after.start, before.end);
        assert_eq!(after.end - after.start, H);
        // The hour that happens twice is one period of two hours.
        let twice = span(Period::Hour, ny, at(ny, 2026, 11, 1, 1, 10, 0) + H);
        assert_eq!(twice.end - twice.start, 2 * H);
        // A zone whose DST gap is at midnight: that day starts at 01:00.
        let santiago: Tz = "America/Santiago".parse().unwrap();
        // 2026-09-06 00:00 -04 jumps to 01:00 -03.
        let d = span(Period::Day, santiago, at(santiago, 2026, 9, 6, 12, 0, 0));
        assert_eq!(d.start, at(santiago, 2026, 9, 6, 1, 0, 0));
        assert_eq!(d.end - d.start, 23 * H);
    }

    #[test]
    fn a_week_runs_monday_to_monday() {
        let tz: Tz = "UTC".parse().unwrap();
        // 2026-11-26 is a Thursday.
        let w = span(Period::Week, tz, at(tz, 2026, 11, 26, 9, 0, 0));
        assert_eq!(w.start, at(tz, 2026, 11, 23, 0, 0, 0));
        assert_eq!(w.end, at(tz, 2026, 11, 30, 0, 0, 0));
        // Across a year's end.
        let w = span(Period::Week, tz, at(tz, 2027, 1, 1, 0, 0, 0));
        assert_eq!(w.start, at(tz, 2026, 12, 28, 0, 0, 0));
    }

    #[test]
    fn every_instant_falls_in_exactly_one_period() {
        // Walk a year in steps that cross every boundary: each instant is
        // in its span, and consecutive spans touch.
        for zone in [
            "UTC",
            "America/New_York",
            "Europe/London",
            "Australia/Lord_Howe",
            "Asia/Kolkata",
        ] {
            let tz: Tz = zone.parse().unwrap();
            for period in Period::ALL.map(|(_, p)| p) {
                let step = match period {
                    Period::Minute => 17_000_000,
                    Period::Hour => 20 * 60_000_000,
                    _ => 5 * H,
                };
                let mut t = at(tz, 2026, 1, 1, 0, 0, 0);
                let stop = t + if period == Period::Minute {
                    3 * DAY
                } else {
                    366 * DAY
                };
                let mut last = span(period, tz, t);
                while t < stop {
                    let s = span(period, tz, t);
                    assert!(s.contains(t), "{zone} {period:?} {t}: {s:?}");
                    if s != last {
                        assert_eq!(s.start, last.end, "{zone} {period:?}: periods touch");
                        last = s;
                    }
                    t += step;
                }
            }
        }
    }
}
