//! A route's `signature`: the webhook signature the proxy checks before it claims a delivery's key
//! (docs/routes.md: Signatures). Validated once at load into [`SignatureConfig`]: the scheme,
//! the timestamp tolerance, and the secrets, read through a [`SecretReader`] from the file or the
//! environment variables the config names — never from the TOML itself. Secrets are read at start only:
//! a changed file is not read again until the next start (rotation works by listing both secrets for a
//! while, see docs/routes.md). `proxy/signature.rs` verifies with the result. Touches nothing but the files
//! and variables the config names.

use std::fmt;
use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use http::HeaderName;
use serde::{Deserialize, Serialize};

use super::ConfigError;
use super::parse::parse_header;

/// Most secrets one route verifies with at once: each costs one HMAC pass over every body.
pub const MAX_SECRETS: usize = 8;
/// Largest secrets file read; a secret is tens of bytes.
const MAX_SECRETS_FILE: u64 = 64 * 1024;
/// How far a signed timestamp may be from the proxy's clock, either way, unless `tolerance` says.
const DEFAULT_TOLERANCE: Duration = Duration::from_secs(5 * 60);
/// The widest `tolerance` accepted: past it a captured delivery could be sent again for too long.
const MAX_TOLERANCE: Duration = Duration::from_secs(60 * 60);
/// What a Stripe signing secret, and optionally a Standard Webhooks one, starts with.
const WHSEC: &str = "whsec_";
/// Variables the configuration itself reads: a secret there would be taken for a config key.
const CONFIG_ENV_PREFIX: &str = "IDEMPROXY_";

/// A route's `signature` table as written.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawSignature {
    /// Who signs: `standard_webhooks`, `stripe`, `github`, `shopify`, or `hmac` (generic).
    pub scheme: SchemeName,
    /// A file holding the secrets, one per line (blank lines skipped, surrounding whitespace trimmed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secrets_file: Option<PathBuf>,
    /// An environment variable holding the secrets (one per line), or a list of such variables.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secrets_env: Option<EnvNames>,
    /// How far the signed timestamp may be from the proxy's clock, either way (`standard_webhooks` and
    /// `stripe`; default 5 minutes).
    #[serde(default, skip_serializing_if = "Option::is_none", with = "humantime_serde")]
    pub tolerance: Option<Duration>,
    /// `hmac` only: the header carrying the signature.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    /// `hmac` only: `sha256` (default) or `sha512`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub algorithm: Option<Algorithm>,
    /// `hmac` only: how the signature is written, `hex` (default) or `base64`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encoding: Option<Encoding>,
    /// `hmac` only: text before the signature in the header (`sha256=`); default none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
}

/// `secrets_env`: one variable's name, or several.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(untagged)]
pub enum EnvNames {
    /// One variable.
    One(String),
    /// Several variables, each holding one or more secrets.
    Many(Vec<String>),
}

impl EnvNames {
    fn names(&self) -> &[String] {
        match self {
            EnvNames::One(name) => std::slice::from_ref(name),
            EnvNames::Many(names) => names,
        }
    }
}

/// Who signs the deliveries, as written in `scheme`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SchemeName {
    /// Standard Webhooks (Svix and others): `webhook-id`, `webhook-timestamp`, `webhook-signature`.
    StandardWebhooks,
    /// Stripe: `Stripe-Signature: t=…,v1=…`.
    Stripe,
    /// GitHub: `X-Hub-Signature-256: sha256=<hex>`.
    Github,
    /// Shopify: `X-Shopify-Hmac-Sha256: <base64>`.
    Shopify,
    /// An HMAC of the body in a header the route names.
    Hmac,
}

impl SchemeName {
    /// The name as written in the config.
    pub fn as_str(self) -> &'static str {
        match self {
            SchemeName::StandardWebhooks => "standard_webhooks",
            SchemeName::Stripe => "stripe",
            SchemeName::Github => "github",
            SchemeName::Shopify => "shopify",
            SchemeName::Hmac => "hmac",
        }
    }

    /// Whether the scheme signs a timestamp, which `tolerance` then bounds.
    fn timestamped(self) -> bool {
        matches!(self, SchemeName::StandardWebhooks | SchemeName::Stripe)
    }
}

