//! The maps of the code and the documentation stay true. `docs/LIFECYCLE.md` and the module list in
//! `src/lib.rs`: every file path they cite exists, every `module::item` or `Type::item` they cite is defined
//! where it says, every `section.key` they cite is a configuration key of `config/idemproxy.toml`, and
//! each step of a request in `docs/LIFECYCLE.md` names exactly one file, a file no other step names. Every
//! page of the documentation (all of `docs/`, and README.md, SECURITY.md, CONTRIBUTING.md, CHANGELOG.md):
//! every relative link leads to a file that exists and, with a `#fragment`, to a heading of that page (as
//! GitHub makes anchors); and, outside the CHANGELOG's history, every repository path it cites in backticks
//! exists and every `section.key` whose section is one of the configuration's is a key of
//! `config/idemproxy.toml`. The README stays a front page: at most 300 lines.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &str) -> String {
    fs::read_to_string(root().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The text between backticks, in order.
fn quoted(text: &str) -> Vec<&str> {
    text.split('`').skip(1).step_by(2).collect()
}

/// Every `.rs` file under `src/`, by its path from the repository root.
fn sources() -> BTreeMap<String, String> {
    fn walk(dir: &Path, found: &mut BTreeMap<String, String>) {
        for entry in fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, found);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let name = path.strip_prefix(root()).unwrap().to_string_lossy().into_owned();
                found.insert(name, fs::read_to_string(&path).unwrap());
            }
        }
    }
    let mut found = BTreeMap::new();
    walk(&root().join("src"), &mut found);
    found
}

fn is_path(token: &str) -> bool {
    token.ends_with(".rs") && token.chars().all(|c| c.is_ascii_lowercase() || "_/.".contains(c))
}

fn is_symbol(token: &str) -> bool {
    let segments: Vec<&str> = token.split("::").collect();
    segments.len() >= 2
        && segments.iter().all(|s| {
            let mut chars = s.chars();
            chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        })
}

