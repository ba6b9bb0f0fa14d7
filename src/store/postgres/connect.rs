//! How the store reaches PostgreSQL: `store.url` with our connection defaults, the TLS connector its
//! `sslmode` asks for, and the pool. Runs at start-up (`PostgresStore::connect`) and for each migration
//! run; touches no database (the pool opens connections lazily, migrations open their own).

use std::time::Duration;

use deadpool_postgres::{Hook, HookError, Manager, ManagerConfig, Pool, RecyclingMethod};
use tokio_postgres::NoTls;
use tokio_postgres::config::Host;
use tokio_postgres::error::SqlState;
use tokio_postgres_rustls::MakeRustlsConnect;

use super::citus::Layout;
use crate::config::StoreConfig;
use crate::error_chain::error_chain;
use crate::store::StoreError;

/// Set on every pooled connection as it opens: the key table is reached by its indexes only, and each
/// prepared statement runs on its generic plan, made once per connection. A plan made while the table
/// is empty (new, or vacuumed empty) finds a sequential scan, or a hash or merge join over the whole
/// table, cheaper than an index lookup, and a generic plan would go on using it as the table grows to
/// millions of rows until the next ANALYZE. With these off, such plans cost more than any other, so each
/// record is found through the primary key whatever the table's size when the plan was made, and the
/// plan need not be made again for every call (PostgreSQL would otherwise plan each small coalesced
/// batch for its own arguments, at a cost larger than running it). Statements with no index to use (the
/// operator tools' STATS) still scan, as before; the sweeper's statement, whose best plan depends on
/// the size of the expired backlog, is sent unprepared, so its plan is made anew at every call from the
/// table's statistics as they are then. JIT compilation is off, because the cost such a plan carries
/// for its disabled scan would otherwise have every run of it compiled (over 100 ms of LLVM work for a
/// count over an empty table), and none of the store's statements gains from it. Memoizing is off:
/// the lookups of one statement are by distinct keys, so a cache of their results is only overhead.
///
/// Each setting is applied only if the server has it, so a Postgres-compatible server without one
/// (whose planner is its own) still connects. On a key table distributed by Citus (`$1`), generic plans
/// stay PostgreSQL's choice: Citus cannot plan the store's statements without their arguments.
pub(super) const INDEX_PLANS: &str = "SELECT count(set_config(name, setting, false))
    FROM (VALUES ('enable_seqscan', 'off'), ('enable_hashjoin', 'off'), ('enable_mergejoin', 'off'),
                 ('enable_memoize', 'off'), ('jit', 'off'), ('plan_cache_mode', 'force_generic_plan'))
        AS s(name, setting)
    WHERE name IN (SELECT name FROM pg_settings) AND NOT (name = 'plan_cache_mode' AND $1)";

/// The pool of `store.pool_size` connections; none is opened until one is asked for, so this succeeds
/// while the database is down. Each connection checks whether the key table is distributed (`layout`)
/// and plans by index only ([`INDEX_PLANS`]) from its start.
pub(super) fn pool(config: &StoreConfig, layout: &Layout) -> Result<Pool, StoreError> {
    let pg = pg_config(config)?;
    let manager_config = ManagerConfig {
        recycling_method: RecyclingMethod::Fast,
    };
    let manager = match tls_connector(config)? {
        Some(tls) => Manager::from_config(pg, tls, manager_config),
        None => Manager::from_config(pg, NoTls, manager_config),
    };
    Pool::builder(manager)
        .max_size(config.pool_size)
        .post_create(Hook::async_fn({
            let layout = layout.clone();
            move |client, _| {
                let layout = layout.clone();
                Box::pin(async move {
                    let distributed = layout.check(client).await.map_err(HookError::Backend)?;
                    client
                        .query_one(INDEX_PLANS, &[&distributed])
                        .await
                        .map(drop)
                        .map_err(HookError::Backend)
                })
            }
        }))
        .build()
        .map_err(|e| StoreError::Backend(e.to_string()))
}