/// The hash under a generic HMAC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Algorithm {
    /// HMAC-SHA256, 32-byte signatures.
    Sha256,
    /// HMAC-SHA512, 64-byte signatures.
    Sha512,
}

/// How a generic HMAC's signature is written in its header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Encoding {
    /// Hexadecimal, either case.
    Hex,
    /// Standard base64, padded.
    Base64,
}

/// A validated `signature`: every secret read and well-formed for its scheme.
#[derive(Debug, Clone)]
pub struct SignatureConfig {
    /// How deliveries are signed.
    pub scheme: Scheme,
    /// The HMAC keys, at least one: a delivery signed with any of them passes.
    pub secrets: Vec<Secret>,
    /// How far a signed timestamp may be from the proxy's clock, either way.
    pub tolerance: Duration,
}

impl SignatureConfig {
    /// The request headers a delivery's signature is read from.
    pub fn signed_headers(&self) -> Vec<HeaderName> {
        let names: &[&'static str] = match &self.scheme {
            Scheme::StandardWebhooks => &["webhook-id", "webhook-timestamp", "webhook-signature"],
            Scheme::Stripe => &["stripe-signature"],
            Scheme::Github => &["x-hub-signature-256"],
            Scheme::Shopify => &["x-shopify-hmac-sha256"],
            Scheme::Hmac(generic) => return vec![generic.header.clone()],
        };
        names.iter().map(|name| HeaderName::from_static(name)).collect()
    }
}

/// How deliveries are signed, with what a generic HMAC needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scheme {
    /// Standard Webhooks.
    StandardWebhooks,
    /// Stripe.
    Stripe,
    /// GitHub.
    Github,
    /// Shopify.
    Shopify,
    /// A generic HMAC of the body.
    Hmac(GenericHmac),
}

impl Scheme {
    /// The scheme's name as written in the config.
    pub fn name(&self) -> SchemeName {
        match self {
            Scheme::StandardWebhooks => SchemeName::StandardWebhooks,
            Scheme::Stripe => SchemeName::Stripe,
            Scheme::Github => SchemeName::Github,
            Scheme::Shopify => SchemeName::Shopify,
            Scheme::Hmac(_) => SchemeName::Hmac,
        }
    }
}

/// A generic HMAC: where its signature is and how it is written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GenericHmac {
    /// The header carrying the signature.
    pub header: HeaderName,
    /// The hash.
    pub algorithm: Algorithm,
    /// How the signature is written.
    pub encoding: Encoding,
    /// Text before the signature, if any.
    pub prefix: String,
}

/// One HMAC key; its `Debug` shows none of it.
#[derive(Clone)]
pub struct Secret(Vec<u8>);

impl Secret {
    /// The key's bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

/// Where secrets are read from: the process's environment and files ([`ProcessSecrets`]), or, in tests,
/// something else.
pub trait SecretReader {
    /// The value of the environment variable `name`; `Ok(None)` when it is not set.
    fn var(&self, name: &str) -> Result<Option<String>, String>;
    /// The contents of the file at `path`, at most `limit` bytes of it (more is an error).
    fn file(&self, path: &Path, limit: u64) -> Result<String, String>;
}

/// The process's environment and file system.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcessSecrets;

impl SecretReader for ProcessSecrets {
    fn var(&self, name: &str) -> Result<Option<String>, String> {
        match std::env::var(name) {
            Ok(value) => Ok(Some(value)),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(_)) => Err(format!("{name} is not UTF-8")),
        }
    }