/// `section.key` or `section.sub.key`, all lowercase words.
fn is_config_key(token: &str) -> bool {
    token.contains('.')
        && !token.ends_with(".rs")
        && token
            .split('.')
            .all(|w| !w.is_empty() && w.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
}

/// Whether `text` defines `name` as an item, an enum variant or a struct field.
fn defines(text: &str, name: &str) -> bool {
    let items = ["fn", "struct", "enum", "const", "static", "type", "trait", "mod"];
    text.lines().any(|line| {
        let line = line.trim_start();
        let line = line
            .strip_prefix("pub(crate) ")
            .or_else(|| line.strip_prefix("pub(super) "))
            .or_else(|| line.strip_prefix("pub "))
            .unwrap_or(line);
        let line = line.strip_prefix("async ").unwrap_or(line);
        let named = |rest: &str| {
            rest.strip_prefix(name).is_some_and(|after| {
                after.is_empty() || !after.starts_with(|c: char| c.is_alphanumeric() || c == '_')
            })
        };
        items.iter().any(|item| {
            line.strip_prefix(item)
                .and_then(|l| l.strip_prefix(' '))
                .is_some_and(named)
        }) || (named(line) && {
            let after = &line[name.len()..];
            after.starts_with([' ', '(', '{', ',', ':']) || after.is_empty()
        })
    })
}

/// Whether `text` defines or implements the type `name`.
fn has_type(text: &str, name: &str) -> bool {
    defines(text, name) || text.contains(&format!("impl {name} ")) || text.contains(&format!(" for {name} "))
}

/// Where `symbol` is defined, or why it is not.
fn resolve(symbol: &str, sources: &BTreeMap<String, String>) -> Result<(), String> {
    let segments: Vec<&str> = symbol.split("::").collect();
    let (item, owner) = (segments[segments.len() - 1], segments[segments.len() - 2]);
    let candidates: Vec<&String> = if owner.starts_with(|c: char| c.is_ascii_uppercase()) {
        sources
            .iter()
            .filter(|(_, text)| has_type(text, owner))
            .map(|(_, text)| text)
            .collect()
    } else {
        sources
            .iter()
            .filter(|(path, _)| path.ends_with(&format!("/{owner}.rs")))
            .map(|(_, text)| text)
            .collect()
    };
    if candidates.is_empty() {
        return Err(format!("`{symbol}`: no file defines `{owner}`"));
    }
    if candidates.iter().any(|text| defines(text, item)) {
        Ok(())
    } else {
        Err(format!("`{symbol}`: `{item}` is not defined beside `{owner}`"))
    }
}

/// The keys of the example configuration, as `section.key` (and `section.sub` for sub-tables).
fn config_keys() -> BTreeSet<String> {
    let mut keys = BTreeSet::new();
    let mut section = String::new();
    for line in read("config/idemproxy.toml").lines() {
        let line = line.trim();
        let table = line.trim_start_matches('#').trim();
        if let Some(name) = table.strip_prefix('[').and_then(|t| t.strip_suffix(']')) {
            if !name.contains(' ') {
                section = name.trim_matches(['[', ']']).to_owned();
                keys.insert(section.clone());
            }
            continue;
        }
        let Some((key, _)) = table.split_once('=') else {
            continue;
        };
        let key = key.trim();
        if !section.is_empty() && !key.is_empty() && key.chars().all(|c| c.is_ascii_lowercase() || c == '_') {
            keys.insert(format!("{section}.{key}"));
        }
    }
    keys
}

/// Every problem with the citations in `text`; paths are taken relative to `base`.
fn check(doc: &str, text: &str, base: &str) -> Vec<String> {
    let sources = sources();
    let keys = config_keys();
    let mut problems = Vec::new();
    for token in quoted(text) {
        if is_path(token) {
            let path: PathBuf = root().join(base).join(token);
            if !path.is_file() {
                problems.push(format!("{doc}: `{token}` does not exist"));
            }
        } else if is_symbol(token) {
            if let Err(why) = resolve(token, &sources) {
                problems.push(format!("{doc}: {why}"));
            }
        } else if is_config_key(token) && !keys.contains(token) {
            problems.push(format!("{doc}: `{token}` is not a key of config/idemproxy.toml"));
        }
    }
    problems
}

#[test]
fn every_path_symbol_and_key_the_lifecycle_cites_exists() {
    let problems = check("docs/LIFECYCLE.md", &read("docs/LIFECYCLE.md"), "");
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn every_path_symbol_and_key_the_map_in_lib_rs_cites_exists() {
    let map: String = read("src/lib.rs")
        .lines()
        .filter_map(|line| line.strip_prefix("//!"))
        .collect::<Vec<_>>()
        .join("\n");
    assert!(map.contains(".rs`"), "the map in src/lib.rs cites no file");
    let problems = check("src/lib.rs", &map, "src");
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The numbered steps of `docs/LIFECYCLE.md`: title and text (the numbered line and the indented lines
/// under it).
fn steps(text: &str) -> Vec<(String, String)> {
    let mut steps: Vec<(String, String)> = Vec::new();
    let mut in_step = false;
    for line in text.lines() {
        let numbered = line
            .split_once(". **")
            .filter(|(n, _)| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()));
        if let Some((_, rest)) = numbered {
            let title = rest.split("**").next().unwrap_or_default().to_owned();
            steps.push((title, line.to_owned()));
            in_step = true;
        } else if in_step && line.starts_with("  ") {
            let last = steps.last_mut().expect("in a step");
            last.1.push('\n');
            last.1.push_str(line);
        } else {
            in_step = false;
        }
    }
    steps
}

#[test]
fn each_step_of_the_lifecycle_names_exactly_one_file_of_its_own() {
    let text = read("docs/LIFECYCLE.md");
    let steps = steps(&text);
    assert!(
        steps.len() >= 10,
        "only {} steps found in docs/LIFECYCLE.md",
        steps.len()
    );
    let mut seen = BTreeMap::new();
    for (title, step) in &steps {
        let named: BTreeSet<&str> = quoted(step).into_iter().filter(|t| is_path(t)).collect();
        assert_eq!(
            named.len(),
            1,
            "step {title} must name exactly one file, names {named:?}"
        );
        let file = named.into_iter().next().unwrap();
        if let Some(other) = seen.insert(file.to_owned(), title.clone()) {
            panic!("steps {other} and {title} both name {file}");
        }
    }
}

#[test]
fn the_checks_catch_what_is_not_there() {
    let sources = sources();
    assert!(resolve("key::parse_key", &sources).is_ok());
    assert!(resolve("Proxy::handle", &sources).is_ok());
    assert!(resolve("key::no_such_function", &sources).is_err());
    assert!(resolve("NoSuchType::handle", &sources).is_err());
    let problems = check(
        "test",
        "`src/no_such_file.rs` `idempotency.no_such_key` `idempotency.ttl`",
        "",
    );
    assert_eq!(problems.len(), 2, "{problems:?}");
    let two = "1. **A** — `src/lib.rs` and `src/proxy.rs`.\n2. **B** — `src/error.rs`.\n   more `x`\n\nafter";
    let found = steps(two);
    assert_eq!(found.len(), 2);
    assert_eq!(found[1].0, "B");
    assert!(found[1].1.ends_with("more `x`"), "{:?}", found[1]);
}

/// The pages a reader can reach: every markdown file under `docs/`, and the pages at the root.
fn pages() -> Vec<String> {
    fn walk(dir: &Path, found: &mut Vec<String>) {
        for entry in fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, found);
            } else if path.extension().is_some_and(|e| e == "md") {
                found.push(path.strip_prefix(root()).unwrap().to_string_lossy().into_owned());
            }
        }
    }
    let mut found: Vec<String> = ["README.md", "SECURITY.md", "CONTRIBUTING.md", "CHANGELOG.md"]
        .map(String::from)
        .into();
    walk(&root().join("docs"), &mut found);
    found
}

