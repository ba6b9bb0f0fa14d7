//! `[[routes]]`: per-endpoint policies. Each route matches requests by path (exact, a prefix of whole
//! segments, or a glob whose `*` stands for one segment; in either case and with an optional trailing
//! slash where the route says so) and optionally by method; the first match wins, and a request no route
//! matches takes the default route, which is `[idempotency]` itself. Paths are compared in their normal
//! form (`config/path.rs`), which route paths must be written in. A route's own policy is the section's
//! with the route's keys laid over it, validated as the section is (its errors name `routes[2].ttl`).
//! Validation also refuses a route no request can reach because an earlier one matches everything it
//! does. `proxy.rs` asks [`RouteTable::select`] for every request, and [`Route::respell`] for the path
//! the chosen route forwards.

use std::fmt::Write as _;
use std::sync::Arc;

use figment::value::{Dict, Value};
use http::Method;
use serde::{Deserialize, Serialize};

use super::ConfigError;
use super::idempotency::{Policy, RawIdempotency};
use super::path::{self, NotNormal, PathMode, PathRules};
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
    /// A path prefix of whole segments: `/webhooks` takes `/webhooks` and `/webhooks/x`, not
    /// `/webhooksx`; written with a trailing slash (`/webhooks/`) it takes only what is below it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path_prefix: Option<String>,
    /// Letters in the route's path match in either case (`/V1/Payments` takes `path = "/v1/payments"`),
    /// for upstreams that route so (ASP.NET, Express); the request goes upstream as the route writes it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ignore_case: bool,
    /// A trailing slash is optional (`/v1/payments/` takes `path = "/v1/payments"`, and the other way
    /// round), for upstreams that route so; the request goes upstream as the route writes it. Routes
    /// matched by `path` only.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ignore_trailing_slash: bool,
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
    /// The path's first whole segments; with a trailing slash, only what is below them.
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
    /// Its path's letters match in either case (`ignore_case`).
    pub ignore_case: bool,
    /// A trailing slash is optional (`ignore_trailing_slash`).
    pub ignore_trailing_slash: bool,
    /// Methods it matches; `None` means every method.
    pub methods: Option<Vec<Method>>,
    /// Forwards without idempotency.
    pub passthrough: bool,
    /// Its policy.
    pub policy: Policy,
}

/// Every route in match order, and the default route behind them.
#[derive(Debug, Clone)]
pub struct RouteTable {
    /// The `[[routes]]`, first match wins.
    pub routes: Vec<Arc<Route>>,
    /// `[idempotency]`, for requests no route matches.
    pub default: Arc<Route>,
    /// Each route that forwards nothing unprotected, beside itself as it would match without case and
    /// trailing slash (`misspelt`).
    loose: Vec<(Arc<Route>, Route)>,
}

