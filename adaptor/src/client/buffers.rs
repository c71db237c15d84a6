//! Feed buffers: a session's feeds in a segment shared with the service,
//! written in place by the job, and the Runs that read them (their outputs
//! from the segment's reply slot when the service left them there).

use super::{
    unexpected, wait, Client, ClientError, PendingRun, Sent, DEFAULT_REPLY_BYTES, DOORBELL_BYTES,
    MIN_DOORBELL_BYTES,
};
use crate::tensor::{DType, Tensor, TensorType};
use crate::wire::shm::OwnedSegment;
use crate::wire::{self, Reply, SessionId, SlotFind};
use std::time::Instant;

impl Client {
    /// Buffers in a shared segment of `session` for the feeds `feeds` (name
    /// and type of each), attached to the session: write the inputs in
    /// place, then [`Client::run_buffers_in`] sends only a header.
    pub fn feed_buffers_in(
        &mut self,
        session: SessionId,
        feeds: &[(&str, TensorType)],
    ) -> Result<FeedBuffers, ClientError> {
        self.feed_buffers_with_reply_in(session, feeds, DEFAULT_REPLY_BYTES)
    }

    /// [`Client::feed_buffers_in`] with a reply slot of `reply_bytes` bytes
    /// in the same segment (none when zero): the service writes each Run's
    /// fetched tensors there too, and a client that busy-polls
    /// ([`ClientOptions::busy_poll`]) takes them from the slot as soon as
    /// they are written, without waiting for the socket reply. Outputs that
    /// do not fit come in the socket reply, and
    /// [`FeedBuffers::reply_wanted`] says how large a slot would do.
    pub fn feed_buffers_with_reply_in(
        &mut self,
        session: SessionId,
        feeds: &[(&str, TensorType)],
        reply_bytes: usize,
    ) -> Result<FeedBuffers, ClientError> {
        let mut names: Vec<&str> = feeds.iter().map(|f| f.0).collect();
        names.sort_unstable();
        if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
            return Err(ClientError::FeedBuffer {
                reason: format!("feed `{}` is listed twice", w[0]),
            });
        }
        let sizes = feeds
            .iter()
            .map(|(n, ty)| {
                ty.checked_bytes().ok_or_else(|| ClientError::FeedBuffer {
                    reason: format!("feed `{n}` of type {ty} has too many bytes"),
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let (offsets, need) =
            wire::shm::layout(sizes.iter().copied()).ok_or_else(|| ClientError::FeedBuffer {
                reason: "the feeds' bytes overflow".into(),
            })?;
        if !self.shared.usable {
            return Err(ClientError::NoSharedMemory {
                reason: "the service is not on this host, refuses shared memory, or shared memory is off in ClientOptions".into(),
            });
        }
        // The slot follows the feeds (`need` is a multiple of 64).
        let slot = (reply_bytes > 0)
            .then(|| {
                let bytes = reply_bytes
                    .max(wire::shm::REPLY_HEADER)
                    .checked_next_multiple_of(wire::shm::FEED_ALIGN)?;
                Some((need, bytes))
            })
            .flatten();
        // Then the doorbell, no larger than the service takes (none when
        // it takes too little for a Run's header).
        let bell_bytes = DOORBELL_BYTES.min(self.server_limits.max_doorbell_bytes);
        let after = match slot {
            Some((at, bytes)) => at.checked_add(bytes),
            None => Some(need),
        };
        let bell_at = after.filter(|_| bell_bytes >= MIN_DOORBELL_BYTES);
        let end = match bell_at {
            Some(at) => at.checked_add(bell_bytes),
            None => after,
        }
        .and_then(|e| e.checked_next_multiple_of(4096))
        .ok_or_else(|| ClientError::FeedBuffer {
            reason: format!("a reply slot of {reply_bytes} bytes overflows"),
        })?;
        let id = self.shared.next_id;
        self.shared.next_id = self.shared.next_id.wrapping_add(1);
        let mut seg = self
            .share_segment(session, id, end)?
            .map_err(|reason| ClientError::NoSharedMemory { reason })?;
        if let Some((at, _)) = slot {
            seg.clear_slot(at);
        }
        let bell = bell_at.map(|at| (at, bell_bytes));
        if let Some((at, _)) = bell {
            seg.clear_slot(at);
        }
        Ok(FeedBuffers {
            session,
            seg,
            feeds: feeds
                .iter()
                .zip(offsets)
                .map(|((n, ty), at)| (n.to_string(), ty.clone(), at))
                .collect(),
            slot,
            bell,
            wanted: None,
            trips: wait::RoundTrips::default(),
        })
    }

    /// Runs one iteration with the feeds' values as written into `buffers`
    /// (see [`Client::feed_buffers_in`]).
    pub fn run_buffers_in(
        &mut self,
        buffers: &mut FeedBuffers,
        fetches: &[&str],
    ) -> Result<Vec<Tensor>, ClientError> {
        let sent = self.send_buffers(buffers, fetches)?;
        let outputs = self.receive_buffers(&sent, buffers, fetches.len())?;
        buffers.take(outputs)
    }

    /// [`Client::run_buffers_in`] leaving the outputs where they came: in
    /// the buffers' reply slot ([`BufferOutputs::InSlot`], read them with
    /// [`FeedBuffers::output_bytes`] until the next Run from these buffers
    /// overwrites them) or, when they did not fit it, as tensors from the
    /// socket reply.
    pub fn run_buffers_in_place(
        &mut self,
        buffers: &mut FeedBuffers,
        fetches: &[&str],
    ) -> Result<BufferOutputs, ClientError> {
        let sent = self.send_buffers(buffers, fetches)?;
        self.receive_buffers(&sent, buffers, fetches.len())
    }

    /// The outputs of Run `sent` from `buffers`: from its reply slot when
    /// the service wrote them there (polled first while busy polling),
    /// else from the socket reply.
    fn receive_buffers(
        &mut self,
        sent: &Sent,
        buffers: &mut FeedBuffers,
        fetches: usize,
    ) -> Result<BufferOutputs, ClientError> {
        let Some((at, len)) = buffers.slot else {
            self.ahead.remove(&sent.id);
            return match self.receive(sent, None)? {
                Reply::RunDone { outputs } => Ok(BufferOutputs::Sent(outputs)),
                other => Err(unexpected("run", &other)),
            };
        };
        let limits = self.options.limits;
        let read = |buffers: &mut FeedBuffers| -> Result<SlotFind, ClientError> {
            let read = buffers
                .seg
                .find_in_slot(at, len, sent.id, &limits)
                .map_err(|e| ClientError::FeedBuffer {
                    reason: format!("the reply slot: {e}"),
                })?;
            if let SlotFind::OnSocket { need } = read {
                buffers.wanted = Some(usize::try_from(need).unwrap_or(usize::MAX));
            }
            Ok(read)
        };
        // Its socket reply, when taken while polling the slot.
        let mut socket_reply = None;
        let deadline = sent.sent + self.options.timeout;
        let how = wait::plan(
            self.options.busy_poll,
            self.options.adaptive_wait,
            &buffers.trips,
        );
        // With other requests under way their replies come first: sleep.
        let spin = how.spins() && !self.early.contains_key(&sent.id);
        if spin && !how.spin_from.is_zero() {
            // Sleep on the socket until shortly before the reply is due.
            let wake = (sent.sent + how.spin_from).min(deadline);
            socket_reply = self.sleep_until(sent, wake)?;
        }
        if socket_reply.is_none() && spin {
            let until = (Instant::now() + how.spin).min(deadline);
            loop {
                match read(buffers)? {
                    SlotFind::Here(places) if places.len() == fetches => {
                        // Its socket reply, when it comes, is dropped.
                        self.ahead.remove(&sent.id);
                        buffers.trips.record(sent.sent.elapsed());
                        self.drain_replies(sent);
                        return Ok(BufferOutputs::InSlot(places));
                    }
                    SlotFind::Here(_) | SlotFind::OnSocket { .. } => break,
                    SlotFind::NotYet => {}
                }
                if Instant::now() >= until {
                    break;
                }
                // Replies to earlier Runs answered through their slots
                // arrive meanwhile: taken and dropped without leaving.
                if self.conn.socket.poll(zmq::POLLIN, 0)? != 0 {
                    if let Some(r) = self.take_reply(sent, None)? {
                        socket_reply = Some(r);
                        break;
                    }
                }
                std::hint::spin_loop();
            }
        }
        let reply = match socket_reply {
            Some(r) => r,
            None => self.receive(sent, None),
        };
        self.ahead.remove(&sent.id);
        let outputs = match reply? {
            Reply::RunDone { outputs } => outputs,
            other => return Err(unexpected("run", &other)),
        };
        buffers.trips.record(sent.sent.elapsed());
        // Read after the reply (also to learn whether the slot was too
        // small): what the service wrote before replying is visible.
        match read(buffers) {
            _ if outputs.len() == fetches => Ok(BufferOutputs::Sent(outputs)),
            Ok(SlotFind::Here(here)) if here.len() == fetches => Ok(BufferOutputs::InSlot(here)),
            Err(e) => Err(e),
            _ => Err(ClientError::FeedBuffer {
                reason: format!(
                    "{fetches} outputs asked for, {} in the reply and none in the reply slot (was it written while the Run was in flight?)",
                    outputs.len()
                ),
            }),
        }
    }

    /// Takes the replies already on the socket without waiting: earlier
    /// Runs' that their reply slots answered (dropped; their shared areas
    /// released) and those of Runs submitted ahead (kept for their waits).
    /// A client whose Runs are all answered from their slots would never
    /// read the socket otherwise: its queue fills, and the service drops
    /// the replies after it (`a client does not read its replies`), among
    /// them one a later wait needs.
    fn drain_replies(&mut self, sent: &Sent) {
        while matches!(self.conn.socket.poll(zmq::POLLIN, 0), Ok(n) if n > 0) {
            if self.take_reply(sent, None).is_err() {
                break;
            }
        }
    }

    /// Sleeps until `wake` on the socket, taking (and dropping) the
    /// replies of earlier Runs that arrive meanwhile: `Some` with `sent`'s
    /// reply if it came. ZeroMQ's poll counts milliseconds; the rest, under
    /// one, is a plain sleep (a reply then waits for its end, which comes
    /// before the reply is expected).
    fn sleep_until(
        &mut self,
        sent: &Sent,
        wake: Instant,
    ) -> Result<Option<Result<Reply, ClientError>>, ClientError> {
        loop {
            let left = wake.saturating_duration_since(Instant::now());
            let ms = i64::try_from(left.as_millis()).unwrap_or(i64::MAX);
            if ms == 0 {
                if !left.is_zero() {
                    std::thread::sleep(left);
                }
                return Ok(None);
            }
            if self.conn.socket.poll(zmq::POLLIN, ms)? == 0 {
                continue;
            }
            if let Some(r) = self.take_reply(sent, None)? {
                return Ok(Some(r));
            }
        }
    }

    /// [`Client::run_buffers_in`] without waiting: the buffers stay
    /// borrowed (the service reads them while the Run is queued and runs)
    /// until [`Client::wait_buffer_run`] takes the result.
    pub fn submit_run_buffers_in<'b>(
        &mut self,
        buffers: &'b mut FeedBuffers,
        fetches: &[&str],
    ) -> Result<PendingBufferRun<'b>, ClientError> {
        let sent = self.send_buffers(buffers, fetches)?;
        self.ahead.insert(sent.id);
        Ok(PendingBufferRun {
            run: PendingRun { sent },
            buffers,
            fetches: fetches.len(),
        })
    }

    /// The fetched tensors of a Run sent with
    /// [`Client::submit_run_buffers_in`]; its buffers may be written again.
    pub fn wait_buffer_run(
        &mut self,
        run: PendingBufferRun<'_>,
    ) -> Result<Vec<Tensor>, ClientError> {
        let outputs = self.receive_buffers(&run.run.sent, run.buffers, run.fetches)?;
        run.buffers.take(outputs)
    }

    fn send_buffers(
        &mut self,
        buffers: &mut FeedBuffers,
        fetches: &[&str],
    ) -> Result<Sent, ClientError> {
        let fetches: Vec<String> = fetches.iter().map(|s| s.to_string()).collect();
        let place = |(offset, bytes): (usize, usize)| wire::SlotRange {
            offset: offset as u64,
            bytes: bytes as u64,
        };
        // The doorbell only while nothing else of this client's is under
        // way: a Run taken from it may not overtake an earlier request.
        let bell = buffers.bell.filter(|_| {
            self.options.doorbell && !self.options.busy_poll.is_zero() && self.ahead.is_empty()
        });
        let areas = wire::SharedAreas {
            reply: buffers.slot.map(place),
            doorbell: bell.map(place),
        };
        let (session, segment) = (buffers.session, buffers.seg.id());
        let FeedBuffers { feeds, seg, .. } = buffers;
        let feeds = feeds.iter().map(|(n, ty, at)| (n.as_str(), ty, *at));
        self.send_encoded("run", |id| {
            let frames = wire::encode_shared_run(id, session, feeds, segment, areas, &fetches)?;
            if let (Some((at, len)), [frame]) = (bell, frames.as_slice()) {
                seg.ring(at, len, id, frame);
            }
            Ok(frames)
        })
    }
}

/// Buffers for a session's feeds in a segment shared with the service (a
/// job on the service's host): the job writes each iteration's inputs in
/// place, once, and a Run carries only a header; the service reads the
/// values where they are (on the GPU: one DMA from this memory, which it
/// registers page-locked). Made by [`Session::feed_buffers`]; write with
/// [`FeedBuffers::f32s_mut`], [`FeedBuffers::i64s_mut`] or
/// [`FeedBuffers::write`], run with [`Session::run_buffers`].
pub struct FeedBuffers {
    pub(super) session: SessionId,
    seg: OwnedSegment,
    /// Name, type and offset in the segment of each feed.
    feeds: Vec<(String, TensorType, u64)>,
    /// Offset and length of the reply slot, if any.
    slot: Option<(usize, usize)>,
    /// Offset and length of the doorbell, if any.
    bell: Option<(usize, usize)>,
    /// The slot's bytes a Run's outputs needed, when they did not fit.
    wanted: Option<usize>,
    /// How long the last Runs from these buffers took, send to outputs:
    /// what the next wait expects (see [`wait::plan`]).
    trips: wait::RoundTrips,
}

impl std::fmt::Debug for FeedBuffers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FeedBuffers")
            .field("session", &self.session)
            .field("segment", &self.seg.id())
            .field("feeds", &self.feeds)
            .finish()
    }
}

