//! What a request on a `charge` route costs, in the units only the upstream
//! knows (LLM tokens, rows, bytes): the estimate taken at admission
//! (`estimate`), the true cost read from the answer as it passes
//! (`Meter`), and what is finally charged (`charged`).
//!
//! Nothing here holds a body: the request's estimate is read from a body
//! Pingora keeps anyway (its retry buffer, at most 64 KiB), the answer's
//! cost by scanners whose memory does not grow with it (`json_scan`,
//! `sse`).

pub mod json_scan;
pub mod sse;

use bytes::Bytes;
use http::HeaderMap;

use crate::config::{Charge, CostSource};
use json_scan::{Found, JsonScan};
use sse::SseScan;

/// The largest count taken as a reading (2^53: an f64's integers); past
/// it, or negative, or not finite, a number is no reading.
const MOST: f64 = 9_007_199_254_740_992.0;

/// Why a request was charged what it was: the metric's `reason` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    /// The answer said (at most `max`).
    Read,
    /// The answer said more than `max`: `max` was charged.
    Capped,
    /// No source held the cost: the estimate was charged.
    Missing,
    /// The body was not JSON (or not server-sent events of JSON).
    NotJson,
    /// The field held something other than a number.
    NotNumber,
    Negative,
    /// Not finite, or past 2^53.
    OutOfRange,
    /// The answer ended before its cost came (the stream was cut).
    Cut,
    /// The upstream failed (5xx, reset, timeout): refunded, unless the
    /// route charges failures (then the estimate).
    Failed,
}

impl Why {
    pub fn as_str(self) -> &'static str {
        match self {
            Why::Read => "read",
            Why::Capped => "capped",
            Why::Missing => "missing",
            Why::NotJson => "not_json",
            Why::NotNumber => "not_a_number",
            Why::Negative => "negative",
            Why::OutOfRange => "out_of_range",
            Why::Cut => "cut",
            Why::Failed => "failed",
        }
    }

    pub const ALL: [Why; 9] = [
        Why::Read,
        Why::Capped,
        Why::Missing,
        Why::NotJson,
        Why::NotNumber,
        Why::Negative,
        Why::OutOfRange,
        Why::Cut,
        Why::Failed,
    ];
}

/// How the answer ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// Whole, with this status.
    Whole(u16),
    /// The client left before it ended: the upstream did the work.
    ClientLeft,
    /// The upstream failed it: a 5xx, a reset, a timeout, a cut body.
    UpstreamFailed,
}

/// Reads the cost from an answer as it passes.
///
/// A piece is scanned once the next one comes (or the answer ends), not
/// before it goes on to the client: the client's first byte never waits
/// for the scan, and one piece is all that is held (a reference to the
/// bytes Pingora already has, not a copy).
pub struct Meter {
    header: Found,
    json: Option<JsonScan>,
    sse: Option<SseScan>,
    /// The body scanned: `json` or `sse` (from its content type).
    event_stream: bool,
    /// The last piece, not scanned yet.
    held: Option<Bytes>,
}

