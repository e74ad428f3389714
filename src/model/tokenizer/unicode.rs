//! Character classes the byte-level BPE pre-tokenizers need, with llama.cpp's definitions: letters
//! and numbers by Unicode general category (`\p{L}`, `\p{N}`), whitespace as llama.cpp's fixed set
//! (the Unicode `White_Space` property); and GPT-2's byte ↔ character map.
//!
//! The category tables come from `regex-syntax` (the same Unicode data the `regex` crate matches
//! with), so the hand-written splitters and the regex-based ones agree with each other. Both are
//! limited to the Unicode version of llama.cpp's tables (see [`category_class`]).

use std::sync::OnceLock;

use regex_syntax::hir::{Class, HirKind};

/// What a code point is, as the pre-tokenizers ask. `Flags::default()` stands for "outside the
/// text" (llama.cpp's empty flags), which is why `in_range` exists.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Flags {
    pub in_range: bool,
    pub letter: bool,
    pub number: bool,
    pub whitespace: bool,
}

/// llama.cpp's whitespace set (`unicode_set_whitespace`): the Unicode White_Space property.
const WHITESPACE: [u32; 25] = [
    0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680, 0x2000, 0x2001, 0x2002, 0x2003, 0x2004,
    0x2005, 0x2006, 0x2007, 0x2008, 0x2009, 0x200A, 0x2028, 0x2029, 0x202F, 0x205F, 0x3000,
];

/// The Unicode version of llama.cpp's category tables (`unicode-data.cpp`); characters assigned
/// later have no category there (checked: equal to its tables for L, N and P).
const UNICODE_AGE: &str = "15.1";

/// A regex class for general category `name` (e.g. "L") as llama.cpp classifies code points.
pub(crate) fn category_class(name: &str) -> String {
    format!(r"[\p{{{name}}}&&\p{{Age={UNICODE_AGE}}}]")
}

struct Tables {
    letter: Vec<(char, char)>,
    number: Vec<(char, char)>,
}

fn class_ranges(pattern: &str) -> Vec<(char, char)> {
    // The patterns are constants of this file; a failure here is a bug in it, not bad input.
    let hir = regex_syntax::Parser::new()
        .parse(pattern)
        .expect("constant Unicode class pattern parses");
    match hir.kind() {
        HirKind::Class(Class::Unicode(c)) => {
            c.ranges().iter().map(|r| (r.start(), r.end())).collect()
        }
        _ => Vec::new(),
    }
}

fn tables() -> &'static Tables {
    static TABLES: OnceLock<Tables> = OnceLock::new();
    TABLES.get_or_init(|| Tables {
        letter: class_ranges(&category_class("L")),
        number: class_ranges(&category_class("N")),
    })
}

fn in_ranges(ranges: &[(char, char)], c: char) -> bool {
    ranges
        .binary_search_by(|&(lo, hi)| {
            if hi < c {
                std::cmp::Ordering::Less
            } else if lo > c {
                std::cmp::Ordering::Greater
            } else {
                std::cmp::Ordering::Equal
            }
        })
        .is_ok()
}

pub(crate) fn is_whitespace(c: char) -> bool {
    WHITESPACE.contains(&(c as u32))
}

/// The flags of a code point inside the text.
pub(crate) fn flags(c: char) -> Flags {
    if c.is_ascii() {
        return Flags {
            in_range: true,
            letter: c.is_ascii_alphabetic(),
            number: c.is_ascii_digit(),
            whitespace: matches!(c, '\t' | '\n' | '\x0B' | '\x0C' | '\r' | ' '),
        };
    }
    let t = tables();
    Flags {
        in_range: true,
        letter: in_ranges(&t.letter, c),
        number: in_ranges(&t.number, c),
        whitespace: is_whitespace(c),
    }
}

/// GPT-2's reversible byte → character map: printable Latin-1 bytes map to themselves, the other
/// 68 bytes to U+0100.. in byte order.
pub(crate) fn byte_to_char(b: u8) -> char {
    byte_maps().0[b as usize]
}

/// The inverse of [`byte_to_char`].
pub(crate) fn char_to_byte(c: char) -> Option<u8> {
    let rev = &byte_maps().1;
    rev.binary_search_by_key(&c, |&(ch, _)| ch)
        .ok()
        .map(|i| rev[i].1)
}

fn is_printable_latin1(b: u8) -> bool {
    matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF)
}

#[allow(clippy::type_complexity)]
fn byte_maps() -> &'static ([char; 256], Vec<(char, u8)>) {
    static MAPS: OnceLock<([char; 256], Vec<(char, u8)>)> = OnceLock::new();
    MAPS.get_or_init(|| {
        let mut fwd = ['\0'; 256];
        let mut next = 256u32;
        for b in 0..=255u8 {
            fwd[b as usize] = if is_printable_latin1(b) {
                char::from(b)
            } else {
                let c = char::from_u32(next).unwrap_or('\u{FFFD}');
                next += 1;
                c
            };
        }
        let mut rev: Vec<(char, u8)> = (0..=255u8).map(|b| (fwd[b as usize], b)).collect();
        rev.sort_unstable();
        (fwd, rev)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_map_is_gpt2s() {
        assert_eq!(byte_to_char(b'a'), 'a');
        assert_eq!(byte_to_char(b' '), 'Ġ');
        assert_eq!(byte_to_char(b'\n'), 'Ċ');
        assert_eq!(byte_to_char(0xAD), 'Ń');
        for b in 0..=255u8 {
            assert_eq!(char_to_byte(byte_to_char(b)), Some(b));
        }
        assert_eq!(char_to_byte('中'), None);
    }

    #[test]
    fn categories_follow_unicode() {
        assert!(flags('é').letter && flags('中').letter && flags('한').letter);
        assert!(flags('½').number && flags('²').number && flags('Ⅻ').number && flags('٣').number);
        assert!(!flags('🎉').letter && !flags('🎉').number && !flags('🎉').whitespace);
        assert!(flags('\u{3000}').whitespace && flags('\u{85}').whitespace);
        assert!(!flags('\u{200B}').whitespace);
        assert!(!Flags::default().in_range);
        // Unicode 16 additions are not letters to llama.cpp (Garay digits, Todhri letters).
        assert!(!flags('\u{10D40}').number && !flags('\u{105C0}').letter);
        assert_eq!(category_class("N"), r"[\p{N}&&\p{Age=15.1}]");
    }
}
