//! Runs first for every request on the proxy listener, before the access line and the routes
//! read its path: [`normalise`] brings the path to its one spelling (`config/path.rs`) or refuses it
//! (400 `non-normal-path`, per `server.paths`, `server.escaped_slashes`, `server.path_parameters`);
//! once a route is chosen, [`respell`] writes the path as that route does (`ignore_case`,
//! `ignore_trailing_slash`). Both rewrite the request's URI in place, the query untouched, so the
//! fingerprint, `{path}` in key templates and the upstream see what the route saw. Touches nothing else.

use std::borrow::Cow;

use http::uri::{PathAndQuery, Uri};
use http::{Method, Request};

use crate::config::{NotNormal, PathRules, Route, normal};
use crate::error::ProxyError;

/// Brings the request's path to normal form, or refuses it; a path already normal is left as it is.
/// The asterisk-form target is refused but for OPTIONS.
pub(crate) fn normalise<B>(request: &mut Request<B>, rules: &PathRules) -> Result<(), ProxyError> {
    if request.uri().path() == "*" && request.method() != Method::OPTIONS {
        return Err(ProxyError::NonNormalPath(NotNormal::Asterisk));
    }
    let spelled = match normal(request.uri().path(), rules) {
        Ok(Cow::Borrowed(_)) => return Ok(()),
        Ok(Cow::Owned(spelled)) => spelled,
        Err(why) => return Err(ProxyError::NonNormalPath(why)),
    };
    *request.uri_mut() = with_path(request.uri(), &spelled)?;
    Ok(())
}

/// Writes the request's (normal) path as `route` does, where the route takes other spellings.
pub(crate) fn respell<B>(request: &mut Request<B>, route: &Route) -> Result<(), ProxyError> {
    if let Some(spelled) = route.respell(request.uri().path()) {
        *request.uri_mut() = with_path(request.uri(), &spelled)?;
    }
    Ok(())
}

/// `uri` with another path, its query (and scheme and authority, in absolute form) as they were.
fn with_path(uri: &Uri, path: &str) -> Result<Uri, ProxyError> {
    let too_long = |_| ProxyError::NonNormalPath(NotNormal::TooLong);
    let target = match uri.query() {
        Some(query) => format!("{path}?{query}"),
        None => path.to_owned(),
    };
    let mut parts = uri.clone().into_parts();
    parts.path_and_query = Some(PathAndQuery::try_from(target).map_err(too_long)?);
    Uri::from_parts(parts).map_err(|_| ProxyError::NonNormalPath(NotNormal::TooLong))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Ambiguous, Config, PathMode};

    fn request(target: &str) -> Request<()> {
        Request::builder().uri(target).body(()).unwrap()
    }

    #[test]
    fn the_path_is_normalised_and_the_query_kept_as_sent() {
        let mut hostile = request("//v1/./x/../%70ayments?a=%2e%2E&b=//");
        normalise(&mut hostile, &PathRules::default()).unwrap();
        assert_eq!(hostile.uri(), "/v1/payments?a=%2e%2E&b=//");
        let mut absolute = request("http://example.com//v1/payments?x=1");
        normalise(&mut absolute, &PathRules::default()).unwrap();
        assert_eq!(absolute.uri().to_string(), "http://example.com/v1/payments?x=1");
        for target in ["*", "example.com:443"] {
            let mut pathless = request(target);
            *pathless.method_mut() = Method::OPTIONS;
            normalise(&mut pathless, &PathRules::default()).unwrap();
            assert_eq!(pathless.uri(), target, "a target without a path is left alone");
        }
    }

    #[test]
    fn the_asterisk_form_is_only_for_options() {
        for method in [Method::POST, Method::GET, Method::PATCH] {
            let mut asterisk = request("*");
            *asterisk.method_mut() = method.clone();
            let error = normalise(&mut asterisk, &PathRules::default()).unwrap_err();
            assert_eq!(error.slug(), "non-normal-path", "{method}");
        }
        let mut options = request("*");
        *options.method_mut() = Method::OPTIONS;
        normalise(&mut options, &PathRules::default()).unwrap();
    }

    #[test]
    fn a_refused_path_is_a_non_normal_path_problem_and_the_request_is_left_alone() {
        let reject = PathRules {
            mode: PathMode::Reject,
            escaped_slashes: Ambiguous::Keep,
            path_parameters: Ambiguous::Keep,
        };
        for (target, rules) in [
            ("//v1/payments", reject),
            ("/v1%2Fpayments", PathRules::default()),
            ("/v1/payments;a", PathRules::default()),
            ("/v1/%zz", PathRules::default()),
        ] {
            let mut refused = request(target);
            let error = normalise(&mut refused, &rules).unwrap_err();
            assert_eq!(error.slug(), "non-normal-path", "{target}");
            assert_eq!(error.status(), http::StatusCode::BAD_REQUEST);
            assert_eq!(refused.uri(), target);
        }
    }

    #[test]
    fn a_route_that_ignores_case_and_slash_forwards_its_own_spelling() {
        let config = Config::from_toml_str(
            "[[routes]]\nname = \"pay\"\npath = \"/v1/payments\"\nignore_case = true\n\
             ignore_trailing_slash = true\n[[routes]]\nname = \"refund\"\npath = \"/v1/orders/*/refund/\"\n\
             ignore_case = true\nignore_trailing_slash = true\n[[routes]]\nname = \"hooks\"\n\
             path_prefix = \"/hooks\"\nignore_case = true\n",
        )
        .unwrap();
        for (target, want) in [
            ("/V1/Payments/?q=A", "/v1/payments?q=A"),
            ("/v1/payments", "/v1/payments"),
            ("/V1/ORDERS/AbC/Refund", "/v1/orders/AbC/refund/"),
            ("/HOOKS/Stripe", "/hooks/Stripe"),
        ] {
            let mut request = request(target);
            let route = config
                .routes
                .select(request.method(), request.uri().path())
                .clone();
            assert_ne!(route.name, "default", "{target}");
            respell(&mut request, &route).unwrap();
            assert_eq!(request.uri(), want, "{target}");
        }
    }
}
