//! Where a route's idempotency key comes from (`key = "…"`), and which JSON body fields its fingerprint
//! leaves out (`fingerprint_exclude`), as written in a policy and as the proxy reads them. Parsed once at
//! load by `idempotency.rs`; `proxy/key/source.rs` reads the key out of a request with a [`KeySource`].
//! Touches nothing but the text it is given.

use std::fmt;

use http::HeaderName;

use super::ConfigError;
use super::parse::parse_header;

/// Where a request's idempotency key is read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    /// `header:NAME`: a request header, as an RFC 8941 sf-string or a bare token (`Idempotency-Key`).
    Header(HeaderName),
    /// `cloudevents`: a CloudEvent's `source` and `id` (binary mode `ce-source` / `ce-id` headers, or
    /// the fields of an `application/cloudevents+json` body). Batched mode is refused.
    CloudEvents,
    /// `json:/pointer`: an RFC 6901 pointer into a JSON body (a string or a number).
    Json(String),
    /// `template:…`: literal text and `{…}` parts, joined; missing if any part is missing.
    Template(Vec<KeyPart>),
    /// `jsonrpc` or `jsonrpc:/pointer`: a JSON-RPC 2.0 request's key, at `params._meta.idempotencyKey`
    /// (MCP's proposed field, [`JSONRPC_KEY`]) or at the pointer named. The request `id` and
    /// `params._meta` are left out of the fingerprint, and a replay answers with the retry's own `id`.
    JsonRpc(String),
    /// `repeatability`: OASIS Repeatable Requests. The key is `Repeatability-Request-ID` (as a header
    /// key is read); `Repeatability-First-Sent` must come with it, within the route's
    /// `repeatability_window`.
    Repeatability,
    /// `graphql`: a GraphQL mutation's root fields marked `@idempotent(key: "…")`, each keyed on its own
    /// and forwarded as an operation of its own (`proxy/dialect/graphql.rs`); other operations pass.
    GraphQl,
}

/// Where `key = "jsonrpc"` reads the key: `params._meta.idempotencyKey`.
pub const JSONRPC_KEY: &str = "/params/_meta/idempotencyKey";

/// One part of a key template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyPart {
    /// Text written in the template.
    Literal(String),
    /// `{header:NAME}`
    Header(HeaderName),
    /// `{json:/pointer}`
    Json(String),
    /// `{cloudevents}`: the CloudEvent's source and id, as `key = "cloudevents"` reads them.
    CloudEvents,
    /// `{method}`: the request method.
    Method,
    /// `{path}`: the request path, without the query.
    Path,
}

impl KeySource {
    /// Parses `key = "…"`, naming `key` in errors.
    pub fn parse(key: &str, text: &str) -> Result<KeySource, ConfigError> {
        let text = text.trim();
        if text == "cloudevents" {
            return Ok(KeySource::CloudEvents);
        }
        if text == "jsonrpc" {
            return Ok(KeySource::JsonRpc(JSONRPC_KEY.to_owned()));
        }
        if text == "repeatability" {
            return Ok(KeySource::Repeatability);
        }
        if text == "graphql" {
            return Ok(KeySource::GraphQl);
        }
        if let Some(pointer) = text.strip_prefix("jsonrpc:") {
            return parse_jsonrpc_pointer(key, pointer).map(KeySource::JsonRpc);
        }
        if let Some(name) = text.strip_prefix("header:") {
            return Ok(KeySource::Header(parse_header(key, name.trim())?));
        }
        if let Some(pointer) = text.strip_prefix("json:") {
            return Ok(KeySource::Json(parse_pointer(key, pointer)?));
        }
        if let Some(template) = text.strip_prefix("template:") {
            return parse_template(key, template).map(KeySource::Template);
        }
        Err(ConfigError::new(
            key,
            format!(
                "{text:?} is not a key source; use \"header:NAME\", \"cloudevents\", \"json:/pointer\", \
                 \"jsonrpc\", \"jsonrpc:/pointer\", \"graphql\", \"repeatability\" or \"template:…\" with {{header:NAME}}, {{json:/pointer}}, {{cloudevents}}, {{method}}, \
                 {{path}} parts"
            ),
        ))
    }

