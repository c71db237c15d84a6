//! A program's arena at a fixed virtual address whose physical memory is
//! given up on eviction and taken again on return (CUDA virtual memory
//! management). The address never changes, so the CUDA graphs recorded for
//! the program (the whole iteration, the switch segments) stay valid across
//! any number of evictions, and the memory behind its ephemeral part may
//! change between iterations.
//!
//! An arena has two parts, each mapped to its own physical block: the
//! program's own memory (`[0, split)`: the persistent region) and the
//! ephemeral part (`[split, size)`: the planned ephemeral tensors and the
//! workspaces, used only during an iteration). The ephemeral part is either
//! the program's own block or **its lane's**: the programs of one lane map
//! one shared block (the lane's arena, as large as the largest of them
//! needs) and run one iteration at a time, so a lane holds
//! `sum P + max T` bytes, not `sum (P + T)` ([`VmArena::bind_lane`]).
//!
//! The own part may be cut in two blocks, `[0, keep)` and `[keep, split)`
//! ([`VmArena::set_keep`]), so that an eviction can give up the second
//! and keep the first mapped ([`VmArena::unmap_keeping`]: a partial
//! eviction, docs/switching.md). A block of one allocation maps only
//! whole (the driver maps an allocation from its start), so the cut is
//! made while the own part is unmapped.
//!
//! Physical blocks given up go to a process-wide free list keyed by size
//! (the next block of the same size is mapped without asking the driver for
//! new memory). The list keeps at most [`FREE_KEPT_BYTES`]; more is released
//! to the driver. A block is given up when no arena maps it any more.
//! The device reservation whose allocations every block is made of while
//! one is held is in `reservation.rs`: whole chunks, as few allocations as
//! fit (each costs a step of `cuMemSetAccess` at every mapping). A lane's
//! block may then end in an allocation that runs past a smaller program's
//! ephemeral part, so an arena reserves address space past its end for it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError, Weak};

use cudarc::driver::sys;
use cudarc::driver::CudaContext;

use super::program::dev_err;
use crate::exec::ExecError;

mod reservation;

use reservation::POOL;
pub use reservation::{DeviceReservation, RESERVE_CHUNK};

/// Bytes of given-up physical memory kept for reuse, process-wide.
const FREE_KEPT_BYTES: usize = 8 << 30;

/// Handles of unmapped physical memory by (device, size).
#[allow(clippy::type_complexity)]
static FREE: Mutex<Option<HashMap<(i32, usize), Vec<sys::CUmemGenericAllocationHandle>>>> =
    Mutex::new(None);

/// Each lane's shared ephemeral block by (device, lane), while some arena
/// maps it.
#[allow(clippy::type_complexity)]
static LANES: Mutex<Option<HashMap<(i32, u64), Weak<Block>>>> = Mutex::new(None);

fn location(device: sys::CUdevice) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: device,
    }
}

pub(super) fn prop(device: sys::CUdevice) -> sys::CUmemAllocationProp {
    // SAFETY: a plain C struct for which all-zero bytes are valid (null
    // pointer, zero enums and flags); the fields that matter are set below.
    let mut p: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    p.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location = location(device);
    p
}

/// Arena parts are multiples of this: the device reservation's chunk while
/// one is held, else the device's mapping granularity.
pub(super) fn granularity(ctx: &Arc<CudaContext>) -> Result<usize, ExecError> {
    let device = ctx.cu_device();
    if let Some(p) = POOL.lock().unwrap_or_else(PoisonError::into_inner).as_ref() {
        if p.device == device {
            return Ok(p.chunk);
        }
    }
    min_granularity(ctx)
}

/// The device's minimum mapping granularity.
pub(super) fn min_granularity(ctx: &Arc<CudaContext>) -> Result<usize, ExecError> {
    let p = prop(ctx.cu_device());
    let mut gran = 0usize;
    // SAFETY: valid out-pointer and property struct.
    unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut gran,
            &p,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    }
    .result()
    .map_err(|e| dev_err("allocation granularity", e))?;
    Ok(gran.max(1))
}

