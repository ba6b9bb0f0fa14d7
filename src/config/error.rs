//! The one error a configuration has: every problem a load found, each on one line naming its key (and
//! the file, variable or flag that set it) and what is wrong; for an unknown key, the known key that was
//! most likely meant. Types are named in words (`a whole number (0 or more)`), never as Rust spells them.

use std::ffi::OsString;
use std::fmt;

use figment::Figment;
use figment::providers::Serialized;
use figment::value::{Dict, Value};

use super::RawConfig;

/// A configuration error: the first problem found, and every further one the same load found, each one
/// line naming the key and what is wrong with it.
#[derive(Debug)]
pub struct ConfigError {
    /// Dotted path of the offending key (`idempotency.ttl`), or `config` when the file itself is unreadable.
    pub key: String,
    /// What is wrong, in one line.
    pub message: String,
    /// The further problems found in the same load, in the order found; empty when there is one.
    pub more: Vec<ConfigError>,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "config error: {}: {}", self.key, self.message)?;
        for other in &self.more {
            write!(f, "\n{other}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigError {}

impl ConfigError {
    pub(crate) fn new(key: &str, message: impl std::fmt::Display) -> Self {
        ConfigError {
            key: key.to_owned(),
            message: message.to_string().replace('\n', " "),
            more: Vec::new(),
        }
    }

    /// All the problems, the first one included, each without the others.
    pub fn problems(&self) -> impl Iterator<Item = (&str, &str)> {
        std::iter::once((self.key.as_str(), self.message.as_str()))
            .chain(self.more.iter().map(|e| (e.key.as_str(), e.message.as_str())))
    }

    /// One error holding `problems` (none repeated), `None` when there are none.
    pub(crate) fn all(problems: Vec<ConfigError>) -> Option<ConfigError> {
        let mut flat: Vec<ConfigError> = Vec::new();
        for problem in problems.into_iter().flat_map(ConfigError::into_list) {
            if !flat
                .iter()
                .any(|p| p.key == problem.key && p.message == problem.message)
            {
                flat.push(problem);
            }
        }
        let mut iter = flat.into_iter();
        let mut first = iter.next()?;
        first.more = iter.collect();
        Some(first)
    }

    pub(super) fn into_list(mut self) -> Vec<ConfigError> {
        let more = std::mem::take(&mut self.more);
        std::iter::once(self).chain(more).collect()
    }

    /// The key's source appended to the message, `(from …)`, where one is known.
    pub(super) fn naming_source(mut self, source: Option<String>) -> Self {
        if let Some(source) = source
            && !self.message.contains("(from ")
        {
            self.message = format!("{} (from {source})", self.message);
        }
        self
    }

    /// The error figment found, named by its key, with the nearest known key for an unknown one; `source`
    /// says which file, variable or flag set the key at a path, when one did.
    pub(super) fn from_figment(err: &figment::Error, source: &dyn Fn(&[String]) -> Option<String>) -> Self {
        let path = error_path(err);
        let file = err.metadata.as_ref().and_then(|m| match &m.source {
            Some(figment::Source::File(file)) => Some(file.display().to_string()),
            _ => None,
        });
        let from = source(&path)
            .or(file)
            .map(|s| format!(" (from {s})"))
            .unwrap_or_default();
        let message = match &err.kind {
            figment::error::Kind::UnknownField(field, expected) => {
                // The variable that set it, if one did: figment may tag the error with the layer
                // whose table holds the key rather than the one that added it.
                unknown_variable(&path, expected, std::env::vars_os())
                    .unwrap_or_else(|| format!("{}{from}", unknown_key(field, expected)))
            }
            kind => format!("{}{from}", describe(kind)),
        };
        ConfigError::new(&dotted(&path), message)
    }
}

/// A path as errors name keys: `routes[0].name`, `config` for the whole.
fn dotted(path: &[String]) -> String {
    let mut key = String::new();
    for part in path {
        if part.bytes().all(|b| b.is_ascii_digit()) && !key.is_empty() {
            key.push_str(&format!("[{part}]"));
        } else {
            if !key.is_empty() {
                key.push('.');
            }
            key.push_str(part);
        }
    }
    if key.is_empty() { "config".to_owned() } else { key }
}

/// The path of the key a figment error is about, an unknown field's own name included.
pub(super) fn error_path(err: &figment::Error) -> Vec<String> {
    let mut path = err.path.clone();
    if let figment::error::Kind::UnknownField(field, _) = &err.kind
        && path.last() != Some(field)
    {
        path.push(field.clone());
    }
    path
}

/// What figment found wrong, in words: no Rust type names, no doubled quotes, never the value itself
/// (which may be a secret) beyond an enum's unknown variant.
pub(super) fn describe(kind: &figment::error::Kind) -> String {
    use figment::error::Kind;
    match kind {
        Kind::Message(message) => without_source_text(&in_words(message)),
        Kind::InvalidType(actual, expected) => {
            format!("found {}, expected {}", kind_of(actual), in_words(expected))
        }
        Kind::InvalidValue(actual, expected) => {
            format!("found {}, expected {}", kind_of(actual), in_words(expected))
        }
        Kind::InvalidLength(len, expected) => {
            format!("found {len} items, expected {}", in_words(expected))
        }
        Kind::UnknownVariant(found, known) => {
            let names: Vec<String> = known.iter().map(|k| format!("{k:?}")).collect();
            let meant = nearest(found, known)
                .map(|m| format!("; did you mean {m:?}?"))
                .unwrap_or_default();
            format!("{found:?} is not one of {}{meant}", names.join(", "))
        }
        Kind::UnknownField(field, known) => unknown_key(field, known),
        Kind::MissingField(field) => format!("missing key {field:?}: it has no default and must be set"),
        Kind::DuplicateField(field) => format!("key {field:?} is set twice"),
        Kind::ISizeOutOfRange(_) | Kind::USizeOutOfRange(_) => "the number is out of range".to_owned(),
        Kind::Unsupported(actual) => format!("{} is not supported here", kind_of(actual)),
        Kind::UnsupportedKey(actual, _) => format!("{} is not supported as a key", kind_of(actual)),
    }
}

/// A type as serde's visitors name it (`usize`, `a boolean`, `` `u16` ``), in an operator's words.
pub(super) fn in_words(expected: &str) -> String {
    let mut text = expected.to_owned();
    for (rust, words) in TYPE_WORDS {
        text = replace_word(&text, rust, words);
    }
    text.replace("``", "`").replace('`', "\"")
}

/// Serde's names of types (as `expected …` writes them) and what an operator reads instead.
const TYPE_WORDS: &[(&str, &str)] = &[
    ("usize", "a whole number (0 or more)"),
    ("u64", "a whole number (0 or more)"),
    ("u32", "a whole number from 0 to 4294967295"),
    ("u16", "a whole number from 0 to 65535"),
    ("u8", "a whole number from 0 to 255"),
    ("isize", "a whole number"),
    ("i64", "a whole number"),
    ("i32", "a whole number"),
    ("i16", "a whole number"),
    ("i8", "a whole number"),
    ("f64", "a number"),
    ("f32", "a number"),
    ("a boolean", "true or false"),
    ("a borrowed string", "a string in quotes"),
    ("a string", "a string in quotes"),
    ("a sequence", "a list, like [\"a\", \"b\"]"),
    ("a map", "a table, like { key = \"value\" }"),
    ("a duration", "a duration, like \"30s\" or \"500ms\""),
    ("struct Duration", "a duration, like \"30s\" or \"500ms\""),
    (
        "an integer or string",
        "a size, like \"4 MiB\" or \"512KiB\", or a whole number of bytes",
    ),
];

/// `text` with `word` replaced where it stands alone (not inside a longer word).
fn replace_word(text: &str, word: &str, with: &str) -> String {
    let is_word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(word) {
        let before = rest[..at].chars().next_back();
        let after = rest[at + word.len()..].chars().next();
        out.push_str(&rest[..at]);
        if before.is_some_and(is_word) || after.is_some_and(is_word) {
            out.push_str(word);
        } else {
            out.push_str(with);
        }
        rest = &rest[at + word.len()..];
    }
    out.push_str(rest);
    out
}

/// What a value is, never the value itself: a string set where a table is expected may be a secret
/// (`encryption.keys = "…"`, `traces.headers = "authorization=…"`), and the message goes to stderr and,
/// on a reload, to the logs.
fn kind_of(actual: &figment::error::Actual) -> String {
    use figment::error::Actual;
    match actual {
        Actual::Str(text) => format!("a string of {} characters", text.chars().count()),
        Actual::Bytes(bytes) => format!("{} bytes", bytes.len()),
        Actual::Char(_) => "a character".to_owned(),
        Actual::Bool(_) => "a boolean".to_owned(),
        Actual::Unsigned(_) | Actual::Signed(_) | Actual::Float(_) => "a number".to_owned(),
        Actual::Other(_) => "another value".to_owned(),
        other => other.to_string(),
    }
}

/// A parse error's message without the lines of the file it quotes (`  |`, `2 | keys = …`, the
/// caret): the line and column stay, the text never, since it may hold a secret (`encryption.keys`) and
/// the message goes to stderr and, on a reload, to the logs.
fn without_source_text(message: &str) -> String {
    let quoted = |line: &str| {
        let trimmed = line.trim_start();
        trimmed.starts_with('|')
            || trimmed.split_once('|').is_some_and(|(number, _)| {
                !number.trim().is_empty() && number.trim().bytes().all(|b| b.is_ascii_digit())
            })
    };
    message
        .lines()
        .filter(|line| !quoted(line) && !line.trim().is_empty())
        .map(str::trim)
        .collect::<Vec<_>>()
        .join(": ")
}

/// Least Jaro similarity for a known key to be offered as the one meant, as clap offers subcommands.
const SIMILAR: f64 = 0.7;

/// The known key nearest to `unknown`, if one is near enough to be what was meant. Jaro similarity
/// (strsim, as clap's own suggestions) weighs a transposition or a dropped letter in a short name, the
/// usual typos in config keys, as small differences.
pub(super) fn nearest<'a>(unknown: &str, known: &[&'a str]) -> Option<&'a str> {
    known
        .iter()
        .map(|key| (strsim::jaro(unknown, key), *key))
        .filter(|(score, _)| *score >= SIMILAR)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, key)| key)
}

