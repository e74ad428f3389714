//! llama.cpp's SentencePiece-style tokenizer ("llama" GGUF vocabularies): start from single
//! UTF-8 characters, repeatedly merge the adjacent pair whose concatenation is the vocabulary piece
//! with the highest score (leftmost first on ties), then map every final symbol to its token, or
//! to byte tokens (`<0xXX>`) when it is not one.
//!
//! Space handling (the `▁` escape, the prefix space) is the caller's; this module sees one text
//! fragment with no special tokens in it.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use super::TokenizeError;

/// What the algorithm needs from a vocabulary.
pub(crate) trait SpmVocab {
    /// The token whose text is exactly `text` (any token type, as in llama.cpp).
    fn lookup(&self, text: &str) -> Option<u32>;
    fn score(&self, id: u32) -> f32;
    /// The token for one raw byte: `<0xXX>`, else the one-byte string, else the unknown token.
    fn byte_token(&self, byte: u8) -> Option<u32>;
}

/// A run of the text: `len == 0` marks a symbol merged into its left neighbour.
#[derive(Clone, Copy, Debug)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// A candidate merge of `left` with its right neighbour `right`.
#[derive(Debug)]
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    /// Byte length of the merged text; a mismatch at pop time means the candidate went stale.
    size: usize,
}

impl Ord for Bigram {
    /// Highest score first; on equal scores, the leftmost pair.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .partial_cmp(&other.score)
            .unwrap_or(Ordering::Equal)
            .then_with(|| other.left.cmp(&self.left))
    }
}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Bigram {}

struct Session<'a, V: SpmVocab> {
    vocab: &'a V,
    text: &'a str,
    symbols: Vec<Symbol>,
    queue: BinaryHeap<Bigram>,
}

impl<V: SpmVocab> Session<'_, V> {
    fn piece(&self, left: usize, len: usize) -> &str {
        let start = self.symbols[left].start;
        &self.text[start..start + len]
    }

    fn try_add(&mut self, left: Option<usize>, right: Option<usize>) {
        let (Some(left), Some(right)) = (left, right) else {
            return;
        };
        let size = self.symbols[left].len + self.symbols[right].len;
        if let Some(id) = self.vocab.lookup(self.piece(left, size)) {
            let score = self.vocab.score(id);
            self.queue.push(Bigram {
                score,
                left,
                right,
                size,
            });
        }
    }

    fn merge_all(&mut self) {
        while let Some(b) = self.queue.pop() {
            let (l, r) = (self.symbols[b.left], self.symbols[b.right]);
            if l.len == 0 || r.len == 0 || l.len + r.len != b.size {
                continue;
            }
            self.symbols[b.left].len += r.len;
            self.symbols[b.right].len = 0;
            self.symbols[b.left].next = r.next;
            if let Some(n) = r.next {
                self.symbols[n].prev = Some(b.left);
            }
            self.try_add(l.prev, Some(b.left));
            self.try_add(Some(b.left), r.next);
        }
    }

    /// Every surviving symbol is a vocabulary piece (merges only form pieces) or one character
    /// that is not, which falls back to its bytes.
    fn emit(&self, out: &mut Vec<u32>) -> Result<(), TokenizeError> {
        let mut i = (!self.symbols.is_empty()).then_some(0);
        while let Some(idx) = i {
            let s = self.symbols[idx];
            let piece = self.piece(idx, s.len);
            match self.vocab.lookup(piece) {
                Some(id) => out.push(id),
                None => {
                    for &b in piece.as_bytes() {
                        let id = self.vocab.byte_token(b).ok_or_else(|| {
                            TokenizeError(format!(
                                "byte 0x{b:02X} of {piece:?} has no token (no <0x{b:02X}> and no unknown token)"
                            ))
                        })?;
                        out.push(id);
                    }
                }
            }
            i = s.next;
        }
        Ok(())
    }
}