/// `store.url`, with what it leaves unset: a connect timeout of `store.timeout` and the application
/// name `idemproxy`; TCP keepalives always on.
pub(super) fn pg_config(config: &StoreConfig) -> Result<tokio_postgres::Config, StoreError> {
    let mut pg: tokio_postgres::Config = crate::config::driver_url(&config.url)
        .parse()
        .map_err(|e: tokio_postgres::Error| StoreError::Backend(e.to_string()))?;
    if pg.get_connect_timeout().is_none() {
        pg.connect_timeout(config.timeout);
    }
    if pg.get_application_name().is_none() {
        pg.application_name("idemproxy");
    }
    pg.keepalives(true).keepalives_idle(Duration::from_secs(30));
    Ok(pg)
}

/// The TLS connector when the URL's `sslmode` may use TLS (all but `disable`, or none): rustls, verifying
/// the server's certificate against the system's CA certificates plus `store.tls_ca_file`, and its host
/// name unless the mode is `verify-ca`. The driver is given `prefer` or `require` ([`driver_url`]), so
/// `allow` and `prefer` connect in clear text when the server offers no TLS.
///
/// [`driver_url`]: crate::config::driver_url
pub(super) fn tls_connector(config: &StoreConfig) -> Result<Option<MakeRustlsConnect>, StoreError> {
    if !config.ssl_mode.may_use_tls() {
        return Ok(None);
    }
    let client = super::tls::client_config(config.tls_ca_file.as_deref(), config.ssl_mode)
        .map_err(|e| StoreError::Backend(format!("store TLS: {e}")))?;
    Ok(Some(MakeRustlsConnect::new(client)))
}

/// A connection's failure on one line; when the server says the database does not exist, followed by
/// the command that creates it, so the first start against a new server says what to do.
pub(super) fn connect_failure(error: &tokio_postgres::Error, pg: &tokio_postgres::Config) -> String {
    let text = error_chain(error);
    if error.code() != Some(&SqlState::INVALID_CATALOG_NAME) {
        return text;
    }
    format!("{text} (create it with `{}`)", createdb(pg))
}

/// A failure to get a pooled connection on one line, with the server's own reason (the driver's error
/// chain, not the pool's summary) and, where one exists, what mends it: the `createdb` for a missing
/// database, `idemproxy migrate` for a missing key table (the new connection's check found none), the
/// `GRANT` for a login without rights on the schema, the URL for a refused login.
pub(super) fn pool_failure(error: &deadpool_postgres::PoolError, pg: &tokio_postgres::Config) -> String {
    use deadpool_postgres::PoolError;
    match error {
        PoolError::Backend(error) => with_fix(connect_failure(error, pg), error, pg),
        PoolError::PostCreateHook(HookError::Backend(error)) => with_fix(error_chain(error), error, pg),
        other => error_chain(other),
    }
}

/// `text`, followed by what mends the error where the server's code names a cause an operator fixes
/// (beyond a missing database, which [`connect_failure`] names).
pub(super) fn with_fix(text: String, error: &tokio_postgres::Error, pg: &tokio_postgres::Config) -> String {
    let user = pg.get_user().map_or("the store.url user".to_owned(), identifier);
    let fix = match error.code() {
        Some(code) if *code == SqlState::UNDEFINED_TABLE || *code == SqlState::INVALID_SCHEMA_NAME => {
            "the key table is not there: apply the migrations with `idemproxy migrate`".to_owned()
        }
        Some(code) if *code == SqlState::INSUFFICIENT_PRIVILEGE => format!(
            "grant the user its rights: `GRANT USAGE ON SCHEMA idemproxy TO {user}; GRANT SELECT, INSERT, \
             UPDATE, DELETE ON ALL TABLES IN SCHEMA idemproxy TO {user}`, or run `idemproxy migrate` as it"
        ),
        Some(code)
            if *code == SqlState::INVALID_PASSWORD
                || *code == SqlState::INVALID_AUTHORIZATION_SPECIFICATION =>
        {
            format!("the server refused the login of {user}: check the user and password in store.url")
        }
        _ => return text,
    };
    format!("{text} ({fix})")
}

