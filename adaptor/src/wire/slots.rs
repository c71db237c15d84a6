//! The shared-memory side of the codec: a Run's feeds written into a
//! segment and taken back as views of it (checked against the segment,
//! disjoint, distinct), the reply slot and doorbell a shared Run names, and
//! the outputs a worker posts into a reply slot and a client reads back.

use super::codec::{options, SlotRange, TensorMeta};
use super::error::WireError;
use super::frames::{checked_len, copy_bytes, tensor_from_frame_in};
use super::shm::{self, OwnedSegment};
use super::{Limits, NamedTensor};
use crate::tensor::{Tensor, TensorData, TensorType};
use bincode::Options;

/// Writes the feeds' values into `seg` (packed by [`shm::layout`]) and
/// returns their offsets.
pub(super) fn write_shared(
    feeds: &[NamedTensor],
    seg: &mut OwnedSegment,
) -> Result<Vec<u64>, WireError> {
    let sizes: Vec<usize> = feeds.iter().map(|f| f.tensor.ty().bytes()).collect();
    let room = seg.len();
    let (offsets, _) = shm::layout(sizes.iter().copied())
        .filter(|(_, end)| *end <= room)
        .ok_or_else(|| WireError::Encode {
            reason: format!("the feeds do not fit the shared segment of {room} bytes"),
        })?;
    let bytes = seg.bytes_mut();
    for ((f, &at), &len) in feeds.iter().zip(&offsets).zip(&sizes) {
        let at = at as usize;
        write_tensor(&mut bytes[at..at + len], &f.tensor);
    }
    Ok(offsets)
}

/// Copies a tensor's values into `dst` (exactly its bytes) little-endian.
pub fn write_tensor(dst: &mut [u8], t: &Tensor) {
    match t.data() {
        TensorData::F32(v) => write_le(dst, t.data().ne_bytes(), v, f32::to_le_bytes),
        TensorData::I64(v) => write_le(dst, t.data().ne_bytes(), v, i64::to_le_bytes),
        TensorData::F16(v) => write_le(dst, t.data().ne_bytes(), v, crate::f16::to_le_bytes),
        TensorData::BF16(v) => write_le(dst, t.data().ne_bytes(), v, crate::bf16::to_le_bytes),
    }
}

/// Copies values into `dst` little-endian (one memory copy on
/// little-endian hosts).
fn write_le<T: Copy, const N: usize>(
    dst: &mut [u8],
    raw: &[u8],
    values: &[T],
    le: fn(T) -> [u8; N],
) {
    if cfg!(target_endian = "little") {
        copy_bytes(dst, raw);
    } else {
        for (d, v) in dst.chunks_exact_mut(N).zip(values) {
            d.copy_from_slice(&le(*v));
        }
    }
}

/// A Run's feeds in a shared segment at `offsets`, each range checked
/// against the segment and the tensor limit, the ranges pairwise disjoint
/// and under distinct names. Nothing is copied: the feeds are views of the
/// segment, read by the worker that runs the iteration.
pub(super) fn take_shared(
    metas: Vec<TensorMeta>,
    offsets: &[u64],
    segment_id: u32,
    seg: &std::sync::Arc<shm::AttachedSegment>,
    limits: &Limits,
) -> Result<Vec<shm::SharedFeed>, WireError> {
    if metas.len() != offsets.len() {
        return Err(WireError::SharedMemory {
            reason: format!(
                "{} feeds but {} offsets in the segment",
                metas.len(),
                offsets.len()
            ),
        });
    }
    let seg_len = seg.bytes().len();
    let mut ranges = Vec::with_capacity(metas.len());
    for (m, &at) in metas.iter().zip(offsets) {
        let len = checked_len(m, limits)?;
        let range = usize::try_from(at)
            .ok()
            .filter(|a| *a >= shm::SEGMENT_HEADER)
            .and_then(|a| Some(a..a.checked_add(len)?))
            .filter(|r| r.end <= seg_len);
        let Some(range) = range else {
            return Err(WireError::SharedMemory {
                reason: format!(
                    "feed `{}` ({len} bytes at offset {at}) is outside the segment's {} data bytes",
                    m.name,
                    seg_len.saturating_sub(shm::SEGMENT_HEADER)
                ),
            });
        };
        ranges.push(range);
    }
    let mut order: Vec<usize> = (0..ranges.len()).collect();
    order.sort_by_key(|&i| (ranges[i].start, ranges[i].end));
    for w in order.windows(2) {
        let (a, b) = (&ranges[w[0]], &ranges[w[1]]);
        if b.start < a.end && !a.is_empty() && !b.is_empty() {
            return Err(WireError::SharedMemory {
                reason: format!(
                    "feeds `{}` and `{}` overlap in the segment",
                    metas[w[0]].name, metas[w[1]].name
                ),
            });
        }
    }
    let mut names: Vec<&str> = metas.iter().map(|m| m.name.as_str()).collect();
    names.sort_unstable();
    if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
        return Err(WireError::SharedMemory {
            reason: format!("feed `{}` is listed twice", w[0]),
        });
    }
    metas
        .into_iter()
        .zip(ranges)
        .map(|(m, range)| {
            let name = m.name.clone();
            shm::SharedFeed::new(m.name, m.ty, segment_id, range.start, seg.clone()).ok_or_else(
                || WireError::SharedMemory {
                    reason: format!("feed `{name}` is outside the segment"),
                },
            )
        })
        .collect()
}

