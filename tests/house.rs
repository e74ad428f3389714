//! The shape of the house, checked from the source: rooms import only rooms below them, no two
//! files of `src/` import each other round a circle, no file is over 1,200 lines and no function
//! over 150 (README, "Where things are").
//!
//! Imports are read from the text: every `use` tree (braces expanded) and inline path that starts
//! with `crate::`, `super::`, `self::` or a child module's name, outside comments, strings and
//! `#[cfg(test)]` code (tests may drive anything). A path is followed through `pub use`
//! re-exports to the file that defines its item, and a re-export is no import of its own, so a
//! `mod.rs` that declares and re-exports its children is no hub of circles.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

/// Rooms from the bottom up: a room may import only rooms of a lower rank.
const ROOMS: &[(&str, u32)] = &[
    ("fsutil", 0),
    ("limits", 0),
    ("fault", 0),
    ("tensor", 0),
    ("model", 1),
    ("store", 2),
    ("footprint", 2),
    ("backend", 3),
    ("engine", 4),
    ("sparsity", 5),
    ("plan", 6),
    ("tier", 7),
    ("kv", 7),
    ("runtime", 8),
    ("service", 9),
    ("bench", 9),
    ("cli", 10),
];

const MAX_FILE_LINES: usize = 1200;
const MAX_FN_LINES: usize = 150;

type ModPath = Vec<String>;

struct Source {
    file: PathBuf,
    /// The text with comments, strings and character literals blanked (newlines kept).
    code: String,
}

fn src_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every `.rs` file under `src/`, by its module path (`src/engine/mod.rs` → `engine`).
fn sources() -> BTreeMap<ModPath, Source> {
    let mut out = BTreeMap::new();
    let mut stack = vec![src_dir()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let rel = p.strip_prefix(src_dir()).unwrap().with_extension("");
                let mut m: ModPath = rel
                    .components()
                    .map(|c| c.as_os_str().to_string_lossy().into_owned())
                    .collect();
                if m.last().is_some_and(|l| l == "mod") {
                    m.pop();
                }
                if m == ["lib"] || m == ["main"] {
                    m.clear();
                }
                let text = std::fs::read_to_string(&p).unwrap();
                out.insert(
                    m,
                    Source {
                        file: p,
                        code: blank(&text),
                    },
                );
            }
        }
    }
    out
}

