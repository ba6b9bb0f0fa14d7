//! Integration tests: the real proxy against real PostgreSQL and a stub upstream on real sockets.

mod support;

mod access_log;
mod admin;
mod attach;
mod attempts;
mod cli;
mod concurrency;
mod config_errors;
mod demo_upstream;
mod differential;
mod encryption;
mod grpc;
mod guarantees;
mod harness;
mod health_cli;
mod history;
mod hostile;
mod jsonrpc;
mod key_header;
mod keys_cli;
mod keys_oncall;
mod keys_sources;
mod problems;
mod processes;
mod protocols;
mod proxy_basic;
mod readme_clients;
mod replay_cache;
mod roles;
mod routes;
mod seams;
mod socket;
mod store;
mod storm;
mod sweeper;
mod telemetry;
#[cfg(feature = "otlp")]
mod traces;
mod trailers;
mod upstream_faults;
mod upstream_transports;
mod wait;
mod webhooks;
