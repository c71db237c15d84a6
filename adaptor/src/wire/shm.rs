//! Shared-memory segments for the feeds of a job on the service's host.
//!
//! Over a socket, a Run's feed values are copied four times (into the
//! frame, into and out of the kernel, into the service's tensor). A job on
//! the same host can instead write them once into a segment it shares with
//! the service: a sealed `memfd` (Linux) that the client maps read-write and
//! the service maps read-only through `/proc/<pid>/fd/<fd>`. The Run header
//! then names the segment and each feed's offset, and the service copies
//! the values straight from the mapping into the Run's tensors.
//!
//! Safety of the service against its clients:
//! - the segment must be a memfd sealed against shrinking (`F_SEAL_SHRINK`),
//!   so no client can truncate it under the service's mapping (which would
//!   turn the service's reads into SIGBUS);
//! - the first [`TOKEN_BYTES`] of the segment must equal the token of the
//!   offer: the descriptor really is the segment the client wrote;
//! - every offset and length is checked against the mapping before a byte is
//!   read; a segment is never larger than the service allows.
//!
//! A client that rewrites a segment while its Run is in flight only spoils
//! its own feeds. A segment holds one Run's feeds at a time: the client
//! reuses it once the Run's reply arrived.

use serde::{Deserialize, Serialize};

/// Bytes at the start of a segment before the first feed: the token, then
/// padding to a cache line.
pub const SEGMENT_HEADER: usize = 64;
/// Length of the token a segment starts with.
pub const TOKEN_BYTES: usize = 16;
/// Feed offsets in a segment are multiples of this.
pub const FEED_ALIGN: usize = 64;

/// What a client tells the service about a segment it made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentOffer {
    /// The client's name for the segment, unique within its session.
    pub segment: u32,
    /// Process id of the client, and the segment's descriptor in it.
    pub pid: u32,
    pub fd: i32,
    /// Length of the segment in bytes (header included).
    pub bytes: u64,
    /// What the segment's first bytes hold.
    pub token: [u8; TOKEN_BYTES],
}

/// Why a segment could not be made or attached.
#[derive(Debug, thiserror::Error)]
pub enum SharedMemoryError {
    #[error("shared-memory feeds need Linux (memfd)")]
    Unsupported,
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    #[error("{path} is not a memfd")]
    NotMemfd { path: String },
    #[error("the segment is not sealed against shrinking (F_SEAL_SHRINK)")]
    NotSealed,
    #[error("the segment has {actual} bytes, fewer than the {offered} offered")]
    Short { offered: u64, actual: u64 },
    #[error("a segment of {bytes} bytes is outside 1 header .. {limit} bytes")]
    Size { bytes: u64, limit: u64 },
    #[error("the segment's first bytes are not the offered token")]
    Token,
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> SharedMemoryError {
    let what = what.into();
    move |source| SharedMemoryError::Io { what, source }
}

/// [`io`] for the memfd crate's errors, keeping the OS error they carry.
#[cfg(target_os = "linux")]
fn memfd_io(what: impl Into<String>) -> impl FnOnce(memfd::Error) -> SharedMemoryError {
    let to_io = io(what);
    move |e| match e {
        memfd::Error::Create(source)
        | memfd::Error::AddSeals(source)
        | memfd::Error::GetSeals(source) => to_io(source),
    }
}

/// Offsets of `sizes` (bytes) packed from [`SEGMENT_HEADER`], each aligned
/// to [`FEED_ALIGN`], and the bytes the segment then needs; `None` on
/// overflow.
pub fn layout(sizes: impl IntoIterator<Item = usize>) -> Option<(Vec<u64>, usize)> {
    let mut at = SEGMENT_HEADER;
    let mut offsets = Vec::new();
    for s in sizes {
        offsets.push(u64::try_from(at).ok()?);
        at = at.checked_add(s)?.checked_next_multiple_of(FEED_ALIGN)?;
    }
    Some((offsets, at))
}

/// A client's segment: a sealed memfd mapped read-write.
pub struct OwnedSegment {
    id: u32,
    token: [u8; TOKEN_BYTES],
    map: memmap2::MmapMut,
    #[cfg(target_os = "linux")]
    memfd: memfd::Memfd,
}

impl std::fmt::Debug for OwnedSegment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnedSegment")
            .field("id", &self.id)
            .field("bytes", &self.map.len())
            .finish()
    }
}

