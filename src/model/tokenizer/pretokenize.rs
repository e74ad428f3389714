//! Byte-level BPE pre-tokenizers: how a GGUF's `tokenizer.ggml.pre` name splits text into words
//! before merging, exactly as llama.cpp does it.
//!
//! llama.cpp applies a list of regexes in sequence, each one refining the pieces the previous one
//! produced (a piece never grows back). The GPT-2 and Llama-3/Qwen2 regexes are implemented there
//! by hand-written scanners whose behaviour differs from a real regex engine in corner cases (e.g.
//! `\s+(?!\S)` at the end of a piece), so those are scanners here too, written to the same rules;
//! the simple regexes (digits, punctuation runs) go through the `regex` crate, whose
//! leftmost-first semantics equal the ECMAScript engine llama.cpp uses for them.

use std::ops::Range;

use regex::Regex;

use super::unicode::{Flags, category_class, flags};

/// One splitting pass.
#[derive(Clone, Debug)]
enum Step {
    /// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
    Gpt2,
    /// `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,K}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
    /// with K = 3 (Llama 3) or 1 (Qwen2).
    Llama3 { max_digits: usize },
    /// Matches and the text between them become pieces.
    Regex(Regex),
}

/// A pre-tokenizer and the vocabulary settings llama.cpp ties to its name.
#[derive(Clone, Debug)]
pub(crate) struct PreTokenizer {
    pub name: String,
    steps: Vec<Step>,
    /// A word that is itself a token is emitted whole, without merging.
    pub ignore_merges: bool,
    /// Detokenize removes spaces before punctuation and in some contractions.
    pub clean_spaces: bool,
    /// Overrides the add-BOS default (metadata still wins).
    pub add_bos: Option<bool>,
    /// The vocabulary has no BOS token whatever its default.
    pub no_bos: bool,
}

#[derive(Clone, Copy)]
enum Family {
    Default,
    Falcon,
    Gpt2,
    SmolLm,
    Llama3,
    Qwen2,
}

/// Vocabulary settings llama.cpp ties to a pre-tokenizer name.
#[derive(Clone, Copy)]
struct NameSettings {
    clean_spaces: bool,
    ignore_merges: bool,
    add_bos: Option<bool>,
    no_bos: bool,
}

const CLEAN: NameSettings = NameSettings {
    clean_spaces: true,
    ignore_merges: false,
    add_bos: None,
    no_bos: false,
};
const KEEP_SPACES: NameSettings = NameSettings {
    clean_spaces: false,
    ..CLEAN
};
const LLAMA3: NameSettings = NameSettings {
    ignore_merges: true,
    add_bos: Some(true),
    ..CLEAN
};
const NO_BOS: NameSettings = NameSettings {
    no_bos: true,
    ..CLEAN
};
const NO_BOS_IGNORE_MERGES: NameSettings = NameSettings {
    ignore_merges: true,
    ..NO_BOS
};

