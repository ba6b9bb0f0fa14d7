//! Settings that are valid but risky, found once at load from the validated [`Config`]: `check-config`
//! prints them (and fails on them with `--deny-warnings`), `serve` logs them at start. Each names the key
//! and says what can go wrong and what to do. Touches nothing but the configuration it is given.

use std::fmt;
use std::net::IpAddr;

use super::{Config, DEFAULT_ROUTE, OnStoreError, Route, StoreBackend, Unscoped};

/// One risky setting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Warning {
    /// Dotted path of the key (`store.on_error`, `routes[1].scope`).
    pub key: String,
    /// What can go wrong, and what to do, in one line.
    pub message: String,
}

impl fmt::Display for Warning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "warning: {}: {}", self.key, self.message)
    }
}

impl Config {
    /// The risky settings in this configuration, in file order.
    pub fn warnings(&self) -> Vec<Warning> {
        let mut found = Vec::new();
        no_upstream(self, &mut found);
        fail_open(self, &mut found);
        store_in_clear(self, &mut found);
        let routes = self.routes.routes.iter().map(|r| &**r);
        let all: Vec<&Route> = routes.chain(std::iter::once(&*self.routes.default)).collect();
        shared_scopes(&all, &mut found);
        for (index, route) in all.iter().enumerate() {
            unscoped_without_signature(index, route, &mut found);
        }
        found
    }

    /// What is worth knowing about this configuration but not risky enough to refuse it under
    /// `--deny-warnings`: routes whose scope is the `Authorization` header as sent, which is stable for an
    /// API key and not for an OAuth access token (a retry with a refreshed token runs again).
    pub fn notes(&self) -> Vec<Warning> {
        let routes = self.routes.routes.iter().map(|r| &**r);
        let by_spelling: Vec<&str> = routes
            .chain(std::iter::once(&*self.routes.default))
            .filter(|route| !route.passthrough && scopes_by_spelling(route))
            .map(|route| route.name.as_str())
            .collect();
        if by_spelling.is_empty() {
            return Vec::new();
        }
        vec![Warning {
            key: "scope_headers".to_owned(),
            message: format!(
                "route{} {} scope{} keys by the Authorization header as sent: right for an API key, but \
                 an OAuth or OIDC access token changes when it is refreshed, and a retry sent with the \
                 new one runs again; for bearer tokens set scope_jwt (the token's verified subject), or \
                 scope_client_cert for client certificates",
                if by_spelling.len() == 1 { "" } else { "s" },
                by_spelling
                    .iter()
                    .map(|name| format!("{name:?}"))
                    .collect::<Vec<_>>()
                    .join(", "),
                if by_spelling.len() == 1 { "s" } else { "" },
            ),
        }]
    }

    /// What `check-config` prints: a comment line for each warning, each note ([`Config::notes`]) and
    /// the service-link variables left out, then the effective configuration ([`Config::to_masked_toml`]).
    pub fn to_checked_toml(&self, warnings: &[Warning]) -> String {
        let mut text = String::new();
        for warning in warnings {
            text.push_str(&format!("# {warning}\n"));
        }
        for note in self.notes() {
            text.push_str(&format!("# note: {}: {}\n", note.key, note.message));
        }
        if !self.service_links.is_empty() {
            text.push_str(&format!(
                "# note: ignoring Kubernetes service-link variables (not configuration): {}\n",
                self.service_links.join(", ")
            ));
        }
        if !text.is_empty() {
            text.push('\n');
        }
        text.push_str(&self.to_masked_toml());
        super::mask_passwords(&text)
    }
}

fn warn(found: &mut Vec<Warning>, key: &str, message: String) {
    found.push(Warning {
        key: key.to_owned(),
        message,
    });
}

/// The key path of a route's setting: `idempotency.x` for the default route, `routes[i].x` for others.
fn route_key(index: usize, route: &Route, field: &str) -> String {
    match route.name.as_str() {
        DEFAULT_ROUTE => format!("idempotency.{field}"),
        _ => format!("routes[{index}].{field}"),
    }
}

/// No layer named the upstream: every request goes to the default, `http://127.0.0.1:3000`, which is
/// right only beside a service there (the quickstart's demo). A warning, not an error: tests and
/// examples start the proxy with only a store, and the default is documented.
fn no_upstream(config: &Config, found: &mut Vec<Warning>) {
    if !config.upstream_named {
        warn(
            found,
            "upstream.url",
            format!(
                "not set, so requests go to the default {}; set upstream.url in the file, --upstream or \
                 IDEMPROXY_UPSTREAM__URL",
                super::RawUpstream::default().url
            ),
        );
    }
}

fn fail_open(config: &Config, found: &mut Vec<Warning>) {
    if config.store.on_error == OnStoreError::FailOpen {
        warn(
            found,
            "store.on_error",
            "\"fail_open\" forwards keyed requests unprotected while the store is down: every retry \
             then executes again (a payment charged twice); keep \"fail_closed\" unless a duplicate \
             execution is harmless"
                .into(),
        );
    }
}

