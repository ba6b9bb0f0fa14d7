//! What an operator runs and reads, from the real binary: its configuration and the errors it gives
//! (`cli.rs`, `config_errors.rs`), the `health` and `keys` commands (`health_cli.rs`, `keys_cli.rs`,
//! `keys_oncall.rs`), the admin port, access log, metrics, logs and traces (`admin.rs`, `access_log.rs`,
//! `telemetry.rs`, `traces.rs`), the open-files limit (`limits.rs`), a process that dies or is asked to
//! stop (`processes.rs`), the sweeper (`sweeper.rs`), the PostgreSQL roles the guide recommends
//! (`roles.rs`), what the store's refusals read (`store_errors.rs`), and a reload without a restart
//! (`reload.rs`). One file per task.

mod access_log;
mod admin;
mod cli;
mod config_errors;
mod health_cli;
mod keys_cli;
mod keys_oncall;
mod limits;
mod processes;
mod reload;
mod roles;
mod store_errors;
mod sweeper;
mod telemetry;
#[cfg(feature = "otlp")]
mod traces;