impl OwnedSegment {
    /// A new segment of `bytes` bytes (header included), sealed against
    /// shrinking and growing, its token written.
    #[cfg(target_os = "linux")]
    pub fn create(id: u32, bytes: usize) -> Result<Self, SharedMemoryError> {
        use memfd::{FileSeal, MemfdOptions};
        if bytes < SEGMENT_HEADER {
            return Err(SharedMemoryError::Size {
                bytes: bytes as u64,
                limit: u64::MAX,
            });
        }
        let memfd = MemfdOptions::default()
            .allow_sealing(true)
            .create("lanes-feeds")
            .map_err(memfd_io("memfd_create"))?;
        memfd
            .as_file()
            .set_len(bytes as u64)
            .map_err(io(format!("sizing the segment to {bytes} bytes")))?;
        memfd
            .add_seals(&[FileSeal::SealShrink, FileSeal::SealGrow, FileSeal::SealSeal])
            .map_err(memfd_io("sealing the segment"))?;
        // SAFETY: the file is a memfd this process just made and sealed
        // against resizing, so the mapping stays backed for its whole life;
        // only this process writes it.
        #[allow(unsafe_code)]
        let mut map = unsafe { memmap2::MmapMut::map_mut(memfd.as_file()) }
            .map_err(io("mapping the segment"))?;
        let token = token();
        map[..TOKEN_BYTES].copy_from_slice(&token);
        Ok(OwnedSegment {
            id,
            token,
            map,
            memfd,
        })
    }

    #[cfg(not(target_os = "linux"))]
    pub fn create(_id: u32, _bytes: usize) -> Result<Self, SharedMemoryError> {
        Err(SharedMemoryError::Unsupported)
    }

    pub fn id(&self) -> u32 {
        self.id
    }

    /// Length in bytes, header included.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// What the service needs to attach this segment.
    pub fn offer(&self) -> SegmentOffer {
        #[cfg(target_os = "linux")]
        let fd = {
            use std::os::fd::AsRawFd;
            self.memfd.as_file().as_raw_fd()
        };
        #[cfg(not(target_os = "linux"))]
        let fd = -1;
        SegmentOffer {
            segment: self.id,
            pid: std::process::id(),
            fd,
            bytes: self.map.len() as u64,
            token: self.token,
        }
    }

    /// The whole segment, header included (callers write past the header).
    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.map
    }
}

/// A token no other segment is likely to start with (not a secret: reading
/// another process's descriptor already needs its user's rights).
fn token() -> [u8; TOKEN_BYTES] {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let mut out = [0u8; TOKEN_BYTES];
    for (i, chunk) in out.chunks_mut(8).enumerate() {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(COUNT.fetch_add(1, Ordering::Relaxed));
        h.write_u32(std::process::id());
        h.write_usize(i);
        if let Ok(d) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
            h.write_u128(d.as_nanos());
        }
        chunk.copy_from_slice(&h.finish().to_le_bytes()[..chunk.len()]);
    }
    out
}

/// The service's view of a client's segment: mapped read-only.
pub struct AttachedSegment {
    map: memmap2::Mmap,
}

impl std::fmt::Debug for AttachedSegment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AttachedSegment")
            .field("bytes", &self.map.len())
            .finish()
    }
}

impl AttachedSegment {
    /// Opens the segment an offer describes, if it is a memfd sealed
    /// against shrinking, at least as long as offered, at most `limit`
    /// bytes, and starts with the offered token.
    #[cfg(target_os = "linux")]
    pub fn open(offer: &SegmentOffer, limit: u64) -> Result<Self, SharedMemoryError> {
        use memfd::{FileSeal, Memfd};
        if offer.bytes < SEGMENT_HEADER as u64 || offer.bytes > limit {
            return Err(SharedMemoryError::Size {
                bytes: offer.bytes,
                limit,
            });
        }
        let path = format!("/proc/{}/fd/{}", offer.pid, offer.fd);
        // Only regular files (a memfd is one): opening a FIFO could block
        // the service and a device could react to being opened. Checked
        // before opening, opened non-blocking (the descriptor may be
        // swapped in between) and checked again on what was opened.
        let regular = |m: std::fs::Metadata| m.file_type().is_file();
        let meta = std::fs::metadata(&path).map_err(io(format!("looking at {path}")))?;
        if !regular(meta) {
            return Err(SharedMemoryError::NotMemfd { path });
        }
        use std::os::unix::fs::OpenOptionsExt;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
            .open(&path)
            .map_err(io(format!("opening {path}")))?;
        if !file.metadata().is_ok_and(regular) {
            return Err(SharedMemoryError::NotMemfd { path });
        }
        let memfd = Memfd::try_from_file(file)
            .map_err(|_| SharedMemoryError::NotMemfd { path: path.clone() })?;
        let seals = memfd
            .seals()
            .map_err(memfd_io(format!("reading the seals of {path}")))?;
        if !seals.contains(&FileSeal::SealShrink) {
            return Err(SharedMemoryError::NotSealed);
        }
        let actual = memfd
            .as_file()
            .metadata()
            .map_err(io(format!("reading the size of {path}")))?
            .len();
        if actual < offer.bytes {
            return Err(SharedMemoryError::Short {
                offered: offer.bytes,
                actual,
            });
        }
        let len = usize::try_from(offer.bytes).map_err(|_| SharedMemoryError::Size {
            bytes: offer.bytes,
            limit,
        })?;
        // SAFETY: the file cannot shrink (sealed, checked above), so every
        // page of the first `len` bytes stays backed while mapped. Its
        // owner may still write it; the service only copies bytes out and
        // gives them no meaning beyond the feeds of that owner's own Run.
        #[allow(unsafe_code)]
        let map = unsafe { memmap2::MmapOptions::new().len(len).map(memfd.as_file()) }
            .map_err(io(format!("mapping {path}")))?;
        if map[..TOKEN_BYTES] != offer.token {
            return Err(SharedMemoryError::Token);
        }
        Ok(AttachedSegment { map })
    }