/// A shared store reached over the network without TLS: its password and every stored response cross
/// the network in the clear.
fn store_in_clear(config: &Config, found: &mut Vec<Warning>) {
    let store = &config.store;
    if store.tls {
        return;
    }
    let urls: Vec<&str> = match &store.backend {
        StoreBackend::Sqlite { .. } => return,
        StoreBackend::Postgres => vec![store.url.as_str()],
        StoreBackend::Redis(target) => target.nodes.iter().map(String::as_str).collect(),
    };
    let hosts: Vec<String> = urls
        .into_iter()
        .filter_map(|url| Some(url::Url::parse(url).ok()?.host_str()?.to_owned()))
        .collect();
    if let Some(host) = hosts.iter().find(|host| is_remote(host)) {
        let ask = match store.backend {
            StoreBackend::Redis(_) => "use rediss://",
            _ if store.ssl_mode.may_use_tls() => {
                "write sslmode=verify-full in the URL: allow and prefer fall back to clear text whenever the \
                 server offers no TLS, which an attacker on the path can arrange"
            }
            _ => "add sslmode=verify-full to the URL (TLS, the server's certificate and host name verified)",
        };
        warn(
            found,
            "store.url",
            format!(
                "the store at {host} is reached without TLS: its password and every stored response \
                 cross the network in the clear; {ask}"
            ),
        );
    }
}

/// Whether a store host (as a URL names it) is on another machine: not loopback, not a unix socket
/// directory.
fn is_remote(host: &str) -> bool {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    if bare.is_empty() || bare.starts_with('/') || bare.eq_ignore_ascii_case("localhost") {
        return false;
    }
    !bare.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// Routes that share a scope name share their keys: a key sent to one is found by the other. That is
/// safe only when both read keys, credentials and fingerprints alike; otherwise one route's request can
/// be answered from the other's record (422, or its stored response where the fingerprints agree).
fn shared_scopes(all: &[&Route], found: &mut Vec<Warning>) {
    for (later, route) in all.iter().enumerate() {
        if route.passthrough {
            continue;
        }
        let earlier = all[..later]
            .iter()
            .enumerate()
            .find(|(_, other)| !other.passthrough && other.scope == route.scope);
        let Some((first, other)) = earlier else {
            continue;
        };
        let differ = differences(other, route);
        if differ.is_empty() {
            continue;
        }
        let key = if route.name == DEFAULT_ROUTE {
            route_key(first, other, "scope")
        } else {
            route_key(later, route, "scope")
        };
        warn(
            found,
            &key,
            format!(
                "routes {:?} and {:?} share the scope {:?} (and so their keys) but differ in {}: a key \
                 used on both answers one route's request from the other's record; give each its own \
                 scope, or the same settings",
                other.name,
                route.name,
                route.scope,
                differ.join(", ")
            ),
        );
    }
}

/// The settings two routes sharing a scope must agree on, where they do not.
fn differences(a: &Route, b: &Route) -> Vec<&'static str> {
    let (a, b) = (&a.policy.key, &b.policy.key);
    let checks = [
        ("key", a.source != b.source),
        ("header", a.header != b.header),
        ("scope_headers", a.scope_headers != b.scope_headers),
        ("scope_cookie", a.scope_cookie != b.scope_cookie),
        ("unscoped", a.unscoped != b.unscoped),
        (
            "fingerprint_headers",
            a.fingerprint_headers != b.fingerprint_headers,
        ),
        ("fingerprint_body", a.fingerprint_body != b.fingerprint_body),
        (
            "fingerprint_exclude",
            a.fingerprint_exclude != b.fingerprint_exclude,
        ),
    ];
    checks
        .into_iter()
        .filter(|(_, differs)| *differs)
        .map(|(name, _)| name)
        .collect()
}

/// Whether a route's scope is the `Authorization` header's spelling, with no stable identity beside it.
fn scopes_by_spelling(route: &Route) -> bool {
    let key = &route.policy.key;
    key.scope_headers.contains(&http::header::AUTHORIZATION)
        && key.scope_jwt.is_none()
        && !key.scope_client_cert
}

