//! The promises of the HTTP contract (docs/contract.md), each tested as a client sees it, on both stores where the store
//! matters: a retry sent the moment a response is read gets the replay, no two clients share a scope by
//! accident, secrets are not stored, a running key is never new, a client that stops reading does not hold
//! its key, detached work is bounded, unknown outcomes can be held, floods do not lock clients out, HTTP
//! edge cases are refused, every holder is bounded per attacker byte and in time, stored responses are sealed per record, and logs never hold a key. One file
//! per promise.

mod bounds;
mod encryption;
mod file_modes;
mod flood;
mod full_response;
mod holders;
mod http_edges;
mod log_keys;
mod readiness;
mod running_key;
mod scope;
mod secrets;
mod slow_reader;
mod unknown;
