//! The command line: `serve`, `migrate`, `check-config`, each taking the config file and the override
//! flags that form the top configuration layer, `keys`, the operator's runbook for single records
//! (`cmd/keys.rs`), `health`, the probe for a container's HEALTHCHECK (`cmd/health.rs`),
//! `demo-upstream`, a service to try the proxy on, and `completions` and `man`, which print a shell's
//! completion script and the manual page. Parsed once by `main.rs`, which runs the command. `--version`
//! names the build ([`version`]).

pub mod health;
pub mod keys;
pub mod reload;

use std::path::PathBuf;
use std::sync::LazyLock;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::config::Overrides;
use crate::store::RecordState;
use health::Probe;

/// Idempotency sidecar: executes each keyed request once and replays its response to retries.
#[derive(Debug, Parser)]
#[command(name = "idemproxy", version = version(), about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the proxy (applies pending migrations first unless --no-migrate).
    Serve(ConfigArgs),
    /// Apply pending store migrations and exit.
    Migrate(ConfigArgs),
    /// Validate the configuration and print it, secrets masked, after a comment line for each risky
    /// setting found (exit 0 whatever they are, unless --deny-warnings).
    CheckConfig(CheckArgs),
    /// Inspect and repair records in the configured store.
    Keys(KeysArgs),
    /// Probe a running proxy's admin listener (for a container HEALTHCHECK): exit 0 when `/readyz`
    /// (or with --live `/healthz`) answers 200, else 1 with one line saying what failed.
    Health(HealthArgs),
    /// Ask a running proxy to read its configuration again, as SIGHUP does (`POST /-/reload` on its
    /// admin listener): routes, policies, signature secrets and upstream settings apply to new
    /// requests; prints what was applied and what waits for a restart. Exit 1 when the configuration
    /// is refused (the running one is kept) or the proxy cannot be asked.
    Reload(ReloadArgs),
    /// Run a tiny demo service to try the proxy on (not for production): it answers every request 201
    /// with how many times it has executed; `?delay_ms=N` makes it take N milliseconds. Under `/c/` it
    /// is the conformance suite's counting service (`idemproxy conformance --service`).
    DemoUpstream(DemoArgs),
    /// Run the conformance suite for idempotency keys against BASE_URL (this proxy or any other
    /// implementation), with the counting service (`--service`) behind it: a table of every case,
    /// pass / fail / not applicable, and with --json a report. Exit 0 when no case failed, 1 when one
    /// did, 2 when the suite could not run.
    Conformance(ConformanceArgs),
    /// Print a completion script for SHELL on standard output (for example
    /// `idemproxy completions bash > /etc/bash_completion.d/idemproxy`).
    Completions {
        /// The shell to complete in.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print the manual page (roff) on standard output (`idemproxy man | man -l -`).
    Man,
}

impl Command {
    /// The configuration layers this command was given.
    pub fn overrides(&self) -> (Option<&std::path::Path>, Overrides) {
        match self {
            Command::Serve(args) | Command::Migrate(args) => (args.config.as_deref(), args.overrides()),
            Command::CheckConfig(args) => (args.config.config.as_deref(), args.config.overrides()),
            Command::Keys(args) => (args.config.as_deref(), args.overrides()),
            Command::Health(args) => (args.config.as_deref(), args.overrides()),
            Command::Reload(args) => (args.config.as_deref(), args.overrides()),
            Command::DemoUpstream(_)
            | Command::Conformance(_)
            | Command::Completions { .. }
            | Command::Man => (None, Overrides::default()),
        }
    }
}

/// The cargo features a build may enable, and whether this one did.
const FEATURES: [(&str, bool); 1] = [("otlp", cfg!(feature = "otlp"))];

