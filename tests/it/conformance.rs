//! `idemproxy conformance`, the open suite for idempotency keys, run as its users run it: the binary
//! against the proxy on each store with the demo service behind it (`suite.rs`), against a proxy broken
//! on purpose and against the service alone (it must fail them), and as a command (`command.rs`).

mod command;
mod suite;