    fn file(&self, path: &Path, limit: u64) -> Result<String, String> {
        let file = std::fs::File::open(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let mut text = String::new();
        file.take(limit + 1)
            .read_to_string(&mut text)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        if text.len() as u64 > limit {
            return Err(format!("{} is larger than {limit} bytes", path.display()));
        }
        Ok(text)
    }
}

/// One line of a secrets source, for errors that must name where a bad secret is but never show it.
struct Line {
    text: String,
    /// "line 2 of /run/secrets/stripe", "STRIPE_WEBHOOK_SECRET".
    place: String,
}

impl RawSignature {
    /// Checks the table and reads its secrets; `prefix` is its dotted key (`routes[1].signature`).
    pub fn validate(&self, prefix: &str, reader: &dyn SecretReader) -> Result<SignatureConfig, ConfigError> {
        let key = |field: &str| format!("{prefix}.{field}");
        let scheme = self.scheme(prefix)?;
        let tolerance = self.tolerance(&key("tolerance"))?;
        let (source_key, lines) = self.lines(prefix, reader)?;
        if lines.len() > MAX_SECRETS {
            return Err(ConfigError::new(
                &source_key,
                format!(
                    "holds {} secrets; at most {MAX_SECRETS} (each costs one HMAC pass over every body; \
                     a rotation needs two)",
                    lines.len()
                ),
            ));
        }
        let secrets = lines
            .iter()
            .map(|line| secret(self.scheme, line).map_err(|why| ConfigError::new(&source_key, why)))
            .collect::<Result<_, _>>()?;
        Ok(SignatureConfig {
            scheme,
            secrets,
            tolerance,
        })
    }

    fn scheme(&self, prefix: &str) -> Result<Scheme, ConfigError> {
        let generic = [
            ("header", self.header.is_some()),
            ("algorithm", self.algorithm.is_some()),
            ("encoding", self.encoding.is_some()),
            ("prefix", self.prefix.is_some()),
        ];
        let scheme = match self.scheme {
            SchemeName::StandardWebhooks => Scheme::StandardWebhooks,
            SchemeName::Stripe => Scheme::Stripe,
            SchemeName::Github => Scheme::Github,
            SchemeName::Shopify => Scheme::Shopify,
            SchemeName::Hmac => return self.generic(prefix).map(Scheme::Hmac),
        };
        if let Some((field, _)) = generic.iter().find(|(_, set)| *set) {
            return Err(ConfigError::new(
                &format!("{prefix}.{field}"),
                format!(
                    "applies to scheme = \"hmac\" only; {} signatures have their own",
                    self.scheme.as_str()
                ),
            ));
        }
        Ok(scheme)
    }

    fn generic(&self, prefix: &str) -> Result<GenericHmac, ConfigError> {
        let key = format!("{prefix}.header");
        let Some(header) = &self.header else {
            return Err(ConfigError::new(
                &key,
                "scheme = \"hmac\" needs the header that carries the signature (e.g. \"X-Signature\")",
            ));
        };
        let prefix_text = self.prefix.clone().unwrap_or_default();
        if !prefix_text.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(ConfigError::new(
                &format!("{prefix}.prefix"),
                format!("{prefix_text:?}: use visible ASCII characters only"),
            ));
        }
        Ok(GenericHmac {
            header: parse_header(&key, header)?,
            algorithm: self.algorithm.unwrap_or(Algorithm::Sha256),
            encoding: self.encoding.unwrap_or(Encoding::Hex),
            prefix: prefix_text,
        })
    }

    fn tolerance(&self, key: &str) -> Result<Duration, ConfigError> {
        let Some(tolerance) = self.tolerance else {
            return Ok(DEFAULT_TOLERANCE);
        };
        if !self.scheme.timestamped() {
            return Err(ConfigError::new(
                key,
                format!("{} signatures carry no timestamp", self.scheme.as_str()),
            ));
        }
        if tolerance < Duration::from_secs(1) || tolerance > MAX_TOLERANCE {
            return Err(ConfigError::new(key, "must be from 1s to 1h"));
        }
        Ok(tolerance)
    }

