//! Recycled storage for decoded tensors.
//!
//! Decoding a tensor frame copies its bytes into an aligned `Vec`. A fresh
//! `Vec` of many megabytes is fresh memory from the allocator (glibc maps
//! large blocks anew and unmaps them on free), so the copy also pays one
//! page fault per 4 KiB page, which can cost more than the copy itself. A
//! service that receives a feed of the same size every iteration gives the
//! feed tensors back to a [`BufferPool`] after the run, and the next decode
//! writes into memory that is already mapped.

use crate::tensor::{DType, Tensor, TensorData};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

/// Buffers smaller than this are not kept: the allocator serves them from
/// memory it already has.
pub const MIN_POOLED_BYTES: usize = 1 << 20;

/// The largest block glibc's dynamic mmap threshold follows (its
/// `DEFAULT_MMAP_THRESHOLD_MAX` on 64-bit hosts).
const GLIBC_MMAP_THRESHOLD_MAX: usize = 32 << 20;

/// Lets the allocator keep freed blocks below 32 MiB mapped, so that the
/// frames ZeroMQ allocates and frees for every large message (which no pool
/// can hold: ZeroMQ owns them) land on pages already mapped.
///
/// glibc serves blocks above its mmap threshold (128 KiB at start) with a
/// fresh `mmap` and unmaps them on free; each new block then costs a page
/// fault per 4 KiB page. The threshold is dynamic (mallopt(3)): freeing an
/// mmapped block of at most 32 MiB raises it to that block's size (and the
/// heap trim threshold to twice that). Allocating and freeing one block
/// just under 32 MiB does that once per process: the block's chunk
/// (its size, a size word, rounded up to pages) must not pass 32 MiB, and
/// a block of exactly 32 MiB does (glibc 2.36 then leaves the thresholds
/// at 128 KiB: every large block mapped anew). 128 KiB less leaves room
/// for the size word at any page size up to 64 KiB. The block is zeroed by
/// `calloc`'s `mmap` and never touched, so it costs two system calls.
/// Other allocators ignore it.
pub fn keep_freed_blocks_mapped() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        drop(std::hint::black_box(vec![
            0u8;
            GLIBC_MMAP_THRESHOLD_MAX
                - (128 << 10)
        ]))
    });
}

/// Tensor storage given back after use, reused by the next decode of a
/// tensor of at most the same size. Cloning shares the pool. Holds at most
/// `limit_bytes` of buffers (by capacity); giving one more frees the oldest
/// ones until it fits.
#[derive(Debug, Clone)]
pub struct BufferPool {
    inner: Arc<Mutex<Buffers>>,
}

#[derive(Debug, Default)]
struct Buffers {
    /// Oldest first.
    list: VecDeque<TensorData>,
    /// Bytes held (sum of capacities).
    bytes: usize,
    limit: usize,
}

fn capacity(d: &TensorData) -> usize {
    match d {
        TensorData::F32(v) => v.capacity(),
        TensorData::I64(v) => v.capacity(),
        TensorData::F16(v) => v.capacity(),
        TensorData::BF16(v) => v.capacity(),
    }
}

fn capacity_bytes(d: &TensorData) -> usize {
    capacity(d) * d.dtype().size()
}

impl Buffers {
    /// Removes the smallest buffer of `dtype` able to hold `len` elements
    /// without leaving more than half of it unused.
    fn best_fit(&mut self, dtype: DType, len: usize) -> Option<TensorData> {
        let (i, _) = self
            .list
            .iter()
            .enumerate()
            .filter(|(_, d)| d.dtype() == dtype && capacity(d) >= len && capacity(d) / 2 <= len)
            .min_by_key(|(_, d)| capacity(d))?;
        let d = self.list.remove(i)?;
        self.bytes -= capacity_bytes(&d);
        Some(d)
    }
}

