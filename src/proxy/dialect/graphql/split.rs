//! Splits a keyed mutation into parts, one per root field, by cutting ranges out of the client's text: the
//! `@idempotent` directive, the other root fields, and the declarations of variables the part does not
//! use; then the fragments it spreads (transitively) follow, each as written, in document order. What is
//! not cut is the client's text byte for byte. Also reads each keyed field's key.

use std::collections::{HashMap, HashSet};

use apollo_parser::cst::{self, CstNode};
use apollo_parser::{SyntaxKind, SyntaxNode, TextRange};

use super::body::Body;
use super::document::RootField;
use super::{NotPlanned, Part, canonical};

/// A fragment definition as the parts need it.
struct Fragment {
    name: String,
    range: TextRange,
    /// The fragments it spreads itself.
    spreads: Vec<String>,
    /// The variables it uses.
    variables: Vec<String>,
}

/// A variable declaration of the operation.
struct Declaration {
    name: String,
    range: TextRange,
    default: Option<cst::Value>,
}

/// What every part of one operation shares: the text, the fragments, the declarations.
pub(super) struct Splitter<'a> {
    body: &'a Body<'a>,
    operation: cst::OperationDefinition,
    fragments: Vec<Fragment>,
    /// Where each fragment name is defined in `fragments` (twice when the client defined it twice).
    by_name: HashMap<String, Vec<usize>>,
    declarations: Vec<Declaration>,
    /// The variables the operation's own directives use: every part keeps them.
    operation_variables: HashSet<String>,
    /// The root fields, each cut from the parts it is not.
    root_ranges: Vec<TextRange>,
}

impl<'a> Splitter<'a> {
    /// Reads the fragments of `doc` and the declarations of `operation`, whose root fields are `fields`.
    pub(super) fn new(
        doc: &cst::Document,
        operation: &cst::OperationDefinition,
        fields: &[RootField],
        body: &'a Body<'a>,
    ) -> Splitter<'a> {
        let fragments: Vec<Fragment> = doc
            .definitions()
            .filter_map(|definition| match definition {
                cst::Definition::FragmentDefinition(fragment) => Some(Fragment::read(&fragment)),
                _ => None,
            })
            .collect();
        let mut by_name: HashMap<String, Vec<usize>> = HashMap::new();
        for (i, fragment) in fragments.iter().enumerate() {
            by_name.entry(fragment.name.clone()).or_default().push(i);
        }
        let declarations = operation
            .variable_definitions()
            .into_iter()
            .flat_map(|definitions| definitions.variable_definitions())
            .map(|definition| Declaration {
                name: definition
                    .variable()
                    .map(|v| v.text().to_string())
                    .unwrap_or_default(),
                range: definition.syntax().text_range(),
                default: definition.default_value().and_then(|d| d.value()),
            })
            .collect();
        let operation_variables = operation
            .directives()
            .map(|directives| variables_in(directives.syntax(), None))
            .unwrap_or_default();
        Splitter {
            body,
            operation: operation.clone(),
            fragments,
            by_name,
            declarations,
            operation_variables,
            root_ranges: fields.iter().map(|f| f.field.syntax().text_range()).collect(),
        }
    }

    /// The part of one root field.
    pub(super) fn part(&self, root: &RootField) -> Result<Part, NotPlanned> {
        let key = match &root.directive {
            Some(directive) => Some(self.key(directive, &root.response_key)?),
            None => None,
        };
        let skipped = root.directive.as_ref().map(|d| d.syntax().text_range());
        let fragments = self.closure(&spreads_in(root.field.syntax()));
        let mut used = variables_in(root.field.syntax(), skipped);
        used.extend(self.operation_variables.iter().cloned());
        for fragment in &fragments {
            used.extend(fragment.variables.iter().cloned());
        }
        let kept: HashSet<&str> = (self.declarations.iter())
            .filter(|d| used.contains(&d.name))
            .map(|d| d.name.as_str())
            .collect();
        let field = root.field.syntax().text_range();
        let document = self.document(field, skipped, &kept, &fragments);
        let variables: Vec<_> = (self.body.variables.0.iter())
            .filter(|(name, _)| kept.contains(&name.as_str()))
            .map(|(name, value)| (name.as_str(), *value))
            .collect();
        let operation_name = self.body.operation_name.as_deref();
        Ok(Part {
            body: self.body.with(&document, &kept),
            response_key: root.response_key.clone(),
            key,
            fingerprint: canonical::fingerprint(&document, operation_name, &variables),
        })
    }

    /// The part's document: the operation without the other root fields, the directive (`skipped`) and
    /// the declarations not `kept`, then `fragments`, in document order.
    fn document(
        &self,
        field: TextRange,
        skipped: Option<TextRange>,
        kept: &HashSet<&str>,
        fragments: &[&Fragment],
    ) -> String {
        let mut cuts: Vec<TextRange> = self.root_ranges.iter().copied().filter(|r| *r != field).collect();
        cuts.extend(skipped);
        let unused: Vec<TextRange> = (self.declarations.iter())
            .filter(|d| !kept.contains(&d.name.as_str()))
            .map(|d| d.range)
            .collect();
        match self.operation.variable_definitions() {
            Some(all) if unused.len() == self.declarations.len() => cuts.push(all.syntax().text_range()),
            _ => cuts.extend(unused),
        }
        let query = self.body.query.as_str();
        let operation = self.operation.syntax().text_range();
        let mut definitions = vec![(operation.start(), splice(query, operation, cuts))];
        for fragment in fragments {
            definitions.push((fragment.range.start(), query[fragment.range].to_owned()));
        }
        definitions.sort_by_key(|(start, _)| *start);
        let texts: Vec<String> = definitions.into_iter().map(|(_, text)| text).collect();
        texts.join("\n")
    }

    /// The fragments `spreads` names, and those they spread, transitively; in document order. Every
    /// definition of a name is taken (a document that defines one twice is refused upstream as it was).
    fn closure(&self, spreads: &[String]) -> Vec<&Fragment> {
        let mut taken = vec![false; self.fragments.len()];
        let mut pending: Vec<&str> = spreads.iter().map(String::as_str).collect();
        while let Some(name) = pending.pop() {
            for &i in self.by_name.get(name).into_iter().flatten() {
                if !std::mem::replace(&mut taken[i], true) {
                    pending.extend(self.fragments[i].spreads.iter().map(String::as_str));
                }
            }
        }
        (self.fragments.iter().zip(taken))
            .filter_map(|(fragment, taken)| taken.then_some(fragment))
            .collect()
    }

    /// The key `directive` gives the field `field`: its `key` argument, a non-empty string literal or a
    /// variable whose value (or, without one, whose default) is a non-empty string.
    fn key(&self, directive: &cst::Directive, field: &str) -> Result<String, NotPlanned> {
        let invalid = |why: &str| NotPlanned::InvalidKey {
            field: field.to_owned(),
            why: why.to_owned(),
        };
        let arguments: Vec<cst::Argument> = directive
            .arguments()
            .into_iter()
            .flat_map(|a| a.arguments())
            .collect();
        if arguments
            .iter()
            .any(|a| a.name().is_none_or(|n| n.text() != "key"))
        {
            return Err(invalid("@idempotent takes only `key`"));
        }
        let [argument] = arguments.as_slice() else {
            let why = if arguments.is_empty() {
                "no `key` argument"
            } else {
                "`key` given twice"
            };
            return Err(invalid(why));
        };
        let key = match argument.value() {
            Some(cst::Value::StringValue(text)) => String::from(text),
            Some(cst::Value::Variable(variable)) => {
                self.variable_key(&variable.text()).map_err(|why| invalid(&why))?
            }
            _ => return Err(invalid("`key` is not a string")),
        };
        if key.is_empty() {
            return Err(invalid("`key` is empty"));
        }
        Ok(key)
    }

    /// The string value of the variable `name`, from `variables`, else from its default.
    fn variable_key(&self, name: &str) -> Result<String, String> {
        let Some(declaration) = self.declarations.iter().find(|d| d.name == name) else {
            return Err(format!("`${name}` is not declared"));
        };
        if let Some((_, value)) = self.body.variables.0.iter().find(|(n, _)| n == name) {
            return serde_json::from_str(value.get()).map_err(|_| format!("`${name}` is not a string"));
        }
        match &declaration.default {
            Some(cst::Value::StringValue(text)) => Ok(String::from(text)),
            Some(_) => Err(format!("`${name}` is not a string")),
            None => Err(format!("`${name}` has no value")),
        }
    }
}

