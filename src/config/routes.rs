//! `[[routes]]`: per-endpoint policies. Each route matches requests by path (exact, prefix, or a glob
//! whose `*` stands for one segment) and optionally by method; the first match wins, and a request no
//! route matches takes the default route, which is `[idempotency]` itself. A route's own policy is the
//! section's with the route's keys laid over it, validated as the section is (its errors name
//! `routes[2].ttl`). Validation also refuses a route no request can reach because an earlier one
//! matches everything it does. `proxy.rs` asks [`RouteTable::select`] for every request.

use std::fmt::Write as _;
use std::sync::Arc;

use figment::value::{Dict, Value};
use http::Method;
use serde::{Deserialize, Serialize};

use super::ConfigError;
use super::idempotency::{IdempotencyConfig, RawIdempotency};
use super::signature::SecretReader;

/// The default route's name and scope name: the scope every key had before routes existed.
pub const DEFAULT_ROUTE: &str = "default";

/// One `[[routes]]` entry as written: how it matches, and the `[idempotency]` keys it overrides.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RawRoute {
    /// The route's name, in logs, the access log and `check-config`; also its scope name by default.
    pub name: String,
    /// The scope name its keys are unique within (default: `name`). Two routes with one scope name share
    /// their keys.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scope: Option<String>,
    /// The path matched exactly, or, with `*` segments, as a glob (`/v1/orders/*/refund`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// A path prefix (`/webhooks/`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path_prefix: Option<String>,
    /// Methods the route matches; empty means every method.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub match_methods: Vec<String>,
    /// Forward every request this route matches without idempotency.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub passthrough: bool,
    /// Keys of `[idempotency]` this route sets for itself.
    #[serde(flatten)]
    pub policy: Dict,
}

/// How a route matches a request's path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathMatch {
    /// The whole path.
    Exact(String),
    /// The path's beginning.
    Prefix(String),
    /// Segment by segment; `None` is a `*`, matching any one non-empty segment.
    Glob(Vec<Option<String>>),
}

/// A validated route.
#[derive(Debug, Clone)]
pub struct Route {
    /// The route's name.
    pub name: String,
    /// The scope name of its keys.
    pub scope: String,
    /// How it matches the path; `None` for the default route, which matches everything.
    pub path: Option<PathMatch>,
    /// Methods it matches; `None` means every method.
    pub methods: Option<Vec<Method>>,
    /// Forwards without idempotency.
    pub passthrough: bool,
    /// Its policy.
    pub policy: IdempotencyConfig,
}

/// Every route in match order, and the default route behind them.
#[derive(Debug, Clone)]
pub struct RouteTable {
    /// The `[[routes]]`, first match wins.
    pub routes: Vec<Arc<Route>>,
    /// `[idempotency]`, for requests no route matches.
    pub default: Arc<Route>,
}

impl RouteTable {
    /// Validates the routes over the section they inherit from, reading their signature secrets
    /// through `secrets`.
    pub fn new(
        section: &RawIdempotency,
        default: IdempotencyConfig,
        raw: &[RawRoute],
        secrets: &dyn SecretReader,
    ) -> Result<RouteTable, ConfigError> {
        let base = section_dict(section)?;
        let mut routes: Vec<Arc<Route>> = Vec::with_capacity(raw.len());
        for (index, route) in raw.iter().enumerate() {
            let prefix = format!("routes[{index}]");
            let route = route.validate(&prefix, &base, secrets)?;
            if let Some(earlier) = routes.iter().find(|r| r.name == route.name) {
                return Err(ConfigError::new(
                    &format!("{prefix}.name"),
                    format!("{:?} is already the name of an earlier route", earlier.name),
                ));
            }
            if let Some((at, earlier)) = routes.iter().enumerate().find(|(_, r)| r.covers(&route)) {
                return Err(ConfigError::new(
                    &prefix,
                    format!(
                        "route {:?} can never match: routes[{at}] ({:?}) comes first and matches every \
                         request it would; put the narrower route first",
                        route.name, earlier.name
                    ),
                ));
            }
            routes.push(Arc::new(route));
        }
        let default = Arc::new(Route {
            name: DEFAULT_ROUTE.into(),
            scope: DEFAULT_ROUTE.into(),
            path: None,
            methods: None,
            passthrough: false,
            policy: default,
        });
        Ok(RouteTable { routes, default })
    }