/// `text` with comments, string and character literals replaced by spaces (newlines kept), so
/// braces and paths are only the code's.
fn blank(text: &str) -> String {
    let c: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    let keep_newlines = |s: &[char], out: &mut String| {
        for &ch in s {
            out.push(if ch == '\n' { '\n' } else { ' ' });
        }
    };
    while i < c.len() {
        let rest = &c[i..];
        if rest.starts_with(&['/', '/']) {
            let end = rest.iter().position(|&x| x == '\n').unwrap_or(rest.len());
            keep_newlines(&rest[..end], &mut out);
            i += end;
        } else if rest.starts_with(&['/', '*']) {
            let mut depth = 0;
            let mut j = 0;
            while j < rest.len() {
                if rest[j..].starts_with(&['/', '*']) {
                    depth += 1;
                    j += 2;
                } else if rest[j..].starts_with(&['*', '/']) {
                    depth -= 1;
                    j += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    j += 1;
                }
            }
            keep_newlines(&rest[..j], &mut out);
            i += j;
        } else if rest[0] == 'r'
            && (i == 0 || !(c[i - 1].is_alphanumeric() || c[i - 1] == '_'))
            && rest.len() > 1
            && (rest[1] == '"' || rest[1] == '#')
        {
            // Raw string r"…" / r#"…"#.
            let hashes = rest[1..].iter().take_while(|&&x| x == '#').count();
            if rest.get(1 + hashes) != Some(&'"') {
                out.push(rest[0]);
                i += 1;
                continue;
            }
            let mut j = 2 + hashes;
            while j < rest.len() {
                if rest[j] == '"' && rest[j + 1..].iter().take(hashes).all(|&x| x == '#') {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            keep_newlines(&rest[..j.min(rest.len())], &mut out);
            i += j.min(rest.len());
        } else if rest[0] == '"' {
            let mut j = 1;
            while j < rest.len() && rest[j] != '"' {
                j += if rest[j] == '\\' { 2 } else { 1 };
            }
            let j = (j + 1).min(rest.len());
            keep_newlines(&rest[..j], &mut out);
            i += j;
        } else if rest[0] == '\'' {
            // A character literal ('x', '\n', '\u{..}'), or a lifetime (kept).
            let len = if rest.get(1) == Some(&'\\') {
                rest.iter().skip(2).position(|&x| x == '\'').map(|p| p + 3)
            } else if rest.get(2) == Some(&'\'') {
                Some(3)
            } else {
                None
            };
            match len {
                Some(n) => {
                    keep_newlines(&rest[..n], &mut out);
                    i += n;
                }
                None => {
                    out.push('\'');
                    i += 1;
                }
            }
        } else {
            out.push(rest[0]);
            i += 1;
        }
    }
    out
}

/// Where the item starting at `from` ends its head: the byte of its first `;` or `{` outside
/// parentheses and brackets (`fn f(a: [u8; 4]) {` opens at the brace).
fn head_end(code: &str, from: usize) -> Option<(usize, char)> {
    let mut depth = 0i32;
    for (k, ch) in code[from..].char_indices() {
        match ch {
            '(' | '[' => depth += 1,
            ')' | ']' => depth -= 1,
            ';' | '{' if depth == 0 => return Some((from + k, ch)),
            _ => {}
        }
    }
    None
}

/// The byte range of the block that opens at the first `{` at or after `from`, to its `}`.
fn block(code: &str, from: usize) -> Option<(usize, usize)> {
    let open = from + code[from..].find('{')?;
    let mut depth = 0;
    for (k, ch) in code[open..].char_indices() {
        match ch {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some((open, open + k));
                }
            }
            _ => {}
        }
    }
    None
}

/// `code` without its `#[cfg(test)]` items (blanked, so lines keep their numbers), and the
/// modules it declares only for tests (`#[cfg(test)] mod x;`).
fn without_tests(code: &str) -> (String, Vec<String>) {
    let mut out = code.to_string();
    let mut test_mods = Vec::new();
    let mut from = 0;
    while let Some(p) = out[from..].find("#[cfg(test)]") {
        let at = from + p;
        let Some((end, ch)) = head_end(&out, at + "#[cfg(test)]".len()) else {
            break;
        };
        let close = if ch == ';' {
            let head: Vec<&str> = out[at..end].split_whitespace().collect();
            if let [.., "mod", name] = head.as_slice() {
                test_mods.push(name.to_string());
            }
            end
        } else {
            match block(&out, end) {
                Some((_, close)) => close,
                None => break,
            }
        };
        let blanked: String = out[at..=close]
            .chars()
            .map(|c| if c == '\n' { '\n' } else { ' ' })
            .collect();
        out.replace_range(at..=close, &blanked);
        from = close + 1;
    }
    (out, test_mods)
}

/// The paths of a `use` tree (`a::{b, c::{d, e as f}}` → `a::b`, `a::c::d`, `a::c::e`), each
/// with the name it is brought in as where renamed.
fn expand_use(tree: &str) -> Vec<(String, Option<String>)> {
    let tree = tree.trim();
    let (Some(open), Some(close)) = (tree.find('{'), tree.rfind('}')) else {
        let mut words = tree.split_whitespace();
        let path = words.next().unwrap_or("").to_string();
        let renamed = match (words.next(), words.next()) {
            (Some("as"), Some(name)) => Some(name.to_string()),
            _ => None,
        };
        return vec![(path, renamed)];
    };
    let prefix: String = tree[..open].split_whitespace().collect();
    let inner = &tree[open + 1..close];
    let mut items = Vec::new();
    let (mut depth, mut start) = (0, 0);
    for (k, ch) in inner.char_indices() {
        match ch {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                items.push(&inner[start..k]);
                start = k + 1;
            }
            _ => {}
        }
    }
    items.push(&inner[start..]);
    items
        .into_iter()
        .filter(|i| !i.trim().is_empty())
        .flat_map(|i| {
            expand_use(i)
                .into_iter()
                .map(|(p, r)| (format!("{prefix}{p}"), r))
        })
        .collect()
}

