//! The README's promises, run as a reader runs them: the quickstart's demo service
//! (`demo_upstream.rs`) and the client snippets in Python, JavaScript and Go (`readme_clients.rs`).

mod demo_upstream;
mod readme_clients;
