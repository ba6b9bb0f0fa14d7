//! How the layers become one [`Config`] with every mistake reported at once, run by `Config::load` (and
//! `Config::from_toml_str`) at start-up and at each SIGHUP. Serde stops at the first value of the wrong
//! type or the first unknown key, so the merged layers are read as a plain tree first; each such problem
//! is noted, its key taken out of the tree (its default then applies) and the tree read again, until it
//! reads. Then every section is validated ([`RawConfig::validate_with`]), each whatever another's
//! problems. Each problem names its key and the file, variable or flag that set it. Touches the
//! configuration file (to say why it cannot be read) and the process's environment (to name a variable).

use std::io::Read;
use std::path::{Path, PathBuf};

use figment::providers::{Env, Format, Serialized, Toml};
use figment::value::{Dict, Map, Value};
use figment::{Figment, Metadata, Profile, Provider};

use super::error::error_path;
use super::{Config, ConfigError, Overrides, ProcessSecrets, RawConfig, SecretReader, service_links};

/// The variable naming the configuration file (`IDEMPROXY_CONFIG`, read by the command line), as the
/// `IDEMPROXY_` layer sees it: not a configuration key, so that layer leaves it out.
pub(super) const CONFIG_VARIABLE_KEY: &str = "CONFIG";

/// Most keys taken out of the tree before giving up: more mistakes than this in one file are not read
/// one by one.
const MOST_ROUNDS: usize = 100;

/// Largest configuration file read: a file past it (or an endless one, `/dev/zero`) is refused rather
/// than read into memory until the process is killed.
const MOST_FILE_BYTES: u64 = 16 << 20;

/// The longest a configuration file that is not a regular file (a pipe, a device) is waited for.
const PIPE_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Which file, variable or flag set the key at a path, if one did.
pub(super) type Source<'a> = dyn Fn(&[String]) -> Option<String> + 'a;

impl Config {
    /// Defaults < the given TOML text. No `IDEMPROXY_` environment, no flags: for tests and embedding.
    /// Signature secrets are still read from the files and variables the text names.
    pub fn from_toml_str(toml: &str) -> Result<Config, ConfigError> {
        Self::from_toml_str_with(toml, &ProcessSecrets)
    }

    /// [`Config::from_toml_str`], reading signature secrets through `secrets`.
    pub fn from_toml_str_with(toml: &str, secrets: &dyn SecretReader) -> Result<Config, ConfigError> {
        let figment = Figment::from(Serialized::defaults(RawConfig::default())).merge(Toml::string(toml));
        let mut config = collect(&figment, &|_| None, secrets)?;
        config.upstream_named = names_upstream(&figment);
        Ok(config)
    }

    /// Defaults < TOML file (if given) < `IDEMPROXY_…` environment < command-line overrides. Every
    /// problem found is reported, each on its own line ([`ConfigError::problems`]).
    pub fn load(file: Option<&Path>, overrides: &Overrides) -> Result<Config, ConfigError> {
        let mut figment = Figment::from(Serialized::defaults(RawConfig::default()));
        if let Some(path) = file {
            // Read once: a pipe (`--config <(…)`, `/dev/stdin`) gives its text only to the first read.
            figment = figment.merge(FileText {
                path: path.to_owned(),
                text: read(path)?,
            });
        }
        let vars: Vec<(String, String)> = std::env::vars_os()
            .filter_map(|(name, value)| Some((name.into_string().ok()?, value.into_string().ok()?)))
            .collect();
        let links = service_links::service_links(vars.iter().map(|(n, v)| (n.as_str(), v.as_str())));
        let mut ignored: Vec<&str> = links
            .iter()
            .map(|name| &name[service_links::PREFIX.len()..])
            .collect();
        ignored.push(CONFIG_VARIABLE_KEY);
        let env = Env::prefixed(service_links::PREFIX)
            .ignore(&ignored)
            .split("__")
            .lowercase(true);
        figment = figment.merge(env).merge(overrides.figment());
        let source = |path: &[String]| source(&figment, overrides, &vars, &links, path);
        let mut config = collect(&figment, &source, &ProcessSecrets)?;
        config.upstream_named = names_upstream(&figment);
        config.service_links = links;
        Ok(config)
    }
}