impl BufferPool {
    /// A pool holding at most `limit_bytes` of buffers.
    pub fn new(limit_bytes: usize) -> Self {
        BufferPool {
            inner: Arc::new(Mutex::new(Buffers {
                limit: limit_bytes,
                ..Buffers::default()
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Buffers> {
        // The pool holds plain buffers and a byte count updated together
        // under the lock: a panic elsewhere cannot leave it inconsistent.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Bytes of storage the pool holds now.
    pub fn held_bytes(&self) -> usize {
        self.lock().bytes
    }

    /// Keeps a tensor's storage for reuse if it is at least
    /// [`MIN_POOLED_BYTES`] and at most the limit, freeing the oldest
    /// buffers held when the limit would be passed.
    pub fn give(&self, t: Tensor) {
        let data = t.into_data();
        let bytes = capacity_bytes(&data);
        let mut b = self.lock();
        if bytes < MIN_POOLED_BYTES || bytes > b.limit {
            return;
        }
        while b.bytes.saturating_add(bytes) > b.limit {
            match b.list.pop_front() {
                Some(old) => b.bytes -= capacity_bytes(&old),
                None => break,
            }
        }
        b.bytes += bytes;
        b.list.push_back(data);
    }

    /// Frees every buffer held.
    pub fn clear(&self) {
        let mut b = self.lock();
        b.list.clear();
        b.bytes = 0;
    }

    /// A buffer of exactly `len` elements of `dtype` (values unspecified).
    pub(crate) fn data(&self, dtype: DType, len: usize) -> TensorData {
        let reused = self.lock().best_fit(dtype, len);
        match (dtype, reused) {
            (DType::F32, Some(TensorData::F32(v))) => TensorData::F32(sized(Some(v), len, 0.0)),
            (DType::I64, Some(TensorData::I64(v))) => TensorData::I64(sized(Some(v), len, 0)),
            (DType::F16, Some(TensorData::F16(v))) => {
                TensorData::F16(sized(Some(v), len, crate::f16::ZERO))
            }
            (DType::BF16, Some(TensorData::BF16(v))) => {
                TensorData::BF16(sized(Some(v), len, crate::bf16::ZERO))
            }
            _ => TensorData::zeros(dtype, len),
        }
    }
}

/// `v` (or a new zeroed vector) with length `len`; only the part beyond its
/// old length is written.
fn sized<T: Copy>(v: Option<Vec<T>>, len: usize, zero: T) -> Vec<T> {
    match v {
        Some(mut v) => {
            if v.len() >= len {
                v.truncate(len);
            } else {
                v.resize(len, zero);
            }
            v
        }
        None => vec![zero; len],
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    const BIG: usize = MIN_POOLED_BYTES / 4;

    impl BufferPool {
        fn f32s(&self, len: usize) -> Vec<f32> {
            match self.data(DType::F32, len) {
                TensorData::F32(v) => v,
                other => panic!("asked for f32, got {}", other.dtype()),
            }
        }
        fn i64s(&self, len: usize) -> Vec<i64> {
            match self.data(DType::I64, len) {
                TensorData::I64(v) => v,
                other => panic!("asked for i64, got {}", other.dtype()),
            }
        }
    }

    #[test]
    fn given_storage_is_reused_for_a_fitting_size() {
        let pool = BufferPool::new(64 << 20);
        let t = Tensor::full([BIG], 2.0);
        let ptr = t.f32s().unwrap().as_ptr();
        pool.give(t);
        assert_eq!(pool.held_bytes(), BIG * 4);
        let v = pool.f32s(BIG - 10);
        assert_eq!(v.len(), BIG - 10);
        assert_eq!(v.as_ptr(), ptr);
        assert_eq!(pool.held_bytes(), 0);
        // Empty pool: a fresh zeroed buffer.
        let w = pool.f32s(BIG);
        assert_ne!(w.as_ptr(), ptr);
        assert!(w.iter().all(|x| *x == 0.0));
    }

    #[test]
    fn small_wasteful_and_over_limit_buffers_are_not_used() {
        let pool = BufferPool::new(3 * BIG * 4);
        pool.give(Tensor::full([16], 1.0)); // too small to keep
        pool.give(Tensor::full([4 * BIG], 1.0)); // larger than the limit
        assert_eq!(pool.held_bytes(), 0);
        pool.give(Tensor::full([2 * BIG], 1.0));
        assert_eq!(pool.held_bytes(), 2 * BIG * 4);
        // Less than half of the buffer would be used: not handed out.
        let small = pool.f32s(BIG - 1);
        assert_eq!(pool.held_bytes(), 2 * BIG * 4);
        assert_eq!(small.len(), BIG - 1);
        let v = pool.f32s(2 * BIG);
        assert_eq!(v.len(), 2 * BIG);
        assert_eq!(pool.held_bytes(), 0);
        // A buffer longer in capacity than in length grows in place.
        let mut short = Vec::with_capacity(2 * BIG);
        short.resize(BIG, 1.0f32);
        let ptr = short.as_ptr();
        pool.give(Tensor::from_f32([BIG], short).unwrap());
        let grown = pool.f32s(2 * BIG - 5);
        assert_eq!((grown.len(), grown.as_ptr()), (2 * BIG - 5, ptr));
        assert!(grown[BIG..].iter().all(|x| *x == 0.0));
        // i64 and f32 storage are kept apart.
        pool.give(Tensor::from_i64([BIG], vec![3; BIG]).unwrap());
        assert_eq!(pool.f32s(BIG).len(), BIG);
        assert_eq!(pool.held_bytes(), BIG * 8);
        assert_eq!(pool.i64s(BIG).len(), BIG);
        assert_eq!(pool.held_bytes(), 0);
    }

    #[test]
    fn decoding_into_the_pool_reuses_storage_and_keeps_values() {
        let pool = BufferPool::new(64 << 20);
        let old = Tensor::full([BIG + 3], 9.0);
        let ptr = old.f32s().unwrap().as_ptr();
        pool.give(old);
        let values: Vec<f32> = (0..BIG).map(|i| i as f32 * 0.5).collect();
        let sent = Tensor::from_f32([BIG / 4, 4], values).unwrap();
        let frame = crate::wire::tensor_frame(&sent);
        let got = crate::wire::tensor_from_frame_in(&sent.ty(), &frame, Some(&pool)).unwrap();
        assert_eq!(got, sent);
        assert_eq!(got.f32s().unwrap().as_ptr(), ptr);
        // A frame of the wrong length is still refused.
        let err = crate::wire::tensor_from_frame_in(&sent.ty(), &frame[1..], Some(&pool));
        assert!(err.is_err());
    }

    #[test]
    fn the_oldest_buffers_go_first_when_the_limit_is_reached() {
        let pool = BufferPool::new(3 * BIG * 4);
        let first = Tensor::full([BIG], 1.0);
        let second = Tensor::full([BIG], 2.0);
        let second_ptr = second.f32s().unwrap().as_ptr();
        pool.give(first);
        pool.give(second);
        pool.give(Tensor::full([2 * BIG], 3.0)); // frees `first` only
        assert_eq!(pool.held_bytes(), 3 * BIG * 4);
        let v = pool.f32s(BIG);
        assert_eq!(v.as_ptr(), second_ptr);
        pool.clear();
        assert_eq!(pool.held_bytes(), 0);
    }
}
