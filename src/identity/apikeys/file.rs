//! `clients.api_keys_file`: keys outside `gateway.toml`, one a line.
//!
//! JSON lines (any name but `*.csv`), one object a line:
//! `{"id": "...", "sha256": "<hex>" | "key": "...", "plan": "...",
//! "quotas": [{"limit": N, "period": "day"}], "capacity": N,
//! "refill_per_sec": R}`; blank lines are skipped. Or CSV (`*.csv`) with a
//! header naming the columns `id`, `key` or `sha256`, `plan`, and optionally
//! `capacity`, `refill_per_sec` and `quotas` (`1000/day;30000/month`).
//!
//! The rules are `[[api_keys]]`'s. Any bad line refuses the whole file,
//! each problem named by its line; no message repeats a secret or a digest.
//! The file is read a line at a time, so a million keys need no more memory
//! than the set they build.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::value::RawValue;

use super::{Builder, KeySet, Origin, Refused};
use crate::calendar::Period;
use crate::config::{rules, ApiKey, Burst, Plan, Quota};

/// Problems listed at most; the rest are counted.
const SHOWN: usize = 20;

/// Why a keys file was refused.
#[derive(Debug)]
pub struct FileError {
    pub path: PathBuf,
    pub problems: Vec<Refused>,
    /// Problems beyond those listed.
    pub more: usize,
}

impl fmt::Display for FileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:", self.path.display())?;
        for p in &self.problems {
            match p.at {
                Origin::Line(0) => write!(f, " {};", p.message)?,
                at => write!(f, " {at}: {};", p.message)?,
            }
        }
        if self.more > 0 {
            write!(f, " and {} more problem(s);", self.more)?;
        }
        write!(f, " the whole file is refused")
    }
}

/// One line as written; each field is checked on its own, so a message can
/// say which one is wrong without repeating its value.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Line<'a> {
    #[serde(borrow)]
    id: Option<&'a RawValue>,
    #[serde(borrow)]
    key: Option<&'a RawValue>,
    #[serde(borrow)]
    sha256: Option<&'a RawValue>,
    #[serde(borrow)]
    plan: Option<&'a RawValue>,
    #[serde(borrow)]
    quotas: Option<&'a RawValue>,
    #[serde(borrow)]
    capacity: Option<&'a RawValue>,
    #[serde(borrow)]
    refill_per_sec: Option<&'a RawValue>,
}

/// A line's fields as text, before their rules.
#[derive(Default)]
struct Fields<'a> {
    id: Option<Cow<'a, str>>,
    key: Option<Cow<'a, str>>,
    sha256: Option<Cow<'a, str>>,
    plan: Option<Cow<'a, str>>,
    quotas: Option<Vec<Quota>>,
    capacity: Option<u64>,
    refill_per_sec: Option<f64>,
}

/// Reads the file beside the config's own keys; the whole set, or every
/// problem (the first `SHOWN`).
pub fn load(
    path: &Path,
    inline: &[ApiKey],
    plans: &BTreeMap<String, Plan>,
) -> Result<KeySet, FileError> {
    let fail = |problems: Vec<Refused>| {
        let more = problems.len().saturating_sub(SHOWN);
        FileError {
            path: path.to_path_buf(),
            problems: problems.into_iter().take(SHOWN).collect(),
            more,
        }
    };
    let io = |e: std::io::Error| {
        fail(vec![Refused {
            at: Origin::Line(0),
            message: format!("cannot read it: {e}"),
        }])
    };
    let file = std::fs::File::open(path).map_err(io)?;
    // About 100 bytes a line: room for the set without growing it.
    let expected = file
        .metadata()
        .map_or(0, |m| (m.len() / 100) as usize)
        .min(10_000_000);
    let mut b = Builder::with_inline(inline, expected);
    let mut problems = Vec::new();
    let mut add = |b: &mut Builder, n: usize, f: Result<Fields<'_>, String>| {
        let refused = |message: String| Refused {
            at: Origin::Line(n),
            message,
        };
        match f.and_then(|f| checked(f, plans)) {
            Ok(k) => {
                if let Err(e) =
                    b.insert(&k.id, k.digest, &k.plan, k.quotas, k.burst, Origin::Line(n))
                {
                    problems.push(e);
                }
            }
            Err(message) => problems.push(refused(message)),
        }
    };
    let csv = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("csv"));
    let reader = BufReader::with_capacity(1 << 20, file);
    if csv {
        read_csv(reader, |n, f| add(&mut b, n, f)).map_err(io)?;
    } else {
        read_json_lines(reader, |n, f| add(&mut b, n, f)).map_err(io)?;
    }
    if !problems.is_empty() {
        return Err(fail(problems));
    }
    let mut set = b.finish().map_err(fail)?;
    set.inline = inline.len();
    Ok(set)
}

