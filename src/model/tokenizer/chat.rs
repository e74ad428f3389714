//! Chat templates: render a model's Jinja template with minijinja the way transformers'
//! `apply_chat_template` does (trim_blocks, lstrip_blocks, loop controls, Python string and dict
//! methods, `raise_exception`, `strftime_now`, a Python-style `tojson`).

use std::collections::BTreeMap;
use std::sync::Arc;

use minijinja::value::{Enumerator, Kwargs, Object, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};

use super::{ChatMessage, TokenizeError};

/// Render `template` for `messages`.
pub(crate) fn render(
    template: &str,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<String, TokenizeError> {
    let env = environment()?;
    let guarded = guard_namespace_sets(template);
    let tmpl = env
        .template_from_str(&guarded)
        .map_err(|e| TokenizeError(format!("chat template does not parse: {e:#}")))?;
    let messages: Vec<Value> = messages
        .iter()
        .map(|m| Value::from_object(Message(m.clone())))
        .collect();
    let ctx = BTreeMap::from([
        ("messages", Value::from(messages)),
        ("add_generation_prompt", Value::from(add_generation_prompt)),
        ("bos_token", Value::from(bos_token)),
        ("eos_token", Value::from(eos_token)),
    ]);
    tmpl.render(ctx)
        .map_err(|e| TokenizeError(format!("chat template failed: {e:#}")))
}

/// A message as a template sees it: a map with keys in Python's order (role, then content).
#[derive(Debug)]
struct Message(ChatMessage);

impl Object for Message {
    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        match key.as_str()? {
            "role" => Some(Value::from(self.0.role.as_str())),
            "content" => Some(Value::from(self.0.content.as_str())),
            _ => None,
        }
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Str(&["role", "content"])
    }
}

fn environment() -> Result<Environment<'static>, TokenizeError> {
    let mut env = Environment::new();
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
        .map_err(|e| TokenizeError(format!("chat template syntax: {e}")))?;
    env.set_syntax(syntax);
    minijinja_contrib::add_to_environment(&mut env);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_filter("tojson", tojson);
    env.add_filter(NAMESPACE_VALUE_FILTER, namespace_value);
    env.add_filter("string", |v: Value| -> Result<String, Error> {
        within_depth(&v, 0)?;
        Ok(v.to_string())
    });
    // A value shown is walked first: a namespace set into itself (`{% set ns.n = ns %}`, found
    // by the fuzzer) would otherwise recurse until the stack overflows and abort the process.
    env.set_formatter(|out, state, value| {
        within_depth(value, 0)?;
        minijinja::escape_formatter(out, state, value)
    });
    Ok(env)
}

/// The filter every value a template stores in a namespace goes through
/// ([`guard_namespace_sets`]).
const NAMESPACE_VALUE_FILTER: &str = "__gpu_offload_namespace_value";

/// `template` with the value of every `{% set NS.attr = VALUE %}` passed through
/// [`namespace_value`]: a namespace is the only value a template can change, so one that
/// holds no map (no namespace) can never hold itself. A namespace set into itself
/// (`{% set ns.n = ns %}`, found by the fuzzer) made showing, comparing or joining it recurse
/// until the stack overflowed and aborted the process; minijinja has no hook on the
/// assignment. Tags inside `{{ }}`, comments and raw blocks are left alone.
fn guard_namespace_sets(template: &str) -> String {
    let mut out = String::with_capacity(template.len() + 64);
    let mut rest = template;
    loop {
        let Some(open) = rest.find('{') else {
            out.push_str(rest);
            return out;
        };
        out.push_str(&rest[..open]);
        rest = &rest[open..];
        let (end, rewritten) = match rest.as_bytes().get(1) {
            Some(b'{') => (tag_end(rest, 2, "}}"), None),
            Some(b'#') => (rest[2..].find("#}").map(|i| i + 4), None),
            Some(b'%') => statement(rest),
            _ => (Some(1), None),
        };
        let Some(end) = end else {
            // Unterminated: the parser says what is wrong.
            out.push_str(rest);
            return out;
        };
        match rewritten {
            Some(s) => out.push_str(&s),
            None => out.push_str(&rest[..end]),
        }
        rest = &rest[end..];
    }
}

