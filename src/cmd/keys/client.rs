//! Whom a `keys` command is about, resolved once before the store is asked: a scope as given, a route's
//! scope name, or one client's scope, computed from its credential on its route by the proxy's own code
//! (`proxy/key.rs` for the scope, the route table and `config/path.rs` for the route), so the command
//! finds the record the proxy would. Touches only the configuration and the arguments.

use std::fmt::Write as _;

use http::{HeaderMap, HeaderName, HeaderValue, Method};

use super::report::{KeysError, Output, Report};
use crate::cmd::ClientArgs;
use crate::config::{Config, DEFAULT_ROUTE, Route, Unscoped, normal};
use crate::proxy::key;
use crate::proxy::key::client_cert::ClientCert;
use crate::store::RecordInfo;
use crate::store::ScopeFilter;

/// Which scope a command looks in, and how it was found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Client {
    /// Every scope.
    Anyone,
    /// The scope given with --scope.
    Scope(String),
    /// Every client of a route's scope name.
    Route { route: String, scope_name: String },
    /// One client of a route: the scope the proxy computes from its credential.
    Credential {
        route: String,
        scope: String,
        /// Why the proxy would refuse this client's keyed requests, if it would.
        refused: Option<String>,
    },
}

impl Client {
    /// The scope the arguments name: --scope as given; else, with a credential, the scope the proxy
    /// computes for it on the route (named, chosen by --method and --path, or the default route); else
    /// the route's scope name, when a route is named.
    pub(super) fn resolve(
        config: &Config,
        scope: Option<&str>,
        args: &ClientArgs,
    ) -> Result<Client, KeysError> {
        if let Some(scope) = scope {
            return Ok(Client::Scope(scope.to_owned()));
        }
        if !args.has_route() && !args.has_credential() {
            return Ok(Client::Anyone);
        }
        let route = route(config, args)?;
        if route.passthrough {
            return Err(KeysError::Usage(format!(
                "route {:?} is passthrough: the proxy keeps no records for it",
                route.name
            )));
        }
        if !args.has_credential() {
            return Ok(Client::Route {
                route: route.name.clone(),
                scope_name: route.scope.clone(),
            });
        }
        let headers = headers(args)?;
        let cert = client_cert(args)?;
        let subject = match &route.policy.key.scope_jwt {
            Some(rules) => key::jwt::unverified_subject(rules, &headers)
                .map_err(|why| KeysError::Usage(format!("--header Authorization: {why}")))?,
            None => None,
        };
        let presented = key::Presented {
            cert: cert.as_ref(),
            subject: subject.as_ref(),
        };
        Ok(Client::Credential {
            route: route.name.clone(),
            scope: key::scope_with(&route.scope, &route.policy.key, &headers, presented),
            refused: refused(route, &headers, cert.as_ref()),
        })
    }

    pub(super) fn filter(&self) -> ScopeFilter {
        match self {
            Client::Anyone => ScopeFilter::All,
            Client::Scope(scope) | Client::Credential { scope, .. } => ScopeFilter::Exact(scope.clone()),
            Client::Route { scope_name, .. } => ScopeFilter::Named(scope_name.clone()),
        }
    }

    /// The one scope to look in, if the arguments name one.
    pub(super) fn scope(&self) -> Option<&str> {
        match self {
            Client::Scope(scope) | Client::Credential { scope, .. } => Some(scope),
            Client::Anyone | Client::Route { .. } => None,
        }
    }

    /// A line saying which scope was computed, for text output.
    pub(super) fn describe(&self, text: &mut String) {
        if let Client::Credential {
            route,
            scope,
            refused,
        } = self
        {
            let _ = writeln!(text, "route {route:?}: this client's scope is {scope}");
            if let Some(why) = refused {
                let _ = writeln!(text, "note: {why}");
            }
        }
    }
}