/// A path as written in module `at` (`crate::…`, `super::…`, `self::…`), made absolute; `None`
/// for paths into other crates.
fn absolute(at: &[String], path: &str) -> Option<ModPath> {
    let path = path.trim_end_matches("::*");
    let mut segs = path.split("::").filter(|s| !s.is_empty() && *s != "self");
    let first = path.split("::").next()?;
    let mut base: ModPath = match first {
        "crate" => {
            segs.next();
            Vec::new()
        }
        "super" | "self" => at.to_vec(),
        _ => return None,
    };
    for s in segs.by_ref() {
        if s == "super" {
            base.pop();
        } else {
            base.push(s.to_string());
        }
    }
    Some(base)
}

/// The modules `code` declares in files of their own (`mod x;`, `pub mod x;`): paths may start
/// with their names (`use x::Item`, `x::f()`).
fn child_modules(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(p) = code[i..].find("mod ") {
        let s = i + p;
        i = s + 4;
        if s > 0 && code[..s].ends_with(|c: char| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let name: String = code[i..]
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() && code[i + name.len()..].trim_start().starts_with(';') {
            out.push(name);
        }
    }
    out
}

/// `code` with its re-exports (`pub use …;`, `pub(crate) use …;`) blanked: a re-export is no
/// import (paths through it are followed to the defining file).
fn without_reexports(code: &str) -> String {
    let mut out = code.to_string();
    let mut i = 0;
    while let Some(p) = out[i..].find("pub") {
        let s = i + p;
        i = s + 3;
        if s > 0 && out[..s].ends_with(|c: char| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let rest = &out[i..];
        let after_vis = match rest.strip_prefix('(') {
            Some(r) => r.find(')').map_or(0, |k| k + 2),
            None => 0,
        };
        let tail = &out[i + after_vis..];
        if !tail.trim_start().starts_with("use ") {
            continue;
        }
        let Some(end) = out[s..].find(';') else { break };
        let blanked: String = out[s..=s + end]
            .chars()
            .map(|c| if c == '\n' { '\n' } else { ' ' })
            .collect();
        out.replace_range(s..=s + end, &blanked);
        i = s + end + 1;
    }
    out
}

/// Every path module `at` names: its `use` trees and inline `crate::`/`super::`/`self::` paths,
/// and paths that start with one of its child modules (re-exports left out).
fn paths_named(at: &[String], code: &str) -> Vec<ModPath> {
    let children = child_modules(code);
    let code = &without_reexports(code);
    let relative = |path: &str| -> String {
        match path.split("::").next() {
            Some(first) if children.iter().any(|c| c == first) => format!("self::{path}"),
            _ => path.to_string(),
        }
    };
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(p) = code[i..].find("use ") {
        let s = i + p;
        let boundary = s == 0 || !code[..s].ends_with(|c: char| c.is_alphanumeric() || c == '_');
        i = s + 4;
        if !boundary {
            continue;
        }
        let Some(end) = code[i..].find(';') else {
            break;
        };
        for (path, _) in expand_use(&code[i..i + end]) {
            out.extend(absolute(at, &relative(&path)));
        }
    }
    let starts = ["crate::", "super::", "self::"]
        .map(str::to_string)
        .into_iter()
        .chain(children.iter().map(|c| format!("{c}::")));
    for start in starts {
        let mut i = 0;
        while let Some(p) = code[i..].find(&start) {
            let s = i + p;
            i = s + start.len();
            if s > 0 && code[..s].ends_with(|c: char| c.is_alphanumeric() || c == '_' || c == ':') {
                continue;
            }
            // `crate::{…}`, `super::*`: a `use` tree, read above.
            if !code[i..].starts_with(|c: char| c.is_alphabetic() || c == '_') {
                continue;
            }
            let len = code[s..]
                .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                .unwrap_or(code.len() - s);
            let path = relative(code[s..s + len].trim_end_matches(':'));
            out.extend(absolute(at, &path).filter(|p| !p.is_empty()));
        }
    }
    // A `use` line is also read as an inline path: keep each path once.
    let mut seen = BTreeSet::new();
    out.retain(|p| seen.insert(p.clone()));
    out
}

/// The items module `m` re-exports (`pub use …`): name → the absolute paths it stands for.
fn reexports(at: &[String], code: &str) -> HashMap<String, Vec<ModPath>> {
    let mut out: HashMap<String, Vec<ModPath>> = HashMap::new();
    let mut i = 0;
    while let Some(p) = code[i..].find("pub") {
        let s = i + p;
        i = s + 3;
        let rest = &code[i..];
        let rest = match rest.strip_prefix('(') {
            Some(r) => &r[r.find(')').map_or(0, |k| k + 1)..],
            None => rest,
        };
        let Some(tree) = rest.trim_start().strip_prefix("use ") else {
            continue;
        };
        let Some(end) = tree.find(';') else { break };
        for (path, renamed) in expand_use(&tree[..end]) {
            let Some(mut abs) = absolute(at, &path).or_else(|| {
                // A child module's item: `pub use child::Item`.
                let mut m = at.to_vec();
                m.extend(path.split("::").map(str::to_string));
                Some(m)
            }) else {
                continue;
            };
            if abs.last().is_some_and(|l| l == "*") {
                abs.pop();
            }
            if let Some(name) = renamed.or_else(|| abs.last().cloned()) {
                out.entry(name).or_default().push(abs);
            }
        }
    }
    out
}

struct House {
    sources: BTreeMap<ModPath, Source>,
    /// Each module's code outside its tests.
    live: BTreeMap<ModPath, String>,
    /// Modules declared only for tests (`#[cfg(test)] mod x;`).
    test_only: BTreeSet<ModPath>,
    reexports: HashMap<ModPath, HashMap<String, Vec<ModPath>>>,
}

impl House {
    fn read() -> Self {
        let sources = sources();
        let mut live = BTreeMap::new();
        let mut test_only = BTreeSet::new();
        for (m, s) in &sources {
            let (code, mods) = without_tests(&s.code);
            live.insert(m.clone(), code);
            for name in mods {
                let mut t = m.clone();
                t.push(name);
                test_only.insert(t);
            }
        }
        let reexports = live
            .iter()
            .map(|(m, code)| (m.clone(), reexports(m, code)))
            .collect();
        House {
            sources,
            live,
            test_only,
            reexports,
        }
    }

    /// The file (module) that defines what `path` names: its longest module prefix, followed
    /// through that module's re-exports of the next segment.
    fn resolve(&self, path: &[String], depth: usize) -> Option<ModPath> {
        for k in (0..=path.len()).rev() {
            let m = &path[..k];
            if !self.sources.contains_key(m) {
                continue;
            }
            if let (Some(item), true) = (path.get(k), depth < 8)
                && let Some(targets) = self.reexports.get(m).and_then(|r| r.get(item))
            {
                for t in targets {
                    let mut full = t.clone();
                    full.extend(path[k + 1..].iter().cloned());
                    if let Some(r) = self.resolve(&full, depth + 1)
                        && r != m
                    {
                        return Some(r);
                    }
                }
            }
            return Some(m.to_vec());
        }
        None
    }

    /// File → the files it imports (outside tests), each with one path that shows it.
    fn imports(&self) -> BTreeMap<ModPath, BTreeMap<ModPath, String>> {
        let mut g: BTreeMap<ModPath, BTreeMap<ModPath, String>> = BTreeMap::new();
        for (m, code) in &self.live {
            if self.test_only.contains(m) {
                continue;
            }
            let edges = g.entry(m.clone()).or_default();
            for p in paths_named(m, code) {
                if let Some(t) = self.resolve(&p, 0)
                    && &t != m
                    && !t.is_empty()
                    && !self.test_only.contains(&t)
                {
                    edges.entry(t).or_insert_with(|| p.join("::"));
                }
            }
        }
        g
    }

    fn file(&self, m: &ModPath) -> String {
        relative(&self.sources[m].file)
    }
}

/// `file` from the project root (`src/…`).
fn relative(file: &Path) -> String {
    file.strip_prefix(src_dir().parent().unwrap())
        .unwrap_or(file)
        .display()
        .to_string()
}

fn room(m: &[String]) -> &str {
    m.first().map_or("lib", String::as_str)
}

fn rank(room: &str) -> Option<u32> {
    ROOMS.iter().find(|(r, _)| *r == room).map(|(_, k)| *k)
}

#[test]
fn rooms_import_only_rooms_below_them() {
    let house = House::read();
    let mut wrong = Vec::new();
    for (m, edges) in house.imports() {
        if m.is_empty() {
            continue;
        }
        let from = room(&m);
        let Some(rf) = rank(from) else {
            wrong.push(format!(
                "{}: room `{from}` has no place in ROOMS",
                house.file(&m)
            ));
            continue;
        };
        for (t, via) in edges {
            let to = room(&t);
            if to == from {
                continue;
            }
            match rank(to) {
                Some(rt) if rt < rf => {}
                _ => wrong.push(format!(
                    "{} ({from}) imports {to} by `{via}`",
                    house.file(&m)
                )),
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "imports against the rooms' order:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn no_files_import_each_other_round_a_circle() {
    let house = House::read();
    // A module's files may use what an enclosing module defines (its error type, the core struct
    // its children share): that arrow points at the room's own hub and is what `super::` is for.
    // Circles among siblings and across the tree are what this looks for.
    let mut g = house.imports();
    for (m, edges) in g.iter_mut() {
        edges.retain(|t, _| !(t.len() < m.len() && m.starts_with(t)));
    }
    // Tarjan's strongly connected components.
    struct Walk<'a> {
        g: &'a BTreeMap<ModPath, BTreeMap<ModPath, String>>,
        index: HashMap<&'a ModPath, usize>,
        low: HashMap<&'a ModPath, usize>,
        stack: Vec<&'a ModPath>,
        on: BTreeSet<&'a ModPath>,
        found: Vec<Vec<&'a ModPath>>,
    }
    impl<'a> Walk<'a> {
        fn visit(&mut self, v: &'a ModPath) {
            let n = self.index.len();
            self.index.insert(v, n);
            self.low.insert(v, n);
            self.stack.push(v);
            self.on.insert(v);
            for w in self.g.get(v).into_iter().flat_map(|e| e.keys()) {
                if !self.g.contains_key(w) {
                    continue;
                }
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let lw = self.low[w];
                    let lv = self.low.get_mut(v).unwrap();
                    *lv = (*lv).min(lw);
                } else if self.on.contains(w) {
                    let iw = self.index[w];
                    let lv = self.low.get_mut(v).unwrap();
                    *lv = (*lv).min(iw);
                }
            }
            if self.low[v] == self.index[v] {
                let mut comp = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on.remove(w);
                    comp.push(w);
                    if w == v {
                        break;
                    }
                }
                if comp.len() > 1 {
                    self.found.push(comp);
                }
            }
        }
    }
    let mut walk = Walk {
        g: &g,
        index: HashMap::new(),
        low: HashMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        found: Vec::new(),
    };
    for v in g.keys() {
        if !walk.index.contains_key(v) {
            walk.visit(v);
        }
    }
    let circles: Vec<String> = walk
        .found
        .iter()
        .map(|comp| {
            let set: BTreeSet<&ModPath> = comp.iter().copied().collect();
            let mut lines = Vec::new();
            for &m in comp {
                for (t, via) in &g[m] {
                    if set.contains(t) {
                        lines.push(format!("  {} → {} (`{via}`)", house.file(m), house.file(t)));
                    }
                }
            }
            lines.join("\n")
        })
        .collect();
    assert!(
        circles.is_empty(),
        "files importing each other round a circle:\n{}",
        circles.join("\n\n")
    );
}

#[test]
fn no_file_is_over_1200_lines() {
    let house = House::read();
    let long: Vec<String> = house
        .sources
        .values()
        .map(|s| (s, std::fs::read_to_string(&s.file).unwrap().lines().count()))
        .filter(|&(_, n)| n > MAX_FILE_LINES)
        .map(|(s, n)| format!("{}: {n} lines", relative(&s.file)))
        .collect();
    assert!(
        long.is_empty(),
        "files over {MAX_FILE_LINES} lines:\n{}",
        long.join("\n")
    );
}

/// `(name, first line, lines)` of every function in `code` (nested ones too).
fn functions(code: &str) -> Vec<(String, usize, usize)> {
    let line_of = |at: usize| code[..at].matches('\n').count() + 1;
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(p) = code[i..].find("fn ") {
        let s = i + p;
        i = s + 3;
        if s > 0 && code[..s].ends_with(|c: char| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let name: String = code[i..]
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if name.is_empty() {
            continue;
        }
        // A declaration without a body (trait methods) ends at `;` before any `{`.
        let Some((head, '{')) = head_end(code, i) else {
            continue;
        };
        if let Some((_, close)) = block(code, head) {
            out.push((name, line_of(s), line_of(close) - line_of(s) + 1));
        }
    }
    out
}

#[test]
fn no_function_is_over_150_lines() {
    let house = House::read();
    let mut long = Vec::new();
    for s in house.sources.values() {
        for (name, line, n) in functions(&s.code) {
            if n > MAX_FN_LINES {
                long.push(format!("{}:{line} fn {name}: {n} lines", relative(&s.file)));
            }
        }
    }
    assert!(
        long.is_empty(),
        "functions over {MAX_FN_LINES} lines:\n{}",
        long.join("\n")
    );
}

#[test]
fn the_checks_see_what_they_check() {
    // The reader sees through comments, strings and re-exports, and finds what it looks for.
    let code =
        blank("let s = \"use crate::x;\"; // crate::y\nuse crate::{a::B, c::{d, e as f}};\n");
    let at: ModPath = vec!["engine".into()];
    let named = paths_named(&at, &code);
    let named: Vec<String> = named.iter().map(|p| p.join("::")).collect();
    assert_eq!(named, ["a::B", "c::d", "c::e"]);
    // Paths through a child module declared here are the child's.
    let code = blank("mod kv;\nuse kv::Rows;\nfn f() { kv::g(); }\n");
    let named: Vec<String> = paths_named(&at, &code)
        .iter()
        .map(|p| p.join("::"))
        .collect();
    assert_eq!(named, ["engine::kv::Rows", "engine::kv::g"]);
    let fns = functions(&blank(
        "fn a() {\n    let c = '{';\n}\nfn b();\nfn c(x: [u8; 2]) { }\nfn d<'a>(s: &'a str) {\n}\n",
    ));
    let want = [("a", 1, 3), ("c", 5, 1), ("d", 6, 2)].map(|(n, l, c)| (n.to_string(), l, c));
    assert_eq!(fns, want);
    let reexported = without_reexports("pub use a::B;\npub(crate) use c::D;\nuse e::F;\n");
    assert!(!reexported.contains("a::B") && !reexported.contains("c::D"));
    assert!(reexported.contains("use e::F;"));
    let (no_tests, test_mods) = without_tests(
        "fn x() {}\n#[cfg(test)]\nmod tests {\n use crate::y;\n}\n#[cfg(test)]\nmod more;\nfn f(a: [u8; 4]) {}\n",
    );
    assert!(!no_tests.contains("crate::y") && no_tests.lines().count() == 8);
    assert!(no_tests.contains("fn f(a: [u8; 4]) {}") && !no_tests.contains("more"));
    assert_eq!(test_mods, ["more"]);
    // Every room of src/ has its place.
    let house = House::read();
    for m in house.sources.keys().filter(|m| !m.is_empty()) {
        assert!(rank(room(m)).is_some(), "room `{}` has no rank", room(m));
    }
    // The engine imports the backend (an arrow the order allows): the reader sees imports.
    let g = house.imports();
    assert!(
        g.iter()
            .any(|(m, e)| room(m) == "engine" && e.keys().any(|t| room(t) == "backend"))
    );
}