/// Tokenize `text` (spaces already escaped as `▁`) and append the ids to `out`.
pub(crate) fn tokenize<V: SpmVocab>(
    vocab: &V,
    text: &str,
    out: &mut Vec<u32>,
) -> Result<(), TokenizeError> {
    let n = text.chars().count();
    let symbols = text
        .char_indices()
        .enumerate()
        .map(|(i, (start, c))| Symbol {
            start,
            len: c.len_utf8(),
            prev: i.checked_sub(1),
            next: (i + 1 < n).then_some(i + 1),
        })
        .collect();
    let mut s = Session {
        vocab,
        text,
        symbols,
        queue: BinaryHeap::new(),
    };
    for i in 1..n {
        s.try_add(Some(i - 1), Some(i));
    }
    s.merge_all();
    s.emit(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    struct Toy {
        ids: HashMap<String, u32>,
        scores: Vec<f32>,
    }

    impl Toy {
        fn new(pieces: &[(&str, f32)]) -> Toy {
            let mut ids = HashMap::new();
            let mut scores = Vec::new();
            for b in 0..=255u8 {
                ids.insert(format!("<0x{b:02X}>"), scores.len() as u32);
                scores.push(0.0);
            }
            for (p, s) in pieces {
                ids.insert(p.to_string(), scores.len() as u32);
                scores.push(*s);
            }
            Toy { ids, scores }
        }
        fn id(&self, p: &str) -> u32 {
            self.ids[p]
        }
    }

    impl SpmVocab for Toy {
        fn lookup(&self, text: &str) -> Option<u32> {
            self.ids.get(text).copied()
        }
        fn score(&self, id: u32) -> f32 {
            self.scores[id as usize]
        }
        fn byte_token(&self, byte: u8) -> Option<u32> {
            Some(byte as u32)
        }
    }

    fn tok(v: &Toy, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        tokenize(v, text, &mut out).unwrap();
        out
    }

    #[test]
    fn highest_scoring_merge_wins() {
        let v = Toy::new(&[("a", -1.), ("b", -1.), ("c", -1.), ("ab", -5.), ("bc", -2.)]);
        // "bc" outscores "ab"; after it "a" + "bc" is no piece, so nothing more merges.
        assert_eq!(tok(&v, "abc"), [v.id("a"), v.id("bc")]);
        // With "abc" in the vocabulary the merge continues from "a" + "bc".
        let v = Toy::new(&[
            ("a", -1.),
            ("b", -1.),
            ("c", -1.),
            ("ab", -5.),
            ("bc", -2.),
            ("abc", -9.),
        ]);
        assert_eq!(tok(&v, "abc"), [v.id("abc")]);
    }

    #[test]
    fn equal_scores_merge_leftmost_first() {
        let v = Toy::new(&[("a", -1.), ("aa", -2.)]);
        assert_eq!(tok(&v, "aaa"), [v.id("aa"), v.id("a")]);
    }

    #[test]
    fn unknown_characters_fall_back_to_bytes() {
        let v = Toy::new(&[("▁", -1.), ("h", -1.), ("▁h", -1.5)]);
        // 'é' is U+00E9 = C3 A9 in UTF-8, not in the vocabulary.
        assert_eq!(tok(&v, "▁hé"), [v.id("▁h"), 0xC3, 0xA9]);
    }

    #[test]
    fn missing_byte_token_is_an_error() {
        struct NoBytes;
        impl SpmVocab for NoBytes {
            fn lookup(&self, _: &str) -> Option<u32> {
                None
            }
            fn score(&self, _: u32) -> f32 {
                0.0
            }
            fn byte_token(&self, _: u8) -> Option<u32> {
                None
            }
        }
        let mut out = Vec::new();
        assert!(tokenize(&NoBytes, "x", &mut out).is_err());
        assert!(tokenize(&NoBytes, "", &mut out).is_ok());
    }
}