    /// The secrets' lines, and the key that names their source (for errors about them).
    fn lines(&self, prefix: &str, reader: &dyn SecretReader) -> Result<(String, Vec<Line>), ConfigError> {
        let file_key = format!("{prefix}.secrets_file");
        let env_key = format!("{prefix}.secrets_env");
        let lines = match (&self.secrets_file, &self.secrets_env) {
            (Some(path), None) => (file_key.clone(), file_lines(&file_key, path, reader)?),
            (None, Some(names)) => (env_key.clone(), env_lines(&env_key, names.names(), reader)?),
            (Some(_), Some(_)) => {
                return Err(ConfigError::new(
                    &env_key,
                    format!("give the secrets in {prefix}.secrets_file or in {prefix}.secrets_env, not both"),
                ));
            }
            (None, None) => {
                return Err(ConfigError::new(
                    &file_key,
                    "a signature needs its secrets: name a file (secrets_file) or environment variables \
                     (secrets_env); secrets are never written in the config itself",
                ));
            }
        };
        if lines.1.is_empty() {
            return Err(ConfigError::new(&lines.0, "holds no secret"));
        }
        Ok(lines)
    }
}

/// The non-blank lines of the secrets file, trimmed.
fn file_lines(key: &str, path: &Path, reader: &dyn SecretReader) -> Result<Vec<Line>, ConfigError> {
    let text = reader
        .file(path, MAX_SECRETS_FILE)
        .map_err(|why| ConfigError::new(key, why))?;
    Ok(split(&text, |n| format!("line {n} of {}", path.display())))
}

/// The non-blank lines of every named variable, trimmed; each variable must be set.
fn env_lines(key: &str, names: &[String], reader: &dyn SecretReader) -> Result<Vec<Line>, ConfigError> {
    if names.is_empty() {
        return Err(ConfigError::new(key, "names no environment variable"));
    }
    let mut lines = Vec::new();
    for name in names {
        check_var_name(key, name)?;
        let value = reader.var(name).map_err(|why| ConfigError::new(key, why))?;
        let Some(value) = value else {
            return Err(ConfigError::new(key, format!("{name} is not set")));
        };
        let found = split(&value, |n| format!("line {n} of {name}"));
        if found.is_empty() {
            return Err(ConfigError::new(key, format!("{name} is empty")));
        }
        lines.extend(found);
    }
    Ok(lines)
}

fn check_var_name(key: &str, name: &str) -> Result<(), ConfigError> {
    let valid = name
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if !valid {
        return Err(ConfigError::new(
            key,
            format!("{name:?} is not an environment variable name"),
        ));
    }
    if name.to_ascii_uppercase().starts_with(CONFIG_ENV_PREFIX) {
        return Err(ConfigError::new(
            key,
            format!(
                "{name}: variables starting {CONFIG_ENV_PREFIX} are read as configuration; choose another name"
            ),
        ));
    }
    Ok(())
}

/// Each non-blank line, trimmed, with its place named by `place(line number)`.
fn split(text: &str, place: impl Fn(usize) -> String) -> Vec<Line> {
    text.lines()
        .enumerate()
        .map(|(n, line)| (n + 1, line.trim()))
        .filter(|(_, line)| !line.is_empty())
        .map(|(n, line)| Line {
            text: line.to_owned(),
            place: place(n),
        })
        .collect()
}

/// The HMAC key a line holds for `scheme`; the error names the line, never its text.
fn secret(scheme: SchemeName, line: &Line) -> Result<Secret, String> {
    let text = line.text.as_str();
    let bytes = match scheme {
        SchemeName::StandardWebhooks => {
            let encoded = text.strip_prefix(WHSEC).unwrap_or(text);
            match BASE64.decode(encoded) {
                Ok(key) if !key.is_empty() => key,
                _ => {
                    return Err(format!(
                        "{} is not a Standard Webhooks secret (whsec_ and base64)",
                        line.place
                    ));
                }
            }
        }
        SchemeName::Stripe => {
            if text.len() <= WHSEC.len() || !text.starts_with(WHSEC) {
                return Err(format!(
                    "{} is not a Stripe webhook signing secret (whsec_…; not an API key)",
                    line.place
                ));
            }
            text.as_bytes().to_vec()
        }
        SchemeName::Github | SchemeName::Shopify | SchemeName::Hmac => text.as_bytes().to_vec(),
    };
    Ok(Secret(bytes))
}