impl Fragment {
    fn read(fragment: &cst::FragmentDefinition) -> Fragment {
        let name = fragment.fragment_name().and_then(|n| n.name());
        Fragment {
            name: name.map(|n| n.text().to_string()).unwrap_or_default(),
            range: fragment.syntax().text_range(),
            spreads: spreads_in(fragment.syntax()),
            variables: variables_in(fragment.syntax(), None).into_iter().collect(),
        }
    }
}

/// The names of the fragments spread under `node`.
fn spreads_in(node: &SyntaxNode) -> Vec<String> {
    node.descendants()
        .filter_map(cst::FragmentSpread::cast)
        .filter_map(|spread| spread.fragment_name()?.name())
        .map(|name| name.text().to_string())
        .collect()
}

/// The names of the variables used under `node`, but those within `skipped`.
fn variables_in(node: &SyntaxNode, skipped: Option<TextRange>) -> HashSet<String> {
    node.descendants()
        .filter(|n| n.kind() == SyntaxKind::VARIABLE)
        .filter(|n| skipped.is_none_or(|s| !s.contains_range(n.text_range())))
        .filter_map(cst::Variable::cast)
        .map(|variable| variable.text().to_string())
        .collect()
}

/// `text[within]` without the ranges `cuts` (a cut inside an earlier one is already gone).
fn splice(text: &str, within: TextRange, mut cuts: Vec<TextRange>) -> String {
    cuts.sort_by_key(|cut| cut.start());
    let mut out = String::with_capacity(usize::from(within.len()));
    let mut at = within.start();
    for cut in cuts {
        if cut.start() < at {
            continue;
        }
        out.push_str(&text[TextRange::new(at, cut.start())]);
        at = cut.end();
    }
    out.push_str(&text[TextRange::new(at, within.end())]);
    out
}
