//! `[tracing]`: OpenTelemetry traces (src/traces/). Absent: none. The
//! standard `OTEL_*` variables override these keys where the process runs
//! (`TracingSettings::from_env`), as the OpenTelemetry spec says.

use toml::de::DeTable;

use super::model::TracingSettings;
use super::reader::{opt, Reader};
use super::url::HttpUrl;

pub const TRACING_KEYS: &[&str] = &["otlp_endpoint", "sample_ratio", "service_name"];

pub(super) fn read(r: &mut Reader<'_>, t: &DeTable<'_>) -> Option<TracingSettings> {
    let p = "tracing";
    r.only_keys(p, t, TRACING_KEYS);
    let d = TracingSettings::default();
    let endpoint = opt(r, t, p, "otlp_endpoint", d.otlp_endpoint, |r, path, v| {
        let s = r.string(path, v)?;
        match otlp_endpoint(&s) {
            Ok(()) => Some(s),
            Err(e) => {
                r.error(path, Some(&v.span()), e);
                None
            }
        }
    });
    let ratio = opt(r, t, p, "sample_ratio", d.sample_ratio, |r, path, v| {
        r.fraction(path, v)
    });
    let service = opt(r, t, p, "service_name", d.service_name, |r, path, v| {
        let s = r.string(path, v)?;
        if s.trim().is_empty() {
            r.error(path, Some(&v.span()), "expected a service name, found \"\"");
            return None;
        }
        Some(s)
    });
    Some(TracingSettings {
        otlp_endpoint: endpoint?,
        sample_ratio: ratio?,
        service_name: service?,
    })
}

/// An OTLP/HTTP base URL: plain `http://` (the exporter speaks no TLS: a
/// collector beside the gateway, or a sidecar, takes the spans on).
pub fn otlp_endpoint(s: &str) -> Result<(), String> {
    let url = HttpUrl::parse(s)?;
    if url.https {
        return Err(format!(
            "\"{s}\": spans go over plain http:// to a collector beside the gateway (no TLS to the collector)"
        ));
    }
    Ok(())
}

impl TracingSettings {
    /// The settings in force where the process runs: the standard variables
    /// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (the whole URL),
    /// `OTEL_EXPORTER_OTLP_ENDPOINT` (a base URL, `/v1/traces` added),
    /// `OTEL_SERVICE_NAME` and `OTEL_TRACES_SAMPLER_ARG` win over the keys.
    /// A variable that does not read is an error naming it.
    pub fn from_env(&self, var: impl Fn(&str) -> Option<String>) -> Result<Resolved, String> {
        let set = |name: &str| var(name).filter(|v| !v.trim().is_empty());
        let traces_url = match (
            set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
            set("OTEL_EXPORTER_OTLP_ENDPOINT"),
        ) {
            (Some(full), _) => {
                otlp_endpoint(&full)
                    .map_err(|e| format!("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: {e}"))?;
                full
            }
            (None, Some(base)) => {
                otlp_endpoint(&base).map_err(|e| format!("OTEL_EXPORTER_OTLP_ENDPOINT: {e}"))?;
                traces_path(&base)
            }
            (None, None) => traces_path(&self.otlp_endpoint),
        };
        let sample_ratio = match set("OTEL_TRACES_SAMPLER_ARG") {
            Some(v) => match v.trim().parse::<f64>() {
                Ok(n) if (0.0..=1.0).contains(&n) => n,
                _ => {
                    return Err(format!(
                        "OTEL_TRACES_SAMPLER_ARG: expected a number from 0 to 1, found \"{v}\""
                    ))
                }
            },
            None => self.sample_ratio,
        };
        Ok(Resolved {
            traces_url,
            sample_ratio,
            service_name: set("OTEL_SERVICE_NAME").unwrap_or_else(|| self.service_name.clone()),
        })
    }
}

/// A base URL's traces path, as the OTLP spec builds it.
fn traces_path(base: &str) -> String {
    format!("{}/v1/traces", base.trim_end_matches('/'))
}

/// `[tracing]` with the environment applied.
#[derive(Debug, Clone, PartialEq)]
pub struct Resolved {
    /// Where spans are POSTed (`…/v1/traces`).
    pub traces_url: String,
    pub sample_ratio: f64,
    pub service_name: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_standard_variables_win_over_the_keys() {
        let keys = TracingSettings {
            otlp_endpoint: "http://collector:4318/".into(),
            sample_ratio: 0.01,
            service_name: "edge".into(),
        };
        let none = |_: &str| None;
        let r = keys.from_env(none).unwrap();
        assert_eq!(r.traces_url, "http://collector:4318/v1/traces");
        assert_eq!((r.sample_ratio, r.service_name.as_str()), (0.01, "edge"));
        let env = |name: &str| {
            match name {
                "OTEL_EXPORTER_OTLP_ENDPOINT" => Some("http://otel:4318"),
                "OTEL_SERVICE_NAME" => Some("gw"),
                "OTEL_TRACES_SAMPLER_ARG" => Some("0.5"),
                _ => None,
            }
            .map(str::to_string)
        };
        let r = keys.from_env(env).unwrap();
        assert_eq!(r.traces_url, "http://otel:4318/v1/traces");
        assert_eq!((r.sample_ratio, r.service_name.as_str()), (0.5, "gw"));
        // The signal's own variable is the whole URL.
        let full = |name: &str| {
            (name == "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").then(|| "http://t:1/x".to_string())
        };
        assert_eq!(keys.from_env(full).unwrap().traces_url, "http://t:1/x");
        let bad = |name: &str| (name == "OTEL_TRACES_SAMPLER_ARG").then(|| "2".to_string());
        assert!(keys
            .from_env(bad)
            .unwrap_err()
            .starts_with("OTEL_TRACES_SAMPLER_ARG: expected a number from 0 to 1"));
        let tls = |name: &str| {
            (name == "OTEL_EXPORTER_OTLP_ENDPOINT").then(|| "https://otel:4318".to_string())
        };
        assert!(keys.from_env(tls).unwrap_err().contains("plain http://"));
    }
}
