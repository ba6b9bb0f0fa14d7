//! The one spelling of a request path, and `server.paths`, `server.escaped_slashes` and
//! `server.path_parameters`, which choose what happens to the others. [`normal`] is pure: `proxy/path.rs`
//! applies it to every request before anything reads the path (routes, the fingerprint, `{path}` in key
//! templates, the upstream), and `config/routes.rs` checks that every route's path is written in it.
//!
//! The normal form (RFC 3986 §6.2.2): percent-escapes of unreserved characters decoded, every other
//! escape in upper-case hex, characters a path may not hold raw (`"`, `{`, `|`, non-ASCII, …) escaped,
//! repeated slashes merged, and dot segments removed (§5.2.4), in that order, so `%2e%2e` is a `..`.
//! Spellings that upstreams read in different ways are refused, not normalised: a `%` not followed by
//! two hex digits always; an encoded slash or backslash (`%2F`, `%5C`, a raw `\`: Go's net/http, some
//! Java stacks and IIS read them as separators) and a `;` path parameter (Tomcat and Jetty cut it off
//! before routing) unless the operator keeps them, as data that matches no separator.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};

/// `server.paths`: what a request whose path is not in normal form gets.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PathMode {
    /// Brought to normal form, and forwarded so.
    #[default]
    Normalize,
    /// Refused: 400 `non-normal-path`.
    Reject,
}

/// `server.escaped_slashes`, `server.path_parameters`: a spelling upstreams disagree about.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Ambiguous {
    /// Refused: 400 `non-normal-path`.
    #[default]
    Reject,
    /// Kept as data: it separates nothing for routes, and goes upstream as the normal form spells it.
    Keep,
}

/// How request paths are brought to their one spelling.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PathRules {
    /// `server.paths`.
    pub mode: PathMode,
    /// `server.escaped_slashes`: `%2F`, `%5C` and a raw `\`.
    pub escaped_slashes: Ambiguous,
    /// `server.path_parameters`: `;`.
    pub path_parameters: Ambiguous,
}

/// Why a path has no normal form the rules accept. `Display` is the sentence the client is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum NotNormal {
    /// A `%` without two hex digits after it.
    #[error("the path holds a '%' that is not followed by two hex digits")]
    MalformedEscape,
    /// `%2F`, `%5C` or a raw `\`, while `server.escaped_slashes = "reject"`.
    #[error(
        "the path holds an encoded slash or a backslash (%2F, %5C or \\), which services read in \
         different ways"
    )]
    EscapedSlash,
    /// A `;`, while `server.path_parameters = "reject"`.
    #[error("the path holds a ';' (a path parameter), which some services cut off before routing")]
    PathParameter,
    /// Another spelling of a normal path, while `server.paths = "reject"`.
    #[error(
        "the path is not in normal form: send it without repeated slashes or '.' and '..' segments, \
         with unreserved characters unescaped and escapes in upper case"
    )]
    Spelling,
    /// Another case or trailing slash of a route's path, which that route does not take.
    #[error(
        "the path is another spelling (case, trailing slash) of a route's path; send it as the route \
         writes it"
    )]
    RouteSpelling,
    /// The asterisk-form target (`*`) of a method other than OPTIONS, which has no path to route by
    /// and which no service means to be asked (RFC 9112 §3.2.4).
    #[error("the target '*' is only for OPTIONS")]
    Asterisk,
    /// The normal form is longer than a request target may be.
    #[error("the path's normal form is too long")]
    TooLong,
}

/// `path` in normal form: borrowed when it already is. `Err` when the rules refuse it. Only paths are
/// normalised: a request target with none (`*` of `OPTIONS *`, the empty path of a `CONNECT`'s
/// authority form) is left as it is.
pub fn normal<'a>(path: &'a str, rules: &PathRules) -> Result<Cow<'a, str>, NotNormal> {
    if !path.starts_with('/') || already_normal(path, rules) {
        return Ok(Cow::Borrowed(path));
    }
    let spelled = remove_dot_segments(&merge_slashes(&spell(path, rules)?));
    let spelled = if spelled.is_empty() {
        "/".to_owned()
    } else {
        spelled
    };
    if spelled == path {
        return Ok(Cow::Borrowed(path));
    }
    if rules.mode == PathMode::Reject && spelled != path {
        return Err(NotNormal::Spelling);
    }
    Ok(Cow::Owned(spelled))
}

