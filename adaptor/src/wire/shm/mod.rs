//! Shared-memory segments for the feeds of a job on the service's host.
//!
//! Over a socket, a Run's feed values are copied four times (into the
//! frame, into and out of the kernel, into the service's tensor). A job on
//! the same host can instead write them once into a segment it shares with
//! the service: a sealed `memfd` (Linux) that the client maps read-write and
//! the service maps read-only. The client hands the segment's descriptor to
//! the service itself, over a Unix socket of the service's (the *desk*, an
//! abstract socket named in the Hello reply) with `SCM_RIGHTS`, together
//! with the segment's random token; the ShareMemory request then names the
//! token. The Run header names the segment and each feed's offset, and the
//! service copies the values straight from the mapping into the Run's
//! tensors.
//!
//! Who may share what: the service never opens a file a peer names; it maps
//! only descriptors a peer handed over, which that peer could already read.
//! A token is 16 random bytes known to the client that made it, so no peer
//! can attach another's descriptor. A peer on another host cannot reach
//! the desk (an abstract Unix socket of this host's network namespace).
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

mod areas;
mod desk;

pub use areas::{Doorbell, ReplySlot, RingRefused, DOORBELL_HEADER};
pub use desk::FdDesk;

/// Bytes at the start of a segment before the first feed: the token, then
/// padding to a cache line.
pub const SEGMENT_HEADER: usize = 64;
/// Length of the token a segment starts with.
pub const TOKEN_BYTES: usize = 16;
/// Feed offsets in a segment are multiples of this.
pub const FEED_ALIGN: usize = 64;

/// Bytes at the start of a reply slot before its table of outputs: the
/// sequence word (u64, the request id of the Run last answered here),
/// the status (u32, [`SLOT_HERE`] or [`SLOT_ON_SOCKET`]), the table's
/// length (u32), the bytes the slot needs for that Run's outputs (u64),
/// then padding to a cache line.
pub const REPLY_HEADER: usize = 64;
/// Status of a slot whose outputs are in it.
pub const SLOT_HERE: u32 = 0;
/// Status of a slot too small for the Run's outputs: they travel in the
/// socket reply, and the slot's `need` says how many bytes would do.
pub const SLOT_ON_SOCKET: u32 = 1;
/// The sequence word of a slot no Run has answered into yet.
pub const SLOT_EMPTY: u64 = u64::MAX;

/// What a client tells the service about a segment whose descriptor it
/// handed to the service's desk ([`OwnedSegment::hand_over`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentOffer {
    /// The client's name for the segment, unique within its session.
    pub segment: u32,
    /// Length of the segment in bytes (header included).
    pub bytes: u64,
    /// The segment's token: what its first bytes hold, and the key its
    /// descriptor was handed over under.
    pub token: [u8; TOKEN_BYTES],
}

/// Descriptors the desk keeps for offers still to come, at most.
pub const DESK_PENDING: usize = 256;
/// How long the desk keeps a descriptor no offer has claimed.
pub const DESK_KEEP: std::time::Duration = std::time::Duration::from_secs(30);
/// Connections the desk accepted whose descriptor has not arrived yet, at
/// most (the oldest is dropped beyond), and how long one may stay silent: a
/// client sends its token and descriptor right after connecting.
const DESK_WAITING: usize = 64;
const DESK_SILENT: std::time::Duration = std::time::Duration::from_secs(2);

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
    #[error("no descriptor was handed over with this segment's token")]
    NotHandedOver,
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
    layout_from(SEGMENT_HEADER, sizes)
}

