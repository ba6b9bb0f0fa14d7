//! What the spans made for traces are called and carry: their target, the request span's target and
//! name, and the values of the attributes set on their exported form only. Shared by `otlp.rs`, which
//! makes the spans, and `otlp/export.rs`, which sends them.

/// The target of the spans made for traces alone.
pub const TARGET: &str = "idemproxy::otlp";

/// The log filter's directive that keeps the spans of [`TARGET`] out of the log output.
pub const NOT_LOGGED: &str = "idemproxy::otlp=off";

/// The target and name of the request's span, made by `proxy.rs` for logs and traces alike.
pub const REQUEST_SPAN: (&str, &str) = ("idemproxy::proxy", "request");

/// A value an attribute of a span's exported form takes.
#[derive(Debug, Clone, Copy)]
pub enum AttributeValue {
    /// Text.
    Str(&'static str),
    /// A number.
    Int(i64),
}

impl From<&'static str> for AttributeValue {
    fn from(value: &'static str) -> Self {
        AttributeValue::Str(value)
    }
}

impl From<i64> for AttributeValue {
    fn from(value: i64) -> Self {
        AttributeValue::Int(value)
    }
}
