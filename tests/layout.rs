//! The layout stays acyclic: no file under `src/` uses, directly or through other files, a file that uses
//! it back, and the bottom layers (`metrics.rs` and its files, the configuration, the shared helpers) use
//! nothing above them. A use is any `crate::`, `super::` or `self::` path outside test modules, resolved
//! to the file of the longest module it names.
//!
//! Inside the request path (`src/proxy.rs` and `src/proxy/`) uses follow the order in which the stages
//! call one another — the spine, then the keyed task, then wait, then claim, then execute, forward and
//! intake, then settle, then the leaves — so that a stage's calls into another are seen as the uses
//! they are, and no stage reaches back into one that calls it. And the stages name no protocol: what a
//! dialect changes is asked of `src/proxy/dialect.rs`.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::Path;

type Graph = BTreeMap<String, BTreeSet<String>>;

/// Every `.rs` file under `src/` (but `main.rs`), by module path (`proxy::execute`) → file text without its
/// test modules.
fn modules() -> BTreeMap<Vec<String>, (String, String)> {
    fn walk(root: &Path, dir: &Path, found: &mut BTreeMap<Vec<String>, (String, String)>) {
        for entry in fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(root, &path, found);
                continue;
            }
            let relative = path.strip_prefix(root).unwrap().to_string_lossy().into_owned();
            let Some(module) = relative.strip_suffix(".rs") else {
                continue;
            };
            if module == "main" {
                continue;
            }
            let segments = if module == "lib" {
                Vec::new()
            } else {
                module.split('/').map(str::to_owned).collect()
            };
            let text = fs::read_to_string(&path).unwrap();
            found.insert(
                segments,
                (format!("src/{relative}"), without_tests(&text).to_owned()),
            );
        }
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut found = BTreeMap::new();
    walk(&root, &root, &mut found);
    found
}

/// The text before the first test module; nothing of a file that is for tests only (`#![cfg(test)]`).
fn without_tests(text: &str) -> &str {
    let end = ["#![cfg(test)]", "#[cfg(test)]", "#[cfg(all(test", "mod tests {"]
        .iter()
        .filter_map(|marker| text.find(marker))
        .min()
        .unwrap_or(text.len());
    &text[..end]
}

/// The module paths `text` (the file of module `me`) names with `crate::`, `super::` or `self::`,
/// including each name inside a `{...}` group.
fn named_paths(text: &str, me: &[String]) -> Vec<Vec<String>> {
    let mut paths = Vec::new();
    let mut bases = vec![
        ("crate::".to_owned(), Vec::new()),
        ("super::".to_owned(), me[..me.len().saturating_sub(1)].to_vec()),
        ("self::".to_owned(), me.to_vec()),
    ];
    // A module the file declares is named by its bare name too (`claim::alone` in postgres.rs), but
    // a re-export (`pub use open::serve;`) is the parent speaking for its child, not a use of it.
    for child in declared_modules(text) {
        let mut root = me.to_vec();
        root.push(child.clone());
        bases.push((format!("{child}::"), root));
    }
    for (n, (base, root)) in bases.iter().enumerate() {
        for (at, _) in text.match_indices(base.as_str()) {
            let before = text[..at].chars().next_back();
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                continue;
            }
            let line = text[..at].rsplit('\n').next().unwrap_or("").trim_start();
            if n >= 3 && (line.starts_with("pub use ") || line.starts_with("pub(crate) use ")) {
                continue;
            }
            let mut path: Vec<String> = root.clone();
            let rest = &text[at + base.len()..];
            let end = rest
                .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                .unwrap_or(rest.len());
            for segment in rest[..end].split("::").filter(|s| !s.is_empty()) {
                if segment == "super" {
                    path.pop();
                } else {
                    path.push(segment.to_owned());
                }
            }
            if rest[end..].starts_with('{') {
                let group = &rest[end + 1..rest[end..].find('}').map_or(rest.len(), |close| end + close)];
                // A group uses the module it is taken from only where it names it (`self`).
                let mut itself = false;
                for item in group.split(',').map(str::trim).filter(|i| !i.is_empty()) {
                    if item == "self" {
                        itself = true;
                        continue;
                    }
                    let mut inner = path.clone();
                    inner.extend(
                        item.split("::")
                            .next()
                            .map(|s| s.split(' ').next().unwrap_or(s).to_owned()),
                    );
                    paths.push(inner);
                }
                if !itself {
                    continue;
                }
            }
            paths.push(path);
        }
    }
    paths
}

