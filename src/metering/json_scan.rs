//! Finds one number in a JSON text fed in pieces, with bounded memory
//! whatever the text's size: the value at a path of object keys
//! (`usage.total_tokens`), as a response body streams past.
//!
//! It keeps no part of the document: per open container one bit, the
//! number being read (at most `MAX_NUMBER` bytes) and how far the current
//! key matches its path segment. A key with an escape (`\"`, `\u0041`)
//! never matches; nesting past `MAX_DEPTH` ends the scan as malformed.
//! A scan allocates nothing: it runs before a charged request's first
//! byte goes on (its estimate) and as the answer passes.

use std::sync::Arc;

use crate::config::JsonPath;

/// Nesting deeper than this is refused (a real usage object is shallow);
/// one bit a level (`Stack`).
pub const MAX_DEPTH: usize = 128;

/// A number longer than this is not a count.
const MAX_NUMBER: usize = 40;

/// What the scan found at the path.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Found {
    /// Nothing at the path (so far).
    Nothing,
    /// A JSON number (the last one, if the path repeats).
    Number(f64),
    /// `null`.
    Null,
    /// Something else: a string, a boolean, an object, a number too long.
    NotNumber,
}

/// A byte of a number or a literal (`true`, `false`, `null`).
fn is_atom_byte(b: u8) -> bool {
    matches!(b, b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E' | b'a'..=b'z')
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Frame {
    Object,
    Array,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    /// Expecting a value (the document's, an array element, a key's).
    Value,
    /// In an object, expecting a key or `}` (`first`: `}` allowed).
    Key {
        first: bool,
    },
    /// Reading a key; `pos` bytes of the wanted segment matched so far, or
    /// None once it cannot match.
    InKey {
        pos: Option<usize>,
        escaped: bool,
    },
    /// After a key, expecting `:`.
    Colon,
    /// After a value, expecting `,` or the container's end.
    After,
    /// Inside a string value.
    InString {
        escaped: bool,
    },
    /// Inside a number or literal (`true`, `false`, `null`).
    InAtom,
    /// The top-level value ended; only whitespace may follow.
    Done,
    Malformed,
}

/// The open containers, innermost last: bit i set for an array at depth i
/// (and clear above the top, so any bit set is an open array).
#[derive(Default)]
struct Stack {
    len: usize,
    arrays: u128,
}

impl Stack {
    fn len(&self) -> usize {
        self.len
    }

    fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether an array is open (the target never sits inside one).
    fn in_array(&self) -> bool {
        self.arrays != 0
    }

    fn last(&self) -> Option<&Frame> {
        let top = self.len.checked_sub(1)?;
        Some(match self.arrays >> top & 1 {
            1 => &Frame::Array,
            _ => &Frame::Object,
        })
    }

    /// The caller keeps `len` below `MAX_DEPTH`.
    fn push(&mut self, frame: Frame) {
        if frame == Frame::Array {
            self.arrays |= 1u128 << self.len;
        }
        self.len += 1;
    }

    fn pop(&mut self) -> Option<Frame> {
        let frame = *self.last()?;
        self.len -= 1;
        self.arrays &= !(1u128 << self.len);
        Some(frame)
    }

    fn clear(&mut self) {
        *self = Stack::default();
    }
}

/// The atom being read: the target's number (one byte past `MAX_NUMBER`
/// tells a number too long), or enough of another to tell a literal.
struct Atom {
    bytes: [u8; MAX_NUMBER + 1],
    len: usize,
}

impl Atom {
    fn clear(&mut self) {
        self.len = 0;
    }

    fn push(&mut self, b: u8) {
        self.bytes[self.len] = b;
        self.len += 1;
    }

    fn len(&self) -> usize {
        self.len
    }

    fn as_slice(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

pub struct JsonScan {
    path: Arc<[Box<[u8]>]>,
    stack: Stack,
    /// How many open objects, from the root, sit at their path segment's
    /// key: the value being read is the target when it equals the path's
    /// length and every open container is such an object.
    matched: usize,
    /// Whether the key just read (or being read) matches the next segment.
    key_matches: bool,
    state: State,
    /// The target's atom, being read.
    atom: Atom,
    target_atom: bool,
    found: Found,
}

impl JsonScan {
    /// A scan for the value at `path` (object keys from the root).
    pub fn new(path: &JsonPath) -> Self {
        JsonScan {
            path: path.keys().clone(),
            stack: Stack::default(),
            matched: 0,
            key_matches: false,
            state: State::Value,
            atom: Atom {
                bytes: [0; MAX_NUMBER + 1],
                len: 0,
            },
            target_atom: false,
            found: Found::Nothing,
        }
    }

    /// Starts over on a new document (the next server-sent event), keeping
    /// what was found.
    pub fn reset(&mut self) {
        self.stack.clear();
        self.matched = 0;
        self.key_matches = false;
        self.state = State::Value;
        self.atom.clear();
        self.target_atom = false;
    }

    pub fn found(&self) -> Found {
        self.found
    }

    /// Forgets what the current document found (it did not complete).
    pub fn restore(&mut self, found: Found) {
        self.found = found;
    }

    /// Whether the text so far cannot be JSON.
    pub fn malformed(&self) -> bool {
        self.state == State::Malformed
    }

    /// Whether one whole value has been read.
    pub fn complete(&self) -> bool {
        self.state == State::Done
    }

    /// Ends the document: an atom still open at the end (a bare number)
    /// is complete now.
    pub fn finish(&mut self) {
        if self.state == State::InAtom {
            self.end_atom();
        }
    }

    pub fn feed(&mut self, bytes: &[u8]) {
        let mut i = 0;
        while i < bytes.len() {
            match self.state {
                State::Malformed => return,
                // Most of an answer is text inside strings: skipped a run
                // at a time, to the next quote or backslash. So is a key
                // that cannot match its segment.
                State::InString { escaped: false }
                | State::InKey {
                    pos: None,
                    escaped: false,
                } => match memchr::memchr2(b'"', b'\\', &bytes[i..]) {
                    Some(n) => {
                        i += n;
                        self.byte(bytes[i]);
                        i += 1;
                    }
                    None => return,
                },
                // An atom's bytes a run at a time; the byte that ends it is
                // read again in the state after it.
                State::InAtom => {
                    let run = bytes[i..]
                        .iter()
                        .position(|b| !is_atom_byte(*b))
                        .unwrap_or(bytes.len() - i);
                    for &b in &bytes[i..i + run] {
                        self.push_atom(b);
                    }
                    i += run;
                    if i < bytes.len() {
                        self.end_atom();
                    }
                }
                _ => {
                    self.byte(bytes[i]);
                    i += 1;
                }
            }
        }
    }

    /// Whether a value starting now sits at the path.
    fn at_target(&self) -> bool {
        self.matched == self.path.len()
            && self.stack.len() == self.path.len()
            && !self.stack.in_array()
    }

    #[inline(always)]
    fn byte(&mut self, b: u8) {
        let ws = matches!(b, b' ' | b'\t' | b'\n' | b'\r');
        match self.state {
            State::Value => match b {
                _ if ws => {}
                b'{' => self.open(Frame::Object),
                b'[' => self.open(Frame::Array),
                b'"' => {
                    if self.at_target() {
                        self.found = Found::NotNumber;
                    }
                    self.state = State::InString { escaped: false };
                }
                b'-' | b'0'..=b'9' | b't' | b'f' | b'n' => {
                    self.target_atom = self.at_target();
                    self.atom.clear();
                    self.push_atom(b);
                    self.state = State::InAtom;
                }
                // An empty array: `[` then `]`.
                b']' if self.stack.last() == Some(&Frame::Array) => self.close(),
                _ => self.state = State::Malformed,
            },
            State::Key { first } => match b {
                _ if ws => {}
                b'"' => {
                    let depth = self.stack.len();
                    let pos = (self.matched + 1 == depth && depth <= self.path.len()).then_some(0);
                    self.state = State::InKey {
                        pos,
                        escaped: false,
                    };
                }
                b'}' if first => self.close(),
                _ => self.state = State::Malformed,
            },
            State::InKey { pos, escaped } => {
                if escaped {
                    self.state = State::InKey {
                        pos: None,
                        escaped: false,
                    };
                    return;
                }
                match b {
                    b'"' => {
                        let depth = self.stack.len();
                        self.key_matches = pos.is_some_and(|p| p == self.path[depth - 1].len());
                        self.state = State::Colon;
                    }
                    b'\\' => {
                        self.state = State::InKey {
                            pos: None,
                            escaped: true,
                        }
                    }
                    _ => {
                        let depth = self.stack.len();
                        let next = pos.and_then(|p| {
                            let seg = &self.path[depth - 1];
                            (seg.get(p) == Some(&b)).then_some(p + 1)
                        });
                        self.state = State::InKey {
                            pos: next,
                            escaped: false,
                        };
                    }
                }
            }
            State::Colon => match b {
                _ if ws => {}
                b':' => {
                    if self.key_matches {
                        self.matched += 1;
                    }
                    self.state = State::Value;
                }
                _ => self.state = State::Malformed,
            },
            State::After => self.after(b, ws),
            State::InString { escaped } => {
                self.state = match (escaped, b) {
                    (true, _) => State::InString { escaped: false },
                    (false, b'\\') => State::InString { escaped: true },
                    (false, b'"') => self.after_value(),
                    _ => State::InString { escaped: false },
                };
            }
            // `feed` reads atoms a run at a time; this is the byte one by one.
            State::InAtom if is_atom_byte(b) => self.push_atom(b),
            State::InAtom => {
                self.end_atom();
                match self.state {
                    State::After => self.after(b, ws),
                    State::Done => self.done(ws),
                    _ => {}
                }
            }
            State::Done => self.done(ws),
            State::Malformed => {}
        }
    }

    /// After a value: `,` or the container's end.
    fn after(&mut self, b: u8, ws: bool) {
        match b {
            _ if ws => {}
            b',' => match self.stack.last() {
                Some(Frame::Object) => {
                    self.unmatch_key();
                    self.state = State::Key { first: false };
                }
                Some(Frame::Array) => self.state = State::Value,
                None => self.state = State::Malformed,
            },
            b'}' if self.stack.last() == Some(&Frame::Object) => {
                self.unmatch_key();
                self.close();
            }
            b']' if self.stack.last() == Some(&Frame::Array) => self.close(),
            _ => self.state = State::Malformed,
        }
    }

    /// After the document: only whitespace.
    fn done(&mut self, ws: bool) {
        if !ws {
            self.state = State::Malformed;
        }
    }

    fn push_atom(&mut self, b: u8) {
        if self.target_atom && self.atom.len() < MAX_NUMBER + 1 {
            self.atom.push(b);
        } else if !self.target_atom && self.atom.len() < 5 {
            // Enough to tell a literal from garbage.
            self.atom.push(b);
        }
    }

    fn end_atom(&mut self) {
        let atom = self.atom.as_slice();
        // A number starts with `-` or a digit; anything else must be a
        // literal (compared byte by byte: no call for a short atom).
        let number = matches!(atom.first(), Some(b'-' | b'0'..=b'9'));
        let literal = !number
            && matches!(
                atom,
                [b't', b'r', b'u', b'e']
                    | [b'f', b'a', b'l', b's', b'e']
                    | [b'n', b'u', b'l', b'l']
            );
        if !literal && !number {
            self.state = State::Malformed;
            return;
        }
        if self.target_atom {
            self.found = if literal {
                match atom {
                    [b'n', ..] => Found::Null,
                    _ => Found::NotNumber,
                }
            } else {
                match std::str::from_utf8(atom)
                    .ok()
                    .filter(|_| atom.len() <= MAX_NUMBER)
                    .and_then(|s| s.parse::<f64>().ok())
                {
                    Some(n) => Found::Number(n),
                    None => Found::NotNumber,
                }
            };
        }
        self.target_atom = false;
        self.atom.clear();
        self.state = self.after_value();
    }

    fn open(&mut self, frame: Frame) {
        if self.at_target() {
            self.found = Found::NotNumber;
        }
        if self.stack.len() >= MAX_DEPTH {
            self.state = State::Malformed;
            return;
        }
        self.stack.push(frame);
        self.state = match frame {
            Frame::Object => State::Key { first: true },
            Frame::Array => State::Value,
        };
    }

    fn close(&mut self) {
        self.stack.pop();
        self.state = self.after_value();
    }

    /// The state after a value ends in the current container.
    fn after_value(&self) -> State {
        if self.stack.is_empty() {
            State::Done
        } else {
            State::After
        }
    }

    /// The current object's key is done with: the objects matched from
    /// the root drop back to the ones above it.
    fn unmatch_key(&mut self) {
        let depth = self.stack.len();
        if self.matched >= depth {
            self.matched = depth - 1;
        }
        self.key_matches = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan(path: &str, text: &str) -> (Found, bool) {
        let mut s = JsonScan::new(&path.into());
        s.feed(text.as_bytes());
        s.finish();
        (s.found(), s.malformed())
    }

    /// Every split of the text into two pieces finds the same.
    fn scan_split(path: &str, text: &str) -> (Found, bool) {
        let whole = scan(path, text);
        for i in 0..=text.len() {
            let mut s = JsonScan::new(&path.into());
            s.feed(&text.as_bytes()[..i]);
            s.feed(&text.as_bytes()[i..]);
            s.finish();
            assert_eq!((s.found(), s.malformed()), whole, "split at {i} of {text}");
        }
        whole
    }

    #[test]
    fn finds_the_number_at_the_path() {
        let body = r#"{"id":"x","choices":[{"message":{"content":"usage: {\"total_tokens\": 9}"}}],
            "usage": {"prompt_tokens": 12, "completion_tokens": 30, "total_tokens": 42}}"#;
        assert_eq!(
            scan_split("usage.total_tokens", body),
            (Found::Number(42.0), false)
        );
        assert_eq!(
            scan_split("usage.prompt_tokens", body),
            (Found::Number(12.0), false)
        );
        assert_eq!(scan_split("usage.cached", body), (Found::Nothing, false));
        assert_eq!(scan_split("total_tokens", body), (Found::Nothing, false));
    }

    #[test]
    fn same_key_elsewhere_does_not_count() {
        let body = r#"{"total_tokens": 1, "a": {"usage": {"total_tokens": 2}},
            "usage": [{"total_tokens": 3}], "x": {"usage": {"total_tokens": 4}}}"#;
        assert_eq!(
            scan_split("usage.total_tokens", body),
            (Found::Nothing, false)
        );
        let body = r#"{"usage": {"a": {"total_tokens": 5}, "total_tokens": 6}}"#;
        assert_eq!(
            scan_split("usage.total_tokens", body),
            (Found::Number(6.0), false)
        );
    }

    #[test]
    fn what_is_not_a_count() {
        for (body, found) in [
            (r#"{"usage":{"total_tokens":"42"}}"#, Found::NotNumber),
            (r#"{"usage":{"total_tokens":null}}"#, Found::Null),
            (r#"{"usage":{"total_tokens":true}}"#, Found::NotNumber),
            (r#"{"usage":{"total_tokens":{"n":1}}}"#, Found::NotNumber),
            (r#"{"usage":{"total_tokens":[1]}}"#, Found::NotNumber),
            (r#"{"usage":{"total_tokens":-5}}"#, Found::Number(-5.0)),
            (r#"{"usage":{"total_tokens":1e30}}"#, Found::Number(1e30)),
            (r#"{"usage":{"total_tokens":2.5}}"#, Found::Number(2.5)),
            (
                r#"{"usage":{"total_tokens":123456789012345678901234567890123456789012345}}"#,
                Found::NotNumber,
            ),
        ] {
            assert_eq!(
                scan_split("usage.total_tokens", body),
                (found, false),
                "{body}"
            );
        }
    }

    #[test]
    fn malformed_text_is_said_so() {
        for body in [
            "<html>502</html>",
            "{\"usage\": {\"total_tokens\": 4} x}",
            "{\"a\" 1}",
            "[1,,2]",
            "{} {}",
            "nope",
        ] {
            assert!(scan("usage.total_tokens", body).1, "{body}");
        }
        // A deep document ends the scan, with bounded memory.
        let deep = "[".repeat(MAX_DEPTH + 1);
        assert!(scan("a", &deep).1);
    }

    #[test]
    fn nesting_up_to_the_deepest_is_read_level_by_level() {
        // MAX_DEPTH levels, objects and arrays in turn, closed in order:
        // each close must find its own kind, or the text reads malformed.
        let (mut open, mut close) = (String::new(), String::new());
        for i in 0..MAX_DEPTH {
            if i % 2 == 0 {
                open.push_str(r#"{"k":"#);
                close.insert(0, '}');
            } else {
                open.push('[');
                close.insert(0, ']');
            }
        }
        let text = format!("{open}1{close}");
        assert_eq!(scan("k", &text), (Found::NotNumber, false));
        // One close of the wrong kind anywhere is malformed.
        let wrong = format!("{open}1{}]", &close[..close.len() - 1]);
        assert!(scan("k", &wrong).1);
        // The target inside the deepest object.
        let path = vec!["k"; MAX_DEPTH].join(".");
        let text = format!("{}7{}", r#"{"k":"#.repeat(MAX_DEPTH), "}".repeat(MAX_DEPTH));
        assert_eq!(scan(&path, &text), (Found::Number(7.0), false));
    }

    #[test]
    fn a_cut_document_is_incomplete_not_malformed() {
        let mut s = JsonScan::new(&"usage.total_tokens".into());
        s.feed(br#"{"usage": {"total_tok"#);
        s.finish();
        assert_eq!(
            (s.found(), s.malformed(), s.complete()),
            (Found::Nothing, false, false)
        );
    }

    #[test]
    fn a_key_with_an_escape_never_matches() {
        let body = r#"{"us\u0061ge": {"total_tokens": 1}, "usage": {"total_tokens": 2}}"#;
        assert_eq!(
            scan_split("usage.total_tokens", body),
            (Found::Number(2.0), false)
        );
    }

    #[test]
    fn documents_one_after_another() {
        let mut s = JsonScan::new(&"usage.total_tokens".into());
        s.feed(br#"{"usage": {"total_tokens": 7}}"#);
        assert!(s.complete());
        s.reset();
        s.feed(br#"{"choices": []}"#);
        assert_eq!(s.found(), Found::Number(7.0), "kept across documents");
        s.reset();
        s.feed(br#"{"usage": {"total_tokens": 8}}"#);
        assert_eq!(s.found(), Found::Number(8.0), "the last found");
    }
}
