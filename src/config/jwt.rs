//! `scope_jwt` (on `[idempotency]` and per route): who a client is by its verified bearer token, not by the
//! token's spelling. A table naming where the signing keys come from (`jwks_file`, or `jwks_url`: https,
//! or http on a loopback address), which issuers and audiences are taken, how much clock skew (`leeway`)
//! `exp` and `nbf` allow, which claims make the scope, and how often the key set is read again.
//! Validated once at load into [`JwtRules`]; a key file is read then too, so a broken one is a
//! configuration error. Touches the key file only.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::ConfigError;
use super::jwk_set::Keys;
use super::parse::positive;

/// The longest `leeway` taken: clocks further apart than this are a problem to mend, not to allow.
const MAX_LEEWAY: Duration = Duration::from_secs(5 * 60);

/// The least `min_refetch`: tokens with unknown `kid`s are anyone's to send, and each may have the set
/// read again; below a second, they would have the issuer's endpoint read as often as they come.
const MIN_REFETCH: Duration = Duration::from_secs(1);

/// The claims most tokens have, and a refreshed token keeps: who issued it, and whom it is about.
const DEFAULT_CLAIMS: [&str; 2] = ["iss", "sub"];

/// `scope_jwt` as written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawScopeJwt {
    /// A file holding the JSON Web Key Set; read at start and again as `jwks_url` is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub jwks_file: Option<PathBuf>,
    /// Where the JSON Web Key Set is fetched from: https, or http on a loopback address.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub jwks_url: Option<String>,
    /// More authorities to trust for an https `jwks_url`, beside the system's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
    /// The `iss` values taken; empty takes any (the key set already says who signs).
    pub issuers: Vec<String>,
    /// The `aud` values taken; empty takes any (the audience is left to the app).
    pub audiences: Vec<String>,
    /// The claims whose verified values make the scope.
    pub claims: Vec<String>,
    /// The clock skew allowed on `exp` and `nbf`.
    #[serde(with = "humantime_serde")]
    pub leeway: Duration,
    /// How often the key set is read again.
    #[serde(with = "humantime_serde")]
    pub refresh: Duration,
    /// The least time between two reads of the set caused by a token whose `kid` it does not hold.
    #[serde(with = "humantime_serde")]
    pub min_refetch: Duration,
}

impl Default for RawScopeJwt {
    fn default() -> Self {
        RawScopeJwt {
            jwks_file: None,
            jwks_url: None,
            ca_file: None,
            issuers: Vec::new(),
            audiences: Vec::new(),
            claims: DEFAULT_CLAIMS.iter().map(|c| (*c).to_owned()).collect(),
            leeway: Duration::from_secs(60),
            refresh: Duration::from_secs(5 * 60),
            min_refetch: Duration::from_secs(30),
        }
    }
}

/// Where a key set comes from; routes naming the same source share one set.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum JwksSource {
    /// A file.
    File(PathBuf),
    /// A URL, with more authorities to trust for it.
    Url {
        /// The URL.
        url: url::Url,
        /// Extra authorities for https.
        ca_file: Option<PathBuf>,
    },
}

impl std::fmt::Display for JwksSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            JwksSource::File(path) => write!(f, "{}", path.display()),
            JwksSource::Url { url, .. } => write!(f, "{url}"),
        }
    }
}

/// `scope_jwt` checked: what a keyed request's token is verified against, and what of it makes the scope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JwtRules {
    /// The key set.
    pub source: JwksSource,
    /// `iss` values taken (empty: any).
    pub issuers: Vec<String>,
    /// `aud` values taken (empty: any; `aud` is not checked).
    pub audiences: Vec<String>,
    /// The claims the scope is made of.
    pub claims: Vec<String>,
    /// Clock skew on `exp` and `nbf`, whole seconds.
    pub leeway: u64,
    /// How often the set is read again.
    pub refresh: Duration,
    /// The least time between reads for an unknown `kid`.
    pub min_refetch: Duration,
}

/// `scope_jwt` as written: a table, or `false`, so that a route can turn off the section's table (its
/// clients send static API keys in `Authorization`, say). A table's unknown keys are named as anywhere.
pub fn table_or_off<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<RawScopeJwt>, D::Error> {
    struct Setting;
    impl<'de> serde::de::Visitor<'de> for Setting {
        type Value = Option<RawScopeJwt>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a table (jwks_url or jwks_file, issuers, audiences, ...), or false")
        }
        fn visit_bool<E: serde::de::Error>(self, on: bool) -> Result<Self::Value, E> {
            match on {
                false => Ok(None),
                true => Err(E::custom(
                    "true names no key set: write a table with jwks_url or jwks_file",
                )),
            }
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
            RawScopeJwt::deserialize(serde::de::value::MapAccessDeserializer::new(map)).map(Some)
        }
    }
    d.deserialize_any(Setting)
}