impl RouteTable {
    /// Validates the routes over the section they inherit from; their paths must be in the normal form
    /// `paths` brings request paths to, and their signature secrets are read through `secrets`.
    pub fn new(
        section: &RawIdempotency,
        default: Policy,
        raw: &[RawRoute],
        paths: &PathRules,
        secrets: &dyn SecretReader,
    ) -> Result<RouteTable, ConfigError> {
        let base = section_dict(section)?;
        let mut routes: Vec<Arc<Route>> = Vec::with_capacity(raw.len());
        for (index, route) in raw.iter().enumerate() {
            let prefix = format!("routes[{index}]");
            let route = route.validate(&prefix, &base, paths, secrets)?;
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
            ignore_case: false,
            ignore_trailing_slash: false,
            methods: None,
            passthrough: false,
            policy: default,
        });
        let loose = routes
            .iter()
            .filter(|route| !(route.passthrough || route.ignore_case && route.ignore_trailing_slash))
            .map(|route| {
                let twin = Route {
                    ignore_case: true,
                    ignore_trailing_slash: !matches!(route.path, Some(PathMatch::Prefix(_))),
                    ..Route::clone(route)
                };
                (route.clone(), twin)
            })
            .collect();
        Ok(RouteTable {
            routes,
            default,
            loose,
        })
    }

    /// Whether the request spells the path of a route that would protect it in another case or with
    /// another trailing slash, while the route it takes (`selected`) is another: frameworks that route
    /// without case or slash (Express, ASP.NET) would run that route's handler for it, unprotected, so
    /// the proxy refuses it (`proxy.rs`). `path` is in normal form.
    pub fn misspelt(&self, method: &Method, path: &str, selected: &Route) -> bool {
        self.loose
            .iter()
            .filter(|(route, _)| route.name != selected.name)
            .filter(|(route, _)| {
                route.policy.key.methods.contains(method) || route.policy.signature.is_some()
            })
            .any(|(route, twin)| twin.matches(method, path) && !route.matches(method, path))
    }

    /// The route a request takes: the first that matches, else the default. `path` is in normal form.
    pub fn select(&self, method: &Method, path: &str) -> &Arc<Route> {
        self.routes
            .iter()
            .find(|route| route.matches(method, path))
            .unwrap_or(&self.default)
    }

    /// Every route's policy, the default's included.
    pub fn policies(&self) -> impl Iterator<Item = &Policy> {
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
    fn validate(
        &self,
        prefix: &str,
        base: &Dict,
        paths: &PathRules,
        secrets: &dyn SecretReader,
    ) -> Result<Route, ConfigError> {
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
        let path = self.path_match(prefix, paths)?;
        if self.ignore_trailing_slash && matches!(path, PathMatch::Prefix(_)) {
            return Err(ConfigError::new(
                &key("ignore_trailing_slash"),
                "is for routes matched by path: path_prefix = \"/a\" already takes \"/a\", \"/a/\" and \
                 what is below them",
            ));
        }
        let policy = self.policy(prefix, base, secrets)?;
        // A signed route takes every spelling of its path a service might route to its handler, and
        // every method, so that none reaches the handler unverified (`proxy.rs`).
        let signed = policy.signature.is_some();
        if signed && !self.match_methods.is_empty() {
            return Err(ConfigError::new(
                &key("match_methods"),
                "a route with a signature verifies requests of every method; drop match_methods",
            ));
        }
        let exact = !matches!(path, PathMatch::Prefix(_));
        Ok(Route {
            path: Some(path),
            ignore_case: self.ignore_case || signed,
            ignore_trailing_slash: self.ignore_trailing_slash || (signed && exact),
            methods: self.match_methods(&key("match_methods"))?,
            passthrough: self.passthrough,
            policy,
            name,
            scope,
        })
    }

    fn path_match(&self, prefix: &str, paths: &PathRules) -> Result<PathMatch, ConfigError> {
        match (&self.path, &self.path_prefix) {
            (Some(path), None) => {
                let key = format!("{prefix}.path");
                check_path(&key, path, paths)?;
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
                check_path(&key, start, paths)?;
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
    fn policy(&self, prefix: &str, base: &Dict, secrets: &dyn SecretReader) -> Result<Policy, ConfigError> {
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
            match &e.kind {
                figment::error::Kind::UnknownField(field, known) => {
                    ConfigError::new(&key, super::error::unknown_key(field, known))
                }
                kind => ConfigError::new(&key, super::error::describe(kind)),
            }
        })?;
        raw.validate_with(prefix, secrets)
    }
}

impl Route {
    /// Whether this route takes the request; `path` is in normal form.
    pub fn matches(&self, method: &Method, path: &str) -> bool {
        if let Some(methods) = &self.methods
            && !methods.contains(method)
        {
            return false;
        }
        self.takes(path)
    }

    /// The path as this route writes it, for a path it takes, when that is another spelling (only on a
    /// route with `ignore_case` or `ignore_trailing_slash`): the part the route names in the route's
    /// case, the trailing slash as the route writes it; a `*` segment, and what follows a prefix, as
    /// sent. The request is forwarded, fingerprinted and keyed by this spelling, so every spelling the
    /// route takes is one request.
    pub fn respell(&self, path: &str) -> Option<String> {
        if !(self.ignore_case || self.ignore_trailing_slash) {
            return None;
        }
        let spelled = match self.path.as_ref()? {
            PathMatch::Exact(exact) => exact.clone(),
            PathMatch::Prefix(start) => format!("{start}{}", path.get(start.len()..).unwrap_or("")),
            PathMatch::Glob(segments) => {
                let parts = self.without_slash(path).split('/');
                let wanted = self.glob_segments(segments).iter().zip(parts);
                let joined: Vec<&str> = wanted
                    .map(|(want, part)| want.as_deref().unwrap_or(part))
                    .collect();
                let mut spelled = joined.join("/");
                if self.ignore_trailing_slash && glob_ends_with_slash(segments) {
                    spelled.push('/');
                }
                spelled
            }
        };
        (spelled != path).then_some(spelled)
    }

    /// Whether the route takes `path` (in normal form), whatever the method.
    fn takes(&self, path: &str) -> bool {
        let path = self.without_slash(path);
        match &self.path {
            None => true,
            Some(PathMatch::Exact(exact)) => self.same(path, self.without_slash(exact)),
            Some(PathMatch::Prefix(start)) => prefix_takes(start, path, self.ignore_case),
            Some(PathMatch::Glob(segments)) => {
                let mut parts = path.split('/');
                let all = self
                    .glob_segments(segments)
                    .iter()
                    .all(|want| match (want, parts.next()) {
                        (_, None) => false,
                        (None, Some(part)) => !part.is_empty(),
                        (Some(want), Some(part)) => self.same(part, want),
                    });
                all && parts.next().is_none()
            }
        }
    }

    /// `path` without its trailing slash where the route ignores it.
    fn without_slash<'p>(&self, path: &'p str) -> &'p str {
        match path.strip_suffix('/') {
            Some(trimmed) if self.ignore_trailing_slash && !trimmed.is_empty() => trimmed,
            _ => path,
        }
    }

    /// A glob's segments as compared: without the empty last one of a trailing slash the route ignores.
    fn glob_segments<'s>(&self, segments: &'s [Option<String>]) -> &'s [Option<String>] {
        if self.ignore_trailing_slash && glob_ends_with_slash(segments) {
            &segments[..segments.len() - 1]
        } else {
            segments
        }
    }

    fn same(&self, a: &str, b: &str) -> bool {
        if self.ignore_case {
            a.eq_ignore_ascii_case(b)
        } else {
            a == b
        }
    }

    /// Whether every request `later` matches is matched by this route first. Conservative: `false`
    /// where that is not plain (a later route that ignores case or a trailing slash that this one does
    /// not heed), never `true` for a route some request would reach.
    fn covers(&self, later: &Route) -> bool {
        let methods = match (&self.methods, &later.methods) {
            (None, _) => true,
            (Some(_), None) => false,
            (Some(mine), Some(theirs)) => theirs.iter().all(|m| mine.contains(m)),
        };
        methods && (self.ignore_case || !later.ignore_case) && self.covers_path(later)
    }

    fn covers_path(&self, later: &Route) -> bool {
        let (Some(earlier), Some(theirs)) = (&self.path, &later.path) else {
            return self.path.is_none();
        };
        let fold = |text: &str| {
            if self.ignore_case {
                text.to_ascii_lowercase()
            } else {
                text.to_owned()
            }
        };
        match (earlier, theirs) {
            // Every spelling of the later path, but for case: with `later.ignore_case` this route
            // ignores case too.
            (_, PathMatch::Exact(exact)) => later.spellings(exact).iter().all(|p| self.takes(p)),
            (PathMatch::Prefix(start), PathMatch::Prefix(b)) => {
                below(&fold(b)).starts_with(&below(&fold(start)))
                    && (b.ends_with('/') || prefix_takes(start, b, self.ignore_case))
            }
            (PathMatch::Prefix(start), PathMatch::Glob(segments)) => {
                // Every path the glob takes is its text up to the first '*', a '/', then more (a trailing
                // slash the later route ignores included, as the prefix takes both).
                let fixed: Vec<&str> = segments.iter().map_while(|s| s.as_deref()).collect();
                below(&fold(&fixed.join("/"))).starts_with(&below(&fold(start)))
            }
            (PathMatch::Glob(mine), PathMatch::Glob(theirs)) => {
                if later.ignore_trailing_slash && !self.ignore_trailing_slash {
                    return false;
                }
                let (mine, theirs) = (self.glob_segments(mine), self.glob_segments(theirs));
                mine.len() == theirs.len()
                    && mine.iter().zip(theirs).all(|(a, b)| match (a, b) {
                        // A '*' takes any non-empty segment: not the empty one of a trailing slash.
                        (None, None) => true,
                        (None, Some(b)) => !b.is_empty(),
                        (Some(a), Some(b)) => self.same(a, b),
                        (Some(_), None) => false,
                    })
            }
            (PathMatch::Exact(_), _) | (PathMatch::Glob(_), PathMatch::Prefix(_)) => false,
        }
    }

    /// The paths an exact route takes, but for case.
    fn spellings(&self, exact: &str) -> Vec<String> {
        let trimmed = self.without_slash(exact);
        if !self.ignore_trailing_slash || trimmed == "/" {
            return vec![exact.to_owned()];
        }
        vec![trimmed.to_owned(), format!("{trimmed}/")]
    }

    fn describe(&self) -> String {
        let methods = match &self.methods {
            None => "*".to_owned(),
            Some(methods) => methods.iter().map(Method::as_str).collect::<Vec<_>>().join(","),
        };
        let mut path = match &self.path {
            None => "(any other request)".to_owned(),
            Some(PathMatch::Exact(path)) => format!("path = {path:?}"),
            Some(PathMatch::Prefix(start)) => format!("path_prefix = {start:?}"),
            Some(PathMatch::Glob(segments)) => {
                let glob: Vec<&str> = segments.iter().map(|s| s.as_deref().unwrap_or("*")).collect();
                format!("path = {:?}", glob.join("/"))
            }
        };
        let options: Vec<&str> = [
            (self.ignore_case, "ignore_case"),
            (self.ignore_trailing_slash, "ignore_trailing_slash"),
        ]
        .iter()
        .filter_map(|(on, name)| on.then_some(*name))
        .collect();
        if !options.is_empty() {
            let _ = write!(path, " ({})", options.join(", "));
        }
        let policy = &self.policy;
        if self.passthrough {
            return format!("{:?} {methods} {path}: passthrough", self.name);
        }
        let protected: Vec<&str> = policy.key.methods.iter().map(Method::as_str).collect();
        format!(
            "{:?} {methods} {path}: scope {:?}, key {}, protects {}{}, ttl {}, lock_timeout {}, \
             on_in_flight {}{}",
            self.name,
            self.scope,
            policy.key.source,
            protected.join(","),
            if policy.key.required { " (required)" } else { "" },
            humantime::format_duration(policy.claim.ttl),
            humantime::format_duration(policy.claim.lock_timeout),
            match policy.claim.on_in_flight {
                super::OnInFlight::Reject => "reject".to_owned(),
                super::OnInFlight::Wait =>
                    format!("wait {}", humantime::format_duration(policy.claim.wait_timeout)),
                super::OnInFlight::Attach =>
                    format!("attach {}", humantime::format_duration(policy.claim.wait_timeout)),
            },
            match &policy.signature {
                Some(signature) => format!(
                    ", signature {} ({} secret{}; every method and every case and trailing slash of \
                     the path verified)",
                    signature.scheme.name().as_str(),
                    signature.secrets.len(),
                    if signature.secrets.len() == 1 { "" } else { "s" }
                ),
                None => String::new(),
            },
        )
    }
}

