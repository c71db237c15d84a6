//! Compressed HTTP bodies (what tritonclient's
//! `request_compression_algorithm` and `response_compression_algorithm`
//! ask for): an inference request's `Content-Encoding: gzip | deflate`
//! inflated by flate2 into at most `--http-max-body` bytes, and a response
//! compressed for the request's `Accept-Encoding`.

use std::io::{Read, Write};

use axum::http::HeaderValue;
use flate2::read::{GzDecoder, ZlibDecoder};
use flate2::write::{GzEncoder, ZlibEncoder};

use super::body::Chunks;
use super::error::ApiError;

/// A content coding the front door reads and writes. `deflate` is the
/// zlib format (RFC 9110), as tritonclient and browsers send it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Coding {
    Gzip,
    Deflate,
}

impl Coding {
    /// The coding's name in `Content-Encoding`.
    pub fn name(self) -> &'static str {
        match self {
            Coding::Gzip => "gzip",
            Coding::Deflate => "deflate",
        }
    }

    fn of(token: &str) -> Option<Coding> {
        if token.eq_ignore_ascii_case("gzip") || token.eq_ignore_ascii_case("x-gzip") {
            Some(Coding::Gzip)
        } else if token.eq_ignore_ascii_case("deflate") {
            Some(Coding::Deflate)
        } else {
            None
        }
    }
}

/// A request's `Content-Encoding`: `None` without one or for `identity`;
/// any coding but gzip and deflate (or several) is refused.
pub fn request_coding(header: Option<&HeaderValue>) -> Result<Option<Coding>, ApiError> {
    let Some(v) = header else {
        return Ok(None);
    };
    let text = v.to_str().unwrap_or_default().trim();
    if text.is_empty() || text.eq_ignore_ascii_case("identity") {
        return Ok(None);
    }
    Coding::of(text).map(Some).ok_or_else(|| {
        ApiError::BadRequest(format!(
            "Content-Encoding {v:?} is not supported; send the body as gzip, deflate or uncompressed"
        ))
    })
}

/// The coding to answer in for a request's `Accept-Encoding`: gzip if
/// accepted, else deflate if accepted, else none. A coding with `q=0` is
/// not accepted; other weights are not compared.
pub fn response_coding(header: Option<&HeaderValue>) -> Option<Coding> {
    let text = header?.to_str().ok()?;
    let accepted: Vec<Coding> = text
        .split(',')
        .filter_map(|item| {
            let mut parts = item.split(';');
            let coding = Coding::of(parts.next()?.trim())?;
            let refused = parts.any(|p| {
                p.trim()
                    .strip_prefix("q=")
                    .and_then(|q| q.trim().parse::<f32>().ok())
                    .is_some_and(|q| q <= 0.0)
            });
            (!refused).then_some(coding)
        })
        .collect();
    [Coding::Gzip, Coding::Deflate]
        .into_iter()
        .find(|c| accepted.contains(c))
}

/// A body's pieces read in order, as one stream.
#[derive(Debug)]
struct Parts<'a> {
    parts: Vec<&'a [u8]>,
    next: usize,
}

impl Read for Parts<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while let Some(p) = self.parts.get_mut(self.next) {
            if p.is_empty() {
                self.next += 1;
                continue;
            }
            let n = p.len().min(buf.len());
            buf[..n].copy_from_slice(&p[..n]);
            *p = &p[n..];
            return Ok(n);
        }
        Ok(0)
    }
}

/// Inflates a `coding` body into at most `limit` bytes: past it the
/// request is refused (413) once the limit is reached, whatever the body
/// would have inflated to; a body that is not `coding` is a 400.
pub fn inflate(coding: Coding, body: &Chunks, limit: usize) -> Result<Vec<u8>, ApiError> {
    let input = Parts {
        parts: body.parts().collect(),
        next: 0,
    };
    let mut dec: Box<dyn Read + '_> = match coding {
        Coding::Gzip => Box::new(GzDecoder::new(input)),
        Coding::Deflate => Box::new(ZlibDecoder::new(input)),
    };
    let mut out = Vec::new();
    let cap = u64::try_from(limit).unwrap_or(u64::MAX).saturating_add(1);
    dec.by_ref().take(cap).read_to_end(&mut out).map_err(|e| {
        ApiError::BadRequest(format!("the body is not valid {} data: {e}", coding.name()))
    })?;
    if out.len() > limit {
        return Err(too_large(limit));
    }
    Ok(out)
}