/// The byte just past the `close` that ends the tag opened at `rest[0]`, from `from`, outside
/// string literals.
fn tag_end(rest: &str, from: usize, close: &str) -> Option<usize> {
    let b = rest.as_bytes();
    let mut i = from;
    let mut quote = None;
    while i < b.len() {
        match (quote, b[i]) {
            (Some(_), b'\\') => i += 1,
            (Some(q), c) if c == q => quote = None,
            (None, c @ (b'\'' | b'"')) => quote = Some(c),
            // Bytes, not `rest[i..]`: `i` may fall inside a character.
            (None, _) if b[i..].starts_with(close.as_bytes()) => return Some(i + close.len()),
            _ => {}
        }
        i += 1;
    }
    None
}

/// A `{% … %}` statement at `rest[0]`: its length, and its rewrite where it sets a namespace's
/// attribute (a raw block is passed through whole).
fn statement(rest: &str) -> (Option<usize>, Option<String>) {
    let Some(end) = tag_end(rest, 2, "%}") else {
        return (None, None);
    };
    let inner = rest[2..end - 2].trim_start_matches(['-', '+']);
    let body = inner.trim_start();
    if body.starts_with("raw")
        && body[3..]
            .trim_matches(['-', '+', ' ', '\t', '\n', '\r'])
            .is_empty()
    {
        let close = rest[end..]
            .find("endraw")
            .and_then(|i| tag_end(rest, end + i, "%}"));
        return (close.or(Some(end)), None);
    }
    let Some(after_set) = body.strip_prefix("set") else {
        return (Some(end), None);
    };
    if !after_set.starts_with(char::is_whitespace) {
        return (Some(end), None);
    }
    let Some(eq) = after_set.find('=') else {
        return (Some(end), None);
    };
    if !after_set[..eq].contains('.') {
        return (Some(end), None);
    }
    // The value runs from after `=` to the closing marker (`%}`, `-%}` or `+%}`).
    let value_start = end - 2 - inner.len() + (inner.len() - body.len()) + 3 + eq + 1;
    let mut value_end = end - 2;
    if matches!(rest.as_bytes()[value_end - 1], b'-' | b'+') && value_end - 1 > value_start {
        value_end -= 1;
    }
    let rewritten = format!(
        "{}({}) | {NAMESPACE_VALUE_FILTER} {}",
        &rest[..value_start],
        &rest[value_start..value_end],
        &rest[value_end..end]
    );
    (Some(end), Some(rewritten))
}

/// A value a template stores in a namespace, refused when it is or holds a map (a namespace
/// among them), or is nested deeper than [`MAX_VALUE_DEPTH`].
fn namespace_value(v: Value) -> Result<Value, Error> {
    within_depth(&v, 0)?;
    if holds_map(&v)? {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "a namespace may hold strings, numbers, booleans and lists of them here, not maps \
             or namespaces (one that held itself would never end)",
        ));
    }
    Ok(v)
}

fn holds_map(v: &Value) -> Result<bool, Error> {
    match v.kind() {
        ValueKind::Map => Ok(v.downcast_object_ref::<Message>().is_none()),
        ValueKind::Seq => {
            for item in v.try_iter()? {
                if holds_map(&item)? {
                    return Ok(true);
                }
            }
            Ok(false)
        }
        _ => Ok(false),
    }
}

/// The widest `tojson(indent=…)` a template may ask for.
const MAX_JSON_INDENT: usize = 64;

/// Deepest nesting of lists and maps a template may show or serialise.
const MAX_VALUE_DEPTH: usize = 64;

/// `v` (at nesting `depth`) holds no list or map nested deeper than [`MAX_VALUE_DEPTH`].
fn within_depth(v: &Value, depth: usize) -> Result<(), Error> {
    if !matches!(v.kind(), ValueKind::Seq | ValueKind::Map) {
        return Ok(());
    }
    if depth >= MAX_VALUE_DEPTH {
        return Err(too_deep());
    }
    let map = v.kind() == ValueKind::Map;
    for item in v.try_iter()? {
        let inner = if map { v.get_item(&item)? } else { item };
        within_depth(&inner, depth + 1)?;
    }
    Ok(())
}

