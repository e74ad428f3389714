//! llama.cpp's byte-level BPE ("gpt2" GGUF vocabularies) for one pre-tokenized word: map the
//! word's bytes to GPT-2's printable characters, then repeatedly merge the adjacent pair with the
//! lowest merge rank (leftmost first on ties), and map the final symbols to tokens. A symbol that
//! is not a token falls back to the tokens of its single bytes, dropping bytes that have none
//! (llama.cpp does the same).

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use super::unicode::byte_to_char;

/// What the algorithm needs from a vocabulary.
pub(crate) trait BpeVocab {
    fn lookup(&self, text: &str) -> Option<u32>;
    /// The rank of merging `left` and `right` (lower merges first).
    fn rank(&self, left: &str, right: &str) -> Option<u32>;
    /// Emit a word that is itself a token without merging (llama.cpp's `ignore_merges`).
    fn ignore_merges(&self) -> bool;
}

/// The merge list as ranks. Strings are interned so a lookup by two `&str` allocates nothing.
#[derive(Clone, Debug, Default)]
pub(crate) struct MergeRanks {
    parts: HashMap<String, u32>,
    ranks: HashMap<(u32, u32), u32>,
}

impl MergeRanks {
    /// Ranks from `tokenizer.ggml.merges` entries (`"left right"`, split at the first space after
    /// the first byte, as llama.cpp does). The first occurrence of a pair keeps its rank.
    pub fn new<'a>(merges: impl IntoIterator<Item = &'a str>) -> MergeRanks {
        let mut m = MergeRanks::default();
        for (rank, line) in merges.into_iter().enumerate() {
            // The space is ASCII, so both slices fall on character boundaries.
            let space = line.bytes().skip(1).position(|b| b == b' ').map(|i| i + 1);
            let (left, right) = match space {
                Some(i) => (&line[..i], &line[i + 1..]),
                None => ("", ""),
            };
            let l = m.intern(left);
            let r = m.intern(right);
            m.ranks.entry((l, r)).or_insert(rank as u32);
        }
        m
    }

    fn intern(&mut self, s: &str) -> u32 {
        let next = self.parts.len() as u32;
        *self.parts.entry(s.to_string()).or_insert(next)
    }

    pub fn get(&self, left: &str, right: &str) -> Option<u32> {
        let l = *self.parts.get(left)?;
        let r = *self.parts.get(right)?;
        self.ranks.get(&(l, r)).copied()
    }

    pub fn len(&self) -> usize {
        self.ranks.len()
    }
}

/// GPT-2's byte-to-character encoding of a word.
pub(crate) fn byte_encode(word: &str) -> String {
    word.bytes().map(byte_to_char).collect()
}

#[derive(Clone, Copy, Debug)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

#[derive(Debug, PartialEq, Eq)]
struct Bigram {
    rank: u32,
    left: usize,
    right: usize,
    size: usize,
}

impl Ord for Bigram {
    /// Lowest rank first; on equal ranks, the leftmost pair.
    fn cmp(&self, other: &Self) -> Ordering {
        other
            .rank
            .cmp(&self.rank)
            .then_with(|| other.left.cmp(&self.left))
    }
}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

struct Session<'a, V: BpeVocab> {
    vocab: &'a V,
    word: &'a str,
    symbols: Vec<Symbol>,
    queue: BinaryHeap<Bigram>,
}