/// [`layout`] from byte `start` (a multiple of [`FEED_ALIGN`]) instead of
/// the segment's header end: a reply slot's values after its table.
pub(crate) fn layout_from(
    start: usize,
    sizes: impl IntoIterator<Item = usize>,
) -> Option<(Vec<u64>, usize)> {
    let mut at = start;
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

    /// What the service needs to attach this segment, once its descriptor
    /// was handed over ([`OwnedSegment::hand_over`]).
    pub fn offer(&self) -> SegmentOffer {
        SegmentOffer {
            segment: self.id,
            bytes: self.map.len() as u64,
            token: self.token,
        }
    }

    /// Hands the segment's descriptor to the service's desk (the abstract
    /// Unix socket `desk` its Hello reply named), under the segment's token.
    #[cfg(target_os = "linux")]
    pub fn hand_over(&self, desk: &str) -> Result<(), SharedMemoryError> {
        use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags, UnixAddr};
        use std::os::fd::AsRawFd;
        use std::os::linux::net::SocketAddrExt;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(desk.as_bytes())
            .map_err(io(format!("the desk name {desk:?}")))?;
        let stream = std::os::unix::net::UnixStream::connect_addr(&addr)
            .map_err(io(format!("connecting to the service's desk {desk:?}")))?;
        let fds = [self.memfd.as_file().as_raw_fd()];
        let iov = [std::io::IoSlice::new(&self.token)];
        let sent = sendmsg::<UnixAddr>(
            stream.as_raw_fd(),
            &iov,
            &[ControlMessage::ScmRights(&fds)],
            MsgFlags::empty(),
            None,
        )
        .map_err(|e| io("handing the descriptor over")(e.into()))?;
        if sent != TOKEN_BYTES {
            return Err(io("handing the descriptor over")(std::io::Error::other(
                "short write",
            )));
        }
        Ok(())
    }

    #[cfg(not(target_os = "linux"))]
    pub fn hand_over(&self, _desk: &str) -> Result<(), SharedMemoryError> {
        Err(SharedMemoryError::Unsupported)
    }

    /// The whole segment, header included (callers write past the header).
    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.map
    }

    /// The sequence word of the reply slot at `offset` (acquire ordering:
    /// what the service wrote before it is visible after); `None` when
    /// `offset` is not a slot's place in this segment.
    pub(crate) fn slot_seq(&self, offset: usize) -> Option<u64> {
        use std::sync::atomic::{AtomicU64, Ordering};
        if offset % FEED_ALIGN != 0 || offset.checked_add(REPLY_HEADER)? > self.map.len() {
            return None;
        }
        // SAFETY: in bounds and 8-byte aligned (checked above, in a
        // page-aligned mapping); the word is only ever accessed atomically,
        // here and by the service.
        #[allow(unsafe_code)]
        let word =
            unsafe { AtomicU64::from_ptr(self.map.as_ptr().add(offset).cast::<u64>().cast_mut()) };
        Some(word.load(Ordering::Acquire))
    }

    /// Run `seq`'s answer in the reply slot of `bytes` bytes at `offset`
    /// (see [`ReplySlot`]), checked against the slot and `limits`.
    pub fn read_slot(
        &self,
        offset: usize,
        bytes: usize,
        seq: u64,
        limits: &super::Limits,
    ) -> Result<super::SlotRead, super::WireError> {
        let word = self.slot_seq(offset).unwrap_or(SLOT_EMPTY);
        let slot = offset
            .checked_add(bytes)
            .and_then(|end| self.map.get(offset..end))
            .unwrap_or(&[]);
        super::read_slot(slot, word, seq, limits)
    }

    /// [`OwnedSegment::read_slot`] without copying the outputs: where
    /// each lies, as ranges of the whole segment.
    pub fn find_in_slot(
        &self,
        offset: usize,
        bytes: usize,
        seq: u64,
        limits: &super::Limits,
    ) -> Result<super::SlotFind, super::WireError> {
        let word = self.slot_seq(offset).unwrap_or(SLOT_EMPTY);
        let slot = offset
            .checked_add(bytes)
            .and_then(|end| self.map.get(offset..end))
            .unwrap_or(&[]);
        Ok(match super::find_in_slot(slot, word, seq, limits)? {
            super::SlotFind::Here(places) => super::SlotFind::Here(
                places
                    .into_iter()
                    .map(|(ty, r)| (ty, r.start + offset..r.end + offset))
                    .collect(),
            ),
            other => other,
        })
    }

    /// The whole segment, header included.
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// Another descriptor of the segment's memory (a job that maps it
    /// itself, as a Python client's NumPy arrays do, keeps the memory for
    /// as long as its mapping lives, whatever becomes of this segment).
    #[cfg(target_os = "linux")]
    pub fn file(&self) -> Result<std::fs::File, SharedMemoryError> {
        self.memfd
            .as_file()
            .try_clone()
            .map_err(io("duplicating the segment's descriptor"))
    }

    #[cfg(not(target_os = "linux"))]
    pub fn file(&self) -> Result<std::fs::File, SharedMemoryError> {
        Err(SharedMemoryError::Unsupported)
    }

    /// Leaves request `id`'s one frame `frame` in the doorbell of `bytes`
    /// bytes at `offset` and rings it (see [`Doorbell`]); `false` (nothing
    /// written) when the frame does not fit or `offset` is not a doorbell's
    /// place.
    pub fn ring(&mut self, offset: usize, bytes: usize, id: u64, frame: &[u8]) -> bool {
        use std::sync::atomic::{AtomicU64, Ordering};
        let fits = offset % FEED_ALIGN == 0
            && DOORBELL_HEADER
                .checked_add(frame.len())
                .is_some_and(|n| n <= bytes)
            && offset
                .checked_add(bytes)
                .is_some_and(|e| e <= self.map.len())
            && u32::try_from(frame.len()).is_ok();
        if !fits {
            return false;
        }
        let at = offset + DOORBELL_HEADER;
        self.map[at..at + frame.len()].copy_from_slice(frame);
        self.map[offset + 8..offset + 12].copy_from_slice(&(frame.len() as u32).to_le_bytes());
        // SAFETY: in bounds and 8-byte aligned (checked above, in a
        // page-aligned mapping); the word is only ever accessed atomically.
        #[allow(unsafe_code)]
        let word = unsafe { AtomicU64::from_ptr(self.map.as_mut_ptr().add(offset).cast::<u64>()) };
        word.store(id, Ordering::Release);
        true
    }

    /// Marks the slot at `offset` as answering no Run yet.
    pub(crate) fn clear_slot(&mut self, offset: usize) {
        use std::sync::atomic::{AtomicU64, Ordering};
        if offset % FEED_ALIGN != 0
            || offset
                .checked_add(REPLY_HEADER)
                .is_none_or(|e| e > self.map.len())
        {
            return;
        }
        // SAFETY: as in `slot_seq`.
        #[allow(unsafe_code)]
        let word = unsafe { AtomicU64::from_ptr(self.map.as_mut_ptr().add(offset).cast::<u64>()) };
        word.store(SLOT_EMPTY, Ordering::Release);
    }
}

