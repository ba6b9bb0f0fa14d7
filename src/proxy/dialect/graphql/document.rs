//! The document in a request's `query`: parsed under the limits, its operation picked, `@idempotent`
//! checked wherever it appears, and a keyed mutation's root fields listed.

use apollo_parser::cst::{self, CstNode};
use apollo_parser::{Parser, SyntaxKind, SyntaxNode, SyntaxTree};

use super::{MAX_DEPTH, MAX_FRAGMENTS, MAX_PARTS, MAX_TOKENS, NotPlanned};

/// The directive's name, without its `@`.
pub(super) const IDEMPOTENT: &str = "idempotent";

/// A root field of a keyed mutation.
pub(super) struct RootField {
    pub(super) field: cst::Field,
    /// Its alias, else its name.
    pub(super) response_key: String,
    /// Its `@idempotent` directive, when it has one.
    pub(super) directive: Option<cst::Directive>,
}

/// Parses `query` under [`MAX_DEPTH`] and [`MAX_TOKENS`]; refuses a document with a syntax error, with
/// definitions a request may not hold (types, schemas, directives), or with more than [`MAX_FRAGMENTS`]
/// fragments.
pub(super) fn parse(query: &str) -> Result<SyntaxTree, NotPlanned> {
    let tree = Parser::new(query)
        .recursion_limit(MAX_DEPTH)
        .token_limit(MAX_TOKENS)
        .parse();
    if let Some(error) = tree.errors().next() {
        return Err(refusal(error));
    }
    let mut fragments = 0usize;
    for definition in tree.document().definitions() {
        if !definition.is_executable_definition() {
            return Err(NotPlanned::Unparseable(format!(
                "the document holds a {}, which a request may not",
                definition.kind()
            )));
        }
        fragments += usize::from(matches!(definition, cst::Definition::FragmentDefinition(_)));
    }
    if fragments > MAX_FRAGMENTS {
        return Err(NotPlanned::OverLimit(format!(
            "more than {MAX_FRAGMENTS} fragments"
        )));
    }
    Ok(tree)
}

fn refusal(error: &apollo_parser::Error) -> NotPlanned {
    if !error.is_limit() {
        return NotPlanned::Unparseable(format!(
            "syntax error at byte {}: {}",
            error.index(),
            error.message()
        ));
    }
    if error.message().contains("recursion") {
        NotPlanned::OverLimit(format!("nested deeper than {MAX_DEPTH}"))
    } else {
        NotPlanned::OverLimit(format!("more than {MAX_TOKENS} tokens"))
    }
}

/// The operation to run: the one `name` names, else the only one (GraphQL's GetOperation).
pub(super) fn operation(
    doc: &cst::Document,
    name: Option<&str>,
) -> Result<cst::OperationDefinition, NotPlanned> {
    let mut operations = doc.definitions().filter_map(|definition| match definition {
        cst::Definition::OperationDefinition(operation) => Some(operation),
        _ => None,
    });
    let no = |why: String| NotPlanned::NoOperation(why);
    match name {
        Some(name) => operations
            .find(|operation| operation.name().is_some_and(|n| n.text() == name))
            .ok_or_else(|| no(format!("the document has no operation named `{name}`"))),
        None => {
            let first = operations
                .next()
                .ok_or_else(|| no("the document has no operation".into()))?;
            match operations.next() {
                None => Ok(first),
                Some(_) => Err(no(
                    "the document has several operations and no `operationName`".into()
                )),
            }
        }
    }
}

/// Whether `operation` is a mutation (an operation without a type is a query).
pub(super) fn is_mutation(operation: &cst::OperationDefinition) -> bool {
    operation
        .operation_type()
        .is_some_and(|kind| kind.mutation_token().is_some())
}

/// Refuses an `@idempotent` anywhere in the document (any operation, any fragment) but once on a root
/// field of a mutation.
pub(super) fn check_placement(doc: &cst::Document) -> Result<(), NotPlanned> {
    for node in doc.syntax().descendants() {
        if node.kind() != SyntaxKind::DIRECTIVES {
            continue;
        }
        let keyed = node
            .children()
            .filter_map(cst::Directive::cast)
            .filter(is_idempotent)
            .count();
        if keyed > 1 {
            return Err(NotPlanned::Misplaced(format!(
                "twice on {}",
                describe_target(&node)
            )));
        }
        if keyed == 1
            && let Some(place) = misplacement(&node)
        {
            return Err(NotPlanned::Misplaced(place));
        }
    }
    Ok(())
}