    /// The route a request takes: the first that matches, else the default.
    pub fn select(&self, method: &Method, path: &str) -> &Arc<Route> {
        self.routes
            .iter()
            .find(|route| route.matches(method, path))
            .unwrap_or(&self.default)
    }

    /// Every route's policy, the default's included.
    pub fn policies(&self) -> impl Iterator<Item = &IdempotencyConfig> {
        self.routes
            .iter()
            .chain(std::iter::once(&self.default))
            .map(|route| &route.policy)
    }

    /// The resolved table as TOML comments, for `check-config`.
    pub fn describe(&self) -> String {
        let mut out = String::from("\n# Routes, in match order (first match wins):\n");
        for (index, route) in self.routes.iter().enumerate() {
            let _ = writeln!(out, "#   {index}. {}", route.describe());
        }
        let _ = writeln!(out, "#   -. {}", self.default.describe());
        out
    }
}

impl RawRoute {
    fn validate(&self, prefix: &str, base: &Dict, secrets: &dyn SecretReader) -> Result<Route, ConfigError> {
        let key = |field: &str| format!("{prefix}.{field}");
        let name = check_name(&key("name"), &self.name)?;
        let scope = match &self.scope {
            Some(scope) => check_name(&key("scope"), scope)?,
            None => name.clone(),
        };
        if name == DEFAULT_ROUTE {
            return Err(ConfigError::new(
                &key("name"),
                "\"default\" is the name of [idempotency]'s route; choose another",
            ));
        }
        if self.passthrough && self.policy.contains_key("signature") {
            return Err(ConfigError::new(
                &key("signature"),
                "a passthrough route forwards every request as it is and verifies nothing; drop \
                 passthrough to verify signatures here",
            ));
        }
        Ok(Route {
            path: Some(self.path_match(prefix)?),
            methods: self.match_methods(&key("match_methods"))?,
            passthrough: self.passthrough,
            policy: self.policy(prefix, base, secrets)?,
            name,
            scope,
        })
    }

    fn path_match(&self, prefix: &str) -> Result<PathMatch, ConfigError> {
        match (&self.path, &self.path_prefix) {
            (Some(path), None) => {
                let key = format!("{prefix}.path");
                check_path(&key, path)?;
                if !path.split('/').any(|s| s == "*") {
                    if path.contains('*') {
                        return Err(ConfigError::new(
                            &key,
                            format!("{path:?}: '*' stands for a whole segment (\"/orders/*/refund\")"),
                        ));
                    }
                    return Ok(PathMatch::Exact(path.clone()));
                }
                let segments = path.split('/').map(|s| (s != "*").then(|| s.to_owned()));
                Ok(PathMatch::Glob(segments.collect()))
            }
            (None, Some(start)) => {
                let key = format!("{prefix}.path_prefix");
                check_path(&key, start)?;
                if start.contains('*') {
                    return Err(ConfigError::new(
                        &key,
                        format!("{start:?}: a prefix takes no '*'"),
                    ));
                }
                Ok(PathMatch::Prefix(start.clone()))
            }
            (Some(_), Some(_)) => Err(ConfigError::new(
                &format!("{prefix}.path_prefix"),
                format!("a route matches by {prefix}.path or by {prefix}.path_prefix, not both"),
            )),
            (None, None) => Err(ConfigError::new(
                &format!("{prefix}.path"),
                "a route needs path (exact, or a glob with * segments) or path_prefix",
            )),
        }
    }

    fn match_methods(&self, key: &str) -> Result<Option<Vec<Method>>, ConfigError> {
        if self.match_methods.is_empty() {
            return Ok(None);
        }
        let methods = self.match_methods.iter().map(|m| {
            Method::from_bytes(m.to_ascii_uppercase().as_bytes())
                .map_err(|_| ConfigError::new(key, format!("{m:?} is not an HTTP method")))
        });
        methods.collect::<Result<_, _>>().map(Some)
    }

