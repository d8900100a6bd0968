//! The layout keeps its shape: within `agent/`, `client/` and `server/`,
//! files of different folders never import each other in a circle; no
//! source file is over 900 lines without its tests, no function over 120
//! lines (data tables named below excepted); the server's `Server` is
//! extended only in its own module; `docs/ARCHITECTURE.md` names only
//! crates and files that exist.
//!
//! The sources are read as text: `crate::a::b` and `super::` paths in code
//! (comments and test modules left out) are the imports, followed through
//! `pub use` re-exports to the module that defines what they name.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The crates whose folders must not import each other in a circle.
const LAYERED: &[&str] = &["agent/src", "client/src", "server/src"];

/// Every crate whose sources are held to the size limits.
const SIZED: &[&str] = &[
    "agent/src",
    "api/src",
    "cli/src",
    "client/src",
    "server/src",
    "allocrunner/src",
    "csimanager/src",
    "heartbeat/src",
    "metrics/src",
    "structs/src",
    "proto/src",
    "testutil/src",
    "bench/src",
    "tests/src",
    "examples/hostpath-plugin/src",
    "sync/src",
];

/// Files that may still be in a circle across folders. The check fails on
/// a circle with any other file, and on a file listed here that is no
/// longer in one, so the list only shrinks; it is empty.
const IN_CIRCLES_STILL: &[&str] = &[];

const MAX_FILE_LINES: usize = 900;
const MAX_FN_LINES: usize = 120;

/// Functions allowed past [`MAX_FN_LINES`]: data, not logic (a table of
/// routes or descriptions a reader scans, never follows).
const DATA_TABLES: &[(&str, &str)] = &[
    // The OpenAPI description: one entry per operation, one per schema.
    ("agent/src/http/openapi.rs", "operations"),
    ("agent/src/http/openapi.rs", "components"),
    // The server's routes: one line per route with its handler and the
    // ACL capability it needs.
    ("agent/src/http.rs", "server_routes"),
    // The process-wide metrics: one registration per metric family.
    ("metrics/src/lib.rs", "new"),
];

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace above tests/")
        .to_path_buf()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut entries: Vec<_> = entries.filter_map(|e| e.ok()).map(|e| e.path()).collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

/// A file only tests compile (`tests.rs`, `foo_tests.rs`, `proptests.rs`).
fn test_only(path: &Path) -> bool {
    let name = path.file_stem().and_then(|s| s.to_str()).unwrap_or("");
    name == "tests" || name.ends_with("_tests") || name == "proptests"
}

/// The lines of `text` before its test module, without comment lines.
fn product_lines(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        let t = line.trim_start();
        if t == "#[cfg(test)]"
            && lines
                .peek()
                .is_some_and(|n| n.trim_start().starts_with("mod tests"))
        {
            break;
        }
        out.push(line);
    }
    out
}

fn code_lines(text: &str) -> Vec<&str> {
    product_lines(text)
        .into_iter()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect()
}

/// The module path of a file under `src` (`http/forward.rs` is
/// `["http", "forward"]`; `lib.rs`, `main.rs` are the root).
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).expect("under src");
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    let last = parts.pop().unwrap_or_default();
    let stem = last.trim_end_matches(".rs");
    if !(stem == "mod" || (parts.is_empty() && (stem == "lib" || stem == "main"))) {
        parts.push(stem.to_string());
    }
    parts
}

/// The folder a file belongs to: a module with children of its own
/// (`http.rs` beside `http/`, or `http/mod.rs`) is its children's folder.
fn folder_of(src: &Path, file: &Path, modules: &BTreeSet<Vec<String>>) -> Vec<String> {
    let m = module_of(src, file);
    let has_children = modules
        .iter()
        .any(|o| o.len() == m.len() + 1 && o.starts_with(&m));
    if has_children || m.is_empty() {
        m
    } else {
        m[..m.len() - 1].to_vec()
    }
}