    /// Whether the key can only be known once the body has been read.
    pub fn needs_body(&self) -> bool {
        match self {
            KeySource::Header(_) | KeySource::Repeatability => false,
            KeySource::CloudEvents | KeySource::Json(_) | KeySource::JsonRpc(_) | KeySource::GraphQl => true,
            KeySource::Template(parts) => parts
                .iter()
                .any(|p| matches!(p, KeyPart::Json(_) | KeyPart::CloudEvents)),
        }
    }
}

impl fmt::Display for KeySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeySource::Header(name) => write!(f, "header:{name}"),
            KeySource::CloudEvents => f.write_str("cloudevents"),
            KeySource::Json(pointer) => write!(f, "json:{pointer}"),
            KeySource::JsonRpc(pointer) if pointer == JSONRPC_KEY => f.write_str("jsonrpc"),
            KeySource::JsonRpc(pointer) => write!(f, "jsonrpc:{pointer}"),
            KeySource::Repeatability => f.write_str("repeatability"),
            KeySource::GraphQl => f.write_str("graphql"),
            KeySource::Template(parts) => {
                f.write_str("template:")?;
                parts.iter().try_for_each(|part| write!(f, "{part}"))
            }
        }
    }
}

impl fmt::Display for KeyPart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyPart::Literal(text) => f.write_str(text),
            KeyPart::Header(name) => write!(f, "{{header:{name}}}"),
            KeyPart::Json(pointer) => write!(f, "{{json:{pointer}}}"),
            KeyPart::CloudEvents => f.write_str("{cloudevents}"),
            KeyPart::Method => f.write_str("{method}"),
            KeyPart::Path => f.write_str("{path}"),
        }
    }
}

/// Checks an RFC 6901 JSON pointer: empty (the whole document) or `/`-separated tokens in which `~` is
/// only ever followed by `0` or `1`.
pub fn parse_pointer(key: &str, pointer: &str) -> Result<String, ConfigError> {
    let bad = |why: &str| {
        ConfigError::new(
            key,
            format!("{pointer:?} is not a JSON pointer (RFC 6901, like \"/data/id\"): {why}"),
        )
    };
    if !pointer.is_empty() && !pointer.starts_with('/') {
        return Err(bad("it must start with '/'"));
    }
    let mut chars = pointer.chars();
    while let Some(c) = chars.next() {
        if c == '~' && !matches!(chars.next(), Some('0' | '1')) {
            return Err(bad("'~' must be followed by 0 or 1"));
        }
    }
    Ok(pointer.to_owned())
}

/// A `jsonrpc:` pointer: an RFC 6901 pointer into the request object, never at or under its `id` (which a
/// retry changes) nor the whole body.
fn parse_jsonrpc_pointer(key: &str, pointer: &str) -> Result<String, ConfigError> {
    let pointer = parse_pointer(key, pointer)?;
    if pointer.is_empty() || pointer == "/id" || pointer.starts_with("/id/") {
        return Err(ConfigError::new(
            key,
            format!(
                "{pointer:?}: a jsonrpc key is a field of the request other than its id (a retry sends a \
                 new id), like \"jsonrpc:/params/idempotency_key\""
            ),
        ));
    }
    Ok(pointer)
}