impl Meter {
    /// Once the upstream's response header is in: the header sources are
    /// read, and the body's scanner chosen by its content type.
    pub fn start(charge: &Charge, headers: &HeaderMap) -> Self {
        let event_stream = headers
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.trim_start().starts_with("text/event-stream"));
        let mut header = Found::Nothing;
        let (mut json, mut sse) = (None, None);
        for s in &charge.response {
            match s {
                CostSource::Header(name) if header == Found::Nothing => {
                    header = match headers.get(name.as_str()).map(|v| v.to_str()) {
                        None => Found::Nothing,
                        Some(Ok(v)) => v
                            .trim()
                            .parse::<f64>()
                            .map_or(Found::NotNumber, Found::Number),
                        Some(Err(_)) => Found::NotNumber,
                    };
                }
                CostSource::Json(path) if !event_stream && json.is_none() => {
                    json = Some(JsonScan::new(path));
                }
                CostSource::Sse(path) if event_stream && sse.is_none() => {
                    sse = Some(SseScan::new(path));
                }
                _ => {}
            }
        }
        Meter {
            header,
            json,
            sse,
            event_stream,
            held: None,
        }
    }

    /// A piece of the answer's body, on its way to the client: the one
    /// before it is scanned now.
    pub fn body(&mut self, chunk: &Bytes) {
        if self.json.is_none() && self.sse.is_none() {
            return;
        }
        if let Some(before) = self.held.replace(chunk.clone()) {
            self.scan(&before);
        }
    }

    fn scan(&mut self, chunk: &[u8]) {
        if let Some(s) = &mut self.json {
            s.feed(chunk);
        }
        if let Some(s) = &mut self.sse {
            s.feed(chunk);
        }
    }

    /// What the answer said it cost, in `charge.response`'s order: the
    /// first source that holds something; None when none does, with why.
    pub fn reading(&mut self, charge: &Charge, ended: Ended) -> Result<f64, Why> {
        if let Some(last) = self.held.take() {
            self.scan(&last);
        }
        let cut = !matches!(ended, Ended::Whole(_));
        let mut first_problem = None;
        for s in &charge.response {
            let (found, problem) = match s {
                CostSource::Header(_) => (self.header, None),
                CostSource::Json(_) if !self.event_stream => match &mut self.json {
                    Some(scan) => {
                        scan.finish();
                        let problem = if scan.malformed() {
                            Some(Why::NotJson)
                        } else if !scan.complete() {
                            Some(if cut { Why::Cut } else { Why::NotJson })
                        } else {
                            None
                        };
                        // A number in a body that did not end is no reading.
                        match problem {
                            Some(p) => (Found::Nothing, Some(p)),
                            None => (scan.found(), None),
                        }
                    }
                    None => (Found::Nothing, None),
                },
                CostSource::Sse(_) if self.event_stream => match &self.sse {
                    Some(scan) => {
                        let problem = match scan.found() {
                            Found::Nothing if cut => Some(Why::Cut),
                            Found::Nothing if scan.events > 0 && scan.not_json == scan.events => {
                                Some(Why::NotJson)
                            }
                            _ => None,
                        };
                        (scan.found(), problem)
                    }
                    None => (Found::Nothing, None),
                },
                _ => (Found::Nothing, None),
            };
            match found {
                Found::Number(n) => return Ok(n),
                Found::NotNumber | Found::Null => {
                    first_problem.get_or_insert(Why::NotNumber);
                }
                Found::Nothing => {
                    if let Some(p) = problem {
                        first_problem.get_or_insert(p);
                    }
                }
            }
        }
        Err(first_problem.unwrap_or(if cut { Why::Cut } else { Why::Missing }))
    }
}

/// What a request is finally charged, from what its answer said, the
/// estimate it was admitted on, and how it ended:
/// - a failed answer: nothing, or the estimate where the route charges
///   failures;
/// - a reading: rounded up to a whole unit, at most `max`;
/// - no reading (missing, not JSON, not a number, negative, past 2^53,
///   cut): the estimate.
pub fn charged(
    charge: &Charge,
    estimate: u64,
    ended: Ended,
    reading: Result<f64, Why>,
) -> (u64, Why) {
    let failed = match ended {
        Ended::UpstreamFailed => true,
        Ended::Whole(status) => status >= 500,
        Ended::ClientLeft => false,
    };
    if failed {
        let cost = if charge.charge_failed { estimate } else { 0 };
        return (cost, Why::Failed);
    }
    match reading {
        Ok(n) if n.is_nan() || n.is_infinite() || n > MOST => (estimate, Why::OutOfRange),
        Ok(n) if n < 0.0 => (estimate, Why::Negative),
        Ok(n) => {
            let n = n.ceil() as u64;
            if n > charge.max {
                (charge.max, Why::Capped)
            } else {
                (n, Why::Read)
            }
        }
        Err(why) => (estimate, why),
    }
}

/// The estimate a request is admitted on: its body's number at
/// `estimate = "json:PATH"` (rounded up, at most `max`), or the fixed one;
/// `default_estimate` when the body does not hold one. None: no estimate
/// at all (the request is refused, saying why).
pub fn estimate(charge: &Charge, body: Option<&[u8]>) -> Result<u64, String> {
    use crate::config::Estimate;
    let read = match &charge.estimate {
        Estimate::Fixed(n) => return Ok((*n).min(charge.max)),
        Estimate::Json(path) => body.map(|b| {
            let mut s = JsonScan::new(path);
            s.feed(b);
            s.finish();
            match (s.complete(), s.found()) {
                (true, Found::Number(n)) if (0.0..=MOST).contains(&n) => Ok(n.ceil() as u64),
                (true, Found::Number(_) | Found::NotNumber) => {
                    Err(format!("`{path}` in the request body is not a count"))
                }
                (true, _) => Err(format!("the request body has no `{path}`")),
                (false, _) => Err("the request body is not JSON".to_string()),
            }
        }),
    };
    match (read, charge.default_estimate) {
        (Some(Ok(n)), _) => Ok(n.min(charge.max)),
        (_, Some(d)) => Ok(d.min(charge.max)),
        (Some(Err(why)), None) => Err(why),
        (None, None) => Err("the request body could not be read for its estimate".to_string()),
    }
}

#[cfg(test)]
mod tests;