/// What `--version` prints after the name: the crate's version, the git commit it was built from
/// (`build.rs`; `unknown` outside a git checkout), the profile, and the cargo features enabled.
pub fn version() -> &'static str {
    static VERSION: LazyLock<String> = LazyLock::new(|| {
        let commit = option_env!("BUILD_COMMIT").unwrap_or("unknown");
        let profile = if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        };
        let enabled: Vec<&str> = FEATURES
            .iter()
            .filter(|(_, on)| *on)
            .map(|(name, _)| *name)
            .collect();
        let features = if enabled.is_empty() {
            "none".to_owned()
        } else {
            enabled.join(",")
        };
        format!(
            "{} (commit {commit}, {profile} build, features: {features})",
            env!("CARGO_PKG_VERSION")
        )
    });
    VERSION.as_str()
}

/// `idemproxy keys`: works against the configured store, beside a running proxy.
#[derive(Debug, Args)]
pub struct KeysArgs {
    /// TOML configuration file (or the file IDEMPROXY_CONFIG names; the flag wins).
    #[arg(long, short, value_name = "FILE", env = "IDEMPROXY_CONFIG", global = true)]
    pub config: Option<PathBuf>,
    /// Store URL (store.url).
    #[arg(long, value_name = "URL", global = true)]
    pub store: Option<String>,
    /// Print JSON for scripts instead of text.
    #[arg(long, global = true)]
    pub json: bool,
    /// What to do.
    #[command(subcommand)]
    pub command: KeysCommand,
}

impl KeysArgs {
    /// The flags as the top configuration layer.
    pub fn overrides(&self) -> Overrides {
        Overrides {
            store: self.store.clone(),
            ..Overrides::default()
        }
    }
}

/// The `keys` subcommands.
#[derive(Debug, Subcommand)]
pub enum KeysCommand {
    /// Show the records holding KEY: status, attempts, lease, expiry, stored response. With a client's
    /// credential (--header, --cookie) and its route (--route, or --method and --path), only the record
    /// in the scope the proxy gives that client.
    Show {
        /// The idempotency key.
        key: String,
        /// Only the record in this scope (as `keys show` prints it).
        #[arg(long, conflicts_with_all = ["route", "path", "headers", "cookie"])]
        scope: Option<String>,
        /// The client and route whose scope to look in.
        #[command(flatten)]
        client: ClientArgs,
    },
    /// List records, a page at a time: by route, by client (--header, --cookie) or by scope, and by
    /// state. Each page reads a bounded number of records; the last line gives the next page's --after.
    List {
        /// Only the records of this scope (as `keys show` prints it).
        #[arg(long, conflicts_with_all = ["route", "path", "headers", "cookie"])]
        scope: Option<String>,
        /// The route or client whose records to list.
        #[command(flatten)]
        client: ClientArgs,
        /// Only records in these states (repeat, or separate with commas).
        #[arg(long, value_enum, value_delimiter = ',')]
        state: Vec<RecordState>,
        /// Most records on the page.
        #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=1000))]
        limit: u32,
        /// Start after this cursor, as the previous page's last line gives it.
        #[arg(long, value_name = "CURSOR")]
        after: Option<String>,
    },
    /// Delete one stored record, so the next request with its key executes again. Asks to type the key
    /// back (or --yes); refuses a claim in flight without --force.
    Forget {
        /// The idempotency key.
        key: String,
        /// The record's scope, needed when the key exists in several.
        #[arg(long, conflicts_with_all = ["route", "path", "headers", "cookie"])]
        scope: Option<String>,
        /// The client and route whose record to forget.
        #[command(flatten)]
        client: ClientArgs,
        /// Do not ask for confirmation (for scripts; without a terminal it is required).
        #[arg(long)]
        yes: bool,
        /// Forget a claim in flight too: its request is executing, and a retry will then execute it again
        /// while the first may still be running.
        #[arg(long)]
        force: bool,
    },
    /// Release a stuck in-flight claim so the next retry executes.
    Release {
        /// The idempotency key.
        key: String,
        /// The record's scope, needed when the key exists in several.
        #[arg(long)]
        scope: Option<String>,
        /// Release even while the claim's lease is live (a proxy is still heartbeating it); the request
        /// may then execute twice.
        #[arg(long)]
        force: bool,
    },
    /// Delete records now instead of waiting for the sweeper.
    Purge {
        /// Delete every expired record (the only purge there is; required to say so).
        #[arg(long, required = true)]
        expired: bool,
    },
    /// Count records by state.
    Stats,
}