/// The modules `text` declares (`mod name;`, public or not).
fn declared_modules(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|line| {
            let line = line.trim_start();
            let rest = line
                .strip_prefix("pub ")
                .or_else(|| line.strip_prefix("pub(crate) "))
                .or_else(|| line.strip_prefix("pub(super) "))
                .unwrap_or(line);
            let name = rest.strip_prefix("mod ")?.strip_suffix(';')?;
            Some(name.to_owned())
        })
        .collect()
}

/// Which file uses which, by file path.
fn graph() -> Graph {
    let modules = modules();
    let file_of = |path: &[String]| {
        (0..=path.len())
            .rev()
            .find_map(|n| modules.get(&path[..n]).map(|(file, _)| file.clone()))
    };
    let mut graph = Graph::new();
    for (me, (file, text)) in &modules {
        let uses = named_paths(text, me)
            .iter()
            .filter_map(|path| file_of(path))
            .filter(|used| used != file && used != "src/lib.rs")
            .collect();
        graph.insert(file.clone(), uses);
    }
    graph
}

/// A cycle through `graph`, if there is one, as the files in order.
fn find_cycle(graph: &Graph) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &Graph,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|n| n == node) {
            let mut cycle = path[at..].to_vec();
            cycle.push(node.to_owned());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_owned());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, graph, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        done.insert(node.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|node| visit(node, graph, &mut Vec::new(), &mut done))
}

#[test]
fn no_file_uses_a_file_that_uses_it_back() {
    let graph = graph();
    assert!(graph.len() > 40, "only {} files found", graph.len());
    if let Some(cycle) = find_cycle(&graph) {
        panic!("import cycle: {}", cycle.join(" → "));
    }
}

#[test]
fn the_bottom_layers_use_nothing_above_them() {
    let graph = graph();
    let bottom = |file: &str| {
        [
            "src/metrics.rs",
            "src/body.rs",
            "src/headers.rs",
            "src/error_chain.rs",
        ]
        .contains(&file)
            || file == "src/config.rs"
            || file.starts_with("src/config/")
            || file.starts_with("src/metrics/")
    };
    let family = |a: &str, b: &str| {
        ["src/config", "src/metrics"]
            .iter()
            .any(|root| a.starts_with(root) && b.starts_with(root))
    };
    for (file, uses) in &graph {
        if !bottom(file) {
            continue;
        }
        let above: Vec<&String> = uses.iter().filter(|used| !family(file, used)).collect();
        assert!(above.is_empty(), "{file} uses {above:?}");
    }
}

/// The request path's stages by their place in the call order: `src/proxy.rs` (the spine) first; a
/// stage is its file and the files under it. Every other file under `src/proxy/` is a leaf, after all
/// of them.
const STAGES: [(&str, u8); 9] = [
    ("src/proxy", 0),
    ("src/proxy/keyed", 1),
    ("src/proxy/many", 2),
    ("src/proxy/wait", 2),
    ("src/proxy/claim", 3),
    ("src/proxy/execute", 4),
    ("src/proxy/passthrough", 4),
    ("src/proxy/intake", 4),
    ("src/proxy/settle", 5),
];
const LEAF: u8 = 6;

/// A request-path file's stage (its name in [`STAGES`], or `None` for a leaf) and place in the call
/// order; `None` for a file outside the request path.
fn stage_of(file: &str) -> Option<(Option<&'static str>, u8)> {
    if file == "src/proxy.rs" {
        return Some((Some("src/proxy"), 0));
    }
    if !file.starts_with("src/proxy/") {
        return None;
    }
    let stage = STAGES[1..]
        .iter()
        .find(|(stage, _)| file == format!("{stage}.rs") || file.starts_with(&format!("{stage}/")));
    Some(match stage {
        Some((stage, rank)) => (Some(*stage), *rank),
        None => (None, LEAF),
    })
}