/// Whether a prefix takes `path`: the same first whole segments (`/health` takes `/health` and
/// `/health/x`, not `/healthz`); a prefix written with a trailing slash takes only what is below it.
fn prefix_takes(start: &str, path: &str, ignore_case: bool) -> bool {
    let Some(head) = path.get(..start.len()) else {
        return false;
    };
    let same = if ignore_case {
        head.eq_ignore_ascii_case(start)
    } else {
        head == start
    };
    same && (path.len() == start.len() || start.ends_with('/') || path.as_bytes()[start.len()] == b'/')
}

/// A prefix with one trailing slash: every path below it starts so.
fn below(prefix: &str) -> String {
    if prefix.ends_with('/') {
        prefix.to_owned()
    } else {
        format!("{prefix}/")
    }
}

/// Whether a glob is written with a trailing slash (its last segment empty).
fn glob_ends_with_slash(segments: &[Option<String>]) -> bool {
    segments.len() > 1 && segments.last().is_some_and(|s| s.as_deref() == Some(""))
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

/// A route's path: a path, written in the normal form request paths are compared in, holding nothing
/// `paths` refuses in every request.
fn check_path(key: &str, path: &str, paths: &PathRules) -> Result<(), ConfigError> {
    if !path.starts_with('/') || path.bytes().any(|b| !b.is_ascii_graphic() || b == b'?') {
        return Err(ConfigError::new(
            key,
            format!("{path:?} is not a path: it starts with '/' and holds no spaces or query"),
        ));
    }
    let rules = PathRules {
        mode: PathMode::Normalize,
        ..*paths
    };
    let why = match path::normal(path, &rules) {
        Ok(normal) if normal == path => return Ok(()),
        Ok(normal) => format!(
            "{path:?} is another spelling of {normal:?}, the normal form request paths are compared in; \
             write that"
        ),
        Err(NotNormal::EscapedSlash) => format!(
            "{path:?} can never match: server.escaped_slashes = \"reject\" refuses every request path with \
             %2F, %5C or \\"
        ),
        Err(NotNormal::PathParameter) => format!(
            "{path:?} can never match: server.path_parameters = \"reject\" refuses every request path \
             with ';'"
        ),
        Err(other) => format!("{path:?}: {other}"),
    };
    Err(ConfigError::new(key, why))
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
    fn another_case_or_trailing_slash_of_a_protecting_route_s_path_is_a_misspelling() {
        let routes = table(
            r#"
            [[routes]]
            name = "pay"
            path = "/pay"
            required = true
            [[routes]]
            name = "orders"
            path = "/orders/*/refund"
            [[routes]]
            name = "open"
            path = "/open"
            passthrough = true
            [[routes]]
            name = "all"
            path_prefix = "/"
            passthrough = true
            "#,
        );
        let misspelt = |method: Method, path: &str| {
            let selected = routes.select(&method, path);
            routes.misspelt(&method, path, selected)
        };
        for path in ["/PAY", "/Pay/", "/pay/", "/ORDERS/1/Refund", "/orders/1/refund/"] {
            assert!(misspelt(Method::POST, path), "{path}");
        }
        for path in [
            "/pay",
            "/orders/1/refund",
            "/payments",
            "/OPEN",
            "/open/",
            "/other",
        ] {
            assert!(!misspelt(Method::POST, path), "{path}");
        }
        assert!(
            !misspelt(Method::GET, "/PAY"),
            "a method the route does not protect passes"
        );
        let shadowed = table(
            "[[routes]]\nname = \"listed\"\npath_prefix = \"/status\"\nmatch_methods = [\"PATCH\"]\n\
             [[routes]]\nname = \"open\"\npath_prefix = \"/status\"\n",
        );
        let selected = shadowed.select(&Method::PATCH, "/status/1");
        assert_eq!(selected.name, "listed");
        assert!(
            !shadowed.misspelt(&Method::PATCH, "/status/1", selected),
            "a later route that takes the path as it is spelt is shadowed, not misspelt"
        );
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
        assert!(payments.policy.key.required);
        assert_eq!(payments.policy.claim.ttl, Duration::from_secs(12 * 3600));
        assert_eq!(payments.policy.claim.lock_timeout, Duration::from_secs(5));
        assert_eq!(payments.policy.key.max_request_body, 1_000_001);
        assert_eq!(payments.policy.claim.on_in_flight, OnInFlight::Wait);
        assert_eq!(payments.policy.claim.wait_timeout, Duration::from_secs(3));
        assert_eq!(payments.policy.key.source.to_string(), "header:x-request-key");
        assert!(!routes.default.policy.key.required);
        assert_eq!(
            routes.default.policy.key.source,
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
    fn a_prefix_takes_whole_segments() {
        let routes = table(
            "[[routes]]\nname = \"health\"\npath_prefix = \"/health\"\n\
             [[routes]]\nname = \"hooks\"\npath_prefix = \"/hooks/\"\n\
             [[routes]]\nname = \"root\"\npath_prefix = \"/\"\nmatch_methods = [\"PUT\"]\n",
        );
        let name = |method: Method, path: &str| routes.select(&method, path).name.clone();
        for (path, want) in [
            ("/health", "health"),
            ("/health/", "health"),
            ("/health/live", "health"),
            ("/healthz", "default"),
            ("/health-x", "default"),
            ("/Health", "default"),
            ("/hooks/", "hooks"),
            ("/hooks/stripe", "hooks"),
            ("/hooks", "default"),
            ("/hooksx/a", "default"),
        ] {
            assert_eq!(name(Method::POST, path), want, "{path}");
        }
        assert_eq!(name(Method::PUT, "/anything/at/all"), "root");
        assert_eq!(name(Method::PUT, "/"), "root");
    }

    #[test]
    fn a_route_may_take_either_case_and_an_optional_trailing_slash() {
        let routes = table(
            "[[routes]]\nname = \"pay\"\npath = \"/v1/payments\"\nignore_case = true\n\
             ignore_trailing_slash = true\n\
             [[routes]]\nname = \"case\"\npath = \"/v1/Charges\"\nignore_case = true\n\
             [[routes]]\nname = \"slash\"\npath = \"/v1/refunds/\"\nignore_trailing_slash = true\n\
             [[routes]]\nname = \"orders\"\npath = \"/v1/orders/*/capture\"\nignore_case = true\n\
             ignore_trailing_slash = true\n\
             [[routes]]\nname = \"hooks\"\npath_prefix = \"/Hooks\"\nignore_case = true\n\
             [[routes]]\nname = \"plain\"\npath = \"/v1/plain\"\n",
        );
        let name = |path: &str| routes.select(&Method::POST, path).name.clone();
        for (path, want) in [
            ("/v1/payments", "pay"),
            ("/V1/PAYMENTS", "pay"),
            ("/v1/payments/", "pay"),
            ("/V1/Payments/", "pay"),
            ("/v1/payments/x", "default"),
            ("/v1/charges", "case"),
            ("/V1/CHARGES", "case"),
            ("/v1/charges/", "default"),
            ("/v1/refunds/", "slash"),
            ("/v1/refunds", "slash"),
            ("/V1/refunds", "default"),
            ("/V1/Orders/AbC/CAPTURE/", "orders"),
            ("/v1/orders//capture", "default"),
            ("/hooks/x", "hooks"),
            ("/HOOKS", "hooks"),
            ("/hooksx", "default"),
            ("/v1/plain", "plain"),
            ("/v1/plain/", "default"),
            ("/V1/plain", "default"),
        ] {
            assert_eq!(name(path), want, "{path}");
        }
        let respelled = |path: &str| routes.select(&Method::POST, path).respell(path);
        assert_eq!(respelled("/V1/Payments/").as_deref(), Some("/v1/payments"));
        assert_eq!(respelled("/v1/payments"), None);
        assert_eq!(respelled("/v1/charges").as_deref(), Some("/v1/Charges"));
        assert_eq!(respelled("/v1/refunds").as_deref(), Some("/v1/refunds/"));
        assert_eq!(
            respelled("/V1/Orders/AbC/CAPTURE/").as_deref(),
            Some("/v1/orders/AbC/capture")
        );
        assert_eq!(respelled("/HOOKS/Stripe/A").as_deref(), Some("/Hooks/Stripe/A"));
        assert_eq!(respelled("/v1/plain"), None);
        assert_eq!(respelled("/elsewhere"), None);
    }

    #[test]
    fn a_route_path_is_written_in_normal_form() {
        for (path, why) in [
            ("//a", "\"/a\""),
            ("/a/./b", "\"/a/b\""),
            ("/%70ay", "\"/pay\""),
            ("/a%2fb", "escaped_slashes"),
            ("/a;b", "path_parameters"),
            ("/a%zz", "hex"),
        ] {
            let err = error(&format!("[[routes]]\nname = \"a\"\npath = \"{path}\"\n"));
            assert_eq!(err.key, "routes[0].path", "{path}");
            assert!(err.message.contains(why), "{path}: {err}");
        }
        let prefix = error("[[routes]]\nname = \"a\"\npath_prefix = \"/a/../b\"\n");
        assert_eq!(prefix.key, "routes[0].path_prefix");
        let kept = "[server]\nescaped_slashes = \"keep\"\npath_parameters = \"keep\"\n\
                    [[routes]]\nname = \"a\"\npath = \"/a%2Fb;c\"\n";
        assert!(Config::from_toml_str(kept).is_ok());
        let slash = error("[[routes]]\nname = \"a\"\npath_prefix = \"/a\"\nignore_trailing_slash = true\n");
        assert_eq!(slash.key, "routes[0].ignore_trailing_slash");
    }

    #[test]
    fn the_can_never_match_check_heeds_segments_case_and_slashes() {
        for (first, second) in [
            ("path_prefix = \"/a\"", "path_prefix = \"/a/\""),
            (
                "path_prefix = \"/a\"",
                "path = \"/a\"\nignore_trailing_slash = true",
            ),
            (
                "path_prefix = \"/a\"",
                "path = \"/a/*\"\nignore_trailing_slash = true",
            ),
            ("path_prefix = \"/A\"\nignore_case = true", "path = \"/a/b\""),
            (
                "path_prefix = \"/A\"\nignore_case = true",
                "path = \"/a/b\"\nignore_case = true",
            ),
            ("path = \"/a/\"\nignore_trailing_slash = true", "path = \"/a\""),
            (
                "path = \"/a\"\nignore_trailing_slash = true",
                "path = \"/a/\"\nignore_trailing_slash = true",
            ),
            (
                "path = \"/a/*\"\nignore_trailing_slash = true",
                "path = \"/a/*/\"",
            ),
            ("path = \"/A/*\"\nignore_case = true", "path = \"/a/B\""),
        ] {
            let toml = format!("[[routes]]\nname = \"one\"\n{first}\n[[routes]]\nname = \"two\"\n{second}\n");
            assert_eq!(error(&toml).key, "routes[1]", "{toml}");
        }
        for (first, second) in [
            ("path_prefix = \"/health\"", "path = \"/healthz\""),
            ("path_prefix = \"/a\"", "path_prefix = \"/ab\""),
            ("path_prefix = \"/a/\"", "path = \"/a\""),
            (
                "path_prefix = \"/a/\"",
                "path = \"/a/\"\nignore_trailing_slash = true",
            ),
            ("path_prefix = \"/a\"", "path = \"/ab/*\""),
            ("path = \"/a\"", "path = \"/a\"\nignore_trailing_slash = true"),
            ("path = \"/a\"", "path = \"/a\"\nignore_case = true"),
            ("path_prefix = \"/a\"", "path = \"/a\"\nignore_case = true"),
            ("path = \"/a/*\"", "path = \"/a/*\"\nignore_trailing_slash = true"),
            ("path = \"/A/*\"", "path = \"/a/b\""),
        ] {
            let toml = format!("[[routes]]\nname = \"one\"\n{first}\n[[routes]]\nname = \"two\"\n{second}\n");
            assert!(Config::from_toml_str(&toml).is_ok(), "{toml}");
        }
    }

    /// A route from its parts, or `None` when validation refuses them.
    fn route(
        prefix: bool,
        path: &str,
        ignore_case: bool,
        ignore_trailing_slash: bool,
    ) -> Option<super::Route> {
        let base = super::section_dict(&crate::config::RawIdempotency::default()).unwrap();
        let raw = super::RawRoute {
            name: "r".into(),
            scope: None,
            path: (!prefix).then(|| path.to_owned()),
            path_prefix: prefix.then(|| path.to_owned()),
            ignore_case,
            ignore_trailing_slash,
            match_methods: Vec::new(),
            passthrough: false,
            policy: Default::default(),
        };
        raw.validate(
            "routes[0]",
            &base,
            &Default::default(),
            &crate::config::signature::ProcessSecrets,
        )
        .ok()
    }

    /// Every path of up to three segments of `a`, `A`, `ab`, `b`, with and without a trailing slash.
    fn small_paths() -> Vec<String> {
        let mut paths = vec!["/".to_owned()];
        let mut last = vec![String::new()];
        for _ in 0..3 {
            last = last
                .iter()
                .flat_map(|p| ["a", "A", "ab", "b"].map(|s| format!("{p}/{s}")))
                .collect();
            paths.extend(last.iter().flat_map(|p| [p.clone(), format!("{p}/")]));
        }
        paths
    }

    /// Every route of up to two segments of `a`, `A`, `ab`, `*`, with and without a trailing slash,
    /// each option and match kind, that validation accepts.
    fn small_routes() -> Vec<super::Route> {
        let mut paths = vec!["/".to_owned()];
        let mut last = vec![String::new()];
        for _ in 0..2 {
            last = last
                .iter()
                .flat_map(|p| ["a", "A", "ab", "*"].map(|s| format!("{p}/{s}")))
                .collect();
            paths.extend(last.iter().flat_map(|p| [p.clone(), format!("{p}/")]));
        }
        let mut routes = Vec::new();
        for path in &paths {
            for (prefix, case, slash) in (0..8).map(|bits| (bits & 1 != 0, bits & 2 != 0, bits & 4 != 0)) {
                routes.extend(route(prefix, path, case, slash));
            }
        }
        routes
    }

    /// A route refused as hidden is one no path reaches: every path it takes, the earlier one takes.
    /// Exhaustive over the small routes and paths.
    #[test]
    fn a_route_refused_as_hidden_takes_no_path_the_earlier_one_does_not() {
        let (routes, paths) = (small_routes(), small_paths());
        assert!(routes.len() > 200, "{}", routes.len());
        let mut refused = 0;
        for earlier in &routes {
            for later in routes.iter().filter(|later| earlier.covers(later)) {
                refused += 1;
                for path in paths.iter().filter(|p| later.takes(p)) {
                    assert!(earlier.takes(path), "{earlier:?} covers {later:?} but not {path}");
                }
            }
        }
        assert!(refused > 1000, "the check refuses something: {refused}");
    }

    /// What a route respells a path to, it takes, and respells no further.
    #[test]
    fn a_respelled_path_takes_the_same_route() {
        let paths = small_paths();
        for route in small_routes() {
            for path in paths.iter().filter(|p| route.takes(p)) {
                if let Some(spelled) = route.respell(path) {
                    assert!(route.takes(&spelled), "{route:?}: {path} -> {spelled}");
                    assert_eq!(route.respell(&spelled), None, "{route:?}: {path}");
                }
            }
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
        let options = table(
            "[[routes]]\nname = \"pay\"\npath = \"/pay\"\nignore_case = true\nignore_trailing_slash = true\n",
        );
        assert!(
            options
                .describe()
                .contains("path = \"/pay\" (ignore_case, ignore_trailing_slash): scope"),
            "{}",
            options.describe()
        );
        assert!(printed.contains("-. \"default\""), "{printed}");
        let again: toml::Table = printed.parse().expect("check-config prints valid TOML");
        assert!(again.contains_key("routes"));
    }
}