/// A migration's failure on one line, followed by what mends it where the server's code names a cause
/// an operator fixes: for a user without the rights migrating takes, the `GRANT` that gives them (to
/// create the schema, `CREATE` on the database) or the role to migrate as (the schema's owner, which
/// owns its tables); for a refused login, as [`with_fix`] says.
pub(super) fn with_migration_fix(
    text: String,
    error: &tokio_postgres::Error,
    pg: &tokio_postgres::Config,
) -> String {
    let login = [
        SqlState::INVALID_PASSWORD,
        SqlState::INVALID_AUTHORIZATION_SPECIFICATION,
    ];
    if error.code().is_some_and(|code| login.contains(code)) {
        return with_fix(text, error, pg);
    }
    let Some(db_error) = error
        .as_db_error()
        .filter(|e| *e.code() == SqlState::INSUFFICIENT_PRIVILEGE)
    else {
        return text;
    };
    let user = pg.get_user().map_or("the store.url user".to_owned(), identifier);
    let fix = if db_error.message().starts_with("permission denied for database") {
        let database = pg
            .get_dbname()
            .or(pg.get_user())
            .map_or("the database".to_owned(), identifier);
        format!(
            "{user} may not create the idemproxy schema: `GRANT CREATE ON DATABASE {database} TO {user}`, \
             or run `idemproxy migrate` as the database's owner"
        )
    } else {
        format!(
            "{user} may not change the idemproxy schema: run `idemproxy migrate` as the schema's owner, \
             or give {user} the schema (`ALTER SCHEMA idemproxy OWNER TO {user}`, and its tables)"
        )
    };
    format!("{text} ({fix})")
}

/// `createdb` naming the server, port, user and database `pg` names (libpq's defaults where it does not).
fn createdb(pg: &tokio_postgres::Config) -> String {
    let mut command = vec!["createdb".to_owned()];
    match pg.get_hosts().first() {
        Some(Host::Tcp(host)) => command.extend(["-h".to_owned(), quoted(host)]),
        Some(Host::Unix(dir)) => command.extend(["-h".to_owned(), quoted(&dir.to_string_lossy())]),
        None => {}
    }
    if let Some(port) = pg.get_ports().first() {
        command.extend(["-p".to_owned(), port.to_string()]);
    }
    if let Some(user) = pg.get_user() {
        command.extend(["-U".to_owned(), quoted(user)]);
    }
    if let Some(name) = pg.get_dbname().or(pg.get_user()) {
        command.push(quoted(name));
    }
    command.join(" ")
}