/// The message for an unknown key in a file or a route: the key meant, if one is near.
pub(super) fn unknown_key(unknown: &str, known: &[&str]) -> String {
    match nearest(unknown, known) {
        Some(meant) => format!("unknown key; did you mean {meant:?}?"),
        None => "unknown key; no known key is like it".to_owned(),
    }
}

/// The message for an unknown key set by an `IDEMPROXY_` variable, naming the variable and the one
/// meant; `None` when no variable in `vars` (the process's environment) sets it. `path` is the key's
/// path, its last part the unknown one.
pub(super) fn unknown_variable(
    path: &[String],
    known: &[&str],
    vars: impl Iterator<Item = (OsString, OsString)>,
) -> Option<String> {
    let (unknown, parents) = path.split_last()?;
    let prefix = super::service_links::PREFIX;
    let variable = vars
        .filter_map(|(name, _)| name.into_string().ok())
        .find(|name| {
            let Some(rest) = name.strip_prefix(prefix) else {
                return false;
            };
            let parts: Vec<String> = rest.split("__").map(str::to_ascii_lowercase).collect();
            parts.len() >= path.len() && parts[..path.len()] == *path
        })?;
    if let Some(full) = split_where_meant(parents, unknown) {
        let rest: Vec<String> = full.iter().map(|p| p.to_ascii_uppercase()).collect();
        let meant = format!("{prefix}{}", rest.join("__"));
        return Some(format!("unknown key (from {variable}); did you mean {meant}?"));
    }
    let Some(meant) = nearest(unknown, known) else {
        return Some(format!("unknown key (from {variable}); no known key is like it"));
    };
    let parents: String = parents
        .iter()
        .map(|p| format!("{}__", p.to_ascii_uppercase()))
        .collect();
    let wrong = format!("{prefix}{parents}{}", unknown.to_ascii_uppercase());
    let right = format!("{prefix}{parents}{}", meant.to_ascii_uppercase());
    let fixed = variable.replacen(&wrong, &right, 1);
    Some(format!("unknown key (from {variable}); did you mean {fixed}?"))
}