/// `text` without its fenced code blocks (their lines left empty, so the rest keeps its shape).
fn prose(text: &str) -> String {
    let mut fence: Option<&str> = None;
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        let trimmed = line.trim_start();
        let marker = ["```", "~~~"].into_iter().find(|m| trimmed.starts_with(m));
        match (fence, marker) {
            (None, Some(m)) => fence = Some(m),
            (Some(open), Some(m)) if open == m => fence = None,
            (None, None) => out.push_str(line),
            _ => {}
        }
        out.push('\n');
    }
    out
}

/// The anchor GitHub gives a heading: lower case, every character but letters, digits, `-`, `_` and
/// spaces dropped, spaces made hyphens.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | ' '))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of the headings of `text`; a heading met again gets `-1`, `-2`, … as on GitHub.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut found = BTreeSet::new();
    for line in prose(text).lines() {
        let hashes = line.len() - line.trim_start_matches('#').len();
        let Some(heading) = line[hashes..]
            .strip_prefix(' ')
            .filter(|_| (1..=6).contains(&hashes))
        else {
            continue;
        };
        let base = slug(heading.trim_end_matches('#'));
        let count = seen.entry(base.clone()).or_insert(0);
        found.insert(if *count == 0 {
            base.clone()
        } else {
            format!("{base}-{count}")
        });
        *count += 1;
    }
    found
}

/// `text` split at its backticks: the parts outside inline code, and the parts inside.
fn code_spans(text: &str) -> (Vec<&str>, Vec<&str>) {
    let parts: Vec<&str> = text.split('`').collect();
    let outside = parts.iter().step_by(2).copied().collect();
    let inside = parts.iter().skip(1).step_by(2).copied().collect();
    (outside, inside)
}

/// The targets of the inline links (`[text](target)`, images too) outside code.
fn links(text: &str) -> Vec<String> {
    let prose = prose(text);
    let (outside, _) = code_spans(&prose);
    let mut found = Vec::new();
    for part in outside {
        for after in part.split("](").skip(1) {
            let Some(end) = after.find(')') else { continue };
            let target = after[..end].split_whitespace().next().unwrap_or_default();
            found.push(target.trim_matches(['<', '>']).to_owned());
        }
    }
    found
}