fn read_json_lines(
    mut reader: impl BufRead,
    mut each: impl FnMut(usize, Result<Fields<'_>, String>),
) -> std::io::Result<()> {
    let mut line = String::new();
    let mut n = 0;
    loop {
        line.clear();
        if reader.read_line(&mut line)? == 0 {
            return Ok(());
        }
        n += 1;
        if line.trim().is_empty() {
            continue;
        }
        each(n, json_fields(&line));
    }
}

fn json_fields(line: &str) -> Result<Fields<'_>, String> {
    let l: Line<'_> = serde_json::from_str(line).map_err(|e| {
        // serde's own words name fields and columns, never values.
        let s = e.to_string();
        match s.rsplit_once(" at line ") {
            Some((what, at)) => format!(
                "not a JSON object of a key: {what} (column {})",
                at.rsplit(' ').next().unwrap_or("?")
            ),
            None => format!("not a JSON object of a key: {s}"),
        }
    })?;
    let text = |name: &str, v: Option<&RawValue>| -> Result<Option<Cow<'_, str>>, String> {
        v.map(|v| {
            serde_json::from_str::<Cow<'_, str>>(v.get())
                .map_err(|_| format!("`{name}`: expected a string"))
        })
        .transpose()
    };
    let number = |name: &str, v: Option<&RawValue>| -> Result<Option<f64>, String> {
        v.map(|v| {
            serde_json::from_str::<f64>(v.get()).map_err(|_| format!("`{name}`: expected a number"))
        })
        .transpose()
    };
    let quotas = l
        .quotas
        .map(|v| {
            #[derive(Deserialize)]
            #[serde(deny_unknown_fields)]
            struct Q<'a> {
                limit: f64,
                #[serde(borrow)]
                period: Cow<'a, str>,
            }
            let qs: Vec<Q<'_>> = serde_json::from_str(v.get()).map_err(|_| {
                "`quotas`: expected a list of {\"limit\": N, \"period\": \"day\"}".to_string()
            })?;
            let mut out: Vec<Quota> = Vec::new();
            for (i, q) in qs.iter().enumerate() {
                out.push(quota(q.limit, &q.period).map_err(|e| format!("`quotas[{i}]`: {e}"))?);
            }
            one_per_period(&out)?;
            Ok::<_, String>(out)
        })
        .transpose()?;
    Ok(Fields {
        id: text("id", l.id)?,
        key: text("key", l.key)?,
        sha256: text("sha256", l.sha256)?,
        plan: text("plan", l.plan)?,
        quotas,
        capacity: number("capacity", l.capacity)?
            .map(|c| whole("capacity", c))
            .transpose()?,
        refill_per_sec: number("refill_per_sec", l.refill_per_sec)?,
    })
}

