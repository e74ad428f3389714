//! Special-token partitioning (llama.cpp's `tokenizer_st_partition`): before any merging, the
//! text is cut at every occurrence of a special token's text, longest tokens first. User-defined
//! tokens are always cut out; control and unknown tokens only when the caller parses specials.

use std::ops::Range;

/// A token matched by its literal text.
#[derive(Clone, Debug)]
pub(crate) struct SpecialToken {
    pub id: u32,
    pub text: String,
    /// Control or unknown: only matched with `parse_special`.
    pub control: bool,
    /// Swallow whitespace before / after a match.
    pub lstrip: bool,
    pub rstrip: bool,
}

/// A piece of the input: raw text still to tokenize, or a token already decided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Fragment {
    Text(Range<usize>),
    Token(u32),
}

/// C's `isspace` in the "C" locale, which is what llama.cpp strips with.
fn is_c_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | 0x0B | 0x0C | b'\r')
}

/// Split `text` at special tokens. `specials` must be in matching order (longest text first).
pub(crate) fn partition(
    text: &str,
    specials: &[SpecialToken],
    parse_special: bool,
) -> Vec<Fragment> {
    let mut frags = if text.is_empty() {
        Vec::new()
    } else {
        vec![Fragment::Text(0..text.len())]
    };
    for special in specials {
        if special.text.is_empty() || (special.control && !parse_special) {
            continue;
        }
        let mut next = Vec::with_capacity(frags.len());
        for frag in frags {
            match frag {
                Fragment::Text(r) => split_at(text, r, special, &mut next),
                tok => next.push(tok),
            }
        }
        frags = next;
    }
    frags
}

/// Cut every occurrence of `special` out of `text[r]`, left to right.
fn split_at(text: &str, r: Range<usize>, special: &SpecialToken, out: &mut Vec<Fragment>) {
    let bytes = text.as_bytes();
    let needle = special.text.as_str();
    let (mut start, end) = (r.start, r.end);
    // A valid UTF-8 needle only matches at character boundaries of valid UTF-8 text.
    while let Some(found) = text[start..end].find(needle) {
        let m = start + found;
        let mut left_end = m;
        if special.lstrip {
            while left_end > start && is_c_space(bytes[left_end - 1]) {
                left_end -= 1;
            }
        }
        if left_end > start {
            out.push(Fragment::Text(start..left_end));
        }
        out.push(Fragment::Token(special.id));
        start = m + needle.len();
        if special.rstrip {
            while start < end && is_c_space(bytes[start]) {
                start += 1;
            }
        }
    }
    if start < end {
        out.push(Fragment::Text(start..end));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sp(id: u32, text: &str, control: bool) -> SpecialToken {
        SpecialToken {
            id,
            text: text.into(),
            control,
            lstrip: false,
            rstrip: false,
        }
    }

    #[test]
    fn control_tokens_need_parse_special() {
        let specials = [sp(7, "<|im_start|>", true)];
        let text = "a<|im_start|>b<|im_start|>";
        assert_eq!(
            partition(text, &specials, false),
            [Fragment::Text(0..text.len())]
        );
        assert_eq!(
            partition(text, &specials, true),
            [
                Fragment::Text(0..1),
                Fragment::Token(7),
                Fragment::Text(13..14),
                Fragment::Token(7)
            ]
        );
    }

    #[test]
    fn user_defined_tokens_always_split() {
        let specials = [sp(3, "<x>", false)];
        assert_eq!(
            partition("<x><x>", &specials, false),
            [Fragment::Token(3), Fragment::Token(3)]
        );
    }

    #[test]
    fn strip_flags_swallow_spaces() {
        let mut s = sp(1, "<m>", false);
        s.lstrip = true;
        s.rstrip = true;
        assert_eq!(
            partition("a  <m>  b", &[s], false),
            [
                Fragment::Text(0..1),
                Fragment::Token(1),
                Fragment::Text(8..9)
            ]
        );
    }
}