#[cfg(test)]
pub(crate) mod tests {
    use std::collections::BTreeMap;
    use std::io::Write as _;
    use std::path::Path;
    use std::time::Duration;

    use super::*;
    use crate::config::Config;

    /// Secrets from a map of variables (and no files), as the process's environment would give them.
    pub(crate) struct Vars(pub BTreeMap<&'static str, &'static str>);

    impl Vars {
        pub(crate) fn of(pairs: &[(&'static str, &'static str)]) -> Vars {
            Vars(pairs.iter().copied().collect())
        }
    }

    impl SecretReader for Vars {
        fn var(&self, name: &str) -> Result<Option<String>, String> {
            Ok(self.0.get(name).map(|value| (*value).to_owned()))
        }

        fn file(&self, path: &Path, _limit: u64) -> Result<String, String> {
            Err(format!("cannot read {}: no such file", path.display()))
        }
    }

    /// The route `hook` with the given `signature` table, loaded with `reader`.
    fn load(signature: &str, reader: &dyn SecretReader) -> Result<Config, ConfigError> {
        let toml = format!(
            "[[routes]]\nname = \"hook\"\npath = \"/hook\"\nunscoped = \"shared\"\nscope_headers = []\n\
             signature = {{ {signature} }}\n"
        );
        Config::from_toml_str_with(&toml, reader)
    }

    fn signature(config: &Config) -> &SignatureConfig {
        config.routes.routes[0]
            .policy
            .signature
            .as_deref()
            .expect("a signature")
    }

    const WHSEC: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

    #[test]
    fn each_scheme_takes_its_secrets_from_the_environment() {
        let vars = Vars::of(&[("SECRET", WHSEC), ("TEXT", "It's a Secret to Everybody")]);
        let standard = load("scheme = \"standard_webhooks\", secrets_env = \"SECRET\"", &vars).unwrap();
        assert_eq!(
            signature(&standard).secrets[0].bytes().len(),
            24,
            "base64 after whsec_"
        );
        assert_eq!(signature(&standard).tolerance, Duration::from_secs(300));
        let stripe = load("scheme = \"stripe\", secrets_env = \"SECRET\"", &vars).unwrap();
        assert_eq!(
            signature(&stripe).secrets[0].bytes(),
            WHSEC.as_bytes(),
            "used as is"
        );
        for scheme in ["github", "shopify"] {
            let config = load(&format!("scheme = \"{scheme}\", secrets_env = \"TEXT\""), &vars).unwrap();
            assert_eq!(
                signature(&config).secrets[0].bytes(),
                b"It's a Secret to Everybody"
            );
        }
        let generic = load(
            "scheme = \"hmac\", header = \"X-Sig\", algorithm = \"sha512\", encoding = \"base64\", \
             prefix = \"v1=\", secrets_env = \"TEXT\"",
            &vars,
        )
        .unwrap();
        let Scheme::Hmac(hmac) = &signature(&generic).scheme else {
            panic!("a generic HMAC")
        };
        assert_eq!(hmac.header.as_str(), "x-sig");
        assert_eq!(
            (hmac.algorithm, hmac.encoding),
            (Algorithm::Sha512, Encoding::Base64)
        );
        assert_eq!(hmac.prefix, "v1=");
    }

