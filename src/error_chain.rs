//! One line for an error and its causes, for logs and stored reasons; any layer may use it.

/// An error and all its causes on one line (`outer: cause: root cause`). A cause whose text the line
/// already ends with (an error that prints its source itself, as the Redis client's do) is not repeated.
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.ends_with(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    enum Failure {
        #[error("outer")]
        Outer(#[source] std::io::Error),
        #[error("connection lost: {0}")]
        SaysItsSource(#[source] std::io::Error),
    }

    #[test]
    fn every_cause_is_on_the_line() {
        let error = Failure::Outer(std::io::Error::other("root"));
        assert_eq!(error_chain(&error), "outer: root");
    }

    #[test]
    fn a_cause_the_error_already_printed_is_not_repeated() {
        let error = Failure::SaysItsSource(std::io::Error::other("Connection refused"));
        assert_eq!(error_chain(&error), "connection lost: Connection refused");
    }
}
