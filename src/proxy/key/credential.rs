//! Runs inside the scope hash (`key.rs`), for each value of an `Authorization` or
//! `Proxy-Authorization` scope header: [`canonical`] gives the one spelling a credential is hashed in.
//! The auth scheme is case-insensitive (RFC 9110 §11.1) and the whitespace between its parts is any run
//! of spaces and tabs, so `Bearer tok`, `bearer tok`, `BEARER  tok` are one credential to every
//! service; hashed as sent they were five clients to the proxy, each with its own keys and its own
//! share of the capture budget. The credentials after the scheme (a token68 is case-sensitive) are kept
//! as sent. Pure; touches nothing.

use std::borrow::Cow;

use http::HeaderName;
use http::header::{AUTHORIZATION, PROXY_AUTHORIZATION};

/// Whether `name`'s values are credentials whose scheme is read without case.
pub fn is_credential(name: &HeaderName) -> bool {
    name == AUTHORIZATION || name == PROXY_AUTHORIZATION
}

/// The credential in its one spelling: where a scheme has credentials after it, the scheme with its first
/// letter in upper case and the rest in lower case (`Bearer`, `Basic`, `Digest`: the spelling nearly every
/// client sends, so their scopes did not change with this rule) and the spaces and tabs between the two as
/// one space; the credentials as sent, and a value of one word (a bare API key, which is no scheme) as
/// sent. Borrowed when `value` is already so.
pub fn canonical(value: &[u8]) -> Cow<'_, [u8]> {
    let value = value.trim_ascii();
    let Some(scheme_end) = value.iter().position(|byte| is_blank(*byte)) else {
        return Cow::Borrowed(value);
    };
    let (scheme, rest) = value.split_at(scheme_end);
    let credentials = &rest[rest.iter().take_while(|byte| is_blank(**byte)).count()..];
    if scheme.iter().copied().eq(scheme_spelling(scheme))
        && rest.len() - credentials.len() == 1
        && rest[0] == b' '
    {
        return Cow::Borrowed(value);
    }
    let mut spelled = Vec::with_capacity(value.len());
    spelled.extend(scheme_spelling(scheme));
    spelled.push(b' ');
    spelled.extend_from_slice(credentials);
    Cow::Owned(spelled)
}

fn is_blank(byte: u8) -> bool {
    byte == b' ' || byte == b'\t'
}

fn scheme_spelling(scheme: &[u8]) -> impl Iterator<Item = u8> + '_ {
    scheme.iter().enumerate().map(|(at, byte)| match at {
        0 => byte.to_ascii_uppercase(),
        _ => byte.to_ascii_lowercase(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spelled(value: &str) -> String {
        String::from_utf8(canonical(value.as_bytes()).into_owned()).unwrap()
    }

    #[test]
    fn every_spelling_of_a_scheme_and_its_spaces_is_one_credential() {
        for sent in [
            "Bearer tok",
            "bearer tok",
            "BEARER tok",
            "bEaReR tok",
            "Bearer  tok",
            "Bearer\ttok",
            "bearer \t tok",
            " Bearer tok ",
        ] {
            assert_eq!(spelled(sent), "Bearer tok", "{sent:?}");
        }
    }

    #[test]
    fn the_common_spelling_is_kept_as_it_is_and_the_credentials_keep_their_case() {
        for kept in [
            "Bearer tok",
            "Basic YWxpY2U6c2VjcmV0",
            "Digest username=\"Al\", realm=\"R\"",
        ] {
            assert!(matches!(canonical(kept.as_bytes()), Cow::Borrowed(_)), "{kept}");
        }
        assert_ne!(
            spelled("Bearer TOK"),
            spelled("Bearer tok"),
            "a token68 is case-sensitive"
        );
        assert_eq!(spelled("dpop  abc"), "Dpop abc");
        assert_eq!(
            spelled("AWS4-HMAC-SHA256 Credential=A/b, Signature=c"),
            "Aws4-hmac-sha256 Credential=A/b, Signature=c"
        );
    }

    #[test]
    fn only_the_scheme_and_the_space_after_it_are_respelt_never_the_credentials() {
        // A bare API key is no scheme: its case is its own.
        assert_ne!(spelled("sk_live_AbCdEf"), spelled("sk_live_abcdef"));
        assert_eq!(spelled("sk_live_AbCdEf"), "sk_live_AbCdEf");
        assert_ne!(spelled("Token=ABC"), spelled("token=abc"));
        // Whitespace inside the credentials is theirs.
        assert_ne!(spelled("Bearer a  b"), spelled("Bearer a\tb"));
        assert_ne!(
            spelled("Digest username=\"al  ice\""),
            spelled("Digest username=\"al ice\"")
        );
        assert_eq!(
            spelled("digest  username=\"al  ice\""),
            "Digest username=\"al  ice\""
        );
    }

    #[test]
    fn values_that_are_no_credential_stay_apart_and_never_panic() {
        assert_eq!(spelled(""), "");
        assert_eq!(spelled("   "), "");
        assert_ne!(spelled("Bearer a b"), spelled("Bearer ab"));
        assert_eq!(canonical(b"Bearer \xff\xfe").as_ref(), b"Bearer \xff\xfe");
    }
}
