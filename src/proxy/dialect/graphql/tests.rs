use apollo_parser::Parser;
use apollo_parser::cst::{self, CstNode};
use proptest::prelude::*;
use serde_json::{Value, json};

use super::*;

/// A GraphQL-over-HTTP body.
fn body(query: &str, variables: Value) -> Vec<u8> {
    serde_json::to_vec(&json!({ "query": query, "variables": variables })).unwrap()
}

fn named(query: &str, name: &str, variables: Value) -> Vec<u8> {
    serde_json::to_vec(&json!({ "query": query, "operationName": name, "variables": variables })).unwrap()
}

/// The parts of a keyed request, each checked: its document parses again, holds no `@idempotent`, and
/// declares only variables it uses and spreads every fragment it holds.
fn parts(request: &[u8]) -> Vec<Part> {
    match plan(request) {
        Ok(Plan::Keyed(parts)) => {
            for part in &parts {
                check_part(part);
            }
            parts
        }
        other => panic!("not keyed: {other:?}"),
    }
}

fn check_part(part: &Part) {
    let document = query(part);
    let tree = Parser::new(&document).parse();
    assert_eq!(tree.errors().count(), 0, "{document}");
    let doc = tree.document();
    let mut directives = doc.syntax().descendants().filter_map(cst::Directive::cast);
    assert!(!directives.any(|d| document::is_idempotent(&d)), "{document}");
    let operations = doc
        .definitions()
        .filter(|d| matches!(d, cst::Definition::OperationDefinition(_)))
        .count();
    assert_eq!(operations, 1, "{document}");
    check_unused(&doc, &document);
    if let Value::Object(variables) = sent_variables(part) {
        let declared = names::<cst::VariableDefinition>(&doc, |d| d.variable().map(|v| v.text().to_string()));
        assert!(
            variables.keys().all(|name| declared.contains(name)),
            "{document} {variables:?}"
        );
    }
}

/// The sorted, distinct names `name` gives the nodes of type `N` in `doc`.
fn names<N: CstNode>(doc: &cst::Document, name: impl Fn(N) -> Option<String>) -> Vec<String> {
    let mut names: Vec<String> = doc
        .syntax()
        .descendants()
        .filter_map(N::cast)
        .filter_map(name)
        .collect();
    names.sort();
    names.dedup();
    names
}

/// Checks what GraphQL's validation refuses a part for: a variable declared and not used (or used and not
/// declared), a fragment defined and not spread.
fn check_unused(doc: &cst::Document, document: &str) {
    let declared = names::<cst::VariableDefinition>(doc, |d| d.variable().map(|v| v.text().to_string()));
    let used = names::<cst::Variable>(doc, |v| {
        let declaration = v.syntax().parent()?.kind() == apollo_parser::SyntaxKind::VARIABLE_DEFINITION;
        (!declaration).then(|| v.text().to_string())
    });
    assert_eq!(declared, used, "every declared variable is used: {document}");
    let fragment_name = |name: Option<cst::FragmentName>| name?.name().map(|n| n.text().to_string());
    let defined = names::<cst::FragmentDefinition>(doc, |f| fragment_name(f.fragment_name()));
    let spread = names::<cst::FragmentSpread>(doc, |f| fragment_name(f.fragment_name()));
    assert_eq!(defined, spread, "every fragment held is spread: {document}");
}

/// The document of a part.
fn query(part: &Part) -> String {
    let body: Value = serde_json::from_slice(&part.body).unwrap();
    body["query"].as_str().unwrap().to_owned()
}

fn sent_variables(part: &Part) -> Value {
    serde_json::from_slice::<Value>(&part.body).unwrap()["variables"].clone()
}

fn keys(parts: &[Part]) -> Vec<(&str, Option<&str>)> {
    parts
        .iter()
        .map(|part| (part.response_key.as_str(), part.key.as_deref()))
        .collect()
}

fn refused(request: &[u8]) -> NotPlanned {
    match plan(request) {
        Err(refusal) => refusal,
        Ok(plan) => panic!("planned: {plan:?}"),
    }
}

fn is_misplaced(refusal: &NotPlanned) -> bool {
    matches!(refusal, NotPlanned::Misplaced(_))
}

#[test]
fn one_keyed_field_is_the_operation_without_its_directive() {
    let text = "mutation Pay {\n  pay(amount: 5) @idempotent(key: \"k1\") { id }\n}";
    let parts = parts(&body(text, json!({})));
    assert_eq!(keys(&parts), [("pay", Some("k1"))]);
    assert_eq!(query(&parts[0]), "mutation Pay {\n  pay(amount: 5)  { id }\n}");
    assert_eq!(sent_variables(&parts[0]), json!({}));
}

#[test]
fn a_variable_only_the_directive_uses_loses_its_declaration() {
    let text = "mutation($k: String!, $input: PayInput!) { pay(input: $input) @idempotent(key: $k) { id } }";
    let parts = parts(&body(text, json!({"k": "key-7", "input": {"amount": 5}})));
    assert_eq!(keys(&parts), [("pay", Some("key-7"))]);
    let document = query(&parts[0]);
    assert!(!document.contains("$k"), "{document}");
    assert!(document.contains("$input: PayInput!"), "{document}");
    assert_eq!(sent_variables(&parts[0]), json!({"input": {"amount": 5}}));
}

