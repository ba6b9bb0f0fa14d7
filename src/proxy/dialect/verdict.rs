//! What an upstream's answer means for its key's record, as every dialect says it (`dialect.rs`): the
//! words the dialects and the execute stage share.

use crate::error::ProxyError;

/// What the upstream's answer means for the key's record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// An answer: stored, and replayed to every retry.
    Store,
    /// Not processed: the key is given back, so a retry executes again.
    Release,
    /// The upstream may have acted without saying what came of it (why, for the log):
    /// `on_unknown_outcome` decides.
    Unknown(String),
}

/// What the head of the upstream's answer decides, before any of its body.
#[derive(Debug)]
pub(crate) enum OnHead {
    /// Relay the body; its end decides ([`Dialect::on_end`]).
    Relay,
    /// Not processed: the key is given back, and the client gets the answer as it is.
    Release,
    /// The upstream may have acted without saying what came of it (why, for the log): the client gets
    /// the answer as it is, and `on_unknown_outcome` decides.
    Unknown(String),
    /// The answer cannot be relayed (a `101` nothing asked for): the client gets this refusal, and the
    /// outcome is unknown.
    Refused(ProxyError),
}