/// Unmaps the first pieces of `block`, mapped side by side from `at`,
/// that cover `bytes` (a prefix of whole pieces).
fn unmap_pieces(at: u64, block: &Block, bytes: usize) -> Result<(), ExecError> {
    let mut done = 0usize;
    for &(_, n) in &block.pieces {
        if done >= bytes {
            break;
        }
        // SAFETY: the caller mapped this piece here and no work uses it
        // any more.
        unsafe { sys::cuMemUnmap(at + done as u64, n) }
            .result()
            .map_err(|e| dev_err("unmapping the arena", e))?;
        done += n;
    }
    Ok(())
}

pub(super) fn round_up(bytes: usize, gran: usize) -> Result<usize, ExecError> {
    bytes
        .checked_next_multiple_of(gran)
        .ok_or_else(|| dev_err("arena size", "overflows"))
}

/// Physical memory of one arena part: one allocation, or allocations of
/// the device reservation (whole chunks, the largest first); back to the
/// reservation, the free list or the driver when the last arena that maps
/// it lets go.
struct Block {
    ctx: Arc<CudaContext>,
    device: sys::CUdevice,
    /// Allocations and their bytes, mapped side by side in this order.
    pieces: Vec<(sys::CUmemGenericAllocationHandle, usize)>,
    size: usize,
    /// Allocations of the device reservation.
    pooled: bool,
}

// SAFETY: the handle is a plain driver identifier owned by this value;
// every call on it binds the context first.
unsafe impl Send for Block {}
// SAFETY: as above; the block has no interior state.
unsafe impl Sync for Block {}

impl Block {
    /// A block of `size` bytes (a multiple of the granularity): a kept one
    /// if there is, else new memory.
    fn take(ctx: &Arc<CudaContext>, size: usize) -> Result<Arc<Block>, ExecError> {
        let device = ctx.cu_device();
        if let Some(p) = POOL
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_mut()
            .filter(|p| p.device == device)
        {
            let units = size.div_ceil(p.chunk);
            if let Some(pieces) = p.take_units(units) {
                return Ok(Arc::new(Block {
                    ctx: ctx.clone(),
                    device,
                    pieces,
                    size: units * p.chunk,
                    pooled: true,
                }));
            }
            tracing::warn!(
                bytes = size,
                free = p.free_bytes(),
                "device reservation exhausted: memory taken from the driver"
            );
        }
        let reused = FREE
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_or_insert_with(HashMap::new)
            .get_mut(&(device, size))
            .and_then(Vec::pop);
        let handle = match reused {
            Some(h) => h,
            None => {
                let mut h: sys::CUmemGenericAllocationHandle = 0;
                let p = prop(device);
                // SAFETY: valid out-pointer and property struct.
                unsafe { sys::cuMemCreate(&mut h, size, &p, 0) }
                    .result()
                    .map_err(|e| dev_err(&format!("allocating {size} bytes"), e))?;
                h
            }
        };
        Ok(Arc::new(Block {
            ctx: ctx.clone(),
            device,
            pieces: vec![(handle, size)],
            size,
            pooled: false,
        }))
    }

