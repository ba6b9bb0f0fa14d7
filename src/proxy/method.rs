//! Runs first for every request on the proxy listener, before anything reads its method (routing, the
//! CONNECT and TRACE refusal, the protected methods, signatures, the fingerprint, the upstream):
//! [`normalise`] brings the method to its one spelling, upper case. Methods are case-sensitive tokens
//! (RFC 9110 §9.1), but every registered one is upper case and common frameworks disagree on the others
//! (Werkzeug upper-cases `post`, Go's net/http and hyper keep it as sent): a `post` that the proxy took
//! for an unknown method would reach a handler that runs it as POST, unkeyed and unverified. So the
//! proxy reads, and the upstream receives, `POST`. Touches nothing else.

use http::{Method, Request};

/// Upper-cases the request's method where it has lower-case letters; any other method is left as it is.
pub(crate) fn normalise<B>(request: &mut Request<B>) {
    let sent = request.method().as_str();
    if !sent.bytes().any(|byte| byte.is_ascii_lowercase()) {
        return;
    }
    // Upper-casing keeps a token a token, so this cannot fail; were it to, the method stays as sent and
    // matches no upper-case list.
    if let Ok(upper) = Method::from_bytes(sent.to_ascii_uppercase().as_bytes()) {
        *request.method_mut() = upper;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn normalised(method: &str) -> Method {
        let mut request = Request::builder()
            .method(Method::from_bytes(method.as_bytes()).unwrap())
            .body(())
            .unwrap();
        normalise(&mut request);
        request.method().clone()
    }

    #[test]
    fn every_spelling_of_a_method_is_its_upper_case_one() {
        for (sent, want) in [
            ("post", Method::POST),
            ("Post", Method::POST),
            ("pOST", Method::POST),
            ("POST", Method::POST),
            ("patch", Method::PATCH),
            ("trace", Method::TRACE),
            ("connect", Method::CONNECT),
            ("options", Method::OPTIONS),
        ] {
            assert_eq!(normalised(sent), want, "{sent}");
        }
        assert_eq!(normalised("purge").as_str(), "PURGE");
        assert_eq!(normalised("PURGE").as_str(), "PURGE");
        assert_eq!(normalised("M-SEARCH").as_str(), "M-SEARCH");
        assert_eq!(normalised("x_1.a~").as_str(), "X_1.A~");
    }
}
