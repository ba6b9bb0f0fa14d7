//! Passwords in text the proxy prints: the one function every output goes through before it leaves the
//! process — `check-config`'s effective configuration, the one-line errors `main.rs` prints, and every log
//! line (`config/log.rs` wraps the log writer with it). Runs on text only; touches nothing else.
//!
//! It masks what a store or upstream address can carry, wherever it appears in the text (a URL inside an
//! error message from a database client is masked like the URL alone):
//! - the password of a URL's userinfo, `scheme://user:password@host` (any scheme, a cluster's list of
//!   hosts included), also when the password itself holds a raw `@`;
//! - the value of any `password=` setting (`?password=` and `&sslpassword=` in a PostgreSQL URL, or a
//!   libpq `key=value` string's `password=…` and `password='…'`), whatever its case.
//!
//! A user name stays readable (`user:***@host`), and so does everything else; a URL whose userinfo is only
//! a name has nothing to mask.

/// Replaces every password `text` carries in a URL's userinfo or a `password=` setting with `***`.
pub fn mask_passwords(text: &str) -> String {
    if !may_hold_a_password(text) {
        return text.to_owned();
    }
    mask_settings(&mask_userinfo(text))
}

/// What masking replaces a password with.
const MASK: &str = "***";

/// Whether `text` could hold anything [`mask_passwords`] masks; cheap, so every log line can ask.
pub fn may_hold_a_password(text: &str) -> bool {
    text.contains("://") || contains_ignoring_case(text, "password")
}

/// Characters that end a URL inside text: whitespace and the quotes and brackets text wraps one in.
fn ends_url(c: char) -> bool {
    c.is_whitespace() || matches!(c, '"' | '\'' | '`' | '<' | '>')
}

/// `scheme://user:password@host…` → `scheme://user:***@host…`, for every URL in `text`.
fn mask_userinfo(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        let (before, after) = rest.split_at(at + 3);
        out.push_str(before);
        let end = after.find(ends_url).unwrap_or(after.len());
        let (url, tail) = after.split_at(end);
        out.push_str(&mask_authority(url));
        rest = tail;
    }
    out.push_str(rest);
    out
}

/// One URL after its `://`: the userinfo is everything before its last `@` (a raw `@` or `/` in a
/// password is the last thing a person should have to escape), when it holds a `:` with no `/` before
/// it. A path holding `@` after a port (`http://svc:80/a@b`) is masked too: wrongly hiding a path is
/// better than showing a password.
fn mask_authority(url: &str) -> String {
    let Some((userinfo, hosts)) = url.rsplit_once('@') else {
        return url.to_owned();
    };
    match userinfo.split_once(':') {
        Some((user, _)) if !user.contains('/') => format!("{user}:{MASK}@{hosts}"),
        _ => url.to_owned(),
    }
}

/// `…password=value…` → `…password=***…`: the value runs to the next `&`, `;`, whitespace or quote, or
/// is a quoted libpq value (`password='a b'`, with `\'` inside).
fn mask_settings(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(found) = find_ignoring_case(rest, "password") {
        let (before, after) = rest.split_at(found + "password".len());
        out.push_str(before);
        let Some(value_at) = value_start(after) else {
            rest = after;
            continue;
        };
        out.push_str(&after[..value_at]);
        out.push_str(MASK);
        rest = &after[value_at + value_len(&after[value_at..])..];
    }
    out.push_str(rest);
    out
}

/// Where a setting's value starts after its name: past optional spaces, `=` and optional spaces.
fn value_start(after_name: &str) -> Option<usize> {
    let trimmed = after_name.trim_start_matches(' ');
    let value = trimmed.strip_prefix('=')?.trim_start_matches(' ');
    Some(after_name.len() - value.len())
}