fn read_csv(
    reader: impl std::io::Read,
    mut each: impl FnMut(usize, Result<Fields<'_>, String>),
) -> std::io::Result<()> {
    const COLUMNS: [&str; 7] = [
        "id",
        "key",
        "sha256",
        "plan",
        "quotas",
        "capacity",
        "refill_per_sec",
    ];
    let mut r = csv::ReaderBuilder::new()
        .has_headers(true)
        .trim(csv::Trim::All)
        .from_reader(reader);
    let headers = match r.headers() {
        Ok(h) => h.clone(),
        Err(e) => {
            each(1, Err(format!("not a CSV header: {}", csv_error(&e))));
            return Ok(());
        }
    };
    let mut col = [None; 7];
    for (i, h) in headers.iter().enumerate() {
        let problem = match COLUMNS.iter().position(|c| c.eq_ignore_ascii_case(h)) {
            Some(c) if col[c].is_none() => {
                col[c] = Some(i);
                continue;
            }
            Some(_) => format!("column `{h}` is named twice"),
            None => format!(
                "unknown column `{h}`; the columns are {}",
                COLUMNS.join(", ")
            ),
        };
        each(1, Err(problem));
        return Ok(());
    }
    let mut record = csv::StringRecord::new();
    loop {
        let n = r.position().line() as usize;
        match r.read_record(&mut record) {
            Ok(false) => return Ok(()),
            Ok(true) => {
                let n = record.position().map_or(n, |p| p.line() as usize);
                let field = |c: usize| -> Option<&str> {
                    col[c].and_then(|i| record.get(i)).filter(|s| !s.is_empty())
                };
                let parsed = (|| {
                    let num = |c: usize| -> Result<Option<f64>, String> {
                        field(c)
                            .map(|s| {
                                s.parse::<f64>()
                                    .map_err(|_| format!("`{}`: expected a number", COLUMNS[c]))
                            })
                            .transpose()
                    };
                    Ok(Fields {
                        id: field(0).map(Cow::Borrowed),
                        key: field(1).map(Cow::Borrowed),
                        sha256: field(2).map(Cow::Borrowed),
                        plan: field(3).map(Cow::Borrowed),
                        quotas: field(4).map(csv_quotas).transpose()?,
                        capacity: num(5)?.map(|c| whole("capacity", c)).transpose()?,
                        refill_per_sec: num(6)?,
                    })
                })();
                each(n, parsed);
            }
            Err(e) if e.is_io_error() => {
                return Err(match e.into_kind() {
                    csv::ErrorKind::Io(e) => e,
                    _ => std::io::Error::other("read error"),
                })
            }
            Err(e) => {
                let n = e.position().map_or(n, |p| p.line() as usize);
                each(n, Err(csv_error(&e)));
            }
        }
    }
}

/// A CSV error in its own words, without the record it quotes.
fn csv_error(e: &csv::Error) -> String {
    match e.kind() {
        csv::ErrorKind::UnequalLengths {
            expected_len, len, ..
        } => {
            format!("{len} fields where the header has {expected_len}")
        }
        csv::ErrorKind::Utf8 { .. } => "not UTF-8".into(),
        _ => "not a CSV record".into(),
    }
}

/// `1000/day;30000/month`.
fn csv_quotas(s: &str) -> Result<Vec<Quota>, String> {
    let mut out = Vec::new();
    for (i, part) in s
        .split(';')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .enumerate()
    {
        let (limit, period) = part
            .split_once('/')
            .ok_or_else(|| format!("`quotas[{i}]`: expected LIMIT/PERIOD, e.g. 1000/day"))?;
        let limit = limit
            .trim()
            .parse::<f64>()
            .map_err(|_| format!("`quotas[{i}]`: expected a whole number before the /"))?;
        out.push(quota(limit, period.trim()).map_err(|e| format!("`quotas[{i}]`: {e}"))?);
    }
    one_per_period(&out)?;
    Ok(out)
}

fn quota(limit: f64, period: &str) -> Result<Quota, String> {
    let period = Period::ALL
        .iter()
        .find(|(name, _)| *name == period)
        .map(|(_, p)| *p)
        .ok_or_else(|| {
            let names: Vec<&str> = Period::ALL.iter().map(|(n, _)| *n).collect();
            format!("period \"{period}\" is not one of {}", names.join(", "))
        })?;
    Ok(Quota {
        limit: whole("limit", limit)?,
        period,
        charged: false,
    })
}

fn one_per_period(q: &[Quota]) -> Result<(), String> {
    (0..q.len()).try_for_each(|i| rules::new_period(&q[..i], q[i].period, q[i].charged))
}

/// A whole number in 1..=2^40, as `[[api_keys]]` takes it.
fn whole(name: &str, v: f64) -> Result<u64, String> {
    if v.fract() == 0.0 && (1.0..=rules::MAX_COUNT as f64).contains(&v) {
        Ok(v as u64)
    } else {
        Err(format!(
            "`{name}`: expected a whole number from 1 to {}",
            rules::MAX_COUNT
        ))
    }
}

/// A line that passed `[[api_keys]]`'s rules.
#[derive(Debug, Clone, PartialEq)]
pub struct Checked {
    pub id: String,
    pub digest: [u8; 32],
    pub plan: String,
    pub quotas: Option<Vec<Quota>>,
    pub burst: Option<Burst>,
}

/// One key as a JSON object (a line of the file, a record in Redis),
/// checked by `[[api_keys]]`'s rules; with `plans`, its plan must be one.
pub fn parse_record(line: &str, plans: Option<&BTreeMap<String, Plan>>) -> Result<Checked, String> {
    let f = json_fields(line)?;
    match plans {
        Some(p) => checked(f, p),
        None => checked_with(f, |_| Ok(())),
    }
}

/// A key as a JSON object, in sha256 form: what Redis keeps.
pub fn record(k: &Checked) -> String {
    let mut v = serde_json::json!({
        "id": k.id,
        "sha256": hex::encode(k.digest),
        "plan": k.plan,
    });
    if let Some(q) = &k.quotas {
        v["quotas"] = q
            .iter()
            .map(|q| serde_json::json!({"limit": q.limit, "period": q.period.as_str()}))
            .collect();
    }
    if let Some(b) = k.burst {
        v["capacity"] = b.capacity.into();
        v["refill_per_sec"] = b.refill_per_sec.into();
    }
    v.to_string()
}

fn checked(f: Fields<'_>, plans: &BTreeMap<String, Plan>) -> Result<Checked, String> {
    checked_with(f, |plan| {
        rules::plan(plan, plans.keys().map(String::as_str))
    })
}

fn checked_with(
    f: Fields<'_>,
    plan_ok: impl Fn(&str) -> Result<(), String>,
) -> Result<Checked, String> {
    // The value rules are the config's (`config::rules`), named by field.
    fn at(field: &'static str) -> impl Fn(String) -> String {
        move |e| format!("`{field}`: {e}")
    }
    let id = f.id.ok_or("missing `id`")?;
    rules::name(&id).map_err(at("id"))?;
    let plan = f.plan.ok_or("missing `plan`")?;
    plan_ok(&plan)?;
    let digest = match (f.key, f.sha256) {
        (Some(k), None) => rules::secret(&k).map_err(at("key"))?,
        (None, Some(h)) => rules::sha256(&h).map_err(at("sha256"))?,
        (Some(_), Some(_)) => return Err("give either `key` or `sha256`, not both".into()),
        (None, None) => return Err("missing `key` or `sha256`".into()),
    };
    let burst = match (f.capacity, f.refill_per_sec) {
        (None, None) => None,
        (Some(capacity), Some(r)) if r.is_finite() && r > 0.0 => Some(Burst {
            capacity,
            refill_per_sec: r,
        }),
        (Some(_), Some(_)) => return Err("`refill_per_sec`: expected a positive number".into()),
        (Some(_), None) => return Err("`capacity` needs `refill_per_sec` beside it".into()),
        (None, Some(_)) => return Err("`refill_per_sec` needs `capacity` beside it".into()),
    };
    Ok(Checked {
        id: id.into_owned(),
        digest,
        plan: plan.into_owned(),
        quotas: f.quotas,
        burst,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plans() -> BTreeMap<String, Plan> {
        ["free", "pro"]
            .iter()
            .map(|n| {
                (
                    n.to_string(),
                    Plan {
                        priority: 0,
                        capacity: 10,
                        refill_per_sec: 1.0,
                        quotas: vec![],
                    },
                )
            })
            .collect()
    }

    fn write(name: &str, text: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("apikeys-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    fn err(name: &str, text: &str) -> String {
        load(&write(name, text), &[], &plans())
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn json_lines_with_every_field() {
        let hex = hex::encode(super::super::digest_of("s2"));
        let text = format!(
            "{{\"id\":\"a\",\"key\":\"s1\",\"plan\":\"free\"}}\n\n{{\"id\":\"b\",\"sha256\":\"{hex}\",\"plan\":\"pro\",\"quotas\":[{{\"limit\":5,\"period\":\"day\"}}],\"capacity\":3,\"refill_per_sec\":0.5}}\n"
        );
        let set = load(&write("ok.jsonl", &text), &[], &plans()).unwrap();
        assert_eq!(set.len(), 2);
        assert_eq!(set.lookup(b"s1").unwrap().plan, "free");
        let b = set.lookup(b"s2").unwrap();
        assert_eq!(b.id, "b");
        assert_eq!(
            b.burst,
            Some(Burst {
                capacity: 3,
                refill_per_sec: 0.5
            })
        );
        assert_eq!(b.quotas.unwrap()[0].limit, 5);
    }

    #[test]
    fn csv_with_a_header() {
        let text = "id,key,plan,quotas,capacity,refill_per_sec\na,s1,free,,,\n\"b\",s2,pro,10/day;100/month,4,2\n";
        let set = load(&write("ok.csv", text), &[], &plans()).unwrap();
        assert_eq!(set.len(), 2);
        let b = set.lookup(b"s2").unwrap();
        assert_eq!(b.quotas.unwrap().len(), 2);
        assert_eq!(b.burst.unwrap().capacity, 4);
    }

    #[test]
    fn each_bad_line_is_named_and_no_secret_is_repeated() {
        let text = [
            r#"{"id":"a","key":"top-secret-1","plan":"free"}"#,
            r#"{"id":"b","key":"top-secret-2","plan":"gold"}"#,
            r#"{"id":"c","key":"top-secret-3","plan":"free","colour":"red"}"#,
            r#"{"id":"d","key":5,"plan":"free"}"#,
            r#"{"id":"e","sha256":"abc","plan":"free"}"#,
            r#"{"id":"f","key":"top-secret-1","plan":"free"}"#,
            r#"{"id":"a","key":"top-secret-7","plan":"free"}"#,
            r#"{"id":"g","key":"top-secret-8","plan":"free","capacity":3}"#,
            r#"{"id":"h" "key":"top-secret-9"}"#,
        ]
        .join("\n");
        let e = err("bad.jsonl", &text);
        for want in [
            "line 2: plan \"gold\" is not defined; defined plans: [free, pro]",
            "line 3: not a JSON object of a key: unknown field `colour`",
            "line 4: `key`: expected a string",
            "line 5: `sha256`: expected 64 hex digits (a SHA-256 digest), found 3 characters",
            "line 6: the same key as line 1 (id \"a\")",
            "line 8: `capacity` needs `refill_per_sec` beside it",
            "line 9: not a JSON object of a key: expected `,` or `}` (column 11)",
            "the whole file is refused",
        ] {
            assert!(e.contains(want), "{want:?} not in {e}");
        }
        // The duplicate id is found only once every line is good.
        assert!(!e.contains("top-secret"), "{e}");
        let e = err(
            "dup.jsonl",
            &text
                .lines()
                .take(1)
                .chain(text.lines().skip(6).take(1))
                .collect::<Vec<_>>()
                .join("\n"),
        );
        assert!(
            e.contains("line 2: duplicate id \"a\" (first at line 1)"),
            "{e}"
        );
    }

    #[test]
    fn bad_csv_is_named_by_line() {
        let e = err("bad.csv", "id,key,plan\na,s1,free\nb,s2\nc,s3,gold\n");
        assert!(e.contains("line 3: 2 fields where the header has 3"), "{e}");
        assert!(e.contains("line 4: plan \"gold\""), "{e}");
        assert!(err("cols.csv", "id,secret,plan\n").contains("line 1: unknown column `secret`"));
    }

    #[test]
    fn a_key_of_the_config_and_of_the_file_conflict() {
        let inline = vec![ApiKey {
            id: "a".into(),
            digest: super::super::digest_of("s1"),
            plan: "free".into(),
            quotas: None,
            burst: None,
        }];
        let p = write("conflict.jsonl", "{\"id\":\"b\",\"key\":\"s1\",\"plan\":\"free\"}\n{\"id\":\"a\",\"key\":\"s9\",\"plan\":\"free\"}\n");
        let e = load(&p, &inline, &plans()).unwrap_err().to_string();
        assert!(
            e.contains("line 1: the same key as api_keys[0] in the config (id \"a\")"),
            "{e}"
        );
        let p = write(
            "conflict2.jsonl",
            "{\"id\":\"a\",\"key\":\"s9\",\"plan\":\"free\"}\n",
        );
        let e = load(&p, &inline, &plans()).unwrap_err().to_string();
        assert!(
            e.contains("line 1: duplicate id \"a\" (first at api_keys[0] in the config)"),
            "{e}"
        );
    }

    #[test]
    fn an_unreadable_file_says_so() {
        let e = load(Path::new("/nonexistent/keys.jsonl"), &[], &plans())
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("/nonexistent/keys.jsonl: cannot read it:"),
            "{e}"
        );
    }
}