fn too_large(limit: usize) -> ApiError {
    ApiError::TooLarge(format!(
        "the request body inflates to more than {limit} bytes (--http-max-body)"
    ))
}

/// `body` compressed in `coding` (the fast level: a response is on the
/// way to a waiting caller).
pub fn compress(coding: Coding, body: &[u8]) -> Vec<u8> {
    let level = flate2::Compression::fast();
    let out = Vec::with_capacity(body.len() / 2 + 64);
    // Writing into a Vec cannot fail.
    let done = match coding {
        Coding::Gzip => {
            let mut e = GzEncoder::new(out, level);
            e.write_all(body).and_then(|()| e.finish())
        }
        Coding::Deflate => {
            let mut e = ZlibEncoder::new(out, level);
            e.write_all(body).and_then(|()| e.finish())
        }
    };
    done.unwrap_or_default()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn chunks(b: &[u8], pieces: usize) -> Chunks {
        let mut c = Chunks::default();
        let step = b.len().div_ceil(pieces).max(1);
        for p in b.chunks(step) {
            c.push(axum::body::Bytes::copy_from_slice(p));
        }
        c
    }

    #[test]
    fn bodies_round_trip_in_both_codings() {
        let body: Vec<u8> = (0..100_000u32)
            .flat_map(|x| (x % 251).to_le_bytes())
            .collect();
        for c in [Coding::Gzip, Coding::Deflate] {
            let z = compress(c, &body);
            assert!(z.len() < body.len() / 4, "{c:?}");
            for pieces in [1, 7] {
                assert_eq!(inflate(c, &chunks(&z, pieces), body.len()).unwrap(), body);
            }
            // One byte short of the limit: refused, not truncated.
            let e = inflate(c, &chunks(&z, 3), body.len() - 1).unwrap_err();
            assert!(matches!(e, ApiError::TooLarge(_)), "{e:?}");
        }
        // Each coding is its own format.
        let e = inflate(
            Coding::Deflate,
            &chunks(&compress(Coding::Gzip, b"x"), 1),
            10,
        );
        assert!(matches!(e, Err(ApiError::BadRequest(m)) if m.contains("not valid deflate")));
    }

    #[test]
    fn a_bomb_stops_at_the_limit() {
        // 64 MiB of zeros is about 64 KiB of gzip.
        let z = compress(Coding::Gzip, &vec![0u8; 64 << 20]);
        assert!(z.len() < 1 << 20);
        let e = inflate(Coding::Gzip, &chunks(&z, 1), 1 << 20).unwrap_err();
        assert!(matches!(e, ApiError::TooLarge(m) if m.contains("inflates to more than")));
    }

    #[test]
    fn broken_streams_are_bad_requests() {
        for bad in [
            &b"not gzip at all"[..],
            &compress(Coding::Gzip, b"abcdef")[..12],
        ] {
            let e = inflate(Coding::Gzip, &chunks(bad, 1), 1 << 20).unwrap_err();
            assert!(matches!(e, ApiError::BadRequest(_)), "{bad:?}: {e:?}");
        }
    }

    #[test]
    fn codings_are_read_from_the_headers() {
        let h = |s: &'static str| HeaderValue::from_static(s);
        assert_eq!(request_coding(None).unwrap(), None);
        assert_eq!(request_coding(Some(&h("identity"))).unwrap(), None);
        assert_eq!(
            request_coding(Some(&h("gzip"))).unwrap(),
            Some(Coding::Gzip)
        );
        assert_eq!(
            request_coding(Some(&h("Deflate"))).unwrap(),
            Some(Coding::Deflate)
        );
        for bad in ["br", "gzip, deflate", "zstd"] {
            assert!(request_coding(Some(&h(bad))).is_err(), "{bad}");
        }
        assert_eq!(response_coding(None), None);
        assert_eq!(response_coding(Some(&h("deflate"))), Some(Coding::Deflate));
        assert_eq!(
            response_coding(Some(&h("deflate, gzip;q=0.5"))),
            Some(Coding::Gzip)
        );
        assert_eq!(
            response_coding(Some(&h("gzip;q=0, deflate"))),
            Some(Coding::Deflate)
        );
        assert_eq!(response_coding(Some(&h("br, identity"))), None);
    }
}