/// A client as the proxy sees it: the route its request takes and the credential it sends. The scope
/// is computed from them by the proxy's own code, so `keys` finds the record the proxy would.
#[derive(Debug, Clone, Default, Args)]
pub struct ClientArgs {
    /// The route, by its name in [[routes]] (`default` for [idempotency]).
    #[arg(long, conflicts_with = "path")]
    pub route: Option<String>,
    /// The request's path, to choose the route as the proxy does.
    #[arg(long)]
    pub path: Option<String>,
    /// The request's method, with --path.
    #[arg(long, requires = "path", default_value = "POST")]
    pub method: String,
    /// A request header as the client sends it, `Name: value` (repeat for several): the route's scope
    /// headers are read from these, e.g. --header 'Authorization: Bearer abc'.
    #[arg(long = "header", short = 'H', value_name = "NAME: VALUE")]
    pub headers: Vec<String>,
    /// The client's Cookie header as it sends it (`session=abc; theme=dark`), for a route whose scope is
    /// a cookie (scope_cookie).
    #[arg(long, value_name = "COOKIES")]
    pub cookie: Option<String>,
    /// The certificate the client presents (PEM, its own first), for a route whose scope is a client
    /// certificate (scope_client_cert). On a route with scope_jwt, --header 'Authorization: Bearer <jwt>'
    /// names the token's subject (read, not verified: the token may have expired since).
    #[arg(long, value_name = "FILE")]
    pub client_cert: Option<std::path::PathBuf>,
}

impl ClientArgs {
    /// Whether a credential was given (a header or a cookie).
    pub fn has_credential(&self) -> bool {
        !self.headers.is_empty() || self.cookie.is_some() || self.client_cert.is_some()
    }

    /// Whether a route was named, by name or by path.
    pub fn has_route(&self) -> bool {
        self.route.is_some() || self.path.is_some()
    }
}

/// `keys list --state` takes the states by the names `keys list` prints.
impl clap::ValueEnum for RecordState {
    fn value_variants<'a>() -> &'a [Self] {
        &RecordState::ALL
    }

    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        Some(clap::builder::PossibleValue::new(self.as_str()))
    }
}

/// `idemproxy health`: where the admin listener is, read from the same layers as `serve`.
#[derive(Debug, Args)]
pub struct HealthArgs {
    /// TOML configuration file (or the file IDEMPROXY_CONFIG names; the flag wins).
    #[arg(long, short, value_name = "FILE", env = "IDEMPROXY_CONFIG")]
    pub config: Option<PathBuf>,
    /// Admin listen address (server.admin_listen); 0.0.0.0 and [::] are probed on loopback.
    #[arg(long, value_name = "ADDR")]
    pub admin_listen: Option<String>,
    /// Probe liveness (`/healthz`) instead of readiness (`/readyz`).
    #[arg(long)]
    pub live: bool,
    /// How long to wait for the answer, e.g. `2s`, `500ms`.
    #[arg(long, value_name = "DURATION", default_value = "2s", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
}

impl HealthArgs {
    /// The flags as the top configuration layer.
    pub fn overrides(&self) -> Overrides {
        Overrides {
            admin_listen: self.admin_listen.clone(),
            ..Overrides::default()
        }
    }

    /// The endpoint to probe.
    pub fn probe(&self) -> Probe {
        if self.live { Probe::Live } else { Probe::Ready }
    }
}