/// The configuration file's text, read once and at most [`MOST_FILE_BYTES`]; if it cannot be read, why
/// not, as the OS says it, and where.
pub(super) fn read(path: &Path) -> Result<String, ConfigError> {
    let refused = |why: String| {
        ConfigError::new(
            "config",
            format!("cannot read the configuration file {}: {why}", path.display()),
        )
    };
    let bytes = if std::fs::metadata(path).is_ok_and(|meta| meta.is_file()) {
        read_bytes(path).map_err(|e| refused(e.to_string()))?
    } else {
        // A pipe (`--config <(...)`) or a device: opening a named pipe waits for a writer, and reading
        // waits for its data, so the read runs beside and is waited for at most PIPE_WAIT.
        let (sent, read) = std::sync::mpsc::channel();
        let owned = path.to_owned();
        std::thread::spawn(move || sent.send(read_bytes(&owned)));
        match read.recv_timeout(PIPE_WAIT) {
            Ok(bytes) => bytes.map_err(|e| refused(e.to_string()))?,
            Err(_) => {
                return Err(refused(format!(
                    "nothing came from it within {} s (a named pipe nothing writes to?)",
                    PIPE_WAIT.as_secs()
                )));
            }
        }
    };
    if bytes.len() as u64 > MOST_FILE_BYTES {
        return Err(refused(format!("larger than {} MiB", MOST_FILE_BYTES >> 20)));
    }
    String::from_utf8(bytes).map_err(|e| refused(format!("not UTF-8 text ({e})")))
}

/// At most [`MOST_FILE_BYTES`] and one more of the file at `path`.
fn read_bytes(path: &Path) -> std::io::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    std::fs::File::open(path)?
        .take(MOST_FILE_BYTES + 1)
        .read_to_end(&mut bytes)?;
    Ok(bytes)
}

/// The configuration file's TOML as read by [`read`], named by its path as `Toml::file_exact` names it
/// (so each problem says `(from FILE)`).
struct FileText {
    path: PathBuf,
    text: String,
}

impl Provider for FileText {
    fn metadata(&self) -> Metadata {
        Metadata::from("TOML file", self.path.as_path())
    }

    fn data(&self) -> Result<Map<Profile, Dict>, figment::Error> {
        Toml::string(&self.text).data()
    }
}

/// The configuration of `figment`'s layers, or every problem found in them.
pub(super) fn collect(
    figment: &Figment,
    source: &Source<'_>,
    secrets: &dyn SecretReader,
) -> Result<Config, ConfigError> {
    let mut tree: Value = figment
        .extract()
        .map_err(|e| ConfigError::from_figment(&e, source))?;
    let mut found = Vec::new();
    let mut defaulted = Vec::new();
    for _ in 0..MOST_ROUNDS {
        match Figment::from(Serialized::defaults(&tree)).extract::<RawConfig>() {
            Ok(raw) => return finish(raw.validate_with(secrets), found, &defaulted, source),
            Err(error) => {
                // A value taken out gives way to its default, which the section's checks would then
                // judge beside the values written (an unknown key changes nothing).
                if !matches!(error.kind, figment::error::Kind::UnknownField(..))
                    && let Some(section) = error_path(&error).first()
                {
                    defaulted.push(section.clone());
                }
                found.push(ConfigError::from_figment(&error, source));
                if !remove_or_its_list(&mut tree, &error_path(&error)) {
                    break;
                }
            }
        }
    }
    Err(all(found))
}

/// The validated configuration if nothing was found before validating, else every problem. A check of a
/// section one of whose values was taken out (`defaulted`) is not reported: it judged the default put
/// in its place, not what was written (a wrong `store.url` made `store.tls_ca_file` "only used with a
/// PostgreSQL store"); it is judged again once the value is mended.
fn finish(
    validated: Result<Config, ConfigError>,
    mut found: Vec<ConfigError>,
    defaulted: &[String],
    source: &Source<'_>,
) -> Result<Config, ConfigError> {
    match validated {
        Ok(config) if found.is_empty() => Ok(config),
        Ok(_) => Err(all(found)),
        Err(errors) => {
            for error in errors.into_list() {
                let section = key_path(&error.key).into_iter().next().unwrap_or_default();
                if defaulted.contains(&section) {
                    continue;
                }
                let from = source(&key_path(&error.key));
                found.push(error.naming_source(from));
            }
            Err(all(found))
        }
    }
}

fn all(found: Vec<ConfigError>) -> ConfigError {
    ConfigError::all(found).unwrap_or_else(|| ConfigError::new("config", "cannot be read"))
}

/// Takes the value at `path` out of the tree; false when there is none, or it is an item of a list
/// (taking it out would renumber the items after it).
fn remove(tree: &mut Value, path: &[String]) -> bool {
    match (tree, path) {
        (Value::Dict(_, dict), [last]) => dict.remove(last).is_some(),
        (Value::Dict(_, dict), [first, rest @ ..]) => dict.get_mut(first).is_some_and(|v| remove(v, rest)),
        (Value::Array(_, items), [index, rest @ ..]) if !rest.is_empty() => index
            .parse::<usize>()
            .ok()
            .and_then(|i| items.get_mut(i))
            .is_some_and(|v| remove(v, rest)),
        _ => false,
    }
}

