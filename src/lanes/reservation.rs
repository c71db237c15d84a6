//! The one up-front memory reservation. On the CPU backend it is a host
//! buffer standing in for device memory: an anonymous memory mapping, so
//! reserving costs neither start-up time nor resident memory (its pages
//! read as zero and are backed on first touch); never grown; lanes are
//! byte ranges of it.
//!
//! Every byte is reached through the mapping's base pointer
//! ([`Reservation::base`]): [`Reservation::region`], `region_mut` and
//! `apply_moves` through the whole-mapping slices of two small accessors,
//! and a lane's turn ([`super::LaneTurn::memory`]) through slices of its
//! own job's ranges. The latter exist only while [`super::SharedLanes`]
//! lends the reservation to nobody else, so the two never overlap in time.

use memmap2::{MmapMut, MmapRaw};

use super::manager::Move;

/// Why the reservation could not be made or accessed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReserveError {
    #[error("cannot reserve {bytes} bytes: {reason}")]
    Alloc { bytes: u64, reason: String },
    #[error("range {offset}+{len} lies outside the reservation of {capacity} bytes")]
    OutOfRange {
        offset: u64,
        len: u64,
        capacity: u64,
    },
}

/// One contiguous block of memory, page-aligned (so 8-byte aligned).
#[derive(Debug)]
pub struct Reservation {
    /// Private, anonymous, read-write; `bytes` long (`MmapRaw` hands out
    /// its base pointer without forming a reference to the bytes).
    map: MmapRaw,
    bytes: u64,
}

impl Reservation {
    /// Maps `bytes` bytes of zeroed memory (touched lazily). Failure to map
    /// is an error, not an abort.
    pub fn new(bytes: u64) -> Result<Self, ReserveError> {
        let alloc = |reason: String| ReserveError::Alloc { bytes, reason };
        let len = usize::try_from(bytes)
            .ok()
            .filter(|&n| isize::try_from(n).is_ok())
            .ok_or_else(|| alloc("larger than the address space".into()))?;
        let map = MmapMut::map_anon(len).map_err(|e| alloc(e.to_string()))?;
        Ok(Reservation {
            map: MmapRaw::from(map),
            bytes,
        })
    }

    /// Size in bytes.
    pub fn capacity(&self) -> u64 {
        self.bytes
    }

    /// The mapping's first word. Forms no reference to the bytes: a lane's
    /// turn builds its slices from it (see [`super::LaneTurn::memory`]).
    pub(super) fn base(&self) -> *mut u64 {
        self.map.as_mut_ptr().cast()
    }

    fn range(&self, offset: u64, len: u64) -> Result<std::ops::Range<usize>, ReserveError> {
        let oob = ReserveError::OutOfRange {
            offset,
            len,
            capacity: self.bytes,
        };
        let end = offset.checked_add(len).ok_or(oob.clone())?;
        if end > self.bytes {
            return Err(oob);
        }
        // Both fit in usize: the mapping of `bytes` bytes exists.
        Ok(offset as usize..end as usize)
    }

    /// The bytes `offset..offset + len`.
    pub fn region(&self, offset: u64, len: u64) -> Result<&[u8], ReserveError> {
        let r = self.range(offset, len)?;
        Ok(&self.bytes()[r])
    }

    /// The bytes `offset..offset + len`, writable.
    pub fn region_mut(&mut self, offset: u64, len: u64) -> Result<&mut [u8], ReserveError> {
        let r = self.range(offset, len)?;
        Ok(&mut self.bytes_mut()[r])
    }

    /// Applies relocations reported by the lane manager, in order. Each is
    /// a `memmove`; the manager orders them so none overwrites bytes a
    /// later one still has to read.
    pub fn apply_moves(&mut self, moves: &[Move]) -> Result<(), ReserveError> {
        for m in moves {
            let src = self.range(m.from, m.bytes)?;
            let dst = self.range(m.to, m.bytes)?;
            self.bytes_mut().copy_within(src, dst.start);
        }
        Ok(())
    }
}

/// The whole mapping as one slice: the reservation's only `unsafe`
/// besides a lane turn's slices (`LaneTurn::memory`).
#[allow(unsafe_code)]
impl Reservation {
    fn bytes(&self) -> &[u8] {
        // SAFETY: `map` is a live read-write mapping of `bytes` bytes (it
        // fits in isize, checked in `new`) that lives as long as `self`;
        // the pointer is page-aligned and non-null. The only other
        // references into the bytes are a lane turn's slices, and the
        // lanes reach `bytes` / `bytes_mut` (through `region`,
        // `region_mut`, `apply_moves`, and the `&mut Reservation` they
        // lend) only while no turn is active, so none is live during the
        // returned borrow. (While turns run the lanes read only `base` and
        // `capacity`, which form no reference to the bytes.)
        unsafe { std::slice::from_raw_parts(self.map.as_ptr(), self.bytes as usize) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`; `&mut self` excludes every other borrow
        // made through this reservation, and turn slices are not live (see
        // `bytes`).
        unsafe { std::slice::from_raw_parts_mut(self.map.as_mut_ptr(), self.bytes as usize) }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn regions_are_bounded() {
        let mut r = Reservation::new(1000).unwrap();
        assert_eq!(r.capacity(), 1000);
        r.region_mut(990, 10).unwrap().fill(7);
        assert_eq!(r.region(995, 5).unwrap(), &[7; 5]);
        assert!(matches!(
            r.region(995, 6),
            Err(ReserveError::OutOfRange {
                offset: 995,
                len: 6,
                capacity: 1000
            })
        ));
        assert!(r.region(u64::MAX, 2).is_err());
    }

    #[test]
    fn huge_reservation_is_an_error() {
        assert!(matches!(
            Reservation::new(u64::MAX),
            Err(ReserveError::Alloc { .. })
        ));
    }

    /// Resident memory of this process, from /proc (Linux).
    fn resident_bytes() -> Option<u64> {
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
        let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib * 1024)
    }

    /// A large reservation is mapped, not filled: it reads as zero and only
    /// the pages touched become resident.
    #[test]
    fn a_large_reservation_is_not_resident_until_touched() {
        const GIB: u64 = 1 << 30;
        let before = resident_bytes();
        let mut r = Reservation::new(GIB).unwrap();
        assert_eq!(r.capacity(), GIB);
        assert_eq!(r.region(0, 8).unwrap(), &[0; 8]);
        assert_eq!(r.region(GIB / 2, 8).unwrap(), &[0; 8]);
        r.region_mut(GIB - 8, 8).unwrap().fill(0xAB);
        assert_eq!(r.region(GIB - 16, 16).unwrap()[8..], [0xAB; 8]);
        if let (Some(b), Some(a)) = (before, resident_bytes()) {
            assert!(
                a.saturating_sub(b) < GIB / 4,
                "{} MiB became resident",
                (a - b) >> 20
            );
        }
        let empty = Reservation::new(0).unwrap();
        assert_eq!(empty.region(0, 0).unwrap(), &[] as &[u8]);
        assert!(empty.region(0, 1).is_err());
    }
}