/// Every use inside the request path that goes against the call order: a use of a stage that is not
/// later than the user's own, by another stage or by a leaf. A stage's files may use one another.
fn against_the_call_order(graph: &Graph) -> Vec<(String, String)> {
    let mut against = Vec::new();
    for (file, uses) in graph {
        let Some((stage, rank)) = stage_of(file) else {
            continue;
        };
        for used in uses {
            let Some((used_stage, used_rank)) = stage_of(used) else {
                continue;
            };
            let same_stage = stage.is_some() && stage == used_stage;
            let leaf_to_leaf = rank == LEAF && used_rank == LEAF;
            if !same_stage && !leaf_to_leaf && used_rank <= rank {
                against.push((file.clone(), used.clone()));
            }
        }
    }
    against
}

#[test]
fn the_request_path_uses_follow_the_call_order() {
    let graph = graph();
    for (stage, _) in STAGES {
        let file = format!("{stage}.rs");
        assert!(
            graph.contains_key(&file),
            "the stage {file} is gone; update STAGES"
        );
    }
    let against = against_the_call_order(&graph);
    assert!(
        against.is_empty(),
        "uses against the call order (spine → keyed → wait → claim → execute/passthrough/intake → \
         settle → leaves): {against:?}"
    );
}

/// The files of the stages a keyed request goes through, which ask its dialect rather than name it.
const DIALECT_FREE: [&str; 8] = [
    "src/proxy.rs",
    "src/proxy/keyed.rs",
    "src/proxy/wait.rs",
    "src/proxy/claim.rs",
    "src/proxy/execute.rs",
    "src/proxy/execute/relay.rs",
    "src/proxy/intake.rs",
    "src/proxy/settle.rs",
];

/// The words that name a dialect, or what only one dialect has.
fn names_a_dialect(text: &str) -> Vec<&'static str> {
    ["grpc", "jsonrpc", "call_id", "CallId", "Grpc", "JsonRpc"]
        .into_iter()
        .filter(|word| text.contains(word))
        .collect()
}

#[test]
fn the_stages_name_no_dialect() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for file in DIALECT_FREE {
        let text = fs::read_to_string(root.join(file)).unwrap();
        let named = names_a_dialect(without_tests(&text));
        assert!(
            named.is_empty(),
            "{file} names {named:?}: ask the request's Dialect (src/proxy/dialect.rs) instead"
        );
    }
    assert_eq!(names_a_dialect("if grpc::is_grpc(&request)"), ["grpc"]);
    assert_eq!(names_a_dialect("call_id: Option<CallId>"), ["call_id", "CallId"]);
}

#[test]
fn the_call_order_check_refuses_a_use_back_up_and_between_stages_of_one_rank() {
    let graph = |edges: &[(&str, &str)]| {
        let mut graph = Graph::new();
        for (from, to) in edges {
            graph.entry(from.to_string()).or_default().insert(to.to_string());
        }
        graph
    };
    let fine = graph(&[
        ("src/proxy.rs", "src/proxy/keyed.rs"),
        ("src/proxy/keyed.rs", "src/proxy/wait.rs"),
        ("src/proxy/keyed.rs", "src/proxy/settle.rs"),
        ("src/proxy/wait.rs", "src/proxy/claim.rs"),
        ("src/proxy/claim.rs", "src/proxy/execute.rs"),
        ("src/proxy/execute.rs", "src/proxy/execute/relay.rs"),
        ("src/proxy/execute/relay.rs", "src/proxy/answer.rs"),
        ("src/proxy/replay.rs", "src/proxy/cache.rs"),
        ("src/proxy/claim.rs", "src/store.rs"),
    ]);
    assert_eq!(against_the_call_order(&fine), Vec::new());
    for (from, to) in [
        ("src/proxy/execute/relay.rs", "src/proxy.rs"),
        ("src/proxy/claim.rs", "src/proxy/wait.rs"),
        ("src/proxy/wait.rs", "src/proxy/keyed.rs"),
        ("src/proxy/execute.rs", "src/proxy/passthrough.rs"),
        ("src/proxy/cache.rs", "src/proxy/settle.rs"),
    ] {
        assert_eq!(
            against_the_call_order(&graph(&[(from, to)])),
            vec![(from.to_owned(), to.to_owned())],
            "{from} → {to}"
        );
    }
}