    /// The section's settings with this route's laid over them, validated under the route's prefix.
    fn policy(
        &self,
        prefix: &str,
        base: &Dict,
        secrets: &dyn SecretReader,
    ) -> Result<IdempotencyConfig, ConfigError> {
        let mut merged = base.clone();
        merged.extend(self.policy.clone());
        let raw: RawIdempotency = Value::from(merged).deserialize().map_err(|e| {
            // An unknown field's path names it when it is nested (`signature.secret`), not at the top.
            let field = match &e.kind {
                figment::error::Kind::UnknownField(field, _) if e.path.last() != Some(field) => {
                    let path = e.path.iter().chain(std::iter::once(field));
                    path.map(String::as_str).collect::<Vec<_>>().join(".")
                }
                _ => e.path.join("."),
            };
            let key = if field.is_empty() {
                prefix.to_owned()
            } else {
                format!("{prefix}.{field}")
            };
            ConfigError::new(&key, e.kind)
        })?;
        raw.validate_with(prefix, secrets)
    }
}

impl Route {
    /// Whether this route takes the request.
    pub fn matches(&self, method: &Method, path: &str) -> bool {
        if let Some(methods) = &self.methods
            && !methods.contains(method)
        {
            return false;
        }
        match &self.path {
            None => true,
            Some(PathMatch::Exact(exact)) => path == exact,
            Some(PathMatch::Prefix(start)) => path.starts_with(start.as_str()),
            Some(PathMatch::Glob(segments)) => glob_matches(segments, path),
        }
    }

    /// Whether every request `later` matches is matched by this route first.
    fn covers(&self, later: &Route) -> bool {
        let methods = match (&self.methods, &later.methods) {
            (None, _) => true,
            (Some(_), None) => false,
            (Some(mine), Some(theirs)) => theirs.iter().all(|m| mine.contains(m)),
        };
        methods && covers_path(self.path.as_ref(), later.path.as_ref())
    }

    fn describe(&self) -> String {
        let methods = match &self.methods {
            None => "*".to_owned(),
            Some(methods) => methods.iter().map(Method::as_str).collect::<Vec<_>>().join(","),
        };
        let path = match &self.path {
            None => "(any other request)".to_owned(),
            Some(PathMatch::Exact(path)) => format!("path = {path:?}"),
            Some(PathMatch::Prefix(start)) => format!("path_prefix = {start:?}"),
            Some(PathMatch::Glob(segments)) => {
                let glob: Vec<&str> = segments.iter().map(|s| s.as_deref().unwrap_or("*")).collect();
                format!("path = {:?}", glob.join("/"))
            }
        };
        let policy = &self.policy;
        if self.passthrough {
            return format!("{:?} {methods} {path}: passthrough", self.name);
        }
        let protected: Vec<&str> = policy.methods.iter().map(Method::as_str).collect();
        format!(
            "{:?} {methods} {path}: scope {:?}, key {}, protects {}{}, ttl {}, lock_timeout {}, \
             on_in_flight {}{}",
            self.name,
            self.scope,
            policy.key,
            protected.join(","),
            if policy.required { " (required)" } else { "" },
            humantime::format_duration(policy.ttl),
            humantime::format_duration(policy.lock_timeout),
            match policy.on_in_flight {
                super::OnInFlight::Reject => "reject".to_owned(),
                super::OnInFlight::Wait =>
                    format!("wait {}", humantime::format_duration(policy.wait_timeout)),
            },
            match &policy.signature {
                Some(signature) => format!(
                    ", signature {} ({} secret{})",
                    signature.scheme.name().as_str(),
                    signature.secrets.len(),
                    if signature.secrets.len() == 1 { "" } else { "s" }
                ),
                None => String::new(),
            },
        )
    }
}

fn covers_path(earlier: Option<&PathMatch>, later: Option<&PathMatch>) -> bool {
    let (Some(earlier), Some(later)) = (earlier, later) else {
        return earlier.is_none();
    };
    match (earlier, later) {
        (PathMatch::Exact(a), PathMatch::Exact(b)) => a == b,
        (PathMatch::Prefix(start), PathMatch::Exact(b) | PathMatch::Prefix(b)) => {
            b.starts_with(start.as_str())
        }
        (PathMatch::Prefix(start), PathMatch::Glob(segments)) => {
            // Every path the glob matches begins with its text up to the first '*'.
            let fixed: Vec<&str> = segments.iter().map_while(|s| s.as_deref()).collect();
            let literal = if fixed.len() == segments.len() {
                fixed.join("/")
            } else {
                format!("{}/", fixed.join("/"))
            };
            literal.starts_with(start.as_str())
        }
        (PathMatch::Glob(mine), PathMatch::Exact(path)) => glob_matches(mine, path),
        (PathMatch::Glob(mine), PathMatch::Glob(theirs)) => {
            mine.len() == theirs.len()
                && mine.iter().zip(theirs).all(|(a, b)| match (a, b) {
                    (None, _) => true,
                    (Some(a), Some(b)) => a == b,
                    (Some(_), None) => false,
                })
        }
        (PathMatch::Exact(_), _) | (PathMatch::Glob(_), PathMatch::Prefix(_)) => false,
    }
}