    /// The shared ephemeral block of `lane`, at least `size` bytes: the
    /// lane's current one when it is large enough, else a new one as large
    /// as both (arenas still mapping the old one keep it until they bind
    /// again).
    fn of_lane(ctx: &Arc<CudaContext>, lane: u64, size: usize) -> Result<Arc<Block>, ExecError> {
        let key = (ctx.cu_device(), lane);
        let mut lanes = LANES.lock().unwrap_or_else(PoisonError::into_inner);
        let lanes = lanes.get_or_insert_with(HashMap::new);
        let current = lanes.get(&key).and_then(Weak::upgrade);
        if let Some(b) = &current {
            if b.size >= size {
                return Ok(b.clone());
            }
        }
        let size = size.max(current.map_or(0, |b| b.size));
        let b = Block::take(ctx, size)?;
        lanes.insert(key, Arc::downgrade(&b));
        lanes.retain(|_, w| w.strong_count() > 0);
        Ok(b)
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        if self.pooled {
            let mut pool = POOL.lock().unwrap_or_else(PoisonError::into_inner);
            let pool = pool.as_mut().filter(|p| p.device == self.device);
            match pool {
                Some(p) => {
                    for (h, bytes) in self.pieces.drain(..) {
                        match p.class_of(bytes) {
                            Some(k) => p.free[k].push(h),
                            None => {
                                // SAFETY: mapped by no arena any more (each
                                // mapping holds an `Arc` to this block).
                                let _ = unsafe { sys::cuMemRelease(h) };
                            }
                        }
                    }
                }
                None => {
                    for &(h, _) in &self.pieces {
                        // SAFETY: no arena maps the chunk any more (each
                        // mapping holds an `Arc` to this block) and the
                        // reservation is gone.
                        let _ = unsafe { sys::cuMemRelease(h) };
                    }
                }
            }
            return;
        }
        let Some(&(handle, _)) = self.pieces.first() else {
            return;
        };
        let mut free = FREE.lock().unwrap_or_else(PoisonError::into_inner);
        let lists = free.get_or_insert_with(HashMap::new);
        let kept: usize = lists.iter().map(|((_, size), v)| size * v.len()).sum();
        if kept + self.size <= FREE_KEPT_BYTES {
            lists
                .entry((self.device, self.size))
                .or_default()
                .push(handle);
        } else {
            // SAFETY: no arena maps the handle any more (each mapping holds
            // an `Arc` to this block).
            let _ = unsafe { sys::cuMemRelease(handle) };
        }
    }
}

/// Bytes of the lanes' shared blocks alive now (on every device).
pub fn lane_block_bytes() -> u64 {
    let lanes = LANES.lock().unwrap_or_else(PoisonError::into_inner);
    lanes.as_ref().map_or(0, |m| {
        m.values()
            .filter_map(Weak::upgrade)
            .map(|b| b.size as u64)
            .sum()
    })
}

/// The kept prefix of the own memory (`[0, keep)`), the rest of it
/// (`[keep, split)`) and the ephemeral part (`[split, size)`).
const KEPT: usize = 0;
const OWN: usize = 1;
const EPH: usize = 2;

/// A reserved virtual range: `[0, split)` mapped to the program's own
/// blocks (`[0, keep)` and `[keep, split)`), `[split, size)` to its own or
/// its lane's, while resident.
pub(super) struct VmArena {
    ctx: Arc<CudaContext>,
    device: sys::CUdevice,
    va: u64,
    size: usize,
    /// Address space reserved: `size`, and room past it for the last
    /// allocation of a lane's block that covers the ephemeral part and
    /// runs past its end (see [`VmArena::covers`]).
    reserved: usize,
    split: usize,
    /// Where the own memory is cut (0: one block for all of it).
    keep: usize,
    /// The lane whose block the ephemeral part maps (`None`: its own).
    /// While the part is mapped, it maps that lane's block exactly when
    /// this is `Some`.
    lane: Option<u64>,
    /// Blocks of [`KEPT`], [`OWN`] and [`EPH`].
    parts: [Option<Arc<Block>>; 3],
    /// Bytes of each part mapped now (from its start; whole pieces). A part
    /// made of several chunks may be mapped a prefix at a time (see
    /// [`VmArena::map_through`]).
    mapped: [usize; 3],
}

// SAFETY: the range is a plain driver identifier owned by this value; every
// call on it binds the context first.
unsafe impl Send for VmArena {}

