//! `[traces]`: OpenTelemetry traces exported over OTLP, off by default. Read once at load; `main.rs` builds
//! the exporter from it (`otlp.rs`) and `proxy.rs` opens the request's spans only while it is on. Two
//! forms: [`RawTraces`] as written (the export's settings left unset fall back to the standard
//! `OTEL_EXPORTER_OTLP_*` variables, read by the exporter), [`TracesConfig`] as run.

use std::collections::BTreeMap;
use std::time::Duration;

use http::{HeaderName, HeaderValue, Uri};
use serde::{Deserialize, Serialize};

use super::ConfigError;
use super::parse::{positive, within};

/// The `protocol` OTLP is sent with: protobuf over HTTP (the only one this build speaks).
pub const HTTP_PROTOBUF: &str = "http/protobuf";

/// The service name spans are exported under, unless `service_name` or `OTEL_SERVICE_NAME` says another.
pub const DEFAULT_SERVICE_NAME: &str = "idemproxy";

/// Where OTLP/HTTP takes traces below the collector's base URL.
const TRACES_PATH: &str = "/v1/traces";

/// `[traces]`, as written.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawTraces {
    /// Export a span per request (and its claim, upstream call and completion) over OTLP.
    pub enabled: bool,
    /// The collector's OTLP/HTTP URL: a base (`http://collector:4318`, to which `/v1/traces` is added) or
    /// the traces URL itself. Unset: `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, `OTEL_EXPORTER_OTLP_ENDPOINT`,
    /// else `http://localhost:4318/v1/traces`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    /// How spans are sent: `"http/protobuf"`.
    pub protocol: String,
    /// The `service.name` of the exported spans. Unset: `OTEL_SERVICE_NAME`, else `idemproxy`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub service_name: Option<String>,
    /// Share of the traces this proxy starts (requests without a sampled `traceparent`) that are
    /// recorded, 0 to 1; a request whose caller decided follows the caller's decision.
    pub sample_ratio: f64,
    /// Bound on one export request. Unset: `OTEL_EXPORTER_OTLP_TRACES_TIMEOUT`,
    /// `OTEL_EXPORTER_OTLP_TIMEOUT`, else 10 s.
    #[serde(
        default,
        with = "humantime_serde::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub timeout: Option<Duration>,
    /// Longest a finished span waits before it is sent with others.
    #[serde(with = "humantime_serde")]
    pub batch_delay: Duration,
    /// Most spans in one export request.
    pub max_batch: usize,
    /// Most finished spans held while the collector is slow or away; past it new spans are dropped.
    pub max_queue: usize,
    /// Headers on every export request (a collector's credentials); added to `OTEL_EXPORTER_OTLP_HEADERS`.
    /// `check-config` masks their values.
    pub headers: BTreeMap<String, String>,
}

impl Default for RawTraces {
    fn default() -> Self {
        RawTraces {
            enabled: false,
            endpoint: None,
            protocol: HTTP_PROTOBUF.into(),
            service_name: None,
            sample_ratio: 1.0,
            timeout: None,
            batch_delay: Duration::from_secs(5),
            max_batch: 512,
            max_queue: 2048,
            headers: BTreeMap::new(),
        }
    }
}

/// `[traces]`, as run.
#[derive(Debug, Clone, PartialEq)]
pub struct TracesConfig {
    /// Whether spans are made and exported at all.
    pub enabled: bool,
    /// The traces URL, when the configuration names one.
    pub endpoint: Option<String>,
    /// The service name, when the configuration names one.
    pub service_name: Option<String>,
    /// Share of root traces recorded.
    pub sample_ratio: f64,
    /// Bound on one export request, when the configuration sets one.
    pub timeout: Option<Duration>,
    /// Longest a finished span waits to be sent.
    pub batch_delay: Duration,
    /// Most spans in one export.
    pub max_batch: usize,
    /// Most finished spans held.
    pub max_queue: usize,
    /// Headers on every export request.
    pub headers: Vec<(HeaderName, HeaderValue)>,
}

impl Default for TracesConfig {
    fn default() -> Self {
        RawTraces::default()
            .validate()
            .expect("the default [traces] section is valid")
    }
}

impl RawTraces {
    /// Checks the section and converts it; the first problem found is named.
    pub fn validate(&self) -> Result<TracesConfig, ConfigError> {
        if self.enabled && !cfg!(feature = "otlp") {
            let msg = "this build has no OTLP export (built without the `otlp` feature)";
            return Err(ConfigError::new("traces.enabled", msg));
        }
        if self.protocol != HTTP_PROTOBUF {
            let msg = format!(
                "{:?} is not spoken here; use \"{HTTP_PROTOBUF}\" (a collector's port 4318)",
                self.protocol
            );
            return Err(ConfigError::new("traces.protocol", msg));
        }
        if !(0.0..=1.0).contains(&self.sample_ratio) {
            return Err(ConfigError::new("traces.sample_ratio", "must be between 0 and 1"));
        }
        if let Some(timeout) = self.timeout {
            positive("traces.timeout", timeout)?;
        }
        positive("traces.batch_delay", self.batch_delay)?;
        within("traces.max_queue", self.max_queue, 1..=1_000_000)?;
        within("traces.max_batch", self.max_batch, 1..=self.max_queue)?;
        if self.service_name.as_deref().is_some_and(str::is_empty) {
            return Err(ConfigError::new("traces.service_name", "must not be empty"));
        }
        Ok(TracesConfig {
            enabled: self.enabled,
            endpoint: self.endpoint.as_deref().map(traces_url).transpose()?,
            service_name: self.service_name.clone(),
            sample_ratio: self.sample_ratio,
            timeout: self.timeout,
            batch_delay: self.batch_delay,
            max_batch: self.max_batch,
            max_queue: self.max_queue,
            headers: self.headers()?,
        })
    }