/// `name` as SQL names a role or database in the statements the hints give: as written when PostgreSQL
/// would read it unchanged, else in double quotes (`"App-User"`; unquoted, it would be folded to lower
/// case or not parse).
fn identifier(name: &str) -> String {
    let plain = name.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if plain {
        return name.to_owned();
    }
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// `word` as one shell word.
fn quoted(word: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "-_./:".contains(c);
    if !word.is_empty() && word.chars().all(plain) {
        return word.to_owned();
    }
    format!("'{}'", word.replace('\'', "'\\''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store(url: &str) -> StoreConfig {
        crate::Config::from_toml_str(&format!("[store]\nurl = \"{url}\"\ntimeout = \"7s\"\n"))
            .unwrap()
            .store
    }

    #[test]
    fn a_plain_url_gets_the_store_timeout_our_name_and_keepalives() {
        let pg = pg_config(&store("postgres://app@db.internal/keys")).unwrap();
        assert_eq!(pg.get_connect_timeout(), Some(&Duration::from_secs(7)));
        assert_eq!(pg.get_application_name(), Some("idemproxy"));
        assert!(pg.get_keepalives());
        assert_eq!(pg.get_keepalives_idle(), Duration::from_secs(30));
    }

    #[test]
    fn a_connect_timeout_and_name_in_the_url_win_but_keepalives_stay_on() {
        let url = "postgres://app@db.internal/keys?connect_timeout=2&application_name=billing&keepalives=0";
        let pg = pg_config(&store(url)).unwrap();
        assert_eq!(pg.get_connect_timeout(), Some(&Duration::from_secs(2)));
        assert_eq!(pg.get_application_name(), Some("billing"));
        assert!(pg.get_keepalives());
    }

    #[test]
    fn a_url_the_driver_cannot_read_is_a_backend_error() {
        let mut config = store("postgres://app@db.internal/keys");
        config.url = "postgres://app@db.internal/keys?connect_timeout=soon".into();
        assert!(matches!(pg_config(&config), Err(StoreError::Backend(_))));
        assert!(matches!(
            pool(&config, &Layout::default()),
            Err(StoreError::Backend(_))
        ));
    }

    #[test]
    fn clear_text_urls_get_no_tls_connector() {
        for url in [
            "postgres://db.internal/keys",
            "postgres://db.internal/keys?sslmode=disable",
        ] {
            assert!(tls_connector(&store(url)).unwrap().is_none(), "{url}");
        }
    }

    #[test]
    fn every_sslmode_but_disable_gets_a_tls_connector_and_the_driver_reads_the_url() {
        let ca = rcgen::generate_simple_self_signed(vec!["db.internal".into()]).unwrap();
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), ca.cert.pem()).unwrap();
        for mode in ["allow", "prefer", "require", "verify-ca", "verify-full"] {
            let config = crate::Config::from_toml_str(&format!(
                "[store]\nurl = \"postgres://db.internal/keys?sslmode={mode}\"\ntls_ca_file = {:?}\n",
                file.path()
            ))
            .unwrap()
            .store;
            assert!(tls_connector(&config).unwrap().is_some(), "{mode}");
            let pg = pg_config(&config).expect("the driver reads the URL");
            let want = match mode {
                "allow" | "prefer" => tokio_postgres::config::SslMode::Prefer,
                _ => tokio_postgres::config::SslMode::Require,
            };
            assert_eq!(pg.get_ssl_mode(), want, "{mode}");
        }
    }

    #[test]
    fn sslmode_require_trusts_the_configured_ca_file() {
        let ca = rcgen::generate_simple_self_signed(vec!["db.internal".into()]).unwrap();
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), ca.cert.pem()).unwrap();
        let mut config = store("postgres://db.internal/keys?sslmode=require");
        config.tls_ca_file = Some(file.path().to_owned());
        assert!(tls_connector(&config).unwrap().is_some());
    }

    #[test]
    fn an_unreadable_ca_file_is_a_store_tls_error() {
        let mut config = store("postgres://db.internal/keys?sslmode=require");
        config.tls_ca_file = Some("/nonexistent/idemproxy-ca.pem".into());
        let Err(StoreError::Backend(message)) = tls_connector(&config) else {
            panic!("a missing CA file was accepted");
        };
        assert!(message.starts_with("store TLS: "), "{message}");
    }

    #[test]
    fn the_createdb_command_names_the_urls_server_user_and_database() {
        let pg = pg_config(&store("postgres://postgres@127.0.0.1:5432/idemproxy")).unwrap();
        assert_eq!(
            createdb(&pg),
            "createdb -h 127.0.0.1 -p 5432 -U postgres idemproxy"
        );
        let pg = pg_config(&store("postgres://app@db.internal/it%27s")).unwrap();
        assert_eq!(createdb(&pg), "createdb -h db.internal -p 5432 -U app 'it'\\''s'");
    }

    #[test]
    fn a_role_sql_would_fold_or_not_parse_is_quoted_in_the_hints() {
        assert_eq!(identifier("app_user2"), "app_user2");
        assert_eq!(identifier("App-User"), "\"App-User\"");
        assert_eq!(identifier("a\"b"), "\"a\"\"b\"");
        assert_eq!(identifier("2fa"), "\"2fa\"");
    }

    #[test]
    fn the_pool_holds_at_most_pool_size_connections() {
        let mut config = store("postgres://db.internal/keys");
        config.pool_size = 3;
        assert_eq!(pool(&config, &Layout::default()).unwrap().status().max_size, 3);
    }
}
