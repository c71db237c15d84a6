//! Parts and frames: a message's logical parts (its header, then one part
//! per tensor) and the ZeroMQ frames that carry them.
//!
//! A part may span several consecutive frames: a request's sender splits
//! every part into frames of at most [`CHUNK_BYTES`], so that the service's
//! socket can cap every frame, ZeroMQ's handshake included, at that size
//! (`ZMQ_MAXMSGSIZE`): a peer that has not authenticated can then make the
//! service hold no more than one such frame per connection. The receiver
//! knows each part's length before reading its frames (the header's from its
//! prefix, each tensor's from its type in the header) and concatenates
//! frames until it is reached; frames that do not add up to it exactly are
//! a [`WireError::PartFrames`]. One frame per part (replies) is the same
//! thing with one frame each.
//!
//! Values are copied once, from the frames straight into the tensor's own
//! (possibly pooled) storage, by several threads when large.

use std::ops::Deref;
use std::sync::OnceLock;

use super::error::WireError;
use super::pool::BufferPool;
use super::Limits;
use super::NamedTensor;
use crate::tensor::{Tensor, TensorData, TensorError, TensorType};

/// Largest frame a request's sender puts on the wire, and the cap
/// (`ZMQ_MAXMSGSIZE`) of the service's socket on every frame it receives,
/// ZeroMQ's own handshake commands included. 64 KiB: far above what the
/// handshake needs (a PLAIN HELLO with a connection token is under 300
/// bytes, READY's metadata under 1 KiB) and above every small request
/// (a Hello, an Authenticate, a Run's header and small feeds: one frame
/// each, nothing split on the hot path), while a large tensor costs one
/// ZeroMQ message per 64 KiB (16 per MiB), small beside copying it.
pub const CHUNK_BYTES: usize = 64 << 10;

/// Frames at least this large are copied by several threads.
const PARALLEL_COPY_BYTES: usize = 4 << 20;
/// Bytes each copying thread gets at least, and most threads per copy.
const BYTES_PER_COPY_THREAD: usize = 2 << 20;
const MAX_COPY_THREADS: usize = 4;

fn copy_threads(bytes: usize) -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    let cores = *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    if bytes < PARALLEL_COPY_BYTES {
        1
    } else {
        (bytes / BYTES_PER_COPY_THREAD).clamp(1, cores.min(MAX_COPY_THREADS))
    }
}

/// `dst.copy_from_slice(src)`, split over a few scoped threads when large
/// (4 MiB or more, at least 2 MiB a thread, at most 4): a large
/// destination is often fresh memory, and its page faults as well as the
/// copy then proceed in parallel; one core's copy runs at a few GB/s.
pub fn copy_bytes<T: Copy + Send + Sync>(dst: &mut [T], src: &[T]) {
    let threads = copy_threads(std::mem::size_of_val(src));
    if threads <= 1 || dst.len() != src.len() {
        dst.copy_from_slice(src);
        return;
    }
    let chunk = src.len().div_ceil(threads);
    std::thread::scope(|scope| {
        let mut parts = dst.chunks_mut(chunk).zip(src.chunks(chunk));
        let first = parts.next();
        for (d, s) in parts {
            scope.spawn(move || d.copy_from_slice(s));
        }
        if let Some((d, s)) = first {
            d.copy_from_slice(s);
        }
    });
}

/// Copies `chunks`, in order, into `dst` (exactly their total length:
/// checked by the caller), by several threads when large, each taking a
/// run of whole chunks.
fn copy_chunks(dst: &mut [u8], chunks: &[&[u8]]) {
    let threads = copy_threads(dst.len());
    if threads <= 1 || chunks.len() < threads {
        let mut at = 0;
        for c in chunks {
            dst[at..at + c.len()].copy_from_slice(c);
            at += c.len();
        }
        return;
    }
    let share = dst.len().div_ceil(threads);
    std::thread::scope(|scope| {
        let mut rest = dst;
        let mut from = 0;
        while from < chunks.len() {
            // Whole chunks up to about `share` bytes for this thread.
            let (mut to, mut bytes) = (from, 0);
            while to < chunks.len() && (bytes < share || to == from) {
                bytes += chunks[to].len();
                to += 1;
            }
            let (mine, tail) = std::mem::take(&mut rest).split_at_mut(bytes);
            rest = tail;
            let group = &chunks[from..to];
            from = to;
            let mut copy = move || {
                let mut at = 0;
                for c in group {
                    mine[at..at + c.len()].copy_from_slice(c);
                    at += c.len();
                }
            };
            if from < chunks.len() {
                scope.spawn(copy);
            } else {
                copy();
            }
        }
    });
}