impl RawScopeJwt {
    /// Checks the table, whose keys are named under `key` (`idempotency.scope_jwt`).
    pub fn validate(&self, key: &str) -> Result<JwtRules, ConfigError> {
        let field = |name: &str| format!("{key}.{name}");
        let source = self.source(key)?;
        if self.claims.is_empty() {
            return Err(ConfigError::new(
                &field("claims"),
                "names no claim, so every client would share one scope; name the claims that say who \
                 the client is (the default is [\"iss\", \"sub\"])",
            ));
        }
        if let Some(bad) = self.claims.iter().find(|c| c.is_empty()) {
            return Err(ConfigError::new(
                &field("claims"),
                format!("{bad:?} is not a claim name"),
            ));
        }
        if self.leeway > MAX_LEEWAY || self.leeway.subsec_nanos() != 0 {
            return Err(ConfigError::new(
                &field("leeway"),
                "must be whole seconds, at most 5m (token times have no finer unit)",
            ));
        }
        let min_refetch = positive(&field("min_refetch"), self.min_refetch)?;
        if min_refetch < MIN_REFETCH {
            return Err(ConfigError::new(
                &field("min_refetch"),
                "must be at least 1s: every token naming an unknown kid may have the key set read again",
            ));
        }
        if self.refresh < min_refetch {
            return Err(ConfigError::new(
                &field("refresh"),
                format!("must be at least {}", field("min_refetch")),
            ));
        }
        for (name, values) in [("issuers", &self.issuers), ("audiences", &self.audiences)] {
            if values.iter().any(String::is_empty) {
                return Err(ConfigError::new(&field(name), "holds an empty value"));
            }
        }
        Ok(JwtRules {
            source,
            issuers: self.issuers.clone(),
            audiences: self.audiences.clone(),
            claims: self.claims.clone(),
            leeway: self.leeway.as_secs(),
            refresh: self.refresh,
            min_refetch,
        })
    }