    #[test]
    fn several_secrets_come_one_per_line_or_one_variable_each() {
        let vars = Vars::of(&[
            ("BOTH", "  whsec_new\r\n\n whsec_old \n"),
            ("NEW", "whsec_new"),
            ("OLD", "whsec_old"),
        ]);
        for source in ["secrets_env = \"BOTH\"", "secrets_env = [\"NEW\", \"OLD\"]"] {
            let config = load(&format!("scheme = \"stripe\", {source}"), &vars).unwrap();
            let secrets: Vec<&[u8]> = signature(&config).secrets.iter().map(Secret::bytes).collect();
            assert_eq!(secrets, [b"whsec_new".as_slice(), b"whsec_old"], "{source}");
        }
        let mut file = tempfile::NamedTempFile::new().unwrap();
        writeln!(file, "whsec_new\n\nwhsec_old").unwrap();
        let source = format!("scheme = \"stripe\", secrets_file = {:?}", file.path());
        let config = load(&source, &ProcessSecrets).unwrap();
        assert_eq!(signature(&config).secrets.len(), 2);
    }

    #[test]
    fn a_missing_or_empty_source_names_the_key_and_the_variable_or_file() {
        let vars = Vars::of(&[("EMPTY", " \n")]);
        for (source, key, says) in [
            ("secrets_env = \"UNSET\"", "secrets_env", "UNSET is not set"),
            ("secrets_env = \"EMPTY\"", "secrets_env", "EMPTY is empty"),
            ("secrets_env = []", "secrets_env", "names no environment variable"),
            (
                "secrets_env = \"A-B\"",
                "secrets_env",
                "not an environment variable name",
            ),
            (
                "secrets_env = \"IDEMPROXY_SECRET\"",
                "secrets_env",
                "read as configuration",
            ),
            (
                "secrets_file = \"/no/such/file\"",
                "secrets_file",
                "/no/such/file",
            ),
            (
                "secrets_file = \"/f\", secrets_env = \"EMPTY\"",
                "secrets_env",
                "not both",
            ),
            (
                "tolerance = \"1m\"",
                "secrets_file",
                "never written in the config",
            ),
        ] {
            let err = load(&format!("scheme = \"stripe\", {source}"), &vars).unwrap_err();
            assert_eq!(err.key, format!("routes[0].signature.{key}"), "{source}: {err}");
            assert!(err.message.contains(says), "{source}: {err}");
            assert_eq!(err.to_string().lines().count(), 1, "{err}");
        }
    }

    #[test]
    fn a_malformed_secret_is_named_by_its_place_never_shown() {
        let vars = Vars::of(&[("KEYS", "whsec_good\nsk_live_51Habc"), ("SW", "whsec_not*base64")]);
        let err = load("scheme = \"stripe\", secrets_env = \"KEYS\"", &vars).unwrap_err();
        assert_eq!(err.key, "routes[0].signature.secrets_env");
        assert!(err.message.contains("line 2 of KEYS"), "{err}");
        assert!(!err.message.contains("sk_live"), "{err}");
        let err = load("scheme = \"standard_webhooks\", secrets_env = \"SW\"", &vars).unwrap_err();
        assert!(err.message.contains("Standard Webhooks secret"), "{err}");
        assert!(!err.message.contains("not*base64"), "{err}");
    }

    #[test]
    fn at_most_eight_secrets() {
        let nine = "a\nb\nc\nd\ne\nf\ng\nh\ni";
        let err = load(
            "scheme = \"github\", secrets_env = \"MANY\"",
            &Vars::of(&[("MANY", nine)]),
        )
        .unwrap_err();
        assert_eq!(err.key, "routes[0].signature.secrets_env");
        assert!(err.message.contains("at most 8"), "{err}");
    }

    #[test]
    fn settings_of_other_schemes_are_refused_by_name() {
        let vars = Vars::of(&[("S", "whsec_abc")]);
        for (table, key) in [
            ("scheme = \"github\", tolerance = \"1m\"", "tolerance"),
            ("scheme = \"stripe\", tolerance = \"0s\"", "tolerance"),
            ("scheme = \"stripe\", tolerance = \"2h\"", "tolerance"),
            ("scheme = \"stripe\", header = \"x-sig\"", "header"),
            ("scheme = \"github\", prefix = \"sha1=\"", "prefix"),
            ("scheme = \"hmac\"", "header"),
            ("scheme = \"hmac\", header = \"a b\"", "header"),
            ("scheme = \"hmac\", header = \"x\", prefix = \"a b\"", "prefix"),
            (
                "scheme = \"hmac\", header = \"x\", algorithm = \"md5\"",
                "algorithm",
            ),
            ("scheme = \"rsa\"", "scheme"),
            ("scheme = \"stripe\", secret = \"whsec_abc\"", "secret"),
        ] {
            let err = load(&format!("{table}, secrets_env = \"S\""), &vars).unwrap_err();
            assert_eq!(err.key, format!("routes[0].signature.{key}"), "{table}: {err}");
        }
    }