/// `bytes` as frames of at most `chunk` bytes (one empty frame when
/// empty): one copy, by several threads when large.
pub fn chunk_frames(bytes: &[u8], chunk: usize) -> Vec<Vec<u8>> {
    let chunk = chunk.max(1);
    if bytes.is_empty() {
        return vec![Vec::new()];
    }
    let threads = copy_threads(bytes.len());
    if threads <= 1 {
        return bytes.chunks(chunk).map(<[u8]>::to_vec).collect();
    }
    // Each thread copies a run of whole chunks.
    let per_thread = bytes.len().div_ceil(chunk).div_ceil(threads) * chunk;
    std::thread::scope(|scope| {
        let handles: Vec<_> = bytes
            .chunks(per_thread)
            .map(|run| {
                scope.spawn(move || run.chunks(chunk).map(<[u8]>::to_vec).collect::<Vec<_>>())
            })
            .collect();
        // A copying thread cannot panic (slices of known bounds); were it
        // to, its chunks are copied here instead.
        let runs = bytes.chunks(per_thread);
        handles
            .into_iter()
            .zip(runs)
            .flat_map(|(h, run)| {
                h.join()
                    .unwrap_or_else(|_| run.chunks(chunk).map(<[u8]>::to_vec).collect())
            })
            .collect()
    })
}

/// Appends `part` to `frames` as frames of at most `chunk` bytes: moved
/// as it is when it fits one frame, else copied into several.
pub(super) fn push_part(frames: &mut Vec<Vec<u8>>, part: Vec<u8>, chunk: usize) {
    if part.len() <= chunk {
        frames.push(part);
    } else {
        frames.extend(chunk_frames(&part, chunk));
    }
}

/// A copy of `bytes` in a new vector.
fn bytes_to_vec(bytes: &[u8]) -> Vec<u8> {
    if copy_threads(bytes.len()) <= 1 {
        return bytes.to_vec();
    }
    let mut out = vec![0u8; bytes.len()];
    copy_bytes(&mut out, bytes);
    out
}

/// A tensor's values as one little-endian frame.
pub fn tensor_frame(t: &Tensor) -> Vec<u8> {
    #[cfg(target_endian = "little")]
    {
        bytes_to_vec(t.data().ne_bytes())
    }
    #[cfg(not(target_endian = "little"))]
    {
        t.to_le_bytes()
    }
}

/// A tensor's values as little-endian frames of at most `chunk` bytes
/// (one copy, straight from the tensor's storage).
pub(super) fn tensor_frames(t: &Tensor, chunk: usize, frames: &mut Vec<Vec<u8>>) {
    #[cfg(target_endian = "little")]
    {
        let bytes = t.data().ne_bytes();
        if bytes.len() <= chunk {
            frames.push(bytes_to_vec(bytes));
        } else {
            frames.extend(chunk_frames(bytes, chunk));
        }
    }
    #[cfg(not(target_endian = "little"))]
    {
        push_part(frames, t.to_le_bytes(), chunk);
    }
}

/// Rebuilds a tensor from its type and a little-endian frame (one copy into
/// aligned memory; no per-element decoding on little-endian hosts).
pub fn tensor_from_frame(ty: &TensorType, bytes: &[u8]) -> Result<Tensor, TensorError> {
    tensor_from_frame_in(ty, bytes, None)
}

/// [`tensor_from_frame`] into storage from `pool` when it has a buffer that
/// fits (the one copy then writes into memory already mapped).
pub fn tensor_from_frame_in(
    ty: &TensorType,
    bytes: &[u8],
    pool: Option<&BufferPool>,
) -> Result<Tensor, TensorError> {
    tensor_from_chunks_in(ty, &[bytes], pool)
}

/// A tensor of type `ty` whose little-endian values are `chunks`, in
/// order (a body received in pieces), copied once into its storage.
pub fn tensor_from_chunks(ty: &TensorType, chunks: &[&[u8]]) -> Result<Tensor, TensorError> {
    tensor_from_chunks_in(ty, chunks, None)
}