impl<V: BpeVocab> Session<'_, V> {
    fn text(&self, i: usize) -> &str {
        let s = self.symbols[i];
        &self.word[s.start..s.start + s.len]
    }

    fn try_add(&mut self, left: Option<usize>, right: Option<usize>) {
        let (Some(left), Some(right)) = (left, right) else {
            return;
        };
        if let Some(rank) = self.vocab.rank(self.text(left), self.text(right)) {
            let size = self.symbols[left].len + self.symbols[right].len;
            self.queue.push(Bigram {
                rank,
                left,
                right,
                size,
            });
        }
    }

    fn merge_all(&mut self) {
        while let Some(b) = self.queue.pop() {
            let (l, r) = (self.symbols[b.left], self.symbols[b.right]);
            // Symbols only grow rightwards from a fixed start, so an unchanged total length means
            // the pair is still exactly the one this candidate was made from.
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

    fn emit(&self, out: &mut Vec<u32>) {
        for i in 0..self.symbols.len() {
            if self.symbols[i].len == 0 {
                continue;
            }
            let text = self.text(i);
            match self.vocab.lookup(text) {
                Some(id) => out.push(id),
                None => {
                    let mut buf = [0u8; 4];
                    for &b in text.as_bytes() {
                        // llama.cpp looks up each raw byte of the encoded text as a one-byte
                        // string; only ASCII bytes can be a (valid UTF-8) token.
                        if b.is_ascii()
                            && let Some(id) = self.vocab.lookup(char::from(b).encode_utf8(&mut buf))
                        {
                            out.push(id);
                        }
                    }
                }
            }
        }
    }
}

/// Tokenize one byte-encoded word (see [`byte_encode`]) and append the ids to `out`.
pub(crate) fn tokenize_word<V: BpeVocab>(vocab: &V, word: &str, out: &mut Vec<u32>) {
    if vocab.ignore_merges()
        && let Some(id) = vocab.lookup(word)
    {
        out.push(id);
        return;
    }
    let n = word.chars().count();
    let symbols = word
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
        word,
        symbols,
        queue: BinaryHeap::new(),
    };
    for i in 1..n {
        s.try_add(Some(i - 1), Some(i));
    }
    s.merge_all();
    s.emit(out);
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Toy {
        ids: HashMap<String, u32>,
        merges: MergeRanks,
        ignore_merges: bool,
    }

    impl Toy {
        fn new(tokens: &[&str], merges: &[&str]) -> Toy {
            Toy {
                ids: tokens
                    .iter()
                    .enumerate()
                    .map(|(i, t)| (t.to_string(), i as u32))
                    .collect(),
                merges: MergeRanks::new(merges.iter().copied()),
                ignore_merges: false,
            }
        }
    }

    impl BpeVocab for Toy {
        fn lookup(&self, text: &str) -> Option<u32> {
            self.ids.get(text).copied()
        }
        fn rank(&self, left: &str, right: &str) -> Option<u32> {
            self.merges.get(left, right)
        }
        fn ignore_merges(&self) -> bool {
            self.ignore_merges
        }
    }

    fn tok(v: &Toy, word: &str) -> Vec<u32> {
        let mut out = Vec::new();
        tokenize_word(v, &byte_encode(word), &mut out);
        out
    }

    #[test]
    fn merges_apply_in_rank_order() {
        let tokens = ["a", "b", "c", "ab", "bc", "abc"];
        // "b c" ranks before "a b": a + bc, and "a bc" is no merge.
        let v = Toy::new(&tokens, &["b c", "a b", "ab c"]);
        assert_eq!(tok(&v, "abc"), [0, 4]);
        // "a b" first, then "ab c".
        let v = Toy::new(&tokens, &["a b", "b c", "ab c"]);
        assert_eq!(tok(&v, "abc"), [5]);
    }

    #[test]
    fn equal_pairs_merge_leftmost_first() {
        let v = Toy::new(&["a", "aa"], &["a a"]);
        assert_eq!(tok(&v, "aaa"), [1, 0]);
    }

    #[test]
    fn spaces_are_byte_encoded() {
        let v = Toy::new(&["Ġ", "h", "Ġh"], &["Ġ h"]);
        assert_eq!(tok(&v, " h"), [2]);
    }

    #[test]
    fn symbols_without_tokens_keep_only_their_ascii_bytes() {
        let v = Toy::new(&["x"], &[]);
        assert_eq!(tok(&v, "xé"), [0]);
    }

    #[test]
    fn ignore_merges_takes_whole_word_tokens() {
        let mut v = Toy::new(&["a", "b", "ab"], &[]);
        assert_eq!(tok(&v, "ab"), [0, 1]);
        v.ignore_merges = true;
        assert_eq!(tok(&v, "ab"), [2]);
    }

    #[test]
    fn merge_lines_split_after_the_first_byte() {
        let m = MergeRanks::new([" a b", "x y", "bad", "x y", "Ġ t"]);
        assert_eq!(m.get(" a", "b"), Some(0));
        assert_eq!(m.get("x", "y"), Some(1));
        assert_eq!(m.get("", ""), Some(2));
        assert_eq!(m.get("Ġ", "t"), Some(4));
        assert_eq!(m.len(), 4);
    }
}