#[test]
fn a_variable_the_field_uses_too_is_kept() {
    let text = "mutation($k: String!) { pay(reference: $k) @idempotent(key: $k) { id } }";
    let parts = parts(&body(text, json!({"k": "r1"})));
    assert_eq!(
        query(&parts[0]),
        "mutation($k: String!) { pay(reference: $k)  { id } }"
    );
    assert_eq!(sent_variables(&parts[0]), json!({"k": "r1"}));
}

#[test]
fn the_only_declaration_going_takes_its_parentheses() {
    let text = "mutation M($k: String!) { pay @idempotent(key: $k) }";
    let parts = parts(&body(text, json!({"k": "r1"})));
    assert_eq!(query(&parts[0]), "mutation M { pay  }");
    assert_eq!(sent_variables(&parts[0]), json!({}));
}

#[test]
fn a_variable_key_takes_its_default_and_refuses_null_absent_and_other_types() {
    let text = "mutation($k: String = \"dflt\") { pay @idempotent(key: $k) }";
    assert_eq!(keys(&parts(&body(text, json!({})))), [("pay", Some("dflt"))]);
    assert_eq!(
        keys(&parts(&body(text, json!({"k": "given"})))),
        [("pay", Some("given"))]
    );
    let invalid = |request: Vec<u8>| matches!(refused(&request), NotPlanned::InvalidKey { field, .. } if field == "pay");
    assert!(
        invalid(body(text, json!({"k": null}))),
        "an explicit null overrides the default"
    );
    assert!(invalid(body(text, json!({"k": ""}))));
    assert!(invalid(body(text, json!({"k": 7}))));
    assert!(invalid(body(text, json!({"k": ["a"]}))));
    let without_default = "mutation($k: String) { pay @idempotent(key: $k) }";
    assert!(invalid(body(without_default, json!({}))));
    assert!(invalid(body(without_default, Value::Null)));
    let undeclared = "mutation { pay @idempotent(key: $k) }";
    assert!(invalid(body(undeclared, json!({"k": "x"}))));
    let number_default = "mutation($k: Int = 4) { pay @idempotent(key: $k) }";
    assert!(invalid(body(number_default, json!({}))));
}