impl FeedBuffers {
    /// The feeds' names and types, in the order given.
    pub fn feeds(&self) -> impl Iterator<Item = (&str, &TensorType)> {
        self.feeds.iter().map(|(n, ty, _)| (n.as_str(), ty))
    }

    /// Bytes of the reply slot (zero: none).
    pub fn reply_bytes(&self) -> usize {
        self.slot.map_or(0, |(_, b)| b)
    }

    /// When a Run's outputs did not fit the reply slot (they came in the
    /// socket reply): the slot's bytes that would have held them. Buffers
    /// made again with that much ([`Client::feed_buffers_with_reply_in`])
    /// take such outputs from the slot.
    pub fn reply_wanted(&self) -> Option<usize> {
        self.wanted
    }

    /// The bytes of feed `name`, and its type.
    fn bytes_mut(&mut self, name: &str) -> Result<(&mut [u8], &TensorType), ClientError> {
        let Some((_, ty, at)) = self.feeds.iter().find(|f| f.0 == name) else {
            return Err(ClientError::FeedBuffer {
                reason: format!("no buffer for feed `{name}`"),
            });
        };
        let at = *at as usize;
        let len = ty.bytes();
        let bytes =
            self.seg
                .bytes_mut()
                .get_mut(at..at + len)
                .ok_or_else(|| ClientError::FeedBuffer {
                    reason: format!("feed `{name}` lies outside its segment"),
                })?;
        Ok((bytes, ty))
    }

