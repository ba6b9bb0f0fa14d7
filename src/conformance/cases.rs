//! Every case, in the order a run takes them: what the draft requires, what it and common practice
//! recommend, and what this project promises beyond them.

pub mod beyond;
pub mod recommended;
pub mod required;

use crate::conformance::case::Case;

/// Every case of the suite.
pub fn all() -> Vec<Case> {
    let mut cases = required::cases();
    cases.extend(recommended::cases());
    cases.extend(beyond::cases());
    cases
}