/// Every supported `tokenizer.ggml.pre` name, as llama.cpp's vocabulary loader maps it. Names
/// llama.cpp knows but whose regexes are not implemented here are left out, so they are refused
/// with a clear error instead of tokenizing differently.
#[rustfmt::skip]
const NAMES: &[(&str, Family, NameSettings)] = &[
    ("default",           Family::Default, CLEAN),
    ("falcon",            Family::Falcon,  CLEAN),
    // "gpt2" is not a llama.cpp name; accepted as an alias of "gpt-2".
    ("gpt2",              Family::Gpt2,    CLEAN),
    ("gpt-2",             Family::Gpt2,    CLEAN),
    ("phi-2",             Family::Gpt2,    CLEAN),
    ("jina-es",           Family::Gpt2,    CLEAN),
    ("jina-de",           Family::Gpt2,    CLEAN),
    ("gigachat",          Family::Gpt2,    CLEAN),
    ("jina-v2-es",        Family::Gpt2,    CLEAN),
    ("jina-v2-de",        Family::Gpt2,    CLEAN),
    ("a.x-4.0",           Family::Gpt2,    CLEAN),
    ("mellum",            Family::Gpt2,    CLEAN),
    ("modern-bert",       Family::Gpt2,    CLEAN),
    ("mpt",               Family::Gpt2,    CLEAN),
    ("olmo",              Family::Gpt2,    CLEAN),
    ("jais",              Family::Gpt2,    CLEAN),
    ("exaone4",           Family::Gpt2,    CLEAN),
    ("trillion",          Family::Gpt2,    KEEP_SPACES),
    ("granite-docling",   Family::Gpt2,    KEEP_SPACES),
    ("starcoder",         Family::SmolLm,  CLEAN),
    ("refact",            Family::SmolLm,  CLEAN),
    ("codeshell",         Family::SmolLm,  CLEAN),
    ("exaone",            Family::SmolLm,  CLEAN),
    ("minerva-7b",        Family::SmolLm,  CLEAN),
    ("mellum2",           Family::SmolLm,  CLEAN),
    ("command-r",         Family::SmolLm,  KEEP_SPACES),
    ("smollm",            Family::SmolLm,  KEEP_SPACES),
    ("llama3",            Family::Llama3,  LLAMA3),
    ("llama-v3",          Family::Llama3,  LLAMA3),
    ("llama-bpe",         Family::Llama3,  LLAMA3),
    ("falcon3",           Family::Llama3,  LLAMA3),
    ("falcon-h1",         Family::Llama3,  LLAMA3),
    ("pixtral",           Family::Llama3,  LLAMA3),
    ("midm-2.0",          Family::Llama3,  LLAMA3),
    ("lfm2",              Family::Llama3,  LLAMA3),
    ("jina-v5-nano",      Family::Llama3,  LLAMA3),
    ("dbrx",              Family::Llama3,  CLEAN),
    ("smaug-bpe",         Family::Llama3,  CLEAN),
    ("chatglm-bpe",       Family::Llama3,  NO_BOS),
    ("glm4",              Family::Llama3,  NO_BOS_IGNORE_MERGES),
    ("glm5",              Family::Llama3,  NO_BOS_IGNORE_MERGES),
    ("qwen2",             Family::Qwen2,   KEEP_SPACES),
    ("deepseek-r1-qwen",  Family::Qwen2,   KEEP_SPACES),
    ("kormo",             Family::Qwen2,   KEEP_SPACES),
    ("f2llmv2",           Family::Qwen2,   KEEP_SPACES),
    ("hunyuan",           Family::Qwen2,   KEEP_SPACES),
    ("solar-open",        Family::Qwen2,   KEEP_SPACES),
    ("megrez",            Family::Qwen2,   CLEAN),
    ("stablelm2",         Family::Qwen2,   CLEAN),
];

/// The names [`PreTokenizer::from_name`] accepts, for error messages.
pub(crate) fn known_names() -> impl Iterator<Item = &'static str> {
    NAMES.iter().map(|n| n.0)
}

fn regex(pattern: &str) -> Step {
    // Constant patterns of this file: failing to compile is a bug here, not bad input.
    Step::Regex(Regex::new(pattern).expect("constant pre-tokenizer regex compiles"))
}

fn steps(family: Family) -> Vec<Step> {
    let (p, n) = (category_class("P"), category_class("N"));
    match family {
        Family::Default => vec![
            regex(&format!(r"[{p}\$\+<=>\^~\|]+")),
            Step::Gpt2,
            regex(&format!("{n}+")),
            regex("[0-9][0-9][0-9]"),
        ],
        Family::Falcon => vec![
            regex(&format!(r"[{p}\$\+<=>\^~\|`]+")),
            Step::Gpt2,
            regex("[0-9][0-9][0-9]"),
        ],
        Family::Gpt2 => vec![Step::Gpt2],
        Family::SmolLm => vec![regex(&n), Step::Gpt2],
        Family::Llama3 => vec![Step::Llama3 { max_digits: 3 }],
        Family::Qwen2 => vec![Step::Llama3 { max_digits: 1 }],
    }
}

impl PreTokenizer {
    /// The pre-tokenizer llama.cpp uses for `tokenizer.ggml.pre = name`; an absent or empty name
    /// is llama.cpp's "default". `None` for names not supported here.
    pub fn from_name(name: &str) -> Option<PreTokenizer> {
        let key = if name.is_empty() { "default" } else { name };
        let &(_, family, settings) = NAMES.iter().find(|n| n.0 == key)?;
        Some(PreTokenizer {
            name: key.to_string(),
            steps: steps(family),
            ignore_merges: settings.ignore_merges,
            clean_spaces: settings.clean_spaces,
            add_bos: settings.add_bos,
            no_bos: settings.no_bos,
        })
    }

