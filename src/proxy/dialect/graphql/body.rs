//! The GraphQL-over-HTTP JSON body around the document: reads `query`, `operationName` and `variables`
//! from it, and writes a part's body as the client's with those replaced. Values are kept as the client's
//! JSON text ([`RawValue`]), members in the client's order, so what the proxy does not change goes
//! upstream as it came (numbers to the last digit). A member named twice is refused: the proxy and the
//! service could read different ones.

use std::collections::HashSet;
use std::fmt;

use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;

use super::NotPlanned;

/// A JSON object's members in the order written, each value as its JSON text.
#[derive(Debug, Default)]
pub(super) struct Members<'a>(pub(super) Vec<(String, &'a RawValue)>);

impl<'de: 'a, 'a> Deserialize<'de> for Members<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(MembersVisitor(std::marker::PhantomData))
    }
}

struct MembersVisitor<'a>(std::marker::PhantomData<&'a ()>);

impl<'de: 'a, 'a> Visitor<'de> for MembersVisitor<'a> {
    type Value = Members<'a>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<Self::Value, M::Error> {
        let mut members: Vec<(String, &'a RawValue)> = Vec::new();
        let mut seen = HashSet::new();
        while let Some((name, value)) = map.next_entry::<String, &'de RawValue>()? {
            if !seen.insert(name.clone()) {
                return Err(serde::de::Error::custom(format_args!("`{name}` is named twice")));
            }
            members.push((name, value));
        }
        Ok(Members(members))
    }
}

impl<'a> Members<'a> {
    /// The members of the object `json`, or why it is not one.
    pub(super) fn read(json: &'a [u8]) -> Result<Members<'a>, String> {
        serde_json::from_slice(json).map_err(|e| e.to_string())
    }

    /// The value of the member `name`, unless absent or `null`.
    pub(super) fn get(&self, name: &str) -> Option<&'a RawValue> {
        self.0
            .iter()
            .find(|(seen, value)| seen == name && value.get() != "null")
            .map(|(_, value)| *value)
    }
}

/// A request body, read as far as the proxy needs it.
pub(super) struct Body<'a> {
    /// Every member of the body, as sent.
    pub(super) members: Members<'a>,
    /// The `query` member: the document.
    pub(super) query: String,
    /// The `operationName` member, unless absent or `null`.
    pub(super) operation_name: Option<String>,
    /// The members of `variables`, empty when it is absent or `null`.
    pub(super) variables: Members<'a>,
}

impl<'a> Body<'a> {
    /// Reads `request`; `Unparseable` when it is not a JSON object with a string `query`, an
    /// `operationName` that is a string or `null`, and `variables` that is an object or `null`.
    pub(super) fn read(request: &'a [u8]) -> Result<Body<'a>, NotPlanned> {
        let unparseable = |why: &str| NotPlanned::Unparseable(why.to_owned());
        let members = Members::read(request).map_err(|e| unparseable(&format!("the body: {e}")))?;
        let query = members
            .get("query")
            .ok_or_else(|| unparseable("no `query` in the body"))?;
        let query: String =
            serde_json::from_str(query.get()).map_err(|_| unparseable("`query` is not a string"))?;
        let operation_name = match members.get("operationName") {
            None => None,
            Some(name) => Some(
                serde_json::from_str(name.get())
                    .map_err(|_| unparseable("`operationName` is not a string"))?,
            ),
        };
        let variables = match members.get("variables") {
            None => Members::default(),
            Some(raw) => {
                Members::read(raw.get().as_bytes()).map_err(|e| unparseable(&format!("`variables`: {e}")))?
            }
        };
        Ok(Body {
            members,
            query,
            operation_name,
            variables,
        })
    }

    /// The body of a part: the client's members in its order, `query` replaced by `document`, the
    /// object `variables` keeping only the members `used` names (in the client's order), and
    /// `extensions` without `persistedQuery`.
    pub(super) fn with(&self, document: &str, used: &HashSet<&str>) -> Vec<u8> {
        let mut out = Vec::with_capacity(document.len() + 64);
        out.push(b'{');
        for (i, (name, value)) in self.members.0.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            write_string(&mut out, name);
            out.push(b':');
            match name.as_str() {
                "query" => write_string(&mut out, document),
                "variables" if value.get() != "null" => self.write_variables(&mut out, used),
                "extensions" => write_extensions(&mut out, value),
                _ => out.extend_from_slice(value.get().as_bytes()),
            }
        }
        out.push(b'}');
        out
    }

    fn write_variables(&self, out: &mut Vec<u8>, used: &HashSet<&str>) {
        let kept = self
            .variables
            .0
            .iter()
            .filter(|(name, _)| used.contains(&name.as_str()));
        write_object(out, kept);
    }
}

/// The request's `extensions` without `persistedQuery`: its hash is of the client's document, and a
/// service that reads it (automatic persisted queries) refuses a part's document that does not match.
fn write_extensions(out: &mut Vec<u8>, extensions: &RawValue) {
    let Ok(members) = Members::read(extensions.get().as_bytes()) else {
        out.extend_from_slice(extensions.get().as_bytes());
        return;
    };
    write_object(out, members.0.iter().filter(|(name, _)| name != "persistedQuery"));
}

/// An object of these members, each value as it came.
fn write_object<'a, 'b: 'a>(out: &mut Vec<u8>, members: impl Iterator<Item = &'a (String, &'b RawValue)>) {
    out.push(b'{');
    for (i, (name, value)) in members.enumerate() {
        if i > 0 {
            out.push(b',');
        }
        write_string(out, name);
        out.push(b':');
        out.extend_from_slice(value.get().as_bytes());
    }
    out.push(b'}');
}

/// `text` as a JSON string.
pub(super) fn write_string(out: &mut Vec<u8>, text: &str) {
    // Writing a `str` into a `Vec` cannot fail.
    let _ = serde_json::to_writer(&mut *out, text);
}