/// Whether `path` is in normal form with no escape at all: the common case, checked in one pass over its
/// bytes, without allocating.
fn already_normal(path: &str, rules: &PathRules) -> bool {
    let bytes = path.as_bytes();
    if bytes.first() != Some(&b'/') {
        return false;
    }
    let parameters = rules.path_parameters == Ambiguous::Keep;
    let mut segment = 1;
    for (at, &byte) in bytes.iter().enumerate().skip(1) {
        if byte == b'/' {
            if matches!(&bytes[segment..at], b"" | b"." | b"..") {
                return false;
            }
            segment = at + 1;
        } else if !(is_plain(byte) || (byte == b';' && parameters)) {
            return false;
        }
    }
    !matches!(&bytes[segment..], b"." | b"..")
}

/// Each escape and character in its one spelling; refuses what the rules refuse.
fn spell(path: &str, rules: &PathRules) -> Result<String, NotNormal> {
    let bytes = path.as_bytes();
    let mut out = String::with_capacity(path.len());
    let mut at = 0;
    while at < bytes.len() {
        let byte = bytes[at];
        at += 1;
        let (byte, escaped) = if byte == b'%' {
            let decoded = escaped_byte(bytes.get(at..at + 2)).ok_or(NotNormal::MalformedEscape)?;
            at += 2;
            (decoded, true)
        } else {
            (byte, false)
        };
        match byte {
            b'/' if escaped => check(rules.escaped_slashes, NotNormal::EscapedSlash)?,
            b'\\' => check(rules.escaped_slashes, NotNormal::EscapedSlash)?,
            b';' if !escaped => check(rules.path_parameters, NotNormal::PathParameter)?,
            _ => {}
        }
        let raw = is_unreserved(byte) || (!escaped && (is_plain(byte) || byte == b';'));
        if raw {
            out.push(char::from(byte));
        } else {
            out.push_str(percent_encoding::percent_encode_byte(byte));
        }
    }
    Ok(out)
}

fn check(rule: Ambiguous, refusal: NotNormal) -> Result<(), NotNormal> {
    match rule {
        Ambiguous::Reject => Err(refusal),
        Ambiguous::Keep => Ok(()),
    }
}

/// The byte two hex digits spell.
fn escaped_byte(digits: Option<&[u8]>) -> Option<u8> {
    let [high, low] = digits? else {
        return None;
    };
    let hex = |b: &u8| char::from(*b).to_digit(16);
    u8::try_from(hex(high)? * 16 + hex(low)?).ok()
}

/// RFC 3986 §2.3: `ALPHA / DIGIT / "-" / "." / "_" / "~"`.
fn is_unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

/// What a normal path holds unescaped: unreserved characters, `/`, and the sub-delims, `:` and `@` a
/// segment may hold (RFC 3986 §3.3), but `;`, which the rules decide.
fn is_plain(b: u8) -> bool {
    PLAIN[usize::from(b)]
}

/// [`is_plain`] by byte.
const PLAIN: [bool; 256] = {
    let mut table = [false; 256];
    let mut b = 0;
    while b < 256 {
        let byte = b as u8;
        table[b] = byte.is_ascii_alphanumeric()
            || matches!(byte, b'-' | b'.' | b'_' | b'~' | b'/' | b':' | b'@' | b'=')
            || matches!(
                byte,
                b'!' | b'$' | b'&' | b'\'' | b'(' | b')' | b'*' | b'+' | b','
            );
        b += 1;
    }
    table
};

/// Runs of `/` as one.
fn merge_slashes(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    for c in path.chars() {
        if !(c == '/' && out.ends_with('/')) {
            out.push(c);
        }
    }
    out
}