impl VmArena {
    /// Reserves address space for `own` bytes then `ephemeral` bytes (each
    /// rounded up to the granularity) and maps memory into the first part
    /// (the second is mapped by [`VmArena::map`]).
    pub fn new(ctx: &Arc<CudaContext>, own: usize, ephemeral: usize) -> Result<Self, ExecError> {
        ctx.bind_to_thread().map_err(|e| dev_err("bind", e))?;
        let gran = granularity(ctx)?;
        let split = round_up(own, gran)?;
        let size = split
            .checked_add(round_up(ephemeral.max(1), gran)?)
            .ok_or_else(|| dev_err("arena size", "overflows"))?;
        // Inside a device reservation a lane's block is made of allocations
        // up to the largest class; one may end past the ephemeral part.
        let slack = POOL
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .filter(|p| p.device == ctx.cu_device())
            .map_or(0, |p| p.class_bytes(reservation::CLASSES - 1) - p.chunk);
        let reserved = size
            .checked_add(slack)
            .ok_or_else(|| dev_err("arena size", "overflows"))?;
        let mut va = 0u64;
        // SAFETY: valid out-pointer; the range is freed in `Drop`.
        unsafe { sys::cuMemAddressReserve(&mut va, reserved, 0, 0, 0) }
            .result()
            .map_err(|e| dev_err(&format!("reserving {reserved} bytes of address space"), e))?;
        let mut a = VmArena {
            ctx: ctx.clone(),
            device: ctx.cu_device(),
            va,
            size,
            reserved,
            split,
            keep: 0,
            lane: None,
            parts: [None, None, None],
            mapped: [0, 0, 0],
        };
        // The persistent part now (variables are uploaded into it); the
        // ephemeral part at the first `map`, by then perhaps bound to its
        // lane's block (so a program in a lane never holds both).
        if split > 0 {
            let b = Block::take(ctx, split)?;
            a.map_part(OWN, b)?;
        }
        Ok(a)
    }

    /// The arena's device address (fixed for its lifetime).
    pub fn base(&self) -> u64 {
        self.va
    }

    /// Bytes of the range (a multiple of the granularity).
    pub fn size(&self) -> usize {
        self.size
    }

    /// The lane whose shared block the ephemeral part maps (when mapped).
    pub fn lane(&self) -> Option<u64> {
        self.lane
    }

    /// Bytes mapped to the program's own memory now (a lane's shared
    /// block is not counted).
    pub fn own_bytes(&self) -> usize {
        let held = |part: usize| match &self.parts[part] {
            Some(_) => self.range(part).1,
            None => 0,
        };
        let eph = match self.lane {
            None => held(EPH),
            Some(_) => 0,
        };
        held(KEPT) + held(OWN) + eph
    }

    /// Bytes of the own memory's kept block mapped now (the prefix a
    /// partial eviction keeps; 0 when the own memory is one block).
    pub fn kept_bytes(&self) -> usize {
        match &self.parts[KEPT] {
            Some(_) => self.keep,
            None => 0,
        }
    }

    /// Where the own memory is cut (see [`VmArena::set_keep`]).
    pub fn keep(&self) -> usize {
        self.keep
    }

    /// The cut of the own memory that holds its first `bytes`: rounded up
    /// to the granularity, at most the own memory's size (0 for 0).
    pub fn keep_for(&self, bytes: usize) -> Result<usize, ExecError> {
        if bytes == 0 {
            return Ok(0);
        }
        let gran = granularity(&self.ctx)?;
        Ok(round_up(bytes, gran)?.min(self.split))
    }