fn value_len(value: &str) -> usize {
    if let Some(quoted) = value.strip_prefix('\'') {
        let mut escaped = false;
        for (i, c) in quoted.char_indices() {
            match c {
                '\\' if !escaped => escaped = true,
                '\'' if !escaped => return i + 2,
                _ => escaped = false,
            }
        }
        return value.len();
    }
    value
        .find(|c: char| c == '&' || c == ';' || c == '#' || ends_url(c))
        .unwrap_or(value.len())
}

fn contains_ignoring_case(text: &str, needle: &str) -> bool {
    find_ignoring_case(text, needle).is_some()
}

/// Byte offset of the first ASCII-case-insensitive match of `needle` (ASCII) in `text`.
fn find_ignoring_case(text: &str, needle: &str) -> Option<usize> {
    let (text, needle) = (text.as_bytes(), needle.as_bytes());
    text.windows(needle.len())
        .position(|window| window.eq_ignore_ascii_case(needle))
}

#[cfg(test)]
mod tests {
    use super::mask_passwords;

    #[test]
    fn every_form_of_store_and_upstream_address_loses_its_password() {
        for (raw, masked) in [
            (
                "postgres://app:s3cret@db:5432/idem",
                "postgres://app:***@db:5432/idem",
            ),
            (
                "postgresql://app:s3cret@db/idem?sslmode=require&password=s3cret",
                "postgresql://app:***@db/idem?sslmode=require&password=***",
            ),
            (
                "postgres://app@db/idem?password=s3cret&sslpassword=s3cret#x",
                "postgres://app@db/idem?password=***&sslpassword=***#x",
            ),
            (
                "postgres://db/idem?PassWord=s3cret",
                "postgres://db/idem?PassWord=***",
            ),
            (
                "host=db user=app password=s3cret dbname=idem",
                "host=db user=app password=*** dbname=idem",
            ),
            (
                "host=db password = 'it\\'s s3cret' dbname=idem",
                "host=db password = *** dbname=idem",
            ),
            ("redis://:s3cret@cache:6379/2", "redis://:***@cache:6379/2"),
            ("rediss://app:s3cret@cache", "rediss://app:***@cache"),
            (
                "redis+cluster://app:s3cret@a:7000,b:7001",
                "redis+cluster://app:***@a:7000,b:7001",
            ),
            (
                "rediss+cluster://:s3cret@a:7000,b:7001/",
                "rediss+cluster://:***@a:7000,b:7001/",
            ),
            ("https://app:s3cret@svc:8443", "https://app:***@svc:8443"),
            ("postgres://app:s3@cr@t@db/idem", "postgres://app:***@db/idem"),
            ("postgres://app:s3/cr@t@db/idem", "postgres://app:***@db/idem"),
        ] {
            assert_eq!(mask_passwords(raw), masked, "{raw}");
        }
    }

    #[test]
    fn urls_inside_messages_are_masked_and_the_rest_is_left_alone() {
        let line = r#"{"error":"cannot connect to redis://:s3cret@10.0.0.1:6379 (refused)","nodes":["rediss://u:s3cret@a:1"]}"#;
        let masked = mask_passwords(line);
        assert!(!masked.contains("s3cret"), "{masked}");
        assert!(
            masked.contains("redis://:***@10.0.0.1:6379 (refused)"),
            "{masked}"
        );
        assert!(masked.contains("\"rediss://u:***@a:1\""), "{masked}");
        for untouched in [
            "postgres://app@db/idem",
            "sqlite://idemproxy.db",
            "http://svc/users/@me",
            "unix:/run/app.sock",
            "the password is required",
            "no secrets here",
        ] {
            assert_eq!(mask_passwords(untouched), untouched);
        }
    }

    #[test]
    fn text_that_is_not_ascii_is_masked_without_panicking() {
        let masked = mask_passwords("é postgres://ü:pässwörd@hôst/db password=ünïcode ✓");
        assert_eq!(masked, "é postgres://ü:***@hôst/db password=*** ✓");
    }
}
