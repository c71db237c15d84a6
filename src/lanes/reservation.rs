//! The one up-front memory reservation. On the CPU backend it is a host
//! buffer standing in for device memory: allocated and touched once at
//! start-up, never grown; lanes are byte ranges of it.

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

/// One contiguous block of memory, 8-byte aligned.
#[derive(Debug)]
pub struct Reservation {
    words: Vec<u64>,
    bytes: u64,
}

impl Reservation {
    /// Reserves and zeroes `bytes` bytes. Failure to allocate is an error,
    /// not an abort.
    pub fn new(bytes: u64) -> Result<Self, ReserveError> {
        let alloc = |reason: String| ReserveError::Alloc { bytes, reason };
        let words = usize::try_from(bytes.div_ceil(8))
            .map_err(|_| alloc("larger than the address space".into()))?;
        let mut v: Vec<u64> = Vec::new();
        v.try_reserve_exact(words)
            .map_err(|e| alloc(e.to_string()))?;
        v.resize(words, 0);
        Ok(Reservation { words: v, bytes })
    }

    /// Size in bytes.
    pub fn capacity(&self) -> u64 {
        self.bytes
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
        // Both fit in usize: the buffer of `bytes` bytes exists.
        Ok(offset as usize..end as usize)
    }

    /// The bytes `offset..offset + len`.
    pub fn region(&self, offset: u64, len: u64) -> Result<&[u8], ReserveError> {
        let r = self.range(offset, len)?;
        Ok(&bytemuck::cast_slice::<u64, u8>(&self.words)[r])
    }

    /// The bytes `offset..offset + len`, writable.
    pub fn region_mut(&mut self, offset: u64, len: u64) -> Result<&mut [u8], ReserveError> {
        let r = self.range(offset, len)?;
        Ok(&mut bytemuck::cast_slice_mut::<u64, u8>(&mut self.words)[r])
    }

    /// Applies relocations reported by the lane manager, in order. Each is
    /// a `memmove`; the manager orders them so none overwrites bytes a
    /// later one still has to read.
    pub fn apply_moves(&mut self, moves: &[Move]) -> Result<(), ReserveError> {
        for m in moves {
            self.range(m.from, m.bytes)?;
            let dst = self.range(m.to, m.bytes)?;
            let bytes = bytemuck::cast_slice_mut::<u64, u8>(&mut self.words);
            bytes.copy_within(m.from as usize..(m.from + m.bytes) as usize, dst.start);
        }
        Ok(())
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
}