    /// Cuts the own memory at `keep` (a multiple of the granularity, or
    /// its size; 0: one block): from the next [`VmArena::map`] on,
    /// `[0, keep)` and `[keep, split)` are blocks of their own. Only while
    /// the own memory is unmapped (its contents are gone anyway).
    pub fn set_keep(&mut self, keep: usize) -> Result<(), ExecError> {
        if self.parts[KEPT].is_some() || self.parts[OWN].is_some() {
            return Err(dev_err("cutting the arena", "its own memory is mapped"));
        }
        // All of the own memory is one cut whatever the granularity now
        // (a program made before a reservation has pieces of another).
        let gran = granularity(&self.ctx)?;
        if keep > self.split || (keep % gran != 0 && keep != self.split) {
            return Err(dev_err(
                "cutting the arena",
                format!(
                    "{keep} bytes is not whole pieces of {gran} within {}",
                    self.split
                ),
            ));
        }
        self.keep = keep;
        Ok(())
    }

    /// Maps the kept block (`[0, keep)`) when it is not: a kept block of
    /// its size or new memory, contents undefined.
    pub fn map_kept(&mut self) -> Result<(), ExecError> {
        self.ctx.bind_to_thread().map_err(|e| dev_err("bind", e))?;
        if self.parts[KEPT].is_none() && self.keep > 0 {
            let b = Block::take(&self.ctx, self.keep)?;
            self.map_part(KEPT, b)?;
        }
        Ok(())
    }

    /// The ephemeral part from now on maps the shared block of `lane` (a
    /// key unique in the process; `None`: the program's own block). Takes
    /// effect at once when mapped. The caller runs the iterations of one
    /// lane one at a time and has synchronised every stream that used the
    /// ephemeral part.
    pub fn bind_lane(&mut self, lane: Option<u64>) -> Result<(), ExecError> {
        let Some(have) = self.parts[EPH].clone() else {
            // Not mapped: `map` binds.
            self.lane = lane;
            return Ok(());
        };
        let bytes = self.size - self.split;
        let want = match lane {
            Some(l) => self.lane_block(l)?,
            None if self.lane.is_none() => return Ok(()),
            None => Block::take(&self.ctx, bytes)?,
        };
        if Arc::ptr_eq(&have, &want) {
            self.lane = lane;
            return Ok(());
        }
        self.ctx.bind_to_thread().map_err(|e| dev_err("bind", e))?;
        self.unmap_part(EPH)?;
        self.lane = lane;
        self.map_part(EPH, want)
    }

    fn range(&self, part: usize) -> (u64, usize) {
        match part {
            KEPT => (self.va, self.keep),
            OWN => (self.va + self.keep as u64, self.split - self.keep),
            _ => (self.va + self.split as u64, self.size - self.split),
        }
    }

    fn map_part(&mut self, part: usize, block: Arc<Block>) -> Result<(), ExecError> {
        self.map_part_upto(part, block, usize::MAX)
    }

    /// The block the ephemeral part maps in `lane`: the lane's shared one,
    /// or, where its first allocations do not cover the part within the
    /// address space reserved for it (a lane's block of one larger
    /// allocation), one of the part's own. An allocation maps only whole:
    /// the driver refuses part of one (CUDA_ERROR_NOT_SUPPORTED, seen on
    /// an H100 when programs of different T shared a lane without a
    /// device reservation).
    fn lane_block(&self, lane: u64) -> Result<Arc<Block>, ExecError> {
        let bytes = self.size - self.split;
        match Block::of_lane(&self.ctx, lane, bytes)? {
            b if !self.covers(EPH, &b) => Block::take(&self.ctx, bytes),
            b => Ok(b),
        }
    }

    /// Whether the first allocations of `block` cover `part` and end
    /// inside the address space reserved for it: exactly at its end, or,
    /// for the ephemeral part (the last), in the room reserved past it.
    fn covers(&self, part: usize, block: &Block) -> bool {
        let (_, bytes) = self.range(part);
        let room = match part {
            EPH => self.reserved - self.split,
            _ => bytes,
        };
        let mut end = 0usize;
        for &(_, n) in &block.pieces {
            if end >= bytes {
                break;
            }
            end += n;
        }
        end >= bytes && end <= room
    }