    /// Split `text` into the words BPE merges within.
    pub fn split<'t>(&self, text: &'t str) -> Vec<&'t str> {
        let mut pieces: Vec<Range<usize>> = Vec::new();
        if !text.is_empty() {
            pieces.push(0..text.len());
        }
        for step in &self.steps {
            let mut next = Vec::with_capacity(pieces.len() * 2);
            for r in pieces {
                step.split(&text[r.clone()], r.start, &mut next);
            }
            pieces = next;
        }
        pieces.into_iter().map(|r| &text[r]).collect()
    }
}

impl Step {
    /// Append the pieces of `piece` (which starts at byte `base` of the text) to `out`.
    fn split(&self, piece: &str, base: usize, out: &mut Vec<Range<usize>>) {
        match self {
            Step::Regex(re) => split_regex(re, piece, base, out),
            Step::Gpt2 | Step::Llama3 { .. } => {
                let (offsets, cps): (Vec<usize>, Vec<char>) = piece.char_indices().unzip();
                let ends = match self {
                    Step::Llama3 { max_digits } => scan_llama3(&Text(&cps), *max_digits),
                    _ => scan_gpt2(&Text(&cps)),
                };
                let byte_at = |i: usize| base + offsets.get(i).copied().unwrap_or(piece.len());
                let mut start = 0;
                for end in ends {
                    out.push(byte_at(start)..byte_at(end));
                    start = end;
                }
            }
        }
    }
}

fn split_regex(re: &Regex, piece: &str, base: usize, out: &mut Vec<Range<usize>>) {
    let mut last = 0;
    for m in re.find_iter(piece) {
        if m.start() > last {
            out.push(base + last..base + m.start());
        }
        if m.end() > m.start() {
            out.push(base + m.start()..base + m.end());
        }
        last = m.end();
    }
    if last < piece.len() {
        out.push(base + last..base + piece.len());
    }
}

/// The code points of one piece; positions past either end read as "outside" (no flags, no char),
/// which is how the scanners' look-aheads stop at the piece boundary.
struct Text<'a>(&'a [char]);

impl Text<'_> {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn at(&self, i: usize) -> Option<char> {
        self.0.get(i).copied()
    }
    fn fl(&self, i: usize) -> Flags {
        self.at(i).map(flags).unwrap_or_default()
    }
    fn is_punct_like(f: Flags) -> bool {
        // `[^\s\p{L}\p{N}]`, but never past the end of the piece.
        f.in_range && !(f.whitespace || f.letter || f.number)
    }
    /// First position at or after `i` where `pred` fails.
    fn run(&self, mut i: usize, pred: impl Fn(Flags) -> bool) -> usize {
        while pred(self.fl(i)) {
            i += 1;
        }
        i
    }
    fn whitespace_run(&self, i: usize) -> usize {
        self.run(i, |f| f.whitespace) - i
    }
}

/// `'s|'t|'re|'ve|'m|'ll|'d` at `pos` (case-folded when `fold`): the end of the match.
fn contraction(t: &Text, pos: usize, fold: bool) -> Option<usize> {
    let lower = |c: Option<char>| c.map(|c| if fold { c.to_ascii_lowercase() } else { c });
    if t.at(pos) != Some('\'') || pos + 1 >= t.len() {
        return None;
    }
    let c1 = lower(t.at(pos + 1));
    if matches!(c1, Some('s' | 't' | 'm' | 'd')) {
        return Some(pos + 2);
    }
    if pos + 2 < t.len() {
        let c2 = lower(t.at(pos + 2));
        if matches!(
            (c1, c2),
            (Some('r'), Some('e')) | (Some('v'), Some('e')) | (Some('l'), Some('l'))
        ) {
            return Some(pos + 3);
        }
    }
    None
}

/// `\s+(?!\S)|\s+` at `pos` given `n` whitespace code points there: all but the last one when more
/// follows the run (so the last space joins the next word), else the whole run.
fn whitespace_end(t: &Text, pos: usize, n: usize) -> Option<usize> {
    if n > 1 && t.at(pos + n).is_some() {
        Some(pos + n - 1)
    } else if n > 0 {
        Some(pos + n)
    } else {
        None
    }
}

/// GPT-2's regex as llama.cpp scans it: the end position of every piece.
fn scan_gpt2(t: &Text) -> Vec<usize> {
    let mut ends = Vec::new();
    let mut pos = 0;
    while pos < t.len() {
        let end = gpt2_piece(t, pos);
        ends.push(end);
        pos = end;
    }
    ends
}