/// A segment's token: 16 bytes from a cryptographically secure generator
/// (the key under which its descriptor waits at the desk, so it must not
/// be guessable).
fn token() -> [u8; TOKEN_BYTES] {
    use rand::RngCore;
    let mut out = [0u8; TOKEN_BYTES];
    rand::thread_rng().fill_bytes(&mut out);
    out
}

#[cfg(target_os = "linux")]
/// The service's view of a client's segment: mapped read-only, and a
/// second, writable mapping of the same pages for the reply slots of the
/// client's Runs when the descriptor allows writing (see [`ReplySlot`]).
pub struct AttachedSegment {
    map: memmap2::Mmap,
    writable: Option<memmap2::MmapRaw>,
    /// What the service charged for the mappings' address space (see
    /// [`AttachedSegment::with_charge`]); dropped after them.
    charge: Option<Box<dyn std::any::Any + Send + Sync>>,
}

impl std::fmt::Debug for AttachedSegment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AttachedSegment")
            .field("bytes", &self.map.len())
            .finish()
    }
}

impl AttachedSegment {
    /// Maps the descriptor handed over for an offer, if it is a memfd
    /// sealed against shrinking, at least as long as offered, at most
    /// `limit` bytes, and starts with the offered token.
    #[cfg(target_os = "linux")]
    pub fn attach(
        file: std::fs::File,
        offer: &SegmentOffer,
        limit: u64,
    ) -> Result<Self, SharedMemoryError> {
        use memfd::{FileSeal, Memfd};
        if offer.bytes < SEGMENT_HEADER as u64 || offer.bytes > limit {
            return Err(SharedMemoryError::Size {
                bytes: offer.bytes,
                limit,
            });
        }
        let what = format!("segment {}", offer.segment);
        // A memfd is a regular file; a socket, a pipe or a device is not.
        if !file.metadata().is_ok_and(|m| m.file_type().is_file()) {
            return Err(SharedMemoryError::NotMemfd { path: what });
        }
        let memfd = Memfd::try_from_file(file)
            .map_err(|_| SharedMemoryError::NotMemfd { path: what.clone() })?;
        let seals = memfd
            .seals()
            .map_err(memfd_io(format!("reading the seals of {what}")))?;
        if !seals.contains(&FileSeal::SealShrink) {
            return Err(SharedMemoryError::NotSealed);
        }
        let actual = memfd
            .as_file()
            .metadata()
            .map_err(io(format!("reading the size of {what}")))?
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
            .map_err(io(format!("mapping {what}")))?;
        if map[..TOKEN_BYTES] != offer.token {
            return Err(SharedMemoryError::Token);
        }
        // The same pages, writable, for reply slots; a descriptor opened
        // read-only or sealed against writing gives none, and that
        // client's outputs then travel in the socket replies.
        let writable = memmap2::MmapOptions::new()
            .len(len)
            .map_raw(memfd.as_file())
            .ok();
        Ok(AttachedSegment {
            map,
            writable,
            charge: None,
        })
    }

