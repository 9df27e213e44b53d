//! Server-sent events fed in pieces: each event's `data` is scanned for the
//! path (`JsonScan`), and the last event that carries a number there wins
//! (an LLM stream sends its usage in its last event). Bounded memory: how
//! much of `data:` a line has matched, and the scanner's.

use super::json_scan::{Found, JsonScan};

#[derive(Debug, Clone, Copy, PartialEq)]
enum Line {
    /// At a line's start: the first `len` bytes of `data:` read (a line
    /// that strays from it is another field's).
    Start { len: usize },
    /// In a `data` field's value; `space`: its one leading space may
    /// still come.
    Data { space: bool },
    /// In another field (`event:`, `id:`, a `:comment`): skipped.
    Other,
}

pub struct SseScan {
    scan: JsonScan,
    /// What the complete events found: the last number, or the last
    /// thing that was not one (`null` finds nothing: streams send
    /// `"usage": null` in every event but the last).
    settled: Found,
    line: Line,
    /// The event has data lines (a second one is joined by a newline).
    has_data: bool,
    /// The last byte was `\r` (a following `\n` ends nothing more).
    after_cr: bool,
    /// Events ended, and the ones whose data was not JSON.
    pub events: u64,
    pub not_json: u64,
}

impl SseScan {
    pub fn new(path: &crate::config::JsonPath) -> Self {
        SseScan {
            scan: JsonScan::new(path),
            settled: Found::Nothing,
            line: Line::Start { len: 0 },
            has_data: false,
            after_cr: false,
            events: 0,
            not_json: 0,
        }
    }

    /// The last number found at the path in a complete event.
    pub fn found(&self) -> Found {
        self.settled
    }

    pub fn feed(&mut self, bytes: &[u8]) {
        let mut i = 0;
        while i < bytes.len() {
            let b = bytes[i];
            // A data line's value goes to the scanner a run at a time.
            if let Line::Data { space } = self.line {
                if !self.after_cr && b != b'\r' && b != b'\n' {
                    let rest = &bytes[i..];
                    let end = memchr::memchr2(b'\r', b'\n', rest).unwrap_or(rest.len());
                    let skip = (space && rest[0] == b' ') as usize;
                    self.scan.feed(&rest[skip..end]);
                    self.line = Line::Data { space: false };
                    i += end;
                    continue;
                }
            }
            i += 1;
            if self.after_cr {
                self.after_cr = false;
                if b == b'\n' {
                    continue;
                }
            }
            if b == b'\r' || b == b'\n' {
                self.after_cr = b == b'\r';
                self.end_line();
                continue;
            }
            match self.line {
                // The bytes before matched already: `len` of "data:".
                Line::Start { len } if b != b"data:"[len] => self.line = Line::Other,
                Line::Start { len: 4 } => {
                    if self.has_data {
                        self.scan.feed(b"\n");
                    }
                    self.has_data = true;
                    self.line = Line::Data { space: true };
                }
                Line::Start { len } => self.line = Line::Start { len: len + 1 },
                Line::Data { space } => {
                    self.line = Line::Data { space: false };
                    if !(space && b == b' ') {
                        self.scan.feed(&[b]);
                    }
                }
                Line::Other => {}
            }
        }
    }

    fn end_line(&mut self) {
        if self.line == (Line::Start { len: 0 }) {
            self.end_event();
        } else if self.line == (Line::Start { len: 4 }) {
            // `data` alone: an empty data line.
            if self.has_data {
                self.scan.feed(b"\n");
            }
            self.has_data = true;
        }
        self.line = Line::Start { len: 0 };
    }

    /// A blank line: the event is complete. A number counts only from an
    /// event whose data was one whole JSON document; `[DONE]` and other
    /// text count as not JSON.
    fn end_event(&mut self) {
        if !self.has_data {
            return;
        }
        self.scan.finish();
        self.events += 1;
        match (self.scan.complete(), self.scan.found()) {
            (true, Found::Null) | (false, _) => {
                self.not_json += !self.scan.complete() as u64;
                self.scan.restore(self.settled);
            }
            (true, found) => self.settled = found,
        }
        self.scan.reset();
        self.has_data = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(events: &[&str]) -> String {
        events.iter().map(|e| format!("data: {e}\n\n")).collect()
    }

    fn scan_all_splits(text: &str) -> (Found, u64, u64) {
        let whole = {
            let mut s = SseScan::new(&"usage.total_tokens".into());
            s.feed(text.as_bytes());
            (s.found(), s.events, s.not_json)
        };
        for i in 0..=text.len() {
            let mut s = SseScan::new(&"usage.total_tokens".into());
            s.feed(&text.as_bytes()[..i]);
            s.feed(&text.as_bytes()[i..]);
            assert_eq!((s.found(), s.events, s.not_json), whole, "split at {i}");
        }
        whole
    }

    #[test]
    fn the_usage_in_the_last_event_that_carries_it() {
        let text = stream(&[
            r#"{"choices":[{"delta":{"content":"Hel"}}],"usage":null}"#,
            r#"{"choices":[{"delta":{"content":"lo"}}]}"#,
            r#"{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}"#,
            "[DONE]",
        ]);
        assert_eq!(scan_all_splits(&text), (Found::Number(5.0), 4, 1));
    }

    #[test]
    fn line_endings_comments_and_other_fields() {
        let text = ": keep-alive\r\nevent: message\r\nid: 7\r\ndata: {\"usage\":\r\ndata: {\"total_tokens\": 9}}\r\n\r\n";
        assert_eq!(scan_all_splits(text), (Found::Number(9.0), 1, 0));
        let text = "data:{\"usage\":{\"total_tokens\":4}}\r\rdatum: x\n\n";
        assert_eq!(scan_all_splits(text), (Found::Number(4.0), 1, 0));
    }

    #[test]
    fn a_cut_stream_counts_only_complete_events() {
        // The last event never ended: its number does not count.
        let text =
            "data: {\"usage\":{\"total_tokens\":4}}\n\ndata: {\"usage\":{\"total_tokens\":40}";
        assert_eq!(scan_all_splits(text), (Found::Number(4.0), 1, 0));
        let text = "data: {\"usage\":{\"total_tokens\":4}\n\n";
        assert_eq!(scan_all_splits(text), (Found::Nothing, 1, 1));
    }
}