/// Every problem with the relative links of `page` (a path from the repository root), whose text is `text`.
fn check_links(page: &str, text: &str) -> Vec<String> {
    let dir = Path::new(page).parent().unwrap_or(Path::new(""));
    let mut problems = Vec::new();
    for target in links(text) {
        if target.contains("://") || target.starts_with("mailto:") {
            continue;
        }
        let (path, fragment) = target.split_once('#').unwrap_or((target.as_str(), ""));
        if path.is_empty() {
            if !anchors(text).contains(fragment) {
                problems.push(format!(
                    "{page}: (#{fragment}): no heading of the page has that anchor"
                ));
            }
            continue;
        }
        let Ok(file) = root().join(dir).join(path).canonicalize() else {
            problems.push(format!("{page}: ({target}) leads nowhere"));
            continue;
        };
        if !file.starts_with(root().canonicalize().unwrap()) {
            problems.push(format!("{page}: ({target}) leads out of the repository"));
        } else if !fragment.is_empty() {
            let headings = if file.extension().is_some_and(|e| e == "md") {
                anchors(&fs::read_to_string(&file).unwrap())
            } else {
                BTreeSet::new()
            };
            if !headings.contains(fragment) {
                problems.push(format!(
                    "{page}: ({target}): no heading there has the anchor #{fragment}"
                ));
            }
        }
    }
    problems
}

/// Where a repository path cited in backticks starts.
const CITED_ROOTS: [&str; 10] = [
    "src/",
    "tests/",
    "examples/",
    "deploy/",
    "bench/",
    "migrations/",
    "config/",
    "docs/",
    "fuzz/",
    ".ci/",
];

/// Every problem with the repository paths and configuration keys `page` cites in backticks.
fn check_citations(page: &str, text: &str, keys: &BTreeSet<String>) -> Vec<String> {
    let sections: BTreeSet<&str> = keys.iter().filter_map(|k| k.split('.').next()).collect();
    let prose = prose(text);
    let (_, inside) = code_spans(&prose);
    let mut problems = Vec::new();
    for token in inside {
        let token = token.trim();
        let is_repo_path = CITED_ROOTS.iter().any(|r| token.starts_with(r))
            && token
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "_./-".contains(c));
        if is_repo_path && !root().join(token).exists() {
            problems.push(format!("{page}: `{token}` does not exist"));
        }
        let section = token.split('.').next().unwrap_or_default();
        if is_config_key(token) && sections.contains(section) && !keys.contains(token) {
            problems.push(format!("{page}: `{token}` is not a key of config/idemproxy.toml"));
        }
    }
    problems
}

