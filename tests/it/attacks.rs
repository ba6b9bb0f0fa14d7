//! What is thrown at the proxy from outside, and what it must survive: hostile and malformed input
//! (`hostile.rs`), requests sent where features meet (`seams.rs`), a retry storm (`storm.rs`), odd
//! spellings judged against real frameworks (`differential.rs`, its corpus and apps in `differential/`),
//! seeded histories under a fault schedule (`history.rs`), and reloads where applied settings meet
//! running ones (`reload_seams.rs`). One file per kind of attack.

mod differential;
mod history;
mod hostile;
mod many_keys;
mod many_keys_again;
mod reload_seams;
mod seams;
mod storm;