/// The full key a variable meant when it joined a section and its key with one `_` where `__` belongs
/// (`IDEMPROXY_SERVER_LISTEN` for `server.listen`): `unknown`, read under `parents`, split at an
/// underscore into a known table and a key known in it (or near one), as deep as the tables go.
fn split_where_meant(parents: &[String], unknown: &str) -> Option<Vec<String>> {
    let here: Vec<&str> = parents.iter().map(String::as_str).collect();
    let known = known_keys(&here)?;
    for (at, _) in unknown.match_indices('_') {
        let (table, rest) = (&unknown[..at], &unknown[at + 1..]);
        if !known.contains(&table) {
            continue;
        }
        let mut deeper = parents.to_vec();
        deeper.push(table.to_owned());
        let Some(inner) = known_keys(&deeper.iter().map(String::as_str).collect::<Vec<_>>()) else {
            continue;
        };
        if inner.contains(&rest) {
            deeper.push(rest.to_owned());
            return Some(deeper);
        }
        if let Some(found) = split_where_meant(&deeper, rest) {
            return Some(found);
        }
        if let Some(key) = nearest(rest, inner) {
            deeper.push(key.to_owned());
            return Some(deeper);
        }
    }
    None
}

/// The keys a table of the configuration knows (`[]` for the sections, `["server"]` for `[server]`'s),
/// as serde lists them; `None` for a path that is not a table of fixed keys.
pub(super) fn known_keys(path: &[&str]) -> Option<&'static [&'static str]> {
    const PROBE: &str = "\u{1}";
    let mut tree = Value::from(Dict::from([(PROBE.to_owned(), Value::from(0u8))]));
    for part in path.iter().rev() {
        tree = Value::from(Dict::from([((*part).to_owned(), tree)]));
    }
    let error = Figment::from(Serialized::defaults(&tree))
        .extract::<RawConfig>()
        .err()?;
    let at = error_path(&error);
    match error.kind {
        figment::error::Kind::UnknownField(field, known) if field == PROBE && at[..at.len() - 1] == *path => {
            Some(known)
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_nearest_key_is_offered_and_a_far_one_is_not() {
        let known = ["listen", "admin_listen", "shutdown_grace", "workers"];
        assert_eq!(nearest("lisen", &known), Some("listen"));
        assert_eq!(nearest("admin_lisetn", &known), Some("admin_listen"));
        assert_eq!(nearest("wrokers", &known), Some("workers"));
        assert_eq!(nearest("retries", &known), None);
    }

    #[test]
    fn an_unknown_variable_is_named_with_the_one_meant() {
        let vars = || {
            [("IDEMPROXY_STORE__POOL_SIZ", "3"), ("HOME", "/root")]
                .into_iter()
                .map(|(n, v)| (OsString::from(n), OsString::from(v)))
        };
        let path = ["store".to_owned(), "pool_siz".to_owned()];
        let said = unknown_variable(&path, &["pool_size", "url"], vars()).expect("set by a variable");
        assert_eq!(
            said,
            "unknown key (from IDEMPROXY_STORE__POOL_SIZ); did you mean IDEMPROXY_STORE__POOL_SIZE?"
        );
        let from_file = ["store".to_owned(), "pool".to_owned()];
        assert_eq!(unknown_variable(&from_file, &["pool_size"], vars()), None);
    }

    #[test]
    fn a_variable_joining_section_and_key_with_one_underscore_gets_the_double_underscore_form() {
        let vars = |name: &str| [(OsString::from(name), OsString::from("1"))].into_iter();
        for (name, meant) in [
            ("IDEMPROXY_SERVER_LISTEN", "IDEMPROXY_SERVER__LISTEN"),
            ("IDEMPROXY_STORE_POOL_SIZE", "IDEMPROXY_STORE__POOL_SIZE"),
            (
                "IDEMPROXY_SERVER_TLS_CERT_FILE",
                "IDEMPROXY_SERVER__TLS__CERT_FILE",
            ),
            (
                "IDEMPROXY_REPLAY_CACHE_MAX_SIZE",
                "IDEMPROXY_REPLAY_CACHE__MAX_SIZE",
            ),
        ] {
            let path = [name["IDEMPROXY_".len()..].to_ascii_lowercase()];
            let said = unknown_variable(&path, &["server", "store"], vars(name)).expect("a variable");
            assert!(
                said.ends_with(&format!("did you mean {meant}?")),
                "{name}: {said}"
            );
        }
    }

    #[test]
    fn types_are_named_in_words_and_enum_values_without_doubled_quotes() {
        for (rust, words) in [
            ("usize", "a whole number (0 or more)"),
            ("u64", "a whole number (0 or more)"),
            ("u16", "a whole number from 0 to 65535"),
            ("u32", "a whole number from 0 to 4294967295"),
            ("i64", "a whole number"),
            ("f64", "a number"),
            ("a boolean", "true or false"),
            ("a string", "a string in quotes"),
            ("a sequence", "a list"),
            ("a map", "a table"),
            ("a duration", "a duration, like \"30s\""),
            ("an integer or string", "a size, like \"4 MiB\""),
        ] {
            let said = in_words(rust);
            assert!(said.starts_with(words), "{rust}: {said}");
        }
        assert_eq!(in_words("usizes"), "usizes", "only whole words");
        let kind = figment::error::Kind::UnknownVariant("http3".into(), &["http1", "h2c"]);
        let said = describe(&kind);
        assert_eq!(
            said,
            "\"http3\" is not one of \"http1\", \"h2c\"; did you mean \"http1\"?"
        );
        assert!(!describe(&figment::error::Kind::Message("expected `a` or `b`".into())).contains('`'));
    }

    #[test]
    fn the_known_keys_of_a_table_are_serdes_own() {
        let sections = known_keys(&[]).expect("the top level has fixed keys");
        assert!(sections.contains(&"server") && sections.contains(&"upstream"));
        let server = known_keys(&["server"]).expect("server has fixed keys");
        assert!(server.contains(&"listen") && server.contains(&"admin_listen"));
        assert_eq!(known_keys(&["encryption", "keys"]), None, "a map takes any key");
    }
}