fn gpt2_piece(t: &Text, pos: usize) -> usize {
    if let Some(end) = contraction(t, pos, false) {
        return end;
    }
    let space = usize::from(t.at(pos) == Some(' '));
    let f2 = t.fl(pos + space);
    if f2.letter {
        return t.run(pos + space, |f| f.letter);
    }
    if f2.number {
        return t.run(pos + space, |f| f.number);
    }
    if Text::is_punct_like(f2) {
        return t.run(pos + space, Text::is_punct_like);
    }
    whitespace_end(t, pos, t.whitespace_run(pos)).unwrap_or(pos + 1)
}

/// Llama 3's (and, with `max_digits` 1, Qwen2's) regex as llama.cpp scans it.
fn scan_llama3(t: &Text, max_digits: usize) -> Vec<usize> {
    let mut ends = Vec::new();
    let mut pos = 0;
    while pos < t.len() {
        pos = llama3_piece(t, pos, max_digits, &mut ends);
    }
    ends
}

/// Push the piece(s) starting at `pos` and return where the next one starts.
fn llama3_piece(t: &Text, pos: usize, max_digits: usize, ends: &mut Vec<usize>) -> usize {
    let mut push = |end: usize| {
        ends.push(end);
        end
    };
    if let Some(end) = contraction(t, pos, true) {
        return push(end);
    }
    let c = t.at(pos);
    let f = t.fl(pos);
    let is_crlf = |c: Option<char>| matches!(c, Some('\r' | '\n'));
    // [^\r\n\p{L}\p{N}]?\p{L}+
    if !is_crlf(c) && !f.number && (f.letter || t.fl(pos + 1).letter) {
        return push(t.run(pos + 1, |f| f.letter));
    }
    // \p{N}{1,K}: a digit run cut into groups of K from the left.
    if f.number {
        let end = t.run(pos, |f| f.number);
        let mut start = pos;
        while start < end {
            start = push((start + max_digits.max(1)).min(end));
        }
        return end;
    }
    //  ?[^\s\p{L}\p{N}]+[\r\n]*
    let space = usize::from(c == Some(' '));
    let f2 = t.fl(pos + space);
    if !(f2.whitespace || f2.letter || f2.number) && f.in_range {
        let mut end = t.run(pos + space, Text::is_punct_like);
        while is_crlf(t.at(end)) {
            end += 1;
        }
        return push(end);
    }
    // \s*[\r\n]+ : up to the last CR/LF of the whitespace run.
    let n = t.whitespace_run(pos);
    if let Some(last) = (pos..pos + n).rev().find(|&i| is_crlf(t.at(i))) {
        return push(last + 1);
    }
    push(whitespace_end(t, pos, n).unwrap_or(pos + 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(name: &str, text: &str) -> Vec<String> {
        let p = PreTokenizer::from_name(name).unwrap();
        let pieces = p.split(text);
        assert_eq!(pieces.concat(), text, "pieces cover the text");
        pieces.into_iter().map(String::from).collect()
    }

    #[test]
    fn gpt2_keeps_one_space_with_the_next_word() {
        assert_eq!(split("gpt-2", "a  b"), ["a", " ", " b"]);
        assert_eq!(
            split("gpt-2", "Hello world!!  "),
            ["Hello", " world", "!!", "  "]
        );
        assert_eq!(split("gpt-2", "it's"), ["it", "'s"]);
        assert_eq!(split("gpt-2", "IT'S"), ["IT", "'", "S"]);
    }

    #[test]
    fn smollm_isolates_every_digit() {
        assert_eq!(split("smollm", "ab 123"), ["ab", " ", "1", "2", "3"]);
    }

    #[test]
    fn llama3_groups_digits_by_three_and_newlines() {
        assert_eq!(split("llama3", "12345"), ["123", "45"]);
        assert_eq!(split("llama3", "a\n\n b"), ["a", "\n\n", " b"]);
        assert_eq!(split("llama3", "IT'S ok"), ["IT", "'S", " ok"]);
        assert_eq!(split("qwen2", "12"), ["1", "2"]);
    }

    #[test]
    fn default_splits_punctuation_first() {
        assert_eq!(
            split("default", "a,b 1234"),
            ["a", ",", "b", " ", "123", "4"]
        );
    }

    #[test]
    fn unknown_names_are_refused() {
        assert!(PreTokenizer::from_name("no-such-pre").is_none());
        assert!(PreTokenizer::from_name("").is_some());
    }
}