/// The module paths `code` names from inside module `at`: `crate::a::b`,
/// `super::a` (also inside `use crate::{a, b::c}` groups, first level),
/// and `child::x` for each of `children`, the modules declared in it.
fn references(code: &str, at: &[String], children: &[String]) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let bytes = code.as_bytes();
    let ident = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
    for child in children {
        let start = format!("{child}::");
        let mut from = 0;
        while let Some(pos) = code[from..].find(&start) {
            let i = from + pos;
            from = i + start.len();
            if i > 0 && (ident(bytes[i - 1]) || bytes[i - 1] == b':') {
                continue;
            }
            out.push([at.to_vec(), vec![child.clone()]].concat());
        }
    }
    for (start, prefix) in [("crate::", None), ("super::", Some(()))] {
        let mut from = 0;
        while let Some(pos) = code[from..].find(start) {
            let i = from + pos;
            from = i + start.len();
            if i > 0 && (ident(bytes[i - 1]) || bytes[i - 1] == b':') {
                continue;
            }
            let mut base: Vec<String> = match prefix {
                None => Vec::new(),
                Some(()) => at[..at.len().saturating_sub(1)].to_vec(),
            };
            let mut rest = &code[from..];
            // `super::super::x`
            while let Some(r) = rest.strip_prefix("super::") {
                base.pop();
                rest = r;
            }
            if let Some(group) = rest.strip_prefix('{') {
                let end = group.find('}').unwrap_or(group.len());
                for item in group[..end].split(',') {
                    let path = path_of(item.trim());
                    if !path.is_empty() {
                        out.push([base.clone(), path].concat());
                    }
                }
            } else {
                let path = path_of(rest);
                if !path.is_empty() {
                    out.push([base, path].concat());
                }
            }
        }
    }
    out
}

/// The leading `a::b::c` of `s` (identifiers joined by `::`).
fn path_of(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = s;
    loop {
        let end = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        if end == 0 {
            break;
        }
        out.push(rest[..end].to_string());
        match rest[end..].strip_prefix("::") {
            Some(r) if r.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_') => rest = r,
            _ => break,
        }
    }
    out
}

/// The names module `at` re-exports (`pub use a::B;`, `pub(crate) use
/// super::{C, D as E};`) with the module path each comes from, for the
/// paths within the crate (`crate::`, `super::`, `self::` or a child
/// module of `at`); a re-export from another crate is left out.
fn reexports(code: &str, at: &[String], children: &[String]) -> Vec<(String, Vec<String>)> {
    let mut out = Vec::new();
    for vis in ["pub use ", "pub(crate) use ", "pub(super) use "] {
        let mut from = 0;
        while let Some(pos) = code[from..].find(vis) {
            let start = from + pos + vis.len();
            let end = code[start..].find(';').map_or(code.len(), |e| start + e);
            from = end;
            let stmt: String = code[start..end]
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ");
            let (prefix, items) = match stmt.split_once('{') {
                Some((p, rest)) => (
                    p.trim_end_matches("::").to_string(),
                    rest.trim_end_matches('}').to_string(),
                ),
                None => match stmt.rsplit_once("::") {
                    Some((p, item)) => (p.to_string(), item.to_string()),
                    None => continue,
                },
            };
            let mut segs: Vec<&str> = prefix.split("::").filter(|s| !s.is_empty()).collect();
            let mut base: Vec<String> = match segs.first().copied() {
                Some("crate") => Vec::new(),
                Some("super") => at[..at.len().saturating_sub(1)].to_vec(),
                Some("self") => at.to_vec(),
                Some(first) if children.iter().any(|c| c == first) => {
                    segs.insert(0, "self");
                    at.to_vec()
                }
                _ => continue,
            };
            for seg in segs.iter().skip(1) {
                match *seg {
                    "super" => {
                        base.pop();
                    }
                    s => base.push(s.to_string()),
                }
            }
            for item in items.split(',') {
                let item = item.trim();
                let (name, alias) = match item.split_once(" as ") {
                    Some((n, a)) => (n.trim(), a.trim()),
                    None => (item, item),
                };
                let path = path_of(name);
                if path.is_empty() || alias == "_" || alias == "*" {
                    continue;
                }
                let shown = path_of(alias).last().cloned().unwrap_or_default();
                out.push((shown, [base.clone(), path].concat()));
            }
        }
    }
    out
}

