//! Runs while a keyed request's scope is derived, on routes with `scope_cookie`: finds the named
//! cookie's values in the request's `Cookie` headers (HTTP/2 clients may split them over several), with
//! the `cookie` crate's parser. A cookie sent more than once (a browser holds one per domain or path
//! that set it, and orders them by path length and age, which a retry need not repeat) is read as the
//! set of its values, so the same cookies in another order are the same scope. Pure functions of the
//! headers; the values go into the scope's hash only.

use http::HeaderMap;
use http::header::COOKIE;

/// The distinct values of the cookies called `name`, in byte order, each with a surrounding pair of
/// double quotes removed. Pieces that do not parse as `name=value`, and header lines that are not UTF-8,
/// are skipped.
pub fn values(headers: &HeaderMap, name: &str) -> Vec<String> {
    let mut values: Vec<String> = headers
        .get_all(COOKIE)
        .iter()
        .filter_map(|line| std::str::from_utf8(line.as_bytes()).ok())
        .flat_map(cookie::Cookie::split_parse)
        .filter_map(Result::ok)
        .filter(|cookie| cookie.name() == name)
        .map(|cookie| cookie.value_trimmed().to_owned())
        .collect();
    values.sort_unstable();
    values.dedup();
    values
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    fn cookies(lines: &[&[u8]]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for line in lines {
            headers.append(COOKIE, HeaderValue::from_bytes(line).unwrap());
        }
        headers
    }

    #[test]
    fn finds_the_named_cookie_among_others_and_across_lines() {
        let headers = cookies(&[b"theme=dark; session=abc123", b"lang=en"]);
        assert_eq!(values(&headers, "session"), ["abc123"]);
        let split = cookies(&[b"theme=dark", b"session=\"abc123\""]);
        assert_eq!(values(&split, "session"), ["abc123"]);
    }

    #[test]
    fn names_are_exact() {
        let headers = cookies(&[b"Session=a; session_id=b; xsession=c"]);
        assert!(values(&headers, "session").is_empty());
    }

    #[test]
    fn a_repeated_cookie_is_the_set_of_its_values() {
        let headers = cookies(&[b"session=b; session=a"]);
        assert_eq!(values(&headers, "session"), ["a", "b"]);
        let across_lines = cookies(&[b"session=a", b"lang=en; session=\"b\"; session=a"]);
        assert_eq!(values(&across_lines, "session"), ["a", "b"]);
    }

    #[test]
    fn garbage_is_skipped_without_panicking() {
        let headers = cookies(&[b";;; =x; session; \xff\xfe=1", b"session=ok;", b"\xc3\x28"]);
        assert_eq!(values(&headers, "session"), ["ok"]);
        assert!(values(&HeaderMap::new(), "session").is_empty());
    }
}