fn parse_template(key: &str, template: &str) -> Result<Vec<KeyPart>, ConfigError> {
    let mut parts = Vec::new();
    let mut rest = template;
    while !rest.is_empty() {
        let Some(open) = rest.find('{') else {
            push_literal(key, &mut parts, rest)?;
            break;
        };
        push_literal(key, &mut parts, &rest[..open])?;
        let Some(close) = rest[open..].find('}') else {
            return Err(ConfigError::new(
                key,
                format!("{template:?}: a '{{' is never closed"),
            ));
        };
        parts.push(parse_part(key, &rest[open + 1..open + close])?);
        rest = &rest[open + close + 1..];
    }
    if !parts.iter().any(|p| !matches!(p, KeyPart::Literal(_))) {
        return Err(ConfigError::new(
            key,
            format!("{template:?}: a template needs at least one {{…}} part taken from the request"),
        ));
    }
    Ok(parts)
}

fn push_literal(key: &str, parts: &mut Vec<KeyPart>, text: &str) -> Result<(), ConfigError> {
    if text.is_empty() {
        return Ok(());
    }
    if text.contains('}') || !text.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(ConfigError::new(
            key,
            format!("template text {text:?} may hold only visible ASCII characters other than braces"),
        ));
    }
    parts.push(KeyPart::Literal(text.to_owned()));
    Ok(())
}

