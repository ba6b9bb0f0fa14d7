//! The store, proved against the real servers: one suite written against the `Store` trait and run on
//! every backend (`suite.rs`), what only one backend has to prove (`postgres.rs`, `sqlite.rs`,
//! `citus.rs`, `redis.rs` under faults), claims and completions coalesced into batches (`coalesce.rs`),
//! a store reached over TLS (`tls.rs`), and a store that is not there: at start (`start.rs`), going away
//! (`faults.rs`) and coming back (`recovery.rs`). One file per concern.

mod citus;
mod coalesce;
mod faults;
mod postgres;
mod recovery;
mod redis;
mod sqlite;
mod start;
pub(crate) mod suite;
mod tls;