    fn headers(&self) -> Result<Vec<(HeaderName, HeaderValue)>, ConfigError> {
        self.headers
            .iter()
            .map(|(name, value)| {
                let key = format!("traces.headers.{name}");
                let name = HeaderName::from_bytes(name.as_bytes())
                    .map_err(|_| ConfigError::new(&key, "is not a header name"))?;
                let mut value = HeaderValue::from_str(value)
                    .map_err(|_| ConfigError::new(&key, "is not a header value"))?;
                value.set_sensitive(true);
                Ok((name, value))
            })
            .collect()
    }
}

/// The traces URL of an `endpoint`: an http(s) URL, `/v1/traces` added to one without a path.
fn traces_url(endpoint: &str) -> Result<String, ConfigError> {
    let bad = |why: &str| ConfigError::new("traces.endpoint", format!("{endpoint:?} {why}"));
    let uri: Uri = endpoint.parse().map_err(|_| bad("is not a URL"))?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.authority().is_none() {
        return Err(bad("is not an http:// or https:// URL"));
    }
    if uri.path() == "/" && uri.query().is_none() {
        return Ok(format!("{}{TRACES_PATH}", endpoint.trim_end_matches('/')));
    }
    Ok(endpoint.to_owned())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::config::Config;

    #[test]
    fn traces_are_off_by_default_and_leave_the_export_to_the_standard_variables() {
        let traces = Config::from_toml_str("").unwrap().traces;
        assert!(!traces.enabled);
        assert_eq!(traces.endpoint, None);
        assert_eq!(traces.service_name, None);
        assert_eq!(traces.timeout, None);
        assert_eq!(traces.sample_ratio, 1.0);
        assert_eq!(
            (traces.batch_delay, traces.max_batch, traces.max_queue),
            (Duration::from_secs(5), 512, 2048)
        );
    }

    #[test]
    fn a_base_url_gets_the_traces_path_and_a_full_one_is_kept() {
        for (written, used) in [
            ("http://collector:4318", "http://collector:4318/v1/traces"),
            ("http://collector:4318/", "http://collector:4318/v1/traces"),
            ("https://otlp.example/v1/traces", "https://otlp.example/v1/traces"),
            ("http://gw:80/otlp/v1/traces", "http://gw:80/otlp/v1/traces"),
        ] {
            let config = Config::from_toml_str(&format!("[traces]\nendpoint = \"{written}\"\n")).unwrap();
            assert_eq!(config.traces.endpoint.as_deref(), Some(used), "{written}");
        }
    }

    #[test]
    fn each_bad_setting_names_its_key() {
        for (text, key) in [
            ("endpoint = \"collector:4318\"", "traces.endpoint"),
            ("endpoint = \"grpc://collector:4317\"", "traces.endpoint"),
            ("protocol = \"grpc\"", "traces.protocol"),
            ("sample_ratio = 1.5", "traces.sample_ratio"),
            ("sample_ratio = -0.1", "traces.sample_ratio"),
            ("timeout = \"0s\"", "traces.timeout"),
            ("batch_delay = \"0s\"", "traces.batch_delay"),
            ("max_batch = 0", "traces.max_batch"),
            ("max_batch = 4096", "traces.max_batch"),
            ("service_name = \"\"", "traces.service_name"),
            (
                "headers = { \"bad header\" = \"x\" }",
                "traces.headers.bad header",
            ),
            (
                "headers = { authorization = \"a\\nb\" }",
                "traces.headers.authorization",
            ),
        ] {
            let err = Config::from_toml_str(&format!("[traces]\n{text}\n")).unwrap_err();
            assert_eq!(err.key, key, "{text}: {err}");
        }
    }

    #[test]
    fn export_headers_are_masked_when_the_config_is_printed() {
        let config =
            Config::from_toml_str("[traces]\nheaders = { authorization = \"Bearer s3cret-token\" }\n")
                .unwrap();
        let (name, value) = &config.traces.headers[0];
        assert_eq!((name.as_str(), value.is_sensitive()), ("authorization", true));
        let printed = config.to_masked_toml();
        assert!(!printed.contains("s3cret-token"), "{printed}");
        assert!(printed.contains("authorization = \"***\""), "{printed}");
    }
}
