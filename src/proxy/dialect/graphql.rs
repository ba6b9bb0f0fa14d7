//! The GraphQL dialect, for a route keyed by `graphql`, once the body has been read (issue 49): a
//! `mutation` whose root fields carry `@idempotent(key: "…")` (a string literal or a variable) gets one
//! idempotency claim per keyed field. [`plan`] reads a GraphQL-over-HTTP JSON body and splits the
//! operation into [`Part`]s, one operation to forward per root field, in document order, with the
//! directive cut out; [`merge`] puts their answers back together in the client's order; [`answer`]'s
//! helpers write the answers the proxy gives without forwarding. Queries and subscriptions pass through.
//! Pure functions of the bytes: no I/O, no proxy types. The caller bounds the body; the document's depth,
//! size and fan-out are bounded here (`MAX_*`).
//!
//! The part documents are spliced from the client's text (`split.rs`), so each keeps what the client wrote
//! byte for byte (comments, aliases, arguments, other directives, fragments) except what must go: the
//! `@idempotent` directive, the other root fields, the variable declarations and fragments the part does
//! not use (GraphQL refuses an operation that declares a variable it does not use, or a document with a
//! fragment it does not spread), and the other operations of the document.

pub mod answer;
mod body;
mod canonical;
mod document;
mod split;
#[cfg(test)]
mod tests;

pub use self::answer::{
    IDEMPOTENCY_CONCURRENT_REQUEST, IDEMPOTENCY_KEY_PARAMETER_MISMATCH, IDEMPOTENCY_PREVIOUS_ATTEMPT_FAILED,
    error_answer, field_failed, idempotency_error, merge,
};

/// The deepest nesting the parser follows: selection sets, list and object values, and list types all
/// count. Deeper documents are refused rather than walked (the parser recurses; its own default is 500).
/// The standard introspection query, among the deepest documents in common use, needs a quarter of it.
pub const MAX_DEPTH: usize = 64;

/// The most tokens a document may have, whitespace and comments included (a token is at least a byte, so
/// the body budget bounds this too; this bounds the syntax tree built from a large budget).
pub const MAX_TOKENS: usize = 200_000;

/// The most root fields a keyed mutation may have: each becomes its own request upstream.
pub const MAX_PARTS: usize = 32;

/// The most fragment definitions a document may have: every part looks up the fragments it spreads.
pub const MAX_FRAGMENTS: usize = 500;

/// How many times the request's bytes its parts may take, their bodies and fingerprints together (plus
/// [`PLANNED_SLACK`]): every part repeats the fragments and variables it shares with others, so a
/// request of many fields spreading one large fragment would otherwise cost [`MAX_PARTS`] times its size
/// in memory and upstream.
pub const MAX_PLANNED_FACTOR: usize = 8;

/// What the parts may take beyond [`MAX_PLANNED_FACTOR`] times the request, so a small request's parts
/// sharing its fragments always fit.
pub const PLANNED_SLACK: usize = 64 * 1024;

/// What a request body asks of the proxy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// Forward the request as it came, unprotected: a query or a subscription. As it came: should another operation of its document carry
    /// `@idempotent`, a service that does not declare the directive refuses the whole document (GraphQL
    /// validates every operation of a document, run or not).
    PassThrough,
    /// A mutation none of whose root fields is marked `@idempotent`: forwarded as it came where keys are
    /// optional, refused where they are required.
    Unkeyed,
    /// Forward each part in turn, in this order (the client's), and merge their answers: one part per
    /// root field of the mutation, keyed or not (a root field beside keyed ones is forwarded on its own,
    /// every time, with `key` `None`). Never empty. A single part is the whole operation without its
    /// directive, and its answer may go to the client as it comes: merging one answer changes nothing
    /// but its layout.
    Keyed(Vec<Part>),
}

/// One root field of a keyed mutation as its own request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    /// The request body to forward: the client's JSON body, members in its order, with `query` holding
    /// only this field's operation (and the fragments it spreads, transitively) and `variables` only the
    /// variables that operation declares. `operationName`, `extensions` and any other member as sent, but
    /// for `extensions.persistedQuery`, whose hash is of the client's whole document.
    pub body: Vec<u8>,
    /// The field's response key (its alias, else its name): where its answer sits in `data`, and the first
    /// element of its errors' `path`.
    pub response_key: String,
    /// The idempotency key its `@idempotent` directive gave (never empty); `None` for an unkeyed root field
    /// beside keyed ones, forwarded unprotected.
    pub key: Option<String>,
    /// What makes two parts the same request, for the key's fingerprint: the part's document as its
    /// significant tokens (whitespace, comments and commas do not count), its `operationName`, and the
    /// values of the variables it uses in canonical JSON (members sorted, no whitespace, numbers as
    /// written). So the same key with other arguments, another selection or another alias (which moves
    /// the answer in `data`) is a mismatch; a retry that reformats its document or reorders its variables
    /// is not. `extensions` (tracing, persisted-query hashes) and the variables only the directive used
    /// do not count.
    pub fingerprint: Vec<u8>,
}