/// A tensor of type `ty` whose little-endian values are `chunks`, in
/// order, copied once into its (pooled, where a buffer fits) storage.
fn tensor_from_chunks_in(
    ty: &TensorType,
    chunks: &[&[u8]],
    pool: Option<&BufferPool>,
) -> Result<Tensor, TensorError> {
    let expected = ty.checked_bytes().ok_or_else(|| TensorError::Overflow {
        shape: ty.shape.clone(),
    })?;
    let got = chunks.iter().map(|c| c.len()).sum::<usize>();
    if expected != got {
        return Err(TensorError::Bytes {
            ty: ty.clone(),
            expected,
            got,
        });
    }
    let copy = |dst: &mut [u8]| match chunks {
        [one] => copy_bytes(dst, one),
        many => copy_chunks(dst, many),
    };
    #[cfg(target_endian = "little")]
    {
        let len = expected / ty.dtype.size();
        let mut data = pool.map_or_else(
            || TensorData::zeros(ty.dtype, len),
            |p| p.data(ty.dtype, len),
        );
        copy(data.ne_bytes_mut());
        Tensor::new(ty.shape.clone(), data)
    }
    #[cfg(not(target_endian = "little"))]
    {
        let _ = pool;
        let mut all = vec![0u8; expected];
        copy(&mut all);
        Tensor::from_le_bytes(ty, &all)
    }
}

/// Most frames a message may have: its parts (`max_frames`), each split
/// into frames of [`CHUNK_BYTES`] as a sender does, at the largest sizes
/// the limits allow. Checked before anything is decoded; every frame
/// after the header carries at least one byte (an empty part is one empty
/// frame), so decoding costs at most this many steps.
pub fn max_message_frames(limits: &Limits) -> usize {
    let header = limits.max_header_bytes.min(limits.max_frame_bytes);
    let tensor = limits.max_tensor_bytes.min(limits.max_frame_bytes);
    let bytes = limits
        .max_frames
        .saturating_sub(1)
        .saturating_mul(tensor)
        .saturating_add(header);
    limits.max_frames.saturating_add(bytes / CHUNK_BYTES)
}

/// Reads a message's parts off its frames, in order.
pub(super) struct Parts<'f, F> {
    frames: &'f [F],
    /// The next part's index (the header is part 0).
    part: usize,
}

impl<'f, F: Deref<Target = [u8]>> Parts<'f, F> {
    pub(super) fn new(frames: &'f [F]) -> Self {
        Parts { frames, part: 0 }
    }

    /// Frames not taken yet.
    pub(super) fn rest(&self) -> &'f [F] {
        self.frames
    }

    /// The frames of the next part, of `len` bytes: consecutive frames
    /// whose lengths add up to exactly `len`, none of them empty (an empty
    /// part is exactly one empty frame). `None` when no frame is left.
    pub(super) fn take(&mut self, len: usize) -> Option<Result<Vec<&'f [u8]>, WireError>> {
        let first = self.frames.first()?;
        let part = self.part;
        self.part += 1;
        let bad = |reason| {
            Some(Err(WireError::PartFrames {
                part,
                expected: len,
                reason,
            }))
        };
        if len == 0 {
            self.frames = &self.frames[1..];
            return if first.is_empty() {
                Some(Ok(vec![&first[..]]))
            } else {
                bad("an empty part is one empty frame")
            };
        }
        let mut taken = Vec::with_capacity(len.div_ceil(CHUNK_BYTES).min(self.frames.len()));
        let mut bytes = 0usize;
        for f in self.frames {
            if f.is_empty() {
                return bad("an empty frame inside it");
            }
            bytes = bytes.saturating_add(f.len());
            taken.push(&f[..]);
            if bytes >= len {
                break;
            }
        }
        self.frames = &self.frames[taken.len()..];
        match bytes.cmp(&len) {
            std::cmp::Ordering::Equal => Some(Ok(taken)),
            std::cmp::Ordering::Less => bad("the message ends before it does"),
            std::cmp::Ordering::Greater => bad("a frame straddles its end"),
        }
    }
}