    #[cfg(not(target_os = "linux"))]
    pub fn open(_offer: &SegmentOffer, _limit: u64) -> Result<Self, SharedMemoryError> {
        Err(SharedMemoryError::Unsupported)
    }

    /// The whole segment, header included.
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }
}

/// How the decoder finds the segments a Run names: by session and segment
/// id, only those of the connection the request came from.
pub trait SegmentLookup {
    fn segment(&self, session: super::SessionId, segment: u32) -> Option<&[u8]>;
}

/// No segments attached (clients, and services that never attach any).
#[derive(Debug, Clone, Copy, Default)]
pub struct NoSegments;

impl SegmentLookup for NoSegments {
    fn segment(&self, _session: super::SessionId, _segment: u32) -> Option<&[u8]> {
        None
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn layout_aligns_every_feed_after_the_header() {
        let (offsets, end) = layout([10, 64, 1]).unwrap();
        assert_eq!(offsets, vec![64, 128, 192]);
        assert_eq!(end, 256);
        assert_eq!(layout([]).unwrap(), (vec![], SEGMENT_HEADER));
        assert!(layout([usize::MAX]).is_none());
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_segment_attaches_and_shows_what_its_owner_wrote() {
        let mut seg = OwnedSegment::create(3, 4096).unwrap();
        seg.bytes_mut()[SEGMENT_HEADER..SEGMENT_HEADER + 4].copy_from_slice(&[1, 2, 3, 4]);
        let offer = seg.offer();
        assert_eq!((offer.segment, offer.bytes), (3, 4096));
        let at = AttachedSegment::open(&offer, 1 << 20).unwrap();
        assert_eq!(
            &at.bytes()[SEGMENT_HEADER..SEGMENT_HEADER + 4],
            &[1, 2, 3, 4]
        );
        // Later writes are seen through the service's mapping.
        seg.bytes_mut()[SEGMENT_HEADER] = 9;
        assert_eq!(at.bytes()[SEGMENT_HEADER], 9);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn offers_that_do_not_match_their_segment_are_refused() {
        let seg = OwnedSegment::create(1, 4096).unwrap();
        let good = seg.offer();
        let wrong_token = SegmentOffer {
            token: [7; TOKEN_BYTES],
            ..good
        };
        assert!(matches!(
            AttachedSegment::open(&wrong_token, 1 << 20),
            Err(SharedMemoryError::Token)
        ));
        let longer = SegmentOffer {
            bytes: 8192,
            ..good
        };
        assert!(matches!(
            AttachedSegment::open(&longer, 1 << 20),
            Err(SharedMemoryError::Short { .. })
        ));
        assert!(matches!(
            AttachedSegment::open(&good, 1024),
            Err(SharedMemoryError::Size { .. })
        ));
        let no_fd = SegmentOffer {
            fd: 1 << 20,
            ..good
        };
        assert!(matches!(
            AttachedSegment::open(&no_fd, 1 << 20),
            Err(SharedMemoryError::Io { .. })
        ));
        // An ordinary file (this test binary's stdin may be anything; use a
        // file we open) is not a memfd.
        let f = std::fs::File::open("/proc/self/exe").unwrap();
        use std::os::fd::AsRawFd;
        let plain = SegmentOffer {
            fd: f.as_raw_fd(),
            ..good
        };
        assert!(matches!(
            AttachedSegment::open(&plain, 1 << 20),
            Err(SharedMemoryError::NotMemfd { .. })
        ));
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_socket_is_refused_without_opening_it() {
        // Not a regular file (opening a FIFO with no writer would block).
        let (reader, _writer) = std::os::unix::net::UnixStream::pair().unwrap();
        use std::os::fd::AsRawFd;
        let offer = SegmentOffer {
            segment: 0,
            pid: std::process::id(),
            fd: reader.as_raw_fd(),
            bytes: 4096,
            token: [0; TOKEN_BYTES],
        };
        assert!(matches!(
            AttachedSegment::open(&offer, 1 << 20),
            Err(SharedMemoryError::NotMemfd { .. })
        ));
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn an_unsealed_memfd_is_refused() {
        let fd = memfd::MemfdOptions::default()
            .allow_sealing(true)
            .create("unsealed")
            .unwrap();
        fd.as_file().set_len(4096).unwrap();
        use std::os::fd::AsRawFd;
        let offer = SegmentOffer {
            segment: 0,
            pid: std::process::id(),
            fd: fd.as_file().as_raw_fd(),
            bytes: 4096,
            token: [0; TOKEN_BYTES],
        };
        assert!(matches!(
            AttachedSegment::open(&offer, 1 << 20),
            Err(SharedMemoryError::NotSealed)
        ));
    }
}