    /// Maps `block` under `part`: the pieces covering its first `upto` bytes
    /// (see [`VmArena::extend_part`]).
    fn map_part_upto(
        &mut self,
        part: usize,
        block: Arc<Block>,
        upto: usize,
    ) -> Result<(), ExecError> {
        let (_, bytes) = self.range(part);
        if bytes == 0 {
            return Ok(());
        }
        // Whole allocations side by side (a lane's block may be larger than
        // this part: its first allocations; a single allocation maps
        // whole).
        if !self.covers(part, &block) {
            return Err(dev_err(
                "mapping the arena",
                format!(
                    "a block of {} bytes in {} allocations does not fit a part of {bytes}",
                    block.size,
                    block.pieces.len()
                ),
            ));
        }
        self.parts[part] = Some(block);
        self.mapped[part] = 0;
        self.extend_part(part, upto.min(bytes))
    }

    /// Maps the allocations of `part`'s block that cover its first `upto`
    /// bytes and are not mapped yet (whole ones: a single allocation is
    /// all of it), and makes them accessible with one `cuMemSetAccess`
    /// (whose time grows with the allocations in its range).
    fn extend_part(&mut self, part: usize, upto: usize) -> Result<(), ExecError> {
        let (at, bytes) = self.range(part);
        let Some(block) = self.parts[part].clone() else {
            return Err(dev_err("mapping the arena", "no block for the part"));
        };
        let from = self.mapped[part];
        let upto = upto.min(bytes);
        if upto <= from {
            return Ok(());
        }
        let t0 = std::time::Instant::now();
        let mut off = 0usize;
        let mut mapped = from;
        let mut pieces = 0usize;
        for &(h, n) in &block.pieces {
            if off >= upto {
                break;
            }
            if off >= from {
                // SAFETY: the range was reserved by `new` (with room past
                // the ephemeral part: `covers`) and this piece of it is
                // unmapped; the allocation holds `n` bytes.
                if let Err(e) = unsafe { sys::cuMemMap(at + off as u64, n, 0, h, 0) }.result() {
                    let _ = unmap_pieces(at, &block, mapped);
                    self.parts[part] = None;
                    self.mapped[part] = 0;
                    return Err(dev_err("mapping the arena", e));
                }
                mapped = off + n;
                pieces += 1;
            }
            off += n;
        }
        let t1 = std::time::Instant::now();
        let access = sys::CUmemAccessDesc {
            location: location(self.device),
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the range is mapped (just above).
        if let Err(e) =
            unsafe { sys::cuMemSetAccess(at + from as u64, mapped - from, &access, 1) }.result()
        {
            let _ = unmap_pieces(at, &block, mapped);
            self.parts[part] = None;
            self.mapped[part] = 0;
            return Err(dev_err("arena access", e));
        }
        self.mapped[part] = mapped;
        // What a switch's mapping costs, call by call (RUST_LOG=
        // lanes::exec::cuda::vm=trace; docs/switching.md).
        tracing::trace!(
            part,
            pieces,
            bytes = mapped - from,
            map_us = (t1 - t0).as_secs_f64() * 1e6,
            access_us = t1.elapsed().as_secs_f64() * 1e6,
            "mapped pieces"
        );
        Ok(())
    }

    fn unmap_part(&mut self, part: usize) -> Result<(), ExecError> {
        let Some(block) = self.parts[part].clone() else {
            return Ok(());
        };
        let (at, _) = self.range(part);
        // Only what is mapped (a prefix of whole pieces).
        unmap_pieces(at, &block, self.mapped[part])?;
        self.parts[part] = None;
        self.mapped[part] = 0;
        Ok(())
    }

    /// Maps memory into both parts (the own part: a kept block of its size
    /// or new memory; the ephemeral part: the lane's block or an own one).
    /// The contents are undefined.
    pub fn map(&mut self) -> Result<(), ExecError> {
        let t0 = std::time::Instant::now();
        self.map_kept()?;
        let own = self.split - self.keep;
        if self.parts[OWN].is_none() && own > 0 {
            let b = Block::take(&self.ctx, own)?;
            self.map_part(OWN, b)?;
        } else if self.parts[OWN].is_some() {
            self.extend_part(OWN, own)?;
        }
        self.map_ephemeral()?;
        tracing::trace!(
            ms = t0.elapsed().as_secs_f64() * 1e3,
            bytes = self.size,
            lane = ?self.lane,
            "mapped"
        );
        Ok(())
    }

    /// Maps the ephemeral part (the lane's block or an own one) when it is
    /// not. A switch maps it first, where the feeds land; the own part
    /// follows with [`VmArena::map_own_deferred`] while the feeds' copy
    /// runs.
    pub fn map_ephemeral(&mut self) -> Result<(), ExecError> {
        if self.parts[EPH].is_none() {
            let bytes = self.size - self.split;
            let b = match self.lane {
                Some(l) => self.lane_block(l)?,
                None => Block::take(&self.ctx, bytes)?,
            };
            self.map_part(EPH, b)?;
        }
        Ok(())
    }

    /// The kept block and, of the own part, only the pieces covering its
    /// first `first` bytes (from the arena's base): the rest is mapped by
    /// [`VmArena::map_through`] while earlier pieces are being filled (a
    /// switched-back program maps one chunk per call inside a device
    /// reservation; this takes those calls off the path to its first
    /// copy). A part that is one allocation is mapped whole.
    pub fn map_own_deferred(&mut self, first: usize) -> Result<(), ExecError> {
        self.map_kept()?;
        let own = self.split - self.keep;
        if self.parts[OWN].is_none() && own > 0 {
            let b = Block::take(&self.ctx, own)?;
            self.map_part_upto(OWN, b, first.saturating_sub(self.keep))?;
        }
        Ok(())
    }

    /// Maps the own part's pieces up to `upto` bytes from the arena's base
    /// (after [`VmArena::map_own_deferred`]); nothing when they are mapped.
    /// Every byte a copy or kernel touches must be mapped through first.
    pub fn map_through(&mut self, upto: usize) -> Result<(), ExecError> {
        let upto = upto.saturating_sub(self.keep);
        if self.parts[OWN].is_none() || upto <= self.mapped[OWN] {
            return Ok(());
        }
        self.extend_part(OWN, upto)
    }

    /// Gives the physical memory up (the own blocks to the free list; a
    /// lane's block stays with the lane's other programs). The caller has
    /// synchronised every stream that used the range.
    pub fn unmap(&mut self) -> Result<(), ExecError> {
        self.ctx.bind_to_thread().map_err(|e| dev_err("bind", e))?;
        self.unmap_part(KEPT)?;
        self.unmap_part(OWN)?;
        self.unmap_part(EPH)
    }

    /// Gives the ephemeral part up alone (the next [`VmArena::map`] maps
    /// it again). The caller has synchronised every stream that used it;
    /// copies out of the persistent part may still be in flight.
    pub fn unmap_ephemeral(&mut self) -> Result<(), ExecError> {
        self.ctx.bind_to_thread().map_err(|e| dev_err("bind", e))?;
        self.unmap_part(EPH)
    }

    /// [`VmArena::unmap`] but for the kept block (`[0, keep)`), which
    /// stays mapped with its contents: a partial eviction.
    pub fn unmap_keeping(&mut self) -> Result<(), ExecError> {
        self.ctx.bind_to_thread().map_err(|e| dev_err("bind", e))?;
        self.unmap_part(OWN)?;
        self.unmap_part(EPH)
    }
}

impl Drop for VmArena {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        for part in [KEPT, OWN, EPH] {
            // The program owning the range is gone; the block goes back
            // when no other arena maps it.
            let _ = self.unmap_part(part);
            self.parts[part] = None;
        }
        // SAFETY: the range was reserved by `new` and is unmapped now.
        let _ = unsafe { sys::cuMemAddressFree(self.va, self.reserved) };
    }
}