#[test]
fn the_check_sees_a_cycle_and_the_uses_it_is_given() {
    let mut graph = Graph::new();
    graph.insert("a".into(), ["b".to_owned()].into());
    graph.insert("b".into(), ["c".to_owned()].into());
    graph.insert("c".into(), BTreeSet::new());
    assert_eq!(find_cycle(&graph), None);
    graph.get_mut("c").unwrap().insert("a".into());
    assert_eq!(find_cycle(&graph).unwrap().len(), 4);
    let me = vec!["proxy".to_owned(), "claim".to_owned()];
    let found = named_paths(
        "mod replay;\nuse super::{Answer, replay};\nuse crate::store::Store;\nlet x = myself::thing;\nuse crate::metrics::{self, Outcome};\nlet y = replay::response();",
        &me,
    );
    assert!(
        found.contains(&vec!["proxy".to_owned(), "replay".to_owned()]),
        "{found:?}"
    );
    assert!(
        found.contains(&vec!["store".to_owned(), "Store".to_owned()]),
        "{found:?}"
    );
    assert!(
        !found.contains(&vec!["proxy".to_owned()]),
        "a group does not use the module it is taken from: {found:?}"
    );
    assert!(
        found.contains(&vec!["metrics".to_owned()]),
        "unless it names self: {found:?}"
    );
    assert!(
        found.contains(&vec![
            "proxy".to_owned(),
            "claim".to_owned(),
            "replay".to_owned(),
            "response".to_owned()
        ]),
        "a declared module by its bare name: {found:?}"
    );
    assert_eq!(found.len(), 6, "myself:: is not self::: {found:?}");
}

/// The types whose values hold bytes, a permit or a budget's share for as long as they live: a struct
/// with a field of one of them holds that per request (or is process-wide, and says so below).
const HOLDING_TYPES: [&str; 5] = [
    "OwnedSemaphorePermit",
    "SemaphorePermit",
    // The body budget's and the capture budget's shares (`proxy/budget.rs`, `proxy/execute/capture.rs`).
    "Reservation",
    "ReservedBody",
    "BytesMut",
];

/// Structs that hold one of [`HOLDING_TYPES`] but nothing per request, each with why. Empty today: the
/// process-wide budgets (`BodyBudget`, `CaptureBudget`) hold a semaphore or a ledger, not a share.
const NOT_PER_REQUEST: &[(&str, &str, &str)] = &[];

/// Whether `file` is on the request path, where a `Vec<u8>` or a `VecDeque` field is bytes or a queue
/// kept per request.
fn on_the_request_path(file: &str) -> bool {
    ["src/proxy", "src/server", "src/body.rs", "src/headers.rs"]
        .iter()
        .any(|root| file.starts_with(root))
}