/// Whether `directive` is `@idempotent`.
pub(super) fn is_idempotent(directive: &cst::Directive) -> bool {
    directive.name().is_some_and(|name| name.text() == IDEMPOTENT)
}

/// Where the `directives` holding an `@idempotent` are, when that is not on a mutation's root field.
fn misplacement(directives: &SyntaxNode) -> Option<String> {
    let target = directives.parent()?;
    if target.kind() != SyntaxKind::FIELD {
        return Some(format!(
            "on {}: it goes on a mutation's root field",
            describe_target(directives)
        ));
    }
    let owner = target.parent().and_then(|set| set.parent())?;
    let field = describe_target(directives);
    match owner.kind() {
        SyntaxKind::OPERATION_DEFINITION => {
            let operation = cst::OperationDefinition::cast(owner)?;
            (!is_mutation(&operation)).then(|| format!("on {field} of a query or subscription"))
        }
        SyntaxKind::FRAGMENT_DEFINITION => Some(format!("on {field} in a fragment: write the field out")),
        _ => Some(format!(
            "on the nested {field}: it goes on a mutation's root field"
        )),
    }
}

/// What the `directives` node is attached to, in words.
fn describe_target(directives: &SyntaxNode) -> String {
    let Some(target) = directives.parent() else {
        return "the document".into();
    };
    match target.kind() {
        SyntaxKind::FIELD => cst::Field::cast(target)
            .and_then(|field| field.name())
            .map_or_else(|| "a field".into(), |name| format!("field `{}`", name.text())),
        SyntaxKind::OPERATION_DEFINITION => "an operation".into(),
        SyntaxKind::FRAGMENT_DEFINITION => "a fragment definition".into(),
        SyntaxKind::FRAGMENT_SPREAD => "a fragment spread".into(),
        SyntaxKind::INLINE_FRAGMENT => "an inline fragment".into(),
        SyntaxKind::VARIABLE_DEFINITION => "a variable definition".into(),
        _ => "something other than a field".into(),
    }
}

/// The root fields of `operation` when it is a mutation with at least one `@idempotent` root field (its
/// placement already checked); `None` when it is not one.
pub(super) fn keyed_fields(
    operation: &cst::OperationDefinition,
) -> Result<Option<Vec<RootField>>, NotPlanned> {
    let Some(selections) = operation.selection_set().filter(|_| is_mutation(operation)) else {
        return Ok(None);
    };
    let directives = |field: &cst::Field| field.directives().into_iter().flat_map(|d| d.directives());
    let keyed = selections.selections().any(|selection| match selection {
        cst::Selection::Field(field) => directives(&field).any(|d| is_idempotent(&d)),
        _ => false,
    });
    if !keyed {
        return Ok(None);
    }
    if selections.selections().count() > MAX_PARTS {
        return Err(NotPlanned::OverLimit(format!(
            "more than {MAX_PARTS} root fields in a keyed mutation"
        )));
    }
    let mut fields: Vec<RootField> = Vec::new();
    for selection in selections.selections() {
        let cst::Selection::Field(field) = selection else {
            return Err(NotPlanned::Unsplittable(
                "a fragment among its root fields: write them out".into(),
            ));
        };
        let response_key = response_key(&field);
        if fields.iter().any(|seen| seen.response_key == response_key) {
            return Err(NotPlanned::Unsplittable(format!(
                "two root fields answer as `{response_key}`"
            )));
        }
        let directive = directives(&field).find(is_idempotent);
        fields.push(RootField {
            field,
            response_key,
            directive,
        });
    }
    Ok(Some(fields))
}

/// A field's alias, else its name.
fn response_key(field: &cst::Field) -> String {
    let name = field
        .alias()
        .and_then(|alias| alias.name())
        .or_else(|| field.name());
    name.map(|name| name.text().to_string()).unwrap_or_default()
}