fn too_deep() -> Error {
    Error::new(
        ErrorKind::InvalidOperation,
        format!("a value nested deeper than {MAX_VALUE_DEPTH} levels (one that holds itself?)"),
    )
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// Python's `json.dumps(value, ensure_ascii=False, indent=indent)` (what transformers' `tojson`
/// does): `", "` and `": "` separators without indent, newlines with it.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    // Found by the fuzzer: `indent=222222222222` asked for that many spaces a line.
    if let Some(n) = indent.filter(|&n| n > MAX_JSON_INDENT) {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson indent {n} is over {MAX_JSON_INDENT}"),
        ));
    }
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    let _: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(&value, indent, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

fn write_json(
    v: &Value,
    indent: Option<usize>,
    depth: usize,
    out: &mut String,
) -> Result<(), Error> {
    if depth > MAX_VALUE_DEPTH {
        return Err(too_deep());
    }
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&v.to_string()),
        ValueKind::String => write_json_string(v.as_str().unwrap_or_default(), out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            write_container(out, indent, depth, ('[', ']'), &items, |item, out| {
                write_json(item, indent, depth + 1, out)
            })?;
        }
        ValueKind::Map => {
            let keys: Vec<Value> = v.try_iter()?.collect();
            write_container(out, indent, depth, ('{', '}'), &keys, |key, out| {
                write_json_string(&key.to_string(), out);
                out.push_str(": ");
                write_json(&v.get_item(key)?, indent, depth + 1, out)
            })?;
        }
        _ => {
            within_depth(v, depth)?;
            write_json_string(&v.to_string(), out)
        }
    }
    Ok(())
}

fn write_container(
    out: &mut String,
    indent: Option<usize>,
    depth: usize,
    (open, close): (char, char),
    items: &[Value],
    mut item: impl FnMut(&Value, &mut String) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if items.is_empty() {
        out.push(close);
        return Ok(());
    }
    let newline = |out: &mut String, level: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * level));
        }
    };
    for (i, v) in items.iter().enumerate() {
        if i > 0 {
            out.push_str(if indent.is_some() { "," } else { ", " });
        }
        newline(out, depth + 1);
        item(v, out)?;
    }
    newline(out, depth);
    out.push(close);
    Ok(())
}

fn write_json_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0C}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// The current UTC time formatted with the common `strftime` directives (Llama 3 templates put
/// `strftime_now("%d %b %Y")` in their system prompt).
fn strftime_now(format: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format_time(secs, &format)
}