/// The route a request takes, chosen as the proxy chooses it: by name, or by method and path (brought to
/// the proxy's normal form first); the default route when neither is given.
fn route<'a>(config: &'a Config, args: &ClientArgs) -> Result<&'a Route, KeysError> {
    let routes = &config.routes;
    if let Some(name) = &args.route {
        if name == DEFAULT_ROUTE {
            return Ok(&routes.default);
        }
        let found = routes.routes.iter().find(|route| &route.name == name);
        return found.map(|route| &**route).ok_or_else(|| {
            let names: Vec<&str> = routes.routes.iter().map(|r| r.name.as_str()).collect();
            let known = match names.as_slice() {
                [] => "it has none but default; pass the proxy's --config".to_owned(),
                names => format!("its routes: {}, and default", names.join(", ")),
            };
            KeysError::Usage(format!("no route named {name:?} in the configuration ({known})"))
        });
    }
    let Some(path) = &args.path else {
        return Ok(&routes.default);
    };
    let method = Method::from_bytes(args.method.to_ascii_uppercase().as_bytes())
        .map_err(|_| KeysError::Usage(format!("{:?} is not an HTTP method", args.method)))?;
    let path = path.split('?').next().unwrap_or_default();
    let normal = normal(path, &config.server.paths)
        .map_err(|why| KeysError::Usage(format!("the proxy refuses the path {path:?}: {why}")))?;
    Ok(&**routes.select(&method, &normal))
}

/// The request headers the arguments give, as the proxy receives them.
fn headers(args: &ClientArgs) -> Result<HeaderMap, KeysError> {
    let mut headers = HeaderMap::new();
    for line in &args.headers {
        let bad = |why: &str| KeysError::Usage(format!("--header {line:?}: {why}"));
        let (name, value) = line
            .split_once(':')
            .ok_or_else(|| bad("write it as 'Name: value'"))?;
        let name = HeaderName::from_bytes(name.trim().as_bytes()).map_err(|_| bad("not a header name"))?;
        let value = HeaderValue::from_str(value.trim()).map_err(|_| bad("not a header value"))?;
        headers.append(name, value);
    }
    if let Some(cookie) = &args.cookie {
        let value = HeaderValue::from_str(cookie)
            .map_err(|_| KeysError::Usage(format!("--cookie {cookie:?}: not a header value")))?;
        headers.append(http::header::COOKIE, value);
    }
    Ok(headers)
}

/// The identity of the client certificate --client-cert names (its first certificate, PEM).
fn client_cert(args: &ClientArgs) -> Result<Option<ClientCert>, KeysError> {
    let Some(path) = &args.client_cert else {
        return Ok(None);
    };
    let bad = |why: String| KeysError::Usage(format!("--client-cert {}: {why}", path.display()));
    let chain = crate::config::tls::certificates(path).map_err(bad)?;
    let leaf = chain.first().ok_or_else(|| bad("holds no certificate".into()))?;
    ClientCert::of(leaf)
        .map(Some)
        .ok_or_else(|| bad("not an X.509 certificate".into()))
}

/// Why the proxy would refuse a keyed request with these headers (and certificate) on `route` for
/// naming no client.
fn refused(route: &Route, headers: &HeaderMap, cert: Option<&ClientCert>) -> Option<String> {
    let policy = &route.policy;
    if policy.key.unscoped == Unscoped::Shared || key::has_scope_with(&policy.key, headers, cert) {
        return None;
    }
    let mut names: Vec<String> = policy.key.scope_headers.iter().map(|h| h.to_string()).collect();
    names.extend(policy.key.scope_cookie.iter().map(|c| format!("cookie {c}")));
    if policy.key.scope_client_cert {
        names.push("a client certificate (--client-cert)".to_owned());
    }
    if policy.key.scope_jwt.is_some() {
        names.push("a bearer token".to_owned());
    }
    Some(format!(
        "these headers name no client on route {:?} (it reads {}): the proxy refuses such keyed \
         requests (400 missing-scope), so no record can have this scope",
        route.name,
        names.join(", ")
    ))
}