#[test]
fn a_literal_key_must_be_a_non_empty_string_given_once_alone() {
    for directive in [
        "@idempotent",
        "@idempotent(key: 5)",
        "@idempotent(key: KEY)",
        "@idempotent(key: \"\")",
        "@idempotent(key: \"\"\"\"\"\")",
        "@idempotent(key: null)",
        "@idempotent(key: [\"a\"])",
        "@idempotent(key: \"a\", key: \"b\")",
        "@idempotent(key: \"a\", ttl: 5)",
        "@idempotent(id: \"a\")",
    ] {
        let request = body(&format!("mutation {{ pay {directive} }}"), json!({}));
        assert!(
            matches!(refused(&request), NotPlanned::InvalidKey { .. }),
            "{directive}"
        );
    }
    let block = body(
        "mutation { pay @idempotent(key: \"\"\"\n   k\u{e9}y\n\"\"\") }",
        json!({}),
    );
    assert_eq!(keys(&parts(&block)), [("pay", Some("k\u{e9}y"))]);
    let escaped = body(r#"mutation { pay @idempotent(key: "a\u0041\n") }"#, json!({}));
    assert_eq!(keys(&parts(&escaped)), [("pay", Some("aA\n"))]);
}

#[test]
fn odd_escapes_in_a_key_are_read_or_refused_never_a_panic() {
    for key in [
        r#""\u{1F600}""#,
        r#""\u{FFFFFFFFFFFFFFFF}""#,
        r#""\u{110000}""#,
        r#""\u{}""#,
        r#""\uD83D\uDE00""#,
        r#""\uD83D""#,
        r#""\uDE00x""#,
        r#""\u00""#,
    ] {
        let request = body(&format!("mutation {{ pay @idempotent(key: {key}) }}"), json!({}));
        let _ = plan(&request);
        let default = body(
            &format!("mutation($k: String = {key}) {{ pay @idempotent(key: $k) }}"),
            json!({}),
        );
        let _ = plan(&default);
    }
    let smiley = body(r#"mutation { pay @idempotent(key: "\uD83D\uDE00") }"#, json!({}));
    assert_eq!(keys(&parts(&smiley)), [("pay", Some("\u{1F600}"))]);
}

#[test]
fn aliases_answer_as_the_response_key() {
    let text = "mutation { first: pay(n: 1) @idempotent(key: \"a\") { id } second: pay(n: 2) @idempotent(key: \"b\") { id } }";
    let parts = parts(&body(text, json!({})));
    assert_eq!(keys(&parts), [("first", Some("a")), ("second", Some("b"))]);
    assert_eq!(query(&parts[0]), "mutation { first: pay(n: 1)  { id }  }");
    assert_eq!(query(&parts[1]), "mutation {  second: pay(n: 2)  { id } }");
}

#[test]
fn several_keyed_fields_split_in_document_order_with_the_fragments_each_spreads() {
    let text = r#"
mutation Checkout($cart: ID!, $k1: String!, $k2: String!, $note: String, $unused: Int) {
  order: createOrder(cart: $cart) @idempotent(key: $k1) { ...OrderFields }
  charge(cart: $cart, note: $note) @idempotent(key: $k2) { ...ChargeFields ...Money }
}
fragment Unused on Order { id }
fragment OrderFields on Order { id total { ...Money } }
fragment Money on Price { amount currency }
fragment ChargeFields on Charge { id status }
"#;
    let variables = json!({"cart": "c1", "k1": "o-1", "k2": "c-1", "note": "hi", "unused": 3, "stray": 1});
    let parts = parts(&named(text, "Checkout", variables));
    assert_eq!(keys(&parts), [("order", Some("o-1")), ("charge", Some("c-1"))]);
    let order = query(&parts[0]);
    assert_eq!(
        order,
        "mutation Checkout($cart: ID!, , , , ) {\n  order: createOrder(cart: $cart)  { ...OrderFields }\n  \n}\n\
         fragment OrderFields on Order { id total { ...Money } }\n\
         fragment Money on Price { amount currency }"
    );
    assert!(order.contains("fragment OrderFields") && order.contains("fragment Money"));
    assert!(!order.contains("ChargeFields") && !order.contains("Unused") && !order.contains("$note"));
    assert_eq!(sent_variables(&parts[0]), json!({"cart": "c1"}));
    let charge = query(&parts[1]);
    assert!(charge.contains("fragment ChargeFields") && charge.contains("fragment Money"));
    assert!(!charge.contains("OrderFields") && !charge.contains("createOrder"));
    assert!(charge.contains("$note: String") && !charge.contains("$unused"));
    assert_eq!(sent_variables(&parts[1]), json!({"cart": "c1", "note": "hi"}));
    let body: Value = serde_json::from_slice(&parts[1].body).unwrap();
    assert_eq!(body["operationName"], "Checkout");
}

#[test]
fn a_fragment_cycle_ends() {
    let text = "mutation { a @idempotent(key: \"a\") { ...A } }\nfragment A on T { x ...B }\nfragment B on T { y ...A }";
    let parts = parts(&body(text, json!({})));
    let document = query(&parts[0]);
    assert!(document.contains("fragment A") && document.contains("fragment B"));
}

#[test]
fn an_unkeyed_root_field_beside_keyed_ones_is_a_part_of_its_own_without_a_key() {
    let text = "mutation { log(msg: \"x\") { ok } pay @idempotent(key: \"p\") { id } audit }";
    let parts = parts(&body(text, json!({})));
    assert_eq!(keys(&parts), [("log", None), ("pay", Some("p")), ("audit", None)]);
    assert_eq!(query(&parts[0]), "mutation { log(msg: \"x\") { ok }   }");
    assert_eq!(query(&parts[2]), "mutation {   audit }");
}

#[test]
fn other_directives_and_their_variables_are_kept() {
    let text = "mutation M($c: Boolean!, $k: String!, $t: String) @trace(id: $t) {\n  pay @include(if: $c) @idempotent(key: $k) @deprecated { id @skip(if: $c) }\n}";
    let parts = parts(&body(text, json!({"c": true, "k": "k", "t": "trace-1"})));
    let document = query(&parts[0]);
    assert_eq!(
        document,
        "mutation M($c: Boolean!, , $t: String) @trace(id: $t) {\n  pay @include(if: $c)  @deprecated { id @skip(if: $c) }\n}"
    );
    assert_eq!(sent_variables(&parts[0]), json!({"c": true, "t": "trace-1"}));
}

#[test]
fn the_operation_is_picked_by_name_and_the_others_are_dropped() {
    let text = "query Q { me { id } }\nmutation A { a @idempotent(key: \"a\") }\nmutation B { b @idempotent(key: \"b\") }";
    let parts = parts(&named(text, "B", json!({})));
    assert_eq!(keys(&parts), [("b", Some("b"))]);
    assert_eq!(query(&parts[0]), "mutation B { b  }");
    assert_eq!(plan(&named(text, "Q", json!({}))), Ok(Plan::PassThrough));
    let unknown = refused(&named(text, "C", json!({})));
    assert!(matches!(unknown, NotPlanned::NoOperation(_)) && unknown.is_unparseable());
    let ambiguous = refused(&body(text, json!({})));
    assert!(matches!(ambiguous, NotPlanned::NoOperation(_)) && ambiguous.is_unparseable());
    assert!(refused(&body("fragment F on T { a }", json!({}))).is_unparseable());
}

#[test]
fn queries_subscriptions_and_plain_mutations_pass_through() {
    for text in [
        "{ me { id } }",
        "query { me { id } }",
        "subscription { paid { id } }",
        "query($k: String = \"@idempotent(key: \\\"x\\\")\") { search(q: \"\"\"@idempotent(key: \"k\")\"\"\") }",
    ] {
        assert_eq!(plan(&body(text, json!({}))), Ok(Plan::PassThrough), "{text}");
    }
    for text in [
        "mutation { pay { id } }",
        "mutation { pay @include(if: true) { id } }",
        "mutation { note(text: \"\"\"\n  mutation { pay @idempotent(key: \"k\") }\n\"\"\") }",
        "mutation { pay # @idempotent(key: \"k\")\n }",
    ] {
        assert_eq!(plan(&body(text, json!({}))), Ok(Plan::Unkeyed), "{text}");
    }
}

#[test]
fn directive_text_in_strings_and_comments_is_not_a_directive() {
    let text = "mutation {\n  # not this: @idempotent(key: \"comment\")\n  pay(memo: \"\"\"@idempotent(key: \"block\")\"\"\", note: \"@idempotent(key: \\\"s\\\")\") @idempotent(key: \"real\") { id }\n}";
    let parts = parts(&body(text, json!({})));
    assert_eq!(keys(&parts), [("pay", Some("real"))]);
    let document = query(&parts[0]);
    assert!(document.contains("# not this: @idempotent(key: \"comment\")"));
    assert!(document.contains("\"\"\"@idempotent(key: \"block\")\"\"\""));
    assert!(document.contains("@idempotent(key: \\\"s\\\")"));
    assert!(!document.contains("\"real\""));
}

#[test]
fn comments_odd_whitespace_and_unicode_are_kept_as_written() {
    let text = "\u{feff}# lead\r\nmutation\t,Pay , ( $k :String! ,, $x: Int) {\r\n\tpay ( x : $x , emoji: \"\u{1F600} caf\u{e9} \\u00e9\" ) # trailing\r\n @idempotent ( key : $k ) ,{ id } }";
    let parts = parts(&body(text, json!({"k": "\u{1F600}", "x": 1})));
    assert_eq!(keys(&parts), [("pay", Some("\u{1F600}"))]);
    let document = query(&parts[0]);
    assert!(document.contains("pay ( x : $x , emoji: \"\u{1F600} caf\u{e9} \\u00e9\" ) # trailing\r\n"));
    assert!(document.contains("$x: Int"));
    assert!(!document.contains("$k"));
}

#[test]
fn misplaced_directives_are_refused_in_any_operation_and_fragment() {
    for text in [
        "query { me @idempotent(key: \"k\") { id } }",
        "{ me @idempotent(key: \"k\") }",
        "subscription { paid @idempotent(key: \"k\") { id } }",
        "mutation { pay { id @idempotent(key: \"k\") } }",
        "mutation { pay { ... on Paid { id @idempotent(key: \"k\") } } }",
        "mutation { ...F }\nfragment F on Mutation { pay @idempotent(key: \"k\") }",
        "mutation { pay { ...F @idempotent(key: \"k\") } }\nfragment F on P { id }",
        "mutation { ... on Mutation @idempotent(key: \"k\") { pay } }",
        "mutation @idempotent(key: \"k\") { pay }",
        "mutation($v: Int @idempotent(key: \"k\")) { pay(v: $v) }",
        "fragment F on P @idempotent(key: \"k\") { id }\nmutation { pay { ...F } }",
        "mutation { pay @idempotent(key: \"a\") @idempotent(key: \"b\") }",
        "mutation A { pay }\nquery B { me @idempotent(key: \"k\") }",
    ] {
        let refusal = refused(&body(text, json!({})));
        assert!(is_misplaced(&refusal), "{text}: {refusal}");
        assert!(!refusal.is_unparseable());
    }
}

#[test]
fn a_keyed_mutation_whose_fields_cannot_be_told_apart_is_refused() {
    for text in [
        "mutation { pay @idempotent(key: \"a\") ...F }\nfragment F on Mutation { log }",
        "mutation { pay @idempotent(key: \"a\") ... on Mutation { log } }",
        "mutation { pay @idempotent(key: \"a\") pay }",
        "mutation { x: pay @idempotent(key: \"a\") x: log }",
        "mutation { a: pay @idempotent(key: \"same\") b: pay @idempotent(key: \"same\") }",
    ] {
        let refusal = refused(&body(text, json!({})));
        assert!(
            matches!(refusal, NotPlanned::Unsplittable(_)),
            "{text}: {refusal}"
        );
    }
}

#[test]
fn what_is_not_a_graphql_request_is_unparseable() {
    for request in [
        &b"not json"[..],
        b"[1]",
        b"{}",
        b"{\"query\": null}",
        b"{\"query\": 5}",
        b"{\"query\": \"mutation { pay }\", \"query\": \"query { me }\"}",
        b"{\"query\": \"mutation { pay }\", \"operationName\": 5}",
        b"{\"query\": \"mutation { pay }\", \"variables\": [1]}",
        b"{\"query\": \"mutation { pay }\", \"variables\": {\"a\": 1, \"a\": 2}}",
        b"{\"query\": \"mutation { pay @idempotent(key: \\\"k\\\") \"}",
        b"{\"query\": \"mutation { pay @idempotent(key: \\\"k) }\"}",
        b"{\"query\": \"mutation { pay(x: \\\"\\\\q\\\") @idempotent(key: \\\"k\\\") }\"}",
        b"{\"query\": \"type Mutation { pay: ID }\\nmutation { pay @idempotent(key: \\\"k\\\") }\"}",
        b"{\"query\": \"\"}",
        b"{\"query\": \"mutation { pay @idempotent() }\"}",
        b"{\"extensions\": {\"persistedQuery\": {\"version\": 1, \"sha256Hash\": \"ab\"}}}",
    ] {
        let refusal = refused(request);
        assert!(
            matches!(refusal, NotPlanned::Unparseable(_)),
            "{}: {refusal}",
            String::from_utf8_lossy(request)
        );
        assert!(refusal.is_unparseable());
    }
}

#[test]
fn a_depth_bomb_is_over_the_limit_not_a_crash() {
    let deep = format!(
        "mutation {{ pay @idempotent(key: \"k\") {} {} }}",
        "{ a ".repeat(100_000),
        "}".repeat(100_000)
    );
    assert!(matches!(
        refused(&body(&deep, json!({}))),
        NotPlanned::OverLimit(_)
    ));
    let list = format!(
        "mutation {{ pay(x: {}1{}) @idempotent(key: \"k\") }}",
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    assert!(matches!(
        refused(&body(&list, json!({}))),
        NotPlanned::OverLimit(_)
    ));
    let object = format!(
        "query {{ me(x: {}1{}) }}",
        "{a: ".repeat(10_000),
        "}".repeat(10_000)
    );
    assert!(matches!(
        refused(&body(&object, json!({}))),
        NotPlanned::OverLimit(_)
    ));
    let just_under = format!(
        "mutation {{ pay @idempotent(key: \"k\") {} id {} }}",
        "{ a ".repeat(MAX_DEPTH - 2),
        "}".repeat(MAX_DEPTH - 2)
    );
    assert_eq!(parts(&body(&just_under, json!({}))).len(), 1);
}

/// graphql-js's `getIntrospectionQuery()`, among the deepest documents in common use.
const INTROSPECTION: &str = r#"
query IntrospectionQuery {
  __schema {
    queryType { name } mutationType { name } subscriptionType { name }
    types { ...FullType }
    directives { name description locations args { ...InputValue } }
  }
}
fragment FullType on __Type {
  kind name description
  fields(includeDeprecated: true) {
    name description args { ...InputValue } type { ...TypeRef } isDeprecated deprecationReason
  }
  inputFields { ...InputValue }
  interfaces { ...TypeRef }
  enumValues(includeDeprecated: true) { name description isDeprecated deprecationReason }
  possibleTypes { ...TypeRef }
}
fragment InputValue on __InputValue { name description type { ...TypeRef } defaultValue }
fragment TypeRef on __Type {
  kind name
  ofType { kind name ofType { kind name ofType { kind name ofType { kind name ofType { kind name
    ofType { kind name ofType { kind name ofType { kind name } } } } } } } }
}
"#;

#[test]
fn the_introspection_query_is_well_within_the_depth_limit() {
    assert_eq!(plan(&body(INTROSPECTION, json!({}))), Ok(Plan::PassThrough));
    let high = Parser::new(INTROSPECTION).parse().recursion_limit().high;
    assert!(high * 4 <= MAX_DEPTH, "{high}");
}

#[test]
fn plans_and_refusals_may_cross_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Plan>();
    send_sync::<NotPlanned>();
}

#[test]
fn ten_thousand_fields_are_read_within_the_limits() {
    let fields: String = (0..10_000).map(|i| format!("f{i} ")).collect();
    let query = format!("query {{ {fields} }}");
    assert_eq!(plan(&body(&query, json!({}))), Ok(Plan::PassThrough));
    let wide = format!("mutation {{ pay @idempotent(key: \"k\") {{ {fields} }} }}");
    let parts = parts(&body(&wide, json!({})));
    assert_eq!(parts.len(), 1);
    assert!(query_of_len(&parts[0]) > 50_000);
    let roots = format!("mutation {{ pay @idempotent(key: \"k\") {fields} }}");
    assert!(matches!(
        refused(&body(&roots, json!({}))),
        NotPlanned::OverLimit(_)
    ));
    let unkeyed = format!("mutation {{ {fields} }}");
    assert_eq!(plan(&body(&unkeyed, json!({}))), Ok(Plan::Unkeyed));
    let tokens = format!("query {{ {} }}", "a ".repeat(MAX_TOKENS));
    assert!(matches!(
        refused(&body(&tokens, json!({}))),
        NotPlanned::OverLimit(_)
    ));
}

fn query_of_len(part: &Part) -> usize {
    query(part).len()
}

#[test]
fn the_root_fields_and_fragments_are_bounded() {
    let roots: String = (0..MAX_PARTS)
        .map(|i| format!("f{i}: pay @idempotent(key: \"k{i}\") "))
        .collect();
    assert_eq!(
        parts(&body(&format!("mutation {{ {roots} }}"), json!({}))).len(),
        MAX_PARTS
    );
    let over = format!("mutation {{ {roots} extra }}");
    assert!(matches!(
        refused(&body(&over, json!({}))),
        NotPlanned::OverLimit(_)
    ));
    let fragments: String = (0..=MAX_FRAGMENTS)
        .map(|i| format!("fragment F{i} on T {{ a }}\n"))
        .collect();
    let many = format!("mutation {{ pay @idempotent(key: \"k\") {{ ...F0 }} }}\n{fragments}");
    assert!(matches!(
        refused(&body(&many, json!({}))),
        NotPlanned::OverLimit(_)
    ));
}

#[test]
fn parts_repeating_a_large_fragment_are_over_the_limit() {
    let fields: String = (0..20_000).map(|i| format!("f{i} ")).collect();
    let roots: String = (0..MAX_PARTS)
        .map(|i| format!("f{i}: pay @idempotent(key: \"k{i}\") {{ ...Big }} "))
        .collect();
    let text = format!("mutation {{ {roots} }}\nfragment Big on P {{ {fields} }}");
    assert!(matches!(
        refused(&body(&text, json!({}))),
        NotPlanned::OverLimit(_)
    ));
    let few: String = (0..4)
        .map(|i| format!("f{i}: pay @idempotent(key: \"k{i}\") {{ ...Big }} "))
        .collect();
    let text = format!("mutation {{ {few} }}\nfragment Big on P {{ {fields} }}");
    assert_eq!(parts(&body(&text, json!({}))).len(), 4);
}

#[test]
fn the_body_keeps_its_other_members_their_order_and_exact_values() {
    let request = br#"{"extensions":{"trace":true},"operationName":"Pay","variables":{"big":123456789012345678901234567890,"k":"x","d":1.50},"query":"mutation Pay($big: BigInt, $d: Decimal, $k: String!) { pay(a: $big, d: $d) @idempotent(key: $k) }","x-other":[1,2]}"#;
    let parts = parts(request);
    let expected = concat!(
        r#"{"extensions":{"trace":true},"operationName":"Pay","#,
        r#""variables":{"big":123456789012345678901234567890,"d":1.50},"#,
        r#""query":"mutation Pay($big: BigInt, $d: Decimal, ) { pay(a: $big, d: $d)  }","x-other":[1,2]}"#
    );
    assert_eq!(String::from_utf8(parts[0].body.clone()).unwrap(), expected);
}

#[test]
fn a_persisted_query_hash_of_the_whole_document_is_not_sent_with_a_part() {
    let request = br#"{"query":"mutation { a @idempotent(key: \"a\") b }","extensions":{"persistedQuery":{"version":1,"sha256Hash":"ab"},"trace":1}}"#;
    let parts = parts(request);
    assert!(String::from_utf8_lossy(&parts[0].body).ends_with(r#""extensions":{"trace":1}}"#));
}

#[test]
fn absent_or_null_variables_stay_so() {
    let text = "mutation { pay @idempotent(key: \"k\") }";
    let without = serde_json::to_vec(&json!({ "query": text })).unwrap();
    assert_eq!(parts(&without)[0].body, br#"{"query":"mutation { pay  }"}"#);
    let null = serde_json::to_vec(&json!({ "query": text, "variables": null })).unwrap();
    assert_eq!(
        parts(&null)[0].body,
        br#"{"query":"mutation { pay  }","variables":null}"#
    );
}

#[test]
fn the_fingerprint_ignores_layout_and_order_but_not_what_runs() {
    let fingerprint = |text: &str, variables: &str| {
        let request = format!(
            r#"{{"query": {}, "variables": {variables}, "extensions": {{"n": {}}}}}"#,
            json!(text),
            variables.len()
        );
        parts(request.as_bytes())[0].fingerprint.clone()
    };
    let base = fingerprint(
        "mutation($k: String!, $in: In) { pay(in: $in) @idempotent(key: $k) { id } }",
        r#"{"k": "a", "in": {"x": 1, "y": [1, 2.0]}}"#,
    );
    let same = [
        (
            "mutation ( $k:String! $in:In ) {\n  # retry\n  pay( in:$in ) @idempotent( key:$k ) { id, }\n}",
            r#"{"in":{"y":[1,2.0],"x":1},"k":"b"}"#,
        ),
        (
            "mutation($in: In, $k: String!) { pay(in: $in) @idempotent(key: $k) { id } }",
            r#"{"in": {"y": [1, 2.0], "x": 0, "x": 1}, "k": "a"}"#,
        ),
    ];
    for (text, variables) in same {
        assert_eq!(fingerprint(text, variables), base, "{text} {variables}");
    }
    let different = [
        (
            "mutation($k: String!, $in: In) { pay(in: $in) @idempotent(key: $k) { id } }",
            r#"{"k": "a", "in": {"x": 2, "y": [1, 2.0]}}"#,
        ),
        (
            "mutation($k: String!, $in: In) { pay(in: $in) @idempotent(key: $k) { id } }",
            r#"{"k": "a", "in": {"x": 1, "y": [1, 2]}}"#,
        ),
        (
            "mutation($k: String!, $in: In) { p: pay(in: $in) @idempotent(key: $k) { id } }",
            r#"{"k": "a", "in": {"x": 1, "y": [1, 2.0]}}"#,
        ),
        (
            "mutation($k: String!, $in: In) { pay(in: $in) @idempotent(key: $k) { id name } }",
            r#"{"k": "a", "in": {"x": 1, "y": [1, 2.0]}}"#,
        ),
        (
            "mutation M($k: String!, $in: In) { pay(in: $in) @idempotent(key: $k) { id } }",
            r#"{"k": "a", "in": {"x": 1, "y": [1, 2.0]}}"#,
        ),
    ];
    for (text, variables) in different {
        assert_ne!(fingerprint(text, variables), base, "{text} {variables}");
    }
}

#[test]
fn canonical_json_sorts_members_and_keeps_numbers_and_strings() {
    assert_eq!(
        canonical::json(r#" { "b" : [ 1 , 1.0 , 1e3 ] , "a" : "\u00e9\"" } "#),
        r#"{"a":"é\"","b":[1,1.0,1e3]}"#
    );
    assert_eq!(canonical::json(r#"{"a": 1, "a": 2}"#), r#"{"a":2}"#);
    assert_eq!(canonical::json("[]"), "[]");
    assert_eq!(canonical::json("{}"), "{}");
    assert_eq!(canonical::json("null"), "null");
    assert_eq!(
        canonical::json("123456789012345678901234567890"),
        "123456789012345678901234567890"
    );
}

#[test]
fn merge_keeps_the_clients_order_and_every_error() {
    let ok = br#"{"data":{"order":{"id":"o1","total":12345678901234567890.50}},"extensions":{"cost":1}}"#;
    let failed = br#"{"data":{"charge":null},"errors":[{"message":"declined","path":["charge"]}],"extensions":{"cost":2,"trace":"t"}}"#;
    let replayed_error = error_answer(
        "refund",
        &idempotency_error("refund", IDEMPOTENCY_CONCURRENT_REQUEST, "This key is in use."),
    );
    let merged = merge(&[("order", ok), ("charge", failed), ("refund", &replayed_error)]);
    let expected = concat!(
        r#"{"data":{"order":{"id":"o1","total":12345678901234567890.50},"charge":null,"refund":null},"#,
        r#""errors":[{"message":"declined","path":["charge"]},"#,
        r#"{"extensions":{"code":"IDEMPOTENCY_CONCURRENT_REQUEST"},"message":"This key is in use.","path":["refund"]}],"#,
        r#""extensions":{"cost":2,"trace":"t"}}"#
    );
    assert_eq!(String::from_utf8(merged).unwrap(), expected);
}

#[test]
fn merged_data_is_null_only_when_no_part_has_data() {
    let null = br#"{"data":null,"errors":[{"message":"boom","path":["a"]}]}"#;
    let refused = br#"{"errors":[{"message":"Cannot query field"}]}"#;
    let merged: Value = serde_json::from_slice(&merge(&[("a", null), ("b", null)])).unwrap();
    assert_eq!(merged["data"], Value::Null);
    assert_eq!(merged["errors"].as_array().unwrap().len(), 2);
    let merged: Value = serde_json::from_slice(&merge(&[("b", refused)])).unwrap();
    assert!(merged.get("data").is_none(), "a request error has no data");
    let merged: Value =
        serde_json::from_slice(&merge(&[("a", null), ("b", br#"{"data":{"b":1}}"#)])).unwrap();
    assert_eq!(merged["data"], json!({"a": null, "b": 1}));
    let skipped: Value = serde_json::from_slice(&merge(&[
        ("a", br#"{"data":{}}"#),
        ("b", br#"{"data":{"b":true}}"#),
    ]))
    .unwrap();
    assert_eq!(
        skipped,
        json!({"data": {"b": true}}),
        "a field skipped by @include is absent"
    );
}

#[test]
fn an_answer_that_is_not_graphql_becomes_the_proxys_error() {
    let merged: Value = serde_json::from_slice(&merge(&[
        ("a", b"<html>502</html>"),
        ("b", br#"{"data":{"b":1}}"#),
    ]))
    .unwrap();
    assert_eq!(merged["data"], json!({"a": null, "b": 1}));
    assert_eq!(merged["errors"][0]["path"], json!(["a"]));
    let merged: Value = serde_json::from_slice(&merge(&[("a", br#"{"data":[1]}"#)])).unwrap();
    assert_eq!(merged["data"], Value::Null);
}

#[test]
fn a_field_failed_when_it_has_errors_and_no_value() {
    assert!(field_failed(
        br#"{"data":{"pay":null},"errors":[{"message":"x"}]}"#
    ));
    assert!(field_failed(br#"{"data":null,"errors":[{"message":"x"}]}"#));
    assert!(field_failed(br#"{"errors":[{"message":"x"}]}"#));
    assert!(field_failed(b"Bad Gateway"));
    assert!(field_failed(&error_answer(
        "pay",
        &idempotency_error("pay", IDEMPOTENCY_PREVIOUS_ATTEMPT_FAILED, "m")
    )));
    assert!(!field_failed(br#"{"data":{"pay":{"id":1}}}"#));
    assert!(
        !field_failed(br#"{"data":{"pay":null}}"#),
        "a null without errors is the field's value"
    );
    assert!(!field_failed(
        br#"{"data":{"pay":{"id":1,"sub":null}},"errors":[{"message":"sub","path":["pay","sub"]}]}"#
    ));
}

#[test]
fn the_idempotency_error_is_shaped_as_shopifys() {
    assert_eq!(
        idempotency_error(
            "pay",
            IDEMPOTENCY_KEY_PARAMETER_MISMATCH,
            "The key was used with other arguments."
        ),
        json!({
            "message": "The key was used with other arguments.",
            "path": ["pay"],
            "extensions": {"code": "IDEMPOTENCY_KEY_PARAMETER_MISMATCH"},
        })
    );
}

/// A root field the property tests write: its alias, whether it is keyed, and whether its key is a
/// variable.
fn root_field() -> impl Strategy<Value = (bool, bool, u8)> {
    (any::<bool>(), any::<bool>(), 0u8..3)
}

proptest! {
    #[test]
    fn any_mix_of_root_fields_splits_into_clean_parts_in_order(fields in prop::collection::vec(root_field(), 1..8)) {
        let mut declarations = Vec::new();
        let mut variables = serde_json::Map::new();
        let mut text = String::new();
        for (i, (keyed, by_variable, fragment)) in fields.iter().enumerate() {
            let directive = match (keyed, by_variable) {
                (false, _) => String::new(),
                (true, false) => format!("@idempotent(key: \"key{i}\")"),
                (true, true) => {
                    declarations.push(format!("$k{i}: String!"));
                    variables.insert(format!("k{i}"), json!(format!("key{i}")));
                    format!("@idempotent(key: $k{i})")
                }
            };
            text.push_str(&format!("  f{i}: op(n: {i}) {directive} {{ ...F{fragment} }}\n"));
        }
        let any_keyed = fields.iter().any(|(keyed, _, _)| *keyed);
        let declared = if declarations.is_empty() { String::new() } else { format!("({})", declarations.join(", ")) };
        let document = format!("mutation{declared} {{\n{text}}}\nfragment F0 on T {{ a }}\nfragment F1 on T {{ b ...F0 }}\nfragment F2 on T {{ c }}");
        let request = body(&document, Value::Object(variables));
        if !any_keyed {
            prop_assert_eq!(plan(&request), Ok(Plan::Unkeyed));
            return Ok(());
        }
        let parts = parts(&request);
        prop_assert_eq!(parts.len(), fields.len());
        for (i, (part, (keyed, _, fragment))) in parts.iter().zip(&fields).enumerate() {
            prop_assert_eq!(&part.response_key, &format!("f{i}"));
            prop_assert_eq!(part.key.clone(), keyed.then(|| format!("key{i}")));
            let document = query(part);
            prop_assert!(document.contains(&format!("fragment F{fragment} ")), "{}", document);
            prop_assert_eq!(document.matches("op(").count(), 1);
            prop_assert_eq!(sent_variables(part), json!({}));
        }
    }

    #[test]
    fn ignored_tokens_change_neither_the_fingerprint_nor_the_key(separators in prop::collection::vec(0usize..5, 23)) {
        const CHUNKS: [&str; 23] = [
            "mutation", "(", "$k", ":", "String!", ")", "{", "pay", "(", "x", ":", "1", ")",
            "@idempotent", "(", "key", ":", "$k", ")", "{", "id", "}", "}",
        ];
        const IGNORED: [&str; 5] = [" ", "\n", ",", " # comment, with @idempotent(key: \"no\")\n", "\t,\r\n"];
        let spaced: String = CHUNKS.iter().zip(&separators).map(|(chunk, s)| format!("{chunk}{}", IGNORED[*s])).collect();
        let plain = CHUNKS.join(" ");
        let fingerprint = |text: &str| {
            let parts = parts(&body(text, json!({"k": "key"})));
            (parts[0].fingerprint.clone(), parts[0].key.clone())
        };
        prop_assert_eq!(fingerprint(&spaced), fingerprint(&plain));
    }

    #[test]
    fn plan_never_panics_on_any_document(text in "[a-z@(){}:$\"#\\[\\]!=., \n]{0,80}") {
        let _ = plan(&body(&text, json!({"k": "v"})));
    }

    #[test]
    fn merge_never_panics_and_always_writes_json(answers in prop::collection::vec("[a-z{}\\[\\]\":,0-9 ]{0,40}", 0..4)) {
        let parts: Vec<(&str, &[u8])> = answers.iter().map(|a| ("f", a.as_bytes())).collect();
        prop_assert!(serde_json::from_slice::<Value>(&merge(&parts)).is_ok());
    }
}