fn format_time(unix_secs: u64, format: &str) -> String {
    let (y, m, d) = civil_from_days((unix_secs / 86_400) as i64);
    let tod = unix_secs % 86_400;
    let month = MONTHS[(m - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('B') => out.push_str(month),
            Some('b') => out.push_str(&month[..3]),
            Some('H') => out.push_str(&format!("{:02}", tod / 3600)),
            Some('M') => out.push_str(&format!("{:02}", tod / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", tod % 60)),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// (year, month 1..=12, day 1..=31) of a day count since 1970-01-01 (proleptic Gregorian).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: &str, content: &str) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }

    #[test]
    fn renders_hf_style_templates() {
        let t = "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}SYS\n{% endif %}\
                 {{ '<' + m.role + '>' + m.content.strip() }}\n{% endfor %}\
                 {% if add_generation_prompt %}<assistant>{% endif %}";
        let out = render(t, &[msg("user", "  hi  ")], true, "<s>", "</s>").unwrap();
        assert_eq!(out, "SYS\n<user>hi\n<assistant>");
    }

    /// Found by the fuzzer: a namespace set into itself, then shown or serialised, recursed
    /// until the stack overflowed (the process aborted). The assignment is refused now, and a
    /// value too deep to show is an error of its own.
    #[test]
    fn a_value_that_holds_itself_is_an_error() {
        let deep = format!("{}1{}", "[".repeat(70), "]".repeat(70));
        for show in ["{{ x }}", "{{ x | tojson }}", "{{ x | string }}"] {
            let t = format!("{{% set x = {deep} %}}{show}");
            let err = render(&t, &[], false, "", "").unwrap_err();
            assert!(err.0.contains("nested deeper than"), "{show}: {err}");
        }
        let set = "{% set ns = namespace(n=0) %}{% set ns.n = ns %}";
        for show in [
            "{{ ns }}",
            "{{ ns.n }}",
            "{{ ns | tojson }}",
            "{{ ns | string }}",
        ] {
            let err = render(&format!("{set}{show}"), &[], false, "", "").unwrap_err();
            assert!(err.0.contains("may hold strings"), "{show}: {err}");
        }
        // Deep but finite values are shown.
        let out = render("{{ [[[1]]] | tojson }}{{ [[2]] }}", &[], false, "", "").unwrap();
        assert_eq!(out, "[[[1]]][[2]]");
        // Nor can a namespace come to hold itself, however it is then used.
        for (set, then) in [
            ("{% set ns.n = ns %}", "{{ 'a' ~ ns }}"),
            ("{%- set ns.n = [1, ns] -%}", "{{ ns == ns.n }}"),
            ("{% set m = ns %}{% set ns.n = m %}", "{{ ns.n == m }}"),
            ("{% set ns.a, ns.b = [ns, 1] %}", "{{ ns ~ '' }}"),
        ] {
            let t = format!("{{% set ns = namespace(n=0) %}}{set}{then}");
            let err = render(&t, &[], false, "", "").unwrap_err();
            assert!(err.0.contains("may hold strings"), "{t}: {err}");
        }
    }

    /// Found by the CI fuzz run of the first version of the rewrite: a multi-byte character
    /// inside a tag made it slice through the character.
    /// Found by the long fuzz run: an indent of 222222222222 aborted on the allocation.
    #[test]
    fn a_huge_tojson_indent_is_an_error() {
        let err = render(
            "{{ [1] | tojson(indent=222222222222) }}",
            &[],
            false,
            "",
            "",
        )
        .unwrap_err();
        assert!(err.0.contains("indent 222222222222 is over 64"), "{err}");
        assert_eq!(
            render("{{ [1] | tojson(indent=64) }}", &[], false, "", "")
                .unwrap()
                .len(),
            69
        );
    }

    #[test]
    fn tags_with_multibyte_characters_are_scanned_by_bytes() {
        let t =
            "{{ 'é' ~ '%}' }}{% set ns = namespace(a='ü') %}{% set ns.a = 'ß→' %}{{ ns.a }}{# ☃ #}";
        assert_eq!(render(t, &[], false, "", "").unwrap(), "é%}ß→");
        for t in ["{{ '€", "{% set ns.a = '€ %}", "{# ☃"] {
            assert!(render(t, &[], false, "", "").is_err(), "{t}");
        }
    }

    #[test]
    fn namespaces_keep_working_as_templates_use_them() {
        let t = "{%- set ns = namespace(found=false, n=0, last='', ids=[]) -%}\
                 {%- for m in messages -%}{%- set ns.n = ns.n + 1 -%}\
                 {%- if m.role == 'user' %}{% set ns.found = true %}{% set ns.last = m.content %}\
                 {%- set ns.ids = ns.ids + [loop.index0] %}{% endif -%}{%- endfor -%}\
                 {{ ns.found }} {{ ns.n }} {{ ns.last }} {{ ns.ids }} {{ '{% set a.b = c %}' }}\
                 {# {% set ns.n = ns %} #}{% raw %}{% set x.y = z %}{% endraw %}";
        let out = render(
            t,
            &[msg("user", "a"), msg("assistant", "b"), msg("user", "c=d")],
            false,
            "",
            "",
        )
        .unwrap();
        assert_eq!(out, "True 3 c=d [0, 2] {% set a.b = c %}{% set x.y = z %}");
    }

    #[test]
    fn raise_exception_is_an_error() {
        let t = "{{ raise_exception('only user and assistant roles') }}";
        let err = render(t, &[], false, "", "").unwrap_err();
        assert!(err.0.contains("only user and assistant roles"), "{err}");
    }

    #[test]
    fn tojson_is_pythons() {
        let t = "{{ messages[0] | tojson }}|{{ [1, 'a\"'] | tojson(indent=2) }}";
        let out = render(t, &[msg("user", "é\n")], false, "", "").unwrap();
        assert_eq!(
            out,
            "{\"role\": \"user\", \"content\": \"é\\n\"}|[\n  1,\n  \"a\\\"\"\n]"
        );
    }

    #[test]
    fn dates_format_like_strftime() {
        // 2024-07-23 12:34:56 UTC
        assert_eq!(
            format_time(1_721_738_096, "%d %b %Y %H:%M:%S"),
            "23 Jul 2024 12:34:56"
        );
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(-1), (1969, 12, 31));
    }
}