impl Client {
    /// What a command says when this client has no record for `key`.
    pub(super) fn not_found(&self, out: &Output, key: &str) -> Report {
        let empty: [RecordInfo; 0] = [];
        out.report(&empty, false, |_, text| {
            self.describe(text);
            match self.scope() {
                Some(scope) => {
                    let _ = writeln!(text, "no record for key {key:?} in scope {scope}");
                }
                None => {
                    let _ = writeln!(text, "no record for key {key:?}");
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(route: Option<&str>, path: Option<&str>, headers: &[&str]) -> ClientArgs {
        ClientArgs {
            route: route.map(str::to_owned),
            path: path.map(str::to_owned),
            method: "post".into(),
            headers: headers.iter().map(|h| (*h).to_owned()).collect(),
            cookie: None,
            client_cert: None,
        }
    }

    fn config() -> Config {
        Config::from_toml_str(
            "[[routes]]\nname = \"payments\"\npath_prefix = \"/payments\"\nscope_headers = [\"x-api-key\"]\n",
        )
        .expect("valid")
    }

    #[test]
    fn a_credential_gets_the_scope_the_proxy_computes_on_the_route_its_path_takes() {
        let config = config();
        let route = &config.routes.routes[0];
        let mut sent = HeaderMap::new();
        sent.insert("x-api-key", HeaderValue::from_static("alice"));
        let proxy_scope = key::scope(&route.scope, &route.policy.key, &sent);

        for by in [
            args(Some("payments"), None, &["X-Api-Key:  alice "]),
            args(
                None,
                Some("/payments/./7?x=1"),
                &["x-api-key: alice", "authorization: other"],
            ),
        ] {
            match Client::resolve(&config, None, &by).expect("resolves") {
                Client::Credential {
                    route,
                    scope,
                    refused,
                } => {
                    assert_eq!(
                        (route.as_str(), scope.as_str()),
                        ("payments", proxy_scope.as_str())
                    );
                    assert_eq!(refused, None);
                }
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn a_route_alone_is_its_scope_name_and_nothing_is_everyone() {
        let config = config();
        let by_name = Client::resolve(&config, None, &args(Some("payments"), None, &[])).unwrap();
        assert_eq!(by_name.filter(), ScopeFilter::Named("payments".into()));
        let by_path = Client::resolve(&config, None, &args(None, Some("/other"), &[])).unwrap();
        assert_eq!(by_path.filter(), ScopeFilter::Named(DEFAULT_ROUTE.into()));
        assert_eq!(
            Client::resolve(&config, None, &args(None, None, &[])).unwrap(),
            Client::Anyone
        );
    }

    #[test]
    fn a_credential_the_route_does_not_read_is_said_to_be_refused() {
        let by = args(Some("payments"), None, &["Authorization: Bearer x"]);
        match Client::resolve(&config(), None, &by).unwrap() {
            Client::Credential {
                refused: Some(why), ..
            } => assert!(why.contains("x-api-key"), "{why}"),
            other => panic!("{other:?}"),
        }
    }

    /// An unsigned token's text with these claims (the CLI reads tokens without verifying them).
    fn token(claims: &str) -> String {
        use base64::Engine as _;
        let b64 = |text: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(text);
        format!(
            "Bearer {}.{}.c2ln",
            b64(r#"{"alg":"RS256","kid":"k"}"#),
            b64(claims)
        )
    }

    #[test]
    fn a_bearer_token_names_its_subject_on_a_scope_jwt_route_whatever_its_other_claims() {
        let dir = tempfile::tempdir().unwrap();
        let jwks = dir.path().join("jwks.json");
        std::fs::write(
            &jwks,
            r#"{"keys":[{"kty":"OKP","crv":"Ed25519","x":"11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo"}]}"#,
        )
        .unwrap();
        let toml = format!(
            "[[routes]]\nname = \"payments\"\npath = \"/p\"\nscope_jwt = {{ jwks_file = {:?} }}\n",
            jwks.display().to_string()
        );
        let config = Config::from_toml_str(&toml).expect("valid");
        let scope_of = |claims: &str| {
            let header = format!("Authorization: {}", token(claims));
            match Client::resolve(&config, None, &args(Some("payments"), None, &[&header])).unwrap() {
                Client::Credential { scope, refused, .. } => {
                    assert_eq!(refused, None);
                    scope
                }
                other => panic!("{other:?}"),
            }
        };
        let alice = scope_of(r#"{"iss":"https://i/","sub":"alice","exp":1}"#);
        assert_eq!(
            alice,
            scope_of(r#"{"iss":"https://i/","sub":"alice","exp":99,"jti":"x"}"#)
        );
        assert_ne!(alice, scope_of(r#"{"iss":"https://i/","sub":"bob","exp":1}"#));
        let no_sub = format!("Authorization: {}", token(r#"{"iss":"https://i/"}"#));
        let err = Client::resolve(&config, None, &args(Some("payments"), None, &[&no_sub])).unwrap_err();
        assert!(err.to_string().contains("sub"), "{err}");
    }

    #[test]
    fn a_header_that_is_not_one_is_a_usage_error_naming_it() {
        for bad in ["no colon", "bad name: x", "x-api-key: \u{1}"] {
            let err = Client::resolve(&config(), None, &args(Some("payments"), None, &[bad])).unwrap_err();
            assert!(err.to_string().contains(&format!("--header {bad:?}")), "{err}");
        }
    }
}
