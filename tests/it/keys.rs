//! Where a key comes from and what it is unique within: the `Idempotency-Key` header (`header.rs`), keys
//! taken from a sender's delivery id, the body or a template (`sources.rs`), signed webhooks that cannot
//! squat an id (`webhooks.rs`), OASIS Repeatable Requests (`repeatability.rs`), TLS client certificates
//! (`client_cert.rs`), verified bearer tokens (`jwt.rs`), and `[[routes]]`, which decide a request's policy and scope by its path
//! (`routes.rs`). One file per source of the key; and what makes a retry the same request when its
//! client changes the body's form on every attempt: file uploads under a new boundary (`multipart.rs`).

mod client_cert;
mod header;
pub(crate) mod jwt;
mod multipart;
mod repeatability;
mod routes;
mod sources;
mod webhooks;
