//! The command line: `serve`, `migrate`, `check-config`, each taking the config file and the override
//! flags that form the top configuration layer, and `keys`, the operator's runbook for single records.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::config::Overrides;

/// Idempotency sidecar: executes each keyed request once and replays its response to retries.
#[derive(Debug, Parser)]
#[command(name = "idemproxy", version, about)]
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
    /// Validate the configuration and print it, secrets masked.
    CheckConfig(ConfigArgs),
    /// Inspect and repair records in the configured store.
    Keys(KeysArgs),
}

impl Command {
    /// The configuration layers this command was given.
    pub fn overrides(&self) -> (Option<&std::path::Path>, Overrides) {
        match self {
            Command::Serve(args) | Command::Migrate(args) | Command::CheckConfig(args) => {
                (args.config.as_deref(), args.overrides())
            }
            Command::Keys(args) => (args.config.as_deref(), args.overrides()),
        }
    }
}

/// `idemproxy keys`: works against the configured store, beside a running proxy.
#[derive(Debug, Args)]
pub struct KeysArgs {
    /// TOML configuration file.
    #[arg(long, short, value_name = "FILE", global = true)]
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
    /// Show the records holding KEY: status, attempts, lease, expiry, stored response.
    Show {
        /// The idempotency key.
        key: String,
        /// Only the record in this scope (as `keys show` prints it).
        #[arg(long)]
        scope: Option<String>,
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

/// Where the configuration comes from.
#[derive(Debug, Args)]
pub struct ConfigArgs {
    /// TOML configuration file.
    #[arg(long, short, value_name = "FILE")]
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