/// A Run's reply slot or doorbell (`what`) at `r`, made by `make`: inside
/// the segment past its header, aligned, at least `min` bytes long, and
/// disjoint from every feed of the Run and from `other` (the other area).
pub(super) fn take_area<A>(
    what: &str,
    r: SlotRange,
    min: usize,
    feeds: &[shm::SharedFeed],
    other: Option<std::ops::Range<usize>>,
    make: impl FnOnce(usize, usize) -> Option<(A, std::ops::Range<usize>)>,
    seg_len: usize,
) -> Result<A, WireError> {
    let bad = |why: &str| WireError::SharedMemory {
        reason: format!(
            "the {what} of {} bytes at offset {} {why}",
            r.bytes, r.offset
        ),
    };
    let (Ok(offset), Ok(bytes)) = (usize::try_from(r.offset), usize::try_from(r.bytes)) else {
        return Err(bad("is outside the segment"));
    };
    let (area, range) = make(offset, bytes).ok_or_else(|| {
        bad(&format!(
            "is not inside the segment's {seg_len} bytes past its {}-byte header, at a multiple of {}, at least {min} bytes",
            shm::SEGMENT_HEADER,
            shm::FEED_ALIGN,
        ))
    })?;
    if let Some(f) = feeds.iter().find(|f| {
        let len = f.ty.bytes();
        len > 0 && f.offset() < range.end && range.start < f.offset() + len
    }) {
        return Err(bad(&format!("overlaps feed `{}`", f.name)));
    }
    if other.is_some_and(|o| o.start < range.end && range.start < o.end) {
        return Err(bad("overlaps the Run's other shared area"));
    }
    Ok(area)
}

/// Writes `outputs` into `slot` as Run `seq`'s answer (see
/// [`shm::ReplySlot::post`]); whether they are there (`false`: they go in
/// the socket reply).
pub fn post_outputs(slot: &shm::ReplySlot, seq: u64, outputs: &[Tensor]) -> bool {
    let types: Vec<TensorType> = outputs.iter().map(Tensor::ty).collect();
    let Ok(table) = options().serialize(&types) else {
        return false;
    };
    let Some((offsets, need)) = slot_layout(table.len(), outputs.iter().map(|t| t.ty().bytes()))
    else {
        return false;
    };
    slot.post(seq, need, table.len(), |body| {
        // `body` starts at the slot's header end; offsets are the slot's.
        let at = |o: usize| o - shm::REPLY_HEADER;
        body[..table.len()].copy_from_slice(&table);
        for (t, o) in outputs.iter().zip(offsets) {
            let o = at(o as usize);
            write_tensor(&mut body[o..o + t.ty().bytes()], t);
        }
    })
}

/// Writes outputs of `types` into `slot` as Run `seq`'s answer, their
/// values by `write`, which gets one place per output, exactly its type's
/// bytes, in order (a backend copies them there straight from the device).
/// `Ok(true)`: they are in the slot. `Ok(false)`: nothing was written,
/// `write` was not called (the slot is too small or the segment not
/// writable; [`post_outputs`] then says so in the slot). `Err`: `write`'s
/// error, and nothing posted (see [`shm::ReplySlot::try_post`]).
pub fn post_outputs_with<E>(
    slot: &shm::ReplySlot,
    seq: u64,
    types: &[TensorType],
    write: impl FnOnce(&mut [&mut [u8]]) -> Result<(), E>,
) -> Result<bool, E> {
    let Ok(table) = options().serialize(types) else {
        return Ok(false);
    };
    let Some((offsets, need)) = slot_layout(table.len(), types.iter().map(TensorType::bytes))
    else {
        return Ok(false);
    };
    if !slot.holds(need) {
        return Ok(false);
    }
    slot.try_post(seq, need, table.len(), |body| {
        // `body` starts at the slot's header end; offsets are the slot's.
        let (head, mut rest) = body.split_at_mut(table.len());
        head.copy_from_slice(&table);
        let mut at = shm::REPLY_HEADER + table.len();
        let mut places = Vec::with_capacity(types.len());
        for (ty, o) in types.iter().zip(offsets) {
            // Packed in order, each at or after the previous one's end.
            let gap = o as usize - at;
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(gap);
            let (place, tail) = tail.split_at_mut(ty.bytes());
            places.push(place);
            rest = tail;
            at = o as usize + ty.bytes();
        }
        write(&mut places)
    })
}