#[test]
fn every_relative_link_in_the_docs_leads_to_a_file_and_heading_that_exist() {
    let pages = pages();
    assert!(pages.len() >= 12, "only {pages:?}");
    let problems: Vec<String> = pages
        .iter()
        .flat_map(|page| check_links(page, &read(page)))
        .collect();
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn every_path_and_key_the_docs_cite_exists() {
    let keys = config_keys();
    // Past releases in the CHANGELOG may name files and keys as they were then; its links still lead somewhere.
    let problems: Vec<String> = pages()
        .iter()
        .filter(|page| *page != "CHANGELOG.md")
        .flat_map(|page| check_citations(page, &read(page), &keys))
        .collect();
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_link_checks_catch_what_is_not_there() {
    assert_eq!(
        slug("What \"at most once\" means, exactly"),
        "what-at-most-once-means-exactly"
    );
    assert_eq!(
        slug("Retention: `ttl` and the sweeper"),
        "retention-ttl-and-the-sweeper"
    );
    let page = "# Top\n\n## Twice\n\n## Twice\n\n```sh\n# not a heading\n```\n";
    assert_eq!(
        anchors(page),
        BTreeSet::from(["top", "twice", "twice-1"].map(String::from))
    );
    let good = "[a](#top) [b](operations.md#metrics) [c](../src/lib.rs) [d](https://example.com/x#y) \
                `[e](nowhere.md)`\n\n```md\n[f](nowhere.md)\n```\n";
    assert_eq!(
        check_links("docs/x.md", &format!("# Top\n{good}")),
        Vec::<String>::new()
    );
    let bad = "# Top\n[a](#nothing) [b](operations.md#no-such-heading) [c](no-such-page.md) \
               [d](../../outside.md) [e](../src/lib.rs#no-heading-in-rust)\n";
    let problems = check_links("docs/x.md", bad);
    assert_eq!(problems.len(), 5, "{problems:#?}");
    let keys = config_keys();
    let cited = "`src/lib.rs` `src/no_such.rs` `tests/it/no_such/` `store.no_such_key` `store.url` \
                 `idemproxy.db` `bench/run --quick`";
    let problems = check_citations("x.md", cited, &keys);
    assert_eq!(problems.len(), 3, "{problems:#?}");
}

#[test]
fn the_readme_stays_a_front_page_of_at_most_300_lines() {
    let readme = read("README.md");
    let lines = readme.lines().count();
    assert!(
        lines <= 300,
        "README.md has {lines} lines: move reference to a page under docs/ and link to it"
    );
}

/// The case ids a line of prose names in backticks that look like case ids (lower-case words joined
/// by `-`).
fn named_cases(line: &str) -> Vec<&str> {
    let (_, inside) = code_spans(line);
    inside
        .into_iter()
        .filter(|t| {
            t.contains('-')
                && t.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        })
        .collect()
}

/// Every problem with the "must"s of `text`: a line that says "must" and does not end naming, after its
/// last `: `, the cases that check it, or names one that does not exist. Headings are not promises.
fn check_musts(text: &str, cases: &BTreeSet<&str>) -> Vec<String> {
    let mut problems = Vec::new();
    for line in prose(text).lines().filter(|l| !l.starts_with('#')) {
        let says_must = line
            .split(|c: char| !c.is_ascii_alphabetic())
            .any(|word| word.eq_ignore_ascii_case("must"));
        if !says_must {
            continue;
        }
        let named = line.rsplit_once(": `").map_or(Vec::new(), |(_, list)| {
            named_cases(&format!("`{list}"))
                .into_iter()
                .map(str::to_owned)
                .collect()
        });
        if named.is_empty() {
            problems.push(format!("a \"must\" that names no conformance case: {line}"));
        }
        for id in named.iter().filter(|id| !cases.contains(id.as_str())) {
            problems.push(format!("`{id}` is not a case of the suite: {line}"));
        }
    }
    problems
}

#[test]
fn every_must_of_the_contract_names_the_conformance_cases_that_check_it() {
    let all = idemproxy::conformance::cases::all();
    let cases: BTreeSet<&str> = all.iter().map(|c| c.id).collect();
    let problems = check_musts(&read("docs/contract.md"), &cases);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    let musts = prose(&read("docs/contract.md"))
        .lines()
        .filter(|l| l.contains(" must "))
        .count();
    assert!(musts >= 15, "only {musts} lines say must");
    let cited: BTreeSet<&str> = read("docs/contract.md")
        .lines()
        .flat_map(named_cases)
        .filter(|id| cases.contains(id))
        .map(|id| *all.iter().find(|c| c.id == id).map(|c| &c.id).unwrap_or(&""))
        .collect();
    let unnamed: Vec<&&str> = cases.iter().filter(|id| !cited.contains(*id)).collect();
    assert!(
        unnamed.is_empty(),
        "cases no promise of docs/contract.md names: {unnamed:?}"
    );
}

#[test]
fn every_case_of_the_suite_is_in_the_table_of_docs_conformance() {
    let page = read("docs/conformance.md");
    for case in idemproxy::conformance::cases::all() {
        let row = format!("| `{}` | {} | {} |", case.id, case.group.name(), case.source);
        assert!(page.contains(&row), "docs/conformance.md has no row {row}");
    }
}

#[test]
fn the_must_check_sees_a_must_without_a_case_and_a_case_that_does_not_exist() {
    let cases = BTreeSet::from(["first-execution"]);
    assert!(check_musts("It must run once: `first-execution`.\n", &cases).is_empty());
    assert_eq!(check_musts("A client must retry.\n", &cases).len(), 1);
    assert_eq!(
        check_musts("It must run once: `first-execution`, `no-such-case`.\n", &cases).len(),
        1
    );
    assert!(check_musts("Nothing mustard here.\n", &cases).is_empty());
}
