//! One line for an error and its causes, for logs and stored reasons; any layer may use it.

/// An error and all its causes on one line (`outer: cause: root cause`).
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn every_cause_is_on_the_line() {
        let error = Outer(std::io::Error::other("root"));
        assert_eq!(error_chain(&error), "outer: root");
    }
}