/// Offsets (from the slot's start) of values of `sizes` bytes after a
/// table of `table` bytes, packed as a segment's feeds are, and the bytes
/// the slot then needs.
fn slot_layout(table: usize, sizes: impl IntoIterator<Item = usize>) -> Option<(Vec<u64>, usize)> {
    let start = shm::REPLY_HEADER
        .checked_add(table)?
        .checked_next_multiple_of(shm::FEED_ALIGN)?;
    shm::layout_from(start, sizes)
}

/// What a reply slot holds for one Run (see [`read_slot`]).
#[derive(Debug, Clone, PartialEq)]
pub enum SlotRead {
    /// Not answered here (yet): the sequence word names another Run.
    NotYet,
    /// The Run's outputs.
    Here(Vec<Tensor>),
    /// Its outputs travel in the socket reply; the slot would need `need`
    /// bytes.
    OnSocket { need: u64 },
}

/// Where a reply slot's outputs lie (see [`find_in_slot`]).
#[derive(Debug, Clone, PartialEq)]
pub enum SlotFind {
    /// Not answered here (yet): the sequence word names another Run.
    NotYet,
    /// Each output's type and the range of its values in the slot.
    Here(Vec<(TensorType, std::ops::Range<usize>)>),
    /// Its outputs travel in the socket reply; the slot would need `need`
    /// bytes.
    OnSocket { need: u64 },
}

/// Reads Run `seq`'s answer from the slot whose bytes are `slot` (header
/// included), given its sequence word `word` as read with acquire ordering.
/// The table and every range are checked against the slot and `limits`.
pub fn read_slot(slot: &[u8], word: u64, seq: u64, limits: &Limits) -> Result<SlotRead, WireError> {
    Ok(match find_in_slot(slot, word, seq, limits)? {
        SlotFind::NotYet => SlotRead::NotYet,
        SlotFind::OnSocket { need } => SlotRead::OnSocket { need },
        SlotFind::Here(places) => SlotRead::Here(slot_outputs(slot, &places)?),
    })
}

/// The outputs at `places` (as [`find_in_slot`] found them, offsets from
/// the start of `bytes`) copied out of `bytes`.
pub fn slot_outputs(
    bytes: &[u8],
    places: &[(TensorType, std::ops::Range<usize>)],
) -> Result<Vec<Tensor>, WireError> {
    let bad = |reason: String| WireError::SharedMemory { reason };
    places
        .iter()
        .map(|(ty, range)| {
            let values = bytes
                .get(range.clone())
                .ok_or_else(|| bad(format!("output {ty} lies outside the reply slot")))?;
            tensor_from_frame_in(ty, values, None).map_err(|e| bad(e.to_string()))
        })
        .collect()
}

