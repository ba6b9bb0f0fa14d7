//! A key executes once and its retries get what it answered: the basics of one proxy and one client
//! (`basics.rs`), the replay cache in front of the store (`cache.rs`), the attempt the upstream is told
//! (`attempts.rs`), stored responses sealed at rest (`encryption.rs`), an upstream that fails before or
//! during its answer (`upstream_faults.rs`), and what a refusal tells a client (`problems.rs`). One file
//! per concern.

mod attempts;
mod basics;
mod cache;
mod encryption;
mod problems;
mod upstream_faults;
