//! OASIS Repeatable Requests Version 1.0 (<https://docs.oasis-open.org/odata/repeatable-requests/v1.0/repeatable-requests-v1.0.html>),
//! for a route keyed by `repeatability`: the key is `Repeatability-Request-ID` (read as a header key is,
//! `key/source.rs`), and `Repeatability-First-Sent`, the time the client first sent the request as an
//! IMF-fixdate, must come with it. A request first sent longer ago than the route's
//! `repeatability_window` (or later than now, beyond the clock skew allowed) is refused 412 before any
//! claim: whether it ran before can no longer be told. Pure functions of the request and the clock.

use std::time::{Duration, SystemTime};

use http::HeaderMap;

use crate::error::ProxyError;
use crate::headers::REPEATABILITY_FIRST_SENT_HEADER;

/// How far ahead of this proxy's clock a client's may run: a first-sent time less than this in the
/// future is taken (the route's `ttl` is at least this longer than its window, so its record outlives
/// every retry taken).
pub const CLOCK_SKEW: Duration = crate::config::REPEATABILITY_CLOCK_SKEW;

/// Checks a keyed request's `Repeatability-First-Sent` against `window` at `now`: one IMF-fixdate, no
/// older than `window` and less than [`CLOCK_SKEW`] in the future.
pub fn check_first_sent(headers: &HeaderMap, window: Duration, now: SystemTime) -> Result<(), ProxyError> {
    let invalid = |why: &str| Err(ProxyError::RepeatabilityInvalid(why.to_owned()));
    let mut values = headers.get_all(REPEATABILITY_FIRST_SENT_HEADER).iter();
    let (Some(value), None) = (values.next(), values.next()) else {
        return invalid("it came without one, or with more than one");
    };
    let Some(first_sent) = imf_fixdate(value.as_bytes()) else {
        return invalid("the one it came with is not an IMF-fixdate");
    };
    // A first-sent time has whole seconds: so has the clock it is held against, or a request first
    // sent exactly the window ago would be refused for the fraction of a second it arrived in.
    let now = whole_seconds(now);
    if let Ok(age) = now.duration_since(first_sent)
        && age > window
    {
        let window = humantime::format_duration(window);
        return Err(ProxyError::RepeatabilityExpired(format!(
            "longer ago than this route's window of {window}"
        )));
    }
    // Counted in whole seconds, the window lets a retry in until its last second ends: with a
    // first-sent a full minute ahead, that is up to a second after the record claimed when the request
    // came (kept `ttl`, which may be just the window and a minute) has expired, and the retry would
    // run again. A minute ahead is one second too many.
    if let Ok(ahead) = first_sent.duration_since(now)
        && ahead >= CLOCK_SKEW
    {
        return Err(ProxyError::RepeatabilityExpired(
            "in the future, a minute or more ahead of this proxy's clock".into(),
        ));
    }
    Ok(())
}

/// `time` without its fraction of a second.
fn whole_seconds(time: SystemTime) -> SystemTime {
    match time.duration_since(SystemTime::UNIX_EPOCH) {
        Ok(since) => SystemTime::UNIX_EPOCH + Duration::from_secs(since.as_secs()),
        Err(_) => time,
    }
}

/// `text` as an IMF-fixdate (RFC 9110 §5.6.7, `Sun, 06 Nov 1994 08:49:37 GMT`), and only that form: the
/// obsolete RFC 850 and asctime forms a recipient may accept are not what the specification asks for.
fn imf_fixdate(text: &[u8]) -> Option<SystemTime> {
    let text = std::str::from_utf8(text).ok()?;
    let time = httpdate::parse_http_date(text).ok()?;
    (httpdate::fmt_http_date(time) == text).then_some(time)
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    const WINDOW: Duration = Duration::from_secs(300);

    fn at(seconds: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(seconds)
    }

    fn sent(values: &[&str]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for value in values {
            headers.append(
                REPEATABILITY_FIRST_SENT_HEADER,
                HeaderValue::from_str(value).unwrap(),
            );
        }
        headers
    }

    /// 784111777 is Sun, 06 Nov 1994 08:49:37 GMT.
    const SENT: &str = "Sun, 06 Nov 1994 08:49:37 GMT";
    const SENT_AT: u64 = 784_111_777;

    #[test]
    fn a_first_sent_within_the_window_passes_up_to_its_edge() {
        for now in [SENT_AT, SENT_AT + 1, SENT_AT + 300] {
            assert!(check_first_sent(&sent(&[SENT]), WINDOW, at(now)).is_ok(), "{now}");
        }
        let edge = at(SENT_AT + 300) + Duration::from_millis(900);
        assert!(
            check_first_sent(&sent(&[SENT]), WINDOW, edge).is_ok(),
            "the window's last second, whatever its fraction"
        );
        assert!(
            check_first_sent(&sent(&[SENT]), WINDOW, at(SENT_AT - 59)).is_ok(),
            "up to a minute's skew"
        );
    }

    /// Whatever the fraction of a second a request comes in, every retry the window takes comes before
    /// its first attempt's record (claimed when that came, kept the shortest `ttl` allowed) expires.
    #[test]
    fn every_retry_taken_comes_before_the_first_attempts_record_expires() {
        let ttl = WINDOW + CLOCK_SKEW;
        for millis in [0, 1, 250, 500, 999] {
            let came = at(SENT_AT) + Duration::from_millis(millis);
            for ahead in 0..=61 {
                let first_sent = imf_text(at(SENT_AT + ahead));
                if check_first_sent(&sent(&[&first_sent]), WINDOW, came).is_err() {
                    continue;
                }
                let expires = came + ttl;
                // Around the record's end: every earlier retry comes before it.
                for step in 0..=50 {
                    let retry = expires - Duration::from_secs(3) + Duration::from_millis(step * 100);
                    if check_first_sent(&sent(&[&first_sent]), WINDOW, retry).is_ok() {
                        assert!(
                            retry < expires,
                            "first sent {ahead}s ahead, came at +{millis}ms: a retry taken at {:?} \
                             after the record expired",
                            retry.duration_since(expires).unwrap()
                        );
                    }
                }
            }
        }
    }

    fn imf_text(time: SystemTime) -> String {
        httpdate::fmt_http_date(time)
    }

    #[test]
    fn a_first_sent_outside_the_window_is_expired() {
        for now in [SENT_AT + 301, SENT_AT + 86_400, SENT_AT - 61, SENT_AT - 60] {
            let checked = check_first_sent(&sent(&[SENT]), WINDOW, at(now));
            assert!(
                matches!(checked, Err(ProxyError::RepeatabilityExpired(_))),
                "{now}: {checked:?}"
            );
        }
    }

    #[test]
    fn a_missing_repeated_or_other_form_of_date_is_invalid() {
        let cases: [&[&str]; 6] = [
            &[],
            &[SENT, SENT],
            &["Sunday, 06-Nov-94 08:49:37 GMT"],
            &["Sun Nov  6 08:49:37 1994"],
            &["1994-11-06T08:49:37Z"],
            &["sun, 06 nov 1994 08:49:37 gmt"],
        ];
        for case in cases {
            let checked = check_first_sent(&sent(case), WINDOW, at(SENT_AT));
            assert!(
                matches!(checked, Err(ProxyError::RepeatabilityInvalid(_))),
                "{case:?}: {checked:?}"
            );
        }
    }
}