fn parse_part(key: &str, part: &str) -> Result<KeyPart, ConfigError> {
    match part {
        "cloudevents" => return Ok(KeyPart::CloudEvents),
        "method" => return Ok(KeyPart::Method),
        "path" => return Ok(KeyPart::Path),
        _ => {}
    }
    if let Some(name) = part.strip_prefix("header:") {
        return Ok(KeyPart::Header(parse_header(key, name)?));
    }
    if let Some(pointer) = part.strip_prefix("json:") {
        return Ok(KeyPart::Json(parse_pointer(key, pointer)?));
    }
    Err(ConfigError::new(
        key,
        format!(
            "{{{part}}} is not a template part; use {{header:NAME}}, {{json:/pointer}}, {{cloudevents}}, \
             {{method}} or {{path}}"
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_source_parses_and_prints_back() {
        for text in [
            "header:x-github-delivery",
            "cloudevents",
            "json:/data/id",
            "jsonrpc",
            "jsonrpc:/params/idempotency_key",
            "template:{header:x-github-hook-id}/{header:x-github-delivery}",
            "template:{method}:{path}:{json:/id}",
        ] {
            let source = KeySource::parse("routes[0].key", text).unwrap();
            assert_eq!(source.to_string(), text);
        }
        assert_eq!(
            KeySource::parse("k", "jsonrpc").unwrap(),
            KeySource::JsonRpc("/params/_meta/idempotencyKey".into())
        );
        assert_eq!(
            KeySource::parse("k", "jsonrpc:/params/_meta/idempotencyKey")
                .unwrap()
                .to_string(),
            "jsonrpc",
            "the default pointer prints as the bare source"
        );
        assert_eq!(
            KeySource::parse("k", "header:X-Shopify-Event-Id").unwrap(),
            KeySource::Header(HeaderName::from_static("x-shopify-event-id"))
        );
    }

    #[test]
    fn only_body_sources_need_the_body() {
        let needs = |text| KeySource::parse("k", text).unwrap().needs_body();
        assert!(!needs("header:idempotency-key"));
        assert!(!needs("template:{method}{header:webhook-id}"));
        assert!(needs("cloudevents"));
        assert!(needs("json:/id"));
        assert!(needs("jsonrpc"));
        assert!(needs("template:{header:a}{json:/id}"));
    }

    #[test]
    fn bad_sources_are_named_in_one_line() {
        for text in [
            "idempotency-key",
            "header:a b",
            "json:id",
            "json:/a~2",
            "template:plain",
            "template:{header:a",
            "template:{body}",
            "template:{header:a} b",
            "jsonrpc:",
            "jsonrpc:params/key",
            "jsonrpc:/id",
            "jsonrpc:/id/0",
        ] {
            let err = KeySource::parse("routes[1].key", text).unwrap_err();
            assert_eq!(err.key, "routes[1].key", "{text}");
            assert_eq!(err.to_string().lines().count(), 1, "{err}");
        }
    }

    /// The ```toml blocks of the "Webhook and event receivers" section of docs/routes.md.
    fn receiver_examples() -> Vec<&'static str> {
        const ROUTES: &str = include_str!("../../docs/routes.md");
        let start = ROUTES
            .find("\n## Webhook and event receivers\n")
            .expect("docs/routes.md has a Webhook and event receivers section");
        let section = &ROUTES[start + 1..];
        let section = &section[..section.find("\n## ").unwrap_or(section.len())];
        section
            .split("```toml\n")
            .skip(1)
            .map(|block| block.split("```").next().unwrap_or_default())
            .collect()
    }

    /// Every variable and file the examples name holds a secret valid for every scheme.
    struct AnySecret;

    impl crate::config::SecretReader for AnySecret {
        fn var(&self, _name: &str) -> Result<Option<String>, String> {
            Ok(Some("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw".into()))
        }

        fn file(&self, _path: &std::path::Path, _limit: u64) -> Result<String, String> {
            Ok("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\n".into())
        }
    }

    #[test]
    fn every_receiver_example_in_the_docs_loads() {
        use crate::config::SchemeName;
        let examples = receiver_examples();
        let mut names = Vec::new();
        let mut verified = Vec::new();
        for example in &examples {
            let config = crate::config::Config::from_toml_str_with(example, &AnySecret)
                .unwrap_or_else(|e| panic!("docs/routes.md example does not load: {e}\n{example}"));
            assert!(!config.routes.routes.is_empty(), "{example}");
            names.extend(config.routes.routes.iter().map(|r| r.name.clone()));
            let signed = config.routes.routes.iter().filter_map(|r| {
                let scheme = r.policy.signature.as_ref()?.scheme.name();
                Some((r.name.clone(), scheme))
            });
            verified.extend(signed);
        }
        for (name, scheme) in [
            ("github", SchemeName::Github),
            ("stripe", SchemeName::Stripe),
            ("standard-webhooks", SchemeName::StandardWebhooks),
            ("shopify", SchemeName::Shopify),
        ] {
            assert!(
                verified.contains(&(name.to_owned(), scheme)),
                "the {name} example of docs/routes.md verifies {scheme:?} signatures: {verified:?}"
            );
        }
        for name in [
            "payments",
            "github",
            "stripe",
            "standard-webhooks",
            "shopify",
            "knative-events",
            "dapr-orders",
        ] {
            assert!(
                names.iter().any(|n| n == name),
                "no example in docs/routes.md named {name}: {names:?}"
            );
        }
    }

    #[test]
    fn the_jsonrpc_example_in_the_docs_loads_and_keys_by_jsonrpc() {
        const ROUTES: &str = include_str!("../../docs/routes.md");
        let start = ROUTES
            .find("\n## JSON-RPC and MCP\n")
            .expect("docs/routes.md has a JSON-RPC and MCP section");
        let section = &ROUTES[start + 1..];
        let section = &section[..section.find("\n## ").unwrap_or(section.len())];
        let example = section
            .split("```toml\n")
            .nth(1)
            .and_then(|block| block.split("```").next())
            .expect("a TOML example");
        let config = crate::config::Config::from_toml_str(example)
            .unwrap_or_else(|e| panic!("docs/routes.md example does not load: {e}\n{example}"));
        assert_eq!(
            config.routes.routes[0].policy.key.source,
            KeySource::JsonRpc(JSONRPC_KEY.into())
        );
    }

    #[test]
    fn pointers_follow_rfc_6901() {
        assert!(parse_pointer("k", "").is_ok());
        assert!(parse_pointer("k", "/a~0b/c~1d/0").is_ok());
        assert!(parse_pointer("k", "a").is_err());
        assert!(parse_pointer("k", "/a~").is_err());
    }
}
