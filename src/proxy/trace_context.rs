//! Runs first for every request whose span is recorded (or while the access log is on): reads the W3C
//! Trace Context `traceparent` header, so the request's span and access line carry the caller's trace id.
//! Pure; the headers themselves (`traceparent`, `tracestate`) are forwarded upstream untouched (unless
//! traces are on: then `otlp.rs` writes the proxy's upstream span as the parent) and are never part of the
//! fingerprint (`config/idempotency.rs` refuses them as fingerprint headers).

use http::HeaderMap;

/// The header that carries the trace context.
pub const TRACEPARENT: &str = "traceparent";

/// A valid `traceparent`: `version-traceid-parentid-flags`, lower-case hex.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent<'a> {
    /// 32 hex digits, not all zero.
    pub trace_id: &'a str,
    /// 16 hex digits, not all zero: the caller's span.
    pub parent_id: &'a str,
}

/// The request's trace context; `None` when it has none, several, or an invalid one (ignored, never an
/// error: tracing must not change how a request is answered).
pub fn parse(headers: &HeaderMap) -> Option<TraceParent<'_>> {
    let mut values = headers.get_all(TRACEPARENT).iter();
    let value = values.next()?;
    if values.next().is_some() {
        return None;
    }
    parse_value(value.to_str().ok()?.trim())
}

/// One `traceparent` value, as the W3C Trace Context recommendation reads it: version `00` is exactly 55
/// characters; a later version may add fields after a `-`, which are ignored; version `ff` is invalid.
fn parse_value(value: &str) -> Option<TraceParent<'_>> {
    // ASCII first: every slice below is by byte offset.
    if !value.is_ascii() || value.len() < 55 {
        return None;
    }
    let version = &value[0..2];
    if !is_hex(version) || version == "ff" {
        return None;
    }
    let well_ended = if version == "00" {
        value.len() == 55
    } else {
        value.len() == 55 || value.as_bytes()[55] == b'-'
    };
    let dashes = [2, 35, 52].iter().all(|&at| value.as_bytes()[at] == b'-');
    let (trace_id, parent_id, flags) = (&value[3..35], &value[36..52], &value[53..55]);
    let ids_valid = is_hex(trace_id) && is_hex(parent_id) && !is_zero(trace_id) && !is_zero(parent_id);
    (well_ended && dashes && ids_valid && is_hex(flags)).then_some(TraceParent { trace_id, parent_id })
}

fn is_hex(s: &str) -> bool {
    s.bytes()
        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

fn is_zero(s: &str) -> bool {
    s.bytes().all(|b| b == b'0')
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_valid_traceparent_gives_its_trace_and_parent_ids() {
        assert_eq!(
            parse_value(VALID),
            Some(TraceParent {
                trace_id: "4bf92f3577b34da6a3ce929d0e0e4736",
                parent_id: "00f067aa0ba902b7",
            })
        );
        let later = format!("cc{}-what-comes-next", &VALID[2..]);
        assert!(
            parse_value(&later).is_some(),
            "a later version's extra fields are ignored"
        );
    }

    #[test]
    fn invalid_traceparents_are_ignored() {
        let cases = [
            "",
            "00",
            &VALID[..54],
            &format!("{VALID}-"),
            &format!("{VALID}0"),
            &format!("cc{}0", &VALID[2..]),
            &format!("ff{}", &VALID[2..]),
            &VALID.to_uppercase(),
            &VALID.replace("4bf92f3577b34da6a3ce929d0e0e4736", &"0".repeat(32)),
            &VALID.replace("00f067aa0ba902b7", &"0".repeat(16)),
            &VALID.replace('-', "_"),
            &VALID.replace("-01", "-0g"),
            "00-4bf92f3577b34da6a3ce929d0e0e473é-00f067aa0ba902b7-01",
        ];
        for case in cases {
            assert_eq!(parse_value(case), None, "{case:?}");
        }
    }

    #[test]
    fn a_repeated_header_is_ignored() {
        let mut headers = HeaderMap::new();
        headers.append(TRACEPARENT, http::HeaderValue::from_static(VALID));
        assert!(parse(&headers).is_some());
        headers.append(TRACEPARENT, http::HeaderValue::from_static(VALID));
        assert!(parse(&headers).is_none());
    }
}
