//! Checked ranges of an attached segment that the service writes: a Run's
//! reply slot and its doorbell.

use super::*;

/// A checked range of an attached segment: past its header, at a multiple
/// of [`FEED_ALIGN`], at least `min` bytes, inside the mapping.
#[derive(Clone)]
struct Area {
    segment: std::sync::Arc<AttachedSegment>,
    segment_id: u32,
    offset: usize,
    bytes: usize,
}

impl Area {
    fn new(
        segment: std::sync::Arc<AttachedSegment>,
        segment_id: u32,
        offset: usize,
        bytes: usize,
        min: usize,
    ) -> Option<Self> {
        let end = offset.checked_add(bytes)?;
        (offset >= SEGMENT_HEADER
            && offset % FEED_ALIGN == 0
            && bytes >= min
            && end <= segment.bytes().len())
        .then_some(Area {
            segment,
            segment_id,
            offset,
            bytes,
        })
    }

    fn range(&self) -> std::ops::Range<usize> {
        self.offset..self.offset + self.bytes
    }

    /// The area's start in the writable mapping, `None` without one:
    /// `bytes` bytes from it lie inside the mapping, which lives as long
    /// as `self.segment` (checked by `new`); the file is sealed against
    /// shrinking, so every page stays backed. The client may write them
    /// concurrently from its process; that spoils only its own data.
    fn start(&self) -> Option<*mut u8> {
        let map = self.segment.writable.as_ref()?;
        // SAFETY: `offset` is inside the mapping (checked by `new`).
        #[allow(unsafe_code)]
        Some(unsafe { map.as_mut_ptr().add(self.offset) })
    }

    /// The area's first 8 bytes as an atomic word (writable mapping only).
    fn word(&self) -> Option<&std::sync::atomic::AtomicU64> {
        let start = self.start()?;
        // SAFETY: the offset is a multiple of 64 in a page-aligned mapping
        // and the area is at least 8 bytes (`new`), so this is an aligned
        // u64 inside the mapping, which outlives `&self`. Both sides only
        // ever access this word atomically.
        #[allow(unsafe_code)]
        Some(unsafe { std::sync::atomic::AtomicU64::from_ptr(start.cast::<u64>()) })
    }

    fn same(&self, other: &Area) -> bool {
        std::sync::Arc::ptr_eq(&self.segment, &other.segment)
            && self.offset == other.offset
            && self.bytes == other.bytes
    }

    fn debug(&self, name: &str, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct(name)
            .field("segment", &self.segment_id)
            .field("offset", &self.offset)
            .field("bytes", &self.bytes)
            .field("writable", &self.segment.is_writable())
            .finish()
    }
}

/// Where in a client's segment the service writes a Run's fetched tensors,
/// so that a client polling the slot's sequence word takes them without
/// waiting for the socket reply (which still follows, without the
/// tensors). The range was checked against the segment and the Run's
/// feeds when the Run was decoded.
///
/// Layout (offsets from the slot's start): [`REPLY_HEADER`] bytes of
/// header, then the table (the outputs' types, bincode), then each
/// output's values at a multiple of [`FEED_ALIGN`]. The service writes
/// the table and the values, then the status and `need`, and last the
/// sequence word (release ordering); a client that reads the sequence word
/// with acquire ordering and finds its request id sees the rest.
#[derive(Clone)]
pub struct ReplySlot(Area);

impl ReplySlot {
    /// The slot of `bytes` bytes at `offset` of `segment`: `None` unless it
    /// starts past the segment's header at a multiple of [`FEED_ALIGN`],
    /// holds at least its header, and lies inside the segment.
    pub fn new(
        segment: std::sync::Arc<AttachedSegment>,
        segment_id: u32,
        offset: usize,
        bytes: usize,
    ) -> Option<Self> {
        Area::new(segment, segment_id, offset, bytes, REPLY_HEADER).map(ReplySlot)
    }

    /// The client's id of its segment.
    pub fn segment_id(&self) -> u32 {
        self.0.segment_id
    }