/// `idemproxy reload`: where the admin listener is, read from the same layers as `serve`.
#[derive(Debug, Args)]
pub struct ReloadArgs {
    /// TOML configuration file.
    #[arg(long, short, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Admin listen address (server.admin_listen); 0.0.0.0 and [::] are asked on loopback.
    #[arg(long, value_name = "ADDR")]
    pub admin_listen: Option<String>,
    /// How long to wait for the answer, e.g. `30s`.
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
}

impl ReloadArgs {
    /// The flags as the top configuration layer.
    pub fn overrides(&self) -> Overrides {
        Overrides {
            admin_listen: self.admin_listen.clone(),
            ..Overrides::default()
        }
    }
}

/// `idemproxy check-config`.
#[derive(Debug, Args)]
pub struct CheckArgs {
    /// Where the configuration comes from.
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Exit 64, as for a bad configuration, when any risky setting is found (for CI).
    #[arg(long)]
    pub deny_warnings: bool,
}

/// `idemproxy demo-upstream`: the demo service's address.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Address to listen on.
    #[arg(value_name = "ADDR", default_value = "127.0.0.1:3000")]
    pub listen: String,
    /// Only check that something accepts connections on ADDR: exit 0 if so, else 1.
    #[arg(long)]
    pub probe: bool,
}

/// `idemproxy conformance`: where to run the suite, and how.
#[derive(Debug, Args)]
pub struct ConformanceArgs {
    /// The implementation under test, e.g. `http://127.0.0.1:8080` (the counting service behind it).
    #[arg(value_name = "BASE_URL", required_unless_present_any = ["list", "service"])]
    pub base_url: Option<String>,
    /// Write the report as JSON to FILE (`-` for standard output, the table then going to stderr).
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Add this header to every request, e.g. `--header 'X-Tenant: t1'` (repeatable).
    #[arg(long = "header", short = 'H', value_name = "NAME: VALUE")]
    pub headers: Vec<String>,
    /// Run only this case (repeatable); see --list.
    #[arg(long = "case", value_name = "ID")]
    pub cases: Vec<String>,
    /// Start `idemproxy demo-upstream` on ADDR, inside this process, for the target to forward to.
    #[arg(long, value_name = "ADDR")]
    pub demo_upstream: Option<String>,
    /// The target's key lifetime, when it is at most 60s: the expiry case then waits it out.
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub ttl: Option<Duration>,
    /// How long one request may take.
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
    /// List the cases (id, group, source, what each checks) and exit.
    #[arg(long)]
    pub list: bool,
    /// Print the counting service the suite expects behind the target, and exit.
    #[arg(long)]
    pub service: bool,
}

/// Where the configuration comes from.
#[derive(Debug, Args)]
pub struct ConfigArgs {
    /// TOML configuration file (or the file IDEMPROXY_CONFIG names; the flag wins).
    #[arg(long, short, value_name = "FILE", env = "IDEMPROXY_CONFIG")]
    pub config: Option<PathBuf>,
    /// Proxy listen address (server.listen).
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<String>,
    /// Admin listen address (server.admin_listen).
    #[arg(long, value_name = "ADDR")]
    pub admin_listen: Option<String>,
    /// Upstream base URL (upstream.url).
    #[arg(long, value_name = "URL")]
    pub upstream: Option<String>,
    /// Store URL (store.url).
    #[arg(long, value_name = "URL")]
    pub store: Option<String>,
    /// Do not apply migrations at start (store.migrate = false).
    #[arg(long)]
    pub no_migrate: bool,
}

impl ConfigArgs {
    /// The flags as the top configuration layer.
    pub fn overrides(&self) -> Overrides {
        Overrides {
            listen: self.listen.clone(),
            admin_listen: self.admin_listen.clone(),
            upstream: self.upstream.clone(),
            store: self.store.clone(),
            no_migrate: self.no_migrate,
        }
    }
}
