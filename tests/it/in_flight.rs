//! A duplicate that finds its key still running: told to come back (`concurrency.rs`), made to wait for
//! the original's answer (`wait.rs`), or attached to the running response and fed it live (`attach.rs`);
//! always one execution. One file per `on_in_flight` behaviour.

mod attach;
mod concurrency;
mod wait;
