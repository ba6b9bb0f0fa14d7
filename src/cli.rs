//! The command line: `serve`, `migrate`, `check-config`, each taking the config file and the override
//! flags that form the top configuration layer.

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