/// The file a module path names: its longest module prefix, followed
/// through the re-exports of the modules on the way (`crate::Server`,
/// re-exported by the root from `server`, names `server/mod.rs`), so
/// that a re-export does not hide where an import goes.
fn target_of(
    path: &[String],
    by_module: &BTreeMap<Vec<String>, String>,
    reexported: &BTreeMap<(Vec<String>, String), Vec<String>>,
) -> Option<String> {
    let mut path = path.to_vec();
    for _ in 0..8 {
        let n = (1..=path.len())
            .rev()
            .find(|&n| by_module.contains_key(&path[..n]));
        // None: only the root holds the name, a root-level re-export.
        let found = n.unwrap_or(0);
        match path
            .get(found)
            .and_then(|name| reexported.get(&(path[..found].to_vec(), name.clone())))
        {
            Some(from) if *from != path[..=found] => {
                path = [from.clone(), path[found + 1..].to_vec()].concat();
            }
            _ => return by_module.get(&path[..found]).cloned(),
        }
    }
    None
}

/// Strongly connected components of `edges` (Tarjan, iterative enough for
/// a few hundred files).
fn components(nodes: &[String], edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct T<'a> {
        edges: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<String, usize>,
        low: BTreeMap<String, usize>,
        stack: Vec<String>,
        on: BTreeSet<String>,
        next: usize,
        out: Vec<Vec<String>>,
    }
    fn visit(t: &mut T<'_>, v: &str) {
        t.index.insert(v.to_string(), t.next);
        t.low.insert(v.to_string(), t.next);
        t.next += 1;
        t.stack.push(v.to_string());
        t.on.insert(v.to_string());
        let targets: Vec<String> = t
            .edges
            .get(v)
            .map(|s| s.iter().cloned().collect())
            .unwrap_or_default();
        for w in targets {
            if !t.index.contains_key(&w) {
                visit(t, &w);
                let lw = t.low[&w];
                let lv = t.low.get_mut(v).expect("visited");
                *lv = (*lv).min(lw);
            } else if t.on.contains(&w) {
                let iw = t.index[&w];
                let lv = t.low.get_mut(v).expect("visited");
                *lv = (*lv).min(iw);
            }
        }
        if t.low[v] == t.index[v] {
            let mut c = Vec::new();
            while let Some(w) = t.stack.pop() {
                t.on.remove(&w);
                let done = w == v;
                c.push(w);
                if done {
                    break;
                }
            }
            t.out.push(c);
        }
    }
    let mut t = T {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        next: 0,
        out: Vec::new(),
    };
    for n in nodes {
        if !t.index.contains_key(n) {
            visit(&mut t, n);
        }
    }
    t.out
}

/// The circles across folders of the crate at `src`: each as its files.
fn circles_across_folders(src: &Path) -> Vec<Vec<String>> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    files.retain(|f| !test_only(f));
    let modules: BTreeSet<Vec<String>> = files.iter().map(|f| module_of(src, f)).collect();
    let by_module: BTreeMap<Vec<String>, String> = files
        .iter()
        .map(|f| (module_of(src, f), f.display().to_string()))
        .collect();
    let folder: BTreeMap<String, Vec<String>> = files
        .iter()
        .map(|f| (f.display().to_string(), folder_of(src, f, &modules)))
        .collect();
    let children_of = |at: &[String]| -> Vec<String> {
        modules
            .iter()
            .filter(|m| m.len() == at.len() + 1 && m.starts_with(at))
            .filter_map(|m| m.last().cloned())
            .collect()
    };
    let mut reexported: BTreeMap<(Vec<String>, String), Vec<String>> = BTreeMap::new();
    for f in &files {
        let text = std::fs::read_to_string(f).expect("read a source file");
        let at = module_of(src, f);
        for (name, from) in reexports(&code_lines(&text).join("\n"), &at, &children_of(&at)) {
            reexported.insert((at.clone(), name), from);
        }
    }
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in &files {
        let text = std::fs::read_to_string(f).expect("read a source file");
        let at = module_of(src, f);
        let me = f.display().to_string();
        let children = children_of(&at);
        for r in references(&code_lines(&text).join("\n"), &at, &children) {
            let target = target_of(&r, &by_module, &reexported);
            if let Some(t) = target.filter(|t| *t != me) {
                edges.entry(me.clone()).or_default().insert(t);
            }
        }
    }
    let nodes: Vec<String> = by_module.values().cloned().collect();
    components(&nodes, &edges)
        .into_iter()
        .filter(|c| {
            let folders: BTreeSet<&Vec<String>> = c.iter().map(|f| &folder[f]).collect();
            folders.len() > 1
        })
        .collect()
}