/// Takes the value at `path` out of the tree or, when it is an item of a list, the whole list (whose
/// default then applies), so a wrong item does not stop the search for the other mistakes.
fn remove_or_its_list(tree: &mut Value, mut path: &[String]) -> bool {
    loop {
        if remove(tree, path) {
            return true;
        }
        match path.iter().rposition(|p| is_index(p)) {
            Some(at) if at > 0 => path = &path[..at],
            _ => return false,
        }
    }
}

fn is_index(part: &str) -> bool {
    !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit())
}

/// A key as errors name it (`routes[0].signature.secret`) as a path (`routes`, `0`, `signature`, …).
pub(super) fn key_path(key: &str) -> Vec<String> {
    let mut path = Vec::new();
    for part in key.split('.') {
        let mut pieces = part.split('[');
        if let Some(name) = pieces.next() {
            path.push(name.to_owned());
        }
        path.extend(pieces.map(|index| index.trim_end_matches(']').to_owned()));
    }
    path
}

/// Whether a layer above the defaults (the file, a variable, a flag) set `upstream.url`.
pub(super) fn names_upstream(figment: &Figment) -> bool {
    figment
        .find_metadata("upstream.url")
        .is_some_and(|m| m.name != std::any::type_name::<RawConfig>())
}

/// Which layer set the key at `path`: its flag, its `IDEMPROXY_` variable or the file, by name.
pub(super) fn source(
    figment: &Figment,
    overrides: &Overrides,
    vars: &[(String, String)],
    links: &[String],
    path: &[String],
) -> Option<String> {
    if path.is_empty() {
        return None;
    }
    if let Some(flag) = overrides.flag_for(&path.join(".")) {
        return Some(flag.to_owned());
    }
    if let Some(variable) = variable_for(vars, links, path) {
        return Some(variable.to_owned());
    }
    // figment finds no value inside a list: a list comes whole from one layer, so its layer is the item's.
    let whole = path.iter().position(|p| is_index(p)).unwrap_or(path.len());
    let metadata = figment
        .find_metadata(&path.join("."))
        .or_else(|| figment.find_metadata(&path[..whole].join(".")))?;
    match &metadata.source {
        Some(figment::Source::File(file)) => Some(file.display().to_string()),
        _ => None,
    }
}

/// The `IDEMPROXY_` variable that sets the key at `path` (or a key under it).
fn variable_for<'a>(vars: &'a [(String, String)], links: &[String], path: &[String]) -> Option<&'a str> {
    let prefix = service_links::PREFIX;
    vars.iter().map(|(name, _)| name.as_str()).find(|name| {
        let Some(rest) = name.strip_prefix(prefix) else {
            return false;
        };
        if rest == CONFIG_VARIABLE_KEY || links.iter().any(|l| l == name) {
            return false;
        }
        let parts: Vec<String> = rest.split("__").map(str::to_ascii_lowercase).collect();
        parts.len() >= path.len() && parts[..path.len()] == *path
    })
}

#[cfg(test)]
mod tests {

    use super::*;

    #[test]
    fn a_default_put_in_place_of_a_wrong_value_is_never_reported_as_wrong() {
        for (toml, only) in [
            (
                "[store]\nurl = [\"postgres://db/idem?sslmode=verify-full\"]\ntls_ca_file = \"/etc/hostname\"\n",
                "store.url",
            ),
            (
                "[server]\nlisten = 8080\nadmin_listen = \":8080\"\n",
                "server.listen",
            ),
            (
                "[server]\nmax_buffered_responses = \"x\"\nmax_buffered_responses_per_scope = \"1 GiB\"\n",
                "server.max_buffered_responses",
            ),
        ] {
            let err = Config::from_toml_str(toml).unwrap_err();
            let keys: Vec<&str> = err.problems().map(|(key, _)| key).collect();
            assert_eq!(keys, [only], "{err}");
        }
    }

    #[test]
    fn a_key_as_errors_write_it_is_a_path() {
        assert_eq!(key_path("server.listen"), ["server", "listen"]);
        assert_eq!(
            key_path("routes[2].signature.secret"),
            ["routes", "2", "signature", "secret"]
        );
    }

    #[test]
    fn a_value_is_taken_out_of_a_table_but_not_out_of_a_list() {
        let mut tree: Value = Figment::from(figment::providers::Serialized::defaults(toml::toml! { [server]
        listen = 1
        [[routes]]
        name = "a" }))
        .extract()
        .unwrap();
        assert!(remove(&mut tree, &key_path("server.listen")));
        assert!(!remove(&mut tree, &key_path("server.listen")), "already gone");
        assert!(remove(&mut tree, &key_path("routes[0].name")));
        assert!(
            !remove(&mut tree, &key_path("routes[0]")),
            "items keep their numbers"
        );
    }
}