/// [`read_slot`] without copying the outputs: where each lies in `slot`.
pub fn find_in_slot(
    slot: &[u8],
    word: u64,
    seq: u64,
    limits: &Limits,
) -> Result<SlotFind, WireError> {
    if word != seq {
        return Ok(SlotFind::NotYet);
    }
    let bad = |reason: String| WireError::SharedMemory { reason };
    let header = slot
        .get(..shm::REPLY_HEADER)
        .ok_or_else(|| bad("the reply slot is shorter than its header".into()))?;
    let u32_at =
        |i: usize| u32::from_le_bytes([header[i], header[i + 1], header[i + 2], header[i + 3]]);
    let mut need = [0u8; 8];
    need.copy_from_slice(&header[16..24]);
    let need = u64::from_le_bytes(need);
    match u32_at(8) {
        shm::SLOT_HERE => {}
        shm::SLOT_ON_SOCKET => return Ok(SlotFind::OnSocket { need }),
        other => return Err(bad(format!("the reply slot's status is {other}"))),
    }
    let table_len = u32_at(12) as usize;
    let table = slot
        .get(shm::REPLY_HEADER..shm::REPLY_HEADER.saturating_add(table_len))
        .ok_or_else(|| {
            bad(format!(
                "the reply slot's table of {table_len} bytes is outside it"
            ))
        })?;
    let types: Vec<TensorType> = options()
        .with_limit(table_len as u64)
        .deserialize(table)
        .map_err(|e| bad(format!("the reply slot's table: {e}")))?;
    if types.len() > limits.max_frames {
        return Err(bad(format!(
            "the reply slot names {} outputs, more than {}",
            types.len(),
            limits.max_frames
        )));
    }
    let mut sizes = Vec::with_capacity(types.len());
    for (i, ty) in types.iter().enumerate() {
        let m = TensorMeta {
            name: format!("output {i}"),
            ty: ty.clone(),
        };
        sizes.push(checked_len(&m, limits)?);
    }
    let (offsets, _) = slot_layout(table_len, sizes.iter().copied())
        .ok_or_else(|| bad("the reply slot's outputs overflow".into()))?;
    types
        .into_iter()
        .zip(offsets.into_iter().zip(sizes))
        .map(|(ty, (at, len))| {
            let at = usize::try_from(at).unwrap_or(usize::MAX);
            let end = at
                .checked_add(len)
                .filter(|&e| e <= slot.len())
                .ok_or_else(|| bad(format!("output {ty} lies outside the reply slot")))?;
            Ok((ty, at..end))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(SlotFind::Here)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn meta(name: &str, n: usize) -> TensorMeta {
        TensorMeta {
            name: name.into(),
            ty: TensorType::f32([n]),
        }
    }

    /// Shared feeds are checked as a whole before any is copied: feeds
    /// that overlap (a few bytes of header naming one range many times
    /// would copy it that many times) or share a name are refused.
    #[cfg(target_os = "linux")]
    #[test]
    fn shared_feeds_must_be_disjoint_and_distinct() {
        let (_own, seg) = shm::attached_pair(1, shm::SEGMENT_HEADER + 1024);
        let l = Limits::default();
        let at = shm::SEGMENT_HEADER as u64;
        let ok = take_shared(
            vec![meta("a", 64), meta("b", 64)],
            &[at, at + 256],
            1,
            &seg,
            &l,
        )
        .unwrap();
        assert_eq!(ok.len(), 2);
        assert_eq!(
            (ok[1].offset(), ok[1].bytes().len()),
            (at as usize + 256, 256)
        );
        for (metas, offsets) in [
            (vec![meta("a", 64), meta("b", 64)], vec![at, at]),
            (vec![meta("a", 64), meta("b", 64)], vec![at, at + 128]),
            (vec![meta("a", 8), meta("a", 8)], vec![at, at + 512]),
            (vec![meta("a", 64)], vec![at - 1]),
            (vec![meta("a", 64)], vec![at + 1024 - 255]),
        ] {
            let e = take_shared(metas, &offsets, 1, &seg, &l).unwrap_err();
            assert!(matches!(e, WireError::SharedMemory { .. }), "{e}");
        }
    }

    /// Outputs written in place by a backend read back as the same
    /// tensors `post_outputs` would give; a slot too small is left
    /// alone without asking for the values; a failed write posts nothing.
    #[cfg(target_os = "linux")]
    #[test]
    fn outputs_written_in_place_read_back_as_posted() {
        let bytes = 4096;
        let (own, seg) = shm::attached_pair(1, shm::SEGMENT_HEADER + 2 * bytes);
        let at = shm::SEGMENT_HEADER;
        let slot = shm::ReplySlot::new(seg.clone(), 1, at, bytes).unwrap();
        let outs = [
            Tensor::from_f32([3], vec![1.0, -2.5, 3.25]).unwrap(),
            Tensor::from_i64([2, 1], vec![-7, 9]).unwrap(),
            Tensor::from_f32([0], vec![]).unwrap(),
            Tensor::from_f32([5], vec![0.5; 5]).unwrap(),
        ];
        let types: Vec<TensorType> = outs.iter().map(Tensor::ty).collect();
        let l = Limits::default();
        let written = post_outputs_with(&slot, 7, &types, |places| {
            assert_eq!(places.len(), outs.len());
            for (p, t) in places.iter_mut().zip(&outs) {
                write_tensor(p, t);
            }
            Ok::<(), ()>(())
        });
        assert_eq!(written, Ok(true));
        assert_eq!(
            own.read_slot(at, bytes, 7, &l).unwrap(),
            SlotRead::Here(outs.to_vec())
        );
        // A failed write: the slot still answers Run 7 only.
        let failed = post_outputs_with(&slot, 8, &types, |_| Err("device"));
        assert_eq!(failed, Err("device"));
        assert_eq!(own.read_slot(at, bytes, 8, &l).unwrap(), SlotRead::NotYet);
        // Too small: not asked for the values, nothing posted.
        let small = shm::ReplySlot::new(seg, 1, at + bytes, 128).unwrap();
        let big = [TensorType::f32([64])];
        let r = post_outputs_with(&small, 9, &big, |_| -> Result<(), ()> {
            panic!("asked to write into a slot too small")
        });
        assert_eq!(r, Ok(false));
        assert_eq!(
            own.read_slot(at + bytes, 128, 9, &l).unwrap(),
            SlotRead::NotYet
        );
    }
}