    #[cfg(not(target_os = "linux"))]
    pub fn attach(
        _file: std::fs::File,
        _offer: &SegmentOffer,
        _limit: u64,
    ) -> Result<Self, SharedMemoryError> {
        Err(SharedMemoryError::Unsupported)
    }

    /// The whole segment, header included.
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// Whether the service can write reply slots into it.
    pub fn is_writable(&self) -> bool {
        self.writable.is_some()
    }

    /// The addresses of the writable mapping (`None` without one): a
    /// backend that registers part of it page-locked checks its range
    /// against these, as numbers; nothing is read or written through them.
    pub fn writable_addresses(&self) -> Option<std::ops::Range<usize>> {
        let map = self.writable.as_ref()?;
        let start = map.as_ptr() as usize;
        Some(start..start + map.len())
    }

    /// The address space its mappings take: its bytes once per mapping
    /// (read-only, and writable when the descriptor allows it).
    pub fn mapped_bytes(&self) -> u64 {
        let once = self.map.len() as u64;
        once.saturating_mul(1 + u64::from(self.writable.is_some()))
    }

    /// Keeps `charge` as long as the mappings live and drops it right
    /// after they are unmapped (whoever holds the segment last): a
    /// service's account of the address space its peers' segments take
    /// (its `Drop` gives it back).
    pub fn with_charge(mut self, charge: impl std::any::Any + Send + Sync) -> Self {
        self.charge = Some(Box::new(charge));
        self
    }
}

/// A Run's feed whose values stay in the job's segment: the service reads
/// them where the job wrote them, in the worker that runs the iteration (the
/// CUDA backend copies them to the device straight from the segment, which
/// it registers page-locked; the CPU backend copies them into its arena).
/// Its range was checked against the segment when the Run was decoded, and
/// it holds the segment mapped until it is dropped.
#[derive(Clone)]
pub struct SharedFeed {
    pub name: String,
    pub ty: crate::TensorType,
    segment_id: u32,
    offset: usize,
    segment: std::sync::Arc<AttachedSegment>,
}

impl SharedFeed {
    /// The feed at `offset` of `segment` (the client's segment `segment_id`):
    /// `None` unless its `ty.bytes()` bytes lie inside the segment, past the
    /// header.
    pub fn new(
        name: String,
        ty: crate::TensorType,
        segment_id: u32,
        offset: usize,
        segment: std::sync::Arc<AttachedSegment>,
    ) -> Option<Self> {
        let end = offset.checked_add(ty.checked_bytes()?)?;
        (offset >= SEGMENT_HEADER && end <= segment.bytes().len()).then_some(SharedFeed {
            name,
            ty,
            segment_id,
            offset,
            segment,
        })
    }

