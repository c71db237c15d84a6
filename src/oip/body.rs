//! A request body as the pieces it arrived in: hyper hands a large body
//! over in chunks of its read buffer, and gathering them into one buffer
//! is a copy of the whole body into freshly allocated memory. The pieces
//! are kept as they are (each a reference-counted `Bytes`); a binary
//! tensor is a range of them ([`Chunks::slice`]) that is copied once, to
//! where the service reads it (a feed buffer), and only the small JSON
//! header is made contiguous when it spans pieces.

use std::borrow::Cow;

use axum::body::Bytes;

/// Bytes in pieces, in order; empty pieces are never kept.
#[derive(Debug, Clone, Default)]
pub struct Chunks {
    parts: Vec<Bytes>,
    len: usize,
}

impl Chunks {
    /// Appends a piece.
    pub fn push(&mut self, b: Bytes) {
        if !b.is_empty() {
            self.len += b.len();
            self.parts.push(b);
        }
    }

    /// One piece.
    pub fn one(b: Bytes) -> Chunks {
        let mut c = Chunks::default();
        c.push(b);
        c
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// The pieces, in order.
    pub fn parts(&self) -> impl Iterator<Item = &[u8]> {
        self.parts.iter().map(|b| &b[..])
    }

    /// Bytes `at..at + n` as pieces of the same memory (no copy); `None`
    /// past the end.
    pub fn slice(&self, at: usize, n: usize) -> Option<Chunks> {
        let end = at.checked_add(n)?;
        if end > self.len {
            return None;
        }
        let mut out = Chunks::default();
        let mut start = 0;
        for p in &self.parts {
            let (lo, hi) = (start, start + p.len());
            start = hi;
            if hi <= at {
                continue;
            }
            if lo >= end {
                break;
            }
            out.push(p.slice(at.max(lo) - lo..end.min(hi) - lo));
        }
        Some(out)
    }

    /// Bytes `..n` in one slice: borrowed when the first piece holds them,
    /// else gathered; `None` past the end.
    pub fn prefix(&self, n: usize) -> Option<Cow<'_, [u8]>> {
        if n > self.len {
            return None;
        }
        match self.parts.first() {
            Some(p) if p.len() >= n => Some(Cow::Borrowed(&p[..n])),
            _ => {
                let mut v = Vec::with_capacity(n);
                for p in self.parts() {
                    let take = (n - v.len()).min(p.len());
                    v.extend_from_slice(&p[..take]);
                    if v.len() == n {
                        break;
                    }
                }
                Some(Cow::Owned(v))
            }
        }
    }

    /// Copies every byte into `dst`, which must be exactly as long; false
    /// (and `dst` untouched) when it is not.
    pub fn copy_to(&self, dst: &mut [u8]) -> bool {
        if dst.len() != self.len {
            return false;
        }
        let mut at = 0;
        for p in self.parts() {
            dst[at..at + p.len()].copy_from_slice(p);
            at += p.len();
        }
        true
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn pieces() -> Chunks {
        let mut c = Chunks::default();
        for p in [&b"abc"[..], b"", b"defg", b"h"] {
            c.push(Bytes::copy_from_slice(p));
        }
        c
    }

    fn all(c: &Chunks) -> Vec<u8> {
        let mut v = vec![0; c.len()];
        assert!(c.copy_to(&mut v));
        v
    }

    #[test]
    fn slices_cross_pieces_without_gathering() {
        let c = pieces();
        assert_eq!(c.len(), 8);
        assert_eq!(c.parts().count(), 3);
        assert_eq!(all(&c), b"abcdefgh");
        let s = c.slice(2, 4).unwrap();
        assert_eq!(all(&s), b"cdef");
        assert_eq!(s.parts().count(), 2);
        assert_eq!(all(&c.slice(8, 0).unwrap()), b"");
        assert!(c.slice(5, 4).is_none());
        assert!(c.slice(usize::MAX, 2).is_none());
    }

    #[test]
    fn a_prefix_is_borrowed_from_the_first_piece_when_it_holds_it() {
        let c = pieces();
        assert!(matches!(c.prefix(3), Some(Cow::Borrowed(b"abc"))));
        assert_eq!(c.prefix(5).unwrap().as_ref(), b"abcde");
        assert!(matches!(c.prefix(5), Some(Cow::Owned(_))));
        assert_eq!(c.prefix(8).unwrap().as_ref(), b"abcdefgh");
        assert!(c.prefix(9).is_none());
        let mut short = [0u8; 3];
        assert!(!c.copy_to(&mut short));
    }
}