#[test]
fn no_folder_imports_another_in_a_circle() {
    let root = workspace();
    let mut found = Vec::new();
    let mut in_circles = BTreeSet::new();
    for dir in LAYERED {
        for mut c in circles_across_folders(&root.join(dir)) {
            c.sort();
            let names: Vec<String> = c
                .iter()
                .map(|f| {
                    Path::new(f)
                        .strip_prefix(&root)
                        .map_or(f.clone(), |p| p.display().to_string())
                })
                .collect();
            let new: Vec<&String> = names
                .iter()
                .filter(|n| !IN_CIRCLES_STILL.contains(&n.as_str()))
                .collect();
            if !new.is_empty() {
                found.push(format!("{} (new: {new:?})", names.join(" <-> ")));
            }
            in_circles.extend(names);
        }
    }
    assert!(
        found.is_empty(),
        "files of different folders import each other in a circle:\n{}",
        found.join("\n")
    );
    let out: Vec<&&str> = IN_CIRCLES_STILL
        .iter()
        .filter(|f| !in_circles.contains(**f))
        .collect();
    assert!(
        out.is_empty(),
        "no longer in a circle, take them off IN_CIRCLES_STILL: {out:?}"
    );
}

#[test]
fn a_reexport_does_not_hide_where_an_import_goes() {
    let m = |p: &[&str]| p.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    // lib.rs: `mod server; pub use server::jobs::{Jobs, Resp as Answer};`
    let root = reexports(
        "pub use server::jobs::{Jobs, Resp as Answer};\npub use berth_structs::Job;",
        &[],
        &m(&["server"]),
    );
    assert_eq!(
        root,
        vec![
            ("Jobs".to_string(), m(&["server", "jobs", "Jobs"])),
            ("Answer".to_string(), m(&["server", "jobs", "Resp"])),
        ],
        "a re-export from another crate is left out"
    );
    // server/mod.rs: `pub(crate) use super::state::Tables;`
    let server = reexports("pub(crate) use super::state::Tables;", &m(&["server"]), &[]);
    assert_eq!(
        server,
        vec![("Tables".to_string(), m(&["state", "Tables"]))]
    );

    let by_module: BTreeMap<Vec<String>, String> = [
        (m(&[]), "lib.rs"),
        (m(&["server"]), "server/mod.rs"),
        (m(&["server", "jobs"]), "server/jobs.rs"),
        (m(&["state"]), "state.rs"),
    ]
    .into_iter()
    .map(|(k, v)| (k, v.to_string()))
    .collect();
    let mut reexported = BTreeMap::new();
    for (name, from) in root {
        reexported.insert((m(&[]), name), from);
    }
    for (name, from) in server {
        reexported.insert((m(&["server"]), name), from);
    }
    let to = |p: &[&str]| target_of(&m(p), &by_module, &reexported);
    assert_eq!(to(&["Jobs"]).as_deref(), Some("server/jobs.rs"));
    assert_eq!(to(&["Answer", "new"]).as_deref(), Some("server/jobs.rs"));
    assert_eq!(to(&["server", "Tables"]).as_deref(), Some("state.rs"));
    assert_eq!(
        to(&["server", "jobs", "Jobs"]).as_deref(),
        Some("server/jobs.rs")
    );
    assert_eq!(to(&["Unknown"]).as_deref(), Some("lib.rs"));
}