    /// Feed `name`'s bytes (native-endian values, row-major) and its
    /// type, to write in place whatever its element type.
    pub fn ne_bytes_mut(&mut self, name: &str) -> Result<(&mut [u8], &TensorType), ClientError> {
        self.bytes_mut(name)
    }

    /// Feed `name`'s values, to write in place (an f32 feed).
    pub fn f32s_mut(&mut self, name: &str) -> Result<&mut [f32], ClientError> {
        let (bytes, ty) = self.bytes_mut(name)?;
        if ty.dtype != DType::F32 {
            return Err(ClientError::FeedBuffer {
                reason: format!("feed `{name}` is {ty}, not f32"),
            });
        }
        // Offsets are multiples of 64 bytes in a page-aligned mapping.
        bytemuck::try_cast_slice_mut(bytes).map_err(|e| ClientError::FeedBuffer {
            reason: format!("feed `{name}`: {e}"),
        })
    }

    /// Feed `name`'s values, to write in place (an i64 feed).
    pub fn i64s_mut(&mut self, name: &str) -> Result<&mut [i64], ClientError> {
        let (bytes, ty) = self.bytes_mut(name)?;
        if ty.dtype != DType::I64 {
            return Err(ClientError::FeedBuffer {
                reason: format!("feed `{name}` is {ty}, not i64"),
            });
        }
        bytemuck::try_cast_slice_mut(bytes).map_err(|e| ClientError::FeedBuffer {
            reason: format!("feed `{name}`: {e}"),
        })
    }