/// Whether `path` has exactly the glob's segments, a `*` (`None`) standing for any non-empty one.
fn glob_matches(segments: &[Option<String>], path: &str) -> bool {
    let mut parts = path.split('/');
    let all = segments.iter().all(|want| match (want, parts.next()) {
        (_, None) => false,
        (None, Some(part)) => !part.is_empty(),
        (Some(want), Some(part)) => want == part,
    });
    all && parts.next().is_none()
}

/// The section as a dictionary of its settings, for routes to be laid over.
fn section_dict(section: &RawIdempotency) -> Result<Dict, ConfigError> {
    match Value::serialize(section) {
        Ok(Value::Dict(_, dict)) => Ok(dict),
        Ok(_) => Err(ConfigError::new("idempotency", "is not a table")),
        Err(e) => Err(ConfigError::new("idempotency", e)),
    }
}

fn check_name(key: &str, name: &str) -> Result<String, ConfigError> {
    let ok = (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if !ok {
        return Err(ConfigError::new(
            key,
            format!("{name:?}: use 1 to 64 letters, digits, '-', '_' or '.'"),
        ));
    }
    Ok(name.to_owned())
}

fn check_path(key: &str, path: &str) -> Result<(), ConfigError> {
    if !path.starts_with('/') || path.bytes().any(|b| !b.is_ascii_graphic() || b == b'?') {
        return Err(ConfigError::new(
            key,
            format!("{path:?} is not a path: it starts with '/' and holds no spaces or query"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use http::Method;

    use crate::config::{Config, KeySource, OnInFlight};

    fn table(toml: &str) -> crate::config::RouteTable {
        Config::from_toml_str(toml).unwrap().routes
    }

    fn error(toml: &str) -> crate::config::ConfigError {
        Config::from_toml_str(toml).unwrap_err()
    }

    #[test]
    fn first_match_wins_and_the_rest_take_the_default() {
        let routes = table(
            r#"
            [[routes]]
            name = "refunds"
            path = "/v1/orders/*/refund"
            [[routes]]
            name = "orders"
            path_prefix = "/v1/orders"
            match_methods = ["post"]
            [[routes]]
            name = "health"
            path = "/healthz"
            passthrough = true
            "#,
        );
        let name = |method: Method, path: &str| routes.select(&method, path).name.clone();
        assert_eq!(name(Method::POST, "/v1/orders/42/refund"), "refunds");
        assert_eq!(name(Method::POST, "/v1/orders//refund"), "orders");
        assert_eq!(name(Method::POST, "/v1/orders/42/refund/x"), "orders");
        assert_eq!(name(Method::GET, "/v1/orders/42"), "default");
        assert_eq!(name(Method::GET, "/healthz"), "health");
        assert_eq!(name(Method::GET, "/healthz/"), "default");
        assert!(routes.select(&Method::GET, "/healthz").passthrough);
    }

    #[test]
    fn a_route_inherits_the_section_and_overrides_what_it_names() {
        let routes = table(
            r#"
            [idempotency]
            ttl = "12h"
            max_request_body = "1000001 B"
            [[routes]]
            name = "payments"
            path = "/payments"
            required = true
            lock_timeout = "5s"
            on_in_flight = "wait"
            wait_timeout = "3s"
            key = "header:X-Request-Key"
            "#,
        );
        let payments = &routes.routes[0];
        assert_eq!(payments.scope, "payments");
        assert!(payments.policy.required);
        assert_eq!(payments.policy.ttl, Duration::from_secs(12 * 3600));
        assert_eq!(payments.policy.lock_timeout, Duration::from_secs(5));
        assert_eq!(payments.policy.max_request_body, 1_000_001);
        assert_eq!(payments.policy.on_in_flight, OnInFlight::Wait);
        assert_eq!(payments.policy.wait_timeout, Duration::from_secs(3));
        assert_eq!(payments.policy.key.to_string(), "header:x-request-key");
        assert!(!routes.default.policy.required);
        assert_eq!(
            routes.default.policy.key,
            KeySource::Header(http::HeaderName::from_static("idempotency-key"))
        );
    }

    #[test]
    fn errors_name_the_route_key() {
        let base = "[[routes]]\nname = \"a\"\npath = \"/a\"\n";
        for (extra, key) in [
            ("ttl = \"1s\"", "routes[0].ttl"),
            ("ttl = \"soon\"", "routes[0].ttl"),
            ("colour = \"red\"", "routes[0].colour"),
            ("key = \"nope\"", "routes[0].key"),
            ("match_methods = [\"P T\"]", "routes[0].match_methods"),
            ("path_prefix = \"/b\"", "routes[0].path_prefix"),
            ("fingerprint_exclude = [\"/ts\"]", "routes[0].fingerprint_exclude"),
        ] {
            let err = error(&format!("{base}{extra}\n"));
            assert_eq!(err.key, key, "{extra}: {err}");
            assert_eq!(err.to_string().lines().count(), 1, "{err}");
        }
        for (toml, key) in [
            ("[[routes]]\nname = \"a\"\n", "routes[0].path"),
            ("[[routes]]\nname = \"a b\"\npath = \"/a\"\n", "routes[0].name"),
            (
                "[[routes]]\nname = \"default\"\npath = \"/a\"\n",
                "routes[0].name",
            ),
            ("[[routes]]\nname = \"a\"\npath = \"a\"\n", "routes[0].path"),
            ("[[routes]]\nname = \"a\"\npath = \"/a*\"\n", "routes[0].path"),
            (
                "[[routes]]\nname = \"a\"\npath = \"/a\"\n[[routes]]\nname = \"a\"\npath = \"/b\"\n",
                "routes[1].name",
            ),
        ] {
            assert_eq!(error(toml).key, key, "{toml}");
        }
    }

    #[test]
    fn a_route_an_earlier_one_hides_is_refused() {
        for (first, second) in [
            ("path = \"/a\"", "path = \"/a\""),
            ("path_prefix = \"/a\"", "path = \"/a/b\""),
            ("path_prefix = \"/a/\"", "path = \"/a/*/c\""),
            ("path_prefix = \"/a\"", "path_prefix = \"/a/b\""),
            ("path = \"/a/*\"", "path = \"/a/b\""),
            ("path = \"/a/*/*\"", "path = \"/a/*/c\""),
            ("path = \"/a\"", "path = \"/a\"\nmatch_methods = [\"POST\"]"),
        ] {
            let toml = format!("[[routes]]\nname = \"one\"\n{first}\n[[routes]]\nname = \"two\"\n{second}\n");
            let err = error(&toml);
            assert_eq!(err.key, "routes[1]", "{toml}");
            assert!(err.message.contains("routes[0]"), "{err}");
        }
        for (first, second) in [
            ("path = \"/a\"\nmatch_methods = [\"POST\"]", "path = \"/a\""),
            ("path = \"/a/b\"", "path_prefix = \"/a\""),
            ("path = \"/a/*\"", "path = \"/a/b/c\""),
            ("path = \"/a/*/c\"", "path = \"/a/*/*\""),
            ("path_prefix = \"/a/b\"", "path = \"/a/*\""),
        ] {
            let toml = format!("[[routes]]\nname = \"one\"\n{first}\n[[routes]]\nname = \"two\"\n{second}\n");
            assert!(Config::from_toml_str(&toml).is_ok(), "{toml}");
        }
    }

    #[test]
    fn the_table_is_described_for_check_config() {
        let config = Config::from_toml_str(
            "[[routes]]\nname = \"hooks\"\npath_prefix = \"/hooks/\"\nkey = \"header:webhook-id\"\n\
             unscoped = \"shared\"\n",
        )
        .unwrap();
        let printed = config.to_masked_toml();
        assert!(printed.contains("[[routes]]"), "{printed}");
        assert!(
            printed.contains("0. \"hooks\" * path_prefix = \"/hooks/\""),
            "{printed}"
        );
        assert!(printed.contains("key header:webhook-id"), "{printed}");
        assert!(printed.contains("-. \"default\""), "{printed}");
        let again: toml::Table = printed.parse().expect("check-config prints valid TOML");
        assert!(again.contains_key("routes"));
    }
}