    /// Its range in the segment.
    pub fn range(&self) -> std::ops::Range<usize> {
        self.0.range()
    }

    /// The segment the slot lies in (its writable mapping holds it).
    pub fn segment(&self) -> &std::sync::Arc<AttachedSegment> {
        &self.0.segment
    }

    /// Whether an answer of `need` bytes (header included) would be
    /// written here: the slot is that large and the service may write it.
    pub fn holds(&self, need: usize) -> bool {
        need <= self.0.bytes && self.0.segment.is_writable()
    }

    /// Answers Run `seq` here: when `need` bytes fit the slot, `fill`
    /// writes the slot's bytes past the header (the table from
    /// [`REPLY_HEADER`], the values after it) and the status says
    /// [`SLOT_HERE`]; otherwise nothing is filled and the status says
    /// [`SLOT_ON_SOCKET`] with `need`. The sequence word is written last.
    /// `table` is the table's length. Returns whether the outputs are in
    /// the slot; `false` also when the segment is not writable (then
    /// nothing is written at all).
    pub fn post(&self, seq: u64, need: usize, table: usize, fill: impl FnOnce(&mut [u8])) -> bool {
        let posted = self.try_post(seq, need, table, |body| {
            fill(body);
            Ok::<(), std::convert::Infallible>(())
        });
        match posted {
            Ok(here) => here,
            Err(never) => match never {},
        }
    }

    /// [`ReplySlot::post`] whose `fill` may fail: then its error is
    /// returned and neither the status nor the sequence word is written,
    /// so the client goes on waiting for the socket reply (which carries
    /// the Run's error).
    pub fn try_post<E>(
        &self,
        seq: u64,
        need: usize,
        table: usize,
        fill: impl FnOnce(&mut [u8]) -> Result<(), E>,
    ) -> Result<bool, E> {
        let Some(start) = self.0.start() else {
            return Ok(false);
        };
        // SAFETY: `start` is valid for the area's bytes (`Area::start`).
        // The decoder checked the slot disjoint from the Run's feeds and
        // its doorbell, so no other thread of the service touches these
        // bytes while this Run is answered (one Run of a session at a
        // time); the word is written only below, after the slice's last
        // use.
        #[allow(unsafe_code)]
        let slot = unsafe { std::slice::from_raw_parts_mut(start, self.0.bytes) };
        let fits = need <= slot.len() && table <= u32::MAX as usize;
        let status = if fits {
            fill(&mut slot[REPLY_HEADER..])?;
            SLOT_HERE
        } else {
            SLOT_ON_SOCKET
        };
        slot[8..12].copy_from_slice(&status.to_le_bytes());
        slot[12..16].copy_from_slice(&(table.min(u32::MAX as usize) as u32).to_le_bytes());
        slot[16..24].copy_from_slice(&(need as u64).to_le_bytes());
        if let Some(word) = self.0.word() {
            word.store(seq, std::sync::atomic::Ordering::Release);
        }
        Ok(fits)
    }
}

impl std::fmt::Debug for ReplySlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.debug("ReplySlot", f)
    }
}

/// Equal when they are the same range of the same mapping.
impl PartialEq for ReplySlot {
    fn eq(&self, other: &Self) -> bool {
        self.0.same(&other.0)
    }
}

/// Bytes at the start of a doorbell before the request it holds: the word
/// (u64, the request id last rung), the request's length (u32), padding.
pub const DOORBELL_HEADER: usize = 64;

/// A doorbell in a client's segment: where a busy-polling client also
/// leaves a Run's request (its one header frame) and then writes the
/// request's id into the doorbell's word (release ordering), so that a
/// service whose socket thread is polling takes the Run from there without
/// waiting for it to cross the socket. The same request also goes through
/// the socket; the service serves whichever copy it sees first and drops
/// the other (a Run whose header names a doorbell is served only if its id
/// is above the last one taken through that doorbell). The service learns
/// a doorbell from the first Run that names it, through the socket.
///
/// Layout: [`DOORBELL_HEADER`] bytes (the word, then the length as u32),
/// then the request's bytes.
#[derive(Clone)]
pub struct Doorbell(Area);

