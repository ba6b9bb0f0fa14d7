//! Integration tests: the real proxy against real PostgreSQL and a stub upstream on real sockets.

mod support;

mod admin;
mod cli;
mod concurrency;
mod harness;
mod history;
mod key_header;
mod processes;
mod protocols;
mod proxy_basic;
mod store_faults;
mod store_pg;
mod store_recovery;
mod store_tls;
mod storm;
mod upstream_faults;