    fn source(&self, key: &str) -> Result<JwksSource, ConfigError> {
        let field = |name: &str| format!("{key}.{name}");
        match (&self.jwks_file, &self.jwks_url) {
            (Some(path), None) => {
                if self.ca_file.is_some() {
                    return Err(ConfigError::new(
                        &field("ca_file"),
                        "is for an https jwks_url only",
                    ));
                }
                let bytes = std::fs::read(path)
                    .map_err(|e| ConfigError::new(&field("jwks_file"), format!("{}: {e}", path.display())))?;
                Keys::parse(&bytes)
                    .map_err(|e| ConfigError::new(&field("jwks_file"), format!("{}: {e}", path.display())))?;
                Ok(JwksSource::File(path.clone()))
            }
            (None, Some(text)) => {
                let url = url::Url::parse(text).map_err(|e| {
                    ConfigError::new(&field("jwks_url"), format!("{text:?} is not a URL: {e}"))
                })?;
                let loopback = match url.host() {
                    Some(url::Host::Domain(name)) => name.eq_ignore_ascii_case("localhost"),
                    Some(url::Host::Ipv4(ip)) => IpAddr::V4(ip).is_loopback(),
                    Some(url::Host::Ipv6(ip)) => IpAddr::V6(ip).is_loopback(),
                    None => false,
                };
                match url.scheme() {
                    "https" => {}
                    "http" if loopback => {}
                    _ => {
                        return Err(ConfigError::new(
                            &field("jwks_url"),
                            format!(
                                "{text:?}: the keys that decide who a client is come over https (http only \
                                 from a loopback address)"
                            ),
                        ));
                    }
                }
                if let Some(path) = &self.ca_file {
                    crate::config::tls::roots(Some(path))
                        .map_err(|e| ConfigError::new(&field("ca_file"), e))?;
                }
                Ok(JwksSource::Url {
                    url,
                    ca_file: self.ca_file.clone(),
                })
            }
            (Some(_), Some(_)) => Err(ConfigError::new(
                key,
                "names jwks_file and jwks_url; the keys come from one of them",
            )),
            (None, None) => Err(ConfigError::new(
                key,
                "names no key set: set jwks_url (the issuer's JWKS endpoint) or jwks_file",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn url(text: &str) -> Result<JwtRules, ConfigError> {
        RawScopeJwt {
            jwks_url: Some(text.into()),
            ..RawScopeJwt::default()
        }
        .validate("idempotency.scope_jwt")
    }

    #[test]
    fn keys_come_over_https_or_from_a_loopback_address() {
        assert!(url("https://issuer.example/.well-known/jwks.json").is_ok());
        assert!(url("http://127.0.0.1:8080/jwks").is_ok());
        assert!(url("http://[::1]:8080/jwks").is_ok());
        assert!(url("http://localhost/jwks").is_ok());
        let refused = url("http://issuer.example/jwks").unwrap_err();
        assert_eq!(refused.key, "idempotency.scope_jwt.jwks_url");
        assert!(refused.message.contains("https"), "{refused}");
        assert!(url("ftp://127.0.0.1/jwks").is_err());
        assert!(url("not a url").is_err());
    }

    #[test]
    fn one_source_and_sane_times() {
        let neither = RawScopeJwt::default().validate("r").unwrap_err();
        assert_eq!(neither.key, "r");
        let both = RawScopeJwt {
            jwks_url: Some("https://a.example/jwks".into()),
            jwks_file: Some("/nonexistent".into()),
            ..RawScopeJwt::default()
        };
        assert!(both.validate("r").unwrap_err().message.contains("one of them"));
        let mut raw = RawScopeJwt {
            jwks_url: Some("https://a.example/jwks".into()),
            ..RawScopeJwt::default()
        };
        raw.leeway = Duration::from_millis(1500);
        assert_eq!(raw.validate("r").unwrap_err().key, "r.leeway");
        raw.leeway = Duration::from_secs(30);
        raw.claims = Vec::new();
        assert_eq!(raw.validate("r").unwrap_err().key, "r.claims");
        raw.claims = vec!["sub".into()];
        raw.refresh = Duration::from_secs(1);
        assert_eq!(raw.validate("r").unwrap_err().key, "r.refresh");
        raw.refresh = Duration::from_millis(10);
        raw.min_refetch = Duration::from_millis(10);
        assert_eq!(
            raw.validate("r").unwrap_err().key,
            "r.min_refetch",
            "anyone's unknown kid would have the set read every 10ms"
        );
    }

    #[test]
    fn a_route_turns_the_sections_table_off_with_false_and_401_is_released_where_it_is_on() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("jwks.json");
        let set =
            r#"{"keys":[{"kty":"OKP","crv":"Ed25519","x":"11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo"}]}"#;
        std::fs::write(&file, set).unwrap();
        let section = format!(
            "[idempotency.scope_jwt]\njwks_file = {:?}\n",
            file.display().to_string()
        );
        let toml = format!(
            "{section}[[routes]]\nname = \"partners\"\npath = \"/p\"\nscope_jwt = false\n\
             [[routes]]\nname = \"users\"\npath = \"/u\"\n"
        );
        let config = crate::config::Config::from_toml_str(&toml).expect("valid");
        let partners = &config.routes.routes[0].policy;
        assert!(partners.key.scope_jwt.is_none());
        assert_eq!(
            partners.key.scope_headers,
            [http::header::AUTHORIZATION],
            "the API key scopes"
        );
        assert!(!partners.store.release.releases(http::StatusCode::UNAUTHORIZED));
        let users = &config.routes.routes[1].policy;
        assert!(users.key.scope_jwt.is_some(), "inherited");
        assert!(users.key.scope_headers.is_empty());
        assert!(users.store.release.releases(http::StatusCode::UNAUTHORIZED));
        assert!(users.store.release.releases(http::StatusCode::FORBIDDEN));

        let on = format!("{section}[[routes]]\nname = \"r\"\npath = \"/r\"\nscope_jwt = true\n");
        let refused = crate::config::Config::from_toml_str(&on).unwrap_err();
        assert_eq!(refused.key, "routes[0].scope_jwt", "{refused}");
        assert!(refused.message.contains("jwks_url"), "{refused}");
        let typo = "[idempotency.scope_jwt]\njwks_uri = \"https://a.example/jwks\"\n";
        let refused = crate::config::Config::from_toml_str(typo).unwrap_err();
        assert!(refused.to_string().contains("jwks_uri"), "{refused}");
    }

    #[test]
    fn a_missing_key_file_names_the_key_and_the_reason() {
        let raw = RawScopeJwt {
            jwks_file: Some("/nonexistent/jwks.json".into()),
            ..RawScopeJwt::default()
        };
        let refused = raw.validate("routes[0].scope_jwt").unwrap_err();
        assert_eq!(refused.key, "routes[0].scope_jwt.jwks_file");
        assert!(refused.message.contains("No such file"), "{refused}");
    }
}