#[test]
fn the_circle_finder_sees_a_circle_and_its_folders() {
    let dir = tempfile::tempdir().expect("temp dir");
    let src = dir.path();
    std::fs::create_dir_all(src.join("a")).expect("mkdir");
    std::fs::write(src.join("lib.rs"), "mod a;\nmod b;\n").expect("write");
    std::fs::write(src.join("a.rs"), "mod x;\n").expect("write");
    std::fs::write(src.join("a/x.rs"), "use crate::b::B;\n").expect("write");
    std::fs::write(src.join("b.rs"), "use crate::a::x::X;\n").expect("write");
    let circles = circles_across_folders(src);
    assert_eq!(circles.len(), 1, "{circles:?}");
    assert_eq!(circles[0].len(), 2, "{circles:?}");
    // Within one folder a circle is allowed; a comment is no import.
    std::fs::write(src.join("b.rs"), "// crate::a::x::X\n").expect("write");
    assert!(circles_across_folders(src).is_empty());
    std::fs::write(src.join("a/x.rs"), "use super::Y;\n").expect("write");
    std::fs::write(src.join("a.rs"), "mod x;\nuse x::X;\n").expect("write");
    assert!(circles_across_folders(src).is_empty());
    // A parent naming its child closes a circle too: b -> a -> a/x -> b.
    std::fs::write(src.join("a/x.rs"), "use crate::b::B;\n").expect("write");
    std::fs::write(src.join("b.rs"), "use crate::a::A;\n").expect("write");
    assert_eq!(circles_across_folders(src).len(), 1);
}

/// The functions of `lines` longer than `max`: name, first line, length.
/// A function runs from its `fn` line to the line where its braces close.
fn long_functions(lines: &[&str], max: usize) -> Vec<(String, usize, usize)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let t = lines[i].trim_start();
        let is_fn = ["fn ", "pub fn ", "async fn ", "pub async fn ", "const fn "]
            .iter()
            .any(|p| t.starts_with(p))
            || (t.starts_with("pub(") && t.contains(" fn "));
        if !is_fn || t.ends_with(';') {
            i += 1;
            continue;
        }
        let name = t
            .split("fn ")
            .nth(1)
            .and_then(|r| r.split(['(', '<']).next())
            .unwrap_or("")
            .to_string();
        let mut depth: i64 = 0;
        let mut opened = false;
        let mut j = i;
        while j < lines.len() {
            for c in lines[j].chars() {
                match c {
                    '{' => {
                        depth += 1;
                        opened = true;
                    }
                    '}' => depth -= 1,
                    _ => {}
                }
            }
            if opened && depth <= 0 {
                break;
            }
            // A declaration without a body (`fn f();` over lines).
            if !opened && lines[j].trim_end().ends_with(';') {
                break;
            }
            j += 1;
        }
        let len = j + 1 - i;
        if opened && len > max {
            out.push((name, i + 1, len));
        }
        i += 1;
    }
    out
}

