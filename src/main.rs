//! The `idemproxy` binary: parse the command line, load the configuration, start logging, and hand over to
//! the library. Exit codes: 0 done, 1 runtime failure (or a `keys` command that found nothing to act on or
//! refused, a `health` probe that failed or a `reload` that was refused or could not be asked, bad
//! configuration included), 64 bad configuration (or, for
//! `check-config --deny-warnings`, a risky one).

use std::process::ExitCode;

use clap::{CommandFactory, Parser};
use idemproxy::cmd::{Cli, Command, DemoArgs, HealthArgs, KeysArgs, ReloadArgs};
use idemproxy::config::{Config, mask_passwords};
use idemproxy::logging;
use idemproxy::reload::Reload;
use tokio_util::sync::CancellationToken;

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
    if let Command::Conformance(args) = &cli.command {
        return match tokio::runtime::Runtime::new() {
            Ok(runtime) => ExitCode::from(runtime.block_on(idemproxy::conformance::run(args))),
            Err(error) => {
                eprintln!("idemproxy conformance: {error}");
                ExitCode::from(idemproxy::conformance::EXIT_CANNOT_RUN)
            }
        };
    }
    if let Command::Reload(args) = &cli.command {
        return reload(&cli.command, args);
    }
    if let Command::Completions { shell } = cli.command {
        return print_with(|out| {
            clap_complete::generate(shell, &mut Cli::command(), "idemproxy", out);
            Ok(())
        });
    }
    if let Command::Man = cli.command {
        return print_with(|out| clap_mangen::Man::new(Cli::command()).render(out));
    }
    let (file, overrides) = cli.command.overrides();
    let config = match Config::load(file, &overrides) {
        Ok(config) => config,
        Err(error) => {
            eprintln!("{}", mask_passwords(&error.to_string()));
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    if let Command::CheckConfig(args) = &cli.command {
        return check_config(&config, args.deny_warnings);
    }
    let (filter, traces) = match logging::init(&config.log, &config.traces) {
        Ok(started) => started,
        Err(error) => {
            eprintln!("{}", mask_passwords(&error.to_string()));
            return ExitCode::FAILURE;
        }
    };
    let reload = Reload {
        file: file.map(ToOwned::to_owned),
        overrides,
        filter,
    };
    let code = run(cli, config, reload);
    if let Some(traces) = traces {
        traces.shutdown();
    }
    code
}

/// The commands that run with logging (and traces) set up; `serve` rereads the configuration through
/// `reload` at SIGHUP.
fn run(cli: Cli, config: Config, reload: Reload) -> ExitCode {
    // The process's own runtime: the accept loop, the store's connections and batches, the admin
    // listener, the sweeper. One thread is enough for them, and leaves the cores to the workers, which
    // serve the requests on runtimes of their own (`server.workers`); with a second thread the two woke
    // each other for every batch (bench/RESULTS.md, "What each change bought").
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build();
    let runtime = match runtime {
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
            _ => serve(config, reload).await,
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

/// Prints the effective configuration, each risky setting first as a comment; with `--deny-warnings`
/// any such setting makes it a bad configuration.
fn check_config(config: &Config, deny_warnings: bool) -> ExitCode {
    let warnings = config.warnings();
    print!("{}", config.to_checked_toml(&warnings));
    if deny_warnings && !warnings.is_empty() {
        eprintln!(
            "idemproxy check-config: {} warning(s) and --deny-warnings",
            warnings.len()
        );
        return ExitCode::from(EXIT_CONFIG);
    }
    ExitCode::SUCCESS
}

/// Prints the runbook command's report; its exit code says whether it did what was asked.
fn keys(runtime: &tokio::runtime::Runtime, config: &Config, args: &KeysArgs) -> ExitCode {
    match runtime.block_on(idemproxy::cmd::keys::run(config, &args.command, args.json)) {
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
    let probe = idemproxy::cmd::health::run(file, &overrides, args.probe(), args.timeout);
    match runtime.block_on(probe) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("idemproxy health: {}", mask_passwords(&error.to_string()));
            ExitCode::FAILURE
        }
    }
}

/// Asks a running proxy to reload its configuration and prints what it applied; exit 1 when it refused
/// the configuration or could not be asked.
fn reload(command: &Command, args: &ReloadArgs) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("idemproxy reload: cannot start the runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let (file, overrides) = command.overrides();
    match runtime.block_on(idemproxy::cmd::reload::run(file, &overrides, args.timeout)) {
        Ok(answer) => {
            let list = |keys: &[String]| {
                if keys.is_empty() {
                    "none".to_owned()
                } else {
                    keys.join(", ")
                }
            };
            println!("reloaded; applied to new requests: {}", list(&answer.applied));
            if !answer.restart.is_empty() {
                println!("take effect only after a restart: {}", list(&answer.restart));
            }
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("idemproxy reload: {}", mask_passwords(&error.to_string()));
            ExitCode::FAILURE
        }
    }
}

/// Writes what `write` makes to standard output (`completions`, `man`).
fn print_with(write: impl FnOnce(&mut dyn std::io::Write) -> std::io::Result<()>) -> ExitCode {
    let mut out = std::io::stdout().lock();
    match write(&mut out).and_then(|()| std::io::Write::flush(&mut out)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("idemproxy: cannot write to standard output: {error}");
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

async fn serve(config: Config, reload: Reload) -> anyhow::Result<()> {
    logging::announce(&config);
    let listeners = idemproxy::Listeners::bind(&config).await?;
    let shutdown = CancellationToken::new();
    idemproxy::shutdown::cancel_on_signal(shutdown.clone())?;
    idemproxy::run_reloading(config, listeners, shutdown, reload).await?;
    Ok(())
}

async fn migrate(config: &Config) -> anyhow::Result<()> {
    let applied = idemproxy::migrate(config).await?;
    tracing::info!(applied, "migrations applied");
    Ok(())
}