/// RFC 3986 §5.2.4, step by step as written there.
pub fn remove_dot_segments(path: &str) -> String {
    let mut input = path;
    let mut output = String::with_capacity(path.len());
    while !input.is_empty() {
        if let Some(rest) = input.strip_prefix("../").or_else(|| input.strip_prefix("./")) {
            // A: a leading "../" or "./" is removed.
            input = rest;
        } else if input.starts_with("/./") || input == "/." {
            // B: "/./" or a final "/." becomes "/".
            input = if input == "/." { "/" } else { &input[2..] };
        } else if input.starts_with("/../") || input == "/.." {
            // C: "/../" or a final "/.." becomes "/", and the output's last segment goes.
            input = if input == "/.." { "/" } else { &input[3..] };
            match output.rfind('/') {
                Some(at) => output.truncate(at),
                None => output.clear(),
            }
        } else if input == "." || input == ".." {
            // D: a lone "." or ".." is removed.
            input = "";
        } else {
            // E: the first segment, with its leading "/" if any, moves to the output.
            let from = usize::from(input.starts_with('/'));
            let end = input[from..].find('/').map_or(input.len(), |at| at + from);
            output.push_str(&input[..end]);
            input = &input[end..];
        }
    }
    output
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn rules(mode: PathMode, slashes: Ambiguous, parameters: Ambiguous) -> PathRules {
        PathRules {
            mode,
            escaped_slashes: slashes,
            path_parameters: parameters,
        }
    }

    const KEEP: PathRules = PathRules {
        mode: PathMode::Normalize,
        escaped_slashes: Ambiguous::Keep,
        path_parameters: Ambiguous::Keep,
    };

    fn normalised(path: &str) -> Result<String, NotNormal> {
        normal(path, &PathRules::default()).map(Cow::into_owned)
    }

    #[test]
    fn dot_segments_are_removed_as_rfc_3986_5_2_4_shows() {
        // §5.2.4's two worked examples.
        assert_eq!(remove_dot_segments("/a/b/c/./../../g"), "/a/g");
        assert_eq!(remove_dot_segments("mid/content=5/../6"), "mid/6");
        // §5.4's examples against the base "http://a/b/c/d;p?q", as the merged paths §5.2.2 hands to
        // remove_dot_segments, and the paths §5.4 gives for them.
        for (merged, want) in [
            ("/b/c/g", "/b/c/g"),
            ("/b/c/./g", "/b/c/g"),
            ("/b/c/g/", "/b/c/g/"),
            ("/b/c/.", "/b/c/"),
            ("/b/c/./", "/b/c/"),
            ("/b/c/..", "/b/"),
            ("/b/c/../", "/b/"),
            ("/b/c/../g", "/b/g"),
            ("/b/c/../..", "/"),
            ("/b/c/../../", "/"),
            ("/b/c/../../g", "/g"),
            ("/b/c/../../../g", "/g"),
            ("/b/c/../../../../g", "/g"),
            ("/./g", "/g"),
            ("/../g", "/g"),
            ("/b/c/g.", "/b/c/g."),
            ("/b/c/.g", "/b/c/.g"),
            ("/b/c/g..", "/b/c/g.."),
            ("/b/c/..g", "/b/c/..g"),
            ("/b/c/./../g", "/b/g"),
            ("/b/c/./g/.", "/b/c/g/"),
            ("/b/c/g/./h", "/b/c/g/h"),
            ("/b/c/g/../h", "/b/c/h"),
            ("/b/c/g;x=1/./y", "/b/c/g;x=1/y"),
            ("/b/c/g;x=1/../y", "/b/c/y"),
        ] {
            assert_eq!(remove_dot_segments(merged), want, "{merged}");
        }
    }

    #[test]
    fn every_spelling_of_a_path_has_one_normal_form() {
        for hostile in [
            "/v1/payments",
            "//v1/payments",
            "/v1//payments",
            "/v1/payments/../payments",
            "/v1/./payments",
            "/x/../v1/payments",
            "/../v1/payments",
            "/v1/%70ayments",
            "/v1/%70%61yments",
            "/%76%31/payments",
            "/v1/x/%2e%2e/payments",
            "/v1/x/%2E./payments",
            "/v1/%2e/payments",
            "/./v1/./payments",
        ] {
            assert_eq!(normalised(hostile).as_deref(), Ok("/v1/payments"), "{hostile}");
        }
        for (path, want) in [
            ("/", "/"),
            ("/.", "/"),
            ("/..", "/"),
            ("//", "/"),
            ("/a/", "/a/"),
            ("/a//", "/a/"),
            ("/a/.", "/a/"),
            ("/a/b/..", "/a/"),
            ("/%7e%41", "/~A"),
            ("/caf%c3%a9", "/caf%C3%A9"),
            ("/caf%C3%A9/%FF", "/caf%C3%A9/%FF"),
            ("/a%3fb", "/a%3Fb"),
            ("/a%25b", "/a%25b"),
            ("/a%252e", "/a%252e"),
            ("/a%2e%2e", "/a.."),
            ("/{\"a\"}", "/%7B%22a%22%7D"),
            ("/a|b^c[d]", "/a%7Cb%5Ec%5Bd%5D"),
            ("/café", "/caf%C3%A9"),
            ("/a:b@c!$&'()*+,=", "/a:b@c!$&'()*+,="),
            ("/a%3Bb", "/a%3Bb"),
            ("*", "*"),
            ("", ""),
        ] {
            assert_eq!(normalised(path).as_deref(), Ok(want), "{path}");
        }
    }

    #[test]
    fn a_normal_path_is_borrowed_as_it_is() {
        for path in ["/", "/v1/payments", "/v1/orders/42/refund/", "/a:b@c", "/a%2Fb"] {
            let rules = if path.contains('%') {
                KEEP
            } else {
                PathRules::default()
            };
            assert!(matches!(normal(path, &rules), Ok(Cow::Borrowed(_))), "{path}");
        }
    }

    #[test]
    fn spellings_upstreams_disagree_about_are_refused_unless_kept() {
        let default = PathRules::default();
        for (path, refusal) in [
            ("/a%", NotNormal::MalformedEscape),
            ("/a%4", NotNormal::MalformedEscape),
            ("/a%zz", NotNormal::MalformedEscape),
            ("/a%+1", NotNormal::MalformedEscape),
            ("/a%é", NotNormal::MalformedEscape),
            ("/v1%2Fpayments", NotNormal::EscapedSlash),
            ("/v1%2fpayments", NotNormal::EscapedSlash),
            ("/v1%5Cpayments", NotNormal::EscapedSlash),
            ("/v1\\payments", NotNormal::EscapedSlash),
            ("/v1/payments/..%2F..%2Fadmin", NotNormal::EscapedSlash),
            ("/v1/payments;x=1", NotNormal::PathParameter),
            ("/v1/payments/..;/admin", NotNormal::PathParameter),
        ] {
            assert_eq!(normal(path, &default), Err(refusal), "{path}");
        }
        for (path, want) in [
            ("/v1%2fpayments", "/v1%2Fpayments"),
            ("/v1\\payments", "/v1%5Cpayments"),
            ("/a/..%2F..%2Fadmin", "/a/..%2F..%2Fadmin"),
            ("/v1/payments;x=1", "/v1/payments;x=1"),
            ("/a/..;/b", "/a/..;/b"),
            ("/a%3B/b", "/a%3B/b"),
        ] {
            assert_eq!(normal(path, &KEEP).as_deref(), Ok(want), "{path}");
        }
        assert_eq!(normal("/a%", &KEEP), Err(NotNormal::MalformedEscape));
    }

    #[test]
    fn reject_mode_refuses_every_other_spelling_and_passes_normal_paths() {
        let reject = rules(PathMode::Reject, Ambiguous::Keep, Ambiguous::Keep);
        for path in [
            "//v1/payments",
            "/v1/./payments",
            "/v1/%70ayments",
            "/a%2f",
            "/a\\b",
            "/é",
        ] {
            assert_eq!(normal(path, &reject), Err(NotNormal::Spelling), "{path}");
        }
        for path in ["/v1/payments", "/a/", "/a%2F", "/a;b", "/caf%C3%A9"] {
            assert_eq!(normal(path, &reject).as_deref(), Ok(path), "{path}");
        }
        let strict = rules(PathMode::Reject, Ambiguous::Reject, Ambiguous::Reject);
        assert_eq!(normal("/a%2F", &strict), Err(NotNormal::EscapedSlash));
        assert_eq!(normal("/a;b", &strict), Err(NotNormal::PathParameter));
    }

    fn any_rules() -> impl Strategy<Value = PathRules> {
        let ambiguous = || prop_oneof![Just(Ambiguous::Reject), Just(Ambiguous::Keep)];
        (ambiguous(), ambiguous()).prop_map(|(s, p)| rules(PathMode::Normalize, s, p))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn the_fast_check_agrees_with_the_full_normalisation(
            path in "/[a-zA-Z0-9._~%/;:@!$&'()*+,=\\\\-]{0,30}",
            rules in any_rules(),
        ) {
            if already_normal(&path, &rules) {
                let full = remove_dot_segments(&merge_slashes(&spell(&path, &rules).unwrap()));
                prop_assert_eq!(full, path);
            }
        }
    }
}