    /// The feed's values: `ty.bytes()` little-endian bytes.
    pub fn bytes(&self) -> &[u8] {
        let len = self.ty.bytes();
        // Checked in `new`; an empty slice, never a panic, if it were not.
        self.segment
            .bytes()
            .get(self.offset..self.offset.saturating_add(len))
            .unwrap_or(&[])
    }

    /// The segment it lies in (the service pins a segment once, by this).
    pub fn segment(&self) -> &std::sync::Arc<AttachedSegment> {
        &self.segment
    }

    /// The client's id of that segment.
    pub fn segment_id(&self) -> u32 {
        self.segment_id
    }

    /// Where in the segment it starts.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// A copy as a tensor, in `pool`'s storage where a buffer fits.
    pub fn to_tensor(
        &self,
        pool: Option<&super::BufferPool>,
    ) -> Result<crate::Tensor, crate::TensorError> {
        super::tensor_from_frame_in(&self.ty, self.bytes(), pool)
    }
}

impl std::fmt::Debug for SharedFeed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedFeed")
            .field("name", &self.name)
            .field("ty", &self.ty)
            .field("segment", &self.segment_id)
            .field("offset", &self.offset)
            .finish()
    }
}

/// Equal when they name the same feed of the same type at the same place,
/// with the same values.
impl PartialEq for SharedFeed {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
            && self.ty == other.ty
            && self.segment_id == other.segment_id
            && self.offset == other.offset
            && self.bytes() == other.bytes()
    }
}

/// What the decoder may ask the service about the sessions of the
/// connection a request came from: the segments a Run names (by session and
/// segment id), and the feeds a session's graph takes, so that a Run's
/// feeds are checked before any of their bytes is read.
pub trait SegmentLookup {
    fn segment(
        &self,
        session: super::SessionId,
        segment: u32,
    ) -> Option<&std::sync::Arc<AttachedSegment>>;
    /// The placeholders of the session's loaded graph, by name (`None`
    /// before a graph is loaded, or when the caller does not know).
    fn feed_types(
        &self,
        _session: super::SessionId,
    ) -> Option<&std::collections::BTreeMap<String, crate::TensorType>> {
        None
    }
}

/// No segments attached (clients, and services that never attach any).
#[derive(Debug, Clone, Copy, Default)]
pub struct NoSegments;

impl SegmentLookup for NoSegments {
    fn segment(
        &self,
        _session: super::SessionId,
        _segment: u32,
    ) -> Option<&std::sync::Arc<AttachedSegment>> {
        None
    }
}