/// The structs `text` defines, by name, with the text between their braces or parentheses.
fn structs(text: &str) -> Vec<(String, String)> {
    let mut found = Vec::new();
    for (at, _) in text.match_indices("struct ") {
        let before = text[..at].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let rest = &text[at + "struct ".len()..];
        let name_end = rest
            .find(|c: char| !(c.is_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        let name = &rest[..name_end];
        let Some(open) = rest[name_end..].find(['{', '(', ';']).map(|i| i + name_end) else {
            continue;
        };
        if name.is_empty() || rest[open..].starts_with(';') {
            continue;
        }
        let (opening, closing) = if rest[open..].starts_with('{') {
            ('{', '}')
        } else {
            ('(', ')')
        };
        let mut depth = 0usize;
        let mut end = rest.len();
        for (i, c) in rest[open..].char_indices() {
            if c == opening {
                depth += 1;
            } else if c == closing {
                depth -= 1;
                if depth == 0 {
                    end = open + i;
                    break;
                }
            }
        }
        let fields = rest[open + 1..end]
            .lines()
            .filter(|line| !line.trim_start().starts_with("//"))
            .collect::<Vec<_>>()
            .join("\n");
        found.push((name.to_owned(), fields));
    }
    found
}

/// What in `fields` (a struct's fields, in `file`) holds bytes or a permit, if anything.
fn holding(file: &str, fields: &str) -> Option<String> {
    let words: BTreeSet<&str> = fields
        .split(|c: char| !(c.is_alphanumeric() || c == '_'))
        .collect();
    if let Some(held) = HOLDING_TYPES.iter().find(|t| words.contains(*t)) {
        return Some((*held).to_owned());
    }
    let squeezed: String = fields.chars().filter(|c| !c.is_whitespace()).collect();
    if squeezed.contains("Vec<Bytes>") {
        return Some("Vec<Bytes>".to_owned());
    }
    if let Some(at) = squeezed.find("VecDeque<")
        && squeezed[at..]
            .split(['>', ';'])
            .next()
            .is_some_and(|inner| inner.contains("Bytes"))
    {
        return Some("VecDeque<…Bytes…>".to_owned());
    }
    if !on_the_request_path(file) {
        return None;
    }
    if squeezed.contains("Vec<u8>") {
        return Some("Vec<u8>".to_owned());
    }
    if squeezed.contains("VecDeque<") {
        return Some("VecDeque<…>".to_owned());
    }
    None
}

/// Every struct under `src/` that holds bytes or a permit, as (file, struct, what it holds).
fn holders() -> Vec<(String, String, String)> {
    let mut found = Vec::new();
    for (file, text) in modules().into_values() {
        for (name, fields) in structs(&text) {
            if let Some(held) = holding(&file, &fields) {
                found.push((file.clone(), name, held));
            }
        }
    }
    found
}

/// The section of docs/security.md that lists every holder.
fn holders_table() -> String {
    let text = fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/security.md")).unwrap();
    let start = text
        .find("## What each request may hold")
        .expect("docs/security.md has a section \"## What each request may hold\"");
    let section = &text[start + 3..];
    section[..section.find("\n## ").unwrap_or(section.len())].to_owned()
}

#[test]
fn every_holder_has_a_row_in_the_holders_table() {
    let table = holders_table();
    let found = holders();
    assert!(found.len() > 5, "only {found:?} found");
    let mut missing = Vec::new();
    for (file, name, held) in &found {
        let excepted = NOT_PER_REQUEST.iter().any(|(f, n, _)| f == file && n == name);
        if !excepted && !table.contains(&format!("`{name}`")) {
            missing.push(format!(
                "{file}: struct `{name}` holds `{held}`. Add a row naming `{name}` ({file}) to the table under \
                 \"## What each request may hold\" in docs/security.md (what it holds, its budget: config key \
                 and default, memory per attacker byte, the longest it is held: config key) and measure it \
                 in tests/it/guarantees/holders.rs; or, if it holds nothing per request, add (\"{file}\", \
                 \"{name}\", \"why\") to NOT_PER_REQUEST in tests/layout.rs."
            ));
        }
    }
    assert!(
        missing.is_empty(),
        "holders without a row:\n{}",
        missing.join("\n")
    );
    for (file, name, _) in NOT_PER_REQUEST {
        assert!(
            found.iter().any(|(f, n, _)| f == file && n == name),
            "NOT_PER_REQUEST names {name} in {file}, which holds nothing any more: remove it"
        );
    }
}

#[test]
fn the_holder_scan_sees_permits_reservations_and_buffers() {
    let text = "pub(crate) struct Slot {\n    _permit: OwnedSemaphorePermit,\n}\nstruct Tuple(Arc<Mutex<Vec<u8>>>);\n\
                struct Plain { n: usize }\nstruct Queue { frames: VecDeque<(u64, Bytes)>, }\nstruct Marker;\n\
                struct Nested { body: Option<ReservedBody>, reservations: Vec<Reservation> }\n\
                struct NotMine { held: BodyReservationLike }";
    let found: Vec<(String, Option<String>)> = structs(text)
        .into_iter()
        .map(|(name, fields)| (name, holding("src/proxy/x.rs", &fields)))
        .collect();
    let names = |held: bool| -> Vec<&str> {
        found
            .iter()
            .filter(|(_, h)| h.is_some() == held)
            .map(|(n, _)| n.as_str())
            .collect()
    };
    assert_eq!(names(true), ["Slot", "Tuple", "Queue", "Nested"], "{found:?}");
    assert_eq!(names(false), ["Plain", "NotMine"], "{found:?}");
    assert_eq!(
        holding("src/store/x.rs", "key: Vec<u8>"),
        None,
        "Vec<u8> counts on the request path only"
    );
    assert_eq!(
        holding("src/store/x.rs", "q: VecDeque<Reply>"),
        None,
        "so does any VecDeque"
    );
    assert!(
        holding("src/store/x.rs", "q: VecDeque<Bytes>").is_some(),
        "but one of Bytes anywhere"
    );
}
