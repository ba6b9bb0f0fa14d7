//! Why the pool (`pool.rs`, and `multiplex.rs` for HTTP/2) gave no response head: the one word both
//! answer in, which `upstream.rs` turns into a failure a client can be told. Touches nothing.

/// Why the pool gave no response head.
#[derive(Debug)]
pub enum SendError {
    /// No connection took the request: connecting failed or timed out, the connection closed before
    /// the request was written, or the upstream refused its stream unprocessed (HTTP/2).
    NotSent(String),
    /// The request was handed to a connection that then failed; it may have been written.
    Failed(String),
    /// The pool was at its connection cap, and no connection came free within the connect timeout.
    Busy,
}