/// A segment of `bytes` bytes and the service's view of it, through a desk
/// as in service (for tests).
#[cfg(all(test, target_os = "linux"))]
#[allow(clippy::unwrap_used)]
pub(crate) fn attached_pair(
    id: u32,
    bytes: usize,
) -> (OwnedSegment, std::sync::Arc<AttachedSegment>) {
    let mut desk = FdDesk::bind().unwrap();
    let seg = OwnedSegment::create(id, bytes).unwrap();
    seg.hand_over(desk.name()).unwrap();
    let file = desk.take(&seg.offer().token).unwrap();
    let at = AttachedSegment::attach(file, &seg.offer(), u64::MAX).unwrap();
    (seg, std::sync::Arc::new(at))
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

    /// Hands `seg` over to `desk` and attaches what the desk received.
    #[cfg(target_os = "linux")]
    fn through_desk(
        desk: &mut FdDesk,
        seg: &OwnedSegment,
        offer: &SegmentOffer,
        limit: u64,
    ) -> Result<AttachedSegment, SharedMemoryError> {
        seg.hand_over(desk.name()).unwrap();
        let file = desk
            .take(&seg.offer().token)
            .ok_or(SharedMemoryError::NotHandedOver)?;
        AttachedSegment::attach(file, offer, limit)
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_segment_attaches_and_shows_what_its_owner_wrote() {
        let mut desk = FdDesk::bind().unwrap();
        let mut seg = OwnedSegment::create(3, 4096).unwrap();
        seg.bytes_mut()[SEGMENT_HEADER..SEGMENT_HEADER + 4].copy_from_slice(&[1, 2, 3, 4]);
        let offer = seg.offer();
        assert_eq!((offer.segment, offer.bytes), (3, 4096));
        let at = through_desk(&mut desk, &seg, &offer, 1 << 20).unwrap();
        assert_eq!(
            &at.bytes()[SEGMENT_HEADER..SEGMENT_HEADER + 4],
            &[1, 2, 3, 4]
        );
        // Later writes are seen through the service's mapping.
        seg.bytes_mut()[SEGMENT_HEADER] = 9;
        assert_eq!(at.bytes()[SEGMENT_HEADER], 9);
        // A token attaches once; an unknown token finds nothing.
        assert!(desk.take(&offer.token).is_none());
        assert!(desk.take(&[5; TOKEN_BYTES]).is_none());
        assert_eq!(desk.pending(), 0);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn offers_that_do_not_match_their_segment_are_refused() {
        let mut desk = FdDesk::bind().unwrap();
        let seg = OwnedSegment::create(1, 4096).unwrap();
        let good = seg.offer();
        let wrong_token = SegmentOffer {
            token: [7; TOKEN_BYTES],
            ..good
        };
        // The descriptor is found under the segment's token, but its first
        // bytes are not the offered token.
        assert!(matches!(
            through_desk(&mut desk, &seg, &wrong_token, 1 << 20),
            Err(SharedMemoryError::Token)
        ));
        let longer = SegmentOffer {
            bytes: 8192,
            ..good
        };
        assert!(matches!(
            through_desk(&mut desk, &seg, &longer, 1 << 20),
            Err(SharedMemoryError::Short { .. })
        ));
        assert!(matches!(
            through_desk(&mut desk, &seg, &good, 1024),
            Err(SharedMemoryError::Size { .. })
        ));
        // An ordinary file is not a memfd, a socket is not a regular file.
        let plain = std::fs::File::open("/proc/self/exe").unwrap();
        assert!(matches!(
            AttachedSegment::attach(plain, &good, 1 << 20),
            Err(SharedMemoryError::NotMemfd { .. })
        ));
        let (reader, _writer) = std::os::unix::net::UnixStream::pair().unwrap();
        let sock = std::fs::File::from(std::os::fd::OwnedFd::from(reader));
        assert!(matches!(
            AttachedSegment::attach(sock, &good, 1 << 20),
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
        let offer = SegmentOffer {
            segment: 0,
            bytes: 4096,
            token: [0; TOKEN_BYTES],
        };
        assert!(matches!(
            AttachedSegment::attach(fd.into_file(), &offer, 1 << 20),
            Err(SharedMemoryError::NotSealed)
        ));
    }

    /// Messages that are not exactly a token and one descriptor are
    /// dropped (their descriptors closed); the desk keeps serving.
    #[cfg(target_os = "linux")]
    #[test]
    fn the_desk_drops_malformed_hand_overs() {
        use std::io::Write;
        use std::os::linux::net::SocketAddrExt;
        let mut desk = FdDesk::bind().unwrap();
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(desk.name()).unwrap();
        // Bytes without a descriptor, and a connection that sends nothing.
        let mut s = std::os::unix::net::UnixStream::connect_addr(&addr).unwrap();
        s.write_all(&[1; TOKEN_BYTES]).unwrap();
        let _silent = std::os::unix::net::UnixStream::connect_addr(&addr).unwrap();
        assert!(desk.take(&[1; TOKEN_BYTES]).is_none());
        let seg = OwnedSegment::create(2, 4096).unwrap();
        assert!(through_desk(&mut desk, &seg, &seg.offer(), 1 << 20).is_ok());
        // A pile of silent connections does not keep a hand-over out.
        let pile: Vec<_> = (0..100)
            .map(|_| std::os::unix::net::UnixStream::connect_addr(&addr).unwrap())
            .collect();
        assert!(through_desk(&mut desk, &seg, &seg.offer(), 1 << 20).is_ok());
        drop(pile);
    }
}