    /// Where feed `name`'s values lie in the segment (bytes from its
    /// start) and its type.
    pub fn feed_place(&self, name: &str) -> Option<(usize, &TensorType)> {
        let (_, ty, at) = self.feeds.iter().find(|f| f.0 == name)?;
        Some((usize::try_from(*at).ok()?, ty))
    }

    /// The values of an output a Run left in the reply slot (one of
    /// [`BufferOutputs::InSlot`]'s ranges): valid until the next Run from
    /// these buffers is sent.
    pub fn output_bytes(&self, range: std::ops::Range<usize>) -> Option<&[u8]> {
        self.seg.bytes().get(range)
    }

    /// Bytes of the whole segment (feeds, reply slot, doorbell).
    pub fn segment_len(&self) -> usize {
        self.seg.len()
    }

    /// Another descriptor of the segment's memory, to map it again (see
    /// [`OwnedSegment::file`]): a mapping of it stays valid after these
    /// buffers are dropped.
    pub fn segment_file(&self) -> Result<std::fs::File, ClientError> {
        self.seg.file().map_err(|e| ClientError::NoSharedMemory {
            reason: e.to_string(),
        })
    }

    /// `outputs` as tensors (those in the reply slot copied out of it).
    pub fn take(&self, outputs: BufferOutputs) -> Result<Vec<Tensor>, ClientError> {
        match outputs {
            BufferOutputs::Sent(t) => Ok(t),
            BufferOutputs::InSlot(places) => {
                wire::slot_outputs(self.seg.bytes(), &places).map_err(|e| ClientError::FeedBuffer {
                    reason: format!("the reply slot: {e}"),
                })
            }
        }
    }

