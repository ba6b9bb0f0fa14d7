//! The `idemproxy` binary: parse the command line, load the configuration, start logging, and hand over to
//! the library. Exit codes: 0 done, 1 runtime failure (or a `keys` command that found nothing to act on or
//! refused, or a `health` probe that failed, bad configuration included), 64 bad configuration.

use std::process::ExitCode;

use clap::Parser;
use idemproxy::cli::{Cli, Command, DemoArgs, HealthArgs, KeysArgs};
use idemproxy::config::{Config, LogFormat, MaskedStderr, mask_passwords};
use tokio_util::sync::CancellationToken;
use tracing_subscriber::EnvFilter;

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
    if let Command::DemoUpstream(args) = &cli.command {
        return demo_upstream(args);
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
    init_tracing(&config);
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

/// Runs the demo service until interrupted, or with --probe checks that something accepts on its address.
fn demo_upstream(args: &DemoArgs) -> ExitCode {
    let result = tokio::runtime::Runtime::new().and_then(|runtime| {
        runtime.block_on(async {
            if args.probe {
                return idemproxy::demo::probe(&args.listen).await;
            }
            let listener = tokio::net::TcpListener::bind(&args.listen).await?;
            idemproxy::demo::serve(listener).await
        })
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("idemproxy demo-upstream: {}: {error}", args.listen);
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

fn init_tracing(config: &Config) {
    let mut filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(&config.log.filter));
    for directive in QUIET_TARGETS {
        if let Ok(directive) = directive.parse() {
            filter = filter.add_directive(directive);
        }
    }
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(MaskedStderr);
    match config.log.format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
}
