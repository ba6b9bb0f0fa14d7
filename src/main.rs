//! The `idemproxy` binary: parse the command line, load the configuration, start logging, and hand over to
//! the library. Exit codes: 0 done, 1 runtime failure (or a `keys` command that found nothing to act on or
//! refused, or a `health` probe that failed, bad configuration included), 64 bad configuration.

use std::process::ExitCode;

use clap::Parser;
use idemproxy::cli::{Cli, Command, HealthArgs, KeysArgs};
use idemproxy::config::{Config, LogFormat, MaskedStderr, mask_passwords};
use idemproxy::otlp::{self, Exporting, StartError};
use tokio_util::sync::CancellationToken;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// The allocator for the whole process (see `Cargo.toml`).
#[cfg(not(target_env = "msvc"))]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// sysexits' EX_USAGE, as for any bad configuration.
const EXIT_CONFIG: u8 = 64;

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Command::Health(args) = &cli.command {
        return health(&cli.command, args);
    }
    let (file, overrides) = cli.command.overrides();
    let config = match Config::load(file, &overrides) {
        Ok(config) => config,
        Err(error) => {
            eprintln!("{}", mask_passwords(&error.to_string()));
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    if let Command::CheckConfig(_) = cli.command {
        print!("{}", config.to_masked_toml());
        return ExitCode::SUCCESS;
    }
    let traces = match init_tracing(&config) {
        Ok(traces) => traces,
        Err(error) => {
            eprintln!("{}", mask_passwords(&error.to_string()));
            return ExitCode::FAILURE;
        }
    };
    let code = run(cli, config);
    if let Some(traces) = traces {
        traces.shutdown();
    }
    code
}

/// The commands that run with logging (and traces) set up.
fn run(cli: Cli, config: Config) -> ExitCode {
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(error) => {
            tracing::error!(%error, "cannot start the runtime");
            return ExitCode::FAILURE;
        }
    };
    if let Command::Keys(args) = &cli.command {
        return keys(&runtime, &config, args);
    }
    let result = runtime.block_on(async {
        match cli.command {
            Command::Migrate(_) => migrate(&config).await,
            _ => serve(config).await,
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            tracing::error!(error = format!("{error:#}"), "idemproxy stopped");
            ExitCode::FAILURE
        }
    }
}

/// Prints the runbook command's report; its exit code says whether it did what was asked.
fn keys(runtime: &tokio::runtime::Runtime, config: &Config, args: &KeysArgs) -> ExitCode {
    match runtime.block_on(idemproxy::keys::run(config, &args.command, args.json)) {
        Ok(report) => {
            print!("{}", report.output);
            if report.success {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(error) => {
            eprintln!("idemproxy keys: {}", mask_passwords(&error.to_string()));
            ExitCode::FAILURE
        }
    }
}

/// Probes a running proxy; any failure, a bad configuration included, is exit 1 (unhealthy), the one
/// failure code a container HEALTHCHECK defines.
fn health(command: &Command, args: &HealthArgs) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("idemproxy health: cannot start the runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let (file, overrides) = command.overrides();
    let probe = idemproxy::health::run(file, &overrides, args.probe(), args.timeout);
    match runtime.block_on(probe) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("idemproxy health: {}", mask_passwords(&error.to_string()));
            ExitCode::FAILURE
        }
    }
}

async fn serve(config: Config) -> anyhow::Result<()> {
    let listeners = idemproxy::Listeners::bind(&config).await?;
    let shutdown = CancellationToken::new();
    idemproxy::shutdown::cancel_on_signal(shutdown.clone())?;
    idemproxy::run(config, listeners, shutdown).await?;
    Ok(())
}

async fn migrate(config: &Config) -> anyhow::Result<()> {
    let applied = idemproxy::migrate(config).await?;
    tracing::info!(applied, "migrations applied");
    Ok(())
}

/// Targets of dependencies whose lines would carry keys or bodies in clear, held at INFO whatever the
/// filter asks: tokio-postgres logs every statement's parameters (scope, key, fingerprint) at DEBUG.
const QUIET_TARGETS: [&str; 1] = ["tokio_postgres::query=info"];

/// Sets up the log output (with its own filter) and, with `traces.enabled`, the OTLP export beside it
/// (`otlp.rs`), which sees the request spans whatever the log filter; returns the export to flush at exit.
fn init_tracing(config: &Config) -> Result<Option<Exporting>, StartError> {
    let mut filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(&config.log.filter));
    for directive in QUIET_TARGETS.iter().chain([&otlp::NOT_LOGGED]) {
        if let Ok(directive) = directive.parse() {
            filter = filter.add_directive(directive);
        }
    }
    let fmt = tracing_subscriber::fmt::layer().with_writer(MaskedStderr);
    let fmt = match config.log.format {
        LogFormat::Json => fmt.json().with_filter(filter).boxed(),
        LogFormat::Text => fmt.with_filter(filter).boxed(),
    };
    let (traces, exporting) = otlp::layer(&config.traces)?.unzip();
    tracing_subscriber::registry().with(fmt).with(traces).init();
    Ok(exporting)
}