#[test]
fn no_source_file_or_function_is_too_long() {
    let root = workspace();
    let mut problems = Vec::new();
    for dir in SIZED {
        let mut files = Vec::new();
        rust_files(&root.join(dir), &mut files);
        for f in files.iter().filter(|f| !test_only(f)) {
            let rel = f.strip_prefix(&root).expect("in the workspace");
            let rel_s = rel.display().to_string();
            let text = std::fs::read_to_string(f).expect("read a source file");
            let product = product_lines(&text);
            if product.len() > MAX_FILE_LINES {
                problems.push(format!(
                    "{rel_s}: {} lines without its tests (at most {MAX_FILE_LINES})",
                    product.len()
                ));
            }
            for (name, line, len) in long_functions(&product, MAX_FN_LINES) {
                if DATA_TABLES.contains(&(rel_s.as_str(), name.as_str())) {
                    continue;
                }
                problems.push(format!(
                    "{rel_s}:{line}: fn {name} is {len} lines (at most {MAX_FN_LINES})"
                ));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// Whether `line` opens an `impl` block of the server's `Server` type
/// (inherent or of a trait).
fn opens_impl_of_server(line: &str) -> bool {
    let Some(rest) = line.trim_start().strip_prefix("impl") else {
        return false;
    };
    let rest = rest.trim_start_matches(|c: char| c != ' ').trim();
    let target = rest.rsplit(" for ").next().unwrap_or(rest);
    let target = target.trim_end_matches('{').trim();
    target == "Server" || target.ends_with("::Server")
}

#[test]
fn the_server_is_extended_only_in_its_own_module() {
    let root = workspace();
    let src = root.join("server/src");
    let own = src.join("server");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut outside = Vec::new();
    for f in files
        .iter()
        .filter(|f| !f.starts_with(&own) && !test_only(f))
    {
        let text = std::fs::read_to_string(f).expect("read a source file");
        for l in product_lines(&text) {
            if opens_impl_of_server(l) {
                let rel = f.strip_prefix(&root).expect("in the workspace");
                outside.push(format!("{}: {}", rel.display(), l.trim()));
            }
        }
    }
    assert!(
        outside.is_empty(),
        "`impl Server` outside server/src/server/:\n{}",
        outside.join("\n")
    );
}

#[test]
fn the_impl_finder_sees_impls_of_the_server() {
    assert!(opens_impl_of_server("impl Server {"));
    assert!(opens_impl_of_server("impl crate::server::Server {"));
    assert!(opens_impl_of_server("impl EvaluateJob for Server {"));
    assert!(opens_impl_of_server("impl<T> Trait<T> for crate::Server {"));
    assert!(!opens_impl_of_server("impl Drainer {"));
    assert!(!opens_impl_of_server("impl NodeServer for NodeService {"));
    assert!(!opens_impl_of_server("impl ServerConfig {"));
}

#[test]
fn the_length_check_measures_functions() {
    let text =
        "fn short() {\n    1\n}\n\nfn long() {\n".to_string() + &"    x();\n".repeat(130) + "}\n";
    let lines: Vec<&str> = text.lines().collect();
    let long = long_functions(&lines, MAX_FN_LINES);
    assert_eq!(long, vec![("long".to_string(), 5, 132)]);
}

/// The crates of the workspace, by folder (`Cargo.toml`'s members).
fn members(root: &Path) -> BTreeSet<String> {
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).expect("Cargo.toml");
    let start = manifest.find("members = [").expect("members");
    let end = start + manifest[start..].find(']').expect("end of members");
    manifest[start..end]
        .split('"')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect()
}

#[test]
fn the_architecture_page_names_what_exists() {
    let root = workspace();
    let page = std::fs::read_to_string(root.join("docs/ARCHITECTURE.md"))
        .expect("docs/ARCHITECTURE.md exists");
    let members = members(&root);
    // Every crate of the workspace is on the page, and every `berth-x`
    // crate the page names is one of the workspace.
    let mut names = BTreeMap::new();
    // Package names, and the names of the binaries they build.
    let mut built = BTreeSet::new();
    for m in &members {
        let manifest =
            std::fs::read_to_string(root.join(m).join("Cargo.toml")).expect("a member manifest");
        for l in manifest.lines() {
            if let Some(n) = l
                .strip_prefix("name = \"")
                .and_then(|l| l.strip_suffix('"'))
            {
                built.insert(n.to_string());
            }
        }
        let name = manifest
            .lines()
            .find_map(|l| l.strip_prefix("name = \""))
            .and_then(|l| l.strip_suffix('"'))
            .expect("a package name")
            .to_string();
        names.insert(name, m.clone());
    }
    for (name, folder) in &names {
        assert!(
            page.contains(&format!("`{name}`")),
            "docs/ARCHITECTURE.md does not name the crate `{name}` ({folder}/)"
        );
    }
    let mut problems = Vec::new();
    for word in page.split('`').skip(1).step_by(2) {
        if word.starts_with("berth-")
            && !word.contains(' ')
            && !built.contains(word)
            && !word.ends_with(".rs")
        {
            problems.push(format!(
                "names the crate {word}, which is not in the workspace"
            ));
        }
        // A path with a folder and `.rs` is a file that must exist.
        if word.ends_with(".rs") && word.contains('/') && !root.join(word).is_file() {
            problems.push(format!("names the file {word}, which does not exist"));
        }
    }
    assert!(
        problems.is_empty(),
        "docs/ARCHITECTURE.md: {}",
        problems.join("; ")
    );
}
