//! The variables Kubernetes gives every pod for each Service in its namespace (unless the pod sets
//! `enableServiceLinks: false`), read once at load. A Service named `idemproxy` (or `idemproxy-…`) yields
//! `IDEMPROXY_SERVICE_HOST=10.0.0.1`, `IDEMPROXY_PORT=tcp://10.0.0.1:8080` and their kin, which share
//! the prefix of the proxy's own `IDEMPROXY_` configuration variables. They are recognised here by name
//! and value, so the environment layer leaves exactly those out; any other `IDEMPROXY_` variable is still
//! configuration, and a misspelt one still an error. Touches nothing but the names and values it is given.

use std::net::IpAddr;

/// The prefix of every configuration variable.
pub(super) const PREFIX: &str = "IDEMPROXY_";

/// The names of the service-link variables among `vars`, in the order given.
pub(super) fn service_links<'a>(vars: impl IntoIterator<Item = (&'a str, &'a str)>) -> Vec<String> {
    vars.into_iter()
        .filter(|(name, value)| is_service_link(name, value))
        .map(|(name, _)| name.to_owned())
        .collect()
}

/// Whether `name=value` is a variable Kubernetes sets for a Service whose name starts with `idemproxy`:
/// `<SVC>_SERVICE_HOST` (an IP), `<SVC>_SERVICE_PORT` and `<SVC>_SERVICE_PORT_<PORT NAME>` (a port
/// number), `<SVC>_PORT` and `<SVC>_PORT_<n>_<PROTO>` (`proto://ip:port`), and the latter's `_PROTO`,
/// `_PORT` and `_ADDR`. `<SVC>` is the Service's name upper-cased with `-` as `_`; a configuration
/// variable always holds `__`, which none of these can.
fn is_service_link(name: &str, value: &str) -> bool {
    let plain = name
        .bytes()
        .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_');
    if !name.starts_with(PREFIX) || name.contains("__") || !plain {
        return false;
    }
    let words: Vec<&str> = name.split('_').collect();
    (1..words.len()).any(|start| link_suffix(&words[start..], value))
}

/// Whether the words after the Service's name, and the value, are one of the service-link shapes.
fn link_suffix(words: &[&str], value: &str) -> bool {
    match words {
        ["SERVICE", "HOST"] => value.parse::<IpAddr>().is_ok(),
        ["SERVICE", "PORT"] => is_port(value),
        ["SERVICE", "PORT", name @ ..] if !name.is_empty() => is_port(value),
        ["PORT"] => is_url(value),
        ["PORT", port, proto] => is_port(port) && is_proto(proto) && is_url(value),
        ["PORT", port, proto, "PROTO"] => {
            is_port(port) && is_proto(proto) && value.eq_ignore_ascii_case(proto)
        }
        ["PORT", port, proto, "PORT"] => is_port(port) && is_proto(proto) && value == *port,
        ["PORT", port, proto, "ADDR"] => is_port(port) && is_proto(proto) && value.parse::<IpAddr>().is_ok(),
        _ => false,
    }
}

fn is_port(text: &str) -> bool {
    text.parse::<u16>().is_ok_and(|port| port > 0)
}

fn is_proto(text: &str) -> bool {
    matches!(text, "TCP" | "UDP" | "SCTP")
}

/// `tcp://10.0.0.1:8080`, `udp://[fd00::1]:53`.
fn is_url(value: &str) -> bool {
    let Some((proto, address)) = value.split_once("://") else {
        return false;
    };
    is_proto(&proto.to_ascii_uppercase()) && address.parse::<std::net::SocketAddr>().is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What Kubernetes sets for a Service `idemproxy` with ports `http` (8080) and `admin` (9090).
    const SET_BY_KUBERNETES: [(&str, &str); 12] = [
        ("IDEMPROXY_SERVICE_HOST", "10.96.0.12"),
        ("IDEMPROXY_SERVICE_PORT", "8080"),
        ("IDEMPROXY_SERVICE_PORT_HTTP", "8080"),
        ("IDEMPROXY_SERVICE_PORT_ADMIN", "9090"),
        ("IDEMPROXY_PORT", "tcp://10.96.0.12:8080"),
        ("IDEMPROXY_PORT_8080_TCP", "tcp://10.96.0.12:8080"),
        ("IDEMPROXY_PORT_8080_TCP_PROTO", "tcp"),
        ("IDEMPROXY_PORT_8080_TCP_PORT", "8080"),
        ("IDEMPROXY_PORT_8080_TCP_ADDR", "10.96.0.12"),
        ("IDEMPROXY_PORT_9090_TCP", "tcp://10.96.0.12:9090"),
        ("IDEMPROXY_ADMIN_SERVICE_HOST", "fd00::12"),
        ("IDEMPROXY_ADMIN_PORT_9090_TCP_ADDR", "fd00::12"),
    ];

    #[test]
    fn every_variable_kubernetes_sets_for_an_idemproxy_service_is_recognised() {
        let names = service_links(SET_BY_KUBERNETES);
        assert_eq!(names.len(), SET_BY_KUBERNETES.len(), "{names:?}");
    }

    #[test]
    fn configuration_and_near_misses_are_not_service_links() {
        for (name, value) in [
            ("IDEMPROXY_STORE__URL", "postgres://db/idemproxy"),
            ("IDEMPROXY_SERVR__LISTEN", "0.0.0.0:8080"),
            ("IDEMPROXY_PORT", "8080"),
            ("IDEMPROXY_SERVICE_HOST", "db.example"),
            ("IDEMPROXY_SERVICE_PORT", "http"),
            ("IDEMPROXY_PORT_8080_TCP", "http://10.0.0.1:8080"),
            ("IDEMPROXY_PORT_8080_TCP_PORT", "9090"),
            ("IDEMPROXY_PORT_8080_HTTP", "tcp://10.0.0.1:8080"),
            ("IDEMPROXY_LISTEN", "tcp://10.0.0.1:8080"),
            ("OTHER_SERVICE_HOST", "10.0.0.1"),
        ] {
            assert!(service_links([(name, value)]).is_empty(), "{name}={value}");
        }
    }
}