/// A scope shared by every client, with nothing proving who sent a request: any client that sends
/// another's key gets the other's stored response.
fn unscoped_without_signature(index: usize, route: &Route, found: &mut Vec<Warning>) {
    let policy = &route.policy;
    if route.passthrough || policy.key.unscoped != Unscoped::Shared || policy.signature.is_some() {
        return;
    }
    warn(
        found,
        &route_key(index, route, "unscoped"),
        format!(
            "\"shared\" puts the keyed requests of route {:?} that carry no credential into one scope \
             with no signature to say who sent them: a client that sends another's key gets the other's \
             stored response; scope them by a credential (scope_headers, scope_cookie) or verify a \
             webhook signature",
            route.name
        ),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The keys warned about, the upstream's own warning aside (`toml` names no upstream).
    fn keys(toml: &str) -> Vec<String> {
        let config = Config::from_toml_str(toml).expect("valid");
        let keys = config.warnings().into_iter().map(|w| w.key);
        keys.filter(|key| key != "upstream.url").collect()
    }

    #[test]
    fn the_defaults_are_not_risky() {
        assert!(keys("").is_empty());
    }

    #[test]
    fn a_configuration_naming_no_upstream_is_warned_about_and_one_naming_it_is_not() {
        let warned = Config::from_toml_str("[store]\nmax_batch = 8\n")
            .unwrap()
            .warnings();
        assert_eq!(warned.len(), 1, "{warned:?}");
        assert_eq!(warned[0].key, "upstream.url");
        for words in ["http://127.0.0.1:3000", "--upstream", "IDEMPROXY_UPSTREAM__URL"] {
            assert!(warned[0].message.contains(words), "{}", warned[0]);
        }
        let named = Config::from_toml_str("[upstream]\nurl = \"http://127.0.0.1:3000\"\n").unwrap();
        assert!(named.warnings().is_empty(), "the default, written, is named");
    }

    #[test]
    fn a_scope_by_the_authorization_spelling_is_noted_and_not_with_a_stable_identity() {
        let notes = |toml: &str| Config::from_toml_str(toml).expect("valid").notes();
        let defaults = notes("");
        assert_eq!(defaults.len(), 1);
        assert!(
            defaults[0].message.contains("route \"default\" scopes"),
            "{:?}",
            defaults
        );
        assert!(defaults[0].message.contains("scope_jwt"));
        let api_key = "[idempotency]\nscope_headers = [\"x-api-key\"]\n";
        assert!(notes(api_key).is_empty());
        let dir = std::env::temp_dir().join(format!("idemproxy-notes-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("jwks.json");
        let set = r#"{"keys":[{"kty":"OKP","crv":"Ed25519","x":"11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo","kid":"a"}]}"#;
        std::fs::write(&file, set).unwrap();
        let jwt = format!(
            "[idempotency.scope_jwt]\njwks_file = {:?}\n",
            file.display().to_string()
        );
        assert!(notes(&jwt).is_empty(), "{:?}", notes(&jwt));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn fail_open_is_named() {
        assert_eq!(keys("[store]\non_error = \"fail_open\"\n"), ["store.on_error"]);
    }

    #[test]
    fn a_remote_store_without_tls_is_named_and_a_local_one_is_not() {
        let remote = "[store]\nurl = \"postgres://app@db.internal:5432/idemproxy\"\n";
        assert_eq!(keys(remote), ["store.url"]);
        assert!(keys("[store]\nurl = \"postgres://app@127.0.0.1:5432/idemproxy\"\n").is_empty());
        assert!(keys("[store]\nurl = \"redis://localhost:6379\"\n").is_empty());
        assert_eq!(keys("[store]\nurl = \"redis://cache:6379\"\n"), ["store.url"]);
        let secured = "[store]\nurl = \"postgres://app@db.internal/idemproxy?sslmode=require\"\n";
        assert!(keys(secured).is_empty());
        assert!(!is_remote("[::1]") && is_remote("[fd00::1]") && !is_remote("/run/pg"));
        let cluster = "[store]\nurl = \"redis+cluster://127.0.0.1:7000,cache-1:7001\"\n";
        assert_eq!(keys(cluster), ["store.url"], "any remote node");
    }

    #[test]
    fn routes_sharing_a_scope_warn_only_when_they_read_requests_differently() {
        let alike = "[[routes]]\nname = \"a\"\npath = \"/a\"\nscope = \"s\"\n\
                     [[routes]]\nname = \"b\"\npath = \"/b\"\nscope = \"s\"\n";
        assert!(keys(alike).is_empty());
        let differ = "[[routes]]\nname = \"a\"\npath = \"/a\"\nscope = \"s\"\n\
                      [[routes]]\nname = \"b\"\npath = \"/b\"\nscope = \"s\"\n\
                      fingerprint_headers = []\n";
        assert_eq!(keys(differ), ["routes[1].scope"]);
        let into_default = "[[routes]]\nname = \"a\"\npath = \"/a\"\nscope = \"default\"\n\
                            scope_headers = [\"x-api-key\"]\n";
        assert_eq!(keys(into_default), ["routes[0].scope"]);
    }

    #[test]
    fn a_shared_scope_without_a_signature_is_named() {
        let shared = "[[routes]]\nname = \"hooks\"\npath_prefix = \"/hooks\"\nunscoped = \"shared\"\n";
        assert_eq!(keys(shared), ["routes[0].unscoped"]);
        assert_eq!(
            keys("[idempotency]\nunscoped = \"shared\"\n"),
            ["idempotency.unscoped"]
        );
    }
}