/// The tensors `metas` announce, each from its part of `parts`: the count,
/// the part and tensor limits and each part's frames checked.
pub(super) fn take_tensors<F: Deref<Target = [u8]>>(
    metas: Vec<super::codec::TensorMeta>,
    parts: &mut Parts<'_, F>,
    limits: &Limits,
    pool: Option<&BufferPool>,
) -> Result<Vec<NamedTensor>, WireError> {
    if metas.len() >= limits.max_frames {
        return Err(WireError::TooManyFrames {
            frames: metas.len().saturating_add(1),
            limit: limits.max_frames,
        });
    }
    let count = metas.len();
    let mut out = Vec::with_capacity(count);
    for (i, m) in metas.into_iter().enumerate() {
        // A part above the part limit (`--max-frame`), then a tensor above
        // the tensor limit.
        if let Some(bytes) = m.ty.checked_bytes().filter(|b| *b > limits.max_frame_bytes) {
            return Err(WireError::FrameTooLarge {
                index: i + 1,
                bytes,
                limit: limits.max_frame_bytes,
            });
        }
        let len = checked_len(&m, limits)?;
        let chunks = parts.take(len).ok_or(WireError::FrameCount {
            expected: count,
            got: i,
        })??;
        out.push(match tensor_from_chunks_in(&m.ty, &chunks, pool) {
            Ok(tensor) => NamedTensor {
                name: m.name,
                tensor,
            },
            Err(source) => {
                return Err(WireError::TensorBytes {
                    name: m.name,
                    source,
                })
            }
        });
    }
    no_more(parts, count)?;
    Ok(out)
}

/// Nothing after the `parts` announced.
pub(super) fn no_more<F: Deref<Target = [u8]>>(
    parts: &Parts<'_, F>,
    announced: usize,
) -> Result<(), WireError> {
    if parts.rest().is_empty() {
        Ok(())
    } else {
        Err(WireError::FrameCount {
            expected: announced,
            got: announced.saturating_add(1),
        })
    }
}

/// The byte length of the tensor `m` announces, within the tensor limit.
pub(super) fn checked_len(
    m: &super::codec::TensorMeta,
    limits: &Limits,
) -> Result<usize, WireError> {
    m.ty.checked_bytes()
        .filter(|b| *b <= limits.max_tensor_bytes)
        .ok_or_else(|| WireError::TensorTooLarge {
            name: m.name.clone(),
            ty: m.ty.clone(),
            limit: limits.max_tensor_bytes,
        })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn copy_bytes_copies_every_element_of_any_type() {
        // Below, at and above the 4 MiB from which threads share the copy.
        for n in [
            0usize,
            1,
            1000,
            (4 << 20) / 4 - 1,
            (4 << 20) / 4,
            (9 << 20) / 4 + 3,
        ] {
            let src: Vec<f32> = (0..n).map(|i| i as f32).collect();
            let mut dst = vec![-1.0f32; n];
            copy_bytes(&mut dst, &src);
            assert_eq!(dst, src, "{n}");
        }
    }

    #[test]
    fn chunks_cover_the_bytes_in_order() {
        for (len, chunk) in [
            (0, 4),
            (1, 4),
            (4, 4),
            (5, 4),
            (9 << 20, 64 << 10),
            (9 << 20, 1000),
        ] {
            let bytes: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
            let frames = chunk_frames(&bytes, chunk);
            assert!(frames.iter().all(|f| f.len() <= chunk));
            assert!(frames.iter().all(|f| !f.is_empty()) || len == 0);
            assert_eq!(frames.concat(), bytes);
            // Reassembled as the decoder does, in parallel when large.
            let slices: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
            let mut back = vec![0u8; len];
            copy_chunks(&mut back, &slices);
            assert_eq!(back, bytes);
        }
    }

    #[test]
    fn parts_must_add_up_exactly() {
        let frames: Vec<Vec<u8>> = vec![vec![1; 3], vec![2; 2], vec![], vec![3; 4]];
        let mut p = Parts::new(&frames);
        assert_eq!(p.take(5).unwrap().unwrap().concat(), [1, 1, 1, 2, 2]);
        assert_eq!(p.take(0).unwrap().unwrap().concat(), Vec::<u8>::new());
        let e = p.take(3).unwrap().unwrap_err();
        assert!(matches!(e, WireError::PartFrames { part: 2, .. }), "{e}");
        assert!(p.take(1).is_none());
        for len in [2, 4, 6, 100] {
            let mut p = Parts::new(&frames);
            assert!(p.take(len).unwrap().is_err(), "{len}");
        }
        // An empty frame inside a part.
        let mut p = Parts::new(&frames[1..]);
        assert!(p.take(6).unwrap().is_err());
    }
}