impl Doorbell {
    /// The doorbell of `bytes` bytes at `offset` of `segment`, under the
    /// same conditions as a [`ReplySlot`].
    pub fn new(
        segment: std::sync::Arc<AttachedSegment>,
        segment_id: u32,
        offset: usize,
        bytes: usize,
    ) -> Option<Self> {
        Area::new(segment, segment_id, offset, bytes, DOORBELL_HEADER).map(Doorbell)
    }

    /// The client's id of its segment.
    pub fn segment_id(&self) -> u32 {
        self.0.segment_id
    }

    /// Its range in the segment.
    pub fn range(&self) -> std::ops::Range<usize> {
        self.0.range()
    }

    /// Whether the two are the same range of the same mapping.
    pub fn same(&self, other: &Doorbell) -> bool {
        self.0.same(&other.0)
    }

    /// Whether a request was rung after `last` (one atomic load).
    pub fn rung_since(&self, last: u64) -> bool {
        self.id_after(last).is_some()
    }

    /// The doorbell's word, if it names a request after `last` (acquire
    /// ordering: the request's bytes written before it are visible).
    fn id_after(&self, last: u64) -> Option<u64> {
        let id = self.0.word()?.load(std::sync::atomic::Ordering::Acquire);
        (id != SLOT_EMPTY && id > last).then_some(id)
    }

    /// The request rung after `last`: its id and a copy of its bytes, or
    /// why they are not taken. The length word, the request id in the
    /// prefix and the request's kind are checked where they lie before
    /// anything is copied, so a ring with anything but a Run under the
    /// word's id costs a few loads whatever the doorbell holds; a Run
    /// copies at most the doorbell's bytes (bounded by the service's
    /// `Limits::max_doorbell_bytes` when the Run naming it was decoded).
    /// `None` when nothing was rung since, or the segment is not writable
    /// (the word is read through the writable mapping).
    pub fn take(&self, last: u64) -> Option<(u64, Result<Vec<u8>, RingRefused>)> {
        let id = self.id_after(last)?;
        let start = self.0.start()?;
        // SAFETY: `start` is valid for the area's bytes (`Area::start`);
        // they are only read here, and the service never writes a
        // doorbell.
        #[allow(unsafe_code)]
        let area = unsafe { std::slice::from_raw_parts(start.cast_const(), self.0.bytes) };
        Some((id, Self::request_in(area, id).map(<[u8]>::to_vec)))
    }

    /// The request a doorbell's bytes `area` hold under id `id`, checked
    /// without copying.
    fn request_in(area: &[u8], id: u64) -> Result<&[u8], RingRefused> {
        let len = u32::from_le_bytes([area[8], area[9], area[10], area[11]]) as usize;
        let room = area.len() - DOORBELL_HEADER;
        let body = DOORBELL_HEADER
            .checked_add(len)
            .and_then(|end| area.get(DOORBELL_HEADER..end))
            .ok_or(RingRefused::Length { len, room })?;
        if crate::wire::peek_request_id(body) != Some(id) {
            return Err(RingRefused::OtherId { word: id });
        }
        if crate::wire::peek_request_name(body) != Some("run") {
            return Err(RingRefused::NotRun);
        }
        Ok(body)
    }
}

/// Why what a doorbell was rung with is not taken (see [`Doorbell::take`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RingRefused {
    #[error("its length word says {len} bytes, more than the {room} the doorbell holds")]
    Length { len: usize, room: usize },
    #[error("it does not hold the request its word names ({word})")]
    OtherId { word: u64 },
    #[error("it holds a request that is not a Run")]
    NotRun,
}

impl std::fmt::Debug for Doorbell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.debug("Doorbell", f)
    }
}

impl PartialEq for Doorbell {
    fn eq(&self, other: &Self) -> bool {
        self.0.same(&other.0)
    }
}