/// Why a body has no plan. [`NotPlanned::is_unparseable`] tells the requests the service refuses as well
/// (nothing runs), which may be forwarded unprotected where keys are optional; every other one is the
/// client's mistake about `@idempotent`, or over a limit, and is refused (400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotPlanned {
    /// Not a GraphQL request: not a JSON object, no `query` string, members of the wrong type or named
    /// twice, a syntax error, or type definitions in the document. The text says which.
    #[error("not a GraphQL request: {0}")]
    Unparseable(String),
    /// The document names no operation to run: it has none, `operationName` names none of them, or it has
    /// several and no `operationName`. The text says which.
    #[error("no operation to run: {0}")]
    NoOperation(String),
    /// The document is deeper, longer, or fans out wider than the `MAX_*` limits; the text says which.
    #[error("the GraphQL document is over a limit: {0}")]
    OverLimit(String),
    /// `@idempotent` where it cannot go: anywhere but on a root field of a mutation written out in the
    /// operation (not in a fragment), or twice on one field. The text says where.
    #[error("@idempotent is misplaced: {0}")]
    Misplaced(String),
    /// A keyed mutation whose root fields cannot be told apart: two answering to one response key, two
    /// with one idempotency key, or a fragment spread among its root fields.
    #[error("the keyed mutation cannot be split: {0}")]
    Unsplittable(String),
    /// The key of a keyed field is missing, empty, not a string, or a variable that is not declared or has
    /// no value; `field` is the field's response key.
    #[error("the idempotency key of `{field}` is not valid: {why}")]
    InvalidKey {
        /// The keyed field's response key.
        field: String,
        /// What is wrong with its key.
        why: String,
    },
}

impl NotPlanned {
    /// Whether the service would refuse the request too, before running anything: a body that is not a
    /// GraphQL request, or names no operation.
    pub fn is_unparseable(&self) -> bool {
        matches!(self, NotPlanned::Unparseable(_) | NotPlanned::NoOperation(_))
    }
}

/// What `request` (a GraphQL-over-HTTP JSON POST body) asks of the proxy. Refuses a misused
/// `@idempotent` anywhere in the document, then picks the operation by `operationName`, or the only one.
pub fn plan(request: &[u8]) -> Result<Plan, NotPlanned> {
    let body = body::Body::read(request)?;
    let tree = document::parse(&body.query)?;
    let doc = tree.document();
    document::check_placement(&doc)?;
    let operation = document::operation(&doc, body.operation_name.as_deref())?;
    let Some(fields) = document::keyed_fields(&operation)? else {
        return Ok(match document::is_mutation(&operation) {
            true => Plan::Unkeyed,
            false => Plan::PassThrough,
        });
    };
    let splitter = split::Splitter::new(&doc, &operation, &fields, &body);
    let allowance = planned_allowance(request.len());
    let mut parts: Vec<Part> = Vec::with_capacity(fields.len());
    let mut planned = 0usize;
    for field in &fields {
        let part = splitter.part(field)?;
        planned += part.body.len() + part.fingerprint.len();
        if planned > allowance {
            return Err(NotPlanned::OverLimit(format!(
                "the parts would take more than {MAX_PLANNED_FACTOR} times the request's bytes"
            )));
        }
        parts.push(part);
    }
    check_keys_distinct(&parts)?;
    Ok(Plan::Keyed(parts))
}

/// The most bytes the parts of a `length`-byte request may take, bodies and fingerprints together.
fn planned_allowance(length: usize) -> usize {
    length
        .saturating_mul(MAX_PLANNED_FACTOR)
        .saturating_add(PLANNED_SLACK)
}

/// Refuses two fields of one request with one key: the second would find the first's claim.
fn check_keys_distinct(parts: &[Part]) -> Result<(), NotPlanned> {
    for (i, part) in parts.iter().enumerate() {
        let Some(key) = &part.key else { continue };
        if parts[..i].iter().any(|earlier| earlier.key.as_ref() == Some(key)) {
            return Err(NotPlanned::Unsplittable(format!(
                "`{}` has the key of an earlier field",
                part.response_key
            )));
        }
    }
    Ok(())
}
