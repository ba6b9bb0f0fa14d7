//! `grpc_release_codes` and `grpc_unknown_codes` (in `[idempotency]` or a route): which gRPC status
//! codes of a keyed call give its key back (the call was not carried out; a retry runs it) and which
//! leave its outcome unknown (`on_unknown_outcome` decides). Every other code, OK included, is a result:
//! stored and replayed. Codes are written by name (`"UNAVAILABLE"`, any case) or number (`14`).

use super::ConfigError;

/// The gRPC status codes by number (grpc/doc/statuscodes.md).
const NAMES: [&str; 17] = [
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
];

/// The codes that say the server did not carry the call out: UNAVAILABLE, RESOURCE_EXHAUSTED, ABORTED.
const DEFAULT_RELEASE: [u32; 3] = [14, 8, 10];
/// The codes that say nothing of what the server did: DEADLINE_EXCEEDED, CANCELLED, UNKNOWN, INTERNAL,
/// DATA_LOSS.
const DEFAULT_UNKNOWN: [u32; 5] = [4, 1, 2, 13, 15];

/// The name of gRPC status `code` (`"UNAVAILABLE"`), or `"OTHER"` past the last one gRPC defines.
pub fn code_name(code: u32) -> &'static str {
    NAMES.get(code as usize).copied().unwrap_or("OTHER")
}

/// What a keyed gRPC call's status means for its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrpcOutcome {
    /// A result: stored and replayed.
    Store,
    /// Not carried out: the key is given back.
    Release,
    /// Not known: `on_unknown_outcome` decides.
    Unknown,
}

/// Which codes release and which are unknown outcomes, one bit per code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrpcOutcomes {
    release: u32,
    unknown: u32,
}

impl GrpcOutcomes {
    /// The outcome of a call that ended with `code`. A code past the last one gRPC defines is taken as
    /// UNKNOWN, as gRPC's clients take it.
    pub fn of(&self, code: u32) -> GrpcOutcome {
        let code = if code < NAMES.len() as u32 { code } else { 2 };
        if self.release & (1 << code) != 0 {
            GrpcOutcome::Release
        } else if self.unknown & (1 << code) != 0 {
            GrpcOutcome::Unknown
        } else {
            GrpcOutcome::Store
        }
    }

    /// The two lists as written (absent means the defaults), checked: names or numbers of codes, never
    /// OK, and no code in both.
    pub fn parse(
        release: Option<&[String]>,
        unknown: Option<&[String]>,
        release_key: &str,
        unknown_key: &str,
    ) -> Result<GrpcOutcomes, ConfigError> {
        let outcomes = GrpcOutcomes {
            release: mask(release_key, release, &DEFAULT_RELEASE)?,
            unknown: mask(unknown_key, unknown, &DEFAULT_UNKNOWN)?,
        };
        let both = outcomes.release & outcomes.unknown;
        if both != 0 {
            let code = NAMES[both.trailing_zeros() as usize];
            return Err(ConfigError::new(
                unknown_key,
                format!(
                    "{code} is also in {release_key}: a code either gives the key back or leaves the outcome unknown"
                ),
            ));
        }
        Ok(outcomes)
    }
}

impl Default for GrpcOutcomes {
    fn default() -> Self {
        GrpcOutcomes {
            release: DEFAULT_RELEASE.iter().fold(0, |mask, code| mask | 1 << code),
            unknown: DEFAULT_UNKNOWN.iter().fold(0, |mask, code| mask | 1 << code),
        }
    }
}

fn mask(key: &str, listed: Option<&[String]>, default: &[u32]) -> Result<u32, ConfigError> {
    let Some(listed) = listed else {
        return Ok(default.iter().fold(0, |mask, code| mask | 1 << code));
    };
    let mut mask = 0;
    for entry in listed {
        let code = match entry.parse::<u32>() {
            Ok(code) if code < NAMES.len() as u32 => Some(code),
            Ok(_) => None,
            Err(_) => NAMES
                .iter()
                .position(|name| name.eq_ignore_ascii_case(entry))
                .map(|code| code as u32),
        };
        match code {
            Some(0) => {
                return Err(ConfigError::new(
                    key,
                    "OK is a result: it is always stored and replayed",
                ));
            }
            Some(code) => mask |= 1 << code,
            None => {
                return Err(ConfigError::new(
                    key,
                    format!(
                        "{entry:?} is not a gRPC status code (a name such as \"UNAVAILABLE\", or 1 to 16)"
                    ),
                ));
            }
        }
    }
    Ok(mask)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listed(codes: &[&str]) -> Vec<String> {
        codes.iter().map(|code| code.to_string()).collect()
    }

    #[test]
    fn by_default_unavailable_releases_deadline_is_unknown_and_deterministic_errors_are_stored() {
        let outcomes = GrpcOutcomes::default();
        assert_eq!(outcomes.of(0), GrpcOutcome::Store);
        for code in [3, 5, 6, 7, 9, 11, 12, 16] {
            assert_eq!(outcomes.of(code), GrpcOutcome::Store, "{}", NAMES[code as usize]);
        }
        for code in [14, 8, 10] {
            assert_eq!(
                outcomes.of(code),
                GrpcOutcome::Release,
                "{}",
                NAMES[code as usize]
            );
        }
        for code in [4, 1, 2, 13, 15, 17, 99] {
            assert_eq!(outcomes.of(code), GrpcOutcome::Unknown, "{code}");
        }
        assert_eq!(GrpcOutcomes::parse(None, None, "r", "u").unwrap(), outcomes);
    }

    #[test]
    fn lists_take_names_in_any_case_or_numbers_and_replace_the_default_whole() {
        let release = listed(&["unavailable", "9"]);
        let outcomes = GrpcOutcomes::parse(Some(&release), Some(&[]), "r", "u").unwrap();
        assert_eq!(outcomes.of(14), GrpcOutcome::Release);
        assert_eq!(outcomes.of(9), GrpcOutcome::Release);
        assert_eq!(
            outcomes.of(8),
            GrpcOutcome::Store,
            "RESOURCE_EXHAUSTED is no longer listed"
        );
        assert_eq!(outcomes.of(4), GrpcOutcome::Store, "the unknown list is empty");
    }

    #[test]
    fn ok_unknown_names_and_a_code_in_both_lists_are_refused_naming_the_key() {
        let refused = |release: &[&str], unknown: &[&str]| {
            GrpcOutcomes::parse(
                Some(&listed(release)),
                Some(&listed(unknown)),
                "route.r",
                "route.u",
            )
            .unwrap_err()
        };
        let error = refused(&["OK"], &[]);
        assert_eq!(error.key, "route.r");
        let error = refused(&[], &["NOT_A_CODE"]);
        assert_eq!(error.key, "route.u");
        assert!(error.message.contains("NOT_A_CODE"), "{}", error.message);
        assert_eq!(refused(&["17"], &[]).key, "route.r");
        let error = refused(&["ABORTED"], &["10"]);
        assert_eq!(error.key, "route.u");
        assert!(error.message.contains("ABORTED"), "{}", error.message);
    }
}