    #[test]
    fn a_signed_route_takes_every_case_and_trailing_slash_of_its_path_and_every_method() {
        let vars = Vars::of(&[("STRIPE_SECRET", "whsec_x")]);
        let config = load("scheme = \"stripe\", secrets_env = \"STRIPE_SECRET\"", &vars).unwrap();
        for path in ["/hook", "/HOOK", "/Hook/", "/hook/"] {
            for method in [
                http::Method::POST,
                http::Method::PUT,
                http::Method::GET,
                http::Method::DELETE,
            ] {
                assert_eq!(
                    config.routes.select(&method, path).name,
                    "hook",
                    "{method} {path}"
                );
            }
        }
        assert_eq!(
            config.routes.select(&http::Method::POST, "/hooks").name,
            "default"
        );
        let toml = "[[routes]]\nname = \"hook\"\npath = \"/hook\"\nunscoped = \"shared\"\n\
                    scope_headers = []\nmatch_methods = [\"POST\"]\n\
                    signature = { scheme = \"stripe\", secrets_env = \"STRIPE_SECRET\" }\n";
        let err = Config::from_toml_str_with(toml, &vars).unwrap_err();
        assert_eq!(err.key, "routes[0].match_methods", "{err}");
    }

    #[test]
    fn secrets_never_appear_in_debug_or_check_config() {
        let vars = Vars::of(&[("STRIPE_SECRET", "whsec_do_not_print")]);
        let config = load("scheme = \"stripe\", secrets_env = \"STRIPE_SECRET\"", &vars).unwrap();
        assert!(!format!("{config:?}").contains("do_not_print"));
        let printed = config.to_masked_toml();
        assert!(!printed.contains("do_not_print"), "{printed}");
        assert!(printed.contains("STRIPE_SECRET"), "{printed}");
        assert!(
            printed.contains("signature stripe (1 secret; every method"),
            "{printed}"
        );
        let again: toml::Table = printed.parse().expect("check-config prints valid TOML");
        assert!(again.contains_key("routes"));
    }

    #[test]
    fn a_passthrough_route_verifies_nothing_and_says_so() {
        let toml = "[[routes]]\nname = \"p\"\npath = \"/p\"\npassthrough = true\n\
                    signature = { scheme = \"github\", secrets_env = \"S\" }\n";
        let err = Config::from_toml_str_with(toml, &Vars::of(&[("S", "x")])).unwrap_err();
        assert_eq!(err.key, "routes[0].signature");
    }

    #[test]
    fn a_route_inherits_the_sections_signature_and_may_set_its_own() {
        let toml = "[idempotency]\nsignature = { scheme = \"github\", secrets_env = \"GH\" }\n\
                    [[routes]]\nname = \"a\"\npath = \"/a\"\n\
                    [[routes]]\nname = \"b\"\npath = \"/b\"\n\
                    signature = { scheme = \"shopify\", secrets_env = \"SHOP\" }\n";
        let config = Config::from_toml_str_with(toml, &Vars::of(&[("GH", "g"), ("SHOP", "s")])).unwrap();
        let scheme = |i: usize| {
            config.routes.routes[i]
                .policy
                .signature
                .as_ref()
                .unwrap()
                .scheme
                .name()
        };
        assert_eq!(scheme(0), SchemeName::Github);
        assert_eq!(scheme(1), SchemeName::Shopify);
        assert!(config.routes.default.policy.signature.is_some());
    }
}