    /// Copies `value` into feed `name`'s buffer (types must match).
    pub fn write(&mut self, name: &str, value: &Tensor) -> Result<(), ClientError> {
        let (bytes, ty) = self.bytes_mut(name)?;
        if *ty != value.ty() {
            return Err(ClientError::FeedBuffer {
                reason: format!("feed `{name}` is {ty}, the value {}", value.ty()),
            });
        }
        bytes.copy_from_slice(value.data().ne_bytes());
        Ok(())
    }
}

/// Where a Run from feed buffers left its outputs.
#[derive(Debug, Clone, PartialEq)]
pub enum BufferOutputs {
    /// In the socket reply (no reply slot, or they did not fit it).
    Sent(Vec<Tensor>),
    /// In the buffers' reply slot: each output's type and the range of
    /// its values (little-endian, row-major) in the segment, read with
    /// [`FeedBuffers::output_bytes`] or [`FeedBuffers::take`].
    InSlot(Vec<(TensorType, std::ops::Range<usize>)>),
}

/// A Run sent from feed buffers and not yet waited for: the buffers stay
/// borrowed until [`Session::wait_buffer_run`].
#[derive(Debug)]
pub struct PendingBufferRun<'b> {
    run: PendingRun,
    buffers: &'b mut FeedBuffers,
    fetches: usize,
}
